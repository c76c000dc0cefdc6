//! Adopting what the kernel already holds. A full sync (the first after a start, or one after
//! a failure or drift) plans every chain, but sends only the chains the kernel lacks or holds
//! differently, and deletes our chains the plan no longer has: a restart over a correct table
//! sends nothing, and the kernel keeps every rule it had (with the `recent` tables of ClientIP
//! affinity, which live as long as a rule names them).
//!
//! The kernel's chains are read with `iptables-save`, hashed chain by chain as they stream past
//! (the planner keeps a digest of each chain, not its text: the same hash over the rules as
//! `iptables-save` prints them), so no table's text is held. Whatever makes the read
//! untrustworthy (it fails; a chain is declared twice or its rules come in two places; with
//! nft, the chain listing and the save disagree) leaves the digests unused: the sync sends the
//! whole plan, as before adoption, and says why.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kp_core::model::IpFamily;
use kp_iptables_plan::{digest, Table};

use crate::names::{is_owned_chain, LOCALNET_CHAIN};
use crate::runner::{Backend, IptablesRunner};
use crate::view::{scan_tables, Seen, TableScan};
use crate::Error;

/// The tables a full sync reads.
const TABLES: [&str; 2] = ["nat", "filter"];

/// Whether a chain may be one the planner plans (or one of ours it no longer plans): the
/// names [`is_owned_chain`] knows, and kubelet's `KUBE-FIREWALL`, which the planner fills with
/// localhost NodePorts.
fn wanted(chain: &str) -> bool {
    is_owned_chain(chain) || chain == LOCALNET_CHAIN
}

/// One chain named like ours, as the kernel holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    /// The digest of its rules as `iptables-save` printed them (of no rules until they are
    /// seen: a chain without rules has no rules line).
    digest: u64,
    /// Whether its rules were seen.
    rules_seen: bool,
}

/// The chains of nat and filter named like ours, with the digest of their rules when the
/// tables were read whole, built from the reports of a streaming read ([`KernelChains::see`]).
#[derive(Debug, Default)]
pub(crate) struct KernelChains {
    nat: HashMap<String, Held>,
    filter: HashMap<String, Held>,
    /// Chains of nat and filter that are not built in, ours or not (iptables-nft-save's cost
    /// grows with them).
    pub user_chains: usize,
    /// The first thing that made the read look inconsistent.
    pub problem: Option<String>,
}

impl KernelChains {
    fn map(&self, t: Table) -> &HashMap<String, Held> {
        match t {
            Table::Nat => &self.nat,
            Table::Filter => &self.filter,
        }
    }

    fn inconsistent(&mut self, what: String) {
        self.problem.get_or_insert(what);
    }

    /// Takes one report of a streaming read ([`scan_tables`]); tables other than nat and
    /// filter are ignored.
    pub fn see(&mut self, table: &str, seen: Seen<'_>) {
        let t = match table {
            "nat" => Table::Nat,
            "filter" => Table::Filter,
            _ => return,
        };
        let map = match t {
            Table::Nat => &mut self.nat,
            Table::Filter => &mut self.filter,
        };
        match seen {
            Seen::Chain { builtin: true, .. } => {}
            Seen::Chain { name, .. } => {
                self.user_chains += 1;
                if !wanted(name) {
                    return;
                }
                let fresh = Held {
                    digest: digest::<&str>(&[]),
                    rules_seen: false,
                };
                if map.insert(name.to_string(), fresh).is_some() {
                    self.inconsistent(format!("{table} chain {name} is declared twice"));
                }
            }
            Seen::Rules { chain, rules } => {
                if !wanted(chain) {
                    return;
                }
                let problem = match map.get_mut(chain) {
                    None => format!("{table} chain {chain} has rules but was not declared"),
                    Some(h) if h.rules_seen => {
                        format!("the rules of {table} chain {chain} come in two places")
                    }
                    Some(h) => {
                        h.digest = digest(rules);
                        h.rules_seen = true;
                        return;
                    }
                };
                self.inconsistent(problem);
            }
        }
    }

    /// The digest of `chain`'s rules, if the kernel has the chain (and it is named like ours).
    /// Meaningful only when the tables were read whole.
    pub fn get(&self, t: Table, chain: &str) -> Option<u64> {
        self.map(t).get(chain).map(|h| h.digest)
    }

    /// Whether the kernel has `chain` (named like ours).
    pub fn contains(&self, t: Table, chain: &str) -> bool {
        self.map(t).contains_key(chain)
    }

    /// Every chain named like ours, by table and name.
    pub fn names(&self) -> impl Iterator<Item = (Table, &str)> {
        self.nat
            .keys()
            .map(|c| (Table::Nat, c.as_str()))
            .chain(self.filter.keys().map(|c| (Table::Filter, c.as_str())))
    }

    /// Whether both name the same chains.
    fn same_chains(&self, other: &KernelChains) -> bool {
        let same = |a: &HashMap<String, Held>, b: &HashMap<String, Held>| {
            a.len() == b.len() && a.keys().all(|k| b.contains_key(k))
        };
        same(&self.nat, &other.nat) && same(&self.filter, &other.filter)
    }
}

/// What a full sync found in one family's nat and filter tables.
#[derive(Debug)]
pub(crate) struct KernelRead {
    /// The canaries and the built-in chains, from the last read.
    pub scans: Vec<TableScan>,
    /// The chains named like ours; with digests unless `fallback` says otherwise.
    pub chains: KernelChains,
    /// Why the kernel's rules cannot be compared with the plan, if they cannot: the sync then
    /// sends the whole plan (and still deletes our chains it does not plan, by name).
    pub fallback: Option<String>,
    /// How long the read took.
    pub took: Duration,
}

/// Reads one family's nat and filter for a full sync: the canaries, the built-in chains, the
/// chains named like ours and, when `adopt`, the digests of their rules.
///
/// Legacy: one `iptables-save`, which is cheap at any size. Nft: first the names, with `nft list
/// chains` (0.07 s at 25k chains); the tables are then read whole with `iptables-nft-save` only
/// if they hold at most `nft_chain_limit` chains, since its cost grows faster than the chains
/// (measured with iptables 1.8.9: 25k chains and 183k rules 1.4 s, 75k and 527k 6.9 s, 128k
/// chains of 3 rules over 5 minutes). An error reading the names is returned (there is
/// nothing to go on); anything else that goes wrong after it is a `fallback`.
pub(crate) fn read_kernel(
    cmd: &dyn IptablesRunner,
    backend: Backend,
    family: IpFamily,
    adopt: bool,
    nft_chain_limit: usize,
) -> Result<KernelRead, Error> {
    let started = Instant::now();
    let mut names = KernelChains::default();
    let scans = scan_tables(cmd, backend, family, &TABLES, false, &mut |t, seen| {
        names.see(t, seen)
    })?;
    let done = |scans, chains: KernelChains, fallback: Option<String>| {
        Ok(KernelRead {
            scans,
            chains,
            fallback,
            took: started.elapsed(),
        })
    };
    if !adopt {
        return done(scans, names, Some("adoption is turned off".into()));
    }
    if scans.iter().all(|s| s.whole) {
        // Legacy, or nft without a chain listing: the tables were read whole already. A
        // listing that failed part way reported chains that the save then reported again,
        // which reads as chains declared twice: read once more, alone.
        if backend == Backend::Nft && names.problem.is_some() {
            let mut again = KernelChains::default();
            let whole = scan_tables(cmd, backend, family, &TABLES, true, &mut |t, seen| {
                again.see(t, seen)
            });
            return match whole {
                Ok(whole) => {
                    let problem = again.problem.clone();
                    done(whole, again, problem)
                }
                Err(e) => done(
                    scans,
                    names,
                    Some(format!("cannot read the tables whole: {e}")),
                ),
            };
        }
        let problem = names.problem.clone();
        return done(scans, names, problem);
    }
    if names.user_chains > nft_chain_limit {
        let why = format!(
            "nat and filter hold {} chains, more than {nft_chain_limit}: iptables-nft-save would take minutes",
            names.user_chains
        );
        return done(scans, names, Some(why));
    }
    let mut chains = KernelChains::default();
    let whole = scan_tables(cmd, backend, family, &TABLES, true, &mut |t, seen| {
        chains.see(t, seen)
    });
    match whole {
        Err(e) => done(
            scans,
            names,
            Some(format!("cannot read the tables whole: {e}")),
        ),
        Ok(_) if chains.problem.is_some() => {
            let problem = chains.problem.take();
            done(scans, names, problem)
        }
        Ok(_) if !chains.same_chains(&names) => done(
            scans,
            names,
            Some(
                "nft list chains and iptables-nft-save name different chains of ours: the tables changed while they were read"
                    .into(),
            ),
        ),
        Ok(whole) => done(whole, chains, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(r: &[&str]) -> Vec<String> {
        r.iter().map(|s| s.to_string()).collect()
    }

    fn chain(k: &mut KernelChains, table: &str, name: &str) {
        k.see(
            table,
            Seen::Chain {
                name,
                builtin: false,
            },
        );
    }

    #[test]
    fn chains_named_like_ours_are_kept_with_the_digest_of_their_rules() {
        let mut k = KernelChains::default();
        k.see(
            "nat",
            Seen::Chain {
                name: "PREROUTING",
                builtin: true,
            },
        );
        for name in [
            "KUBE-SERVICES",
            "KUBE-SVC-AAAAAAAAAAAAAAAA",
            "KUBE-MARK-MASQ",
            "MY-CHAIN",
        ] {
            chain(&mut k, "nat", name);
        }
        chain(&mut k, "filter", "KUBE-FIREWALL");
        chain(&mut k, "mangle", "KUBE-PROXY-CANARY");
        let svc = rules(&["-j KUBE-SEP-X"]);
        k.see(
            "nat",
            Seen::Rules {
                chain: "KUBE-SVC-AAAAAAAAAAAAAAAA",
                rules: &svc,
            },
        );
        k.see(
            "nat",
            Seen::Rules {
                chain: "MY-CHAIN",
                rules: &svc,
            },
        );
        assert_eq!(k.problem, None);
        assert_eq!(k.user_chains, 5);
        assert_eq!(
            k.get(Table::Nat, "KUBE-SVC-AAAAAAAAAAAAAAAA"),
            Some(digest(&svc))
        );
        // A chain without rules has the digest of no rules, as the planner records it.
        assert_eq!(
            k.get(Table::Nat, "KUBE-MARK-MASQ"),
            Some(digest::<String>(&[]))
        );
        assert!(k.contains(Table::Filter, "KUBE-FIREWALL"));
        assert!(!k.contains(Table::Nat, "MY-CHAIN"));
        assert!(!k.contains(Table::Nat, "PREROUTING"));
        assert_eq!(k.names().count(), 4);
    }

    #[test]
    fn a_read_that_declares_a_chain_twice_or_splits_its_rules_is_inconsistent() {
        let r = rules(&["-j RETURN"]);
        let mut twice = KernelChains::default();
        chain(&mut twice, "nat", "KUBE-SERVICES");
        chain(&mut twice, "nat", "KUBE-SERVICES");
        assert!(twice.problem.as_deref().unwrap().contains("declared twice"));

        let mut split = KernelChains::default();
        chain(&mut split, "nat", "KUBE-SERVICES");
        for _ in 0..2 {
            split.see(
                "nat",
                Seen::Rules {
                    chain: "KUBE-SERVICES",
                    rules: &r,
                },
            );
        }
        let p = split.problem.clone().unwrap();
        assert!(p.contains("two places"), "{p}");
        // The first problem is the one reported.
        chain(&mut split, "nat", "KUBE-SERVICES");
        assert_eq!(split.problem.unwrap(), p);

        let mut undeclared = KernelChains::default();
        undeclared.see(
            "filter",
            Seen::Rules {
                chain: "KUBE-FORWARD",
                rules: &r,
            },
        );
        assert!(undeclared
            .problem
            .unwrap()
            .contains("filter chain KUBE-FORWARD has rules but was not declared"));
    }

    #[test]
    fn the_same_chains_in_two_reads_agree_and_one_more_does_not() {
        let mut a = KernelChains::default();
        let mut b = KernelChains::default();
        for k in [&mut a, &mut b] {
            chain(k, "nat", "KUBE-SERVICES");
            chain(k, "filter", "KUBE-SERVICES");
        }
        assert!(a.same_chains(&b));
        chain(&mut b, "nat", "KUBE-SEP-AAAAAAAAAAAAAAAA");
        assert!(!a.same_chains(&b) && !b.same_chains(&a));
    }
}
