//! Fetches `--model ORG/NAME[@REVISION][:QUANT]` from a Hugging Face hub:
//! the HTTP half of [`tandem_modelfile::hub`], which validated the id,
//! picks the files, and owns the cache and the checks.
//!
//! `HF_ENDPOINT` (default https://huggingface.co) names the hub and
//! `HF_TOKEN`, where set, is sent as `Authorization: Bearer` to that origin
//! only (never to the CDN a download is redirected to). The listing comes
//! from the hub API; every file is downloaded from the resolved commit
//! (not the branch, which may move meanwhile) into a `.part` file that a
//! broken connection, or a later run, resumes with a `Range` request. It
//! is checked against the size and SHA-256 that the listing or the
//! `x-linked-*` headers give before it moves into the snapshot.

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tandem_modelfile::ModelError;
use tandem_modelfile::hub::{self, Expected, HubCache, RepoFile, RepoId, RepoInfo};
use ureq::http::{Response, StatusCode, header};

/// Tries per file; a broken connection resumes where it stopped.
const ATTEMPTS: u32 = 4;
/// Redirect hops followed by hand (to keep each hop's headers and to drop
/// the token when leaving the hub's origin).
const MAX_REDIRECTS: usize = 10;
/// The hub's listing of a large repo is well under this.
const MAX_LISTING: u64 = 64 << 20;

/// Fetches `id` into `cache` (the caller found it not cached) and returns
/// the path to load: a `.gguf` file or a snapshot directory.
pub fn fetch(id: &RepoId, cache: &Path) -> Result<PathBuf, ModelError> {
    let hub = Hub::from_env().map_err(|p| id.error(p))?;
    let store = HubCache::new(cache, id);
    let _lock = lock(&store).map_err(|e| id.error(e))?;
    // Whoever held the lock may just have fetched it.
    if let Some(path) = store.cached(id) {
        return Ok(path);
    }
    eprintln!(
        "tandem: resolving {}@{} on {} ...",
        id.repo(),
        id.revision(),
        hub.endpoint
    );
    let info = hub.repo_info(id)?;
    let selection = hub::select(&info, id.quant()).map_err(|p| id.error(p))?;
    let snapshot = store.snapshot(&info.sha);
    for file in &selection.files {
        // Another selection of this commit may have fetched it already.
        if snapshot.join(&file.name).is_file() {
            continue;
        }
        hub.download(id, &store, &info, file)?;
    }
    let path = store
        .commit(id, &info.sha, &selection)
        .map_err(|p| id.error(p))?;
    eprintln!(
        "tandem: {}@{} (commit {}) ready at {}",
        id.repo(),
        id.revision(),
        info.sha,
        path.display()
    );
    Ok(path)
}

/// Takes the repo's cache lock, waiting for another process that holds it;
/// released when the file is dropped (or the process dies).
fn lock(store: &HubCache) -> Result<File, String> {
    let path = store.lock_file();
    std::fs::create_dir_all(&store.dir)
        .map_err(|e| format!("creating {}: {e}", store.dir.display()))?;
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            eprintln!(
                "tandem: waiting for another tandem process fetching into {} ...",
                store.dir.display()
            );
            file.lock()
                .map_err(|e| format!("locking {}: {e}", path.display()))?;
            Ok(file)
        }
        Err(std::fs::TryLockError::Error(e)) => Err(format!("locking {}: {e}", path.display())),
    }
}

struct Hub {
    endpoint: String,
    token: Option<String>,
    agent: ureq::Agent,
}

/// Why a request failed, and whether trying again may help.
struct Failure {
    problem: String,
    retry: bool,
}

impl Failure {
    fn fatal(problem: impl std::fmt::Display) -> Self {
        Self {
            problem: problem.to_string(),
            retry: false,
        }
    }
}

impl Hub {
    fn from_env() -> Result<Self, hub::HubError> {
        let endpoint = hub::endpoint(std::env::var("HF_ENDPOINT").ok().as_deref())?;
        let token = std::env::var("HF_TOKEN")
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            // A stalled transfer fails (and resumes) instead of hanging.
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(format!("tandem/{}", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(Self {
            endpoint,
            token,
            agent,
        })
    }

    /// GET `url`, following redirects; also returns what the hops' headers
    /// say the file is (the hub puts `x-linked-*` on its redirect).
    fn get(
        &self,
        url: &str,
        range_from: Option<u64>,
    ) -> Result<(Response<ureq::Body>, Expected), Failure> {
        let mut url = url.to_string();
        let mut linked = Expected::default();
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&url);
            if let Some(t) = &self.token
                && hub::origin(&url) == hub::origin(&self.endpoint)
            {
                req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
            }
            if let Some(n) = range_from {
                req = req.header(header::RANGE, format!("bytes={n}-"));
            }
            let resp = req.call().map_err(|e| Failure {
                problem: format!("GET {url}: {e}"),
                retry: true,
            })?;
            let text = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok());
            let hop = Expected {
                size: text("x-linked-size").and_then(|v| v.trim().parse().ok()),
                sha256: text("x-linked-etag").and_then(hub::linked_sha256),
            };
            linked = linked.merge(hop).map_err(Failure::fatal)?;
            if !resp.status().is_redirection() {
                return Ok((resp, linked));
            }
            let location = text("location")
                .ok_or_else(|| Failure::fatal(format!("GET {url}: redirect without a Location")))?;
            url = hub::join_location(&url, location);
        }
        Err(Failure::fatal(format!(
            "more than {MAX_REDIRECTS} redirects"
        )))
    }

    /// What a refused request means, in the user's terms.
    fn status_problem(&self, status: StatusCode, what: &str) -> String {
        match status.as_u16() {
            401 if self.token.is_some() => format!(
                "{what}: HTTP 401 Unauthorized: the hub refused HF_TOKEN (expired or mistyped?)"
            ),
            // The hub answers 401 for private repos and for ones that do
            // not exist, so as not to reveal which.
            401 => format!(
                "{what}: HTTP 401 Unauthorized: the repo does not exist, or it is private or \
                 gated: set HF_TOKEN to an access token that can read it"
            ),
            403 => format!(
                "{what}: HTTP 403 Forbidden: the token may not read this repo (a gated model \
                 needs its terms accepted on its hub page first)"
            ),
            404 => format!("{what}: HTTP 404 Not Found: no such repo, revision or file"),
            _ => format!("{what}: HTTP {status}"),
        }
    }

    fn repo_info(&self, id: &RepoId) -> Result<RepoInfo, ModelError> {
        let url = hub::api_url(&self.endpoint, id);
        let mut last = String::new();
        for attempt in 1..=ATTEMPTS {
            match self.try_repo_info(&url) {
                Ok(json) => return hub::parse_repo_info(&json).map_err(|p| id.error(p)),
                Err(f) if f.retry && attempt < ATTEMPTS => {
                    eprintln!("tandem: {} (retrying)", f.problem);
                    last = f.problem;
                    std::thread::sleep(backoff(attempt));
                }
                Err(f) => return Err(id.error(f.problem)),
            }
        }
        Err(id.error(last))
    }

    fn try_repo_info(&self, url: &str) -> Result<String, Failure> {
        let (resp, _) = self.get(url, None)?;
        let status = resp.status();
        if status != StatusCode::OK {
            return Err(Failure {
                problem: self.status_problem(status, "listing the repo"),
                retry: retryable(status),
            });
        }
        resp.into_body()
            .into_with_config()
            .limit(MAX_LISTING)
            .read_to_string()
            .map_err(|e| Failure {
                problem: format!("reading the repo listing: {e}"),
                retry: true,
            })
    }

    /// Downloads `file` of commit `info.sha`, resuming its `.part`, checks
    /// it and installs it into the snapshot.
    fn download(
        &self,
        id: &RepoId,
        store: &HubCache,
        info: &RepoInfo,
        file: &RepoFile,
    ) -> Result<PathBuf, ModelError> {
        let url = hub::file_url(&self.endpoint, id, &info.sha, &file.name);
        let partial = store.partial(&info.sha, &file.name);
        if let Some(dir) = partial.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| id.error(format!("creating {}: {e}", dir.display())))?;
        }
        let mut expected = Expected::of(file);
        for attempt in 1..=ATTEMPTS {
            match self.try_download(&url, &partial, &file.name, expected.clone()) {
                Ok(e) => {
                    expected = e;
                    break;
                }
                Err(f) if f.retry && attempt < ATTEMPTS => {
                    eprintln!("tandem: {} (resuming)", f.problem);
                    std::thread::sleep(backoff(attempt));
                }
                Err(f) => {
                    let kept = partial.metadata().map_or(0, |m| m.len());
                    let note = if kept > 0 && f.retry {
                        format!("; {} kept, a later run resumes it", size_text(kept))
                    } else {
                        String::new()
                    };
                    return Err(id.error(format!("{}: {}{note}", file.name, f.problem)));
                }
            }
        }
        store
            .install(&partial, &info.sha, &file.name, &expected)
            .map_err(|p| id.error(format!("{p}; nothing was cached")))
    }

    /// One attempt: appends to `partial` from where it ends. Returns what
    /// the file must be, as far as is known.
    fn try_download(
        &self,
        url: &str,
        partial: &Path,
        name: &str,
        expected: Expected,
    ) -> Result<Expected, Failure> {
        let have = partial.metadata().map_or(0, |m| m.len());
        let (resp, linked) = self.get(url, (have > 0).then_some(have))?;
        let mut expected = expected.merge(linked).map_err(Failure::fatal)?;
        let status = resp.status();
        let header_text = |n: header::HeaderName| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (mut out, start) = match status.as_u16() {
            206 => {
                let range = header_text(header::CONTENT_RANGE).unwrap_or_default();
                let Some(total) = hub::content_range_total(&range, have) else {
                    // Not where we asked: start over.
                    remove(partial)?;
                    return Err(Failure {
                        problem: format!("the server answered Range {have}- with {range:?}"),
                        retry: true,
                    });
                };
                expected = expected
                    .merge(Expected {
                        size: Some(total),
                        sha256: None,
                    })
                    .map_err(Failure::fatal)?;
                (open(partial, true)?, have)
            }
            200 => {
                // The server ignored the Range: start from the beginning.
                let length = header_text(header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
                expected = expected
                    .merge(Expected {
                        size: length,
                        sha256: None,
                    })
                    .map_err(Failure::fatal)?;
                (open(partial, false)?, 0)
            }
            416 if have > 0 => {
                // Nothing after `have`: complete if that is the file's
                // length (a run that stopped before installing it),
                // otherwise stale: redo it.
                let total = header_text(header::CONTENT_RANGE)
                    .and_then(|v| hub::unsatisfied_range_total(&v));
                if total == Some(have) && expected.size.is_none_or(|s| s == have) {
                    return expected
                        .merge(Expected {
                            size: Some(have),
                            sha256: None,
                        })
                        .map_err(Failure::fatal);
                }
                remove(partial)?;
                return Err(Failure {
                    problem: "the server refused to resume (416)".into(),
                    retry: true,
                });
            }
            _ => {
                return Err(Failure {
                    problem: self.status_problem(status, "downloading"),
                    retry: retryable(status),
                });
            }
        };
        let mut progress = Progress::new(name, start, expected.size);
        let mut body = resp.into_body().into_reader();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    progress.end();
                    // What arrived is kept: the next attempt resumes after it.
                    let _ = out.flush();
                    return Err(Failure {
                        problem: format!(
                            "connection broke after {}: {e}",
                            size_text(progress.done)
                        ),
                        retry: true,
                    });
                }
            };
            out.write_all(&buf[..n])
                .map_err(|e| Failure::fatal(format!("writing {}: {e}", partial.display())))?;
            progress.add(n as u64);
        }
        out.flush()
            .map_err(|e| Failure::fatal(format!("writing {}: {e}", partial.display())))?;
        progress.end();
        Ok(expected)
    }
}

fn open(path: &Path, append: bool) -> Result<File, Failure> {
    let mut o = OpenOptions::new();
    if append {
        o.append(true);
    } else {
        o.write(true).create(true).truncate(true);
    }
    o.open(path)
        .map_err(|e| Failure::fatal(format!("opening {}: {e}", path.display())))
}

fn remove(path: &Path) -> Result<(), Failure> {
    std::fs::remove_file(path)
        .map_err(|e| Failure::fatal(format!("removing {}: {e}", path.display())))
}

/// Server trouble and rate limits may pass; refusals will not.
fn retryable(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(500 * u64::from(attempt))
}

fn size_text(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

/// A progress line on stderr: redrawn in place on a terminal, otherwise
/// one line per file (logs stay readable).
struct Progress {
    name: String,
    total: Option<u64>,
    done: u64,
    tty: bool,
    last: Instant,
}

impl Progress {
    fn new(name: &str, done: u64, total: Option<u64>) -> Self {
        let tty = std::io::stderr().is_terminal();
        let p = Self {
            name: name.to_string(),
            total,
            done,
            tty,
            last: Instant::now(),
        };
        if !tty {
            let size = total.map_or_else(String::new, |t| format!(" ({})", size_text(t)));
            let from = if done > 0 {
                format!(", resuming after {}", size_text(done))
            } else {
                String::new()
            };
            eprintln!("tandem: downloading {name}{size}{from}");
        } else {
            p.draw();
        }
        p
    }

    fn add(&mut self, n: u64) {
        self.done += n;
        if self.tty && self.last.elapsed() >= Duration::from_millis(200) {
            self.last = Instant::now();
            self.draw();
        }
    }

    fn draw(&self) {
        let line = match self.total {
            Some(t) if t > 0 => format!(
                "{} / {} ({:.0}%)",
                size_text(self.done),
                size_text(t),
                self.done as f64 * 100.0 / t as f64
            ),
            _ => size_text(self.done),
        };
        eprint!("\r\x1b[2Ktandem: {} {line}", self.name);
    }

    fn end(&self) {
        if self.tty {
            self.draw();
            eprintln!();
        }
    }
}
