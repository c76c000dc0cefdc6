//! One-off scale measurement: N services × E endpoints loaded into a fresh network namespace,
//! then single-endpoint changes. Prints timings; it is a measurement, never a test.
//!
//! `cargo run --release -p kp-nftables --example measure -- 10000 10`
//!
//! `KP_MEASURE_DUMP=PATH` writes the full text transaction to PATH; `KP_MEASURE_ONLY_FULL=1`
//! stops after the first full sync and its read-back; `KP_MEASURE_CHANGES=N` sets the number of
//! one-endpoint changes (default 50); `KP_PERF_CTL=FIFO` writes `enable` and `disable` to a perf
//! control fifo around the changes (scripts/profile.sh profiles them alone);
//! `KP_MEASURE_RESTART=1` measures restarts instead of changes: a new dataplane (a restarted
//! process) syncs full over the table the first one left, with the cluster unchanged and after
//! `KP_MEASURE_CHANGES` one-endpoint changes made while it was down; each both with the read-back
//! inside the sync and with the tables read ahead (`read_ahead`, started 2 s before the sync, as
//! a proxy would while its informers list the cluster); first, for comparison, the replace a
//! restart did before (the all-text path). `KP_MEASURE_CHECK=1` makes the read-back after the
//! first full sync the periodic drift check (`begin_check` and `finish_check`, elements read as
//! digests) instead of `verify` (elements read as tuples); VmHWM is printed after the sync and
//! after the read-back, so the read-back's own peak shows when it is the process's.

use std::sync::Arc;
use std::time::Instant;

use kp_core::track::{Changes, SourceEvent};
use kp_flows::synthetic;
use kp_metrics::Metrics;
use kp_nftables::{NftCommand, NftablesConfig, NftablesDataplane, NodePortAddresses};
use kp_nftables_plan::{ElementBatch, NodeContext, PlanConfig, Planner};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (n, per) = (
        args.first().copied().unwrap_or(10_000),
        args.get(1).copied().unwrap_or(10),
    );
    let ns = format!("kp-measure-{}", std::process::id());
    let ok = std::process::Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .map(|s| s.success());
    assert_eq!(ok.ok(), Some(true), "ip netns add {ns} (needs root)");
    struct Cleanup(String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .status();
        }
    }
    let _cleanup = Cleanup(ns.clone());

    eprintln!("building {n} services x {per} endpoints");
    let mut state = kp_flows::load("node-0", synthetic::cluster(n, per));
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for l in status.lines().filter(|l| l.starts_with("VmRSS")) {
        println!("after loading the state: {l}");
    }

    let t = Instant::now();
    let keys: Vec<_> = state.service_keys().cloned().collect();
    let mut eps = 0;
    for k in &keys {
        eps += state
            .service_state(k)
            .iter()
            .map(|s| s.endpoints.cluster.len())
            .sum::<usize>();
    }
    println!(
        "select endpoints for every service: {:.3} s ({eps} endpoints)",
        t.elapsed().as_secs_f64()
    );

    // Render only, to separate our cost from nft's and the kernel's: all as text (the bare
    // `nft -f` baseline's input), and split as the dataplane sends a fresh table (structure as
    // text, elements as one netlink batch). Each is dropped before the next.
    {
        let t = Instant::now();
        let tx = Planner::new(PlanConfig::new(kp_core::model::IpFamily::V4))
            .full(&state, &NodeContext::default());
        println!(
            "render full as text: {:.3} s, {} operations, {} bytes",
            t.elapsed().as_secs_f64(),
            tx.operations,
            tx.text.len()
        );
        if let Ok(path) = std::env::var("KP_MEASURE_DUMP") {
            std::fs::write(path, &tx.text).expect("dump");
        }
    }
    {
        let t = Instant::now();
        let mut batch = ElementBatch::new();
        let tx = Planner::new(PlanConfig::new(kp_core::model::IpFamily::V4)).full_split(
            &state,
            &NodeContext::default(),
            &mut batch,
        );
        let elements = batch.elements();
        let encoded = batch.finish();
        println!(
            "render full split: {:.3} s, {} bytes of text, {elements} elements in {} netlink messages, {} bytes",
            t.elapsed().as_secs_f64(),
            tx.text.len(),
            encoded.as_ref().map_or(0, |b| b.messages),
            encoded.as_ref().map_or(0, |b| b.bytes.len()),
        );
    }

    let cfg = NftablesConfig {
        node_ports: NodePortAddresses::AllLocal,
        ..NftablesConfig::default()
    };
    let mut dp = NftablesDataplane::new(
        cfg.clone(),
        NftCommand::in_netns(&ns),
        Arc::new(Metrics::new()),
    );
    let t = Instant::now();
    dp.sync(&state, &Changes::default(), true)
        .expect("full sync");
    println!(
        "first full sync (render, nft -f of the structure, one netlink batch of elements): {:.3} s",
        t.elapsed().as_secs_f64()
    );

    print_memory("after the first full sync");

    let t = Instant::now();
    let diffs = if std::env::var("KP_MEASURE_CHECK").is_ok_and(|v| v == "1") {
        // The periodic check as the loop runs it, the read on a thread of its own.
        let read = dp
            .begin_check()
            .expect("the netlink backend reads off the loop");
        let read = std::thread::spawn(read).join().expect("the read");
        let took = t.elapsed().as_secs_f64();
        let cpu = thread_cpu_seconds();
        let outcome = kp_core::dataplane::Dataplane::finish_check(&mut dp, &state, read);
        println!(
            "periodic check (digests): read {took:.3} s, compared {:.3} s ({:.2} s of CPU on the loop's thread), {outcome:?}",
            t.elapsed().as_secs_f64() - took,
            thread_cpu_seconds() - cpu
        );
        match outcome {
            kp_core::dataplane::CheckOutcome::Clean => Vec::new(),
            other => vec![format!("{other:?}")],
        }
    } else {
        dp.verify().expect("verify")
    };
    println!(
        "read-back check: {:.3} s, {} differences",
        t.elapsed().as_secs_f64(),
        diffs.len()
    );
    for d in diffs.iter().take(5) {
        println!("  {d}");
    }
    print_memory("after the read-back check");

    if std::env::var("KP_MEASURE_ONLY_FULL").is_ok_and(|v| v == "1") {
        return;
    }
    if std::env::var("KP_MEASURE_RESTART").is_ok_and(|v| v == "1") {
        drop(dp);
        restart(&ns, &cfg, &mut state, n, per);
        return;
    }
    // scripts/profile.sh profiles the changes alone: it starts perf with sampling off and
    // hands us its control fifo.
    if let Ok(fifo) = std::env::var("KP_PERF_CTL") {
        std::fs::write(&fifo, "enable\n").expect("perf control fifo");
    }
    let changes: usize = std::env::var("KP_MEASURE_CHANGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let mut times = Vec::new();
    for k in 0..changes {
        state
            .apply(SourceEvent::Upsert(synthetic::endpoint_change(k, n, per)))
            .unwrap();
        let changes = state.take_changes();
        let t = Instant::now();
        let r = dp.sync(&state, &changes, false).expect("partial sync");
        times.push((t.elapsed().as_secs_f64() * 1000.0, r.operations));
    }
    if let Ok(fifo) = std::env::var("KP_PERF_CTL") {
        std::fs::write(&fifo, "disable\n").expect("perf control fifo");
    }
    times.sort_by(|a, b| a.0.total_cmp(&b.0));
    let p = |q: f64| times[((times.len() as f64 - 1.0) * q) as usize].0;
    println!(
        "one-endpoint change (render + netlink batch), {changes} changes: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, operations {}..{}",
        p(0.5),
        p(0.99),
        times.last().map_or(0.0, |t| t.0),
        times.iter().map(|t| t.1).min().unwrap_or(0),
        times.iter().map(|t| t.1).max().unwrap_or(0)
    );
    let diffs = dp.verify().expect("verify");
    println!("read-back after the changes: {} differences", diffs.len());
    for d in diffs.iter().take(5) {
        println!("  {d}");
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for l in status
        .lines()
        .filter(|l| l.starts_with("VmHWM") || l.starts_with("VmRSS"))
    {
        println!("{l}");
    }
}

/// CPU time (user and system) of the calling thread so far, from `/proc/thread-self/stat`, in
/// clock ticks of 10 ms: what a comparison costs whatever the machine's load.
fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // The fields after the command name (which is in parentheses and may hold spaces): utime
    // and stime are the 12th and 13th of them.
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    let ticks: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse().ok())
        .collect();
    ticks.iter().sum::<f64>() / 100.0
}

/// Prints the process's peak and current resident memory (VmHWM, VmRSS) after `what`.
fn print_memory(what: &str) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .map(|l| l[name.len()..].trim().to_string())
            .unwrap_or_default()
    };
    println!(
        "memory {what}: VmHWM {}, VmRSS {}",
        field("VmHWM:"),
        field("VmRSS:")
    );
}

/// Restarts over the existing table: unchanged, then after changes made while down.
fn restart(
    ns: &str,
    cfg: &NftablesConfig,
    state: &mut kp_core::track::ProxyState,
    n: usize,
    per: usize,
) {
    let changes: usize = std::env::var("KP_MEASURE_CHANGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    // The replace a restart did before adoption: the all-text path (a stand-in nft program sends
    // everything as text) replaces an existing table in one `nft -f`.
    {
        let mut dp = NftablesDataplane::new(
            cfg.clone(),
            NftCommand::in_netns(ns).with_program("nft"),
            Arc::new(Metrics::new()),
        );
        let t = Instant::now();
        let r = dp
            .sync(state, &Changes::default(), true)
            .expect("replacing sync");
        println!(
            "restart by replacing the table (as before adoption): first sync {:.3} s, {} operations",
            t.elapsed().as_secs_f64(),
            r.operations
        );
    }
    let cases = [
        ("unchanged cluster", 0, false),
        ("unchanged cluster", 0, true),
        ("after changes while down", changes, false),
        ("after more changes while down", changes, true),
    ];
    let mut done = 0;
    for (what, k, ahead) in cases {
        for i in done..done + k {
            state
                .apply(SourceEvent::Upsert(synthetic::endpoint_change(i, n, per)))
                .unwrap();
        }
        done += k;
        let _ = state.take_changes();
        let mut dp = NftablesDataplane::new(
            cfg.clone(),
            NftCommand::in_netns(ns),
            Arc::new(Metrics::new()),
        );
        if ahead {
            dp.read_ahead();
            std::thread::sleep(std::time::Duration::from_secs(2));
        }
        let t = Instant::now();
        let r = dp
            .sync(state, &Changes::default(), true)
            .expect("restart sync");
        let took = t.elapsed().as_secs_f64();
        let tx = dp.last_transaction();
        let netlink = tx
            .lines()
            .find(|l| l.starts_with("# netlink"))
            .unwrap_or("# netlink: none");
        println!(
            "restart, {what} ({k} endpoint changes){}: first sync {took:.3} s, {} operations, {} bytes of nft text, {netlink}",
            if ahead { ", tables read ahead" } else { "" },
            r.operations,
            tx.lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| l.len() + 1)
                .sum::<usize>(),
        );
        let t = Instant::now();
        let diffs = dp.verify().expect("verify");
        println!(
            "  read-back after it: {:.3} s, {} differences",
            t.elapsed().as_secs_f64(),
            diffs.len()
        );
        for d in diffs.iter().take(5) {
            println!("  {d}");
        }
    }
}
