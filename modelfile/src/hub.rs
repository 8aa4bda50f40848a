//! Hugging Face hub repos named as `--model ORG/NAME[@REVISION][:QUANT]`:
//! the pure parts. Parsing and validating repo ids (before any request),
//! the hub's URLs, the repo listing the hub API returns, which files make
//! the model, what a downloaded file is expected to be, and the cache.
//! The binary does the HTTP.
//!
//! The cache mirrors `huggingface_hub`'s layout, without its blob store:
//!
//! ```text
//! <cache>/hub/models--ORG--NAME/
//!   refs/<revision>                     the commit sha the revision resolved to
//!   snapshots/<sha>/<file>              verified files
//!   incomplete/<sha>/<file>.part        downloads in progress (resumable)
//!   manifests/<sha>/<quant|default>.json  the files a selection needs, written last
//!   .lock                               held by the process fetching
//! ```
//!
//! A revision whose ref and manifest are there and whose files are all in
//! the snapshot resolves without the network. A branch therefore stays on
//! the commit it first resolved to; name a commit (`@<sha>`) or remove the
//! ref to move.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ModelError;
use crate::fetch::sha256_file;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
pub const DEFAULT_REVISION: &str = "main";

/// Longest org or repo name the hub accepts.
const MAX_NAME: usize = 96;

/// What is wrong with the hub's answers, or with the cache, for one repo.
/// The binary adds the repo (see [`RepoId::error`]).
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("HF_ENDPOINT {0:?} is not an http(s) URL like {DEFAULT_ENDPOINT}")]
    BadEndpoint(String),
    #[error("unreadable repo listing: {0}")]
    UnreadableListing(#[source] serde_json::Error),
    #[error("the repo listing has no commit sha (is this a model repo?)")]
    NoCommit,
    #[error("the repo listing's commit {0:?} is not a 40-digit hex sha")]
    BadCommit(String),
    #[error("{file}: bad lfs sha256 {sha256:?}")]
    BadLfsSha256 { file: String, sha256: String },
    #[error("the hub listed an unsafe file name {0:?}")]
    UnsafeFileName(String),
    #[error(
        "{0} is one part of a split GGUF, which is not supported; pick a single-file quantization"
    )]
    SplitGguf(String),
    #[error("no .gguf file to match :{0}")]
    NoGgufForQuant(String),
    #[error("no .gguf file matches :{quant}; the repo has {}", .ggufs.join(", "))]
    NoQuantMatch { quant: String, ggufs: Vec<String> },
    #[error("several .gguf files match :{quant}: {}", .matching.join(", "))]
    SeveralQuantMatches {
        quant: String,
        matching: Vec<String>,
    },
    #[error(
        "several .gguf files: {}; pick one with ORG/NAME:QUANT (like :Q4_K_M)",
        .0.join(", ")
    )]
    SeveralGgufs(Vec<String>),
    #[error(
        "no .gguf file and no safetensors model (config.json, tokenizer.json, *.safetensors) in the repo"
    )]
    NoModel,
    #[error("the hub gives two sizes, {0} and {1} bytes")]
    SizesDisagree(u64, u64),
    #[error("the hub gives two sha256 sums, {0} and {1}")]
    Sha256sDisagree(String, String),
    #[error("size mismatch: expected {expected} bytes, got {got}")]
    SizeMismatch { expected: u64, got: u64 },
    #[error("checksum mismatch: expected {expected}, got {got}")]
    ChecksumMismatch { expected: String, got: String },
    /// A downloaded file failed its check (and was deleted).
    #[error("{file}: {source}")]
    BadDownload {
        file: String,
        #[source]
        source: Box<HubError>,
    },
    /// A file system operation on the cache failed.
    #[error("{doing} {}: {source}", .path.display())]
    Io {
        doing: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("moving {file} into the cache: {source}")]
    Install {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Manifest(#[source] serde_json::Error),
}

impl HubError {
    fn io(doing: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> HubError {
        let path = path.to_path_buf();
        move |source| HubError::Io {
            doing,
            path,
            source,
        }
    }
}

/// Whether a `--model` string that is neither an alias nor an existing path
/// is meant as a repo id (and so is parsed, and refused if malformed,
/// rather than reported as a missing file).
pub fn looks_like_repo_id(s: &str) -> bool {
    s.contains('/') && !s.starts_with('/')
}

/// A parsed, validated `ORG/NAME[@REVISION][:QUANT]`. Every part is safe
/// in a URL path and as a path component in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoId {
    org: String,
    name: String,
    revision: Option<String>,
    quant: Option<String>,
}

impl RepoId {
    /// Parses and validates `s`; touches nothing.
    pub fn parse(s: &str) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::InvalidRepoId {
            id: s.to_string(),
            reason,
        };
        // Git ref names cannot contain ':', so the last one starts a quant.
        let (rest, quant) = match s.rsplit_once(':') {
            Some((rest, q)) => {
                check_quant(q).map_err(bad)?;
                (rest, Some(q.to_string()))
            }
            None => (s, None),
        };
        let (repo, revision) = match rest.split_once('@') {
            Some((repo, rev)) => {
                check_revision(rev).map_err(bad)?;
                (repo, Some(rev.to_string()))
            }
            None => (rest, None),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        let [org, name] = parts[..] else {
            return Err(bad(format!(
                "{} '/'-separated parts, expected ORG/NAME",
                parts.len()
            )));
        };
        check_name(org, "organisation").map_err(bad)?;
        check_name(name, "name").map_err(bad)?;
        Ok(Self {
            org: org.to_string(),
            name: name.to_string(),
            revision,
            quant,
        })
    }

    /// `ORG/NAME`.
    pub fn repo(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }

    /// The revision asked for (`main` if none was).
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or(DEFAULT_REVISION)
    }

    /// The `:QUANT` asked for, if any.
    pub fn quant(&self) -> Option<&str> {
        self.quant.as_deref()
    }

    /// Whether the revision is a full commit sha (it needs no ref).
    pub fn is_commit(&self) -> bool {
        is_commit_sha(self.revision())
    }

    /// A [`ModelError::Hub`] about this repo: `problem` (a [`HubError`],
    /// or the binary's transfer failure) rendered after the repo's name.
    pub fn error(&self, problem: impl std::fmt::Display) -> ModelError {
        ModelError::Hub {
            repo: format!("{}@{}", self.repo(), self.revision()),
            problem: problem.to_string(),
        }
    }
}

/// The hub's rules for org and repo names: letters, digits, `-`, `_`, `.`;
/// no leading or trailing `-` or `.`; no `--` or `..` (the cache joins
/// org and name with `--`, so this also keeps cache keys unique).
fn check_name(s: &str, what: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err(format!("empty {what}"));
    }
    if s.len() > MAX_NAME {
        return Err(format!("{what} longer than {MAX_NAME} characters"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!("character {c:?} is not allowed in the {what}"));
    }
    if s.starts_with(['-', '.']) || s.ends_with(['-', '.']) {
        return Err(format!("the {what} {s:?} starts or ends with '-' or '.'"));
    }
    if s.contains("--") || s.contains("..") {
        return Err(format!("the {what} {s:?} contains '--' or '..'"));
    }
    Ok(())
}

/// A branch, tag (`/`-separated segments allowed, as in `refs/pr/1`) or
/// commit sha; each segment is a safe path component.
fn check_revision(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("empty revision after '@'".into());
    }
    if s.len() > 200 {
        return Err("revision longer than 200 characters".into());
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/')))
    {
        return Err(format!("character {c:?} is not allowed in a revision"));
    }
    for seg in s.split('/') {
        if seg.is_empty() || seg.starts_with('.') || seg.ends_with(".lock") {
            return Err(format!(
                "revision {s:?} has an empty, hidden or .lock segment"
            ));
        }
    }
    Ok(())
}

fn check_quant(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 32 || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!(
            "quantization {s:?} after ':' must be 1 to 32 letters, digits or '_' (like Q4_K_M)"
        ));
    }
    Ok(())
}

/// A full git commit sha, lower-case hex.
pub fn is_commit_sha(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `HF_ENDPOINT`'s value (or the default), checked and without a trailing
/// slash.
pub fn endpoint(value: Option<&str>) -> Result<String, HubError> {
    let e = value
        .filter(|v| !v.is_empty())
        .unwrap_or(DEFAULT_ENDPOINT)
        .trim_end_matches('/');
    if !(e.starts_with("https://") || e.starts_with("http://")) || e.contains(['?', '#', ' ']) {
        return Err(HubError::BadEndpoint(e.to_string()));
    }
    Ok(e.to_string())
}

/// The API route listing the repo's files at the revision.
pub fn api_url(endpoint: &str, id: &RepoId) -> String {
    // A revision like refs/pr/1 is one path segment to the API.
    format!(
        "{endpoint}/api/models/{}/{}/revision/{}",
        id.org,
        id.name,
        id.revision().replace('/', "%2F")
    )
}

/// Where a file of the repo at commit `sha` is downloaded from (the hub
/// may redirect it to a CDN).
pub fn file_url(endpoint: &str, id: &RepoId, sha: &str, file: &str) -> String {
    let path: Vec<String> = file.split('/').map(encode_segment).collect();
    format!(
        "{endpoint}/{}/{}/resolve/{sha}/{}",
        id.org,
        id.name,
        path.join("/")
    )
}

/// Percent-encodes all but RFC 3986's unreserved characters.
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `scheme://host[:port]` of a URL.
pub fn origin(url: &str) -> &str {
    let start = url.find("://").map_or(0, |i| i + 3);
    match url[start..].find(['/', '?', '#']) {
        Some(i) => &url[..start + i],
        None => url,
    }
}

/// The URL a redirect's `Location` points to, relative to `base`.
pub fn join_location(base: &str, location: &str) -> String {
    if location.starts_with("https://") || location.starts_with("http://") {
        location.to_string()
    } else if let Some(rest) = location.strip_prefix("//") {
        let scheme = base.split("://").next().unwrap_or("https");
        format!("{scheme}://{rest}")
    } else if location.starts_with('/') {
        format!("{}{location}", origin(base))
    } else {
        let path = base.split(['?', '#']).next().unwrap_or(base);
        let dir = path.rfind('/').map_or(path, |i| &path[..=i]);
        format!("{dir}{location}")
    }
}

/// A file the repo listing names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFile {
    /// Path inside the repo, validated by [`check_file_name`].
    pub name: String,
    pub size: Option<u64>,
    /// The LFS object's SHA-256, where the listing gives it.
    pub sha256: Option<String>,
}

/// The repo at a revision, as the hub API lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoInfo {
    /// The commit the revision resolved to.
    pub sha: String,
    pub files: Vec<RepoFile>,
}

#[derive(Deserialize)]
struct ApiInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<ApiSibling>,
}

#[derive(Deserialize)]
struct ApiSibling {
    rfilename: String,
    size: Option<u64>,
    lfs: Option<ApiLfs>,
}

#[derive(Deserialize)]
struct ApiLfs {
    sha256: Option<String>,
    size: Option<u64>,
}

/// Parses `GET /api/models/{repo}/revision/{rev}`'s JSON. Every file name
/// is checked: a server must not be able to write outside the cache.
pub fn parse_repo_info(json: &str) -> Result<RepoInfo, HubError> {
    let api: ApiInfo = serde_json::from_str(json).map_err(HubError::UnreadableListing)?;
    let sha = api.sha.ok_or(HubError::NoCommit)?;
    if !is_commit_sha(&sha) {
        return Err(HubError::BadCommit(sha));
    }
    let mut files = Vec::with_capacity(api.siblings.len());
    for s in api.siblings {
        check_file_name(&s.rfilename)?;
        let (lfs_sha, lfs_size) = s.lfs.map_or((None, None), |l| (l.sha256, l.size));
        let sha256 = match lfs_sha {
            Some(h) if is_sha256(&h) => Some(h.to_ascii_lowercase()),
            Some(h) => {
                return Err(HubError::BadLfsSha256 {
                    file: s.rfilename,
                    sha256: h,
                });
            }
            None => None,
        };
        files.push(RepoFile {
            name: s.rfilename,
            size: lfs_size.or(s.size),
            sha256,
        });
    }
    Ok(RepoInfo { sha, files })
}

/// A repo file name is a relative path of plain segments.
pub fn check_file_name(name: &str) -> Result<(), HubError> {
    let ok = !name.is_empty()
        && name.len() <= 1024
        && !name.starts_with('/')
        && !name.contains(['\\', '\0'])
        && !name.chars().any(char::is_control)
        && name
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..");
    if ok {
        Ok(())
    } else {
        Err(HubError::UnsafeFileName(name.to_string()))
    }
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The files that make the model, and the path (relative to the snapshot)
/// to load: a `.gguf` file, or `""` for the snapshot as an HF directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub files: Vec<RepoFile>,
    pub model: String,
}

/// An HF directory's files besides the weights; the first two are needed.
const HF_DIR_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
];

/// Picks the model among the repo's files: the `.gguf` matching `quant`;
/// else the only `.gguf`; else a safetensors directory (top level only:
/// subfolders hold other formats or originals); else an error that lists
/// the choices.
pub fn select(info: &RepoInfo, quant: Option<&str>) -> Result<Selection, HubError> {
    let ggufs: Vec<&RepoFile> = info
        .files
        .iter()
        .filter(|f| {
            let base = base_name(&f.name).to_ascii_lowercase();
            // Vision projectors ship next to the language model.
            base.ends_with(".gguf") && !base.starts_with("mmproj")
        })
        .collect();
    let names = |fs: &[&RepoFile]| fs.iter().map(|f| f.name.clone()).collect::<Vec<_>>();
    let gguf = |f: &RepoFile| {
        if is_split_gguf(&f.name) {
            return Err(HubError::SplitGguf(f.name.clone()));
        }
        Ok(Selection {
            files: vec![f.clone()],
            model: f.name.clone(),
        })
    };
    if let Some(q) = quant {
        let matching: Vec<&RepoFile> = ggufs
            .iter()
            .copied()
            .filter(|f| has_quant(base_name(&f.name), q))
            .collect();
        return match matching[..] {
            [f] => gguf(f),
            [] if ggufs.is_empty() => Err(HubError::NoGgufForQuant(q.to_string())),
            [] => Err(HubError::NoQuantMatch {
                quant: q.to_string(),
                ggufs: names(&ggufs),
            }),
            _ => Err(HubError::SeveralQuantMatches {
                quant: q.to_string(),
                matching: names(&matching),
            }),
        };
    }
    if let [f] = ggufs[..] {
        return gguf(f);
    }
    let top = |n: &str| info.files.iter().find(|f| f.name == n);
    let weights: Vec<&RepoFile> = info
        .files
        .iter()
        .filter(|f| !f.name.contains('/') && f.name.ends_with(".safetensors"))
        .collect();
    if top("config.json").is_some() && top("tokenizer.json").is_some() && !weights.is_empty() {
        let mut files: Vec<RepoFile> = HF_DIR_FILES
            .iter()
            .filter_map(|n| top(n))
            .cloned()
            .collect();
        files.extend(weights.into_iter().cloned());
        return Ok(Selection {
            files,
            model: String::new(),
        });
    }
    if ggufs.len() > 1 {
        return Err(HubError::SeveralGgufs(names(&ggufs)));
    }
    Err(HubError::NoModel)
}

fn base_name(name: &str) -> &str {
    name.rsplit('/').next().unwrap_or(name)
}

/// `model-00001-of-00003.gguf`.
fn is_split_gguf(name: &str) -> bool {
    let stem = base_name(name).to_ascii_lowercase();
    let stem = stem.trim_end_matches(".gguf");
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    stem.len() > 15 && {
        let tail = &stem[stem.len() - 15..];
        tail.as_bytes()[0] == b'-'
            && digits(&tail[1..6])
            && &tail[6..10] == "-of-"
            && digits(&tail[10..])
    }
}

/// Whether `q` appears in `name` as a whole token, case-insensitively:
/// `Q4_K` matches `x.Q4_K.gguf` but not `x.Q4_K_M.gguf`.
fn has_quant(name: &str, q: &str) -> bool {
    let name = name.to_ascii_lowercase();
    let q = q.to_ascii_lowercase();
    let b = name.as_bytes();
    name.match_indices(&q).any(|(i, _)| {
        let before = i == 0 || !b[i - 1].is_ascii_alphanumeric();
        let j = i + q.len();
        let after = j == b.len() || !(b[j].is_ascii_alphanumeric() || b[j] == b'_');
        before && after
    })
}

/// What a downloaded file must be.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub size: Option<u64>,
    pub sha256: Option<String>,
}

impl Expected {
    /// What the repo listing says.
    pub fn of(file: &RepoFile) -> Self {
        Self {
            size: file.size,
            sha256: file.sha256.clone(),
        }
    }

    /// Adds what a response said (`x-linked-size`, `x-linked-etag`, or the
    /// body's length); two sources that disagree are an error.
    pub fn merge(self, other: Expected) -> Result<Expected, HubError> {
        let size = match (self.size, other.size) {
            (Some(a), Some(b)) if a != b => {
                return Err(HubError::SizesDisagree(a, b));
            }
            (a, b) => a.or(b),
        };
        let sha256 = match (self.sha256, other.sha256) {
            (Some(a), Some(b)) if a != b => {
                return Err(HubError::Sha256sDisagree(a, b));
            }
            (a, b) => a.or(b),
        };
        Ok(Expected { size, sha256 })
    }
}

/// The SHA-256 in an `x-linked-etag` (an LFS object's id), if it is one:
/// a plain git blob's etag is a 40-digit sha1 and names no sha256.
pub fn linked_sha256(etag: &str) -> Option<String> {
    let e = etag.trim().trim_start_matches("W/").trim_matches('"');
    is_sha256(e).then(|| e.to_ascii_lowercase())
}

/// The total length in a `Content-Range: bytes a-b/total` whose range
/// starts at `start`; `None` if it starts elsewhere or cannot be read.
pub fn content_range_total(value: &str, start: u64) -> Option<u64> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, _) = range.split_once('-')?;
    (a.trim().parse::<u64>().ok()? == start).then_some(())?;
    total.trim().parse().ok()
}

/// The length in a 416 answer's `Content-Range: bytes */total`.
pub fn unsatisfied_range_total(value: &str) -> Option<u64> {
    value.trim().strip_prefix("bytes */")?.trim().parse().ok()
}

/// Checks `file` against `expected`: size first, then SHA-256.
pub fn verify(file: &Path, expected: &Expected) -> Result<(), HubError> {
    let got = std::fs::metadata(file)
        .map_err(HubError::io("reading", file))?
        .len();
    if let Some(size) = expected.size
        && got != size
    {
        return Err(HubError::SizeMismatch {
            expected: size,
            got,
        });
    }
    if let Some(want) = &expected.sha256 {
        let digest = sha256_file(file).map_err(HubError::io("hashing", file))?;
        if &digest != want {
            return Err(HubError::ChecksumMismatch {
                expected: want.clone(),
                got: digest,
            });
        }
    }
    Ok(())
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    model: String,
    files: Vec<String>,
}

/// One repo's part of the cache (see the module docs for the layout).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubCache {
    pub dir: PathBuf,
}

impl HubCache {
    pub fn new(cache: &Path, id: &RepoId) -> Self {
        Self {
            dir: cache
                .join("hub")
                .join(format!("models--{}--{}", id.org, id.name)),
        }
    }

    /// Held (an advisory lock) by the process fetching into this repo's
    /// cache, so two never append to the same `.part`.
    pub fn lock_file(&self) -> PathBuf {
        self.dir.join(".lock")
    }

    pub fn ref_file(&self, revision: &str) -> PathBuf {
        self.dir.join("refs").join(revision)
    }

    pub fn snapshot(&self, sha: &str) -> PathBuf {
        self.dir.join("snapshots").join(sha)
    }

    /// Where `file` of commit `sha` is downloaded to before it is checked;
    /// kept across runs so a download resumes.
    pub fn partial(&self, sha: &str, file: &str) -> PathBuf {
        self.dir
            .join("incomplete")
            .join(sha)
            .join(format!("{file}.part"))
    }

    fn manifest(&self, sha: &str, quant: Option<&str>) -> PathBuf {
        let key = quant.map_or_else(|| "default".to_string(), str::to_ascii_lowercase);
        self.dir
            .join("manifests")
            .join(sha)
            .join(format!("{key}.json"))
    }

    /// The model's path if `id`'s revision is cached with every file of
    /// its selection; reads the cache only.
    pub fn cached(&self, id: &RepoId) -> Option<PathBuf> {
        let sha = if id.is_commit() {
            id.revision().to_string()
        } else {
            let s = std::fs::read_to_string(self.ref_file(id.revision())).ok()?;
            let s = s.trim().to_string();
            is_commit_sha(&s).then_some(s)?
        };
        let text = std::fs::read_to_string(self.manifest(&sha, id.quant())).ok()?;
        let m: Manifest = serde_json::from_str(&text).ok()?;
        let snapshot = self.snapshot(&sha);
        let safe = |n: &str| check_file_name(n).is_ok();
        let complete = m
            .files
            .iter()
            .all(|f| safe(f) && snapshot.join(f).is_file());
        (complete && (m.model.is_empty() || safe(&m.model))).then(|| snapshot.join(&m.model))
    }

    /// Checks the downloaded `partial` against `expected` and moves it to
    /// `file`'s place in the snapshot. A file that fails the check is
    /// deleted (resuming it would only append to bad bytes).
    pub fn install(
        &self,
        partial: &Path,
        sha: &str,
        file: &str,
        expected: &Expected,
    ) -> Result<PathBuf, HubError> {
        if let Err(e) = verify(partial, expected) {
            let _ = std::fs::remove_file(partial);
            return Err(HubError::BadDownload {
                file: file.to_string(),
                source: Box::new(e),
            });
        }
        let dest = self.snapshot(sha).join(file);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(HubError::io("creating", parent))?;
        }
        std::fs::rename(partial, &dest).map_err(|source| HubError::Install {
            file: file.to_string(),
            source,
        })?;
        Ok(dest)
    }

    /// Records that `id`'s revision is commit `sha` and that `selection`
    /// is complete in its snapshot, so later runs need no network. Call it
    /// once every file is installed. Returns the model's path.
    pub fn commit(
        &self,
        id: &RepoId,
        sha: &str,
        selection: &Selection,
    ) -> Result<PathBuf, HubError> {
        let manifest = Manifest {
            model: selection.model.clone(),
            files: selection.files.iter().map(|f| f.name.clone()).collect(),
        };
        let json = serde_json::to_string_pretty(&manifest).map_err(HubError::Manifest)?;
        write_atomic(&self.manifest(sha, id.quant()), json.as_bytes())?;
        if !id.is_commit() {
            write_atomic(&self.ref_file(id.revision()), sha.as_bytes())?;
        }
        let _ = std::fs::remove_dir(self.dir.join("incomplete").join(sha));
        Ok(self.snapshot(sha).join(&selection.model))
    }
}

/// Writes `path` whole or not at all (a reader never sees half a file).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), HubError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(HubError::io("writing", path))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(HubError::io("writing", path))?;
    std::fs::rename(&tmp, path).map_err(HubError::io("writing", path))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn id(s: &str) -> RepoId {
        RepoId::parse(s).unwrap()
    }

    fn file(name: &str) -> RepoFile {
        RepoFile {
            name: name.into(),
            size: None,
            sha256: None,
        }
    }

    fn info(names: &[&str]) -> RepoInfo {
        RepoInfo {
            sha: "a".repeat(40),
            files: names.iter().map(|n| file(n)).collect(),
        }
    }

    #[test]
    fn repo_ids_parse() {
        let r = id("HuggingFaceTB/SmolLM2-135M-Instruct");
        assert_eq!(r.repo(), "HuggingFaceTB/SmolLM2-135M-Instruct");
        assert_eq!(r.revision(), "main");
        assert_eq!(r.quant(), None);
        assert!(!r.is_commit());
        let r = id("org/name.v2@refs/pr/1:Q4_K_M");
        assert_eq!(r.repo(), "org/name.v2");
        assert_eq!(r.revision(), "refs/pr/1");
        assert_eq!(r.quant(), Some("Q4_K_M"));
        let sha = "0123456789abcdef0123456789abcdef01234567";
        assert!(id(&format!("o/n@{sha}")).is_commit());
    }

    #[test]
    fn bad_repo_ids_are_refused() {
        for bad in [
            "org/",
            "/name",
            "org//name",
            "a/b/c",
            "../etc",
            "org/..",
            "org/.hidden",
            "org/-x",
            "org/x-",
            "org/a--b",
            "org/a..b",
            "org/na me",
            "org/name%2F..",
            "or\u{e9}g/name",
            "org/name@",
            "org/name@..",
            "org/name@a/../b",
            "org/name@a//b",
            "org/name@/a",
            "org/name@.x",
            "org/name@a b",
            "org/name:",
            "org/name:Q4-K",
            "org/name@main:",
            "org/name\0",
            "org/name\\x",
        ] {
            let e = RepoId::parse(bad).expect_err(bad);
            assert!(
                matches!(&e, ModelError::InvalidRepoId { id, .. } if id == bad),
                "{bad}: {e:?}"
            );
        }
        let long = format!("org/{}", "n".repeat(97));
        assert!(RepoId::parse(&long).is_err());
        let e = RepoId::parse("org/../x").unwrap_err().to_string();
        assert!(e.contains("\"org/../x\"") && e.contains("ORG/NAME"), "{e}");
    }

    #[test]
    fn only_relative_slashed_strings_look_like_repo_ids() {
        assert!(looks_like_repo_id("org/name"));
        assert!(looks_like_repo_id("../x"));
        assert!(!looks_like_repo_id("/abs/path.gguf"));
        assert!(!looks_like_repo_id("model.gguf"));
    }

    #[test]
    fn urls() {
        let e = endpoint(Some("http://127.0.0.1:9/")).unwrap();
        assert_eq!(e, "http://127.0.0.1:9");
        assert_eq!(endpoint(None).unwrap(), DEFAULT_ENDPOINT);
        assert_eq!(endpoint(Some("")).unwrap(), DEFAULT_ENDPOINT);
        assert!(endpoint(Some("ftp://x")).is_err());
        let r = id("org/name@refs/pr/1");
        assert_eq!(
            api_url(&e, &r),
            "http://127.0.0.1:9/api/models/org/name/revision/refs%2Fpr%2F1"
        );
        assert_eq!(
            file_url(&e, &r, "abc", "sub dir/a+b.gguf"),
            "http://127.0.0.1:9/org/name/resolve/abc/sub%20dir/a%2Bb.gguf"
        );
        assert_eq!(origin("https://h.co:8/a/b?c"), "https://h.co:8");
        assert_eq!(origin("https://h.co"), "https://h.co");
        let base = "https://h.co/o/n/resolve/s/f.gguf";
        assert_eq!(join_location(base, "https://cdn/x"), "https://cdn/x");
        assert_eq!(join_location(base, "//cdn/x"), "https://cdn/x");
        assert_eq!(join_location(base, "/api/x"), "https://h.co/api/x");
        assert_eq!(
            join_location(base, "g.gguf"),
            "https://h.co/o/n/resolve/s/g.gguf"
        );
    }

    #[test]
    fn repo_listing_parses_and_unsafe_names_are_refused() {
        let sha = "0123456789abcdef0123456789abcdef01234567";
        let h = "ab".repeat(32);
        let json = format!(
            r#"{{"sha":"{sha}","siblings":[{{"rfilename":"a.gguf","size":5,"lfs":{{"sha256":"{h}","size":5}}}},{{"rfilename":"config.json"}}]}}"#
        );
        let i = parse_repo_info(&json).unwrap();
        assert_eq!(i.sha, sha);
        assert_eq!(
            i.files,
            [
                RepoFile {
                    name: "a.gguf".into(),
                    size: Some(5),
                    sha256: Some(h.clone())
                },
                file("config.json")
            ]
        );
        for bad in ["../x", "/etc/passwd", "a/../b", "a//b", "a\\b", "./a", ""] {
            let json = format!(r#"{{"sha":"{sha}","siblings":[{{"rfilename":{bad:?}}}]}}"#);
            assert!(parse_repo_info(&json).is_err(), "{bad}");
        }
        assert!(parse_repo_info(r#"{"sha":"../x","siblings":[]}"#).is_err());
        assert!(parse_repo_info(r#"{"siblings":[]}"#).is_err());
        assert!(parse_repo_info("not json").is_err());
    }

    #[test]
    fn selection() {
        let one = select(
            &info(&["README.md", "m.Q4_1.gguf", "mmproj-f16.gguf"]),
            None,
        )
        .unwrap();
        assert_eq!(one.model, "m.Q4_1.gguf");
        assert_eq!(one.files, [file("m.Q4_1.gguf")]);

        let many = info(&["m.Q4_K.gguf", "m.Q4_K_M.gguf", "sub/m.Q8_0.gguf"]);
        let e = select(&many, None).unwrap_err().to_string();
        assert!(e.contains("m.Q4_K_M.gguf") && e.contains(":QUANT"), "{e}");
        assert_eq!(
            select(&many, Some("q4_k_m")).unwrap().model,
            "m.Q4_K_M.gguf"
        );
        assert_eq!(select(&many, Some("Q4_K")).unwrap().model, "m.Q4_K.gguf");
        assert_eq!(
            select(&many, Some("Q8_0")).unwrap().model,
            "sub/m.Q8_0.gguf"
        );
        let e = select(&many, Some("Q5_0")).unwrap_err().to_string();
        assert!(e.contains("no .gguf file matches :Q5_0"), "{e}");

        let split = info(&["m-00001-of-00002.gguf"]);
        assert!(
            select(&split, None)
                .unwrap_err()
                .to_string()
                .contains("split GGUF")
        );

        let hf = info(&[
            "README.md",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "model-00002-of-00002.safetensors",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "onnx/model.safetensors",
            "vocab.json",
        ]);
        let s = select(&hf, None).unwrap();
        assert_eq!(s.model, "");
        let names: Vec<_> = s.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
                "model.safetensors.index.json",
                "model-00002-of-00002.safetensors",
                "model-00001-of-00002.safetensors",
            ]
        );
        let e = select(&info(&["README.md", "model.safetensors"]), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no .gguf file and no safetensors model"), "{e}");
    }

    #[test]
    fn expectations_merge_and_headers_parse() {
        let h = "cd".repeat(32);
        let listing = Expected {
            size: Some(3),
            sha256: None,
        };
        let headers = Expected {
            size: Some(3),
            sha256: linked_sha256(&format!("\"{h}\"")),
        };
        assert_eq!(
            listing.clone().merge(headers).unwrap(),
            Expected {
                size: Some(3),
                sha256: Some(h.clone())
            }
        );
        let other = Expected {
            size: Some(4),
            sha256: None,
        };
        assert!(listing.merge(other).is_err());
        assert_eq!(
            linked_sha256("\"0123456789abcdef0123456789abcdef01234567\""),
            None
        );
        assert_eq!(
            linked_sha256(&format!("W/\"{}\"", h.to_uppercase())),
            Some(h)
        );
        assert_eq!(content_range_total("bytes 10-99/100", 10), Some(100));
        assert_eq!(content_range_total("bytes 0-99/100", 10), None);
        assert_eq!(content_range_total("bytes 10-99/*", 10), None);
        assert_eq!(unsatisfied_range_total("bytes */100"), Some(100));
        assert_eq!(unsatisfied_range_total("bytes 0-1/100"), None);
    }

    #[test]
    fn cache_round_trip_and_verification() {
        let cache = tempfile::tempdir().unwrap();
        let r = id("org/name");
        let hc = HubCache::new(cache.path(), &r);
        assert_eq!(hc.dir, cache.path().join("hub/models--org--name"));
        assert_eq!(hc.cached(&r), None);
        let sha = "0123456789abcdef0123456789abcdef01234567";
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let partial = hc.partial(sha, "sub/m.gguf");
        assert!(partial.starts_with(hc.dir.join("incomplete")));
        std::fs::create_dir_all(partial.parent().unwrap()).unwrap();

        // A wrong sum: refused, the partial deleted, nothing in the snapshot.
        std::fs::write(&partial, b"abd").unwrap();
        let want = Expected {
            size: Some(3),
            sha256: Some(abc.into()),
        };
        let e = hc
            .install(&partial, sha, "sub/m.gguf", &want)
            .unwrap_err()
            .to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        assert!(!partial.exists());
        assert!(!hc.snapshot(sha).exists());
        std::fs::write(&partial, b"abcd").unwrap();
        let e = hc
            .install(&partial, sha, "sub/m.gguf", &want)
            .unwrap_err()
            .to_string();
        assert!(e.contains("size mismatch"), "{e}");

        std::fs::write(&partial, b"abc").unwrap();
        let dest = hc.install(&partial, sha, "sub/m.gguf", &want).unwrap();
        assert_eq!(dest, hc.snapshot(sha).join("sub/m.gguf"));
        // Installed but not committed: not yet a cache hit.
        assert_eq!(hc.cached(&r), None);
        let selection = Selection {
            files: vec![file("sub/m.gguf")],
            model: "sub/m.gguf".into(),
        };
        assert_eq!(hc.commit(&r, sha, &selection).unwrap(), dest);
        assert_eq!(hc.cached(&r), Some(dest.clone()));
        assert_eq!(std::fs::read_to_string(hc.ref_file("main")).unwrap(), sha);
        // The commit itself resolves without a ref; other revisions and
        // quants do not.
        assert_eq!(
            hc.cached(&id(&format!("org/name@{sha}"))),
            Some(dest.clone())
        );
        assert_eq!(hc.cached(&id("org/name@v2")), None);
        assert_eq!(hc.cached(&id("org/name:Q8_0")), None);
        // A file gone from the snapshot: no longer a hit.
        std::fs::remove_file(&dest).unwrap();
        assert_eq!(hc.cached(&r), None);
    }
}
