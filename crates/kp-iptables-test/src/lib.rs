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
//! - [`save`] reads `iptables-save` output (the live kernel's tables) down to kube-proxy's
//!   chains, restore input the tracer replays: `kube-proxy explain` and `status` trace and
//!   compare the live rules with it ([`IptablesTracer::differences`]).
//!
//! Used by tests, the fuzzer, and the binary's `explain`/`status`. What it leaves to others:
//! rendering (`kp-iptables-plan`), running the real tools (`kp-iptables`), and the rows
//! (`kp-flows`).

pub mod fake;
pub mod save;
pub mod tracer;

pub use fake::FakeIptables;
pub use tracer::{IptablesTracer, TraceError};
