//! Switching the proxy mode under traffic, shared by the host's switching test
//! (`modes_e2e.rs`) and the ipvs guest's (`ipvs_vm_e2e.rs`): mode A's binary is stopped and
//! mode B's started on the same manifest directory, while one long-lived TCP connection through
//! a ClusterIP and one through a NodePort send every 10 ms, and new connections to both are made
//! one after another. A switch passes with no reset or lost line on the long-lived connections,
//! no pause over its [`Bar`] (on the host the issue's [`MAX_GAP`]), no new connection refused
//! or reset (the guest's bar counts a lone refused one as a stray), at most [`STRAY_FAILURES`]
//! new connection of each kind timed out (printed), and no new ClusterIP connection answered
//! only after a retransmitted SYN.
//!
//! B starts once A has exited, or once A says it serves on after the stop (a userspace proxy
//! keeps relaying while its redirect rules still send connections to it, [`SERVING_ON`]); A
//! must then exit on its own, after B removed its rules and its relays ended, well within its
//! drain timeout.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kp_test::echo::{self, Outcome, Proto, Request};
use kp_test::lab::Lab;
use kp_test::netns::ChildGuard;

use crate::common::{self, PROGRAMMED};

/// The fixture's web Service: pods 1-3 behind 10.96.0.10:80.
pub const WEB: &str = "10.96.0.10";
/// The web Service's NodePort (`externalTrafficPolicy: Cluster`, masqueraded from outside).
pub const WEB_NODE_PORT: u16 = 30080;
/// The longest pause a long-lived connection may see (the bar), on the host; a longer
/// one in the guest is printed as over target. A switch with an instant without rules shows a
/// pause of seconds. Measured on the host with the switching test running alone: 11-29 ms
/// (a lone 119 ms stall was seen once while other tests loaded both cores, so the host's test
/// runs alone).
pub const MAX_GAP: Duration = Duration::from_millis(100);
/// New connections of one kind that may time out in one switch, each printed (a SYN and its
/// retransmission lost; `Seen::fresh_problems_of` says where from); a refused or reset one
/// always fails the switch. An instant without rules refuses hundreds.
pub const STRAY_FAILURES: usize = 1;
/// In a switch to or from ebpf mode, the timed-out new connections of a held kind that pass, per
/// thousand (each printed; never fewer than [`STRAY_FAILURES`]). Its socket hooks connect
/// straight to a backend, so one client port's connections to that backend alternate between
/// two TCP tuples (the backend's own, and the ClusterIP's that conntrack translates), each with
/// its own series of initial sequence numbers and timestamps: a SYN that meets the backend's
/// TIME_WAIT of the other tuple is answered with an ACK, not a SYN-ACK, and one connection in a
/// few thousand loses both its SYNs (a timeout); one whose conntrack entry outlived the switch
/// could be sent on untranslated (refused, which fails the switch). Seen: up to 2 in 2,600 in 36 switches; none
/// in 9,000 over three switches to ebpf since it deletes the old mode's closed conntrack
/// entries after its first sync (`modes::ebpf::forget_closed_translations`).
/// An instant without rules refuses hundreds.
pub const EBPF_FAILURES_PER_MILLE: usize = 2;
/// In a switch to or from ebpf mode, the timed-out new NodePort connections that pass at the
/// least (each printed; [`EBPF_FAILURES_PER_MILLE`] where that allows more): one whose
/// handshake meets the switch, or whose masqueraded port meets the other path's, times out;
/// seen in 45 of 72 host switches to ebpf, at most twice in one, of a few hundred to a few
/// thousand (the tc path's are fewer than netfilter's). A path that drops them all loses
/// hundreds.
pub const EBPF_NODE_PORT_TIMEOUTS: usize = 2;
/// A new connection this slow lost its first SYN.
pub const SLOW_CONNECT: Duration = Duration::from_millis(500);
/// The local ports the pod's long-lived ClusterIP connection is made from, the next one each switch
/// (a port is not bound again while its last connection waits in TIME_WAIT): below the kernel's
/// ephemeral range ([`kp_test::lab::EPHEMERAL_PORTS`]), so that none of the pod's new connections
/// takes it. Linux gives a new connection a local port that another connection of the pod uses when
/// the two go to different destinations; after a switch from ebpf to ipvs the long-lived connection
/// goes straight to its backend (ebpf's socket hooks connected it there), and a new connection to
/// the ClusterIP from its port that IPVS schedules to the same backend meets IPVS's known limit
/// (kubernetes/kubernetes#90042, #107249, upstream's ipvs mode alike, for any pod that talks to an
/// endpoint both directly and through its Service): IPVS gives the old connection's replies the
/// ClusterIP's address and conntrack drops the new SYN (its reply tuple is the old connection's).
/// Measured in the kp-vm guest: the new connection timed out and the old one stalled until reset.
/// In the test that pair met it about once in seven runs (a stall of seconds); the README's
/// "Switching modes" says what an operator sees.
const STREAM_PORTS: std::ops::Range<u16> = 20000..30000;
const _: () = assert!(STREAM_PORTS.end <= *kp_test::lab::EPHEMERAL_PORTS.start());
static NEXT_STREAM_PORT: std::sync::atomic::AtomicU16 =
    std::sync::atomic::AtomicU16::new(STREAM_PORTS.start);

/// The local port for the next long-lived ClusterIP connection ([`STREAM_PORTS`]).
fn stream_port() -> u16 {
    let n = NEXT_STREAM_PORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    STREAM_PORTS.start + (n - STREAM_PORTS.start) % STREAM_PORTS.len() as u16
}

pub use crate::common::LEFTOVERS_GONE;
/// The log line of leftovers kept because connections still use them.
pub const LEFTOVERS_DRAINING: &str = "kept until they end";
/// The log line of a stopping userspace proxy that serves on while its rules reach it
/// (`kp_userspace::SERVING_ON`).
pub const SERVING_ON: &str = "stopping: serving on while the redirect rules send connections here";
/// The reason a draining userspace proxy gives when another proxy took over.
pub const TAKEN_OVER: &str = "the redirect rules no longer send connections here";

/// Sends SIGTERM to `proxy` and waits until it has exited or says that it serves on until
/// another proxy takes over; returns whether it still runs.
pub fn stop(proxy: &mut ChildGuard, what: &str, within: Duration) -> bool {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &proxy.id().to_string()])
        .status();
    let deadline = Instant::now() + within;
    loop {
        if proxy.try_wait().expect("the proxy's status").is_some() {
            return false;
        }
        if proxy.log().contains(SERVING_ON) {
            return true;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still running {within:?} after SIGTERM, without serving on\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits up to `within` for `proxy` to exit on its own; what went wrong, if anything.
pub fn exited_on_its_own(proxy: &mut ChildGuard, what: &str, within: Duration) -> Option<String> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        match proxy.try_wait().expect("the proxy's status") {
            Some(status) if status.success() => return None,
            Some(status) => return Some(format!("{what} exited with {status}")),
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let _ = proxy.kill_now();
    Some(format!(
        "{what} was still running {within:?} later (killed)"
    ))
}

/// The pauses a switch is held to.
#[derive(Debug, Clone, Copy)]
pub struct Bar {
    /// A long-lived connection's pause that fails the switch.
    pub failing_gap: Duration,
    /// A new ClusterIP connection this slow lost its first SYN.
    pub slow_connect: Duration,
    /// New connections of a kind that may time out per thousand in any pair (each printed;
    /// never fewer than [`STRAY_FAILURES`]).
    pub timeouts_per_mille: usize,
    /// Whether a refused new connection counts as a stray failure rather than failing the
    /// switch.
    pub refusals_are_strays: bool,
}

impl Bar {
    /// The host's bar ([`MAX_GAP`], [`SLOW_CONNECT`]).
    pub const HOST: Bar = Bar {
        failing_gap: MAX_GAP,
        slow_connect: SLOW_CONNECT,
        timeouts_per_mille: 0,
        refusals_are_strays: false,
    };

    /// The kp-vm guest's. Under TCG on a shared 2-core machine the guest's own scheduling
    /// stalls a connection for hundreds of milliseconds now and then (290-800 ms measured in
    /// switches whose connections all survived); a second still tells a dropped packet (a
    /// retransmission: at least 1 s for a SYN, 200 ms and doubling for data, and a pause of
    /// seconds for an instant without rules) from a slow guest. The new connections: one in a
    /// thousand of a kind may time out (2 of 3,751 new NodePort connections did in ipvs ->
    /// userspace once, masqueraded as in `Seen::fresh_problems_of`), and a lone refused one is
    /// a stray, printed (1 of 12,311 new ClusterIP connections in nftables -> ipvs once, not
    /// explained yet; the host's pairs refuse none); an instant without rules refuses hundreds.
    pub const GUEST: Bar = Bar {
        failing_gap: Duration::from_secs(1),
        slow_connect: Duration::from_millis(950),
        timeouts_per_mille: 1,
        refusals_are_strays: true,
    };
}

/// Extra flags for every start (the ipvs guest passes its sync periods).
pub struct Switcher<'a> {
    /// The lab.
    pub lab: &'a Lab,
    /// The manifest directory every binary reads.
    pub dir: &'a std::path::Path,
    /// Flags after the common ones.
    pub extra: &'a [&'a str],
    /// How long the first sync may take.
    pub first_sync: Duration,
    /// What a switch is held to.
    pub bar: Bar,
}

impl Switcher<'_> {
    /// Starts `mode`'s binary and waits for its first sync.
    pub fn start(&self, mode: &str) -> ChildGuard {
        let mut source = vec!["--manifests", self.dir.to_str().unwrap()];
        source.extend_from_slice(self.extra);
        let mut proxy = common::spawn_proxy_in_mode(self.lab, mode, &[], &source);
        proxy
            .wait_for_log(PROGRAMMED, self.first_sync)
            .unwrap_or_else(|e| panic!("{mode}: first sync: {e}\n{}", proxy.log()));
        proxy
    }
}

/// What the traffic saw across one switch.
#[derive(Debug)]
pub struct Seen {
    /// What went wrong with the stop of A (a draining proxy that did not exit on its own).
    pub old: Option<String>,
    /// `from -> to`.
    pub pair: String,
    /// The long-lived connections: ClusterIP, NodePort.
    pub streams: Vec<(&'static str, echo::StreamResult)>,
    /// The new connections: ClusterIP, NodePort.
    pub fresh: Vec<(&'static str, echo::TimedOutcomes)>,
    /// From the stop of A to B's first sync.
    pub took: Duration,
    /// What the switch is held to.
    pub bar: Bar,
}

impl Seen {
    /// What went wrong, if anything.
    pub fn problems(&self) -> Vec<String> {
        self.problems_allowing(&[], true, 0)
    }

    /// What went wrong of what every pair is held to: [`Seen::problems`], and for a pair with
    /// ebpf mode, whose new ClusterIP connections may time out [`EBPF_FAILURES_PER_MILLE`] and
    /// its new NodePort connections [`EBPF_NODE_PORT_TIMEOUTS`] (modes_e2e's switching test
    /// says why), and whose slow new ClusterIP connections are printed,
    /// [`Seen::problems_allowing`] that.
    pub fn held_problems(&self) -> Vec<String> {
        if self.pair.split(" -> ").any(|m| m == "ebpf") {
            self.problems_allowing(
                &[("NodePort", EBPF_NODE_PORT_TIMEOUTS)],
                false,
                EBPF_FAILURES_PER_MILLE,
            )
        } else {
            self.problems()
        }
    }

    /// What went wrong, if anything, where the new connections of a kind in `timeouts` may
    /// time out as often as it says in this switch, those of every kind `per_mille` in a
    /// thousand (at least [`STRAY_FAILURES`]), and, without `slow_connects`, a new ClusterIP
    /// connection answered only after a lost SYN is printed instead (a pair that cannot keep
    /// them).
    pub fn problems_allowing(
        &self,
        timeouts: &[(&str, usize)],
        slow_connects: bool,
        per_mille: usize,
    ) -> Vec<String> {
        let mut out = self.stream_problems();
        let mut not_held = Vec::new();
        out.extend(self.fresh_problems_of(timeouts, slow_connects, per_mille, &mut not_held));
        if !not_held.is_empty() {
            eprintln!("  not held in {}: {}", self.pair, not_held.join("; "));
        }
        out.extend(self.old.clone());
        out
    }

    /// What went wrong with the long-lived connections.
    pub fn stream_problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (what, s) in &self.streams {
            if let Some(f) = &s.failed {
                out.push(format!("{what} long-lived connection broke ({f}): {s:?}"));
            } else if s.sent != s.echoed || s.sent < 100 {
                out.push(format!("{what} long-lived connection lost lines: {s:?}"));
            } else if s.max_gap > self.bar.failing_gap {
                out.push(format!(
                    "{what} long-lived connection stalled {:?}",
                    s.max_gap
                ));
            } else if s.max_gap > MAX_GAP {
                eprintln!(
                    "  WARNING: {what} long-lived connection stalled {:?} (over the {MAX_GAP:?} \
                     target)",
                    s.max_gap
                );
            }
        }
        out
    }

    /// What went wrong with the new connections: a kind may time out `per_mille` in a thousand
    /// (at least [`STRAY_FAILURES`], the bar's per mille, and what `timeouts` gives it); a slow
    /// ClusterIP connection without `slow_connects` goes to `not_held` instead. A new
    /// connection refused (unless the bar counts it a stray), reset or failed otherwise is
    /// always a problem, in every kind.
    fn fresh_problems_of(
        &self,
        timeouts: &[(&str, usize)],
        slow_connects: bool,
        per_mille: usize,
        not_held: &mut Vec<String>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for (what, f) in &self.fresh {
            let failed: Vec<&Outcome> = f
                .outcomes
                .iter()
                .filter(|o| !matches!(o, Outcome::Answered { .. }))
                .collect();
            let refused: Vec<&Outcome> = failed
                .iter()
                .copied()
                .filter(|o| **o != Outcome::Timeout)
                .collect();
            let refusals_allowed = if self.bar.refusals_are_strays
                && refused.iter().all(|o| **o == Outcome::Refused)
            {
                STRAY_FAILURES
            } else {
                0
            };
            let per_mille = per_mille.max(self.bar.timeouts_per_mille);
            let stray = timeouts
                .iter()
                .filter(|(kind, _)| kind == what)
                .map(|(_, n)| *n)
                .fold(STRAY_FAILURES, usize::max)
                .max(f.outcomes.len() * per_mille / 1000);
            if refused.len() > refusals_allowed {
                out.push(format!(
                    "{what}: {} of {} new connections refused, reset or failed otherwise: {:?}",
                    refused.len(),
                    f.outcomes.len(),
                    &refused[..refused.len().min(5)]
                ));
            } else if (1..=stray).contains(&failed.len()) && f.outcomes.len() >= 50 {
                eprintln!(
                    "  WARNING: {what}: {} of {} new connections failed: {:?}",
                    failed.len(),
                    f.outcomes.len(),
                    failed
                );
            } else if f.outcomes.len() < 50 || !failed.is_empty() {
                out.push(format!(
                    "{what}: {} of {} new connections failed: {:?}",
                    failed.len(),
                    f.outcomes.len(),
                    &failed[..failed.len().min(5)]
                ));
            }
            // Through the NodePort the client's connections are masqueraded to the node's
            // address; at thousands a second, one now and then is answered only after its
            // SYN's retransmission. Measured without any switch (steady nftables mode, three 6 s
            // runs of new NodePort connections from the outside client, 26,000 in all): the
            // backend pods' TIME_WAIT sockets of earlier connections on the same masqueraded
            // tuple answered 354 SYNs with an ACK (the pods count `TcpExtPAWSTimewait`; the
            // client sent as many resets and SYN retransmissions), and from the second run on
            // some waited a second; iptables mode alike; the ClusterIP's new connections, not
            // masqueraded, had none in 55,000. So the lab's rate and the masquerade, not the
            // switch: the summary shows it, and the bar is for the ClusterIP's new connections.
            if *what == "ClusterIP" && f.slowest >= self.bar.slow_connect {
                let slow = format!("{what}: a new connection took {:?} (a lost SYN)", f.slowest);
                if slow_connects {
                    out.push(slow);
                } else {
                    not_held.push(slow);
                }
            }
        }
        out
    }

    /// One line for the log.
    pub fn summary(&self) -> String {
        let streams: Vec<String> = self
            .streams
            .iter()
            .map(|(w, s)| format!("{w} {}/{} gap {:?}", s.echoed, s.sent, s.max_gap))
            .collect();
        let fresh: Vec<String> = self
            .fresh
            .iter()
            .map(|(w, f)| {
                let ok = f
                    .outcomes
                    .iter()
                    .filter(|o| matches!(o, Outcome::Answered { .. }))
                    .count();
                format!("{w} {ok}/{} slowest {:?}", f.outcomes.len(), f.slowest)
            })
            .collect();
        format!(
            "{}: switched in {:?}; long-lived: {}; new: {}",
            self.pair,
            self.took,
            streams.join(", "),
            fresh.join(", ")
        )
    }
}

/// Stops `running` (mode `from`, SIGTERM) and starts `to` while the traffic flows; waits until
/// `to` has removed `from`'s leftovers (or keeps them for their connections), then for the
/// traffic's end. Returns `to`'s process and what the traffic saw.
pub fn switch(
    sw: &Switcher<'_>,
    mut running: ChildGuard,
    from: &str,
    to: &str,
    traffic_for: Duration,
) -> (ChildGuard, Seen) {
    let lab = sw.lab;
    let web: IpAddr = WEB.parse().unwrap();
    let node: IpAddr = kp_flows::NODE_IP.parse().unwrap();
    let interval = Duration::from_millis(10);
    let (pod, outside) = (lab.pod(4), lab.client());
    let mut streams = vec![
        (
            "ClusterIP",
            echo::spawn_stream_from_port(pod, Some(stream_port()), web, 80, interval, traffic_for)
                .expect("ClusterIP stream"),
        ),
        (
            "NodePort",
            echo::spawn_stream(outside, node, WEB_NODE_PORT, interval, traffic_for)
                .expect("NodePort stream"),
        ),
    ];
    let timeout = Duration::from_secs(2);
    let mut fresh = vec![
        (
            "ClusterIP",
            echo::spawn_requests(
                pod,
                &Request::new(Proto::Tcp, web, 80).timeout(timeout),
                traffic_for,
            )
            .expect("new ClusterIP connections"),
        ),
        (
            "NodePort",
            echo::spawn_requests(
                outside,
                &Request::new(Proto::Tcp, node, WEB_NODE_PORT).timeout(timeout),
                traffic_for,
            )
            .expect("new NodePort connections"),
        ),
    ];
    std::thread::sleep(Duration::from_millis(400));
    let t = Instant::now();
    let draining = stop(&mut running, from, Duration::from_secs(15));
    // A moment with no proxy at all (or only the draining one), as between a pod's stop and its
    // replacement's start.
    std::thread::sleep(Duration::from_millis(200));
    let proxy = sw.start(to);
    let took = t.elapsed();
    let deadline = Instant::now() + traffic_for;
    while Instant::now() < deadline {
        let log = proxy.log();
        if log.contains(LEFTOVERS_GONE) || log.contains(LEFTOVERS_DRAINING) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = proxy.log();
    assert!(
        log.contains(LEFTOVERS_GONE) || log.contains(LEFTOVERS_DRAINING),
        "{from} -> {to}: the other modes' leftovers were not removed while the traffic ran \
         (make it run longer?)\n{log}"
    );
    let wait = traffic_for + Duration::from_secs(20);
    let streams = streams
        .iter_mut()
        .map(|(w, c)| {
            (
                *w,
                echo::finished_stream(c, wait).expect("a stream's result"),
            )
        })
        .collect();
    let fresh = fresh
        .iter_mut()
        .map(|(w, c)| {
            (
                *w,
                echo::finished_requests(c, wait).expect("new connections' outcomes"),
            )
        })
        .collect();
    // The old proxy is gone, or goes on its own now that its rules are and the traffic ended.
    let old = if draining {
        exited_on_its_own(&mut running, from, Duration::from_secs(20)).or_else(|| {
            (!running.log().contains(TAKEN_OVER))
                .then(|| format!("{from} did not see {to} take over:\n{}", running.log()))
        })
    } else {
        match running.try_wait() {
            Ok(Some(status)) if !status.success() => Some(format!("{from} exited with {status}")),
            _ => None,
        }
    };
    let seen = Seen {
        old,
        pair: format!("{from} -> {to}"),
        streams,
        fresh,
        took,
        bar: sw.bar,
    };
    (proxy, seen)
}

/// An order of `modes` in which every ordered pair of two different modes follows each other
/// exactly once (an Eulerian circuit of the complete directed graph), starting and ending with
/// the first: n·(n-1) switches for n modes, each one measured.
pub fn every_pair(modes: &[&'static str]) -> Vec<&'static str> {
    let n = modes.len();
    if n < 2 {
        return modes.to_vec();
    }
    // Hierholzer's algorithm: the next unused edge of each vertex, in order.
    let mut next = vec![0usize; n];
    let mut stack = vec![0usize];
    let mut circuit = Vec::new();
    while let Some(&v) = stack.last() {
        // Skip the loop v -> v.
        if next[v] == v {
            next[v] += 1;
        }
        if next[v] < n {
            let w = next[v];
            next[v] += 1;
            stack.push(w);
        } else {
            circuit.push(stack.pop().unwrap());
        }
    }
    circuit.reverse();
    circuit.into_iter().map(|i| modes[i]).collect()
}

/// [`every_pair`] of `modes` but `hub`, then every pair with `hub` (`hub` between each two of
/// the others, starting and ending where the first circuit ended): the hub's pairs come last,
/// so what they leave behind (conntrack entries) meets no other pair.
pub fn every_pair_hub_last(modes: &[&'static str], hub: &'static str) -> Vec<&'static str> {
    let rest: Vec<&'static str> = modes.iter().copied().filter(|m| *m != hub).collect();
    if !modes.contains(&hub) {
        return every_pair(&rest);
    }
    if rest.is_empty() {
        return vec![hub];
    }
    let mut order = every_pair(&rest);
    for m in rest.iter().skip(1).chain(rest.first()) {
        order.extend([hub, *m]);
    }
    order
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kp_test::echo::{Outcome, StreamResult, TimedOutcomes};

    use super::{every_pair, every_pair_hub_last, Bar, Seen};

    /// A switch whose long-lived connections were fine and whose 3,000 new ClusterIP and 500
    /// new NodePort connections ended with `failures` and `node_port_failures`.
    fn seen(pair: &str, bar: Bar, failures: &[Outcome], node_port_failures: &[Outcome]) -> Seen {
        let answered = Outcome::Answered {
            backend: "pod-1".to_string(),
            client_seen: "10.244.1.14".parse().unwrap(),
        };
        let fresh = |n: usize, failures: &[Outcome]| {
            let mut outcomes = vec![answered.clone(); n - failures.len()];
            outcomes.extend_from_slice(failures);
            TimedOutcomes {
                outcomes,
                slowest: Duration::from_millis(20),
            }
        };
        let stream = || StreamResult {
            backend: "pod-1".to_string(),
            sent: 500,
            echoed: 500,
            max_gap: Duration::from_millis(30),
            failed: None,
        };
        Seen {
            old: None,
            pair: pair.to_string(),
            streams: vec![("ClusterIP", stream()), ("NodePort", stream())],
            fresh: vec![
                ("ClusterIP", fresh(3000, failures)),
                ("NodePort", fresh(500, node_port_failures)),
            ],
            took: Duration::from_millis(300),
            bar,
        }
    }

    #[test]
    fn a_refused_or_reset_new_connection_fails_a_switch_and_a_lone_timeout_does_not() {
        use Outcome::{Refused, Reset, Timeout};
        let host = |failures: &[Outcome]| seen("a -> b", Bar::HOST, failures, &[]).held_problems();
        assert!(host(&[]).is_empty());
        assert!(host(&[Timeout]).is_empty());
        assert_eq!(host(&[Timeout, Timeout]).len(), 1);
        assert_eq!(host(&[Refused]).len(), 1);
        assert_eq!(host(&[Reset]).len(), 1);
        // An ebpf pair: two timeouts in a thousand, still no refusal.
        let ebpf =
            |failures: &[Outcome]| seen("a -> ebpf", Bar::HOST, failures, &[]).held_problems();
        assert!(ebpf(&vec![Timeout; 6]).is_empty());
        assert_eq!(ebpf(&vec![Timeout; 7]).len(), 1);
        assert_eq!(ebpf(&[Refused]).len(), 1);
        let ebpf_node_port =
            |failures: &[Outcome]| seen("ebpf -> a", Bar::HOST, &[], failures).held_problems();
        assert!(ebpf_node_port(&[Timeout, Timeout]).is_empty());
        assert_eq!(ebpf_node_port(&[Timeout, Timeout, Timeout]).len(), 1);
        assert_eq!(ebpf_node_port(&[Reset]).len(), 1);
        // The guest: one in a thousand may time out, a lone refusal is a stray, a reset is not.
        let guest =
            |failures: &[Outcome]| seen("a -> b", Bar::GUEST, failures, &[]).held_problems();
        assert!(guest(&vec![Timeout; 3]).is_empty());
        assert_eq!(guest(&vec![Timeout; 4]).len(), 1);
        assert!(guest(&[Refused]).is_empty());
        assert_eq!(guest(&[Refused, Refused]).len(), 1);
        assert_eq!(guest(&[Reset]).len(), 1);
    }

    #[test]
    fn every_ordered_pair_once_with_the_hubs_last() {
        for modes in [
            &["a", "h"][..],
            &["a", "b", "h"][..],
            &["h", "a", "b", "c"][..],
        ] {
            let order = every_pair_hub_last(modes, "h");
            let n = modes.len();
            assert_eq!(order.len(), n * (n - 1) + 1, "{order:?}");
            assert_eq!(order.first(), order.last());
            let mut pairs: Vec<(&str, &str)> = order.windows(2).map(|w| (w[0], w[1])).collect();
            let first_hub = pairs.iter().position(|(a, b)| *a == "h" || *b == "h");
            assert!(
                pairs[first_hub.unwrap()..]
                    .iter()
                    .all(|(a, b)| *a == "h" || *b == "h"),
                "{order:?}"
            );
            pairs.sort();
            let before = pairs.len();
            pairs.dedup();
            assert_eq!(pairs.len(), before, "{order:?}");
            assert!(pairs.iter().all(|(a, b)| a != b));
        }
    }

    #[test]
    fn every_ordered_pair_once() {
        for modes in [
            &["a", "b"][..],
            &["a", "b", "c"][..],
            &["a", "b", "c", "d", "e"][..],
        ] {
            let order = every_pair(modes);
            let n = modes.len();
            assert_eq!(order.len(), n * (n - 1) + 1, "{order:?}");
            assert_eq!(order.first(), order.last());
            let mut pairs: Vec<(&str, &str)> = order.windows(2).map(|w| (w[0], w[1])).collect();
            pairs.sort();
            let before = pairs.len();
            pairs.dedup();
            assert_eq!(pairs.len(), before, "{order:?}");
            assert!(pairs.iter().all(|(a, b)| a != b));
        }
    }
}
