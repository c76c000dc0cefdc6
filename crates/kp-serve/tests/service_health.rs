//! Health check node ports over real loopback sockets: opened and closed as Services come and
//! go, answering 200/503 and the weight header as local endpoints change.

mod common;

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use common::{free_port, get, t, FakeClock};
use kp_core::model::{IpFamily, ServiceKey};
use kp_serve::{health_timeout, Error, ProxyHealth, ServiceHealthServer, SharedHealth};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn healthy_proxy() -> (SharedHealth, FakeClock) {
    let clock = FakeClock::at(t(0));
    let health = ProxyHealth::new(health_timeout(Duration::from_secs(30)), [IpFamily::V4]);
    let shared = SharedHealth::with_clock(health, clock.reader());
    shared.updated();
    (shared, clock)
}

fn key(name: &str) -> ServiceKey {
    ServiceKey::new("ns", name)
}

fn services<const N: usize>(entries: [(&str, u16); N]) -> HashMap<ServiceKey, u16> {
    entries
        .into_iter()
        .map(|(name, port)| (key(name), port))
        .collect()
}

fn endpoints<const N: usize>(entries: [(&str, usize); N]) -> HashMap<ServiceKey, usize> {
    entries
        .into_iter()
        .map(|(name, n)| (key(name), n))
        .collect()
}

fn addr_of(server: &ServiceHealthServer, name: &str) -> SocketAddr {
    let addrs = server
        .local_addrs(&key(name))
        .unwrap_or_else(|| panic!("{name} is not open"));
    assert_eq!(addrs.len(), 1);
    addrs[0]
}

async fn assert_closed(addr: SocketAddr) {
    match get(addr, "/").await {
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{addr}: {e}"),
        Ok(reply) => panic!("{addr} still answers: {reply:?}"),
    }
}

#[tokio::test]
async fn answers_503_then_200_with_the_weight_as_local_endpoints_change() {
    let (health, _clock) = healthy_proxy();
    let mut server = ServiceHealthServer::new([LOOPBACK], health);
    let failed = server.sync_services(services([("web", 0)])).await;
    assert!(failed.is_empty(), "{failed:?}");
    let addr = addr_of(&server, "web");

    let reply = get(addr, "/").await.expect("GET");
    assert_eq!(reply.status, 503, "no local endpoints yet");
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("0"));
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(reply.header("x-content-type-options"), Some("nosniff"));

    server.sync_endpoints(endpoints([("web", 3)]));
    let reply = get(addr, "/any/path?at=all").await.expect("GET");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("3"));
    assert_eq!(
        reply.body,
        "{\n\t\"service\": {\n\t\t\"namespace\": \"ns\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
    );

    // A Service missing from the endpoint map has no local endpoints.
    server.sync_endpoints(endpoints([("other", 5)]));
    let reply = get(addr, "/").await.expect("GET");
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("0"));
    let json: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON");
    assert_eq!(json["localEndpoints"], 0);
}

#[tokio::test]
async fn an_unhealthy_proxy_turns_traffic_away_even_with_local_endpoints() {
    let (health, clock) = healthy_proxy();
    let mut server = ServiceHealthServer::new([LOOPBACK], health.clone());
    server.sync_services(services([("web", 0)])).await;
    server.sync_endpoints(endpoints([("web", 1)]));
    let addr = addr_of(&server, "web");
    assert_eq!(get(addr, "/").await.expect("GET").status, 200);

    health.queued_update();
    clock.set(t(60));
    let reply = get(addr, "/").await.expect("GET");
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("1"));
    let json: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON");
    assert_eq!(json["serviceProxyHealthy"], false);
    assert_eq!(json["localEndpoints"], 1);
}

#[tokio::test]
async fn listeners_open_and_close_as_services_come_and_go() {
    let (health, _clock) = healthy_proxy();
    let mut server = ServiceHealthServer::new([LOOPBACK], health);
    server.sync_services(services([("a", 0), ("b", 0)])).await;
    server.sync_endpoints(endpoints([("a", 1), ("b", 2)]));
    let (a, b) = (addr_of(&server, "a"), addr_of(&server, "b"));
    assert_ne!(a, b);
    assert_eq!(
        get(a, "/")
            .await
            .expect("GET a")
            .header("x-load-balancing-endpoint-weight"),
        Some("1")
    );
    assert_eq!(
        get(b, "/")
            .await
            .expect("GET b")
            .header("x-load-balancing-endpoint-weight"),
        Some("2")
    );

    // "a" goes away; "b" stays open on the same socket and keeps its count.
    server.sync_services(services([("b", 0)])).await;
    assert!(server.local_addrs(&key("a")).is_none());
    assert_closed(a).await;
    assert_eq!(addr_of(&server, "b"), b);
    assert_eq!(get(b, "/").await.expect("GET b").status, 200);

    // Endpoints for a Service without a health check are ignored.
    server.sync_endpoints(endpoints([("a", 7), ("b", 2)]));
    assert!(server.local_addrs(&key("a")).is_none());

    server.sync_services(HashMap::new()).await;
    assert_closed(b).await;
}

#[tokio::test]
async fn a_changed_port_is_closed_and_reopened() {
    let (health, _clock) = healthy_proxy();
    let mut server = ServiceHealthServer::new([LOOPBACK], health);
    server.sync_services(services([("web", 0)])).await;
    let old = addr_of(&server, "web");

    let port = free_port();
    let failed = server.sync_services(services([("web", port)])).await;
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(addr_of(&server, "web"), SocketAddr::new(LOOPBACK, port));
    assert_closed(old).await;
    assert_eq!(
        get(SocketAddr::new(LOOPBACK, port), "/")
            .await
            .expect("GET")
            .status,
        503
    );
}

#[tokio::test]
async fn a_port_handed_to_another_service_in_one_sync_is_freed_first() {
    let (health, _clock) = healthy_proxy();
    let mut server = ServiceHealthServer::new([LOOPBACK], health);
    let port = free_port();
    assert!(server
        .sync_services(services([("old", port)]))
        .await
        .is_empty());

    let failed = server.sync_services(services([("new", port)])).await;
    assert!(
        failed.is_empty(),
        "the old listener must be gone before the new bind: {failed:?}"
    );
    server.sync_endpoints(endpoints([("new", 1)]));
    let reply = get(SocketAddr::new(LOOPBACK, port), "/")
        .await
        .expect("GET");
    assert_eq!(reply.status, 200);
    assert!(reply.body.contains("\"name\": \"new\""), "{}", reply.body);
}

#[tokio::test]
async fn a_port_that_fails_to_bind_is_reported_and_retried_on_the_next_sync() {
    let (health, _clock) = healthy_proxy();
    let mut server = ServiceHealthServer::new([LOOPBACK], health);
    let squatter = std::net::TcpListener::bind((LOOPBACK, 0)).expect("bind");
    let port = squatter.local_addr().expect("addr").port();

    let failed = server
        .sync_services(services([("web", port), ("api", 0)]))
        .await;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, key("web"));
    assert!(
        matches!(&failed[0].1, Error::Bind { addr, source }
            if addr.port() == port && source.kind() == ErrorKind::AddrInUse),
        "{:?}",
        failed[0].1
    );
    assert!(server.local_addrs(&key("web")).is_none());
    assert!(
        server.local_addrs(&key("api")).is_some(),
        "other Services still open"
    );

    drop(squatter);
    let failed = server
        .sync_services(services([("web", port), ("api", 0)]))
        .await;
    assert!(failed.is_empty(), "{failed:?}");
    server.sync_endpoints(endpoints([("web", 2)]));
    let reply = get(SocketAddr::new(LOOPBACK, port), "/healthz")
        .await
        .expect("GET");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("2"));
}

#[tokio::test]
async fn dropping_the_server_closes_its_listeners() {
    let (health, _clock) = healthy_proxy();
    let mut server = ServiceHealthServer::new([LOOPBACK], health);
    server.sync_services(services([("web", 0)])).await;
    let addr = addr_of(&server, "web");
    assert_eq!(get(addr, "/").await.expect("GET").status, 503);
    drop(server);
    // Abort is asynchronous: give the runtime a moment to drop the task.
    let deadline = tokio::time::Instant::now() + common::TIMEOUT;
    loop {
        match get(addr, "/").await {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => break,
            _ if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => panic!("{addr} still open after drop: {other:?}"),
        }
    }
}
