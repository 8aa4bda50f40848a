//! Cluster secrets in a real (private) etcd: created once, the same for
//! everyone who asks, per cluster.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use tandem_discovery::testing::EtcdServer;
use tandem_discovery::{DiscoveryError, EtcdConfig, get_or_create_secret, secret_key};

fn config(endpoint: String, cluster: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint],
        cluster: cluster.into(),
        lease_ttl: Duration::from_secs(2),
        security: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_of_a_cluster_gets_the_same_secret() {
    let etcd = EtcdServer::start().unwrap();
    let cfg = config(etcd.url(), "s1");
    // Sixteen nodes starting at once, each with its own candidate: one
    // candidate wins, and everyone gets it.
    let calls = (0..16u8).map(|i| {
        let cfg = cfg.clone();
        tokio::spawn(async move { get_or_create_secret(&cfg, "dkv-key", &[i; 32]).await })
    });
    let mut got = Vec::new();
    for c in calls {
        got.push(c.await.unwrap().unwrap());
    }
    let first = got[0].clone();
    assert!(got.iter().all(|g| *g == first), "{got:?}");
    assert!((0..16u8).any(|i| first == [i; 32]));
    // It is in etcd, at the documented key, and stays.
    let mut client = etcd_client::Client::connect([etcd.url()], None)
        .await
        .unwrap();
    let stored = client.get(secret_key("s1", "dkv-key"), None).await.unwrap();
    assert_eq!(stored.kvs()[0].value(), &first[..]);
    assert_eq!(
        get_or_create_secret(&cfg, "dkv-key", &[99; 32])
            .await
            .unwrap(),
        first
    );
    // Another cluster, or another name, has its own.
    let other = get_or_create_secret(&config(etcd.url(), "s2"), "dkv-key", &[77; 32])
        .await
        .unwrap();
    assert_eq!(other, [77; 32]);
    let named = get_or_create_secret(&cfg, "other", &[55; 32])
        .await
        .unwrap();
    assert_eq!(named, [55; 32]);
}

#[tokio::test]
async fn an_unreachable_etcd_is_an_error_in_bounded_time() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let r = get_or_create_secret(
        &config(format!("http://127.0.0.1:{port}"), "s3"),
        "dkv-key",
        &[1; 32],
    )
    .await;
    assert!(matches!(r, Err(DiscoveryError::Unreachable(_))), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let bad = config("http://127.0.0.1:1".into(), "no/slash");
    assert!(matches!(
        get_or_create_secret(&bad, "k", &[1]).await,
        Err(DiscoveryError::InvalidConfig(_))
    ));
}
