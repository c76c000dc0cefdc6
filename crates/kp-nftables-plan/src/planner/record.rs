//! The element record: every element the planner believes the kernel holds, with the Service
//! ports (owners) that want it, packed into fixed-size keys and values. A partial sync releases
//! a changed Service's claims and claims its new wants, noting each touched key's value before
//! ([`Touched`]), from which the writer derives the element changes.
//!
//! The record is compact, because it is as large as the cluster: keys and values are packed
//! into fixed-size byte arrays (16 and 8 bytes in an IPv4 table, 40 and 24 in an IPv6 one), an
//! element wanted by one port (nearly all of them) costs one hash-map slot, and an entry's
//! dispatch (its key in a class set and one map element per endpoint slot) is kept as one
//! record holding the endpoint list. At 10k Services × 10 endpoints the IPv4 record is a few
//! megabytes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use ipnet::IpNet;
use kp_core::model::{IpFamily, ServiceKey};
use kp_core::node::NodeContext;

use crate::element::{Atom, Packed, Tuple};
use crate::layout::{self, PlanConfig, Route, RuleDef, SetId};

/// Who wants an element: a Service port, or the node itself.
pub(super) type Owner = u32;
pub(super) const NODE_OWNER: Owner = 0;

/// Where an owner stands when several want one element (two Services listing the same external
/// IP and port, which nothing in Kubernetes prevents): the node first, then Services in
/// namespace/name order, each one's ports by name. The element holds the first one's value
/// whatever order the claims came in, so a partial sync leaves it where a full sync of the same
/// state puts it; the userspace mode's balancer and redirect table rank the same way.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Rank(pub(super) Arc<ServiceKey>, pub(super) Box<str>);

/// Per-Service-port facts the metrics need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PortFacts {
    /// `internalTrafficPolicy: Local` with endpoints elsewhere but none here.
    pub(super) no_local_internal: bool,
    /// `externalTrafficPolicy: Local` with endpoints elsewhere but none here.
    pub(super) no_local_external: bool,
}

/// Key and value sizes of an IPv4 table's packed elements: the longest key is a
/// `firewall-allow` element (address, protocol, port, network), the longest value an endpoint
/// (address, port).
pub(super) const V4_KEY: usize = 16;
pub(super) const V4_VALUE: usize = 8;
/// The same for IPv6.
pub(super) const V6_KEY: usize = 40;
pub(super) const V6_VALUE: usize = 24;

/// What the planner knows besides the elements themselves.
#[derive(Debug)]
pub(super) struct Meta {
    /// The owners (one per port) of each Service's elements.
    pub(super) by_service: HashMap<ServiceKey, Box<[Owner]>>,
    /// Facts of the ports that have any.
    pub(super) facts: HashMap<Owner, PortFacts>,
    /// Each Service port owner's [`Rank`] (the node has none: it comes first).
    pub(super) ranks: HashMap<Owner, Rank>,
    /// Owner numbers free for reuse, and the next never used.
    pub(super) free: Vec<Owner>,
    pub(super) next_owner: Owner,
    /// Dispatch classes whose objects and rules exist.
    pub(super) classes: BTreeSet<(Route, u32)>,
    /// Affinity timeouts whose objects and rules exist.
    pub(super) affinities: BTreeSet<u32>,
}

impl Meta {
    /// Every rule of the table, in order per chain: the fixed ones, then those of the
    /// classes and affinity timeouts whose objects exist.
    pub(super) fn rules(&self, cfg: &PlanConfig) -> Vec<RuleDef> {
        layout::rules_for(cfg, &self.classes, &self.affinities)
    }

    pub(super) fn new() -> Self {
        Meta {
            by_service: HashMap::new(),
            facts: HashMap::new(),
            ranks: HashMap::new(),
            free: Vec::new(),
            next_owner: NODE_OWNER + 1,
            classes: BTreeSet::new(),
            affinities: BTreeSet::new(),
        }
    }

    /// Whether `a` comes before `b` for an element both want.
    pub(super) fn precedes(&self, a: Owner, b: Owner) -> bool {
        self.ranks.get(&a) < self.ranks.get(&b)
    }

    pub(super) fn new_owner(&mut self) -> Owner {
        self.free.pop().unwrap_or_else(|| {
            self.next_owner += 1;
            self.next_owner - 1
        })
    }
}

/// The element record, in the packed sizes of the table's family.
#[derive(Debug)]
pub(super) enum Store {
    V4(Elements<V4_KEY, V4_VALUE>),
    V6(Elements<V6_KEY, V6_VALUE>),
}

impl Store {
    pub(super) fn new(family: IpFamily) -> Self {
        match family {
            IpFamily::V4 => Store::V4(Elements::default()),
            IpFamily::V6 => Store::V6(Elements::default()),
        }
    }
}

/// A plain element's first owner and the value it wants (the one the kernel holds).
#[derive(Clone, Copy, Debug)]
pub(super) struct Held<const V: usize> {
    pub(super) owner: Owner,
    /// Empty for a set element.
    pub(super) value: Packed<V>,
    /// Whether other owners want it too (listed in [`Elements::plain_more`]).
    pub(super) more: bool,
}

/// An entry's dispatch as its first owner wants it: the endpoint in each slot.
#[derive(Clone, Debug)]
pub(super) struct Dispatch<const V: usize> {
    pub(super) owner: Owner,
    pub(super) endpoints: Box<[Packed<V>]>,
    /// Whether other owners want it too (listed in [`Elements::dispatch_more`]).
    pub(super) more: bool,
}

/// A record several owners may want: the first owner's value is the one held, the others wait
/// in a side list (`Elements::plain_more`, `Elements::dispatch_more`).
pub(super) trait Shared<T> {
    fn first_owner(&self) -> Owner;
    fn more(&mut self) -> &mut bool;
    /// Another owner's value takes over; returns the one it replaced.
    fn take_over(&mut self, owner: Owner, value: T) -> (Owner, T);
}

impl<const V: usize> Shared<Packed<V>> for Held<V> {
    fn first_owner(&self) -> Owner {
        self.owner
    }
    fn more(&mut self) -> &mut bool {
        &mut self.more
    }
    fn take_over(&mut self, owner: Owner, value: Packed<V>) -> (Owner, Packed<V>) {
        (
            std::mem::replace(&mut self.owner, owner),
            std::mem::replace(&mut self.value, value),
        )
    }
}

impl<const V: usize> Shared<Slots<V>> for Dispatch<V> {
    fn first_owner(&self) -> Owner {
        self.owner
    }
    fn more(&mut self) -> &mut bool {
        &mut self.more
    }
    fn take_over(&mut self, owner: Owner, endpoints: Slots<V>) -> (Owner, Slots<V>) {
        (
            std::mem::replace(&mut self.owner, owner),
            std::mem::replace(&mut self.endpoints, endpoints),
        )
    }
}

/// Adds `owner`'s claim (wanting `value`) to `record`, which another owner holds; the owners
/// waiting for it (`waiting[key]`) are kept in [`Rank`] order behind the holder, the first of
/// all. A claimant that comes before the holder takes the record over.
pub(super) fn join_claim<T, R: Shared<T>, MK: std::hash::Hash + Eq>(
    record: &mut R,
    waiting: &mut HashMap<MK, Vec<(Owner, T)>>,
    key: MK,
    owner: Owner,
    value: T,
    meta: &Meta,
) {
    let list = waiting.entry(key).or_default();
    if list.iter().any(|(o, _)| *o == owner) {
        return;
    }
    if meta.precedes(owner, record.first_owner()) {
        let held = record.take_over(owner, value);
        list.insert(0, held);
    } else {
        let at = list.partition_point(|(o, _)| meta.precedes(*o, owner));
        list.insert(at, (owner, value));
    }
    *record.more() = true;
}

/// Drops `owner`'s claim on `record` (whose waiting owners are `waiting[key]`, in [`Rank`]
/// order, so the first takes over); returns whether no owner is left, so the caller removes
/// the record.
pub(super) fn drop_claim<T, R: Shared<T>, MK: std::hash::Hash + Eq>(
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
pub(super) type DispatchKey<const K: usize> = (Route, u32, Packed<K>);

/// Endpoints per slot.
pub(super) type Slots<const V: usize> = Box<[Packed<V>]>;

/// What one owner contributed, to take it back.
#[derive(Debug)]
pub(super) struct Owned<const K: usize> {
    pub(super) plain: Box<[(SetId, Packed<K>)]>,
    pub(super) dispatch: Box<[(Route, u32, Packed<K>)]>,
}

/// Every element the kernel holds, with its owners.
#[derive(Debug)]
pub(super) struct Elements<const K: usize, const V: usize> {
    /// Elements of every set and map but the dispatch classes.
    pub(super) plain: HashMap<SetId, HashMap<Packed<K>, Held<V>>>,
    /// Further owners of plain elements wanted by several, in rank order.
    pub(super) plain_more: HashMap<(SetId, Packed<K>), Vec<(Owner, Packed<V>)>>,
    /// Dispatch records per class (route, endpoint count), by entry key: the entry is in the
    /// class set, and `key . slot` maps to the slot's endpoint in the class map.
    pub(super) dispatch: HashMap<(Route, u32), HashMap<Packed<K>, Dispatch<V>>>,
    /// Further owners of dispatch records wanted by several, in rank order.
    pub(super) dispatch_more: HashMap<DispatchKey<K>, Vec<(Owner, Slots<V>)>>,
    pub(super) owned: HashMap<Owner, Owned<K>>,
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
pub(super) struct Wants<const K: usize, const V: usize> {
    pub(super) plain: Vec<(SetId, Packed<K>, Packed<V>)>,
    /// (route, entry key, endpoint per slot).
    pub(super) dispatch: Vec<(Route, Packed<K>, Vec<Packed<V>>)>,
}

impl<const K: usize, const V: usize> Wants<K, V> {
    pub(super) fn new() -> Self {
        Wants {
            plain: Vec::new(),
            dispatch: Vec::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.plain.is_empty() && self.dispatch.is_empty()
    }

    pub(super) fn element(&mut self, set: SetId, key: &[Atom]) {
        self.entry(set, key, &[]);
    }

    pub(super) fn entry(&mut self, set: SetId, key: &[Atom], value: &[Atom]) {
        match (Packed::new(key), Packed::new(value)) {
            (Some(k), Some(v)) => self.plain.push((set, k, v)),
            // The sizes fit every element of the family; a planner only sees its own family.
            _ => debug_assert!(false, "element {key:?} : {value:?} does not fit"),
        }
    }
}

/// A planned change to the elements: how each touched key looked before.
pub(super) struct Touched<const K: usize, const V: usize> {
    /// Full rebuilds send everything, so they skip the bookkeeping.
    pub(super) off: bool,
    /// Plain elements: the value before, `None` if absent.
    pub(super) plain: HashMap<(SetId, Packed<K>), Option<Packed<V>>>,
    pub(super) plain_order: Vec<(SetId, Packed<K>)>,
    /// Dispatch records: the endpoints before, `None` if absent.
    pub(super) dispatch: HashMap<DispatchKey<K>, Option<Slots<V>>>,
    pub(super) dispatch_order: Vec<(Route, u32, Packed<K>)>,
}

impl<const K: usize, const V: usize> Touched<K, V> {
    pub(super) fn new(off: bool) -> Self {
        Touched {
            off,
            plain: HashMap::new(),
            plain_order: Vec::new(),
            dispatch: HashMap::new(),
            dispatch_order: Vec::new(),
        }
    }
}

/// The value of a plain element as a `Some` for maps and `None` for sets.
pub(super) fn value_of<const V: usize>(value: &Packed<V>) -> Option<&Packed<V>> {
    (!value.is_empty()).then_some(value)
}

impl<const K: usize, const V: usize> Elements<K, V> {
    /// The value of a plain element, if present.
    pub(super) fn plain_value(&self, set: SetId, key: &Packed<K>) -> Option<Packed<V>> {
        self.plain.get(&set)?.get(key).map(|h| h.value)
    }

    /// The endpoints of a dispatch record, if present.
    pub(super) fn dispatch_value(
        &self,
        route: Route,
        n: u32,
        key: &Packed<K>,
    ) -> Option<&[Packed<V>]> {
        self.dispatch
            .get(&(route, n))?
            .get(key)
            .map(|d| &d.endpoints[..])
    }

    pub(super) fn expected_len(&self, set: SetId) -> usize {
        match set {
            SetId::Class(route, n) => self.dispatch.get(&(route, n)).map_or(0, HashMap::len),
            SetId::ClassEndpoints(route, n) => self
                .dispatch
                .get(&(route, n))
                .map_or(0, |m| m.values().map(|d| d.endpoints.len()).sum()),
            _ => self.plain.get(&set).map_or(0, HashMap::len),
        }
    }

    pub(super) fn lookup(&self, set: SetId, atoms: &[Atom]) -> Option<Option<Tuple>> {
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

    pub(super) fn endpoints_of(&self, meta: &Meta, key: &Tuple) -> BTreeSet<Tuple> {
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

    /// Calls `f` with every element of `set` (key, and value in a map), in no particular
    /// order, without building the set: the atoms are gathered into two buffers reused for
    /// every element.
    pub(super) fn for_each_expected(
        &self,
        set: SetId,
        mut f: impl FnMut(&[Atom], Option<&[Atom]>),
    ) {
        let mut key = Vec::new();
        let mut value = Vec::new();
        match set {
            SetId::Class(route, n) => {
                for k in self
                    .dispatch
                    .get(&(route, n))
                    .into_iter()
                    .flat_map(HashMap::keys)
                {
                    k.gather(&mut key);
                    f(&key, None);
                }
            }
            SetId::ClassEndpoints(route, n) => {
                for (k, d) in self.dispatch.get(&(route, n)).into_iter().flatten() {
                    k.gather(&mut key);
                    let entry = key.len();
                    for (slot, ep) in d.endpoints.iter().enumerate() {
                        key.truncate(entry);
                        key.push(Atom::Slot(slot as u32));
                        ep.gather(&mut value);
                        f(&key, Some(&value));
                    }
                }
            }
            _ => {
                for (k, h) in self.plain.get(&set).into_iter().flatten() {
                    k.gather(&mut key);
                    match value_of(&h.value) {
                        Some(v) => {
                            v.gather(&mut value);
                            f(&key, Some(&value));
                        }
                        None => f(&key, None),
                    }
                }
            }
        }
    }

    pub(super) fn expected(&self, set: SetId) -> BTreeMap<Tuple, Option<Tuple>> {
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
pub(super) struct Ctx<'a, const K: usize, const V: usize> {
    pub(super) cfg: &'a PlanConfig,
    pub(super) meta: &'a mut Meta,
    pub(super) els: &'a mut Elements<K, V>,
    /// Slot assignments to keep where the record has none: the kernel's, when adopting a table
    /// (see `adopt.rs`).
    pub(super) seed: Option<&'a Seed<K, V>>,
}

/// Slot assignments by (route, endpoint count, entry key).
pub(super) type Seed<const K: usize, const V: usize> = HashMap<DispatchKey<K>, Slots<V>>;

impl<const K: usize, const V: usize> Ctx<'_, K, V> {
    pub(super) fn set_node_elements(&mut self, node: &NodeContext, touched: &mut Touched<K, V>) {
        self.release(NODE_OWNER, touched);
        let fam = self.cfg.family;
        let mut wants = Wants::new();
        for net in IpNet::aggregate(&in_family(&node.local_cidrs, fam)) {
            wants.element(SetId::PodCidrs, &[Atom::Net(net)]);
        }
        for net in IpNet::aggregate(&in_family(&node.node_port_addresses, fam)) {
            wants.element(SetId::NodePortAddresses, &[Atom::Net(net)]);
        }
        for net in in_family(&node.service_cidrs, fam) {
            wants.element(SetId::ServiceCidrs, &[Atom::Net(net)]);
        }
        self.claim(NODE_OWNER, wants, touched);
    }

    pub(super) fn note_plain(&self, touched: &mut Touched<K, V>, set: SetId, key: Packed<K>) {
        if touched.off {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = touched.plain.entry((set, key)) {
            e.insert(self.els.plain_value(set, &key));
            touched.plain_order.push((set, key));
        }
    }

    pub(super) fn note_dispatch(
        &self,
        touched: &mut Touched<K, V>,
        route: Route,
        n: u32,
        key: Packed<K>,
    ) {
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

    pub(super) fn release(&mut self, owner: Owner, touched: &mut Touched<K, V>) {
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

    pub(super) fn claim(&mut self, owner: Owner, wants: Wants<K, V>, touched: &mut Touched<K, V>) {
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
                    join_claim(
                        held,
                        &mut els.plain_more,
                        (set, key),
                        owner,
                        value,
                        self.meta,
                    );
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
                    let endpoints = endpoints.into();
                    join_claim(
                        d,
                        &mut els.dispatch_more,
                        (route, n, key),
                        owner,
                        endpoints,
                        self.meta,
                    );
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
}

/// The networks of `family` among `nets`.
pub(super) fn in_family(nets: &[IpNet], family: IpFamily) -> Vec<IpNet> {
    nets.iter()
        .filter(|n| IpFamily::of_net(n) == family)
        .copied()
        .collect()
}
