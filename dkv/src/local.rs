//! In-process transport: memcpy between regions registered by `Dkv`
//! instances of this process, found through a process-wide registry. Node
//! tests use it to run prefill and decode logic without UCX.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::grant::{GrantTable, Token};
use crate::{DkvError, Owner, RegionShared, WriteOp};

#[derive(Default)]
struct Registry {
    /// Live in-process `Dkv` instances and the grants of each (what a
    /// receiver checks incoming writes against).
    instances: HashMap<u64, Arc<GrantTable>>,
    regions: HashMap<u64, Entry>,
}

/// A registration: the registry holds the owner, so shutting an instance
/// down releases its memory as the UCX transport does.
struct Entry {
    dkv: u64,
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

pub(crate) fn add_instance(id: u64, grants: Arc<GrantTable>) {
    registry().instances.insert(id, grants);
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

/// Copies `ops` (already validated against `local.len` and the remote length)
/// into the region `token` names, each op only if the receiver's grant
/// table accepts it (as the UCX receiver does on arrival).
pub(crate) fn write(
    local: &RegionShared,
    instance: u64,
    token: &Token,
    ops: &[WriteOp],
    deadline: Instant,
) -> Result<(), DkvError> {
    // Take the source's owner and the receiver's grants under the lock,
    // copy (and maybe drop them) outside it: the last drop of a region
    // takes the lock.
    let (grants, _src_owner) = {
        let r = registry();
        let grants = r.instances.get(&instance).cloned().ok_or_else(|| {
            DkvError::PeerUnreachable(format!("in-process dkv {instance} is gone"))
        })?;
        let src_owner = r
            .regions
            .get(&local.id)
            .map(|e| e.owner.clone())
            .ok_or(DkvError::Shutdown)?;
        (grants, src_owner)
    };
    for op in ops {
        if Instant::now() >= deadline {
            return Err(DkvError::DeadlineExceeded);
        }
        let landing = grants
            .accept(token, op.remote_offset, op.len)
            .map_err(DkvError::Refused)?;
        // SAFETY: the source range was validated against the local region,
        // which `local` keeps alive; the grant table accepted the target
        // range (inside its region, which the grant keeps alive until the
        // landing is done). `copy` tolerates overlap (a region writing into
        // itself).
        unsafe {
            std::ptr::copy(
                local.ptr.add(op.local_offset as usize),
                landing.dst as *mut u8,
                landing.len(),
            );
        }
        landing.done();
    }
    Ok(())
}
