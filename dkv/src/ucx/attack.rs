//! An attacker with a UCX stack of its own, on the same network: it dials
//! a node's worker (the address is in every descriptor) and
//!
//! - packs a key for memory of its own and issues raw software puts (what
//!   UCX's tcp and shared-memory transports do for RMA) at the node's KV
//!   pool. Before grants, such puts landed wherever the sender said; now
//!   the node's context has no RMA at all, so they land nowhere;
//! - floods the node with KV-write active messages it has no grant for,
//!   eager and rendezvous, at full rate. Each is refused and counted, and
//!   refusing leaves nothing behind in UCX (a refused rendezvous message
//!   was once released twice, which crashed the node).
//!
//! Either way the node keeps serving its real grant holders.

#![allow(clippy::unwrap_used)]

use std::ffi::c_void;
use std::ptr;
use std::time::{Duration, Instant};

use super::sys::*;
use super::{AM_HEADER_LEN, AM_KV_WRITE};
use crate::descriptor::{self, MAGIC_UCX_ADDRESS};
use crate::grant::{TOKEN_LEN, Token};
use crate::tests::{dkv_metrics, wait_for};
use crate::{Dkv, DkvConfig, TransportKind, WriteOp};
use tandem_testkit::TestMeter;

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
        let ep = match self.connect(address) {
            Ok(ep) => ep,
            Err(s) => {
                said.push(format!("ep_create: {}", ucp.status_string(s)));
                return said;
            }
        };
        // SAFETY: FFI with checked statuses; the endpoint is open; the
        // source buffer outlives the puts (they are waited for) and the
        // mapping is undone at the end.
        unsafe {
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
            self.close(ep);
            ucp.ucp_mem_unmap(self.ctx, memh);
        }
        said
    }

    /// An endpoint to the worker at `address` (a real UCX worker address).
    fn connect(&self, address: &[u8]) -> Result<ucp_ep_h, ucs_status_t> {
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
    unsafe fn close(&self, ep: ucp_ep_h) {
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
    /// payload is 0x5A bytes. Returns each send's final status.
    fn send_ams(&self, ep: ucp_ep_h, msgs: &[Am], window: usize) -> Vec<ucs_status_t> {
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
        statuses
    }
}

/// One active message of the flood.
struct Am {
    header: Vec<u8>,
    len: usize,
    rndv: bool,
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

/// The node of the tests: UCX over tcp on loopback.
fn tcp() -> DkvConfig {
    DkvConfig {
        ucx_tls: Some("tcp".into()),
        ucx_net_devices: Some("lo".into()),
        ..DkvConfig::ucx()
    }
}

/// A KV-write header: `token` (any 32 bytes) and the offset.
fn header(token: [u8; TOKEN_LEN], offset: u64) -> Vec<u8> {
    let mut h = token.to_vec();
    h.extend_from_slice(&offset.to_le_bytes());
    assert_eq!(h.len(), AM_HEADER_LEN);
    h
}

/// Hundreds of refused writes from a stranger's own UCX, eager and
/// rendezvous, small and large, as fast as it can send them: each is
/// refused and counted under its reason, every one of the stranger's sends
/// completes (UCX acknowledged and dropped the refused rendezvous data:
/// nothing is left pending on either side), nothing lands, the real grant
/// is untouched, and the grant holder's write still lands afterwards, in a
/// live process. (Releasing a refused rendezvous message in the handler as
/// well as returning UCS_OK freed UCX's descriptor twice and crashed the
/// receiver within a few hundred such messages.)
#[test]
fn a_flood_of_refused_messages_leaves_ucx_intact() {
    let meter = TestMeter::new();
    let node = Dkv::with_metrics(tcp(), dkv_metrics(&meter)).unwrap();
    const LEN: usize = 1 << 20;
    let pool = node.alloc(LEN).unwrap();
    // SAFETY: the region's memory is live while `pool` lives; nothing
    // writes it during these reads but the transports under test.
    let bytes = || unsafe { std::slice::from_raw_parts(pool.as_ptr(), LEN) }.to_vec();
    let granted = LEN as u64 / 2;
    let grant = pool
        .grant(
            std::slice::from_ref(&(0..granted)),
            Instant::now() + Duration::from_secs(120),
        )
        .unwrap();
    let desc = grant.descriptor();
    let address = descriptor::open("a", MAGIC_UCX_ADDRESS, &desc.worker_address)
        .unwrap()
        .to_vec();
    let real = Token::open(&desc.grant).unwrap();
    let forged = Token {
        secret: [0x11; 16],
        ..real
    };
    let unknown = Token {
        id: real.id + 1000,
        ..real
    };
    // (header, reason): a wrong secret for the live grant, a grant that
    // does not exist, and headers that are not grant headers at all.
    let headers: [(Vec<u8>, &str); 4] = [
        (header(forged.to_bytes(), 0), "forged"),
        (header(unknown.to_bytes(), 4096), "unknown"),
        (vec![7; AM_HEADER_LEN - 1], "malformed"),
        (Vec::new(), "malformed"),
    ];
    // Eager: one fragment, and several (assembled by UCX); rendezvous:
    // a KV layer of a block, and more than a whole block.
    let sizes = [
        (1024, false),
        (40 << 10, false),
        (12 << 10, true),
        (400 << 10, true),
    ];
    const ROUNDS: usize = 40;
    let mut msgs = Vec::new();
    let mut want: std::collections::BTreeMap<String, f64> = Default::default();
    for _ in 0..ROUNDS {
        for (h, reason) in &headers {
            for &(len, rndv) in &sizes {
                msgs.push(Am {
                    header: h.clone(),
                    len,
                    rndv,
                });
                *want.entry((*reason).to_owned()).or_default() += 1.0;
            }
        }
    }
    let total = msgs.len() as u64;
    assert_eq!(total, 640);
    let attacker = Attacker::new();
    let ep = attacker.connect(&address).unwrap();
    let statuses = attacker.send_ams(ep, &msgs, 64);
    assert!(
        statuses.iter().all(|&s| s == UCS_OK),
        "the stranger's sends did not all complete: {:?}",
        statuses
            .iter()
            .map(|&s| attacker.ucp.status_string(s))
            .collect::<std::collections::BTreeSet<_>>()
    );
    wait_for(|| node.refused_writes() >= total, "every message refused");
    assert_eq!(node.refused_writes(), total);
    let by_reason = meter
        .points()
        .by_label("tandem.dkv.refused_writes", "reason");
    let counted: std::collections::BTreeMap<String, f64> =
        by_reason.into_iter().filter(|(_, n)| *n > 0.0).collect();
    assert_eq!(counted, want);
    // Nothing landed, nothing is held: no receive in flight, the grant
    // alone is live and none of it was used up.
    assert!(bytes().iter().all(|&b| b == 0));
    let seen = node.inspect();
    assert_eq!(seen.receives, 0, "{seen:?}");
    assert_eq!(node.live_grants(), 1);
    assert_eq!(grant.landed(), 0);

    // The stranger is still connected and may go on; the grant holder's
    // write lands all the same.
    let writer = Dkv::new(tcp()).unwrap();
    let src = writer.alloc(granted as usize).unwrap();
    // SAFETY: `src` is ours and idle.
    unsafe { ptr::write_bytes(src.as_ptr(), 7, granted as usize) };
    // Rendezvous-sized ops and eager-sized ones.
    let ops = [
        WriteOp {
            local_offset: 0,
            remote_offset: 0,
            len: granted - 512,
        },
        WriteOp {
            local_offset: granted - 512,
            remote_offset: granted - 512,
            len: 512,
        },
    ];
    let deadline = Instant::now() + Duration::from_secs(20);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(writer.write(&src, &desc, &ops, deadline))
        .unwrap();
    rt.block_on(grant.complete(deadline)).unwrap();
    let after = bytes();
    assert!(after[..granted as usize].iter().all(|&b| b == 7));
    assert!(after[granted as usize..].iter().all(|&b| b == 0));
    assert_eq!(node.refused_writes(), total);
    // A second flood after the real write: refused the same way.
    let statuses = attacker.send_ams(ep, &msgs[..64], 64);
    assert!(statuses.iter().all(|&s| s == UCS_OK));
    wait_for(
        || node.refused_writes() == total + 64,
        "the second flood refused",
    );
    // SAFETY: the endpoint is open and idle.
    unsafe { attacker.close(ep) };
    drop(grant);
    wait_for(|| node.live_grants() == 0, "grant gone");
    assert_eq!(node.inspect().receives, 0);
}
