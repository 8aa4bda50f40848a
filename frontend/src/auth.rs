//! API keys (`--api-key`, `--api-key-file`): `Authorization: Bearer KEY`
//! on the OpenAI routes, and on `/health` and `/metrics` when configured.
//! Keys are kept as SHA-256 digests and compared in constant time; the set
//! can be replaced while serving (the binary reloads the key file on
//! SIGHUP).

use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// The keys a server accepts. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    digests: Arc<RwLock<Vec<[u8; 32]>>>,
}

impl PartialEq for ApiKeys {
    fn eq(&self, other: &Self) -> bool {
        let read = |k: &Self| {
            k.digests
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        };
        read(self) == read(other)
    }
}

impl Eq for ApiKeys {}

/// Why a set of keys was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("an API key is empty")]
    Empty,
    #[error("an API key contains whitespace or control characters")]
    BadCharacter,
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// Equality whose time does not depend on where the inputs differ.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl ApiKeys {
    /// A set holding `keys`; empty means no key is required.
    pub fn new<S: AsRef<str>>(keys: &[S]) -> Result<Self, KeyError> {
        let me = Self::default();
        me.replace(keys)?;
        Ok(me)
    }

    /// Parses a key file: one key per line; blank lines and lines starting
    /// with `#` are skipped.
    pub fn parse_file(text: &str) -> Vec<String> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_string)
            .collect()
    }

    /// Replaces the accepted keys (all or nothing).
    pub fn replace<S: AsRef<str>>(&self, keys: &[S]) -> Result<(), KeyError> {
        let mut digests = Vec::with_capacity(keys.len());
        for k in keys {
            let k = k.as_ref();
            if k.is_empty() {
                return Err(KeyError::Empty);
            }
            if k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(KeyError::BadCharacter);
            }
            digests.push(digest(k.as_bytes()));
        }
        *self
            .digests
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = digests;
        Ok(())
    }

    /// Whether any key is required.
    pub fn enabled(&self) -> bool {
        !self
            .digests
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }

    /// Checks an `Authorization` header value (`Bearer KEY`); the key's
    /// digest when keys are required (`None` when the API is open).
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<Option<[u8; 32]>, ApiError> {
        let digests = self
            .digests
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if digests.is_empty() {
            return Ok(None);
        }
        let Some(token) = authorization.and_then(bearer) else {
            return Err(ApiError::Unauthorized(
                "You didn't provide an API key. Send it in the Authorization header \
                 (Authorization: Bearer YOUR_KEY)."
                    .into(),
            ));
        };
        let presented = digest(token);
        // Every stored key is compared, so the time does not tell which
        // (or whether one) matched.
        let ok = digests
            .iter()
            .fold(false, |found, d| found | ct_eq(d, &presented));
        if ok {
            Ok(Some(presented))
        } else {
            Err(ApiError::Unauthorized("Incorrect API key provided.".into()))
        }
    }
}

/// The token of `Bearer TOKEN` (scheme case-insensitive).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_and_replaced() {
        let keys = ApiKeys::new(&["k1", "k2"]).expect("valid keys");
        assert!(keys.enabled());
        assert!(keys.check(Some(b"Bearer k1")).is_ok());
        assert!(keys.check(Some(b"bearer  k2 ")).is_ok());
        for bad in [
            None,
            Some(&b"Bearer k3"[..]),
            Some(b"Bearer "),
            Some(b"k1"),
            Some(b"Basic k1"),
            Some(b"Bearer k1x"),
        ] {
            assert!(
                matches!(keys.check(bad), Err(ApiError::Unauthorized(_))),
                "{bad:?}"
            );
        }
        keys.replace(&["k3"]).expect("valid");
        assert!(keys.check(Some(b"Bearer k1")).is_err());
        assert!(keys.check(Some(b"Bearer k3")).is_ok());
        // A bad set changes nothing.
        assert_eq!(
            keys.replace(&["ok", "has space"]),
            Err(KeyError::BadCharacter)
        );
        assert_eq!(keys.replace(&[""]), Err(KeyError::Empty));
        assert!(keys.check(Some(b"Bearer k3")).is_ok());
        // No keys: open.
        let open = ApiKeys::default();
        assert!(!open.enabled());
        assert_eq!(open.check(None).ok(), Some(None));
    }

    #[test]
    fn key_files_skip_comments_and_blanks() {
        assert_eq!(
            ApiKeys::parse_file("# team a\nkey-a\n\n  key-b  \n#old\n"),
            vec!["key-a", "key-b"]
        );
    }
}
