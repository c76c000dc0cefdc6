use super::*;

use std::net::IpAddr;

use serde_json::{json, Value};

use crate::track::{Kind, Object, ObjectKey, SourceEvent};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

// Test addressing (the lab's plan): ClusterIPs in 10.96.0.0/16 and fd00:10:96::/112, endpoints
// in 10.244.0.0/16 and fd00:10:244::/48, external IPs in 198.51.100.0/24, LoadBalancer IPs in
// 203.0.113.0/24, this node ("node-a") is 192.0.2.1 and 2001:db8::1, clients are 192.0.2.2 and
// 2001:db8::2. Services live in namespace "web"; the UDP port is "dns", 53 → 5353.

const NODE: &str = "node-a";
const BOTH: &[IpFamily] = &[IpFamily::V4, IpFamily::V6];
const V4: &[IpFamily] = &[IpFamily::V4];

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn node_addrs() -> HashSet<IpAddr> {
    [ip("192.0.2.1"), ip("2001:db8::1")].into_iter().collect()
}

/// A Service `web/<name>` from its spec (and optional status).
fn service(name: &str, spec: Value, status: Value) -> Object {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"namespace": "web", "name": name},
        "spec": spec,
        "status": status,
    }))
    .expect("Service JSON");
    Object::Service(Box::new(svc))
}

/// A ClusterIP Service with one port `dns` 53 of `protocol`.
fn udp_service(name: &str, cluster_ip: &str, protocol: &str) -> Object {
    service(
        name,
        json!({"clusterIP": cluster_ip, "ports": [{"name": "dns", "port": 53, "protocol": protocol}]}),
        json!({}),
    )
}

/// An endpoint on another node, with the given conditions.
fn ep(addr: &str, conditions: Value) -> Value {
    json!({"addresses": [addr], "conditions": conditions, "nodeName": "node-b"})
}

fn ready(addr: &str) -> Value {
    ep(addr, json!({"ready": true}))
}

/// Slice `web/<service>-<family>` with port `dns` 5353 of `protocol`.
fn slice(service: &str, family: &str, protocol: &str, endpoints: Vec<Value>) -> Object {
    slice_port(service, family, protocol, 5353, endpoints)
}

fn slice_port(
    service: &str,
    family: &str,
    protocol: &str,
    port: u16,
    endpoints: Vec<Value>,
) -> Object {
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {
            "namespace": "web",
            "name": format!("{service}-{}", family.to_lowercase()),
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": family,
        "endpoints": endpoints,
        "ports": [{"name": "dns", "port": port, "protocol": protocol}],
    }))
    .expect("EndpointSlice JSON");
    Object::EndpointSlice(Box::new(slice))
}

fn new_state() -> ProxyState {
    let mut state = ProxyState::new(NODE);
    for kind in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        state.apply(SourceEvent::Synced(kind)).expect("synced");
    }
    state
}

fn upsert(state: &mut ProxyState, obj: Object) {
    state.apply(SourceEvent::Upsert(obj)).expect("accepted");
}

fn delete_service(state: &mut ProxyState, name: &str) {
    let key = ObjectKey {
        namespace: "web".into(),
        name: name.into(),
    };
    state
        .apply(SourceEvent::Delete(Kind::Service, key))
        .expect("deleted");
}

/// A UDP entry from `client:40000` to `dst:dport`, answered by `reply_src:reply_sport`.
fn entry(client: &str, dst: &str, dport: u16, reply_src: &str, reply_sport: u16) -> FlowEntry {
    FlowEntry {
        protocol: Protocol::Udp,
        orig_src: ip(client),
        orig_dst: ip(dst),
        orig_sport: 40000,
        orig_dport: dport,
        reply_src: ip(reply_src),
        reply_sport,
        zone: 0,
        id: None,
    }
}

fn udp(dst: &str, dport: u16, reply_src: &str, reply_sport: u16) -> FlowEntry {
    let client = if dst.contains(':') {
        "2001:db8::2"
    } else {
        "192.0.2.2"
    };
    entry(client, dst, dport, reply_src, reply_sport)
}

fn cip(addr: &str) -> Frontend {
    Frontend::Ip {
        protocol: Protocol::Udp,
        ip: ip(addr),
        port: 53,
    }
}

fn planner(state: &ProxyState, families: &[IpFamily]) -> ConntrackPlanner {
    let mut p = ConntrackPlanner::new();
    p.update(state, families);
    p
}

#[test]
fn an_entry_to_a_removed_endpoint_is_stale_and_one_to_a_remaining_endpoint_is_not() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice(
            "dns",
            "IPv4",
            "UDP",
            vec![ready("10.244.1.10"), ready("10.244.2.10")],
        ),
    );
    let mut p = planner(&state, BOTH);
    let to_a = udp("10.96.0.10", 53, "10.244.1.10", 5353);
    let to_b = udp("10.96.0.10", 53, "10.244.2.10", 5353);
    assert_eq!(
        p.check(&to_a, &node_addrs()),
        Check::Valid(cip("10.96.0.10"))
    );
    assert!(!p.stale(&to_b, &node_addrs()));

    upsert(
        &mut state,
        slice("dns", "IPv4", "UDP", vec![ready("10.244.2.10")]),
    );
    p.update(&state, BOTH);
    assert_eq!(
        p.check(&to_a, &node_addrs()),
        Check::Stale(cip("10.96.0.10"), Staleness::EndpointGone)
    );
    assert!(!p.stale(&to_b, &node_addrs()));
}

#[test]
fn untranslated_entries_are_kept_while_a_service_has_no_endpoints_and_stale_once_it_has_some() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    let mut p = planner(&state, BOTH);
    // Sent while there was no endpoint: never translated.
    let early = udp("10.96.0.10", 53, "10.96.0.10", 53);
    assert!(!early.translated());
    assert_eq!(
        p.check(&early, &node_addrs()),
        Check::Valid(cip("10.96.0.10"))
    );

    upsert(
        &mut state,
        slice("dns", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    p.update(&state, BOTH);
    assert_eq!(
        p.check(&early, &node_addrs()),
        Check::Stale(cip("10.96.0.10"), Staleness::Untranslated)
    );
    assert!(!p.stale(&udp("10.96.0.10", 53, "10.244.1.10", 5353), &node_addrs()));
}

#[test]
fn endpoints_of_the_other_family_do_not_make_untranslated_entries_stale() {
    let mut state = new_state();
    upsert(
        &mut state,
        service(
            "dns",
            json!({
                "clusterIPs": ["10.96.0.10", "fd00:10:96::10"],
                "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}],
            }),
            json!({}),
        ),
    );
    upsert(
        &mut state,
        slice("dns", "IPv6", "UDP", vec![ready("fd00:10:244:1::10")]),
    );
    let p = planner(&state, BOTH);
    // IPv4 has no endpoint: an untranslated IPv4 entry waits for one.
    assert!(!p.stale(&udp("10.96.0.10", 53, "10.96.0.10", 53), &node_addrs()));
    // IPv6 has one: an untranslated IPv6 entry must go.
    assert_eq!(
        p.check(
            &udp("fd00:10:96::10", 53, "fd00:10:96::10", 53),
            &node_addrs()
        ),
        Check::Stale(cip("fd00:10:96::10"), Staleness::Untranslated)
    );
}

#[test]
fn an_entry_to_an_endpoint_that_is_gone_is_stale_even_when_no_endpoint_is_left() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice("dns", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    let mut p = planner(&state, BOTH);
    upsert(&mut state, slice("dns", "IPv4", "UDP", vec![]));
    p.update(&state, BOTH);
    assert_eq!(
        p.check(&udp("10.96.0.10", 53, "10.244.1.10", 5353), &node_addrs()),
        Check::Stale(cip("10.96.0.10"), Staleness::EndpointGone)
    );
    assert!(!p.stale(&udp("10.96.0.10", 53, "10.96.0.10", 53), &node_addrs()));
}

#[test]
fn entries_to_a_deleted_service_are_stale_until_a_reconcile_succeeds() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice("dns", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    let mut p = planner(&state, BOTH);
    let flow = udp("10.96.0.10", 53, "10.244.1.10", 5353);
    assert!(!p.stale(&flow, &node_addrs()));

    delete_service(&mut state, "dns");
    p.update(&state, BOTH);
    assert_eq!(
        p.check(&flow, &node_addrs()),
        Check::Stale(cip("10.96.0.10"), Staleness::FrontendGone)
    );
    // Still remembered through another sync whose reconcile did not run or failed.
    p.update(&state, BOTH);
    assert!(p.stale(&flow, &node_addrs()));
    assert!(p.wants(IpFamily::V4, Protocol::Udp));

    p.reconciled();
    assert_eq!(p.check(&flow, &node_addrs()), Check::NotOurs);
    assert_eq!(p.forgotten().count(), 0);
    assert!(!p.wants(IpFamily::V4, Protocol::Udp));
}

#[test]
fn forgotten_frontends_are_remembered_for_a_bounded_number_of_updates() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    let mut p = planner(&state, BOTH);
    delete_service(&mut state, "dns");
    let flow = udp("10.96.0.10", 53, "10.244.1.10", 5353);
    for _ in 0..=FORGOTTEN_UPDATES {
        p.update(&state, BOTH);
        assert!(p.stale(&flow, &node_addrs()));
    }
    p.update(&state, BOTH);
    assert_eq!(p.check(&flow, &node_addrs()), Check::NotOurs);
}

#[test]
fn a_cluster_ip_reused_by_a_new_service_is_current_again() {
    let mut state = new_state();
    upsert(&mut state, udp_service("old", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice("old", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    let mut p = planner(&state, BOTH);
    delete_service(&mut state, "old");
    p.update(&state, BOTH);
    upsert(&mut state, udp_service("new", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice("new", "IPv4", "UDP", vec![ready("10.244.3.10")]),
    );
    p.update(&state, BOTH);
    assert_eq!(p.forgotten().count(), 0);
    assert!(!p.stale(&udp("10.96.0.10", 53, "10.244.3.10", 5353), &node_addrs()));
    assert_eq!(
        p.check(&udp("10.96.0.10", 53, "10.244.1.10", 5353), &node_addrs()),
        Check::Stale(cip("10.96.0.10"), Staleness::EndpointGone)
    );
}

#[test]
fn a_removed_port_is_forgotten_while_the_service_stays() {
    let mut state = new_state();
    upsert(
        &mut state,
        service(
            "dns",
            json!({"clusterIP": "10.96.0.10", "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "alt", "port": 5300, "protocol": "UDP"},
            ]}),
            json!({}),
        ),
    );
    let mut p = planner(&state, BOTH);
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    p.update(&state, BOTH);
    let gone = Frontend::Ip {
        protocol: Protocol::Udp,
        ip: ip("10.96.0.10"),
        port: 5300,
    };
    assert_eq!(p.forgotten().collect::<Vec<_>>(), vec![gone]);
    assert_eq!(
        p.check(&udp("10.96.0.10", 5300, "10.244.1.10", 5353), &node_addrs()),
        Check::Stale(gone, Staleness::FrontendGone)
    );
}

#[test]
fn ipv6_entries_are_judged_like_ipv4_ones() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "fd00:10:96::10", "UDP"));
    upsert(
        &mut state,
        slice(
            "dns",
            "IPv6",
            "UDP",
            vec![ready("fd00:10:244:1::10"), ready("fd00:10:244:2::10")],
        ),
    );
    let mut p = planner(&state, BOTH);
    upsert(
        &mut state,
        slice("dns", "IPv6", "UDP", vec![ready("fd00:10:244:2::10")]),
    );
    p.update(&state, BOTH);
    assert_eq!(
        p.check(
            &udp("fd00:10:96::10", 53, "fd00:10:244:1::10", 5353),
            &node_addrs()
        ),
        Check::Stale(cip("fd00:10:96::10"), Staleness::EndpointGone)
    );
    assert!(!p.stale(
        &udp("fd00:10:96::10", 53, "fd00:10:244:2::10", 5353),
        &node_addrs()
    ));
}

#[test]
fn families_the_proxy_does_not_program_are_not_ours() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "fd00:10:96::10", "UDP"));
    upsert(
        &mut state,
        slice("dns", "IPv6", "UDP", vec![ready("fd00:10:244:1::10")]),
    );
    let p = planner(&state, V4);
    let flow = udp("fd00:10:96::10", 53, "fd00:10:244:9::10", 5353);
    assert_eq!(p.check(&flow, &node_addrs()), Check::NotOurs);
    assert!(!p.wants(IpFamily::V6, Protocol::Udp));
}

/// A NodePort Service `web/np` (NodePort 30053) with two endpoints.
fn node_port_state(policy: &str) -> ProxyState {
    let mut state = new_state();
    upsert(
        &mut state,
        service(
            "np",
            json!({
                "type": "NodePort",
                "clusterIPs": ["10.96.0.20", "fd00:10:96::20"],
                "externalTrafficPolicy": policy,
                "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}],
            }),
            json!({}),
        ),
    );
    upsert(
        &mut state,
        slice(
            "np",
            "IPv4",
            "UDP",
            vec![
                ready("10.244.1.10"),
                json!({"addresses": ["10.244.1.11"], "conditions": {"ready": true}, "nodeName": NODE}),
            ],
        ),
    );
    upsert(
        &mut state,
        slice("np", "IPv6", "UDP", vec![ready("fd00:10:244:1::10")]),
    );
    state
}

#[test]
fn node_port_entries_match_on_the_node_addresses_only() {
    let mut state = node_port_state("Cluster");
    let mut p = planner(&state, BOTH);
    upsert(
        &mut state,
        slice("np", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    upsert(&mut state, slice("np", "IPv6", "UDP", vec![]));
    p.update(&state, BOTH);

    let np4 = Frontend::NodePort {
        protocol: Protocol::Udp,
        family: IpFamily::V4,
        port: 30053,
    };
    let np6 = Frontend::NodePort {
        protocol: Protocol::Udp,
        family: IpFamily::V6,
        port: 30053,
    };
    let gone = udp("192.0.2.1", 30053, "10.244.1.11", 5353);
    assert_eq!(
        p.check(&gone, &node_addrs()),
        Check::Stale(np4, Staleness::EndpointGone)
    );
    assert_eq!(
        p.check(&udp("192.0.2.1", 30053, "10.244.1.10", 5353), &node_addrs()),
        Check::Valid(np4)
    );
    assert_eq!(
        p.check(
            &udp("2001:db8::1", 30053, "fd00:10:244:1::10", 5353),
            &node_addrs()
        ),
        Check::Stale(np6, Staleness::EndpointGone)
    );
    // The same port on an address that is not the node's is some other flow.
    let elsewhere = udp("192.0.2.99", 30053, "10.244.1.11", 5353);
    assert_eq!(p.check(&elsewhere, &node_addrs()), Check::NotOurs);
    // And with no node addresses given, no NodePort entry matches.
    assert_eq!(p.check(&gone, &HashSet::new()), Check::NotOurs);
}

#[test]
fn traffic_policy_local_does_not_make_flows_to_remote_endpoints_stale() {
    let state = node_port_state("Local");
    let p = planner(&state, BOTH);
    // The remote endpoint is not in the Local set, but it still serves: flows to it stay.
    for dst in ["192.0.2.1", "10.96.0.20"] {
        let dport = if dst == "192.0.2.1" { 30053 } else { 53 };
        let flow = udp(dst, dport, "10.244.1.10", 5353);
        assert!(matches!(p.check(&flow, &node_addrs()), Check::Valid(_)));
    }
}

#[test]
fn external_and_load_balancer_ips_are_frontends() {
    let mut state = new_state();
    upsert(
        &mut state,
        service(
            "lb",
            json!({
                "type": "LoadBalancer",
                "clusterIP": "10.96.0.30",
                "externalIPs": ["198.51.100.30"],
                "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30054}],
            }),
            json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.30"}]}}),
        ),
    );
    upsert(
        &mut state,
        slice("lb", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    let p = planner(&state, BOTH);
    for vip in ["10.96.0.30", "198.51.100.30", "203.0.113.30"] {
        assert_eq!(
            p.check(&udp(vip, 53, "10.244.9.9", 5353), &node_addrs()),
            Check::Stale(cip(vip), Staleness::EndpointGone),
            "{vip}"
        );
        assert_eq!(
            p.check(&udp(vip, 53, "10.244.1.10", 5353), &node_addrs()),
            Check::Valid(cip(vip)),
            "{vip}"
        );
        // Another port on the same address is not a frontend.
        assert_eq!(
            p.check(&udp(vip, 54, "10.244.9.9", 5353), &node_addrs()),
            Check::NotOurs
        );
    }
}

#[test]
fn tcp_entries_are_never_stale() {
    let mut state = new_state();
    upsert(&mut state, udp_service("tcp", "10.96.0.40", "TCP"));
    upsert(
        &mut state,
        slice("tcp", "IPv4", "TCP", vec![ready("10.244.1.10")]),
    );
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice("dns", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    let p = planner(&state, BOTH);
    for dst in ["10.96.0.40", "10.96.0.10"] {
        let flow = FlowEntry {
            protocol: Protocol::Tcp,
            ..udp(dst, 53, "10.244.9.9", 5353)
        };
        assert_eq!(p.check(&flow, &node_addrs()), Check::NotOurs, "{dst}");
    }
    assert!(!p.wants(IpFamily::V4, Protocol::Tcp));
    assert_eq!(p.frontends().count(), 1);
}

#[test]
fn sctp_entries_are_judged_like_udp_ones_and_protocols_do_not_mix() {
    let mut state = new_state();
    upsert(&mut state, udp_service("sctp", "10.96.0.50", "SCTP"));
    upsert(
        &mut state,
        slice("sctp", "IPv4", "SCTP", vec![ready("10.244.1.10")]),
    );
    let p = planner(&state, BOTH);
    let sctp = |reply: &str| FlowEntry {
        protocol: Protocol::Sctp,
        ..udp("10.96.0.50", 53, reply, 5353)
    };
    let frontend = Frontend::Ip {
        protocol: Protocol::Sctp,
        ip: ip("10.96.0.50"),
        port: 53,
    };
    assert_eq!(
        p.check(&sctp("10.244.9.9"), &node_addrs()),
        Check::Stale(frontend, Staleness::EndpointGone)
    );
    assert_eq!(
        p.check(&sctp("10.244.1.10"), &node_addrs()),
        Check::Valid(frontend)
    );
    // A UDP entry to the SCTP Service's address and port is not the Service's.
    assert_eq!(
        p.check(&udp("10.96.0.50", 53, "10.244.9.9", 5353), &node_addrs()),
        Check::NotOurs
    );
    assert!(p.wants(IpFamily::V4, Protocol::Sctp));
    assert!(!p.wants(IpFamily::V4, Protocol::Udp));
}

#[test]
fn session_affinity_changes_nothing() {
    let verdicts = |affinity: bool| {
        let mut state = new_state();
        let mut spec = json!({"clusterIP": "10.96.0.10", "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]});
        if affinity {
            spec["sessionAffinity"] = json!("ClientIP");
        }
        upsert(&mut state, service("dns", spec, json!({})));
        upsert(
            &mut state,
            slice("dns", "IPv4", "UDP", vec![ready("10.244.1.10")]),
        );
        let p = planner(&state, BOTH);
        [
            udp("10.96.0.10", 53, "10.244.1.10", 5353),
            udp("10.96.0.10", 53, "10.244.2.10", 5353),
            udp("10.96.0.10", 53, "10.96.0.10", 53),
        ]
        .map(|e| p.check(&e, &node_addrs()))
    };
    assert_eq!(verdicts(true), verdicts(false));
    assert!(matches!(verdicts(true)[1], Check::Stale(..)));
}

#[test]
fn serving_terminating_endpoints_keep_their_flows_and_unserving_ones_do_not() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice(
            "dns",
            "IPv4",
            "UDP",
            vec![
                ready("10.244.1.10"),
                ep(
                    "10.244.1.11",
                    json!({"ready": false, "serving": true, "terminating": true}),
                ),
                ep(
                    "10.244.1.12",
                    json!({"ready": false, "serving": false, "terminating": true}),
                ),
                ep("10.244.1.13", json!({"ready": false})),
            ],
        ),
    );
    let p = planner(&state, BOTH);
    let check = |reply: &str| p.check(&udp("10.96.0.10", 53, reply, 5353), &node_addrs());
    assert!(matches!(check("10.244.1.10"), Check::Valid(_)));
    assert!(matches!(check("10.244.1.11"), Check::Valid(_)));
    assert!(matches!(check("10.244.1.12"), Check::Stale(..)));
    assert!(matches!(check("10.244.1.13"), Check::Stale(..)));
}

#[test]
fn a_changed_target_port_makes_flows_to_the_old_port_stale() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice_port("dns", "IPv4", "UDP", 5353, vec![ready("10.244.1.10")]),
    );
    let mut p = planner(&state, BOTH);
    upsert(
        &mut state,
        slice_port("dns", "IPv4", "UDP", 5354, vec![ready("10.244.1.10")]),
    );
    p.update(&state, BOTH);
    assert!(p.stale(&udp("10.96.0.10", 53, "10.244.1.10", 5353), &node_addrs()));
    assert!(!p.stale(&udp("10.96.0.10", 53, "10.244.1.10", 5354), &node_addrs()));
}

#[test]
fn translations_to_addresses_that_are_no_service_frontend_are_never_touched() {
    let mut state = new_state();
    upsert(&mut state, udp_service("dns", "10.96.0.10", "UDP"));
    upsert(
        &mut state,
        slice("dns", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    let p = planner(&state, BOTH);
    // A host port or another DNAT on the node: its destination is no frontend of ours.
    for flow in [
        udp("10.50.0.1", 53, "10.244.9.9", 5353),
        udp("192.0.2.1", 8053, "10.244.9.9", 53),
        udp("10.96.0.11", 53, "10.244.9.9", 5353),
    ] {
        assert_eq!(p.check(&flow, &node_addrs()), Check::NotOurs, "{flow}");
    }
}

#[test]
fn two_services_sharing_an_external_ip_and_port_allow_the_endpoints_of_both() {
    let mut state = new_state();
    for (name, cluster_ip) in [("a", "10.96.0.60"), ("b", "10.96.0.61")] {
        upsert(
            &mut state,
            service(
                name,
                json!({
                    "clusterIP": cluster_ip,
                    "externalIPs": ["198.51.100.60"],
                    "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}],
                }),
                json!({}),
            ),
        );
    }
    upsert(
        &mut state,
        slice("a", "IPv4", "UDP", vec![ready("10.244.1.10")]),
    );
    upsert(
        &mut state,
        slice("b", "IPv4", "UDP", vec![ready("10.244.2.10")]),
    );
    let p = planner(&state, BOTH);
    let shared = |reply: &str| p.check(&udp("198.51.100.60", 53, reply, 5353), &node_addrs());
    assert!(matches!(shared("10.244.1.10"), Check::Valid(_)));
    assert!(matches!(shared("10.244.2.10"), Check::Valid(_)));
    assert!(matches!(shared("10.244.3.10"), Check::Stale(..)));
    // Each ClusterIP still allows only its own Service's endpoints.
    assert!(p.stale(&udp("10.96.0.60", 53, "10.244.2.10", 5353), &node_addrs()));
}

#[test]
fn an_ip_frontend_wins_over_a_node_port_on_the_same_address_and_port() {
    let mut state = node_port_state("Cluster");
    // An external IP that is the node's own address, on the NodePort's number.
    upsert(
        &mut state,
        service(
            "ext",
            json!({
                "clusterIP": "10.96.0.70",
                "externalIPs": ["192.0.2.1"],
                "ports": [{"name": "dns", "port": 30053, "protocol": "UDP"}],
            }),
            json!({}),
        ),
    );
    upsert(
        &mut state,
        slice("ext", "IPv4", "UDP", vec![ready("10.244.7.10")]),
    );
    let p = planner(&state, BOTH);
    let frontend = Frontend::Ip {
        protocol: Protocol::Udp,
        ip: ip("192.0.2.1"),
        port: 30053,
    };
    assert_eq!(
        p.check(&udp("192.0.2.1", 30053, "10.244.7.10", 5353), &node_addrs()),
        Check::Valid(frontend)
    );
    assert_eq!(
        p.check(&udp("192.0.2.1", 30053, "10.244.1.10", 5353), &node_addrs()),
        Check::Stale(frontend, Staleness::EndpointGone)
    );
}

#[test]
fn a_deleted_node_port_is_forgotten_per_family() {
    let mut state = node_port_state("Cluster");
    let mut p = planner(&state, BOTH);
    delete_service(&mut state, "np");
    p.update(&state, BOTH);
    let flow = udp("2001:db8::1", 30053, "fd00:10:244:1::10", 5353);
    assert_eq!(
        p.check(&flow, &node_addrs()),
        Check::Stale(
            Frontend::NodePort {
                protocol: Protocol::Udp,
                family: IpFamily::V6,
                port: 30053
            },
            Staleness::FrontendGone
        )
    );
    // Not on a node address: not the NodePort's.
    assert_eq!(
        p.check(
            &udp("192.0.2.99", 30053, "10.244.1.10", 5353),
            &node_addrs()
        ),
        Check::NotOurs
    );
}

#[test]
fn entries_display_as_conntrack_tuples() {
    let flow = udp("fd00:10:96::10", 53, "fd00:10:244:1::10", 5353);
    assert_eq!(
        flow.to_string(),
        "UDP [2001:db8::2]:40000 -> [fd00:10:96::10]:53 (reply from [fd00:10:244:1::10]:5353)"
    );
    assert_eq!(cip("10.96.0.10").to_string(), "UDP 10.96.0.10:53");
}

/// A Service `web/<name>` with external IP 198.51.100.99 (shared by several Services in the
/// test below), a ClusterIP and optionally a NodePort, one UDP port `dns` 53.
fn shared_ip_service(name: &str, cluster_ip: &str, node_port: Option<u16>) -> Object {
    let mut port = json!({"name": "dns", "port": 53, "protocol": "UDP"});
    let kind = if let Some(np) = node_port {
        port["nodePort"] = json!(np);
        "NodePort"
    } else {
        "ClusterIP"
    };
    service(
        name,
        json!({"type": kind, "clusterIP": cluster_ip, "externalIPs": ["198.51.100.99"], "ports": [port]}),
        json!({}),
    )
}

#[test]
fn re_indexing_only_the_changed_services_gives_the_same_index_as_re_indexing_all() {
    let mut state = new_state();
    upsert(&mut state, shared_ip_service("a", "10.96.0.1", Some(30053)));
    upsert(
        &mut state,
        slice("a", "IPv4", "UDP", vec![ready("10.244.1.1")]),
    );
    upsert(&mut state, shared_ip_service("b", "10.96.0.2", None));
    upsert(
        &mut state,
        slice("b", "IPv4", "UDP", vec![ready("10.244.2.1")]),
    );
    upsert(&mut state, udp_service("tcp", "10.96.0.3", "TCP"));
    state.take_changes();
    let mut incremental = planner(&state, BOTH);
    let mut full = planner(&state, BOTH);

    type Step = Box<dyn Fn(&mut ProxyState)>;
    let steps: Vec<(&str, Step)> = vec![
        (
            "endpoint of a replaced",
            Box::new(|s| upsert(s, slice("a", "IPv4", "UDP", vec![ready("10.244.1.2")]))),
        ),
        (
            "b loses its endpoints",
            Box::new(|s| upsert(s, slice("b", "IPv4", "UDP", vec![]))),
        ),
        (
            "a third Service shares the external IP",
            Box::new(|s| {
                upsert(s, shared_ip_service("c", "10.96.0.4", Some(30054)));
                upsert(s, slice("c", "IPv4", "UDP", vec![ready("10.244.3.1")]));
            }),
        ),
        (
            "a is deleted: the shared IP stays, its ClusterIP and NodePort are forgotten",
            Box::new(|s| delete_service(s, "a")),
        ),
        (
            "b turns TCP",
            Box::new(|s| upsert(s, udp_service("b", "10.96.0.2", "TCP"))),
        ),
        (
            "a comes back on its old ClusterIP",
            Box::new(|s| {
                upsert(s, shared_ip_service("a", "10.96.0.1", None));
                upsert(s, slice("a", "IPv4", "UDP", vec![ready("10.244.1.3")]));
            }),
        ),
        (
            "c is deleted: the external IP is a's alone",
            Box::new(|s| delete_service(s, "c")),
        ),
        ("nothing changes", Box::new(|_| {})),
    ];
    for (what, step) in steps {
        step(&mut state);
        let changes = state.take_changes();
        incremental.update_services(&state, &changes.services, BOTH);
        full.update(&state, BOTH);
        assert_eq!(incremental.ips, full.ips, "{what}");
        assert_eq!(incremental.node_ports, full.node_ports, "{what}");
        assert_eq!(incremental.forgotten, full.forgotten, "{what}");
    }
    // The shared external IP allows a's endpoint alone now; c's NodePort is forgotten.
    let shared = udp("198.51.100.99", 53, "10.244.3.1", 5353);
    assert_eq!(
        incremental.check(&shared, &node_addrs()),
        Check::Stale(cip("198.51.100.99"), Staleness::EndpointGone)
    );
    assert!(incremental.forgotten().any(|f| f
        == Frontend::NodePort {
            protocol: Protocol::Udp,
            family: IpFamily::V4,
            port: 30054
        }));
}

#[test]
fn every_endpoint_a_frontend_sends_to_is_a_valid_reply_source() {
    // The dataplanes translate each frontend to its endpoints (and, for a Local policy, pods
    // and the node to the short-circuit set): conntrack must never call such a flow stale.
    for policy in ["Cluster", "Local"] {
        let state = node_port_state(policy);
        let p = planner(&state, BOTH);
        let mut checked = 0;
        for key in state.service_keys() {
            for sps in state.service_state(key) {
                for family in IpFamily::ALL {
                    for f in crate::frontend::Frontends::of(&sps, family).iter() {
                        let dst = match (f.address, family) {
                            (Some(ip), _) => ip,
                            (None, IpFamily::V4) => ip("192.0.2.1"),
                            (None, IpFamily::V6) => ip("2001:db8::1"),
                        };
                        for ep in f.endpoints.iter().chain(f.short_circuit) {
                            let flow = udp(&dst.to_string(), f.port, &ep.ip.to_string(), ep.port);
                            let check = p.check(&flow, &node_addrs());
                            assert!(
                                matches!(check, Check::Valid(_)),
                                "{policy} {flow}: {check:?}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked >= 4, "{policy}: {checked} flows checked");
    }
}
