//! A fake HTTP API for the forge and tracker tests: each request parsed (method, path,
//! query, headers, JSON body) and answered by a closure.

/// One request a fake forge took: the path as sent (still percent-encoded), its query,
/// headers (names lowercased) and JSON body.
pub struct ApiRequest {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: serde_json::Value,
}

impl ApiRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Serves `listener` on a thread: each request is parsed and answered with the status and
/// JSON body `answer` gives (one request per connection).
pub fn serve_json(
    listener: std::net::TcpListener,
    mut answer: impl FnMut(&ApiRequest) -> (u16, serde_json::Value) + Send + 'static,
) {
    std::thread::spawn(move || {
        use std::io::{BufRead, BufReader, Read, Write};
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut first = String::new();
            let _ = reader.read_line(&mut first);
            let mut parts = first.split_whitespace();
            let (method, target) = (
                parts.next().unwrap_or("").to_string(),
                parts.next().unwrap_or("").to_string(),
            );
            let (mut length, mut headers) = (0, Vec::new());
            let mut line = String::new();
            loop {
                line.clear();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                    break;
                }
                if let Some((name, value)) = line.split_once(':') {
                    let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
                    if name == "content-length" {
                        length = value.parse().unwrap_or(0);
                    }
                    headers.push((name, value.to_string()));
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let (path, query) = target.split_once('?').unwrap_or((&target, ""));
            let request = ApiRequest {
                method,
                path: path.to_string(),
                query: query.to_string(),
                headers,
                body: serde_json::from_slice(&body).unwrap_or_default(),
            };
            let (status, answer) = answer(&request);
            let text = answer.to_string();
            let mut stream = stream;
            let _ = write!(
                stream,
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
}

/// Starts Prism (`prism`, the binary in `.tools/forge`) as a validating proxy on a free port
/// in front of `upstream`, checking requests and answers against the OpenAPI `spec`; waits
/// until it listens (it reads a big description first). Its log goes to `log`.
pub fn start_prism(
    prism: &std::path::Path,
    spec: &std::path::Path,
    upstream: u16,
    log: &std::path::Path,
) -> (std::process::Child, u16) {
    use std::time::{Duration, Instant};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new(prism)
        .args([
            "proxy",
            "--errors",
            "-p",
            &port.to_string(),
            "-h",
            "127.0.0.1",
        ])
        .arg(spec)
        .arg(format!("http://127.0.0.1:{upstream}"))
        .stdout(std::fs::File::create(log).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("prism starts");
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "prism did not listen: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    (child, port)
}
