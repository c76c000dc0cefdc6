//! The ipvs mode's iptables rules (upstream's `writeIptablesRules` in
//! `pkg/proxy/ipvs/proxier.go`): a fixed set of chains whose rules match the ipsets of
//! [`crate::ipset`], so they change only when a set goes from empty to non-empty or back.
//! Rendered as one `iptables-restore --noflush` input (nat, then filter) that rewrites every
//! chain it declares, plus the jump rules from the built-in chains the applier makes sure of.
//!
//! The mark, the masquerade choice and detect-local come from the iptables mode's
//! [`PlanConfig`] and [`NodeContext`]; the chain names shared with it come from its `names`.

use std::fmt::Write;

use kp_core::model::IpFamily;
use kp_core::node::NodeContext;
use kp_iptables_plan::names::{
    KUBE_FORWARD, KUBE_MARK_MASQ, KUBE_POSTROUTING, KUBE_PROXY_FIREWALL, KUBE_SERVICES,
};
use kp_iptables_plan::{JumpRule, PlanConfig};

use crate::ipset::{SetName, SetType, Sets};
use crate::local::{self, LocalPolicy, KUBE_IPVS_LOCAL};

/// nat: NodePort steering (masquerade unless `Local`); filter: health check node ports.
pub const KUBE_NODE_PORT: &str = "KUBE-NODE-PORT";
/// nat: LoadBalancer IPs (source-range check, masquerade unless `Local`).
pub const KUBE_LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
/// filter: drops LoadBalancer traffic that no allowed source range returned.
pub const KUBE_SOURCE_RANGES_FIREWALL: &str = "KUBE-SOURCE-RANGES-FIREWALL";
/// filter INPUT: rejects new connections to a bound service address on a port no Service has.
pub const KUBE_IPVS_FILTER: &str = "KUBE-IPVS-FILTER";
/// filter OUTPUT: the node's traffic to unallocated ClusterIPs dropped (upstream: no rules).
pub const KUBE_IPVS_OUT_FILTER: &str = "KUBE-IPVS-OUT-FILTER";

/// The chains of each table, in declaration order.
const NAT_CHAINS: [&str; 5] = [
    KUBE_SERVICES,
    KUBE_POSTROUTING,
    KUBE_NODE_PORT,
    KUBE_LOAD_BALANCER,
    KUBE_MARK_MASQ,
];
const FILTER_CHAINS: [&str; 6] = [
    KUBE_FORWARD,
    KUBE_NODE_PORT,
    KUBE_PROXY_FIREWALL,
    KUBE_SOURCE_RANGES_FIREWALL,
    KUBE_IPVS_FILTER,
    KUBE_IPVS_OUT_FILTER,
];

/// Whether `chain` is one of the chains this mode writes (in nat, filter or mangle).
pub fn is_owned_chain(chain: &str) -> bool {
    NAT_CHAINS.contains(&chain) || FILTER_CHAINS.contains(&chain) || chain == KUBE_IPVS_LOCAL
}

/// Which table a rule from a set goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tbl {
    Nat,
    Filter,
}

/// Upstream's `ipsetWithIptablesChain`: a set matched in a chain, with a protocol match for
/// the port bitmaps, jumping to a target; emitted only when the set has entries.
const SET_RULES: [(SetName, Tbl, &str, &str, &str, &str); 12] = [
    (
        SetName::LoopBack,
        Tbl::Nat,
        KUBE_POSTROUTING,
        "MASQUERADE",
        "dst,dst,src",
        "",
    ),
    (
        SetName::LoadBalancer,
        Tbl::Nat,
        KUBE_SERVICES,
        KUBE_LOAD_BALANCER,
        "dst,dst",
        "",
    ),
    (
        SetName::LoadBalancerFw,
        Tbl::Filter,
        KUBE_PROXY_FIREWALL,
        KUBE_SOURCE_RANGES_FIREWALL,
        "dst,dst",
        "",
    ),
    (
        SetName::LoadBalancerSourceCidr,
        Tbl::Filter,
        KUBE_SOURCE_RANGES_FIREWALL,
        "RETURN",
        "dst,dst,src",
        "",
    ),
    (
        SetName::LoadBalancerSourceIp,
        Tbl::Filter,
        KUBE_SOURCE_RANGES_FIREWALL,
        "RETURN",
        "dst,dst,src",
        "",
    ),
    (
        SetName::LoadBalancerLocal,
        Tbl::Nat,
        KUBE_LOAD_BALANCER,
        "RETURN",
        "dst,dst",
        "",
    ),
    (
        SetName::NodePortLocalTcp,
        Tbl::Nat,
        KUBE_NODE_PORT,
        "RETURN",
        "dst",
        "tcp",
    ),
    (
        SetName::NodePortTcp,
        Tbl::Nat,
        KUBE_NODE_PORT,
        KUBE_MARK_MASQ,
        "dst",
        "tcp",
    ),
    (
        SetName::NodePortLocalUdp,
        Tbl::Nat,
        KUBE_NODE_PORT,
        "RETURN",
        "dst",
        "udp",
    ),
    (
        SetName::NodePortUdp,
        Tbl::Nat,
        KUBE_NODE_PORT,
        KUBE_MARK_MASQ,
        "dst",
        "udp",
    ),
    (
        SetName::NodePortLocalSctp,
        Tbl::Nat,
        KUBE_NODE_PORT,
        "RETURN",
        "dst,dst",
        "sctp",
    ),
    (
        SetName::NodePortSctp,
        Tbl::Nat,
        KUBE_NODE_PORT,
        KUBE_MARK_MASQ,
        "dst,dst",
        "sctp",
    ),
];

/// The rules from the built-in chains into ours (upstream's `iptablesJumpChain` for ipvs).
pub fn jump_rules() -> Vec<JumpRule> {
    let j = |table, chain, target: &str, comment: &str| JumpRule {
        table,
        chain,
        args: format!("-m comment --comment \"{comment}\" -j {target}"),
    };
    vec![
        j("nat", "OUTPUT", KUBE_SERVICES, "kubernetes service portals"),
        j(
            "nat",
            "PREROUTING",
            KUBE_SERVICES,
            "kubernetes service portals",
        ),
        j(
            "nat",
            "POSTROUTING",
            KUBE_POSTROUTING,
            "kubernetes postrouting rules",
        ),
        j(
            "filter",
            "FORWARD",
            KUBE_FORWARD,
            "kubernetes forwarding rules",
        ),
        j(
            "filter",
            "INPUT",
            KUBE_NODE_PORT,
            "kubernetes health check rules",
        ),
        j(
            "filter",
            "INPUT",
            KUBE_PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
        j(
            "filter",
            "FORWARD",
            KUBE_PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
        j(
            "filter",
            "INPUT",
            KUBE_IPVS_FILTER,
            "kubernetes ipvs access filter",
        ),
        j(
            "filter",
            "OUTPUT",
            KUBE_IPVS_OUT_FILTER,
            "kubernetes ipvs access filter",
        ),
        j(
            "mangle",
            "PREROUTING",
            KUBE_IPVS_LOCAL,
            "kubernetes local traffic policies",
        ),
        j(
            "mangle",
            "OUTPUT",
            KUBE_IPVS_LOCAL,
            "kubernetes local traffic policies",
        ),
    ]
}

/// The `iptables-restore --noflush` input for `sets`' family: every chain of the mode
/// declared (so flushed) and refilled, nat then filter.
pub fn render(sets: &Sets, config: &PlanConfig, node: &NodeContext) -> String {
    render_with(sets, config, node, None)
}

/// [`render`], and with `local` the `Local` policies' mangle chain after the filter table
/// (see [`crate::local`]) and, when a frontend of the family is short-circuited, the masquerade
/// of the node's short-circuited traffic first in `KUBE-POSTROUTING`.
pub fn render_with(
    sets: &Sets,
    config: &PlanConfig,
    node: &NodeContext,
    local: Option<&LocalPolicy>,
) -> String {
    let family = sets.family();
    let name = |s: SetName| s.name(family);
    let mark = config.mark();
    let mut nat: Vec<String> = Vec::new();
    let mut filter: Vec<String> = Vec::new();

    let lo = match family {
        IpFamily::V4 => "127.0.0.0/8",
        IpFamily::V6 => "::1/128",
    };
    nat.push(format!("-A {KUBE_SERVICES} -s {lo} -j RETURN"));
    for (set, tbl, chain, target, match_type, p) in SET_RULES {
        if sets.is_empty(set) {
            continue;
        }
        let proto = if p.is_empty() {
            String::new()
        } else {
            format!(" -p {p}")
        };
        let rule = format!(
            "-A {chain}{proto} -m comment --comment \"{}\" -m set --match-set {} {match_type} -j {target}",
            set.comment(),
            name(set)
        );
        match tbl {
            Tbl::Nat => nat.push(rule),
            Tbl::Filter => filter.push(rule),
        }
    }
    if !sets.is_empty(SetName::ClusterIp) {
        let head = format!(
            "-A {KUBE_SERVICES} -m comment --comment \"{}\" -m set --match-set {}",
            SetName::ClusterIp.comment(),
            name(SetName::ClusterIp)
        );
        let local: Vec<_> = node
            .local_cidrs
            .iter()
            .filter(|n| IpFamily::of_net(n) == family && n.prefix_len() > 0)
            .collect();
        if config.masquerade_all {
            nat.push(format!("{head} dst,dst -j {KUBE_MARK_MASQ}"));
        } else if let Some(i) = &node.local_interface {
            // Detect-local by interface: what did not arrive on the pods' interface(s) (the
            // node's own traffic arrives on none) is masqueraded, as upstream's ipvs proxier
            // writes `IfNotLocal()`.
            nat.push(format!(
                "{head} dst,dst {} -j {KUBE_MARK_MASQ}",
                i.iptables(true)
            ));
        } else if !local.is_empty() {
            // Traffic to a ClusterIP from outside the pod network is masqueraded (it may have
            // been routed here by a static route and go to another node).
            for net in local {
                nat.push(format!("{head} dst,dst ! -s {net} -j {KUBE_MARK_MASQ}"));
            }
        } else {
            // Without detect-local, the node's own connections (sourced from a VIP on
            // kube-ipvs0) are masqueraded.
            nat.push(format!("{head} src,dst -j {KUBE_MARK_MASQ}"));
        }
    }
    for (set, masq) in [
        (SetName::ExternalIp, true),
        (SetName::ExternalIpLocal, false),
    ] {
        if sets.is_empty(set) {
            continue;
        }
        let head = format!(
            "-A {KUBE_SERVICES} -m comment --comment \"{}\" -m set --match-set {} dst,dst",
            set.comment(),
            name(set)
        );
        if masq {
            nat.push(format!("{head} -j {KUBE_MARK_MASQ}"));
        }
        // From off the machine (not a bridged pod, not a local process), or to an address
        // the node treats as its own: accepted, so IPVS sees it.
        nat.push(format!(
            "{head} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"
        ));
        nat.push(format!("{head} -m addrtype --dst-type LOCAL -j ACCEPT"));
    }
    nat.push(format!(
        "-A {KUBE_SERVICES} -m addrtype --dst-type LOCAL -j {KUBE_NODE_PORT}"
    ));
    nat.push(format!("-A {KUBE_LOAD_BALANCER} -j {KUBE_MARK_MASQ}"));
    filter.push(format!("-A {KUBE_SOURCE_RANGES_FIREWALL} -j DROP"));
    for set in [SetName::ClusterIp, SetName::LoadBalancer] {
        if !sets.is_empty(set) {
            let m = match set.set_type() {
                SetType::BitmapPort => "dst",
                _ => "dst,dst",
            };
            nat.push(format!(
                "-A {KUBE_SERVICES} -m set --match-set {} {m} -j ACCEPT",
                name(set)
            ));
        }
    }
    filter.push(format!(
        "-A {KUBE_FORWARD} -m conntrack --ctstate INVALID -j DROP"
    ));
    // Traffic to an address of the Service CIDRs that no Service holds (not bound, so not in
    // KUBE-IPVS-IPS) would be routed out: dropped, forwarded from pods or sent by the node.
    // Upstream's nftables behaviour, which kube-proxy-rs gives every mode; upstream's ipvs
    // mode lets it through.
    for net in node
        .service_cidrs
        .iter()
        .filter(|n| IpFamily::of_net(n) == family && n.prefix_len() > 0)
    {
        for chain in [KUBE_FORWARD, KUBE_IPVS_OUT_FILTER] {
            filter.push(format!(
                "-A {chain} -d {net} -m set ! --match-set {} dst -m comment --comment \"drop traffic to unallocated ClusterIPs\" -j DROP",
                name(SetName::IpvsIps)
            ));
        }
    }
    filter.push(format!(
        "-A {KUBE_FORWARD} -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark:#x}/{mark:#x} -j ACCEPT"
    ));
    filter.push(format!(
        "-A {KUBE_FORWARD} -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    ));
    filter.push(format!(
        "-A {KUBE_NODE_PORT} -m comment --comment \"{}\" -m set --match-set {} dst -j ACCEPT",
        SetName::HealthCheckNodePort.comment(),
        name(SetName::HealthCheckNodePort)
    ));
    for (set, m) in [
        (SetName::LoadBalancer, "dst,dst"),
        (SetName::ClusterIp, "dst,dst"),
        (SetName::ExternalIp, "dst,dst"),
        (SetName::ExternalIpLocal, "dst,dst"),
        (SetName::HealthCheckNodePort, "dst"),
    ] {
        filter.push(format!(
            "-A {KUBE_IPVS_FILTER} -m set --match-set {} {m} -j RETURN",
            name(set)
        ));
    }
    filter.push(format!(
        "-A {KUBE_IPVS_FILTER} -m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT",
        name(SetName::IpvsIps)
    ));
    if local.is_some_and(|l| l.short_circuits(family)) {
        nat.push(local::masquerade_rule(KUBE_POSTROUTING));
    }
    nat.push(format!(
        "-A {KUBE_POSTROUTING} -m mark ! --mark {mark:#x}/{mark:#x} -j RETURN"
    ));
    nat.push(format!(
        "-A {KUBE_POSTROUTING} -j MARK --xor-mark {mark:#x}"
    ));
    nat.push(format!(
        "-A {KUBE_POSTROUTING} -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE"
    ));
    nat.push(format!("-A {KUBE_MARK_MASQ} -j MARK --or-mark {mark:#x}"));

    let mut out = String::new();
    for (table, chains, rules) in [
        ("nat", &NAT_CHAINS[..], &nat),
        ("filter", &FILTER_CHAINS[..], &filter),
    ] {
        let _ = writeln!(out, "*{table}");
        for c in chains {
            let _ = writeln!(out, ":{c} - [0:0]");
        }
        for r in rules.iter() {
            let _ = writeln!(out, "{r}");
        }
        let _ = writeln!(out, "COMMIT");
    }
    if let Some(l) = local {
        out.push_str(&l.render(family, node));
    }
    out
}

#[cfg(test)]
mod tests;
