use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_core::flow::{Origin, Verdict};
use kp_core::model::ServicePort;
use kp_core::track::ProxyState;

use super::*;

#[test]
fn row_names_are_unique() {
    let mut seen = BTreeSet::new();
    for case in cases() {
        assert!(seen.insert(case.name), "duplicate row name: {}", case.name);
    }
}

/// Every Service port, with what its endpoint selection says.
fn ports(state: &ProxyState) -> Vec<kp_core::track::ServicePortState> {
    state
        .service_keys()
        .flat_map(|k| state.service_state(k))
        .collect()
}

fn reaches(port: &ServicePort, dst: IpAddr, dport: u16) -> bool {
    let addressed = port
        .cluster_ips
        .iter()
        .chain(&port.external_ips)
        .chain(&port.load_balancer_ips)
        .any(|ip| *ip == dst);
    (addressed && port.port == dport) || port.node_port == Some(dport)
}

#[test]
fn every_fixture_service_is_reached_by_some_row() {
    let state = state();
    let cases = cases();
    for s in ports(&state) {
        assert!(
            cases
                .iter()
                .any(|c| reaches(&s.port, c.packet.dst, c.packet.dport)),
            "no row reaches {}",
            s.port.name
        );
    }
}

/// The ClusterIP rows from pods name exactly the endpoints the core selects for internal
/// traffic: the fixture holds what the row names claim (a typo in an address or a condition
/// would show here first, not as a puzzling dataplane failure).
#[test]
fn clusterip_rows_from_pods_agree_with_the_fixture_selection() {
    let state = state();
    let ports = ports(&state);
    let mut checked = 0;
    for case in cases() {
        if case.packet.origin != Origin::Pod {
            continue;
        }
        let Some(s) = ports.iter().find(|s| {
            s.port.cluster_ips.contains(&case.packet.dst)
                && s.port.port == case.packet.dport
                && s.port.name.protocol == case.packet.protocol
        }) else {
            continue;
        };
        let family = kp_core::model::IpFamily::of(&case.packet.dst);
        let internal: BTreeSet<(IpAddr, u16)> = s
            .endpoints
            .internal(&s.port)
            .iter()
            .filter(|e| kp_core::model::IpFamily::of(&e.ip) == family)
            .map(|e| (e.ip, e.port))
            .collect();
        match expected_verdict(&case) {
            Verdict::Dnat {
                endpoints,
                affinity,
                ..
            } => {
                assert_eq!(endpoints, internal, "{}", case.name);
                assert_eq!(affinity, s.port.session_affinity_timeout, "{}", case.name);
            }
            Verdict::Reject => assert!(
                internal.is_empty() && !s.endpoints.has_any_for(family),
                "{}: rejects, yet the port has endpoints",
                case.name
            ),
            Verdict::Drop => assert!(
                internal.is_empty() && s.endpoints.has_any_for(family),
                "{}: drops, so endpoints must exist elsewhere",
                case.name
            ),
            Verdict::Untouched => panic!("{}: a Service port is never untouched", case.name),
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} rows checked");
}

#[test]
fn rows_that_need_the_other_node_are_marked() {
    for case in cases() {
        let remote = matches!(&case.expect, Expect::Pods { pods, .. }
            if pods.iter().any(|p| p.starts_with("remote-")));
        assert_eq!(case.needs_second_node, remote, "{}", case.name);
    }
    assert!(cases().iter().any(|c| c.needs_sctp()));
}

#[test]
fn the_table_config_serves_node_ports_on_both_primary_addresses_only() {
    let ctx = node_context();
    let want: Vec<String> = vec![format!("{NODE_IP}/32"), format!("{NODE_IP6}/128")];
    let got: Vec<String> = ctx
        .node_port_addresses
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(got, want);
    assert_eq!(ctx.local_cidrs.len(), 2);
}

#[test]
fn sources_follow_the_destination_family() {
    let by_name = |name: &str| {
        cases()
            .into_iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no row {name}"))
    };
    let v6 = by_name("IPv6 NodePort on the node's primary IPv6 address, masqueraded");
    assert_eq!(v6.packet.src, CLIENT6.parse::<IpAddr>().unwrap());
    let lo = by_name("localhost NodePorts are off: 127.0.0.1 is left alone");
    assert_eq!(lo.packet.src, lo.packet.dst);
    let pod6 = by_name("single-stack IPv6 ClusterIP");
    assert_eq!(
        pod6.packet.src,
        "fd00:10:244:1::14".parse::<IpAddr>().unwrap()
    );
}

#[test]
fn a_mode_without_sctp_is_held_to_rejecting_the_sctp_rows_and_to_every_other_row_as_is() {
    let mut sctp_rows = 0;
    for case in cases() {
        let all = case.for_mode(Support::ALL);
        let no_sctp = case.for_mode(Support::NO_SCTP);
        assert_eq!(all.expect, case.expect, "{}", case.name);
        if case.needs_sctp() {
            sctp_rows += 1;
            assert_ne!(case.expect, Expect::Reject, "{}", case.name);
            assert_eq!(no_sctp.expect, Expect::Reject, "{}", case.name);
        } else {
            assert_eq!(no_sctp.expect, case.expect, "{}", case.name);
        }
    }
    assert!(sctp_rows > 0);
}

/// What a mode declares changes only the rows it names, and each in the one way documented.
#[test]
fn declared_support_changes_only_the_rows_it_covers() {
    for case in cases() {
        assert_eq!(
            case.for_mode(Support::ALL).expect,
            case.expect,
            "{}",
            case.name
        );
        let lb = case.for_mode(Support::SOCKET_LB);
        match (&case.packet.origin, &lb.expect) {
            (Origin::External, Expect::Untouched) => {}
            (Origin::External, other) => panic!("{}: {other:?}", case.name),
            (_, Expect::Pods { masquerade, .. }) => {
                assert_eq!(*masquerade, case.from == "node", "{}", case.name);
            }
            (_, other) => assert_eq!(*other, case.expect, "{}", case.name),
        }
        let userspace = case.for_mode(Support::NO_SCTP);
        if case.needs_sctp() {
            assert_eq!(userspace.expect, Expect::Reject);
        } else {
            assert_eq!(userspace.expect, case.expect, "{}", case.name);
        }
    }
    assert!(!Support::SOCKET_LB.reason.is_empty() && Support::ALL.reason.is_empty());
}

/// The ebpf mode with its tc path: rows from the node and its pods as socket load balancing
/// declares them; rows from outside as upstream (masquerade included), except that a reject
/// is a drop and SCTP is left alone.
#[test]
fn socket_lb_with_the_tc_path_changes_only_rejects_and_sctp_from_outside() {
    let mut outside = 0;
    for case in cases() {
        let tc = case.for_mode(Support::SOCKET_LB_TC);
        if case.packet.origin != Origin::External {
            assert_eq!(
                tc.expect,
                case.for_mode(Support::SOCKET_LB).expect,
                "{}",
                case.name
            );
            continue;
        }
        outside += 1;
        match (&case.expect, &tc.expect) {
            _ if case.needs_sctp() => assert_eq!(tc.expect, Expect::Untouched, "{}", case.name),
            (Expect::Reject, got) => assert_eq!(*got, Expect::Drop, "{}", case.name),
            (want, got) => assert_eq!(got, want, "{}", case.name),
        }
    }
    assert!(outside >= 10, "{outside} rows from outside");
    // A synthetic reject and SCTP row from outside, as the table has none today.
    let mut reject = cases()
        .into_iter()
        .find(|c| c.packet.origin == Origin::External)
        .unwrap();
    reject.expect = Expect::Reject;
    assert_eq!(reject.for_mode(Support::SOCKET_LB_TC).expect, Expect::Drop);
    assert_eq!(reject.for_mode(Support::ALL).expect, Expect::Reject);
    let mut sctp = reject.clone();
    sctp.packet.protocol = kp_core::model::Protocol::Sctp;
    assert_eq!(
        sctp.for_mode(Support::SOCKET_LB_TC).expect,
        Expect::Untouched
    );
    assert_eq!(sctp.for_mode(Support::NO_SCTP).expect, Expect::Reject);
    // Masquerade from outside survives (unlike SOCKET_LB's rule for the node and its pods).
    let masq = cases()
        .into_iter()
        .find(|c| {
            c.packet.origin == Origin::External
                && matches!(
                    c.expect,
                    Expect::Pods {
                        masquerade: true,
                        ..
                    }
                )
        })
        .unwrap();
    assert_eq!(masq.for_mode(Support::SOCKET_LB_TC).expect, masq.expect);
    assert!(!masq.changed_for(Support::SOCKET_LB_TC));
    assert!(!Support::SOCKET_LB_TC.reason.is_empty());
}

/// The links of detect-local by interface put every pod row on an interface the detect-local
/// matches, and every other row on one it does not (or none, from the node).
#[test]
fn interface_links_tell_pod_rows_from_the_others() {
    let forms = crate::interface_detect_locals();
    assert_eq!(forms.len(), 2);
    for (detect, links) in forms {
        let local = node_context_with(&detect)
            .local_interface
            .expect("an interface form");
        for case in cases() {
            let iif = links.interface(&case.packet);
            let from_pod = case.packet.origin == Origin::Pod;
            assert_eq!(local.matches(iif), from_pod, "{detect:?}: {}", case.name);
            if case.packet.origin == Origin::Node {
                assert_eq!(iif, None, "{}", case.name);
            }
        }
    }
    let pod_1 = cases()
        .into_iter()
        .find(|c| c.from == "pod-1")
        .expect("a row from pod-1");
    assert_eq!(crate::ingress().interface(&pod_1.packet), Some("veth1"));
    assert_eq!(
        crate::ingress_bridged().interface(&pod_1.packet),
        Some(crate::POD_BRIDGE)
    );
    let client = cases()
        .into_iter()
        .find(|c| c.from == "client")
        .expect("a row from the client");
    assert_eq!(crate::ingress().interface(&client.packet), Some("eth0"));
}
