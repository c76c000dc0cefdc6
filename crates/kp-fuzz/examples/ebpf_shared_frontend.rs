//! An open defect found by `kp-fuzz`, reproduced: `cargo run -p kp-fuzz --example
//! ebpf_shared_frontend` prints what it sees and exits 1 while the defect is there.
//!
//! Two Services list the same external IP and port (nothing allocates externalIPs, so nothing
//! stops that). The ebpf planner (`kp-ebpf-plan`) keeps one owner per frontend: when Service
//! `a` is deleted, `set_service(a, [])` deletes the shared `198.51.100.70:80/TCP` frontend from
//! the maps and from the planner's record, although Service `b` still wants it. A full plan of
//! the same state has it, with `b`'s endpoint. The frontend stays missing (its connections
//! refused) until the mode's next full sync, at the latest its periodic one (`syncPeriod`).
//! The nftables and userspace modes keep every claim and hand the frontend to the next one. An example, not a test: CI runs ignored tests too, and
//! this one fails until the planner is fixed (then it becomes a test in
//! `tests/known_defects.rs`).

use kp_core::model::ServiceKey;
use kp_core::node::NodePortAddresses;
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_ebpf_plan::{plan_state, service_specs, Planner};
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
    for o in [
        external("a", "10.96.1.1"),
        slice("a", "10.244.1.1"),
        external("b", "10.96.1.2"),
        slice("b", "10.244.1.2"),
    ] {
        let _ = state.apply(SourceEvent::Upsert(o));
    }
    let mut p = Planner::new();
    for name in ["a", "b"] {
        let key = ServiceKey::new("default", name);
        p.set_service(&key, &service_specs(&state, &key, &[]))
            .expect("ids");
    }
    let a = ObjectKey {
        namespace: "default".into(),
        name: "a".into(),
    };
    let _ = state.apply(SourceEvent::Delete(Kind::Service, a));
    p.set_service(&ServiceKey::new("default", "a"), &[])
        .expect("ids");
    let full = plan_state(&state, &NodePortAddresses::AllLocal, &[]).expect("ids");
    let shared = |c: &kp_ebpf_plan::Contents| {
        c.services
            .keys()
            .filter(|k| k.frontend.ip.to_string() == "198.51.100.70" && k.slot == 0)
            .count()
    };
    let (partial, fresh) = (p.contents(), full.contents());
    println!(
        "198.51.100.70:80 after deleting a: {} entries in the planner's record, {} in a full plan",
        shared(&partial),
        shared(&fresh)
    );
    if shared(&partial) == shared(&fresh) {
        println!("fixed: move this reproducer into tests/known_defects.rs");
        std::process::ExitCode::SUCCESS
    } else {
        println!("defect present: b's frontend went with a");
        std::process::ExitCode::FAILURE
    }
}
