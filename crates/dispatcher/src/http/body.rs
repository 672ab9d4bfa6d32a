//! Request bodies: read within a time and a size, refused bodies drained briefly.
//!
//! A body must arrive within 15 s and 1 MiB.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};

use crate::SubmitError;

use super::problem::Failure;
use super::BODY_READ_TIMEOUT;

/// Reads a request body of at most `limit` bytes within [`BODY_READ_TIMEOUT`]. A larger body
/// is refused as soon as its size is known, whatever it is, with the same JSON error as a
/// request over the limit; a slow one gets a JSON 408.
pub(super) async fn read_body(
    headers: &HeaderMap,
    body: axum::body::Body,
    limit: usize,
) -> Result<Bytes, Failure> {
    let too_large = |size: usize| -> Failure {
        SubmitError::TooLarge {
            field: "body".into(),
            size,
            limit,
        }
        .into()
    };
    // An announced size over the limit is refused before a byte of the body is read.
    if let Some(announced) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        if announced > limit as u64 {
            drain(body, announced).await;
            return Err(too_large(usize::try_from(announced).unwrap_or(usize::MAX)));
        }
    }
    match tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(Failure::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!(
                "the request body did not arrive within {} s",
                BODY_READ_TIMEOUT.as_secs()
            ),
            None,
        )),
        Ok(Ok(bytes)) => Ok(bytes),
        // Over the limit, or the client went away mid-body.
        Ok(Err(_)) => Err(too_large(limit + 1)),
    }
}

/// The most of a refused body read and dropped before the answer.
const DRAIN_BYTES: u64 = 8 * 1024 * 1024;
/// How long a refused body is read before the answer.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads and drops a refused body of `announced` bytes when it is at most [`DRAIN_BYTES`],
/// for at most [`DRAIN_TIME`], holding no more than one chunk: a client that sends a body a
/// little over the limit finishes writing and reads the answer, instead of a broken pipe.
async fn drain(body: axum::body::Body, announced: u64) {
    use futures_util::StreamExt;
    if announced > DRAIN_BYTES {
        return;
    }
    let mut chunks = body.into_data_stream();
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut read = 0u64;
        while let Some(Ok(chunk)) = chunks.next().await {
            read += chunk.len() as u64;
            if read > DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}
