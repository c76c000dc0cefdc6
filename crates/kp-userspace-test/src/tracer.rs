//! Follows a connection's first packet through the `inet kube-proxy-userspace` table the
//! redirect planner renders, without a kernel, and asks the balancer where a redirected one
//! goes.
//!
//! The tracer replays transactions (a full one, then partial ones) into its own copy of the
//! table, orders base chains by hook and priority, and walks the packet: prerouting, then input
//! or forward, for traffic arriving on an interface; output, then input for a local
//! destination, for the node's own. It knows only the rule shapes the planner emits and refuses
//! anything else. In an `inet` table every `ip`/`ip6` selector also matches the family, as nft's
//! implicit `meta nfproto` dependency does.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use kp_core::flow::{Ingress, Origin, Packet, Tracer, Verdict};
use kp_core::model::{IpFamily, Protocol};
use kp_nftables_plan::element::{Atom, NoEndpointVerdict, Tuple};
use kp_nftables_test::elements::{lookup, Elements};
pub use kp_nftables_test::transaction::TraceError;
use kp_nftables_test::transaction::{self, statements, Hook, RuleModel, SetModel};
use kp_userspace_plan::layout::comment_ports;
use kp_userspace_plan::names::{FAMILY, REJECT_PACKET, TABLE};
use kp_userspace_plan::{Arrival, Balancer, Pick, Scheduler, Source};

/// One component of a concatenated selector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sel {
    Saddr,
    Daddr,
    L4Proto,
    Dport,
}

#[derive(Clone, Debug)]
enum Match {
    CtStateNew,
    Family(IpFamily),
    FibLocal {
        dst: bool,
    },
    L4ProtoIn(Vec<Protocol>),
    /// `socket transparent 1`: a packet for a transparent socket. A connection's first packet
    /// has none.
    SocketTransparent,
    InSet {
        key: Vec<Sel>,
        set: String,
        negate: bool,
    },
    NotInNet {
        key: Sel,
        net: IpNet,
    },
    /// `iifname "NAME"`, `iifname "PREFIX*"` (`prefix`), or with `!=` (`negate`).
    Iifname {
        name: String,
        prefix: bool,
        negate: bool,
    },
}

#[derive(Clone, Debug)]
enum Action {
    MarkSet(u32),
    Vmap { key: Vec<Sel>, map: String },
    Jump(String),
    Goto(String),
    Accept,
    Drop,
    Reject,
    Redirect(u16),
}

#[derive(Clone, Debug)]
struct Rule {
    matches: Vec<Match>,
    actions: Vec<Action>,
}

type Table = transaction::Table<Rule>;

impl RuleModel for Rule {
    fn parse(body: &str, _comment: Option<&str>) -> Option<Self> {
        parse_rule(body)
    }

    fn sets(&self) -> Vec<&str> {
        let sets = self.matches.iter().filter_map(|m| match m {
            Match::InSet { set, .. } => Some(set.as_str()),
            _ => None,
        });
        let maps = self.actions.iter().filter_map(|a| match a {
            Action::Vmap { map, .. } => Some(map.as_str()),
            _ => None,
        });
        sets.chain(maps).collect()
    }

    fn chains(&self) -> Vec<&str> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::Jump(c) | Action::Goto(c) => Some(c.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Typed sets, and verdict maps only.
    fn knows_set(map: bool, body: &str) -> bool {
        body.starts_with("type ") && map == body.contains(": verdict")
    }
}

/// A packet's state along its walk.
#[derive(Clone, Debug)]
struct Walk {
    family: IpFamily,
    src: IpAddr,
    dst: IpAddr,
    proto: Protocol,
    dport: u16,
    mark: u32,
    /// The proxy port it was redirected to.
    redirected: Option<u16>,
    /// The interface it arrived on: `None` for the node's own packets, `Some(None)` when the
    /// tracer has no links to tell.
    iif: Option<Option<String>>,
}

enum Flow {
    Continue,
    Return,
    Accept,
    Drop,
    Reject,
}

/// A tracer over the rendered table and the balancer the proxy consults.
#[derive(Debug)]
pub struct UserspaceTracer {
    table: Option<Table>,
    local: Vec<IpAddr>,
    /// The node's links, for `iifname` ([`UserspaceTracer::with_ingress`]).
    ingress: Option<Ingress>,
    /// The pod port the table's comment names (detect-local by interface): what the proxy
    /// accepts there arrived on the pods' interface(s).
    pod_port: Option<u16>,
    balancer: RefCell<Balancer>,
    now: Instant,
}

impl UserspaceTracer {
    /// A tracer for a node whose own addresses are `local` (what `fib … type local` matches;
    /// loopback is always local), asking `balancer` (synced by the caller) where redirected
    /// connections go.
    pub fn new(local: Vec<IpAddr>, balancer: Balancer) -> Self {
        UserspaceTracer {
            table: None,
            local,
            ingress: None,
            pod_port: None,
            balancer: RefCell::new(balancer),
            now: Instant::now(),
        }
    }

    /// The tracer with the node's links, which tell the interface a packet arrives on (what
    /// `iifname` matches). Without them, a packet from outside or from a pod that meets an
    /// `iifname` match panics: the tracer does not guess.
    pub fn with_ingress(mut self, ingress: Ingress) -> Self {
        self.ingress = Some(ingress);
        self
    }

    /// The balancer, to sync it along with the table.
    pub fn balancer_mut(&mut self) -> &mut Balancer {
        self.balancer.get_mut()
    }

    /// The scheduler the balancer picks with.
    pub fn scheduler(&self) -> Scheduler {
        self.balancer.borrow().config().scheduler
    }

    /// The endpoints the balancer tries for `p`'s connection, in order (its scheduler's or
    /// affinity's choice first), when the table redirects `p` to the proxy and the balancer
    /// has a route for it; `None` otherwise. Like a connection, it moves the balancer's
    /// round-robin position.
    pub fn attempts(&self, p: &Packet) -> Option<Vec<(IpAddr, u16)>> {
        let Walked::Redirected(port) = self.walk(p) else {
            return None;
        };
        match self.pick(p, port) {
            Pick::Connect { attempts, .. } => Some(
                attempts
                    .iter()
                    .map(|a| (a.endpoint.ip(), a.endpoint.port()))
                    .collect(),
            ),
            _ => None,
        }
    }

    /// Moves the tracer's clock (affinity and quarantine expire with it).
    pub fn advance(&mut self, by: Duration) {
        self.now += by;
    }

    /// Whether the table exists.
    pub fn has_table(&self) -> bool {
        self.table.is_some()
    }

    /// The elements of a set, as replayed (spelled as the kernel's read-back spells them);
    /// `None` when the table or the set does not exist.
    pub fn elements(&self, set: &str) -> Option<Elements> {
        Some(self.table.as_ref()?.sets.get(set)?.elements.clone())
    }

    /// Replays a transaction. Fails on any statement the planner would not emit.
    pub fn apply(&mut self, text: &str) -> Result<(), TraceError> {
        for st in statements(text) {
            if st.family != FAMILY {
                return Err(st.unsupported("family"));
            }
            if st.table != TABLE {
                return Err(st.unsupported("table"));
            }
            match (st.verb, st.what) {
                ("add", "table") => {
                    if !st.rest.is_empty() && st.table_comment().is_none() {
                        return Err(st.unsupported("table"));
                    }
                    match st.table_comment() {
                        Some(c) => self.pod_port = comment_ports(c).and_then(|(_, pod)| pod),
                        None if self.table.is_none() => self.pod_port = None,
                        None => {}
                    }
                    self.table.get_or_insert_with(Table::default);
                }
                ("delete", "table") => {
                    self.table
                        .take()
                        .ok_or_else(|| st.invalid("delete of a missing table".into()))?;
                    self.pod_port = None;
                }
                _ => self
                    .table
                    .as_mut()
                    .ok_or_else(|| st.invalid("no such table".into()))?
                    .apply(&st)?,
            }
        }
        self.table.as_ref().map_or(Ok(()), Table::check_references)
    }

    fn is_local(&self, ip: &IpAddr) -> bool {
        ip.is_loopback() || self.local.contains(ip)
    }

    /// Runs every base chain of `hook` in priority order.
    fn run_hook(&self, t: &Table, hook: Hook, w: &mut Walk) -> Flow {
        for (nat, name) in t.base_chains(hook) {
            // One NAT decision per connection.
            if nat && w.redirected.is_some() {
                continue;
            }
            match self.run_chain(t, name, w, 0) {
                Flow::Drop => return Flow::Drop,
                Flow::Reject => return Flow::Reject,
                _ => {}
            }
        }
        Flow::Continue
    }

    fn run_chain(&self, t: &Table, name: &str, w: &mut Walk, depth: usize) -> Flow {
        let Some(chain) = t.chains.get(name) else {
            return Flow::Continue;
        };
        if depth > 16 {
            return Flow::Drop;
        }
        for rule in &chain.rules {
            if !rule.matches.iter().all(|m| self.matches(t, m, w)) {
                continue;
            }
            for a in &rule.actions {
                match a {
                    Action::MarkSet(m) => w.mark = *m,
                    Action::Accept => return Flow::Accept,
                    Action::Drop => return Flow::Drop,
                    Action::Reject => return Flow::Reject,
                    Action::Redirect(port) => {
                        w.redirected = Some(*port);
                        w.dst = match w.family {
                            IpFamily::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
                            IpFamily::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
                        };
                        w.dport = *port;
                        return Flow::Accept;
                    }
                    Action::Jump(c) => match self.run_chain(t, c, w, depth + 1) {
                        Flow::Continue | Flow::Return => {}
                        f => return f,
                    },
                    Action::Goto(c) => {
                        return match self.run_chain(t, c, w, depth + 1) {
                            Flow::Continue | Flow::Return => Flow::Return,
                            f => f,
                        };
                    }
                    Action::Vmap { key, map } => {
                        let verdict = t
                            .sets
                            .get(map)
                            .and_then(|s| find(s, key, w))
                            .cloned()
                            .flatten();
                        // A failed lookup ends the rule, as in the kernel.
                        let Some(verdict) = verdict else { break };
                        return match verdict.atoms() {
                            [Atom::Verdict(NoEndpointVerdict::Drop)] => Flow::Drop,
                            [Atom::Verdict(NoEndpointVerdict::Reject)] => {
                                match self.run_chain(t, REJECT_PACKET, w, depth + 1) {
                                    Flow::Continue | Flow::Return => Flow::Return,
                                    f => f,
                                }
                            }
                            _ => Flow::Drop,
                        };
                    }
                }
            }
        }
        Flow::Continue
    }

    fn matches(&self, t: &Table, m: &Match, w: &Walk) -> bool {
        match m {
            Match::CtStateNew => true,
            Match::Family(f) => w.family == *f,
            Match::FibLocal { dst } => self.is_local(if *dst { &w.dst } else { &w.src }),
            Match::L4ProtoIn(ps) => ps.contains(&w.proto),
            Match::SocketTransparent => false,
            Match::InSet { key, set, negate } => {
                let found = t.sets.get(set).is_some_and(|s| find(s, key, w).is_some());
                found != *negate
            }
            Match::NotInNet { key, net } => match value(*key, w) {
                Atom::Ip(ip) => !net.contains(&ip),
                _ => false,
            },
            Match::Iifname {
                name,
                prefix,
                negate,
            } => kp_core::flow::iifname_matches(
                w.iif.as_ref().map(Option::as_deref),
                name,
                *prefix,
                *negate,
                "UserspaceTracer::with_ingress",
            ),
        }
    }

    /// The walk's end: what the proxy does with a connection redirected to `port`, per the
    /// balancer. As the proxy, it knows the node's own connections by their source, and takes
    /// what it accepts on the pod port for a pod's.
    /// What the balancer does with `p`'s connection redirected to `port`: the proxy takes what
    /// it accepts on the pod port for a pod's.
    fn pick(&self, p: &Packet, port: u16) -> Pick {
        let arrival = if p.origin == Origin::Node {
            Arrival::Node
        } else if self.pod_port == Some(port) {
            Arrival::PodInterface
        } else {
            Arrival::Other
        };
        self.balancer.borrow_mut().pick_via(
            p.protocol,
            SocketAddr::new(p.dst, p.dport),
            SocketAddr::new(p.src, 40000),
            arrival,
            self.now,
        )
    }

    fn redirected(&self, p: &Packet, port: u16) -> Verdict {
        let pick = self.pick(p, port);
        let balancer = self.balancer.borrow();
        match pick {
            Pick::Connect { route, attempts } => Verdict::Dnat {
                endpoints: attempts
                    .iter()
                    .map(|a| (a.endpoint.ip(), a.endpoint.port()))
                    .collect::<BTreeSet<_>>(),
                masquerade: attempts.iter().all(|a| a.source == Source::Node),
                affinity: balancer
                    .affinity(&route)
                    .map(|d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX)),
            },
            Pick::Drop => Verdict::Drop,
            // The proxy closes a connection it has no route for.
            Pick::Reject | Pick::NotAService => Verdict::Reject,
        }
    }
}

/// Where the table alone sends a connection's first packet ([`UserspaceTracer::walk`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walked {
    /// Left alone (no rule of ours redirects, drops or rejects it).
    Untouched,
    /// Dropped by the table.
    Drop,
    /// Rejected by the table.
    Reject,
    /// Redirected to the proxy listening on this port: where it goes next is the balancer's
    /// choice.
    Redirected(u16),
}

impl Tracer for UserspaceTracer {
    fn trace(&self, p: &Packet) -> Verdict {
        match self.walk(p) {
            Walked::Untouched => Verdict::Untouched,
            Walked::Drop => Verdict::Drop,
            Walked::Reject => Verdict::Reject,
            Walked::Redirected(port) => self.redirected(p, port),
        }
    }
}

impl UserspaceTracer {
    /// The names of the table's sets and maps (none without a table).
    pub fn set_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .table
            .as_ref()
            .map(|t| t.sets.keys().cloned().collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    /// The pod port the table's comment names: with detect-local by interface, the rules send
    /// what arrives on the pods' interface(s) there, and the proxy takes what it accepts there
    /// for a pod's. `None` without one (or without a table).
    pub fn pod_port(&self) -> Option<u16> {
        self.pod_port
    }

    /// The proxy ports the table's rules redirect to (with a pod port, both).
    pub fn redirect_ports(&self) -> BTreeSet<u16> {
        let chains = self.table.iter().flat_map(|t| t.chains.values());
        chains
            .flat_map(|c| &c.rules)
            .flat_map(|r| &r.actions)
            .filter_map(|a| match a {
                Action::Redirect(port) => Some(*port),
                _ => None,
            })
            .collect()
    }

    /// Follows `p` through the table alone, without asking the balancer.
    pub fn walk(&self, p: &Packet) -> Walked {
        let Some(t) = &self.table else {
            return Walked::Untouched;
        };
        let mut w = Walk {
            family: IpFamily::of(&p.dst),
            src: p.src,
            dst: p.dst,
            proto: p.protocol,
            dport: p.dport,
            mark: 0,
            redirected: None,
            iif: match (&self.ingress, p.origin) {
                (_, Origin::Node) => None,
                (Some(links), _) => Some(links.interface(p).map(str::to_string)),
                (None, _) => Some(None),
            },
        };
        let hooks: &[Hook] = match p.origin {
            Origin::External | Origin::Pod => &[Hook::Prerouting],
            Origin::Node => &[Hook::Output],
        };
        for hook in hooks {
            match self.run_hook(t, *hook, &mut w) {
                Flow::Drop => return Walked::Drop,
                Flow::Reject => return Walked::Reject,
                _ => {}
            }
        }
        // Routing: delivered locally (a redirect always is), or forwarded.
        let next = if self.is_local(&w.dst) {
            Hook::Input
        } else if p.origin == Origin::Node {
            // Leaves the node: no hook of ours after output.
            return outcome(&w);
        } else {
            Hook::Forward
        };
        match self.run_hook(t, next, &mut w) {
            Flow::Drop => Walked::Drop,
            Flow::Reject => Walked::Reject,
            _ => outcome(&w),
        }
    }
}

fn outcome(w: &Walk) -> Walked {
    match w.redirected {
        Some(port) => Walked::Redirected(port),
        None => Walked::Untouched,
    }
}

fn value(s: Sel, w: &Walk) -> Atom {
    match s {
        Sel::Saddr => Atom::Ip(w.src),
        Sel::Daddr => Atom::Ip(w.dst),
        Sel::L4Proto => Atom::Proto(w.proto),
        Sel::Dport => Atom::Port(w.dport),
    }
}

fn find<'a>(set: &'a SetModel, key: &[Sel], w: &Walk) -> Option<&'a Option<Tuple>> {
    let probe: Vec<Atom> = key.iter().map(|s| value(*s, w)).collect();
    lookup(&set.elements, &probe)
}

/// Parses a selector at `w[i..]`: its family (for addresses), itself, and how many words.
fn parse_sel(w: &[&str], i: usize) -> Option<(Option<IpFamily>, Sel, usize)> {
    let at = |k: usize| w.get(i + k).copied().unwrap_or("");
    let family = match at(0) {
        "ip" => Some(IpFamily::V4),
        "ip6" => Some(IpFamily::V6),
        _ => None,
    };
    match (at(0), at(1)) {
        ("ip" | "ip6", "saddr") => Some((family, Sel::Saddr, 2)),
        ("ip" | "ip6", "daddr") => Some((family, Sel::Daddr, 2)),
        ("meta", "l4proto") if at(2) != "{" => Some((None, Sel::L4Proto, 2)),
        ("th", "dport") => Some((None, Sel::Dport, 2)),
        _ => None,
    }
}

/// Parses a concatenation; returns its families, itself and the index after it.
fn parse_concat(w: &[&str], mut i: usize) -> Option<(Vec<IpFamily>, Vec<Sel>, usize)> {
    let mut families = Vec::new();
    let mut v = Vec::new();
    loop {
        let (f, s, n) = parse_sel(w, i)?;
        families.extend(f);
        v.push(s);
        i += n;
        if w.get(i) == Some(&".") {
            i += 1;
        } else {
            return Some((families, v, i));
        }
    }
}

fn protocol(s: &str) -> Option<Protocol> {
    Protocol::ALL.into_iter().find(|p| p.as_lower() == s)
}

fn parse_rule(body: &str) -> Option<Rule> {
    let w: Vec<&str> = body.split_whitespace().collect();
    let mut matches = Vec::new();
    let mut actions = Vec::new();
    let mut i = 0;
    while i < w.len() {
        let at = |k: usize| w.get(i + k).copied().unwrap_or("");
        match (at(0), at(1), at(2)) {
            ("ct", "state", "new") => {
                matches.push(Match::CtStateNew);
                i += 3;
            }
            ("iifname", op, quoted) => {
                let (negate, quoted, n) = match op {
                    "!=" => (true, quoted, 3),
                    _ => (false, op, 2),
                };
                let inner = quoted.strip_prefix('"')?.strip_suffix('"')?;
                let (name, prefix) = match inner.strip_suffix('*') {
                    Some(p) => (p, true),
                    None => (inner, false),
                };
                kp_core::node::InterfaceName::new(name).ok()?;
                matches.push(Match::Iifname {
                    name: name.to_string(),
                    prefix,
                    negate,
                });
                i += n;
            }
            ("meta", "nfproto", f) => {
                matches.push(Match::Family(match f {
                    "ipv4" => IpFamily::V4,
                    "ipv6" => IpFamily::V6,
                    _ => return None,
                }));
                i += 3;
            }
            ("meta", "l4proto", "{") => {
                let close = w[i..].iter().position(|x| *x == "}")? + i;
                let protos = w[i + 3..close]
                    .iter()
                    .map(|p| protocol(p.trim_end_matches(',')))
                    .collect::<Option<Vec<_>>>()?;
                matches.push(Match::L4ProtoIn(protos));
                i = close + 1;
            }
            ("fib", which @ ("daddr" | "saddr"), "type") if at(3) == "local" => {
                matches.push(Match::FibLocal {
                    dst: which == "daddr",
                });
                i += 4;
            }
            ("socket", "transparent", "1") => {
                matches.push(Match::SocketTransparent);
                i += 3;
            }
            ("meta", "mark", "set") => {
                actions.push(Action::MarkSet(
                    u32::from_str_radix(at(3).strip_prefix("0x")?, 16).ok()?,
                ));
                i += 4;
            }
            ("redirect", "to", port) => {
                actions.push(Action::Redirect(port.strip_prefix(':')?.parse().ok()?));
                i += 3;
            }
            ("jump", c, _) => {
                actions.push(Action::Jump(c.to_string()));
                i += 2;
            }
            ("goto", c, _) => {
                actions.push(Action::Goto(c.to_string()));
                i += 2;
            }
            ("accept", _, _) => {
                actions.push(Action::Accept);
                i += 1;
            }
            ("drop", _, _) => {
                actions.push(Action::Drop);
                i += 1;
            }
            ("reject", _, _) => {
                actions.push(Action::Reject);
                i += 1;
            }
            _ => {
                let (families, key, j) = parse_concat(&w, i)?;
                matches.extend(families.into_iter().map(Match::Family));
                let next = w.get(j).copied().unwrap_or("");
                match next {
                    "vmap" => {
                        let map = w.get(j + 1)?.strip_prefix('@')?.to_string();
                        actions.push(Action::Vmap { key, map });
                        i = j + 2;
                    }
                    "!=" => {
                        let target = w.get(j + 1)?;
                        if let Some(set) = target.strip_prefix('@') {
                            matches.push(Match::InSet {
                                key,
                                set: set.to_string(),
                                negate: true,
                            });
                        } else if let [key] = key.as_slice() {
                            let net = if target.contains('/') {
                                target.parse().ok()?
                            } else {
                                IpNet::from(target.parse::<IpAddr>().ok()?)
                            };
                            matches.push(Match::NotInNet { key: *key, net });
                        } else {
                            return None;
                        }
                        i = j + 2;
                    }
                    s if s.starts_with('@') => {
                        matches.push(Match::InSet {
                            key,
                            set: s[1..].to_string(),
                            negate: false,
                        });
                        i = j + 1;
                    }
                    _ => return None,
                }
            }
        }
    }
    // A verdict or a statement ends every rule we emit; a rule of matches only is not ours.
    if actions.is_empty() {
        return None;
    }
    Some(Rule { matches, actions })
}

#[cfg(test)]
mod tests;
