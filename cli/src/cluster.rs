//! `tandem cluster up`: the supervisor that starts etcd, prefill and
//! decode nodes and a router as processes on loopback (for people and
//! tests), and stops them in drain order.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

use crate::serve::{SHUTDOWN_GRACE, runtime, shutdown_signal};
use crate::telemetry::TelemetryArgs;

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Start etcd, prefill and decode nodes and a router on loopback; stop them all on Ctrl-C.
    Up(ClusterUpArgs),
}

#[derive(Debug, Args)]
pub struct ClusterUpArgs {
    /// Prefill nodes.
    #[arg(long, env = "TANDEM_CLUSTER_PREFILL", default_value_t = 1)]
    pub prefill: usize,
    /// Decode nodes.
    #[arg(long, env = "TANDEM_CLUSTER_DECODE", default_value_t = 1)]
    pub decode: usize,
    /// Router port.
    #[arg(long, env = "TANDEM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Model for every process.
    #[arg(long, env = "TANDEM_MODEL", default_value = tandem_modelfile::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Use this etcd instead of starting one.
    #[arg(long, env = "TANDEM_ETCD")]
    pub etcd: Option<String>,
    /// Kernel threads per node.
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 1)]
    pub threads: usize,
    /// KV connector of the nodes.
    #[arg(long, env = "TANDEM_KV_CONNECTOR", default_value = "ucx", value_parser = ["ucx", "local"])]
    pub kv_connector: String,
    /// The nodes' dKV key file (see `tandem prefill --help`); default: a
    /// key the nodes create in the cluster's etcd.
    #[arg(long, env = "TANDEM_DKV_KEY_FILE")]
    pub dkv_key_file: Option<PathBuf>,
    /// Passed on to every process.
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Children stopped when dropped, in drain order: the router first (it
/// stops taking requests and finishes its streams), then the nodes (they
/// drain and deregister from etcd), then etcd. Each stage gets SIGTERM,
/// then SIGKILL after a deadline.
struct Procs(Vec<(String, Stage, Child)>);

/// When a child stops: higher stages first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Etcd,
    Node,
    Router,
}

impl Procs {
    fn push(&mut self, name: &str, stage: Stage, child: Child) {
        self.0.push((name.to_string(), stage, child));
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for stage in [Stage::Router, Stage::Node, Stage::Etcd] {
            let group: Vec<_> = self.0.iter_mut().filter(|(_, s, _)| *s == stage).collect();
            stop_all(group);
        }
    }
}

/// SIGTERM to each, then waits for all (SIGKILL past a deadline above the
/// binary's own drain grace).
fn stop_all(mut group: Vec<&mut (String, Stage, Child)>) {
    for (_, _, c) in group.iter_mut() {
        if let Ok(None) = c.try_wait() {
            // SAFETY: plain kill(2) on our own, not yet reaped child's pid.
            unsafe { libc_kill(c.id() as i32, 15) };
        }
    }
    let deadline = Instant::now() + SHUTDOWN_GRACE + Duration::from_secs(5);
    for (name, _, c) in group {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Ok(None) = c.try_wait() {
            eprintln!("tandem cluster: {name} did not stop; killing it");
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// A terminal's Ctrl-C signals the whole foreground process group; each
/// child gets its own group so that only we see it and stop them in order.
fn own_group(cmd: &mut Command) -> &mut Command {
    std::os::unix::process::CommandExt::process_group(cmd, 0)
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Starts `cmd` and waits for its stdout line containing `marker`.
fn start(
    procs: &mut Procs,
    name: &str,
    stage: Stage,
    mut cmd: Command,
    marker: &str,
) -> Result<String> {
    let mut child = own_group(&mut cmd)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    procs.push(name, stage, child);
    let mut lines = BufReader::new(stdout).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) => {
                println!("[{name}] {line}");
                if line.contains(marker) {
                    // Keep draining its stdout so it never blocks on a full pipe.
                    std::thread::spawn(move || lines.for_each(drop));
                    return Ok(line);
                }
            }
            _ => bail!("{name} exited before it was ready"),
        }
    }
}

pub fn run_cluster(cmd: ClusterCommand) -> Result<()> {
    let ClusterCommand::Up(args) = cmd;
    if args.prefill == 0 && args.decode == 0 {
        bail!("--decode must be at least 1");
    }
    if args.decode == 0 {
        bail!("--decode must be at least 1 (the router needs a decode node)");
    }
    args.telemetry.validate()?;
    if let Some(f) = &args.dkv_key_file {
        crate::dkv_key::read(f)?;
    }
    let telemetry = |c: &mut Command| {
        if let Some(e) = &args.telemetry.otlp_endpoint {
            c.args(["--otlp-endpoint", e]);
        }
    };
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut procs = Procs(Vec::new());
    let data = std::env::temp_dir().join(format!("tandem-cluster-etcd-{}", std::process::id()));
    let etcd_url = match &args.etcd {
        Some(u) => u.clone(),
        None => {
            let (client, peer) = (free_port()?, free_port()?);
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let mut c = Command::new("etcd");
            c.args(["--data-dir", &data.to_string_lossy()])
                .args([
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                ])
                .args([
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                ])
                .args(["--initial-cluster", &format!("default={peer_url}")])
                .stderr(Stdio::null());
            let child = own_group(&mut c)
                .stdout(Stdio::null())
                .spawn()
                .context("starting etcd (apt install etcd-server)")?;
            procs.push("etcd", Stage::Etcd, child);
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
                if Instant::now() > deadline {
                    bail!("etcd did not start on {url}");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            println!("tandem cluster: etcd on {url}");
            url
        }
    };
    let node = |role: &str, i: usize| {
        let mut c = Command::new(&exe);
        c.arg(role)
            .args(["--etcd", &etcd_url, "--model", &args.model])
            .args(["--id", &format!("{role}-{i}")])
            .args(["--threads", &args.threads.to_string()])
            .args(["--kv-connector", &args.kv_connector]);
        if let Some(f) = &args.dkv_key_file {
            c.arg("--dkv-key-file").arg(f);
        }
        telemetry(&mut c);
        c
    };
    for i in 0..args.prefill {
        start(
            &mut procs,
            &format!("prefill-{i}"),
            Stage::Node,
            node("prefill", i),
            "serving gRPC",
        )?;
    }
    for i in 0..args.decode {
        start(
            &mut procs,
            &format!("decode-{i}"),
            Stage::Node,
            node("decode", i),
            "serving gRPC",
        )?;
    }
    let mut router = Command::new(&exe);
    router
        .arg("router")
        .args(["--etcd", &etcd_url, "--model", &args.model])
        .args(["--port", &args.port.to_string()]);
    telemetry(&mut router);
    start(&mut procs, "router", Stage::Router, router, "router for")?;
    println!(
        "tandem cluster: up ({} prefill, {} decode); Ctrl-C stops it",
        args.prefill, args.decode
    );
    let rt = runtime()?;
    rt.block_on(shutdown_signal());
    drop(procs);
    let _ = std::fs::remove_dir_all(&data);
    Ok(())
}
