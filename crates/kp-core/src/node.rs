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
    /// Packets that arrive on this bridge are from pods (`detectLocalMode: BridgeInterface`).
    BridgeInterface(InterfaceName),
    /// Packets that arrive on an interface whose name starts with this prefix are from pods
    /// (`detectLocalMode: InterfaceNamePrefix`).
    InterfaceNamePrefix(InterfaceName),
}

impl DetectLocal {
    /// The interface form of detect-local, if it is one.
    pub fn interface(&self) -> Option<LocalInterface> {
        match self {
            DetectLocal::BridgeInterface(n) => Some(LocalInterface::Bridge(n.clone())),
            DetectLocal::InterfaceNamePrefix(n) => Some(LocalInterface::Prefix(n.clone())),
            _ => None,
        }
    }
}

/// An interface name (or name prefix) as detect-local may use it: 1 to 15 bytes (the kernel's
/// `IFNAMSIZ` less the NUL), not `.` or `..`, of printable ASCII without whitespace and
/// without any character that could end or extend a match in rule text: `/` and `:` (which
/// the kernel refuses in names), quotes and `\`, iptables' and nftables' wildcards `+` and
/// `*`, and nft's syntax characters `$ # ; { }`. The renderers write it into rules unquoted
/// (iptables) or between double quotes (nftables), so a name that passes cannot inject.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InterfaceName(String);

/// Why a name is refused as an [`InterfaceName`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InterfaceNameError {
    /// Empty.
    #[error("an interface name must not be empty")]
    Empty,
    /// More than 15 bytes.
    #[error("an interface name has at most 15 bytes, this one has {0}")]
    TooLong(usize),
    /// `.` or `..`.
    #[error("an interface name cannot be \".\" or \"..\"")]
    Dots,
    /// A character the kernel or the rule text does not allow.
    #[error("an interface name cannot contain {0:?} (allowed: printable ASCII except whitespace and / : \" ' ` \\ + * $ # ; {{ }})")]
    Character(char),
}

impl InterfaceName {
    /// The longest name the kernel takes, in bytes.
    pub const MAX_LEN: usize = 15;

    /// Validates `name` (see [`InterfaceName`]).
    pub fn new(name: &str) -> Result<Self, InterfaceNameError> {
        if name.is_empty() {
            return Err(InterfaceNameError::Empty);
        }
        if let Some(c) = name.chars().find(|c| {
            !c.is_ascii_graphic()
                || matches!(
                    c,
                    '/' | ':' | '"' | '\'' | '`' | '\\' | '+' | '*' | '$' | '#' | ';' | '{' | '}'
                )
        }) {
            return Err(InterfaceNameError::Character(c));
        }
        if name.len() > Self::MAX_LEN {
            return Err(InterfaceNameError::TooLong(name.len()));
        }
        if name == "." || name == ".." {
            return Err(InterfaceNameError::Dots);
        }
        Ok(InterfaceName(name.to_string()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for InterfaceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Detect-local by the interface a packet arrives on (upstream's `BridgeInterface` and
/// `InterfaceNamePrefix` detectors, `pkg/proxy/util/localdetector.go`). Packets the node sends
/// itself arrive on no interface, so they are never local by this test, as upstream's
/// `! -i` / `iifname !=` match them in the output hook.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LocalInterface {
    /// Packets that arrive on this interface (a bridge) are from pods.
    Bridge(InterfaceName),
    /// Packets that arrive on an interface whose name starts with this are from pods.
    Prefix(InterfaceName),
}

impl LocalInterface {
    /// Whether a packet that arrived on `iif` (`None`: sent by the node) is from a pod.
    pub fn matches(&self, iif: Option<&str>) -> bool {
        match (self, iif) {
            (_, None) => false,
            (LocalInterface::Bridge(n), Some(i)) => i == n.as_str(),
            (LocalInterface::Prefix(p), Some(i)) => i.starts_with(p.as_str()),
        }
    }

    /// The iptables match for "from a pod" (`-i cbr0`, `-i veth+`), or with `negate` for "not
    /// from a pod" (`! -i cbr0`), as `iptables-save` prints it.
    pub fn iptables(&self, negate: bool) -> String {
        let neg = if negate { "! " } else { "" };
        match self {
            LocalInterface::Bridge(n) => format!("{neg}-i {n}"),
            // A prefix as long as a name can be matches that name alone (and iptables refuses
            // `-i` of 16 bytes with the `+`).
            LocalInterface::Prefix(p) if p.as_str().len() == InterfaceName::MAX_LEN => {
                format!("{neg}-i {p}")
            }
            LocalInterface::Prefix(p) => format!("{neg}-i {p}+"),
        }
    }

    /// The nftables match for "from a pod" (`iifname "cbr0"`, `iifname "veth*"`), or with
    /// `negate` for "not from a pod" (`iifname != "cbr0"`), as `nft list` prints it.
    pub fn nft(&self, negate: bool) -> String {
        let op = if negate { "!= " } else { "" };
        match self {
            LocalInterface::Bridge(n) => format!("iifname {op}\"{n}\""),
            // As for iptables: a 15-byte prefix is the whole name.
            LocalInterface::Prefix(p) if p.as_str().len() == InterfaceName::MAX_LEN => {
                format!("iifname {op}\"{p}\"")
            }
            LocalInterface::Prefix(p) => format!("iifname {op}\"{p}*\""),
        }
    }
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
    /// Empty when detect-local is off or goes by interface.
    pub local_cidrs: Vec<IpNet>,
    /// Detect-local by the interface a packet arrives on, instead of by source address
    /// (`BridgeInterface`, `InterfaceNamePrefix`). `None` with the CIDR forms and without
    /// detect-local.
    pub local_interface: Option<LocalInterface>,
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
                DetectLocal::None
                | DetectLocal::BridgeInterface(_)
                | DetectLocal::InterfaceNamePrefix(_) => Vec::new(),
                DetectLocal::ClusterCidr(c) => c.clone(),
                DetectLocal::NodeCidr => node.pod_cidrs.clone(),
            },
            local_interface: detect_local.interface(),
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

    /// Whether detect-local is on, in either form.
    pub fn detects_local(&self) -> bool {
        !self.local_cidrs.is_empty() || self.local_interface.is_some()
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
    fn interface_detect_local_carries_the_name_and_no_cidrs() {
        let mut state = ProxyState::new("node-a");
        upsert(&mut state, node_a());
        let veth = InterfaceName::new("veth").unwrap();
        let ctx = NodeContext::resolve(
            &DetectLocal::InterfaceNamePrefix(veth.clone()),
            &NodePortAddresses::AllLocal,
            &state,
        );
        assert!(ctx.local_cidrs.is_empty());
        assert_eq!(ctx.local_interface, Some(LocalInterface::Prefix(veth)));
        assert!(ctx.detects_local());
        let prefix = ctx.local_interface.unwrap();
        assert!(prefix.matches(Some("veth1")));
        assert!(prefix.matches(Some("veth")));
        assert!(!prefix.matches(Some("eth0")));
        assert!(!prefix.matches(None));
        assert_eq!(prefix.iptables(false), "-i veth+");
        assert_eq!(prefix.nft(true), "iifname != \"veth*\"");
        let bridge = LocalInterface::Bridge(InterfaceName::new("cbr0").unwrap());
        assert!(bridge.matches(Some("cbr0")));
        assert!(!bridge.matches(Some("cbr01")));
        assert!(!bridge.matches(None));
        assert_eq!(bridge.iptables(true), "! -i cbr0");
        assert_eq!(bridge.nft(false), "iifname \"cbr0\"");
        let off = NodeContext::resolve(&DetectLocal::None, &NodePortAddresses::AllLocal, &state);
        assert!(!off.detects_local());
    }

    #[test]
    fn interface_names_follow_the_kernel_and_cannot_inject() {
        for ok in [
            "cbr0",
            "veth",
            "flannel.1",
            "br-0a1b2c3d4e5f",
            "eth0.100",
            "a",
            "vlan@x",
        ] {
            assert_eq!(InterfaceName::new(ok).unwrap().as_str(), ok);
        }
        assert_eq!(InterfaceName::new(""), Err(InterfaceNameError::Empty));
        assert_eq!(
            InterfaceName::new("abcdefghijklmnop"),
            Err(InterfaceNameError::TooLong(16))
        );
        let longest = InterfaceName::new("abcdefghijklmno").unwrap();
        let whole = LocalInterface::Prefix(longest);
        assert_eq!(whole.iptables(false), "-i abcdefghijklmno");
        assert_eq!(whole.nft(false), "iifname \"abcdefghijklmno\"");
        assert!(whole.matches(Some("abcdefghijklmno")));
        assert_eq!(InterfaceName::new(".."), Err(InterfaceNameError::Dots));
        for (bad, c) in [
            ("cbr 0", ' '),
            ("a/b", '/'),
            ("eth0:1", ':'),
            ("x\"y", '"'),
            ("x'y", '\''),
            ("a\\b", '\\'),
            ("veth+", '+'),
            ("veth*", '*'),
            ("a;b", ';'),
            ("a\0b", '\0'),
            ("a\tb", '\t'),
            ("a\nb", '\n'),
            ("vé", 'é'),
            ("x}", '}'),
        ] {
            assert_eq!(
                InterfaceName::new(bad),
                Err(InterfaceNameError::Character(c)),
                "{bad:?}"
            );
        }
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
