//! Follows a packet through `iptables-restore --noflush` text, without a kernel.
//!
//! The tracer keeps its own copy of the filter and nat tables of each family and replays the
//! same restore inputs the applier sends (the jump rules from the built-in chains are fed as
//! `-I` lines). It knows only the commands, matches and targets kube-proxy emits and refuses
//! anything else ([`TraceError::Unsupported`]), and it refuses what iptables-restore or the
//! kernel would refuse ([`TraceError::Invalid`]: a jump to a missing chain, a jump loop,
//! deleting a chain that is still referenced, DNAT reached from POSTROUTING, ...). So a test can
//! pass neither by the tracer ignoring a rule nor with a table the kernel would not load.
//! Mirrors the idea of upstream's tracer in `pkg/proxy/iptables/proxier_test.go`.
//!
//! A trace follows the first packet of a connection (conntrack state `NEW`): nat PREROUTING
//! (nat OUTPUT for the node's own packets), then the filter chain the routing decision picks
//! (INPUT for a local destination, else FORWARD; OUTPUT for the node's own packets), then nat
//! POSTROUTING (for forwarded and node packets; a packet delivered locally from outside takes
//! nat INPUT instead). `-m statistic` is a random choice: both outcomes are explored, so one
//! trace yields every [`Branch`] the connection may take, with its probability.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use kp_core::flow::Tracer;
use kp_core::flow::{Ingress, Origin, Packet, Verdict};
use kp_core::model::{IpFamily, Protocol};

use kp_iptables_plan::restore::Table;

/// The tables a trace walks: the two kube-proxy's iptables mode writes ([`Table`]), and
/// mangle, where the ipvs mode marks the `Local` policies' short-circuited traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tbl {
    Filter,
    Nat,
    Mangle,
}

impl Tbl {
    fn as_str(self) -> &'static str {
        match self {
            Tbl::Filter => "filter",
            Tbl::Nat => "nat",
            Tbl::Mangle => "mangle",
        }
    }
}

impl From<Table> for Tbl {
    fn from(t: Table) -> Tbl {
        match t {
            Table::Filter => Tbl::Filter,
            Table::Nat => Tbl::Nat,
        }
    }
}
use kp_iptables_plan::validate::{MAX_CHAIN_NAME, MAX_COMMENT, MAX_RECENT_NAME};

/// The longest ipset name (`IPSET_MAXNAMELEN` less the NUL).
const MAX_IPSET_NAME: usize = 31;

/// The source port of a traced connection (a [`Packet`] has none); `--sport` matches this.
pub const SOURCE_PORT: u16 = 40000;

/// Deepest chain nesting a trace or a commit check follows.
const MAX_DEPTH: usize = 64;
/// Rule evaluations one trace may take.
const MAX_STEPS: usize = 2_000_000;
/// Branches one trace may produce.
const MAX_BRANCHES: usize = 100_000;

/// Targets iptables knows that the tracer does not model; `-j` with one of these is refused as
/// unsupported rather than taken for a jump to a user chain.
const OTHER_TARGETS: &[&str] = &[
    "QUEUE",
    "SNAT",
    "REDIRECT",
    "NETMAP",
    "LOG",
    "NFLOG",
    "ULOG",
    "TRACE",
    "CT",
    "NOTRACK",
    "CONNMARK",
    "TPROXY",
    "CLASSIFY",
    "DSCP",
    "TOS",
    "TTL",
    "HL",
    "TCPMSS",
    "NFQUEUE",
    "AUDIT",
    "CHECKSUM",
    "SET",
    "TEE",
    "SECMARK",
    "CONNSECMARK",
    "HMARK",
    "IDLETIMER",
    "LED",
    "RATEEST",
    "SYNPROXY",
    "ECN",
];

/// Why the tracer refused an input or a trace.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// A table, command, match, target or option the tracer does not model. Not retryable:
    /// the input needs a tracer that understands it (or a renderer that does not emit it).
    #[error("line {line}: unsupported: {reason}")]
    Unsupported {
        /// 1-based line in the input.
        line: usize,
        /// What is not supported.
        reason: String,
    },
    /// Input iptables-restore or the kernel would refuse: a malformed line, a missing or
    /// duplicate chain, a jump to a missing chain or a loop at commit, deleting a chain that
    /// is still referenced or not empty, a target in a table or hook that does not allow it.
    /// Also what they accept but cannot be what was meant: a comment longer than 255 bytes
    /// (silently truncated, so the rule reads back differently), an unterminated quote (it
    /// swallows the rest of the line into the argument) and a chain named like a target. Not
    /// retryable. The whole input is then ignored: the tracer is left as
    /// it was.
    #[error("line {line}: {reason}")]
    Invalid {
        /// 1-based line in the input (for commit checks, the `COMMIT` line).
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// The rules give one packet different kinds of outcome depending on a random choice (for
    /// example DNAT on one branch and nothing on another), or the trace did not finish within
    /// its limits. A bug in the rules, not in the packet. Not retryable.
    #[error("{packet}: {reason}")]
    Inconsistent {
        /// The packet, as text.
        packet: String,
        /// What disagrees.
        reason: String,
    },
}

/// What happens to one branch of a traced connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Translated to this endpoint and let through.
    Dnat(IpAddr, u16),
    /// Let through untranslated.
    Untouched,
    /// Dropped.
    Drop,
    /// Rejected.
    Reject,
}

/// One way a connection may go, after the random choices on its way.
#[derive(Clone, Debug, PartialEq)]
pub struct Branch {
    /// What happens to it.
    pub outcome: Outcome,
    /// Whether its source is masqueraded.
    pub masquerade: bool,
    /// ClientIP affinity: the `--seconds` of a `-m recent --rcheck` whose list this branch then
    /// adds the client to with `-m recent --set`.
    pub affinity: Option<u32>,
    /// How likely this branch is, from the `-m statistic` probabilities on its way.
    pub probability: f64,
    /// The rules it matched, in order, as `table CHAIN rule`.
    pub rules: Vec<String>,
}

/// Which of a packet's addresses or ports one field of an `-m set` lookup takes (`src`, `dst`
/// in `--match-set NAME dst,dst,src`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetSide {
    /// The source address or port.
    Src,
    /// The destination address or port.
    Dst,
}

/// A packet as an ipset lookup or IPVS sees it, at that point of its walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// Source address.
    pub src: IpAddr,
    /// Destination address (after any DNAT so far).
    pub dst: IpAddr,
    /// L4 protocol.
    pub protocol: Protocol,
    /// Source port ([`SOURCE_PORT`]).
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// The packet's mark.
    pub mark: u32,
}

/// Where IPVS sends a new connection that one of its virtual servers took.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduled {
    /// The real servers it may go to, each with its chance; none: IPVS answers with an ICMP
    /// port unreachable (a reject).
    pub reals: Vec<((IpAddr, u16), f64)>,
    /// The virtual server's persistence timeout in seconds (ClientIP affinity).
    pub persistence: Option<u32>,
    /// The virtual server, as the trace's list of rules names it.
    pub rule: String,
}

/// What the node holds besides iptables' tables, for a tracer of the ipvs mode: the ipsets
/// `-m set` looks up, and IPVS's virtual servers, which take a packet to a local address after
/// the filter table's `INPUT` (a packet from outside or a pod) or after nat `OUTPUT` (the
/// node's own). Without one ([`IptablesTracer::with_beyond`]), a `-m set` rule fails its trace
/// and nothing is load-balanced by IPVS.
pub trait Beyond: fmt::Debug + Send + Sync + std::panic::RefUnwindSafe {
    /// Whether set `set` holds the packet's fields that `sides` pick, in the set type's order
    /// (a set that does not exist holds nothing).
    fn set_contains(&self, set: &str, sides: &[SetSide], probe: &Probe) -> bool;
    /// The virtual server that takes the packet, if any: by its firewall mark first, then by
    /// its destination, protocol and port.
    fn virtual_server(&self, probe: &Probe) -> Option<Scheduled>;
}

/// A rule-parsing or command failure, before it gets its line number.
#[derive(Debug)]
enum Bad {
    Unsupported(String),
    Invalid(String),
}

impl Bad {
    fn at(self, line: usize) -> TraceError {
        match self {
            Bad::Unsupported(reason) => TraceError::Unsupported { line, reason },
            Bad::Invalid(reason) => TraceError::Invalid { line, reason },
        }
    }
}

fn unsupported(reason: impl Into<String>) -> Bad {
    Bad::Unsupported(reason.into())
}

fn invalid(reason: impl Into<String>) -> Bad {
    Bad::Invalid(reason.into())
}

/// A netfilter hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hook::Prerouting => "PREROUTING",
            Hook::Input => "INPUT",
            Hook::Forward => "FORWARD",
            Hook::Output => "OUTPUT",
            Hook::Postrouting => "POSTROUTING",
        })
    }
}

/// The built-in chains of a table, with their hooks.
fn builtins(table: Tbl) -> &'static [Hook] {
    match table {
        Tbl::Filter => &[Hook::Input, Hook::Forward, Hook::Output],
        Tbl::Mangle => &[
            Hook::Prerouting,
            Hook::Input,
            Hook::Forward,
            Hook::Output,
            Hook::Postrouting,
        ],
        Tbl::Nat => &[
            Hook::Prerouting,
            Hook::Input,
            Hook::Output,
            Hook::Postrouting,
        ],
    }
}

fn is_builtin(table: Tbl, name: &str) -> bool {
    builtins(table).iter().any(|h| h.to_string() == name)
}

// Conntrack states, as bits of a `--ctstate` list.
const CT_INVALID: u8 = 1;
const CT_NEW: u8 = 2;
const CT_ESTABLISHED: u8 = 4;
const CT_RELATED: u8 = 8;
const CT_UNTRACKED: u8 = 16;
const CT_SNAT: u8 = 32;
const CT_DNAT: u8 = 64;

/// One match of a rule. Rules compare equal (for `-D`) when their matches and target do.
#[derive(Clone, Debug, PartialEq)]
enum Match {
    Src {
        net: IpNet,
        neg: bool,
    },
    Dst {
        net: IpNet,
        neg: bool,
    },
    Proto {
        proto: Protocol,
        neg: bool,
    },
    Port {
        dst: bool,
        lo: u16,
        hi: u16,
        neg: bool,
    },
    Comment(String),
    /// `-i NAME`, or `-i NAME+` (`prefix`): the interface the packet arrived on.
    InIface {
        name: String,
        prefix: bool,
        neg: bool,
    },
    LocalAddr {
        dst: bool,
        neg: bool,
    },
    Statistic {
        probability: f64,
    },
    RecentCheck {
        name: String,
        seconds: u32,
    },
    RecentSet {
        name: String,
    },
    Mark {
        value: u32,
        mask: u32,
        neg: bool,
    },
    CtState {
        states: u8,
        neg: bool,
    },
    /// `-m set --match-set NAME dst,dst,...`, looked up in the tracer's [`Beyond`].
    Set {
        name: String,
        sides: Vec<SetSide>,
        neg: bool,
    },
    /// `-m physdev --physdev-is-in`: the packet came in through a bridge port. The tracer's
    /// node has no bridge, so it never did.
    PhysdevIsIn {
        neg: bool,
    },
}

/// What a rule does when it matches.
#[derive(Clone, Debug, PartialEq)]
enum Target {
    /// No `-j`: the rule only counts.
    None,
    Jump(String),
    Goto(String),
    Accept,
    Drop,
    Return,
    Reject,
    Dnat {
        ip: IpAddr,
        port: Option<u16>,
    },
    /// `mark = (mark & !mask) ^ value`, the kernel's `--set-xmark`.
    Mark {
        value: u32,
        mask: u32,
    },
    Masquerade,
}

/// A parsed rule.
#[derive(Clone, Debug, PartialEq)]
struct Spec {
    matches: Vec<Match>,
    target: Target,
}

impl Spec {
    fn chain_ref(&self) -> Option<&str> {
        match &self.target {
            Target::Jump(c) | Target::Goto(c) => Some(c),
            _ => None,
        }
    }
}

/// One chain: its rules as text (for [`IptablesTracer::chain`]) and parsed, in step.
#[derive(Clone, Debug, Default)]
struct Chain {
    builtin: bool,
    policy_drop: bool,
    texts: Vec<String>,
    specs: Vec<Spec>,
}

/// One table of one family.
#[derive(Clone, Debug)]
struct TableModel {
    table: Tbl,
    /// Chains are shared between copies until written, so staging an input is cheap.
    chains: HashMap<String, Arc<Chain>>,
    /// How many rules jump or go to each chain.
    refs: HashMap<String, usize>,
}

impl TableModel {
    fn new(table: Tbl) -> Self {
        let chains = builtins(table)
            .iter()
            .map(|h| {
                (
                    h.to_string(),
                    Arc::new(Chain {
                        builtin: true,
                        ..Chain::default()
                    }),
                )
            })
            .collect();
        TableModel {
            table,
            chains,
            refs: HashMap::new(),
        }
    }

    fn chain_mut(&mut self, name: &str) -> Result<&mut Chain, Bad> {
        self.chains
            .get_mut(name)
            .map(Arc::make_mut)
            .ok_or_else(|| invalid(format!("no chain {name} in table {}", self.table.as_str())))
    }

    fn add_ref(&mut self, spec: &Spec) {
        if let Some(c) = spec.chain_ref() {
            *self.refs.entry(c.to_string()).or_default() += 1;
        }
    }

    fn drop_ref(&mut self, spec: &Spec) {
        if let Some(c) = spec.chain_ref() {
            if let Some(n) = self.refs.get_mut(c) {
                *n -= 1;
                if *n == 0 {
                    self.refs.remove(c);
                }
            }
        }
    }

    /// Inserts at 0-based `pos`, or appends.
    fn insert(
        &mut self,
        chain: &str,
        pos: Option<usize>,
        text: String,
        spec: Spec,
    ) -> Result<(), Bad> {
        let c = self.chain_mut(chain)?;
        let pos = pos.unwrap_or(c.specs.len());
        if pos > c.specs.len() {
            return Err(invalid(format!(
                "index of insertion too big: {} (chain {chain} has {} rules)",
                pos + 1,
                c.specs.len()
            )));
        }
        c.texts.insert(pos, text);
        c.specs.insert(pos, spec.clone());
        self.add_ref(&spec);
        Ok(())
    }

    fn delete_at(&mut self, chain: &str, pos: usize) -> Result<(), Bad> {
        let c = self.chain_mut(chain)?;
        if pos >= c.specs.len() {
            return Err(invalid(format!(
                "index of deletion too big: {} (chain {chain} has {} rules)",
                pos + 1,
                c.specs.len()
            )));
        }
        c.texts.remove(pos);
        let spec = c.specs.remove(pos);
        self.drop_ref(&spec);
        Ok(())
    }

    fn delete_matching(&mut self, chain: &str, spec: &Spec) -> Result<(), Bad> {
        let c = self.chain_mut(chain)?;
        let pos = c.specs.iter().position(|s| s == spec).ok_or_else(|| {
            invalid(format!(
                "bad rule (does a matching rule exist in chain {chain}?)"
            ))
        })?;
        self.delete_at(chain, pos)
    }

    fn flush(&mut self, chain: &str) -> Result<(), Bad> {
        let c = self.chain_mut(chain)?;
        c.texts.clear();
        let specs = std::mem::take(&mut c.specs);
        for s in &specs {
            self.drop_ref(s);
        }
        Ok(())
    }

    fn create(&mut self, name: &str) -> Result<(), Bad> {
        check_chain_name(name)?;
        if self.chains.contains_key(name) {
            return Err(invalid(format!("chain {name} already exists")));
        }
        self.chains
            .insert(name.to_string(), Arc::new(Chain::default()));
        Ok(())
    }

    fn delete_chain(&mut self, name: &str) -> Result<(), Bad> {
        let c = self
            .chains
            .get(name)
            .ok_or_else(|| invalid(format!("cannot delete chain {name}: no such chain")))?;
        if c.builtin {
            return Err(invalid(format!("cannot delete built-in chain {name}")));
        }
        if !c.specs.is_empty() {
            return Err(invalid(format!(
                "cannot delete chain {name}: it has {} rules (flush it first)",
                c.specs.len()
            )));
        }
        if let Some(n) = self.refs.get(name) {
            return Err(invalid(format!(
                "cannot delete chain {name}: {n} rules still jump to it"
            )));
        }
        self.chains.remove(name);
        Ok(())
    }

    fn set_policy(&mut self, name: &str, policy: &str) -> Result<(), Bad> {
        let table = self.table;
        let c = self.chain_mut(name)?;
        if !c.builtin {
            return Err(invalid(format!(
                "cannot set a policy on user-defined chain {name}"
            )));
        }
        match policy {
            "ACCEPT" => c.policy_drop = false,
            "DROP" => c.policy_drop = true,
            p => {
                return Err(invalid(format!(
                    "bad policy {p} for {name} in the {} table",
                    table.as_str()
                )))
            }
        }
        Ok(())
    }

    /// `:NAME POLICY [packets:bytes]`. With `--noflush`, a user chain is flushed (or created);
    /// a built-in chain only takes the policy (`-` keeps it).
    fn declare(&mut self, decl: &str) -> Result<(), Bad> {
        let words: Vec<&str> = decl.split_whitespace().collect();
        let (name, policy) = match words.as_slice() {
            [name, policy] => (*name, *policy),
            [name, policy, counters] => {
                check_counters(counters)?;
                (*name, *policy)
            }
            _ => return Err(invalid(format!("malformed chain line :{decl}"))),
        };
        if is_builtin(self.table, name) {
            if policy == "-" {
                return Ok(());
            }
            return self.set_policy(name, policy);
        }
        if policy != "-" {
            return Err(invalid(format!(
                "user-defined chain {name} cannot have policy {policy}"
            )));
        }
        if self.chains.contains_key(name) {
            self.flush(name)
        } else {
            self.create(name)
        }
    }

    /// What the kernel checks when a table is committed: every jump lands on a chain, no chain
    /// reaches itself, and NAT targets sit only under hooks that allow them.
    fn check(&self) -> Result<(), Bad> {
        let mut missing: Vec<&String> = self
            .refs
            .keys()
            .filter(|c| !self.chains.contains_key(c.as_str()))
            .collect();
        missing.sort();
        if let Some(target) = missing.first() {
            let from = self
                .chains
                .iter()
                .filter(|(_, c)| {
                    c.specs
                        .iter()
                        .any(|s| s.chain_ref() == Some(target.as_str()))
                })
                .map(|(n, _)| n.as_str())
                .min()
                .unwrap_or("?");
            return Err(invalid(format!(
                "chain {from} jumps to missing chain {target}"
            )));
        }
        for &hook in builtins(self.table) {
            let name = hook.to_string();
            let mut stack = Vec::new();
            let mut done = HashSet::new();
            self.visit(&name, hook, &mut stack, &mut done)?;
        }
        Ok(())
    }

    fn visit<'a>(
        &'a self,
        name: &'a str,
        hook: Hook,
        stack: &mut Vec<&'a str>,
        done: &mut HashSet<&'a str>,
    ) -> Result<(), Bad> {
        if stack.contains(&name) {
            return Err(invalid(format!(
                "jump loop: {} -> {name}",
                stack.join(" -> ")
            )));
        }
        if done.contains(name) {
            return Ok(());
        }
        if stack.len() >= MAX_DEPTH {
            return Err(invalid(format!(
                "chains nested deeper than {MAX_DEPTH} under {hook}"
            )));
        }
        let Some(chain) = self.chains.get(name) else {
            return Ok(());
        };
        stack.push(name);
        for spec in &chain.specs {
            match &spec.target {
                Target::Dnat { .. } if !matches!(hook, Hook::Prerouting | Hook::Output) => {
                    return Err(invalid(format!(
                        "DNAT in chain {name} is reached from {hook}"
                    )));
                }
                Target::Masquerade if hook != Hook::Postrouting => {
                    return Err(invalid(format!(
                        "MASQUERADE in chain {name} is reached from {hook}"
                    )));
                }
                Target::Jump(c) | Target::Goto(c) => self.visit(c, hook, stack, done)?,
                _ => {}
            }
        }
        stack.pop();
        done.insert(name);
        Ok(())
    }
}

/// Whether two parsed rules are the same rule to the kernel: the same target and the same
/// matches in any order (`iptables-save` prints addresses and the protocol first, whatever order
/// they were written in).
fn same_rule(a: &Spec, b: &Spec) -> bool {
    if a.target != b.target || a.matches.len() != b.matches.len() {
        return false;
    }
    let mut left: Vec<&Match> = b.matches.iter().collect();
    a.matches
        .iter()
        .all(|m| match left.iter().position(|o| *o == m) {
            Some(i) => {
                left.swap_remove(i);
                true
            }
            None => false,
        })
}

fn check_chain_name(name: &str) -> Result<(), Bad> {
    if name.is_empty() || name.starts_with('-') || name.starts_with('!') {
        return Err(invalid(format!("invalid chain name {name:?}")));
    }
    if name.len() > MAX_CHAIN_NAME {
        return Err(invalid(format!(
            "chain name {name} is {} characters; the limit is {MAX_CHAIN_NAME}",
            name.len()
        )));
    }
    if is_target(name) {
        return Err(invalid(format!("chain name {name} clashes with a target")));
    }
    Ok(())
}

fn check_counters(s: &str) -> Result<(), Bad> {
    let ok = s
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .and_then(|s| s.split_once(':'))
        .is_some_and(|(p, b)| p.parse::<u64>().is_ok() && b.parse::<u64>().is_ok());
    if ok {
        Ok(())
    } else {
        Err(invalid(format!("malformed counters {s}")))
    }
}

/// Splits a line into arguments as iptables-restore does: whitespace separates, `"..."` quotes,
/// and inside quotes `\"` and `\\` are escapes.
fn tokenize(line: &str) -> Result<Vec<String>, Bad> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut started = false;
    let mut quoted = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if quoted {
            match c {
                '\\' => match chars.next() {
                    Some(n @ ('"' | '\\')) => cur.push(n),
                    Some(n) => {
                        cur.push('\\');
                        cur.push(n);
                    }
                    None => cur.push('\\'),
                },
                '"' => quoted = false,
                c => cur.push(c),
            }
        } else if c == '"' {
            quoted = true;
            started = true;
        } else if c.is_whitespace() {
            if started {
                out.push(std::mem::take(&mut cur));
                started = false;
            }
        } else {
            cur.push(c);
            started = true;
        }
    }
    if quoted {
        return Err(invalid("unterminated quoted string"));
    }
    if started {
        out.push(cur);
    }
    Ok(out)
}

/// Joins arguments back into rule text, quoting those that need it.
/// Joins arguments back into one rule text the way `iptables-save` prints it: a comment is
/// always quoted, other arguments only when they must be.
fn join(args: &[String]) -> String {
    args.iter()
        .enumerate()
        .map(|(i, a)| {
            let comment = i > 0 && args[i - 1] == "--comment";
            if comment
                || a.is_empty()
                || a.chars()
                    .any(|c| c.is_whitespace() || c == '"' || c == '\\')
            {
                format!("\"{}\"", a.replace('\\', "\\\\").replace('"', "\\\""))
            } else {
                a.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn parse_u32(s: &str) -> Result<u32, Bad> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| invalid(format!("bad number {s}")))
}

/// `VALUE[/MASK]`.
fn parse_mark(s: &str) -> Result<(u32, Option<u32>), Bad> {
    match s.split_once('/') {
        Some((v, m)) => Ok((parse_u32(v)?, Some(parse_u32(m)?))),
        None => Ok((parse_u32(s)?, None)),
    }
}

fn parse_net(s: &str, family: IpFamily) -> Result<IpNet, Bad> {
    if s.contains(',') {
        return Err(unsupported(format!("address list {s}")));
    }
    let net = match s.split_once('/') {
        None => {
            let ip: IpAddr = s
                .parse()
                .map_err(|_| invalid(format!("bad address {s} (host names are not resolved)")))?;
            IpNet::from(ip)
        }
        Some((a, len)) => {
            let ip: IpAddr = a.parse().map_err(|_| invalid(format!("bad address {s}")))?;
            let prefix = match len.parse::<u8>() {
                Ok(p) => p,
                Err(_) => {
                    // A dotted mask: must be contiguous ones.
                    let m: IpAddr = len
                        .parse()
                        .map_err(|_| invalid(format!("bad mask in {s}")))?;
                    ipnet::ip_mask_to_prefix(m).map_err(|_| invalid(format!("bad mask in {s}")))?
                }
            };
            IpNet::new(ip, prefix).map_err(|_| invalid(format!("bad prefix length in {s}")))?
        }
    };
    if IpFamily::of_net(&net) != family {
        return Err(invalid(format!("address {s} is not {}", family.as_str())));
    }
    Ok(net.trunc())
}

fn parse_ports(s: &str) -> Result<(u16, u16), Bad> {
    let port = |p: &str, default: u16| -> Result<u16, Bad> {
        if p.is_empty() {
            return Ok(default);
        }
        p.parse()
            .map_err(|_| invalid(format!("bad port {p} (service names are not resolved)")))
    };
    let (lo, hi) = match s.split_once(':') {
        Some((a, b)) => (port(a, 0)?, port(b, u16::MAX)?),
        None => {
            let p = port(s, 0)?;
            if s.is_empty() {
                return Err(invalid("empty port"));
            }
            (p, p)
        }
    };
    if lo > hi {
        return Err(invalid(format!("bad port range {s}")));
    }
    Ok((lo, hi))
}

fn parse_protocol(s: &str) -> Result<Protocol, Bad> {
    Protocol::ALL
        .into_iter()
        .find(|p| p.as_lower() == s.to_ascii_lowercase())
        .ok_or_else(|| unsupported(format!("protocol {s}")))
}

fn parse_ctstates(s: &str) -> Result<u8, Bad> {
    let mut bits = 0;
    for st in s.split(',') {
        bits |= match st {
            "INVALID" => CT_INVALID,
            "NEW" => CT_NEW,
            "ESTABLISHED" => CT_ESTABLISHED,
            "RELATED" => CT_RELATED,
            "UNTRACKED" => CT_UNTRACKED,
            "SNAT" => CT_SNAT,
            "DNAT" => CT_DNAT,
            other => return Err(invalid(format!("bad ctstate {other}"))),
        };
    }
    Ok(bits)
}

/// `IP`, `IP:PORT`, `[IPv6]`, `[IPv6]:PORT`, or a bare IPv6 address.
fn parse_dnat(s: &str, family: IpFamily) -> Result<(IpAddr, Option<u16>), Bad> {
    if s.contains('-') {
        return Err(unsupported(format!("DNAT range {s}")));
    }
    let (addr, port) = if let Some(rest) = s.strip_prefix('[') {
        let (a, after) = rest
            .split_once(']')
            .ok_or_else(|| invalid(format!("bad DNAT destination {s}")))?;
        match after {
            "" => (a, None),
            p => (
                a,
                Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| invalid(format!("bad DNAT destination {s}")))?,
                ),
            ),
        }
    } else if family == IpFamily::V4 {
        match s.split_once(':') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        }
    } else {
        (s, None)
    };
    let ip: IpAddr = addr
        .parse()
        .map_err(|_| invalid(format!("bad DNAT address in {s}")))?;
    if IpFamily::of(&ip) != family {
        return Err(invalid(format!(
            "DNAT destination {s} is not {}",
            family.as_str()
        )));
    }
    let port = match port {
        None => None,
        Some(p) => {
            let n: u16 = p
                .parse()
                .map_err(|_| invalid(format!("bad DNAT port in {s}")))?;
            if n == 0 {
                return Err(invalid(format!("DNAT port 0 in {s}")));
            }
            Some(n)
        }
    };
    Ok((ip, port))
}

fn check_reject_with(s: &str, family: IpFamily) -> Result<(), Bad> {
    let known: &[&str] = match family {
        IpFamily::V4 => &[
            "icmp-net-unreachable",
            "net-unreach",
            "icmp-host-unreachable",
            "host-unreach",
            "icmp-port-unreachable",
            "port-unreach",
            "icmp-proto-unreachable",
            "proto-unreach",
            "icmp-net-prohibited",
            "net-prohib",
            "icmp-host-prohibited",
            "host-prohib",
            "icmp-admin-prohibited",
            "admin-prohib",
            "tcp-reset",
        ],
        IpFamily::V6 => &[
            "icmp6-no-route",
            "no-route",
            "icmp6-adm-prohibited",
            "adm-prohibited",
            "icmp6-addr-unreachable",
            "addr-unreach",
            "icmp6-port-unreachable",
            "port-unreach",
            "icmp6-policy-fail",
            "policy-fail",
            "icmp6-reject-route",
            "reject-route",
            "tcp-reset",
        ],
    };
    if known.contains(&s) {
        Ok(())
    } else {
        Err(invalid(format!(
            "bad --reject-with {s} for {}",
            family.as_str()
        )))
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct PortRange {
    lo: u16,
    hi: u16,
    neg: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum RecentAction {
    /// `--rcheck`: is the client on the list?
    Check,
    /// `--update`: `--rcheck`, and refresh the client's entry when it is.
    Update,
    /// `--set`: add the client (always matches).
    Set,
}

/// A loaded match module, collecting its options.
#[derive(Debug)]
enum Module {
    Ports {
        proto: Protocol,
        dport: Option<PortRange>,
        sport: Option<PortRange>,
    },
    Comment(Option<String>),
    AddrType {
        src: Option<bool>,
        dst: Option<bool>,
    },
    Statistic {
        random: bool,
        probability: Option<f64>,
    },
    Recent {
        name: Option<String>,
        action: Option<RecentAction>,
        seconds: Option<u32>,
        reap: bool,
    },
    Mark(Option<(u32, u32, bool)>),
    Conntrack(Option<(u8, bool)>),
    Set(Option<(String, Vec<SetSide>, bool)>),
    Physdev(Option<bool>),
}

/// A target, collecting its options.
#[derive(Debug)]
enum TargetState {
    Chain { name: String, goto: bool },
    Accept,
    Drop,
    Return,
    Reject { with: Option<String> },
    Dnat { to: Option<(IpAddr, Option<u16>)> },
    Mark { op: Option<(u32, u32)> },
    Masquerade,
}

/// How many arguments an option took, if the module or target knew it.
enum Claim {
    No,
    Took(usize),
}

fn value<'a>(opt: &str, next: Option<&'a str>) -> Result<&'a str, Bad> {
    next.ok_or_else(|| invalid(format!("option {opt} requires a value")))
}

fn no_neg(opt: &str, neg: bool) -> Result<(), Bad> {
    if neg {
        Err(invalid(format!("option {opt} cannot be negated")))
    } else {
        Ok(())
    }
}

fn once<T>(slot: &mut Option<T>, v: T, opt: &str) -> Result<(), Bad> {
    if slot.is_some() {
        return Err(invalid(format!("option {opt} given twice")));
    }
    *slot = Some(v);
    Ok(())
}

fn claim_module(
    m: &mut Module,
    opt: &str,
    next: Option<&str>,
    neg: bool,
    family: IpFamily,
) -> Result<Claim, Bad> {
    match m {
        Module::Ports { dport, sport, .. } => match opt {
            "--dport" | "--destination-port" | "--sport" | "--source-port" => {
                let (lo, hi) = parse_ports(value(opt, next)?)?;
                let is_dst = matches!(opt, "--dport" | "--destination-port");
                let slot = if is_dst { dport } else { sport };
                once(slot, PortRange { lo, hi, neg }, opt)?;
                Ok(Claim::Took(2))
            }
            "--tcp-flags" | "--syn" | "--tcp-option" | "--chunk-types" => {
                Err(unsupported(format!("option {opt}")))
            }
            _ => Ok(Claim::No),
        },
        Module::Comment(c) => match opt {
            "--comment" => {
                no_neg(opt, neg)?;
                let v = value(opt, next)?;
                if v.len() > MAX_COMMENT {
                    return Err(invalid(format!(
                        "comment is {} bytes; the limit is {MAX_COMMENT}",
                        v.len()
                    )));
                }
                once(c, v.to_string(), opt)?;
                Ok(Claim::Took(2))
            }
            _ => Ok(Claim::No),
        },
        Module::AddrType { src, dst } => match opt {
            "--src-type" | "--dst-type" => {
                let v = value(opt, next)?;
                if v != "LOCAL" {
                    return Err(unsupported(format!("address type {v}")));
                }
                let slot = if opt == "--src-type" { src } else { dst };
                once(slot, neg, opt)?;
                Ok(Claim::Took(2))
            }
            "--limit-iface-in" | "--limit-iface-out" => Err(unsupported(format!("option {opt}"))),
            _ => Ok(Claim::No),
        },
        Module::Statistic {
            random,
            probability,
        } => match opt {
            "--mode" => {
                no_neg(opt, neg)?;
                match value(opt, next)? {
                    "random" => *random = true,
                    "nth" => return Err(unsupported("statistic mode nth")),
                    v => return Err(invalid(format!("bad statistic mode {v}"))),
                }
                Ok(Claim::Took(2))
            }
            "--probability" => {
                let v = value(opt, next)?;
                let p: f64 = v
                    .parse()
                    .ok()
                    .filter(|p: &f64| (0.0..=1.0).contains(p))
                    .ok_or_else(|| invalid(format!("bad probability {v}")))?;
                once(probability, if neg { 1.0 - p } else { p }, opt)?;
                Ok(Claim::Took(2))
            }
            "--every" | "--packet" => Err(unsupported(format!("option {opt}"))),
            _ => Ok(Claim::No),
        },
        Module::Recent {
            name,
            action,
            seconds,
            reap,
        } => {
            let known = [
                "--name",
                "--rcheck",
                "--update",
                "--set",
                "--seconds",
                "--reap",
                "--mask",
                "--rsource",
            ];
            if neg && known.contains(&opt) {
                return Err(unsupported(format!("negated recent option {opt}")));
            }
            match opt {
                "--name" => {
                    let v = value(opt, next)?;
                    if v.is_empty() || v.len() > MAX_RECENT_NAME {
                        return Err(invalid(format!("bad recent list name {v:?}")));
                    }
                    once(name, v.to_string(), opt)?;
                    Ok(Claim::Took(2))
                }
                "--rcheck" | "--update" | "--set" => {
                    let a = match opt {
                        "--set" => RecentAction::Set,
                        "--update" => RecentAction::Update,
                        _ => RecentAction::Check,
                    };
                    if action.is_some() {
                        return Err(invalid(
                            "recent takes only one of --set, --rcheck, --update, --remove",
                        ));
                    }
                    *action = Some(a);
                    Ok(Claim::Took(1))
                }
                "--seconds" => {
                    let v = value(opt, next)?;
                    let s = v
                        .parse()
                        .map_err(|_| invalid(format!("bad --seconds {v}")))?;
                    once(seconds, s, opt)?;
                    Ok(Claim::Took(2))
                }
                "--reap" => {
                    *reap = true;
                    Ok(Claim::Took(1))
                }
                "--mask" => {
                    let v = value(opt, next)?;
                    let m: IpAddr = v
                        .parse()
                        .map_err(|_| invalid(format!("bad recent mask {v}")))?;
                    if IpFamily::of(&m) != family {
                        return Err(invalid(format!(
                            "recent mask {v} is not {}",
                            family.as_str()
                        )));
                    }
                    Ok(Claim::Took(2))
                }
                "--rsource" => Ok(Claim::Took(1)),
                "--rdest" | "--remove" | "--hitcount" | "--rttl" => {
                    Err(unsupported(format!("recent option {opt}")))
                }
                _ => Ok(Claim::No),
            }
        }
        Module::Mark(slot) => match opt {
            "--mark" => {
                let (v, m) = parse_mark(value(opt, next)?)?;
                once(slot, (v, m.unwrap_or(u32::MAX), neg), opt)?;
                Ok(Claim::Took(2))
            }
            _ => Ok(Claim::No),
        },
        Module::Conntrack(slot) => match opt {
            "--ctstate" => {
                let bits = parse_ctstates(value(opt, next)?)?;
                once(slot, (bits, neg), opt)?;
                Ok(Claim::Took(2))
            }
            o if o.starts_with("--ct") => Err(unsupported(format!("conntrack option {o}"))),
            _ => Ok(Claim::No),
        },
        Module::Set(_) => match opt {
            "--return-nomatch"
            | "--update-counters"
            | "--update-subcounters"
            | "--packets-eq"
            | "--packets-lt"
            | "--packets-gt"
            | "--bytes-eq"
            | "--bytes-lt"
            | "--bytes-gt" => Err(unsupported(format!("set option {opt}"))),
            _ => Ok(Claim::No),
        },
        Module::Physdev(slot) => match opt {
            "--physdev-is-in" => {
                once(slot, neg, opt)?;
                Ok(Claim::Took(1))
            }
            o if o.starts_with("--physdev") => Err(unsupported(format!("physdev option {o}"))),
            _ => Ok(Claim::No),
        },
    }
}

fn claim_target(
    t: &mut TargetState,
    opt: &str,
    next: Option<&str>,
    neg: bool,
    family: IpFamily,
) -> Result<Claim, Bad> {
    let claim = match t {
        TargetState::Reject { with } => match opt {
            "--reject-with" => {
                let v = value(opt, next)?;
                check_reject_with(v, family)?;
                once(with, v.to_string(), opt)?;
                Claim::Took(2)
            }
            _ => Claim::No,
        },
        TargetState::Dnat { to } => match opt {
            "--to-destination" => {
                let d = parse_dnat(value(opt, next)?, family)?;
                once(to, d, opt)?;
                Claim::Took(2)
            }
            "--random" | "--persistent" | "--random-fully" => {
                return Err(unsupported(format!("DNAT option {opt}")))
            }
            _ => Claim::No,
        },
        TargetState::Mark { op } => {
            let parsed = match opt {
                "--set-xmark" => {
                    let (v, m) = parse_mark(value(opt, next)?)?;
                    Some((v, m.unwrap_or(u32::MAX)))
                }
                "--set-mark" => {
                    let (v, m) = parse_mark(value(opt, next)?)?;
                    Some((v, v | m.unwrap_or(u32::MAX)))
                }
                "--or-mark" => {
                    let v = parse_u32(value(opt, next)?)?;
                    Some((v, v))
                }
                "--and-mark" => {
                    let v = parse_u32(value(opt, next)?)?;
                    Some((0, !v))
                }
                "--xor-mark" => {
                    let v = parse_u32(value(opt, next)?)?;
                    Some((v, 0))
                }
                _ => None,
            };
            match parsed {
                Some(p) => {
                    if op.is_some() {
                        return Err(invalid("MARK takes only one operation"));
                    }
                    *op = Some(p);
                    Claim::Took(2)
                }
                None => Claim::No,
            }
        }
        TargetState::Masquerade => match opt {
            "--random-fully" | "--random" => Claim::Took(1),
            "--to-ports" => return Err(unsupported("MASQUERADE --to-ports")),
            _ => Claim::No,
        },
        _ => Claim::No,
    };
    if matches!(claim, Claim::Took(_)) {
        no_neg(opt, neg)?;
    }
    Ok(claim)
}

/// Parses the arguments of a rule (what follows `-A CHAIN`).
fn parse_rule(family: IpFamily, table: Tbl, args: &[String]) -> Result<Spec, Bad> {
    let mut src: Option<Match> = None;
    let mut dst: Option<Match> = None;
    let mut in_iface: Option<Match> = None;
    let mut proto: Option<(Protocol, bool)> = None;
    let mut modules: Vec<Module> = Vec::new();
    let mut target: Option<TargetState> = None;
    let mut neg = false;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        let next = args.get(i + 1).map(String::as_str);
        if a == "!" {
            if neg {
                return Err(invalid("double negation"));
            }
            neg = true;
            i += 1;
            continue;
        }
        let was_neg = std::mem::take(&mut neg);
        match a {
            "-s" | "--source" | "--src" | "-d" | "--destination" | "--dst" => {
                let net = parse_net(value(a, next)?, family)?;
                if was_neg && net.prefix_len() == 0 {
                    // iptables-legacy takes it (a match that never matches); iptables-nft
                    // refuses it: RULE_APPEND failed (Invalid argument).
                    return Err(invalid(format!(
                        "! {a} {net}: iptables-nft refuses a negated zero-length prefix"
                    )));
                }
                let (slot, m) = if a.starts_with("-s") || a.starts_with("--s") {
                    (&mut src, Match::Src { net, neg: was_neg })
                } else {
                    (&mut dst, Match::Dst { net, neg: was_neg })
                };
                once(slot, m, a)?;
                i += 2;
            }
            "-p" | "--protocol" => {
                let p = parse_protocol(value(a, next)?)?;
                once(&mut proto, (p, was_neg), a)?;
                i += 2;
            }
            "-m" | "--match" => {
                no_neg(a, was_neg)?;
                let m = match value(a, next)? {
                    "tcp" => Module::Ports {
                        proto: Protocol::Tcp,
                        dport: None,
                        sport: None,
                    },
                    "udp" => Module::Ports {
                        proto: Protocol::Udp,
                        dport: None,
                        sport: None,
                    },
                    "sctp" => Module::Ports {
                        proto: Protocol::Sctp,
                        dport: None,
                        sport: None,
                    },
                    "comment" => Module::Comment(None),
                    "addrtype" => Module::AddrType {
                        src: None,
                        dst: None,
                    },
                    "statistic" => Module::Statistic {
                        random: false,
                        probability: None,
                    },
                    "recent" => Module::Recent {
                        name: None,
                        action: None,
                        seconds: None,
                        reap: false,
                    },
                    "mark" => Module::Mark(None),
                    "conntrack" => Module::Conntrack(None),
                    "set" => Module::Set(None),
                    "physdev" => Module::Physdev(None),
                    other => return Err(unsupported(format!("match -m {other}"))),
                };
                modules.push(m);
                i += 2;
            }
            "-j" | "--jump" | "-g" | "--goto" => {
                no_neg(a, was_neg)?;
                if target.is_some() {
                    return Err(invalid("more than one target"));
                }
                let goto = a == "-g" || a == "--goto";
                let name = value(a, next)?;
                let t = match name {
                    _ if goto => {
                        if is_target(name) {
                            return Err(invalid(format!("-g needs a chain, not {name}")));
                        }
                        check_chain_name(name)?;
                        TargetState::Chain {
                            name: name.to_string(),
                            goto,
                        }
                    }
                    "ACCEPT" => TargetState::Accept,
                    "DROP" => TargetState::Drop,
                    "RETURN" => TargetState::Return,
                    "REJECT" => TargetState::Reject { with: None },
                    "DNAT" => TargetState::Dnat { to: None },
                    "MARK" => TargetState::Mark { op: None },
                    "MASQUERADE" => TargetState::Masquerade,
                    n if OTHER_TARGETS.contains(&n) => {
                        return Err(unsupported(format!("target {n}")))
                    }
                    n => {
                        check_chain_name(n)?;
                        TargetState::Chain {
                            name: n.to_string(),
                            goto,
                        }
                    }
                };
                target = Some(t);
                i += 2;
            }
            "-i" | "--in-interface" => {
                let v = value(a, next)?;
                let (name, prefix) = match v.strip_suffix('+') {
                    Some(n) => (n, true),
                    None => (v, false),
                };
                // IFNAMSIZ: 15 bytes and the NUL, the `+` counted.
                if name.is_empty() || v.len() > 15 || name.contains('+') {
                    return Err(invalid(format!("-i {v}: not an interface name")));
                }
                if in_iface.is_some() {
                    return Err(invalid("-i given twice"));
                }
                in_iface = Some(Match::InIface {
                    name: name.to_string(),
                    prefix,
                    neg: was_neg,
                });
                i += 2;
            }
            "-o" | "--out-interface" | "-f" | "--fragment" | "-c" | "--set-counters" | "-4"
            | "-6" | "--ipv4" | "--ipv6" => {
                return Err(unsupported(format!("option {a}")));
            }
            "-t" | "--table" => {
                return Err(invalid(
                    "-t cannot be used inside an iptables-restore table",
                ));
            }
            // `--match-set NAME DIRECTIONS`: two values, which no other option takes.
            "--match-set" => {
                let Some(Module::Set(slot)) = modules
                    .iter_mut()
                    .rev()
                    .find(|m| matches!(m, Module::Set(_)))
                else {
                    return Err(invalid("--match-set needs -m set"));
                };
                let name = value(a, next)?;
                if name.is_empty() || name.len() > MAX_IPSET_NAME {
                    return Err(invalid(format!("bad set name {name:?}")));
                }
                let flags = value(a, args.get(i + 2).map(String::as_str))?;
                let sides = flags
                    .split(',')
                    .map(|f| match f {
                        "src" => Ok(SetSide::Src),
                        "dst" => Ok(SetSide::Dst),
                        _ => Err(invalid(format!(
                            "--match-set {name} {flags}: bad direction {f:?}"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if sides.len() > 6 {
                    return Err(invalid(format!(
                        "--match-set {name} {flags}: too many directions"
                    )));
                }
                once(slot, (name.to_string(), sides, was_neg), a)?;
                i += 3;
            }
            opt if opt.starts_with("--") => {
                let mut took = match target.as_mut() {
                    Some(t) => claim_target(t, opt, next, was_neg, family)?,
                    None => Claim::No,
                };
                if matches!(took, Claim::No) {
                    for m in modules.iter_mut().rev() {
                        took = claim_module(m, opt, next, was_neg, family)?;
                        if matches!(took, Claim::Took(_)) {
                            break;
                        }
                    }
                }
                if matches!(took, Claim::No) {
                    // iptables loads the protocol's match on its own for its options, once
                    // `-p` has named the protocol.
                    let implicit = matches!(
                        opt,
                        "--dport" | "--destination-port" | "--sport" | "--source-port"
                    ) && !modules.iter().any(|m| matches!(m, Module::Ports { .. }));
                    if let (true, Some((p, false))) = (implicit, proto) {
                        let mut m = Module::Ports {
                            proto: p,
                            dport: None,
                            sport: None,
                        };
                        took = claim_module(&mut m, opt, next, was_neg, family)?;
                        modules.push(m);
                    }
                }
                match took {
                    Claim::Took(n) => i += n,
                    Claim::No => return Err(unsupported(format!("option {opt}"))),
                }
            }
            other => return Err(invalid(format!("unexpected argument {other:?}"))),
        }
    }
    if neg {
        return Err(invalid("trailing !"));
    }

    let mut matches: Vec<Match> = src.into_iter().chain(dst).chain(in_iface).collect();
    if let Some((proto, neg)) = proto {
        matches.push(Match::Proto { proto, neg });
    }
    let plain_proto = |p: Protocol| proto == Some((p, false));
    for m in modules {
        match m {
            Module::Ports {
                proto: p,
                dport,
                sport,
            } => {
                if !plain_proto(p) {
                    return Err(invalid(format!("-m {0} needs -p {0}", p.as_lower())));
                }
                for (dst, r) in [(false, sport), (true, dport)] {
                    if let Some(r) = r {
                        matches.push(Match::Port {
                            dst,
                            lo: r.lo,
                            hi: r.hi,
                            neg: r.neg,
                        });
                    }
                }
            }
            Module::Comment(c) => {
                matches.push(Match::Comment(
                    c.ok_or_else(|| invalid("-m comment needs --comment"))?,
                ));
            }
            Module::AddrType { src, dst } => {
                if src.is_none() && dst.is_none() {
                    return Err(invalid("-m addrtype needs --src-type or --dst-type"));
                }
                if let Some(neg) = src {
                    matches.push(Match::LocalAddr { dst: false, neg });
                }
                if let Some(neg) = dst {
                    matches.push(Match::LocalAddr { dst: true, neg });
                }
            }
            Module::Statistic {
                random,
                probability,
            } => {
                let (true, Some(probability)) = (random, probability) else {
                    return Err(invalid("-m statistic needs --mode random --probability P"));
                };
                matches.push(Match::Statistic { probability });
            }
            Module::Recent {
                name,
                action,
                seconds,
                reap,
            } => {
                let name = name.unwrap_or_else(|| "DEFAULT".to_string());
                if reap && seconds.is_none() {
                    return Err(invalid("recent --reap needs --seconds"));
                }
                match action {
                    // The first connection of a client, which is all a trace follows: an update
                    // finds it on no list, like a check.
                    Some(RecentAction::Check | RecentAction::Update) => {
                        let seconds = seconds.ok_or_else(|| {
                            unsupported("recent --rcheck/--update without --seconds (no expiry)")
                        })?;
                        matches.push(Match::RecentCheck { name, seconds });
                    }
                    Some(RecentAction::Set) => {
                        if seconds.is_some() {
                            return Err(invalid(
                                "recent --seconds goes with --rcheck or --update, not --set",
                            ));
                        }
                        matches.push(Match::RecentSet { name });
                    }
                    None => return Err(invalid("-m recent needs --set, --rcheck or --update")),
                }
            }
            Module::Mark(m) => {
                let (value, mask, neg) = m.ok_or_else(|| invalid("-m mark needs --mark"))?;
                matches.push(Match::Mark { value, mask, neg });
            }
            Module::Conntrack(c) => {
                let (states, neg) = c.ok_or_else(|| invalid("-m conntrack needs --ctstate"))?;
                matches.push(Match::CtState { states, neg });
            }
            Module::Set(m) => {
                let (name, sides, neg) = m.ok_or_else(|| invalid("-m set needs --match-set"))?;
                matches.push(Match::Set { name, sides, neg });
            }
            Module::Physdev(m) => {
                let neg = m.ok_or_else(|| unsupported("-m physdev without --physdev-is-in"))?;
                matches.push(Match::PhysdevIsIn { neg });
            }
        }
    }

    let has_ports = Protocol::ALL.into_iter().any(plain_proto);
    let target = match target {
        None => Target::None,
        Some(TargetState::Chain { name, goto: false }) => Target::Jump(name),
        Some(TargetState::Chain { name, goto: true }) => Target::Goto(name),
        Some(TargetState::Accept) => Target::Accept,
        Some(TargetState::Return) => Target::Return,
        Some(TargetState::Drop) => {
            if table == Tbl::Nat {
                return Err(invalid("DROP is not allowed in the nat table"));
            }
            Target::Drop
        }
        Some(TargetState::Reject { with }) => {
            if table != Tbl::Filter {
                return Err(invalid("REJECT is only valid in the filter table"));
            }
            if with.as_deref() == Some("tcp-reset") && !plain_proto(Protocol::Tcp) {
                return Err(invalid("REJECT --reject-with tcp-reset needs -p tcp"));
            }
            Target::Reject
        }
        Some(TargetState::Dnat { to }) => {
            if table != Tbl::Nat {
                return Err(invalid("DNAT is only valid in the nat table"));
            }
            let (ip, port) = to.ok_or_else(|| invalid("DNAT needs --to-destination"))?;
            if port.is_some() && !has_ports {
                return Err(invalid("DNAT to a port needs -p tcp, -p udp or -p sctp"));
            }
            Target::Dnat { ip, port }
        }
        Some(TargetState::Mark { op }) => {
            let (value, mask) = op.ok_or_else(|| {
                invalid("MARK needs --set-xmark, --set-mark, --or-mark, --and-mark or --xor-mark")
            })?;
            Target::Mark { value, mask }
        }
        Some(TargetState::Masquerade) => {
            if table != Tbl::Nat {
                return Err(invalid("MASQUERADE is only valid in the nat table"));
            }
            Target::Masquerade
        }
    };
    Ok(Spec { matches, target })
}

/// Whether `name` is a target iptables knows, modelled or not.
fn is_target(name: &str) -> bool {
    [
        "ACCEPT",
        "DROP",
        "RETURN",
        "REJECT",
        "DNAT",
        "MARK",
        "MASQUERADE",
    ]
    .contains(&name)
        || OTHER_TARGETS.contains(&name)
}

fn table_index(t: Tbl) -> usize {
    match t {
        Tbl::Filter => 0,
        Tbl::Nat => 1,
        Tbl::Mangle => 2,
    }
}

fn family_index(f: IpFamily) -> usize {
    match f {
        IpFamily::V4 => 0,
        IpFamily::V6 => 1,
    }
}

/// Applies one non-blank, non-comment line to the staged tables of one family.
fn apply_line(
    family: IpFamily,
    staged: &mut [TableModel; 3],
    current: &mut Option<Tbl>,
    l: &str,
) -> Result<(), Bad> {
    if let Some(name) = l.strip_prefix('*') {
        if let Some(t) = current {
            return Err(invalid(format!(
                "table {} is not committed before *{name}",
                t.as_str()
            )));
        }
        *current = Some(match name.trim() {
            "filter" => Tbl::Filter,
            "nat" => Tbl::Nat,
            "mangle" => Tbl::Mangle,
            other => return Err(unsupported(format!("table {other}"))),
        });
        return Ok(());
    }
    if l == "COMMIT" {
        let t = current
            .take()
            .ok_or_else(|| invalid("COMMIT outside a table"))?;
        return staged[table_index(t)].check();
    }
    let Some(table) = *current else {
        return Err(invalid(format!("line outside a table: {l}")));
    };
    let model = &mut staged[table_index(table)];
    if let Some(decl) = l.strip_prefix(':') {
        return model.declare(decl);
    }
    let mut toks = tokenize(l)?;
    if toks.first().is_some_and(|t| t.starts_with('[')) {
        check_counters(&toks[0])?;
        toks.remove(0);
    }
    let cmd = toks.first().map(String::as_str).unwrap_or("");
    let chain = toks.get(1).map(String::as_str);
    let need_chain = || chain.ok_or_else(|| invalid(format!("{cmd} needs a chain")));
    let no_more = |n: usize| {
        if toks.len() > n {
            Err(invalid(format!("unexpected argument {:?}", toks[n])))
        } else {
            Ok(())
        }
    };
    match cmd {
        "-A" | "--append" => {
            let chain = need_chain()?;
            let args = &toks[2..];
            let spec = parse_rule(family, table, args)?;
            model.insert(chain, None, join(args), spec)
        }
        "-I" | "--insert" => {
            let chain = need_chain()?;
            let (pos, args) = match toks.get(2).map(|t| t.parse::<usize>()) {
                Some(Ok(n)) if n >= 1 => (n - 1, &toks[3..]),
                Some(Ok(_)) => return Err(invalid("rule numbers start at 1")),
                _ => (0, &toks[2..]),
            };
            let spec = parse_rule(family, table, args)?;
            model.insert(chain, Some(pos), join(args), spec)
        }
        "-D" | "--delete" => {
            let chain = need_chain()?;
            match toks.get(2).map(|t| t.parse::<usize>()) {
                Some(Ok(n)) if toks.len() == 3 => {
                    if n == 0 {
                        return Err(invalid("rule numbers start at 1"));
                    }
                    model.delete_at(chain, n - 1)
                }
                _ => {
                    let spec = parse_rule(family, table, &toks[2..])?;
                    model.delete_matching(chain, &spec)
                }
            }
        }
        "-F" | "--flush" => match chain {
            Some(c) => {
                no_more(2)?;
                model.flush(c)
            }
            None => {
                let mut names: Vec<String> = model.chains.keys().cloned().collect();
                names.sort();
                names.iter().try_for_each(|c| model.flush(c))
            }
        },
        "-X" | "--delete-chain" => {
            let c = chain.ok_or_else(|| unsupported("-X without a chain"))?;
            no_more(2)?;
            model.delete_chain(c)
        }
        "-N" | "--new-chain" => {
            let c = need_chain()?;
            no_more(2)?;
            model.create(c)
        }
        "-P" | "--policy" => {
            let c = need_chain()?;
            let p = toks.get(2).ok_or_else(|| invalid("-P needs a policy"))?;
            no_more(3)?;
            model.set_policy(c, p)
        }
        other => Err(unsupported(format!("command {other}"))),
    }
}

/// How a chain walk ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    /// Fell off the end or hit RETURN: back to the caller (or the policy, in a built-in chain).
    Return,
    /// Accepted for this table and hook (also after DNAT and MASQUERADE).
    Accept,
    Drop,
    Reject,
}

/// A packet's state along one branch.
#[derive(Clone, Debug)]
struct Walk {
    src: IpAddr,
    dst: IpAddr,
    proto: Protocol,
    sport: u16,
    dport: u16,
    mark: u32,
    dnat: bool,
    masquerade: bool,
    /// The interface the packet arrived on: `None` for the node's own packets, `Some(None)`
    /// when the tracer has no [`Ingress`] to tell (an `-i` match then fails the trace).
    iif: Option<Option<String>>,
    /// `-m recent --rcheck` lists looked up, with their `--seconds`.
    rchecks: Vec<(String, u32)>,
    /// `-m recent --set` lists the client was added to.
    sets: Vec<String>,
    /// The persistence of the IPVS virtual server that took it.
    persistence: Option<u32>,
    probability: f64,
    rules: Vec<String>,
}

impl Walk {
    fn probe(&self) -> Probe {
        Probe {
            src: self.src,
            dst: self.dst,
            protocol: self.proto,
            sport: self.sport,
            dport: self.dport,
            mark: self.mark,
        }
    }

    fn affinity(&self) -> Option<u32> {
        if self.persistence.is_some() {
            return self.persistence;
        }
        self.sets.iter().find_map(|s| {
            self.rchecks
                .iter()
                .find(|(n, _)| n == s)
                .map(|(_, secs)| *secs)
        })
    }
}

/// Counts work, so a pathological table cannot hang a test.
#[derive(Default)]
struct Budget {
    steps: usize,
}

/// How one match tests a walk.
enum Test {
    Yes,
    No,
    /// Matches with this probability.
    Maybe(f64),
}

/// The filter and nat tables of both families, fed with `iptables-restore --noflush` text.
#[derive(Clone, Debug)]
pub struct IptablesTracer {
    local: Vec<IpAddr>,
    /// The node's links, for `-i` matches ([`IptablesTracer::with_ingress`]).
    ingress: Option<Ingress>,
    /// ipsets and IPVS ([`IptablesTracer::with_beyond`]).
    beyond: Option<Arc<dyn Beyond>>,
    /// Indexed by family, then table (filter, nat, mangle).
    tables: [[TableModel; 3]; 2],
}

impl IptablesTracer {
    /// A tracer for a node whose own addresses are `local` (what `-m addrtype --dst-type
    /// LOCAL` matches; loopback is always local). Every table starts with its built-in chains,
    /// empty, policy ACCEPT.
    pub fn new(local: Vec<IpAddr>) -> Self {
        let fresh = || {
            [
                TableModel::new(Tbl::Filter),
                TableModel::new(Tbl::Nat),
                TableModel::new(Tbl::Mangle),
            ]
        };
        IptablesTracer {
            local,
            ingress: None,
            beyond: None,
            tables: [fresh(), fresh()],
        }
    }

    /// The tracer with the node's links, which tell the interface a packet arrives on (what
    /// `-i` matches). Without them, a packet from outside or from a pod that meets an `-i`
    /// match fails its trace.
    pub fn with_ingress(mut self, ingress: Ingress) -> Self {
        self.ingress = Some(ingress);
        self
    }

    /// The tracer with the node's ipsets and IPVS ([`Beyond`]): the ipvs mode's node.
    pub fn with_beyond(mut self, beyond: Arc<dyn Beyond>) -> Self {
        self.beyond = Some(beyond);
        self
    }

    /// Replays one `iptables-restore --noflush` input for `family`. All or nothing: on error
    /// the tracer is left as it was (iptables-legacy would keep the tables committed before the
    /// failing one; kube-proxy resyncs everything after a failure either way).
    pub fn apply(&mut self, family: IpFamily, text: &str) -> Result<(), TraceError> {
        let fi = family_index(family);
        let mut staged = self.tables[fi].clone();
        let mut current: Option<Tbl> = None;
        let mut last = 0;
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            last = line;
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            apply_line(family, &mut staged, &mut current, l).map_err(|b| b.at(line))?;
        }
        if let Some(t) = current {
            return Err(invalid(format!(
                "table {} is not committed: COMMIT expected",
                t.as_str()
            ))
            .at(last + 1));
        }
        self.tables[fi] = staged;
        Ok(())
    }

    /// The rules of a chain, as the arguments after `-A CHAIN`, or `None` if it does not exist.
    pub fn chain(&self, family: IpFamily, table: Table, name: &str) -> Option<&[String]> {
        self.model(family, table.into())
            .chains
            .get(name)
            .map(|c| c.texts.as_slice())
    }

    /// The policy of built-in chain `name` (`ACCEPT` or `DROP`); `None` for a chain that is
    /// not built-in or does not exist.
    pub fn policy(&self, family: IpFamily, table: Table, name: &str) -> Option<&'static str> {
        let c = self.model(family, table.into()).chains.get(name)?;
        match (c.builtin, c.policy_drop) {
            (false, _) => None,
            (true, false) => Some("ACCEPT"),
            (true, true) => Some("DROP"),
        }
    }

    /// Every chain of a table, built-in ones included, sorted.
    pub fn chain_names(&self, family: IpFamily, table: Table) -> Vec<String> {
        let mut v: Vec<String> = self
            .model(family, table.into())
            .chains
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Every way `packet`'s connection may go.
    pub fn branches(&self, packet: &Packet) -> Result<Vec<Branch>, TraceError> {
        self.branches_inner(packet)
            .map_err(|reason| TraceError::Inconsistent {
                packet: packet.to_string(),
                reason,
            })
    }

    /// What happens to `packet`, or an error when its branches disagree on the kind of
    /// outcome (some translated and some not, some dropped and some rejected, ...).
    ///
    /// When every branch is translated, the verdict lists every endpoint; it is masqueraded
    /// only if every branch is (so a hairpin rule that masquerades one endpoint's branch does
    /// not make the whole Service look masqueraded), and carries the affinity timeout when
    /// every branch has one (the smallest).
    pub fn trace_all(&self, packet: &Packet) -> Result<Verdict, TraceError> {
        let branches = self.branches(packet)?;
        let count = |f: fn(&Outcome) -> bool| branches.iter().filter(|b| f(&b.outcome)).count();
        let dnat = count(|o| matches!(o, Outcome::Dnat(..)));
        let untouched = count(|o| *o == Outcome::Untouched);
        let drop = count(|o| *o == Outcome::Drop);
        let reject = count(|o| *o == Outcome::Reject);
        let n = branches.len();
        if n == 0 {
            return Err(TraceError::Inconsistent {
                packet: packet.to_string(),
                reason: "no branch finished".into(),
            });
        }
        if dnat == n {
            let endpoints = branches
                .iter()
                .filter_map(|b| match b.outcome {
                    Outcome::Dnat(ip, port) => Some((ip, port)),
                    _ => None,
                })
                .collect();
            let masquerade = branches.iter().all(|b| b.masquerade);
            let affinity = if branches.iter().all(|b| b.affinity.is_some()) {
                branches.iter().filter_map(|b| b.affinity).min()
            } else {
                None
            };
            return Ok(Verdict::Dnat {
                endpoints,
                masquerade,
                affinity,
            });
        }
        if untouched == n {
            return Ok(Verdict::Untouched);
        }
        if drop == n {
            return Ok(Verdict::Drop);
        }
        if reject == n {
            return Ok(Verdict::Reject);
        }
        Err(TraceError::Inconsistent {
            packet: packet.to_string(),
            reason: format!(
                "branches disagree: {dnat} translated, {untouched} untouched, {drop} dropped, \
                 {reject} rejected"
            ),
        })
    }

    /// How kube-proxy's chains in this tracer (the kernel's, read with
    /// [`crate::save::kube_rules`]) differ from `planned`'s (what a planner renders), for
    /// `family`: a `KUBE-*` chain missing on either side, or whose rules differ, and the jumps
    /// from the built-in chains into `KUBE-*` chains. Rules are compared as parsed, so the
    /// spellings `iptables-save` prints and the planner's spelling of the same rule are equal.
    /// One line per difference, empty when they agree.
    pub fn differences(&self, planned: &IptablesTracer, family: IpFamily) -> Vec<String> {
        self.differences_of(planned, family, &crate::save::is_kube_chain)
    }

    /// [`IptablesTracer::differences`] over the chains `ours` names (the ipvs mode's own
    /// chains, besides the shared ones), in the filter, nat and mangle tables.
    pub fn differences_of(
        &self,
        planned: &IptablesTracer,
        family: IpFamily,
        ours: &dyn Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for table in [Tbl::Filter, Tbl::Nat, Tbl::Mangle] {
            let (k, p) = (self.model(family, table), planned.model(family, table));
            let mut names: Vec<&String> = k
                .chains
                .keys()
                .chain(p.chains.keys())
                .filter(|n| ours(n) || is_builtin(table, n))
                .collect();
            names.sort();
            names.dedup();
            for name in names {
                let t = table.as_str();
                let (kc, pc) = (k.chains.get(name.as_str()), p.chains.get(name.as_str()));
                let (kc, pc) = match (kc, pc) {
                    (Some(kc), Some(pc)) => (kc, pc),
                    (None, Some(_)) => {
                        out.push(format!("{t} chain {name} is missing from the kernel"));
                        continue;
                    }
                    (Some(_), None) => {
                        out.push(format!("{t} chain {name} is in the kernel but not planned"));
                        continue;
                    }
                    (None, None) => continue,
                };
                let ours = |c: &Chain| -> Vec<(Spec, String)> {
                    c.specs
                        .iter()
                        .zip(&c.texts)
                        .filter(|(s, _)| !c.builtin || s.chain_ref().is_some_and(ours))
                        .map(|(s, t)| (s.clone(), t.clone()))
                        .collect()
                };
                let (kr, mut pr) = (ours(kc), ours(pc));
                if kc.builtin {
                    // The jumps into kube-proxy's chains, whatever their order among
                    // themselves and other programs' rules.
                    let mut extra = Vec::new();
                    for (ks, kt) in kr {
                        match pr.iter().position(|(ps, _)| same_rule(&ks, ps)) {
                            Some(i) => {
                                pr.remove(i);
                            }
                            None => extra.push(kt),
                        }
                    }
                    for kt in extra {
                        out.push(format!(
                            "{t} chain {name}: `{kt}` is in the kernel but not planned"
                        ));
                    }
                    for (_, pt) in pr {
                        out.push(format!(
                            "{t} chain {name}: `{pt}` is missing from the kernel"
                        ));
                    }
                    continue;
                }
                if kr.len() != pr.len() {
                    out.push(format!(
                        "{t} chain {name}: the kernel has {} rules, the plan {}",
                        kr.len(),
                        pr.len()
                    ));
                    continue;
                }
                if let Some(((_, kt), (_, pt))) = kr
                    .iter()
                    .zip(&pr)
                    .find(|((ks, _), (ps, _))| !same_rule(ks, ps))
                {
                    out.push(format!(
                        "{t} chain {name}: the kernel has `{kt}` where the plan has `{pt}`"
                    ));
                }
            }
        }
        out
    }

    fn model(&self, family: IpFamily, table: Tbl) -> &TableModel {
        &self.tables[family_index(family)][table_index(table)]
    }

    fn is_local(&self, ip: &IpAddr) -> bool {
        ip.is_loopback() || self.local.contains(ip)
    }

    fn branches_inner(&self, p: &Packet) -> Result<Vec<Branch>, String> {
        let family = IpFamily::of(&p.dst);
        if IpFamily::of(&p.src) != family {
            return Err("source and destination are of different families".into());
        }
        let filter = self.model(family, Tbl::Filter);
        let nat = self.model(family, Tbl::Nat);
        let mangle = self.model(family, Tbl::Mangle);
        let start = Walk {
            src: p.src,
            dst: p.dst,
            proto: p.protocol,
            sport: SOURCE_PORT,
            dport: p.dport,
            mark: 0,
            dnat: false,
            masquerade: false,
            iif: match (&self.ingress, p.origin) {
                (_, Origin::Node) => None,
                (Some(links), _) => Some(links.interface(p).map(str::to_string)),
                (None, _) => Some(None),
            },
            rchecks: Vec::new(),
            sets: Vec::new(),
            persistence: None,
            probability: 1.0,
            rules: Vec::new(),
        };
        let mut budget = Budget::default();
        let mut stopped: Vec<(Walk, Outcome)> = Vec::new();
        let mut finished: Vec<Walk> = Vec::new();
        match p.origin {
            Origin::External | Origin::Pod => {
                let walks = self.run_hook(
                    mangle,
                    Hook::Prerouting,
                    vec![start],
                    &mut stopped,
                    &mut budget,
                )?;
                let walks =
                    self.run_hook(nat, Hook::Prerouting, walks, &mut stopped, &mut budget)?;
                let (local, remote): (Vec<Walk>, Vec<Walk>) =
                    walks.into_iter().partition(|w| self.is_local(&w.dst));
                let local = self.run_hook(filter, Hook::Input, local, &mut stopped, &mut budget)?;
                // IPVS takes what its virtual servers hold and sends it on to a real server
                // through LOCAL_OUT and POSTROUTING; the rest is delivered here.
                let (sent, local) = self.ipvs(local, &mut stopped);
                let sent = self.run_hook(filter, Hook::Output, sent, &mut stopped, &mut budget)?;
                finished.extend(self.run_hook(
                    nat,
                    Hook::Postrouting,
                    sent,
                    &mut stopped,
                    &mut budget,
                )?);
                finished.extend(self.run_hook(
                    nat,
                    Hook::Input,
                    local,
                    &mut stopped,
                    &mut budget,
                )?);
                let remote =
                    self.run_hook(filter, Hook::Forward, remote, &mut stopped, &mut budget)?;
                finished.extend(self.run_hook(
                    nat,
                    Hook::Postrouting,
                    remote,
                    &mut stopped,
                    &mut budget,
                )?);
            }
            Origin::Node => {
                let walks =
                    self.run_hook(mangle, Hook::Output, vec![start], &mut stopped, &mut budget)?;
                let walks = self.run_hook(nat, Hook::Output, walks, &mut stopped, &mut budget)?;
                // IPVS's LOCAL_OUT hook, after nat OUTPUT.
                let (mut walks, left) = self.ipvs(walks, &mut stopped);
                walks.extend(left);
                let walks =
                    self.run_hook(filter, Hook::Output, walks, &mut stopped, &mut budget)?;
                let walks =
                    self.run_hook(nat, Hook::Postrouting, walks, &mut stopped, &mut budget)?;
                // Looped back to a local address: the filter table sees it again on input.
                let (local, remote): (Vec<Walk>, Vec<Walk>) =
                    walks.into_iter().partition(|w| self.is_local(&w.dst));
                finished.extend(remote);
                finished.extend(self.run_hook(
                    filter,
                    Hook::Input,
                    local,
                    &mut stopped,
                    &mut budget,
                )?);
            }
        }
        let through = finished.into_iter().map(|w| {
            let o = if w.dnat {
                Outcome::Dnat(w.dst, w.dport)
            } else {
                Outcome::Untouched
            };
            (w, o)
        });
        Ok(through
            .chain(stopped)
            .map(|(w, outcome)| Branch {
                outcome,
                masquerade: w.masquerade,
                affinity: w.affinity(),
                probability: w.probability,
                rules: w.rules,
            })
            .collect())
    }

    /// Runs the built-in chain of `hook` in `t`; returns the walks let through, and records
    /// those dropped or rejected in `stopped`.
    fn run_hook(
        &self,
        t: &TableModel,
        hook: Hook,
        walks: Vec<Walk>,
        stopped: &mut Vec<(Walk, Outcome)>,
        budget: &mut Budget,
    ) -> Result<Vec<Walk>, String> {
        let name = hook.to_string();
        let policy_drop = t.chains.get(&name).is_some_and(|c| c.policy_drop);
        let mut through = Vec::new();
        for w in walks {
            for (w, flow) in self.run_chain(t, &name, w, 0, budget)? {
                match flow {
                    Flow::Accept => through.push(w),
                    Flow::Return if !policy_drop => through.push(w),
                    Flow::Return | Flow::Drop => stopped.push((w, Outcome::Drop)),
                    Flow::Reject => stopped.push((w, Outcome::Reject)),
                }
            }
            if through.len() + stopped.len() > MAX_BRANCHES {
                return Err(format!("more than {MAX_BRANCHES} branches"));
            }
        }
        Ok(through)
    }

    fn run_chain(
        &self,
        t: &TableModel,
        name: &str,
        w: Walk,
        depth: usize,
        budget: &mut Budget,
    ) -> Result<Vec<(Walk, Flow)>, String> {
        if depth > MAX_DEPTH {
            return Err(format!("jumps nested deeper than {MAX_DEPTH} at {name}"));
        }
        let chain = t
            .chains
            .get(name)
            .ok_or_else(|| format!("jump to missing chain {name}"))?;
        let mut out = Vec::new();
        let mut work = vec![(0usize, w)];
        while let Some((i, w)) = work.pop() {
            budget.steps += 1;
            if budget.steps > MAX_STEPS {
                return Err(format!("more than {MAX_STEPS} rule evaluations"));
            }
            if work.len() + out.len() > MAX_BRANCHES {
                return Err(format!("more than {MAX_BRANCHES} branches"));
            }
            let Some(spec) = chain.specs.get(i) else {
                out.push((w, Flow::Return));
                continue;
            };
            for (mut w, matched) in self.evaluate(spec, w) {
                if !matched {
                    work.push((i + 1, w));
                    continue;
                }
                w.rules
                    .push(format!("{} {name} {}", t.table.as_str(), chain.texts[i]));
                match &spec.target {
                    Target::None => work.push((i + 1, w)),
                    Target::Mark { value, mask } => {
                        w.mark = (w.mark & !mask) ^ value;
                        work.push((i + 1, w));
                    }
                    Target::Jump(c) => {
                        for (w, flow) in self.run_chain(t, c, w, depth + 1, budget)? {
                            match flow {
                                Flow::Return => work.push((i + 1, w)),
                                f => out.push((w, f)),
                            }
                        }
                    }
                    // A chain gone to returns straight to this chain's caller.
                    Target::Goto(c) => out.extend(self.run_chain(t, c, w, depth + 1, budget)?),
                    Target::Return => out.push((w, Flow::Return)),
                    Target::Accept => out.push((w, Flow::Accept)),
                    Target::Drop => out.push((w, Flow::Drop)),
                    Target::Reject => out.push((w, Flow::Reject)),
                    Target::Dnat { ip, port } => {
                        w.dst = *ip;
                        if let Some(p) = port {
                            w.dport = *p;
                        }
                        w.dnat = true;
                        out.push((w, Flow::Accept));
                    }
                    Target::Masquerade => {
                        w.masquerade = true;
                        out.push((w, Flow::Accept));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Tests a rule's matches in order; returns each resulting walk and whether it matched.
    /// A statistic match splits the walk in two.
    fn evaluate(&self, spec: &Spec, w: Walk) -> Vec<(Walk, bool)> {
        let mut live = vec![w];
        let mut out = Vec::new();
        for m in &spec.matches {
            let mut next = Vec::with_capacity(live.len());
            for mut w in live {
                match self.test(m, &mut w) {
                    Test::Yes => next.push(w),
                    Test::No => out.push((w, false)),
                    Test::Maybe(p) => {
                        let mut yes = w.clone();
                        yes.probability *= p;
                        next.push(yes);
                        w.probability *= 1.0 - p;
                        out.push((w, false));
                    }
                }
            }
            live = next;
            if live.is_empty() {
                break;
            }
        }
        out.extend(live.into_iter().map(|w| (w, true)));
        out
    }

    fn test(&self, m: &Match, w: &mut Walk) -> Test {
        let yes = |b: bool| if b { Test::Yes } else { Test::No };
        match m {
            Match::Src { net, neg } => yes(net.contains(&w.src) != *neg),
            Match::Dst { net, neg } => yes(net.contains(&w.dst) != *neg),
            Match::Proto { proto, neg } => yes((w.proto == *proto) != *neg),
            Match::Port { dst, lo, hi, neg } => {
                let port = if *dst { w.dport } else { w.sport };
                yes((*lo..=*hi).contains(&port) != *neg)
            }
            Match::Comment(_) => Test::Yes,
            Match::InIface { name, prefix, neg } => {
                let on = match &w.iif {
                    None => false,
                    Some(Some(i)) if *prefix => i.starts_with(name.as_str()),
                    Some(Some(i)) => i == name,
                    Some(None) => panic!(
                        "a rule matches -i {name}, and the tracer has no links to tell the \
                         interface a packet from outside or from a pod arrives on: build it \
                         with IptablesTracer::with_ingress"
                    ),
                };
                yes(on != *neg)
            }
            Match::LocalAddr { dst, neg } => {
                let ip = if *dst { &w.dst } else { &w.src };
                yes(self.is_local(ip) != *neg)
            }
            Match::Statistic { probability } => {
                if *probability >= 1.0 {
                    Test::Yes
                } else if *probability <= 0.0 {
                    Test::No
                } else {
                    Test::Maybe(*probability)
                }
            }
            Match::RecentCheck { name, seconds } => {
                // The first connection of a client: not on any list yet.
                w.rchecks.push((name.clone(), *seconds));
                Test::No
            }
            Match::RecentSet { name } => {
                w.sets.push(name.clone());
                Test::Yes
            }
            Match::Mark { value, mask, neg } => yes((w.mark & mask == *value) != *neg),
            Match::CtState { states, neg } => {
                let mut now = CT_NEW;
                if w.dnat {
                    now |= CT_DNAT;
                }
                if w.masquerade {
                    now |= CT_SNAT;
                }
                yes((now & states != 0) != *neg)
            }
            Match::Set { name, sides, neg } => {
                let Some(beyond) = &self.beyond else {
                    panic!(
                        "a rule matches ipset {name}, and the tracer has no sets: build it with \
                         IptablesTracer::with_beyond"
                    )
                };
                yes(beyond.set_contains(name, sides, &w.probe()) != *neg)
            }
            Match::PhysdevIsIn { neg } => yes(*neg),
        }
    }

    /// IPVS at a local address (`LOCAL_IN`, or `LOCAL_OUT` for the node's own packets): the
    /// walks a virtual server takes are split over its real servers (and rejected when it has
    /// none); the rest are returned as they are.
    fn ipvs(&self, walks: Vec<Walk>, stopped: &mut Vec<(Walk, Outcome)>) -> (Vec<Walk>, Vec<Walk>) {
        let Some(beyond) = &self.beyond else {
            return (Vec::new(), walks);
        };
        let mut taken = Vec::new();
        let mut left = Vec::new();
        for mut w in walks {
            let Some(s) = beyond.virtual_server(&w.probe()) else {
                left.push(w);
                continue;
            };
            w.rules.push(s.rule.clone());
            if s.reals.is_empty() {
                stopped.push((w, Outcome::Reject));
                continue;
            }
            for ((ip, port), p) in &s.reals {
                let mut to = w.clone();
                to.dst = *ip;
                to.dport = *port;
                to.dnat = true;
                to.probability *= p;
                to.persistence = s.persistence;
                taken.push(to);
            }
        }
        (taken, left)
    }
}

impl Tracer for IptablesTracer {
    /// [`IptablesTracer::trace_all`]. A trace that fails (branches that disagree, a bug in the
    /// rules) answers a translation to no endpoint at all: a verdict no flow row can expect,
    /// so such a table always fails its rows instead of passing one that expects a drop.
    fn trace(&self, packet: &Packet) -> Verdict {
        self.trace_all(packet).unwrap_or_else(|_| Verdict::Dnat {
            endpoints: Default::default(),
            masquerade: false,
            affinity: None,
        })
    }
}

#[cfg(test)]
mod tests;
