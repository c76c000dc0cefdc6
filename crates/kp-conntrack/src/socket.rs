//! The `NETLINK_NETFILTER` socket (a `kp_netlink::Socket`, in a named network namespace if
//! asked): dumping entries and deleting them in batches.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use kp_core::conntrack::FlowEntry;
use kp_core::model::{IpFamily, Protocol};
use kp_netlink::socket::Error as SocketError;
use kp_netlink::{KernelError, Message, Protocol as NetlinkProtocol, Socket};

use crate::wire;
use crate::Error;

/// Deletes sent in one datagram. Each is acknowledged by a message of its own, queued on our
/// socket until read; 64 acknowledgements stay far below the default receive buffer, which a
/// few hundred would overflow (ENOBUFS).
const DELETE_BATCH: usize = 64;

/// Whether the kernel refused a filtered dump once: then every later dump goes unfiltered.
static FILTER_REFUSED: AtomicBool = AtomicBool::new(false);

/// What a delete pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Deleted {
    /// Entries the kernel deleted.
    pub deleted: usize,
    /// Entries already gone (ENOENT): expired, deleted by someone else, or replaced by a newer
    /// entry with the same tuple (when the id is given).
    pub gone: usize,
    /// Entries the kernel refused to delete, with the first errno.
    pub failed: usize,
    /// The first errno of a failed delete.
    pub first_errno: Option<KernelError>,
}

/// A ctnetlink socket.
pub(crate) struct Conn {
    socket: Socket,
    /// Where it lives, for errors: `host` or `netns NAME`.
    location: String,
}

/// The entries of a dump, and how many could not be read.
#[derive(Default)]
struct Dumped {
    entries: Vec<FlowEntry>,
    skipped: usize,
}

impl Conn {
    /// Opens a socket in the namespace the process runs in, or in `/var/run/netns/NAME`.
    pub fn open(netns: Option<&str>) -> Result<Conn, Error> {
        let location = match netns {
            None => "host".to_string(),
            Some(name) => format!("netns {name}"),
        };
        let socket = Socket::open(NetlinkProtocol::Netfilter, netns).map_err(|e| match e {
            SocketError::Open { detail, .. } => Error::Socket {
                location: location.clone(),
                detail,
            },
            e => Error::Socket {
                location: location.clone(),
                detail: e.to_string(),
            },
        })?;
        Ok(Conn { socket, location })
    }

    /// Dumps the entries of one family and protocol. Entries the kernel reports in a shape
    /// that cannot be read are logged and counted in the second value, not returned.
    pub fn list(
        &mut self,
        family: IpFamily,
        protocol: Protocol,
    ) -> Result<(Vec<FlowEntry>, usize), Error> {
        self.list_where(family, protocol, |_| Ok(true))
    }

    /// The TCP entries of one family whose connection has ended (`TIME_WAIT`, `CLOSE`).
    pub fn list_closed_tcp(&mut self, family: IpFamily) -> Result<(Vec<FlowEntry>, usize), Error> {
        self.list_where(family, Protocol::Tcp, |m| {
            Ok(matches!(
                wire::tcp_state(m)?,
                Some(wire::TCP_TIME_WAIT | wire::TCP_CLOSE)
            ))
        })
    }

    /// [`Conn::list`] of the entries whose message `keep` accepts.
    fn list_where(
        &mut self,
        family: IpFamily,
        protocol: Protocol,
        keep: impl Fn(&Message<'_>) -> Result<bool, wire::Malformed> + Copy,
    ) -> Result<(Vec<FlowEntry>, usize), Error> {
        let filtered = !FILTER_REFUSED.load(Ordering::Relaxed);
        match self.dump(family, protocol, filtered, keep) {
            Err(Error::Kernel { errno, .. }) if filtered && errno.is_not_supported() => {
                tracing::info!(
                    %errno,
                    "the kernel refuses filtered conntrack dumps; dumping whole families"
                );
                FILTER_REFUSED.store(true, Ordering::Relaxed);
                self.dump(family, protocol, false, keep)
            }
            other => other,
        }
    }

    fn dump(
        &mut self,
        family: IpFamily,
        protocol: Protocol,
        filtered: bool,
        keep: impl Fn(&Message<'_>) -> Result<bool, wire::Malformed>,
    ) -> Result<(Vec<FlowEntry>, usize), Error> {
        let op = format!(
            "listing {} {} conntrack entries in {}",
            family.as_str(),
            protocol,
            self.location
        );
        let dumped = self
            .socket
            .dump(
                |buf, seq| buf.extend(wire::dump_request(seq, family, protocol, filtered)),
                |d: &mut Dumped, m| {
                    if m.kind() != wire::CT_NEW {
                        return Err(format!("unexpected message type {:#x}", m.kind()).into());
                    }
                    match keep(m).and_then(|kept| match kept {
                        true => wire::decode_entry(m),
                        false => Ok(None),
                    }) {
                        Ok(Some(e)) if e.protocol == protocol => d.entries.push(e),
                        Ok(_) => {}
                        Err(detail) => {
                            d.skipped += 1;
                            tracing::warn!(%op, %detail, "skipping a conntrack entry that cannot be read");
                        }
                    }
                    Ok(())
                },
            )
            .map_err(|e| error(&op, e))?;
        Ok((dumped.entries, dumped.skipped))
    }

    /// The entry whose reply tuple is `reply_src` → `reply_dst`; `None` if there is none.
    pub fn get_by_reply(
        &mut self,
        protocol: Protocol,
        reply_src: std::net::SocketAddr,
        reply_dst: std::net::SocketAddr,
    ) -> Result<Option<FlowEntry>, Error> {
        let op = format!(
            "getting the {protocol} conntrack entry replying {reply_src} -> {reply_dst} in {}",
            self.location
        );
        let mut found = None;
        let r = self.socket.request(
            |buf, seq| {
                buf.extend(wire::get_by_reply_request(
                    seq, protocol, reply_src, reply_dst,
                ))
            },
            |m| {
                found = wire::decode_entry(m).map_err(kp_netlink::Malformed)?;
                Ok(())
            },
        );
        match r {
            Ok(_) => Ok(found),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(error(&op, e)),
        }
    }

    /// Deletes `entries`, [`DELETE_BATCH`] per datagram.
    pub fn delete(&mut self, entries: &[FlowEntry]) -> Result<Deleted, Error> {
        let op = format!("deleting conntrack entries in {}", self.location);
        let mut out = Deleted::default();
        for batch in entries.chunks(DELETE_BATCH) {
            let mut datagram = Vec::new();
            let mut pending: HashMap<u32, &FlowEntry> = HashMap::new();
            for entry in batch {
                let seq = self.socket.next_seq();
                datagram.extend(wire::delete_request(seq, entry));
                pending.insert(seq, entry);
            }
            self.socket
                .acks(&datagram, |ack| {
                    let Some(entry) = pending.remove(&ack.seq) else {
                        return false;
                    };
                    match ack.result {
                        Ok(()) => out.deleted += 1,
                        Err(e) if e.is_not_found() => out.gone += 1,
                        Err(errno) => {
                            tracing::warn!(%entry, %errno, "the kernel refused to delete a conntrack entry");
                            out.failed += 1;
                            out.first_errno.get_or_insert(errno);
                        }
                    }
                    pending.is_empty()
                })
                .map_err(|e| error(&op, e))?;
        }
        Ok(out)
    }
}

/// The socket layer's error as this crate reports it, for operation `op`.
fn error(op: &str, e: SocketError) -> Error {
    let op = op.to_string();
    match e {
        SocketError::Kernel { error, .. } => Error::Kernel { op, errno: error },
        SocketError::Io { source, .. } => Error::Io { op, source },
        SocketError::Open {
            location, detail, ..
        } => Error::Socket { location, detail },
        e => Error::Malformed {
            op,
            detail: e.to_string(),
        },
    }
}
