//! Test support for the ebpf mode: [`EbpfTracer`] answers, for a connection's first packet,
//! what the socket load balancer's programs (`crates/kp-ebpf/bpf/sock.c`) decide over given
//! map contents — the [`kp_ebpf_plan::Contents`] the planner says the maps hold, or what was
//! read back from the kernel. It answers in `kp_core::flow` terms, so the packet-flow table
//! (`kp-flows`) runs over it, with the mode's declaration ([`SUPPORT`],
//! `Support::SOCKET_LB_TC`): rows from the node and its pods through the socket hooks, rows
//! from outside through the tc path.
//!
//! Used by tests, and by `kube-proxy status` and `explain`, which read the live maps into it
//! (`kp_ebpf::read_pinned`) and check drift with [`EbpfTracer::differences`]. What it leaves
//! to others: planning (`kp-ebpf-plan`), the programs and the kernel (`kp-ebpf`), the rows
//! (`kp-flows`).

pub mod tracer;

pub use tracer::EbpfTracer;

use kp_core::flow::Tracer;
use kp_flows::{Case, Support};

/// What the ebpf mode declares: socket load balancing for the node and its pods, the tc path
/// for traffic from outside the node ([`Support::SOCKET_LB_TC`]). The real-packet test
/// (`crates/kp-ebpf/tests/flows.rs`) holds the kernel to the same.
pub const SUPPORT: Support = Support::SOCKET_LB_TC;

/// A row as the ebpf mode must pass it ([`SUPPORT`]). From the node and its pods: no source
/// NAT. From outside the node: the tc path, as upstream, except that a reject is a drop and
/// SCTP is left alone.
pub fn case_for_ebpf(row: &Case) -> Case {
    row.for_mode(SUPPORT)
}

/// Whether [`case_for_ebpf`] changes the row, and why.
pub fn declared(row: &Case) -> Option<&'static str> {
    row.changed_for(SUPPORT).then_some(SUPPORT.reason)
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
