//! The egress proxy: the only way out for a stage whose profile says `network = "egress"`.
//!
//! Such a stage is attached to an internal Docker network with no route anywhere; the only
//! other members are the worker's proxy containers, each running `forgepool egress-proxy` for
//! one allowlist (a profile's `egress` entries). The stage gets `HTTPS_PROXY`/`HTTP_PROXY`
//! naming its proxy with a token; the proxy answers only that token, and opens a connection
//! only to a `host:port` of its allowlist: `CONNECT host:port` for TLS, an absolute-form
//! request for plain HTTP. A host name is resolved by the proxy, and refused when it resolves
//! to the worker's host, a private network, or a link-local (cloud metadata) address, so DNS
//! cannot smuggle a stage inside; an entry that is an IP address is the operator's explicit
//! choice and is allowed, except link-local ones, which never are.
//!
//! Why a proxy of forgepool's own, in a container per allowlist on an internal network without a
//! host address: the worker may run in a pod without `NET_ADMIN`, so no firewall rules are
//! needed, and Docker's own isolation carries the boundary. A token per proxy keeps one profile
//! from borrowing another's allowlist.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// The port every proxy listens on inside its container.
pub const PROXY_PORT: u16 = 3128;
/// The user name in the proxy URL a stage gets; the token is its password.
pub const PROXY_USER: &str = "forgepool";
/// The environment variable holding a proxy's token.
pub const ENV_TOKEN: &str = "FORGEPOOL_EGRESS_TOKEN";
/// The environment variable holding a proxy's allowlist, comma-separated.
pub const ENV_ALLOW: &str = "FORGEPOOL_EGRESS_ALLOW";
/// The largest request head the proxy reads.
const MAX_HEAD: usize = 16 * 1024;
/// The time a client has to send its request head, and a connection to the target to open.
const STEP_TIMEOUT: Duration = Duration::from_secs(15);
/// The most tunnels one proxy keeps open.
const MAX_TUNNELS: usize = 256;

/// The hosts one proxy may connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowlist(Vec<(Pattern, u16)>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    /// This host name exactly (lowercased).
    Host(String),
    /// Any subdomain of this domain (`*.example.com`), not the domain itself.
    Subdomains(String),
    /// This address: the operator named it, so it may be private (never link-local).
    Address(IpAddr),
}

impl Allowlist {
    /// Parses `host:port` entries (see [`proto::check_egress_entry`]).
    pub fn parse(entries: &[String]) -> Result<Allowlist, String> {
        let mut rules = Vec::new();
        for entry in entries {
            proto::check_egress_entry(entry)?;
            let (host, port) = entry.rsplit_once(':').unwrap_or((entry, "0"));
            let port: u16 = port.parse().map_err(|_| format!("{entry:?}: bad port"))?;
            let host = host.to_ascii_lowercase();
            let pattern = if let Some(domain) = host.strip_prefix("*.") {
                Pattern::Subdomains(domain.to_string())
            } else if let Ok(address) = host.parse::<IpAddr>() {
                Pattern::Address(address)
            } else {
                Pattern::Host(host)
            };
            rules.push((pattern, port));
        }
        Ok(Allowlist(rules))
    }

    /// The rule that lets `host:port` through, if one does.
    fn rule_for(&self, host: &str, port: u16) -> Option<&Pattern> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let address = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok();
        self.0.iter().find_map(|(pattern, allowed)| {
            let matches = *allowed == port
                && match pattern {
                    Pattern::Host(name) => *name == host,
                    Pattern::Subdomains(domain) => {
                        host.len() > domain.len() + 1
                            && host.ends_with(domain.as_str())
                            && host.as_bytes()[host.len() - domain.len() - 1] == b'.'
                    }
                    Pattern::Address(allowed) => address == Some(*allowed),
                };
            matches.then_some(pattern)
        })
    }

    /// Where `host:port` may be reached, or why not: the allowlist, then the addresses.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
        let Some(pattern) = self.rule_for(host, port) else {
            return Err(format!("{host}:{port} is not an allowed egress host"));
        };
        if let Pattern::Address(address) = pattern {
            if link_local(*address) || address.is_unspecified() {
                return Err(format!(
                    "{address} is a link-local address, never reachable"
                ));
            }
            return Ok(vec![SocketAddr::new(*address, port)]);
        }
        let found: Vec<SocketAddr> =
            tokio::time::timeout(STEP_TIMEOUT, tokio::net::lookup_host((host, port)))
                .await
                .map_err(|_| format!("{host} did not resolve in time"))?
                .map_err(|e| format!("{host} does not resolve: {e}"))?
                .collect();
        if found.is_empty() {
            return Err(format!("{host} has no address"));
        }
        if let Some(inside) = found.iter().find(|a| !public(a.ip())) {
            return Err(format!(
                "{host} resolves to {}, an address of the host, a private network or a link-local range",
                inside.ip()
            ));
        }
        Ok(found)
    }
}

/// Whether an address is on the public internet: not loopback, private, shared (CGNAT),
/// link-local, unspecified, broadcast, multicast, documentation or unique-local.
pub fn public(address: IpAddr) -> bool {
    match address {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && v4.octets()[2] == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return public(IpAddr::V4(v4));
            }
            let segments = v6.segments();
            let first = segments[0];
            // Addresses that embed an IPv4 address: judged by it.
            let embedded = match segments {
                [0, 0, 0, 0, 0, 0, high, low] if high != 0 => Some((high, low)),
                [0x0064, 0xff9b, 0, 0, 0, 0, high, low] => Some((high, low)),
                [0x2002, high, low, ..] => Some((high, low)),
                _ => None,
            };
            if let Some((high, low)) = embedded {
                let [a, b] = high.to_be_bytes();
                let [c, d] = low.to_be_bytes();
                return public(IpAddr::V4(std::net::Ipv4Addr::new(a, b, c, d)));
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || (first & 0xffc0) == 0xfec0)
        }
    }
}

fn link_local(address: IpAddr) -> bool {
    match address {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// Serves the proxy on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    token: String,
    allow: Allowlist,
    shutdown: CancellationToken,
) {
    let expected = Arc::new(format!(
        "Basic {}",
        base64(format!("{PROXY_USER}:{token}").as_bytes())
    ));
    let allow = Arc::new(allow);
    let tunnels = Arc::new(Semaphore::new(MAX_TUNNELS));
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&tunnels).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            () = shutdown.cancelled() => return,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => return,
        };
        let (expected, allow) = (Arc::clone(&expected), Arc::clone(&allow));
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(error) = handle(stream, &expected, &allow).await {
                tracing::info!(%error, "egress connection ended");
            }
        });
    }
}

/// One client connection: its request head, the checks, then a tunnel.
async fn handle(mut client: TcpStream, expected: &str, allow: &Allowlist) -> std::io::Result<()> {
    let (head, rest) = match tokio::time::timeout(STEP_TIMEOUT, read_head(&mut client)).await {
        Ok(Ok(read)) => read,
        Ok(Err(error)) => return Err(error),
        Err(_) => return refuse(&mut client, 408, "the request head did not arrive in time").await,
    };
    let text = String::from_utf8_lossy(&head).to_string();
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_string();
    let headers: Vec<&str> = lines.take_while(|l| !l.is_empty()).collect();
    let authorized = headers.iter().any(|h| {
        h.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("proxy-authorization")
                && constant_time_eq(value.trim().as_bytes(), expected.as_bytes())
        })
    });
    if !authorized {
        return refuse(
            &mut client,
            407,
            "this proxy needs the stage's own proxy URL",
        )
        .await;
    }
    let mut parts = request_line.split_whitespace();
    let (method, target, version) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or("HTTP/1.1"),
    );
    let connect = method.eq_ignore_ascii_case("CONNECT");
    let (host, port, path) = if connect {
        match split_host_port(target, 443) {
            Some((host, port)) => (host, port, String::new()),
            None => return refuse(&mut client, 400, "CONNECT needs host:port").await,
        }
    } else {
        let Some(rest_of_url) = target.strip_prefix("http://") else {
            return refuse(
                &mut client,
                400,
                "only CONNECT and http:// requests are proxied",
            )
            .await;
        };
        let (authority, path) = match rest_of_url.find('/') {
            Some(at) => (&rest_of_url[..at], rest_of_url[at..].to_string()),
            None => (rest_of_url, "/".to_string()),
        };
        match split_host_port(authority, 80) {
            Some((host, port)) => (host, port, path),
            None => return refuse(&mut client, 400, "the request names no host").await,
        }
    };
    let addresses = match allow.resolve(&host, port).await {
        Ok(addresses) => addresses,
        Err(reason) => return refuse(&mut client, 403, &reason).await,
    };
    let upstream =
        match tokio::time::timeout(STEP_TIMEOUT, TcpStream::connect(&addresses[..])).await {
            Ok(Ok(upstream)) => upstream,
            _ => {
                return refuse(
                    &mut client,
                    502,
                    &format!("cannot connect to {host}:{port}"),
                )
                .await
            }
        };
    let mut upstream = upstream;
    if connect {
        client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await?;
    } else {
        // One request per connection, for the host it was checked for: a `Host` of its own
        // choosing or a pipelined request for another host never reaches the target.
        let mut forwarded = format!("{method} {path} {version}\r\nHost: {host}:{port}\r\n");
        for header in &headers {
            let name = header.split(':').next().unwrap_or_default().trim();
            let dropped = [
                "proxy-authorization",
                "proxy-connection",
                "host",
                "connection",
                "keep-alive",
            ];
            if !dropped.iter().any(|d| name.eq_ignore_ascii_case(d)) {
                forwarded.push_str(header);
                forwarded.push_str("\r\n");
            }
        }
        forwarded.push_str("Connection: close\r\n\r\n");
        // Exactly this request's body, then only the answer flows: whatever the client sends
        // after it (a pipelined request for another host) never reaches the target.
        let header = |wanted: &str| {
            headers.iter().find_map(|h| {
                let (name, value) = h.split_once(':')?;
                name.trim()
                    .eq_ignore_ascii_case(wanted)
                    .then(|| value.trim().to_string())
            })
        };
        if header("transfer-encoding").is_some() {
            return refuse(&mut client, 400, "chunked request bodies are not proxied").await;
        }
        let length: u64 = match header("content-length").map(|v| v.parse()) {
            None => 0,
            Some(Ok(length)) => length,
            Some(Err(_)) => return refuse(&mut client, 400, "a bad Content-Length").await,
        };
        upstream.write_all(forwarded.as_bytes()).await?;
        let first = rest
            .len()
            .min(usize::try_from(length).unwrap_or(usize::MAX));
        upstream.write_all(&rest[..first]).await?;
        let remaining = length - first as u64;
        if remaining > 0 {
            tokio::io::copy(&mut (&mut client).take(remaining), &mut upstream).await?;
        }
        tokio::io::copy(&mut upstream, &mut client).await?;
        return Ok(());
    }
    if !rest.is_empty() {
        upstream.write_all(&rest).await?;
    }
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}

/// Reads up to the blank line that ends a request head; returns the head and what followed.
async fn read_head(client: &mut TcpStream) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buffer = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let read = client.read(&mut chunk).await?;
        if read == 0 {
            return Err(std::io::Error::other(
                "the client closed before its request",
            ));
        }
        buffer.extend_from_slice(&chunk[..read]);
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buffer.split_off(end + 4);
            return Ok((buffer, rest));
        }
        if buffer.len() > MAX_HEAD {
            return Err(std::io::Error::other("the request head is too large"));
        }
    }
}

fn split_host_port(authority: &str, default_port: u16) -> Option<(String, u16)> {
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    if authority.is_empty() {
        return None;
    }
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(port) => port.parse().ok()?,
            None => default_port,
        };
        return Some((host.to_string(), port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Some((host.to_string(), port.parse().ok()?)),
        None => Some((authority.to_string(), default_port)),
    }
}

async fn refuse(client: &mut TcpStream, status: u16, reason: &str) -> std::io::Result<()> {
    let title = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        407 => "Proxy Authentication Required",
        408 => "Request Timeout",
        _ => "Bad Gateway",
    };
    let body = format!("forgepool egress: {reason}\n");
    let mut response = format!(
        "HTTP/1.1 {status} {title}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if status == 407 {
        response.push_str("Proxy-Authenticate: Basic realm=\"forgepool\"\r\n");
    }
    response.push_str("\r\n");
    response.push_str(&body);
    client.write_all(response.as_bytes()).await?;
    client.shutdown().await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Standard base64 with padding.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `forgepool egress-proxy`: serves one allowlist on [`PROXY_PORT`] until SIGTERM, taking its
/// token and allowlist from the environment. Returns the exit code.
pub async fn run_from_env(shutdown: CancellationToken) -> i32 {
    let token = std::env::var(ENV_TOKEN).unwrap_or_default();
    if token.len() < 16 {
        eprintln!("error: {ENV_TOKEN} must hold the proxy's token (16 or more characters)");
        return 2;
    }
    let entries: Vec<String> = std::env::var(ENV_ALLOW)
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let allow = match Allowlist::parse(&entries) {
        Ok(allow) => allow,
        Err(error) => {
            eprintln!("error: {ENV_ALLOW}: {error}");
            return 2;
        }
    };
    let listener = match TcpListener::bind(("0.0.0.0", PROXY_PORT)).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("error: cannot listen on port {PROXY_PORT}: {error}");
            return 1;
        }
    };
    println!(
        "egress proxy listening on port {PROXY_PORT} for {} host(s)",
        entries.len()
    );
    serve(listener, token, allow, shutdown).await;
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowlists_match_hosts_ports_and_subdomains() {
        let allow = Allowlist::parse(&[
            "api.anthropic.com:443".into(),
            "*.github.com:443".into(),
            "10.1.2.3:8080".into(),
        ])
        .unwrap();
        assert!(allow.rule_for("api.anthropic.com", 443).is_some());
        assert!(allow.rule_for("API.Anthropic.com.", 443).is_some());
        assert!(allow.rule_for("api.anthropic.com", 80).is_none());
        assert!(allow.rule_for("evil-anthropic.com", 443).is_none());
        assert!(allow.rule_for("raw.github.com", 443).is_some());
        assert!(allow.rule_for("github.com", 443).is_none());
        assert!(allow.rule_for("evilgithub.com", 443).is_none());
        assert!(allow.rule_for("10.1.2.3", 8080).is_some());
        assert!(allow.rule_for("10.1.2.4", 8080).is_none());
        assert!(Allowlist::parse(&["no-port".into()]).is_err());
        assert!(Allowlist::parse(&["a b:1".into()]).is_err());
    }

    #[test]
    fn only_public_addresses_count_as_outside() {
        for inside in [
            "127.0.0.1",
            "10.0.0.1",
            "172.17.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:a9fe:a9fe::1",
            "::7f00:1",
            "fec0::1",
            "198.18.0.1",
        ] {
            assert!(!public(inside.parse().unwrap()), "{inside}");
        }
        for outside in [
            "1.1.1.1",
            "140.82.112.3",
            "2606:4700::1111",
            "192.0.5.1",
            "64:ff9b::101:101",
        ] {
            assert!(public(outside.parse().unwrap()), "{outside}");
        }
    }

    #[tokio::test]
    async fn names_that_resolve_inside_and_link_local_entries_are_refused() {
        let allow = Allowlist::parse(&[
            "localhost:80".into(),
            "169.254.169.254:80".into(),
            "127.0.0.1:9".into(),
        ])
        .unwrap();
        let inside = allow.resolve("localhost", 80).await.unwrap_err();
        assert!(inside.contains("resolves to"), "{inside}");
        let metadata = allow.resolve("169.254.169.254", 80).await.unwrap_err();
        assert!(metadata.contains("link-local"), "{metadata}");
        assert!(
            allow.resolve("127.0.0.1", 9).await.is_ok(),
            "an explicit address"
        );
        assert!(allow.resolve("127.0.0.1", 10).await.is_err());
    }

    #[tokio::test]
    async fn the_proxy_tunnels_only_with_its_token_and_only_to_allowed_hosts() {
        // A target that answers, and one that records any connection.
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target_port = target.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = target.accept().await {
                let mut buffer = [0u8; 1024];
                let _ = stream.read(&mut buffer).await;
                let _ = stream
                    .write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello")
                    .await;
            }
        });
        let decoy = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let decoy_port = decoy.local_addr().unwrap().port();
        let (touched, mut touched_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(_connection) = decoy.accept().await {
                let _ = touched.send(());
            }
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = listener.local_addr().unwrap();
        let allow = Allowlist::parse(&[format!("127.0.0.1:{target_port}")]).unwrap();
        let shutdown = CancellationToken::new();
        let token = "a-token-of-sixteen-chars".to_string();
        tokio::spawn(serve(listener, token.clone(), allow, shutdown.clone()));
        let auth = base64(format!("{PROXY_USER}:{token}").as_bytes());
        let ask = |request: String| async move {
            let mut stream = TcpStream::connect(proxy).await.unwrap();
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut answer = Vec::new();
            let _ =
                tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
            String::from_utf8_lossy(&answer).to_string()
        };
        let allowed = ask(format!(
            "GET http://127.0.0.1:{target_port}/x HTTP/1.1\r\nHost: 127.0.0.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
        ))
        .await;
        assert!(allowed.ends_with("hello"), "{allowed}");
        let tunnel = ask(format!(
            "CONNECT 127.0.0.1:{target_port} HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\nGET / HTTP/1.0\r\n\r\n"
        ))
        .await;
        assert!(
            tunnel.starts_with("HTTP/1.1 200 Connection established"),
            "{tunnel}"
        );
        assert!(tunnel.ends_with("hello"), "{tunnel}");
        let denied = ask(format!(
            "CONNECT 127.0.0.1:{decoy_port} HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
        ))
        .await;
        assert!(denied.starts_with("HTTP/1.1 403"), "{denied}");
        let metadata = ask(format!(
            "GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
        ))
        .await;
        assert!(metadata.starts_with("HTTP/1.1 403"), "{metadata}");
        let anonymous = ask(format!(
            "GET http://127.0.0.1:{target_port}/ HTTP/1.1\r\n\r\n"
        ))
        .await;
        assert!(anonymous.starts_with("HTTP/1.1 407"), "{anonymous}");
        assert!(touched_rx.try_recv().is_err(), "the decoy was reached");
        shutdown.cancel();
    }

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"forgepool:token"), "Zm9yZ2Vwb29sOnRva2Vu");
    }
}
