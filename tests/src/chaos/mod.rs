//! The chaos suite's harness: a disaggregated cluster whose every process
//! (etcd, router, each prefill and decode node) has its own network
//! namespace (`netns`), fault proxies in front of the prefill nodes' gRPC
//! (`proxy`), a steady mixed load with a hard deadline per request
//! (`load`), and the checks every scenario ends with: no hung request, no
//! KV block left in use on any node (`scenario`, which also runs and
//! judges the suite's scenarios).

pub mod load;
pub mod netns;
pub mod proxy;
pub mod scenario;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{Proc, binary, client_builder, gguf_path, ports_in};
use netns::{Net, Space};
use proxy::FaultProxy;

/// Lease TTL of the chaos nodes (s): how long a frozen node stays listed.
pub const LEASE_TTL_S: u64 = 3;
/// The decode nodes' prefill watchdog (ms).
pub const PREFILL_TIMEOUT_MS: u64 = 4000;
/// The router's port in its namespace (fixed, so a restart keeps it).
const ROUTER_PORT: u16 = 8000;
const ETCD_CLIENT_PORT: u16 = 2379;
const ETCD_PEER_PORT: u16 = 2380;

/// A `tandem` node in its namespace.
#[derive(Debug)]
pub struct NsNode {
    pub id: String,
    pub role: &'static str,
    pub space: Space,
    pub grpc: u16,
    pub metrics: u16,
    args: Vec<String>,
    pub proc: Option<Proc>,
}

impl NsNode {
    /// `GET /health` on the node's metrics port (5 s at most).
    pub fn health(&self) -> Option<Value> {
        get_json(self.space.ip, self.metrics, "/health")
    }

    pub fn pid(&self) -> u32 {
        self.proc.as_ref().expect("the node runs").pid()
    }

    /// Kills with SIGKILL.
    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }

    /// Starts it again with the same id, ports and flags.
    pub fn restart(&mut self) {
        self.kill9();
        self.proc = Some(spawn_node(&self.space, &self.id, &self.args));
    }

    /// SIGSTOP (true) or SIGCONT (false).
    pub fn freeze(&self, frozen: bool) {
        signal(self.pid(), if frozen { "-STOP" } else { "-CONT" });
    }

    /// Blocks in use (and anything running, waiting, importing or
    /// exported), once it has settled: polled for up to `within`.
    pub fn settle(&self, within: Duration) -> (u64, Value) {
        let deadline = Instant::now() + within;
        loop {
            let h = self.health().unwrap_or(Value::Null);
            let get = |k: &str| h[k].as_u64().unwrap_or(u64::MAX / 8);
            let busy = get("running") + get("waiting") + get("importing") + get("exported");
            let used = get("kv_blocks_in_use");
            if (busy == 0 && used == 0) || Instant::now() >= deadline {
                return (used + busy, h);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn signal(pid: u32, sig: &str) {
    netns::sh("kill", &[sig, &pid.to_string()]);
}

/// The client of the harness's own probes: 5 s at most per request.
fn probe_client() -> &'static reqwest::blocking::Client {
    static C: std::sync::OnceLock<reqwest::blocking::Client> = std::sync::OnceLock::new();
    C.get_or_init(|| {
        client_builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("an HTTP client")
    })
}

/// `GET` of a JSON document on a namespace address, `None` on any error.
pub fn get_json(ip: Ipv4Addr, port: u16, path: &str) -> Option<Value> {
    let r = probe_client()
        .get(format!("http://{ip}:{port}{path}"))
        .send()
        .ok()?;
    serde_json::from_str(&r.text().ok()?).ok()
}

/// `GET` of a text document (e.g. /metrics), "" on any error.
pub fn get_text(ip: Ipv4Addr, port: u16, path: &str) -> String {
    probe_client()
        .get(format!("http://{ip}:{port}{path}"))
        .send()
        .ok()
        .and_then(|r| r.text().ok())
        .unwrap_or_default()
}

fn spawn_node(space: &Space, id: &str, args: &[String]) -> Proc {
    let mut cmd = Command::new("ip");
    cmd.args(&space.exec_prefix()[1..]).arg(binary()).args(args);
    let mut p = Proc::spawn_command(id, cmd);
    p.wait_line("serving gRPC", Duration::from_secs(120));
    p
}

/// etcd in its namespace, with a data dir that survives restarts.
#[derive(Debug)]
pub struct NsEtcd {
    pub space: Space,
    dir: tempfile::TempDir,
    pub proc: Option<Proc>,
}

impl NsEtcd {
    pub fn url(&self) -> String {
        format!("http://{}:{ETCD_CLIENT_PORT}", self.space.ip)
    }

    pub fn start(space: Space) -> NsEtcd {
        let mut e = NsEtcd {
            space,
            dir: tempfile::tempdir().expect("a temp dir for etcd"),
            proc: None,
        };
        e.restart();
        e
    }

    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }

    /// (Re)starts on the same address and data.
    pub fn restart(&mut self) {
        self.kill9();
        let ip = self.space.ip;
        let client = format!("http://{ip}:{ETCD_CLIENT_PORT}");
        let peer = format!("http://{ip}:{ETCD_PEER_PORT}");
        let mut cmd = Command::new("ip");
        cmd.args(&self.space.exec_prefix()[1..])
            .arg("etcd")
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")]);
        let mut proc = Proc::spawn_command("etcd", cmd);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok =
                get_json(ip, ETCD_CLIENT_PORT, "/health").is_some_and(|v| v["health"] == "true");
            if ok {
                break;
            }
            assert!(
                proc.is_running() && Instant::now() < deadline,
                "etcd in {} never became healthy: {}",
                self.space.name,
                proc.stderr()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.proc = Some(proc);
    }
}

/// The router in its namespace.
#[derive(Debug)]
pub struct NsRouter {
    pub space: Space,
    args: Vec<String>,
    pub proc: Option<Proc>,
}

impl NsRouter {
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((self.space.ip, ROUTER_PORT))
    }

    pub fn health(&self) -> Option<Value> {
        get_json(self.space.ip, ROUTER_PORT, "/health")
    }

    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }

    pub fn restart(&mut self) {
        self.kill9();
        let mut cmd = Command::new("ip");
        cmd.args(&self.space.exec_prefix()[1..])
            .arg(binary())
            .args(&self.args);
        let mut p = Proc::spawn_command("router", cmd);
        let line = p.wait_line("router for", Duration::from_secs(120));
        assert_eq!(ports_in(&line).first(), Some(&ROUTER_PORT), "{line}");
        self.proc = Some(p);
    }

    /// Waits until the router lists exactly these worker counts.
    pub fn wait_members(&self, prefill: usize, decode: usize, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let h = self.health().unwrap_or(Value::Null);
            let n = |k: &str| h[k].as_array().map_or(usize::MAX, Vec::len);
            if n("prefill_workers") == prefill && n("decode_workers") == decode {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "the router's membership never became {prefill}P{decode}D: {h}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A cluster with one namespace per process; the prefill nodes' gRPC is
/// reached through a fault proxy in the root namespace (their advertised
/// endpoint is the proxy's address). Fields drop in order: processes
/// before proxies before the namespaces.
#[derive(Debug)]
pub struct ChaosCluster {
    pub router: NsRouter,
    pub prefills: Vec<NsNode>,
    pub decodes: Vec<NsNode>,
    pub etcd: NsEtcd,
    /// One per prefill node, same order.
    pub proxies: Vec<FaultProxy>,
    pub net: Net,
}

impl ChaosCluster {
    /// `prefill` prefill nodes and `decode` decode nodes, each with a KV
    /// pool of `kv_blocks`.
    pub fn start(name: &str, prefill: usize, decode: usize, kv_blocks: usize) -> ChaosCluster {
        Self::start_with(name, prefill, decode, kv_blocks, &[])
    }

    /// [`ChaosCluster::start`], with `node_flags` added to every node (`{id}`
    /// in a flag replaced by the node's id, e.g. for a directory of its own).
    pub fn start_with(
        name: &str,
        prefill: usize,
        decode: usize,
        kv_blocks: usize,
        node_flags: &[&str],
    ) -> ChaosCluster {
        netns::require_netns();
        let mut names = vec!["etcd".to_string(), "rt".to_string()];
        names.extend((0..prefill).map(|i| format!("p{i}")));
        names.extend((0..decode).map(|i| format!("d{i}")));
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let net = Net::new(&refs);
        let etcd = NsEtcd::start(net.space("etcd").clone());
        let cluster = crate::cluster::unique_cluster(name);
        let gguf: PathBuf = gguf_path();
        let node_args = |role: &str, id: &str, space: &Space, port: u16, advertise: Ipv4Addr| {
            let mut a: Vec<String> = vec![
                role.into(),
                "--cluster".into(),
                cluster.clone(),
                "--id".into(),
                id.into(),
                "--model".into(),
                gguf.to_string_lossy().into_owned(),
                "--threads".into(),
                "1".into(),
                "--lease-ttl".into(),
                LEASE_TTL_S.to_string(),
                "--max-length".into(),
                "512".into(),
                "--max-batch-size".into(),
                "16".into(),
                "--kv-cache-blocks".into(),
                kv_blocks.to_string(),
                "--ucx-tls".into(),
                "tcp".into(),
                "--ucx-net-devices".into(),
                space.dev.clone(),
                "--etcd".into(),
                etcd.url(),
                "--host".into(),
                space.ip.to_string(),
                "--port".into(),
                port.to_string(),
                "--metrics-port".into(),
                (port + 1).to_string(),
                "--advertise-host".into(),
                advertise.to_string(),
            ];
            a.extend(node_flags.iter().map(|f| f.replace("{id}", id)));
            if role == "decode" {
                // Extra decode flags for experiments (e.g. a longer
                // `--quarantine-limit-secs`), whitespace-separated.
                if let Ok(extra) = std::env::var("TANDEM_CHAOS_DECODE_FLAGS") {
                    a.extend(extra.split_whitespace().map(String::from));
                }
                a.extend(
                    [
                        "--remote-prefill-min-tokens",
                        "32",
                        "--prefill-timeout-ms",
                        &PREFILL_TIMEOUT_MS.to_string(),
                    ]
                    .map(String::from),
                );
            }
            a
        };
        let mut proxies = Vec::new();
        let mut prefills = Vec::new();
        for i in 0..prefill {
            let id = format!("p{i}");
            let space = net.space(&id).clone();
            // The proxy picks a free port in the root namespace; the node
            // listens on the same port in its own.
            let proxy_listen = SocketAddr::from((net.proxy_ip(), 0));
            let port_probe = std::net::TcpListener::bind(proxy_listen).expect("a proxy port");
            let port = port_probe.local_addr().unwrap().port();
            drop(port_probe);
            let proxy = FaultProxy::start(
                SocketAddr::from((net.proxy_ip(), port)),
                SocketAddr::from((space.ip, port)),
            )
            .expect("starting the fault proxy");
            let args = node_args("prefill", &id, &space, port, net.proxy_ip());
            let proc = spawn_node(&space, &id, &args);
            prefills.push(NsNode {
                id,
                role: "prefill",
                space,
                grpc: port,
                metrics: port + 1,
                args,
                proc: Some(proc),
            });
            proxies.push(proxy);
        }
        let mut decodes = Vec::new();
        for i in 0..decode {
            let id = format!("d{i}");
            let space = net.space(&id).clone();
            let port = 7000;
            let args = node_args("decode", &id, &space, port, space.ip);
            let proc = spawn_node(&space, &id, &args);
            decodes.push(NsNode {
                id,
                role: "decode",
                space,
                grpc: port,
                metrics: port + 1,
                args,
                proc: Some(proc),
            });
        }
        let rspace = net.space("rt").clone();
        let router_args: Vec<String> = [
            "router",
            "--etcd",
            &etcd.url(),
            "--cluster",
            &cluster,
            "--model",
            &gguf.to_string_lossy(),
            "--host",
            &rspace.ip.to_string(),
            "--port",
            &ROUTER_PORT.to_string(),
            "--max-length",
            "512",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut router = NsRouter {
            space: rspace,
            args: router_args,
            proc: None,
        };
        router.restart();
        router.wait_members(prefill, decode, Duration::from_secs(30));
        ChaosCluster {
            router,
            prefills,
            decodes,
            etcd,
            proxies,
            net,
        }
    }

    /// Prompts each decode node prefilled locally after failed remote
    /// attempts, or retried on another prefill node
    /// (`tandem_decode_prefills_total{outcome="fallback"|"retried"}`; 0
    /// where none is exported yet).
    pub fn fallbacks(&self) -> Vec<f64> {
        self.decodes
            .iter()
            .map(|d| {
                let m = get_text(d.space.ip, d.metrics, "/metrics");
                ["fallback", "retried"]
                    .iter()
                    .map(|o| {
                        let label = format!("outcome=\"{o}\"");
                        crate::metric(&m, "tandem_decode_prefills_total", &label)
                    })
                    .sum()
            })
            .collect()
    }

    /// Fallbacks and retries counted since `before` (a [`Self::fallbacks`]),
    /// over every decode node (a restarted node counts from zero).
    pub fn fallbacks_since(&self, before: &[f64]) -> f64 {
        self.fallbacks()
            .iter()
            .zip(before)
            .map(|(now, b)| if now >= b { now - b } else { *now })
            .sum()
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NsNode> {
        self.prefills.iter().chain(self.decodes.iter())
    }

    /// Waits (up to `within`) for every node to hold no KV block and no
    /// request; returns each node's leftover (0 when settled).
    pub fn settle(&self, within: Duration) -> Vec<(String, u64, Value)> {
        let deadline = Instant::now() + within;
        self.nodes()
            .map(|n| {
                let left = deadline.saturating_duration_since(Instant::now());
                let (used, h) = n.settle(left.max(Duration::from_secs(1)));
                (n.id.clone(), used, h)
            })
            .collect()
    }
}

/// Resident set size of `pid` in KiB (0 if gone).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Least-squares slope of `(x, y)` points.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

/// Whether memory samples `(minute, KiB)` show a leak rather than a one-time
/// step: the least-squares slope is above `bound` KiB/min *and* the
/// high-water mark rises by at least half that rate in each of `windows`
/// consecutive equal slices. A growing arena or cache steps once and then
/// stays; a leak keeps raising the high-water mark slice after slice.
pub fn sustained_growth(points: &[(f64, f64)], windows: usize, bound: f64) -> bool {
    if points.len() < 2 || windows < 2 || slope(points) <= bound {
        return false;
    }
    let (t0, t1) = (points[0].0, points[points.len() - 1].0);
    let width = (t1 - t0) / windows as f64;
    let high_water = |w: usize| {
        let (lo, hi) = (t0 + width * w as f64, t0 + width * (w + 1) as f64);
        points
            .iter()
            .filter(|p| p.0 >= lo && (p.0 < hi || w + 1 == windows))
            .map(|p| p.1)
            .fold(None, |m: Option<f64>, y| Some(m.map_or(y, |m| m.max(y))))
    };
    let marks: Vec<Option<f64>> = (0..windows).map(high_water).collect();
    marks.windows(2).all(|pair| match (pair[0], pair[1]) {
        (Some(a), Some(b)) => b - a >= bound * width / 2.0,
        _ => true,
    })
}

/// The `q` quantile (0..=1) of `v` (nearest rank), `None` when empty.
pub fn quantile(v: &mut [Duration], q: f64) -> Option<Duration> {
    if v.is_empty() {
        return None;
    }
    v.sort();
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_and_quantiles() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 * i as f64 + 1.0)).collect();
        assert!((slope(&pts) - 3.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 1.0)]), 0.0);
        let mut v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&mut v, 0.99), Some(Duration::from_millis(99)));
        assert_eq!(quantile(&mut v, 0.5), Some(Duration::from_millis(50)));
        assert_eq!(quantile(&mut [], 0.5), None);
    }

    #[test]
    fn a_leak_is_sustained_growth_and_a_step_is_not() {
        let minutes = |f: &dyn Fn(f64) -> f64| -> Vec<(f64, f64)> {
            (0..10).map(|i| i as f64 / 6.0).map(|t| (t, f(t))).collect()
        };
        // 2 MiB/min, steadily: a leak.
        let leak = minutes(&|t| 300_000.0 + 2048.0 * t);
        assert!(sustained_growth(&leak, 3, 1024.0));
        // One 4.8 MB step mid-run, flat otherwise (the CI failure that
        // motivated this): steep by least squares, but not sustained.
        let step = minutes(&|t| if t < 0.8 { 300_000.0 } else { 304_800.0 });
        assert!(slope(&step) > 1024.0);
        assert!(!sustained_growth(&step, 3, 1024.0));
        // Flat with noise.
        let flat = minutes(&|t| {
            300_000.0
                + if (t * 6.0) as i64 % 2 == 0 {
                    200.0
                } else {
                    0.0
                }
        });
        assert!(!sustained_growth(&flat, 3, 1024.0));
        // A leak plus a step is still a leak.
        let both = minutes(&|t| 300_000.0 + 2048.0 * t + if t > 0.5 { 5000.0 } else { 0.0 });
        assert!(sustained_growth(&both, 3, 1024.0));
    }
}
