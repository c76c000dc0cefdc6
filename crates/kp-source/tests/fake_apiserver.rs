//! The Kubernetes source against a fake API server: axum on 127.0.0.1:0, speaking just enough
//! of the list and watch protocol, scripted by each test.
//!
//! The server records every request and hands every watch connection to the test, which writes
//! watch events into it or drops it. Every wait is bounded by a timeout, so a request the
//! client never makes, or an event it never reports, fails the test instead of hanging it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::http::{header, StatusCode};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use kp_core::track::{Kind, Object, SourceEvent};
use kp_metrics::Metrics;
use kp_source::{run_kubernetes_with, RetryPolicy};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::timeout;

/// Fast retries, so that outages and relists take milliseconds rather than kube-runtime's
/// production backoff of seconds.
const FAST_RETRY: RetryPolicy = RetryPolicy::Exponential {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(100),
    recheck: RECHECK,
};

/// How often an unserved ServiceCIDR API is asked for again: 5 minutes in production. Longer
/// than `FAST_RETRY`'s longest delay, so that a retry loop would show as more requests.
const RECHECK: Duration = Duration::from_millis(250);

/// Longest wait for any one request or event.
const DEADLINE: Duration = Duration::from_secs(5);

const NODE_NAME: &str = "node-1";

/// The four collections the source watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Res {
    Services,
    EndpointSlices,
    Nodes,
    ServiceCidrs,
}

impl Res {
    const ALL: [Res; 4] = [
        Res::Services,
        Res::EndpointSlices,
        Res::Nodes,
        Res::ServiceCidrs,
    ];

    fn path(self) -> &'static str {
        match self {
            Res::Services => "/api/v1/services",
            Res::EndpointSlices => "/apis/discovery.k8s.io/v1/endpointslices",
            Res::Nodes => "/api/v1/nodes",
            Res::ServiceCidrs => "/apis/networking.k8s.io/v1/servicecidrs",
        }
    }

    fn list_type(self) -> (&'static str, &'static str) {
        match self {
            Res::Services => ("v1", "ServiceList"),
            Res::EndpointSlices => ("discovery.k8s.io/v1", "EndpointSliceList"),
            Res::Nodes => ("v1", "NodeList"),
            Res::ServiceCidrs => ("networking.k8s.io/v1", "ServiceCIDRList"),
        }
    }
}

/// A request the server answered.
#[derive(Clone, Debug)]
struct Request {
    res: Res,
    watch: bool,
    query: HashMap<String, String>,
    status: u16,
}

/// An open watch response; dropping it ends the response, as a server closing the watch does.
struct WatchConn {
    query: HashMap<String, String>,
    lines: mpsc::UnboundedSender<Bytes>,
}

impl WatchConn {
    fn send(&self, kind: &str, object: Value) {
        let mut line = json!({ "type": kind, "object": object }).to_string();
        line.push('\n');
        self.lines
            .send(Bytes::from(line))
            .expect("watch connection closed by the client");
    }
}

/// What the server answers for one collection.
struct Collection {
    items: Vec<Value>,
    resource_version: String,
    /// Fail every list with this status.
    fail_list: Option<u16>,
    /// Fail every watch with this status.
    fail_watch: Option<u16>,
    watches: mpsc::UnboundedSender<WatchConn>,
}

struct Shared {
    collections: HashMap<Res, Mutex<Collection>>,
    requests: mpsc::UnboundedSender<Request>,
}

impl Shared {
    fn collection(&self, res: Res) -> MutexGuard<'_, Collection> {
        self.collections[&res].lock().expect("collection lock")
    }
}

struct FakeApiServer {
    url: String,
    shared: Arc<Shared>,
    requests: mpsc::UnboundedReceiver<Request>,
    watches: HashMap<Res, mpsc::UnboundedReceiver<WatchConn>>,
    /// Every request seen so far, in order.
    seen: Vec<Request>,
    /// Whether `request` has returned the request at the same index of `seen`.
    returned: Vec<bool>,
}

/// A failure Status as the API server sends it, with the reason it gives for `code`.
fn status_body(code: u16) -> Value {
    let reason = match code {
        403 => "Forbidden",
        404 => "NotFound",
        410 => "Expired",
        500 => "InternalError",
        _ => "ServiceUnavailable",
    };
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": format!("fake {reason}"), "reason": reason, "code": code,
    })
}

async fn handle(shared: Arc<Shared>, res: Res, query: HashMap<String, String>) -> Response {
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let mut record = Request {
        res,
        watch,
        query: query.clone(),
        status: 200,
    };
    let response = {
        let col = shared.collection(res);
        let failure = if watch { col.fail_watch } else { col.fail_list };
        if let Some(code) = failure {
            record.status = code;
            json_response(code, &status_body(code))
        } else if watch {
            let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
            // If the test has stopped taking watches the connection just stays open.
            let _ = col.watches.send(WatchConn { query, lines: tx });
            let body = futures::stream::poll_fn(move |cx| {
                rx.poll_recv(cx).map(|b| b.map(Ok::<_, Infallible>))
            });
            Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from_stream(body))
                .expect("watch response")
        } else {
            let (api_version, kind) = res.list_type();
            json_response(
                200,
                &json!({
                    "apiVersion": api_version, "kind": kind,
                    "metadata": { "resourceVersion": col.resource_version },
                    "items": col.items,
                }),
            )
        }
    };
    let _ = shared.requests.send(record);
    response
}

fn json_response(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("json response")
}

impl FakeApiServer {
    /// Starts a server whose collections hold `initial` (items and resourceVersion); those it
    /// does not name are empty, at resourceVersion 1.
    async fn start(initial: Vec<(Res, Vec<Value>, &str)>) -> Self {
        let (requests_tx, requests) = mpsc::unbounded_channel();
        let mut collections = HashMap::new();
        let mut watches = HashMap::new();
        let mut initial = initial;
        for res in Res::ALL {
            if !initial.iter().any(|(r, _, _)| *r == res) {
                initial.push((res, Vec::new(), "1"));
            }
        }
        for (res, items, rv) in initial {
            let (tx, rx) = mpsc::unbounded_channel();
            collections.insert(
                res,
                Mutex::new(Collection {
                    items,
                    resource_version: rv.to_string(),
                    fail_list: None,
                    fail_watch: None,
                    watches: tx,
                }),
            );
            watches.insert(res, rx);
        }
        let shared = Arc::new(Shared {
            collections,
            requests: requests_tx,
        });
        let mut router = Router::new();
        for res in Res::ALL {
            let shared = shared.clone();
            router = router.route(
                res.path(),
                get(move |Query(query): Query<HashMap<String, String>>| {
                    handle(shared.clone(), res, query)
                }),
            );
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        tokio::spawn(async move {
            axum::serve(listener, router).await.expect("serve");
        });
        FakeApiServer {
            url: format!("http://{addr}"),
            shared,
            requests,
            watches,
            seen: Vec::new(),
            returned: Vec::new(),
        }
    }

    fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url.parse().expect("url"));
        kube::Client::try_from(config).expect("client")
    }

    /// Returns the first request matching `pred` that no earlier call returned, waiting for it
    /// if it has not arrived yet.
    async fn request(&mut self, what: &str, pred: impl Fn(&Request) -> bool) -> Request {
        if let Some(i) = (0..self.seen.len()).find(|&i| !self.returned[i] && pred(&self.seen[i])) {
            self.returned[i] = true;
            return self.seen[i].clone();
        }
        let wait = async {
            loop {
                let req = self.requests.recv().await.expect("server stopped");
                let matched = pred(&req);
                self.seen.push(req.clone());
                self.returned.push(matched);
                if matched {
                    return req;
                }
            }
        };
        match timeout(DEADLINE, wait).await {
            Ok(req) => req,
            Err(_) => panic!(
                "no request within {DEADLINE:?}: expected {what}; seen {:#?}",
                self.seen
            ),
        }
    }

    /// Waits for the client's next watch of `res`.
    async fn watch(&mut self, res: Res) -> WatchConn {
        let rx = self.watches.get_mut(&res).expect("collection");
        match timeout(DEADLINE, rx.recv()).await {
            Ok(Some(conn)) => conn,
            Ok(None) => panic!("server stopped"),
            Err(_) => panic!("no watch of {res:?} within {DEADLINE:?}"),
        }
    }

    fn set_list(&self, res: Res, items: Vec<Value>, rv: &str) {
        let mut col = self.shared.collection(res);
        col.items = items;
        col.resource_version = rv.to_string();
    }

    fn fail_list(&self, res: Res, code: Option<u16>) {
        self.shared.collection(res).fail_list = code;
    }

    fn fail_watch(&self, res: Res, code: Option<u16>) {
        self.shared.collection(res).fail_watch = code;
    }

    /// Refuses lists and watches of `res` with `code` (`None`: serves them again): 404 as an
    /// API server that does not serve it, 403 as one whose RBAC denies it.
    fn refuse(&self, res: Res, code: Option<u16>) {
        self.fail_list(res, code);
        self.fail_watch(res, code);
    }
}

fn service(name: &str, rv: &str, port: u16) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name, "namespace": "ns", "resourceVersion": rv },
        "spec": { "clusterIP": "10.96.0.10", "ports": [{ "port": port, "protocol": "TCP" }] },
    })
}

fn slice(name: &str, rv: &str) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": name, "namespace": "ns", "resourceVersion": rv,
            "labels": { "kubernetes.io/service-name": "a" },
        },
        "addressType": "IPv4",
        "endpoints": [{ "addresses": ["10.0.0.1"] }],
    })
}

fn node(rv: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": NODE_NAME, "resourceVersion": rv },
    })
}

fn service_cidr(name: &str, rv: &str, cidrs: &[&str]) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": { "name": name, "resourceVersion": rv },
        "spec": { "cidrs": cidrs },
    })
}

fn bookmark(rv: &str) -> Value {
    json!({ "kind": "Service", "apiVersion": "v1", "metadata": { "resourceVersion": rv } })
}

fn show(ev: &SourceEvent) -> String {
    match ev {
        SourceEvent::Upsert(obj) => format!("upsert {} {}", obj.kind(), obj.key()),
        SourceEvent::Delete(kind, key) => format!("delete {kind} {key}"),
        SourceEvent::Synced(kind) => format!("synced {kind}"),
    }
}

async fn next(rx: &mut mpsc::Receiver<SourceEvent>, waiting_for: &str) -> SourceEvent {
    match timeout(DEADLINE, rx.recv()).await {
        Ok(Some(ev)) => ev,
        Ok(None) => panic!("source stopped while waiting for {waiting_for}"),
        Err(_) => panic!("no event within {DEADLINE:?} while waiting for {waiting_for}"),
    }
}

/// Every kind the source reports.
const KINDS: [Kind; 4] = [
    Kind::Service,
    Kind::EndpointSlice,
    Kind::Node,
    Kind::ServiceCidr,
];

/// Receives events until every kind has reported `Synced`, returning them grouped by kind in
/// the order received.
async fn initial_sync(rx: &mut mpsc::Receiver<SourceEvent>) -> HashMap<Kind, Vec<String>> {
    sync_of(rx, &KINDS).await
}

/// Receives events until each of `kinds` has reported `Synced`, returning them grouped by kind
/// in the order received.
async fn sync_of(
    rx: &mut mpsc::Receiver<SourceEvent>,
    kinds: &[Kind],
) -> HashMap<Kind, Vec<String>> {
    let mut by_kind: HashMap<Kind, Vec<String>> = HashMap::new();
    let mut synced = std::collections::HashSet::new();
    while !kinds.iter().all(|k| synced.contains(k)) {
        let ev = next(rx, "the initial sync").await;
        let kind = match &ev {
            SourceEvent::Upsert(obj) => obj.kind(),
            SourceEvent::Delete(kind, _) => *kind,
            SourceEvent::Synced(kind) => {
                synced.insert(*kind);
                *kind
            }
        };
        by_kind.entry(kind).or_default().push(show(&ev));
    }
    by_kind
}

fn source_errors(metrics: &Metrics, reason: &str) -> u64 {
    let prefix =
        format!("kubeproxy_rs_source_errors_total{{source=\"kubernetes\",reason=\"{reason}\"}} ");
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

/// Every source error counted so far, whatever its reason.
fn all_source_errors(metrics: &Metrics) -> u64 {
    metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("kubeproxy_rs_source_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next().and_then(|n| n.parse::<u64>().ok()))
        .sum()
}

/// Starts a server with one slice and this node, services as given, and the source against it.
async fn start(services: Vec<Value>) -> (FakeApiServer, mpsc::Receiver<SourceEvent>, Arc<Metrics>) {
    let server = FakeApiServer::start(vec![
        (Res::Services, services, "10"),
        (Res::EndpointSlices, vec![slice("a-1", "3")], "10"),
        (Res::Nodes, vec![node("4")], "10"),
        (Res::ServiceCidrs, vec![], "10"),
    ])
    .await;
    let (rx, metrics) = run_source(&server);
    (server, rx, metrics)
}

/// Starts the source against `server`.
fn run_source(server: &FakeApiServer) -> (mpsc::Receiver<SourceEvent>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(run_kubernetes_with(
        server.client(),
        NODE_NAME.to_string(),
        tx,
        metrics.clone(),
        FAST_RETRY,
    ));
    (rx, metrics)
}

#[tokio::test]
async fn the_initial_list_is_reported_with_upstreams_selectors_then_synced() {
    let (mut server, mut rx, _) = start(vec![service("a", "1", 80), service("b", "2", 81)]).await;
    let by_kind = initial_sync(&mut rx).await;
    assert_eq!(
        by_kind[&Kind::Service],
        [
            "upsert Service ns/a",
            "upsert Service ns/b",
            "synced Service"
        ]
    );
    assert_eq!(
        by_kind[&Kind::EndpointSlice],
        ["upsert EndpointSlice ns/a-1", "synced EndpointSlice"]
    );
    assert_eq!(by_kind[&Kind::Node], ["upsert Node node-1", "synced Node"]);
    assert_eq!(by_kind[&Kind::ServiceCidr], ["synced ServiceCIDR"]);

    let svc_list = server
        .request("a Service list", |r| r.res == Res::Services && !r.watch)
        .await;
    assert_eq!(
        svc_list.query.get("labelSelector").map(String::as_str),
        Some("!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless")
    );
    let slice_list = server
        .request("a slice list", |r| r.res == Res::EndpointSlices && !r.watch)
        .await;
    assert_eq!(
        slice_list.query.get("labelSelector").map(String::as_str),
        Some("!service.kubernetes.io/service-proxy-name")
    );
    let node_list = server
        .request("a Node list", |r| r.res == Res::Nodes && !r.watch)
        .await;
    assert_eq!(
        node_list.query.get("fieldSelector").map(String::as_str),
        Some("metadata.name=node-1")
    );
    // ServiceCIDRs are all listed, as upstream's informer does.
    let cidr_list = server
        .request("a ServiceCIDR list", |r| {
            r.res == Res::ServiceCidrs && !r.watch
        })
        .await;
    assert!(
        !cidr_list.query.contains_key("labelSelector")
            && !cidr_list.query.contains_key("fieldSelector"),
        "{cidr_list:?}"
    );
    // Every first list asks the API server's watch cache, as client-go's informers do:
    // `resourceVersion=0`, unpaged (kube-apiserver ignores a limit there, and kube's client
    // would drop the version if one were given).
    for list in [&svc_list, &slice_list, &node_list, &cidr_list] {
        assert_eq!(
            list.query.get("resourceVersion").map(String::as_str),
            Some("0"),
            "{:?}",
            list.res
        );
        assert!(!list.query.contains_key("limit"), "{list:?}");
    }

    // Each watch starts from its list's resourceVersion, with bookmarks.
    for res in Res::ALL {
        let conn = server.watch(res).await;
        assert_eq!(
            conn.query.get("resourceVersion").map(String::as_str),
            Some("10"),
            "{res:?}"
        );
        assert_eq!(
            conn.query.get("allowWatchBookmarks").map(String::as_str),
            Some("true"),
            "{res:?}"
        );
    }
}

#[tokio::test]
async fn watch_events_are_reported_and_a_dropped_watch_resumes_from_the_last_bookmark() {
    let (mut server, mut rx, _) = start(vec![service("a", "1", 80)]).await;
    initial_sync(&mut rx).await;
    let conn = server.watch(Res::Services).await;

    conn.send("ADDED", service("b", "11", 81));
    conn.send("MODIFIED", service("a", "12", 8080));
    conn.send("DELETED", service("b", "13", 81));
    conn.send("BOOKMARK", bookmark("20"));
    assert_eq!(show(&next(&mut rx, "b added").await), "upsert Service ns/b");
    let ev = next(&mut rx, "a modified").await;
    let SourceEvent::Upsert(Object::Service(svc)) = &ev else {
        panic!("got {}", show(&ev))
    };
    assert_eq!(
        svc.spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .expect("ports")[0]
            .port,
        8080
    );
    assert_eq!(
        show(&next(&mut rx, "b deleted").await),
        "delete Service ns/b"
    );

    // The server drops the watch: the client watches again from the bookmark, without a list.
    drop(conn);
    let conn = server.watch(Res::Services).await;
    assert_eq!(
        conn.query.get("resourceVersion").map(String::as_str),
        Some("20")
    );
    conn.send("ADDED", service("c", "21", 82));
    assert_eq!(show(&next(&mut rx, "c added").await), "upsert Service ns/c");
    server
        .request("the first watch", |r| r.res == Res::Services && r.watch)
        .await;
    server
        .request("the second watch", |r| r.res == Res::Services && r.watch)
        .await;
    let lists = server
        .seen
        .iter()
        .filter(|r| r.res == Res::Services && !r.watch)
        .count();
    assert_eq!(lists, 1, "a dropped watch must not cause a relist");
}

#[tokio::test]
async fn an_expired_watch_relists_and_deletes_what_vanished() {
    let (mut server, mut rx, metrics) =
        start(vec![service("a", "1", 80), service("b", "2", 81)]).await;
    initial_sync(&mut rx).await;
    let conn = server.watch(Res::Services).await;

    // Meanwhile b was deleted and c created, and the watch window has moved on.
    server.set_list(
        Res::Services,
        vec![service("a", "1", 80), service("c", "25", 82)],
        "30",
    );
    conn.send(
        "ERROR",
        json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "too old resource version: 10 (25)", "reason": "Expired", "code": 410 }),
    );
    // Unchanged a is not reported again; c is new; b is gone; the kind is synced again.
    let got: Vec<String> = [
        next(&mut rx, "c").await,
        next(&mut rx, "b's deletion").await,
        next(&mut rx, "Synced").await,
    ]
    .iter()
    .map(show)
    .collect();
    assert_eq!(
        got,
        [
            "upsert Service ns/c",
            "delete Service ns/b",
            "synced Service"
        ]
    );

    let conn = server.watch(Res::Services).await;
    assert_eq!(
        conn.query.get("resourceVersion").map(String::as_str),
        Some("30")
    );
    assert_eq!(source_errors(&metrics, "relist"), 1);
    server
        .request("the initial list", |r| r.res == Res::Services && !r.watch)
        .await;
    let relist = server
        .request("the relist", |r| r.res == Res::Services && !r.watch)
        .await;
    // After a 410 the watch cache may be behind what was seen: a quorum read, paged.
    assert!(!relist.query.contains_key("resourceVersion"), "{relist:?}");
    assert_eq!(
        relist.query.get("limit").map(String::as_str),
        Some(kp_source::kubernetes::LIST_PAGE_SIZE.to_string().as_str())
    );
}

#[tokio::test]
async fn an_outage_deletes_nothing_until_a_relist_completes() {
    let (mut server, mut rx, metrics) =
        start(vec![service("a", "1", 80), service("b", "2", 81)]).await;
    initial_sync(&mut rx).await;
    let conn = server.watch(Res::Services).await;

    // The API server goes away: the watch drops and every new one fails, first with 503 (which
    // kube's client retries by itself), then with 500 (which reaches the watcher).
    server.fail_watch(Res::Services, Some(503));
    drop(conn);
    for i in 1..=3 {
        server
            .request(&format!("503 watch {i}"), |r| {
                r.res == Res::Services && r.watch && r.status == 503
            })
            .await;
    }
    server.fail_watch(Res::Services, Some(500));
    for i in 1..=3 {
        server
            .request(&format!("500 watch {i}"), |r| {
                r.res == Res::Services && r.watch && r.status == 500
            })
            .await;
    }

    // It comes back having lost our resourceVersion, and lists fail for a while.
    server.fail_list(Res::Services, Some(500));
    server.fail_watch(Res::Services, None);
    let conn = server.watch(Res::Services).await;
    conn.send(
        "ERROR",
        json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "too old resource version", "reason": "Expired", "code": 410 }),
    );
    for i in 1..=3 {
        server
            .request(&format!("failed list {i}"), |r| {
                r.res == Res::Services && !r.watch && r.status == 500
            })
            .await;
    }
    if let Ok(ev) = rx.try_recv() {
        panic!("reported {} during the outage", show(&ev));
    }
    // Each failure the watcher saw is counted (the last one of each may still be in flight).
    assert!(
        source_errors(&metrics, "watch") >= 2,
        "{}",
        metrics.encode()
    );
    assert!(source_errors(&metrics, "list") >= 2, "{}", metrics.encode());
    assert_eq!(source_errors(&metrics, "relist"), 1);

    // The list works again and no longer holds b: only now is b deleted.
    server.set_list(Res::Services, vec![service("a", "1", 80)], "40");
    server.fail_list(Res::Services, None);
    assert_eq!(
        show(&next(&mut rx, "b's deletion").await),
        "delete Service ns/b"
    );
    assert_eq!(show(&next(&mut rx, "Synced").await), "synced Service");
    let conn = server.watch(Res::Services).await;
    assert_eq!(
        conn.query.get("resourceVersion").map(String::as_str),
        Some("40")
    );
}

#[tokio::test]
async fn the_source_stops_when_the_receiver_is_dropped() {
    let server = FakeApiServer::start(vec![]).await;
    let (tx, mut rx) = mpsc::channel(8);
    let source = tokio::spawn(run_kubernetes_with(
        server.client(),
        NODE_NAME.to_string(),
        tx,
        Arc::new(Metrics::new()),
        FAST_RETRY,
    ));
    initial_sync(&mut rx).await;
    drop(rx);
    timeout(DEADLINE, source)
        .await
        .expect("source did not stop")
        .expect("source panicked");
}

/// A kubeconfig whose only cluster is at `server`.
fn kubeconfig(server: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: ctx\n\
         clusters:\n- name: c\n  cluster:\n    server: {server}\n\
         contexts:\n- name: ctx\n  context: {{cluster: c, user: u}}\n\
         users:\n- name: u\n  user: {{}}\n"
    )
}

#[tokio::test]
async fn master_overrides_the_kubeconfig_server() {
    let mut server =
        FakeApiServer::start(vec![(Res::Services, vec![service("a", "1", 80)], "1")]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kubeconfig");
    // Port 9 (discard) on loopback: nothing answers there, so only --master can work.
    std::fs::write(&path, kubeconfig("http://127.0.0.1:9")).expect("write kubeconfig");

    let client = kp_source::client_from(Some(&path), Some(&server.url))
        .await
        .expect("client");
    let (tx, mut rx) = mpsc::channel(8);
    tokio::spawn(run_kubernetes_with(
        client,
        NODE_NAME.to_string(),
        tx,
        Arc::new(Metrics::new()),
        FAST_RETRY,
    ));
    let by_kind = initial_sync(&mut rx).await;
    assert_eq!(
        by_kind[&Kind::Service],
        ["upsert Service ns/a", "synced Service"]
    );
    server
        .request("a Service list", |r| r.res == Res::Services && !r.watch)
        .await;
}

#[tokio::test]
async fn bad_client_flags_are_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing");
    let Err(err) = kp_source::client_from(Some(&missing), None).await else {
        panic!("a missing kubeconfig must fail");
    };
    assert!(
        matches!(err, kp_source::SourceError::Kubeconfig(_)),
        "{err}"
    );

    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, kubeconfig("http://127.0.0.1:9")).expect("write kubeconfig");
    let Err(err) = kp_source::client_from(Some(&path), Some("http://[::1")).await else {
        panic!("a bad --master must fail");
    };
    assert!(
        matches!(err, kp_source::SourceError::InvalidMaster { .. }),
        "{err}"
    );
}

#[tokio::test]
async fn service_cidrs_are_reported_and_followed_through_dropped_watches_and_410s() {
    let server = FakeApiServer::start(vec![(
        Res::ServiceCidrs,
        vec![service_cidr("kubernetes", "1", &["10.96.0.0/16"])],
        "10",
    )])
    .await;
    let (mut rx, metrics) = run_source(&server);
    let mut server = server;
    let by_kind = initial_sync(&mut rx).await;
    assert_eq!(
        by_kind[&Kind::ServiceCidr],
        ["upsert ServiceCIDR kubernetes", "synced ServiceCIDR"]
    );

    // A created ServiceCIDR, then its deletion, as watch events.
    let conn = server.watch(Res::ServiceCidrs).await;
    assert_eq!(
        conn.query.get("resourceVersion").map(String::as_str),
        Some("10")
    );
    conn.send("ADDED", service_cidr("extra", "11", &["10.97.0.0/16"]));
    let ev = next(&mut rx, "extra added").await;
    let SourceEvent::Upsert(Object::ServiceCidr(cidr)) = &ev else {
        panic!("got {}", show(&ev))
    };
    assert_eq!(
        cidr.spec.as_ref().and_then(|s| s.cidrs.as_deref()),
        Some(&["10.97.0.0/16".to_string()][..])
    );
    conn.send("DELETED", service_cidr("extra", "12", &["10.97.0.0/16"]));
    assert_eq!(
        show(&next(&mut rx, "extra deleted").await),
        "delete ServiceCIDR extra"
    );

    // The server drops the watch after a bookmark: the client watches again from it, without
    // a list (which would have said resourceVersion 10).
    conn.send(
        "BOOKMARK",
        json!({ "kind": "ServiceCIDR", "apiVersion": "networking.k8s.io/v1",
                "metadata": { "resourceVersion": "20" } }),
    );
    drop(conn);
    let conn = server.watch(Res::ServiceCidrs).await;
    assert_eq!(
        conn.query.get("resourceVersion").map(String::as_str),
        Some("20")
    );

    // 410: kubernetes was replaced by second meanwhile; the relist says so, then Synced.
    server.set_list(
        Res::ServiceCidrs,
        vec![service_cidr("second", "25", &["10.96.0.0/15"])],
        "30",
    );
    conn.send(
        "ERROR",
        json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "too old resource version: 20 (25)", "reason": "Expired", "code": 410 }),
    );
    let got: Vec<String> = [
        next(&mut rx, "second").await,
        next(&mut rx, "kubernetes's deletion").await,
        next(&mut rx, "Synced").await,
    ]
    .iter()
    .map(show)
    .collect();
    assert_eq!(
        got,
        [
            "upsert ServiceCIDR second",
            "delete ServiceCIDR kubernetes",
            "synced ServiceCIDR"
        ]
    );
    let conn = server.watch(Res::ServiceCidrs).await;
    assert_eq!(
        conn.query.get("resourceVersion").map(String::as_str),
        Some("30")
    );
    assert_eq!(source_errors(&metrics, "relist"), 1);
    assert_eq!(all_source_errors(&metrics), 1, "{}", metrics.encode());
    server
        .request("the initial list", |r| {
            r.res == Res::ServiceCidrs && !r.watch
        })
        .await;
    server
        .request("the relist", |r| r.res == Res::ServiceCidrs && !r.watch)
        .await;
}

/// An API server that does not serve ServiceCIDRs (404, as 1.28 answers) or a role that may
/// not list them (403, as 1.28 answers kube-proxy's stock role): everything else syncs,
/// `Synced(ServiceCIDR)` is sent, and the source asks again now and then, quietly: no error
/// counted, no retry loop. Once served, ServiceCIDRs are listed and watched.
async fn an_unavailable_service_cidr_api_is_asked_for_again_quietly(code: u16) {
    let server = FakeApiServer::start(vec![
        (Res::Services, vec![service("a", "1", 80)], "10"),
        (Res::EndpointSlices, vec![slice("a-1", "3")], "10"),
        (Res::Nodes, vec![node("4")], "10"),
    ])
    .await;
    server.refuse(Res::ServiceCidrs, Some(code));
    let (mut rx, metrics) = run_source(&server);
    let mut server = server;
    let by_kind = initial_sync(&mut rx).await;
    assert_eq!(
        by_kind[&Kind::Service],
        ["upsert Service ns/a", "synced Service"]
    );
    assert_eq!(
        by_kind[&Kind::EndpointSlice],
        ["upsert EndpointSlice ns/a-1", "synced EndpointSlice"]
    );
    assert_eq!(by_kind[&Kind::Node], ["upsert Node node-1", "synced Node"]);
    assert_eq!(by_kind[&Kind::ServiceCidr], ["synced ServiceCIDR"]);

    // The watcher's list was refused once; then a list of one object, every `RECHECK`.
    let first = server
        .request("the refused list", |r| {
            r.res == Res::ServiceCidrs && r.status == code
        })
        .await;
    assert!(!first.watch);
    for i in 1..=3 {
        let again = server
            .request(&format!("recheck {i}"), |r| {
                r.res == Res::ServiceCidrs && r.status == code
            })
            .await;
        assert!(!again.watch, "{again:?}");
        assert_eq!(again.query.get("limit").map(String::as_str), Some("1"));
    }
    // Three rechecks, not a retry loop: with `FAST_RETRY`, one would have made dozens of
    // requests by now (the rest being idle watches of the other kinds).
    let cidr_requests = server
        .seen
        .iter()
        .filter(|r| r.res == Res::ServiceCidrs)
        .count();
    assert_eq!(cidr_requests, 4, "{:#?}", server.seen);
    assert_eq!(all_source_errors(&metrics), 0, "{}", metrics.encode());
    if let Ok(ev) = rx.try_recv() {
        panic!("reported {} while the API was unavailable", show(&ev));
    }

    // The cluster is upgraded (or the role fixed): the next recheck hands over to the watcher.
    server.set_list(
        Res::ServiceCidrs,
        vec![service_cidr("kubernetes", "15", &["10.96.0.0/16"])],
        "20",
    );
    server.refuse(Res::ServiceCidrs, None);
    assert_eq!(
        show(&next(&mut rx, "the ServiceCIDR once served").await),
        "upsert ServiceCIDR kubernetes"
    );
    assert_eq!(
        show(&next(&mut rx, "Synced once served").await),
        "synced ServiceCIDR"
    );
    let conn = server.watch(Res::ServiceCidrs).await;
    assert_eq!(
        conn.query.get("resourceVersion").map(String::as_str),
        Some("20")
    );
    conn.send(
        "DELETED",
        service_cidr("kubernetes", "21", &["10.96.0.0/16"]),
    );
    assert_eq!(
        show(&next(&mut rx, "the deletion").await),
        "delete ServiceCIDR kubernetes"
    );
    assert_eq!(all_source_errors(&metrics), 0, "{}", metrics.encode());
}

#[tokio::test]
async fn an_api_server_without_service_cidrs_syncs_the_rest_and_asks_again_quietly() {
    an_unavailable_service_cidr_api_is_asked_for_again_quietly(404).await;
}

#[tokio::test]
async fn a_role_without_service_cidrs_syncs_the_rest_and_asks_again_quietly() {
    an_unavailable_service_cidr_api_is_asked_for_again_quietly(403).await;
}

/// A ServiceCIDR API that stops being served keeps what was reported (a 404 proves nothing
/// about the objects: during an upgrade, API servers of both versions answer in turn), and a
/// list once it is served again reports what vanished meanwhile.
#[tokio::test]
async fn service_cidrs_outlive_the_api_going_away_until_a_list_proves_them_gone() {
    let server = FakeApiServer::start(vec![(
        Res::ServiceCidrs,
        vec![service_cidr("kubernetes", "1", &["10.96.0.0/16"])],
        "10",
    )])
    .await;
    let (mut rx, metrics) = run_source(&server);
    let mut server = server;
    initial_sync(&mut rx).await;
    let conn = server.watch(Res::ServiceCidrs).await;

    // The watch ends, and the next one meets an API server that does not serve ServiceCIDRs.
    server.refuse(Res::ServiceCidrs, Some(404));
    drop(conn);
    assert_eq!(
        show(&next(&mut rx, "Synced when refused").await),
        "synced ServiceCIDR"
    );
    server
        .request("a recheck", |r| {
            r.res == Res::ServiceCidrs
                && r.status == 404
                && r.query.get("limit").map(String::as_str) == Some("1")
        })
        .await;
    if let Ok(ev) = rx.try_recv() {
        panic!("reported {} while the API was unavailable", show(&ev));
    }

    server.set_list(
        Res::ServiceCidrs,
        vec![service_cidr("other", "31", &["10.98.0.0/16"])],
        "40",
    );
    server.refuse(Res::ServiceCidrs, None);
    let got: Vec<String> = [
        next(&mut rx, "other").await,
        next(&mut rx, "kubernetes's deletion").await,
        next(&mut rx, "Synced").await,
    ]
    .iter()
    .map(show)
    .collect();
    assert_eq!(
        got,
        [
            "upsert ServiceCIDR other",
            "delete ServiceCIDR kubernetes",
            "synced ServiceCIDR"
        ]
    );
    assert_eq!(all_source_errors(&metrics), 0, "{}", metrics.encode());
}

/// Any other failure of ServiceCIDR requests is an error like any kind's: logged, counted and
/// retried with backoff, and no `Synced(ServiceCIDR)` until a list succeeds.
#[tokio::test]
async fn other_service_cidr_errors_are_counted_and_retried_as_for_any_kind() {
    let server = FakeApiServer::start(vec![]).await;
    server.fail_list(Res::ServiceCidrs, Some(500));
    let (mut rx, metrics) = run_source(&server);
    let mut server = server;
    let by_kind = sync_of(&mut rx, &[Kind::Service, Kind::EndpointSlice, Kind::Node]).await;
    assert!(
        !by_kind.contains_key(&Kind::ServiceCidr),
        "{:?}",
        by_kind.get(&Kind::ServiceCidr)
    );
    for i in 1..=3 {
        server
            .request(&format!("failed list {i}"), |r| {
                r.res == Res::ServiceCidrs && !r.watch && r.status == 500
            })
            .await;
    }
    // The last failure may still be on its way to the counter.
    assert!(source_errors(&metrics, "list") >= 2, "{}", metrics.encode());
    if let Ok(ev) = rx.try_recv() {
        panic!("reported {} while lists failed", show(&ev));
    }

    server.fail_list(Res::ServiceCidrs, None);
    assert_eq!(
        show(&next(&mut rx, "Synced after the errors").await),
        "synced ServiceCIDR"
    );
    server.watch(Res::ServiceCidrs).await;
}
