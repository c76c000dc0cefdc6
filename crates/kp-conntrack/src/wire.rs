//! ctnetlink messages: the dump request, the delete request, and the decoding of one dumped
//! entry into a [`FlowEntry`]. Pure bytes in, bytes out, on `kp-netlink`'s framing and
//! attributes; the socket is in [`crate::socket`].
//!
//! Layouts and constants are the kernel UAPI's (`linux/netfilter/nfnetlink_conntrack.h`), under
//! their kernel names. Every nest is flagged `NLA_F_NESTED`: the kernel parses `CTA_FILTER`
//! strictly and insists on it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use kp_core::conntrack::FlowEntry;
use kp_core::model::{IpFamily, Protocol};
use kp_netlink::abi::{NFNL_SUBSYS_CTNETLINK, NFPROTO_IPV4, NFPROTO_IPV6, NLM_F_ACK, NLM_F_DUMP};
use kp_netlink::{attr, message, nfnl, Message};

// linux/netfilter/nfnetlink_conntrack.h: enum cntl_msg_types
const IPCTNL_MSG_CT_NEW: u8 = 0;
const IPCTNL_MSG_CT_GET: u8 = 1;
const IPCTNL_MSG_CT_DELETE: u8 = 2;
// enum ctattr_type
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_PROTOINFO: u16 = 4;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
// enum ctattr_tuple
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
// enum ctattr_ip
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
// enum ctattr_l4proto
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
// enum ctattr_filter
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
// include/uapi/linux/netfilter/nf_conntrack_tcp.h: enum tcp_conntrack.
/// `TCP_CONNTRACK_TIME_WAIT`: both ends closed.
pub(crate) const TCP_TIME_WAIT: u8 = 7;
/// `TCP_CONNTRACK_CLOSE`: reset.
pub(crate) const TCP_CLOSE: u8 = 8;

const CTA_FILTER_ORIG_FLAGS: u16 = 1;
// net/netfilter/nf_internals.h: CTA_FILTER_F_CTA_PROTO_NUM, a bit of the filter flags
const CTA_FILTER_F_CTA_PROTO_NUM: u32 = 1 << 3;
// netinet/in.h
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_SCTP: u8 = 132;

/// The message type of a dumped entry.
pub(crate) const CT_NEW: u16 = (NFNL_SUBSYS_CTNETLINK as u16) << 8 | IPCTNL_MSG_CT_NEW as u16;

/// Why one dumped message could not become a [`FlowEntry`].
pub(crate) type Malformed = String;

fn nfproto(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => NFPROTO_IPV4,
        IpFamily::V6 => NFPROTO_IPV6,
    }
}

fn ipproto(protocol: Protocol) -> u8 {
    protocol.ip_number()
}

/// `conntrack -L -f FAMILY -p PROTOCOL`: a dump of one family's entries of one protocol.
///
/// With `filtered`, the kernel (5.8 and later) leaves out entries of other protocols itself
/// (`CTA_FILTER` on the original tuple's protocol number); older kernels ignore the attribute
/// and dump the whole family, which the caller filters again anyway.
pub(crate) fn dump_request(
    seq: u32,
    family: IpFamily,
    protocol: Protocol,
    filtered: bool,
) -> Vec<u8> {
    let mut buf = Vec::with_capacity(48);
    let m = nfnl::begin(
        &mut buf,
        NFNL_SUBSYS_CTNETLINK,
        IPCTNL_MSG_CT_GET,
        NLM_F_DUMP,
        seq,
        nfproto(family),
    );
    if filtered {
        attr::put_nested(&mut buf, CTA_TUPLE_ORIG, |b| {
            attr::put_nested(b, CTA_TUPLE_PROTO, |b| {
                attr::put_u8(b, CTA_PROTO_NUM, ipproto(protocol));
            });
        });
        attr::put_nested(&mut buf, CTA_FILTER, |b| {
            // A host-order bit set, unlike the rest of ctnetlink.
            attr::put_u32(b, CTA_FILTER_ORIG_FLAGS, CTA_FILTER_F_CTA_PROTO_NUM);
        });
    }
    message::end(&mut buf, m);
    buf
}

/// `conntrack -D` of one entry, by its original tuple (and zone and id when known), asking for
/// an acknowledgement.
pub(crate) fn delete_request(seq: u32, entry: &FlowEntry) -> Vec<u8> {
    let mut buf = Vec::with_capacity(88);
    let m = nfnl::begin(
        &mut buf,
        NFNL_SUBSYS_CTNETLINK,
        IPCTNL_MSG_CT_DELETE,
        NLM_F_ACK,
        seq,
        nfproto(entry.family()),
    );
    attr::put_nested(&mut buf, CTA_TUPLE_ORIG, |b| {
        attr::put_nested(b, CTA_TUPLE_IP, |b| {
            let (src, dst) = match entry.orig_src {
                IpAddr::V4(_) => (CTA_IP_V4_SRC, CTA_IP_V4_DST),
                IpAddr::V6(_) => (CTA_IP_V6_SRC, CTA_IP_V6_DST),
            };
            attr::put(b, src, &ip_bytes(entry.orig_src));
            attr::put(b, dst, &ip_bytes(entry.orig_dst));
        });
        attr::put_nested(b, CTA_TUPLE_PROTO, |b| {
            attr::put_u8(b, CTA_PROTO_NUM, ipproto(entry.protocol));
            attr::put_be16(b, CTA_PROTO_SRC_PORT, entry.orig_sport);
            attr::put_be16(b, CTA_PROTO_DST_PORT, entry.orig_dport);
        });
    });
    if entry.zone != 0 {
        attr::put_be16(&mut buf, CTA_ZONE, entry.zone);
    }
    if let Some(id) = entry.id {
        attr::put_be32(&mut buf, CTA_ID, id);
    }
    message::end(&mut buf, m);
    buf
}

/// `conntrack -G` by reply tuple: the entry whose replies go from `reply_src` to `reply_dst`
/// (a proxy that received a redirected datagram asks this with its own address and port as
/// the source and the client as the destination, and reads the original destination from the
/// answer).
pub(crate) fn get_by_reply_request(
    seq: u32,
    protocol: Protocol,
    reply_src: std::net::SocketAddr,
    reply_dst: std::net::SocketAddr,
) -> Vec<u8> {
    let mut buf = Vec::with_capacity(88);
    let family = match reply_src {
        std::net::SocketAddr::V4(_) => IpFamily::V4,
        std::net::SocketAddr::V6(_) => IpFamily::V6,
    };
    let m = nfnl::begin(
        &mut buf,
        NFNL_SUBSYS_CTNETLINK,
        IPCTNL_MSG_CT_GET,
        NLM_F_ACK,
        seq,
        nfproto(family),
    );
    attr::put_nested(&mut buf, CTA_TUPLE_REPLY, |b| {
        attr::put_nested(b, CTA_TUPLE_IP, |b| {
            let (src, dst) = match family {
                IpFamily::V4 => (CTA_IP_V4_SRC, CTA_IP_V4_DST),
                IpFamily::V6 => (CTA_IP_V6_SRC, CTA_IP_V6_DST),
            };
            attr::put(b, src, &ip_bytes(reply_src.ip()));
            attr::put(b, dst, &ip_bytes(reply_dst.ip()));
        });
        attr::put_nested(b, CTA_TUPLE_PROTO, |b| {
            attr::put_u8(b, CTA_PROTO_NUM, ipproto(protocol));
            attr::put_be16(b, CTA_PROTO_SRC_PORT, reply_src.port());
            attr::put_be16(b, CTA_PROTO_DST_PORT, reply_dst.port());
        });
    });
    message::end(&mut buf, m);
    buf
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Decodes one dumped conntrack message. `Ok(None)`: an entry of a protocol the proxy never
/// proxies (only listed by kernels that ignore the dump filter).
pub(crate) fn decode_entry(m: &Message<'_>) -> Result<Option<FlowEntry>, Malformed> {
    if m.kind() != CT_NEW {
        return Err(format!(
            "not a conntrack entry: message type {:#x}",
            m.kind()
        ));
    }
    let (_, body) = nfnl::NfGenMsg::parse(m.payload)?;
    let a: [Option<&[u8]>; 19] = attr::table(body)?;
    let orig = tuple(
        a[usize::from(CTA_TUPLE_ORIG)].ok_or("no original tuple")?,
        "original",
    )?;
    let reply = tuple(
        a[usize::from(CTA_TUPLE_REPLY)].ok_or("no reply tuple")?,
        "reply",
    )?;
    let zone = match a[usize::from(CTA_ZONE)] {
        Some(z) => attr::be16(Some(z), "CTA_ZONE")?,
        None => 0,
    };
    let id = a[usize::from(CTA_ID)]
        .map(|i| attr::be32(Some(i), "CTA_ID"))
        .transpose()?;
    let protocol = match orig.protocol {
        IPPROTO_UDP => Protocol::Udp,
        IPPROTO_SCTP => Protocol::Sctp,
        IPPROTO_TCP => Protocol::Tcp,
        _ => return Ok(None),
    };
    let port = |p: Option<u16>, what: &str| p.ok_or_else(|| format!("no {what} port"));
    Ok(Some(FlowEntry {
        protocol,
        orig_src: orig.src,
        orig_dst: orig.dst,
        orig_sport: port(orig.sport, "original source")?,
        orig_dport: port(orig.dport, "original destination")?,
        reply_src: reply.src,
        reply_sport: port(reply.sport, "reply source")?,
        zone,
        id,
    }))
}

/// The TCP state of a dumped conntrack entry (`CTA_PROTOINFO_TCP_STATE`), `None` for an entry
/// without one (not TCP).
pub(crate) fn tcp_state(m: &Message<'_>) -> Result<Option<u8>, Malformed> {
    let (_, body) = nfnl::NfGenMsg::parse(m.payload)?;
    let a: [Option<&[u8]>; 5] = attr::table(body)?;
    let Some(info) = a[usize::from(CTA_PROTOINFO)] else {
        return Ok(None);
    };
    let info: [Option<&[u8]>; 2] = attr::table(info)?;
    let Some(tcp) = info[usize::from(CTA_PROTOINFO_TCP)] else {
        return Ok(None);
    };
    let tcp: [Option<&[u8]>; 2] = attr::table(tcp)?;
    match tcp[usize::from(CTA_PROTOINFO_TCP_STATE)] {
        Some(state) => Ok(Some(attr::u8(Some(state), "CTA_PROTOINFO_TCP_STATE")?)),
        None => Ok(None),
    }
}

/// The parts of one direction's tuple the reconciler uses.
struct Parsed {
    src: IpAddr,
    dst: IpAddr,
    protocol: u8,
    sport: Option<u16>,
    dport: Option<u16>,
}

fn address(payload: Option<&[u8]>, what: &str) -> Result<Option<IpAddr>, Malformed> {
    Ok(match payload {
        None => None,
        Some(&[a, b, c, d]) => Some(IpAddr::V4(Ipv4Addr::new(a, b, c, d))),
        Some(p) => {
            let octets: [u8; 16] = p
                .try_into()
                .map_err(|_| format!("{what} of {} bytes", p.len()))?;
            Some(IpAddr::V6(Ipv6Addr::from(octets)))
        }
    })
}

fn tuple(nest: &[u8], direction: &str) -> Result<Parsed, Malformed> {
    let missing = |what: &str| format!("{direction} tuple without {what}");
    let t: [Option<&[u8]>; 3] = attr::table(nest)?;
    let ip: [Option<&[u8]>; 5] = match t[usize::from(CTA_TUPLE_IP)] {
        Some(ip) => attr::table(ip)?,
        None => [None; 5],
    };
    let proto: [Option<&[u8]>; 4] = match t[usize::from(CTA_TUPLE_PROTO)] {
        Some(p) => attr::table(p)?,
        None => [None; 4],
    };
    let src = address(ip[usize::from(CTA_IP_V4_SRC)], "source address")?
        .or(address(ip[usize::from(CTA_IP_V6_SRC)], "source address")?);
    let dst = address(ip[usize::from(CTA_IP_V4_DST)], "destination address")?.or(address(
        ip[usize::from(CTA_IP_V6_DST)],
        "destination address",
    )?);
    let port = |i: u16, what: &str| {
        proto[usize::from(i)]
            .map(|p| attr::be16(Some(p), what))
            .transpose()
    };
    Ok(Parsed {
        src: src.ok_or_else(|| missing("source address"))?,
        dst: dst.ok_or_else(|| missing("destination address"))?,
        protocol: match proto[usize::from(CTA_PROTO_NUM)] {
            Some(p) => attr::u8(Some(p), "protocol")?,
            None => return Err(missing("protocol")),
        },
        sport: port(CTA_PROTO_SRC_PORT, "source port")?,
        dport: port(CTA_PROTO_DST_PORT, "destination port")?,
    })
}

#[cfg(test)]
mod tests;
