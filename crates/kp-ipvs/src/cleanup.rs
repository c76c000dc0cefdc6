//! Removing what the ipvs mode leaves in a node (upstream's `CleanupLeftovers` in
//! `pkg/proxy/ipvs/proxier.go`): its virtual servers, `kube-ipvs0`, the iptables chains that
//! match its sets, and the sets.
//!
//! Every start of another mode runs this, so it must cost little and change nothing where the
//! ipvs mode never ran: IPVS is asked only when `kube-ipvs0` exists (so a node without IPVS
//! never loads `ip_vs` for it), a table's chains are touched only when one of the chains only
//! this mode makes is there, and a set is destroyed only if it has one of this mode's names.
//!
//! Which virtual servers are ours: with `kube-ipvs0` present, every address-based one outside
//! `--ipvs-exclude-cidrs` and the firewall-mark ones of the short-circuit marks
//! (`kp_ipvs_plan::local`). Upstream flushes IPVS whole; the excluded ranges and other
//! firewall-mark services are left to their owners.
//!
//! A mode switch removes these leftovers while another mode runs ([`Keep`]): the chains that
//! mode fills by the same names (the iptables mode's `KUBE-SERVICES`, `KUBE-POSTROUTING`, ...)
//! and its jumps to them stay, and virtual servers that still carry connections stay (with
//! `kube-ipvs0`, whose addresses their packets are for) until those connections end: the new
//! mode translates every new connection before IPVS sees it, and deleting a virtual server
//! would drop the established ones (`expire_nodest_conn`).

use std::collections::BTreeSet;
use std::process::Command;

use ipnet::IpNet;
use kp_core::dataplane::HeldBackend;
use kp_core::model::IpFamily;
use kp_iptables::{Backend, IptablesCommand};
use kp_iptables_plan::names::{
    KUBE_FORWARD, KUBE_MARK_MASQ, KUBE_POSTROUTING, KUBE_PROXY_FIREWALL, KUBE_SERVICES,
};
use kp_ipvs_plan::addresses::DUMMY_INTERFACE;
use kp_ipvs_plan::ipset::SetName;
use kp_ipvs_plan::local::KUBE_IPVS_LOCAL;
use kp_ipvs_plan::rules::{
    jump_rules, KUBE_IPVS_FILTER, KUBE_IPVS_OUT_FILTER, KUBE_LOAD_BALANCER, KUBE_NODE_PORT,
    KUBE_SOURCE_RANGES_FIREWALL,
};
use kp_netlink::ipvs::{Destination, DestinationState, ServiceKey};

use crate::link::Dummy;
use crate::{Client, Error, Result};

/// What a removal did, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    /// Virtual servers deleted.
    pub services: usize,
    /// Whether `kube-ipvs0` was deleted.
    pub interface: bool,
    /// Chains deleted (the ones only this mode makes; the ones it shares with the iptables
    /// mode are flushed and left to that mode's cleanup).
    pub chains: usize,
    /// Sets destroyed.
    pub sets: usize,
    /// Virtual servers left in place because they still carry connections (only with
    /// [`Keep::draining`]); `kube-ipvs0` stays with them.
    pub draining: usize,
    /// Real servers deleted from those virtual servers because they carry no established
    /// connection.
    pub real_servers: usize,
}

/// What a removal must leave because the mode now running uses it (empty for `--cleanup`
/// and a start with nothing shared).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Keep {
    /// Chains, as (table, chain), that the running mode fills: not flushed, not deleted.
    pub chains: BTreeSet<(String, String)>,
    /// Rules in built-in chains, as (table, chain, words), that the running mode makes too:
    /// not deleted even where they are also this mode's jumps.
    pub jumps: BTreeSet<(String, String, Vec<String>)>,
    /// Whether virtual servers with connections stay until they have none (a mode switch);
    /// without it every one of ours goes at once (`--cleanup`).
    pub draining: bool,
}

impl Keep {
    fn chain(&self, table: &str, chain: &str) -> bool {
        self.chains.iter().any(|(t, c)| t == table && c == chain)
    }

    fn jump(&self, table: &str, chain: &str, words: &[String]) -> bool {
        self.jumps
            .iter()
            .any(|(t, c, w)| t == table && c == chain && w == words)
    }
}

impl Removed {
    /// Whether nothing was there.
    pub fn is_empty(&self) -> bool {
        *self == Removed::default()
    }
}

/// The chains only the ipvs mode makes, by table.
fn own_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &[KUBE_NODE_PORT, KUBE_LOAD_BALANCER],
        "filter" => &[
            KUBE_NODE_PORT,
            KUBE_SOURCE_RANGES_FIREWALL,
            KUBE_IPVS_FILTER,
            KUBE_IPVS_OUT_FILTER,
        ],
        "mangle" => &[KUBE_IPVS_LOCAL],
        _ => &[],
    }
}

/// The chains the ipvs mode fills and shares by name with the iptables mode, by table.
fn shared_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &[KUBE_SERVICES, KUBE_POSTROUTING, KUBE_MARK_MASQ],
        "filter" => &[KUBE_FORWARD, KUBE_PROXY_FIREWALL],
        _ => &[],
    }
}

/// Every chain the ipvs mode fills, as (table, chain): its own and the shared ones. What a
/// removal of the iptables mode's leftovers must leave while this mode runs.
pub fn ipvs_mode_chains() -> BTreeSet<(String, String)> {
    ["nat", "filter", "mangle"]
        .into_iter()
        .flat_map(|t| {
            own_chains(t)
                .iter()
                .chain(shared_chains(t))
                .map(move |c| (t.to_string(), c.to_string()))
        })
        .collect()
}

/// The ipvs mode's jumps from the built-in chains, as (table, chain, words).
pub fn ipvs_mode_jumps() -> BTreeSet<(String, String, Vec<String>)> {
    jump_rules()
        .into_iter()
        .map(|j| {
            (
                j.table.to_string(),
                j.chain.to_string(),
                kp_iptables::split_args(&j.args),
            )
        })
        .collect()
}

/// The iptables mode's jumps from the built-in chains (its planner's, with kubelet's
/// `KUBE-FIREWALL` jumps where it owns that chain), as (table, chain, words): what a removal
/// of this mode's leftovers must leave while the iptables mode runs.
pub fn iptables_mode_jumps() -> BTreeSet<(String, String, Vec<String>)> {
    let mut all = BTreeSet::new();
    for localhost_node_ports in [false, true] {
        let cfg = kp_iptables_plan::PlanConfig {
            localhost_node_ports,
            ..kp_iptables_plan::PlanConfig::new(IpFamily::V4)
        };
        for j in kp_iptables_plan::Planner::new(cfg).jump_rules() {
            all.insert((
                j.table.to_string(),
                j.chain.to_string(),
                kp_iptables::split_args(&j.args),
            ));
        }
    }
    all
}

/// The chains the ipvs mode shares by name with the iptables mode, as (table, chain).
pub fn chains_shared_with_iptables_mode() -> BTreeSet<(String, String)> {
    ["nat", "filter"]
        .into_iter()
        .flat_map(|t| {
            shared_chains(t)
                .iter()
                .map(move |c| (t.to_string(), c.to_string()))
        })
        .collect()
}

/// The `iptables-restore --noflush` input that removes the ipvs mode's rules from one table,
/// given its `iptables-save -t TABLE` text, or `None` when none of the chains only this mode
/// makes is there (the table is the iptables mode's, or nobody's). The input deletes this
/// mode's jumps from the built-in chains, flushes the shared chains (their rules match the
/// sets, which cannot be destroyed while referenced) and deletes this mode's own chains.
/// Also returns how many chains it deletes.
pub fn table_removal(table: &str, saved: &str) -> Option<(String, usize)> {
    table_removal_keeping(table, saved, &Keep::default())
}

/// [`table_removal`], leaving what `keep` names: a kept shared chain is not flushed, and a
/// jump of this mode's that the running mode makes too (to a kept chain) is not deleted.
pub fn table_removal_keeping(table: &str, saved: &str, keep: &Keep) -> Option<(String, usize)> {
    let mut chains: BTreeSet<&str> = BTreeSet::new();
    let mut rules: Vec<(&str, Vec<String>)> = Vec::new();
    for line in saved.lines() {
        if let Some(decl) = line.strip_prefix(':') {
            if let Some(name) = decl.split_whitespace().next() {
                chains.insert(name);
            }
        } else if let Some(rest) = line.strip_prefix("-A ") {
            if let Some((chain, args)) = rest.split_once(' ') {
                rules.push((chain, kp_iptables::split_args(args)));
            }
        }
    }
    let own: Vec<&str> = own_chains(table)
        .iter()
        .copied()
        .filter(|c| chains.contains(c))
        .collect();
    if own.is_empty() {
        return None;
    }
    let jumps: Vec<(&str, Vec<String>)> = jump_rules()
        .into_iter()
        .filter(|j| j.table == table)
        .map(|j| (j.chain, kp_iptables::split_args(&j.args)))
        .collect();
    let mut out = format!("*{table}\n");
    for (chain, args) in &rules {
        if own_chains(table).contains(chain) || shared_chains(table).contains(chain) {
            continue; // flushed below
        }
        let target = args
            .windows(2)
            .find(|w| w[0] == "-j" || w[0] == "-g")
            .map(|w| w[1].as_str());
        let to_own = target.is_some_and(|t| own.contains(&t));
        let ours = jumps.iter().any(|(c, a)| c == chain && a == args);
        let kept = target.is_some_and(|t| keep.chain(table, t)) && keep.jump(table, chain, args);
        if to_own || (ours && !kept) {
            out.push_str(&format!("-D {chain} {}\n", quote(args)));
        }
    }
    for c in shared_chains(table)
        .iter()
        .filter(|c| chains.contains(*c) && !keep.chain(table, c))
    {
        out.push_str(&format!(":{c} - [0:0]\n"));
    }
    for c in &own {
        out.push_str(&format!(":{c} - [0:0]\n"));
    }
    for c in &own {
        out.push_str(&format!("-X {c}\n"));
    }
    out.push_str("COMMIT\n");
    Some((out, own.len()))
}

/// Words back into one `iptables-restore` line, quoting those with spaces.
fn quote(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            if w.contains(char::is_whitespace) || w.is_empty() {
                format!("\"{w}\"")
            } else {
                w.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn tool(op: &str) -> impl FnOnce(kp_iptables::Error) -> Error + '_ {
    move |e| Error::Tool {
        op: op.to_string(),
        detail: e.to_string(),
    }
}

/// The tables of one backend and family that hold one of the chains only this mode makes,
/// found without reading rules: with nft the chain names `nft list chains` prints (reading a
/// 10k-Service iptables-mode table with iptables-nft-save takes minutes); with legacy the
/// tables that exist (`/proc/net/ip_tables_names`: reading one by name would create it).
fn tables_with_own_chains(
    iptables: &IptablesCommand,
    backend: Backend,
    family: IpFamily,
) -> Vec<&'static str> {
    const TABLES: [&str; 3] = ["nat", "filter", "mangle"];
    match backend {
        Backend::Nft => {
            let mut found: BTreeSet<&'static str> = BTreeSet::new();
            let mut table: Option<&'static str> = None;
            let listed = iptables.nft_chain_lines(family, &mut |line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    ["table", _, name, ..] => table = TABLES.iter().copied().find(|t| t == name),
                    ["chain", name, ..] => {
                        if let Some(t) = table {
                            if own_chains(t).contains(name) {
                                found.insert(t);
                            }
                        }
                    }
                    _ => {}
                }
                Ok(())
            });
            if let Err(e) = listed {
                tracing::debug!(error = %e, ?family, "cannot list nft chains; nothing to remove");
                return Vec::new();
            }
            TABLES.into_iter().filter(|t| found.contains(t)).collect()
        }
        Backend::Legacy => {
            let exist = iptables.legacy_tables(family);
            TABLES
                .into_iter()
                .filter(|t| exist.iter().any(|e| e == t))
                .collect()
        }
    }
}

/// Removes the ipvs mode's chains from both backends and families. A backend whose tables
/// cannot be read (the tool missing, a kernel without the legacy interface) has nothing to
/// remove. Returns the chains deleted.
fn remove_chains(iptables: &IptablesCommand, keep: &Keep) -> Result<usize> {
    let mut removed = 0;
    for backend in Backend::ALL {
        for family in IpFamily::ALL {
            for table in tables_with_own_chains(iptables, backend, family) {
                let mut saved = String::new();
                let read = iptables.save_lines(backend, family, Some(table), &mut |l| {
                    saved.push_str(l);
                    saved.push('\n');
                    Ok(())
                });
                if let Err(e) = read {
                    tracing::debug!(error = %e, %backend, ?family, table, "nothing to read");
                    continue;
                }
                if let Some((input, n)) = table_removal_keeping(table, &saved, keep) {
                    iptables
                        .restore(backend, family, &input)
                        .map_err(tool("iptables-restore (ipvs cleanup)"))?;
                    removed += n;
                }
            }
        }
    }
    Ok(removed)
}

fn ipset(netns: Option<&str>, args: &[&str]) -> Command {
    let mut c = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "ipset"]);
            c
        }
        None => Command::new("ipset"),
    };
    c.args(args);
    c
}

/// Destroys the ipvs mode's sets (both families' names) that exist. Without the `ipset` tool
/// there is nothing this mode could have made. Returns the sets destroyed.
fn remove_sets(netns: Option<&str>) -> Result<usize> {
    let listed = match ipset(netns, &["list", "-n"]).output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => {
            // No set subsystem in this kernel: no sets either.
            tracing::debug!(stderr = %String::from_utf8_lossy(&o.stderr), "ipset list failed");
            return Ok(0);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => {
            return Err(Error::Tool {
                op: "ipset list -n".into(),
                detail: e.to_string(),
            })
        }
    };
    let ours: Vec<&str> = listed
        .lines()
        .map(str::trim)
        .filter(|n| {
            IpFamily::ALL
                .iter()
                .any(|f| SetName::parse(n, *f).is_some())
        })
        .collect();
    for name in &ours {
        let out = ipset(netns, &["destroy", name])
            .output()
            .map_err(|e| Error::Tool {
                op: format!("ipset destroy {name}"),
                detail: e.to_string(),
            })?;
        if !out.status.success() {
            return Err(Error::Tool {
                op: format!("ipset destroy {name}"),
                detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
    }
    Ok(ours.len())
}

/// Removes everything the ipvs mode may have left in `netns` (the current namespace if
/// `None`): with `kube-ipvs0` there, IPVS's virtual servers outside `exclude` and the
/// interface; then the mode's iptables rules (through `iptables`, which runs in the same
/// namespace) and its ipsets. Where the mode never ran, nothing is changed and nothing is
/// loaded.
pub fn remove_leftovers(
    netns: Option<&str>,
    iptables: &IptablesCommand,
    exclude: &[IpNet],
) -> Result<Removed> {
    remove_leftovers_keeping(netns, iptables, exclude, &Keep::default())
}

/// [`remove_leftovers`] while another mode runs: what `keep` names stays (see [`Keep`]); with
/// [`Keep::draining`], virtual servers that carry connections and `kube-ipvs0` stay too, and
/// [`Removed::draining`] says how many (call again later to finish).
pub fn remove_leftovers_keeping(
    netns: Option<&str>,
    iptables: &IptablesCommand,
    exclude: &[IpNet],
    keep: &Keep,
) -> Result<Removed> {
    let mut removed = Removed::default();
    if let Some(dummy) = Dummy::find(netns, DUMMY_INTERFACE)? {
        match Client::open(netns) {
            Ok(mut ipvs) => {
                // The kept virtual servers' idle real servers first: until they go, IPVS
                // answers for their closed connections (see `established_on`).
                let mut gone = Vec::new();
                for key in our_services(&mut ipvs, exclude)? {
                    let established = match keep.draining {
                        true => established_on(&mut ipvs, &key)?,
                        false => None,
                    };
                    let Some(idle) = established else {
                        gone.push(key);
                        continue;
                    };
                    removed.draining += 1;
                    for d in idle {
                        match ipvs.delete_destination(&key, d.addr, d.port) {
                            Ok(()) => removed.real_servers += 1,
                            Err(e) if e.is_not_found() => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
                for key in gone {
                    match ipvs.delete_service(&key) {
                        Ok(()) => removed.services += 1,
                        Err(e) if e.is_not_found() => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            // The interface outlived the module: no virtual servers to remove.
            Err(Error::Unavailable { .. }) => {}
            Err(e) => return Err(e),
        }
        if removed.draining == 0 {
            dummy.delete()?;
            removed.interface = true;
        }
    }
    removed.chains = remove_chains(iptables, keep)?;
    removed.sets = remove_sets(netns)?;
    Ok(removed)
}

/// The real servers of the ipvs mode's leftover virtual servers (those
/// [`remove_leftovers`] would remove) that carry established connections and on which IPVS
/// also keeps closing connections' (or UDP flows') entries, read without changing anything:
/// what another mode running in the ipvs mode's place must not connect clients straight to yet
/// ([`HeldBackend`]). These are what a draining removal keeps (`established_on`); the idle
/// ones it deletes, with their entries, so read before that removal (before the new mode's
/// first sync) this already names what stays after it. Empty where the ipvs mode never ran.
pub fn held_real_servers(netns: Option<&str>, exclude: &[IpNet]) -> Result<BTreeSet<HeldBackend>> {
    let mut out = BTreeSet::new();
    if Dummy::find(netns, DUMMY_INTERFACE)?.is_none() {
        return Ok(out);
    }
    let mut ipvs = match Client::open(netns) {
        Ok(ipvs) => ipvs,
        Err(Error::Unavailable { .. }) => return Ok(out),
        Err(e) => return Err(e),
    };
    for key in our_services(&mut ipvs, exclude)? {
        match ipvs.destinations(&key) {
            Ok(dests) => out.extend(held(&key, &dests)),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// The ipvs mode's virtual servers: with `kube-ipvs0` there, every address-based one outside
/// `exclude`, and the firewall-mark ones of the short-circuit marks.
fn our_services(ipvs: &mut Client, exclude: &[IpNet]) -> Result<Vec<ServiceKey>> {
    Ok(ipvs
        .services()?
        .into_iter()
        .map(|svc| svc.key)
        .filter(|key| match *key {
            ServiceKey::Addr { addr, .. } => !exclude.iter().any(|n| n.contains(&addr)),
            ServiceKey::Fwmark { mark, .. } => kp_ipvs_plan::local::is_short_circuit_mark(mark),
        })
        .collect())
}

/// Of `dests` (real servers of the virtual server `key`), those that count established
/// connections and closing connections' (or UDP flows') entries, as endpoints. A
/// firewall-mark virtual server names no protocol; its real servers are the address-based
/// ones' too.
fn held(key: &ServiceKey, dests: &[DestinationState]) -> Vec<HeldBackend> {
    let protocol = match *key {
        ServiceKey::Addr { protocol, .. } => kp_ipvs_plan::core_protocol(protocol),
        ServiceKey::Fwmark { .. } => return Vec::new(),
    };
    dests
        .iter()
        .filter(|d| d.active_connections > 0 && d.inactive_connections > 0)
        .map(|d| HeldBackend {
            protocol,
            addr: std::net::SocketAddr::new(d.destination.addr, d.destination.port),
        })
        .collect()
}

/// Whether a virtual server's real servers still count established connections, and if so
/// the real servers that count none (to delete: the virtual server stays for the others).
/// Closing ones (IPVS keeps `TIME_WAIT` for two minutes), UDP flows and persistence templates
/// do not hold a removal: the new mode serves the next packets of a UDP flow, and a template
/// only steers connections IPVS no longer sees. Deleting the idle real servers matters for a
/// mode that connects straight to a backend (ebpf's socket hooks): while a virtual server
/// exists IPVS's hooks stay registered, and a backend's answer to a new connection from a
/// client port that one of IPVS's `TIME_WAIT` entries holds is given the virtual server's
/// address (and the connection fails); with `expire_nodest_conn` (which the ipvs mode sets) a
/// deleted real server's entries go at once (Linux 5.9+).
fn established_on(ipvs: &mut Client, key: &ServiceKey) -> Result<Option<Vec<Destination>>> {
    let dests = match ipvs.destinations(key) {
        Ok(dests) => dests,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    };
    if !dests.iter().any(|d| d.active_connections > 0) {
        return Ok(None);
    }
    Ok(Some(
        dests
            .into_iter()
            .filter(|d| d.active_connections == 0)
            .map(|d| d.destination)
            .collect(),
    ))
}

#[cfg(test)]
mod tests;
