//! Probation: a worker learned from etcd is not routed to until it has
//! proved itself. Anyone who can write etcd can list a "worker"; the
//! router routes only to workers it holds a verified connection to (the
//! `Worker.Events` stream open, under mutual TLS when the cluster has a CA,
//! with `Worker.Info` naming the record's id, role and fingerprint) and
//! that have sent their first load report over it. Until then, and again
//! whenever that connection is lost, a worker is on probation: never
//! ranked, so no request or retry is spent on it, not counted as available
//! (`/health`, `tandem.router.workers`), and reported (a rate-limited log
//! line, `tandem.router.probation_workers{role}`,
//! `tandem.router.probation_failures{reason}`, `/health`'s
//! `probation_workers`). Failed workers are retried with a capped backoff.

use std::collections::BTreeMap;
use std::error::Error as _;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge};
use tandem_discovery::Role;
use tandem_proto::{WorkerRecord, pb};
use tandem_types::ModelFingerprint;
use tonic::{Code, Status};

use super::Worker;

type Workers = BTreeMap<(Role, String), Arc<Worker>>;

/// Why a worker is on probation; the metric's `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Reason {
    /// Not verified yet: no connection, or no load report on it so far.
    Pending = 0,
    /// No connection (refused, timed out, reset before TLS finished).
    Unreachable = 1,
    /// The TLS handshake failed: a certificate the cluster CA did not sign
    /// (or that names another host), or no TLS at all.
    Tls = 2,
    /// It answered, but as another worker: id, role or fingerprint differ
    /// from its record.
    Identity = 3,
    /// It answered `Info` or `Events` with an error.
    Refused = 4,
    /// A verified connection broke (the worker stopped or went away).
    Lost = 5,
}

impl Reason {
    const ALL: [Reason; 6] = [
        Reason::Pending,
        Reason::Unreachable,
        Reason::Tls,
        Reason::Identity,
        Reason::Refused,
        Reason::Lost,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Pending => "pending",
            Reason::Unreachable => "unreachable",
            Reason::Tls => "tls",
            Reason::Identity => "identity",
            Reason::Refused => "refused",
            Reason::Lost => "lost",
        }
    }

    fn from_u8(v: u8) -> Reason {
        Reason::ALL
            .into_iter()
            .find(|r| *r as u8 == v)
            .unwrap_or(Reason::Pending)
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

struct Metrics {
    workers: Gauge<u64>,
    probation: Gauge<u64>,
    failures: Counter<u64>,
}

fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("tandem");
        Metrics {
            workers: m
                .u64_gauge("tandem.router.workers")
                .with_description(
                    "Workers this router routes to (verified and reporting load), by role",
                )
                .build(),
            probation: m
                .u64_gauge("tandem.router.probation_workers")
                .with_description(
                    "Workers listed in etcd that this router does not route to: not verified \
                     yet, failing verification, or disconnected, by role",
                )
                .build(),
            failures: m
                .u64_counter("tandem.router.probation_failures")
                .with_description(
                    "Failed attempts to verify a worker or keep its connection, by reason",
                )
                .build(),
        }
    })
}

/// How many workers of each role are ready and on probation; exported as
/// `tandem.router.workers` and `tandem.router.probation_workers`.
#[derive(Debug, Default)]
pub(crate) struct Census {
    /// `[role][ready as usize]`.
    counts: Mutex<[[u64; 2]; 2]>,
}

impl Census {
    fn slot(role: Role) -> usize {
        match role {
            Role::Prefill => 0,
            Role::Decode => 1,
        }
    }

    /// Moves one worker of `role` between states (`None`: not counted).
    fn apply(&self, role: Role, from: Option<bool>, to: Option<bool>) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let row = &mut counts[Self::slot(role)];
        if let Some(ready) = from {
            row[usize::from(ready)] = row[usize::from(ready)].saturating_sub(1);
        }
        if let Some(ready) = to {
            row[usize::from(ready)] += 1;
        }
        let label = [KeyValue::new("role", role.as_str())];
        let m = metrics();
        m.workers.record(row[1], &label);
        m.probation.record(row[0], &label);
    }

    /// Records zero for both roles (a router with no workers yet).
    pub(crate) fn publish(&self) {
        for role in [Role::Prefill, Role::Decode] {
            self.apply(role, None, None);
        }
    }
}

/// One worker's standing: routable, or on probation and why.
#[derive(Debug)]
pub(crate) struct Standing {
    role: Role,
    ready: AtomicBool,
    reason: AtomicU8,
    /// Whether it was ever verified: a worker that was is retried sooner.
    proven: AtomicBool,
    census: Arc<Census>,
    /// The last failure logged, to log each worker's failures at most
    /// once a minute (and at once when the reason changes).
    last_log: Mutex<Option<(Reason, Instant)>>,
}

/// How often one worker's unchanged failure is logged again.
const LOG_EVERY: Duration = Duration::from_secs(60);

impl Standing {
    /// A worker just learned from etcd: on probation, pending.
    pub(crate) fn new(role: Role, census: Arc<Census>) -> Self {
        census.apply(role, None, Some(false));
        Self {
            role,
            ready: AtomicBool::new(false),
            reason: AtomicU8::new(Reason::Pending as u8),
            proven: AtomicBool::new(false),
            census,
            last_log: Mutex::new(None),
        }
    }

    /// Whether requests may be routed to it.
    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Why it is on probation; `None` when ready.
    pub(crate) fn reason(&self) -> Option<Reason> {
        (!self.is_ready()).then(|| Reason::from_u8(self.reason.load(Ordering::Relaxed)))
    }

    /// It is verified and has reported its load: routable from now on.
    pub(crate) fn promote(&self, id: &str) {
        if self.ready.swap(true, Ordering::AcqRel) {
            return;
        }
        self.proven.store(true, Ordering::Relaxed);
        self.census.apply(self.role, Some(false), Some(true));
        tracing::info!(worker = %id, role = self.role.as_str(), "worker verified; routing to it");
    }

    /// A failed verification, or a verified connection lost: on probation
    /// (again), counted and reported.
    pub(crate) fn demote(&self, id: &str, reason: Reason, detail: &str) {
        self.reason.store(reason as u8, Ordering::Relaxed);
        let was_ready = self.ready.swap(false, Ordering::AcqRel);
        if was_ready {
            self.census.apply(self.role, Some(true), Some(false));
        }
        metrics()
            .failures
            .add(1, &[KeyValue::new("reason", reason.as_str())]);
        if !self.log_due(reason) {
            return;
        }
        let role = self.role.as_str();
        if was_ready {
            tracing::warn!(worker = %id, role, reason = reason.as_str(), error = %detail,
                "worker lost its verified connection; on probation (not routed to) until it reconnects and reports load");
        } else {
            tracing::warn!(worker = %id, role, reason = reason.as_str(), error = %detail,
                "worker failed verification; on probation (not routed to)");
        }
    }

    fn log_due(&self, reason: Reason) -> bool {
        let mut last = self.last_log.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let due = last.is_none_or(|(r, at)| r != reason || now.duration_since(at) >= LOG_EVERY);
        if due {
            *last = Some((reason, now));
        }
        due
    }

    /// The longest pause between attempts: short for a worker that was
    /// verified before (a restart or a blip), longer for one never
    /// verified (a stranger's record then costs the router a handshake
    /// every 30 s).
    pub(crate) fn max_backoff(&self) -> Duration {
        if self.proven.load(Ordering::Relaxed) {
            Duration::from_secs(2)
        } else {
            Duration::from_secs(30)
        }
    }
}

impl Drop for Standing {
    fn drop(&mut self) {
        self.census.apply(self.role, Some(self.is_ready()), None);
    }
}

/// The class of a failed `Info` or `Events` call. A status made here from
/// a transport error carries that error as its source: a failed TLS
/// handshake (a certificate the cluster CA did not sign, or no TLS) ends
/// with rustls's `InvalidData` I/O error somewhere in that chain, anything
/// else is "unreachable". A status the worker sent has no source:
/// "refused", unless it says it is unavailable.
pub(crate) fn classify(status: &Status) -> Reason {
    let Some(first) = status.source() else {
        return match status.code() {
            Code::Unavailable | Code::DeadlineExceeded => Reason::Unreachable,
            _ => Reason::Refused,
        };
    };
    let mut source = Some(first);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::InvalidData
        {
            return Reason::Tls;
        }
        source = e.source();
    }
    Reason::Unreachable
}

/// A failed call's message and its causes, for the log.
pub(crate) fn detail(status: &Status) -> String {
    let mut out = status.message().to_string();
    let mut source = status.source();
    while let Some(e) = source {
        let s = e.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        source = e.source();
    }
    out
}

/// Whether the process that answered `Info` is the worker its record
/// describes.
pub(crate) fn check_identity(record: &WorkerRecord, info: pb::WorkerInfo) -> Result<(), String> {
    if info.id != record.id || info.role != record.role {
        return Err(format!(
            "it says it is {} worker {:?}, its record {} worker {:?}",
            info.role, info.id, record.role, record.id
        ));
    }
    let fingerprint = info
        .fingerprint
        .ok_or_else(|| "it sent no fingerprint".to_string())
        .and_then(|f| ModelFingerprint::try_from(f).map_err(|e| e.to_string()))?;
    match record.fingerprint.mismatch(&fingerprint) {
        None => Ok(()),
        Some(m) => Err(format!("its fingerprint is not its record's: {m}")),
    }
}

/// Most probationary workers `/health` names (a stranger may list many).
const HEALTH_LISTED: usize = 100;

/// `/health`'s report of the workers on probation: their number, and up to
/// [`HEALTH_LISTED`] of them with role and reason.
pub(super) fn health_report(workers: &RwLock<Workers>) -> (usize, Vec<serde_json::Value>) {
    let workers = workers.read().unwrap_or_else(PoisonError::into_inner);
    let mut total = 0;
    let mut listed = Vec::new();
    for w in workers.values() {
        let Some(reason) = w.standing.reason() else {
            continue;
        };
        total += 1;
        if listed.len() < HEALTH_LISTED {
            listed.push(serde_json::json!({
                "id": w.record.id,
                "role": w.role.as_str(),
                "reason": reason.as_str(),
            }));
        }
    }
    (total, listed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicU64, AtomicUsize};

    use futures_util::Stream;
    use tandem_proto::tls::{ClusterTls, PeerConnector, TlsFiles};
    use tandem_testkit::tls::{PemFiles, TestCa};
    use tokio::sync::mpsc;
    use tonic::transport::{Identity, Server, ServerTlsConfig};
    use tonic::{Request, Response};

    use crate::cluster::events::follow_events;

    fn fingerprint() -> ModelFingerprint {
        ModelFingerprint {
            model_id: "m".into(),
            weights_hash: 7,
            kv_dtype: "f16".into(),
            block_size: 4,
            kv_layout: "l".into(),
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
        }
    }

    fn record(id: &str, endpoint: &str) -> WorkerRecord {
        WorkerRecord {
            id: id.into(),
            role: "decode".into(),
            grpc_endpoint: endpoint.into(),
            metrics_endpoint: String::new(),
            fingerprint: fingerprint(),
            kv_blocks_total: 100,
            max_batch_size: 1,
            tp: 1,
            dp: 1,
        }
    }

    /// A node's `Worker` service: `Info` as configured (or refused), and
    /// one `Events` stream fed by the test.
    struct FakeNode {
        info: pb::WorkerInfo,
        refuse: Option<Code>,
        events: Mutex<Option<mpsc::Receiver<Result<pb::WorkerEvent, Status>>>>,
    }

    type Events = Pin<Box<dyn Stream<Item = Result<pb::WorkerEvent, Status>> + Send>>;

    #[tonic::async_trait]
    impl pb::worker_server::Worker for FakeNode {
        async fn info(
            &self,
            _: Request<pb::InfoRequest>,
        ) -> Result<Response<pb::WorkerInfo>, Status> {
            match self.refuse {
                Some(code) => Err(Status::new(code, "fake refusal")),
                None => Ok(Response::new(self.info.clone())),
            }
        }

        type EventsStream = Events;

        async fn events(&self, _: Request<pb::EventsRequest>) -> Result<Response<Events>, Status> {
            let rx = self.events.lock().expect("lock").take();
            let rx = rx.ok_or_else(|| Status::permission_denied("one stream only"))?;
            Ok(Response::new(Box::pin(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            )))
        }

        async fn fetch_blocks(
            &self,
            _: Request<pb::FetchRequest>,
        ) -> Result<Response<pb::FetchResponse>, Status> {
            Err(Status::unimplemented("a fake node holds no blocks"))
        }
    }

    /// Serves a fake node (over TLS with `tls`) until the runtime ends;
    /// its port and the sender of its event stream.
    async fn serve(
        info: pb::WorkerInfo,
        refuse: Option<Code>,
        tls: Option<ServerTlsConfig>,
    ) -> (u16, mpsc::Sender<Result<pb::WorkerEvent, Status>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (tx, rx) = mpsc::channel(16);
        let node = FakeNode {
            info,
            refuse,
            events: Mutex::new(Some(rx)),
        };
        let mut server = Server::builder();
        if let Some(tls) = tls {
            server = server.tls_config(tls).expect("server TLS");
        }
        tokio::spawn(
            server
                .add_service(pb::worker_server::WorkerServer::new(node))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (port, tx)
    }

    fn info_of(r: &WorkerRecord) -> pb::WorkerInfo {
        pb::WorkerInfo {
            version: tandem_proto::PROTOCOL_VERSION,
            id: r.id.clone(),
            role: r.role.clone(),
            fingerprint: Some((&r.fingerprint).into()),
        }
    }

    fn load() -> pb::WorkerEvent {
        pb::WorkerEvent {
            event_id: 0,
            kind: Some(pb::worker_event::Kind::Load(pb::Load {
                waiting: 0,
                running: 0,
                kv_blocks_used: 3,
                kv_blocks_total: 100,
            })),
            emitted_unix_us: 0,
        }
    }

    /// A worker as `sync` makes it, followed by `follow_events`.
    fn follow(record: WorkerRecord, peers: &PeerConnector, census: &Arc<Census>) -> Arc<Worker> {
        let channel = peers
            .endpoint(&record.grpc_endpoint)
            .expect("endpoint")
            .connect_lazy();
        let w = Arc::new(Worker {
            record,
            role: Role::Decode,
            channel,
            cached: Mutex::default(),
            last_event: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            kv_blocks_used: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            standing: Standing::new(Role::Decode, Arc::clone(census)),
            events_task: Mutex::new(None),
        });
        let task = tokio::spawn(follow_events(Arc::downgrade(&w)));
        *w.events_task.lock().expect("lock") = Some(task);
        w
    }

    /// Polls `w`'s standing until it is `want` (`None`: ready).
    async fn wait_for(w: &Worker, want: Option<Reason>) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while w.standing.reason() != want {
            assert!(
                Instant::now() < deadline,
                "{}: {:?}, not {want:?}",
                w.record.id,
                w.standing.reason()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn counts(c: &Census) -> [[u64; 2]; 2] {
        *c.counts.lock().expect("lock")
    }

    /// A worker is ready only after a verified connection and its first
    /// load report; a broken connection puts it back on probation, and the
    /// census follows each step.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_is_routable_from_its_first_load_report_until_its_stream_breaks() {
        let census = Arc::new(Census::default());
        let r = record("d1", "http://127.0.0.1:1");
        let (port, events) = serve(info_of(&r), None, None).await;
        let r = record("d1", &format!("http://127.0.0.1:{port}"));
        let w = follow(r, &PeerConnector::default(), &census);
        assert_eq!(w.standing.reason(), Some(Reason::Pending));
        assert_eq!(counts(&census)[1], [1, 0]);
        // Connected, a cache event applied, but no load yet: still pending.
        let stored = pb::WorkerEvent {
            event_id: 1,
            kind: Some(pb::worker_event::Kind::Stored(pb::BlockStored {
                parent: None,
                hashes: vec![5],
            })),
            emitted_unix_us: 0,
        };
        events.send(Ok(stored)).await.expect("send");
        let deadline = Instant::now() + Duration::from_secs(20);
        while w.overlap(&[5]).blocks == 0 {
            assert!(Instant::now() < deadline, "the event never arrived");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(w.standing.reason(), Some(Reason::Pending));
        events.send(Ok(load())).await.expect("send");
        wait_for(&w, None).await;
        assert_eq!(w.kv_blocks_used.load(Ordering::Relaxed), 3);
        assert_eq!(counts(&census)[1], [0, 1]);
        // The stream breaks: on probation again (and the one-stream fake
        // refuses every resubscription, so it stays there).
        drop(events);
        let deadline = Instant::now() + Duration::from_secs(20);
        while w.standing.is_ready() {
            assert!(Instant::now() < deadline, "still ready");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(matches!(
            w.standing.reason(),
            Some(Reason::Lost | Reason::Refused)
        ));
        assert_eq!(counts(&census)[1], [1, 0]);
        drop(w);
        assert_eq!(counts(&census)[1], [0, 0]);
    }

    /// A process that answers as another worker, or with another model, or
    /// refuses `Info`, never becomes ready.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_must_be_the_one_its_record_names() {
        let census = Arc::new(Census::default());
        let real = record("d1", "http://127.0.0.1:1");
        let mut other_model = info_of(&real);
        other_model.fingerprint = Some(
            (&ModelFingerprint {
                weights_hash: 8,
                ..fingerprint()
            })
                .into(),
        );
        for (info, refuse, want) in [
            (info_of(&record("d2", "")), None, Reason::Identity),
            (other_model, None, Reason::Identity),
            (
                info_of(&real),
                Some(Code::PermissionDenied),
                Reason::Refused,
            ),
        ] {
            let (port, events) = serve(info, refuse, None).await;
            events.send(Ok(load())).await.expect("send");
            let r = record("d1", &format!("http://127.0.0.1:{port}"));
            let w = follow(r, &PeerConnector::default(), &census);
            wait_for(&w, Some(want)).await;
            assert!(!w.standing.is_ready());
        }
    }

    fn cluster_tls(ca: &TestCa, id: &PemFiles) -> ClusterTls {
        ClusterTls::load(&TlsFiles {
            ca: ca.ca_path().to_path_buf(),
            cert: id.cert.clone(),
            key: id.key.clone(),
            server_name: Some("node".into()),
        })
        .expect("cluster TLS")
    }

    /// Under mutual TLS: a server whose certificate another CA signed fails
    /// as `tls`, a closed port as `unreachable`; a node with a cluster
    /// certificate is verified.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_failures_are_classed_apart_from_unreachable_workers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = TestCa::new(dir.path(), "cluster");
        let router = PeerConnector::new(Some(cluster_tls(&ca, &ca.issue("router", &["r"]))));
        let node = cluster_tls(&ca, &ca.issue("node", &["node"]));
        let rogue = TestCa::new(dir.path(), "rogue");
        let stranger = rogue.issue("stranger", &["node", "127.0.0.1"]);
        let identity = Identity::from_pem(
            std::fs::read(&stranger.cert).expect("cert"),
            std::fs::read(&stranger.key).expect("key"),
        );
        let census = Arc::new(Census::default());
        let info = info_of(&record("d1", ""));

        let (port, _events) = serve(
            info.clone(),
            None,
            Some(ServerTlsConfig::new().identity(identity)),
        )
        .await;
        let w = follow(
            record("d1", &format!("https://127.0.0.1:{port}")),
            &router,
            &census,
        );
        wait_for(&w, Some(Reason::Tls)).await;

        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let w = follow(
            record("d1", &format!("https://127.0.0.1:{closed}")),
            &router,
            &census,
        );
        wait_for(&w, Some(Reason::Unreachable)).await;

        let (port, events) = serve(info, None, Some(node.server_config())).await;
        events.send(Ok(load())).await.expect("send");
        let w = follow(
            record("d1", &format!("https://127.0.0.1:{port}")),
            &router,
            &census,
        );
        wait_for(&w, None).await;
    }

    /// Each worker's failure is logged once a minute, and again at once
    /// when its reason changes.
    #[test]
    fn failures_are_logged_at_most_once_a_minute_per_reason() {
        let s = Standing::new(Role::Prefill, Arc::default());
        assert!(s.log_due(Reason::Tls));
        assert!(!s.log_due(Reason::Tls));
        assert!(s.log_due(Reason::Unreachable));
        assert!(!s.log_due(Reason::Unreachable));
        *s.last_log.lock().expect("lock") = Some((Reason::Unreachable, Instant::now() - LOG_EVERY));
        assert!(s.log_due(Reason::Unreachable));
    }
}
