//! Defects the fuzzer found and that are fixed, each as the smallest reproducer asserting the
//! correct behaviour. A defect still open is an example instead (`examples/`), since CI runs
//! ignored tests too: its reproducer moves here once it is fixed, and its entry leaves
//! `kp_fuzz::KNOWN_DEFECTS`, which keeps the fuzzer from failing on it meanwhile.

use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Kind, Object, ProxyState, SourceEvent};
use serde_json::json;

fn object(v: serde_json::Value) -> Object {
    match v["kind"].as_str() {
        Some("Service") => Object::Service(Box::new(serde_json::from_value(v).unwrap())),
        Some("EndpointSlice") => {
            Object::EndpointSlice(Box::new(serde_json::from_value(v).unwrap()))
        }
        Some("Node") => Object::Node(Box::new(serde_json::from_value(v).unwrap())),
        _ => Object::ServiceCidr(Box::new(serde_json::from_value(v).unwrap())),
    }
}

/// The objects loaded as a source would: a rejected one is skipped (and stays out).
fn state(objects: Vec<serde_json::Value>) -> ProxyState {
    let mut s = ProxyState::new("node-a");
    for o in objects {
        let _ = s.apply(SourceEvent::Upsert(object(o)));
    }
    for k in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        s.apply(SourceEvent::Synced(k)).unwrap();
    }
    s.take_changes();
    s
}

/// A Service listing the external IP 198.51.100.70 on TCP port 80, as another may too.
fn external(name: &str, cluster_ip: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "default"},
           "spec": {"clusterIP": cluster_ip, "externalIPs": ["198.51.100.70"],
                    "ports": [{"protocol": "TCP", "port": 80}]}})
}

/// Service `service`'s slice with one endpoint, `ip`, on port 8080.
fn slice(service: &str, ip: &str) -> serde_json::Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{service}-1"), "namespace": "default",
                        "labels": {"kubernetes.io/service-name": service}},
           "addressType": "IPv4",
           "ports": [{"name": "", "protocol": "TCP", "port": 8080}],
           "endpoints": [{"addresses": [ip]}]})
}

/// A valid IPv6 Service, so the IPv6 tables have something to lose.
fn web6() -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "web6", "namespace": "default"},
           "spec": {"clusterIP": "fd00:10:96::10", "ports": [{"protocol": "TCP", "port": 80}]}})
}

/// Found by `kp-fuzz`. A ServiceCIDR holding an IPv4-compatible IPv6 range (`::a00:0/104`, that is
/// `::10.0.0.0/104`) passes kp-core's validation (`convert::service_cidrs` refuses only the special
/// ranges), and the iptables planner renders it into the shared filter `KUBE-SERVICES` rule that
/// drops unallocated ClusterIPs. Its own validator then refuses that rule (iptables-save prints the
/// address dotted, so the read-back would never match) as a `PlanError::Shared`: the whole IPv6
/// restore is empty, and every later IPv6 sync too, for every Service, as long as the object
/// exists. One object stops a family; the other family goes on.
///
/// Fixed in kp-core: IPv4-compatible addresses (`::/96`) are refused as IPv4-mapped ones are.
#[test]
fn ipv4_compatible_ipv6_address_stops_every_iptables_sync_of_the_family() {
    let state = state(vec![
        web6(),
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
               "metadata": {"name": "odd"}, "spec": {"cidrs": ["::a00:0/104"]}}),
    ]);
    let node = NodeContext::resolve(&DetectLocal::None, &NodePortAddresses::AllLocal, &state);
    let mut p = kp_iptables_plan::Planner::new(kp_iptables_plan::PlanConfig::new(IpFamily::V6));
    let restore = p.full(&state, &node);
    assert!(restore.fatal().is_none(), "{:?}", restore.errors);
}

/// Found by `kp-fuzz`. The same defect through this node's own Node object: an InternalIP of
/// `::1003:b748` is accepted (`convert::node_info` checks only that it parses), becomes the IPv6
/// NodePort address with `nodePortAddresses: primary`, and the nat `KUBE-SERVICES` rule that sends
/// it to `KUBE-NODEPORTS` is refused as a shared rule: no IPv6 iptables sync until the Node
/// changes.
#[test]
fn ipv4_compatible_node_address_stops_every_iptables_sync_of_the_family() {
    let state = state(vec![
        web6(),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
               "status": {"addresses": [{"type": "InternalIP", "address": "::1003:b748"}]}}),
    ]);
    let node = NodeContext::resolve(&DetectLocal::None, &NodePortAddresses::Primary, &state);
    let mut p = kp_iptables_plan::Planner::new(kp_iptables_plan::PlanConfig::new(IpFamily::V6));
    let restore = p.full(&state, &node);
    assert!(restore.fatal().is_none(), "{:?}", restore.errors);
}

/// Two Services list one external IP and port; when one of them is deleted, the ebpf planner
/// hands the frontend to the other (found by the fuzzer as
/// `ebpf_planner_loses_a_frontend_two_services_share`: the planner deleted it with the
/// Service that left).
#[test]
fn ebpf_planner_keeps_a_frontend_two_services_share_when_one_leaves() {
    use kp_core::model::ServiceKey;
    use kp_core::track::ObjectKey;
    use kp_ebpf_plan::{plan_state, service_specs, Contents, Planner};
    let mut s = state(vec![
        external("a", "10.96.1.1"),
        slice("a", "10.244.1.1"),
        external("b", "10.96.1.2"),
        slice("b", "10.244.1.2"),
    ]);
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    let mut plan = |planner: &mut Planner, s: &ProxyState, name: &str| {
        let key = ServiceKey::new("default", name);
        let mut todo = vec![key];
        while let Some(key) = todo.pop() {
            for op in planner
                .set_service(&key, &service_specs(s, &key, &[]))
                .unwrap()
            {
                maps.apply(&op);
            }
            todo.extend(planner.take_handoffs());
        }
    };
    plan(&mut planner, &s, "a");
    plan(&mut planner, &s, "b");
    let a = ObjectKey {
        namespace: "default".into(),
        name: "a".into(),
    };
    s.apply(SourceEvent::Delete(Kind::Service, a)).unwrap();
    plan(&mut planner, &s, "a");
    let full = plan_state(&s, &NodePortAddresses::AllLocal, &[]).unwrap();
    let shared = |c: &Contents| {
        c.services
            .keys()
            .filter(|k| k.frontend.ip.to_string() == "198.51.100.70" && k.slot != 0)
            .count()
    };
    assert_eq!(
        shared(&planner.contents()),
        1,
        "b's endpoint behind the shared address"
    );
    assert_eq!(shared(&planner.contents()), shared(&full.contents()));
    assert_eq!(kp_ebpf_plan::diff(&maps, &planner.contents()), vec![]);
}

/// Found by `kp-fuzz`. Two Services list the same external IP and port (nothing allocates
/// externalIPs, so nothing stops that). The nftables planner gave the shared
/// `198.51.100.70 . tcp . 80` entry to whichever Service claimed it first: a partial sync that
/// added Service `a` while `b` held the entry left it with `b`'s endpoints, while a full sync of
/// the same state gave it to `a`, so which Service received the traffic flipped at the next full
/// sync (a restart, a failed transaction).
///
/// Fixed in kp-nftables-plan: several owners of one element are ranked (the node, then Services
/// in name order, then ports), and the first holds it whatever order the claims came in.
#[test]
fn nftables_partial_sync_gives_a_shared_external_ip_to_the_service_a_full_sync_does() {
    let mut s = state(vec![external("b", "10.96.1.2"), slice("b", "10.244.1.2")]);
    let node = NodeContext::default();
    let mut p = kp_nftables_plan::Planner::new(kp_nftables_plan::PlanConfig::new(IpFamily::V4));
    p.full(&s, &node);
    for o in [external("a", "10.96.1.1"), slice("a", "10.244.1.1")] {
        s.apply(SourceEvent::Upsert(object(o))).unwrap();
    }
    let changes = s.take_changes();
    p.partial(&s, &changes.services, &node, changes.node_changed);
    let mut fresh = kp_nftables_plan::Planner::new(kp_nftables_plan::PlanConfig::new(IpFamily::V4));
    fresh.full(&s, &node);
    let set = kp_nftables_plan::SetId::ClassEndpoints(kp_nftables_plan::Route::Vips, 1);
    let shared = |p: &kp_nftables_plan::Planner| {
        p.expected_elements(set)
            .into_iter()
            .filter(|(k, _)| k.to_string().starts_with("198.51.100.70 "))
            .collect::<Vec<_>>()
    };
    assert_eq!(shared(&p).len(), 1, "{:?}", p.expected_elements(set));
    assert_eq!(shared(&p), shared(&fresh));
    assert!(
        shared(&p)[0]
            .1
            .as_ref()
            .unwrap()
            .to_string()
            .starts_with("10.244.1.1 "),
        "a, first by name: {:?}",
        shared(&p)
    );
}
