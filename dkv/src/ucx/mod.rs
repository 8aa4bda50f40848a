//! UCX transport. One actor thread per `Dkv` owns the UCP context and worker
//! (UCP objects are single-threaded); callers talk to it over a channel and
//! an eventfd. The actor sleeps on the worker's event fd when idle, so an idle
//! node burns no CPU yet still wakes for incoming writes.
//!
//! Writes are active messages, not one-sided puts: the context enables no
//! RMA at all. UCX's software puts (what tcp and shared memory do for puts)
//! write wherever the sender says, unchecked, and an rkey limits nothing
//! there; an active message instead carries its grant token and offset to
//! our handler, which checks them against the grant table and only then
//! copies the bytes (eager) or receives them straight into the granted
//! memory (rendezvous: zero-copy where the transport can, RDMA reads into
//! registered memory in production).
//!
//! Peers are connected by UCP worker address (`ucp_ep_create` with
//! `REMOTE_ADDRESS`): it works over tcp and shared memory on UCX 1.13, needs
//! no listener port per node, and the address travels in the descriptor.
//! Endpoints ask for peer error handling (so a dead or stuck peer can be
//! force-closed); transports without it (shared memory on 1.13) fall back to
//! no error handling, where a stuck transfer is abandoned instead.

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unreachable_pub,
    unused_imports,
    missing_debug_implementations,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
mod bindings;
pub(crate) mod sys;

#[cfg(test)]
mod attack;
pub(crate) mod raw;

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
use crate::grant::{GrantTable, Landing, TOKEN_LEN, Token};
use crate::{DkvError, Owner, RegionShared, WriteOp};

/// Our one active message: a KV write, header = grant token + offset.
const AM_KV_WRITE: u32 = 1;
pub(crate) const AM_HEADER_LEN: usize = TOKEN_LEN + 8;

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
/// is force-closed: a slow but live peer (a throttled link drains an 8 MiB
/// window at 10 Mbit/s in 7 s) keeps its connection; a dead one is cut off.
/// (Whatever still arrives later is refused by the receiver's grants.)
const GRACE: Duration = Duration::from_secs(10);
/// At shutdown, how long closing endpoints may take.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);
/// Zero bytes appended to addresses and keys handed to UCX, which parses
/// them without a length.
const PAD: usize = 1024;
const MAX_PEERS: usize = 256;
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
    /// its address.
    Register {
        id: u64,
        ptr: Option<usize>,
        len: usize,
        owner: Option<Owner>,
        reply: mpsc::SyncSender<Result<usize, DkvError>>,
    },
    Unregister(u64),
    Write(Box<WriteCmd>),
    Cancel(u64),
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
    /// Rendezvous receives into granted memory still in flight.
    pub receives: usize,
}

pub(crate) struct WriteCmd {
    pub id: u64,
    pub region: Arc<RegionShared>,
    /// Opened (validated) worker address payload.
    pub address: Vec<u8>,
    /// The receiver's grant, sent with every message.
    pub token: Token,
    /// Validated against both lengths, no empty ops.
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
    /// Our UCP worker address (the `Dkv` seals it into its descriptors).
    pub(crate) address: Vec<u8>,
}

impl UcxHandle {
    pub(crate) fn start(
        library: Option<&std::path::Path>,
        tls: Option<&str>,
        net_devices: Option<&str>,
        live: Arc<AtomicUsize>,
        grants: Arc<GrantTable>,
    ) -> Result<Self, DkvError> {
        let ucp = sys::load(library)?;
        let wake = Arc::new(Wake::new()?);
        let (tx, rx) = mpsc::channel();
        let (init_tx, init_rx) = mpsc::sync_channel(1);
        let tls = tls.map(str::to_owned);
        let net_devices = net_devices.map(str::to_owned);
        let actor_wake = wake.clone();
        let thread = std::thread::Builder::new()
            .name("dkv-ucx".into())
            .spawn(move || {
                match Actor::init(
                    ucp,
                    tls.as_deref(),
                    net_devices.as_deref(),
                    rx,
                    actor_wake,
                    live,
                    grants,
                ) {
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
            address,
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
    /// `None`; returns the address.
    pub(crate) fn register(
        &self,
        id: u64,
        ptr: Option<usize>,
        len: usize,
        owner: Option<Owner>,
    ) -> Result<usize, DkvError> {
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

/// What the receive handler needs; boxed at a fixed address for the
/// worker's lifetime (the handler's `arg`).
struct AmCtx {
    ucp: &'static Ucp,
    grants: Arc<GrantTable>,
    worker: ucp_worker_h,
    /// Rendezvous receives the handler started; the actor polls them.
    started: RefCell<Vec<(*mut c_void, Landing)>>,
}

/// Receives one KV write: checks the header against the grant table, then
/// copies the bytes in (eager) or starts receiving them straight into the
/// granted memory (rendezvous). A refused write lands nowhere.
///
/// Always returns `UCS_OK`, which to UCX (1.10 and later) means "done with
/// this message": eager data is freed after the return, and a rendezvous
/// message that no `ucp_am_recv_data_nbx` was started for is dropped (UCX
/// acknowledges it to the sender, whose send completes, and frees its
/// descriptor). Refusing is therefore to do nothing at all. In particular
/// `ucp_am_data_release` is only for data kept past the callback by
/// returning `UCS_INPROGRESS`: called here as well, the descriptor was
/// released and acknowledged twice, corrupting UCX's memory pool (the
/// decode node died in `ucp_am_rndv_process_rts` after a few hundred
/// refused rendezvous messages).
///
/// # Safety
/// Called by UCX inside `ucp_worker_progress` on the actor thread, with
/// `arg` the actor's live `AmCtx` and the header/data/param pointers UCX
/// documents for `ucp_am_recv_callback_t`.
unsafe extern "C" fn on_kv_write(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // Must not unwind: nothing below panics.
    // SAFETY: `arg` is the AmCtx the actor registered, alive while the
    // worker is (it is dropped only after ucp_worker_destroy).
    let ctx = unsafe { &*arg.cast::<AmCtx>() };
    let ucp = ctx.ucp;
    // SAFETY: UCX passes a valid param for the duration of the call.
    let rndv = !param.is_null()
        && unsafe { (*param).recv_attr } & u64::from(UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let landing = if header.is_null() || header_length != AM_HEADER_LEN {
        ctx.grants.refuse_malformed();
        None
    } else {
        // SAFETY: UCX gives `header_length` readable bytes at `header`.
        let h = unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) };
        let token = Token::from_bytes(&h[..TOKEN_LEN]);
        let offset = h[TOKEN_LEN..]
            .try_into()
            .ok()
            .map(u64::from_le_bytes)
            .unwrap_or(u64::MAX);
        match token {
            Some(t) => ctx.grants.accept(&t, offset, length as u64).ok(),
            None => {
                ctx.grants.refuse_malformed();
                None
            }
        }
    };
    match landing {
        // Refused (and counted): UCX drops the message once we return.
        None => {}
        Some(l) if rndv => {
            // SAFETY: all-zero is a valid ucp_request_param_t (contiguous
            // bytes, no callback: the actor polls the request).
            let p: ucp_request_param_t = unsafe { std::mem::zeroed() };
            // SAFETY: `data` is UCX's rendezvous descriptor; the granted
            // range [dst, dst+length) lies in live memory that the landing
            // keeps alive until it is finished.
            let r = unsafe {
                ucp.ucp_am_recv_data_nbx(ctx.worker, data, l.dst as *mut c_void, length, &p)
            };
            match posted(r) {
                Posted::Done => l.done(),
                Posted::Pending(req) => match ctx.started.try_borrow_mut() {
                    Ok(mut started) => started.push((req, l)),
                    // Cannot happen (only this thread borrows, never across
                    // a progress call); if it did, keep the grant in flight
                    // for good rather than let the memory go while UCX may
                    // still write it.
                    Err(_) => std::mem::forget(l),
                },
                // Nothing was received; UCX keeps the descriptor (a receive
                // was started on it), and the range may be written again.
                Posted::Failed(_) => drop(l),
            }
        }
        Some(l) if !data.is_null() => {
            // SAFETY: eager data: `length` readable bytes at `data`; the
            // landing's range (same length) is granted, live memory.
            unsafe {
                ptr::copy_nonoverlapping(data.cast::<u8>(), l.dst as *mut u8, length);
            }
            l.done();
        }
        // No bytes to copy: nothing landed (the landing, dropped, says so).
        Some(_) => {}
    }
    UCS_OK
}

struct Peer {
    address: Vec<u8>,
    ep: ucp_ep_h,
    /// Endpoint created with peer error handling (can be force-closed).
    peer_errors: bool,
}

/// An endpoint being closed; forgotten once no transfer on it has requests
/// left and the close completed.
struct Closing {
    peer: u64,
    req: *mut c_void,
}

struct Transfer {
    id: u64,
    peer: u64,
    ep: ucp_ep_h,
    token: Token,
    memh: ucp_mem_h,
    /// Keeps the source memory mapped and alive while UCX may read it.
    region: Arc<RegionShared>,
    ops: Vec<WriteOp>,
    next: usize,
    next_off: u64,
    /// Posted messages: request, bytes, and the header UCX may still read.
    pending: VecDeque<(*mut c_void, u64, Box<[u8; AM_HEADER_LEN]>)>,
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

fn transfer_error(ucp: &Ucp, op: &'static str, s: ucs_status_t) -> DkvError {
    if is_peer_failure(s) {
        DkvError::PeerUnreachable(format!("{op}: {}", ucp.status_string(s)))
    } else {
        DkvError::Ucx {
            op,
            status: ucp.status_string(s),
        }
    }
}

fn ucx_err(ucp: &Ucp, op: &'static str, s: ucs_status_t) -> DkvError {
    DkvError::Ucx {
        op,
        status: ucp.status_string(s),
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
fn poll_request(ucp: &Ucp, req: *mut c_void) -> Option<ucs_status_t> {
    // SAFETY: `req` came from an nbx call on our worker and is not freed yet.
    let s = unsafe { ucp.ucp_request_check_status(req) };
    if s == UCS_INPROGRESS {
        return None;
    }
    // SAFETY: complete and owned by us; freed exactly once.
    unsafe { ucp.ucp_request_free(req) };
    Some(s)
}

fn unavailable(ucp: &Ucp, op: &str, s: ucs_status_t) -> DkvError {
    DkvError::UcxUnavailable(format!("{op}: {}", ucp.status_string(s)))
}

/// UCX's configuration: its `UCX_*` environment variables, with the
/// node's transports and interfaces and the TCP tuning on top.
fn read_config(
    ucp: &Ucp,
    tls: Option<&str>,
    net_devices: Option<&str>,
) -> Result<*mut ucp_config_t, DkvError> {
    let mut config: *mut ucp_config_t = ptr::null_mut();
    // SAFETY: out-pointer to a local; NULL prefix/file read UCX_* env vars.
    let s = unsafe { ucp.ucp_config_read(ptr::null(), ptr::null(), &mut config) };
    if s != UCS_OK {
        return Err(unavailable(ucp, "ucp_config_read", s));
    }
    if let Err(e) = configure(ucp, config, tls, net_devices) {
        // SAFETY: releasing the config we read.
        unsafe { ucp.ucp_config_release(config) };
        return Err(e);
    }
    Ok(config)
}

/// Applies the node's settings to the live `config`.
fn configure(
    ucp: &Ucp,
    config: *mut ucp_config_t,
    tls: Option<&str>,
    net_devices: Option<&str>,
) -> Result<(), DkvError> {
    if let Some(tls) = tls {
        set_option(ucp, config, c"TLS", "ucx_tls", tls)?;
    }
    // Only the interfaces the node was told to use (an explicit
    // UCX_NET_DEVICES wins): UCX otherwise listens on every interface,
    // the external ones too when the node binds 127.0.0.1.
    if let Some(devices) = net_devices
        && std::env::var_os("UCX_NET_DEVICES").is_none()
    {
        set_option(ucp, config, c"NET_DEVICES", "ucx_net_devices", devices)?;
    }
    // Messages over TCP go out in TX segments; 64 KiB instead of 8 KiB
    // gave 1.4-2x the bandwidth here (bench/dkv.sh).
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
        let s = unsafe { ucp.ucp_config_modify(config, name.as_ptr(), value.as_ptr()) };
        if s != UCS_OK {
            tracing::debug!(
                env,
                "dkv: UCX rejected a tuning option: {}",
                ucp.status_string(s)
            );
        }
    }
    Ok(())
}

/// Sets UCX option `name` (`UCX_<name>`) to the value of the node's
/// `flag`.
fn set_option(
    ucp: &Ucp,
    config: *mut ucp_config_t,
    name: &std::ffi::CStr,
    flag: &str,
    value: &str,
) -> Result<(), DkvError> {
    let c_value = CString::new(value)
        .map_err(|_| DkvError::UcxUnavailable(format!("{flag} {value:?} contains NUL")))?;
    // SAFETY: config is live; both strings are NUL-terminated.
    let s = unsafe { ucp.ucp_config_modify(config, name.as_ptr(), c_value.as_ptr()) };
    if s != UCS_OK {
        return Err(DkvError::UcxUnavailable(format!(
            "UCX_{}={value}: {}",
            name.to_string_lossy(),
            ucp.status_string(s)
        )));
    }
    Ok(())
}

/// A UCX context for active messages with wakeup; releases `config`.
fn create_context(ucp: &Ucp, config: *mut ucp_config_t) -> Result<ucp_context_h, DkvError> {
    // SAFETY: all-zero is a valid ucp_params_t (masks select fields).
    let mut params: ucp_params_t = unsafe { std::mem::zeroed() };
    params.field_mask = u64::from(UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME);
    // No RMA: see the module comment.
    params.features = u64::from(UCP_FEATURE_AM | UCP_FEATURE_WAKEUP);
    params.name = c"tandem-dkv".as_ptr();
    let mut ctx: ucp_context_h = ptr::null_mut();
    // SAFETY: ucp_init is a static inline wrapper around this call.
    let s =
        unsafe { ucp.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx) };
    // SAFETY: the config is copied by ucp_init.
    unsafe { ucp.ucp_config_release(config) };
    if s != UCS_OK {
        return Err(unavailable(ucp, "ucp_init", s));
    }
    Ok(ctx)
}

/// The actor's single-threaded worker; cleans `ctx` up if it fails.
fn create_worker(ucp: &Ucp, ctx: ucp_context_h) -> Result<ucp_worker_h, DkvError> {
    // SAFETY: all-zero is a valid ucp_worker_params_t.
    let mut wparams: ucp_worker_params_t = unsafe { std::mem::zeroed() };
    wparams.field_mask = u64::from(UCP_WORKER_PARAM_FIELD_THREAD_MODE);
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    let mut worker: ucp_worker_h = ptr::null_mut();
    // SAFETY: ctx is live; out-pointer to a local.
    let s = unsafe { ucp.ucp_worker_create(ctx, &wparams, &mut worker) };
    if s != UCS_OK {
        // SAFETY: nothing else uses ctx.
        unsafe { ucp.ucp_cleanup(ctx) };
        return Err(unavailable(ucp, "ucp_worker_create", s));
    }
    Ok(worker)
}

/// Installs the KV write handler (its `arg` is `am`, which must outlive
/// the worker) and returns the worker's event fd and address.
fn open_worker(ucp: &Ucp, worker: ucp_worker_h, am: &AmCtx) -> Result<(i32, Vec<u8>), DkvError> {
    // SAFETY: all-zero is a valid ucp_am_handler_param_t.
    let mut hp: ucp_am_handler_param_t = unsafe { std::mem::zeroed() };
    hp.field_mask = u64::from(
        UCP_AM_HANDLER_PARAM_FIELD_ID
            | UCP_AM_HANDLER_PARAM_FIELD_FLAGS
            | UCP_AM_HANDLER_PARAM_FIELD_CB
            | UCP_AM_HANDLER_PARAM_FIELD_ARG,
    );
    hp.id = AM_KV_WRITE;
    // Eager fragments arrive assembled: one call per message.
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = Some(on_kv_write);
    hp.arg = ptr::from_ref(am).cast_mut().cast();
    // SAFETY: worker is live; the handler's arg outlives the worker
    // (the actor drops `am` only after destroying it).
    let s = unsafe { ucp.ucp_worker_set_am_recv_handler(worker, &hp) };
    if s != UCS_OK {
        return Err(unavailable(ucp, "ucp_worker_set_am_recv_handler", s));
    }
    let mut efd = -1;
    // SAFETY: worker is live; out-pointer to a local.
    let s = unsafe { ucp.ucp_worker_get_efd(worker, &mut efd) };
    if s != UCS_OK {
        return Err(unavailable(ucp, "ucp_worker_get_efd", s));
    }
    let mut addr: *mut ucp_address_t = ptr::null_mut();
    let mut addr_len = 0usize;
    // SAFETY: worker is live; out-pointers to locals.
    let s = unsafe { ucp.ucp_worker_get_address(worker, &mut addr, &mut addr_len) };
    if s != UCS_OK || addr.is_null() {
        return Err(unavailable(ucp, "ucp_worker_get_address", s));
    }
    // SAFETY: UCX returned addr_len readable bytes at addr.
    let address = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), addr_len) }.to_vec();
    // SAFETY: releasing the buffer UCX gave us.
    unsafe { ucp.ucp_worker_release_address(worker, addr) };
    Ok((efd, address))
}

/// Shared-memory-only transport lists cannot do peer error handling on
/// 1.13; the actor skips the attempt (and the error UCX logs for it).
fn shared_memory_only(tls: Option<&str>) -> bool {
    tls.is_some_and(|t| {
        !t.starts_with('^')
            && t.split(',').all(|x| {
                matches!(
                    x.trim(),
                    "posix" | "sysv" | "cma" | "knem" | "xpmem" | "self" | "sm" | "shm"
                )
            })
    })
}

struct Actor {
    ucp: &'static Ucp,
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
    /// The receive handler's context (its address is the handler's `arg`).
    am: Box<AmCtx>,
    /// Rendezvous receives in flight into granted memory.
    receives: Vec<(*mut c_void, Landing)>,
    /// The first byte of our own worker address: UCX's address header
    /// (format version and flags).
    header: u8,
}

impl Actor {
    fn init(
        ucp: &'static Ucp,
        tls: Option<&str>,
        net_devices: Option<&str>,
        rx: mpsc::Receiver<Cmd>,
        wake: Arc<Wake>,
        live: Arc<AtomicUsize>,
        grants: Arc<GrantTable>,
    ) -> Result<(Self, Vec<u8>), DkvError> {
        let config = read_config(ucp, tls, net_devices)?;
        let ctx = create_context(ucp, config)?;
        let worker = create_worker(ucp, ctx)?;
        let am = Box::new(AmCtx {
            ucp,
            grants,
            worker,
            started: RefCell::new(Vec::new()),
        });
        let (efd, address) = match open_worker(ucp, worker, &am) {
            Ok(opened) => opened,
            Err(e) => {
                // SAFETY: worker and ctx are live and unused elsewhere.
                unsafe {
                    ucp.ucp_worker_destroy(worker);
                    ucp.ucp_cleanup(ctx);
                }
                return Err(e);
            }
        };
        let actor = Self {
            ucp,
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
            no_peer_errors: shared_memory_only(tls),
            transfers: Vec::new(),
            closing: Vec::new(),
            am,
            receives: Vec::new(),
            header: address.first().copied().unwrap_or_default(),
        };
        Ok((actor, address))
    }

    fn run(mut self) {
        let ucp = self.ucp;
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
            let s = unsafe { ucp.ucp_worker_arm(self.worker) };
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
        let live = self.transfers.iter().any(|t| t.stopped.is_none()) || !self.receives.is_empty();
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
        let ucp = self.ucp;
        let mut any = false;
        for _ in 0..64 {
            // SAFETY: worker is live and used only on this thread.
            if unsafe { ucp.ucp_worker_progress(self.worker) } == 0 {
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
            self.evict(peer, &format!("endpoint error: {}", ucp.status_string(s)));
        }
        if let Ok(mut started) = self.am.started.try_borrow_mut() {
            any |= !started.is_empty();
            self.receives.append(&mut started);
        }
        // Finished receives: the bytes are in (or, failed, never will be).
        let before = self.receives.len();
        let mut kept = Vec::with_capacity(before);
        for (req, landing) in self.receives.drain(..) {
            match poll_request(ucp, req) {
                None => kept.push((req, landing)),
                Some(st) if st == UCS_OK => landing.done(),
                Some(st) => {
                    tracing::debug!("dkv: a granted receive failed: {}", ucp.status_string(st));
                    drop(landing);
                }
            }
        }
        any |= kept.len() != before;
        self.receives = kept;
        any
    }

    fn handle(&mut self, cmd: Cmd) {
        let ucp = self.ucp;
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
                    unsafe { ucp.ucp_mem_unmap(self.ctx, m.memh) };
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
                    receives: self.receives.len(),
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
    ) -> Result<usize, DkvError> {
        let ucp = self.ucp;
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
        let s = unsafe { ucp.ucp_mem_map(self.ctx, &p, &mut memh) };
        if s != UCS_OK {
            return Err(ucx_err(ucp, "ucp_mem_map", s));
        }
        let base = match ptr {
            Some(p) => p,
            None => {
                // SAFETY: all-zero is a valid ucp_mem_attr_t.
                let mut attr: ucp_mem_attr_t = unsafe { std::mem::zeroed() };
                attr.field_mask = u64::from(UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH);
                // SAFETY: memh is live; out-pointer to a local.
                let s = unsafe { ucp.ucp_mem_query(memh, &mut attr) };
                if s != UCS_OK || attr.address.is_null() || attr.length < len {
                    // SAFETY: undo the map above.
                    unsafe { ucp.ucp_mem_unmap(self.ctx, memh) };
                    return Err(ucx_err(ucp, "ucp_mem_query", s));
                }
                // SAFETY: UCX allocated at least len bytes there for us.
                unsafe { ptr::write_bytes(attr.address.cast::<u8>(), 0, len) };
                attr.address as usize
            }
        };
        self.regions.insert(
            id,
            Mapped {
                memh,
                _owner: owner,
            },
        );
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok(base)
    }

    fn connect(&mut self, address: &[u8]) -> Result<u64, DkvError> {
        let ucp = self.ucp;
        if let Some(&id) = self.by_address.get(address) {
            return Ok(id);
        }
        // UCX asserts (aborting the process) on addresses it does not
        // expect. The address verified under the cluster's key, so a node
        // of the cluster made it; its header must still be ours (the nodes
        // of a cluster run the same UCX and address settings): a node of
        // another UCX build is refused here, not aborted on.
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
            // SAFETY: the address verified under the cluster key as a node's and is
            // zero-padded so UCX's length-less parse stays in bounds.
            let s = unsafe { ucp.ucp_ep_create(self.worker, &p, &mut ep) };
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
                ucp.status_string(s)
            )));
        }
        self.peers.insert(
            id,
            Peer {
                address: address.to_vec(),
                ep,
                peer_errors,
            },
        );
        self.by_address.insert(address.to_vec(), id);
        Ok(id)
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
        let Some(ep) = self.peers.get(&peer).map(|p| p.ep) else {
            return;
        };
        self.transfers.push(Transfer {
            id: w.id,
            peer,
            ep,
            token: w.token,
            memh,
            region: w.region,
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
        let ucp = self.ucp;
        let mut activity = false;
        let mut evict: Vec<(u64, String)> = Vec::new();
        for t in &mut self.transfers {
            if t.reply.as_ref().is_some_and(|r| r.is_closed()) {
                t.reply = None;
                t.stopped.get_or_insert(now);
            }
            if t.reply.is_some() && now >= t.deadline {
                t.fail(DkvError::DeadlineExceeded, now);
                activity = true;
            }
            // Reap locally completed sends (in order is the common case).
            while let Some(&(req, len, _)) = t.pending.front() {
                match poll_request(ucp, req) {
                    None => break,
                    Some(s) => {
                        t.pending.pop_front();
                        t.pending_bytes -= len;
                        activity = true;
                        if s != UCS_OK && t.stopped.is_none() {
                            t.fail(transfer_error(ucp, "ucp_am_send_nbx", s), now);
                            evict.push((t.peer, format!("send failed: {}", ucp.status_string(s))));
                        }
                    }
                }
            }
            if let Some(req) = t.flush
                && let Some(s) = poll_request(ucp, req)
            {
                t.flush = None;
                activity = true;
                if s == UCS_OK {
                    t.flushed = true;
                } else if t.stopped.is_none() {
                    t.fail(transfer_error(ucp, "ucp_ep_flush_nbx", s), now);
                    evict.push((t.peer, format!("flush failed: {}", ucp.status_string(s))));
                }
            }
            if t.stopped.is_some()
                && let Some(req) = t.flush.take()
            {
                // A stopped transfer need not wait for remote completion;
                // the flush does not touch our memory.
                // SAFETY: releases our handle; UCX frees it on completion.
                unsafe { ucp.ucp_request_free(req) };
            }
            if t.stopped.is_none() && !t.ep_gone {
                match post(ucp, t) {
                    Ok(a) => activity |= a,
                    Err((op, s)) => {
                        activity = true;
                        t.fail(transfer_error(ucp, op, s), now);
                        evict.push((t.peer, format!("{op}: {}", ucp.status_string(s))));
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
        // Dropping t.region may queue an Unregister to ourselves.
    }

    /// Closes a peer's endpoint (force when it has peer error handling),
    /// failing the transfers on it.
    fn evict(&mut self, peer_id: u64, why: &str) {
        let ucp = self.ucp;
        let Some(peer) = self.peers.remove(&peer_id) else {
            return;
        };
        self.by_address.remove(&peer.address);
        let now = Instant::now();
        for t in self.transfers.iter_mut().filter(|t| t.peer == peer_id) {
            t.fail(DkvError::PeerUnreachable(why.to_owned()), now);
            t.ep_gone = true;
            // A flush on a closed endpoint completes (cancelled) by itself;
            // we only wait for sends, which read the source memory.
            if let Some(req) = t.flush.take() {
                // SAFETY: releases our handle; UCX frees it on completion.
                unsafe { ucp.ucp_request_free(req) };
            }
        }
        tracing::debug!(peer_id, why, "dkv: closing endpoint");
        // SAFETY: all-zero is a valid ucp_request_param_t.
        let mut p: ucp_request_param_t = unsafe { std::mem::zeroed() };
        if peer.peer_errors {
            p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: ep is open and closed exactly once (removed from peers).
        let r = unsafe { ucp.ucp_ep_close_nbx(peer.ep, &p) };
        let req = match posted(r) {
            Posted::Pending(req) => req,
            Posted::Done | Posted::Failed(_) => ptr::null_mut(),
        };
        self.closing.push(Closing { peer: peer_id, req });
    }

    fn reap_closing(&mut self) {
        let ucp = self.ucp;
        let transfers = &self.transfers;
        self.closing.retain_mut(|c| {
            if !c.req.is_null() {
                match poll_request(ucp, c.req) {
                    None => return true,
                    Some(_) => c.req = ptr::null_mut(),
                }
            }
            transfers.iter().any(|t| t.peer == c.peer)
        });
    }

    fn shutdown(mut self) {
        let ucp = self.ucp;
        let now = Instant::now();
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
        unsafe { ucp.ucp_worker_destroy(self.worker) };
        drop(leftover);
        for (_, m) in self.regions.drain() {
            // SAFETY: mapped on our context, no worker left to use it.
            unsafe { ucp.ucp_mem_unmap(self.ctx, m.memh) };
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
        // SAFETY: every worker and mapping of the context is gone.
        unsafe { ucp.ucp_cleanup(self.ctx) };
    }
}

/// Posts messages until the window is full or every op is out, then the
/// flush.
fn post(ucp: &Ucp, t: &mut Transfer) -> Result<bool, (&'static str, ucs_status_t)> {
    let mut activity = false;
    let token = t.token.to_bytes();
    while t.next < t.ops.len() && t.pending_bytes < WINDOW {
        let op = t.ops[t.next];
        let n = (op.len - t.next_off).min(CHUNK);
        // In bounds: write() validated local_offset + len <= region len.
        let src = t.region.ptr as usize + (op.local_offset + t.next_off) as usize;
        let mut header = Box::new([0u8; AM_HEADER_LEN]);
        header[..TOKEN_LEN].copy_from_slice(&token);
        header[TOKEN_LEN..].copy_from_slice(&(op.remote_offset + t.next_off).to_le_bytes());
        // SAFETY: all-zero is a valid ucp_request_param_t.
        let mut p: ucp_request_param_t = unsafe { std::mem::zeroed() };
        p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
        p.memh = t.memh;
        // SAFETY: src..src+n lies in the mapped, live local region (held by
        // t.region); the header lives in `pending` until the request
        // completes; ep is open (ep_gone is false).
        let r = unsafe {
            ucp.ucp_am_send_nbx(
                t.ep,
                AM_KV_WRITE,
                header.as_ptr().cast(),
                AM_HEADER_LEN,
                src as *const c_void,
                n as usize,
                &p,
            )
        };
        match posted(r) {
            Posted::Done => {}
            Posted::Pending(req) => {
                t.pending.push_back((req, n, header));
                t.pending_bytes += n;
            }
            Posted::Failed(s) => return Err(("ucp_am_send_nbx", s)),
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
        let r = unsafe { ucp.ucp_ep_flush_nbx(t.ep, &p) };
        activity = true;
        match posted(r) {
            Posted::Done => t.flushed = true,
            Posted::Pending(req) => t.flush = Some(req),
            Posted::Failed(s) => return Err(("ucp_ep_flush_nbx", s)),
        }
    }
    Ok(activity)
}
