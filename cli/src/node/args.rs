//! Flags the disaggregated roles share: where etcd is (`EtcdArgs`), the
//! cluster's mutual TLS (`ClusterTlsArgs`), and a prefill or decode node's
//! own (`NodeArgs`), checked into the node's options.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use tandem_discovery::{EtcdConfig, EtcdSecurity, EtcdTls, EtcdUser, Role};
use tandem_dkv::TransportKind;
use tandem_proto::tls::{ClusterTls, TlsFiles};
use tandem_worker::NodeOptions;

use crate::serve::{SHUTDOWN_GRACE, parse_addr};
use crate::telemetry::TelemetryArgs;

/// Where the cluster's etcd is and how workers register there.
#[derive(Debug, Args)]
pub struct EtcdArgs {
    /// etcd client URL(s), comma-separated (e.g. http://127.0.0.1:2379).
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: workers and routers of one cluster share it.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Lease TTL in seconds: how long a crashed worker stays listed.
    #[arg(long, env = "TANDEM_LEASE_TTL", default_value_t = 5)]
    pub lease_ttl: u64,
    /// PEM CA of etcd's server certificate (for https:// etcd endpoints).
    #[arg(long, env = "TANDEM_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate for an etcd run with --client-cert-auth.
    #[arg(long, env = "TANDEM_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, env = "TANDEM_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd's own authentication; the password from
    /// TANDEM_ETCD_PASSWORD or --etcd-password-file).
    #[arg(long, env = "TANDEM_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// The etcd user's password (prefer the environment variable or
    /// --etcd-password-file: a flag shows in the process list).
    #[arg(long, env = "TANDEM_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,
    /// File holding the etcd user's password (first line).
    #[arg(long, env = "TANDEM_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

impl EtcdArgs {
    fn security(&self) -> Result<EtcdSecurity> {
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p).with_context(|| format!("reading {what} {}", p.display()))
        };
        let tls = match &self.etcd_ca {
            None if self.etcd_cert.is_some() => bail!("--etcd-cert needs --etcd-ca"),
            None => None,
            Some(ca) => Some(EtcdTls {
                ca_pem: read(ca, "--etcd-ca")?,
                identity: match (&self.etcd_cert, &self.etcd_key) {
                    (Some(c), Some(k)) => Some((read(c, "--etcd-cert")?, read(k, "--etcd-key")?)),
                    _ => None,
                },
            }),
        };
        let password = match (&self.etcd_password_file, &self.etcd_password) {
            (Some(_), Some(_)) => {
                bail!("--etcd-password and --etcd-password-file are alternatives")
            }
            (Some(f), None) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("reading --etcd-password-file {}", f.display()))?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            ),
            (None, p) => p.clone(),
        };
        let user = match (&self.etcd_user, password) {
            (Some(name), Some(password)) => Some(EtcdUser {
                name: name.clone(),
                password,
            }),
            (Some(_), None) => {
                bail!(
                    "--etcd-user needs --etcd-password (TANDEM_ETCD_PASSWORD) or --etcd-password-file"
                )
            }
            (None, Some(_)) => bail!("an etcd password was given without --etcd-user"),
            (None, None) => None,
        };
        Ok(EtcdSecurity { tls, user })
    }

    pub(super) fn config(&self) -> Result<Option<EtcdConfig>> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let c = EtcdConfig {
            endpoints: self.etcd.clone(),
            cluster: self.cluster.clone(),
            lease_ttl: Duration::from_secs(self.lease_ttl),
            security: self.security()?,
        };
        c.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Some(c))
    }
}

/// The process's identity in the cluster: mutual TLS on every internal gRPC
/// connection (all three flags, or none for plaintext).
#[derive(Debug, Args)]
pub struct ClusterTlsArgs {
    /// PEM file of the cluster CA: peers must present certificates it signed.
    #[arg(long, env = "TANDEM_CLUSTER_CA")]
    pub cluster_ca: Option<PathBuf>,
    /// PEM certificate (chain) of this process, signed by the cluster CA; for
    /// nodes its names must cover --advertise-host.
    #[arg(long, env = "TANDEM_CLUSTER_CERT")]
    pub cluster_cert: Option<PathBuf>,
    /// PEM private key of --cluster-cert.
    #[arg(long, env = "TANDEM_CLUSTER_KEY")]
    pub cluster_key: Option<PathBuf>,
    /// The DNS name every node certificate carries, checked instead of the
    /// dialled host (for pods, whose addresses no certificate can name).
    #[arg(long, env = "TANDEM_CLUSTER_SERVER_NAME", requires = "cluster_ca")]
    pub cluster_server_name: Option<String>,
}

impl ClusterTlsArgs {
    pub(super) fn load(&self) -> Result<Option<ClusterTls>> {
        match (&self.cluster_ca, &self.cluster_cert, &self.cluster_key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => {
                let files = TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                    server_name: self.cluster_server_name.clone(),
                };
                Ok(Some(ClusterTls::load(&files)?))
            }
            _ => bail!("--cluster-ca, --cluster-cert and --cluster-key go together"),
        }
    }
}

/// Flags of a prefill or decode node.
#[derive(Debug, Args)]
pub struct NodeArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Address the gRPC and metrics servers bind.
    #[arg(long, env = "TANDEM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// gRPC port (0 picks a free one; the bound port is printed).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 0)]
    pub port: u16,
    /// Port of /metrics and /health (0 picks a free one; printed).
    #[arg(long, env = "TANDEM_METRICS_PORT", default_value_t = 0)]
    pub metrics_port: u16,
    /// Host other processes dial, as advertised in etcd.
    #[arg(long, env = "TANDEM_ADVERTISE_HOST", default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// Worker id in the membership (default: role-pid).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub id: Option<String>,
    /// KV transfer connector: ucx (libucp; UCX_TLS picks tcp/shm/rdma) or local (in-process only).
    #[arg(long, env = "TANDEM_KV_CONNECTOR", default_value = "ucx", value_parser = ["ucx", "local"])]
    pub kv_connector: String,
    /// UCX transports (UCX_TLS) for the ucx connector, e.g. tcp or posix,sysv,cma,self.
    #[arg(long, env = "TANDEM_UCX_TLS")]
    pub ucx_tls: Option<String>,
    /// Network interfaces the ucx connector uses (UCX_NET_DEVICES, e.g.
    /// eth0 or mlx5_0:1). Default: the interface holding --advertise-host
    /// (lo for 127.0.0.1), so KV ports never open on other interfaces.
    #[arg(long, env = "TANDEM_UCX_NET_DEVICES")]
    pub ucx_net_devices: Option<String>,
    /// UCX's libucp, loaded when the ucx connector starts (default
    /// `libucp.so.0` from the library path: Debian's libucx0).
    #[arg(long, env = "TANDEM_UCX_LIBRARY")]
    pub ucx_library: Option<PathBuf>,
    /// File holding the cluster's dKV key (64 hex digits, e.g. from
    /// `openssl rand -hex 32`): KV addresses are sealed with it and a
    /// peer's must verify under it. Default: the key in etcd under the
    /// cluster's prefix, created by the first node (etcd access is then
    /// key access: run etcd with authentication).
    #[arg(long, env = "TANDEM_DKV_KEY_FILE")]
    pub dkv_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: ClusterTlsArgs,
    /// Close gRPC connections that carried no traffic for this many seconds.
    #[arg(long, env = "TANDEM_GRPC_IDLE_TIMEOUT_SECS", default_value_t = 300)]
    pub grpc_idle_timeout_secs: u64,
    /// Prefix-cache events kept for routers that reconnect (a router
    /// further behind rebuilds its view from scratch); each holds a few
    /// hundred bytes until the ring is full.
    #[arg(long, env = "TANDEM_KV_EVENT_RING", default_value_t = tandem_worker::node::EVENT_RING)]
    pub kv_event_ring: usize,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// The interface holding `host`'s address (resolved if it is a name).
fn interface_of(host: &str) -> Option<String> {
    use std::net::ToSocketAddrs;
    let ips: Vec<std::net::IpAddr> = (host, 0).to_socket_addrs().ok()?.map(|a| a.ip()).collect();
    if_addrs::get_if_addrs()
        .ok()?
        .into_iter()
        .find(|i| ips.contains(&i.ip()))
        .map(|i| i.name)
}

pub(super) fn node_options(node: &NodeArgs, role: Role) -> Result<NodeOptions> {
    let transport = match node.kv_connector.as_str() {
        "local" => TransportKind::InProcess,
        _ => TransportKind::Ucx,
    };
    Ok(NodeOptions {
        role,
        id: node
            .id
            .clone()
            .unwrap_or_else(|| format!("{}-{}", role.as_str(), std::process::id())),
        grpc_addr: parse_addr(&node.host, node.port)?,
        metrics_addr: parse_addr(&node.host, node.metrics_port)?,
        advertise_host: node.advertise_host.clone(),
        etcd: node.etcd.config()?,
        transport,
        ucx_tls: node.ucx_tls.clone(),
        ucx_library: node.ucx_library.clone(),
        ucx_net_devices: match &node.ucx_net_devices {
            Some(d) => Some(d.clone()),
            None if transport == TransportKind::Ucx => {
                let found = interface_of(&node.advertise_host);
                if found.is_none() {
                    tracing::warn!(
                        "no interface holds --advertise-host {}; UCX may listen on every \
                         interface (set --ucx-net-devices)",
                        node.advertise_host
                    );
                }
                found
            }
            None => None,
        },
        // Set by `run_node` (it may come from etcd).
        dkv_key: None,
        shutdown_grace: SHUTDOWN_GRACE,
        tls: node.tls.load()?,
        grpc_idle_timeout: match node.grpc_idle_timeout_secs {
            0 => bail!("--grpc-idle-timeout-secs must be at least 1"),
            s => Duration::from_secs(s),
        },
        kv_event_ring: match node.kv_event_ring {
            0 => bail!("--kv-event-ring must be at least 1"),
            n => n,
        },
    })
}
