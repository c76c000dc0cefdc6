//! Health check node ports for `externalTrafficPolicy: Local` Services, as upstream's
//! `pkg/proxy/healthcheck/service_health.go`.
//!
//! A cloud load balancer probes `healthCheckNodePort` on every node and sends traffic only to
//! nodes that answer 200, which are the nodes with a local endpoint for the Service.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Router;
use kp_core::model::ServiceKey;
use serde::Serialize;
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::health::SharedHealth;
use crate::health_server::json_response;
use crate::Error;

/// Header a load balancer may read as this node's weight: the number of local endpoints.
pub const ENDPOINT_WEIGHT_HEADER: HeaderName =
    HeaderName::from_static("x-load-balancing-endpoint-weight");

/// Upstream's default when `nodePortAddresses` selects every address. Unlike Go, Rust does not
/// turn `0.0.0.0` into a dual-stack socket: a node serving IPv6 should pass `::` instead,
/// which Linux makes dual-stack unless `net.ipv6.bindv6only` is set.
pub const DEFAULT_SERVICE_HEALTH_BIND_ADDRESS: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);

/// Opens, answers and closes one HTTP listener per `healthCheckNodePort` and address.
///
/// Each listener answers any method and path with 200 when the Service has local endpoints and
/// the proxy is healthy, otherwise 503, with header [`ENDPOINT_WEIGHT_HEADER`] and the body
/// `{"service":{"namespace":..,"name":..},"localEndpoints":n,"serviceProxyHealthy":bool}`
/// (tab-indented, byte for byte as upstream prints it).
///
/// Dropping the server closes every listener.
pub struct ServiceHealthServer {
    /// Where each health check port listens: upstream's node IPs.
    bind_addresses: Vec<IpAddr>,
    /// The proxy's own health, reported as `serviceProxyHealthy`.
    health: SharedHealth,
    /// Open health checks (upstream's `hcInstance`s).
    services: HashMap<ServiceKey, HcInstance>,
}

/// One Service's open health check.
struct HcInstance {
    /// The `healthCheckNodePort` asked for.
    port: u16,
    /// The addresses actually bound (differs from `port` only when asked for port 0).
    local_addrs: Vec<SocketAddr>,
    /// Local endpoints, read by the handlers; shared so updates need no restart.
    endpoints: Arc<AtomicUsize>,
    /// One serving task per address.
    tasks: Vec<JoinHandle<()>>,
}

impl HcInstance {
    /// Stops accepting and releases the ports before returning, so a port freed here can be
    /// bound again in the same sync. Connections already open keep going but report 0 local
    /// endpoints.
    async fn close(self, service: &ServiceKey) {
        self.endpoints.store(0, Ordering::Relaxed);
        for task in self.tasks {
            task.abort();
            // An aborted task's future, and with it the listener, is dropped before the
            // handle resolves.
            match task.await {
                Err(e) if e.is_panic() => error!(%service, "health check server panicked"),
                _ => {}
            }
        }
    }
}

impl std::fmt::Debug for ServiceHealthServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut open: Vec<_> = self.services.iter().map(|(k, i)| (k, i.port)).collect();
        open.sort();
        f.debug_struct("ServiceHealthServer")
            .field("bind_addresses", &self.bind_addresses)
            .field("services", &open)
            .finish_non_exhaustive()
    }
}

impl ServiceHealthServer {
    /// A server that will listen on each of `bind_addresses` (upstream: the node IPs selected by
    /// `nodePortAddresses`), or on [`DEFAULT_SERVICE_HEALTH_BIND_ADDRESS`] if there are none.
    pub fn new(bind_addresses: impl IntoIterator<Item = IpAddr>, health: SharedHealth) -> Self {
        let mut bind_addresses: Vec<IpAddr> = bind_addresses.into_iter().collect();
        if bind_addresses.is_empty() {
            bind_addresses.push(DEFAULT_SERVICE_HEALTH_BIND_ADDRESS);
        }
        ServiceHealthServer {
            bind_addresses,
            health,
            services: HashMap::new(),
        }
    }

    /// Makes `services` (Service → `healthCheckNodePort`) the open set: closes the health
    /// checks of Services that are gone or changed port, then opens the missing ones. Services
    /// already open on the same port are left alone.
    ///
    /// A port that cannot be bound is logged and returned with its error; the Service stays
    /// closed, and the next call tries again. Must be called within a tokio runtime.
    pub async fn sync_services(
        &mut self,
        services: HashMap<ServiceKey, u16>,
    ) -> Vec<(ServiceKey, Error)> {
        // Close first, so a port handed from one Service to another in the same sync is free.
        let stale: Vec<ServiceKey> = self
            .services
            .iter()
            .filter(|(key, hc)| services.get(*key) != Some(&hc.port))
            .map(|(key, _)| key.clone())
            .collect();
        for key in stale {
            if let Some(hc) = self.services.remove(&key) {
                info!(service = %key, port = hc.port, "closing healthcheck");
                hc.close(&key).await;
            }
        }

        let mut failed = Vec::new();
        for (key, port) in services {
            if self.services.contains_key(&key) {
                continue;
            }
            match self.open(&key, port).await {
                Ok(hc) => {
                    info!(service = %key, port, "opened healthcheck");
                    self.services.insert(key, hc);
                }
                Err(e) => {
                    error!(service = %key, port, error = %e, "failed to start healthcheck");
                    failed.push((key, e));
                }
            }
        }
        failed
    }

    /// Sets each open Service's local endpoint count; open Services missing from `endpoints`
    /// get 0, and entries for Services without an open health check are dropped.
    pub fn sync_endpoints(&mut self, endpoints: HashMap<ServiceKey, usize>) {
        for (key, hc) in &self.services {
            let count = endpoints.get(key).copied().unwrap_or(0);
            debug!(service = %key, count, "reporting endpoints for healthcheck");
            hc.endpoints.store(count, Ordering::Relaxed);
        }
    }

    /// Where `service`'s health check listens, if it is open. With port 0 this tells which
    /// port the kernel chose.
    pub fn local_addrs(&self, service: &ServiceKey) -> Option<&[SocketAddr]> {
        self.services
            .get(service)
            .map(|hc| hc.local_addrs.as_slice())
    }

    /// Binds every address, then starts serving; if any bind fails, closes the rest, as
    /// upstream does, so the retry starts clean.
    async fn open(&self, key: &ServiceKey, port: u16) -> Result<HcInstance, Error> {
        let endpoints = Arc::new(AtomicUsize::new(0));
        let state = HcState {
            service: Arc::new(key.clone()),
            endpoints: endpoints.clone(),
            health: self.health.clone(),
        };
        let router = Router::new().fallback(handle).with_state(state);

        let mut listeners = Vec::with_capacity(self.bind_addresses.len());
        for &ip in &self.bind_addresses {
            let addr = SocketAddr::new(ip, port);
            // Returning early drops, and so closes, the listeners already bound.
            let listener = crate::bind(addr).await?;
            let local_addr = listener
                .local_addr()
                .map_err(|source| Error::Bind { addr, source })?;
            listeners.push((local_addr, listener));
        }
        let mut hc = HcInstance {
            port,
            local_addrs: Vec::new(),
            endpoints,
            tasks: Vec::new(),
        };
        for (addr, listener) in listeners {
            hc.local_addrs.push(addr);
            let router = router.clone();
            let service = key.clone();
            hc.tasks.push(tokio::spawn(async move {
                let never = std::future::pending();
                if let Err(e) = crate::serve(listener, router, never, "service healthcheck").await {
                    warn!(%service, %addr, error = %e, "healthcheck server stopped");
                }
            }));
        }
        Ok(hc)
    }
}

impl Drop for ServiceHealthServer {
    fn drop(&mut self) {
        for hc in self.services.values() {
            for task in &hc.tasks {
                task.abort();
            }
        }
    }
}

/// What one health check's handler needs.
#[derive(Clone)]
struct HcState {
    service: Arc<ServiceKey>,
    endpoints: Arc<AtomicUsize>,
    health: SharedHealth,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct HcBody<'a> {
    service: ServiceRef<'a>,
    local_endpoints: usize,
    service_proxy_healthy: bool,
}

#[derive(Serialize)]
struct ServiceRef<'a> {
    namespace: &'a str,
    name: &'a str,
}

/// Upstream prints the body from a dedented, tab-indented template; serde_json's pretty
/// printer with a tab indent writes the same bytes.
fn tab_indented(value: &impl Serialize) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"\t");
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    value.serialize(&mut serializer)?;
    Ok(out)
}

async fn handle(State(state): State<HcState>) -> Response {
    let count = state.endpoints.load(Ordering::Relaxed);
    let proxy_healthy = state.health.status().healthy;
    let body = HcBody {
        service: ServiceRef {
            namespace: &state.service.namespace,
            name: &state.service.name,
        },
        local_endpoints: count,
        service_proxy_healthy: proxy_healthy,
    };
    // Upstream also turns the node away while the proxy itself is unhealthy: its rules
    // may be stale, so the local endpoints it counts may not be reachable.
    let code = if count != 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut resp = json_response(code, tab_indented(&body));
    resp.headers_mut()
        .insert(ENDPOINT_WEIGHT_HEADER, HeaderValue::from(count));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_byte_for_byte_upstreams() {
        let body = HcBody {
            service: ServiceRef {
                namespace: "ns",
                name: "web",
            },
            local_endpoints: 2,
            service_proxy_healthy: true,
        };
        let text = String::from_utf8(tab_indented(&body).expect("encode")).expect("utf-8");
        assert_eq!(
            text,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
    }
}
