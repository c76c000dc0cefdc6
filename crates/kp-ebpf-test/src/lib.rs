//! Test support for the ebpf mode: [`EbpfTracer`] answers, for a connection's first packet,
//! what the socket load balancer's programs (`crates/kp-ebpf/bpf/sock.c`) decide over given
//! map contents — the [`kp_ebpf_plan::Contents`] the planner says the maps hold, or what was
//! read back from the kernel. It answers in `kp_core::flow` terms, so the packet-flow table
//! (`kp-flows`) runs over it, with the mode's declaration ([`case_for_ebpf`]): rows from the
//! node and its pods as `Support::SOCKET_LB`, rows from outside through the tc path.
//!
//! Used only by tests: nothing in the proxy links it. What it leaves to others: planning
//! (`kp-ebpf-plan`), the programs and the kernel (`kp-ebpf`), the rows (`kp-flows`).

pub mod tracer;

pub use tracer::EbpfTracer;

use kp_core::flow::{Origin, Tracer};
use kp_core::model::Protocol;
use kp_flows::{Case, Expect, Support};

/// Why a row from outside the node is held to something else than upstream's expectation.
pub const OUTSIDE_REASON: &str = "from outside the node, the tc path drops what upstream \
    rejects (no TCP reset or ICMP error is built in tc) and leaves SCTP alone (TCP and UDP only)";

/// A row as the ebpf mode must pass it. From the node and its pods: the socket load balancer,
/// as `Support::SOCKET_LB` declares (no source NAT). From outside the node: the tc path, as
/// upstream, except that a reject is a drop and SCTP is left alone ([`OUTSIDE_REASON`]).
pub fn case_for_ebpf(row: &Case) -> Case {
    if row.packet.origin != Origin::External {
        return row.for_mode(Support::SOCKET_LB);
    }
    let mut case = row.clone();
    if row.packet.protocol == Protocol::Sctp {
        case.expect = Expect::Untouched;
    } else if row.expect == Expect::Reject {
        case.expect = Expect::Drop;
    }
    case
}

/// Whether [`case_for_ebpf`] changes the row, and why.
pub fn declared(row: &Case) -> Option<&'static str> {
    (case_for_ebpf(row).expect != row.expect).then_some(if row.packet.origin == Origin::External {
        OUTSIDE_REASON
    } else {
        Support::SOCKET_LB.reason
    })
}

/// Runs every row of the flow table, as [`case_for_ebpf`] makes it, through `tracer`; one
/// message per failing row.
pub fn check_table(tracer: &impl Tracer) -> Vec<String> {
    kp_flows::cases()
        .iter()
        .filter_map(|row| {
            let case = case_for_ebpf(row);
            let want = kp_flows::expected_verdict(&case);
            let got = tracer.trace(&case.packet);
            let why = declared(row)
                .map(|r| format!(" (row as declared for this mode: {r})"))
                .unwrap_or_default();
            (got != want).then(|| {
                format!(
                    "{}{why}: {}\n    want {want:?}\n    got  {got:?}",
                    case.name, case.packet
                )
            })
        })
        .collect()
}
