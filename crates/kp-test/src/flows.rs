//! The packet-flow table with real packets: each row of `kp-flows` is sent from the namespace
//! it names, through the lab node's kernel, and the answers are checked against the row.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use kp_core::model::Protocol;
use kp_flows::{Case, Expect};

use crate::echo::{Outcome, Proto, Request};
use crate::lab::{Lab, POD_GATEWAY};
use crate::netns::Netns;

/// Connections per row that expects endpoints: enough that a balanced Service shows every
/// endpoint (missing one of three has probability 3·(2/3)^40 ≈ 3e-7).
pub const TRIES: usize = 40;

/// The lab pod index of a fixture pod name (`pod-N` is index N).
fn pod_index(name: &str) -> Option<usize> {
    name.strip_prefix("pod-")?.parse().ok()
}

/// The namespace a row's client sits in, and the source address it must use.
fn client<'a>(lab: &'a Lab, case: &Case) -> Option<(&'a Netns, Option<IpAddr>)> {
    match case.from {
        "client" => Some((lab.client(), Some(case.packet.src))),
        "client-outside" => Some((lab.client(), Some(case.packet.src))),
        "node" => Some((lab.node(), None)),
        p => Some((lab.pod(pod_index(p)?), None)),
    }
}

/// Runs one row with real packets. Returns a description of what went wrong, if anything.
pub fn check(lab: &Lab, case: &Case) -> Result<(), String> {
    let (ns, src) = client(lab, case)
        .ok_or_else(|| format!("{}: no lab namespace for {}", case.name, case.from))?;
    let proto = match case.packet.protocol {
        Protocol::Tcp => Proto::Tcp,
        Protocol::Udp => Proto::Udp,
        Protocol::Sctp => {
            return Err(format!(
                "{}: SCTP rows are not run with real packets yet",
                case.name
            ))
        }
    };
    let answering = matches!(case.expect, Expect::Pods { .. });
    let mut req = Request::new(proto, case.packet.dst, case.packet.dport)
        .count(if answering { TRIES } else { 1 })
        .timeout(Duration::from_millis(if answering { 2000 } else { 700 }));
    if let Some(ip) = src {
        req = req.src_ip(ip);
    }
    let outcomes = lab.send(ns, &req);
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
                let want_src: IpAddr = if *masquerade {
                    IpAddr::V4(POD_GATEWAY)
                } else {
                    src.unwrap_or(case.packet.src)
                };
                // IPv6 masquerade sources vary with the egress address; only the "kept" case is
                // exact there.
                let v6_masq = *masquerade && client_seen.is_ipv6();
                if !v6_masq && *client_seen != want_src {
                    return fail(format!(
                        "backend saw source {client_seen}, expected {want_src}"
                    ));
                }
                if v6_masq && Some(*client_seen) == src {
                    return fail("expected a masqueraded source".into());
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

/// Starts the echo servers the fixture's local pods need (TCP and UDP).
pub fn serve_fixture_pods(lab: &Lab) -> crate::Result<Vec<crate::netns::ChildGuard>> {
    kp_flows::pods()
        .iter()
        .filter(|p| p.node == kp_flows::NODE)
        .filter_map(|p| pod_index(p.name))
        .map(|i| lab.serve_echo(i, &[kp_flows::TCP_PORT], &[kp_flows::UDP_PORT]))
        .collect()
}

/// Runs every row that one node can run; returns the failures. Rows that need a second node are
/// reported on stderr as skipped.
pub fn check_all(lab: &Lab) -> Vec<String> {
    let mut failures = Vec::new();
    for case in kp_flows::cases() {
        if case.needs_second_node {
            eprintln!("flow row skipped (needs a second node): {}", case.name);
            continue;
        }
        if let Err(e) = check(lab, &case) {
            failures.push(e);
        }
    }
    failures
}
