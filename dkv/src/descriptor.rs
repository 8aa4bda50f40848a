//! Wire envelopes for the opaque bytes in a `RemoteRegion`. Every blob
//! carries a magic (which also tells the transport apart) and its length.
//!
//! - Worker addresses carry an HMAC-SHA256 tag under the cluster's dKV key
//!   ([`DkvKey`]), checked (in constant time) before a byte of the address
//!   is used. UCX parses addresses without a length and trusts them (a
//!   crafted one aborts the process in `ucp_ep_create`), so only an
//!   address a node of the cluster sealed may ever reach it, and then from
//!   a zero-padded copy. An unkeyed checksum did not do: anyone can
//!   recompute one over a modified address.
//! - Grant tokens carry an xxh3 checksum: it proves the blob intact, not
//!   who made it; the token's secret, checked by the receiver, does that.

use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use xxhash_rust::xxh3::xxh3_64;

use crate::{DkvError, DkvKey};

/// Addresses sealed under the cluster's key.
pub(crate) const MAGIC_UCX_ADDRESS: [u8; 4] = *b"DKum";
pub(crate) const MAGIC_LOCAL_ADDRESS: [u8; 4] = *b"DKlm";
/// Addresses of builds before the key (an unkeyed checksum): refused.
const MAGIC_UNKEYED_UCX_ADDRESS: [u8; 4] = *b"DKua";
const MAGIC_UNKEYED_LOCAL_ADDRESS: [u8; 4] = *b"DKla";
/// A write grant's token (any transport).
pub(crate) const MAGIC_GRANT: [u8; 4] = *b"DKgr";

const HEADER: usize = 4 + 4 + 8;
const TAG: usize = 32;
const KEYED_HEADER: usize = 4 + 4 + TAG;
/// What the tag covers before the envelope's own bytes: no other use of a
/// cluster's key can produce a valid address tag.
const TAG_CONTEXT: &[u8] = b"tandem-dkv worker address v1\0";
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
    check_shape(what, magic, header, payload)?;
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&header[8..16]);
    if u64::from_le_bytes(sum) != xxh3_64(payload) {
        return Err(bad("checksum mismatch"));
    }
    Ok(payload)
}

/// Checks an envelope's magic and length field against its payload.
fn check_shape(what: &str, magic: [u8; 4], header: &[u8], payload: &[u8]) -> Result<(), DkvError> {
    let bad = |m: &str| DkvError::InvalidDescriptor(format!("{what}: {m}"));
    if header[..4] != magic {
        let kind = match [header[0], header[1], header[2], header[3]] {
            MAGIC_UCX_ADDRESS => "a UCX address",
            MAGIC_LOCAL_ADDRESS => "an in-process address",
            MAGIC_UNKEYED_UCX_ADDRESS | MAGIC_UNKEYED_LOCAL_ADDRESS => {
                "an address without a key's tag, from an older build"
            }
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
    Ok(())
}

/// The tag of an address envelope: over the context, the magic, the length
/// field and the payload.
fn mac(key: &DkvKey, header: &[u8], payload: &[u8]) -> Hmac<Sha256> {
    // HMAC pads a key shorter than the hash's block with zeros: done here,
    // the infallible constructor takes it.
    let mut block = [0u8; 64];
    block[..key.as_bytes().len()].copy_from_slice(key.as_bytes());
    let mut m = <Hmac<Sha256> as KeyInit>::new(&block.into());
    m.update(TAG_CONTEXT);
    m.update(&header[..8]);
    m.update(payload);
    m
}

/// `payload` in an address envelope tagged under `key`.
pub(crate) fn seal_keyed(key: &DkvKey, magic: [u8; 4], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(KEYED_HEADER + payload.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let tag = mac(key, &out, payload).finalize().into_bytes();
    out.extend_from_slice(&tag);
    out.extend_from_slice(payload);
    out
}

/// The payload of `blob` if it is an address envelope with `magic` whose
/// tag verifies under `key`: [`DkvError::InvalidDescriptor`] for a
/// malformed one, [`DkvError::Unauthenticated`] for a wrong tag.
pub(crate) fn open_keyed<'a>(
    key: &DkvKey,
    what: &str,
    magic: [u8; 4],
    blob: &'a [u8],
) -> Result<&'a [u8], DkvError> {
    let (header, payload) = blob.split_at_checked(KEYED_HEADER).ok_or_else(|| {
        DkvError::InvalidDescriptor(format!(
            "{what}: {} bytes, shorter than the header",
            blob.len()
        ))
    })?;
    check_shape(what, magic, header, payload)?;
    mac(key, header, payload)
        .verify_slice(&header[8..])
        .map_err(|_| {
            DkvError::Unauthenticated(format!(
                "{what}: its tag does not verify under this cluster's dKV key (forged, altered, \
                 or sealed by another cluster)"
            ))
        })?;
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

    #[test]
    fn keyed_envelopes_open_under_their_key_only() {
        let key = DkvKey::from_bytes([7; 32]);
        let other = DkvKey::from_bytes([8; 32]);
        let payload: Vec<u8> = (0..120u8).collect();
        let blob = seal_keyed(&key, MAGIC_UCX_ADDRESS, &payload);
        fn open<'a>(k: &DkvKey, b: &'a [u8]) -> Result<&'a [u8], DkvError> {
            open_keyed(k, "a", MAGIC_UCX_ADDRESS, b)
        }
        assert_eq!(open(&key, &blob).ok(), Some(&payload[..]));
        assert!(matches!(
            open(&other, &blob),
            Err(DkvError::Unauthenticated(_))
        ));
        assert!(open_keyed(&key, "a", MAGIC_LOCAL_ADDRESS, &blob).is_err());
        // Any changed bit, anywhere: the tag fails (or the shape does).
        for i in 0..blob.len() {
            let mut b = blob.clone();
            b[i] ^= 0x01;
            assert!(open(&key, &b).is_err(), "flip {i}");
        }
        for cut in 0..blob.len() {
            assert!(open(&key, &blob[..cut]).is_err(), "cut {cut}");
        }
        // A changed address resealed without the key: the old checksum
        // envelope, or a tag under another key.
        let mut forged = payload.clone();
        forged[63] = 0xff;
        let unkeyed = seal(MAGIC_UNKEYED_UCX_ADDRESS, &forged);
        match open(&key, &unkeyed) {
            Err(DkvError::InvalidDescriptor(m)) => assert!(m.contains("older build"), "{m}"),
            other => panic!("{other:?}"),
        }
        let mut relabelled = seal(MAGIC_UCX_ADDRESS, &forged);
        relabelled.resize(KEYED_HEADER + forged.len(), 0);
        assert!(open(&key, &relabelled).is_err());
        assert!(matches!(
            open(&key, &seal_keyed(&other, MAGIC_UCX_ADDRESS, &forged)),
            Err(DkvError::Unauthenticated(_))
        ));
        // The same address sealed for the in-process transport is another
        // envelope: the magic is under the tag.
        let mut local = blob.clone();
        local[..4].copy_from_slice(&MAGIC_LOCAL_ADDRESS);
        assert!(matches!(
            open_keyed(&key, "a", MAGIC_LOCAL_ADDRESS, &local),
            Err(DkvError::Unauthenticated(_))
        ));
    }
}
