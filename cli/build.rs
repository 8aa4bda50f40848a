//! Stamps the binary with the hash of its sources (`tandem --version`).

include!("source_hash.rs");

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let root = Path::new(&manifest).join("..");
    println!("cargo:rustc-env=TANDEM_SOURCE_HASH={}", source_hash(&root));
}
