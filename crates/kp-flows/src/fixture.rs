//! The fixture cluster: its pods, Services, EndpointSlices and this Node, as the API holds them.
//!
//! Each Service exists for one or two rows of the [table](crate::table); the comment above it
//! says which feature it shows. ClusterIPs are 10.96.0.x, and a Service's NodePort, when it has
//! one, is 30000 + x where that is free.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kp_core::flow::Ingress;
use kp_core::node::{DetectLocal, InterfaceName, NodeContext, NodePortAddresses};
use kp_core::track::{Kind, Object, ProxyState, SourceEvent};
use serde_json::{json, Value};

use crate::{
    CLUSTER_CIDR, CLUSTER_CIDR6, NODE, NODE_IP, NODE_IP6, OTHER_NODE, POD_CIDR, POD_CIDR6,
    SCTP_PORT, SERVICE_CIDR, SERVICE_CIDR6, TCP_PORT, UDP_PORT, ZONE,
};

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
    let on = |node, name, v4, v6| Pod {
        name,
        v4,
        v6: Some(v6),
        node,
    };
    vec![
        on(NODE, "pod-1", "10.244.1.11", "fd00:10:244:1::11"),
        on(NODE, "pod-2", "10.244.1.12", "fd00:10:244:1::12"),
        on(NODE, "pod-3", "10.244.1.13", "fd00:10:244:1::13"),
        on(NODE, "pod-4", "10.244.1.14", "fd00:10:244:1::14"),
        on(OTHER_NODE, "remote-1", "10.244.2.21", "fd00:10:244:2::21"),
    ]
}

/// The fixture pod called `name`; panics if there is none (a typo in the table).
pub(crate) fn pod(name: &str) -> Pod {
    pods()
        .into_iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("fixture has no pod {name}"))
}

fn service(name: &str, spec: Value, status: Value) -> Service {
    service_with(name, json!({}), spec, status)
}

fn service_with(name: &str, annotations: Value, spec: Value, status: Value) -> Service {
    let v = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "annotations": annotations},
        "spec": spec,
        "status": status,
    });
    serde_json::from_value(v).unwrap_or_else(|e| panic!("fixture service {name}: {e}"))
}

/// One endpoint of a fixture slice: a pod and its conditions.
#[derive(Clone, Copy, Debug)]
struct Ep {
    pod: &'static str,
    ready: bool,
    serving: bool,
    terminating: bool,
    /// `hints.forZones`, if any.
    zones: Option<&'static [&'static str]>,
}

fn ready(names: &[&'static str]) -> Vec<Ep> {
    names
        .iter()
        .map(|&pod| Ep {
            pod,
            ready: true,
            serving: true,
            terminating: false,
            zones: None,
        })
        .collect()
}

/// A pod being deleted that still passes its readiness probe: not ready, serving, terminating.
fn serving_terminating(pod: &'static str) -> Ep {
    Ep {
        ready: false,
        serving: true,
        terminating: true,
        ..ready(&[pod])[0]
    }
}

/// A pod being deleted that no longer passes its readiness probe.
fn terminating_not_serving(pod: &'static str) -> Ep {
    Ep {
        serving: false,
        ..serving_terminating(pod)
    }
}

/// A running pod that fails its readiness probe.
fn not_ready(pod: &'static str) -> Ep {
    Ep {
        ready: false,
        serving: false,
        ..ready(&[pod])[0]
    }
}

/// A ready pod with zone hints.
fn hinted(pod: &'static str, zones: &'static [&'static str]) -> Ep {
    Ep {
        zones: Some(zones),
        ..ready(&[pod])[0]
    }
}

fn slice(service: &str, family: &str, port: (&str, u16), eps: &[Ep]) -> EndpointSlice {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|ep| {
            let p = pod(ep.pod);
            let addr = if family == "IPv6" {
                p.v6.unwrap_or_else(|| panic!("fixture pod {} has no IPv6 address", p.name))
            } else {
                p.v4
            };
            let mut e = json!({
                "addresses": [addr],
                "conditions": {"ready": ep.ready, "serving": ep.serving, "terminating": ep.terminating},
                "nodeName": p.node,
            });
            if let Some(zones) = ep.zones {
                let zones: Vec<Value> = zones.iter().map(|z| json!({"name": z})).collect();
                e["hints"] = json!({"forZones": zones});
            }
            e
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

/// A TCP Service port `port` → the echo servers' TCP port, with extra fields.
fn tcp(port: u16, extra: Value) -> Value {
    let mut p = json!({"protocol": "TCP", "port": port, "targetPort": TCP_PORT});
    if let (Some(o), Some(e)) = (p.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    p
}

fn tcp4(service: &str, eps: &[Ep]) -> EndpointSlice {
    slice(service, "IPv4", ("TCP", TCP_PORT), eps)
}

fn tcp6(service: &str, eps: &[Ep]) -> EndpointSlice {
    slice(service, "IPv6", ("TCP", TCP_PORT), eps)
}

/// The annotation that turns topology-aware routing on. Upstream 1.27-1.30 also required it
/// before using hints; later releases use hints whenever every endpoint has them. The fixture
/// sets it on the topology Services so both readings agree.
fn topology_auto() -> Value {
    json!({"service.kubernetes.io/topology-mode": "Auto"})
}

fn services() -> Vec<Service> {
    vec![
        // Plain ClusterIP + NodePort, three local endpoints.
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
        // UDP without endpoints: rejected with an ICMP port unreachable.
        service(
            "dns-empty",
            json!({"clusterIP": "10.96.0.54",
            "ports": [{"protocol": "UDP", "port": 53, "targetPort": UDP_PORT}]}),
            json!({}),
        ),
        service(
            "sctp",
            json!({"clusterIP": "10.96.0.132",
            "ports": [{"protocol": "SCTP", "port": SCTP_PORT, "targetPort": SCTP_PORT}]}),
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
        // Single-stack IPv6.
        service(
            "web6",
            json!({"clusterIP": "fd00:10:96::10", "clusterIPs": ["fd00:10:96::10"],
            "ipFamilies": ["IPv6"], "ipFamilyPolicy": "SingleStack",
            "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        // Dual-stack, with a NodePort on both families' primary addresses.
        service(
            "dual",
            json!({"type": "NodePort", "clusterIP": "10.96.0.120",
            "clusterIPs": ["10.96.0.120", "fd00:10:96::120"],
            "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack",
            "ports": [tcp(80, json!({"nodePort": 30120}))]}),
            json!({}),
        ),
        // Dual-stack with IPv4 endpoints only: each family decides on its own endpoints.
        service(
            "dual-v4-only",
            json!({"clusterIP": "10.96.0.121", "clusterIPs": ["10.96.0.121", "fd00:10:96::121"],
            "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack",
            "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        // externalTrafficPolicy: Local, with a local and a remote endpoint.
        service(
            "local",
            json!({"type": "NodePort", "clusterIP": "10.96.0.70", "externalTrafficPolicy": "Local",
            "externalIPs": ["198.51.100.70"],
            "healthCheckNodePort": 32070, "ports": [tcp(80, json!({"nodePort": 30070}))]}),
            json!({}),
        ),
        service(
            "local-none",
            json!({"type": "NodePort", "clusterIP": "10.96.0.71", "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 32071, "ports": [tcp(80, json!({"nodePort": 30071}))]}),
            json!({}),
        ),
        // internalTrafficPolicy: Local.
        service(
            "itp-local",
            json!({"clusterIP": "10.96.0.85", "internalTrafficPolicy": "Local",
            "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "itp-local-none",
            json!({"clusterIP": "10.96.0.86", "internalTrafficPolicy": "Local",
            "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        // Terminating endpoints.
        service(
            "terminating",
            json!({"clusterIP": "10.96.0.90", "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "terminating-with-ready",
            json!({"clusterIP": "10.96.0.91", "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service(
            "local-terminating",
            json!({"type": "NodePort", "clusterIP": "10.96.0.92", "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 32092, "ports": [tcp(80, json!({"nodePort": 30092}))]}),
            json!({}),
        ),
        // Topology hints.
        service_with(
            "topology",
            topology_auto(),
            json!({"clusterIP": "10.96.0.100", "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service_with(
            "topology-partial",
            topology_auto(),
            json!({"clusterIP": "10.96.0.101", "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        service_with(
            "topology-elsewhere",
            topology_auto(),
            json!({"clusterIP": "10.96.0.102", "ports": [tcp(80, json!({}))]}),
            json!({}),
        ),
        // Every endpoint on the other node.
        service(
            "remote",
            json!({"type": "NodePort", "clusterIP": "10.96.0.110",
            "ports": [tcp(80, json!({"nodePort": 30110}))]}),
            json!({}),
        ),
    ]
}

fn slices() -> Vec<EndpointSlice> {
    vec![
        tcp4("web", &ready(&["pod-1", "pod-2", "pod-3"])),
        slice(
            "dns",
            "IPv4",
            ("UDP", UDP_PORT),
            &ready(&["pod-1", "pod-2"]),
        ),
        slice(
            "sctp",
            "IPv4",
            ("SCTP", SCTP_PORT),
            &ready(&["pod-1", "pod-2"]),
        ),
        tcp4("sticky", &ready(&["pod-1", "pod-2"])),
        tcp4("ext", &ready(&["pod-3"])),
        tcp4("lb", &ready(&["pod-1", "pod-2"])),
        tcp4("hairpin", &ready(&["pod-1"])),
        tcp6("web6", &ready(&["pod-1", "pod-2"])),
        tcp4("dual", &ready(&["pod-1", "pod-2"])),
        tcp6("dual", &ready(&["pod-2", "remote-1"])),
        tcp4("dual-v4-only", &ready(&["pod-1"])),
        tcp4("local", &ready(&["pod-2", "remote-1"])),
        tcp4("local-none", &ready(&["remote-1"])),
        tcp4("itp-local", &ready(&["pod-3", "remote-1"])),
        tcp4("itp-local-none", &ready(&["remote-1"])),
        tcp4(
            "terminating",
            &[
                serving_terminating("pod-1"),
                terminating_not_serving("pod-2"),
                not_ready("pod-3"),
            ],
        ),
        tcp4(
            "terminating-with-ready",
            &[serving_terminating("pod-1"), ready(&["pod-3"])[0]],
        ),
        tcp4(
            "local-terminating",
            &[serving_terminating("pod-2"), ready(&["remote-1"])[0]],
        ),
        tcp4(
            "topology",
            &[
                hinted("pod-1", &[ZONE]),
                hinted("pod-2", &[ZONE, "zone-b"]),
                hinted("pod-3", &["zone-b"]),
                hinted("remote-1", &["zone-b"]),
            ],
        ),
        tcp4(
            "topology-partial",
            &[
                hinted("pod-1", &[ZONE]),
                hinted("pod-2", &["zone-b"]),
                ready(&["pod-3"])[0],
            ],
        ),
        tcp4(
            "topology-elsewhere",
            &[hinted("pod-1", &["zone-b"]), hinted("pod-2", &["zone-c"])],
        ),
        tcp4("remote", &ready(&["remote-1"])),
    ]
}

fn node() -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": ZONE}},
        "spec": {"podCIDR": POD_CIDR, "podCIDRs": [POD_CIDR, POD_CIDR6]},
        "status": {"addresses": [
            {"type": "InternalIP", "address": NODE_IP},
            {"type": "InternalIP", "address": NODE_IP6},
            {"type": "Hostname", "address": NODE},
        ]},
    }))
    .unwrap_or_else(|e| panic!("fixture node: {e}"))
}

/// The cluster's Service CIDRs, as the API server's default ServiceCIDR object holds them.
fn service_cidr() -> ServiceCIDR {
    serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": [SERVICE_CIDR, SERVICE_CIDR6]},
    }))
    .unwrap_or_else(|e| panic!("fixture ServiceCIDR: {e}"))
}

/// The cluster's objects: Services, EndpointSlices, this Node and the ServiceCIDR.
pub fn objects() -> Vec<Object> {
    services()
        .into_iter()
        .map(|s| Object::Service(Box::new(s)))
        .chain(
            slices()
                .into_iter()
                .map(|s| Object::EndpointSlice(Box::new(s))),
        )
        .chain([
            Object::Node(Box::new(node())),
            Object::ServiceCidr(Box::new(service_cidr())),
        ])
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
        Object::ServiceCidr(c) => (
            "networking.k8s.io/v1",
            "ServiceCIDR",
            serde_json::to_value(c),
        ),
        Object::Endpoints(e) => ("v1", "Endpoints", serde_json::to_value(e)),
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

/// `objects` loaded into a [`ProxyState`] for node `node`, with every initial list complete and
/// no changes pending. Panics if an object is rejected: a fixture must be valid.
pub fn load(node: &str, objects: Vec<Object>) -> ProxyState {
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
pub fn state() -> ProxyState {
    load(NODE, objects())
}

/// The node settings every mode runs the table with: detect-local by the cluster CIDRs of both
/// families, and `nodePortAddresses: primary` resolved against the fixture's Node (192.0.2.1
/// and 2001:db8::1). Localhost NodePorts are off: `primary` never includes 127.0.0.1.
pub fn node_context() -> NodeContext {
    node_context_with(&DetectLocal::ClusterCidr(vec![
        cidr(CLUSTER_CIDR),
        cidr(CLUSTER_CIDR6),
    ]))
}

fn cidr<T: std::str::FromStr>(s: &str) -> T
where
    T::Err: std::fmt::Display,
{
    s.parse()
        .unwrap_or_else(|e| panic!("fixture CIDR {s}: {e}"))
}

/// [`node_context`] with another detect-local.
pub fn node_context_with(detect_local: &DetectLocal) -> NodeContext {
    NodeContext::resolve(detect_local, &NodePortAddresses::Primary, &state())
}

/// The prefix of the node's pod-side interfaces in the lab (`vethI` for pod I; see
/// `kp_test::lab`).
pub const POD_VETH_PREFIX: &str = "veth";
/// The bridge of [`ingress_bridged`]'s node.
pub const POD_BRIDGE: &str = "cbr0";

/// The node's links as the lab builds them, for tracers of detect-local by interface: pod I of
/// this node behind `vethI` (routed point-to-point, as kindnet and the `ptp` plugin do), the
/// other node's network behind `eth1`, and everything else (external clients) behind `eth0`.
pub fn ingress() -> Ingress {
    let mut links = uplinks();
    for p in pods().into_iter().filter(|p| p.node == NODE) {
        let veth = format!("{POD_VETH_PREFIX}{}", pod_index(p.name));
        links = links.route(cidr(&format!("{}/32", p.v4)), &veth);
        if let Some(v6) = p.v6 {
            links = links.route(cidr(&format!("{v6}/128")), &veth);
        }
    }
    links
}

/// The node's links when its pods hang off one bridge, [`POD_BRIDGE`] (the CNI `bridge`
/// plugin, kubenet's `cbr0`): this node's pod CIDRs behind it, the rest as in [`ingress`].
pub fn ingress_bridged() -> Ingress {
    [POD_CIDR, POD_CIDR6]
        .into_iter()
        .fold(uplinks(), |l, net| l.route(cidr(net), POD_BRIDGE))
}

/// External clients behind `eth0`, the other node and its pods behind `eth1`.
fn uplinks() -> Ingress {
    let mut links = Ingress::new()
        .route(cidr("0.0.0.0/0"), "eth0")
        .route(cidr("::/0"), "eth0");
    for net in [
        "10.244.2.0/24",
        "fd00:10:244:2::/64",
        "198.18.0.0/24",
        "2001:db8:1::/64",
    ] {
        links = links.route(cidr(net), "eth1");
    }
    links
}

/// Detect-local by interface, each form with the links it is run with: `InterfaceNamePrefix`
/// `veth` over [`ingress`], and `BridgeInterface` `cbr0` over [`ingress_bridged`]. Every row of
/// the table expects the same with either as with the cluster CIDRs: the table's pods are on
/// this node, and its other clients arrive on `eth0` or from the node itself.
pub fn interface_detect_locals() -> Vec<(DetectLocal, Ingress)> {
    let name = |s: &str| InterfaceName::new(s).expect("fixture interface name");
    vec![
        (
            DetectLocal::InterfaceNamePrefix(name(POD_VETH_PREFIX)),
            ingress(),
        ),
        (
            DetectLocal::BridgeInterface(name(POD_BRIDGE)),
            ingress_bridged(),
        ),
    ]
}

/// The digits that end a fixture pod's name (`pod-3` → 3), which number its veth.
fn pod_index(name: &str) -> u32 {
    name.rsplit('-')
        .next()
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("fixture pod {name} has no number"))
}

/// The fixture's `web` EndpointSlice with only the named pods.
pub fn web_slice(pods: &[&'static str]) -> EndpointSlice {
    tcp4("web", &ready(pods))
}

/// The fixture's `sticky` EndpointSlice (the ClientIP affinity Service) with only the named
/// pods.
pub fn sticky_slice(pods: &[&'static str]) -> EndpointSlice {
    tcp4("sticky", &ready(pods))
}
