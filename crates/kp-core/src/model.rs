//! The Service and Endpoint model that every dataplane programs.
//!
//! Mirrors upstream `pkg/proxy/serviceport.go` and `pkg/proxy/endpoint.go`: a Service is split
//! into one [`ServicePort`] per `spec.ports[]` entry, and EndpointSlices are split into one
//! [`Endpoint`] list per port name. Every value here has been validated (see [`crate::convert`]),
//! so renderers may put it into rule text as-is.

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

/// An L4 protocol a Service port can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    /// Every protocol, in a fixed order.
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// The IANA protocol number the kernel uses (`IPPROTO_TCP` 6, `IPPROTO_UDP` 17,
    /// `IPPROTO_SCTP` 132).
    pub fn ip_number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// Parses the Kubernetes spelling (`TCP`, `UDP`, `SCTP`).
    pub fn from_kubernetes(s: &str) -> Option<Protocol> {
        match s {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// The Kubernetes spelling.
    pub fn as_kubernetes(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// The lower-case spelling used by nft and iptables.
    pub fn as_lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_kubernetes())
    }
}

/// An IP family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// Both families, IPv4 first.
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The family of an address.
    pub fn of(ip: &IpAddr) -> IpFamily {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    /// The family of a network.
    pub fn of_net(net: &IpNet) -> IpFamily {
        match net {
            IpNet::V4(_) => IpFamily::V4,
            IpNet::V6(_) => IpFamily::V6,
        }
    }

    /// Upstream's name for the family in health JSON (`IPv4`, `IPv6`).
    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

/// Identifies a Service: namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub name: String,
}

impl ServiceKey {
    /// Builds a key.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ServiceKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Identifies one port of a Service: upstream's `ServicePortName`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    /// The Service.
    pub service: ServiceKey,
    /// The port's name; empty for a single unnamed port.
    pub port: String,
    /// The port's protocol.
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    /// Upstream's spelling: `namespace/name:port` (`namespace/name` for an unnamed port).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

/// One port of a Service, with everything a dataplane needs to program it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// Which Service port this is.
    pub name: ServicePortName,
    /// The ClusterIPs, at most one per family.
    pub cluster_ips: Vec<IpAddr>,
    /// The Service port number.
    pub port: u16,
    /// The NodePort, if allocated.
    pub node_port: Option<u16>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`.
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`: when non-empty, LoadBalancer traffic from elsewhere drops.
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// ClientIP session affinity timeout in seconds; `None` without affinity.
    pub session_affinity_timeout: Option<u32>,
    /// `internalTrafficPolicy: Local`.
    pub internal_traffic_local: bool,
    /// `externalTrafficPolicy: Local` (only meaningful for NodePort and LoadBalancer Services).
    pub external_traffic_local: bool,
    /// `spec.healthCheckNodePort`, used with `externalTrafficPolicy: Local`.
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// Whether anything reaches this port from outside the cluster network.
    pub fn has_external(&self) -> bool {
        self.node_port.is_some()
            || !self.external_ips.is_empty()
            || !self.load_balancer_ips.is_empty()
    }

    /// Whether external traffic uses only node-local endpoints.
    pub fn external_policy_local(&self) -> bool {
        self.external_traffic_local && self.has_external()
    }
}

/// One endpoint of a Service port, from an EndpointSlice.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    /// The endpoint address.
    pub ip: IpAddr,
    /// The target port on the endpoint.
    pub port: u16,
    /// `conditions.ready` (unset counts as ready, as upstream).
    pub ready: bool,
    /// `conditions.serving` (unset follows `ready`).
    pub serving: bool,
    /// `conditions.terminating` (unset counts as not terminating).
    pub terminating: bool,
    /// Whether `nodeName` is this node.
    pub is_local: bool,
    /// `hints.forZones[].name`; `None` when the endpoint carries no zone hints.
    pub zone_hints: Option<BTreeSet<String>>,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}", self.port),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}", self.port),
        }
    }
}

/// Endpoints an EndpointSlice lists for one port name and protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    /// The port's name (matches [`ServicePortName::port`]).
    pub port_name: String,
    /// The port's protocol.
    pub protocol: Protocol,
    /// The endpoints, each with this port's number.
    pub endpoints: Vec<Endpoint>,
}

/// What an EndpointSlice contributes to its Service.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceEndpoints {
    /// The Service this slice belongs to (label `kubernetes.io/service-name`).
    pub service: ServiceKey,
    /// The slice's own name.
    pub slice_name: String,
    /// The slice's address family.
    pub family: IpFamily,
    /// One entry per port.
    pub ports: Vec<SlicePort>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, as Unix seconds, if present.
    pub trigger_time: Option<f64>,
}

/// What this node's own Node object tells the proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node name.
    pub name: String,
    /// Whether the Node object exists.
    pub exists: bool,
    /// Whether the Node has a deletion timestamp.
    pub deleting: bool,
    /// Whether it has the `ToBeDeletedByClusterAutoscaler` taint.
    pub to_be_deleted: bool,
    /// Its `topology.kubernetes.io/zone` label.
    pub zone: Option<String>,
    /// `spec.podCIDRs`, for detect-local `NodeCIDR`.
    pub pod_cidrs: Vec<IpNet>,
    /// The node's primary addresses (`status.addresses`: InternalIP, else ExternalIP), at most
    /// one per family, for `nodePortAddresses: primary`.
    pub addresses: Vec<IpAddr>,
}

impl NodeInfo {
    /// Whether the node may receive load-balancer traffic (`/healthz`'s `nodeEligible`).
    pub fn eligible(&self) -> bool {
        self.exists && !self.deleting && !self.to_be_deleted
    }
}
