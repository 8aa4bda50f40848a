//! `/metrics` and `/health` of a node, on their own HTTP port. What they
//! serve comes from the node through two callbacks, so this module does not
//! depend on the node's state (`node` builds the router).

use std::sync::Arc;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// Renders the process's metrics in Prometheus text format.
pub type MetricsRenderer = Arc<dyn Fn() -> String + Send + Sync>;

/// A node's health as `/health` reports it.
#[derive(Debug, Clone)]
pub struct Health {
    /// A draining node, or one whose steps keep failing, answers 503, so
    /// that balancers stop sending it work.
    pub unavailable: bool,
    /// The JSON body (status, identity, load).
    pub body: serde_json::Value,
}

/// Reports the node's current health.
pub type HealthReporter = Arc<dyn Fn() -> Health + Send + Sync>;

pub fn router(health: HealthReporter, render: MetricsRenderer) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let render = Arc::clone(&render);
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        render(),
                    )
                }
            }),
        )
        .route(
            "/health",
            get(move || {
                let h = health();
                async move { respond(h) }
            }),
        )
}

fn respond(h: Health) -> Response {
    let code = if h.unavailable {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, axum::Json(h.body)).into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn health_and_metrics_come_from_the_callbacks() {
        let draining = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&draining);
        let health: HealthReporter = Arc::new(move || {
            let draining = flag.load(Ordering::Relaxed);
            Health {
                unavailable: draining,
                body: serde_json::json!({ "status": if draining { "draining" } else { "ok" } }),
            }
        });
        let render: MetricsRenderer = Arc::new(|| "tandem_up 1\n".to_string());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router(health, render)).await });

        let ok = get(addr, "/health").await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.ends_with(r#"{"status":"ok"}"#), "{ok}");

        draining.store(true, Ordering::Relaxed);
        let drain = get(addr, "/health").await;
        assert!(drain.starts_with("HTTP/1.1 503"), "{drain}");
        assert!(drain.ends_with(r#"{"status":"draining"}"#), "{drain}");

        let m = get(addr, "/metrics").await;
        assert!(m.starts_with("HTTP/1.1 200"), "{m}");
        assert!(m.contains("text/plain; version=0.0.4"), "{m}");
        assert!(m.ends_with("tandem_up 1\n"), "{m}");
    }
}
