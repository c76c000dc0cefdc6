//! Pure core of kube-proxy-rs: the Service/Endpoint model, endpoint selection, change tracking
//! and sync scheduling.
//!
//! Nothing here does I/O or reads the clock: sources feed [`track::SourceEvent`]s in, dataplanes
//! read [`track::ProxyState`] out, and the binary drives [`sync::SyncSchedule`] with real time.
//! Mirrors upstream `pkg/proxy` (`serviceport.go`, `endpoint.go`, `topology.go`, the change
//! trackers) and `pkg/util/async`.

pub mod conntrack;
pub mod convert;
pub mod dataplane;
pub mod flow;
pub mod frontend;
pub mod logsafe;
pub mod mirror;
pub mod model;
pub mod node;
pub mod select;
pub mod sync;
pub mod track;
