//! Two routers side by side behind a real haproxy, one prefill and one
//! decode node behind them. A mixed load through the balancer reaches both
//! routers with exact greedy outputs; then one router is killed with
//! SIGKILL while streams run through both: only its streams fail (cleanly,
//! the connection ends), the survivor's streams finish, every request
//! started after the kill succeeds (haproxy retries and redispatches the
//! ones it still sends to the dead router before its health check notices),
//! and the killed router's requests free their KV blocks on both nodes.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_tests::cluster::{
    Node, Router, counting_prompt, expected, long_prompt, short_prompt, unique_cluster,
};
use tandem_tests::{
    client_builder, error_chain, free_port, http, metric, model, reference, request, sse_events,
    try_http,
};

const MAX_TOKENS: usize = 16;
/// Long enough that a stream is still decoding when its router is killed.
const STREAM_TOKENS: usize = 320;
/// Longest wait for a response head, a whole reply or one read of a
/// stream: a connection silent this long has hung.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// The client of the requests through the balancer: the harness's, with
/// `READ_TIMEOUT`.
fn client() -> &'static reqwest::blocking::Client {
    static CLIENT: OnceLock<reqwest::blocking::Client> = OnceLock::new();
    CLIENT.get_or_init(|| client_builder().timeout(READ_TIMEOUT).build().unwrap())
}

/// haproxy as a child process with its configuration and runtime socket in
/// a private directory; killed, and the directory removed, on drop.
struct Haproxy {
    child: Child,
    dir: PathBuf,
    port: u16,
    stderr: Arc<Mutex<String>>,
}

fn haproxy_binary() -> PathBuf {
    let mut candidates: Vec<PathBuf> = std::env::var_os("TANDEM_HAPROXY")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("haproxy")));
    }
    // Debian installs it outside a non-root user's PATH.
    candidates.push(PathBuf::from("/usr/sbin/haproxy"));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "haproxy is missing: install it with `apt-get install haproxy` \
                 (scripts/test.sh does), or point TANDEM_HAPROXY at the binary"
            )
        })
}

impl Haproxy {
    /// Balances over `routers` (named `router0`, `router1`, ...).
    fn start(routers: &[u16]) -> Haproxy {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tandem-haproxy-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let servers: String = routers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("    server router{i} 127.0.0.1:{p}\n"))
            .collect();
        // Retries: a request still sent to a dead router before the health
        // check marks it down fails to connect (or gets no answer) and is
        // replayed on the other one. Replaying is safe: a router that sent
        // nothing back has started nothing the client sees. Server-side
        // connections close after each response so that no idle connection
        // to a dead router is reused. Long client/server timeouts: streams
        // send nothing while a prompt is being computed.
        let config = format!(
            "global
    maxconn 512
    stats socket {sock} mode 600 level admin

defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    timeout http-request 10s
    timeout queue 10s
    timeout check 1s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response response-timeout
    option http-server-close

frontend openai
    bind 127.0.0.1:{port}
    default_backend routers

backend routers
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
    http-response set-header X-Served-By %[srv_name]
    default-server check inter 300ms fastinter 100ms downinter 300ms fall 2 rise 2
{servers}",
            sock = dir.join("admin.sock").display(),
        );
        let cfg = dir.join("haproxy.cfg");
        std::fs::write(&cfg, config).unwrap();
        let mut child = Command::new(haproxy_binary())
            .arg("-db")
            .arg("-f")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning haproxy: {e}"));
        let stderr = Arc::new(Mutex::new(String::new()));
        let log = Arc::clone(&stderr);
        let mut err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Haproxy {
            child,
            dir,
            port,
            stderr,
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("admin.sock")
    }

    /// `show stat` on the runtime socket: one map per proxy/server row.
    fn stats(&self) -> Option<Vec<HashMap<String, String>>> {
        let mut s = UnixStream::connect(self.socket()).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"show stat\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let mut lines = out.lines();
        let header: Vec<&str> = lines.next()?.strip_prefix("# ")?.split(',').collect();
        Some(
            lines
                .filter(|l| !l.is_empty())
                .map(|l| {
                    header
                        .iter()
                        .zip(l.split(','))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect()
                })
                .collect(),
        )
    }

    fn row(&self, proxy: &str, name: &str) -> HashMap<String, String> {
        let rows = self
            .stats()
            .unwrap_or_else(|| panic!("haproxy's runtime socket does not answer:\n{}", self.log()));
        rows.into_iter()
            .find(|r| r["pxname"] == proxy && r["svname"] == name)
            .unwrap_or_else(|| panic!("haproxy has no {proxy}/{name}"))
    }

    fn counter(&self, proxy: &str, name: &str, field: &str) -> u64 {
        self.row(proxy, name)[field].parse().unwrap_or(0)
    }

    /// Waits until haproxy's health checks have passed on every router.
    fn wait_up(&mut self, servers: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("haproxy exited ({status}):\n{}", self.log());
            }
            let up = self.stats().is_some_and(|rows| {
                rows.iter()
                    .filter(|r| r["pxname"] == "routers" && r["svname"].starts_with("router"))
                    .filter(|r| r["status"] == "UP" && r["check_status"] == "L7OK")
                    .count()
                    == servers
            });
            if up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "haproxy never saw {servers} routers up: {:?}\n{}",
                self.stats(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn is_down(&self, server: &str) -> bool {
        self.row("routers", server)["status"].starts_with("DOWN")
    }

    fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What a request asks for; its greedy reference is computed after the
/// load, so that the in-process model does not compete with the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Job {
    Completion(String, usize),
    ChatStream(String, usize),
}

impl Job {
    /// Request `i` of a mixed load: short and long prompts, plain
    /// completions and streamed chats.
    fn mixed(i: usize) -> Job {
        let prompt = if i.is_multiple_of(2) {
            short_prompt().to_string()
        } else {
            long_prompt(i)
        };
        if i % 4 < 2 {
            Job::Completion(prompt, MAX_TOKENS)
        } else {
            Job::ChatStream(prompt, MAX_TOKENS)
        }
    }

    fn request(&self) -> (&'static str, String) {
        match self {
            Job::Completion(p, n) => (
                "/v1/completions",
                json!({"prompt": p, "max_tokens": n, "temperature": 0}).to_string(),
            ),
            Job::ChatStream(p, n) => (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": p}],
                       "max_tokens": n, "temperature": 0, "stream": true})
                .to_string(),
            ),
        }
    }

    /// The generated text of a complete answer.
    fn text(&self, reply: &Reply) -> Result<String, String> {
        if reply.status != 200 {
            return Err(format!("status {}: {}", reply.status, reply.body));
        }
        match self {
            Job::Completion(..) => {
                let v: Value = serde_json::from_str(&reply.body)
                    .map_err(|e| format!("not JSON ({e}): {}", reply.body))?;
                v["choices"][0]["text"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("no text: {v}"))
            }
            Job::ChatStream(..) => stream_text(&reply.body, "/v1/chat/completions"),
        }
    }

    fn reference(&self) -> String {
        match self {
            Job::Completion(p, n) => expected(p, *n),
            Job::ChatStream(p, n) => {
                let m = model();
                let rendered = m
                    .text
                    .chat_template
                    .as_ref()
                    .unwrap()
                    .render(&[tandem_modelfile::chat::ChatMessage::new("user", p)], true)
                    .unwrap();
                reference(m.text.tokenizer.encode(&rendered, false).unwrap(), *n)
            }
        }
    }
}

/// The text of a finished SSE body (ends with `[DONE]`, no error event).
fn stream_text(body: &str, path: &str) -> Result<String, String> {
    let events = sse_events(body);
    if events.last().map(String::as_str) != Some("[DONE]") {
        return Err(format!("stream did not finish: {events:?}"));
    }
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).map_err(|err| format!("{err}: {e}"))?;
        if v.get("error").is_some() {
            return Err(format!("error event: {e}"));
        }
        let piece = if path == "/v1/completions" {
            &v["choices"][0]["text"]
        } else {
            &v["choices"][0]["delta"]["content"]
        };
        text.push_str(piece.as_str().unwrap_or(""));
    }
    Ok(text)
}

/// A whole response, as the client received it.
#[derive(Debug)]
struct Reply {
    status: u16,
    /// The router that answered (haproxy's `X-Served-By`).
    server: String,
    body: String,
}

/// A failed request as text; panics on a timeout (a hang, not a failure).
fn failure(e: &reqwest::Error) -> String {
    assert!(
        !e.is_timeout(),
        "a response hung for {READ_TIMEOUT:?}: {}",
        error_chain(e)
    );
    error_chain(e)
}

/// A failed read of a stream as text; panics on a timeout.
fn read_failure(e: &std::io::Error) -> String {
    match e.get_ref().and_then(|e| e.downcast_ref::<reqwest::Error>()) {
        Some(e) => failure(e),
        None => error_chain(e),
    }
}

/// One request on a fresh connection through the balancer; `Err` when the
/// connection failed, reset or the response was cut (a chunked body without
/// its last chunk).
fn send(port: u16, path: &str, body: &str) -> Result<Reply, String> {
    let r = try_http(client(), port, "POST", path, body, &[]).map_err(|e| failure(&e))?;
    Ok(Reply {
        status: r.status,
        server: r.header("x-served-by").to_string(),
        body: r.body,
    })
}

#[derive(Debug)]
struct Outcome {
    job: Job,
    started: Instant,
    result: Result<Reply, String>,
}

fn run(port: u16, job: Job) -> Outcome {
    let started = Instant::now();
    let (path, body) = job.request();
    let result = send(port, path, &body);
    Outcome {
        job,
        started,
        result,
    }
}

/// Checks every outcome against its greedy reference; returns the failures.
fn failures(outcomes: &[Outcome], refs: &mut HashMap<Job, String>) -> Vec<String> {
    outcomes
        .iter()
        .filter_map(|o| {
            let reply = match &o.result {
                Ok(r) => r,
                Err(e) => return Some(format!("{:?}: {e}", o.job)),
            };
            let text = match o.job.text(reply) {
                Ok(t) => t,
                Err(e) => return Some(format!("{:?} via {}: {e}", o.job, reply.server)),
            };
            let want = refs
                .entry(o.job.clone())
                .or_insert_with(|| o.job.reference());
            (text != *want)
                .then(|| format!("{:?} via {}: {text:?} != {want:?}", o.job, reply.server))
        })
        .collect()
}

/// A streamed completion through the balancer, read until its first token.
struct OpenStream {
    resp: reqwest::blocking::Response,
    raw: Vec<u8>,
    server: String,
    prompt: String,
}

fn open_stream(port: u16, prompt: String) -> OpenStream {
    let body = json!({"prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0,
                      "stream": true});
    let mut resp = request(client(), port, "POST", "/v1/completions", &body.to_string())
        .send()
        .unwrap_or_else(|e| panic!("opening a stream: {}", error_chain(&e)));
    assert_eq!(resp.status(), 200);
    let server = resp
        .headers()
        .get("x-served-by")
        .expect("haproxy names the router")
        .to_str()
        .unwrap()
        .to_string();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while sse_events(&String::from_utf8_lossy(&raw)).is_empty() {
        let n = resp.read(&mut buf).expect("reading a stream's first token");
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&raw)
        );
        raw.extend_from_slice(&buf[..n]);
    }
    OpenStream {
        resp,
        raw,
        server,
        prompt,
    }
}

impl OpenStream {
    /// Reads to the end: `Ok(text)` for a finished stream, `Err` for one
    /// whose connection ended or reset before `[DONE]`.
    fn finish(mut self) -> (String, String, Result<String, String>) {
        let result = match self.resp.read_to_end(&mut self.raw) {
            Ok(_) => stream_text(&String::from_utf8_lossy(&self.raw), "/v1/completions"),
            Err(e) => Err(read_failure(&e)),
        };
        (self.server, self.prompt, result)
    }
}

fn router_health(port: u16) -> Value {
    http(port, "GET", "/health", "").json()
}

fn ok_requests(port: u16) -> f64 {
    metric(
        &http(port, "GET", "/metrics", "").body,
        "tandem_requests_total",
        "status=\"ok\"",
    )
}

#[test]
fn two_routers_behind_haproxy_survive_a_killed_router() {
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("lb");
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d0", &[]);
    let mut routers = [
        Router::start(&etcd.url(), &cluster),
        Router::start(&etcd.url(), &cluster),
    ];
    for r in &routers {
        r.wait_members(1, 1, Duration::from_secs(10));
    }
    let mut lb = Haproxy::start(&[routers[0].port, routers[1].port]);
    lb.wait_up(2, Duration::from_secs(15));
    let mut refs = HashMap::new();

    // A mixed load through the balancer reaches both routers.
    let load: Vec<Outcome> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let port = lb.port;
                s.spawn(move || {
                    (0..4)
                        .map(|k| run(port, Job::mixed(t * 4 + k)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let failed = failures(&load, &mut refs);
    assert!(failed.is_empty(), "mixed load failed: {failed:#?}");
    let served = |name: &str, outcomes: &[Outcome]| {
        outcomes
            .iter()
            .filter(|o| o.result.as_ref().is_ok_and(|r| r.server == name))
            .count()
    };
    let per_router = [served("router0", &load), served("router1", &load)];
    let ok_before = [ok_requests(routers[0].port), ok_requests(routers[1].port)];
    assert!(
        per_router.iter().all(|&n| n > 0) && ok_before.iter().all(|&n| n > 0.0),
        "a router got no work: by header {per_router:?}, by metrics {ok_before:?}"
    );
    eprintln!("mixed load: {per_router:?} requests through router0/router1");

    // Streams through both routers, each confirmed decoding by its first
    // token and by the routers' own count of requests in flight.
    let streams: Vec<OpenStream> = (0..4)
        .map(|i| open_stream(lb.port, counting_prompt(i)))
        .collect();
    let on = |name: &str| streams.iter().filter(|s| s.server == name).count();
    let (on_killed, on_survivor) = (on("router0"), on("router1"));
    assert!(
        on_killed > 0 && on_survivor > 0,
        "streams not spread over both routers: {on_killed}/{on_survivor}"
    );
    for (r, n) in routers.iter().zip([on_killed, on_survivor]) {
        let h = router_health(r.port);
        assert!(h["requests_in_flight"].as_u64().unwrap() >= n as u64, "{h}");
    }

    let (ended, burst, down_after) = std::thread::scope(|s| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|st| s.spawn(move || st.finish()))
            .collect();
        routers[0].proc.kill9();
        let killed_at = Instant::now();
        // Requests right after the kill: the first ones surely reach haproxy
        // before its health check has failed twice.
        let port = lb.port;
        let senders: Vec<_> = (0..8)
            .map(|t| {
                s.spawn(move || {
                    (0..3)
                        .map(|k| run(port, Job::mixed(t * 3 + k + 1)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let lb = &lb;
        let watcher = s.spawn(move || {
            let deadline = killed_at + Duration::from_secs(10);
            while !lb.is_down("router0") {
                assert!(
                    Instant::now() < deadline,
                    "haproxy never marked the killed router down"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            killed_at.elapsed()
        });
        let burst: Vec<Outcome> = senders
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        let ended: Vec<_> = readers.into_iter().map(|h| h.join().unwrap()).collect();
        let down_after = watcher.join().unwrap();
        let burst_started: Vec<Duration> = burst
            .iter()
            .map(|o| o.started.duration_since(killed_at))
            .collect();
        (ended, (burst, burst_started), down_after)
    });
    let (burst, burst_started) = burst;

    // Streams on the killed router ended (not hung) without [DONE]; those on
    // the survivor finished with the greedy text.
    let mut cut = Vec::new();
    for (server, prompt, result) in &ended {
        if server == "router0" {
            match result {
                Err(e) => cut.push(e.clone()),
                Ok(_) => panic!("a stream on the killed router finished"),
            }
        } else {
            let text = result
                .as_ref()
                .unwrap_or_else(|e| panic!("a stream on the surviving router failed: {e}"));
            assert_eq!(*text, expected(prompt, STREAM_TOKENS));
        }
    }

    // Every request started after the kill succeeded, on the survivor.
    let failed = failures(&burst, &mut refs);
    let before_down = burst_started.iter().filter(|t| **t < down_after).count();
    let redispatched = lb.counter("routers", "BACKEND", "wredis");
    let retried = lb.counter("routers", "BACKEND", "wretr");
    eprintln!(
        "kill: {} stream(s) cut ({cut:?}), {on_survivor} finished on the survivor; {} requests after the \
         kill, {} failed, {before_down} sent before haproxy marked router0 down after {down_after:?}; \
         haproxy retried {retried}, redispatched {redispatched}",
        cut.len(),
        burst.len(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "requests after the kill failed: {failed:#?}"
    );
    assert_eq!(cut.len(), on_killed);
    assert_eq!(
        served("router1", &burst),
        burst.len(),
        "not every request after the kill was answered by the surviving router"
    );
    assert!(
        before_down > 0 && redispatched > 0,
        "no request raced haproxy's health check, so retries were not exercised \
         ({before_down} sent before the router was marked down, {redispatched} redispatched)"
    );
    assert!(
        ok_requests(routers[1].port) >= ok_before[1] + (burst.len() + on_survivor) as f64,
        "the survivor's metrics miss requests"
    );

    // The killed router's requests are gone from both nodes: the decode
    // node saw its gRPC stream break and freed the KV blocks.
    p.assert_idle();
    d.assert_idle();
}
