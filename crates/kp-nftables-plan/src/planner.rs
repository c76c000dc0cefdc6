//! From the proxy's state to nft transactions.
//!
//! The planner keeps a record of every element it believes the kernel holds, with the Service
//! ports that want it (several ports may want the same element, such as a shared ClusterIP). A
//! partial sync recomputes only the changed Services' elements and sends the difference; a full
//! sync replaces the table in one transaction. Both are atomic: the kernel never sees a state in
//! which a REJECT is gone but the DNAT not yet there.
//!
//! Element changes are written either into the nft text ([`Planner::full`],
//! [`Planner::partial`]) or, encoded, into an [`ElementBatch`] for netlink
//! ([`Planner::full_split`], [`Planner::partial_split`]), never both, so a large table is held
//! once. The split forms leave in the text only what nft must parse: the table, chains, set
//! declarations and rules.
//!
//! The record is compact, because it is as large as the cluster: keys and values are packed
//! into fixed-size byte arrays (16 and 8 bytes in an IPv4 table, 40 and 24 in an IPv6 one), an
//! element wanted by one port (nearly all of them) costs one hash-map slot, and an entry's
//! dispatch (its key in a class set and one map element per endpoint slot) is kept as one
//! record holding the endpoint list. At 10k Services × 10 endpoints the IPv4 record is a few
//! megabytes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::{self, Display, Write};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{Endpoint, IpFamily, ServiceKey};
use kp_core::track::{ProxyState, ServicePortState};

use crate::element::{Atom, NoEndpointVerdict, Packed, Tuple};
use crate::layout::{self, PlanConfig, Route, RuleDef, SetId};
use crate::names::{self, TABLE};
use crate::netlink::ElementBatch;

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
}

/// Who wants an element: a Service port, or the node itself.
type Owner = u32;
const NODE_OWNER: Owner = 0;

/// Per-Service-port facts the metrics need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PortFacts {
    /// `internalTrafficPolicy: Local` with endpoints elsewhere but none here.
    no_local_internal: bool,
    /// `externalTrafficPolicy: Local` with endpoints elsewhere but none here.
    no_local_external: bool,
}

/// Key and value sizes of an IPv4 table's packed elements: the longest key is a
/// `firewall-allow` element (address, protocol, port, network), the longest value an endpoint
/// (address, port).
const V4_KEY: usize = 16;
const V4_VALUE: usize = 8;
/// The same for IPv6.
const V6_KEY: usize = 40;
const V6_VALUE: usize = 24;

/// The planner for one IP family's table.
#[derive(Debug)]
pub struct Planner {
    cfg: PlanConfig,
    meta: Meta,
    store: Store,
    /// Whether a full sync has programmed the table.
    programmed: bool,
}

/// What the planner knows besides the elements themselves.
#[derive(Debug)]
struct Meta {
    /// The owners (one per port) of each Service's elements.
    by_service: HashMap<ServiceKey, Box<[Owner]>>,
    /// Facts of the ports that have any.
    facts: HashMap<Owner, PortFacts>,
    /// Owner numbers free for reuse, and the next never used.
    free: Vec<Owner>,
    next_owner: Owner,
    /// Dispatch classes whose objects and rules exist.
    classes: BTreeSet<(Route, u32)>,
    /// Affinity timeouts whose objects and rules exist.
    affinities: BTreeSet<u32>,
}

impl Meta {
    fn new() -> Self {
        Meta {
            by_service: HashMap::new(),
            facts: HashMap::new(),
            free: Vec::new(),
            next_owner: NODE_OWNER + 1,
            classes: BTreeSet::new(),
            affinities: BTreeSet::new(),
        }
    }

    fn new_owner(&mut self) -> Owner {
        self.free.pop().unwrap_or_else(|| {
            self.next_owner += 1;
            self.next_owner - 1
        })
    }
}

/// The element record, in the packed sizes of the table's family.
#[derive(Debug)]
enum Store {
    V4(Elements<V4_KEY, V4_VALUE>),
    V6(Elements<V6_KEY, V6_VALUE>),
}

impl Store {
    fn new(family: IpFamily) -> Self {
        match family {
            IpFamily::V4 => Store::V4(Elements::default()),
            IpFamily::V6 => Store::V6(Elements::default()),
        }
    }
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
                };
                $body
            }
            Store::V6(els) => {
                #[allow(unused_mut)]
                let mut $ctx = Ctx {
                    cfg: &$self.cfg,
                    meta: &mut $self.meta,
                    els,
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

/// A plain element's first owner and the value it wants (the one the kernel holds).
#[derive(Clone, Copy, Debug)]
struct Held<const V: usize> {
    owner: Owner,
    /// Empty for a set element.
    value: Packed<V>,
    /// Whether other owners want it too (listed in [`Elements::plain_more`]).
    more: bool,
}

/// An entry's dispatch as its first owner wants it: the endpoint in each slot.
#[derive(Clone, Debug)]
struct Dispatch<const V: usize> {
    owner: Owner,
    endpoints: Box<[Packed<V>]>,
    /// Whether other owners want it too (listed in [`Elements::dispatch_more`]).
    more: bool,
}

/// A record several owners may want: the first owner's value is the one held, the others wait
/// in a side list (`Elements::plain_more`, `Elements::dispatch_more`).
trait Shared<T> {
    fn first_owner(&self) -> Owner;
    fn more(&mut self) -> &mut bool;
    /// The next owner's value takes over.
    fn take_over(&mut self, owner: Owner, value: T);
}

impl<const V: usize> Shared<Packed<V>> for Held<V> {
    fn first_owner(&self) -> Owner {
        self.owner
    }
    fn more(&mut self) -> &mut bool {
        &mut self.more
    }
    fn take_over(&mut self, owner: Owner, value: Packed<V>) {
        self.owner = owner;
        self.value = value;
    }
}

impl<const V: usize> Shared<Slots<V>> for Dispatch<V> {
    fn first_owner(&self) -> Owner {
        self.owner
    }
    fn more(&mut self) -> &mut bool {
        &mut self.more
    }
    fn take_over(&mut self, owner: Owner, endpoints: Slots<V>) {
        self.owner = owner;
        self.endpoints = endpoints;
    }
}

/// Drops `owner`'s claim on `record` (whose waiting owners are `waiting[key]`); returns whether
/// no owner is left, so the caller removes the record.
fn drop_claim<T, R: Shared<T>, MK: std::hash::Hash + Eq>(
    record: &mut R,
    waiting: &mut HashMap<MK, Vec<(Owner, T)>>,
    key: MK,
    owner: Owner,
) -> bool {
    if record.first_owner() == owner {
        if !*record.more() {
            return true;
        }
        if let Some(list) = waiting.get_mut(&key) {
            let (next, value) = list.remove(0);
            record.take_over(next, value);
            if list.is_empty() {
                waiting.remove(&key);
                *record.more() = false;
            }
        }
    } else if let Some(list) = waiting.get_mut(&key) {
        list.retain(|(o, _)| *o != owner);
        if list.is_empty() {
            waiting.remove(&key);
            *record.more() = false;
        }
    }
    false
}

/// A dispatch record's place: route, endpoint count, entry key.
type DispatchKey<const K: usize> = (Route, u32, Packed<K>);

/// Endpoints per slot.
type Slots<const V: usize> = Box<[Packed<V>]>;

/// What one owner contributed, to take it back.
#[derive(Debug)]
struct Owned<const K: usize> {
    plain: Box<[(SetId, Packed<K>)]>,
    dispatch: Box<[(Route, u32, Packed<K>)]>,
}

/// Every element the kernel holds, with its owners.
#[derive(Debug)]
struct Elements<const K: usize, const V: usize> {
    /// Elements of every set and map but the dispatch classes.
    plain: HashMap<SetId, HashMap<Packed<K>, Held<V>>>,
    /// Further owners of plain elements wanted by several, in the order they came.
    plain_more: HashMap<(SetId, Packed<K>), Vec<(Owner, Packed<V>)>>,
    /// Dispatch records per class (route, endpoint count), by entry key: the entry is in the
    /// class set, and `key . slot` maps to the slot's endpoint in the class map.
    dispatch: HashMap<(Route, u32), HashMap<Packed<K>, Dispatch<V>>>,
    /// Further owners of dispatch records wanted by several, in the order they came.
    dispatch_more: HashMap<DispatchKey<K>, Vec<(Owner, Slots<V>)>>,
    owned: HashMap<Owner, Owned<K>>,
}

impl<const K: usize, const V: usize> Default for Elements<K, V> {
    fn default() -> Self {
        Elements {
            plain: HashMap::new(),
            plain_more: HashMap::new(),
            dispatch: HashMap::new(),
            dispatch_more: HashMap::new(),
            owned: HashMap::new(),
        }
    }
}

/// What one owner wants.
struct Wants<const K: usize, const V: usize> {
    plain: Vec<(SetId, Packed<K>, Packed<V>)>,
    /// (route, entry key, endpoint per slot).
    dispatch: Vec<(Route, Packed<K>, Vec<Packed<V>>)>,
}

impl<const K: usize, const V: usize> Wants<K, V> {
    fn new() -> Self {
        Wants {
            plain: Vec::new(),
            dispatch: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.plain.is_empty() && self.dispatch.is_empty()
    }

    fn element(&mut self, set: SetId, key: &[Atom]) {
        self.entry(set, key, &[]);
    }

    fn entry(&mut self, set: SetId, key: &[Atom], value: &[Atom]) {
        match (Packed::new(key), Packed::new(value)) {
            (Some(k), Some(v)) => self.plain.push((set, k, v)),
            // The sizes fit every element of the family; a planner only sees its own family.
            _ => debug_assert!(false, "element {key:?} : {value:?} does not fit"),
        }
    }
}

/// A planned change to the elements: how each touched key looked before.
struct Touched<const K: usize, const V: usize> {
    /// Full rebuilds send everything, so they skip the bookkeeping.
    off: bool,
    /// Plain elements: the value before, `None` if absent.
    plain: HashMap<(SetId, Packed<K>), Option<Packed<V>>>,
    plain_order: Vec<(SetId, Packed<K>)>,
    /// Dispatch records: the endpoints before, `None` if absent.
    dispatch: HashMap<DispatchKey<K>, Option<Slots<V>>>,
    dispatch_order: Vec<(Route, u32, Packed<K>)>,
}

impl<const K: usize, const V: usize> Touched<K, V> {
    fn new(off: bool) -> Self {
        Touched {
            off,
            plain: HashMap::new(),
            plain_order: Vec::new(),
            dispatch: HashMap::new(),
            dispatch_order: Vec::new(),
        }
    }
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
        self.full_with(state, node, None)
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
        self.full_with(state, node, Some(batch))
    }

    fn full_with(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        batch: Option<&mut ElementBatch>,
    ) -> Transaction {
        self.invalidate();
        let mut tx = TxWriter::new(self.cfg.family, batch);
        with_ctx!(self, ctx => {
            let mut touched = Touched::new(true);
            ctx.set_node_elements(node, &mut touched);
            for key in state.service_keys() {
                ctx.replace_service(state, key, &mut touched);
            }
            ctx.write_full(&mut tx);
        });
        self.programmed = true;
        tx.finish()
    }

    /// A transaction with only what changed for `services` (and the node, if `node_changed`).
    /// Must follow a successful [`Planner::full`] or [`Planner::full_split`].
    pub fn partial<'a>(
        &mut self,
        state: &ProxyState,
        services: impl IntoIterator<Item = &'a ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
    ) -> Transaction {
        self.partial_with(state, services, node, node_changed, None)
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
        self.partial_with(state, services, node, node_changed, Some(batch))
    }

    fn partial_with<'a>(
        &mut self,
        state: &ProxyState,
        services: impl IntoIterator<Item = &'a ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
        batch: Option<&mut ElementBatch>,
    ) -> Transaction {
        let classes_before = self.meta.classes.clone();
        let affinities_before = self.meta.affinities.clone();
        let mut tx = TxWriter::new(self.cfg.family, batch);
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
                    ctx.replace_service(state, key, &mut touched);
                }
            } else {
                for key in services {
                    ctx.replace_service(state, key, &mut touched);
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
        all_rules(&self.cfg, &self.meta)
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
        let last = atoms.last_mut()?;
        match (set, *last) {
            (SetId::ClassEndpoints(..), Atom::Port(p)) => *last = Atom::Slot(u32::from(p)),
            (SetId::PodCidrs | SetId::NodePortAddresses | SetId::FirewallAllow, Atom::Ip(ip)) => {
                *last = Atom::Net(IpNet::from(ip));
            }
            _ => {}
        }
        with_elements!(self, els => els.lookup(set, &atoms))
    }
}

fn all_rules(cfg: &PlanConfig, meta: &Meta) -> Vec<RuleDef> {
    let mut rules = layout::fixed_rules(cfg);
    for &(route, n) in &meta.classes {
        rules.extend(layout::class_rules(cfg, route, n));
    }
    for &t in &meta.affinities {
        rules.extend(layout::affinity_rules(cfg, t));
    }
    rules
}

pub use kp_core::node::NodeContext;

/// The value of a plain element as a `Some` for maps and `None` for sets.
fn value_of<const V: usize>(value: &Packed<V>) -> Option<&Packed<V>> {
    (!value.is_empty()).then_some(value)
}

impl<const K: usize, const V: usize> Elements<K, V> {
    /// The value of a plain element, if present.
    fn plain_value(&self, set: SetId, key: &Packed<K>) -> Option<Packed<V>> {
        self.plain.get(&set)?.get(key).map(|h| h.value)
    }

    /// The endpoints of a dispatch record, if present.
    fn dispatch_value(&self, route: Route, n: u32, key: &Packed<K>) -> Option<&[Packed<V>]> {
        self.dispatch
            .get(&(route, n))?
            .get(key)
            .map(|d| &d.endpoints[..])
    }

    fn expected_len(&self, set: SetId) -> usize {
        match set {
            SetId::Class(route, n) => self.dispatch.get(&(route, n)).map_or(0, HashMap::len),
            SetId::ClassEndpoints(route, n) => self
                .dispatch
                .get(&(route, n))
                .map_or(0, |m| m.values().map(|d| d.endpoints.len()).sum()),
            _ => self.plain.get(&set).map_or(0, HashMap::len),
        }
    }

    fn lookup(&self, set: SetId, atoms: &[Atom]) -> Option<Option<Tuple>> {
        match set {
            SetId::Class(route, n) => {
                let key = Packed::<K>::new(atoms)?;
                self.dispatch_value(route, n, &key).map(|_| None)
            }
            SetId::ClassEndpoints(route, n) => {
                let (Atom::Slot(slot), entry) = atoms.split_last()? else {
                    return None;
                };
                let key = Packed::<K>::new(entry)?;
                let ep = self.dispatch_value(route, n, &key)?.get(*slot as usize)?;
                Some(Some(ep.to_tuple()))
            }
            _ => {
                let key = Packed::<K>::new(atoms)?;
                let held = self.plain.get(&set)?.get(&key)?;
                Some(value_of(&held.value).map(|v| v.to_tuple()))
            }
        }
    }

    fn endpoints_of(&self, meta: &Meta, key: &Tuple) -> BTreeSet<Tuple> {
        let Some(key) = Packed::<K>::new(key.atoms()) else {
            return BTreeSet::new();
        };
        let mut out = BTreeSet::new();
        for &(route, n) in &meta.classes {
            if let Some(eps) = self.dispatch_value(route, n, &key) {
                out.extend(eps.iter().map(|e| e.to_tuple()));
            }
        }
        out
    }

    fn expected(&self, set: SetId) -> BTreeMap<Tuple, Option<Tuple>> {
        // Sorted on the packed bytes first (their order is the tuples' order, but cheap to
        // compare), so the map is built from sorted input.
        let mut out = Vec::with_capacity(self.expected_len(set));
        match set {
            SetId::Class(route, n) => {
                let mut keys: Vec<&Packed<K>> = self
                    .dispatch
                    .get(&(route, n))
                    .into_iter()
                    .flatten()
                    .map(|e| e.0)
                    .collect();
                keys.sort_unstable();
                out.extend(keys.into_iter().map(|k| (k.to_tuple(), None)));
            }
            SetId::ClassEndpoints(route, n) => {
                let mut records: Vec<(&Packed<K>, &Dispatch<V>)> = self
                    .dispatch
                    .get(&(route, n))
                    .into_iter()
                    .flatten()
                    .collect();
                records.sort_unstable_by_key(|r| r.0);
                for (key, d) in records {
                    for (slot, ep) in d.endpoints.iter().enumerate() {
                        let k = key.to_tuple_with(Some(Atom::Slot(slot as u32)));
                        out.push((k, Some(ep.to_tuple())));
                    }
                }
            }
            _ => {
                let mut held: Vec<(&Packed<K>, &Held<V>)> =
                    self.plain.get(&set).into_iter().flatten().collect();
                held.sort_unstable_by_key(|h| h.0);
                out.extend(
                    held.into_iter()
                        .map(|(k, h)| (k.to_tuple(), value_of(&h.value).map(|v| v.to_tuple()))),
                );
            }
        }
        out.into_iter().collect()
    }
}

/// The planner's record in one size, with what it works with.
struct Ctx<'a, const K: usize, const V: usize> {
    cfg: &'a PlanConfig,
    meta: &'a mut Meta,
    els: &'a mut Elements<K, V>,
}

impl<const K: usize, const V: usize> Ctx<'_, K, V> {
    fn set_node_elements(&mut self, node: &NodeContext, touched: &mut Touched<K, V>) {
        self.release(NODE_OWNER, touched);
        let fam = self.cfg.family;
        let mut wants = Wants::new();
        for net in IpNet::aggregate(&in_family(&node.local_cidrs, fam)) {
            wants.element(SetId::PodCidrs, &[Atom::Net(net)]);
        }
        for net in IpNet::aggregate(&in_family(&node.node_port_addresses, fam)) {
            wants.element(SetId::NodePortAddresses, &[Atom::Net(net)]);
        }
        self.claim(NODE_OWNER, wants, touched);
    }

    /// Recomputes one Service's elements.
    fn replace_service(
        &mut self,
        state: &ProxyState,
        key: &ServiceKey,
        touched: &mut Touched<K, V>,
    ) {
        // Compute first, while the current slot assignment is still recorded, so endpoints
        // that stay keep their slots.
        let els = &*self.els;
        let computed: Vec<(Wants<K, V>, PortFacts)> = state
            .service_state(key)
            .iter()
            .map(|sps| {
                contributions(self.cfg, sps, &|route, key, n| {
                    els.dispatch_value(route, n, key)
                })
            })
            .collect();
        for owner in self.meta.by_service.remove(key).unwrap_or_default().iter() {
            self.release(*owner, touched);
            self.meta.facts.remove(owner);
            self.meta.free.push(*owner);
        }
        // Ports that put nothing into this table (another family's) need no owner.
        let computed: Vec<(Wants<K, V>, PortFacts)> = computed
            .into_iter()
            .filter(|(w, f)| !w.is_empty() || *f != PortFacts::default())
            .collect();
        if computed.is_empty() {
            return;
        }
        let mut owners = Vec::with_capacity(computed.len());
        for (wants, facts) in computed {
            let owner = self.meta.new_owner();
            self.claim(owner, wants, touched);
            if facts != PortFacts::default() {
                self.meta.facts.insert(owner, facts);
            }
            owners.push(owner);
        }
        self.meta.by_service.insert(key.clone(), owners.into());
    }

    fn note_plain(&self, touched: &mut Touched<K, V>, set: SetId, key: Packed<K>) {
        if touched.off {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = touched.plain.entry((set, key)) {
            e.insert(self.els.plain_value(set, &key));
            touched.plain_order.push((set, key));
        }
    }

    fn note_dispatch(&self, touched: &mut Touched<K, V>, route: Route, n: u32, key: Packed<K>) {
        if touched.off {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) =
            touched.dispatch.entry((route, n, key))
        {
            e.insert(self.els.dispatch_value(route, n, &key).map(Box::from));
            touched.dispatch_order.push((route, n, key));
        }
    }

    fn release(&mut self, owner: Owner, touched: &mut Touched<K, V>) {
        let Some(owned) = self.els.owned.remove(&owner) else {
            return;
        };
        for &(set, key) in owned.plain.iter() {
            self.note_plain(touched, set, key);
            let els = &mut *self.els;
            let Some(map) = els.plain.get_mut(&set) else {
                continue;
            };
            let Some(held) = map.get_mut(&key) else {
                continue;
            };
            if drop_claim(held, &mut els.plain_more, (set, key), owner) {
                map.remove(&key);
            }
        }
        for &(route, n, key) in owned.dispatch.iter() {
            self.note_dispatch(touched, route, n, key);
            let els = &mut *self.els;
            let Some(map) = els.dispatch.get_mut(&(route, n)) else {
                continue;
            };
            let Some(d) = map.get_mut(&key) else {
                continue;
            };
            if drop_claim(d, &mut els.dispatch_more, (route, n, key), owner) {
                map.remove(&key);
            }
        }
    }

    fn claim(&mut self, owner: Owner, wants: Wants<K, V>, touched: &mut Touched<K, V>) {
        let mut plain = Vec::with_capacity(wants.plain.len());
        for (set, key, value) in wants.plain {
            if let SetId::AffinityVips(t) | SetId::AffinityNodePorts(t) = set {
                self.meta.affinities.insert(t);
            }
            self.note_plain(touched, set, key);
            let els = &mut *self.els;
            let map = els.plain.entry(set).or_default();
            match map.get_mut(&key) {
                None => {
                    map.insert(
                        key,
                        Held {
                            owner,
                            value,
                            more: false,
                        },
                    );
                }
                Some(held) => {
                    if held.owner == owner {
                        continue;
                    }
                    let more = els.plain_more.entry((set, key)).or_default();
                    if more.iter().any(|(o, _)| *o == owner) {
                        continue;
                    }
                    more.push((owner, value));
                    held.more = true;
                }
            }
            plain.push((set, key));
        }
        let mut dispatch = Vec::with_capacity(wants.dispatch.len());
        for (route, key, endpoints) in wants.dispatch {
            let n = endpoints.len() as u32;
            self.meta.classes.insert((route, n));
            self.note_dispatch(touched, route, n, key);
            let els = &mut *self.els;
            let map = els.dispatch.entry((route, n)).or_default();
            match map.get_mut(&key) {
                None => {
                    map.insert(
                        key,
                        Dispatch {
                            owner,
                            endpoints: endpoints.into(),
                            more: false,
                        },
                    );
                }
                Some(d) => {
                    if d.owner == owner {
                        continue;
                    }
                    let more = els.dispatch_more.entry((route, n, key)).or_default();
                    if more.iter().any(|(o, _)| *o == owner) {
                        continue;
                    }
                    more.push((owner, endpoints.into()));
                    d.more = true;
                }
            }
            dispatch.push((route, n, key));
        }
        if plain.is_empty() && dispatch.is_empty() {
            return;
        }
        self.els.owned.insert(
            owner,
            Owned {
                plain: plain.into(),
                dispatch: dispatch.into(),
            },
        );
    }

    /// The whole table: objects, elements, rules.
    fn write_full(&self, tx: &mut TxWriter<'_>) {
        let fam = names::family(self.cfg.family);
        tx.line(format_args!("add table {fam} {TABLE}"));
        tx.line(format_args!("delete table {fam} {TABLE}"));
        tx.line(format_args!("add table {fam} {TABLE}"));
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
        for rule in all_rules(self.cfg, self.meta) {
            tx.rule(&rule);
        }
    }

    fn write_element_changes(&self, touched: &Touched<K, V>, tx: &mut TxWriter<'_>) {
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

/// An element key as the transaction spells it: a packed key, or an entry key with its slot.
#[derive(Clone, Copy)]
enum Elem<const K: usize> {
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
struct Slotted<'a, const K: usize>(&'a Packed<K>, u32);

impl<const K: usize> Display for Slotted<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} . {}", self.0, self.1)
    }
}

fn sorted(eps: &[Endpoint]) -> Vec<&Endpoint> {
    let mut v: Vec<&Endpoint> = eps.iter().collect();
    v.sort_by_key(|e| (e.ip, e.port));
    v
}

fn in_family(nets: &[IpNet], family: IpFamily) -> Vec<IpNet> {
    nets.iter()
        .filter(|n| IpFamily::of_net(n) == family)
        .copied()
        .collect()
}

fn vip_key(ip: IpAddr, sps: &ServicePortState) -> [Atom; 3] {
    [
        Atom::Ip(ip),
        Atom::Proto(sps.port.name.protocol),
        Atom::Port(sps.port.port),
    ]
}

fn nodeport_key(port: u16, sps: &ServicePortState) -> [Atom; 2] {
    [Atom::Proto(sps.port.name.protocol), Atom::Port(port)]
}

/// Previous slot assignment of an entry: (route, key, endpoint count) → endpoint per slot.
type PriorSlots<'a, const K: usize, const V: usize> =
    &'a dyn Fn(Route, &Packed<K>, u32) -> Option<&'a [Packed<V>]>;

/// The dispatch that sends `key` to `endpoints` (sorted by address and port): the key in its
/// class set, and one slot per endpoint in the class map. When the count is unchanged,
/// endpoints that stay keep their slot and newcomers take the vacated ones, so replacing one
/// endpoint rewrites one slot.
fn dispatch<const K: usize, const V: usize>(
    route: Route,
    key: &[Atom],
    endpoints: &[&Endpoint],
    prior: PriorSlots<'_, K, V>,
    out: &mut Wants<K, V>,
) {
    let Some(key) = Packed::<K>::new(key) else {
        debug_assert!(false, "entry key {key:?} does not fit");
        return;
    };
    // Sorted: endpoints come sorted by (address, port), and packing keeps that order.
    let wanted: Vec<Packed<V>> = endpoints
        .iter()
        .filter_map(|ep| Packed::new(&[Atom::Ip(ep.ip), Atom::Port(ep.port)]))
        .collect();
    debug_assert!(wanted.windows(2).all(|w| w[0] <= w[1]));
    let n = wanted.len() as u32;
    let mut slots: Vec<Option<Packed<V>>> = vec![None; wanted.len()];
    let mut kept = vec![false; wanted.len()];
    if let Some(previous) = prior(route, &key, n) {
        for (slot, ep) in previous.iter().enumerate() {
            if let Ok(i) = wanted.binary_search(ep) {
                if !kept[i] {
                    kept[i] = true;
                    slots[slot] = Some(*ep);
                }
            }
        }
    }
    let mut newcomers = wanted
        .iter()
        .zip(&kept)
        .filter(|(_, k)| !**k)
        .map(|(w, _)| *w);
    for slot in slots.iter_mut().filter(|s| s.is_none()) {
        *slot = newcomers.next();
    }
    out.dispatch
        .push((route, key, slots.into_iter().flatten().collect()));
}

fn no_endpoints<const K: usize, const V: usize>(
    set: SetId,
    key: &[Atom],
    has_any: bool,
    out: &mut Wants<K, V>,
) {
    let verdict = if has_any {
        NoEndpointVerdict::Drop
    } else {
        NoEndpointVerdict::Reject
    };
    out.entry(set, key, &[Atom::Verdict(verdict)]);
}

/// Everything one Service port puts into the table.
fn contributions<const K: usize, const V: usize>(
    cfg: &PlanConfig,
    sps: &ServicePortState,
    prior: PriorSlots<'_, K, V>,
) -> (Wants<K, V>, PortFacts) {
    let fam = cfg.family;
    let port = &sps.port;
    let sel = &sps.endpoints;
    let of_family = |eps: &'_ [Endpoint]| -> Vec<Endpoint> {
        eps.iter()
            .filter(|e| IpFamily::of(&e.ip) == fam)
            .cloned()
            .collect()
    };
    let internal = of_family(sel.internal(port));
    let external = of_family(sel.external(port));
    let cluster = of_family(&sel.cluster);
    let has_any = sel.has_any_for(fam);
    let (internal, external, cluster) = (sorted(&internal), sorted(&external), sorted(&cluster));
    let ext_local = port.external_policy_local();
    let affinity = port.session_affinity_timeout;
    let mut out = Wants::new();
    let mut facts = PortFacts::default();

    for ip in port.cluster_ips.iter().filter(|ip| IpFamily::of(ip) == fam) {
        out.element(SetId::ClusterIps, &[Atom::Ip(*ip)]);
        let key = vip_key(*ip, sps);
        if internal.is_empty() {
            no_endpoints(SetId::NoEndpointVips, &key, has_any, &mut out);
            facts.no_local_internal = has_any && port.internal_traffic_local;
        } else {
            dispatch(Route::Vips, &key, &internal, prior, &mut out);
            if let Some(t) = affinity {
                out.element(SetId::AffinityVips(t), &key);
            }
        }
    }

    let externals = port
        .external_ips
        .iter()
        .map(|ip| (*ip, false))
        .chain(port.load_balancer_ips.iter().map(|ip| (*ip, true)))
        .filter(|(ip, _)| IpFamily::of(ip) == fam);
    // External entries, each with its route: ExternalIPs and LoadBalancer IPs, then the NodePort.
    let mut entries: Vec<(Vec<Atom>, Route)> = Vec::new();
    for (ip, is_lb) in externals {
        let key = vip_key(ip, sps);
        if is_lb && !port.load_balancer_source_ranges.is_empty() {
            out.element(SetId::FirewallVips, &key);
            for net in IpNet::aggregate(&in_family(&port.load_balancer_source_ranges, fam)) {
                let mut k = key.to_vec();
                k.push(Atom::Net(net));
                out.element(SetId::FirewallAllow, &k);
            }
        }
        entries.push((key.to_vec(), Route::Vips));
    }
    if let Some(np) = port.node_port {
        entries.push((nodeport_key(np, sps).to_vec(), Route::NodePorts));
    }
    for (key, route) in entries {
        if ext_local {
            out.element(route.local_policy_set(), &key);
            if !cluster.is_empty() {
                dispatch(route.local_source(), &key, &cluster, prior, &mut out);
            }
        } else {
            out.element(route.masquerade_set(), &key);
        }
        if external.is_empty() {
            no_endpoints(route.no_endpoint_set(), &key, has_any, &mut out);
            facts.no_local_external |= has_any && ext_local;
        } else {
            dispatch(route, &key, &external, prior, &mut out);
            if let Some(t) = affinity {
                out.element(route.affinity_set(t), &key);
            }
        }
    }

    // Hairpin: an endpoint reaching itself through any of this port's entries. Only endpoints
    // on this node can do that here (a remote pod's Service traffic is translated on its own
    // node), so only they need an element.
    let mut eps: BTreeSet<IpAddr> = BTreeSet::new();
    eps.extend(
        internal
            .iter()
            .chain(external.iter())
            .chain(cluster.iter())
            .filter(|e| e.is_local)
            .map(|e| e.ip),
    );
    for ip in eps {
        out.element(SetId::Hairpin, &[Atom::Ip(ip), Atom::Ip(ip)]);
    }
    (out, facts)
}

/// The atoms of an element key or value, gathered without allocating.
trait Atoms: Display {
    fn with_atoms(&self, f: &mut dyn FnMut(&[Atom]));
}

/// The most atoms of a key or value (a `firewall-allow` key has four, an endpoint-map key five
/// with its slot).
const MAX_ATOMS: usize = 8;

fn gather(atoms: impl Iterator<Item = Atom>, f: &mut dyn FnMut(&[Atom])) {
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

/// Renders statements in the order the kernel needs: objects, element deletions, element
/// additions, rules. Callers write them in that order, straight into one buffer (a full table
/// is megabytes of text: one copy is enough). With a batch, element changes are encoded into it
/// instead of the text (never both: a full table is big either way).
struct TxWriter<'b> {
    family: &'static str,
    ip_family: IpFamily,
    text: String,
    ops: usize,
    removes_endpoints: bool,
    batch: Option<&'b mut ElementBatch>,
}

impl<'b> TxWriter<'b> {
    fn new(family: IpFamily, batch: Option<&'b mut ElementBatch>) -> Self {
        TxWriter {
            family: names::family(family),
            ip_family: family,
            text: String::new(),
            ops: 0,
            removes_endpoints: false,
            batch,
        }
    }

    fn line(&mut self, s: fmt::Arguments<'_>) {
        // Writing to a String cannot fail.
        let _ = self.text.write_fmt(s);
        self.text.push('\n');
    }

    fn object(&mut self, s: fmt::Arguments<'_>) {
        self.line(s);
        self.ops += 1;
    }

    fn declare(&mut self, id: SetId) {
        let kind = if id.is_map() { "map" } else { "set" };
        let decl = id.declaration(self.ip_family);
        let family = self.family;
        self.object(format_args!(
            "add {kind} {family} {TABLE} {} {{ {decl} }}",
            id.name()
        ));
    }

    fn add_elements<A: Atoms, B: Atoms>(
        &mut self,
        set: SetId,
        els: impl Iterator<Item = (A, Option<B>)>,
    ) {
        if let Some(batch) = self.batch.as_deref_mut() {
            let family = self.ip_family;
            for (k, v) in els {
                k.with_atoms(&mut |key| match &v {
                    Some(v) => v.with_atoms(&mut |value| batch.add(family, set, key, Some(value))),
                    None => batch.add(family, set, key, None),
                });
                self.ops += 1;
            }
            return;
        }
        let mut els = els.peekable();
        if els.peek().is_none() {
            return;
        }
        let _ = write!(
            self.text,
            "add element {} {TABLE} {} {{ ",
            self.family,
            set.name()
        );
        for (i, (k, v)) in els.enumerate() {
            if i > 0 {
                self.text.push_str(", ");
            }
            let _ = write!(self.text, "{k}");
            if let Some(v) = v {
                let _ = write!(self.text, " : {v}");
            }
            self.ops += 1;
        }
        self.text.push_str(" }\n");
    }

    fn delete_elements<'a, A: Atoms + 'a>(
        &mut self,
        set: SetId,
        keys: impl Iterator<Item = &'a A>,
    ) {
        let mut keys = keys.peekable();
        if keys.peek().is_none() {
            return;
        }
        self.removes_endpoints |= matches!(set, SetId::ClassEndpoints(..));
        if let Some(batch) = self.batch.as_deref_mut() {
            let family = self.ip_family;
            for k in keys {
                k.with_atoms(&mut |key| batch.delete(family, set, key));
                self.ops += 1;
            }
            return;
        }
        let _ = write!(
            self.text,
            "delete element {} {TABLE} {} {{ ",
            self.family,
            set.name()
        );
        for (i, k) in keys.enumerate() {
            if i > 0 {
                self.text.push_str(", ");
            }
            let _ = write!(self.text, "{k}");
            self.ops += 1;
        }
        self.text.push_str(" }\n");
    }

    fn rule(&mut self, rule: &RuleDef) {
        self.ops += 1;
        let _ = writeln!(
            self.text,
            "add rule {} {TABLE} {} {} comment \"{}\"",
            self.family, rule.chain, rule.text, rule.id
        );
    }

    fn finish(self) -> Transaction {
        Transaction {
            text: self.text,
            operations: self.ops,
            removes_endpoints: self.removes_endpoints,
        }
    }
}

#[cfg(test)]
mod tests;
