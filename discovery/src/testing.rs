//! A private etcd server for tests (feature `testing`): free loopback ports,
//! a temporary data dir, and stop/start to simulate outages.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long [`EtcdServer::start`] waits for etcd to answer: a fresh
/// single-member cluster is up in about a second; the slack is for a loaded
/// two-core CI machine.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A child `etcd` process, killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    bin: PathBuf,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    tls: Option<ServerTls>,
    child: Option<Child>,
}

/// PEM files of an etcd that serves clients over TLS and demands client
/// certificates signed by `ca` (`--client-cert-auth`).
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Where one launch listens and what it is given.
struct Launch<'a> {
    client_port: u16,
    peer_port: u16,
    tls: Option<(&'a ServerTls, u16)>,
}

impl EtcdServer {
    /// Starts etcd (from `PATH`, else `/usr/bin/etcd`) on free loopback
    /// ports and waits until it reports healthy.
    pub fn start() -> io::Result<EtcdServer> {
        Self::start_inner(None)
    }

    /// Like [`EtcdServer::start`], but clients must speak TLS and present a
    /// certificate signed by `tls.ca` ([`EtcdServer::url`] is `https://`).
    /// Health is probed on a separate plain-HTTP metrics port.
    pub fn start_tls(tls: ServerTls) -> io::Result<EtcdServer> {
        Self::start_inner(Some(tls))
    }

    fn start_inner(tls: Option<ServerTls>) -> io::Result<EtcdServer> {
        let bin = find_etcd()?;
        let dir = tempfile::Builder::new().prefix("tandem-etcd-").tempdir()?;
        let mut last_error = None;
        // A free port can be taken between picking and binding it; pick again
        // a few times before giving up.
        for _ in 0..3 {
            let (client_port, peer_port) = free_ports()?;
            let metrics_port = free_ports()?.0;
            let l = Launch {
                client_port,
                peer_port,
                tls: tls.as_ref().map(|t| (t, metrics_port)),
            };
            match launch(&bin, dir.path(), &l) {
                Ok(child) => {
                    return Ok(EtcdServer {
                        bin,
                        dir,
                        client_port,
                        peer_port,
                        tls,
                        child: Some(child),
                    });
                }
                Err(e) => {
                    let in_use = e.to_string().contains("address already in use");
                    last_error = Some(e);
                    if !in_use {
                        break;
                    }
                    // Leftovers of the failed attempt must not confuse the next.
                    let _ = std::fs::remove_dir_all(dir.path().join("data"));
                }
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::other("etcd did not start")))
    }

    /// The client URL to put in `EtcdConfig::endpoints`.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Kills etcd (SIGKILL, as a crash) and waits for it; the data dir and
    /// ports are kept for [`EtcdServer::start_again`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same ports with the same data, so keys and
    /// leases written before [`EtcdServer::stop`] come back.
    pub fn start_again(&mut self) -> io::Result<()> {
        self.stop();
        let metrics_port = free_ports()?.0;
        let l = Launch {
            client_port: self.client_port,
            peer_port: self.peer_port,
            tls: self.tls.as_ref().map(|t| (t, metrics_port)),
        };
        self.child = Some(launch(&self.bin, self.dir.path(), &l)?);
        Ok(())
    }

    /// Whether the process is running (it may have exited on its own).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn find_etcd() -> io::Result<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("etcd"))
        .find(|p| is_executable(p));
    let fallback = PathBuf::from("/usr/bin/etcd");
    on_path
        .or_else(|| is_executable(&fallback).then_some(fallback))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "etcd not found on PATH or at /usr/bin/etcd (apt-get install etcd-server)",
            )
        })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Two distinct free ports (both held while picking, so they differ).
fn free_ports() -> io::Result<(u16, u16)> {
    let a = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let b = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// Spawns etcd with its output appended to `dir/etcd.log` and waits until it
/// is healthy; on failure the error carries the tail of that output.
fn launch(bin: &Path, dir: &Path, l: &Launch<'_>) -> io::Result<Child> {
    let (client_port, peer_port) = (l.client_port, l.peer_port);
    let log_path = dir.join("etcd.log");
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let log_start = log.seek(SeekFrom::End(0))?;
    let scheme = if l.tls.is_some() { "https" } else { "http" };
    let client = format!("{scheme}://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let mut cmd = Command::new(bin);
    let health_port = match l.tls {
        None => client_port,
        Some((t, metrics_port)) => {
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key)
                .arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--client-cert-auth")
                .args([
                    "--listen-metrics-urls",
                    &format!("http://127.0.0.1:{metrics_port}"),
                ]);
            metrics_port
        }
    };
    let mut child = cmd
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("default={peer}")])
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("spawning {}: {e}", bin.display())))?;

    let fail = |what: String| {
        let tail = log_tail(&log_path, log_start)
            .unwrap_or_else(|e| format!("(log {} unreadable: {e})", log_path.display()));
        io::Error::other(format!(
            "{what} (client port {client_port}, peer port {peer_port}); its last output:\n{tail}"
        ))
    };
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Err(fail(format!("etcd exited with {status}")));
        }
        if healthy(health_port) {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!(
                "etcd did not become healthy within {STARTUP_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// etcd serves `/health` over HTTP/1 on the client port; it reports true once
/// there is a leader and reads go through, i.e. when clients can use it.
fn healthy(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let probe = || -> io::Result<String> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.set_write_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    };
    probe().is_ok_and(|b| b.contains("\"health\":\"true\""))
}

/// The last lines etcd wrote since `start` (this launch only).
fn log_tail(path: &Path, start: u64) -> io::Result<String> {
    let mut f = File::open(path)?;
    f.seek(SeekFrom::Start(start))?;
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let lines: Vec<&str> = text.lines().collect();
    Ok(lines[lines.len().saturating_sub(20)..].join("\n"))
}
