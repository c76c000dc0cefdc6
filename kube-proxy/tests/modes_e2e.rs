//! The binary in each kernel mode, end to end: the whole flow table with real packets, in
//! iptables mode on both backends, and switching modes back and forth on one node, where each
//! start must remove what the other mode left (after its own first sync) and traffic must work
//! after every start; and every ordered pair of modes switched under traffic, dropping no
//! connection.

use std::time::Duration;

use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
mod ebpf_lab;
mod switching;
use common::{assert_flows, eventually, metric_sum, temp_dir, write_atomically, PROGRAMMED};

/// The switching-under-traffic test runs alone, every other kernel test here shares: its bar is
/// the 100 ms pause (`switching::MAX_GAP`), which a machine whose two cores the other
/// tests load can miss (scheduling, not rules).
static ALONE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    ALONE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How long a stopped userspace proxy serves on with its rules in place (no other proxy takes
/// over in these tests): short, so each stop is quick (the switching test keeps the default).
const DRAIN: &str = "--userspace-drain-timeout=1s";

fn start(lab: &Lab, mode: &str, dir: &std::path::Path, extra: &[&str]) -> ChildGuard {
    let mut source = vec!["--manifests", dir.to_str().unwrap(), DRAIN];
    source.extend_from_slice(extra);
    let mut proxy = common::spawn_proxy_in_mode(lab, mode, &[], &source);
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
/// new mode joins the switching test by saying how to see its state. ebpf mode's is seen in the
/// test's sandbox: anything pinned in its pin directory, a program on the cgroup's socket
/// hooks or a tcx program on the node's interfaces ([`ebpf_lab::Sandbox::state`]); and in the
/// node's namespace, the table that keeps the NAT hooks.
fn has_state(lab: &Lab, sandbox: Option<&ebpf_lab::Sandbox>, mode: &str) -> bool {
    match mode {
        "ebpf" => {
            let sandbox = sandbox.expect("ebpf mode's state is seen in the test's sandbox");
            let state = sandbox.mode_state(lab);
            if !state.is_empty() {
                eprintln!("  ebpf mode's state: {}", state.join("; "));
            }
            !state.is_empty()
        }
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
    let _shared = shared();
    let (lab, _echo) = common::serving_lab(backend == "legacy");
    let dir = temp_dir(&format!("ipt-{backend}"));
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start(&lab, "iptables", &dir.0, &[]);
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
    let _shared = shared();
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
    let names: Vec<&str> = kp_proxy::modes::MODES
        .iter()
        .map(|m| m.name())
        .filter(|m| *m != "ipvs" || ipvs_here)
        .collect();
    assert!(names.len() >= 2, "{names:?}");
    // ebpf mode acts on a cgroup, not on a network namespace: its socket hooks go on a cgroup
    // of the test's, which the node's and the pods' processes join, and its pins on a bpffs of
    // the test's; the outside client stays out (another host's sockets), so its rows meet the
    // tc path. Every mode, and --cleanup, gets the pin directory: where ebpf's leftovers are.
    let sandbox = names
        .contains(&"ebpf")
        .then(|| ebpf_lab::Sandbox::new("leftovers"));
    let flags = sandbox.as_ref().map(|s| s.flags()).unwrap_or_default();
    if let Some(sandbox) = &sandbox {
        sandbox.admit(&lab);
        lab.client().place_in_cgroup(None);
    }
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    let sandbox = sandbox.as_ref();
    let mut order = names.clone();
    order.push(names[0]);
    // Each start's connections take local ports no earlier start's took. ebpf's socket hooks
    // connect a pod straight to a backend, the other modes translate the Service's address: a
    // backend's TIME_WAIT of one start's connection meets the next start's SYN from the same
    // client port with another timestamp base and answers it with an ACK, not a SYN-ACK
    // (measured in the backends' PAWSTimewait: 11 in ebpf's start and 8 in the start after
    // it, 0 in the others; one connection that never got its SYN-ACK timed out once in CI).
    // With a port range per start: 1 after ebpf, like the steady 0 to 1 of the others (the
    // masqueraded NodePort rows, `switching`), 3 to 5 in ebpf's own start, whose socket hooks
    // and translated paths both carry one pod's connections. The switching test holds the
    // switch's transient (`switching::EBPF_FAILURES_PER_MILLE`); this one checks the rules
    // each start leaves.
    // Even, so each range's ends differ in parity (as the kernel prefers).
    use kp_test::lab::EPHEMERAL_PORTS;
    let span = ((EPHEMERAL_PORTS.end() - EPHEMERAL_PORTS.start()) / order.len() as u16) & !1;
    for (i, mode) in order.iter().enumerate() {
        let first = EPHEMERAL_PORTS.start() + i as u16 * span;
        lab.set_local_ports(first..=first + span - 1)
            .expect("local port range");
        let mut proxy = start(&lab, mode, &dir.0, &extra);
        assert!(has_state(&lab, sandbox, mode), "{mode} programmed nothing");
        // The other modes' leftovers go after the first sync.
        proxy
            .wait_for_log(switching::LEFTOVERS_GONE, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{mode}: leftovers: {e}\n{}", proxy.log()));
        for other in names.iter().filter(|o| *o != mode) {
            // The first start finds nothing of anyone; later ones find the previous mode's.
            assert!(
                !has_state(&lab, sandbox, other),
                "start {i}: {mode} mode left {other} mode's state in place"
            );
        }
        if *mode == "ebpf" {
            // Its rows as it declares them (as crates/kp-ebpf's flow test runs them).
            kp_test::flows::assert_all_for(&lab, kp_flows::Support::SOCKET_LB_TC);
        } else {
            assert_flows(&lab);
        }
        // A plain stop ends on its own (userspace: at its 1 s drain timeout, its rules staying).
        let stopping = std::time::Instant::now();
        let status = proxy.terminate(Duration::from_secs(10)).unwrap();
        assert!(
            status.success() && stopping.elapsed() < Duration::from_secs(5),
            "{mode}: stop took {:?}: {status:?}\n{}",
            stopping.elapsed(),
            proxy.log()
        );
        assert!(
            has_state(&lab, sandbox, mode),
            "{mode}: rules stay after a stop"
        );
    }

    // --cleanup removes every mode's state, and only ours.
    let mut cleanup = vec![env!("CARGO_BIN_EXE_kube-proxy"), "--cleanup"];
    cleanup.extend_from_slice(&extra);
    lab.node().run(&cleanup).expect("kube-proxy --cleanup");
    for mode in &names {
        assert!(
            !has_state(&lab, sandbox, mode),
            "--cleanup left {mode} mode's state"
        );
    }
    assert!(nft_tables(&lab).contains("someone-else"));
    let nat = lab.node().run(&["iptables-nft-save", "-t", "nat"]).unwrap();
    assert!(
        nat.contains(":SOMEONE-ELSE") && nat.contains("-A SOMEONE-ELSE -j RETURN"),
        "{nat}"
    );
    assert!(kube_chains(&lab, "nft").is_empty());
}

/// The modes the host can switch between under traffic: every registry mode but ipvs where
/// the kernel has no IPVS (its pairs run in the kp-vm guest, `ipvs_vm_e2e.rs`). ebpf mode runs
/// on a cgroup and a bpffs of the test's own (`ebpf_lab`).
fn host_switch_modes() -> Vec<&'static str> {
    let ipvs_here = std::path::Path::new("/proc/net/ip_vs").exists();
    kp_proxy::modes::MODES
        .iter()
        .map(|m| m.name())
        .filter(|m| *m != "ipvs" || ipvs_here)
        .collect()
}

#[test]
#[ignore = "needs root"]
fn switching_between_every_pair_of_modes_drops_no_connection() {
    if !kp_test::netns::require_root() {
        return;
    }
    let _alone = ALONE
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("switch-traffic");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let modes = host_switch_modes();
    // ebpf mode: its socket hooks on a cgroup of the test's, which the node's and the pods'
    // processes join (the ClusterIP clients among them; in the other modes the cgroup, with
    // nothing attached, changes nothing); the outside client stays out, as another host's
    // sockets would, so its NodePort traffic meets the tc path on the node's uplink. Every
    // mode gets the sandbox's flags: the pin directory is where the others find ebpf mode's
    // leftovers.
    let sandbox = modes
        .contains(&"ebpf")
        .then(|| ebpf_lab::Sandbox::new("switch"));
    let flags = sandbox.as_ref().map(|s| s.flags()).unwrap_or_default();
    if let Some(sandbox) = &sandbox {
        sandbox.admit(&lab);
        lab.client().place_in_cgroup(None);
    }
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    let sw = switching::Switcher {
        lab: &lab,
        dir: &dir.0,
        extra: &extra,
        first_sync: Duration::from_secs(60),
        bar: switching::Bar::HOST,
    };
    assert!(modes.len() >= 2, "{modes:?}");
    // ebpf's pairs last: see the bars below.
    let order = switching::every_pair_hub_last(&modes, "ebpf");
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
        //
        // ebpf mode translates in its own programs, not in netfilter, and that bounds its
        // pairs (see the README's "Switching modes"):
        // - its long-lived ClusterIP connections are held: made through the old mode's NAT,
        //   they keep it after that mode's chains go (ebpf mode keeps conntrack and the NAT
        //   hooks on, `kp_ebpf::nat_hooks`); made straight to a backend by its socket hooks,
        //   they need no translation in the next mode.
        // - to ebpf, its long-lived NodePort connection from outside is held too: its tc path
        //   starts TCP connections only at a SYN and leaves the packets of one it does not hold
        //   to the stack, where conntrack carries the old mode's translation.
        // - from ebpf, it is held too: the next mode leaves the tc programs attached, with
        //   their frontends emptied, until the connections they made (unknown to netfilter)
        //   have been idle for --bpf-handover-idle (`kp_ebpf::hand_over`); new ones meet the
        //   next mode's rules at once.
        // - both ways, new NodePort connections may time out twice in a switch
        //   (`switching::EBPF_NODE_PORT_TIMEOUTS`): one in a few hundred whose handshake meets
        //   the switch, or whose masqueraded port meets the other path's, times out (seen in 45
        //   of 72 switches to ebpf, twice in one of them); a refused or reset one fails the
        //   switch, as in every pair.
        // - its new ClusterIP connections may time out two in a thousand
        //   (`switching::EBPF_FAILURES_PER_MILLE` says why), and a lost SYN is printed.
        // Every kind of new connection must have run, and the old mode's state and the old
        // proxy's exit are held as in every pair. They run last (`every_pair_hub_last`), so the
        // conntrack entries and TIME_WAITs they leave meet no other pair.
        let problems = seen.held_problems();
        eprintln!(
            "{} [{}]",
            seen.summary(),
            if problems.is_empty() { "ok" } else { "FAILED" }
        );
        // The old mode's state is gone once the new mode has taken over (ebpf's tc programs
        // once the connections they carried have been idle for `--bpf-handover-idle`).
        if w[0] == "ebpf" {
            if let Err(e) = proxy.wait_for_log(
                switching::LEFTOVERS_GONE,
                ebpf_lab::HANDOVER_IDLE + Duration::from_secs(25),
            ) {
                failed.push(format!(
                    "{} -> {}: ebpf's tc programs stayed: {e}",
                    w[0], w[1]
                ));
            }
        }
        if has_state(&lab, sandbox.as_ref(), w[0]) {
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
