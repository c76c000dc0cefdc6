//! The binary in userspace mode, end to end: the flow table with real packets through the
//! proxy, its connection metrics, and its graceful stop: serving on while its redirect rules
//! stay (until the drain timeout), a running relay finished once they are removed, a second
//! signal ending the drain.

use std::time::Duration;

use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
use common::{http_get, metric_sum, temp_dir, write_atomically, PROGRAMMED};

/// A short drain for the tests that stop the proxy with its rules in place.
const SHORT_DRAIN: &str = "--userspace-drain-timeout=1s";

fn start(lab: &Lab, dir: &std::path::Path) -> ChildGuard {
    start_draining(lab, dir, "1s")
}

#[test]
#[ignore = "needs root"]
fn the_binary_in_userspace_mode_serves_the_flow_table_and_counts_its_connections() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("userspace");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start(&lab, &dir.0);
    // No SCTP socket in this mode: its rows are held to a rejection.
    kp_test::flows::assert_all_for(&lab, kp_flows::Support::NO_SCTP);
    let mode = http_get(lab.node(), "http://127.0.0.1:10249/proxyMode");
    assert_eq!(mode.trim(), "userspace");
    assert!(metric_sum(lab.node(), "kubeproxy_rs_userspace_connections_total") > 0.0);
    assert!(
        metric_sum(
            lab.node(),
            "kubeproxy_rs_userspace_udp_sessions_created_total"
        ) > 0.0
    );
    assert!(metric_sum(lab.node(), "kubeproxy_rs_userspace_bytes_relayed_total") > 0.0);
    // The periodic syncs (1 s here) read the table back and find it equal to the plan.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        !proxy.log().contains("differs from the plan"),
        "{}",
        proxy.log()
    );
    proxy.terminate(Duration::from_secs(15)).unwrap();
}

/// The log line of a stopping proxy that serves on while its rules reach it
/// (`kp_userspace::SERVING_ON`).
const SERVING_ON: &str = "stopping: serving on while the redirect rules send connections here";
/// The log line of a stopping proxy that closed its listeners (`kp_userspace::STOPPED_ACCEPTING`).
const STOPPED_ACCEPTING: &str = "stopped accepting new connections";

/// Starts the proxy with `--userspace-drain-timeout=DRAIN`.
fn start_draining(lab: &Lab, dir: &std::path::Path, drain: &str) -> ChildGuard {
    let flag = format!("--userspace-drain-timeout={drain}");
    let mut proxy = common::spawn_proxy_in_mode(
        lab,
        "userspace",
        &[],
        &["--manifests", dir.to_str().unwrap(), &flag],
    );
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("first sync: {e}\n{}", proxy.log()));
    proxy
}

fn sigterm(proxy: &ChildGuard) {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &proxy.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Waits up to `within` for the proxy's own exit; its status and when it came.
fn exit_within(proxy: &mut ChildGuard, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = proxy.try_wait().unwrap() {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running {within:?} later\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
#[ignore = "needs root"]
fn a_stopped_proxy_serves_on_while_its_rules_stay_and_exits_at_the_drain_timeout() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("userspace-stop-alone");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start_draining(&lab, &dir.0, "3s");
    let web = "10.96.0.10".parse().unwrap();
    let stopping = std::time::Instant::now();
    sigterm(&proxy);
    proxy
        .wait_for_log(SERVING_ON, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e}\n{}", proxy.log()));
    // Nobody takes over: new connections are still answered through the stopping proxy.
    for _ in 0..5 {
        let answer = lab.request(lab.pod(4), kp_test::echo::Proto::Tcp, web, 80);
        assert!(
            answer.backend().is_some_and(|b| b.starts_with("pod-")),
            "{answer:?}\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // It exits by itself at its drain timeout, not sooner, not at a kill.
    let status = exit_within(&mut proxy, Duration::from_secs(10));
    let took = stopping.elapsed();
    assert!(status.success(), "{status:?}\n{}", proxy.log());
    assert!(
        took >= Duration::from_millis(2900) && took < Duration::from_secs(6),
        "{took:?}\n{}",
        proxy.log()
    );
    assert!(
        proxy.log().contains("the drain timeout passed"),
        "{}",
        proxy.log()
    );
    // The rules stay, as every mode leaves them, and nothing accepts any more.
    let tables = lab.node().run(&["nft", "list", "tables"]).unwrap();
    assert!(tables.contains("kube-proxy-userspace"), "{tables}");
    let after = lab.request(lab.pod(4), kp_test::echo::Proto::Tcp, web, 80);
    assert!(after.backend().is_none(), "{after:?}");
}

#[test]
#[ignore = "needs root"]
fn a_stopped_proxy_lets_its_running_relay_finish_after_another_mode_took_over_and_exits() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("userspace-stop");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    // A drain timeout far beyond the relay's life: the exit must come from the relay's end.
    let mut proxy = start_draining(&lab, &dir.0, "30s");
    let web = "10.96.0.10".parse().unwrap();
    // From a pod: the endpoint sees the pod's address, so the relay answers from a transparent
    // socket whose replies need this mode's reply mark and policy routing.
    let mut stream = kp_test::echo::spawn_stream(
        lab.pod(4),
        web,
        80,
        Duration::from_millis(20),
        Duration::from_secs(5),
    )
    .expect("stream");
    common::eventually("the stream's relay", Duration::from_secs(5), || {
        metric_sum(lab.node(), "kubeproxy_rs_userspace_active_connections") >= 1.0
    });
    let stopping = std::time::Instant::now();
    sigterm(&proxy);
    proxy
        .wait_for_log(SERVING_ON, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e}\n{}", proxy.log()));
    let answer = lab.request(lab.pod(4), kp_test::echo::Proto::Tcp, web, 80);
    assert!(answer.backend().is_some(), "{answer:?}\n{}", proxy.log());
    // nftables mode takes over: after its first sync it removes this mode's table, keeping
    // the return path of the relay still open.
    let mut next = common::spawn_proxy_in_mode(
        &lab,
        "nftables",
        &[],
        &["--manifests", dir.0.to_str().unwrap()],
    );
    next.wait_for_log(PROGRAMMED, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("nftables: {e}\n{}", next.log()));
    proxy
        .wait_for_log(STOPPED_ACCEPTING, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\n{}\nnftables:\n{}", proxy.log(), next.log()));
    assert!(
        proxy
            .log()
            .contains("the redirect rules no longer send connections here"),
        "{}",
        proxy.log()
    );
    assert!(next.log().contains("kept until they end"), "{}", next.log());
    // The relay runs to its end (5 s from its start), and the proxy exits right after it,
    // removing the return path it was left.
    let status = exit_within(&mut proxy, Duration::from_secs(15));
    assert!(status.success(), "{status:?}\n{}", proxy.log());
    assert!(
        stopping.elapsed() < Duration::from_secs(12),
        "{:?}\n{}",
        stopping.elapsed(),
        proxy.log()
    );
    let log = proxy.log();
    assert!(log.contains("every relay has ended"), "{log}");
    assert!(log.contains("removed the return path"), "{log}");
    let result = kp_test::echo::finished_stream(&mut stream, Duration::from_secs(10))
        .expect("stream result");
    assert_eq!(result.failed, None, "{result:?}");
    assert_eq!(result.echoed, result.sent, "{result:?}");
    let tables = lab.node().run(&["nft", "list", "tables"]).unwrap();
    assert!(!tables.contains("kube-proxy-userspace"), "{tables}");
    // nftables mode serves on.
    let answer = lab.request(lab.pod(4), kp_test::echo::Proto::Tcp, web, 80);
    assert!(answer.backend().is_some(), "{answer:?}\n{}", next.log());
    next.terminate(Duration::from_secs(5)).unwrap();
}

#[test]
#[ignore = "needs root"]
fn a_second_sigterm_ends_the_drain_at_once() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("userspace-stop-twice");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start_draining(&lab, &dir.0, "30s");
    sigterm(&proxy);
    proxy
        .wait_for_log(SERVING_ON, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e}\n{}", proxy.log()));
    let second = std::time::Instant::now();
    sigterm(&proxy);
    let status = exit_within(&mut proxy, Duration::from_secs(5));
    assert!(status.success(), "{status:?}\n{}", proxy.log());
    assert!(
        second.elapsed() < Duration::from_secs(2),
        "{:?}",
        second.elapsed()
    );
    assert!(proxy.log().contains("a second signal"), "{}", proxy.log());
}

/// Every iptables tool the iptables mode could run (both backends, both families), as a
/// program that fails: iptables is unusable on this "node", nft still works.
fn write_unusable_iptables(dir: &std::path::Path) {
    for family in ["iptables", "ip6tables"] {
        for backend in ["", "-nft", "-legacy"] {
            for tool in ["", "-save", "-restore"] {
                let name = format!("{family}{backend}{tool}");
                let script = format!(
                    "#!/bin/sh\necho \"{name}: iptables is unusable in this test\" >&2\nexit 1\n"
                );
                kp_test::write_executable(&dir.join(&name), &script).unwrap();
            }
        }
    }
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_without_usable_iptables_warns_once_and_runs_userspace_mode() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("userspace-fallback");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let tools = temp_dir("userspace-fallback-tools");
    write_unusable_iptables(&tools.0);
    let path = format!("PATH={}:/usr/sbin:/usr/bin:/sbin:/bin", tools.0.display());
    let mut proxy = common::spawn_proxy_in_mode(
        &lab,
        "iptables",
        &["env", &path],
        &["--manifests", dir.0.to_str().unwrap(), SHORT_DRAIN],
    );
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("first sync: {e}\n{}", proxy.log()));
    let log = proxy.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("iptables mode cannot run on this node"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(warnings[0].contains("WARN"), "{}", warnings[0]);
    // The warning says why: the failing tool's own words.
    assert!(
        warnings[0].contains("iptables is unusable in this test"),
        "{}",
        warnings[0]
    );
    assert!(warnings[0].contains("running userspace mode instead"));
    let mode = http_get(lab.node(), "http://127.0.0.1:10249/proxyMode");
    assert_eq!(mode.trim(), "userspace");
    let metrics = http_get(lab.node(), "http://127.0.0.1:10249/metrics");
    assert!(
        metrics.contains(
            "kubeproxy_rs_proxy_mode_fallbacks_total{from=\"iptables\",to=\"userspace\"} 1"
        ),
        "{metrics}"
    );
    // And the userspace proxy serves: a ClusterIP answers from a pod.
    let web = "10.96.0.10".parse().unwrap();
    let answer = lab.request(lab.pod(4), kp_test::echo::Proto::Tcp, web, 80);
    assert!(
        answer.backend().is_some_and(|b| b.starts_with("pod-")),
        "{answer:?}\n{}",
        proxy.log()
    );
    proxy.terminate(Duration::from_secs(15)).unwrap();
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_with_working_iptables_does_not_fall_back() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("userspace-no-fallback");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = common::spawn_proxy_in_mode(
        &lab,
        "iptables",
        &[],
        &["--manifests", dir.0.to_str().unwrap()],
    );
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("first sync: {e}\n{}", proxy.log()));
    assert!(
        !proxy.log().contains("cannot run on this node"),
        "{}",
        proxy.log()
    );
    let mode = http_get(lab.node(), "http://127.0.0.1:10249/proxyMode");
    assert_eq!(mode.trim(), "iptables");
    let metrics = http_get(lab.node(), "http://127.0.0.1:10249/metrics");
    assert!(
        !metrics.contains("kubeproxy_rs_proxy_mode_fallbacks_total{"),
        "{metrics}"
    );
    proxy.terminate(Duration::from_secs(15)).unwrap();
}
