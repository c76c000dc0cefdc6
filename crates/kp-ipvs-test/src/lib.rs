//! Test support for the ipvs mode: [`IpvsTracer`] follows a connection's first packet through
//! what the mode programs — its iptables chains (nat, filter and the `Local` policies' mangle
//! chain, replayed by `kp_iptables_test`'s tracer), the ipsets those chains match, and IPVS's
//! virtual servers on the addresses bound to `kube-ipvs0` and the node's — and answers in
//! `kp_core::flow` terms, so the packet-flow table (`kp-flows`) runs over it as over every
//! other mode's tracer.
//!
//! [`IpvsTracer::planned`] builds it from a planner's state (what a sync would program);
//! [`IpvsTracer::new`] from parts, such as a dump of the kernel's. What it leaves to others:
//! planning (`kp-ipvs-plan`), the kernel (`kp-ipvs`), the rows (`kp-flows`).
//!
//! IPVS as modelled: a packet to a local address that a virtual server holds (its firewall
//! mark first, then its address, protocol and port) is sent to one of the real servers of
//! weight above zero, each as likely as its weight says, after the filter table's `INPUT` (or,
//! for the node's own packet, after nat `OUTPUT`), then through filter `OUTPUT` and nat
//! `POSTROUTING` (where `KUBE-POSTROUTING` masquerades it when marked). A virtual server
//! without such a real server answers with ICMP port unreachable: a reject. Persistence is
//! ClientIP affinity. The scheduler is not modelled beyond weights: every real server that can
//! be picked is listed.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use kp_core::flow::{Ingress, Packet, Tracer, Verdict};
use kp_core::model::IpFamily;
use kp_core::node::NodeContext;
use kp_iptables_plan::PlanConfig;
use kp_iptables_test::tracer::{Beyond, IptablesTracer, Probe, Scheduled, SetSide, TraceError};
use kp_ipvs_plan::ipset::{Entry, SetName, SetType, Sets};
use kp_ipvs_plan::local::LocalPolicy;
use kp_ipvs_plan::planner::Planner;
use kp_ipvs_plan::{rules, Planned as _};
use kp_netlink::ipvs::abi;
pub use kp_netlink::ipvs::{Destination, Service, ServiceKey};

/// The node's state beyond iptables' tables, as the iptables tracer consults it: the mode's
/// ipsets of each family and IPVS's virtual servers.
#[derive(Clone, Default)]
pub struct IpvsNode {
    sets: Vec<Sets>,
    virtual_servers: BTreeMap<ServiceKey, (Service, Vec<Destination>)>,
}

impl fmt::Debug for IpvsNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpvsNode")
            .field(
                "families",
                &self.sets.iter().map(Sets::family).collect::<Vec<_>>(),
            )
            .field("virtual_servers", &self.virtual_servers.len())
            .finish()
    }
}

impl IpvsNode {
    /// A node holding `sets` (one per family) and `virtual_servers` with their real servers.
    pub fn new(
        sets: Vec<Sets>,
        virtual_servers: impl IntoIterator<Item = (Service, Vec<Destination>)>,
    ) -> IpvsNode {
        IpvsNode {
            sets,
            virtual_servers: virtual_servers
                .into_iter()
                .map(|(s, d)| (s.key, (s, d)))
                .collect(),
        }
    }

    /// What `planner` planned: its sets and virtual servers.
    pub fn planned(planner: &Planner) -> IpvsNode {
        IpvsNode::new(
            planner.sets().to_vec(),
            planner
                .virtual_servers()
                .map(|(_, vs)| (vs.service.clone(), vs.destinations.values().collect())),
        )
    }

    /// The sets, one per family.
    pub fn sets(&self) -> &[Sets] {
        &self.sets
    }

    /// The virtual servers, by key.
    pub fn virtual_servers(&self) -> &BTreeMap<ServiceKey, (Service, Vec<Destination>)> {
        &self.virtual_servers
    }

    fn sets_of(&self, family: IpFamily) -> Option<&Sets> {
        self.sets.iter().find(|s| s.family() == family)
    }
}

impl Beyond for IpvsNode {
    fn set_contains(&self, set: &str, sides: &[SetSide], p: &Probe) -> bool {
        let family = IpFamily::of(&p.dst);
        let (Some(sets), Some(name)) = (self.sets_of(family), SetName::parse(set, family)) else {
            return false;
        };
        let addr = |i: usize| match sides.get(i) {
            Some(SetSide::Src) => Some(p.src),
            Some(SetSide::Dst) => Some(p.dst),
            None => None,
        };
        let port = |i: usize| match sides.get(i) {
            Some(SetSide::Src) => Some(p.sport),
            Some(SetSide::Dst) => Some(p.dport),
            None => None,
        };
        let entries = sets.get(name);
        // Each field the set type has takes the next direction; a lookup with fewer
        // directions than fields matches nothing (the kernel refuses such a rule).
        let wanted = match name.set_type() {
            SetType::BitmapPort => port(0).map(Entry::Port),
            SetType::HashIp => addr(0).map(Entry::Ip),
            SetType::HashIpPort => addr(0)
                .zip(port(1))
                .map(|(a, n)| Entry::IpPort(a, p.protocol, n)),
            SetType::HashIpPortIp => addr(0)
                .zip(port(1))
                .zip(addr(2))
                .map(|((a, n), b)| Entry::IpPortIp(a, p.protocol, n, b)),
            SetType::HashIpPortNet => {
                let (Some(a), Some(n), Some(b)) = (addr(0), port(1), addr(2)) else {
                    return false;
                };
                return entries.iter().any(|e| {
                    matches!(e, Entry::IpPortNet(ea, ep, en, net)
                        if ea == a && ep == p.protocol && en == n && net.contains(&b))
                });
            }
        };
        wanted.is_some_and(|e| entries.contains(&e))
    }

    fn virtual_server(&self, p: &Probe) -> Option<Scheduled> {
        let ipv6 = p.dst.is_ipv6();
        let by_mark = (p.mark != 0)
            .then(|| {
                self.virtual_servers
                    .get(&ServiceKey::Fwmark { mark: p.mark, ipv6 })
            })
            .flatten();
        let (service, reals) = by_mark.or_else(|| {
            self.virtual_servers.get(&ServiceKey::Addr {
                addr: p.dst,
                protocol: kp_ipvs_plan::protocol(p.protocol),
                port: p.dport,
            })
        })?;
        let total: u64 = reals.iter().map(|d| u64::from(d.weight)).sum();
        let reals = reals
            .iter()
            .filter(|d| d.weight > 0)
            .map(|d| ((d.addr, d.port), d.weight as f64 / total as f64))
            .collect();
        let persistence =
            (service.flags & abi::IP_VS_SVC_F_PERSISTENT != 0).then_some(service.timeout);
        Some(Scheduled {
            reals,
            persistence,
            rule: format!("ipvs {} {}", service.key, service.scheduler),
        })
    }
}

/// The ipvs mode's node, traced: its iptables chains over [`IpvsNode`].
#[derive(Clone, Debug)]
pub struct IpvsTracer {
    iptables: IptablesTracer,
    node: Arc<IpvsNode>,
}

/// What the mode's iptables holds for one family: the chains as `iptables-restore` input (nat,
/// filter, and mangle with the `Local` policies of `local`) and the jump rules from the
/// built-in chains, each inserted first in turn as the mode makes sure of them.
pub fn restore_input(
    sets: &Sets,
    config: &PlanConfig,
    node: &NodeContext,
    local: &LocalPolicy,
) -> String {
    let mut text = rules::render_with(sets, config, node, Some(local));
    for table in ["nat", "filter", "mangle"] {
        text.push_str(&format!("*{table}\n"));
        for j in rules::jump_rules().iter().filter(|j| j.table == table) {
            text.push_str(&format!("-I {} {}\n", j.chain, j.args));
        }
        text.push_str("COMMIT\n");
    }
    text
}

impl IpvsTracer {
    /// A tracer of a node whose own addresses are `local` (those of its interfaces and those
    /// bound to `kube-ipvs0`), holding `node`'s sets and virtual servers and the chains of
    /// `restore` (per family, `iptables-restore` input: see [`restore_input`]), with the
    /// node's links `ingress` when detect-local is by interface.
    pub fn new(
        local: Vec<IpAddr>,
        node: IpvsNode,
        restore: &[(IpFamily, String)],
        ingress: Option<Ingress>,
    ) -> Result<IpvsTracer, TraceError> {
        let node = Arc::new(node);
        let mut iptables = IptablesTracer::new(local).with_beyond(node.clone());
        if let Some(links) = ingress {
            iptables = iptables.with_ingress(links);
        }
        for (family, text) in restore {
            iptables.apply(*family, text)?;
        }
        Ok(IpvsTracer { iptables, node })
    }

    /// A tracer of what `planner` planned (after a sync), on a node whose interfaces hold
    /// `interface_addresses`, with the iptables settings `config_of` gives each family and the
    /// node context `node`.
    pub fn planned(
        planner: &Planner,
        interface_addresses: &[IpAddr],
        config_of: impl Fn(IpFamily) -> PlanConfig,
        node: &NodeContext,
        ingress: Option<Ingress>,
    ) -> Result<IpvsTracer, TraceError> {
        let held = IpvsNode::planned(planner);
        IpvsTracer::planned_over(planner, interface_addresses, config_of, node, ingress, held)
    }

    /// [`IpvsTracer::planned`]'s chains and addresses over sets and virtual servers `held`
    /// (the planner's, or others: what a node whose IPVS or sets went wrong would hold).
    pub fn planned_over(
        planner: &Planner,
        interface_addresses: &[IpAddr],
        config_of: impl Fn(IpFamily) -> PlanConfig,
        node: &NodeContext,
        ingress: Option<Ingress>,
        held: IpvsNode,
    ) -> Result<IpvsTracer, TraceError> {
        let mut local: Vec<IpAddr> = interface_addresses.to_vec();
        local.extend(planner.bind_addresses().iter().copied());
        let restore: Vec<(IpFamily, String)> = planner
            .sets()
            .iter()
            .map(|s| {
                let family = s.family();
                (
                    family,
                    restore_input(s, &config_of(family), node, planner.local()),
                )
            })
            .collect();
        IpvsTracer::new(local, held, &restore, ingress)
    }

    /// The iptables tracer underneath (its chains, and every branch of a trace with the rules
    /// on its way: [`IptablesTracer::branches`]).
    pub fn iptables(&self) -> &IptablesTracer {
        &self.iptables
    }

    /// The sets and virtual servers.
    pub fn node(&self) -> &IpvsNode {
        &self.node
    }

    /// What happens to `packet`, or why the trace failed ([`IptablesTracer::trace_all`]).
    pub fn trace_all(&self, packet: &Packet) -> Result<Verdict, TraceError> {
        self.iptables.trace_all(packet)
    }
}

impl Tracer for IpvsTracer {
    /// [`IpvsTracer::trace_all`]; a failed trace answers as [`IptablesTracer`]'s does.
    fn trace(&self, packet: &Packet) -> Verdict {
        self.iptables.trace(packet)
    }
}
