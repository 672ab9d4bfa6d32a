//! The gateway's listeners: each connection's sender (the relay's preface, or a TCP peer)
//! held to its share of connections (`conns`), an idle keep-alive connection closed so that it
//! does not hold its place, and every request handed to the server (`server`).

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

use crate::conns::{first_byte, Senders};
use crate::server::{handle, Body, REQUEST_TIMEOUT};
use crate::{Gateway, PEER_PREFACE};

/// The time the relay has to send its preface.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves relay connections on a Unix socket until `shutdown`: each starts with the relay's
/// preface naming the container that connected, whose share of connections it takes.
pub async fn serve_unix(
    listener: UnixListener,
    gateway: Arc<Gateway>,
    shutdown: CancellationToken,
) {
    let senders = Arc::new(Senders::default());
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "the gateway cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (gateway, shutdown, senders) =
            (Arc::clone(&gateway), shutdown.clone(), Arc::clone(&senders));
        tokio::spawn(async move {
            let mut stream = stream;
            let Ok(Some(peer)) = tokio::time::timeout(PREFACE_TIMEOUT, preface(&mut stream)).await
            else {
                return;
            };
            let Some(place) = senders.place(peer).await else {
                return;
            };
            connection(TokioIo::new(stream), gateway, peer, shutdown).await;
            drop(place);
        });
    }
}

/// Serves TCP clients until `shutdown`, each known by its address (tests and benchmarks;
/// a worker serves stages through [`serve_unix`]).
pub async fn serve_tcp(listener: TcpListener, gateway: Arc<Gateway>, shutdown: CancellationToken) {
    let senders = Arc::new(Senders::default());
    loop {
        let (stream, address) = tokio::select! {
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
        let (gateway, shutdown, senders) =
            (Arc::clone(&gateway), shutdown.clone(), Arc::clone(&senders));
        tokio::spawn(async move {
            if !first_byte(&stream).await {
                return;
            }
            let Some(place) = senders.place(address.ip()).await else {
                return;
            };
            connection(TokioIo::new(stream), gateway, address.ip(), shutdown).await;
            drop(place);
        });
    }
}

async fn connection<I>(
    io: TokioIo<I>,
    gateway: Arc<Gateway>,
    peer: IpAddr,
    shutdown: CancellationToken,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::default());
    let service = {
        let activity = Arc::clone(&activity);
        hyper::service::service_fn(move |request| {
            let gateway = Arc::clone(&gateway);
            let guard = activity.begin();
            async move {
                let mut response = handle(&gateway, peer, request).await;
                response.headers_mut().insert(
                    HeaderName::from_static("keep-alive"),
                    HeaderValue::from_static(KEEP_ALIVE_HINT),
                );
                Ok::<_, Infallible>(response.map(|body| {
                    Guarded {
                        body,
                        _guard: guard,
                    }
                    .boxed_unsync()
                }))
            }
        })
    };
    let served = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Some(REQUEST_TIMEOUT))
        .max_buf_size(64 * 1024)
        .serve_connection(io, service);
    tokio::pin!(served);
    let mut ticks = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = &mut served => return,
            () = shutdown.cancelled() => break,
            _ = ticks.tick() => {
                if activity.idle_for() >= KEEP_ALIVE_IDLE {
                    break;
                }
            }
        }
    }
    served.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(5), served).await;
}

/// How long a connection may stay open with no request on it: it holds its sender's place.
/// Answers say a little less (`keep-alive: timeout=`), so that clients which read it (Node's)
/// close first and never send on a connection the gateway is closing.
const KEEP_ALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEP_ALIVE_HINT: &str = "timeout=25";

/// A connection's requests in flight (a request counts until its answer's body is done), and
/// since when it has had none.
#[derive(Debug)]
struct Activity {
    state: std::sync::Mutex<(usize, Instant)>,
}

impl Default for Activity {
    fn default() -> Activity {
        Activity {
            state: std::sync::Mutex::new((0, Instant::now())),
        }
    }
}

impl Activity {
    fn begin(self: &Arc<Activity>) -> InFlight {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0 += 1;
        InFlight(Arc::clone(self))
    }

    fn idle_for(&self) -> Duration {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.0 > 0 {
            Duration::ZERO
        } else {
            state.1.elapsed()
        }
    }
}

/// One request in flight on a connection.
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        state.0 = state.0.saturating_sub(1);
        state.1 = Instant::now();
    }
}

/// An answer's body that keeps its request in flight until it is done.
struct Guarded {
    body: Body,
    _guard: InFlight,
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Reads the relay's `FORGEPOOL-PEER address\n` line, byte by byte so that none of the HTTP
/// request behind it is consumed.
async fn preface(stream: &mut tokio::net::UnixStream) -> Option<IpAddr> {
    let mut line = Vec::with_capacity(64);
    loop {
        let byte = stream.read_u8().await.ok()?;
        if byte == b'\n' {
            break;
        }
        if line.len() >= 64 {
            return None;
        }
        line.push(byte);
    }
    let text = std::str::from_utf8(&line).ok()?;
    text.strip_prefix(PEER_PREFACE)?.trim().parse().ok()
}
