//! `kube-ipvs0` over rtnetlink in the kp-vm guest (this machine's kernel has no dummy links),
//! in a namespace of the test's own: found only once made, addresses bound and unbound, IPv6
//! ones deprecated (never a source address), the node's own addresses without it, deleted.

use std::net::IpAddr;

use kp_ipvs::link::Dummy;

mod common;
use common::in_guest;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

#[test]
#[ignore = "needs root"]
fn kube_ipvs0_holds_service_addresses_ipv6_ones_deprecated_and_goes_away() {
    if !kp_test::netns::require_root()
        || !in_guest("kube_ipvs0_holds_service_addresses_ipv6_ones_deprecated_and_goes_away")
    {
        return;
    }
    let ns = kp_test::netns::Netns::new("ipvs-link").expect("namespace");
    ns.ip(&["link", "set", "lo", "up"]).expect("lo up");
    ns.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
    ])
    .expect("a node interface");
    ns.ip(&["addr", "add", "192.0.2.1/24", "dev", "eth0"])
        .expect("node address");
    ns.ip(&[
        "-6",
        "addr",
        "add",
        "2001:db8::1/64",
        "dev",
        "eth0",
        "nodad",
    ])
    .expect("node address");
    ns.ip(&["link", "set", "eth0", "up"]).expect("up");
    let name = Some(ns.name());

    assert!(Dummy::find(name, "kube-ipvs0").expect("lookup").is_none());
    let mut d = Dummy::ensure(name, "kube-ipvs0").expect("created");
    // Made again: kept.
    let again = Dummy::ensure(name, "kube-ipvs0").expect("kept");
    assert_eq!(again.index(), d.index());
    for a in ["10.96.0.10", "fd00:10:96::10"] {
        d.bind(ip(a)).expect("bind");
        // Bound again: the state asked for.
        d.bind(ip(a)).expect("bind again");
    }
    let bound = d.addresses().expect("addresses");
    assert_eq!(
        bound.into_iter().collect::<Vec<_>>(),
        [ip("10.96.0.10"), ip("fd00:10:96::10")]
    );
    let shown = ns
        .ip(&["-6", "addr", "show", "dev", "kube-ipvs0"])
        .expect("ip addr");
    let line = shown
        .lines()
        .find(|l| l.contains("fd00:10:96::10/128"))
        .unwrap_or_else(|| panic!("{shown}"));
    assert!(line.contains("deprecated"), "{shown}");
    // The node's addresses: eth0's, not the Service addresses, loopback or link-local ones.
    let node = d.node_addresses().expect("node addresses");
    assert_eq!(
        node.into_iter().collect::<Vec<_>>(),
        [ip("192.0.2.1"), ip("2001:db8::1")]
    );
    d.unbind(ip("10.96.0.10")).expect("unbind");
    d.unbind(ip("10.96.0.10")).expect("unbind again");
    assert_eq!(
        d.addresses()
            .expect("addresses")
            .into_iter()
            .collect::<Vec<_>>(),
        [ip("fd00:10:96::10")]
    );
    // Many at once, pipelined over more than one datagram, some already bound: all bound;
    // then all unbound, some already gone.
    let many: Vec<IpAddr> = (0..300u32)
        .map(|i| ip(&format!("10.97.{}.{}", i / 200, i % 200 + 1)))
        .collect();
    d.bind(many[5]).expect("bind one first");
    d.bind_all(&many).expect("bind all");
    let bound = d.addresses().expect("addresses");
    assert_eq!(bound.len(), 301, "the 300 and fd00:10:96::10");
    assert!(many.iter().all(|a| bound.contains(a)));
    d.unbind(many[299]).expect("unbind one first");
    d.unbind_all(&many).expect("unbind all");
    assert_eq!(
        d.addresses()
            .expect("addresses")
            .into_iter()
            .collect::<Vec<_>>(),
        [ip("fd00:10:96::10")]
    );
    let found = Dummy::find(name, "kube-ipvs0")
        .expect("lookup")
        .expect("there");
    assert_eq!(found.index(), d.index());
    found.delete().expect("deleted");
    assert!(Dummy::find(name, "kube-ipvs0").expect("lookup").is_none());
}
