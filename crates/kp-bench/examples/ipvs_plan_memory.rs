//! How much heap the ipvs mode's planner holds for the benchmark's cluster, and how much a
//! full sync's plan adds on top (no kernel: the diff is against an empty dump and no sets).
//!
//! `cargo run --release -p kp-bench --example ipvs_plan_memory -- 10000`

use kp_core::model::IpFamily;
use kp_core::node::NodeContext;
use kp_ipvs_plan::planner::Planner;
use kp_ipvs_plan::{ipset, Config, Planned as _};

/// `VmRSS` and `VmHWM` of this process, bytes.
fn memory() -> (usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| {
                v.trim()
                    .trim_end_matches(" kB")
                    .trim()
                    .parse::<usize>()
                    .ok()
            })
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn report(what: &str, base: usize) {
    let (now, peak) = memory();
    println!(
        "{what:<40} RSS {:>8.1} MiB (peak {:>8.1} MiB), above the state {:>8.1} MiB",
        mib(now),
        mib(peak),
        mib(now.saturating_sub(base))
    );
}

fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(10_000);
    let cluster = kp_test::cluster::Cluster::new(n, 10);
    let state = kp_bench::cluster::load_state(cluster.manifests())?;
    let base = memory().0;
    report("the proxy's state", base);
    let node = NodeContext::resolve(
        &kp_core::node::DetectLocal::ClusterCidr(vec![kp_test::cluster::CLUSTER_CIDR.parse()?]),
        &kp_core::node::NodePortAddresses::AllLocal,
        &state,
    );
    let node_addresses = vec!["192.0.2.10".parse()?];
    let config = Config::new("rr", 0, Vec::new())?;
    let mut planner = Planner::new(&[IpFamily::V4]);
    let mut delta = planner.untracked();
    planner.set_all(
        state.service_keys().map(|k| (k, state.service_state(k))),
        &node_addresses,
        &node,
        &config,
        &mut delta,
    );
    report("planner (a full sync's untracked delta)", base);
    let virtual_servers = planner.virtual_servers().count();
    let destinations: usize = planner
        .virtual_servers()
        .map(|(_, v)| v.destinations.len())
        .sum();
    drop(delta);
    report("planner", base);
    if std::env::args().any(|a| a == "--planner-only") {
        return Ok(());
    }
    // As the dataplane's full sync does it: a few hundred virtual servers' changes at a time,
    // the sets' changes written out as they come.
    let kernel = Vec::new();
    let dump = kp_ipvs_plan::Dump::index(&kernel);
    let keys: Vec<_> = dump.all_keys(&planner).into_iter().collect();
    let mut changes = 0;
    for part in keys.chunks(256) {
        let mut plan = kp_ipvs_plan::Plan::default();
        dump.diff_into(&planner, part.iter(), &config, &mut plan);
        changes += plan.changes.len();
    }
    report("+ the full diff against nothing, in parts", base);
    let none = ipset::Sets::new(IpFamily::V4);
    let mut text = Vec::new();
    let set_changes = ipset::write_restore(
        &mut text,
        IpFamily::V4,
        ipset::changes(&planner.sets()[0], &none),
    )?;
    report("+ the sets' restore text (held here)", base);
    // A periodic sync reads `ipset save` into this; its lines are the restore text's.
    let saved = ipset::Saved::read(&[IpFamily::V4], &text[..])?;
    report("+ those sets read back as ipset::Saved", base);
    drop(saved);
    println!(
        "{n} Services: {virtual_servers} virtual servers, {destinations} real servers, {changes} IPVS changes, {set_changes} set changes, restore text {:.1} MiB",
        mib(text.len())
    );
    Ok(())
}
