//! Faults injected into a running kube-proxy, in each kernel mode: the kernel tool (`nft`,
//! `iptables-restore`; userspace mode's `nft` for its redirect table; ipvs mode's
//! `ipset restore`) failing N times in a row, and the manifest directory vanishing and coming
//! back. Existing Services must keep answering throughout, the failures must be counted, and
//! the proxy must recover with the first attempt after the fault ends. Then tampering: rules,
//! table elements, ebpf map entries, an IPVS virtual server or an ipset's elements deleted
//! behind the proxy's back, repaired by its periodic check. ipvs mode's tests run in the kp-vm
//! guest (`tests/guest`): this machine's kernel has no IPVS.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use kp_test::echo::{tally, Proto, Request};
use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
mod ebpf_lab;
mod guest;
use common::{
    eventually, http_get, metric_sum, temp_dir, web_backends, write_atomically, HEALTHZ, PROGRAMMED,
};

/// The tool that applies a sync in each mode, wrapped so that a test can make the next N runs
/// fail. (Only the applying tools: iptables mode on nft also lists chains with `nft`, and falls
/// back to iptables-save when that fails.) An entry of two words wraps the tool but fails only
/// its runs with that first argument: ipvs mode's full syncs read the sets back with `ipset
/// save` and apply them with `ipset restore`; its partial syncs send set elements and IPVS
/// changes over netlink, which no wrapper reaches.
fn applying_tools(mode: &str) -> &'static [&'static str] {
    match mode {
        "nftables" | "userspace" => &["nft"],
        "ipvs" => &[
            "ipset restore",
            "iptables-nft-restore",
            "ip6tables-nft-restore",
            "iptables-legacy-restore",
            "ip6tables-legacy-restore",
        ],
        _ => &[
            "iptables-nft-restore",
            "ip6tables-nft-restore",
            "iptables-legacy-restore",
            "ip6tables-legacy-restore",
        ],
    }
}

/// Writes a wrapper for each tool into `dir`: while `dir/fail-count` holds a number above zero,
/// a run decrements it and fails the way a refused transaction does; otherwise it runs the
/// real tool. A `tool subcommand` entry fails only runs whose first argument is `subcommand`.
fn write_wrappers(dir: &Path, tools: &[&str]) {
    for entry in tools {
        let (tool, only) = match entry.split_once(' ') {
            Some((tool, sub)) => (tool, format!(" && [ \"$1\" = {sub} ]")),
            None => (*entry, String::new()),
        };
        let real = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{tool} is not installed"));
        let script = format!(
            "#!/bin/sh\n\
             count={dir}/fail-count\n\
             n=$(cat \"$count\" 2>/dev/null || echo 0)\n\
             if [ \"$n\" -gt 0 ]{only}; then\n\
             \techo $((n - 1)) > \"$count\"\n\
             \techo \"{tool}: injected failure\" >&2\n\
             \texit 1\n\
             fi\n\
             exec {real} \"$@\"\n",
            dir = dir.display(),
            real = real.display(),
        );
        let path = dir.join(tool);
        kp_test::write_executable(&path, &script).unwrap();
    }
    std::fs::write(dir.join("fail-count"), "0").unwrap();
}

fn fails_left(dir: &Path) -> u32 {
    std::fs::read_to_string(dir.join("fail-count"))
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0)
}

/// A Service `faulty` (10.96.0.140:80) over five pods: an endpoint count no fixture Service
/// has, so nftables mode needs new structure (an `nft` run) for it, not only elements.
fn faulty_service() -> String {
    let eps: Vec<serde_json::Value> = ["pod-1", "pod-2", "pod-3", "pod-4", "remote-1"]
        .iter()
        .map(|name| {
            let pod = kp_flows::pods()
                .into_iter()
                .find(|p| p.name == *name)
                .unwrap();
            serde_json::json!({"addresses": [pod.v4], "nodeName": pod.node,
                "conditions": {"ready": true}})
        })
        .collect();
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "faulty", "namespace": "default"},
         "spec": {"clusterIP": "10.96.0.140", "ports": [{"name": "http", "port": 80,
            "targetPort": kp_flows::TCP_PORT}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "faulty-1", "namespace": "default",
            "labels": {"kubernetes.io/service-name": "faulty"}},
         "addressType": "IPv4", "endpoints": eps,
         "ports": [{"name": "http", "port": kp_flows::TCP_PORT, "protocol": "TCP"}]},
    ]})
    .to_string()
}

fn answers(lab: &Lab, ip: &str) -> bool {
    let ip: IpAddr = ip.parse().unwrap();
    let seen = tally(&lab.send(lab.pod(4), &Request::new(Proto::Tcp, ip, 80).count(5)));
    !seen.is_empty()
        && seen
            .keys()
            .all(|k| k.starts_with("pod-") || k.starts_with("remote-"))
}

/// How a mode counts failed syncs: a metric of its own, or (modes without one) the sync loop's
/// log line for each failed sync.
#[derive(Clone, Copy)]
enum Failures {
    Metric(&'static str),
    LogLines,
}

/// The sync loop's line for a failed sync (one per failure).
const SYNC_FAILED: &str = "sync failed; retrying with a full sync";

impl Failures {
    fn count(self, lab: &Lab, proxy: &ChildGuard) -> f64 {
        match self {
            Failures::Metric(name) => metric_sum(lab.node(), name),
            Failures::LogLines => proxy.log().matches(SYNC_FAILED).count() as f64,
        }
    }
}

/// A stopping userspace proxy serves on for its drain timeout: short here, so each stop is quick.
const USERSPACE_DRAIN: &str = "--userspace-drain-timeout=1s";

/// ipvs mode's periods (the iptables ones, which `common::spawn_proxy_in_mode` sets to a
/// second, do not apply in ipvs mode). ipvs mode runs only in the kp-vm guest, where a full
/// sync that changes nothing takes about 9 s (every `ipset` and `iptables-nft` run is
/// emulated): with a period of a second the loop would be in a full sync all the time, and a
/// tampering test could not see the breakage before a sync already under way repaired it. 5 s
/// leaves that time after each periodic full sync.
const IPVS_PERIODS: [&str; 2] = ["--ipvs-sync-period=5s", "--ipvs-min-sync-period=100ms"];

/// `host`, or `guest` in the kp-vm guest (ipvs mode): the guest is emulated (TCG) on a shared
/// machine, where a start's first sync took 5-27 s and a full sync that changes nothing 9 s, so
/// every wait for the proxy is longer there. The other modes' waits are unchanged.
fn wait(host: u64, guest: u64) -> Duration {
    Duration::from_secs(if guest::is_guest() { guest } else { host })
}

fn start(lab: &Lab, mode: &str, manifests: &Path, tools: &Path) -> ChildGuard {
    start_with(lab, mode, manifests, tools, &[])
}

fn start_with(lab: &Lab, mode: &str, manifests: &Path, tools: &Path, extra: &[&str]) -> ChildGuard {
    let path = format!("PATH={}:/usr/sbin:/usr/bin:/sbin:/bin", tools.display());
    let mut source = vec!["--manifests", manifests.to_str().unwrap()];
    if mode == "userspace" {
        source.push(USERSPACE_DRAIN);
    }
    if mode == "ipvs" {
        source.extend(IPVS_PERIODS);
    }
    source.extend(extra);
    let mut proxy = common::spawn_proxy_in_mode(lab, mode, &["env", &path], &source);
    proxy
        .wait_for_log(PROGRAMMED, wait(60, 180))
        .unwrap_or_else(|e| panic!("{mode}: first sync: {e}\n{}", proxy.log()));
    // The other modes' leftovers are removed after the first sync, with the same tools: a
    // fault injected before that would be spent there instead of on the sync under test.
    proxy
        .wait_for_log(common::LEFTOVERS_GONE, wait(30, 180))
        .unwrap_or_else(|e| panic!("{mode}: leftovers: {e}\n{}", proxy.log()));
    proxy
}

/// Asserts that six requests from pod 4 to the web Service are all answered by its pods.
fn web_answers_from_its_pods(lab: &Lab, mode: &str) {
    assert_eq!(
        web_backends(lab, 6)
            .iter()
            .filter(|b| !b.starts_with("pod-"))
            .count(),
        0,
        "{mode}: the web Service stopped answering during the failures"
    );
}

/// The kernel tool fails `FAILURES` times in a row while a new Service waits to be programmed.
fn tool_failures_are_survived(mode: &str, legacy: bool, failures: Failures) {
    const FAILURES: u32 = 3;
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(legacy);
    let manifests = temp_dir(&format!("faults-{mode}-{legacy}"));
    let tools = temp_dir(&format!("faults-tools-{mode}-{legacy}"));
    write_wrappers(&tools.0, applying_tools(mode));
    write_atomically(
        &manifests.0.join("cluster.json"),
        &kp_flows::manifest_list(),
    );
    let proxy = start(&lab, mode, &manifests.0, &tools.0);
    assert_eq!(failures.count(&lab, &proxy), 0.0);

    std::fs::write(tools.0.join("fail-count"), FAILURES.to_string()).unwrap();
    write_atomically(&manifests.0.join("faulty.json"), &faulty_service());
    // While the tool fails, the web Service keeps answering from its three pods.
    let mut checks = 0;
    let recovered = eventually(
        "the new Service to be programmed after the injected failures",
        wait(60, 180),
        || {
            web_answers_from_its_pods(&lab, mode);
            checks += 1;
            answers(&lab, "10.96.0.140")
        },
    );
    // Every injected failure is hit: by the sync of that change, or (ipvs mode, whose partial
    // syncs run no tool) by the periodic full syncs after it, and counted: the wrapper spends
    // its last failure as the tool starts, the proxy counts it when the tool has returned (in
    // the emulated guest, seconds later). The web Service answers on.
    eventually(
        "every injected failure to be hit and counted",
        wait(60, 180),
        || {
            web_answers_from_its_pods(&lab, mode);
            checks += 1;
            fails_left(&tools.0) == 0 && failures.count(&lab, &proxy) >= f64::from(FAILURES)
        },
    );
    // The rules answer as soon as the tool commits; /healthz turns healthy when the sync that
    // committed them returns (after its own checks), a moment later on a loaded machine.
    eventually(&format!("{mode}: healthy again"), wait(10, 60), || {
        http_get(lab.node(), HEALTHZ).contains("\"healthy\":true")
    });
    // Recovered by the first attempt after the fault ended (a sync succeeded since: healthy):
    // exactly the injected failures were counted, none more.
    assert_eq!(
        failures.count(&lab, &proxy),
        f64::from(FAILURES),
        "{mode}: {}",
        proxy.log()
    );
    assert!(
        proxy.log().contains("injected failure"),
        "the tool's error is logged"
    );
    eprintln!(
        "{mode}: {FAILURES} injected failures survived; programmed {recovered:?} after the change, \
         web answered in all {checks} checks meanwhile"
    );
}

#[test]
#[ignore = "needs root"]
fn nftables_mode_survives_nft_failing_three_times() {
    tool_failures_are_survived(
        "nftables",
        false,
        Failures::Metric("kubeproxy_sync_proxy_rules_nftables_sync_failures_total"),
    );
}

/// Userspace mode programs its redirect table with `nft`; it has no failure metric of its own,
/// so the failed syncs are counted from the sync loop's log.
#[test]
#[ignore = "needs root"]
fn userspace_mode_survives_nft_failing_three_times() {
    tool_failures_are_survived("userspace", false, Failures::LogLines);
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_nft_survives_iptables_restore_failing_three_times() {
    tool_failures_are_survived(
        "iptables",
        false,
        Failures::Metric("kubeproxy_sync_proxy_rules_iptables_restore_failures_total"),
    );
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_legacy_survives_iptables_restore_failing_three_times() {
    tool_failures_are_survived(
        "iptables",
        true,
        Failures::Metric("kubeproxy_sync_proxy_rules_iptables_restore_failures_total"),
    );
}

/// ipvs mode's full syncs apply the sets with `ipset restore` and the chains with
/// `iptables-restore`; its partial syncs run no tool (the new Service's set elements go over
/// netlink), so the injected failures are hit by the periodic full syncs that follow. It has
/// no failure metric of its own: the failed syncs are counted from the sync loop's log. Runs in
/// the kp-vm guest: this machine's kernel has no IPVS.
#[test]
#[ignore = "needs root"]
fn ipvs_mode_survives_ipset_restore_failing_three_times() {
    if !kp_test::netns::require_root() {
        return;
    }
    if !guest::in_guest("ipvs_mode_survives_ipset_restore_failing_three_times") {
        return;
    }
    tool_failures_are_survived("ipvs", false, Failures::LogLines);
}

/// The manifest directory disappears (an unmounted volume) and comes back: nothing is removed
/// meanwhile, and changes made while it was gone are picked up when it returns.
#[test]
#[ignore = "needs root"]
fn the_manifest_directory_vanishing_and_returning_removes_nothing() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let root = temp_dir("faults-dir");
    let manifests = root.0.join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    write_atomically(&manifests.join("cluster.json"), &kp_flows::manifest_list());
    let tools = temp_dir("faults-dir-tools");
    write_wrappers(&tools.0, applying_tools("nftables"));
    let proxy = start(&lab, "nftables", &manifests, &tools.0);

    let aside = root.0.join("aside");
    std::fs::rename(&manifests, &aside).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        web_backends(&lab, kp_test::flows::TRIES),
        ["pod-1", "pod-2", "pod-3"],
        "rules stay while the directory is gone:\n{}",
        proxy.log()
    );
    assert!(answers(&lab, "10.96.0.10"));

    // It comes back with a new Service.
    write_atomically(&aside.join("faulty.json"), &faulty_service());
    std::fs::rename(&aside, &manifests).unwrap();
    eventually(
        "the returned directory's new Service to be programmed",
        Duration::from_secs(30),
        || answers(&lab, "10.96.0.140"),
    );
    assert_eq!(
        web_backends(&lab, kp_test::flows::TRIES),
        ["pod-1", "pod-2", "pod-3"]
    );
}

/// How a mode counts what its periodic check found: a metric of its own, a log line for each
/// difference it repairs, or (ebpf, whose periodic full sync reads every map back and writes
/// the difference) the periodic full syncs that had something to write.
#[derive(Clone, Copy)]
enum Repairs {
    Metric(&'static str),
    LogLines(&'static str),
    FullSyncWrites,
    /// Full syncs that wrote more than the full sync before them: ipvs mode's periodic full
    /// sync reads IPVS, the sets and `kube-ipvs0` back and writes what differs, but restores
    /// its chains every time, so a full sync that found nothing still reports those writes.
    /// (The tamper waits for a periodic full sync first, so the one before a repair is a
    /// quiet one, not the first sync.)
    FullSyncWritesAboveTheLast,
}

/// The sync loop's line for a full sync, followed by the number of operations it sent.
const FULL_SYNC: &str = "programmed the kernel (full sync) operations=";
/// Userspace mode's own line for each difference its redirect table's check finds.
const USERSPACE_DRIFT: &str = "the userspace redirect table differs from the plan; rebuilding";

impl Repairs {
    fn count(self, lab: &Lab, proxy: &ChildGuard) -> f64 {
        match self {
            Repairs::Metric(name) => metric_sum(lab.node(), name),
            Repairs::LogLines(line) => proxy.log().matches(line).count() as f64,
            Repairs::FullSyncWrites => proxy
                .log()
                .lines()
                .filter_map(|l| l.split_once(FULL_SYNC))
                .filter_map(|(_, rest)| rest.split_whitespace().next()?.parse::<u64>().ok())
                .filter(|n| *n > 0)
                .count() as f64,
            Repairs::FullSyncWritesAboveTheLast => {
                let writes = full_sync_writes(proxy);
                writes.windows(2).filter(|w| w[1] > w[0]).count() as f64
            }
        }
    }
}

/// The operations of each full sync in `proxy`'s log, in order.
fn full_sync_writes(proxy: &ChildGuard) -> Vec<u64> {
    proxy
        .log()
        .lines()
        .filter_map(|l| l.split_once(FULL_SYNC))
        .filter_map(|(_, rest)| rest.split_whitespace().next()?.parse::<u64>().ok())
        .collect()
}

/// What is done behind the proxy's back.
enum Tamper<'a> {
    /// Commands run in the lab's node.
    Commands(&'a [&'a [&'a str]]),
    /// An ebpf map entry deleted through its pin: the map's name and the key's bytes.
    EbpfMapEntry(&'a str, Vec<u8>),
}

/// Something deletes part of our rules behind the proxy's back; the periodic check (every
/// `--iptables-sync-period`, 1 s in these tests; ipvs mode's `--ipvs-sync-period`, see
/// [`IPVS_PERIODS`]) finds and repairs it.
fn tampering_is_repaired_within_one_sync_period(
    mode: &str,
    legacy: bool,
    tamper: Tamper<'_>,
    repairs: Repairs,
) {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(legacy);
    // ebpf mode: a cgroup (the lab's proxy and clients inside) and a bpffs of the test's
    // own; dropped after the proxy.
    let sandbox = (mode == "ebpf").then(|| ebpf_lab::Sandbox::new("tamper"));
    if let Some(sandbox) = &sandbox {
        sandbox.admit(&lab);
    }
    let flags = sandbox.as_ref().map(|s| s.flags()).unwrap_or_default();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let manifests = temp_dir(&format!("tamper-{mode}-{legacy}"));
    let tools = temp_dir(&format!("tamper-tools-{mode}-{legacy}"));
    write_wrappers(&tools.0, &[]);
    write_atomically(
        &manifests.0.join("cluster.json"),
        &kp_flows::manifest_list(),
    );
    let proxy = start_with(&lab, mode, &manifests.0, &tools.0, &flags);
    assert!(answers(&lab, "10.96.0.10"));
    if let Repairs::FullSyncWritesAboveTheLast = repairs {
        // A periodic full sync after the first one, so that the repair is compared with a
        // quiet one; tampering right after it also leaves the test a whole period to see
        // the breakage before the next one repairs it.
        let synced = full_sync_writes(&proxy).len();
        eventually(
            &format!("{mode}: a periodic full sync"),
            wait(10, 60),
            || full_sync_writes(&proxy).len() > synced,
        );
    }
    let before = repairs.count(&lab, &proxy);
    match tamper {
        Tamper::Commands(commands) => {
            for command in commands {
                lab.node()
                    .run(command)
                    .unwrap_or_else(|e| panic!("{command:?}: {e}"));
            }
        }
        Tamper::EbpfMapEntry(map, key) => sandbox
            .as_ref()
            .expect("ebpf mode's sandbox")
            .delete_map_entry(map, &key),
    }
    assert!(
        !answers(&lab, "10.96.0.10"),
        "{mode}: the tampering did not break the web Service, so it proves nothing"
    );
    let repaired = eventually("the tampered rules to be repaired", wait(5, 60), || {
        answers(&lab, "10.96.0.10")
    });
    // The sync that repairs counts the repair when it ends, which can be a moment after the
    // part that mattered answered (in the guest, seconds: the sets come first in a sync).
    let until = std::time::Instant::now() + wait(5, 60);
    while repairs.count(&lab, &proxy) <= before && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        repairs.count(&lab, &proxy) > before,
        "{mode}: the repair is counted\n{}",
        proxy.log()
    );
    assert_eq!(
        web_backends(&lab, kp_test::flows::TRIES),
        ["pod-1", "pod-2", "pod-3"]
    );
    eprintln!("{mode}: tampering repaired {repaired:?} after it was seen");
}

#[test]
#[ignore = "needs root"]
fn nftables_mode_repairs_an_element_deleted_behind_its_back() {
    tampering_is_repaired_within_one_sync_period(
        "nftables",
        false,
        Tamper::Commands(&[&[
            "nft",
            "delete",
            "element",
            "ip",
            "kube-proxy",
            "vips-3",
            "{ 10.96.0.10 . tcp . 80 }",
        ]]),
        Repairs::Metric("kubeproxy_rs_nftables_readback_mismatches_total"),
    );
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_nft_repairs_a_chain_flushed_behind_its_back() {
    tampering_is_repaired_within_one_sync_period(
        "iptables",
        false,
        Tamper::Commands(&[&["iptables-nft", "-t", "nat", "-F", "KUBE-SERVICES"]]),
        Repairs::Metric("kubeproxy_rs_iptables_readback_mismatches_total"),
    );
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_legacy_repairs_a_chain_flushed_behind_its_back() {
    tampering_is_repaired_within_one_sync_period(
        "iptables",
        true,
        Tamper::Commands(&[&["iptables-legacy", "-t", "nat", "-F", "KUBE-SERVICES"]]),
        Repairs::Metric("kubeproxy_rs_iptables_readback_mismatches_total"),
    );
}

#[test]
#[ignore = "needs root"]
fn userspace_mode_repairs_an_element_deleted_behind_its_back() {
    tampering_is_repaired_within_one_sync_period(
        "userspace",
        false,
        Tamper::Commands(&[common::DELETE_USERSPACE_WEB_REDIRECT]),
        Repairs::LogLines(USERSPACE_DRIFT),
    );
}

/// ebpf mode's periodic full sync reads every map back and writes what differs from the
/// planner's record (`kp-ebpf`'s dataplane: `read_back`, then `diff`); the web frontend's
/// head entry deleted through its pin leaves 10.96.0.10:80 refused (the address map rejects
/// a ClusterIP's unknown ports) until then.
#[test]
#[ignore = "needs root"]
fn ebpf_mode_repairs_a_map_entry_deleted_behind_its_back() {
    tampering_is_repaired_within_one_sync_period(
        "ebpf",
        false,
        Tamper::EbpfMapEntry(
            "kp_services",
            ebpf_lab::tcp_frontend_head("10.96.0.10".parse().unwrap(), 80),
        ),
        Repairs::FullSyncWrites,
    );
}

/// The web virtual server deleted (`ipvsadm -D`): 10.96.0.10 is still bound to `kube-ipvs0`
/// and let through by `KUBE-IPVS-FILTER`, so a connection reaches the node's own stack, where
/// nothing listens on port 80, and is refused until the periodic full sync re-adds the virtual
/// server and its real servers. Runs in the kp-vm guest: this machine's kernel has no IPVS.
#[test]
#[ignore = "needs root"]
fn ipvs_mode_repairs_a_virtual_server_deleted_behind_its_back() {
    if !kp_test::netns::require_root() {
        return;
    }
    if !guest::in_guest("ipvs_mode_repairs_a_virtual_server_deleted_behind_its_back") {
        return;
    }
    tampering_is_repaired_within_one_sync_period(
        "ipvs",
        false,
        Tamper::Commands(&[&["ipvsadm", "-D", "-t", "10.96.0.10:80"]]),
        Repairs::FullSyncWritesAboveTheLast,
    );
}

/// `KUBE-CLUSTER-IP` flushed: besides masquerade, the set is what lets a new connection to a
/// ClusterIP through `KUBE-IPVS-FILTER`, which rejects new connections to every other address
/// of `KUBE-IPVS-IPS`; so 10.96.0.10 refuses until the periodic full sync (which compares the
/// sets with `ipset save`) adds the elements back. Runs in the kp-vm guest.
#[test]
#[ignore = "needs root"]
fn ipvs_mode_repairs_a_set_flushed_behind_its_back() {
    if !kp_test::netns::require_root() {
        return;
    }
    if !guest::in_guest("ipvs_mode_repairs_a_set_flushed_behind_its_back") {
        return;
    }
    tampering_is_repaired_within_one_sync_period(
        "ipvs",
        false,
        Tamper::Commands(&[&["ipset", "flush", "KUBE-CLUSTER-IP"]]),
        Repairs::FullSyncWritesAboveTheLast,
    );
}
