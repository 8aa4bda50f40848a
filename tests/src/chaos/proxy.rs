//! A fault-injecting TCP proxy (toxiproxy-style) for the chaos tests: it
//! forwards every connection accepted on its listening address to one
//! upstream address, and can, switched at any time, delay each forwarded
//! chunk, stall (stop forwarding, so backpressure builds as on a frozen
//! link), refuse new connections (accept, then reset), or reset every open
//! connection. Only loopback and the test namespaces' own addresses are
//! ever targets: the proxy forwards to the one upstream it was given.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often blocked threads look at the switches.
const POLL: Duration = Duration::from_millis(20);

/// The faults in force; each one switchable while connections run.
#[derive(Debug, Default)]
struct Faults {
    /// Added before each chunk is forwarded, in either direction (ms).
    latency_ms: AtomicU64,
    /// Nothing is read or forwarded while set.
    stalled: AtomicBool,
    /// New connections are accepted and reset at once while set.
    refuse: AtomicBool,
}

#[derive(Debug)]
struct Shared {
    faults: Faults,
    stop: AtomicBool,
    /// Both sockets of every open connection, so a reset can cut them.
    conns: Mutex<Vec<(u64, TcpStream, TcpStream)>>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    forwarded_bytes: AtomicU64,
}

/// A running proxy; stopped (and its connections reset) when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and forwards to `upstream`.
    pub fn start(listen: SocketAddr, upstream: SocketAddr) -> io::Result<FaultProxy> {
        assert!(
            allowed_target(upstream),
            "the fault proxy only forwards to loopback or the test namespaces' addresses, not \
             {upstream}"
        );
        let listener = TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            faults: Faults::default(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            forwarded_bytes: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name(format!("proxy {addr}"))
            .spawn(move || accept_loop(listener, upstream, s))?;
        Ok(FaultProxy {
            addr,
            upstream,
            shared,
            acceptor: Some(acceptor),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Delay added to every forwarded chunk (zero: none).
    pub fn set_latency(&self, latency: Duration) {
        self.shared
            .faults
            .latency_ms
            .store(latency.as_millis() as u64, Ordering::Relaxed);
    }

    /// Stops (true) or resumes (false) forwarding on every connection.
    pub fn set_stalled(&self, stalled: bool) {
        self.shared.faults.stalled.store(stalled, Ordering::Relaxed);
    }

    /// New connections are reset as soon as they are accepted while set.
    pub fn set_refuse(&self, refuse: bool) {
        self.shared.faults.refuse.store(refuse, Ordering::Relaxed);
    }

    /// Resets (RST) every open connection; new ones are unaffected.
    pub fn reset_all(&self) -> usize {
        let conns = std::mem::take(
            &mut *self
                .shared
                .conns
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let n = conns.len();
        for (_, a, b) in conns {
            reset(&a);
            reset(&b);
        }
        n
    }

    /// Clears every fault.
    pub fn heal(&self) {
        self.set_latency(Duration::ZERO);
        self.set_stalled(false);
        self.set_refuse(false);
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Connections refused (reset at accept) so far.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.shared
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Bytes forwarded so far, both directions.
    pub fn forwarded_bytes(&self) -> u64 {
        self.shared.forwarded_bytes.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.reset_all();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

/// Loopback, or the chaos namespaces' range (198.18.0.0/15, RFC 2544's
/// benchmarking block: never routed beyond this machine).
pub fn allowed_target(addr: SocketAddr) -> bool {
    match addr.ip() {
        std::net::IpAddr::V4(ip) => {
            let o = ip.octets();
            ip.is_loopback() || (o[0] == 198 && (o[1] == 18 || o[1] == 19))
        }
        std::net::IpAddr::V6(ip) => ip.is_loopback(),
    }
}

/// Closes with RST rather than FIN (SO_LINGER 0), as a crashed or reset
/// peer does.
fn reset(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
    let _ = s.shutdown(Shutdown::Both);
}

fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        let client = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(POLL / 4);
                continue;
            }
            Err(_) => {
                std::thread::sleep(POLL);
                continue;
            }
        };
        if shared.faults.refuse.load(Ordering::Relaxed) {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            reset(&client);
            continue;
        }
        let s = Arc::clone(&shared);
        // Connecting may take a while (a partitioned upstream): not on the
        // accepting thread.
        std::thread::spawn(move || connect_and_pump(client, upstream, s));
    }
}

fn connect_and_pump(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5)) else {
        reset(&client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
    ) else {
        reset(&client);
        reset(&server);
        return;
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    shared.accepted.fetch_add(1, Ordering::Relaxed);
    shared
        .conns
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((id, c3, s3));
    let s = Arc::clone(&shared);
    let up = std::thread::spawn(move || pump(client, server, &s));
    pump(s2, c2, &shared);
    let _ = up.join();
    shared
        .conns
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|(i, _, _)| *i != id);
}

/// Forwards `from` -> `to` until either side closes, applying the faults.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            break;
        }
        if shared.faults.stalled.load(Ordering::Relaxed) {
            std::thread::sleep(POLL);
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                reset(&to);
                return;
            }
        };
        let latency = shared.faults.latency_ms.load(Ordering::Relaxed);
        if latency > 0 {
            std::thread::sleep(Duration::from_millis(latency));
        }
        // A stall that began while the chunk was read holds it back too.
        let held = Instant::now();
        while shared.faults.stalled.load(Ordering::Relaxed) && !shared.stop.load(Ordering::Relaxed)
        {
            std::thread::sleep(POLL);
            if held.elapsed() > Duration::from_secs(3600) {
                break;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            reset(&from);
            return;
        }
        shared
            .forwarded_bytes
            .fetch_add(n as u64, Ordering::Relaxed);
    }
    // Half-close: the other direction may still be sending.
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    /// An upstream that echoes each line back.
    fn echo_server() -> (SocketAddr, JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { return };
                std::thread::spawn(move || {
                    let mut w = s.try_clone().unwrap();
                    for line in std::io::BufReader::new(s).lines() {
                        let Ok(line) = line else { return };
                        if w.write_all(format!("{line}\n").as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, t)
    }

    fn proxy() -> FaultProxy {
        let (up, _t) = echo_server();
        FaultProxy::start("127.0.0.1:0".parse().unwrap(), up).unwrap()
    }

    fn connect(p: &FaultProxy) -> (TcpStream, std::io::BufReader<TcpStream>) {
        let s = TcpStream::connect(p.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let r = std::io::BufReader::new(s.try_clone().unwrap());
        (s, r)
    }

    fn roundtrip(s: &mut TcpStream, r: &mut std::io::BufReader<TcpStream>, msg: &str) -> String {
        s.write_all(format!("{msg}\n").as_bytes()).unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        line
    }

    #[test]
    fn forwards_both_ways() {
        let p = proxy();
        let (mut s, mut r) = connect(&p);
        assert_eq!(roundtrip(&mut s, &mut r, "hello"), "hello\n");
        assert_eq!(roundtrip(&mut s, &mut r, "again"), "again\n");
        assert_eq!(p.accepted(), 1);
        // Counted just after each write: give the last count a moment.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(p.forwarded_bytes(), 24);
    }

    #[test]
    fn latency_delays_each_chunk() {
        let p = proxy();
        let (mut s, mut r) = connect(&p);
        roundtrip(&mut s, &mut r, "warm");
        p.set_latency(Duration::from_millis(150));
        let t = Instant::now();
        assert_eq!(roundtrip(&mut s, &mut r, "slow"), "slow\n");
        // One delay each way.
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        p.heal();
        let t = Instant::now();
        roundtrip(&mut s, &mut r, "fast");
        assert!(
            t.elapsed() < Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_stall_holds_data_until_healed() {
        let p = proxy();
        let (mut s, mut r) = connect(&p);
        roundtrip(&mut s, &mut r, "warm");
        p.set_stalled(true);
        s.write_all(b"held\n").unwrap();
        r.get_ref()
            .set_read_timeout(Some(Duration::from_millis(400)))
            .unwrap();
        let mut line = String::new();
        let e = r.read_line(&mut line).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{e}"
        );
        p.set_stalled(false);
        r.get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        r.read_line(&mut line).unwrap();
        assert_eq!(line, "held\n");
    }

    #[test]
    fn refused_and_reset_connections_fail_at_once() {
        let p = proxy();
        let (mut s, mut r) = connect(&p);
        roundtrip(&mut s, &mut r, "warm");
        assert_eq!(p.reset_all(), 1);
        let mut line = String::new();
        // The peer sees the connection cut: an error or EOF, not a wait.
        let t = Instant::now();
        let got = r.read_line(&mut line);
        assert!(matches!(got, Ok(0) | Err(_)), "{got:?} {line:?}");
        assert!(t.elapsed() < Duration::from_secs(2));

        p.set_refuse(true);
        let (mut s, mut r) = connect(&p);
        let _ = s.write_all(b"nobody\n");
        let mut line = String::new();
        let got = r.read_line(&mut line);
        assert!(matches!(got, Ok(0) | Err(_)), "{got:?} {line:?}");
        assert_eq!(p.refused(), 1);
        p.heal();
        let (mut s, mut r) = connect(&p);
        assert_eq!(roundtrip(&mut s, &mut r, "back"), "back\n");
    }

    #[test]
    fn only_local_targets() {
        assert!(allowed_target("127.0.0.1:1".parse().unwrap()));
        assert!(allowed_target("198.18.7.2:1".parse().unwrap()));
        assert!(!allowed_target("192.0.2.1:1".parse().unwrap()));
        assert!(!allowed_target("8.8.8.8:53".parse().unwrap()));
    }
}
