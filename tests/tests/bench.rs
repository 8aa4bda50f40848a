//! End to end: `tandem bench` multi-turn sessions against a real `tandem
//! serve` (prefix caching on): turns 2+ must find the previous turn's blocks
//! in the server's prefix cache.
//!
//! Needs the release binary and `TANDEM_TEST_GGUF`, as tests/serve.rs does.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

fn binary() -> PathBuf {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("TANDEM_BIN") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        candidates.push(PathBuf::from(d).join("release").join("tandem"));
    }
    candidates.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/tandem"));
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| panic!("the release binary is missing (looked at {candidates:?})"))
}

/// `tandem serve` on a free port; killed on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start() -> Server {
        let gguf = std::env::var("TANDEM_TEST_GGUF")
            .expect("TANDEM_TEST_GGUF must point at SmolLM2-135M-Instruct.Q4_1.gguf");
        let mut child = Command::new(binary())
            .args([
                "serve",
                "--model",
                &gguf,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ])
            .args(["--max-length", "2048", "--kv-cache-blocks", "1024"])
            .env("TANDEM_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning tandem serve");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut server = Server { child, port: 0 };
        while server.port == 0 {
            let line = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("tandem serve did not report its address");
            if let Some(rest) = line.strip_prefix("tandem: serving ")
                && let Some((_, url)) = rest.rsplit_once(" on http://")
            {
                server.port = url.rsplit(':').next().unwrap().trim().parse().unwrap();
            }
        }
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const SESSIONS: usize = 3;
const TURNS: usize = 3;

#[test]
fn multi_turn_sessions_reuse_the_previous_turn() {
    let server = Server::start();
    let json = std::env::temp_dir().join(format!("tandem-bench-mt-{}.json", std::process::id()));
    let out = Command::new(binary())
        .arg("bench")
        .args(["--url", &format!("http://127.0.0.1:{}", server.port)])
        .args(["--multi-turn-sessions", &SESSIONS.to_string()])
        .args(["--turns", &TURNS.to_string()])
        .args(["--concurrency", "2", "--input-len-range", "16:48"])
        .args(["--output-len", "12", "--quiet", "--timeout", "300"])
        .arg("--json")
        .arg(&json)
        .output()
        .expect("running tandem bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tandem bench failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("KV retention (turns 2+)"), "{stdout}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(v["num_requests"], SESSIONS * TURNS);
    let r = &v["results"][0];
    assert_eq!(
        (r["completed"].as_u64(), r["errors"].as_u64()),
        (Some((SESSIONS * TURNS) as u64), Some(0)),
        "{r}"
    );
    let mt = &r["multi_turn"];
    let per_turn = mt["per_turn"].as_array().unwrap();
    assert_eq!(per_turn.len(), TURNS, "{mt}");
    for (i, t) in per_turn.iter().enumerate() {
        assert_eq!(t["completed"], SESSIONS, "{t}");
        assert_eq!(t["ttft"]["count"], SESSIONS, "{t}");
        let n = t["turn"].as_u64().unwrap();
        assert_eq!(n, i as u64 + 1, "turns out of order: {mt}");
        if n > 1 {
            let ret = t["retention"].as_f64().unwrap();
            assert!(ret > 0.0, "turn {n} reused nothing: {t}");
            assert!(t["cached_tokens_mean"].as_f64().unwrap() > 0.0, "{t}");
        }
    }
    assert!(mt["retention"].as_f64().unwrap() > 0.0, "{mt}");
    assert_eq!(mt["retention_requests"], SESSIONS * (TURNS - 1));
}

/// `bench-engine --profile` on one rank and on two tensor-parallel ranks
/// (Qwen2.5's heads split in two; SmolLM2's nine do not): the file loads as
/// a profile, says what it measured, and `tandem plan` accepts it.
#[test]
fn bench_engine_writes_profiles_the_planner_reads() {
    let dir = tempfile::tempdir().unwrap();
    let models = [
        (
            std::env::var("TANDEM_TEST_GGUF").expect("TANDEM_TEST_GGUF"),
            1,
        ),
        (
            std::env::var("TANDEM_TEST_QWEN2_GGUF").expect("TANDEM_TEST_QWEN2_GGUF"),
            2,
        ),
    ];
    for (gguf, tp) in models {
        let path = dir.path().join(format!("tp{tp}.json"));
        let out = Command::new(binary())
            .arg("bench-engine")
            .args(["--model", &gguf, "--threads", "2", "--tp", &tp.to_string()])
            .args([
                "--pp", "32", "--tg", "4", "--batch", "2", "--npp", "16", "--ntg", "4",
            ])
            .args(["--reps", "1", "--profile", path.to_str().unwrap()])
            .args(["--profile-prefill", "16,32", "--profile-batch", "1,2"])
            .args(["--profile-context", "16,48"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "bench-engine --tp {tp}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("B=2 npp16 ntg4 gen"), "{stdout}");
        let p = tandem_perfmodel::EngineProfile::load(&path).unwrap();
        assert_eq!(p.tp, tp);
        let prefill: Vec<usize> = p.prefill.iter().map(|x| x.tokens).collect();
        assert_eq!(prefill, [16, 32]);
        let grid: Vec<(usize, usize)> = p.decode.iter().map(|d| (d.batch, d.context)).collect();
        assert_eq!(grid.len(), 4, "{grid:?}");
        for (b, c) in [(1, 16), (1, 48), (2, 16), (2, 48)] {
            assert!(grid.contains(&(b, c)), "{grid:?} lacks {b}x{c}");
        }
        assert!(p.prefill.iter().all(|x| x.seconds > 0.0));
        assert!(p.decode.iter().all(|x| x.seconds > 0.0));

        let report = dir.path().join(format!("plan-tp{tp}.json"));
        let plan = Command::new(binary())
            .args(["plan", "--profile", path.to_str().unwrap()])
            .args(["--rate", "1", "--input-len", "32", "--output-len", "8"])
            .args(["--nodes", "2", "--requests", "50"])
            .args(["--json", report.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            plan.status.success(),
            "plan over the tp{tp} profile: {}\n{}",
            String::from_utf8_lossy(&plan.stdout),
            String::from_utf8_lossy(&plan.stderr)
        );
        let v: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
        let candidates = v["candidates"].as_array().unwrap();
        assert!(!candidates.is_empty(), "{v}");
        for c in candidates {
            // A node that steps in milliseconds sustains some requests per
            // second, not an unbounded rate. (How many depends on how fast
            // this machine ran the profile: a loaded machine gave 0.25.)
            let r = c["max_good_rate"].as_f64().unwrap();
            assert!(r > 0.0 && r < 1e4, "{}: {r} req/s", c["topology"]);
        }
    }
}
