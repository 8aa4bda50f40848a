//! Finds UCX with pkg-config and generates bindings for `ucp/api/ucp.h`.
//! Without UCX (or with `TANDEM_DKV_NO_UCX=1`) the crate still builds: only
//! the in-process transport is available and `Dkv::new(Ucx)` says why.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(dkv_ucx)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=TANDEM_DKV_NO_UCX");
    println!("cargo::rerun-if-env-changed=PKG_CONFIG_PATH");

    if env::var("TANDEM_DKV_NO_UCX").is_ok_and(|v| v == "1") {
        println!("cargo::warning=TANDEM_DKV_NO_UCX=1: building tandem-dkv without UCX");
        return;
    }
    // Probe without emitting link lines: bindgen may still fail below, and a
    // crate that does not use UCX must not link it.
    let lib = match pkg_config::Config::new()
        .atleast_version("1.10")
        .cargo_metadata(false)
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(e) => {
            println!(
                "cargo::warning=UCX not found by pkg-config ({e}); dkv has only the in-process transport"
            );
            return;
        }
    };
    let out = match PathBuf::from(env::var("OUT_DIR").unwrap_or_default()) {
        p if p.as_os_str().is_empty() => return,
        p => p.join("ucp_bindings.rs"),
    };
    let mut builder = bindgen::Builder::default()
        .header_contents("dkv_ucp.h", "#include <ucp/api/ucp.h>\n")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*|ucs_.*")
        .allowlist_var("UCP_.*|UCS_.*")
        .prepend_enum_name(false)
        .layout_tests(false)
        .derive_debug(false)
        .generate_comments(false)
        .rust_edition(bindgen::RustEdition::Edition2024);
    for p in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", p.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => {
            println!(
                "cargo::warning=bindgen on ucp/api/ucp.h failed ({e}); dkv has only the in-process transport"
            );
            return;
        }
    };
    if let Err(e) = bindings.write_to_file(&out) {
        println!(
            "cargo::warning=writing {}: {e}; dkv has only the in-process transport",
            out.display()
        );
        return;
    }
    for p in &lib.link_paths {
        println!("cargo::rustc-link-search=native={}", p.display());
    }
    for l in ["ucp", "uct", "ucs"] {
        println!("cargo::rustc-link-lib={l}");
    }
    println!("cargo::rustc-cfg=dkv_ucx");
}
