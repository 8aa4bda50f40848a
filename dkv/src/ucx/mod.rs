//! UCX transport. One actor thread per `Dkv` owns the UCP context and worker
//! (UCP objects are single-threaded); callers talk to it over a channel and
//! an eventfd. The actor sleeps on the worker's event fd when idle, so an idle
//! node burns no CPU yet still wakes for incoming puts (over TCP, UCX emulates
//! puts with active messages that the target must progress).
//!
//! Peers are connected by UCP worker address (`ucp_ep_create` with
//! `REMOTE_ADDRESS`): it works over tcp and shared memory on UCX 1.13, needs
//! no listener port per node, and the address travels in the descriptor.
//! Endpoints ask for peer error handling (so a dead or stuck peer can be
//! force-closed); transports without it (shared memory on 1.13) fall back to
//! no error handling, where a stuck transfer is abandoned instead.

pub(crate) mod sys;

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CString, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use self::sys::*;
use crate::descriptor::{self, MAGIC_UCX_ADDRESS, MAGIC_UCX_RKEY};
use crate::{DkvError, Owner, RegionShared, WriteOp};

/// Largest single put: as fast as 4 and 16 MiB here (tcp and shm), and a
/// cancelled transfer stops within a chunk or so.
const CHUNK: u64 = 1 << 20;
/// Bytes a transfer may have posted but not locally completed. Bounds what
/// still goes out after a cancel; 8 vs 32 MiB made no measurable difference.
const WINDOW: u64 = 8 << 20;
/// With no transfer of ours in flight, keep polling this long after the
/// last event before sleeping. Longer spins (200 us, 1 ms) cost tcp
/// bandwidth on 2 cores (the kernel's loopback work needs the CPU); none at
/// all costs small writes a wakeup each.
const SPIN_IDLE: Duration = Duration::from_micros(50);
/// With transfers in flight, poll (yielding the CPU between polls) this long
/// before napping: some progress raises no wakeup event (a full shared-memory
/// FIFO draining), and a nap there costs a whole `BUSY_SLEEP`. Same bandwidth
/// as 50 us in the bench; the cost is one yielding core during a transfer.
const SPIN_BUSY: Duration = Duration::from_millis(2);
/// Longest sleep while transfers are in flight (some shm progress has no
/// wakeup event).
const BUSY_SLEEP: Duration = Duration::from_millis(1);
/// Nap while only stopped transfers or closing endpoints remain (an
/// endpoint without peer error handling may never finish closing).
const DRAIN_SLEEP: Duration = Duration::from_millis(10);
/// How long a cancelled or timed-out transfer may drain before its endpoint
/// is force-closed. Long: a slow but live peer (a throttled link drains an
/// 8 MiB window at 10 Mbit/s in 7 s) must drain, so that a later
/// `FlushPeer` can confirm its data landed; only a dead one is cut off.
const GRACE: Duration = Duration::from_secs(30);
/// After a force close, data the kernel still holds for the old socket
/// (an orphaned TCP connection retransmits for minutes) may land at the
/// peer: for this long a `FlushPeer` to that address cannot confirm
/// anything and fails.
const EVICTED_UNSAFE: Duration = Duration::from_secs(300);
/// At shutdown, how long closing endpoints may take.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);
/// Zero bytes appended to addresses and keys handed to UCX, which parses
/// them without a length.
const PAD: usize = 1024;
const MAX_PEERS: usize = 256;
const MAX_RKEYS_PER_PEER: usize = 64;
/// UCX settings dkv changes from UCX's defaults (see `Actor::init`), as
/// (key for `ucp_config_modify`, environment variable that overrides it).
/// The keys are the tcp transport's (no other transport has them); the
/// bench gives ucx_perftest the same values.
const TCP_DEFAULTS: [(&std::ffi::CStr, &std::ffi::CStr, &str); 2] = [
    (c"TX_SEG_SIZE", c"64K", "UCX_TCP_TX_SEG_SIZE"),
    (c"RX_SEG_SIZE", c"256K", "UCX_TCP_RX_SEG_SIZE"),
];

pub(crate) enum Cmd {
    /// Maps `ptr` (or, if `None`, memory UCX allocates) and replies with
    /// its address and sealed rkey.
    Register {
        id: u64,
        ptr: Option<usize>,
        len: usize,
        owner: Option<Owner>,
        reply: mpsc::SyncSender<Result<(usize, Vec<u8>), DkvError>>,
    },
    Unregister(u64),
    Write(Box<WriteCmd>),
    Cancel(u64),
    /// Remote completion of everything posted so far to this peer.
    FlushPeer {
        address: Vec<u8>,
        reply: oneshot::Sender<Result<(), DkvError>>,
    },
    Shutdown,
    #[cfg(test)]
    Stall(Duration),
    #[cfg(test)]
    Inspect(mpsc::SyncSender<Inspect>),
}

#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Inspect {
    pub transfers: usize,
    pub peers: usize,
    pub closing: usize,
    pub regions: usize,
}

pub(crate) struct WriteCmd {
    pub id: u64,
    pub region: Arc<RegionShared>,
    /// Opened (validated) worker address payload.
    pub address: Vec<u8>,
    /// Opened packed rkey (without our base/len prefix).
    pub rkey: Vec<u8>,
    pub remote_base: u64,
    /// Validated against both regions, no empty ops.
    pub ops: Vec<WriteOp>,
    pub deadline: Instant,
    pub reply: oneshot::Sender<Result<(), DkvError>>,
}

/// The caller side's doorbell: an eventfd the actor polls next to the
/// worker's. Kept alive by every handle, so a late notify never hits a
/// closed (or reused) fd.
pub(crate) struct Wake(OwnedFd);

impl Wake {
    fn new() -> Result<Self, DkvError> {
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(DkvError::UcxUnavailable(format!(
                "eventfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: fd is a fresh descriptor we own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub(crate) fn notify(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd. A full
        // counter (EAGAIN) still leaves it readable, which is all we need.
        unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    fn clear(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a valid u64; nonblocking.
        unsafe { libc::read(self.0.as_raw_fd(), (&raw mut v).cast(), 8) };
    }
}

/// What a `Region` needs to deregister itself on the actor thread.
#[derive(Clone)]
pub(crate) struct Releaser {
    tx: mpsc::Sender<Cmd>,
    wake: Arc<Wake>,
}

impl Releaser {
    pub(crate) fn release(&self, id: u64) {
        // If the actor is gone it already unmapped everything.
        if self.tx.send(Cmd::Unregister(id)).is_ok() {
            self.wake.notify();
        }
    }
}

/// The `Dkv`'s handle on its actor.
pub(crate) struct UcxHandle {
    tx: mpsc::Sender<Cmd>,
    wake: Arc<Wake>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Sealed worker address, the `worker_address` of our descriptors.
    pub(crate) address: Vec<u8>,
}

impl UcxHandle {
    pub(crate) fn start(
        tls: Option<&str>,
        net_devices: Option<&str>,
        live: Arc<AtomicUsize>,
    ) -> Result<Self, DkvError> {
        let wake = Arc::new(Wake::new()?);
        let (tx, rx) = mpsc::channel();
        let (init_tx, init_rx) = mpsc::sync_channel(1);
        let tls = tls.map(str::to_owned);
        let net_devices = net_devices.map(str::to_owned);
        let actor_wake = wake.clone();
        let thread = std::thread::Builder::new()
            .name("dkv-ucx".into())
            .spawn(move || {
                match Actor::init(tls.as_deref(), net_devices.as_deref(), rx, actor_wake, live) {
                    Ok((actor, address)) => {
                        let _ = init_tx.send(Ok(address));
                        actor.run();
                    }
                    Err(e) => {
                        let _ = init_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| DkvError::UcxUnavailable(format!("spawning the UCX thread: {e}")))?;
        let address = match init_rx.recv() {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(DkvError::UcxUnavailable(
                    "UCX thread died during init".into(),
                ));
            }
        };
        Ok(Self {
            tx,
            wake,
            thread: Mutex::new(Some(thread)),
            address: descriptor::seal(MAGIC_UCX_ADDRESS, &address),
        })
    }

    pub(crate) fn send(&self, cmd: Cmd) -> Result<(), DkvError> {
        self.tx.send(cmd).map_err(|_| DkvError::Shutdown)?;
        self.wake.notify();
        Ok(())
    }

    pub(crate) fn releaser(&self) -> Releaser {
        Releaser {
            tx: self.tx.clone(),
            wake: self.wake.clone(),
        }
    }

    /// Maps `[ptr, ptr+len)`, or allocates `len` mapped bytes if `ptr` is
    /// `None`; returns the address and the sealed rkey (base, len, key).
    pub(crate) fn register(
        &self,
        id: u64,
        ptr: Option<usize>,
        len: usize,
        owner: Option<Owner>,
    ) -> Result<(usize, Vec<u8>), DkvError> {
        let (reply, rx) = mpsc::sync_channel(1);
        self.send(Cmd::Register {
            id,
            ptr,
            len,
            owner,
            reply,
        })?;
        rx.recv().map_err(|_| DkvError::Shutdown)?
    }

    /// Stops and joins the actor; idempotent.
    pub(crate) fn shutdown(&self) {
        let _ = self.send(Cmd::Shutdown);
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread
            && t.join().is_err()
        {
            tracing::error!("dkv UCX thread panicked");
        }
    }

    #[cfg(test)]
    pub(crate) fn inspect(&self) -> Option<Inspect> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Cmd::Inspect(tx)).ok()?;
        rx.recv().ok()
    }
}

// --- the actor ------------------------------------------------------------

thread_local! {
    /// Endpoint errors reported by UCX during progress: (peer id, status).
    static EP_ERRORS: RefCell<Vec<(u64, ucs_status_t)>> = const { RefCell::new(Vec::new()) };
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // Runs inside ucp_worker_progress on the actor thread; must not unwind.
    EP_ERRORS.with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            e.push((arg as u64, status));
        }
    });
}

struct Mapped {
    memh: ucp_mem_h,
    _owner: Option<Owner>,
}

struct Rkey {
    rkey: ucp_rkey_h,
    users: usize,
}

struct Peer {
    address: Vec<u8>,
    ep: ucp_ep_h,
    /// Endpoint created with peer error handling (can be force-closed).
    peer_errors: bool,
    rkeys: HashMap<Vec<u8>, Rkey>,
}

/// An endpoint being closed; its rkeys are destroyed once no transfer on it
/// has requests left and the close completed.
struct Closing {
    peer: u64,
    req: *mut c_void,
    rkeys: Vec<ucp_rkey_h>,
}

struct Transfer {
    id: u64,
    peer: u64,
    ep: ucp_ep_h,
    rkey: ucp_rkey_h,
    rkey_bytes: Vec<u8>,
    memh: ucp_mem_h,
    /// Keeps the source memory mapped and alive while UCX may read it.
    region: Arc<RegionShared>,
    remote_base: u64,
    ops: Vec<WriteOp>,
    next: usize,
    next_off: u64,
    pending: VecDeque<(*mut c_void, u64)>,
    pending_bytes: u64,
    flush: Option<*mut c_void>,
    flushed: bool,
    deadline: Instant,
    reply: Option<oneshot::Sender<Result<(), DkvError>>>,
    /// Set when the transfer stops early (cancel, deadline, error): no more
    /// puts; it lingers only until UCX is done with the source memory.
    stopped: Option<Instant>,
    /// The endpoint was closed under it: never touch `ep` again.
    ep_gone: bool,
}

impl Transfer {
    fn finished(&self) -> bool {
        self.pending.is_empty() && self.flush.is_none() && (self.flushed || self.stopped.is_some())
    }

    fn fail(&mut self, e: DkvError, now: Instant) {
        if let Some(r) = self.reply.take() {
            let _ = r.send(Err(e));
        }
        self.stopped.get_or_insert(now);
    }
}

fn is_peer_failure(s: ucs_status_t) -> bool {
    (UCS_ERR_LAST_LINK_FAILURE..=UCS_ERR_FIRST_LINK_FAILURE).contains(&s)
        || (UCS_ERR_LAST_ENDPOINT_FAILURE..=UCS_ERR_FIRST_ENDPOINT_FAILURE).contains(&s)
        || [
            UCS_ERR_UNREACHABLE,
            UCS_ERR_CANCELED,
            UCS_ERR_NOT_CONNECTED,
            UCS_ERR_CONNECTION_RESET,
            UCS_ERR_TIMED_OUT,
            UCS_ERR_REJECTED,
        ]
        .contains(&s)
}

fn transfer_error(op: &'static str, s: ucs_status_t) -> DkvError {
    if is_peer_failure(s) {
        DkvError::PeerUnreachable(format!("{op}: {}", status_string(s)))
    } else {
        DkvError::Ucx {
            op,
            status: status_string(s),
        }
    }
}

fn ucx_err(op: &'static str, s: ucs_status_t) -> DkvError {
    DkvError::Ucx {
        op,
        status: status_string(s),
    }
}

/// Completion state of a request pointer from an `*_nbx` call.
enum Posted {
    Done,
    Pending(*mut c_void),
    Failed(ucs_status_t),
}

fn posted(p: ucs_status_ptr_t) -> Posted {
    if p.is_null() {
        Posted::Done
    } else if ptr_is_err(p) {
        Posted::Failed(ptr_status(p))
    } else {
        Posted::Pending(p)
    }
}

/// Status of a pending request; frees it once complete.
fn poll_request(req: *mut c_void) -> Option<ucs_status_t> {
    // SAFETY: `req` came from an nbx call on our worker and is not freed yet.
    let s = unsafe { ucp_request_check_status(req) };
    if s == UCS_INPROGRESS {
        return None;
    }
    // SAFETY: complete and owned by us; freed exactly once.
    unsafe { ucp_request_free(req) };
    Some(s)
}

/// A `FlushPeer` in flight: the peer, the flush request, the caller.
type PeerFlush = (u64, *mut c_void, oneshot::Sender<Result<(), DkvError>>);

struct Actor {
    ctx: ucp_context_h,
    worker: ucp_worker_h,
    efd: i32,
    rx: mpsc::Receiver<Cmd>,
    wake: Arc<Wake>,
    live: Arc<AtomicUsize>,
    regions: HashMap<u64, Mapped>,
    peers: HashMap<u64, Peer>,
    by_address: HashMap<Vec<u8>, u64>,
    next_peer: u64,
    /// Set once an endpoint with peer error handling was unreachable and one
    /// without worked: skip the failing attempt (and its UCX error line).
    no_peer_errors: bool,
    transfers: Vec<Transfer>,
    closing: Vec<Closing>,
    /// `FlushPeer`s in flight: the peer, the flush request, the caller.
    peer_flushes: Vec<PeerFlush>,
    /// Addresses whose endpoint was force-closed, and when.
    evicted: HashMap<Vec<u8>, Instant>,
    /// The first byte of our own worker address: UCX's address header
    /// (format version and flags).
    header: u8,
}

impl Actor {
    fn init(
        tls: Option<&str>,
        net_devices: Option<&str>,
        rx: mpsc::Receiver<Cmd>,
        wake: Arc<Wake>,
        live: Arc<AtomicUsize>,
    ) -> Result<(Self, Vec<u8>), DkvError> {
        let unavailable = |op: &str, s: ucs_status_t| {
            DkvError::UcxUnavailable(format!("{op}: {}", status_string(s)))
        };
        let mut config: *mut ucp_config_t = ptr::null_mut();
        // SAFETY: out-pointer to a local; NULL prefix/file read UCX_* env vars.
        let s = unsafe { ucp_config_read(ptr::null(), ptr::null(), &mut config) };
        if s != UCS_OK {
            return Err(unavailable("ucp_config_read", s));
        }
        if let Some(tls) = tls {
            let value = CString::new(tls)
                .map_err(|_| DkvError::UcxUnavailable(format!("ucx_tls {tls:?} contains NUL")))?;
            // SAFETY: config is live; both strings are NUL-terminated.
            let s = unsafe { ucp_config_modify(config, c"TLS".as_ptr(), value.as_ptr()) };
            if s != UCS_OK {
                // SAFETY: releasing the config we read.
                unsafe { ucp_config_release(config) };
                return Err(DkvError::UcxUnavailable(format!(
                    "UCX_TLS={tls}: {}",
                    status_string(s)
                )));
            }
        }
        // Only the interfaces the node was told to use (an explicit
        // UCX_NET_DEVICES wins): UCX otherwise listens on every interface,
        // the external ones too when the node binds 127.0.0.1.
        if let Some(devices) = net_devices
            && std::env::var_os("UCX_NET_DEVICES").is_none()
        {
            let value = CString::new(devices).map_err(|_| {
                DkvError::UcxUnavailable(format!("ucx_net_devices {devices:?} contains NUL"))
            })?;
            // SAFETY: config is live; both strings are NUL-terminated.
            let s = unsafe { ucp_config_modify(config, c"NET_DEVICES".as_ptr(), value.as_ptr()) };
            if s != UCS_OK {
                // SAFETY: releasing the config we read.
                unsafe { ucp_config_release(config) };
                return Err(DkvError::UcxUnavailable(format!(
                    "UCX_NET_DEVICES={devices}: {}",
                    status_string(s)
                )));
            }
        }
        // Software-emulated puts over TCP go out in TX segments; 64 KiB
        // instead of 8 KiB gave 1.4-2x the bandwidth here (bench/dkv.sh).
        // An explicit UCX_* environment variable still wins.
        // (Only where tcp may be used: UCX warns about options no transport
        // consumed.)
        let env_tls = std::env::var("UCX_TLS").ok();
        let tls_list = tls.or(env_tls.as_deref());
        let may_use_tcp =
            tls_list.is_none_or(|t| t.starts_with('^') || t.contains("tcp") || t.contains("all"));
        for (name, value, env) in TCP_DEFAULTS {
            if !may_use_tcp || std::env::var_os(env).is_some() {
                continue;
            }
            // SAFETY: config is live; both strings are NUL-terminated.
            let s = unsafe { ucp_config_modify(config, name.as_ptr(), value.as_ptr()) };
            if s != UCS_OK {
                tracing::debug!(
                    env,
                    "dkv: UCX rejected a tuning option: {}",
                    status_string(s)
                );
            }
        }
        // SAFETY: all-zero is a valid ucp_params_t (masks select fields).
        let mut params: ucp_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME);
        params.features = u64::from(UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP);
        params.name = c"tandem-dkv".as_ptr();
        let mut ctx: ucp_context_h = ptr::null_mut();
        // SAFETY: ucp_init is a static inline wrapper around this call.
        let s =
            unsafe { ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx) };
        // SAFETY: the config is copied by ucp_init.
        unsafe { ucp_config_release(config) };
        if s != UCS_OK {
            return Err(unavailable("ucp_init", s));
        }
        // SAFETY: all-zero is a valid ucp_worker_params_t.
        let mut wparams: ucp_worker_params_t = unsafe { std::mem::zeroed() };
        wparams.field_mask = u64::from(UCP_WORKER_PARAM_FIELD_THREAD_MODE);
        wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
        let mut worker: ucp_worker_h = ptr::null_mut();
        // SAFETY: ctx is live; out-pointer to a local.
        let s = unsafe { ucp_worker_create(ctx, &wparams, &mut worker) };
        if s != UCS_OK {
            // SAFETY: nothing else uses ctx.
            unsafe { ucp_cleanup(ctx) };
            return Err(unavailable("ucp_worker_create", s));
        }
        let cleanup = || {
            // SAFETY: worker and ctx are live and unused elsewhere.
            unsafe {
                ucp_worker_destroy(worker);
                ucp_cleanup(ctx);
            }
        };
        let mut efd = -1;
        // SAFETY: worker is live; out-pointer to a local.
        let s = unsafe { ucp_worker_get_efd(worker, &mut efd) };
        if s != UCS_OK {
            cleanup();
            return Err(unavailable("ucp_worker_get_efd", s));
        }
        let mut addr: *mut ucp_address_t = ptr::null_mut();
        let mut addr_len = 0usize;
        // SAFETY: worker is live; out-pointers to locals.
        let s = unsafe { ucp_worker_get_address(worker, &mut addr, &mut addr_len) };
        if s != UCS_OK || addr.is_null() {
            cleanup();
            return Err(unavailable("ucp_worker_get_address", s));
        }
        // SAFETY: UCX returned addr_len readable bytes at addr.
        let address = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), addr_len) }.to_vec();
        // SAFETY: releasing the buffer UCX gave us.
        unsafe { ucp_worker_release_address(worker, addr) };
        // Shared-memory-only transport lists cannot do peer error handling
        // on 1.13; skip the attempt (and the error UCX logs for it).
        let no_peer_errors = tls.is_some_and(|t| {
            !t.starts_with('^')
                && t.split(',').all(|x| {
                    matches!(
                        x.trim(),
                        "posix" | "sysv" | "cma" | "knem" | "xpmem" | "self" | "sm" | "shm"
                    )
                })
        });
        let actor = Self {
            ctx,
            worker,
            efd,
            rx,
            wake,
            live,
            regions: HashMap::new(),
            peers: HashMap::new(),
            by_address: HashMap::new(),
            next_peer: 1,
            no_peer_errors,
            transfers: Vec::new(),
            closing: Vec::new(),
            peer_flushes: Vec::new(),
            evicted: HashMap::new(),
            header: address.first().copied().unwrap_or_default(),
        };
        Ok((actor, address))
    }

    fn run(mut self) {
        let mut last_activity = Instant::now();
        'outer: loop {
            let mut activity = false;
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => break 'outer,
                    Ok(cmd) => {
                        activity = true;
                        self.handle(cmd);
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            activity |= self.progress();
            let now = Instant::now();
            activity |= self.advance(now);
            self.reap_closing();
            if activity {
                last_activity = now;
                continue;
            }
            let live = self.transfers.iter().any(|t| t.stopped.is_none());
            let spin = if live { SPIN_BUSY } else { SPIN_IDLE };
            if now.duration_since(last_activity) < spin {
                if live {
                    std::thread::yield_now();
                }
                continue;
            }
            // SAFETY: worker is live and used only on this thread.
            let s = unsafe { ucp_worker_arm(self.worker) };
            if s == UCS_ERR_BUSY {
                continue;
            }
            let timeout = self.sleep_timeout(now, s != UCS_OK);
            self.sleep(timeout);
            self.wake.clear();
        }
        self.shutdown();
    }

    /// Poll timeout in ms (-1: until an event).
    fn sleep_timeout(&self, now: Instant, arm_failed: bool) -> i32 {
        let live =
            self.transfers.iter().any(|t| t.stopped.is_none()) || !self.peer_flushes.is_empty();
        let draining = !self.transfers.is_empty() || !self.closing.is_empty();
        let mut until = if live || arm_failed {
            Some(BUSY_SLEEP)
        } else if draining {
            Some(DRAIN_SLEEP)
        } else {
            None
        };
        for t in &self.transfers {
            let at = match t.stopped {
                None => t.deadline,
                Some(s) if !t.ep_gone => s + GRACE,
                // Waiting for UCX to cancel its requests: nothing to time.
                Some(_) => continue,
            };
            let d = at.saturating_duration_since(now);
            until = Some(until.map_or(d, |u| u.min(d)));
        }
        match until {
            None => -1,
            Some(d) => d.as_millis().clamp(0, 1000) as i32,
        }
    }

    fn sleep(&self, timeout_ms: i32) {
        let mut fds = [
            libc::pollfd {
                fd: self.efd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd entries.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    }

    fn progress(&mut self) -> bool {
        let mut any = false;
        for _ in 0..64 {
            // SAFETY: worker is live and used only on this thread.
            if unsafe { ucp_worker_progress(self.worker) } == 0 {
                break;
            }
            any = true;
        }
        let errors = EP_ERRORS.with(|e| {
            e.try_borrow_mut()
                .map(|mut e| std::mem::take(&mut *e))
                .unwrap_or_default()
        });
        for (peer, s) in errors {
            any = true;
            self.evict(peer, &format!("endpoint error: {}", status_string(s)));
        }
        any
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register {
                id,
                ptr,
                len,
                owner,
                reply,
            } => {
                let _ = reply.send(self.register(id, ptr, len, owner));
            }
            Cmd::Unregister(id) => {
                if let Some(m) = self.regions.remove(&id) {
                    // SAFETY: memh came from ucp_mem_map on our context; no
                    // transfer holds the region (it holds the Arc that sent this).
                    unsafe { ucp_mem_unmap(self.ctx, m.memh) };
                    self.live.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Cmd::Write(w) => self.start(*w),
            Cmd::Cancel(id) => {
                let now = Instant::now();
                for t in self.transfers.iter_mut().filter(|t| t.id == id) {
                    t.reply = None;
                    t.stopped.get_or_insert(now);
                }
            }
            Cmd::FlushPeer { address, reply } => {
                if let Some(at) = self.evicted.get(&address)
                    && at.elapsed() < EVICTED_UNSAFE
                {
                    let _ = reply.send(Err(DkvError::PeerUnreachable(format!(
                        "the endpoint was force-closed {:?} ago; its socket may still deliver \
                         data for up to {EVICTED_UNSAFE:?}",
                        at.elapsed()
                    ))));
                    return;
                }
                let Some(peer_id) = self.by_address.get(&address).copied() else {
                    // No endpoint (never connected, or closed): nothing of
                    // ours is queued towards that peer.
                    let _ = reply.send(Ok(()));
                    return;
                };
                let Some(peer) = self.peers.get(&peer_id) else {
                    let _ = reply.send(Ok(()));
                    return;
                };
                // SAFETY: all-zero is a valid ucp_request_param_t.
                let p: ucp_request_param_t = unsafe { std::mem::zeroed() };
                // SAFETY: the endpoint is open (it is in `peers`).
                let r = unsafe { ucp_ep_flush_nbx(peer.ep, &p) };
                match posted(r) {
                    Posted::Done => {
                        let _ = reply.send(Ok(()));
                    }
                    Posted::Pending(req) => self.peer_flushes.push((peer_id, req, reply)),
                    Posted::Failed(st) => {
                        let _ = reply.send(Err(transfer_error("ucp_ep_flush_nbx", st)));
                    }
                }
            }
            Cmd::Shutdown => {}
            #[cfg(test)]
            Cmd::Stall(d) => std::thread::sleep(d),
            #[cfg(test)]
            Cmd::Inspect(reply) => {
                let _ = reply.send(Inspect {
                    transfers: self.transfers.len(),
                    peers: self.peers.len(),
                    closing: self.closing.len(),
                    regions: self.regions.len(),
                });
            }
        }
    }

    fn register(
        &mut self,
        id: u64,
        ptr: Option<usize>,
        len: usize,
        owner: Option<Owner>,
    ) -> Result<(usize, Vec<u8>), DkvError> {
        // SAFETY: all-zero is a valid ucp_mem_map_params_t.
        let mut p: ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        p.field_mask = u64::from(
            UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        );
        p.address = ptr.unwrap_or(0) as *mut c_void;
        p.length = len;
        p.flags = if ptr.is_none() {
            UCP_MEM_MAP_ALLOCATE
        } else {
            0
        };
        let mut memh: ucp_mem_h = ptr::null_mut();
        // SAFETY: the caller of Dkv::register vouched for [ptr, ptr+len);
        // with ALLOCATE, UCX picks the memory.
        let s = unsafe { ucp_mem_map(self.ctx, &p, &mut memh) };
        if s != UCS_OK {
            return Err(ucx_err("ucp_mem_map", s));
        }
        let base = match ptr {
            Some(p) => p,
            None => {
                // SAFETY: all-zero is a valid ucp_mem_attr_t.
                let mut attr: ucp_mem_attr_t = unsafe { std::mem::zeroed() };
                attr.field_mask = u64::from(UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH);
                // SAFETY: memh is live; out-pointer to a local.
                let s = unsafe { ucp_mem_query(memh, &mut attr) };
                if s != UCS_OK || attr.address.is_null() || attr.length < len {
                    // SAFETY: undo the map above.
                    unsafe { ucp_mem_unmap(self.ctx, memh) };
                    return Err(ucx_err("ucp_mem_query", s));
                }
                // SAFETY: UCX allocated at least len bytes there for us.
                unsafe { ptr::write_bytes(attr.address.cast::<u8>(), 0, len) };
                attr.address as usize
            }
        };
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: memh is live; out-pointers to locals.
        let s = unsafe { ucp_rkey_pack(self.ctx, memh, &mut buf, &mut size) };
        if s != UCS_OK || buf.is_null() {
            // SAFETY: undo the map above.
            unsafe { ucp_mem_unmap(self.ctx, memh) };
            return Err(ucx_err("ucp_rkey_pack", s));
        }
        let mut payload = Vec::with_capacity(16 + size);
        payload.extend_from_slice(&(base as u64).to_le_bytes());
        payload.extend_from_slice(&(len as u64).to_le_bytes());
        // SAFETY: UCX returned `size` readable bytes at buf.
        payload.extend_from_slice(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) });
        // SAFETY: releasing the buffer UCX gave us.
        unsafe { ucp_rkey_buffer_release(buf) };
        self.regions.insert(
            id,
            Mapped {
                memh,
                _owner: owner,
            },
        );
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok((base, descriptor::seal(MAGIC_UCX_RKEY, &payload)))
    }

    fn connect(&mut self, address: &[u8]) -> Result<u64, DkvError> {
        if let Some(&id) = self.by_address.get(address) {
            return Ok(id);
        }
        // UCX asserts (aborting the process) on an address whose header
        // names a format it does not expect, so a peer's header must be
        // ours: the nodes of a cluster run the same UCX and address
        // settings. (The checksum only proves the envelope is intact, not
        // who made it.)
        if address.first() != Some(&self.header) {
            return Err(DkvError::InvalidDescriptor(format!(
                "worker_address: UCX address header {:#04x}, expected {:#04x} (another UCX \
                 build or not a UCX address)",
                address.first().copied().unwrap_or_default(),
                self.header
            )));
        }
        if self.peers.len() >= MAX_PEERS {
            let idle = self
                .peers
                .keys()
                .copied()
                .find(|p| !self.transfers.iter().any(|t| t.peer == *p));
            match idle {
                Some(p) => self.evict(p, "endpoint cache full"),
                None => {
                    return Err(DkvError::PeerUnreachable(format!(
                        "more than {MAX_PEERS} busy peers"
                    )));
                }
            }
        }
        let mut padded = Vec::with_capacity(address.len() + PAD);
        padded.extend_from_slice(address);
        padded.resize(address.len() + PAD, 0);
        let id = self.next_peer;
        self.next_peer += 1;
        let create = |peer_errors: bool| {
            // SAFETY: all-zero is a valid ucp_ep_params_t.
            let mut p: ucp_ep_params_t = unsafe { std::mem::zeroed() };
            p.field_mask =
                u64::from(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
            p.address = padded.as_ptr().cast();
            if peer_errors {
                p.field_mask |= u64::from(UCP_EP_PARAM_FIELD_ERR_HANDLER);
                p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
                p.err_handler.cb = Some(on_ep_error);
                p.err_handler.arg = id as *mut c_void;
            } else {
                p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
            }
            let mut ep: ucp_ep_h = ptr::null_mut();
            // SAFETY: the address was checksummed as one of ours and is
            // zero-padded so UCX's length-less parse stays in bounds.
            let s = unsafe { ucp_ep_create(self.worker, &p, &mut ep) };
            (s, ep)
        };
        let mut peer_errors = !self.no_peer_errors;
        let (mut s, mut ep) = create(peer_errors);
        if s != UCS_OK && peer_errors {
            let (s2, ep2) = create(false);
            if s2 == UCS_OK {
                tracing::debug!("dkv: transports lack peer error handling; endpoints without it");
                self.no_peer_errors = true;
                peer_errors = false;
            }
            (s, ep) = (s2, ep2);
        }
        if s != UCS_OK || ep.is_null() {
            return Err(DkvError::PeerUnreachable(format!(
                "ucp_ep_create: {}",
                status_string(s)
            )));
        }
        self.peers.insert(
            id,
            Peer {
                address: address.to_vec(),
                ep,
                peer_errors,
                rkeys: HashMap::new(),
            },
        );
        self.by_address.insert(address.to_vec(), id);
        Ok(id)
    }

    fn rkey(&mut self, peer_id: u64, packed: &[u8]) -> Result<ucp_rkey_h, DkvError> {
        let peer = self
            .peers
            .get_mut(&peer_id)
            .ok_or_else(|| DkvError::PeerUnreachable("endpoint closed".into()))?;
        if let Some(k) = peer.rkeys.get_mut(packed) {
            k.users += 1;
            return Ok(k.rkey);
        }
        if peer.rkeys.len() >= MAX_RKEYS_PER_PEER {
            peer.rkeys.retain(|_, k| {
                if k.users == 0 {
                    // SAFETY: no transfer uses this key (users == 0) and the
                    // endpoint is still open.
                    unsafe { ucp_rkey_destroy(k.rkey) };
                }
                k.users > 0
            });
            if peer.rkeys.len() >= MAX_RKEYS_PER_PEER {
                return Err(DkvError::InvalidDescriptor(format!(
                    "more than {MAX_RKEYS_PER_PEER} remote keys in use for one peer"
                )));
            }
        }
        let mut padded = Vec::with_capacity(packed.len() + PAD);
        padded.extend_from_slice(packed);
        padded.resize(packed.len() + PAD, 0);
        let mut rkey: ucp_rkey_h = ptr::null_mut();
        // SAFETY: ep is open; the key was checksummed and is zero-padded.
        let s = unsafe { ucp_ep_rkey_unpack(peer.ep, padded.as_ptr().cast(), &mut rkey) };
        if s != UCS_OK || rkey.is_null() {
            return Err(DkvError::InvalidDescriptor(format!(
                "ucp_ep_rkey_unpack: {}",
                status_string(s)
            )));
        }
        peer.rkeys.insert(packed.to_vec(), Rkey { rkey, users: 1 });
        Ok(rkey)
    }

    fn start(&mut self, w: WriteCmd) {
        let now = Instant::now();
        if w.reply.is_closed() {
            return;
        }
        if now >= w.deadline {
            let _ = w.reply.send(Err(DkvError::DeadlineExceeded));
            return;
        }
        let Some(memh) = self.regions.get(&w.region.id).map(|m| m.memh) else {
            let _ = w.reply.send(Err(DkvError::InvalidRegion(
                "local region is not registered".into(),
            )));
            return;
        };
        let peer = match self.connect(&w.address) {
            Ok(p) => p,
            Err(e) => {
                let _ = w.reply.send(Err(e));
                return;
            }
        };
        let rkey = match self.rkey(peer, &w.rkey) {
            Ok(k) => k,
            Err(e) => {
                let _ = w.reply.send(Err(e));
                return;
            }
        };
        let Some(ep) = self.peers.get(&peer).map(|p| p.ep) else {
            return;
        };
        self.transfers.push(Transfer {
            id: w.id,
            peer,
            ep,
            rkey,
            rkey_bytes: w.rkey,
            memh,
            region: w.region,
            remote_base: w.remote_base,
            ops: w.ops,
            next: 0,
            next_off: 0,
            pending: VecDeque::new(),
            pending_bytes: 0,
            flush: None,
            flushed: false,
            deadline: w.deadline,
            reply: Some(w.reply),
            stopped: None,
            ep_gone: false,
        });
    }

    /// Moves every transfer along; true if anything changed.
    fn advance(&mut self, now: Instant) -> bool {
        let mut activity = false;
        let mut evict: Vec<(u64, String)> = Vec::new();
        self.peer_flushes
            .retain_mut(|(_, req, reply)| match poll_request(*req) {
                None => true,
                Some(st) => {
                    activity = true;
                    let r = if st == UCS_OK {
                        Ok(())
                    } else {
                        Err(transfer_error("ucp_ep_flush_nbx", st))
                    };
                    let (tx, _) = oneshot::channel();
                    let _ = std::mem::replace(reply, tx).send(r);
                    false
                }
            });
        for t in &mut self.transfers {
            if t.reply.as_ref().is_some_and(|r| r.is_closed()) {
                t.reply = None;
                t.stopped.get_or_insert(now);
            }
            if t.reply.is_some() && now >= t.deadline {
                t.fail(DkvError::DeadlineExceeded, now);
                activity = true;
            }
            // Reap locally completed puts (in order is the common case).
            while let Some(&(req, len)) = t.pending.front() {
                match poll_request(req) {
                    None => break,
                    Some(s) => {
                        t.pending.pop_front();
                        t.pending_bytes -= len;
                        activity = true;
                        if s != UCS_OK && t.stopped.is_none() {
                            t.fail(transfer_error("ucp_put_nbx", s), now);
                            evict.push((t.peer, format!("put failed: {}", status_string(s))));
                        }
                    }
                }
            }
            if let Some(req) = t.flush
                && let Some(s) = poll_request(req)
            {
                t.flush = None;
                activity = true;
                if s == UCS_OK {
                    t.flushed = true;
                } else if t.stopped.is_none() {
                    t.fail(transfer_error("ucp_ep_flush_nbx", s), now);
                    evict.push((t.peer, format!("flush failed: {}", status_string(s))));
                }
            }
            if t.stopped.is_some()
                && let Some(req) = t.flush.take()
            {
                // A stopped transfer need not wait for remote completion;
                // the flush does not touch our memory.
                // SAFETY: releases our handle; UCX frees it on completion.
                unsafe { ucp_request_free(req) };
            }
            if t.stopped.is_none() && !t.ep_gone {
                match post(t) {
                    Ok(a) => activity |= a,
                    Err((op, s)) => {
                        activity = true;
                        t.fail(transfer_error(op, s), now);
                        evict.push((t.peer, format!("{op}: {}", status_string(s))));
                    }
                }
            }
            if let Some(at) = t.stopped
                && !t.finished()
                && now.duration_since(at) >= GRACE
                && !t.ep_gone
            {
                evict.push((
                    t.peer,
                    "transfer stalled past its deadline or cancel".into(),
                ));
            }
        }
        for (peer, why) in evict {
            self.evict(peer, &why);
        }
        // Retire finished transfers.
        let mut i = 0;
        while i < self.transfers.len() {
            if self.transfers[i].finished() {
                let t = self.transfers.swap_remove(i);
                activity = true;
                self.retire(t);
            } else {
                i += 1;
            }
        }
        activity
    }

    fn retire(&mut self, mut t: Transfer) {
        if let Some(r) = t.reply.take() {
            let _ = r.send(if t.flushed {
                Ok(())
            } else {
                Err(DkvError::Shutdown)
            });
        }
        if let Some(k) = self
            .peers
            .get_mut(&t.peer)
            .and_then(|p| p.rkeys.get_mut(&t.rkey_bytes))
        {
            k.users = k.users.saturating_sub(1);
        }
        // Dropping t.region may queue an Unregister to ourselves.
    }

    /// Closes a peer's endpoint (force when it has peer error handling),
    /// failing the transfers on it.
    fn evict(&mut self, peer_id: u64, why: &str) {
        let Some(peer) = self.peers.remove(&peer_id) else {
            return;
        };
        self.by_address.remove(&peer.address);
        let now = Instant::now();
        self.evicted
            .retain(|_, at| now.duration_since(*at) < EVICTED_UNSAFE);
        self.evicted.insert(peer.address.clone(), now);
        for t in self.transfers.iter_mut().filter(|t| t.peer == peer_id) {
            t.fail(DkvError::PeerUnreachable(why.to_owned()), now);
            t.ep_gone = true;
            // A flush on a closed endpoint completes (cancelled) by itself;
            // we only wait for puts, which read the source memory.
            if let Some(req) = t.flush.take() {
                // SAFETY: releases our handle; UCX frees it on completion.
                unsafe { ucp_request_free(req) };
            }
        }
        self.peer_flushes.retain_mut(|(p, req, reply)| {
            if *p != peer_id {
                return true;
            }
            // SAFETY: releases our handle; UCX frees it on completion.
            unsafe { ucp_request_free(*req) };
            // The endpoint is closed: nothing more of ours reaches the peer
            // through it.
            let (tx, _) = oneshot::channel();
            let _ = std::mem::replace(reply, tx).send(Ok(()));
            false
        });
        tracing::debug!(peer_id, why, "dkv: closing endpoint");
        // SAFETY: all-zero is a valid ucp_request_param_t.
        let mut p: ucp_request_param_t = unsafe { std::mem::zeroed() };
        if peer.peer_errors {
            p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: ep is open and closed exactly once (removed from peers).
        let r = unsafe { ucp_ep_close_nbx(peer.ep, &p) };
        let req = match posted(r) {
            Posted::Pending(req) => req,
            Posted::Done | Posted::Failed(_) => ptr::null_mut(),
        };
        self.closing.push(Closing {
            peer: peer_id,
            req,
            rkeys: peer.rkeys.into_values().map(|k| k.rkey).collect(),
        });
    }

    fn reap_closing(&mut self) {
        let transfers = &self.transfers;
        self.closing.retain_mut(|c| {
            if !c.req.is_null() {
                match poll_request(c.req) {
                    None => return true,
                    Some(_) => c.req = ptr::null_mut(),
                }
            }
            if transfers.iter().any(|t| t.peer == c.peer) {
                return true;
            }
            for &k in &c.rkeys {
                // SAFETY: no request uses the key any more: the close
                // completed (a force close cancels outstanding operations)
                // and no transfer on this peer has requests left.
                unsafe { ucp_rkey_destroy(k) };
            }
            false
        });
    }

    fn shutdown(mut self) {
        let now = Instant::now();
        for (_, req, reply) in self.peer_flushes.drain(..) {
            // SAFETY: releases our handle; the worker goes below.
            unsafe { ucp_request_free(req) };
            let _ = reply.send(Err(DkvError::Shutdown));
        }
        for t in &mut self.transfers {
            t.fail(DkvError::Shutdown, now);
        }
        let peers: Vec<u64> = self.peers.keys().copied().collect();
        for p in peers {
            self.evict(p, "dkv shutting down");
        }
        let until = Instant::now() + SHUTDOWN_WAIT;
        while (!self.transfers.is_empty() || !self.closing.is_empty()) && Instant::now() < until {
            self.progress();
            self.advance(Instant::now());
            self.reap_closing();
        }
        if !self.transfers.is_empty() || !self.closing.is_empty() {
            tracing::warn!(
                transfers = self.transfers.len(),
                closing = self.closing.len(),
                "dkv: endpoints did not close in time; the worker reclaims them"
            );
        }
        // Destroying the worker ends all UCX use of our memory; only then
        // may the transfers' source regions go and the mappings be undone.
        let leftover = std::mem::take(&mut self.transfers);
        // SAFETY: the worker is live; nothing uses it after this.
        unsafe { ucp_worker_destroy(self.worker) };
        drop(leftover);
        for (_, m) in self.regions.drain() {
            // SAFETY: mapped on our context, no worker left to use it.
            unsafe { ucp_mem_unmap(self.ctx, m.memh) };
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
        // SAFETY: every worker and mapping of the context is gone.
        unsafe { ucp_cleanup(self.ctx) };
    }
}

/// Posts puts until the window is full or every op is out, then the flush.
fn post(t: &mut Transfer) -> Result<bool, (&'static str, ucs_status_t)> {
    let mut activity = false;
    while t.next < t.ops.len() && t.pending_bytes < WINDOW {
        let op = t.ops[t.next];
        let n = (op.len - t.next_off).min(CHUNK);
        // In bounds: write() validated local_offset + len <= region len.
        let src = t.region.ptr as usize + (op.local_offset + t.next_off) as usize;
        let dst = t.remote_base + op.remote_offset + t.next_off;
        // SAFETY: all-zero is a valid ucp_request_param_t.
        let mut p: ucp_request_param_t = unsafe { std::mem::zeroed() };
        p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
        p.memh = t.memh;
        // SAFETY: src..src+n lies in the mapped, live local region (held by
        // t.region); ep and rkey are open (ep_gone is false).
        let r = unsafe { ucp_put_nbx(t.ep, src as *const c_void, n as usize, dst, t.rkey, &p) };
        match posted(r) {
            Posted::Done => {}
            Posted::Pending(req) => {
                t.pending.push_back((req, n));
                t.pending_bytes += n;
            }
            Posted::Failed(s) => return Err(("ucp_put_nbx", s)),
        }
        activity = true;
        t.next_off += n;
        if t.next_off == op.len {
            t.next += 1;
            t.next_off = 0;
        }
    }
    if t.next == t.ops.len() && t.flush.is_none() && !t.flushed {
        // SAFETY: all-zero is a valid ucp_request_param_t.
        let p: ucp_request_param_t = unsafe { std::mem::zeroed() };
        // SAFETY: ep is open.
        let r = unsafe { ucp_ep_flush_nbx(t.ep, &p) };
        activity = true;
        match posted(r) {
            Posted::Done => t.flushed = true,
            Posted::Pending(req) => t.flush = Some(req),
            Posted::Failed(s) => return Err(("ucp_ep_flush_nbx", s)),
        }
    }
    Ok(activity)
}
