//! Helpers shared by the binary's end-to-end tests: how kube-proxy is started in a lab node,
//! and how its metrics and the lab's traffic are read.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::time::{Duration, Instant};

use kp_test::echo::{tally, Proto, Request};
use kp_test::lab::Lab;
use kp_test::netns::{ChildGuard, Netns};

/// The health endpoint, inside the node namespace.
pub const HEALTHZ: &str = "http://127.0.0.1:10256/healthz";
/// The metrics endpoint, inside the node namespace.
pub const METRICS: &str = "http://127.0.0.1:10249/metrics";
/// The log line of a full sync.
pub const PROGRAMMED: &str = "programmed the kernel";
/// The log line of the removal of the other modes' leftovers (after the first sync), once
/// nothing of them is left.
pub const LEFTOVERS_GONE: &str = "no other mode's rules are left";

/// Deletes the web ClusterIP's element from the userspace mode's redirect set, behind the
/// proxy's back (what the tampering and drift tests break).
pub const DELETE_USERSPACE_WEB_REDIRECT: &[&str] = &[
    "nft",
    "delete",
    "element",
    "inet",
    "kube-proxy-userspace",
    "redirect-vips-v4",
    "{ 10.96.0.10 . tcp . 80 }",
];

/// Starts kube-proxy in the lab node with the flags every e2e test uses, plus `source` (how it
/// finds its objects: `--manifests DIR` or `--master URL`). `prefix` goes before the binary
/// (`env -u …`).
pub fn spawn_proxy(lab: &Lab, prefix: &[&str], source: &[&str]) -> ChildGuard {
    spawn_proxy_in_mode(lab, "nftables", prefix, source)
}

/// [`spawn_proxy`] in proxy mode `mode`.
pub fn spawn_proxy_in_mode(lab: &Lab, mode: &str, prefix: &[&str], source: &[&str]) -> ChildGuard {
    let mode_flag = format!("--proxy-mode={mode}");
    let mut args: Vec<&str> = prefix.to_vec();
    args.push(env!("CARGO_BIN_EXE_kube-proxy"));
    args.extend([
        mode_flag.as_str(),
        "--hostname-override",
        kp_flows::NODE,
        "--cluster-cidr=10.244.0.0/16,fd00:10:244::/48",
        // The flow table's setting; nftables mode's default, not iptables mode's.
        "--nodeport-addresses=primary",
        "--healthz-bind-address=127.0.0.1:10256",
        "--metrics-bind-address=127.0.0.1:10249",
        "--iptables-min-sync-period=100ms",
        "--iptables-sync-period=1s",
        "-v=2",
    ]);
    args.extend(source);
    lab.node().spawn(&args).expect("start kube-proxy")
}

/// The flow lab with every fixture pod serving. With `legacy_kubelet`, the node's kubelet is
/// made to look like an iptables-legacy one (its canary chain), so iptables mode picks that
/// backend.
pub fn serving_lab(legacy_kubelet: bool) -> (Lab, Vec<ChildGuard>) {
    let lab = kp_test::flows::lab().expect("lab");
    let echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    if legacy_kubelet {
        lab.node()
            .run(&[
                "iptables-legacy",
                "-t",
                "mangle",
                "-N",
                "KUBE-KUBELET-CANARY",
            ])
            .expect("the legacy kubelet's canary");
    }
    (lab, echo)
}

/// GET `url` from inside `ns` (empty on failure).
pub fn http_get(ns: &Netns, url: &str) -> String {
    ns.run(&["curl", "-s", "--max-time", "2", url])
        .unwrap_or_default()
}

/// The sum of every metric line that starts with `prefix` (a name and, optionally, labels).
pub fn metric_sum(ns: &Netns, prefix: &str) -> f64 {
    http_get(ns, METRICS)
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next())
        .filter_map(|v| v.parse::<f64>().ok())
        .sum()
}

/// Polls `ok` until it holds; fails the test after `timeout`. Returns how long it took.
pub fn eventually(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !ok() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

/// Who answered `tries` connections from pod 4 to the web Service (10.96.0.10:80), sorted;
/// failures count under their outcome (`timeout`, `refused`, ...).
pub fn web_backends(lab: &Lab, tries: usize) -> Vec<String> {
    let web = "10.96.0.10".parse().unwrap();
    tally(&lab.send(lab.pod(4), &Request::new(Proto::Tcp, web, 80).count(tries)))
        .into_keys()
        .collect()
}

/// Runs the whole flow table with real packets and fails with every failing row.
pub fn assert_flows(lab: &Lab) {
    kp_test::flows::assert_all(lab);
}

/// Writes `text` to `path` so a reader never sees it half-written.
pub fn write_atomically(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A scratch directory removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh scratch directory named after `tag`, this process and this call. Tests of one binary
/// run in parallel, and two of them may pass the same tag (the restart test and its control
/// both run nftables mode): the counter keeps their directories apart, so one test's set-up or
/// clean-up never removes the manifests another test's proxy is reading.
pub fn temp_dir(tag: &str) -> TempDir {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let p = std::env::temp_dir().join(format!("kp-e2e-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    TempDir(p)
}

/// The fixture's manifest list with `edit` applied to every item.
pub fn edited_fixture(mut edit: impl FnMut(&mut serde_json::Value)) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&kp_flows::manifest_list()).unwrap();
    for item in v["items"].as_array_mut().unwrap() {
        edit(item);
    }
    v.to_string()
}
