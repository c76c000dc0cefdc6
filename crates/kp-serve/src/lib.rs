//! The HTTP servers of kube-proxy-rs, on axum and tokio.
//!
//! - [`ProxyHealth`] / [`SharedHealth`]: whether the proxy keeps up with changes, per IP family,
//!   and whether its Node may take load-balancer traffic. Pure bookkeeping with the time passed
//!   in; mirrors `pkg/proxy/healthcheck/proxy_health.go` (formerly `proxier_health.go`).
//! - [`health_router`] / [`serve_health`]: `/healthz` and `/livez` on `--healthz-bind-address`
//!   (default `0.0.0.0:10256`), same JSON, status codes and headers as upstream's handlers.
//! - [`metrics_router`] / [`serve_metrics`]: `/metrics`, `/healthz`, `/proxyMode` and `/configz`
//!   on `--metrics-bind-address` (default `127.0.0.1:10249`), as `serveMetrics` in
//!   `cmd/kube-proxy/app/server.go`.
//! - [`ServiceHealthServer`]: one listener per `healthCheckNodePort` for
//!   `externalTrafficPolicy: Local` Services; mirrors `pkg/proxy/healthcheck/service_health.go`.
//!
//! Left to others: the metrics themselves (`kp-metrics`); calling
//! [`SharedHealth::queued_update`] / [`SharedHealth::updated`] and the two `sync_*` methods at
//! the right moments (the sync loop); computing which Services need a health check port and how
//! many local endpoints each has (`kp-core`); choosing addresses, redacting the configuration
//! handed to `/configz`, and deciding what a failed server means for the process (the binary).
//!
//! Deliberate differences from upstream: timestamps are always printed in UTC; the
//! `kubeproxy_healthz_total` / `kubeproxy_livez_total` counters are not kept (they belong in
//! `kp-metrics`); `/metrics` is OpenMetrics text, the format `prometheus-client` writes.

mod health;
mod health_server;
mod metrics_server;
pub mod rfc3339;
mod service_health;

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use axum::Router;
use tokio::net::TcpListener;

pub use health::{health_timeout, Clock, HealthStatus, ProxierHealth, ProxyHealth, SharedHealth};
pub use health_server::{health_router, serve_health};
pub use metrics_server::{metrics_router, serve_metrics, CONFIGZ_NAME, METRICS_CONTENT_TYPE};
pub use service_health::{
    ServiceHealthServer, DEFAULT_SERVICE_HEALTH_BIND_ADDRESS, ENDPOINT_WEIGHT_HEADER,
};

/// Upstream's default `healthzBindAddress`.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: &str = "0.0.0.0:10256";
/// Upstream's default `metricsBindAddress`.
pub const DEFAULT_METRICS_BIND_ADDRESS: &str = "127.0.0.1:10249";

/// Errors of the HTTP servers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A listening socket could not be opened: the port is taken, the address is not on this
    /// host, or binding is not permitted. Retryable: the port may be freed later (the
    /// [`ServiceHealthServer`] retries on its next sync; upstream retries its servers every 5 s).
    #[error("failed to listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A server stopped with an I/O error after it had started. Retryable with a new listener.
    #[error("{server} server failed: {source}")]
    Serve {
        /// Which server (`healthz`, `metrics`, `service healthcheck`).
        server: &'static str,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// Opens a listener on `addr`, turning a failure into [`Error::Bind`] with the address.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// Serves `router` on `listener` until `shutdown` completes, then lets open requests finish.
async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    server: &'static str,
) -> Result<(), Error> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, server, "serving HTTP");
    }
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| Error::Serve { server, source })
}
