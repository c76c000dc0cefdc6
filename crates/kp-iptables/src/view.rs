//! What the kernel holds, read at a cost that stays low with 100k chains, and chain deletions
//! cut to the same scale.
//!
//! The legacy tools read a table as one blob: `iptables-legacy-save` is cheap at any size. The
//! nft tools are not: any iptables-nft command that reads a whole table (`-save`, `-S`, `-L`)
//! pairs each rule with its chain by a linear search, so at 10k Services × 10 endpoints
//! (128k chains, 378k rules) `iptables-nft-save -t nat` runs for minutes and crashed after two
//! (iptables 1.8.9). Commands on one chain (`-S CHAIN`) stay cheap (6 ms, 0.4 s for a 12k-rule
//! `KUBE-SERVICES`), and `nft list chains` lists every chain name in about a second. So with the
//! nft backend a [`TableView`] holds the names from `nft`, and reads rules one chain at a time.
//!
//! Deleting is the same story: one iptables-nft-restore input that flushes and deletes 128k
//! chains ran for over 20 minutes (quadratic in its own command list), while inputs of 2000
//! chains did it in 7 s. [`deletion_inputs`] cuts a deletion that way.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::IpFamily;

use crate::readback::{parse_save, SavedTable};
use crate::runner::{Backend, IptablesCommand};
use crate::Error;

/// The chains of one table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ChainList {
    /// Chains created with `-N` (or a restore's `:CHAIN - [0:0]`).
    pub user: BTreeSet<String>,
    /// Built-in chains (those attached to a hook).
    pub builtin: BTreeSet<String>,
}

impl ChainList {
    /// Whether the table has `chain`.
    pub fn contains(&self, chain: &str) -> bool {
        self.user.contains(chain) || self.builtin.contains(chain)
    }
}

/// Reads one chain's rules (`None`: no such chain).
pub(crate) type ReadRules<'a> = &'a dyn Fn(&str) -> Result<Option<Vec<String>>, Error>;

/// Parses `nft list chains ip` (or `ip6`): the chains of `tables` only. A chain followed by a
/// `type … hook …` line is a built-in one.
pub(crate) fn parse_nft_chains(text: &str, tables: &[&str]) -> BTreeMap<String, ChainList> {
    let mut out: BTreeMap<String, ChainList> = tables
        .iter()
        .map(|t| (t.to_string(), ChainList::default()))
        .collect();
    let mut table: Option<String> = None;
    let mut chain: Option<String> = None;
    for line in text.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("table ") {
            // `table ip nat {`
            table = rest
                .trim_end_matches('{')
                .split_whitespace()
                .nth(1)
                .map(|t| t.trim_matches('"').to_string());
            chain = None;
        } else if let Some(rest) = l.strip_prefix("chain ") {
            let name = rest
                .trim_end_matches('{')
                .trim()
                .trim_matches('"')
                .to_string();
            if let Some(list) = table.as_ref().and_then(|t| out.get_mut(t)) {
                list.user.insert(name.clone());
            }
            chain = Some(name);
        } else if l.starts_with("type ") && l.contains(" hook ") {
            if let (Some(list), Some(c)) = (table.as_ref().and_then(|t| out.get_mut(t)), &chain) {
                list.user.remove(c);
                list.builtin.insert(c.clone());
            }
        }
    }
    out
}

/// Parses `iptables -S CHAIN`: the chain's rules, each the arguments after `-A CHAIN `.
pub(crate) fn parse_listing(text: &str, chain: &str) -> Vec<String> {
    let prefix = format!("-A {chain} ");
    let bare = format!("-A {chain}");
    text.lines()
        .filter_map(|l| {
            l.strip_prefix(&prefix)
                .map(str::to_string)
                .or_else(|| (l == bare).then(String::new))
        })
        .collect()
}

/// One table as the kernel holds it: its chain names, and its rules either all read at once
/// (legacy, or when `nft` is not installed) or read per chain on demand (nft).
#[derive(Debug)]
pub(crate) struct TableView {
    /// `nat`, `filter` or `mangle`.
    pub table: &'static str,
    /// Its chains.
    pub chains: ChainList,
    saved: Option<SavedTable>,
}

impl TableView {
    fn from_saved(table: &'static str, saved: SavedTable) -> TableView {
        let chains = ChainList {
            user: saved
                .chains
                .keys()
                .filter(|c| !saved.builtin.contains(*c))
                .cloned()
                .collect(),
            builtin: saved.builtin.clone(),
        };
        TableView {
            table,
            chains,
            saved: Some(saved),
        }
    }

    /// The rules of `chain`, or `None` if the table has no such chain.
    pub fn rules(
        &self,
        cmd: &IptablesCommand,
        backend: Backend,
        family: IpFamily,
        chain: &str,
    ) -> Result<Option<Vec<String>>, Error> {
        if !self.chains.contains(chain) {
            return Ok(None);
        }
        if let Some(saved) = &self.saved {
            return Ok(saved.chains.get(chain).cloned());
        }
        chain_rules(cmd, backend, family, self.table, chain)
    }
}

/// `iptables -t TABLE -S CHAIN`: one chain's rules, or `None` if it does not exist.
pub(crate) fn chain_rules(
    cmd: &IptablesCommand,
    backend: Backend,
    family: IpFamily,
    table: &str,
    chain: &str,
) -> Result<Option<Vec<String>>, Error> {
    let out = cmd.run(backend, family, &["-t", table, "-S", chain])?;
    match out.status {
        Some(0) => Ok(Some(parse_listing(&out.stdout, chain))),
        // No such chain (or, with nft, no such table).
        Some(1) => Ok(None),
        _ => Err(Error::Command {
            command: format!("{} -t {table} -S {chain}", backend.program(family, "")),
            status: out.status,
            stderr: out.stderr,
        }),
    }
}

/// Reads `tables` of one backend and family: with the nft backend, chain names from `nft` and
/// rules on demand, unless `whole` (then, and with legacy, every table is saved at once). Legacy
/// tables that do not exist are empty (reading them would create them).
pub(crate) fn read_tables(
    cmd: &IptablesCommand,
    backend: Backend,
    family: IpFamily,
    tables: &[&'static str],
    whole: bool,
) -> Result<Vec<TableView>, Error> {
    if backend == Backend::Nft && !whole {
        match cmd.nft_list_chains(family) {
            Ok(text) => {
                tracing::debug!(family = ?family, bytes = text.len(), "listed chains with nft");
                let mut lists = parse_nft_chains(&text, tables);
                return Ok(tables
                    .iter()
                    .map(|t| TableView {
                        table: t,
                        chains: lists.remove(*t).unwrap_or_default(),
                        saved: None,
                    })
                    .collect());
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list chains with nft; reading whole tables with iptables-nft-save (slow with many chains)");
            }
        }
    }
    let legacy = (backend == Backend::Legacy).then(|| cmd.legacy_tables(family));
    let mut out = Vec::new();
    for t in tables {
        if legacy.as_ref().is_some_and(|l| !l.iter().any(|x| x == t)) {
            out.push(TableView {
                table: t,
                chains: ChainList::default(),
                saved: Some(SavedTable::default()),
            });
            continue;
        }
        let text = cmd.save(backend, family, Some(t))?;
        out.push(TableView::from_saved(t, parse_save(&text, t)?));
    }
    Ok(out)
}

/// Restore inputs that first run `pre` (rule deletions), then flush every chain of `doomed` and
/// delete them (a chain can only go once nothing jumps to it, so every flush comes first). Up to
/// `batch` chains, one input. More: with nft, inputs of at most `batch` chains each; with
/// legacy, two inputs, the flushes and then the deletions (libiptc took 51 s to flush and delete
/// 128k chains in one input, and 5 s in two).
pub(crate) fn deletion_inputs(
    table: &str,
    pre: &[String],
    doomed: &[String],
    backend: Backend,
    batch: usize,
) -> Vec<String> {
    if pre.is_empty() && doomed.is_empty() {
        return Vec::new();
    }
    let wrap = |body: String| format!("*{table}\n{body}COMMIT\n");
    let lines = |prefix: &str, suffix: &str, chains: &[String]| -> String {
        chains
            .iter()
            .map(|c| format!("{prefix}{c}{suffix}\n"))
            .collect()
    };
    let pre_text: String = pre.iter().map(|l| format!("{l}\n")).collect();
    let batch = batch.max(1);
    if doomed.len() <= batch {
        return vec![wrap(format!(
            "{pre_text}{}{}",
            lines(":", " - [0:0]", doomed),
            lines("-X ", "", doomed)
        ))];
    }
    match backend {
        Backend::Legacy => vec![
            wrap(format!("{pre_text}{}", lines(":", " - [0:0]", doomed))),
            wrap(lines("-X ", "", doomed)),
        ],
        Backend::Nft => {
            let mut inputs = Vec::new();
            if !pre.is_empty() {
                inputs.push(wrap(pre_text));
            }
            for part in doomed.chunks(batch) {
                inputs.push(wrap(lines(":", " - [0:0]", part)));
            }
            for part in doomed.chunks(batch) {
                inputs.push(wrap(lines("-X ", "", part)));
            }
            inputs
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nft list chains ip` in a namespace holding iptables-nft tables and an nftables-mode
    /// table (nft 1.0.6).
    const NFT_CHAINS: &str = "table ip nat {
\tchain KUBE-MARK-MASQ {
\t}
\tchain PREROUTING {
\t\ttype nat hook prerouting priority dstnat; policy accept;
\t}
\tchain KUBE-SEP-SBTZEYXKGXHCIW3Y {
\t}
}
table ip filter {
\tchain INPUT {
\t\ttype filter hook input priority filter; policy accept;
\t}
\tchain MY-CHAIN {
\t}
}
table ip kube-proxy {
\tchain services {
\t}
}
";

    #[test]
    fn nft_chain_listings_give_each_tables_chains() {
        let lists = parse_nft_chains(NFT_CHAINS, &["nat", "filter", "mangle"]);
        assert_eq!(lists.len(), 3);
        let nat = &lists["nat"];
        assert_eq!(
            nat.user.iter().collect::<Vec<_>>(),
            ["KUBE-MARK-MASQ", "KUBE-SEP-SBTZEYXKGXHCIW3Y"]
        );
        assert!(nat.builtin.contains("PREROUTING"));
        assert!(lists["filter"].user.contains("MY-CHAIN"));
        assert!(lists["filter"].builtin.contains("INPUT"));
        assert_eq!(lists["mangle"], ChainList::default());
        assert!(!lists.values().any(|l| l.contains("services")));
    }

    #[test]
    fn chain_listings_give_the_chains_rules() {
        let text = "-N KUBE-SVC-X\n-A KUBE-SVC-X -m comment --comment \"a b\" -j KUBE-SEP-Y\n-A KUBE-SVC-XY -j Z\n-A KUBE-SVC-X\n";
        assert_eq!(
            parse_listing(text, "KUBE-SVC-X"),
            ["-m comment --comment \"a b\" -j KUBE-SEP-Y", ""]
        );
        assert!(parse_listing("-P INPUT ACCEPT\n", "INPUT").is_empty());
    }

    #[test]
    fn large_deletions_are_cut_flushes_first() {
        let doomed: Vec<String> = (0..5).map(|i| format!("KUBE-SEP-{i}")).collect();
        let pre = vec!["-D PREROUTING -j KUBE-SERVICES".to_string()];
        let one = deletion_inputs("nat", &pre, &doomed, Backend::Nft, 10);
        assert_eq!(one.len(), 1);
        assert!(one[0].starts_with("*nat\n-D PREROUTING"));
        assert!(one[0].find(":KUBE-SEP-4").unwrap() < one[0].find("-X KUBE-SEP-0").unwrap());
        assert_eq!(
            deletion_inputs("nat", &pre, &doomed, Backend::Legacy, 5),
            one
        );

        let cut = deletion_inputs("nat", &pre, &doomed, Backend::Nft, 2);
        assert_eq!(cut.len(), 1 + 3 + 3, "{cut:#?}");
        assert_eq!(cut[0], "*nat\n-D PREROUTING -j KUBE-SERVICES\nCOMMIT\n");
        assert!(cut[1..4]
            .iter()
            .all(|i| i.contains(":KUBE-SEP-") && !i.contains("-X")));
        assert!(cut[4..]
            .iter()
            .all(|i| i.contains("-X KUBE-SEP-") && !i.contains(':')));
        assert_eq!(cut[6], "*nat\n-X KUBE-SEP-4\nCOMMIT\n");
        assert!(deletion_inputs("nat", &[], &[], Backend::Nft, 2).is_empty());

        let legacy = deletion_inputs("nat", &pre, &doomed, Backend::Legacy, 2);
        assert_eq!(legacy.len(), 2, "{legacy:#?}");
        assert!(legacy[0].starts_with("*nat\n-D PREROUTING") && legacy[0].contains(":KUBE-SEP-4"));
        assert!(!legacy[0].contains("-X"));
        assert!(legacy[1].contains("-X KUBE-SEP-0") && legacy[1].contains("-X KUBE-SEP-4"));
    }
}
