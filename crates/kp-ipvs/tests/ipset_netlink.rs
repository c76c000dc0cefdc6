//! ipset elements over netlink against this machine's kernel (no IPVS needed), in a namespace
//! of the test's own: every set of both families created by `ipset restore`, then every entry
//! shape added and deleted through [`Ipset::apply`], each time read back with `ipset save`;
//! an add of a present element and a delete of an absent one succeed; a refusal names its set.

use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};

use kp_core::model::{IpFamily, Protocol};
use kp_ipvs::ipset::Ipset;
use kp_ipvs_plan::ipset::{restore_text, Entry, SetChange, SetName, Sets};
use kp_test::netns::Netns;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn restore(ns: &Netns, text: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns.name(), "ipset", "restore"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ipset restore");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "ipset restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn saved(ns: &Netns, family: IpFamily) -> Sets {
    Sets::parse_save(family, &ns.run(&["ipset", "save"]).expect("ipset save"))
}

/// Every entry shape of every set type, for `family`.
fn entries(family: IpFamily) -> Vec<(SetName, Entry)> {
    let (a, b, node, net, host) = match family {
        IpFamily::V4 => (
            ip("10.96.0.10"),
            ip("10.0.1.5"),
            ip("192.0.2.1"),
            "198.51.100.0/24",
            "198.51.100.77/32",
        ),
        IpFamily::V6 => (
            ip("fd00:10:96::10"),
            ip("fd00:10:1::5"),
            ip("2001:db8::1"),
            "2001:db8:100::/56",
            "2001:db8:100::77/128",
        ),
    };
    vec![
        (SetName::ClusterIp, Entry::IpPort(a, Protocol::Tcp, 80)),
        (SetName::ClusterIp, Entry::IpPort(a, Protocol::Udp, 53)),
        (SetName::IpvsIps, Entry::Ip(a)),
        (
            SetName::LoopBack,
            Entry::IpPortIp(b, Protocol::Tcp, 8080, b),
        ),
        (
            SetName::LoadBalancerSourceIp,
            Entry::IpPortIp(a, Protocol::Sctp, 443, a),
        ),
        (
            SetName::LoadBalancerSourceCidr,
            Entry::IpPortNet(a, Protocol::Tcp, 443, net.parse().expect("net")),
        ),
        (
            SetName::LoadBalancerSourceCidr,
            Entry::IpPortNet(a, Protocol::Udp, 443, host.parse().expect("net")),
        ),
        (SetName::NodePortTcp, Entry::Port(30080)),
        (SetName::NodePortLocalUdp, Entry::Port(0)),
        (SetName::HealthCheckNodePort, Entry::Port(65535)),
        (
            SetName::NodePortSctp,
            Entry::IpPort(node, Protocol::Sctp, 30090),
        ),
    ]
}

#[test]
#[ignore = "needs root"]
fn every_entry_shape_is_added_and_deleted_over_netlink_in_both_families() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipset-nl").expect("namespace");
    for family in [IpFamily::V4, IpFamily::V6] {
        restore(&ns, &restore_text(family, &[]));
        assert_eq!(saved(&ns, family), Sets::new(family), "created empty");
    }
    let mut ipset = Ipset::open(Some(ns.name())).expect("ipset socket");

    for family in [IpFamily::V4, IpFamily::V6] {
        let entries = entries(family);
        let adds: Vec<_> = entries
            .iter()
            .map(|(s, e)| SetChange::Add(*s, *e))
            .collect();
        ipset.apply(family, &adds).expect("adds");
        let mut want = Sets::new(family);
        for (s, e) in &entries {
            want.insert(*s, *e);
        }
        assert_eq!(saved(&ns, family), want, "{family:?} after the adds");

        // Added again, and one absent deleted: the state asked for, no error.
        let absent = match family {
            IpFamily::V4 => Entry::Ip(ip("10.96.0.99")),
            IpFamily::V6 => Entry::Ip(ip("fd00:10:96::99")),
        };
        let mut again = adds.clone();
        again.push(SetChange::Del(SetName::IpvsIps, absent));
        ipset.apply(family, &again).expect("idempotent");
        assert_eq!(saved(&ns, family), want, "{family:?} unchanged");

        // Half deleted.
        let (gone, kept) = entries.split_at(entries.len() / 2);
        let dels: Vec<_> = gone.iter().map(|(s, e)| SetChange::Del(*s, *e)).collect();
        ipset.apply(family, &dels).expect("deletes");
        let mut want = Sets::new(family);
        for (s, e) in kept {
            want.insert(*s, *e);
        }
        assert_eq!(saved(&ns, family), want, "{family:?} after the deletes");
    }
    // Each family's changes left the other's sets alone: both hold their kept halves.
    for family in [IpFamily::V4, IpFamily::V6] {
        let entries = entries(family);
        let mut want = Sets::new(family);
        for (s, e) in &entries[entries.len() / 2..] {
            want.insert(*s, *e);
        }
        assert_eq!(saved(&ns, family), want, "{family:?} at the end");
    }
}

#[test]
#[ignore = "needs root"]
fn more_changes_than_a_datagram_holds_and_a_refusal_naming_its_set() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipset-nl-many").expect("namespace");
    restore(&ns, &restore_text(IpFamily::V4, &[]));
    let mut ipset = Ipset::open(Some(ns.name())).expect("ipset socket");

    // 300 elements: three datagrams.
    let many: Vec<_> = (0..300u16)
        .map(|i| {
            let [hi, lo] = i.to_be_bytes();
            SetChange::Add(SetName::IpvsIps, Entry::Ip(IpAddr::from([10, 97, hi, lo])))
        })
        .collect();
    ipset.apply(IpFamily::V4, &many).expect("300 adds");
    assert_eq!(saved(&ns, IpFamily::V4).get(SetName::IpvsIps).len(), 300);

    // A set that does not exist (destroyed behind the client's back), between two changes
    // that are fine: the refusal names the set and the entry; the rest of its datagram is
    // still applied.
    ns.run(&["ipset", "destroy", "KUBE-HEALTH-CHECK-NODE-PORT"])
        .expect("destroy");
    let before = Entry::Port(30001);
    let after = Entry::Port(30002);
    let err = ipset
        .apply(
            IpFamily::V4,
            &[
                SetChange::Add(SetName::NodePortTcp, before),
                SetChange::Add(SetName::HealthCheckNodePort, Entry::Port(31000)),
                SetChange::Add(SetName::NodePortTcp, after),
            ],
        )
        .expect_err("no such set");
    let text = err.to_string();
    assert!(
        text.contains("ipset add KUBE-HEALTH-CHECK-NODE-PORT 31000"),
        "{text}"
    );
    assert!(err.is_not_found(), "{err:?}");
    let sets = saved(&ns, IpFamily::V4);
    assert!(sets.get(SetName::NodePortTcp).contains(&before));
    assert!(sets.get(SetName::NodePortTcp).contains(&after));

    // An entry the set's type cannot hold: ipset's own errno, by name.
    let err = ipset
        .apply(
            IpFamily::V4,
            &[SetChange::Add(SetName::IpvsIps, Entry::Ip(ip("fd00::1")))],
        )
        .expect_err("an IPv6 address in an IPv4 set");
    assert!(
        err.to_string()
            .contains("ipset add KUBE-IPVS-IPS fd00::1 (IPSET_ERR_"),
        "{err}"
    );
}
