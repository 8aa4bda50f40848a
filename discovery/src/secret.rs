//! Cluster-wide secrets kept in etcd, under `/tandem/<cluster>/secrets/`:
//! created by whichever node of a cluster asks first, then read by all. The
//! value is as secret as etcd is: whoever can read the cluster's keys has
//! it (run etcd with authentication and TLS).

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use crate::client::{CONNECT_TIMEOUT, bounded, classify, connect};
use crate::{DiscoveryError, EtcdConfig};

/// The etcd key of the cluster's secret `name`; outside the workers'
/// prefix, so no membership watch ever sees it.
pub fn secret_key(cluster: &str, name: &str) -> String {
    format!("/tandem/{cluster}/secrets/{name}")
}

/// The cluster's secret `name`: the value stored in etcd, or `fresh`,
/// stored now if there was none. One transaction (create if absent, else
/// read), so every node of a cluster ends with the same value however many
/// start at once.
pub async fn get_or_create_secret(
    cfg: &EtcdConfig,
    name: &str,
    fresh: &[u8],
) -> Result<Vec<u8>, DiscoveryError> {
    cfg.validate()?;
    let key = secret_key(&cfg.cluster, name);
    bounded(CONNECT_TIMEOUT, "reading the cluster's secret", async {
        let mut client = connect(cfg).await?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), fresh.to_vec(), None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let resp = client.txn(txn).await.map_err(classify)?;
        if resp.succeeded() {
            return Ok(fresh.to_vec());
        }
        resp.op_responses()
            .into_iter()
            .find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
                _ => None,
            })
            .ok_or_else(|| {
                DiscoveryError::InvalidConfig(format!("etcd has {key} but returned no value"))
            })
    })
    .await
}
