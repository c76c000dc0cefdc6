//! ipset over nfnetlink (subsystem `NFNL_SUBSYS_IPSET`, `net/netfilter/ipset/ip_set_core.c`):
//! the requests that add an element to a set and delete one from it, what `ipset add` and
//! `ipset del` send, without the `ipset` program.
//!
//! Pure: bytes in, bytes out. A request is `nlmsghdr` (type `NFNL_SUBSYS_IPSET << 8 | cmd`),
//! `nfgenmsg` (the family, version 0, resource id 0), then `IPSET_ATTR_PROTOCOL` (u8),
//! `IPSET_ATTR_SETNAME` (NUL-terminated) and the element in the nest `IPSET_ATTR_DATA`:
//! addresses nested in `IPSET_ATTR_IP`/`IPSET_ATTR_IP2` as `IPSET_ATTR_IPADDR_IPV4`/`_IPV6`,
//! the port as a network-order u16; the kernel refuses (`IPSET_ERR_PROTOCOL`) an address or
//! port not flagged `NLA_F_NET_BYTEORDER`, and nests not flagged `NLA_F_NESTED`.
//!
//! An element already present (add) or absent (del) is not an error unless the request carries
//! `NLM_F_EXCL`: the kernel reads "no `NLM_F_EXCL`" as `IPSET_FLAG_EXIST` (`-exist`), which is
//! what these requests ask for. Each carries `NLM_F_ACK`, so it is acknowledged when applied
//! (netlink answers only refusals otherwise); a refusal is an `NLMSG_ERROR` whose errno is a
//! plain one (`ENOENT`: no such set) or one of ipset's own, 4096 and up ([`error_name`]).

use std::net::IpAddr;

use crate::abi::{NFNL_SUBSYS_IPSET, NFPROTO_IPV4, NFPROTO_IPV6, NLA_F_NET_BYTEORDER, NLM_F_ACK};
use crate::{attr, message, nfnl};

/// The ipset numbers, under their names in `include/uapi/linux/netfilter/ipset/ip_set.h`
/// (and `ip_set_hash.h`, `ip_set_bitmap.h` for the type-specific errors).
#[allow(missing_docs)]
pub mod abi {
    pub const IPSET_PROTOCOL: u8 = 7;
    pub const IPSET_PROTOCOL_MIN: u8 = 6;
    /// The longest set name, its NUL included.
    pub const IPSET_MAXNAMELEN: usize = 32;

    // enum ipset_cmd (the ones sent here)
    pub const IPSET_CMD_ADD: u8 = 9;
    pub const IPSET_CMD_DEL: u8 = 10;
    pub const IPSET_CMD_TEST: u8 = 11;

    // Attributes at command level
    pub const IPSET_ATTR_PROTOCOL: u16 = 1;
    pub const IPSET_ATTR_SETNAME: u16 = 2;
    pub const IPSET_ATTR_DATA: u16 = 7;
    pub const IPSET_ATTR_LINENO: u16 = 9;

    // CADT attributes (inside IPSET_ATTR_DATA)
    pub const IPSET_ATTR_IP: u16 = 1;
    pub const IPSET_ATTR_CIDR: u16 = 3;
    pub const IPSET_ATTR_PORT: u16 = 4;
    pub const IPSET_ATTR_PROTO: u16 = 7;
    pub const IPSET_ATTR_CADT_FLAGS: u16 = 8;
    // ADT attributes
    pub const IPSET_ATTR_IP2: u16 = 20;
    pub const IPSET_ATTR_CIDR2: u16 = 21;

    // Inside IPSET_ATTR_IP and IPSET_ATTR_IP2
    pub const IPSET_ATTR_IPADDR_IPV4: u16 = 1;
    pub const IPSET_ATTR_IPADDR_IPV6: u16 = 2;

    // enum ipset_cmd_flags
    pub const IPSET_FLAG_EXIST: u32 = 1;

    // enum ipset_errno
    pub const IPSET_ERR_PRIVATE: i32 = 4096;
    pub const IPSET_ERR_PROTOCOL: i32 = 4097;
    pub const IPSET_ERR_FIND_TYPE: i32 = 4098;
    pub const IPSET_ERR_MAX_SETS: i32 = 4099;
    pub const IPSET_ERR_BUSY: i32 = 4100;
    pub const IPSET_ERR_EXIST_SETNAME2: i32 = 4101;
    pub const IPSET_ERR_TYPE_MISMATCH: i32 = 4102;
    pub const IPSET_ERR_EXIST: i32 = 4103;
    pub const IPSET_ERR_INVALID_CIDR: i32 = 4104;
    pub const IPSET_ERR_INVALID_NETMASK: i32 = 4105;
    pub const IPSET_ERR_INVALID_FAMILY: i32 = 4106;
    pub const IPSET_ERR_TIMEOUT: i32 = 4107;
    pub const IPSET_ERR_REFERENCED: i32 = 4108;
    pub const IPSET_ERR_IPADDR_IPV4: i32 = 4109;
    pub const IPSET_ERR_IPADDR_IPV6: i32 = 4110;
    pub const IPSET_ERR_COUNTER: i32 = 4111;
    pub const IPSET_ERR_COMMENT: i32 = 4112;
    pub const IPSET_ERR_INVALID_MARKMASK: i32 = 4113;
    pub const IPSET_ERR_SKBINFO: i32 = 4114;
    pub const IPSET_ERR_TYPE_SPECIFIC: i32 = 4352;
    // ip_set_hash.h
    pub const IPSET_ERR_HASH_FULL: i32 = 4352;
    pub const IPSET_ERR_HASH_ELEM: i32 = 4353;
    pub const IPSET_ERR_INVALID_PROTO: i32 = 4354;
    pub const IPSET_ERR_MISSING_PROTO: i32 = 4355;
    pub const IPSET_ERR_HASH_RANGE_UNSUPPORTED: i32 = 4356;
    pub const IPSET_ERR_HASH_RANGE: i32 = 4357;
    // ip_set_bitmap.h (the same numbers as the hash types' first two: type-specific)
    pub const IPSET_ERR_BITMAP_RANGE: i32 = 4352;
    pub const IPSET_ERR_BITMAP_RANGE_SIZE: i32 = 4353;
}

use abi::*;

/// Add or delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// `IPSET_CMD_ADD`.
    Add,
    /// `IPSET_CMD_DEL`.
    Del,
}

impl Command {
    /// The `IPSET_CMD_*` number.
    pub fn number(self) -> u8 {
        match self {
            Command::Add => IPSET_CMD_ADD,
            Command::Del => IPSET_CMD_DEL,
        }
    }

    /// As `ipset` spells it: `add`, `del`.
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "add",
            Command::Del => "del",
        }
    }
}

/// One element, as the attributes of `IPSET_ATTR_DATA`: each set type reads the parts it
/// stores (`bitmap:port` the port; `hash:ip` the address; `hash:ip,port` address, protocol and
/// port; `hash:ip,port,ip` and `hash:ip,port,net` those and a second address, the latter with
/// its prefix length). A part left `None` is not sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Element {
    /// `IPSET_ATTR_IP`.
    pub ip: Option<IpAddr>,
    /// `IPSET_ATTR_PORT`.
    pub port: Option<u16>,
    /// `IPSET_ATTR_PROTO`: the `IPPROTO_*` number the port belongs to.
    pub proto: Option<u8>,
    /// `IPSET_ATTR_IP2`: the second address, or the network's address.
    pub ip2: Option<IpAddr>,
    /// `IPSET_ATTR_CIDR2`: the network's prefix length.
    pub cidr2: Option<u8>,
}

/// The nfnetlink family of an address family: `NFPROTO_IPV4` or `NFPROTO_IPV6`.
pub fn nfproto(ipv6: bool) -> u8 {
    if ipv6 {
        NFPROTO_IPV6
    } else {
        NFPROTO_IPV4
    }
}

fn put_addr(buf: &mut Vec<u8>, kind: u16, addr: IpAddr) {
    attr::put_nested(buf, kind, |b| match addr {
        IpAddr::V4(a) => attr::put(b, IPSET_ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &a.octets()),
        IpAddr::V6(a) => attr::put(b, IPSET_ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &a.octets()),
    });
}

/// Appends a whole `IPSET_CMD_ADD` or `IPSET_CMD_DEL` request (sequence `seq`, `NLM_F_ACK`, no
/// `NLM_F_EXCL`: an element already there, or already gone, is acknowledged) for `element` of
/// the set named `set` (at most [`IPSET_MAXNAMELEN`] − 1 bytes; the kernel refuses a longer
/// one), in family `family` (`NFPROTO_*`; [`nfproto`]).
pub fn request(
    buf: &mut Vec<u8>,
    command: Command,
    family: u8,
    seq: u32,
    set: &str,
    element: &Element,
) {
    let start = nfnl::begin(
        buf,
        NFNL_SUBSYS_IPSET,
        command.number(),
        NLM_F_ACK,
        seq,
        family,
    );
    attr::put_u8(buf, IPSET_ATTR_PROTOCOL, IPSET_PROTOCOL);
    attr::put_str(buf, IPSET_ATTR_SETNAME, set);
    attr::put_nested(buf, IPSET_ATTR_DATA, |b| {
        if let Some(ip) = element.ip {
            put_addr(b, IPSET_ATTR_IP, ip);
        }
        if let Some(port) = element.port {
            attr::put_be16(b, IPSET_ATTR_PORT | NLA_F_NET_BYTEORDER, port);
        }
        if let Some(proto) = element.proto {
            attr::put_u8(b, IPSET_ATTR_PROTO, proto);
        }
        if let Some(ip2) = element.ip2 {
            put_addr(b, IPSET_ATTR_IP2, ip2);
        }
        if let Some(cidr2) = element.cidr2 {
            attr::put_u8(b, IPSET_ATTR_CIDR2, cidr2);
        }
    });
    message::end(buf, start);
}

/// The name of one of ipset's own errnos (4096 and up), as the kernel's headers spell it;
/// `None` for other numbers. The type-specific ones (4352 and up) are named for the hash
/// types, whose numbers the bitmap types reuse (4352 is also `IPSET_ERR_BITMAP_RANGE`, a port
/// outside a `bitmap:port` set's range).
pub fn error_name(errno: i32) -> Option<&'static str> {
    Some(match errno {
        IPSET_ERR_PRIVATE => "IPSET_ERR_PRIVATE",
        IPSET_ERR_PROTOCOL => "IPSET_ERR_PROTOCOL",
        IPSET_ERR_FIND_TYPE => "IPSET_ERR_FIND_TYPE",
        IPSET_ERR_MAX_SETS => "IPSET_ERR_MAX_SETS",
        IPSET_ERR_BUSY => "IPSET_ERR_BUSY",
        IPSET_ERR_EXIST_SETNAME2 => "IPSET_ERR_EXIST_SETNAME2",
        IPSET_ERR_TYPE_MISMATCH => "IPSET_ERR_TYPE_MISMATCH",
        IPSET_ERR_EXIST => "IPSET_ERR_EXIST",
        IPSET_ERR_INVALID_CIDR => "IPSET_ERR_INVALID_CIDR",
        IPSET_ERR_INVALID_NETMASK => "IPSET_ERR_INVALID_NETMASK",
        IPSET_ERR_INVALID_FAMILY => "IPSET_ERR_INVALID_FAMILY",
        IPSET_ERR_TIMEOUT => "IPSET_ERR_TIMEOUT",
        IPSET_ERR_REFERENCED => "IPSET_ERR_REFERENCED",
        IPSET_ERR_IPADDR_IPV4 => "IPSET_ERR_IPADDR_IPV4",
        IPSET_ERR_IPADDR_IPV6 => "IPSET_ERR_IPADDR_IPV6",
        IPSET_ERR_COUNTER => "IPSET_ERR_COUNTER",
        IPSET_ERR_COMMENT => "IPSET_ERR_COMMENT",
        IPSET_ERR_INVALID_MARKMASK => "IPSET_ERR_INVALID_MARKMASK",
        IPSET_ERR_SKBINFO => "IPSET_ERR_SKBINFO",
        IPSET_ERR_HASH_FULL => "IPSET_ERR_HASH_FULL",
        IPSET_ERR_HASH_ELEM => "IPSET_ERR_HASH_ELEM",
        IPSET_ERR_INVALID_PROTO => "IPSET_ERR_INVALID_PROTO",
        IPSET_ERR_MISSING_PROTO => "IPSET_ERR_MISSING_PROTO",
        IPSET_ERR_HASH_RANGE_UNSUPPORTED => "IPSET_ERR_HASH_RANGE_UNSUPPORTED",
        IPSET_ERR_HASH_RANGE => "IPSET_ERR_HASH_RANGE",
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
