//! bindgen output for `ucp/api/ucp.h` (see build.rs) plus the header's
//! macros that bindgen cannot translate.
#![allow(
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

include!(concat!(env!("OUT_DIR"), "/ucp_bindings.rs"));

/// `UCS_PTR_IS_ERR`: status pointers are small negative integers.
pub(crate) fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_STATUS`.
pub(crate) fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    p as isize as ucs_status_t
}

pub(crate) fn status_string(s: ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static C string for any value.
    let p = unsafe { ucs_status_string(s) };
    if p.is_null() {
        return format!("status {s}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}
