//! A deterministic, seedable fuzzer for kube-proxy-rs, on stable Rust: hostile Kubernetes
//! objects through object decoding, the manifest parser, validation and the object → model
//! conversion, and every renderer (nftables text and netlink element batches, iptables-restore
//! input), checking after each stage that nothing panicked and that no rendered rule, set
//! element or log line carries text an object field smuggled in.
//!
//! - [`generate`]: the objects (Services, EndpointSlices, v1 Endpoints, Nodes, ServiceCIDRs as
//!   JSON), built from pools of valid values with fields swapped for odd and hostile ones, the
//!   flow fixture's objects mutated, random trees, and garbled manifest text.
//! - [`hostile`]: the hostile values, and the [marker](hostile::MARKER) whose appearance in
//!   rendered text proves smuggling (why it cannot appear legitimately is explained there).
//! - [`harness`]: the pipeline and its checks ([`Check`] lists them).
//! - [`modes`]: the userspace, ipvs and ebpf planners, and their checks (keys only from
//!   validated addresses and ports).
//! - [`precedence`]: the model of which endpoints a Service gets (its own EndpointSlices, else
//!   those mirrored from its Endpoints) that `ProxyState` is held to.
//! - [`report`]: the counts and violations of a run.
//!
//! [`run`] is the whole thing: `run(seed, objects)` is reproducible from its arguments alone
//! (no clock, no thread, no environment decides anything but the elapsed time). The
//! `kp-fuzz` binary runs it long, with progress; `tests/short_run.rs` runs it short in CI.
//!
//! What it leaves to others: it fixes nothing. Validation (kp-core `convert`), parsing
//! (kp-source), rendering (kp-nftables-plan, kp-iptables-plan) and log escaping (the binary's
//! formatter) stay where they are; a defect found here is recorded as an ignored test with its
//! reproducer in `tests/known_defects.rs`. Nothing here talks to a kernel: the tracers stand
//! in for `nft` and `iptables-restore`, and the crates' own kernel tests cover the rest.

pub mod generate;
pub mod harness;
pub mod hostile;
pub mod modes;
pub mod precedence;
pub mod report;
pub mod rng;

use std::time::Duration;

pub use harness::{run_with, Options};
pub use report::{Check, KnownDefect, Report, Violation, KNOWN_DEFECTS};

/// Runs `objects` generated objects from `seed` through the pipeline and returns what it did
/// and found.
pub fn run(seed: u64, objects: u64) -> Report {
    run_with(&Options::new(seed, objects), Duration::MAX, |_| {})
}
