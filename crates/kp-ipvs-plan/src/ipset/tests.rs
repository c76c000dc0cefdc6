use super::*;

use kp_core::model::{Endpoint, NodeInfo, ServiceKey as K8sKey, ServicePort, ServicePortName};
use kp_core::select::select;

// ClusterIP 10.96.0.1, external IP 203.0.113.10, LoadBalancer IP 198.51.100.10, NodePort
// 30080 on the node's 192.0.2.1; endpoints 10.244.1.5 (this node) and 10.244.2.5 (another).

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn port(protocol: Protocol) -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: K8sKey::new("web", "api"),
            port: "http".into(),
            protocol,
        },
        cluster_ips: vec![ip("10.96.0.1")],
        port: 80,
        node_port: Some(30080),
        external_ips: vec![ip("203.0.113.10")],
        load_balancer_ips: vec![ip("198.51.100.10")],
        load_balancer_source_ranges: Vec::new(),
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: false,
        health_check_node_port: None,
    }
}

fn ep(addr: &str, local: bool) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        is_local: local,
        zone_hints: None,
    }
}

fn sets_of(port: &ServicePort, node: &NodeContext) -> Sets {
    let eps = vec![ep("10.244.1.5", true), ep("10.244.2.5", false)];
    let sel = select(port, &eps, &NodeInfo::default());
    let mut sets = Sets::new(IpFamily::V4);
    sets.add(
        &Frontends::new(port, &sel, IpFamily::V4),
        &[ip("192.0.2.1")],
        node,
    );
    sets
}

fn texts(sets: &Sets, set: SetName) -> Vec<String> {
    sets.get(set).iter().map(|e| e.to_string()).collect()
}

#[test]
fn a_cluster_policy_service_fills_the_cluster_external_lb_nodeport_and_loopback_sets() {
    let sets = sets_of(&port(Protocol::Tcp), &NodeContext::default());
    assert_eq!(texts(&sets, SetName::ClusterIp), ["10.96.0.1,tcp:80"]);
    assert_eq!(texts(&sets, SetName::ExternalIp), ["203.0.113.10,tcp:80"]);
    assert!(sets.is_empty(SetName::ExternalIpLocal));
    assert_eq!(
        texts(&sets, SetName::LoadBalancer),
        ["198.51.100.10,tcp:80"]
    );
    assert!(sets.is_empty(SetName::LoadBalancerLocal));
    assert!(sets.is_empty(SetName::LoadBalancerFw));
    assert_eq!(texts(&sets, SetName::NodePortTcp), ["30080"]);
    assert!(sets.is_empty(SetName::NodePortUdp));
    assert!(sets.is_empty(SetName::NodePortLocalTcp));
    assert_eq!(
        texts(&sets, SetName::LoopBack),
        [
            "10.244.1.5,tcp:8080,10.244.1.5",
            "10.244.2.5,tcp:8080,10.244.2.5"
        ]
    );
    assert_eq!(
        texts(&sets, SetName::IpvsIps),
        ["10.96.0.1", "198.51.100.10", "203.0.113.10"]
    );
}

#[test]
fn a_local_policy_service_goes_to_the_local_sets_and_its_health_check_port_is_listed() {
    let mut p = port(Protocol::Udp);
    p.external_traffic_local = true;
    p.health_check_node_port = Some(32000);
    let sets = sets_of(&p, &NodeContext::default());
    assert!(sets.is_empty(SetName::ExternalIp));
    assert_eq!(
        texts(&sets, SetName::ExternalIpLocal),
        ["203.0.113.10,udp:80"]
    );
    assert_eq!(
        texts(&sets, SetName::LoadBalancer),
        ["198.51.100.10,udp:80"]
    );
    assert_eq!(
        texts(&sets, SetName::LoadBalancerLocal),
        ["198.51.100.10,udp:80"]
    );
    assert_eq!(texts(&sets, SetName::NodePortUdp), ["30080"]);
    assert_eq!(texts(&sets, SetName::NodePortLocalUdp), ["30080"]);
    assert_eq!(texts(&sets, SetName::HealthCheckNodePort), ["32000"]);
}

#[test]
fn source_ranges_fill_the_firewall_sets_and_admit_the_node_when_its_address_is_inside() {
    let mut p = port(Protocol::Tcp);
    p.load_balancer_source_ranges =
        vec!["192.0.2.0/24".parse().unwrap(), "fd00::/8".parse().unwrap()];
    let node = NodeContext {
        node_ips: vec![ip("192.0.2.1")],
        ..NodeContext::default()
    };
    let sets = sets_of(&p, &node);
    assert_eq!(
        texts(&sets, SetName::LoadBalancerFw),
        ["198.51.100.10,tcp:80"]
    );
    assert_eq!(
        texts(&sets, SetName::LoadBalancerSourceCidr),
        ["198.51.100.10,tcp:80,192.0.2.0/24"]
    );
    assert_eq!(
        texts(&sets, SetName::LoadBalancerSourceIp),
        ["198.51.100.10,tcp:80,198.51.100.10"]
    );
    let elsewhere = sets_of(
        &p,
        &NodeContext {
            node_ips: vec![ip("203.0.113.99")],
            ..NodeContext::default()
        },
    );
    assert!(elsewhere.is_empty(SetName::LoadBalancerSourceIp));
}

#[test]
fn an_sctp_nodeport_is_one_entry_per_node_address_of_the_family() {
    let sets = sets_of(&port(Protocol::Sctp), &NodeContext::default());
    assert_eq!(
        texts(&sets, SetName::NodePortSctp),
        ["192.0.2.1,sctp:30080"]
    );
    assert!(sets.is_empty(SetName::NodePortTcp));
}

#[test]
fn ipv6_sets_carry_the_kube_6_prefix_and_parse_back() {
    assert_eq!(SetName::ClusterIp.name(IpFamily::V6), "KUBE-6-CLUSTER-IP");
    assert_eq!(
        SetName::NodePortLocalSctp.name(IpFamily::V6),
        "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"
    );
    assert_eq!(
        SetName::parse("KUBE-6-LOOP-BACK", IpFamily::V6),
        Some(SetName::LoopBack)
    );
    assert_eq!(SetName::parse("KUBE-6-LOOP-BACK", IpFamily::V4), None);
    assert_eq!(
        SetName::LoadBalancerSourceCidr.name(IpFamily::V6),
        "KUBE-6-LOAD-BALANCER-SOURCE-CID"
    );
    let names: BTreeSet<String> = SetName::ALL.iter().map(|s| s.name(IpFamily::V6)).collect();
    assert_eq!(names.len(), SetName::ALL.len(), "cut names stay distinct");
    for s in SetName::ALL {
        assert!(s.name(IpFamily::V6).len() <= NAME_MAX, "{s:?}");
        assert_eq!(SetName::parse(&s.name(IpFamily::V6), IpFamily::V6), Some(s));
    }
}

#[test]
fn the_diff_adds_and_deletes_single_entries() {
    let before = sets_of(&port(Protocol::Tcp), &NodeContext::default());
    let mut p = port(Protocol::Tcp);
    p.external_ips.clear();
    let after = sets_of(&p, &NodeContext::default());
    let changes = diff(&after, &before);
    assert_eq!(
        changes,
        [
            SetChange::Del(
                SetName::ExternalIp,
                Entry::IpPort(ip("203.0.113.10"), Protocol::Tcp, 80)
            ),
            SetChange::Del(SetName::IpvsIps, Entry::Ip(ip("203.0.113.10"))),
        ]
    );
    assert!(diff(&after, &after).is_empty());
}

#[test]
fn restore_text_creates_every_set_and_saved_output_reads_back_to_the_same_contents() {
    let mut p = port(Protocol::Tcp);
    p.load_balancer_source_ranges = vec!["192.0.2.0/24".parse().unwrap()];
    let want = sets_of(&p, &NodeContext::default());
    let text = restore_text(IpFamily::V4, &diff(&want, &Sets::new(IpFamily::V4)));
    assert!(text.contains("create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 -exist\n"));
    assert!(text.contains(
        "create KUBE-LOOP-BACK hash:ip,port,ip family inet hashsize 1024 maxelem 1048576 -exist\n"
    ));
    assert!(text
        .contains("add KUBE-LOAD-BALANCER-SOURCE-CIDR 198.51.100.10,tcp:80,192.0.2.0/24 -exist\n"));
    assert_eq!(
        text.lines().filter(|l| l.starts_with("create ")).count(),
        SetName::ALL.len()
    );
    // `ipset save` prints what we added (without -exist), plus sets of others.
    let saved: String = text
        .lines()
        .filter(|l| l.starts_with("add "))
        .map(|l| format!("{}\n", l.trim_end_matches(" -exist")))
        .chain(["add OTHER-SET 1.2.3.4\n".to_string()])
        .collect();
    assert_eq!(Sets::parse_save(IpFamily::V4, &saved), want);
}

#[test]
fn a_host_network_saved_without_its_length_parses_as_a_host_route() {
    assert_eq!(
        Entry::parse(SetType::HashIpPortNet, "198.51.100.10,tcp:80,192.0.2.7"),
        Some(Entry::IpPortNet(
            ip("198.51.100.10"),
            Protocol::Tcp,
            80,
            "192.0.2.7/32".parse().unwrap()
        ))
    );
    assert_eq!(Entry::parse(SetType::HashIpPort, "10.0.0.1,icmp:0"), None);
    assert_eq!(
        Entry::parse(SetType::HashIpPort, "10.0.0.1,tcp:80,10.0.0.1"),
        None
    );
}

#[test]
fn sets_created_with_other_options_are_found_and_replaced_under_their_name() {
    // As `ipset save` prints them: ours (the kernel's sizes differ and do not count), one with
    // upstream's maxelem, one with comments, one of the other family, one of someone else.
    let saved = "\
create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 4096 maxelem 1048576 bucketsize 12 initval 0x1
create KUBE-LOOP-BACK hash:ip,port,ip family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x2
create KUBE-EXTERNAL-IP hash:ip,port family inet hashsize 1024 maxelem 1048576 comment bucketsize 12 initval 0x3
create KUBE-NODE-PORT-TCP bitmap:port range 0-65535
create KUBE-6-LOOP-BACK hash:ip,port,ip family inet6 hashsize 1024 maxelem 65536 bucketsize 12 initval 0x4
create OTHER hash:ip family inet hashsize 1024 maxelem 65536
add KUBE-LOOP-BACK 10.244.1.5,tcp:8080,10.244.1.5
";
    assert_eq!(
        misfits(IpFamily::V4, saved),
        [SetName::LoopBack, SetName::ExternalIp]
    );
    assert_eq!(misfits(IpFamily::V6, saved), [SetName::LoopBack]);
    let text = replace_text(IpFamily::V4, &[SetName::LoopBack]);
    assert_eq!(
        text,
        "create KUBE-REPLACING-0 hash:ip,port,ip family inet hashsize 1024 maxelem 1048576\n\
         swap KUBE-LOOP-BACK KUBE-REPLACING-0\n\
         destroy KUBE-REPLACING-0\n"
    );
    // What restore_text creates is not a misfit.
    let ours: String = restore_text(IpFamily::V4, &[])
        .replace(" -exist", "")
        .lines()
        .map(|l| format!("{l} bucketsize 12 initval 0x9\n"))
        .collect();
    assert!(misfits(IpFamily::V4, &ours).is_empty(), "{ours}");
}

#[test]
fn saved_output_read_as_it_comes_gives_the_same_changes_as_the_parsed_text() {
    let mut p = port(Protocol::Tcp);
    p.load_balancer_source_ranges = vec!["192.0.2.0/24".parse().unwrap()];
    let want = sets_of(&p, &NodeContext::default());
    let mut other = port(Protocol::Udp);
    other.cluster_ips = vec![ip("10.96.0.99")];
    other.external_ips = vec![ip("203.0.113.99")];
    let stale = sets_of(&other, &NodeContext::default());
    // The kernel holds half of what is wanted and all of a stale Service's entries, in the
    // order `ipset save` prints (not sorted), with another program's set and a set of the
    // other family among them.
    let mut lines: Vec<String> = diff(&want, &Sets::new(IpFamily::V4))
        .into_iter()
        .step_by(2)
        .chain(diff(&stale, &Sets::new(IpFamily::V4)))
        .map(|c| match c {
            SetChange::Add(s, e) | SetChange::Del(s, e) => {
                format!("add {} {e}", s.name(IpFamily::V4))
            }
        })
        .collect();
    lines.reverse();
    lines
        .push("create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536".into());
    lines.push("add OTHER-SET 1.2.3.4".into());
    lines.push("add KUBE-6-CLUSTER-IP fd00::1,tcp:80".into());
    let text = lines.join("\n") + "\n";

    let saved = Saved::read(&[IpFamily::V4, IpFamily::V6], text.as_bytes()).unwrap();
    let parsed = Sets::parse_save(IpFamily::V4, &text);
    let streamed: Vec<SetChange> = saved.changes(0, &want, &[]).collect();
    assert_eq!(streamed, diff(&want, &parsed));
    assert!(streamed.iter().any(|c| matches!(c, SetChange::Del(..))));
    assert!(streamed.iter().any(|c| matches!(c, SetChange::Add(..))));
    // The other family's entry is read into its own list.
    let v6: Vec<SetChange> = saved.changes(1, &Sets::new(IpFamily::V6), &[]).collect();
    assert_eq!(v6.len(), 1);
    // A set being replaced counts as empty: all of it is added again, nothing deleted.
    assert_eq!(
        misfits(IpFamily::V4, saved.creates()),
        vec![SetName::ClusterIp]
    );
    let mut cleared = parsed.clone();
    cleared.clear(SetName::ClusterIp);
    let replaced: Vec<SetChange> = saved.changes(0, &want, &[SetName::ClusterIp]).collect();
    assert_eq!(replaced, diff(&want, &cleared));
}

#[test]
fn ipv4_entries_pack_into_twelve_bytes_that_sort_as_the_entries_and_others_stay_as_they_are() {
    let net = |s: &str| s.parse::<IpNet>().expect("net");
    let lb = ip("198.51.100.10");
    let ep = ip("10.244.1.5");
    // Each entry, and whether it packs (IPv4 and of its set's type).
    let given = [
        (SetName::NodePortTcp, Entry::Port(30080), true),
        (SetName::NodePortTcp, Entry::Port(80), true),
        (SetName::IpvsIps, Entry::Ip(ip("10.96.0.2")), true),
        (SetName::IpvsIps, Entry::Ip(ip("10.96.0.1")), true),
        (
            SetName::ClusterIp,
            Entry::IpPort(ip("10.96.0.1"), Protocol::Sctp, 80),
            true,
        ),
        (
            SetName::ClusterIp,
            Entry::IpPort(ip("10.96.0.1"), Protocol::Udp, 443),
            true,
        ),
        (
            SetName::ClusterIp,
            Entry::IpPort(ip("10.96.0.1"), Protocol::Tcp, 443),
            true,
        ),
        (
            SetName::LoopBack,
            Entry::IpPortIp(ep, Protocol::Tcp, 8080, ep),
            true,
        ),
        (
            SetName::LoopBack,
            Entry::IpPortIp(ep, Protocol::Tcp, 8080, ip("10.244.1.4")),
            true,
        ),
        (
            SetName::LoadBalancerSourceCidr,
            Entry::IpPortNet(lb, Protocol::Tcp, 80, net("10.1.2.3/8")),
            true,
        ),
        (
            SetName::LoadBalancerSourceCidr,
            Entry::IpPortNet(lb, Protocol::Tcp, 80, net("10.0.0.0/8")),
            true,
        ),
        (
            SetName::LoadBalancerSourceCidr,
            Entry::IpPortNet(lb, Protocol::Tcp, 80, net("10.0.0.0/32")),
            true,
        ),
        (SetName::IpvsIps, Entry::Ip(ip("fd00::1")), false),
        (SetName::IpvsIps, Entry::Port(7), false),
        (
            SetName::LoopBack,
            Entry::IpPortIp(ep, Protocol::Tcp, 8080, ip("fd00::1")),
            false,
        ),
        (
            SetName::LoadBalancerSourceCidr,
            Entry::IpPortNet(lb, Protocol::Tcp, 80, net("fd00::/64")),
            false,
        ),
    ];
    let mut sets = Sets::new(IpFamily::V4);
    for (set, e, packs) in given {
        let packed = pack(set.set_type(), &e);
        assert_eq!(packed.is_some(), packs, "{set:?} {e}");
        if let Some(p) = packed {
            assert_eq!(unpack(set.set_type(), &p), e, "{set:?} {e} back");
        }
        sets.insert(set, e);
    }
    for set in SetName::ALL {
        let mut want: Vec<Entry> = given
            .iter()
            .filter(|(s, _, _)| *s == set)
            .map(|(_, e, _)| *e)
            .collect();
        want.sort();
        let got: Vec<Entry> = sets.get(set).iter().collect();
        assert_eq!(got, want, "{set:?} in the entries' order");
        assert_eq!(sets.get(set).len(), want.len());
        assert!(want.iter().all(|e| sets.get(set).contains(e)), "{set:?}");
    }
    let mut v6 = Sets::new(IpFamily::V6);
    v6.insert(SetName::IpvsIps, Entry::Ip(ip("fd00::1")));
    assert!(v6.get(SetName::IpvsIps).contains(&Entry::Ip(ip("fd00::1"))));
    for (set, e, _) in given {
        sets.remove(set, &e);
    }
    assert_eq!(sets, Sets::new(IpFamily::V4), "every entry removed");
}
