//! The nftables dataplane (`--proxy-mode nftables`): sends the planner's transactions, reads the
//! table back to prove the kernel holds what we planned, and forgets its record after any failure
//! so the next sync rebuilds the table.
//!
//! How a sync reaches the kernel:
//! - a partial sync: the declarations and rules of new endpoint-count or affinity classes (if any;
//!   their sets are empty, so they change nothing yet) with `nft -f -`, then every element change
//!   of the sync, for both families, in one netlink batch ([`netlink::send_batch`]): atomic, so
//!   the kernel never sees a REJECT gone before its DNAT is there;
//! - a full sync when no `kube-proxy` table exists yet (first start on a node): the structure with
//!   `nft -f -`, then all elements in one netlink batch (no traffic is ours to lose in between);
//! - a full sync when the table exists (restart, repair after a failure or drift): one atomic
//!   `nft -f -` transaction that deletes and re-creates the table with everything in it.
//!
//! nft's text parser is most of the cost of a large load and every `nft` is a process, so the
//! batch is what makes a first sync and a one-endpoint change cheap at scale.
//!
//! Planning (what to send) is `kp-nftables-plan`'s; this crate only talks to the kernel.
//! Mirrors upstream `pkg/proxy/nftables/proxier.go` (`syncProxyRules`, `CleanupLeftovers`).

pub mod netlink;
mod readback;
mod runner;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use kp_core::dataplane::{Dataplane, SyncReport};
use kp_core::model::IpFamily;
use kp_core::track::{Changes, ProxyState};
use kp_metrics::Metrics;
use kp_nftables_plan::element::Tuple;
use kp_nftables_plan::names::{self, TABLE};
use kp_nftables_plan::{layout, ElementBatch, NodeContext, PlanConfig, Planner, SetId};

pub use kp_core::node::{DetectLocal, NodePortAddresses};
pub use readback::{canonical, parse_table, KernelTable};
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
    },
    /// A listing could not be understood.
    #[error("cannot parse nft output: {0}")]
    Parse(String),
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
    nft: NftCommand,
    metrics: Arc<Metrics>,
    last_transaction: String,
    /// The netlink socket for element batches, opened on first use and kept (closing one after a
    /// commit costs the kernel an RCU grace period); dropped after any error.
    session: Option<netlink::Session>,
}

impl NftablesDataplane {
    /// A dataplane that has programmed nothing yet; the first sync rebuilds the tables.
    pub fn new(cfg: NftablesConfig, nft: NftCommand, metrics: Arc<Metrics>) -> Self {
        let planners = cfg
            .families
            .iter()
            .map(|f| {
                Planner::new(PlanConfig {
                    family: *f,
                    masquerade_mark: 1 << cfg.masquerade_bit,
                    masquerade_all: cfg.masquerade_all,
                    detect_local: cfg.detect_local != DetectLocal::None,
                    node_ports_restricted: cfg.node_ports != NodePortAddresses::AllLocal,
                })
            })
            .collect();
        NftablesDataplane {
            cfg,
            planners,
            nft,
            metrics,
            last_transaction: String::new(),
            session: None,
        }
    }

    /// The last transaction sent (for tests and debugging): the nft text, followed, when element
    /// changes went over netlink, by a line `# netlink: N element changes in M messages`.
    pub fn last_transaction(&self) -> &str {
        &self.last_transaction
    }

    fn node_context(&self, state: &ProxyState) -> NodeContext {
        NodeContext::resolve(&self.cfg.detect_local, &self.cfg.node_ports, state.node())
    }

    fn send(&mut self, text: String) -> Result<(), Error> {
        let r = self.nft.run(&text);
        self.last_transaction = text;
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    /// Runs `f` on the netlink session (opening it if needed); drops the session if `f` fails.
    fn with_session<T>(
        &mut self,
        f: impl FnOnce(&mut netlink::Session) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut session = match self.session.take() {
            Some(s) => s,
            None => netlink::Session::open(self.nft.netns())?,
        };
        let r = f(&mut session);
        if r.is_ok() {
            self.session = Some(session);
        }
        r
    }

    fn failed(&mut self, e: &Error) {
        self.metrics.nftables_sync_failures.inc();
        tracing::error!(error = %e, "nftables sync failed; the next sync rebuilds the tables");
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
            }),
            (None, Some(b)) => self.with_session(|s| s.send_batch(b)),
            (None, None) => Ok(()),
        };
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    /// Whether no family's table exists, so a full sync can fill fresh tables over netlink. If
    /// the kernel cannot be asked, answers false (the all-text rebuild is right either way).
    fn tables_absent(&mut self) -> bool {
        let families: Vec<IpFamily> = self.planners.iter().map(|p| p.config().family).collect();
        families.into_iter().all(|family| {
            match self.with_session(|s| s.table_exists(family)) {
                Ok(exists) => !exists,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot ask whether the table exists; rebuilding with nft");
                    false
                }
            }
        })
    }

    /// Deletes remembered ClientIP affinity choices that point at endpoints no longer serving
    /// their entry, so a client is not pinned to a removed pod until its timeout expires. Reads
    /// and deletes over netlink (with nft when a stand-in program replaces it).
    fn purge_stale_affinity(&mut self) -> Result<usize, Error> {
        let netlink = self.nft.netlink_elements();
        let mut script = String::new();
        let mut batch = ElementBatch::new();
        let mut removed = 0;
        let mut session = match (netlink, self.session.take()) {
            (false, _) => None,
            (true, Some(s)) => Some(s),
            (true, None) => Some(netlink::Session::open(self.nft.netns())?),
        };
        for p in &self.planners {
            let family = p.config().family;
            let fam = names::family(family);
            for t in p.affinity_timeouts() {
                let set = SetId::Affinity(t);
                let map = set.name();
                let els = if let Some(session) = session.as_mut() {
                    let schema = netlink::SetSchema::of(set);
                    // On error the session is dropped with this function's frame.
                    match session.read_set(family, &map, &schema)? {
                        Some(els) => els,
                        None => continue,
                    }
                } else {
                    let json = self.nft.json(&["list", "map", fam, TABLE, &map])?;
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
                if netlink {
                    for k in stale {
                        batch.delete(family, set, k.atoms());
                    }
                } else if !stale.is_empty() {
                    let keys: Vec<String> = stale.iter().map(|k| k.to_string()).collect();
                    script.push_str(&format!(
                        "delete element {fam} {TABLE} {map} {{ {} }}\n",
                        keys.join(", ")
                    ));
                }
            }
        }
        // An entry may expire between listing and deleting; that fails this cleanup only, and
        // the next one catches whatever is left.
        let r = match (batch.finish(), session.as_mut()) {
            (Some(b), Some(s)) => s.send_batch(&b),
            _ if !script.is_empty() => self.nft.run(&script),
            _ => Ok(()),
        };
        if r.is_ok() {
            self.session = session;
        }
        if let Err(e) = r {
            tracing::debug!(error = %e, "stale affinity cleanup raced with expiry");
            return Ok(0);
        }
        Ok(removed)
    }

    fn rebuild(&mut self, state: &ProxyState, node: &NodeContext) -> Result<usize, Error> {
        let mut text = String::new();
        let mut ops = 0;
        if self.nft.netlink_elements() && self.tables_absent() {
            let mut batch = ElementBatch::new();
            for p in &mut self.planners {
                let tx = p.full_split(state, node, &mut batch);
                text.push_str(&tx.text);
                ops += tx.operations;
            }
            self.send_split(text, batch)?;
            return Ok(ops);
        }
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

    /// Reads one family's table from the kernel over netlink; falls back to `nft -j list table`
    /// (ten times slower at scale) if netlink fails for another reason than a missing table.
    fn read_back(&self, p: &Planner) -> Result<KernelTable, Error> {
        let family = p.config().family;
        let ids: HashMap<String, SetId> = p.all_sets().into_iter().map(|s| (s.name(), s)).collect();
        let schema = |name: &str| {
            ids.get(name)
                .filter(|id| !id.is_dynamic())
                .map(|id| netlink::SetSchema::of(*id))
        };
        match netlink::read_table(family, self.nft.netns(), &schema) {
            Ok(t) => Ok(t),
            Err(e @ Error::Netlink { .. }) if e.to_string().contains("ENOENT") => Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "netlink read-back failed; reading with nft instead");
                let fam = names::family(family);
                parse_table(&self.nft.json(&["list", "table", fam, TABLE])?)
            }
        }
    }
}

/// Compares one set read back from the kernel with the plan, element by element: every kernel
/// element must be planned with the same value, and there must be as many as planned.
fn compare_elements(
    fam: &str,
    p: &Planner,
    set: SetId,
    actual: &BTreeMap<Tuple, Option<Tuple>>,
) -> Option<String> {
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
    (wrong + extra + missing > 0).then(|| {
        format!(
            "{fam}: set {}: {missing} elements missing, {wrong} with another value, {extra} extra{}",
            set.name(),
            sample.unwrap_or_default()
        )
    })
}

/// Rule ids expected per chain; chains whose rule order does not matter are sorted.
fn expected_chains(p: &Planner) -> BTreeMap<String, Vec<String>> {
    let mut chains: BTreeMap<String, Vec<String>> = layout::chains()
        .into_iter()
        .map(|c| (c.name.to_string(), Vec::new()))
        .collect();
    for r in p.all_rules() {
        chains.entry(r.chain.to_string()).or_default().push(r.id);
    }
    for c in layout::UNORDERED_CHAINS {
        if let Some(v) = chains.get_mut(*c) {
            v.sort();
        }
    }
    chains
}

impl Dataplane for NftablesDataplane {
    type Error = Error;

    fn mode(&self) -> &'static str {
        "nftables"
    }

    fn sync(
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
            let mut text = String::new();
            let mut ops = 0;
            let mut removes_endpoints = false;
            let mut batch = self.nft.netlink_elements().then(ElementBatch::new);
            for p in &mut self.planners {
                let tx = match batch.as_mut() {
                    Some(b) => {
                        p.partial_split(state, &changes.services, &node, changes.node_changed, b)
                    }
                    None => p.partial(state, &changes.services, &node, changes.node_changed),
                };
                text.push_str(&tx.text);
                ops += tx.operations;
                removes_endpoints |= tx.removes_endpoints;
            }
            if ops > 0 {
                match batch {
                    Some(b) => self.send_split(text, b)?,
                    None => self.send(text)?,
                }
            }
            if removes_endpoints
                && self
                    .planners
                    .iter()
                    .any(|p| !p.affinity_timeouts().is_empty())
            {
                let n = self.purge_stale_affinity()?;
                if n > 0 {
                    tracing::info!(
                        entries = n,
                        "removed ClientIP affinity entries of removed endpoints"
                    );
                }
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

    fn verify(&mut self) -> Result<Vec<String>, Error> {
        let mut diffs = Vec::new();
        for p in &self.planners {
            let fam = names::family(p.config().family);
            let mut kernel = match self.read_back(p) {
                Ok(k) => k,
                Err(Error::Netlink { detail, .. }) if detail.contains("ENOENT") => {
                    diffs.push(format!("{fam}: table {TABLE} is missing"));
                    continue;
                }
                Err(Error::List { .. }) => {
                    diffs.push(format!("{fam}: table {TABLE} is missing"));
                    continue;
                }
                Err(e) => return Err(e),
            };
            for c in layout::UNORDERED_CHAINS {
                if let Some(v) = kernel.chains.get_mut(*c) {
                    v.sort();
                }
            }
            // Chains and set names first; then each set's elements one by one against the
            // planner's lookup, so the check never holds a second copy of the table (at 10k
            // Services that copy was most of the proxy's peak memory).
            let all_sets = p.all_sets();
            let names = all_sets.iter().map(|s| (s.name(), None)).collect();
            diffs.extend(readback::compare(fam, &expected_chains(p), &names, &kernel));
            for set in all_sets.into_iter().filter(|s| !s.is_dynamic()) {
                let Some(actual) = kernel.sets.remove(&set.name()) else {
                    continue;
                };
                diffs.extend(compare_elements(fam, p, set, &actual));
            }
        }
        Ok(diffs)
    }

    fn cleanup(&mut self) -> Result<(), Error> {
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
        for p in &mut self.planners {
            p.invalidate();
        }
        r
    }
}
