//! Broker addresses: `FORGEPOOL_AMQP_URL` is one URL or a comma-separated list of a cluster's
//! nodes (as RabbitMQ's own clients take them), and every connection forgepool opens goes to
//! the first node of the list that answers, starting with the one that answered last.
//!
//! An entry after the first may be a bare `host[:port]`: it takes the first URL's scheme,
//! credentials, virtual host and query. A failover is a new connection like any other: each
//! user of a connection (consumers, the publisher, the ledger, leases) already reconnects and
//! declares its topology again after a lost one, and publisher confirms keep their meaning
//! (a confirm that never came is a publish that is retried; the store's idempotency absorbs
//! the copy).

use std::sync::atomic::{AtomicUsize, Ordering};

use lapin::types::LongString;
use lapin::{Connection, ConnectionProperties};

use super::{AmqpError, CONNECT_TIMEOUT};

/// The largest AMQP frame forgepool asks for, unless the URL sets `frame_max` itself. The
/// client keeps two buffers of 32 frames per connection and fills them with zeros, so the
/// broker's default (128 KiB) costs 8 MiB of resident memory per connection; 8 KiB frames
/// cost 512 KiB. Messages of any size still pass: a body is split into frames.
pub const FRAME_MAX: u32 = 8192;

/// The node of the list that answered last: the first one tried by the next connection, so
/// that after a failover a process's connections stay together on the node that is up.
static PREFERRED: AtomicUsize = AtomicUsize::new(0);

/// Connection properties that run lapin on the current tokio runtime.
pub fn connection_properties(name: &str) -> ConnectionProperties {
    ConnectionProperties::default().with_connection_name(LongString::from(name.to_string()))
}

/// `url` with `frame_max=`[`FRAME_MAX`] added to its query, unless it has one.
pub fn with_frame_max(url: &str) -> String {
    if url.contains("frame_max=") {
        return url.to_string();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}frame_max={FRAME_MAX}")
}

/// The node URLs of `list` (one URL, or several separated by commas), in its order. A bare
/// `host[:port]` entry takes the first URL's scheme, credentials, virtual host and query.
pub fn broker_urls(list: &str) -> Vec<String> {
    let entries: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    let Some(first) = entries.first() else {
        return vec![String::new()];
    };
    let (scheme, rest) = first.split_once("://").unwrap_or(("amqp", first));
    let (credentials, rest) = match rest.rsplit_once('@') {
        Some((credentials, rest)) => (Some(credentials), rest),
        None => (None, rest),
    };
    let tail = rest.find(['/', '?']).map_or("", |at| &rest[at..]);
    entries
        .iter()
        .map(|entry| {
            if entry.contains("://") {
                entry.to_string()
            } else {
                let user = credentials.map(|c| format!("{c}@")).unwrap_or_default();
                format!("{scheme}://{user}{entry}{tail}")
            }
        })
        .collect()
}

/// A broker URL or list (or any text holding URLs) with every password hidden, for messages
/// and logs. After each `://`, everything up to the last `@` before the next URL or space
/// loses what follows the user: a password with a comma, a slash or an `@` in it is hidden
/// whole (an `@` in a path hides more than it needs to, never less).
pub fn redact_url(text: &str) -> String {
    let mut shown = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(scheme) = rest.find("://") {
        let (before, after) = rest.split_at(scheme + 3);
        shown.push_str(before);
        let next = after.find("://").unwrap_or(after.len());
        let end = after[..next].find(char::is_whitespace).unwrap_or(next);
        let span = &after[..end];
        match span.rfind('@') {
            Some(at) => {
                let user = span[..at].split(':').next().unwrap_or("");
                shown.push_str(user);
                shown.push_str(":***");
                shown.push_str(&span[at..]);
            }
            None => shown.push_str(span),
        }
        rest = &after[end..];
    }
    shown.push_str(rest);
    shown
}

/// Opens a connection to a node of `list` (see the module), each node within
/// [`CONNECT_TIMEOUT`]. The error names every node tried and why it failed.
pub async fn connect(list: &str, name: &str) -> Result<Connection, AmqpError> {
    let urls = broker_urls(list);
    let start = PREFERRED.load(Ordering::Relaxed) % urls.len();
    let mut failures = Vec::new();
    for index in (start..urls.len()).chain(0..start) {
        let url = &urls[index];
        match tokio::time::timeout(
            CONNECT_TIMEOUT,
            Connection::connect(&with_frame_max(url), connection_properties(name)),
        )
        .await
        {
            Ok(Ok(connection)) => {
                if index != start {
                    tracing::info!(node = %redact_url(url), "connected to another RabbitMQ node");
                }
                PREFERRED.store(index, Ordering::Relaxed);
                return Ok(connection);
            }
            Ok(Err(error)) => failures.push(format!("{}: {error}", redact_url(url))),
            Err(_) => failures.push(format!(
                "{}: no answer within {CONNECT_TIMEOUT:?}",
                redact_url(url)
            )),
        }
    }
    Err(AmqpError::Connect {
        url: redact_url(list),
        detail: failures.join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_password() {
        assert_eq!(
            redact_url("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(redact_url("amqp://host"), "amqp://host");
    }

    #[test]
    fn urls_ask_for_small_frames_unless_they_say_otherwise() {
        assert_eq!(
            with_frame_max("amqp://h:5672/%2f"),
            "amqp://h:5672/%2f?frame_max=8192"
        );
        assert_eq!(
            with_frame_max("amqp://h/%2f?heartbeat=30"),
            "amqp://h/%2f?heartbeat=30&frame_max=8192"
        );
        assert_eq!(
            with_frame_max("amqp://h/%2f?frame_max=65536"),
            "amqp://h/%2f?frame_max=65536"
        );
    }

    /// Catches: a list taken for one URL (every connection refused), a bare node that loses
    /// the credentials, virtual host or query of the first (a login refused, the wrong vhost,
    /// a worker's heartbeat dropped), and a password left in a message.
    #[test]
    fn a_list_of_nodes_is_read_and_redacted() {
        let list =
            "amqps://fp:s3cret@rabbit-0:5671/pool?heartbeat=60, rabbit-1:5671 ,amqp://o:pw@other/";
        assert_eq!(
            broker_urls(list),
            [
                "amqps://fp:s3cret@rabbit-0:5671/pool?heartbeat=60",
                "amqps://fp:s3cret@rabbit-1:5671/pool?heartbeat=60",
                "amqp://o:pw@other/",
            ]
        );
        assert_eq!(
            broker_urls("amqp://127.0.0.1:5672"),
            ["amqp://127.0.0.1:5672"]
        );
        assert_eq!(broker_urls("amqp://h1,h2"), ["amqp://h1", "amqp://h2"]);
        let shown = redact_url(list);
        assert!(
            !shown.contains("s3cret") && !shown.contains(":pw@"),
            "{shown}"
        );
        assert!(shown.contains("fp:***@rabbit-0") && shown.contains("rabbit-1:5671"));
        // A password with a comma or an `@` in it (unencoded) is hidden whole; so is one of a
        // multi-host PostgreSQL URL.
        for (url, secret) in [
            ("amqp://u:pa,ss@h/%2f", "pa,ss"),
            ("amqp://u:p@ss@h:5672", "p@ss"),
            ("amqp://u:pa/ss@h/%2f", "pa/ss"),
            (
                "postgres://fp:pg-secret@db-0,db-1/forgepool?sslmode=require",
                "pg-secret",
            ),
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains(secret), "{shown}");
            assert!(shown.contains(":***@"), "{shown}");
        }
    }

    /// Catches: a connection that stops at the first node of the list when it is down, and an
    /// error that hides which nodes were tried.
    #[tokio::test]
    async fn a_node_that_is_down_is_passed_over_and_every_failure_is_named() {
        let closed = || {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let (a, b) = (closed(), closed());
        let error = connect(
            &format!("amqp://u:secret@127.0.0.1:{a}/%2f,127.0.0.1:{b}"),
            "test",
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            error.contains(&format!("127.0.0.1:{a}")) && error.contains(&format!("127.0.0.1:{b}")),
            "{error}"
        );
        assert!(!error.contains("secret"), "{error}");
    }
}
