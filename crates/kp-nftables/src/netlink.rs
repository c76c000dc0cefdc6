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
//! ([`table_exists`]) and which ruleset generation the kernel is at ([`generation`]); everything
//! else is a `GET`. Message layouts are the kernel UAPI's (`linux/netfilter/nf_tables.h`);
//! constants keep their kernel names. The socket (opened inside the named namespace), framing,
//! dumps, batches and the kernel's errno are `kp-netlink`'s; this module says what to ask and
//! how to read the answers. The one layout that is nft's and not the kernel's is the rule
//! comment, which nft keeps in the rule's opaque user data (a TLV record of type 0,
//! `NFTNL_UDATA_RULE_COMMENT`).
//!
//! Cost: the kernel sends a dump in 32 KiB datagrams (about 730 endpoint-map elements each) and
//! resumes each one by walking the set from its start, so one set's dump grows with the square of
//! its size. At 10k Services × 10 endpoints the 114k-element `vips-10-endpoints` map took
//! 0.3-0.45 s to dump (`rhashtable_walk_next` a third of all samples), at 30k Services 5 s. So a
//! large endpoint map is read by lookups instead: its keys are `entry . slot` for the entries of
//! its class set (read first) and the slots below its endpoint count, and when the kernel's count
//! of its elements (`NFTA_SET_COUNT`, Linux 6.16 and later) equals the number found, nothing
//! else is there (`Conn::class_endpoints`; otherwise, or on older kernels, it is dumped). Lookups
//! cost the same per element whatever the map's size: 0.3 s for those 114k elements (a datagram
//! per answer), 0.9 s for the 345k at 30k Services.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};
use kp_netlink::abi::{
    NFGENMSG_LEN, NFNL_SUBSYS_NFTABLES, NFPROTO_UNSPEC, NLA_F_NESTED, NLM_F_ACK, NLM_F_DUMP,
};
use kp_netlink::attr::{self, cstr};
use kp_netlink::socket::Error as SocketError;
use kp_netlink::{message, nfnl, KernelError, Protocol as NetlinkProtocol, Socket};
use kp_nftables_plan::element::{Atom, ElementDigest, NoEndpointVerdict, Tuple};
use kp_nftables_plan::names::{REJECT_PACKET, TABLE};
use kp_nftables_plan::SetId;

use crate::{DigestTable, Error, KernelTable};

#[cfg(test)]
mod tests;

use kp_nftables_plan::netlink::abi::*;

/// nft's (libnftnl's) user-data record type for a rule comment: `type u8, len u8, value`, the
/// value NUL-terminated. A userspace convention: the kernel stores the bytes without reading them.
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;

/// nft's (libnftnl's) user-data record type for a table comment (`NFTNL_UDATA_TABLE_COMMENT`),
/// laid out as a rule comment is.
const NFTNL_UDATA_TABLE_COMMENT: u8 = 0;

/// What [`parse_table`](crate::parse_table) reports for a rule without comment.
const NO_COMMENT: &str = "<rule without comment>";

/// Endpoint maps smaller than this are dumped: a dump of a few thousand elements costs
/// milliseconds, and fewer requests.
const GET_INSTEAD_OF_DUMP: u32 = 4096;

/// Keys per lookup request: the answers (a datagram each, a few KiB of receive buffer) must fit
/// the receive buffer together.
const GET_CHUNK: usize = 512;

/// How often a read is made before giving up when the ruleset changes while it is being read,
/// or a set's dump disagrees with the set's element count.
const ATTEMPTS: u32 = 5;

/// Waits before read `attempt` (from 2): 10, 20, 40, 80 ms, time for a resize of a set's hash
/// table (the kernel's worker runs it a while after many additions) to finish.
fn before_attempt(attempt: u32) {
    if attempt > 1 {
        std::thread::sleep(std::time::Duration::from_millis(10 << (attempt - 2)));
    }
}

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
/// kernel flagging a dump as interrupted, or an object vanishing between two dumps), or a set's
/// dump holds fewer distinct elements than the kernel counts in it (its hash table was resized
/// while dumped), it starts over after a short wait, up to five reads in all.
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
    let t = read_table_as::<Tuples>(family, netns, schema)?;
    Ok(KernelTable {
        chains: t.chains,
        sets: t.sets,
        comment: t.comment,
    })
}

/// Reads the table as [`read_table`] does, with the same checks and retries, but keeps of each
/// element only its digests ([`ElementDigest`], 16 bytes), each set's sorted by key digest: what
/// the periodic drift check compares with the plan. At 10k Services × 10 endpoints the tuples of
/// [`read_table`] are about 40 MB of heap; the digests of the same 133k elements 2 MB.
///
/// The class sets whose endpoint maps are read by lookups are decoded as tuples first (their
/// keys make the lookups' keys; about a tenth of the endpoint maps' elements), then digested.
pub fn read_table_digests(
    family: IpFamily,
    netns: Option<&str>,
    schema: &dyn Fn(&str) -> Option<SetSchema>,
) -> Result<DigestTable, Error> {
    let t = read_table_as::<Digests>(family, netns, schema)?;
    Ok(DigestTable {
        chains: t.chains,
        sets: t.sets,
        comment: t.comment,
    })
}

/// A table as read: chains, the comment, and each set's elements as `C` keeps them.
struct Read<S> {
    chains: BTreeMap<String, Vec<String>>,
    sets: BTreeMap<String, S>,
    comment: Option<String>,
}

fn read_table_as<C: Collect>(
    family: IpFamily,
    netns: Option<&str>,
    schema: &dyn Fn(&str) -> Option<SetSchema>,
) -> Result<Read<C::Set>, Error> {
    let mut conn = Conn::open(netns)?;
    for attempt in 1..=ATTEMPTS {
        before_attempt(attempt);
        let before = conn.generation()?;
        let read = conn.read_table::<C>(family, schema);
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
        format!(
            "the ruleset changed (or a set's dump disagreed with its count) during each of \
             {ATTEMPTS} reads"
        ),
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

/// The ruleset generation of the named network namespace (or the current one): the kernel
/// changes it with every committed nftables transaction, ours or anyone's, in any table. The
/// same generation at two moments means nothing changed in between.
pub fn generation(netns: Option<&str>) -> Result<u32, Error> {
    Session::open(netns)?.generation()
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

    /// See [`generation`].
    pub fn generation(&mut self) -> Result<u32, Error> {
        self.conn.generation()
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
        Err(e) if not_found(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let Some(set) = sets.iter().find(|s| s.name == name) else {
        return Ok(None);
    };
    // A dump that disagrees with the set's count is read again; the last is kept.
    let mut attempt = 1;
    loop {
        match conn.elements::<Tuples>(family, set, schema) {
            Ok((elements, complete)) if complete || attempt == ATTEMPTS => {
                return Ok(Some(elements))
            }
            Ok(_) => {}
            Err(e) if not_found(&e) => return Ok(None),
            Err(e) => return Err(e),
        }
        attempt += 1;
        before_attempt(attempt);
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
        Err(e) if not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
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
    match conn.socket.send_batch(&batch.bytes, batch.ack_seq) {
        Ok(()) => Ok(()),
        Err(SocketError::Kernel { seq: 0, error }) => Err(Error::Netlink {
            op: what,
            detail: format!("the batch was refused: {}", errno_message(error, None)),
            errno: Some(error),
        }),
        Err(SocketError::Kernel { seq, error }) => Err(Error::Netlink {
            op: what,
            detail: format!(
                "message {seq} of {} was refused, so nothing was applied: {}",
                batch.messages,
                errno_message(
                    error,
                    error.is_not_found().then_some("set or element missing")
                )
            ),
            errno: Some(error),
        }),
        Err(e) => Err(socket_error(&what, e, None)),
    }
}

fn family_name(family: IpFamily) -> &'static str {
    kp_nftables_plan::names::family(family)
}

fn list_error(op: String, detail: String) -> Error {
    Error::Netlink {
        op,
        detail,
        errno: None,
    }
}

/// Whether the kernel answered a request with `ENOENT` (a table, set or element missing).
fn not_found(e: &Error) -> bool {
    matches!(e, Error::Netlink { errno: Some(k), .. } if k.is_not_found())
}

/// A reply that does not have the expected shape; `what` names the request.
fn parse_error(what: &str, detail: String) -> Error {
    Error::Parse(format!("{what}: {detail}"))
}

/// What is wrong with a reply, before it is known which request it answered.
type Malformed = String;

/// `netlink error -ENOENT (No such file or directory)`, with `hint` instead of the generic
/// description when there is one.
fn errno_message(error: KernelError, hint: Option<&str>) -> String {
    let desc = hint.map_or_else(|| error.description(), str::to_string);
    format!("netlink error -{} ({desc})", error.errno_label())
}

/// The socket layer's error as this crate reports it: `what` names the request, `enoent`
/// explains ENOENT.
fn socket_error(what: &str, e: SocketError, enoent: Option<&str>) -> Error {
    match e {
        SocketError::Kernel { error, .. } => Error::Netlink {
            op: what.to_string(),
            detail: errno_message(error, enoent.filter(|_| error.is_not_found())),
            errno: Some(error),
        },
        SocketError::Malformed(m) => parse_error(what, m.0),
        e @ SocketError::Truncated { .. } => parse_error(what, e.to_string()),
        SocketError::Open {
            location, detail, ..
        } => list_error(format!("netlink socket in {location}"), detail),
        e => list_error(what.to_string(), e.to_string()),
    }
}

/// A NETLINK_NETFILTER socket.
struct Conn {
    socket: Socket,
}

/// What the kernel says about one set of our table.
#[derive(Debug)]
struct SetInfo {
    name: String,
    flags: u32,
    key_len: u32,
    data_type: Option<u32>,
    data_len: Option<u32>,
    /// How many elements it holds, from kernels that say (6.16 and later).
    count: Option<u32>,
}

impl Conn {
    fn open(netns: Option<&str>) -> Result<Conn, Error> {
        let socket = Socket::open(NetlinkProtocol::Netfilter, netns)
            .map_err(|e| socket_error("netlink socket", e, None))?;
        Ok(Conn { socket })
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
    fn read_table<C: Collect>(
        &mut self,
        family: IpFamily,
        schema: &dyn Fn(&str) -> Option<SetSchema>,
    ) -> Result<(Read<C::Set>, bool), Error> {
        let fam = nfproto(family);
        let fam_name = family_name(family);
        let table_attr = cstr(TABLE);
        let mut complete = true;

        // The table itself: a missing table is an error, not an empty listing.
        let mut comment = None;
        self.request(
            NFT_MSG_GETTABLE,
            NLM_F_ACK,
            fam,
            &[(NFTA_TABLE_NAME, &table_attr)],
            &format!("netlink list table {fam_name} {TABLE}"),
            Some("table missing"),
            |body| {
                let a: [Option<&[u8]>; 7] = attr_table(body)?;
                comment = a[usize::from(NFTA_TABLE_USERDATA)]
                    .and_then(|u| udata_string(u, NFTNL_UDATA_TABLE_COMMENT))
                    .map(str::to_string);
                Ok(())
            },
        )?;

        let mut t = Read {
            comment,
            chains: BTreeMap::new(),
            sets: BTreeMap::new(),
        };
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
        // Endpoint maps last: their keys can be asked for once their class sets are known.
        let (endpoint_maps, others): (Vec<SetInfo>, Vec<SetInfo>) = sets
            .into_iter()
            .filter(|s| s.flags & NFT_SET_ANONYMOUS == 0)
            .partition(|s| matches!(SetId::from_name(&s.name), Some(SetId::ClassEndpoints(..))));
        // The keys of the class sets whose endpoint maps will be read by lookups, by the
        // endpoint map's name.
        let looked_up: Vec<String> = endpoint_maps
            .iter()
            .filter(|m| m.count.is_some_and(|c| c >= GET_INSTEAD_OF_DUMP))
            .map(|m| m.name.clone())
            .collect();
        let mut class_keys: BTreeMap<String, Vec<Tuple>> = BTreeMap::new();
        for set in others.into_iter().chain(endpoint_maps) {
            let Some(schema) = schema(&set.name) else {
                t.sets.insert(set.name, C::empty());
                continue;
            };
            let id = SetId::from_name(&set.name);
            if let Some(SetId::Class(route, n)) = id {
                let map = SetId::ClassEndpoints(route, n).name();
                if looked_up.contains(&map) {
                    let (elements, set_complete) =
                        self.elements::<Tuples>(family, &set, &schema)?;
                    complete &= set_complete;
                    class_keys.insert(map, elements.keys().cloned().collect());
                    t.sets.insert(set.name, C::of_tuples(elements));
                    continue;
                }
            }
            let keys = class_keys.remove(&set.name);
            if let Some(elements) = self.class_endpoints::<C>(family, &set, &schema, keys)? {
                t.sets.insert(set.name, elements);
                continue;
            }
            let (elements, set_complete) = self.elements::<C>(family, &set, &schema)?;
            complete &= set_complete;
            t.sets.insert(set.name, elements);
        }
        Ok((t, complete))
    }

    /// An endpoint map read by asking for its elements one by one instead of dumping it, when
    /// that is certain to find them all; `None` when it is not (dump it then).
    ///
    /// Why: the kernel resumes a dump by walking the set from its start for every 32 KiB
    /// datagram, so dumping one set costs the square of its size (0.3 s for the 115k elements
    /// of `vips-10-endpoints` at 10k Services, 5 s at 30k). Every element the proxy puts in the
    /// map `X-N-endpoints` is `key . slot` for a key of the class set `X-N` (read before) and a
    /// slot below N, so asking for those finds every element the map holds as long as the
    /// kernel's count of its elements (`NFTA_SET_COUNT`, Linux 6.16 and later) says nothing else
    /// is there. Lookups cost the same whatever the map's size.
    /// `class` is the keys of the map's class set, as read before.
    fn class_endpoints<C: Collect>(
        &mut self,
        family: IpFamily,
        set: &SetInfo,
        schema: &SetSchema,
        class: Option<Vec<Tuple>>,
    ) -> Result<Option<C::Set>, Error> {
        let (Some(id @ SetId::ClassEndpoints(_, n)), Some(count)) =
            (SetId::from_name(&set.name), set.count)
        else {
            return Ok(None);
        };
        if *schema != SetSchema::of(id) || count < GET_INSTEAD_OF_DUMP || n == 0 {
            return Ok(None);
        }
        let Some(class) = class else {
            return Ok(None);
        };
        // The candidates are `entry . slot` for every entry and slot, made a chunk at a time:
        // key `i` is entry `i / n`, slot `i % n`.
        let candidates = class.len() * n as usize;
        let key = |i: usize| {
            let mut k = class[i / n as usize].atoms().to_vec();
            k.push(Atom::Slot((i % n as usize) as u32));
            k
        };
        // Fewer candidates than elements: some element is of no entry, so only a dump finds it.
        if candidates < count as usize {
            return Ok(None);
        }
        let what = format!(
            "netlink get elements {} {TABLE} {}",
            family_name(family),
            set.name
        );
        let mut decoder =
            SetDecoder::<C>::checked(set, family, schema).map_err(|e| parse_error(&what, e))?;
        // Each answer is a datagram of its own, queued until read: room for a request's worth.
        let _ = self.socket.force_receive_buffer(8 * 1024 * 1024);
        let allowed_misses = candidates - count as usize;
        let mut misses = 0;
        let mut at = 0;
        let mut chunk = Vec::with_capacity(GET_CHUNK);
        while at < candidates {
            chunk.clear();
            chunk.extend((at..(at + GET_CHUNK).min(candidates)).map(key));
            let payload =
                kp_nftables_plan::netlink::encode_keys(family, id, chunk.iter().map(Vec::as_slice))
                    .map_err(|e| parse_error(&what, e))?;
            let before = decoder.out.len();
            let r = self.request(
                NFT_MSG_GETSETELEM,
                NLM_F_ACK,
                nfproto(family),
                &[
                    (NFTA_SET_ELEM_LIST_TABLE, &cstr(TABLE)),
                    (NFTA_SET_ELEM_LIST_SET, &cstr(&set.name)),
                    (NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED, &payload),
                ],
                &what,
                Some("element or set missing"),
                |body| decoder.message(body),
            );
            match r {
                Ok(_) => at += chunk.len(),
                // The kernel answered the keys before the first it lacks, then stopped.
                Err(e) if not_found(&e) => {
                    at += decoder.out.len() - before + 1;
                    misses += 1;
                    // More keys missing than the count allows: something else is going on
                    // (the set went away, say). A dump settles it.
                    if misses > allowed_misses {
                        return Ok(None);
                    }
                }
                // Out of receive buffer, or a kernel that cannot look elements up: dump.
                Err(Error::Netlink { .. }) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        let found = decoder.out.len();
        let elements = decoder.finish().map_err(|e| parse_error(&what, e))?;
        Ok((found == count as usize).then_some(elements))
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
                let a: [Option<&[u8]>; 21] = attr_table(body)?;
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
                    count: optional(NFTA_SET_COUNT, "set element count")?,
                    name,
                });
                Ok(())
            },
        )?;
        Ok((sets, complete))
    }

    /// One set's elements; the flag is false if the dump was interrupted.
    fn elements<C: Collect>(
        &mut self,
        family: IpFamily,
        set: &SetInfo,
        schema: &SetSchema,
    ) -> Result<(C::Set, bool), Error> {
        let what = format!(
            "netlink list set {} {TABLE} {}",
            family_name(family),
            set.name
        );
        let mut decoder =
            SetDecoder::<C>::checked(set, family, schema).map_err(|e| parse_error(&what, e))?;
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
        // A hash set's dump is resumed by position for each datagram, so when the kernel
        // resizes the set's table while it is dumped (it grows it a while after many
        // additions) an element can be skipped and another sent twice, with no interrupted
        // flag. The kernel's count of the set's elements tells: fewer distinct elements read
        // than it holds means some were skipped. (Interval sets count their bounds.)
        let consistent = match set.count {
            Some(count) if set.flags & NFT_SET_INTERVAL == 0 => {
                let read = C::distinct(&elements);
                if read != count as usize {
                    tracing::debug!(
                        set = %set.name,
                        read,
                        count,
                        "a set's dump disagrees with its element count (resized while dumped?)"
                    );
                }
                read == count as usize
            }
            _ => true,
        };
        Ok((elements, complete && consistent))
    }

    /// Sends one request and hands the body (after `struct nfgenmsg`) of each nf_tables reply
    /// to `on_reply`, until the request is answered in full: `NLMSG_DONE` for a dump, the
    /// acknowledgement for a request with `NLM_F_ACK`. Returns false if the kernel flagged a
    /// dump as interrupted by a ruleset change. `what` names the request in errors; `enoent`
    /// explains ENOENT.
    #[allow(clippy::too_many_arguments)] // Private; each argument is one part of the request.
    fn request(
        &mut self,
        msg: u8,
        flags: u16,
        family: u8,
        attrs: &[(u16, &[u8])],
        what: &str,
        enoent: Option<&str>,
        mut on_reply: impl FnMut(&[u8]) -> Result<(), Malformed>,
    ) -> Result<bool, Error> {
        self.socket
            .request(
                |buf, seq| encode_request(buf, msg, flags, seq, family, attrs),
                |m| reply_body(m).and_then(|body| on_reply(body).map_err(kp_netlink::Malformed)),
            )
            .map(|answered| !answered.dump_interrupted)
            .map_err(|e| socket_error(what, e, enoent))
    }
}

/// The body (after `struct nfgenmsg`) of an nf_tables reply; any other message is an error.
fn reply_body<'a>(m: &message::Message<'a>) -> Result<&'a [u8], kp_netlink::Malformed> {
    if nfnl::subsys(m.kind()) != NFNL_SUBSYS_NFTABLES {
        return Err(kp_netlink::Malformed(format!(
            "unexpected message type {:#x}",
            m.kind()
        )));
    }
    m.payload
        .get(NFGENMSG_LEN..)
        .ok_or_else(|| "a reply without nfgenmsg".into())
}

/// Appends an nf_tables request: `nlmsghdr` (with `NLM_F_REQUEST`), `nfgenmsg`, attributes.
fn encode_request(
    buf: &mut Vec<u8>,
    msg: u8,
    flags: u16,
    seq: u32,
    family: u8,
    attrs: &[(u16, &[u8])],
) {
    let m = nfnl::begin(buf, NFNL_SUBSYS_NFTABLES, msg, flags, seq, family);
    for (kind, payload) in attrs {
        attr::put(buf, *kind, payload);
    }
    message::end(buf, m);
}

/// The attributes of `data` indexed by type; types beyond `N - 1` are ignored (newer kernels
/// add attributes; we read only the ones we know).
fn attr_table<const N: usize>(data: &[u8]) -> Result<[Option<&[u8]>; N], Malformed> {
    Ok(attr::table(data)?)
}

fn be32(payload: Option<&[u8]>, what: &str) -> Result<u32, Malformed> {
    Ok(attr::be32(payload, what)?)
}

/// A string attribute, without its terminating NUL.
fn str_attr<'a>(payload: Option<&'a [u8]>, what: &str) -> Result<&'a str, Malformed> {
    Ok(attr::str(payload, what)?)
}

/// The comment in a rule's user data (nft's TLV records; see [`NFTNL_UDATA_RULE_COMMENT`]).
fn rule_comment(udata: &[u8]) -> Option<&str> {
    udata_string(udata, NFTNL_UDATA_RULE_COMMENT)
}

/// The string record of type `wanted` in nft's user data (TLV records: `type u8, len u8,
/// value`, the value NUL-terminated).
fn udata_string(udata: &[u8], wanted: u8) -> Option<&str> {
    let mut rest = udata;
    while let [kind, len, tail @ ..] = rest {
        let value = tail.get(..usize::from(*len))?;
        if *kind == wanted {
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

/// Makes `atoms` canonical in place.
fn canonicalize(atoms: &mut [Atom]) {
    for a in atoms.iter_mut() {
        *a = canonical_atom(*a);
    }
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

/// What a read keeps of each element of a set: [`Tuples`], or only [`Digests`].
trait Collect {
    /// A set's elements as kept.
    type Set;
    fn new() -> Self;
    /// One element, its atoms already canonical.
    fn push(&mut self, key: &[Atom], value: Option<&[Atom]>);
    /// Elements pushed so far.
    fn len(&self) -> usize;
    fn finish(self) -> Self::Set;
    /// How many distinct elements a finished set holds.
    fn distinct(set: &Self::Set) -> usize;
    /// A set read as tuples, kept as this collector keeps sets.
    fn of_tuples(set: BTreeMap<Tuple, Option<Tuple>>) -> Self::Set;
    /// A set whose elements were not read.
    fn empty() -> Self::Set;
}

/// Keys and values as tuples.
struct Tuples(Vec<(Tuple, Option<Tuple>)>);

impl Collect for Tuples {
    type Set = BTreeMap<Tuple, Option<Tuple>>;

    fn new() -> Self {
        Tuples(Vec::new())
    }

    fn push(&mut self, key: &[Atom], value: Option<&[Atom]>) {
        self.0.push((Tuple::new(key), value.map(Tuple::new)));
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    /// Sorted into a map at the end: cheaper than inserting one by one.
    fn finish(self) -> Self::Set {
        self.0.into_iter().collect()
    }

    fn distinct(set: &Self::Set) -> usize {
        set.len()
    }

    fn of_tuples(set: BTreeMap<Tuple, Option<Tuple>>) -> Self::Set {
        set
    }

    fn empty() -> Self::Set {
        BTreeMap::new()
    }
}

/// Only each element's digests, sorted by key digest at the end.
struct Digests(Vec<ElementDigest>);

impl Collect for Digests {
    type Set = Vec<ElementDigest>;

    fn new() -> Self {
        Digests(Vec::new())
    }

    fn push(&mut self, key: &[Atom], value: Option<&[Atom]>) {
        self.0.push(ElementDigest::of(key, value));
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    /// Sorted, and an element sent twice (see [`Conn::elements`]) kept once.
    fn finish(mut self) -> Self::Set {
        self.0.sort_unstable();
        self.0.dedup();
        self.0.shrink_to_fit();
        self.0
    }

    fn distinct(set: &Self::Set) -> usize {
        set.len()
    }

    fn of_tuples(set: BTreeMap<Tuple, Option<Tuple>>) -> Self::Set {
        let mut d = Digests(Vec::with_capacity(set.len()));
        for (k, v) in &set {
            d.push(k.atoms(), v.as_ref().map(Tuple::atoms));
        }
        d.finish()
    }

    fn empty() -> Self::Set {
        Vec::new()
    }
}

/// Turns one set's element dump into keys and values, kept as `C` keeps them.
struct SetDecoder<'s, C: Collect = Tuples> {
    family: IpFamily,
    schema: &'s SetSchema,
    set: String,
    /// Interval bounds of a single-field interval set: (address, is the exclusive end).
    bounds: Vec<(u128, bool)>,
    out: C,
    /// Scratch space for one element's components, reused.
    key: Vec<Atom>,
    key_end: Vec<Atom>,
    value: Vec<Atom>,
    /// Whether elements come without values (a deletion's).
    keys_only: bool,
    /// Whether the list's entries may carry any type: nft numbers the entries of a request 1,
    /// 2, 3… (the kernel ignores the number), where a dump's are all `NFTA_LIST_ELEM`.
    numbered: bool,
}

#[cfg(test)]
impl<'s> SetDecoder<'s, Tuples> {
    /// A decoder into tuples: see [`SetDecoder::checked`].
    fn new(set: &SetInfo, family: IpFamily, schema: &'s SetSchema) -> Result<Self, Malformed> {
        Self::checked(set, family, schema)
    }
}

impl<'s, C: Collect> SetDecoder<'s, C> {
    /// Checks that the kernel's declaration of `set` matches `schema` before reading a byte.
    fn checked(set: &SetInfo, family: IpFamily, schema: &'s SetSchema) -> Result<Self, Malformed> {
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
            numbered: false,
            ..SetDecoder::of_schema(&set.name, family, schema, false)
        })
    }

    /// A decoder of `set`'s elements as `schema` lays them out, without the kernel's
    /// declaration to check it against (a request we encoded); `keys_only` for a deletion's.
    fn of_schema(set: &str, family: IpFamily, schema: &'s SetSchema, keys_only: bool) -> Self {
        SetDecoder {
            family,
            schema,
            set: set.to_string(),
            bounds: Vec::new(),
            out: C::new(),
            key: Vec::new(),
            key_end: Vec::new(),
            value: Vec::new(),
            keys_only,
            numbered: true,
        }
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
        for e in attr::attrs(list) {
            let e = e?;
            if e.kind == NFTA_LIST_ELEM || self.numbered {
                self.element(e.payload)?;
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
        let value = match self.keys_only {
            true => false,
            false => self.value(a[usize::from(NFTA_SET_ELEM_DATA)])?,
        };
        canonicalize(&mut self.key);
        canonicalize(&mut self.value);
        self.out.push(&self.key, value.then_some(&self.value[..]));
        Ok(())
    }

    /// Decodes an element's value into `self.value`; false for a set element, which has none.
    fn value(&mut self, data: Option<&[u8]>) -> Result<bool, Malformed> {
        self.value.clear();
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
            self.value.push(Atom::Verdict(verdict));
            return Ok(true);
        }
        match (&self.schema.value, data) {
            (None, None) => Ok(false),
            (Some(kinds), Some(_)) => {
                let bytes = data_value(data, "element value")?;
                decode_fields(kinds, self.family, bytes, &mut self.value)?;
                Ok(true)
            }
            (None, Some(_)) => Err("an element with a value in a set".into()),
            (Some(_), None) => Err("a map element without a value".into()),
        }
    }

    /// The elements; pairs the bounds of a single-field interval set into networks.
    fn finish(mut self) -> Result<C::Set, Malformed> {
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
            let mut key = [Atom::Net(net)];
            canonicalize(&mut key);
            self.out.push(&key, None);
        }
        Ok(self.out.finish())
    }
}

/// The bytes of a `struct nft_data` attribute holding a value (`NFTA_DATA_VALUE`).
fn data_value<'a>(data: Option<&'a [u8]>, what: &str) -> Result<&'a [u8], Malformed> {
    let data = data.ok_or_else(|| format!("{what} missing"))?;
    let d: [Option<&[u8]>; 2] = attr_table(data)?;
    d[usize::from(NFTA_DATA_VALUE)].ok_or_else(|| format!("{what} is not a value"))
}

/// One message of an element batch, decoded: what [`decode_batch`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElementChanges {
    /// The table's family.
    pub family: IpFamily,
    /// The set's name.
    pub set: String,
    /// Whether the message deletes its elements (`NFT_MSG_DELSETELEM`) or adds them.
    pub delete: bool,
    /// The elements, keys and values spelled as the read-back spells them
    /// ([`canonical`](crate::canonical)); no values in a deletion.
    pub elements: BTreeMap<Tuple, Option<Tuple>>,
}

/// Reads an element batch as [`kp_nftables_plan::ElementBatch`] encodes it, back into the
/// element changes it carries, message by message in order: what the kernel would apply. Pure
/// (kp-netlink's framing and the nf_tables ABI); for fakes of the kernel and tests. Elements
/// are decoded as the read-back decodes the kernel's dumps, so a network of a single-field
/// interval set is one element again.
///
/// Errors: [`Error::Parse`] for bytes that are not such a batch (no `BATCH_BEGIN` first or
/// `BATCH_END` last, a message of another kind, a set that is not ours, an element that does not
/// fit its set's schema).
pub fn decode_batch(bytes: &[u8]) -> Result<Vec<ElementChanges>, Error> {
    use kp_netlink::abi::{NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFPROTO_IPV4, NFPROTO_IPV6};
    let what = "element batch";
    let bad = |detail: String| parse_error(what, detail);
    let messages = message::messages(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.0))?;
    match (messages.first(), messages.last()) {
        (Some(first), Some(last))
            if messages.len() >= 2
                && first.kind() == NFNL_MSG_BATCH_BEGIN
                && last.kind() == NFNL_MSG_BATCH_END => {}
        _ => return Err(bad("not framed by BATCH_BEGIN and BATCH_END".into())),
    }
    let mut out = Vec::new();
    for m in &messages[1..messages.len() - 1] {
        if nfnl::subsys(m.kind()) != NFNL_SUBSYS_NFTABLES {
            return Err(bad(format!("message type {:#x}", m.kind())));
        }
        let delete = match (m.kind() & 0xff) as u8 {
            NFT_MSG_NEWSETELEM => false,
            NFT_MSG_DELSETELEM => true,
            other => return Err(bad(format!("nf_tables message {other}"))),
        };
        let (gen, body) = nfnl::NfGenMsg::parse(m.payload).map_err(|e| bad(e.0))?;
        let family = match gen.family {
            NFPROTO_IPV4 => IpFamily::V4,
            NFPROTO_IPV6 => IpFamily::V6,
            other => return Err(bad(format!("protocol family {other}"))),
        };
        let a: [Option<&[u8]>; 4] = attr_table(body).map_err(bad)?;
        let table = str_attr(a[usize::from(NFTA_SET_ELEM_LIST_TABLE)], "table").map_err(bad)?;
        if table != TABLE {
            return Err(bad(format!("table {table}")));
        }
        let set = str_attr(a[usize::from(NFTA_SET_ELEM_LIST_SET)], "set").map_err(bad)?;
        let id = SetId::from_name(set).ok_or_else(|| bad(format!("set {set} is not ours")))?;
        let schema = SetSchema::of(id);
        let mut decoder = SetDecoder::<Tuples>::of_schema(set, family, &schema, delete);
        decoder.message(body).map_err(bad)?;
        let elements = decoder.finish().map_err(bad)?;
        out.push(ElementChanges {
            family,
            set: set.to_string(),
            delete,
            elements,
        });
    }
    Ok(out)
}
