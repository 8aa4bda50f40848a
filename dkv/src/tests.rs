//! Transfers between two `Dkv`s in one process, over UCX (tcp and shared
//! memory) and the in-process transport.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_testkit::{Point, TestMeter};

use crate::*;

/// Heap memory owned through a raw pointer, so a test can read what a peer
/// wrote without aliasing a live `Box`.
pub(crate) struct Buf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain heap bytes; tests synchronise through write completion.
unsafe impl Send for Buf {}
// SAFETY: as above.
unsafe impl Sync for Buf {}

impl Buf {
    pub(crate) fn new(len: usize, fill: impl Fn(usize) -> u8) -> Arc<Self> {
        let v: Vec<u8> = (0..len).map(fill).collect();
        let ptr = Box::into_raw(v.into_boxed_slice()).cast::<u8>();
        Arc::new(Self { ptr, len })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: ptr/len from a leaked boxed slice, alive until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: reconstitutes the boxed slice leaked in `new`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

pub(crate) fn register(dkv: &Dkv, buf: &Arc<Buf>) -> Region {
    // SAFETY: the Region keeps `buf` (which owns the memory) alive.
    unsafe { dkv.register(buf.ptr, buf.len, buf.clone()) }.expect("register")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn pair(cfg: &DkvConfig) -> (Dkv, Dkv) {
    (
        Dkv::new(cfg.clone()).expect("dkv a"),
        Dkv::new(cfg.clone()).expect("dkv b"),
    )
}

#[cfg(dkv_ucx)]
fn tcp() -> DkvConfig {
    DkvConfig {
        transport: TransportKind::Ucx,
        ucx_tls: Some("tcp".into()),
        ucx_net_devices: Some("lo".into()),
    }
}

#[cfg(dkv_ucx)]
fn shm() -> DkvConfig {
    DkvConfig {
        transport: TransportKind::Ucx,
        ucx_tls: Some("posix,sysv,cma,self".into()),
        ucx_net_devices: None,
    }
}

const BLOCK: u64 = 64 * 1024;
const BLOCKS: u64 = 80;

/// Writes 1..64 blocks at scattered offsets and checks every byte of the
/// destination: written ranges hold the source, the rest is untouched.
fn patterns(cfg: DkvConfig) {
    let (a, b) = pair(&cfg);
    let src = Buf::new((BLOCK * BLOCKS) as usize, |i| (i * 7 + i / 65536) as u8);
    let dst = Buf::new((BLOCK * BLOCKS) as usize, |_| 0xEE);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let mut model = dst.bytes().to_vec();
    let rt = rt();
    for (n, src0, dst0, shift) in [
        (1u64, 0u64, 0u64, 0u64),
        (2, 3, 10, 17),
        (7, 40, 1, 4096),
        (64, 5, 15, 1),
        (16, 60, 62, 0),
    ] {
        // Block i of the run goes to dst block (dst0 + n - 1 - i): reversed,
        // so nothing merges; plus a sub-block shift on the remote side.
        let ops: Vec<WriteOp> = (0..n)
            .map(|i| WriteOp {
                local_offset: (src0 + i) * BLOCK,
                remote_offset: (dst0 + n - 1 - i) * BLOCK + shift,
                len: BLOCK - shift,
            })
            .collect();
        let stats = rt
            .block_on(a.write(&ra, &desc, &ops, Instant::now() + Duration::from_secs(10)))
            .unwrap_or_else(|e| panic!("{} blocks: {e}", n));
        assert_eq!(stats.ops, n as usize);
        for op in &ops {
            let (l, r, len) = (
                op.local_offset as usize,
                op.remote_offset as usize,
                op.len as usize,
            );
            model[r..r + len].copy_from_slice(&src.bytes()[l..l + len]);
        }
        assert_eq!(stats.bytes, ops.iter().map(|o| o.len).sum::<u64>());
        let got = dst.bytes();
        if let Some(i) = (0..got.len()).find(|&i| got[i] != model[i]) {
            panic!(
                "{n} blocks: first difference at byte {i}: {} != {}",
                got[i], model[i]
            );
        }
    }
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_tcp_patterns() {
    patterns(tcp());
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_shm_patterns() {
    patterns(shm());
}

#[test]
fn in_process_patterns() {
    patterns(DkvConfig::in_process());
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn block_op(l: u64, r: u64) -> WriteOp {
    WriteOp {
        local_offset: l * BLOCK,
        remote_offset: r * BLOCK,
        len: BLOCK,
    }
}

/// Out-of-bounds ops are rejected before anything is sent: the destination
/// stays untouched even when earlier ops in the list were fine.
fn out_of_bounds(cfg: DkvConfig) {
    let (a, b) = pair(&cfg);
    let src = Buf::new(4 * BLOCK as usize, |i| i as u8);
    let dst = Buf::new(2 * BLOCK as usize, |_| 0xEE);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let rt = rt();
    let bad: [(&str, Vec<WriteOp>); 6] = [
        ("remote end", vec![block_op(0, 0), block_op(1, 2)]),
        ("local end", vec![block_op(0, 0), block_op(4, 1)]),
        (
            "one byte over",
            vec![WriteOp {
                local_offset: 0,
                remote_offset: BLOCK + 1,
                len: BLOCK,
            }],
        ),
        (
            "offset overflow",
            vec![WriteOp {
                local_offset: 0,
                remote_offset: u64::MAX,
                len: 2,
            }],
        ),
        (
            "len overflow",
            vec![WriteOp {
                local_offset: u64::MAX - 1,
                remote_offset: 0,
                len: u64::MAX,
            }],
        ),
        (
            "huge len",
            vec![WriteOp {
                local_offset: 0,
                remote_offset: 0,
                len: u64::MAX,
            }],
        ),
    ];
    for (what, ops) in bad {
        match rt.block_on(a.write(&ra, &desc, &ops, deadline())) {
            Err(DkvError::OutOfBounds(m)) => assert!(m.contains("op "), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    assert!(
        dst.bytes().iter().all(|&x| x == 0xEE),
        "nothing may be written"
    );
    // Empty ops and empty lists are fine.
    let empty = WriteOp {
        local_offset: 4 * BLOCK,
        remote_offset: 2 * BLOCK,
        len: 0,
    };
    let s = rt
        .block_on(a.write(&ra, &desc, &[empty], deadline()))
        .expect("empty op");
    assert_eq!((s.bytes, s.ops), (0, 1));
    assert!(rt.block_on(a.write(&ra, &desc, &[], deadline())).is_ok());
    // A region of another instance cannot be the source.
    assert!(matches!(
        rt.block_on(a.write(&rb, &desc, &[], deadline())),
        Err(DkvError::InvalidRegion(_))
    ));
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_out_of_bounds() {
    out_of_bounds(tcp());
}

#[test]
fn in_process_out_of_bounds() {
    out_of_bounds(DkvConfig::in_process());
}

/// Descriptors are network input: garbage of every kind is an error, never
/// a panic or a write.
fn garbage(cfg: DkvConfig, other: Option<DkvConfig>) {
    let (a, b) = pair(&cfg);
    let src = Buf::new(BLOCK as usize, |i| i as u8);
    let dst = Buf::new(BLOCK as usize, |_| 0xEE);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let good = rb.descriptor();
    let ops = [WriteOp {
        local_offset: 0,
        remote_offset: 0,
        len: 16,
    }];
    let rt = rt();
    let mut cases: Vec<(String, RemoteRegion)> = Vec::new();
    let mut with = |what: &str, f: &dyn Fn(&mut RemoteRegion)| {
        let mut d = good.clone();
        f(&mut d);
        cases.push((what.to_owned(), d));
    };
    with("empty address", &|d| d.worker_address.clear());
    with("empty rkey", &|d| d.rkey.clear());
    with("random address", &|d| {
        d.worker_address = (0..200).map(|i| (i * 37) as u8).collect()
    });
    with("random rkey", &|d| {
        d.rkey = (0..60).map(|i| (i * 91 + 5) as u8).collect()
    });
    with("truncated address", &|d| {
        d.worker_address.truncate(d.worker_address.len() / 2)
    });
    with("truncated rkey", &|d| d.rkey.truncate(d.rkey.len() - 1));
    with("flipped address", &|d| {
        let n = d.worker_address.len();
        d.worker_address[n - 3] ^= 1;
    });
    with("flipped rkey", &|d| {
        let n = d.rkey.len();
        d.rkey[n - 1] ^= 0x80;
    });
    with("other base", &|d| d.base += 8);
    with("longer len", &|d| d.len += 1);
    with("overflowing base", &|d| d.base = u64::MAX - 4);
    with("address and rkey swapped", &|d| {
        std::mem::swap(&mut d.worker_address, &mut d.rkey)
    });
    // An intact envelope around a payload UCX would abort on (found by an
    // attacker: byte 0x28, then zeros): refused before UCX sees it.
    if good
        .worker_address
        .starts_with(&crate::descriptor::MAGIC_UCX_ADDRESS)
    {
        let mut payload = vec![0u8; 200];
        payload[0] = 0x28;
        cases.push((
            "forged UCX address".into(),
            RemoteRegion {
                worker_address: crate::descriptor::seal(
                    crate::descriptor::MAGIC_UCX_ADDRESS,
                    &payload,
                ),
                ..good.clone()
            },
        ));
    }
    // A descriptor of the other transport.
    let other = other.map(|cfg| {
        let o = Dkv::new(cfg).expect("other dkv");
        let obuf = Buf::new(BLOCK as usize, |_| 0);
        let oreg = register(&o, &obuf);
        cases.push(("other transport".into(), oreg.descriptor()));
        (o, oreg)
    });
    for (what, d) in cases {
        match rt.block_on(a.write(&ra, &d, &ops, deadline())) {
            Err(DkvError::InvalidDescriptor(_)) => {}
            Err(DkvError::OutOfBounds(_)) if what == "longer len" => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    assert!(dst.bytes().iter().all(|&x| x == 0xEE));
    drop(other);
    // The good descriptor still works afterwards.
    rt.block_on(a.write(&ra, &good, &ops, deadline()))
        .expect("good descriptor");
    assert_eq!(&dst.bytes()[..16], &src.bytes()[..16]);
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_garbage_descriptors() {
    garbage(tcp(), Some(DkvConfig::in_process()));
}

#[test]
fn in_process_garbage_descriptors() {
    #[cfg(dkv_ucx)]
    let other = Some(tcp());
    #[cfg(not(dkv_ucx))]
    let other = None;
    garbage(DkvConfig::in_process(), other);
}

fn past_deadline(cfg: DkvConfig) {
    let (a, b) = pair(&cfg);
    let src = Buf::new(BLOCK as usize, |i| i as u8);
    let dst = Buf::new(BLOCK as usize, |_| 0xEE);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let r = rt().block_on(a.write(&ra, &rb.descriptor(), &[block_op(0, 0)], Instant::now()));
    assert!(matches!(r, Err(DkvError::DeadlineExceeded)), "{r:?}");
    assert!(dst.bytes().iter().all(|&x| x == 0xEE));
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_past_deadline() {
    past_deadline(tcp());
}

#[test]
fn in_process_past_deadline() {
    past_deadline(DkvConfig::in_process());
}

fn region_drop_deregisters(cfg: DkvConfig) {
    let a = Dkv::new(cfg).expect("dkv");
    let bufs: Vec<_> = (0..5).map(|_| Buf::new(4096, |_| 0)).collect();
    let regions: Vec<Region> = bufs.iter().map(|b| register(&a, b)).collect();
    assert_eq!(a.live_registrations(), 5);
    // The region owns its memory: only the test's Arc and the region's.
    assert_eq!(Arc::strong_count(&bufs[0]), 2);
    drop(regions);
    wait_for(|| a.live_registrations() == 0, "registrations undone");
    wait_for(|| Arc::strong_count(&bufs[0]) == 1, "owner released");
    // Shutdown with live regions undoes them too; later calls fail cleanly.
    let r = register(&a, &bufs[1]);
    a.shutdown();
    assert_eq!(a.live_registrations(), 0);
    // SAFETY: as in `register`.
    assert!(matches!(
        unsafe { a.register(bufs[2].ptr, 16, bufs[2].clone()) },
        Err(DkvError::Shutdown)
    ));
    let w = rt().block_on(a.write(&r, &r.descriptor(), &[], deadline()));
    assert!(matches!(w, Err(DkvError::Shutdown)), "{w:?}");
    drop(r);
    wait_for(
        || Arc::strong_count(&bufs[1]) == 1,
        "owner released after shutdown",
    );
}

pub(crate) fn wait_for(mut f: impl FnMut() -> bool, what: &str) {
    let until = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_region_drop_deregisters() {
    region_drop_deregisters(tcp());
}

#[test]
fn in_process_region_drop_deregisters() {
    region_drop_deregisters(DkvConfig::in_process());
}

#[test]
fn rejects_bad_registrations() {
    #[cfg(dkv_ucx)]
    let cfgs = [tcp(), DkvConfig::in_process()];
    #[cfg(not(dkv_ucx))]
    let cfgs = [DkvConfig::in_process()];
    for cfg in cfgs {
        let a = Dkv::new(cfg).expect("dkv");
        let b = Buf::new(16, |_| 0);
        // SAFETY: rejected before any use of the pointer.
        assert!(matches!(
            unsafe { a.register(std::ptr::null_mut(), 16, b.clone()) },
            Err(DkvError::InvalidRegion(_))
        ));
        // SAFETY: as above.
        assert!(matches!(
            unsafe { a.register(b.ptr, 0, b.clone()) },
            Err(DkvError::InvalidRegion(_))
        ));
        assert_eq!(a.live_registrations(), 0);
    }
}

#[test]
fn in_process_peer_gone() {
    let (a, b) = pair(&DkvConfig::in_process());
    let src = Buf::new(BLOCK as usize, |i| i as u8);
    let dst = Buf::new(BLOCK as usize, |_| 0xEE);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    b.shutdown();
    let r = rt().block_on(a.write(&ra, &desc, &[block_op(0, 0)], deadline()));
    assert!(matches!(r, Err(DkvError::PeerUnreachable(_))), "{r:?}");
    drop(rb);
    assert!(dst.bytes().iter().all(|&x| x == 0xEE));
}

/// dkv's instruments on `meter`'s provider (leaked: a `Dkv` keeps them for
/// its life, as it keeps the process's).
pub(crate) fn dkv_metrics(meter: &TestMeter) -> &'static DkvMetrics {
    Box::leak(Box::new(DkvMetrics::new(&meter.meter())))
}

/// Each outcome of `write` is recorded once, under the bounded labels:
/// `connector` on everything, plus `reason` on failures.
#[test]
fn writes_are_recorded_with_bounded_labels() {
    let meter = TestMeter::new();
    let a = Dkv::with_metrics(DkvConfig::in_process(), dkv_metrics(&meter)).expect("dkv a");
    let b = Dkv::new(DkvConfig::in_process()).expect("dkv b");
    let src = Buf::new(4 * BLOCK as usize, |i| i as u8);
    let dst = Buf::new(4 * BLOCK as usize, |_| 0);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let rt = rt();
    let local = [("connector", "local")];
    let failures = |points: &[Point]| -> BTreeMap<String, f64> {
        points
            .iter()
            .filter(|p| p.name == "tandem.dkv.transfer_failures")
            .map(|p| (p.label("reason").expect("a reason").to_owned(), p.value))
            .collect()
    };
    let reasons = |counts: [f64; 5]| -> BTreeMap<String, f64> {
        ["bounds", "cancelled", "deadline", "peer", "transport"]
            .into_iter()
            .map(str::to_owned)
            .zip(counts)
            .collect()
    };
    // Every reason exists, at zero, before the first failure.
    assert_eq!(failures(&meter.points()), reasons([0.0; 5]));

    rt.block_on(a.write(&ra, &desc, &[block_op(0, 1), block_op(2, 3)], deadline()))
        .expect("write");
    rt.block_on(a.write(&ra, &desc, &[block_op(1, 0)], deadline()))
        .expect("write");
    let p = meter.points();
    let bytes = p.point("tandem.dkv.bytes_transferred", &local).clone();
    assert_eq!(
        (bytes.value, bytes.unit.as_str()),
        (3.0 * BLOCK as f64, "By")
    );
    let latency = p.point("tandem.dkv.transfer_latency", &local);
    assert_eq!((latency.count, latency.unit.as_str()), (2, "ms"));
    assert!(
        latency.value > 0.0 && latency.value < 10_000.0,
        "{latency:?}"
    );
    assert_eq!(failures(&p), reasons([0.0; 5]));

    // One failure of each kind a local write can have.
    let bounds = rt.block_on(a.write(&ra, &desc, &[block_op(0, 4)], deadline()));
    assert!(
        matches!(bounds, Err(DkvError::OutOfBounds(_))),
        "{bounds:?}"
    );
    let late = rt.block_on(a.write(&ra, &desc, &[block_op(0, 0)], Instant::now()));
    assert!(matches!(late, Err(DkvError::DeadlineExceeded)), "{late:?}");
    b.shutdown();
    for _ in 0..2 {
        let gone = rt.block_on(a.write(&ra, &desc, &[block_op(0, 0)], deadline()));
        assert!(
            matches!(gone, Err(DkvError::PeerUnreachable(_))),
            "{gone:?}"
        );
    }
    a.shutdown();
    let closed = rt.block_on(a.write(&ra, &desc, &[block_op(0, 0)], deadline()));
    assert!(matches!(closed, Err(DkvError::Shutdown)), "{closed:?}");

    let p = meter.points();
    assert_eq!(failures(&p), reasons([1.0, 0.0, 1.0, 2.0, 1.0]));
    // Failures moved no bytes and took no latency sample.
    assert_eq!(p.point("tandem.dkv.bytes_transferred", &local), &bytes);
    assert_eq!(p.point("tandem.dkv.transfer_latency", &local).count, 2);
    for pt in p.iter() {
        let keys: Vec<&str> = pt.labels.iter().map(|(k, _)| k.as_str()).collect();
        let want_keys: &[&str] = if pt.name == "tandem.dkv.transfer_failures" {
            &["connector", "reason"]
        } else {
            &["connector"]
        };
        assert_eq!(keys, want_keys, "{pt:?}");
        assert_eq!(pt.label("connector"), Some("local"), "{pt:?}");
    }
    drop((ra, rb));
}

/// Every error maps to one of the documented, bounded `reason` values.
#[test]
fn every_error_has_a_bounded_reason() {
    let cases = [
        (DkvError::UcxUnavailable(String::new()), "transport"),
        (
            DkvError::Ucx {
                op: "put",
                status: String::new(),
            },
            "transport",
        ),
        (DkvError::OutOfBounds(String::new()), "bounds"),
        (DkvError::InvalidDescriptor(String::new()), "bounds"),
        (DkvError::InvalidRegion(String::new()), "bounds"),
        (DkvError::InvalidLayout(String::new()), "bounds"),
        (DkvError::DeadlineExceeded, "deadline"),
        (DkvError::PeerUnreachable(String::new()), "peer"),
        (DkvError::Shutdown, "transport"),
    ];
    for (e, reason) in cases {
        assert_eq!(e.reason(), reason, "{e:?}");
    }
}

/// A peer that stops progressing (TCP puts need the target to progress):
/// the write fails at its deadline, its state is reclaimed, and the next
/// write after the peer recovers succeeds.
#[cfg(dkv_ucx)]
#[test]
fn ucx_deadline_with_stalled_peer() {
    let (a, b) = pair(&tcp());
    let src = Buf::new(16 * BLOCK as usize, |i| (i % 251) as u8);
    let dst = Buf::new(16 * BLOCK as usize, |_| 0xEE);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let rt = rt();
    let ops = [WriteOp {
        local_offset: 0,
        remote_offset: 0,
        len: 16 * BLOCK,
    }];
    rt.block_on(a.write(&ra, &desc, &ops, deadline()))
        .expect("warm-up write");
    b.stall(Duration::from_millis(1200));
    std::thread::sleep(Duration::from_millis(20));
    let t = Instant::now();
    let r = rt.block_on(a.write(
        &ra,
        &desc,
        &ops,
        Instant::now() + Duration::from_millis(200),
    ));
    let took = t.elapsed();
    assert!(matches!(r, Err(DkvError::DeadlineExceeded)), "{r:?}");
    assert!(
        took >= Duration::from_millis(190) && took < Duration::from_millis(900),
        "{took:?}"
    );
    wait_for(|| a.inspect().transfers == 0, "stalled transfer reclaimed");
    // Once the peer is back, writes work again (over a new endpoint if the
    // old one was force-closed).
    let t = Instant::now();
    let ops2 = [WriteOp {
        local_offset: 0,
        remote_offset: 8 * BLOCK,
        len: 8 * BLOCK,
    }];
    rt.block_on(a.write(&ra, &desc, &ops2, Instant::now() + Duration::from_secs(5)))
        .expect("write after the peer recovered");
    assert!(t.elapsed() < Duration::from_secs(3));
    assert_eq!(
        &dst.bytes()[8 * BLOCK as usize..],
        &src.bytes()[..8 * BLOCK as usize]
    );
}

/// Dropping the write future stops it: no more puts are issued, the
/// transfer is reclaimed, and the tail of a large write never arrives.
#[cfg(dkv_ucx)]
#[test]
fn ucx_drop_cancels() {
    let meter = TestMeter::new();
    let a = Dkv::with_metrics(tcp(), dkv_metrics(&meter)).expect("dkv a");
    let b = Dkv::new(tcp()).expect("dkv b");
    const LEN: usize = 48 << 20;
    let src = Buf::new(LEN, |i| (i % 253) as u8 | 1);
    let dst = Buf::new(LEN, |_| 0);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let rt = rt();
    let small = [WriteOp {
        local_offset: 0,
        remote_offset: 0,
        len: 4096,
    }];
    rt.block_on(a.write(&ra, &desc, &small, deadline()))
        .expect("warm-up write");
    b.stall(Duration::from_millis(800));
    std::thread::sleep(Duration::from_millis(20));
    let ops = [WriteOp {
        local_offset: 0,
        remote_offset: 0,
        len: LEN as u64,
    }];
    let r = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_millis(100),
            a.write(&ra, &desc, &ops, deadline()),
        )
        .await
    });
    assert!(
        r.is_err(),
        "the write cannot finish while the peer is stalled: {r:?}"
    );
    wait_for(
        || a.inspect().transfers == 0,
        "cancelled transfer reclaimed",
    );
    // Counted once, as cancelled (not as the deadline or peer failure the
    // transport might see afterwards).
    let p = meter.points();
    let failures: Vec<&Point> = p
        .iter()
        .filter(|p| p.name == "tandem.dkv.transfer_failures" && p.value > 0.0)
        .collect();
    let cancelled = p.point(
        "tandem.dkv.transfer_failures",
        &[("connector", "ucx"), ("reason", "cancelled")],
    );
    assert_eq!((failures.len(), cancelled.value), (1, 1.0), "{failures:?}");
    // Let the peer wake up and drain whatever reached it.
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(b.inspect().transfers, 0);
    let tail = &dst.bytes()[LEN - (16 << 20)..];
    assert!(
        tail.iter().all(|&x| x == 0),
        "bytes past the posted window arrived"
    );
    // The pair still works.
    let last = [WriteOp {
        local_offset: 0,
        remote_offset: LEN as u64 - 4096,
        len: 4096,
    }];
    rt.block_on(a.write(&ra, &desc, &last, deadline()))
        .expect("write after cancel");
    assert_eq!(&dst.bytes()[LEN - 4096..], &src.bytes()[..4096]);
}

/// A peer that shut down is reported as unreachable, promptly.
#[cfg(dkv_ucx)]
#[test]
fn ucx_peer_gone() {
    let (a, b) = pair(&tcp());
    let src = Buf::new(BLOCK as usize, |i| i as u8);
    let dst = Buf::new(BLOCK as usize, |_| 0);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let rt = rt();
    rt.block_on(a.write(&ra, &desc, &[block_op(0, 0)], deadline()))
        .expect("first write");
    drop(rb);
    b.shutdown();
    let t = Instant::now();
    let r = rt.block_on(a.write(
        &ra,
        &desc,
        &[block_op(0, 0)],
        Instant::now() + Duration::from_secs(5),
    ));
    assert!(matches!(r, Err(DkvError::PeerUnreachable(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    wait_for(
        || a.inspect().transfers == 0 && a.inspect().closing == 0,
        "endpoint closed",
    );
}

/// Concurrent writes from several tasks to one peer share its endpoint.
#[cfg(dkv_ucx)]
#[test]
fn ucx_concurrent_writes() {
    let (a, b) = pair(&tcp());
    let src = Buf::new(32 * BLOCK as usize, |i| (i * 13) as u8);
    let dst = Buf::new(32 * BLOCK as usize, |_| 0);
    let (ra, rb) = (Arc::new(register(&a, &src)), register(&b, &dst));
    let desc = Arc::new(rb.descriptor());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("rt");
    rt.block_on(async {
        let tasks: Vec<_> = (0..8u64)
            .map(|t| {
                let (a, ra, desc) = (a.clone(), ra.clone(), desc.clone());
                tokio::spawn(async move {
                    let ops: Vec<WriteOp> = (0..4)
                        .map(|i| block_op(t * 4 + i, 31 - (t * 4 + i)))
                        .collect();
                    a.write(&ra, &desc, &ops, deadline()).await
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("join").expect("write");
        }
    });
    for blk in 0..32usize {
        let b = BLOCK as usize;
        assert_eq!(
            &dst.bytes()[(31 - blk) * b..(32 - blk) * b],
            &src.bytes()[blk * b..(blk + 1) * b],
            "block {blk}"
        );
    }
    assert_eq!(a.inspect().peers, 1);
}

/// A UCX that cannot start is reported as unavailable, as an error, in
/// every build: with UCX compiled in, a transport list UCX rejects (its
/// "transport is not available" lines on stderr are expected); without it,
/// any UCX request.
#[test]
fn ucx_unavailable_is_reported() {
    for tls in ["no_such_transport", "tcp\0posix"] {
        let cfg = DkvConfig {
            transport: TransportKind::Ucx,
            ucx_tls: Some(tls.into()),
            ucx_net_devices: None,
        };
        let m = match Dkv::new(cfg) {
            Err(DkvError::UcxUnavailable(m)) => m,
            other => panic!("UCX_TLS={tls:?}: {other:?}"),
        };
        #[cfg(dkv_ucx)]
        let want = if tls.contains('\0') {
            "contains NUL"
        } else {
            "ucp_init"
        };
        #[cfg(not(dkv_ucx))]
        let want = "without UCX";
        assert!(m.contains(want), "UCX_TLS={tls:?}: {m}");
    }
    // The default configuration works exactly when UCX is compiled in.
    let default = Dkv::new(DkvConfig::ucx());
    #[cfg(dkv_ucx)]
    assert_eq!(default.expect("UCX with its defaults").connector(), "ucx");
    #[cfg(not(dkv_ucx))]
    assert!(
        matches!(&default, Err(DkvError::UcxUnavailable(m)) if m.contains("without UCX")),
        "{default:?}"
    );
}

#[test]
fn handles_and_futures_are_send() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<Dkv>();
    send_sync::<Region>();
    send_sync::<RemoteRegion>();
    let a = Dkv::new(DkvConfig::in_process()).expect("dkv");
    let r = a.alloc(64).expect("alloc");
    let d = r.descriptor();
    let f = a.write(&r, &d, &[], deadline());
    send(&f);
}

/// A `Dkv` writing into its own regions (all roles in one process).
fn self_write(cfg: DkvConfig) {
    let a = Dkv::new(cfg).expect("dkv");
    let src = a.alloc(2 * BLOCK as usize).expect("alloc src");
    let dst = a.alloc(2 * BLOCK as usize).expect("alloc dst");
    // SAFETY: the region is alive and nothing else touches it now.
    unsafe { std::slice::from_raw_parts_mut(src.as_ptr(), src.len()) }
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 239) as u8);
    let rt = rt();
    rt.block_on(a.write(
        &src,
        &dst.descriptor(),
        &[block_op(1, 0), block_op(0, 1)],
        deadline(),
    ))
    .expect("self write");
    // SAFETY: as above; the write completed.
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src.as_ptr(), src.len()),
            std::slice::from_raw_parts(dst.as_ptr(), dst.len()),
        )
    };
    let b = BLOCK as usize;
    assert_eq!(&d[..b], &s[b..]);
    assert_eq!(&d[b..], &s[..b]);
    assert_eq!(a.live_registrations(), 2);
    drop((src, dst));
    wait_for(|| a.live_registrations() == 0, "alloc regions freed");
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_tcp_self_write() {
    self_write(tcp());
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_shm_self_write() {
    self_write(shm());
}

#[test]
fn in_process_self_write() {
    self_write(DkvConfig::in_process());
}

/// Shutting down fails a write in flight instead of leaving it hanging.
#[cfg(dkv_ucx)]
#[test]
fn ucx_shutdown_fails_inflight_writes() {
    let (a, b) = pair(&tcp());
    let src = Buf::new(16 << 20, |i| i as u8);
    let dst = Buf::new(16 << 20, |_| 0);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let rt = rt();
    let small = [WriteOp {
        local_offset: 0,
        remote_offset: 0,
        len: 4096,
    }];
    rt.block_on(a.write(&ra, &desc, &small, deadline()))
        .expect("warm-up write");
    b.stall(Duration::from_millis(500));
    let stopper = {
        let a = a.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            a.shutdown();
        })
    };
    let ops = [WriteOp {
        local_offset: 0,
        remote_offset: 0,
        len: 16 << 20,
    }];
    let r = rt.block_on(a.write(&ra, &desc, &ops, deadline()));
    assert!(matches!(r, Err(DkvError::Shutdown)), "{r:?}");
    stopper.join().expect("stopper");
    assert_eq!(a.live_registrations(), 0);
}

/// Ops from `KvLayout` end to end: a TP=2 prefill rank (2 of 4 heads per
/// block) writes its head slices into a full decode block, then whole
/// blocks move in merged runs. The model is built head by head, independent
/// of the op generator.
fn layout_end_to_end(cfg: DkvConfig) {
    let hs = 1024u64;
    let geo = |heads: u32| KvLayout {
        block_bytes: 3 * 2 * u64::from(heads) * hs,
        layer_bytes: 2 * u64::from(heads) * hs,
        head_slice_bytes: hs,
        num_layers: 3,
        num_kv_heads: heads,
    };
    let (src_l, dst_l) = (geo(2), geo(4));
    let (a, b) = pair(&cfg);
    let src = Buf::new((8 * src_l.block_bytes) as usize, |i| (i / 7 % 251) as u8);
    let dst = Buf::new((8 * dst_l.block_bytes) as usize, |_| 0xEE);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let (sb, db) = ([1u32, 2, 5], [6u32, 0, 3]);
    let ops = src_l
        .head_slice_ops_to(&dst_l, &sb, &db, 0..2, 2)
        .expect("ops");
    rt().block_on(a.write(&ra, &desc, &ops, deadline()))
        .expect("head slices");
    let mut model = vec![0xEEu8; dst.bytes().len()];
    for (&s, &d) in sb.iter().zip(&db) {
        for layer in 0..3u64 {
            for kv in 0..2u64 {
                for h in 0..2u64 {
                    let from = s as u64 * src_l.block_bytes
                        + layer * src_l.layer_bytes
                        + (kv * 2 + h) * hs;
                    let to = d as u64 * dst_l.block_bytes
                        + layer * dst_l.layer_bytes
                        + (kv * 4 + 2 + h) * hs;
                    let (f, t, n) = (from as usize, to as usize, hs as usize);
                    model[t..t + n].copy_from_slice(&src.bytes()[f..f + n]);
                }
            }
        }
    }
    assert!(
        dst.bytes() == model.as_slice(),
        "head slices differ from the model"
    );
    // Whole blocks of the destination layout within the decode node's own
    // region: runs 0..3 -> 4..7 merge into one op.
    let whole = dst_l.block_ops(&[0, 1, 2], &[4, 5, 6]).expect("ops");
    assert_eq!(whole.len(), 1);
    let rb2 = register(&b, &dst);
    rt().block_on(b.write(&rb2, &desc, &whole, deadline()))
        .expect("blocks");
    let n = (3 * dst_l.block_bytes) as usize;
    let o = (4 * dst_l.block_bytes) as usize;
    assert_eq!(&dst.bytes()[o..o + n], &model[..n]);
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_layout_end_to_end() {
    layout_end_to_end(tcp());
}

#[test]
fn in_process_layout_end_to_end() {
    layout_end_to_end(DkvConfig::in_process());
}

/// The fence: a transfer cancelled mid-way may still have puts in flight;
/// once `flush_peer` resolves, nothing more lands in the peer's memory.
fn flush_peer_fences_cancelled_writes(cfg: DkvConfig) {
    let (a, b) = pair(&cfg);
    let src = Buf::new((BLOCK * BLOCKS) as usize, |i| (i % 251) as u8);
    let dst = Buf::new((BLOCK * BLOCKS) as usize, |_| 0);
    let (ra, rb) = (register(&a, &src), register(&b, &dst));
    let desc = rb.descriptor();
    let rt = rt();
    // Never talked to: nothing to flush.
    rt.block_on(a.flush_peer(&desc.worker_address))
        .expect("flush without an endpoint");
    // Not an address at all.
    assert!(matches!(
        rt.block_on(a.flush_peer(b"junk")),
        Err(DkvError::InvalidDescriptor(_))
    ));
    let ops: Vec<WriteOp> = (0..BLOCKS).map(|i| block_op(i, i)).collect();
    for round in 0..5u64 {
        // Cancelled after a short while, usually with puts still queued.
        let cut = Duration::from_micros(200 * (round + 1));
        let _ = rt.block_on(async {
            tokio::time::timeout(cut, a.write(&ra, &desc, &ops, deadline())).await
        });
        rt.block_on(a.flush_peer(&desc.worker_address))
            .expect("flush after a cancelled write");
        let fenced = dst.bytes().to_vec();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            dst.bytes() == &fenced[..],
            "round {round}: bytes landed after the fence"
        );
    }
    // The endpoint still works for new writes after the fence.
    rt.block_on(a.write(&ra, &desc, &ops[..1], deadline()))
        .expect("write after the fence");
}

#[cfg(dkv_ucx)]
#[test]
fn ucx_tcp_flush_peer_fences_cancelled_writes() {
    flush_peer_fences_cancelled_writes(tcp());
}

#[test]
fn in_process_flush_peer_is_immediate() {
    let (a, b) = pair(&DkvConfig::in_process());
    let dst = Buf::new(BLOCK as usize, |_| 0);
    let rb = register(&b, &dst);
    rt().block_on(a.flush_peer(&rb.descriptor().worker_address))
        .expect("in-process flush");
}
