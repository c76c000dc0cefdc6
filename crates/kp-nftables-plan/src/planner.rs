//! From the proxy's state to nft transactions.
//!
//! The planner keeps a record of every element it believes the kernel holds, with the Service
//! ports that want it (several ports may want the same element, such as a shared ClusterIP). A
//! partial sync recomputes only the changed Services' elements and sends the difference; a full
//! sync replaces the table in one transaction. Both are atomic: the kernel never sees a state in
//! which a REJECT is gone but the DNAT not yet there.
//!
//! A sync is written into a [`TransactionSink`] ([`Planner::full_into`],
//! [`Planner::partial_into`]): [`NftText`] keeps every statement as nft text, [`SplitSink`]
//! leaves in the text only what nft must parse (the table, chains, set declarations and rules)
//! and encodes the element changes into an [`ElementBatch`] for netlink, never both, so a large
//! table is held once. [`Planner::full`] and [`Planner::partial`] (text) and
//! [`Planner::full_split`] and [`Planner::partial_split`] (split) are the two sinks' shorthands.
//!
//! | file | does |
//! |---|---|
//! | `planner.rs` | [`Planner`]: full and partial syncs, read-back queries |
//! | `planner/service.rs` | what one Service port adds: the elements of its frontends |
//! | `planner/record.rs` | the element record with its owners, claims and releases |
//! | `planner/writer.rs` | the transaction writer: the whole table, or the element changes |
//! | `planner/adopt.rs` | adopting a table read back from the kernel |

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use kp_core::model::ServiceKey;
use kp_core::track::ProxyState;

use crate::element::{Atom, Tuple};
use crate::layout::{self, PlanConfig, Route, RuleDef, SetId};
use crate::netlink::ElementBatch;
use record::{Ctx, Meta, Store, Touched};
use writer::TxWriter;
pub use writer::{NftText, SplitSink, Transaction, TransactionSink, Written};

/// The planner for one IP family's table.
#[derive(Debug)]
pub struct Planner {
    cfg: PlanConfig,
    meta: Meta,
    store: Store,
    /// Whether a full sync has programmed the table.
    programmed: bool,
}

/// Runs `$body` with `$ctx` bound to a [`Ctx`] over the planner's record, whatever its sizes.
macro_rules! with_ctx {
    ($self:ident, $ctx:ident => $body:expr) => {
        match &mut $self.store {
            Store::V4(els) => {
                #[allow(unused_mut)]
                let mut $ctx = Ctx {
                    cfg: &$self.cfg,
                    meta: &mut $self.meta,
                    els,
                    seed: None,
                };
                $body
            }
            Store::V6(els) => {
                #[allow(unused_mut)]
                let mut $ctx = Ctx {
                    cfg: &$self.cfg,
                    meta: &mut $self.meta,
                    els,
                    seed: None,
                };
                $body
            }
        }
    };
}

/// Runs `$body` with `$els` bound to the planner's record, read-only.
macro_rules! with_elements {
    ($self:ident, $els:ident => $body:expr) => {
        match &$self.store {
            Store::V4($els) => $body,
            Store::V6($els) => $body,
        }
    };
}

impl Planner {
    /// A planner that has programmed nothing yet.
    pub fn new(cfg: PlanConfig) -> Self {
        Planner {
            store: Store::new(cfg.family),
            cfg,
            meta: Meta::new(),
            programmed: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PlanConfig {
        &self.cfg
    }

    /// Whether the table has been programmed by a full sync (else the next sync must be full).
    pub fn programmed(&self) -> bool {
        self.programmed
    }

    /// Forgets what the kernel holds, so the next sync is full (after a failed transaction).
    pub fn invalidate(&mut self) {
        *self = Planner::new(self.cfg.clone());
    }

    /// Number of Service ports with a Local policy and no local endpoints: (internal, external).
    pub fn no_local_endpoints(&self) -> (u64, u64) {
        self.meta.facts.values().fold((0, 0), |(i, e), f| {
            (
                i + u64::from(f.no_local_internal),
                e + u64::from(f.no_local_external),
            )
        })
    }

    /// A transaction that replaces the table with one built from `state`, all as nft text.
    pub fn full(&mut self, state: &ProxyState, node: &NodeContext) -> Transaction {
        let mut text = NftText::new();
        let written = self.full_into(state, node, &mut text);
        Transaction::of(text.into_text(), written)
    }

    /// Like [`Planner::full`], but the elements go into `batch` instead of the text: the text
    /// replaces the table with one whose sets are empty, and the batch (sent after it) fills
    /// them. For a table that does not exist yet, where nothing is lost between the two.
    pub fn full_split(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        batch: &mut ElementBatch,
    ) -> Transaction {
        let mut split = SplitSink::new(batch);
        let written = self.full_into(state, node, &mut split);
        Transaction::of(split.into_text(), written)
    }

    /// Writes a transaction that replaces the table with one built from `state` into `sink`.
    pub fn full_into(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        sink: &mut dyn TransactionSink,
    ) -> Written {
        self.invalidate();
        let mut tx = TxWriter::new(self.cfg.family, sink);
        with_ctx!(self, ctx => {
            let mut touched = Touched::new(true);
            ctx.set_node_elements(node, &mut touched);
            for key in state.service_keys() {
                ctx.replace_service(state, node, key, &mut touched);
            }
            ctx.write_full(&mut tx);
        });
        self.programmed = true;
        tx.finish()
    }

    /// A transaction with only what changed for `services` (and the node, if `node_changed`),
    /// all as nft text. Must follow a successful full sync.
    pub fn partial<'a>(
        &mut self,
        state: &ProxyState,
        services: impl IntoIterator<Item = &'a ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
    ) -> Transaction {
        let mut text = NftText::new();
        let written = self.partial_into(state, services, node, node_changed, &mut text);
        Transaction::of(text.into_text(), written)
    }

    /// Like [`Planner::partial`], but the element changes go into `batch`; the text holds only
    /// the declarations and rules of new endpoint-count and affinity classes (empty sets, so
    /// harmless until the batch fills them), and is empty when there are none. Send the text
    /// first, then the batch.
    pub fn partial_split<'a>(
        &mut self,
        state: &ProxyState,
        services: impl IntoIterator<Item = &'a ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
        batch: &mut ElementBatch,
    ) -> Transaction {
        let mut split = SplitSink::new(batch);
        let written = self.partial_into(state, services, node, node_changed, &mut split);
        Transaction::of(split.into_text(), written)
    }

    /// Writes a transaction with only what changed for `services` (and the node, if
    /// `node_changed`) into `sink`: the declarations of new endpoint-count and affinity classes,
    /// the element changes, then the new classes' rules. Must follow a successful full sync
    /// ([`Planner::full_into`], or [`Planner::adopt`]).
    pub fn partial_into<'a>(
        &mut self,
        state: &ProxyState,
        services: impl IntoIterator<Item = &'a ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
        sink: &mut dyn TransactionSink,
    ) -> Written {
        let classes_before = self.meta.classes.clone();
        let affinities_before = self.meta.affinities.clone();
        let mut tx = TxWriter::new(self.cfg.family, sink);
        with_ctx!(self, ctx => {
            let mut touched = Touched::new(false);
            if node_changed {
                ctx.set_node_elements(node, &mut touched);
                // A zone change can change every Service's selection.
                let all: BTreeSet<ServiceKey> = state
                    .service_keys()
                    .cloned()
                    .chain(ctx.meta.by_service.keys().cloned())
                    .collect();
                for key in &all {
                    ctx.replace_service(state, node, key, &mut touched);
                }
            } else {
                for key in services {
                    ctx.replace_service(state, node, key, &mut touched);
                }
            }
            let new_classes: Vec<(Route, u32)> = ctx
                .meta
                .classes
                .difference(&classes_before)
                .copied()
                .collect();
            let new_affinities: Vec<u32> = ctx
                .meta
                .affinities
                .difference(&affinities_before)
                .copied()
                .collect();
            for &(route, n) in &new_classes {
                tx.declare(SetId::Class(route, n));
                tx.declare(SetId::ClassEndpoints(route, n));
            }
            for &t in &new_affinities {
                tx.declare(SetId::Affinity(t));
                tx.declare(SetId::AffinityVips(t));
                tx.declare(SetId::AffinityNodePorts(t));
            }
            ctx.write_element_changes(&touched, &mut tx);
            for &(route, n) in &new_classes {
                for rule in layout::class_rules(ctx.cfg, route, n) {
                    tx.rule(&rule);
                }
            }
            for &t in &new_affinities {
                for rule in layout::affinity_rules(ctx.cfg, t) {
                    tx.rule(&rule);
                }
            }
        });
        tx.finish()
    }

    /// Every set and map the table holds, beyond the fixed ones.
    fn class_sets(&self) -> Vec<SetId> {
        let mut v = Vec::new();
        for &(route, n) in &self.meta.classes {
            v.push(SetId::Class(route, n));
            v.push(SetId::ClassEndpoints(route, n));
        }
        for &t in &self.meta.affinities {
            v.push(SetId::Affinity(t));
            v.push(SetId::AffinityVips(t));
            v.push(SetId::AffinityNodePorts(t));
        }
        v
    }

    /// Every rule the table holds, in order per chain.
    pub fn all_rules(&self) -> Vec<RuleDef> {
        self.meta.rules(&self.cfg)
    }

    /// Rule ids the table should hold per chain, every chain listed; the chains whose order does
    /// not matter ([`layout::UNORDERED_CHAINS`]) sorted, so a read-back with those chains sorted
    /// compares equal.
    pub fn expected_chains(&self) -> BTreeMap<String, Vec<String>> {
        layout::chains_for(&self.cfg, &self.meta.classes, &self.meta.affinities)
    }

    /// Affinity timeouts in use.
    pub fn affinity_timeouts(&self) -> Vec<u32> {
        self.meta.affinities.iter().copied().collect()
    }

    /// The endpoints (`address . port`) an entry key currently dispatches to, over every route.
    pub fn endpoints_of(&self, key: &Tuple) -> BTreeSet<Tuple> {
        with_elements!(self, els => els.endpoints_of(&self.meta, key))
    }

    /// Every set and map the table holds.
    pub fn all_sets(&self) -> Vec<SetId> {
        let mut v = SetId::FIXED.to_vec();
        v.extend(self.class_sets());
        v
    }

    /// The elements the kernel should hold in `set`, with their values.
    pub fn expected_elements(&self, set: SetId) -> BTreeMap<Tuple, Option<Tuple>> {
        with_elements!(self, els => els.expected(set))
    }

    /// Calls `f` with every element the kernel should hold in `set`: its key, and its value in
    /// a map (`None` in a set), spelled as [`Planner::expected_elements`] spells them, in no
    /// particular order. Builds nothing: the atoms are lent from buffers reused for every
    /// element, so a check can digest a set of any size (see
    /// [`crate::element::ElementDigest`]) without holding it.
    pub fn for_each_expected(&self, set: SetId, f: impl FnMut(&[Atom], Option<&[Atom]>)) {
        with_elements!(self, els => els.for_each_expected(set, f))
    }

    /// Number of elements the kernel should hold in `set`: the length of
    /// [`Planner::expected_elements`], without building them.
    pub fn expected_len(&self, set: SetId) -> usize {
        with_elements!(self, els => els.expected_len(set))
    }

    /// What the kernel should hold for `key` in `set`, looked up without building the set:
    /// `None` if the key should not be there, `Some(None)` for a set element, `Some(Some(v))`
    /// for a map element with value `v`. `key` may also be spelled as the kernel read-back
    /// spells it (slots as port numbers, a single-address network as an address). With
    /// [`Planner::expected_len`], this lets a read-back check compare a large set element by
    /// element: every kernel element found with the right value, and as many of them as
    /// expected, means the set is exactly right.
    pub fn expected_value(&self, set: SetId, key: &Tuple) -> Option<Option<Tuple>> {
        let mut atoms = key.atoms().to_vec();
        respell(set, &mut atoms);
        with_elements!(self, els => els.lookup(set, &atoms))
    }
}

pub use kp_core::node::NodeContext;

/// Turns a key of `set` as the kernel read-back spells it ([`crate::element::canonical`]) back
/// into the planner's spelling: the last atom of an endpoint-map key is a slot, and the last
/// atom of an interval set's key is a network.
fn respell(set: SetId, atoms: &mut [Atom]) {
    let Some(last) = atoms.last_mut() else {
        return;
    };
    match (set, *last) {
        (SetId::ClassEndpoints(..), Atom::Port(p)) => *last = Atom::Slot(u32::from(p)),
        (
            SetId::PodCidrs | SetId::ServiceCidrs | SetId::NodePortAddresses | SetId::FirewallAllow,
            Atom::Ip(ip),
        ) => *last = Atom::Net(IpNet::from(ip)),
        _ => {}
    }
}

mod adopt;
mod record;
mod service;
mod writer;
pub use adopt::{KernelTable, Mismatch};

#[cfg(test)]
mod tests;
