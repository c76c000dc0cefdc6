//! The `NETLINK_NETFILTER` socket: opening it (in a named network namespace if asked), dumping
//! entries and deleting them in batches.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use kp_core::conntrack::FlowEntry;
use kp_core::model::{IpFamily, Protocol};
use netlink_packet_core::{NLMSG_DONE, NLMSG_ERROR, NLMSG_NOOP};
use netlink_sys::protocols::NETLINK_NETFILTER;
use netlink_sys::Socket;
use nix::errno::Errno;
use nix::sys::time::TimeValLike;

use crate::wire::{self, Frame};
use crate::Error;

/// Where `ip netns add` puts its namespaces.
const NETNS_DIR: &str = "/var/run/netns";

/// The receive buffer. The kernel fills a dump datagram up to the reader's buffer size, capped
/// at 32 KiB; twice that leaves room, and a longer datagram is reported, not cut.
const RECV_BUFFER: usize = 64 * 1024;

/// How long to wait for any kernel reply before giving up (it answers in microseconds; this
/// only keeps a sync from hanging on a wedged socket).
const RECV_TIMEOUT_SECS: i64 = 10;

/// Deletes sent in one datagram. Each is acknowledged by a message of its own, queued on our
/// socket until read; 64 acknowledgements stay far below the default receive buffer, which a
/// few hundred would overflow (ENOBUFS).
const DELETE_BATCH: usize = 64;

/// `ctnetlink` message type of a dumped entry: `IPCTNL_MSG_CT_NEW` in subsystem
/// `NFNL_SUBSYS_CTNETLINK`.
const CT_NEW: u16 = 1 << 8;

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
    pub first_errno: Option<Errno>,
}

/// A ctnetlink socket and its request sequence.
pub(crate) struct Conn {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
    /// Where it lives, for errors: `host` or `netns NAME`.
    location: String,
}

impl Conn {
    /// Opens a socket in the namespace the process runs in, or in `/var/run/netns/NAME`.
    pub fn open(netns: Option<&str>) -> Result<Conn, Error> {
        let (socket, location) = match netns {
            None => (new_socket("host")?, "host".to_string()),
            Some(name) => (socket_in_netns(name)?, format!("netns {name}")),
        };
        Ok(Conn {
            socket,
            seq: 0,
            buf: Vec::with_capacity(RECV_BUFFER),
            location,
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Dumps the entries of one family and protocol. Entries the kernel reports in a shape
    /// that cannot be read are logged and counted in the second value, not returned.
    pub fn list(
        &mut self,
        family: IpFamily,
        protocol: Protocol,
    ) -> Result<(Vec<FlowEntry>, usize), Error> {
        let filtered = !FILTER_REFUSED.load(Ordering::Relaxed);
        match self.dump(family, protocol, filtered) {
            Err(Error::Kernel { errno, .. })
                if filtered && matches!(errno, Errno::EINVAL | Errno::EOPNOTSUPP) =>
            {
                tracing::info!(
                    %errno,
                    "the kernel refuses filtered conntrack dumps; dumping whole families"
                );
                FILTER_REFUSED.store(true, Ordering::Relaxed);
                self.dump(family, protocol, false)
            }
            other => other,
        }
    }

    fn dump(
        &mut self,
        family: IpFamily,
        protocol: Protocol,
        filtered: bool,
    ) -> Result<(Vec<FlowEntry>, usize), Error> {
        let op = format!(
            "listing {} {} conntrack entries in {}",
            family.as_str(),
            protocol,
            self.location
        );
        let seq = self.next_seq();
        let request = wire::dump_request(seq, family, protocol, filtered);
        self.send(&request, &op)?;
        let mut entries = Vec::new();
        let mut skipped = 0;
        loop {
            self.recv(&op)?;
            for frame in wire::frames(&self.buf) {
                let frame = frame.map_err(|detail| Error::Malformed {
                    op: op.clone(),
                    detail,
                })?;
                if frame.seq != seq {
                    continue;
                }
                match frame.kind {
                    NLMSG_NOOP => {}
                    NLMSG_DONE | NLMSG_ERROR => {
                        let code = wire::code(&frame).map_err(|detail| Error::Malformed {
                            op: op.clone(),
                            detail,
                        })?;
                        if code != 0 {
                            return Err(Error::Kernel {
                                op,
                                errno: Errno::from_raw(code),
                            });
                        }
                        return Ok((entries, skipped));
                    }
                    CT_NEW => match wire::decode_entry(&frame) {
                        Ok(Some(e)) if e.protocol == protocol => entries.push(e),
                        Ok(_) => {}
                        Err(detail) => {
                            skipped += 1;
                            tracing::warn!(%op, %detail, "skipping a conntrack entry that cannot be read");
                        }
                    },
                    kind => {
                        return Err(Error::Malformed {
                            op,
                            detail: format!("unexpected message type {kind:#x}"),
                        })
                    }
                }
            }
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
                let seq = self.next_seq();
                datagram.extend(wire::delete_request(seq, entry));
                pending.insert(seq, entry);
            }
            self.send(&datagram, &op)?;
            while !pending.is_empty() {
                self.recv(&op)?;
                for frame in wire::frames(&self.buf) {
                    let frame = frame.map_err(|detail| Error::Malformed {
                        op: op.clone(),
                        detail,
                    })?;
                    let Some(entry) = pending.remove(&frame.seq) else {
                        continue;
                    };
                    match ack(&frame) {
                        Ok(0) => out.deleted += 1,
                        Ok(code) if code == Errno::ENOENT as i32 => out.gone += 1,
                        Ok(code) => {
                            let errno = Errno::from_raw(code);
                            tracing::warn!(%entry, %errno, "the kernel refused to delete a conntrack entry");
                            out.failed += 1;
                            out.first_errno.get_or_insert(errno);
                        }
                        Err(detail) => {
                            return Err(Error::Malformed { op, detail });
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    fn send(&mut self, bytes: &[u8], op: &str) -> Result<(), Error> {
        self.socket.send(bytes, 0).map_err(|source| Error::Io {
            op: op.to_string(),
            source,
        })?;
        Ok(())
    }

    /// Receives one datagram into `self.buf`.
    fn recv(&mut self, op: &str) -> Result<(), Error> {
        self.buf.clear();
        let n = self
            .socket
            .recv(&mut self.buf, nix::libc::MSG_TRUNC)
            .map_err(|source| Error::Io {
                op: op.to_string(),
                source,
            })?;
        if n > self.buf.capacity() {
            return Err(Error::Malformed {
                op: op.to_string(),
                detail: format!(
                    "a reply of {n} bytes did not fit the {}-byte buffer",
                    self.buf.capacity()
                ),
            });
        }
        Ok(())
    }
}

/// The errno an acknowledgement carries (0: done).
fn ack(frame: &Frame<'_>) -> Result<i32, String> {
    if frame.kind != NLMSG_ERROR {
        return Err(format!(
            "expected an acknowledgement, got message type {:#x}",
            frame.kind
        ));
    }
    wire::code(frame)
}

fn new_socket(location: &str) -> Result<Socket, Error> {
    let fail = |e: std::io::Error| Error::Socket {
        location: location.to_string(),
        detail: format!("cannot open a NETLINK_NETFILTER socket: {e}"),
    };
    let mut socket = Socket::new(NETLINK_NETFILTER).map_err(fail)?;
    socket.bind_auto().map_err(fail)?;
    let timeout = nix::sys::time::TimeVal::seconds(RECV_TIMEOUT_SECS);
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
        .map_err(|e| fail(e.into()))?;
    Ok(socket)
}

/// Opens the socket inside the named namespace. A socket belongs to the namespace it was
/// created in for good, so a short-lived thread enters the namespace, creates it and ends; the
/// caller's threads never change namespace.
fn socket_in_netns(name: &str) -> Result<Socket, Error> {
    let location = format!("netns {name}");
    let fail = |detail: String| Error::Socket {
        location: location.clone(),
        detail,
    };
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(fail("not a namespace name".into()));
    }
    let path = Path::new(NETNS_DIR).join(name);
    let ns = File::open(&path).map_err(|e| fail(format!("cannot open {}: {e}", path.display())))?;
    let thread_location = location.clone();
    std::thread::Builder::new()
        .name("kp-conntrack-netns".into())
        .spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                Error::Socket {
                    location: thread_location.clone(),
                    detail: format!("cannot enter the namespace: {e}"),
                }
            })?;
            new_socket(&thread_location)
        })
        .map_err(|e| fail(format!("cannot start a thread: {e}")))?
        .join()
        .map_err(|_| fail("the namespace thread panicked".into()))?
}
