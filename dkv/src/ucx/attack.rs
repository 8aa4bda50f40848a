//! An attacker with a UCX stack of its own, on the same network: it dials
//! a node's worker (the address is in every descriptor), packs a key for
//! memory of its own, and issues raw software puts (what UCX's tcp and
//! shared-memory transports do for RMA) at the node's KV pool. Before
//! grants, such puts landed wherever the sender said; now the node's
//! context has no RMA at all, so they land nowhere, and the node keeps
//! serving.

#![allow(clippy::unwrap_used)]

use std::ffi::c_void;
use std::ptr;
use std::time::{Duration, Instant};

use super::sys::*;
use crate::descriptor::{self, MAGIC_UCX_ADDRESS};
use crate::{Dkv, DkvConfig, TransportKind, WriteOp};

/// A bare UCP context and worker with RMA, over tcp on loopback.
struct Attacker {
    ucp: &'static Ucp,
    ctx: ucp_context_h,
    worker: ucp_worker_h,
}

impl Attacker {
    fn new() -> Self {
        let ucp = load(None).unwrap();
        let mut config: *mut ucp_config_t = ptr::null_mut();
        // SAFETY: plain UCX setup calls with out-pointers to locals and
        // NUL-terminated strings; every status is checked.
        unsafe {
            assert_eq!(
                ucp.ucp_config_read(ptr::null(), ptr::null(), &mut config),
                UCS_OK
            );
            assert_eq!(
                ucp.ucp_config_modify(config, c"TLS".as_ptr(), c"tcp".as_ptr()),
                UCS_OK
            );
            assert_eq!(
                ucp.ucp_config_modify(config, c"NET_DEVICES".as_ptr(), c"lo".as_ptr()),
                UCS_OK
            );
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = u64::from(UCP_PARAM_FIELD_FEATURES);
            params.features = u64::from(UCP_FEATURE_RMA | UCP_FEATURE_AM);
            let mut ctx: ucp_context_h = ptr::null_mut();
            let s = ucp.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx);
            ucp.ucp_config_release(config);
            assert_eq!(s, UCS_OK);
            let mut wp: ucp_worker_params_t = std::mem::zeroed();
            wp.field_mask = u64::from(UCP_WORKER_PARAM_FIELD_THREAD_MODE);
            wp.thread_mode = UCS_THREAD_MODE_SINGLE;
            let mut worker: ucp_worker_h = ptr::null_mut();
            assert_eq!(ucp.ucp_worker_create(ctx, &wp, &mut worker), UCS_OK);
            Self { ucp, ctx, worker }
        }
    }

    /// Progresses until `req` completes (or 5 s pass); its status.
    fn wait(&self, req: ucs_status_ptr_t) -> ucs_status_t {
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

    /// Everything the attacker can try against `address`, aimed at
    /// `[target, target + len)`; returns what UCX said at each step.
    fn raw_puts(&self, address: &[u8], target: u64, len: usize) -> Vec<String> {
        let ucp = self.ucp;
        let mut said = Vec::new();
        let mut padded = address.to_vec();
        padded.resize(address.len() + 1024, 0);
        // SAFETY: FFI with checked statuses; the address is a real UCX
        // worker address, zero-padded; the source buffer outlives the puts
        // (they are waited for) and the mapping is undone at the end.
        unsafe {
            let mut ep_params: ucp_ep_params_t = std::mem::zeroed();
            ep_params.field_mask = u64::from(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
            ep_params.address = padded.as_ptr().cast();
            let mut ep: ucp_ep_h = ptr::null_mut();
            let s = ucp.ucp_ep_create(self.worker, &ep_params, &mut ep);
            said.push(format!("ep_create: {}", self.ucp.status_string(s)));
            if s != UCS_OK {
                return said;
            }
            let mut src = vec![0x5Au8; len];
            let mut mp: ucp_mem_map_params_t = std::mem::zeroed();
            mp.field_mask =
                u64::from(UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH);
            mp.address = src.as_mut_ptr().cast();
            mp.length = len;
            let mut memh: ucp_mem_h = ptr::null_mut();
            assert_eq!(ucp.ucp_mem_map(self.ctx, &mp, &mut memh), UCS_OK);
            let mut packed: *mut c_void = ptr::null_mut();
            let mut size = 0usize;
            assert_eq!(
                ucp.ucp_rkey_pack(self.ctx, memh, &mut packed, &mut size),
                UCS_OK
            );
            let mut rkey: ucp_rkey_h = ptr::null_mut();
            let s = ucp.ucp_ep_rkey_unpack(ep, packed, &mut rkey);
            said.push(format!("rkey_unpack: {}", self.ucp.status_string(s)));
            if s == UCS_OK {
                for off in [0, len / 2] {
                    let p: ucp_request_param_t = std::mem::zeroed();
                    let r = ucp.ucp_put_nbx(
                        ep,
                        src.as_ptr().add(off).cast(),
                        len - off,
                        target + off as u64,
                        rkey,
                        &p,
                    );
                    said.push(format!("put: {}", self.ucp.status_string(self.wait(r))));
                }
                let p: ucp_request_param_t = std::mem::zeroed();
                let r = ucp.ucp_ep_flush_nbx(ep, &p);
                said.push(format!("flush: {}", self.ucp.status_string(self.wait(r))));
                ucp.ucp_rkey_destroy(rkey);
            }
            ucp.ucp_rkey_buffer_release(packed);
            let mut cp: ucp_request_param_t = std::mem::zeroed();
            cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
            let r = ucp.ucp_ep_close_nbx(ep, &cp);
            self.wait(r);
            ucp.ucp_mem_unmap(self.ctx, memh);
        }
        said
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        let ucp = self.ucp;
        // SAFETY: created in `new`, destroyed once, nothing else uses them.
        unsafe {
            ucp.ucp_worker_destroy(self.worker);
            ucp.ucp_cleanup(self.ctx);
        }
    }
}

#[test]
fn raw_puts_from_a_stranger_land_nowhere() {
    let cfg = DkvConfig {
        transport: TransportKind::Ucx,
        ucx_tls: Some("tcp".into()),
        ucx_net_devices: Some("lo".into()),
        ucx_library: None,
    };
    let node = Dkv::new(cfg.clone()).unwrap();
    const LEN: usize = 256 * 1024;
    let pool = node.alloc(LEN).unwrap();
    // SAFETY: the region's memory is live while `pool` lives; nothing
    // writes it during these reads but the transports under test.
    let bytes = || unsafe { std::slice::from_raw_parts(pool.as_ptr(), LEN) }.to_vec();
    assert!(bytes().iter().all(|&b| b == 0));
    // A live grant on part of the pool: the attacker does not have it,
    // only the node's address (which every descriptor carries).
    let grant = pool
        .grant(
            std::slice::from_ref(&(0..LEN as u64 / 2)),
            Instant::now() + Duration::from_secs(60),
        )
        .unwrap();
    let address = descriptor::open("a", MAGIC_UCX_ADDRESS, &grant.descriptor().worker_address)
        .unwrap()
        .to_vec();

    let said = Attacker::new().raw_puts(&address, pool.as_ptr() as u64, LEN);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        bytes().iter().all(|&b| b == 0),
        "a stranger's raw put landed ({said:?})"
    );

    // The node still serves its grant holder.
    let writer = Dkv::new(cfg).unwrap();
    let src = writer.alloc(LEN / 2).unwrap();
    // SAFETY: `src` is ours and idle.
    unsafe { ptr::write_bytes(src.as_ptr(), 7, LEN / 2) };
    let op = WriteOp {
        local_offset: 0,
        remote_offset: 0,
        len: LEN as u64 / 2,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(writer.write(&src, &grant.descriptor(), &[op], deadline))
        .unwrap();
    rt.block_on(grant.complete(deadline)).unwrap();
    let after = bytes();
    assert!(after[..LEN / 2].iter().all(|&b| b == 7));
    assert!(after[LEN / 2..].iter().all(|&b| b == 0));
}
