//! What one sync sends to `iptables-restore --noflush`: the chains it writes and deletes, and
//! how that is cut into restore inputs.
//!
//! `iptables-restore --noflush` flushes a chain named in a `:CHAIN - [0:0]` line (creating it if
//! needed) and leaves every other chain alone, so a chain is the unit of change. With the
//! iptables-nft backend, each input line that adds a rule looks its chain up in a sorted list
//! of every chain the input touches, so one input naming 100k chains costs minutes; cut into
//! steps of a few thousand chains it costs seconds (see the crate README). The steps are
//! ordered so that no rule ever jumps to a chain that does not exist yet, and every change that
//! decides whether traffic reaches a Service (its dispatch rules in nat and its REJECT/DROP in
//! filter) lands in the last step, in one input.

use std::collections::BTreeSet;
use std::io::{self, Write};
use std::ops::Range;

use kp_core::model::ServiceKey;
use kp_core::track::ProxyState;

use crate::names::ChainId;
use crate::render::RenderContext;
use crate::validate::PlanError;

pub use crate::render::{ChainWrite, ServiceChains, Table};

/// Groups of Service chains a full plan renders from the state only when they are written, so
/// a full restore never holds the text of every chain (tens of megabytes at 10k Services).
/// Group `i` is the `nth` Service port with chains of `services[service]`; its chain names are
/// known up front (`ids[first..first + len]`), as restore inputs declare every chain before
/// any rule. After [`Restore::retain`] a group may write only some of the chains its port
/// renders: those named in its `ids`.
#[derive(Clone)]
pub(crate) struct LazyGroups<'a> {
    pub state: &'a ProxyState,
    pub ctx: RenderContext,
    pub services: Vec<ServiceKey>,
    pub groups: Vec<LazyGroup>,
    pub ids: Vec<ChainId>,
    /// The rules of each chain of `ids`, in the same order.
    pub rule_counts: Vec<u32>,
    pub rules: usize,
}

/// One lazily rendered group (see [`LazyGroups`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LazyGroup {
    pub service: u32,
    pub nth: u32,
    pub first: u32,
    pub len: u32,
}

impl LazyGroups<'_> {
    fn names(&self, g: &LazyGroup) -> impl Iterator<Item = String> + '_ {
        let (a, n) = (g.first as usize, g.len as usize);
        self.ids[a..a + n].iter().map(ChainId::name)
    }

    /// Renders the groups in `range`, in order, one Service at a time: of each group, the
    /// chains its `ids` name.
    fn render(
        &self,
        range: Range<usize>,
        mut each: impl FnMut(&ServiceChains) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut cached: Option<(u32, Vec<ServiceChains>)> = None;
        for g in &self.groups[range] {
            if cached.as_ref().map(|(s, _)| *s) != Some(g.service) {
                let key = &self.services[g.service as usize];
                let groups = crate::render::service_groups(&self.ctx, self.state, key);
                cached = Some((g.service, groups));
            }
            let Some(group) = cached.as_ref().and_then(|(_, v)| v.get(g.nth as usize)) else {
                continue;
            };
            if group.chains.len() == g.len as usize {
                each(group)?;
                continue;
            }
            // Trimmed by `retain`: the chains left out are in the kernel as planned.
            let ids = &self.ids[g.first as usize..(g.first + g.len) as usize];
            let part = ServiceChains {
                service_port: group.service_port.clone(),
                chains: group
                    .chains
                    .iter()
                    .filter(|c| ChainId::parse(&c.chain).is_some_and(|id| ids.contains(&id)))
                    .cloned()
                    .collect(),
            };
            each(&part)?;
        }
        Ok(())
    }

    /// Keeps the chains `keep` accepts (all in nat), dropping groups left with none.
    fn retain(&mut self, keep: &mut dyn FnMut(Table, &str) -> bool) {
        let mut ids = Vec::new();
        let mut counts = Vec::new();
        let mut groups = Vec::new();
        for g in &self.groups {
            let first = ids.len() as u32;
            let range = g.first as usize..(g.first + g.len) as usize;
            for (id, n) in self.ids[range.clone()].iter().zip(&self.rule_counts[range]) {
                if keep(Table::Nat, &id.name()) {
                    ids.push(*id);
                    counts.push(*n);
                }
            }
            let len = ids.len() as u32 - first;
            if len > 0 {
                groups.push(LazyGroup { first, len, ..*g });
            }
        }
        self.rules = counts.iter().map(|n| *n as usize).sum();
        self.ids = ids;
        self.rule_counts = counts;
        self.groups = groups;
    }
}

impl std::fmt::Debug for LazyGroups<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyGroups")
            .field("services", &self.services.len())
            .field("groups", &self.groups.len())
            .field("chains", &self.ids.len())
            .field("rules", &self.rules)
            .finish()
    }
}

impl PartialEq for LazyGroups<'_> {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.state, other.state)
            && self.ctx == other.ctx
            && self.services == other.services
            && self.groups == other.groups
            && self.ids == other.ids
    }
}

impl Eq for LazyGroups<'_> {}

/// Everything one sync changes.
///
/// A partial plan holds its chains; a full plan ([`crate::Planner::full`]) renders most of its
/// Service chains from the state it borrows while they are written ([`Restore::write_input`]),
/// after the groups in `service_chains`. [`Restore::materialize`] renders them all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restore<'a> {
    /// Whether this is a full plan: it rewrites every chain kube-proxy owns, unless the
    /// applier trimmed it to what the kernel lacks ([`Restore::retain`]).
    pub full: bool,
    /// Fixed chains the Service chains jump to (`KUBE-MARK-MASQ`, ...), written first.
    pub base_chains: Vec<ChainWrite>,
    /// Per-Service-port chains, created or rewritten (of a full plan: see above).
    pub service_chains: Vec<ServiceChains>,
    /// Dispatch chains (`KUBE-SERVICES`, `KUBE-NODEPORTS`, `KUBE-EXTERNAL-SERVICES`,
    /// `KUBE-PROXY-FIREWALL`, ...), written in the last step.
    pub dispatch_chains: Vec<ChainWrite>,
    /// Chains to delete, in the last step, after nothing jumps to them any more.
    pub deleted_chains: Vec<(Table, String)>,
    /// What the plan left out because its rules failed validation ([`crate::validate`]): each
    /// Service named in a [`PlanError::Service`] is left out of this family's tables (as if it
    /// had no ClusterIP of the family) until a later plan renders it valid. After a
    /// [`PlanError::Shared`] ([`Restore::fatal`]) the restore is empty: send nothing.
    pub errors: Vec<PlanError>,
    pub(crate) lazy: Option<LazyGroups<'a>>,
}

/// One restore input of a [`Restore`] ([`Restore::inputs`]): the fixed chains or not, a range
/// of Service chain groups, and the dispatch chains with the deletions or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Input {
    base: bool,
    groups: Range<usize>,
    last: bool,
    chains: usize,
}

impl Input {
    /// Chains it writes or deletes.
    pub fn chains(&self) -> usize {
        self.chains
    }

    /// Whether it is the last input of its restore (the dispatch chains and deletions).
    pub fn is_last(&self) -> bool {
        self.last
    }
}

/// Lines the applier adds to one table's section of an input: `decls` right after `*table`,
/// `rules` right before its `COMMIT`. A section the input lacks is added at its end.
#[derive(Clone, Copy, Debug)]
pub struct Extra<'e> {
    /// The table.
    pub table: Table,
    /// Lines such as `:KUBE-PROXY-CANARY - [0:0]`.
    pub decls: &'e [String],
    /// Lines such as `-I PREROUTING …`.
    pub rules: &'e [String],
}

impl<'a> Restore<'a> {
    /// The error that left this plan empty: a rule of a fixed or shared chain failed
    /// validation, so no restore could load (the kernel keeps what it has, and the planner
    /// plans a full restore next).
    pub fn fatal(&self) -> Option<&PlanError> {
        self.errors
            .iter()
            .find(|e| matches!(e, PlanError::Shared { .. }))
    }

    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.base_chains.is_empty()
            && self.group_count() == 0
            && self.dispatch_chains.is_empty()
            && self.deleted_chains.is_empty()
    }

    /// Every chain written or deleted (renders nothing, but allocates every name).
    pub fn chain_names(&self) -> BTreeSet<(Table, String)> {
        let mut out: BTreeSet<(Table, String)> = self
            .writes()
            .map(|c| (c.table, c.chain.clone()))
            .chain(self.deleted_chains.iter().cloned())
            .collect();
        if let Some(l) = &self.lazy {
            out.extend(l.ids.iter().map(|id| (Table::Nat, id.name())));
        }
        out
    }

    /// Number of chains written or deleted.
    pub fn chain_count(&self) -> usize {
        self.writes().count()
            + self.deleted_chains.len()
            + self.lazy.as_ref().map_or(0, |l| l.ids.len())
    }

    /// Number of rules written.
    pub fn rule_count(&self) -> usize {
        self.writes().map(|c| c.rules.len()).sum::<usize>()
            + self.lazy.as_ref().map_or(0, |l| l.rules)
    }

    /// The held chains: fixed, the groups in `service_chains`, dispatch.
    fn writes(&self) -> impl Iterator<Item = &ChainWrite> {
        self.base_chains
            .iter()
            .chain(self.service_chains.iter().flat_map(|g| g.chains.iter()))
            .chain(self.dispatch_chains.iter())
    }

    fn group_count(&self) -> usize {
        self.service_chains.len() + self.lazy.as_ref().map_or(0, |l| l.groups.len())
    }

    fn group_len(&self, i: usize) -> usize {
        match self.service_chains.get(i) {
            Some(g) => g.chains.len(),
            None => self.lazy.as_ref().map_or(0, |l| {
                l.groups
                    .get(i - self.service_chains.len())
                    .map_or(0, |g| g.len as usize)
            }),
        }
    }

    /// Keeps, of the chains this restore writes, only those `keep` accepts (by table and
    /// name); deletions are kept. Service chain groups left with no chain are dropped, and
    /// what remains keeps its order: a chain still comes after the chains of its group it
    /// jumps to, and the dispatch chains and deletions still come last, nat committed before
    /// filter. For adopting what the kernel already holds: a full plan trimmed to the chains
    /// the kernel lacks or holds differently is what a partial plan of the same difference
    /// would send (the chains left out must be in the kernel exactly as planned, so that
    /// every jump of what is written finds its chain). [`Restore::full`] stays set.
    pub fn retain(&mut self, mut keep: impl FnMut(Table, &str) -> bool) {
        self.base_chains.retain(|c| keep(c.table, &c.chain));
        for g in &mut self.service_chains {
            g.chains.retain(|c| keep(c.table, &c.chain));
        }
        self.service_chains.retain(|g| !g.chains.is_empty());
        self.dispatch_chains.retain(|c| keep(c.table, &c.chain));
        if let Some(l) = &mut self.lazy {
            l.retain(&mut keep);
        }
        self.lazy = self.lazy.take().filter(|l| !l.groups.is_empty());
    }

    /// Renders every group: the restore then holds all its text.
    pub fn materialize(mut self) -> Restore<'static> {
        if let Some(l) = self.lazy.take() {
            let n = l.groups.len();
            let _ = l.render(0..n, |g| {
                self.service_chains.push(g.clone());
                Ok(())
            });
        }
        Restore {
            full: self.full,
            base_chains: self.base_chains,
            service_chains: self.service_chains,
            dispatch_chains: self.dispatch_chains,
            deleted_chains: self.deleted_chains,
            errors: self.errors,
            lazy: None,
        }
    }

    /// The whole change as one input: what [`Restore::text`] holds.
    pub fn whole(&self) -> Input {
        Input {
            base: true,
            groups: 0..self.group_count(),
            last: true,
            chains: self.chain_count(),
        }
    }

    /// The whole change as one restore input (one commit per table, nat first, with either
    /// backend).
    pub fn text(&self) -> String {
        self.input_text(&self.whole(), &[])
    }

    /// The change cut into restore inputs of at most about `max_chains` chains each, to be sent
    /// in order. Fixed chains come first, then groups of Service chains (a group is never
    /// split), and the dispatch chains with every deletion come last, together. A change that
    /// fits in `max_chains` is one input, the same as [`Restore::whole`].
    pub fn inputs(&self, max_chains: usize) -> Vec<Input> {
        if self.is_empty() {
            return Vec::new();
        }
        if self.chain_count() <= max_chains.max(1) {
            return vec![self.whole()];
        }
        let mut out = Vec::new();
        let (mut base, mut start, mut current) = (true, 0, self.base_chains.len());
        for i in 0..self.group_count() {
            let len = self.group_len(i);
            if current > 0 && current + len > max_chains {
                out.push(Input {
                    base,
                    groups: start..i,
                    last: false,
                    chains: current,
                });
                (base, start, current) = (false, i, 0);
            }
            current += len;
        }
        if current > 0 {
            out.push(Input {
                base,
                groups: start..self.group_count(),
                last: false,
                chains: current,
            });
        }
        if !self.dispatch_chains.is_empty() || !self.deleted_chains.is_empty() {
            out.push(Input {
                base: false,
                groups: 0..0,
                last: true,
                chains: self.dispatch_chains.len() + self.deleted_chains.len(),
            });
        }
        out
    }

    /// [`Restore::inputs`], each rendered.
    pub fn steps(&self, max_chains: usize) -> Vec<String> {
        self.inputs(max_chains)
            .iter()
            .map(|i| self.input_text(i, &[]))
            .collect()
    }

    /// One input as text, with `extra` lines added.
    pub fn input_text(&self, input: &Input, extra: &[Extra<'_>]) -> String {
        let mut out = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = self.write_input(input, extra, &mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Writes one input, rendering lazily planned chains as it goes: per table (in
    /// [`Table::COMMIT_ORDER`]), `*table`, the extra declarations, the chain lines, the rules,
    /// the deletions, the extra rules and `COMMIT`; then a section for each table that has
    /// extra lines only (nat, then filter). A deleted chain is flushed by its chain line first,
    /// so chains that jump to each other can be deleted together.
    pub fn write_input(
        &self,
        input: &Input,
        extra: &[Extra<'_>],
        w: &mut dyn Write,
    ) -> io::Result<()> {
        let held = self.service_chains.len();
        let held_range = input.groups.start.min(held)..input.groups.end.min(held);
        let lazy_range = input.groups.start.max(held) - held..input.groups.end.max(held) - held;
        let lazy = self.lazy.as_ref().filter(|_| !lazy_range.is_empty());
        let base: &[ChainWrite] = if input.base { &self.base_chains } else { &[] };
        let dispatch: &[ChainWrite] = if input.last {
            &self.dispatch_chains
        } else {
            &[]
        };
        let deleted: &[(Table, String)] = if input.last {
            &self.deleted_chains
        } else {
            &[]
        };
        let held_groups = &self.service_chains[held_range];
        let held_writes = || {
            base.iter()
                .chain(held_groups.iter().flat_map(|g| g.chains.iter()))
        };
        let mut sections = Vec::new();
        for table in Table::COMMIT_ORDER {
            let writes = held_writes()
                .chain(dispatch.iter())
                .any(|c| c.table == table)
                || (table == Table::Nat && lazy.is_some());
            if writes || deleted.iter().any(|(t, _)| *t == table) {
                sections.push(table);
            }
        }
        for table in [Table::Nat, Table::Filter] {
            let wanted = extra
                .iter()
                .any(|e| e.table == table && !(e.decls.is_empty() && e.rules.is_empty()));
            if wanted && !sections.contains(&table) {
                sections.push(table);
            }
        }
        for table in sections {
            let extras = || extra.iter().filter(move |e| e.table == table);
            writeln!(w, "*{}", table.as_str())?;
            for l in extras().flat_map(|e| e.decls.iter()) {
                writeln!(w, "{l}")?;
            }
            for c in held_writes().filter(|c| c.table == table) {
                writeln!(w, ":{} - [0:0]", c.chain)?;
            }
            if let (Some(l), Table::Nat) = (lazy, table) {
                for g in &l.groups[lazy_range.clone()] {
                    for name in l.names(g) {
                        writeln!(w, ":{name} - [0:0]")?;
                    }
                }
            }
            for c in dispatch.iter().filter(|c| c.table == table) {
                writeln!(w, ":{} - [0:0]", c.chain)?;
            }
            for (_, c) in deleted.iter().filter(|(t, _)| *t == table) {
                writeln!(w, ":{c} - [0:0]")?;
            }
            let rules = |w: &mut dyn Write, c: &ChainWrite| -> io::Result<()> {
                for r in &c.rules {
                    writeln!(w, "-A {} {r}", c.chain)?;
                }
                Ok(())
            };
            for c in held_writes().filter(|c| c.table == table) {
                rules(w, c)?;
            }
            if let (Some(l), Table::Nat) = (lazy, table) {
                l.render(lazy_range.clone(), |g| {
                    for c in g.chains.iter().filter(|c| c.table == table) {
                        rules(w, c)?;
                    }
                    Ok(())
                })?;
            }
            for c in dispatch.iter().filter(|c| c.table == table) {
                rules(w, c)?;
            }
            for (_, c) in deleted.iter().filter(|(t, _)| *t == table) {
                writeln!(w, "-X {c}")?;
            }
            for l in extras().flat_map(|e| e.rules.iter()) {
                writeln!(w, "{l}")?;
            }
            writeln!(w, "COMMIT")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(table: Table, name: &str, rules: &[&str]) -> ChainWrite {
        ChainWrite {
            table,
            chain: name.into(),
            rules: rules.iter().map(|r| r.to_string()).collect(),
        }
    }

    fn sample() -> Restore<'static> {
        Restore {
            full: true,
            base_chains: vec![chain(
                Table::Nat,
                "KUBE-MARK-MASQ",
                &["-j MARK --or-mark 0x4000"],
            )],
            service_chains: (0..3)
                .map(|i| ServiceChains {
                    service_port: format!("ns/s{i}:p"),
                    chains: vec![
                        chain(
                            Table::Nat,
                            &format!("KUBE-SEP-{i}"),
                            &["-j DNAT --to-destination 10.0.0.1:80"],
                        ),
                        chain(
                            Table::Nat,
                            &format!("KUBE-SVC-{i}"),
                            &[&format!("-j KUBE-SEP-{i}")],
                        ),
                    ],
                })
                .collect(),
            dispatch_chains: vec![
                chain(Table::Filter, "KUBE-SERVICES", &[]),
                chain(
                    Table::Nat,
                    "KUBE-SERVICES",
                    &["-d 10.96.0.1/32 -j KUBE-SVC-0"],
                ),
            ],
            deleted_chains: vec![(Table::Nat, "KUBE-SVC-OLD".into())],
            errors: Vec::new(),
            lazy: None,
        }
    }

    #[test]
    fn one_input_commits_nat_before_filter_and_deletes_last() {
        let text = sample().text();
        let filter = text.find("*filter").unwrap();
        let nat = text.find("*nat").unwrap();
        assert!(nat < filter);
        let flush = text.find(":KUBE-SVC-OLD - [0:0]").unwrap();
        let delete = text.find("-X KUBE-SVC-OLD").unwrap();
        let last_rule = text.rfind("-A ").unwrap();
        assert!(flush < delete && last_rule < delete, "{text}");
        assert_eq!(text.matches("COMMIT").count(), 2);
    }

    #[test]
    fn steps_keep_groups_whole_and_dispatch_last() {
        let r = sample();
        let steps = r.steps(3);
        assert_eq!(steps.len(), 4, "{steps:#?}");
        assert!(steps[0].contains("KUBE-MARK-MASQ") && steps[0].contains("KUBE-SVC-0"));
        assert!(steps[1].contains("KUBE-SEP-1") && steps[1].contains("KUBE-SVC-1"));
        assert!(steps[2].contains("KUBE-SVC-2"));
        let last = steps.last().unwrap();
        assert!(last.contains("-X KUBE-SVC-OLD") && last.contains("-A KUBE-SERVICES"));
        assert!(!last.contains("KUBE-SEP-"));
        // Small enough: one input, identical to text().
        assert_eq!(r.steps(100), vec![r.text()]);
        assert!(Restore::default().steps(10).is_empty());
    }

    #[test]
    fn counts() {
        let r = sample();
        assert_eq!(r.rule_count(), 1 + 6 + 1);
        assert_eq!(r.chain_names().len(), 1 + 6 + 2 + 1);
        assert!(!r.is_empty());
    }
}
