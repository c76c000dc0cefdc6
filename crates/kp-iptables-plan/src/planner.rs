//! From the proxy's state to [`Restore`]s: full rebuilds and partial restores that rewrite only
//! what changed.
//!
//! The planner records, per Service, what each of its ports contributes, as digests rather
//! than text (the text of 10k Services × 10 endpoints is 40 MB): the name and a 64-bit digest
//! of each of its own nat chains (`KUBE-SVC`, `KUBE-SVL`, `KUBE-EXT`, `KUBE-FW`, `KUBE-SEP`),
//! and a digest of its rules in the shared chains (`KUBE-SERVICES`, `KUBE-NODEPORTS`,
//! `KUBE-EXTERNAL-SERVICES`, `KUBE-PROXY-FIREWALL`); per shared chain, a digest too.
//! A partial restore re-renders only the changed Services and sends:
//! - each of their chains whose digest changed (a `KUBE-SEP` chain of an unchanged endpoint is
//!   left alone), and deletes the chains they no longer have;
//! - the shared chains, re-rendered from the state (their rules only) when a changed Service's
//!   contribution changed, and sent only if their digest differs from what was last planned. Upstream rewrites `KUBE-SERVICES`, `KUBE-NODEPORTS` and
//!   `KUBE-EXTERNAL-SERVICES` on every sync; with iptables-nft a 10k-rule `KUBE-SERVICES` full
//!   of jumps costs about 0.6 s per restore, so an endpoint change (which never touches them)
//!   does not send them.
//!
//! Planning cost is proportional to the changed Services, plus one pass over every Service's
//! shared-chain rules when a shared chain may have changed. A full plan renders every Service
//! to record it, and its [`Restore`] renders the Service chains again while they are written.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;

use kp_core::model::{IpFamily, ServiceKey, ServicePortName};
use kp_core::node::NodeContext;
use kp_core::track::ProxyState;

use crate::names::{self, ChainId};
use crate::render::{
    self, render_service, ChainWrite, Dispatch, PortRules, RenderContext, ServiceChains, Table,
};
use crate::restore::{LazyGroup, LazyGroups, Restore};
use crate::validate::{self, RuleError};

pub use crate::render::PlanConfig;
pub use crate::validate::PlanError;

/// A rule in a built-in chain that reaches one of ours (upstream's `iptablesJumpChains`). The
/// applier makes sure each exists, inserted at the top of its chain.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct JumpRule {
    /// `filter` or `nat`.
    pub table: &'static str,
    /// The built-in chain (`INPUT`, `FORWARD`, `OUTPUT`, `PREROUTING`, `POSTROUTING`).
    pub chain: &'static str,
    /// The rule in `iptables-save` form, without `-A CHAIN `.
    pub args: String,
}

/// A 64-bit digest of a chain's rules (SipHash over each rule and its end, and the count): two
/// rule lists with the same digest are taken to be the same.
pub fn digest<S: AsRef<str>>(rules: &[S]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for r in rules {
        r.as_ref().hash(&mut h);
    }
    h.write_usize(rules.len());
    h.finish()
}

/// Every rule of one rendered Service port through [`validate`]: the first that fails, as
/// (table, chain, rule, why).
fn check_port(family: IpFamily, p: &PortRules) -> Result<(), (Table, String, String, RuleError)> {
    for c in &p.chains {
        validate::chain_name(&c.chain).map_err(|e| (c.table, c.chain.clone(), String::new(), e))?;
        for r in &c.rules {
            validate::rule(family, c.table, &c.chain, r)
                .map_err(|e| (c.table, c.chain.clone(), r.clone(), e))?;
        }
    }
    for d in Dispatch::ALL {
        for r in &p.dispatch[d as usize] {
            validate::rule(family, d.table(), d.chain(), r)
                .map_err(|e| (d.table(), d.chain().to_string(), r.clone(), e))?;
        }
    }
    Ok(())
}

/// Every rule of the fixed and shared chains through [`validate`].
fn check_shared(family: IpFamily, shared: &Shared) -> Result<(), Box<PlanError>> {
    for ((table, chain), rules) in shared {
        for r in rules {
            validate::rule(family, *table, chain, r).map_err(|error| {
                Box::new(PlanError::Shared {
                    family,
                    table: *table,
                    chain: chain.to_string(),
                    rule: r.clone(),
                    error,
                })
            })?;
        }
    }
    Ok(())
}

/// One chain of a Service port as planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ChainRec {
    digest: u64,
    /// Its rules (kept so a full plan trimmed by [`Restore::retain`] still counts what it
    /// writes; the field fits in the padding after `id`, so the record stays 24 bytes).
    rules: u32,
    id: ChainId,
}

/// One Service port as planned.
#[derive(Clone, Debug, Default)]
struct PortRec {
    /// Its nat chains, in the order they are written.
    chains: Vec<ChainRec>,
    /// Rules in those chains.
    rules: u32,
    /// Digest of its rules in the shared chains.
    dispatch: u64,
    no_local_internal: bool,
    no_local_external: bool,
}

/// One Service's recorded plan.
#[derive(Clone, Debug, Default)]
struct ServicePlan {
    /// Its ports that have a ClusterIP of this family, by name.
    ports: Vec<PortRec>,
    /// Its endpoints of this family (every one, usable or not), for large-cluster mode.
    endpoints: usize,
    /// Its ClusterIP of this family: traffic to it on other ports is rejected.
    vip: Option<IpAddr>,
}

impl ServicePlan {
    fn chains(&self) -> impl Iterator<Item = &ChainRec> {
        self.ports.iter().flat_map(|p| p.chains.iter())
    }

    fn no_local(&self) -> (u64, u64) {
        self.ports.iter().fold((0, 0), |(i, e), p| {
            (
                i + u64::from(p.no_local_internal),
                e + u64::from(p.no_local_external),
            )
        })
    }
}

fn dispatch_digest(p: &PortRules) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for rules in &p.dispatch {
        h.write_u64(digest(rules));
    }
    h.finish()
}

fn record_port(p: &PortRules) -> PortRec {
    PortRec {
        chains: p
            .chains
            .iter()
            .filter_map(|c| {
                // Every Service chain is named by `names`, so it has an id.
                ChainId::parse(&c.chain).map(|id| ChainRec {
                    digest: digest(&c.rules),
                    rules: c.rules.len() as u32,
                    id,
                })
            })
            .collect(),
        rules: p.chains.iter().map(|c| c.rules.len() as u32).sum(),
        dispatch: dispatch_digest(p),
        no_local_internal: p.no_local_internal,
        no_local_external: p.no_local_external,
    }
}

/// [`render_service`] with chains, every rule validated: the Service's first refused rule
/// fails it whole (a Service is planned entirely or not at all).
fn render_checked(
    ctx: &RenderContext,
    state: &ProxyState,
    key: &ServiceKey,
) -> Result<Vec<(ServicePortName, PortRules)>, Box<PlanError>> {
    let ports = render_service(ctx, state, key, true);
    for (_, p) in &ports {
        check_port(ctx.family, p).map_err(|(table, chain, rule, error)| {
            Box::new(PlanError::Service {
                service: key.clone(),
                family: ctx.family,
                table,
                chain,
                rule,
                error,
            })
        })?;
    }
    Ok(ports)
}

/// Rules of one port in the shared chains, indexed like [`Dispatch::ALL`].
type PortDispatch = [Vec<String>; 6];

/// Below this many Services a full plan renders on one thread.
const PARALLEL_SERVICES: usize = 512;

/// A Service's record in a full plan: its plan and each port's rules in the shared chains.
type Recorded = (ServiceKey, ServicePlan, Vec<PortDispatch>);

/// Renders, validates and records every Service of `counts` (with its endpoint count), in
/// order: its plan and each port's rules in the shared chains. Services without a port of the
/// family are left out, and so are Services with a rule [`validate`] refuses (returned as
/// errors). Large clusters are rendered on two threads (the restore tool is not running yet,
/// so the full plan has the machine to itself); each keeps only the records, never a chain's
/// text.
fn record_services(
    ctx: &RenderContext,
    state: &ProxyState,
    counts: Vec<(ServiceKey, usize)>,
) -> (Vec<Recorded>, Vec<PlanError>) {
    let record = |services: &[(ServiceKey, usize)]| {
        let mut out = Vec::with_capacity(services.len());
        let mut errors = Vec::new();
        for (key, n) in services {
            let ports = match render_checked(ctx, state, key) {
                Ok(ports) => ports,
                Err(e) => {
                    errors.push(*e);
                    continue;
                }
            };
            if ports.is_empty() {
                continue;
            }
            let mut plan = ServicePlan {
                ports: Vec::with_capacity(ports.len()),
                endpoints: *n,
                vip: service_vip(ctx, state, key),
            };
            let mut dispatch = Vec::with_capacity(ports.len());
            for (_, p) in ports {
                plan.ports.push(record_port(&p));
                dispatch.push(p.dispatch);
            }
            out.push((key.clone(), plan, dispatch));
        }
        (out, errors)
    };
    if counts.len() < PARALLEL_SERVICES {
        return record(&counts);
    }
    let (first, second) = counts.split_at(counts.len() / 2);
    std::thread::scope(|scope| {
        let other = scope.spawn(|| record(second));
        let (mut out, mut errors) = record(first);
        match other.join() {
            Ok((rest, more)) => {
                out.extend(rest);
                errors.extend(more);
            }
            // Rendering has no panicking path; if one appeared, it surfaces as it would have
            // on this thread.
            Err(panic) => std::panic::resume_unwind(panic),
        }
        (out, errors)
    })
}

fn service_vip(ctx: &RenderContext, state: &ProxyState, key: &ServiceKey) -> Option<IpAddr> {
    state
        .service_ports(key)
        .iter()
        .flat_map(|p| p.cluster_ips.iter())
        .find(|ip| IpFamily::of(ip) == ctx.family)
        .copied()
}

/// The target of a rule and its options: what follows its last `-j ` (the target comes last).
fn jump_target(rule: &str) -> &str {
    match rule.rsplit_once(" -j ") {
        Some((_, target)) => target,
        None => rule.strip_prefix("-j ").unwrap_or(""),
    }
}

/// The shared chains' rules, in the order a restore writes them.
type Shared = BTreeMap<(Table, &'static str), Vec<String>>;

/// What the planner recorded of each shared chain: digest and rule count.
type SharedRec = BTreeMap<(Table, &'static str), (u64, usize)>;

/// Every chain a planner planned, with its digest, to compare what the kernel holds with
/// ([`Planner::index`]).
#[derive(Clone, Debug, Default)]
pub struct ChainIndex {
    /// The Service chains (all in nat) with their digests, sorted by id (a sorted vector: 24
    /// bytes a chain, where a hash map would take 50 and twice that while it grows).
    pub service: Vec<(ChainId, u64)>,
    /// The fixed and shared chains.
    pub shared: BTreeMap<(Table, &'static str), u64>,
}

impl ChainIndex {
    /// The digest of `chain`'s planned rules ([`digest`]), if it is planned.
    pub fn get(&self, table: Table, chain: &str) -> Option<u64> {
        if let Some(d) = self.shared.get(&(table, chain)) {
            return Some(*d);
        }
        if table != Table::Nat {
            return None;
        }
        let id = ChainId::parse(chain)?;
        self.position(&id).map(|i| self.service[i].1)
    }

    /// Where Service chain `id` is in [`ChainIndex::service`].
    pub fn position(&self, id: &ChainId) -> Option<usize> {
        self.service.binary_search_by(|(c, _)| c.cmp(id)).ok()
    }

    /// Number of chains planned in `table`.
    pub fn count(&self, table: Table) -> usize {
        self.shared.keys().filter(|(t, _)| *t == table).count()
            + if table == Table::Nat {
                self.service.len()
            } else {
                0
            }
    }

    /// The chains planned in `table`, fixed and shared ones first.
    pub fn names(&self, table: Table) -> impl Iterator<Item = String> + '_ {
        let shared = self
            .shared
            .keys()
            .filter(move |(t, _)| *t == table)
            .map(|(_, c)| c.to_string());
        let service = self
            .service
            .iter()
            .filter(move |_| table == Table::Nat)
            .map(|(id, _)| id.name());
        shared.chain(service)
    }
}

/// The planner of one family's `filter` and `nat` chains.
#[derive(Debug)]
pub struct Planner {
    cfg: PlanConfig,
    /// Every Service with at least one port of this family.
    services: BTreeMap<ServiceKey, ServicePlan>,
    total_endpoints: usize,
    /// What the last plan rendered with; `None` before the first full plan.
    ctx: Option<RenderContext>,
    /// The fixed and shared chains as last planned.
    shared: SharedRec,
    /// Chains the last plan deleted; if that restore failed they may still exist, so the next
    /// full plan deletes them again. A partial plan confirms the previous restore succeeded.
    maybe_stale: BTreeSet<(Table, String)>,
    no_local: (u64, u64),
    programmed: bool,
}

impl Planner {
    /// A planner that has planned nothing yet.
    pub fn new(cfg: PlanConfig) -> Self {
        Planner {
            cfg,
            services: BTreeMap::new(),
            total_endpoints: 0,
            ctx: None,
            shared: SharedRec::new(),
            maybe_stale: BTreeSet::new(),
            no_local: (0, 0),
            programmed: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PlanConfig {
        &self.cfg
    }

    /// Whether a full restore has been planned since [`Planner::new`] or
    /// [`Planner::invalidate`] (else the next plan must be [`Planner::full`]).
    pub fn programmed(&self) -> bool {
        self.programmed
    }

    /// After a failed restore: the kernel's state is unknown, so the next plan is full. The
    /// chains planned so far are remembered, so that full plan deletes the ones it no longer
    /// needs.
    pub fn invalidate(&mut self) {
        self.programmed = false;
    }

    /// Service ports with a `Local` policy and endpoints elsewhere but none on this node:
    /// (internal, external), as of the last plan (upstream's
    /// `sync_proxy_rules_no_local_endpoints_total`).
    pub fn no_local_endpoints(&self) -> (u64, u64) {
        self.no_local
    }

    /// Upstream's jumps from the built-in chains into ours, in upstream's order (upstream
    /// inserts each at position 1 in turn).
    pub fn jump_rules(&self) -> Vec<JumpRule> {
        render::jump_rules(self.kubelet_firewall())
            .into_iter()
            .map(|(table, chain, args)| JumpRule { table, chain, args })
            .collect()
    }

    /// Rules in the chains planned, per table (filter, nat), as of the last plan.
    pub fn rule_counts(&self) -> [(Table, usize); 2] {
        Table::ALL.map(|t| {
            let shared: usize = self
                .shared
                .iter()
                .filter(|((st, _), _)| *st == t)
                .map(|(_, (_, n))| *n)
                .sum();
            let service: usize = if t == Table::Nat {
                self.services
                    .values()
                    .flat_map(|s| s.ports.iter())
                    .map(|p| p.rules as usize)
                    .sum()
            } else {
                0
            };
            (t, shared + service)
        })
    }

    /// Every chain planned, with the digest of its rules, as last planned.
    pub fn index(&self) -> ChainIndex {
        let mut service: Vec<(ChainId, u64)> = Vec::with_capacity(self.service_chain_count());
        service.extend(
            self.services
                .values()
                .flat_map(|s| s.chains())
                .map(|c| (c.id, c.digest)),
        );
        service.sort_unstable_by_key(|(id, _)| *id);
        ChainIndex {
            service,
            shared: self.shared.iter().map(|(k, (d, _))| (*k, *d)).collect(),
        }
    }

    /// The planned Service chains of nat, in the planner's order (by Service, then port), from
    /// the `skip`th on: for sampling.
    pub fn service_chain_names(&self, skip: usize) -> impl Iterator<Item = String> + '_ {
        self.services
            .values()
            .flat_map(|s| s.chains())
            .skip(skip)
            .map(|c| c.id.name())
    }

    /// Number of planned Service chains.
    pub fn service_chain_count(&self) -> usize {
        self.services.values().map(|s| s.chains().count()).sum()
    }

    /// The rules of one planned chain, rendered again from `state`, if what that renders is
    /// what was last planned (same digest). The planner keeps digests only: `state` must hold
    /// what the last plan saw for the chain's Service (the shared chains: for every Service).
    pub fn planned_rules(
        &self,
        state: &ProxyState,
        table: Table,
        chain: &str,
    ) -> Option<Vec<String>> {
        let ctx = self.ctx.as_ref()?;
        let (want, rules) = if let Some((d, _)) = self
            .shared
            .iter()
            .find_map(|((t, c), v)| (*t == table && *c == chain).then_some(v))
        {
            let shared = self.assemble(ctx, &self.render_dispatch(ctx, state));
            (
                *d,
                shared
                    .into_iter()
                    .find(|((t, c), _)| *t == table && *c == chain)?
                    .1,
            )
        } else {
            let id = ChainId::parse(chain).filter(|_| table == Table::Nat)?;
            let (key, rec) = self
                .services
                .iter()
                .find_map(|(k, s)| s.chains().find(|c| c.id == id).map(|c| (k, *c)))?;
            let rules = render_service(ctx, state, key, true)
                .into_iter()
                .flat_map(|(_, p)| p.chains)
                .find(|c| c.chain == chain)?
                .rules;
            (rec.digest, rules)
        };
        (digest(&rules) == want).then_some(rules)
    }

    /// Every chain this planner owns with its rules (each the arguments after `-A CHAIN `, in
    /// `iptables-save` form), rendered again from `state`, which must be what the last plan
    /// saw. A chain whose rendering differs from what was planned (another state) is listed
    /// with the single rule `<not as planned>`.
    pub fn expected(&self, state: &ProxyState) -> BTreeMap<(Table, String), Vec<String>> {
        let mut out = BTreeMap::new();
        let Some(ctx) = &self.ctx else {
            return out;
        };
        let mismatch = || vec!["<not as planned>".to_string()];
        let shared = self.assemble(ctx, &self.render_dispatch(ctx, state));
        for ((t, c), (d, _)) in &self.shared {
            let rules = shared
                .get(&(*t, *c))
                .filter(|r| digest(r) == *d)
                .cloned()
                .unwrap_or_else(mismatch);
            out.insert((*t, c.to_string()), rules);
        }
        for (key, plan) in &self.services {
            let rendered: HashMap<String, Vec<String>> = render_service(ctx, state, key, true)
                .into_iter()
                .flat_map(|(_, p)| p.chains)
                .map(|c| (c.chain, c.rules))
                .collect();
            for c in plan.chains() {
                let name = c.id.name();
                let rules = rendered
                    .get(&name)
                    .filter(|r| digest(r) == c.digest)
                    .cloned()
                    .unwrap_or_else(mismatch);
                out.insert((Table::Nat, name), rules);
            }
        }
        out
    }

    /// Whether this planner owns `KUBE-FIREWALL` (IPv4 with localhost NodePorts).
    fn kubelet_firewall(&self) -> bool {
        self.cfg.localhost_node_ports && self.cfg.family == IpFamily::V4
    }

    fn context(&self, node: &NodeContext, total: usize) -> RenderContext {
        RenderContext::new(
            &self.cfg,
            node,
            total > names::LARGE_CLUSTER_ENDPOINTS_THRESHOLD,
        )
    }

    /// Endpoints of this family of `key`'s ports that have a ClusterIP of this family.
    fn count_endpoints(&self, state: &ProxyState, key: &ServiceKey) -> usize {
        let family = self.cfg.family;
        state
            .service_ports(key)
            .iter()
            .filter(|p| p.cluster_ips.iter().any(|ip| IpFamily::of(ip) == family))
            .map(|p| {
                state
                    .endpoints(&p.name)
                    .iter()
                    .filter(|e| IpFamily::of(&e.ip) == family)
                    .count()
            })
            .sum()
    }

    /// Every recorded Service's rules in the shared chains, rendered from `state`, indexed like
    /// [`Dispatch::ALL`].
    fn render_dispatch(&self, ctx: &RenderContext, state: &ProxyState) -> [Vec<String>; 6] {
        let mut out: [Vec<String>; 6] = Default::default();
        for key in self.services.keys() {
            for (_, p) in render_service(ctx, state, key, false) {
                for (i, rules) in p.dispatch.into_iter().enumerate() {
                    out[i].extend(rules);
                }
            }
        }
        out
    }

    /// The fixed and shared chains, from every Service's shared-chain rules (`dispatch`) and
    /// the recorded ClusterIPs.
    fn assemble(&self, ctx: &RenderContext, dispatch: &[Vec<String>; 6]) -> Shared {
        let mut shared = Shared::new();
        for d in Dispatch::ALL {
            shared.insert((d.table(), d.chain()), dispatch[d as usize].clone());
        }
        if let Some(rules) = shared.get_mut(&(Table::Nat, names::KUBE_SERVICES)) {
            // Each rule matches its own destination, so their order is free (upstream's is Go's
            // map order). By jump target, descending: iptables-nft-restore inserts every chain
            // an input names into a sorted list, walking it from the smallest name, so 10k
            // jumps in ascending (or service) order cost 10k walks of thousands of names
            // (1.9 s at 10k Services), and in descending order a step each.
            rules.sort_by(|a, b| jump_target(b).cmp(jump_target(a)));
            rules.extend(render::nodeports_jump(ctx));
        }
        let vips: Vec<(String, IpAddr)> = self
            .services
            .iter()
            .filter_map(|(key, s)| s.vip.map(|vip| (key.to_string(), vip)))
            .collect();
        if let Some(rules) = shared.get_mut(&(Table::Filter, names::KUBE_SERVICES)) {
            rules.extend(render::cluster_ip_rejects(
                ctx.family,
                &vips,
                &ctx.service_cidrs,
            ));
        }
        shared.insert(
            (Table::Nat, names::KUBE_POSTROUTING),
            render::postrouting(ctx.mark),
        );
        shared.insert(
            (Table::Nat, names::KUBE_MARK_MASQ),
            render::mark_masq(ctx.mark),
        );
        shared.insert(
            (Table::Filter, names::KUBE_FORWARD),
            render::forward(ctx.mark),
        );
        if self.kubelet_firewall() {
            shared.insert(
                (Table::Filter, names::KUBE_FIREWALL),
                render::kubelet_firewall(),
            );
        }
        shared
    }

    /// Splits the shared chains into the restore's base chains (what Service chains jump to)
    /// and dispatch chains, keeping those `keep` accepts.
    fn shared_writes(
        shared: Shared,
        keep: impl Fn(&(Table, &'static str), &Vec<String>) -> bool,
    ) -> (Vec<ChainWrite>, Vec<ChainWrite>) {
        let (mut base, mut dispatch) = (Vec::new(), Vec::new());
        for (key, rules) in shared {
            if !keep(&key, &rules) {
                continue;
            }
            let write = ChainWrite {
                table: key.0,
                chain: key.1.to_string(),
                rules,
            };
            if key.1 == names::KUBE_MARK_MASQ {
                base.push(write);
            } else {
                dispatch.push(write);
            }
        }
        // nat KUBE-SERVICES first: the names of the chains it jumps to then come into
        // iptables-nft-restore's sorted list in descending order (see `assemble`), before
        // KUBE-NODEPORTS' jumps put the KUBE-EXT names in front of them.
        dispatch.sort_by_key(|w| (w.table, w.chain.as_str()) != (Table::Nat, names::KUBE_SERVICES));
        (base, dispatch)
    }

    fn record_shared(shared: &Shared) -> SharedRec {
        shared
            .iter()
            .map(|(k, rules)| (*k, (digest(rules), rules.len())))
            .collect()
    }

    /// A restore that writes every chain this planner owns, built from `state`, and deletes the
    /// chains it planned before and no longer needs. The Service chains are rendered to be
    /// recorded, then again from `state` while the restore is written: the restore borrows it.
    pub fn full<'a>(&mut self, state: &'a ProxyState, node: &NodeContext) -> Restore<'a> {
        let counts: Vec<(ServiceKey, usize)> = state
            .service_keys()
            .map(|k| (k.clone(), self.count_endpoints(state, k)))
            .collect();
        let total: usize = counts.iter().map(|(_, n)| n).sum();
        let ctx = self.context(node, total);
        let old = std::mem::take(&mut self.services);
        let mut dispatch: [Vec<String>; 6] = Default::default();
        let mut lazy = LazyGroups {
            state,
            ctx: ctx.clone(),
            services: Vec::new(),
            groups: Vec::new(),
            ids: Vec::new(),
            rule_counts: Vec::new(),
            rules: 0,
        };
        let (recorded, errors) = record_services(&ctx, state, counts);
        for (key, plan, ports) in recorded {
            let service = lazy.services.len() as u32;
            let mut nth = 0;
            for (rec, port_dispatch) in plan.ports.iter().zip(ports) {
                if !rec.chains.is_empty() {
                    lazy.groups.push(LazyGroup {
                        service,
                        nth,
                        first: lazy.ids.len() as u32,
                        len: rec.chains.len() as u32,
                    });
                    nth += 1;
                    lazy.ids.extend(rec.chains.iter().map(|c| c.id));
                    lazy.rule_counts.extend(rec.chains.iter().map(|c| c.rules));
                    lazy.rules += rec.rules as usize;
                }
                for (i, rules) in port_dispatch.into_iter().enumerate() {
                    dispatch[i].extend(rules);
                }
            }
            lazy.services.push(key.clone());
            self.services.insert(key, plan);
        }
        self.total_endpoints = self.services.values().map(|s| s.endpoints).sum();
        self.no_local = self.services.values().fold((0, 0), |acc, s| {
            let (i, e) = s.no_local();
            (acc.0 + i, acc.1 + e)
        });
        let shared = self.assemble(&ctx, &dispatch);
        drop(dispatch);
        let fatal = check_shared(ctx.family, &shared).err();
        let old_shared = std::mem::replace(&mut self.shared, Self::record_shared(&shared));
        self.ctx = Some(ctx);

        // Deleted: what was planned before, or deleted by a restore that may have failed, and
        // is not planned now.
        // Sorted ids (11 bytes a chain; a hash set would take several times that).
        let mut planned: Vec<ChainId> = lazy.ids.clone();
        planned.sort_unstable();
        let has = |id: &ChainId| planned.binary_search(id).is_ok();
        let is_planned = |t: Table, c: &str| -> bool {
            self.shared.contains_key(&(t, c))
                || (t == Table::Nat && ChainId::parse(c).is_some_and(|id| has(&id)))
        };
        let mut deleted: BTreeSet<(Table, String)> = BTreeSet::new();
        for s in old.values() {
            for c in s.chains().filter(|c| !has(&c.id)) {
                deleted.insert((Table::Nat, c.id.name()));
            }
        }
        for (t, c) in old_shared.keys() {
            if !is_planned(*t, c) {
                deleted.insert((*t, c.to_string()));
            }
        }
        for (t, c) in &self.maybe_stale {
            if !is_planned(*t, c) {
                deleted.insert((*t, c.clone()));
            }
        }
        drop(planned);
        self.maybe_stale = deleted.clone();
        if let Some(fatal) = fatal {
            return self.refuse(true, errors, *fatal);
        }
        let (base_chains, dispatch_chains) = Self::shared_writes(shared, |_, _| true);
        self.programmed = true;
        Restore {
            full: true,
            base_chains,
            service_chains: Vec::new(),
            dispatch_chains,
            deleted_chains: deleted.into_iter().collect(),
            errors,
            lazy: Some(lazy).filter(|l| !l.groups.is_empty()),
        }
    }

    /// The empty restore of a plan whose fixed or shared chains failed validation: nothing is
    /// sent, and, as after a failed restore, the next plan is full and deletes what this one
    /// would have (remembered in `maybe_stale`).
    fn refuse<'a>(
        &mut self,
        full: bool,
        mut errors: Vec<PlanError>,
        fatal: PlanError,
    ) -> Restore<'a> {
        self.programmed = false;
        errors.push(fatal);
        Restore {
            full,
            errors,
            ..Restore::default()
        }
    }

    /// A restore with only what changed for `changed` Services (and for every Service if
    /// `node_changed`, or if the node context or large-cluster mode changed). Without a
    /// previous full plan (see [`Planner::programmed`]) this plans a full restore.
    pub fn partial<'a>(
        &mut self,
        state: &'a ProxyState,
        changed: &BTreeSet<ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
    ) -> Restore<'a> {
        if !self.programmed || self.ctx.is_none() {
            return self.full(state, node);
        }
        // Partial plans follow a successful restore: what it deleted is gone.
        self.maybe_stale.clear();

        let mut counts: HashMap<ServiceKey, usize> = HashMap::new();
        let mut total = self.total_endpoints;
        for key in changed {
            let n = self.count_endpoints(state, key);
            total = total + n - self.services.get(key).map_or(0, |s| s.endpoints);
            counts.insert(key.clone(), n);
        }
        let ctx = self.context(node, total);
        let everything = node_changed || self.ctx.as_ref() != Some(&ctx);
        let keys: BTreeSet<ServiceKey> = if everything {
            state
                .service_keys()
                .chain(self.services.keys())
                .cloned()
                .collect()
        } else {
            changed.clone()
        };

        let mut restore = Restore::default();
        let mut deleted: Vec<(Table, String)> = Vec::new();
        let mut dispatch_changed = everything;
        for key in &keys {
            let n = match counts.get(key) {
                Some(n) => *n,
                None => self.services.get(key).map_or(0, |s| s.endpoints),
            };
            let ports = match render_checked(&ctx, state, key) {
                Ok(ports) => ports,
                Err(e) => {
                    // Left out: planned as if it had no port of this family.
                    restore.errors.push(*e);
                    Vec::new()
                }
            };
            let new = ServicePlan {
                ports: ports.iter().map(|(_, p)| record_port(p)).collect(),
                // A Service left out is not recorded, so its endpoints do not count.
                endpoints: if ports.is_empty() { 0 } else { n },
                vip: service_vip(&ctx, state, key).filter(|_| !ports.is_empty()),
            };
            let old = self.services.remove(key).unwrap_or_default();
            let old_chains: HashMap<ChainId, u64> =
                old.chains().map(|c| (c.id, c.digest)).collect();
            let new_ids: HashSet<ChainId> = new.chains().map(|c| c.id).collect();
            for ((name, port), rec) in ports.into_iter().zip(&new.ports) {
                let chains: Vec<ChainWrite> = port
                    .chains
                    .into_iter()
                    .filter(|c| {
                        let d = ChainId::parse(&c.chain).and_then(|id| old_chains.get(&id));
                        let now = rec
                            .chains
                            .iter()
                            .find(|r| Some(r.id) == ChainId::parse(&c.chain))
                            .map(|r| r.digest);
                        d.is_none() || d.copied() != now
                    })
                    .collect();
                if !chains.is_empty() {
                    restore.service_chains.push(ServiceChains {
                        service_port: name.to_string(),
                        chains,
                    });
                }
            }
            for c in old.chains() {
                if !new_ids.contains(&c.id) {
                    deleted.push((Table::Nat, c.id.name()));
                }
            }
            let dispatch_of =
                |p: &ServicePlan| -> Vec<u64> { p.ports.iter().map(|r| r.dispatch).collect() };
            dispatch_changed |= old.vip != new.vip || dispatch_of(&old) != dispatch_of(&new);
            let (oi, oe) = old.no_local();
            let (ni, ne) = new.no_local();
            self.no_local = (self.no_local.0 - oi + ni, self.no_local.1 - oe + ne);
            self.total_endpoints = self.total_endpoints - old.endpoints + new.endpoints;
            if !new.ports.is_empty() {
                self.services.insert(key.clone(), new);
            }
        }

        let mut fatal = None;
        if dispatch_changed {
            let shared = self.assemble(&ctx, &self.render_dispatch(&ctx, state));
            fatal = check_shared(ctx.family, &shared).err();
            let recorded = Self::record_shared(&shared);
            // A shared chain that is no longer planned (none today) would be deleted.
            for key in self.shared.keys() {
                if !recorded.contains_key(key) {
                    deleted.push((key.0, key.1.to_string()));
                }
            }
            let previous = std::mem::replace(&mut self.shared, recorded);
            let (base, dispatch) = Self::shared_writes(shared, |k, rules| {
                previous.get(k).map(|(d, _)| *d) != Some(digest(rules))
            });
            restore.base_chains = base;
            restore.dispatch_chains = dispatch;
        }
        self.ctx = Some(ctx);

        deleted.sort();
        deleted.dedup();
        for d in &deleted {
            self.maybe_stale.insert(d.clone());
        }
        if let Some(fatal) = fatal {
            return self.refuse(false, restore.errors, *fatal);
        }
        restore.deleted_chains = deleted;
        restore
    }
}

#[cfg(test)]
mod tests;
