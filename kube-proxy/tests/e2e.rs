//! The `kube-proxy` binary, end to end: it runs in a lab node namespace, reads the flow fixture
//! from a manifest directory, and must pass the flow table with real packets, follow live edits,
//! and survive bad input without losing working rules.

use std::path::Path;
use std::time::Duration;

use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
use common::{
    eventually, http_get, metric_sum, temp_dir, web_backends, write_atomically, HEALTHZ, PROGRAMMED,
};

fn start_proxy(lab: &Lab, dir: &Path) -> ChildGuard {
    let mut proxy = common::spawn_proxy(lab, &[], &["--manifests", dir.to_str().unwrap()]);
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(20))
        .expect("first sync");
    proxy
}

#[test]
#[ignore = "needs root"]
fn the_binary_serves_the_flow_table_from_manifests_and_follows_live_edits() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let dir = temp_dir("flows");
    let cluster = dir.0.join("cluster.json");
    write_atomically(&cluster, &kp_flows::manifest_list());
    let mut proxy = start_proxy(&lab, &dir.0);

    let health = http_get(lab.node(), HEALTHZ);
    assert!(health.contains("\"healthy\":true"), "{health}");
    let failures = kp_test::flows::check_all(&lab);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // Live edit: scale web down to two endpoints; traffic follows within a sync or two.
    let edited = serde_json::to_string(&{
        let mut v: serde_json::Value = serde_json::from_str(&kp_flows::manifest_list()).unwrap();
        for item in v["items"].as_array_mut().unwrap() {
            if item["kind"] == "EndpointSlice" && item["metadata"]["name"] == "web-ipv4" {
                item["endpoints"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|e| e["addresses"][0] != "10.244.1.13");
                // As the EndpointSlice controller does: when the change was triggered. Its age
                // at the time the rules are live is the network programming latency.
                let now = kp_serve::rfc3339::format(std::time::SystemTime::now());
                item["metadata"]["annotations"] = serde_json::json!({
                    "endpoints.kubernetes.io/last-change-trigger-time": now,
                });
            }
        }
        v
    })
    .unwrap();
    write_atomically(&cluster, &edited);
    eventually(
        "pod-3 to leave the web Service",
        Duration::from_secs(3),
        || web_backends(&lab, 12) == ["pod-1", "pod-2"],
    );

    // The periodic full syncs (every second here) found the kernel equal to the plan.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        metric_sum(
            lab.node(),
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
        ) >= 1.0
    );
    assert_eq!(
        metric_sum(
            lab.node(),
            "kubeproxy_rs_nftables_readback_mismatches_total"
        ),
        0.0
    );
    assert_eq!(
        metric_sum(
            lab.node(),
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"
        ),
        0.0
    );
    // The edit's trigger time was turned into one programming-latency sample, of a sane size.
    assert_eq!(
        metric_sum(
            lab.node(),
            "kubeproxy_network_programming_duration_seconds_count"
        ),
        1.0
    );
    let latency = metric_sum(
        lab.node(),
        "kubeproxy_network_programming_duration_seconds_sum",
    );
    assert!((0.0..5.0).contains(&latency), "{latency} s");

    // Stopping leaves the rules in place, as upstream.
    proxy.terminate(Duration::from_secs(5)).unwrap();
    assert_eq!(web_backends(&lab, 24), ["pod-1", "pod-2"]);

    // `--cleanup` removes both tables and nothing else.
    lab.node()
        .run(&["nft", "add", "table", "inet", "someone-else"])
        .unwrap();
    let out = lab
        .node()
        .run(&[env!("CARGO_BIN_EXE_kube-proxy"), "--cleanup"])
        .expect("kube-proxy --cleanup");
    let tables = lab.node().run(&["nft", "list", "tables"]).unwrap();
    assert!(!tables.contains("kube-proxy"), "{tables}\n{out}");
    assert!(
        tables.contains("someone-else"),
        "cleanup must not touch other tables: {tables}"
    );
}

#[test]
#[ignore = "needs root"]
fn bad_manifests_are_reported_and_never_break_working_rules() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let dir = temp_dir("bad");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start_proxy(&lab, &dir.0);
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2", "pod-3"]);

    // 1. A file that is not YAML at all: the error names the file and the document.
    write_atomically(
        &dir.0.join("broken.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: [unclosed\n",
    );
    // 2. A Service with an invalid ClusterIP and one with a port out of range.
    write_atomically(
        &dir.0.join("invalid.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: bad-ip, namespace: default}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}\n---\n\
         apiVersion: v1\nkind: Service\nmetadata: {name: bad-port, namespace: default}\nspec: {clusterIP: 10.96.0.81, ports: [{port: 70000}]}\n",
    );
    // 3. Names that would inject into rule text, in JSON so quotes and newlines survive.
    let hostile = serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "x\"; flush ruleset; \"", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.82", "ports": [{"name": "a\nb", "port": 80}]},
    });
    write_atomically(&dir.0.join("hostile.json"), &hostile.to_string());
    // 4. A ClusterIP the API server would refuse (its unknown-port reject would refuse TCP to
    // the node's loopback, /metrics included), and a name that would forge a log line.
    let special = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "loopback", "namespace": "default"},
         "spec": {"clusterIP": "127.0.0.1", "ports": [{"port": 80}]}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "x\nERROR forged log line", "namespace": "default"},
         "spec": {"clusterIP": "10.96.0.83", "ports": [{"port": 80}]}},
    ]});
    write_atomically(&dir.0.join("special.json"), &special.to_string());
    // 5. A valid Service turned invalid: its last good version stays.
    let mut list: serde_json::Value = serde_json::from_str(&kp_flows::manifest_list()).unwrap();
    for item in list["items"].as_array_mut().unwrap() {
        if item["kind"] == "Service" && item["metadata"]["name"] == "web" {
            item["spec"]["clusterIPs"] = serde_json::json!(["10.96.0.10", "not-an-ip"]);
        }
    }
    write_atomically(&dir.0.join("cluster.json"), &list.to_string());

    eventually(
        "the bad objects to be counted",
        Duration::from_secs(5),
        || {
            metric_sum(
                lab.node(),
                "kubeproxy_rs_invalid_objects_total{kind=\"Service\"}",
            ) >= 6.0
                && metric_sum(
                    lab.node(),
                    "kubeproxy_rs_source_errors_total{source=\"manifests\",reason=\"parse\"}",
                ) >= 1.0
        },
    );
    let log = proxy.log();
    assert!(
        log.contains("broken.yaml") && log.contains("document 1"),
        "parse error must name file and document:\n{log}"
    );
    assert!(
        log.contains("10.96.0.300"),
        "invalid IP must be named:\n{log}"
    );
    assert!(log.contains("70000"), "invalid port must be named:\n{log}");
    assert!(
        log.contains("flush ruleset"),
        "the hostile name must be reported (escaped):\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    assert!(
        log.contains("127.0.0.1") && log.contains("loopback range"),
        "the loopback ClusterIP must be named with its reason:\n{log}"
    );
    assert!(
        log.contains("x\\nERROR forged log line") && !log.lines().any(|l| l.starts_with("ERROR")),
        "the hostile name must be escaped, never forge a line:\n{log}"
    );

    // Nothing bad reached the kernel, and every working Service still works.
    let table = lab
        .node()
        .run(&["nft", "list", "table", "ip", "kube-proxy"])
        .unwrap();
    for bad in [
        "10.96.0.81",
        "10.96.0.82",
        "10.96.0.83",
        "127.0.0.1",
        "flush",
    ] {
        assert!(!table.contains(bad), "{bad} reached the table");
    }
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2", "pod-3"]);
    let failures = kp_test::flows::check_all(&lab);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(
        metric_sum(
            lab.node(),
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"
        ),
        0.0
    );
    proxy.terminate(Duration::from_secs(5)).unwrap();
}

/// The fixture with the web Service's EndpointSlice replaced by a v1 Endpoints holding the
/// same pods (all but `left_out`) and port, as hand-written manifests do.
fn web_as_endpoints(left_out: &[&str]) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&kp_flows::manifest_list()).unwrap();
    let items = v["items"].as_array_mut().unwrap();
    let i = items
        .iter()
        .position(|item| item["kind"] == "EndpointSlice" && item["metadata"]["name"] == "web-ipv4")
        .expect("the web slice");
    let slice = items.remove(i);
    let addresses: Vec<serde_json::Value> = slice["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| !left_out.contains(&e["addresses"][0].as_str().unwrap()))
        .map(|e| serde_json::json!({"ip": e["addresses"][0], "nodeName": e["nodeName"]}))
        .collect();
    items.push(serde_json::json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "web", "namespace": slice["metadata"]["namespace"]},
        "subsets": [{"addresses": addresses, "ports": slice["ports"]}],
    }));
    v.to_string()
}

#[test]
#[ignore = "needs root"]
fn a_service_with_only_a_v1_endpoints_object_answers_and_follows_its_edits() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let dir = temp_dir("endpoints");
    let cluster = dir.0.join("cluster.json");
    write_atomically(&cluster, &web_as_endpoints(&[]));
    let _proxy = start_proxy(&lab, &dir.0);
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2", "pod-3"]);

    // Editing the Endpoints moves traffic, as editing a slice does.
    write_atomically(&cluster, &web_as_endpoints(&["10.244.1.13"]));
    eventually(
        "pod-3 to leave the web Service",
        Duration::from_secs(3),
        || web_backends(&lab, 12) == ["pod-1", "pod-2"],
    );
}
