use super::*;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;

use crate::model::{Protocol, ServiceKey, ServicePortName};

// Endpoints live in 10.244.0.0/24 and fd00:244::/64; the ClusterIP is 10.96.0.1; the
// NodePort is 30080. This node is in zone "zone-a" unless a test says otherwise.

const ZONE: &str = "zone-a";

/// A ClusterIP-only port with Cluster policies.
fn cluster_ip_port() -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: ServiceKey::new("web", "api"),
            port: "http".into(),
            protocol: Protocol::Tcp,
        },
        cluster_ips: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1))],
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

fn internal_local_port() -> ServicePort {
    ServicePort {
        internal_traffic_local: true,
        ..cluster_ip_port()
    }
}

/// A NodePort port with `externalTrafficPolicy: Local`.
fn external_local_port() -> ServicePort {
    ServicePort {
        node_port: Some(30080),
        external_traffic_local: true,
        ..cluster_ip_port()
    }
}

fn node_in(zone: Option<&str>) -> NodeInfo {
    NodeInfo {
        name: "node-a".into(),
        exists: true,
        zone: zone.map(String::from),
        ..NodeInfo::default()
    }
}

fn node() -> NodeInfo {
    node_in(Some(ZONE))
}

fn endpoint(n: u8, ready: bool, serving: bool, terminating: bool) -> Endpoint {
    Endpoint {
        ip: IpAddr::V4(Ipv4Addr::new(10, 244, 0, n)),
        port: 8080,
        ready,
        serving,
        terminating,
        is_local: false,
        zone_hints: None,
    }
}

fn ready(n: u8) -> Endpoint {
    endpoint(n, true, true, false)
}

/// Terminating but still serving: the fallback kind.
fn terminating(n: u8) -> Endpoint {
    endpoint(n, false, true, true)
}

/// Terminating and no longer serving: never used.
fn terminated(n: u8) -> Endpoint {
    endpoint(n, false, false, true)
}

fn not_ready(n: u8) -> Endpoint {
    endpoint(n, false, false, false)
}

fn local(ep: Endpoint) -> Endpoint {
    Endpoint {
        is_local: true,
        ..ep
    }
}

fn hinted(ep: Endpoint, zones: &[&str]) -> Endpoint {
    Endpoint {
        zone_hints: Some(zones.iter().map(|z| z.to_string()).collect()),
        ..ep
    }
}

fn v6(ep: Endpoint) -> Endpoint {
    let IpAddr::V4(v4) = ep.ip else { return ep };
    Endpoint {
        ip: IpAddr::V6(Ipv6Addr::new(
            0xfd00,
            0x244,
            0,
            0,
            0,
            0,
            0,
            v4.octets()[3].into(),
        )),
        ..ep
    }
}

/// Endpoints shown as `ip:port`, for readable assertions.
fn shown(eps: &[Endpoint]) -> Vec<String> {
    eps.iter().map(ToString::to_string).collect()
}

fn addrs(ns: &[u8]) -> Vec<String> {
    ns.iter().map(|n| format!("10.244.0.{n}:8080")).collect()
}

#[test]
fn ready_endpoints_serve() {
    let port = cluster_ip_port();
    let s = select(
        &port,
        &[ready(1), not_ready(2), terminating(3), ready(4)],
        &node(),
    );
    assert_eq!(shown(&s.cluster), addrs(&[1, 4]));
    assert_eq!(shown(s.internal(&port)), addrs(&[1, 4]));
    assert!(
        s.local.is_empty(),
        "the local set is unused under Cluster policies"
    );
    assert!(s.has_any);
}

#[test]
fn terminating_endpoints_serve_when_none_are_ready() {
    let port = cluster_ip_port();
    let s = select(
        &port,
        &[not_ready(1), terminating(2), terminated(3), terminating(4)],
        &node(),
    );
    assert_eq!(shown(&s.cluster), addrs(&[2, 4]));
    assert!(s.has_any);
}

#[test]
fn terminating_endpoints_are_not_used_while_one_is_ready() {
    let s = select(
        &cluster_ip_port(),
        &[terminating(1), ready(2), terminating(3)],
        &node(),
    );
    assert_eq!(shown(&s.cluster), addrs(&[2]));
}

#[test]
fn terminating_endpoints_that_stopped_serving_are_never_used() {
    let port = external_local_port();
    let s = select(&port, &[terminated(1), local(terminated(2))], &node());
    assert!(s.cluster.is_empty() && s.local.is_empty());
    assert!(!s.has_any);
}

#[test]
fn the_local_set_falls_back_to_terminating_endpoints_on_its_own() {
    // Remote endpoints are ready, the only local one is terminating: the cluster set keeps the
    // ready ones, and the local set still falls back to the local terminating one.
    let port = external_local_port();
    let s = select(&port, &[ready(1), local(terminating(2)), ready(3)], &node());
    assert_eq!(shown(&s.cluster), addrs(&[1, 3]));
    assert_eq!(shown(&s.local), addrs(&[2]));
    assert!(s.has_any);
}

#[test]
fn the_cluster_set_falls_back_even_when_the_local_set_cannot() {
    // Remote endpoints are only terminating and the local one is not serving at all: the
    // cluster set falls back to the remote ones, and the local set stays empty.
    let port = external_local_port();
    let s = select(
        &port,
        &[terminating(1), local(not_ready(2)), terminating(3)],
        &node(),
    );
    assert_eq!(shown(&s.cluster), addrs(&[1, 3]));
    assert!(s.local.is_empty());
    assert!(s.has_any);
}

#[test]
fn local_ready_endpoints_win_over_local_terminating_ones() {
    let port = internal_local_port();
    let s = select(
        &port,
        &[local(terminating(1)), local(ready(2)), ready(3)],
        &node(),
    );
    assert_eq!(shown(&s.local), addrs(&[2]));
}

#[test]
fn internal_traffic_policy_local_sends_cluster_traffic_to_local_endpoints() {
    let port = internal_local_port();
    let s = select(
        &port,
        &[local(ready(1)), ready(2), local(ready(3))],
        &node(),
    );
    assert_eq!(shown(s.internal(&port)), addrs(&[1, 3]));
    assert!(
        s.cluster.is_empty(),
        "a ClusterIP-only port with Local internal policy needs no cluster set"
    );
}

#[test]
fn internal_traffic_policy_local_without_local_endpoints_has_none_but_the_service_has_some() {
    // Upstream drops (not rejects) such traffic: has_any tells the two apart.
    let port = internal_local_port();
    let s = select(&port, &[ready(1), terminating(2)], &node());
    assert!(s.internal(&port).is_empty());
    assert!(s.has_any);
}

#[test]
fn external_traffic_policy_local_sends_external_traffic_to_local_endpoints() {
    let port = external_local_port();
    let s = select(&port, &[ready(1), local(ready(2)), ready(3)], &node());
    assert_eq!(shown(s.external(&port)), addrs(&[2]));
    // The cluster set is still computed: pods and the node itself short-circuit to it.
    assert_eq!(shown(s.internal(&port)), addrs(&[1, 2, 3]));
}

#[test]
fn external_traffic_policy_local_applies_to_load_balancer_and_external_ips_too() {
    for port in [
        ServicePort {
            load_balancer_ips: vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10))],
            external_traffic_local: true,
            ..cluster_ip_port()
        },
        ServicePort {
            external_ips: vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7))],
            external_traffic_local: true,
            ..cluster_ip_port()
        },
    ] {
        let s = select(&port, &[ready(1), local(ready(2))], &node());
        assert_eq!(shown(s.external(&port)), addrs(&[2]));
        assert_eq!(shown(s.internal(&port)), addrs(&[1, 2]));
    }
}

#[test]
fn external_traffic_policy_local_without_external_access_changes_nothing() {
    let port = ServicePort {
        external_traffic_local: true,
        ..cluster_ip_port()
    };
    let s = select(&port, &[ready(1), local(ready(2))], &node());
    assert!(s.local.is_empty());
    assert_eq!(shown(s.external(&port)), addrs(&[1, 2]));
}

#[test]
fn both_local_policies_with_external_access_use_both_sets() {
    let port = ServicePort {
        internal_traffic_local: true,
        ..external_local_port()
    };
    let s = select(&port, &[ready(1), local(ready(2))], &node());
    assert_eq!(shown(s.internal(&port)), addrs(&[2]));
    assert_eq!(shown(s.external(&port)), addrs(&[2]));
    // Still computed, for short-circuiting external addresses from inside the node.
    assert_eq!(shown(&s.cluster), addrs(&[1, 2]));
}

#[test]
fn external_traffic_policy_local_without_local_endpoints_drops_rather_than_rejects() {
    let port = external_local_port();
    let s = select(&port, &[ready(1)], &node());
    assert!(s.external(&port).is_empty());
    assert!(s.has_any);
}

#[test]
fn topology_hints_keep_cluster_traffic_in_this_zone() {
    let port = cluster_ip_port();
    let eps = [
        hinted(ready(1), &[ZONE]),
        hinted(ready(2), &["zone-b"]),
        hinted(ready(3), &["zone-b", ZONE]),
    ];
    let s = select(&port, &eps, &node());
    assert_eq!(shown(&s.cluster), addrs(&[1, 3]));
}

#[test]
fn topology_ignores_the_hints_of_endpoints_that_are_not_ready() {
    // Upstream checks hints on ready endpoints only.
    let eps = [
        hinted(ready(1), &[ZONE]),
        hinted(ready(2), &["zone-b"]),
        terminating(3),
        not_ready(4),
    ];
    let s = select(&cluster_ip_port(), &eps, &node());
    assert_eq!(shown(&s.cluster), addrs(&[1]));
}

#[test]
fn one_ready_endpoint_without_hints_switches_topology_off() {
    let eps = [
        hinted(ready(1), &[ZONE]),
        hinted(ready(2), &["zone-b"]),
        ready(3),
    ];
    let s = select(&cluster_ip_port(), &eps, &node());
    assert_eq!(shown(&s.cluster), addrs(&[1, 2, 3]));
}

#[test]
fn an_empty_hint_list_counts_as_no_hints() {
    let eps = [hinted(ready(1), &[ZONE]), hinted(ready(2), &[])];
    let s = select(&cluster_ip_port(), &eps, &node());
    assert_eq!(shown(&s.cluster), addrs(&[1, 2]));
}

#[test]
fn hints_without_an_endpoint_for_this_zone_are_ignored() {
    let eps = [hinted(ready(1), &["zone-b"]), hinted(ready(2), &["zone-c"])];
    let s = select(&cluster_ip_port(), &eps, &node());
    assert_eq!(shown(&s.cluster), addrs(&[1, 2]));
}

#[test]
fn hints_are_ignored_on_a_node_without_a_zone() {
    let eps = [hinted(ready(1), &[ZONE]), hinted(ready(2), &["zone-b"])];
    for node in [node_in(None), node_in(Some(""))] {
        let s = select(&cluster_ip_port(), &eps, &node);
        assert_eq!(shown(&s.cluster), addrs(&[1, 2]), "{node:?}");
    }
}

#[test]
fn hints_are_ignored_when_falling_back_to_terminating_endpoints() {
    let eps = [
        hinted(terminating(1), &[ZONE]),
        hinted(terminating(2), &["zone-b"]),
    ];
    let s = select(&cluster_ip_port(), &eps, &node());
    assert_eq!(shown(&s.cluster), addrs(&[1, 2]));
}

#[test]
fn hints_do_not_narrow_the_local_set() {
    let port = external_local_port();
    let eps = [
        hinted(ready(1), &[ZONE]),
        hinted(local(ready(2)), &["zone-b"]),
    ];
    let s = select(&port, &eps, &node());
    assert_eq!(shown(&s.cluster), addrs(&[1]));
    assert_eq!(shown(&s.local), addrs(&[2]));
}

#[test]
fn a_port_with_nothing_usable_has_no_endpoints_anywhere() {
    let eps = [not_ready(1), terminated(2), local(not_ready(3))];
    for port in [
        cluster_ip_port(),
        internal_local_port(),
        external_local_port(),
    ] {
        for endpoints in [&eps[..], &[]] {
            let s = select(&port, endpoints, &node());
            assert!(!s.has_any, "{port:?}");
            assert!(s.cluster.is_empty() && s.local.is_empty());
            assert!(s.internal(&port).is_empty() && s.external(&port).is_empty());
        }
    }
}

#[test]
fn a_terminating_remote_endpoint_counts_as_usable_under_local_policy() {
    let port = internal_local_port();
    let s = select(&port, &[terminating(1)], &node());
    assert!(s.local.is_empty());
    assert!(s.has_any);
}

#[test]
fn each_address_family_falls_back_on_its_own() {
    // Upstream runs one proxier per family: ready IPv6 endpoints do not stop IPv4 traffic from
    // using terminating IPv4 endpoints.
    let port = external_local_port();
    let eps = [
        terminating(1),
        v6(ready(2)),
        local(terminating(3)),
        v6(terminating(4)),
    ];
    let s = select(&port, &eps, &node());
    assert_eq!(
        shown(&s.cluster),
        ["10.244.0.1:8080", "10.244.0.3:8080", "[fd00:244::2]:8080"]
    );
    assert_eq!(shown(&s.local), ["10.244.0.3:8080"]);
}

#[test]
fn each_address_family_decides_topology_on_its_own() {
    let eps = [
        hinted(ready(1), &[ZONE]),
        hinted(ready(2), &["zone-b"]),
        v6(ready(3)),
        v6(hinted(ready(4), &["zone-b"])),
    ];
    let s = select(&cluster_ip_port(), &eps, &node());
    assert_eq!(
        shown(&s.cluster),
        [
            "10.244.0.1:8080",
            "[fd00:244::3]:8080",
            "[fd00:244::4]:8080"
        ]
    );
}

// ---- Property: selection agrees with upstream's CategorizeEndpoints ----

fn usable(ep: &Endpoint) -> bool {
    ep.ready || (ep.serving && ep.terminating)
}

/// Upstream's rules, written as set filters over one family at a time.
fn expected(
    port: &ServicePort,
    endpoints: &[Endpoint],
    node: &NodeInfo,
) -> (Vec<Endpoint>, Vec<Endpoint>) {
    let uses_cluster = !port.internal_traffic_local || port.has_external();
    let uses_local =
        port.internal_traffic_local || (port.external_traffic_local && port.has_external());
    let zone = node.zone.clone().filter(|z| !z.is_empty());
    let hints_of = |e: &Endpoint| e.zone_hints.clone().unwrap_or_default();
    let (mut cluster, mut local) = (Vec::new(), Vec::new());
    for family in IpFamily::ALL {
        let eps: Vec<&Endpoint> = endpoints
            .iter()
            .filter(|e| IpFamily::of(&e.ip) == family)
            .collect();
        let ready: Vec<&Endpoint> = eps.iter().copied().filter(|e| e.ready).collect();
        let fallback: Vec<&Endpoint> = eps
            .iter()
            .copied()
            .filter(|e| e.serving && e.terminating)
            .collect();
        if uses_cluster {
            let topology_zone = zone.as_ref().filter(|z| {
                ready.iter().all(|e| !hints_of(e).is_empty())
                    && ready.iter().any(|e| hints_of(e).contains(*z))
            });
            let in_zone: Vec<&Endpoint> = ready
                .iter()
                .copied()
                .filter(|e| topology_zone.is_none_or(|z| hints_of(e).contains(z)))
                .collect();
            cluster.extend(if in_zone.is_empty() {
                fallback.clone()
            } else {
                in_zone
            });
        }
        if uses_local {
            let local_ready: Vec<&Endpoint> =
                ready.iter().copied().filter(|e| e.is_local).collect();
            let local_fallback: Vec<&Endpoint> =
                fallback.iter().copied().filter(|e| e.is_local).collect();
            local.extend(if local_ready.is_empty() {
                local_fallback
            } else {
                local_ready
            });
        }
    }
    (
        cluster.into_iter().cloned().collect(),
        local.into_iter().cloned().collect(),
    )
}

fn arb_zone() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("zone-a".to_string()),
        Just("zone-b".to_string()),
        Just("zone-c".to_string())
    ]
}

fn arb_endpoint(n: u8) -> impl Strategy<Value = Endpoint> {
    (
        any::<bool>(),
        any::<(bool, bool, bool, bool)>(),
        prop::option::weighted(0.7, prop::collection::btree_set(arb_zone(), 0..3)),
    )
        .prop_map(
            move |(ipv6, (ready, serving, terminating, is_local), zone_hints)| {
                let ep = Endpoint {
                    ready,
                    serving,
                    terminating,
                    is_local,
                    zone_hints,
                    ..endpoint(n, true, true, false)
                };
                if ipv6 {
                    v6(ep)
                } else {
                    ep
                }
            },
        )
}

fn arb_endpoints() -> impl Strategy<Value = Vec<Endpoint>> {
    (0usize..9).prop_flat_map(|len| {
        (0..len)
            .map(|n| arb_endpoint(n as u8 + 1))
            .collect::<Vec<_>>()
    })
}

fn arb_port() -> impl Strategy<Value = ServicePort> {
    (any::<bool>(), any::<bool>(), 0u8..4).prop_map(|(internal_local, external_local, external)| {
        let mut port = cluster_ip_port();
        port.internal_traffic_local = internal_local;
        port.external_traffic_local = external_local;
        match external {
            1 => port.node_port = Some(30080),
            2 => port.load_balancer_ips = vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10))],
            3 => port.external_ips = vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7))],
            _ => {}
        }
        port
    })
}

fn arb_node() -> impl Strategy<Value = NodeInfo> {
    prop_oneof![
        Just(None),
        Just(Some(String::new())),
        arb_zone().prop_map(Some)
    ]
    .prop_map(|zone| NodeInfo { zone, ..node() })
}

fn sorted(mut eps: Vec<Endpoint>) -> Vec<Endpoint> {
    eps.sort();
    eps
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn selection_follows_upstream_rules(port in arb_port(), eps in arb_endpoints(), node in arb_node()) {
        let s = select(&port, &eps, &node);
        let all: BTreeSet<&Endpoint> = eps.iter().collect();

        prop_assert!(s.cluster.iter().all(|e| all.contains(e) && usable(e)), "cluster ⊄ usable endpoints");
        prop_assert!(s.local.iter().all(|e| all.contains(e) && e.is_local && usable(e)), "local ⊄ usable local endpoints");
        prop_assert_eq!(s.has_any, eps.iter().any(usable));

        let topology_off = node.zone.as_deref().is_none_or(str::is_empty);
        let uses_cluster = !port.internal_traffic_local || port.has_external();
        if uses_cluster && eps.iter().any(|e| e.ready) {
            prop_assert!(!s.cluster.is_empty(), "a ready endpoint exists but the cluster set is empty");
            if topology_off {
                // Every ready endpoint serves; a terminating one only stands in for a family
                // that has no ready endpoint.
                let cluster: BTreeSet<&Endpoint> = s.cluster.iter().collect();
                prop_assert!(eps.iter().filter(|e| e.ready).all(|e| cluster.contains(e)));
                for e in s.cluster.iter().filter(|e| !e.ready) {
                    let family = IpFamily::of(&e.ip);
                    prop_assert!(!eps.iter().any(|r| r.ready && IpFamily::of(&r.ip) == family));
                }
            }
        }

        let (cluster, local) = expected(&port, &eps, &node);
        prop_assert_eq!(sorted(s.cluster.clone()), sorted(cluster));
        prop_assert_eq!(sorted(s.local.clone()), sorted(local));
    }
}
