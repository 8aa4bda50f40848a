//! For fuzzing the receiving side with a real UCX sender (the `dkv_ucx`
//! fuzz target): a stranger's own UCX worker that sends a node raw
//! KV-write active messages, any header, any length, eager or rendezvous.
//! Not for serving.

pub use crate::ucx::raw::RawAm;
use crate::ucx::raw::RawSender as Inner;
use crate::ucx::sys::UCS_INPROGRESS;
use crate::{DkvError, DkvKey, RemoteRegion};

/// Bytes of a real KV-write header: the grant token, then the offset.
pub const HEADER_LEN: usize = crate::ucx::AM_HEADER_LEN;

/// A UCP context and worker of its own, over tcp on loopback.
pub struct RawSender(Inner);

impl std::fmt::Debug for RawSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawSender")
    }
}

impl RawSender {
    pub fn new() -> Result<Self, DkvError> {
        Inner::new(false).map(Self)
    }

    /// Sends `msgs` to the worker whose address `remote` carries (it must
    /// verify under `key`: this is the fuzzer's own receiver), at most 64
    /// in flight; each send's final UCX status (0 is success), or
    /// [`DkvError::DeadlineExceeded`] if one had not finished in a minute.
    pub fn send(
        &self,
        key: &DkvKey,
        remote: &RemoteRegion,
        msgs: &[RawAm],
    ) -> Result<Vec<i8>, DkvError> {
        let address = key.open_address(&remote.worker_address)?;
        let ep = self.0.connect(address).map_err(|s| DkvError::Ucx {
            op: "ucp_ep_create",
            status: self.0.ucp.status_string(s),
        })?;
        let statuses = self.0.send_ams(ep, msgs, 64);
        if statuses.contains(&UCS_INPROGRESS) {
            // A send that never finished may still read `msgs`: the
            // endpoint stays open (a hang is the caller's finding).
            return Err(DkvError::DeadlineExceeded);
        }
        // SAFETY: `ep` is open, ours, and every send on it has completed.
        unsafe { self.0.close(ep) };
        Ok(statuses)
    }
}

/// `token` (any 32 bytes) in a grant envelope with a valid checksum.
pub fn seal_grant(token: &[u8; 32]) -> Vec<u8> {
    crate::descriptor::seal(crate::descriptor::MAGIC_GRANT, token)
}

/// The raw 32 bytes of `remote`'s grant token (for headers of one's own).
pub fn token_bytes(remote: &RemoteRegion) -> Result<[u8; 32], DkvError> {
    Ok(crate::grant::Token::open(&remote.grant)?.to_bytes())
}
