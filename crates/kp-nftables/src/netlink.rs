//! Reads our table straight from the kernel over `NETLINK_NETFILTER`, into the same
//! [`KernelTable`] that [`parse_table`](crate::parse_table) builds from `nft -j list table`.
//!
//! nft takes seconds to list a table holding a few hundred thousand elements: it loads and
//! formats every set before it prints anything. The kernel's own dumps of the same objects take
//! a small fraction of that. This module asks for the dumps nft itself would ask for (chains,
//! rules, sets, then each set's elements) and nothing else, and turns the raw element bytes into
//! atoms with a per-set [`SetSchema`], because the kernel keeps bytes, not types.
//!
//! It also sends the element batches that `kp_nftables_plan::netlink` encodes ([`send_batch`],
//! or [`Session::send_batch`] on a socket kept open), and asks whether our table exists
//! ([`table_exists`]); everything else is a `GET`. Message layouts are the kernel UAPI's
//! (`linux/netlink.h`, `linux/netfilter/nfnetlink.h`, `linux/netfilter/nf_tables.h`); constants
//! keep their kernel names. The one layout that is nft's and not the kernel's is the rule
//! comment, which nft keeps in the rule's opaque user data (a TLV record of type 0,
//! `NFTNL_UDATA_RULE_COMMENT`).
//!
//! Cost: the kernel sends a dump in 32 KiB datagrams (about 730 endpoint-map elements each) and
//! resumes each one by walking the set from its start, so one set's dump grows with the square of
//! its size. At 10k Services × 10 endpoints the 114k-element `vips-10-endpoints` map takes
//! 0.25-0.3 s of kernel time, most of a read; decoding everything takes 0.06 s.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};
use kp_nftables_plan::element::{Atom, NoEndpointVerdict, Tuple};
use kp_nftables_plan::names::{REJECT_PACKET, TABLE};
#[cfg(test)]
use kp_nftables_plan::SetId;
use netlink_sys::protocols::NETLINK_NETFILTER;
use netlink_sys::Socket;
use nix::sys::time::TimeValLike;

use crate::{Error, KernelTable};

#[cfg(test)]
mod tests;

use kp_nftables_plan::netlink::abi::*;

/// nft's (libnftnl's) user-data record type for a rule comment: `type u8, len u8, value`, the
/// value NUL-terminated. A userspace convention: the kernel stores the bytes without reading them.
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;

/// What [`parse_table`](crate::parse_table) reports for a rule without comment.
const NO_COMMENT: &str = "<rule without comment>";

/// Where `ip netns add` puts its namespaces.
const NETNS_DIR: &str = "/var/run/netns";

/// How often a read is repeated when the ruleset changes while it is being read.
const ATTEMPTS: usize = 3;

/// The receive buffer. The kernel fills a dump datagram up to the reader's last buffer size,
/// capped at 32 KiB; twice that leaves room, and a longer datagram is reported, not cut.
const RECV_BUFFER: usize = 64 * 1024;

/// How long to wait for any kernel reply before giving up (it answers in microseconds; this only
/// keeps a sync from hanging forever on a wedged socket).
const RECV_TIMEOUT_SECS: i64 = 10;

use kp_nftables_plan::netlink::{strides, total_len};
pub use kp_nftables_plan::netlink::{AtomKind, SetSchema};
use kp_nftables_plan::EncodedBatch;

/// Reads the `kube-proxy` table of `family` from the kernel: like
/// `nft -j list table ip|ip6 kube-proxy` followed by [`parse_table`](crate::parse_table), and
/// equal to it for every set `schema` describes.
///
/// With `netns`, reads the table of the named network namespace (`/var/run/netns/NAME`, as made
/// by `ip netns add`); the calling thread stays where it is. `schema` gives the layout of each
/// set by name; a set it answers `None` for is reported with no elements (they are not even
/// dumped). Anonymous sets are left out, as nft leaves them out.
///
/// The read is consistent: if the ruleset changes while the dumps run (a new generation, the
/// kernel flagging a dump as interrupted, or an object vanishing between two dumps), it starts
/// over, up to three times.
///
/// Errors: [`Error::Netlink`] when the kernel refuses a request (its errno in the message:
/// `netlink error -ENOENT (table missing)`) or the socket fails; [`Error::Parse`] when a reply or
/// an element does not have the expected shape (including a set whose kernel declaration does
/// not match its schema).
pub fn read_table(
    family: IpFamily,
    netns: Option<&str>,
    schema: &dyn Fn(&str) -> Option<SetSchema>,
) -> Result<KernelTable, Error> {
    let mut conn = Conn::open(netns)?;
    for attempt in 1..=ATTEMPTS {
        let before = conn.generation()?;
        let read = conn.read_table(family, schema);
        let after = conn.generation()?;
        match read {
            Ok((table, true)) if before == after => return Ok(table),
            Ok(_) => {}
            // A set deleted between the set dump and its element dump, say. Only kernel
            // refusals are retried: they end the dump, so the socket is ready for the next.
            Err(Error::Netlink { .. }) if before != after => {}
            Err(e) => return Err(e),
        }
        tracing::debug!(
            attempt,
            before,
            after,
            "nftables ruleset changed while it was read; reading again"
        );
    }
    Err(list_error(
        format!("netlink list table {} {TABLE}", family_name(family)),
        format!("the ruleset changed during each of {ATTEMPTS} reads"),
    ))
}

/// Reads one set of our table (`None` if the table or the set does not exist): the elements as
/// [`read_table`] reads them, with the same checks of the kernel's declaration against `schema`.
/// A dynamic set's elements may expire or appear while it is read; the answer is a snapshot.
pub fn read_set(
    family: IpFamily,
    netns: Option<&str>,
    name: &str,
    schema: &SetSchema,
) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error> {
    Session::open(netns)?.read_set(family, name, schema)
}

/// A `NETLINK_NETFILTER` socket kept open for repeated requests and batches.
///
/// Closing a socket that committed an nf_tables batch makes the kernel wait for that commit's
/// cleanup, an RCU grace period (10-25 ms on the test machine, more than everything else a
/// one-endpoint change costs), so the dataplane keeps one session instead of a socket per sync.
/// After any error, drop the session and open a new one: replies may be left unread.
pub struct Session {
    conn: Conn,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

impl Session {
    /// Opens a socket in the named network namespace (as made by `ip netns add`), or in the
    /// current one.
    pub fn open(netns: Option<&str>) -> Result<Session, Error> {
        Ok(Session {
            conn: Conn::open(netns)?,
        })
    }

    /// See [`read_set`].
    pub fn read_set(
        &mut self,
        family: IpFamily,
        name: &str,
        schema: &SetSchema,
    ) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error> {
        let conn = &mut self.conn;
        read_set_with(conn, family, name, schema)
    }

    /// See [`table_exists`].
    pub fn table_exists(&mut self, family: IpFamily) -> Result<bool, Error> {
        table_exists_with(&mut self.conn, family)
    }

    /// See [`send_batch`].
    pub fn send_batch(&mut self, batch: &EncodedBatch) -> Result<(), Error> {
        send_batch_with(&mut self.conn, batch)
    }
}

fn read_set_with(
    conn: &mut Conn,
    family: IpFamily,
    name: &str,
    schema: &SetSchema,
) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error> {
    let sets = match conn.sets(family) {
        Ok((sets, _)) => sets,
        Err(Error::Netlink { detail, .. }) if detail.contains("ENOENT") => return Ok(None),
        Err(e) => return Err(e),
    };
    let Some(set) = sets.iter().find(|s| s.name == name) else {
        return Ok(None);
    };
    match conn.elements(family, set, schema) {
        Ok((elements, _)) => Ok(Some(elements)),
        Err(Error::Netlink { detail, .. }) if detail.contains("ENOENT") => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether the `kube-proxy` table of `family` exists (in the named network namespace, or the
/// current one). Errors: [`Error::Netlink`] when the kernel cannot be asked (no permission, no
/// socket).
pub fn table_exists(family: IpFamily, netns: Option<&str>) -> Result<bool, Error> {
    Session::open(netns)?.table_exists(family)
}

fn table_exists_with(conn: &mut Conn, family: IpFamily) -> Result<bool, Error> {
    let fam_name = family_name(family);
    let r = conn.request(
        NFT_MSG_GETTABLE,
        NLM_F_ACK,
        nfproto(family),
        &[(NFTA_TABLE_NAME, &cstr(TABLE))],
        &format!("netlink get table {fam_name} {TABLE}"),
        None,
        |_| Ok(()),
    );
    match r {
        Ok(_) => Ok(true),
        Err(Error::Netlink { detail, .. }) if detail.contains("ENOENT") => Ok(false),
        Err(e) => Err(e),
    }
}

/// The send buffer a batch of `len` bytes needs: netlink refuses a datagram larger than the
/// socket's send buffer (less a little overhead).
fn send_buffer_for(len: usize) -> usize {
    len + 64 * 1024
}

/// Sends one element batch (in the named network namespace, or the current one) and waits
/// until the kernel has processed it: the kernel applies a batch while `sendmsg` runs, then
/// reports an error for each refused message and acknowledges the last one, or reports an error
/// against the batch as a whole (sequence 0: no permission, a failed commit). Either all of the
/// batch is committed or none of it.
///
/// Errors: [`Error::Netlink`] naming the first refused message and the kernel's errno (for
/// example `-ENOENT` when a deleted element is missing or a set does not exist).
///
/// Opens a socket for this batch alone; see [`Session`] for repeated batches.
pub fn send_batch(netns: Option<&str>, batch: &EncodedBatch) -> Result<(), Error> {
    Session::open(netns)?.send_batch(batch)
}

fn send_batch_with(conn: &mut Conn, batch: &EncodedBatch) -> Result<(), Error> {
    let what = format!(
        "netlink element batch ({} messages, {} bytes)",
        batch.messages,
        batch.bytes.len()
    );
    let fail = |detail: String| list_error(what.clone(), detail);
    let len = batch.bytes.len();
    // The default send buffer (208 KiB) holds a partial sync's batch; a full table's needs more,
    // which only a privileged process may force (as nft does).
    if len + 1024 > 200 * 1024 {
        use nix::sys::socket::{setsockopt, sockopt};
        setsockopt(&conn.socket, sockopt::SndBufForce, &send_buffer_for(len))
            .map_err(|e| fail(format!("cannot grow the send buffer to {len} bytes: {e}")))?;
        // Room for error reports, each of which echoes the refused message.
        let _ = setsockopt(&conn.socket, sockopt::RcvBufForce, &(4 * 1024 * 1024));
    }
    let sent = conn
        .socket
        .send(&batch.bytes, 0)
        .map_err(|e| fail(format!("netlink send: {e}")))?;
    if sent != len {
        return Err(fail(format!("sent {sent} of {len} bytes")));
    }
    let mut first_error: Option<(u32, i32)> = None;
    loop {
        conn.buf.clear();
        let n = conn
            .socket
            .recv(&mut conn.buf, nix::libc::MSG_TRUNC)
            .map_err(|e| fail(format!("netlink receive: {e}")))?;
        if n > conn.buf.len() {
            return Err(fail(format!("a reply of {n} bytes did not fit the buffer")));
        }
        let mut done = false;
        for m in Messages(&conn.buf[..n]) {
            let m = m.map_err(|e| parse_error(&what, e))?;
            if m.kind != NLMSG_ERROR {
                continue;
            }
            let code = m
                .payload
                .get(..4)
                .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                .ok_or_else(|| parse_error(&what, "an NLMSG_ERROR without error code".into()))?;
            if code != 0 && first_error.is_none() {
                first_error = Some((m.seq, -code));
            }
            // The batch as a whole was refused, or the acknowledged last message was reached.
            if (m.seq == 0 && code != 0) || m.seq == batch.ack_seq {
                done = true;
            }
        }
        if done {
            break;
        }
    }
    match first_error {
        None => Ok(()),
        Some((0, errno)) => Err(fail(format!(
            "the batch was refused: {}",
            errno_message(errno, None)
        ))),
        Some((seq, errno)) => Err(fail(format!(
            "message {seq} of {} was refused, so nothing was applied: {}",
            batch.messages,
            errno_message(
                errno,
                (errno == nix::libc::ENOENT).then_some("set or element missing")
            )
        ))),
    }
}

fn family_name(family: IpFamily) -> &'static str {
    kp_nftables_plan::names::family(family)
}

fn list_error(op: String, detail: String) -> Error {
    Error::Netlink { op, detail }
}

/// A reply that does not have the expected shape; `what` names the request.
fn parse_error(what: &str, detail: String) -> Error {
    Error::Parse(format!("{what}: {detail}"))
}

/// What is wrong with a reply, before it is known which request it answered.
type Malformed = String;

/// `netlink error -ENOENT (No such file or directory)`, with `hint` instead of the generic
/// description when there is one.
fn errno_message(errno: i32, hint: Option<&str>) -> String {
    let e = nix::errno::Errno::from_raw(errno);
    let name = format!("{e:?}");
    let desc = hint.unwrap_or(e.desc());
    format!("netlink error -{name} ({desc})")
}

/// A NETLINK_NETFILTER socket and the state of its request/reply exchange.
struct Conn {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

/// What the kernel says about one set of our table.
#[derive(Debug)]
struct SetInfo {
    name: String,
    flags: u32,
    key_len: u32,
    data_type: Option<u32>,
    data_len: Option<u32>,
}

impl Conn {
    fn open(netns: Option<&str>) -> Result<Conn, Error> {
        let socket = match netns {
            None => new_socket("the current network namespace")?,
            Some(name) => socket_in_netns(name)?,
        };
        Ok(Conn {
            socket,
            seq: 0,
            buf: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// The ruleset generation: it changes with every committed transaction.
    fn generation(&mut self) -> Result<u32, Error> {
        let mut gen = None;
        self.request(
            NFT_MSG_GETGEN,
            NLM_F_ACK,
            NFPROTO_UNSPEC,
            &[],
            "netlink get generation",
            None,
            |body| {
                let a: [Option<&[u8]>; 2] = attr_table(body)?;
                gen = Some(be32(a[usize::from(NFTA_GEN_ID)], "generation id")?);
                Ok(())
            },
        )?;
        gen.ok_or_else(|| {
            parse_error(
                "netlink get generation",
                "no generation in the reply".into(),
            )
        })
    }

    /// Reads the table; the flag is false if the kernel said a dump was interrupted by a change.
    fn read_table(
        &mut self,
        family: IpFamily,
        schema: &dyn Fn(&str) -> Option<SetSchema>,
    ) -> Result<(KernelTable, bool), Error> {
        let fam = nfproto(family);
        let fam_name = family_name(family);
        let table_attr = cstr(TABLE);
        let mut complete = true;

        // The table itself: a missing table is an error, not an empty listing.
        self.request(
            NFT_MSG_GETTABLE,
            NLM_F_ACK,
            fam,
            &[(NFTA_TABLE_NAME, &table_attr)],
            &format!("netlink list table {fam_name} {TABLE}"),
            Some("table missing"),
            |_| Ok(()),
        )?;

        let mut t = KernelTable::default();
        // Chains: the kernel dumps every chain of the family, so keep only ours.
        complete &= self.request(
            NFT_MSG_GETCHAIN,
            NLM_F_DUMP,
            fam,
            &[],
            &format!("netlink list chains {fam_name}"),
            None,
            |body| {
                let a: [Option<&[u8]>; 4] = attr_table(body)?;
                if str_attr(a[usize::from(NFTA_CHAIN_TABLE)], "chain table")? == TABLE {
                    let name = str_attr(a[usize::from(NFTA_CHAIN_NAME)], "chain name")?;
                    t.chains.entry(name.to_string()).or_default();
                }
                Ok(())
            },
        )?;
        // Rules, in each chain's order.
        complete &= self.request(
            NFT_MSG_GETRULE,
            NLM_F_DUMP,
            fam,
            &[(NFTA_RULE_TABLE, &table_attr)],
            &format!("netlink list rules {fam_name} {TABLE}"),
            Some("table missing"),
            |body| {
                let a: [Option<&[u8]>; 8] = attr_table(body)?;
                if str_attr(a[usize::from(NFTA_RULE_TABLE)], "rule table")? != TABLE {
                    return Ok(());
                }
                let chain = str_attr(a[usize::from(NFTA_RULE_CHAIN)], "rule chain")?;
                let comment = a[usize::from(NFTA_RULE_USERDATA)]
                    .and_then(rule_comment)
                    .unwrap_or(NO_COMMENT);
                t.chains
                    .entry(chain.to_string())
                    .or_default()
                    .push(comment.to_string());
                Ok(())
            },
        )?;
        // Sets and maps.
        let (sets, sets_complete) = self.sets(family)?;
        complete &= sets_complete;
        // Each set's elements: one dump per set, as the kernel only dumps one set at a time.
        for set in sets {
            if set.flags & NFT_SET_ANONYMOUS != 0 {
                continue;
            }
            let Some(schema) = schema(&set.name) else {
                t.sets.insert(set.name, BTreeMap::new());
                continue;
            };
            let (elements, set_complete) = self.elements(family, &set, &schema)?;
            complete &= set_complete;
            t.sets.insert(set.name, elements);
        }
        Ok((t, complete))
    }

    /// Every set of our table in `family`; the flag is false if the dump was interrupted.
    fn sets(&mut self, family: IpFamily) -> Result<(Vec<SetInfo>, bool), Error> {
        let fam_name = family_name(family);
        let mut sets = Vec::new();
        let complete = self.request(
            NFT_MSG_GETSET,
            NLM_F_DUMP,
            nfproto(family),
            &[(NFTA_SET_TABLE, &cstr(TABLE))],
            &format!("netlink list sets {fam_name} {TABLE}"),
            Some("table missing"),
            |body| {
                let a: [Option<&[u8]>; 8] = attr_table(body)?;
                if str_attr(a[usize::from(NFTA_SET_TABLE)], "set table")? != TABLE {
                    return Ok(());
                }
                let name = str_attr(a[usize::from(NFTA_SET_NAME)], "set name")?.to_string();
                let optional =
                    |i: u16, what| a[usize::from(i)].map(|p| be32(Some(p), what)).transpose();
                sets.push(SetInfo {
                    flags: optional(NFTA_SET_FLAGS, "set flags")?.unwrap_or(0),
                    key_len: be32(a[usize::from(NFTA_SET_KEY_LEN)], "set key length")?,
                    data_type: optional(NFTA_SET_DATA_TYPE, "set data type")?,
                    data_len: optional(NFTA_SET_DATA_LEN, "set data length")?,
                    name,
                });
                Ok(())
            },
        )?;
        Ok((sets, complete))
    }

    /// One set's elements; the flag is false if the dump was interrupted.
    fn elements(
        &mut self,
        family: IpFamily,
        set: &SetInfo,
        schema: &SetSchema,
    ) -> Result<(BTreeMap<Tuple, Option<Tuple>>, bool), Error> {
        let what = format!(
            "netlink list set {} {TABLE} {}",
            family_name(family),
            set.name
        );
        let mut decoder =
            SetDecoder::new(set, family, schema).map_err(|e| parse_error(&what, e))?;
        let complete = self.request(
            NFT_MSG_GETSETELEM,
            NLM_F_DUMP,
            nfproto(family),
            &[
                (NFTA_SET_ELEM_LIST_TABLE, &cstr(TABLE)),
                (NFTA_SET_ELEM_LIST_SET, &cstr(&set.name)),
            ],
            &what,
            Some("set or table missing"),
            |body| decoder.message(body),
        )?;
        let elements = decoder.finish().map_err(|e| parse_error(&what, e))?;
        Ok((elements, complete))
    }

    /// Sends one request and hands the body (after `struct nfgenmsg`) of each nf_tables reply
    /// to `on_reply`, until the request is answered in full: `NLMSG_DONE` for a dump, the
    /// acknowledgement for a request with `NLM_F_ACK`. Returns false if the kernel flagged a
    /// dump as interrupted by a ruleset change. `what` names the request in errors; `enoent`
    /// explains ENOENT.
    #[allow(clippy::too_many_arguments)] // Private; each argument is one part of the request.
    fn request(
        &mut self,
        msg: u16,
        flags: u16,
        family: u8,
        attrs: &[(u16, &[u8])],
        what: &str,
        enoent: Option<&str>,
        mut on_reply: impl FnMut(&[u8]) -> Result<(), Malformed>,
    ) -> Result<bool, Error> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let request = encode_request(msg, NLM_F_REQUEST | flags, seq, family, attrs);
        self.socket
            .send(&request, 0)
            .map_err(|e| list_error(what.to_string(), format!("netlink send: {e}")))?;
        let mut complete = true;
        loop {
            self.buf.clear();
            let n = self
                .socket
                .recv(&mut self.buf, nix::libc::MSG_TRUNC)
                .map_err(|e| list_error(what.to_string(), format!("netlink receive: {e}")))?;
            if n > self.buf.len() {
                let detail = format!(
                    "a reply of {n} bytes did not fit the {}-byte buffer",
                    self.buf.len()
                );
                return Err(parse_error(what, detail));
            }
            match replies(&self.buf[..n], seq, &mut complete, &mut on_reply) {
                Ok(Reply::More) => {}
                Ok(Reply::End) => return Ok(complete),
                Ok(Reply::Errno(errno)) => return Err(kernel_error(what, errno, enoent)),
                Err(e) => return Err(parse_error(what, e)),
            }
        }
    }
}

/// Where a request stands after one datagram of replies.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    /// More datagrams follow.
    More,
    /// Answered in full.
    End,
    /// The kernel refused it with this errno.
    Errno(i32),
}

/// Handles one datagram of replies to request `seq`: the body of each nf_tables message goes to
/// `on_reply`; `complete` turns false if the kernel flags a dump as interrupted.
fn replies(
    datagram: &[u8],
    seq: u32,
    complete: &mut bool,
    on_reply: &mut impl FnMut(&[u8]) -> Result<(), Malformed>,
) -> Result<Reply, Malformed> {
    let mut state = Reply::More;
    for m in Messages(datagram) {
        let m = m?;
        if m.seq != seq {
            // A late reply to an earlier request; nothing of ours.
            continue;
        }
        let code = || {
            m.payload
                .get(..4)
                .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        };
        match m.kind {
            NLMSG_NOOP => {}
            // A dump may end with an error code instead of an empty body.
            NLMSG_DONE => match code() {
                Some(c) if c < 0 => return Ok(Reply::Errno(-c)),
                _ => state = Reply::End,
            },
            NLMSG_ERROR => match code() {
                None => return Err("an NLMSG_ERROR without error code".into()),
                // An acknowledgement: the request is complete.
                Some(0) => state = Reply::End,
                Some(c) => return Ok(Reply::Errno(-c)),
            },
            kind if kind >> 8 == NFNL_SUBSYS_NFTABLES => {
                if m.flags & NLM_F_DUMP_INTR != 0 {
                    *complete = false;
                }
                let body = m
                    .payload
                    .get(NFGENMSG_LEN..)
                    .ok_or("a reply without nfgenmsg")?;
                on_reply(body)?;
            }
            kind => return Err(format!("unexpected message type {kind:#x}")),
        }
    }
    Ok(state)
}

fn kernel_error(what: &str, errno: i32, enoent: Option<&str>) -> Error {
    let hint = enoent.filter(|_| errno == nix::libc::ENOENT);
    list_error(what.to_string(), errno_message(errno, hint))
}

fn new_socket(where_: &str) -> Result<Socket, Error> {
    let fail = |e: std::io::Error| {
        list_error(
            format!("netlink socket in {where_}"),
            format!("cannot open a NETLINK_NETFILTER socket: {e}"),
        )
    };
    let mut socket = Socket::new(NETLINK_NETFILTER).map_err(fail)?;
    socket.bind_auto().map_err(fail)?;
    let timeout = nix::sys::time::TimeVal::seconds(RECV_TIMEOUT_SECS);
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
        .map_err(|e| fail(e.into()))?;
    Ok(socket)
}

/// Opens the socket inside the named namespace: a socket belongs to the namespace it was created
/// in for good, so a short-lived thread enters the namespace, creates it and ends; the caller's
/// threads never change namespace.
fn socket_in_netns(name: &str) -> Result<Socket, Error> {
    let where_ = format!("netns {name}");
    let bad = name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']);
    if bad {
        return Err(list_error(
            format!("netlink socket in {where_}"),
            "not a namespace name".into(),
        ));
    }
    let path = Path::new(NETNS_DIR).join(name);
    let ns = File::open(&path).map_err(|e| {
        list_error(
            format!("netlink socket in {where_}"),
            format!("cannot open {}: {e}", path.display()),
        )
    })?;
    let thread_where = where_.clone();
    std::thread::Builder::new()
        .name("kp-netlink-netns".into())
        .spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                list_error(
                    format!("netlink socket in {thread_where}"),
                    format!("cannot enter the namespace: {e}"),
                )
            })?;
            new_socket(&thread_where)
        })
        .map_err(|e| {
            list_error(
                format!("netlink socket in {where_}"),
                format!("cannot start a thread: {e}"),
            )
        })?
        .join()
        .map_err(|_| {
            list_error(
                format!("netlink socket in {where_}"),
                "the namespace thread panicked".into(),
            )
        })?
}

/// Encodes `nlmsghdr`, `nfgenmsg` and the attributes of one nf_tables request.
fn encode_request(msg: u16, flags: u16, seq: u32, family: u8, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&[0; 4]); // nlmsg_len, set below
    out.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_pid: the kernel fills in ours
                                                // nfgenmsg: family, version, res_id (big-endian, unused in requests).
    out.extend_from_slice(&[family, NFNETLINK_V0, 0, 0]);
    for (kind, payload) in attrs {
        let len = NLA_HDRLEN + payload.len();
        out.extend_from_slice(&(len as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(payload);
        out.resize(align4(out.len()), 0);
    }
    let len = out.len() as u32;
    out[..4].copy_from_slice(&len.to_ne_bytes());
    out
}

/// A NUL-terminated string attribute.
fn cstr(s: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(s.len() + 1);
    v.extend_from_slice(s.as_bytes());
    v.push(0);
    v
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One netlink message of a datagram.
struct Message<'a> {
    kind: u16,
    flags: u16,
    seq: u32,
    payload: &'a [u8],
}

/// The netlink messages of a datagram.
struct Messages<'a>(&'a [u8]);

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Message<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        let b = self.0;
        if b.is_empty() {
            return None;
        }
        let fail = |this: &mut Self, what: String| {
            this.0 = &[];
            Some(Err(what))
        };
        if b.len() < NLMSG_HDRLEN {
            return fail(
                self,
                format!("{} stray bytes after the last message", b.len()),
            );
        }
        let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
        if len < NLMSG_HDRLEN || len > b.len() {
            return fail(
                self,
                format!("message length {len} with {} bytes left", b.len()),
            );
        }
        let m = Message {
            kind: u16::from_ne_bytes([b[4], b[5]]),
            flags: u16::from_ne_bytes([b[6], b[7]]),
            seq: u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
            payload: &b[NLMSG_HDRLEN..len],
        };
        self.0 = &b[align4(len).min(b.len())..];
        Some(Ok(m))
    }
}

/// The attributes of a message body or a nested attribute: `(type, payload)`.
struct Attrs<'a>(&'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<(u16, &'a [u8]), Malformed>;

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
            return Some(Err(format!(
                "attribute length {len} with {} bytes left",
                b.len()
            )));
        }
        let kind = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        self.0 = &b[align4(len).min(b.len())..];
        Some(Ok((kind, &b[NLA_HDRLEN..len])))
    }
}

/// The attributes of `data` indexed by type; types beyond `N - 1` are ignored (newer kernels
/// add attributes; we read only the ones we know).
fn attr_table<const N: usize>(data: &[u8]) -> Result<[Option<&[u8]>; N], Malformed> {
    let mut t = [None; N];
    for a in Attrs(data) {
        let (kind, payload) = a?;
        if let Some(slot) = t.get_mut(usize::from(kind)) {
            *slot = Some(payload);
        }
    }
    Ok(t)
}

fn be32(payload: Option<&[u8]>, what: &str) -> Result<u32, Malformed> {
    match payload {
        Some(&[a, b, c, d]) => Ok(u32::from_be_bytes([a, b, c, d])),
        Some(p) => Err(format!("{what}: {} bytes, not 4", p.len())),
        None => Err(format!("{what} missing")),
    }
}

/// A string attribute, without its terminating NUL.
fn str_attr<'a>(payload: Option<&'a [u8]>, what: &str) -> Result<&'a str, Malformed> {
    let p = payload.ok_or_else(|| format!("{what} missing"))?;
    let p = p.split(|b| *b == 0).next().unwrap_or_default();
    std::str::from_utf8(p).map_err(|_| format!("{what} is not UTF-8"))
}

/// The comment in a rule's user data (nft's TLV records; see [`NFTNL_UDATA_RULE_COMMENT`]).
fn rule_comment(udata: &[u8]) -> Option<&str> {
    let mut rest = udata;
    while let [kind, len, tail @ ..] = rest {
        let value = tail.get(..usize::from(*len))?;
        if *kind == NFTNL_UDATA_RULE_COMMENT {
            let text = value.split(|b| *b == 0).next().unwrap_or_default();
            return std::str::from_utf8(text).ok();
        }
        rest = &tail[usize::from(*len)..];
    }
    None
}

/// Decodes the components of one key or value, appending them to `out`.
fn decode_fields(
    kinds: &[AtomKind],
    family: IpFamily,
    bytes: &[u8],
    out: &mut Vec<Atom>,
) -> Result<(), Malformed> {
    let want = total_len(kinds, family);
    if bytes.len() != want {
        return Err(format!(
            "{} bytes where the schema needs {want}",
            bytes.len()
        ));
    }
    let mut at = 0;
    for (kind, stride) in strides(kinds, family) {
        let b = &bytes[at..at + kind.width(family)];
        at += stride;
        out.push(match kind {
            AtomKind::Addr => Atom::Ip(match *b {
                [a, b, c, d] => IpAddr::V4(Ipv4Addr::new(a, b, c, d)),
                _ => {
                    let mut v6 = [0u8; 16];
                    v6.copy_from_slice(b);
                    IpAddr::V6(Ipv6Addr::from(v6))
                }
            }),
            AtomKind::Proto => Atom::Proto(protocol(b[0])?),
            AtomKind::Port => Atom::Port(u16::from_be_bytes([b[0], b[1]])),
            // `numgen` writes its result into a register as a host-order u32, and nft declares
            // the `typeof numgen` key as a host-order integer: slot 1 is 01 00 00 00 on x86_64.
            AtomKind::Slot => Atom::Slot(u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
        });
    }
    Ok(())
}

/// [`canonical`](crate::canonical) for one atom, so that a tuple is allocated once, already canonical. A unit
/// test holds the two to the same answers.
fn canonical_atom(a: Atom) -> Atom {
    match a {
        Atom::Slot(s) => u16::try_from(s).map_or(a, Atom::Port),
        Atom::Net(n) if n.prefix_len() == n.max_prefix_len() => Atom::Ip(n.addr()),
        a => a,
    }
}

fn canonical_tuple(atoms: &mut [Atom]) -> Tuple {
    for a in atoms.iter_mut() {
        *a = canonical_atom(*a);
    }
    Tuple::new(&*atoms)
}

fn protocol(number: u8) -> Result<Protocol, Malformed> {
    // IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP (netinet/in.h).
    match number {
        6 => Ok(Protocol::Tcp),
        17 => Ok(Protocol::Udp),
        132 => Ok(Protocol::Sctp),
        n => Err(format!("IP protocol {n} is not one Kubernetes uses")),
    }
}

fn ip_number(ip: IpAddr) -> (u128, u8) {
    match ip {
        IpAddr::V4(a) => (u128::from(u32::from(a)), 32),
        IpAddr::V6(a) => (u128::from(a), 128),
    }
}

fn ip_from_number(n: u128, bits: u8) -> IpAddr {
    if bits == 32 {
        IpAddr::V4(Ipv4Addr::from(n as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(n))
    }
}

/// The network spanning exactly `lo..=hi` (numbers of a `bits`-bit address), if there is one.
fn range_net(lo: u128, hi: u128, bits: u8) -> Option<IpNet> {
    let prefix = match hi.checked_sub(lo)?.checked_add(1) {
        // The whole IPv6 space: 2^128 addresses do not fit a u128.
        None => 0,
        Some(size) if size.is_power_of_two() && lo.is_multiple_of(size) => {
            bits.checked_sub(size.trailing_zeros() as u8)?
        }
        Some(_) => return None,
    };
    IpNet::new(ip_from_number(lo, bits), prefix).ok()
}

/// Turns one set's element dump into keys and values.
struct SetDecoder<'s> {
    family: IpFamily,
    schema: &'s SetSchema,
    set: String,
    /// Interval bounds of a single-field interval set: (address, is the exclusive end).
    bounds: Vec<(u128, bool)>,
    /// Sorted into a map at the end: cheaper than inserting one by one.
    elements: Vec<(Tuple, Option<Tuple>)>,
    /// Scratch space for one element's components, reused.
    key: Vec<Atom>,
    key_end: Vec<Atom>,
    value: Vec<Atom>,
}

impl<'s> SetDecoder<'s> {
    /// Checks that the kernel's declaration of `set` matches `schema` before reading a byte.
    fn new(set: &SetInfo, family: IpFamily, schema: &'s SetSchema) -> Result<Self, Malformed> {
        let mismatch = |what: &str, kernel: String, schema: String| {
            Err(format!(
                "the kernel's {what} is {kernel}, the schema's {schema}"
            ))
        };
        let key_len = total_len(&schema.key, family);
        if set.key_len as usize != key_len {
            return mismatch("key length", set.key_len.to_string(), key_len.to_string());
        }
        let interval = set.flags & NFT_SET_INTERVAL != 0;
        if interval != schema.interval {
            return mismatch(
                "interval flag",
                interval.to_string(),
                schema.interval.to_string(),
            );
        }
        let map = set.flags & NFT_SET_MAP != 0;
        let verdicts = set.data_type == Some(NFT_DATA_VERDICT);
        let want_map = schema.verdict_map || schema.value.is_some();
        if map != want_map || (map && verdicts != schema.verdict_map) {
            let describe = |map: bool, verdicts: bool| match (map, verdicts) {
                (false, _) => "a set",
                (true, true) => "a verdict map",
                (true, false) => "a data map",
            };
            return mismatch(
                "kind",
                describe(map, verdicts).into(),
                describe(want_map, schema.verdict_map).into(),
            );
        }
        if let (Some(value), Some(len)) = (&schema.value, set.data_len) {
            let want = total_len(value, family);
            if len as usize != want {
                return mismatch("value length", len.to_string(), want.to_string());
            }
        }
        if interval && schema.value.is_some() {
            return Err("interval maps are not supported".into());
        }
        Ok(SetDecoder {
            family,
            schema,
            set: set.name.clone(),
            bounds: Vec::new(),
            elements: Vec::new(),
            key: Vec::new(),
            key_end: Vec::new(),
            value: Vec::new(),
        })
    }

    /// One `NFT_MSG_NEWSETELEM` reply of the dump.
    fn message(&mut self, body: &[u8]) -> Result<(), Malformed> {
        let a: [Option<&[u8]>; 4] = attr_table(body)?;
        let set = str_attr(a[usize::from(NFTA_SET_ELEM_LIST_SET)], "element's set")?;
        if set != self.set {
            return Err(format!("asked for set {}, got {set}", self.set));
        }
        let Some(list) = a[usize::from(NFTA_SET_ELEM_LIST_ELEMENTS)] else {
            return Ok(());
        };
        for e in Attrs(list) {
            let (kind, element) = e?;
            if kind == NFTA_LIST_ELEM {
                self.element(element)?;
            }
        }
        Ok(())
    }

    fn element(&mut self, element: &[u8]) -> Result<(), Malformed> {
        let a: [Option<&[u8]>; 11] = attr_table(element)?;
        let flags = match a[usize::from(NFTA_SET_ELEM_FLAGS)] {
            Some(p) => be32(Some(p), "element flags")?,
            None => 0,
        };
        if flags & NFT_SET_ELEM_CATCHALL != 0 {
            return Err("a catch-all element, which the planner never adds".into());
        }
        self.key.clear();
        let key = data_value(a[usize::from(NFTA_SET_ELEM_KEY)], "element key")?;
        decode_fields(&self.schema.key, self.family, key, &mut self.key)?;
        if let Some(end) = a[usize::from(NFTA_SET_ELEM_KEY_END)] {
            // A concatenated interval (nft's pipapo): one element holds the first and the last
            // key of a range in every field; equal ends are a single value.
            self.key_end.clear();
            let end = data_value(Some(end), "element key end")?;
            decode_fields(&self.schema.key, self.family, end, &mut self.key_end)?;
            for (lo, hi) in self.key.iter_mut().zip(&self.key_end) {
                match (*lo, *hi) {
                    (l, h) if l == h => {}
                    (Atom::Ip(l), Atom::Ip(h)) => {
                        let ((l, bits), (h, _)) = (ip_number(l), ip_number(h));
                        *lo = Atom::Net(range_net(l, h, bits).ok_or_else(|| {
                            format!(
                                "range {}-{} is not a network",
                                ip_from_number(l, bits),
                                ip_from_number(h, bits)
                            )
                        })?);
                    }
                    (l, h) => return Err(format!("range {l}-{h} is not one of addresses")),
                }
            }
        } else if self.schema.interval {
            // A single-field interval (nft's rbtree): starts and exclusive ends arrive as
            // separate elements, in no order we rely on; `finish` pairs them.
            return match self.key.as_slice() {
                [Atom::Ip(ip)] => {
                    let end = flags & NFT_SET_ELEM_INTERVAL_END != 0;
                    self.bounds.push((ip_number(*ip).0, end));
                    Ok(())
                }
                _ => Err("an interval element without an end key".into()),
            };
        }
        let value = self.value(a[usize::from(NFTA_SET_ELEM_DATA)])?;
        let key = canonical_tuple(&mut self.key);
        self.elements.push((key, value));
        Ok(())
    }

    fn value(&mut self, data: Option<&[u8]>) -> Result<Option<Tuple>, Malformed> {
        if self.schema.verdict_map {
            let d: [Option<&[u8]>; 3] =
                attr_table(data.ok_or("a verdict map element without a value")?)?;
            let v: [Option<&[u8]>; 3] = attr_table(
                d[usize::from(NFTA_DATA_VERDICT)]
                    .ok_or("a verdict map element without a verdict")?,
            )?;
            let code = be32(v[usize::from(NFTA_VERDICT_CODE)], "verdict code")? as i32;
            let chain = v[usize::from(NFTA_VERDICT_CHAIN)]
                .map(|c| str_attr(Some(c), "verdict chain"))
                .transpose()?;
            let verdict = match (code, chain) {
                (NF_DROP, _) => NoEndpointVerdict::Drop,
                (NFT_GOTO, Some(REJECT_PACKET)) => NoEndpointVerdict::Reject,
                (code, chain) => {
                    return Err(format!(
                        "verdict {code} (chain {chain:?}) is neither drop nor goto {REJECT_PACKET}"
                    ))
                }
            };
            return Ok(Some(Tuple::new([Atom::Verdict(verdict)])));
        }
        match (&self.schema.value, data) {
            (None, None) => Ok(None),
            (Some(kinds), Some(_)) => {
                self.value.clear();
                let bytes = data_value(data, "element value")?;
                decode_fields(kinds, self.family, bytes, &mut self.value)?;
                Ok(Some(canonical_tuple(&mut self.value)))
            }
            (None, Some(_)) => Err("an element with a value in a set".into()),
            (Some(_), None) => Err("a map element without a value".into()),
        }
    }

    /// The elements; pairs the bounds of a single-field interval set into networks.
    fn finish(mut self) -> Result<BTreeMap<Tuple, Option<Tuple>>, Malformed> {
        let bits = match self.family {
            IpFamily::V4 => 32,
            IpFamily::V6 => 128,
        };
        let max = u128::MAX >> (128 - u32::from(bits));
        // Ends sort before starts at the same address: `[a, b)` followed by `[b, c)` holds both
        // an end and a start at b.
        self.bounds.sort_unstable_by_key(|&(at, end)| (at, !end));
        let mut open = None;
        let mut ranges = Vec::new();
        for &(at, end) in &self.bounds {
            match (open, end) {
                // nft marks the gap below the first interval with an end at address zero.
                (None, true) => {}
                (None, false) => open = Some(at),
                (Some(lo), true) => {
                    ranges.push((lo, at - 1));
                    open = None;
                }
                (Some(lo), false) => {
                    return Err(format!(
                        "intervals start at {} and {} with no end between",
                        ip_from_number(lo, bits),
                        ip_from_number(at, bits)
                    ))
                }
            }
        }
        // nft leaves out the end of an interval that reaches the top of the address space.
        if let Some(lo) = open {
            ranges.push((lo, max));
        }
        for (lo, hi) in ranges {
            let net = range_net(lo, hi, bits).ok_or_else(|| {
                format!(
                    "interval {}-{} is not a network",
                    ip_from_number(lo, bits),
                    ip_from_number(hi, bits)
                )
            })?;
            let key = canonical_tuple(&mut [Atom::Net(net)]);
            self.elements.push((key, None));
        }
        Ok(self.elements.into_iter().collect())
    }
}

/// The bytes of a `struct nft_data` attribute holding a value (`NFTA_DATA_VALUE`).
fn data_value<'a>(data: Option<&'a [u8]>, what: &str) -> Result<&'a [u8], Malformed> {
    let data = data.ok_or_else(|| format!("{what} missing"))?;
    let d: [Option<&[u8]>; 2] = attr_table(data)?;
    d[usize::from(NFTA_DATA_VALUE)].ok_or_else(|| format!("{what} is not a value"))
}
