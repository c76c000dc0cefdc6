//! The encoder against bytes nft 1.0.6 sent for the same statements (Linux 6.18, x86_64),
//! captured with `strace -e trace=sendmsg -xx nft …` in a scratch namespace holding:
//!
//! ```text
//! add table ip kube-proxy
//! add chain ip kube-proxy reject-packet
//! add set ip kube-proxy s { type ipv4_addr; flags interval; }          # as pod-cidrs
//! add set ip kube-proxy f { type ipv4_addr . inet_proto . inet_service . ipv4_addr; flags interval; }
//! add map ip kube-proxy v { type ipv4_addr . inet_proto . inet_service : verdict; }
//! add map ip kube-proxy m { typeof ip daddr . meta l4proto . th dport . numgen random mod 3 : ip daddr . th dport; }
//! ```
//!
//! Each constant is the payload of the message's `NFTA_SET_ELEM_LIST_ELEMENTS` attribute.
//! nft also sends `NFTA_SET_ELEM_LIST_SET_ID` with additions, which only matters for a set
//! created in the same batch; ours exist already.

use super::*;
use crate::layout::Route;
use kp_core::model::Protocol;
use kp_netlink::abi::{NLA_F_NESTED, NLM_F_REQUEST};

/// `add element … v { 10.0.0.3 . tcp . 80 : goto reject-packet, 10.0.0.4 . udp . 53 : drop }`
const VERDICTS: &[u8] = b"\x3c\x00\x01\x80\x14\x00\x01\x80\x10\x00\x01\x00\x0a\x00\x00\x03\x06\x00\x00\x00\x00\x50\x00\x00\x24\x00\x02\x80\x20\x00\x02\x80\x08\x00\x01\x00\xff\xff\xff\xfc\x12\x00\x02\x00\x72\x65\x6a\x65\x63\x74\x2d\x70\x61\x63\x6b\x65\x74\x00\x00\x00\x28\x00\x02\x80\x14\x00\x01\x80\x10\x00\x01\x00\x0a\x00\x00\x04\x11\x00\x00\x00\x00\x35\x00\x00\x10\x00\x02\x80\x0c\x00\x02\x80\x08\x00\x01\x00\x00\x00\x00\x00";
/// `delete element … v { 10.0.0.3 . tcp . 80 }`
const VERDICT_DELETE: &[u8] = b"\x18\x00\x01\x80\x14\x00\x01\x80\x10\x00\x01\x00\x0a\x00\x00\x03\x06\x00\x00\x00\x00\x50\x00\x00";
/// `add element … s { 192.168.0.0/16 }` into a set already holding an element (also what
/// `delete element` sends for it).
const RBTREE: &[u8] = b"\x10\x00\x01\x80\x0c\x00\x01\x80\x08\x00\x01\x00\xc0\xa8\x00\x00\x18\x00\x02\x80\x08\x00\x03\x00\x00\x00\x00\x01\x0c\x00\x01\x80\x08\x00\x01\x00\xc0\xa9\x00\x00";
/// `add element … s { 255.255.0.0/16 }`: open at the top, with nft's user-data flag.
const RBTREE_OPEN: &[u8] = b"\x1c\x00\x01\x80\x0c\x00\x01\x80\x08\x00\x01\x00\xff\xff\x00\x00\x0a\x00\x06\x00\x01\x04\x01\x00\x00\x00\x00\x00";
/// `add element … f { 10.0.0.5 . tcp . 80 . 192.168.0.0/16 }` (also what `delete` sends).
const PIPAPO: &[u8] = b"\x34\x00\x01\x80\x18\x00\x01\x80\x14\x00\x01\x00\x0a\x00\x00\x05\x06\x00\x00\x00\x00\x50\x00\x00\xc0\xa8\x00\x00\x18\x00\x0a\x80\x14\x00\x01\x00\x0a\x00\x00\x05\x06\x00\x00\x00\x00\x50\x00\x00\xc0\xa8\xff\xff";
/// `add element … m { 10.0.0.2 . udp . 53 . 1 : 10.1.0.2 . 53 }`
const ENDPOINT: &[u8] = b"\x2c\x00\x01\x80\x18\x00\x01\x80\x14\x00\x01\x00\x0a\x00\x00\x02\x11\x00\x00\x00\x00\x35\x00\x00\x01\x00\x00\x00\x10\x00\x02\x80\x0c\x00\x01\x00\x0a\x01\x00\x02\x00\x35\x00\x00";

fn bytes(s: &[u8]) -> Vec<u8> {
    s.to_vec()
}

fn ip(s: &str) -> Atom {
    Atom::Ip(s.parse().unwrap())
}

fn net(s: &str) -> Atom {
    Atom::Net(s.parse().unwrap())
}

/// One message of a batch: type, flags, seq, family, and its attributes by type.
#[derive(Debug)]
struct Msg {
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: Vec<(u16, Vec<u8>)>,
}

/// The messages of a batch, read with kp-netlink's framing (attribute types keep their
/// `NLA_F_NESTED` flag, so the tests can check it).
fn messages(b: &[u8]) -> Vec<Msg> {
    kp_netlink::messages(b)
        .map(|m| {
            let m = m.expect("framed");
            let (gen, body) = kp_netlink::nfnl::NfGenMsg::parse(m.payload).expect("nfgenmsg");
            let attrs = kp_netlink::attr::attrs(body)
                .map(|a| {
                    let a = a.expect("attribute");
                    let flag = if a.nested { NLA_F_NESTED } else { 0 };
                    (a.kind | flag, a.payload.to_vec())
                })
                .collect();
            Msg {
                kind: m.kind(),
                flags: m.header.flags,
                seq: m.seq(),
                family: gen.family,
                res_id: gen.res_id,
                attrs,
            }
        })
        .collect()
}

/// Encodes with `f` and returns the single element message's list payload, after checking its
/// header and table/set attributes.
fn one_message(set: SetId, delete: bool, f: impl FnOnce(&mut ElementBatch)) -> Vec<u8> {
    let mut b = ElementBatch::new();
    f(&mut b);
    let batch = b.finish().expect("not empty");
    let msgs = messages(&batch.bytes);
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    let (begin, m, end) = (&msgs[0], &msgs[1], &msgs[2]);
    assert_eq!(
        (begin.kind, begin.flags, begin.seq),
        (0x10, NLM_F_REQUEST, 0)
    );
    assert_eq!((begin.family, begin.res_id), (0, 10));
    assert_eq!((end.kind, end.flags, end.seq), (0x11, NLM_F_REQUEST, 2));
    assert_eq!((end.family, end.res_id), (0, 10));
    let (kind, flags) = if delete {
        (0x0a0e, NLM_F_REQUEST | NLM_F_ACK)
    } else {
        (0x0a0c, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK)
    };
    assert_eq!((m.kind, m.flags, m.seq, m.family), (kind, flags, 1, 2));
    assert_eq!(batch.ack_seq, 1);
    assert_eq!(m.attrs[0], (1, b"kube-proxy\0".to_vec()));
    assert_eq!(m.attrs[1], (2, format!("{}\0", set.name()).into_bytes()));
    assert_eq!(m.attrs[2].0, 3 | NLA_F_NESTED);
    assert_eq!(m.attrs.len(), 3);
    m.attrs[2].1.clone()
}

const V4: IpFamily = IpFamily::V4;

#[test]
fn elements_encode_as_nft_encodes_them() {
    let v = SetId::NoEndpointVips;
    let key3 = [ip("10.0.0.3"), Atom::Proto(Protocol::Tcp), Atom::Port(80)];
    let key4 = [ip("10.0.0.4"), Atom::Proto(Protocol::Udp), Atom::Port(53)];
    let got = one_message(v, false, |b| {
        b.add(
            V4,
            v,
            &key3,
            Some(&[Atom::Verdict(NoEndpointVerdict::Reject)]),
        );
        b.add(
            V4,
            v,
            &key4,
            Some(&[Atom::Verdict(NoEndpointVerdict::Drop)]),
        );
    });
    assert_eq!(got, bytes(VERDICTS));
    let got = one_message(v, true, |b| b.delete(V4, v, &key3));
    assert_eq!(got, bytes(VERDICT_DELETE));

    let s = SetId::PodCidrs;
    let got = one_message(s, false, |b| b.add(V4, s, &[net("192.168.0.0/16")], None));
    assert_eq!(got, bytes(RBTREE));
    let got = one_message(s, true, |b| b.delete(V4, s, &[net("192.168.0.0/16")]));
    assert_eq!(got, bytes(RBTREE));
    let got = one_message(s, false, |b| b.add(V4, s, &[net("255.255.0.0/16")], None));
    assert_eq!(got, bytes(RBTREE_OPEN));

    let f = SetId::FirewallAllow;
    let fkey = [
        ip("10.0.0.5"),
        Atom::Proto(Protocol::Tcp),
        Atom::Port(80),
        net("192.168.0.0/16"),
    ];
    assert_eq!(
        one_message(f, false, |b| b.add(V4, f, &fkey, None)),
        bytes(PIPAPO)
    );
    assert_eq!(
        one_message(f, true, |b| b.delete(V4, f, &fkey)),
        bytes(PIPAPO)
    );

    let m = SetId::ClassEndpoints(Route::Vips, 3);
    let key = [
        ip("10.0.0.2"),
        Atom::Proto(Protocol::Udp),
        Atom::Port(53),
        Atom::Slot(1),
    ];
    let got = one_message(m, false, |b| {
        b.add(V4, m, &key, Some(&[ip("10.1.0.2"), Atom::Port(53)]))
    });
    assert_eq!(got, bytes(ENDPOINT));
}

#[test]
fn changes_group_by_set_and_kind_and_split_before_attribute_lengths_overflow() {
    let mut b = ElementBatch::new();
    let c = SetId::ClusterIps;
    let h = SetId::Hairpin;
    b.delete(V4, c, &[ip("10.0.0.1")]);
    b.add(V4, c, &[ip("10.0.0.2")], None);
    b.add(V4, c, &[ip("10.0.0.3")], None);
    b.add(IpFamily::V6, c, &[ip("fd00::3")], None);
    b.add(V4, h, &[ip("10.1.0.1"), ip("10.1.0.1")], None);
    // 20k cluster IPs: 16 bytes each, more than one message can hold.
    for i in 0..20_000u32 {
        b.add(
            V4,
            c,
            &[Atom::Ip(std::net::Ipv4Addr::from(0x0a60_0000 + i).into())],
            None,
        );
    }
    assert_eq!(b.elements(), 20_005);
    let batch = b.finish().unwrap();
    let msgs = messages(&batch.bytes);
    let kinds: Vec<(u16, u8)> = msgs.iter().map(|m| (m.kind & 0xff, m.family)).collect();
    // begin, delete, add v4, add v6, add hairpin, then the big add split in several messages.
    assert_eq!(
        &kinds[..5],
        &[(0x10, 0), (14, 2), (12, 2), (12, 10), (12, 2)]
    );
    assert!(msgs.len() >= 8, "{} messages", msgs.len());
    assert_eq!(kinds.last(), Some(&(0x11, 0)));
    let mut total = 0;
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.seq, i as u32);
        let ack = m.flags & NLM_F_ACK != 0;
        assert_eq!(
            ack,
            i == msgs.len() - 2,
            "only the last element message asks for an ack"
        );
        if let Some((_, list)) = m.attrs.iter().find(|a| a.0 == 3 | NLA_F_NESTED) {
            assert!(list.len() < 65_000);
            total += list.len() / 16;
        }
    }
    assert_eq!(total, 20_005);
    assert_eq!(batch.ack_seq, msgs.len() as u32 - 2);
}

#[test]
fn elements_that_do_not_fit_their_set_are_left_out_and_reported() {
    let mut b = ElementBatch::new();
    b.add(V4, SetId::ClusterIps, &[ip("fd00::1")], None);
    b.add(
        V4,
        SetId::ClusterIps,
        &[ip("10.0.0.1"), ip("10.0.0.2")],
        None,
    );
    b.add(
        V4,
        SetId::NoEndpointVips,
        &[ip("10.0.0.1"), Atom::Proto(Protocol::Tcp), Atom::Port(1)],
        None,
    );
    assert_eq!(b.errors().len(), 3, "{:?}", b.errors());
    assert!(b.is_empty());
    assert!(b.finish().is_none());
    let mut b = ElementBatch::new();
    b.add(V4, SetId::ClusterIps, &[Atom::Port(1)], None);
    b.add(V4, SetId::ClusterIps, &[ip("10.0.0.1")], None);
    assert_eq!(b.errors().len(), 1);
    let batch = b.finish().unwrap();
    // Only the good element is in the message.
    let msgs = messages(&batch.bytes);
    assert_eq!(msgs[1].attrs[2].1.len(), 16);
}

#[test]
fn schemas_match_declared_lengths() {
    use crate::layout::Route;
    for (set, key, value) in [
        (SetId::ClusterIps, 4, None),
        (SetId::FirewallAllow, 16, None),
        (SetId::ClassEndpoints(Route::Vips, 3), 16, Some(8)),
        (SetId::ClassEndpoints(Route::NodePorts, 3), 12, Some(8)),
        (SetId::Affinity(10), 16, Some(8)),
    ] {
        let s = SetSchema::of(set);
        assert_eq!(total_len(&s.key, V4), key, "{set:?}");
        assert_eq!(s.value.map(|v| total_len(&v, V4)), value, "{set:?}");
    }
}

#[test]
fn lookup_keys_are_encoded_as_a_deletion_encodes_them() {
    let set = SetId::ClassEndpoints(Route::Vips, 3);
    let keys: Vec<Vec<Atom>> = (0..3)
        .map(|slot| {
            vec![
                Atom::Ip("10.96.0.1".parse().unwrap()),
                Atom::Proto(Protocol::Tcp),
                Atom::Port(80),
                Atom::Slot(slot),
            ]
        })
        .collect();
    let payload = encode_keys(IpFamily::V4, set, keys.iter().map(Vec::as_slice)).unwrap();
    let mut batch = ElementBatch::new();
    for k in &keys {
        batch.delete(IpFamily::V4, set, k);
    }
    let bytes = batch.finish().unwrap().bytes;
    assert!(!payload.is_empty());
    assert!(
        bytes
            .windows(payload.len())
            .any(|w| w == payload.as_slice()),
        "the lookup's elements are not the deletion's"
    );
    assert!(encode_keys(IpFamily::V4, SetId::PodCidrs, std::iter::empty()).is_err());
}
