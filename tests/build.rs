//! The hash of the `tandem` binary's sources these tests were built with
//! (the harness refuses a binary stamped with another).

include!("../cli/source_hash.rs");

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let root = Path::new(&manifest).join("..");
    println!("cargo:rustc-env=TANDEM_SOURCE_HASH={}", source_hash(&root));
}
