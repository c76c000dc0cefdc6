//! The pure layer: annotated raw bytes parse into the expected values, and the writers emit the
//! same bytes back. Byte order is the host's (x86_64, little-endian) where the kernel uses it.

use crate::abi::*;
use crate::{attr, genl, message, messages, nfnl, Control, Header, KernelError, Malformed};

/// The bytes of an annotated hex dump: on each line, the hex groups before the first run of
/// three spaces; the rest of the line is the annotation.
pub(crate) fn bytes(dump: &str) -> Vec<u8> {
    let digits: Vec<u8> = dump
        .lines()
        .map(|l| l.trim_start())
        .flat_map(|l| l.split("   ").next().unwrap_or_default().bytes())
        .filter(u8::is_ascii_hexdigit)
        .collect();
    digits
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).expect("ascii"), 16).expect("hex"))
        .collect()
}

/// Captured on Linux 6.18 in a scratch namespace: the controller's answer to this crate's
/// `genl::get_family_request(buf, 1, "nlctrl")` (what `genl ctrl get name nlctrl` asks), the
/// first datagram, printed by a throwaway test over `Socket::request`.
const NLCTRL_FAMILY: &str = "\
88000000 1000 0000 01000000 9d7f0000   nlmsghdr: len 136, GENL_ID_CTRL, seq 1, port 0x7f9d
01 02 0000                             genlmsghdr: CTRL_CMD_NEWFAMILY, version 2
0b00 0200 6e6c6374726c00 00            CTRL_ATTR_FAMILY_NAME \"nlctrl\"
0600 0100 1000 0000                    CTRL_ATTR_FAMILY_ID 0x10
0800 0300 02000000                     CTRL_ATTR_VERSION 2
0800 0400 00000000                     CTRL_ATTR_HDRSIZE 0
0800 0500 00000000                     CTRL_ATTR_MAXATTR 0
2c00 0600                              CTRL_ATTR_OPS (nested, unflagged)
  1400 0100 0800 0100 03000000 0800 0200 0e000000     op 1: CTRL_CMD_GETFAMILY, flags
  1400 0200 0800 0100 0a000000 0800 0200 0c000000     op 2: CTRL_CMD_GETPOLICY, flags
1c00 0700                              CTRL_ATTR_MCAST_GROUPS
  1800 0100                            group 1
    0800 0200 10000000                 CTRL_ATTR_MCAST_GRP_ID 0x10
    0b00 0100 6e6f7469667900 00        CTRL_ATTR_MCAST_GRP_NAME \"notify\"";

#[test]
fn the_controller_s_family_answer_parses_and_the_writers_emit_it_again() {
    let raw = bytes(NLCTRL_FAMILY);
    let all: Vec<_> = messages(&raw).collect::<Result<_, _>>().expect("frames");
    assert_eq!(all.len(), 1);
    let m = all[0];
    assert_eq!(
        m.header,
        Header {
            len: 136,
            kind: GENL_ID_CTRL,
            flags: 0,
            seq: 1,
            pid: 0x7f9d
        }
    );
    assert_eq!(m.control(), Ok(Control::Data));
    let family = genl::parse_family(&m).expect("family");
    assert_eq!(
        family,
        genl::Family {
            id: 0x10,
            name: "nlctrl".into(),
            version: 2,
            hdrsize: 0,
            maxattr: 0,
            mcast_groups: vec![("notify".into(), 0x10)],
        }
    );

    let mut out = Vec::new();
    let start = message::begin(&mut out, GENL_ID_CTRL, 0, 1);
    genl::GenlHeader {
        cmd: CTRL_CMD_NEWFAMILY,
        version: 2,
    }
    .emit(&mut out);
    attr::put_str(&mut out, CTRL_ATTR_FAMILY_NAME, "nlctrl");
    attr::put_u16(&mut out, CTRL_ATTR_FAMILY_ID, 0x10);
    attr::put_u32(&mut out, CTRL_ATTR_VERSION, 2);
    attr::put_u32(&mut out, CTRL_ATTR_HDRSIZE, 0);
    attr::put_u32(&mut out, CTRL_ATTR_MAXATTR, 0);
    // The kernel does not flag these nests NLA_F_NESTED.
    attr::put_with(&mut out, CTRL_ATTR_OPS, |b| {
        for (i, (cmd, flags)) in [(3u32, 0x0eu32), (10, 0x0c)].into_iter().enumerate() {
            attr::put_with(b, i as u16 + 1, |b| {
                attr::put_u32(b, 1, cmd);
                attr::put_u32(b, 2, flags);
            });
        }
    });
    attr::put_with(&mut out, CTRL_ATTR_MCAST_GROUPS, |b| {
        attr::put_with(b, 1, |b| {
            attr::put_u32(b, CTRL_ATTR_MCAST_GRP_ID, 0x10);
            attr::put_str(b, CTRL_ATTR_MCAST_GRP_NAME, "notify");
        });
    });
    message::end(&mut out, start);
    message::set_seq(&mut out, start, 1);
    out[12..16].copy_from_slice(&0x7f9du32.to_ne_bytes());
    assert_eq!(out, raw);
}

#[test]
fn a_family_request_is_what_genl_ctrl_get_sends() {
    let mut out = Vec::new();
    genl::get_family_request(&mut out, 7, "IPVS");
    let want = bytes(
        "\
        20000000 1000 0500 07000000 00000000   len 32, GENL_ID_CTRL, REQUEST|ACK, seq 7
        03 01 0000                             CTRL_CMD_GETFAMILY, version 1
        0900 0200 49505653 00 000000           CTRL_ATTR_FAMILY_NAME \"IPVS\"",
    );
    assert_eq!(out, want);
}

/// An `NLMSG_ERROR` refusing an nf_tables `GETTABLE` (seq 3) with -ENOENT: the code, then the
/// refused request's header, flagged `NLM_F_CAPPED` because the echo is cut to the header (as
/// the kernel sends it on a socket with `NETLINK_CAP_ACK`).
const ENOENT_ERROR: &str = "\
24000000 0200 0001 03000000 00000000   len 36, NLMSG_ERROR, flags NLM_F_CAPPED, seq 3
feffffff                               error -2
14000000 010a 0500 03000000 9d7f0000   the request: len 20, NFT_MSG_GETTABLE, REQUEST|ACK";

#[test]
fn an_error_message_is_a_typed_errno_with_the_request_it_refuses() {
    let raw = bytes(ENOENT_ERROR);
    let m = messages(&raw).next().expect("one").expect("framed");
    let Control::Error(e) = m.control().expect("control") else {
        panic!("not an error: {m:?}");
    };
    assert_eq!(e, KernelError { errno: ENOENT });
    assert!(e.is_not_found() && !e.is_permission_denied() && !e.is_transient());
    assert_eq!(e.to_string(), "ENOENT (No such file or directory)");
    let req = m.error_request().expect("echoed header");
    assert_eq!((req.kind, req.seq, req.flags), (0x0a01, 3, 5));

    let mut out = Vec::new();
    let start = message::begin(&mut out, NLMSG_ERROR, 0x100, 3);
    out.extend_from_slice(&(-ENOENT).to_ne_bytes());
    req.emit(&mut out);
    message::end(&mut out, start);
    assert_eq!(out, raw);
}

#[test]
fn errnos_are_told_apart_by_number() {
    assert!(KernelError::new(EPERM).is_permission_denied());
    assert!(KernelError::new(EACCES).is_permission_denied());
    assert!(KernelError::new(EEXIST).is_exists());
    assert!(KernelError::new(EOPNOTSUPP).is_not_supported());
    assert!(KernelError::new(ENOBUFS).is_transient());
    assert_eq!(KernelError::new(ENOBUFS).name(), Some("ENOBUFS"));
    assert_eq!(KernelError::new(4000).errno_label(), "errno 4000");
}

/// A dump's tail: two nf_tables `NEWTABLE` replies flagged `NLM_F_MULTI`, the second also
/// `NLM_F_DUMP_INTR`, then `NLMSG_DONE` with code 0, all of seq 9 in one datagram.
const DUMP: &str = "\
1c000000 000a 0200 09000000 00000000   NFT_MSG_NEWTABLE, NLM_F_MULTI
02 00 0001                             nfgenmsg: NFPROTO_IPV4, v0, res_id 1
0600 0100 6100 0000                    NFTA_TABLE_NAME \"a\"
1c000000 000a 1200 09000000 00000000   NFT_MSG_NEWTABLE, NLM_F_MULTI | NLM_F_DUMP_INTR
02 00 0001
0600 0100 6200 0000                    NFTA_TABLE_NAME \"b\"
14000000 0300 0200 09000000 00000000   NLMSG_DONE, NLM_F_MULTI
00000000                               code 0";

#[test]
fn a_multipart_dump_ends_with_done_and_reports_an_interruption() {
    let raw = bytes(DUMP);
    let all: Vec<_> = messages(&raw).collect::<Result<_, _>>().expect("frames");
    assert_eq!(all.len(), 3);
    let names: Vec<(&str, bool)> = all[..2]
        .iter()
        .map(|m| {
            assert!(m.is_multipart());
            assert_eq!(m.control(), Ok(Control::Data));
            assert_eq!(nfnl::subsys(m.kind()), NFNL_SUBSYS_NFTABLES);
            let (gen, body) = nfnl::NfGenMsg::parse(m.payload).expect("nfgenmsg");
            assert_eq!((gen.family, gen.res_id), (NFPROTO_IPV4, 1));
            let a: [Option<&[u8]>; 2] = attr::table(body).expect("attrs");
            (
                attr::str(a[1], "name").expect("name"),
                m.is_dump_interrupted(),
            )
        })
        .collect();
    assert_eq!(names, [("a", false), ("b", true)]);
    assert_eq!(all[2].control(), Ok(Control::Done));

    let mut out = Vec::new();
    for (name, flags) in [("a", NLM_F_MULTI), ("b", NLM_F_MULTI | NLM_F_DUMP_INTR)] {
        let s = message::begin(&mut out, nfnl::msg_type(NFNL_SUBSYS_NFTABLES, 0), flags, 9);
        nfnl::NfGenMsg {
            res_id: 1,
            ..nfnl::NfGenMsg::new(NFPROTO_IPV4)
        }
        .emit(&mut out);
        attr::put_str(&mut out, 1, name);
        message::end(&mut out, s);
    }
    let s = message::begin(&mut out, NLMSG_DONE, NLM_F_MULTI, 9);
    out.extend_from_slice(&0i32.to_ne_bytes());
    message::end(&mut out, s);
    assert_eq!(out, raw);
}

#[test]
fn a_dump_that_ends_with_an_errno_in_done_is_refused() {
    let raw = bytes("14000000 0300 0200 09000000 00000000 eaffffff"); // -EINVAL
    let m = messages(&raw).next().expect("one").expect("framed");
    assert_eq!(m.control(), Ok(Control::Error(KernelError::new(EINVAL))));
}

#[test]
fn an_ack_is_an_error_message_with_code_zero() {
    let raw =
        bytes("24000000 0200 0001 05000000 00000000 00000000 14000000 000a 0500 05000000 00000000");
    let m = messages(&raw).next().expect("one").expect("framed");
    assert_eq!(m.control(), Ok(Control::Ack));
}

/// An nfnetlink batch as nft sends it: `BATCH_BEGIN` (seq 0, res_id NFNL_SUBSYS_NFTABLES in
/// network order), one request, `BATCH_END`.
const BATCH: &str = "\
14000000 1000 0100 00000000 00000000   NFNL_MSG_BATCH_BEGIN, REQUEST, seq 0
00 00 000a                             nfgenmsg: UNSPEC, v0, res_id 10
24000000 000a 0504 01000000 00000000   NFT_MSG_NEWTABLE, REQUEST|ACK|CREATE, seq 1
02 00 0000                             nfgenmsg: NFPROTO_IPV4
0f00 0100 6b7562652d70726f787900 00    NFTA_TABLE_NAME \"kube-proxy\"
14000000 1100 0100 02000000 00000000   NFNL_MSG_BATCH_END, seq 2
00 00 000a";

#[test]
fn a_batch_is_framed_by_begin_and_end_messages_of_its_subsystem() {
    let mut out = Vec::new();
    nfnl::batch_control(&mut out, NFNL_MSG_BATCH_BEGIN, 0, NFNL_SUBSYS_NFTABLES);
    assert_eq!(out.len(), nfnl::batch_control_len());
    let m = nfnl::begin(
        &mut out,
        NFNL_SUBSYS_NFTABLES,
        0,
        NLM_F_CREATE,
        1,
        NFPROTO_IPV4,
    );
    attr::put_str(&mut out, 1, "kube-proxy");
    message::end(&mut out, m);
    message::add_flags(&mut out, m, NLM_F_ACK);
    nfnl::batch_control(&mut out, NFNL_MSG_BATCH_END, 2, NFNL_SUBSYS_NFTABLES);
    assert_eq!(out, bytes(BATCH));
    let kinds: Vec<(u16, u32)> = messages(&out)
        .map(|m| m.map(|m| (m.kind(), m.seq())))
        .collect::<Result<_, _>>()
        .expect("frames");
    assert_eq!(kinds, [(0x10, 0), (0x0a00, 1), (0x11, 2)]);
}

/// Nested attributes with padding: a ctnetlink original tuple, flagged `NLA_F_NESTED`, holding
/// an IP nest (two IPv4 addresses) and a protocol nest (protocol byte padded to 4, two ports in
/// network order padded from 6 to 8).
const TUPLE: &str = "\
3400 0180                              CTA_TUPLE_ORIG | NLA_F_NESTED, len 52
  1400 0180                            CTA_TUPLE_IP
    0800 0100 c0000202                 CTA_IP_V4_SRC 192.0.2.2
    0800 0200 0a60000a                 CTA_IP_V4_DST 10.96.0.10
  1c00 0280                            CTA_TUPLE_PROTO
    0500 0100 11 000000                CTA_PROTO_NUM 17, padded
    0600 0200 9c6a 0000                CTA_PROTO_SRC_PORT 40042, padded
    0600 0300 0035 0000                CTA_PROTO_DST_PORT 53, padded";

#[test]
fn nested_attributes_keep_their_alignment_both_ways() {
    let raw = bytes(TUPLE);
    let top: Vec<attr::Attr<'_>> = attr::attrs(&raw).collect::<Result<_, _>>().expect("attrs");
    assert_eq!(top.len(), 1);
    assert!(top[0].nested && !top[0].net_byteorder);
    assert_eq!(top[0].kind, 1);
    let t: [Option<&[u8]>; 3] = attr::table(top[0].payload).expect("tuple");
    let ip: [Option<&[u8]>; 3] = attr::table(t[1].expect("ip")).expect("ip");
    assert_eq!(attr::be32(ip[1], "src"), Ok(0xc000_0202));
    let proto: [Option<&[u8]>; 4] = attr::table(t[2].expect("proto")).expect("proto");
    assert_eq!(attr::u8(proto[1], "proto"), Ok(17));
    assert_eq!(attr::be16(proto[2], "sport"), Ok(40042));
    assert_eq!(attr::be16(proto[3], "dport"), Ok(53));

    let mut out = Vec::new();
    attr::put_nested(&mut out, 1, |b| {
        attr::put_nested(b, 1, |b| {
            attr::put(b, 1, &[192, 0, 2, 2]);
            attr::put(b, 2, &[10, 96, 0, 10]);
        });
        attr::put_nested(b, 2, |b| {
            attr::put_u8(b, 1, 17);
            attr::put_be16(b, 2, 40042);
            attr::put_be16(b, 3, 53);
        });
    });
    assert_eq!(out, raw);
}

#[test]
fn a_record_longer_than_its_buffer_ends_the_walk_with_an_error() {
    let raw = bytes("0800 0100 01000000 1000 0200 00000000");
    let got: Vec<_> = attr::attrs(&raw).collect();
    assert_eq!(got.len(), 2);
    assert!(got[0].is_ok());
    assert_eq!(
        got[1],
        Err(Malformed("attribute length 16 with 8 bytes left".into()))
    );
    let raw = bytes("ff000000 1000 0000 01000000 00000000");
    let got: Vec<_> = messages(&raw).collect();
    assert_eq!(
        got,
        [Err(Malformed(
            "message length 255 with 16 bytes left".into()
        ))]
    );
    assert!(attr::be32(Some(&[1, 2]), "x").is_err());
    assert_eq!(attr::be32(None, "x"), Err(Malformed("x missing".into())));
}
