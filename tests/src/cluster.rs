//! A disaggregated cluster as processes: prefill and decode nodes and
//! routers started from the release binary, plus the prompts and greedy
//! references the cluster tests share.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::{Proc, gguf_path, http, model, ports_in, reference};

/// Lease TTL of the test nodes: how long a killed node stays listed.
pub const LEASE_TTL_S: u64 = 2;

/// A prefill or decode node.
#[derive(Debug)]
pub struct Node {
    pub proc: Proc,
    pub grpc: u16,
    pub metrics: u16,
}

impl Node {
    pub fn start(etcd: &str, cluster: &str, role: &str, id: &str, extra: &[&str]) -> Node {
        Self::start_env(etcd, cluster, role, id, extra, &[])
    }

    /// A node with `extra` flags and `env` variables.
    pub fn start_env(
        etcd: &str,
        cluster: &str,
        role: &str,
        id: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Node {
        let gguf = gguf_path();
        let ttl = LEASE_TTL_S.to_string();
        let mut defaults = vec![
            ("--cluster", cluster),
            ("--id", id),
            ("--model", gguf.to_str().unwrap()),
            ("--threads", "1"),
            ("--lease-ttl", &ttl),
            ("--max-length", "512"),
            ("--max-batch-size", "16"),
            ("--kv-cache-blocks", "512"),
            ("--ucx-tls", "tcp"),
        ];
        if !etcd.is_empty() {
            defaults.push(("--etcd", etcd));
        }
        if role == "decode" {
            defaults.extend([
                ("--remote-prefill-min-tokens", "32"),
                ("--prefill-timeout-ms", "20000"),
            ]);
        }
        let args = command_line(role, &defaults, extra);
        let mut proc = Proc::spawn(id, &args, env);
        let line = proc.wait_line("serving gRPC", Duration::from_secs(120));
        let ports = ports_in(&line);
        assert_eq!(ports.len(), 2, "{line}");
        Node {
            proc,
            grpc: ports[0],
            metrics: ports[1],
        }
    }

    pub fn metrics(&self) -> String {
        http(self.metrics, "GET", "/metrics", "").body
    }

    /// Prompts this decode node had a prefill node compute.
    pub fn remote_prefills(&self) -> f64 {
        crate::metric(
            &self.metrics(),
            "tandem_decode_prefills_total",
            "outcome=\"remote\"",
        )
    }

    pub fn health(&self) -> Value {
        http(self.metrics, "GET", "/health", "").json()
    }

    /// Whether no sequence runs or waits, no handoff is pending and no KV
    /// block is referenced; with the /health body it was read from.
    pub fn idle(&self) -> (bool, Value) {
        let h = self.health();
        let busy = [
            "running",
            "waiting",
            "importing",
            "exported",
            "kv_blocks_in_use",
        ]
        .iter()
        .map(|k| h[k].as_u64().unwrap())
        .sum::<u64>();
        (busy == 0, h)
    }

    /// Waits until no KV block is referenced and no handoff is pending.
    pub fn assert_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (idle, h) = self.idle();
            if idle {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} never went idle: {h}",
                self.proc.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `subcommand`, the `defaults` (flag, value) that `extra` does not set
/// itself, then `extra`: clap refuses a flag given twice, so a test
/// overrides a default (say `--max-length`) by passing it in `extra`.
fn command_line(subcommand: &str, defaults: &[(&str, &str)], extra: &[&str]) -> Vec<String> {
    let mut args = vec![subcommand.to_string()];
    for (flag, value) in defaults {
        if !extra.contains(flag) {
            args.extend([flag.to_string(), value.to_string()]);
        }
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

#[derive(Debug)]
pub struct Router {
    pub proc: Proc,
    pub port: u16,
}

impl Router {
    pub fn start(etcd: &str, cluster: &str) -> Router {
        Self::start_with(etcd, cluster, &[])
    }

    /// A router with `extra` flags; a default flag that `extra` sets too
    /// is left out.
    pub fn start_with(etcd: &str, cluster: &str, extra: &[&str]) -> Router {
        Self::start_env(etcd, cluster, extra, &[])
    }

    /// A router with `extra` flags and `env` variables.
    pub fn start_env(etcd: &str, cluster: &str, extra: &[&str], env: &[(&str, &str)]) -> Router {
        let gguf = gguf_path();
        let defaults = [
            ("--etcd", etcd),
            ("--cluster", cluster),
            ("--model", gguf.to_str().unwrap()),
            ("--port", "0"),
            ("--max-length", "512"),
        ];
        let args = command_line("router", &defaults, extra);
        let mut proc = Proc::spawn("router", &args, env);
        let line = proc.wait_line("router for", Duration::from_secs(120));
        let port = ports_in(&line)[0];
        Router { proc, port }
    }

    pub fn health(&self) -> Value {
        http(self.port, "GET", "/health", "").json()
    }

    /// Waits until the router sees exactly these worker counts.
    pub fn wait_members(&self, prefill: usize, decode: usize, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let h = self.health();
            let n = |k: &str| h[k].as_array().map_or(0, Vec::len);
            if n("prefill_workers") == prefill && n("decode_workers") == decode {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "membership never became {prefill}P{decode}D: {h}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn complete(&self, prompt: &str, max_tokens: usize) -> Value {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
        let r = http(self.port, "POST", "/v1/completions", &body.to_string());
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    }
}

pub fn short_prompt() -> &'static str {
    "The capital of France is"
}

/// About 120 tokens: well over the decode node's 32-token local threshold.
pub fn long_prompt(i: usize) -> String {
    let subjects = [
        "woodcutter",
        "baker",
        "fisherman",
        "weaver",
        "smith",
        "miller",
    ];
    format!(
        "{} Once upon a time, in a small village at the edge of a great forest, there lived an old {} \
         and his three daughters. Every morning he walked into the forest, and every evening he came \
         home with stories of what he had seen among the trees. One day, the youngest daughter asked him",
        "Listen to this story. ".repeat(4 + i % 3),
        subjects[i % subjects.len()],
    )
}

/// A prompt the model continues for a long time (counting), so that a
/// stream is surely still running when its node is killed.
pub fn counting_prompt(i: usize) -> String {
    let numbers: Vec<String> = (1..=40 + i).map(|n| n.to_string()).collect();
    format!("Count from 1 to 1000: {},", numbers.join(", "))
}

pub fn expected(prompt: &str, max_tokens: usize) -> String {
    reference(
        model().text.tokenizer.encode(prompt, true).unwrap(),
        max_tokens,
    )
}

pub fn unique_cluster(name: &str) -> String {
    format!("{name}{}", std::process::id())
}
