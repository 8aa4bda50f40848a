//! Wire envelope for the opaque bytes in a `RemoteRegion`. UCX parses worker
//! addresses and packed rkeys without a length, so garbage from the network
//! must never reach it: every blob carries a magic (which also tells the
//! transport apart), its length and an xxh3 checksum, and is handed to UCX
//! from a zero-padded copy.

use xxhash_rust::xxh3::xxh3_64;

use crate::DkvError;

pub(crate) const MAGIC_UCX_ADDRESS: [u8; 4] = *b"DKua";
pub(crate) const MAGIC_UCX_RKEY: [u8; 4] = *b"DKuk";
pub(crate) const MAGIC_LOCAL_ADDRESS: [u8; 4] = *b"DKla";
pub(crate) const MAGIC_LOCAL_RKEY: [u8; 4] = *b"DKlk";

const HEADER: usize = 4 + 4 + 8;
/// Far above any UCX worker address or packed rkey, far below harm.
const MAX_PAYLOAD: usize = 64 * 1024;

pub(crate) fn seal(magic: [u8; 4], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&xxh3_64(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload of `blob` if it is an intact envelope with `magic`.
pub(crate) fn open<'a>(what: &str, magic: [u8; 4], blob: &'a [u8]) -> Result<&'a [u8], DkvError> {
    let bad = |m: &str| DkvError::InvalidDescriptor(format!("{what}: {m}"));
    let (header, payload) = blob
        .split_at_checked(HEADER)
        .ok_or_else(|| bad(&format!("{} bytes, shorter than the header", blob.len())))?;
    if header[..4] != magic {
        let kind = match [header[0], header[1], header[2], header[3]] {
            MAGIC_UCX_ADDRESS | MAGIC_UCX_RKEY => "a UCX",
            MAGIC_LOCAL_ADDRESS | MAGIC_LOCAL_RKEY => "an in-process",
            _ => "not a dkv",
        };
        return Err(bad(&format!("wrong magic ({kind} descriptor?)")));
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&header[4..8]);
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_PAYLOAD || len != payload.len() {
        return Err(bad(&format!(
            "payload length {len} (have {} bytes)",
            payload.len()
        )));
    }
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&header[8..16]);
    if u64::from_le_bytes(sum) != xxh3_64(payload) {
        return Err(bad("checksum mismatch"));
    }
    Ok(payload)
}

/// Reads the little-endian u64 at `at` of a payload.
pub(crate) fn read_u64(what: &str, payload: &[u8], at: usize) -> Result<u64, DkvError> {
    payload
        .get(at..at + 8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| DkvError::InvalidDescriptor(format!("{what}: truncated")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let blob = seal(MAGIC_UCX_RKEY, b"packed key");
        assert_eq!(
            open("rkey", MAGIC_UCX_RKEY, &blob).ok(),
            Some(&b"packed key"[..])
        );
        // Wrong transport, truncation, bit flips anywhere, trailing bytes.
        assert!(open("rkey", MAGIC_LOCAL_RKEY, &blob).is_err());
        for cut in 0..blob.len() {
            assert!(
                open("rkey", MAGIC_UCX_RKEY, &blob[..cut]).is_err(),
                "cut {cut}"
            );
        }
        for i in 0..blob.len() {
            let mut b = blob.clone();
            b[i] ^= 0x40;
            assert!(open("rkey", MAGIC_UCX_RKEY, &b).is_err(), "flip {i}");
        }
        let mut long = blob.clone();
        long.push(0);
        assert!(open("rkey", MAGIC_UCX_RKEY, &long).is_err());
        assert!(open("rkey", MAGIC_UCX_RKEY, &seal(MAGIC_UCX_RKEY, b"")).is_err());
        assert!(read_u64("k", &[1, 2, 3], 0).is_err());
        assert_eq!(read_u64("k", &7u64.to_le_bytes(), 0).ok(), Some(7));
    }
}
