//! The metrics server (`--metrics-bind-address`, default `127.0.0.1:10249`), as upstream's
//! `serveMetrics` in `cmd/kube-proxy/app/server.go`: `/metrics`, `/healthz`, `/proxyMode` and
//! `/configz`.

use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::any;
use axum::Router;
use kp_metrics::Metrics;
use tokio::net::TcpListener;

use crate::health_server::{json_response, text_response};
use crate::Error;

/// What [`Metrics::encode`] writes: the OpenMetrics text format (it ends in `# EOF` and names
/// counters without `_total` in `# TYPE`), so it is served under OpenMetrics' own media type,
/// which Prometheus asks for first and parses natively.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The name upstream registers its configuration under with `configz.New`
/// (`proxyconfigapi.GroupName`): `/configz` answers `{"kubeproxy.config.k8s.io": <config>}`.
pub const CONFIGZ_NAME: &str = "kubeproxy.config.k8s.io";

#[derive(Clone)]
struct MetricsState {
    metrics: Arc<Metrics>,
    proxy_mode: Arc<str>,
    configz: Arc<serde_json::Value>,
}

async fn metrics(State(state): State<MetricsState>) -> Response {
    let mut resp = Response::new(Body::from(state.metrics.encode()));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(METRICS_CONTENT_TYPE),
    );
    resp
}

/// Upstream installs `healthz.InstallHandler(mux)` with no checks, i.e. the apiserver library's
/// `ping` check: the answer says the process serves HTTP, not that the proxy is in sync
/// (that is port 10256's job). A liveness probe pointed here therefore never restarts a
/// kube-proxy whose Node is merely draining.
async fn healthz(RawQuery(query): RawQuery) -> Response {
    let verbose = query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .any(|pair| pair.split('=').next() == Some("verbose"));
    if verbose {
        text_response(StatusCode::OK, "[+]ping ok\nhealthz check passed\n")
    } else {
        text_response(StatusCode::OK, "ok")
    }
}

/// The single named check's own path, as upstream installs `/healthz/ping`.
async fn healthz_ping() -> Response {
    text_response(StatusCode::OK, "ok")
}

async fn proxy_mode(State(state): State<MetricsState>) -> Response {
    text_response(StatusCode::OK, state.proxy_mode.to_string())
}

async fn configz(State(state): State<MetricsState>) -> Response {
    let mut wrapped = serde_json::Map::new();
    wrapped.insert(CONFIGZ_NAME.to_string(), (*state.configz).clone());
    json_response(StatusCode::OK, serde_json::to_vec(&wrapped))
}

/// The metrics server's routes.
///
/// - `/metrics`: `metrics.encode()`, as [`METRICS_CONTENT_TYPE`].
/// - `/healthz` (and `/healthz/ping`): `ok`, upstream's ping check; `?verbose` lists the check.
/// - `/proxyMode`: `proxy_mode` as plain text, e.g. `nftables`.
/// - `/configz`: `configz`, the effective configuration, wrapped as
///   `{"kubeproxy.config.k8s.io": configz}` the way upstream's configz handler wraps it.
///   The caller redacts anything secret before handing it over.
pub fn metrics_router(
    metrics: Arc<Metrics>,
    proxy_mode: &str,
    configz: serde_json::Value,
) -> Router {
    let state = MetricsState {
        metrics,
        proxy_mode: Arc::from(proxy_mode),
        configz: Arc::new(configz),
    };
    Router::new()
        .route("/metrics", any(self::metrics))
        .route("/healthz", any(self::healthz))
        .route("/healthz/ping", any(healthz_ping))
        .route("/proxyMode", any(self::proxy_mode))
        .route("/configz", any(self::configz))
        .with_state(state)
}

/// Serves [`metrics_router`] on `listener` until `shutdown` completes.
///
/// The routes are built before this returns, so the future borrows nothing and can be spawned.
pub fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    proxy_mode: &str,
    configz: serde_json::Value,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = Result<(), Error>> + Send + 'static {
    let router = metrics_router(metrics, proxy_mode, configz);
    crate::serve(listener, router, shutdown, "metrics")
}
