//! The binary in userspace mode, end to end: the flow table with real packets through the
//! proxy, its connection metrics, and a graceful stop that lets a running relay finish.

use std::time::Duration;

use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
use common::{http_get, metric_sum, temp_dir, write_atomically, PROGRAMMED};

fn start(lab: &Lab, dir: &std::path::Path) -> ChildGuard {
    let mut proxy = common::spawn_proxy_in_mode(
        lab,
        "userspace",
        &[],
        &["--manifests", dir.to_str().unwrap()],
    );
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("first sync: {e}\n{}", proxy.log()));
    proxy
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

#[test]
#[ignore = "needs root"]
fn sigterm_stops_accepting_and_lets_a_running_relay_finish() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("userspace-stop");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start(&lab, &dir.0);
    let web = "10.96.0.10".parse().unwrap();
    let mut stream = kp_test::echo::spawn_stream(
        lab.pod(4),
        web,
        80,
        Duration::from_millis(50),
        Duration::from_secs(3),
    )
    .expect("stream");
    common::eventually("the stream's relay", Duration::from_secs(5), || {
        metric_sum(lab.node(), "kubeproxy_rs_userspace_active_connections") >= 1.0
    });
    let stopping = std::time::Instant::now();
    let status = proxy.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status:?}\n{}", proxy.log());
    // The proxy waited for the relay (about 3 s from its start), not the full grace period.
    assert!(
        stopping.elapsed() < Duration::from_secs(12),
        "{:?}",
        stopping.elapsed()
    );
    let result = kp_test::echo::finished_stream(&mut stream, Duration::from_secs(10))
        .expect("stream result");
    assert_eq!(result.failed, None, "{result:?}");
    assert_eq!(result.echoed, result.sent, "{result:?}");
    // Stopped: nothing accepts new connections any more.
    let after = lab.request(lab.pod(4), kp_test::echo::Proto::Tcp, web, 80);
    assert!(after.backend().is_none(), "{after:?}");
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
        &["--manifests", dir.0.to_str().unwrap()],
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
