//! A stranger's own UCX: a UCP context and worker of its own that dials a
//! node's worker by address and sends it raw KV-write active messages
//! (any header, any length, eager or rendezvous), or, with RMA, raw puts
//! (`attack.rs`). What the attack tests and the `dkv_ucx` fuzz target
//! throw at a real receiver.

use std::ffi::c_void;
use std::ptr;
use std::time::{Duration, Instant};

use super::AM_KV_WRITE;
use super::sys::*;
use crate::DkvError;

/// A bare UCP context and worker over tcp on loopback, which sends what
/// it is told.
pub(crate) struct RawSender {
    pub(crate) ucp: &'static Ucp,
    pub(crate) ctx: ucp_context_h,
    pub(crate) worker: ucp_worker_h,
}

impl RawSender {
    /// A context (with RMA when `rma`) and worker over tcp on loopback.
    pub(crate) fn new(rma: bool) -> Result<Self, DkvError> {
        let ucp = load(None)?;
        let fail = |op: &str, s: ucs_status_t| DkvError::Ucx {
            op: "raw sender setup",
            status: format!("{op}: {}", ucp.status_string(s)),
        };
        let mut config: *mut ucp_config_t = ptr::null_mut();
        // SAFETY: plain UCX setup calls with out-pointers to locals and
        // NUL-terminated strings; every status is checked, and what was
        // made is undone on failure.
        unsafe {
            let s = ucp.ucp_config_read(ptr::null(), ptr::null(), &mut config);
            if s != UCS_OK {
                return Err(fail("ucp_config_read", s));
            }
            for (k, v) in [(c"TLS", c"tcp"), (c"NET_DEVICES", c"lo")] {
                let s = ucp.ucp_config_modify(config, k.as_ptr(), v.as_ptr());
                if s != UCS_OK {
                    ucp.ucp_config_release(config);
                    return Err(fail("ucp_config_modify", s));
                }
            }
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = u64::from(UCP_PARAM_FIELD_FEATURES);
            params.features = u64::from(if rma {
                UCP_FEATURE_RMA | UCP_FEATURE_AM
            } else {
                UCP_FEATURE_AM
            });
            let mut ctx: ucp_context_h = ptr::null_mut();
            let s = ucp.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx);
            ucp.ucp_config_release(config);
            if s != UCS_OK {
                return Err(fail("ucp_init", s));
            }
            let mut wp: ucp_worker_params_t = std::mem::zeroed();
            wp.field_mask = u64::from(UCP_WORKER_PARAM_FIELD_THREAD_MODE);
            wp.thread_mode = UCS_THREAD_MODE_SINGLE;
            let mut worker: ucp_worker_h = ptr::null_mut();
            let s = ucp.ucp_worker_create(ctx, &wp, &mut worker);
            if s != UCS_OK {
                ucp.ucp_cleanup(ctx);
                return Err(fail("ucp_worker_create", s));
            }
            Ok(Self { ucp, ctx, worker })
        }
    }

    /// Progresses until `req` completes (or 5 s pass); its status.
    pub(crate) fn wait(&self, req: ucs_status_ptr_t) -> ucs_status_t {
        if req.is_null() {
            return UCS_OK;
        }
        if ptr_is_err(req) {
            return ptr_status(req);
        }
        let ucp = self.ucp;
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            // SAFETY: the worker is live; `req` came from it.
            unsafe { ucp.ucp_worker_progress(self.worker) };
            // SAFETY: as above.
            let s = unsafe { ucp.ucp_request_check_status(req) };
            if s != UCS_INPROGRESS || Instant::now() > until {
                // SAFETY: ours, freed once.
                unsafe { ucp.ucp_request_free(req) };
                return s;
            }
        }
    }

    /// An endpoint to the worker at `address` (a real UCX worker address).
    pub(crate) fn connect(&self, address: &[u8]) -> Result<ucp_ep_h, ucs_status_t> {
        let mut padded = address.to_vec();
        padded.resize(address.len() + 1024, 0);
        // SAFETY: all-zero is a valid ucp_ep_params_t; the address is
        // zero-padded so UCX's length-less parse stays in bounds; `ep` is
        // an out-pointer to a local.
        unsafe {
            let mut p: ucp_ep_params_t = std::mem::zeroed();
            p.field_mask = u64::from(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
            p.address = padded.as_ptr().cast();
            let mut ep: ucp_ep_h = ptr::null_mut();
            match self.ucp.ucp_ep_create(self.worker, &p, &mut ep) {
                UCS_OK => Ok(ep),
                s => Err(s),
            }
        }
    }

    /// Force-closes `ep` and waits for it.
    ///
    /// # Safety
    /// `ep` is an open endpoint of this worker, closed once, with no
    /// request on it still reading memory that is gone.
    pub(crate) unsafe fn close(&self, ep: ucp_ep_h) {
        // SAFETY: all-zero is a valid ucp_request_param_t; the caller
        // vouches for `ep`.
        unsafe {
            let mut cp: ucp_request_param_t = std::mem::zeroed();
            cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
            let r = self.ucp.ucp_ep_close_nbx(ep, &cp);
            self.wait(r);
        }
    }

    /// Sends every message of `msgs` to `ep` as a KV write (`AM_KV_WRITE`),
    /// at most `window` in flight, eager or rendezvous as each says; the
    /// payload is 0x5A bytes. Returns each send's final status,
    /// `UCS_INPROGRESS` for one still pending after a minute (whose header
    /// in `msgs` UCX may then still read: keep `msgs`, and `ep` open).
    pub(crate) fn send_ams(
        &self,
        ep: ucp_ep_h,
        msgs: &[RawAm],
        window: usize,
    ) -> Vec<ucs_status_t> {
        let ucp = self.ucp;
        let longest = msgs.iter().map(|m| m.len).max().unwrap_or(0);
        let payload = vec![0x5Au8; longest.max(1)];
        let mut statuses = vec![UCS_INPROGRESS; msgs.len()];
        // (message index, request); headers live in `msgs` until the end.
        let mut pending: Vec<(usize, *mut c_void)> = Vec::new();
        let mut next = 0;
        let until = Instant::now() + Duration::from_secs(60);
        while (next < msgs.len() || !pending.is_empty()) && Instant::now() < until {
            while next < msgs.len() && pending.len() < window {
                let m = &msgs[next];
                // SAFETY: all-zero is a valid ucp_request_param_t; the
                // header and payload outlive the request (waited for
                // below); `ep` is open.
                let r = unsafe {
                    let mut p: ucp_request_param_t = std::mem::zeroed();
                    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
                    p.flags = if m.rndv {
                        UCP_AM_SEND_FLAG_RNDV
                    } else {
                        UCP_AM_SEND_FLAG_EAGER
                    };
                    ucp.ucp_am_send_nbx(
                        ep,
                        AM_KV_WRITE,
                        m.header.as_ptr().cast(),
                        m.header.len(),
                        payload.as_ptr().cast(),
                        m.len,
                        &p,
                    )
                };
                if r.is_null() {
                    statuses[next] = UCS_OK;
                } else if ptr_is_err(r) {
                    statuses[next] = ptr_status(r);
                } else {
                    pending.push((next, r));
                }
                next += 1;
            }
            // SAFETY: the worker is live and used by this thread only.
            unsafe { ucp.ucp_worker_progress(self.worker) };
            pending.retain(|&(i, req)| {
                // SAFETY: `req` came from this worker and is not freed yet.
                let s = unsafe { ucp.ucp_request_check_status(req) };
                if s == UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: complete and ours; freed once.
                unsafe { ucp.ucp_request_free(req) };
                statuses[i] = s;
                false
            });
        }
        if !pending.is_empty() {
            // Given up on, but UCX may still read the payload.
            std::mem::forget(payload);
        }
        statuses
    }
}

/// One active message to send as a KV write.
#[derive(Clone, Debug)]
pub struct RawAm {
    /// Any bytes (a real header is a grant token and an offset).
    pub header: Vec<u8>,
    /// Payload bytes (0x5A).
    pub len: usize,
    /// Rendezvous (else eager).
    pub rndv: bool,
}

impl Drop for RawSender {
    fn drop(&mut self) {
        let ucp = self.ucp;
        // SAFETY: created in `new`, destroyed once, nothing else uses them.
        unsafe {
            ucp.ucp_worker_destroy(self.worker);
            ucp.ucp_cleanup(self.ctx);
        }
    }
}
