//! Decoding kernel replies without a kernel.
//!
//! The annotated bytes below are replies the kernel sent (Linux 6.18, nft 1.0.6, x86_64), captured
//! by printing each reply body this module received after loading, in a scratch namespace:
//!
//! ```text
//! add table ip kube-proxy
//! add chain ip kube-proxy reject-packet
//! add rule ip kube-proxy reject-packet reject comment "reject"
//! add map ip kube-proxy m { typeof ip daddr . meta l4proto . th dport . numgen random mod 10 : ip daddr . th dport; }
//! add element ip kube-proxy m { 10.96.0.1 . tcp . 80 . 1 : 10.128.0.1 . 8080 }
//! add set ip kube-proxy p { type ipv4_addr; flags interval; }
//! add element ip kube-proxy p { 10.244.0.0/16, 192.168.1.0/25, 192.168.1.128/26 }
//! add set ip kube-proxy f { type ipv4_addr . inet_proto . inet_service . ipv4_addr; flags interval; }
//! add element ip kube-proxy f { 198.51.100.1 . tcp . 80 . 192.0.2.0/24 }
//! add map ip kube-proxy v { type ipv4_addr . inet_proto . inet_service : verdict; }
//! add element ip kube-proxy v { 10.96.0.2 . udp . 53 : drop, 10.96.0.3 . sctp . 80 : goto reject-packet }
//! ```
//!
//! Netlink headers are host order (little-endian here); nf_tables' own integers are big-endian.

use super::*;

/// Bytes from hex, ignoring spaces (so that the literals can be grouped by field).
fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert!(digits.len().is_multiple_of(2), "odd hex: {s}");
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

fn t(atoms: &[Atom]) -> Tuple {
    Tuple::new(atoms)
}

fn ip(s: &str) -> Atom {
    Atom::Ip(s.parse().unwrap())
}

fn net(s: &str) -> Atom {
    Atom::Net(s.parse().unwrap())
}

fn set_info(name: &str, flags: u32, key_len: u32, data: Option<(u32, u32)>) -> SetInfo {
    SetInfo {
        name: name.into(),
        flags,
        key_len,
        data_type: data.map(|d| d.0),
        data_len: data.map(|d| d.1),
        count: None,
    }
}

/// Runs reply bodies through a decoder for `info` and `schema`; also through one keeping only
/// digests (the periodic check's), which must keep exactly the digests of the tuples.
fn decode(
    info: &SetInfo,
    family: IpFamily,
    schema: &SetSchema,
    bodies: &[Vec<u8>],
) -> Result<BTreeMap<Tuple, Option<Tuple>>, Malformed> {
    let mut d = SetDecoder::new(info, family, schema)?;
    let mut digests = SetDecoder::<Digests>::checked(info, family, schema)?;
    for b in bodies {
        d.message(b)?;
        digests.message(b)?;
    }
    let tuples = d.finish()?;
    let digests = digests.finish()?;
    let mut want: Vec<ElementDigest> = tuples
        .iter()
        .map(|(k, v)| ElementDigest::of(k.atoms(), v.as_ref().map(Tuple::atoms)))
        .collect();
    want.sort_unstable();
    assert_eq!(digests, want, "digests of {tuples:?}");
    assert!(digests.windows(2).all(|w| w[0].key < w[1].key));
    Ok(tuples)
}

/// `NFTA_SET_ELEM_LIST_TABLE "kube-proxy"` and `NFTA_SET_ELEM_LIST_SET "<one letter>"`.
fn list_header(set: char) -> String {
    format!(
        "0f00 0100 6b7562652d70726f787900 00  0600 0200 {:02x}00 0000",
        set as u32
    )
}

/// The end of every element dump: a reply with an empty `NFTA_SET_ELEM_LIST_ELEMENTS`.
fn empty_reply(set: char) -> Vec<u8> {
    hex(&format!("{} 0400 0300", list_header(set)))
}

#[test]
fn a_captured_endpoint_map_element_decodes_with_its_slot_in_host_order() {
    let body = annotated(&format!(
        "{}
         3000 0300                      # NFTA_SET_ELEM_LIST_ELEMENTS
           2c00 0100                    #   NFTA_LIST_ELEM
             1800 0100 1400 0100        #     NFTA_SET_ELEM_KEY, NFTA_DATA_VALUE:
               0a600001                 #       10.96.0.1
               06000000                 #       tcp, padded to 4
               00500000                 #       80, big-endian, padded to 4
               01000000                 #       slot 1, host order
             1000 0200 0c00 0100        #     NFTA_SET_ELEM_DATA, NFTA_DATA_VALUE:
               0a800001                 #       10.128.0.1
               1f900000                 #       8080",
        list_header('m')
    ));
    let info = set_info("m", NFT_SET_MAP, 16, Some((0, 8)));
    let schema = SetSchema::of(SetId::ClassEndpoints(kp_nftables_plan::Route::Vips, 10));
    let got = decode(&info, IpFamily::V4, &schema, &[body, empty_reply('m')]).unwrap();
    let key = t(&[
        ip("10.96.0.1"),
        Atom::Proto(Protocol::Tcp),
        Atom::Port(80),
        Atom::Port(1),
    ]);
    let want = BTreeMap::from([(key, Some(t(&[ip("10.128.0.1"), Atom::Port(8080)])))]);
    assert_eq!(got, want);
}

/// Strips `#` comments and joins lines.
fn annotated(s: &str) -> Vec<u8> {
    hex(&s
        .lines()
        .map(|l| l.split('#').next().unwrap())
        .collect::<String>())
}

#[test]
fn captured_interval_bounds_pair_into_networks_even_when_adjacent() {
    // The kernel dumps the rbtree from the top down; an end element carries
    // NFTA_SET_ELEM_FLAGS = NFT_SET_ELEM_INTERVAL_END and is the first address after the range.
    let body = annotated(&format!(
        "{}
         9400 0300
           1800 0100 0c00 0100 0800 0100 c0a801c0  0800 0300 00000001  # end 192.168.1.192
           1000 0100 0c00 0100 0800 0100 c0a80180                      # start 192.168.1.128
           1800 0100 0c00 0100 0800 0100 c0a80180  0800 0300 00000001  # end 192.168.1.128
           1000 0100 0c00 0100 0800 0100 c0a80100                      # start 192.168.1.0
           1800 0100 0c00 0100 0800 0100 0af50000  0800 0300 00000001  # end 10.245.0.0
           1000 0100 0c00 0100 0800 0100 0af40000                      # start 10.244.0.0
           1800 0100 0c00 0100 0800 0100 00000000  0800 0300 00000001  # nft's end at 0.0.0.0",
        list_header('p')
    ));
    let info = set_info("p", NFT_SET_INTERVAL, 4, None);
    let got = decode(
        &info,
        IpFamily::V4,
        &SetSchema::of(SetId::PodCidrs),
        &[body],
    )
    .unwrap();
    let want: BTreeMap<_, _> = ["10.244.0.0/16", "192.168.1.0/25", "192.168.1.128/26"]
        .into_iter()
        .map(|n| (t(&[net(n)]), None))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn a_captured_concatenated_range_becomes_a_network_in_its_last_field() {
    let body = annotated(&format!(
        "{}
         3800 0300 3400 0100
           1800 0100 1400 0100 c6336401 06000000 00500000 c0000200  # key: ... . 192.0.2.0
           1800 0a00 1400 0100 c6336401 06000000 00500000 c00002ff  # key end: ... . 192.0.2.255",
        list_header('f')
    ));
    let info = set_info("f", NFT_SET_INTERVAL | 0x80, 16, None);
    let schema = SetSchema::of(SetId::FirewallAllow);
    let got = decode(&info, IpFamily::V4, &schema, &[body]).unwrap();
    let key = t(&[
        ip("198.51.100.1"),
        Atom::Proto(Protocol::Tcp),
        Atom::Port(80),
        net("192.0.2.0/24"),
    ]);
    assert_eq!(got, BTreeMap::from([(key, None)]));
}

#[test]
fn captured_verdicts_decode_to_reject_and_drop() {
    let body = annotated(&format!(
        "{}
         6800 0300
           3c00 0100
             1400 0100 1000 0100 0a600003 84000000 00500000    # 10.96.0.3 . sctp . 80
             2400 0200 2000 0200                               # NFTA_SET_ELEM_DATA, NFTA_DATA_VERDICT
               0800 0100 fffffffc                              #   NFTA_VERDICT_CODE NFT_GOTO
               1200 0200 72656a6563742d7061636b657400 0000     #   NFTA_VERDICT_CHAIN reject-packet
           2800 0100
             1400 0100 1000 0100 0a600002 11000000 00350000    # 10.96.0.2 . udp . 53
             1000 0200 0c00 0200 0800 0100 00000000            # NF_DROP",
        list_header('v')
    ));
    let info = set_info("v", NFT_SET_MAP | 0x80, 12, Some((NFT_DATA_VERDICT, 0)));
    let schema = SetSchema::of(SetId::NoEndpointVips);
    let got = decode(&info, IpFamily::V4, &schema, &[body]).unwrap();
    let reject = Some(t(&[Atom::Verdict(NoEndpointVerdict::Reject)]));
    let drop = Some(t(&[Atom::Verdict(NoEndpointVerdict::Drop)]));
    let want = BTreeMap::from([
        (
            t(&[ip("10.96.0.3"), Atom::Proto(Protocol::Sctp), Atom::Port(80)]),
            reject,
        ),
        (
            t(&[ip("10.96.0.2"), Atom::Proto(Protocol::Udp), Atom::Port(53)]),
            drop,
        ),
    ]);
    assert_eq!(got, want);
}

#[test]
fn a_captured_rule_yields_its_table_chain_and_comment() {
    let body = annotated(
        "0f00 0100 6b7562652d70726f787900 00                # NFTA_RULE_TABLE kube-proxy
         1200 0200 72656a6563742d7061636b657400 0000        # NFTA_RULE_CHAIN reject-packet
         0c00 0300 0000000000000002                         # NFTA_RULE_HANDLE
         2800 0400 2400 0100 0b00 0100 72656a65637400 00    # NFTA_RULE_EXPRESSIONS: reject
                   1400 0200 0800 0100 00000000 0500 0200 03 000000
         0d00 0700 00 07 72656a65637400 000000              # NFTA_RULE_USERDATA: comment",
    );
    let a: [Option<&[u8]>; 8] = attr_table(&body).unwrap();
    assert_eq!(
        str_attr(a[usize::from(NFTA_RULE_TABLE)], "table").unwrap(),
        TABLE
    );
    assert_eq!(
        str_attr(a[usize::from(NFTA_RULE_CHAIN)], "chain").unwrap(),
        REJECT_PACKET
    );
    assert_eq!(
        a[usize::from(NFTA_RULE_USERDATA)].and_then(rule_comment),
        Some("reject")
    );
}

#[test]
fn rule_user_data_is_searched_for_the_comment_record() {
    // Another record first (type 1, 2 bytes), then the comment.
    assert_eq!(rule_comment(&hex("01 02 abcd 00 04 61626300")), Some("abc"));
    assert_eq!(rule_comment(&hex("01 02 abcd")), None);
    // A record running past the end is not read.
    assert_eq!(rule_comment(&hex("00 09 616263")), None);
    assert_eq!(rule_comment(&[]), None);
}

/// One element dump reply of a single-address v4 interval set: `(address, is end)`.
fn bounds_reply(bounds: &[([u8; 4], bool)]) -> Vec<u8> {
    let mut elements = String::new();
    for (a, end) in bounds {
        let a = a.iter().map(|b| format!("{b:02x}")).collect::<String>();
        if *end {
            elements.push_str(&format!(
                "1800 0100 0c00 0100 0800 0100 {a} 0800 0300 00000001 "
            ));
        } else {
            elements.push_str(&format!("1000 0100 0c00 0100 0800 0100 {a} "));
        }
    }
    let len = 4 + hex(&elements).len();
    hex(&format!(
        "{} {:02x}{:02x} 0300 {elements}",
        list_header('p'),
        len & 0xff,
        len >> 8
    ))
}

fn pod_cidrs(bounds: &[([u8; 4], bool)]) -> Result<BTreeMap<Tuple, Option<Tuple>>, Malformed> {
    let info = set_info("p", NFT_SET_INTERVAL, 4, None);
    decode(
        &info,
        IpFamily::V4,
        &SetSchema::of(SetId::PodCidrs),
        &[bounds_reply(bounds)],
    )
}

#[test]
fn intervals_at_both_ends_of_the_address_space_are_read() {
    // 0.0.0.0/8 starts at zero (no gap marker), 255.255.255.0/24 has no end element, and a
    // single address comes back as a plain address, as `canonical` makes it.
    let got = pod_cidrs(&[
        ([0, 0, 0, 0], false),
        ([1, 0, 0, 0], true),
        ([192, 0, 2, 1], false),
        ([192, 0, 2, 2], true),
        ([255, 255, 255, 0], false),
    ])
    .unwrap();
    let want: BTreeMap<_, _> = [net("0.0.0.0/8"), ip("192.0.2.1"), net("255.255.255.0/24")]
        .into_iter()
        .map(|a| (t(&[a]), None))
        .collect();
    assert_eq!(got, want);
    // The whole space: a start at zero and nothing else.
    let all = pod_cidrs(&[([0, 0, 0, 0], false)]).unwrap();
    assert_eq!(all, BTreeMap::from([(t(&[net("0.0.0.0/0")]), None)]));
}

#[test]
fn intervals_that_are_not_networks_or_lack_an_end_are_errors() {
    let err = pod_cidrs(&[([10, 0, 0, 0], false), ([10, 0, 0, 3], true)]).unwrap_err();
    assert_eq!(err, "interval 10.0.0.0-10.0.0.2 is not a network");
    let err = pod_cidrs(&[([10, 0, 0, 0], false), ([10, 0, 1, 0], false)]).unwrap_err();
    assert_eq!(
        err,
        "intervals start at 10.0.0.0 and 10.0.1.0 with no end between"
    );
}

#[test]
fn a_set_declared_otherwise_than_its_schema_is_refused_before_decoding() {
    let vip = SetSchema::of(SetId::MasqVips);
    let err =
        |info: SetInfo, schema: &SetSchema| SetDecoder::new(&info, IpFamily::V4, schema).err();
    assert_eq!(
        err(set_info("x", 0, 16, None), &vip).as_deref(),
        Some("the kernel's key length is 16, the schema's 12")
    );
    assert_eq!(
        err(set_info("x", NFT_SET_INTERVAL, 12, None), &vip).as_deref(),
        Some("the kernel's interval flag is true, the schema's false")
    );
    let verdicts = SetSchema::of(SetId::NoEndpointVips);
    assert_eq!(
        err(set_info("x", NFT_SET_MAP, 12, Some((0, 8))), &verdicts).as_deref(),
        Some("the kernel's kind is a data map, the schema's a verdict map")
    );
    // The same schema in the ip6 table: 16 + 4 + 4 bytes.
    assert!(SetDecoder::new(&set_info("x", 0, 24, None), IpFamily::V6, &vip).is_ok());
}

#[test]
fn bytes_that_do_not_fit_the_schema_are_errors_not_guesses() {
    let mut out = Vec::new();
    let kinds = [AtomKind::Addr, AtomKind::Proto, AtomKind::Port];
    let err = decode_fields(&kinds, IpFamily::V4, &hex("0a600001 06000000"), &mut out);
    assert_eq!(err, Err("8 bytes where the schema needs 12".into()));
    let err = decode_fields(
        &kinds,
        IpFamily::V4,
        &hex("0a600001 01000000 00500000"),
        &mut out,
    );
    assert_eq!(err, Err("IP protocol 1 is not one Kubernetes uses".into()));
    // A single field is not padded: an IPv6 address alone is 16 bytes.
    let v6 = hex("20010db8000000000000000000000001");
    out.clear();
    decode_fields(&[AtomKind::Addr], IpFamily::V6, &v6, &mut out).unwrap();
    assert_eq!(out, [ip("2001:db8::1")]);
}

#[test]
fn atoms_are_made_canonical_exactly_as_canonical_does() {
    let atoms = [
        Atom::Slot(0),
        Atom::Slot(65535),
        Atom::Slot(65536),
        Atom::Port(7),
        net("10.0.0.1/32"),
        net("10.0.0.0/31"),
        net("2001:db8::1/128"),
        ip("10.0.0.1"),
        Atom::Proto(Protocol::Sctp),
        Atom::Verdict(NoEndpointVerdict::Drop),
    ];
    let mut ours = atoms;
    canonicalize(&mut ours);
    assert_eq!(t(&ours), crate::canonical(&t(&atoms)));
}

// Framing (datagrams, NLMSG_DONE, NLMSG_ERROR, NLM_F_DUMP_INTR) is kp-netlink's, tested there.

#[test]
fn kernel_errors_keep_their_errno_and_name_it() {
    let e = socket_error(
        "netlink list table ip kube-proxy",
        SocketError::Kernel {
            seq: 3,
            error: KernelError::new(2),
        },
        Some("table missing"),
    );
    assert_eq!(
        e.to_string(),
        "netlink list table ip kube-proxy failed: netlink error -ENOENT (table missing)"
    );
    assert!(not_found(&e));
    let e = socket_error(
        "netlink list sets ip kube-proxy",
        SocketError::Kernel {
            seq: 3,
            error: KernelError::new(1),
        },
        Some("table missing"),
    );
    assert!(
        e.to_string()
            .ends_with("netlink error -EPERM (Operation not permitted)"),
        "{e}"
    );
    assert!(!not_found(&e));
    assert!(matches!(e, Error::Netlink { errno: Some(k), .. } if k.is_permission_denied()));
}

#[test]
fn replies_of_another_subsystem_or_without_nfgenmsg_are_errors() {
    let mut buf = Vec::new();
    let m = message::begin(&mut buf, 0x0a0c, 0, 1);
    buf.extend_from_slice(&[2, 0, 0, 7]);
    buf.extend_from_slice(b"body");
    message::end(&mut buf, m);
    let msg = message::messages(&buf).next().unwrap().unwrap();
    assert_eq!(reply_body(&msg), Ok(&b"body"[..]));
    let mut buf = Vec::new();
    let m = message::begin(&mut buf, 0x0102, 0, 1);
    buf.extend_from_slice(&[2, 0, 0, 7]);
    message::end(&mut buf, m);
    let msg = message::messages(&buf).next().unwrap().unwrap();
    assert!(reply_body(&msg).is_err());
}

#[test]
fn truncated_attributes_are_errors() {
    let short = hex("0800 0100 0a00");
    let t: Result<[Option<&[u8]>; 4], _> = attr_table(&short);
    assert_eq!(t.unwrap_err(), "attribute length 8 with 6 bytes left");
}

#[test]
fn a_set_element_request_is_encoded_as_the_kernel_expects() {
    let table = cstr(TABLE);
    let set = cstr("ab");
    let mut got = Vec::new();
    encode_request(
        &mut got,
        NFT_MSG_GETSETELEM,
        NLM_F_DUMP,
        9,
        kp_netlink::abi::NFPROTO_IPV6,
        &[
            (NFTA_SET_ELEM_LIST_TABLE, &table),
            (NFTA_SET_ELEM_LIST_SET, &set),
        ],
    );
    let want = annotated(
        "2c000000                              # nlmsg_len 44
         0d0a                                  # NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETSETELEM
         0103                                  # NLM_F_REQUEST | NLM_F_DUMP
         09000000 00000000                     # seq 9, pid 0
         0a 00 0000                            # nfgenmsg: NFPROTO_IPV6, NFNETLINK_V0, res_id
         0f00 0100 6b7562652d70726f787900 00   # NFTA_SET_ELEM_LIST_TABLE kube-proxy
         0700 0200 616200 00                   # NFTA_SET_ELEM_LIST_SET ab",
    );
    assert_eq!(got, want);
}

#[test]
fn every_planner_set_has_a_schema_matching_its_declaration() {
    use kp_nftables_plan::Route;
    // Key and value lengths nft declares for each of the planner's sets in the ip table
    // (`nft --debug=netlink` on a loaded table: 4 bytes per concatenated field).
    let cases = [
        (SetId::ClusterIps, 4, None),
        (SetId::PodCidrs, 4, None),
        (SetId::MasqVips, 12, None),
        (SetId::MasqNodePorts, 8, None),
        (SetId::FirewallAllow, 16, None),
        (SetId::Hairpin, 8, None),
        (SetId::Class(Route::LocalSourceNodePorts, 3), 8, None),
        (SetId::ClassEndpoints(Route::Vips, 3), 16, Some(8)),
        (SetId::ClassEndpoints(Route::NodePorts, 3), 12, Some(8)),
        (SetId::Affinity(60), 16, Some(8)),
    ];
    for (set, key, value) in cases {
        let s = SetSchema::of(set);
        assert_eq!(total_len(&s.key, IpFamily::V4), key, "{set:?}");
        assert_eq!(
            s.value.map(|v| total_len(&v, IpFamily::V4)),
            value,
            "{set:?}"
        );
        let declared_interval = set.declaration(IpFamily::V4).contains("interval");
        assert_eq!(s.interval, declared_interval, "{set:?}");
        assert_eq!(
            s.verdict_map,
            set.declaration(IpFamily::V4).contains("verdict"),
            "{set:?}"
        );
    }
}

#[test]
fn a_batch_decodes_back_into_the_changes_it_was_encoded_from() {
    use kp_nftables_plan::element::NoEndpointVerdict;
    use kp_nftables_plan::{ElementBatch, Route};
    let vip = [ip("10.96.0.10"), Atom::Proto(Protocol::Tcp), Atom::Port(80)];
    let slot = |s| {
        let mut k = vip.to_vec();
        k.push(Atom::Slot(s));
        k
    };
    let endpoints = SetId::ClassEndpoints(Route::Vips, 3);
    let mut b = ElementBatch::new();
    b.delete(IpFamily::V4, endpoints, &slot(2));
    b.add(
        IpFamily::V4,
        endpoints,
        &slot(2),
        Some(&[ip("10.244.1.14"), Atom::Port(8080)]),
    );
    // Two networks and one reaching the top of the space: bounds pair back into networks.
    for n in ["10.244.0.0/16", "192.168.1.128/26", "255.255.255.0/24"] {
        b.add(IpFamily::V4, SetId::PodCidrs, &[net(n)], None);
    }
    b.add(
        IpFamily::V6,
        SetId::NoEndpointVips,
        &[ip("fd00::10"), Atom::Proto(Protocol::Udp), Atom::Port(53)],
        Some(&[Atom::Verdict(NoEndpointVerdict::Drop)]),
    );
    let encoded = b.finish().expect("a batch");
    let decoded = decode_batch(&encoded.bytes).expect("our own batch decodes");
    let summary: Vec<(IpFamily, String, bool, Vec<String>)> = decoded
        .iter()
        .map(|m| {
            let els = m
                .elements
                .iter()
                .map(|(k, v)| match v {
                    Some(v) => format!("{k} : {v}"),
                    None => k.to_string(),
                })
                .collect();
            (m.family, m.set.clone(), m.delete, els)
        })
        .collect();
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        summary,
        [
            (
                IpFamily::V4,
                "vips-3-endpoints".into(),
                true,
                s(&["10.96.0.10 . tcp . 80 . 2"])
            ),
            (
                IpFamily::V4,
                "vips-3-endpoints".into(),
                false,
                s(&["10.96.0.10 . tcp . 80 . 2 : 10.244.1.14 . 8080"])
            ),
            (
                IpFamily::V4,
                "pod-cidrs".into(),
                false,
                s(&["10.244.0.0/16", "192.168.1.128/26", "255.255.255.0/24"])
            ),
            (
                IpFamily::V6,
                "no-endpoint-vips".into(),
                false,
                s(&["fd00::10 . udp . 53 : drop"])
            ),
        ]
    );
    // Bytes that are not a batch are refused.
    assert!(decode_batch(&encoded.bytes[16..]).is_err());
}
