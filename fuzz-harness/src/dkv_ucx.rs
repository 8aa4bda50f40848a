//! dKV's network-facing entry points with the real UCX, where a crash is
//! an abort inside UCX, not a Rust panic: so every input runs in a child
//! process (forked, one per batch of [`BATCH`] inputs, fresh UCX state
//! each), and a child that dies or hangs is the finding. The batch's inputs
//! are then saved (the culprit may be an earlier input that left UCX
//! corrupted), and the target panics, which makes libFuzzer save the last
//! input as well.
//!
//! In the child, a receiver with a live grant on two ranges of its pool,
//! and, by the input's first byte:
//! - a descriptor whose worker address carries bytes of the input (spliced
//!   into the sealed envelope, or into the address then resealed with the
//!   unkeyed checksum of older builds or under another key, or raw input):
//!   `Dkv::check` then `Dkv::write` (which dials by that address,
//!   `ucp_ep_create`). Anything but the genuine address must be refused;
//! - raw KV-write active messages from a stranger's own UCX worker: headers
//!   (the real grant token with input bytes spliced in, or any bytes of any
//!   length), lengths and eager/rendezvous from the input;
//! - `Dkv::write` with the grant token resealed around input bytes, and
//!   ops (offsets, lengths) from the input.
//!
//! Always: no byte outside the granted ranges ever changes, and the child
//! lives.

use std::io::{Read, Write};
use std::ops::Range;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tandem_dkv::fuzzing::{RawAm, RawSender, seal_grant, token_bytes};
use tandem_dkv::{Dkv, DkvConfig, DkvKey, Region, RemoteRegion, WriteOp};

/// Inputs per child: enough to amortise its UCX setup, few enough that a
/// finding's batch is small.
const BATCH: usize = 64;
/// How long one input may take in the child.
const INPUT_LIMIT: Duration = Duration::from_secs(30);
const POOL: usize = 256 * 1024;
const GRANTED: [Range<u64>; 2] = [4096..8192, 16384..147456];

/// The parent's side of the current child.
struct Child {
    pid: i32,
    to: std::fs::File,
    from: std::fs::File,
    batch: Vec<Vec<u8>>,
}

static CHILD: Mutex<Option<Child>> = Mutex::new(None);

pub fn run(data: &[u8]) {
    let mut slot = CHILD.lock().unwrap_or_else(|p| p.into_inner());
    let child = slot.get_or_insert_with(Child::fork);
    child.batch.push(data.to_vec());
    if let Err(what) = child.exec(data) {
        let child = slot.take().unwrap();
        let saved = child.bury_and_save();
        panic!("dkv_ucx finding: {what}; this batch's inputs are in {saved}");
    }
    if child.batch.len() >= BATCH {
        slot.take().unwrap().finish();
    }
}

impl Child {
    fn fork() -> Child {
        let (to_child, child_in) = pipe();
        let (child_out, from_child) = pipe();
        // SAFETY: the child only runs `serve` (its own UCX, memory and
        // pipes) and leaves with _exit; the parent keeps its own ends.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            drop((to_child, from_child));
            let code = match std::panic::catch_unwind(|| serve(child_in, child_out)) {
                Ok(()) => 0,
                Err(_) => 101,
            };
            // SAFETY: ends the child without running the parent's atexit
            // handlers or destructors (libFuzzer's among them).
            unsafe { libc::_exit(code) };
        }
        drop((child_in, child_out));
        Child {
            pid,
            to: to_child,
            from: from_child,
            batch: Vec::new(),
        }
    }

    /// Runs one input in the child: its verdict, or why there is none.
    fn exec(&mut self, data: &[u8]) -> Result<(), String> {
        let len = (data.len() as u32).to_le_bytes();
        self.to
            .write_all(&len)
            .and_then(|()| self.to.write_all(data))
            .map_err(|e| format!("the child is gone ({e})"))?;
        if !readable(&self.from, INPUT_LIMIT) {
            return Err(format!("the child hung on an input for {INPUT_LIMIT:?}"));
        }
        let mut verdict = [0u8; 1];
        if self.from.read_exact(&mut verdict).is_err() {
            return Err("the child died".into());
        }
        match verdict[0] {
            b'k' => Ok(()),
            _ => {
                let mut why = String::new();
                let _ = self.from.read_to_string(&mut why);
                Err(format!("the child found a violation: {why}"))
            }
        }
    }

    /// Ends a batch that passed.
    fn finish(self) {
        drop(self.to);
        let _ = wait(self.pid, Duration::from_secs(30));
    }

    /// Kills and reaps the child (saying how it ended) and saves the batch.
    fn bury_and_save(self) -> String {
        drop(self.to);
        let status = wait(self.pid, Duration::from_secs(5));
        let dir = std::env::var_os("TANDEM_FUZZ_ARTIFACTS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("artifacts/dkv_ucx"))
            .join(format!("batch-{}-{}", std::process::id(), self.pid));
        let _ = std::fs::create_dir_all(&dir);
        for (i, input) in self.batch.iter().enumerate() {
            let _ = std::fs::write(dir.join(format!("{i:03}")), input);
        }
        format!("{} (child {status})", dir.display())
    }
}

/// Whether `f` has something to read (or hit its end) within `limit`;
/// signals (libFuzzer's timers) do not cut the wait short.
fn readable(f: &std::fs::File, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let mut fds = [libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(f),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 1, left.as_millis() as i32) };
        if ready > 0 {
            return true;
        }
        let interrupted =
            ready < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted;
        if !interrupted || left.is_zero() {
            return false;
        }
    }
}

/// Waits up to `limit` for `pid`, then kills it; how it ended.
fn wait(pid: i32, limit: Duration) -> String {
    let until = Instant::now() + limit;
    loop {
        let mut st = 0;
        // SAFETY: our own child; WNOHANG.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            return if libc::WIFSIGNALED(st) {
                format!("killed by signal {}", libc::WTERMSIG(st))
            } else {
                format!("exited with {}", libc::WEXITSTATUS(st))
            };
        }
        if r < 0 || Instant::now() >= until {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let mut st = 0;
            // SAFETY: as above, now blocking.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            return "hung, killed".into();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn pipe() -> (std::fs::File, std::fs::File) {
    let mut fds = [0i32; 2];
    // SAFETY: fills two fds we then own.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe: {}", std::io::Error::last_os_error());
    // SAFETY: fresh descriptors, owned once each.
    unsafe {
        (
            std::fs::File::from(OwnedFd::from_raw_fd(fds[1])),
            std::fs::File::from(OwnedFd::from_raw_fd(fds[0])),
        )
    }
}

// --- the child ---------------------------------------------------------

struct State {
    key: DkvKey,
    rt: tokio::runtime::Runtime,
    /// Owns the pool's registration and the grants.
    _receiver: Dkv,
    pool: Region,
    writer: Dkv,
    src: Region,
    raw: RawSender,
}

/// The child's loop: inputs in, one verdict byte each (`k`, or `v` and
/// what was violated), until the parent closes the pipe.
fn serve(input: std::fs::File, mut output: std::fs::File) {
    let mut input = std::io::BufReader::new(input);
    let s = State::new();
    loop {
        let mut len = [0u8; 4];
        if input.read_exact(&mut len).is_err() {
            return;
        }
        let mut data = vec![0u8; u32::from_le_bytes(len) as usize];
        if input.read_exact(&mut data).is_err() {
            return;
        }
        let verdict = s.one(&data).and_then(|()| s.outside_untouched());
        let sent = match verdict {
            Ok(()) => output.write_all(b"k"),
            Err(why) => output.write_all(format!("v{why}").as_bytes()),
        };
        if sent.is_err() {
            return;
        }
    }
}

impl State {
    fn new() -> State {
        let key = DkvKey::from_bytes([0x11; 32]);
        let cfg = DkvConfig {
            ucx_tls: Some("tcp,self".into()),
            ucx_net_devices: Some("lo".into()),
            key: Some(key.clone()),
            ..DkvConfig::ucx()
        };
        let receiver = Dkv::new(cfg.clone()).expect("receiver");
        let writer = Dkv::new(cfg).expect("writer");
        let pool = receiver.alloc(POOL).expect("pool");
        let src = writer.alloc(POOL).expect("src");
        // SAFETY: `src` is ours and idle.
        unsafe { std::ptr::write_bytes(src.as_ptr(), 0xA5, POOL) };
        State {
            key,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("runtime"),
            _receiver: receiver,
            pool,
            writer,
            src,
            raw: RawSender::new().expect("raw sender"),
        }
    }

    fn one(&self, data: &[u8]) -> Result<(), String> {
        let grant = self
            .pool
            .grant(&GRANTED, Instant::now() + Duration::from_secs(60))
            .map_err(|e| format!("grant: {e}"))?;
        let good = grant.descriptor();
        let mut input = Input(data);
        match input.byte() % 3 {
            0 => self.address(&good, &mut input),
            1 => self.raw_messages(&good, &mut input),
            _ => self.writes(&good, &mut input),
        }
    }

    /// A changed worker address: refused unless it is the genuine one.
    fn address(&self, good: &RemoteRegion, input: &mut Input<'_>) -> Result<(), String> {
        let genuine = self.key.open_address(&good.worker_address).expect("ours");
        let how = input.byte() % 4;
        let at = usize::from(input.u16());
        let bytes = input.take(64);
        let splice = |v: &mut Vec<u8>| {
            let at = at % (v.len() + 1);
            let end = (at + bytes.len()).min(v.len());
            v.splice(at..end, bytes.iter().copied());
        };
        let address = match how {
            0 => {
                let mut v = good.worker_address.clone();
                splice(&mut v);
                v
            }
            1 | 2 => {
                let mut v = genuine.to_vec();
                splice(&mut v);
                if how == 1 {
                    unkeyed(&v)
                } else {
                    DkvKey::from_bytes([0x22; 32]).seal_address(&v)
                }
            }
            _ => bytes.to_vec(),
        };
        let d = RemoteRegion {
            worker_address: address,
            ..good.clone()
        };
        let checked = self.writer.check(&d);
        let op = WriteOp {
            local_offset: 0,
            remote_offset: GRANTED[0].start,
            len: 64,
        };
        let wrote = self.rt.block_on(self.writer.write(
            &self.src,
            &d,
            &[op],
            Instant::now() + Duration::from_secs(5),
        ));
        let genuine_again = d.worker_address == good.worker_address;
        if !genuine_again && (checked.is_ok() || wrote.is_ok()) {
            return Err(format!(
                "a changed worker address was accepted (check {checked:?}, write {wrote:?})"
            ));
        }
        Ok(())
    }

    /// Raw active messages from a stranger's UCX.
    fn raw_messages(&self, good: &RemoteRegion, input: &mut Input<'_>) -> Result<(), String> {
        let token = token_bytes(good).map_err(|e| format!("token: {e}"))?;
        let n = 1 + usize::from(input.byte() % 8);
        let msgs: Vec<RawAm> = (0..n)
            .map(|_| {
                let kind = input.byte();
                let header = if kind.is_multiple_of(2) {
                    let mut h = token.to_vec();
                    let at = usize::from(input.byte()) % h.len();
                    for (i, b) in input.take(usize::from(kind >> 4)).iter().enumerate() {
                        if let Some(x) = h.get_mut(at + i) {
                            *x = *b;
                        }
                    }
                    h.extend_from_slice(&u64::from(input.u32()).to_le_bytes());
                    h
                } else {
                    let len = usize::from(input.byte() % 80);
                    input.take(len).to_vec()
                };
                let len = usize::from(input.u16()) << (input.byte() % 4);
                RawAm {
                    header,
                    len: len.min(POOL),
                    rndv: kind & 2 != 0,
                }
            })
            .collect();
        match self.raw.send(&self.key, good, &msgs) {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("a raw send did not complete: {e}")),
        }
    }

    /// `Dkv::write` with the token and ops from the input.
    fn writes(&self, good: &RemoteRegion, input: &mut Input<'_>) -> Result<(), String> {
        let mut remote = good.clone();
        if input.byte() % 2 == 1 {
            let mut token = token_bytes(good).map_err(|e| format!("token: {e}"))?;
            let at = usize::from(input.byte()) % token.len();
            for (i, b) in input.take(8).iter().enumerate() {
                if let Some(x) = token.get_mut(at + i) {
                    *x = *b;
                }
            }
            remote.grant = seal_grant(&token);
        }
        let ops: Vec<WriteOp> = (0..usize::from(input.byte() % 6))
            .map(|_| WriteOp {
                local_offset: u64::from(input.u16()),
                remote_offset: u64::from(input.u32()) % (2 * POOL as u64),
                len: u64::from(input.u16()) << (input.byte() % 3),
            })
            .collect();
        let _ = self.rt.block_on(self.writer.write(
            &self.src,
            &remote,
            &ops,
            Instant::now() + Duration::from_secs(5),
        ));
        Ok(())
    }

    /// No byte outside the granted ranges of the pool ever changes.
    fn outside_untouched(&self) -> Result<(), String> {
        // SAFETY: the pool lives in `self`; granted ranges may change
        // under us, the rest may not (which is what is checked).
        let pool = unsafe { std::slice::from_raw_parts(self.pool.as_ptr(), POOL) };
        let outside = |i: usize| !GRANTED.iter().any(|r| r.contains(&(i as u64)));
        match (0..POOL).find(|&i| outside(i) && pool[i] != 0) {
            Some(i) => Err(format!("byte {i} outside the grant was written")),
            None => Ok(()),
        }
    }
}

/// The envelope of older builds: magic, length, xxh3 of the address.
fn unkeyed(address: &[u8]) -> Vec<u8> {
    let mut v = b"DKua".to_vec();
    v.extend_from_slice(&(address.len() as u32).to_le_bytes());
    v.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(address).to_le_bytes());
    v.extend_from_slice(address);
    v
}

/// Reads numbers off the input, zeros once it runs out.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (a, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        a
    }

    fn byte(&mut self) -> u8 {
        self.take(1).first().copied().unwrap_or(0)
    }

    fn u16(&mut self) -> u16 {
        self.take(2)
            .iter()
            .rev()
            .fold(0, |acc, &b| acc << 8 | u16::from(b))
    }

    fn u32(&mut self) -> u32 {
        self.take(4)
            .iter()
            .rev()
            .fold(0, |acc, &b| acc << 8 | u32::from(b))
    }
}
