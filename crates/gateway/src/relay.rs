//! The relay: the gateway's only door on a worker's internal network.
//!
//! Stage containers have no route to the worker's host, and must not get one. The relay is a
//! container (`forgepool gateway-relay`, forgepool's own image) attached to the internal
//! network only, with the gateway's socket folder mounted: it accepts a stage's TCP
//! connection, opens the gateway's Unix socket, sends one preface line naming the stage's
//! address (which the gateway checks against the token's container), then copies bytes both
//! ways. It holds no key and no token, and reaches nothing but the socket. Each sender gets
//! its share of connections and no more (`conns`): a stage that opens a thousand idle ones
//! waits on its own, while every other stage's calls go through.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::conns::{first_byte, Senders};
use crate::PEER_PREFACE;

/// Relays connections from `listener` to the gateway's socket until `shutdown`.
pub async fn relay(listener: TcpListener, socket: PathBuf, shutdown: CancellationToken) {
    let socket = Arc::new(socket);
    let senders = Arc::new(Senders::default());
    loop {
        let (mut stream, peer) = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (socket, senders) = (Arc::clone(&socket), Arc::clone(&senders));
        tokio::spawn(async move {
            if !first_byte(&stream).await {
                return;
            }
            let Some(place) = senders.place(peer.ip()).await else {
                return;
            };
            if let Ok(mut gateway) = UnixStream::connect(socket.as_path()).await {
                if gateway.write_all(preface(peer).as_bytes()).await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut stream, &mut gateway).await;
                }
            }
            drop(place);
        });
    }
}

/// The line naming a connection's sender.
pub fn preface(peer: SocketAddr) -> String {
    format!("{PEER_PREFACE}{}\n", peer.ip())
}
