//! The byte layout of our sets' elements as the kernel keeps them, and an encoder of element
//! changes into one nf_tables netlink batch.
//!
//! `nft -f` spends most of a large load parsing its own text (1.4 s of a 10k-Service table), and
//! every change costs an `nft` process. Every Service and endpoint of our table is a set or map
//! element, so a sync's element changes can go to the kernel as `NFT_MSG_NEWSETELEM` /
//! `NFT_MSG_DELSETELEM` messages, with no parser and no process: [`ElementBatch`] writes them.
//! `kp-nftables` sends the batch and reads the kernel's answer; this module does no I/O.
//!
//! [`SetSchema`] describes each set's key and value components; the read-back decoder in
//! `kp-nftables` uses the same schema in the other direction. Layouts are the kernel UAPI's
//! (`linux/netlink.h`, `linux/netfilter/nfnetlink.h`, `linux/netfilter/nf_tables.h`), written
//! with `kp-netlink`'s pure framing and attributes, and the encodings are the ones nft 1.0.6 sends for the same `add element` / `delete element`
//! statements (captured with `strace`; see the unit tests):
//! - a concatenation pads every component to 4 bytes; addresses and ports are big-endian, the
//!   protocol one byte, the `numgen` slot a host-order `u32`;
//! - a single-field `flags interval` set (the kernel's rbtree) holds a network as two elements: its
//!   first address, and the address after its last flagged `NFT_SET_ELEM_INTERVAL_END`; a network
//!   reaching the top of the address space has no end element and carries nft's "open interval"
//!   user-data flag instead;
//! - a concatenated `flags interval` set (pipapo) holds each element as `KEY` and `KEY_END`, the
//!   first and last value of every component.
//!
//! nft also adds an `INTERVAL_END` element at address zero the first time it fills an empty
//! rbtree set. The kernel does not need it (a lookup below the first start finds nothing either
//! way), and listings ignore it, so the encoder does not send it. Nor does it send
//! `NFTA_SET_ELEM_LIST_SET_ID`, which only names a set created in the same batch.

use std::net::IpAddr;

use kp_core::model::IpFamily;

use crate::element::{Atom, NoEndpointVerdict};
use crate::layout::SetId;
use crate::names::{REJECT_PACKET, TABLE};

/// One component of a set's key or value, as the planner declares it (see
/// [`SetId::declaration`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomKind {
    /// `ipv4_addr` or `ipv6_addr` (the table's family decides): 4 or 16 bytes, network order.
    Addr,
    /// `inet_proto`: 1 byte, the IP protocol number.
    Proto,
    /// `inet_service`: 2 bytes, network order.
    Port,
    /// The endpoint slot, `numgen random mod N`: an `integer` of 4 bytes in host order.
    Slot,
}

impl AtomKind {
    /// Bytes the kernel uses for this component alone (not padded).
    pub fn width(self, family: IpFamily) -> usize {
        match (self, family) {
            (AtomKind::Addr, IpFamily::V4) => 4,
            (AtomKind::Addr, IpFamily::V6) => 16,
            (AtomKind::Proto, _) => 1,
            (AtomKind::Port, _) => 2,
            (AtomKind::Slot, _) => 4,
        }
    }
}

/// Each component with the bytes it takes in a key or value: in a concatenation every
/// component is padded to a 32-bit register; a single component is not.
pub fn strides(
    kinds: &[AtomKind],
    family: IpFamily,
) -> impl Iterator<Item = (AtomKind, usize)> + '_ {
    let concat = kinds.len() > 1;
    kinds.iter().map(move |k| {
        let w = k.width(family);
        (*k, if concat { attr::align(w) } else { w })
    })
}

/// The length of a key or value made of `kinds`.
pub fn total_len(kinds: &[AtomKind], family: IpFamily) -> usize {
    strides(kinds, family).map(|(_, s)| s).sum()
}

/// How to read or write one set's elements as bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetSchema {
    /// The key's components, in concatenation order.
    pub key: Vec<AtomKind>,
    /// A map's value components (`None` for sets and verdict maps).
    pub value: Option<Vec<AtomKind>>,
    /// Whether the values are verdicts (`drop`, `goto reject-packet`).
    pub verdict_map: bool,
    /// Whether the set is declared `flags interval`: a single address field holds networks,
    /// and the last address field of a concatenation holds an address range.
    pub interval: bool,
}

impl SetSchema {
    /// The schema of one of the planner's sets, following [`SetId::declaration`]. Dynamic sets
    /// (ClientIP affinity memory) get one too.
    pub fn of(set: SetId) -> SetSchema {
        use AtomKind::*;
        let plain = |key: Vec<AtomKind>| SetSchema {
            key,
            value: None,
            verdict_map: false,
            interval: false,
        };
        let vip = || vec![Addr, Proto, Port];
        let nodeport = || vec![Proto, Port];
        match set {
            SetId::ClusterIps => plain(vec![Addr]),
            SetId::PodCidrs | SetId::ServiceCidrs | SetId::NodePortAddresses => SetSchema {
                interval: true,
                ..plain(vec![Addr])
            },
            SetId::MasqVips
            | SetId::LocalPolicyVips
            | SetId::FirewallVips
            | SetId::AffinityVips(_) => plain(vip()),
            SetId::MasqNodePorts | SetId::LocalPolicyNodePorts | SetId::AffinityNodePorts(_) => {
                plain(nodeport())
            }
            SetId::NoEndpointVips => SetSchema {
                verdict_map: true,
                ..plain(vip())
            },
            SetId::NoEndpointNodePorts => SetSchema {
                verdict_map: true,
                ..plain(nodeport())
            },
            SetId::FirewallAllow => SetSchema {
                interval: true,
                ..plain(vec![Addr, Proto, Port, Addr])
            },
            SetId::Hairpin => plain(vec![Addr, Addr]),
            SetId::Class(route, _) if route.keyed_by_address() => plain(vip()),
            SetId::Class(..) => plain(nodeport()),
            SetId::ClassEndpoints(route, _) => {
                let mut key = if route.keyed_by_address() {
                    vip()
                } else {
                    nodeport()
                };
                key.push(Slot);
                SetSchema {
                    value: Some(vec![Addr, Port]),
                    ..plain(key)
                }
            }
            SetId::Affinity(_) => SetSchema {
                value: Some(vec![Addr, Port]),
                ..plain(vec![Addr, Addr, Proto, Port])
            },
        }
    }
}

pub mod abi;

use abi::*;
use kp_netlink::abi::{
    NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFNL_SUBSYS_NFTABLES, NLA_HDRLEN, NLA_TYPE_MASK,
    NLM_F_ACK, NLM_F_CREATE,
};
use kp_netlink::attr::{self, Nest};
use kp_netlink::message::{self, Start};
use kp_netlink::nfnl;

/// nft's (libnftnl's) element user data marking an interval open at the top of the address
/// space: record `NFTNL_UDATA_SET_ELEM_FLAGS` (1), length 4, value
/// `NFTNL_SET_ELEM_F_INTERVAL_OPEN` (1, host order). nft reads it to list such an interval.
const OPEN_INTERVAL_UDATA: [u8; 6] = [1, 4, 1, 0, 0, 0];

/// The most bytes of elements one message carries: nested attribute lengths are 16 bits.
const MESSAGE_ELEMENTS_LIMIT: usize = 60 * 1024;

/// Why an element could not be encoded (the planner never makes such an element; the sender
/// treats it as a failed sync).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot encode element of set {set}: {detail}")]
pub struct EncodeError {
    /// The set's name.
    pub set: String,
    /// What is wrong.
    pub detail: String,
}

/// The message being filled: which set and operation, where its parts start.
struct Open {
    family: IpFamily,
    set: SetId,
    delete: bool,
    schema: SetSchema,
    /// The message header.
    start: Start,
    /// The `NFTA_SET_ELEM_LIST_ELEMENTS` attribute.
    elements: Nest,
    /// Attribute types of the list entries so far: nft numbers them 1, 2, 3… (the kernel
    /// ignores the number).
    entries: u16,
}

/// Element additions and deletions of one sync, encoded as nf_tables messages inside one
/// `NFNL_MSG_BATCH_BEGIN` / `NFNL_MSG_BATCH_END` batch (for any mix of families and sets): the
/// kernel applies all of them or none. Consecutive changes of the same set and kind share a
/// message, up to about 60 KiB of elements each.
///
/// Messages keep the order of the calls; within one batch the kernel applies them in order, so
/// a deletion followed by an addition of the same key replaces it.
pub struct ElementBatch {
    buf: Vec<u8>,
    open: Option<Open>,
    messages: u32,
    elements: usize,
    /// The last finished message.
    last: Option<Start>,
    errors: Vec<EncodeError>,
}

impl Default for ElementBatch {
    fn default() -> Self {
        ElementBatch::new()
    }
}

impl std::fmt::Debug for ElementBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElementBatch")
            .field("bytes", &self.buf.len())
            .field("messages", &self.messages)
            .field("elements", &self.elements)
            .field("errors", &self.errors)
            .finish()
    }
}

/// A finished batch, ready for one `sendmsg` on a `NETLINK_NETFILTER` socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedBatch {
    /// `BATCH_BEGIN` (sequence 0), the element messages (sequences 1..=N, the last one asking
    /// for an acknowledgement), `BATCH_END`.
    pub bytes: Vec<u8>,
    /// The sequence number whose acknowledgement says the kernel processed every message (its
    /// errors, if any, come before it). Errors about the batch as a whole (permission, a failed
    /// commit) carry sequence 0.
    pub ack_seq: u32,
    /// Element messages in the batch.
    pub messages: u32,
}

impl ElementBatch {
    /// An empty batch.
    pub fn new() -> Self {
        // Room for BATCH_BEGIN, written by `finish`.
        let buf = vec![0; nfnl::batch_control_len()];
        ElementBatch {
            buf,
            open: None,
            messages: 0,
            elements: 0,
            last: None,
            errors: Vec::new(),
        }
    }

    /// Whether it holds no element change.
    pub fn is_empty(&self) -> bool {
        self.elements == 0
    }

    /// Element changes encoded (an interval counts once).
    pub fn elements(&self) -> usize {
        self.elements
    }

    /// Bytes so far.
    pub fn len_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Elements that could not be encoded (and were left out).
    pub fn errors(&self) -> &[EncodeError] {
        &self.errors
    }

    /// Adds an element (`add element`): `value` for maps (a verdict for verdict maps).
    pub fn add(&mut self, family: IpFamily, set: SetId, key: &[Atom], value: Option<&[Atom]>) {
        self.element(family, set, false, key, value);
    }

    /// Deletes an element (`delete element`).
    pub fn delete(&mut self, family: IpFamily, set: SetId, key: &[Atom]) {
        self.element(family, set, true, key, None);
    }

    fn element(
        &mut self,
        family: IpFamily,
        set: SetId,
        delete: bool,
        key: &[Atom],
        value: Option<&[Atom]>,
    ) {
        let same = self
            .open
            .as_ref()
            .is_some_and(|o| o.family == family && o.set == set && o.delete == delete);
        let full = self
            .open
            .as_ref()
            .is_some_and(|o| self.buf.len() - o.elements.offset() > MESSAGE_ELEMENTS_LIMIT);
        if !same || full {
            self.close();
            self.open_message(family, set, delete);
        }
        let mark = self.buf.len();
        let Some(mut open) = self.open.take() else {
            return;
        };
        let entries = open.entries;
        let r = encode_element(
            &mut self.buf,
            &open.schema,
            family,
            key,
            value,
            delete,
            &mut open.entries,
        );
        if r.is_err() {
            open.entries = entries;
        }
        self.open = Some(open);
        match r {
            Ok(()) => self.elements += 1,
            Err(detail) => {
                self.buf.truncate(mark);
                if self.errors.len() < 10 {
                    self.errors.push(EncodeError {
                        set: set.name(),
                        detail,
                    });
                }
            }
        }
    }

    fn open_message(&mut self, family: IpFamily, set: SetId, delete: bool) {
        let (kind, flags) = if delete {
            (NFT_MSG_DELSETELEM, 0)
        } else {
            (NFT_MSG_NEWSETELEM, NLM_F_CREATE)
        };
        // Sequence zero for now: `close` numbers the messages that keep an element.
        let start = nfnl::begin(
            &mut self.buf,
            NFNL_SUBSYS_NFTABLES,
            kind,
            flags,
            0,
            nfproto(family),
        );
        attr::put_str(&mut self.buf, NFTA_SET_ELEM_LIST_TABLE, TABLE);
        attr::put_str(&mut self.buf, NFTA_SET_ELEM_LIST_SET, &set.name());
        let elements = attr::nest_start(&mut self.buf, NFTA_SET_ELEM_LIST_ELEMENTS);
        self.open = Some(Open {
            family,
            set,
            delete,
            schema: SetSchema::of(set),
            start,
            elements,
            entries: NFTA_LIST_ELEM - 1,
        });
    }

    /// Ends the open message; drops it if no element made it in.
    fn close(&mut self) {
        let Some(open) = self.open.take() else {
            return;
        };
        if self.buf.len() == open.elements.offset() + NLA_HDRLEN {
            self.buf.truncate(open.start.offset());
            return;
        }
        attr::nest_end(&mut self.buf, open.elements);
        message::end(&mut self.buf, open.start);
        self.messages += 1;
        message::set_seq(&mut self.buf, open.start, self.messages);
        self.last = Some(open.start);
    }

    /// The whole batch. `None` if it holds no element change.
    pub fn finish(mut self) -> Option<EncodedBatch> {
        self.close();
        let last = self.last?;
        message::add_flags(&mut self.buf, last, NLM_F_ACK);
        let mut begin = Vec::with_capacity(nfnl::batch_control_len());
        nfnl::batch_control(&mut begin, NFNL_MSG_BATCH_BEGIN, 0, NFNL_SUBSYS_NFTABLES);
        self.buf[..begin.len()].copy_from_slice(&begin);
        nfnl::batch_control(
            &mut self.buf,
            NFNL_MSG_BATCH_END,
            self.messages + 1,
            NFNL_SUBSYS_NFTABLES,
        );
        Some(EncodedBatch {
            bytes: self.buf,
            ack_seq: self.messages,
            messages: self.messages,
        })
    }
}

/// The elements of a `NFT_MSG_GETSETELEM` request for `keys` of `set` (the payload of its
/// `NFTA_SET_ELEM_LIST_ELEMENTS` nest, keys only, encoded as for a deletion): the kernel looks each
/// one up and answers with the element, or stops at the first it lacks with `-ENOENT`. For sets
/// that are not intervals. Errors name the first key that cannot be encoded.
pub fn encode_keys<'a>(
    family: IpFamily,
    set: SetId,
    keys: impl IntoIterator<Item = &'a [Atom]>,
) -> Result<Vec<u8>, String> {
    let schema = SetSchema::of(set);
    if schema.interval {
        return Err(format!("{} is an interval set", set.name()));
    }
    let mut buf = Vec::new();
    let mut entries = NFTA_LIST_ELEM - 1;
    for key in keys {
        encode_element(&mut buf, &schema, family, key, None, true, &mut entries)
            .map_err(|e| format!("{}: {e}", set.name()))?;
    }
    Ok(buf)
}

/// Which bound of an interval a key spells.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bound {
    /// First address of a network.
    First,
    /// Last address of a network.
    Last,
}

fn ip_bytes(ip: IpAddr, out: &mut [u8]) -> usize {
    match ip {
        IpAddr::V4(a) => {
            out[..4].copy_from_slice(&a.octets());
            4
        }
        IpAddr::V6(a) => {
            out[..16].copy_from_slice(&a.octets());
            16
        }
    }
}

/// Writes the components of a key or value, `bound` choosing a network's first or last address.
fn encode_fields(
    kinds: &[AtomKind],
    family: IpFamily,
    atoms: &[Atom],
    bound: Bound,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    if kinds.len() != atoms.len() {
        return Err(format!(
            "{} components where the set has {}",
            atoms.len(),
            kinds.len()
        ));
    }
    for ((kind, stride), atom) in strides(kinds, family).zip(atoms) {
        let mut b = [0u8; 16];
        let w = kind.width(family);
        let ip_family = |ip: &IpAddr| IpFamily::of(ip) == family;
        match (kind, atom) {
            (AtomKind::Addr, Atom::Ip(ip)) if ip_family(ip) => {
                ip_bytes(*ip, &mut b);
            }
            (AtomKind::Addr, Atom::Net(n)) if ip_family(&n.addr()) => {
                let ip = match bound {
                    Bound::First => n.network(),
                    Bound::Last => n.broadcast(),
                };
                ip_bytes(ip, &mut b);
            }
            (AtomKind::Proto, Atom::Proto(p)) => b[0] = p.ip_number(),
            (AtomKind::Port, Atom::Port(p)) => b[..2].copy_from_slice(&p.to_be_bytes()),
            (AtomKind::Slot, Atom::Slot(s)) => b[..4].copy_from_slice(&s.to_ne_bytes()),
            (kind, atom) => return Err(format!("{atom} is not a {kind:?} of this family")),
        }
        out.extend_from_slice(&b[..w]);
        out.resize(out.len() + stride - w, 0);
    }
    Ok(())
}

/// A `struct nft_data` value attribute (`NFTA_SET_ELEM_KEY`, `_KEY_END`, `_DATA`).
fn data_attr(
    buf: &mut Vec<u8>,
    kind: u16,
    kinds: &[AtomKind],
    family: IpFamily,
    atoms: &[Atom],
    bound: Bound,
) -> Result<(), String> {
    let outer = attr::nest_start(buf, kind);
    let mut r = Ok(());
    attr::put_with(buf, NFTA_DATA_VALUE, |b| {
        r = encode_fields(kinds, family, atoms, bound, b)
    });
    attr::nest_end(buf, outer);
    r
}

fn verdict_attr(buf: &mut Vec<u8>, verdict: NoEndpointVerdict) {
    let data = attr::nest_start(buf, NFTA_SET_ELEM_DATA);
    let v = attr::nest_start(buf, NFTA_DATA_VERDICT);
    match verdict {
        NoEndpointVerdict::Drop => attr::put(buf, NFTA_VERDICT_CODE, &NF_DROP.to_be_bytes()),
        NoEndpointVerdict::Reject => {
            attr::put(buf, NFTA_VERDICT_CODE, &NFT_GOTO.to_be_bytes());
            attr::put_str(buf, NFTA_VERDICT_CHAIN, REJECT_PACKET);
        }
    }
    attr::nest_end(buf, v);
    attr::nest_end(buf, data);
}

/// One element (two for a closed network in a single-field interval set), each in its own
/// list entry (`NFTA_LIST_ELEM`, numbered as nft numbers them).
fn encode_element(
    buf: &mut Vec<u8>,
    schema: &SetSchema,
    family: IpFamily,
    key: &[Atom],
    value: Option<&[Atom]>,
    delete: bool,
    entries: &mut u16,
) -> Result<(), String> {
    let mut entry = |buf: &mut Vec<u8>| {
        *entries = entries.wrapping_add(1) & NLA_TYPE_MASK;
        attr::nest_start(buf, *entries)
    };
    if schema.interval && schema.key.len() == 1 {
        // rbtree: the first address; then the address after the last, flagged as an end.
        let (first, last) = match key {
            [Atom::Net(n)] => (n.network(), n.broadcast()),
            [Atom::Ip(ip)] => (*ip, *ip),
            _ => return Err(format!("{} components where the set has 1", key.len())),
        };
        if IpFamily::of(&first) != family {
            return Err(format!("{first} is not of this family"));
        }
        if value.is_some() {
            return Err("interval maps are not supported".into());
        }
        let next = match last {
            IpAddr::V4(a) => u32::from(a).checked_add(1).map(|n| IpAddr::V4(n.into())),
            IpAddr::V6(a) => u128::from(a).checked_add(1).map(|n| IpAddr::V6(n.into())),
        };
        let e = entry(buf);
        data_attr(
            buf,
            NFTA_SET_ELEM_KEY,
            &schema.key,
            family,
            &[Atom::Ip(first)],
            Bound::First,
        )?;
        if next.is_none() {
            attr::put(buf, NFTA_SET_ELEM_USERDATA, &OPEN_INTERVAL_UDATA);
        }
        attr::nest_end(buf, e);
        if let Some(next) = next {
            let e = entry(buf);
            attr::put_be32(buf, NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
            data_attr(
                buf,
                NFTA_SET_ELEM_KEY,
                &schema.key,
                family,
                &[Atom::Ip(next)],
                Bound::First,
            )?;
            attr::nest_end(buf, e);
        }
        return Ok(());
    }
    let e = entry(buf);
    data_attr(
        buf,
        NFTA_SET_ELEM_KEY,
        &schema.key,
        family,
        key,
        Bound::First,
    )?;
    if schema.interval {
        // pipapo: every component's last value.
        data_attr(
            buf,
            NFTA_SET_ELEM_KEY_END,
            &schema.key,
            family,
            key,
            Bound::Last,
        )?;
    }
    if !delete {
        match (schema.verdict_map, &schema.value, value) {
            (true, _, Some([Atom::Verdict(v)])) => verdict_attr(buf, *v),
            (false, Some(kinds), Some(atoms)) => {
                data_attr(buf, NFTA_SET_ELEM_DATA, kinds, family, atoms, Bound::First)?;
            }
            (false, None, None) => {}
            (_, _, v) => {
                return Err(format!(
                    "value {v:?} does not fit the set (verdict map: {}, value: {:?})",
                    schema.verdict_map, schema.value
                ))
            }
        }
    }
    attr::nest_end(buf, e);
    Ok(())
}

#[cfg(test)]
mod tests;
