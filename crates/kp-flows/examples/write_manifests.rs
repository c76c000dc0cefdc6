//! Prints a cluster as one JSON `v1 List` for the manifest-directory source: the flow fixture,
//! or with `N PER` a synthetic cluster of N Services with PER endpoints each.
//!
//! `cargo run -p kp-flows --example write_manifests -- 10000 10 > dir/cluster.json`

use kp_core::track::Object;
use serde_json::{json, Value};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let Some(&n) = args.first() else {
        println!("{}", kp_flows::manifest_list());
        return;
    };
    let per = args.get(1).copied().unwrap_or(10);
    let items: Vec<Value> = kp_flows::synthetic::cluster(n, per)
        .into_iter()
        .map(|o| match o {
            Object::Service(s) => {
                let mut v = serde_json::to_value(*s).unwrap_or_default();
                v["apiVersion"] = json!("v1");
                v["kind"] = json!("Service");
                v
            }
            Object::EndpointSlice(s) => {
                let mut v = serde_json::to_value(*s).unwrap_or_default();
                v["apiVersion"] = json!("discovery.k8s.io/v1");
                v["kind"] = json!("EndpointSlice");
                v
            }
            Object::Node(n) => serde_json::to_value(*n).unwrap_or_default(),
        })
        .collect();
    println!(
        "{}",
        json!({"apiVersion": "v1", "kind": "List", "items": items})
    );
}
