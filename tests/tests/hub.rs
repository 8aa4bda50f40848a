//! End to end: `tandem generate --model ORG/NAME` against a fake Hugging
//! Face hub in this process (`HF_ENDPOINT`), which serves the API listing
//! and the resolve routes for fixture repos built from the test model, and
//! redirects weight files to a "CDN" on a second port, as the hub does. It
//! logs every request, so the tests see what the binary asked for.
//!
//! Needs the release binary and `TANDEM_TEST_GGUF` (see serve.rs), and the
//! HF-directory fixture at `$TANDEM_TEST_HF_DIR` (scripts/test.sh).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::json;
use tandem_modelfile::fetch::sha256_file;
use tandem_tests::gguf_path;

const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SHA_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const SHA_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
const SHA_C: &str = "cccccccccccccccccccccccccccccccccccccccc";
const SHA_HF: &str = "dddddddddddddddddddddddddddddddddddddddd";
const SHA_EVIL: &str = "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee";

fn hf_dir() -> PathBuf {
    tandem_testkit::cached_path("TANDEM_TEST_HF_DIR", "test-fixtures/smollm2-135m-hf-f32")
}

/// SHA-256 of a fixture file, computed once per process.
fn sha256_of(path: &Path) -> String {
    static SUMS: OnceLock<Mutex<HashMap<PathBuf, String>>> = OnceLock::new();
    let sums = SUMS.get_or_init(Default::default);
    if let Some(s) = sums.lock().unwrap().get(path) {
        return s.clone();
    }
    let s = sha256_file(path).unwrap();
    sums.lock().unwrap().insert(path.to_path_buf(), s.clone());
    s
}

/// A file of a fixture commit: its bytes come from `source`.
#[derive(Clone)]
struct FixtureFile {
    name: String,
    source: Source,
    /// Served through the CDN redirect with `x-linked-*`, as LFS files are.
    lfs: bool,
}

#[derive(Clone)]
enum Source {
    Path(PathBuf),
    Bytes(Vec<u8>),
}

impl FixtureFile {
    fn lfs(name: &str, path: PathBuf) -> Self {
        Self {
            name: name.into(),
            source: Source::Path(path),
            lfs: true,
        }
    }

    fn small(name: &str, bytes: &[u8]) -> Self {
        Self {
            name: name.into(),
            source: Source::Bytes(bytes.to_vec()),
            lfs: false,
        }
    }

    fn len(&self) -> u64 {
        match &self.source {
            Source::Path(p) => p.metadata().unwrap().len(),
            Source::Bytes(b) => b.len() as u64,
        }
    }

    fn sha256(&self) -> String {
        match &self.source {
            Source::Path(p) => sha256_of(p),
            Source::Bytes(b) => {
                let dir = tempfile::tempdir().unwrap();
                let p = dir.path().join("f");
                std::fs::write(&p, b).unwrap();
                sha256_file(&p).unwrap()
            }
        }
    }
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Logged {
    port: u16,
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

impl Logged {
    fn is_file(&self) -> bool {
        self.path.contains("/resolve/") || self.path.starts_with("/cdn/")
    }
}

#[derive(Default)]
struct State {
    /// repo -> revision -> commit sha.
    refs: HashMap<String, HashMap<String, String>>,
    /// commit sha -> files.
    commits: HashMap<String, Vec<FixtureFile>>,
    log: Vec<Logged>,
    /// Every request to the hub port needs this bearer token.
    token: Option<String>,
    /// The next this-many CDN responses stop after `drop_after` bytes.
    drops: usize,
    drop_after: u64,
    /// Announce a wrong sha256 in `x-linked-etag`.
    lie_about_sha: bool,
}

/// The fake hub: API and resolve routes on `port`, file bytes on
/// `cdn_port`.
struct Hub {
    state: Arc<Mutex<State>>,
    port: u16,
    cdn_port: u16,
}

impl Hub {
    fn start() -> Hub {
        let state = Arc::new(Mutex::new(State::default()));
        let hub = TcpListener::bind("127.0.0.1:0").unwrap();
        let cdn = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = hub.local_addr().unwrap().port();
        let cdn_port = cdn.local_addr().unwrap().port();
        for listener in [hub, cdn] {
            let state = state.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    let Ok(conn) = conn else { continue };
                    let state = state.clone();
                    std::thread::spawn(move || serve(conn, &state, cdn_port));
                }
            });
        }
        Hub {
            state,
            port,
            cdn_port,
        }
    }

    fn add(&self, repo: &str, revs: &[&str], sha: &str, files: Vec<FixtureFile>) {
        let mut s = self.state.lock().unwrap();
        for rev in revs {
            s.refs
                .entry(repo.into())
                .or_default()
                .insert((*rev).into(), sha.into());
        }
        s.commits.insert(sha.into(), files);
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> Vec<Logged> {
        self.state.lock().unwrap().log.clone()
    }

    fn file_requests(&self) -> Vec<Logged> {
        self.log().into_iter().filter(Logged::is_file).collect()
    }

    fn clear_log(&self) {
        self.state.lock().unwrap().log.clear();
    }

    fn set(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap());
    }
}

/// The SmolLM2 GGUF repo: `main` is commit A; `v2` is commit B, where the
/// GGUF has another name; `multi` is commit C with two quantizations.
fn gguf_hub() -> Hub {
    let hub = Hub::start();
    let readme = FixtureFile::small("README.md", b"# fixture\n");
    hub.add(
        "tandem-test/smollm2-gguf",
        &["main"],
        SHA_A,
        vec![readme.clone(), FixtureFile::lfs(GGUF_NAME, gguf_path())],
    );
    hub.add(
        "tandem-test/smollm2-gguf",
        &["v2"],
        SHA_B,
        vec![
            readme.clone(),
            FixtureFile::lfs("renamed/smollm2-v2.gguf", gguf_path()),
        ],
    );
    hub.add(
        "tandem-test/smollm2-gguf",
        &["multi"],
        SHA_C,
        vec![
            readme,
            FixtureFile::lfs("smollm2.Q4_1.gguf", gguf_path()),
            FixtureFile {
                name: "smollm2.Q8_0.gguf".into(),
                source: Source::Bytes(b"not fetched".to_vec()),
                lfs: true,
            },
            FixtureFile::small("mmproj-smollm2-f16.gguf", b"a projector"),
        ],
    );
    hub
}

fn serve(mut conn: TcpStream, state: &Mutex<State>, cdn_port: u16) {
    let port = conn.local_addr().unwrap().port();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let logged = Logged {
        port,
        path: path.clone(),
        range: headers.get("range").cloned(),
        auth: headers.get("authorization").cloned(),
    };
    let mut s = state.lock().unwrap();
    s.log.push(logged.clone());
    let respond = |conn: &mut TcpStream, status: &str, extra: &[(&str, String)], body: &[u8]| {
        let mut head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = conn.write_all(head.as_bytes());
        let _ = conn.write_all(body);
    };
    if port != cdn_port
        && let Some(token) = &s.token
        && logged.auth.as_deref() != Some(&format!("Bearer {token}"))
    {
        drop(s);
        return respond(&mut conn, "401 Unauthorized", &[], b"{\"error\":\"token\"}");
    }
    let not_found = |conn: &mut TcpStream| respond(conn, "404 Not Found", &[], b"not found");

    if let Some(rest) = path.strip_prefix("/api/models/") {
        // {org}/{name}/revision/{rev}
        let parts: Vec<&str> = rest.splitn(4, '/').collect();
        let [org, name, "revision", rev] = parts[..] else {
            return not_found(&mut conn);
        };
        let rev = rev.replace("%2F", "/");
        let repo = format!("{org}/{name}");
        let Some(sha) = s.refs.get(&repo).and_then(|r| r.get(&rev)).cloned() else {
            return not_found(&mut conn);
        };
        let siblings: Vec<_> = s.commits[&sha]
            .iter()
            .map(|f| json!({ "rfilename": f.name }))
            .collect();
        let body = json!({ "id": repo, "sha": sha, "siblings": siblings }).to_string();
        drop(s);
        return respond(&mut conn, "200 OK", &[], body.as_bytes());
    }
    if let Some(rest) = path.strip_prefix("/cdn/") {
        // {sha}/{file}: the bytes, honouring Range.
        let (sha, name) = rest.split_once('/').unwrap_or(("", ""));
        let Some(file) = s
            .commits
            .get(sha)
            .and_then(|fs| fs.iter().find(|f| f.name == name))
            .cloned()
        else {
            return not_found(&mut conn);
        };
        let drop_after = (s.drops > 0).then_some(s.drop_after);
        s.drops = s.drops.saturating_sub(1);
        drop(s);
        return send_file(&mut conn, &file, logged.range.as_deref(), drop_after);
    }
    // {org}/{name}/resolve/{sha}/{file...}
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    let [_org, _name, "resolve", sha, name] = parts[..] else {
        return not_found(&mut conn);
    };
    let name = name.replace("%20", " ");
    let Some(file) = s
        .commits
        .get(sha)
        .and_then(|fs| fs.iter().find(|f| f.name == name))
        .cloned()
    else {
        return not_found(&mut conn);
    };
    let lie = s.lie_about_sha;
    drop(s);
    if file.lfs {
        let sha256 = if lie { "0".repeat(64) } else { file.sha256() };
        let location = format!("http://127.0.0.1:{cdn_port}/cdn/{sha}/{name}");
        respond(
            &mut conn,
            "302 Found",
            &[
                ("Location", location),
                ("X-Linked-Etag", format!("\"{sha256}\"")),
                ("X-Linked-Size", file.len().to_string()),
                ("X-Repo-Commit", sha.to_string()),
            ],
            b"",
        );
    } else {
        send_file(&mut conn, &file, logged.range.as_deref(), None);
    }
}

/// Sends `file` (from the start of a `bytes=N-` range, if any); stops
/// after `drop_after` bytes of body if given, as a broken connection would.
fn send_file(
    conn: &mut TcpStream,
    file: &FixtureFile,
    range: Option<&str>,
    drop_after: Option<u64>,
) {
    let len = file.len();
    let start: u64 = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .map_or(0, |n| n.parse().unwrap());
    if start >= len && range.is_some() {
        let head = format!(
            "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\nContent-Range: bytes */{len}\r\nConnection: close\r\n\r\n"
        );
        let _ = conn.write_all(head.as_bytes());
        return;
    }
    let head = if range.is_some() {
        format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{}/{len}\r\nConnection: close\r\n\r\n",
            len - start,
            len - 1
        )
    } else {
        format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
    };
    if conn.write_all(head.as_bytes()).is_err() {
        return;
    }
    let body: Box<dyn Read> = match &file.source {
        Source::Path(p) => {
            let mut f = std::fs::File::open(p).unwrap();
            f.seek(SeekFrom::Start(start)).unwrap();
            Box::new(f)
        }
        Source::Bytes(b) => Box::new(std::io::Cursor::new(b[start as usize..].to_vec())),
    };
    let mut body: Box<dyn Read> = match drop_after {
        Some(n) => Box::new(body.take(n)),
        None => Box::new(body),
    };
    let _ = std::io::copy(&mut body, conn);
    let _ = conn.flush();
    let _ = conn.shutdown(Shutdown::Both);
}

/// `tandem generate --model <model>` against `hub`, caching in `cache`.
fn generate(hub: &Hub, cache: &Path, model: &str, token: Option<&str>) -> Output {
    generate_at(&hub.endpoint(), cache, model, token)
}

fn generate_at(endpoint: &str, cache: &Path, model: &str, token: Option<&str>) -> Output {
    let mut cmd = Command::new(tandem_tests::binary());
    cmd.args(["generate", "--model", model])
        .args(["--prompt", "Hi", "--max-tokens", "2", "--temperature", "0"])
        .arg("--cache-dir")
        .arg(cache)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_TOKEN")
        .env_remove("TANDEM_MODEL");
    // The fake hub is local: no proxy may stand in between.
    for var in [
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ] {
        cmd.env_remove(var);
    }
    if let Some(t) = token {
        cmd.env("HF_TOKEN", t);
    }
    cmd.output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_generated(out: &Output) {
    let err = stderr(out);
    assert!(out.status.success(), "tandem generate failed: {err}");
    assert!(err.contains("generated 2 tokens"), "{err}");
}

fn repo_cache(cache: &Path, repo: &str) -> PathBuf {
    cache
        .join("hub")
        .join(format!("models--{}", repo.replace('/', "--")))
}

#[test]
fn gguf_repo_generates_then_resolves_from_the_cache_without_requests() {
    let hub = gguf_hub();
    let cache = tempfile::tempdir().unwrap();
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf", None);
    assert_generated(&out);
    let log = hub.log();
    assert_eq!(
        log[0].path,
        "/api/models/tandem-test/smollm2-gguf/revision/main"
    );
    // Only the model: the README is not fetched. The hub redirects to the
    // CDN, which serves the bytes; no token was set, none was sent.
    let files: Vec<_> = hub.file_requests().iter().map(|l| l.path.clone()).collect();
    assert_eq!(
        files,
        [
            format!("/tandem-test/smollm2-gguf/resolve/{SHA_A}/{GGUF_NAME}"),
            format!("/cdn/{SHA_A}/{GGUF_NAME}"),
        ]
    );
    assert!(
        log.iter().all(|l| l.auth.is_none() && l.range.is_none()),
        "{log:?}"
    );
    let repo = repo_cache(cache.path(), "tandem-test/smollm2-gguf");
    let cached = repo.join("snapshots").join(SHA_A).join(GGUF_NAME);
    assert_eq!(sha256_file(&cached).unwrap(), sha256_of(&gguf_path()));
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        SHA_A
    );

    // Again: all from the cache, not a single request.
    hub.clear_log();
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf", None);
    assert_generated(&out);
    assert!(hub.log().is_empty(), "{:?}", hub.log());
    // The commit itself names the same snapshot, also without requests.
    let out = generate(
        &hub,
        cache.path(),
        &format!("tandem-test/smollm2-gguf@{SHA_A}"),
        None,
    );
    assert_generated(&out);
    assert!(hub.log().is_empty(), "{:?}", hub.log());
}

#[test]
fn revision_and_quant_select_other_commits_and_files() {
    let hub = gguf_hub();
    let cache = tempfile::tempdir().unwrap();
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf@v2", None);
    assert_generated(&out);
    assert_eq!(
        hub.log()[0].path,
        "/api/models/tandem-test/smollm2-gguf/revision/v2"
    );
    let repo = repo_cache(cache.path(), "tandem-test/smollm2-gguf");
    assert!(
        repo.join("snapshots")
            .join(SHA_B)
            .join("renamed/smollm2-v2.gguf")
            .is_file()
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/v2")).unwrap(),
        SHA_B
    );
    assert!(!repo.join("refs/main").exists());
    assert!(!repo.join("snapshots").join(SHA_A).exists());

    // Two quantizations and a projector: without a choice, a clear error
    // naming them; then `:QUANT` picks one, and only it is fetched.
    hub.clear_log();
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf@multi", None);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("several .gguf files: smollm2.Q4_1.gguf, smollm2.Q8_0.gguf")
            && err.contains(":QUANT"),
        "{err}"
    );
    assert!(hub.file_requests().is_empty());
    let out = generate(
        &hub,
        cache.path(),
        "tandem-test/smollm2-gguf@multi:q4_1",
        None,
    );
    assert_generated(&out);
    let files: Vec<_> = hub.file_requests().iter().map(|l| l.path.clone()).collect();
    assert_eq!(
        files,
        [
            format!("/tandem-test/smollm2-gguf/resolve/{SHA_C}/smollm2.Q4_1.gguf"),
            format!("/cdn/{SHA_C}/smollm2.Q4_1.gguf"),
        ]
    );
}

#[test]
fn safetensors_repo_generates() {
    let hub = Hub::start();
    let dir = hf_dir();
    let mut files = vec![FixtureFile::small("README.md", b"# fixture\n")];
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        files.push(if name.ends_with(".safetensors") {
            FixtureFile::lfs(&name, path)
        } else {
            FixtureFile::small(&name, &std::fs::read(&path).unwrap())
        });
    }
    let n_files = files.len() - 1;
    hub.add("tandem-test/smollm2-hf", &["main"], SHA_HF, files);
    let cache = tempfile::tempdir().unwrap();
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-hf", None);
    assert_generated(&out);
    let snapshot = repo_cache(cache.path(), "tandem-test/smollm2-hf")
        .join("snapshots")
        .join(SHA_HF);
    let err = stderr(&out);
    assert!(
        err.contains(&format!("ready at {}", snapshot.display())),
        "{err}"
    );
    let mut cached: Vec<_> = std::fs::read_dir(&snapshot)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    cached.sort();
    assert_eq!(cached.len(), n_files, "{cached:?}");
    assert!(!cached.contains(&"README.md".to_string()));
    for name in &cached {
        assert_eq!(
            std::fs::read(snapshot.join(name)).unwrap(),
            std::fs::read(dir.join(name)).unwrap(),
            "{name}"
        );
    }
    hub.clear_log();
    assert_generated(&generate(
        &hub,
        cache.path(),
        "tandem-test/smollm2-hf",
        None,
    ));
    assert!(hub.log().is_empty());
}

#[test]
fn a_broken_download_resumes_with_a_range_request() {
    let hub = gguf_hub();
    let cache = tempfile::tempdir().unwrap();
    const CUT: u64 = 10 << 20;
    hub.set(|s| {
        s.drops = 1;
        s.drop_after = CUT;
    });
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf", None);
    assert_generated(&out);
    let cdn: Vec<_> = hub
        .file_requests()
        .into_iter()
        .filter(|l| l.port == hub.cdn_port)
        .collect();
    assert_eq!(cdn.len(), 2, "{cdn:?}");
    assert_eq!(cdn[0].range, None);
    assert_eq!(
        cdn[1].range.as_deref(),
        Some(format!("bytes={CUT}-").as_str())
    );
    let cached = repo_cache(cache.path(), "tandem-test/smollm2-gguf")
        .join("snapshots")
        .join(SHA_A)
        .join(GGUF_NAME);
    assert_eq!(sha256_file(&cached).unwrap(), sha256_of(&gguf_path()));
}

#[test]
fn a_download_broken_in_every_attempt_resumes_in_the_next_run() {
    let hub = gguf_hub();
    let cache = tempfile::tempdir().unwrap();
    const CUT: u64 = 4 << 20;
    hub.set(|s| {
        s.drops = 100;
        s.drop_after = CUT;
    });
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf", None);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("a later run resumes it"), "{err}");
    let cdn: Vec<_> = hub
        .file_requests()
        .into_iter()
        .filter(|l| l.port == hub.cdn_port)
        .collect();
    let attempts = cdn.len() as u64;
    assert!(attempts >= 2, "{cdn:?}");
    // Each attempt went on from where the last one broke.
    for (i, l) in cdn.iter().enumerate().skip(1) {
        assert_eq!(l.range, Some(format!("bytes={}-", i as u64 * CUT)));
    }
    let repo = repo_cache(cache.path(), "tandem-test/smollm2-gguf");
    assert!(!repo.join("snapshots").exists());
    assert!(!repo.join("refs").exists());

    hub.set(|s| s.drops = 0);
    hub.clear_log();
    assert_generated(&generate(
        &hub,
        cache.path(),
        "tandem-test/smollm2-gguf",
        None,
    ));
    let cdn: Vec<_> = hub
        .file_requests()
        .into_iter()
        .filter(|l| l.port == hub.cdn_port)
        .collect();
    assert_eq!(cdn.len(), 1, "{cdn:?}");
    assert_eq!(cdn[0].range, Some(format!("bytes={}-", attempts * CUT)));
    let cached = repo.join("snapshots").join(SHA_A).join(GGUF_NAME);
    assert_eq!(sha256_file(&cached).unwrap(), sha256_of(&gguf_path()));
}

#[test]
fn the_token_goes_to_the_hub_only_and_a_401_is_explained() {
    let hub = gguf_hub();
    hub.set(|s| s.token = Some("hf_fixture_secret".into()));
    let cache = tempfile::tempdir().unwrap();

    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf", None);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("HTTP 401") && err.contains("set HF_TOKEN"),
        "{err}"
    );
    let out = generate(
        &hub,
        cache.path(),
        "tandem-test/smollm2-gguf",
        Some("hf_wrong"),
    );
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("the hub refused HF_TOKEN"), "{err}");
    assert!(hub.file_requests().is_empty());

    hub.clear_log();
    let out = generate(
        &hub,
        cache.path(),
        "tandem-test/smollm2-gguf",
        Some("hf_fixture_secret"),
    );
    assert_generated(&out);
    let log = hub.log();
    assert_eq!(log.len(), 3, "{log:?}");
    for l in &log {
        if l.port == hub.cdn_port {
            // The CDN is another origin: the token stays home.
            assert_eq!(l.auth, None, "{l:?}");
        } else {
            assert_eq!(l.auth.as_deref(), Some("Bearer hf_fixture_secret"), "{l:?}");
        }
    }
    assert!(!stderr(&out).contains("hf_fixture_secret"));
}

#[test]
fn a_wrong_sha256_is_refused_and_nothing_is_cached() {
    let hub = gguf_hub();
    hub.set(|s| s.lie_about_sha = true);
    let cache = tempfile::tempdir().unwrap();
    let out = generate(&hub, cache.path(), "tandem-test/smollm2-gguf", None);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("checksum mismatch") && err.contains("nothing was cached"),
        "{err}"
    );
    let repo = repo_cache(cache.path(), "tandem-test/smollm2-gguf");
    assert!(!repo.join("snapshots").exists());
    assert!(!repo.join("refs").exists());
    assert!(!repo.join("manifests").exists());
    // Nor is the bad download kept to resume from.
    let partial = repo
        .join("incomplete")
        .join(SHA_A)
        .join(format!("{GGUF_NAME}.part"));
    assert!(!partial.exists());
}

#[test]
fn bad_repo_ids_and_unsafe_file_names_fail_before_any_file_request() {
    let hub = gguf_hub();
    let cache = tempfile::tempdir().unwrap();
    for bad in [
        "../etc/passwd",
        "tandem-test/..",
        "tandem-test//smollm2-gguf",
        "tandem-test/smollm2-gguf/extra",
        "tandem-test/smol lm",
        "tandem-test/smollm2-gguf@../../x",
        "tandem-test/smollm2-gguf@",
        "tandem-test/smollm2-gguf:Q4-K",
    ] {
        let out = generate(&hub, cache.path(), bad, None);
        let err = stderr(&out);
        assert!(!out.status.success(), "{bad}");
        assert!(err.contains("invalid Hugging Face repo id"), "{bad}: {err}");
    }
    assert!(hub.log().is_empty(), "{:?}", hub.log());
    assert!(!cache.path().join("hub").exists());

    // A listing that names a path outside the repo is refused whole.
    hub.add(
        "tandem-test/evil",
        &["main"],
        SHA_EVIL,
        vec![FixtureFile::lfs("../../../evil.gguf", gguf_path())],
    );
    let out = generate(&hub, cache.path(), "tandem-test/evil", None);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("unsafe file name"), "{err}");
    assert!(hub.file_requests().is_empty());
    assert!(!cache.path().join("evil.gguf").exists());

    // A missing repo is a 404, explained.
    let out = generate(&hub, cache.path(), "tandem-test/missing", None);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("HTTP 404 Not Found"), "{err}");
}

#[test]
fn concurrent_runs_fetch_once() {
    let hub = gguf_hub();
    let cache = tempfile::tempdir().unwrap();
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let (endpoint, cache) = (hub.endpoint(), cache.path().to_path_buf());
            std::thread::spawn(move || {
                generate_at(&endpoint, &cache, "tandem-test/smollm2-gguf", None)
            })
        })
        .collect();
    for r in runs {
        assert_generated(&r.join().unwrap());
    }
    // One fetched; the other waited for its lock, then found the model
    // cached (or came late and found it without waiting).
    assert_eq!(hub.file_requests().len(), 2, "{:?}", hub.file_requests());
}

#[test]
fn a_complete_part_from_an_earlier_run_is_checked_not_fetched_again() {
    let hub = gguf_hub();
    let cache = tempfile::tempdir().unwrap();
    let repo = repo_cache(cache.path(), "tandem-test/smollm2-gguf");
    // A run that downloaded everything but died before installing it.
    let partial = repo
        .join("incomplete")
        .join(SHA_A)
        .join(format!("{GGUF_NAME}.part"));
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::copy(gguf_path(), &partial).unwrap();
    let len = partial.metadata().unwrap().len();
    assert_generated(&generate(
        &hub,
        cache.path(),
        "tandem-test/smollm2-gguf",
        None,
    ));
    let cdn: Vec<_> = hub
        .file_requests()
        .into_iter()
        .filter(|l| l.port == hub.cdn_port)
        .collect();
    assert_eq!(cdn.len(), 1, "{cdn:?}");
    assert_eq!(cdn[0].range, Some(format!("bytes={len}-")));
    let cached = repo.join("snapshots").join(SHA_A).join(GGUF_NAME);
    assert_eq!(sha256_file(&cached).unwrap(), sha256_of(&gguf_path()));
    assert!(!partial.exists());
}
