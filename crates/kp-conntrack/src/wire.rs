//! ctnetlink messages: the dump request, the delete request, and the decoding of one dumped
//! entry into a [`FlowEntry`]. Pure bytes in, bytes out; the socket is in [`crate::socket`].
//!
//! Layouts are the kernel UAPI's (`linux/netfilter/nfnetlink_conntrack.h`); the typed parts come
//! from `netlink-packet-netfilter`, and the attributes it does not model (`CTA_ID`, `CTA_ZONE`,
//! `CTA_FILTER`) are written and read here as raw attributes under their kernel names.

use std::net::IpAddr;

use kp_core::conntrack::FlowEntry;
use kp_core::model::{IpFamily, Protocol};
use netlink_packet_core::{
    DefaultNla, Emitable, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProtocol, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};

// linux/netfilter/nfnetlink_conntrack.h: enum cntl_msg_types
const IPCTNL_MSG_CT_GET: u8 = 1;
// enum ctattr_type
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
// enum ctattr_filter
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
// net/netfilter/nf_internals.h: CTA_FILTER_F_CTA_PROTO_NUM, a bit of the filter flags
const CTA_FILTER_F_CTA_PROTO_NUM: u32 = 1 << 3;
// linux/netlink.h
const NLA_F_NESTED: u16 = 1 << 15;
const NLA_TYPE_MASK: u16 = !((1 << 15) | (1 << 14));

/// Why one dumped message could not become a [`FlowEntry`].
pub(crate) type Malformed = String;

fn nfproto(family: IpFamily) -> NetfilterProtoFamily {
    match family {
        IpFamily::V4 => NetfilterProtoFamily::IPv4,
        IpFamily::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn ct_protocol(protocol: Protocol) -> CtProtocol {
    match protocol {
        Protocol::Tcp => CtProtocol::Tcp,
        Protocol::Udp => CtProtocol::Udp,
        Protocol::Sctp => CtProtocol::Sctp,
    }
}

fn serialize(flags: u16, seq: u32, family: IpFamily, message: ConntrackMessage) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut packet = NetlinkMessage::new(
        header,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(nfproto(family), 0, 0),
            message,
        )),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    buf
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
    let mut attrs = Vec::new();
    if filtered {
        // Raw attributes, because the kernel parses CTA_FILTER strictly and insists on the
        // NLA_F_NESTED flag, which `ConntrackAttribute::Other` does not emit.
        let proto = Tuple::Proto(vec![ProtoTuple::Protocol(ct_protocol(protocol))]);
        attrs.push(DefaultNla::new(
            CTA_TUPLE_ORIG | NLA_F_NESTED,
            emit_nla(&proto),
        ));
        let flags = DefaultNla::new(
            CTA_FILTER_ORIG_FLAGS,
            CTA_FILTER_F_CTA_PROTO_NUM.to_ne_bytes().to_vec(),
        );
        attrs.push(DefaultNla::new(CTA_FILTER | NLA_F_NESTED, emit_nla(&flags)));
    }
    serialize(
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        family,
        ConntrackMessage::Other {
            message_type: IPCTNL_MSG_CT_GET,
            attributes: attrs,
        },
    )
}

/// `conntrack -D` of one entry, by its original tuple (and zone and id when known), asking for
/// an acknowledgement.
pub(crate) fn delete_request(seq: u32, entry: &FlowEntry) -> Vec<u8> {
    let mut attrs = vec![ConntrackAttribute::CtaTupleOrig(vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(entry.orig_src),
            IPTuple::DestinationAddress(entry.orig_dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(ct_protocol(entry.protocol)),
            ProtoTuple::SourcePort(entry.orig_sport),
            ProtoTuple::DestinationPort(entry.orig_dport),
        ]),
    ])];
    if entry.zone != 0 {
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_ZONE,
            entry.zone.to_be_bytes().to_vec(),
        )));
    }
    if let Some(id) = entry.id {
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_ID,
            id.to_be_bytes().to_vec(),
        )));
    }
    serialize(
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        entry.family(),
        ConntrackMessage::Delete(attrs),
    )
}

fn emit_nla(nla: &impl Nla) -> Vec<u8> {
    let mut buf = vec![0; nla.buffer_len()];
    nla.emit(&mut buf);
    buf
}

/// An attribute's value (the crate keeps it private).
fn nla_value(nla: &DefaultNla) -> Vec<u8> {
    let mut buf = vec![0; nla.value_len()];
    nla.emit_value(&mut buf);
    buf
}

/// One netlink message of a datagram, by its header.
#[derive(Debug)]
pub(crate) struct Frame<'a> {
    /// `nlmsg_type`.
    pub kind: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// The whole message, header included.
    pub bytes: &'a [u8],
}

/// Splits a datagram into its messages. A header that does not fit ends the datagram with an
/// error: after it, nothing can be framed.
pub(crate) fn frames(datagram: &[u8]) -> impl Iterator<Item = Result<Frame<'_>, Malformed>> {
    let mut rest = datagram;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let frame = NetlinkBuffer::new_checked(rest)
            .map_err(|e| format!("bad netlink header: {e}"))
            .map(|buf| {
                let len = buf.length() as usize;
                let frame = Frame {
                    kind: buf.message_type(),
                    seq: buf.sequence_number(),
                    bytes: &rest[..len],
                };
                // Messages are padded to 4 bytes; the last one may not be.
                rest = rest.get(align4(len)..).unwrap_or(&[]);
                frame
            });
        if frame.is_err() {
            rest = &[];
        }
        Some(frame)
    })
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The errno of an `NLMSG_ERROR` message (0 for an acknowledgement) or of an `NLMSG_DONE` that
/// carries one.
pub(crate) fn code(frame: &Frame<'_>) -> Result<i32, Malformed> {
    let body = frame
        .bytes
        .get(16..20)
        .ok_or_else(|| "an NLMSG_ERROR or NLMSG_DONE without code".to_string())?;
    Ok(-i32::from_ne_bytes([body[0], body[1], body[2], body[3]]))
}

/// Decodes one dumped conntrack message. `Ok(None)`: an entry of a protocol the proxy never
/// proxies (only listed by kernels that ignore the dump filter).
pub(crate) fn decode_entry(frame: &Frame<'_>) -> Result<Option<FlowEntry>, Malformed> {
    let message = NetlinkMessage::<NetfilterMessage>::deserialize(frame.bytes)
        .map_err(|e| format!("cannot decode conntrack message: {e}"))?;
    let attrs = match message.payload {
        NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
            ..
        }) => attrs,
        other => return Err(format!("not a conntrack entry: {other:?}")),
    };
    let mut orig = None;
    let mut reply = None;
    let mut zone = 0;
    let mut id = None;
    for attr in attrs {
        match attr {
            ConntrackAttribute::CtaTupleOrig(t) => orig = Some(tuple(&t, "original")?),
            ConntrackAttribute::CtaTupleReply(t) => reply = Some(tuple(&t, "reply")?),
            ConntrackAttribute::Other(nla) => match nla.kind() & NLA_TYPE_MASK {
                CTA_ZONE => zone = u16::from_be_bytes(fixed(&nla_value(&nla), "CTA_ZONE")?),
                CTA_ID => id = Some(u32::from_be_bytes(fixed(&nla_value(&nla), "CTA_ID")?)),
                _ => {}
            },
            _ => {}
        }
    }
    let orig = orig.ok_or("no original tuple")?;
    let reply = reply.ok_or("no reply tuple")?;
    let protocol = match orig.protocol {
        CtProtocol::Udp => Protocol::Udp,
        CtProtocol::Sctp => Protocol::Sctp,
        CtProtocol::Tcp => Protocol::Tcp,
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

fn fixed<const N: usize>(value: &[u8], what: &str) -> Result<[u8; N], Malformed> {
    value
        .try_into()
        .map_err(|_| format!("{what} of {} bytes, expected {N}", value.len()))
}

/// The parts of one direction's tuple the reconciler uses.
struct Parsed {
    src: IpAddr,
    dst: IpAddr,
    protocol: CtProtocol,
    sport: Option<u16>,
    dport: Option<u16>,
}

fn tuple(parts: &[Tuple], direction: &str) -> Result<Parsed, Malformed> {
    let (mut src, mut dst, mut protocol, mut sport, mut dport) = (None, None, None, None, None);
    for part in parts {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(protos) => {
                for p in protos {
                    match p {
                        ProtoTuple::Protocol(n) => protocol = Some(*n),
                        ProtoTuple::SourcePort(n) => sport = Some(*n),
                        ProtoTuple::DestinationPort(n) => dport = Some(*n),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let missing = |what: &str| format!("{direction} tuple without {what}");
    Ok(Parsed {
        src: src.ok_or_else(|| missing("source address"))?,
        dst: dst.ok_or_else(|| missing("destination address"))?,
        protocol: protocol.ok_or_else(|| missing("protocol"))?,
        sport,
        dport,
    })
}

#[cfg(test)]
mod tests;
