//! `/healthz` and `/livez`: JSON shape, status codes and headers, through the router and over a
//! real loopback socket.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{t, FakeClock, TIMEOUT};
use kp_core::model::{IpFamily, NodeInfo};
use kp_serve::{health_router, health_timeout, Error, ProxyHealth, SharedHealth};
use tower::ServiceExt;

const SYNC_PERIOD: Duration = Duration::from_secs(30);

fn shared(families: &[IpFamily], clock: &FakeClock) -> SharedHealth {
    let health = ProxyHealth::new(health_timeout(SYNC_PERIOD), families.iter().copied());
    SharedHealth::with_clock(health, clock.reader())
}

struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    nosniff: Option<String>,
    body: String,
}

async fn call(health: &SharedHealth, method: &str, path: &str) -> Answer {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .expect("request");
    let resp = health_router(health.clone())
        .oneshot(request)
        .await
        .expect("infallible");
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
async fn a_synced_proxy_answers_200_with_upstreams_json() {
    let clock = FakeClock::at(t(0));
    let health = shared(&[IpFamily::V4], &clock);
    health.updated();
    clock.set(t(10));

    let a = call(&health, "GET", "/healthz").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.content_type.as_deref(), Some("application/json"));
    assert_eq!(a.nosniff.as_deref(), Some("nosniff"));
    // Healthy answers report "now" as lastUpdated, as upstream does for compatibility; the
    // per-family status keeps the real time.
    assert_eq!(
        a.body,
        r#"{"lastUpdated":"2023-11-14T22:13:30Z","currentTime":"2023-11-14T22:13:30Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":true}}}"#
    );

    let l = call(&health, "GET", "/livez").await;
    assert_eq!(l.status, StatusCode::OK);
    assert_eq!(l.content_type.as_deref(), Some("application/json"));
    assert_eq!(l.nosniff.as_deref(), Some("nosniff"));
    assert_eq!(
        l.body,
        r#"{"lastUpdated":"2023-11-14T22:13:30Z","currentTime":"2023-11-14T22:13:30Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":true}}}"#,
        "/livez omits nodeEligible"
    );
}

#[tokio::test]
async fn before_the_first_sync_the_proxy_is_healthy_and_reports_no_families() {
    let clock = FakeClock::at(t(0));
    let health = shared(&[IpFamily::V4], &clock);
    health.queued_update();
    clock.set(t(3600));
    let a = call(&health, "GET", "/healthz").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.body,
        r#"{"lastUpdated":"2023-11-14T23:13:20Z","currentTime":"2023-11-14T23:13:20Z","nodeEligible":true,"healthy":true}"#
    );
}

#[tokio::test]
async fn a_change_queued_too_long_fails_both_probes() {
    let clock = FakeClock::at(t(0));
    let health = shared(&[IpFamily::V4], &clock);
    health.updated();
    clock.set(t(5));
    health.queued_update();
    clock.set(t(65));

    for path in ["/healthz", "/livez"] {
        let a = call(&health, "GET", path).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert_eq!(
            a.content_type.as_deref(),
            Some("application/json"),
            "{path}"
        );
        assert_eq!(a.nosniff.as_deref(), Some("nosniff"), "{path}");
        let json: serde_json::Value = serde_json::from_str(&a.body).expect("JSON");
        assert_eq!(json["healthy"], false, "{path}");
        // Unhealthy answers report the real last sync.
        assert_eq!(json["lastUpdated"], "2023-11-14T22:13:20Z", "{path}");
        assert_eq!(json["currentTime"], "2023-11-14T22:14:25Z", "{path}");
        assert_eq!(json["status"]["IPv4"]["healthy"], false, "{path}");
    }

    clock.set(t(66));
    health.updated();
    assert_eq!(
        call(&health, "GET", "/healthz").await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn an_ineligible_node_fails_healthz_but_not_livez() {
    let clock = FakeClock::at(t(0));
    let health = shared(&[IpFamily::V4], &clock);
    health.updated();
    health.set_node(&NodeInfo {
        name: "node-a".into(),
        exists: true,
        to_be_deleted: true,
        ..NodeInfo::default()
    });

    let a = call(&health, "GET", "/healthz").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    let json: serde_json::Value = serde_json::from_str(&a.body).expect("JSON");
    assert_eq!(json["nodeEligible"], false);
    assert_eq!(json["healthy"], true, "the proxy itself is fine");

    let l = call(&health, "GET", "/livez").await;
    assert_eq!(l.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_str(&l.body).expect("JSON");
    assert!(json.get("nodeEligible").is_none());
}

#[tokio::test]
async fn dual_stack_reports_each_family_and_fails_if_either_is_late() {
    let clock = FakeClock::at(t(0));
    let health = shared(&IpFamily::ALL, &clock);
    health.updated();
    health.queued_update_for(IpFamily::V6);
    clock.set(t(60));
    let a = call(&health, "GET", "/livez").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        a.body.ends_with(
            r#""status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":true},"IPv6":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":false}}}"#
        ),
        "{}",
        a.body
    );
}

#[tokio::test]
async fn any_method_is_answered_and_other_paths_are_404() {
    let clock = FakeClock::at(t(0));
    let health = shared(&[IpFamily::V4], &clock);
    assert_eq!(
        call(&health, "HEAD", "/healthz").await.status,
        StatusCode::OK
    );
    assert_eq!(call(&health, "POST", "/livez").await.status, StatusCode::OK);
    assert_eq!(
        call(&health, "GET", "/metrics").await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        call(&health, "GET", "/healthz/extra").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn serve_health_answers_on_loopback_and_stops_on_shutdown() {
    let clock = FakeClock::at(t(0));
    let health = shared(&[IpFamily::V4], &clock);
    let listener = kp_serve::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kp_serve::serve_health(listener, health.clone(), async {
        let _ = stopped.await;
    }));

    let reply = common::get(addr, "/healthz").await.expect("GET /healthz");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert!(
        reply.body.contains(r#""nodeEligible":true"#),
        "{}",
        reply.body
    );

    health.set_node(&NodeInfo {
        exists: false,
        ..NodeInfo::default()
    });
    assert_eq!(
        common::get(addr, "/healthz").await.expect("GET").status,
        503
    );
    assert_eq!(common::get(addr, "/livez").await.expect("GET").status, 200);

    stop.send(()).expect("server still running");
    let result = tokio::time::timeout(TIMEOUT, server)
        .await
        .expect("stops")
        .expect("no panic");
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test]
async fn a_taken_port_is_a_typed_bind_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    match kp_serve::bind(addr).await {
        Err(Error::Bind {
            addr: reported,
            source,
        }) => {
            assert_eq!(reported, addr);
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        other => panic!("expected a bind error, got {other:?}"),
    }
}
