//! The packet-flow table through the ipvs mode's planned state: chains, ipsets and virtual
//! servers as a sync of the fixture programs them, traced without a kernel. (The same table
//! runs with real packets on a real IPVS kernel in `kp-ipvs`'s `flows_vm` test.)

use kp_core::model::IpFamily;
use kp_core::node::NodeContext;
use kp_iptables_plan::PlanConfig;
use kp_ipvs_plan::ipset::{Entry, SetName, Sets};
use kp_ipvs_plan::planner::Planner;
use kp_ipvs_plan::Config;
use kp_ipvs_test::{IpvsNode, IpvsTracer};
use kp_netlink::ipvs::{Destination, Service};

/// What the dataplane plans at its first sync of the fixture, with the settings of the
/// real-kernel test.
fn planner() -> Planner {
    planner_for(&kp_flows::node_context())
}

fn planner_for(node: &NodeContext) -> Planner {
    let state = kp_flows::state();
    let mut planner = Planner::new(&IpFamily::ALL);
    let mut delta = planner.untracked();
    planner.set_all(
        state.service_keys().map(|k| (k, state.service_state(k))),
        &node.node_ips,
        node,
        &Config::new("rr", 0, Vec::new()).expect("config"),
        &mut delta,
    );
    planner
}

fn config(family: IpFamily) -> PlanConfig {
    let mut c = PlanConfig::new(family);
    c.masquerade_bit = 14;
    c
}

fn tracer(planner: &Planner) -> IpvsTracer {
    IpvsTracer::planned(
        planner,
        &kp_flows::node_addresses(),
        config,
        &kp_flows::node_context(),
        Some(kp_flows::ingress()),
    )
    .expect("the planned chains load")
}

#[test]
fn every_flow_row_passes_through_the_planned_chains_sets_and_virtual_servers() {
    let planner = planner();
    let tracer = tracer(&planner);
    let failures = kp_flows::check_tracer(&tracer);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Every row's trace is consistent over its branches, not just the merged verdict.
    for row in kp_flows::cases() {
        tracer
            .trace_all(&row.packet)
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
    }
}

/// The same planned chains over another IPVS and other sets: a tracer that could not fail
/// would pass these too.
fn tracer_over(planner: &Planner, held: IpvsNode) -> IpvsTracer {
    IpvsTracer::planned_over(
        planner,
        &kp_flows::node_addresses(),
        config,
        &kp_flows::node_context(),
        Some(kp_flows::ingress()),
        held,
    )
    .expect("the planned chains load")
}

fn planned_virtual_servers(planner: &Planner) -> Vec<(Service, Vec<Destination>)> {
    IpvsNode::planned(planner)
        .virtual_servers()
        .values()
        .cloned()
        .collect()
}

#[test]
fn rows_fail_without_the_virtual_servers_their_real_servers_or_the_masquerade_set() {
    let planner = planner();
    let failing = |node: IpvsNode| kp_flows::check_tracer(&tracer_over(&planner, node));
    assert!(failing(IpvsNode::new(
        planner.sets().to_vec(),
        planned_virtual_servers(&planner)
    ))
    .is_empty());

    // No virtual servers: what IPVS would balance is delivered to the node untouched.
    let none = failing(IpvsNode::new(planner.sets().to_vec(), Vec::new()));
    assert!(
        none.iter()
            .any(|f| f.starts_with("pod to ClusterIP spreads over all endpoints")),
        "{none:?}"
    );

    // Every real server drained (weight 0): new connections are refused.
    let drained: Vec<_> = planned_virtual_servers(&planner)
        .into_iter()
        .map(|(s, mut d)| {
            d.iter_mut().for_each(|d| d.weight = 0);
            (s, d)
        })
        .collect();
    let drained = failing(IpvsNode::new(planner.sets().to_vec(), drained));
    assert!(
        drained.iter().any(|f| f.contains("got  Reject")),
        "{drained:?}"
    );

    // KUBE-CLUSTER-IP empty (its rules are still there): an external client's connection to a
    // ClusterIP is not masqueraded, and the VIP port filter rejects it.
    let mut sets = planner.sets().to_vec();
    for s in &mut sets {
        s.clear(SetName::ClusterIp);
    }
    let unmarked = failing(IpvsNode::new(sets, planned_virtual_servers(&planner)));
    assert!(
        unmarked
            .iter()
            .any(|f| f.starts_with("external client to ClusterIP is masqueraded")),
        "{unmarked:?}"
    );
}

#[test]
fn a_set_lookup_takes_the_packet_fields_its_directions_name_in_the_set_types_order() {
    use kp_iptables_test::tracer::{Beyond as _, Probe, SetSide::*};
    let mut sets = Sets::new(IpFamily::V4);
    let ip = |s: &str| -> std::net::IpAddr { s.parse().unwrap() };
    let tcp = kp_core::model::Protocol::Tcp;
    sets.insert(
        SetName::LoopBack,
        Entry::IpPortIp(ip("10.244.1.11"), tcp, 8080, ip("10.244.1.11")),
    );
    sets.insert(
        SetName::LoadBalancerSourceCidr,
        Entry::IpPortNet(
            ip("203.0.113.10"),
            tcp,
            80,
            "198.51.100.0/24".parse().unwrap(),
        ),
    );
    sets.insert(SetName::NodePortTcp, Entry::Port(30080));
    let node = IpvsNode::new(vec![sets], Vec::new());
    let probe = |src: &str, dst: &str, dport: u16| Probe {
        src: ip(src),
        dst: ip(dst),
        protocol: tcp,
        sport: kp_iptables_test::tracer::SOURCE_PORT,
        dport,
        mark: 0,
    };
    let hairpin = probe("10.244.1.11", "10.244.1.11", 8080);
    assert!(node.set_contains("KUBE-LOOP-BACK", &[Dst, Dst, Src], &hairpin));
    assert!(!node.set_contains(
        "KUBE-LOOP-BACK",
        &[Dst, Dst, Src],
        &probe("10.244.1.12", "10.244.1.11", 8080)
    ));
    let lb = probe("198.51.100.7", "203.0.113.10", 80);
    assert!(node.set_contains("KUBE-LOAD-BALANCER-SOURCE-CIDR", &[Dst, Dst, Src], &lb));
    assert!(!node.set_contains(
        "KUBE-LOAD-BALANCER-SOURCE-CIDR",
        &[Dst, Dst, Src],
        &probe("198.51.101.7", "203.0.113.10", 80)
    ));
    // A bitmap of ports takes one direction: the destination port here, the source port not.
    assert!(node.set_contains(
        "KUBE-NODE-PORT-TCP",
        &[Dst],
        &probe("192.0.2.2", "192.0.2.1", 30080)
    ));
    assert!(!node.set_contains(
        "KUBE-NODE-PORT-TCP",
        &[Src],
        &probe("192.0.2.2", "192.0.2.1", 30080)
    ));
    // Another family's set, or one that does not exist, holds nothing.
    assert!(!node.set_contains("KUBE-6-LOOP-BACK", &[Dst, Dst, Src], &hairpin));
    assert!(!node.set_contains("KUBE-NO-SUCH-SET", &[Dst], &hairpin));
}

/// Detect-local by interface (the chains match `-i`, and the `Local` policies' mangle rules
/// too): every row passes with each form, as with the cluster CIDRs.
#[test]
fn every_flow_row_passes_with_detect_local_by_interface() {
    kp_flows::check_detect_local_by_interface(|detect, links| {
        let node = kp_flows::node_context_with(detect);
        let planner = planner_for(&node);
        IpvsTracer::planned(
            &planner,
            &kp_flows::node_addresses(),
            config,
            &node,
            Some(links),
        )
        .expect("the planned chains load")
    });
}
