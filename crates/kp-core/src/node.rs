//! Node-level settings every kernel mode interprets the same way: which sources count as pod
//! traffic (detect-local), where NodePorts answer (`nodePortAddresses`), the node's own
//! addresses and the Service CIDRs, resolved once per sync against this node's Node object and
//! the ServiceCIDRs.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::track::ProxyState;

/// How detect-local decides which sources are pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DetectLocal {
    /// No detection: ClusterIP traffic is not masqueraded (unless `masqueradeAll`).
    None,
    /// Sources inside these cluster CIDRs are pods.
    ClusterCidr(Vec<IpNet>),
    /// Sources inside this node's `podCIDRs` are pods.
    NodeCidr,
}

/// Where NodePorts answer (`nodePortAddresses`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address (`nodePortAddresses` empty in older upstreams, and the iptables
    /// default).
    AllLocal,
    /// Local addresses inside these CIDRs.
    Cidrs(Vec<IpNet>),
    /// The node's primary addresses, from its Node object (`primary`, upstream's nftables
    /// default). Until the Node reports an address, NodePorts answer nowhere.
    Primary,
}

/// What a rule planner needs from the node besides the Services.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// Sources that count as pod traffic for detect-local (ClusterCIDR or the node's PodCIDR).
    /// Empty when detect-local is off.
    pub local_cidrs: Vec<IpNet>,
    /// Where NodePorts answer, when they are restricted; empty with [`NodePortAddresses::AllLocal`].
    pub node_port_addresses: Vec<IpNet>,
    /// The node's primary addresses, at most one per family (from its Node object).
    pub node_ips: Vec<IpAddr>,
    /// The ranges ClusterIPs come from (configured, and from ServiceCIDR objects), aggregated.
    /// Traffic to an address inside them that no Service holds is dropped; empty when unknown.
    pub service_cidrs: Vec<IpNet>,
}

impl NodeContext {
    /// Resolves the settings against the node and the Service CIDRs as last seen.
    pub fn resolve(
        detect_local: &DetectLocal,
        node_ports: &NodePortAddresses,
        state: &ProxyState,
    ) -> NodeContext {
        let node = state.node();
        NodeContext {
            local_cidrs: match detect_local {
                DetectLocal::None => Vec::new(),
                DetectLocal::ClusterCidr(c) => c.clone(),
                DetectLocal::NodeCidr => node.pod_cidrs.clone(),
            },
            node_port_addresses: match node_ports {
                NodePortAddresses::AllLocal => Vec::new(),
                NodePortAddresses::Cidrs(c) => c.clone(),
                NodePortAddresses::Primary => {
                    node.addresses.iter().map(|ip| IpNet::from(*ip)).collect()
                }
            },
            node_ips: node.addresses.clone(),
            service_cidrs: state.service_cidrs(),
        }
    }

    /// Where NodePorts of `family` answer, read as upstream reads `nodePortAddresses` per
    /// family: `None` for every local address (no network of this family is configured, or
    /// one of zero length is), else the local addresses inside these networks (host bits
    /// cleared, in order, without repeats). A NodePort frontend
    /// ([`crate::frontend::FrontendKind::NodePort`]) answers there.
    ///
    /// The iptables mode reads it so. The nftables mode matches the configured networks as a
    /// set (`nodeport-addresses`), so an empty set with restricted NodePorts answers nowhere.
    pub fn node_port_networks(&self, family: crate::model::IpFamily) -> Option<Vec<IpNet>> {
        let mut nets: Vec<IpNet> = Vec::new();
        for net in self
            .node_port_addresses
            .iter()
            .filter(|n| crate::model::IpFamily::of_net(n) == family)
        {
            if net.prefix_len() == 0 {
                return None;
            }
            let net = net.trunc();
            if !nets.contains(&net) {
                nets.push(net);
            }
        }
        (!nets.is_empty()).then_some(nets)
    }

    /// The node's primary address of `family`, if its Node reports one.
    pub fn node_ip(&self, family: crate::model::IpFamily) -> Option<IpAddr> {
        self.node_ips
            .iter()
            .find(|ip| crate::model::IpFamily::of(ip) == family)
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::track::{Object, SourceEvent};

    fn upsert(state: &mut ProxyState, object: Object) {
        state.apply(SourceEvent::Upsert(object)).expect("valid");
    }

    fn node_a() -> Object {
        Object::Node(Box::new(
            serde_json::from_value(json!({
                "metadata": {"name": "node-a"},
                "spec": {"podCIDRs": ["10.244.1.0/24"]},
                "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]},
            }))
            .expect("Node JSON"),
        ))
    }

    fn service_cidr(name: &str, cidrs: &[&str]) -> Object {
        Object::ServiceCidr(Box::new(
            serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}}))
                .expect("ServiceCIDR JSON"),
        ))
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().expect("network")).collect()
    }

    #[test]
    fn primary_follows_the_node_and_node_cidr_its_pod_cidrs() {
        let mut state = ProxyState::new("node-a");
        upsert(&mut state, node_a());
        let ctx = NodeContext::resolve(&DetectLocal::NodeCidr, &NodePortAddresses::Primary, &state);
        assert_eq!(ctx.local_cidrs, nets(&["10.244.1.0/24"]));
        assert_eq!(ctx.node_port_addresses, nets(&["192.0.2.1/32"]));
        assert_eq!(
            ctx.node_ip(crate::model::IpFamily::V4),
            Some("192.0.2.1".parse().unwrap())
        );
        assert_eq!(ctx.node_ip(crate::model::IpFamily::V6), None);
        let none = NodeContext::resolve(
            &DetectLocal::None,
            &NodePortAddresses::AllLocal,
            &ProxyState::new("node-a"),
        );
        assert_eq!(none, NodeContext::default());
    }

    #[test]
    fn node_port_networks_are_per_family_and_a_zero_network_means_every_address() {
        let ctx = NodeContext {
            node_port_addresses: nets(&["192.0.2.7/24", "127.0.0.1/32", "192.0.2.0/24"]),
            ..NodeContext::default()
        };
        use crate::model::IpFamily::{V4, V6};
        assert_eq!(
            ctx.node_port_networks(V4),
            Some(nets(&["192.0.2.0/24", "127.0.0.1/32"]))
        );
        assert_eq!(ctx.node_port_networks(V6), None);
        let zero = NodeContext {
            node_port_addresses: nets(&["192.0.2.0/24", "0.0.0.0/0", "2001:db8::/64"]),
            ..NodeContext::default()
        };
        assert_eq!(zero.node_port_networks(V4), None);
        assert_eq!(zero.node_port_networks(V6), Some(nets(&["2001:db8::/64"])));
    }

    #[test]
    fn service_cidrs_join_configuration_and_service_cidr_objects() {
        let mut state = ProxyState::new("node-a");
        state.set_configured_service_cidrs(nets(&["192.168.50.0/24"]));
        upsert(
            &mut state,
            service_cidr("kubernetes", &["10.96.0.0/16", "fd00:10:96::/112"]),
        );
        // A second object inside the first adds nothing.
        upsert(&mut state, service_cidr("extra", &["10.96.1.0/24"]));
        let ctx = NodeContext::resolve(&DetectLocal::None, &NodePortAddresses::AllLocal, &state);
        assert_eq!(
            ctx.service_cidrs,
            nets(&["10.96.0.0/16", "192.168.50.0/24", "fd00:10:96::/112"])
        );
    }
}
