//! How long the real API server takes to answer one EndpointSlice replace, as the benchmark's
//! writer sends it, one write at a time with a pause between: a measurement, never a test.
//!
//! `cargo run --release -p kp-test --example write-latency -- [WRITES] [PAUSE_MS]`

use std::time::{Duration, Instant};

use kp_test::kube_apiserver::KubeApiServer;
use serde_json::json;

fn slice(n: usize) -> serde_json::Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-1",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "web"}
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        "endpoints": (0..10).map(|i| json!({
            "addresses": [format!("10.1.{}.{}", n % 250, i + 1)],
            "conditions": {"ready": true}
        })).collect::<Vec<_>>()
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let writes = args.first().copied().unwrap_or(30) as usize;
    let pause = Duration::from_millis(args.get(1).copied().unwrap_or(200));
    let server = KubeApiServer::start()?;
    server.load(vec![slice(0)], 1)?;
    let mut ms = Vec::new();
    for n in 1..=writes {
        std::thread::sleep(pause);
        let t = Instant::now();
        server.replace(&slice(n))?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "writes: {}",
        ms.iter()
            .map(|m| format!("{m:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    ms.sort_by(f64::total_cmp);
    println!(
        "p50 {:.1} ms, max {:.1} ms over {writes} writes {pause:?} apart",
        ms[ms.len() / 2],
        ms[ms.len() - 1]
    );
    Ok(())
}
