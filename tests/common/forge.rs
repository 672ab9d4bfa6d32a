//! A GitHub forge for delivery tests: git over HTTPS (Debian's nginx serving `git
//! http-backend` through fcgiwrap, TLS from a test CA, HTTP basic authentication) and a
//! stateful fake of the GitHub REST endpoints a delivery calls (pulls, statuses, GraphQL's
//! draft mutations) behind Prism with GitHub's own description. Shared by `tests/forges.rs`
//! and `tests/trackers.rs`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The token the fake GitHub's GraphQL endpoint takes.
pub const GITHUB_TOKEN: &str = "ghs_forgepoolTestToken0123456789";

fn require(program: &str) {
    assert!(
        Command::new("sh")
            .args(["-c", &format!("command -v {program}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()),
        "{program} is missing: run scripts/services.sh (it installs nginx-light, fcgiwrap and openssl)"
    );
}

fn run(dir: &Path, program: &str, args: &[&str]) {
    let output = super::output_within(
        Command::new(program).args(args).current_dir(dir),
        super::COMMAND_LIMIT,
    );
    assert!(output.status.success(), "{program} {args:?}: {output:?}");
}

pub fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    run(
        dir,
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=forgepool test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
    );
    run(
        dir,
        "openssl",
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(dir.join("san.ext"), "subjectAltName = IP:127.0.0.1\n").unwrap();
    run(
        dir,
        "openssl",
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ],
    );
    (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}

/// nginx and fcgiwrap serving the repositories under a folder over HTTPS, for one user.
pub struct GitHttps {
    children: Vec<Child>,
    port: u16,
    pub ca: PathBuf,
}

impl Drop for GitHttps {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl GitHttps {
    pub fn start(root: &Path, dir: &Path, user: &str, token: &str) -> GitHttps {
        require("nginx");
        require("fcgiwrap");
        require("openssl");
        let (ca, cert, key) = certificates(dir);
        let hash = super::output_within(
            Command::new("openssl").args(["passwd", "-apr1", token]),
            super::COMMAND_LIMIT,
        );
        std::fs::write(
            dir.join("htpasswd"),
            format!("{user}:{}", String::from_utf8_lossy(&hash.stdout).trim()),
        )
        .unwrap();
        let socket = dir.join("fcgi.sock");
        let fcgi = Command::new("fcgiwrap")
            .args(["-s", &format!("unix:{}", socket.display())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fcgiwrap starts");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = format!(
            r#"daemon off;
user root;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log;
events {{ worker_connections 64; }}
http {{
  access_log {dir}/nginx-access.log;
  client_body_temp_path {dir}/body;
  fastcgi_temp_path {dir}/fastcgi;
  proxy_temp_path {dir}/proxy;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  client_max_body_size 0;
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    location / {{
      auth_basic "git";
      auth_basic_user_file {dir}/htpasswd;
      include /etc/nginx/fastcgi_params;
      fastcgi_param SCRIPT_FILENAME /usr/lib/git-core/git-http-backend;
      fastcgi_param GIT_PROJECT_ROOT {root};
      fastcgi_param GIT_HTTP_EXPORT_ALL "";
      fastcgi_param PATH_INFO $uri;
      fastcgi_param REMOTE_USER $remote_user;
      fastcgi_pass unix:{socket};
    }}
  }}
}}
"#,
            dir = dir.display(),
            cert = cert.display(),
            key = key.display(),
            root = root.display(),
            socket = socket.display(),
        );
        std::fs::write(dir.join("nginx.conf"), config).unwrap();
        let nginx = Command::new("nginx")
            .args(["-e", &dir.join("nginx-error.log").display().to_string()])
            .args(["-c", &dir.join("nginx.conf").display().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx starts");
        let server = GitHttps {
            children: vec![fcgi, nginx],
            port,
            ca,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() || !socket.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "nginx did not listen: {}",
                std::fs::read_to_string(dir.join("nginx-error.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// A pull request the fake GitHub keeps: number, head, base, title, body, draft.
pub type FakePull = (u64, String, String, String, String, bool);

/// What the fake GitHub saw and keeps: every request (method, path, body) and its pulls.
#[derive(Default)]
pub struct GithubState {
    pub requests: Vec<(String, String, serde_json::Value)>,
    pub pulls: Vec<FakePull>,
    pub statuses: usize,
}

/// A stateful fake of the few GitHub REST endpoints forgepool calls, behind Prism, which
/// checks every request against GitHub's published OpenAPI description (a request that breaks
/// it is answered 422 by Prism and never reaches the fake).
pub struct FakeGithub {
    pub state: std::sync::Arc<std::sync::Mutex<GithubState>>,
    prism: Child,
    pub port: u16,
    /// The fake itself, for GraphQL (GitHub's REST description has no `/graphql`).
    pub upstream: u16,
}

impl Drop for FakeGithub {
    fn drop(&mut self) {
        let _ = self.prism.kill();
        let _ = self.prism.wait();
    }
}

impl FakeGithub {
    pub fn start(dir: &Path) -> FakeGithub {
        let tools = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/forge/node_modules");
        let prism = tools.join(".bin/prism");
        let spec = tools.join("@octokit/openapi/generated/api.github.com.json");
        assert!(
            prism.exists() && spec.exists(),
            "Prism and GitHub's OpenAPI description are missing: run scripts/forge-tools.sh"
        );
        // Prism also checks the answers against the description: the fake answers with
        // GitHub's own examples from it, changed only where its state differs.
        let described: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap();
        let example = |name: &str| described["components"]["examples"][name]["value"].clone();
        let mut repository = example("full-repository-default-response");
        repository["default_branch"] = "main".into();
        let simple = example("pull-request-simple-items")[0].clone();
        let full = example("pull-request");
        let status_example = example("status");
        drop(described);
        let state = std::sync::Arc::new(std::sync::Mutex::new(GithubState::default()));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = listener.local_addr().unwrap().port();
        let kept = std::sync::Arc::clone(&state);
        super::api::serve_json(listener, move |request| {
            let (method, path, body) = (&request.method, request.path.as_str(), &request.body);
            // Prism passes the query on percent-encoded.
            let query = request
                .query
                .replace("%3A", ":")
                .replace("%3a", ":")
                .replace("%2F", "/")
                .replace("%2f", "/");
            let mut state = kept.lock().unwrap();
            state
                .requests
                .push((method.clone(), path.to_string(), body.clone()));
            let shaped = |template: &serde_json::Value, n: u64| {
                let mut pull = template.clone();
                pull["number"] = n.into();
                // GitHub's example breaks its own schema here (a team without its
                // required fields).
                if pull.get("requested_teams").is_some() {
                    pull["requested_teams"] = serde_json::json!([]);
                }
                pull["html_url"] = format!("https://github.example/acme/shop/pull/{n}").into();
                pull
            };
            let pull = |n: u64| shaped(&full, n);
            match (method.as_str(), path) {
                ("GET", "/repos/acme/shop") => (200, repository.clone()),
                ("GET", "/repos/acme/shop/pulls") => {
                    let open: Vec<_> = state
                        .pulls
                        .iter()
                        .filter(|p| query.contains(&format!("head=acme:{}", p.1)))
                        .map(|p| {
                            let mut listed = shaped(&simple, p.0);
                            listed["draft"] = p.5.into();
                            listed["node_id"] = format!("PR_node_{}", p.0).into();
                            listed
                        })
                        .collect();
                    (200, serde_json::Value::Array(open))
                }
                ("POST", "/repos/acme/shop/pulls") => {
                    let n = state.pulls.len() as u64 + 1;
                    let text = |k: &str| body[k].as_str().unwrap_or("").to_string();
                    let draft = body["draft"].as_bool().unwrap_or(false);
                    state.pulls.push((
                        n,
                        text("head"),
                        text("base"),
                        text("title"),
                        text("body"),
                        draft,
                    ));
                    (201, pull(n))
                }
                ("PATCH", p) if p.starts_with("/repos/acme/shop/pulls/") => {
                    let n: u64 = p.rsplit('/').next().unwrap().parse().unwrap();
                    if let Some(kept) = state.pulls.iter_mut().find(|k| k.0 == n) {
                        kept.3 = body["title"].as_str().unwrap_or("").to_string();
                        kept.4 = body["body"].as_str().unwrap_or("").to_string();
                    }
                    (200, pull(n))
                }
                ("POST", p) if p.starts_with("/repos/acme/shop/statuses/") => {
                    state.statuses += 1;
                    let mut answer = status_example.clone();
                    answer["state"] = body["state"].clone();
                    (201, answer)
                }
                // Modelled on GitHub's GraphQL reference: the two mutations, their input
                // `pullRequestId`, a bearer token; an error is a 200 with `errors`.
                ("POST", "/graphql") => {
                    if request.header("authorization") != Some(&format!("Bearer {GITHUB_TOKEN}")) {
                        return (401, serde_json::json!({"message": "Bad credentials"}));
                    }
                    let query = body["query"].as_str().unwrap_or("");
                    let draft = if query
                        .contains("convertPullRequestToDraft(input: {pullRequestId: $id})")
                    {
                        true
                    } else if query
                        .contains("markPullRequestReadyForReview(input: {pullRequestId: $id})")
                    {
                        false
                    } else {
                        return (
                            200,
                            serde_json::json!({"errors": [{"message": "unknown mutation"}]}),
                        );
                    };
                    let id = body["variables"]["id"].as_str().unwrap_or("");
                    match state
                        .pulls
                        .iter_mut()
                        .find(|p| id == format!("PR_node_{}", p.0))
                    {
                        Some(kept) => {
                            kept.5 = draft;
                            (
                                200,
                                serde_json::json!({"data": {"pullRequest": {"isDraft": draft}}}),
                            )
                        }
                        None => (
                            200,
                            serde_json::json!({"errors": [{"type": "NOT_FOUND", "message": "no such node"}]}),
                        ),
                    }
                }
                _ => (404, serde_json::json!({"message": "Not Found"})),
            }
        });
        let (prism, port) =
            super::api::start_prism(&prism, &spec, upstream, &dir.join("prism-forge.log"));
        FakeGithub {
            state,
            prism,
            port,
            upstream,
        }
    }
}
