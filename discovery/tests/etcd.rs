//! Registration and membership against a real (private) etcd.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant};

use tandem_discovery::testing::EtcdServer;
use tandem_discovery::{
    CONNECT_TIMEOUT, DiscoveryError, EtcdConfig, Member, Membership, Registration, Role,
    parse_worker_key, worker_key, workers_prefix,
};

const TTL: Duration = Duration::from_secs(2);

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "tandem_discovery=debug".into()),
        )
        .try_init();
}

fn config(endpoint: String, cluster: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint],
        cluster: cluster.into(),
        lease_ttl: TTL,
        security: Default::default(),
    }
}

/// Polls `cond` until it holds; the time it took, or None after `limit`.
async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if cond() {
            return Some(start.elapsed());
        }
        if start.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn has(m: &Membership, role: Role, id: &str) -> bool {
    m.current().contains_key(&(role, id.to_owned()))
}

fn member(role: Role, id: &str, value: &[u8]) -> ((Role, String), Member) {
    (
        (role, id.to_owned()),
        Member {
            role,
            id: id.to_owned(),
            value: value.to_vec(),
        },
    )
}

async fn etcd_client(etcd: &EtcdServer) -> etcd_client::Client {
    etcd_client::Client::connect([etcd.url()], None)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_sees_registered_workers_and_drops_one_on_shutdown() {
    init_logs();
    let etcd = EtcdServer::start().unwrap();
    let cfg = config(etcd.url(), "c1");

    // One worker before the watcher starts (found by the initial list), one
    // after (found by the watch).
    let prefill = Registration::start(&cfg, Role::Prefill, "p-0", b"prefill record".to_vec())
        .await
        .unwrap();
    let members = Membership::watch(&cfg).await.unwrap();
    assert!(members.is_connected());
    assert_eq!(
        *members.current(),
        BTreeMap::from([member(Role::Prefill, "p-0", b"prefill record")])
    );
    let decode_value = vec![0u8, 1, 2, 0xff, 0];
    let decode = Registration::start(&cfg, Role::Decode, "127.0.0.1:9001", decode_value.clone())
        .await
        .unwrap();
    assert!(prefill.is_registered() && decode.is_registered());
    assert_eq!(decode.key(), "/tandem/c1/workers/decode/127.0.0.1:9001");

    let expected = BTreeMap::from([
        member(Role::Prefill, "p-0", b"prefill record"),
        member(Role::Decode, "127.0.0.1:9001", &decode_value),
    ]);
    let mut rx = members.subscribe();
    let seen = wait_for(Duration::from_secs(5), || *members.current() == expected).await;
    assert!(seen.is_some(), "watcher has {:?}", members.current());
    assert_eq!(**rx.borrow_and_update(), expected);

    // Another cluster on the same etcd sees none of these.
    let other = Membership::watch(&config(etcd.url(), "c")).await.unwrap();
    assert!(other.current().is_empty());

    // Keepalive holds the keys well past the TTL.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(*members.current(), expected);
    assert!(prefill.is_registered() && decode.is_registered());

    let start = Instant::now();
    decode.shutdown().await;
    let gone = wait_for(Duration::from_secs(1), || {
        !has(&members, Role::Decode, "127.0.0.1:9001")
    })
    .await;
    let took = start.elapsed();
    assert!(
        gone.is_some(),
        "decode still listed {took:?} after shutdown"
    );
    eprintln!("shutdown -> dropped from the watch in {took:?}");
    assert!(rx.has_changed().unwrap());
    assert_eq!(
        *members.current(),
        BTreeMap::from([member(Role::Prefill, "p-0", b"prefill record")])
    );
    // The key is gone from etcd itself, not just from this watcher.
    let key = worker_key("c1", Role::Decode, "127.0.0.1:9001");
    let left = etcd_client(&etcd).await.get(key, None).await.unwrap();
    assert!(left.kvs().is_empty());
    assert!(other.current().is_empty());

    prefill.shutdown().await;
    assert!(
        wait_for(Duration::from_secs(1), || members.current().is_empty())
            .await
            .is_some()
    );
    other.shutdown().await;
    members.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_registration_expires_with_its_lease() {
    init_logs();
    let etcd = EtcdServer::start().unwrap();
    let cfg = config(etcd.url(), "c2");
    let members = Membership::watch(&cfg).await.unwrap();
    let reg = Registration::start(&cfg, Role::Decode, "d-crash", b"x".to_vec())
        .await
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || has(
            &members,
            Role::Decode,
            "d-crash"
        ))
        .await
        .is_some()
    );

    // Dropping without shutdown is how a kill -9 looks: no goodbye.
    drop(reg);
    let dropped = Instant::now();
    assert!(has(&members, Role::Decode, "d-crash"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        has(&members, Role::Decode, "d-crash"),
        "key removed on drop: a crash must leave it to the lease"
    );

    let gone = wait_for(TTL + Duration::from_secs(3), || {
        !has(&members, Role::Decode, "d-crash")
    })
    .await;
    let after = dropped.elapsed();
    assert!(gone.is_some(), "still listed {after:?} after the drop");
    eprintln!("dropped registration expired {after:?} after the drop");
    members.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_keeps_membership_and_registration_returns() {
    init_logs();
    let mut etcd = EtcdServer::start().unwrap();
    let cfg = config(etcd.url(), "c3");
    let reg = Registration::start(&cfg, Role::Prefill, "p-a", b"a".to_vec())
        .await
        .unwrap();
    // Crashes just before the outage: etcd restores its lease on restart,
    // so it must still go away afterwards.
    let crashed = Registration::start(&cfg, Role::Decode, "d-crash", b"c".to_vec())
        .await
        .unwrap();
    let members = Membership::watch(&cfg).await.unwrap();
    let before = BTreeMap::from([
        member(Role::Prefill, "p-a", b"a"),
        member(Role::Decode, "d-crash", b"c"),
    ]);
    assert_eq!(*members.current(), before);
    let old_lease = reg.lease_id().unwrap();
    drop(crashed);

    etcd.stop();
    let outage = Instant::now();
    assert!(
        wait_for(Duration::from_secs(5), || !members.is_connected())
            .await
            .is_some(),
        "watcher still claims a connection with etcd down"
    );
    assert!(
        wait_for(Duration::from_secs(5), || !reg.is_registered())
            .await
            .is_some(),
        "registration still claims to be registered with etcd down"
    );
    // Outlast the TTL: the old lease cannot be relied on afterwards.
    tokio::time::sleep((TTL + Duration::from_secs(1)).saturating_sub(outage.elapsed())).await;
    assert_eq!(
        *members.current(),
        before,
        "last known membership must be kept"
    );
    assert!(!members.is_connected());

    etcd.start_again().unwrap();
    let restarted = Instant::now();
    let back = wait_for(Duration::from_secs(15), || {
        reg.is_registered() && reg.lease_id().is_some_and(|l| l != old_lease)
    })
    .await;
    assert!(back.is_some(), "registration did not come back");
    eprintln!("re-registered {:?} after etcd answered", back.unwrap());
    assert!(
        wait_for(Duration::from_secs(15), || members.is_connected())
            .await
            .is_some(),
        "watcher did not reconnect"
    );
    eprintln!(
        "watch restored {:?} after etcd answered",
        restarted.elapsed()
    );

    // etcd holds the key under the fresh lease; the old one is gone.
    let mut client = etcd_client(&etcd).await;
    let key = worker_key("c3", Role::Prefill, "p-a");
    let got = client.get(key.as_str(), None).await.unwrap();
    let kv = &got.kvs()[0];
    assert_eq!(kv.value(), b"a");
    assert_eq!(Some(kv.lease()), reg.lease_id());
    let mut old_alive = true;
    for _ in 0..50 {
        let ttl = client.lease_time_to_live(old_lease, None).await.unwrap();
        old_alive = ttl.ttl() > 0;
        if !old_alive {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!old_alive, "old lease {old_lease:x} still alive");

    // A worker registered after the restart shows up in the same watcher,
    // and the one that crashed before the outage is dropped.
    let late = Registration::start(&cfg, Role::Decode, "d-late", b"late".to_vec())
        .await
        .unwrap();
    let after = BTreeMap::from([
        member(Role::Prefill, "p-a", b"a"),
        member(Role::Decode, "d-late", b"late"),
    ]);
    let converged = wait_for(TTL + Duration::from_secs(5), || *members.current() == after).await;
    assert!(
        converged.is_some(),
        "watcher has {:?} {:?} after restart",
        members.current(),
        restarted.elapsed()
    );

    late.shutdown().await;
    reg.shutdown().await;
    members.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_config_and_unreachable_etcd_fail_fast() {
    init_logs();
    let good = config("http://127.0.0.1:2379".into(), "ok_Cluster-1");
    good.validate().unwrap();
    let bad = [
        EtcdConfig {
            endpoints: vec![],
            ..good.clone()
        },
        EtcdConfig {
            endpoints: vec![" ".into()],
            ..good.clone()
        },
        EtcdConfig {
            cluster: String::new(),
            ..good.clone()
        },
        EtcdConfig {
            cluster: "a/b".into(),
            ..good.clone()
        },
        EtcdConfig {
            cluster: "a b".into(),
            ..good.clone()
        },
        EtcdConfig {
            cluster: "é".into(),
            ..good.clone()
        },
        EtcdConfig {
            lease_ttl: Duration::from_millis(999),
            ..good.clone()
        },
        EtcdConfig {
            lease_ttl: Duration::ZERO,
            ..good.clone()
        },
    ];
    for cfg in &bad {
        assert!(
            matches!(cfg.validate(), Err(DiscoveryError::InvalidConfig(_))),
            "{cfg:?} accepted"
        );
        let r = Registration::start(cfg, Role::Decode, "d", vec![]).await;
        assert!(
            matches!(r, Err(DiscoveryError::InvalidConfig(_))),
            "{cfg:?}"
        );
        let m = Membership::watch(cfg).await;
        assert!(
            matches!(m, Err(DiscoveryError::InvalidConfig(_))),
            "{cfg:?}"
        );
    }
    for id in ["", "a/b", "a b", "ü", "x\n"] {
        let r = Registration::start(&good, Role::Prefill, id, vec![]).await;
        assert!(
            matches!(r, Err(DiscoveryError::InvalidConfig(_))),
            "id {id:?} accepted"
        );
    }

    // Nothing listens on a port we just released (refused at once), and a
    // listener that never answers (the TCP handshake completes in the
    // kernel backlog, then silence): both must end in Unreachable within the
    // connect timeout, not hang.
    let closed = {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        l.local_addr().unwrap().port()
    };
    let silent = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    for endpoint in [
        format!("http://127.0.0.1:{closed}"),
        format!("http://{}", silent.local_addr().unwrap()),
    ] {
        let cfg = config(endpoint.clone(), "c4");
        // Both at once: each must give up on its own clock.
        let start = Instant::now();
        let (r, m) = tokio::join!(
            async {
                let r = Registration::start(&cfg, Role::Prefill, "p", vec![1]).await;
                (r, start.elapsed())
            },
            async {
                let m = Membership::watch(&cfg).await;
                (m, start.elapsed())
            },
        );
        let ((r, r_took), (m, m_took)) = (r, m);
        eprintln!("{endpoint}: start failed in {r_took:?}, watch in {m_took:?}");
        assert!(
            matches!(r, Err(DiscoveryError::Unreachable(_))),
            "{endpoint}: {r:?}"
        );
        assert!(
            matches!(m, Err(DiscoveryError::Unreachable(_))),
            "{endpoint}: {m:?}"
        );
        let limit = CONNECT_TIMEOUT + Duration::from_secs(1);
        assert!(
            r_took < limit && m_took < limit,
            "{endpoint}: {r_took:?} {m_took:?}"
        );
    }

    drop(silent);

    // A malformed URL is a config error, not an outage.
    let r = Registration::start(
        &config("http://[::1".into(), "c4"),
        Role::Prefill,
        "p",
        vec![],
    )
    .await;
    assert!(matches!(r, Err(DiscoveryError::InvalidConfig(_))), "{r:?}");
}

#[test]
fn worker_keys_round_trip_and_reject_everything_else() {
    assert_eq!(workers_prefix("c"), "/tandem/c/workers/");
    let key = worker_key("c", Role::Prefill, "10.0.0.1:50051");
    assert_eq!(key, "/tandem/c/workers/prefill/10.0.0.1:50051");
    assert_eq!(
        parse_worker_key("c", &key),
        Some((Role::Prefill, "10.0.0.1:50051".to_owned()))
    );
    assert_eq!(
        parse_worker_key("c", "/tandem/c/workers/decode/d-1"),
        Some((Role::Decode, "d-1".to_owned()))
    );
    for bad in [
        "/tandem/other/workers/prefill/p",   // wrong cluster
        "/tandem/cc/workers/prefill/p",      // cluster that merely shares a prefix
        "/tandem/c/workers/router/p",        // unknown role
        "/tandem/c/workers/Prefill/p",       // roles are lower case
        "/tandem/c/workers/prefill/",        // empty id
        "/tandem/c/workers/prefill",         // no id segment
        "/tandem/c/workers/",                // the prefix itself
        "/tandem/c/workers/prefill/p/extra", // extra path segment
        "/tandem/c/workers/prefill/p/",      // trailing slash
        "/tandem/c/workers//p",              // empty role
        "/tandem/c/workers/prefill/a b",     // id with a space
        "tandem/c/workers/prefill/p",        // not absolute
        "/tandem/c/nodes/prefill/p",         // not under workers
        "",
    ] {
        assert_eq!(parse_worker_key("c", bad), None, "{bad:?}");
    }
    for role in [Role::Prefill, Role::Decode] {
        assert_eq!(role.as_str().parse::<Role>().unwrap(), role);
        assert_eq!(role.to_string(), role.as_str());
    }
    assert!("PREFILL".parse::<Role>().is_err());
    assert!("".parse::<Role>().is_err());
    assert!(Role::Prefill < Role::Decode);
}

#[test]
fn etcd_server_reports_a_failed_start_and_dies_with_its_handle() {
    let mut etcd = EtcdServer::start().unwrap();
    assert!(etcd.is_running());
    let port: u16 = etcd.url().rsplit(':').next().unwrap().parse().unwrap();
    etcd.stop();
    assert!(!etcd.is_running());
    // Someone else takes the client port: the restart must fail at once with
    // etcd's own words, not time out.
    let squatter = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
    let start = Instant::now();
    let err = etcd.start_again().unwrap_err().to_string();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert!(err.contains("etcd exited"), "{err}");
    assert!(err.contains("address already in use"), "{err}");
    drop(squatter);

    etcd.start_again().unwrap();
    assert!(etcd.is_running());
    drop(etcd);
    assert!(
        std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err(),
        "etcd outlived its handle"
    );
}

/// An etcd that demands TLS client certificates, then etcd's own user
/// authentication: workers register only with both, and a process with
/// neither (or another CA's certificate) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_user_authentication_keep_strangers_out() {
    use tandem_discovery::testing::ServerTls;
    use tandem_discovery::{EtcdSecurity, EtcdTls, EtcdUser};
    use tandem_testkit::tls::{PemFiles, TestCa};
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "etcd");
    let server = ca.issue("server", &["127.0.0.1", "localhost"]);
    let node = ca.issue("node", &["node"]);
    let rogue = TestCa::new(dir.path(), "rogue").issue("stranger", &["node"]);
    let etcd = EtcdServer::start_tls(ServerTls {
        ca: server.ca.clone(),
        cert: server.cert.clone(),
        key: server.key.clone(),
    })
    .unwrap();
    assert!(etcd.url().starts_with("https://"));
    let ca_pem = std::fs::read(ca.ca_path()).unwrap();
    let identity = |p: &PemFiles| {
        Some((
            std::fs::read(&p.cert).unwrap(),
            std::fs::read(&p.key).unwrap(),
        ))
    };
    let with = |identity: Option<(Vec<u8>, Vec<u8>)>, user: Option<EtcdUser>| EtcdConfig {
        security: EtcdSecurity {
            tls: Some(EtcdTls {
                ca_pem: ca_pem.clone(),
                identity,
            }),
            user,
        },
        ..config(etcd.url(), "secure")
    };

    // Plaintext settings for an https:// endpoint are refused up front.
    let plain = config(etcd.url(), "secure");
    assert!(matches!(
        Registration::start(&plain, Role::Decode, "d", b"v".to_vec()).await,
        Err(DiscoveryError::InvalidConfig(_))
    ));
    // No client certificate, or one from another CA: etcd refuses.
    for (who, id) in [("none", None), ("another CA's", identity(&rogue))] {
        let r = Registration::start(&with(id, None), Role::Decode, "d", b"v".to_vec()).await;
        assert!(r.is_err(), "registered with {who} certificate");
    }
    // The cluster's certificate works.
    let good = with(identity(&node), None);
    let reg = Registration::start(&good, Role::Decode, "d0", b"v".to_vec())
        .await
        .unwrap();
    let m = Membership::watch(&good).await.unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || has(&m, Role::Decode, "d0"))
            .await
            .is_some()
    );
    reg.shutdown().await;
    m.shutdown().await;

    // Turn on etcd's authentication (root user), as an operator would.
    let tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(&ca_pem))
        .identity(etcd_client::Identity::from_pem(
            std::fs::read(&node.cert).unwrap(),
            std::fs::read(&node.key).unwrap(),
        ));
    let mut admin = etcd_client::Client::connect(
        [etcd.url()],
        Some(etcd_client::ConnectOptions::new().with_tls(tls)),
    )
    .await
    .unwrap();
    admin.user_add("root", "s3cret", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    // A certificate alone no longer writes; a wrong password neither.
    let r = Registration::start(&good, Role::Decode, "d1", b"v".to_vec()).await;
    assert!(r.is_err(), "registered without a user");
    let wrong = EtcdUser {
        name: "root".into(),
        password: "guess".into(),
    };
    let r = Registration::start(
        &with(identity(&node), Some(wrong)),
        Role::Decode,
        "d1",
        b"v".to_vec(),
    )
    .await;
    assert!(r.is_err(), "registered with a wrong password");
    let user = EtcdUser {
        name: "root".into(),
        password: "s3cret".into(),
    };
    // The password never shows in logs.
    assert!(!format!("{user:?}").contains("s3cret"));
    let authed = with(identity(&node), Some(user));
    let reg = Registration::start(&authed, Role::Decode, "d1", b"v".to_vec())
        .await
        .unwrap();
    let m = Membership::watch(&authed).await.unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || has(&m, Role::Decode, "d1"))
            .await
            .is_some()
    );
    reg.shutdown().await;
    m.shutdown().await;
}
