//! The cluster's dKV key: 256 bits that every node of a cluster shares and
//! nobody else has. A node seals its worker address with it (HMAC-SHA256,
//! see `descriptor`), and a node verifies a peer's address under it before
//! any byte reaches UCX, whose address parser trusts its input (a crafted
//! address aborts the process inside `ucp_ep_create`). Whoever has the key
//! can make addresses every node accepts: keep it as secret as the
//! cluster's certificates.

use std::fmt;

use crate::DkvError;

/// Bytes of a [`DkvKey`].
pub const KEY_LEN: usize = 32;

/// A cluster's dKV key. `Debug` never shows it.
#[derive(Clone)]
pub struct DkvKey([u8; KEY_LEN]);

impl DkvKey {
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(bytes)
    }

    /// A fresh key from the operating system's generator.
    pub fn generate() -> Result<Self, DkvError> {
        let mut k = [0u8; KEY_LEN];
        getrandom::fill(&mut k)
            .map_err(|e| DkvError::InvalidKey(format!("no randomness for a key: {e}")))?;
        Ok(Self(k))
    }

    /// A key written as 64 hexadecimal digits (`openssl rand -hex 32`);
    /// surrounding whitespace is ignored.
    pub fn from_hex(text: &str) -> Result<Self, DkvError> {
        let t = text.trim();
        let bad = || {
            DkvError::InvalidKey(format!(
                "expected {} hexadecimal digits (e.g. from `openssl rand -hex 32`), got {} \
                 characters",
                2 * KEY_LEN,
                t.len()
            ))
        };
        if t.len() != 2 * KEY_LEN || !t.is_ascii() {
            return Err(bad());
        }
        let mut k = [0u8; KEY_LEN];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(k))
    }

    /// A key of exactly [`KEY_LEN`] raw bytes (as stored in etcd).
    pub fn from_slice(bytes: &[u8]) -> Result<Self, DkvError> {
        <[u8; KEY_LEN]>::try_from(bytes)
            .map(Self)
            .map_err(|_| DkvError::InvalidKey(format!("{} bytes, expected {KEY_LEN}", bytes.len())))
    }

    pub fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }

    /// `payload` (a UCX worker address) in the envelope a
    /// [`crate::RemoteRegion`]'s `worker_address` carries, tagged with this
    /// key.
    pub fn seal_address(&self, payload: &[u8]) -> Vec<u8> {
        crate::descriptor::seal_keyed(self, crate::descriptor::MAGIC_UCX_ADDRESS, payload)
    }

    /// The UCX worker address inside `blob` if its tag verifies under this
    /// key ([`DkvError::Unauthenticated`] if not).
    pub fn open_address<'a>(&self, blob: &'a [u8]) -> Result<&'a [u8], DkvError> {
        crate::descriptor::open_keyed(
            self,
            "worker_address",
            crate::descriptor::MAGIC_UCX_ADDRESS,
            blob,
        )
    }
}

impl PartialEq for DkvKey {
    fn eq(&self, other: &Self) -> bool {
        // Constant time: no byte-by-byte oracle on a key.
        self.0
            .iter()
            .zip(&other.0)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl Eq for DkvKey {}

impl fmt::Debug for DkvKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DkvKey(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_raw_forms() {
        let k = DkvKey::from_hex(&format!("  {}\n", "0a".repeat(32))).expect("hex key");
        assert_eq!(k.as_bytes(), &[10u8; 32]);
        assert_eq!(DkvKey::from_slice(&[10u8; 32]).ok(), Some(k.clone()));
        for bad in [
            "",
            "0a",
            &"0a".repeat(31),
            &"0g".repeat(32),
            &"é".repeat(32),
        ] {
            assert!(
                matches!(DkvKey::from_hex(bad), Err(DkvError::InvalidKey(_))),
                "{bad:?}"
            );
        }
        assert!(DkvKey::from_slice(&[1; 31]).is_err());
        assert!(!format!("{k:?}").contains("10"));
        let (a, b) = (
            DkvKey::generate().expect("a"),
            DkvKey::generate().expect("b"),
        );
        assert_ne!(a, b);
    }
}
