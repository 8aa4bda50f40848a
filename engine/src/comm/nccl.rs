//! NCCL backend: one rank per GPU, the ranks being threads of this
//! process.
//!
//! The [`Communicator`] trait works on host `f32` slices, so each call here
//! copies host -> device, runs the NCCL collective on the rank's stream and
//! copies back: enough for correctness tests and TP bring-up. The GPU
//! forward pass will keep activations on the device and call NCCL on device
//! buffers directly, without these copies.
//!
//! Sizes (and all-to-all counts) are first agreed through a [`CpuComm`]
//! group over the same ranks: NCCL does not check them (a mismatch hangs or
//! corrupts memory), and the CPU group turns a departed peer into
//! [`CommError::PeerGone`]. A rank that fails between that check and the
//! NCCL call (say, a device allocation) can still leave its peers blocked
//! inside NCCL.
//!
//! Libraries are loaded at run time: without a CUDA driver, libnccl or a
//! GPU, [`NcclComm::new_group`] returns [`CommError::NotAvailable`].

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, ReduceOp, group_end, group_start};

use super::cpu::Op;
use super::{CommError, Communicator, CpuComm, CpuGroup};

/// One GPU rank of a group made by [`NcclComm::new_group`].
pub struct NcclComm {
    rank: usize,
    world: usize,
    device: usize,
    /// Held for a whole call, so the size check and the NCCL launch of one
    /// call are not interleaved with another thread's call on this rank.
    inner: Mutex<Rank>,
    host: CpuComm,
}

struct Rank {
    comm: Comm,
    stream: Arc<CudaStream>,
}

// SAFETY: an NCCL communicator may be driven from any thread as long as its
// calls are not concurrent; `NcclComm::inner` serializes them. The stream is
// Send + Sync already.
unsafe impl Send for Rank {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .finish()
    }
}

fn driver_err(e: DriverError) -> CommError {
    CommError::Backend(format!("CUDA driver: {e}"))
}

fn nccl_err(e: NcclError) -> CommError {
    CommError::Backend(format!("NCCL: {:?}", e.0))
}

/// Loads nothing but checks that the libraries can be loaded: cudarc's
/// dynamic loading panics on first use when they cannot.
fn libraries_present() -> Result<(), CommError> {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::NotAvailable(
            "no CUDA driver found (libcuda could not be loaded)".into(),
        ));
    }
    // SAFETY: only tries to dlopen libnccl.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(CommError::NotAvailable(
            "libnccl not found (install NCCL or run with --devices cpu)".into(),
        ));
    }
    Ok(())
}

/// Runs driver/NCCL set-up, turning a panic of the dynamically loaded
/// bindings (e.g. a symbol missing from an old library) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, CommError>) -> Result<T, CommError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(CommError::NotAvailable(format!("{what}: {msg}")))
    })
}

impl NcclComm {
    /// Number of visible GPUs; `NotAvailable` without a driver, libnccl or
    /// any GPU.
    pub fn device_count() -> Result<usize, CommError> {
        libraries_present()?;
        guarded("CUDA driver", || match CudaContext::device_count() {
            Ok(n) if n > 0 => Ok(n as usize),
            Ok(_) => Err(CommError::NotAvailable("no CUDA device".into())),
            Err(e) => Err(CommError::NotAvailable(format!("CUDA driver: {e}"))),
        })
    }

    /// One rank per entry of `devices` (rank i on device `devices[i]`),
    /// initialised together (`ncclCommInitAll`). Move each to its own
    /// thread: every rank must enter each collective.
    pub fn new_group(devices: &[usize]) -> Result<Vec<NcclComm>, CommError> {
        if devices.is_empty() {
            return Err(CommError::InvalidDevices("no GPUs given".into()));
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(CommError::InvalidDevices(format!(
                    "GPU {d} listed twice (NCCL takes one rank per GPU)"
                )));
            }
        }
        let count = Self::device_count()?;
        if let Some(d) = devices.iter().find(|&&d| d >= count) {
            return Err(CommError::InvalidDevices(format!(
                "GPU {d} does not exist ({count} visible)"
            )));
        }
        let comms = guarded("NCCL initialisation", || {
            let mut streams = Vec::with_capacity(devices.len());
            for &d in devices {
                let ctx = CudaContext::new(d).map_err(driver_err)?;
                streams.push(ctx.new_stream().map_err(driver_err)?);
            }
            Comm::from_devices(streams).map_err(nccl_err)
        })?;
        let world = devices.len();
        Ok(comms
            .into_iter()
            .zip(CpuGroup::new(world))
            .zip(devices)
            .enumerate()
            .map(|(rank, ((comm, host), &device))| NcclComm {
                rank,
                world,
                device,
                inner: Mutex::new(Rank {
                    stream: comm.stream(),
                    comm,
                }),
                host,
            })
            .collect())
    }

    /// The GPU this rank runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    fn lock(&self) -> MutexGuard<'_, Rank> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Rank {
    fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>, CommError> {
        self.stream.clone_htod(host).map_err(driver_err)
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>, CommError> {
        self.stream.alloc_zeros::<f32>(len).map_err(driver_err)
    }

    fn download(&self, dev: &CudaSlice<f32>, host: &mut [f32]) -> Result<(), CommError> {
        self.stream.memcpy_dtoh(dev, host).map_err(driver_err)?;
        self.stream.synchronize().map_err(driver_err)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let g = self.lock();
        self.host.check_sizes(Op::AllReduce, buf.len(), 0)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut d = g.upload(buf)?;
        g.comm
            .all_reduce_in_place(&mut d, &ReduceOp::Sum)
            .map_err(nccl_err)?;
        g.download(&d, buf)
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let g = self.lock();
        self.host
            .check_sizes(Op::AllGather, send.len(), recv.len())?;
        if send.is_empty() {
            return Ok(());
        }
        let d_send = g.upload(send)?;
        let mut d_recv = g.zeros(recv.len())?;
        g.comm.all_gather(&d_send, &mut d_recv).map_err(nccl_err)?;
        g.download(&d_recv, recv)
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let g = self.lock();
        self.host
            .check_sizes(Op::ReduceScatter, send.len(), recv.len())?;
        if recv.is_empty() {
            return Ok(());
        }
        let d_send = g.upload(send)?;
        let mut d_recv = g.zeros(recv.len())?;
        g.comm
            .reduce_scatter(&d_send, &mut d_recv, &ReduceOp::Sum)
            .map_err(nccl_err)?;
        g.download(&d_recv, recv)
    }

    /// Counts go through the CPU group; the data through grouped NCCL
    /// send/recv pairs (this rank's own piece is copied on the host).
    fn all_to_all(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut Vec<f32>,
        recv_counts: &mut Vec<usize>,
    ) -> Result<(), CommError> {
        let g = self.lock();
        self.host
            .all_to_all_inner(send, send_counts, None, recv_counts)?;
        let (world, r) = (self.world, self.rank);
        let offsets = |counts: &[usize]| {
            let mut acc = 0;
            counts
                .iter()
                .map(|&c| {
                    acc += c;
                    acc - c
                })
                .collect::<Vec<usize>>()
        };
        let (send_off, recv_off) = (offsets(send_counts), offsets(recv_counts));
        recv.clear();
        recv.resize(recv_counts.iter().sum(), 0.0);
        recv[recv_off[r]..recv_off[r] + recv_counts[r]]
            .copy_from_slice(&send[send_off[r]..send_off[r] + send_counts[r]]);

        let d_send = if send.is_empty() {
            None
        } else {
            Some(g.upload(send)?)
        };
        let mut d_recv = Vec::with_capacity(world);
        for (q, &c) in recv_counts.iter().enumerate() {
            d_recv.push(if q != r && c > 0 {
                Some(g.zeros(c)?)
            } else {
                None
            });
        }
        // group_end must follow group_start even when an enqueue failed.
        let mut result = group_start().map(|_| ()).map_err(nccl_err);
        if result.is_ok() {
            for (q, &c) in send_counts.iter().enumerate() {
                if let (Some(d), true) = (&d_send, q != r && c > 0) {
                    let view = d.slice(send_off[q]..send_off[q] + c);
                    result = result.and(g.comm.send(&view, q as i32).map_err(nccl_err));
                }
            }
            for (q, d) in d_recv.iter_mut().enumerate() {
                if let Some(d) = d {
                    let status = g.comm.recv(d, q as i32).map(|_| ()).map_err(nccl_err);
                    result = result.and(status);
                }
            }
            result = result.and(group_end().map(|_| ()).map_err(nccl_err));
        }
        result?;
        for (q, d) in d_recv.iter().enumerate() {
            if let Some(d) = d {
                let dst = &mut recv[recv_off[q]..recv_off[q] + recv_counts[q]];
                g.stream.memcpy_dtoh(d, dst).map_err(driver_err)?;
            }
        }
        g.stream.synchronize().map_err(driver_err)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let _g = self.lock();
        // Every call above is synchronous, so a host barrier suffices.
        self.host.barrier()
    }
}
