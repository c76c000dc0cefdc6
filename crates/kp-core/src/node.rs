//! Node-level settings every kernel mode interprets the same way: which sources count as pod
//! traffic (detect-local) and where NodePorts answer (`nodePortAddresses`), resolved against
//! this node's Node object.

use ipnet::IpNet;

use crate::model::NodeInfo;

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
}

impl NodeContext {
    /// Resolves the settings against the node as last seen.
    pub fn resolve(
        detect_local: &DetectLocal,
        node_ports: &NodePortAddresses,
        node: &NodeInfo,
    ) -> NodeContext {
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primary_follows_the_node_and_node_cidr_its_pod_cidrs() {
        let node = NodeInfo {
            addresses: vec!["192.0.2.1".parse().unwrap()],
            pod_cidrs: vec!["10.244.1.0/24".parse().unwrap()],
            ..NodeInfo::default()
        };
        let ctx = NodeContext::resolve(&DetectLocal::NodeCidr, &NodePortAddresses::Primary, &node);
        assert_eq!(ctx.local_cidrs, node.pod_cidrs);
        assert_eq!(
            ctx.node_port_addresses,
            vec!["192.0.2.1/32".parse::<IpNet>().unwrap()]
        );
        let none = NodeContext::resolve(&DetectLocal::None, &NodePortAddresses::AllLocal, &node);
        assert_eq!(none, NodeContext::default());
    }
}
