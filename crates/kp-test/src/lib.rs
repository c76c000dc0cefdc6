//! Test support for kube-proxy-rs: real packets through real kernels, inside network
//! namespaces the tests create and always delete.
//!
//! - [`netns`]: a uniquely named [`Netns`] deleted on drop (with whatever still runs in it),
//!   veth pairs between namespaces, [`ChildGuard`] for background processes, and
//!   [`require_root`].
//! - [`lab`]: a [`Lab`] with one node, K pods and outside clients, optionally a second node with
//!   remote pods ([`Lab::two_nodes`]), and the one addressing plan all netns tests use.
//! - [`echo`]: drives the `kp-echo` binary (this crate's `src/bin/kp-echo.rs`), the backend and
//!   client whose answers say which backend answered and which source address it saw.
//! - [`flows`]: runs the `kp-flows` packet-flow table with real packets through a lab.
//! - [`write_executable`]: a stand-in program (a failing or wrapping kernel tool) as a script.
//! - [`apiserver`]: a scripted fake Kubernetes API server (list, watch, bookmarks, outages,
//!   410 Gone) that can listen inside a lab namespace, for driving the real binary.
//! - [`kube_apiserver`]: a real etcd + kube-apiserver v1.28.7 on loopback (`../shared/k8s`), its
//!   bulk loader and a bridge into a namespace.
//! - [`cluster`]: the benchmark's cluster of N Services × E endpoints, the one object generator
//!   (kp-bench measures with it, [`kube_apiserver`] loads it).
//!
//! What it leaves to others: starting kube-proxy and writing its manifests (each test does, in
//! [`Lab::node`]), and the flow table that says what each request should do (`kp-flows`). It mirrors the
//! idea, not the code, of upstream's `pkg/proxy/nftables/proxy_userns_test.go`: program the
//! real kernel in a private namespace.
//!
//! Root is needed. Tests that use this crate are marked `#[ignore = "needs root"]`, call
//! [`require_root`] first, and run with `cargo test -- --include-ignored`.

mod error;

pub mod apiserver;
pub mod cluster;
pub mod echo;
pub mod flows;
pub mod kube_apiserver;
pub mod lab;
pub mod netns;

pub use echo::{echo_binary, Outcome, Proto, Request};
pub use error::{Error, Result};
pub use lab::Lab;
pub use netns::{require_root, ChildGuard, Netns};

/// Writes `text` (a script starting with `#!`) to `path` and makes it executable: a stand-in
/// for a kernel tool that fails, wraps the real one, or swallows its input.
pub fn write_executable(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}
