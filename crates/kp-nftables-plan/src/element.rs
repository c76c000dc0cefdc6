//! Set and map elements as typed values: rendered into nft text, parsed back by the tracer and
//! compared with the kernel by the read-back check.

use std::fmt::{self, Write};
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;

use ipnet::IpNet;
use kp_core::model::Protocol;

use crate::names;

/// What the no-endpoint verdict maps do with a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NoEndpointVerdict {
    /// No endpoint anywhere: REJECT (`goto reject-packet`).
    Reject,
    /// A Local traffic policy with no local endpoint: drop.
    Drop,
}

/// One component of an element key or value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Atom {
    /// An address.
    Ip(IpAddr),
    /// A network (interval sets).
    Net(IpNet),
    /// An L4 protocol.
    Proto(Protocol),
    /// A port.
    Port(u16),
    /// An endpoint slot (the `numgen` result).
    Slot(u32),
    /// A verdict (verdict maps).
    Verdict(NoEndpointVerdict),
}

impl fmt::Display for Atom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Atom::Ip(ip) => write!(f, "{ip}"),
            Atom::Net(net) => write!(f, "{net}"),
            Atom::Proto(p) => f.write_str(p.as_lower()),
            Atom::Port(p) => write!(f, "{p}"),
            Atom::Slot(s) => write!(f, "{s}"),
            Atom::Verdict(NoEndpointVerdict::Drop) => f.write_str("drop"),
            Atom::Verdict(NoEndpointVerdict::Reject) => write!(f, "goto {}", names::REJECT_PACKET),
        }
    }
}

/// A concatenation of atoms: an element key or a map value. Shared, because the planner keeps
/// each key both in its set and in the record of who owns it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple(pub Arc<[Atom]>);

impl Tuple {
    /// Builds a tuple.
    pub fn new(atoms: impl Into<Arc<[Atom]>>) -> Tuple {
        Tuple(atoms.into())
    }

    /// The atoms.
    pub fn atoms(&self) -> &[Atom] {
        &self.0
    }
}

impl fmt::Display for Tuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" . ")?;
            }
            write!(f, "{a}")?;
        }
        Ok(())
    }
}

/// Why element text did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot parse element atom {0:?}")]
pub struct ParseAtomError(pub String);

impl FromStr for Atom {
    type Err = ParseAtomError;

    fn from_str(s: &str) -> Result<Atom, ParseAtomError> {
        let s = s.trim();
        if let Some(p) = Protocol::ALL.iter().find(|p| p.as_lower() == s) {
            return Ok(Atom::Proto(*p));
        }
        if s == "drop" {
            return Ok(Atom::Verdict(NoEndpointVerdict::Drop));
        }
        if s.strip_prefix("goto ").map(str::trim) == Some(names::REJECT_PACKET) {
            return Ok(Atom::Verdict(NoEndpointVerdict::Reject));
        }
        if s.contains('/') {
            return IpNet::from_str(s)
                .map(Atom::Net)
                .map_err(|_| ParseAtomError(s.into()));
        }
        if let Ok(ip) = IpAddr::from_str(s) {
            return Ok(Atom::Ip(ip));
        }
        // Bare numbers: the caller decides port versus slot by position; default to port.
        s.parse::<u16>()
            .map(Atom::Port)
            .or_else(|_| s.parse::<u32>().map(Atom::Slot))
            .map_err(|_| ParseAtomError(s.into()))
    }
}

/// Parses ` . `-separated atoms.
pub fn parse_tuple(s: &str) -> Result<Tuple, ParseAtomError> {
    let atoms = s
        .split(" . ")
        .map(Atom::from_str)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tuple::new(atoms))
}

/// Renders `{ k, k }` or `{ k : v, k : v }` element lists.
pub fn render_elements<'a>(
    out: &mut String,
    elements: impl Iterator<Item = (&'a Tuple, Option<&'a Tuple>)>,
) {
    out.push_str("{ ");
    for (i, (k, v)) in elements.enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        // Writing to a String cannot fail.
        let _ = write!(out, "{k}");
        if let Some(v) = v {
            let _ = write!(out, " : {v}");
        }
    }
    out.push_str(" }");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuples_round_trip_through_text() {
        let t = Tuple::new(vec![
            Atom::Ip("10.96.0.10".parse().unwrap()),
            Atom::Proto(Protocol::Udp),
            Atom::Port(53),
        ]);
        assert_eq!(t.to_string(), "10.96.0.10 . udp . 53");
        assert_eq!(parse_tuple(&t.to_string()).unwrap(), t);
        let v6 = Tuple::new(vec![
            Atom::Ip("fd00::1".parse().unwrap()),
            Atom::Net("2001:db8::/32".parse().unwrap()),
        ]);
        assert_eq!(parse_tuple(&v6.to_string()).unwrap(), v6);
        let reject = Tuple::new(vec![Atom::Verdict(NoEndpointVerdict::Reject)]);
        assert_eq!(parse_tuple(&reject.to_string()).unwrap(), reject);
    }

    #[test]
    fn garbage_does_not_parse() {
        assert!(parse_tuple("10.0.0.1 . tcp . 80; flush ruleset").is_err());
        assert!(parse_tuple("\"x\"").is_err());
    }
}
