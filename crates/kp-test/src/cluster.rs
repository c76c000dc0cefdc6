//! The benchmark's cluster, the one object generator of the repository: N Services × E
//! endpoints with a realistic mix of Service kinds, the Node the proxy runs as, the one Service
//! the data-path measurement connects through, and a stream of single-endpoint changes. kp-bench
//! measures with it (`kp_bench::cluster` re-exports it, with the mix it reports and the typed
//! objects it feeds the in-process dataplanes); [`crate::kube_apiserver`] loads it into a real
//! API server.
//!
//! The mix is fixed by the Service's index, so every size holds the same proportions and every
//! run the same objects:
//!
//! | index `i % 100` | kind |
//! |---|---|
//! | 0-9   | NodePort (10%) |
//! | 10-14 | LoadBalancer with `loadBalancerSourceRanges` and an ingress IP (5%) |
//! | 20-24 | ClusterIP with `sessionAffinity: ClientIP` (5%) |
//! | other | ClusterIP |
//!
//! Independently, every Service with `i % 10 == 5` has a second TCP port (443) and every one with
//! `i % 50 == 35` a third, UDP, port (53): 10% multi-port. Every Service has one EndpointSlice of
//! E ready endpoints; one endpoint in 100 runs on this node, the rest spread over 99 others.
//!
//! Addresses (rule entries only: no traffic is ever sent to them, except the data-path Service):
//! ClusterIPs from `10.96.0.2` (`10.96.0.1` is a real API server's own `kubernetes` Service; a
//! real API server with the default `10.96.0.0/16` Service range holds 65,533 of them);
//! endpoints `10.128.0.0/9`; replacement endpoints of
//! the change stream from `10.250.0.1`; LoadBalancer ingress IPs `198.18.0.0/15` (RFC 2544's
//! benchmarking range); NodePorts counted up from 30000, unique, as an API server with a wide
//! `--service-node-port-range` would allocate them.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use serde_json::{json, Value};

/// The namespace of every generated object.
pub const NAMESPACE: &str = "bench";
/// The Node name the proxy runs as (`--hostname-override`).
pub const NODE_NAME: &str = "bench-node";
/// The cluster's pod range (`--cluster-cidr`); the lab's pods are inside it.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The Service port every generated Service has (TCP).
pub const SERVICE_PORT: u16 = 80;
/// Its name.
pub const SERVICE_PORT_NAME: &str = "http";
/// The endpoints' port for [`SERVICE_PORT`].
pub const TARGET_PORT: u16 = 8080;
/// The data-path Service's name.
pub const DATAPATH_SERVICE: &str = "datapath";
/// The data-path Service's port for connection-rate runs (the server accepts and resets).
pub const DATAPATH_CONNECT_PORT: u16 = 80;
/// The data-path Service's port for bulk runs (the server reads to the end).
pub const DATAPATH_BULK_PORT: u16 = 81;
/// The data-path server's connect port.
pub const DATAPATH_CONNECT_TARGET: u16 = 8080;
/// The data-path server's bulk port.
pub const DATAPATH_BULK_TARGET: u16 = 8081;

/// What a generated Service is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ServiceKind {
    /// A plain ClusterIP Service.
    ClusterIp,
    /// ClusterIP with ClientIP session affinity.
    Affinity,
    /// A NodePort Service.
    NodePort,
    /// A LoadBalancer Service with source ranges and an ingress IP.
    LoadBalancer,
}

/// The kind of Service `i`.
pub fn kind_of(i: usize) -> ServiceKind {
    match i % 100 {
        0..=9 => ServiceKind::NodePort,
        10..=14 => ServiceKind::LoadBalancer,
        20..=24 => ServiceKind::Affinity,
        _ => ServiceKind::ClusterIp,
    }
}

/// The ports of Service `i`: (name, protocol, port, target port).
pub fn ports_of(i: usize) -> Vec<(&'static str, &'static str, u16, u16)> {
    let mut ports = vec![(SERVICE_PORT_NAME, "TCP", SERVICE_PORT, TARGET_PORT)];
    if i % 10 == 5 {
        ports.push(("https", "TCP", 443, 8443));
        if i % 50 == 35 {
            ports.push(("dns", "UDP", 53, 5353));
        }
    }
    ports
}

fn add(base: Ipv4Addr, offset: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base).wrapping_add(offset as u32))
}

/// The ClusterIP of Service `i`: `10.96.0.2` + i.
pub fn cluster_ip(i: usize) -> Ipv4Addr {
    add(Ipv4Addr::new(10, 96, 0, 2), i)
}

/// The address of endpoint `j` of Service `i` in a cluster of `per` endpoints per Service.
pub fn endpoint_ip(i: usize, j: usize, per: usize) -> Ipv4Addr {
    add(Ipv4Addr::new(10, 128, 0, 1), i * per + j)
}

/// The replacement endpoint address of change `k`.
pub fn change_ip(k: usize) -> Ipv4Addr {
    add(Ipv4Addr::new(10, 250, 0, 1), k)
}

fn load_balancer_ip(i: usize) -> Ipv4Addr {
    add(Ipv4Addr::new(198, 18, 0, 1), i)
}

fn node_of(i: usize, j: usize, per: usize) -> String {
    match (i * per + j) % 100 {
        0 => NODE_NAME.to_string(),
        n => format!("node-{n}"),
    }
}

/// A generated cluster of `services` Services with `per` endpoints each.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// Number of Services.
    pub services: usize,
    /// Endpoints per Service.
    pub per: usize,
    /// The first NodePort of each NodePort or LoadBalancer Service.
    node_ports: HashMap<usize, u16>,
}

impl Cluster {
    /// The cluster of `services` × `per`.
    pub fn new(services: usize, per: usize) -> Cluster {
        let mut node_ports = HashMap::new();
        let mut next = 30000usize;
        for i in 0..services {
            if matches!(
                kind_of(i),
                ServiceKind::NodePort | ServiceKind::LoadBalancer
            ) {
                node_ports.insert(i, next as u16);
                next += ports_of(i).len();
            }
        }
        Cluster {
            services,
            per,
            node_ports,
        }
    }

    /// The name of Service `i`.
    pub fn service_name(i: usize) -> String {
        format!("svc-{i}")
    }

    /// The name of Service `i`'s EndpointSlice.
    pub fn slice_name(i: usize) -> String {
        format!("svc-{i}-bench")
    }

    /// Service `i` as a manifest.
    pub fn service_json(&self, i: usize) -> Value {
        let kind = kind_of(i);
        let first_node_port = self.node_ports.get(&i).copied();
        let ports: Vec<Value> = ports_of(i)
            .into_iter()
            .enumerate()
            .map(|(k, (name, proto, port, target))| {
                let mut p =
                    json!({"name": name, "protocol": proto, "port": port, "targetPort": target});
                if let Some(np) = first_node_port {
                    p["nodePort"] = json!(np + k as u16);
                }
                p
            })
            .collect();
        let ip = cluster_ip(i).to_string();
        let mut spec = json!({"clusterIP": ip, "clusterIPs": [ip], "ports": ports});
        let mut status = json!({});
        match kind {
            ServiceKind::NodePort => spec["type"] = json!("NodePort"),
            ServiceKind::LoadBalancer => {
                spec["type"] = json!("LoadBalancer");
                spec["loadBalancerSourceRanges"] = json!(["192.0.2.0/24", "203.0.113.0/26"]);
                status =
                    json!({"loadBalancer": {"ingress": [{"ip": load_balancer_ip(i).to_string()}]}});
            }
            ServiceKind::Affinity => {
                spec["sessionAffinity"] = json!("ClientIP");
                spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": 10800}});
            }
            ServiceKind::ClusterIp => spec["type"] = json!("ClusterIP"),
        }
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": Cluster::service_name(i), "namespace": NAMESPACE},
            "spec": spec, "status": status,
        })
    }

    /// Service `i`'s EndpointSlice with these endpoint addresses.
    pub fn slice_json(&self, i: usize, addresses: &[Ipv4Addr]) -> Value {
        let endpoints: Vec<Value> = addresses
            .iter()
            .enumerate()
            .map(|(j, a)| {
                json!({
                    "addresses": [a.to_string()],
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "nodeName": node_of(i, j, self.per),
                })
            })
            .collect();
        let ports: Vec<Value> = ports_of(i)
            .into_iter()
            .map(
                |(name, proto, _, target)| json!({"name": name, "protocol": proto, "port": target}),
            )
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "name": Cluster::slice_name(i), "namespace": NAMESPACE,
                "labels": {"kubernetes.io/service-name": Cluster::service_name(i)},
            },
            "addressType": "IPv4", "ports": ports, "endpoints": endpoints,
        })
    }

    /// Service `i`'s endpoint addresses as generated.
    pub fn initial_endpoints(&self, i: usize) -> Vec<Ipv4Addr> {
        (0..self.per).map(|j| endpoint_ip(i, j, self.per)).collect()
    }

    /// The Node the proxy runs as: 192.0.2.1 (the lab node's address), podCIDR 10.244.1.0/24.
    pub fn node_json() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE_NAME, "labels": {"topology.kubernetes.io/zone": "zone-a"}},
            "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
            "status": {"addresses": [
                {"type": "InternalIP", "address": "192.0.2.1"},
                {"type": "Hostname", "address": NODE_NAME},
            ]},
        })
    }

    /// The data-path Service (ClusterIP [`Cluster::datapath_ip`], ports 80 and 81) and its
    /// slice, whose one endpoint is `server` (a lab pod).
    pub fn datapath_json(&self, server: Ipv4Addr) -> [Value; 2] {
        let ip = self.datapath_ip().to_string();
        let service = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": DATAPATH_SERVICE, "namespace": NAMESPACE},
            "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "ports": [
                {"name": "connect", "protocol": "TCP", "port": DATAPATH_CONNECT_PORT, "targetPort": DATAPATH_CONNECT_TARGET},
                {"name": "bulk", "protocol": "TCP", "port": DATAPATH_BULK_PORT, "targetPort": DATAPATH_BULK_TARGET},
            ]},
        });
        let slice = json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "name": format!("{DATAPATH_SERVICE}-bench"), "namespace": NAMESPACE,
                "labels": {"kubernetes.io/service-name": DATAPATH_SERVICE},
            },
            "addressType": "IPv4",
            "ports": [
                {"name": "connect", "protocol": "TCP", "port": DATAPATH_CONNECT_TARGET},
                {"name": "bulk", "protocol": "TCP", "port": DATAPATH_BULK_TARGET},
            ],
            "endpoints": [{"addresses": [server.to_string()], "conditions": {"ready": true}, "nodeName": NODE_NAME}],
        });
        [service, slice]
    }

    /// The data-path Service's ClusterIP: the one after the last generated Service.
    pub fn datapath_ip(&self) -> Ipv4Addr {
        cluster_ip(self.services)
    }

    /// Every object as a manifest: the Node, then each Service followed by its slice.
    pub fn manifests(&self) -> impl Iterator<Item = Value> + '_ {
        std::iter::once(Cluster::node_json()).chain((0..self.services).flat_map(move |i| {
            [
                self.service_json(i),
                self.slice_json(i, &self.initial_endpoints(i)),
            ]
        }))
    }
}

/// One single-endpoint change: endpoint `slot` of Service `service` becomes `new`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// The change's number.
    pub k: usize,
    /// The Service.
    pub service: usize,
    /// Which endpoint of its slice.
    pub slot: usize,
    /// The endpoint it replaces.
    pub old: Ipv4Addr,
    /// The new endpoint.
    pub new: Ipv4Addr,
    /// The Service's slice after the change.
    pub slice: Value,
}

/// Single-endpoint changes spread over the cluster: change `k` replaces one endpoint of Service
/// `(k × 7919) mod N` with a fresh address. It remembers what it changed, so a Service changed
/// twice changes again by exactly one endpoint.
#[derive(Debug)]
pub struct ChangeStream<'a> {
    cluster: &'a Cluster,
    next: usize,
    current: HashMap<usize, Vec<Ipv4Addr>>,
}

impl<'a> ChangeStream<'a> {
    /// Changes of `cluster`, starting from its generated endpoints.
    pub fn new(cluster: &'a Cluster) -> Self {
        ChangeStream {
            cluster,
            next: 0,
            current: HashMap::new(),
        }
    }

    /// Service `i`'s endpoints after the changes so far.
    pub fn endpoints(&self, i: usize) -> Vec<Ipv4Addr> {
        self.current
            .get(&i)
            .cloned()
            .unwrap_or_else(|| self.cluster.initial_endpoints(i))
    }

    /// The next change (the stream never ends; the cluster must have a Service and endpoints).
    pub fn next_change(&mut self) -> Change {
        let k = self.next;
        self.next += 1;
        let c = self.cluster;
        let service = (k * 7919) % c.services.max(1);
        let eps = self
            .current
            .entry(service)
            .or_insert_with(|| c.initial_endpoints(service));
        let slot = k % eps.len().max(1);
        let new = change_ip(k);
        let old = std::mem::replace(&mut eps[slot], new);
        let slice = c.slice_json(service, eps);
        Change {
            k,
            service,
            slot,
            old,
            new,
            slice,
        }
    }
}
