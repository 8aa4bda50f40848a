//! In-process transport: memcpy between regions registered by `Dkv`
//! instances of this process, found through a process-wide registry. Node
//! tests use it to run prefill and decode logic without UCX.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;

use crate::descriptor::{self, MAGIC_LOCAL_ADDRESS, MAGIC_LOCAL_RKEY};
use crate::{DkvError, Owner, RegionShared, RemoteRegion, WriteOp};

#[derive(Default)]
struct Registry {
    /// Live in-process `Dkv` instances.
    instances: HashSet<u64>,
    regions: HashMap<u64, Entry>,
}

/// A registration: the registry holds the owner, so shutting an instance
/// down releases its memory as the UCX transport does.
struct Entry {
    dkv: u64,
    region: Weak<RegionShared>,
    owner: Owner,
    live: Arc<AtomicUsize>,
}

fn registry() -> MutexGuard<'static, Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    // A panic while holding the lock cannot leave the maps inconsistent.
    R.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn address(instance: u64) -> Vec<u8> {
    descriptor::seal(MAGIC_LOCAL_ADDRESS, &instance.to_le_bytes())
}

pub(crate) fn rkey(region: u64) -> Vec<u8> {
    descriptor::seal(MAGIC_LOCAL_RKEY, &region.to_le_bytes())
}

pub(crate) fn add_instance(id: u64) {
    registry().instances.insert(id);
}

/// Forgets the instance and undoes its registrations.
pub(crate) fn remove_instance(id: u64) {
    let gone: Vec<Entry> = {
        let mut r = registry();
        r.instances.remove(&id);
        let ids: Vec<u64> = r
            .regions
            .iter()
            .filter(|(_, e)| e.dkv == id)
            .map(|(k, _)| *k)
            .collect();
        ids.iter().filter_map(|k| r.regions.remove(k)).collect()
    };
    // Owners drop outside the lock (their drop may do anything).
    for e in gone {
        e.live.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(crate) fn add_region(region: &Arc<RegionShared>, owner: Owner, live: Arc<AtomicUsize>) {
    live.fetch_add(1, Ordering::Relaxed);
    registry().regions.insert(
        region.id,
        Entry {
            dkv: region.dkv,
            region: Arc::downgrade(region),
            owner,
            live,
        },
    );
}

pub(crate) fn remove_region(id: u64) {
    let gone = registry().regions.remove(&id);
    if let Some(e) = gone {
        e.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Copies `ops` (already validated against `local.len` and `remote.len`)
/// into the registered region `remote` names.
pub(crate) fn write(
    local: &RegionShared,
    remote: &RemoteRegion,
    ops: &[WriteOp],
    deadline: Instant,
) -> Result<(), DkvError> {
    let instance = descriptor::read_u64(
        "worker_address",
        descriptor::open(
            "worker_address",
            MAGIC_LOCAL_ADDRESS,
            &remote.worker_address,
        )?,
        0,
    )?;
    let region = descriptor::read_u64(
        "rkey",
        descriptor::open("rkey", MAGIC_LOCAL_RKEY, &remote.rkey)?,
        0,
    )?;
    // Take both regions and their owners under the lock, copy (and maybe
    // drop them) outside it: the last drop of a region takes the lock.
    let (target, _owners) = {
        let r = registry();
        if !r.instances.contains(&instance) {
            return Err(DkvError::PeerUnreachable(format!(
                "in-process dkv {instance} is gone"
            )));
        }
        let src_owner = r
            .regions
            .get(&local.id)
            .map(|e| e.owner.clone())
            .ok_or(DkvError::Shutdown)?;
        let target = r
            .regions
            .get(&region)
            .and_then(|e| Some((e.region.upgrade()?, e.owner.clone())));
        let (target, dst_owner) = target.ok_or_else(|| {
            DkvError::InvalidDescriptor(format!("region {region} is not registered"))
        })?;
        (target, (src_owner, dst_owner))
    };
    if target.dkv != instance || target.ptr as u64 != remote.base || target.len as u64 != remote.len
    {
        return Err(DkvError::InvalidDescriptor(format!(
            "region {region}: descriptor (dkv {instance}, base {:#x}, len {}) does not match the registration",
            remote.base, remote.len
        )));
    }
    for op in ops {
        if Instant::now() >= deadline {
            return Err(DkvError::DeadlineExceeded);
        }
        // SAFETY: both ranges were validated against their region lengths;
        // both regions are registered and alive (`local` borrowed, `target`
        // held). `copy` tolerates overlap (a region writing into itself).
        unsafe {
            std::ptr::copy(
                local.ptr.add(op.local_offset as usize),
                target.ptr.add(op.remote_offset as usize),
                op.len as usize,
            );
        }
    }
    Ok(())
}
