//! What the socket load balancer's programs do with a connect (or a UDP send), decided over map
//! contents, without a kernel.
//!
//! The model follows `bpf/sock.c` step by step:
//! - only sockets on the node and in its pods meet the cgroup hooks; a packet that arrives from
//!   outside the node meets the tc program instead (`bpf/tc.c`, [`EbpfTracer::trace_outside`]);
//! - `{destination, port, protocol, slot 0}` in the services map is a frontend: a count of 0
//!   refuses (`ETIMEDOUT` with the drop flag, read as a drop; `ECONNREFUSED` without, a
//!   reject); otherwise slots `1..=count` name the backends a connect may be sent to, each
//!   equally likely, or the one the client's network namespace (from outside the node, through
//!   the tc path: its address) sticks to when the frontend has an affinity timeout;
//! - with the Maglev flag (`sh`, `mh`) a new connection's slot is the one the frontend's Maglev
//!   table gives the client's hash: the reachable set is the same (the table names every
//!   backend), and for a client outside the node, whose hash is its address's,
//!   [`EbpfTracer::pick_outside`] names the one backend;
//! - a destination that is no frontend meets the address map's longest prefix: a ClusterIP
//!   rejects, a Service CIDR drops, anything else passes untouched;
//! - nothing rewrites a source: the backend sees the socket's own address, which for the node's
//!   unbound sockets is the node's address towards the backend (read as masqueraded), and for
//!   a pod or a bound socket its own.
//!
//! A slot the programs cannot follow to a backend (missing slot, missing backend, an IPv6
//! backend behind an IPv4 frontend) refuses the pick that lands on it: the tracer answers
//! `Reject` for the whole frontend, so such maps fail the table. [`EbpfTracer::problems`]
//! lists every inconsistency, the reverse-NAT entries the hooks give the frontend back with
//! included.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kp_core::flow::{Origin, Packet, Tracer, Verdict};
use kp_core::model::Protocol;
use kp_ebpf_plan::layout::address_hash;
use kp_ebpf_plan::{
    AddrKey, AddrVerdict, Backend, Contents, FrontendAddr, Op, Scope, ServiceKey, FLAG_DROP_EMPTY,
    FLAG_KEEP_SOURCE, FLAG_MAGLEV, FLAG_SRC_RANGES,
};

/// A tracer over the maps' contents.
#[derive(Debug, Clone)]
pub struct EbpfTracer {
    maps: Contents,
    local: Vec<IpAddr>,
}

/// What a pick from a frontend's slots may give.
enum Slots {
    /// Every slot leads to a backend.
    Backends(Vec<Backend>),
    /// Some slot does not: that pick is refused.
    Broken(String),
}

impl EbpfTracer {
    /// A tracer over `maps`, for a node whose own addresses are `local` (the sources an unbound
    /// socket of the node may have; loopback is always local).
    pub fn new(maps: Contents, local: Vec<IpAddr>) -> Self {
        EbpfTracer { maps, local }
    }

    /// The maps as the tracer holds them.
    pub fn maps(&self) -> &Contents {
        &self.maps
    }

    /// The maps, to change them (tests that break them on purpose).
    pub fn maps_mut(&mut self) -> &mut Contents {
        &mut self.maps
    }

    /// Applies map updates as `kp_ebpf::SocketLb::apply` writes them, in order.
    pub fn apply(&mut self, ops: &[Op]) {
        apply(&mut self.maps, ops);
    }

    fn is_local(&self, ip: &IpAddr) -> bool {
        ip.is_loopback() || self.local.contains(ip)
    }

    /// The backends a pick from `frontend` (with `count` slots) may land on.
    fn slots(&self, frontend: FrontendAddr, count: u16) -> Slots {
        let mut out = Vec::new();
        for slot in 1..=count {
            let Some(v) = self.maps.services.get(&ServiceKey { frontend, slot }) else {
                return Slots::Broken(format!(
                    "{}: slot {slot} is missing",
                    frontend_text(&frontend)
                ));
            };
            let Some(b) = self.maps.backends.get(&v.backend_id) else {
                return Slots::Broken(format!(
                    "{}: slot {slot} names backend {} which is missing",
                    frontend_text(&frontend),
                    v.backend_id
                ));
            };
            // connect4 refuses a backend that is no IPv4 address.
            if frontend.ip.is_ipv4() && b.ip.is_ipv6() {
                return Slots::Broken(format!(
                    "{}: slot {slot} holds IPv6 backend {b:?}",
                    frontend_text(&frontend)
                ));
            }
            out.push(*b);
        }
        Slots::Backends(out)
    }

    /// The address map's longest prefix holding `ip`, as the LPM trie finds it.
    fn longest_prefix(&self, ip: IpAddr) -> Option<AddrVerdict> {
        self.maps
            .addrs
            .iter()
            .filter(|(k, _)| contains(k, ip))
            .max_by_key(|(k, _)| k.len)
            .map(|(_, v)| *v)
    }

    /// What the Maglev table of `frontend` (its slot-0 entry `head`) names, entry by entry:
    /// `None` when it has no table in use (no flag, or none under its reverse-NAT id); an entry
    /// `None` where the programs would pick at random instead (a slot beyond the count) or a
    /// slot leads nowhere.
    fn maglev_entries(
        &self,
        frontend: FrontendAddr,
        head: &kp_ebpf_plan::ServiceValue,
    ) -> Option<Vec<Option<Backend>>> {
        if head.flags & FLAG_MAGLEV == 0 {
            return None;
        }
        let table = self.maps.maglev.get(&head.rev_nat)?;
        Some(
            table
                .slots()
                .iter()
                .map(|&slot| {
                    if slot == 0 || slot > head.count {
                        return None;
                    }
                    let v = self.maps.services.get(&ServiceKey { frontend, slot })?;
                    self.maps.backends.get(&v.backend_id).copied()
                })
                .collect(),
        )
    }

    /// The backend a new connection from `p.src` outside the node is given by the tc path
    /// when the frontend it reaches (the outside entry, else the socket one) hashes clients
    /// (`sh`, `mh`): its Maglev table's entry for the source address's hash. `None` for a
    /// random pick (no Maglev flag or table, or the entry is beyond the count), and where no
    /// frontend matches. Affinity, which the tc path applies first, is state of the programs:
    /// a client's first connection is given this one.
    pub fn pick_outside(&self, p: &Packet) -> Option<Backend> {
        let (frontend, head) = [Scope::Outside, Scope::Socket]
            .into_iter()
            .find_map(|scope| {
                let frontend = FrontendAddr {
                    ip: p.dst,
                    port: p.dport,
                    protocol: p.protocol,
                    scope,
                };
                self.maps
                    .services
                    .get(&ServiceKey { frontend, slot: 0 })
                    .map(|v| (frontend, v))
            })?;
        let entries = self.maglev_entries(frontend, head)?;
        entries[kp_ebpf_plan::layout::maglev_index(address_hash(p.src))]
    }

    /// Everything in the maps the programs would stumble on: slots that lead nowhere,
    /// frontends without a reverse-NAT entry (recvmsg and getpeername would show the backend
    /// instead of the frontend), reverse-NAT entries naming another frontend, backend slots
    /// beyond the count, Maglev tables missing for a frontend flagged to use one, naming a slot
    /// beyond its count, or of no frontend.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut tables_used = BTreeSet::new();
        for (k, v) in self.maps.services.iter().filter(|(k, _)| k.slot == 0) {
            if v.flags & FLAG_MAGLEV != 0 {
                tables_used.insert(v.rev_nat);
                match self.maps.maglev.get(&v.rev_nat) {
                    None => out.push(format!(
                        "{}: flagged Maglev but kp_maglev has no table under {}",
                        frontend_text(&k.frontend),
                        v.rev_nat
                    )),
                    Some(t) => {
                        let beyond = t
                            .slots()
                            .iter()
                            .filter(|s| **s == 0 || **s > v.count)
                            .count();
                        if beyond > 0 {
                            out.push(format!(
                                "{}: {beyond} Maglev entries name a slot beyond its {} \
                                 backends",
                                frontend_text(&k.frontend),
                                v.count
                            ));
                        }
                    }
                }
            }
            if let Slots::Broken(why) = self.slots(k.frontend, v.count) {
                out.push(why);
            }
            match self.maps.rev_nat.get(&v.rev_nat) {
                None => out.push(format!(
                    "{}: reverse-NAT entry {} is missing",
                    frontend_text(&k.frontend),
                    v.rev_nat
                )),
                Some(r) if (r.ip, r.port) != (k.frontend.ip, k.frontend.port) => out.push(format!(
                    "{}: reverse-NAT entry {} is {r:?}",
                    frontend_text(&k.frontend),
                    v.rev_nat
                )),
                Some(_) => {}
            }
        }
        for id in self
            .maps
            .maglev
            .keys()
            .filter(|id| !tables_used.contains(id))
        {
            out.push(format!(
                "kp_maglev: a table under {id}, which no frontend flagged Maglev has"
            ));
        }
        for k in self.maps.services.keys().filter(|k| k.slot != 0) {
            let head = ServiceKey { slot: 0, ..*k };
            match self.maps.services.get(&head) {
                Some(h) if k.slot <= h.count => {}
                _ => out.push(format!(
                    "{}: slot {} beyond its count (or no count)",
                    frontend_text(&k.frontend),
                    k.slot
                )),
            }
        }
        out
    }
}

/// What one frontend leads to, whatever ids the maps use: what [`EbpfTracer::differences`]
/// compares.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Resolved {
    /// Its backends by slot, sorted (`None`: a slot leads nowhere, see `problems`).
    backends: Option<Vec<Backend>>,
    /// The address its reverse-NAT entry gives back (`None`: missing).
    rev_nat: Option<(IpAddr, u16)>,
    affinity: u32,
    flags: u8,
    /// The sources it admits from outside (its `kp_src_ranges` entries).
    ranges: BTreeSet<AddrKey>,
    /// What its Maglev table names, entry by entry (`None`: no table in use).
    maglev: Option<Vec<Option<Backend>>>,
}

/// A frontend as an operator reads it: `ADDR:PORT/PROTO (socket|outside)`.
fn frontend_text(f: &FrontendAddr) -> String {
    let addr = match f.ip {
        IpAddr::V4(_) => format!("{}:{}", f.ip, f.port),
        IpAddr::V6(_) => format!("[{}]:{}", f.ip, f.port),
    };
    let scope = match f.scope {
        Scope::Socket => "socket hooks",
        Scope::Outside => "outside only",
    };
    format!("{addr}/{} ({scope})", f.protocol.as_lower())
}

/// A frontend's backends as an operator reads them.
fn backends_text(b: &Option<Vec<Backend>>) -> String {
    match b {
        None => "a slot that leads nowhere".into(),
        Some(b) => format!(
            "[{}]",
            b.iter()
                .map(|b| match b.ip {
                    IpAddr::V4(_) => format!("{}:{}", b.ip, b.port),
                    IpAddr::V6(_) => format!("[{}]:{}", b.ip, b.port),
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl EbpfTracer {
    fn resolved(&self) -> BTreeMap<FrontendAddr, Resolved> {
        self.maps
            .services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(k, head)| {
                let backends = match self.slots(k.frontend, head.count) {
                    Slots::Backends(mut b) => {
                        b.sort();
                        Some(b)
                    }
                    Slots::Broken(_) => None,
                };
                let resolved = Resolved {
                    backends,
                    rev_nat: self.maps.rev_nat.get(&head.rev_nat).map(|r| (r.ip, r.port)),
                    affinity: head.affinity,
                    flags: head.flags,
                    ranges: self
                        .maps
                        .ranges
                        .iter()
                        .filter(|r| r.rev_nat == head.rev_nat)
                        .map(|r| r.prefix)
                        .collect(),
                    maglev: self.maglev_entries(k.frontend, head),
                };
                (k.frontend, resolved)
            })
            .collect()
    }

    /// Where these maps (the kernel's, read back) differ from `planned`'s (a planner's
    /// contents): each frontend by what it leads to (its backends, reverse-NAT address,
    /// affinity, flags and source ranges), not by the ids and slots that encode it, since
    /// maps adopted across restarts and changed Service by Service keep other ids than a fresh
    /// plan, and the backend each entry of its Maglev table names; then every address entry;
    /// then whatever in these maps the programs would stumble on ([`EbpfTracer::problems`]).
    /// One line per difference, empty when they agree.
    pub fn differences(&self, planned: &EbpfTracer) -> Vec<String> {
        let (have, want) = (self.resolved(), planned.resolved());
        let mut out = Vec::new();
        let frontends: BTreeSet<&FrontendAddr> = have.keys().chain(want.keys()).collect();
        for f in frontends {
            let name = frontend_text(f);
            let (h, w) = match (have.get(f), want.get(f)) {
                (None, _) => {
                    out.push(format!(
                        "kp_services: frontend {name} is missing from the kernel"
                    ));
                    continue;
                }
                (_, None) => {
                    out.push(format!(
                        "kp_services: frontend {name} is in the kernel but not planned"
                    ));
                    continue;
                }
                (Some(h), Some(w)) => (h, w),
            };
            if h.backends != w.backends {
                out.push(format!(
                    "kp_services: frontend {name} leads to {} where the plan has {}",
                    backends_text(&h.backends),
                    backends_text(&w.backends)
                ));
            }
            if h.rev_nat != w.rev_nat {
                out.push(format!(
                    "kp_rev_nat: frontend {name} is given back as {:?} where the plan has {:?}",
                    h.rev_nat, w.rev_nat
                ));
            }
            if (h.affinity, h.flags) != (w.affinity, w.flags) {
                out.push(format!(
                    "kp_services: frontend {name} has affinity {}s, flags {:#x} where the plan \
                     has {}s, {:#x}",
                    h.affinity, h.flags, w.affinity, w.flags
                ));
            }
            match (&h.maglev, &w.maglev) {
                (Some(a), Some(b)) if a != b => out.push(format!(
                    "kp_maglev: frontend {name}'s table names another backend than the plan in \
                     {} of {} entries",
                    a.iter().zip(b).filter(|(x, y)| x != y).count(),
                    b.len()
                )),
                (None, Some(_)) => out.push(format!(
                    "kp_maglev: frontend {name} has no Maglev table where the plan has one"
                )),
                (Some(_), None) => out.push(format!(
                    "kp_maglev: frontend {name} has a Maglev table where the plan has none"
                )),
                _ => {}
            }
            if h.ranges != w.ranges {
                let text = |r: &BTreeSet<AddrKey>| {
                    r.iter()
                        .map(|k| format!("{}/{}", k.ip, k.len))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                out.push(format!(
                    "kp_src_ranges: frontend {name} admits [{}] where the plan has [{}]",
                    text(&h.ranges),
                    text(&w.ranges)
                ));
            }
        }
        let keys: BTreeSet<&AddrKey> = self
            .maps
            .addrs
            .keys()
            .chain(planned.maps.addrs.keys())
            .collect();
        for k in keys {
            match (self.maps.addrs.get(k), planned.maps.addrs.get(k)) {
                (h, w) if h == w => {}
                (None, Some(w)) => out.push(format!(
                    "kp_addrs: {}/{} ({w:?}) is missing from the kernel",
                    k.ip, k.len
                )),
                (Some(h), None) => out.push(format!(
                    "kp_addrs: {}/{} ({h:?}) is in the kernel but not planned",
                    k.ip, k.len
                )),
                (h, w) => out.push(format!(
                    "kp_addrs: {}/{} is {h:?} where the plan has {w:?}",
                    k.ip, k.len
                )),
            }
        }
        out.extend(
            self.problems()
                .into_iter()
                .map(|p| format!("in the kernel: {p}")),
        );
        out
    }
}

impl EbpfTracer {
    /// What `kp_tc_outside` does with a new connection's first packet from outside the node:
    /// TCP and UDP only; the frontend's outside entry, else its socket one; source ranges
    /// (a miss drops); no backend drops (no reject is built in tc); what no frontend matches
    /// drops where the address map rejects or drops, and passes otherwise. Masqueraded unless
    /// the entry keeps the source; the entry's affinity timeout sticks the client's address to
    /// one of its backends (`kp_affinity_out`), as the socket hooks stick its namespace.
    pub fn trace_outside(&self, p: &Packet) -> Verdict {
        if p.protocol == Protocol::Sctp {
            return Verdict::Untouched;
        }
        let key = |scope| ServiceKey {
            frontend: FrontendAddr {
                ip: p.dst,
                port: p.dport,
                protocol: p.protocol,
                scope,
            },
            slot: 0,
        };
        let found = [Scope::Outside, Scope::Socket]
            .into_iter()
            .find_map(|scope| self.maps.services.get(&key(scope)).map(|v| (scope, v)));
        let Some((scope, head)) = found else {
            return match self.longest_prefix(p.dst) {
                Some(_) => Verdict::Drop,
                None => Verdict::Untouched,
            };
        };
        if head.flags & FLAG_SRC_RANGES != 0
            && !self
                .maps
                .ranges
                .iter()
                .any(|r| r.rev_nat == head.rev_nat && contains(&r.prefix, p.src))
        {
            return Verdict::Drop;
        }
        if head.count == 0 {
            return Verdict::Drop;
        }
        match self.slots(key(scope).frontend, head.count) {
            Slots::Broken(_) => Verdict::Drop,
            Slots::Backends(backends) => Verdict::Dnat {
                endpoints: backends
                    .iter()
                    .map(|b| (b.ip, b.port))
                    .collect::<BTreeSet<_>>(),
                masquerade: head.flags & FLAG_KEEP_SOURCE == 0,
                affinity: (head.affinity != 0).then_some(head.affinity),
            },
        }
    }
}

impl Tracer for EbpfTracer {
    fn trace(&self, p: &Packet) -> Verdict {
        // Only sockets meet the cgroup hooks; the rest meets the tc path.
        if p.origin == Origin::External {
            return self.trace_outside(p);
        }
        let frontend = FrontendAddr {
            ip: p.dst,
            port: p.dport,
            protocol: p.protocol,
            scope: Scope::Socket,
        };
        let Some(head) = self.maps.services.get(&ServiceKey { frontend, slot: 0 }) else {
            return match self.longest_prefix(p.dst) {
                Some(AddrVerdict::Reject) => Verdict::Reject,
                Some(AddrVerdict::Drop) => Verdict::Drop,
                None => Verdict::Untouched,
            };
        };
        if head.count == 0 {
            return if head.flags & FLAG_DROP_EMPTY != 0 {
                Verdict::Drop
            } else {
                Verdict::Reject
            };
        }
        match self.slots(frontend, head.count) {
            Slots::Broken(_) => Verdict::Reject,
            Slots::Backends(backends) => Verdict::Dnat {
                endpoints: backends
                    .iter()
                    .map(|b| (b.ip, b.port))
                    .collect::<BTreeSet<_>>(),
                masquerade: p.origin == Origin::Node && self.is_local(&p.src),
                affinity: (head.affinity != 0).then_some(head.affinity),
            },
        }
    }
}

/// Whether prefix `k` holds `ip` (of the same family).
fn contains(k: &AddrKey, ip: IpAddr) -> bool {
    match (k.ip, ip) {
        (IpAddr::V4(net), IpAddr::V4(a)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(k.len)).unwrap_or(0);
            u32::from(net) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(net), IpAddr::V6(a)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(k.len)).unwrap_or(0);
            u128::from(net) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

/// Applies map updates to `maps` as the loader writes them.
pub fn apply(maps: &mut Contents, ops: &[Op]) {
    ops.iter().for_each(|op| maps.apply(op));
}

#[cfg(test)]
mod tests;
