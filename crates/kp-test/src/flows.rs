//! The packet-flow table with real packets: each row of `kp-flows` is sent from the namespace
//! it names, through the lab node's kernel, and the answers are checked against the row.
//!
//! A mode joins with one line once its dataplane has programmed [`lab`]'s node:
//! [`assert_all`]`(&lab)`, after [`serve_fixture_pods`].
//!
//! What each expectation means on the wire:
//! - `Pods`: every attempt is answered by one of the named pods, each of them answers at least
//!   once (or exactly one does, with affinity), and the source the pod saw is the client's own
//!   or, masqueraded, the node's address on the link towards that pod.
//! - `Drop`: no answer before the timeout. `Reject`: a TCP reset or an ICMP unreachable.
//! - `Untouched`: nobody answers (the packet goes where it would without a proxy, which in the
//!   lab is nowhere that listens).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use kp_core::model::Protocol;
use kp_flows::{Case, Expect, NODE_FROM_LB_IP};

use crate::echo::{self, Outcome, Proto, Request};
use crate::lab::{Lab, NODE_LINK_IP, POD_GATEWAY};
use crate::netns::{ChildGuard, Netns};
use crate::Error;

/// Connections per row that expects endpoints: enough that a balanced Service shows every
/// endpoint (missing one of three has probability 3·(2/3)^40 ≈ 3e-7).
pub const TRIES: usize = 40;

/// How long an attempt that should be answered may take. In the lab an answer takes
/// milliseconds; this only bounds how long a broken row takes to fail.
const ANSWER_TIMEOUT: Duration = Duration::from_millis(1000);

/// The same for SCTP: longer than SCTP's initial retransmission timeout (3 s), so a lost INIT
/// is sent again within the attempt. IPVS drops the first packet of a connection that reuses
/// a finished one's addresses and ports (`conn_reuse_mode` with conntrack on) and counts on the
/// client's retransmission; TCP resends its SYN after 1 s, SCTP its INIT after 3 s, so in the
/// ipvs guest one SCTP attempt in a row's 40 timed out now and then.
const SCTP_ANSWER_TIMEOUT: Duration = Duration::from_millis(4500);

/// How long to wait before calling silence a drop, for UDP.
const SILENCE_TIMEOUT: Duration = Duration::from_millis(600);

/// The same for TCP and SCTP, whose rejects may come only with the first retransmission, 1 s
/// after the first SYN (or INIT): on veth, the ICMP error for the first one can arrive while
/// the connecting socket is still locked by `connect`, and the kernel then keeps it only as a
/// soft error (`TcpExtLockDroppedIcmps`). The retransmission's is delivered while the process
/// waits, and fails the connection with ECONNREFUSED.
const STREAM_SILENCE_TIMEOUT: Duration = Duration::from_millis(1500);

/// Which node a fixture pod runs on, and its index there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// `pod-N`: lab pod N on the node.
    Local(usize),
    /// `remote-N`: lab remote pod N on node-b.
    Remote(usize),
}

/// Where the lab keeps the fixture pod called `name`.
fn place(name: &str) -> Option<Place> {
    if let Some(n) = name.strip_prefix("pod-") {
        return n.parse().ok().map(Place::Local);
    }
    name.strip_prefix("remote-")?
        .parse()
        .ok()
        .map(Place::Remote)
}

/// The pod's namespace, if the lab has that pod.
fn pod_ns<'a>(lab: &'a Lab, name: &str) -> Option<&'a Netns> {
    match place(name)? {
        Place::Local(i) if i < lab.pod_count() => Some(lab.pod(i)),
        Place::Remote(i) if i < lab.remote_pod_count() => Some(lab.remote_pod(i)),
        _ => None,
    }
}

/// The lab the fixture needs: node-a with pods up to the highest `pod-N`, and node-b with
/// remote pods up to the highest `remote-N`.
pub fn lab() -> crate::Result<Lab> {
    let (mut local, mut remote) = (0, 0);
    for p in kp_flows::pods() {
        match place(p.name) {
            Some(Place::Local(i)) => local = local.max(i + 1),
            Some(Place::Remote(i)) => remote = remote.max(i + 1),
            None => {
                return Err(Error::InvalidArgument(format!(
                    "fixture pod {} is neither pod-N nor remote-N",
                    p.name
                )))
            }
        }
    }
    Lab::two_nodes(local, remote)
}

/// The namespace a row's client sits in, and the source address it must bind.
fn client<'a>(lab: &'a Lab, case: &Case) -> Option<(&'a Netns, Option<IpAddr>)> {
    match case.from {
        "client" | "client-outside" => Some((lab.client(), Some(case.packet.src))),
        "node" => Some((lab.node(), None)),
        NODE_FROM_LB_IP => Some((lab.node(), Some(case.packet.src))),
        p => Some((pod_ns(lab, p)?, None)),
    }
}

/// An address on a namespace's loopback, removed when dropped.
struct LocalAddress<'a> {
    ns: &'a Netns,
    cidr: String,
}

impl<'a> LocalAddress<'a> {
    fn add(ns: &'a Netns, ip: IpAddr) -> crate::Result<Self> {
        let cidr = format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 });
        ns.add_addr("lo", &cidr)?;
        Ok(LocalAddress { ns, cidr })
    }
}

impl Drop for LocalAddress<'_> {
    fn drop(&mut self) {
        let _ = self.ns.ip(&["addr", "del", &self.cidr, "dev", "lo"]);
    }
}

/// Name the client's escape sink answers with.
const ESCAPE_SINK: &str = "escaped-to-client";

/// The client answering at a row's destination (see [`check`]).
struct EscapeSink<'a> {
    _address: LocalAddress<'a>,
    _server: ChildGuard,
}

impl<'a> EscapeSink<'a> {
    fn start(lab: &'a Lab, case: &Case) -> crate::Result<Self> {
        let address = LocalAddress::add(lab.client(), case.packet.dst)?;
        let server = echo::serve_on(
            lab.client(),
            ESCAPE_SINK,
            &[(proto(case.packet.protocol), case.packet.dport)],
        )?;
        Ok(EscapeSink {
            _address: address,
            _server: server,
        })
    }
}

fn proto(p: Protocol) -> Proto {
    match p {
        Protocol::Tcp => Proto::Tcp,
        Protocol::Udp => Proto::Udp,
        Protocol::Sctp => Proto::Sctp,
    }
}

/// The source a backend `pod` must see for a masqueraded IPv4 connection: the node's address
/// on the interface towards it.
fn masquerade_source(pod: &str) -> Option<IpAddr> {
    match place(pod)? {
        Place::Local(_) => Some(POD_GATEWAY.into()),
        Place::Remote(_) => Some(NODE_LINK_IP.into()),
    }
}

/// Runs one row with real packets. Returns a description of what went wrong, if anything.
///
/// The row must be runnable in `lab` (its namespaces exist, its protocol is in the kernel);
/// [`check_all`] skips rows that are not.
pub fn check(lab: &Lab, case: &Case) -> Result<(), String> {
    let (ns, src) = client(lab, case)
        .ok_or_else(|| format!("{}: no lab namespace for {}", case.name, case.from))?;
    // The node sends from its LoadBalancer IP only where that IP is local: hold it on the
    // node's loopback for this row (a reply to a non-local source would leave the node).
    let _local_lb_ip = match (case.from, src) {
        (NODE_FROM_LB_IP, Some(ip)) => Some(
            LocalAddress::add(lab.node(), ip)
                .map_err(|e| format!("{}: cannot add {ip} to the node: {e}", case.name))?,
        ),
        _ => None,
    };
    // A packet the node should drop but lets through goes to the client (the node's uplink),
    // where it would die in silence too. For TCP and SCTP rows sent from inside the node, the
    // client answers at the row's destination meanwhile, so an escape shows as an answer. (Not
    // UDP: the echo server answers from its primary address, which the sender ignores; the
    // tracers still tell a UDP drop from an escape.)
    let _escape_sink = match (&case.expect, case.from) {
        (Expect::Drop, from)
            if !matches!(from, "client" | "client-outside")
                && case.packet.protocol != Protocol::Udp =>
        {
            Some(
                EscapeSink::start(lab, case)
                    .map_err(|e| format!("{}: cannot start the escape sink: {e}", case.name))?,
            )
        }
        _ => None,
    };
    let answering = matches!(case.expect, Expect::Pods { .. });
    let mut req = Request::new(
        proto(case.packet.protocol),
        case.packet.dst,
        case.packet.dport,
    )
    .timeout(match (answering, case.packet.protocol) {
        (true, Protocol::Sctp) => SCTP_ANSWER_TIMEOUT,
        (true, _) => ANSWER_TIMEOUT,
        (false, Protocol::Udp) => SILENCE_TIMEOUT,
        (false, Protocol::Tcp | Protocol::Sctp) => STREAM_SILENCE_TIMEOUT,
    });
    if let Some(ip) = src {
        req = req.src_ip(ip);
    }
    // One attempt first: a row that is broken outright fails in a second, not in TRIES.
    let mut outcomes = lab.send(ns, &req);
    if answering && matches!(outcomes.as_slice(), [Outcome::Answered { .. }]) {
        outcomes.extend(lab.send(ns, &req.clone().count(TRIES - 1)));
    }
    let fail = |what: String| Err(format!("{}: {what}; outcomes: {outcomes:?}", case.name));
    match &case.expect {
        Expect::Pods {
            pods,
            masquerade,
            affinity,
            ..
        } => {
            let mut seen = BTreeSet::new();
            for o in &outcomes {
                let Outcome::Answered {
                    backend,
                    client_seen,
                } = o
                else {
                    return fail(format!("expected an answer from {pods:?}"));
                };
                if !pods.contains(&backend.as_str()) {
                    return fail(format!("answered by {backend}, expected one of {pods:?}"));
                }
                if let Err(e) = check_source(lab, case, backend, *client_seen, *masquerade) {
                    return fail(e);
                }
                seen.insert(backend.clone());
            }
            match affinity {
                Some(_) if seen.len() != 1 => {
                    fail(format!("affinity: expected one backend, saw {seen:?}"))
                }
                None if seen.len() != pods.len() => fail(format!(
                    "expected all of {pods:?} over {TRIES} tries, saw {seen:?}"
                )),
                _ => Ok(()),
            }
        }
        Expect::Drop => match outcomes.as_slice() {
            [Outcome::Timeout] => Ok(()),
            _ => fail("expected a silent drop (timeout)".into()),
        },
        Expect::Reject => match outcomes.as_slice() {
            [Outcome::Refused | Outcome::Unreachable] => Ok(()),
            _ => fail("expected a reject (refused or unreachable)".into()),
        },
        Expect::Untouched => match outcomes.as_slice() {
            [Outcome::Answered { .. }] => fail("expected nothing to answer".into()),
            _ => Ok(()),
        },
    }
}

/// Whether `seen`, the source `backend` saw, is what the row expects.
fn check_source(
    lab: &Lab,
    case: &Case,
    backend: &str,
    seen: IpAddr,
    masquerade: bool,
) -> Result<(), String> {
    if !masquerade {
        // The client's own address: the bound one, or the row's (a pod's, the node's).
        return if seen == case.packet.src {
            Ok(())
        } else {
            Err(format!(
                "backend saw source {seen}, expected the client's {}",
                case.packet.src
            ))
        };
    }
    match seen {
        IpAddr::V4(_) => {
            let want = masquerade_source(backend)
                .ok_or_else(|| format!("{backend} is not a lab pod name"))?;
            if seen == want {
                Ok(())
            } else {
                Err(format!(
                    "backend saw source {seen}, expected {want} (masqueraded)"
                ))
            }
        }
        // IPv6 source selection among the node's global addresses depends on the kernel's
        // rules; any of the node's own addresses proves the masquerade.
        IpAddr::V6(_) => {
            if lab.node_ips().contains(&seen) {
                Ok(())
            } else {
                Err(format!(
                    "backend saw source {seen}, expected one of the node's addresses {:?} (masqueraded)",
                    lab.node_ips()
                ))
            }
        }
    }
}

/// Starts the echo servers of every fixture pod the lab holds (on node-b too, in a two-node
/// lab): TCP and UDP, and SCTP where the kernel has it.
pub fn serve_fixture_pods(lab: &Lab) -> crate::Result<Vec<ChildGuard>> {
    let mut ports = vec![
        (Proto::Tcp, kp_flows::TCP_PORT),
        (Proto::Udp, kp_flows::UDP_PORT),
    ];
    if echo::sctp_support().is_ok() {
        ports.push((Proto::Sctp, kp_flows::SCTP_PORT));
    }
    let mut servers = Vec::new();
    for p in kp_flows::pods() {
        match pod_ns(lab, p.name) {
            Some(ns) => servers.push(echo::serve_on(ns, p.name, &ports)?),
            None if matches!(place(p.name), Some(Place::Remote(_)))
                && lab.other_node().is_none() => {}
            None => {
                return Err(Error::InvalidArgument(format!(
                "the lab has no namespace for fixture pod {} (build it with kp_test::flows::lab())",
                p.name
            )))
            }
        }
    }
    Ok(servers)
}

/// Runs every row the lab can run; returns the failures. Rows it cannot run are reported on
/// stderr as skipped: those needing node-b in a one-node lab, and SCTP rows on a kernel without
/// SCTP (with a banner, as that skip hides a whole protocol).
pub fn check_all(lab: &Lab) -> Vec<String> {
    check_all_for(lab, kp_flows::Support::ALL)
}

/// [`check_all`] for a mode with `support`: each row as [`kp_flows::Case::for_mode`] makes it
/// (userspace mode must reject SCTP rows).
pub fn check_all_for(lab: &Lab, support: kp_flows::Support) -> Vec<String> {
    let mut failures = Vec::new();
    let mut sctp_skipped = Vec::new();
    for case in kp_flows::cases().iter().map(|c| c.for_mode(support)) {
        if case.needs_second_node && lab.other_node().is_none() {
            eprintln!(
                "flow row skipped (needs node-b; build the lab with kp_test::flows::lab()): {}",
                case.name
            );
            continue;
        }
        if case.needs_sctp() {
            if let Err(why) = echo::sctp_support() {
                sctp_skipped.push((case.name, why));
                continue;
            }
        }
        if let Err(e) = check(lab, &case) {
            failures.push(e);
        }
    }
    if !sctp_skipped.is_empty() {
        let banner = "!".repeat(72);
        eprintln!("\n{banner}");
        for (name, why) in sctp_skipped {
            eprintln!("!! SKIPPED flow row `{name}`: {why}");
        }
        eprintln!("!! The tracer still checks these rows; real packets need a kernel with SCTP.");
        eprintln!("{banner}\n");
    }
    failures
}

/// Runs every row [`check_all`] can run and panics naming every failing row: the one line a
/// mode's real-packet test needs.
pub fn assert_all(lab: &Lab) {
    assert_all_for(lab, kp_flows::Support::ALL);
}

/// [`assert_all`] for a mode with `support`.
pub fn assert_all_for(lab: &Lab, support: kp_flows::Support) {
    let failures = check_all_for(lab, support);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[cfg(test)]
mod tests {
    use kp_core::flow::{Origin, Packet};

    use super::*;

    #[test]
    fn fixture_pod_names_map_to_lab_pods() {
        assert_eq!(place("pod-4"), Some(Place::Local(4)));
        assert_eq!(place("remote-1"), Some(Place::Remote(1)));
        assert_eq!(place("pod-x"), None);
        assert_eq!(place("client"), None);
        assert_eq!(masquerade_source("pod-1"), Some(POD_GATEWAY.into()));
        assert_eq!(masquerade_source("remote-1"), Some(NODE_LINK_IP.into()));
        for p in kp_flows::pods() {
            assert!(place(p.name).is_some(), "{}", p.name);
        }
    }

    /// A hand-made row straight to a pod address: no proxy is involved, so what the runner
    /// reports is the lab's plain routing.
    fn direct(from: &'static str, src: &str, dst: &str, port: u16, expect: Expect) -> Case {
        Case {
            name: "direct",
            from,
            packet: Packet {
                origin: Origin::Pod,
                src: src.parse().unwrap(),
                protocol: Protocol::Tcp,
                dst: dst.parse().unwrap(),
                dport: port,
            },
            expect,
            needs_second_node: true,
        }
    }

    fn pods(names: &[&'static str], masquerade: bool, affinity: Option<u32>) -> Expect {
        Expect::Pods {
            pods: names.to_vec(),
            port: kp_flows::TCP_PORT,
            masquerade,
            affinity,
        }
    }

    /// The runner tells every kind of outcome apart, in both directions: each check below
    /// passes for the truth and fails for a wrong expectation.
    #[test]
    #[ignore = "needs root"]
    fn the_runner_tells_answers_sources_drops_and_rejects_apart() {
        if !crate::require_root() {
            return;
        }
        let lab = lab().unwrap();
        let _echo = serve_fixture_pods(&lab).unwrap();
        let (pod4, remote) = ("10.244.1.14", "10.244.2.21");
        let port = kp_flows::TCP_PORT;

        let truth = direct(
            "pod-4",
            pod4,
            remote,
            port,
            pods(&["remote-1"], false, None),
        );
        assert_eq!(check(&lab, &truth), Ok(()));
        // A direct connection is not masqueraded, is answered by remote-1 only, and so sticks.
        for wrong in [
            pods(&["remote-1"], true, None),
            pods(&["pod-1"], false, None),
            pods(&["remote-1", "pod-1"], false, None),
            Expect::Drop,
            Expect::Reject,
            Expect::Untouched,
        ] {
            let case = Case {
                expect: wrong.clone(),
                ..truth.clone()
            };
            assert!(check(&lab, &case).is_err(), "{wrong:?} passed");
        }
        let sticky = Case {
            expect: pods(&["remote-1"], false, Some(60)),
            ..truth.clone()
        };
        assert_eq!(check(&lab, &sticky), Ok(()));

        // Nothing listens on port 9: a reset is a reject, not a drop.
        let closed = direct("pod-4", pod4, remote, 9, Expect::Reject);
        assert_eq!(check(&lab, &closed), Ok(()));
        let closed_as_drop = Case {
            expect: Expect::Drop,
            ..closed.clone()
        };
        assert!(check(&lab, &closed_as_drop).is_err());
        // Without a proxy the node routes an unclaimed ClusterIP to the client. A row expecting
        // a drop there has the client answer (the escape sink), so a packet that leaves the
        // node is told apart from one the node dropped.
        let nowhere = direct("pod-4", pod4, "10.96.0.99", 80, Expect::Drop);
        let escaped = check(&lab, &nowhere).expect_err("the escape is answered");
        assert!(escaped.contains(ESCAPE_SINK), "{escaped}");
        let nowhere_as_reject = Case {
            expect: Expect::Reject,
            ..nowhere.clone()
        };
        assert!(check(&lab, &nowhere_as_reject).is_err());
        let nowhere_untouched = Case {
            expect: Expect::Untouched,
            ..nowhere.clone()
        };
        assert_eq!(check(&lab, &nowhere_untouched), Ok(()));

        // From outside, the client's own address reaches node-b's pod, and node-b answers
        // through the node.
        let mut outside = direct(
            "client",
            "192.0.2.3",
            remote,
            port,
            pods(&["remote-1"], false, None),
        );
        outside.packet.origin = Origin::External;
        assert_eq!(check(&lab, &outside), Ok(()));
    }
}
