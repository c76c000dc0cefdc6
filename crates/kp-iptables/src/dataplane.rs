//! The dataplane: one planner per family, restores, canaries, jumps, read-back, and the full
//! sync that adopts what the kernel holds.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use kp_core::dataplane::{Dataplane, DataplaneError, SyncReport};
use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Changes, ProxyState};
use kp_iptables_plan::{
    digest, ChainId, ChainIndex, Extra, Input, JumpRule, PlanConfig, PlanError, Planner,
};
use kp_iptables_plan::{Restore, Table};
use kp_metrics::{Metrics, TableLabel};

use crate::adopt::read_kernel;
use crate::cleanup::cleanup_with;
use crate::names::{is_owned_chain, is_service_chain, CANARY_CHAIN, CANARY_TABLES};
use crate::readback::{canonical, compare_rules};
use crate::runner::{Backend, IptablesRunner};
use crate::view::{chain_rules, deletion_inputs, scan_tables, Seen, TableScan};
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
    /// Adopt what the kernel holds on a full sync (the first after a start, one after a failed
    /// restore, a repair): read our chains back, send only those the kernel lacks or holds
    /// differently, and delete ours that are no longer planned. Off: every full sync rewrites
    /// every chain.
    pub adopt: bool,
    /// With the nft backend, adoption reads whole tables only while nat and filter hold at most
    /// this many chains (counted with `nft list chains`); above it, a full sync rewrites every
    /// chain. iptables-nft-save's cost grows faster than the chains: 25k chains 1.4 s, 75k
    /// 6.9 s, 128k over 5 minutes (iptables 1.8.9). The legacy backend always adopts.
    pub adopt_chain_limit: usize,
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
            adopt: true,
            adopt_chain_limit: DEFAULT_ADOPT_CHAIN_LIMIT,
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

/// Default [`IptablesConfig::adopt_chain_limit`]: 30k Services × 10 endpoints (75k chains in
/// our layout) still read whole in 7 s.
pub const DEFAULT_ADOPT_CHAIN_LIMIT: usize = 80_000;

/// What one family's last full sync found in the kernel and sent
/// ([`IptablesDataplane::last_adoption`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adoption {
    /// The family.
    pub family: IpFamily,
    /// Why the kernel's rules were not compared with the plan, if they were not: the sync sent
    /// every planned chain (the read failed or looked inconsistent, the nft tables were too
    /// large to read whole, or adoption is off).
    pub fallback: Option<String>,
    /// Chains planned.
    pub planned: usize,
    /// Planned chains the kernel held exactly as planned, left alone.
    pub kept: usize,
    /// Planned chains written: missing, or holding other rules.
    pub written: usize,
    /// Chains of ours deleted: left by an earlier run or no longer planned.
    pub deleted: usize,
    /// Planning the full restore (`Planner::full`).
    pub plan: std::time::Duration,
    /// Reading the kernel's tables (at the same time as the planning, on another thread).
    pub read: std::time::Duration,
    /// Comparing, sending the restore, and the canaries and jumps.
    pub send: std::time::Duration,
}

/// Per-Service and per-endpoint chains whose rules a sampled read-back compares, per family and
/// check; successive checks move through all of them in turn.
pub const READBACK_SAMPLE_CHAINS: usize = 256;

/// One family's planner and what we believe its tables hold.
struct FamilyPlane {
    planner: Planner,
    /// Whether the planner's last plan is in the kernel (for
    /// `kubeproxy_sync_proxy_rules_iptables_total`; false after cleanup).
    applied: bool,
    /// Where the next sampled read-back starts in the list of Service chains.
    sample_cursor: usize,
}

impl FamilyPlane {
    fn family(&self) -> IpFamily {
        self.planner.config().family
    }
}

/// How many chains with differing rules a read-back renders again from the state, to show the
/// rule that differs and to let a difference of spelling only pass; beyond that a difference
/// in digest is reported as it is.
const READBACK_DETAILS: usize = 100;

/// Restore inputs kept for [`IptablesDataplane::last_inputs`] only up to this size, so a full
/// sync at scale does not hold tens of megabytes (the copy is dropped once it outgrows this;
/// a one-endpoint change is about 2 KB, a Service added at 10k Services about 2 MB).
const KEEP_INPUTS_BYTES: usize = 1 << 20;

/// The nat and filter tables, as [`Table`]s and by name.
const TABLES: [(Table, &str); 2] = [(Table::Nat, "nat"), (Table::Filter, "filter")];

fn table_of(name: &str) -> Option<Table> {
    TABLES.iter().find(|(_, n)| *n == name).map(|(t, _)| *t)
}

/// The iptables dataplane.
pub struct IptablesDataplane {
    cfg: IptablesConfig,
    planes: Vec<FamilyPlane>,
    /// The tools: [`crate::IptablesCommand`], or a fake in tests. Boxed, so the dataplane is
    /// one type whatever runs its tools (a process spawn per call dwarfs the indirection).
    cmd: Box<dyn IptablesRunner>,
    metrics: Arc<Metrics>,
    last_inputs: Vec<String>,
    /// This sync's inputs outgrew [`KEEP_INPUTS_BYTES`]: none are kept.
    inputs_overflowed: bool,
    route_localnet_set: bool,
    /// What the last full sync found and sent, per family.
    adoptions: Vec<Adoption>,
}

fn family_label(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    }
}

impl IptablesDataplane {
    /// A dataplane that has programmed nothing yet; its first sync is a full one, which adopts
    /// what the kernel holds (a restarted process rewrites only what differs). `cmd` runs the
    /// tools: an [`crate::IptablesCommand`] says where (namespace, lock wait); tests may pass a
    /// fake. The backend is `cfg.backend`.
    pub fn new(
        cfg: IptablesConfig,
        cmd: impl IptablesRunner + 'static,
        metrics: Arc<Metrics>,
    ) -> Self {
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
                    applied: false,
                    sample_cursor: 0,
                }
            })
            .collect();
        IptablesDataplane {
            cfg,
            planes,
            cmd: Box::new(cmd),
            metrics,
            last_inputs: Vec::new(),
            inputs_overflowed: false,
            route_localnet_set: false,
            adoptions: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &IptablesConfig {
        &self.cfg
    }

    /// The restore inputs the last sync sent, in order, across families (empty if it sent
    /// nothing, or if they were larger than 1 MiB together).
    pub fn last_inputs(&self) -> &[String] {
        &self.last_inputs
    }

    /// What the last full sync found in the kernel and sent, per family (empty before the
    /// first).
    pub fn last_adoption(&self) -> &[Adoption] {
        &self.adoptions
    }

    /// Replaces the command (tests swap in a failing restore between syncs).
    pub fn set_command(&mut self, cmd: impl IptablesRunner + 'static) {
        self.cmd = Box::new(cmd);
    }

    fn invalidate(&mut self) {
        for p in &mut self.planes {
            p.planner.invalidate();
        }
    }

    /// One restore as inputs: one with the legacy backend, ordered steps with nft.
    /// `live`: the tables already hold our jumps, so every nft commit re-validates everything
    /// they reach, and fewer, larger inputs cost less (see [`LIVE_STEP_FACTOR`]).
    fn inputs(&self, restore: &Restore, live: bool) -> Vec<Input> {
        match self.cfg.backend {
            Backend::Legacy => {
                if restore.is_empty() {
                    Vec::new()
                } else {
                    vec![restore.whole()]
                }
            }
            Backend::Nft => {
                let factor = if live { LIVE_STEP_FACTOR } else { 1 };
                restore.inputs(self.cfg.step_chains.max(1).saturating_mul(factor))
            }
        }
    }

    /// Sends a restore's inputs in order, each rendered straight into the tool's standard
    /// input; `extra` goes into the last one. On failure: as [`IptablesDataplane::send`].
    fn send_restore(
        &mut self,
        family: IpFamily,
        restore: &Restore,
        inputs: &[Input],
        extra: &[Extra<'_>],
        partial: bool,
    ) -> Result<(), Error> {
        for (i, input) in inputs.iter().enumerate() {
            let extra = if i + 1 == inputs.len() { extra } else { &[] };
            self.send_one(family, partial, &mut |w| {
                restore.write_input(input, extra, w)
            })?;
        }
        Ok(())
    }

    /// Sends inputs in order. On failure: counted, logged with the failing line, every
    /// planner invalidated (the next sync is full).
    fn send(&mut self, family: IpFamily, inputs: Vec<String>, partial: bool) -> Result<(), Error> {
        for input in inputs {
            self.send_one(family, partial, &mut |w| w.write_all(input.as_bytes()))?;
        }
        Ok(())
    }

    /// Sends one input, keeping a copy for [`IptablesDataplane::last_inputs`] while the inputs
    /// of this sync stay under [`KEEP_INPUTS_BYTES`].
    fn send_one(
        &mut self,
        family: IpFamily,
        partial: bool,
        write: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<(), Error> {
        let backend = self.cfg.backend;
        let kept: usize = self.last_inputs.iter().map(String::len).sum();
        let room = if self.inputs_overflowed {
            0
        } else {
            KEEP_INPUTS_BYTES.saturating_sub(kept)
        };
        let mut copy = Keep {
            buf: Vec::new(),
            room,
            overflow: false,
        };
        let mut first = true;
        let r = self.cmd.restore_with(backend, family, &mut |w| {
            if std::mem::take(&mut first) {
                let mut tee = Tee {
                    out: w,
                    keep: &mut copy,
                };
                write(&mut tee)
            } else {
                write(w)
            }
        });
        if copy.overflow || self.inputs_overflowed {
            self.inputs_overflowed = true;
            self.last_inputs.clear();
        } else {
            self.last_inputs
                .push(String::from_utf8_lossy(&copy.buf).into_owned());
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
        Ok(())
    }

    /// Logs and counts what a plan left out because its rules failed validation: each
    /// Service left out is one `kubeproxy_rs_invalid_objects_total{kind="Service"}`. A plan
    /// that could send nothing (a fixed or shared rule failed) fails the sync before anything
    /// is sent, so the kernel keeps the rules it has, and the next sync rebuilds.
    fn plan_errors(&mut self, family: IpFamily, restore: &Restore) -> Result<(), Error> {
        for e in &restore.errors {
            if let PlanError::Service { service, .. } = e {
                tracing::error!(
                    error = %e,
                    service = %service,
                    family = family_label(family),
                    "a Service's iptables rules failed validation; it is left out of this family's tables"
                );
                self.metrics.invalid_object("Service");
            }
        }
        if let Some(fatal) = restore.fatal() {
            tracing::error!(
                error = %fatal,
                family = family_label(family),
                "planned iptables rules failed validation; nothing is sent and the kernel keeps its rules"
            );
            self.invalidate();
            return Err(Error::Plan(Box::new(fatal.clone())));
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
                    chain_rules(
                        self.cmd.as_ref(),
                        self.cfg.backend,
                        family,
                        table,
                        CANARY_CHAIN
                    ),
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

    /// A full sync of every family: plans every chain and, while it plans, reads the kernel's
    /// nat and filter back ([`read_kernel`]). Sends the chains the kernel lacks or holds
    /// differently (all of them when the read cannot be trusted: see [`crate::adopt`]), and in
    /// the same restore deletes our chains the plan does not have (left by an earlier run, or
    /// no longer planned), creates the nat and filter canaries if missing, and inserts the
    /// missing jumps from the built-in chains (upstream's `EnsureRule(Prepend)`, in the
    /// planner's order, each at the top). A single `iptables -C`/`-I` on a large legacy table
    /// rewrites the whole table, so they are not run one by one.
    fn rebuild(&mut self, state: &ProxyState, node: &NodeContext) -> Result<usize, Error> {
        self.ensure_route_localnet()?;
        self.adoptions.clear();
        let backend = self.cfg.backend;
        let (adopt, limit) = (self.cfg.adopt, self.cfg.adopt_chain_limit);
        let mut ops = 0;
        for idx in 0..self.planes.len() {
            let family = self.planes[idx].family();
            // The plan is our CPU (two threads at scale), the read mostly iptables-save's and
            // the kernel's: done at the same time, a restart costs the longer of the two.
            let cmd = self.cmd.as_ref();
            let planner = &mut self.planes[idx].planner;
            let read_now = || read_kernel(cmd, backend, family, adopt, limit);
            let (mut restore, plan_time, read) = std::thread::scope(|scope| {
                let reader = std::thread::Builder::new()
                    .name("iptables-read".into())
                    .spawn_scoped(scope, read_now);
                let started = Instant::now();
                let restore = planner.full(state, node);
                let plan_time = started.elapsed();
                let read = match reader.map(|r| r.join()) {
                    Ok(Ok(read)) => read,
                    // Reading has no panicking path; if one appeared, it surfaces as it
                    // would have on this thread.
                    Ok(Err(panic)) => std::panic::resume_unwind(panic),
                    // No thread to spare: read after planning.
                    Err(_) => read_now(),
                };
                (restore, plan_time, read)
            });
            let started = Instant::now();
            self.plan_errors(family, &restore)?;
            let read = match read {
                Ok(r) => r,
                Err(e) => {
                    self.invalidate();
                    return Err(e);
                }
            };
            let index = self.planes[idx].planner.index();
            let planned = index.service.len() + index.shared.len();
            let kernel = &read.chains;
            match &read.fallback {
                None => {
                    // Only what the kernel lacks or holds differently. The rest is there as
                    // planned, so every jump of what is written finds its chain.
                    restore.retain(|t, c| kernel.get(t, c) != index.get(t, c));
                    restore
                        .deleted_chains
                        .retain(|(t, c)| kernel.contains(*t, c));
                }
                Some(why) if adopt => tracing::warn!(
                    family = family_label(family),
                    reason = %why,
                    "not adopting the kernel's iptables rules; rewriting every chain"
                ),
                Some(_) => {}
            }
            let written = restore.chain_count() - restore.deleted_chains.len();
            // Chains of ours the kernel holds and this restore neither writes nor deletes:
            // left by an earlier run.
            let deleting: HashSet<(Table, &str)> = restore
                .deleted_chains
                .iter()
                .map(|(t, c)| (*t, c.as_str()))
                .collect();
            let mut leftovers: Vec<(Table, String)> = kernel
                .names()
                .filter(|(t, c)| {
                    is_owned_chain(c)
                        && *c != CANARY_CHAIN
                        && index.get(*t, c).is_none()
                        && !deleting.contains(&(*t, *c))
                })
                .map(|(t, c)| (t, c.to_string()))
                .collect();
            drop(deleting);
            drop(index);
            leftovers.sort();
            let scans = read.scans;
            let mut decls: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            for scan in &scans {
                if !scan.canary {
                    decls
                        .entry(scan.table)
                        .or_default()
                        .push(format!(":{CANARY_CHAIN} - [0:0]"));
                }
            }
            let mut inserts: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            let jumps = self.planes[idx].planner.jump_rules().len();
            let missing = match self.missing_jumps(idx, &scans) {
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
            let deleted = restore.deleted_chains.len() + later.len();
            ops += operations(&restore);
            let mut inputs = self.inputs(&restore, live);
            let empty = Vec::new();
            let extra: Vec<Extra<'_>> = TABLES
                .iter()
                .map(|(table, name)| Extra {
                    table: *table,
                    decls: decls.get(name).unwrap_or(&empty),
                    rules: inserts.get(name).unwrap_or(&empty),
                })
                .collect();
            if inputs.is_empty() && !(decls.is_empty() && inserts.is_empty()) {
                // Nothing of ours to write, but a canary or a jump to add: an input of those
                // lines only.
                inputs.push(restore.whole());
            }
            self.send_restore(family, &restore, &inputs, &extra, false)?;
            drop(restore);
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
            self.planes[idx].applied = true;
            if let Err(e) = self.ensure_mangle_canary(family) {
                tracing::error!(error = %e, family = family_label(family), "cannot create the mangle canary");
                self.invalidate();
                return Err(e);
            }
            let adoption = Adoption {
                family,
                fallback: read.fallback,
                planned,
                kept: planned.saturating_sub(written),
                written,
                deleted,
                plan: plan_time,
                read: read.took,
                send: started.elapsed(),
            };
            if adoption.fallback.is_none() {
                tracing::info!(
                    family = family_label(family),
                    kept = adoption.kept,
                    written = adoption.written,
                    deleted = adoption.deleted,
                    plan_ms = adoption.plan.as_millis() as u64,
                    read_ms = adoption.read.as_millis() as u64,
                    send_ms = adoption.send.as_millis() as u64,
                    "full sync adopted the kernel's iptables rules: only the chains that differed were written"
                );
            }
            self.adoptions.push(adoption);
        }
        Ok(ops)
    }

    fn set_rule_gauges(&self) {
        for table in Table::ALL {
            let n: usize = self
                .planes
                .iter()
                .filter(|p| p.applied)
                .flat_map(|p| p.planner.rule_counts())
                .filter(|(t, _)| *t == table)
                .map(|(_, n)| n)
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
    fn missing_jumps(&self, idx: usize, views: &[TableScan]) -> Result<Vec<JumpRule>, Error> {
        let family = self.planes[idx].family();
        let mut builtin: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
        let mut missing = Vec::new();
        for j in self.planes[idx].planner.jump_rules() {
            let rules = match builtin.entry((j.table, j.chain)) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let rules = match views.iter().find(|v| v.table == j.table) {
                        Some(v) => {
                            v.builtin_rules(self.cmd.as_ref(), self.cfg.backend, family, j.chain)?
                        }
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

    /// What the next read-back of family `idx` covers: whole tables when that is cheap
    /// (always with legacy: its save is one read), else (`false`, the next
    /// [`READBACK_SAMPLE_CHAINS`] Service chains in rotation, wrapping around).
    fn readback_scope(&mut self, idx: usize) -> (bool, BTreeSet<String>) {
        let plane = &mut self.planes[idx];
        let ChainIndex { service, shared } = plane.planner.index();
        let chains = (service.len() + shared.len()) as u64;
        let rules: u64 = plane
            .planner
            .rule_counts()
            .iter()
            .map(|(_, n)| *n as u64)
            .sum();
        if self.cfg.backend == Backend::Legacy || chains * rules <= self.cfg.full_readback_limit {
            return (true, BTreeSet::new());
        }
        let n = plane.planner.service_chain_count();
        let start = plane.sample_cursor % n.max(1);
        plane.sample_cursor = start + READBACK_SAMPLE_CHAINS;
        let take = READBACK_SAMPLE_CHAINS.min(n);
        let sample = plane
            .planner
            .service_chain_names(start)
            .take(take)
            .chain(
                plane
                    .planner
                    .service_chain_names(0)
                    .take(take.saturating_sub(n - start)),
            )
            .collect();
        (false, sample)
    }

    /// Compares one family's tables with its planner: whole tables when that is cheap (always
    /// with legacy), else chain names, every fixed chain, and the next sample of Service chains.
    /// The planner keeps a digest of each chain: a chain whose rules hash differently is
    /// rendered again from `state` (when given, and only if that reproduces the planned digest)
    /// to name the rule that differs and to let a difference of spelling only pass.
    fn verify_family(
        &mut self,
        idx: usize,
        state: Option<&ProxyState>,
    ) -> Result<Vec<String>, Error> {
        let backend = self.cfg.backend;
        let family = self.planes[idx].family();
        let (whole, sample) = self.readback_scope(idx);
        let planner = &self.planes[idx].planner;
        let ChainIndex { service, shared } = planner.index();
        let mut service = ServiceMarks {
            marks: vec![Mark::default(); service.len()],
            chains: service,
        };
        let mut shared: SharedMarks = shared
            .into_iter()
            .map(|(k, d)| (k, (d, Mark::default())))
            .collect();
        let mut details = 0usize;
        // (chain, difference) for planned chains; leftovers apart.
        let mut found: Vec<(Table, String, String)> = Vec::new();
        let mut leftovers: Vec<(Table, String)> = Vec::new();
        let mut check = |table: Table,
                         chain: &str,
                         want: u64,
                         have: &[String],
                         found: &mut Vec<(Table, String, String)>| {
            if digest(have) == want {
                return;
            }
            let planned = match state {
                Some(state) if details < READBACK_DETAILS => {
                    details += 1;
                    planner.planned_rules(state, table, chain)
                }
                _ => None,
            };
            let d = match planned {
                Some(want) => compare_rules(&want, have, family),
                None => Some(format!(
                    "rules differ from the plan ({} in the kernel; the plan is kept as a digest)",
                    have.len()
                )),
            };
            if let Some(d) = d {
                found.push((table, chain.to_string(), d));
            }
        };
        let scans = scan_tables(
            self.cmd.as_ref(),
            backend,
            family,
            &["nat", "filter"],
            whole,
            &mut |table, seen| {
                let Some(t) = table_of(table) else {
                    return;
                };
                match seen {
                    Seen::Chain { builtin: true, .. } => {}
                    Seen::Chain { name, .. } => {
                        if let Some((_, mark)) = lookup(t, name, &mut service, &mut shared) {
                            mark.present = true;
                        } else if is_service_chain(name) {
                            leftovers.push((t, name.to_string()));
                        }
                    }
                    Seen::Rules { chain, rules } => {
                        if let Some((want, mark)) = lookup(t, chain, &mut service, &mut shared) {
                            if mark.present {
                                mark.compared = true;
                                check(t, chain, want, rules, &mut found);
                            }
                        }
                    }
                }
            },
        )?;
        // Present chains not compared yet: with whole tables, they have no rules; else read
        // the fixed ones and the sample.
        let mut to_read: Vec<(Table, String, u64)> = Vec::new();
        for ((t, c), (d, seen)) in &shared {
            if seen.present && !seen.compared {
                to_read.push((*t, c.to_string(), *d));
            }
        }
        if whole {
            for ((id, d), seen) in service.chains.iter().zip(&service.marks) {
                if seen.present && !seen.compared {
                    to_read.push((Table::Nat, id.name(), *d));
                }
            }
        } else {
            for name in &sample {
                let at = ChainId::parse(name).and_then(|id| service.position(&id));
                if let Some(i) = at {
                    if service.marks[i].present {
                        to_read.push((Table::Nat, name.clone(), service.chains[i].1));
                    }
                }
            }
        }
        for (t, chain, want) in to_read {
            let have = if whole {
                Vec::new()
            } else {
                chain_rules(self.cmd.as_ref(), backend, family, t.as_str(), &chain)?
                    .unwrap_or_default()
            };
            check(t, &chain, want, &have, &mut found);
        }
        for ((t, c), (_, seen)) in &shared {
            if !seen.present {
                found.push((*t, c.to_string(), String::new()));
            }
        }
        for ((id, _), seen) in service.chains.iter().zip(&service.marks) {
            if !seen.present {
                found.push((Table::Nat, id.name(), String::new()));
            }
        }
        drop(service);
        let fam = family_label(family);
        let mut diffs = describe_differences(fam, &scans, found, leftovers);
        for j in self.missing_jumps(idx, &scans)? {
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

    /// [`Dataplane::verify`], with the state the last plans saw when there is one (see
    /// [`IptablesDataplane::verify_family`]).
    fn verify_with(&mut self, state: Option<&ProxyState>) -> Result<Vec<String>, Error> {
        let mut diffs = Vec::new();
        for idx in 0..self.planes.len() {
            diffs.extend(self.verify_family(idx, state)?);
        }
        Ok(diffs)
    }
}

/// The copy of an input kept for [`IptablesDataplane::last_inputs`], up to `room` bytes.
struct Keep {
    buf: Vec<u8>,
    room: usize,
    overflow: bool,
}

/// Writes to `out` and copies into `keep` until it overflows.
struct Tee<'w, 'k> {
    out: &'w mut dyn Write,
    keep: &'k mut Keep,
}

impl Write for Tee<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        let k = &mut *self.keep;
        if !k.overflow {
            if k.buf.len() + n > k.room {
                k.overflow = true;
                k.buf = Vec::new();
            } else {
                k.buf.extend_from_slice(&buf[..n]);
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// What a read-back saw of one planned chain.
#[derive(Clone, Copy, Debug, Default)]
struct Mark {
    present: bool,
    compared: bool,
}

/// The planned Service chains ([`ChainIndex::service`], sorted by id) and what was seen of
/// each.
struct ServiceMarks {
    chains: Vec<(ChainId, u64)>,
    marks: Vec<Mark>,
}

impl ServiceMarks {
    fn position(&self, id: &ChainId) -> Option<usize> {
        self.chains.binary_search_by(|(c, _)| c.cmp(id)).ok()
    }
}

type SharedMarks = BTreeMap<(Table, &'static str), (u64, Mark)>;

/// The planned chain `name` of table `t`, if any: its digest and what was seen of it.
fn lookup<'m>(
    t: Table,
    name: &str,
    service: &'m mut ServiceMarks,
    shared: &'m mut SharedMarks,
) -> Option<(u64, &'m mut Mark)> {
    if let Some((_, (d, m))) = shared
        .iter_mut()
        .find(|((st, c), _)| *st == t && *c == name)
    {
        return Some((*d, m));
    }
    let id = ChainId::parse(name).filter(|_| t == Table::Nat)?;
    let i = service.position(&id)?;
    Some((service.chains[i].1, &mut service.marks[i]))
}

/// The read-back's findings as operator-facing lines, table by table: planned chains missing
/// or differing (`found`, a difference of "" meaning missing), chains of ours nobody planned,
/// and a missing canary.
fn describe_differences(
    fam: &str,
    scans: &[TableScan],
    mut found: Vec<(Table, String, String)>,
    mut leftovers: Vec<(Table, String)>,
) -> Vec<String> {
    found.sort();
    leftovers.sort();
    leftovers.dedup();
    let mut diffs = Vec::new();
    for scan in scans {
        let Some(table) = table_of(scan.table) else {
            continue;
        };
        let label = format!("{fam} {}", scan.table);
        for (_, chain, d) in found.iter().filter(|(t, _, _)| *t == table) {
            if d.is_empty() {
                diffs.push(format!("{label}: chain {chain} is missing"));
            } else {
                diffs.push(format!("{label}: chain {chain}: {d}"));
            }
        }
        for (_, chain) in leftovers.iter().filter(|(t, _)| *t == table) {
            diffs.push(format!(
                "{label}: chain {chain} is not planned (a leftover)"
            ));
        }
        if !scan.canary {
            diffs.push(format!("{label}: chain {CANARY_CHAIN} is missing"));
        }
    }
    diffs
}

/// The size of a restore, for [`SyncReport::operations`]: chains written or deleted plus rules
/// written.
fn operations(r: &Restore) -> usize {
    r.chain_count() + r.rule_count()
}

/// The mode's operations with their own typed errors (tests match on them); the loop calls
/// them through [`Dataplane`].
impl IptablesDataplane {
    /// See [`Dataplane::sync`].
    pub fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, Error> {
        let node = NodeContext::resolve(&self.cfg.detect_local, &self.cfg.node_ports, state);
        self.last_inputs.clear();
        self.inputs_overflowed = false;
        let mut rebuild = !self.planes.iter().all(|p| p.planner.programmed());
        if full && !rebuild {
            if self.flushed() {
                rebuild = true;
            } else {
                // A periodic full sync: prove the kernel holds what we planned; rebuild only
                // if something changed behind our back, or if it cannot be read.
                let diffs = self
                    .verify_with(Some(state))
                    .unwrap_or_else(|e| vec![format!("cannot read the kernel's rules back: {e}")]);
                if !diffs.is_empty() {
                    self.metrics
                        .iptables_readback_mismatches
                        .inc_by(diffs.len() as u64);
                    for d in diffs.iter().take(10) {
                        tracing::warn!(difference = %d, "iptables rules differ from the plan; repairing with a full sync");
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
                let family = self.planes[idx].family();
                self.plan_errors(family, &restore)?;
                if restore.is_empty() {
                    continue;
                }
                ops += operations(&restore);
                let inputs = self.inputs(&restore, true);
                self.send_restore(family, &restore, &inputs, &[], true)?;
                self.planes[idx].applied = true;
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

    /// Without the state, a chain whose rules hash differently from the plan is reported as
    /// it is (a periodic full sync compares with the state: see `verify_family`).
    /// See [`Dataplane::verify`].
    pub fn verify(&mut self) -> Result<Vec<String>, Error> {
        self.verify_with(None)
    }

    /// See [`Dataplane::cleanup`].
    pub fn cleanup(&mut self) -> Result<(), Error> {
        self.invalidate();
        for p in &mut self.planes {
            p.applied = false;
        }
        self.route_localnet_set = false;
        let r = cleanup_with(self.cmd.as_ref(), self.cfg.step_chains);
        self.set_rule_gauges();
        r
    }
}

impl Dataplane for IptablesDataplane {
    fn mode(&self) -> &'static str {
        "iptables"
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        IptablesDataplane::sync(self, state, changes, full).map_err(Error::into_dataplane)
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        IptablesDataplane::verify(self).map_err(Error::into_dataplane)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        IptablesDataplane::cleanup(self).map_err(Error::into_dataplane)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
