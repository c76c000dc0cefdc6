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
use std::fmt::Write as _;

/// An iptables table kube-proxy writes with `iptables-restore`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// The filter table.
    Filter,
    /// The nat table.
    Nat,
}

impl Table {
    /// Both tables.
    pub const ALL: [Table; 2] = [Table::Filter, Table::Nat];

    /// The order a restore input lists (and so commits) them: nat, then filter. Both
    /// iptables-restore backends commit table by table. Upstream commits filter first, so a
    /// Service gaining its first endpoint loses its REJECT before its DNAT exists, for as long
    /// as the (large) nat commit takes; nat first makes the only window the reverse case (a
    /// Service losing its last endpoint, DNAT gone before the REJECT lands), bounded by the
    /// small filter commit.
    pub const COMMIT_ORDER: [Table; 2] = [Table::Nat, Table::Filter];

    /// The table's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
        }
    }
}

/// One chain, written whole: flushed (or created) and filled with `rules`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainWrite {
    /// Its table.
    pub table: Table,
    /// Its name.
    pub chain: String,
    /// Its rules in order, each as the arguments after `-A CHAIN `.
    pub rules: Vec<String>,
}

/// The chains of one Service port (`KUBE-SVC`, `KUBE-SVL`, `KUBE-EXT`, `KUBE-FW` and its
/// `KUBE-SEP` chains): they jump to each other and to the fixed chains only, so a group can be
/// written in any step after the fixed chains exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceChains {
    /// The Service port, upstream's spelling (`namespace/name:port`).
    pub service_port: String,
    /// Its chains; a chain appears after the chains it jumps to.
    pub chains: Vec<ChainWrite>,
}

/// Everything one sync changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restore {
    /// Whether this rewrites every chain kube-proxy owns.
    pub full: bool,
    /// Fixed chains the Service chains jump to (`KUBE-MARK-MASQ`, ...), written first.
    pub base_chains: Vec<ChainWrite>,
    /// Per-Service-port chains, created or rewritten.
    pub service_chains: Vec<ServiceChains>,
    /// Dispatch chains (`KUBE-SERVICES`, `KUBE-NODEPORTS`, `KUBE-EXTERNAL-SERVICES`,
    /// `KUBE-PROXY-FIREWALL`, ...), written in the last step.
    pub dispatch_chains: Vec<ChainWrite>,
    /// Chains to delete, in the last step, after nothing jumps to them any more.
    pub deleted_chains: Vec<(Table, String)>,
}

impl Restore {
    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.base_chains.is_empty()
            && self.service_chains.is_empty()
            && self.dispatch_chains.is_empty()
            && self.deleted_chains.is_empty()
    }

    /// Every chain written or deleted.
    pub fn chain_names(&self) -> BTreeSet<(Table, &str)> {
        self.writes()
            .map(|c| (c.table, c.chain.as_str()))
            .chain(self.deleted_chains.iter().map(|(t, c)| (*t, c.as_str())))
            .collect()
    }

    /// Number of rules written.
    pub fn rule_count(&self) -> usize {
        self.writes().map(|c| c.rules.len()).sum()
    }

    fn writes(&self) -> impl Iterator<Item = &ChainWrite> {
        self.base_chains
            .iter()
            .chain(self.service_chains.iter().flat_map(|g| g.chains.iter()))
            .chain(self.dispatch_chains.iter())
    }

    /// The whole change as one restore input (one commit per table, nat first, with either
    /// backend).
    pub fn text(&self) -> String {
        render(&self.writes().collect::<Vec<_>>(), &self.deleted_chains)
    }

    /// The change cut into restore inputs of at most about `max_chains` chains each, to be sent
    /// in order. Fixed chains come first, then groups of Service chains (a group is never
    /// split), and the dispatch chains with every deletion come last, together. A change that
    /// fits in `max_chains` is one input, the same as [`Restore::text`].
    pub fn steps(&self, max_chains: usize) -> Vec<String> {
        let total = self.writes().count() + self.deleted_chains.len();
        if total <= max_chains.max(1) {
            return if self.is_empty() {
                Vec::new()
            } else {
                vec![self.text()]
            };
        }
        let mut steps = Vec::new();
        let mut current: Vec<&ChainWrite> = self.base_chains.iter().collect();
        for group in &self.service_chains {
            if !current.is_empty() && current.len() + group.chains.len() > max_chains {
                steps.push(render(&current, &[]));
                current.clear();
            }
            current.extend(group.chains.iter());
        }
        if !current.is_empty() {
            steps.push(render(&current, &[]));
        }
        let last: Vec<&ChainWrite> = self.dispatch_chains.iter().collect();
        if !last.is_empty() || !self.deleted_chains.is_empty() {
            steps.push(render(&last, &self.deleted_chains));
        }
        steps
    }
}

/// Renders one restore input: per table (in [`Table::COMMIT_ORDER`]), the chain lines, then
/// the rules, then the deletions.
/// A deleted chain is flushed by its chain line first, so chains that jump to each other can be
/// deleted together.
fn render(writes: &[&ChainWrite], deleted: &[(Table, String)]) -> String {
    let mut out = String::new();
    for table in Table::COMMIT_ORDER {
        let w: Vec<&&ChainWrite> = writes.iter().filter(|c| c.table == table).collect();
        let d: Vec<&String> = deleted
            .iter()
            .filter(|(t, _)| *t == table)
            .map(|(_, c)| c)
            .collect();
        if w.is_empty() && d.is_empty() {
            continue;
        }
        let _ = writeln!(out, "*{}", table.as_str());
        for c in &w {
            let _ = writeln!(out, ":{} - [0:0]", c.chain);
        }
        for c in &d {
            let _ = writeln!(out, ":{c} - [0:0]");
        }
        for c in &w {
            for r in &c.rules {
                let _ = writeln!(out, "-A {} {r}", c.chain);
            }
        }
        for c in &d {
            let _ = writeln!(out, "-X {c}");
        }
        out.push_str("COMMIT\n");
    }
    out
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

    fn sample() -> Restore {
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
