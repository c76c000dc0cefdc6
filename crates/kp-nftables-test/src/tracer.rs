//! Follows a packet through the nft text we render, without a kernel.
//!
//! The tracer replays transactions (a full one, then any partial ones) into its own copy of the
//! table, orders base chains by the hook and priority they declare, and walks a connection's
//! first packet through them. It knows only the rule shapes the planner emits and refuses
//! anything else, so a renderer change that it does not understand fails loudly instead of
//! being traced wrongly. Mirrors the idea of upstream's `nftables/helpers_test.go` tracer.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use kp_core::flow::Tracer;
use kp_core::flow::{Ingress, Origin, Packet, Verdict};
use kp_core::model::{IpFamily, Protocol};

use kp_nftables_plan::element::{canonical, Atom, NoEndpointVerdict, Tuple};

use crate::elements::{lookup, num};
pub use crate::transaction::TraceError;
use crate::transaction::{self, statements, Hook, RuleModel, SetModel};

/// One component of a concatenated selector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sel {
    Saddr,
    Daddr,
    L4Proto,
    Dport,
    Numgen(u32),
    OrigDaddr,
    OrigDport,
}

#[derive(Clone, Debug)]
enum Match {
    CtStateNew,
    CtStatusDnat,
    FibLocal {
        dst: bool,
    },
    L4Proto(Protocol),
    MarkClear(u32),
    InSet {
        key: Vec<Sel>,
        set: String,
        negate: bool,
    },
    NotInNet {
        key: Sel,
        net: ipnet::IpNet,
    },
    /// `iifname "NAME"`, `iifname "PREFIX*"` (`prefix`), or with `!=` (`negate`).
    Iifname {
        name: String,
        prefix: bool,
        negate: bool,
    },
}

#[derive(Clone, Debug)]
enum Action {
    MarkOr(u32),
    MarkXor(u32),
    Vmap { key: Vec<Sel>, map: String },
    DnatMap { key: Vec<Sel>, map: String },
    Update { map: String },
    Jump(String),
    Goto(String),
    Return,
    Drop,
    Reject,
    Masquerade,
}

#[derive(Clone, Debug)]
struct Rule {
    matches: Vec<Match>,
    actions: Vec<Action>,
    /// The rule's comment (its id), as the kernel's read-back reports it.
    id: String,
}

/// What the read-back reports for a rule without comment (as `kp-nftables` does).
const NO_COMMENT: &str = "<rule without comment>";

type Table = transaction::Table<Rule>;

impl RuleModel for Rule {
    fn parse(body: &str, comment: Option<&str>) -> Option<Self> {
        let mut rule = parse_rule(body)?;
        rule.id = comment.unwrap_or(NO_COMMENT).to_string();
        Some(rule)
    }

    fn sets(&self) -> Vec<&str> {
        let sets = self.matches.iter().filter_map(|m| match m {
            Match::InSet { set, .. } => Some(set.as_str()),
            _ => None,
        });
        let maps = self.actions.iter().filter_map(|a| match a {
            Action::Vmap { map, .. } | Action::DnatMap { map, .. } | Action::Update { map } => {
                Some(map.as_str())
            }
            _ => None,
        });
        sets.chain(maps).collect()
    }

    fn chains(&self) -> Vec<&str> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::Jump(c) | Action::Goto(c) => Some(c.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// Why an element change was refused, as the kernel refuses one (see [`NftTracer::insert_element`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ElementError {
    /// The table or the set does not exist (the kernel: `ENOENT`).
    #[error("no such table or set")]
    NoSet,
    /// A deleted element is not there (`ENOENT`).
    #[error("no such element")]
    Missing,
    /// An added element is there with another value (`EBUSY`; with the same value, the kernel
    /// accepts the addition and changes nothing).
    #[error("the element exists with another value")]
    Clash,
    /// A value for a set, or none for a map (`EINVAL`).
    #[error("the element's shape does not fit the set")]
    Shape,
}

/// A packet's state along its walk.
#[derive(Clone, Debug)]
struct Walk {
    src: IpAddr,
    dst: IpAddr,
    proto: Protocol,
    dport: u16,
    orig_dst: IpAddr,
    orig_dport: u16,
    mark: u32,
    dnat: bool,
    masquerade: bool,
    affinity: Option<u32>,
    affinity_lookup: bool,
    /// The interface the packet arrived on: `None` for the node's own packets (nft reads an
    /// empty name), `Some(None)` when the tracer has no links to tell.
    iif: Option<Option<String>>,
}

enum Flow {
    Continue,
    Return,
    Accept,
    Drop,
    Reject,
}

/// A tracer over the rendered `ip` and `ip6` tables.
#[derive(Clone, Debug)]
pub struct NftTracer {
    tables: HashMap<&'static str, Table>,
    local: Vec<IpAddr>,
    /// The node's links, for `iifname` ([`NftTracer::with_ingress`]).
    ingress: Option<Ingress>,
}

impl NftTracer {
    /// A tracer for a node whose own addresses are `local` (what `fib … type local` matches;
    /// loopback is always local).
    pub fn new(local: Vec<IpAddr>) -> Self {
        NftTracer {
            tables: HashMap::new(),
            local,
            ingress: None,
        }
    }

    /// The tracer with the node's links, which tell the interface a packet arrives on (what
    /// `iifname` matches). Without them, a packet from outside or from a pod that meets an
    /// `iifname` match panics: the tracer does not guess.
    pub fn with_ingress(mut self, ingress: Ingress) -> Self {
        self.ingress = Some(ingress);
        self
    }

    /// Replays a transaction. Fails on any statement the planner would not emit.
    pub fn apply(&mut self, text: &str) -> Result<(), TraceError> {
        for st in statements(text) {
            let fam: &'static str = match st.family {
                "ip" => "ip",
                "ip6" => "ip6",
                _ => return Err(st.unsupported("family")),
            };
            if st.table != kp_nftables_plan::names::TABLE {
                return Err(st.unsupported("table"));
            }
            match (st.verb, st.what) {
                ("add", "table") => {
                    let t = self.tables.entry(fam).or_default();
                    if let Some(c) = st.table_comment() {
                        t.comment = Some(c.to_string());
                    }
                }
                ("delete", "table") => {
                    self.tables
                        .remove(fam)
                        .ok_or_else(|| st.invalid("delete of a missing table".into()))?;
                }
                _ => self
                    .tables
                    .get_mut(fam)
                    .ok_or_else(|| st.invalid("no such table".into()))?
                    .apply(&st)?,
            }
        }
        self.tables.values().try_for_each(Table::check_references)
    }

    /// Number of elements in a set, for tests.
    pub fn element_count(&self, family: IpFamily, set: &str) -> usize {
        self.tables
            .get(kp_nftables_plan::names::family(family))
            .and_then(|t| t.sets.get(set))
            .map_or(0, |s| s.elements.len())
    }

    fn table(&self, family: IpFamily) -> Option<&Table> {
        self.tables.get(kp_nftables_plan::names::family(family))
    }

    /// Whether the family's `kube-proxy` table exists.
    pub fn has_table(&self, family: IpFamily) -> bool {
        self.table(family).is_some()
    }

    /// The table's comment (`add table … { comment "…"; }`), if it has one.
    pub fn comment(&self, family: IpFamily) -> Option<&str> {
        self.table(family)?.comment.as_deref()
    }

    /// Every chain of the table with its rules' ids (their comments) in order, as a read-back
    /// of the kernel reports them. Empty when the table does not exist.
    pub fn rule_ids(&self, family: IpFamily) -> BTreeMap<String, Vec<String>> {
        self.table(family)
            .into_iter()
            .flat_map(|t| &t.chains)
            .map(|(name, c)| (name.clone(), c.rules.iter().map(|r| r.id.clone()).collect()))
            .collect()
    }

    /// The names of the table's sets and maps.
    pub fn set_names(&self, family: IpFamily) -> BTreeSet<String> {
        self.table(family)
            .into_iter()
            .flat_map(|t| t.sets.keys().cloned())
            .collect()
    }

    /// A set's elements (key to value), spelled as the kernel's read-back spells them
    /// ([`canonical`]); `None` if the table or the set does not exist.
    pub fn elements(&self, family: IpFamily, set: &str) -> Option<BTreeMap<Tuple, Option<Tuple>>> {
        Some(self.table(family)?.sets.get(set)?.elements.clone())
    }

    /// Replays what the kernel prints for a table (`nft list table FAMILY kube-proxy`), read
    /// back into a transaction by [`crate::listing::transaction`]. An empty listing (no table)
    /// changes nothing.
    pub fn apply_listing(&mut self, listing: &str) -> Result<(), TraceError> {
        let text = crate::listing::transaction(listing).map_err(|e| TraceError::Invalid {
            line: 0,
            reason: e.to_string(),
        })?;
        self.apply(&text)
    }

    /// How this tracer's `family` table (the kernel's, from [`NftTracer::apply_listing`])
    /// differs from `planned`'s (what a planner renders): the table itself, each chain's rule
    /// ids (in order, except in the chains whose order does not matter), the set and map names,
    /// and the elements of every set and map but the dynamic ones (ClientIP affinity, which the
    /// packet path fills). Endpoint maps are compared by the endpoints each frontend has, not
    /// by slot: a table adopted after a restart keeps the kernel's slot assignment. One line per
    /// difference, empty when they agree.
    pub fn differences(&self, planned: &NftTracer, family: IpFamily) -> Vec<String> {
        let fam = kp_nftables_plan::names::family(family);
        let (k, p) = match (self.table(family), planned.table(family)) {
            (None, None) => return Vec::new(),
            (None, Some(_)) => return vec![format!("{fam}: the table is missing from the kernel")],
            (Some(_), None) => {
                return vec![format!("{fam}: the table is in the kernel but not planned")]
            }
            (Some(k), Some(p)) => (k, p),
        };
        let mut out = Vec::new();
        let ids = |t: &NftTracer| {
            let mut m = t.rule_ids(family);
            for c in kp_nftables_plan::layout::UNORDERED_CHAINS {
                if let Some(v) = m.get_mut(*c) {
                    v.sort();
                }
            }
            m
        };
        let (kc, pc) = (ids(self), ids(planned));
        for name in kc.keys().chain(pc.keys()).collect::<BTreeSet<_>>() {
            match (kc.get(name), pc.get(name)) {
                (None, _) => out.push(format!("{fam}: chain {name} is missing from the kernel")),
                (_, None) => out.push(format!(
                    "{fam}: chain {name} is in the kernel but not planned"
                )),
                (Some(a), Some(b)) if a != b => out.push(format!(
                    "{fam}: chain {name} has rules {a:?} where the plan has {b:?}"
                )),
                _ => {}
            }
        }
        let names: BTreeSet<&String> = k.sets.keys().chain(p.sets.keys()).collect();
        for name in names {
            let (ks, ps) = match (k.sets.get(name), p.sets.get(name)) {
                (None, _) => {
                    out.push(format!("{fam}: set {name} is missing from the kernel"));
                    continue;
                }
                (_, None) => {
                    out.push(format!(
                        "{fam}: set {name} is in the kernel but not planned"
                    ));
                    continue;
                }
                (Some(a), Some(b)) => (a, b),
            };
            if ks.timeout.is_some() || ps.timeout.is_some() || ks.elements == ps.elements {
                continue;
            }
            if name.ends_with("-endpoints")
                && by_frontend(&ks.elements) == by_frontend(&ps.elements)
            {
                continue;
            }
            let missing: Vec<String> = ps
                .elements
                .iter()
                .filter(|(e, v)| ks.elements.get(*e) != Some(*v))
                .map(|(e, v)| element_text(e, v.as_ref()))
                .collect();
            let extra: Vec<String> = ks
                .elements
                .iter()
                .filter(|(e, v)| ps.elements.get(*e) != Some(*v))
                .map(|(e, v)| element_text(e, v.as_ref()))
                .collect();
            out.push(format!(
                "{fam}: set {name}: missing from the kernel {missing:?}, not planned {extra:?}"
            ));
        }
        out
    }

    fn set_mut(&mut self, family: IpFamily, set: &str) -> Result<&mut SetModel, ElementError> {
        self.tables
            .get_mut(kp_nftables_plan::names::family(family))
            .and_then(|t| t.sets.get_mut(set))
            .ok_or(ElementError::NoSet)
    }

    /// Adds one element as the kernel adds one sent over netlink (`NFT_MSG_NEWSETELEM` without
    /// `NLM_F_EXCL`): an element already there with the same value is left as it is. `key` and
    /// `value` are taken as [`canonical`] spells them. Unlike [`NftTracer::apply`], which refuses
    /// any `add element` of an element already there, to catch a planner that adds twice.
    pub fn insert_element(
        &mut self,
        family: IpFamily,
        set: &str,
        key: &Tuple,
        value: Option<&Tuple>,
    ) -> Result<(), ElementError> {
        let s = self.set_mut(family, set)?;
        if s.map != value.is_some() {
            return Err(ElementError::Shape);
        }
        let key = canonical(key);
        let value = value.map(canonical);
        match s.elements.get(&key) {
            Some(v) if *v == value => Ok(()),
            Some(_) => Err(ElementError::Clash),
            None => {
                s.elements.insert(key, value);
                Ok(())
            }
        }
    }

    /// Deletes one element (`NFT_MSG_DELSETELEM`).
    pub fn remove_element(
        &mut self,
        family: IpFamily,
        set: &str,
        key: &Tuple,
    ) -> Result<(), ElementError> {
        let s = self.set_mut(family, set)?;
        s.elements
            .remove(&canonical(key))
            .map(|_| ())
            .ok_or(ElementError::Missing)
    }

    fn is_local(&self, ip: &IpAddr) -> bool {
        ip.is_loopback() || self.local.contains(ip)
    }

    /// Runs every base chain of `hook`; returns false if the packet was dropped or rejected.
    fn run_hook(&self, t: &Table, hook: Hook, w: &mut Vec<Walk>, verdicts: &mut Vec<Verdict>) {
        for (nat, chain) in t.base_chains(hook) {
            let mut next = Vec::new();
            for mut walk in w.drain(..) {
                if nat && hook != Hook::Postrouting && walk.dnat {
                    next.push(walk);
                    continue;
                }
                let mut branches = Vec::new();
                match self.run_chain(t, chain, &mut walk, &mut branches, 0) {
                    Flow::Drop => verdicts.push(Verdict::Drop),
                    Flow::Reject => verdicts.push(Verdict::Reject),
                    _ => {
                        if branches.is_empty() {
                            next.push(walk);
                        } else {
                            next.extend(branches);
                        }
                    }
                }
            }
            *w = next;
        }
    }

    fn run_chain(
        &self,
        t: &Table,
        name: &str,
        w: &mut Walk,
        branches: &mut Vec<Walk>,
        depth: usize,
    ) -> Flow {
        let Some(chain) = t.chains.get(name) else {
            return Flow::Continue;
        };
        if depth > 16 {
            return Flow::Drop;
        }
        for rule in &chain.rules {
            if !rule.matches.iter().all(|m| self.matches(t, m, w)) {
                continue;
            }
            for a in &rule.actions {
                match a {
                    Action::MarkOr(m) => w.mark |= m,
                    Action::MarkXor(m) => w.mark ^= m,
                    Action::Update { map } => {
                        w.affinity = t.sets.get(map).and_then(|s| s.timeout);
                    }
                    Action::Return => return Flow::Return,
                    Action::Drop => return Flow::Drop,
                    Action::Reject => return Flow::Reject,
                    Action::Masquerade => {
                        w.masquerade = true;
                        return Flow::Accept;
                    }
                    Action::Jump(c) => match self.run_chain(t, c, w, branches, depth + 1) {
                        Flow::Continue | Flow::Return => {}
                        f => return f,
                    },
                    Action::Goto(c) => {
                        return match self.run_chain(t, c, w, branches, depth + 1) {
                            Flow::Continue | Flow::Return => Flow::Return,
                            f => f,
                        };
                    }
                    Action::Vmap { key, map } => {
                        let Some(v) = self.lookup(t, map, key, w, None) else {
                            break;
                        };
                        match v.atoms() {
                            [Atom::Verdict(NoEndpointVerdict::Drop)] => return Flow::Drop,
                            [Atom::Verdict(NoEndpointVerdict::Reject)] => {
                                return match self.run_chain(
                                    t,
                                    kp_nftables_plan::names::REJECT_PACKET,
                                    w,
                                    branches,
                                    depth + 1,
                                ) {
                                    Flow::Continue | Flow::Return => Flow::Return,
                                    f => f,
                                };
                            }
                            _ => return Flow::Drop,
                        }
                    }
                    Action::DnatMap { key, map } => {
                        let slots = key.iter().find_map(|s| match s {
                            Sel::Numgen(n) => Some(*n),
                            _ => None,
                        });
                        let mut targets = BTreeSet::new();
                        for slot in 0..slots.unwrap_or(1) {
                            if let Some(v) = self.lookup(t, map, key, w, Some(slot)) {
                                if let [Atom::Ip(ip), port] = v.atoms() {
                                    if let Some(p) = num(port) {
                                        targets.insert((*ip, p as u16));
                                    }
                                }
                            }
                        }
                        if targets.is_empty() {
                            // A failed map lookup ends the rule, as in the kernel.
                            if slots.is_none() {
                                w.affinity_lookup = true;
                            }
                            break;
                        }
                        for (ip, port) in targets {
                            let mut b = w.clone();
                            b.dst = ip;
                            b.dport = port;
                            b.dnat = true;
                            branches.push(b);
                        }
                        return Flow::Accept;
                    }
                }
            }
        }
        Flow::Continue
    }

    fn value(&self, s: Sel, w: &Walk, slot: Option<u32>) -> Atom {
        match s {
            Sel::Saddr => Atom::Ip(w.src),
            Sel::Daddr => Atom::Ip(w.dst),
            Sel::L4Proto => Atom::Proto(w.proto),
            Sel::Dport => Atom::Port(w.dport),
            Sel::Numgen(_) => Atom::Slot(slot.unwrap_or(0)),
            Sel::OrigDaddr => Atom::Ip(w.orig_dst),
            Sel::OrigDport => Atom::Port(w.orig_dport),
        }
    }

    fn find<'a>(
        &self,
        set: &'a SetModel,
        key: &[Sel],
        w: &Walk,
        slot: Option<u32>,
    ) -> Option<&'a Option<Tuple>> {
        let probe: Vec<Atom> = key.iter().map(|s| self.value(*s, w, slot)).collect();
        lookup(&set.elements, &probe)
    }

    fn lookup(
        &self,
        t: &Table,
        map: &str,
        key: &[Sel],
        w: &Walk,
        slot: Option<u32>,
    ) -> Option<Tuple> {
        let set = t.sets.get(map)?;
        self.find(set, key, w, slot).cloned().flatten()
    }

    fn matches(&self, t: &Table, m: &Match, w: &Walk) -> bool {
        match m {
            Match::CtStateNew => true,
            Match::CtStatusDnat => w.dnat,
            Match::FibLocal { dst } => self.is_local(if *dst { &w.dst } else { &w.src }),
            Match::L4Proto(p) => w.proto == *p,
            Match::MarkClear(mask) => w.mark & mask == 0,
            Match::InSet { key, set, negate } => {
                let found = t
                    .sets
                    .get(set)
                    .is_some_and(|s| self.find(s, key, w, None).is_some());
                found != *negate
            }
            Match::NotInNet { key, net } => match self.value(*key, w, None) {
                Atom::Ip(ip) => !net.contains(&ip),
                _ => false,
            },
            Match::Iifname {
                name,
                prefix,
                negate,
            } => kp_core::flow::iifname_matches(
                w.iif.as_ref().map(Option::as_deref),
                name,
                *prefix,
                *negate,
                "NftTracer::with_ingress",
            ),
        }
    }
}

impl Tracer for NftTracer {
    fn trace(&self, p: &Packet) -> Verdict {
        let fam = match p.dst {
            IpAddr::V4(_) => "ip",
            IpAddr::V6(_) => "ip6",
        };
        let Some(t) = self.tables.get(fam) else {
            return Verdict::Untouched;
        };
        let start = Walk {
            src: p.src,
            dst: p.dst,
            proto: p.protocol,
            dport: p.dport,
            orig_dst: p.dst,
            orig_dport: p.dport,
            mark: 0,
            dnat: false,
            masquerade: false,
            affinity: None,
            affinity_lookup: false,
            iif: match (&self.ingress, p.origin) {
                (_, Origin::Node) => None,
                (Some(links), _) => Some(links.interface(p).map(str::to_string)),
                (None, _) => Some(None),
            },
        };
        let mut walks = vec![start];
        let mut verdicts = Vec::new();
        let first = match p.origin {
            Origin::External | Origin::Pod => Hook::Prerouting,
            Origin::Node => Hook::Output,
        };
        self.run_hook(t, first, &mut walks, &mut verdicts);
        // Routing decision: delivered locally, or forwarded.
        let (local, remote): (Vec<Walk>, Vec<Walk>) =
            walks.into_iter().partition(|w| self.is_local(&w.dst));
        let mut out = Vec::new();
        let mut local = local;
        let mut remote = remote;
        if p.origin == Origin::Node {
            out.append(&mut remote);
            self.run_hook(t, Hook::Postrouting, &mut out, &mut verdicts);
            self.run_hook(t, Hook::Postrouting, &mut local, &mut verdicts);
            self.run_hook(t, Hook::Input, &mut local, &mut verdicts);
        } else {
            self.run_hook(t, Hook::Forward, &mut remote, &mut verdicts);
            self.run_hook(t, Hook::Postrouting, &mut remote, &mut verdicts);
            out.append(&mut remote);
            self.run_hook(t, Hook::Input, &mut local, &mut verdicts);
        }
        out.append(&mut local);
        merge(out, verdicts)
    }
}

fn merge(walks: Vec<Walk>, verdicts: Vec<Verdict>) -> Verdict {
    if walks.is_empty() {
        return verdicts.into_iter().next().unwrap_or(Verdict::Drop);
    }
    if !walks.iter().any(|w| w.dnat) {
        return Verdict::Untouched;
    }
    let endpoints = walks
        .iter()
        .filter(|w| w.dnat)
        .map(|w| (w.dst, w.dport))
        .collect();
    let masquerade = walks.iter().all(|w| w.masquerade);
    // Affinity holds when the entry has a remembered-choice lookup and the choice is recorded.
    let affinity = if walks.iter().all(|w| w.affinity_lookup) {
        walks.iter().map(|w| w.affinity).min().flatten()
    } else {
        None
    };
    Verdict::Dnat {
        endpoints,
        masquerade,
        affinity,
    }
}

/// An endpoint map's content without its slots: each frontend's endpoints, sorted.
fn by_frontend(e: &crate::elements::Elements) -> BTreeMap<Vec<String>, Vec<String>> {
    let mut m: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
    for (k, v) in e {
        let atoms = k.atoms();
        let front = atoms[..atoms.len().saturating_sub(1)]
            .iter()
            .map(ToString::to_string)
            .collect();
        let value = v.as_ref().map(element_value).unwrap_or_default();
        m.entry(front).or_default().push(value);
    }
    for v in m.values_mut() {
        v.sort();
    }
    m
}

fn element_value(t: &Tuple) -> String {
    t.atoms()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" . ")
}

fn element_text(k: &Tuple, v: Option<&Tuple>) -> String {
    match v {
        Some(v) => format!("{} : {}", element_value(k), element_value(v)),
        None => element_value(k),
    }
}

/// Parses a selector at `w[i..]`; returns it and how many words it used.
fn parse_sel(w: &[&str], i: usize) -> Option<(Sel, usize)> {
    let at = |k: usize| w.get(i + k).copied().unwrap_or("");
    match (at(0), at(1)) {
        ("ip" | "ip6", "saddr") => Some((Sel::Saddr, 2)),
        ("ip" | "ip6", "daddr") => Some((Sel::Daddr, 2)),
        ("meta", "l4proto") => Some((Sel::L4Proto, 2)),
        ("th", "dport") => Some((Sel::Dport, 2)),
        ("numgen", "random") if at(2) == "mod" => Some((Sel::Numgen(at(3).parse().ok()?), 4)),
        ("ct", "original") => match (at(2), at(3)) {
            ("ip" | "ip6", "daddr") => Some((Sel::OrigDaddr, 4)),
            ("proto-dst", _) => Some((Sel::OrigDport, 3)),
            _ => None,
        },
        _ => None,
    }
}

/// Parses a concatenation; returns it and the index after it.
fn parse_concat(w: &[&str], mut i: usize) -> Option<(Vec<Sel>, usize)> {
    let mut v = Vec::new();
    loop {
        let (s, n) = parse_sel(w, i)?;
        v.push(s);
        i += n;
        if w.get(i) == Some(&".") {
            i += 1;
        } else {
            return Some((v, i));
        }
    }
}

fn parse_rule(body: &str) -> Option<Rule> {
    let w: Vec<&str> = body.split_whitespace().collect();
    let mut matches = Vec::new();
    let mut actions = Vec::new();
    let mut i = 0;
    while i < w.len() {
        let at = |k: usize| w.get(i + k).copied().unwrap_or("");
        match (at(0), at(1), at(2)) {
            ("ct", "state", "new") => {
                matches.push(Match::CtStateNew);
                i += 3;
            }
            ("iifname", op, quoted) => {
                let (negate, quoted, n) = match op {
                    "!=" => (true, quoted, 3),
                    _ => (false, op, 2),
                };
                let inner = quoted.strip_prefix('"')?.strip_suffix('"')?;
                let (name, prefix) = match inner.strip_suffix('*') {
                    Some(p) => (p, true),
                    None => (inner, false),
                };
                kp_core::node::InterfaceName::new(name).ok()?;
                matches.push(Match::Iifname {
                    name: name.to_string(),
                    prefix,
                    negate,
                });
                i += n;
            }
            ("ct", "status", "dnat") => {
                matches.push(Match::CtStatusDnat);
                i += 3;
            }
            ("fib", which @ ("daddr" | "saddr"), "type") if at(3) == "local" => {
                matches.push(Match::FibLocal {
                    dst: which == "daddr",
                });
                i += 4;
            }
            ("meta", "l4proto", p) if Protocol::ALL.iter().any(|x| x.as_lower() == p) => {
                let proto = *Protocol::ALL.iter().find(|x| x.as_lower() == p)?;
                matches.push(Match::L4Proto(proto));
                i += 3;
            }
            ("meta", "mark", "&") => {
                // meta mark & MASK == 0
                if at(4) != "==" || at(5) != "0" {
                    return None;
                }
                matches.push(Match::MarkClear(parse_hex(at(3))?));
                i += 6;
            }
            ("meta", "mark", "set") => {
                // meta mark set meta mark or|xor MASK
                if at(3) != "meta" || at(4) != "mark" {
                    return None;
                }
                let m = parse_hex(at(6))?;
                actions.push(match at(5) {
                    "or" => Action::MarkOr(m),
                    "xor" => Action::MarkXor(m),
                    _ => return None,
                });
                i += 7;
            }
            ("dnat", "ip" | "ip6", "to") => {
                let (key, j) = parse_concat(&w, i + 3)?;
                if w.get(j) != Some(&"map") {
                    return None;
                }
                let map = w.get(j + 1)?.strip_prefix('@')?.to_string();
                actions.push(Action::DnatMap { key, map });
                i = j + 2;
            }
            ("update", m, "{") => {
                let map = m.strip_prefix('@')?.to_string();
                let close = w[i..].iter().position(|x| *x == "}")? + i;
                // The element is `key : value`, both concatenations we can parse.
                let inner = &w[i + 3..close];
                let colon = inner.iter().position(|x| *x == ":")?;
                let (k, kn) = parse_concat(inner, 0)?;
                let (_, vn) = parse_concat(inner, colon + 1)?;
                if kn != colon || vn != inner.len() || k.is_empty() {
                    return None;
                }
                actions.push(Action::Update { map });
                i = close + 1;
            }
            ("jump", c, _) => {
                actions.push(Action::Jump(c.to_string()));
                i += 2;
            }
            ("goto", c, _) => {
                actions.push(Action::Goto(c.to_string()));
                i += 2;
            }
            ("return", _, _) => {
                actions.push(Action::Return);
                i += 1;
            }
            ("drop", _, _) => {
                actions.push(Action::Drop);
                i += 1;
            }
            ("reject", _, _) => {
                actions.push(Action::Reject);
                i += 1;
            }
            ("masquerade", "fully-random", _) => {
                actions.push(Action::Masquerade);
                i += 2;
            }
            _ => {
                let (key, j) = parse_concat(&w, i)?;
                let next = w.get(j).copied().unwrap_or("");
                match next {
                    "vmap" => {
                        let map = w.get(j + 1)?.strip_prefix('@')?.to_string();
                        actions.push(Action::Vmap { key, map });
                        i = j + 2;
                    }
                    "!=" => {
                        let target = w.get(j + 1)?;
                        if let Some(set) = target.strip_prefix('@') {
                            matches.push(Match::InSet {
                                key,
                                set: set.to_string(),
                                negate: true,
                            });
                        } else if key.len() == 1 {
                            let net = if target.contains('/') {
                                target.parse().ok()?
                            } else {
                                ipnet::IpNet::from(target.parse::<IpAddr>().ok()?)
                            };
                            matches.push(Match::NotInNet { key: key[0], net });
                        } else {
                            return None;
                        }
                        i = j + 2;
                    }
                    s if s.starts_with('@') => {
                        matches.push(Match::InSet {
                            key,
                            set: s[1..].to_string(),
                            negate: false,
                        });
                        i = j + 1;
                    }
                    _ => return None,
                }
            }
        }
    }
    if actions.is_empty() {
        return None;
    }
    Some(Rule {
        matches,
        actions,
        id: String::new(),
    })
}

fn parse_hex(s: &str) -> Option<u32> {
    u32::from_str_radix(s.strip_prefix("0x")?, 16).ok()
}

#[cfg(test)]
mod tests;
