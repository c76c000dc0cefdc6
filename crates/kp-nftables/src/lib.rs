//! The nftables dataplane (`--proxy-mode nftables`): sends the planner's transactions, reads the
//! table back to prove the kernel holds what we planned, and forgets its record after any failure
//! so the next sync rebuilds the table.
//!
//! How a sync reaches the kernel:
//! - a partial sync: the declarations and rules of new endpoint-count or affinity classes (if any;
//!   their sets are empty, so they change nothing yet) with `nft -f -`, then every element change
//!   of the sync, for both families, in one netlink batch ([`netlink::send_batch`]): atomic, so
//!   the kernel never sees a REJECT gone before its DNAT is there;
//! - a full sync when no `kube-proxy` table exists yet (first start on a node): each table as it
//!   is planned, its structure and regular chains' rules with `nft -f -` (the base chains empty,
//!   accepting), its elements in netlink batches of about 1 MiB, then its base chains' jumps
//!   with `nft -f -` (`fill.rs`: no packet sees a half-filled set, and a 10 MB batch is never
//!   resident at the proxy's peak);
//! - a full sync when the table exists (restart, repair after a failure or drift): the table is
//!   read back over netlink and *adopted* ([`Planner::adopt`]) when its structure is the one this
//!   version and configuration make (the layout named in the table's comment, our sets, the rule
//!   ids of its classes in every chain). Then only the element difference between the kernel
//!   and the full plan is sent, like a partial sync: new classes' declarations and rules with
//!   `nft -f -` if the plan needs any, then one netlink batch (empty when nothing changed). The
//!   entries keep the kernel's slot assignment, the dynamic affinity maps keep their entries
//!   (those pointing at endpoints no longer serving are purged), and established connections
//!   and new ones are never without their DNAT. At 10k Services × 10 endpoints an unchanged
//!   restart costs the read-back (most of it looking up the largest endpoint map's elements; see
//!   `README.md`) and sends nothing; [`NftablesDataplane::read_ahead`] takes the read off the
//!   first sync's path;
//! - a family whose table is not adoptable (another layout, e.g. after an upgrade, a rule deleted
//!   behind our back, a set that is not ours) or cannot be read: one atomic `nft -f -`
//!   transaction that deletes and re-creates the table with everything in it, logged at info
//!   with the reason. ClientIP affinity choices are lost with it.
//!
//! The periodic check off the sync loop ([`Dataplane::begin_check`]): the ruleset generation,
//! then every family's table over netlink on a socket of its own, run on the loop's check thread
//! while partial syncs go on. The read keeps of each element only a 64-bit digest of its key
//! and one of its value ([`NftablesBackend::read_digests`]; 2 MB instead of about 40 MB of
//! tuples at 10k Services × 10 endpoints). Every key a partial sync adds or deletes meanwhile is
//! recorded; [`Dataplane::finish_check`] compares the read with the same digests of the
//! planners' elements as they are when it is back (see `check.rs`), leaving those keys out (the
//! kernel acknowledged their batch after the read began), and finds what
//! [`NftablesDataplane::verify`] finds: elements missing, with another value or extra per set,
//! chains and set names. A difference is certain when the ruleset generation is still
//! the one from before the read (nothing was committed since, so the read is the kernel as it
//! is): the planners are invalidated and the loop's full sync rebuilds by adoption, which sends
//! only what differs. Otherwise a commit may have made a dump skip an element, and the loop
//! reads again. A full sync or a failure during the read supersedes the check.
//!
//! nft's text parser is most of the cost of a large load and every `nft` is a process, so the
//! batch is what makes a first sync and a one-endpoint change cheap at scale.
//!
//! Planning (what to send) is `kp-nftables-plan`'s; this crate only talks to the kernel, through
//! [`NftablesBackend`]: [`NftCommand`] is the real kernel, `kp-nftables-test`'s `FakeNftables`
//! the one tests use without root.
//! Mirrors upstream `pkg/proxy/nftables/proxier.go` (`syncProxyRules`, `CleanupLeftovers`).

mod backend;
mod check;
mod fill;
pub mod netlink;
mod readback;
mod runner;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use kp_core::dataplane::{
    CheckOutcome, CheckRead, Dataplane, DataplaneError, KernelRead, Retry, SyncReport,
};
use kp_core::model::IpFamily;
use kp_core::track::{Changes, ProxyState};
use kp_metrics::Metrics;
use kp_nftables_plan::element::{Atom, ElementDigest, Tuple};
use kp_nftables_plan::names::{self, TABLE};
use kp_nftables_plan::planner::{NftText, SplitSink, TransactionSink};
use kp_nftables_plan::{ElementBatch, NodeContext, PlanConfig, Planner, SetId};

pub use backend::{DigestRead, NftablesBackend, ReadAhead};
pub use check::DigestTable;
use check::{SetDifference, Touched};
use fill::FillSink;
pub use kp_core::node::{DetectLocal, NodePortAddresses};
pub use readback::{canonical, compare, parse_table, parse_table_named, KernelTable};
pub use runner::NftCommand;

/// What went wrong talking to the kernel. Every variant is retryable: the next sync is a full
/// rebuild.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `nft` could not be started or fed (not installed, no permission).
    #[error("cannot run nft: {0}")]
    Spawn(std::io::Error),
    /// The kernel or nft refused a transaction; nothing of it was applied.
    #[error("nft transaction failed (exit {status:?}): {stderr}{}", failing_statement.as_ref().map(|s| format!("\n  failing statement: {s}")).unwrap_or_default())]
    Transaction {
        /// nft's exit code.
        status: Option<i32>,
        /// What nft printed.
        stderr: String,
        /// The statement nft pointed at, if it did.
        failing_statement: Option<String>,
    },
    /// A listing failed.
    #[error("nft -j {args} failed: {stderr}")]
    List {
        /// The listing's arguments.
        args: String,
        /// What nft printed.
        stderr: String,
    },
    /// A netlink request failed (the kernel's errno is in `detail`, e.g. `-ENOENT (table
    /// missing)`), or the socket could not be opened.
    #[error("{op} failed: {detail}")]
    Netlink {
        /// What was asked (`netlink list table ip kube-proxy`).
        op: String,
        /// Why it failed.
        detail: String,
        /// The kernel's errno when the kernel refused the request: match on it (`ENOENT`, a
        /// missing table), never on the text.
        errno: Option<kp_netlink::KernelError>,
    },
    /// A listing could not be understood.
    #[error("cannot parse nft output: {0}")]
    Parse(String),
}

impl Error {
    /// Whether retrying can help: an `nft` that is missing or not permitted stays so, and so
    /// does a netlink socket the kernel refuses for want of permission or support.
    pub fn retry(&self) -> Retry {
        match self {
            Error::Spawn(e) => Retry::of_spawn(e),
            Error::Netlink { errno: Some(k), .. } => Retry::of_errno(k.errno),
            _ => Retry::WithBackoff,
        }
    }

    /// The error as the sync loop handles it.
    pub fn into_dataplane(self) -> DataplaneError {
        DataplaneError::new(self.retry(), self)
    }
}

/// The mode's settings.
#[derive(Clone, Debug)]
pub struct NftablesConfig {
    /// Families to program (one table each).
    pub families: Vec<IpFamily>,
    /// `masqueradeBit`.
    pub masquerade_bit: u32,
    /// `masqueradeAll`.
    pub masquerade_all: bool,
    /// detect-local mode.
    pub detect_local: DetectLocal,
    /// Where NodePorts answer.
    pub node_ports: NodePortAddresses,
}

impl Default for NftablesConfig {
    fn default() -> Self {
        NftablesConfig {
            families: IpFamily::ALL.to_vec(),
            masquerade_bit: 14,
            masquerade_all: false,
            detect_local: DetectLocal::None,
            node_ports: NodePortAddresses::Primary,
        }
    }
}

/// The nftables dataplane.
pub struct NftablesDataplane {
    cfg: NftablesConfig,
    planners: Vec<Planner>,
    /// The kernel: [`NftCommand`], or a fake in tests.
    nft: Box<dyn NftablesBackend>,
    metrics: Arc<Metrics>,
    last_transaction: String,
    /// The tables being read ahead of the first sync ([`NftablesDataplane::read_ahead`]): the
    /// ruleset generation from before the read, and every family's table in the planners' order
    /// (an error, a missing table say, kept as the answer).
    ahead: Option<std::thread::JoinHandle<Result<TablesAhead, Error>>>,
    /// Bumped whenever the planners stop describing what a read began against: a rebuild, a
    /// failure, a cleanup. A drift check from an older epoch is superseded.
    epoch: u64,
    /// The drift check whose read is running off the loop, if any.
    check: Option<CheckInFlight>,
}

/// A drift check whose read is running ([`Dataplane::begin_check`]).
struct CheckInFlight {
    epoch: u64,
    touched: Touched,
}

/// What a drift check's read returns: the generation before it and every family's table, its
/// elements as digests.
struct CheckTables(Result<DigestsRead, Error>);

/// What a digest read returns: the generation before it, and each family's table.
type DigestsRead = (u32, Vec<Result<DigestTable, Error>>);

/// A sink that records every element it passes on (see [`Touched`]).
struct Recording<'s> {
    inner: &'s mut dyn TransactionSink,
    touched: &'s mut Touched,
}

impl Recording<'_> {
    fn record(&mut self, family: IpFamily, set: SetId, key: &[Atom]) {
        self.touched
            .entry((family, set))
            .or_default()
            .insert(ElementDigest::key_of(key));
    }
}

impl TransactionSink for Recording<'_> {
    fn statement(&mut self, line: std::fmt::Arguments<'_>) {
        self.inner.statement(line);
    }

    fn base_chain_rule(&mut self, line: std::fmt::Arguments<'_>) {
        self.inner.base_chain_rule(line);
    }

    fn add_element(&mut self, family: IpFamily, set: SetId, key: &[Atom], value: Option<&[Atom]>) {
        self.record(family, set, key);
        self.inner.add_element(family, set, key, value);
    }

    fn delete_element(&mut self, family: IpFamily, set: SetId, key: &[Atom]) {
        self.record(family, set, key);
        self.inner.delete_element(family, set, key);
    }
}

/// What a read ahead returns: the generation before it, and each family's table.
type TablesAhead = (u32, Vec<Result<KernelTable, Error>>);

impl NftablesDataplane {
    /// A dataplane that has programmed nothing yet; the first sync rebuilds the tables. `nft` is
    /// the kernel: an [`NftCommand`], or a fake ([`NftablesBackend`]).
    pub fn new(
        cfg: NftablesConfig,
        nft: impl NftablesBackend + 'static,
        metrics: Arc<Metrics>,
    ) -> Self {
        let planners = cfg
            .families
            .iter()
            .map(|f| {
                Planner::new(PlanConfig {
                    family: *f,
                    masquerade_mark: 1 << cfg.masquerade_bit,
                    masquerade_all: cfg.masquerade_all,
                    detect_local: cfg.detect_local != DetectLocal::None,
                    local_interface: cfg.detect_local.interface(),
                    node_ports_restricted: cfg.node_ports != NodePortAddresses::AllLocal,
                })
            })
            .collect();
        NftablesDataplane {
            cfg,
            planners,
            nft: Box::new(nft),
            metrics,
            last_transaction: String::new(),
            ahead: None,
            epoch: 0,
            check: None,
        }
    }

    /// Starts reading the existing tables in the background, so that the first sync, which
    /// adopts them (see the module docs), does not wait for the read: call it at start-up, before
    /// waiting for the Kubernetes API's initial lists. At 10k Services the read is most of a
    /// restart's first sync (0.3-0.45 s of 0.55-0.65 s on the test machine), and the initial
    /// lists take longer than that.
    ///
    /// The first sync uses what was read only if the kernel's ruleset generation is still the
    /// one from before the read (nothing in the namespace committed an nftables change since);
    /// otherwise it reads again. Does nothing when element changes do not go over netlink, or
    /// after the first sync.
    pub fn read_ahead(&mut self) {
        if !self.nft.netlink_elements()
            || self.ahead.is_some()
            || self.planners.iter().any(Planner::programmed)
        {
            return;
        }
        let families: Vec<IpFamily> = self.planners.iter().map(|p| p.config().family).collect();
        let Some(read) = self.nft.read_ahead(families) else {
            return;
        };
        match std::thread::Builder::new()
            .name("kp-nft-read-ahead".into())
            .spawn(read)
        {
            Ok(h) => self.ahead = Some(h),
            // The first sync reads the tables itself.
            Err(e) => tracing::debug!(error = %e, "cannot start reading the tables ahead"),
        }
    }

    /// The tables read ahead, if there were any and the kernel has not changed since.
    fn take_read_ahead(&mut self) -> Option<Vec<Result<KernelTable, Error>>> {
        let (generation, tables) = match self.ahead.take()?.join() {
            Ok(Ok(ahead)) => ahead,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "reading the tables ahead failed; reading them now");
                return None;
            }
            Err(_) => return None,
        };
        match self.nft.generation() {
            Ok(now) if now == generation => Some(tables),
            Ok(_) => {
                tracing::debug!(
                    "the nftables ruleset changed since it was read ahead; reading it again"
                );
                None
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot ask the ruleset generation; reading the tables again");
                None
            }
        }
    }

    /// The last transaction sent (for tests and debugging): the nft text, followed, when element
    /// changes went over netlink, by a line `# netlink: N element changes in M messages`.
    pub fn last_transaction(&self) -> &str {
        &self.last_transaction
    }

    fn node_context(&self, state: &ProxyState) -> NodeContext {
        NodeContext::resolve(&self.cfg.detect_local, &self.cfg.node_ports, state)
    }

    fn send(&mut self, text: String) -> Result<(), Error> {
        let r = self.nft.run(&text);
        self.last_transaction = text;
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    fn failed(&mut self, e: &Error) {
        self.metrics.nftables_sync_failures.inc();
        tracing::error!(error = %e, "nftables sync failed; the next sync rebuilds the tables");
        self.epoch += 1;
        for p in &mut self.planners {
            p.invalidate();
        }
    }

    /// Sends `text` with nft (if there is any), then `batch` over netlink.
    fn send_split(&mut self, text: String, batch: ElementBatch) -> Result<(), Error> {
        let elements = batch.elements();
        let errors = batch.errors().to_vec();
        let encoded = batch.finish();
        if text.is_empty() {
            self.last_transaction.clear();
        } else {
            self.send(text)?;
        }
        if let Some(b) = &encoded {
            self.last_transaction.push_str(&format!(
                "# netlink: {elements} element changes in {} messages\n",
                b.messages
            ));
        }
        let r = match (errors.first(), &encoded) {
            (Some(e), _) => Err(Error::Netlink {
                op: "encode element batch".into(),
                detail: format!("{e} ({} elements could not be encoded)", errors.len()),
                errno: None,
            }),
            (None, Some(b)) => self.nft.send_batch(b),
            (None, None) => Ok(()),
        };
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    /// Deletes remembered ClientIP affinity choices that point at endpoints no longer serving
    /// their entry, so a client is not pinned to a removed pod until its timeout expires. Reads
    /// and deletes over netlink (with nft when a stand-in program replaces it).
    fn purge_stale_affinity(&mut self) -> Result<usize, Error> {
        // The deletions go as the backend takes element changes: one netlink batch, or nft text.
        let netlink = self.nft.netlink_elements();
        let mut batch = ElementBatch::new();
        let mut split = SplitSink::new(&mut batch);
        let mut script = NftText::new();
        let sink: &mut dyn TransactionSink = if netlink { &mut split } else { &mut script };
        let mut removed = 0;
        for p in &self.planners {
            let family = p.config().family;
            let fam = names::family(family);
            for t in p.affinity_timeouts() {
                let set = SetId::Affinity(t);
                let map = set.name();
                let els = if netlink {
                    let schema = netlink::SetSchema::of(set);
                    match self.nft.read_set(family, &map, &schema)? {
                        Some(els) => els,
                        None => continue,
                    }
                } else {
                    let json = self.nft.list_json(&["list", "map", fam, TABLE, &map])?;
                    match parse_table(&json)?.sets.remove(&map) {
                        Some(els) => els,
                        None => continue,
                    }
                };
                let mut stale = Vec::new();
                for (k, v) in &els {
                    let Some(v) = v else { continue };
                    let (vip, nodeport) = match k.atoms() {
                        [_, daddr, proto, port] => (
                            Tuple::new(vec![*daddr, *proto, *port]),
                            Tuple::new(vec![*proto, *port]),
                        ),
                        _ => continue,
                    };
                    let valid: BTreeSet<Tuple> = p
                        .endpoints_of(&vip)
                        .into_iter()
                        .chain(p.endpoints_of(&nodeport))
                        .map(|t| canonical(&t))
                        .collect();
                    if !valid.contains(&canonical(v)) {
                        stale.push(k);
                    }
                }
                removed += stale.len();
                for k in stale {
                    sink.delete_element(family, set, k.atoms());
                }
            }
        }
        // An entry may expire between listing and deleting; that fails this cleanup only, and
        // the next one catches whatever is left.
        let script = script.into_text();
        drop(split);
        let r = match batch.finish() {
            Some(b) => self.nft.send_batch(&b),
            None if !script.is_empty() => self.nft.run(&script),
            None => Ok(()),
        };
        if let Err(e) = r {
            tracing::debug!(error = %e, "stale affinity cleanup raced with expiry");
            return Ok(0);
        }
        Ok(removed)
    }

    /// A full sync: see the module docs. Returns the operations sent.
    fn rebuild(&mut self, state: &ProxyState, node: &NodeContext) -> Result<usize, Error> {
        self.epoch += 1;
        if !self.nft.netlink_elements() {
            return self.replace(state, node);
        }
        let reads: Vec<Result<KernelTable, Error>> = match self.take_read_ahead() {
            Some(tables) => tables,
            None => self
                .planners
                .iter()
                .map(|p| self.nft.read_table(p.config().family, &adoptable_schema))
                .collect(),
        };
        if reads.iter().all(|r| r.as_ref().is_err_and(table_missing)) {
            // The first start on this node: nothing of ours to keep, so each table goes as it is
            // planned: its structure, its elements in batches, its rules last (`fill.rs`).
            let mut fill = FillSink::new(self.nft.as_mut(), fill::CHUNK_BYTES);
            let mut ops = 0;
            for p in &mut self.planners {
                ops += p.full_into(state, node, &mut fill).operations;
            }
            return match fill.finish() {
                Ok(filled) => {
                    let mut record = filled.scripts.join("");
                    record.push_str(&format!(
                        "# netlink: {} element changes in {} batches, before the rules\n",
                        filled.elements, filled.batches
                    ));
                    self.last_transaction = record;
                    Ok(ops)
                }
                Err(e) => {
                    self.failed(&e);
                    Err(e)
                }
            };
        }
        let mut text = String::new();
        let mut ops = 0;
        let mut batch = ElementBatch::new();
        let mut adopted = Vec::new();
        for (p, read) in self.planners.iter_mut().zip(reads) {
            let family = names::family(p.config().family);
            let reason = match read {
                Ok(kernel) => match p.adopt(state, node, &kernel, &mut batch) {
                    Ok(tx) => {
                        text.push_str(&tx.text);
                        ops += tx.operations;
                        adopted.push((family, tx.operations));
                        continue;
                    }
                    Err(mismatch) => mismatch.to_string(),
                },
                Err(e) if table_missing(&e) => "there is none".to_string(),
                Err(e) => format!("it cannot be read back: {e}"),
            };
            tracing::info!(
                family,
                reason = %reason,
                "replacing the nftables table in one transaction instead of adopting it"
            );
            // Atomic with whatever else the text holds: the table is never half there.
            let tx = p.full(state, node);
            text.push_str(&tx.text);
            ops += tx.operations;
        }
        self.send_split(text, batch)?;
        for (family, operations) in adopted {
            tracing::info!(
                family,
                operations,
                "adopted the existing nftables table: sent only its difference from the plan"
            );
        }
        // Endpoints may have gone while no proxy watched; the affinity choices kept with the
        // adopted table must not pin clients to them.
        self.purge_stale_affinity_logged()?;
        Ok(ops)
    }

    /// All families' tables replaced in one atomic `nft -f -` transaction, elements included.
    fn replace(&mut self, state: &ProxyState, node: &NodeContext) -> Result<usize, Error> {
        let mut text = String::new();
        let mut ops = 0;
        for p in &mut self.planners {
            let tx = p.full(state, node);
            // A full table is megabytes of text: take the first one as it is, not a copy.
            if text.is_empty() {
                text = tx.text;
            } else {
                text.push_str(&tx.text);
            }
            ops += tx.operations;
        }
        self.send(text)?;
        Ok(ops)
    }

    /// [`NftablesDataplane::purge_stale_affinity`] when any family uses affinity, logged.
    fn purge_stale_affinity_logged(&mut self) -> Result<(), Error> {
        if self
            .planners
            .iter()
            .all(|p| p.affinity_timeouts().is_empty())
        {
            return Ok(());
        }
        let n = self.purge_stale_affinity()?;
        if n > 0 {
            tracing::info!(
                entries = n,
                "removed ClientIP affinity entries of removed endpoints"
            );
        }
        Ok(())
    }
}

/// Reads one family's table from the kernel over netlink; falls back to `nft -j list table`
/// (ten times slower at scale) if netlink fails for another reason than a missing table.
fn read_back(nft: &mut dyn NftablesBackend, p: &Planner) -> Result<KernelTable, Error> {
    let family = p.config().family;
    let ids: HashMap<String, SetId> = p.all_sets().into_iter().map(|s| (s.name(), s)).collect();
    let schema = |name: &str| {
        ids.get(name)
            .filter(|id| !id.is_dynamic())
            .map(|id| netlink::SetSchema::of(*id))
    };
    match nft.read_table(family, &schema) {
        Ok(t) => Ok(t),
        Err(e) if table_missing(&e) => Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "netlink read-back failed; reading with nft instead");
            let fam = names::family(family);
            parse_table(&nft.list_json(&["list", "table", fam, TABLE])?)
        }
    }
}

/// Compares one family's table read back from the kernel with its planner: chains and set
/// names first, then each set's elements one by one against the planner's lookup, so the check
/// never holds a second copy of the table. Takes the sets out of `kernel` as it goes. (The
/// periodic check compares digests instead: [`check::compare_family`].)
fn compare_family(p: &Planner, kernel: &mut KernelTable) -> Vec<String> {
    let family = p.config().family;
    let fam = names::family(family);
    for c in kp_nftables_plan::layout::UNORDERED_CHAINS {
        if let Some(v) = kernel.chains.get_mut(*c) {
            v.sort();
        }
    }
    let all_sets = p.all_sets();
    let names = all_sets.iter().map(|s| (s.name(), None)).collect();
    let mut diffs = readback::compare(fam, &p.expected_chains(), &names, kernel);
    for set in all_sets.into_iter().filter(|s| !s.is_dynamic()) {
        let Some(actual) = kernel.sets.remove(&set.name()) else {
            continue;
        };
        diffs.extend(compare_elements(family, p, set, &actual).map(|d| d.line()));
    }
    diffs
}

/// Compares one set read back from the kernel with the plan, element by element: every kernel
/// element must be planned with the same value, and there must be as many as planned.
fn compare_elements(
    family: IpFamily,
    p: &Planner,
    set: SetId,
    actual: &BTreeMap<Tuple, Option<Tuple>>,
) -> Option<SetDifference> {
    let mut matched = 0;
    let mut wrong = 0;
    let mut extra = 0;
    let mut sample = None;
    for (k, v) in actual {
        match p.expected_value(set, k) {
            Some(want) if want.as_ref().map(canonical) == v.as_ref().map(canonical) => matched += 1,
            Some(_) => {
                wrong += 1;
                sample.get_or_insert_with(|| format!(" (e.g. {k} has another value)"));
            }
            None => {
                extra += 1;
                sample.get_or_insert_with(|| format!(" (e.g. extra {k})"));
            }
        }
    }
    let missing = p.expected_len(set).saturating_sub(matched + wrong);
    (wrong + extra + missing > 0).then_some(SetDifference {
        family,
        set,
        missing,
        wrong,
        extra,
        example: sample,
    })
}

/// The schema of a table read to adopt it, over netlink only (the nft listing does not show the
/// table's comment, so it could never be adopted anyway): every set of ours is read but the
/// dynamic affinity maps, which adopting leaves alone.
pub(crate) fn adoptable_schema(name: &str) -> Option<netlink::SetSchema> {
    SetId::from_name(name)
        .filter(|id| !id.is_dynamic())
        .map(netlink::SetSchema::of)
}

/// Whether a read failed because the table does not exist.
fn table_missing(e: &Error) -> bool {
    matches!(e, Error::Netlink { errno: Some(k), .. } if k.is_not_found())
}

/// The mode's operations with their own typed errors (tests match on them); the loop calls
/// them through [`Dataplane`].
impl NftablesDataplane {
    /// See [`Dataplane::sync`].
    pub fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, Error> {
        let node = self.node_context(state);
        let mut rebuild = !self.planners.iter().all(Planner::programmed);
        if full && !rebuild {
            // A periodic full sync: check the kernel still holds what we planned (a netlink
            // read, 0.4 s at 10k Services); rebuild only if something changed behind our back.
            // If the kernel cannot be read, nothing proves the table right: rebuild it.
            let diffs = self.drift();
            if !diffs.is_empty() {
                self.metrics
                    .nftables_readback_mismatches
                    .inc_by(diffs.len() as u64);
                for d in diffs.iter().take(10) {
                    tracing::warn!(difference = %d, "nftables table differs from the plan; rebuilding");
                }
                rebuild = true;
            }
        }
        let ops = if rebuild {
            self.rebuild(state, &node)?
        } else {
            // Every family's changes into one transaction: element changes into one netlink
            // batch when the backend takes them, else all of it as nft text.
            let netlink = self.nft.netlink_elements();
            let mut batch = ElementBatch::new();
            let mut split = SplitSink::new(&mut batch);
            let mut script = NftText::new();
            let sink: &mut dyn TransactionSink = if netlink { &mut split } else { &mut script };
            // While a drift check's read runs, what this sync writes is not drift.
            let mut recording;
            let sink: &mut dyn TransactionSink = match self.check.as_mut() {
                Some(check) => {
                    recording = Recording {
                        inner: sink,
                        touched: &mut check.touched,
                    };
                    &mut recording
                }
                None => sink,
            };
            let mut ops = 0;
            let mut removes_endpoints = false;
            for p in &mut self.planners {
                let w = p.partial_into(state, &changes.services, &node, changes.node_changed, sink);
                ops += w.operations;
                removes_endpoints |= w.removes_endpoints;
            }
            if ops > 0 && netlink {
                let text = split.into_text();
                self.send_split(text, batch)?;
            } else if ops > 0 {
                self.send(script.into_text())?;
            }
            if removes_endpoints {
                self.purge_stale_affinity_logged()?;
            }
            ops
        };
        self.metrics
            .nftables_transaction_statements
            .observe(ops as f64);
        let no_local = self
            .planners
            .iter()
            .map(Planner::no_local_endpoints)
            .fold((0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1)));
        Ok(SyncReport {
            full: rebuild,
            operations: ops,
            no_local_endpoints: no_local,
        })
    }

    /// See [`Dataplane::verify`].
    pub fn verify(&mut self) -> Result<Vec<String>, Error> {
        let mut diffs = Vec::new();
        for p in &self.planners {
            let fam = names::family(p.config().family);
            let mut kernel = match read_back(&mut *self.nft, p) {
                Ok(k) => k,
                Err(e) if table_missing(&e) => {
                    diffs.push(format!("{fam}: table {TABLE} is missing"));
                    continue;
                }
                Err(Error::List { .. }) => {
                    diffs.push(format!("{fam}: table {TABLE} is missing"));
                    continue;
                }
                Err(e) => return Err(e),
            };
            diffs.extend(compare_family(p, &mut kernel));
        }
        Ok(diffs)
    }

    /// See [`Dataplane::cleanup`].
    pub fn cleanup(&mut self) -> Result<(), Error> {
        let mut script = String::new();
        for f in IpFamily::ALL {
            let fam = names::family(f);
            // Adding first makes the delete succeed whether or not the table exists.
            script.push_str(&format!(
                "add table {fam} {TABLE}\ndelete table {fam} {TABLE}\n"
            ));
        }
        let r = self.nft.run(&script);
        if r.is_err() {
            self.metrics.nftables_cleanup_failures.inc();
        }
        self.epoch += 1;
        for p in &mut self.planners {
            p.invalidate();
        }
        r
    }

    /// See [`Dataplane::begin_check`]: `None` (the check stays in line, in the full sync) until
    /// the tables are programmed, or when the backend cannot read them on another thread.
    pub fn begin_check(&mut self) -> Option<KernelRead> {
        if !self.planners.iter().all(Planner::programmed) {
            return None;
        }
        let families = self.planners.iter().map(|p| p.config().family).collect();
        let read = self.nft.read_digests(families)?;
        self.check = Some(CheckInFlight {
            epoch: self.epoch,
            touched: Touched::new(),
        });
        Some(Box::new(move || CheckRead(Box::new(CheckTables(read())))))
    }

    /// See [`Dataplane::finish_check`] and the module docs.
    pub fn finish_check(&mut self, read: CheckRead) -> CheckOutcome {
        let Some(check) = self.check.take() else {
            return CheckOutcome::Superseded;
        };
        if check.epoch != self.epoch || !self.planners.iter().all(Planner::programmed) {
            return CheckOutcome::Superseded;
        }
        let Ok(tables) = read.0.downcast::<CheckTables>() else {
            return self.drift_found(vec!["the drift check read something else".into()]);
        };
        let (generation, tables) = match tables.0 {
            Ok(t) => t,
            Err(e) => {
                return self.drift_found(vec![format!("cannot read the kernel's rules back: {e}")])
            }
        };
        let diffs = self.compare_digests(tables, &check.touched);
        if diffs.is_empty() {
            return CheckOutcome::Clean;
        }
        // Nothing committed since the read began: the read is the kernel as it is now.
        if self.nft.generation().is_ok_and(|g| g == generation) {
            return self.drift_found(diffs);
        }
        CheckOutcome::Unsure(diffs)
    }

    /// Compares every family's table read as digests with its planner (see [`check`]), leaving
    /// out the keys in `touched`; names an example of each set's difference, reading a set
    /// again only when all it has to show is an extra element.
    fn compare_digests(
        &mut self,
        tables: Vec<Result<DigestTable, Error>>,
        touched: &Touched,
    ) -> Vec<String> {
        let mut diffs = Vec::new();
        let mut sets = Vec::new();
        for (p, table) in self.planners.iter().zip(tables) {
            let fam = names::family(p.config().family);
            match table {
                Ok(mut kernel) => {
                    let (lines, differ) = check::compare_family(p, &mut kernel, touched);
                    diffs.extend(lines);
                    sets.extend(differ);
                }
                Err(e) if table_missing(&e) => {
                    diffs.push(format!("{fam}: table {TABLE} is missing"))
                }
                Err(e) => diffs.push(format!("{fam}: cannot read table {TABLE} back: {e}")),
            }
        }
        for mut d in sets {
            if d.example.is_none() && d.extra > 0 {
                d.example = self.extra_example(&d, touched.get(&(d.family, d.set)));
            }
            diffs.push(d.line());
        }
        diffs
    }

    /// Reads set `d.set` again in full to name one of its extra elements (the digests cannot).
    fn extra_example(&mut self, d: &SetDifference, skip: Option<&HashSet<u64>>) -> Option<String> {
        let p = self
            .planners
            .iter()
            .find(|p| p.config().family == d.family)?;
        let schema = netlink::SetSchema::of(d.set);
        match self.nft.read_set(d.family, &d.set.name(), &schema) {
            Ok(Some(elements)) => check::extra_example(p, d.set, &elements, skip),
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, set = %d.set.name(), "cannot read the set again to name an extra element");
                None
            }
        }
    }

    /// Drift found for certain: counted, and the planners forget their record, so the loop's
    /// full sync rebuilds (by adoption: only what differs is sent).
    fn drift_found(&mut self, diffs: Vec<String>) -> CheckOutcome {
        self.metrics
            .nftables_readback_mismatches
            .inc_by(diffs.len() as u64);
        self.epoch += 1;
        for p in &mut self.planners {
            p.invalidate();
        }
        CheckOutcome::Drift(diffs)
    }

    /// What a periodic full sync acts on: the differences between the kernel and the plan, or,
    /// when the kernel cannot be read, one difference saying so (nothing then proves the rules
    /// right, so the sync rebuilds them). Compares digests, as the check off the loop does, when
    /// the backend reads them ([`NftablesBackend::read_digests`]); else, or if that read fails,
    /// [`Self::verify`]'s differences.
    pub fn drift(&mut self) -> Vec<String> {
        let families = self.planners.iter().map(|p| p.config().family).collect();
        if let Some(read) = self.nft.read_digests(families) {
            match read() {
                Ok((_, tables))
                    if !tables
                        .iter()
                        .any(|t| t.as_ref().is_err_and(|e| !table_missing(e))) =>
                {
                    return self.compare_digests(tables, &Touched::new());
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read the tables as digests; reading them in full")
                }
            }
        }
        self.verify()
            .unwrap_or_else(|e| vec![format!("cannot read the kernel's rules back: {e}")])
    }
}

impl Dataplane for NftablesDataplane {
    fn mode(&self) -> &'static str {
        "nftables"
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        NftablesDataplane::sync(self, state, changes, full).map_err(Error::into_dataplane)
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        NftablesDataplane::verify(self).map_err(Error::into_dataplane)
    }

    fn begin_check(&mut self) -> Option<KernelRead> {
        NftablesDataplane::begin_check(self)
    }

    fn finish_check(&mut self, _state: &ProxyState, read: CheckRead) -> CheckOutcome {
        NftablesDataplane::finish_check(self, read)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        NftablesDataplane::cleanup(self).map_err(Error::into_dataplane)
    }
}
