//! What the kernel holds, read at a cost that stays low with 100k chains, and chain deletions
//! cut to the same scale.
//!
//! The legacy tools read a table as one blob: `iptables-legacy-save` is cheap at any size. The
//! nft tools are not: any iptables-nft command that reads a whole table (`-save`, `-S`, `-L`)
//! pairs each rule with its chain by a linear search, so at 10k Services × 10 endpoints
//! (128k chains, 378k rules) `iptables-nft-save -t nat` runs for minutes and crashed after two
//! (iptables 1.8.9). Commands on one chain (`-S CHAIN`) stay cheap (6 ms, 0.4 s for a 12k-rule
//! `KUBE-SERVICES`), and `nft list chains` lists every chain name in about a second. So with the
//! nft backend [`scan_tables`] reports the names from `nft`, and rules are read one chain at a
//! time. Everything is read as a stream (line by line as the tool prints it): no table's text
//! is held whole.
//!
//! Deleting is the same story: one iptables-nft-restore input that flushes and deletes 128k
//! chains ran for over 20 minutes (quadratic in its own command list), while inputs of 2000
//! chains did it in 7 s. [`deletion_inputs`] cuts a deletion that way.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::IpFamily;

use crate::names::CANARY_CHAIN;
use crate::runner::{Backend, IptablesRunner};
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

/// Follows `nft list chains ip` (or `ip6`) line by line: `table ip nat {`, `chain NAME {`, and
/// for a built-in chain a `type … hook …` line right after it. Reports the chains of `tables`
/// only, as (index in `tables`, name, built-in).
pub(crate) struct NftChainParser<'t> {
    tables: &'t [&'static str],
    table: Option<usize>,
    pending: Option<String>,
}

impl<'t> NftChainParser<'t> {
    pub fn new(tables: &'t [&'static str]) -> Self {
        NftChainParser {
            tables,
            table: None,
            pending: None,
        }
    }

    /// The next line; a chain is reported once the line after it is seen.
    pub fn line(&mut self, line: &str) -> Option<(usize, String, bool)> {
        let l = line.trim();
        let builtin = l.starts_with("type ") && l.contains(" hook ");
        let done = match (self.table, self.pending.take()) {
            (Some(t), Some(name)) => Some((t, name, builtin)),
            _ => None,
        };
        if let Some(rest) = l.strip_prefix("table ") {
            let name = rest
                .trim_end_matches('{')
                .split_whitespace()
                .nth(1)
                .map(|t| t.trim_matches('"').to_string());
            self.table = name.and_then(|n| self.tables.iter().position(|t| *t == n));
        } else if let Some(rest) = l.strip_prefix("chain ") {
            self.pending = Some(
                rest.trim_end_matches('{')
                    .trim()
                    .trim_matches('"')
                    .to_string(),
            );
        }
        done
    }

    /// After the last line.
    pub fn finish(&mut self) -> Option<(usize, String, bool)> {
        match (self.table, self.pending.take()) {
            (Some(t), Some(name)) => Some((t, name, false)),
            _ => None,
        }
    }
}

/// Parses a whole `nft list chains` output: the chains of `tables` only.
#[cfg(test)]
pub(crate) fn parse_nft_chains(text: &str, tables: &[&'static str]) -> BTreeMap<String, ChainList> {
    let mut out: BTreeMap<String, ChainList> = tables
        .iter()
        .map(|t| (t.to_string(), ChainList::default()))
        .collect();
    let mut parser = NftChainParser::new(tables);
    let mut found: Vec<_> = text.lines().filter_map(|l| parser.line(l)).collect();
    found.extend(parser.finish());
    for (t, name, builtin) in found {
        let list = out.entry(tables[t].to_string()).or_default();
        if builtin {
            list.builtin.insert(name);
        } else {
            list.user.insert(name);
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

/// `iptables -t TABLE -S CHAIN`: one chain's rules, or `None` if it does not exist.
pub(crate) fn chain_rules(
    cmd: &dyn IptablesRunner,
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

/// What a streaming read of a table reports, in the order the tools print it.
pub(crate) enum Seen<'l> {
    /// A chain of the table.
    Chain {
        /// Its name.
        name: &'l str,
        /// Whether it is a built-in one (has a policy, or a hook).
        builtin: bool,
    },
    /// The rules of a chain that is not built-in, each the arguments after `-A CHAIN `, once
    /// its last rule has been read (only when the table is read whole; a chain without rules
    /// has no such report).
    Rules {
        /// The chain.
        chain: &'l str,
        /// Its rules.
        rules: &'l [String],
    },
}

/// What a streaming read keeps of one table: whether the canary is there, and the built-in
/// chains (with their rules when the table was read whole). Everything else went to the
/// visitor and is not held.
#[derive(Debug)]
pub(crate) struct TableScan {
    /// `nat` or `filter`.
    pub table: &'static str,
    /// Whether `KUBE-PROXY-CANARY` exists in it.
    pub canary: bool,
    /// Whether it was read whole (every non-built-in chain's rules went to the visitor).
    pub whole: bool,
    builtin: BTreeMap<String, Option<Vec<String>>>,
}

impl TableScan {
    /// The rules of a built-in chain, or `None` if the table has no such chain.
    pub fn builtin_rules(
        &self,
        cmd: &dyn IptablesRunner,
        backend: Backend,
        family: IpFamily,
        chain: &str,
    ) -> Result<Option<Vec<String>>, Error> {
        match self.builtin.get(chain) {
            None => Ok(None),
            Some(Some(rules)) => Ok(Some(rules.clone())),
            Some(None) => chain_rules(cmd, backend, family, self.table, chain),
        }
    }
}

/// Reads `tables` of one backend and family as a stream (whole with legacy or with `whole`,
/// in one `iptables-save` run; else chain names from `nft`), handing every chain and, when read
/// whole, every non-built-in chain's rules to `visit` without keeping them. A table that does
/// not exist is empty (a legacy one is not created by reading). A table iptables-nft-save
/// cannot print (made incompatible with `nft`) is an error, not an empty table.
pub(crate) fn scan_tables(
    cmd: &dyn IptablesRunner,
    backend: Backend,
    family: IpFamily,
    tables: &[&'static str],
    whole: bool,
    visit: &mut dyn FnMut(&'static str, Seen<'_>),
) -> Result<Vec<TableScan>, Error> {
    let mut scans: Vec<TableScan> = tables
        .iter()
        .map(|t| TableScan {
            table: t,
            canary: false,
            whole: true,
            builtin: BTreeMap::new(),
        })
        .collect();
    if backend == Backend::Nft && !whole {
        let mut parser = NftChainParser::new(tables);
        let mut report = |scans: &mut Vec<TableScan>, (t, name, builtin): (usize, String, bool)| {
            let scan = &mut scans[t];
            if builtin {
                scan.builtin.insert(name.clone(), None);
            } else if name == CANARY_CHAIN {
                scan.canary = true;
            }
            visit(
                scan.table,
                Seen::Chain {
                    name: &name,
                    builtin,
                },
            );
        };
        let listed = cmd.nft_chain_lines(family, &mut |line| {
            if let Some(found) = parser.line(line) {
                report(&mut scans, found);
            }
            Ok(())
        });
        match listed {
            Ok(()) => {
                if let Some(found) = parser.finish() {
                    report(&mut scans, found);
                }
                scans.iter_mut().for_each(|s| s.whole = false);
                return Ok(scans);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list chains with nft; reading whole tables with iptables-nft-save (slow with many chains)");
                scans.iter_mut().for_each(|s| {
                    s.canary = false;
                    s.builtin.clear();
                });
            }
        }
    }
    // Whole tables: one `iptables-save` for all of them. iptables-nft-save dumps the rules of
    // every table whichever `-t` it is given (at 10k Services × 10 endpoints `-t nat` took
    // 1.3 s, `-t filter` 1.0 s, both at once 1.4 s); a legacy table that does not exist is not
    // printed (nor created, as reading it by name would).
    let mut inside: Option<usize> = None;
    let mut current: Option<(String, Vec<String>)> = None;
    let mut line_no = 0;
    let flush = |inside: Option<usize>,
                 current: &mut Option<(String, Vec<String>)>,
                 visit: &mut dyn FnMut(&'static str, Seen<'_>)| {
        if let (Some(i), Some((chain, rules))) = (inside, current.take()) {
            visit(
                tables[i],
                Seen::Rules {
                    chain: &chain,
                    rules: &rules,
                },
            );
        }
    };
    cmd.save_lines(backend, family, None, &mut |line| {
        line_no += 1;
        if let Some(name) = line.strip_prefix('*') {
            flush(inside, &mut current, visit);
            inside = tables.iter().position(|t| *t == name.trim());
            return Ok(());
        }
        if let Some(name) = incompatible_table(line) {
            if tables.contains(&name) {
                return Err(Error::Parse(format!(
                    "table {name} holds rules iptables cannot show: `{line}`"
                )));
            }
            return Ok(());
        }
        let Some(i) = inside else {
            return Ok(());
        };
        if line.is_empty() || line.starts_with('#') {
            return Ok(());
        }
        if line == "COMMIT" {
            flush(inside, &mut current, visit);
            return Ok(());
        }
        let scan = &mut scans[i];
        let t = scan.table;
        if let Some(decl) = line.strip_prefix(':') {
            let mut words = decl.split_whitespace();
            let name = words.next().unwrap_or_default();
            let builtin = words.next().is_some_and(|policy| policy != "-");
            if builtin {
                scan.builtin.insert(name.to_string(), Some(Vec::new()));
            } else if name == CANARY_CHAIN {
                scan.canary = true;
            }
            visit(t, Seen::Chain { name, builtin });
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let (chain, args) = rule.split_once(' ').unwrap_or((rule, ""));
            if let Some(Some(rules)) = scan.builtin.get_mut(chain) {
                rules.push(args.to_string());
                return Ok(());
            }
            if current.as_ref().map(|(c, _)| c.as_str()) != Some(chain) {
                flush(inside, &mut current, visit);
                current = Some((chain.to_string(), Vec::new()));
            }
            if let Some((_, rules)) = current.as_mut() {
                rules.push(args.to_string());
            }
        } else {
            return Err(Error::Parse(format!(
                "iptables-save line {line_no}: unexpected `{}`",
                line.chars().take(200).collect::<String>()
            )));
        }
        Ok(())
    })?;
    flush(inside, &mut current, visit);
    Ok(scans)
}

/// The table an `iptables-nft-save` comment says it cannot print (``# Table `nat' is
/// incompatible, use 'nft' tool.``: it holds rules made with `nft` that iptables cannot
/// express). Read as empty, such a table would look like one that lost all our chains.
fn incompatible_table(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("# Table `")?;
    let (name, tail) = rest.split_once('\'')?;
    tail.contains("incompatible").then_some(name)
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
    fn a_table_iptables_cannot_print_is_named() {
        assert_eq!(
            incompatible_table("# Table `nat' is incompatible, use 'nft' tool."),
            Some("nat")
        );
        assert_eq!(
            incompatible_table(
                "# Warning: iptables-legacy tables present, use iptables-legacy-save to see them"
            ),
            None
        );
        assert_eq!(
            incompatible_table("# Generated by iptables-nft-save v1.8.9 on Mon"),
            None
        );
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
