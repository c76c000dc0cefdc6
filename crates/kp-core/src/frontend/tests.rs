use super::*;

use std::collections::BTreeSet;

use crate::model::{Protocol, ServiceKey, ServicePortName};
use crate::select::select;

// The ClusterIPs are 10.96.0.1 and fd00:10:96::1; external IP 203.0.113.10, LoadBalancer IP
// 198.51.100.10 (and 2001:db8:100::10); endpoints in 10.244.1.0/24 (this node) and
// 10.244.2.0/24 (another), and fd00:10:244:1::/64 (this node); this node is 192.0.2.1.

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn net(s: &str) -> IpNet {
    s.parse().expect("network")
}

fn port() -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: ServiceKey::new("web", "api"),
            port: "http".into(),
            protocol: Protocol::Tcp,
        },
        cluster_ips: vec![ip("10.96.0.1")],
        port: 80,
        node_port: None,
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        load_balancer_source_ranges: Vec::new(),
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: false,
        health_check_node_port: None,
    }
}

fn load_balancer() -> ServicePort {
    ServicePort {
        node_port: Some(30080),
        external_ips: vec![ip("203.0.113.10")],
        load_balancer_ips: vec![ip("198.51.100.10")],
        ..port()
    }
}

fn ep(addr: &str, local: bool, ready: bool) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 8080,
        ready,
        serving: true,
        terminating: !ready,
        is_local: local,
        zone_hints: None::<BTreeSet<String>>,
    }
}

fn endpoints() -> Vec<Endpoint> {
    vec![
        ep("10.244.1.5", true, true),
        ep("10.244.2.5", false, true),
        ep("10.244.2.6", false, true),
    ]
}

fn selected(port: &ServicePort, eps: &[Endpoint]) -> SelectedEndpoints {
    select(port, eps, &crate::model::NodeInfo::default())
}

fn addrs(eps: &[&Endpoint]) -> Vec<String> {
    eps.iter().map(|e| e.ip.to_string()).collect()
}

#[test]
fn a_load_balancer_port_has_its_frontends_in_kubernetes_order() {
    let port = load_balancer();
    let sel = selected(&port, &endpoints());
    let fronts = Frontends::new(&port, &sel, IpFamily::V4);
    let listed: Vec<(FrontendKind<'_>, Option<IpAddr>, u16)> =
        fronts.iter().map(|f| (f.kind, f.address, f.port)).collect();
    let ranges = SourceRanges {
        all: &[],
        family: IpFamily::V4,
    };
    assert_eq!(
        listed,
        vec![
            (FrontendKind::ClusterIp, Some(ip("10.96.0.1")), 80),
            (FrontendKind::ExternalIp, Some(ip("203.0.113.10")), 80),
            (
                FrontendKind::LoadBalancer {
                    source_ranges: ranges
                },
                Some(ip("198.51.100.10")),
                80
            ),
            (FrontendKind::NodePort, None, 30080),
        ]
    );
    for f in fronts.iter() {
        assert_eq!(f.protocol, Protocol::Tcp);
        assert_eq!(f.family, IpFamily::V4);
        assert_eq!(f.policy, TrafficPolicy::Cluster);
        assert_eq!(addrs(f.endpoints).len(), 3);
        assert_eq!(f.no_endpoints(), None);
        assert!(f.short_circuit.is_empty());
        let want = if f.is_external() {
            Masquerade::Always
        } else {
            Masquerade::NotFromPods
        };
        assert_eq!(f.masquerade, want);
    }
}

#[test]
fn the_other_family_sees_only_its_addresses_and_the_node_port() {
    let port = ServicePort {
        cluster_ips: vec![ip("10.96.0.1"), ip("fd00:10:96::1")],
        load_balancer_ips: vec![ip("198.51.100.10"), ip("2001:db8:100::10")],
        ..load_balancer()
    };
    let mut eps = endpoints();
    eps.push(ep("fd00:10:244:1::5", true, true));
    let sel = selected(&port, &eps);
    let v6 = Frontends::new(&port, &sel, IpFamily::V6);
    assert_eq!(v6.cluster_ip(), Some(ip("fd00:10:96::1")));
    let listed: Vec<Option<IpAddr>> = v6.iter().map(|f| f.address).collect();
    assert_eq!(
        listed,
        vec![
            Some(ip("fd00:10:96::1")),
            Some(ip("2001:db8:100::10")),
            None
        ]
    );
    for f in v6.iter() {
        assert_eq!(addrs(f.endpoints), vec!["fd00:10:244:1::5"]);
    }
    // A single-stack IPv4 port still lists its NodePort in IPv6, with no endpoints: rejected.
    let port = load_balancer();
    let sel = selected(&port, &endpoints());
    let v6 = Frontends::new(&port, &sel, IpFamily::V6);
    assert_eq!(v6.cluster_ip(), None);
    let only: Vec<Frontend<'_>> = v6.iter().collect();
    assert_eq!(only.len(), 1);
    assert_eq!(only[0].kind, FrontendKind::NodePort);
    assert_eq!(only[0].no_endpoints(), Some(NoEndpoints::Reject));
}

#[test]
fn external_local_policy_uses_local_endpoints_and_short_circuits_to_all() {
    let port = ServicePort {
        external_traffic_local: true,
        session_affinity_timeout: Some(600),
        ..load_balancer()
    };
    let sel = selected(&port, &endpoints());
    let fronts = Frontends::new(&port, &sel, IpFamily::V4);
    assert_eq!(fronts.external_policy(), TrafficPolicy::Local);
    for f in fronts.iter() {
        assert_eq!(f.affinity, Some(600));
        if f.is_external() {
            assert_eq!(f.policy, TrafficPolicy::Local);
            assert_eq!(f.masquerade, Masquerade::FromNode);
            assert_eq!(addrs(f.endpoints), vec!["10.244.1.5"]);
            assert_eq!(addrs(f.short_circuit).len(), 3);
        } else {
            assert_eq!(f.policy, TrafficPolicy::Cluster);
            assert_eq!(addrs(f.endpoints).len(), 3);
            assert!(f.short_circuit.is_empty());
        }
    }
}

#[test]
fn local_policy_without_local_endpoints_drops_and_without_any_rejects() {
    let port = ServicePort {
        internal_traffic_local: true,
        external_traffic_local: true,
        ..load_balancer()
    };
    let remote = vec![ep("10.244.2.5", false, true)];
    let sel = selected(&port, &remote);
    let fronts = Frontends::new(&port, &sel, IpFamily::V4);
    for f in fronts.iter() {
        assert_eq!(f.no_endpoints(), Some(NoEndpoints::Drop), "{:?}", f.kind);
    }
    let none = selected(&port, &[]);
    let fronts = Frontends::new(&port, &none, IpFamily::V4);
    assert!(!fronts.has_endpoints());
    for f in fronts.iter() {
        assert_eq!(f.no_endpoints(), Some(NoEndpoints::Reject), "{:?}", f.kind);
    }
}

#[test]
fn terminating_endpoints_are_the_fallback_per_policy() {
    let port = ServicePort {
        external_traffic_local: true,
        ..load_balancer()
    };
    // Ready endpoints elsewhere only; a terminating one here.
    let eps = vec![ep("10.244.2.5", false, true), ep("10.244.1.5", true, false)];
    let sel = selected(&port, &eps);
    let fronts = Frontends::new(&port, &sel, IpFamily::V4);
    assert_eq!(addrs(fronts.cluster_endpoints()), vec!["10.244.2.5"]);
    assert_eq!(addrs(fronts.local_endpoints()), vec!["10.244.1.5"]);
}

#[test]
fn internal_local_without_external_frontends_leaves_the_cluster_set_unused() {
    // Reachable from outside through IPv6 only: IPv4 has no external frontend, so the cluster
    // set is not used there.
    let port = ServicePort {
        internal_traffic_local: true,
        external_ips: vec![ip("2001:db8:100::10")],
        ..port()
    };
    let sel = selected(&port, &endpoints());
    assert!(!sel.cluster.is_empty());
    let fronts = Frontends::new(&port, &sel, IpFamily::V4);
    assert!(!fronts.externally_accessible());
    assert!(fronts.cluster_endpoints().is_empty());
    assert_eq!(addrs(fronts.local_endpoints()), vec!["10.244.1.5"]);
    assert_eq!(fronts.iter().count(), 1);
}

#[test]
fn source_ranges_restrict_load_balancer_frontends_and_may_admit_the_node() {
    let port = ServicePort {
        load_balancer_source_ranges: vec![net("192.0.2.0/24"), net("2001:db8::/64")],
        ..load_balancer()
    };
    let sel = selected(&port, &endpoints());
    let fronts = Frontends::new(&port, &sel, IpFamily::V4);
    let node = NodeContext {
        node_ips: vec![ip("192.0.2.1")],
        ..NodeContext::default()
    };
    let elsewhere = NodeContext {
        node_ips: vec![ip("198.51.100.1")],
        ..NodeContext::default()
    };
    let mut seen = 0;
    for f in fronts.iter() {
        match f.kind {
            FrontendKind::LoadBalancer { source_ranges } => {
                seen += 1;
                assert!(source_ranges.restricted());
                let v4: Vec<&IpNet> = source_ranges.of_family().collect();
                assert_eq!(v4, vec![&net("192.0.2.0/24")]);
                assert!(f.admits_node(&node));
                assert!(!f.admits_node(&elsewhere));
            }
            _ => {
                assert!(f.source_ranges().is_none());
                assert!(!f.admits_node(&node));
            }
        }
    }
    assert_eq!(seen, 1);
    // Ranges of the other family only: restricted, with none of this family.
    let port = ServicePort {
        load_balancer_source_ranges: vec![net("2001:db8::/64")],
        ..load_balancer()
    };
    let sel = selected(&port, &endpoints());
    let fronts = Frontends::new(&port, &sel, IpFamily::V4);
    let lb = fronts
        .iter()
        .find_map(|f| f.source_ranges())
        .expect("restricted");
    assert_eq!(lb.of_family().count(), 0);
}

#[test]
fn frontends_of_a_service_port_state_match_new() {
    let port = std::sync::Arc::new(load_balancer());
    let sps = ServicePortState {
        endpoints: selected(&port, &endpoints()),
        port: port.clone(),
    };
    let sel = selected(&port, &endpoints());
    let of = Frontends::of(&sps, IpFamily::V4);
    let new = Frontends::new(&port, &sel, IpFamily::V4);
    assert!(of.iter().eq(new.iter()));
    assert_eq!(of.iter().count(), 4);
}

mod generated {
    use super::*;
    use proptest::prelude::*;

    fn arb_port() -> impl Strategy<Value = ServicePort> {
        (
            (any::<bool>(), any::<bool>(), any::<bool>()),
            (0usize..3, 0usize..3, 0usize..3),
            (any::<bool>(), any::<bool>(), any::<bool>()),
        )
            .prop_map(
                |((dual, node_port, affinity), (ext, lb, ranges), (itp, etp, v6_only))| {
                    let v4 = ["203.0.113.10", "198.51.100.10"];
                    let v6 = ["2001:db8:100::10", "2001:db8:100::20"];
                    let pick = |n: usize| -> Vec<IpAddr> {
                        v4.iter()
                            .chain(v6.iter())
                            .take(n * 2)
                            .map(|s| ip(s))
                            .collect()
                    };
                    let mut cluster_ips = vec![ip("10.96.0.1"), ip("fd00:10:96::1")];
                    if !dual {
                        cluster_ips.remove(usize::from(!v6_only));
                    }
                    ServicePort {
                        cluster_ips,
                        node_port: node_port.then_some(30080),
                        external_ips: pick(ext),
                        load_balancer_ips: pick(lb),
                        load_balancer_source_ranges: [net("192.0.2.0/24"), net("2001:db8::/64")]
                            [..ranges.min(2)]
                            .to_vec(),
                        session_affinity_timeout: affinity.then_some(300),
                        internal_traffic_local: itp,
                        external_traffic_local: etp,
                        ..port()
                    }
                },
            )
    }

    fn arb_endpoints() -> impl Strategy<Value = Vec<Endpoint>> {
        prop::collection::vec((0u8..6, any::<bool>(), any::<bool>(), any::<bool>()), 0..8).prop_map(
            |eps| {
                let mut out: Vec<Endpoint> = Vec::new();
                for (i, local, ready, v6) in eps {
                    let node = if local { 1 } else { 2 };
                    let addr = if v6 {
                        format!("fd00:10:244:{node}::{i}")
                    } else {
                        format!("10.244.{node}.{i}")
                    };
                    if out.iter().all(|e| e.ip != ip(&addr)) {
                        out.push(ep(&addr, local, ready));
                    }
                }
                out
            },
        )
    }

    proptest! {
        #[test]
        fn frontends_follow_the_selection_one_family_at_a_time(
            port in arb_port(),
            eps in arb_endpoints(),
        ) {
            let sel = selected(&port, &eps);
            for family in IpFamily::ALL {
                let fronts = Frontends::new(&port, &sel, family);
                let listed: Vec<Frontend<'_>> = fronts.iter().collect();
                let node_ports = listed.iter().filter(|f| f.kind == FrontendKind::NodePort).count();
                prop_assert_eq!(node_ports, usize::from(port.node_port.is_some()));
                for f in &listed {
                    prop_assert_eq!(f.family, family);
                    prop_assert!(f.address.is_none_or(|a| IpFamily::of(&a) == family));
                    prop_assert_eq!(f.address.is_none(), f.kind == FrontendKind::NodePort);
                    let pool = match f.policy {
                        TrafficPolicy::Cluster => &sel.cluster,
                        TrafficPolicy::Local => &sel.local,
                    };
                    for e in f.endpoints {
                        prop_assert_eq!(IpFamily::of(&e.ip), family);
                        prop_assert!(pool.contains(e));
                    }
                    for e in f.short_circuit {
                        prop_assert!(sel.cluster.contains(e));
                    }
                    prop_assert!(f.short_circuit.is_empty() || (f.is_external() && f.policy == TrafficPolicy::Local));
                    let want = match (f.endpoints.is_empty(), sel.has_any_for(family)) {
                        (false, _) => None,
                        (true, true) => Some(NoEndpoints::Drop),
                        (true, false) => Some(NoEndpoints::Reject),
                    };
                    prop_assert_eq!(f.no_endpoints(), want);
                    // Drop only ever comes from a Local policy.
                    if f.no_endpoints() == Some(NoEndpoints::Drop) {
                        prop_assert_eq!(f.policy, TrafficPolicy::Local);
                    }
                }
            }
        }
    }
}
