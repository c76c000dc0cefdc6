//! IPVS over generic netlink (family `IPVS`, `net/netfilter/ipvs/ip_vs_ctl.c`): virtual services
//! and their destinations (real servers) as types, the requests that add, change, delete and
//! dump them, and the reading of the kernel's answers. What `ipvsadm` sends, without `ipvsadm`.
//!
//! Pure: bytes in, bytes out. The family's message type is resolved at run time
//! ([`genl::get_family_request`](crate::genl::get_family_request) with [`abi::IPVS_GENL_NAME`])
//! and passed to every writer here.
//!
//! The wire, as the kernel reads and writes it: the service and the destination are nests
//! (`IPVS_CMD_ATTR_SERVICE`, `IPVS_CMD_ATTR_DEST`, not flagged `NLA_F_NESTED`, as the kernel
//! and libnl write them); numbers in host order except the ports, which travel in network order
//! inside an `NLA_U16`; addresses as the 16 bytes of `union nf_inet_addr` (an IPv4 address in
//! the first 4, the rest zero); the service's flags as `struct ip_vs_flags { flags, mask }`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::abi::{NLM_F_ACK, NLM_F_DUMP};
use crate::attr;
use crate::genl::{self, GenlHeader};
use crate::message::{self, Message};
use crate::Malformed;

/// The IPVS generic netlink numbers, under their names in `include/uapi/linux/ip_vs.h` (and the
/// address families and protocols they carry, from `linux/socket.h` and `linux/in.h`).
#[allow(missing_docs)]
pub mod abi {
    pub const IPVS_GENL_NAME: &str = "IPVS";
    pub const IPVS_GENL_VERSION: u8 = 1;

    // enum: Generic Netlink commands
    pub const IPVS_CMD_NEW_SERVICE: u8 = 1;
    pub const IPVS_CMD_SET_SERVICE: u8 = 2;
    pub const IPVS_CMD_DEL_SERVICE: u8 = 3;
    pub const IPVS_CMD_GET_SERVICE: u8 = 4;
    pub const IPVS_CMD_NEW_DEST: u8 = 5;
    pub const IPVS_CMD_SET_DEST: u8 = 6;
    pub const IPVS_CMD_DEL_DEST: u8 = 7;
    pub const IPVS_CMD_GET_DEST: u8 = 8;
    pub const IPVS_CMD_NEW_DAEMON: u8 = 9;
    pub const IPVS_CMD_DEL_DAEMON: u8 = 10;
    pub const IPVS_CMD_GET_DAEMON: u8 = 11;
    pub const IPVS_CMD_SET_CONFIG: u8 = 12;
    pub const IPVS_CMD_GET_CONFIG: u8 = 13;
    pub const IPVS_CMD_SET_INFO: u8 = 14;
    pub const IPVS_CMD_GET_INFO: u8 = 15;
    pub const IPVS_CMD_ZERO: u8 = 16;
    pub const IPVS_CMD_FLUSH: u8 = 17;

    // enum: attributes of the first level
    pub const IPVS_CMD_ATTR_SERVICE: u16 = 1;
    pub const IPVS_CMD_ATTR_DEST: u16 = 2;
    pub const IPVS_CMD_ATTR_DAEMON: u16 = 3;
    pub const IPVS_CMD_ATTR_TIMEOUT_TCP: u16 = 4;
    pub const IPVS_CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
    pub const IPVS_CMD_ATTR_TIMEOUT_UDP: u16 = 6;

    // enum: attributes inside IPVS_CMD_ATTR_SERVICE
    pub const IPVS_SVC_ATTR_AF: u16 = 1;
    pub const IPVS_SVC_ATTR_PROTOCOL: u16 = 2;
    pub const IPVS_SVC_ATTR_ADDR: u16 = 3;
    pub const IPVS_SVC_ATTR_PORT: u16 = 4;
    pub const IPVS_SVC_ATTR_FWMARK: u16 = 5;
    pub const IPVS_SVC_ATTR_SCHED_NAME: u16 = 6;
    pub const IPVS_SVC_ATTR_FLAGS: u16 = 7;
    pub const IPVS_SVC_ATTR_TIMEOUT: u16 = 8;
    pub const IPVS_SVC_ATTR_NETMASK: u16 = 9;
    pub const IPVS_SVC_ATTR_STATS: u16 = 10;
    pub const IPVS_SVC_ATTR_PE_NAME: u16 = 11;
    pub const IPVS_SVC_ATTR_STATS64: u16 = 12;
    pub const IPVS_SVC_ATTR_MAX: u16 = 12;

    // enum: attributes inside IPVS_CMD_ATTR_DEST
    pub const IPVS_DEST_ATTR_ADDR: u16 = 1;
    pub const IPVS_DEST_ATTR_PORT: u16 = 2;
    pub const IPVS_DEST_ATTR_FWD_METHOD: u16 = 3;
    pub const IPVS_DEST_ATTR_WEIGHT: u16 = 4;
    pub const IPVS_DEST_ATTR_U_THRESH: u16 = 5;
    pub const IPVS_DEST_ATTR_L_THRESH: u16 = 6;
    pub const IPVS_DEST_ATTR_ACTIVE_CONNS: u16 = 7;
    pub const IPVS_DEST_ATTR_INACT_CONNS: u16 = 8;
    pub const IPVS_DEST_ATTR_PERSIST_CONNS: u16 = 9;
    pub const IPVS_DEST_ATTR_STATS: u16 = 10;
    pub const IPVS_DEST_ATTR_ADDR_FAMILY: u16 = 11;
    pub const IPVS_DEST_ATTR_STATS64: u16 = 12;
    pub const IPVS_DEST_ATTR_TUN_TYPE: u16 = 13;
    pub const IPVS_DEST_ATTR_TUN_PORT: u16 = 14;
    pub const IPVS_DEST_ATTR_TUN_FLAGS: u16 = 15;
    pub const IPVS_DEST_ATTR_MAX: u16 = 15;

    // enum: attributes of the IPVS_CMD_GET_INFO answer
    pub const IPVS_INFO_ATTR_VERSION: u16 = 1;
    pub const IPVS_INFO_ATTR_CONN_TAB_SIZE: u16 = 2;

    // Virtual service flags
    pub const IP_VS_SVC_F_PERSISTENT: u32 = 0x0001;
    pub const IP_VS_SVC_F_HASHED: u32 = 0x0002;
    pub const IP_VS_SVC_F_ONEPACKET: u32 = 0x0004;
    pub const IP_VS_SVC_F_SCHED1: u32 = 0x0008;
    pub const IP_VS_SVC_F_SCHED2: u32 = 0x0010;
    pub const IP_VS_SVC_F_SCHED3: u32 = 0x0020;
    pub const IP_VS_SVC_F_SCHED_SH_FALLBACK: u32 = IP_VS_SVC_F_SCHED1;
    pub const IP_VS_SVC_F_SCHED_SH_PORT: u32 = IP_VS_SVC_F_SCHED2;

    // Connection flags: the forwarding methods (IP_VS_CONN_F_FWD_MASK)
    pub const IP_VS_CONN_F_FWD_MASK: u32 = 0x0007;
    pub const IP_VS_CONN_F_MASQ: u32 = 0x0000;
    pub const IP_VS_CONN_F_LOCALNODE: u32 = 0x0001;
    pub const IP_VS_CONN_F_TUNNEL: u32 = 0x0002;
    pub const IP_VS_CONN_F_DROUTE: u32 = 0x0003;
    pub const IP_VS_CONN_F_BYPASS: u32 = 0x0004;

    pub const IP_VS_SCHEDNAME_MAXLEN: usize = 16;
    /// `sizeof(union nf_inet_addr)`.
    pub const NF_INET_ADDR_LEN: usize = 16;

    // linux/socket.h
    pub const AF_INET: u16 = 2;
    pub const AF_INET6: u16 = 10;
    // linux/in.h
    pub const IPPROTO_TCP: u16 = 6;
    pub const IPPROTO_UDP: u16 = 17;
    pub const IPPROTO_SCTP: u16 = 132;
}

use abi::*;

/// The transport protocol of a virtual service (`IPVS_SVC_ATTR_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// `IPPROTO_TCP`.
    Tcp,
    /// `IPPROTO_UDP`.
    Udp,
    /// `IPPROTO_SCTP`.
    Sctp,
}

impl Protocol {
    /// The `IPPROTO_*` number.
    pub fn number(self) -> u16 {
        match self {
            Protocol::Tcp => IPPROTO_TCP,
            Protocol::Udp => IPPROTO_UDP,
            Protocol::Sctp => IPPROTO_SCTP,
        }
    }

    /// The protocol of an `IPPROTO_*` number.
    pub fn from_number(n: u16) -> Result<Protocol, Malformed> {
        Ok(match n {
            IPPROTO_TCP => Protocol::Tcp,
            IPPROTO_UDP => Protocol::Udp,
            IPPROTO_SCTP => Protocol::Sctp,
            other => return Err(Malformed(format!("IPVS protocol {other}"))),
        })
    }
}

/// Which virtual service: an address, protocol and port, or a firewall mark (of one address
/// family). The kernel finds services by this; everything else about them can change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceKey {
    /// `addr:port` over `protocol`.
    Addr {
        /// The virtual address.
        addr: IpAddr,
        /// The transport protocol.
        protocol: Protocol,
        /// The virtual port.
        port: u16,
    },
    /// Packets marked `mark`, of IPv6 if `ipv6`, else IPv4.
    Fwmark {
        /// The firewall mark (non-zero).
        mark: u32,
        /// The address family.
        ipv6: bool,
    },
}

impl ServiceKey {
    /// Whether the service is IPv6.
    pub fn is_ipv6(&self) -> bool {
        match self {
            ServiceKey::Addr { addr, .. } => addr.is_ipv6(),
            ServiceKey::Fwmark { ipv6, .. } => *ipv6,
        }
    }

    /// `AF_INET` or `AF_INET6`.
    pub fn family(&self) -> u16 {
        if self.is_ipv6() {
            AF_INET6
        } else {
            AF_INET
        }
    }
}

impl std::fmt::Display for ServiceKey {
    /// As `ipvsadm -Ln` names it: `TCP 10.0.0.1:80`, `UDP [fd00::1]:53`, `FWM 7`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceKey::Addr {
                addr,
                protocol,
                port,
            } => {
                let p = match protocol {
                    Protocol::Tcp => "TCP",
                    Protocol::Udp => "UDP",
                    Protocol::Sctp => "SCTP",
                };
                write!(f, "{p} {}", std::net::SocketAddr::new(*addr, *port))
            }
            ServiceKey::Fwmark { mark, ipv6 } => {
                write!(f, "FWM {mark}{}", if *ipv6 { " IPv6" } else { "" })
            }
        }
    }
}

/// A virtual service: what `ipvsadm -A` sets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Service {
    /// Which one.
    pub key: ServiceKey,
    /// The scheduler's name (`rr`, `wrr`, `lc`, `sh`, ...; at most 15 bytes).
    pub scheduler: String,
    /// `IP_VS_SVC_F_*` flags (persistence, scheduler flags). `IP_VS_SVC_F_HASHED`, which the
    /// kernel sets on every service it holds, is left out when a dump is read.
    pub flags: u32,
    /// The persistence timeout in seconds (with `IP_VS_SVC_F_PERSISTENT`).
    pub timeout: u32,
    /// The persistence netmask: the IPv4 mask as a number (`0xffff_ffff` for /32), or the IPv6
    /// prefix length (128).
    pub netmask: u32,
}

impl Service {
    /// A service with scheduler `scheduler`, no flags and no persistence, and the netmask
    /// `ipvsadm` uses (all ones for IPv4, 128 for IPv6).
    pub fn new(key: ServiceKey, scheduler: &str) -> Service {
        Service {
            key,
            scheduler: scheduler.to_string(),
            flags: 0,
            timeout: 0,
            netmask: if key.is_ipv6() { 128 } else { u32::MAX },
        }
    }
}

/// How packets reach a real server (`IPVS_DEST_ATTR_FWD_METHOD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Forward {
    /// `IP_VS_CONN_F_MASQ`: NAT (`ipvsadm -m`), what kube-proxy uses.
    Masquerade,
    /// `IP_VS_CONN_F_LOCALNODE`.
    Local,
    /// `IP_VS_CONN_F_TUNNEL`: IP-in-IP (`-i`).
    Tunnel,
    /// `IP_VS_CONN_F_DROUTE`: direct routing (`-g`).
    DirectRoute,
    /// `IP_VS_CONN_F_BYPASS`.
    Bypass,
}

impl Forward {
    /// The `IP_VS_CONN_F_*` number.
    pub fn number(self) -> u32 {
        match self {
            Forward::Masquerade => IP_VS_CONN_F_MASQ,
            Forward::Local => IP_VS_CONN_F_LOCALNODE,
            Forward::Tunnel => IP_VS_CONN_F_TUNNEL,
            Forward::DirectRoute => IP_VS_CONN_F_DROUTE,
            Forward::Bypass => IP_VS_CONN_F_BYPASS,
        }
    }

    /// The method of a number (its bits outside `IP_VS_CONN_F_FWD_MASK` ignored).
    pub fn from_number(n: u32) -> Result<Forward, Malformed> {
        Ok(match n & IP_VS_CONN_F_FWD_MASK {
            IP_VS_CONN_F_MASQ => Forward::Masquerade,
            IP_VS_CONN_F_LOCALNODE => Forward::Local,
            IP_VS_CONN_F_TUNNEL => Forward::Tunnel,
            IP_VS_CONN_F_DROUTE => Forward::DirectRoute,
            IP_VS_CONN_F_BYPASS => Forward::Bypass,
            other => return Err(Malformed(format!("IPVS forwarding method {other}"))),
        })
    }
}

/// A destination (real server) of a service: what `ipvsadm -a` sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Destination {
    /// Its address (of the service's family here; IPVS allows another only for tunnels).
    pub addr: IpAddr,
    /// Its port.
    pub port: u16,
    /// How packets reach it.
    pub forward: Forward,
    /// Its weight; 0 takes it out of scheduling (new connections) but keeps its connections.
    pub weight: u32,
    /// Upper connection threshold (0: none).
    pub upper_threshold: u32,
    /// Lower connection threshold (0: none).
    pub lower_threshold: u32,
}

impl Destination {
    /// A masqueraded destination of weight `weight`, without thresholds.
    pub fn masquerade(addr: IpAddr, port: u16, weight: u32) -> Destination {
        Destination {
            addr,
            port,
            forward: Forward::Masquerade,
            weight,
            upper_threshold: 0,
            lower_threshold: 0,
        }
    }
}

/// A destination as the kernel reports it: its settings and its connection counts (which
/// graceful termination waits on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DestinationState {
    /// Its settings.
    pub destination: Destination,
    /// `IPVS_DEST_ATTR_ACTIVE_CONNS`: connections established.
    pub active_connections: u32,
    /// `IPVS_DEST_ATTR_INACT_CONNS`: connections in other states (closing, UDP).
    pub inactive_connections: u32,
    /// `IPVS_DEST_ATTR_PERSIST_CONNS`: persistence templates pointing at it.
    pub persistent_connections: u32,
}

/// The answer to `IPVS_CMD_GET_INFO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    /// `IPVS_INFO_ATTR_VERSION` (`0x010201` is 1.2.1).
    pub version: u32,
    /// `IPVS_INFO_ATTR_CONN_TAB_SIZE`: the connection hash table's size.
    pub connection_table_size: u32,
}

/// The 16 bytes of `union nf_inet_addr` holding `addr`.
fn inet_addr(addr: IpAddr) -> [u8; NF_INET_ADDR_LEN] {
    let mut b = [0u8; NF_INET_ADDR_LEN];
    match addr {
        IpAddr::V4(a) => b[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => b.copy_from_slice(&a.octets()),
    }
    b
}

/// The address in `union nf_inet_addr` bytes (4 or 16 of them accepted), of family `af`.
fn read_inet_addr(payload: Option<&[u8]>, af: u16, what: &str) -> Result<IpAddr, Malformed> {
    let p = payload.ok_or_else(|| Malformed(format!("{what} missing")))?;
    match af {
        AF_INET if p.len() >= 4 => Ok(IpAddr::V4(Ipv4Addr::new(p[0], p[1], p[2], p[3]))),
        AF_INET6 => {
            let b: [u8; 16] = p
                .try_into()
                .map_err(|_| Malformed(format!("{what}: {} bytes for IPv6", p.len())))?;
            Ok(IpAddr::V6(Ipv6Addr::from(b)))
        }
        _ => Err(Malformed(format!(
            "{what}: {} bytes of address family {af}",
            p.len()
        ))),
    }
}

/// The service's identifying attributes (inside its nest): family, then the mark or the
/// protocol, address and port.
fn put_service_key(buf: &mut Vec<u8>, key: &ServiceKey) {
    attr::put_u16(buf, IPVS_SVC_ATTR_AF, key.family());
    match *key {
        ServiceKey::Fwmark { mark, .. } => attr::put_u32(buf, IPVS_SVC_ATTR_FWMARK, mark),
        ServiceKey::Addr {
            addr,
            protocol,
            port,
        } => {
            attr::put_u16(buf, IPVS_SVC_ATTR_PROTOCOL, protocol.number());
            attr::put(buf, IPVS_SVC_ATTR_ADDR, &inet_addr(addr));
            attr::put_be16(buf, IPVS_SVC_ATTR_PORT, port);
        }
    }
}

/// `IPVS_CMD_ATTR_SERVICE` with the key only (deletes, destination commands, dumps).
fn put_service_key_nest(buf: &mut Vec<u8>, key: &ServiceKey) {
    attr::put_with(buf, IPVS_CMD_ATTR_SERVICE, |b| put_service_key(b, key));
}

/// `IPVS_CMD_ATTR_SERVICE` with every setting (adds and changes): the flags with a full mask,
/// so the kernel takes them as given.
fn put_service(buf: &mut Vec<u8>, svc: &Service) {
    attr::put_with(buf, IPVS_CMD_ATTR_SERVICE, |b| {
        put_service_key(b, &svc.key);
        attr::put_str(b, IPVS_SVC_ATTR_SCHED_NAME, &svc.scheduler);
        let mut flags = [0u8; 8];
        flags[..4].copy_from_slice(&svc.flags.to_ne_bytes());
        flags[4..].copy_from_slice(&u32::MAX.to_ne_bytes());
        attr::put(b, IPVS_SVC_ATTR_FLAGS, &flags);
        attr::put_u32(b, IPVS_SVC_ATTR_TIMEOUT, svc.timeout);
        attr::put_u32(b, IPVS_SVC_ATTR_NETMASK, svc.netmask);
    });
}

/// `IPVS_CMD_ATTR_DEST` with the address and port only (deletes), or every setting.
fn put_destination(buf: &mut Vec<u8>, dest: &Destination, full: bool) {
    attr::put_with(buf, IPVS_CMD_ATTR_DEST, |b| {
        attr::put(b, IPVS_DEST_ATTR_ADDR, &inet_addr(dest.addr));
        attr::put_be16(b, IPVS_DEST_ATTR_PORT, dest.port);
        if full {
            attr::put_u32(b, IPVS_DEST_ATTR_FWD_METHOD, dest.forward.number());
            attr::put_u32(b, IPVS_DEST_ATTR_WEIGHT, dest.weight);
            attr::put_u32(b, IPVS_DEST_ATTR_U_THRESH, dest.upper_threshold);
            attr::put_u32(b, IPVS_DEST_ATTR_L_THRESH, dest.lower_threshold);
            let af = if dest.addr.is_ipv6() {
                AF_INET6
            } else {
                AF_INET
            };
            attr::put_u16(b, IPVS_DEST_ATTR_ADDR_FAMILY, af);
        }
    });
}

/// Writes one IPVS request of family `family` (its resolved id) and command `cmd`, with
/// `NLM_F_ACK` (or `NLM_F_DUMP` for a dump), and whatever `attrs` appends.
fn request(
    buf: &mut Vec<u8>,
    family: u16,
    seq: u32,
    cmd: u8,
    dump: bool,
    attrs: impl FnOnce(&mut Vec<u8>),
) {
    let flags = if dump { NLM_F_DUMP } else { NLM_F_ACK };
    let header = GenlHeader {
        cmd,
        version: IPVS_GENL_VERSION,
    };
    let start = genl::begin(buf, family, flags, seq, header);
    attrs(buf);
    message::end(buf, start);
}

/// `IPVS_CMD_NEW_SERVICE`: adds a service (`EEXIST` if its key is taken).
pub fn new_service(buf: &mut Vec<u8>, family: u16, seq: u32, svc: &Service) {
    request(buf, family, seq, IPVS_CMD_NEW_SERVICE, false, |b| {
        put_service(b, svc)
    });
}

/// `IPVS_CMD_SET_SERVICE`: changes a service's scheduler, flags, timeout or netmask (`ESRCH`
/// if there is none of that key).
pub fn set_service(buf: &mut Vec<u8>, family: u16, seq: u32, svc: &Service) {
    request(buf, family, seq, IPVS_CMD_SET_SERVICE, false, |b| {
        put_service(b, svc)
    });
}

/// `IPVS_CMD_DEL_SERVICE`: deletes a service and its destinations (`ESRCH` if there is none).
pub fn del_service(buf: &mut Vec<u8>, family: u16, seq: u32, key: &ServiceKey) {
    request(buf, family, seq, IPVS_CMD_DEL_SERVICE, false, |b| {
        put_service_key_nest(b, key)
    });
}

/// `IPVS_CMD_GET_SERVICE` as a dump: every service of the namespace, each answered with an
/// `IPVS_CMD_NEW_SERVICE` message ([`parse_service`]).
pub fn get_services(buf: &mut Vec<u8>, family: u16, seq: u32) {
    request(buf, family, seq, IPVS_CMD_GET_SERVICE, true, |_| {});
}

/// `IPVS_CMD_NEW_DEST`: adds a destination to service `key` (`EEXIST` if it has it, `ESRCH` if
/// there is no such service).
pub fn new_dest(buf: &mut Vec<u8>, family: u16, seq: u32, key: &ServiceKey, dest: &Destination) {
    request(buf, family, seq, IPVS_CMD_NEW_DEST, false, |b| {
        put_service_key_nest(b, key);
        put_destination(b, dest, true);
    });
}

/// `IPVS_CMD_SET_DEST`: changes a destination's forwarding, weight or thresholds (`ENOENT` if
/// the service does not have it).
pub fn set_dest(buf: &mut Vec<u8>, family: u16, seq: u32, key: &ServiceKey, dest: &Destination) {
    request(buf, family, seq, IPVS_CMD_SET_DEST, false, |b| {
        put_service_key_nest(b, key);
        put_destination(b, dest, true);
    });
}

/// `IPVS_CMD_DEL_DEST`: removes destination `addr:port` from service `key` (`ENOENT` if the
/// service does not have it).
pub fn del_dest(
    buf: &mut Vec<u8>,
    family: u16,
    seq: u32,
    key: &ServiceKey,
    addr: IpAddr,
    port: u16,
) {
    request(buf, family, seq, IPVS_CMD_DEL_DEST, false, |b| {
        put_service_key_nest(b, key);
        put_destination(b, &Destination::masquerade(addr, port, 0), false);
    });
}

/// `IPVS_CMD_GET_DEST` as a dump: the destinations of service `key`, each answered with an
/// `IPVS_CMD_NEW_DEST` message ([`parse_destination`]). For a service that does not exist the
/// kernel answers an empty dump.
pub fn get_dests(buf: &mut Vec<u8>, family: u16, seq: u32, key: &ServiceKey) {
    request(buf, family, seq, IPVS_CMD_GET_DEST, true, |b| {
        put_service_key_nest(b, key)
    });
}

/// `IPVS_CMD_FLUSH`: deletes every service of the namespace.
pub fn flush(buf: &mut Vec<u8>, family: u16, seq: u32) {
    request(buf, family, seq, IPVS_CMD_FLUSH, false, |_| {});
}

/// `IPVS_CMD_GET_INFO`: the IPVS version and connection table size ([`parse_info`]).
pub fn get_info(buf: &mut Vec<u8>, family: u16, seq: u32) {
    request(buf, family, seq, IPVS_CMD_GET_INFO, false, |_| {});
}

/// The body of a reply of command `cmd`, and its first-level attribute `kind`.
fn reply_attr<'a>(
    msg: &Message<'a>,
    cmd: u8,
    kind: u16,
    what: &str,
) -> Result<&'a [u8], Malformed> {
    let (header, body) = GenlHeader::parse(msg.payload)?;
    if header.cmd != cmd {
        return Err(Malformed(format!(
            "IPVS command {} where {what} was expected",
            header.cmd
        )));
    }
    for a in attr::attrs(body) {
        let a = a?;
        if a.kind == kind {
            return Ok(a.payload);
        }
    }
    Err(Malformed(format!("{what} without its nest")))
}

/// Reads a service from an `IPVS_CMD_NEW_SERVICE` message (an answer to [`get_services`]).
pub fn parse_service(msg: &Message<'_>) -> Result<Service, Malformed> {
    let nest = reply_attr(
        msg,
        IPVS_CMD_NEW_SERVICE,
        IPVS_CMD_ATTR_SERVICE,
        "a service",
    )?;
    read_service(nest)
}

/// Reads the attributes of an `IPVS_CMD_ATTR_SERVICE` nest.
pub fn read_service(nest: &[u8]) -> Result<Service, Malformed> {
    let a: [Option<&[u8]>; IPVS_SVC_ATTR_MAX as usize + 1] = attr::table(nest)?;
    let get = |k: u16| a[usize::from(k)];
    let af = attr::u16_ne(get(IPVS_SVC_ATTR_AF), "service address family")?;
    let key = match get(IPVS_SVC_ATTR_FWMARK) {
        Some(mark) if attr::u32_ne(Some(mark), "fwmark")? != 0 => ServiceKey::Fwmark {
            mark: attr::u32_ne(Some(mark), "fwmark")?,
            ipv6: af == AF_INET6,
        },
        _ => ServiceKey::Addr {
            addr: read_inet_addr(get(IPVS_SVC_ATTR_ADDR), af, "service address")?,
            protocol: Protocol::from_number(attr::u16_ne(
                get(IPVS_SVC_ATTR_PROTOCOL),
                "service protocol",
            )?)?,
            port: attr::be16(get(IPVS_SVC_ATTR_PORT), "service port")?,
        },
    };
    let flags = match get(IPVS_SVC_ATTR_FLAGS) {
        Some(f) if f.len() >= 4 => u32::from_ne_bytes([f[0], f[1], f[2], f[3]]),
        Some(f) => return Err(Malformed(format!("service flags: {} bytes", f.len()))),
        None => 0,
    };
    let optional = |k: u16, what| get(k).map(|p| attr::u32_ne(Some(p), what)).transpose();
    Ok(Service {
        key,
        scheduler: attr::str(get(IPVS_SVC_ATTR_SCHED_NAME), "scheduler")?.to_string(),
        flags: flags & !IP_VS_SVC_F_HASHED,
        timeout: optional(IPVS_SVC_ATTR_TIMEOUT, "service timeout")?.unwrap_or(0),
        netmask: optional(IPVS_SVC_ATTR_NETMASK, "service netmask")?.unwrap_or(0),
    })
}

/// Reads a destination from an `IPVS_CMD_NEW_DEST` message (an answer to [`get_dests`]).
/// `ipv6` is the service's family, for kernels that do not say the destination's
/// (`IPVS_DEST_ATTR_ADDR_FAMILY` came in Linux 4.4).
pub fn parse_destination(msg: &Message<'_>, ipv6: bool) -> Result<DestinationState, Malformed> {
    let nest = reply_attr(msg, IPVS_CMD_NEW_DEST, IPVS_CMD_ATTR_DEST, "a destination")?;
    read_destination(nest, ipv6)
}

/// Reads the attributes of an `IPVS_CMD_ATTR_DEST` nest (`ipv6`: as [`parse_destination`]).
pub fn read_destination(nest: &[u8], ipv6: bool) -> Result<DestinationState, Malformed> {
    let a: [Option<&[u8]>; IPVS_DEST_ATTR_MAX as usize + 1] = attr::table(nest)?;
    let get = |k: u16| a[usize::from(k)];
    let af = match get(IPVS_DEST_ATTR_ADDR_FAMILY) {
        Some(p) => attr::u16_ne(Some(p), "destination address family")?,
        None if ipv6 => AF_INET6,
        None => AF_INET,
    };
    let u32_or_0 = |k: u16, what| {
        get(k)
            .map(|p| attr::u32_ne(Some(p), what))
            .transpose()
            .map(Option::unwrap_or_default)
    };
    Ok(DestinationState {
        destination: Destination {
            addr: read_inet_addr(get(IPVS_DEST_ATTR_ADDR), af, "destination address")?,
            port: attr::be16(get(IPVS_DEST_ATTR_PORT), "destination port")?,
            forward: Forward::from_number(u32_or_0(IPVS_DEST_ATTR_FWD_METHOD, "forwarding")?)?,
            weight: u32_or_0(IPVS_DEST_ATTR_WEIGHT, "weight")?,
            upper_threshold: u32_or_0(IPVS_DEST_ATTR_U_THRESH, "upper threshold")?,
            lower_threshold: u32_or_0(IPVS_DEST_ATTR_L_THRESH, "lower threshold")?,
        },
        active_connections: u32_or_0(IPVS_DEST_ATTR_ACTIVE_CONNS, "active connections")?,
        inactive_connections: u32_or_0(IPVS_DEST_ATTR_INACT_CONNS, "inactive connections")?,
        persistent_connections: u32_or_0(IPVS_DEST_ATTR_PERSIST_CONNS, "persistent connections")?,
    })
}

/// Reads the `IPVS_CMD_SET_INFO` answer to [`get_info`].
pub fn parse_info(msg: &Message<'_>) -> Result<Info, Malformed> {
    let (header, body) = GenlHeader::parse(msg.payload)?;
    if header.cmd != IPVS_CMD_SET_INFO {
        return Err(Malformed(format!(
            "IPVS command {} where IPVS_CMD_SET_INFO was expected",
            header.cmd
        )));
    }
    let a: [Option<&[u8]>; 3] = attr::table(body)?;
    Ok(Info {
        version: attr::u32_ne(a[usize::from(IPVS_INFO_ATTR_VERSION)], "IPVS version")?,
        connection_table_size: attr::u32_ne(
            a[usize::from(IPVS_INFO_ATTR_CONN_TAB_SIZE)],
            "connection table size",
        )?,
    })
}

#[cfg(test)]
mod tests;
