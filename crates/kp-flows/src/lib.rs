//! The packet-flow test table: one small cluster and the cases every dataplane mode must pass.
//!
//! The same rows run through each mode's tracer (over the rules it renders) and with real
//! packets in network namespaces. A mode joins by running [`check_tracer`] over its tracer and
//! the real-packet harness over its binary.
//!
//! Addressing plan (all inside test-made namespaces):
//! - node `node-a`: 192.0.2.1/24 towards external clients (TEST-NET-1), 10.244.1.1/24 and
//!   fd00:10:244:1::1/64 towards its pods (pod CIDR 10.244.1.0/24; cluster CIDR 10.244.0.0/16).
//! - pods on node-a: pod-1..pod-4 at 10.244.1.11-14 and fd00:10:244:1::11-14. pod-4 is a client
//!   pod that backs no Service.
//! - a pod on another node: remote-1 at 10.244.2.21 (rows that need it are marked).
//! - external clients: 192.0.2.2 (inside the LoadBalancer source range 192.0.2.0/30) and
//!   192.0.2.5 (outside it).
//! - ClusterIPs in 10.96.0.0/16 and fd00:10:96::/112; external and LoadBalancer IPs in
//!   198.51.100.0/24 (TEST-NET-2).

use std::collections::BTreeSet;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::dataplane::Tracer;
use kp_core::flow::{Origin, Packet, Verdict};
use kp_core::model::Protocol;
use kp_core::track::Object;
use serde_json::{json, Value};

/// This node's name.
pub const NODE: &str = "node-a";
/// The other node's name.
pub const OTHER_NODE: &str = "node-b";
/// The node's address towards external clients.
pub const NODE_IP: &str = "192.0.2.1";
/// The node's address on the pod network.
pub const NODE_POD_GATEWAY: &str = "10.244.1.1";
/// The node's IPv6 address on the pod network.
pub const NODE_POD_GATEWAY_V6: &str = "fd00:10:244:1::1";
/// The cluster's pod network.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// This node's pod network.
pub const POD_CIDR: &str = "10.244.1.0/24";
/// External client inside the LoadBalancer source range.
pub const CLIENT: &str = "192.0.2.2";
/// External client outside the LoadBalancer source range.
pub const CLIENT_OUTSIDE: &str = "192.0.2.5";

/// A pod of the fixture.
#[derive(Clone, Debug)]
pub struct Pod {
    /// Its name (also what its echo server answers with).
    pub name: &'static str,
    /// IPv4 address.
    pub v4: &'static str,
    /// IPv6 address, when it has one.
    pub v6: Option<&'static str>,
    /// The node it runs on.
    pub node: &'static str,
}

/// Every pod of the fixture.
pub fn pods() -> Vec<Pod> {
    let local = |name, v4, v6| Pod {
        name,
        v4,
        v6: Some(v6),
        node: NODE,
    };
    vec![
        local("pod-1", "10.244.1.11", "fd00:10:244:1::11"),
        local("pod-2", "10.244.1.12", "fd00:10:244:1::12"),
        local("pod-3", "10.244.1.13", "fd00:10:244:1::13"),
        local("pod-4", "10.244.1.14", "fd00:10:244:1::14"),
        Pod {
            name: "remote-1",
            v4: "10.244.2.21",
            v6: None,
            node: OTHER_NODE,
        },
    ]
}

fn pod(name: &str) -> Pod {
    pods()
        .into_iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("fixture has no pod {name}"))
}

/// Ports the pods' echo servers listen on.
pub const TCP_PORT: u16 = 8080;
/// UDP port of the pods' echo servers.
pub const UDP_PORT: u16 = 5353;

fn service(name: &str, spec: Value, status: Value) -> Service {
    let v = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
        "status": status,
    });
    serde_json::from_value(v).unwrap_or_else(|e| panic!("fixture service {name}: {e}"))
}

fn slice(
    service: &str,
    family: &str,
    port: (&str, u16),
    eps: &[(&str, bool, bool, bool)],
) -> EndpointSlice {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(name, ready, serving, terminating)| {
            let p = pod(name);
            let addr = if family == "IPv6" {
                p.v6.unwrap_or(p.v4)
            } else {
                p.v4
            };
            json!({
                "addresses": [addr],
                "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                "nodeName": p.node,
            })
        })
        .collect();
    let v = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{service}-{}", family.to_lowercase()),
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": family,
        "ports": [{"name": "", "protocol": port.0, "port": port.1}],
        "endpoints": endpoints,
    });
    serde_json::from_value(v).unwrap_or_else(|e| panic!("fixture slice {service}: {e}"))
}

const READY: bool = true;

fn ready(names: &[&'static str]) -> Vec<(&'static str, bool, bool, bool)> {
    names.iter().map(|n| (*n, READY, READY, false)).collect()
}

/// The cluster's objects: Services, EndpointSlices and this Node.
pub fn objects() -> Vec<Object> {
    let tcp = |port: u16, extra: Value| {
        let mut p = json!({"protocol": "TCP", "port": port, "targetPort": TCP_PORT});
        if let (Some(o), Some(e)) = (p.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        p
    };
    let services = vec![
        service(
            "web",
            json!({"type": "NodePort", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
            "ports": [tcp(80, json!({"nodePort": 30080}))]}),
            json!({}),
        ),
        service(
            "dns",
            json!({"clusterIP": "10.96.0.53",
            "ports": [{"protocol": "UDP", "port": 53, "targetPort": UDP_PORT}]}),
            json!({}),
        ),
        service(
            "empty",
            json!({"clusterIP": "10.96.0.20", "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "sticky",
            json!({"clusterIP": "10.96.0.30", "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
            "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "ext",
            json!({"clusterIP": "10.96.0.40", "externalIPs": ["198.51.100.10"],
            "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "lb",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.50",
            "loadBalancerSourceRanges": ["192.0.2.0/30"],
            "ports": [tcp(80, json!({"nodePort": 30050}))]}),
            json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}]}}),
        ),
        service(
            "hairpin",
            json!({"clusterIP": "10.96.0.60", "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "web6",
            json!({"clusterIP": "fd00:10:96::10", "clusterIPs": ["fd00:10:96::10"],
            "ipFamilies": ["IPv6"], "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "local",
            json!({"type": "NodePort", "clusterIP": "10.96.0.70", "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 32070, "ports": [tcp(80, json!({"nodePort": 30070}))]}),
            json!({}),
        ),
        service(
            "local-none",
            json!({"type": "NodePort", "clusterIP": "10.96.0.71", "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 32071, "ports": [tcp(80, json!({"nodePort": 30071}))]}),
            json!({}),
        ),
    ];
    let slices = vec![
        slice(
            "web",
            "IPv4",
            ("TCP", TCP_PORT),
            &ready(&["pod-1", "pod-2", "pod-3"]),
        ),
        slice(
            "dns",
            "IPv4",
            ("UDP", UDP_PORT),
            &ready(&["pod-1", "pod-2"]),
        ),
        slice(
            "sticky",
            "IPv4",
            ("TCP", TCP_PORT),
            &ready(&["pod-1", "pod-2"]),
        ),
        slice("ext", "IPv4", ("TCP", TCP_PORT), &ready(&["pod-3"])),
        slice("lb", "IPv4", ("TCP", TCP_PORT), &ready(&["pod-1", "pod-2"])),
        slice("hairpin", "IPv4", ("TCP", TCP_PORT), &ready(&["pod-1"])),
        slice(
            "web6",
            "IPv6",
            ("TCP", TCP_PORT),
            &ready(&["pod-1", "pod-2"]),
        ),
        slice(
            "local",
            "IPv4",
            ("TCP", TCP_PORT),
            &ready(&["pod-2", "remote-1"]),
        ),
        slice(
            "local-none",
            "IPv4",
            ("TCP", TCP_PORT),
            &ready(&["remote-1"]),
        ),
    ];
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        "spec": {"podCIDR": POD_CIDR, "podCIDRs": [POD_CIDR]},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}, {"type": "Hostname", "address": NODE}]},
    }))
    .unwrap_or_else(|e| panic!("fixture node: {e}"));
    services
        .into_iter()
        .map(|s| Object::Service(Box::new(s)))
        .chain(
            slices
                .into_iter()
                .map(|s| Object::EndpointSlice(Box::new(s))),
        )
        .chain([Object::Node(Box::new(node))])
        .collect()
}

/// One object as a manifest: its JSON with `apiVersion` and `kind` set, as a file or an API
/// server holds it.
pub fn manifest(object: &Object) -> Value {
    let (api, kind, value) = match object {
        Object::Service(s) => ("v1", "Service", serde_json::to_value(s)),
        Object::EndpointSlice(s) => (
            "discovery.k8s.io/v1",
            "EndpointSlice",
            serde_json::to_value(s),
        ),
        Object::Node(n) => ("v1", "Node", serde_json::to_value(n)),
    };
    let mut v =
        value.unwrap_or_else(|e| panic!("{} {} serialises: {e}", object.kind(), object.key()));
    v["apiVersion"] = json!(api);
    v["kind"] = json!(kind);
    v
}

/// Objects as one JSON `v1 List`, for the manifest-directory source.
pub fn manifest_list_of(objects: &[Object]) -> String {
    let items: Vec<Value> = objects.iter().map(manifest).collect();
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

/// The fixture as one JSON `v1 List`.
pub fn manifest_list() -> String {
    manifest_list_of(&objects())
}

/// What a row expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Answered by one of these pods (every one of them, over enough tries).
    Pods {
        /// Pod names.
        pods: Vec<&'static str>,
        /// The pods' port.
        port: u16,
        /// Whether the pod sees the node's address instead of the client's.
        masquerade: bool,
        /// ClientIP affinity timeout, if the client sticks to one pod.
        affinity: Option<u32>,
    },
    /// Not handled by the proxy at all.
    Untouched,
    /// Silently dropped.
    Drop,
    /// Rejected.
    Reject,
}

/// One row of the table.
#[derive(Clone, Debug)]
pub struct Case {
    /// What the row shows.
    pub name: &'static str,
    /// Where the client sits: `client`, `client-outside`, `node`, or a pod name.
    pub from: &'static str,
    /// The packet.
    pub packet: Packet,
    /// What must happen.
    pub expect: Expect,
    /// The row needs endpoints on a second node (real-packet runs need a two-node lab).
    pub needs_second_node: bool,
}

fn ip(s: &str) -> IpAddr {
    s.parse()
        .unwrap_or_else(|e| panic!("fixture address {s}: {e}"))
}

fn source_of(from: &str, v6: bool) -> (Origin, IpAddr) {
    match from {
        "client" => (Origin::External, ip(CLIENT)),
        "client-outside" => (Origin::External, ip(CLIENT_OUTSIDE)),
        "node" => (Origin::Node, ip(NODE_IP)),
        p => {
            let pod = pod(p);
            (
                Origin::Pod,
                ip(if v6 { pod.v6.unwrap_or(pod.v4) } else { pod.v4 }),
            )
        }
    }
}

fn row(
    name: &'static str,
    from: &'static str,
    proto: Protocol,
    dst: &str,
    dport: u16,
    expect: Expect,
) -> Case {
    let dst = ip(dst);
    let (origin, src) = source_of(from, dst.is_ipv6());
    let needs_second_node =
        matches!(&expect, Expect::Pods { pods, .. } if pods.contains(&"remote-1"));
    Case {
        name,
        from,
        packet: Packet {
            origin,
            src,
            protocol: proto,
            dst,
            dport,
        },
        expect,
        needs_second_node,
    }
}

fn to(pods: &[&'static str], masquerade: bool) -> Expect {
    Expect::Pods {
        pods: pods.to_vec(),
        port: TCP_PORT,
        masquerade,
        affinity: None,
    }
}

/// Every row.
pub fn cases() -> Vec<Case> {
    use Protocol::{Tcp, Udp};
    let web = ["pod-1", "pod-2", "pod-3"];
    let mut v = vec![
        row(
            "pod to ClusterIP spreads over all endpoints, source kept",
            "pod-4",
            Tcp,
            "10.96.0.10",
            80,
            to(&web, false),
        ),
        row(
            "external client to ClusterIP is masqueraded",
            "client",
            Tcp,
            "10.96.0.10",
            80,
            to(&web, true),
        ),
        row(
            "node to ClusterIP is masqueraded",
            "node",
            Tcp,
            "10.96.0.10",
            80,
            to(&web, true),
        ),
        row(
            "NodePort from outside reaches every endpoint, masqueraded",
            "client",
            Tcp,
            NODE_IP,
            30080,
            to(&web, true),
        ),
        row(
            "NodePort from a pod to the node's primary address",
            "pod-4",
            Tcp,
            NODE_IP,
            30080,
            to(&web, true),
        ),
        row(
            "NodePorts answer only on the primary address (nodePortAddresses: primary)",
            "pod-4",
            Tcp,
            NODE_POD_GATEWAY,
            30080,
            Expect::Untouched,
        ),
        row(
            "UDP ClusterIP",
            "pod-4",
            Udp,
            "10.96.0.53",
            53,
            Expect::Pods {
                pods: vec!["pod-1", "pod-2"],
                port: UDP_PORT,
                masquerade: false,
                affinity: None,
            },
        ),
        row(
            "a Service without endpoints rejects",
            "pod-4",
            Tcp,
            "10.96.0.20",
            80,
            Expect::Reject,
        ),
        row(
            "a NodePort-less port of a ClusterIP is not ours",
            "pod-4",
            Tcp,
            "10.96.0.10",
            81,
            Expect::Untouched,
        ),
        row(
            "ClientIP affinity sticks with its timeout",
            "pod-4",
            Tcp,
            "10.96.0.30",
            80,
            Expect::Pods {
                pods: vec!["pod-1", "pod-2"],
                port: TCP_PORT,
                masquerade: false,
                affinity: Some(60),
            },
        ),
        row(
            "ExternalIP from outside is masqueraded",
            "client",
            Tcp,
            "198.51.100.10",
            80,
            to(&["pod-3"], true),
        ),
        row(
            "LoadBalancer IP from inside the source ranges is served",
            "client",
            Tcp,
            "198.51.100.20",
            80,
            to(&["pod-1", "pod-2"], true),
        ),
        row(
            "LoadBalancer IP from outside the source ranges drops",
            "client-outside",
            Tcp,
            "198.51.100.20",
            80,
            Expect::Drop,
        ),
        row(
            "LoadBalancer NodePort is not subject to source ranges",
            "client-outside",
            Tcp,
            NODE_IP,
            30050,
            to(&["pod-1", "pod-2"], true),
        ),
        row(
            "hairpin: a pod reaching itself through its Service is masqueraded",
            "pod-1",
            Tcp,
            "10.96.0.60",
            80,
            to(&["pod-1"], true),
        ),
        row(
            "another pod reaching the same Service keeps its source",
            "pod-4",
            Tcp,
            "10.96.0.60",
            80,
            to(&["pod-1"], false),
        ),
        row(
            "IPv6 ClusterIP",
            "pod-4",
            Tcp,
            "fd00:10:96::10",
            80,
            to(&["pod-1", "pod-2"], false),
        ),
        row(
            "externalTrafficPolicy Local: NodePort uses local endpoints and keeps the source",
            "client",
            Tcp,
            NODE_IP,
            30070,
            to(&["pod-2"], false),
        ),
        row(
            "externalTrafficPolicy Local: pods short-circuit to every endpoint",
            "pod-4",
            Tcp,
            NODE_IP,
            30070,
            to(&["pod-2", "remote-1"], false),
        ),
        row(
            "externalTrafficPolicy Local: the node short-circuits too, masqueraded",
            "node",
            Tcp,
            NODE_IP,
            30070,
            to(&["pod-2", "remote-1"], true),
        ),
        row(
            "externalTrafficPolicy Local without local endpoints drops external traffic",
            "client",
            Tcp,
            NODE_IP,
            30071,
            Expect::Drop,
        ),
        row(
            "externalTrafficPolicy Local without local endpoints still serves pods",
            "pod-4",
            Tcp,
            NODE_IP,
            30071,
            to(&["remote-1"], false),
        ),
        row(
            "ClusterIP of an externalTrafficPolicy Local Service uses every endpoint",
            "pod-4",
            Tcp,
            "10.96.0.70",
            80,
            to(&["pod-2", "remote-1"], false),
        ),
    ];
    v.retain(|c| !c.name.is_empty());
    v
}

/// The verdict a row expects, in tracer terms.
pub fn expected_verdict(case: &Case) -> Verdict {
    match &case.expect {
        Expect::Pods {
            pods: names,
            port,
            masquerade,
            affinity,
        } => {
            let v6 = case.packet.dst.is_ipv6();
            let endpoints: BTreeSet<(IpAddr, u16)> = names
                .iter()
                .map(|n| {
                    let p = pod(n);
                    (ip(if v6 { p.v6.unwrap_or(p.v4) } else { p.v4 }), *port)
                })
                .collect();
            Verdict::Dnat {
                endpoints,
                masquerade: *masquerade,
                affinity: *affinity,
            }
        }
        Expect::Untouched => Verdict::Untouched,
        Expect::Drop => Verdict::Drop,
        Expect::Reject => Verdict::Reject,
    }
}

/// The node's own addresses, for tracers (`fib daddr type local`).
pub fn node_addresses() -> Vec<IpAddr> {
    vec![ip(NODE_IP), ip(NODE_POD_GATEWAY), ip(NODE_POD_GATEWAY_V6)]
}

/// Runs every row through `tracer`; returns one message per failing row.
pub fn check_tracer(tracer: &impl Tracer) -> Vec<String> {
    cases()
        .iter()
        .filter_map(|case| {
            let want = expected_verdict(case);
            let got = tracer.trace(&case.packet);
            (got != want).then(|| {
                format!(
                    "{}: {}\n    want {want:?}\n    got  {got:?}",
                    case.name, case.packet
                )
            })
        })
        .collect()
}

/// Synthetic clusters for scale tests and benchmarks.
pub mod synthetic {
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
}

/// `objects` loaded into a [`kp_core::track::ProxyState`] for node `node`, with every initial
/// list complete and no changes pending.
pub fn load(node: &str, objects: Vec<Object>) -> kp_core::track::ProxyState {
    use kp_core::track::{Kind, ProxyState, SourceEvent};
    let mut s = ProxyState::new(node);
    for o in objects {
        if let Err(e) = s.apply(SourceEvent::Upsert(o)) {
            panic!("fixture object rejected: {e}");
        }
    }
    for k in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        let _ = s.apply(SourceEvent::Synced(k));
    }
    s.take_changes();
    s
}

/// The fixture loaded for this node (see [`load`]).
pub fn state() -> kp_core::track::ProxyState {
    load(NODE, objects())
}

/// The fixture's `web` EndpointSlice with only the named pods.
pub fn web_slice(pods: &[&'static str]) -> EndpointSlice {
    slice("web", "IPv4", ("TCP", TCP_PORT), &ready(pods))
}
