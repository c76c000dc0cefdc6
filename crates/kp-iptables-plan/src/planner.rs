//! From the proxy's state to [`Restore`]s: full rebuilds and partial restores that rewrite only
//! what changed.
//!
//! The planner caches, per Service, what each of its ports contributes: its own nat chains
//! (`KUBE-SVC`, `KUBE-SVL`, `KUBE-EXT`, `KUBE-FW`, `KUBE-SEP`) and its rules in the shared
//! chains (`KUBE-SERVICES`, `KUBE-NODEPORTS`, `KUBE-EXTERNAL-SERVICES`, `KUBE-PROXY-FIREWALL`).
//! A partial restore re-renders only the changed Services and sends:
//! - each of their chains whose content changed (a `KUBE-SEP` chain of an unchanged endpoint is
//!   left alone), and deletes the chains they no longer have;
//! - the shared chains, re-assembled from the cached contributions, only if their content
//!   differs from what was last planned. Upstream rewrites `KUBE-SERVICES`, `KUBE-NODEPORTS` and
//!   `KUBE-EXTERNAL-SERVICES` on every sync; with iptables-nft a 10k-rule `KUBE-SERVICES` full
//!   of jumps costs about 0.6 s per restore, so an endpoint change (which never touches them)
//!   does not send them.
//!
//! Planning cost is proportional to the changed Services, plus one pass over the cached
//! contributions when a shared chain may have changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use kp_core::model::{IpFamily, ServiceKey, ServicePortName};
use kp_core::node::NodeContext;
use kp_core::track::ProxyState;

use crate::names;
use crate::render::{self, Dispatch, PortRules, RenderContext};
use crate::restore::{ChainWrite, Restore, ServiceChains, Table};

/// How the planner renders rules (upstream's `iptables` configuration for one family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// The family of the tables planned (`iptables` or `ip6tables`).
    pub family: IpFamily,
    /// `iptables.masqueradeBit`: the mark bit for SNAT, 0 to 31 (validated by the
    /// configuration; an out-of-range bit falls back to 14).
    pub masquerade_bit: u32,
    /// `masqueradeAll`: masquerade all ClusterIP traffic.
    pub masquerade_all: bool,
    /// `iptables.localhostNodePorts`: NodePorts also answer on 127.0.0.0/8 (IPv4 only), with
    /// kubelet's `KUBE-FIREWALL` anti-martian rule. Upstream turns it off when
    /// `nodePortAddresses` excludes loopback; the configuration layer does that here.
    pub localhost_node_ports: bool,
}

impl PlanConfig {
    /// Defaults for `family`: mark bit 14, no `masqueradeAll`, no localhost NodePorts.
    pub fn new(family: IpFamily) -> Self {
        PlanConfig {
            family,
            masquerade_bit: 14,
            masquerade_all: false,
            localhost_node_ports: false,
        }
    }

    /// The masquerade mark, `1 << masquerade_bit`.
    pub fn mark(&self) -> u32 {
        1u32.checked_shl(self.masquerade_bit).unwrap_or(1 << 14)
    }
}

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

/// One Service's cached plan.
#[derive(Clone, Debug, Default)]
struct ServicePlan {
    /// Its ports that have a ClusterIP of this family, by name.
    ports: Vec<(ServicePortName, PortRules)>,
    /// Its endpoints of this family (every one, usable or not), for large-cluster mode.
    endpoints: usize,
    /// Its ClusterIP of this family: traffic to it on other ports is rejected.
    vip: Option<IpAddr>,
}

impl ServicePlan {
    fn chains(&self) -> impl Iterator<Item = &ChainWrite> {
        self.ports.iter().flat_map(|(_, p)| p.chains.iter())
    }

    fn no_local(&self) -> (u64, u64) {
        self.ports.iter().fold((0, 0), |(i, e), (_, p)| {
            (
                i + u64::from(p.no_local_internal),
                e + u64::from(p.no_local_external),
            )
        })
    }
}

/// The shared chains, in the order a restore writes them.
type Shared = BTreeMap<(Table, &'static str), Vec<String>>;

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
    shared: Shared,
    /// Chains planned and not deleted since: what the kernel may hold.
    known: BTreeSet<(Table, String)>,
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
            shared: Shared::new(),
            known: BTreeSet::new(),
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

    /// Every chain this planner owns with its rules (each the arguments after `-A CHAIN `, in
    /// `iptables-save` form), as last planned.
    pub fn expected(&self) -> BTreeMap<(Table, String), Vec<String>> {
        let mut out: BTreeMap<(Table, String), Vec<String>> = self
            .shared
            .iter()
            .map(|((t, c), rules)| ((*t, c.to_string()), rules.clone()))
            .collect();
        for plan in self.services.values() {
            for c in plan.chains() {
                out.insert((c.table, c.chain.clone()), c.rules.clone());
            }
        }
        out
    }

    /// Whether this planner owns `KUBE-FIREWALL` (IPv4 with localhost NodePorts).
    fn kubelet_firewall(&self) -> bool {
        self.cfg.localhost_node_ports && self.cfg.family == IpFamily::V4
    }

    fn context(&self, state: &ProxyState, node: &NodeContext, total: usize) -> RenderContext {
        RenderContext::new(
            &self.cfg,
            node,
            &state.node().addresses,
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

    fn plan_service(
        ctx: &RenderContext,
        state: &ProxyState,
        key: &ServiceKey,
        endpoints: usize,
    ) -> ServicePlan {
        let mut ports: Vec<(ServicePortName, PortRules)> = state
            .service_state(key)
            .iter()
            .filter_map(|ps| {
                render::render_port(ctx, &ps.port, &ps.endpoints).map(|r| (ps.port.name.clone(), r))
            })
            .collect();
        ports.sort_by(|a, b| a.0.cmp(&b.0));
        let vip = state
            .service_ports(key)
            .iter()
            .flat_map(|p| p.cluster_ips.iter())
            .find(|ip| IpFamily::of(ip) == ctx.family)
            .copied()
            .filter(|_| !ports.is_empty());
        ServicePlan {
            ports,
            endpoints,
            vip,
        }
    }

    /// The fixed and shared chains, assembled from the cached contributions.
    fn assemble(&self, ctx: &RenderContext) -> Shared {
        let mut shared = Shared::new();
        for d in Dispatch::ALL {
            let rules: Vec<String> = self
                .services
                .values()
                .flat_map(|s| s.ports.iter())
                .flat_map(|(_, p)| p.dispatch[d as usize].iter().cloned())
                .collect();
            shared.insert((d.table(), d.chain()), rules);
        }
        if let Some(rules) = shared.get_mut(&(Table::Nat, names::KUBE_SERVICES)) {
            rules.extend(render::nodeports_jump(ctx));
        }
        let vips: Vec<(String, IpAddr)> = self
            .services
            .iter()
            .filter_map(|(key, s)| s.vip.map(|vip| (key.to_string(), vip)))
            .collect();
        if let Some(rules) = shared.get_mut(&(Table::Filter, names::KUBE_SERVICES)) {
            rules.extend(render::cluster_ip_rejects(ctx.family, &vips));
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
        shared: &Shared,
        keep: impl Fn(&(Table, &'static str), &Vec<String>) -> bool,
    ) -> (Vec<ChainWrite>, Vec<ChainWrite>) {
        let (mut base, mut dispatch) = (Vec::new(), Vec::new());
        for (key, rules) in shared {
            if !keep(key, rules) {
                continue;
            }
            let write = ChainWrite {
                table: key.0,
                chain: key.1.to_string(),
                rules: rules.clone(),
            };
            if key.1 == names::KUBE_MARK_MASQ {
                base.push(write);
            } else {
                dispatch.push(write);
            }
        }
        (base, dispatch)
    }

    /// A restore that writes every chain this planner owns, built from `state`, and deletes the
    /// chains it planned before and no longer needs.
    pub fn full(&mut self, state: &ProxyState, node: &NodeContext) -> Restore {
        let counts: Vec<(ServiceKey, usize)> = state
            .service_keys()
            .map(|k| (k.clone(), self.count_endpoints(state, k)))
            .collect();
        let total: usize = counts.iter().map(|(_, n)| n).sum();
        let ctx = self.context(state, node, total);
        self.services.clear();
        for (key, n) in counts {
            let plan = Self::plan_service(&ctx, state, &key, n);
            if !plan.ports.is_empty() {
                self.services.insert(key, plan);
            }
        }
        self.total_endpoints = self.services.values().map(|s| s.endpoints).sum();
        self.no_local = self.services.values().fold((0, 0), |acc, s| {
            let (i, e) = s.no_local();
            (acc.0 + i, acc.1 + e)
        });
        self.shared = self.assemble(&ctx);
        self.ctx = Some(ctx);

        let (base_chains, dispatch_chains) = Self::shared_writes(&self.shared, |_, _| true);
        let service_chains: Vec<ServiceChains> = self
            .services
            .values()
            .flat_map(|s| s.ports.iter())
            .filter(|(_, p)| !p.chains.is_empty())
            .map(|(name, p)| ServiceChains {
                service_port: name.to_string(),
                chains: p.chains.clone(),
            })
            .collect();
        let mut restore = Restore {
            full: true,
            base_chains,
            service_chains,
            dispatch_chains,
            deleted_chains: Vec::new(),
        };
        let planned: BTreeSet<(Table, String)> = restore
            .chain_names()
            .into_iter()
            .map(|(t, c)| (t, c.to_string()))
            .collect();
        let deleted: BTreeSet<(Table, String)> = self
            .known
            .union(&self.maybe_stale)
            .filter(|k| !planned.contains(*k))
            .cloned()
            .collect();
        restore.deleted_chains = deleted.iter().cloned().collect();
        self.known = planned;
        self.maybe_stale = deleted;
        self.programmed = true;
        restore
    }

    /// A restore with only what changed for `changed` Services (and for every Service if
    /// `node_changed`, or if the node context or large-cluster mode changed). Without a
    /// previous full plan (see [`Planner::programmed`]) this plans a full restore.
    pub fn partial(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServiceKey>,
        node: &NodeContext,
        node_changed: bool,
    ) -> Restore {
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
        let ctx = self.context(state, node, total);
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
            let new = Self::plan_service(&ctx, state, key, n);
            let old = self.services.remove(key).unwrap_or_default();
            let old_chains: HashMap<&str, &ChainWrite> =
                old.chains().map(|c| (c.chain.as_str(), c)).collect();
            let new_names: BTreeSet<&str> = new.chains().map(|c| c.chain.as_str()).collect();
            for (name, port) in &new.ports {
                let chains: Vec<ChainWrite> = port
                    .chains
                    .iter()
                    .filter(|c| {
                        old_chains.get(c.chain.as_str()).map(|o| &o.rules) != Some(&c.rules)
                    })
                    .cloned()
                    .collect();
                if !chains.is_empty() {
                    restore.service_chains.push(ServiceChains {
                        service_port: name.to_string(),
                        chains,
                    });
                }
            }
            for c in old.chains() {
                if !new_names.contains(c.chain.as_str()) {
                    deleted.push((c.table, c.chain.clone()));
                }
            }
            let dispatch_of = |p: &ServicePlan| -> Vec<[Vec<String>; 6]> {
                p.ports.iter().map(|(_, r)| r.dispatch.clone()).collect()
            };
            dispatch_changed |= old.vip != new.vip || dispatch_of(&old) != dispatch_of(&new);
            let (oi, oe) = old.no_local();
            let (ni, ne) = new.no_local();
            self.no_local = (self.no_local.0 - oi + ni, self.no_local.1 - oe + ne);
            self.total_endpoints = self.total_endpoints - old.endpoints + new.endpoints;
            if !new.ports.is_empty() {
                self.services.insert(key.clone(), new);
            }
        }

        if dispatch_changed {
            let shared = self.assemble(&ctx);
            let previous = &self.shared;
            let (base, dispatch) =
                Self::shared_writes(&shared, |k, rules| previous.get(k) != Some(rules));
            restore.base_chains = base;
            restore.dispatch_chains = dispatch;
            // A shared chain that is no longer planned (none today) would be deleted.
            for key in self.shared.keys() {
                if !shared.contains_key(key) {
                    deleted.push((key.0, key.1.to_string()));
                }
            }
            self.shared = shared;
        }
        self.ctx = Some(ctx);

        deleted.sort();
        deleted.dedup();
        for (t, c) in restore
            .service_chains
            .iter()
            .flat_map(|g| g.chains.iter())
            .chain(restore.base_chains.iter())
            .chain(restore.dispatch_chains.iter())
            .map(|c| (c.table, c.chain.clone()))
        {
            self.known.insert((t, c));
        }
        for d in &deleted {
            self.known.remove(d);
            self.maybe_stale.insert(d.clone());
        }
        restore.deleted_chains = deleted;
        restore
    }
}

#[cfg(test)]
mod tests;
