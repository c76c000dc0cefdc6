//! From the proxy's state to nft transactions.
//!
//! The planner keeps a record of every element it believes the kernel holds, with the Service
//! ports that want it (several ports may want the same element, such as a shared ClusterIP). A
//! partial sync recomputes only the changed Services' elements and sends the difference; a full
//! sync replaces the table in one transaction. Both are atomic: the kernel never sees a state in
//! which a REJECT is gone but the DNAT not yet there.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{Endpoint, IpFamily, ServiceKey, ServicePortName};
use kp_core::track::{ProxyState, ServicePortState};

use crate::element::{render_elements, Atom, NoEndpointVerdict, Tuple};
use crate::layout::{self, PlanConfig, Route, RuleDef, SetId};
use crate::names::{self, TABLE};

/// One nft transaction, ready for `nft -f -`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transaction {
    /// The nft script.
    pub text: String,
    /// Objects, rules and individual element additions/deletions it contains.
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

/// The Service ports (or the node) that want one element, each with the value it wants; the
/// kernel holds the first one's.
type Owners = Vec<(Owner, Option<Tuple>)>;

/// An element of a set (value `None`) or map.
type Element = (SetId, Tuple, Option<Tuple>);

/// Per-Service-port facts the metrics need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PortFacts {
    /// `internalTrafficPolicy: Local` with endpoints elsewhere but none here.
    no_local_internal: bool,
    /// `externalTrafficPolicy: Local` with endpoints elsewhere but none here.
    no_local_external: bool,
}

/// The planner for one IP family's table.
#[derive(Debug)]
pub struct Planner {
    cfg: PlanConfig,
    /// Every element the kernel holds: set → key → owners with their values. The kernel holds
    /// the first owner's value.
    sets: HashMap<SetId, HashMap<Tuple, Owners>>,
    /// What each owner contributed, to take it back.
    owned: HashMap<Owner, Vec<(SetId, Tuple)>>,
    owners: HashMap<ServicePortName, Owner>,
    facts: HashMap<Owner, PortFacts>,
    by_service: HashMap<ServiceKey, Vec<ServicePortName>>,
    next_owner: Owner,
    /// Dispatch classes whose objects and rules exist.
    classes: BTreeSet<(Route, u32)>,
    /// Affinity timeouts whose objects and rules exist.
    affinities: BTreeSet<u32>,
    /// Whether a full sync has programmed the table.
    programmed: bool,
}

pub use kp_core::node::NodeContext;

/// A planned change to the set of elements: how each touched key looked before.
#[derive(Default)]
struct Touched {
    /// Full rebuilds send everything, so they skip the bookkeeping.
    off: bool,
    before: HashMap<(SetId, Tuple), Option<Option<Tuple>>>,
    order: Vec<(SetId, Tuple)>,
}

impl Planner {
    /// A planner that has programmed nothing yet.
    pub fn new(cfg: PlanConfig) -> Self {
        Planner {
            cfg,
            sets: HashMap::new(),
            owned: HashMap::new(),
            owners: HashMap::new(),
            facts: HashMap::new(),
            by_service: HashMap::new(),
            next_owner: NODE_OWNER + 1,
            classes: BTreeSet::new(),
            affinities: BTreeSet::new(),
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
        self.facts.values().fold((0, 0), |(i, e), f| {
            (
                i + u64::from(f.no_local_internal),
                e + u64::from(f.no_local_external),
            )
        })
    }

    /// A transaction that replaces the table with one built from `state`.
    pub fn full(&mut self, state: &ProxyState, node: &NodeContext) -> Transaction {
        self.invalidate();
        let mut touched = Touched {
            off: true,
            ..Touched::default()
        };
        self.set_node_elements(node, &mut touched);
        for key in state.service_keys() {
            self.replace_service(state, key, &mut touched);
        }
        self.programmed = true;
        let mut tx = TxWriter::new(self.cfg.family);
        let fam = names::family(self.cfg.family);
        tx.line(format!("add table {fam} {TABLE}"));
        tx.line(format!("delete table {fam} {TABLE}"));
        tx.line(format!("add table {fam} {TABLE}"));
        for chain in layout::chains() {
            match chain.hook {
                Some(hook) => tx.object(format!(
                    "add chain {fam} {TABLE} {} {{ {hook} }}",
                    chain.name
                )),
                None => tx.object(format!("add chain {fam} {TABLE} {}", chain.name)),
            }
        }
        let mut sets: Vec<SetId> = SetId::FIXED.to_vec();
        sets.extend(self.class_sets());
        for id in &sets {
            tx.declare(*id);
        }
        for id in &sets {
            if let Some(elements) = self.sets.get(id) {
                let els = elements
                    .iter()
                    .filter_map(|(k, owners)| owners.first().map(|(_, v)| (k, v.as_ref())));
                tx.add_elements(*id, els);
            }
        }
        for rule in self.all_rules() {
            tx.rule(&rule);
        }
        tx.finish()
    }

    /// A transaction with only what changed for `services` (and the node, if `node_changed`).
    /// Must follow a successful [`Planner::full`].
    pub fn partial<'a>(
        &mut self,
        state: &ProxyState,
        services: impl IntoIterator<Item = &'a ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
    ) -> Transaction {
        let classes_before = self.classes.clone();
        let affinities_before = self.affinities.clone();
        let mut touched = Touched::default();
        if node_changed {
            self.set_node_elements(node, &mut touched);
            // A zone change can change every Service's selection.
            let all: Vec<ServiceKey> = state
                .service_keys()
                .cloned()
                .chain(self.by_service.keys().cloned())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            for key in &all {
                self.replace_service(state, key, &mut touched);
            }
        } else {
            for key in services {
                self.replace_service(state, key, &mut touched);
            }
        }
        let mut tx = TxWriter::new(self.cfg.family);
        let new_classes: Vec<(Route, u32)> =
            self.classes.difference(&classes_before).copied().collect();
        let new_affinities: Vec<u32> = self
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
        self.write_element_changes(&touched, &mut tx);
        for &(route, n) in &new_classes {
            for rule in layout::class_rules(&self.cfg, route, n) {
                tx.rule(&rule);
            }
        }
        for &t in &new_affinities {
            for rule in layout::affinity_rules(&self.cfg, t) {
                tx.rule(&rule);
            }
        }
        tx.finish()
    }

    /// Every set and map the table holds, beyond the fixed ones.
    fn class_sets(&self) -> Vec<SetId> {
        let mut v = Vec::new();
        for &(route, n) in &self.classes {
            v.push(SetId::Class(route, n));
            v.push(SetId::ClassEndpoints(route, n));
        }
        for &t in &self.affinities {
            v.push(SetId::Affinity(t));
            v.push(SetId::AffinityVips(t));
            v.push(SetId::AffinityNodePorts(t));
        }
        v
    }

    /// Every rule the table holds, in order per chain.
    pub fn all_rules(&self) -> Vec<RuleDef> {
        let mut rules = layout::fixed_rules(&self.cfg);
        for &(route, n) in &self.classes {
            rules.extend(layout::class_rules(&self.cfg, route, n));
        }
        for &t in &self.affinities {
            rules.extend(layout::affinity_rules(&self.cfg, t));
        }
        rules
    }

    /// Affinity timeouts in use.
    pub fn affinity_timeouts(&self) -> Vec<u32> {
        self.affinities.iter().copied().collect()
    }

    /// The endpoints (`address . port`) an entry key currently dispatches to, over every route.
    pub fn endpoints_of(&self, key: &Tuple) -> BTreeSet<Tuple> {
        let mut out = BTreeSet::new();
        for &(route, n) in &self.classes {
            let in_class = self
                .sets
                .get(&SetId::Class(route, n))
                .is_some_and(|m| m.contains_key(key));
            if !in_class {
                continue;
            }
            let Some(map) = self.sets.get(&SetId::ClassEndpoints(route, n)) else {
                continue;
            };
            for slot in 0..n {
                let mut k = key.atoms().to_vec();
                k.push(Atom::Slot(slot));
                if let Some(Some(v)) = map
                    .get(&Tuple::new(k))
                    .and_then(|o| o.first())
                    .map(|(_, v)| v)
                {
                    out.insert(v.clone());
                }
            }
        }
        out
    }

    /// Every set and map the table holds.
    pub fn all_sets(&self) -> Vec<SetId> {
        let mut v = SetId::FIXED.to_vec();
        v.extend(self.class_sets());
        v
    }

    /// The elements the kernel should hold in `set`, with their values.
    pub fn expected_elements(&self, set: SetId) -> BTreeMap<Tuple, Option<Tuple>> {
        self.sets
            .get(&set)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, owners)| owners.first().map(|(_, v)| (k.clone(), v.clone())))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn set_node_elements(&mut self, node: &NodeContext, touched: &mut Touched) {
        self.release(NODE_OWNER, touched);
        let fam = self.cfg.family;
        let mut els = Vec::new();
        for net in IpNet::aggregate(&in_family(&node.local_cidrs, fam)) {
            els.push((SetId::PodCidrs, Tuple::new(vec![Atom::Net(net)]), None));
        }
        for net in IpNet::aggregate(&in_family(&node.node_port_addresses, fam)) {
            els.push((
                SetId::NodePortAddresses,
                Tuple::new(vec![Atom::Net(net)]),
                None,
            ));
        }
        self.claim(NODE_OWNER, els, touched);
    }

    /// Recomputes one Service's elements.
    fn replace_service(&mut self, state: &ProxyState, key: &ServiceKey, touched: &mut Touched) {
        // Compute first, while the current slot assignment is still recorded, so endpoints
        // that stay keep their slots.
        let computed: Vec<(ServicePortName, Vec<Element>, PortFacts)> = state
            .service_state(key)
            .iter()
            .map(|sps| {
                let (els, facts) =
                    contributions(&self.cfg, sps, &|route, key, n| self.slots(route, key, n));
                (sps.port.name.clone(), els, facts)
            })
            .collect();
        for name in self.by_service.remove(key).unwrap_or_default() {
            if let Some(owner) = self.owners.remove(&name) {
                self.release(owner, touched);
                self.facts.remove(&owner);
            }
        }
        if computed.is_empty() {
            return;
        }
        let mut names_of = Vec::new();
        for (name, els, facts) in computed {
            let owner = self.next_owner;
            self.next_owner += 1;
            self.claim(owner, els, touched);
            self.owners.insert(name.clone(), owner);
            self.facts.insert(owner, facts);
            names_of.push(name);
        }
        self.by_service.insert(key.clone(), names_of);
    }

    /// The endpoints in slots `0..n` of `key` in class (`route`, `n`), if it is there.
    fn slots(&self, route: Route, key: &Tuple, n: u32) -> Option<Vec<Tuple>> {
        if !self.sets.get(&SetId::Class(route, n))?.contains_key(key) {
            return None;
        }
        let map = self.sets.get(&SetId::ClassEndpoints(route, n))?;
        (0..n)
            .map(|slot| {
                let mut k = key.atoms().to_vec();
                k.push(Atom::Slot(slot));
                map.get(&Tuple::new(k))?.first()?.1.clone()
            })
            .collect()
    }

    fn note(&self, touched: &mut Touched, set: SetId, key: &Tuple) {
        if touched.off {
            return;
        }
        let k = (set, key.clone());
        if touched.before.contains_key(&k) {
            return;
        }
        let before = self
            .sets
            .get(&set)
            .and_then(|m| m.get(key))
            .and_then(|owners| owners.first())
            .map(|(_, v)| v.clone());
        touched.before.insert(k.clone(), before);
        touched.order.push(k);
    }

    fn release(&mut self, owner: Owner, touched: &mut Touched) {
        for (set, key) in self.owned.remove(&owner).unwrap_or_default() {
            self.note(touched, set, &key);
            if let Some(m) = self.sets.get_mut(&set) {
                if let Some(owners) = m.get_mut(&key) {
                    owners.retain(|(o, _)| *o != owner);
                    if owners.is_empty() {
                        m.remove(&key);
                    }
                }
            }
        }
    }

    fn claim(&mut self, owner: Owner, els: Vec<Element>, touched: &mut Touched) {
        let mut mine = Vec::with_capacity(els.len());
        for (set, key, value) in els {
            match set {
                SetId::Class(r, n) => {
                    self.classes.insert((r, n));
                }
                SetId::AffinityVips(t) | SetId::AffinityNodePorts(t) => {
                    self.affinities.insert(t);
                }
                _ => {}
            }
            self.note(touched, set, &key);
            let owners = self
                .sets
                .entry(set)
                .or_default()
                .entry(key.clone())
                .or_default();
            if owners.iter().any(|(o, _)| *o == owner) {
                continue;
            }
            owners.push((owner, value));
            mine.push((set, key));
        }
        self.owned.insert(owner, mine);
    }

    fn write_element_changes(&self, touched: &Touched, tx: &mut TxWriter) {
        let mut deletes: BTreeMap<SetId, Vec<&Tuple>> = BTreeMap::new();
        let mut adds: BTreeMap<SetId, Vec<(&Tuple, Option<&Tuple>)>> = BTreeMap::new();
        for k in &touched.order {
            let (set, key) = k;
            let before = touched.before.get(k).cloned().flatten();
            let after = self
                .sets
                .get(set)
                .and_then(|m| m.get(key))
                .and_then(|owners| owners.first())
                .map(|(_, v)| v);
            match (&before, after) {
                (Some(b), Some(a)) if b.as_ref() == a.as_ref() => {}
                (Some(_), Some(a)) => {
                    deletes.entry(*set).or_default().push(key);
                    adds.entry(*set).or_default().push((key, a.as_ref()));
                }
                (Some(_), None) => deletes.entry(*set).or_default().push(key),
                (None, Some(a)) => adds.entry(*set).or_default().push((key, a.as_ref())),
                (None, None) => {}
            }
        }
        for (set, keys) in deletes {
            tx.delete_elements(set, keys.into_iter());
        }
        for (set, els) in adds {
            tx.add_elements(set, els.into_iter());
        }
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

fn vip_key(ip: IpAddr, sps: &ServicePortState) -> Tuple {
    Tuple::new(vec![
        Atom::Ip(ip),
        Atom::Proto(sps.port.name.protocol),
        Atom::Port(sps.port.port),
    ])
}

fn nodeport_key(port: u16, sps: &ServicePortState) -> Tuple {
    Tuple::new(vec![Atom::Proto(sps.port.name.protocol), Atom::Port(port)])
}

/// Previous slot assignment of an entry: (route, key, endpoint count) → endpoint per slot.
type PriorSlots<'a> = &'a dyn Fn(Route, &Tuple, u32) -> Option<Vec<Tuple>>;

/// The elements that send `key` to `endpoints`: the key in its class set, and one slot per
/// endpoint in the class map. When the count is unchanged, endpoints that stay keep their slot
/// and newcomers take the vacated ones, so replacing one endpoint rewrites one slot.
fn dispatch(
    route: Route,
    key: &Tuple,
    endpoints: &[&Endpoint],
    prior: PriorSlots<'_>,
    out: &mut Vec<Element>,
) {
    let n = endpoints.len() as u32;
    let wanted: Vec<Tuple> = endpoints
        .iter()
        .map(|ep| Tuple::new(vec![Atom::Ip(ep.ip), Atom::Port(ep.port)]))
        .collect();
    let mut slots: Vec<Option<Tuple>> = vec![None; wanted.len()];
    if let Some(previous) = prior(route, key, n) {
        for (slot, ep) in previous.into_iter().enumerate() {
            if wanted.contains(&ep) {
                slots[slot] = Some(ep);
            }
        }
    }
    let kept: Vec<Tuple> = slots.iter().flatten().cloned().collect();
    let mut newcomers = wanted.iter().filter(|w| !kept.contains(w));
    for slot in slots.iter_mut().filter(|s| s.is_none()) {
        *slot = newcomers.next().cloned();
    }
    out.push((SetId::Class(route, n), key.clone(), None));
    for (slot, ep) in slots.into_iter().enumerate() {
        let mut k: Vec<Atom> = key.atoms().to_vec();
        k.push(Atom::Slot(slot as u32));
        out.push((SetId::ClassEndpoints(route, n), Tuple::new(k), ep));
    }
}

fn no_endpoints(set: SetId, key: &Tuple, has_any: bool, out: &mut Vec<Element>) {
    let verdict = if has_any {
        NoEndpointVerdict::Drop
    } else {
        NoEndpointVerdict::Reject
    };
    out.push((
        set,
        key.clone(),
        Some(Tuple::new(vec![Atom::Verdict(verdict)])),
    ));
}

/// Everything one Service port puts into the table.
fn contributions(
    cfg: &PlanConfig,
    sps: &ServicePortState,
    prior: PriorSlots<'_>,
) -> (Vec<Element>, PortFacts) {
    let fam = cfg.family;
    let port = &sps.port;
    let sel = &sps.endpoints;
    let of_family = |eps: &[Endpoint]| -> Vec<Endpoint> {
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
    let mut out = Vec::new();
    let mut facts = PortFacts::default();

    for ip in port.cluster_ips.iter().filter(|ip| IpFamily::of(ip) == fam) {
        out.push((SetId::ClusterIps, Tuple::new(vec![Atom::Ip(*ip)]), None));
        let key = vip_key(*ip, sps);
        if internal.is_empty() {
            no_endpoints(SetId::NoEndpointVips, &key, has_any, &mut out);
            facts.no_local_internal = has_any && port.internal_traffic_local;
        } else {
            dispatch(Route::Vips, &key, &internal, prior, &mut out);
            if let Some(t) = affinity {
                out.push((SetId::AffinityVips(t), key, None));
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
    let mut entries: Vec<(Tuple, Route)> = Vec::new();
    for (ip, is_lb) in externals {
        let key = vip_key(ip, sps);
        if is_lb && !port.load_balancer_source_ranges.is_empty() {
            out.push((SetId::FirewallVips, key.clone(), None));
            for net in IpNet::aggregate(&in_family(&port.load_balancer_source_ranges, fam)) {
                let mut k = key.atoms().to_vec();
                k.push(Atom::Net(net));
                out.push((SetId::FirewallAllow, Tuple::new(k), None));
            }
        }
        entries.push((key, Route::Vips));
    }
    if let Some(np) = port.node_port {
        entries.push((nodeport_key(np, sps), Route::NodePorts));
    }
    for (key, route) in entries {
        if ext_local {
            out.push((route.local_policy_set(), key.clone(), None));
            if !cluster.is_empty() {
                dispatch(route.local_source(), &key, &cluster, prior, &mut out);
            }
        } else {
            out.push((route.masquerade_set(), key.clone(), None));
        }
        if external.is_empty() {
            no_endpoints(route.no_endpoint_set(), &key, has_any, &mut out);
            facts.no_local_external |= has_any && ext_local;
        } else {
            dispatch(route, &key, &external, prior, &mut out);
            if let Some(t) = affinity {
                out.push((route.affinity_set(t), key, None));
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
        out.push((
            SetId::Hairpin,
            Tuple::new(vec![Atom::Ip(ip), Atom::Ip(ip)]),
            None,
        ));
    }
    (out, facts)
}

/// Renders statements in the order the kernel needs: objects, element deletions, element
/// additions, rules.
struct TxWriter {
    family: &'static str,
    objects: String,
    deletes: String,
    adds: String,
    rules: String,
    ops: usize,
    removes_endpoints: bool,
}

impl TxWriter {
    fn new(family: IpFamily) -> Self {
        TxWriter {
            family: names::family(family),
            objects: String::new(),
            deletes: String::new(),
            adds: String::new(),
            rules: String::new(),
            ops: 0,
            removes_endpoints: false,
        }
    }

    fn line(&mut self, s: String) {
        self.objects.push_str(&s);
        self.objects.push('\n');
    }

    fn object(&mut self, s: String) {
        self.line(s);
        self.ops += 1;
    }

    fn declare(&mut self, id: SetId) {
        let kind = if id.is_map() { "map" } else { "set" };
        let decl = id.declaration(match self.family {
            "ip" => IpFamily::V4,
            _ => IpFamily::V6,
        });
        self.object(format!(
            "add {kind} {} {TABLE} {} {{ {decl} }}",
            self.family,
            id.name()
        ));
    }

    fn add_elements<'a>(
        &mut self,
        set: SetId,
        els: impl Iterator<Item = (&'a Tuple, Option<&'a Tuple>)>,
    ) {
        let els: Vec<_> = els.collect();
        if els.is_empty() {
            return;
        }
        self.ops += els.len();
        let _ = write!(
            self.adds,
            "add element {} {TABLE} {} ",
            self.family,
            set.name()
        );
        render_elements(&mut self.adds, els.into_iter());
        self.adds.push('\n');
    }

    fn delete_elements<'a>(&mut self, set: SetId, keys: impl Iterator<Item = &'a Tuple>) {
        let keys: Vec<_> = keys.collect();
        if keys.is_empty() {
            return;
        }
        self.ops += keys.len();
        self.removes_endpoints |= matches!(set, SetId::ClassEndpoints(..));
        let _ = write!(
            self.deletes,
            "delete element {} {TABLE} {} ",
            self.family,
            set.name()
        );
        render_elements(&mut self.deletes, keys.into_iter().map(|k| (k, None)));
        self.deletes.push('\n');
    }

    fn rule(&mut self, rule: &RuleDef) {
        self.ops += 1;
        let _ = writeln!(
            self.rules,
            "add rule {} {TABLE} {} {} comment \"{}\"",
            self.family, rule.chain, rule.text, rule.id
        );
    }

    fn finish(self) -> Transaction {
        let mut text = self.objects;
        text.push_str(&self.deletes);
        text.push_str(&self.adds);
        text.push_str(&self.rules);
        Transaction {
            text,
            operations: self.ops,
            removes_endpoints: self.removes_endpoints,
        }
    }
}
