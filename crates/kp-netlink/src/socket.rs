//! Netlink sockets and the exchanges kube-proxy-rs runs over them: a request and its answer
//! (replies, then an acknowledgement or `NLMSG_DONE`), a dump repeated while the kernel flags
//! it interrupted, pipelined requests each acknowledged on its own, and an nfnetlink batch.
//!
//! Blocking, one exchange at a time: every caller runs on a thread of its own (the sync loop,
//! a benchmark probe), and a socket is cheap. After an error, drop the socket and open another:
//! replies of the failed exchange may still be queued (later exchanges skip them by sequence
//! number, but a fresh socket is simpler to reason about).

use std::time::Duration;

use nix::sys::socket::{setsockopt, sockopt};

use crate::abi;
use crate::message::{messages, Control, Message};
use crate::{netns, KernelError, Malformed};

/// The receive buffer. The kernel fills a dump datagram up to the reader's buffer size, capped
/// at 32 KiB; twice that leaves room, and a longer datagram is reported, not cut.
pub const RECV_BUFFER: usize = 64 * 1024;

/// How long to wait for any kernel reply before giving up, by default (the kernel answers in
/// microseconds; this only keeps a sync from hanging on a wedged socket).
pub const RECV_TIMEOUT: Duration = Duration::from_secs(10);

/// How many times [`Socket::dump`] runs a dump that the kernel flags interrupted.
pub const DUMP_ATTEMPTS: usize = 3;

/// The netlink protocols kube-proxy-rs speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Protocol {
    /// `NETLINK_ROUTE`: links, addresses, routes.
    Route,
    /// `NETLINK_NETFILTER`: nf_tables, ctnetlink.
    Netfilter,
    /// `NETLINK_GENERIC`: IPVS and other generic netlink families.
    Generic,
}

impl Protocol {
    /// The protocol number for `socket(2)`.
    pub fn number(self) -> isize {
        match self {
            Protocol::Route => abi::NETLINK_ROUTE,
            Protocol::Netfilter => abi::NETLINK_NETFILTER,
            Protocol::Generic => abi::NETLINK_GENERIC,
        }
    }

    /// The kernel's name.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Route => "NETLINK_ROUTE",
            Protocol::Netfilter => "NETLINK_NETFILTER",
            Protocol::Generic => "NETLINK_GENERIC",
        }
    }
}

/// What can go wrong on a socket.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be opened, or the namespace entered. Retryable only if the cause is
    /// transient (a namespace that appears later, a lack of memory); a missing capability
    /// (`CAP_NET_ADMIN`) is not.
    #[error("{protocol} socket in {location}: {detail}")]
    Open {
        /// The protocol's kernel name.
        protocol: &'static str,
        /// `the current network namespace` or `netns NAME`.
        location: String,
        /// What failed.
        detail: String,
    },
    /// Sending, receiving (including the receive timeout) or a socket option failed.
    /// Retryable.
    #[error("netlink {op}: {source}")]
    Io {
        /// `send`, `receive`, or the option.
        op: &'static str,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused the message of sequence `seq` (0: a batch as a whole). Retryable for
    /// transient errnos ([`KernelError::is_transient`]).
    #[error("netlink error -{}", .error.errno_label())]
    Kernel {
        /// The refused message's sequence number.
        seq: u32,
        /// The errno.
        error: KernelError,
    },
    /// A reply could not be framed or read. Not retryable: a bug here or an unexpected kernel.
    #[error("malformed reply: {0}")]
    Malformed(#[from] Malformed),
    /// A datagram longer than the receive buffer. Not retryable.
    #[error("a reply of {len} bytes did not fit the {buffer}-byte buffer")]
    Truncated {
        /// The datagram's length.
        len: usize,
        /// The buffer's.
        buffer: usize,
    },
    /// A dump was flagged `NLM_F_DUMP_INTR` (the objects changed while it ran) every time.
    /// Retryable later.
    #[error("the dump was interrupted by changes {attempts} times in a row")]
    DumpInterrupted {
        /// How many times it ran.
        attempts: usize,
    },
}

impl Error {
    /// The kernel's refusal, if that is what it is.
    pub fn kernel(&self) -> Option<KernelError> {
        match self {
            Error::Kernel { error, .. } => Some(*error),
            _ => None,
        }
    }

    /// Whether the kernel answered `ENOENT`.
    pub fn is_not_found(&self) -> bool {
        self.kernel().is_some_and(|e| e.is_not_found())
    }
}

/// How a request ended well.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Answered {
    /// Some reply was flagged `NLM_F_DUMP_INTR`: the dump may be inconsistent.
    pub dump_interrupted: bool,
}

/// One acknowledgement of pipelined requests: the sequence number it answers and the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    /// The answered request's sequence number.
    pub seq: u32,
    /// `Ok` if it was applied.
    pub result: Result<(), KernelError>,
}

/// A netlink socket, bound to a kernel-chosen port, with its sequence numbers and receive
/// buffer.
pub struct Socket {
    socket: netlink_sys::Socket,
    protocol: Protocol,
    seq: u32,
    buf: Vec<u8>,
    location: String,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket")
            .field("protocol", &self.protocol.name())
            .field("location", &self.location)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

fn new_socket(protocol: Protocol) -> std::io::Result<netlink_sys::Socket> {
    let mut socket = netlink_sys::Socket::new(protocol.number())?;
    socket.bind_auto()?;
    Ok(socket)
}

impl Socket {
    /// Opens a socket of `protocol` in the namespace the process runs in, or in
    /// `/var/run/netns/NAME` (see [`netns`]); it stays in that namespace for its life.
    pub fn open(protocol: Protocol, netns: Option<&str>) -> Result<Socket, Error> {
        let location = match netns {
            None => "the current network namespace".to_string(),
            Some(name) => format!("netns {name}"),
        };
        let fail = |detail: String| Error::Open {
            protocol: protocol.name(),
            location: location.clone(),
            detail,
        };
        let socket = match netns {
            None => new_socket(protocol),
            Some(name) => netns::run_in(name, "kp-netlink-netns", move || new_socket(protocol))
                .map_err(|e| fail(e.to_string()))?,
        }
        .map_err(|e| fail(format!("cannot open a {} socket: {e}", protocol.name())))?;
        let s = Socket {
            socket,
            protocol,
            seq: 0,
            buf: Vec::with_capacity(RECV_BUFFER),
            location: location.clone(),
        };
        s.set_receive_timeout(RECV_TIMEOUT)
            .map_err(|e| fail(e.to_string()))?;
        Ok(s)
    }

    /// `the current network namespace` or `netns NAME`, for messages.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// The protocol.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The next request's sequence number (1, 2, 3…).
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// How long a receive waits before failing with [`Error::Io`].
    pub fn set_receive_timeout(&self, timeout: Duration) -> Result<(), Error> {
        let tv = nix::sys::time::TimeVal::new(timeout.as_secs() as _, timeout.subsec_micros() as _);
        setsockopt(&self.socket, sockopt::ReceiveTimeout, &tv).map_err(|e| Error::Io {
            op: "SO_RCVTIMEO",
            source: e.into(),
        })
    }

    /// Sets the send buffer to `bytes` beyond the system limit (`SO_SNDBUFFORCE`, needs
    /// `CAP_NET_ADMIN`): netlink refuses a datagram larger than the send buffer.
    pub fn force_send_buffer(&self, bytes: usize) -> Result<(), Error> {
        setsockopt(&self.socket, sockopt::SndBufForce, &bytes).map_err(|e| Error::Io {
            op: "SO_SNDBUFFORCE",
            source: e.into(),
        })
    }

    /// Sets the receive buffer to `bytes` beyond the system limit (`SO_RCVBUFFORCE`): room for
    /// many answers queued at once.
    pub fn force_receive_buffer(&self, bytes: usize) -> Result<(), Error> {
        setsockopt(&self.socket, sockopt::RcvBufForce, &bytes).map_err(|e| Error::Io {
            op: "SO_RCVBUFFORCE",
            source: e.into(),
        })
    }

    /// Sends one datagram (one message, or several back to back).
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), Error> {
        let sent = self
            .socket
            .send(bytes, 0)
            .map_err(|source| Error::Io { op: "send", source })?;
        if sent != bytes.len() {
            return Err(Error::Io {
                op: "send",
                source: std::io::Error::other(format!("sent {sent} of {} bytes", bytes.len())),
            });
        }
        Ok(())
    }

    /// Receives one datagram.
    pub fn recv(&mut self) -> Result<&[u8], Error> {
        self.buf.clear();
        let n = self
            .socket
            .recv(&mut self.buf, nix::libc::MSG_TRUNC)
            .map_err(|source| Error::Io {
                op: "receive",
                source,
            })?;
        if n > self.buf.len() {
            return Err(Error::Truncated {
                len: n,
                buffer: self.buf.capacity(),
            });
        }
        Ok(&self.buf[..n])
    }

    /// Sends the request `build` writes (given its sequence number) and hands each protocol
    /// message answering it to `on_reply`, until it is answered in full: `NLMSG_DONE` for a
    /// dump, the acknowledgement for a request with `NLM_F_ACK`. Messages of other sequence
    /// numbers (late answers to an earlier request) are skipped.
    pub fn request(
        &mut self,
        build: impl FnOnce(&mut Vec<u8>, u32),
        mut on_reply: impl FnMut(&Message<'_>) -> Result<(), Malformed>,
    ) -> Result<Answered, Error> {
        let seq = self.next_seq();
        let mut request = Vec::with_capacity(64);
        build(&mut request, seq);
        self.send(&request)?;
        let mut answered = Answered::default();
        loop {
            let datagram = self.recv()?;
            for m in messages(datagram) {
                let m = m?;
                if m.seq() != seq {
                    continue;
                }
                match m.control()? {
                    Control::Noop => {}
                    Control::Done | Control::Ack => return Ok(answered),
                    Control::Error(error) => return Err(Error::Kernel { seq, error }),
                    Control::Overrun => return Err(Malformed::from("NLMSG_OVERRUN").into()),
                    Control::Data => {
                        answered.dump_interrupted |= m.is_dump_interrupted();
                        on_reply(&m)?;
                    }
                }
            }
        }
    }

    /// A dump that must be consistent: runs the request `build` writes, collecting its replies
    /// into a fresh `S` with `on_reply`, again while the kernel flags it `NLM_F_DUMP_INTR`, at
    /// most [`DUMP_ATTEMPTS`] times; then [`Error::DumpInterrupted`].
    pub fn dump<S: Default>(
        &mut self,
        build: impl Fn(&mut Vec<u8>, u32),
        mut on_reply: impl FnMut(&mut S, &Message<'_>) -> Result<(), Malformed>,
    ) -> Result<S, Error> {
        for _ in 0..DUMP_ATTEMPTS {
            let mut state = S::default();
            let answered = self.request(&build, |m| on_reply(&mut state, m))?;
            if !answered.dump_interrupted {
                return Ok(state);
            }
        }
        Err(Error::DumpInterrupted {
            attempts: DUMP_ATTEMPTS,
        })
    }

    /// Sends pipelined requests (each with `NLM_F_ACK`) in one datagram and hands each
    /// acknowledgement or error to `on_ack` until it returns `true` (every awaited one arrived).
    /// `on_ack` decides which sequence numbers it waits for and ignores the others. Messages
    /// that are neither (no such request answers with data) are skipped.
    pub fn acks(&mut self, bytes: &[u8], mut on_ack: impl FnMut(Ack) -> bool) -> Result<(), Error> {
        self.send(bytes)?;
        loop {
            let datagram = self.recv()?;
            for m in messages(datagram) {
                let m = m?;
                let result = match m.control()? {
                    Control::Ack => Ok(()),
                    Control::Error(e) => Err(e),
                    _ => continue,
                };
                if on_ack(Ack {
                    seq: m.seq(),
                    result,
                }) {
                    return Ok(());
                }
            }
        }
    }

    /// Sends `count` requests that each ask for an acknowledgement (`NLM_F_ACK`), `build(i,
    /// buf, seq)` appending the `i`-th with sequence number `seq`, `per_datagram` of them to a
    /// datagram (pipelined: one round trip per datagram, the kernel running them in order), and
    /// waits for every acknowledgement. Returns the first refusal that `accepted` does not take
    /// as success (an `EEXIST` may be the state asked for), with its request's index: the
    /// requests after it in its datagram ran, the datagrams after it were not sent.
    pub fn pipeline(
        &mut self,
        count: usize,
        per_datagram: usize,
        mut build: impl FnMut(usize, &mut Vec<u8>, u32),
        accepted: impl Fn(usize, &KernelError) -> bool,
    ) -> Result<Option<(usize, KernelError)>, Error> {
        let per_datagram = per_datagram.max(1);
        let mut start = 0;
        while start < count {
            let end = (start + per_datagram).min(count);
            let mut buf = Vec::with_capacity((end - start) * 128);
            let first = self.seq.wrapping_add(1);
            for i in start..end {
                let seq = self.next_seq();
                build(i, &mut buf, seq);
            }
            let index = |seq: u32| start + seq.wrapping_sub(first) as usize;
            let mut waiting = end - start;
            let mut refused: Option<(usize, KernelError)> = None;
            self.acks(&buf, |ack| {
                let i = index(ack.seq);
                if !(start..end).contains(&i) {
                    return false;
                }
                if let Err(e) = ack.result {
                    if !accepted(i, &e) && refused.is_none_or(|(r, _)| i < r) {
                        refused = Some((i, e));
                    }
                }
                waiting -= 1;
                waiting == 0
            })?;
            if refused.is_some() {
                return Ok(refused);
            }
            start = end;
        }
        Ok(None)
    }

    /// Sends an nfnetlink batch (`BATCH_BEGIN`, messages, `BATCH_END`; see
    /// [`nfnl::batch_control`](crate::nfnl::batch_control)) whose message `ack_seq` asks for an
    /// acknowledgement, and waits until the kernel has processed it: the kernel applies a batch
    /// while `sendmsg` runs, then reports an error for each refused message and acknowledges the
    /// last one, or reports an error against the batch as a whole (sequence 0: no permission, a
    /// failed commit). Either all of the batch is committed or none of it.
    ///
    /// A batch larger than the default send buffer grows it (needs `CAP_NET_ADMIN`, which
    /// changing nf_tables needs anyway). Errors: [`Error::Kernel`] with the first refused
    /// message's sequence number and errno.
    pub fn send_batch(&mut self, bytes: &[u8], ack_seq: u32) -> Result<(), Error> {
        let len = bytes.len();
        // The default send buffer (208 KiB) holds a partial sync's batch; a full table's needs
        // more, which only a privileged process may force (as nft does).
        if len + 1024 > 200 * 1024 {
            self.force_send_buffer(len + 64 * 1024)?;
            // Room for error reports, each of which echoes the refused message.
            let _ = self.force_receive_buffer(4 * 1024 * 1024);
        }
        let mut first_error: Option<(u32, KernelError)> = None;
        self.acks(bytes, |ack| {
            if let Err(e) = ack.result {
                first_error.get_or_insert((ack.seq, e));
            }
            // The batch as a whole was refused, or the acknowledged last message was reached.
            (ack.seq == 0 && ack.result.is_err()) || ack.seq == ack_seq
        })?;
        match first_error {
            None => Ok(()),
            Some((seq, error)) => Err(Error::Kernel { seq, error }),
        }
    }
}

impl std::os::fd::AsFd for Socket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.socket.as_fd()
    }
}
