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

/// Follows a packet through a mode's rendered rules, without a kernel.
pub trait Tracer {
    /// What happens to `packet`.
    fn trace(&self, packet: &Packet) -> Verdict;
}
