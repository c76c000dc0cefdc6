//! What each mode uses in the kernel by name, so that removing one mode's leftovers while
//! another runs never takes what the running one uses.
//!
//! Most modes' names are their own (the nftables mode's `kube-proxy` tables, the userspace
//! mode's `kube-proxy-userspace` table, `kube-ipvs0`, the ebpf mode's pins), but the iptables
//! and ipvs modes fill the same chains (`KUBE-SERVICES`, `KUBE-POSTROUTING`, `KUBE-MARK-MASQ`
//! in nat, `KUBE-FORWARD` and `KUBE-PROXY-FIREWALL` in filter) and make some of the same jumps
//! from the built-in chains, as upstream's two proxiers do. A switch between them removes the
//! old mode's leftovers after the new mode's first sync: the shared chains then hold the new
//! mode's rules and must stay, and so must the jumps to them that the new mode makes too.
//!
//! The iptables mode's removal (`kp_iptables::cleanup_with`) decides by name alone and knows no
//! other mode, so it runs here through [`KeepingRunner`], which takes out of its restore inputs
//! the flush and deletion of a kept chain and the deletion of a kept jump, and deletes instead
//! the kept chain's rules that still jump to a chain being deleted.

use std::collections::BTreeSet;
use std::io::{self, Write};

use kp_core::model::IpFamily;
use kp_iptables::{Backend, CommandOutput, IptablesCommand, IptablesRunner};

/// Names a mode uses that another mode's leftover removal could also find.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Footprint {
    /// iptables chains it fills, as (table, chain), on its backend, both families.
    pub chains: BTreeSet<(String, String)>,
    /// Its rules in built-in chains, as (table, chain, words of the rule).
    pub jumps: BTreeSet<(String, String, Vec<String>)>,
    /// nftables tables it owns, as (family, name).
    pub nft_tables: BTreeSet<(String, String)>,
}

impl Footprint {
    /// Whether the chain is one the mode fills.
    pub fn has_chain(&self, table: &str, chain: &str) -> bool {
        self.chains.iter().any(|(t, c)| t == table && c == chain)
    }

    /// Whether the rule is one of the mode's jumps.
    pub fn has_jump(&self, table: &str, chain: &str, words: &[String]) -> bool {
        self.jumps
            .iter()
            .any(|(t, c, w)| t == table && c == chain && w == words)
    }

    /// The same names, as the ipvs mode's removal takes them (`draining`: a switch, where
    /// virtual servers that carry connections stay until they have none).
    pub fn ipvs_keep(&self, draining: bool) -> kp_ipvs::cleanup::Keep {
        kp_ipvs::cleanup::Keep {
            chains: self.chains.clone(),
            jumps: self.jumps.clone(),
            draining,
        }
    }
}

fn tables(list: &[(&str, &str)]) -> BTreeSet<(String, String)> {
    list.iter()
        .map(|(f, n)| (f.to_string(), n.to_string()))
        .collect()
}

/// The nftables mode: its `kube-proxy` tables.
pub fn nftables() -> Footprint {
    Footprint {
        nft_tables: tables(&[("ip", "kube-proxy"), ("ip6", "kube-proxy")]),
        ..Footprint::default()
    }
}

/// The iptables mode: its fixed chains in nat and filter, its canary in every table, and its
/// jumps from the built-in chains. (Its per-Service chains have prefixes no other mode uses.)
pub fn iptables() -> Footprint {
    let mut chains = BTreeSet::new();
    for table in ["nat", "filter"] {
        for c in kp_iptables::FIXED_CHAINS {
            chains.insert((table.to_string(), c.to_string()));
        }
    }
    for table in kp_iptables::CANARY_TABLES {
        chains.insert((table.to_string(), kp_iptables::CANARY_CHAIN.to_string()));
    }
    Footprint {
        chains,
        jumps: kp_ipvs::cleanup::iptables_mode_jumps(),
        ..Footprint::default()
    }
}

/// The userspace mode: its `kube-proxy-userspace` table.
pub fn userspace() -> Footprint {
    Footprint {
        nft_tables: tables(&[("inet", "kube-proxy-userspace")]),
        ..Footprint::default()
    }
}

/// The ipvs mode: its chains (its own and those it shares with the iptables mode) and its
/// jumps. (`kube-ipvs0`, the virtual servers and the sets are no other mode's.)
pub fn ipvs() -> Footprint {
    Footprint {
        chains: kp_ipvs::cleanup::ipvs_mode_chains(),
        jumps: kp_ipvs::cleanup::ipvs_mode_jumps(),
        ..Footprint::default()
    }
}

/// The ebpf mode: its `kube-proxy-ebpf` table, which only keeps the NAT hooks registered (its
/// programs and maps are pinned under its own directory).
pub fn ebpf() -> Footprint {
    Footprint {
        nft_tables: tables(&[("inet", kp_ebpf::nat_hooks::TABLE)]),
        ..Footprint::default()
    }
}

/// The built-in chains of the tables a removal touches.
const BUILTIN_CHAINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// The chain a rule's words jump or go to.
fn target(words: &[String]) -> Option<&str> {
    words
        .windows(2)
        .find(|w| matches!(w[0].as_str(), "-j" | "--jump" | "-g" | "--goto"))
        .map(|w| w[1].as_str())
}

/// One restore input of the iptables mode's removal with what `keep` names left out: no
/// flush (`:CHAIN`) or deletion (`-X CHAIN`) of a kept chain, and no deletion (`-D`) of a rule
/// that jumps to a kept chain unless it is in a built-in chain and not one of the running
/// mode's jumps. The rules a kept chain still holds that jump to a chain this input
/// deletes or flushes (`rules_of(table, chain)` lists them, in `-S` form without `-A CHAIN`)
/// are deleted first instead, so the deletion is not refused.
pub fn filter_removal(
    input: &str,
    keep: &Footprint,
    rules_of: &mut dyn FnMut(&str, &str) -> Vec<String>,
) -> String {
    let mut out = String::new();
    let mut table = String::new();
    // The current table's lines, and the deletions to put first.
    let mut first: Vec<String> = Vec::new();
    let mut body: Vec<String> = Vec::new();
    let mut kept_flushed: Vec<String> = Vec::new();
    let mut doomed: BTreeSet<String> = BTreeSet::new();
    for line in input.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim().to_string();
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if line.trim() == "COMMIT" {
            for chain in kept_flushed.drain(..) {
                for rule in rules_of(&table, &chain) {
                    let words = kp_iptables::split_args(&rule);
                    if target(&words).is_some_and(|t| doomed.contains(t)) {
                        first.push(format!("-D {chain} {rule}"));
                    }
                }
            }
            for l in first.drain(..).chain(body.drain(..)) {
                out.push_str(&l);
                out.push('\n');
            }
            out.push_str(line);
            out.push('\n');
            doomed.clear();
            continue;
        }
        if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().unwrap_or_default();
            if keep.has_chain(&table, chain) {
                kept_flushed.push(chain.to_string());
                continue;
            }
            doomed.insert(chain.to_string());
        } else if let Some(chain) = line.strip_prefix("-X ") {
            let chain = chain.trim();
            if keep.has_chain(&table, chain) {
                continue;
            }
            doomed.insert(chain.to_string());
        } else if let Some(rest) = line.strip_prefix("-D ") {
            if let Some((chain, args)) = rest.split_once(' ') {
                let words = kp_iptables::split_args(args);
                // A rule that jumps to a kept chain need not go for that chain's sake; it goes
                // only if it is this mode's own jump from a built-in chain. The running mode's
                // rules in its own chains, and anyone's in theirs, stay.
                let to_kept = target(&words).is_some_and(|t| keep.has_chain(&table, t));
                let builtin = BUILTIN_CHAINS.contains(&chain);
                if to_kept && (!builtin || keep.has_jump(&table, chain, &words)) {
                    continue;
                }
            }
        }
        body.push(line.to_string());
    }
    out
}

/// The iptables tools, with the removal's restore inputs filtered by [`filter_removal`].
pub struct KeepingRunner<'a> {
    /// The tools.
    pub inner: &'a IptablesCommand,
    /// What the running mode uses.
    pub keep: &'a Footprint,
}

impl IptablesRunner for KeepingRunner<'_> {
    fn restore_with(
        &self,
        backend: Backend,
        family: IpFamily,
        write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
    ) -> Result<(), kp_iptables::Error> {
        let mut buf: Vec<u8> = Vec::new();
        write(&mut buf).map_err(|e| kp_iptables::Error::Spawn {
            program: "iptables-restore (input)".into(),
            source: e,
        })?;
        let input = String::from_utf8_lossy(&buf);
        let mut rules_of = |table: &str, chain: &str| -> Vec<String> {
            let prefix = format!("-A {chain} ");
            match self.inner.run(backend, family, &["-t", table, "-S", chain]) {
                Ok(o) if o.success() => o
                    .stdout
                    .lines()
                    .filter_map(|l| l.strip_prefix(&prefix))
                    .map(str::to_string)
                    .collect(),
                _ => Vec::new(),
            }
        };
        let filtered = filter_removal(&input, self.keep, &mut rules_of);
        self.inner.restore(backend, family, &filtered)
    }

    fn run(
        &self,
        backend: Backend,
        family: IpFamily,
        args: &[&str],
    ) -> Result<CommandOutput, kp_iptables::Error> {
        self.inner.run(backend, family, args)
    }

    fn save_lines(
        &self,
        backend: Backend,
        family: IpFamily,
        table: Option<&str>,
        each: &mut dyn FnMut(&str) -> Result<(), kp_iptables::Error>,
    ) -> Result<(), kp_iptables::Error> {
        self.inner.save_lines(backend, family, table, each)
    }

    fn nft_chain_lines(
        &self,
        family: IpFamily,
        each: &mut dyn FnMut(&str) -> Result<(), kp_iptables::Error>,
    ) -> Result<(), kp_iptables::Error> {
        self.inner.nft_chain_lines(family, each)
    }

    fn sysctl(&self, key: &str, value: &str) -> Result<(), kp_iptables::Error> {
        self.inner.sysctl(key, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the iptables mode's removal sends for a nat table it owns (as
    /// `kp_iptables::cleanup_with` writes it: jump deletions, flushes, deletions).
    const REMOVAL: &str = "*nat
-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-D OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-D KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-SVC-AAAA - [0:0]
:KUBE-PROXY-CANARY - [0:0]
-X KUBE-SERVICES
-X KUBE-POSTROUTING
-X KUBE-MARK-MASQ
-X KUBE-NODEPORTS
-X KUBE-SVC-AAAA
-X KUBE-PROXY-CANARY
COMMIT
*filter
-D INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
-X KUBE-PROXY-FIREWALL
-X KUBE-EXTERNAL-SERVICES
COMMIT
";

    #[test]
    fn with_the_ipvs_mode_running_its_chains_and_jumps_stay_and_the_rest_goes() {
        let keep = ipvs();
        // The running mode has not rewritten KUBE-SERVICES for some family yet: its rule to a
        // per-Service chain is deleted on its own instead of by a flush.
        let mut asked = Vec::new();
        let mut rules_of = |t: &str, c: &str| {
            asked.push(format!("{t} {c}"));
            if t == "nat" && c == "KUBE-SERVICES" {
                vec![
                    "-d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-AAAA".to_string(),
                    "-m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT".to_string(),
                ]
            } else {
                Vec::new()
            }
        };
        let out = filter_removal(REMOVAL, &keep, &mut rules_of);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines,
            [
                "*nat",
                "-D KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-AAAA",
                ":KUBE-NODEPORTS - [0:0]",
                ":KUBE-SVC-AAAA - [0:0]",
                ":KUBE-PROXY-CANARY - [0:0]",
                "-X KUBE-NODEPORTS",
                "-X KUBE-SVC-AAAA",
                "-X KUBE-PROXY-CANARY",
                "COMMIT",
                "*filter",
                // The iptables mode's own jump to the shared firewall chain goes; the ipvs
                // mode's own jumps there are other rules.
                "-D INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL",
                ":KUBE-EXTERNAL-SERVICES - [0:0]",
                "-X KUBE-EXTERNAL-SERVICES",
                "COMMIT",
            ]
        );
        assert!(
            asked.contains(&"nat KUBE-SERVICES".to_string()),
            "{asked:?}"
        );
    }

    #[test]
    fn with_nothing_shared_running_the_removal_is_unchanged() {
        for keep in [nftables(), userspace(), ebpf(), Footprint::default()] {
            let mut rules_of =
                |_: &str, _: &str| -> Vec<String> { panic!("nothing kept, nothing to read") };
            assert_eq!(filter_removal(REMOVAL, &keep, &mut rules_of), REMOVAL);
        }
    }

    /// Every (running, removed) pair: what the removed mode's removal deletes by name is either
    /// not the running mode's, or is left by the keep rules (the chains the two share).
    #[test]
    fn no_two_modes_own_the_same_nft_table_and_only_iptables_and_ipvs_share_chains() {
        let all = [
            ("nftables", nftables()),
            ("iptables", iptables()),
            ("userspace", userspace()),
            ("ipvs", ipvs()),
            ("ebpf", ebpf()),
        ];
        for (a, fa) in &all {
            for (b, fb) in &all {
                if a == b {
                    continue;
                }
                assert!(
                    fa.nft_tables.is_disjoint(&fb.nft_tables),
                    "{a} and {b} share an nft table"
                );
                let shared: BTreeSet<_> = fa.chains.intersection(&fb.chains).collect();
                let pair = [*a, *b];
                if pair.contains(&"iptables") && pair.contains(&"ipvs") {
                    let expected = kp_ipvs::cleanup::chains_shared_with_iptables_mode();
                    assert_eq!(shared, expected.iter().collect(), "{a}/{b}");
                } else {
                    assert!(shared.is_empty(), "{a}/{b}: {shared:?}");
                }
            }
        }
    }
}
