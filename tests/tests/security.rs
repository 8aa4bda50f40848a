//! End to end, a cluster that lets no one in: every internal gRPC
//! connection under mutual TLS with a cluster CA made for the test, the
//! OpenAI port over HTTPS. The cluster must still serve correct greedy
//! output through a real prefill -> decode handoff, while gRPC callers
//! without a CA-signed certificate are refused by every node, `Worker.Events`
//! is unreadable without one, and workers registered in etcd by strangers
//! never receive a request (the attack of issue 16, item 3).
//!
//! Needs the release binary, `TANDEM_TEST_GGUF`, `etcd` and libucx
//! (scripts/test.sh provides all).

#![allow(clippy::unwrap_used)]

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};
use tandem_discovery::testing::EtcdServer;
use tandem_discovery::{EtcdConfig, Registration, Role};
use tandem_proto::pb;
use tandem_proto::pb::worker_client::WorkerClient;
use tandem_proto::tls::{ClusterTls, PeerConnector, TlsFiles};
use tandem_testkit::tls::{PemFiles, TestCa};
use tandem_tests::cluster::{Node, Router, expected, long_prompt, short_prompt, unique_cluster};
use tokio_rustls::rustls;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const MAX_TOKENS: usize = 8;

/// The name node certificates carry; peers check it instead of the
/// dialled address (`--cluster-server-name`), as in a pod network.
const NODE_NAME: &str = "tandem-node";

fn tls_flags(ca: &TestCa, id: &PemFiles) -> Vec<String> {
    let p = |p: &Path| p.to_str().unwrap().to_string();
    vec![
        "--cluster-server-name".into(),
        NODE_NAME.into(),
        "--cluster-ca".into(),
        p(ca.ca_path()),
        "--cluster-cert".into(),
        p(&id.cert),
        "--cluster-key".into(),
        p(&id.key),
    ]
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// An HTTPS client that trusts only `ca` (HTTP/1.1 by hand over
/// tokio-rustls: one request per connection, `Connection: close`).
struct Https {
    rt: tokio::runtime::Runtime,
    connector: tokio_rustls::TlsConnector,
}

impl Https {
    fn new(ca: &Path) -> Https {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(ring())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Https {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
        }
    }

    /// GET (no body) or POST (JSON body); the status and the body.
    fn request(&self, port: u16, path: &str, body: Option<&Value>) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        self.rt.block_on(async {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let mut tls = self.connector.connect(name, tcp).await.unwrap();
            let body = body.map(Value::to_string).unwrap_or_default();
            let method = if body.is_empty() { "GET" } else { "POST" };
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            tls.write_all(head.as_bytes()).await.unwrap();
            tls.write_all(body.as_bytes()).await.unwrap();
            let mut raw = Vec::new();
            tokio::time::timeout(Duration::from_secs(120), tls.read_to_end(&mut raw))
                .await
                .expect("response within 120 s")
                .unwrap();
            let raw = String::from_utf8(raw).unwrap();
            let (head, body) = raw.split_once("\r\n\r\n").unwrap();
            let status = head.split(' ').nth(1).unwrap().parse().unwrap();
            assert!(
                !head
                    .to_ascii_lowercase()
                    .contains("transfer-encoding: chunked"),
                "{head}"
            );
            (status, body.to_string())
        })
    }

    fn json(&self, port: u16, path: &str, body: Option<Value>) -> Value {
        let (status, text) = self.request(port, path, body.as_ref());
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap()
    }
}

/// How one gRPC caller presents itself.
#[derive(Debug, Clone, Copy)]
enum Caller<'a> {
    Plaintext,
    /// TLS trusting the cluster CA, but no client certificate.
    Anonymous,
    /// TLS with a certificate.
    WithCert(&'a PemFiles),
}

/// The endpoint of a node's gRPC port as `caller` dials it.
fn endpoint(caller: Caller<'_>, ca: &Path, port: u16) -> Endpoint {
    let tls = match caller {
        Caller::Plaintext => None,
        Caller::Anonymous => Some(ClientTlsConfig::new()),
        Caller::WithCert(id) => Some(ClientTlsConfig::new().identity(Identity::from_pem(
            std::fs::read(&id.cert).unwrap(),
            std::fs::read(&id.key).unwrap(),
        ))),
    };
    let e = match tls {
        None => Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap(),
        Some(tls) => Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
            .unwrap()
            .tls_config(
                tls.domain_name(NODE_NAME)
                    .ca_certificate(Certificate::from_pem(std::fs::read(ca).unwrap())),
            )
            .unwrap(),
    };
    e.connect_timeout(Duration::from_secs(5))
}

async fn worker_client(
    caller: Caller<'_>,
    ca: &Path,
    port: u16,
) -> Result<WorkerClient<tonic::transport::Channel>, String> {
    let channel = endpoint(caller, ca, port)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(WorkerClient::new(channel))
}

/// `Info`, then the first message of `Events`, as `caller`.
async fn probe(caller: Caller<'_>, ca: &Path, port: u16) -> Result<pb::WorkerInfo, String> {
    let mut c = worker_client(caller, ca, port).await?;
    let info = tokio::time::timeout(Duration::from_secs(10), c.info(pb::InfoRequest {}))
        .await
        .map_err(|_| "Info timed out".to_string())?
        .map_err(|s| format!("Info: {s}"))?
        .into_inner();
    let mut events = tokio::time::timeout(
        Duration::from_secs(10),
        c.events(pb::EventsRequest { after_event_id: 0 }),
    )
    .await
    .map_err(|_| "Events timed out".to_string())?
    .map_err(|s| format!("Events: {s}"))?
    .into_inner();
    tokio::time::timeout(Duration::from_secs(10), events.message())
        .await
        .map_err(|_| "no event".to_string())?
        .map_err(|s| format!("Events stream: {s}"))?
        .ok_or("Events ended")?;
    Ok(info)
}

/// A stranger's "worker": a TCP listener that counts connections and, when
/// given a certificate, completed TLS handshakes (a client that checks the
/// cluster CA never completes one with it).
struct FakeWorker {
    port: u16,
    connections: Arc<AtomicUsize>,
    handshakes: Arc<AtomicUsize>,
}

impl FakeWorker {
    fn start(rt: &tokio::runtime::Runtime, tls_identity: Option<&PemFiles>) -> FakeWorker {
        let std_listener = TcpListener::bind("127.0.0.1:0").unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let port = std_listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let handshakes = Arc::new(AtomicUsize::new(0));
        let acceptor = tls_identity.map(|id| {
            let chain = CertificateDer::pem_file_iter(&id.cert)
                .unwrap()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            let key = rustls_pki_types::PrivateKeyDer::from_pem_file(&id.key).unwrap();
            let mut config = rustls::ServerConfig::builder_with_provider(ring())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(chain, key)
                .unwrap();
            config.alpn_protocols = vec![b"h2".to_vec()];
            tokio_rustls::TlsAcceptor::from(Arc::new(config))
        });
        let (c, h) = (Arc::clone(&connections), Arc::clone(&handshakes));
        rt.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                c.fetch_add(1, Ordering::SeqCst);
                if let Some(acceptor) = acceptor.clone() {
                    let h = Arc::clone(&h);
                    tokio::spawn(async move {
                        if acceptor.accept(tcp).await.is_ok() {
                            h.fetch_add(1, Ordering::SeqCst);
                        }
                    });
                }
            }
        });
        FakeWorker {
            port,
            connections,
            handshakes,
        }
    }
}

#[test]
fn a_mutual_tls_cluster_serves_and_lets_no_stranger_in() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "cluster");
    // Node certificates name no address at all, only NODE_NAME.
    let node_id = ca.issue("node", &[NODE_NAME]);
    let router_id = ca.issue("router", &["127.0.0.1", "localhost"]);
    let rogue = TestCa::new(dir.path(), "rogue");
    let stranger = rogue.issue("stranger", &["127.0.0.1", NODE_NAME]);

    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("mtls");
    let node_flags = tls_flags(&ca, &node_id);
    let node_flags: Vec<&str> = node_flags.iter().map(String::as_str).collect();
    let mut p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &node_flags);
    let mut d = Node::start(&etcd.url(), &cluster, "decode", "d0", &node_flags);
    let mut router_flags = tls_flags(&ca, &router_id);
    router_flags.extend([
        "--tls-cert".to_string(),
        router_id.cert.to_str().unwrap().to_string(),
        "--tls-key".to_string(),
        router_id.key.to_str().unwrap().to_string(),
    ]);
    let router_flags: Vec<&str> = router_flags.iter().map(String::as_str).collect();
    let r = Router::start_with(&etcd.url(), &cluster, &router_flags);
    let client = Https::new(ca.ca_path());

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = client.request(r.port, "/health", None);
        let h: Value = serde_json::from_str(&body).unwrap();
        let n = |k: &str| h[k].as_array().map_or(0, Vec::len);
        if n("prefill_workers") == 1 && n("decode_workers") == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "membership never became 1P1D: {h}\nrouter: {}",
            r.proc.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Correct greedy output over HTTPS, the long prompt through a real
    // prefill -> decode handoff under mutual TLS.
    for prompt in [short_prompt().to_string(), long_prompt(0)] {
        let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0});
        let v = client.json(r.port, "/v1/completions", Some(body));
        assert_eq!(
            v["choices"][0]["text"],
            expected(&prompt, MAX_TOKENS).as_str(),
            "{prompt}"
        );
    }
    assert_eq!(d.remote_prefills(), 1.0);
    // Plain HTTP on the HTTPS port gets no answer.
    assert!(
        tandem_tests::try_http(tandem_tests::client(), r.port, "GET", "/health", "", &[])
            .map_or(true, |resp| resp.status != 200)
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    let ca_path = ca.ca_path();
    for (name, port) in [("prefill", p.grpc), ("decode", d.grpc)] {
        // A caller with a cluster certificate gets through: the refusals
        // below are about the certificate, not a broken server.
        let info = rt
            .block_on(probe(Caller::WithCert(&router_id), ca_path, port))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(info.role, name);
        for (who, caller) in [
            ("plaintext", Caller::Plaintext),
            ("no certificate", Caller::Anonymous),
            ("another CA's certificate", Caller::WithCert(&stranger)),
        ] {
            let refused = rt.block_on(probe(caller, ca_path, port));
            assert!(refused.is_err(), "{name} answered a caller with {who}");
        }
    }

    // The attacks of issue 16 items 1 and 2, as a stranger: a Prefill whose
    // region would crash UCX, and a Generate naming the stranger's own
    // prefill endpoint (to be handed the decode node's KV region). Both
    // die at the handshake; the nodes stay up.
    let stranger_channel = |port: u16| {
        let _rt = rt.enter();
        endpoint(Caller::WithCert(&stranger), ca_path, port).connect_lazy()
    };
    let mut poison = vec![0x28u8];
    poison.resize(64, 0);
    let prefill = pb::PrefillRequest {
        version: tandem_proto::PROTOCOL_VERSION,
        prompt: vec![1, 2, 3],
        dst_blocks: vec![0],
        region: Some(pb::KvRegion {
            worker_address: poison,
            grant: vec![0; 16],
            len: 1 << 20,
            connector: "ucx".into(),
        }),
        ..Default::default()
    };
    let r1 = rt.block_on(
        pb::prefill_client::PrefillClient::new(stranger_channel(p.grpc)).prefill(prefill),
    );
    assert!(r1.is_err());
    let generate = pb::GenerateRequest {
        version: tandem_proto::PROTOCOL_VERSION,
        prompt: (0..200).collect(),
        max_tokens: 1,
        prefill: vec![pb::PrefillTarget {
            worker_id: "mine".into(),
            endpoint: format!("https://127.0.0.1:{}", p.grpc),
        }],
        ..Default::default()
    };
    let r2 = rt.block_on(
        pb::decode_client::DecodeClient::new(stranger_channel(d.grpc)).generate(generate),
    );
    assert!(r2.is_err());
    assert!(p.proc.is_running() && d.proc.is_running(), "a node died");
    assert_eq!(
        d.remote_prefills(),
        1.0,
        "the stranger's Generate reached the decode node"
    );

    // Strangers register "decode workers" in etcd with the real node's
    // fingerprint: one plaintext, one over TLS with another CA's
    // certificate. The router must never hand either a request.
    let real = rt
        .block_on(probe(Caller::WithCert(&router_id), ca_path, d.grpc))
        .unwrap();
    let plain_fake = FakeWorker::start(&rt, None);
    let tls_fake = FakeWorker::start(&rt, Some(&stranger));
    let cfg = EtcdConfig {
        endpoints: vec![etcd.url()],
        cluster: cluster.clone(),
        lease_ttl: Duration::from_secs(30),
        security: Default::default(),
    };
    let register = |id: &str, endpoint: String| {
        let record = pb::WorkerRecord {
            version: real.version,
            id: id.into(),
            role: "decode".into(),
            grpc_endpoint: endpoint,
            metrics_endpoint: "http://127.0.0.1:1".into(),
            fingerprint: real.fingerprint.clone(),
            kv_blocks_total: 4096,
            max_batch_size: 64,
            tp: 1,
            dp: 1,
        };
        rt.block_on(Registration::start(
            &cfg,
            Role::Decode,
            id,
            prost::Message::encode_to_vec(&record),
        ))
        .unwrap()
    };
    let _a = register(
        "fake-plain",
        format!("http://127.0.0.1:{}", plain_fake.port),
    );
    let _b = register("fake-tls", format!("https://127.0.0.1:{}", tls_fake.port));
    // The router sees both records: it refuses the plaintext endpoint of a
    // TLS cluster without dialling it, and says so; it dials the TLS one,
    // whose certificate fails the handshake, and keeps it on probation.
    let router_health = || -> Value {
        let (_, body) = client.request(r.port, "/health", None);
        serde_json::from_str(&body).unwrap()
    };
    let on_probation = |h: &Value, id: &str| {
        h["probation_workers"]
            .as_array()
            .is_some_and(|ws| ws.iter().any(|w| w["id"] == id))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let refused_plain = r
            .proc
            .stderr()
            .lines()
            .any(|l| l.contains("bad worker endpoint") && l.contains("fake-plain"));
        let dialled_tls = tls_fake.connections.load(Ordering::SeqCst) > 0;
        let h = router_health();
        if refused_plain && dialled_tls && on_probation(&h, "fake-tls") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the router never tried the strangers (plaintext refused: {refused_plain}, TLS \
             dialled: {dialled_tls}): {h}\nrouter: {}",
            r.proc.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for i in 0..8 {
        let prompt = format!("{} {i}", short_prompt());
        let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
        let v = client.json(r.port, "/v1/completions", Some(body));
        assert_eq!(v["choices"][0]["text"], expected(&prompt, 4).as_str());
    }
    assert_eq!(
        plain_fake.connections.load(Ordering::SeqCst),
        0,
        "the router dialled a plaintext worker in a TLS cluster"
    );
    assert_eq!(
        tls_fake.handshakes.load(Ordering::SeqCst),
        0,
        "a worker without a cluster certificate completed a TLS handshake"
    );
    // Neither ever became a decode worker; the TLS one is still refused.
    let h = router_health();
    assert_eq!(h["decode_workers"], json!(["d0"]), "{h}");
    assert!(on_probation(&h, "fake-tls"), "{h}");

    p.assert_idle();
    d.assert_idle();
}

#[test]
fn bad_tls_settings_fail_startup_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "cluster");
    let id = ca.issue("node", &["127.0.0.1"]);
    let other = ca.issue("other", &["127.0.0.1"]);
    // A key that is not the certificate's, and a partial set of flags.
    let p = |p: &Path| p.to_str().unwrap().to_string();
    for (args, wants) in [
        (
            vec![
                "--cluster-ca".to_string(),
                p(ca.ca_path()),
                "--cluster-cert".into(),
                p(&id.cert),
                "--cluster-key".into(),
                p(&other.key),
            ],
            "TLS",
        ),
        (
            vec!["--cluster-ca".to_string(), p(ca.ca_path())],
            "go together",
        ),
    ] {
        let out = std::process::Command::new(tandem_tests::binary())
            .arg("prefill")
            .args(["--model", tandem_tests::gguf_path().to_str().unwrap()])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(wants), "{args:?}: {stderr}");
    }
    // A router's HTTPS key that does not match its certificate.
    let out = std::process::Command::new(tandem_tests::binary())
        .arg("router")
        .args(["--etcd", "http://127.0.0.1:1"])
        .args(["--model", tandem_tests::gguf_path().to_str().unwrap()])
        .args(["--tls-cert", &p(&id.cert), "--tls-key", &p(&other.key)])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("certificate and key rejected"), "{stderr}");

    // The connector itself: what a node built from good files dials.
    let tls = ClusterTls::load(&TlsFiles {
        ca: ca.ca_path().to_path_buf(),
        cert: id.cert.clone(),
        key: id.key.clone(),
        server_name: None,
    })
    .unwrap();
    assert!(
        PeerConnector::new(Some(tls))
            .endpoint("http://127.0.0.1:1")
            .is_err()
    );
}

/// A TCP port nothing listens on (bound, then closed).
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Registers a "decode worker" in etcd at `endpoint`, with the fingerprint
/// and protocol version a real node reported (`real`), as anyone who can
/// write etcd could.
fn register_decode(
    rt: &tokio::runtime::Runtime,
    cfg: &EtcdConfig,
    real: &pb::WorkerInfo,
    id: &str,
    endpoint: String,
) -> Registration {
    let record = pb::WorkerRecord {
        version: real.version,
        id: id.into(),
        role: "decode".into(),
        grpc_endpoint: endpoint,
        metrics_endpoint: "http://127.0.0.1:1".into(),
        fingerprint: real.fingerprint.clone(),
        kv_blocks_total: 4096,
        max_batch_size: 64,
        tp: 1,
        dp: 1,
    };
    rt.block_on(Registration::start(
        cfg,
        Role::Decode,
        id,
        prost::Message::encode_to_vec(&record),
    ))
    .unwrap()
}

/// A log without its ANSI colour sequences (`ESC [ ... m`).
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut rest = log;
    while let Some(i) = rest.find('\x1b') {
        out.push_str(&rest[..i]);
        rest = rest[i..].find('m').map_or("", |j| &rest[i + j + 1..]);
    }
    out.push_str(rest);
    out
}

/// The router's `/health` view of the workers on probation: id -> (role,
/// reason).
fn probation(h: &Value) -> std::collections::BTreeMap<String, (String, String)> {
    h["probation_workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            let s = |k: &str| w[k].as_str().unwrap_or_default().to_string();
            (s("id"), (s("role"), s("reason")))
        })
        .collect()
}

/// Issue 36, item 3: six decode records whose https endpoints fail
/// verification (four TLS servers with another CA's certificate, two closed
/// ports) made most of 30 concurrent requests fail with 503, because such
/// workers send no load reports, ranked first, and took the retries. They
/// must stay on probation: never routed to, not counted as available, and
/// reported in `/health`, the metrics and the log. A real worker whose
/// verified connection breaks goes back to probation too.
#[test]
fn unverifiable_workers_stay_on_probation() {
    const FAKES_TLS: usize = 4;
    const FAKES_CLOSED: usize = 2;
    const REQUESTS: usize = 30;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "cluster");
    let node_id = ca.issue("node", &[NODE_NAME]);
    let router_id = ca.issue("router", &["127.0.0.1", "localhost"]);
    let rogue = TestCa::new(dir.path(), "rogue");
    let stranger = rogue.issue("stranger", &["127.0.0.1", NODE_NAME]);

    let etcd = EtcdServer::start().unwrap();
    let cluster = unique_cluster("probation");
    let flags = tls_flags(&ca, &node_id);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &flags);
    // The decode node's record outlives it by a minute, so that once it is
    // killed the router still lists it: on probation, not gone.
    flags.extend(["--lease-ttl", "60"]);
    let mut d = Node::start(&etcd.url(), &cluster, "decode", "d0", &flags);
    let router_flags = tls_flags(&ca, &router_id);
    let router_flags: Vec<&str> = router_flags.iter().map(String::as_str).collect();
    let r = Router::start_with(&etcd.url(), &cluster, &router_flags);
    r.wait_members(1, 1, Duration::from_secs(30));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let real = rt
        .block_on(probe(Caller::WithCert(&router_id), ca.ca_path(), d.grpc))
        .unwrap();
    let cfg = EtcdConfig {
        endpoints: vec![etcd.url()],
        cluster: cluster.clone(),
        lease_ttl: Duration::from_secs(30),
        security: Default::default(),
    };
    let tls_fakes: Vec<FakeWorker> = (0..FAKES_TLS)
        .map(|_| FakeWorker::start(&rt, Some(&stranger)))
        .collect();
    let mut expected_reasons = std::collections::BTreeMap::new();
    let mut registrations = Vec::new();
    for (i, f) in tls_fakes.iter().enumerate() {
        let id = format!("fake-tls-{i}");
        let endpoint = format!("https://127.0.0.1:{}", f.port);
        registrations.push(register_decode(&rt, &cfg, &real, &id, endpoint));
        expected_reasons.insert(id, ("decode".to_string(), "tls".to_string()));
    }
    for i in 0..FAKES_CLOSED {
        let id = format!("fake-closed-{i}");
        let endpoint = format!("https://127.0.0.1:{}", closed_port());
        registrations.push(register_decode(&rt, &cfg, &real, &id, endpoint));
        expected_reasons.insert(id, ("decode".to_string(), "unreachable".to_string()));
    }

    // Until the router lists all six (as decode workers, or on probation
    // after a first failed attempt to verify each).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = r.health();
        let on_probation = probation(&h);
        let listed = |id: &String| {
            on_probation
                .get(id)
                .is_some_and(|(_, why)| why != "pending")
                || h["decode_workers"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|v| v == id.as_str()))
        };
        if expected_reasons.keys().all(listed) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the router never tried the six records: {h}\nrouter: {}",
            r.proc.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // 30 concurrent requests: every one served by the real decode node.
    let prompts: Vec<String> = (0..REQUESTS)
        .map(|i| format!("{} {i}", short_prompt()))
        .collect();
    let answers: Vec<(u16, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|prompt| {
                let port = r.port;
                s.spawn(move || {
                    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
                    let resp =
                        tandem_tests::http(port, "POST", "/v1/completions", &body.to_string());
                    (resp.status, resp.body)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let failed: Vec<&(u16, String)> = answers.iter().filter(|(s, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {REQUESTS} requests failed, e.g. {:?}",
        failed.len(),
        failed[0]
    );
    for (prompt, (_, body)) in prompts.iter().zip(&answers) {
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["choices"][0]["text"], expected(prompt, 4).as_str());
    }

    // Reported: listed apart from the ready workers, with the class of
    // failure; counted in the metrics; logged once each.
    let h = r.health();
    assert_eq!(h["decode_workers"], json!(["d0"]), "{h}");
    assert_eq!(h["prefill_workers"], json!(["p0"]), "{h}");
    assert_eq!(probation(&h), expected_reasons, "{h}");
    assert_eq!(h["probation_total"], json!(FAKES_TLS + FAKES_CLOSED), "{h}");
    let text = tandem_tests::http(r.port, "GET", "/metrics", "").body;
    let m = |name: &str, labels: &str| tandem_tests::metric(&text, name, labels);
    assert_eq!(m("tandem_router_workers", "role=\"decode\""), 1.0);
    assert_eq!(m("tandem_router_workers", "role=\"prefill\""), 1.0);
    assert_eq!(
        m("tandem_router_probation_workers", "role=\"decode\""),
        (FAKES_TLS + FAKES_CLOSED) as f64
    );
    assert_eq!(
        m("tandem_router_probation_workers", "role=\"prefill\""),
        0.0
    );
    assert!(m("tandem_router_probation_failures_total", "reason=\"tls\"") >= FAKES_TLS as f64);
    assert!(
        m(
            "tandem_router_probation_failures_total",
            "reason=\"unreachable\""
        ) >= FAKES_CLOSED as f64
    );
    let log = plain(&r.proc.stderr());
    for (id, (_, reason)) in &expected_reasons {
        let lines = log
            .lines()
            .filter(|l| {
                l.contains("failed verification")
                    && l.contains(&format!("worker={id} "))
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .count();
        assert_eq!(
            lines, 1,
            "{id}: {lines} log lines (rate limit: one a minute)\n{log}"
        );
    }
    // The router did dial the TLS fakes; none got through a handshake.
    for f in &tls_fakes {
        assert!(f.connections.load(Ordering::SeqCst) > 0);
        assert_eq!(f.handshakes.load(Ordering::SeqCst), 0);
    }

    // The real decode node dies; its record stays (lease of a minute). It
    // goes back on probation at once, and no request is sent its way.
    d.proc.kill9();
    let deadline = Instant::now() + Duration::from_secs(20);
    let h = loop {
        let h = r.health();
        if h["decode_workers"] == json!([]) {
            break h;
        }
        assert!(Instant::now() < deadline, "d0 stayed routable: {h}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (role, reason) = &probation(&h)["d0"];
    assert_eq!(role, "decode");
    assert!(reason == "lost" || reason == "unreachable", "{h}");
    let body = json!({"prompt": short_prompt(), "max_tokens": 4, "temperature": 0});
    let resp = tandem_tests::http(r.port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(resp.status, 503, "{}", resp.body);
    let log = plain(&r.proc.stderr());
    assert!(
        log.lines()
            .any(|l| l.contains("lost its verified connection") && l.contains("worker=d0 ")),
        "no log line for d0's lost connection:\n{log}"
    );
    drop(registrations);
    p.assert_idle();
}

/// Issue 36: what a captured `PrefillRequest` (a real decode node's
/// region and grant) lets its holder do against real nodes over real UCX:
/// replayed to the real prefill node, every write it causes is refused by
/// the decode node, which counts each refusal and stays up and correct.
mod captured_prefill_requests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use tandem_discovery::testing::EtcdServer;
    use tandem_engine::sampler::SamplingParams;
    use tandem_proto::pb;
    use tandem_tests::cluster::{Node, unique_cluster};
    use tandem_tests::{client, metric, model, reference_output, try_http};
    use tokio_stream::StreamExt;

    /// A `Prefill` service between a decode node and the real prefill
    /// node: it keeps every request it passes on (what an eavesdropper on
    /// an unprotected link, or a compromised peer, would hold).
    struct Capture {
        upstream: String,
        seen: Arc<Mutex<Vec<pb::PrefillRequest>>>,
    }

    #[tonic::async_trait]
    impl pb::prefill_server::Prefill for Capture {
        async fn prefill(
            &self,
            req: tonic::Request<pb::PrefillRequest>,
        ) -> Result<tonic::Response<pb::PrefillResponse>, tonic::Status> {
            let req = req.into_inner();
            self.seen.lock().unwrap().push(req.clone());
            let mut real = pb::prefill_client::PrefillClient::connect(self.upstream.clone())
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            real.prefill(req).await
        }
    }

    /// The capture's endpoint, and what it saw; it serves until `rt` ends.
    fn capture(
        rt: &tokio::runtime::Runtime,
        prefill_port: u16,
    ) -> (String, Arc<Mutex<Vec<pb::PrefillRequest>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let svc = Capture {
            upstream: format!("http://127.0.0.1:{prefill_port}"),
            seen: Arc::clone(&seen),
        };
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(pb::prefill_server::PrefillServer::new(svc))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (endpoint, seen)
    }

    /// `n` prompt tokens (never a whole number of blocks), distinct per
    /// `seed`.
    pub(super) fn prompt(seed: usize, n: usize) -> Vec<u32> {
        let text = format!(
            "Story {seed}. {}",
            "The river ran past the mill, and the miller counted the sacks of grain. "
                .repeat(n / 8 + 4)
        );
        let mut tokens = model().text.tokenizer.encode(&text, true).unwrap();
        assert!(tokens.len() >= n);
        tokens.truncate(n);
        tokens
    }

    /// `Generate` straight to the decode node with `prefill` as its one
    /// prefill worker; the tokens it streamed.
    pub(super) async fn generate(decode_port: u16, prompt: &[u32], prefill: &str) -> Vec<u32> {
        let endpoint = format!("http://127.0.0.1:{decode_port}");
        let channel = tonic::transport::Endpoint::from_shared(endpoint)
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
            prefill: vec![pb::PrefillTarget {
                worker_id: "p0".into(),
                endpoint: prefill.into(),
            }],
            constraint: None,
            prefix_source: None,
        };
        let mut stream = pb::decode_client::DecodeClient::new(channel)
            .generate(req)
            .await
            .unwrap()
            .into_inner();
        let mut tokens = Vec::new();
        while let Some(m) = stream.next().await {
            match m.unwrap().kind {
                Some(pb::generate_response::Kind::Token(t)) => tokens.push(t.id),
                Some(pb::generate_response::Kind::Finished(f)) => {
                    assert_eq!(f.prefill_worker, "p0", "not prefilled remotely: {f:?}");
                }
                None => {}
            }
        }
        tokens
    }

    const MAX_TOKENS: usize = 4;

    /// The writes a decode node refused so far; `None` if it does not
    /// answer.
    fn refused(d: &Node) -> Option<f64> {
        let r = try_http(client(), d.metrics, "GET", "/metrics", "", &[]).ok()?;
        Some(metric(&r.body, "tandem_dkv_refused_writes_total", ""))
    }

    /// Panics, with its log's end, if `n`'s process is gone.
    pub(super) fn assert_alive(n: &mut Node, after: &str) {
        if !n.proc.is_running() {
            let log = n.proc.stderr();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "{} died {after}; its log ends:\n{}",
                n.proc.name,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }

    /// Issue 36 item 2: a captured request replayed 129 times with two
    /// destination blocks, then 11 times with 13, to the real prefill node
    /// (each replay writes every block as one rendezvous-size message,
    /// the prompt being in the prefill node's cache by then), used to kill
    /// the decode node within seconds: UCX released each refused
    /// rendezvous message twice. Now every such write is refused and
    /// counted, and the decode node serves correct output after.
    #[test]
    fn replayed_requests_are_refused_and_the_decode_node_lives_on() {
        let etcd = EtcdServer::start().unwrap();
        let cluster = unique_cluster("replay");
        let mut p = Node::start(&etcd.url(), &cluster, "prefill", "p0", &[]);
        let mut d = Node::start(
            &etcd.url(),
            &cluster,
            "decode",
            "d0",
            &["--remote-prefill-min-tokens", "1"],
        );
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (proxy, seen) = capture(&rt, p.grpc);
        // (destination blocks, replays, prompt tokens); blocks of 16.
        for (seed, (blocks, replays, n)) in [(2, 129, 27), (13, 11, 200)].into_iter().enumerate() {
            let tokens = prompt(seed, n);
            let out = rt.block_on(generate(d.grpc, &tokens, &proxy));
            let want = reference_output(tokens, SamplingParams::greedy(), MAX_TOKENS).tokens;
            assert_eq!(out, want);
            let captured = seen.lock().unwrap().pop().unwrap();
            assert_eq!(captured.dst_blocks.len(), blocks);
            let before = refused(&d).unwrap();
            let started = Instant::now();
            let answers = rt.block_on(async {
                let channel =
                    tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", p.grpc))
                        .unwrap()
                        .connect()
                        .await
                        .unwrap();
                let calls = (0..replays).map(|_| {
                    let mut c = pb::prefill_client::PrefillClient::new(channel.clone());
                    let req = captured.clone();
                    async move { c.prefill(req).await.map(|_| ()) }
                });
                futures_util::future::join_all(calls).await
            });
            // Each replay reaches the decode node: `blocks` writes, each
            // refused (its grant is gone), and nothing more.
            let want = before + (replays * blocks) as f64;
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let after = format!(
                    "{:?} into {replays} replays of {blocks} blocks",
                    started.elapsed()
                );
                assert_alive(&mut d, &after);
                let now = refused(&d);
                if now.is_some_and(|n| n >= want) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{now:?} - {before} of {} writes refused; replies {:?}",
                    replays * blocks,
                    answers
                        .iter()
                        .filter(|a| a.is_err())
                        .take(3)
                        .collect::<Vec<_>>()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            assert_eq!(refused(&d), Some(want));
            assert_alive(&mut p, "after the replays");
            assert_alive(&mut d, "after the replays");
        }
        // Both still serve: a new prompt through the same prefill node.
        let tokens = prompt(7, 90);
        let out = rt.block_on(generate(
            d.grpc,
            &tokens,
            &format!("http://127.0.0.1:{}", p.grpc),
        ));
        assert_eq!(
            out,
            reference_output(tokens, SamplingParams::greedy(), MAX_TOKENS).tokens
        );
        assert_eq!(d.remote_prefills(), 3.0);
        p.assert_idle();
        d.assert_idle();
    }

    /// Issue 36 item 1: byte 63 of a real worker address set to 0xff
    /// aborted the prefill node in `ucp_wireup_select_lanes` (one request
    /// was enough), since anyone could reseal the changed address with the
    /// unkeyed checksum. Addresses now carry a tag under the cluster's
    /// dKV key (here the one the nodes created in etcd): resealed the old
    /// way, or tagged under another key, the address is refused before UCX
    /// sees it, the request fails cleanly, and the node serves on.
    #[test]
    fn a_forged_worker_address_is_refused_before_ucx() {
        let etcd = EtcdServer::start().unwrap();
        let cluster = unique_cluster("forged");
        // Over tcp and self a worker address is long enough for the attack
        // (79 bytes here; tcp alone gives 50).
        let mut p = Node::start(
            &etcd.url(),
            &cluster,
            "prefill",
            "p0",
            &["--ucx-tls", "tcp,self"],
        );
        let mut d = Node::start(
            &etcd.url(),
            &cluster,
            "decode",
            "d0",
            &["--remote-prefill-min-tokens", "1", "--ucx-tls", "tcp,self"],
        );
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (proxy, seen) = capture(&rt, p.grpc);
        let tokens = prompt(11, 40);
        let out = rt.block_on(generate(d.grpc, &tokens, &proxy));
        assert_eq!(
            out,
            reference_output(tokens, SamplingParams::greedy(), MAX_TOKENS).tokens
        );
        let captured = seen.lock().unwrap().pop().unwrap();
        let blob = captured.region.as_ref().unwrap().worker_address.clone();
        // The envelope ends with the address (its length is at bytes 4..8,
        // in every version of the envelope).
        let len = u32::from_le_bytes(blob[4..8].try_into().unwrap()) as usize;
        let mut forged = blob[blob.len() - len..].to_vec();
        assert!(forged.len() > 63, "a UCX address of {} bytes", forged.len());
        forged[63] = 0xff;
        // The nodes' key is the cluster's, in etcd.
        let cfg = tandem_discovery::EtcdConfig {
            endpoints: vec![etcd.url()],
            cluster: cluster.clone(),
            lease_ttl: Duration::from_secs(2),
            security: Default::default(),
        };
        let stored = rt
            .block_on(tandem_discovery::get_or_create_secret(
                &cfg, "dkv-key", &[0; 32],
            ))
            .unwrap();
        let key = tandem_dkv::DkvKey::from_slice(&stored).unwrap();
        assert!(key.open_address(&blob).is_ok());
        // The unkeyed envelope of before: magic, length, xxh3, address.
        let mut unkeyed = b"DKua".to_vec();
        unkeyed.extend_from_slice(&(forged.len() as u32).to_le_bytes());
        unkeyed.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&forged).to_le_bytes());
        unkeyed.extend_from_slice(&forged);
        let stranger = tandem_dkv::DkvKey::from_bytes([0x42; 32]).seal_address(&forged);
        let channel = rt
            .block_on(
                tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", p.grpc))
                    .unwrap()
                    .connect(),
            )
            .unwrap();
        for (what, address, code) in [
            ("resealed unkeyed", unkeyed, tonic::Code::InvalidArgument),
            ("under another key", stranger, tonic::Code::PermissionDenied),
        ] {
            let mut req = captured.clone();
            req.region.as_mut().unwrap().worker_address = address;
            let r =
                rt.block_on(pb::prefill_client::PrefillClient::new(channel.clone()).prefill(req));
            assert_alive(
                &mut p,
                &format!("a Prefill with byte 63 of its address {what}"),
            );
            let s = r.expect_err(what);
            assert_eq!(s.code(), code, "{what}: {s:?}");
        }
        let pm = p.metrics();
        assert_eq!(
            metric(
                &pm,
                "tandem_dkv_transfer_failures_total",
                "reason=\"unauthenticated\""
            ),
            1.0,
            "{pm}"
        );
        // Both serve on, through the same prefill node.
        let tokens = prompt(12, 60);
        let out = rt.block_on(generate(
            d.grpc,
            &tokens,
            &format!("http://127.0.0.1:{}", p.grpc),
        ));
        assert_eq!(
            out,
            reference_output(tokens, SamplingParams::greedy(), MAX_TOKENS).tokens
        );
        assert_alive(&mut d, "at the end");
        p.assert_idle();
        d.assert_idle();
    }
}
