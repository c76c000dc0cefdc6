//! Test support for the userspace mode: [`UserspaceTracer`] replays the nft text the redirect
//! planner (`kp-userspace-plan`) renders into its own model of the `inet kube-proxy-userspace`
//! table, follows a connection's first packet through it, and for a packet the table
//! redirects to the proxy asks the balancer which endpoints the proxy may connect to and with
//! which source (a connection redirected to the pod port that the table's comment names, with
//! detect-local by interface, as a pod's, as the proxy takes what it accepts there). It answers in `kp_core::flow` terms, so the packet-flow table (`kp-flows`)
//! runs over it.
//!
//! Used by tests, and by `kube-proxy status` and `explain`, which replay the live table's
//! listing into it ([`UserspaceTracer::walk`] says where the table alone sends a packet). What
//! it leaves to others: rendering and
//! balancing (`kp-userspace-plan`), the kernel and the relays (`kp-userspace`), the rows
//! (`kp-flows`). The same idea as `kp-nftables-test`'s tracer, for a table of another shape
//! (`inet`, redirects, transparent sockets).

pub mod tracer;

pub use tracer::{TraceError, UserspaceTracer, Walked};
