//! Write bandwidth between two processes over UCX.
//!
//! ```text
//! dkv_bench server [--tls TLS] [--size BYTES] [--register] [PLAN]
//!     allocates BYTES with Dkv::alloc (or registers heap memory) and grants
//!     all of it once per write the client's PLAN makes (a byte lands once
//!     per grant); prints one `DESC <addr hex> <grant hex> <len>` line per
//!     grant, then `END <n>`; progresses until stdin closes and checks what
//!     the client wrote (and that the receiver refused nothing).
//! dkv_bench client [--desc-file FILE] [--tls TLS] [PLAN]
//!     reads the server's DESC lines (from FILE, or stdin up to `END`) and
//!     uses each for one write(). For each size (MiB) writes it as one op
//!     per block, as one merged op, and per block four writes at a time;
//!     prints `RESULT size=B mode=blocks|merged|blocks-q4 ops=N best=X median=Y`
//!     in MB/s, where MB = 2^20 bytes as ucx_perftest counts them; with
//!     --lat-reps, also `LATENCY bytes=64 p50= p90= p99= us` of 64-byte writes.
//! PLAN, the same on both sides: [--sizes 1,4,16,64] [--block 65536]
//!     [--reps 10] [--warmup 3] [--lat-reps N]
//! ```
//! Both sides use the same offsets, so the server can verify the pattern.
//! Grants are made before the timed writes (as a decode node grants its
//! blocks before it asks a prefill node for them).

use std::io::{BufRead, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_dkv::{Dkv, DkvConfig, Grant, RemoteRegion, TransportKind, WriteOp};

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 12)) as u8
}

/// Heap memory handed to dkv through a raw pointer (see `Dkv::register`).
struct Buf {
    ptr: *mut u8,
    len: usize,
}
// SAFETY: plain heap bytes; accesses are ordered by write completion.
unsafe impl Send for Buf {}
// SAFETY: as above.
unsafe impl Sync for Buf {}
impl Buf {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Arc<Self> {
        let v: Vec<u8> = (0..len).map(fill).collect();
        Arc::new(Self {
            ptr: Box::into_raw(v.into_boxed_slice()).cast(),
            len,
        })
    }
}
impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: undoes the leak in `new`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("odd hex length".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn dkv(args: &[String]) -> Result<Dkv, String> {
    let tls = arg(args, "--tls");
    Dkv::new(DkvConfig {
        transport: TransportKind::Ucx,
        ucx_tls: tls,
        ucx_net_devices: None,
        ucx_library: None,
        key: None,
    })
    .map_err(|e| e.to_string())
}

/// What the client writes: both sides parse it from the same options, so
/// the server knows how many grants to make.
struct Plan {
    sizes: Vec<u64>,
    block: u64,
    reps: usize,
    warmup: usize,
    lat_reps: usize,
}

/// Untimed 64-byte writes before the latency samples.
const LAT_WARMUP: usize = 100;
/// Writes per round of each mode: blocks, merged, blocks-q4.
const MODES: [(&str, usize); 3] = [("blocks", 1), ("merged", 1), ("blocks-q4", 4)];

impl Plan {
    fn parse(args: &[String]) -> Result<Plan, String> {
        let num = |name: &str, default: usize| -> Result<usize, String> {
            arg(args, name)
                .map_or(Ok(default), |s| s.parse())
                .map_err(|e| format!("{name}: {e}"))
        };
        let sizes = arg(args, "--sizes")
            .unwrap_or_else(|| "1,4,16,64".into())
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<u64>()
                    .map(|m| m << 20)
                    .map_err(|e| format!("--sizes: {e}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Plan {
            sizes,
            block: num("--block", 64 << 10)? as u64,
            reps: num("--reps", 10)?.max(1),
            warmup: num("--warmup", 3)?,
            lat_reps: num("--lat-reps", 0)?,
        })
    }

    /// write() calls the client makes: each needs a grant of its own.
    fn writes(&self) -> usize {
        let per_size: usize = MODES.iter().map(|(_, depth)| depth).sum();
        let lat = if self.lat_reps > 0 {
            self.lat_reps + LAT_WARMUP
        } else {
            0
        };
        self.sizes.len() * (self.warmup + self.reps) * per_size + lat
    }
}

fn server(args: &[String]) -> Result<(), String> {
    let size: usize = arg(args, "--size")
        .map_or(Ok(64 << 20), |s| s.parse())
        .map_err(|e| format!("--size: {e}"))?;
    let plan = Plan::parse(args)?;
    let d = dkv(args)?;
    // --register: the target is ordinary heap memory registered with
    // ucp_mem_map; default: memory from Dkv::alloc (transport-allocated).
    let (region, _buf) = if args.iter().any(|a| a == "--register") {
        let buf = Buf::new(size, |_| 0);
        // SAFETY: the region keeps `buf` alive.
        let r = unsafe { d.register(buf.ptr, buf.len, buf.clone()) }.map_err(|e| e.to_string())?;
        (r, Some(buf))
    } else {
        (d.alloc(size).map_err(|e| e.to_string())?, None)
    };
    // One grant of the whole region per write: every write of the plan
    // writes its bytes again. Generous expiry: the run takes minutes.
    let expires = Instant::now() + Duration::from_secs(3600);
    let whole = 0..size as u64;
    let grants: Vec<Grant> = (0..plan.writes())
        .map(|_| region.grant(std::slice::from_ref(&whole), expires))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("grant: {e}"))?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for g in &grants {
        let desc = g.descriptor();
        writeln!(
            out,
            "DESC {} {} {}",
            hex(&desc.worker_address),
            hex(&desc.grant),
            desc.len
        )
        .map_err(|e| e.to_string())?;
    }
    writeln!(out, "END {}", grants.len()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    // The dkv thread receives the writes; we only wait for EOF.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    // Every write landed (its bytes are checked below) and none was
    // refused; the client's last write may still be finishing its landing.
    let until = Instant::now() + Duration::from_secs(5);
    while grants.iter().any(|g| g.landed() == 0) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    let unused = grants.iter().filter(|g| g.landed() == 0).count();
    if d.refused_writes() != 0 || unused != 0 {
        return Err(format!(
            "server: {} writes refused, {unused} of {} grants got nothing",
            d.refused_writes(),
            grants.len()
        ));
    }
    drop(grants);
    let written: usize = arg(args, "--verify")
        .map_or(Ok(size), |s| s.parse())
        .map_err(|e| format!("--verify: {e}"))?;
    // SAFETY: the region (and its memory) is alive; the client is done.
    let got = unsafe { std::slice::from_raw_parts(region.as_ptr(), region.len()) };
    match (0..written.min(size)).find(|&i| got[i] != pattern(i)) {
        None => eprintln!(
            "server: verified {} bytes; {} grants, each written, none refused",
            written.min(size),
            plan.writes()
        ),
        Some(i) => return Err(format!("server: byte {i} is {} not {}", got[i], pattern(i))),
    }
    drop(region);
    d.shutdown();
    Ok(())
}

fn parse_desc(line: &str) -> Result<RemoteRegion, String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    match f.as_slice() {
        ["DESC", a, g, len] => Ok(RemoteRegion {
            worker_address: unhex(a)?,
            grant: unhex(g)?,
            len: len.parse().map_err(|e| format!("len: {e}"))?,
        }),
        _ => Err(format!("not a DESC line: {line:?}")),
    }
}

/// The server's DESC lines up to its `END <n>` line (which must be there:
/// a missing one is a server that did not finish printing).
fn read_descs(input: impl BufRead) -> Result<Vec<RemoteRegion>, String> {
    let mut descs = Vec::new();
    for line in input.lines() {
        let line = line.map_err(|e| e.to_string())?;
        let line = line.trim();
        if let Some(n) = line.strip_prefix("END ") {
            let n: usize = n.parse().map_err(|e| format!("END: {e}"))?;
            if n != descs.len() {
                return Err(format!("END {n} after {} DESC lines", descs.len()));
            }
            return Ok(descs);
        }
        descs.push(parse_desc(line)?);
    }
    Err(format!("no END line after {} DESC lines", descs.len()))
}

fn client(args: &[String]) -> Result<(), String> {
    let descs = match arg(args, "--desc-file") {
        Some(path) => {
            let f = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
            read_descs(std::io::BufReader::new(f))?
        }
        None => read_descs(std::io::stdin().lock())?,
    };
    let plan = Plan::parse(args)?;
    if descs.len() < plan.writes() {
        return Err(format!(
            "{} descriptors for {} writes: give the server the same plan options",
            descs.len(),
            plan.writes()
        ));
    }
    let remote_len = descs.iter().map(|d| d.len).min().unwrap_or(0);
    // One grant per write(), in order.
    let mut descs = descs.into_iter();
    let mut next = move || descs.next().ok_or_else(|| "out of grants".to_owned());
    let (block, reps, warmup) = (plan.block, plan.reps, plan.warmup);
    let sizes = &plan.sizes;
    let max = sizes.iter().copied().max().unwrap_or(0).min(remote_len) as usize;
    let d = dkv(args)?;
    let buf = Buf::new(max, pattern);
    // SAFETY: the region keeps `buf` alive.
    let local = unsafe { d.register(buf.ptr, buf.len, buf.clone()) }.map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    for &size in sizes {
        if size > max as u64 {
            return Err(format!("size {size} exceeds the regions ({max} bytes)"));
        }
        let blocks: Vec<WriteOp> = (0..size.div_ceil(block))
            .map(|i| WriteOp {
                local_offset: i * block,
                remote_offset: i * block,
                len: block.min(size - i * block),
            })
            .collect();
        let merged = vec![WriteOp {
            local_offset: 0,
            remote_offset: 0,
            len: size,
        }];
        // blocks-q4: the per-block write four times concurrently (as a node
        // with several layers or requests in flight), so the fixed cost of
        // one write() overlaps with the others' data movement.
        for (mode, depth) in MODES {
            let ops = if mode == "merged" { &merged } else { &blocks };
            let mut mbs = Vec::with_capacity(reps);
            let dl = || Instant::now() + Duration::from_secs(60);
            for i in 0..warmup + reps {
                let remotes: Vec<RemoteRegion> =
                    (0..depth).map(|_| next()).collect::<Result<_, _>>()?;
                let t = Instant::now();
                let bytes = rt
                    .block_on(async {
                        let w = |r| d.write(&local, r, ops, dl());
                        match remotes.as_slice() {
                            [r] => w(r).await.map(|s| s.bytes),
                            [r1, r2, r3, r4] => {
                                let (a, b, c, e) = tokio::join!(w(r1), w(r2), w(r3), w(r4));
                                Ok(a?.bytes + b?.bytes + c?.bytes + e?.bytes)
                            }
                            _ => unreachable!("depth is 1 or 4"),
                        }
                    })
                    .map_err(|e| format!("write {size} B {mode}: {e}"))?;
                let secs = t.elapsed().as_secs_f64();
                if i >= warmup {
                    mbs.push(bytes as f64 / secs / (1024.0 * 1024.0));
                }
            }
            mbs.sort_by(f64::total_cmp);
            println!(
                "RESULT size={size} mode={mode} ops={} best={:.1} median={:.1}",
                ops.len() * depth,
                mbs[mbs.len() - 1],
                mbs[mbs.len() / 2]
            );
        }
    }
    // Small-write latency: the fixed cost of one write() (command to the
    // transport thread, put, flush round trip, completion back).
    let lat_reps = plan.lat_reps;
    if lat_reps > 0 {
        let op = [WriteOp {
            local_offset: 0,
            remote_offset: 0,
            len: 64,
        }];
        let mut us = Vec::with_capacity(lat_reps);
        for i in 0..lat_reps + LAT_WARMUP {
            let remote = next()?;
            let t = Instant::now();
            rt.block_on(d.write(
                &local,
                &remote,
                &op,
                Instant::now() + Duration::from_secs(10),
            ))
            .map_err(|e| format!("latency write: {e}"))?;
            if i >= LAT_WARMUP {
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        us.sort_by(f64::total_cmp);
        println!(
            "LATENCY bytes=64 p50={:.1} p90={:.1} p99={:.1} us",
            us[us.len() / 2],
            us[us.len() * 9 / 10],
            us[us.len() * 99 / 100]
        );
    }
    drop(local);
    d.shutdown();
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        Some("server") => server(&args),
        Some("client") => client(&args),
        _ => Err("usage: dkv_bench server|client [options] (see the source header)".into()),
    };
    if let Err(e) = r {
        eprintln!("dkv_bench: {e}");
        std::process::exit(1);
    }
}
