//! Wire envelope for the opaque bytes in a `RemoteRegion`. UCX parses worker
//! addresses without a length, so garbage from the network must never reach
//! it: every blob carries a magic (which also tells the transport apart),
//! its length and an xxh3 checksum, and is handed to UCX from a zero-padded
//! copy. (The checksum proves the blob intact, not who made it: grants carry
//! a secret for that.)

use xxhash_rust::xxh3::xxh3_64;

use crate::DkvError;

pub(crate) const MAGIC_UCX_ADDRESS: [u8; 4] = *b"DKua";
pub(crate) const MAGIC_LOCAL_ADDRESS: [u8; 4] = *b"DKla";
/// A write grant's token (any transport).
pub(crate) const MAGIC_GRANT: [u8; 4] = *b"DKgr";

const HEADER: usize = 4 + 4 + 8;
/// Far above any UCX worker address or grant token, far below harm.
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
            MAGIC_UCX_ADDRESS => "a UCX address",
            MAGIC_LOCAL_ADDRESS => "an in-process address",
            MAGIC_GRANT => "a grant",
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
        let blob = seal(MAGIC_GRANT, b"a token");
        assert_eq!(
            open("grant", MAGIC_GRANT, &blob).ok(),
            Some(&b"a token"[..])
        );
        // Wrong kind, truncation, bit flips anywhere, trailing bytes.
        assert!(open("grant", MAGIC_UCX_ADDRESS, &blob).is_err());
        for cut in 0..blob.len() {
            assert!(
                open("grant", MAGIC_GRANT, &blob[..cut]).is_err(),
                "cut {cut}"
            );
        }
        for i in 0..blob.len() {
            let mut b = blob.clone();
            b[i] ^= 0x40;
            assert!(open("grant", MAGIC_GRANT, &b).is_err(), "flip {i}");
        }
        let mut long = blob.clone();
        long.push(0);
        assert!(open("grant", MAGIC_GRANT, &long).is_err());
        assert!(open("grant", MAGIC_GRANT, &seal(MAGIC_GRANT, b"")).is_err());
        assert!(read_u64("k", &[1, 2, 3], 0).is_err());
        assert_eq!(read_u64("k", &7u64.to_le_bytes(), 0).ok(), Some(7));
    }
}
