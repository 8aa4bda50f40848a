//! Harness of the end-to-end tests: the release binary as child processes,
//! an HTTP client (blocking reqwest, server-sent events parsed by
//! eventsource-stream; a raw socket only for clients that must misbehave),
//! and greedy references from the engine in this process.

#![allow(clippy::unwrap_used)]

pub mod cluster;

use std::convert::Infallible;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures_util::{FutureExt, StreamExt};
use reqwest::Method;
use reqwest::blocking::{Client, ClientBuilder, RequestBuilder};
use reqwest::header::{CONNECTION, CONTENT_TYPE, HeaderMap, HeaderValue};
use serde_json::Value;
use tandem_engine::LoadedModel;
use tandem_engine::generate::{GenerateOutput, GenerateRequest, generate};
use tandem_engine::moe::Combine;
use tandem_engine::sampler::{Sampled, SamplingParams};
use tandem_engine::scheduler::{Scheduler, SchedulerConfig};
use tandem_types::{FinishReason, GenEvent, GenerationRequest};

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
    shared_model()
}

/// [`model`], shareable with a scheduler ([`reference_outputs`]).
fn shared_model() -> &'static Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    MODEL.get_or_init(|| {
        Arc::new(tandem_engine::load(&gguf_path()).expect("loading the test model"))
    })
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
    reference_output_of(model(), prompt, sampling, max_tokens)
}

/// [`reference_output`] of model `m`.
pub fn reference_output_of(
    m: &LoadedModel,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
) -> GenerateOutput {
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

/// One sequence of [`reference_outputs`]: what [`reference_output`]
/// gives for it, less the timings and the prompt's logits.
#[derive(Debug, Clone)]
pub struct Reference {
    pub tokens: Vec<u32>,
    pub sampled: Vec<Sampled>,
    pub text: String,
    pub finish: FinishReason,
}

/// [`reference_output`] of each of `requests` (a prompt and its sampling),
/// generated together: a scheduler in this process runs them as one
/// batch, so each decode step reads the weights once for all of them.
/// Each output is the one generated alone: a sequence's logits are
/// bitwise identical alone or in any batch (ARCHITECTURE.md, "Batch
/// invariance"), the scheduler samples each row with the `Sampler` that
/// `generate` uses (seeded draws and penalties included), stops on the
/// same stop tokens, and the text is decoded as `generate` decodes it.
pub fn reference_outputs(
    requests: &[(Vec<u32>, SamplingParams)],
    max_tokens: usize,
) -> Vec<Reference> {
    if requests.is_empty() {
        return Vec::new();
    }
    let m = shared_model();
    let block_size = 16;
    let prompt_tokens: usize = requests.iter().map(|(p, _)| p.len()).sum();
    let longest = requests.iter().map(|(p, _)| p.len()).max().unwrap_or(0) + max_tokens;
    let config = SchedulerConfig {
        max_batch_size: requests.len(),
        // Every prompt in the first step.
        max_batch_input_tokens: prompt_tokens.max(requests.len()),
        max_length: longest,
        block_size,
        num_blocks: requests
            .iter()
            .map(|(p, _)| (p.len() + max_tokens).div_ceil(block_size))
            .sum(),
        prefix_caching: false,
        tp: 1,
        moe_combine: Combine::AllReduce,
        kv_tiers: None,
    };
    let sched = Scheduler::spawn(Arc::clone(m) as _, config).unwrap();
    let streams: Vec<_> = requests
        .iter()
        .map(|(prompt, sampling)| {
            let req = GenerationRequest {
                prompt: prompt.clone(),
                sampling: sampling.clone(),
                max_tokens,
                stop_token_ids: m.text.tokenizer.stop_ids(),
                constraint: None,
            };
            sched.handle().generate(req).unwrap()
        })
        .collect();
    let outs = streams
        .into_iter()
        .map(|mut stream| {
            let mut sampled = Vec::new();
            let finish = loop {
                match stream.blocking_next() {
                    Some(GenEvent::Token(s)) => sampled.push(s),
                    Some(GenEvent::Finished(usage)) => break usage.finish,
                    other => panic!("reference generation did not finish: {other:?}"),
                }
            };
            reference_of(m, sampled, finish)
        })
        .collect();
    sched.shutdown();
    outs
}

/// The [`Reference`] of `sampled` tokens that ended with `finish`, its
/// text decoded as `generate` decodes it (no stop strings): each token's
/// piece as it completes, and what is left only when the length ran out.
fn reference_of(m: &LoadedModel, sampled: Vec<Sampled>, finish: FinishReason) -> Reference {
    let tokens: Vec<u32> = sampled.iter().map(|s| s.token).collect();
    let mut decoder = m.text.tokenizer.stream_decoder(true);
    let mut text = String::new();
    for &t in &tokens {
        text.push_str(&decoder.push(t).unwrap());
    }
    if finish == FinishReason::Length {
        text.push_str(&decoder.finish());
    }
    Reference {
        tokens,
        sampled,
        text,
        finish,
    }
}

/// Largest logprob gap at which a GPU run may pick another greedy token
/// than the CPU engine: the two round differently (the CPU quantises
/// activations to int8, the GPU keeps f32; gpu/tests/llama.rs measured one
/// parting, at a gap of 0.22).
pub const GPU_NEAR_TIE: f64 = 0.5;

/// Checks a greedy completion `v` of `prompt` (asked with `"logprobs": 5`)
/// against the CPU engine's: the same tokens and text, or, where the two
/// part, the CPU's token is the run's runner-up within [`GPU_NEAR_TIE`].
/// Returns where they parted, if they did.
pub fn assert_greedy_up_to_near_ties(prompt: &str, max_tokens: usize, v: &Value) -> Option<usize> {
    assert_greedy_up_to_near_ties_of(model(), prompt, max_tokens, v)
}

/// [`assert_greedy_up_to_near_ties`] against model `m`.
pub fn assert_greedy_up_to_near_ties_of(
    m: &LoadedModel,
    prompt: &str,
    max_tokens: usize,
    v: &Value,
) -> Option<usize> {
    let tok = &m.text.tokenizer;
    let piece =
        |id: u32| String::from_utf8_lossy(&tok.token_to_piece_bytes(id).unwrap()).into_owned();
    let with_lp = SamplingParams {
        logprobs: true,
        top_logprobs: 5,
        ..SamplingParams::greedy()
    };
    let want = reference_output_of(m, tok.encode(prompt, true).unwrap(), with_lp, max_tokens);
    let lp = &v["choices"][0]["logprobs"];
    let got: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs: {v}"))
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let cpu: Vec<String> = want.sampled.iter().map(|s| piece(s.token)).collect();
    match got.iter().zip(&cpu).position(|(g, c)| g != c) {
        None => {
            assert_eq!(got.len(), cpu.len(), "{prompt:?}: {v}");
            assert_eq!(v["choices"][0]["text"], want.text.as_str(), "{prompt:?}");
            None
        }
        Some(i) => {
            let chosen = lp["token_logprobs"][i].as_f64().unwrap();
            let cpu_lp = lp["top_logprobs"][i][cpu[i].as_str()].as_f64();
            let gap = cpu_lp.map(|l| chosen - l);
            assert!(
                gap.is_some_and(|g| g <= GPU_NEAR_TIE),
                "{prompt:?}: token {i}: the run chose {:?}, the CPU {:?} (gap {gap:?}): {v}",
                got[i],
                cpu[i]
            );
            Some(i)
        }
    }
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
        cmd.args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::spawn_command(name, cmd)
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

/// Starts `tandem serve` on the test model, on 127.0.0.1 and a free port,
/// with `extra` flags; returns the process and its port once it serves.
pub fn start_serve(extra: &[&str]) -> (Proc, u16) {
    let gguf = gguf_path();
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--model".into(),
        gguf.to_string_lossy().into_owned(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        "0".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut proc = Proc::spawn("tandem serve", &args, &[]);
    let line = proc.wait_line("tandem: serving ", Duration::from_secs(120));
    let port = ports_in(&line)[0];
    (proc, port)
}

/// The ports in a line such as `... http://127.0.0.1:P ... http://127.0.0.1:Q`.
pub fn ports_in(line: &str) -> Vec<u16> {
    line.split("://")
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

/// The settings of every HTTP client of the tests: HTTP/1.1, a fresh
/// connection per request (`Connection: close`, nothing pooled), no proxy,
/// no redirect followed, so what a test sees is what the server sent.
/// `timeout` on the builder bounds the wait for the response head and,
/// apart, the reading of the body (as a whole by `bytes`, each read by
/// `Read::read`).
pub fn client_builder() -> ClientBuilder {
    let mut headers = HeaderMap::new();
    headers.insert(CONNECTION, HeaderValue::from_static("close"));
    Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(0)
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
}

/// The client of `http`: 300 s at most for a response head, and for a body.
pub fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        client_builder()
            .timeout(Duration::from_secs(300))
            .build()
            .unwrap()
    })
}

/// A whole response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }

    /// The `data` of each event of an SSE body.
    pub fn events(&self) -> Vec<String> {
        sse_events(&self.body)
    }

    /// A response header ("" when absent or not text).
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// `error.message` of an OpenAI error body.
    pub fn error_message(&self) -> String {
        self.json()["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message: {}", self.body))
            .to_string()
    }
}

/// The `data` of each event of a server-sent-events body, in order (an event
/// not ended by a blank line is incomplete and left out, as the SSE spec
/// says).
pub fn sse_events(body: &str) -> Vec<String> {
    let chunks = futures_util::stream::iter([Ok::<_, Infallible>(body.as_bytes())]);
    chunks
        .eventsource()
        .map(|e| {
            e.unwrap_or_else(|e| panic!("not an event stream ({e}): {body}"))
                .data
        })
        .collect::<Vec<String>>()
        .now_or_never()
        .expect("an in-memory stream is always ready")
}

/// An error and its causes, on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// One request to `127.0.0.1:port` (`Content-Type: application/json`) on a
/// fresh connection, its whole body read; panics when no whole response
/// came.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> Resp {
    http_with(port, method, path, body, &[])
}

/// [`http`] of every one of `bodies` at once, from threads of their own
/// (a server batches requests that arrive together): the responses in
/// the order of `bodies`.
pub fn http_all(port: u16, method: &str, path: &str, bodies: &[String]) -> Vec<Resp> {
    std::thread::scope(|s| {
        let calls: Vec<_> = bodies
            .iter()
            .map(|body| s.spawn(move || http(port, method, path, body)))
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    })
}

/// `http` with extra request headers.
pub fn http_with(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Resp {
    try_http(client(), port, method, path, body, headers)
        .unwrap_or_else(|e| panic!("{method} {path} on port {port}: {}", error_chain(&e)))
}

/// `http_with` with the given client; `Err` when the request failed, timed
/// out or its body was cut short (a chunked body without its last chunk).
pub fn try_http(
    client: &Client,
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Result<Resp, reqwest::Error> {
    let mut req = request(client, port, method, path, body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send()?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.bytes()?;
    let body = String::from_utf8(body.to_vec())
        .unwrap_or_else(|e| panic!("a body that is not UTF-8 ({e}): {body:?}"));
    Ok(Resp {
        status,
        headers,
        body,
    })
}

/// The request `http` sends, with `client`, to be sent and read by the
/// caller (e.g. a stream read piece by piece).
pub fn request(client: &Client, port: u16, method: &str, path: &str, body: &str) -> RequestBuilder {
    let method = Method::from_bytes(method.as_bytes()).unwrap();
    client
        .request(method, format!("http://127.0.0.1:{port}{path}"))
        .header(CONTENT_TYPE, "application/json")
        .body(body.to_string())
}

/// A raw TCP connection to `127.0.0.1:port` with one request written on it,
/// for the few tests that need a client no HTTP library models: one that
/// hangs up mid-response, where the test times the server's reaction from
/// the moment the socket is dropped. Reads time out after 120 s.
pub fn raw_request(port: u16, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
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

/// The chaos suite's harness: namespaces, fault proxy, load generator.
pub mod chaos;

impl Proc {
    /// A child process from `cmd` (e.g. `ip netns exec NS tandem ...`:
    /// `ip` execs the program, so the pid is the program's), with the same
    /// stdout/stderr capture and log level as [`Proc::spawn`].
    pub fn spawn_command(name: &str, mut cmd: Command) -> Proc {
        // A level the caller chose stays.
        if !cmd.get_envs().any(|(k, _)| k == "TANDEM_LOG") {
            cmd.env("TANDEM_LOG", "warn");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
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
}

/// The workspace root (the tests' Python scripts live under it).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// The client venv's python (the pinned client libraries and schemathesis):
/// `TANDEM_CLIENTS_PYTHON`, else the default cache location.
pub fn clients_python() -> PathBuf {
    let path = tandem_testkit::cached_path("TANDEM_CLIENTS_PYTHON", "clients-venv/bin/python");
    assert!(
        path.exists(),
        "{} is missing: run scripts/clients-venv.sh (scripts/test.sh does) or set \
         TANDEM_CLIENTS_PYTHON to a python with tests/clients/requirements.txt installed",
        path.display()
    );
    path
}
