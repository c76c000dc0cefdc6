//! Measures the socket load balancer's costs (root; attaches nothing, pins nothing):
//! program load time, a full sync of N Services × E endpoints, and one-endpoint changes.
//!
//! `cargo run --release -p kp-ebpf --example ebpf-measure -- [SERVICES] [ENDPOINTS]`

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use kp_core::model::{Protocol, ServiceKey};
use kp_ebpf::{MapSizes, SocketLb};
use kp_ebpf_plan::{Backend, FrontendAddr, FrontendSpec, Planner};

fn spec(i: u32, endpoints: u32, skip: Option<u32>) -> FrontendSpec {
    let vip = Ipv4Addr::from(0x0a60_0000 + i);
    FrontendSpec {
        addr: FrontendAddr {
            ip: IpAddr::V4(vip),
            port: 80,
            protocol: Protocol::Tcp,
            scope: kp_ebpf_plan::Scope::Socket,
        },
        backends: (0..endpoints)
            .filter(|e| Some(*e) != skip)
            .map(|e| Backend {
                ip: IpAddr::V4(Ipv4Addr::from(0x0af4_0000 + i * endpoints + e)),
                port: 8080,
                protocol: Protocol::Tcp,
            })
            .collect(),
        drop_when_empty: false,
        affinity: None,
        cluster_ip: true,
        keep_source: false,
        source_ranges: None,
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let services = args.first().copied().unwrap_or(10_000);
    let endpoints = args.get(1).copied().unwrap_or(10);
    let frontends = services * (endpoints + 1);
    let sizes = MapSizes {
        services: frontends.max(1024),
        backends: (services * endpoints).max(1024),
        rev_nat: services.clamp(1024, 65535),
        sockets: 65536,
        addrs: services.max(1024),
        affinity: 1024,
        src_ranges: 1024,
        connections: 1024,
    };

    let mut loads = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        drop(SocketLb::load(sizes, None)?);
        loads.push(t.elapsed());
    }
    loads.sort();
    println!(
        "load (object + 8 programs, verifier): median {:?} of 5",
        loads[2]
    );

    let mut lb = SocketLb::load(sizes, None)?;
    let mut planner = Planner::new();
    let t = Instant::now();
    let mut ops_total = 0;
    let mut plan_time = Duration::ZERO;
    for i in 0..services {
        let p = Instant::now();
        let ops = planner.set_service(
            &ServiceKey::new("m", format!("s{i}")),
            &[spec(i, endpoints, None)],
        )?;
        plan_time += p.elapsed();
        ops_total += ops.len();
        lb.apply(&ops)?;
    }
    println!(
        "full sync {services} Services x {endpoints} endpoints: {ops_total} map updates, {:?} ({:?} planning)",
        t.elapsed(),
        plan_time
    );

    let mut plan = Vec::new();
    let mut apply = Vec::new();
    let mut counts = Vec::new();
    for round in 0..400u32 {
        // Even rounds remove one endpoint of a Service, odd rounds put it back.
        let i = ((round / 2) * 7919) % services;
        let skip = (round % 2 == 0).then_some((round / 2) % endpoints);
        let name = ServiceKey::new("m", format!("s{i}"));
        let p = Instant::now();
        let ops = planner.set_service(&name, &[spec(i, endpoints, skip)])?;
        plan.push(p.elapsed());
        let a = Instant::now();
        lb.apply(&ops)?;
        apply.push(a.elapsed());
        counts.push(ops.len());
    }
    plan.sort();
    apply.sort();
    counts.sort();
    println!(
        "one-endpoint change at {services} Services: plan p50 {:?} p99 {:?}; apply p50 {:?} p99 {:?}; updates per change {}..={}",
        pct(&plan, 0.5),
        pct(&plan, 0.99),
        pct(&apply, 0.5),
        pct(&apply, 0.99),
        counts[0],
        counts[counts.len() - 1]
    );
    let t = Instant::now();
    let back = lb.read_back()?;
    println!(
        "read back {} services entries, {} backends: {:?}; matches the plan: {}",
        back.services.len(),
        back.backends.len(),
        t.elapsed(),
        back == planner.contents()
    );
    Ok(())
}
