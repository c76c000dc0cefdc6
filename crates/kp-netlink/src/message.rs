//! Messages (`struct nlmsghdr` and what follows): writing them into a buffer, splitting a
//! received datagram into them, and telling netlink's own messages (`NLMSG_ERROR`,
//! `NLMSG_DONE`, `NLMSG_NOOP`) from the protocol's.

use crate::abi::{
    NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, NLMSG_NOOP, NLMSG_OVERRUN, NLM_F_DUMP_INTR, NLM_F_MULTI,
};
use crate::attr::align;
use crate::{KernelError, Malformed};

/// `struct nlmsghdr`, in host byte order as on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    /// `nlmsg_len`: the whole message, header included (padding excluded).
    pub len: u32,
    /// `nlmsg_type`.
    pub kind: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// `nlmsg_pid`: 0 from the kernel, and in requests (the kernel knows our port).
    pub pid: u32,
}

impl Header {
    /// Reads a header from the first 16 bytes of `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Header, Malformed> {
        let b: &[u8; NLMSG_HDRLEN] = bytes
            .get(..NLMSG_HDRLEN)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| {
                Malformed(format!(
                    "{} bytes, too short for a netlink header",
                    bytes.len()
                ))
            })?;
        Ok(Header {
            len: u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
            kind: u16::from_ne_bytes([b[4], b[5]]),
            flags: u16::from_ne_bytes([b[6], b[7]]),
            seq: u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
            pid: u32::from_ne_bytes([b[12], b[13], b[14], b[15]]),
        })
    }

    /// Appends the header's 16 bytes.
    pub fn emit(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&self.len.to_ne_bytes());
        buf.extend_from_slice(&self.kind.to_ne_bytes());
        buf.extend_from_slice(&self.flags.to_ne_bytes());
        buf.extend_from_slice(&self.seq.to_ne_bytes());
        buf.extend_from_slice(&self.pid.to_ne_bytes());
    }
}

/// A message being written: where its header is. Finish it with [`end`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a message must be finished with message::end"]
pub struct Start(usize);

impl Start {
    /// The offset of the message's header in the buffer.
    pub fn offset(self) -> usize {
        self.0
    }
}

/// Starts a message at the end of `buf` (several messages may share a buffer: a batch, or
/// pipelined requests). Append its fixed header (`nfgenmsg`, `genlmsghdr`) and attributes, then
/// call [`end`].
pub fn begin(buf: &mut Vec<u8>, kind: u16, flags: u16, seq: u32) -> Start {
    let at = buf.len();
    Header {
        len: 0,
        kind,
        flags,
        seq,
        pid: 0,
    }
    .emit(buf);
    Start(at)
}

/// Finishes a message: pads it to 4 bytes and writes its length.
pub fn end(buf: &mut Vec<u8>, start: Start) {
    let len = (buf.len() - start.0) as u32;
    buf[start.0..start.0 + 4].copy_from_slice(&len.to_ne_bytes());
    buf.resize(align(buf.len()), 0);
}

/// Rewrites the sequence number of a finished or open message.
pub fn set_seq(buf: &mut [u8], start: Start, seq: u32) {
    buf[start.0 + 8..start.0 + 12].copy_from_slice(&seq.to_ne_bytes());
}

/// Adds `flags` to a finished or open message (a batch asks for the last message's ack).
pub fn add_flags(buf: &mut [u8], start: Start, flags: u16) {
    let at = start.0 + 6;
    let old = u16::from_ne_bytes([buf[at], buf[at + 1]]);
    buf[at..at + 2].copy_from_slice(&(old | flags).to_ne_bytes());
}

/// One message of a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// Its header.
    pub header: Header,
    /// What follows the header (the protocol's fixed header, then attributes).
    pub payload: &'a [u8],
    /// The whole message, header included.
    pub bytes: &'a [u8],
}

/// What a message is, to the exchange that waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Control {
    /// `NLMSG_NOOP`: nothing.
    Noop,
    /// `NLMSG_DONE`: a dump is complete.
    Done,
    /// `NLMSG_ERROR` with code 0: the request it answers was applied.
    Ack,
    /// `NLMSG_ERROR` with an errno, or `NLMSG_DONE` ending a dump with one: refused.
    Error(KernelError),
    /// `NLMSG_OVERRUN`: data was lost.
    Overrun,
    /// A message of the protocol (type `NLMSG_MIN_TYPE` or above).
    Data,
}

impl<'a> Message<'a> {
    /// `nlmsg_type`.
    pub fn kind(&self) -> u16 {
        self.header.kind
    }

    /// `nlmsg_seq`.
    pub fn seq(&self) -> u32 {
        self.header.seq
    }

    /// Whether the kernel flagged this part of a dump `NLM_F_DUMP_INTR`: the objects changed
    /// while it was dumped, so the dump as a whole may be inconsistent.
    pub fn is_dump_interrupted(&self) -> bool {
        self.header.flags & NLM_F_DUMP_INTR != 0
    }

    /// Whether it is part of a multipart reply (`NLM_F_MULTI`), which `NLMSG_DONE` ends.
    pub fn is_multipart(&self) -> bool {
        self.header.flags & NLM_F_MULTI != 0
    }

    /// Tells netlink's own messages from the protocol's and reads their error code.
    pub fn control(&self) -> Result<Control, Malformed> {
        let code = || {
            self.payload
                .get(..4)
                .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        };
        Ok(match self.header.kind {
            NLMSG_NOOP => Control::Noop,
            // A dump may end with an error code (or a zero) instead of an empty body.
            NLMSG_DONE => match code() {
                Some(c) if c < 0 => Control::Error(KernelError::new(-c)),
                _ => Control::Done,
            },
            NLMSG_ERROR => match code() {
                None => return Err("an NLMSG_ERROR without error code".into()),
                Some(0) => Control::Ack,
                Some(c) => Control::Error(KernelError::new(c.checked_neg().unwrap_or(c))),
            },
            NLMSG_OVERRUN => Control::Overrun,
            kind if kind < crate::abi::NLMSG_MIN_TYPE => {
                return Err(Malformed(format!("reserved message type {kind}")))
            }
            _ => Control::Data,
        })
    }

    /// For an `NLMSG_ERROR`: the header of the request it answers (the kernel echoes it).
    pub fn error_request(&self) -> Option<Header> {
        if self.header.kind != NLMSG_ERROR {
            return None;
        }
        Header::parse(self.payload.get(4..)?).ok()
    }
}

/// The messages of a datagram, in order.
pub fn messages(datagram: &[u8]) -> Messages<'_> {
    Messages(datagram)
}

/// Iterator of [`messages`]. A header that does not fit ends the walk with an error: after it,
/// nothing can be framed.
#[derive(Debug, Clone)]
pub struct Messages<'a>(&'a [u8]);

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Message<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        let b = self.0;
        if b.is_empty() {
            return None;
        }
        let fail = |this: &mut Self, what: String| {
            this.0 = &[];
            Some(Err(Malformed(what)))
        };
        if b.len() < NLMSG_HDRLEN {
            return fail(
                self,
                format!("{} stray bytes after the last message", b.len()),
            );
        }
        let header = match Header::parse(b) {
            Ok(h) => h,
            Err(e) => return fail(self, e.0),
        };
        let len = header.len as usize;
        if len < NLMSG_HDRLEN || len > b.len() {
            return fail(
                self,
                format!("message length {len} with {} bytes left", b.len()),
            );
        }
        // Messages are padded to 4 bytes; the last one of a datagram may not be.
        self.0 = &b[align(len).min(b.len())..];
        Some(Ok(Message {
            header,
            payload: &b[NLMSG_HDRLEN..len],
            bytes: &b[..len],
        }))
    }
}
