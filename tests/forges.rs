//! Delivering to real forges: git over HTTPS with a token (Debian's nginx serving
//! `git http-backend` through fcgiwrap, TLS from a test CA, HTTP basic authentication), with
//! the credentials of the forges file. The token must work when right, fail clearly when
//! wrong, and appear in nothing stored, printed or given to a stage. Needs `nginx-light`,
//! `fcgiwrap` and `openssl` (installed by `scripts/services.sh`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Fixture;

const TOKEN: &str = "ghs_forgepoolTestToken0123456789";

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
    let output = common::output_within(
        Command::new(program).args(args).current_dir(dir),
        common::COMMAND_LIMIT,
    );
    assert!(output.status.success(), "{program} {args:?}: {output:?}");
}

/// A test CA and a server certificate for 127.0.0.1 signed by it: `(ca.pem, cert, key)`.
fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
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
struct GitHttps {
    children: Vec<Child>,
    port: u16,
    ca: PathBuf,
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
    fn start(root: &Path, dir: &Path, user: &str, token: &str) -> GitHttps {
        require("nginx");
        require("fcgiwrap");
        require("openssl");
        let (ca, cert, key) = certificates(dir);
        let hash = common::output_within(
            Command::new("openssl").args(["passwd", "-apr1", token]),
            common::COMMAND_LIMIT,
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

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// Everything a run left that a user or an operator could read: the store's bytes, what
/// forgepool printed, and the branch's files.
fn everything_kept(fixture: &Fixture, outcome: &common::Outcome) -> String {
    let store = std::fs::read(fixture.dir.path().join("runs.db")).unwrap_or_default();
    format!(
        "{}\n{}\n{}",
        String::from_utf8_lossy(&store),
        outcome.stdout,
        outcome.stderr
    )
}

/// Catches: a token that does not reach forgepool's git (the push fails), a wrong token that
/// fails with a bare git error, a token that lands in the store, the output, a stage's
/// environment or mounts, and a missing token variable found only mid-run.
#[test]
fn a_token_from_the_forges_file_pushes_over_https_and_is_kept_nowhere() {
    let fixture = Fixture::new(None, &["env-dump"], &["approve"]);
    let tls = fixture.dir.path().join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    let server = GitHttps::start(fixture.dir.path(), &tls, "x-access-token", TOKEN);
    let forges = fixture.dir.path().join("forges.toml");
    std::fs::write(
        &forges,
        format!(
            "[[forge]]\nhost = \"{}\"\nkind = \"github\"\napi_url = \"http://127.0.0.1:9/\"\ntoken_env = \"FORGE_TEST_TOKEN\"\nca_file = \"{}\"\n",
            server.host(),
            server.ca.display()
        ),
    )
    .unwrap();
    let request = |ticket: &str| {
        format!(
            "ticket = \"{ticket}\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n[repository]\nurl = \"https://{}/repo.git\"\nref = \"main\"\n",
            server.host()
        )
    };
    let run = |ticket: &str, token: Option<&str>| {
        let file = fixture.dir.path().join(format!("{ticket}.toml"));
        std::fs::write(&file, request(ticket)).unwrap();
        let mut command = fixture.command();
        command
            .arg("run")
            .arg(&file)
            .arg("--skills")
            .arg(&fixture.skills)
            .arg("--agents")
            .arg(&fixture.agents)
            .env("FORGEPOOL_FORGES_FILE", &forges);
        match token {
            Some(token) => command.env("FORGE_TEST_TOKEN", token),
            None => command.env_remove("FORGE_TEST_TOKEN"),
        };
        fixture.outcome(command)
    };

    let delivered = run("HTTPS-1", Some(TOKEN));
    assert_eq!(
        delivered.code, 0,
        "{}\n{}",
        delivered.stdout, delivered.stderr
    );
    assert_eq!(fixture.pushes("forge/https-1"), 1);
    let env = fixture.branch_file("forge/https-1", "env.txt");
    let mounts = fixture.branch_file("forge/https-1", "mounts.txt");
    assert!(
        env.contains("FORGE_STAGE=implement"),
        "the agent's environment: {env}"
    );
    assert!(
        !env.contains(TOKEN) && !env.contains("FORGE_TEST_TOKEN"),
        "{env}"
    );
    assert!(
        !mounts.contains("forges") && !mounts.contains("ca.pem"),
        "{mounts}"
    );
    assert!(!everything_kept(&fixture, &delivered).contains(TOKEN));

    let refused = run("HTTPS-2", Some("ghs_wrongToken"));
    assert_eq!(refused.code, 1, "{}\n{}", refused.stdout, refused.stderr);
    let reason = refused.record().states.last().unwrap().1.clone();
    assert!(
        reason.contains(&format!(
            "{} refused the token in $FORGE_TEST_TOKEN",
            server.host()
        )),
        "{reason}"
    );
    assert_eq!(fixture.pushes("forge/https-2"), 0);
    assert!(!everything_kept(&fixture, &refused).contains("ghs_wrongToken"));

    let unset = run("HTTPS-3", None);
    assert_eq!(unset.code, 2, "{}\n{}", unset.stdout, unset.stderr);
    assert!(
        unset
            .stderr
            .contains("token_env names FORGE_TEST_TOKEN, which is not set"),
        "{}",
        unset.stderr
    );
    assert!(unset.stderr.contains("forges.toml"), "{}", unset.stderr);
}
