//! The `kube-proxy` binary on its production path: it lists and watches a Kubernetes API server
//! (a fake one, listening inside the lab node namespace) and programs nftables there. It must
//! pass the flow table with real packets, follow a watch event, and keep every rule through an
//! API server outage, then follow changes again once the server is back.
//!
//! Two more cover defects these tests found and that are now fixed: a 503 outage must reach
//! kube-proxy's own error metric (kube's client must not retry it invisibly), and the first sync
//! waits for the Node, so NodePorts on its primary address answer from the first table.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kp_core::track::{Kind, Object};
use kp_test::apiserver::{FakeApiServer, Outage};
use kp_test::echo::{Outcome, Proto};
use kp_test::lab::{Lab, NODE_IP};
use kp_test::netns::ChildGuard;

mod common;
use common::{assert_flows, eventually, http_get, metric_sum, web_backends, HEALTHZ, PROGRAMMED};

/// The source error counter of the Kubernetes source, whatever the reason label.
const SOURCE_ERRORS: &str = "kubeproxy_rs_source_errors_total{source=\"kubernetes\"";

/// The collections kube-proxy watches.
const PATHS: [&str; 4] = [
    "/api/v1/services",
    "/apis/discovery.k8s.io/v1/endpointslices",
    "/api/v1/nodes",
    "/apis/networking.k8s.io/v1/servicecidrs",
];

/// How long the API server stays away.
const OUTAGE: Duration = Duration::from_secs(3);

/// Starts kube-proxy in the node namespace with `--master` and nothing else to find a cluster
/// by: no `$KUBECONFIG`, no `~/.kube/config` (HOME points at a directory that does not exist)
/// and no in-cluster environment. kube-rs's inference then fails and the URL is used alone,
/// without credentials, as upstream does with `--master`.
fn spawn_proxy(lab: &Lab, server: &FakeApiServer) -> ChildGuard {
    let home =
        std::env::temp_dir().join(format!("kp-apiserver-e2e-no-home-{}", std::process::id()));
    assert!(!home.exists(), "{} must not exist", home.display());
    let home = format!("HOME={}", home.display());
    let unset = [
        "env",
        "-u",
        "KUBECONFIG",
        "-u",
        "KUBERNETES_SERVICE_HOST",
        "-u",
        "KUBERNETES_SERVICE_PORT",
        &home,
    ];
    common::spawn_proxy(lab, &unset, &["--master", server.url()])
}

/// [`spawn_proxy`], then waits for its first full sync.
fn start_proxy(lab: &Lab, server: &FakeApiServer) -> ChildGuard {
    let mut proxy = spawn_proxy(lab, server);
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(20))
        .expect("first sync");
    proxy
}

/// Who answered `tries` connections from pod 4 to the web Service, as a set.
fn web_answers(lab: &Lab, tries: usize) -> BTreeSet<String> {
    web_backends(lab, tries).into_iter().collect()
}

/// One connection from the client to the web Service's NodePort on the node's address.
fn node_port(lab: &Lab) -> Outcome {
    lab.request(lab.client(), Proto::Tcp, NODE_IP.into(), 30080)
}

fn web_slice(pods: &[&'static str]) -> Object {
    Object::EndpointSlice(Box::new(kp_flows::web_slice(pods)))
}

/// A lab whose node runs kube-proxy against a fake API server, in the node, that holds the
/// flow fixture; kube-proxy has synced once and watches every kind.
struct Cluster {
    // Dropped in this order: kube-proxy, the API server, the echo servers, the namespaces.
    proxy: ChildGuard,
    server: FakeApiServer,
    _echo: Vec<ChildGuard>,
    lab: Lab,
    /// From starting kube-proxy to its first full sync.
    first_sync: Duration,
}

fn cluster() -> Cluster {
    let lab = kp_test::flows::lab().expect("lab");
    let echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let server = FakeApiServer::start_in(lab.node()).expect("fake API server in the node");
    server
        .load_objects(kp_flows::objects())
        .expect("the fixture loads");
    let spawned = Instant::now();
    let proxy = start_proxy(&lab, &server);
    let first_sync = spawned.elapsed();
    server
        .wait_until("a watch of every kind", Duration::from_secs(5), |s| {
            [
                Kind::Service,
                Kind::EndpointSlice,
                Kind::Node,
                Kind::ServiceCidr,
            ]
            .into_iter()
            .all(|k| s.open_watches(k) == 1)
        })
        .expect("kube-proxy watches");
    // The first sync may come before the Node has listed (see
    // `known_defect_nodeports_answer_nowhere_until_the_node_is_listed`); the next one fixes it.
    eventually(
        "the web NodePort to answer (kube-proxy knows its Node)",
        Duration::from_secs(3),
        || matches!(node_port(&lab), Outcome::Answered { .. }),
    );
    Cluster {
        proxy,
        server,
        _echo: echo,
        lab,
        first_sync,
    }
}

/// For `OUTAGE`, checks that web keeps answering from `pods` only (all of them, over the
/// whole time) and that kube-proxy keeps running.
fn rules_stay_for_the_outage(c: &mut Cluster, pods: &[&str]) {
    let outage = Instant::now();
    let mut answered = BTreeSet::new();
    while outage.elapsed() < OUTAGE {
        let answers = web_answers(&c.lab, 6);
        assert!(
            answers.iter().all(|a| pods.contains(&a.as_str())),
            "during the outage, web was answered by {answers:?}"
        );
        answered.extend(answers);
        assert!(
            c.proxy.try_wait().expect("kube-proxy status").is_none(),
            "kube-proxy exited during the outage:\n{}",
            c.proxy.log()
        );
    }
    let pods: BTreeSet<String> = pods.iter().map(|p| p.to_string()).collect();
    assert_eq!(answered, pods);
    let health = http_get(c.lab.node(), HEALTHZ);
    assert!(
        health.contains("\"healthy\":true"),
        "no update is pending, so an API outage alone is healthy, as upstream: {health}"
    );
}

#[test]
#[ignore = "needs root"]
fn the_binary_follows_the_api_server_and_keeps_its_rules_through_an_outage() {
    if !kp_test::netns::require_root() {
        return;
    }
    let started = Instant::now();
    let mut c = cluster();
    let (lab, server) = (&c.lab, &c.server);

    // 1. From the API server to the kernel: the whole flow table passes.
    let health = http_get(lab.node(), HEALTHZ);
    assert!(health.contains("\"healthy\":true"), "{health}");
    assert_flows(lab);
    let requests = server.requests();
    for path in PATHS {
        assert_eq!(requests[path].lists, 1, "{path}: {requests:?}");
    }
    let node_list = server
        .request_log()
        .into_iter()
        .find(|r| r.path == "/api/v1/nodes")
        .expect("a node list");
    assert_eq!(
        node_list.query.get("fieldSelector").map(String::as_str),
        Some(format!("metadata.name={}", kp_flows::NODE).as_str()),
        "kube-proxy watches only its own Node"
    );

    // 2. A watch event: pod-3 leaves the web Service's EndpointSlice.
    server
        .upsert_object(&web_slice(&["pod-1", "pod-2"]))
        .expect("web slice");
    let followed = eventually(
        "pod-3 to leave the web Service",
        Duration::from_secs(3),
        || web_backends(lab, 12) == ["pod-1", "pod-2"],
    );
    assert_eq!(metric_sum(lab.node(), SOURCE_ERRORS), 0.0);

    // 3. The API server goes away: every connection is cut, watches break off mid-stream, and
    // kube-proxy's retries are refused. Nothing it programmed may go.
    server.set_available(false);
    let counted = eventually(
        "the failed watches to be counted as source errors",
        OUTAGE,
        || metric_sum(lab.node(), SOURCE_ERRORS) > 0.0,
    );
    rules_stay_for_the_outage(&mut c, &["pod-1", "pod-2"]);
    let (lab, server) = (&c.lab, &c.server);
    assert!(
        server.refused_connections() > 0,
        "kube-proxy retried during the outage"
    );
    let table = lab
        .node()
        .run(&["nft", "list", "table", "ip", "kube-proxy"])
        .expect("the table is still there");
    assert!(table.contains("10.96.0.10"), "{table}");

    // The server is back; a change made now (pod-3 returns) must reach the kernel once
    // kube-proxy's backoff lets it watch again.
    server.set_available(true);
    server
        .upsert_object(&web_slice(&["pod-1", "pod-2", "pod-3"]))
        .expect("web slice");
    let recovered = eventually(
        "pod-3 to return to the web Service after the outage",
        Duration::from_secs(10),
        || web_backends(lab, 12) == ["pod-1", "pod-2", "pod-3"],
    );
    // The watches resumed from the resourceVersion they had: the server kept its history, so
    // nothing needed listing again. (Each kind backs off on its own; the others may still be
    // waiting.)
    server
        .wait_until(
            "a watch of every kind again",
            Duration::from_secs(10),
            |s| {
                [
                    Kind::Service,
                    Kind::EndpointSlice,
                    Kind::Node,
                    Kind::ServiceCidr,
                ]
                .into_iter()
                .all(|k| s.open_watches(k) == 1)
            },
        )
        .expect("kube-proxy watches again");
    let requests = server.requests();
    for path in PATHS {
        assert_eq!(
            requests[path].lists, 1,
            "{path} was listed again: {requests:?}"
        );
        assert!(
            requests[path].watches >= 2,
            "{path} not watched again: {requests:?}"
        );
    }
    let log = c.proxy.log();
    assert!(
        log.contains("Kubernetes API error; retrying with backoff"),
        "the outage must be logged:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(
        metric_sum(
            lab.node(),
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"
        ),
        0.0
    );
    c.proxy.terminate(Duration::from_secs(5)).unwrap();
    eprintln!(
        "timings: first sync {:?} after start, watch event followed in {followed:?}, errors \
         counted {counted:?} into the outage, change after the outage followed in \
         {recovered:?}, whole test {:?}",
        c.first_sync,
        started.elapsed()
    );
}

/// An outage in which every request is answered 503 (a load balancer in front of API servers
/// that are all down) keeps the rules too, is logged and counted by kube-proxy's own source
/// (kube's client must not hide it behind its own retries), and changes flow again afterwards
/// within the watchers' capped backoff.
#[test]
#[ignore = "needs root"]
fn a_503_outage_keeps_the_rules_and_is_logged_and_counted() {
    if !kp_test::netns::require_root() {
        return;
    }
    let mut c = cluster();
    c.server.set_outage(Some(Outage::Status(503)));
    rules_stay_for_the_outage(&mut c, &["pod-1", "pod-2", "pod-3"]);
    let requests = c.server.requests();
    for path in PATHS {
        assert!(
            requests[path].failed >= 1,
            "{path}: kube-proxy's watch must have been refused: {requests:?}"
        );
    }
    // Every failed request reached kp-source: counted, and logged by it.
    assert!(
        metric_sum(c.lab.node(), SOURCE_ERRORS) > 0.0,
        "503s must be counted"
    );
    let log = c.proxy.log();
    assert!(
        log.contains("Kubernetes API error; retrying with backoff"),
        "{log}"
    );

    c.server.set_outage(None);
    c.server
        .upsert_object(&web_slice(&["pod-1", "pod-2"]))
        .expect("web slice");
    // The watchers' backoff starts at 0.8 s and doubles with jitter; after a 3 s outage the
    // next attempt is a few seconds away at most.
    let recovered = eventually(
        "pod-3 to leave the web Service after the 503 outage",
        Duration::from_secs(12),
        || web_backends(&c.lab, 12) == ["pod-1", "pod-2"],
    );
    assert_eq!(
        c.server.requests()["/api/v1/services"].lists,
        1,
        "no relist after a 503 outage either"
    );
    c.proxy.terminate(Duration::from_secs(5)).unwrap();
    eprintln!("timings: change after the 503 outage followed in {recovered:?}");
}

/// kube-proxy programs nothing before its own Node is listed, as well as Services and
/// EndpointSlices: with `nodePortAddresses: primary`, the default, the NodePort addresses come
/// from the Node, and a first table built without them would replace the previous instance's
/// working NodePorts with ones that answer nowhere. The server holds the Node list to make the
/// race deterministic.
#[test]
#[ignore = "needs root"]
fn nothing_is_programmed_until_the_node_is_listed() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let server = FakeApiServer::start_in(lab.node()).expect("fake API server in the node");
    server
        .load_objects(kp_flows::objects())
        .expect("the fixture loads");
    server.hold_lists(Kind::Node);
    let mut proxy = spawn_proxy(&lab, &server);
    server
        .wait_until("kube-proxy's Node list", Duration::from_secs(5), |s| {
            s.held_lists(Kind::Node) == 1
        })
        .expect("a held Node list");
    // Services and EndpointSlices are listed, but no table is programmed while the Node is not.
    let early = proxy.wait_for_log("programmed the kernel", Duration::from_secs(2));
    assert!(early.is_err(), "programmed before the Node was listed");
    let tables = lab.node().run(&["nft", "list", "tables"]).unwrap();
    assert!(!tables.contains("kube-proxy"), "{tables}");

    server.release_lists(Kind::Node);
    proxy
        .wait_for_log("programmed the kernel", Duration::from_secs(5))
        .expect("the first sync once the Node is listed");
    // The very first table already answers NodePorts on the Node's primary address.
    let fixed = eventually(
        "the web NodePort to answer once the Node is listed",
        Duration::from_secs(1),
        || matches!(node_port(&lab), Outcome::Answered { .. }),
    );
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2", "pod-3"]);
    proxy.terminate(Duration::from_secs(5)).unwrap();
    eprintln!("timings: NodePorts answered {fixed:?} after the Node list was released");
}
