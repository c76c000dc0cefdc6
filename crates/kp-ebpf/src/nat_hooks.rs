//! Keeps conntrack and netfilter's NAT hooks on while the ebpf mode runs: one nftables table of
//! the mode's own, `inet kube-proxy-ebpf`, with a `nat` base chain on each of the four hooks NAT
//! uses (policy accept: it translates nothing) and one rule that matches on conntrack state
//! (which is what turns conntrack on in a namespace).
//!
//! The mode itself translates in its programs, not in netfilter, but the connections a mode
//! switch finds were translated by conntrack: the old mode's DNAT to a backend, its
//! masquerade, a userspace proxy's REDIRECT. The kernel looks a packet's connection up, and
//! applies its translation, only while some rule or chain in the namespace needs conntrack and
//! NAT. Once the old mode's leftovers are removed, without this table the node has none:
//! every connection made before the switch is no longer translated and stalls, and its
//! conntrack entry stays with the old translation until it times out, ready to send a new
//! connection that reuses its addresses and ports to the old proxy's gone port (refused).
//! With the table, those connections end as they began; and conntrack stays on, so a socket
//! the hooks sent straight to a backend and an older connection translated to the same backend
//! from the same client port are told apart (the kernel gives the newer one another source
//! port) instead of clashing.

use kp_nftables::NftCommand;

/// The table's name (family `inet`).
pub const TABLE: &str = "kube-proxy-ebpf";

/// The chains: (name, hook, priority). The priorities are NAT's usual ones (`dstnat`,
/// `srcnat`), as numbers: nft 1.0.6 accepts those keywords on prerouting and postrouting only.
const CHAINS: [(&str, &str, i32); 4] = [
    ("nat-prerouting", "prerouting", -100),
    ("nat-output", "output", -100),
    ("nat-input", "input", 100),
    ("nat-postrouting", "postrouting", 100),
];

/// The chain that holds the conntrack rule (a `nat` chain sees only a connection's first
/// packet, so the rule costs one match per new connection).
const CONNTRACK_CHAIN: &str = "nat-prerouting";

/// Where the table is kept: the current network namespace, or a named one (tests and
/// benchmarks program namespaces they created).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatHooks {
    netns: Option<String>,
}

impl NatHooks {
    /// In `netns`, or the current namespace.
    pub fn new(netns: Option<&str>) -> Self {
        NatHooks {
            netns: netns.map(str::to_string),
        }
    }

    fn nft(&self) -> NftCommand {
        self.netns
            .as_deref()
            .map_or_else(NftCommand::new, NftCommand::in_netns)
    }

    /// Makes the table as [`install_script`] has it unless [`NatHooks::check`] finds it so
    /// already; returns whether it wrote it. The write replaces the table in one transaction,
    /// so the hooks and conntrack stay on across it.
    pub fn ensure(&self) -> Result<bool, kp_nftables::Error> {
        if self.check()?.is_empty() {
            return Ok(false);
        }
        self.nft().run(&install_script())?;
        Ok(true)
    }

    /// Removes the table, present or not.
    pub fn remove(&self) -> Result<(), kp_nftables::Error> {
        self.nft().run(&format!(
            "add table inet {TABLE}\ndelete table inet {TABLE}\n"
        ))
    }

    /// What differs from the table as [`install_script`] makes it: nothing when it is there
    /// with its four chains on their hooks and only its conntrack rule.
    pub fn check(&self) -> Result<Vec<String>, kp_nftables::Error> {
        match self.nft().json(&["list", "table", "inet", TABLE]) {
            Ok(listing) => differences(&listing),
            Err(kp_nftables::Error::List { stderr, .. })
                if stderr.contains("No such file or directory") =>
            {
                Ok(vec![format!("table inet {TABLE} is missing")])
            }
            Err(e) => Err(e),
        }
    }
}

/// The table as nft input: whatever is there by its name goes in the same transaction.
pub fn install_script() -> String {
    let mut s =
        format!("add table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    for (name, hook, priority) in CHAINS {
        s.push_str(&format!(
            "\tchain {name} {{\n\t\ttype nat hook {hook} priority {priority}; policy accept;\n"
        ));
        if name == CONNTRACK_CHAIN {
            s.push_str("\t\tct state new comment \"keeps conntrack on\"\n");
        }
        s.push_str("\t}\n");
    }
    s.push_str("}\n");
    s
}

/// Compares `nft -j list table inet kube-proxy-ebpf` with [`install_script`]'s table.
fn differences(listing: &str) -> Result<Vec<String>, kp_nftables::Error> {
    let parsed: serde_json::Value = serde_json::from_str(listing)
        .map_err(|e| kp_nftables::Error::Parse(format!("nft -j list table: {e}")))?;
    let objects = parsed
        .get("nftables")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| kp_nftables::Error::Parse("nft -j: no nftables array".into()))?;
    let mut chains = Vec::new();
    let mut rules = Vec::new();
    for o in objects {
        if let Some(chain) = o.get("chain") {
            let field = |k: &str| chain.get(k).and_then(serde_json::Value::as_str);
            chains.push((
                field("name").unwrap_or_default().to_string(),
                field("type").unwrap_or_default().to_string(),
                field("hook").unwrap_or_default().to_string(),
                field("policy").unwrap_or_default().to_string(),
            ));
        } else if let Some(rule) = o.get("rule") {
            let chain = rule
                .get("chain")
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default();
            let conntrack = rule.get("expr").is_some_and(|e| {
                e.as_array().is_some_and(|e| e.len() == 1)
                    && e[0]["match"]["left"]["ct"]["key"] == "state"
                    && e[0]["match"]["right"] == "new"
            });
            rules.push((chain.to_string(), conntrack));
        }
    }
    let mut out = Vec::new();
    for (name, hook, _) in CHAINS {
        let want = (
            name.to_string(),
            "nat".to_string(),
            hook.to_string(),
            "accept".to_string(),
        );
        if !chains.contains(&want) {
            out.push(format!(
                "table inet {TABLE}: chain {name} (nat, hook {hook}, policy accept) is missing"
            ));
        }
    }
    for (name, ..) in &chains {
        if !CHAINS.iter().any(|(n, ..)| n == name) {
            out.push(format!(
                "table inet {TABLE}: chain {name} is not the mode's"
            ));
        }
    }
    let conntrack = rules
        .iter()
        .filter(|(c, ct)| c == CONNTRACK_CHAIN && *ct)
        .count();
    if conntrack != 1 {
        out.push(format!(
            "table inet {TABLE}: chain {CONNTRACK_CHAIN} has {conntrack} conntrack rules, not 1"
        ));
    }
    for (chain, ct) in &rules {
        if !(chain == CONNTRACK_CHAIN && *ct) {
            out.push(format!(
                "table inet {TABLE}: chain {chain} has a rule not the mode's"
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CT_RULE: &str =
        r#"[{"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "new"}}]"#;

    fn listing(chains: &[(&str, &str, &str)], rules: &[(&str, &str)]) -> String {
        let mut objects = vec![format!(
            r#"{{"table": {{"family": "inet", "name": "{TABLE}", "handle": 1}}}}"#
        )];
        for (name, hook, policy) in chains {
            objects.push(format!(
                r#"{{"chain": {{"family": "inet", "table": "{TABLE}", "name": "{name}", "handle": 2, "type": "nat", "hook": "{hook}", "prio": 0, "policy": "{policy}"}}}}"#
            ));
        }
        for (chain, expr) in rules {
            objects.push(format!(
                r#"{{"rule": {{"family": "inet", "table": "{TABLE}", "chain": "{chain}", "handle": 9, "expr": {expr}}}}}"#
            ));
        }
        format!(r#"{{"nftables": [{}]}}"#, objects.join(", "))
    }

    fn all_chains() -> Vec<(&'static str, &'static str, &'static str)> {
        CHAINS.iter().map(|(n, h, _)| (*n, *h, "accept")).collect()
    }

    #[test]
    fn the_script_replaces_the_table_with_a_nat_chain_on_each_hook_and_a_conntrack_rule() {
        let s = install_script();
        assert!(
            s.starts_with("add table inet kube-proxy-ebpf\ndelete table inet kube-proxy-ebpf\n"),
            "{s}"
        );
        for hook in ["prerouting", "output", "input", "postrouting"] {
            assert!(s.contains(&format!("type nat hook {hook} priority")), "{s}");
        }
        assert_eq!(s.matches("ct state new").count(), 1, "{s}");
    }

    #[test]
    fn the_check_passes_the_installed_table_and_names_what_differs() {
        let all = all_chains();
        let ct = [(CONNTRACK_CHAIN, CT_RULE)];
        assert_eq!(
            differences(&listing(&all, &ct)).unwrap(),
            Vec::<String>::new()
        );

        let d = differences(&listing(&all[1..], &ct)).unwrap();
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].contains("nat-prerouting"), "{d:?}");

        let mut dropping = all.clone();
        dropping[3].2 = "drop";
        let d = differences(&listing(&dropping, &ct)).unwrap();
        assert!(d[0].contains("nat-postrouting"), "{d:?}");

        let d = differences(&listing(&all, &[])).unwrap();
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].contains("0 conntrack rules"), "{d:?}");

        let d = differences(&listing(&all, &[ct[0], ct[0]])).unwrap();
        assert!(d[0].contains("2 conntrack rules"), "{d:?}");

        let d = differences(&listing(&all, &[ct[0], ("nat-output", CT_RULE)])).unwrap();
        assert_eq!(
            d,
            vec![format!(
                "table inet {TABLE}: chain nat-output has a rule not the mode's"
            )]
        );

        let accept = r#"[{"accept": null}]"#;
        let d = differences(&listing(&all, &[ct[0], (CONNTRACK_CHAIN, accept)])).unwrap();
        assert_eq!(d.len(), 1, "{d:?}");

        let mut extra = all.clone();
        extra.push(("other", "forward", "accept"));
        let d = differences(&listing(&extra, &ct)).unwrap();
        assert_eq!(
            d,
            vec![format!("table inet {TABLE}: chain other is not the mode's")]
        );

        assert!(differences("not json").is_err());
    }
}
