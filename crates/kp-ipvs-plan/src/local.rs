//! What one virtual server per address cannot say about the `Local` traffic policies, said
//! with firewall marks, as the other modes say it (kube-proxy-rs's addition to upstream's
//! ipvs layout, whose virtual servers give pods and the node the local endpoints only, and
//! answer with a reset where upstream's other modes drop):
//!
//! - **Short-circuit** (`externalTrafficPolicy: Local`): traffic from pods (detect-local) and
//!   from the node itself to an external frontend goes to every endpoint of the cluster, as if
//!   it had gone out to the load balancer and come back to any node. Such packets are marked in
//!   mangle `PREROUTING` and `OUTPUT` (chain [`KUBE_IPVS_LOCAL`]) with the Service port's
//!   mark, and a firewall-mark virtual server of that mark holds the cluster-wide endpoints:
//!   IPVS looks a packet's mark up before its address. The node's own short-circuited traffic
//!   is masqueraded in `KUBE-POSTROUTING` ([`masquerade_rule`]).
//! - **No local endpoints** (`Local` policies with endpoints elsewhere only): what is not
//!   short-circuited is dropped in the same chain, before IPVS sees it (mangle runs before
//!   IPVS's hooks), as upstream's "has no local endpoints" rules do; a virtual server without
//!   real servers would answer with a reset.
//!
//! Marks are `SHORT_CIRCUIT_MARK | index` with a 14-bit index (so bits 14 and 15, the
//! masquerade and drop marks of the default `masqueradeBit`, stay clear), chosen per Service
//! port by a hash of its name, probing on a collision: stable while the Service exists.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use kp_core::model::{IpFamily, Protocol, ServicePortName};
use kp_core::node::NodeContext;

/// mangle: short-circuit marks and drops of the `Local` policies (from `PREROUTING` and
/// `OUTPUT`).
pub const KUBE_IPVS_LOCAL: &str = "KUBE-IPVS-LOCAL";

/// The bit every short-circuit mark carries.
pub const SHORT_CIRCUIT_MARK: u32 = 0x0010_0000;
/// How many short-circuit marks there are (the index's range).
pub const SHORT_CIRCUIT_MARKS: u32 = 0x4000;
/// The mask that tells a short-circuit mark (`--mark SHORT_CIRCUIT_MARK/SHORT_CIRCUIT_MASK`):
/// bit 20 set, bits 14 to 19 clear.
pub const SHORT_CIRCUIT_MASK: u32 = 0x001f_c000;

/// Whether `mark` is one of the short-circuit marks (its virtual server is this mode's).
pub fn is_short_circuit_mark(mark: u32) -> bool {
    mark & SHORT_CIRCUIT_MASK == SHORT_CIRCUIT_MARK
}

/// One frontend address with a `Local` policy that needs more than its virtual server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalRule {
    /// The family.
    pub family: IpFamily,
    /// The frontend's address (each NodePort address for a NodePort).
    pub address: IpAddr,
    /// The protocol.
    pub protocol: Protocol,
    /// The port.
    pub port: u16,
    /// The short-circuit mark for pods and the node, if the frontend has one.
    pub mark: Option<u32>,
    /// Whether what is not short-circuited is dropped (no local endpoints).
    pub drop: bool,
}

/// The marks given out and the rules, for every Service port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocalPolicy {
    marks: BTreeMap<ServicePortName, u32>,
    used: BTreeSet<u32>,
    rules: BTreeSet<LocalRule>,
}

/// FNV-1a, 32 bits: a fixed hash, so a Service port gets the same mark in every process.
fn fnv(text: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in text.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

impl LocalPolicy {
    /// No marks and no rules (for a `static`).
    pub(crate) const EMPTY: LocalPolicy = LocalPolicy {
        marks: BTreeMap::new(),
        used: BTreeSet::new(),
        rules: BTreeSet::new(),
    };

    /// The short-circuit mark of Service port `name` (both families share it: IPVS looks a
    /// mark up per family). The first call for a port chooses it.
    pub fn mark(&mut self, name: &ServicePortName) -> u32 {
        if let Some(m) = self.marks.get(name) {
            return *m;
        }
        let proto = match name.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        };
        let mut index = fnv(&format!("{name}/{proto}")) % SHORT_CIRCUIT_MARKS;
        // Every index taken cannot happen below 16384 Local Service ports; if it did, the
        // port would share a mark, and its pods reach the other port's endpoints.
        for _ in 0..SHORT_CIRCUIT_MARKS {
            if !self.used.contains(&(SHORT_CIRCUIT_MARK | index)) {
                break;
            }
            index = (index + 1) % SHORT_CIRCUIT_MARKS;
        }
        let mark = SHORT_CIRCUIT_MARK | index;
        self.used.insert(mark);
        self.marks.insert(name.clone(), mark);
        mark
    }

    /// Records that Service port `name` holds `mark` (given out by another policy: a
    /// Service's share of the state keeps the names of the marks it uses).
    pub(crate) fn record(&mut self, name: &ServicePortName, mark: u32) {
        self.used.insert(mark);
        self.marks.insert(name.clone(), mark);
    }

    /// Gives Service port `name`'s mark back (its Service went, or no longer short-circuits
    /// it): another port may take it from now on.
    pub fn release(&mut self, name: &ServicePortName) {
        if let Some(mark) = self.marks.remove(name) {
            self.used.remove(&mark);
        }
    }

    /// The mark Service port `name` holds, if it holds one.
    pub fn mark_of(&self, name: &ServicePortName) -> Option<u32> {
        self.marks.get(name).copied()
    }

    /// The Service ports holding a mark.
    pub fn marked(&self) -> impl Iterator<Item = &ServicePortName> + '_ {
        self.marks.keys()
    }

    /// Adds a frontend address's rule.
    pub fn add(&mut self, rule: LocalRule) {
        self.rules.insert(rule);
    }

    /// Removes a frontend address's rule.
    pub(crate) fn remove(&mut self, rule: &LocalRule) {
        self.rules.remove(rule);
    }

    /// Every rule, both families.
    pub(crate) fn all_rules(&self) -> &BTreeSet<LocalRule> {
        &self.rules
    }

    /// The rules of `family`.
    pub fn rules(&self, family: IpFamily) -> impl Iterator<Item = &LocalRule> + '_ {
        self.rules.iter().filter(move |r| r.family == family)
    }

    /// Whether any frontend of `family` is short-circuited.
    pub fn short_circuits(&self, family: IpFamily) -> bool {
        self.rules(family).any(|r| r.mark.is_some())
    }

    /// The mangle table's input for `family`: [`KUBE_IPVS_LOCAL`] declared (so flushed) and
    /// refilled. Pod traffic is what detect-local recognises (`node.local_cidrs`, or
    /// `node.local_interface`: the interface it arrives on); without it,
    /// only the node's own traffic is short-circuited.
    pub fn render(&self, family: IpFamily, node: &NodeContext) -> String {
        let mut out = format!("*mangle\n:{KUBE_IPVS_LOCAL} - [0:0]\n");
        // What matches pod traffic: its source network(s), or with detect-local by interface
        // the interface it arrives on (`-i cbr0`, `-i veth+`).
        let pods: Vec<String> = match &node.local_interface {
            Some(i) => vec![i.iptables(false)],
            None => node
                .local_cidrs
                .iter()
                .filter(|n| IpFamily::of_net(n) == family && n.prefix_len() > 0)
                .map(|n| format!("-s {n}"))
                .collect(),
        };
        for r in self.rules(family) {
            let proto = match r.protocol {
                Protocol::Tcp => "tcp",
                Protocol::Udp => "udp",
                Protocol::Sctp => "sctp",
            };
            let m = format!("-d {} -p {proto} --dport {}", r.address, r.port);
            if let Some(mark) = r.mark {
                for from in &pods {
                    let _ = writeln!(
                        out,
                        "-A {KUBE_IPVS_LOCAL} {from} {m} -m comment --comment \"short-circuit pod traffic\" -j MARK --set-xmark {mark:#x}/0xffffffff"
                    );
                }
                let _ = writeln!(
                    out,
                    "-A {KUBE_IPVS_LOCAL} {m} -m addrtype --src-type LOCAL -m comment --comment \"short-circuit local traffic\" -j MARK --set-xmark {mark:#x}/0xffffffff"
                );
            }
            if r.drop {
                let unmarked = match r.mark {
                    Some(mark) => format!(" -m mark ! --mark {mark:#x}"),
                    None => String::new(),
                };
                let _ = writeln!(
                    out,
                    "-A {KUBE_IPVS_LOCAL} {m}{unmarked} -m comment --comment \"has no local endpoints\" -j DROP"
                );
            }
        }
        out.push_str("COMMIT\n");
        out
    }
}

/// The nat `KUBE-POSTROUTING` rule that masquerades the node's own short-circuited traffic
/// (upstream's "masquerade local traffic" of the external chain).
pub fn masquerade_rule(chain: &str) -> String {
    format!(
        "-A {chain} -m mark --mark {SHORT_CIRCUIT_MARK:#x}/{SHORT_CIRCUIT_MASK:#x} -m addrtype --src-type LOCAL -m comment --comment \"masquerade local traffic short-circuited\" -j MASQUERADE"
    )
}

#[cfg(test)]
mod tests;
