use super::*;
use kp_netlink::{messages, Control};

// Fixtures captured on Linux 6.18 (conntrack-tools 1.4.7 to insert, this crate's dump request
// to read), in a scratch namespace:
//
//   conntrack -I -p udp -s 192.0.2.2 -d 10.96.0.10 --sport 40042 --dport 53 \
//       -r 10.244.1.10 -q 192.0.2.2 --reply-port-src 5353 --reply-port-dst 40042 -t 120 --zone 7
//   conntrack -I -p udp -s 2001:db8::2 -d fd00:10:96::10 --sport 40031 --dport 53 \
//       -r fd00:10:244:1::10 -q 2001:db8::2 --reply-port-src 5353 --reply-port-dst 40031 -t 120
//   conntrack -I -p sctp -s 192.0.2.2 -d 10.96.0.50 --sport 40031 --dport 53 -r 10.244.1.10 \
//       -q 192.0.2.2 --reply-port-src 5353 --reply-port-dst 40031 --state ESTABLISHED \
//       --orig-vtag 1 --reply-vtag 2 -t 60
//   (plus a TCP entry, which the filtered dumps below correctly left out)
//
// Each is the first datagram the kernel answered `dump_request(77, family, protocol, true)`
// with: one IPCTNL_MSG_CT_NEW message, flags NLM_F_MULTI | NLM_F_DUMP_FILTERED.

/// IPv4 UDP, zone 7, id 0x005eb62b.
const DUMP_V4_UDP: &str = "\
c8000000 0001 2200 4d000000 967a0000 02000000\
 34000180 14000180 08000100 c0000202 08000200 0a60000a\
          1c000280 05000100 11000000 06000200 9c6a0000 06000300 00350000\
 34000280 14000180 08000100 0af4010a 08000200 c0000202\
          1c000280 05000100 11000000 06000200 14e90000 06000300 9c6a0000\
 06001200 00070000\
 08000300 00000008 08000800 00000000 08000c00 005eb62b 08000b00 00000001\
 08000700 00000072 1c001880 08000100 00000000 08000200 00000000 08000300 00000000";

/// IPv6 UDP, zone 0 (no CTA_ZONE), id 0x5da9e538.
const DUMP_V6_UDP: &str = "\
f0000000 0001 2200 4d000000 967a0000 0a000000\
 4c000180 2c000180 14000300 20010db8000000000000000000000002\
                   14000400 fd000010009600000000000000000010\
          1c000280 05000100 11000000 06000200 9c5f0000 06000300 00350000\
 4c000280 2c000180 14000300 fd000010024400010000000000000010\
                   14000400 20010db8000000000000000000000002\
          1c000280 05000100 11000000 06000200 14e90000 06000300 9c5f0000\
 08000300 00000008 08000800 00000000 08000c00 5da9e538 08000b00 00000001\
 08000700 00000072 1c001880 08000100 00000000 08000200 00000000 08000300 00000000";

/// IPv4 SCTP with its CTA_PROTOINFO_SCTP (state, vtags), id 0xa87ec40f.
const DUMP_V4_SCTP: &str = "\
e0000000 0001 2200 4d000000 967a0000 02000000\
 34000180 14000180 08000100 c0000202 08000200 0a600032\
          1c000280 05000100 84000000 06000200 9c5f0000 06000300 00350000\
 34000280 14000180 08000100 0af4010a 08000200 c0000202\
          1c000280 05000100 84000000 06000200 14e90000 06000300 9c5f0000\
 08000300 00000008 08000800 00000000 08000c00 a87ec40f 08000b00 00000001\
 08000700 00000036 20000480 1c000380 05000100 04000000 08000200 01000000\
 08000300 02000000\
 1c001880 08000100 00000000 08000200 00000000 08000300 00000000";

fn bytes(hex: &str) -> Vec<u8> {
    let digits: Vec<u8> = hex.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).expect("ascii"), 16).expect("hex"))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn only_frame(datagram: &[u8]) -> Message<'_> {
    let mut frames: Vec<Message<'_>> = messages(datagram)
        .collect::<Result<_, _>>()
        .expect("frames");
    assert_eq!(frames.len(), 1);
    frames.remove(0)
}

#[test]
fn a_dumped_ipv4_udp_entry_decodes_with_its_zone_and_id() {
    let datagram = bytes(DUMP_V4_UDP);
    let frame = only_frame(&datagram);
    assert_eq!((frame.kind(), frame.seq()), (0x0100, 77));
    assert_eq!(
        decode_entry(&frame),
        Ok(Some(FlowEntry {
            protocol: Protocol::Udp,
            orig_src: ip("192.0.2.2"),
            orig_dst: ip("10.96.0.10"),
            orig_sport: 40042,
            orig_dport: 53,
            reply_src: ip("10.244.1.10"),
            reply_sport: 5353,
            zone: 7,
            id: Some(0x005e_b62b),
        }))
    );
}

#[test]
fn a_dumped_ipv6_udp_entry_decodes() {
    let datagram = bytes(DUMP_V6_UDP);
    let entry = decode_entry(&only_frame(&datagram))
        .expect("decodes")
        .expect("an entry");
    assert_eq!(
        (
            entry.orig_src,
            entry.orig_dst,
            entry.orig_sport,
            entry.orig_dport
        ),
        (ip("2001:db8::2"), ip("fd00:10:96::10"), 40031, 53)
    );
    assert_eq!(
        (entry.reply_src, entry.reply_sport, entry.zone, entry.id),
        (ip("fd00:10:244:1::10"), 5353, 0, Some(0x5da9_e538))
    );
    assert!(entry.translated());
}

#[test]
fn a_dumped_sctp_entry_decodes_despite_its_sctp_protocol_info() {
    let datagram = bytes(DUMP_V4_SCTP);
    let entry = decode_entry(&only_frame(&datagram))
        .expect("decodes")
        .expect("an entry");
    assert_eq!(entry.protocol, Protocol::Sctp);
    assert_eq!(
        (
            entry.orig_dst,
            entry.orig_dport,
            entry.reply_src,
            entry.reply_sport
        ),
        (ip("10.96.0.50"), 53, ip("10.244.1.10"), 5353)
    );
}

#[test]
fn a_truncated_or_corrupted_entry_is_an_error_not_a_panic() {
    let datagram = bytes(DUMP_V4_UDP);
    for len in 0..datagram.len() {
        let mut cut = datagram[..len].to_vec();
        if len >= 4 {
            // Keep the header's length consistent, as a kernel message would be.
            cut[..4].copy_from_slice(&(len as u32).to_ne_bytes());
        }
        for frame in messages(&cut).flatten() {
            let _ = decode_entry(&frame);
        }
    }
    // Without its reply tuple (the CTA_TUPLE_REPLY attribute renamed to an unknown type).
    let mut no_reply = datagram.clone();
    no_reply[20 + 0x34 + 2] = 0x7f;
    assert_eq!(
        decode_entry(&only_frame(&no_reply)),
        Err("no reply tuple".to_string())
    );
}

#[test]
fn the_dump_request_asks_the_kernel_to_filter_by_protocol() {
    // nlmsghdr: len 48, type CTNETLINK<<8 | GET, flags REQUEST|DUMP, seq 77, pid 0;
    // nfgenmsg: AF_INET; CTA_TUPLE_ORIG { CTA_TUPLE_PROTO { CTA_PROTO_NUM 17 } };
    // CTA_FILTER (nested) { CTA_FILTER_ORIG_FLAGS = CTA_FILTER_F_CTA_PROTO_NUM }.
    let expected = "\
30000000 0101 0103 4d000000 00000000 02000000\
 10000180 0c000280 05000100 11000000\
 0c001980 08000100 08000000";
    assert_eq!(
        hex(&dump_request(77, IpFamily::V4, Protocol::Udp, true)),
        hex(&bytes(expected))
    );
    // Unfiltered: the bare family dump (`conntrack -L -f ipv6`).
    assert_eq!(
        hex(&dump_request(78, IpFamily::V6, Protocol::Sctp, false)),
        hex(&bytes("14000000 0101 0103 4e000000 00000000 0a000000"))
    );
}

#[test]
fn the_delete_request_names_the_original_tuple_zone_and_id() {
    let entry = FlowEntry {
        protocol: Protocol::Udp,
        orig_src: ip("192.0.2.2"),
        orig_dst: ip("10.96.0.10"),
        orig_sport: 40042,
        orig_dport: 53,
        reply_src: ip("10.244.1.10"),
        reply_sport: 5353,
        zone: 7,
        id: Some(0x005e_b62b),
    };
    // nlmsghdr: type CTNETLINK<<8 | DELETE, flags REQUEST|ACK, seq 9; nfgenmsg AF_INET;
    // CTA_TUPLE_ORIG { IP { src, dst }, PROTO { 17, sport, dport } }; CTA_ZONE 7 (be16);
    // CTA_ID (be32).
    let expected = "\
58000000 0201 0500 09000000 00000000 02000000\
 34000180 14000180 08000100 c0000202 08000200 0a60000a\
          1c000280 05000100 11000000 06000200 9c6a0000 06000300 00350000\
 06001200 00070000 08000c00 005eb62b";
    assert_eq!(hex(&delete_request(9, &entry)), hex(&bytes(expected)));
    // Zone 0 and no id: neither attribute.
    let plain = FlowEntry {
        zone: 0,
        id: None,
        ..entry
    };
    assert_eq!(delete_request(9, &plain).len(), 0x58 - 8 - 8);
}

#[test]
fn frames_split_a_datagram_and_stop_at_a_broken_header() {
    let mut datagram = bytes(DUMP_V4_UDP);
    datagram.extend(bytes(DUMP_V6_UDP));
    // NLMSG_DONE, then NLMSG_ERROR with -ENOENT.
    datagram.extend(bytes("14000000 0300 0200 4d000000 00000000 00000000"));
    datagram.extend(bytes(
        "24000000 0200 0000 4e000000 00000000 feffffff 14000000 0202 0500 4e000000 00000000",
    ));
    let framed: Vec<Message<'_>> = messages(&datagram)
        .collect::<Result<_, _>>()
        .expect("frames");
    assert_eq!(
        framed.iter().map(|f| f.kind()).collect::<Vec<_>>(),
        vec![0x0100, 0x0100, 3, 2]
    );
    assert_eq!(framed[2].control(), Ok(Control::Done));
    assert_eq!(
        framed[3].control(),
        Ok(Control::Error(kp_netlink::KernelError::new(2)))
    );

    let mut broken = bytes(DUMP_V4_UDP);
    broken.extend(bytes("ff000000 0001"));
    let results: Vec<_> = messages(&broken).collect();
    assert_eq!(results.len(), 2);
    assert!(results[0].is_ok());
    assert!(results[1].is_err());
}
