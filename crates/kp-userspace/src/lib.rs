//! The userspace dataplane (`--proxy-mode userspace`): the kernel redirects every Service
//! frontend to one proxy port, and this crate relays each connection to an endpoint, trying
//! the next one when an endpoint refuses or does not answer.
//!
//! - Four sockets at any scale: one TCP and one UDP listener per IP family on the proxy port
//!   ([`Listeners`]), and with detect-local by interface four more on the pod port, where the
//!   table sends what arrives on the pods' interface(s) (what is accepted there is a pod's). TCP recovers the frontend with `SO_ORIGINAL_DST` /
//!   `IP6T_SO_ORIGINAL_DST` ([`sys`]); UDP with one ctnetlink GET per new session ([`udp`]).
//! - [`tcp`]: connects to the balancer's attempts in order with upstream's timeouts (250 ms,
//!   500 ms, 1 s, 2 s), resets the client only when every endpoint failed, and relays with
//!   half-close preserved ([`relay`], `splice(2)` by default).
//! - The endpoint sees the node's address (a plain socket) or the client's (a transparent
//!   socket bound to it); [`routing`] installs the policy routing that brings the replies of
//!   the latter back to the proxy.
//! - The redirect table comes from `kp-userspace-plan` and goes to the kernel with
//!   `kp-nftables`'s [`NftCommand`](kp_nftables::NftCommand).
//!
//! Everything here runs on a runtime of its own, whose threads enter the configured network
//! namespace first (tests and benchmarks program namespaces they created), so every socket the
//! proxy opens, listener or outgoing, lives in the node's namespace.
//!
//! Mirrors upstream's removed userspace proxier (`pkg/proxy/userspace/proxier.go`,
//! `proxysocket.go`), with one listener per protocol and family instead of one per Service
//! port, and the retry schedule of its `tryConnect`.

mod dataplane;
pub mod leftovers;
pub mod relay;
pub mod routing;
mod shared;
pub mod sys;
mod table;
pub mod tcp;
pub mod udp;

pub use dataplane::{
    Listeners, UserspaceConfig, UserspaceDataplane, SERVING_ON, STOPPED_ACCEPTING,
};
pub use relay::Copying;

use kp_core::dataplane::{DataplaneError, Retry};

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listeners could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No port of the configured range was free for all four listeners.
    #[error("no port in {range} is free for TCP and UDP, IPv4 and IPv6")]
    NoPort {
        /// The range, as configured.
        range: String,
    },
    /// The runtime or the namespace could not be set up.
    #[error("cannot start the proxy's runtime: {0}")]
    Runtime(String),
    /// The redirect table could not be applied or read.
    #[error(transparent)]
    Nft(#[from] kp_nftables::Error),
    /// The policy routing could not be installed or removed.
    #[error("{op} failed: {detail}")]
    Routing {
        /// What was asked.
        op: String,
        /// Why it failed.
        detail: String,
        /// The kernel's errno, when it refused.
        errno: Option<kp_netlink::KernelError>,
    },
    /// A sync before [`kp_core::dataplane::Dataplane::start`].
    #[error("the userspace proxy was not started")]
    NotStarted,
}

impl Error {
    /// Whether retrying can help.
    pub fn retry(&self) -> Retry {
        match self {
            Error::Nft(e) => e.retry(),
            Error::Routing { errno: Some(k), .. } => Retry::of_errno(k.errno),
            Error::Listen { source, .. } => source
                .raw_os_error()
                .map_or(Retry::WithBackoff, Retry::of_errno),
            Error::NoPort { .. } | Error::NotStarted => Retry::Never,
            _ => Retry::WithBackoff,
        }
    }

    /// The error as the sync loop handles it.
    pub fn into_dataplane(self) -> DataplaneError {
        DataplaneError::new(self.retry(), self)
    }
}
