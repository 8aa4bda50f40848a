//! Feeds arbitrary KV region descriptors and write ops to the transfer
//! engine's receiving side (the in-process transport, which checks writes
//! against the receiver's grant table exactly as the UCX receiver does):
//! a live grant covers two ranges of a pool; the descriptor is the grant's
//! own with bytes of the input spliced into its address, token, envelope
//! and length, or raw input bytes. Whatever the input: no panic, and no
//! byte outside the granted ranges ever changes.

use std::ops::Range;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tandem_dkv::{Dkv, DkvConfig, Region, RemoteRegion, WriteOp};

const POOL: usize = 64 * 1024;
const GRANTED: [Range<u64>; 2] = [4096..8192, 16384..20480];

struct State {
    rt: tokio::runtime::Runtime,
    writer: Dkv,
    src: Region,
    _receiver: Dkv,
    pool: Region,
}

fn state() -> &'static State {
    static S: OnceLock<State> = OnceLock::new();
    S.get_or_init(|| {
        let writer = Dkv::new(DkvConfig::in_process()).expect("writer");
        let receiver = Dkv::new(DkvConfig::in_process()).expect("receiver");
        let src = writer.alloc(POOL).expect("src");
        // SAFETY: `src` is ours and idle.
        unsafe { std::ptr::write_bytes(src.as_ptr(), 0xA5, POOL) };
        let pool = receiver.alloc(POOL).expect("pool");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        State {
            rt,
            writer,
            src,
            _receiver: receiver,
            pool,
        }
    })
}

/// Reads little-endian u16s off the input, 0 once it runs out.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u16(&mut self) -> u16 {
        let (a, rest) = self.0.split_at(self.0.len().min(2));
        self.0 = rest;
        a.iter().rev().fold(0, |acc, &b| acc << 8 | u16::from(b))
    }
}

/// One fuzz input.
pub fn run(data: &[u8]) {
    let s = state();
    let grant = s
        .pool
        .grant(&GRANTED, Instant::now() + Duration::from_secs(60))
        .expect("grant");
    let good = grant.descriptor();
    let mut input = Input(data);
    let mode = input.u16();
    let mut remote = good.clone();
    match mode % 4 {
        // The grant's own descriptor: only the ops vary.
        0 => {}
        // Bytes of the input spliced into the token, at a chosen offset.
        1 => {
            let at = usize::from(input.u16()) % remote.grant.len();
            for (i, b) in input.0.iter().take(16).enumerate() {
                if let Some(x) = remote.grant.get_mut(at + i) {
                    *x = *b;
                }
            }
        }
        // Raw input as the token, and a length from the input.
        2 => {
            remote.grant = input.0.iter().take(64).copied().collect();
            remote.len = u64::from(input.u16()) << 4;
        }
        // Raw input as the address.
        _ => {
            remote = RemoteRegion {
                worker_address: input.0.iter().take(64).copied().collect(),
                ..good.clone()
            };
        }
    }
    let ops: Vec<WriteOp> = (0..usize::from(input.u16() % 8))
        .map(|_| WriteOp {
            local_offset: u64::from(input.u16()),
            remote_offset: u64::from(input.u16()) << (input.u16() % 3),
            len: u64::from(input.u16() % 8192),
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    let _ =
        s.rt.block_on(s.writer.write(&s.src, &remote, &ops, deadline));
    drop(grant);
    // SAFETY: the pool lives in `state()`; nothing writes it concurrently
    // (the in-process transport copies synchronously, and it is done).
    let pool = unsafe { std::slice::from_raw_parts(s.pool.as_ptr(), POOL) };
    let outside = |i: usize| !GRANTED.iter().any(|r| r.contains(&(i as u64)));
    if let Some(i) = (0..POOL).find(|&i| outside(i) && pool[i] != 0) {
        panic!("byte {i} outside the grant was written");
    }
}
