//! The maps' binary layout: the one place that says how a key or value is laid out in bytes.
//! `crates/kp-ebpf/bpf/maps.h` declares the same structs for the programs; the tests here pin
//! the offsets the header relies on.
//!
//! Every address is 16 bytes: an IPv6 address as is, an IPv4 address IPv4-mapped
//! (`::ffff:a.b.c.d`), so one map serves both families and the programs compare one layout.
//! Ports are in network byte order (as the kernel hands them to the programs); ids, slots and
//! counts in the host's order.

use std::net::{IpAddr, Ipv6Addr};

use kp_core::model::Protocol;

/// Size of a services map key ([`ServiceKey::to_bytes`]).
pub const SERVICE_KEY_SIZE: usize = 24;
/// Size of a services map value ([`ServiceValue::to_bytes`]).
pub const SERVICE_VALUE_SIZE: usize = 16;
/// Size of a backends map value ([`Backend::to_bytes`]).
pub const BACKEND_SIZE: usize = 20;
/// Size of a reverse-NAT map value ([`RevNat::to_bytes`]).
pub const REV_NAT_SIZE: usize = 20;
/// Size of an address map key's data ([`AddrKey::data`]), after its `u32` prefix length.
pub const ADDR_DATA_SIZE: usize = 16;
/// Size of a source-range map key's data ([`RangeKey::data`]), after its `u32` prefix length.
pub const RANGE_DATA_SIZE: usize = 20;
/// Size of a connection-table key (`struct kp_ct_key`).
pub const CT_KEY_SIZE: usize = 40;
/// Size of a connection-table value (`struct kp_ct_val`).
pub const CT_VALUE_SIZE: usize = 40;
/// Offset of a connection-table value's `seen` (`u16`, the host's order): when the tc path
/// last used the entry, on [`ct_clock`].
pub const CT_SEEN_OFFSET: usize = 38;
/// Size of the socket hooks' affinity key (`struct kp_aff_key`: network namespace cookie (8),
/// reverse-NAT id (2), padding).
pub const AFFINITY_KEY_SIZE: usize = 16;
/// Size of the tc path's affinity key (`struct kp_aff_out_key`: the client's address (16,
/// IPv4-mapped), reverse-NAT id (2), padding).
pub const AFFINITY_OUTSIDE_KEY_SIZE: usize = 20;
/// Size of both affinity maps' value (`struct kp_aff_val`: backend id (4), slot (2), padding,
/// last use in ns (8)).
pub const AFFINITY_VALUE_SIZE: usize = 16;
/// Entries of a Maglev lookup table (`KP_MAGLEV_M` in maps.h), a prime: every skip of a
/// backend's permutation (1..M) is then coprime with it, so each permutation visits every
/// entry. 991 is about 100 entries per backend for 10 backends, where the tables stay within
/// one entry of an even share (the fill is round robin) and a change of one backend moves few
/// other clients. A table's 1,982 bytes (its slots are `u16`) and the hash map's element header
/// fit one 2 KiB kernel allocation (measured on 6.18: 1021 entries take 4 KiB each); only
/// frontends under `sh`/`mh` have one.
pub const MAGLEV_M: usize = 991;
/// Size of a Maglev map value (`struct kp_maglev_val`): [`MAGLEV_M`] slots of 2 bytes.
pub const MAGLEV_VALUE_SIZE: usize = 2 * MAGLEV_M;

/// [`ServiceValue::flags`]: a frontend without backends drops (its Local policy has endpoints
/// on other nodes only) instead of rejecting.
pub const FLAG_DROP_EMPTY: u8 = 0x1;
/// [`ServiceValue::flags`]: from outside the node (the tc path), the client's address is kept
/// (`externalTrafficPolicy: Local`); without it, the tc path masquerades.
pub const FLAG_KEEP_SOURCE: u8 = 0x2;
/// [`ServiceValue::flags`]: from outside the node, only sources inside the frontend's
/// source ranges (the source-range map under its reverse-NAT id) are served; others drop.
pub const FLAG_SRC_RANGES: u8 = 0x4;
/// [`ServiceValue::flags`]: a new connection's backend is the one the frontend's Maglev table
/// (the Maglev map under its reverse-NAT id) gives the client's hash ([`client_hash`]): the
/// `sh` and `mh` schedulers. Without it (or without the table), a random slot.
pub const FLAG_MAGLEV: u8 = 0x8;

/// Which traffic a services map entry serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// Connections from the node and its pods (the socket hooks), and traffic from outside the
    /// node to a frontend that has no [`Scope::Outside`] entry.
    #[default]
    Socket,
    /// Traffic from outside the node (the tc path), where it differs: an
    /// `externalTrafficPolicy: Local` frontend (local endpoints, the client's address kept), a
    /// LoadBalancer frontend with source ranges.
    Outside,
}

impl Scope {
    /// The key byte (`KP_SCOPE_*`).
    pub fn to_byte(self) -> u8 {
        match self {
            Scope::Socket => 0,
            Scope::Outside => 1,
        }
    }

    /// Reads a key byte back.
    pub fn from_byte(b: u8) -> Option<Scope> {
        match b {
            0 => Some(Scope::Socket),
            1 => Some(Scope::Outside),
            _ => None,
        }
    }
}

/// The IANA protocol number the kernel uses (`IPPROTO_*`).
pub fn ip_proto(p: Protocol) -> u8 {
    p.ip_number()
}

/// The protocol of an `IPPROTO_*` number this mode programs.
pub fn protocol_of(n: u8) -> Option<Protocol> {
    match n {
        6 => Some(Protocol::Tcp),
        17 => Some(Protocol::Udp),
        132 => Some(Protocol::Sctp),
        _ => None,
    }
}

/// An address as the maps hold it: 16 bytes, IPv4 mapped.
pub fn addr_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The address 16 map bytes stand for (IPv4-mapped ones as IPv4).
pub fn addr_of(bytes: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(bytes);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

fn take<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    bytes.get(at..at + N)?.try_into().ok()
}

/// A services map key: a frontend (address, port, protocol) and a slot. Slot 0 holds the
/// frontend's backend count, slots 1..=count its backends' ids (Cilium's layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    /// The frontend.
    pub frontend: FrontendAddr,
    /// 0 for the count, 1..=count for a backend.
    pub slot: u16,
}

/// A frontend's address, port and protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendAddr {
    /// The address clients connect to.
    pub ip: IpAddr,
    /// The port, host order.
    pub port: u16,
    /// The protocol.
    pub protocol: Protocol,
    /// Which traffic the entry serves.
    pub scope: Scope,
}

impl FrontendAddr {
    /// A UDP frontend of the socket hooks: the kind whose connected sockets can go stale.
    pub fn is_socket_udp(&self) -> bool {
        self.protocol == Protocol::Udp && self.scope == Scope::Socket
    }

    /// Its address and port.
    pub fn socket_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::new(self.ip, self.port)
    }
}

impl ServiceKey {
    /// The key's bytes: address (16), port (network order, 2), slot (2), protocol (1), scope
    /// (1), padding (2).
    pub fn to_bytes(&self) -> [u8; SERVICE_KEY_SIZE] {
        let mut b = [0u8; SERVICE_KEY_SIZE];
        b[..16].copy_from_slice(&addr_bytes(self.frontend.ip));
        b[16..18].copy_from_slice(&self.frontend.port.to_be_bytes());
        b[18..20].copy_from_slice(&self.slot.to_ne_bytes());
        b[20] = ip_proto(self.frontend.protocol);
        b[21] = self.frontend.scope.to_byte();
        b
    }

    /// Reads a key back; `None` for bytes this layout never writes.
    pub fn from_bytes(b: &[u8]) -> Option<ServiceKey> {
        if b.len() != SERVICE_KEY_SIZE || b[22..].iter().any(|x| *x != 0) {
            return None;
        }
        Some(ServiceKey {
            frontend: FrontendAddr {
                ip: addr_of(take(b, 0)?),
                port: u16::from_be_bytes(take(b, 16)?),
                protocol: protocol_of(b[20])?,
                scope: Scope::from_byte(b[21])?,
            },
            slot: u16::from_ne_bytes(take(b, 18)?),
        })
    }
}

/// A services map value. In slot 0: `backend_id` 0, the frontend's backend `count`, its ClientIP
/// `affinity` timeout and `flags`; in a backend slot: the backend's id and the rest 0 (so a
/// count change rewrites one entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceValue {
    /// The backend (slots 1..), or 0 (slot 0).
    pub backend_id: u32,
    /// The backend count (slot 0), or 0.
    pub count: u16,
    /// The frontend's reverse-NAT id (every slot, so a program holding any slot finds it).
    pub rev_nat: u16,
    /// ClientIP affinity timeout in seconds (slot 0); 0 without affinity.
    pub affinity: u32,
    /// [`FLAG_DROP_EMPTY`] (slot 0), or 0.
    pub flags: u8,
}

impl ServiceValue {
    /// A backend slot's value.
    pub fn slot(backend_id: u32, rev_nat: u16) -> ServiceValue {
        ServiceValue {
            backend_id,
            count: 0,
            rev_nat,
            affinity: 0,
            flags: 0,
        }
    }

    /// The value's bytes: backend id (4), count (2), reverse-NAT id (2), affinity (4), flags
    /// (1), padding (3).
    pub fn to_bytes(&self) -> [u8; SERVICE_VALUE_SIZE] {
        let mut b = [0u8; SERVICE_VALUE_SIZE];
        b[..4].copy_from_slice(&self.backend_id.to_ne_bytes());
        b[4..6].copy_from_slice(&self.count.to_ne_bytes());
        b[6..8].copy_from_slice(&self.rev_nat.to_ne_bytes());
        b[8..12].copy_from_slice(&self.affinity.to_ne_bytes());
        b[12] = self.flags;
        b
    }

    /// Reads a value back; `None` for bytes this layout never writes.
    pub fn from_bytes(b: &[u8]) -> Option<ServiceValue> {
        if b.len() != SERVICE_VALUE_SIZE || b[13..].iter().any(|x| *x != 0) {
            return None;
        }
        Some(ServiceValue {
            backend_id: u32::from_ne_bytes(take(b, 0)?),
            count: u16::from_ne_bytes(take(b, 4)?),
            rev_nat: u16::from_ne_bytes(take(b, 6)?),
            affinity: u32::from_ne_bytes(take(b, 8)?),
            flags: b[12],
        })
    }
}

/// An address map key (an LPM trie): a prefix, in its own family's length (0..=32 for IPv4,
/// held IPv4-mapped with 96 more bits; 0..=128 for IPv6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AddrKey {
    /// The prefix's address (host bits clear).
    pub ip: IpAddr,
    /// Its length in `ip`'s family.
    pub len: u8,
}

impl AddrKey {
    /// One address.
    pub fn host(ip: IpAddr) -> AddrKey {
        AddrKey {
            ip,
            len: if ip.is_ipv4() { 32 } else { 128 },
        }
    }

    /// The trie's prefix length: `len`, plus 96 for an IPv4-mapped prefix.
    pub fn trie_len(&self) -> u32 {
        u32::from(self.len) + if self.ip.is_ipv4() { 96 } else { 0 }
    }

    /// The trie key's data: the 16 address bytes.
    pub fn data(&self) -> [u8; ADDR_DATA_SIZE] {
        addr_bytes(self.ip)
    }

    /// Reads a trie key back; `None` for a prefix this layout never writes (an IPv4-mapped
    /// address under 96 bits).
    pub fn from_trie(trie_len: u32, data: [u8; ADDR_DATA_SIZE]) -> Option<AddrKey> {
        let ip = addr_of(data);
        let len = match ip {
            IpAddr::V4(_) => trie_len.checked_sub(96)?,
            IpAddr::V6(_) => trie_len,
        };
        let len = u8::try_from(len).ok()?;
        (len <= if ip.is_ipv4() { 32 } else { 128 }).then_some(AddrKey { ip, len })
    }
}

/// A source-range map key (an LPM trie): a frontend's reverse-NAT id and a source prefix it
/// admits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RangeKey {
    /// The frontend's reverse-NAT id.
    pub rev_nat: u16,
    /// The source prefix.
    pub prefix: AddrKey,
}

impl RangeKey {
    /// The trie's prefix length: 32 (the id and padding) plus the address prefix's.
    pub fn trie_len(&self) -> u32 {
        32 + self.prefix.trie_len()
    }

    /// The trie key's data: reverse-NAT id (2, host order), padding (2), address (16).
    pub fn data(&self) -> [u8; RANGE_DATA_SIZE] {
        let mut b = [0u8; RANGE_DATA_SIZE];
        b[..2].copy_from_slice(&self.rev_nat.to_ne_bytes());
        b[4..].copy_from_slice(&self.prefix.data());
        b
    }

    /// Reads a trie key back; `None` for one this layout never writes.
    pub fn from_trie(trie_len: u32, data: [u8; RANGE_DATA_SIZE]) -> Option<RangeKey> {
        if data[2..4] != [0, 0] {
            return None;
        }
        Some(RangeKey {
            rev_nat: u16::from_ne_bytes(take(&data, 0)?),
            prefix: AddrKey::from_trie(trie_len.checked_sub(32)?, take(&data, 4)?)?,
        })
    }
}

/// What an address map entry does with a call to an address no frontend matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AddrVerdict {
    /// Refused: a ClusterIP on a port or protocol no Service uses (upstream rejects).
    Reject,
    /// Dropped: an address inside a Service CIDR that no Service holds (upstream drops).
    Drop,
}

impl AddrVerdict {
    /// The value byte (`KP_ADDR_*` in maps.h).
    pub fn to_byte(self) -> u8 {
        match self {
            AddrVerdict::Reject => 1,
            AddrVerdict::Drop => 2,
        }
    }

    /// Reads a value byte back.
    pub fn from_byte(b: u8) -> Option<AddrVerdict> {
        match b {
            1 => Some(AddrVerdict::Reject),
            2 => Some(AddrVerdict::Drop),
            _ => None,
        }
    }
}

/// A backends map value (key: the backend's `u32` id, host order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Backend {
    /// The endpoint's address.
    pub ip: IpAddr,
    /// The endpoint's port, host order.
    pub port: u16,
    /// The protocol.
    pub protocol: Protocol,
}

impl Backend {
    /// The value's bytes: address (16), port (network order, 2), protocol (1), padding (1).
    pub fn to_bytes(&self) -> [u8; BACKEND_SIZE] {
        let mut b = [0u8; BACKEND_SIZE];
        b[..16].copy_from_slice(&addr_bytes(self.ip));
        b[16..18].copy_from_slice(&self.port.to_be_bytes());
        b[18] = ip_proto(self.protocol);
        b
    }

    /// Reads a value back.
    pub fn from_bytes(b: &[u8]) -> Option<Backend> {
        if b.len() != BACKEND_SIZE || b[19] != 0 {
            return None;
        }
        Some(Backend {
            ip: addr_of(take(b, 0)?),
            port: u16::from_be_bytes(take(b, 16)?),
            protocol: protocol_of(b[18])?,
        })
    }
}

/// The backend an endpoint that another mode still answers for is.
impl From<kp_core::dataplane::HeldBackend> for Backend {
    fn from(h: kp_core::dataplane::HeldBackend) -> Backend {
        Backend {
            ip: h.addr.ip(),
            port: h.addr.port(),
            protocol: h.protocol,
        }
    }
}

/// A reverse-NAT map value (key: the frontend's `u16` id, host order): the address and port a
/// reply from a backend is given back, so the client sees the frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RevNat {
    /// The frontend's address.
    pub ip: IpAddr,
    /// The frontend's port, host order.
    pub port: u16,
}

impl RevNat {
    /// The value's bytes: address (16), port (network order, 2), padding (2).
    pub fn to_bytes(&self) -> [u8; REV_NAT_SIZE] {
        let mut b = [0u8; REV_NAT_SIZE];
        b[..16].copy_from_slice(&addr_bytes(self.ip));
        b[16..18].copy_from_slice(&self.port.to_be_bytes());
        b
    }

    /// Reads a value back.
    pub fn from_bytes(b: &[u8]) -> Option<RevNat> {
        if b.len() != REV_NAT_SIZE || b[18..].iter().any(|x| *x != 0) {
            return None;
        }
        Some(RevNat {
            ip: addr_of(take(b, 0)?),
            port: u16::from_be_bytes(take(b, 16)?),
        })
    }
}

/// Size of a stale-UDP map key ([`StaleUdp::to_bytes`], `struct kp_stale_key` in
/// `bpf/udp_destroy.c`).
pub const STALE_UDP_SIZE: usize = 40;

/// A UDP frontend the socket hooks serve and a backend it no longer has: connected sockets the
/// hooks sent to that backend for that frontend are destroyed (the key of `kp_stale`, which the
/// socket iterator looks up; also what it writes for each socket it destroyed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StaleUdp {
    /// The frontend's address and port.
    pub frontend: std::net::SocketAddr,
    /// The backend's address and port.
    pub backend: std::net::SocketAddr,
}

impl StaleUdp {
    /// The key's bytes: frontend address (16), backend address (16), frontend port (network
    /// order, 2), backend port (2), padding (4).
    pub fn to_bytes(&self) -> [u8; STALE_UDP_SIZE] {
        let mut b = [0u8; STALE_UDP_SIZE];
        b[..16].copy_from_slice(&addr_bytes(self.frontend.ip()));
        b[16..32].copy_from_slice(&addr_bytes(self.backend.ip()));
        b[32..34].copy_from_slice(&self.frontend.port().to_be_bytes());
        b[34..36].copy_from_slice(&self.backend.port().to_be_bytes());
        b
    }

    /// Reads a key back (as the iterator writes it).
    pub fn from_bytes(b: &[u8]) -> Option<StaleUdp> {
        if b.len() != STALE_UDP_SIZE || b[36..].iter().any(|x| *x != 0) {
            return None;
        }
        Some(StaleUdp {
            frontend: std::net::SocketAddr::new(
                addr_of(take(b, 0)?),
                u16::from_be_bytes(take(b, 32)?),
            ),
            backend: std::net::SocketAddr::new(
                addr_of(take(b, 16)?),
                u16::from_be_bytes(take(b, 34)?),
            ),
        })
    }
}

/// A frontend's Maglev lookup table as the Maglev map holds it (key: the frontend's `u16`
/// reverse-NAT id, host order): for each of the [`MAGLEV_M`] entries, a backend slot of the
/// frontend (1..=count). The planner fills it from the backends' names, so it depends only on
/// the frontend's set of backends; slots encode it, as the programs then reach the backend
/// (and record ClientIP affinity) exactly as for a random pick.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MaglevTable(Box<[u16]>);

impl MaglevTable {
    /// A table of these slots; `None` unless there are [`MAGLEV_M`] of them, none 0.
    pub fn new(slots: Vec<u16>) -> Option<MaglevTable> {
        (slots.len() == MAGLEV_M && !slots.contains(&0)).then(|| MaglevTable(slots.into()))
    }

    /// The slots, entry by entry.
    pub fn slots(&self) -> &[u16] {
        &self.0
    }

    /// The slot a client of hash `hash` ([`client_hash`]) is given: entry `hash % M`.
    pub fn slot_for(&self, hash: u32) -> u16 {
        self.0[maglev_index(hash)]
    }

    /// The value's bytes: each slot (2, host order).
    pub fn to_bytes(&self) -> [u8; MAGLEV_VALUE_SIZE] {
        let mut b = [0u8; MAGLEV_VALUE_SIZE];
        for (chunk, slot) in b.chunks_exact_mut(2).zip(self.0.iter()) {
            chunk.copy_from_slice(&slot.to_ne_bytes());
        }
        b
    }

    /// Reads a value back; `None` for bytes this layout never writes (a slot 0).
    pub fn from_bytes(b: &[u8]) -> Option<MaglevTable> {
        if b.len() != MAGLEV_VALUE_SIZE {
            return None;
        }
        MaglevTable::new(
            b.chunks_exact(2)
                .map(|c| u16::from_ne_bytes([c[0], c[1]]))
                .collect(),
        )
    }

    /// How many entries each slot holds, by slot.
    pub fn shares(&self) -> std::collections::BTreeMap<u16, usize> {
        let mut out = std::collections::BTreeMap::new();
        for s in self.0.iter() {
            *out.entry(*s).or_insert(0) += 1;
        }
        out
    }
}

/// Short: the share of each slot, not 991 numbers.
impl std::fmt::Debug for MaglevTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MaglevTable(entries by slot {:?})", self.shares())
    }
}

/// The Maglev entry a client hash selects (`hash % KP_MAGLEV_M`, as the programs compute it).
pub fn maglev_index(hash: u32) -> usize {
    // u32 into usize: lossless on the 32- and 64-bit targets this runs on.
    (hash % MAGLEV_M as u32) as usize
}

/// The programs' hash of a client (`client_hash` in sock.c): four 32-bit words, each mixed in
/// with MurmurHash3's 32-bit finalizer. The contract between the programs and whoever predicts
/// their pick (the tracer, tests).
pub fn client_hash(words: [u32; 4]) -> u32 {
    fn mix(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^= h >> 16;
        h
    }
    words.iter().fold(CLIENT_HASH_SEED, |h, w| mix(h ^ w))
}

/// The seed of [`client_hash`] (`KP_HASH_SEED` in sock.c).
pub const CLIENT_HASH_SEED: u32 = 0x9e37_79b9;

/// The hash of a client outside the node, by its packets' source address (the tc path; as IPVS
/// `sh` hashes the source address): the 16 map bytes (IPv4-mapped) as four words in the
/// machine's order, as the program holds them.
pub fn address_hash(ip: IpAddr) -> u32 {
    let b = addr_bytes(ip);
    let word = |i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    client_hash([word(0), word(4), word(8), word(12)])
}

/// The hash of a client of the socket hooks, by its network namespace's cookie (the key of its
/// ClientIP affinity too): the low and the high 32 bits, then two zero words.
pub fn netns_hash(cookie: u64) -> u32 {
    // Truncations meant: the cookie's two halves.
    client_hash([cookie as u32, (cookie >> 32) as u32, 0, 0])
}

/// The connection table's clock (`ct_clock` in tc.c): `CLOCK_MONOTONIC` nanoseconds (the
/// programs' `bpf_ktime_get_ns`) in units of 2^30 ns, about a second, wrapping at 16 bits
/// (about 20 hours).
pub fn ct_clock(monotonic_ns: u64) -> u16 {
    // Truncation meant: the clock wraps.
    (monotonic_ns >> 30) as u16
}

/// How long before `CLOCK_MONOTONIC` `now_ns` the connection-table value `value` was last used,
/// to within a unit of [`ct_clock`] (an age past the clock's wrap reads modulo it). Read the
/// clock after the value: the programs stamp entries all the time, and a stamp newer than
/// `now_ns` would wrap to some 20 hours. One that is still found a unit or two ahead (a clock
/// read before a long walk of the map) reads as just used.
pub fn ct_idle(value: &[u8; CT_VALUE_SIZE], now_ns: u64) -> std::time::Duration {
    const AHEAD: u16 = 2;
    let seen = u16::from_ne_bytes([value[CT_SEEN_OFFSET], value[CT_SEEN_OFFSET + 1]]);
    let units = ct_clock(now_ns).wrapping_sub(seen);
    if units > u16::MAX - AHEAD {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::from_nanos(u64::from(units) << 30)
}

#[cfg(test)]
mod ct_tests {
    use super::*;
    use std::time::Duration;

    fn used_at(ns: u64) -> [u8; CT_VALUE_SIZE] {
        let mut v = [0xaa; CT_VALUE_SIZE];
        v[CT_SEEN_OFFSET..CT_SEEN_OFFSET + 2].copy_from_slice(&ct_clock(ns).to_ne_bytes());
        v
    }

    #[test]
    fn a_connection_entry_s_idle_time_reads_its_stamp_across_the_clock_s_wrap() {
        let unit = 1u64 << 30;
        let t = 5_000 * unit + 12;
        assert_eq!(ct_idle(&used_at(t), t), Duration::ZERO);
        assert_eq!(
            ct_idle(&used_at(t), t + 90 * unit),
            Duration::from_nanos(90 * unit)
        );
        // Stamped just before the 16-bit clock wraps, read just after.
        let before = 65_535 * unit;
        assert_eq!(
            ct_idle(&used_at(before), before + 3 * unit),
            Duration::from_nanos(3 * unit)
        );
        // Stamped after the clock was read (a packet during a walk of the map): just used,
        // not twenty hours ago.
        assert_eq!(ct_idle(&used_at(t + unit), t), Duration::ZERO);
        assert_eq!(ct_idle(&used_at(t + 2 * unit), t), Duration::ZERO);
        // The stamp is the two bytes at its offset, nothing else.
        let mut v = used_at(t);
        v[..CT_SEEN_OFFSET].fill(0);
        assert_eq!(ct_idle(&v, t + unit), Duration::from_nanos(unit));
    }
}
