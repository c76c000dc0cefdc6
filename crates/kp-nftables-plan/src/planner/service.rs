//! What one Service port puts into the table: the elements of each of its frontends in the
//! table's family ([`kp_core::frontend`]), and each frontend's dispatch to its endpoints.
//!
//! | frontend | elements |
//! |---|---|
//! | ClusterIP | `cluster-ips`; `vips-N` and `vips-N-endpoints`, or `no-endpoint-vips`; `affinity-T-vips` |
//! | external IP, LoadBalancer IP | `masquerade-vips`, or `local-policy-vips` and `local-source-vips-N`; `vips-N`, or `no-endpoint-vips`; `affinity-T-vips`; with source ranges `firewall-vips` and `firewall-allow` |
//! | NodePort | the same in the `nodeports` sets, keyed by `l4proto . dport` |
//! | every endpoint on this node | `hairpin` |

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::frontend::{Frontend, FrontendKind, Frontends, NoEndpoints, TrafficPolicy};
use kp_core::model::{Endpoint, Protocol, ServiceKey};
use kp_core::node::NodeContext;
use kp_core::track::{ProxyState, ServicePortState};

use super::record::{Ctx, PortFacts, Rank, Touched, Wants};
use crate::element::{Atom, NoEndpointVerdict, Packed};
use crate::layout::{PlanConfig, Route, SetId};

/// Everything one Service port puts into the table of `cfg`'s family.
fn contributions<const K: usize, const V: usize>(
    cfg: &PlanConfig,
    node: &NodeContext,
    sps: &ServicePortState,
    prior: PriorSlots<'_, K, V>,
) -> (Wants<K, V>, PortFacts) {
    let fronts = Frontends::of(sps, cfg.family);
    let mut out = Wants::new();
    let mut facts = PortFacts::default();
    // Hairpin: an endpoint reaching itself through any of this port's frontends. Only
    // endpoints on this node can do that here (a remote pod's Service traffic is translated on
    // its own node), so only they need an element.
    let mut hairpin: BTreeSet<IpAddr> = BTreeSet::new();
    for f in fronts.iter() {
        frontend_elements(node, &f, prior, &mut out, &mut facts);
        hairpin.extend(
            f.endpoints
                .iter()
                .chain(f.short_circuit)
                .filter(|e| e.is_local)
                .map(|e| e.ip),
        );
    }
    for ip in hairpin {
        out.element(SetId::Hairpin, &[Atom::Ip(ip), Atom::Ip(ip)]);
    }
    (out, facts)
}

/// The elements of one frontend.
fn frontend_elements<const K: usize, const V: usize>(
    node: &NodeContext,
    f: &Frontend<'_>,
    prior: PriorSlots<'_, K, V>,
    out: &mut Wants<K, V>,
    facts: &mut PortFacts,
) {
    let (key, route) = match f.address {
        Some(ip) => (vip_key(ip, f.protocol, f.port).to_vec(), Route::Vips),
        None => (nodeport_key(f.protocol, f.port).to_vec(), Route::NodePorts),
    };
    if let (FrontendKind::ClusterIp, Some(ip)) = (f.kind, f.address) {
        out.element(SetId::ClusterIps, &[Atom::Ip(ip)]);
    }
    if let (Some(ranges), Some(ip)) = (f.source_ranges(), f.address) {
        out.element(SetId::FirewallVips, &key);
        let mut allowed: Vec<IpNet> = ranges.of_family().copied().collect();
        if f.admits_node(node) {
            allowed.push(IpNet::from(ip));
        }
        for net in IpNet::aggregate(&allowed) {
            let mut k = key.clone();
            k.push(Atom::Net(net));
            out.element(SetId::FirewallAllow, &k);
        }
    }
    if f.is_external() {
        match f.policy {
            TrafficPolicy::Local => {
                out.element(route.local_policy_set(), &key);
                if !f.short_circuit.is_empty() {
                    let all = sorted(f.short_circuit);
                    dispatch(route.local_source(), &key, &all, prior, out);
                }
            }
            TrafficPolicy::Cluster => out.element(route.masquerade_set(), &key),
        }
    }
    match f.no_endpoints() {
        Some(verdict) => {
            let verdict = match verdict {
                NoEndpoints::Reject => NoEndpointVerdict::Reject,
                NoEndpoints::Drop => NoEndpointVerdict::Drop,
            };
            out.entry(route.no_endpoint_set(), &key, &[Atom::Verdict(verdict)]);
            let no_local = f.has_endpoints && f.policy == TrafficPolicy::Local;
            if f.is_external() {
                facts.no_local_external |= no_local;
            } else {
                facts.no_local_internal |= no_local;
            }
        }
        None => {
            dispatch(route, &key, &sorted(f.endpoints), prior, out);
            if let Some(t) = f.affinity {
                out.element(route.affinity_set(t), &key);
            }
        }
    }
}

/// Endpoints by address and port, the order slots are filled in.
fn sorted<'e>(eps: &[&'e Endpoint]) -> Vec<&'e Endpoint> {
    let mut v: Vec<&Endpoint> = eps.to_vec();
    v.sort_by_key(|e| (e.ip, e.port));
    v
}

/// `daddr . l4proto . dport`.
fn vip_key(ip: IpAddr, protocol: Protocol, port: u16) -> [Atom; 3] {
    [Atom::Ip(ip), Atom::Proto(protocol), Atom::Port(port)]
}

/// `l4proto . dport`.
fn nodeport_key(protocol: Protocol, port: u16) -> [Atom; 2] {
    [Atom::Proto(protocol), Atom::Port(port)]
}

pub(super) type PriorSlots<'a, const K: usize, const V: usize> =
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

impl<const K: usize, const V: usize> Ctx<'_, K, V> {
    /// Recomputes one Service's elements.
    pub(super) fn replace_service(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        key: &ServiceKey,
        touched: &mut Touched<K, V>,
    ) {
        // Compute first, while the current slot assignment is still recorded, so endpoints
        // that stay keep their slots.
        let els = &*self.els;
        let seed = self.seed;
        let computed: Vec<(Wants<K, V>, PortFacts, Box<str>)> = state
            .service_state(key)
            .iter()
            .map(|sps| {
                let (wants, facts) = contributions(self.cfg, node, sps, &|route, key, n| {
                    els.dispatch_value(route, n, key)
                        .or_else(|| seed.and_then(|s| s.get(&(route, n, *key))).map(|e| &e[..]))
                });
                (wants, facts, sps.port.name.port.as_str().into())
            })
            .collect();
        for owner in self.meta.by_service.remove(key).unwrap_or_default().iter() {
            self.release(*owner, touched);
            self.meta.facts.remove(owner);
            self.meta.ranks.remove(owner);
            self.meta.free.push(*owner);
        }
        // Ports that put nothing into this table (another family's) need no owner.
        let computed: Vec<(Wants<K, V>, PortFacts, Box<str>)> = computed
            .into_iter()
            .filter(|(w, f, _)| !w.is_empty() || *f != PortFacts::default())
            .collect();
        if computed.is_empty() {
            return;
        }
        let mut owners = Vec::with_capacity(computed.len());
        let service = std::sync::Arc::new(key.clone());
        for (wants, facts, port) in computed {
            let owner = self.meta.new_owner();
            self.meta.ranks.insert(owner, Rank(service.clone(), port));
            self.claim(owner, wants, touched);
            if facts != PortFacts::default() {
                self.meta.facts.insert(owner, facts);
            }
            owners.push(owner);
        }
        self.meta.by_service.insert(key.clone(), owners.into());
    }
}
