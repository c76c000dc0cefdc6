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
use kp_core::flow::{Origin, Packet, Verdict};
use kp_core::model::{IpFamily, Protocol};

use kp_nftables_plan::element::{canonical, Atom, NoEndpointVerdict, Tuple};

use crate::elements::{apply_elements, lookup, num, split_name, ElementTextError};

/// Why the tracer refused a transaction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// A statement or rule shape the tracer does not know.
    #[error("line {line}: unsupported {what}: {text}")]
    Unsupported {
        /// 1-based line in the transaction.
        line: usize,
        /// What kind of thing.
        what: &'static str,
        /// The offending text.
        text: String,
    },
    /// A statement refers to an object that does not exist, or creates one twice.
    #[error("line {line}: {reason}")]
    Invalid {
        /// 1-based line in the transaction.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

#[derive(Clone, Debug)]
struct Chain {
    base: Option<(bool /* nat */, Hook, i32)>,
    rules: Vec<Rule>,
}

#[derive(Clone, Debug)]
struct SetModel {
    map: bool,
    timeout: Option<u32>,
    elements: BTreeMap<Tuple, Option<Tuple>>,
}

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

#[derive(Clone, Debug, Default)]
struct Table {
    chains: HashMap<String, Chain>,
    sets: HashMap<String, SetModel>,
    /// The table's comment, from `add table … { comment "…"; }`.
    comment: Option<String>,
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
}

impl NftTracer {
    /// A tracer for a node whose own addresses are `local` (what `fib … type local` matches;
    /// loopback is always local).
    pub fn new(local: Vec<IpAddr>) -> Self {
        NftTracer {
            tables: HashMap::new(),
            local,
        }
    }

    /// Replays a transaction. Fails on any statement the planner would not emit.
    pub fn apply(&mut self, text: &str) -> Result<(), TraceError> {
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.trim();
            if l.is_empty() {
                continue;
            }
            let unsupported = |what| TraceError::Unsupported {
                line,
                what,
                text: l.to_string(),
            };
            let invalid = |reason: String| TraceError::Invalid { line, reason };
            let mut words = l.splitn(5, ' ');
            let (verb, what, fam, table) = (
                words.next().unwrap_or(""),
                words.next().unwrap_or(""),
                words.next().unwrap_or(""),
                words.next().unwrap_or(""),
            );
            let rest = words.next().unwrap_or("");
            let fam: &'static str = match fam {
                "ip" => "ip",
                "ip6" => "ip6",
                _ => return Err(unsupported("family")),
            };
            if table != kp_nftables_plan::names::TABLE {
                return Err(unsupported("table"));
            }
            match (verb, what) {
                ("add", "table") => {
                    let t = self.tables.entry(fam).or_default();
                    if let Some(c) = rest
                        .split_once("comment \"")
                        .and_then(|(_, c)| c.split_once('"'))
                    {
                        t.comment = Some(c.0.to_string());
                    }
                }
                ("delete", "table") => {
                    self.tables
                        .remove(fam)
                        .ok_or_else(|| invalid("delete of a missing table".into()))?;
                }
                (verb, what) => {
                    let t = self
                        .tables
                        .get_mut(fam)
                        .ok_or_else(|| invalid("no such table".into()))?;
                    match (verb, what) {
                        ("add", "chain") => {
                            let (name, body) = split_name(rest);
                            let base = match body {
                                None => None,
                                Some(b) => Some(parse_hook(b).ok_or_else(|| unsupported("chain"))?),
                            };
                            t.chains.entry(name.to_string()).or_insert(Chain {
                                base,
                                rules: Vec::new(),
                            });
                        }
                        ("add", "set") | ("add", "map") => {
                            let (name, body) = split_name(rest);
                            let body = body.ok_or_else(|| unsupported("set"))?;
                            let timeout = body
                                .split(';')
                                .map(str::trim)
                                .find_map(|p| p.strip_prefix("timeout "))
                                .and_then(|t| t.trim_end_matches('s').parse().ok());
                            t.sets.entry(name.to_string()).or_insert(SetModel {
                                map: what == "map",
                                timeout,
                                elements: BTreeMap::new(),
                            });
                        }
                        ("add", "element") | ("delete", "element") => {
                            let (name, body) = split_name(rest);
                            let set = t
                                .sets
                                .get_mut(name)
                                .ok_or_else(|| invalid(format!("no set {name}")))?;
                            // Kept as the kernel's read-back spells elements, so changes
                            // sent as netlink batches find them.
                            apply_elements(
                                &mut set.elements,
                                set.map,
                                verb == "add",
                                body.unwrap_or(""),
                            )
                            .map_err(|e| match e {
                                ElementTextError::Unsupported(what) => unsupported(what),
                                ElementTextError::Shape => {
                                    invalid(format!("element shape does not fit {name}"))
                                }
                                ElementTextError::Exists(k) => {
                                    invalid(format!("element exists in {name}: {k}"))
                                }
                                ElementTextError::Missing(k) => {
                                    invalid(format!("delete of a missing element in {name}: {k}"))
                                }
                            })?;
                        }
                        ("add", "rule") => {
                            let (chain, body) =
                                rest.split_once(' ').ok_or_else(|| unsupported("rule"))?;
                            let (body, id) = match body.rsplit_once(" comment \"") {
                                Some((b, c)) => (b, c.trim_end_matches('"')),
                                None => (body, NO_COMMENT),
                            };
                            let mut rule = parse_rule(body).ok_or_else(|| unsupported("rule"))?;
                            rule.id = id.to_string();
                            t.chains
                                .get_mut(chain)
                                .ok_or_else(|| invalid(format!("no chain {chain}")))?
                                .rules
                                .push(rule);
                        }
                        _ => return Err(unsupported("statement")),
                    }
                }
            }
        }
        self.check_references()
    }

    /// Every chain and set a rule names must exist.
    fn check_references(&self) -> Result<(), TraceError> {
        for t in self.tables.values() {
            for c in t.chains.values() {
                for r in &c.rules {
                    let sets = r.matches.iter().filter_map(|m| match m {
                        Match::InSet { set, .. } => Some(set),
                        _ => None,
                    });
                    let maps = r.actions.iter().filter_map(|a| match a {
                        Action::Vmap { map, .. }
                        | Action::DnatMap { map, .. }
                        | Action::Update { map } => Some(map),
                        _ => None,
                    });
                    for s in sets.chain(maps) {
                        if !t.sets.contains_key(s) {
                            return Err(TraceError::Invalid {
                                line: 0,
                                reason: format!("rule refers to missing set {s}"),
                            });
                        }
                    }
                    for a in &r.actions {
                        if let Action::Jump(c) | Action::Goto(c) = a {
                            if !t.chains.contains_key(c) {
                                return Err(TraceError::Invalid {
                                    line: 0,
                                    reason: format!("rule jumps to missing chain {c}"),
                                });
                            }
                        }
                    }
                }
            }
        }
        Ok(())
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

    fn hook_chains(&self, t: &Table, hook: Hook) -> Vec<(bool, String)> {
        let mut v: Vec<(i32, bool, String)> = t
            .chains
            .iter()
            .filter_map(|(n, c)| match c.base {
                Some((nat, h, prio)) if h == hook => Some((prio, nat, n.clone())),
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, nat, n)| (nat, n)).collect()
    }

    /// Runs every base chain of `hook`; returns false if the packet was dropped or rejected.
    fn run_hook(&self, t: &Table, hook: Hook, w: &mut Vec<Walk>, verdicts: &mut Vec<Verdict>) {
        for (nat, chain) in self.hook_chains(t, hook) {
            let mut next = Vec::new();
            for mut walk in w.drain(..) {
                if nat && hook != Hook::Postrouting && walk.dnat {
                    next.push(walk);
                    continue;
                }
                let mut branches = Vec::new();
                match self.run_chain(t, &chain, &mut walk, &mut branches, 0) {
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

fn parse_hook(body: &str) -> Option<(bool, Hook, i32)> {
    // "type nat hook prerouting priority dstnat - 10; policy accept;"
    let first = body.split(';').next()?.trim();
    let w: Vec<&str> = first.split_whitespace().collect();
    if w.len() < 6 || w[0] != "type" || w[2] != "hook" || w[4] != "priority" {
        return None;
    }
    let nat = match w[1] {
        "nat" => true,
        "filter" => false,
        _ => return None,
    };
    let hook = match w[3] {
        "prerouting" => Hook::Prerouting,
        "input" => Hook::Input,
        "forward" => Hook::Forward,
        "output" => Hook::Output,
        "postrouting" => Hook::Postrouting,
        _ => return None,
    };
    let base = match w[5] {
        "dstnat" => -100,
        "srcnat" => 100,
        "filter" => 0,
        n => n.parse().ok()?,
    };
    let prio = match (w.get(6), w.get(7)) {
        (Some(&"+"), Some(n)) => base + n.parse::<i32>().ok()?,
        (Some(&"-"), Some(n)) => base - n.parse::<i32>().ok()?,
        (None, None) => base,
        _ => return None,
    };
    Some((nat, hook, prio))
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
