//! Random clusters for the tests that prove every rendered rule loads: Services of one family
//! or both, with ClusterIPs in two unrelated Service ranges per family, every Service type,
//! TCP/UDP/SCTP ports, external IPs, LoadBalancer IPs with source ranges (including the whole
//! address space), ClientIP affinity, Local traffic policies, and endpoints on this node and
//! another, ready, serving or terminating; and the node settings and planner configurations
//! they run under.

#![allow(dead_code)]

use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Object, ProxyState};
use kp_iptables_plan::{PlanConfig, Planner};
use proptest::prelude::*;
use serde_json::{json, Value};

/// Addresses a Service may list as external or LoadBalancer IPs.
const PUBLIC_IPS: [&str; 6] = [
    "198.51.100.10",
    "198.51.100.200",
    "203.0.113.7",
    "2001:db8:100::10",
    "2001:db8:100::200",
    "2001:db8:200::7",
];

/// `loadBalancerSourceRanges` a Service may list: the whole space of each family among them.
const SOURCE_RANGES: [&str; 7] = [
    "192.0.2.0/24",
    "203.0.113.0/26",
    "0.0.0.0/0",
    "10.0.0.0/8",
    "2001:db8::/64",
    "::/0",
    "2001:db8:100::7/128",
];

/// One endpoint: which pod address (`0..8`), whether on this node, and its conditions.
#[derive(Clone, Debug)]
pub struct GenEndpoint {
    pod: u8,
    local: bool,
    ready: bool,
    serving: bool,
    terminating: bool,
}

/// One Service port: protocol (`0..3`: TCP, UDP, SCTP), port, target port.
#[derive(Clone, Debug)]
pub struct GenPort {
    protocol: u8,
    port: u16,
    target: u16,
}

/// One random Service.
#[derive(Clone, Debug)]
pub struct GenService {
    /// IPv4 ClusterIP: in the second range (192.168.50.0/24) rather than 10.96.0.0/16.
    v4: Option<bool>,
    /// IPv6 ClusterIP: in the second range (2001:db8:50::/112) rather than fd00:10:96::/112.
    v6: Option<bool>,
    /// 0 ClusterIP, 1 NodePort, 2 LoadBalancer.
    kind: u8,
    ports: Vec<GenPort>,
    external_ips: Vec<usize>,
    lb_ips: Vec<usize>,
    source_ranges: Vec<usize>,
    affinity: Option<u32>,
    external_local: bool,
    internal_local: bool,
    endpoints: Vec<GenEndpoint>,
}

fn endpoint() -> impl Strategy<Value = GenEndpoint> {
    (
        0u8..8,
        any::<bool>(),
        prop::bool::weighted(0.8),
        any::<bool>(),
        prop::bool::weighted(0.2),
    )
        .prop_map(|(pod, local, ready, serving, terminating)| GenEndpoint {
            pod,
            local,
            ready,
            serving: serving || ready,
            terminating,
        })
}

fn port() -> impl Strategy<Value = GenPort> {
    (0u8..3, 1u16..=65535, 1u16..=65535).prop_map(|(protocol, port, target)| GenPort {
        protocol,
        port,
        target,
    })
}

/// A random Service (its name and addresses come from its place in the cluster).
pub fn service() -> impl Strategy<Value = GenService> {
    let families = prop_oneof![
        any::<bool>().prop_map(|b| (Some(b), None)),
        any::<bool>().prop_map(|b| (None, Some(b))),
        (any::<bool>(), any::<bool>()).prop_map(|(a, b)| (Some(a), Some(b))),
    ];
    (
        families,
        0u8..3,
        prop::collection::vec(port(), 1..=3),
        prop::collection::vec(0..PUBLIC_IPS.len(), 0..=2),
        prop::collection::vec(0..PUBLIC_IPS.len(), 0..=2),
        prop::collection::vec(0..SOURCE_RANGES.len(), 0..=3),
        prop::option::weighted(0.3, prop_oneof![Just(1u32), 2u32..=86400, Just(86400u32)]),
        (any::<bool>(), any::<bool>()),
        prop::collection::vec(endpoint(), 0..=5),
    )
        .prop_map(
            |(
                (v4, v6),
                kind,
                mut ports,
                external_ips,
                lb_ips,
                source_ranges,
                affinity,
                (external_local, internal_local),
                endpoints,
            )| {
                // The API server refuses a Service listing one port number and protocol
                // twice, and so does kp-core: such a port is left out.
                let mut seen = std::collections::HashSet::new();
                ports.retain(|p: &GenPort| seen.insert((p.protocol, p.port)));
                GenService {
                    v4,
                    v6,
                    kind,
                    ports,
                    external_ips,
                    lb_ips,
                    source_ranges,
                    affinity,
                    external_local,
                    internal_local,
                    endpoints,
                }
            },
        )
}

/// Node settings and planner configuration: detect-local, `nodePortAddresses`,
/// `masqueradeAll`, localhost NodePorts, the mark bit.
#[derive(Clone, Debug)]
pub struct GenSetup {
    /// 0 none, 1 the cluster CIDRs, 2 the node's pod CIDRs, 3 every address, 4 the bridge
    /// `cbr0`, 5 the interface prefix `veth`, 6 a prefix as long as a name (15 bytes).
    detect_local: u8,
    /// 0 every local address, 1 the primary addresses, 2 CIDRs (with loopback), 3 zero CIDRs.
    node_ports: u8,
    masquerade_all: bool,
    localhost_node_ports: bool,
    masquerade_bit: u32,
}

/// Random node settings and planner configuration.
pub fn setup() -> impl Strategy<Value = GenSetup> {
    (0u8..7, 0u8..4, any::<bool>(), any::<bool>(), 0u32..32).prop_map(
        |(detect_local, node_ports, masquerade_all, localhost_node_ports, masquerade_bit)| {
            GenSetup {
                detect_local,
                node_ports,
                masquerade_all,
                localhost_node_ports,
                masquerade_bit,
            }
        },
    )
}

impl GenSetup {
    /// The planner configuration for `family`.
    pub fn config(&self, family: IpFamily) -> PlanConfig {
        let mut cfg = PlanConfig::new(family);
        cfg.masquerade_all = self.masquerade_all;
        cfg.localhost_node_ports = self.localhost_node_ports;
        cfg.masquerade_bit = self.masquerade_bit;
        cfg
    }

    /// The node context, resolved against `state`'s Node.
    pub fn node(&self, state: &ProxyState) -> NodeContext {
        let cidr = |s: &str| s.parse().unwrap();
        let detect = match self.detect_local {
            0 => DetectLocal::None,
            1 => DetectLocal::ClusterCidr(vec![
                cidr(kp_flows::CLUSTER_CIDR),
                cidr(kp_flows::CLUSTER_CIDR6),
            ]),
            2 => DetectLocal::NodeCidr,
            3 => DetectLocal::ClusterCidr(vec![cidr("0.0.0.0/0"), cidr("::/0")]),
            n => {
                let name = match n {
                    4 => "cbr0",
                    5 => "veth",
                    _ => "abcdefghijklmno",
                };
                let name = kp_core::node::InterfaceName::new(name).unwrap();
                if n == 4 {
                    DetectLocal::BridgeInterface(name)
                } else {
                    DetectLocal::InterfaceNamePrefix(name)
                }
            }
        };
        let ports = match self.node_ports {
            0 => NodePortAddresses::AllLocal,
            1 => NodePortAddresses::Primary,
            2 => NodePortAddresses::Cidrs(vec![
                cidr("192.0.2.0/24"),
                cidr("127.0.0.1/32"),
                cidr("2001:db8::/64"),
            ]),
            _ => NodePortAddresses::Cidrs(vec![cidr("0.0.0.0/0"), cidr("::/0")]),
        };
        NodeContext::resolve(&detect, &ports, state)
    }
}

fn cluster_ip(i: usize, family: IpFamily, second: bool) -> String {
    match (family, second) {
        // Apart from the flow fixture's 10.96.0.0/24 and fd00:10:96::/112's first addresses.
        (IpFamily::V4, false) => format!("10.96.{}.{}", 1 + i / 250, i % 250 + 1),
        (IpFamily::V4, true) => format!("192.168.50.{}", i % 250 + 1),
        (IpFamily::V6, false) => format!("fd00:10:96::1:{:x}", i + 1),
        (IpFamily::V6, true) => format!("2001:db8:50::{:x}", i + 1),
    }
}

fn pod_ip(e: &GenEndpoint, family: IpFamily) -> String {
    let node = if e.local { 1 } else { 2 };
    match family {
        IpFamily::V4 => format!("10.244.{node}.{}", 40 + e.pod),
        IpFamily::V6 => format!("fd00:10:244:{node}::{:x}", 0x40 + e.pod),
    }
}

const PROTOCOLS: [&str; 3] = ["TCP", "UDP", "SCTP"];

impl GenService {
    /// Service `i` of a cluster (`gen/svc-i`) and its EndpointSlices.
    pub fn objects(&self, i: usize) -> Vec<Object> {
        let name = format!("svc-{i}");
        let mut families = Vec::new();
        let mut ips = Vec::new();
        if let Some(second) = self.v4 {
            families.push("IPv4");
            ips.push(cluster_ip(i, IpFamily::V4, second));
        }
        if let Some(second) = self.v6 {
            families.push("IPv6");
            ips.push(cluster_ip(i, IpFamily::V6, second));
        }
        let kind = ["ClusterIP", "NodePort", "LoadBalancer"][self.kind as usize];
        let ports: Vec<Value> = self
            .ports
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let mut v = json!({"name": format!("p{k}"), "protocol": PROTOCOLS[p.protocol as usize],
                    "port": p.port, "targetPort": p.target});
                if self.kind > 0 {
                    v["nodePort"] = json!(30000 + (i * 3 + k) % 2767);
                }
                v
            })
            .collect();
        let mut spec = json!({
            "type": kind, "clusterIP": ips[0], "clusterIPs": ips, "ipFamilies": families,
            "ipFamilyPolicy": if families.len() == 2 { "RequireDualStack" } else { "SingleStack" },
            "ports": ports,
            "externalIPs": self.external_ips.iter().map(|k| PUBLIC_IPS[*k]).collect::<Vec<_>>(),
        });
        if self.internal_local {
            spec["internalTrafficPolicy"] = json!("Local");
        }
        if self.kind > 0 && self.external_local {
            spec["externalTrafficPolicy"] = json!("Local");
            spec["healthCheckNodePort"] = json!(32000 + i % 767);
        }
        if let Some(t) = self.affinity {
            spec["sessionAffinity"] = json!("ClientIP");
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
        }
        let mut status = json!({});
        if self.kind == 2 {
            spec["loadBalancerSourceRanges"] = json!(self
                .source_ranges
                .iter()
                .map(|k| SOURCE_RANGES[*k])
                .collect::<Vec<_>>());
            let ingress: Vec<Value> = self
                .lb_ips
                .iter()
                .map(|k| json!({"ip": PUBLIC_IPS[*k]}))
                .collect();
            status = json!({"loadBalancer": {"ingress": ingress}});
        }
        let svc = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "gen"},
            "spec": spec, "status": status,
        });
        let mut out = vec![Object::Service(Box::new(
            serde_json::from_value(svc).unwrap_or_else(|e| panic!("{name}: {e}")),
        ))];
        for (family, label) in [(IpFamily::V4, "IPv4"), (IpFamily::V6, "IPv6")] {
            let mut seen = std::collections::BTreeSet::new();
            let endpoints: Vec<Value> = self
                .endpoints
                .iter()
                .filter(|e| seen.insert((e.pod, e.local)))
                .map(|e| {
                    json!({"addresses": [pod_ip(e, family)],
                        "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
                        "nodeName": if e.local { kp_flows::NODE } else { kp_flows::OTHER_NODE }})
                })
                .collect();
            let ports: Vec<Value> = self
                .ports
                .iter()
                .enumerate()
                .map(|(k, p)| json!({"name": format!("p{k}"), "protocol": PROTOCOLS[p.protocol as usize], "port": p.target}))
                .collect();
            let slice = json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-{}", label.to_lowercase()), "namespace": "gen",
                    "labels": {"kubernetes.io/service-name": name}},
                "addressType": label, "ports": ports, "endpoints": endpoints,
            });
            out.push(Object::EndpointSlice(Box::new(
                serde_json::from_value(slice).unwrap_or_else(|e| panic!("{name} slice: {e}")),
            )));
        }
        out
    }
}

/// The objects of a cluster of `services` (Service `i` is `gen/svc-i`), with the flow fixture's
/// Node, and with every object of the fixture if `with_fixture` (its Services show every
/// feature; its ServiceCIDR covers 10.96.0.0/16 and fd00:10:96::/112).
pub fn objects(services: &[GenService], with_fixture: bool) -> Vec<Object> {
    let mut out: Vec<Object> = kp_flows::objects()
        .into_iter()
        .filter(|o| with_fixture || matches!(o, Object::Node(_)))
        .collect();
    for (i, s) in services.iter().enumerate() {
        out.extend(s.objects(i));
    }
    out
}

/// The applier's jumps from the built-in chains, as `-I` lines (each inserted first in turn,
/// as upstream does), as one restore input.
pub fn jumps(p: &Planner) -> String {
    let mut out = String::new();
    for table in ["filter", "nat"] {
        out.push_str(&format!("*{table}\n"));
        for j in p.jump_rules().iter().filter(|j| j.table == table) {
            out.push_str(&format!("-I {} {}\n", j.chain, j.args));
        }
        out.push_str("COMMIT\n");
    }
    out
}
