//! The binary in each kernel mode, end to end: the whole flow table with real packets, in
//! iptables mode on both backends, and switching modes back and forth on one node, where each
//! start must remove what the other mode left and traffic must work after every start.

use std::time::Duration;

use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
use common::{assert_flows, eventually, metric_sum, temp_dir, write_atomically, PROGRAMMED};

fn start(lab: &Lab, mode: &str, dir: &std::path::Path) -> ChildGuard {
    let mut proxy =
        common::spawn_proxy_in_mode(lab, mode, &[], &["--manifests", dir.to_str().unwrap()]);
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

fn iptables_mode_serves_the_flow_table(backend: &str) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    if backend == "legacy" {
        // A kubelet on this node uses iptables-legacy: its canary chain tells kube-proxy so.
        lab.node()
            .run(&[
                "iptables-legacy",
                "-t",
                "mangle",
                "-N",
                "KUBE-KUBELET-CANARY",
            ])
            .unwrap();
    }
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
    assert!(
        proxy.log().contains("KUBE-PROXY-CANARY chain is gone"),
        "the rebuild says why:\n{}",
        proxy.log()
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

    let mut proxy = start(&lab, "nftables", &dir.0);
    assert_flows(&lab);
    proxy.terminate(Duration::from_secs(5)).unwrap();
    assert!(nft_tables(&lab).contains("kube-proxy"));

    let mut proxy = start(&lab, "iptables", &dir.0);
    assert!(
        !nft_tables(&lab).contains("kube-proxy"),
        "iptables mode removed the nftables tables: {}",
        nft_tables(&lab)
    );
    assert!(!kube_chains(&lab, "nft").is_empty());
    assert_flows(&lab);
    proxy.terminate(Duration::from_secs(5)).unwrap();

    let mut proxy = start(&lab, "nftables", &dir.0);
    assert!(
        kube_chains(&lab, "nft").is_empty() && kube_chains(&lab, "legacy").is_empty(),
        "nftables mode removed the iptables chains: {:?}",
        kube_chains(&lab, "nft")
    );
    assert_flows(&lab);
    proxy.terminate(Duration::from_secs(5)).unwrap();

    // --cleanup removes both modes' state, and only ours.
    lab.node()
        .run(&[env!("CARGO_BIN_EXE_kube-proxy"), "--cleanup"])
        .expect("kube-proxy --cleanup");
    assert!(!nft_tables(&lab).contains("kube-proxy"));
    assert!(nft_tables(&lab).contains("someone-else"));
    let nat = lab.node().run(&["iptables-nft-save", "-t", "nat"]).unwrap();
    assert!(
        nat.contains(":SOMEONE-ELSE") && nat.contains("-A SOMEONE-ELSE -j RETURN"),
        "{nat}"
    );
    assert!(kube_chains(&lab, "nft").is_empty());
}
