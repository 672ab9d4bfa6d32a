//! Webhook signatures, checked over the raw body before anything is parsed, in constant time:
//! GitHub's `X-Hub-Signature-256` and Jira's `X-Hub-Signature` (`sha256=<hex>` of the body
//! with the secret as HMAC key), GitLab's `X-Gitlab-Token` (the secret itself).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{header, Headers, Secret};

/// Checks `sha256=<hex>` in `name` against the HMAC-SHA256 of `body` under `secret`.
pub fn check_hmac(
    headers: &Headers,
    name: &str,
    body: &[u8],
    secret: &Secret,
) -> Result<(), String> {
    let given = header(headers, name).ok_or_else(|| format!("no `{name}` header"))?;
    let bytes = given
        .trim()
        .strip_prefix("sha256=")
        .and_then(|hex| hex::decode(hex).ok())
        .ok_or_else(|| format!("the `{name}` header is not `sha256=<hex>`"))?;
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.expose().as_bytes())
        .expect("HMAC accepts any key length");
    mac.update(body);
    mac.verify_slice(&bytes)
        .map_err(|_| format!("the `{name}` signature does not match the body and the secret"))
}

/// Checks a token header against the secret, in constant time (GitLab).
pub fn check_token(headers: &Headers, name: &str, secret: &Secret) -> Result<(), String> {
    let given = header(headers, name).ok_or_else(|| format!("no `{name}` header"))?;
    // Comparing the MACs of both keeps the time independent of where they differ.
    let mac = |value: &str| {
        let mut mac = Hmac::<Sha256>::new_from_slice(b"forgepool-token-compare")
            .expect("HMAC accepts any key length");
        mac.update(value.as_bytes());
        mac
    };
    mac(secret.expose())
        .verify_slice(&mac(given).finalize().into_bytes())
        .map_err(|_| format!("the `{name}` header is not the webhook secret"))
}

/// The `sha256=<hex>` signature of `body` under `secret` (what a tracker sends; for tests
/// and `docs/TRACKERS.md`'s local try).
pub fn sign(body: &[u8], secret: &str) -> String {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC accepts any key length");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a missing, malformed, wrong or changed-body signature accepted.
    #[test]
    fn only_the_right_signature_over_the_same_body_passes() {
        let secret = Secret::new("a-webhook-secret-of-32-characters");
        let body = br#"{"action":"labeled"}"#;
        let good = vec![(
            "x-hub-signature-256".to_string(),
            sign(body, secret.expose()),
        )];
        assert!(check_hmac(&good, "x-hub-signature-256", body, &secret).is_ok());
        assert!(check_hmac(
            &good,
            "x-hub-signature-256",
            b"{\"action\":\"opened\"}",
            &secret
        )
        .is_err());
        assert!(check_hmac(&vec![], "x-hub-signature-256", body, &secret).is_err());
        let wrong = vec![(
            "x-hub-signature-256".to_string(),
            sign(body, "another-secret-entirely"),
        )];
        assert!(check_hmac(&wrong, "x-hub-signature-256", body, &secret).is_err());
        let junk = vec![("x-hub-signature-256".to_string(), "sha1=abc".to_string())];
        assert!(check_hmac(&junk, "x-hub-signature-256", body, &secret).is_err());
        let token = vec![("x-gitlab-token".to_string(), secret.expose().to_string())];
        assert!(check_token(&token, "x-gitlab-token", &secret).is_ok());
        let other = vec![(
            "x-gitlab-token".to_string(),
            "a-webhook-secret-of-32-characterz".to_string(),
        )];
        assert!(check_token(&other, "x-gitlab-token", &secret).is_err());
    }
}
