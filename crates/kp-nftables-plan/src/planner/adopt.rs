//! Adopting a table that already exists: a restarted proxy's first sync, or the repair of a
//! table that drifted.
//!
//! Replacing the table costs the kernel a reload of every element and forgets the ClientIP
//! affinity choices the packet path wrote into `affinity-T`. So when the kernel's table has the
//! structure this planner would give it, [`Planner::adopt`] plans the full table in memory, as a
//! full sync would, and sends only the element difference between the two (in one batch, which
//! the kernel applies atomically), never touching the dynamic affinity maps.
//!
//! What "the same structure" means: the table's comment names this layout and configuration
//! ([`layout::table_comment`]); every set is one of ours, with its partners (a class set with
//! its endpoint map, an affinity map with its two key sets); and every chain holds the rule ids
//! this planner would put there for the classes and timeouts the kernel has. Classes the kernel
//! has and the plan does not need stay, empty (as a partial sync leaves them); classes the plan
//! needs and the kernel lacks are declared in the transaction's text, as a partial sync declares
//! them.
//!
//! Slots: after churn the kernel's `key . slot → endpoint` assignment of an entry is not the one
//! a fresh plan would make (a replaced endpoint takes the vacated slot). The kernel's assignment
//! seeds the plan where it has the entry in the same class, through the same `prior` mechanism
//! partial syncs use, so endpoints that stay keep their slots and an unchanged cluster costs no
//! element at all.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use kp_core::track::ProxyState;

use super::record::{value_of, Ctx, Elements, Seed, Store, Touched};
use super::writer::{Elem, SplitSink, TxWriter};
use super::{respell, NodeContext, Planner, Transaction};
use crate::element::{Atom, Packed, Tuple};
use crate::layout::{self, PlanConfig, Route, SetId};
use crate::netlink::ElementBatch;

/// One table as the kernel holds it, read back (`kp-nftables` reads it over netlink or from
/// `nft -j list table`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelTable {
    /// Chain name → rule ids (comments) in order.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Set or map name → elements (key → value), spelled as [`crate::element::canonical`] spells them.
    pub sets: BTreeMap<String, BTreeMap<Tuple, Option<Tuple>>>,
    /// The table's comment, when the reader sees it (nft 1.0.6's JSON listing leaves it out).
    pub comment: Option<String>,
}

/// Why a table cannot be adopted: its structure is not the one this planner would give it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Mismatch(pub String);

impl Planner {
    /// Makes the table `kernel` (this family's, as read back) the planner's own: plans the full
    /// table for `state`, keeping the kernel's slot assignment of every entry whose class is
    /// unchanged, and returns a transaction that brings the kernel to the plan by sending only
    /// the difference. Its text declares the classes and affinity timeouts the plan needs and the
    /// kernel lacks (empty until the batch fills them; usually there are none, and the text is
    /// empty); the element changes go into `batch`, to be sent after the text. The dynamic
    /// affinity maps are left alone.
    ///
    /// Afterwards the planner is programmed, as after [`Planner::full_split`], and its record
    /// is the plan, so the next sync may be partial and a read-back right after the batch finds
    /// no difference. Classes the kernel holds that the plan does not need stay in the record,
    /// empty.
    ///
    /// Errors: a [`Mismatch`] naming the first structural difference, when the kernel's table is
    /// not one this version and configuration would make (another layout, a rule deleted behind
    /// our back, a set that is not ours). Nothing is written into `batch` then, and the planner
    /// is left unprogrammed: replace the table with [`Planner::full`].
    pub fn adopt(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        kernel: &KernelTable,
        batch: &mut ElementBatch,
    ) -> Result<Transaction, Mismatch> {
        self.invalidate();
        let (classes, affinities) = kernel_structure(&self.cfg, kernel)?;
        // Nothing reaches `batch` before the whole difference is known to be expressible
        // (`write_difference` checks every element first).
        let mut split = SplitSink::new(batch);
        let mut tx = TxWriter::new(self.cfg.family, &mut split);
        let r = match &mut self.store {
            Store::V4(els) => adopt_in(
                &self.cfg,
                &mut self.meta,
                els,
                state,
                node,
                kernel,
                (&classes, &affinities),
                &mut tx,
            ),
            Store::V6(els) => adopt_in(
                &self.cfg,
                &mut self.meta,
                els,
                state,
                node,
                kernel,
                (&classes, &affinities),
                &mut tx,
            ),
        };
        let written = tx.finish();
        if let Err(e) = r {
            self.invalidate();
            return Err(e);
        }
        self.programmed = true;
        Ok(Transaction::of(split.into_text(), written))
    }
}

/// The dispatch classes and affinity timeouts of a table.
type Structure = (BTreeSet<(Route, u32)>, BTreeSet<u32>);

/// The classes and affinity timeouts `kernel` holds, if its structure is one this planner would
/// make for them.
fn kernel_structure(cfg: &PlanConfig, kernel: &KernelTable) -> Result<Structure, Mismatch> {
    let want = layout::table_comment(cfg);
    match &kernel.comment {
        Some(c) if *c == want => {}
        Some(c) => {
            return Err(Mismatch(format!(
                "the table's comment is {c:?}, this version's and configuration's {want:?}"
            )))
        }
        None => {
            return Err(Mismatch(
                "the table carries no layout comment (made by an older version, or not by us)"
                    .into(),
            ))
        }
    }
    let mut ids = BTreeSet::new();
    for name in kernel.sets.keys() {
        let id = SetId::from_name(name)
            .ok_or_else(|| Mismatch(format!("set {name} is not one of ours")))?;
        ids.insert(id);
    }
    let mut classes = BTreeSet::new();
    let mut affinities = BTreeSet::new();
    for id in &ids {
        match *id {
            SetId::Class(r, n) | SetId::ClassEndpoints(r, n) => {
                classes.insert((r, n));
            }
            SetId::Affinity(t) | SetId::AffinityVips(t) | SetId::AffinityNodePorts(t) => {
                affinities.insert(t);
            }
            _ => {}
        }
    }
    let mut expected: BTreeSet<SetId> = SetId::FIXED.into_iter().collect();
    for &(r, n) in &classes {
        expected.extend([SetId::Class(r, n), SetId::ClassEndpoints(r, n)]);
    }
    for &t in &affinities {
        expected.extend([
            SetId::Affinity(t),
            SetId::AffinityVips(t),
            SetId::AffinityNodePorts(t),
        ]);
    }
    if let Some(missing) = expected.difference(&ids).next() {
        return Err(Mismatch(format!("set {} is missing", missing.name())));
    }
    let want = layout::chains_for(cfg, &classes, &affinities);
    for name in kernel.chains.keys() {
        if !want.contains_key(name) {
            return Err(Mismatch(format!("chain {name} is not one of ours")));
        }
    }
    for (name, rules) in &want {
        let Some(have) = kernel.chains.get(name) else {
            return Err(Mismatch(format!("chain {name} is missing")));
        };
        let mut have = have.clone();
        if layout::UNORDERED_CHAINS.contains(&name.as_str()) {
            have.sort();
        }
        if have != *rules {
            return Err(Mismatch(format!(
                "chain {name} holds rules {have:?}, this version would hold {rules:?}"
            )));
        }
    }
    Ok((classes, affinities))
}

/// [`Planner::adopt`] in one record size, once the structure is known to match: plans with
/// the kernel's slots as seed, declares what the kernel lacks, writes the element difference.
#[allow(clippy::too_many_arguments)] // Private; the planner's parts, split for the borrow.
fn adopt_in<const K: usize, const V: usize>(
    cfg: &PlanConfig,
    meta: &mut super::Meta,
    els: &mut Elements<K, V>,
    state: &ProxyState,
    node: &NodeContext,
    kernel: &KernelTable,
    (kernel_classes, kernel_affinities): (&BTreeSet<(Route, u32)>, &BTreeSet<u32>),
    tx: &mut TxWriter<'_>,
) -> Result<(), Mismatch> {
    let seed = seed_from::<K, V>(kernel);
    let mut ctx = Ctx {
        cfg,
        meta,
        els,
        seed: Some(&seed),
    };
    let mut touched = Touched::new(true);
    ctx.set_node_elements(node, &mut touched);
    for key in state.service_keys() {
        ctx.replace_service(state, node, key, &mut touched);
    }
    let new_classes: Vec<(Route, u32)> = ctx
        .meta
        .classes
        .difference(kernel_classes)
        .copied()
        .collect();
    let new_affinities: Vec<u32> = ctx
        .meta
        .affinities
        .difference(kernel_affinities)
        .copied()
        .collect();
    // The kernel's other classes stay, empty, as a partial sync leaves a class it no longer
    // needs: the record lists them so their rules and sets are expected, and their elements
    // are deleted below.
    ctx.meta.classes.extend(kernel_classes.iter().copied());
    ctx.meta
        .affinities
        .extend(kernel_affinities.iter().copied());
    for &(route, n) in &new_classes {
        tx.declare(SetId::Class(route, n));
        tx.declare(SetId::ClassEndpoints(route, n));
    }
    for &t in &new_affinities {
        tx.declare(SetId::Affinity(t));
        tx.declare(SetId::AffinityVips(t));
        tx.declare(SetId::AffinityNodePorts(t));
    }
    let mut sets = SetId::FIXED.to_vec();
    for &(route, n) in &ctx.meta.classes {
        sets.extend([SetId::Class(route, n), SetId::ClassEndpoints(route, n)]);
    }
    for &t in &ctx.meta.affinities {
        // Not `Affinity(t)`: the packet path writes it.
        sets.extend([SetId::AffinityVips(t), SetId::AffinityNodePorts(t)]);
    }
    ctx.els.write_difference(&sets, kernel, tx)?;
    for &(route, n) in &new_classes {
        for rule in layout::class_rules(cfg, route, n) {
            tx.rule(&rule);
        }
    }
    for &t in &new_affinities {
        for rule in layout::affinity_rules(cfg, t) {
            tx.rule(&rule);
        }
    }
    Ok(())
}

/// The slot assignment of every entry the kernel dispatches completely (an endpoint in each of
/// its class's slots), to seed the plan.
fn seed_from<const K: usize, const V: usize>(kernel: &KernelTable) -> Seed<K, V> {
    let mut seed = Seed::new();
    for (name, els) in &kernel.sets {
        let Some(set @ SetId::ClassEndpoints(route, n)) = SetId::from_name(name) else {
            continue;
        };
        let mut slots: HashMap<Packed<K>, Vec<Option<Packed<V>>>> = HashMap::new();
        for (k, v) in els {
            let Some(Elem::Slot(entry, slot)) = Elements::<K, V>::elem_of(set, k) else {
                continue;
            };
            let Some(ep) = v.as_ref().and_then(|v| Packed::<V>::new(v.atoms())) else {
                continue;
            };
            let entry_slots = slots.entry(entry).or_insert_with(|| vec![None; n as usize]);
            if let Some(s) = entry_slots.get_mut(slot as usize) {
                *s = Some(ep);
            }
        }
        for (entry, eps) in slots {
            if let Some(eps) = eps.into_iter().collect::<Option<Vec<_>>>() {
                seed.insert((route, n, entry), eps.into());
            }
        }
    }
    seed
}

/// The most atoms of a key (an endpoint-map key has five with its slot).
const MAX_KEY_ATOMS: usize = 8;

impl<const K: usize, const V: usize> Elements<K, V> {
    /// A key of `set` as read back (canonical spelling), as the record keys it; `None` if it
    /// cannot be one of ours.
    fn elem_of(set: SetId, key: &Tuple) -> Option<Elem<K>> {
        let atoms = key.atoms();
        let mut buf = [Atom::Port(0); MAX_KEY_ATOMS];
        let buf = buf.get_mut(..atoms.len())?;
        buf.copy_from_slice(atoms);
        respell(set, buf);
        match set {
            SetId::ClassEndpoints(..) => match buf.split_last()? {
                (Atom::Slot(slot), entry) => Some(Elem::Slot(Packed::new(entry)?, *slot)),
                _ => None,
            },
            _ => Some(Elem::Key(Packed::new(buf)?)),
        }
    }

    /// The value the plan wants for `elem` in `set` (empty for a set element), if it wants it.
    fn wanted(&self, set: SetId, elem: &Elem<K>) -> Option<Packed<V>> {
        match (set, elem) {
            (SetId::Class(route, n), Elem::Key(k)) => {
                self.dispatch_value(route, n, k).map(|_| Packed::EMPTY)
            }
            (SetId::ClassEndpoints(route, n), Elem::Slot(k, slot)) => self
                .dispatch_value(route, n, k)?
                .get(*slot as usize)
                .copied(),
            (_, Elem::Key(k)) => self.plain_value(set, k),
            _ => None,
        }
    }

    /// Every element the plan wants in `set`, with its value (empty for a set element).
    fn planned(&self, set: SetId) -> Vec<(Elem<K>, Packed<V>)> {
        match set {
            SetId::Class(route, n) => self
                .dispatch
                .get(&(route, n))
                .into_iter()
                .flatten()
                .map(|(k, _)| (Elem::Key(*k), Packed::EMPTY))
                .collect(),
            SetId::ClassEndpoints(route, n) => self
                .dispatch
                .get(&(route, n))
                .into_iter()
                .flatten()
                .flat_map(|(k, d)| {
                    d.endpoints
                        .iter()
                        .enumerate()
                        .map(move |(slot, ep)| (Elem::Slot(*k, slot as u32), *ep))
                })
                .collect(),
            _ => self
                .plain
                .get(&set)
                .into_iter()
                .flatten()
                .map(|(k, h)| (Elem::Key(*k), h.value))
                .collect(),
        }
    }

    /// Writes the deletions and additions that turn the kernel's `sets` into the plan's:
    /// elements the plan does not want, or wants with another value, are deleted; elements it
    /// wants that the kernel lacks, or holds with another value, are added. All deletions come
    /// before all additions, as the kernel needs for a replaced value.
    fn write_difference(
        &self,
        sets: &[SetId],
        kernel: &KernelTable,
        tx: &mut TxWriter<'_>,
    ) -> Result<(), Mismatch> {
        let empty = BTreeMap::new();
        let mut deletes: Vec<(SetId, Vec<Elem<K>>)> = Vec::new();
        let mut adds: Vec<(SetId, Vec<(Elem<K>, Packed<V>)>)> = Vec::new();
        let packed = |v: &Option<Tuple>| match v {
            None => Some(Packed::<V>::EMPTY),
            Some(v) => Packed::<V>::new(v.atoms()),
        };
        for &set in sets {
            let have = kernel.sets.get(&set.name()).unwrap_or(&empty);
            let mut gone = Vec::new();
            let mut kept = Vec::with_capacity(have.len());
            for (k, v) in have {
                let elem = Self::elem_of(set, k).ok_or_else(|| {
                    Mismatch(format!(
                        "set {}: element {k} is not one of ours",
                        set.name()
                    ))
                })?;
                match (self.wanted(set, &elem), packed(v)) {
                    (Some(want), Some(v)) if want == v => kept.push(elem),
                    _ => gone.push(elem),
                }
            }
            // Everything kept was wanted, with the right value: when that is as many as the
            // plan wants, nothing is missing (the usual case, decided without listing the
            // plan's side). Otherwise the plan's elements not kept are added.
            let mut new = Vec::new();
            if kept.len() < self.expected_len(set) {
                let kept: HashSet<Elem<K>> = kept.into_iter().collect();
                new.extend(
                    self.planned(set)
                        .into_iter()
                        .filter(|(elem, _)| !kept.contains(elem)),
                );
            }
            deletes.push((set, gone));
            adds.push((set, new));
        }
        for (set, gone) in &deletes {
            tx.delete_elements(*set, gone.iter());
        }
        for (set, new) in &adds {
            tx.add_elements(*set, new.iter().map(|(e, v)| (e, value_of(v))));
        }
        Ok(())
    }
}
