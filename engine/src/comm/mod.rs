//! Collective communication for tensor and expert parallelism.
//!
//! A [`Communicator`] is one rank's handle on a group of `world_size()`
//! ranks. Backends: [`CpuGroup`] (ranks are threads of one process, over
//! shared memory) and `NcclComm` (one GPU per rank; CUDA and NCCL loaded
//! at run time). [`parse_devices`] reads the `--devices` flag and [`new_group`]
//! builds the matching group.
//!
//! # Contract
//! - Every rank calls the same collectives in the same order with
//!   consistent sizes. Backends check this where they can (the CPU backend
//!   always) and then every rank of the call returns the same
//!   [`CommError::SizeMismatch`] / [`CommError::OpMismatch`], so a mistake
//!   surfaces as an error on all ranks rather than a hang or corrupt data.
//! - A rank whose handle is dropped (including by a panic unwinding its
//!   thread) poisons the group: peers blocked in, or later entering, a
//!   collective get [`CommError::PeerGone`]. There are no timeouts, so a
//!   rank that stays alive but never calls the collective still blocks its
//!   peers (as with NCCL or MPI).
//! - Calls on one handle are serialized; a handle is `Send + Sync` so it can
//!   sit in an `Arc` shared by a model's threads.
//!
//! # Determinism
//! [`Communicator::all_reduce_sum`] and
//! [`Communicator::reduce_scatter_sum`] give bitwise identical results on
//! every rank, and the CPU backend adds in rank order,
//! `((x0 + x1) + x2) + ...` element by element, however the work is split,
//! so results never depend on timing or on the world size's chunking. (NCCL
//! sums in the order of its own ring/tree algorithm: identical on all ranks
//! and from run to run on one topology, but not rank order.)

mod cpu;
mod devices;
mod nccl;

pub use cpu::{CpuComm, CpuGroup};
pub use devices::{DeviceSpec, GpuSelection, parse_devices};
pub use nccl::NcclComm;

/// Why a collective (or building a group) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// Sizes disagree across ranks or with the collective's shape.
    #[error("{op}: rank {rank} passed {what} of {actual} elements, expected {expected}")]
    SizeMismatch {
        op: &'static str,
        rank: usize,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// Ranks entered different collectives (their call orders diverged).
    #[error("collective order diverged: rank 0 called {expected}, rank {rank} called {actual}")]
    OpMismatch {
        rank: usize,
        expected: &'static str,
        actual: &'static str,
    },
    /// A peer's handle was dropped (its thread returned or panicked): the
    /// group is unusable.
    #[error("a peer rank left the communicator group (dropped or panicked)")]
    PeerGone,
    /// The backend cannot run here (no GPU, no CUDA driver, no libnccl, or
    /// built without the feature).
    #[error("communicator backend not available: {0}")]
    NotAvailable(String),
    /// A malformed `--devices` value or group request.
    #[error("invalid devices: {0}")]
    InvalidDevices(String),
    /// The backend library reported an error (CUDA driver, NCCL).
    #[error("communicator backend error: {0}")]
    Backend(String),
}

/// One rank's handle on a communicator group. Object safe: models hold an
/// `Arc<dyn Communicator>`. See the module docs for the contract.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This handle's rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// In place: `buf` becomes the element-wise sum of every rank's `buf`
    /// (same length on all ranks).
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError>;

    /// `recv` (`world_size() * send.len()` elements) becomes every rank's
    /// `send`, rank-major: rank `q`'s at `q * send.len()`.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// `send` holds `world_size()` blocks of `recv.len()` elements; `recv`
    /// becomes the sum over ranks of block `rank()`.
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// Variable-size exchange (MoE token dispatch): `send` is split into
    /// `world_size()` consecutive pieces of `send_counts[q]` elements, piece
    /// `q` going to rank `q`. On return `recv_counts[q]` is how many elements
    /// came from rank `q` and `recv` holds them rank-major. Counts are
    /// exchanged inside; both vectors are overwritten.
    fn all_to_all(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut Vec<f32>,
        recv_counts: &mut Vec<usize>,
    ) -> Result<(), CommError>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;
}

/// Builds the ranks of a group for a parsed `--devices` value: `cpu:N`
/// gives `N` thread ranks, `gpu:...` gives NCCL ranks (or `NotAvailable`
/// without a CUDA driver, libnccl or GPU).
pub fn new_group(spec: &DeviceSpec) -> Result<Vec<Box<dyn Communicator>>, CommError> {
    match spec {
        DeviceSpec::Cpu { ranks } => Ok(CpuGroup::new(*ranks)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect()),
        DeviceSpec::Gpu(sel) => {
            let devices = match sel {
                GpuSelection::All => (0..NcclComm::device_count()?).collect(),
                GpuSelection::Ids(ids) => ids.clone(),
            };
            Ok(NcclComm::new_group(&devices)?
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn Communicator>)
                .collect())
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn new_group_builds_cpu_ranks() {
        let comms = new_group(&parse_devices("cpu:3").unwrap()).unwrap();
        let ranks: Vec<_> = comms.iter().map(|c| (c.rank(), c.world_size())).collect();
        assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]);
    }

    /// Without a GPU a GPU group is a clean `NotAvailable`; on a GPU
    /// machine it builds.
    #[test]
    fn gpu_group_is_not_available_here_rather_than_a_panic() {
        match new_group(&parse_devices("gpu:all").unwrap()) {
            Err(CommError::NotAvailable(msg)) => assert!(!msg.is_empty()),
            Ok(comms) => assert!(!comms.is_empty()),
            Err(e) => panic!("expected NotAvailable, got {e}"),
        }
    }
}
