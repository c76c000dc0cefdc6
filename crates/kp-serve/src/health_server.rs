//! The proxy health server (`--healthz-bind-address`, default `0.0.0.0:10256`): `/healthz` and
//! `/livez`, as upstream's `healthzHandler` and `livezHandler` in
//! `pkg/proxy/healthcheck/proxy_health.go`.

use std::collections::BTreeMap;
use std::future::Future;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::any;
use axum::Router;
use serde::Serialize;
use tokio::net::TcpListener;

use crate::health::{HealthStatus, SharedHealth};
use crate::{rfc3339, Error};

/// `X-Content-Type-Options`, which every upstream health handler sets.
pub(crate) const NOSNIFF: (header::HeaderName, HeaderValue) = (
    header::X_CONTENT_TYPE_OPTIONS,
    HeaderValue::from_static("nosniff"),
);

/// The JSON both handlers write: upstream's `ProxyHealth` struct, field for field and in the
/// same order, so `json.Marshal` and serde_json produce the same compact bytes.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct HealthBody {
    last_updated: String,
    current_time: String,
    /// Only `/healthz` reports it; upstream leaves the pointer nil for `/livez`.
    #[serde(skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    /// Keyed by upstream's family names (`IPv4` < `IPv6`, as Go sorts map keys).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    status: BTreeMap<&'static str, ProxierBody>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ProxierBody {
    last_updated: String,
    healthy: bool,
}

/// Which handler is answering.
#[derive(Clone, Copy)]
enum Probe {
    /// `/healthz`: proxy health and node eligibility.
    Healthz,
    /// `/livez`: proxy health only.
    Livez,
}

fn respond(status: &HealthStatus, probe: Probe) -> Response {
    let ok = match probe {
        Probe::Healthz => status.healthz_ok(),
        Probe::Livez => status.livez_ok(),
    };
    // Older releases reported the last sync-loop run as lastUpdated, even with nothing to do;
    // upstream keeps that meaning by reporting "now" whenever it answers 200.
    let last_updated = if ok {
        rfc3339::format(status.current_time)
    } else {
        rfc3339::format_or_zero(status.last_updated)
    };
    let body = HealthBody {
        last_updated,
        current_time: rfc3339::format(status.current_time),
        node_eligible: match probe {
            Probe::Healthz => Some(status.node_eligible),
            Probe::Livez => None,
        },
        healthy: status.healthy,
        status: status
            .families
            .iter()
            .map(|(family, health)| {
                let body = ProxierBody {
                    last_updated: rfc3339::format(health.last_updated),
                    healthy: health.healthy,
                };
                (family.as_str(), body)
            })
            .collect(),
    };
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(code, serde_json::to_vec(&body))
}

/// A JSON response with upstream's headers, or a 500 if the body could not be encoded.
pub(crate) fn json_response(code: StatusCode, body: serde_json::Result<Vec<u8>>) -> Response {
    match body {
        Ok(bytes) => {
            let mut resp = Response::new(Body::from(bytes));
            *resp.status_mut() = code;
            let headers = resp.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            headers.insert(NOSNIFF.0, NOSNIFF.1);
            resp
        }
        Err(e) => text_response(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

/// A `text/plain` response with `nosniff`, as Go writes plain-text answers.
pub(crate) fn text_response(code: StatusCode, body: impl Into<Body>) -> Response {
    let mut resp = Response::new(body.into());
    *resp.status_mut() = code;
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(NOSNIFF.0, NOSNIFF.1);
    resp
}

async fn healthz(State(health): State<SharedHealth>) -> Response {
    respond(&health.status(), Probe::Healthz)
}

async fn livez(State(health): State<SharedHealth>) -> Response {
    respond(&health.status(), Probe::Livez)
}

/// The health server's routes: `/healthz` and `/livez`, for any method (as Go's `ServeMux`
/// patterns match), each answering 200 or 503 with `application/json`. Other paths are 404.
pub fn health_router(health: SharedHealth) -> Router {
    Router::new()
        .route("/healthz", any(healthz))
        .route("/livez", any(livez))
        .with_state(health)
}

/// Serves [`health_router`] on `listener` until `shutdown` completes.
///
/// Bind the listener with [`bind`](crate::bind), so a taken port is reported as
/// [`Error::Bind`] before anything is served.
pub async fn serve_health(
    listener: TcpListener,
    health: SharedHealth,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    crate::serve(listener, health_router(health), shutdown, "healthz").await
}
