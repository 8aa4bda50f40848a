//! End to end, disaggregated: a real etcd, prefill and decode nodes and a
//! router as separate `tandem` processes, KV moving between them over UCX
//! (TCP loopback), spoken to over real HTTP and gRPC. Greedy outputs must
//! equal the engine's single-sequence generation, metrics must show the
//! split, failures must end cleanly, and no KV block may leak.
//!
//! Needs the release binary, `TANDEM_TEST_GGUF`, `etcd` and libucx
//! (scripts/test.sh provides all).

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_proto::pb;
use tandem_tests::cluster::{
    LEASE_TTL_S, Node, Router, counting_prompt, expected, long_prompt, short_prompt, unique_cluster,
};
use tandem_tests::{http, metric, model, reference, sse_events};

const MAX_TOKENS: usize = 16;

#[test]
fn one_prefill_one_decode_matches_local_generation_and_splits_the_work() {
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("p1d1");
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
    let d = Node::start(&etcd.url(), &cluster, "decode", "d0", &[]);
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(10));

    // A router whose cluster has no workers answers 503 with a clear
    // message, and says so on /health.
    let lonely = Router::start(&etcd.url(), &format!("{cluster}-empty"));
    let body = json!({"prompt": short_prompt(), "max_tokens": 4});
    let resp = http(lonely.port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(resp.status, 503, "{}", resp.body);
    assert!(
        resp.body.contains("No decode worker is available"),
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
        .chat_template
        .as_ref()
        .unwrap()
        .render(
            &[tandem_engine::chat::ChatMessage::new("user", &content)],
            true,
        )
        .unwrap();
    let want = reference(m.tokenizer.encode(&rendered, false).unwrap(), MAX_TOKENS);
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

    // A client that disconnects mid-stream frees the request's blocks on
    // both nodes.
    let body =
        json!({"prompt": counting_prompt(0), "max_tokens": 300, "temperature": 0, "stream": true});
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", r.port)).unwrap();
    conn.write_all(
        tandem_tests::request_bytes("POST", "/v1/completions", &body.to_string()).as_bytes(),
    )
    .unwrap();
    let mut first = [0u8; 256];
    let n = conn.read(&mut first).unwrap();
    assert!(
        n > 0
            && std::str::from_utf8(&first[..n])
                .unwrap()
                .starts_with("HTTP/1.1 200")
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.health()["running"] != 1 {
        assert!(
            Instant::now() < deadline,
            "the stream never started decoding"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(conn);
    p.assert_idle();
    d.assert_idle();
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

    // Concurrent long prompts spread over both decode nodes, all correct.
    let run_batch = |n: usize, offset: usize| {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|i| {
                    let r = &r;
                    s.spawn(move || {
                        let prompt = long_prompt(i + offset);
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
    run_batch(6, 0);
    let remote = |n: &Node| metric(&n.metrics(), "tandem_decode_prefills_total", "");
    assert!(
        remote(&d0) > 0.0 && remote(&d1) > 0.0,
        "one decode node got no work"
    );

    // kill -9 a prefill node under load: every request still completes
    // correctly (retried on the other prefill node or prefilled locally),
    // and the router drops the dead node within the lease TTL.
    std::thread::scope(|s| {
        let load = s.spawn(|| run_batch(6, 1));
        std::thread::sleep(Duration::from_millis(300));
        p0.proc.kill9();
        load.join().unwrap();
    });
    let gone = r.wait_members(1, 2, Duration::from_secs(LEASE_TTL_S + 5));
    assert!(gone <= Duration::from_secs(LEASE_TTL_S + 5));
    run_batch(2, 3);

    // kill -9 a decode node mid-stream: its streams end with an error
    // event, the others finish normally, nothing hangs.
    let outcomes = std::thread::scope(|s| {
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
        std::thread::sleep(Duration::from_millis(2500));
        d1.proc.kill9();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
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
    assert!(
        errors >= 1,
        "no stream noticed the killed decode node: {outcomes:?}"
    );
    assert!(
        errors < outcomes.len(),
        "every stream failed, not only the killed node's"
    );
    r.wait_members(1, 1, Duration::from_secs(LEASE_TTL_S + 5));

    // etcd goes away: serving continues on the last membership, and comes
    // back when etcd does.
    etcd.stop();
    std::thread::sleep(Duration::from_millis(500));
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
            rkey: vec![4, 5, 6],
            base: 4096,
            len: 64 * block_bytes,
            connector: "ucx".into(),
        }),
        deadline_ms: 5000,
        rank_regions: vec![],
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
    let remote = |n: &Node| {
        metric(
            &n.metrics(),
            "tandem_decode_prefills_total",
            "outcome=\"remote\"",
        )
    };
    assert_eq!(
        remote(&d0) + remote(&d1),
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
    assert_eq!(remote(&d), 3.0);
    assert!(metric(&p.metrics(), "tandem_dkv_bytes_transferred_bytes_total", "") > 0.0);
    p.assert_idle();
    d.assert_idle();
}
