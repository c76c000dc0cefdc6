//! Sources of Kubernetes objects for kube-proxy-rs.
//!
//! Two sources turn the outside world into [`kp_core::track::SourceEvent`]s pushed into a
//! `tokio::sync::mpsc` channel:
//!
//! - [`run_kubernetes`] watches Services, EndpointSlices, this node's Node and the
//!   ServiceCIDRs (where the API server serves them) on the API server (one list-then-watch
//!   loop each, as client-go's reflector runs it, with the label and field selectors upstream
//!   uses, reading lists item by item and decoding only what the proxy reads, all on a thread of
//!   their own);
//! - [`run_manifests`] reads Service, EndpointSlice, Endpoints, Node and ServiceCIDR manifests
//!   from a directory and follows changes to it with inotify (standalone mode, no API server).
//!   v1 Endpoints are passed on as they are, for kp-core to mirror into EndpointSlices as a
//!   cluster's EndpointSliceMirroring controller would (`kp_core::mirror`); the API source
//!   never watches them, since in a cluster that controller writes the slices itself.
//!
//! Both keep the contract documented on `SourceEvent`: `Upsert` for an added or changed object,
//! `Delete` for a removed one, `Synced(kind)` once the initial list of a kind is complete. A
//! source that re-lists reports what vanished meanwhile as `Delete` itself, so the consumer never
//! needs to understand re-lists; an API outage or a broken manifest never produces a `Delete`.
//!
//! What it leaves to others: validating objects and deciding what is proxied (kp-core's
//! `ProxyState`), scheduling syncs (kp-core `sync`), and parsing command-line flags (the binary).
//! Every error is logged with `tracing` and counted in `kubeproxy_rs_source_errors_total`
//! (kp-metrics).
//!
//! Mirrors upstream `pkg/proxy/config` (`config.go`: the Service, EndpointSlice, Node and
//! ServiceCIDR informers and their handlers) and the informer set-up in `cmd/kube-proxy/app/server.go`.

mod error;
pub mod kubernetes;
pub mod manifests;

pub use error::SourceError;
pub use kubernetes::{client_from, run_kubernetes, run_kubernetes_with, RetryPolicy};
pub use manifests::run_manifests;
