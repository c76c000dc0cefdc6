//! Removing everything kube-proxy's iptables mode installs, on either backend, leaving every
//! other chain alone (upstream `CleanupLeftovers` in `pkg/proxy/iptables/proxier.go`).
//!
//! Which chains are ours is decided by name only, from what `iptables-save` shows, so this
//! works without a planner: the nftables mode calls it at start to remove an iptables-mode
//! leftover, and `--cleanup` calls it before exiting.

use kp_core::model::IpFamily;

use crate::readback::{parse_save, split_args, SavedTable};
use crate::runner::{Backend, IptablesCommand};
use crate::Error;

/// The canary chain kube-proxy keeps in mangle, nat and filter: if it vanishes, someone flushed
/// the tables.
pub const CANARY_CHAIN: &str = "KUBE-PROXY-CANARY";

/// The tables a canary lives in.
pub const CANARY_TABLES: [&str; 3] = ["mangle", "nat", "filter"];

/// Fixed chains kube-proxy owns in nat and filter.
pub const FIXED_CHAINS: [&str; 8] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    CANARY_CHAIN,
];

/// Prefixes of the per-Service and per-endpoint chains.
pub const SERVICE_CHAIN_PREFIXES: [&str; 5] =
    ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-"];

/// The chain kubelet created before 1.27 and kube-proxy now fills with one rule when localhost
/// NodePorts are on; it is ours to delete only if that rule is all it holds.
pub const LOCALNET_CHAIN: &str = "KUBE-FIREWALL";

/// The comment of that rule.
pub const LOCALNET_COMMENT: &str = "block incoming localnet connections";

/// Whether `chain` is a per-Service or per-endpoint chain.
pub fn is_service_chain(chain: &str) -> bool {
    SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
}

/// Whether `chain` in a nat or filter table belongs to kube-proxy by its name alone.
pub fn is_owned_chain(chain: &str) -> bool {
    FIXED_CHAINS.contains(&chain) || is_service_chain(chain)
}

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

/// The restore input that removes what we own from one table as saved, or `None` if nothing
/// there is ours: first every rule elsewhere that jumps to a chain being deleted (our jumps
/// from the built-in chains, and anything else that would stop the deletion), then each chain
/// flushed and deleted.
pub(crate) fn cleanup_input(table: &str, saved: &SavedTable) -> Option<String> {
    let mut doomed: Vec<&str> = Vec::new();
    let mut unshare: Vec<String> = Vec::new();
    for (chain, rules) in &saved.chains {
        if saved.builtin.contains(chain) {
            continue;
        }
        let ours = match table {
            "mangle" => chain == CANARY_CHAIN,
            "nat" | "filter" if chain == LOCALNET_CHAIN => {
                let mine = rules.iter().filter(|r| is_localnet_rule(r)).count();
                if mine > 0 && mine < rules.len() {
                    // Shared with kubelet: take only our rule out.
                    unshare.extend(
                        rules
                            .iter()
                            .filter(|r| is_localnet_rule(r))
                            .map(|r| format!("-D {chain} {r}")),
                    );
                }
                mine > 0 && mine == rules.len()
            }
            "nat" | "filter" => is_owned_chain(chain),
            _ => false,
        };
        if ours {
            doomed.push(chain);
        }
    }
    if doomed.is_empty() && unshare.is_empty() {
        return None;
    }
    let mut out = format!("*{table}\n");
    for (chain, rules) in &saved.chains {
        if doomed.contains(&chain.as_str()) {
            continue;
        }
        for r in rules {
            if rule_target(r).is_some_and(|t| doomed.contains(&t.as_str())) {
                out.push_str(&format!("-D {chain} {r}\n"));
            }
        }
    }
    for line in unshare {
        out.push_str(&line);
        out.push('\n');
    }
    for c in &doomed {
        out.push_str(&format!(":{c} - [0:0]\n"));
    }
    for c in &doomed {
        out.push_str(&format!("-X {c}\n"));
    }
    out.push_str("COMMIT\n");
    Some(out)
}

/// Removes what kube-proxy owns from one backend's tables of one family. A missing table, a
/// missing tool, or a kernel without the legacy interface is nothing to clean, not an error.
pub fn cleanup_tables(cmd: &IptablesCommand, backend: Backend, family: IpFamily) -> Result<usize, Error> {
    let legacy_tables = (backend == Backend::Legacy).then(|| cmd.legacy_tables(family));
    let mut removed = 0;
    for table in CANARY_TABLES {
        if let Some(existing) = &legacy_tables {
            // Reading a legacy table that does not exist would create it.
            if !existing.iter().any(|t| t == table) {
                continue;
            }
        }
        let text = match cmd.save(backend, family, Some(table)) {
            Ok(t) => t,
            Err(Error::Spawn { program, source }) if source.kind() == std::io::ErrorKind::NotFound => {
                tracing::debug!(%program, "not installed; nothing to clean up");
                return Ok(removed);
            }
            Err(e) => return Err(e),
        };
        let saved = parse_save(&text, table)?;
        if let Some(input) = cleanup_input(table, &saved) {
            removed += input.lines().filter(|l| l.starts_with("-X ")).count();
            cmd.restore(backend, family, &input)?;
            tracing::info!(
                backend = %backend,
                family = ?family,
                table,
                "removed kube-proxy's iptables chains"
            );
        }
    }
    Ok(removed)
}

/// Removes what kube-proxy's iptables mode installed from both backends and both families:
/// our jumps from the built-in chains, then every chain we own, in one restore per table.
/// Chains of others (kubelet's `KUBE-KUBELET-CANARY`, `KUBE-IPTABLES-HINT`, `KUBE-MARK-DROP`,
/// anyone's own) stay. Every backend and family is tried; the first error is returned.
pub fn cleanup_all(netns: Option<&str>) -> Result<(), Error> {
    let cmd = match netns {
        Some(ns) => IptablesCommand::in_netns(ns),
        None => IptablesCommand::new(),
    };
    cleanup_with(&cmd)
}

/// [`cleanup_all`] through a given command (its namespace and wait).
pub fn cleanup_with(cmd: &IptablesCommand) -> Result<(), Error> {
    let mut first = None;
    for backend in Backend::ALL {
        for family in IpFamily::ALL {
            if let Err(e) = cleanup_tables(cmd, backend, family) {
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
        let deleted: Vec<&str> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("-X "))
            .collect();
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
        assert!(input.contains("-D KUBE-FIREWALL ! -s 127.0.0.0/8"), "{input}");
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

    #[test]
    fn ownership_is_by_name() {
        for c in ["KUBE-SVC-ABC", "KUBE-SEP-X", "KUBE-FW-1", "KUBE-SVL-2", "KUBE-EXT-3", "KUBE-MARK-MASQ"] {
            assert!(is_owned_chain(c), "{c}");
        }
        for c in ["KUBE-MARK-DROP", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-FIREWALL", "KUBE-SVCX", "MY-CHAIN"] {
            assert!(!is_owned_chain(c), "{c}");
        }
    }
}
