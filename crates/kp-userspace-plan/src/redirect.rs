//! The redirect table planner: from the proxy's state to nft transactions for the
//! `inet kube-proxy-userspace` table, whole ([`RedirectPlanner::full`]) or as the element
//! changes of the Services that changed ([`RedirectPlanner::partial`]).
//!
//! What one Service port puts into the table, per frontend ([`kp_core::frontend`]) and family:
//!
//! | frontend | elements |
//! |---|---|
//! | with endpoints for every client | `redirect-vips` (`redirect-nodeports` for a NodePort) |
//! | `Local` policy, endpoints elsewhere only | `redirect-*` and `no-local-*` (outside clients drop; pods and the node short-circuit) |
//! | no usable endpoint of the family | `no-endpoint-*` : `goto reject-packet` |
//! | `internalTrafficPolicy: Local`, endpoints elsewhere only | `no-endpoint-vips` : `drop` |
//! | a ClusterIP | `cluster-ips` (what is still addressed to one after the redirect is an unknown port) |
//! | a LoadBalancer IP with source ranges | `firewall-vips`, `firewall-allow` |
//!
//! The planner keeps a record of every element it believes the kernel holds, with the Services
//! that want it, so a partial sync sends only the difference and the I/O crate can compare the
//! kernel's table with [`RedirectPlanner::expected_sets`] and
//! [`RedirectPlanner::expected_chains`]. Endpoints are not in the table at all: a change of
//! endpoints that leaves a frontend's verdict alone sends nothing.

use std::collections::{BTreeMap, HashMap};

use ipnet::IpNet;
use kp_core::frontend::{Frontend, FrontendKind, Frontends, NoEndpoints};
use kp_core::model::{IpFamily, Protocol, ServiceKey};
use kp_core::node::{LocalInterface, NodeContext};
use kp_core::track::{Changes, ProxyState};
use kp_nftables_plan::element::render_elements;
pub use kp_nftables_plan::element::{Atom, NoEndpointVerdict, Tuple};
pub use kp_nftables_plan::Transaction;

use crate::layout::{self, RedirectConfig, SetId, SetKind};
use crate::names::{FAMILY, TABLE};

/// Who wants an element: the node's own settings (id 0) or a Service.
type OwnerId = u32;
const NODE_OWNER: OwnerId = 0;

/// One element as the record holds it: each owner with the value it wants (maps), in rank order
/// (the node first, then Services by namespace and name); the first one's value is the one in
/// the kernel, whatever order the claims came in. The nftables mode's rule, which the balancer
/// follows too, so a partial sync leaves an element where a full sync puts it.
#[derive(Clone, Debug, Default)]
struct Owned {
    owners: Vec<(OwnerId, Option<Tuple>)>,
}

impl Owned {
    /// The value in the kernel: the first owner's by rank.
    fn value(&self) -> Option<Option<Tuple>> {
        self.owners.first().map(|(_, v)| v.clone())
    }
}

/// What one owner wants: elements with their values.
type Wants = Vec<(SetId, Tuple, Option<Tuple>)>;

/// Plans the `inet kube-proxy-userspace` table.
#[derive(Debug)]
pub struct RedirectPlanner {
    cfg: RedirectConfig,
    /// Detect-local by interface, as the last full sync's node context had it (a setting of
    /// the process: it changes with no sync).
    local_interface: Option<LocalInterface>,
    programmed: bool,
    elements: BTreeMap<SetId, BTreeMap<Tuple, Owned>>,
    /// Each owner's elements.
    owned: HashMap<OwnerId, Vec<(SetId, Tuple)>>,
    owner_ids: HashMap<ServiceKey, OwnerId>,
    /// Each Service owner's Service, its rank (the node's owner has none: it comes first).
    ranks: HashMap<OwnerId, ServiceKey>,
    next_owner: OwnerId,
}

impl RedirectPlanner {
    /// A planner that has programmed nothing yet.
    pub fn new(cfg: RedirectConfig) -> RedirectPlanner {
        RedirectPlanner {
            cfg,
            local_interface: None,
            programmed: false,
            elements: BTreeMap::new(),
            owned: HashMap::new(),
            owner_ids: HashMap::new(),
            ranks: HashMap::new(),
            next_owner: NODE_OWNER + 1,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RedirectConfig {
        &self.cfg
    }

    /// Whether a full sync has programmed the table (else the next sync must be full).
    pub fn programmed(&self) -> bool {
        self.programmed
    }

    /// Forgets what the kernel holds, so the next sync is full (after a failed transaction).
    pub fn invalidate(&mut self) {
        *self = RedirectPlanner::new(self.cfg.clone());
    }

    /// The transaction for a sync: [`RedirectPlanner::full`] when `full`, when the node's
    /// context changed or before the first full sync; else [`RedirectPlanner::partial`].
    pub fn sync(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        changes: &Changes,
        full: bool,
    ) -> Transaction {
        if full || changes.node_changed || !self.programmed {
            self.full(state, node)
        } else {
            self.partial(state, node, changes)
        }
    }

    /// A transaction that replaces the table with one built from `state`.
    pub fn full(&mut self, state: &ProxyState, node: &NodeContext) -> Transaction {
        self.invalidate();
        self.local_interface = node.local_interface.clone();
        let node_wants = node_elements(&self.cfg, node);
        self.claim(NODE_OWNER, node_wants);
        for key in state.service_keys() {
            let wants = service_elements(state, node, key);
            if !wants.is_empty() {
                let owner = self.owner_of(key);
                self.claim(owner, wants);
            }
        }
        self.programmed = true;
        let mut w = Writer::default();
        w.line(format!("add table {FAMILY} {TABLE}"));
        w.line(format!("delete table {FAMILY} {TABLE}"));
        w.line(format!(
            "add table {FAMILY} {TABLE} {{ comment \"{}\"; }}",
            layout::table_comment(&self.cfg, self.local_interface.as_ref())
        ));
        for chain in layout::chains() {
            match chain.hook {
                Some(hook) => w.object(format!(
                    "add chain {FAMILY} {TABLE} {} {{ {hook} }}",
                    chain.name
                )),
                None => w.object(format!("add chain {FAMILY} {TABLE} {}", chain.name)),
            }
        }
        for set in SetId::all() {
            let kind = if set.kind.is_map() { "map" } else { "set" };
            w.object(format!(
                "add {kind} {FAMILY} {TABLE} {} {{ {} }}",
                set.name(),
                set.declaration()
            ));
        }
        for (set, els) in &self.elements {
            let values: Vec<(Tuple, Option<Tuple>)> = els
                .iter()
                .filter_map(|(k, o)| o.value().map(|v| (k.clone(), v)))
                .collect();
            w.elements("add", *set, &values);
        }
        for rule in layout::rules(&self.cfg, self.local_interface.as_ref()) {
            w.object(format!(
                "add rule {FAMILY} {TABLE} {} {} comment \"{}\"",
                rule.chain, rule.text, rule.id
            ));
        }
        w.finish()
    }

    /// The element changes that bring the table from its last sync to `state`, for the
    /// Services `changes` names: work in proportion to them. The node's context is taken as
    /// unchanged (a change of it needs [`RedirectPlanner::full`]; [`RedirectPlanner::sync`]
    /// decides).
    pub fn partial(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        changes: &Changes,
    ) -> Transaction {
        // Every element touched, with its kernel value before.
        let mut before: BTreeMap<(SetId, Tuple), Option<Option<Tuple>>> = BTreeMap::new();
        for key in &changes.services {
            let wants = service_elements(state, node, key);
            let owner = match self.owner_ids.get(key) {
                Some(o) => *o,
                None if wants.is_empty() => continue,
                None => self.owner_of(key),
            };
            for (set, k) in self.owned.get(&owner).into_iter().flatten() {
                let v = self.value(*set, k);
                before.entry((*set, k.clone())).or_insert(v);
            }
            for (set, k, _) in &wants {
                let v = self.value(*set, k);
                before.entry((*set, k.clone())).or_insert(v);
            }
            self.release(owner);
            if wants.is_empty() {
                self.owner_ids.remove(key);
                self.ranks.remove(&owner);
            } else {
                self.claim(owner, wants);
            }
        }
        let mut deletes: BTreeMap<SetId, Vec<(Tuple, Option<Tuple>)>> = BTreeMap::new();
        let mut adds: BTreeMap<SetId, Vec<(Tuple, Option<Tuple>)>> = BTreeMap::new();
        for ((set, k), was) in before {
            let now = self.value(set, &k);
            if was == now {
                continue;
            }
            if was.is_some() {
                deletes.entry(set).or_default().push((k.clone(), None));
            }
            if let Some(v) = now {
                adds.entry(set).or_default().push((k, v));
            }
        }
        let mut w = Writer::default();
        for (set, els) in &deletes {
            w.elements("delete", *set, els);
        }
        for (set, els) in &adds {
            w.elements("add", *set, els);
        }
        w.finish()
    }

    fn value(&self, set: SetId, key: &Tuple) -> Option<Option<Tuple>> {
        self.elements.get(&set)?.get(key)?.value()
    }

    fn owner_of(&mut self, key: &ServiceKey) -> OwnerId {
        if let Some(o) = self.owner_ids.get(key) {
            return *o;
        }
        let o = self.next_owner;
        self.next_owner += 1;
        self.owner_ids.insert(key.clone(), o);
        self.ranks.insert(o, key.clone());
        o
    }

    fn claim(&mut self, owner: OwnerId, wants: Wants) {
        let mut keys = Vec::with_capacity(wants.len());
        for (set, key, value) in wants {
            let owned = self
                .elements
                .entry(set)
                .or_default()
                .entry(key.clone())
                .or_default();
            if owned.owners.iter().any(|(o, _)| *o == owner) {
                continue;
            }
            let ranks = &self.ranks;
            let at = owned
                .owners
                .partition_point(|(o, _)| ranks.get(o) < ranks.get(&owner));
            owned.owners.insert(at, (owner, value));
            keys.push((set, key));
        }
        self.owned.insert(owner, keys);
    }

    fn release(&mut self, owner: OwnerId) {
        for (set, key) in self.owned.remove(&owner).unwrap_or_default() {
            let Some(els) = self.elements.get_mut(&set) else {
                continue;
            };
            if let Some(owned) = els.get_mut(&key) {
                owned.owners.retain(|(o, _)| *o != owner);
                if owned.owners.is_empty() {
                    els.remove(&key);
                }
            }
        }
    }

    /// Chain name → rule ids (comments) in order, as the kernel should hold them.
    pub fn expected_chains(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = layout::chains()
            .iter()
            .map(|c| (c.name.to_string(), Vec::new()))
            .collect();
        for rule in layout::rules(&self.cfg, self.local_interface.as_ref()) {
            out.entry(rule.chain.to_string()).or_default().push(rule.id);
        }
        out
    }

    /// Set or map name → its elements (key → value), as the kernel should hold them; the
    /// shape `kp_nftables::readback::compare` takes (every set is ours, so none is `None`).
    pub fn expected_sets(&self) -> BTreeMap<String, Option<BTreeMap<Tuple, Option<Tuple>>>> {
        SetId::all()
            .map(|set| (set.name(), Some(self.expected_elements(set))))
            .collect()
    }

    /// The elements of one set as the kernel should hold them.
    pub fn expected_elements(&self, set: SetId) -> BTreeMap<Tuple, Option<Tuple>> {
        self.elements
            .get(&set)
            .into_iter()
            .flatten()
            .filter_map(|(k, o)| o.value().map(|v| (k.clone(), v)))
            .collect()
    }

    /// Number of elements the record holds, over every set.
    pub fn element_count(&self) -> usize {
        self.elements.values().map(BTreeMap::len).sum()
    }
}

/// The node's own elements: detect-local's pod networks, the Service CIDRs, and the NodePort
/// addresses when they are restricted.
fn node_elements(cfg: &RedirectConfig, node: &NodeContext) -> Wants {
    let mut out = Wants::new();
    for family in IpFamily::ALL {
        let mut nets = |kind: SetKind, list: &[IpNet]| {
            let of_family: Vec<IpNet> = list
                .iter()
                .filter(|n| IpFamily::of_net(n) == family)
                .map(IpNet::trunc)
                .collect();
            for net in IpNet::aggregate(&of_family) {
                out.push((SetId { kind, family }, Tuple::new([Atom::Net(net)]), None));
            }
        };
        nets(SetKind::PodCidrs, &node.local_cidrs);
        nets(SetKind::ServiceCidrs, &node.service_cidrs);
        if cfg.node_ports_restricted {
            nets(SetKind::NodePortAddresses, &node.node_port_addresses);
        }
    }
    out
}

/// Every element the ports of Service `key` want, in both families.
fn service_elements(state: &ProxyState, node: &NodeContext, key: &ServiceKey) -> Wants {
    let mut out = Wants::new();
    for sps in state.service_state(key) {
        for family in IpFamily::ALL {
            let fronts = Frontends::of(&sps, family);
            for f in fronts.iter() {
                frontend_elements(node, &f, &mut out);
            }
        }
    }
    out
}

/// The elements of one frontend.
fn frontend_elements(node: &NodeContext, f: &Frontend<'_>, out: &mut Wants) {
    let id = |kind| SetId {
        kind,
        family: f.family,
    };
    let proto = Atom::Proto(f.protocol);
    let port = Atom::Port(f.port);
    let (key, vip) = match f.address {
        Some(ip) => (vec![Atom::Ip(ip), proto, port], true),
        None => (vec![proto, port], false),
    };
    let pick = |vips: SetKind, nodeports: SetKind| id(if vip { vips } else { nodeports });
    if let (FrontendKind::ClusterIp, Some(ip)) = (f.kind, f.address) {
        out.push((id(SetKind::ClusterIps), Tuple::new([Atom::Ip(ip)]), None));
    }
    if let (Some(ranges), Some(ip)) = (f.source_ranges(), f.address) {
        out.push((id(SetKind::FirewallVips), Tuple::new(key.clone()), None));
        let mut allowed: Vec<IpNet> = ranges.of_family().map(IpNet::trunc).collect();
        if f.admits_node(node) {
            allowed.push(IpNet::from(ip));
        }
        for net in IpNet::aggregate(&allowed) {
            let mut k = key.clone();
            k.push(Atom::Net(net));
            out.push((id(SetKind::FirewallAllow), Tuple::new(k), None));
        }
    }
    let redirect = pick(SetKind::RedirectVips, SetKind::RedirectNodePorts);
    let verdict = |v| Some(Tuple::new([Atom::Verdict(v)]));
    let no_endpoint = pick(SetKind::NoEndpointVips, SetKind::NoEndpointNodePorts);
    if f.protocol == Protocol::Sctp {
        // The proxy listens for TCP and UDP only: an SCTP frontend is rejected, as a Service
        // without endpoints, never redirected to a port nothing answers on.
        out.push((
            no_endpoint,
            Tuple::new(key),
            verdict(NoEndpointVerdict::Reject),
        ));
        return;
    }
    match f.no_endpoints() {
        None => out.push((redirect, Tuple::new(key), None)),
        // Endpoints elsewhere only, with the short-circuit of an external `Local` policy:
        // pods and the node itself are redirected, outside clients dropped before that.
        Some(NoEndpoints::Drop) if f.is_external() && !f.short_circuit.is_empty() => {
            let no_local = pick(SetKind::NoLocalVips, SetKind::NoLocalNodePorts);
            out.push((no_local, Tuple::new(key.clone()), None));
            out.push((redirect, Tuple::new(key), None));
        }
        Some(NoEndpoints::Drop) => out.push((
            no_endpoint,
            Tuple::new(key),
            verdict(NoEndpointVerdict::Drop),
        )),
        Some(NoEndpoints::Reject) => out.push((
            no_endpoint,
            Tuple::new(key),
            verdict(NoEndpointVerdict::Reject),
        )),
    }
}

/// Writes nft statements, counting operations (objects, rules, elements).
#[derive(Default)]
struct Writer {
    text: String,
    operations: usize,
}

impl Writer {
    fn line(&mut self, s: String) {
        self.text.push_str(&s);
        self.text.push('\n');
    }

    fn object(&mut self, s: String) {
        self.line(s);
        self.operations += 1;
    }

    /// `add|delete element inet kube-proxy-userspace SET { … }`, nothing for no elements.
    fn elements(&mut self, verb: &str, set: SetId, els: &[(Tuple, Option<Tuple>)]) {
        if els.is_empty() {
            return;
        }
        self.text
            .push_str(&format!("{verb} element {FAMILY} {TABLE} {} ", set.name()));
        render_elements(&mut self.text, els.iter().map(|(k, v)| (k, v.as_ref())));
        self.text.push('\n');
        self.operations += els.len();
    }

    fn finish(self) -> Transaction {
        Transaction {
            text: self.text,
            operations: self.operations,
            removes_endpoints: false,
        }
    }
}

#[cfg(test)]
mod tests;
