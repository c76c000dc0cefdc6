//! Attributes (`struct nlattr`): type-length-value records, each padded to 4 bytes, nested by
//! putting records inside a record flagged `NLA_F_NESTED`.
//!
//! Writing appends to a `Vec<u8>` (the message being built, or a nest's payload); reading walks
//! a byte slice. Multi-byte values are in the byte order the attribute's family says: nf_tables
//! and ctnetlink use network order (`put_be32`, [`be32`]), generic netlink host order
//! (`put_u32`, [`u32_ne`]).

use crate::abi::{NLA_ALIGNTO, NLA_F_NESTED, NLA_F_NET_BYTEORDER, NLA_HDRLEN, NLA_TYPE_MASK};
use crate::Malformed;

/// Rounds `n` up to the attribute (and message) alignment, 4.
pub fn align(n: usize) -> usize {
    (n + NLA_ALIGNTO - 1) & !(NLA_ALIGNTO - 1)
}

/// Appends one attribute: header, `payload`, padding.
pub fn put(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    buf.extend_from_slice(&((NLA_HDRLEN + payload.len()) as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(align(buf.len()), 0);
}

/// A string attribute, NUL-terminated as the kernel's `NLA_STRING` and `NLA_NUL_STRING` want.
pub fn put_str(buf: &mut Vec<u8>, kind: u16, s: &str) {
    put_with(buf, kind, |b| {
        b.extend_from_slice(s.as_bytes());
        b.push(0);
    });
}

/// The payload of a string attribute: the bytes and a NUL.
pub fn cstr(s: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(s.len() + 1);
    v.extend_from_slice(s.as_bytes());
    v.push(0);
    v
}

/// A `u8` attribute.
pub fn put_u8(buf: &mut Vec<u8>, kind: u16, v: u8) {
    put(buf, kind, &[v]);
}

/// A `u16` attribute in network order.
pub fn put_be16(buf: &mut Vec<u8>, kind: u16, v: u16) {
    put(buf, kind, &v.to_be_bytes());
}

/// A `u32` attribute in network order.
pub fn put_be32(buf: &mut Vec<u8>, kind: u16, v: u32) {
    put(buf, kind, &v.to_be_bytes());
}

/// A `u16` attribute in host order.
pub fn put_u16(buf: &mut Vec<u8>, kind: u16, v: u16) {
    put(buf, kind, &v.to_ne_bytes());
}

/// A `u32` attribute in host order.
pub fn put_u32(buf: &mut Vec<u8>, kind: u16, v: u32) {
    put(buf, kind, &v.to_ne_bytes());
}

/// An attribute whose payload `fill` writes in place (no copy; the length is patched after).
pub fn put_with(buf: &mut Vec<u8>, kind: u16, fill: impl FnOnce(&mut Vec<u8>)) {
    let at = buf.len();
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(&kind.to_ne_bytes());
    fill(buf);
    let len = (buf.len() - at) as u16;
    buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    buf.resize(align(buf.len()), 0);
}

/// An open nested attribute: where its header is. Close it with [`nest_end`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a nest must be closed with nest_end"]
pub struct Nest(usize);

impl Nest {
    /// The offset of the nest's header in the buffer.
    pub fn offset(self) -> usize {
        self.0
    }
}

/// Opens a nested attribute of type `kind` (flagged `NLA_F_NESTED`, as strict kernel parsers
/// require); the attributes appended until [`nest_end`] are its payload.
pub fn nest_start(buf: &mut Vec<u8>, kind: u16) -> Nest {
    let at = buf.len();
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    Nest(at)
}

/// Closes a nested attribute: writes its length (its content is already aligned).
pub fn nest_end(buf: &mut [u8], nest: Nest) {
    let len = (buf.len() - nest.0) as u16;
    buf[nest.0..nest.0 + 2].copy_from_slice(&len.to_ne_bytes());
}

/// A nested attribute written by `fill`.
pub fn put_nested(buf: &mut Vec<u8>, kind: u16, fill: impl FnOnce(&mut Vec<u8>)) {
    let nest = nest_start(buf, kind);
    fill(buf);
    nest_end(buf, nest);
}

/// One attribute read from a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// The type, without the `NLA_F_NESTED` and `NLA_F_NET_BYTEORDER` flags.
    pub kind: u16,
    /// Whether it was flagged `NLA_F_NESTED`.
    pub nested: bool,
    /// Whether it was flagged `NLA_F_NET_BYTEORDER`.
    pub net_byteorder: bool,
    /// The value, without header and padding.
    pub payload: &'a [u8],
}

/// The attributes of a message body or of a nest's payload, in order.
pub fn attrs(bytes: &[u8]) -> Attrs<'_> {
    Attrs(bytes)
}

/// Iterator of [`attrs`]. A record whose length does not fit ends the walk with an error.
#[derive(Debug, Clone)]
pub struct Attrs<'a>(&'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<Attr<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        let b = self.0;
        if b.is_empty() {
            return None;
        }
        let len = match b.get(..2) {
            Some(l) => usize::from(u16::from_ne_bytes([l[0], l[1]])),
            None => 0,
        };
        if b.len() < NLA_HDRLEN || len < NLA_HDRLEN || len > b.len() {
            self.0 = &[];
            return Some(Err(Malformed(format!(
                "attribute length {len} with {} bytes left",
                b.len()
            ))));
        }
        let raw = u16::from_ne_bytes([b[2], b[3]]);
        // The last record of a message need not be padded.
        self.0 = &b[align(len).min(b.len())..];
        Some(Ok(Attr {
            kind: raw & NLA_TYPE_MASK,
            nested: raw & NLA_F_NESTED != 0,
            net_byteorder: raw & NLA_F_NET_BYTEORDER != 0,
            payload: &b[NLA_HDRLEN..len],
        }))
    }
}

/// The attributes of `bytes` indexed by type; types beyond `N - 1` are ignored (newer kernels
/// add attributes; a reader reads the ones it knows). A repeated type keeps its last value.
pub fn table<const N: usize>(bytes: &[u8]) -> Result<[Option<&[u8]>; N], Malformed> {
    let mut t = [None; N];
    for a in attrs(bytes) {
        let a = a?;
        if let Some(slot) = t.get_mut(usize::from(a.kind)) {
            *slot = Some(a.payload);
        }
    }
    Ok(t)
}

fn fixed<const W: usize>(payload: Option<&[u8]>, what: &str) -> Result<[u8; W], Malformed> {
    let p = payload.ok_or_else(|| Malformed(format!("{what} missing")))?;
    p.try_into()
        .map_err(|_| Malformed(format!("{what}: {} bytes, not {W}", p.len())))
}

/// A network-order `u32` attribute's value; `what` names it in the error.
pub fn be32(payload: Option<&[u8]>, what: &str) -> Result<u32, Malformed> {
    fixed(payload, what).map(u32::from_be_bytes)
}

/// A network-order `u16` attribute's value.
pub fn be16(payload: Option<&[u8]>, what: &str) -> Result<u16, Malformed> {
    fixed(payload, what).map(u16::from_be_bytes)
}

/// A host-order `u32` attribute's value.
pub fn u32_ne(payload: Option<&[u8]>, what: &str) -> Result<u32, Malformed> {
    fixed(payload, what).map(u32::from_ne_bytes)
}

/// A host-order `u16` attribute's value.
pub fn u16_ne(payload: Option<&[u8]>, what: &str) -> Result<u16, Malformed> {
    fixed(payload, what).map(u16::from_ne_bytes)
}

/// A `u8` attribute's value.
pub fn u8(payload: Option<&[u8]>, what: &str) -> Result<u8, Malformed> {
    fixed(payload, what).map(|[b]: [u8; 1]| b)
}

/// A string attribute, up to its first NUL.
pub fn str<'a>(payload: Option<&'a [u8]>, what: &str) -> Result<&'a str, Malformed> {
    let p = payload.ok_or_else(|| Malformed(format!("{what} missing")))?;
    let p = p.split(|b| *b == 0).next().unwrap_or_default();
    std::str::from_utf8(p).map_err(|_| Malformed(format!("{what} is not UTF-8")))
}
