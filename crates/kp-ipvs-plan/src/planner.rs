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
//! whole ([`Delta`]); the caller programs exactly that. The whole ([`Planner::desired`],
//! [`Planner::sets`]) equals a plan of every Service made in one go (the tests check it over
//! random change sequences), and is what the periodic check compares the kernel with.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kp_core::frontend::Frontends;
use kp_core::model::{IpFamily, ServiceKey as ServiceName};
use kp_core::node::NodeContext;
use kp_core::track::ServicePortState;
use kp_netlink::ipvs::{Service, ServiceKey};

use crate::ipset::{Entry, SetChange, SetName, Sets};
use crate::local::LocalRule;
use crate::{Config, Desired};

/// One Service's part of the state.
#[derive(Debug, Clone)]
struct Share {
    desired: Desired,
    /// Per family, in the planner's family order.
    sets: Vec<Sets>,
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
        self.virtual_servers
            .entry(key)
            .or_insert_with(|| before.cloned());
    }

    fn note_address(&mut self, ip: IpAddr, bound: bool) {
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
        let changes = &mut self.sets[family];
        // Added then removed within one delta (or the reverse) is no change.
        if changes.get(&(set, entry)) == Some(&!added) {
            changes.remove(&(set, entry));
        } else {
            changes.insert((set, entry), added);
        }
    }
}

/// The whole planned state, kept per Service.
#[derive(Debug, Clone)]
pub struct Planner {
    families: Vec<IpFamily>,
    shares: BTreeMap<ServiceName, Share>,
    /// The whole state; its `Local` policy gives out the marks.
    whole: Desired,
    /// The whole sets, per family.
    sets: Vec<Sets>,
    /// The Services whose shares plan each virtual server (the last in order wins).
    owners: BTreeMap<ServiceKey, BTreeSet<ServiceName>>,
    /// How many shares hold each address, rule and set entry.
    bound: BTreeMap<IpAddr, u32>,
    rules: BTreeMap<LocalRule, u32>,
    entries: Vec<BTreeMap<(SetName, Entry), u32>>,
}

/// Adds `n` (±1) to `key`'s count; whether the count went from or to zero.
fn count<K: Ord>(counts: &mut BTreeMap<K, u32>, key: K, up: bool) -> bool {
    if up {
        let c = counts.entry(key).or_insert(0);
        *c += 1;
        *c == 1
    } else {
        match counts.get_mut(&key) {
            Some(c) if *c > 1 => {
                *c -= 1;
                false
            }
            Some(_) => {
                counts.remove(&key);
                true
            }
            None => false,
        }
    }
}

impl Planner {
    /// An empty state for `families` (the order [`Planner::sets`] and [`Delta::sets`] use).
    pub fn new(families: &[IpFamily]) -> Planner {
        Planner {
            families: families.to_vec(),
            shares: BTreeMap::new(),
            whole: Desired::new(),
            sets: families.iter().map(|f| Sets::new(*f)).collect(),
            owners: BTreeMap::new(),
            bound: BTreeMap::new(),
            rules: BTreeMap::new(),
            entries: families.iter().map(|_| BTreeMap::new()).collect(),
        }
    }

    /// The whole state's virtual servers, addresses and `Local` policy.
    pub fn desired(&self) -> &Desired {
        &self.whole
    }

    /// The whole state's sets, per family.
    pub fn sets(&self) -> &[Sets] {
        &self.sets
    }

    /// The Services planned.
    pub fn services(&self) -> impl Iterator<Item = &ServiceName> + '_ {
        self.shares.keys()
    }

    /// An empty delta for this planner's families.
    pub fn delta(&self) -> Delta {
        Delta {
            sets: vec![BTreeMap::new(); self.families.len()],
            ..Delta::default()
        }
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
            let mut share = Share {
                desired: Desired::new(),
                sets: self.families.iter().map(|f| Sets::new(*f)).collect(),
            };
            for sps in ports {
                for (family, sets) in self.families.iter().zip(share.sets.iter_mut()) {
                    let frontends = Frontends::of(sps, *family);
                    share.desired.add_with(
                        &frontends,
                        node_addresses,
                        config,
                        Some(&mut self.whole.local),
                    );
                    sets.add(&frontends, node_addresses, node);
                }
            }
            share
        });
        let old = self.shares.remove(name);
        // Marks the old share held and the new one does not go back.
        if let Some(old) = &old {
            for port in old.desired.local.marked() {
                let kept = new
                    .as_ref()
                    .is_some_and(|n| n.desired.local.marked().any(|p| p == port));
                if !kept {
                    self.whole.local.release(port);
                }
            }
        }
        self.replace(name, old.as_ref(), new.as_ref(), delta);
        if let Some(new) = new {
            self.shares.insert(name.clone(), new);
        }
    }

    /// Swaps `old` for `new` as `name`'s share in the whole (the shares map is updated by the
    /// caller, after: the owners of a virtual server are looked up in it).
    fn replace(
        &mut self,
        name: &ServiceName,
        old: Option<&Share>,
        new: Option<&Share>,
        delta: &mut Delta,
    ) {
        let empty = Desired::new();
        let (was, will) = (
            old.map_or(&empty, |s| &s.desired),
            new.map_or(&empty, |s| &s.desired),
        );
        // Virtual servers: each one either share plans is decided again below.
        let keys: BTreeSet<ServiceKey> = was
            .services
            .keys()
            .chain(will.services.keys())
            .copied()
            .collect();
        for key in &keys {
            let owners = self.owners.entry(*key).or_default();
            if will.services.contains_key(key) {
                owners.insert(name.clone());
            } else {
                owners.remove(name);
            }
        }
        for key in keys {
            let owner = self.owners.get(&key).and_then(|o| o.last()).cloned();
            let planned = match &owner {
                None => None,
                Some(o) if o == name => will.services.get(&key).cloned(),
                Some(o) => self
                    .shares
                    .get(o)
                    .and_then(|s| s.desired.services.get(&key))
                    .cloned(),
            };
            if owner.is_none() {
                self.owners.remove(&key);
            }
            let before = self.whole.services.get(&key);
            if before == planned.as_ref() {
                continue;
            }
            delta.note_virtual_server(key, before.map(|v| &v.service));
            match planned {
                Some(vs) => self.whole.services.insert(key, vs),
                None => self.whole.services.remove(&key),
            };
        }
        // Addresses and rules: counted.
        for ip in was.bind.difference(&will.bind) {
            if count(&mut self.bound, *ip, false) {
                self.whole.bind.remove(ip);
                delta.note_address(*ip, false);
            }
        }
        for ip in will.bind.difference(&was.bind) {
            if count(&mut self.bound, *ip, true) {
                self.whole.bind.insert(*ip);
                delta.note_address(*ip, true);
            }
        }
        let (was_rules, will_rules) = (was.local.all_rules(), will.local.all_rules());
        for r in was_rules.difference(will_rules) {
            if count(&mut self.rules, *r, false) {
                self.whole.local.remove(r);
                delta.local = true;
            }
        }
        for r in will_rules.difference(was_rules) {
            if count(&mut self.rules, *r, true) {
                self.whole.local.add(*r);
                delta.local = true;
            }
        }
        // Set entries: counted per family.
        for i in 0..self.families.len() {
            let family = self.families[i];
            let none = Sets::new(family);
            let was = old.map_or(&none, |s| &s.sets[i]);
            let will = new.map_or(&none, |s| &s.sets[i]);
            for change in crate::ipset::diff(will, was) {
                let (set, entry, up) = match change {
                    SetChange::Add(s, e) => (s, e, true),
                    SetChange::Del(s, e) => (s, e, false),
                };
                if count(&mut self.entries[i], (set, entry), up) {
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
            .filter(|n| !seen.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            self.set_service(&name, &[], node_addresses, node, config, delta);
        }
    }
}

#[cfg(test)]
mod tests;
