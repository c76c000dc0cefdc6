//! A DaemonSet rollout restarts kube-proxy on every node: `kill -9` and a new process, in each
//! kernel mode, under traffic. A connection that sends every 10 ms through a ClusterIP must not
//! be reset or stall, and no new connection made while the proxy is down or starting may be
//! refused, reset or lost: the kernel keeps the rules while no proxy runs, and the new process
//! must never take them away while it takes over.
//!
//! ebpf mode runs on a cgroup and a bpffs of the test's own (its pinned maps and links keep
//! serving while no proxy runs; the new process adopts the pins). Userspace mode cannot hold
//! this bar across `kill -9`: the connections it relays live in the process that dies (as in
//! upstream's userspace mode), and new connections are redirected to a port nobody listens on
//! until the next proxy has synced. What it holds is the graceful restart a rolling update
//! does: SIGTERM, the old process serving on while the new one starts and takes the redirect
//! rules over, then draining its relays.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kp_test::echo::{self, Outcome, Proto, Request};
use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

mod common;
mod ebpf_lab;
mod guest;
mod switching;
use common::{temp_dir, write_atomically, PROGRAMMED};

/// The fixture's web Service: pods 1-3 behind 10.96.0.10:80.
const WEB: &str = "10.96.0.10";

/// How long the long-lived connection and the run of new connections go on: through the kill,
/// the new process's start and its first sync.
const STREAM_FOR: Duration = Duration::from_secs(6);

/// A new connection this slow lost its first SYN (the kernel retransmits after 1 s): it was
/// answered, but only because the rules came back before the retransmission.
const SLOW_CONNECT: Duration = Duration::from_millis(500);

/// The longest pause the long-lived connection may see. Nothing in the kernel changes during a
/// restart, so anything near a TCP retransmission (200 ms and more) means a lost packet.
const MAX_GAP: Duration = Duration::from_millis(100);

/// How long the control leaves the node without rules.
const WINDOW_WITHOUT_RULES: Duration = Duration::from_millis(1000);

/// ipvs mode's periods in these tests.
const IPVS_PERIODS: [&str; 2] = ["--ipvs-sync-period=1s", "--ipvs-min-sync-period=100ms"];

/// The kp-vm guest (ipvs mode) is emulated (TCG) on a machine it shares, and that, not the
/// proxy, sets three of the bar's numbers there:
///
/// - a start's first sync took 5-27 s in the guest (a full sync that changes nothing, 9 s:
///   every `ipset` and `iptables-nft` run is emulated), so the traffic runs 30 s, long enough to
///   outlast the kill, the new process's start and its first sync (checked), and the first
///   sync may take 180 s, as in `ipvs_vm_e2e.rs`;
/// - the guest stalls as a whole: with no restart and no change of rules, the long-lived
///   connection saw gaps of 48 ms to 1.4 s and a new connection took up to 1.4 s (measured
///   over eight 6-25 s runs). A stall cannot be told from a lost packet by its length (a lost
///   SYN costs 1 s), so [`MAX_GAP`] and [`SLOW_CONNECT`] are not applied there; the kernel's
///   own count of losses is, in every namespace of the lab: no SYN retransmitted
///   (`TCPSynRetrans`) and no retransmission timeout (`TCPTimeouts`). Both stayed 0 in those
///   runs (a stall sets off only tail-loss probes, `TCPLossProbes`, which are not counted),
///   and a run that removed the rules while no proxy ran counted 4 and 10.
const GUEST_STREAM_FOR: Duration = Duration::from_secs(30);
/// The first sync's wait in the guest (see [`GUEST_STREAM_FOR`]).
const GUEST_FIRST_SYNC: Duration = Duration::from_secs(180);

/// How long the traffic goes on: [`STREAM_FOR`], or in the guest [`GUEST_STREAM_FOR`].
fn stream_for() -> Duration {
    if guest::is_guest() {
        GUEST_STREAM_FOR
    } else {
        STREAM_FOR
    }
}

fn start(lab: &Lab, mode: &str, dir: &std::path::Path, extra: &[String]) -> (ChildGuard, Duration) {
    let started = Instant::now();
    let mut source = vec!["--manifests", dir.to_str().unwrap()];
    source.extend(extra.iter().map(String::as_str));
    let mut proxy = common::spawn_proxy_in_mode(lab, mode, &[], &source);
    let wait = if guest::is_guest() {
        GUEST_FIRST_SYNC
    } else {
        Duration::from_secs(60)
    };
    proxy
        .wait_for_log(PROGRAMMED, wait)
        .unwrap_or_else(|e| panic!("{mode}: first sync: {e}\n{}", proxy.log()));
    (proxy, started.elapsed())
}

/// What the traffic saw across a restart.
struct Seen {
    stream: echo::StreamResult,
    fresh: echo::TimedOutcomes,
    /// From the traffic's start to the new process's first sync.
    programmed_after: Duration,
    /// In the guest: what the lab's namespaces counted as lost meanwhile.
    losses: Option<Losses>,
}

/// TCP's own count of lost packets, summed over the lab's pods (the client and the servers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Losses {
    /// SYNs sent again (`TcpExt: TCPSynRetrans`).
    syn_retransmits: u64,
    /// Retransmission timeouts (`TcpExt: TCPTimeouts`).
    timeouts: u64,
}

impl Losses {
    fn read(lab: &Lab) -> Losses {
        let mut sum = Losses::default();
        for i in 0..lab.pod_count() {
            let text = lab
                .pod(i)
                .run(&["cat", "/proc/net/netstat"])
                .expect("/proc/net/netstat");
            sum.syn_retransmits += tcp_ext(&text, "TCPSynRetrans");
            sum.timeouts += tcp_ext(&text, "TCPTimeouts");
        }
        sum
    }

    fn since(self, before: Losses) -> Losses {
        Losses {
            syn_retransmits: self.syn_retransmits - before.syn_retransmits,
            timeouts: self.timeouts - before.timeouts,
        }
    }
}

/// Counter `field` of `/proc/net/netstat`'s `TcpExt:` lines (names, then values).
fn tcp_ext(netstat: &str, field: &str) -> u64 {
    let mut lines = netstat.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next(), lines.next());
    let (Some(names), Some(values)) = (names, values) else {
        panic!("no TcpExt lines in /proc/net/netstat:\n{netstat}");
    };
    let at = names
        .split_whitespace()
        .position(|n| n == field)
        .unwrap_or_else(|| panic!("no {field} in /proc/net/netstat"));
    values
        .split_whitespace()
        .nth(at)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field}: no value in /proc/net/netstat"))
}

/// Starts the proxy, then kills it with SIGKILL and starts a new one while a long-lived
/// connection and a run of new connections go through the web ClusterIP. With `flush_between`,
/// the rules are removed while no proxy runs (`kube-proxy --cleanup`), as a proxy that
/// rebuilt from nothing would: the control that shows the harness sees a window without rules.
fn restart_under_traffic(mode: &str, legacy: bool, flush_between: bool) -> Seen {
    let (lab, _echo) = common::serving_lab(legacy);
    // ebpf mode: a cgroup (the lab's proxy and clients inside) and a bpffs for the pins,
    // both the test's own; dropped after the proxies.
    let sandbox = (mode == "ebpf").then(|| ebpf_lab::Sandbox::new("restart"));
    if let Some(sandbox) = &sandbox {
        sandbox.admit(&lab);
    }
    let mut extra = sandbox.as_ref().map(|s| s.flags()).unwrap_or_default();
    if mode == "ipvs" {
        // The ipvs section's periods (the iptables ones do not apply in ipvs mode): a periodic
        // full sync every second, as the other modes have here.
        extra.extend(IPVS_PERIODS.map(String::from));
    }
    let dir = temp_dir(&format!("restart-{mode}"));
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let (mut proxy, _) = start(&lab, mode, &dir.0, &extra);

    let web: IpAddr = WEB.parse().unwrap();
    let client = lab.pod(4);
    let losses = guest::is_guest().then(|| Losses::read(&lab));
    let stream_for = stream_for();
    let traffic = Instant::now();
    let mut stream = echo::spawn_stream(client, web, 80, Duration::from_millis(10), stream_for)
        .expect("long-lived connection");
    // New connections all through the restart, one after another.
    let fresh = Request::new(Proto::Tcp, web, 80).timeout(Duration::from_secs(2));
    let mut fresh = echo::spawn_requests(client, &fresh, stream_for).expect("new connections");
    std::thread::sleep(Duration::from_millis(500));

    proxy.kill_now().expect("kill -9");
    // A moment with no proxy at all, as between a pod's death and its replacement's start.
    std::thread::sleep(Duration::from_millis(300));
    if flush_between {
        lab.node()
            .run(&[env!("CARGO_BIN_EXE_kube-proxy"), "--cleanup"])
            .expect("kube-proxy --cleanup");
        // Longer than SLOW_CONNECT, so that whichever attempt the window holds (one begun
        // in it, or one whose packets were in flight when the rules went) shows it.
        std::thread::sleep(WINDOW_WITHOUT_RULES);
    }
    let (proxy, took) = start(&lab, mode, &dir.0, &extra);
    let programmed_after = traffic.elapsed();
    eprintln!("{mode}: restarted and programmed in {took:?}");

    let stream = echo::finished_stream(&mut stream, stream_for + Duration::from_secs(10))
        .expect("the stream's result");
    let fresh = echo::finished_requests(&mut fresh, Duration::from_secs(60))
        .expect("the new connections' outcomes");
    let losses = losses.map(|before| Losses::read(&lab).since(before));
    drop(proxy);
    Seen {
        stream,
        fresh,
        programmed_after,
        losses,
    }
}

fn assert_seamless(mode: &str, legacy: bool) {
    if !kp_test::netns::require_root() {
        return;
    }
    let Seen {
        stream,
        fresh,
        programmed_after,
        losses,
    } = restart_under_traffic(mode, legacy, false);
    let outcomes = &fresh.outcomes;
    assert_eq!(
        stream.failed, None,
        "{mode}: the long-lived connection broke: {stream:?}"
    );
    assert_eq!(stream.sent, stream.echoed, "{stream:?}");
    assert!(
        stream.sent > 100,
        "{mode}: the connection barely ran: {stream:?}"
    );
    if let Some(losses) = losses {
        // The guest: see GUEST_STREAM_FOR.
        assert!(
            programmed_after < stream_for(),
            "{mode}: the traffic ended before the new process's first sync ({programmed_after:?})"
        );
        assert_eq!(
            losses,
            Losses::default(),
            "{mode}: packets were lost during the restart: {stream:?}, slowest new connection {:?}",
            fresh.slowest
        );
    } else {
        assert!(
            stream.max_gap <= MAX_GAP,
            "{mode}: the connection stalled for {:?}: {stream:?}",
            stream.max_gap
        );
    }
    let failed: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !matches!(o, Outcome::Answered { .. }))
        .collect();
    assert!(
        outcomes.len() > 500 && failed.is_empty(),
        "{mode}: {} of {} new connections failed during the restart: {:?}",
        failed.len(),
        outcomes.len(),
        &failed[..failed.len().min(10)]
    );
    assert!(
        losses.is_some() || fresh.slowest < SLOW_CONNECT,
        "{mode}: a new connection took {:?}: a lost SYN, answered only when retransmitted",
        fresh.slowest
    );
    match losses {
        // Not "longest gap": the guest's gaps are the emulator's, not held to MAX_GAP.
        Some(_) => eprintln!(
            "{mode} (guest): {} lines over one connection (gaps up to {:?}, not held in the guest), \
             {} new connections (slowest {:?}), first sync {programmed_after:?} into the traffic, \
             no SYN retransmitted, no retransmission timeout, none failed",
            stream.echoed,
            stream.max_gap,
            outcomes.len(),
            fresh.slowest
        ),
        None => eprintln!(
            "{mode}: {} lines over one connection (longest gap {:?}), {} new connections (slowest {:?}), none failed",
            stream.echoed,
            stream.max_gap,
            outcomes.len(),
            fresh.slowest
        ),
    }
}

#[test]
#[ignore = "needs root"]
fn nftables_mode_restarts_after_kill_9_without_a_reset_or_a_refused_connection() {
    assert_seamless("nftables", false);
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_nft_restarts_after_kill_9_without_a_reset_or_a_refused_connection() {
    assert_seamless("iptables", false);
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_on_legacy_restarts_after_kill_9_without_a_reset_or_a_refused_connection() {
    assert_seamless("iptables", true);
}

/// Its socket hooks stay attached through their pinned links and its maps stay pinned while no
/// proxy runs; the new process adopts both.
#[test]
#[ignore = "needs root"]
fn ebpf_mode_restarts_after_kill_9_without_a_reset_or_a_refused_connection() {
    assert_seamless("ebpf", false);
}

/// Its virtual servers, sets, chains and `kube-ipvs0`'s addresses stay in the kernel while no
/// proxy runs; the new process adopts them (a sync diffs against what the kernel holds). Runs
/// in the kp-vm guest: this machine's kernel has no IPVS.
#[test]
#[ignore = "needs root"]
fn ipvs_mode_restarts_after_kill_9_without_a_reset_or_a_refused_connection() {
    if !kp_test::netns::require_root() {
        return;
    }
    if !guest::in_guest("ipvs_mode_restarts_after_kill_9_without_a_reset_or_a_refused_connection") {
        return;
    }
    assert_seamless("ipvs", false);
}

/// Userspace mode's rolling restart: SIGTERM to the running proxy, which serves on while its
/// redirect rules send connections to it; a new proxy starts, syncs and points the rules at
/// its own port; the old one drains its relays (the long-lived connections among them) and
/// exits on its own. Held to the bar of the restarts above, for a long-lived connection and
/// new connections through the web ClusterIP and its NodePort. (`kill -9` cannot hold it:
/// see the module docs.)
#[test]
#[ignore = "needs root"]
fn userspace_mode_restarts_on_sigterm_without_a_reset_or_a_refused_connection() {
    if !kp_test::netns::require_root() {
        return;
    }
    let (lab, _echo) = common::serving_lab(false);
    let dir = temp_dir("restart-userspace");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    // The default drain timeout (10 s) outlasts the traffic.
    let sw = switching::Switcher {
        lab: &lab,
        dir: &dir.0,
        extra: &[],
        first_sync: Duration::from_secs(60),
        bar: switching::Bar::HOST,
    };
    let running = sw.start("userspace");
    let (proxy, seen) = switching::switch(&sw, running, "userspace", "userspace", STREAM_FOR);
    drop(proxy);
    let problems = seen.problems();
    assert!(
        problems.is_empty(),
        "userspace -> userspace: {problems:?}\n{}",
        seen.summary()
    );
    // The restarts' bar, stricter than the switching test's.
    for (what, s) in &seen.streams {
        assert!(
            s.max_gap <= MAX_GAP,
            "userspace: the {what} connection stalled for {:?}: {s:?}",
            s.max_gap
        );
    }
    for (what, f) in &seen.fresh {
        let failed = f
            .outcomes
            .iter()
            .filter(|o| !matches!(o, Outcome::Answered { .. }))
            .count();
        assert_eq!(
            failed, 0,
            "userspace: {what}: {failed} new connections failed"
        );
    }
    let gap = seen
        .streams
        .iter()
        .map(|(_, s)| s.max_gap)
        .max()
        .unwrap_or_default();
    let fresh: usize = seen.fresh.iter().map(|(_, f)| f.outcomes.len()).sum();
    eprintln!(
        "userspace (SIGTERM): {} (longest gap {gap:?}), {fresh} new connections, none failed",
        seen.summary()
    );
}

/// The control: a restart that leaves a moment without rules is caught by the new
/// connections (one goes untranslated: it times out or stalls until its SYN is retransmitted),
/// so the tests above can fail.
#[test]
#[ignore = "needs root"]
fn the_harness_catches_a_restart_that_leaves_a_moment_without_rules() {
    if !kp_test::netns::require_root() {
        return;
    }
    let seen = restart_under_traffic("nftables", false, true);
    let failed = seen
        .fresh
        .outcomes
        .iter()
        .filter(|o| !matches!(o, Outcome::Answered { .. }))
        .count();
    // Connections are made one after another, so the window costs one attempt: it times out,
    // or (when the rules return before its SYN is retransmitted) it is answered a second late.
    assert!(
        failed > 0 || seen.fresh.slowest >= SLOW_CONNECT,
        "no new connection failed or stalled without rules: {:?}, slowest {:?}",
        echo::tally(&seen.fresh.outcomes),
        seen.fresh.slowest
    );
}
