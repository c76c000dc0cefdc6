//! Synthetic clusters for scale tests and benchmarks.

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::track::Object;
use serde_json::json;

/// The ClusterIP of synthetic Service `i` (10.96.0.0/12 holds a million).
pub fn cluster_ip(i: usize) -> String {
    let n = (10u32 << 24) | (96 << 16) | (i as u32 + 1);
    std::net::Ipv4Addr::from(n).to_string()
}

/// The address of endpoint `j` of synthetic Service `i` (10.128.0.0/9).
pub fn endpoint_ip(i: usize, j: usize, per: usize) -> String {
    let n = (10u32 << 24) | (128 << 16) | ((i * per + j) as u32 + 1);
    std::net::Ipv4Addr::from(n).to_string()
}

/// Synthetic Service `i`: a ClusterIP on TCP 80. Every 10th is a NodePort, every 20th a
/// LoadBalancer with source ranges, every 20th (offset) has ClientIP affinity, and every
/// 7th has a second (UDP) port.
pub fn service(i: usize) -> Service {
    let mut ports =
        vec![json!({"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080})];
    if i % 7 == 3 {
        ports.push(json!({"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 5353}));
    }
    let mut spec = json!({"clusterIP": cluster_ip(i), "ports": ports});
    let mut status = json!({});
    if i % 20 == 5 {
        spec["type"] = json!("LoadBalancer");
        spec["loadBalancerSourceRanges"] = json!(["192.0.2.0/24", "203.0.113.0/26"]);
        status = json!({"loadBalancer": {"ingress": [{"ip": format!("198.51.{}.{}", 100 + (i / 250) % 2, i % 250 + 1)}]}});
    } else if i % 10 == 1 {
        spec["type"] = json!("NodePort");
    }
    if spec["type"] == json!("LoadBalancer") || spec["type"] == json!("NodePort") {
        for (k, p) in spec["ports"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .enumerate()
        {
            p["nodePort"] = json!(30000 + (i * 2 + k) % 2767);
        }
    }
    if i % 20 == 12 {
        spec["sessionAffinity"] = json!("ClientIP");
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc-{i}"), "namespace": "bench"},
        "spec": spec, "status": status,
    }))
    .unwrap_or_else(|e| panic!("synthetic service {i}: {e}"))
}

/// The `k`-th of a stream of one-endpoint changes to `cluster(n, per)`: Service
/// `(k * 7919) % n` gets its endpoint `k % per` replaced by a fresh address from `10.250.0.0/16`.
/// Measurements use it so every mode is timed on the same changes.
pub fn endpoint_change(k: usize, n: usize, per: usize) -> Object {
    let mut slice = slice((k * 7919) % n, per, &[]);
    if let Some(eps) = slice.endpoints.as_mut() {
        eps[k % per].addresses = vec![format!("10.250.{}.{}", k / 250, k % 250 + 1)];
    }
    Object::EndpointSlice(Box::new(slice))
}

/// The EndpointSlice of synthetic Service `i` with endpoints `0..per`, of which `missing`
/// are left out.
pub fn slice(i: usize, per: usize, missing: &[usize]) -> EndpointSlice {
    let endpoints: Vec<_> = (0..per)
        .filter(|j| !missing.contains(j))
        .map(|j| json!({"addresses": [endpoint_ip(i, j, per)], "conditions": {"ready": true}, "nodeName": format!("node-{}", j % 50)}))
        .collect();
    let mut ports = vec![json!({"name": "http", "protocol": "TCP", "port": 8080})];
    if i % 7 == 3 {
        ports.push(json!({"name": "dns", "protocol": "UDP", "port": 5353}));
    }
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc-{i}-abcde"), "namespace": "bench",
            "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
        "addressType": "IPv4", "ports": ports, "endpoints": endpoints,
    }))
    .unwrap_or_else(|e| panic!("synthetic slice {i}: {e}"))
}

/// A cluster of `n` Services with `per` endpoints each.
pub fn cluster(n: usize, per: usize) -> Vec<Object> {
    (0..n)
        .flat_map(|i| {
            [
                Object::Service(Box::new(service(i))),
                Object::EndpointSlice(Box::new(slice(i, per, &[]))),
            ]
        })
        .collect()
}
