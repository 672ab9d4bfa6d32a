//! TLS to PostgreSQL, set in `FORGEPOOL_DATABASE_URL`'s query as libpq does:
//! `sslmode=disable` (the default: plain TCP), `prefer` (TLS when the server offers it, plain
//! TCP otherwise; the certificate is not checked), `require` (encrypted; the server's
//! certificate is not checked, as libpq does without a root certificate) or `verify-full` (encrypted; the
//! certificate must chain to `sslrootcert`, a PEM file, or without it to the Mozilla roots,
//! and must name the host). rustls, with the ring provider already in the build.
//!
//! Also which connection failures are worth waiting out while the server starts.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

/// How the connection is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS when the server offers it, any certificate; plain TCP otherwise (libpq's default,
    /// common in providers' URLs).
    Prefer,
    /// TLS, any certificate.
    Require,
    /// TLS, a certificate that chains to the roots and names the host.
    VerifyFull,
}

/// The TLS settings of a database URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// `sslmode`.
    pub mode: SslMode,
    /// `sslrootcert`: the CA certificates (PEM) `verify-full` trusts.
    pub root_cert: Option<PathBuf>,
}

/// Takes `sslmode` and `sslrootcert` out of a `postgres://` URL's query (tokio-postgres
/// refuses `verify-full` and does not know `sslrootcert`); returns the rest of the URL and the
/// settings. An error names the setting and what it takes.
pub fn split(url: &str) -> Result<(String, TlsSettings), String> {
    let mut settings = TlsSettings {
        mode: SslMode::Disable,
        root_cert: None,
    };
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), settings));
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslmode" => {
                settings.mode = match value {
                    "disable" => SslMode::Disable,
                    "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-full" => SslMode::VerifyFull,
                    other => {
                        return Err(format!(
                        "sslmode: {other:?} is not supported; use disable, prefer, require or verify-full"
                    ))
                    }
                }
            }
            "sslrootcert" => settings.root_cert = Some(PathBuf::from(percent_decoded(value))),
            _ => kept.push(pair),
        }
    }
    if settings.root_cert.is_some() && settings.mode != SslMode::VerifyFull {
        return Err("sslrootcert: is read only with sslmode=verify-full".into());
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, settings))
}

/// `%2F` and friends decoded (a path in a query may be written either way).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied(),
            bytes.get(i + 2).copied(),
        ) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, ..) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The connector for `settings`, or `None` for plain TCP.
pub fn connector(settings: &TlsSettings) -> Result<Option<MakeRustlsConnect>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let config = match settings.mode {
        SslMode::Disable => return Ok(None),
        SslMode::Prefer | SslMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth(),
        SslMode::VerifyFull => {
            let mut roots = RootCertStore::empty();
            match &settings.root_cert {
                Some(path) => {
                    let unreadable = |e: &dyn std::fmt::Display| {
                        format!("sslrootcert: cannot read {}: {e}", path.display())
                    };
                    for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
                        let cert = cert.map_err(|e| unreadable(&e))?;
                        roots.add(cert).map_err(|e| unreadable(&e))?;
                    }
                    if roots.is_empty() {
                        return Err(unreadable(&"no certificate in it"));
                    }
                }
                None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    Ok(Some(MakeRustlsConnect::new(config)))
}

/// `sslmode=require`: the channel is encrypted, the server is not authenticated.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Whether opening should try again after `error`: the server is not there yet (the
/// connection is refused or reset, or it is starting up), rather than refusing us for good (a
/// password, a `pg_hba.conf` rule, a certificate, a migration).
pub(super) fn worth_waiting(error: &super::StoreError) -> bool {
    match error {
        super::StoreError::Unavailable(_) => true,
        super::StoreError::Postgres(error) => {
            if error.code() == Some(&tokio_postgres::error::SqlState::CANNOT_CONNECT_NOW) {
                return true;
            }
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
            while let Some(current) = cause {
                if let Some(io) = current.downcast_ref::<std::io::Error>() {
                    return matches!(
                        io.kind(),
                        std::io::ErrorKind::ConnectionRefused
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::UnexpectedEof
                    );
                }
                cause = current.source();
            }
            false
        }
        _ => false,
    }
}

/// The connection manager for `url`: its TLS parameters (`sslmode`, `sslrootcert`) taken out
/// and applied, or `NoTls` when it asks for none.
pub fn manager(url: &str) -> Result<deadpool_postgres::Manager, String> {
    use deadpool_postgres::{Manager, ManagerConfig, RecyclingMethod};
    let (url, tls) = split(url)?;
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| format!("not a PostgreSQL URL: {e}"))?;
    let manager_config = || ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match connector(&tls)? {
        None => {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            Manager::from_config(config, tokio_postgres::NoTls, manager_config())
        }
        Some(connect) => {
            config.ssl_mode(if tls.mode == SslMode::Prefer {
                tokio_postgres::config::SslMode::Prefer
            } else {
                tokio_postgres::config::SslMode::Require
            });
            Manager::from_config(config, connect, manager_config())
        }
    };
    Ok(manager)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: forgepool's settings left for tokio-postgres (which refuses them), other
    /// settings dropped, or a mode it does not implement taken silently.
    #[test]
    fn tls_settings_are_taken_out_of_the_url() {
        let (rest, settings) = split(
            "postgres://u:p@db:5432/runs?application_name=fp&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@db:5432/runs?application_name=fp");
        assert_eq!(settings.mode, SslMode::VerifyFull);
        assert_eq!(settings.root_cert, Some(PathBuf::from("/etc/ca.pem")));
        let (rest, settings) = split("postgres://u@db/runs").unwrap();
        assert_eq!(
            (rest.as_str(), settings.mode),
            ("postgres://u@db/runs", SslMode::Disable)
        );
        assert_eq!(
            split("postgres://db/r?sslmode=require").unwrap().1.mode,
            SslMode::Require
        );
        for (bad, named) in [
            ("postgres://db/r?sslmode=verify-ca", "sslmode"),
            ("postgres://db/r?sslmode=allow", "sslmode"),
            ("postgres://db/r?sslrootcert=/ca.pem", "sslrootcert"),
        ] {
            let error = split(bad).unwrap_err();
            assert!(error.starts_with(named), "{bad}: {error}");
        }
        let missing = TlsSettings {
            mode: SslMode::VerifyFull,
            root_cert: Some(PathBuf::from("/nonexistent/ca.pem")),
        };
        let error = connector(&missing).map(|_| ()).unwrap_err();
        assert!(
            error.contains("sslrootcert") && error.contains("/nonexistent/ca.pem"),
            "{error}"
        );
    }
}
