//! The frontends of a Service port: every place a client sends its traffic to (the ClusterIP,
//! each external IP, each LoadBalancer ingress IP, the NodePort), each with the endpoints its
//! traffic policy leaves it, what becomes of it without endpoints, masquerading, ClientIP
//! affinity and the short-circuit of `externalTrafficPolicy: Local`.
//!
//! One expansion for every mode: the nftables planner makes set and map elements of each
//! frontend, the iptables renderer makes rules and chains, the conntrack planner indexes the
//! frontends' addresses; a virtual-server mode (IPVS) makes one virtual server of each, an eBPF
//! mode one map key. Mirrors how upstream's proxiers walk a `ServicePort` in
//! `syncProxyRules` (`pkg/proxy/{iptables,nftables}/proxier.go`), one IP family at a time, as
//! upstream runs one proxier per family:
//!
//! - [`Frontends::new`] resolves the port's policies for one family: which endpoint set each
//!   policy uses (`internalTrafficPolicy` for the ClusterIP, `externalTrafficPolicy` for the
//!   others), and whether the port has any usable endpoint of the family at all;
//! - [`Frontends::iter`] lists the frontends of that family in a fixed order: ClusterIPs,
//!   external IPs, LoadBalancer IPs, then the NodePort.
//!
//! Endpoint selection itself (ready versus terminating, topology) is [`crate::select`]'s;
//! node-level settings (detect-local, where NodePorts answer) are [`crate::node`]'s.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::{Endpoint, IpFamily, Protocol, ServicePort};
use crate::node::NodeContext;
use crate::select::SelectedEndpoints;
use crate::track::ServicePortState;

/// Which endpoints a traffic policy sends a frontend's traffic to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TrafficPolicy {
    /// `Cluster`: every usable endpoint (topology applied).
    Cluster,
    /// `Local`: usable endpoints on this node only.
    Local,
}

/// Which traffic to a frontend is masqueraded (its source replaced by the node's address, so
/// that replies come back through this node).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Masquerade {
    /// A ClusterIP: traffic that does not come from a pod (detect-local), or every packet with
    /// `masqueradeAll`; neither configured, none. The mode's configuration decides.
    NotFromPods,
    /// An external frontend with `externalTrafficPolicy: Cluster`: every packet (it may be sent
    /// to another node).
    Always,
    /// An external frontend with `externalTrafficPolicy: Local`: only what the node itself
    /// sends (short-circuited to any endpoint); other clients keep their address.
    FromNode,
}

/// What becomes of traffic to a frontend that has no endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NoEndpoints {
    /// The Service port has no usable endpoint of the family anywhere: rejected (ICMP port
    /// unreachable, or a TCP reset), upstream's "has no endpoints".
    Reject,
    /// A `Local` policy with endpoints elsewhere but none on this node: dropped, upstream's
    /// "has no local endpoints" (the client's load balancer is to try another node).
    Drop,
}

/// `spec.loadBalancerSourceRanges` as they apply to one LoadBalancer frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceRanges<'a> {
    all: &'a [IpNet],
    family: IpFamily,
}

impl<'a> SourceRanges<'a> {
    /// Whether the Service lists any range, of either family.
    ///
    /// A Service that lists ranges of the other family only leaves
    /// [`of_family`](Self::of_family) empty: the nftables mode then admits no other client of
    /// this family (only the node itself, see [`Frontend::admits_node`]); the iptables mode, as
    /// upstream's per-family proxiers, filters nothing.
    pub fn restricted(&self) -> bool {
        !self.all.is_empty()
    }

    /// The ranges of the frontend's family, in the Service's order.
    pub fn of_family(&self) -> impl Iterator<Item = &'a IpNet> + 'a {
        let family = self.family;
        self.all
            .iter()
            .filter(move |n| IpFamily::of_net(n) == family)
    }

    /// Whether `ip` lies in one of the ranges.
    pub fn contains(&self, ip: &IpAddr) -> bool {
        self.all.iter().any(|r| r.contains(ip))
    }
}

/// What kind of frontend, in Kubernetes terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontendKind<'a> {
    /// `spec.clusterIPs[]`.
    ClusterIp,
    /// `spec.externalIPs[]`.
    ExternalIp,
    /// `status.loadBalancer.ingress[].ip`, with the Service's `loadBalancerSourceRanges`.
    LoadBalancer {
        /// The sources allowed to reach it.
        source_ranges: SourceRanges<'a>,
    },
    /// `spec.ports[].nodePort`, on every address NodePorts answer on (see
    /// [`NodeContext::node_port_addresses`]).
    NodePort,
}

/// One frontend of a Service port, in one IP family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frontend<'a> {
    /// What it is.
    pub kind: FrontendKind<'a>,
    /// Its address; `None` for a NodePort, which answers on every NodePort address of
    /// [`family`](Self::family).
    pub address: Option<IpAddr>,
    /// Its IP family.
    pub family: IpFamily,
    /// The Service port's protocol.
    pub protocol: Protocol,
    /// The Service port, or the NodePort.
    pub port: u16,
    /// The traffic policy that applies: `internalTrafficPolicy` for a ClusterIP,
    /// `externalTrafficPolicy` for the others.
    pub policy: TrafficPolicy,
    /// The endpoints that policy leaves (of this family, in selection order); empty when there
    /// are none, and then [`no_endpoints`](Self::no_endpoints) says what happens.
    pub endpoints: &'a [&'a Endpoint],
    /// Which traffic is masqueraded.
    pub masquerade: Masquerade,
    /// ClientIP session affinity timeout in seconds; `None` without affinity.
    pub affinity: Option<u32>,
    /// With `externalTrafficPolicy: Local`, the cluster-wide endpoints that traffic from pods
    /// and from the node itself is sent to instead ("short-circuit": as if it had gone out to
    /// the load balancer and come back to any node). Empty otherwise, and when there are none.
    pub short_circuit: &'a [&'a Endpoint],
    /// Whether the Service port has any usable endpoint of this family, anywhere (with a
    /// `Local` policy, possibly none on this node).
    pub has_endpoints: bool,
}

impl<'a> Frontend<'a> {
    /// Whether traffic comes from outside the cluster network: an external IP, a LoadBalancer
    /// IP or a NodePort (whatever `externalTrafficPolicy` governs).
    pub fn is_external(&self) -> bool {
        !matches!(self.kind, FrontendKind::ClusterIp)
    }

    /// What becomes of its traffic when it has no endpoints; `None` when it has some.
    pub fn no_endpoints(&self) -> Option<NoEndpoints> {
        match (self.endpoints.is_empty(), self.has_endpoints) {
            (false, _) => None,
            (true, true) => Some(NoEndpoints::Drop),
            (true, false) => Some(NoEndpoints::Reject),
        }
    }

    /// The source ranges of a LoadBalancer frontend that restricts its sources; `None` for
    /// every other frontend.
    pub fn source_ranges(&self) -> Option<SourceRanges<'a>> {
        match self.kind {
            FrontendKind::LoadBalancer { source_ranges } if source_ranges.restricted() => {
                Some(source_ranges)
            }
            _ => None,
        }
    }

    /// Whether the node itself may reach this LoadBalancer frontend despite its source
    /// ranges: its own address of the family lies in one of them. That traffic leaves with the
    /// LoadBalancer IP as its source (the IP is bound, or routed, locally), so modes admit the
    /// LoadBalancer IP as a source too (upstream, both proxiers).
    pub fn admits_node(&self, node: &NodeContext) -> bool {
        match self.source_ranges() {
            Some(ranges) => node
                .node_ip(self.family)
                .is_some_and(|ip| ranges.contains(&ip)),
            None => false,
        }
    }
}

/// A Service port's frontends in one IP family, with the endpoint sets its policies use.
#[derive(Clone, Debug)]
pub struct Frontends<'a> {
    port: &'a ServicePort,
    family: IpFamily,
    /// Cluster-wide endpoints of the family, empty when no frontend of the family uses them.
    cluster: Vec<&'a Endpoint>,
    /// Endpoints of the family on this node, empty when no frontend of the family uses them.
    local: Vec<&'a Endpoint>,
    has_endpoints: bool,
    externally_accessible: bool,
    external_local: bool,
}

impl<'a> Frontends<'a> {
    /// The frontends of `sps` in `family`.
    pub fn of(sps: &'a ServicePortState, family: IpFamily) -> Self {
        Frontends::new(&sps.port, &sps.endpoints, family)
    }

    /// The frontends of `port` in `family`, with `endpoints` selected for it
    /// ([`crate::select::select`]).
    pub fn new(port: &'a ServicePort, endpoints: &'a SelectedEndpoints, family: IpFamily) -> Self {
        let of_family = |ips: &[IpAddr]| ips.iter().any(|ip| IpFamily::of(ip) == family);
        // Upstream's per-family view: a port reachable from outside only through the other
        // family's addresses is not external here.
        let externally_accessible = port.node_port.is_some()
            || of_family(&port.external_ips)
            || of_family(&port.load_balancer_ips);
        let internal_local = port.internal_traffic_local;
        let external_local = port.external_traffic_local && externally_accessible;
        let uses_cluster = !internal_local || externally_accessible;
        let uses_local = internal_local || external_local;
        let pick = |set: &'a [Endpoint], used: bool| -> Vec<&'a Endpoint> {
            if !used {
                return Vec::new();
            }
            set.iter()
                .filter(|e| IpFamily::of(&e.ip) == family)
                .collect()
        };
        Frontends {
            port,
            family,
            cluster: pick(&endpoints.cluster, uses_cluster),
            local: pick(&endpoints.local, uses_local),
            has_endpoints: endpoints.has_any_for(family),
            externally_accessible,
            external_local,
        }
    }

    /// The Service port.
    pub fn port(&self) -> &'a ServicePort {
        self.port
    }

    /// The IP family.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// The port's ClusterIP of this family; `None` for a Service of the other family only
    /// (upstream's per-family proxier never sees it).
    pub fn cluster_ip(&self) -> Option<IpAddr> {
        self.port
            .cluster_ips
            .iter()
            .find(|ip| IpFamily::of(ip) == self.family)
            .copied()
    }

    /// Whether the port has any usable endpoint of this family, anywhere.
    pub fn has_endpoints(&self) -> bool {
        self.has_endpoints
    }

    /// Whether the port has an external frontend in this family (a NodePort, or an external or
    /// LoadBalancer IP of the family).
    pub fn externally_accessible(&self) -> bool {
        self.externally_accessible
    }

    /// The policy of the ClusterIP (`internalTrafficPolicy`).
    pub fn internal_policy(&self) -> TrafficPolicy {
        policy(self.port.internal_traffic_local)
    }

    /// The policy of the external frontends (`externalTrafficPolicy`, `Cluster` when there is
    /// no external frontend in this family).
    pub fn external_policy(&self) -> TrafficPolicy {
        policy(self.external_local)
    }

    /// The endpoints of `Cluster` policy frontends (and of the short-circuit), in selection
    /// order; empty when no frontend of this family uses them.
    pub fn cluster_endpoints(&self) -> &[&'a Endpoint] {
        &self.cluster
    }

    /// The endpoints of `Local` policy frontends, in selection order; empty when no frontend
    /// of this family uses them.
    pub fn local_endpoints(&self) -> &[&'a Endpoint] {
        &self.local
    }

    /// The endpoints `policy` leaves.
    pub fn endpoints(&self, policy: TrafficPolicy) -> &[&'a Endpoint] {
        match policy {
            TrafficPolicy::Cluster => &self.cluster,
            TrafficPolicy::Local => &self.local,
        }
    }

    /// Every frontend of this family: ClusterIPs, external IPs, LoadBalancer IPs (each in the
    /// Service's order), then the NodePort.
    pub fn iter(&self) -> impl Iterator<Item = Frontend<'_>> + '_ {
        let port = self.port;
        let family = self.family;
        let in_family = move |ip: &&IpAddr| IpFamily::of(ip) == family;
        let source_ranges = SourceRanges {
            all: &port.load_balancer_source_ranges,
            family,
        };
        let cluster_ips = port
            .cluster_ips
            .iter()
            .filter(in_family)
            .map(|ip| (FrontendKind::ClusterIp, Some(*ip)));
        let external_ips = port
            .external_ips
            .iter()
            .filter(in_family)
            .map(|ip| (FrontendKind::ExternalIp, Some(*ip)));
        let lb_ips = port
            .load_balancer_ips
            .iter()
            .filter(in_family)
            .map(move |ip| (FrontendKind::LoadBalancer { source_ranges }, Some(*ip)));
        let node_port = port.node_port.map(|_| (FrontendKind::NodePort, None));
        cluster_ips
            .chain(external_ips)
            .chain(lb_ips)
            .chain(node_port)
            .map(move |(kind, address)| self.frontend(kind, address))
    }

    fn frontend<'s>(&'s self, kind: FrontendKind<'s>, address: Option<IpAddr>) -> Frontend<'s> {
        let port = self.port;
        let (policy, masquerade, port_number) = match kind {
            FrontendKind::ClusterIp => (self.internal_policy(), Masquerade::NotFromPods, port.port),
            _ => {
                let policy = self.external_policy();
                let masquerade = match policy {
                    TrafficPolicy::Cluster => Masquerade::Always,
                    TrafficPolicy::Local => Masquerade::FromNode,
                };
                let number = match kind {
                    FrontendKind::NodePort => port.node_port.unwrap_or(port.port),
                    _ => port.port,
                };
                (policy, masquerade, number)
            }
        };
        let short_circuit: &[&Endpoint] = match (kind, policy) {
            (FrontendKind::ClusterIp, _) | (_, TrafficPolicy::Cluster) => &[],
            (_, TrafficPolicy::Local) => &self.cluster,
        };
        Frontend {
            kind,
            address,
            family: self.family,
            protocol: port.name.protocol,
            port: port_number,
            policy,
            endpoints: self.endpoints(policy),
            masquerade,
            affinity: port.session_affinity_timeout,
            short_circuit,
            has_endpoints: self.has_endpoints,
        }
    }
}

fn policy(local: bool) -> TrafficPolicy {
    if local {
        TrafficPolicy::Local
    } else {
        TrafficPolicy::Cluster
    }
}

#[cfg(test)]
mod tests;
