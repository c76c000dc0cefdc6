//! The binary in each kernel mode, end to end: the whole flow table with real packets, in
//! iptables mode on both backends, and switching modes back and forth on one node, where each
//! start must remove what the other mode left (after its own first sync) and traffic must work
//! after every start; and every ordered pair of modes switched under traffic, dropping no
//! connection.

use std::time::Duration;

use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
mod switching;
use common::{assert_flows, eventually, metric_sum, temp_dir, write_atomically, PROGRAMMED};

/// How long a stopped userspace proxy serves on with its rules in place (no other proxy takes
/// over in these tests): short, so each stop is quick (the switching test keeps the default).
const DRAIN: &str = "--userspace-drain-timeout=1s";

fn start(lab: &Lab, mode: &str, dir: &std::path::Path) -> ChildGuard {
    let mut proxy = common::spawn_proxy_in_mode(
        lab,
        mode,
        &[],
        &["--manifests", dir.to_str().unwrap(), DRAIN],
    );
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{mode}: first sync: {e}\n{}", proxy.log()));
    proxy
}

/// Our iptables chains on one backend (`nft` or `legacy`), both families.
fn kube_chains(lab: &Lab, backend: &str) -> Vec<String> {
    let mut out = Vec::new();
    for save in ["iptables", "ip6tables"] {
        let text = lab
            .node()
            .run(&[&format!("{save}-{backend}-save")])
            .unwrap_or_default();
        out.extend(
            text.lines()
                .filter(|l| l.starts_with(":KUBE-"))
                .map(|l| format!("{save}: {}", l.split_whitespace().next().unwrap_or(""))),
        );
    }
    out
}

fn nft_tables(lab: &Lab) -> String {
    lab.node()
        .run(&["nft", "list", "tables"])
        .unwrap_or_default()
}

/// Whether `mode` has state in the node's kernel. Every registry mode must be known here: a
/// new mode joins the switching test by saying how to see its state.
fn has_state(lab: &Lab, mode: &str) -> bool {
    match mode {
        "nftables" => nft_tables(lab)
            .lines()
            .any(|l| l == "table ip kube-proxy" || l == "table ip6 kube-proxy"),
        "userspace" => nft_tables(lab)
            .lines()
            .any(|l| l == "table inet kube-proxy-userspace"),
        "iptables" => !kube_chains(lab, "nft").is_empty() || !kube_chains(lab, "legacy").is_empty(),
        "ipvs" => lab.node().ip(&["link", "show", "kube-ipvs0"]).is_ok(),
        other => panic!("the switching test does not know how to see {other} mode's state"),
    }
}

fn iptables_mode_serves_the_flow_table(backend: &str) {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(backend == "legacy");
    let dir = temp_dir(&format!("ipt-{backend}"));
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start(&lab, "iptables", &dir.0);
    assert!(
        proxy.log().contains(&format!("backend=\"{backend}\""))
            || proxy.log().contains(&format!("backend={backend}")),
        "the backend choice is logged:\n{}",
        proxy.log()
    );
    let other = if backend == "nft" { "legacy" } else { "nft" };
    assert!(!kube_chains(&lab, backend).is_empty(), "rules on {backend}");
    assert!(
        kube_chains(&lab, other).is_empty(),
        "nothing on {other}: {:?}",
        kube_chains(&lab, other)
    );
    assert_flows(&lab);

    // Periodic syncs (1 s here) read the tables back and find them equal to the plan.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        metric_sum(
            lab.node(),
            "kubeproxy_rs_iptables_readback_mismatches_total"
        ),
        0.0,
        "{}",
        proxy.log()
    );
    assert!(metric_sum(lab.node(), "kubeproxy_sync_proxy_rules_iptables_total") > 0.0);

    // Someone flushes the nat table: the canary is gone, and the next periodic sync rebuilds.
    let rebuilt_before = proxy.log().matches(PROGRAMMED).count();
    for args in [["-t", "nat", "-F"], ["-t", "nat", "-X"]] {
        let prog = format!("iptables-{backend}");
        let mut cmd = vec![prog.as_str()];
        cmd.extend(args);
        lab.node().run(&cmd).unwrap();
    }
    eventually(
        "the flushed nat table to be rebuilt",
        Duration::from_secs(5),
        || proxy.log().matches(PROGRAMMED).count() > rebuilt_before,
    );
    // The flush is two commands: a periodic sync between `-F` and `-X` still finds the (empty)
    // canary, and its read-back names the missing rules instead. Either way it says why.
    let log = proxy.log();
    assert!(
        log.contains("KUBE-PROXY-CANARY chain is gone")
            || log.contains("iptables rules differ from the plan; repairing"),
        "the rebuild says why:\n{log}"
    );
    assert!(kube_chains(&lab, backend)
        .iter()
        .any(|c| c.contains("KUBE-SERVICES")));
    assert_flows(&lab);
    proxy.terminate(Duration::from_secs(5)).unwrap();
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_the_nft_backend_serves_the_flow_table() {
    iptables_mode_serves_the_flow_table("nft");
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_the_legacy_backend_serves_the_flow_table() {
    iptables_mode_serves_the_flow_table("legacy");
}

#[test]
#[ignore = "needs root"]
fn switching_modes_leaves_no_leftovers_and_traffic_works_after_each_start() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let dir = temp_dir("switch");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    // A chain and a table that are not ours, which no start or cleanup may touch.
    lab.node()
        .run(&["iptables-nft", "-t", "nat", "-N", "SOMEONE-ELSE"])
        .unwrap();
    lab.node()
        .run(&[
            "iptables-nft",
            "-t",
            "nat",
            "-A",
            "SOMEONE-ELSE",
            "-j",
            "RETURN",
        ])
        .unwrap();
    lab.node()
        .run(&["nft", "add", "table", "inet", "someone-else"])
        .unwrap();

    // Every mode in the registry, then the first again: each start removes what every other
    // mode left, and traffic works after it.
    // ipvs mode runs iptables mode on a kernel without IPVS (ipvs_fallback_e2e shows it; the
    // VM tests prove the mode): here it switches only where the kernel has IPVS.
    let ipvs_here = std::path::Path::new("/proc/net/ip_vs").exists()
        || std::process::Command::new("modprobe")
            .args(["-n", "ip_vs"])
            .output()
            .is_ok_and(|o| o.status.success());
    // ebpf mode acts on a cgroup, not on a network namespace: the lab's clients run outside
    // any cgroup it could attach to, and its pins live on the machine's bpffs. Its start,
    // restart over pinned state and cleanup are tested in crates/kp-ebpf, on a cgroup and a
    // bpffs of the test's own.
    let names: Vec<&str> = kp_proxy::modes::MODES
        .iter()
        .map(|m| m.name())
        .filter(|m| (*m != "ipvs" || ipvs_here) && *m != "ebpf")
        .collect();
    assert!(names.len() >= 2, "{names:?}");
    let mut order = names.clone();
    order.push(names[0]);
    for (i, mode) in order.iter().enumerate() {
        let mut proxy = start(&lab, mode, &dir.0);
        assert!(has_state(&lab, mode), "{mode} programmed nothing");
        // The other modes' leftovers go after the first sync.
        proxy
            .wait_for_log(switching::LEFTOVERS_GONE, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{mode}: leftovers: {e}\n{}", proxy.log()));
        for other in names.iter().filter(|o| *o != mode) {
            // The first start finds nothing of anyone; later ones find the previous mode's.
            assert!(
                !has_state(&lab, other),
                "start {i}: {mode} mode left {other} mode's state in place"
            );
        }
        assert_flows(&lab);
        // A plain stop ends on its own (userspace: at its 1 s drain timeout, its rules staying).
        let stopping = std::time::Instant::now();
        let status = proxy.terminate(Duration::from_secs(10)).unwrap();
        assert!(
            status.success() && stopping.elapsed() < Duration::from_secs(5),
            "{mode}: stop took {:?}: {status:?}\n{}",
            stopping.elapsed(),
            proxy.log()
        );
        assert!(has_state(&lab, mode), "{mode}: rules stay after a stop");
    }

    // --cleanup removes every mode's state, and only ours.
    lab.node()
        .run(&[env!("CARGO_BIN_EXE_kube-proxy"), "--cleanup"])
        .expect("kube-proxy --cleanup");
    for mode in &names {
        assert!(!has_state(&lab, mode), "--cleanup left {mode} mode's state");
    }
    assert!(nft_tables(&lab).contains("someone-else"));
    let nat = lab.node().run(&["iptables-nft-save", "-t", "nat"]).unwrap();
    assert!(
        nat.contains(":SOMEONE-ELSE") && nat.contains("-A SOMEONE-ELSE -j RETURN"),
        "{nat}"
    );
    assert!(kube_chains(&lab, "nft").is_empty());
}

/// The modes the host can switch between under traffic: every registry mode but ebpf (its
/// socket hooks act on a cgroup, not on the lab's namespaces) and ipvs where the kernel has no
/// IPVS (its pairs run in the kp-vm guest, `ipvs_vm_e2e.rs`).
fn host_switch_modes() -> Vec<&'static str> {
    let ipvs_here = std::path::Path::new("/proc/net/ip_vs").exists();
    kp_proxy::modes::MODES
        .iter()
        .map(|m| m.name())
        .filter(|m| (*m != "ipvs" || ipvs_here) && *m != "ebpf")
        .collect()
}

#[test]
#[ignore = "needs root"]
fn switching_between_every_pair_of_modes_drops_no_connection() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("switch-traffic");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let sw = switching::Switcher {
        lab: &lab,
        dir: &dir.0,
        extra: &[],
        first_sync: Duration::from_secs(60),
    };
    let modes = host_switch_modes();
    assert!(modes.len() >= 2, "{modes:?}");
    let order = switching::every_pair(&modes);
    eprintln!("switching {}", order.join(" -> "));
    let mut proxy = sw.start(order[0]);
    proxy
        .wait_for_log(switching::LEFTOVERS_GONE, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", order[0], proxy.log()));
    let mut failed = Vec::new();
    for w in order.windows(2) {
        let (next, seen) = switching::switch(&sw, proxy, w[0], w[1], Duration::from_secs(5));
        proxy = next;
        // Every pair to the same bar. A stopping userspace proxy serves on while its redirect
        // rules send connections to it, so leaving userspace mode refuses nothing: the next
        // mode removes the rules after its first sync, and the old proxy then lets its relays
        // finish and exits on its own (`switching::stop`, `Seen::old`).
        let problems = seen.problems();
        eprintln!(
            "{} [{}]",
            seen.summary(),
            if problems.is_empty() { "ok" } else { "FAILED" }
        );
        // The old mode's state is gone once the new mode has taken over.
        if has_state(&lab, w[0]) {
            failed.push(format!(
                "{} -> {}: {} mode's state is left",
                w[0], w[1], w[0]
            ));
        }
        failed.extend(problems.into_iter().map(|p| format!("{}: {p}", seen.pair)));
    }
    proxy.terminate(Duration::from_secs(5)).unwrap();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
