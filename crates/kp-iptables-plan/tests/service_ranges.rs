//! ClusterIPs from two unrelated Service ranges (clusters with several Service CIDRs): the
//! early `RETURN` of filter `KUBE-SERVICES` must never become `! -d 0.0.0.0/0` (iptables-nft
//! refuses a negated zero-length prefix, so every restore of the filter table would fail), and
//! traffic to an unused port of a ClusterIP in either range must still be rejected while every
//! other destination passes.

use kp_core::flow::Tracer;
use kp_core::flow::{Origin, Packet, Verdict};
use kp_core::model::{IpFamily, Protocol};
use kp_core::track::{Object, ProxyState};
use kp_iptables_plan::{PlanConfig, Planner};
use kp_iptables_test::IptablesTracer;
use serde_json::json;

mod common;

/// A Service `name` with ClusterIP `ip` (of either family) on TCP 80, and its EndpointSlice with
/// one ready endpoint `ep` on this node, on TCP 8080.
fn service(name: &str, ip: &str, ep: &str) -> [Object; 2] {
    let v6 = ip.contains(':');
    let family = if v6 { "IPv6" } else { "IPv4" };
    let svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "ranges"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "ipFamilies": [family],
            "ports": [{"protocol": "TCP", "port": 80, "targetPort": 8080}]},
    });
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-x"), "namespace": "ranges",
            "labels": {"kubernetes.io/service-name": name}},
        "addressType": family,
        "ports": [{"name": "", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": [ep], "conditions": {"ready": true}, "nodeName": kp_flows::NODE}],
    });
    [
        Object::Service(Box::new(serde_json::from_value(svc).unwrap())),
        Object::EndpointSlice(Box::new(serde_json::from_value(slice).unwrap())),
    ]
}

/// The flow fixture (ClusterIPs in 10.96.0.0/16 and fd00:10:96::/112) plus a Service in
/// 192.168.50.0/24 and one in 2001:db8:50::/112: no network but the whole address space holds
/// the ClusterIPs of either family.
fn two_ranges() -> ProxyState {
    let mut objects = kp_flows::objects();
    objects.extend(service("second", "192.168.50.10", "10.244.1.31"));
    objects.extend(service("second6", "2001:db8:50::10", "fd00:10:244:1::31"));
    kp_flows::load(kp_flows::NODE, objects)
}

/// Whether a rule argument list negates a zero-length prefix (`! -d 0.0.0.0/0`, `! -s ::/0`).
fn negates_zero_prefix(line: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .windows(3)
        .any(|w| w[0] == "!" && (w[1] == "-s" || w[1] == "-d") && w[2].ends_with("/0"))
}

fn from_pod(family: IpFamily, dst: &str, dport: u16) -> Packet {
    let src = match family {
        IpFamily::V4 => "10.244.1.14",
        IpFamily::V6 => "fd00:10:244:1::14",
    };
    Packet {
        origin: Origin::Pod,
        src: src.parse().unwrap(),
        protocol: Protocol::Tcp,
        dst: dst.parse().unwrap(),
        dport,
    }
}

#[test]
fn clusterips_from_two_unrelated_ranges_never_negate_a_zero_prefix_and_unused_ports_are_rejected() {
    let state = two_ranges();
    let node = kp_flows::node_context();
    let mut tracer = IptablesTracer::new(kp_flows::node_addresses());
    for family in IpFamily::ALL {
        let mut planner = Planner::new(PlanConfig::new(family));
        let text = planner.full(&state, &node).text();
        let negated: Vec<&str> = text.lines().filter(|l| negates_zero_prefix(l)).collect();
        assert!(
            negated.is_empty(),
            "{family:?}: iptables-nft refuses these rules:\n{}",
            negated.join("\n")
        );
        tracer
            .apply(family, &text)
            .unwrap_or_else(|e| panic!("{family:?}: {e}"));
        tracer.apply(family, &common::jumps(&planner)).unwrap();
    }

    let endpoint = |ip: &str| Verdict::Dnat {
        endpoints: [(ip.parse().unwrap(), 8080)].into_iter().collect(),
        masquerade: false,
        affinity: None,
    };
    let cases = [
        // An unused port of a ClusterIP in either range: rejected.
        (from_pod(IpFamily::V4, "10.96.0.10", 9999), Verdict::Reject),
        (
            from_pod(IpFamily::V4, "192.168.50.10", 9999),
            Verdict::Reject,
        ),
        (
            from_pod(IpFamily::V6, "fd00:10:96::10", 9999),
            Verdict::Reject,
        ),
        (
            from_pod(IpFamily::V6, "2001:db8:50::10", 9999),
            Verdict::Reject,
        ),
        // The Service port of the second range's ClusterIP: its endpoint.
        (
            from_pod(IpFamily::V4, "192.168.50.10", 80),
            endpoint("10.244.1.31"),
        ),
        (
            from_pod(IpFamily::V6, "2001:db8:50::10", 80),
            endpoint("fd00:10:244:1::31"),
        ),
        // An unallocated address of the fixture's ServiceCIDR (10.96.0.0/16, fd00:10:96::/112):
        // dropped. Anything else not addressed to a ClusterIP, in the second range (no
        // ServiceCIDR holds it) or outside both: left alone.
        (from_pod(IpFamily::V4, "10.96.0.11", 80), Verdict::Drop),
        (
            from_pod(IpFamily::V4, "192.168.50.11", 80),
            Verdict::Untouched,
        ),
        (from_pod(IpFamily::V4, "8.8.8.8", 53), Verdict::Untouched),
        (from_pod(IpFamily::V6, "fd00:10:96::11", 80), Verdict::Drop),
        (
            from_pod(IpFamily::V6, "2001:db8:50::11", 80),
            Verdict::Untouched,
        ),
        (
            from_pod(IpFamily::V6, "2001:4860::8888", 53),
            Verdict::Untouched,
        ),
    ];
    for (packet, want) in cases {
        assert_eq!(tracer.trace(&packet), want, "{packet}");
    }
    // The fixture's own rows are unaffected.
    let failures = kp_flows::check_tracer(&tracer);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
