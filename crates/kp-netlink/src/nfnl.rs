//! nfnetlink, netfilter's netlink protocol (`NETLINK_NETFILTER`): message types that carry a
//! subsystem (nf_tables, ctnetlink, ipset…) in their high byte, the `nfgenmsg` header after
//! `nlmsghdr`, and the `BATCH_BEGIN`/`BATCH_END` messages around a transaction.

use crate::abi::{NFGENMSG_LEN, NFNETLINK_V0, NFPROTO_UNSPEC, NLM_F_REQUEST};
use crate::message::{self, Start};
use crate::Malformed;

/// The message type of message `msg` of subsystem `subsys` (`NFNL_SUBSYS_*`).
pub fn msg_type(subsys: u8, msg: u8) -> u16 {
    (u16::from(subsys) << 8) | u16::from(msg)
}

/// The subsystem of a message type.
pub fn subsys(kind: u16) -> u8 {
    (kind >> 8) as u8
}

/// `struct nfgenmsg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NfGenMsg {
    /// `nfgen_family`: `NFPROTO_*`.
    pub family: u8,
    /// `version`: `NFNETLINK_V0`.
    pub version: u8,
    /// `res_id`, in host order here (network order on the wire): 0 in requests, the subsystem
    /// in batch messages, the ruleset generation's low bits in nf_tables replies.
    pub res_id: u16,
}

impl NfGenMsg {
    /// A request's header for `family`.
    pub fn new(family: u8) -> NfGenMsg {
        NfGenMsg {
            family,
            version: NFNETLINK_V0,
            res_id: 0,
        }
    }

    /// Appends the 4 bytes.
    pub fn emit(&self, buf: &mut Vec<u8>) {
        buf.push(self.family);
        buf.push(self.version);
        buf.extend_from_slice(&self.res_id.to_be_bytes());
    }

    /// Splits a message payload into its `nfgenmsg` and the attributes after it.
    pub fn parse(payload: &[u8]) -> Result<(NfGenMsg, &[u8]), Malformed> {
        match payload {
            [family, version, a, b, rest @ ..] => Ok((
                NfGenMsg {
                    family: *family,
                    version: *version,
                    res_id: u16::from_be_bytes([*a, *b]),
                },
                rest,
            )),
            _ => Err("a reply without nfgenmsg".into()),
        }
    }
}

/// Starts an nfnetlink request (`NLM_F_REQUEST` is added to `flags`): header and `nfgenmsg`;
/// append attributes, then [`message::end`].
pub fn begin(buf: &mut Vec<u8>, subsys: u8, msg: u8, flags: u16, seq: u32, family: u8) -> Start {
    let start = message::begin(buf, msg_type(subsys, msg), NLM_F_REQUEST | flags, seq);
    NfGenMsg::new(family).emit(buf);
    start
}

/// Appends a whole `NFNL_MSG_BATCH_BEGIN` or `NFNL_MSG_BATCH_END` message (`kind`) for the
/// transaction of subsystem `subsys`: family unspecified, the subsystem as resource id.
pub fn batch_control(buf: &mut Vec<u8>, kind: u16, seq: u32, subsys: u8) {
    let start = message::begin(buf, kind, NLM_F_REQUEST, seq);
    NfGenMsg {
        family: NFPROTO_UNSPEC,
        version: NFNETLINK_V0,
        res_id: u16::from(subsys),
    }
    .emit(buf);
    message::end(buf, start);
}

/// The bytes of a `BATCH_BEGIN` or `BATCH_END` message alone.
pub fn batch_control_len() -> usize {
    crate::abi::NLMSG_HDRLEN + NFGENMSG_LEN
}
