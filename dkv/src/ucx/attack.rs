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

use super::AM_HEADER_LEN;
use super::raw::{RawAm as Am, RawSender};
use super::sys::*;
use crate::grant::{TOKEN_LEN, Token};
use crate::tests::{dkv_metrics, wait_for};
use crate::{Dkv, DkvConfig, WriteOp};
use tandem_testkit::TestMeter;

/// The attacker of these tests: with RMA, to try raw puts too.
struct Attacker;

impl Attacker {
    #[allow(clippy::new_ret_no_self)]
    fn new() -> RawSender {
        RawSender::new(true).unwrap()
    }
}

impl RawSender {
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
}

#[test]
fn raw_puts_from_a_stranger_land_nowhere() {
    let cfg = tcp();
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
    let address = crate::process_key()
        .unwrap()
        .open_address(&grant.descriptor().worker_address)
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
    let address = crate::process_key()
        .unwrap()
        .open_address(&desc.worker_address)
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
