//! kp-bench: the scale benchmark harness behind the `bench` binary. It generates clusters of N
//! Services × E endpoints with a realistic mix, feeds them through the real source paths, and
//! measures per dataplane mode: full and incremental sync cost (render and apply separately,
//! against a bare kernel load of the same input), network programming latency and peak memory of
//! the real `kube-proxy` binary, and the data path (new connections and bulk throughput through
//! a ClusterIP against straight to the pod). It writes JSON results, PNG plots and
//! `BENCHMARKS.md`.
//!
//! `bench churn` ([`churn`]) is a churn soak of the binary: endpoint changes at a steady rate
//! through the API source, with memory over time, programming latency, and the kernel compared
//! with the plan at quiescence.
//!
//! With a real API server ([`kp_test::kube_apiserver`]) as a source, upstream's kube-proxy
//! v1.28.7 runs on the same objects as a baseline row ([`upstream`]).
//!
//! It is a measurement harness, not a test: nothing here asserts a timing. It is a binary crate
//! with a library for its own tests, so errors are `anyhow` throughout.
//!
//! What it leaves to others: the modes themselves (`kp-nftables`, ...), which modes exist and
//! how the binary configures each (the mode registry and configuration of `kp-proxy`), the
//! namespaces and the fake API server (`kp-test`). The harness measures every mode of
//! [`kp_proxy::modes::MODES`]: a mode joins by implementing [`mode::ModeUnderTest`] and
//! returning its adapters from [`modes::adapters`]; a registry mode without one fails this
//! crate's tests.
//!
//! Everything runs inside network namespaces it creates and deletes (`kp_test::Netns`); it
//! needs root.

pub mod churn;
pub mod cli;
pub mod cluster;
pub mod datapath;
pub mod ebpf;
pub mod interrupt;
pub mod iptables;
pub mod machine;
pub mod mode;
pub mod modes;
pub mod nftables;
pub mod plot;
pub mod progress;
pub mod proxy;
pub mod report;
pub mod report_vm;
pub mod results;
pub mod run;
pub mod stats;
pub mod upstream;
pub mod userspace;
pub mod vm;
