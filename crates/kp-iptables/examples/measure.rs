//! One-off scale measurement: N Services × E endpoints loaded into a fresh network namespace
//! with each iptables backend, then single-endpoint changes. Prints timings; it is a
//! measurement, never a test.
//!
//! `cargo run --release -p kp-iptables --example iptables-measure -- 10000 10 [nft] [legacy] [none]`
//! (both backends unless named; `none` only renders).
//!
//! `KP_STEP_CHAINS=N` sets the chains per restore input with the nft backend;
//! `KP_MEASURE_VERIFY=0` skips the read-back checks; `KP_MEASURE_DUMP=PATH` writes the full
//! restore input to PATH, its nft steps to PATH.NNNN and the first partial restore to
//! PATH.partial; `KP_MEASURE_ONLY_FULL=1` stops after
//! the first full sync; `KP_MEASURE_ONLY_RESTART=1` after the restarts; `KP_PERF_CTL=FIFO`
//! writes `enable` and `disable` to a perf control fifo around the changes, or with
//! `KP_PERF_WHAT=restart` around the adopting restart (scripts/profile.sh profiles them alone;
//! name one backend then). `RUST_LOG=kp_iptables=debug` shows the dataplane's log.
//!
//! The restart: after the first full sync, a new dataplane (a restarted process, knowing
//! nothing) syncs the same state over the table, once rewriting every chain (adoption off, as
//! before adoption) and once adopting (read back, send only what differs). The adopting one
//! then takes the changes, so they also show that its planner is programmed.

use std::sync::Arc;
use std::time::Instant;

use kp_core::model::IpFamily;
use kp_core::node::NodeContext;
use kp_core::track::{Changes, SourceEvent};
use kp_flows::synthetic;
use kp_iptables::{
    Backend, IptablesCommand, IptablesConfig, IptablesDataplane, NodePortAddresses,
    DEFAULT_STEP_CHAINS,
};
use kp_iptables_plan::{PlanConfig, Planner};
use kp_metrics::Metrics;

struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("kp-measure-{}-{tag}", std::process::id());
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .map(|s| s.success());
        assert_eq!(ok.ok(), Some(true), "ip netns add {name} (needs root)");
        Netns(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

fn rss(what: &str) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for l in status
        .lines()
        .filter(|l| l.starts_with("VmHWM") || l.starts_with("VmRSS"))
    {
        println!("{what}: {l}");
    }
}

/// Counts bytes written.
struct Bytes(usize);

impl std::io::Write for Bytes {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes `what` to the perf control fifo `KP_PERF_CTL`, if set.
fn perf_ctl(what: &str) {
    if let Ok(fifo) = std::env::var("KP_PERF_CTL") {
        std::fs::write(&fifo, format!("{what}\n")).expect("perf control fifo");
    }
}

/// Resets VmHWM (`/proc/self/clear_refs`, Linux 4.0+), so the next peak is of what follows.
fn reset_peak() {
    if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
        eprintln!("cannot reset the peak RSS: {e}");
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let numbers: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let (n, per) = (
        numbers.first().copied().unwrap_or(10_000),
        numbers.get(1).copied().unwrap_or(10),
    );
    let mut backends: Vec<Backend> = args
        .iter()
        .filter_map(|a| match a.as_str() {
            "nft" => Some(Backend::Nft),
            "legacy" => Some(Backend::Legacy),
            _ => None,
        })
        .collect();
    if backends.is_empty() && !args.iter().any(|a| a == "none") {
        backends = Backend::ALL.to_vec();
    }
    let step_chains = std::env::var("KP_STEP_CHAINS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_STEP_CHAINS);
    let verify = std::env::var("KP_MEASURE_VERIFY").map_or(true, |v| v != "0");

    eprintln!("building {n} services x {per} endpoints");
    rss("start");
    let state0 = kp_flows::load("node-0", synthetic::cluster(n, per));
    rss("after loading the state");

    // Render only, to separate our cost from the tools' and the kernel's.
    let t = Instant::now();
    let restore =
        Planner::new(PlanConfig::new(IpFamily::V4)).full(&state0, &NodeContext::default());
    let render = t.elapsed().as_secs_f64();
    // Streamed into a byte counter, as the dataplane streams it into iptables-restore.
    let t = Instant::now();
    let mut bytes = Bytes(0);
    restore
        .write_input(&restore.whole(), &[], &mut bytes)
        .expect("counting");
    let write = t.elapsed().as_secs_f64();
    println!(
        "render full: plan (render, record digests) {render:.3} s, input (render again, streamed) {write:.3} s; {} chains, {} rules, {} bytes; {} inputs of <= {step_chains} chains with nft",
        restore.chain_count(),
        restore.rule_count(),
        bytes.0,
        restore.inputs(step_chains).len(),
    );
    if let Ok(path) = std::env::var("KP_MEASURE_DUMP") {
        std::fs::write(&path, restore.text()).expect("dump");
        for (i, step) in restore.steps(step_chains).iter().enumerate() {
            std::fs::write(format!("{path}.{i:04}"), step).expect("dump");
        }
    }
    drop(restore);
    // Only one state from here on, as in the proxy; the peak from here on is the dataplane's.
    drop(state0);
    reset_peak();

    for backend in backends {
        let mut state = kp_flows::load("node-0", synthetic::cluster(n, per));
        rss(&format!("[{backend}] state loaded"));
        let ns = Netns::new(backend.as_str());
        let cfg = IptablesConfig {
            families: vec![IpFamily::V4],
            node_ports: NodePortAddresses::AllLocal,
            backend,
            step_chains,
            ..IptablesConfig::default()
        };
        let cmd = IptablesCommand::in_netns(&ns.0).with_wait_seconds(600);
        let mut dp = IptablesDataplane::new(cfg, cmd, Arc::new(Metrics::new()));
        let t = Instant::now();
        let r = dp
            .sync(&state, &Changes::default(), true)
            .expect("full sync");
        println!(
            "[{backend}] first full sync (render + restore + canaries + jumps): {:.3} s, {} operations",
            t.elapsed().as_secs_f64(),
            r.operations
        );
        rss(&format!("[{backend}] after the first full sync"));
        if std::env::var("KP_MEASURE_ONLY_FULL").is_ok_and(|v| v == "1") {
            continue;
        }
        if verify {
            let t = Instant::now();
            let diffs = dp.verify().expect("verify");
            println!(
                "[{backend}] read-back check: {:.3} s, {} differences",
                t.elapsed().as_secs_f64(),
                diffs.len()
            );
            for d in diffs.iter().take(5) {
                println!("    {d}");
            }
        }

        // The restart: a new process over what the first one programmed.
        let perf_restart = std::env::var("KP_PERF_WHAT").is_ok_and(|w| w == "restart");
        for (adopt, down) in [(false, 0), (true, 0), (true, 50)] {
            // Changes made while the process was down (another stream than the changes
            // measured below).
            for k in 0..down {
                state
                    .apply(SourceEvent::Upsert(synthetic::endpoint_change(
                        1000 + k,
                        n,
                        per,
                    )))
                    .unwrap();
            }
            state.take_changes();
            let cfg = IptablesConfig {
                adopt,
                ..dp.config().clone()
            };
            let cmd = IptablesCommand::in_netns(&ns.0).with_wait_seconds(600);
            let mut restarted = IptablesDataplane::new(cfg, cmd, Arc::new(Metrics::new()));
            rss(&format!("[{backend}] before restart (adopt: {adopt})"));
            reset_peak();
            if adopt && down == 0 && perf_restart {
                perf_ctl("enable");
            }
            let t = Instant::now();
            let r = restarted
                .sync(&state, &Changes::default(), true)
                .expect("restart");
            let took = t.elapsed().as_secs_f64();
            if adopt && down == 0 && perf_restart {
                perf_ctl("disable");
            }
            rss(&format!("[{backend}] after restart (adopt: {adopt})"));
            let label = match (adopt, down) {
                (false, _) => "rewriting every chain (adoption off)".to_string(),
                (true, 0) => "adopting an unchanged table".to_string(),
                (true, d) => format!("adopting after {d} one-endpoint changes while down"),
            };
            println!(
                "[{backend}] restart, {label}: {took:.3} s, {} operations",
                r.operations
            );
            for a in restarted.last_adoption() {
                println!(
                    "    {:?}: plan {:.3} s, read {:.3} s (while planning), compare + send {:.3} s; {} chains planned, {} kept, {} written, {} deleted{}",
                    a.family,
                    a.plan.as_secs_f64(),
                    a.read.as_secs_f64(),
                    a.send.as_secs_f64(),
                    a.planned,
                    a.kept,
                    a.written,
                    a.deleted,
                    a.fallback.as_ref().map(|f| format!(" ({f})")).unwrap_or_default()
                );
            }
            if adopt {
                dp = restarted;
            }
        }
        rss(&format!("[{backend}] after the restarts"));
        if verify {
            let t = Instant::now();
            let diffs = dp.verify().expect("verify");
            println!(
                "[{backend}] read-back after the restarts: {:.3} s, {} differences",
                t.elapsed().as_secs_f64(),
                diffs.len()
            );
        }
        if std::env::var("KP_MEASURE_ONLY_RESTART").is_ok_and(|v| v == "1") {
            continue;
        }

        if !perf_restart {
            perf_ctl("enable");
        }
        let mut times = Vec::new();
        for k in 0..50 {
            state
                .apply(SourceEvent::Upsert(synthetic::endpoint_change(k, n, per)))
                .unwrap();
            let changes = state.take_changes();
            let t = Instant::now();
            let r = dp.sync(&state, &changes, false).expect("partial sync");
            times.push((t.elapsed().as_secs_f64() * 1000.0, r.operations));
            if k == 0 {
                if let Ok(path) = std::env::var("KP_MEASURE_DUMP") {
                    std::fs::write(format!("{path}.partial"), dp.last_inputs().join(""))
                        .expect("dump");
                }
            }
        }
        if !perf_restart {
            perf_ctl("disable");
        }
        times.sort_by(|a, b| a.0.total_cmp(&b.0));
        let p = |q: f64| times[((times.len() as f64 - 1.0) * q).round() as usize].0;
        println!(
            "[{backend}] one-endpoint change (render + restore), 50 changes: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, operations {}..{}",
            p(0.5),
            p(0.99),
            times.last().map_or(0.0, |t| t.0),
            times.iter().map(|t| t.1).min().unwrap_or(0),
            times.iter().map(|t| t.1).max().unwrap_or(0)
        );
        if verify {
            let t = Instant::now();
            let diffs = dp.verify().expect("verify");
            println!(
                "[{backend}] read-back after the changes: {:.3} s, {} differences",
                t.elapsed().as_secs_f64(),
                diffs.len()
            );
        }
        let t = Instant::now();
        let r = dp
            .sync(&state, &Changes::default(), true)
            .expect("periodic sync");
        println!(
            "[{backend}] periodic full sync (canary + read-back, nothing to repair): {:.3} s, rebuilt: {}",
            t.elapsed().as_secs_f64(),
            r.full
        );
        // Drift behind our back: the next periodic sync finds it and rebuilds a table that is
        // programmed and reachable from the hooks (every commit then re-validates it).
        let ok = std::process::Command::new("ip")
            .args(["netns", "exec", &ns.0])
            .arg(backend.program(IpFamily::V4, ""))
            .args(["-w", "600", "-t", "nat", "-D", "KUBE-POSTROUTING", "1"])
            .status()
            .map(|s| s.success());
        assert_eq!(ok.ok(), Some(true), "deleting a rule by hand");
        let t = Instant::now();
        let r = dp
            .sync(&state, &Changes::default(), true)
            .expect("repairing sync");
        println!(
            "[{backend}] periodic sync that finds drift and rebuilds everything: {:.3} s, rebuilt: {}",
            t.elapsed().as_secs_f64(),
            r.full
        );
        rss(&format!("[{backend}] after the rebuild"));
        let t = Instant::now();
        dp.cleanup().expect("cleanup");
        println!("[{backend}] cleanup: {:.3} s", t.elapsed().as_secs_f64());
    }
    rss("end");
}
