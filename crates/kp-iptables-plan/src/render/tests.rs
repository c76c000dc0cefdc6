//! Rule shapes, one Service port at a time. The expected strings are `iptables-save` output
//! (checked against the kernel by `tests/kernel.rs`); names and addresses follow upstream's
//! `proxier_test.go` (ClusterIPs in 172.30.0.0/16, endpoints in 10.180.0.0/16, pods in
//! 10.0.0.0/8, node 192.168.0.2, clients in 203.0.113.0/24).

use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort};
use kp_core::node::NodeContext;

use super::chain::Table;
use super::context::{NodePortDestinations, PlanConfig, RenderContext};
use super::fixed::{
    cluster_ip_rejects, covering_net, forward, jump_rules, kubelet_firewall, mark_masq,
    nodeports_jump, postrouting, with_early_return, Check,
};
use super::port::{render_port, Dispatch, PortRules};
use super::rule::{host, probability, save_string, Rule};
use crate::names;
use kp_core::model::{NodeInfo, ServiceKey, ServicePortName};
use kp_core::select::select;

const POD_CIDR: &str = "10.0.0.0/8";
const NODE_IP: &str = "192.168.0.2";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn cidr(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn port(ns: &str, name: &str, cluster_ip: &str) -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: ServiceKey::new(ns, name),
            port: "p80".into(),
            protocol: Protocol::Tcp,
        },
        cluster_ips: vec![ip(cluster_ip)],
        port: 80,
        node_port: None,
        external_ips: vec![],
        load_balancer_ips: vec![],
        load_balancer_source_ranges: vec![],
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: false,
        health_check_node_port: None,
    }
}

fn ep(addr: &str, local: bool) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 80,
        ready: true,
        serving: true,
        terminating: false,
        is_local: local,
        zone_hints: None,
    }
}

/// The context of upstream's tests: detect-local by 10.0.0.0/8, NodePorts on every address.
fn ctx(family: IpFamily) -> RenderContext {
    ctx_with(PlanConfig::new(family), NodeContext::default(), false)
}

fn ctx_with(cfg: PlanConfig, mut node: NodeContext, large: bool) -> RenderContext {
    if node.local_cidrs.is_empty() {
        node.local_cidrs = vec![cidr(POD_CIDR), cidr("fd00:10::/64")];
    }
    if node.node_ips.is_empty() {
        node.node_ips = vec![ip(NODE_IP)];
    }
    RenderContext::new(&cfg, &node, large)
}

fn render(ctx: &RenderContext, port: &ServicePort, eps: &[Endpoint]) -> PortRules {
    let selected = select(port, eps, &NodeInfo::default());
    render_port(ctx, port, &selected).expect("port has a ClusterIP of this family")
}

fn chain<'a>(rules: &'a PortRules, name: &str) -> &'a [String] {
    &rules
        .chains
        .iter()
        .find(|c| c.chain == name)
        .unwrap_or_else(|| panic!("no chain {name} in {:#?}", rules.chains))
        .rules
}

fn chain_names(rules: &PortRules) -> Vec<&str> {
    rules.chains.iter().map(|c| c.chain.as_str()).collect()
}

fn dispatch(rules: &PortRules, d: Dispatch) -> &[String] {
    &rules.dispatch[d as usize]
}

#[test]
fn rules_are_built_in_save_order_whatever_order_they_are_given_in() {
    let rule = Rule::new()
        .comment("ns/svc:p cluster IP")
        .dport(Protocol::Udp, 53)
        .dst("10.96.0.10/32".parse().unwrap())
        .not_src("10.0.0.0/8".parse().unwrap())
        .jump("KUBE-MARK-MASQ")
        .build();
    assert_eq!(
        rule,
        "! -s 10.0.0.0/8 -d 10.96.0.10/32 -p udp -m comment --comment \"ns/svc:p cluster IP\" -m udp --dport 53 -j KUBE-MARK-MASQ"
    );
    // A rule without a target (the last rule of KUBE-FW chains).
    assert_eq!(Rule::new().comment("x").build(), "-m comment --comment x");
}

#[test]
fn comments_are_quoted_like_xtables_save_string() {
    assert_eq!(save_string("abc-DEF_09"), "abc-DEF_09");
    assert_eq!(save_string("ns/svc:p80"), "\"ns/svc:p80\"");
    assert_eq!(save_string("has space"), "\"has space\"");
    assert_eq!(save_string("q\"b\\s'"), "\"q\\\"b\\\\s\\'\"");
    assert_eq!(save_string(""), "\"\"");
}

#[test]
fn probabilities_are_what_the_kernel_prints_back_after_upstreams_ten_decimals() {
    // Read back from iptables-save after restoring upstream's 0.5000000000, 0.3333333333 and
    // 0.1428571429 (see the crate README).
    assert_eq!(probability(2), "0.50000000000");
    assert_eq!(probability(3), "0.33333333349");
    assert_eq!(probability(7), "0.14285714272");
    assert_eq!(probability(4), "0.25000000000");
    // Each value is a 31-bit fraction that round-trips through the kernel's lround().
    for n in 2..=3000 {
        let p: f64 = probability(n).parse().unwrap();
        let stored = (p * 2_147_483_648.0).round();
        let upstream: f64 = format!("{:.10}", 1.0 / n as f64).parse().unwrap();
        assert_eq!(stored, (upstream * 2_147_483_648.0).round(), "n = {n}");
        assert!((p - 1.0 / n as f64).abs() < 1e-9, "n = {n}");
    }
}

#[test]
fn cluster_ip_with_endpoints_jumps_to_the_svc_chain_and_sep_chains_dnat() {
    let ctx = ctx(IpFamily::V4);
    let p = port("ns1", "svc1", "172.30.0.41");
    let rules = render(&ctx, &p, &[ep("10.180.0.1", true)]);
    assert_eq!(
        dispatch(&rules, Dispatch::NatServices),
        ["-d 172.30.0.41/32 -p tcp -m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O"]
    );
    assert!(dispatch(&rules, Dispatch::FilterServices).is_empty());
    assert_eq!(
        chain_names(&rules),
        ["KUBE-SEP-SXIVWICOYRO3J4NJ", "KUBE-SVC-XPGD46QRK7WJZT7O"]
    );
    assert_eq!(
        chain(&rules, "KUBE-SVC-XPGD46QRK7WJZT7O"),
        [
            "! -s 10.0.0.0/8 -d 172.30.0.41/32 -p tcp -m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ",
            "-m comment --comment \"ns1/svc1:p80 -> 10.180.0.1:80\" -j KUBE-SEP-SXIVWICOYRO3J4NJ",
        ]
    );
    assert_eq!(
        chain(&rules, "KUBE-SEP-SXIVWICOYRO3J4NJ"),
        [
            "-s 10.180.0.1/32 -m comment --comment \"ns1/svc1:p80\" -j KUBE-MARK-MASQ",
            "-p tcp -m comment --comment \"ns1/svc1:p80\" -j DNAT --to-destination 10.180.0.1:80",
        ]
    );
    assert!(!rules.no_local_internal && !rules.no_local_external);
}

#[test]
fn endpoints_are_picked_with_falling_probabilities_and_the_last_unconditionally() {
    let ctx = ctx(IpFamily::V4);
    let p = port("ns", "svc", "172.30.0.42");
    let eps: Vec<Endpoint> = (1..=4)
        .map(|i| ep(&format!("10.180.0.{i}"), false))
        .collect();
    let rules = render(&ctx, &p, &eps);
    let svc = &names::service_chains(&p.name).svc;
    let picks: Vec<&String> = chain(&rules, svc).iter().skip(1).collect();
    assert_eq!(picks.len(), 4);
    for (i, (rule, prob)) in picks
        .iter()
        .zip(["0.25000000000", "0.33333333349", "0.50000000000"])
        .enumerate()
    {
        assert_eq!(
            **rule,
            format!(
                "-p tcp -m comment --comment \"ns/svc:p80 -> 10.180.0.{n}:80\" -m statistic --mode random --probability {prob} -j DNAT --to-destination 10.180.0.{n}:80",
                n = i + 1
            )
        );
    }
    assert_eq!(
        *picks[3],
        "-p tcp -m comment --comment \"ns/svc:p80 -> 10.180.0.4:80\" -j DNAT --to-destination 10.180.0.4:80"
    );
    // Endpoints elsewhere are DNATed by their rule: no chain of their own.
    assert_eq!(chain_names(&rules), [svc.as_str()]);
}

#[test]
fn only_endpoints_on_this_node_get_a_chain_for_their_hairpin_rule() {
    let ctx = ctx(IpFamily::V4);
    let p = port("ns", "mixed", "172.30.0.45");
    let eps = [ep("10.180.0.1", true), ep("10.180.0.2", false)];
    let rules = render(&ctx, &p, &eps);
    let svc = names::service_chains(&p.name).svc;
    let sep = names::endpoint_chain(&p.name, &eps[0]);
    assert_eq!(chain_names(&rules), [sep.as_str(), svc.as_str()]);
    assert_eq!(
        chain(&rules, &svc)[1..],
        [
            format!("-m comment --comment \"ns/mixed:p80 -> 10.180.0.1:80\" -m statistic --mode random --probability 0.50000000000 -j {sep}"),
            "-p tcp -m comment --comment \"ns/mixed:p80 -> 10.180.0.2:80\" -j DNAT --to-destination 10.180.0.2:80".to_string(),
        ]
    );
    assert_eq!(
        chain(&rules, &sep)[0],
        "-s 10.180.0.1/32 -m comment --comment \"ns/mixed:p80\" -j KUBE-MARK-MASQ"
    );
}

#[test]
fn client_ip_affinity_checks_recent_lists_before_the_random_pick() {
    let ctx = ctx(IpFamily::V4);
    let mut p = port("ns", "sticky", "172.30.0.43");
    p.session_affinity_timeout = Some(10800);
    // One endpoint here (reached through its chain), one elsewhere (DNATed by its rule).
    let eps = [ep("10.180.0.1", true), ep("10.180.0.2", false)];
    let rules = render(&ctx, &p, &eps);
    let svc = chain(&rules, &names::service_chains(&p.name).svc);
    let (a, b) = (
        names::endpoint_chain(&p.name, &eps[0]),
        names::endpoint_chain(&p.name, &eps[1]),
    );
    assert_eq!(svc.len(), 5);
    assert_eq!(
        svc[1],
        format!("-m comment --comment \"ns/sticky:p80 -> 10.180.0.1:80\" -m recent --rcheck --seconds 10800 --reap --name {a} --mask 255.255.255.255 --rsource -j {a}")
    );
    // A returning client of the other endpoint: found and refreshed by --update, DNATed.
    assert_eq!(
        svc[2],
        format!("-p tcp -m comment --comment \"ns/sticky:p80 -> 10.180.0.2:80\" -m recent --update --seconds 10800 --reap --name {b} --mask 255.255.255.255 --rsource -j DNAT --to-destination 10.180.0.2:80")
    );
    assert!(svc[3].contains("-m statistic") && svc[3].ends_with(&format!("-j {a}")));
    // A new client of the other endpoint is put on its list by the rule that picks it.
    assert_eq!(
        svc[4],
        format!("-p tcp -m comment --comment \"ns/sticky:p80 -> 10.180.0.2:80\" -m recent --set --name {b} --mask 255.255.255.255 --rsource -j DNAT --to-destination 10.180.0.2:80")
    );
    assert_eq!(
        chain(&rules, &a)[1],
        format!("-p tcp -m comment --comment \"ns/sticky:p80\" -m recent --set --name {a} --mask 255.255.255.255 --rsource -j DNAT --to-destination 10.180.0.1:80")
    );
}

#[test]
fn masquerade_all_marks_every_clusterip_packet_and_no_detect_local_marks_none() {
    let p = port("ns", "svc", "172.30.0.44");
    let eps = [ep("10.180.0.1", false)];
    let svc = names::service_chains(&p.name).svc;
    let mut cfg = PlanConfig::new(IpFamily::V4);
    cfg.masquerade_all = true;
    let all = render(&ctx_with(cfg, NodeContext::default(), false), &p, &eps);
    assert_eq!(
        chain(&all, &svc)[0],
        "-d 172.30.0.44/32 -p tcp -m comment --comment \"ns/svc:p80 cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ"
    );
    // Detect-local off: RenderContext built directly, without the default pod CIDR.
    let off = RenderContext::new(
        &PlanConfig::new(IpFamily::V4),
        &NodeContext::default(),
        false,
    );
    let none = render(&off, &p, &eps);
    assert_eq!(chain(&none, &svc).len(), 1);
    assert!(!chain(&none, &svc)[0].contains("KUBE-MARK-MASQ"));
    // Node CIDR (or several cluster CIDRs): the first of this family, truncated.
    let node = NodeContext {
        local_cidrs: vec![
            cidr("fd00::/64"),
            cidr("10.244.1.7/24"),
            cidr("10.9.0.0/16"),
        ],
        node_port_addresses: vec![],
        ..NodeContext::default()
    };
    let nodecidr = render(
        &RenderContext::new(&PlanConfig::new(IpFamily::V4), &node, false),
        &p,
        &eps,
    );
    assert!(chain(&nodecidr, &svc)[0].starts_with("! -s 10.244.1.0/24 -d 172.30.0.44/32 "));
}

#[test]
fn external_traffic_policy_cluster_masquerades_external_destinations() {
    let ctx = ctx(IpFamily::V4);
    let mut p = port("ns4", "svc4", "172.30.0.44");
    p.external_ips = vec![ip("192.168.99.33")];
    p.node_port = Some(3001);
    let rules = render(&ctx, &p, &[ep("10.180.0.4", false)]);
    let n = names::service_chains(&p.name);
    assert_eq!(
        chain(&rules, &n.ext),
        [
            "-m comment --comment \"masquerade traffic for ns4/svc4:p80 external destinations\" -j KUBE-MARK-MASQ".to_string(),
            format!("-j {}", n.svc),
        ]
    );
    assert_eq!(
        dispatch(&rules, Dispatch::NatServices)[1],
        format!("-d 192.168.99.33/32 -p tcp -m comment --comment \"ns4/svc4:p80 external IP\" -m tcp --dport 80 -j {}", n.ext)
    );
    assert_eq!(
        dispatch(&rules, Dispatch::NatNodePorts),
        [format!(
            "-p tcp -m comment --comment \"ns4/svc4:p80\" -m tcp --dport 3001 -j {}",
            n.ext
        )]
    );
    assert!(dispatch(&rules, Dispatch::FilterExternalServices).is_empty());
    // EXT is written after the SVC chain it jumps to.
    let names = chain_names(&rules);
    let pos = |c: &str| names.iter().position(|x| *x == c).unwrap();
    assert!(pos(&n.svc) < pos(&n.ext));
}

#[test]
fn external_traffic_policy_local_keeps_the_source_and_short_circuits_pods_and_the_node() {
    let ctx = ctx(IpFamily::V4);
    let mut p = port("ns2", "svc2", "172.30.0.42");
    p.node_port = Some(3001);
    p.load_balancer_ips = vec![ip("1.2.3.4")];
    p.external_traffic_local = true;
    p.health_check_node_port = Some(30000);
    let eps = [ep("10.180.0.2", true), ep("10.180.2.1", false)];
    let rules = render(&ctx, &p, &eps);
    let n = names::service_chains(&p.name);
    assert_eq!(
        chain(&rules, &n.ext),
        [
            format!("-s 10.0.0.0/8 -m comment --comment \"pod traffic for ns2/svc2:p80 external destinations\" -j {}", n.svc),
            "-m comment --comment \"masquerade LOCAL traffic for ns2/svc2:p80 external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ".to_string(),
            format!("-m comment --comment \"route LOCAL traffic for ns2/svc2:p80 external destinations\" -m addrtype --src-type LOCAL -j {}", n.svc),
            format!("-j {}", n.svl),
        ]
    );
    // SVL holds only the local endpoint; SVC both. The ClusterIP uses SVC (internal Cluster),
    // so the masquerade rule is there.
    let local_sep = names::endpoint_chain(&p.name, &eps[0]);
    assert_eq!(
        chain(&rules, &n.svl),
        [format!(
            "-m comment --comment \"ns2/svc2:p80 -> 10.180.0.2:80\" -j {local_sep}"
        )]
    );
    assert_eq!(chain(&rules, &n.svc).len(), 3);
    assert!(chain(&rules, &n.svc)[0].contains("cluster IP"));
    // The local endpoint's SEP chain (the other one is DNATed in SVC), SVC, SVL, EXT.
    assert_eq!(rules.chains.len(), 4);
    assert!(chain(&rules, &n.svc)[2].ends_with("-j DNAT --to-destination 10.180.2.1:80"));
    assert_eq!(
        dispatch(&rules, Dispatch::FilterNodePorts),
        ["-p tcp -m comment --comment \"ns2/svc2:p80 health check node port\" -m tcp --dport 30000 -j ACCEPT"]
    );
    assert!(dispatch(&rules, Dispatch::FilterExternalServices).is_empty());
}

#[test]
fn external_local_without_local_endpoints_drops_external_traffic_in_filter() {
    let ctx = ctx(IpFamily::V4);
    let mut p = port("ns2", "svc2", "172.30.0.42");
    p.node_port = Some(3001);
    p.external_ips = vec![ip("192.168.99.22")];
    p.load_balancer_ips = vec![ip("1.2.3.4")];
    p.external_traffic_local = true;
    let rules = render(&ctx, &p, &[ep("10.180.2.1", false)]);
    let n = names::service_chains(&p.name);
    assert_eq!(
        dispatch(&rules, Dispatch::FilterExternalServices),
        [
            "-d 192.168.99.22/32 -p tcp -m comment --comment \"ns2/svc2:p80 has no local endpoints\" -m tcp --dport 80 -j DROP",
            "-d 1.2.3.4/32 -p tcp -m comment --comment \"ns2/svc2:p80 has no local endpoints\" -m tcp --dport 80 -j DROP",
            "-p tcp -m comment --comment \"ns2/svc2:p80 has no local endpoints\" -m addrtype --dst-type LOCAL -m tcp --dport 3001 -j DROP",
        ]
    );
    // nat still sends it to EXT, whose short-circuit serves pods and the node; there is no
    // fall-through jump to an (absent) SVL chain.
    assert_eq!(dispatch(&rules, Dispatch::NatServices).len(), 3);
    assert_eq!(dispatch(&rules, Dispatch::NatNodePorts).len(), 1);
    let ext = chain(&rules, &n.ext);
    assert_eq!(ext.len(), 3);
    assert!(ext.iter().all(|r| !r.contains(&n.svl)));
    assert!(!chain_names(&rules).contains(&n.svl.as_str()));
    assert!(rules.no_local_external && !rules.no_local_internal);
}

#[test]
fn internal_local_without_local_endpoints_drops_clusterip_traffic() {
    let ctx = ctx(IpFamily::V4);
    let mut p = port("ns", "itp", "172.30.0.45");
    p.internal_traffic_local = true;
    let rules = render(&ctx, &p, &[ep("10.180.2.1", false)]);
    assert!(dispatch(&rules, Dispatch::NatServices).is_empty());
    assert_eq!(
        dispatch(&rules, Dispatch::FilterServices),
        ["-d 172.30.0.45/32 -p tcp -m comment --comment \"ns/itp:p80 has no local endpoints\" -m tcp --dport 80 -j DROP"]
    );
    assert!(rules.chains.is_empty());
    assert!(rules.no_local_internal);

    // With a local endpoint: the ClusterIP goes to SVL, which carries the masquerade rule.
    let rules = render(&ctx, &p, &[ep("10.180.2.1", false), ep("10.180.0.9", true)]);
    let n = names::service_chains(&p.name);
    assert!(dispatch(&rules, Dispatch::NatServices)[0].ends_with(&format!("-j {}", n.svl)));
    assert_eq!(chain_names(&rules).len(), 2, "one SEP and SVL, no SVC");
    assert!(chain(&rules, &n.svl)[0].contains("-j KUBE-MARK-MASQ"));
}

#[test]
fn no_endpoints_rejects_every_destination_in_filter_and_writes_no_nat_chains() {
    let ctx = ctx(IpFamily::V4);
    let mut p = port("ns1", "svc1", "172.30.0.41");
    p.external_ips = vec![ip("192.168.99.11")];
    p.load_balancer_ips = vec![ip("1.2.3.4")];
    p.load_balancer_source_ranges = vec![cidr("203.0.113.0/25")];
    p.node_port = Some(3001);
    let rules = render(&ctx, &p, &[]);
    let c = "-m comment --comment \"ns1/svc1:p80 has no endpoints\"";
    let r = "-j REJECT --reject-with icmp-port-unreachable";
    assert_eq!(
        dispatch(&rules, Dispatch::FilterServices),
        [format!(
            "-d 172.30.0.41/32 -p tcp {c} -m tcp --dport 80 {r}"
        )]
    );
    assert_eq!(
        dispatch(&rules, Dispatch::FilterExternalServices),
        [
            format!("-d 192.168.99.11/32 -p tcp {c} -m tcp --dport 80 {r}"),
            format!("-d 1.2.3.4/32 -p tcp {c} -m tcp --dport 80 {r}"),
            format!("-p tcp {c} -m addrtype --dst-type LOCAL -m tcp --dport 3001 {r}"),
        ]
    );
    assert!(dispatch(&rules, Dispatch::NatServices).is_empty());
    assert!(dispatch(&rules, Dispatch::NatNodePorts).is_empty());
    assert!(dispatch(&rules, Dispatch::FilterProxyFirewall).is_empty());
    assert!(rules.chains.is_empty());
    assert!(!rules.no_local_external && !rules.no_local_internal);
}

#[test]
fn ipv6_uses_128_bit_hosts_icmp6_rejects_and_bracketed_endpoints() {
    let ctx = ctx(IpFamily::V6);
    let mut p = port("ns", "v6", "fd00:10:96::10");
    p.session_affinity_timeout = Some(60);
    let rules = render(&ctx, &p, &[ep("fd00:10::11", true)]);
    let n = names::service_chains(&p.name);
    let sep = names::endpoint_chain(&p.name, &ep("fd00:10::11", true));
    assert_eq!(
        chain(&rules, &n.svc)[0],
        "! -s fd00:10::/64 -d fd00:10:96::10/128 -p tcp -m comment --comment \"ns/v6:p80 cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ"
    );
    assert!(chain(&rules, &n.svc)[1].contains(&format!(
        "--name {sep} --mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource"
    )));
    assert_eq!(
        chain(&rules, &sep),
        [
            "-s fd00:10::11/128 -m comment --comment \"ns/v6:p80\" -j KUBE-MARK-MASQ".to_string(),
            format!("-p tcp -m comment --comment \"ns/v6:p80\" -m recent --set --name {sep} --mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -j DNAT --to-destination [fd00:10::11]:80"),
        ]
    );
    let none = render(&ctx, &p, &[]);
    assert!(dispatch(&none, Dispatch::FilterServices)[0]
        .ends_with("-j REJECT --reject-with icmp6-port-unreachable"));
}

#[test]
fn a_port_without_a_clusterip_of_the_family_is_not_planned_and_other_family_endpoints_are_ignored()
{
    let p = port("ns", "v4only", "172.30.0.46");
    let eps = [ep("10.180.0.1", false), ep("fd00:10::1", false)];
    let selected = select(&p, &eps, &NodeInfo::default());
    assert!(render_port(&ctx(IpFamily::V6), &p, &selected).is_none());
    let mut dual = p.clone();
    dual.cluster_ips.push(ip("fd00:10:96::46"));
    let v6 = render_port(&ctx(IpFamily::V6), &dual, &selected).unwrap();
    let v4 = render_port(&ctx(IpFamily::V4), &dual, &selected).unwrap();
    for (rules, addr) in [(&v6, "fd00:10::1"), (&v4, "10.180.0.1")] {
        // SVC only (the endpoint is elsewhere), DNATing to its own family's endpoint.
        assert_eq!(rules.chains.len(), 1);
        assert_eq!(rules.chains[0].rules.len(), 2);
        assert!(rules.chains[0].rules[1].contains(addr));
    }
    // REJECT versus DROP is decided per family: only IPv6 endpoints, IPv4 rejects.
    let only6 = [ep("fd00:10::1", false)];
    let selected = select(&dual, &only6, &NodeInfo::default());
    let v4 = render_port(&ctx(IpFamily::V4), &dual, &selected).unwrap();
    assert!(dispatch(&v4, Dispatch::FilterServices)[0].contains("REJECT"));
    assert!(render_port(&ctx(IpFamily::V6), &dual, &selected)
        .unwrap()
        .dispatch[Dispatch::FilterServices as usize]
        .is_empty());
}

#[test]
fn source_ranges_go_through_the_fw_chain_and_the_rest_is_dropped_in_filter() {
    let ctx = ctx(IpFamily::V4);
    let mut p = port("ns5", "svc5", "172.30.0.45");
    p.load_balancer_ips = vec![ip("5.6.7.8")];
    p.load_balancer_source_ranges = vec![cidr("203.0.113.7/25"), cidr("fd00::/8")];
    p.node_port = Some(3002);
    let rules = render(&ctx, &p, &[ep("10.180.0.3", false)]);
    let n = names::service_chains(&p.name);
    assert_eq!(n.fw, "KUBE-FW-NUKIZ6OKUXPJNT4C");
    assert_eq!(
        dispatch(&rules, Dispatch::NatServices)[1],
        "-d 5.6.7.8/32 -p tcp -m comment --comment \"ns5/svc5:p80 loadbalancer IP\" -m tcp --dport 80 -j KUBE-FW-NUKIZ6OKUXPJNT4C"
    );
    assert_eq!(
        chain(&rules, &n.fw),
        [
            "-s 203.0.113.0/25 -m comment --comment \"ns5/svc5:p80 loadbalancer IP\" -j KUBE-EXT-NUKIZ6OKUXPJNT4C",
            "-m comment --comment \"other traffic to ns5/svc5:p80 will be dropped by KUBE-PROXY-FIREWALL\"",
        ]
    );
    assert_eq!(
        dispatch(&rules, Dispatch::FilterProxyFirewall),
        ["-d 5.6.7.8/32 -p tcp -m comment --comment \"ns5/svc5:p80 traffic not accepted by KUBE-FW-NUKIZ6OKUXPJNT4C\" -m tcp --dport 80 -j DROP"]
    );
    // NodePorts are not subject to source ranges.
    assert!(dispatch(&rules, Dispatch::NatNodePorts)[0].ends_with("-j KUBE-EXT-NUKIZ6OKUXPJNT4C"));
    // FW after EXT, which it jumps to.
    assert_eq!(rules.chains.last().unwrap().chain, n.fw);

    // A range containing the node's own address also admits the LB IP as a source.
    p.load_balancer_source_ranges = vec![cidr("192.168.0.0/24")];
    let rules = render(&ctx, &p, &[ep("10.180.0.3", false)]);
    assert_eq!(
        chain(&rules, &n.fw)[1],
        "-s 5.6.7.8/32 -m comment --comment \"ns5/svc5:p80 loadbalancer IP\" -j KUBE-EXT-NUKIZ6OKUXPJNT4C"
    );
}

#[test]
fn node_port_addresses_restrict_the_nodeports_jump_and_the_rejects() {
    let node = NodeContext {
        local_cidrs: vec![],
        node_port_addresses: vec![
            cidr("192.168.0.2/32"),
            cidr("10.1.2.3/16"),
            cidr("127.0.0.1/32"),
            cidr("fd00::1/128"),
        ],
        ..NodeContext::default()
    };
    let ctx = ctx_with(PlanConfig::new(IpFamily::V4), node.clone(), false);
    assert_eq!(
        nodeports_jump(&ctx),
        [
            "-d 192.168.0.2/32 -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
            "-d 10.1.0.0/16 -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
        ]
    );
    let mut p = port("ns", "np", "172.30.0.47");
    p.node_port = Some(30080);
    let rules = render(&ctx, &p, &[]);
    let rejects = dispatch(&rules, Dispatch::FilterExternalServices);
    assert_eq!(rejects.len(), 2);
    assert!(rejects[1].starts_with("-d 10.1.0.0/16 -p tcp -m comment"));
    assert!(rejects[1].contains("-m addrtype --dst-type LOCAL -m tcp --dport 30080 -j REJECT"));

    // Localhost NodePorts on: the loopback address counts too.
    let mut cfg = PlanConfig::new(IpFamily::V4);
    cfg.localhost_node_ports = true;
    let lo = ctx_with(cfg, node.clone(), false);
    assert_eq!(nodeports_jump(&lo).len(), 3);
    assert!(nodeports_jump(&lo)[2].starts_with("-d 127.0.0.1/32 "));

    // IPv6 has only its own CIDR; a family without CIDRs answers everywhere (upstream).
    let v6 = ctx_with(PlanConfig::new(IpFamily::V6), node, false);
    assert_eq!(nodeports_jump(&v6).len(), 1);
    assert!(nodeports_jump(&v6)[0].starts_with("-d fd00::1/128 "));
    let only_v6 = NodeContext {
        local_cidrs: vec![],
        node_port_addresses: vec![cidr("fd00::1/128")],
        ..NodeContext::default()
    };
    let v4 = ctx_with(PlanConfig::new(IpFamily::V4), only_v6, false);
    assert_eq!(v4.node_ports, NodePortDestinations::AllLocal);
}

#[test]
fn nodeports_on_every_address_exclude_loopback_unless_localhost_nodeports() {
    let c = "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS";
    assert_eq!(
        nodeports_jump(&ctx(IpFamily::V4)),
        [format!("! -d 127.0.0.0/8 {c}")]
    );
    let mut cfg = PlanConfig::new(IpFamily::V4);
    cfg.localhost_node_ports = true;
    assert_eq!(
        nodeports_jump(&ctx_with(cfg.clone(), NodeContext::default(), false)),
        [c.to_string()]
    );
    // IPv6 never has localhost NodePorts.
    cfg.family = IpFamily::V6;
    assert_eq!(
        nodeports_jump(&ctx_with(cfg, NodeContext::default(), false)),
        [format!("! -d ::1/128 {c}")]
    );
}

#[test]
fn large_clusters_drop_comments_on_per_endpoint_rules_only() {
    let large = ctx_with(PlanConfig::new(IpFamily::V4), NodeContext::default(), true);
    let mut p = port("ns", "big", "172.30.0.48");
    p.session_affinity_timeout = Some(30);
    let eps = [ep("10.180.0.1", true), ep("10.180.0.2", false)];
    let rules = render(&large, &p, &eps);
    let n = names::service_chains(&p.name);
    let svc = chain(&rules, &n.svc);
    assert!(
        svc[0].contains("cluster IP"),
        "the masquerade rule keeps its comment"
    );
    for r in &svc[1..] {
        assert!(!r.contains("-m comment"), "{r}");
    }
    let sep = names::endpoint_chain(&p.name, &eps[0]);
    assert_eq!(
        chain(&rules, &sep),
        [
            "-s 10.180.0.1/32 -j KUBE-MARK-MASQ".to_string(),
            format!("-p tcp -m recent --set --name {sep} --mask 255.255.255.255 --rsource -j DNAT --to-destination 10.180.0.1:80"),
        ]
    );
    assert!(dispatch(&rules, Dispatch::NatServices)[0].contains("-m comment"));
}

#[test]
fn fixed_chains_use_the_configured_mark() {
    assert_eq!(
        postrouting(0x4000),
        [
            "-m mark ! --mark 0x4000/0x4000 -j RETURN",
            "-j MARK --set-xmark 0x4000/0x0",
            "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
        ]
    );
    assert_eq!(mark_masq(1 << 15), ["-j MARK --set-xmark 0x8000/0x8000"]);
    assert_eq!(
        forward(0x4000),
        [
            "-m conntrack --ctstate INVALID -j DROP",
            "-m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT",
            "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        ]
    );
    assert_eq!(
        kubelet_firewall(),
        ["! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"]
    );
    let mut cfg = PlanConfig::new(IpFamily::V4);
    cfg.masquerade_bit = 99;
    assert_eq!(
        cfg.mark(),
        0x4000,
        "an invalid bit falls back to the default"
    );
}

#[test]
fn jump_rules_are_upstreams_with_kubelets_firewall_only_when_owned() {
    let plain = jump_rules(false);
    assert_eq!(plain.len(), 12);
    assert_eq!(
        plain[0],
        (
            "filter",
            "INPUT",
            "-m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES".to_string()
        )
    );
    assert!(plain.contains(&(
        "nat",
        "PREROUTING",
        "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string()
    )));
    let with = jump_rules(true);
    assert_eq!(with.len(), 14);
    assert_eq!(
        with[13],
        ("filter", "OUTPUT", "-j KUBE-FIREWALL".to_string())
    );
}

#[test]
fn clusterips_reject_unused_ports_behind_one_return_for_other_destinations() {
    let vips = vec![
        ("ns/a".to_string(), ip("10.96.0.10")),
        ("ns/b".to_string(), ip("10.96.3.1")),
    ];
    assert_eq!(
        cluster_ip_rejects(IpFamily::V4, &vips, &[]),
        [
            "! -d 10.96.0.0/22 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN",
            "-d 10.96.0.10/32 -m comment --comment \"ns/a cluster IP: no Service port here\" -j REJECT --reject-with icmp-port-unreachable",
            "-d 10.96.3.1/32 -m comment --comment \"ns/b cluster IP: no Service port here\" -j REJECT --reject-with icmp-port-unreachable",
        ]
    );
    assert!(cluster_ip_rejects(IpFamily::V4, &[], &[]).is_empty());
    // With Service CIDRs, traffic still addressed to one after the rejects is for an address
    // no Service holds: dropped, and the early RETURN covers the CIDRs too.
    let cidrs = [cidr("10.96.0.0/16"), cidr("192.168.50.0/24")];
    assert_eq!(
        cluster_ip_rejects(IpFamily::V4, &vips, &cidrs),
        [
            "-d 192.168.50.0/24 -m comment --comment \"drop traffic to unallocated ClusterIPs\" -j DROP",
            "! -d 10.96.0.0/16 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN",
            "-d 10.96.0.10/32 -m comment --comment \"ns/a cluster IP: no Service port here\" -j REJECT --reject-with icmp-port-unreachable",
            "-d 10.96.3.1/32 -m comment --comment \"ns/b cluster IP: no Service port here\" -j REJECT --reject-with icmp-port-unreachable",
            "-d 10.96.0.0/16 -m comment --comment \"drop traffic to unallocated ClusterIPs\" -j DROP",
        ]
    );
    for rule in cluster_ip_rejects(IpFamily::V4, &vips, &cidrs) {
        crate::validate::rule(IpFamily::V4, Table::Filter, "KUBE-SERVICES", &rule)
            .unwrap_or_else(|e| panic!("{rule}: {e}"));
    }
    let one = cluster_ip_rejects(
        IpFamily::V6,
        &[("ns/v6".to_string(), ip("fd00:10:96::10"))],
        &[],
    );
    assert!(one[0].starts_with("! -d fd00:10:96::10/128 "));
    assert!(one[1].ends_with("-j REJECT --reject-with icmp6-port-unreachable"));
    let covers = |a: &str, b: &str| {
        covering_net([host(&ip(a)), host(&ip(b))].into_iter())
            .unwrap()
            .to_string()
    };
    assert_eq!(covers("10.96.0.1", "10.96.0.1"), "10.96.0.1/32");
    assert_eq!(covers("10.96.0.1", "10.111.255.255"), "10.96.0.0/12");
    assert_eq!(covers("1.0.0.0", "200.0.0.0"), "0.0.0.0/0");
    assert_eq!(
        covers("fd00:10:96::1", "fd00:10:96::ffff"),
        "fd00:10:96::/112"
    );
    let nets = |v: &[&str]| {
        covering_net(v.iter().map(|n| n.parse::<IpNet>().unwrap()))
            .unwrap()
            .to_string()
    };
    assert_eq!(nets(&["10.96.0.0/12", "10.96.0.1/32"]), "10.96.0.0/12");
    assert_eq!(nets(&["10.96.0.0/12", "10.112.0.1/32"]), "10.96.0.0/11");
    assert_eq!(nets(&["0.0.0.0/0"]), "0.0.0.0/0");
}

/// ClusterIPs from unrelated ranges (several Service CIDRs) straddle the two halves of the
/// address space, so the smallest network holding them is `0.0.0.0/0`: `! -d 0.0.0.0/0` would
/// match nothing, and iptables-nft refuses it. The `RETURN` then covers the half with more
/// ClusterIPs, whose rejects follow it; the other half's rejects come first.
#[test]
fn clusterips_from_unrelated_ranges_return_early_for_the_larger_half() {
    let vips: Vec<(String, IpAddr)> = [
        ("ns/a", "10.96.0.10"),
        ("ns/far", "192.168.50.10"),
        ("ns/b", "10.96.3.1"),
    ]
    .iter()
    .map(|(s, a)| (s.to_string(), ip(a)))
    .collect();
    let reject = |a: &str, s: &str| {
        format!("-d {a}/32 -m comment --comment \"{s} cluster IP: no Service port here\" -j REJECT --reject-with icmp-port-unreachable")
    };
    assert_eq!(
        cluster_ip_rejects(IpFamily::V4, &vips, &[]),
        [
            reject("192.168.50.10", "ns/far"),
            "! -d 10.96.0.0/22 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN"
                .to_string(),
            reject("10.96.0.10", "ns/a"),
            reject("10.96.3.1", "ns/b"),
        ]
    );
    // A tie covers the lower half; IPv6 likewise.
    let v6 = [
        ("ns/a".to_string(), ip("fd00:10:96::10")),
        ("ns/b".to_string(), ip("2001:db8:50::10")),
    ];
    let rules = cluster_ip_rejects(IpFamily::V6, &v6, &[]);
    assert_eq!(rules.len(), 3);
    assert!(rules[0].starts_with("-d fd00:10:96::10/128 "), "{rules:#?}");
    assert!(
        rules[1].starts_with("! -d 2001:db8:50::10/128 -m comment"),
        "{rules:#?}"
    );
    assert!(
        rules[2].starts_with("-d 2001:db8:50::10/128 "),
        "{rules:#?}"
    );
    // Any set of ClusterIPs: never a negated zero-length prefix, one RETURN, every reject.
    for spread in [0u32, 1, 7, 31] {
        let vips: Vec<(String, IpAddr)> = (0..9u32)
            .map(|i| {
                let a = std::net::Ipv4Addr::from(i.wrapping_mul(0x9e37_79b9) >> spread);
                (format!("ns/s{i}"), IpAddr::V4(a))
            })
            .collect();
        let rules = cluster_ip_rejects(IpFamily::V4, &vips, &[]);
        assert_eq!(rules.len(), vips.len() + 1, "{rules:#?}");
        for r in &rules {
            crate::validate::rule(IpFamily::V4, Table::Filter, "KUBE-SERVICES", r)
                .unwrap_or_else(|e| panic!("{r}: {e}"));
        }
    }
}

/// A check of the whole space leaves nothing to return early for; checks of networks keep
/// their order within a half (a drop of a Service CIDR stays after the rejects inside it).
#[test]
fn an_early_return_never_reorders_checks_that_can_match_the_same_packet() {
    let check = |net: &str, rule: &str| Check {
        dst: net.parse().unwrap(),
        rule: rule.to_string(),
    };
    assert_eq!(
        with_early_return(vec![check("10.0.0.1/32", "a"), check("0.0.0.0/0", "b")]),
        ["a", "b"]
    );
    let rules = with_early_return(vec![
        check("10.96.0.10/32", "reject a"),
        check("192.168.0.5/32", "reject far"),
        check("10.96.0.0/12", "drop range"),
        check("192.168.0.0/16", "drop far range"),
    ]);
    assert_eq!(
        rules,
        [
            "reject far",
            "drop far range",
            "! -d 10.96.0.0/12 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN",
            "reject a",
            "drop range",
        ]
    );
}

/// A zero-length prefix: as a match it is left out (every address), as a negated match it is
/// never rendered (masquerading for a pod network of every address is no rule at all).
#[test]
fn zero_length_prefixes_are_never_rendered() {
    let any: IpNet = "0.0.0.0/0".parse().unwrap();
    assert_eq!(Rule::new().src(any).jump("X").build(), "-j X");
    assert_eq!(
        Rule::new().dst("::/0".parse().unwrap()).jump("X").build(),
        "-j X"
    );
}

/// A pod network of every address (detect-local by `0.0.0.0/0`) and a source range of every
/// address (`loadBalancerSourceRanges: [0.0.0.0/0]`, a common way to say "anyone"): no negated
/// zero-length prefix (no ClusterIP masquerade rule: no client is off the pod network), no
/// `-s 0.0.0.0/0` (printed back as no match at all), and every rule passes the validator.
#[test]
fn pod_networks_and_source_ranges_of_every_address_render_valid_rules() {
    for (family, any, lb) in [
        (IpFamily::V4, "0.0.0.0/0", "198.51.100.1"),
        (IpFamily::V6, "::/0", "2001:db8:1::1"),
    ] {
        let node = NodeContext {
            local_cidrs: vec![cidr(any)],
            ..NodeContext::default()
        };
        let ctx = ctx_with(PlanConfig::new(family), node, false);
        let (vip, ep_ip) = match family {
            IpFamily::V4 => ("172.30.0.41", "10.180.0.1"),
            IpFamily::V6 => ("fd00:172:30::41", "fd00:10:180::1"),
        };
        let mut p = port("ns1", "svc1", vip);
        p.node_port = Some(30001);
        p.load_balancer_ips = vec![ip(lb)];
        p.load_balancer_source_ranges = vec![cidr(any)];
        p.external_traffic_local = true;
        let rules = render(&ctx, &p, &[ep(ep_ip, true), ep(ep_ip, false)]);
        let chains = names::service_chains(&p.name);
        assert_eq!(
            chain(&rules, &chains.fw)[0],
            format!(
                "-m comment --comment \"ns1/svc1:p80 loadbalancer IP\" -j {}",
                chains.ext
            )
        );
        assert!(
            !chain(&rules, &chains.svc)
                .iter()
                .any(|r| r.contains("KUBE-MARK-MASQ")),
            "{:#?}",
            chain(&rules, &chains.svc)
        );
        for c in &rules.chains {
            for r in &c.rules {
                crate::validate::rule(family, Table::Nat, &c.chain, r)
                    .unwrap_or_else(|e| panic!("{}: {r}: {e}", c.chain));
            }
        }
        for d in Dispatch::ALL {
            for r in dispatch(&rules, d) {
                crate::validate::rule(family, d.table(), d.chain(), r)
                    .unwrap_or_else(|e| panic!("{}: {r}: {e}", d.chain()));
            }
        }
    }
}

/// Detect-local by interface: the ClusterIP masquerades what did not arrive on the pods'
/// interface(s), and a Local-policy entry short-circuits what did, as upstream's
/// `BridgeInterface` (`-i cbr0`) and `InterfaceNamePrefix` (`-i veth+`) detectors do.
#[test]
fn detect_local_by_interface_matches_the_ingress_interface() {
    use kp_core::node::{InterfaceName, LocalInterface};
    let mut p = port("ns2", "svc2", "172.30.0.42");
    p.node_port = Some(3001);
    p.external_traffic_local = true;
    let eps = [ep("10.180.0.2", true), ep("10.180.2.1", false)];
    let n = names::service_chains(&p.name);
    for (local, not_from_pods, from_pods) in [
        (
            LocalInterface::Bridge(InterfaceName::new("cbr0").unwrap()),
            "! -i cbr0",
            "-i cbr0",
        ),
        (
            LocalInterface::Prefix(InterfaceName::new("veth").unwrap()),
            "! -i veth+",
            "-i veth+",
        ),
    ] {
        let node = NodeContext {
            local_interface: Some(local),
            ..NodeContext::default()
        };
        let ctx = RenderContext::new(&PlanConfig::new(IpFamily::V4), &node, false);
        let rules = render(&ctx, &p, &eps);
        assert_eq!(
            chain(&rules, &n.svc)[0],
            format!("-d 172.30.0.42/32 {not_from_pods} -p tcp -m comment --comment \"ns2/svc2:p80 cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ")
        );
        assert_eq!(
            chain(&rules, &n.ext)[0],
            format!("{from_pods} -m comment --comment \"pod traffic for ns2/svc2:p80 external destinations\" -j {}", n.svc)
        );
        for (name, rs) in [
            (&n.svc, chain(&rules, &n.svc)),
            (&n.ext, chain(&rules, &n.ext)),
        ] {
            for r in rs {
                assert!(!r.contains("-s 10."), "{r}");
                crate::validate::rule(IpFamily::V4, Table::Nat, name, r)
                    .unwrap_or_else(|e| panic!("{r}: {e}"));
            }
        }
    }
}
