//! `/metrics` and `/health` of a node, on their own HTTP port.

use std::sync::Arc;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::node::NodeCore;

/// Renders the process's metrics in Prometheus text format.
pub type MetricsRenderer = Arc<dyn Fn() -> String + Send + Sync>;

pub fn router(core: Arc<NodeCore>, render: MetricsRenderer) -> Router {
    let health_core = Arc::clone(&core);
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
                let core = Arc::clone(&health_core);
                async move { health(&core).into_response() }
            }),
        )
}

fn health(core: &NodeCore) -> impl IntoResponse + use<> {
    let s = core.scheduler.stats();
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(std::sync::atomic::Ordering::Relaxed);
    let body = serde_json::json!({
        "status": if core.is_draining() { "draining" } else { "ok" },
        "id": core.id,
        "role": core.role.as_str(),
        "registered": core.is_registered(),
        "waiting": load(&s.waiting),
        "running": load(&s.running),
        "importing": load(&s.importing),
        "exported": load(&s.exported),
        "kv_blocks_total": load(&s.kv_blocks_total),
        "kv_blocks_in_use": load(&s.kv_blocks_in_use),
        "kv_blocks_cached": load(&s.kv_blocks_cached),
        "kv_connector": core.dkv.connector(),
        "last_kv_event_id": core.hub.last_id(),
    });
    let code = if core.is_draining() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, axum::Json(body))
}
