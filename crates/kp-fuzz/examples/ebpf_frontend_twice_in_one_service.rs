//! An open defect found by `kp-fuzz`, reproduced: `cargo run -p kp-fuzz --example
//! ebpf_frontend_twice_in_one_service` prints what it sees and exits 1 while the defect is
//! there.
//!
//! One Service lists the same port and protocol twice under two port names (the manifest
//! source does not refuse it), so both Service ports want the frontend `10.96.1.1:80/TCP`.
//! The ebpf planner's `set_service` plans the two specs one after the other into one batch and
//! then sorts the batch by kind of operation: the second spec's deletion of a backend slot the
//! first one wrote goes after the write, so the maps lose slots the planner's record holds
//! (the frontend's count says more backends than its slots have). The mode's next full sync
//! (at the latest its periodic one) writes them back. An example, not a test: CI runs ignored
//! tests too, and this one fails until the planner is fixed (then it becomes a test in
//! `tests/known_defects.rs`).

use kp_core::model::ServiceKey;
use kp_core::track::{Object, ProxyState, SourceEvent};
use kp_ebpf_plan::{service_specs, Contents, Planner};
use serde_json::json;

fn apply(state: &mut ProxyState, v: serde_json::Value) {
    let o = match v["kind"].as_str() {
        Some("Service") => Object::Service(Box::new(serde_json::from_value(v).expect("Service"))),
        _ => Object::EndpointSlice(Box::new(serde_json::from_value(v).expect("slice"))),
    };
    let _ = state.apply(SourceEvent::Upsert(o));
}

/// The endpoints of Service port `port` (`a` on 8080, `b` on 9090), in a slice of its own.
fn slice(port: &str, ips: &[&str]) -> serde_json::Value {
    let eps: Vec<serde_json::Value> = ips.iter().map(|ip| json!({"addresses": [ip]})).collect();
    let number = if port == "a" { 8080 } else { 9090 };
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("twice-{port}"), "namespace": "default",
            "labels": {"kubernetes.io/service-name": "twice"}},
        "addressType": "IPv4",
        "ports": [{"name": port, "protocol": "TCP", "port": number}],
        "endpoints": eps})
}

fn main() -> std::process::ExitCode {
    let mut state = ProxyState::new("node-a");
    apply(
        &mut state,
        json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "twice", "namespace": "default"},
            "spec": {"clusterIP": "10.96.1.1", "ports": [
                {"name": "a", "protocol": "TCP", "port": 80, "targetPort": 8080},
                {"name": "b", "protocol": "TCP", "port": 80, "targetPort": 9090}]}}),
    );
    let key = ServiceKey::new("default", "twice");
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    let mut worst = 0;
    // Port b (planned last) holds the frontend with two backends; then port a shrinks to one:
    // a's spec deletes slot 2, b's writes it again, and the batch's order puts the delete last.
    for (a, b) in [
        (
            &["10.244.1.1", "10.244.1.2"][..],
            &["10.244.1.3", "10.244.1.4"][..],
        ),
        (&["10.244.1.1"][..], &["10.244.1.3", "10.244.1.4"][..]),
    ] {
        apply(&mut state, slice("a", a));
        apply(&mut state, slice("b", b));
        let ops = planner
            .set_service(&key, &service_specs(&state, &key, &[]))
            .expect("ids");
        for op in &ops {
            maps.apply(op);
        }
        let missing = kp_fuzz_diff(&maps, &planner.contents());
        println!(
            "a {a:?}, b {b:?}: {missing} entries of the planner's record missing from the maps"
        );
        worst = worst.max(missing);
    }
    if worst == 0 {
        println!("fixed: move this reproducer into tests/known_defects.rs");
        std::process::ExitCode::SUCCESS
    } else {
        println!("defect present: the batch's order loses slots of a frontend listed twice");
        std::process::ExitCode::FAILURE
    }
}

/// How many updates would bring `have` to `want`.
fn kp_fuzz_diff(have: &Contents, want: &Contents) -> usize {
    kp_ebpf_plan::diff(have, want).len()
}
