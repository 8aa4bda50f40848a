// Shared by cli/build.rs and tests/build.rs (included, not a module): a
// hash of every source the `tandem` binary is built from, so that the
// end-to-end tests can refuse a binary built from other sources than
// theirs (`cargo test` does not rebuild a binary of another package).

use std::path::{Path, PathBuf};

/// Workspace members the binary is not built from: the tests' own crates
/// and the fuzz targets' bodies.
const NOT_IN_BINARY: [&str; 3] = ["tests", "testkit", "fuzz-harness"];

/// The crates the binary is built from, relative to the workspace root:
/// the workspace's members (read from its manifest, so a new crate is
/// never missed) but the tests' own.
fn crates(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap_or_default();
    let members = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .unwrap_or_else(|| panic!("no `members = [...]` in {}", root.join("Cargo.toml").display()));
    members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty() && !NOT_IN_BINARY.contains(m))
        .map(String::from)
        .collect()
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// FNV-1a over (path, contents) of every source file, in path order; also
/// tells cargo to rerun the build script when any of them changes.
fn source_hash(root: &Path) -> String {
    let mut files = Vec::new();
    for f in ["Cargo.toml", "Cargo.lock"] {
        files.push(root.join(f));
    }
    for c in crates(root) {
        let dir = root.join(c);
        for f in ["Cargo.toml", "build.rs", "source_hash.rs"] {
            if dir.join(f).is_file() {
                files.push(dir.join(f));
            }
        }
        for sub in ["src", "proto"] {
            let d = dir.join(sub);
            if d.is_dir() {
                println!("cargo:rerun-if-changed={}", d.display());
                collect(&d, &mut files);
            }
        }
    }
    files.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        let rel = f.strip_prefix(root).unwrap_or(f);
        eat(rel.to_string_lossy().as_bytes());
        eat(&[0]);
        eat(&std::fs::read(f).unwrap_or_default());
        eat(&[0]);
    }
    format!("{h:016x}")
}
