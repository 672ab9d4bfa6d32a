//! Job signatures: the dispatcher signs every job it publishes with the key it shares with the
//! workers (`FORGEPOOL_JOB_KEY`), and a worker runs only jobs whose signature checks. Anyone
//! else who can publish to the broker (an external producer, a leaked credential) cannot make a
//! worker run anything: they may only submit requests, which the dispatcher validates.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The message header holding a job's signature, `sha256=<hex>`.
pub const SIGNATURE_HEADER: &str = "forgepool-signature";
/// The shortest key accepted.
pub const MIN_KEY_BYTES: usize = 16;

/// The key that signs and checks job messages. Its `Debug` never shows it.
#[derive(Clone)]
pub struct JobKey(Vec<u8>);

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobKey([REDACTED])")
    }
}

impl JobKey {
    /// A key from its text; it must be at least [`MIN_KEY_BYTES`] long.
    pub fn new(text: &str) -> Result<JobKey, String> {
        if text.len() < MIN_KEY_BYTES {
            return Err(format!(
                "must be at least {MIN_KEY_BYTES} characters (for example `openssl rand -hex 32`)"
            ));
        }
        Ok(JobKey(text.as_bytes().to_vec()))
    }

    /// The signature of a message body, `sha256=<hex>`.
    pub fn sign(&self, body: &[u8]) -> String {
        let mut mac = self.mac();
        mac.update(body);
        format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
    }

    /// Checks a body against its signature, in constant time; the error is a dead letter's
    /// reason.
    pub fn verify(&self, body: &[u8], signature: Option<&str>) -> Result<(), String> {
        let Some(signature) = signature else {
            return Err(format!(
                "the job is not signed (no `{SIGNATURE_HEADER}` header): only the dispatcher may publish jobs"
            ));
        };
        let bytes = signature
            .strip_prefix("sha256=")
            .and_then(|text| hex::decode(text).ok())
            .ok_or_else(|| {
                format!("the job's `{SIGNATURE_HEADER}` header is not `sha256=<hex>`")
            })?;
        let mut mac = self.mac();
        mac.update(body);
        mac.verify_slice(&bytes).map_err(|_| {
            "the job's signature does not match: it was not signed with this worker's FORGEPOOL_JOB_KEY, or it was changed".to_string()
        })
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes keys of any length.
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC accepts any key length")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_check_and_refuse() {
        let key = JobKey::new("0123456789abcdef-key").unwrap();
        let body = br#"{"schema_version":1}"#;
        let signature = key.sign(body);
        assert!(signature.starts_with("sha256="));
        assert_eq!(key.verify(body, Some(&signature)), Ok(()));
        assert!(
            key.verify(b"{}", Some(&signature)).is_err(),
            "a changed body"
        );
        assert!(key.verify(body, None).unwrap_err().contains("not signed"));
        assert!(key.verify(body, Some("sha256=zz")).is_err());
        let other = JobKey::new("another-key-of-16-bytes").unwrap();
        assert!(other.verify(body, Some(&signature)).is_err(), "another key");
        assert!(JobKey::new("short").is_err());
        assert_eq!(format!("{key:?}"), "JobKey([REDACTED])");
    }
}
