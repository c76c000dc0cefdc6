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

/// Makes atoms comparable whatever way they were spelled: slots and ports are both numbers (the
/// kernel and nft's listing cannot tell them apart), and a single-address network is an
/// address. Read-back tables are kept in this form.
pub fn canonical(t: &Tuple) -> Tuple {
    Tuple::new(
        t.atoms()
            .iter()
            .map(|a| canonical_atom(*a))
            .collect::<Vec<_>>(),
    )
}

/// [`canonical`] for one atom.
fn canonical_atom(a: Atom) -> Atom {
    match a {
        Atom::Slot(s) if s <= u32::from(u16::MAX) => Atom::Port(s as u16),
        Atom::Net(n) if n.prefix_len() == n.max_prefix_len() => Atom::Ip(n.addr()),
        a => a,
    }
}

/// One element as the periodic drift check keeps it: a 64-bit digest of its key and one of its
/// value, 16 bytes whatever the element, instead of the element itself (at 10k Services the
/// read-back of every element as tuples was most of the proxy's peak memory).
///
/// Both digests are of the [`canonical`] spelling, so an element read back from the kernel
/// (slots as numbers, single-address networks as addresses) and the same element as the planner
/// spells it have the same digests. The hash is std's SipHash-1-3 with fixed keys
/// ([`std::hash::DefaultHasher::new`]) over each atom's tagged bytes; it is the same for the
/// same atoms within one process, which is all a comparison needs (digests are never stored or
/// sent). Two different keys, or two different values of one key, with the same digest would
/// hide a difference, never invent one: the chance is about 2^-64 per pair compared, so below
/// 10^-13 for a check of a million elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ElementDigest {
    /// The key's digest ([`ElementDigest::key_of`]).
    pub key: u64,
    /// The value's digest ([`ElementDigest::value_of`]).
    pub value: u64,
}

/// What the digests hash before the atoms, so that a key, a value and a missing value never
/// share a digest by construction.
const DIGEST_KEY: u8 = 1;
const DIGEST_VALUE: u8 = 2;
const DIGEST_NO_VALUE: u8 = 3;

impl ElementDigest {
    /// The digests of the element `key` (with `value` in a map, `None` in a set).
    pub fn of(key: &[Atom], value: Option<&[Atom]>) -> Self {
        ElementDigest {
            key: Self::key_of(key),
            value: Self::value_of(value),
        }
    }

    /// The digest of a key, however it is spelled ([`canonical`]).
    pub fn key_of(key: &[Atom]) -> u64 {
        digest_atoms(DIGEST_KEY, key)
    }

    /// The digest of a value, `None` for a set element's missing one.
    pub fn value_of(value: Option<&[Atom]>) -> u64 {
        match value {
            Some(v) => digest_atoms(DIGEST_VALUE, v),
            None => digest_atoms(DIGEST_NO_VALUE, &[]),
        }
    }
}

/// SipHash-1-3 with fixed keys of `kind`, then each canonical atom's tag and bytes (as
/// [`Packed`] lays them out: the tag fixes the length, so the concatenation is unambiguous).
/// The bytes are gathered on the stack and hashed in one write (an element's atoms take at most
/// about 60 bytes): the check digests every element of the table on the sync loop's thread.
fn digest_atoms(kind: u8, atoms: &[Atom]) -> u64 {
    use std::hash::Hasher;
    let mut h = std::hash::DefaultHasher::new();
    let mut buf = [0u8; 128];
    buf[0] = kind;
    let mut len = 1;
    for a in atoms {
        if len + 18 > buf.len() {
            h.write(&buf[..len]);
            len = 0;
        }
        let mut one = [0u8; 18];
        let n = encode_atom(&canonical_atom(*a), &mut one);
        buf[len..len + n].copy_from_slice(&one[..n]);
        len += n;
    }
    h.write(&buf[..len]);
    h.finish()
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

/// Atoms packed into `N` bytes, for the planner's record of what the kernel holds: each atom is
/// a tag byte and its bytes in network order, and zeros follow the last one. No heap, `Copy`,
/// cheap to hash. An IPv4 table's keys fit in 16 bytes and its values in 8; an IPv6 table's in
/// 40 and 24. The all-zero value holds no atoms (a set element's missing value).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Packed<const N: usize>([u8; N]);

/// The most atoms a tuple gathered on the stack holds (elements have at most five).
const MAX_ATOMS: usize = 8;

const TAG_END: u8 = 0;
const TAG_IP4: u8 = 1;
const TAG_IP6: u8 = 2;
const TAG_NET4: u8 = 3;
const TAG_NET6: u8 = 4;
const TAG_PROTO: u8 = 5;
const TAG_PORT: u8 = 6;
const TAG_SLOT: u8 = 7;
const TAG_VERDICT: u8 = 8;

impl<const N: usize> Packed<N> {
    /// No atoms.
    pub(crate) const EMPTY: Self = Packed([0; N]);

    /// Packs `atoms`; `None` if they do not fit.
    pub(crate) fn new(atoms: &[Atom]) -> Option<Self> {
        let mut out = [0u8; N];
        let mut at = 0;
        for atom in atoms {
            let mut buf = [0u8; 18];
            let len = encode_atom(atom, &mut buf);
            out.get_mut(at..at + len)?.copy_from_slice(&buf[..len]);
            at += len;
        }
        Some(Packed(out))
    }

    /// Whether it holds no atoms.
    pub(crate) fn is_empty(&self) -> bool {
        self.0[0] == TAG_END
    }

    /// The atoms, in order.
    pub(crate) fn atoms(&self) -> impl Iterator<Item = Atom> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            let (atom, len) = decode_atom(self.0.get(at..)?)?;
            at += len;
            Some(atom)
        })
    }

    /// Replaces the contents of `out` with the atoms: no allocation once `out` has room.
    pub(crate) fn gather(&self, out: &mut Vec<Atom>) {
        out.clear();
        out.extend(self.atoms());
    }

    /// As a [`Tuple`].
    pub(crate) fn to_tuple(self) -> Tuple {
        self.to_tuple_with(None)
    }

    /// As a [`Tuple`], with `last` appended (a slot, say). One allocation: the atoms are
    /// gathered on the stack first.
    pub(crate) fn to_tuple_with(self, last: Option<Atom>) -> Tuple {
        let mut buf = [Atom::Port(0); MAX_ATOMS];
        let mut n = 0;
        for atom in self.atoms().chain(last) {
            match buf.get_mut(n) {
                Some(slot) => *slot = atom,
                // Longer than any element the planner makes; still correct, just slower.
                None => return Tuple::new(self.atoms().chain(last).collect::<Vec<_>>()),
            }
            n += 1;
        }
        Tuple::new(&buf[..n])
    }
}

impl<const N: usize> fmt::Display for Packed<N> {
    /// As the [`Tuple`] of the same atoms.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.atoms().enumerate() {
            if i > 0 {
                f.write_str(" . ")?;
            }
            write!(f, "{a}")?;
        }
        Ok(())
    }
}

impl<const N: usize> fmt::Debug for Packed<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Packed({self})")
    }
}

/// Writes one atom's tag and bytes; returns how many.
fn encode_atom(atom: &Atom, buf: &mut [u8; 18]) -> usize {
    fn ip(buf: &mut [u8], ip: &IpAddr) -> usize {
        match ip {
            IpAddr::V4(a) => {
                buf[..4].copy_from_slice(&a.octets());
                4
            }
            IpAddr::V6(a) => {
                buf[..16].copy_from_slice(&a.octets());
                16
            }
        }
    }
    match atom {
        Atom::Ip(a) => {
            buf[0] = if a.is_ipv4() { TAG_IP4 } else { TAG_IP6 };
            1 + ip(&mut buf[1..], a)
        }
        Atom::Net(n) => {
            let addr = n.addr();
            buf[0] = if addr.is_ipv4() { TAG_NET4 } else { TAG_NET6 };
            let len = 1 + ip(&mut buf[1..], &addr);
            buf[len] = n.prefix_len();
            len + 1
        }
        Atom::Proto(p) => {
            buf[0] = TAG_PROTO;
            buf[1] = match p {
                Protocol::Tcp => 0,
                Protocol::Udp => 1,
                Protocol::Sctp => 2,
            };
            2
        }
        Atom::Port(p) => {
            buf[0] = TAG_PORT;
            buf[1..3].copy_from_slice(&p.to_be_bytes());
            3
        }
        Atom::Slot(s) => {
            buf[0] = TAG_SLOT;
            buf[1..5].copy_from_slice(&s.to_be_bytes());
            5
        }
        Atom::Verdict(v) => {
            buf[0] = TAG_VERDICT;
            buf[1] = match v {
                NoEndpointVerdict::Reject => 0,
                NoEndpointVerdict::Drop => 1,
            };
            2
        }
    }
}

/// Reads one atom; `None` at the end (or on bytes [`encode_atom`] never writes).
fn decode_atom(b: &[u8]) -> Option<(Atom, usize)> {
    let v4 = |b: &[u8]| -> Option<std::net::Ipv4Addr> {
        Some(<[u8; 4]>::try_from(b.get(..4)?).ok()?.into())
    };
    let v6 = |b: &[u8]| -> Option<std::net::Ipv6Addr> {
        Some(<[u8; 16]>::try_from(b.get(..16)?).ok()?.into())
    };
    let rest = b.get(1..)?;
    Some(match *b.first()? {
        TAG_IP4 => (Atom::Ip(IpAddr::V4(v4(rest)?)), 5),
        TAG_IP6 => (Atom::Ip(IpAddr::V6(v6(rest)?)), 17),
        TAG_NET4 => {
            let net = ipnet::Ipv4Net::new(v4(rest)?, *rest.get(4)?).ok()?;
            (Atom::Net(IpNet::V4(net)), 6)
        }
        TAG_NET6 => {
            let net = ipnet::Ipv6Net::new(v6(rest)?, *rest.get(16)?).ok()?;
            (Atom::Net(IpNet::V6(net)), 18)
        }
        TAG_PROTO => (
            Atom::Proto(*Protocol::ALL.get(usize::from(*rest.first()?))?),
            2,
        ),
        TAG_PORT => (
            Atom::Port(u16::from_be_bytes(rest.get(..2)?.try_into().ok()?)),
            3,
        ),
        TAG_SLOT => (
            Atom::Slot(u32::from_be_bytes(rest.get(..4)?.try_into().ok()?)),
            5,
        ),
        TAG_VERDICT => (
            Atom::Verdict(match rest.first()? {
                0 => NoEndpointVerdict::Reject,
                1 => NoEndpointVerdict::Drop,
                _ => return None,
            }),
            2,
        ),
        _ => return None,
    })
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
    fn packed_atoms_round_trip_and_render_as_their_tuple() {
        let tuples = [
            vec![
                Atom::Ip("10.96.0.10".parse().unwrap()),
                Atom::Proto(Protocol::Sctp),
                Atom::Port(65535),
                Atom::Net("192.0.2.0/24".parse().unwrap()),
            ],
            vec![
                Atom::Proto(Protocol::Udp),
                Atom::Port(30001),
                Atom::Slot(70_000),
            ],
            vec![Atom::Verdict(NoEndpointVerdict::Reject)],
            vec![Atom::Verdict(NoEndpointVerdict::Drop)],
            vec![Atom::Net("0.0.0.0/0".parse().unwrap())],
        ];
        for atoms in tuples {
            let t = Tuple::new(atoms.clone());
            let p = Packed::<16>::new(&atoms).expect("fits in 16 bytes");
            assert_eq!(p.to_tuple(), t);
            assert_eq!(p.to_string(), t.to_string());
        }
        let v6 = [
            Atom::Ip("fd00::10".parse().unwrap()),
            Atom::Proto(Protocol::Tcp),
            Atom::Port(443),
            Atom::Net("2001:db8::/32".parse().unwrap()),
        ];
        assert!(Packed::<16>::new(&v6).is_none());
        let p = Packed::<40>::new(&v6).expect("fits in 40 bytes");
        assert_eq!(p.to_tuple(), Tuple::new(v6.to_vec()));
        let slotted = Packed::<16>::new(&[Atom::Proto(Protocol::Tcp), Atom::Port(80)])
            .unwrap()
            .to_tuple_with(Some(Atom::Slot(3)));
        assert_eq!(slotted.to_string(), "tcp . 80 . 3");
        assert!(Packed::<8>::EMPTY.is_empty());
        assert_eq!(Packed::<8>::EMPTY.atoms().count(), 0);
    }

    #[test]
    fn packed_endpoints_sort_as_address_then_port() {
        let ep = |ip: &str, port| {
            Packed::<8>::new(&[Atom::Ip(ip.parse().unwrap()), Atom::Port(port)]).unwrap()
        };
        let mut v = vec![
            ep("10.0.0.2", 80),
            ep("10.0.0.1", 8080),
            ep("10.0.0.1", 443),
        ];
        v.sort();
        assert_eq!(
            v,
            [
                ep("10.0.0.1", 443),
                ep("10.0.0.1", 8080),
                ep("10.0.0.2", 80)
            ]
        );
    }

    #[test]
    fn digests_agree_across_spellings_and_differ_across_elements() {
        let ip = |s: &str| Atom::Ip(s.parse().unwrap());
        // The planner's spelling of an endpoint-map key and the kernel read-back's.
        let planned = [
            ip("10.96.0.10"),
            Atom::Proto(Protocol::Tcp),
            Atom::Port(80),
            Atom::Slot(3),
        ];
        let read = [
            ip("10.96.0.10"),
            Atom::Proto(Protocol::Tcp),
            Atom::Port(80),
            Atom::Port(3),
        ];
        assert_eq!(
            ElementDigest::key_of(&planned),
            ElementDigest::key_of(&read)
        );
        let host: IpNet = "10.0.0.1/32".parse().unwrap();
        assert_eq!(
            ElementDigest::key_of(&[Atom::Net(host)]),
            ElementDigest::key_of(&[ip("10.0.0.1")])
        );
        let ep = [ip("10.244.0.5"), Atom::Port(8080)];
        let a = ElementDigest::of(&planned, Some(&ep));
        assert_eq!(a, ElementDigest::of(&read, Some(&ep)));
        // Any change of key or value shows.
        let other_port = [
            ip("10.96.0.10"),
            Atom::Proto(Protocol::Tcp),
            Atom::Port(81),
            Atom::Port(3),
        ];
        assert_ne!(ElementDigest::key_of(&other_port), a.key);
        assert_ne!(
            ElementDigest::of(&read, Some(&[ip("10.244.0.6"), Atom::Port(8080)])).value,
            a.value
        );
        // A set element's missing value, an empty value and a key of the same atoms differ.
        assert_ne!(
            ElementDigest::value_of(None),
            ElementDigest::value_of(Some(&[]))
        );
        assert_ne!(
            ElementDigest::value_of(Some(&ep)),
            ElementDigest::key_of(&ep)
        );
        // Slots beyond a port's range stay slots, as the read-back keeps them.
        assert_ne!(
            ElementDigest::key_of(&[Atom::Slot(70_000)]),
            ElementDigest::key_of(&[Atom::Port(70_000u32 as u16)])
        );
        // Longer than the stack buffer (more atoms than any element has): still one digest
        // per spelling, and every atom counts.
        let long: Vec<Atom> = (0..12)
            .map(|i| Atom::Ip(format!("fd00::{i}").parse().unwrap()))
            .collect();
        let mut other = long.clone();
        other[11] = ip("fd00::99");
        assert_eq!(
            ElementDigest::key_of(&long),
            ElementDigest::key_of(&long.clone())
        );
        assert_ne!(ElementDigest::key_of(&long), ElementDigest::key_of(&other));
        // Atom boundaries count: the same bytes split otherwise are another key.
        assert_ne!(
            ElementDigest::key_of(&[Atom::Port(1), Atom::Port(2)]),
            ElementDigest::key_of(&[Atom::Port(1)])
        );
    }

    #[test]
    fn garbage_does_not_parse() {
        assert!(parse_tuple("10.0.0.1 . tcp . 80; flush ruleset").is_err());
        assert!(parse_tuple("\"x\"").is_err());
    }
}
