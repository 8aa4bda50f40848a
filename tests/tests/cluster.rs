//! End to end, disaggregated: a real etcd, prefill and decode nodes and a
//! router as separate `tandem` processes, KV moving between them over UCX
//! (TCP loopback), spoken to over real HTTP and gRPC. Greedy outputs must
//! equal the engine's single-sequence generation, metrics must show the
//! split, failures must end cleanly, and no KV block may leak.
//!
//! Needs the release binary, `TANDEM_TEST_GGUF`, `etcd` and libucx
//! (scripts/test.sh provides all).

#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_proto::pb;
use tandem_tests::cluster::{
    LEASE_TTL_S, Node, Router, counting_prompt, expected, long_prompt, short_prompt, unique_cluster,
};
use tandem_tests::{assert_greedy_up_to_near_ties, http, metric, model, reference, sse_events};

const MAX_TOKENS: usize = 16;

#[test]
fn one_prefill_one_decode_matches_local_generation_and_splits_the_work() {
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("p1d1");
    let long = LONG_CONTEXT.to_string();
    let long = ["--max-length", long.as_str()];
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &long);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d0", &long);
    let r = Router::start_with(&etcd.url(), &cluster, &long);
    r.wait_members(1, 1, Duration::from_secs(10));

    // Nodes bound to 127.0.0.1 listen on nothing else: not gRPC, not
    // metrics, and not the KV transfer engine's UCX sockets.
    for (name, pid) in [("prefill", p.proc.pid()), ("decode", d.proc.pid())] {
        let listening = listening_addresses(pid);
        assert!(listening.len() >= 3, "{name}: {listening:?}");
        assert!(
            listening.iter().all(|a| a.ip().is_loopback()),
            "{name} listens beyond loopback: {listening:?}"
        );
    }

    // A router whose cluster has no workers answers 503 with a clear
    // message, and says so on /health.
    let lonely = Router::start(&etcd.url(), &format!("{cluster}-empty"));
    let body = json!({"prompt": short_prompt(), "max_tokens": 4});
    let resp = http(lonely.port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(resp.status, 503, "{}", resp.body);
    assert!(
        resp.body.contains("No worker is available"),
        "{}",
        resp.body
    );
    assert_eq!(http(lonely.port, "GET", "/health", "").status, 503);
    drop(lonely);

    // A short prompt never leaves the decode node.
    let v = r.complete(short_prompt(), MAX_TOKENS);
    assert_eq!(
        v["choices"][0]["text"],
        expected(short_prompt(), MAX_TOKENS).as_str()
    );
    let dm = d.metrics();
    assert_eq!(
        metric(&dm, "tandem_decode_prefills_total", "outcome=\"local\""),
        1.0
    );
    assert_eq!(
        metric(&p.metrics(), "tandem_batch_size_count", ""),
        0.0,
        "prefill node worked on a short prompt"
    );

    // Long prompts are prefilled remotely, and the KV handed over gives the
    // same tokens as computing everything in one process.
    for i in 0..3 {
        let prompt = long_prompt(i);
        let v = r.complete(&prompt, MAX_TOKENS);
        assert_eq!(
            v["choices"][0]["text"],
            expected(&prompt, MAX_TOKENS).as_str(),
            "prompt {i}"
        );
        assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS);
    }
    // Streaming chat through the same path.
    let content = long_prompt(5);
    let body = json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let resp = http(r.port, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(resp.status, 200, "{}", resp.body);
    let events = sse_events(&resp.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "{e}");
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    let m = model();
    let rendered = m
        .text
        .chat_template
        .as_ref()
        .unwrap()
        .render(
            &[tandem_modelfile::chat::ChatMessage::new("user", &content)],
            true,
        )
        .unwrap();
    let want = reference(
        m.text.tokenizer.encode(&rendered, false).unwrap(),
        MAX_TOKENS,
    );
    assert_eq!(text, want);

    // The split, as the metrics see it: prompts computed (CE) on the prefill
    // node, which never decodes (TG); KV bytes moved over UCX; the decode
    // node computed only the short prompt itself.
    let pm = p.metrics();
    let dm = d.metrics();
    assert!(
        metric(&pm, "tandem_batch_size_count", "batch_type=\"CE\"") >= 4.0,
        "{pm}"
    );
    assert_eq!(
        metric(&pm, "tandem_batch_size_count", "batch_type=\"TG\""),
        0.0
    );
    assert!(
        metric(
            &pm,
            "tandem_dkv_bytes_transferred_bytes_total",
            "connector=\"ucx\""
        ) > 0.0
    );
    assert!(metric(&pm, "tandem_dkv_blocks_transferred_total", "") >= 4.0);
    assert_eq!(
        metric(&dm, "tandem_decode_prefills_total", "outcome=\"remote\""),
        4.0
    );
    assert_eq!(
        metric(&dm, "tandem_batch_size_count", "batch_type=\"CE\""),
        1.0
    );
    assert!(
        metric(&dm, "tandem_batch_size_count", "batch_type=\"TG\"")
            >= 4.0 * (MAX_TOKENS as f64 - 1.0)
    );
    // Every step's forward pass is timed, under its step's batch type.
    for (m, ty) in [(&pm, "CE"), (&dm, "CE"), (&dm, "TG")] {
        let label = format!("batch_type=\"{ty}\"");
        assert_eq!(
            metric(m, "tandem_forward_time_milliseconds_count", &label),
            metric(m, "tandem_batch_size_count", &label),
            "{ty}: {m}"
        );
        assert!(metric(m, "tandem_forward_time_milliseconds_sum", &label) > 0.0);
    }

    // A repeated long prompt: the decode node now has its full blocks and
    // reports them as cached.
    let prompt = long_prompt(0);
    let v = r.complete(&prompt, MAX_TOKENS);
    assert_eq!(
        v["choices"][0]["text"],
        expected(&prompt, MAX_TOKENS).as_str()
    );
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let full_blocks = (prompt_tokens - 1) / 16 * 16;
    assert!(full_blocks > 0);
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= full_blocks,
        "{v}"
    );

    // A client that disconnects mid-stream cancels its request: the router
    // counts it cancelled, the decode node stops decoding it and both nodes
    // free its blocks within CANCEL_BOUND of the disconnect. Greedy
    // counting up to the whole context cannot end by itself that soon.
    let prompt = counting_prompt(0);
    let prompt_tokens = m.text.tokenizer.encode(&prompt, true).unwrap().len();
    let max_tokens = LONG_CONTEXT - prompt_tokens;
    let cancelled = || {
        metric(
            &http(r.port, "GET", "/metrics", "").body,
            "tandem_requests_total",
            "status=\"cancelled\"",
        )
    };
    // Decode steps of the decode node: one per token of a lone stream.
    let decoded = || metric(&d.metrics(), "tandem_batch_size_sum", "batch_type=\"TG\"");
    let cancelled_before = cancelled();
    let decoded_before = decoded();
    let body =
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true});
    // A raw socket: dropping it is the disconnect the bound is timed from.
    let mut conn = tandem_tests::raw_request(r.port, "POST", "/v1/completions", &body.to_string());
    let mut first = [0u8; 256];
    let n = conn.read(&mut first).unwrap();
    assert!(
        n > 0
            && std::str::from_utf8(&first[..n])
                .unwrap()
                .starts_with("HTTP/1.1 200")
    );
    wait_until(
        "the stream to start decoding",
        Duration::from_secs(20),
        || d.health()["running"] == 1,
    );
    // The decode rate, to show the request could not finish by itself
    // within the bound (later steps only get slower as the context grows).
    let (t0, g0) = (Instant::now(), decoded());
    wait_until("16 decode steps", Duration::from_secs(20), || {
        decoded() - g0 >= 16.0
    });
    let steps = decoded() - g0;
    let per_token = t0.elapsed().div_f64(steps);
    let would_take = per_token * (max_tokens - steps as usize) as u32;
    assert!(
        would_take >= 10 * CANCEL_BOUND,
        "finishing would take only {would_take:?}: the test could not tell cancellation from \
         completion"
    );
    let dropped = Instant::now();
    drop(conn);
    loop {
        let (p_idle, ph) = p.idle();
        let (d_idle, dh) = d.idle();
        let counted = cancelled() - cancelled_before;
        if p_idle && d_idle && counted == 1.0 {
            break;
        }
        assert!(
            dropped.elapsed() <= CANCEL_BOUND,
            "{:?} after the disconnect: {counted} requests counted cancelled, prefill {ph}, \
             decode {dh}; finishing by itself would take {would_take:?}",
            dropped.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Cancelled, not completed: the decode node stopped far short of
    // max_tokens.
    let generated = decoded() - decoded_before;
    println!(
        "cancelled on both nodes {:?} after the disconnect ({generated} of {max_tokens} tokens \
         decoded; finishing would take {would_take:?})",
        dropped.elapsed()
    );
    assert!(
        generated < max_tokens as f64 / 10.0,
        "the decode node ran {generated} of {max_tokens} steps for a cancelled stream"
    );
}

/// Context length of the nodes and routers of the cancellation test: long
/// enough that a request running to it takes far longer than CANCEL_BOUND.
const LONG_CONTEXT: usize = 4096;

/// How soon after a client disconnects its request must be cancelled on
/// every process: a few steps and polls.
const CANCEL_BOUND: Duration = Duration::from_secs(1);

/// How much later than the lease TTL after its kill a node may still be
/// listed: etcd checks lease expiry every 500 ms, and the router's watch
/// and the test's 50 ms polls add a little.
const MEMBERSHIP_MARGIN: Duration = Duration::from_secs(1);

/// Polls `f` until it holds; panics after `timeout`.
/// The TCP addresses process `pid` listens on (its sockets' inodes looked
/// up in /proc/net/tcp{,6}).
fn listening_addresses(pid: u32) -> Vec<std::net::SocketAddr> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's fds")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut out = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local address, state 0A (LISTEN), inode
            if f.len() < 10 || f[3] != "0A" || !inodes.iter().any(|i| i == f[9]) {
                continue;
            }
            let (ip, port) = f[1].split_once(':').expect("addr:port");
            let port = u16::from_str_radix(port, 16).expect("hex port");
            // The kernel prints each 32-bit word in host (little-endian) order.
            let bytes: Vec<u8> = (0..ip.len() / 8)
                .flat_map(|w| {
                    let word = u32::from_str_radix(&ip[w * 8..w * 8 + 8], 16).expect("hex");
                    word.to_le_bytes()
                })
                .collect();
            let ip: std::net::IpAddr = if v6 {
                <[u8; 16]>::try_from(bytes).expect("16 bytes").into()
            } else {
                <[u8; 4]>::try_from(bytes).expect("4 bytes").into()
            };
            out.push(std::net::SocketAddr::new(ip, port));
        }
    }
    out
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `f` until it returns a value; panics after `timeout`.
fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A long prompt no node has seen (its first block differs from every
/// other prompt's), so it is prefilled remotely.
fn fresh_prompt(tag: &str, i: usize) -> String {
    format!("Chapter {tag}{i}. {}", long_prompt(i))
}

/// Sets the flag when dropped, also while unwinding: stops load threads
/// when the test fails, so that the scope joining them cannot hang.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[test]
fn two_by_two_survives_killed_nodes_and_an_etcd_restart() {
    let mut etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("p2d2");
    let mut p0 = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
    let p1 = Node::start(&etcd.url(), &cluster, "prefill", "p1", &[]);
    let d0 = Node::start(&etcd.url(), &cluster, "decode", "d0", &[]);
    let mut d1 = Node::start(&etcd.url(), &cluster, "decode", "d1", &[]);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(2, 2, Duration::from_secs(10));
    let ttl = Duration::from_secs(LEASE_TTL_S);

    // Concurrent long prompts spread over both decode nodes, all correct.
    let run_prompts = |prompts: Vec<String>| {
        std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .into_iter()
                .map(|prompt| {
                    let r = &r;
                    s.spawn(move || {
                        let v = r.complete(&prompt, MAX_TOKENS);
                        (prompt, v)
                    })
                })
                .collect();
            for h in handles {
                let (prompt, v) = h.join().unwrap();
                assert_eq!(
                    v["choices"][0]["text"],
                    expected(&prompt, MAX_TOKENS).as_str()
                );
            }
        })
    };
    let run_batch =
        |n: usize, offset: usize| run_prompts((offset..offset + n).map(long_prompt).collect());
    run_batch(6, 0);
    let remote = |n: &Node| metric(&n.metrics(), "tandem_decode_prefills_total", "");
    assert!(
        remote(&d0) > 0.0 && remote(&d1) > 0.0,
        "one decode node got no work"
    );

    // kill -9 a prefill node while it computes prompts: every request
    // still completes correctly, those it held are retried on the other
    // prefill node or prefilled locally (and counted so), and the router
    // drops the dead node within the lease TTL of the kill.
    const OUTCOMES: [&str; 4] = ["local", "remote", "retried", "fallback"];
    let outcomes = || {
        OUTCOMES.map(|o| {
            let label = format!("outcome=\"{o}\"");
            [&d0, &d1]
                .iter()
                .map(|n| metric(&n.metrics(), "tandem_decode_prefills_total", &label))
                .sum::<f64>()
        })
    };
    let before = outcomes();
    let killed = AtomicBool::new(false);
    let sent = AtomicUsize::new(0);
    let (held, gone) = std::thread::scope(|s| {
        let stop = SetOnDrop(&killed);
        // Fresh prompts from four clients until p0 is killed: the router
        // spreads them over both prefill nodes, so p0 soon gets one.
        for _ in 0..4 {
            s.spawn(|| {
                while !killed.load(Ordering::Relaxed) {
                    let i = sent.fetch_add(1, Ordering::Relaxed);
                    assert!(i < 64, "p0 never computed one of {i} prompts");
                    let prompt = fresh_prompt("k", i);
                    let v = r.complete(&prompt, MAX_TOKENS);
                    assert_eq!(
                        v["choices"][0]["text"],
                        expected(&prompt, MAX_TOKENS).as_str()
                    );
                }
            });
        }
        // Requests submitted to p0's scheduler and not yet computed: p0
        // can answer none of them once killed.
        let held = wait_for("p0 to compute a prompt", Duration::from_secs(120), || {
            let h = p0.health();
            let n = h["running"].as_u64().unwrap() + h["waiting"].as_u64().unwrap();
            (n > 0).then_some(n)
        });
        p0.proc.kill9();
        let kill = Instant::now();
        drop(stop);
        r.wait_members(1, 2, ttl + Duration::from_secs(10));
        (held, kill.elapsed())
    });
    assert!(
        gone <= ttl + MEMBERSHIP_MARGIN,
        "the killed prefill node stayed listed for {gone:?} (lease TTL {ttl:?})"
    );
    let sent = sent.load(Ordering::Relaxed) as f64;
    let after = outcomes();
    let delta: Vec<f64> = (0..4).map(|i| after[i] - before[i]).collect();
    let report = format!(
        "p0 killed holding {held} prompts, unlisted {gone:?} after the kill; {OUTCOMES:?} went \
         up by {delta:?} for {sent} requests"
    );
    println!("{report}");
    assert_eq!(delta.iter().sum::<f64>(), sent, "{report}");
    assert_eq!(
        delta[0], 0.0,
        "a fresh prompt was prefilled locally: {report}"
    );
    assert!(
        delta[2] + delta[3] >= held as f64,
        "p0 held {held} prompts when killed, but fewer were retried or fell back: {report}"
    );
    run_batch(2, 3);

    // kill -9 a decode node mid-stream: exactly its streams end with an
    // error event, the others finish normally, nothing hangs.
    let running = |n: &Node| n.health()["running"].as_u64().unwrap();
    let (outcomes, on_d1, gone) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let r = &r;
                s.spawn(move || {
                    let body = json!({"prompt": counting_prompt(i), "max_tokens": 200,
                                      "temperature": 0, "stream": true});
                    let resp = http(r.port, "POST", "/v1/completions", &body.to_string());
                    (resp.status, sse_events(&resp.body))
                })
            })
            .collect();
        let (on_d0, on_d1) = wait_for(
            "all four streams to decode",
            Duration::from_secs(60),
            || {
                let (a, b) = (running(&d0), running(&d1));
                (a + b == 4).then_some((a, b))
            },
        );
        assert!(
            on_d0 > 0 && on_d1 > 0,
            "the streams did not spread over both decode nodes: {on_d0} and {on_d1}"
        );
        d1.proc.kill9();
        let kill = Instant::now();
        r.wait_members(1, 1, ttl + Duration::from_secs(10));
        let gone = kill.elapsed();
        let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        (outcomes, on_d1, gone)
    });
    let mut errors = 0;
    for (status, events) in &outcomes {
        assert_eq!(*status, 200);
        let failed = events.iter().any(|e| e.contains("\"error\""));
        if failed {
            errors += 1;
        } else {
            assert_eq!(
                events.last().map(String::as_str),
                Some("[DONE]"),
                "{events:?}"
            );
        }
    }
    println!("d1 killed decoding {on_d1} of 4 streams, unlisted {gone:?} after the kill");
    assert_eq!(
        errors, on_d1,
        "d1 decoded {on_d1} streams when killed: {outcomes:?}"
    );
    assert!(
        gone <= ttl + MEMBERSHIP_MARGIN,
        "the killed decode node stayed listed for {gone:?} (lease TTL {ttl:?})"
    );

    // etcd goes away: once the router has noticed, serving continues on
    // the last membership, and comes back when etcd does.
    let noticed = || {
        r.proc
            .stderr()
            .matches("keeping the last known membership")
            .count()
    };
    let before = noticed();
    etcd.stop();
    wait_until(
        "the router to notice etcd is gone",
        Duration::from_secs(20),
        || noticed() > before,
    );
    let prompt = long_prompt(2);
    assert_eq!(
        r.complete(&prompt, MAX_TOKENS)["choices"][0]["text"],
        expected(&prompt, MAX_TOKENS).as_str()
    );
    assert_eq!(r.health()["decode_workers"].as_array().unwrap().len(), 1);
    etcd.start_again().unwrap();
    let d2 = Node::start(&etcd.url(), &cluster, "decode", "d2", &[]);
    r.wait_members(1, 2, Duration::from_secs(15));
    run_batch(2, 4);

    for n in [&p1, &d0, &d2] {
        n.assert_idle();
    }
}

/// A prefill request as the decode node would send it.
fn prefill_request(fp: pb::Fingerprint, prompt: Vec<u32>, dst: Vec<u32>) -> pb::PrefillRequest {
    let block_bytes =
        u64::from(fp.num_layers * 2 * fp.num_kv_heads * fp.block_size * fp.head_dim * 2);
    pb::PrefillRequest {
        version: tandem_proto::PROTOCOL_VERSION,
        fingerprint: Some(fp),
        prompt,
        sampling: Some((&tandem_engine::sampler::SamplingParams::greedy()).into()),
        skip_blocks: 0,
        dst_blocks: dst,
        region: Some(pb::KvRegion {
            worker_address: vec![1, 2, 3],
            grant: vec![4, 5, 6],
            len: 64 * block_bytes,
            connector: "ucx".into(),
        }),
        deadline_ms: 5000,
        rank_regions: vec![],
        constraint: None,
    }
}

/// Not a `PrefillRequest`: field 3 (the packed prompt) holds broken varints.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbage {
    #[prost(bytes = "vec", tag = "3")]
    prompt: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_grpc_input_is_rejected_with_clear_errors() {
    let p = tokio::task::spawn_blocking(|| Node::start("", "x", "prefill", "p-bad", &[]))
        .await
        .unwrap();
    let endpoint = format!("http://127.0.0.1:{}", p.grpc);
    let channel = tonic::transport::Endpoint::from_shared(endpoint)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = pb::prefill_client::PrefillClient::new(channel.clone());
    let info = pb::worker_client::WorkerClient::new(channel.clone())
        .info(pb::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let fp = info.fingerprint.unwrap();
    let bs = fp.block_size as usize;

    // Wrong fingerprint: refused before any work.
    let mut wrong = fp.clone();
    wrong.block_size = 32;
    let s = client
        .prefill(prefill_request(wrong, vec![1; 40], vec![0; 2]))
        .await
        .unwrap_err();
    assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
    assert!(
        s.message().contains("KV block size differs"),
        "{}",
        s.message()
    );
    let mut wrong = fp.clone();
    wrong.weights_hash = "0123456789abcdef".into();
    let s = client
        .prefill(prefill_request(wrong, vec![1; 40], vec![0; 2]))
        .await
        .unwrap_err();
    assert!(
        s.message().contains("weights hash differs"),
        "{}",
        s.message()
    );

    // Destination blocks outside the registered region.
    let n = 40usize.div_ceil(bs);
    let s = client
        .prefill(prefill_request(fp.clone(), vec![1; 40], vec![1_000_000; n]))
        .await
        .unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    assert!(
        s.message().contains("outside the registered region"),
        "{}",
        s.message()
    );

    // A region descriptor that is not a UCX key: the transfer fails
    // cleanly after the prompt is computed, and its blocks are freed.
    let s = client
        .prefill(prefill_request(fp.clone(), vec![1; 40], vec![0; n]))
        .await
        .unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
    assert!(
        s.message().contains("KV transfer failed"),
        "{}",
        s.message()
    );

    // A malformed message: decoding fails in gRPC, not in our code.
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/tandem.v1.Prefill/Prefill");
    let codec = tonic_prost::ProstCodec::<Garbage, pb::PrefillResponse>::default();
    let s = grpc
        .unary(
            tonic::Request::new(Garbage {
                prompt: vec![0xff; 16],
            }),
            path,
            codec,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            s.code(),
            tonic::Code::Internal | tonic::Code::InvalidArgument
        ),
        "{s:?}"
    );

    // The node is unharmed: still answers, nothing leaked.
    let again = pb::worker_client::WorkerClient::new(channel)
        .info(pb::InfoRequest {})
        .await;
    assert!(again.is_ok());
    tokio::task::spawn_blocking(move || p.assert_idle())
        .await
        .unwrap();
}

#[test]
fn prefill_and_decode_with_different_tensor_parallelism() {
    // TP=3 prefill (each rank holds one of SmolLM2's three KV heads) writes
    // its ranks' head slices straight into the blocks of two TP=1 decode
    // nodes, and a TP=1 prefill feeds a TP=3 decode node.
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("tp3");
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p-tp3", &["--tp", "3"]);
    let d0 = Node::start(&etcd.url(), &cluster, "decode", "d0", &[]);
    let d1 = Node::start(&etcd.url(), &cluster, "decode", "d1", &[]);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 2, Duration::from_secs(10));
    // TP=3 computes bitwise what TP=1 computes (row-parallel sums run over
    // fixed segments), so the KV the TP=3 node writes is the KV a TP=1 node
    // would have computed, and the whole completion equals `tandem serve`'s.
    // Prompts 0, 4 and 5 are ones where an order-dependent TP sum used to
    // flip a near-tied token within 16 steps.
    std::thread::scope(|s| {
        let handles: Vec<_> = [0, 1, 4, 5]
            .into_iter()
            .map(|i| {
                let r = &r;
                s.spawn(move || {
                    let prompt = long_prompt(i);
                    (prompt.clone(), r.complete(&prompt, MAX_TOKENS))
                })
            })
            .collect();
        for h in handles {
            let (prompt, v) = h.join().unwrap();
            let text = v["choices"][0]["text"].as_str().unwrap();
            assert_eq!(text, expected(&prompt, MAX_TOKENS), "{prompt:?}");
        }
    });
    assert_eq!(
        d0.remote_prefills() + d1.remote_prefills(),
        4.0,
        "every prompt prefilled by the TP=3 node"
    );
    let pm = p.metrics();
    assert!(metric(&pm, "tandem_dkv_bytes_transferred_bytes_total", "") > 0.0);
    assert_eq!(
        metric(&pm, "tandem_batch_size_count", "batch_type=\"TG\""),
        0.0
    );
    for n in [&p, &d0, &d1] {
        n.assert_idle();
    }
    drop((p, d0, d1, r));

    // The other way round: a TP=1 prefill node writes into a TP=3 decode
    // node's three rank pools, each rank's KV head into its own pool.
    let cluster = unique_cluster("tp1to3");
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p-tp1", &[]);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d-tp3", &["--tp", "3"]);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(10));
    for i in [0, 4, 5] {
        let prompt = long_prompt(i);
        let v = r.complete(&prompt, MAX_TOKENS);
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(text, expected(&prompt, MAX_TOKENS), "{prompt:?}");
    }
    assert_eq!(d.remote_prefills(), 3.0);
    assert!(metric(&p.metrics(), "tandem_dkv_bytes_transferred_bytes_total", "") > 0.0);
    p.assert_idle();
    d.assert_idle();
}

#[test]
fn gpu_and_cpu_nodes_hand_kv_to_each_other_both_ways() {
    // The decode node runs on gpu:0 (Mesa's lavapipe on machines without a
    // GPU), the prefill node on the CPU. The prompt's KV crosses over UCX
    // into the decode node's host pool and from there to the device; the
    // GPU's greedy continuation is the CPU engine's up to near-ties.
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("gpu-decode");
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p-cpu", &[]);
    let d = Node::start(
        &etcd.url(),
        &cluster,
        "decode",
        "d-gpu",
        &["--devices", "gpu:0"],
    );
    let started = d.proc.stderr();
    assert!(
        started.contains("engine: gpu:0 (") && started.contains("Vulkan"),
        "{started}"
    );
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(10));
    // Lavapipe decodes about a token a second.
    let n = 6;
    for i in [0, 3] {
        let prompt = long_prompt(i);
        let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5});
        let resp = http(r.port, "POST", "/v1/completions", &body.to_string());
        assert_eq!(resp.status, 200, "{}\n{}", resp.body, d.proc.stderr());
        assert_greedy_up_to_near_ties(&prompt, n, &resp.json());
    }
    let dm = d.metrics();
    assert_eq!(
        metric(&dm, "tandem_decode_prefills_total", "outcome=\"remote\""),
        2.0,
        "{dm}"
    );
    let pm = p.metrics();
    assert!(metric(&pm, "tandem_dkv_bytes_transferred_bytes_total", "") > 0.0);
    assert_eq!(
        metric(&pm, "tandem_batch_size_count", "batch_type=\"TG\""),
        0.0,
        "the prefill node decoded"
    );
    p.assert_idle();
    d.assert_idle();
    drop((p, d, r));

    // The other way round: a GPU prefill node's KV (copied back to its host
    // pool after each step, then sent) continued by a CPU decode node. One
    // prompt just over the remote threshold: lavapipe computes prompts
    // slowly.
    let cluster = unique_cluster("gpu-prefill");
    let p = Node::start(
        &etcd.url(),
        &cluster,
        "prefill",
        "p-gpu",
        &["--devices", "gpu:0"],
    );
    // Lavapipe's first prompt (its kernels compiled on the way) takes
    // some 28 s on two cores, the next ones 15 s: past the 20 s watchdog
    // the other tests run the decode node with.
    let d = Node::start(
        &etcd.url(),
        &cluster,
        "decode",
        "d-cpu",
        &["--prefill-timeout-ms", "120000"],
    );
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(10));
    let prompt = "Listen to this story. Once upon a time, in a small village at the edge of a \
                  great forest, there lived an old baker and his three daughters.";
    let n = 12;
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5});
    let resp = http(r.port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(resp.status, 200, "{}\n{}", resp.body, p.proc.stderr());
    assert_greedy_up_to_near_ties(prompt, n, &resp.json());
    assert_eq!(d.remote_prefills(), 1.0);
    p.assert_idle();
    d.assert_idle();
}

/// The README's order on a new machine: the run command builds before UCX
/// is installed, the test command installs it, then the cluster command
/// runs. So nothing of UCX may be decided when the binary is built: it
/// links none of UCX's libraries (dkv loads libucp when a node starts),
/// and a node that cannot load it (here: pointed at a library that is not
/// there) stops at start-up naming what to install, never running
/// without its KV transport. The other tests here run the same binary
/// with the library in place.
#[test]
fn ucx_is_found_when_a_node_starts_not_when_it_is_built() {
    let bin = tandem_tests::binary();
    let ldd = std::process::Command::new("ldd")
        .arg(&bin)
        .output()
        .unwrap();
    let linked = String::from_utf8_lossy(&ldd.stdout);
    assert!(ldd.status.success(), "ldd {}: {linked}", bin.display());
    for lib in ["libucp", "libuct", "libucs"] {
        assert!(
            !linked.contains(lib),
            "{} links {lib}:\n{linked}",
            bin.display()
        );
    }
    let gguf = tandem_tests::gguf_path();
    let mut node = std::process::Command::new(&bin)
        .args([
            "prefill",
            "--model",
            gguf.to_str().unwrap(),
            "--threads",
            "1",
        ])
        .args(["--port", "0", "--metrics-port", "0", "--max-length", "256"])
        .args(["--ucx-library", "/nonexistent/libucp.so.0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = node.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            node.kill().unwrap();
            panic!("a node without libucp kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    node.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!status.success(), "{stderr}");
    for part in ["/nonexistent/libucp.so.0", "libucx0"] {
        assert!(stderr.contains(part), "{part} missing from: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}
