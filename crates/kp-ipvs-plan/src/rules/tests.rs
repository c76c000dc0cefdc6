use super::*;

use std::net::IpAddr;

use kp_core::model::Protocol;

use crate::ipset::Entry;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn rules_of(text: &str, table: &str) -> Vec<String> {
    let mut in_table = false;
    let mut out = Vec::new();
    for l in text.lines() {
        if let Some(t) = l.strip_prefix('*') {
            in_table = t == table;
        } else if in_table && l.starts_with("-A ") {
            out.push(l.to_string());
        }
    }
    out
}

fn with_cluster_ip() -> Sets {
    let mut sets = Sets::new(IpFamily::V4);
    sets.insert(
        SetName::ClusterIp,
        Entry::IpPort(ip("10.96.0.1"), Protocol::Tcp, 80),
    );
    sets.insert(SetName::IpvsIps, Entry::Ip(ip("10.96.0.1")));
    sets
}

#[test]
fn every_chain_is_declared_and_each_table_committed() {
    let text = render(
        &Sets::new(IpFamily::V4),
        &PlanConfig::new(IpFamily::V4),
        &NodeContext::default(),
    );
    for c in [
        ":KUBE-SERVICES - [0:0]",
        ":KUBE-POSTROUTING - [0:0]",
        ":KUBE-NODE-PORT - [0:0]",
        ":KUBE-LOAD-BALANCER - [0:0]",
        ":KUBE-MARK-MASQ - [0:0]",
        ":KUBE-FORWARD - [0:0]",
        ":KUBE-PROXY-FIREWALL - [0:0]",
        ":KUBE-SOURCE-RANGES-FIREWALL - [0:0]",
        ":KUBE-IPVS-FILTER - [0:0]",
        ":KUBE-IPVS-OUT-FILTER - [0:0]",
    ] {
        assert!(text.contains(c), "{c} missing from\n{text}");
    }
    assert_eq!(text.matches("COMMIT\n").count(), 2);
    assert!(text.starts_with("*nat\n"));
}

#[test]
fn an_empty_set_gets_no_rule_and_a_filled_one_does() {
    let empty = render(
        &Sets::new(IpFamily::V4),
        &PlanConfig::new(IpFamily::V4),
        &NodeContext::default(),
    );
    assert!(!empty.contains("--match-set KUBE-NODE-PORT-TCP"));
    assert!(!empty.contains("--match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT"));
    let mut sets = with_cluster_ip();
    sets.insert(SetName::NodePortTcp, Entry::Port(30080));
    let text = render(
        &sets,
        &PlanConfig::new(IpFamily::V4),
        &NodeContext::default(),
    );
    assert!(rules_of(&text, "nat").contains(&"-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port for masquerade purpose\" -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ".to_string()));
    assert_eq!(
        rules_of(&text, "nat").last().map(String::as_str),
        Some("-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000")
    );
    assert!(rules_of(&text, "nat").contains(
        &"-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT".to_string()
    ));
}

#[test]
fn cluster_ip_masquerade_follows_masquerade_all_then_detect_local_then_the_node_source() {
    let sets = with_cluster_ip();
    let head = "-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP";
    let mut all = PlanConfig::new(IpFamily::V4);
    all.masquerade_all = true;
    let detect = NodeContext {
        local_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..NodeContext::default()
    };
    let cases = [
        (&all, &detect, format!("{head} dst,dst -j KUBE-MARK-MASQ")),
        (
            &PlanConfig::new(IpFamily::V4),
            &detect,
            format!("{head} dst,dst ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"),
        ),
        (
            &PlanConfig::new(IpFamily::V4),
            &NodeContext::default(),
            format!("{head} src,dst -j KUBE-MARK-MASQ"),
        ),
    ];
    for (config, node, want) in cases {
        let nat = rules_of(&render(&sets, config, node), "nat");
        let got: Vec<_> = nat.iter().filter(|r| r.starts_with(head)).collect();
        assert_eq!(got, [&want]);
    }
}

/// Detect-local by interface: what did not arrive on the pods' interface(s) is masqueraded
/// (`! -i cbr0`, `! -i veth+`), whatever the pod CIDRs, and `masqueradeAll` still wins.
#[test]
fn cluster_ip_masquerade_by_interface_matches_what_did_not_arrive_on_the_pods_interfaces() {
    use kp_core::node::{InterfaceName, LocalInterface};
    let sets = with_cluster_ip();
    let head = "-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP";
    for (local, not_from_pods) in [
        (
            LocalInterface::Bridge(InterfaceName::new("cbr0").unwrap()),
            "! -i cbr0",
        ),
        (
            LocalInterface::Prefix(InterfaceName::new("veth").unwrap()),
            "! -i veth+",
        ),
    ] {
        let node = NodeContext {
            local_interface: Some(local),
            ..NodeContext::default()
        };
        let nat = rules_of(&render(&sets, &PlanConfig::new(IpFamily::V4), &node), "nat");
        let got: Vec<_> = nat.iter().filter(|r| r.starts_with(head)).collect();
        assert_eq!(
            got,
            [&format!("{head} dst,dst {not_from_pods} -j KUBE-MARK-MASQ")]
        );
        let mut all = PlanConfig::new(IpFamily::V4);
        all.masquerade_all = true;
        let nat = rules_of(&render(&sets, &all, &node), "nat");
        let got: Vec<_> = nat.iter().filter(|r| r.starts_with(head)).collect();
        assert_eq!(got, [&format!("{head} dst,dst -j KUBE-MARK-MASQ")]);
    }
}

#[test]
fn postrouting_masquerades_marked_packets_and_hairpin_loopback_before_the_mark_check() {
    let mut sets = with_cluster_ip();
    sets.insert(
        SetName::LoopBack,
        Entry::IpPortIp(ip("10.244.1.5"), Protocol::Tcp, 8080, ip("10.244.1.5")),
    );
    let mut config = PlanConfig::new(IpFamily::V4);
    config.masquerade_bit = 3;
    let nat = rules_of(&render(&sets, &config, &NodeContext::default()), "nat");
    let post: Vec<_> = nat
        .iter()
        .filter(|r| r.starts_with("-A KUBE-POSTROUTING"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        post,
        [
            "-A KUBE-POSTROUTING -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE",
            "-A KUBE-POSTROUTING -m mark ! --mark 0x8/0x8 -j RETURN",
            "-A KUBE-POSTROUTING -j MARK --xor-mark 0x8",
            "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE",
        ]
    );
}

#[test]
fn source_ranges_are_checked_in_filter_and_unknown_ports_on_service_addresses_rejected() {
    let mut sets = with_cluster_ip();
    let lb = Entry::IpPort(ip("198.51.100.10"), Protocol::Tcp, 80);
    sets.insert(SetName::LoadBalancer, lb);
    sets.insert(SetName::LoadBalancerFw, lb);
    sets.insert(
        SetName::LoadBalancerSourceCidr,
        Entry::IpPortNet(
            ip("198.51.100.10"),
            Protocol::Tcp,
            80,
            "192.0.2.0/24".parse().unwrap(),
        ),
    );
    let filter = rules_of(
        &render(
            &sets,
            &PlanConfig::new(IpFamily::V4),
            &NodeContext::default(),
        ),
        "filter",
    );
    let fw: Vec<_> = filter
        .iter()
        .filter(|r| r.contains("FIREWALL"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        fw,
        [
            "-A KUBE-PROXY-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" -m set --match-set KUBE-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL",
            "-A KUBE-SOURCE-RANGES-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port + source cidr for packet filter purpose\" -m set --match-set KUBE-LOAD-BALANCER-SOURCE-CIDR dst,dst,src -j RETURN",
            "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP",
        ]
    );
    assert_eq!(
        filter.iter().rfind(|r| r.starts_with("-A KUBE-IPVS-FILTER")).map(String::as_str),
        Some("-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT")
    );
}

#[test]
fn an_ipv6_render_names_the_v6_sets_and_loopback() {
    let text = render(
        &Sets::new(IpFamily::V6),
        &PlanConfig::new(IpFamily::V6),
        &NodeContext::default(),
    );
    assert!(text.contains("-A KUBE-SERVICES -s ::1/128 -j RETURN\n"));
    assert!(text.contains("--match-set KUBE-6-IPVS-IPS dst -j REJECT"));
    assert!(!text.contains("--match-set KUBE-IPVS-IPS"));
}

#[test]
fn jump_rules_reach_every_entry_chain() {
    let jumps = jump_rules();
    for (t, c, target) in [
        ("nat", "PREROUTING", "KUBE-SERVICES"),
        ("nat", "OUTPUT", "KUBE-SERVICES"),
        ("nat", "POSTROUTING", "KUBE-POSTROUTING"),
        ("filter", "INPUT", "KUBE-IPVS-FILTER"),
        ("filter", "FORWARD", "KUBE-FORWARD"),
    ] {
        assert!(
            jumps
                .iter()
                .any(|j| j.table == t && j.chain == c && j.args.ends_with(&format!("-j {target}"))),
            "{t} {c} -> {target}"
        );
    }
}

#[test]
fn traffic_to_unallocated_service_addresses_is_dropped_when_forwarded_or_sent_by_the_node() {
    let node = NodeContext {
        service_cidrs: vec![
            "10.96.0.0/16".parse().unwrap(),
            "fd00:10:96::/112".parse().unwrap(),
        ],
        ..NodeContext::default()
    };
    let filter = rules_of(
        &render(&with_cluster_ip(), &PlanConfig::new(IpFamily::V4), &node),
        "filter",
    );
    let drops: Vec<_> = filter
        .iter()
        .filter(|r| r.contains("unallocated"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        drops,
        [
            "-A KUBE-FORWARD -d 10.96.0.0/16 -m set ! --match-set KUBE-IPVS-IPS dst -m comment --comment \"drop traffic to unallocated ClusterIPs\" -j DROP",
            "-A KUBE-IPVS-OUT-FILTER -d 10.96.0.0/16 -m set ! --match-set KUBE-IPVS-IPS dst -m comment --comment \"drop traffic to unallocated ClusterIPs\" -j DROP",
        ]
    );
    let none = render(
        &with_cluster_ip(),
        &PlanConfig::new(IpFamily::V4),
        &NodeContext::default(),
    );
    assert!(!none.contains("unallocated"));
}
