//! Harness of the end-to-end tests: the release binary as child processes,
//! a tiny HTTP/1.1 client (no dependencies, so what is tested is the
//! server), and greedy references from the engine in this process.

#![allow(clippy::unwrap_used)]

pub mod cluster;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_engine::LoadedModel;
use tandem_engine::generate::{GenerateOutput, GenerateRequest, generate};
use tandem_engine::sampler::SamplingParams;

pub fn gguf_path() -> PathBuf {
    match std::env::var_os("TANDEM_TEST_GGUF") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "TANDEM_TEST_GGUF is not set: point it at SmolLM2-135M-Instruct.Q4_1.gguf (scripts/test.sh does)"
        ),
    }
}

/// The release `tandem` binary, checked to be built from the same sources
/// as these tests: `cargo test` does not rebuild another package's binary,
/// and a stale one would test old code.
pub fn binary() -> PathBuf {
    static CHECKED: OnceLock<PathBuf> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let bin = find_binary();
            let out = Command::new(&bin)
                .arg("--version")
                .output()
                .unwrap_or_else(|e| panic!("running {} --version: {e}", bin.display()));
            let version = String::from_utf8_lossy(&out.stdout);
            let want = env!("TANDEM_SOURCE_HASH");
            assert!(
                version.contains(&format!("(source {want})")),
                "{} is stale: it says {:?}, these tests expect sources {want}; rebuild it with \
                 `cargo build --release -p tandem-cli` (scripts/test.sh does)",
                bin.display(),
                version.trim()
            );
            bin
        })
        .clone()
}

fn find_binary() -> PathBuf {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("TANDEM_BIN") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        candidates.push(PathBuf::from(d).join("release").join("tandem"));
    }
    candidates.push(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("target")
            .join("release")
            .join("tandem"),
    );
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "the release binary is missing (looked at {candidates:?}); build it first with \
                 `cargo build --release -p tandem-cli` (scripts/test.sh does)"
            )
        })
}

/// The model in this process, for reference outputs.
pub fn model() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| tandem_engine::load(&gguf_path()).expect("loading the test model"))
}

/// Greedy reference text of the engine's single-sequence generator.
pub fn reference(prompt: Vec<u32>, max_tokens: usize) -> String {
    reference_output(prompt, SamplingParams::greedy(), max_tokens).text
}

/// What the engine's single-sequence generator produces for `prompt` with
/// `sampling` (seeded draws and penalties included): the reference a
/// server's output must equal, since batching never changes logits and a
/// seeded sampler draws the same numbers in either place.
pub fn reference_output(
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
) -> GenerateOutput {
    let m = model();
    let req = GenerateRequest {
        prompt,
        sampling,
        max_tokens,
        stop_token_ids: m.text.tokenizer.stop_ids(),
        stop_strings: Vec::new(),
        prefill_chunk: 512,
    };
    generate(m, &req, |_| {}).unwrap()
}

/// A child process whose stdout lines can be awaited; killed on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
    lines: Mutex<mpsc::Receiver<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    pub fn spawn(name: &str, args: &[String], env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(binary());
        cmd.args(args)
            .env("TANDEM_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let log = Arc::clone(&stderr);
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                log.lock().unwrap().push_str(&format!("{line}\n"));
            }
        });
        Proc {
            name: name.to_string(),
            child,
            lines: Mutex::new(lines),
            stderr,
        }
    }

    /// Waits for a stdout line containing `marker` and returns it.
    pub fn wait_line(&mut self, marker: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = self.lines.lock().unwrap().recv_timeout(left);
            match next {
                Ok(line) if line.contains(marker) => return line,
                Ok(_) => {}
                Err(_) => panic!(
                    "{} printed no line with {marker:?} (status {:?}); stderr:\n{}",
                    self.name,
                    self.child.try_wait(),
                    self.stderr()
                ),
            }
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// SIGKILL: how a crash looks.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A loopback port free right now (for servers that need a port number
/// before they start, e.g. from a config file).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The ports in a line such as `... http://127.0.0.1:P ... http://127.0.0.1:Q`.
pub fn ports_in(line: &str) -> Vec<u16> {
    line.split("http://")
        .skip(1)
        .filter_map(|s| {
            let hostport = s.split_whitespace().next()?;
            hostport
                .rsplit(':')
                .next()?
                .trim_end_matches(')')
                .parse()
                .ok()
        })
        .collect()
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }

    /// The `data:` payloads of an SSE body.
    pub fn events(&self) -> Vec<String> {
        sse_events(&self.body)
    }

    /// `error.message` of an OpenAI error body.
    pub fn error_message(&self) -> String {
        self.json()["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message: {}", self.body))
            .to_string()
    }
}

pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_string))
        .collect()
}

pub fn request_bytes(method: &str, path: &str, body: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One request on a fresh connection; reads to EOF.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> Resp {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    s.write_all(request_bytes(method, path, body).as_bytes())
        .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let headers = head.to_ascii_lowercase();
    let body = if headers.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Resp {
        status,
        headers,
        body,
    }
}

pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let Some((size, rest)) = s.split_once("\r\n") else {
            return out;
        };
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            return out;
        };
        if n == 0 || rest.len() < n {
            out.push_str(&rest[..n.min(rest.len())]);
            return out;
        }
        out.push_str(&rest[..n]);
        s = rest.get(n + 2..).unwrap_or("");
    }
}

/// The value of a Prometheus sample `name{labels}` (summed over matching
/// lines), 0 if absent.
pub fn metric(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            let (key, _) = l.rsplit_once(' ').unwrap_or(("", ""));
            key.starts_with(name)
                && (key.len() == name.len() || key[name.len()..].starts_with('{'))
                && labels
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .all(|lab| key.contains(lab))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}
