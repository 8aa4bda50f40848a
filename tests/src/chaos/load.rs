//! A steady mixed load: client threads issuing greedy completions and chats,
//! streaming and not, short prompts (prefilled on the decode node) and long
//! ones (prefilled remotely), some clients hanging up at random points and,
//! when asked, some reading their streams slowly (one token per
//! [`Knobs::slow_token_ms`]). Every request has a hard deadline; each ends
//! classified:
//!
//! - `Correct`: the whole greedy output equals the engine's reference;
//! - `Clean`: an HTTP error status, or an error event in a stream, in
//!   OpenAI's JSON error shape (`code`, or `type` when there is no code),
//!   with whatever text came before it a prefix of the reference;
//! - `Transport`: the connection was refused, reset or cut without an
//!   error (only acceptable while the router itself is down);
//! - `Wrong`: output that differs from the reference, or a malformed
//!   answer: never acceptable;
//! - `Hung`: no end within the deadline: never acceptable;
//! - `Aborted`: the client hung up on purpose.
//!
//! The client is a raw socket (HTTP/1.1, `Connection: close`) so that a
//! disconnect is exactly a dropped socket and the deadline covers
//! everything from connect to the last byte.
//!
//! Tests wait on the load's progress, not the clock: [`Load::wait_until`]
//! wakes on every request that ends. The load can be paused (clients finish
//! what they sent and wait), and a [`Probe`] runs one long stream of the
//! test's own, to find the node serving it.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_types::SeededRng;

use crate::cluster::{counting_prompt, long_prompt};
use crate::{model, reference, sse_events};

/// A prompt of the load with its greedy reference.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// Sent as a chat message (else as a completion prompt).
    pub chat: bool,
    pub text: String,
    /// Over the decode node's local-prefill threshold.
    pub long: bool,
    pub reference: String,
}

/// The prompts of a load and their references, computed once.
#[derive(Debug)]
pub struct Catalog {
    pub prompts: Vec<Prompt>,
    pub max_tokens: usize,
    /// A completion the model continues for [`PROBE_TOKENS`] tokens (no
    /// early stop), for [`Probe`]s.
    pub probe: Prompt,
}

/// Tokens of a [`Probe`]'s stream: long enough to be found running and
/// frozen mid-stream.
pub const PROBE_TOKENS: usize = 64;

impl Catalog {
    /// `long` distinct long completion prompts (distinct from their first
    /// block, so that with a small KV cache most miss every prefix cache
    /// and are prefilled remotely) and `short` short prompts, each both as
    /// a completion and as a chat.
    pub fn build(long: usize, short: usize, max_tokens: usize) -> Catalog {
        let m = model();
        let tok = &m.text.tokenizer;
        let shorts = [
            "The capital of France is",
            "Water boils at",
            "My favourite colour is",
            "The quick brown fox",
            "In the beginning",
            "Two plus two equals",
            "The best way to learn is",
            "Once upon a time",
        ];
        let mut prompts = Vec::new();
        for i in 0..long {
            let text = format!("Story {i}: {}", long_prompt(i));
            let ids = tok.encode(&text, true).unwrap();
            prompts.push(Prompt {
                chat: false,
                long: true,
                reference: reference(ids, max_tokens),
                text,
            });
        }
        for text in shorts.iter().cycle().take(short) {
            let ids = tok.encode(text, true).unwrap();
            prompts.push(Prompt {
                chat: false,
                long: false,
                reference: reference(ids, max_tokens),
                text: text.to_string(),
            });
            let rendered = m
                .text
                .chat_template
                .as_ref()
                .unwrap()
                .render(
                    &[tandem_modelfile::chat::ChatMessage::new("user", *text)],
                    true,
                )
                .unwrap();
            let ids = tok.encode(&rendered, false).unwrap();
            prompts.push(Prompt {
                chat: true,
                long: false,
                reference: reference(ids, max_tokens),
                text: text.to_string(),
            });
        }
        let text = counting_prompt(0);
        let probe = Prompt {
            chat: false,
            long: false,
            reference: reference(tok.encode(&text, true).unwrap(), PROBE_TOKENS),
            text,
        };
        Catalog {
            prompts,
            max_tokens,
            probe,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Correct,
    /// `status/code` (e.g. `503/unavailable`, `200+event/unavailable`).
    Clean(String),
    Transport(String),
    Wrong(String),
    Hung,
    Aborted,
}

#[derive(Debug, Clone)]
pub struct Record {
    pub start: Instant,
    pub end: Instant,
    pub outcome: Outcome,
    pub stream: bool,
    pub long: bool,
    /// Read by a slow client.
    pub slow: bool,
    /// When the first event of a stream arrived (whatever the outcome).
    pub first_event: Option<Instant>,
    /// Time to the first token (streams that got one).
    pub ttft: Option<Duration>,
    /// Mean time per output token after the first (streams).
    pub tpot: Option<Duration>,
}

impl Record {
    /// Neither correct nor hung up on purpose.
    pub fn failed(&self) -> bool {
        !matches!(self.outcome, Outcome::Correct | Outcome::Aborted)
    }
}

/// How the load behaves; switchable while it runs.
#[derive(Debug)]
pub struct Knobs {
    /// Clients `0..slow` read streams at one token per `slow_token_ms`.
    pub slow: AtomicUsize,
    pub slow_token_ms: AtomicU64,
    /// Per mille of requests whose client hangs up at a random point.
    pub disconnect_per_mille: AtomicU64,
}

#[derive(Debug, Clone)]
pub struct LoadConfig {
    pub clients: usize,
    pub deadline: Duration,
    pub seed: u64,
    pub disconnect_per_mille: u64,
}

/// What the clients share with the test: every record, the requests in
/// flight, whether new ones may start; `changed` wakes waiters on each.
#[derive(Debug, Default)]
struct Progress {
    records: Vec<Record>,
    in_flight: usize,
    paused: bool,
}

#[derive(Debug, Default)]
struct Shared {
    progress: Mutex<Progress>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until new requests may start; false once the load stops.
    fn begin(&self, stop: &AtomicBool) -> bool {
        let mut p = self.lock();
        while p.paused && !stop.load(Ordering::Relaxed) {
            p = self.changed.wait(p).unwrap_or_else(PoisonError::into_inner);
        }
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        p.in_flight += 1;
        true
    }

    fn end(&self, r: Record) {
        let mut p = self.lock();
        p.in_flight -= 1;
        p.records.push(r);
        drop(p);
        self.changed.notify_all();
    }
}

/// Running client threads; `stop` ends them and returns every record.
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    pub knobs: Arc<Knobs>,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    pub fn start(target: SocketAddr, catalog: Arc<Catalog>, cfg: &LoadConfig) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let knobs = Arc::new(Knobs {
            slow: AtomicUsize::new(0),
            slow_token_ms: AtomicU64::new(1000),
            disconnect_per_mille: AtomicU64::new(cfg.disconnect_per_mille),
        });
        let shared = Arc::new(Shared::default());
        let threads = (0..cfg.clients)
            .map(|i| {
                let (stop, knobs, shared, catalog) = (
                    Arc::clone(&stop),
                    Arc::clone(&knobs),
                    Arc::clone(&shared),
                    Arc::clone(&catalog),
                );
                let deadline = cfg.deadline;
                let seed = cfg.seed.wrapping_mul(1000).wrapping_add(i as u64);
                std::thread::spawn(move || {
                    let mut rng = SeededRng::new(seed);
                    while shared.begin(&stop) {
                        let slow = (i < knobs.slow.load(Ordering::Relaxed)).then(|| {
                            Duration::from_millis(knobs.slow_token_ms.load(Ordering::Relaxed))
                        });
                        let cut = rng.below(1000)
                            < knobs.disconnect_per_mille.load(Ordering::Relaxed) as usize;
                        let r = one_request(target, &catalog, &mut rng, deadline, slow, cut);
                        let failed = r.failed();
                        shared.end(r);
                        if failed {
                            // A failing cluster is not hammered in a tight loop.
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            knobs,
            shared,
            threads,
        }
    }

    /// The records so far.
    pub fn records(&self) -> Vec<Record> {
        self.shared.lock().records.clone()
    }

    /// Waits until `done(records, requests in flight)` holds, re-checked
    /// each time a request ends; false if `deadline` passed first.
    pub fn wait_until(
        &self,
        deadline: Instant,
        mut done: impl FnMut(&[Record], usize) -> bool,
    ) -> bool {
        let mut p = self.shared.lock();
        loop {
            if done(&p.records, p.in_flight) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            p = self
                .shared
                .changed
                .wait_timeout(p, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Clients finish the request they are in and start no new one until
    /// [`Load::resume`]; waits (up to `deadline`) until none is in flight.
    pub fn pause(&self, deadline: Instant) -> bool {
        self.shared.lock().paused = true;
        self.wait_until(deadline, |_, in_flight| in_flight == 0)
    }

    pub fn resume(&self) {
        self.shared.lock().paused = false;
        self.shared.changed.notify_all();
    }

    /// Stops issuing requests, waits for those in flight (each bounded by
    /// its deadline) and returns every record.
    pub fn stop(mut self) -> Vec<Record> {
        self.halt();
        for t in self.threads.drain(..) {
            t.join().expect("a load client panicked");
        }
        self.records()
    }

    fn halt(&self) {
        self.stop.store(true, Ordering::Relaxed);
        // Paused clients wake up to see it.
        let _guard = self.shared.lock();
        self.shared.changed.notify_all();
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.halt();
    }
}

/// One streamed completion of the catalog's probe prompt, on a thread of
/// its own: a test starts it on an otherwise idle cluster, waits for its
/// first event and then knows the one node that is running a stream.
#[derive(Debug)]
pub struct Probe {
    first_event: Arc<OnceLock<Instant>>,
    thread: JoinHandle<Record>,
}

impl Probe {
    pub fn start(target: SocketAddr, catalog: &Catalog, deadline: Duration) -> Probe {
        let p = catalog.probe.clone();
        let first_event = Arc::new(OnceLock::new());
        let seen = Arc::clone(&first_event);
        let thread = std::thread::spawn(move || {
            let body = json!({"prompt": p.text, "max_tokens": PROBE_TOKENS, "temperature": 0,
                              "stream": true});
            let start = Instant::now();
            let ex = exchange(
                target,
                "/v1/completions",
                &body.to_string(),
                start + deadline,
                None,
                None,
                Some(&seen),
            );
            record_of(ex, start, &p, true, false)
        });
        Probe {
            first_event,
            thread,
        }
    }

    /// When its first event arrived, if it has.
    pub fn first_event(&self) -> Option<Instant> {
        self.first_event.get().copied()
    }

    /// Whether the stream has ended.
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Waits for the stream's end (bounded by its deadline).
    pub fn finish(self) -> Record {
        self.thread.join().expect("the probe panicked")
    }
}

/// Where a client that hangs up on purpose does so.
#[derive(Debug, Clone, Copy)]
enum Cut {
    BeforeHead,
    AfterHead,
    AfterBytes(usize),
}

fn one_request(
    target: SocketAddr,
    catalog: &Catalog,
    rng: &mut SeededRng,
    deadline: Duration,
    slow: Option<Duration>,
    cut: bool,
) -> Record {
    let p = &catalog.prompts[rng.below(catalog.prompts.len())];
    let stream = slow.is_some() || rng.below(2) == 0;
    let cut = cut.then(|| match rng.below(3) {
        0 => Cut::BeforeHead,
        1 => Cut::AfterHead,
        _ => Cut::AfterBytes(rng.range(50, 1500)),
    });
    let (path, body) = if p.chat {
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": p.text}],
                   "max_tokens": catalog.max_tokens, "temperature": 0, "stream": stream}),
        )
    } else {
        (
            "/v1/completions",
            json!({"prompt": p.text, "max_tokens": catalog.max_tokens, "temperature": 0,
                   "stream": stream}),
        )
    };
    // Slow readers take their time per token on top.
    let deadline = match slow {
        Some(per_token) => deadline + per_token * (catalog.max_tokens as u32 + 2),
        None => deadline,
    };
    let start = Instant::now();
    let ex = exchange(
        target,
        path,
        &body.to_string(),
        start + deadline,
        slow,
        cut,
        None,
    );
    record_of(ex, start, p, stream, slow.is_some())
}

/// The record of one exchange that began at `start`.
fn record_of(ex: Exchange, start: Instant, p: &Prompt, stream: bool, slow: bool) -> Record {
    let mut rec = Record {
        start,
        end: Instant::now(),
        outcome: Outcome::Aborted,
        stream,
        long: p.long,
        slow,
        first_event: None,
        ttft: None,
        tpot: None,
    };
    rec.outcome = match ex {
        Exchange::Aborted => Outcome::Aborted,
        Exchange::Hung => Outcome::Hung,
        Exchange::Transport(e) => Outcome::Transport(e),
        Exchange::Done {
            status,
            body,
            first_event,
            last_event,
            events_seen,
        } => {
            let o = classify(status, &body, stream, p);
            rec.first_event = first_event;
            if stream && o == Outcome::Correct {
                rec.ttft = first_event.map(|t| t - start);
                if let (Some(f), Some(l)) = (first_event, last_event)
                    && events_seen > 1
                {
                    rec.tpot = Some((l - f) / (events_seen as u32 - 1));
                }
            }
            o
        }
    };
    rec
}

enum Exchange {
    Done {
        status: u16,
        body: String,
        first_event: Option<Instant>,
        last_event: Option<Instant>,
        events_seen: usize,
    },
    Transport(String),
    Hung,
    Aborted,
}

/// One request on a fresh connection, read to its end or the deadline; a
/// slow reader takes `slow` per event; `seen` is set at the first event.
fn exchange(
    target: SocketAddr,
    path: &str,
    body: &str,
    deadline: Instant,
    slow: Option<Duration>,
    cut: Option<Cut>,
    seen: Option<&OnceLock<Instant>>,
) -> Exchange {
    let mut s = match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) if e.kind() == ErrorKind::TimedOut => return Exchange::Hung,
        Err(e) => return Exchange::Transport(format!("connect: {}", e.kind())),
    };
    let _ = s.set_nodelay(true);
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    if let Err(e) = s.write_all(req.as_bytes()) {
        return Exchange::Transport(format!("write: {}", e.kind()));
    }
    if matches!(cut, Some(Cut::BeforeHead)) {
        return Exchange::Aborted;
    }
    let mut raw: Vec<u8> = Vec::new();
    let mut head_end = None;
    let mut buf = [0u8; 4096];
    let (mut first_event, mut last_event, mut events_seen) = (None, None, 0usize);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Exchange::Hung;
        }
        let _ = s.set_read_timeout(Some(left.min(Duration::from_millis(500))));
        // A slow reader takes a little at a time.
        let want = if slow.is_some() && head_end.is_some() {
            256
        } else {
            buf.len()
        };
        match s.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(n) => {
                raw.extend_from_slice(&buf[..n]);
                if head_end.is_none() {
                    head_end = raw.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
                    if head_end.is_some() && matches!(cut, Some(Cut::AfterHead)) {
                        return Exchange::Aborted;
                    }
                }
                if let Some(h) = head_end {
                    let events = count(&raw[h..], b"\n\n");
                    if events > events_seen {
                        let now = Instant::now();
                        first_event.get_or_insert(now);
                        if let Some(seen) = seen {
                            let _ = seen.set(now);
                        }
                        last_event = Some(now);
                        let new = events - events_seen;
                        events_seen = events;
                        if let Some(per_event) = slow {
                            std::thread::sleep(per_event * new as u32);
                        }
                    }
                    if let Some(Cut::AfterBytes(b)) = cut
                        && raw.len() - h >= b
                    {
                        return Exchange::Aborted;
                    }
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Exchange::Transport(format!("read: {}", e.kind())),
        }
    }
    let Some(h) = head_end else {
        return Exchange::Transport(format!(
            "closed after {} bytes, no response head",
            raw.len()
        ));
    };
    let head = String::from_utf8_lossy(&raw[..h]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        match dechunk(&raw[h..]) {
            Some(b) => b,
            None => return Exchange::Transport("chunked body cut short".into()),
        }
    } else {
        raw[h..].to_vec()
    };
    Exchange::Done {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
        first_event,
        last_event,
        events_seen,
    }
}

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

/// A chunked body decoded; `None` if the last chunk never came.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = b.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[..line_end]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        b = &b[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        if b.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// `status/code` of an OpenAI error object, or `None` if it is not one.
fn error_label(status: &str, v: &Value) -> Option<String> {
    let e = v.get("error")?;
    e.get("message")?.as_str()?;
    let code = e
        .get("code")
        .and_then(Value::as_str)
        .or_else(|| e.get("type").and_then(Value::as_str))?;
    Some(format!("{status}/{code}"))
}

fn classify(status: u16, body: &str, stream: bool, p: &Prompt) -> Outcome {
    if status != 200 {
        return match serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| error_label(&status.to_string(), &v))
        {
            Some(l) if status >= 500 => Outcome::Clean(l),
            Some(l) => Outcome::Wrong(format!("client error {l}: {body}")),
            None => Outcome::Wrong(format!("{status} without an OpenAI error: {body:?}")),
        };
    }
    let pick = |v: &Value| -> Option<String> {
        let c = &v["choices"][0];
        let t = if stream {
            if p.chat {
                c["delta"]["content"].as_str()
            } else {
                c["text"].as_str()
            }
        } else if p.chat {
            c["message"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        Some(t.unwrap_or("").to_string())
    };
    if !stream {
        let Ok(v) = serde_json::from_str::<Value>(body) else {
            return Outcome::Wrong(format!("200 with a body that is not JSON: {body:?}"));
        };
        let text = pick(&v).unwrap_or_default();
        return if text == p.reference {
            Outcome::Correct
        } else {
            Outcome::Wrong(format!("got {text:?}, reference {:?}", p.reference))
        };
    }
    let events = sse_events(body);
    let mut text = String::new();
    for e in &events {
        if e == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(e) else {
            return Outcome::Wrong(format!("an event that is not JSON: {e:?}"));
        };
        if v.get("error").is_some() {
            if !p.reference.starts_with(&text) {
                return Outcome::Wrong(format!(
                    "failed stream's text {text:?} is no prefix of {:?}",
                    p.reference
                ));
            }
            return match error_label("200+event", &v) {
                Some(l) => Outcome::Clean(l),
                None => Outcome::Wrong(format!("an error event not in OpenAI's shape: {e}")),
            };
        }
        text.push_str(&pick(&v).unwrap_or_default());
    }
    if events.last().map(String::as_str) != Some("[DONE]") {
        return if p.reference.starts_with(&text) {
            Outcome::Transport(format!("stream ended without [DONE] after {text:?}"))
        } else {
            Outcome::Wrong(format!("cut stream's text {text:?} is no prefix"))
        };
    }
    if text == p.reference {
        Outcome::Correct
    } else {
        Outcome::Wrong(format!("got {text:?}, reference {:?}", p.reference))
    }
}

/// One scenario's figures.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub started: usize,
    pub correct: usize,
    pub clean: BTreeMap<String, usize>,
    pub transport: BTreeMap<String, usize>,
    pub wrong: Vec<String>,
    pub hung: usize,
    pub aborted: usize,
}

impl Tally {
    pub fn of(records: &[Record]) -> Tally {
        let mut t = Tally {
            started: records.len(),
            ..Tally::default()
        };
        for r in records {
            match &r.outcome {
                Outcome::Correct => t.correct += 1,
                Outcome::Clean(c) => *t.clean.entry(c.clone()).or_default() += 1,
                Outcome::Transport(c) => *t.transport.entry(c.clone()).or_default() += 1,
                Outcome::Wrong(w) => t.wrong.push(w.clone()),
                Outcome::Hung => t.hung += 1,
                Outcome::Aborted => t.aborted += 1,
            }
        }
        t
    }

    /// `503/unavailable x3, ...` (or `-`).
    pub fn clean_summary(&self) -> String {
        let all: Vec<String> = self
            .clean
            .iter()
            .chain(self.transport.iter())
            .map(|(k, v)| format!("{k} x{v}"))
            .collect();
        if all.is_empty() {
            "-".into()
        } else {
            all.join(", ")
        }
    }
}

/// Correct completions per second of the records that started and ended
/// within `[from, to]`.
pub fn throughput(records: &[Record], from: Instant, to: Instant) -> f64 {
    let n = records
        .iter()
        .filter(|r| r.outcome == Outcome::Correct && r.start >= from && r.end <= to)
        .count();
    n as f64 / (to - from).as_secs_f64()
}

/// The mean of [`throughput`] over the `window`s that fit in `[from, to]`
/// (every 250 ms): the rate [`recovery`] compares a window with, since a
/// window loses the requests that straddle its edges.
pub fn window_rate(records: &[Record], from: Instant, to: Instant, window: Duration) -> f64 {
    let mut rates = Vec::new();
    let mut t = from;
    while t + window <= to {
        rates.push(throughput(records, t, t + window));
        t += Duration::from_millis(250);
    }
    if rates.is_empty() {
        0.0
    } else {
        rates.iter().sum::<f64>() / rates.len() as f64
    }
}

/// The first moment `t` at or after `healed` from which a `window` holds
/// at least `fraction` of `baseline` correct completions per second and no
/// failure; `None` if none within the records.
pub fn recovery(
    records: &[Record],
    healed: Instant,
    baseline: f64,
    fraction: f64,
    window: Duration,
) -> Option<Duration> {
    let last = records.iter().map(|r| r.end).max()?;
    let mut t = healed;
    while t + window <= last {
        let in_window: Vec<&Record> = records
            .iter()
            .filter(|r| r.start >= t && r.end <= t + window)
            .collect();
        let failed = in_window
            .iter()
            .any(|r| !matches!(r.outcome, Outcome::Correct | Outcome::Aborted));
        if !failed && throughput(records, t, t + window) >= fraction * baseline {
            return Some(t - healed);
        }
        t += Duration::from_millis(250);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunks_and_detects_a_cut_body() {
        assert_eq!(
            dechunk(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n").unwrap(),
            b"hello world"
        );
        assert!(dechunk(b"5\r\nhello\r\n6\r\n wo").is_none());
        assert!(dechunk(b"5\r\nhello\r\n").is_none());
    }

    #[test]
    fn classifies_answers() {
        let p = Prompt {
            chat: false,
            text: "x".into(),
            long: false,
            reference: "ab".into(),
        };
        let ok = r#"{"choices":[{"text":"ab"}]}"#;
        assert_eq!(classify(200, ok, false, &p), Outcome::Correct);
        let bad = r#"{"choices":[{"text":"ac"}]}"#;
        assert!(matches!(classify(200, bad, false, &p), Outcome::Wrong(_)));
        let err = r#"{"error":{"message":"m","type":"service_unavailable","param":null,"code":"unavailable"}}"#;
        assert_eq!(
            classify(503, err, false, &p),
            Outcome::Clean("503/unavailable".into())
        );
        assert!(matches!(
            classify(503, "oops", false, &p),
            Outcome::Wrong(_)
        ));
        let stream = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(classify(200, stream, true, &p), Outcome::Correct);
        let failed = format!("data: {{\"choices\":[{{\"text\":\"a\"}}]}}\n\ndata: {err}\n\n");
        assert_eq!(
            classify(200, &failed, true, &p),
            Outcome::Clean("200+event/unavailable".into())
        );
        let wrong_then_failed =
            format!("data: {{\"choices\":[{{\"text\":\"x\"}}]}}\n\ndata: {err}\n\n");
        assert!(matches!(
            classify(200, &wrong_then_failed, true, &p),
            Outcome::Wrong(_)
        ));
        let cut = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
        assert!(matches!(
            classify(200, cut, true, &p),
            Outcome::Transport(_)
        ));
    }

    #[test]
    fn recovery_is_the_first_full_window_after_the_heal() {
        let t0 = Instant::now();
        let rec = |s: u64, ok: bool| Record {
            start: t0 + Duration::from_millis(s),
            end: t0 + Duration::from_millis(s + 400),
            outcome: if ok {
                Outcome::Correct
            } else {
                Outcome::Clean("503/unavailable".into())
            },
            stream: false,
            long: false,
            slow: false,
            first_event: None,
            ttft: None,
            tpot: None,
        };
        // Failures until 3 s, then 2 correct per second.
        let mut rs: Vec<Record> = (0..6).map(|i| rec(i * 500, false)).collect();
        rs.extend((6..30).map(|i| rec(i * 500, true)));
        let r = recovery(&rs, t0, 2.0, 0.5, Duration::from_secs(2)).unwrap();
        assert_eq!(r, Duration::from_millis(2750));
        assert!(recovery(&rs, t0, 20.0, 0.5, Duration::from_secs(2)).is_none());
        // 2 correct per second from 3 s on (400 ms each), windows of 2 s:
        // one on the half second holds 4 requests, one a quarter past 3.
        let from = t0 + Duration::from_secs(3);
        let rate = window_rate(
            &rs,
            from,
            t0 + Duration::from_secs(15),
            Duration::from_secs(2),
        );
        assert!((rate - 1.75).abs() < 0.05, "{rate}");
    }
}
