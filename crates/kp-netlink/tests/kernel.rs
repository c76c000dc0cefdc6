//! The socket layer against the real kernel, each test in its own network namespace (made and
//! removed by `kp_test::Netns`): a generic netlink family lookup, an nf_tables request and dump,
//! a refused request's errno, a route dump, and a batch with a refused message.

#![cfg(feature = "socket")]

use kp_netlink::abi::*;
use kp_netlink::{attr, genl, message, nfnl, Protocol, Socket};
use kp_test::Netns;

// linux/netfilter/nf_tables.h
const NFT_MSG_NEWTABLE: u8 = 0;
const NFT_MSG_GETTABLE: u8 = 1;
const NFT_MSG_GETGEN: u8 = 16;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_GEN_ID: u16 = 1;
// linux/rtnetlink.h, linux/if_link.h
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFLA_IFNAME: u16 = 3;
/// `sizeof(struct ifinfomsg)`.
const IFINFOMSG_LEN: usize = 16;

fn netns(role: &str) -> Netns {
    Netns::new(role).expect("creating a network namespace")
}

#[test]
#[ignore = "needs root"]
fn the_controller_resolves_its_own_family_and_a_missing_one_is_enoent() {
    let ns = netns("nl-genl");
    let mut s = Socket::open(Protocol::Generic, Some(ns.name())).expect("socket");
    let mut families = Vec::new();
    s.request(
        |buf, seq| genl::get_family_request(buf, seq, "nlctrl"),
        |m| {
            families.push(genl::parse_family(m)?);
            Ok(())
        },
    )
    .expect("get family nlctrl");
    assert_eq!(families.len(), 1);
    assert_eq!(families[0].id, GENL_ID_CTRL);
    assert_eq!(families[0].name, "nlctrl");
    assert!(families[0].mcast_groups.iter().any(|(n, _)| n == "notify"));

    let err = s
        .request(
            |buf, seq| genl::get_family_request(buf, seq, "no-such-family"),
            |_| Ok(()),
        )
        .expect_err("a missing family");
    assert!(err.is_not_found(), "{err}");
}

fn get_gen(buf: &mut Vec<u8>, seq: u32) {
    let m = nfnl::begin(
        buf,
        NFNL_SUBSYS_NFTABLES,
        NFT_MSG_GETGEN,
        NLM_F_ACK,
        seq,
        NFPROTO_UNSPEC,
    );
    message::end(buf, m);
}

#[test]
#[ignore = "needs root"]
fn nf_tables_answers_a_request_a_dump_and_refuses_a_missing_table_with_enoent() {
    let ns = netns("nl-nft");
    let mut s = Socket::open(Protocol::Netfilter, Some(ns.name())).expect("socket");
    let mut gen = None;
    s.request(get_gen, |m| {
        let (_, body) = nfnl::NfGenMsg::parse(m.payload)?;
        let a: [Option<&[u8]>; 2] = attr::table(body)?;
        gen = Some(attr::be32(a[usize::from(NFTA_GEN_ID)], "generation")?);
        Ok(())
    })
    .expect("get generation");
    assert!(gen.is_some());

    // A fresh namespace has no tables: the dump is just NLMSG_DONE.
    let tables: Vec<String> = s
        .dump(
            |buf, seq| {
                let m = nfnl::begin(
                    buf,
                    NFNL_SUBSYS_NFTABLES,
                    NFT_MSG_GETTABLE,
                    NLM_F_DUMP,
                    seq,
                    NFPROTO_UNSPEC,
                );
                message::end(buf, m);
            },
            |tables: &mut Vec<String>, m| {
                let (_, body) = nfnl::NfGenMsg::parse(m.payload)?;
                let a: [Option<&[u8]>; 2] = attr::table(body)?;
                tables.push(attr::str(a[usize::from(NFTA_TABLE_NAME)], "name")?.to_string());
                Ok(())
            },
        )
        .expect("dump tables");
    assert!(tables.is_empty(), "{tables:?}");

    let err = s
        .request(
            |buf, seq| {
                let m = nfnl::begin(
                    buf,
                    NFNL_SUBSYS_NFTABLES,
                    NFT_MSG_GETTABLE,
                    NLM_F_ACK,
                    seq,
                    NFPROTO_IPV4,
                );
                attr::put_str(buf, NFTA_TABLE_NAME, "kube-proxy");
                message::end(buf, m);
            },
            |_| Ok(()),
        )
        .expect_err("no such table");
    assert!(err.is_not_found(), "{err}");
    assert_eq!(err.to_string(), "netlink error -ENOENT");
}

#[test]
#[ignore = "needs root"]
fn a_batch_is_committed_and_a_refused_message_names_its_sequence() {
    let ns = netns("nl-batch");
    let mut s = Socket::open(Protocol::Netfilter, Some(ns.name())).expect("socket");
    let batch = |create: u16| {
        let mut buf = Vec::new();
        nfnl::batch_control(&mut buf, NFNL_MSG_BATCH_BEGIN, 0, NFNL_SUBSYS_NFTABLES);
        let m = nfnl::begin(
            &mut buf,
            NFNL_SUBSYS_NFTABLES,
            NFT_MSG_NEWTABLE,
            NLM_F_ACK | NLM_F_CREATE | create,
            1,
            NFPROTO_IPV4,
        );
        attr::put_str(&mut buf, NFTA_TABLE_NAME, "kp-netlink-test");
        message::end(&mut buf, m);
        nfnl::batch_control(&mut buf, NFNL_MSG_BATCH_END, 2, NFNL_SUBSYS_NFTABLES);
        buf
    };
    s.send_batch(&batch(0), 1).expect("create the table");
    assert!(ns
        .run(&["nft", "list", "tables"])
        .expect("nft")
        .contains("kp-netlink-test"));
    // The same table again, exclusively: refused, and nothing applied.
    let err = s.send_batch(&batch(NLM_F_EXCL), 1).expect_err("EEXIST");
    match err {
        kp_netlink::socket::Error::Kernel { seq, error } => {
            assert_eq!(seq, 1);
            assert!(error.is_exists(), "{error}");
        }
        other => panic!("{other}"),
    }
}

#[test]
#[ignore = "needs root"]
fn a_route_dump_lists_the_namespace_s_loopback() {
    let ns = netns("nl-route");
    let mut s = Socket::open(Protocol::Route, Some(ns.name())).expect("socket");
    let links: Vec<String> = s
        .dump(
            |buf, seq| {
                let m = message::begin(buf, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq);
                buf.extend_from_slice(&[0; IFINFOMSG_LEN]);
                message::end(buf, m);
            },
            |links: &mut Vec<String>, m| {
                assert_eq!(m.kind(), RTM_NEWLINK);
                let a: [Option<&[u8]>; 4] = attr::table(&m.payload[IFINFOMSG_LEN..])?;
                links.push(attr::str(a[usize::from(IFLA_IFNAME)], "name")?.to_string());
                Ok(())
            },
        )
        .expect("dump links");
    assert_eq!(links, ["lo"]);
}

#[test]
#[ignore = "needs root"]
fn a_bad_namespace_name_is_refused_before_anything_is_opened() {
    let err = Socket::open(Protocol::Netfilter, Some("../x")).expect_err("bad name");
    assert!(err.to_string().contains("not a namespace name"), "{err}");
}

// linux/rtnetlink.h, linux/if_addr.h
const RTM_NEWADDR: u16 = 20;
const IFA_LOCAL: u16 = 2;
const ENODEV: i32 = 19;

/// `ip addr add 10.250.X.Y/32 dev` the interface of index `ifindex`, with `NLM_F_ACK`.
fn add_address(buf: &mut Vec<u8>, seq: u32, ifindex: u32, i: usize) {
    let m = message::begin(
        buf,
        RTM_NEWADDR,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        seq,
    );
    // struct ifaddrmsg: AF_INET, /32, no flags, host scope, the interface.
    buf.extend_from_slice(&[2, 32, 0, 254]);
    buf.extend_from_slice(&ifindex.to_ne_bytes());
    attr::put(
        buf,
        IFA_LOCAL,
        &[10, 250, (i / 250) as u8, (i % 250 + 1) as u8],
    );
    message::end(buf, m);
}

#[test]
#[ignore = "needs root"]
fn a_pipeline_runs_every_datagram_until_a_refusal_and_names_its_request() {
    let ns = netns("nl-pipeline");
    let mut s = Socket::open(Protocol::Route, Some(ns.name())).expect("socket");
    let count = 300;
    // Request 150 names an interface that does not exist (ENODEV); request 10 adds an address
    // request 9 added (EEXIST), which the caller accepts.
    let refused = s
        .pipeline(
            count,
            128,
            |i, buf, seq| match i {
                150 => add_address(buf, seq, 9999, i),
                10 => add_address(buf, seq, 1, 9),
                _ => add_address(buf, seq, 1, i),
            },
            |i, e| i == 10 && e.is_exists(),
        )
        .expect("the exchange");
    let (index, error) = refused.expect("a refusal");
    assert_eq!((index, error.errno), (150, ENODEV));
    let shown = ns
        .ip(&["-4", "addr", "show", "dev", "lo"])
        .expect("ip addr");
    let has = |i: usize| shown.contains(&format!("10.250.{}.{}/32", i / 250, i % 250 + 1));
    // The first datagram (0-127) and the rest of the refused one (128-255) ran; the third was
    // not sent.
    assert!(
        (0..256).filter(|i| ![10, 150].contains(i)).all(has),
        "{shown}"
    );
    assert!(!has(150) && !has(10));
    assert!(!(256..count).any(has), "{shown}");
    // Nothing refused: every request runs, none returned.
    let again = s
        .pipeline(
            count,
            128,
            |i, buf, seq| add_address(buf, seq, 1, i),
            |_, e| e.is_exists(),
        )
        .expect("the exchange");
    assert!(again.is_none());
    let shown = ns
        .ip(&["-4", "addr", "show", "dev", "lo"])
        .expect("ip addr");
    assert!((0..count).all(|i| shown.contains(&format!("10.250.{}.{}/32", i / 250, i % 250 + 1))));
}
