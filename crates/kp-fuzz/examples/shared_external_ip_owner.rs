//! An open defect found by `kp-fuzz`, reproduced: `cargo run -p kp-fuzz --example
//! shared_external_ip_owner` prints what it sees and exits 1 while the defect is there.
//!
//! Two Services list the same external IP and port (nothing allocates externalIPs, so nothing
//! stops that). The nftables planner gives the shared `198.51.100.70 . tcp . 80` entry to its
//! first owner: a partial sync that adds Service `a` while `b` holds the entry leaves it with
//! `b`'s endpoints, while a full sync of the very same state gives it to `a` (the first in name
//! order). Which Service receives the traffic depends on the sync history, and flips at the next
//! full sync (a restart, a failed transaction); deleting `b` hands it to `a` and the two agree
//! again. The iptables planner is consistent here. An example, not a test: CI runs ignored
//! tests too, and this one fails until the planner is fixed (then it becomes a test in
//! `tests/known_defects.rs`).

use kp_core::model::IpFamily;
use kp_core::node::NodeContext;
use kp_core::track::{Object, ProxyState, SourceEvent};
use kp_nftables_plan::{PlanConfig, Planner, Route, SetId};
use serde_json::json;

fn external(name: &str, cluster_ip: &str) -> Object {
    let svc = json!({"metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": cluster_ip, "externalIPs": ["198.51.100.70"],
            "ports": [{"protocol": "TCP", "port": 80}]}});
    Object::Service(Box::new(serde_json::from_value(svc).expect("Service")))
}

fn slice(service: &str, ip: &str) -> Object {
    let slice = json!({"metadata": {"name": format!("{service}-1"), "namespace": "default",
            "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": [ip]}]});
    Object::EndpointSlice(Box::new(
        serde_json::from_value(slice).expect("EndpointSlice"),
    ))
}

fn main() -> std::process::ExitCode {
    let mut state = ProxyState::new("node-a");
    for o in [external("b", "10.96.1.2"), slice("b", "10.244.1.2")] {
        let _ = state.apply(SourceEvent::Upsert(o));
    }
    state.take_changes();
    let node = NodeContext::default();
    let mut p = Planner::new(PlanConfig::new(IpFamily::V4));
    p.full(&state, &node);
    for o in [external("a", "10.96.1.1"), slice("a", "10.244.1.1")] {
        let _ = state.apply(SourceEvent::Upsert(o));
    }
    let changes = state.take_changes();
    p.partial(&state, &changes.services, &node, changes.node_changed);
    let mut fresh = Planner::new(PlanConfig::new(IpFamily::V4));
    fresh.full(&state, &node);
    let set = SetId::ClassEndpoints(Route::Vips, 1);
    let (partial, full) = (p.expected_elements(set), fresh.expected_elements(set));
    println!("after partial syncs: {partial:?}\nafter one full sync: {full:?}");
    if partial == full {
        println!("fixed: move this reproducer into tests/known_defects.rs");
        std::process::ExitCode::SUCCESS
    } else {
        println!("defect present: the shared external IP's owner depends on the sync history");
        std::process::ExitCode::FAILURE
    }
}
