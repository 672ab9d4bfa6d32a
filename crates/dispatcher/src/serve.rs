//! The dispatcher's HTTP server: hyper under the axum router, with the limits a public API
//! needs and `axum::serve` has no setting for.
//!
//! - at most [`MAX_CONNECTIONS`] connections at once: the next one waits in the kernel's
//!   backlog until one closes, so no number of idle clients exhausts the process;
//! - a request's headers must arrive within [`HEADER_READ_TIMEOUT`], and so must the next
//!   request's on a kept-alive connection: a half-open or idle connection is closed;
//! - a request's head is read into a buffer of at most [`MAX_HEAD_BYTES`].
//!
//! Bodies are read by the handlers that take one, within a time and size limit
//! (`http::read_body`). At shutdown every connection is asked to finish its request and close.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

/// The most connections served at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// The time a client has to send a request's headers, from the moment the connection is idle.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest request head (request line and headers).
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Serves `app` on `listener` until `shutdown`, then lets the requests in flight finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let connections = TaskTracker::new();
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors, say: wait a little instead of spinning.
                    warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let _permit = permit;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
    connections.close();
    connections.wait().await;
    Ok(())
}
