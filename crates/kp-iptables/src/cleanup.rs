//! Removing everything kube-proxy's iptables mode installs, on either backend, leaving every
//! other chain alone (upstream `CleanupLeftovers` in `pkg/proxy/iptables/proxier.go`).
//!
//! Which chains are ours is decided by name only, from what `iptables-save` shows, so this
//! works without a planner: the nftables mode calls it at start to remove an iptables-mode
//! leftover, and `--cleanup` calls it before exiting.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::IpFamily;

use crate::names::{is_owned_chain, CANARY_CHAIN, CANARY_TABLES, LOCALNET_CHAIN, LOCALNET_COMMENT};
use crate::readback::split_args;
use crate::runner::{Backend, IptablesCommand, IptablesRunner};
use crate::view::{chain_rules, deletion_inputs, scan_tables, ChainList, ReadRules, Seen};
use crate::Error;

fn is_localnet_rule(rule: &str) -> bool {
    let words = split_args(rule);
    words
        .windows(2)
        .any(|w| w[0] == "--comment" && w[1] == LOCALNET_COMMENT)
}

/// The chain a rule jumps or goes to, if any.
pub(crate) fn rule_target(rule: &str) -> Option<String> {
    let words = split_args(rule);
    words
        .windows(2)
        .find(|w| w[0] == "-j" || w[0] == "--jump" || w[0] == "-g" || w[0] == "--goto")
        .map(|w| w[1].clone())
}

/// What removing our chains from one table takes: the rule deletions to run first (every rule
/// elsewhere that jumps to a chain being deleted, so our jumps from the built-in chains and
/// anything else that would stop the deletion, plus our rule in a `KUBE-FIREWALL` we share with
/// kubelet), and the chains to flush and delete. `rules` reads one chain's rules.
pub(crate) fn plan_cleanup(
    table: &str,
    chains: &ChainList,
    rules: ReadRules<'_>,
) -> Result<(Vec<String>, Vec<String>), Error> {
    let mut doomed: Vec<String> = Vec::new();
    let mut pre: Vec<String> = Vec::new();
    for chain in &chains.user {
        let ours = match table {
            "mangle" => chain == CANARY_CHAIN,
            "nat" | "filter" if chain == LOCALNET_CHAIN => {
                let rs = rules(chain)?.unwrap_or_default();
                let mine: Vec<&String> = rs.iter().filter(|r| is_localnet_rule(r)).collect();
                if !mine.is_empty() && mine.len() < rs.len() {
                    // Shared with kubelet: take only our rule out.
                    pre.extend(mine.iter().map(|r| format!("-D {chain} {r}")));
                }
                !mine.is_empty() && mine.len() == rs.len()
            }
            "nat" | "filter" => is_owned_chain(chain),
            _ => false,
        };
        if ours {
            doomed.push(chain.clone());
        }
    }
    if doomed.is_empty() {
        return Ok((pre, doomed));
    }
    let doomed_set: BTreeSet<&str> = doomed.iter().map(String::as_str).collect();
    let mut jumps = Vec::new();
    for chain in chains.builtin.iter().chain(chains.user.iter()) {
        if doomed_set.contains(chain.as_str()) {
            continue;
        }
        for r in rules(chain)?.unwrap_or_default() {
            if rule_target(&r).is_some_and(|t| doomed_set.contains(t.as_str())) {
                jumps.push(format!("-D {chain} {r}"));
            }
        }
    }
    jumps.extend(pre);
    Ok((jumps, doomed))
}

/// Removes what kube-proxy owns from one backend's tables of one family. A missing table, a
/// missing tool, or a kernel without the legacy interface is nothing to clean, not an error.
/// More than `batch` chains are deleted in several inputs (see `deletion_inputs`). Returns the
/// number of chains deleted.
pub fn cleanup_tables(
    cmd: &dyn IptablesRunner,
    backend: Backend,
    family: IpFamily,
    batch: usize,
) -> Result<usize, Error> {
    // Read as a stream: chain names, and of the rules only those that could stop a deletion
    // (a jump to a chain we may delete, from a chain we do not delete) and kubelet's shared
    // `KUBE-FIREWALL`, never a whole table's text.
    let mut lists: BTreeMap<&'static str, ChainList> = BTreeMap::new();
    let mut kept: BTreeMap<(&'static str, String), Vec<String>> = BTreeMap::new();
    let scanned = scan_tables(
        cmd,
        backend,
        family,
        &CANARY_TABLES,
        false,
        &mut |table, seen| match seen {
            Seen::Chain { name, builtin } => {
                let list = lists.entry(table).or_default();
                if builtin {
                    list.builtin.insert(name.to_string());
                } else {
                    list.user.insert(name.to_string());
                }
            }
            Seen::Rules { chain, rules } => {
                let keep: Vec<String> = if table != "mangle" && chain == LOCALNET_CHAIN {
                    rules.to_vec()
                } else if (table == "mangle" && chain == CANARY_CHAIN)
                    || (table != "mangle" && is_owned_chain(chain))
                {
                    Vec::new()
                } else {
                    rules
                        .iter()
                        .filter(|r| {
                            rule_target(r).is_some_and(|t| {
                                is_owned_chain(&t) || t == LOCALNET_CHAIN || t == CANARY_CHAIN
                            })
                        })
                        .cloned()
                        .collect()
                };
                if !keep.is_empty() {
                    kept.insert((table, chain.to_string()), keep);
                }
            }
        },
    );
    let views = match scanned {
        Ok(v) => v,
        Err(Error::Spawn { program, source }) if source.kind() == std::io::ErrorKind::NotFound => {
            tracing::debug!(%program, "not installed; nothing to clean up");
            return Ok(0);
        }
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for view in &views {
        let chains = lists.remove(view.table).unwrap_or_default();
        let rules = |chain: &str| -> Result<Option<Vec<String>>, Error> {
            if !chains.contains(chain) {
                return Ok(None);
            }
            if chains.builtin.contains(chain) {
                return view.builtin_rules(cmd, backend, family, chain);
            }
            if !view.whole {
                return chain_rules(cmd, backend, family, view.table, chain);
            }
            // Read whole: what was kept is every rule that matters here.
            Ok(Some(
                kept.get(&(view.table, chain.to_string()))
                    .cloned()
                    .unwrap_or_default(),
            ))
        };
        let (pre, doomed) = plan_cleanup(view.table, &chains, &rules)?;
        tracing::debug!(
            backend = %backend,
            family = ?family,
            table = view.table,
            chains = doomed.len(),
            rule_deletions = pre.len(),
            "planned the cleanup"
        );
        let inputs = deletion_inputs(view.table, &pre, &doomed, backend, batch);
        if inputs.is_empty() {
            continue;
        }
        for input in &inputs {
            cmd.restore(backend, family, input)?;
        }
        removed += doomed.len();
        tracing::info!(
            backend = %backend,
            family = ?family,
            table = view.table,
            chains = doomed.len(),
            "removed kube-proxy's iptables chains"
        );
    }
    Ok(removed)
}

/// Removes what kube-proxy's iptables mode installed from both backends and both families:
/// our jumps from the built-in chains, then every chain we own. Chains of others (kubelet's
/// `KUBE-KUBELET-CANARY`, `KUBE-IPTABLES-HINT`, `KUBE-MARK-DROP`, anyone's own) stay. Every
/// backend and family is tried; the first error is returned.
pub fn cleanup_all(netns: Option<&str>) -> Result<(), Error> {
    let cmd = match netns {
        Some(ns) => IptablesCommand::in_netns(ns),
        None => IptablesCommand::new(),
    };
    cleanup_with(&cmd, crate::DEFAULT_STEP_CHAINS)
}

/// [`cleanup_all`] through a given command (its namespace and wait), deleting at most `batch`
/// chains per input with the nft backend.
pub fn cleanup_with(cmd: &dyn IptablesRunner, batch: usize) -> Result<(), Error> {
    let mut first = None;
    for backend in Backend::ALL {
        for family in IpFamily::ALL {
            if let Err(e) = cleanup_tables(cmd, backend, family, batch) {
                tracing::error!(error = %e, backend = %backend, family = ?family, "iptables cleanup failed");
                first.get_or_insert(e);
            }
        }
    }
    match first {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readback::{parse_save, SavedTable};

    /// The one restore input that cleans `saved` up, if anything there is ours.
    fn cleanup_input(table: &str, saved: &SavedTable) -> Option<String> {
        let chains = ChainList {
            user: saved
                .chains
                .keys()
                .filter(|c| !saved.builtin.contains(*c))
                .cloned()
                .collect(),
            builtin: saved.builtin.clone(),
        };
        let rules = |c: &str| Ok(saved.chains.get(c).cloned());
        let (pre, doomed) = plan_cleanup(table, &chains, &rules).unwrap();
        deletion_inputs(table, &pre, &doomed, Backend::Nft, usize::MAX).pop()
    }

    const FILTER: &str = r#"*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:MY-CHAIN - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -j MY-CHAIN
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A MY-CHAIN -j KUBE-SERVICES
-A MY-CHAIN -s 10.1.2.3/32 -j ACCEPT
COMMIT
"#;

    #[test]
    fn cleanup_deletes_our_chains_and_every_jump_to_them_and_nothing_else() {
        let saved = parse_save(FILTER, "filter").unwrap();
        let input = cleanup_input("filter", &saved).unwrap();
        let lines: Vec<&str> = input.lines().collect();
        let deleted: Vec<&str> = lines.iter().filter_map(|l| l.strip_prefix("-X ")).collect();
        assert_eq!(
            deleted,
            [
                "KUBE-EXTERNAL-SERVICES",
                "KUBE-FIREWALL",
                "KUBE-FORWARD",
                "KUBE-PROXY-CANARY",
                "KUBE-SERVICES"
            ]
        );
        // Jumps out of the built-in chains and out of a foreign chain go first; the foreign
        // chain's own rules and its jump from INPUT stay.
        let jumps: Vec<&&str> = lines.iter().filter(|l| l.starts_with("-D ")).collect();
        assert_eq!(jumps.len(), 5, "{input}");
        assert!(input.contains("-D MY-CHAIN -j KUBE-SERVICES\n"));
        assert!(input.contains("-D INPUT -j KUBE-FIREWALL\n"));
        assert!(!input.contains("MY-CHAIN -s"));
        assert!(!input.contains("-D INPUT -j MY-CHAIN"));
        assert!(!input.contains("KUBELET"));
        // Deletions come after the flushes, and after every -D.
        let first_x = input.find("-X ").unwrap();
        assert!(input.rfind("-D ").unwrap() < first_x);
        assert!(input.rfind(":KUBE-").unwrap() < first_x);
        assert!(input.ends_with("COMMIT\n"));
    }

    #[test]
    fn a_kube_firewall_shared_with_kubelet_only_loses_our_rule() {
        let shared = FILTER.replace(
            "-A KUBE-FORWARD -m conntrack",
            "-A KUBE-FIREWALL -m comment --comment \"kubernetes firewall for dropping marked packets\" -m mark --mark 0x8000/0x8000 -j DROP\n-A KUBE-FORWARD -m conntrack",
        );
        let saved = parse_save(&shared, "filter").unwrap();
        let input = cleanup_input("filter", &saved).unwrap();
        assert!(!input.contains("-X KUBE-FIREWALL"), "{input}");
        assert!(!input.contains("-D INPUT -j KUBE-FIREWALL"), "{input}");
        assert!(
            input.contains("-D KUBE-FIREWALL ! -s 127.0.0.0/8"),
            "{input}"
        );
        assert!(!input.contains("marked packets"), "{input}");
    }

    #[test]
    fn nothing_ours_means_no_restore() {
        let saved = parse_save(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-MARK-DROP - [0:0]\nCOMMIT\n",
            "nat",
        )
        .unwrap();
        assert_eq!(cleanup_input("nat", &saved), None);
        // In mangle only the canary is ours, whatever else is called KUBE-.
        let saved = parse_save(
            "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n",
            "mangle",
        )
        .unwrap();
        assert_eq!(
            cleanup_input("mangle", &saved).unwrap(),
            "*mangle\n:KUBE-PROXY-CANARY - [0:0]\n-X KUBE-PROXY-CANARY\nCOMMIT\n"
        );
    }
}
