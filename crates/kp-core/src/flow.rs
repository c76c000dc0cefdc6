//! The vocabulary of packet-flow tests: a packet, and what the proxy does with it.
//!
//! Every mode's tracer answers in these terms, and so does the real-packet harness, so one
//! table of cases runs against all of them.

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use crate::model::Protocol;

/// Where a packet enters the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Arrives on an interface from another host (prerouting).
    External,
    /// Arrives from a pod on this node (prerouting, source in the pod network).
    Pod,
    /// Sent by a process on the node itself (output).
    Node,
}

/// The first packet of a connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Packet {
    /// Where it enters.
    pub origin: Origin,
    /// Source address.
    pub src: IpAddr,
    /// L4 protocol.
    pub protocol: Protocol,
    /// Destination address.
    pub dst: IpAddr,
    /// Destination port.
    pub dport: u16,
}

impl fmt::Display for Packet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} {} {} -> {} port {}",
            self.origin, self.protocol, self.src, self.dst, self.dport
        )
    }
}

/// What the proxy's rules do with a packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Translated to one of these endpoints (each equally likely, or the affinity one).
    Dnat {
        /// The endpoints it may go to.
        endpoints: BTreeSet<(IpAddr, u16)>,
        /// Whether the source is masqueraded to the node's address.
        masquerade: bool,
        /// ClientIP affinity: later connections from this client stick to the endpoint chosen
        /// first, for this many seconds.
        affinity: Option<u32>,
    },
    /// Not a Service packet: left alone.
    Untouched,
    /// Silently dropped.
    Drop,
    /// Rejected (ICMP unreachable or TCP reset).
    Reject,
}

/// The interface a packet arrives on, for tracers of rules that match it (detect-local by
/// interface): a node's links, each with the networks routed through it. A packet from
/// outside or from a pod arrives on the link its source is routed through (what reverse-path
/// filtering holds a real node to); one the node sends itself arrives on none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ingress {
    routes: Vec<(ipnet::IpNet, String)>,
}

impl Ingress {
    /// No links yet.
    pub fn new() -> Self {
        Ingress::default()
    }

    /// Adds a link `dev` with `net` routed through it.
    pub fn route(mut self, net: ipnet::IpNet, dev: &str) -> Self {
        self.routes.push((net, dev.to_string()));
        self
    }

    /// The interface `packet` arrives on: `None` for the node's own packets, else the link
    /// of the most specific route to its source.
    ///
    /// # Panics
    /// If no link routes the source of a packet from outside or from a pod: the tracer's
    /// model of the node is incomplete, and guessing would hide it.
    pub fn interface(&self, packet: &Packet) -> Option<&str> {
        if packet.origin == Origin::Node {
            return None;
        }
        let dev = self
            .routes
            .iter()
            .filter(|(net, _)| net.contains(&packet.src))
            .max_by_key(|(net, _)| net.prefix_len())
            .map(|(_, dev)| dev.as_str());
        match dev {
            Some(d) => Some(d),
            None => panic!("no link of the tracer's node routes the source of {packet}"),
        }
    }
}

/// Whether an nftables `iifname` match (`iifname "NAME"`, `"PREFIX*"` with `prefix`, `!=` with
/// `negate`) holds for a packet that arrived on `iif`: `None` in the output hook (no input
/// device: an empty name), `Some(None)` when the tracer was built without the node's links
/// (`tracer` names the constructor that takes them), else the link.
///
/// # Panics
/// With `Some(None)`: the tracer cannot tell the interface, and guessing would hide it.
pub fn iifname_matches(
    iif: Option<Option<&str>>,
    name: &str,
    prefix: bool,
    negate: bool,
    tracer: &str,
) -> bool {
    let on = match iif {
        None => false,
        Some(Some(i)) if prefix => i.starts_with(name),
        Some(Some(i)) => i == name,
        Some(None) => panic!(
            "a rule matches iifname {name:?}, and the tracer has no links to tell the interface \
             a packet from outside or from a pod arrives on: build it with {tracer}"
        ),
    };
    on != negate
}

/// Follows a packet through a mode's rendered rules, without a kernel.
pub trait Tracer {
    /// What happens to `packet`.
    fn trace(&self, packet: &Packet) -> Verdict;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(origin: Origin, src: &str) -> Packet {
        Packet {
            origin,
            src: src.parse().unwrap(),
            protocol: Protocol::Tcp,
            dst: "10.96.0.10".parse().unwrap(),
            dport: 80,
        }
    }

    #[test]
    fn ingress_is_the_most_specific_route_to_the_source_and_none_for_the_node() {
        let links = Ingress::new()
            .route("0.0.0.0/0".parse().unwrap(), "eth0")
            .route("10.244.1.0/24".parse().unwrap(), "cbr0")
            .route("10.244.1.12/32".parse().unwrap(), "veth2");
        assert_eq!(
            links.interface(&packet(Origin::External, "192.0.2.2")),
            Some("eth0")
        );
        assert_eq!(
            links.interface(&packet(Origin::Pod, "10.244.1.11")),
            Some("cbr0")
        );
        assert_eq!(
            links.interface(&packet(Origin::Pod, "10.244.1.12")),
            Some("veth2")
        );
        assert_eq!(links.interface(&packet(Origin::Node, "10.244.1.12")), None);
    }

    #[test]
    #[should_panic(expected = "no link")]
    fn an_unrouted_source_is_not_guessed() {
        Ingress::new().interface(&packet(Origin::Pod, "10.244.1.11"));
    }
}
