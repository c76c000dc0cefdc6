//! The fixed chains' rules and the shared chains' tails: masquerading, forwarding, the
//! ClusterIP rejects and unallocated-address drops, the jump to `KUBE-NODEPORTS`, and the jumps
//! from the built-in chains.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use kp_core::model::IpFamily;

use super::context::{NodePortDestinations, RenderContext};
use super::rule::{hex, host, loopback, net, reject, Rule};
use crate::names;

/// The last rules of filter `KUBE-SERVICES`: traffic still addressed to a ClusterIP after DNAT
/// was for a port no Service uses, and is rejected (upstream's nftables `cluster-ips-check`,
/// "Reject traffic to invalid ports of ClusterIPs"; upstream's iptables mode lets it through,
/// kube-proxy-rs gives every mode the nftables behaviour). `vips` are (Service, ClusterIP) of
/// the planner's family. The rules are [`Check`]s behind one early `RETURN`
/// ([`with_early_return`]); a rule for more destinations (say, dropping traffic to unallocated
/// addresses of the Service CIDRs) is one more `Check`, after the rejects.
///
/// After them, traffic still addressed to one of `service_cidrs` (the planner's family's) is
/// for an address no Service holds, and is dropped: upstream's nftables mode ("Drop traffic to
/// unallocated ClusterIPs"), given to every mode.
pub(crate) fn cluster_ip_rejects(
    family: IpFamily,
    vips: &[(String, IpAddr)],
    service_cidrs: &[IpNet],
) -> Vec<String> {
    let rejects = vips.iter().map(|(service, vip)| Check {
        dst: host(vip),
        rule: Rule::new()
            .dst(host(vip))
            .comment(&format!("{service} cluster IP: no Service port here"))
            .jump(reject(family))
            .build(),
    });
    let unallocated = service_cidrs.iter().map(|cidr| Check {
        dst: net(cidr),
        rule: Rule::new()
            .dst(net(cidr))
            .comment("drop traffic to unallocated ClusterIPs")
            .jump("DROP")
            .build(),
    });
    with_early_return(rejects.chain(unallocated).collect())
}

/// A rule of filter `KUBE-SERVICES`' tail that matches only traffic addressed inside `dst`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Check {
    /// Every destination the rule can match lies in this network.
    pub dst: IpNet,
    /// The rule.
    pub rule: String,
}

/// `checks` in order, behind one `! -d COVER -j RETURN`, so that connections not addressed to
/// any of them pass after one rule instead of one per check (filter `KUBE-SERVICES` sees every
/// new forwarded and locally sent connection), where `COVER` is the smallest network holding
/// every check's `dst`.
///
/// That network is the whole address space when the checks straddle its two halves (ClusterIPs
/// from unrelated Service ranges, say 10.96.0.0/12 and 192.168.0.0/16), and `! -d 0.0.0.0/0`
/// matches nothing and is refused by iptables-nft. Then the cover is taken over the half with
/// more checks, and the other half's checks come first: a packet matches checks of one half
/// only, so moving the other half's in front changes no verdict, and connections outside the
/// cover pass after those checks and the `RETURN`, not after all of them. A check of a
/// zero-length `dst` (in both halves) leaves no cover: no `RETURN` then.
pub(crate) fn with_early_return(checks: Vec<Check>) -> Vec<String> {
    let nets = || checks.iter().map(|c| c.dst);
    let Some(cover) = covering_net(nets()) else {
        return Vec::new();
    };
    let return_unless = |cover: IpNet| {
        Rule::new()
            .not_dst(cover)
            .comment("not addressed to a ClusterIP")
            .jump("RETURN")
            .build()
    };
    if cover.prefix_len() > 0 {
        let mut out = Vec::with_capacity(checks.len() + 1);
        out.push(return_unless(cover));
        out.extend(checks.into_iter().map(|c| c.rule));
        return out;
    }
    if nets().any(|n| n.prefix_len() == 0) {
        return checks.into_iter().map(|c| c.rule).collect();
    }
    // Every dst lies in one half: its first bit says which.
    let upper = |n: &IpNet| match n.network() {
        IpAddr::V4(a) => u32::from(a) >> 31 == 1,
        IpAddr::V6(a) => u128::from(a) >> 127 == 1,
    };
    let in_upper = checks.iter().filter(|c| upper(&c.dst)).count();
    let covered_half = in_upper > checks.len() - in_upper;
    let (covered, others): (Vec<Check>, Vec<Check>) = checks
        .into_iter()
        .partition(|c| upper(&c.dst) == covered_half);
    let mut out: Vec<String> = others.into_iter().map(|c| c.rule).collect();
    // Non-empty and within one half, so the cover is at least a /1.
    if let Some(cover) = covering_net(covered.iter().map(|c| c.dst)) {
        out.push(return_unless(cover));
    }
    out.extend(covered.into_iter().map(|c| c.rule));
    out
}

/// The smallest network that holds every network given (all of one family), or `None` without
/// any.
pub(crate) fn covering_net(nets: impl Iterator<Item = IpNet>) -> Option<IpNet> {
    let (mut lo, mut hi, mut v6) = (u128::MAX, 0u128, false);
    let mut any = false;
    for n in nets {
        let (first, last) = match (n.network(), n.broadcast()) {
            (IpAddr::V4(a), IpAddr::V4(b)) => (u128::from(u32::from(a)), u128::from(u32::from(b))),
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                v6 = true;
                (u128::from(a), u128::from(b))
            }
            _ => continue,
        };
        lo = lo.min(first);
        hi = hi.max(last);
        any = true;
    }
    if !any {
        return None;
    }
    let bits: u32 = if v6 { 128 } else { 32 };
    let differing = 128 - (lo ^ hi).leading_zeros();
    let prefix = (bits - differing.min(bits)) as u8;
    let addr = if v6 {
        IpAddr::V6(Ipv6Addr::from(lo))
    } else {
        IpAddr::V4(Ipv4Addr::from(lo as u32))
    };
    IpNet::new(addr, prefix).ok().map(|n| n.trunc())
}

/// nat `KUBE-POSTROUTING`.
pub(crate) fn postrouting(mark: u32) -> Vec<String> {
    let m = hex(mark);
    vec![
        Rule::new()
            .m(&format!("-m mark ! --mark {m}/{m}"))
            .jump("RETURN")
            .build(),
        Rule::new()
            .jump(&format!("MARK --set-xmark {m}/0x0"))
            .build(),
        Rule::new()
            .comment("kubernetes service traffic requiring SNAT")
            .jump("MASQUERADE --random-fully")
            .build(),
    ]
}

/// nat `KUBE-MARK-MASQ`.
pub(crate) fn mark_masq(mark: u32) -> Vec<String> {
    let m = hex(mark);
    vec![Rule::new()
        .jump(&format!("MARK --set-xmark {m}/{m}"))
        .build()]
}

/// filter `KUBE-FORWARD`.
pub(crate) fn forward(mark: u32) -> Vec<String> {
    let m = hex(mark);
    vec![
        Rule::new()
            .m("-m conntrack --ctstate INVALID")
            .jump("DROP")
            .build(),
        Rule::new()
            .comment("kubernetes forwarding rules")
            .m(&format!("-m mark --mark {m}/{m}"))
            .jump("ACCEPT")
            .build(),
        Rule::new()
            .comment("kubernetes forwarding conntrack rule")
            .m("-m conntrack --ctstate RELATED,ESTABLISHED")
            .jump("ACCEPT")
            .build(),
    ]
}

/// filter `KUBE-FIREWALL` (IPv4 with localhost NodePorts): localhost-destined traffic from
/// elsewhere is dropped, so `route_localnet` does not expose loopback services.
pub(crate) fn kubelet_firewall() -> Vec<String> {
    let lo = loopback(IpFamily::V4);
    vec![Rule::new()
        .not_src(lo)
        .dst(lo)
        .comment("block incoming localnet connections")
        .m("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT")
        .jump("DROP")
        .build()]
}

/// The last rules of nat `KUBE-SERVICES`: traffic to this node's addresses goes on to
/// `KUBE-NODEPORTS`.
pub(crate) fn nodeports_jump(ctx: &RenderContext) -> Vec<String> {
    const COMMENT: &str =
        "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
    let local = |r: Rule| {
        r.comment(COMMENT)
            .m("-m addrtype --dst-type LOCAL")
            .jump(names::KUBE_NODEPORTS)
            .build()
    };
    match &ctx.node_ports {
        NodePortDestinations::AllLocal => {
            let rule = if ctx.localhost_node_ports {
                Rule::new()
            } else {
                Rule::new().not_dst(net(&loopback(ctx.family)))
            };
            vec![local(rule)]
        }
        NodePortDestinations::Cidrs(cidrs) => cidrs
            .iter()
            .map(|c| local(Rule::new().dst(net(c))))
            .collect(),
    }
}

/// A rule that a built-in chain needs to reach one of ours (upstream's `iptablesJumpChains`,
/// plus kubelet's `KUBE-FIREWALL` jumps when this planner owns that chain).
pub(crate) fn jump_rules(localhost_firewall: bool) -> Vec<(&'static str, &'static str, String)> {
    let new_conn = "-m conntrack --ctstate NEW";
    let jump = |conntrack: bool, comment: &str, target: &str| {
        let r = if conntrack {
            Rule::new().m(new_conn)
        } else {
            Rule::new()
        };
        r.comment(comment).jump(target).build()
    };
    let ext = "kubernetes externally-visible service portals";
    let portals = "kubernetes service portals";
    let firewall = "kubernetes load balancer firewall";
    let mut v = vec![
        (
            "filter",
            "INPUT",
            jump(true, ext, names::KUBE_EXTERNAL_SERVICES),
        ),
        (
            "filter",
            "FORWARD",
            jump(true, ext, names::KUBE_EXTERNAL_SERVICES),
        ),
        (
            "filter",
            "INPUT",
            jump(
                false,
                "kubernetes health check service ports",
                names::KUBE_NODEPORTS,
            ),
        ),
        (
            "filter",
            "FORWARD",
            jump(true, portals, names::KUBE_SERVICES),
        ),
        (
            "filter",
            "OUTPUT",
            jump(true, portals, names::KUBE_SERVICES),
        ),
        (
            "filter",
            "FORWARD",
            jump(false, "kubernetes forwarding rules", names::KUBE_FORWARD),
        ),
        (
            "filter",
            "INPUT",
            jump(true, firewall, names::KUBE_PROXY_FIREWALL),
        ),
        (
            "filter",
            "OUTPUT",
            jump(true, firewall, names::KUBE_PROXY_FIREWALL),
        ),
        (
            "filter",
            "FORWARD",
            jump(true, firewall, names::KUBE_PROXY_FIREWALL),
        ),
        ("nat", "OUTPUT", jump(false, portals, names::KUBE_SERVICES)),
        (
            "nat",
            "PREROUTING",
            jump(false, portals, names::KUBE_SERVICES),
        ),
        (
            "nat",
            "POSTROUTING",
            jump(
                false,
                "kubernetes postrouting rules",
                names::KUBE_POSTROUTING,
            ),
        ),
    ];
    if localhost_firewall {
        let to_firewall = Rule::new().jump(names::KUBE_FIREWALL).build();
        v.push(("filter", "INPUT", to_firewall.clone()));
        v.push(("filter", "OUTPUT", to_firewall));
    }
    v
}
