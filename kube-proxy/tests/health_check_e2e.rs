//! Health check node ports, end to end: a cloud load balancer probes `healthCheckNodePort` on
//! every node and sends traffic only where it answers 200. The binary must open one server per
//! `externalTrafficPolicy: Local` Service, answer 200 with local endpoints and 503 without (with
//! upstream's body and weight header), follow endpoint changes, and close the port when the
//! Service goes.

use std::time::Duration;

use kp_test::lab::Lab;

mod common;
use common::{edited_fixture, eventually, temp_dir, write_atomically, PROGRAMMED};

/// `curl -i` from the client namespace to the node's health check port: status line, headers
/// and body (empty when the connection fails).
fn probe(lab: &Lab, port: u16) -> String {
    let url = format!("http://{}:{port}/", kp_flows::NODE_IP);
    lab.client()
        .run(&["curl", "-s", "-i", "--max-time", "2", &url])
        .unwrap_or_default()
}

fn status(response: &str) -> Option<u16> {
    response
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
}

/// The fixture with `pod-2` (the only local endpoint of Service `local`) marked `ready`.
fn with_local_endpoint_ready(ready: bool) -> String {
    edited_fixture(|item| {
        if item["kind"] == "EndpointSlice"
            && item["metadata"]["labels"]["kubernetes.io/service-name"] == "local"
        {
            for ep in item["endpoints"].as_array_mut().unwrap() {
                if ep["nodeName"] == kp_flows::NODE {
                    ep["conditions"] = serde_json::json!({"ready": ready, "serving": ready, "terminating": !ready});
                }
            }
        }
    })
}

#[test]
#[ignore = "needs root"]
fn health_check_node_ports_follow_local_endpoints() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = Lab::new(5).expect("lab");
    let dir = temp_dir("hcnp");
    let cluster = dir.0.join("cluster.json");
    write_atomically(&cluster, &with_local_endpoint_ready(true));
    let mut proxy = common::spawn_proxy(&lab, &[], &["--manifests", dir.0.to_str().unwrap()]);
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(20))
        .expect("first sync");

    // Service `local` has pod-2 here: 200, one local endpoint, weight 1.
    let mut answer = String::new();
    eventually(
        "the health check port to open",
        Duration::from_secs(5),
        || {
            answer = probe(&lab, 32070);
            status(&answer) == Some(200)
        },
    );
    assert!(answer.contains("\"localEndpoints\": 1"), "{answer}");
    assert!(answer.contains("\"namespace\": \"default\""), "{answer}");
    assert!(answer.contains("\"name\": \"local\""), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("x-load-balancing-endpoint-weight: 1"),
        "{answer}"
    );
    // Service `local-none` has endpoints only on node-b: 503, zero local endpoints.
    let none = probe(&lab, 32071);
    assert_eq!(status(&none), Some(503), "{none}");
    assert!(none.contains("\"localEndpoints\": 0"), "{none}");

    // The local endpoint starts terminating: it is no longer counted, the port answers 503.
    write_atomically(&cluster, &with_local_endpoint_ready(false));
    eventually(
        "503 once pod-2 is terminating",
        Duration::from_secs(5),
        || status(&probe(&lab, 32070)) == Some(503),
    );
    // And back.
    write_atomically(&cluster, &with_local_endpoint_ready(true));
    eventually(
        "200 once pod-2 is ready again",
        Duration::from_secs(5),
        || status(&probe(&lab, 32070)) == Some(200),
    );

    // The Service is deleted: its port closes (no HTTP answer at all); the other one stays.
    let without = edited_fixture(|_| {});
    let mut v: serde_json::Value = serde_json::from_str(&without).unwrap();
    v["items"]
        .as_array_mut()
        .unwrap()
        .retain(|i| !(i["kind"] == "Service" && i["metadata"]["name"] == "local"));
    write_atomically(&cluster, &v.to_string());
    eventually(
        "the port of a deleted Service to close",
        Duration::from_secs(5),
        || status(&probe(&lab, 32070)).is_none(),
    );
    assert_eq!(status(&probe(&lab, 32071)), Some(503));
    proxy.terminate(Duration::from_secs(5)).unwrap();
}
