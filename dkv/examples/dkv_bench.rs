//! Write bandwidth between two processes over UCX.
//!
//! ```text
//! dkv_bench server [--tls TLS] [--size BYTES] [--register]
//!     allocates BYTES with Dkv::alloc (or registers heap memory), prints `DESC <addr hex> <rkey hex> <base> <len>`, then
//!     progresses until stdin closes and checks what the client wrote.
//! dkv_bench client --desc "<DESC line>" [--tls TLS] [--sizes 1,4,16,64]
//!     [--block 65536] [--reps 10] [--warmup 3] [--lat-reps N]
//!     for each size (MiB) writes it as one op per block, as one merged
//!     op, and per block four writes at a time; prints
//!     `RESULT size=B mode=blocks|merged|blocks-q4 ops=N best=X median=Y`
//!     in MB/s, where MB = 2^20 bytes as ucx_perftest counts them; with
//!     --lat-reps, also `LATENCY bytes=64 p50= p90= p99= us` of 64-byte writes.
//! ```
//! Both sides use the same offsets, so the server can verify the pattern.

use std::io::{BufRead, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_dkv::{Dkv, DkvConfig, RemoteRegion, TransportKind, WriteOp};

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
    })
    .map_err(|e| e.to_string())
}

fn server(args: &[String]) -> Result<(), String> {
    let size: usize = arg(args, "--size")
        .map_or(Ok(64 << 20), |s| s.parse())
        .map_err(|e| format!("--size: {e}"))?;
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
    let desc = region.descriptor();
    println!(
        "DESC {} {} {} {}",
        hex(&desc.worker_address),
        hex(&desc.rkey),
        desc.base,
        desc.len
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // The dkv thread progresses incoming puts; we only wait for EOF.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    let written: usize = arg(args, "--verify")
        .map_or(Ok(size), |s| s.parse())
        .map_err(|e| format!("--verify: {e}"))?;
    // SAFETY: the region (and its memory) is alive; the client is done.
    let got = unsafe { std::slice::from_raw_parts(region.as_ptr(), region.len()) };
    match (0..written.min(size)).find(|&i| got[i] != pattern(i)) {
        None => eprintln!("server: verified {} bytes", written.min(size)),
        Some(i) => return Err(format!("server: byte {i} is {} not {}", got[i], pattern(i))),
    }
    drop(region);
    d.shutdown();
    Ok(())
}

fn parse_desc(line: &str) -> Result<RemoteRegion, String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    match f.as_slice() {
        ["DESC", a, k, base, len] => Ok(RemoteRegion {
            worker_address: unhex(a)?,
            rkey: unhex(k)?,
            base: base.parse().map_err(|e| format!("base: {e}"))?,
            len: len.parse().map_err(|e| format!("len: {e}"))?,
        }),
        _ => Err(format!("not a DESC line: {line:?}")),
    }
}

fn client(args: &[String]) -> Result<(), String> {
    let desc = match arg(args, "--desc") {
        Some(d) => d,
        None => {
            let mut l = String::new();
            std::io::stdin()
                .lock()
                .read_line(&mut l)
                .map_err(|e| e.to_string())?;
            l
        }
    };
    let remote = parse_desc(desc.trim())?;
    let num = |name: &str, default: usize| -> Result<usize, String> {
        arg(args, name)
            .map_or(Ok(default), |s| s.parse())
            .map_err(|e| format!("{name}: {e}"))
    };
    let block = num("--block", 64 << 10)? as u64;
    let reps = num("--reps", 10)?.max(1);
    let warmup = num("--warmup", 3)?;
    let sizes: Vec<u64> = arg(args, "--sizes")
        .unwrap_or_else(|| "1,4,16,64".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<u64>()
                .map(|m| m << 20)
                .map_err(|e| format!("--sizes: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let max = sizes.iter().copied().max().unwrap_or(0).min(remote.len) as usize;
    let d = dkv(args)?;
    let buf = Buf::new(max, pattern);
    // SAFETY: the region keeps `buf` alive.
    let local = unsafe { d.register(buf.ptr, buf.len, buf.clone()) }.map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    for &size in &sizes {
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
        for (mode, ops, depth) in [
            ("blocks", &blocks, 1),
            ("merged", &merged, 1),
            ("blocks-q4", &blocks, 4),
        ] {
            let mut mbs = Vec::with_capacity(reps);
            let dl = || Instant::now() + Duration::from_secs(60);
            for i in 0..warmup + reps {
                let t = Instant::now();
                let bytes = rt
                    .block_on(async {
                        if depth == 1 {
                            return d.write(&local, &remote, ops, dl()).await.map(|s| s.bytes);
                        }
                        let w = || d.write(&local, &remote, ops, dl());
                        let (a, b, c, e) = tokio::join!(w(), w(), w(), w());
                        Ok(a?.bytes + b?.bytes + c?.bytes + e?.bytes)
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
    let lat_reps = num("--lat-reps", 0)?;
    if lat_reps > 0 {
        let op = [WriteOp {
            local_offset: 0,
            remote_offset: 0,
            len: 64,
        }];
        let mut us = Vec::with_capacity(lat_reps);
        for i in 0..lat_reps + 100 {
            let t = Instant::now();
            rt.block_on(d.write(
                &local,
                &remote,
                &op,
                Instant::now() + Duration::from_secs(10),
            ))
            .map_err(|e| format!("latency write: {e}"))?;
            if i >= 100 {
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
