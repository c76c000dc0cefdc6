//! Test support for the nftables mode:
//!
//! - [`NftTracer`] replays the nft text the planner renders (a full transaction, then partial
//!   ones) into its own model of the `kube-proxy` tables, and follows a connection's first
//!   packet through it, answering in `kp_core::flow` terms so the packet-flow table
//!   (`kp-flows`) runs over it.
//! - [`FakeNftables`] is the kernel's nf_tables in memory behind `kp_nftables`'s
//!   `NftablesBackend`, its tables the tracer's: scripts are applied by the tracer, element
//!   batches decoded from their bytes and applied, the read-back answered from the tables, so
//!   the dataplane runs without root (upstream's `knftables.Fake`).
//!
//! - [`listing`] reads what the kernel prints for a table (`nft list table`) back into the
//!   transaction text the tracers replay ([`NftTracer::apply_listing`]): `kube-proxy explain`
//!   and `status` trace and compare the live rules with it ([`NftTracer::differences`]).
//!
//! Used by tests, the fuzzer, and the binary's `explain`/`status`. What it leaves to others:
//! rendering (`kp-nftables-plan`), talking to the kernel (`kp-nftables`), and the rows
//! (`kp-flows`). Mirrors the idea of upstream's `pkg/proxy/nftables/helpers_test.go` tracer.

pub mod elements;
pub mod fake;
pub mod listing;
pub mod tracer;
pub mod transaction;

pub use fake::FakeNftables;
pub use tracer::{ElementError, NftTracer, TraceError};
