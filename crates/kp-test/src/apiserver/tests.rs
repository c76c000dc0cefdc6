//! The fake API server: its store on its own, then the whole server through kube-rs's client
//! and watcher (what the binary uses), then raw HTTP for what the client hides. Every wait is
//! bounded by [`DEADLINE`].

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kube::ResourceExt;

use super::*;

/// Longest wait for any one event or request.
const DEADLINE: Duration = Duration::from_secs(5);

fn service(name: &str, labels: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
    })
}

fn node(name: &str) -> Value {
    json!({"metadata": {"name": name}})
}

fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}})
}

fn selects(labels: &str, fields: &str, object: &Value) -> bool {
    Filter::new(None, Some(labels), Some(fields))
        .expect("selector parses")
        .matches(object)
}

#[test]
fn the_store_fills_in_what_the_api_server_would_and_counts_one_resource_version_for_all_kinds() {
    let mut store = Store::default();
    assert_eq!(store.upsert(Kind::Service, service("a", json!({}))), Ok(1));
    assert_eq!(store.upsert(Kind::Node, node("n")), Ok(2));
    let a = store.get(Kind::Service, "ns", "a").expect("a").clone();
    assert_eq!(a["apiVersion"], "v1");
    assert_eq!(a["kind"], "Service");
    assert_eq!(a["metadata"]["resourceVersion"], "1");
    let uid = a["metadata"]["uid"].clone();
    assert!(uid.is_string());

    // A replacement keeps the uid and takes the next resourceVersion.
    assert_eq!(
        store.upsert(Kind::Service, service("a", json!({"x": "1"}))),
        Ok(3)
    );
    let a = store.get(Kind::Service, "ns", "a").expect("a");
    assert_eq!(a["metadata"]["uid"], uid);
    assert_eq!(a["metadata"]["resourceVersion"], "3");

    let slice = json!({"metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": []});
    assert_eq!(store.upsert(Kind::EndpointSlice, slice), Ok(4));
    let s = store.get(Kind::EndpointSlice, "default", "s").expect("s");
    assert_eq!(s["apiVersion"], "discovery.k8s.io/v1");
    assert_eq!(s["metadata"]["namespace"], "default");

    assert_eq!(store.delete(Kind::Node, "ignored", "n"), Some(5));
    assert_eq!(store.delete(Kind::Node, "", "n"), None);
    assert_eq!(store.resource_version(), 5);
}

#[test]
fn the_store_refuses_objects_the_api_server_would_refuse() {
    let mut store = Store::default();
    for (kind, bad) in [
        (Kind::Service, json!({"metadata": {}})),
        (Kind::Service, json!(["not", "an", "object"])),
        (
            Kind::Service,
            json!({"kind": "Node", "metadata": {"name": "x"}}),
        ),
        (
            Kind::Node,
            json!({"metadata": {"name": "x", "namespace": "ns"}}),
        ),
    ] {
        assert!(store.upsert(kind, bad.clone()).is_err(), "{kind} {bad}");
    }
    assert_eq!(store.resource_version(), 0);
}

#[test]
fn label_and_field_selectors_select_as_upstream() {
    let svc = service("a", json!({"app": "web", "tier": "front"}));
    assert!(selects("", "", &svc));
    assert!(selects("app", "", &svc));
    assert!(selects("app=web,tier==front", "", &svc));
    assert!(selects("!service.kubernetes.io/headless", "", &svc));
    assert!(!selects("!app", "", &svc));
    assert!(selects("app in (db, web)", "", &svc));
    assert!(!selects("app notin (db,web)", "", &svc));
    assert!(selects("app notin (db)", "", &svc));
    assert!(selects("app!=db", "", &svc));
    assert!(
        selects("missing!=x", "", &svc),
        "!= also selects a missing label"
    );
    assert!(selects("", "metadata.name=a", &svc));
    assert!(selects("", "metadata.name==a,metadata.namespace=ns", &svc));
    assert!(!selects("", "metadata.name=b", &svc));
    assert!(selects("", "metadata.name!=b", &svc));
    assert!(selects("", "spec.clusterIP=10.96.0.10", &svc));
    assert!(Filter::new(None, Some("app in web"), None).is_err());
    assert!(Filter::new(None, None, Some("metadata.name")).is_err());

    let filter = Filter::new(Some("other".into()), None, None).expect("filter");
    assert!(!filter.matches(&svc));
}

#[test]
fn watches_see_objects_enter_and_leave_their_selector_as_added_and_deleted() {
    let mut store = Store::default();
    let web = Filter::new(None, Some("app=web"), None).expect("filter");
    store
        .upsert(Kind::Service, service("a", json!({"app": "db"})))
        .expect("upsert");
    store
        .upsert(Kind::Service, service("a", json!({"app": "web"})))
        .expect("upsert");
    store
        .upsert(Kind::Service, service("a", json!({"app": "web", "v": "2"})))
        .expect("upsert");
    store.upsert(Kind::Node, node("n")).expect("upsert");
    store
        .upsert(Kind::Service, service("a", json!({"app": "db"})))
        .expect("upsert");
    store
        .upsert(Kind::Service, service("b", json!({"app": "web"})))
        .expect("upsert");
    store.delete(Kind::Service, "ns", "b");
    store.delete(Kind::Service, "ns", "a");

    let seen: Vec<(u64, &str, String)> = store
        .events_since(Kind::Service, 0, &web)
        .into_iter()
        .map(|(rv, event, object)| {
            let name = object["metadata"]["name"]
                .as_str()
                .unwrap_or("")
                .to_string();
            assert_eq!(object["metadata"]["resourceVersion"], rv.to_string());
            (rv, event.as_str(), name)
        })
        .collect();
    assert_eq!(
        seen,
        [
            (2, "ADDED", "a".to_string()),
            (3, "MODIFIED", "a".to_string()),
            (5, "DELETED", "a".to_string()),
            (6, "ADDED", "b".to_string()),
            (7, "DELETED", "b".to_string()),
        ]
    );
    // a was deleted while it did not match: nothing to report.
    assert_eq!(store.events_since(Kind::Service, 7, &web), []);
    assert_eq!(store.events_since(Kind::Service, 3, &web).len(), 3);
}

#[test]
fn after_compaction_only_watches_from_the_current_resource_version_may_start() {
    let mut store = Store::default();
    store.upsert(Kind::Node, node("n")).expect("upsert");
    store.upsert(Kind::Node, node("m")).expect("upsert");
    assert_eq!(store.check_start(0), Ok(()));
    store.compact();
    assert_eq!(store.check_start(1), Err(store::Gone { oldest: 2 }));
    assert_eq!(store.check_start(2), Ok(()));
    assert_eq!(store.check_start(7), Ok(()));
}

fn names(page: &[Value]) -> Vec<&str> {
    page.iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap_or("?"))
        .collect()
}

#[test]
fn a_page_starts_after_the_last_object_of_the_one_before_whatever_changed_meanwhile() {
    let mut store = Store::default();
    for i in 0..5 {
        store
            .upsert(Kind::Service, service(&format!("s{i}"), json!({})))
            .expect("upsert");
    }
    store
        .upsert(Kind::Service, service("skip", json!({"proxy": "other"})))
        .expect("upsert");
    let all = Filter::new(None, Some("!proxy"), None).expect("selector");
    let (page, next) = store.list_page(Kind::Service, &all, None, Some(2));
    assert_eq!(names(&page), ["s0", "s1"]);
    assert_eq!(next, Some(("ns".to_string(), "s1".to_string())));

    // Between two pages, an object already sent is deleted and one that sorts before the
    // cursor is created: neither shifts what the next page holds (an offset would skip s2).
    store.delete(Kind::Service, "ns", "s0").expect("s0 existed");
    store
        .upsert(Kind::Service, service("a", json!({})))
        .expect("upsert");
    let (page, next) = store.list_page(Kind::Service, &all, Some(&("ns", "s1")), Some(2));
    assert_eq!(names(&page), ["s2", "s3"]);
    assert_eq!(next, Some(("ns".to_string(), "s3".to_string())));
    // The last page is not followed by another, although an unselected object comes after it.
    let (page, next) = store.list_page(Kind::Service, &all, Some(&("ns", "s3")), Some(2));
    assert_eq!(names(&page), ["s4"]);
    assert_eq!(next, None);
    // Without a limit, everything selected; other kinds never leak in.
    store.upsert(Kind::Node, node("n")).expect("upsert");
    let (page, next) = store.list_page(Kind::Service, &all, None, None);
    assert_eq!(names(&page), ["a", "s1", "s2", "s3", "s4"]);
    assert_eq!(next, None);
    let (page, _) = store.list_page(Kind::Node, &Filter::default(), Some(&("", "m")), Some(1));
    assert_eq!(names(&page), ["n"]);
}

fn client(server: &FakeApiServer) -> kube::Client {
    let url = server.url().parse().expect("url");
    kube::Client::try_from(kube::Config::new(url)).expect("client")
}

/// A watcher's output, driven by a task of its own so that it keeps watching while the test
/// waits; after an error it pauses 20 ms, as a backoff would.
type Events<K> = mpsc::UnboundedReceiver<watcher::Result<Event<K>>>;

fn watch_all<K>(client: kube::Client, config: watcher::Config) -> Events<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + k8s_openapi::serde::de::DeserializeOwned
        + Send
        + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let mut stream = watcher(Api::<K>::all(client), config).boxed();
    tokio::spawn(async move {
        while let Some(item) = stream.next().await {
            let failed = item.is_err();
            if tx.send(item).is_err() {
                return;
            }
            if failed {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    rx
}

/// The next watcher event, or the error it reported; panics after [`DEADLINE`].
async fn next<K>(events: &mut Events<K>, waiting_for: &str) -> watcher::Result<Event<K>> {
    match tokio::time::timeout(DEADLINE, events.recv()).await {
        Ok(Some(item)) => item,
        Ok(None) => panic!("the watcher ended while waiting for {waiting_for}"),
        Err(_) => panic!("nothing within {DEADLINE:?} while waiting for {waiting_for}"),
    }
}

/// The next event that is not an error, skipping errors.
async fn next_ok<K>(events: &mut Events<K>, waiting_for: &str) -> Event<K> {
    let start = Instant::now();
    loop {
        match next(events, waiting_for).await {
            Ok(event) => return event,
            Err(_) if start.elapsed() < DEADLINE => {}
            Err(e) => panic!("only errors while waiting for {waiting_for}; the last: {e}"),
        }
    }
}

/// [`FakeApiServer::wait_until`] for async tests: it must not block the runtime that drives
/// the watchers.
async fn until(server: &FakeApiServer, what: &str, done: impl Fn(&FakeApiServer) -> bool) {
    let start = Instant::now();
    while !done(server) {
        assert!(
            start.elapsed() < DEADLINE,
            "timed out waiting for {what}; requests: {:?}",
            server.requests()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn show<K: kube::Resource>(event: &Event<K>) -> String {
    match event {
        Event::Init => "init".into(),
        Event::InitApply(o) => format!("init-apply {}", o.name_any()),
        Event::InitDone => "init-done".into(),
        Event::Apply(o) => format!("apply {}", o.name_any()),
        Event::Delete(o) => format!("delete {}", o.name_any()),
    }
}

/// kube-proxy's Service selector.
const NOT_HEADLESS: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

#[tokio::test]
async fn kube_rs_lists_and_watches_through_selectors() {
    let server = FakeApiServer::start().expect("server");
    server
        .upsert(Kind::Service, service("a", json!({})))
        .expect("a");
    let headless = json!({"service.kubernetes.io/headless": ""});
    server
        .upsert(Kind::Service, service("h", headless.clone()))
        .expect("h");
    server.upsert(Kind::Node, node("node-a")).expect("node-a");
    server.upsert(Kind::Node, node("node-b")).expect("node-b");

    let client = client(&server);
    let config = watcher::Config::default().labels(NOT_HEADLESS);
    let mut services = watch_all::<Service>(client.clone(), config);
    let config = watcher::Config::default().fields("metadata.name=node-a");
    let mut nodes = watch_all::<Node>(client, config);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(show(&next_ok(&mut services, "the initial list").await));
    }
    assert_eq!(got, ["init", "init-apply a", "init-done"]);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(show(&next_ok(&mut nodes, "the initial node list").await));
    }
    assert_eq!(got, ["init", "init-apply node-a", "init-done"]);
    until(&server, "both watches", |s| {
        s.open_watches(Kind::Service) == 1 && s.open_watches(Kind::Node) == 1
    })
    .await;

    // Changes reach the watch; a Service that turns headless leaves it as a deletion.
    server
        .upsert(Kind::Service, service("b", json!({})))
        .expect("b");
    server.upsert(Kind::Node, node("node-b")).expect("node-b");
    server
        .upsert(Kind::Service, service("a", headless))
        .expect("a");
    server.delete(Kind::Service, "ns", "b").expect("b deleted");
    server.upsert(Kind::Node, node("node-a")).expect("node-a");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(show(&next_ok(&mut services, "the changes").await));
    }
    assert_eq!(got, ["apply b", "delete a", "delete b"]);
    assert_eq!(show(&next_ok(&mut nodes, "node-a").await), "apply node-a");

    let requests = server.requests();
    let svc = requests["/api/v1/services"];
    assert_eq!((svc.lists, svc.watches, svc.failed), (1, 1, 0));
    let log = server.request_log();
    let node_watch = log
        .iter()
        .find(|r| r.path == "/api/v1/nodes" && r.watch)
        .expect("a node watch");
    assert_eq!(
        node_watch.query.get("fieldSelector").map(String::as_str),
        Some("metadata.name=node-a")
    );
}

#[tokio::test]
async fn after_a_disconnect_outage_watches_resume_without_a_relist_and_see_what_changed() {
    let server = FakeApiServer::start().expect("server");
    server
        .upsert(Kind::Service, service("a", json!({})))
        .expect("a");
    let mut services = watch_all::<Service>(client(&server), Default::default());
    for _ in 0..3 {
        next_ok(&mut services, "the initial list").await;
    }
    until(&server, "the watch", |s| s.open_watches(Kind::Service) == 1).await;

    server.set_available(false);
    assert!(
        next(&mut services, "the broken watch").await.is_err(),
        "the open watch must break off with an error"
    );
    // Retries fail while the outage lasts; the store still changes meanwhile.
    assert!(next(&mut services, "a refused watch").await.is_err());
    server
        .upsert(Kind::Service, service("b", json!({})))
        .expect("b");
    until(&server, "refused connections", |s| {
        s.refused_connections() > 0
    })
    .await;
    assert_eq!(server.open_watches(Kind::Service), 0);

    server.set_available(true);
    assert_eq!(show(&next_ok(&mut services, "b").await), "apply b");
    assert_eq!(server.requests()["/api/v1/services"].lists, 1, "no relist");
}

#[tokio::test]
async fn a_watch_from_before_a_compaction_is_gone_and_the_client_lists_again() {
    let server = FakeApiServer::start().expect("server");
    server
        .upsert(Kind::Service, service("a", json!({})))
        .expect("a");
    let mut services = watch_all::<Service>(client(&server), Default::default());
    for _ in 0..3 {
        next_ok(&mut services, "the initial list").await;
    }
    until(&server, "the watch", |s| s.open_watches(Kind::Service) == 1).await;
    // While nobody watches, b replaces a and the history is compacted.
    server.set_outage(Some(Outage::Status(500)));
    assert!(next(&mut services, "the broken watch").await.is_err());
    server.delete(Kind::Service, "ns", "a").expect("a");
    server
        .upsert(Kind::Service, service("b", json!({})))
        .expect("b");
    server.compact();
    server.set_outage(None);

    let mut got = Vec::new();
    while got.last().map(String::as_str) != Some("init-done") {
        match next(&mut services, "the relist").await {
            Ok(event) => got.push(show(&event)),
            Err(watcher::Error::WatchError(status)) => {
                assert_eq!(status.code, 410);
                got.push("gone".into());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(got, ["gone", "init", "init-apply b", "init-done"]);
    let svc = server.requests()["/api/v1/services"];
    assert_eq!(svc.lists, 2);
    let gone = server
        .request_log()
        .iter()
        .filter(|r| r.watch && r.status == 410)
        .count();
    assert_eq!(gone, 1);
}

#[tokio::test]
async fn a_held_list_is_answered_only_once_released() {
    let server = FakeApiServer::start().expect("server");
    server.upsert(Kind::Node, node("n")).expect("n");
    server.hold_lists(Kind::Node);
    let mut nodes = watch_all::<Node>(client(&server), Default::default());
    assert_eq!(show(&next_ok(&mut nodes, "init").await), "init");
    until(&server, "the held list", |s| s.held_lists(Kind::Node) == 1).await;
    let early = tokio::time::timeout(Duration::from_millis(300), nodes.recv()).await;
    assert!(early.is_err(), "a held list was answered: {early:?}");
    assert!(
        server.requests().is_empty(),
        "held lists are counted once answered"
    );

    server.release_lists(Kind::Node);
    assert_eq!(show(&next_ok(&mut nodes, "the list").await), "init-apply n");
    assert_eq!(show(&next_ok(&mut nodes, "the list").await), "init-done");
    assert_eq!(server.held_lists(Kind::Node), 0);
    assert_eq!(server.requests()["/api/v1/nodes"].lists, 1);
}

/// One plain HTTP/1.1 request; the whole answer, as text (watch bodies are chunked, one event
/// per chunk, so their JSON lines stay whole).
fn http_get(server: &FakeApiServer, target: &str) -> String {
    http_get_addr(server.addr(), target)
}

/// [`http_get`] by address, for a blocking task of an async test.
fn http_get_addr(addr: SocketAddr, target: &str) -> String {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(DEADLINE)).expect("timeout");
    write!(
        conn,
        "GET {target} HTTP/1.1\r\nHost: fake\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).expect("read the answer");
    answer
}

/// The JSON lines of an answer's body.
fn json_lines(answer: &str) -> Vec<Value> {
    answer
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[test]
fn continue_tokens_page_through_a_list_at_the_first_pages_resource_version() {
    let server = FakeApiServer::start().expect("server");
    for i in 0..3 {
        server
            .upsert(Kind::Node, node(&format!("n{i}")))
            .expect("upsert");
    }
    let body = |answer: &str| -> Value { json_lines(answer).pop().expect("a JSON body") };
    let first = body(&http_get(&server, "/api/v1/nodes?limit=2"));
    assert_eq!(
        names(first["items"].as_array().expect("items")),
        ["n0", "n1"]
    );
    assert_eq!(first["metadata"]["resourceVersion"], "3");
    let token = first["metadata"]["continue"]
        .as_str()
        .expect("a continue token");
    // A change between the pages: the next page still reports the first one's version.
    server.upsert(Kind::Node, node("n3")).expect("upsert");
    let second = body(&http_get(
        &server,
        &format!("/api/v1/nodes?limit=2&continue={token}"),
    ));
    assert_eq!(
        names(second["items"].as_array().expect("items")),
        ["n2", "n3"]
    );
    assert_eq!(second["metadata"]["resourceVersion"], "3");
    assert!(second["metadata"].get("continue").is_none(), "{second}");

    for bad in ["x", "3:n1", "3:/", "three:/n1"] {
        let answer = http_get(&server, &format!("/api/v1/nodes?limit=2&continue={bad}"));
        assert!(answer.starts_with("HTTP/1.1 400"), "{bad}: {answer}");
        assert_eq!(body(&answer)["reason"], "BadRequest", "{bad}");
    }
}

#[test]
fn raw_requests_see_status_bodies_initial_events_bookmarks_and_timeouts() {
    let server = FakeApiServer::start().expect("server");
    server.upsert(Kind::Node, node("n")).expect("n");

    let answer = http_get(&server, "/api/v1/pods");
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert_eq!(json_lines(&answer)[0]["reason"], "NotFound");

    let answer = http_get(&server, "/api/v1/nodes?labelSelector=a%20in%20b");
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");

    // A streaming list: the objects, then the bookmark that ends them, then the timeout.
    let answer = http_get(
        &server,
        "/api/v1/nodes?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&timeoutSeconds=1",
    );
    let events = json_lines(&answer);
    assert_eq!(events.len(), 2, "{answer}");
    assert_eq!(events[0]["type"], "ADDED");
    assert_eq!(events[1]["type"], "BOOKMARK");
    assert_eq!(
        events[1]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );

    // A watch from rv 1 with bookmarks: a change and a bookmark arrive, then it times out.
    let watching = std::thread::scope(|scope| {
        let watch = scope.spawn(|| {
            http_get(
                &server,
                "/api/v1/nodes?watch=1&resourceVersion=1&allowWatchBookmarks=true&timeoutSeconds=2",
            )
        });
        server
            .wait_until("the watch", DEADLINE, |s| s.open_watches(Kind::Node) == 1)
            .expect("watch");
        server.upsert(Kind::Node, node("m")).expect("m");
        server.send_bookmarks();
        watch.join().expect("watch thread")
    });
    let events = json_lines(&watching);
    let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(types, ["ADDED", "BOOKMARK"], "{watching}");
    assert_eq!(events[1]["object"]["metadata"]["resourceVersion"], "2");
    assert_eq!(server.open_watches(Kind::Node), 0);

    server.set_outage(Some(Outage::Status(503)));
    let answer = http_get(&server, "/api/v1/nodes");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert_eq!(json_lines(&answer)[0]["reason"], "ServiceUnavailable");
    server.set_available(false);
    let mut conn = TcpStream::connect(server.addr()).expect("the port stays open");
    conn.set_read_timeout(Some(DEADLINE)).expect("timeout");
    let _ = conn.write_all(b"GET /api/v1/nodes HTTP/1.1\r\nHost: fake\r\n\r\n");
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer);
    assert!(answer.is_empty(), "a disconnect outage answers nothing");
    server.set_available(true);
    assert!(http_get(&server, "/api/v1/nodes").starts_with("HTTP/1.1 200"));

    let nodes = server.requests()["/api/v1/nodes"];
    assert_eq!((nodes.lists, nodes.watches, nodes.failed), (3, 2, 2));
    assert_eq!(server.requests()["/api/v1/pods"].failed, 1);
}

#[test]
#[ignore = "needs root"]
fn a_server_started_in_a_namespace_is_reachable_there_only() {
    if !crate::require_root() {
        return;
    }
    let ns = Netns::new("apiserver").expect("netns");
    let server = FakeApiServer::start_in(&ns).expect("server");
    server.upsert(Kind::Node, node("n")).expect("n");
    let url = format!("{}/api/v1/nodes", server.url());
    let inside = ns
        .run(&["curl", "-sS", "--max-time", "5", &url])
        .expect("curl inside the namespace");
    assert_eq!(
        serde_json::from_str::<Value>(&inside).expect("json")["items"][0]["metadata"]["name"],
        "n"
    );
    // Nothing listens on that port in the test's own namespace (unless by coincidence).
    if let Ok(mut conn) = TcpStream::connect(server.addr()) {
        let _ =
            conn.write_all(b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer);
        assert!(
            !answer.contains("NodeList"),
            "the server leaked out of its namespace"
        );
    }
    assert_eq!(server.requests()["/api/v1/nodes"].lists, 1);
}

#[tokio::test]
async fn lists_are_paged_as_kube_rs_asks_and_every_object_arrives_once() {
    let server = FakeApiServer::start().expect("server");
    for i in 0..7 {
        server
            .upsert(Kind::Service, service(&format!("s{i}"), json!({})))
            .expect("upsert");
    }
    let config = watcher::Config::default().page_size(3);
    let mut services = watch_all::<Service>(client(&server), config);
    let mut applied = Vec::new();
    loop {
        match show(&next_ok(&mut services, "the paged list").await).as_str() {
            "init" => {}
            "init-done" => break,
            other => applied.push(other.to_string()),
        }
    }
    let want: Vec<String> = (0..7).map(|i| format!("init-apply s{i}")).collect();
    assert_eq!(applied, want);
    // Three pages: 3 + 3 + 1, each a separate list request with a limit.
    let lists: Vec<_> = server
        .request_log()
        .into_iter()
        .filter(|r| !r.watch && r.path.ends_with("/services"))
        .collect();
    assert_eq!(lists.len(), 3, "{lists:?}");
    assert!(lists
        .iter()
        .all(|r| r.query.get("limit").map(String::as_str) == Some("3")));
    assert!(lists[1].query.contains_key("continue") && lists[2].query.contains_key("continue"));
}

#[test]
fn service_cidrs_are_stored_cluster_scoped_in_networking_k8s_io_v1() {
    let mut store = Store::default();
    assert_eq!(
        store.upsert(
            Kind::ServiceCidr,
            service_cidr("kubernetes", &["10.96.0.0/16"])
        ),
        Ok(1)
    );
    let cidr = store
        .get(Kind::ServiceCidr, "ignored", "kubernetes")
        .expect("stored");
    assert_eq!(cidr["apiVersion"], "networking.k8s.io/v1");
    assert_eq!(cidr["kind"], "ServiceCIDR");
    assert!(cidr["metadata"].get("namespace").is_none(), "{cidr}");
    let namespaced = json!({"metadata": {"name": "x", "namespace": "ns"}});
    assert!(store.upsert(Kind::ServiceCidr, namespaced).is_err());
    assert_eq!(store.delete(Kind::ServiceCidr, "", "kubernetes"), Some(2));
}

/// Everything the other kinds get, through kube-rs's watcher: a paged list, watch events,
/// bookmarks, a dropped watch resumed without a list, and a 410 that makes it list again.
#[tokio::test]
async fn service_cidrs_are_listed_and_watched_as_the_other_kinds_are() {
    const PATH: &str = "/apis/networking.k8s.io/v1/servicecidrs";
    let server = FakeApiServer::start().expect("server");
    for name in ["a", "b", "c"] {
        server
            .upsert(Kind::ServiceCidr, service_cidr(name, &["10.96.0.0/16"]))
            .expect("upsert");
    }
    let config = watcher::Config::default().page_size(2);
    let mut cidrs = watch_all::<ServiceCIDR>(client(&server), config);
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(show(&next_ok(&mut cidrs, "the paged list").await));
    }
    assert_eq!(
        got,
        [
            "init",
            "init-apply a",
            "init-apply b",
            "init-apply c",
            "init-done"
        ]
    );
    until(&server, "the watch", |s| {
        s.open_watches(Kind::ServiceCidr) == 1
    })
    .await;
    let log = server.request_log();
    let lists: Vec<_> = log.iter().filter(|r| r.path == PATH && !r.watch).collect();
    assert_eq!(lists.len(), 2, "two pages: {lists:?}");
    assert!(lists[1].query.contains_key("continue"), "{lists:?}");
    let watch = log
        .iter()
        .find(|r| r.path == PATH && r.watch)
        .expect("a watch");
    assert_eq!(
        watch.query.get("allowWatchBookmarks").map(String::as_str),
        Some("true")
    );

    // Changes reach the watch; a dropped watch resumes from the last one, without a list.
    server
        .upsert(Kind::ServiceCidr, service_cidr("d", &["fd00:10:96::/112"]))
        .expect("d");
    let deleted = server
        .delete(Kind::ServiceCidr, "", "a")
        .expect("a deleted");
    assert_eq!(show(&next_ok(&mut cidrs, "d").await), "apply d");
    assert_eq!(show(&next_ok(&mut cidrs, "a's deletion").await), "delete a");
    server.drop_watches();
    until(&server, "the second watch", |s| {
        s.requests()[PATH].watches == 2 && s.open_watches(Kind::ServiceCidr) == 1
    })
    .await;
    let resumed = server
        .request_log()
        .into_iter()
        .filter(|r| r.path == PATH && r.watch)
        .nth(1)
        .expect("the second watch");
    assert_eq!(
        resumed.query.get("resourceVersion").map(String::as_str),
        Some(deleted.to_string().as_str())
    );
    assert_eq!(server.requests()[PATH].lists, 2, "no relist");

    // A bookmark names the kind and group version, as the real server's do.
    let addr = server.addr();
    let watching = tokio::task::spawn_blocking(move || {
        http_get_addr(
            addr,
            &format!("{PATH}?watch=1&resourceVersion={deleted}&allowWatchBookmarks=true&timeoutSeconds=1"),
        )
    });
    until(&server, "the raw watch", |s| {
        s.open_watches(Kind::ServiceCidr) == 2
    })
    .await;
    server.send_bookmarks();
    let watching = watching.await.expect("request thread");
    let events = json_lines(&watching);
    assert_eq!(events.len(), 1, "{watching}");
    assert_eq!(events[0]["type"], "BOOKMARK");
    assert_eq!(events[0]["object"]["kind"], "ServiceCIDR");
    assert_eq!(events[0]["object"]["apiVersion"], "networking.k8s.io/v1");

    // Compaction while nobody watches: the next watch is 410 Gone, and the client lists again.
    server.set_outage(Some(Outage::Status(500)));
    assert!(next(&mut cidrs, "the broken watch").await.is_err());
    server
        .delete(Kind::ServiceCidr, "", "b")
        .expect("b deleted");
    server.compact();
    server.set_outage(None);
    let mut got = Vec::new();
    while got.last().map(String::as_str) != Some("init-done") {
        match next(&mut cidrs, "the relist").await {
            Ok(event) => got.push(show(&event)),
            Err(watcher::Error::WatchError(status)) => {
                assert_eq!(status.code, 410);
                got.push("gone".into());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(
        got,
        ["gone", "init", "init-apply c", "init-apply d", "init-done"]
    );
}

/// `serve_service_cidrs(false)` answers as a 1.28 API server: 404 NotFound for lists and
/// watches (kube-rs's watcher sees it as its initial list failing), open watches end, and the
/// other kinds are untouched. Serving it again brings back what was stored.
#[tokio::test]
async fn an_api_server_without_service_cidrs_answers_404_as_before_1_33() {
    const PATH: &str = "/apis/networking.k8s.io/v1/servicecidrs";
    let server = FakeApiServer::start().expect("server");
    server
        .upsert(
            Kind::ServiceCidr,
            service_cidr("kubernetes", &["10.96.0.0/16"]),
        )
        .expect("upsert");
    server.upsert(Kind::Node, node("n")).expect("n");
    let mut cidrs = watch_all::<ServiceCIDR>(client(&server), Default::default());
    for _ in 0..3 {
        next_ok(&mut cidrs, "the list while served").await;
    }
    until(&server, "the watch", |s| {
        s.open_watches(Kind::ServiceCidr) == 1
    })
    .await;

    // Switched off: the open watch ends, and watching again is refused with the 404.
    server.serve_service_cidrs(false);
    match next(&mut cidrs, "the refused watch").await {
        Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) => {
            assert_eq!(status.code, 404, "{status:?}");
            assert!(status.is_not_found(), "{status:?}");
        }
        other => panic!("expected the watch to be refused with 404, got {other:?}"),
    }
    assert_eq!(server.open_watches(Kind::ServiceCidr), 0);

    // A fresh client's initial list is refused the same way: no Init is ever reported after it.
    let mut fresh = watch_all::<ServiceCIDR>(client(&server), Default::default());
    assert_eq!(show(&next_ok(&mut fresh, "init").await), "init");
    match next(&mut fresh, "the refused list").await {
        Err(watcher::Error::InitialListFailed(kube::Error::Api(status))) => {
            assert_eq!(status.code, 404, "{status:?}");
            assert_eq!(status.reason, "NotFound");
            assert_eq!(
                status.message,
                "the server could not find the requested resource"
            );
        }
        other => panic!("expected the list to be refused with 404, got {other:?}"),
    }
    drop(fresh);
    // Held lists of an unserved kind are not held: the real server has nothing to hold.
    server.hold_lists(Kind::ServiceCidr);
    let answer = tokio::task::spawn_blocking({
        let addr = server.addr();
        move || http_get_addr(addr, &format!("{PATH}?watch=true"))
    })
    .await
    .expect("request thread");
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert_eq!(json_lines(&answer)[0]["reason"], "NotFound");
    server.release_lists(Kind::ServiceCidr);
    let nodes = tokio::task::spawn_blocking({
        let addr = server.addr();
        move || http_get_addr(addr, "/api/v1/nodes")
    })
    .await
    .expect("request thread");
    assert!(nodes.starts_with("HTTP/1.1 200"), "other kinds are served");
    assert!(server.requests()[PATH].failed >= 3);

    // The upgrade: served again, with the object stored before. (The first watcher, refused
    // a watch and not a list, only watches again, from where it was: nothing changed since.)
    server.serve_service_cidrs(true);
    drop(cidrs);
    let mut fresh = watch_all::<ServiceCIDR>(client(&server), Default::default());
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(show(
            &next_ok(&mut fresh, "the list once served again").await,
        ));
    }
    assert_eq!(got, ["init", "init-apply kubernetes", "init-done"]);
}
