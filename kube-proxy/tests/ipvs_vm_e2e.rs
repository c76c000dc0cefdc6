//! The binary in ipvs mode on a real IPVS kernel: this test binary boots the kp-vm guest
//! (Debian's kernel with `ip_vs`) and runs itself there (`KP_VM_GUEST` set), where it starts
//! kube-proxy with `--proxy-mode ipvs` in kp-test's lab: the registry entry builds the mode
//! from the configuration (NodePorts on the Node's primary addresses, detect-local by the
//! cluster CIDRs), the flow table passes with real packets, the periodic syncs find the kernel
//! as planned, and `--cleanup` removes the mode's state.

use std::time::{Duration, Instant};

mod common;
use common::{http_get, temp_dir, write_atomically, PROGRAMMED};

/// On the host, runs test `name` of this binary in the kp-vm guest and checks it passed there.
/// Returns whether this is the guest (go on with the test) or not (done).
fn in_guest(name: &str) -> bool {
    if std::env::var_os("KP_VM_GUEST").is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    // kp-echo is found (or built) here, where cargo is; the guest's file system is read-only.
    let echo = kp_test::echo_binary();
    let script = format!(
        "KP_ECHO={} {} --exact {name} --include-ignored --nocapture --test-threads 1",
        echo.display(),
        exe.display()
    );
    let run = kp_vm::Vm::new()
        .expect("qemu, the kernel and busybox are installed")
        .timeout(Duration::from_secs(480))
        .run(&script)
        .expect("the guest runs the test");
    eprintln!(
        "guest: boot {:?}, total {:?}\n{}",
        run.boot, run.total, run.output
    );
    assert!(
        run.success(),
        "the test failed in the guest:\n{}",
        run.output
    );
    assert!(run.output.contains("1 passed"), "{}", run.output);
    false
}

#[test]
#[ignore = "needs root"]
fn the_binary_in_ipvs_mode_serves_the_flow_table_on_a_real_ipvs_kernel() {
    if !kp_test::netns::require_root() {
        return;
    }
    if !in_guest("the_binary_in_ipvs_mode_serves_the_flow_table_on_a_real_ipvs_kernel") {
        return;
    }
    let t0 = Instant::now();
    let (lab, _echo) = common::serving_lab(false);
    eprintln!("lab built in {:?}", t0.elapsed());
    let dir = temp_dir("ipvs");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let t = Instant::now();
    let mut proxy = common::spawn_proxy_in_mode(
        &lab,
        "ipvs",
        &[],
        &[
            "--manifests",
            dir.0.to_str().unwrap(),
            // The ipvs section's periods (the iptables ones do not apply in ipvs mode).
            "--ipvs-sync-period=2s",
            "--ipvs-min-sync-period=100ms",
        ],
    );
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(180))
        .unwrap_or_else(|e| panic!("first sync: {e}\n{}", proxy.log()));
    eprintln!("started and programmed in {:?}", t.elapsed());
    let log = proxy.log();
    assert!(!log.contains("cannot run on this node"), "{log}");
    let mode = http_get(lab.node(), "http://127.0.0.1:10249/proxyMode");
    assert_eq!(mode.trim(), "ipvs");
    let metrics = http_get(lab.node(), "http://127.0.0.1:10249/metrics");
    assert!(
        !metrics.contains("kubeproxy_rs_proxy_mode_fallbacks_total{"),
        "{metrics}"
    );
    let links = lab.node().run(&["ip", "-o", "link"]).expect("links");
    assert!(links.contains("kube-ipvs0"), "{links}");
    // A NodePort virtual server on the Node's primary address (from its Node object).
    let listed = lab.node().run(&["ipvsadm", "-Ln"]).expect("ipvsadm");
    assert!(
        listed.contains(&format!("{}:30070", kp_flows::NODE_IP)),
        "{listed}"
    );

    let t = Instant::now();
    let failures = kp_test::flows::check_all(&lab);
    eprintln!(
        "flow table: {} of {} rows failed in {:?}",
        failures.len(),
        kp_flows::cases().len(),
        t.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{}\n{}",
        failures.join("\n"),
        proxy.log()
    );
    // The periodic syncs (2 s here) read the kernel back and find it as planned.
    std::thread::sleep(Duration::from_secs(5));
    let log = proxy.log();
    assert!(!log.contains("differs from the plan"), "{log}");
    proxy.terminate(Duration::from_secs(15)).unwrap();
    // The state stays after a stop; --cleanup removes it.
    assert!(lab.node().ip(&["link", "show", "kube-ipvs0"]).is_ok());
    lab.node()
        .run(&[env!("CARGO_BIN_EXE_kube-proxy"), "--cleanup"])
        .expect("kube-proxy --cleanup");
    assert!(lab.node().ip(&["link", "show", "kube-ipvs0"]).is_err());
    let listed = lab.node().run(&["ipvsadm", "-Ln"]).expect("ipvsadm");
    assert_eq!(listed.lines().count(), 3, "{listed}");
    let sets = lab.node().run(&["ipset", "list", "-n"]).expect("ipset");
    assert!(!sets.contains("KUBE-"), "{sets}");
}
