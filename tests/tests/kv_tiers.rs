//! End to end, the KV tiers below the pool (`--kv-connector-config`,
//! issue #38): real `tandem serve` processes and a real 1P1D cluster on the
//! test model, with a pool small enough that prompts evict each other.
//! Blocks restored from host memory or from files must give the same
//! tokens and log-probabilities as recomputing them; files left by a
//! previous run are used, damaged ones refused and deleted, a full disk
//! loses blocks and never answers; a bad config stops startup, naming the
//! key.
//!
//! Needs the release binary and `TANDEM_TEST_GGUF`; the 1P1D test also
//! `etcd` and libucx; those on a tmpfs or ramfs root (`mount`). scripts/test.sh
//! provides all.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_engine::sampler::SamplingParams;
use tandem_proto::pb;
use tandem_tests::cluster::{Node, Router, unique_cluster};
use tandem_tests::{Proc, gguf_path, http, metric, model, reference_output, start_serve};
use tempfile::TempDir;

/// A pool of 32 blocks of 16 tokens (the least `--max-length 512` allows)
/// and prompts of about 410 tokens (26 blocks): each prompt evicts most of
/// the one before it.
const POOL: [&str; 6] = [
    "--kv-cache-blocks",
    "32",
    "--max-length",
    "512",
    "--max-batch-size",
    "2",
];
const MAX_TOKENS: usize = 8;
/// One SmolLM2 block: 30 layers x K and V x 3 KV heads x 64 x 16 tokens x
/// 2 bytes.
const BLOCK_BYTES: u64 = 30 * 2 * 3 * 64 * 16 * 2;
/// A block file: its 40-byte header, then the block.
const FILE_BYTES: u64 = BLOCK_BYTES + 40;

/// The tier metrics as exported (OpenTelemetry's unit suffix is appended
/// to names that already end in it: `_bytes_bytes`).
const HITS: &str = "tandem_kv_tier_hits_total";
const BYTES: &str = "tandem_kv_tier_moved_bytes_total";
const ERRORS: &str = "tandem_kv_tier_errors_total";
const BLOCKS: &str = "tandem_kv_tier_blocks";

/// A host tier of 1 GB: every evicted block fits.
const HOST: &str = r#"{"host_kvcache_swap_space_gb": 1}"#;

/// A host tier of 0.001 GB (two blocks) over a disk tier in `dir`: the
/// blocks the pool evicts go on to files almost at once.
fn host_and_disk(dir: &Path, extra: &str) -> String {
    format!(
        r#"{{"host_kvcache_swap_space_gb": 0.001, "disk_offload_dir": {}{extra}}}"#,
        json!(dir.to_str().unwrap())
    )
}

/// About 410 tokens; prompts of different tags differ from their first
/// block on.
fn prompt(tag: &str) -> String {
    let trades = ["miller", "baker", "smith", "weaver"];
    let lines: Vec<String> = (0..20)
        .map(|n| {
            format!(
                "In year {tag}{n} the {} of village {tag} counted {} sheep and wrote it down.",
                trades[n % 4],
                n * 7
            )
        })
        .collect();
    format!("Story {tag}. {}", lines.join(" "))
}

/// A greedy completion with log-probabilities; panics unless 200.
fn complete(port: u16, prompt: &str) -> Value {
    let body = json!({
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
    });
    let r = http(port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        (380..=440).contains(&prompt_tokens),
        "the prompts are sized to evict each other: {v}"
    );
    v
}

/// What a completion said: its text, tokens and their log-probabilities,
/// and why it stopped.
fn answer(v: &Value) -> Value {
    let c = &v["choices"][0];
    assert!(c["logprobs"]["token_logprobs"].is_array(), "{v}");
    json!([c["text"], c["logprobs"], c["finish_reason"]])
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens: {v}"))
}

fn scrape(port: u16) -> String {
    let r = http(port, "GET", "/metrics", "");
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// Polls `f` every 20 ms until it holds; panics naming `what` after
/// `timeout`.
fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `tandem serve` on the test model with the small pool and `tiers`.
fn serve(tiers: Option<&str>) -> (Proc, u16) {
    let mut args = POOL.to_vec();
    if let Some(t) = tiers {
        args.extend(["--kv-connector-config", t]);
    }
    start_serve(&args)
}

/// SIGTERM, then waits for a clean exit.
fn stop(mut proc: Proc) {
    let pid = proc.pid().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut status = None;
    wait_until(
        "the server to exit after SIGTERM",
        Duration::from_secs(30),
        || {
            status = proc.try_wait();
            status.is_some()
        },
    );
    let status = status.unwrap();
    assert!(status.success(), "{status:?}: {}", proc.stderr());
}

/// Every file in the namespace directories under `dir` with extension
/// `ext`, sorted.
fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for ns in std::fs::read_dir(dir).unwrap() {
        let ns = ns.unwrap().path();
        if !ns.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(&ns).unwrap() {
            let f = f.unwrap().path();
            if f.extension().is_some_and(|e| e == ext) {
                out.push(f);
            }
        }
    }
    out.sort();
    out
}

/// Waits until the disk tier has written everything it was given: some
/// block files, no temporary file, and as many files as its gauge counts.
fn wait_for_block_files(port: u16, dir: &Path) -> Vec<PathBuf> {
    wait_until("block files on disk", Duration::from_secs(30), || {
        let kv = files(dir, "kv");
        !kv.is_empty()
            && files(dir, "tmp").is_empty()
            && metric(&scrape(port), BLOCKS, "tier=\"disk\"") == kv.len() as f64
    });
    files(dir, "kv")
}

/// A directory on a disk file system (/tmp may be a tmpfs).
fn disk_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("tandem-kv-tiers")
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// A memory file system mounted on a fresh directory; unmounted on drop.
struct Mount {
    dir: TempDir,
}

impl Mount {
    /// A tmpfs of `size` (e.g. "2m").
    fn tmpfs(size: &str) -> Mount {
        Self::new("tmpfs", &format!("size={size}"))
    }

    /// A ramfs: no size limit, and no `O_DIRECT` (tmpfs takes it since
    /// Linux 6.6).
    fn ramfs() -> Mount {
        Self::new("ramfs", "mode=0755")
    }

    fn new(fstype: &str, options: &str) -> Mount {
        let dir = disk_dir();
        let out = Command::new("mount")
            .args(["-t", fstype, "-o", options, fstype])
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mounting a {fstype} (these tests run as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Mount { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// Starts `tandem serve` with `args`, which must refuse to start: waits
/// (bounded) for a failed exit, then for its stderr to name `want`.
fn refused(args: &[&str], want: &str) {
    let gguf = gguf_path();
    let mut all: Vec<String> = ["serve", "--model", gguf.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    all.extend(["--host", "127.0.0.1", "--port", "0"].map(String::from));
    all.extend(args.iter().map(|s| s.to_string()));
    let mut proc = Proc::spawn("tandem serve", &all, &[]);
    let mut status = None;
    wait_until(
        &format!("{args:?} to be refused"),
        Duration::from_secs(60),
        || {
            status = proc.try_wait();
            status.is_some()
        },
    );
    assert!(!status.unwrap().success(), "{args:?} started");
    // The stderr reader thread may still be catching up.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !proc.stderr().contains(want) {
        assert!(
            Instant::now() < deadline,
            "{args:?}: stderr does not name {want:?}:\n{}",
            proc.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_bad_kv_connector_config_stops_startup_naming_the_key() {
    let flag = "--kv-connector-config";
    refused(
        &[flag, r#"{"host_kvcache_swap_space_gb":1,"bogus":1}"#],
        "bogus",
    );
    refused(
        &[flag, r#"{"disk_offload_dir":"/x"}"#],
        "host_kvcache_swap_space_gb",
    );
    refused(
        &[flag, r#"{"host_kvcache_swap_space_gb":-1}"#],
        "host_kvcache_swap_space_gb must be a positive number",
    );
    // Less than one block (368640 bytes) of host memory.
    refused(
        &[flag, r#"{"host_kvcache_swap_space_gb":0.0001}"#],
        "less than one KV block",
    );
    refused(&[flag, HOST, "--no-prefix-caching"], "need prefix caching");
    // A file system that does not take O_DIRECT: refused at startup, not
    // at the first eviction.
    let ramfs = Mount::ramfs();
    let direct = host_and_disk(ramfs.path(), r#", "disk_offload_direct_io": true"#);
    refused(&[flag, &direct], "O_DIRECT");
    // The same flag through its environment variable.
    let gguf = gguf_path();
    let out = Command::new(tandem_tests::binary())
        .args(["serve", "--model", gguf.to_str().unwrap(), "--port", "0"])
        .env("TANDEM_KV_CONNECTOR_CONFIG", r#"{"bogus":1}"#)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));
}

#[test]
fn multi_turn_outputs_with_tiers_equal_outputs_without() {
    let (_plain, plain) = serve(None);
    let (_tiered, tiered) = serve(Some(HOST));
    let (a, b) = (prompt("A"), prompt("B"));
    for (i, p) in [&a, &b, &a, &b].into_iter().enumerate() {
        let want = complete(plain, p);
        let got = complete(tiered, p);
        assert_eq!(answer(&got), answer(&want), "request {i}");
        // The small pool lost the prompt's head to the other prompt: the
        // plain server recomputes it all.
        assert_eq!(cached(&want), 0, "request {i}: {want}");
        if i < 2 {
            assert_eq!(cached(&got), 0, "request {i}: {got}");
        } else {
            // Restored from host memory (then the pool's tail): every
            // full block of all but the last token.
            let prompt_tokens = got["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(
                cached(&got),
                (prompt_tokens - 1) / 16 * 16,
                "request {i}: {got}"
            );
        }
    }
    let m = scrape(tiered);
    assert!(metric(&m, HITS, "tier=\"host\"") > 0.0, "{m}");
    for direction in ["down", "up"] {
        let moved = metric(
            &m,
            BYTES,
            &format!("direction=\"{direction}\",tier=\"host\""),
        );
        assert!(moved > 0.0, "{direction}: {m}");
        assert_eq!(moved % BLOCK_BYTES as f64, 0.0, "whole blocks: {m}");
    }
    assert_eq!(metric(&m, ERRORS, ""), 0.0, "{m}");
    assert_eq!(metric(&scrape(plain), HITS, ""), 0.0);
}

/// Runs A then B on a server with a tiny host tier over a disk tier in
/// `dir`, waits until A's evicted blocks are being written and stops the
/// server (SIGTERM: it finishes the queued writes). Returns A's answer and
/// the block files.
fn leave_a_on_disk(tiers: &str, dir: &Path) -> (Value, Vec<PathBuf>) {
    let (server, port) = serve(Some(tiers));
    let first = complete(port, &prompt("A"));
    assert_eq!(cached(&first), 0, "{first}");
    complete(port, &prompt("B"));
    let written = wait_for_block_files(port, dir);
    stop(server);
    assert!(files(dir, "tmp").is_empty());
    let files = files(dir, "kv");
    assert!(
        written.iter().all(|f| files.contains(f)),
        "{written:?} {files:?}"
    );
    for f in &files {
        let len = std::fs::metadata(f).unwrap().len();
        assert!(len >= FILE_BYTES, "{}: {len} bytes", f.display());
    }
    (answer(&first), files)
}

#[test]
fn the_disk_tier_survives_a_restart() {
    let dir = disk_dir();
    let tiers = host_and_disk(dir.path(), "");
    let (first, files) = leave_a_on_disk(&tiers, dir.path());

    // A new process on the same directory: its host tier is empty, so
    // what A finds comes from the previous run's files.
    let (_server, port) = serve(Some(&tiers));
    let again = complete(port, &prompt("A"));
    assert_eq!(answer(&again), first);
    // The pool evicted A's head first, host memory passed it on in the
    // same order: the files are A's first blocks, and all come back.
    assert_eq!(cached(&again), files.len() as u64 * 16, "{again}");
    let m = scrape(port);
    assert!(metric(&m, HITS, "tier=\"disk\"") > 0.0, "{m}");
    assert!(
        metric(&m, BYTES, "direction=\"up\",tier=\"disk\"") >= BLOCK_BYTES as f64,
        "{m}"
    );
    assert_eq!(metric(&m, ERRORS, ""), 0.0, "{m}");
}

/// A node killed (SIGKILL, no shutdown) as soon as its disk tier starts
/// writing: whatever the kill left (whole files, unfinished `.tmp` ones)
/// a restart on the same directory deletes the unfinished ones and
/// answers as before, from whole files only, with no tier error. (Which
/// writes the kill catches is up to timing; kvtier's tests leave
/// unfinished and torn files on purpose.)
#[test]
fn a_node_killed_mid_write_restarts_from_whole_files_only() {
    let dir = disk_dir();
    // Direct I/O: each write goes to the device, so the kill finds
    // writes under way.
    let tiers = host_and_disk(dir.path(), r#", "disk_offload_direct_io": true"#);
    let (mut server, port) = serve(Some(&tiers));
    let first = answer(&complete(port, &prompt("A")));
    // B evicts A's blocks down to disk while it runs; the kill comes at
    // the first file, with B (and most writes) still under way.
    let body = json!({"prompt": prompt("B"), "max_tokens": MAX_TOKENS, "temperature": 0});
    let b = std::thread::spawn(move || http(port, "POST", "/v1/completions", &body.to_string()));
    // Watched without a pause: the writes take milliseconds in all.
    let deadline = Instant::now() + Duration::from_secs(30);
    while files(dir.path(), "tmp").is_empty() && files(dir.path(), "kv").is_empty() {
        assert!(Instant::now() < deadline, "no block write started");
    }
    server.kill9();
    let _ = b.join();
    let left = (
        files(dir.path(), "kv").len(),
        files(dir.path(), "tmp").len(),
    );
    println!(
        "left by the kill: {} block files, {} unfinished",
        left.0, left.1
    );

    let (_server, port) = serve(Some(&tiers));
    assert!(files(dir.path(), "tmp").is_empty(), "unfinished files kept");
    let again = complete(port, &prompt("A"));
    assert_eq!(answer(&again), first);
    assert_eq!(cached(&again) % 16, 0, "{again}");
    let m = scrape(port);
    // The unfinished writes are counted, and nothing else went wrong.
    assert_eq!(
        metric(&m, ERRORS, "kind=\"unfinished\""),
        left.1 as f64,
        "{m}"
    );
    assert_eq!(metric(&m, ERRORS, ""), left.1 as f64, "{m}");
    // Every hit came from a whole file the restart found.
    assert!(metric(&m, HITS, "tier=\"disk\"") <= left.0 as f64, "{m}");
}

#[test]
fn corrupt_or_truncated_block_files_are_recomputed() {
    // Written and read with O_DIRECT (a disk file system takes it).
    let dir = disk_dir();
    let tiers = host_and_disk(dir.path(), r#", "disk_offload_direct_io": true"#);
    let (first, files) = leave_a_on_disk(&tiers, dir.path());
    assert!(files.len() >= 2, "{files:?}");
    for (i, f) in files.iter().enumerate() {
        let mut bytes = std::fs::read(f).unwrap();
        if i % 2 == 0 {
            // One bit of the block's payload.
            let at = 40 + BLOCK_BYTES as usize / 2;
            bytes[at] ^= 0x10;
        } else {
            bytes.truncate(bytes.len() / 2);
        }
        std::fs::write(f, bytes).unwrap();
    }

    let (_server, port) = serve(Some(&tiers));
    let again = complete(port, &prompt("A"));
    assert_eq!(answer(&again), first);
    // Its first block's file is damaged: nothing restored.
    assert_eq!(cached(&again), 0, "{again}");
    let m = scrape(port);
    assert!(
        metric(&m, ERRORS, "kind=\"corrupt\",tier=\"disk\"") > 0.0,
        "{m}"
    );
    assert_eq!(metric(&m, HITS, "tier=\"disk\""), 0.0, "{m}");
    wait_until(
        "the damaged files to be deleted",
        Duration::from_secs(10),
        || files.iter().all(|f| !f.exists()),
    );
}

#[test]
fn a_full_disk_loses_blocks_not_answers() {
    // Room for 5 block files (91 pages each), under a 1 GB budget.
    let tmpfs = Mount::tmpfs("2m");
    let tiers = host_and_disk(tmpfs.path(), r#", "disk_offload_max_gb": 1"#);
    let (server, port) = serve(Some(&tiers));
    let (_plain, plain) = serve(None);
    for tag in ["C", "D", "E", "F"] {
        let p = prompt(tag);
        assert_eq!(
            answer(&complete(port, &p)),
            answer(&complete(plain, &p)),
            "{tag}"
        );
    }
    wait_until(
        "failed writes to be counted",
        Duration::from_secs(30),
        || metric(&scrape(port), ERRORS, "kind=\"write\",tier=\"disk\"") > 0.0,
    );
    // What did fit is whole, and no temporary file is left behind.
    wait_until("the writer to settle", Duration::from_secs(30), || {
        files(tmpfs.path(), "tmp").is_empty()
    });
    let kept = files(tmpfs.path(), "kv");
    assert!(!kept.is_empty() && kept.len() <= 5, "{kept:?}");
    for f in &kept {
        assert_eq!(std::fs::metadata(f).unwrap().len(), FILE_BYTES);
    }
    // Still healthy, and still right: C's first blocks were the ones that
    // fit, and come back; the rest is recomputed.
    assert_eq!(http(port, "GET", "/health", "").status, 200);
    for tag in ["C", "G"] {
        let p = prompt(tag);
        let v = complete(port, &p);
        assert_eq!(answer(&v), answer(&complete(plain, &p)), "{tag}");
        let want = if tag == "C" {
            kept.len() as u64 * 16
        } else {
            0
        };
        assert_eq!(cached(&v), want, "{tag}: {v}");
    }
    stop(server);
}

#[test]
fn one_prefill_one_decode_with_tiers_restores_instead_of_transferring() {
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("tiers");
    let mut extra = POOL.to_vec();
    extra.extend(["--kv-connector-config", HOST]);
    let node = |role, id| Node::start(&etcd.url(), &cluster, role, id, &extra);
    let p = node("prefill", "p0");
    let d = node("decode", "d0");
    let r = Router::start(&etcd.url(), &cluster);
    r.wait_members(1, 1, Duration::from_secs(10));
    // The answers of one process with a pool holding everything.
    let (_plain, plain) = start_serve(&[]);
    let transferred = || metric(&p.metrics(), "tandem_dkv_blocks_transferred_total", "");

    let (a, b) = (prompt("A"), prompt("B"));
    let mut moved = Vec::new();
    for (i, prompt) in [&a, &b, &a, &b].into_iter().enumerate() {
        let before = transferred();
        let v = complete(r.port, prompt);
        assert_eq!(answer(&v), answer(&complete(plain, prompt)), "request {i}");
        let full_blocks = (v["usage"]["prompt_tokens"].as_u64().unwrap() - 1) / 16 * 16;
        let want = if i < 2 { 0 } else { full_blocks };
        assert_eq!(cached(&v), want, "request {i}: {v}");
        moved.push(transferred() - before);
    }
    // The first A and B came over UCX; their repeats came back from the
    // decode node's host tier instead.
    assert!(moved[0] > 0.0 && moved[1] > 0.0, "{moved:?}");
    assert!(moved[2] < moved[0] && moved[3] < moved[1], "{moved:?}");
    let dm = d.metrics();
    assert!(metric(&dm, HITS, "tier=\"host\"") > 0.0, "{dm}");
    assert_eq!(metric(&dm, ERRORS, ""), 0.0, "{dm}");
    d.assert_idle();
}

/// The prefix fetches a node made, by outcome.
fn fetches(node: &Node, outcome: &str) -> f64 {
    metric(
        &node.metrics(),
        "tandem_decode_prefix_fetches_total",
        &format!("outcome=\"{outcome}\""),
    )
}

/// Cluster-wide reuse through the router: two decode nodes and a router
/// that ignores overlap (`--prefill-weight 0`), so that repeats of one
/// prompt land on both. The first request computes the prompt on one
/// node; the first repeat that lands on the other is told (by the
/// router's index) that its peer holds the prefix, and fetches those
/// blocks over UCX instead of computing them: every answer equals
/// `serve`'s, the fetched prompt reports its full blocks cached, the
/// fetch is counted as peer-tier hits, and neither node holds a block
/// after.
#[test]
fn a_second_decode_node_fetches_a_prefix_the_first_computed() {
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("fetch");
    let node = |id| Node::start(&etcd.url(), &cluster, "decode", id, &[]);
    let (a, b) = (node("d-a"), node("d-b"));
    let r = Router::start_with(&etcd.url(), &cluster, &["--prefill-weight", "0"]);
    r.wait_members(0, 2, Duration::from_secs(10));
    let (_plain, plain) = start_serve(&[]);
    let x = prompt("X");
    let want = answer(&complete(plain, &x));
    let fetched = || fetches(&a, "fetched") + fetches(&b, "fetched");

    let first = complete(r.port, &x);
    assert_eq!(answer(&first), want);
    assert_eq!(cached(&first), 0, "{first}");
    let full = (first["usage"]["prompt_tokens"].as_u64().unwrap() - 1) / 16 * 16;
    let mut repeats = 0;
    while fetched() == 0.0 {
        repeats += 1;
        assert!(
            repeats <= 12,
            "12 repeats never reached the node without the prefix"
        );
        let v = complete(r.port, &x);
        assert_eq!(answer(&v), want, "repeat {repeats}");
        // From the node's own cache, or fetched: never computed again.
        assert_eq!(cached(&v), full, "repeat {repeats}: {v}");
    }
    assert_eq!(fetched(), 1.0);
    let (am, bm) = (a.metrics(), b.metrics());
    let hits = metric(&am, HITS, "tier=\"peer\"") + metric(&bm, HITS, "tier=\"peer\"");
    assert_eq!(hits, (full / 16) as f64, "{am}\n{bm}");
    let up = metric(&am, BYTES, "tier=\"peer\"") + metric(&bm, BYTES, "tier=\"peer\"");
    assert_eq!(up, (full / 16 * BLOCK_BYTES) as f64);
    assert!(
        metric(&scrape(r.port), "tandem_router_prefix_sources_total", "") >= 1.0,
        "the router never named a prefix source"
    );
    a.assert_idle();
    b.assert_idle();
}

/// `Generate` straight to the decode node on `port` (naming `source` as
/// holding the prompt's first blocks, if any); its tokens and usage.
async fn generate_from(
    port: u16,
    prompt: &[u32],
    source: Option<pb::PrefixSource>,
) -> (Vec<u32>, pb::Finished) {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let info = pb::worker_client::WorkerClient::new(channel.clone())
        .info(pb::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let req = pb::GenerateRequest {
        version: tandem_proto::PROTOCOL_VERSION,
        fingerprint: info.fingerprint,
        prompt: prompt.to_vec(),
        sampling: Some((&SamplingParams::greedy()).into()),
        max_tokens: MAX_TOKENS as u32,
        stop_token_ids: model().text.tokenizer.stop_ids(),
        prefix_source: source,
        ..Default::default()
    };
    let mut stream = pb::decode_client::DecodeClient::new(channel)
        .generate(req)
        .await
        .unwrap()
        .into_inner();
    let mut tokens = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        match m.kind {
            Some(pb::generate_response::Kind::Token(t)) => tokens.push(t.id),
            Some(pb::generate_response::Kind::Finished(f)) => return (tokens, f),
            None => {}
        }
    }
    panic!("stream ended without Finished after {tokens:?}");
}

/// A peer that dies mid-fetch: the holder computed the prompt, is frozen
/// (SIGSTOP) so the fetching node's call hangs with its blocks granted,
/// then killed. The fetch fails, its blocks wait until no write can land,
/// and the prompt is computed on the fetching node: the reference tokens,
/// one peer-tier fetch error, nothing held after, and the node serves on.
#[test]
fn a_peer_killed_mid_fetch_is_a_miss() {
    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("fetchkill");
    let mut holder = Node::start(&etcd.url(), &cluster, "decode", "holder", &[]);
    let fetcher = Node::start(&etcd.url(), &cluster, "decode", "fetcher", &[]);
    let x = model().text.tokenizer.encode(&prompt("K"), true).unwrap();
    let want = model_reference(&x);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let full = (x.len() - 1) / 16;
    let source = pb::PrefixSource {
        worker_id: "holder".into(),
        endpoint: format!("http://127.0.0.1:{}", holder.grpc),
        blocks: full as u32,
    };
    let (computed, f) = rt.block_on(generate_from(holder.grpc, &x, None));
    assert_eq!(computed, want);
    assert_eq!(f.cached_tokens, 0);

    let signal = |sig: &str, pid: u32| {
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP", holder.proc.pid());
    let (port, sent) = (fetcher.grpc, x.clone());
    let call = rt.spawn(async move { generate_from(port, &sent, Some(source)).await });
    wait_until(
        "the fetcher to wait on the frozen holder",
        Duration::from_secs(10),
        || fetcher.health()["importing"].as_u64() == Some(1),
    );
    holder.proc.kill9();
    let (tokens, f) = rt.block_on(call).unwrap();
    assert_eq!(tokens, want);
    assert_eq!(f.cached_tokens, 0, "{f:?}");
    let fm = fetcher.metrics();
    assert_eq!(
        metric(&fm, ERRORS, "tier=\"peer\",kind=\"fetch\""),
        1.0,
        "{fm}"
    );
    fetcher.assert_idle();
    // The node serves on, from its own cache now.
    let (again, f) = rt.block_on(generate_from(fetcher.grpc, &x, None));
    assert_eq!(again, want);
    assert_eq!(f.cached_tokens as usize, full * 16);
    fetcher.assert_idle();
}

/// The local greedy tokens for `prompt`.
fn model_reference(prompt: &[u32]) -> Vec<u32> {
    reference_output(prompt.to_vec(), SamplingParams::greedy(), MAX_TOKENS).tokens
}
