//! How rules are rendered: the configuration ([`PlanConfig`]) and the node resolved for one
//! family ([`RenderContext`]).

use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::IpFamily;
use kp_core::node::{LocalInterface, NodeContext};

use super::rule::loopback;

/// How the planner renders rules (upstream's `iptables` configuration for one family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// The family of the tables planned (`iptables` or `ip6tables`).
    pub family: IpFamily,
    /// `iptables.masqueradeBit`: the mark bit for SNAT, 0 to 31 (validated by the
    /// configuration; an out-of-range bit falls back to 14).
    pub masquerade_bit: u32,
    /// `masqueradeAll`: masquerade all ClusterIP traffic.
    pub masquerade_all: bool,
    /// `iptables.localhostNodePorts`: NodePorts also answer on 127.0.0.0/8 (IPv4 only), with
    /// kubelet's `KUBE-FIREWALL` anti-martian rule. Upstream turns it off when
    /// `nodePortAddresses` excludes loopback; the configuration layer does that here.
    pub localhost_node_ports: bool,
}

impl PlanConfig {
    /// Defaults for `family`: mark bit 14, no `masqueradeAll`, no localhost NodePorts.
    pub fn new(family: IpFamily) -> Self {
        PlanConfig {
            family,
            masquerade_bit: 14,
            masquerade_all: false,
            localhost_node_ports: false,
        }
    }

    /// The masquerade mark, `1 << masquerade_bit`.
    pub fn mark(&self) -> u32 {
        1u32.checked_shl(self.masquerade_bit).unwrap_or(1 << 14)
    }
}

/// Where NodePorts answer, for one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NodePortDestinations {
    /// Every local address (`-m addrtype --dst-type LOCAL`), loopback excluded unless
    /// localhost NodePorts are on (IPv4 only).
    AllLocal,
    /// Local addresses inside these networks.
    Cidrs(Vec<IpNet>),
}

/// Everything besides the Service port itself that its rules depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RenderContext {
    pub family: IpFamily,
    pub mark: u32,
    pub masquerade_all: bool,
    /// Localhost NodePorts in effect (IPv4 only).
    pub localhost_node_ports: bool,
    /// Detect-local: the pod network of this family (upstream allows one per family).
    pub local_cidr: Option<IpNet>,
    /// Detect-local by the interface a packet arrives on (instead of `local_cidr`).
    pub local_interface: Option<LocalInterface>,
    pub node_ports: NodePortDestinations,
    /// The node's primary address of this family (`loadBalancerSourceRanges` that contain it
    /// also admit traffic the node sends to its own LoadBalancer IPs).
    pub node_ip: Option<IpAddr>,
    /// The Service CIDRs of this family (traffic to their unallocated addresses is dropped).
    pub service_cidrs: Vec<IpNet>,
    /// Large-cluster mode: no comments on per-endpoint rules.
    pub large: bool,
}

impl RenderContext {
    /// Resolves the configuration and the node for the planner's family. `large` is
    /// large-cluster mode.
    pub(crate) fn new(cfg: &PlanConfig, node: &NodeContext, large: bool) -> Self {
        let family = cfg.family;
        let localhost_node_ports = cfg.localhost_node_ports && family == IpFamily::V4;
        let node_ports = match node.node_port_networks(family) {
            None => NodePortDestinations::AllLocal,
            Some(nets) => {
                // Upstream skips loopback node IPs unless localhost NodePorts are on.
                let lo = loopback(family);
                let cidrs = nets
                    .into_iter()
                    .filter(|n| localhost_node_ports || !lo.contains(n))
                    .collect();
                NodePortDestinations::Cidrs(cidrs)
            }
        };
        RenderContext {
            family,
            mark: cfg.mark(),
            masquerade_all: cfg.masquerade_all,
            localhost_node_ports,
            local_cidr: node
                .local_cidrs
                .iter()
                .find(|n| IpFamily::of_net(n) == family)
                .map(IpNet::trunc),
            local_interface: node.local_interface.clone(),
            node_ports,
            node_ip: node.node_ip(family),
            service_cidrs: node
                .service_cidrs
                .iter()
                .filter(|n| IpFamily::of_net(n) == family)
                .map(IpNet::trunc)
                .collect(),
            large,
        }
    }
}
