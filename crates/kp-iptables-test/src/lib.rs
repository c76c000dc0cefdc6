//! Test support for the iptables mode:
//!
//! - [`IptablesTracer`] replays `iptables-restore --noflush` inputs into its own model of the
//!   filter and nat tables of each family, refuses what the tools or the kernel would refuse,
//!   and follows a connection's first packet through them, answering in `kp_core::flow` terms
//!   so the packet-flow table (`kp-flows`) runs over it. Mirrors the idea of upstream's tracer
//!   in `pkg/proxy/iptables/proxier_test.go`.
//! - [`FakeIptables`] is the node's iptables tools in memory behind `kp_iptables`'s
//!   `IptablesRunner`, its tables the tracer's, so the dataplane runs without root (upstream's
//!   `iptablestest` fake).
//!
//! Used only by tests and the fuzzer: nothing in the proxy links it. What it leaves to others:
//! rendering (`kp-iptables-plan`), running the real tools (`kp-iptables`), and the rows
//! (`kp-flows`).

pub mod fake;
pub mod tracer;

pub use fake::FakeIptables;
pub use tracer::{IptablesTracer, TraceError};
