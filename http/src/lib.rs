//! The HTTP/1 connection loop of every HTTP port of the system: the
//! OpenAI API (`tandem serve`, `tandem router`) and the nodes' health and
//! metrics ports. [`serve_router`] serves an axum `Router` with a header
//! timeout, a connection cap, each connection's peer address on its
//! requests, optional TLS ([`HttpTls`]) and a bounded graceful drain.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub mod tls;

pub use tls::{HttpTls, HttpTlsError};

/// What one client's connections may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A connection that sends no complete request head for this long (a
    /// new connection, or an idle keep-alive one) is closed.
    pub header_timeout: Duration,
    /// Open connections at most; more wait in the kernel's accept queue.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            max_connections: 4096,
        }
    }
}

/// Serves `router` over HTTP/1 (inside TLS when `tls` is given) on
/// `listener` until `shutdown` resolves; then stops accepting, lets
/// in-flight requests finish for up to `grace`, and returns (connections
/// still open then are dropped). Every connection gets TCP_NODELAY and the
/// header timeout, which also bounds the TLS handshake. Used by every HTTP
/// port of the system (the API, and the nodes' health and metrics).
pub async fn serve_router(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    tls: Option<HttpTls>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    use tower_http::add_extension::AddExtension;

    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = Arc::clone(&slots).acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("setting TCP_NODELAY: {e}");
        }
        let watcher = graceful.watcher();
        // Requests know their peer (the body budget's share per address).
        let service = TowerToHyperService::new(AddExtension::new(
            router.clone(),
            axum::extract::ConnectInfo(peer),
        ));
        let (http, tls) = (http.clone(), tls.clone());
        let handshake_timeout = limits.header_timeout;
        connections.spawn(async move {
            let _slot = slot;
            let served = match tls {
                None => {
                    let conn = http.serve_connection(TokioIo::new(tcp), service);
                    watcher.watch(conn).await
                }
                Some(tls) => {
                    let stream =
                        match tokio::time::timeout(handshake_timeout, tls.acceptor().accept(tcp))
                            .await
                        {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!("TLS handshake: {e}");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!("TLS handshake timed out");
                                return;
                            }
                        };
                    let conn = http.serve_connection(TokioIo::new(stream), service);
                    watcher.watch(conn).await
                }
            };
            if let Err(e) = served {
                tracing::debug!("connection: {e}");
            }
        });
        // Reap finished connections as we go.
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace) => {
            tracing::warn!("requests still in flight after {grace:?}; exiting anyway");
        }
    }
    connections.shutdown().await;
    Ok(())
}
