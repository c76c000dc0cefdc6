//! Deletes stale UDP and SCTP conntrack entries of Services over ctnetlink: the kernel half of
//! upstream's conntrack reconciler (`pkg/proxy/conntrack/cleanup.go` and the ctnetlink calls of
//! `conntrack.go`).
//!
//! [`Conntrack::reconcile`] dumps the entries the planner may care about (per IP family and
//! protocol), asks [`ConntrackPlanner::check`] about each, and deletes the stale ones. Which
//! entries are stale is decided in `kp_core::conntrack`, without I/O; this crate only talks to
//! the kernel. Everything goes over a `NETLINK_NETFILTER` socket of `kp-netlink`, with the
//! ctnetlink messages of [`wire`]; the `conntrack` binary is never run.
//!
//! What it leaves to others: when to reconcile (the sync loop, after each successful sync),
//! which addresses NodePorts answer on (the caller), and metrics (the caller counts
//! [`Conntrack::reconcile`]'s result and errors into `kp-metrics`).

use std::collections::HashSet;
use std::net::IpAddr;

use kp_core::conntrack::{Check, ConntrackPlanner, FlowEntry};
use kp_core::model::{IpFamily, Protocol};
use kp_netlink::KernelError;

mod socket;
mod wire;

use socket::Conn;

/// The protocols whose entries can be stale (TCP never is).
const PROTOCOLS: [Protocol; 2] = [Protocol::Udp, Protocol::Sctp];

/// What can go wrong talking to ctnetlink.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be opened (or the namespace entered). Retryable only if the cause
    /// is transient (a namespace that appears later, a lack of memory); a missing capability
    /// (`CAP_NET_ADMIN`) is not.
    #[error("conntrack socket in {location}: {detail}")]
    Socket {
        /// `host` or `netns NAME`.
        location: String,
        /// What failed.
        detail: String,
    },
    /// Sending or receiving failed (including the receive timeout). Retryable.
    #[error("{op}: {source}")]
    Io {
        /// The operation.
        op: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused a request. Retryable for transient errnos
    /// ([`KernelError::is_transient`]); EPERM ([`KernelError::is_permission_denied`]) means the
    /// process lacks `CAP_NET_ADMIN`.
    #[error("{op}: the kernel answered {errno}")]
    Kernel {
        /// The operation.
        op: String,
        /// The kernel's errno.
        errno: KernelError,
    },
    /// A reply could not be framed, or a dump was interrupted by changes each time it ran. Not
    /// retryable when framing failed (a bug here or an unexpected kernel).
    #[error("{op}: malformed reply: {detail}")]
    Malformed {
        /// The operation.
        op: String,
        /// What was wrong.
        detail: String,
    },
    /// Some deletes were refused (ENOENT, an entry already gone, does not count). Retryable:
    /// the next reconcile tries them again.
    #[error("deleted {deleted} conntrack entries, the kernel refused {failed} (first: {errno})")]
    Delete {
        /// Entries deleted.
        deleted: usize,
        /// Entries refused.
        failed: usize,
        /// The first refusal's errno.
        errno: KernelError,
    },
    /// A reconcile did part of its work and then failed; `deleted` entries were removed.
    #[error("conntrack reconcile deleted {deleted} entries, then failed: {source}")]
    Reconcile {
        /// Entries deleted before or despite the failure.
        deleted: usize,
        /// The first failure.
        #[source]
        source: Box<Error>,
    },
}

impl Error {
    /// Entries deleted despite the error, for the `conntrack_deleted_entries` metric.
    pub fn deleted(&self) -> usize {
        match self {
            Error::Delete { deleted, .. } | Error::Reconcile { deleted, .. } => *deleted,
            _ => 0,
        }
    }
}

/// The conntrack table of one network namespace, over ctnetlink. Every call opens its own
/// socket, so a value can be shared between threads and calls never interfere.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conntrack {
    /// The `ip netns` name to work in; `None` for the namespace the process runs in.
    netns: Option<String>,
}

impl Conntrack {
    /// The conntrack table of the namespace the process runs in (the node's).
    pub fn new() -> Self {
        Conntrack { netns: None }
    }

    /// The conntrack table of the namespace `/var/run/netns/NAME` (for tests).
    pub fn in_netns(name: impl Into<String>) -> Self {
        Conntrack {
            netns: Some(name.into()),
        }
    }

    fn connect(&self) -> Result<Conn, Error> {
        Conn::open(self.netns.as_deref())
    }

    /// `conntrack -L -f FAMILY -p PROTOCOL`: the entries of one family and protocol. Entries
    /// that cannot be read are logged and left out.
    pub fn list(&self, family: IpFamily, protocol: Protocol) -> Result<Vec<FlowEntry>, Error> {
        Ok(self.connect()?.list(family, protocol)?.0)
    }

    /// `conntrack -L -p tcp --state TIME_WAIT,CLOSE -f FAMILY`: the TCP entries of connections
    /// that have ended (the kernel keeps them two minutes in `TIME_WAIT`).
    pub fn list_closed_tcp(&self, family: IpFamily) -> Result<Vec<FlowEntry>, Error> {
        Ok(self.connect()?.list_closed_tcp(family)?.0)
    }

    /// `conntrack -D` of each entry, by original tuple (and zone, and the kernel's id when the
    /// entry came from [`list`](Self::list), so a different entry that took the tuple meanwhile
    /// is usually spared; see [`FlowEntry::id`]). Returns how many the kernel deleted; entries
    /// already gone are not an error.
    pub fn delete(&self, entries: &[FlowEntry]) -> Result<usize, Error> {
        if entries.is_empty() {
            return Ok(0);
        }
        let done = self.connect()?.delete(entries)?;
        match done.first_errno {
            Some(errno) => Err(Error::Delete {
                deleted: done.deleted,
                failed: done.failed,
                errno,
            }),
            None => Ok(done.deleted),
        }
    }

    /// `conntrack -G` by reply tuple: the entry whose replies leave `reply_src` for
    /// `reply_dst`, or `None`. A proxy that received a redirected UDP datagram at `reply_src`
    /// (its own address and port) from the client `reply_dst` finds the frontend the client
    /// addressed as the entry's original destination.
    pub fn get_by_reply(
        &self,
        protocol: Protocol,
        reply_src: std::net::SocketAddr,
        reply_dst: std::net::SocketAddr,
    ) -> Result<Option<FlowEntry>, Error> {
        self.connect()?.get_by_reply(protocol, reply_src, reply_dst)
    }

    /// Deletes the entries `planner` finds stale; returns how many were deleted.
    /// `node_port_addrs` are the addresses NodePorts answer on (passing all of the node's
    /// local addresses is safe).
    ///
    /// Lists only the families and protocols the planner has frontends of, so a node with TCP
    /// Services only never dumps its table. After a fully successful run the planner forgets
    /// the frontends of deleted Services ([`ConntrackPlanner::reconciled`]); after a failure
    /// it keeps them for the next run. A failing family does not stop the others: the error
    /// is returned at the end, with the number deleted anyway.
    pub fn reconcile(
        &self,
        planner: &mut ConntrackPlanner,
        node_port_addrs: &[IpAddr],
    ) -> Result<usize, Error> {
        let wanted: Vec<(IpFamily, Protocol)> = IpFamily::ALL
            .into_iter()
            .flat_map(|f| PROTOCOLS.map(|p| (f, p)))
            .filter(|&(f, p)| planner.wants(f, p))
            .collect();
        if wanted.is_empty() {
            planner.reconciled();
            return Ok(0);
        }
        let addrs: HashSet<IpAddr> = node_port_addrs.iter().copied().collect();
        let mut conn = self.connect()?;
        let mut first_error = None;
        let mut stale = Vec::new();
        let mut listed = 0;
        for (family, protocol) in wanted {
            let entries = match conn.list(family, protocol) {
                Ok((entries, _skipped)) => entries,
                Err(e) => {
                    tracing::warn!(error = %e, "conntrack reconcile: listing failed");
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            listed += entries.len();
            for entry in entries {
                if let Check::Stale(frontend, why) = planner.check(&entry, &addrs) {
                    tracing::debug!(%entry, %frontend, ?why, "stale conntrack entry");
                    stale.push(entry);
                }
            }
        }
        let mut deleted = 0;
        if !stale.is_empty() {
            match conn.delete(&stale) {
                Ok(done) => {
                    deleted = done.deleted;
                    if let Some(errno) = done.first_errno {
                        first_error.get_or_insert(Error::Delete {
                            deleted: done.deleted,
                            failed: done.failed,
                            errno,
                        });
                    }
                    tracing::debug!(
                        listed,
                        stale = stale.len(),
                        deleted = done.deleted,
                        already_gone = done.gone,
                        "conntrack reconcile"
                    );
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            None => {
                planner.reconciled();
                Ok(deleted)
            }
            Some(source) => Err(Error::Reconcile {
                deleted,
                source: Box::new(source),
            }),
        }
    }
}
