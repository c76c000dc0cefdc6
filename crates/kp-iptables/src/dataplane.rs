//! The dataplane: one planner per family, restores, canaries, jumps, read-back.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kp_core::dataplane::{Dataplane, SyncReport};
use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Changes, ProxyState};
use kp_iptables_plan::{JumpRule, PlanConfig, Planner};
use kp_iptables_plan::{Restore, Table};
use kp_metrics::{Metrics, TableLabel};

use crate::cleanup::{cleanup_with, is_owned_chain, is_service_chain, CANARY_CHAIN, CANARY_TABLES};
use crate::readback::{canonical, compare};
use crate::runner::{Backend, IptablesCommand};
use crate::view::{chain_rules, deletion_inputs, read_tables, TableView};
use crate::Error;

/// Chains per restore input with the nft backend (see [`IptablesConfig::step_chains`]).
pub const DEFAULT_STEP_CHAINS: usize = 1000;

/// The mode's settings.
#[derive(Clone, Debug)]
pub struct IptablesConfig {
    /// Families to program (one planner and one set of tables each).
    pub families: Vec<IpFamily>,
    /// `masqueradeBit`.
    pub masquerade_bit: u32,
    /// `masqueradeAll`.
    pub masquerade_all: bool,
    /// `iptables.localhostNodePorts`: NodePorts also answer on 127.0.0.1 (IPv4 only), which
    /// needs `net.ipv4.conf.all.route_localnet=1`. Effective only when `node_ports` includes
    /// 127.0.0.1, as upstream.
    pub localhost_node_ports: bool,
    /// detect-local mode.
    pub detect_local: DetectLocal,
    /// Where NodePorts answer (upstream's iptables default: every local address).
    pub node_ports: NodePortAddresses,
    /// The backend ([`crate::detect_backend`] picks the node's).
    pub backend: Backend,
    /// With the nft backend, the most chains one restore input writes; a larger change is sent
    /// as several inputs ([`Restore::steps`]). iptables-nft-restore looks every rule's chain up
    /// in a list of all chains the input touches, so its cost grows with chains × rules: one
    /// input of 10k Services × 10 endpoints takes over an hour, inputs of a thousand chains 13 s
    /// in all (CPU time there: 250 per input 16.7 s, 500 12.7 s, 1000 12 s, 2000 14 s, 3000
    /// 16.6 s). Tables already reachable from the hooks get larger inputs
    /// ([`LIVE_STEP_FACTOR`]). The legacy backend always gets one input: each input there
    /// rewrites whole tables.
    pub step_chains: usize,
    /// With the nft backend, the read-back saves whole tables only while the planned chains ×
    /// rules stay under this; above it, it lists chain names with `nft` and compares every
    /// fixed chain plus a rotating sample of [`READBACK_SAMPLE_CHAINS`] Service chains, since
    /// iptables-nft-save's cost grows with chains × rules (minutes at 10k Services × 10
    /// endpoints). The legacy backend always reads whole tables.
    pub full_readback_limit: u64,
}

impl Default for IptablesConfig {
    fn default() -> Self {
        IptablesConfig {
            families: IpFamily::ALL.to_vec(),
            masquerade_bit: 14,
            masquerade_all: false,
            localhost_node_ports: true,
            detect_local: DetectLocal::None,
            node_ports: NodePortAddresses::AllLocal,
            backend: Backend::Nft,
            step_chains: DEFAULT_STEP_CHAINS,
            full_readback_limit: DEFAULT_FULL_READBACK_LIMIT,
        }
    }
}

impl IptablesConfig {
    /// Whether localhost NodePorts are in effect: asked for, IPv4 programmed, and 127.0.0.1
    /// among the NodePort addresses (upstream `ContainsIPv4Loopback`).
    pub fn localhost_node_ports_effective(&self) -> bool {
        let loopback = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
        self.localhost_node_ports
            && self.families.contains(&IpFamily::V4)
            && match &self.node_ports {
                NodePortAddresses::AllLocal => true,
                NodePortAddresses::Cidrs(c) => c.iter().any(|n| n.contains(&loopback)),
                NodePortAddresses::Primary => false,
            }
    }
}

/// With the nft backend, a rebuild of tables that our jumps already make reachable (a restart,
/// a repair) sends inputs this many times larger than [`IptablesConfig::step_chains`]: every
/// commit then makes the kernel re-validate all it reaches (about 0.25 s at 10k Services × 10
/// endpoints), which outweighs iptables-nft-restore's per-input cost. Measured there: 1000
/// chains per input, 55 s; 4000, 34 s.
pub const LIVE_STEP_FACTOR: usize = 4;

/// Default [`IptablesConfig::full_readback_limit`]: about 4 s of iptables-nft-save (5000
/// Services × 2 endpoints, 18k chains × 50k rules = 9e8, took 2 s).
pub const DEFAULT_FULL_READBACK_LIMIT: u64 = 2_000_000_000;

/// Per-Service and per-endpoint chains whose rules a sampled read-back compares, per family and
/// check; successive checks move through all of them in turn.
pub const READBACK_SAMPLE_CHAINS: usize = 256;

/// One family's planner and what we believe its tables hold.
struct FamilyPlane {
    planner: Planner,
    /// Rules per chain we wrote, for `kubeproxy_sync_proxy_rules_iptables_total`.
    rules: BTreeMap<(Table, String), usize>,
    /// Where the next sampled read-back starts in the list of Service chains.
    sample_cursor: usize,
}

impl FamilyPlane {
    fn family(&self) -> IpFamily {
        self.planner.config().family
    }

    /// Records what a successful restore wrote and deleted.
    fn record(&mut self, restore: &Restore) {
        if restore.full {
            self.rules.clear();
        }
        let writes = restore
            .base_chains
            .iter()
            .chain(restore.service_chains.iter().flat_map(|g| g.chains.iter()))
            .chain(restore.dispatch_chains.iter());
        for c in writes {
            self.rules.insert((c.table, c.chain.clone()), c.rules.len());
        }
        for (t, c) in &restore.deleted_chains {
            self.rules.remove(&(*t, c.clone()));
        }
    }
}

/// Restore inputs kept for [`IptablesDataplane::last_inputs`] only up to this size, so a full
/// sync at scale does not hold tens of megabytes.
const KEEP_INPUTS_BYTES: usize = 4 << 20;

/// The nat and filter tables, as [`Table`]s and by name.
const TABLES: [(Table, &str); 2] = [(Table::Nat, "nat"), (Table::Filter, "filter")];

fn table_of(name: &str) -> Option<Table> {
    TABLES.iter().find(|(_, n)| *n == name).map(|(t, _)| *t)
}

/// Adds `decls` after the `*table` line and `rules` before that section's `COMMIT` (or a new
/// section at the end if the input has none).
fn splice(input: &str, table: &str, decls: &[String], rules: &[String]) -> String {
    if decls.is_empty() && rules.is_empty() {
        return input.to_string();
    }
    let header = format!("*{table}");
    let mut out = String::with_capacity(input.len() + 256);
    let mut inside = false;
    let mut done = false;
    for line in input.lines() {
        if line == "COMMIT" && inside {
            for r in rules {
                out.push_str(r);
                out.push('\n');
            }
            inside = false;
            done = true;
        }
        out.push_str(line);
        out.push('\n');
        if line == header && !done {
            inside = true;
            for d in decls {
                out.push_str(d);
                out.push('\n');
            }
        }
    }
    if !done {
        out.push_str(&header);
        out.push('\n');
        for l in decls.iter().chain(rules) {
            out.push_str(l);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// The iptables dataplane.
pub struct IptablesDataplane {
    cfg: IptablesConfig,
    planes: Vec<FamilyPlane>,
    cmd: IptablesCommand,
    metrics: Arc<Metrics>,
    last_inputs: Vec<String>,
    route_localnet_set: bool,
}

fn family_label(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    }
}

impl IptablesDataplane {
    /// A dataplane that has programmed nothing yet; the first sync rebuilds the tables. `cmd`
    /// says where the tools run (namespace, lock wait); the backend is `cfg.backend`.
    pub fn new(cfg: IptablesConfig, cmd: IptablesCommand, metrics: Arc<Metrics>) -> Self {
        let localhost = cfg.localhost_node_ports_effective();
        let planes = cfg
            .families
            .iter()
            .map(|f| {
                let mut pc = PlanConfig::new(*f);
                pc.masquerade_bit = cfg.masquerade_bit;
                pc.masquerade_all = cfg.masquerade_all;
                pc.localhost_node_ports = localhost && *f == IpFamily::V4;
                FamilyPlane {
                    planner: Planner::new(pc),
                    rules: BTreeMap::new(),
                    sample_cursor: 0,
                }
            })
            .collect();
        IptablesDataplane {
            cfg,
            planes,
            cmd,
            metrics,
            last_inputs: Vec::new(),
            route_localnet_set: false,
        }
    }

    /// The settings.
    pub fn config(&self) -> &IptablesConfig {
        &self.cfg
    }

    /// The restore inputs the last sync sent, in order, across families (empty if it sent
    /// nothing, or if they were larger than a few megabytes together).
    pub fn last_inputs(&self) -> &[String] {
        &self.last_inputs
    }

    /// Replaces the command (tests swap in a failing restore between syncs).
    pub fn set_command(&mut self, cmd: IptablesCommand) {
        self.cmd = cmd;
    }

    fn invalidate(&mut self) {
        for p in &mut self.planes {
            p.planner.invalidate();
        }
    }

    /// One restore as inputs: one with the legacy backend, ordered steps with nft.
    /// `live`: the tables already hold our jumps, so every nft commit re-validates everything
    /// they reach, and fewer, larger inputs cost less (see [`LIVE_STEP_FACTOR`]).
    fn inputs(&self, restore: &Restore, live: bool) -> Vec<String> {
        match self.cfg.backend {
            Backend::Legacy => vec![restore.text()],
            Backend::Nft => {
                let factor = if live { LIVE_STEP_FACTOR } else { 1 };
                restore.steps(self.cfg.step_chains.max(1).saturating_mul(factor))
            }
        }
    }

    /// Sends inputs in order. On failure: counted, logged with the failing line, every
    /// planner invalidated (the next sync is full).
    fn send(&mut self, family: IpFamily, inputs: Vec<String>, partial: bool) -> Result<(), Error> {
        let backend = self.cfg.backend;
        let mut kept = self.last_inputs.iter().map(String::len).sum::<usize>();
        for input in inputs {
            let r = self.cmd.restore(backend, family, &input);
            kept += input.len();
            if kept <= KEEP_INPUTS_BYTES {
                self.last_inputs.push(input);
            } else {
                self.last_inputs.clear();
            }
            if let Err(e) = r {
                self.metrics.iptables_restore_failures.inc();
                if partial {
                    self.metrics.iptables_partial_restore_failures.inc();
                }
                let (line, text) = match &e {
                    Error::Restore {
                        line, failing_line, ..
                    } => (*line, failing_line.clone()),
                    _ => (None, None),
                };
                tracing::error!(
                    error = %e,
                    family = family_label(family),
                    backend = %backend,
                    partial,
                    line,
                    failing_line = text.as_deref().unwrap_or(""),
                    "iptables-restore failed; the next sync rebuilds everything"
                );
                self.invalidate();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Tables whose canary is gone, checked one chain at a time.
    fn missing_canaries(&self, family: IpFamily, tables: &[&'static str]) -> Vec<&'static str> {
        tables
            .iter()
            .copied()
            .filter(|table| {
                !matches!(
                    chain_rules(&self.cmd, self.cfg.backend, family, table, CANARY_CHAIN),
                    Ok(Some(_))
                )
            })
            .collect()
    }

    fn ensure_mangle_canary(&self, family: IpFamily) -> Result<(), Error> {
        if self.missing_canaries(family, &["mangle"]).is_empty() {
            return Ok(());
        }
        let out = self.cmd.run(
            self.cfg.backend,
            family,
            &["-t", "mangle", "-N", CANARY_CHAIN],
        )?;
        if out.success() || out.stderr.contains("already exists") {
            return Ok(());
        }
        Err(Error::Command {
            command: format!(
                "{} -t mangle -N {CANARY_CHAIN}",
                self.cfg.backend.program(family, "")
            ),
            status: out.status,
            stderr: out.stderr,
        })
    }

    fn ensure_route_localnet(&mut self) -> Result<(), Error> {
        if self.route_localnet_set || !self.cfg.localhost_node_ports_effective() {
            return Ok(());
        }
        self.cmd.sysctl("net.ipv4.conf.all.route_localnet", "1")?;
        tracing::info!("set net.ipv4.conf.all.route_localnet=1 so NodePorts answer on 127.0.0.1");
        self.route_localnet_set = true;
        Ok(())
    }

    /// Rewrites every chain we own in every family. In the same restore: deletes chains of ours
    /// that an earlier run left behind, creates the nat and filter canaries, and inserts the
    /// missing jumps from the built-in chains (upstream's `EnsureRule(Prepend)`, in the
    /// planner's order, each at the top). A single `iptables -C`/`-I` on a large legacy table
    /// rewrites the whole table, so they are not run one by one.
    fn rebuild(&mut self, state: &ProxyState, node: &NodeContext) -> Result<usize, Error> {
        self.ensure_route_localnet()?;
        let backend = self.cfg.backend;
        let mut ops = 0;
        for idx in 0..self.planes.len() {
            let family = self.planes[idx].family();
            let views = match read_tables(&self.cmd, backend, family, &["nat", "filter"], false) {
                Ok(v) => v,
                Err(e) => {
                    self.invalidate();
                    return Err(e);
                }
            };
            let mut restore = self.planes[idx].planner.full(state, node);
            let written: BTreeSet<(Table, String)> = restore
                .chain_names()
                .into_iter()
                .map(|(t, c)| (t, c.to_string()))
                .collect();
            let mut leftovers: Vec<(Table, String)> = Vec::new();
            let mut decls: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            for view in &views {
                let Some(table) = table_of(view.table) else {
                    continue;
                };
                leftovers.extend(
                    view.chains
                        .user
                        .iter()
                        .filter(|c| is_owned_chain(c) && *c != CANARY_CHAIN)
                        .filter(|c| !written.contains(&(table, c.to_string())))
                        .map(|c| (table, c.clone())),
                );
                if !view.chains.user.contains(CANARY_CHAIN) {
                    decls
                        .entry(view.table)
                        .or_default()
                        .push(format!(":{CANARY_CHAIN} - [0:0]"));
                }
            }
            let mut inserts: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            let jumps = self.planes[idx].planner.jump_rules().len();
            let missing = match self.missing_jumps(idx, &views) {
                Ok(m) => m,
                Err(e) => {
                    self.invalidate();
                    return Err(e);
                }
            };
            let live = missing.len() < jumps;
            for j in missing {
                inserts
                    .entry(j.table)
                    .or_default()
                    .push(format!("-I {} {}", j.chain, j.args));
            }
            if !leftovers.is_empty() {
                tracing::info!(
                    family = family_label(family),
                    chains = leftovers.len(),
                    "deleting chains left over from an earlier run"
                );
            }
            // A few leftovers go in the restore; many in inputs of their own after it (nothing
            // the restore writes jumps to them), cut as `deletion_inputs` says.
            let separate = leftovers.len() > self.cfg.step_chains;
            let later = if separate {
                std::mem::take(&mut leftovers)
            } else {
                restore.deleted_chains.extend(leftovers);
                Vec::new()
            };
            ops += operations(&restore);
            let mut inputs = self.inputs(&restore, live);
            if let Some(last) = inputs.last_mut() {
                for (_, name) in TABLES {
                    let d = decls.remove(name).unwrap_or_default();
                    let i = inserts.remove(name).unwrap_or_default();
                    *last = splice(last, name, &d, &i);
                }
            }
            self.send(family, inputs, false)?;
            self.planes[idx].record(&restore);
            for (table, name) in TABLES {
                let doomed: Vec<String> = later
                    .iter()
                    .filter(|(t, _)| *t == table)
                    .map(|(_, c)| c.clone())
                    .collect();
                ops += doomed.len();
                let inputs = deletion_inputs(name, &[], &doomed, backend, self.cfg.step_chains);
                self.send(family, inputs, false)?;
            }
            if let Err(e) = self.ensure_mangle_canary(family) {
                tracing::error!(error = %e, family = family_label(family), "cannot create the mangle canary");
                self.invalidate();
                return Err(e);
            }
        }
        Ok(ops)
    }

    fn set_rule_gauges(&self) {
        for table in Table::ALL {
            let n: usize = self
                .planes
                .iter()
                .flat_map(|p| p.rules.iter())
                .filter(|((t, _), _)| *t == table)
                .map(|(_, n)| *n)
                .sum();
            self.metrics
                .iptables_rules
                .get_or_create(&TableLabel {
                    table: table.as_str().to_string(),
                })
                .set(n as i64);
        }
    }

    /// Whether someone flushed our tables: a canary is missing in any family.
    fn flushed(&self) -> bool {
        let mut gone = false;
        for p in &self.planes {
            let missing = self.missing_canaries(p.family(), &CANARY_TABLES);
            if !missing.is_empty() {
                tracing::warn!(
                    family = family_label(p.family()),
                    tables = ?missing,
                    "the {CANARY_CHAIN} chain is gone: someone flushed the tables; rebuilding"
                );
                gone = true;
            }
        }
        gone
    }

    /// The planner's jumps from the built-in chains that the kernel lacks, in the planner's
    /// order (compared in canonical form; each built-in chain is read once).
    fn missing_jumps(&self, idx: usize, views: &[TableView]) -> Result<Vec<JumpRule>, Error> {
        let family = self.planes[idx].family();
        let mut builtin: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
        let mut missing = Vec::new();
        for j in self.planes[idx].planner.jump_rules() {
            let rules = match builtin.entry((j.table, j.chain)) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let rules = match views.iter().find(|v| v.table == j.table) {
                        Some(v) => v.rules(&self.cmd, self.cfg.backend, family, j.chain)?,
                        None => None,
                    };
                    e.insert(rules.unwrap_or_default())
                }
            };
            let want = canonical(&j.args, family);
            if !rules.iter().any(|r| canonical(r, family) == want) {
                missing.push(j);
            }
        }
        Ok(missing)
    }

    /// Compares one family's tables with its planner: whole tables when that is cheap (always
    /// with legacy), else chain names, every fixed chain, and the next sample of Service chains.
    fn verify_family(&mut self, idx: usize) -> Result<Vec<String>, Error> {
        let backend = self.cfg.backend;
        let family = self.planes[idx].family();
        let fam = family_label(family);
        let mut expected: BTreeMap<Table, BTreeMap<String, Vec<String>>> = BTreeMap::new();
        let (mut chains, mut rules) = (0u64, 0u64);
        for ((t, c), r) in self.planes[idx].planner.expected() {
            chains += 1;
            rules += r.len() as u64;
            expected.entry(t).or_default().insert(c, r);
        }
        let whole = backend == Backend::Legacy || chains * rules <= self.cfg.full_readback_limit;
        let sample: BTreeSet<String> = if whole {
            BTreeSet::new()
        } else {
            let service: Vec<&String> = expected
                .values()
                .flat_map(|m| m.keys())
                .filter(|c| is_service_chain(c))
                .collect();
            let n = service.len();
            let start = self.planes[idx].sample_cursor % n.max(1);
            self.planes[idx].sample_cursor = start + READBACK_SAMPLE_CHAINS;
            (0..READBACK_SAMPLE_CHAINS.min(n))
                .map(|i| service[(start + i) % n].clone())
                .collect()
        };
        let views = read_tables(&self.cmd, backend, family, &["nat", "filter"], whole)?;
        let mut diffs = Vec::new();
        for view in &views {
            let Some(table) = table_of(view.table) else {
                continue;
            };
            let want = expected.remove(&table).unwrap_or_default();
            let present: BTreeSet<String> = view
                .chains
                .user
                .iter()
                .filter(|c| want.contains_key(*c) || is_service_chain(c))
                .cloned()
                .collect();
            let mut kernel = BTreeMap::new();
            for c in present.iter().filter(|c| want.contains_key(*c)) {
                if whole || !is_service_chain(c) || sample.contains(c) {
                    if let Some(r) = view.rules(&self.cmd, backend, family, c)? {
                        kernel.insert(c.clone(), r);
                    }
                }
            }
            diffs.extend(compare(
                &format!("{fam} {}", view.table),
                &want,
                &present,
                &kernel,
                family,
            ));
            if !view.chains.user.contains(CANARY_CHAIN) {
                diffs.push(format!(
                    "{fam} {}: chain {CANARY_CHAIN} is missing",
                    view.table
                ));
            }
        }
        for j in self.missing_jumps(idx, &views)? {
            diffs.push(format!(
                "{fam} {}: jump missing from {}: {}",
                j.table, j.chain, j.args
            ));
        }
        for table in self.missing_canaries(family, &["mangle"]) {
            diffs.push(format!("{fam} {table}: chain {CANARY_CHAIN} is missing"));
        }
        Ok(diffs)
    }
}

/// The size of a restore, for [`SyncReport::operations`]: chains written or deleted plus rules
/// written.
fn operations(r: &Restore) -> usize {
    let chains = r.base_chains.len()
        + r.service_chains
            .iter()
            .map(|g| g.chains.len())
            .sum::<usize>()
        + r.dispatch_chains.len()
        + r.deleted_chains.len();
    chains + r.rule_count()
}

impl Dataplane for IptablesDataplane {
    type Error = Error;

    fn mode(&self) -> &'static str {
        "iptables"
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, Error> {
        let node = NodeContext::resolve(&self.cfg.detect_local, &self.cfg.node_ports, state.node());
        self.last_inputs.clear();
        let mut rebuild = !self.planes.iter().all(|p| p.planner.programmed());
        if full && !rebuild {
            if self.flushed() {
                rebuild = true;
            } else {
                // A periodic full sync: prove the kernel holds what we planned; rebuild only
                // if something changed behind our back, or if it cannot be read.
                let diffs = self.drift();
                if !diffs.is_empty() {
                    self.metrics
                        .iptables_readback_mismatches
                        .inc_by(diffs.len() as u64);
                    for d in diffs.iter().take(10) {
                        tracing::warn!(difference = %d, "iptables rules differ from the plan; rebuilding");
                    }
                    rebuild = true;
                }
            }
        }
        let ops = if rebuild {
            self.invalidate();
            self.rebuild(state, &node)?
        } else {
            let mut ops = 0;
            for idx in 0..self.planes.len() {
                let restore = self.planes[idx].planner.partial(
                    state,
                    &changes.services,
                    &node,
                    changes.node_changed,
                );
                if restore.is_empty() {
                    continue;
                }
                ops += operations(&restore);
                let family = self.planes[idx].family();
                let inputs = self.inputs(&restore, true);
                self.send(family, inputs, true)?;
                self.planes[idx].record(&restore);
            }
            ops
        };
        self.set_rule_gauges();
        let no_local = self
            .planes
            .iter()
            .map(|p| p.planner.no_local_endpoints())
            .fold((0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1)));
        Ok(SyncReport {
            full: rebuild,
            operations: ops,
            no_local_endpoints: no_local,
        })
    }

    fn verify(&mut self) -> Result<Vec<String>, Error> {
        let mut diffs = Vec::new();
        for idx in 0..self.planes.len() {
            diffs.extend(self.verify_family(idx)?);
        }
        Ok(diffs)
    }

    fn cleanup(&mut self) -> Result<(), Error> {
        self.invalidate();
        for p in &mut self.planes {
            p.rules.clear();
        }
        self.route_localnet_set = false;
        let r = cleanup_with(&self.cmd, self.cfg.step_chains);
        self.set_rule_gauges();
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splice_adds_declarations_first_and_rules_before_commit() {
        let input = "*filter\n:KUBE-SERVICES - [0:0]\nCOMMIT\n*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j X\nCOMMIT\n";
        let out = splice(
            input,
            "nat",
            &[":KUBE-PROXY-CANARY - [0:0]".into()],
            &["-I PREROUTING -j KUBE-SERVICES".into()],
        );
        assert_eq!(
            out,
            "*filter\n:KUBE-SERVICES - [0:0]\nCOMMIT\n*nat\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j X\n-I PREROUTING -j KUBE-SERVICES\nCOMMIT\n"
        );
        // No such section: a new one at the end.
        let out = splice("*nat\nCOMMIT\n", "filter", &[], &["-I INPUT -j Y".into()]);
        assert_eq!(out, "*nat\nCOMMIT\n*filter\n-I INPUT -j Y\nCOMMIT\n");
        assert_eq!(splice(input, "nat", &[], &[]), input);
    }

    #[test]
    fn localhost_node_ports_need_loopback_among_the_node_port_addresses() {
        let mut cfg = IptablesConfig::default();
        assert!(cfg.localhost_node_ports_effective());
        cfg.node_ports = NodePortAddresses::Primary;
        assert!(!cfg.localhost_node_ports_effective());
        cfg.node_ports = NodePortAddresses::Cidrs(vec!["127.0.0.0/8".parse().unwrap()]);
        assert!(cfg.localhost_node_ports_effective());
        cfg.node_ports = NodePortAddresses::Cidrs(vec!["192.0.2.0/24".parse().unwrap()]);
        assert!(!cfg.localhost_node_ports_effective());
        cfg.node_ports = NodePortAddresses::AllLocal;
        cfg.families = vec![IpFamily::V6];
        assert!(!cfg.localhost_node_ports_effective());
        cfg.families = vec![IpFamily::V4];
        cfg.localhost_node_ports = false;
        assert!(!cfg.localhost_node_ports_effective());
    }
}
