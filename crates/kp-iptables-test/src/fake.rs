//! [`FakeIptables`]: a node's iptables tools in memory, behind the same
//! [`IptablesRunner`] the dataplane drives the real ones through, so the dataplane's syncs,
//! failures, read-back and adoption are tested without root (as upstream's
//! `pkg/util/iptables/testing` fake, `iptablestest.FakeIPTables`).
//!
//! The nat and filter tables are an [`IptablesTracer`]'s: restore inputs are parsed by the
//! tracer, which refuses what iptables-restore or the kernel would, and a test can trace the
//! packet-flow table through whatever the syncs left. What the tools do that the fake keeps:
//!
//! - `--noflush` restores, committed table by table: a refused table changes nothing of
//!   itself, and tables committed before it stay (as both backends do). The error carries the
//!   failing line's number and text, as [`IptablesCommand`](kp_iptables::IptablesCommand)
//!   reports them.
//! - `iptables-save` in the form the tools print it (declarations, then rules chain by chain),
//!   `iptables -S CHAIN` with exit 1 for a missing chain, `iptables -N` with exit 1 for an
//!   existing one, and `nft list chains` for the nft backend's tables.
//! - The two backends' tables are apart, as in the kernel; a backend nothing was written to
//!   has no tables (its save prints nothing).
//! - The mangle table holds chain names only: kube-proxy keeps nothing but its canary there.
//! - A `recent` list lives as long as a rule names it (the kernel frees an xt_recent table
//!   with its last rule): the names whose last rule went are recorded, in commit order
//!   ([`FakeIptables::take_purged_recent`]).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use kp_core::model::IpFamily;
use kp_iptables::{split_args, Backend, CommandOutput, Error, IptablesRunner};
use kp_iptables_plan::Table;

use crate::tracer::{IptablesTracer, TraceError};

/// The mangle table's built-in chains, in the kernel's order.
const MANGLE_BUILTINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// Tables as `iptables-save` prints them when asked for all.
const SAVE_ORDER: [&str; 3] = ["mangle", "nat", "filter"];

/// A node's iptables tools in memory. Clones share the tables, so a test keeps one and hands
/// another to the dataplane.
#[derive(Clone)]
pub struct FakeIptables {
    state: Arc<Mutex<State>>,
}

/// Everything the fake holds.
struct State {
    /// The node's addresses, for tracing (`-m addrtype --dst-type LOCAL`).
    local: Vec<IpAddr>,
    /// Each backend's tables, once something was written with it.
    backends: BTreeMap<Backend, Tables>,
    /// Restores to let through before one fails (`None`: none fails).
    fail_after: Option<usize>,
    /// Restores run, failed ones included.
    restores: usize,
    /// Sysctls set, by key.
    sysctls: BTreeMap<String, String>,
    /// `recent` names whose last rule went, in commit order.
    purged: Vec<(Backend, IpFamily, String)>,
}

/// One backend's tables.
#[derive(Clone)]
struct Tables {
    /// nat and filter of both families.
    nat_filter: IptablesTracer,
    /// The user chains of mangle, per family (IPv4, IPv6).
    mangle: [BTreeSet<String>; 2],
}

fn family_index(family: IpFamily) -> usize {
    match family {
        IpFamily::V4 => 0,
        IpFamily::V6 => 1,
    }
}

fn table_of(name: &str) -> Option<Table> {
    match name {
        "nat" => Some(Table::Nat),
        "filter" => Some(Table::Filter),
        _ => None,
    }
}

/// The `recent` lists the rules of one family's nat and filter name.
fn recent_names(tracer: &IptablesTracer, family: IpFamily) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for table in Table::ALL {
        for chain in tracer.chain_names(family, table) {
            for rule in tracer.chain(family, table, &chain).unwrap_or_default() {
                if !rule.contains("--name") {
                    continue;
                }
                let words = split_args(rule);
                names.extend(
                    words
                        .windows(2)
                        .filter(|w| w[0] == "--name")
                        .map(|w| w[1].clone()),
                );
            }
        }
    }
    names
}

impl Default for FakeIptables {
    fn default() -> Self {
        FakeIptables::new(Vec::new())
    }
}

impl FakeIptables {
    /// The tools of a node whose own addresses are `local` (what a trace takes for local
    /// destinations; loopback always is). No backend has tables yet.
    pub fn new(local: Vec<IpAddr>) -> Self {
        FakeIptables {
            state: Arc::new(Mutex::new(State {
                local,
                backends: BTreeMap::new(),
                fail_after: None,
                restores: 0,
                sysctls: BTreeMap::new(),
                purged: Vec::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock is failing already.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next restore fails without changing anything, as a tool that exits 1 would.
    pub fn fail_next_restore(&self) {
        self.fail_restore_after(0);
    }

    /// Lets `n` restores through, then fails the next one without changing anything.
    pub fn fail_restore_after(&self, n: usize) {
        self.lock().fail_after = Some(n);
    }

    /// How many restores ran, failed ones included.
    pub fn restores(&self) -> usize {
        self.lock().restores
    }

    /// What `iptables-save` of `backend` and `family` prints: every table, or nothing if no
    /// table was written with that backend.
    pub fn save(&self, backend: Backend, family: IpFamily) -> String {
        self.lock().save(backend, family, None).unwrap_or_default()
    }

    /// The rules of a nat or filter chain, as the arguments after `-A CHAIN`, or `None` if it
    /// does not exist.
    pub fn chain(
        &self,
        backend: Backend,
        family: IpFamily,
        table: Table,
        name: &str,
    ) -> Option<Vec<String>> {
        let st = self.lock();
        let tables = st.backends.get(&backend)?;
        tables
            .nat_filter
            .chain(family, table, name)
            .map(<[String]>::to_vec)
    }

    /// A tracer over `backend`'s nat and filter as they are now, for the packet-flow table.
    pub fn tracer(&self, backend: Backend) -> IptablesTracer {
        let st = self.lock();
        match st.backends.get(&backend) {
            Some(t) => t.nat_filter.clone(),
            None => IptablesTracer::new(st.local.clone()),
        }
    }

    /// The `recent` lists whose last rule went since the last call (the kernel frees their
    /// entries, so clients lose their affinity), as (family, name), in commit order.
    pub fn take_purged_recent(&self) -> Vec<(IpFamily, String)> {
        std::mem::take(&mut self.lock().purged)
            .into_iter()
            .map(|(_, f, n)| (f, n))
            .collect()
    }

    /// The value a sysctl was set to, if it was.
    pub fn sysctl_value(&self, key: &str) -> Option<String> {
        self.lock().sysctls.get(key).cloned()
    }
}

impl State {
    fn tables(&mut self, backend: Backend) -> &mut Tables {
        let local = &self.local;
        self.backends.entry(backend).or_insert_with(|| Tables {
            nat_filter: IptablesTracer::new(local.clone()),
            mangle: [BTreeSet::new(), BTreeSet::new()],
        })
    }

    /// Applies a restore input table by table. On a refused line, the tables committed before
    /// it stay and the refused one is left as it was.
    fn restore(&mut self, backend: Backend, family: IpFamily, input: &str) -> Result<(), Error> {
        let program = backend.program(family, "-restore");
        let lines: Vec<&str> = input.lines().collect();
        let refused = |at: usize, reason: String| Error::Restore {
            program: program.clone(),
            status: Some(1),
            stderr: format!("{program}: line {at}: {reason}"),
            line: Some(at),
            failing_line: lines.get(at.wrapping_sub(1)).map(|l| l.to_string()),
        };
        let mut i = 0;
        while i < lines.len() {
            let l = lines[i].trim();
            if l.is_empty() || l.starts_with('#') {
                i += 1;
                continue;
            }
            let Some(name) = l.strip_prefix('*') else {
                return Err(refused(i + 1, format!("line outside a table: {l}")));
            };
            let start = i;
            let end = lines[start..]
                .iter()
                .position(|l| l.trim() == "COMMIT")
                .map(|n| start + n)
                .ok_or_else(|| {
                    refused(
                        lines.len() + 1,
                        format!("table {name} is not committed: COMMIT expected"),
                    )
                })?;
            let block = &lines[start..=end];
            let tables = self.tables(backend);
            if name.trim() == "mangle" {
                let chains = &mut tables.mangle[family_index(family)];
                let mut staged = chains.clone();
                for (n, l) in block.iter().enumerate().skip(1).take(block.len() - 2) {
                    mangle_line(&mut staged, l.trim()).map_err(|r| refused(start + n + 1, r))?;
                }
                *chains = staged;
            } else {
                let before = recent_names(&tables.nat_filter, family);
                let text = block.join("\n") + "\n";
                tables
                    .nat_filter
                    .apply(family, &text)
                    .map_err(|e| match e {
                        TraceError::Unsupported { line, reason }
                        | TraceError::Invalid { line, reason } => refused(start + line, reason),
                        other => refused(start + 1, other.to_string()),
                    })?;
                let after = recent_names(&tables.nat_filter, family);
                self.purged.extend(
                    before
                        .difference(&after)
                        .map(|n| (backend, family, n.clone())),
                );
            }
            i = end + 1;
        }
        Ok(())
    }

    /// `iptables-save [-t TABLE]`; `None` if the backend has no tables.
    fn save(&self, backend: Backend, family: IpFamily, table: Option<&str>) -> Option<String> {
        let tables = self.backends.get(&backend)?;
        let mut out = String::from("# Generated by iptables-save (kube-proxy-rs FakeIptables)\n");
        for name in SAVE_ORDER {
            if table.is_some_and(|t| t != name) {
                continue;
            }
            out.push_str(&format!("*{name}\n"));
            match table_of(name) {
                None => {
                    for b in MANGLE_BUILTINS {
                        out.push_str(&format!(":{b} ACCEPT [0:0]\n"));
                    }
                    for c in &tables.mangle[family_index(family)] {
                        out.push_str(&format!(":{c} - [0:0]\n"));
                    }
                }
                Some(t) => {
                    let tracer = &tables.nat_filter;
                    let (builtin, user): (Vec<String>, Vec<String>) = tracer
                        .chain_names(family, t)
                        .into_iter()
                        .partition(|c| tracer.policy(family, t, c).is_some());
                    for c in &builtin {
                        let policy = tracer.policy(family, t, c).unwrap_or("ACCEPT");
                        out.push_str(&format!(":{c} {policy} [0:0]\n"));
                    }
                    for c in &user {
                        out.push_str(&format!(":{c} - [0:0]\n"));
                    }
                    for c in builtin.iter().chain(&user) {
                        for rule in tracer.chain(family, t, c).unwrap_or_default() {
                            if rule.is_empty() {
                                out.push_str(&format!("-A {c}\n"));
                            } else {
                                out.push_str(&format!("-A {c} {rule}\n"));
                            }
                        }
                    }
                }
            }
            out.push_str("COMMIT\n");
        }
        Some(out)
    }

    /// `iptables -t TABLE -S CHAIN`.
    fn list(&self, backend: Backend, family: IpFamily, table: &str, chain: &str) -> CommandOutput {
        let missing = CommandOutput {
            status: Some(1),
            stdout: String::new(),
            stderr: format!("iptables: No chain/target/match by that name ({table} {chain})."),
        };
        let Some(tables) = self.backends.get(&backend) else {
            return missing;
        };
        let stdout = match table_of(table) {
            None if table == "mangle" => {
                if MANGLE_BUILTINS.contains(&chain) {
                    format!("-P {chain} ACCEPT\n")
                } else if tables.mangle[family_index(family)].contains(chain) {
                    format!("-N {chain}\n")
                } else {
                    return missing;
                }
            }
            None => return missing,
            Some(t) => {
                let tracer = &tables.nat_filter;
                let Some(rules) = tracer.chain(family, t, chain) else {
                    return missing;
                };
                let mut out = match tracer.policy(family, t, chain) {
                    Some(p) => format!("-P {chain} {p}\n"),
                    None => format!("-N {chain}\n"),
                };
                for r in rules {
                    if r.is_empty() {
                        out.push_str(&format!("-A {chain}\n"));
                    } else {
                        out.push_str(&format!("-A {chain} {r}\n"));
                    }
                }
                out
            }
        };
        CommandOutput {
            status: Some(0),
            stdout,
            stderr: String::new(),
        }
    }

    /// `iptables -t TABLE -N CHAIN`.
    fn new_chain(
        &mut self,
        backend: Backend,
        family: IpFamily,
        table: &str,
        chain: &str,
    ) -> CommandOutput {
        let exists = CommandOutput {
            status: Some(1),
            stdout: String::new(),
            stderr: "iptables: Chain already exists.".into(),
        };
        let tables = self.tables(backend);
        match table_of(table) {
            None if table == "mangle" => {
                let chains = &mut tables.mangle[family_index(family)];
                if MANGLE_BUILTINS.contains(&chain) || !chains.insert(chain.to_string()) {
                    return exists;
                }
            }
            None => return unsupported(&["-t", table, "-N", chain]),
            Some(t) => {
                if tables.nat_filter.chain(family, t, chain).is_some() {
                    return exists;
                }
                let input = format!("*{table}\n-N {chain}\nCOMMIT\n");
                if let Err(e) = tables.nat_filter.apply(family, &input) {
                    return CommandOutput {
                        status: Some(2),
                        stdout: String::new(),
                        stderr: e.to_string(),
                    };
                }
            }
        }
        CommandOutput {
            status: Some(0),
            stdout: String::new(),
            stderr: String::new(),
        }
    }

    /// `nft list chains ip|ip6`: the nft backend's tables, as nft prints them.
    fn nft_chains(&self, family: IpFamily) -> String {
        let Some(tables) = self.backends.get(&Backend::Nft) else {
            return String::new();
        };
        let fam = match family {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        };
        let mut out = String::new();
        let chain = |out: &mut String, name: &str, hook: Option<(&str, &str)>| {
            out.push_str(&format!("\tchain {name} {{\n"));
            if let Some((table, hook)) = hook {
                out.push_str(&format!(
                    "\t\ttype {} hook {hook} priority {table}; policy accept;\n",
                    if table == "nat" { "nat" } else { "filter" }
                ));
            }
            out.push_str("\t}\n");
        };
        for name in ["filter", "nat", "mangle"] {
            out.push_str(&format!("table {fam} {name} {{\n"));
            match table_of(name) {
                None => {
                    for b in MANGLE_BUILTINS {
                        chain(&mut out, b, Some((name, &b.to_lowercase())));
                    }
                    for c in &tables.mangle[family_index(family)] {
                        chain(&mut out, c, None);
                    }
                }
                Some(t) => {
                    let tracer = &tables.nat_filter;
                    for c in tracer.chain_names(family, t) {
                        let hook = tracer
                            .policy(family, t, &c)
                            .map(|_| (name, c.to_lowercase()));
                        chain(&mut out, &c, hook.as_ref().map(|(t, h)| (*t, h.as_str())));
                    }
                }
            }
            out.push_str("}\n");
        }
        out
    }
}

/// One line of a mangle restore block: declarations and deletions of chains only.
fn mangle_line(chains: &mut BTreeSet<String>, l: &str) -> Result<(), String> {
    if l.is_empty() || l.starts_with('#') {
        return Ok(());
    }
    if let Some(decl) = l.strip_prefix(':') {
        let mut words = decl.split_whitespace();
        let name = words.next().unwrap_or_default();
        if MANGLE_BUILTINS.contains(&name) {
            return Ok(());
        }
        if words.next() != Some("-") {
            return Err(format!("cannot set a policy on user-defined chain {name}"));
        }
        chains.insert(name.to_string());
        return Ok(());
    }
    let words: Vec<&str> = l.split_whitespace().collect();
    match words.as_slice() {
        ["-X", name] => {
            if chains.remove(*name) {
                Ok(())
            } else {
                Err(format!("cannot delete chain {name}: no such chain"))
            }
        }
        ["-N", name] => {
            if MANGLE_BUILTINS.contains(name) || !chains.insert(name.to_string()) {
                Err(format!("chain {name} already exists"))
            } else {
                Ok(())
            }
        }
        _ => Err(format!("unsupported in the fake's mangle table: {l}")),
    }
}

/// What the fake answers to arguments it does not model: exit 2, as iptables does for a bad
/// argument, so a test using them fails loudly.
fn unsupported(args: &[&str]) -> CommandOutput {
    CommandOutput {
        status: Some(2),
        stdout: String::new(),
        stderr: format!("FakeIptables does not model `iptables {}`", args.join(" ")),
    }
}

impl IptablesRunner for FakeIptables {
    fn restore_with(
        &self,
        backend: Backend,
        family: IpFamily,
        write: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
    ) -> Result<(), Error> {
        let program = backend.program(family, "-restore");
        let mut buf = Vec::new();
        write(&mut buf).map_err(|source| Error::Spawn {
            program: program.clone(),
            source,
        })?;
        let input = String::from_utf8_lossy(&buf);
        let mut st = self.lock();
        st.restores += 1;
        match st.fail_after {
            Some(0) => {
                st.fail_after = None;
                return Err(Error::Restore {
                    program,
                    status: Some(1),
                    stderr: "FakeIptables was told to fail this restore".into(),
                    line: None,
                    failing_line: None,
                });
            }
            Some(n) => st.fail_after = Some(n - 1),
            None => {}
        }
        st.restore(backend, family, &input)
    }

    fn run(
        &self,
        backend: Backend,
        family: IpFamily,
        args: &[&str],
    ) -> Result<CommandOutput, Error> {
        let mut st = self.lock();
        Ok(match args {
            ["-t", table, "-S", chain] => st.list(backend, family, table, chain),
            ["-t", table, "-N", chain] => st.new_chain(backend, family, table, chain),
            _ => unsupported(args),
        })
    }

    fn save_lines(
        &self,
        backend: Backend,
        family: IpFamily,
        table: Option<&str>,
        each: &mut dyn FnMut(&str) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let text = self.lock().save(backend, family, table).unwrap_or_default();
        text.lines().try_for_each(each)
    }

    fn nft_chain_lines(
        &self,
        family: IpFamily,
        each: &mut dyn FnMut(&str) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let text = self.lock().nft_chains(family);
        text.lines().try_for_each(each)
    }

    fn sysctl(&self, key: &str, value: &str) -> Result<(), Error> {
        self.lock()
            .sysctls
            .insert(key.to_string(), value.to_string());
        Ok(())
    }
}

#[cfg(test)]
mod tests;
