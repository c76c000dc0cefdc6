//! The metrics server's routes: `/metrics`, `/healthz`, `/proxyMode`, `/configz`.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::TIMEOUT;
use kp_metrics::Metrics;
use kp_serve::{metrics_router, CONFIGZ_NAME, METRICS_CONTENT_TYPE};
use serde_json::json;
use tower::ServiceExt;

struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    nosniff: Option<String>,
    body: String,
}

async fn call(metrics: Arc<Metrics>, path: &str) -> Answer {
    let router = metrics_router(
        metrics,
        "nftables",
        json!({"mode": "nftables", "syncPeriod": "30s"}),
    );
    let request = Request::builder()
        .uri(path)
        .body(Body::empty())
        .expect("request");
    let resp = router.oneshot(request).await.expect("infallible");
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().expect("ASCII header").to_string())
    };
    let (content_type, nosniff) = (header("content-type"), header("x-content-type-options"));
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    Answer {
        status,
        content_type,
        nosniff,
        body: String::from_utf8(bytes.to_vec()).expect("utf-8"),
    }
}

#[tokio::test]
async fn metrics_serves_the_registry_as_openmetrics() {
    let metrics = Arc::new(Metrics::new());
    metrics.last_sync_timestamp.set(1_700_000_000.5);
    metrics.nftables_sync_failures.inc();
    let a = call(metrics, "/metrics").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.content_type.as_deref(), Some(METRICS_CONTENT_TYPE));
    assert!(
        a.body
            .contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds 1700000000.5"),
        "{}",
        a.body
    );
    assert!(a
        .body
        .contains("kubeproxy_sync_proxy_rules_nftables_sync_failures_total 1"));
    assert!(a.body.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
}

#[tokio::test]
async fn proxy_mode_is_the_mode_name_in_plain_text() {
    let a = call(Arc::new(Metrics::new()), "/proxyMode").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body, "nftables");
    assert_eq!(a.content_type.as_deref(), Some("text/plain; charset=utf-8"));
    assert_eq!(a.nosniff.as_deref(), Some("nosniff"));
}

#[tokio::test]
async fn configz_wraps_the_configuration_under_upstreams_group_name() {
    let a = call(Arc::new(Metrics::new()), "/configz").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.content_type.as_deref(), Some("application/json"));
    assert_eq!(a.nosniff.as_deref(), Some("nosniff"));
    let body: serde_json::Value = serde_json::from_str(&a.body).expect("JSON");
    assert_eq!(CONFIGZ_NAME, "kubeproxy.config.k8s.io");
    assert_eq!(
        body,
        json!({"kubeproxy.config.k8s.io": {"mode": "nftables", "syncPeriod": "30s"}})
    );
}

#[tokio::test]
async fn healthz_is_upstreams_ping_check() {
    let a = call(Arc::new(Metrics::new()), "/healthz").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body, "ok");
    assert_eq!(a.content_type.as_deref(), Some("text/plain; charset=utf-8"));
    assert_eq!(a.nosniff.as_deref(), Some("nosniff"));

    let v = call(Arc::new(Metrics::new()), "/healthz?verbose").await;
    assert_eq!(v.body, "[+]ping ok\nhealthz check passed\n");
    let v = call(Arc::new(Metrics::new()), "/healthz?exclude=x&verbose=1").await;
    assert_eq!(v.body, "[+]ping ok\nhealthz check passed\n");

    assert_eq!(
        call(Arc::new(Metrics::new()), "/healthz/ping").await.body,
        "ok"
    );
    assert_eq!(
        call(Arc::new(Metrics::new()), "/livez").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn serve_metrics_answers_on_loopback_and_stops_on_shutdown() {
    let metrics = Arc::new(Metrics::new());
    let listener = kp_serve::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mode = String::from("nftables");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // The future borrows nothing: a String's &str is enough to spawn it.
    let server = tokio::spawn(kp_serve::serve_metrics(
        listener,
        metrics,
        &mode,
        json!({}),
        async {
            let _ = stopped.await;
        },
    ));
    drop(mode);

    let reply = common::get(addr, "/metrics").await.expect("GET /metrics");
    assert_eq!(reply.status, 200);
    assert!(reply
        .body
        .contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds"));
    assert_eq!(
        common::get(addr, "/proxyMode").await.expect("GET").body,
        "nftables"
    );

    stop.send(()).expect("server still running");
    let result = tokio::time::timeout(TIMEOUT, server)
        .await
        .expect("stops")
        .expect("no panic");
    assert!(result.is_ok(), "{result:?}");
}
