//! The transaction writer: statements in the order the kernel needs them (objects, element
//! deletions, element additions, rules), into a [`TransactionSink`], the one trait behind both
//! ways of sending them: [`NftText`] (everything as nft text) and [`SplitSink`] (the structure as
//! nft text, the elements into a netlink [`ElementBatch`]); and the two things written from the
//! record, the whole table ([`Ctx::write_full`]) and the element changes of a partial sync
//! ([`Ctx::write_element_changes`]).

use std::collections::BTreeMap;
use std::fmt::{self, Display, Write};

use kp_core::model::IpFamily;

use super::record::{value_of, Ctx, Touched};
use crate::element::{Atom, Packed};
use crate::layout::{self, RuleDef, SetId};
use crate::names::{self, TABLE};
use crate::netlink::ElementBatch;

/// Where a transaction goes, statement by statement, in the order the kernel needs them
/// (objects, element deletions, element additions, rules): what the planner writes into
/// ([`Planner::full_into`], [`Planner::partial_into`]). [`NftText`] keeps everything as nft
/// text; [`SplitSink`] keeps the structure as text and encodes the elements into a netlink
/// [`ElementBatch`], to be sent after the text. Elements are handed over one by one as atoms, so
/// a sink may also keep them as values (a test's fake kernel, say).
pub trait TransactionSink {
    /// One statement nft must parse (the table, a chain, a set or map declaration, a rule),
    /// without its newline.
    fn statement(&mut self, line: fmt::Arguments<'_>);

    /// A rule of a base chain (a hook's jump into the table's regular chains), which a sink
    /// may hold back until the sets those chains look up are filled. By default a statement
    /// like any other.
    fn base_chain_rule(&mut self, line: fmt::Arguments<'_>) {
        self.statement(line);
    }

    /// Adds `key` to `set` of the `family` table, with `value` for a map (a verdict for a
    /// verdict map).
    fn add_element(&mut self, family: IpFamily, set: SetId, key: &[Atom], value: Option<&[Atom]>);

    /// Deletes `key` from `set` of the `family` table.
    fn delete_element(&mut self, family: IpFamily, set: SetId, key: &[Atom]);
}

/// A transaction as nft text, ready for `nft -f -`. Consecutive element changes of one set and
/// kind share a statement (`add element ip kube-proxy SET { a, b }`).
#[derive(Clone, Debug, Default)]
pub struct NftText {
    text: String,
    /// The element statement being written: its family, set and whether it deletes.
    open: Option<(IpFamily, SetId, bool)>,
}

impl NftText {
    /// No statement yet.
    pub fn new() -> Self {
        NftText::default()
    }

    /// The text.
    pub fn into_text(mut self) -> String {
        self.close();
        self.text
    }

    fn close(&mut self) {
        if self.open.take().is_some() {
            self.text.push_str(" }\n");
        }
    }

    /// Opens the element statement of `set` (or continues it) for one more element.
    fn element(&mut self, family: IpFamily, set: SetId, delete: bool, key: &[Atom]) {
        if self.open == Some((family, set, delete)) {
            self.text.push_str(", ");
        } else {
            self.close();
            let verb = if delete { "delete" } else { "add" };
            let _ = write!(
                self.text,
                "{verb} element {} {TABLE} {} {{ ",
                names::family(family),
                set.name()
            );
            self.open = Some((family, set, delete));
        }
        write_atoms(&mut self.text, key);
    }
}

/// `a . b . c`, as [`crate::element::Tuple`] renders the same atoms.
fn write_atoms(out: &mut String, atoms: &[Atom]) {
    for (i, a) in atoms.iter().enumerate() {
        if i > 0 {
            out.push_str(" . ");
        }
        match a {
            // The common atoms without the formatting machinery: a full table is megabytes.
            Atom::Proto(p) => out.push_str(p.as_lower()),
            a => {
                let _ = write!(out, "{a}");
            }
        }
    }
}

impl TransactionSink for NftText {
    fn statement(&mut self, line: fmt::Arguments<'_>) {
        self.close();
        let _ = self.text.write_fmt(line);
        self.text.push('\n');
    }

    fn add_element(&mut self, family: IpFamily, set: SetId, key: &[Atom], value: Option<&[Atom]>) {
        self.element(family, set, false, key);
        if let Some(v) = value {
            self.text.push_str(" : ");
            write_atoms(&mut self.text, v);
        }
    }

    fn delete_element(&mut self, family: IpFamily, set: SetId, key: &[Atom]) {
        self.element(family, set, true, key);
    }
}

/// A transaction split for sending: the structure as nft text, sent first, and every element
/// change encoded into a netlink [`ElementBatch`], sent after it.
#[derive(Debug)]
pub struct SplitSink<'b> {
    text: NftText,
    batch: &'b mut ElementBatch,
}

impl<'b> SplitSink<'b> {
    /// Writes elements into `batch` (which may already hold others: one batch can carry every
    /// family's changes).
    pub fn new(batch: &'b mut ElementBatch) -> Self {
        SplitSink {
            text: NftText::new(),
            batch,
        }
    }

    /// The structure's text (empty when there is none).
    pub fn into_text(self) -> String {
        self.text.into_text()
    }
}

impl TransactionSink for SplitSink<'_> {
    fn statement(&mut self, line: fmt::Arguments<'_>) {
        self.text.statement(line);
    }

    fn add_element(&mut self, family: IpFamily, set: SetId, key: &[Atom], value: Option<&[Atom]>) {
        self.batch.add(family, set, key, value);
    }

    fn delete_element(&mut self, family: IpFamily, set: SetId, key: &[Atom]) {
        self.batch.delete(family, set, key);
    }
}

/// What a transaction written into a [`TransactionSink`] holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Objects, rules and individual element additions/deletions.
    pub operations: usize,
    /// Whether it removes or replaces an endpoint of some entry (remembered ClientIP affinity
    /// choices may then point at an endpoint that no longer serves).
    pub removes_endpoints: bool,
}

/// One nft transaction, ready for `nft -f -`. When planned with an [`ElementBatch`]
/// ([`Planner::full_split`], [`Planner::partial_split`]), `text` holds only the structure (table,
/// chains, set declarations, rules) and the element changes went into the batch, to be sent
/// after the text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transaction {
    /// The nft script.
    pub text: String,
    /// Objects, rules and individual element additions/deletions it contains (wherever the
    /// elements went).
    pub operations: usize,
    /// Whether it removes or replaces an endpoint of some entry (remembered ClientIP affinity
    /// choices may then point at an endpoint that no longer serves).
    pub removes_endpoints: bool,
}

impl Transaction {
    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.operations == 0
    }

    /// `text` with what was written beside it.
    pub(super) fn of(text: String, written: Written) -> Self {
        Transaction {
            text,
            operations: written.operations,
            removes_endpoints: written.removes_endpoints,
        }
    }
}

/// An element key as the transaction spells it: a packed key, or an entry key with its slot.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Elem<const K: usize> {
    Key(Packed<K>),
    Slot(Packed<K>, u32),
}

impl<const K: usize> Display for Elem<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Elem::Key(k) => k.fmt(f),
            Elem::Slot(k, slot) => Slotted(k, *slot).fmt(f),
        }
    }
}

/// `key . slot`.
pub(super) struct Slotted<'a, const K: usize>(&'a Packed<K>, u32);

impl<const K: usize> Display for Slotted<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} . {}", self.0, self.1)
    }
}

/// The atoms of an element key or value, gathered without allocating.
pub(super) trait Atoms: Display {
    fn with_atoms(&self, f: &mut dyn FnMut(&[Atom]));
}

/// The most atoms of a key or value (a `firewall-allow` key has four, an endpoint-map key five
/// with its slot).
pub(super) const MAX_ATOMS: usize = 8;

pub(super) fn gather(atoms: impl Iterator<Item = Atom>, f: &mut dyn FnMut(&[Atom])) {
    let mut buf = [Atom::Port(0); MAX_ATOMS];
    let mut n = 0;
    for a in atoms {
        if let Some(slot) = buf.get_mut(n) {
            *slot = a;
            n += 1;
        }
    }
    f(&buf[..n]);
}

impl<const N: usize> Atoms for Packed<N> {
    fn with_atoms(&self, f: &mut dyn FnMut(&[Atom])) {
        gather(self.atoms(), f);
    }
}

impl<const K: usize> Atoms for Slotted<'_, K> {
    fn with_atoms(&self, f: &mut dyn FnMut(&[Atom])) {
        gather(self.0.atoms().chain([Atom::Slot(self.1)]), f);
    }
}

impl<const K: usize> Atoms for Elem<K> {
    fn with_atoms(&self, f: &mut dyn FnMut(&[Atom])) {
        match self {
            Elem::Key(k) => k.with_atoms(f),
            Elem::Slot(k, slot) => Slotted(k, *slot).with_atoms(f),
        }
    }
}

impl<T: Atoms> Atoms for &T {
    fn with_atoms(&self, f: &mut dyn FnMut(&[Atom])) {
        (**self).with_atoms(f);
    }
}

/// Writes statements into a [`TransactionSink`] in the order the kernel needs (objects, element
/// deletions, element additions, rules; callers write them in that order), counting them.
pub(super) struct TxWriter<'s> {
    pub(super) family: &'static str,
    pub(super) ip_family: IpFamily,
    pub(super) ops: usize,
    pub(super) removes_endpoints: bool,
    pub(super) sink: &'s mut dyn TransactionSink,
}

impl<'s> TxWriter<'s> {
    pub(super) fn new(family: IpFamily, sink: &'s mut dyn TransactionSink) -> Self {
        TxWriter {
            family: names::family(family),
            ip_family: family,
            ops: 0,
            removes_endpoints: false,
            sink,
        }
    }

    pub(super) fn line(&mut self, s: fmt::Arguments<'_>) {
        self.sink.statement(s);
    }

    pub(super) fn object(&mut self, s: fmt::Arguments<'_>) {
        self.line(s);
        self.ops += 1;
    }

    pub(super) fn declare(&mut self, id: SetId) {
        let kind = if id.is_map() { "map" } else { "set" };
        let decl = id.declaration(self.ip_family);
        let family = self.family;
        self.object(format_args!(
            "add {kind} {family} {TABLE} {} {{ {decl} }}",
            id.name()
        ));
    }

    pub(super) fn add_elements<A: Atoms, B: Atoms>(
        &mut self,
        set: SetId,
        els: impl Iterator<Item = (A, Option<B>)>,
    ) {
        let family = self.ip_family;
        let sink = &mut *self.sink;
        for (k, v) in els {
            k.with_atoms(&mut |key| match &v {
                Some(v) => {
                    v.with_atoms(&mut |value| sink.add_element(family, set, key, Some(value)))
                }
                None => sink.add_element(family, set, key, None),
            });
            self.ops += 1;
        }
    }

    pub(super) fn delete_elements<'a, A: Atoms + 'a>(
        &mut self,
        set: SetId,
        keys: impl Iterator<Item = &'a A>,
    ) {
        let family = self.ip_family;
        let sink = &mut *self.sink;
        for k in keys {
            self.removes_endpoints |= matches!(set, SetId::ClassEndpoints(..));
            k.with_atoms(&mut |key| sink.delete_element(family, set, key));
            self.ops += 1;
        }
    }

    pub(super) fn rule(&mut self, rule: &RuleDef) {
        self.ops += 1;
        let line = format_args!(
            "add rule {} {TABLE} {} {} comment \"{}\"",
            self.family, rule.chain, rule.text, rule.id
        );
        if layout::is_base_chain(rule.chain) {
            self.sink.base_chain_rule(line);
        } else {
            self.sink.statement(line);
        }
    }

    pub(super) fn finish(self) -> Written {
        Written {
            operations: self.ops,
            removes_endpoints: self.removes_endpoints,
        }
    }
}

impl<const K: usize, const V: usize> Ctx<'_, K, V> {
    /// The whole table: objects, elements, rules.
    pub(super) fn write_full(&self, tx: &mut TxWriter<'_>) {
        let fam = names::family(self.cfg.family);
        tx.line(format_args!("add table {fam} {TABLE}"));
        tx.line(format_args!("delete table {fam} {TABLE}"));
        // The comment names the layout, so a restarted proxy knows whether it may adopt the
        // table (see `layout::table_comment`).
        tx.line(format_args!(
            "add table {fam} {TABLE} {{ comment \"{}\"; }}",
            layout::table_comment(self.cfg)
        ));
        for chain in layout::chains() {
            match chain.hook {
                Some(hook) => tx.object(format_args!(
                    "add chain {fam} {TABLE} {} {{ {hook} }}",
                    chain.name
                )),
                None => tx.object(format_args!("add chain {fam} {TABLE} {}", chain.name)),
            }
        }
        let mut sets: Vec<SetId> = SetId::FIXED.to_vec();
        for &(route, n) in &self.meta.classes {
            sets.push(SetId::Class(route, n));
            sets.push(SetId::ClassEndpoints(route, n));
        }
        for &t in &self.meta.affinities {
            sets.push(SetId::Affinity(t));
            sets.push(SetId::AffinityVips(t));
            sets.push(SetId::AffinityNodePorts(t));
        }
        for id in &sets {
            tx.declare(*id);
        }
        // The rules before the elements: a node's first sync sends the table in the order it is
        // written here (kp-nftables' `fill.rs`: elements in several batches, the base chains'
        // jumps last), and nft can add a rule that looks a `typeof` map up only in the script
        // that declares the map. Within one transaction the order changes nothing.
        for rule in self.meta.rules(self.cfg) {
            tx.rule(&rule);
        }
        for &id in &sets {
            match id {
                SetId::Class(route, n) => {
                    if let Some(m) = self.els.dispatch.get(&(route, n)) {
                        tx.add_elements(id, m.keys().map(|k| (k, None::<&Packed<V>>)));
                    }
                }
                SetId::ClassEndpoints(route, n) => {
                    if let Some(m) = self.els.dispatch.get(&(route, n)) {
                        tx.add_elements(
                            id,
                            m.iter().flat_map(|(k, d)| {
                                d.endpoints
                                    .iter()
                                    .enumerate()
                                    .map(move |(slot, ep)| (Slotted(k, slot as u32), Some(ep)))
                            }),
                        );
                    }
                }
                _ => {
                    if let Some(m) = self.els.plain.get(&id) {
                        tx.add_elements(id, m.iter().map(|(k, h)| (k, value_of(&h.value))));
                    }
                }
            }
        }
    }

    /// The element changes `touched` records: deletions, then additions, per set.
    pub(super) fn write_element_changes(&self, touched: &Touched<K, V>, tx: &mut TxWriter<'_>) {
        let mut deletes: BTreeMap<SetId, Vec<Elem<K>>> = BTreeMap::new();
        let mut adds: BTreeMap<SetId, Vec<(Elem<K>, Option<Packed<V>>)>> = BTreeMap::new();
        let mut change = |set: SetId,
                          key: Elem<K>,
                          before: Option<Packed<V>>,
                          after: Option<Packed<V>>| match (before, after) {
            (Some(b), Some(a)) if b == a => {}
            (Some(_), Some(a)) => {
                deletes.entry(set).or_default().push(key);
                adds.entry(set)
                    .or_default()
                    .push((key, value_of(&a).copied()));
            }
            (Some(_), None) => deletes.entry(set).or_default().push(key),
            (None, Some(a)) => adds
                .entry(set)
                .or_default()
                .push((key, value_of(&a).copied())),
            (None, None) => {}
        };
        for &(set, key) in &touched.plain_order {
            let before = touched.plain.get(&(set, key)).copied().flatten();
            change(set, Elem::Key(key), before, self.els.plain_value(set, &key));
        }
        for &(route, n, key) in &touched.dispatch_order {
            let before = touched
                .dispatch
                .get(&(route, n, key))
                .and_then(|b| b.as_deref());
            let after = self.els.dispatch_value(route, n, &key);
            let present = |eps: Option<&[Packed<V>]>| eps.map(|_| Packed::EMPTY);
            change(
                SetId::Class(route, n),
                Elem::Key(key),
                present(before),
                present(after),
            );
            for slot in 0..n {
                let at =
                    |eps: Option<&[Packed<V>]>| eps.and_then(|e| e.get(slot as usize)).copied();
                change(
                    SetId::ClassEndpoints(route, n),
                    Elem::Slot(key, slot),
                    at(before),
                    at(after),
                );
            }
        }
        for (set, keys) in deletes {
            tx.delete_elements(set, keys.iter());
        }
        for (set, els) in adds {
            tx.add_elements(set, els.iter().map(|(k, v)| (k, v.as_ref())));
        }
    }
}
