//! dKV: the KV block transfer engine. A prefill node writes KV bytes from
//! its registered memory into a decode node's registered memory; the
//! receiver lets a write land only where a live [`Grant`] of its own allows
//! it (UCX active messages checked on arrival, then copied, or received
//! zero-copy by rendezvous, into the granted bytes).
//!
//! - [`Dkv`]: one transport instance (UCX, or in-process for tests).
//! - [`Region`]: registered local memory.
//! - [`Grant`]: ranges of a region one peer may write, once, until it
//!   expires or is revoked; its [`RemoteRegion`] descriptor is plain data
//!   the nodes exchange over gRPC.
//! - [`Dkv::write`]: validated writes with a deadline.
//! - [`KvLayout`]: block ids -> [`WriteOp`]s for the engine's block layout.

mod descriptor;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod grant;
mod key;
pub mod layout;
mod local;
mod metrics;
mod ucx;

#[cfg(test)]
mod tests;

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;

use crate::grant::{GrantTable, Token};
pub use error::DkvError;
pub use grant::{Grant, Refusal};
pub use key::{DkvKey, KEY_LEN};
pub use layout::KvLayout;
pub use metrics::{DkvMetrics, metrics};

/// Keeps registered memory alive for as long as its `Region` (and any
/// transfer reading from it) lives.
pub type Owner = Arc<dyn Any + Send + Sync>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// UCX (tcp, shared memory, RDMA where present).
    Ucx,
    /// memcpy between `Dkv`s of this process.
    InProcess,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DkvConfig {
    pub transport: TransportKind,
    /// `UCX_TLS` for this instance (e.g. `"tcp"`); `None` lets UCX choose
    /// (and honours a `UCX_TLS` environment variable).
    pub ucx_tls: Option<String>,
    /// `UCX_NET_DEVICES` (e.g. `"lo"`, `"eth0"`): the network interfaces
    /// UCX's network transports listen and connect on. `None` lets UCX use
    /// them all; a `UCX_NET_DEVICES` environment variable wins.
    pub ucx_net_devices: Option<String>,
    /// The UCP library to load when the UCX transport starts: a file name
    /// the dynamic loader looks up (`LD_LIBRARY_PATH` included) or a path.
    /// `None`: `libucp.so.0`. A library that is missing or lacks a function
    /// makes [`Dkv::new`] fail with [`DkvError::UcxUnavailable`].
    pub ucx_library: Option<std::path::PathBuf>,
    /// The cluster's dKV key: our descriptors' worker address is sealed
    /// with it, and a peer's must verify under it before it is used (see
    /// [`DkvKey`]). `None`: a key this process makes at random, shared by
    /// its `Dkv`s only (tests, and everything in one process).
    pub key: Option<DkvKey>,
}

impl DkvConfig {
    pub fn ucx() -> Self {
        Self {
            transport: TransportKind::Ucx,
            ucx_tls: None,
            ucx_net_devices: None,
            ucx_library: None,
            key: None,
        }
    }

    pub fn in_process() -> Self {
        Self {
            transport: TransportKind::InProcess,
            ucx_tls: None,
            ucx_net_devices: None,
            ucx_library: None,
            key: None,
        }
    }
}

/// Where a peer may write: plain data, carried in protobuf by the nodes.
/// `worker_address` (the owner's UCP worker address: writers connect by
/// address, so a node needs no listener port for dkv; tagged under the
/// cluster's [`DkvKey`]) and `grant` (the grant's id and secret, with a
/// checksum) are opaque blobs; `len` is the
/// region's length, which write offsets are relative to. A descriptor is
/// honoured while its [`Grant`] lives, for the granted bytes only.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteRegion {
    pub worker_address: Vec<u8>,
    pub grant: Vec<u8>,
    pub len: u64,
}

impl fmt::Debug for RemoteRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The grant's secret stays out of logs.
        f.debug_struct("RemoteRegion")
            .field("worker_address_len", &self.worker_address.len())
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Copy `len` bytes at `local_offset` of the local region to `remote_offset`
/// of the remote one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOp {
    pub local_offset: u64,
    pub remote_offset: u64,
    pub len: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferStats {
    pub bytes: u64,
    pub ops: usize,
    pub elapsed: Duration,
}

/// Ids of `Dkv` instances and regions, unique in the process.
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

enum Backend {
    Local,
    Ucx(ucx::UcxHandle),
}

struct DkvInner {
    id: u64,
    backend: Backend,
    /// Where `write` records its transfers.
    metrics: &'static DkvMetrics,
    /// Registrations not yet undone (UCX: counted by the actor as it maps
    /// and unmaps).
    live: Arc<AtomicUsize>,
    /// What peers may write into our regions (the receiving side checks
    /// every incoming write here).
    grants: Arc<GrantTable>,
    /// The sealed worker address of our descriptors.
    address: Vec<u8>,
    /// What peers' addresses must verify under.
    key: DkvKey,
    closed: AtomicBool,
}

impl DkvInner {
    fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        match &self.backend {
            Backend::Local => local::remove_instance(self.id),
            Backend::Ucx(h) => h.shutdown(),
        }
        // Nothing lands any more; owners waiting on a grant are told.
        self.grants.clear();
    }
}

impl Drop for DkvInner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A transfer engine instance: `Send + Sync`, cheap to clone. With UCX it
/// owns an actor thread, stopped and joined by [`Dkv::shutdown`] or the
/// last drop.
#[derive(Clone)]
pub struct Dkv {
    inner: Arc<DkvInner>,
}

impl fmt::Debug for Dkv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dkv")
            .field("id", &self.inner.id)
            .field("connector", &self.connector())
            .finish()
    }
}

impl Dkv {
    /// A transport recording into the process's [`metrics()`].
    pub fn new(cfg: DkvConfig) -> Result<Dkv, DkvError> {
        Self::with_metrics(cfg, metrics())
    }

    /// A transport recording into `metrics` (instruments on a meter of the
    /// caller's choice, e.g. a test's own provider).
    pub fn with_metrics(cfg: DkvConfig, metrics: &'static DkvMetrics) -> Result<Dkv, DkvError> {
        let id = next_id();
        let live = Arc::new(AtomicUsize::new(0));
        let connector = match cfg.transport {
            TransportKind::InProcess => "local",
            TransportKind::Ucx => "ucx",
        };
        let key = match cfg.key {
            Some(k) => k,
            None => process_key()?,
        };
        let grants = GrantTable::new(metrics, connector);
        let (backend, address) = match cfg.transport {
            TransportKind::InProcess => {
                local::add_instance(id, grants.clone());
                let address = descriptor::seal_keyed(
                    &key,
                    descriptor::MAGIC_LOCAL_ADDRESS,
                    &id.to_le_bytes(),
                );
                (Backend::Local, address)
            }
            TransportKind::Ucx => {
                let h = ucx::UcxHandle::start(
                    cfg.ucx_library.as_deref(),
                    cfg.ucx_tls.as_deref(),
                    cfg.ucx_net_devices.as_deref(),
                    live.clone(),
                    grants.clone(),
                )?;
                let address =
                    descriptor::seal_keyed(&key, descriptor::MAGIC_UCX_ADDRESS, &h.address);
                (Backend::Ucx(h), address)
            }
        };
        let dkv = Dkv {
            inner: Arc::new(DkvInner {
                id,
                backend,
                metrics,
                live,
                grants,
                address,
                key,
                closed: AtomicBool::new(false),
            }),
        };
        metrics.expose_zeros(dkv.connector());
        Ok(dkv)
    }

    /// The metrics label of this transport: `"ucx"` or `"local"`.
    pub fn connector(&self) -> &'static str {
        match self.inner.backend {
            Backend::Local => "local",
            Backend::Ucx(_) => "ucx",
        }
    }

    /// Stops the transport (joins the UCX thread); in-flight and later
    /// calls fail with [`DkvError::Shutdown`]. Also happens on the last drop.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }

    /// Registrations of this instance not yet undone (a leak check).
    /// Deregistration runs on the transport thread, so a dropped `Region`
    /// may be counted for a moment longer.
    pub fn live_registrations(&self) -> usize {
        self.inner.live.load(Ordering::Relaxed)
    }

    /// Grants not yet revoked, or revoked with a write still landing (a
    /// leak check).
    pub fn live_grants(&self) -> usize {
        self.inner.grants.live()
    }

    /// Incoming writes refused so far (no valid grant for them).
    pub fn refused_writes(&self) -> u64 {
        self.inner.grants.refused()
    }

    /// Registers `[ptr, ptr+len)` so that peers may write the parts of it
    /// that a [`Grant`] names and local writes may read from it
    /// (`ucp_mem_map`).
    ///
    /// # Safety
    /// The memory must stay valid while the returned `Region` lives; `owner`
    /// is kept alive by the `Region` (and by transfers and grants still
    /// using it), so making `owner` own the memory satisfies this. Granted
    /// ranges may be written by the peer at any time until the grant is
    /// revoked.
    pub unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        owner: Owner,
    ) -> Result<Region, DkvError> {
        if ptr.is_null() {
            return Err(DkvError::InvalidRegion("null pointer".into()));
        }
        self.add_region(Some(ptr), len, owner)
    }

    /// Allocates `len` zeroed bytes and registers them; the memory lives as
    /// long as the `Region` (see [`Region::as_ptr`]). With UCX the transports
    /// allocate it, suitably for their zero-copy paths (registered with
    /// RDMA devices where there are any).
    pub fn alloc(&self, len: usize) -> Result<Region, DkvError> {
        self.add_region(None, len, Arc::new(()))
    }

    fn add_region(
        &self,
        ptr: Option<*mut u8>,
        len: usize,
        owner: Owner,
    ) -> Result<Region, DkvError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(DkvError::Shutdown);
        }
        if len == 0 || len > isize::MAX as usize {
            return Err(DkvError::InvalidRegion(format!(
                "cannot register {len} bytes"
            )));
        }
        let id = next_id();
        let (ptr, release, owner) = match &self.inner.backend {
            Backend::Local => {
                let (ptr, owner) = match ptr {
                    Some(p) => (p, owner),
                    None => {
                        let mem = HostMem::zeroed(len)?;
                        (mem.ptr, Arc::new(mem) as Owner)
                    }
                };
                (ptr, Release::Local, Some(owner))
            }
            Backend::Ucx(h) => {
                // The actor keeps the owner with the mapping.
                let base = h.register(id, ptr.map(|p| p as usize), len, Some(owner))?;
                (base as *mut u8, Release::Ucx(h.releaser()), None)
            }
        };
        let shared = Arc::new(RegionShared {
            id,
            dkv: self.inner.id,
            ptr,
            len,
            worker_address: self.inner.address.clone(),
            grants: self.inner.grants.clone(),
            release,
        });
        if let Some(owner) = owner {
            local::add_region(&shared, owner, self.inner.live.clone());
        }
        Ok(Region { shared })
    }

    /// Writes from `local` into the ranges `remote`'s grant allows;
    /// resolves once the peer's transport has every byte (the receiver's
    /// [`Grant`] tells when they landed: it alone checks and copies them).
    /// Every op is checked against both lengths before anything is sent.
    /// Past `deadline` -> [`DkvError::DeadlineExceeded`]. Dropping the
    /// future cancels: no more bytes are sent for it (at most one window
    /// already posted still arrives), and an endpoint that does not drain
    /// is force-closed. The in-process transport reports a refused write
    /// as [`DkvError::Refused`]; over UCX only the receiver knows.
    pub async fn write(
        &self,
        local: &Region,
        remote: &RemoteRegion,
        ops: &[WriteOp],
        deadline: Instant,
    ) -> Result<TransferStats, DkvError> {
        let start = Instant::now();
        let labels = [KeyValue::new("connector", self.connector())];
        let m = self.inner.metrics;
        let mut guard = CancelGuard {
            dkv: self,
            id: 0,
            armed: false,
            labels: &labels,
        };
        let r = self
            .write_inner(local, remote, ops, deadline, &mut guard)
            .await;
        guard.armed = false;
        match &r {
            Ok(bytes) => {
                m.bytes_transferred.add(*bytes, &labels);
                m.transfer_latency
                    .record(start.elapsed().as_secs_f64() * 1e3, &labels);
            }
            Err(e) => m
                .transfer_failures
                .add(1, &[labels[0].clone(), KeyValue::new("reason", e.reason())]),
        }
        let bytes = r?;
        Ok(TransferStats {
            bytes,
            ops: ops.len(),
            elapsed: start.elapsed(),
        })
    }

    async fn write_inner(
        &self,
        local: &Region,
        remote: &RemoteRegion,
        ops: &[WriteOp],
        deadline: Instant,
        guard: &mut CancelGuard<'_>,
    ) -> Result<u64, DkvError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(DkvError::Shutdown);
        }
        if local.shared.dkv != self.inner.id {
            return Err(DkvError::InvalidRegion(
                "local region was registered by another Dkv".into(),
            ));
        }
        let (address, token) = self.open(remote)?;
        let (ops, bytes) = plan(local.shared.len as u64, remote.len, ops)?;
        if Instant::now() >= deadline {
            return Err(DkvError::DeadlineExceeded);
        }
        match &self.inner.backend {
            Backend::Local => {
                let instance = descriptor::read_u64("worker_address", address, 0)?;
                local::write(&local.shared, instance, &token, &ops, deadline)?;
                Ok(bytes)
            }
            Backend::Ucx(h) => {
                if ops.is_empty() {
                    return Ok(0);
                }
                let (tx, rx) = tokio::sync::oneshot::channel();
                let id = next_id();
                h.send(ucx::Cmd::Write(Box::new(ucx::WriteCmd {
                    id,
                    region: local.shared.clone(),
                    address: address.to_vec(),
                    token,
                    ops,
                    deadline,
                    reply: tx,
                })))?;
                guard.id = id;
                guard.armed = true;
                rx.await.unwrap_or(Err(DkvError::Shutdown))?;
                Ok(bytes)
            }
        }
    }
}

impl Dkv {
    /// Checks `remote` before any work is done for it: its worker address
    /// must be one of this transport's kind whose tag verifies under the
    /// cluster's key, and its grant token well formed. A failure is
    /// counted like a failed transfer (`reason` `unauthenticated` for a
    /// wrong tag, `bounds` for a malformed descriptor). [`Dkv::write`]
    /// checks the same.
    pub fn check(&self, remote: &RemoteRegion) -> Result<(), DkvError> {
        self.open(remote).map(|_| ()).inspect_err(|e| {
            self.inner.metrics.transfer_failures.add(
                1,
                &[
                    KeyValue::new("connector", self.connector()),
                    KeyValue::new("reason", e.reason()),
                ],
            );
        })
    }

    /// `remote`'s verified worker address payload and its grant token.
    fn open<'a>(&self, remote: &'a RemoteRegion) -> Result<(&'a [u8], Token), DkvError> {
        let magic = match self.inner.backend {
            Backend::Local => descriptor::MAGIC_LOCAL_ADDRESS,
            Backend::Ucx(_) => descriptor::MAGIC_UCX_ADDRESS,
        };
        let address = descriptor::open_keyed(
            &self.inner.key,
            "worker_address",
            magic,
            &remote.worker_address,
        )?;
        Ok((address, Token::open(&remote.grant)?))
    }
}

/// The key of `Dkv`s configured without one: random, made once, known to
/// this process only.
fn process_key() -> Result<DkvKey, DkvError> {
    static KEY: std::sync::OnceLock<DkvKey> = std::sync::OnceLock::new();
    if let Some(k) = KEY.get() {
        return Ok(k.clone());
    }
    let k = DkvKey::generate()?;
    Ok(KEY.get_or_init(|| k).clone())
}

/// Cancels the transfer on the actor if `write`'s future is dropped early.
struct CancelGuard<'a> {
    dkv: &'a Dkv,
    id: u64,
    armed: bool,
    labels: &'a [KeyValue; 1],
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Backend::Ucx(h) = &self.dkv.inner.backend {
            let _ = h.send(ucx::Cmd::Cancel(self.id));
        }
        self.dkv.inner.metrics.transfer_failures.add(
            1,
            &[self.labels[0].clone(), KeyValue::new("reason", "cancelled")],
        );
    }
}

/// Checks every op against both lengths (checked math; the values come from
/// the network) and drops empty ones. Returns the ops and total bytes.
fn plan(local_len: u64, remote_len: u64, ops: &[WriteOp]) -> Result<(Vec<WriteOp>, u64), DkvError> {
    let mut out = Vec::with_capacity(ops.len());
    let mut bytes = 0u64;
    for (i, op) in ops.iter().enumerate() {
        let check = |side: &str, off: u64, region: u64| match off.checked_add(op.len) {
            Some(end) if end <= region => Ok(()),
            _ => Err(DkvError::OutOfBounds(format!(
                "op {i}: {side} range {off}+{} exceeds the {side} region of {region} bytes",
                op.len
            ))),
        };
        check("local", op.local_offset, local_len)?;
        check("remote", op.remote_offset, remote_len)?;
        if op.len > 0 {
            bytes = bytes
                .checked_add(op.len)
                .ok_or_else(|| DkvError::OutOfBounds(format!("op {i}: total length overflows")))?;
            out.push(*op);
        }
    }
    Ok((out, bytes))
}

/// Registered local memory. Dropping it deregisters (on the transport
/// thread for UCX) once no transfer reads from it any more.
pub struct Region {
    shared: Arc<RegionShared>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.shared.id)
            .field("ptr", &self.shared.ptr)
            .field("len", &self.shared.len)
            .finish()
    }
}

impl Region {
    /// Lets the holder of the returned grant's descriptor write `ranges`
    /// (byte offsets into this region) once each, until `expires` or until
    /// the grant is revoked (dropped), whichever comes first.
    pub fn grant(
        &self,
        ranges: &[std::ops::Range<u64>],
        expires: Instant,
    ) -> Result<Grant, DkvError> {
        self.shared
            .grants
            .issue(Arc::clone(&self.shared), ranges, expires)
    }

    pub fn len(&self) -> usize {
        self.shared.len
    }

    pub fn is_empty(&self) -> bool {
        self.shared.len == 0
    }

    /// Start of the memory; valid while the `Region` lives (for
    /// [`Dkv::alloc`] regions, the memory is freed with it).
    pub fn as_ptr(&self) -> *mut u8 {
        self.shared.ptr
    }
}

pub(crate) struct RegionShared {
    pub(crate) id: u64,
    /// The `Dkv` that registered it.
    pub(crate) dkv: u64,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    worker_address: Vec<u8>,
    grants: Arc<GrantTable>,
    release: Release,
}

// SAFETY: the raw pointer is memory the registrant vouched for (see
// `Dkv::register`); concurrent access to it is the transfer protocol's
// business (grants decide what peers may write, and when).
unsafe impl Send for RegionShared {}
// SAFETY: as above; RegionShared has no interior mutability.
unsafe impl Sync for RegionShared {}

/// Where the registration (and the memory's owner) lives.
enum Release {
    /// The process-wide registry.
    Local,
    /// The actor's map.
    Ucx(ucx::Releaser),
}

impl Drop for RegionShared {
    fn drop(&mut self) {
        match &self.release {
            Release::Local => local::remove_region(self.id),
            Release::Ucx(r) => r.release(self.id),
        }
    }
}

#[cfg(test)]
impl Dkv {
    fn ucx(&self) -> &ucx::UcxHandle {
        match &self.inner.backend {
            Backend::Ucx(h) => h,
            Backend::Local => panic!("not a UCX dkv"),
        }
    }

    /// Freezes the actor (a peer that stops progressing).
    fn stall(&self, d: Duration) {
        self.ucx().send(ucx::Cmd::Stall(d)).expect("stall");
    }

    fn inspect(&self) -> ucx::Inspect {
        self.ucx().inspect().expect("inspect")
    }
}

/// Zeroed heap memory for in-process `Dkv::alloc`.
struct HostMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain heap bytes owned through a raw pointer.
unsafe impl Send for HostMem {}
// SAFETY: as above; HostMem itself never touches the bytes.
unsafe impl Sync for HostMem {}

impl HostMem {
    fn zeroed(len: usize) -> Result<Self, DkvError> {
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|e| DkvError::InvalidRegion(format!("allocating {len} bytes: {e}")))?;
        v.resize(len, 0u8);
        let ptr = Box::into_raw(v.into_boxed_slice()).cast::<u8>();
        Ok(Self { ptr, len })
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: undoes the leak in `zeroed`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}
