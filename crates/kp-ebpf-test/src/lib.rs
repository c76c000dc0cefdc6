//! Test support for the ebpf mode: [`EbpfTracer`] answers, for a connection's first packet,
//! what the socket load balancer's programs (`crates/kp-ebpf/bpf/sock.c`) decide over given
//! map contents — the [`kp_ebpf_plan::Contents`] the planner says the maps hold, or what was
//! read back from the kernel. It answers in `kp_core::flow` terms, so the packet-flow table
//! (`kp-flows`) runs over it, with the mode's declared [`kp_flows`]-`Support::SOCKET_LB`.
//!
//! Used only by tests: nothing in the proxy links it. What it leaves to others: planning
//! (`kp-ebpf-plan`), the programs and the kernel (`kp-ebpf`), the rows (`kp-flows`).

pub mod tracer;

pub use tracer::EbpfTracer;
