//! The ipvs mode's planned state kept between syncs, one Service at a time, so that a change
//! costs what it changes: a one-endpoint change re-plans one Service and names the few virtual
//! servers, set entries and addresses that moved, instead of planning the whole cluster and
//! comparing it with a dump of the kernel (upstream's ipvs proxier re-lists IPVS and the sets
//! on every sync).
//!
//! Each Service has a share: the virtual servers, `kube-ipvs0` addresses, `Local` policy rules
//! and set entries its ports plan ([`Desired::add`], [`Sets::add`]). The whole state is their
//! union, kept with who contributes what:
//!
//! - a virtual server two Services plan (an external IP and port they share) is the share of
//!   the one last in name order, as a plan of every Service in order would leave it, and
//!   passes to the other when that one leaves;
//! - an address, a set entry or a rule stays while any Service's share has it;
//! - a short-circuit mark is given to a Service port the first time it needs one and kept
//!   until its Service no longer does (so it does not move when another port's Service goes).
//!
//! [`Planner::set_service`] replaces one Service's share and returns what changed in the
//! whole ([`Delta`]); the caller programs exactly that. The whole ([`Planner`] as
//! [`crate::Planned`], [`Planner::sets`], [`Planner::bind_addresses`], [`Planner::local`])
//! equals a plan of every Service made in one go (the tests check it over random change
//! sequences), and is what the periodic check compares the kernel with.
//!
//! Memory: the shares are the only copy of the virtual servers (the whole finds each in its
//! owner's share), a share is held as sorted vectors (a map per Service would allocate a
//! node per set and per map however few entries it holds), and the whole counts holders only
//! where there are two or more (an address, set entry or rule held once is counted by being
//! in the whole). Entries and real servers are packed where they can be (`ipset::pack`,
//! [`crate::Reals`]), a Service's name is held once (an `Arc` its virtual servers' owners
//! share). At 10,000 Services × 10 endpoints the planner holds 13.5 MiB (38.8 MiB before the
//! packing, 107 MiB with a map per share and a copied whole).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use kp_core::frontend::Frontends;
use kp_core::model::{IpFamily, ServiceKey as ServiceName};
use kp_core::node::NodeContext;
use kp_core::track::ServicePortState;
use kp_netlink::ipvs::{Service, ServiceKey};

use crate::ipset::{self, Entry, Packed, SetChange, SetName, Sets};
use crate::local::{LocalPolicy, LocalRule};
use crate::{Config, Desired, Planned, VirtualServer};

/// One Service's part of the state, as sorted vectors.
#[derive(Debug, Clone, Default)]
struct Share {
    /// Its virtual servers, sorted by key.
    services: Box<[VirtualServer]>,
    /// The addresses its frontends bind, sorted.
    bind: Box<[IpAddr]>,
    /// Its `Local` rules and the marks it uses, if any (most Services have none: an empty
    /// policy inline is three maps' worth of bytes in every share).
    local: Option<Box<LocalPolicy>>,
    /// Its set entries, per family (in the planner's family order).
    sets: Box<[ShareEntries]>,
}

/// One family's set entries of a share, sorted: packed where they pack ([`ipset::pack`]:
/// 13 bytes an entry instead of 44), as they are otherwise.
#[derive(Debug, Clone, Default)]
struct ShareEntries {
    packed: Box<[(SetName, Packed)]>,
    plain: Box<[(SetName, Entry)]>,
}

impl ShareEntries {
    fn of(sets: Sets) -> ShareEntries {
        let (packed, plain) = sets.into_parts();
        ShareEntries {
            packed: packed.into_boxed_slice(),
            plain: plain.into_boxed_slice(),
        }
    }

    /// The entries of `self` not in `other`.
    fn missing_from<'a>(
        &'a self,
        other: &'a ShareEntries,
    ) -> impl Iterator<Item = (SetName, Entry)> + 'a {
        missing_from(&self.packed, &other.packed)
            .map(|(s, p)| (*s, ipset::unpack(s.set_type(), p)))
            .chain(missing_from(&self.plain, &other.plain).copied())
    }
}

impl Share {
    fn local(&self) -> &LocalPolicy {
        static EMPTY: LocalPolicy = LocalPolicy::EMPTY;
        self.local.as_deref().unwrap_or(&EMPTY)
    }

    fn virtual_server(&self, key: &ServiceKey) -> Option<&VirtualServer> {
        self.services
            .binary_search_by(|v| v.service.key.cmp(key))
            .ok()
            .map(|i| &self.services[i])
    }
}

/// What one or more [`Planner::set_service`] calls changed in the whole state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    /// The virtual servers added, changed or removed, each with what the state held for it
    /// before (`None`: it had none): what the kernel holds, if it was programmed.
    pub virtual_servers: BTreeMap<ServiceKey, Option<Service>>,
    /// Set entries added (`true`) and removed, per family (in the planner's family order).
    sets: Vec<BTreeMap<(SetName, Entry), bool>>,
    /// Addresses `kube-ipvs0` gains.
    pub bind: BTreeSet<IpAddr>,
    /// Addresses `kube-ipvs0` loses.
    pub unbind: BTreeSet<IpAddr>,
    /// Whether the `Local` policy rules changed.
    pub local: bool,
    /// Whether changes are recorded at all ([`Planner::untracked`]: a full sync compares the
    /// whole with the kernel, so recording every entry would only add to its peak memory).
    tracked: bool,
}

impl Delta {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.virtual_servers.is_empty()
            && self.sets.iter().all(BTreeMap::is_empty)
            && self.bind.is_empty()
            && self.unbind.is_empty()
            && !self.local
    }

    /// The set entry changes of the planner's family number `family`: additions first.
    pub fn set_changes(&self, family: usize) -> Vec<SetChange> {
        let Some(changes) = self.sets.get(family) else {
            return Vec::new();
        };
        let adds = changes
            .iter()
            .filter(|(_, add)| **add)
            .map(|((s, e), _)| SetChange::Add(*s, *e));
        let dels = changes
            .iter()
            .filter(|(_, add)| !**add)
            .map(|((s, e), _)| SetChange::Del(*s, *e));
        adds.chain(dels).collect()
    }

    fn note_virtual_server(&mut self, key: ServiceKey, before: Option<&Service>) {
        if self.tracked {
            self.virtual_servers
                .entry(key)
                .or_insert_with(|| before.cloned());
        }
    }

    fn note_address(&mut self, ip: IpAddr, bound: bool) {
        if !self.tracked {
            return;
        }
        // Bound then unbound within one delta (or the reverse) is no change.
        let (to, from) = if bound {
            (&mut self.bind, &mut self.unbind)
        } else {
            (&mut self.unbind, &mut self.bind)
        };
        if !from.remove(&ip) {
            to.insert(ip);
        }
    }

    fn note_entry(&mut self, family: usize, set: SetName, entry: Entry, added: bool) {
        if !self.tracked {
            return;
        }
        let changes = &mut self.sets[family];
        // Added then removed within one delta (or the reverse) is no change.
        if changes.get(&(set, entry)) == Some(&!added) {
            changes.remove(&(set, entry));
        } else {
            changes.insert((set, entry), added);
        }
    }

    fn note_local(&mut self) {
        self.local = self.tracked;
    }
}

/// The whole planned state, kept per Service.
#[derive(Debug, Clone)]
pub struct Planner {
    families: Vec<IpFamily>,
    /// The shares by Service, each name held once (the owners share it).
    shares: BTreeMap<Arc<ServiceName>, Share>,
    /// The Services whose shares plan each virtual server.
    owners: BTreeMap<ServiceKey, Owners>,
    /// The whole state's addresses.
    bind: BTreeSet<IpAddr>,
    /// The whole state's `Local` policy; it gives out the marks.
    local: LocalPolicy,
    /// The whole sets, per family.
    sets: Vec<Sets>,
    /// How many shares hold an address, rule or set entry, where two or more do (one holder
    /// is counted by the item being in the whole).
    bound: BTreeMap<IpAddr, u32>,
    rules: BTreeMap<LocalRule, u32>,
    entries: Vec<BTreeMap<(SetName, Entry), u32>>,
}

/// The Services whose shares plan one virtual server, sorted (the last wins): nearly always
/// one, held without a vector.
#[derive(Debug, Clone)]
enum Owners {
    One(Arc<ServiceName>),
    Many(Vec<Arc<ServiceName>>),
}

impl Owners {
    fn as_slice(&self) -> &[Arc<ServiceName>] {
        match self {
            Owners::One(n) => std::slice::from_ref(n),
            Owners::Many(v) => v,
        }
    }

    /// Adds `name` (if missing).
    fn add(&mut self, name: &Arc<ServiceName>) {
        let mut all = self.as_slice().to_vec();
        if let Err(i) = all.binary_search(name) {
            all.insert(i, name.clone());
            *self = Owners::Many(all);
        }
    }

    /// Removes `name`; whether any is left.
    fn remove(&mut self, name: &ServiceName) -> bool {
        let mut all = self.as_slice().to_vec();
        if let Ok(i) = all.binary_search_by(|n| n.as_ref().cmp(name)) {
            all.remove(i);
        }
        match all.len() {
            0 => return false,
            1 => *self = Owners::One(all.remove(0)),
            _ => *self = Owners::Many(all),
        }
        true
    }
}

/// One more holder (`up`) or one fewer of an item the whole has if `present`, the counts of
/// two or more in `extra`; whether the item enters (up) or leaves (down) the whole.
fn count<K: Ord>(extra: &mut BTreeMap<K, u32>, key: K, present: bool, up: bool) -> bool {
    if up {
        if !present {
            return true;
        }
        *extra.entry(key).or_insert(1) += 1;
        false
    } else {
        match extra.get_mut(&key) {
            Some(c) => {
                *c -= 1;
                if *c == 1 {
                    extra.remove(&key);
                }
                false
            }
            None => present,
        }
    }
}

/// The items of sorted `a` not in sorted `b`.
fn missing_from<'a, T: Ord>(a: &'a [T], b: &'a [T]) -> impl Iterator<Item = &'a T> + 'a {
    a.iter().filter(move |x| b.binary_search(x).is_err())
}

impl Planner {
    /// An empty state for `families` (the order [`Planner::sets`] and [`Delta::sets`] use).
    pub fn new(families: &[IpFamily]) -> Planner {
        Planner {
            families: families.to_vec(),
            shares: BTreeMap::new(),
            owners: BTreeMap::new(),
            bind: BTreeSet::new(),
            local: LocalPolicy::default(),
            sets: families.iter().map(|f| Sets::new(*f)).collect(),
            bound: BTreeMap::new(),
            rules: BTreeMap::new(),
            entries: families.iter().map(|_| BTreeMap::new()).collect(),
        }
    }

    /// The whole state's `kube-ipvs0` addresses.
    pub fn bind_addresses(&self) -> &BTreeSet<IpAddr> {
        &self.bind
    }

    /// The whole state's `Local` policy: marks and rules.
    pub fn local(&self) -> &LocalPolicy {
        &self.local
    }

    /// The whole state's sets, per family.
    pub fn sets(&self) -> &[Sets] {
        &self.sets
    }

    /// The Services planned.
    pub fn services(&self) -> impl Iterator<Item = &ServiceName> + '_ {
        self.shares.keys().map(|n| n.as_ref())
    }

    /// An empty delta for this planner's families.
    pub fn delta(&self) -> Delta {
        Delta {
            sets: vec![BTreeMap::new(); self.families.len()],
            tracked: true,
            ..Delta::default()
        }
    }

    /// A delta that records nothing, for a sync that compares the whole with the kernel.
    pub fn untracked(&self) -> Delta {
        Delta {
            sets: vec![BTreeMap::new(); self.families.len()],
            ..Delta::default()
        }
    }

    /// The virtual server `name`'s share plans for `key`, with `name`'s share taken to be
    /// `own` (a share being replaced is out of the map).
    fn planned_by<'a>(
        &'a self,
        owner: Option<&ServiceName>,
        name: &ServiceName,
        own: Option<&'a Share>,
        key: &ServiceKey,
    ) -> Option<&'a VirtualServer> {
        let owner = owner?;
        let share = if owner == name {
            own?
        } else {
            self.shares.get(owner)?
        };
        share.virtual_server(key)
    }

    /// Plans Service `name` anew from its ports (none: it is gone), NodePorts on
    /// `node_addresses`, and adds what changed in the whole state to `delta`.
    pub fn set_service(
        &mut self,
        name: &ServiceName,
        ports: &[ServicePortState],
        node_addresses: &[IpAddr],
        node: &NodeContext,
        config: &Config,
        delta: &mut Delta,
    ) {
        let new = (!ports.is_empty()).then(|| {
            let mut desired = Desired::new();
            let mut sets: Vec<Sets> = self.families.iter().map(|f| Sets::new(*f)).collect();
            for sps in ports {
                for (family, sets) in self.families.iter().zip(sets.iter_mut()) {
                    let frontends = Frontends::of(sps, *family);
                    desired.add_with(&frontends, node_addresses, config, Some(&mut self.local));
                    sets.add(&frontends, node_addresses, node);
                }
            }
            Share {
                services: desired.services.into_values().collect(),
                bind: desired.bind.into_iter().collect(),
                local: (desired.local != LocalPolicy::EMPTY).then(|| Box::new(desired.local)),
                sets: sets.into_iter().map(ShareEntries::of).collect(),
            }
        });
        let (name, old) = match self.shares.remove_entry(name) {
            Some((n, share)) => (n, Some(share)),
            None => (Arc::new(name.clone()), None),
        };
        // Marks the old share held and the new one does not go back.
        if let Some(old) = &old {
            for port in old.local().marked() {
                let kept = new
                    .as_ref()
                    .is_some_and(|n| n.local().marked().any(|p| p == port));
                if !kept {
                    self.local.release(port);
                }
            }
        }
        self.replace(&name, old.as_ref(), new.as_ref(), delta);
        if let Some(new) = new {
            self.shares.insert(name, new);
        }
    }

    /// Swaps `old` for `new` as `name`'s share in the whole (the shares map is updated by the
    /// caller, after: the owners of a virtual server are looked up in it).
    fn replace(
        &mut self,
        name: &Arc<ServiceName>,
        old: Option<&Share>,
        new: Option<&Share>,
        delta: &mut Delta,
    ) {
        let none = Share::default();
        let (was, will) = (old.unwrap_or(&none), new.unwrap_or(&none));
        // Virtual servers: each one either share plans is decided again.
        let keys: BTreeSet<ServiceKey> = was
            .services
            .iter()
            .chain(will.services.iter())
            .map(|v| v.service.key)
            .collect();
        for key in keys {
            let current = self.owners.get(&key).map(Owners::as_slice);
            let wants = will.virtual_server(&key).is_some();
            // The last owner before, and once `name` is in (it plans the key) or out.
            let before_owner = current.and_then(|o| o.last()).map(|n| n.as_ref());
            let others_last = current
                .and_then(|o| o.iter().rev().find(|n| *n != name))
                .map(|n| n.as_ref());
            let name_ref: &ServiceName = name;
            let after_owner = match (wants, others_last) {
                (true, Some(other)) => Some(other.max(name_ref)),
                (true, None) => Some(name_ref),
                (false, other) => other,
            };
            let before = self.planned_by(before_owner, name, old, &key);
            let after = self.planned_by(after_owner, name, new, &key);
            if before != after {
                delta.note_virtual_server(key, before.map(|v| &v.service));
            }
            if wants {
                match self.owners.get_mut(&key) {
                    Some(owners) => owners.add(name),
                    None => {
                        self.owners.insert(key, Owners::One(name.clone()));
                    }
                }
            } else if let Some(owners) = self.owners.get_mut(&key) {
                if !owners.remove(name) {
                    self.owners.remove(&key);
                }
            }
        }
        // Addresses and rules: counted.
        for ip in missing_from(&was.bind, &will.bind) {
            let present = self.bind.contains(ip);
            if count(&mut self.bound, *ip, present, false) {
                self.bind.remove(ip);
                delta.note_address(*ip, false);
            }
        }
        for ip in missing_from(&will.bind, &was.bind) {
            let present = self.bind.contains(ip);
            if count(&mut self.bound, *ip, present, true) {
                self.bind.insert(*ip);
                delta.note_address(*ip, true);
            }
        }
        let (was_rules, will_rules) = (was.local().all_rules(), will.local().all_rules());
        for r in was_rules.difference(will_rules) {
            let present = self.local.all_rules().contains(r);
            if count(&mut self.rules, *r, present, false) {
                self.local.remove(r);
                delta.note_local();
            }
        }
        for r in will_rules.difference(was_rules) {
            let present = self.local.all_rules().contains(r);
            if count(&mut self.rules, *r, present, true) {
                self.local.add(*r);
                delta.note_local();
            }
        }
        // Set entries: counted per family.
        for i in 0..self.families.len() {
            let empty = ShareEntries::default();
            let was = was.sets.get(i).unwrap_or(&empty);
            let will = will.sets.get(i).unwrap_or(&empty);
            let changes = will
                .missing_from(was)
                .map(|e| (e, true))
                .chain(was.missing_from(will).map(|e| (e, false)));
            for ((set, entry), up) in changes {
                let present = self.sets[i].get(set).contains(&entry);
                if count(&mut self.entries[i], (set, entry), present, up) {
                    if up {
                        self.sets[i].insert(set, entry);
                    } else {
                        self.sets[i].remove(set, &entry);
                    }
                    delta.note_entry(i, set, entry, up);
                }
            }
        }
    }

    /// Plans every Service of `services` (with their ports) anew and drops the others:
    /// a full sync's plan, against the planner's own record.
    pub fn set_all<'a>(
        &mut self,
        services: impl IntoIterator<Item = (&'a ServiceName, Vec<ServicePortState>)>,
        node_addresses: &[IpAddr],
        node: &NodeContext,
        config: &Config,
        delta: &mut Delta,
    ) {
        let mut seen = BTreeSet::new();
        for (name, ports) in services {
            self.set_service(name, &ports, node_addresses, node, config, delta);
            seen.insert(name.clone());
        }
        let gone: Vec<ServiceName> = self
            .shares
            .keys()
            .filter(|n| !seen.contains(n.as_ref()))
            .map(|n| ServiceName::clone(n))
            .collect();
        for name in gone {
            self.set_service(&name, &[], node_addresses, node, config, delta);
        }
    }
}

impl Planned for Planner {
    fn virtual_server(&self, key: &ServiceKey) -> Option<&VirtualServer> {
        let owner = self.owners.get(key)?.as_slice().last()?;
        self.shares.get(owner)?.virtual_server(key)
    }

    fn virtual_servers(&self) -> Box<dyn Iterator<Item = (&ServiceKey, &VirtualServer)> + '_> {
        Box::new(
            self.owners
                .keys()
                .filter_map(|k| self.virtual_server(k).map(|v| (k, v))),
        )
    }
}

#[cfg(test)]
mod tests;
