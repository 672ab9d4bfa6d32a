//! A TCP proxy the harness puts between a worker and RabbitMQ, to cut the worker off and heal
//! it again. A cut is a partition as a dropped route makes it: bytes stop flowing both ways
//! and nothing is closed, so neither side learns of it but by its own timeouts. Healing
//! closes every connection made before (their peers have long given up on them) and forwards
//! new ones again.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    cut: bool,
    /// Bumped at each heal: connections of an older epoch are closed.
    epoch: u64,
}

/// A proxy on a loopback port to `target`.
pub struct Proxy {
    /// The loopback port to connect to instead of the target.
    pub port: u16,
    state: Arc<watch::Sender<State>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Starts forwarding a free loopback port to `target` (`host:port`).
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(watch::Sender::new(State {
            cut: false,
            epoch: 0,
        }));
        let target = target.to_string();
        let shared = Arc::clone(&state);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(connection(client, target.clone(), shared.subscribe()));
            }
        });
        Proxy {
            port,
            state,
            accept,
        }
    }

    /// Cuts every connection, open or new, off from the target: bytes are dropped both ways.
    pub fn sever(&self) {
        self.state.send_modify(|state| state.cut = true);
    }

    /// Ends the cut: the connections made before are closed, new ones are forwarded.
    pub fn heal(&self) {
        self.state.send_modify(|state| {
            state.cut = false;
            state.epoch += 1;
        });
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn connection(client: TcpStream, target: String, mut state: watch::Receiver<State>) {
    let epoch = state.borrow().epoch;
    if state.borrow().cut {
        // Accepted during the cut: held open and silent until the heal closes it.
        let _ = state.wait_for(|now| now.epoch != epoch).await;
        return;
    }
    let Ok(upstream) = TcpStream::connect(&target).await else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    tokio::join!(
        pipe(client_read, upstream_write, state.clone(), epoch),
        pipe(upstream_read, client_write, state, epoch),
    );
}

/// Copies one direction of a connection; during a cut the bytes are dropped and an end of
/// stream is not passed on (the peer must not learn of it), and a heal closes it.
async fn pipe(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut state: watch::Receiver<State>,
    epoch: u64,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            read = from.read(&mut buffer) => {
                let now = *state.borrow();
                if now.epoch != epoch {
                    return;
                }
                let n = match read {
                    Ok(n) if n > 0 => n,
                    _ if now.cut => {
                        let _ = state.wait_for(|now| now.epoch != epoch).await;
                        return;
                    }
                    _ => return,
                };
                if !now.cut && to.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
            changed = state.changed() => {
                if changed.is_err() || state.borrow().epoch != epoch {
                    return;
                }
            }
        }
    }
}
