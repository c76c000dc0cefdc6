//! The binary with `--proxy-mode ipvs` on a kernel without IPVS (this machine's): it says why
//! once, runs iptables mode, reports it on `/proxyMode`, counts the fallback, and serves.
//! The ipvs mode itself is proved on a real IPVS kernel in kp-ipvs's VM tests.

use std::time::Duration;

mod common;
use common::{http_get, temp_dir, write_atomically, PROGRAMMED};

#[test]
#[ignore = "needs root"]
fn ipvs_mode_without_ipvs_warns_once_and_runs_iptables_mode() {
    if !kp_test::netns::require_root() {
        return;
    }
    if std::path::Path::new("/proc/net/ip_vs").exists() {
        // IPVS is loaded here: the fallback cannot be shown on this kernel (the VM tests
        // prove the mode itself).
        eprintln!("this kernel has IPVS loaded; no fallback to show");
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("ipvs-fallback");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy =
        common::spawn_proxy_in_mode(&lab, "ipvs", &[], &["--manifests", dir.0.to_str().unwrap()]);
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("first sync: {e}\n{}", proxy.log()));
    let log = proxy.log();
    if std::path::Path::new("/proc/net/ip_vs").exists() {
        // The probe loaded ip_vs: this kernel has it as a module after all.
        eprintln!("the probe loaded ip_vs; no fallback to show\n{log}");
        proxy.terminate(Duration::from_secs(15)).unwrap();
        return;
    }
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ipvs mode cannot run on this node"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(warnings[0].contains("WARN"), "{}", warnings[0]);
    // The warning says why and what runs instead.
    assert!(
        warnings[0].contains("generic netlink family IPVS"),
        "{}",
        warnings[0]
    );
    assert!(warnings[0].contains("ip_vs"), "{}", warnings[0]);
    assert!(
        warnings[0].contains("running iptables mode instead"),
        "{}",
        warnings[0]
    );
    let mode = http_get(lab.node(), "http://127.0.0.1:10249/proxyMode");
    assert_eq!(mode.trim(), "iptables");
    let metrics = http_get(lab.node(), "http://127.0.0.1:10249/metrics");
    assert!(
        metrics
            .contains("kubeproxy_rs_proxy_mode_fallbacks_total{from=\"ipvs\",to=\"iptables\"} 1"),
        "{metrics}"
    );
    // The iptables mode programmed the node: its chains are there, and a ClusterIP answers
    // from one of its pods.
    // (whichever backend it chose: both are read.)
    let nat: String = ["iptables-nft-save", "iptables-legacy-save"]
        .iter()
        .map(|tool| lab.node().run(&[tool, "-t", "nat"]).unwrap_or_default())
        .collect();
    assert!(nat.contains(":KUBE-SERVICES"), "{nat}");
    assert!(nat.contains(":KUBE-SVC-"), "{nat}");
    let web = "10.96.0.10".parse().unwrap();
    for _ in 0..3 {
        let answer = lab.request(lab.pod(4), kp_test::echo::Proto::Tcp, web, 80);
        assert!(
            answer.backend().is_some_and(|b| b.starts_with("pod-")),
            "{answer:?}\n{}",
            proxy.log()
        );
    }
    // Nothing of the ipvs mode was made.
    let links = lab.node().run(&["ip", "-o", "link"]).expect("links");
    assert!(!links.contains("kube-ipvs0"), "{links}");
    proxy.terminate(Duration::from_secs(15)).unwrap();
}
