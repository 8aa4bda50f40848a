//! UCP, loaded at run time: the committed bindings (`bindings.rs`, made by
//! `scripts/gen-ucp-bindings.sh`) are a table of the functions dkv calls,
//! filled from `libucp.so.0` when the first UCX transport starts. Whether a
//! process has UCX is decided then, not at build time: a missing library or
//! symbol, or a UCX older than 1.10, is a [`DkvError::UcxUnavailable`] that
//! names it. A loaded library stays loaded for the process's life (UCX
//! installs hooks and threads that must not be unmapped under it).

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::sync::{Mutex, PoisonError};

pub(crate) use super::bindings::*;
use crate::DkvError;

/// The library's soname: what Debian's `libucx0` (and UCX's own builds)
/// install, found on the loader's usual path (`LD_LIBRARY_PATH` too).
pub(crate) const DEFAULT_LIBRARY: &str = "libucp.so.0";

/// The oldest UCX whose API dkv uses (worker-address endpoints with peer
/// error handling, active messages with rendezvous receives).
const MIN_VERSION: (u32, u32) = (1, 10);

/// The UCP of `path` (default: [`DEFAULT_LIBRARY`]), loaded once per path.
pub(crate) fn load(path: Option<&Path>) -> Result<&'static Ucp, DkvError> {
    let name: &OsStr = path.map_or(OsStr::new(DEFAULT_LIBRARY), Path::as_os_str);
    static LOADED: Mutex<Option<HashMap<OsString, &'static Ucp>>> = Mutex::new(None);
    let mut loaded = LOADED.lock().unwrap_or_else(PoisonError::into_inner);
    let loaded = loaded.get_or_insert_with(HashMap::new);
    if let Some(ucp) = loaded.get(name) {
        return Ok(ucp);
    }
    let shown = name.to_string_lossy();
    let unavailable = |what: String| {
        DkvError::UcxUnavailable(format!(
            "{what} (dkv loads UCX's libucp at run time: install libucx0, or put the \
             directory holding {DEFAULT_LIBRARY} on LD_LIBRARY_PATH)"
        ))
    };
    // RTLD_NOW: every symbol resolves here, not at a first call inside a
    // callback. RTLD_GLOBAL: as if linked, for the transport modules UCX
    // loads itself.
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
    // SAFETY: runs the library's initialisers; libucp is UCX's own
    // library, whose initialisers set up UCX's global state and nothing of
    // ours.
    let lib = unsafe { libloading::os::unix::Library::open(Some(name), flags) }
        .map_err(|e| unavailable(format!("cannot load {shown}: {e}")))?;
    // SAFETY: the table's signatures are ucp.h's, as bindgen read them; the
    // symbols are looked up by those names.
    let ucp = unsafe { Ucp::from_library(lib) }
        .map_err(|e| unavailable(format!("{shown} lacks a UCP function: {e}")))?;
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three out-pointers to locals.
    unsafe { ucp.ucp_get_version(&mut major, &mut minor, &mut release) };
    if (major, minor) < MIN_VERSION {
        return Err(unavailable(format!(
            "{shown} is UCX {major}.{minor}.{release}; dkv needs {}.{} or newer",
            MIN_VERSION.0, MIN_VERSION.1
        )));
    }
    let ucp: &'static Ucp = Box::leak(Box::new(ucp));
    loaded.insert(name.to_owned(), ucp);
    Ok(ucp)
}

impl Ucp {
    pub(crate) fn status_string(&self, s: ucs_status_t) -> String {
        // SAFETY: ucs_status_string returns a static C string for any value.
        let p = unsafe { self.ucs_status_string(s) };
        if p.is_null() {
            return format!("status {s}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

/// `UCS_PTR_IS_ERR`: status pointers are small negative integers.
pub(crate) fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_STATUS`.
pub(crate) fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    p as isize as ucs_status_t
}
