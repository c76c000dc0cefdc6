//! The dataplane: one planner per family, restores, canaries, jumps, read-back.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kp_core::dataplane::{Dataplane, SyncReport};
use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Changes, ProxyState};
use kp_iptables_plan::{PlanConfig, Planner};
use kp_iptables_plan::{Restore, Table};
use kp_metrics::{Metrics, TableLabel};

use crate::cleanup::{cleanup_with, is_owned_chain, is_service_chain, CANARY_CHAIN, CANARY_TABLES};
use crate::readback::{compare, parse_save, split_args};
use crate::runner::{Backend, IptablesCommand};
use crate::Error;

/// Chains per restore input with the nft backend (see [`IptablesConfig::step_chains`]).
pub const DEFAULT_STEP_CHAINS: usize = 2000;

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
    /// The backend ([`detect_backend`] picks the node's).
    pub backend: Backend,
    /// With the nft backend, the most chains one restore input writes; a larger change is sent
    /// as several inputs ([`Restore::steps`]). iptables-nft-restore looks every rule's chain up
    /// in a list of all chains the input touches, so its cost grows with chains × rules: one
    /// input of 10k Services × 10 endpoints takes over an hour, inputs of a few thousand chains
    /// take seconds in all. The legacy backend always gets one input: each input there rewrites
    /// whole tables.
    pub step_chains: usize,
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

/// One family's planner and what we believe its tables hold.
struct FamilyPlane {
    planner: Planner,
    /// Rules per chain we wrote, for `kubeproxy_sync_proxy_rules_iptables_total`.
    rules: BTreeMap<(Table, String), usize>,
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

    /// Sends one family's restore: one input with the legacy backend, ordered steps with nft.
    fn send(&mut self, idx: usize, restore: &Restore, partial: bool) -> Result<(), Error> {
        let family = self.planes[idx].family();
        let backend = self.cfg.backend;
        let inputs = match backend {
            Backend::Legacy => vec![restore.text()],
            Backend::Nft => restore.steps(self.cfg.step_chains.max(1)),
        };
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
        self.planes[idx].record(restore);
        Ok(())
    }

    /// Chains we own by name that the kernel holds in `family`'s nat and filter tables.
    fn owned_in_kernel(&self, family: IpFamily) -> Result<BTreeSet<(Table, String)>, Error> {
        let backend = self.cfg.backend;
        let legacy = (backend == Backend::Legacy).then(|| self.cmd.legacy_tables(family));
        let mut out = BTreeSet::new();
        for table in Table::ALL {
            if legacy
                .as_ref()
                .is_some_and(|l| !l.iter().any(|t| t == table.as_str()))
            {
                continue;
            }
            let text = self.cmd.save(backend, family, Some(table.as_str()))?;
            let saved = parse_save(&text, table.as_str())?;
            out.extend(
                saved
                    .chains
                    .into_keys()
                    .filter(|c| is_owned_chain(c) && c != CANARY_CHAIN)
                    .map(|c| (table, c)),
            );
        }
        Ok(out)
    }

    fn ensure_canaries(&self, family: IpFamily) -> Result<(), Error> {
        for table in CANARY_TABLES {
            let out = self
                .cmd
                .run(self.cfg.backend, family, &["-t", table, "-N", CANARY_CHAIN])?;
            if !out.success() && !out.stderr.contains("already exists") {
                return Err(Error::Command {
                    command: format!(
                        "{} -t {table} -N {CANARY_CHAIN}",
                        self.cfg.backend.program(family, "")
                    ),
                    status: out.status,
                    stderr: out.stderr,
                });
            }
        }
        Ok(())
    }

    /// Tables whose canary is gone.
    fn missing_canaries(&self, family: IpFamily) -> Vec<&'static str> {
        CANARY_TABLES
            .into_iter()
            .filter(|table| {
                !self
                    .cmd
                    .run(self.cfg.backend, family, &["-t", table, "-S", CANARY_CHAIN])
                    .is_ok_and(|o| o.success())
            })
            .collect()
    }

    /// Whether a jump rule is in place (`-C`): `Ok(false)` when iptables says it is not.
    fn has_jump(&self, family: IpFamily, table: &str, chain: &str, args: &[String]) -> Result<bool, Error> {
        let mut a: Vec<&str> = vec!["-t", table, "-C", chain];
        a.extend(args.iter().map(String::as_str));
        let out = self.cmd.run(self.cfg.backend, family, &a)?;
        match out.status {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(Error::Command {
                command: format!("{} {}", self.cfg.backend.program(family, ""), a.join(" ")),
                status: out.status,
                stderr: out.stderr,
            }),
        }
    }

    /// Inserts every missing jump from a built-in chain, in the order the planner lists them,
    /// each at the top (upstream's `EnsureRule(Prepend)`).
    fn ensure_jumps(&self, idx: usize) -> Result<(), Error> {
        let family = self.planes[idx].family();
        for j in self.planes[idx].planner.jump_rules() {
            let args = split_args(&j.args);
            if self.has_jump(family, j.table, j.chain, &args)? {
                continue;
            }
            let mut a: Vec<&str> = vec!["-t", j.table, "-I", j.chain];
            a.extend(args.iter().map(String::as_str));
            self.cmd.run_ok(self.cfg.backend, family, &a)?;
        }
        Ok(())
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

    /// Rewrites every chain we own in every family, deletes leftovers of earlier runs, and
    /// makes sure the canaries and the jumps from the built-in chains are in place.
    fn rebuild(&mut self, state: &ProxyState, node: &NodeContext) -> Result<usize, Error> {
        self.ensure_route_localnet()?;
        let mut ops = 0;
        for idx in 0..self.planes.len() {
            let family = self.planes[idx].family();
            let existing = match self.owned_in_kernel(family) {
                Ok(e) => e,
                Err(e) => {
                    self.invalidate();
                    return Err(e);
                }
            };
            let mut restore = self.planes[idx].planner.full(state, node);
            let written: BTreeSet<(Table, &str)> = restore.chain_names();
            let leftovers: Vec<(Table, String)> = existing
                .into_iter()
                .filter(|(t, c)| !written.contains(&(*t, c.as_str())))
                .collect();
            if !leftovers.is_empty() {
                tracing::info!(
                    family = family_label(family),
                    chains = leftovers.len(),
                    "deleting chains left over from an earlier run"
                );
            }
            restore.deleted_chains.extend(leftovers);
            ops += operations(&restore);
            self.send(idx, &restore, false)?;
            let ensured = self
                .ensure_canaries(family)
                .and_then(|()| self.ensure_jumps(idx));
            if let Err(e) = ensured {
                tracing::error!(error = %e, family = family_label(family), "cannot install the canary or jump rules");
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
            let missing = self.missing_canaries(p.family());
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
}

/// The size of a restore, for [`SyncReport::operations`]: chains written or deleted plus rules
/// written.
fn operations(r: &Restore) -> usize {
    let chains = r.base_chains.len()
        + r.service_chains.iter().map(|g| g.chains.len()).sum::<usize>()
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
                let diffs = self
                    .verify()
                    .unwrap_or_else(|e| vec![format!("cannot read the tables back: {e}")]);
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
                self.send(idx, &restore, true)?;
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
        let backend = self.cfg.backend;
        for idx in 0..self.planes.len() {
            let family = self.planes[idx].family();
            let fam = family_label(family);
            let mut expected: BTreeMap<Table, BTreeMap<String, Vec<String>>> = BTreeMap::new();
            for ((t, c), rules) in self.planes[idx].planner.expected() {
                expected.entry(t).or_default().insert(c, rules);
            }
            for table in Table::ALL {
                let want = expected.remove(&table).unwrap_or_default();
                let text = self.cmd.save(backend, family, Some(table.as_str()))?;
                let saved = parse_save(&text, table.as_str())?;
                let kernel: BTreeMap<String, Vec<String>> = saved
                    .chains
                    .into_iter()
                    .filter(|(c, _)| want.contains_key(c) || is_service_chain(c))
                    .collect();
                diffs.extend(compare(
                    &format!("{fam} {}", table.as_str()),
                    &want,
                    &kernel,
                    family,
                ));
            }
            for j in self.planes[idx].planner.jump_rules() {
                let args = split_args(&j.args);
                if !self.has_jump(family, j.table, j.chain, &args)? {
                    diffs.push(format!(
                        "{fam} {}: jump missing from {}: {}",
                        j.table, j.chain, j.args
                    ));
                }
            }
            for table in self.missing_canaries(family) {
                diffs.push(format!("{fam} {table}: chain {CANARY_CHAIN} is missing"));
            }
        }
        Ok(diffs)
    }

    fn cleanup(&mut self) -> Result<(), Error> {
        self.invalidate();
        for p in &mut self.planes {
            p.rules.clear();
        }
        self.route_localnet_set = false;
        let r = cleanup_with(&self.cmd);
        self.set_rule_gauges();
        r
    }
}
