//! The pure half of kube-proxy-rs's userspace mode: the kernel redirects every Service
//! frontend to one proxy port (with detect-local by interface, what arrives on the pods'
//! interface(s) to the pod port, its sibling), and the proxy (`kp-userspace`) relays each
//! connection to an endpoint, trying another when one refuses.
//!
//! - [`balancer`]: every frontend's route ([`kp_core::frontend::Frontends`]), IPVS's
//!   schedulers ([`schedule`]), ClientIP affinity and passive health: what the proxy asks for
//!   each new connection or UDP session.
//! - [`redirect`]: the nft table that sends every frontend to the proxy port and rejects or
//!   drops what the kernel decides, planned whole or as element changes; its [`layout`] and
//!   [`names`].
//!
//! What it leaves to others: sockets, relays, the nft process and metrics (`kp-userspace`).
//! Mirrors upstream's userspace proxier (`pkg/proxy/userspace`, removed in 1.26) for retries
//! and affinity, and its nftables proxier (`pkg/proxy/nftables/proxier.go`) for what the
//! kernel rejects or drops before a connection reaches the proxy.

pub mod balancer;
pub mod layout;
pub mod names;
pub mod redirect;
pub mod schedule;

pub use balancer::{
    Arrival, Attempt, Balancer, BalancerConfig, BalancerStats, Outcome, Pick, RouteId, Source,
    SyncStats,
};
pub use layout::{RedirectConfig, SetId, SetKind};
pub use redirect::{RedirectPlanner, Transaction};
pub use schedule::Scheduler;
