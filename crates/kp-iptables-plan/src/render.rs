//! Rule text, in the canonical form `iptables-save` prints.
//!
//! Every rule is rendered exactly as `iptables-save` (legacy and nft backends alike, 1.8.9)
//! prints it back, so the applier can compare a table read back with what was planned, string
//! for string. That form differs from what upstream writes into `iptables-restore` in argument
//! order and spelling, never in meaning:
//! - the address and protocol part comes first, in the order `-s`, `-d`, `-p`, then the `-m`
//!   matches in the order given, then `-j` (upstream writes `-m comment … -m tcp -p tcp -d VIP
//!   --dport P`; save prints `-d VIP/32 -p tcp -m comment … -m tcp --dport P`);
//! - addresses carry their prefix length (`/32`, `/128`), networks are truncated to it;
//! - a comment is quoted unless it is made only of letters, digits, `-` and `_`;
//! - `MARK --or-mark M` prints as `--set-xmark M/M`, `--xor-mark M` as `--set-xmark M/0x0`;
//! - `recent` prints its defaults (`--mask 255.255.255.255 --rsource`) and puts `--name` after
//!   `--set`/`--rcheck --seconds T --reap`/`--update --seconds T --reap`;
//! - `REJECT` prints its default `--reject-with icmp-port-unreachable`
//!   (`icmp6-port-unreachable` for IPv6);
//! - `statistic --probability` is stored by the kernel as a 31-bit fraction and printed with 11
//!   decimals: upstream's `0.3333333333` reads back as `0.33333333349`. [`probability`] renders
//!   the value the kernel holds after upstream's 10-decimal input.
//!
//! The per-Service-port rules mirror upstream's `syncProxyRules` and
//! `writeServiceToEndpointRules`, except that only endpoints on this node get a `KUBE-SEP-…`
//! chain (see [`endpoint_rules`]).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort};
use kp_core::node::NodeContext;
use kp_core::select::SelectedEndpoints;

use crate::names::{self, ServiceChainNames};
use crate::planner::PlanConfig;
use crate::restore::{ChainWrite, Table};

/// One rule under construction. Whatever order the parts are added in, [`Rule::build`] puts
/// them in `iptables-save`'s order: `-s`, `-d`, `-p`, the matches in the order added, `-j`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Rule {
    src: Option<(bool, String)>,
    dst: Option<(bool, String)>,
    proto: Option<Protocol>,
    matches: String,
    target: String,
}

impl Rule {
    pub(crate) fn new() -> Self {
        Rule::default()
    }

    /// `-s NET`.
    pub(crate) fn src(mut self, net: String) -> Self {
        self.src = Some((false, net));
        self
    }

    /// `! -s NET`.
    pub(crate) fn not_src(mut self, net: String) -> Self {
        self.src = Some((true, net));
        self
    }

    /// `-d NET`.
    pub(crate) fn dst(mut self, net: String) -> Self {
        self.dst = Some((false, net));
        self
    }

    /// `! -d NET`.
    pub(crate) fn not_dst(mut self, net: String) -> Self {
        self.dst = Some((true, net));
        self
    }

    /// `-m comment --comment TEXT`.
    pub(crate) fn comment(mut self, text: &str) -> Self {
        let _ = write!(self.matches, " -m comment --comment {}", save_string(text));
        self
    }

    /// A comment, unless `text` is `None` (large-cluster mode).
    pub(crate) fn maybe_comment(self, text: Option<&str>) -> Self {
        match text {
            Some(t) => self.comment(t),
            None => self,
        }
    }

    /// `-p P` alone: what a DNAT to a port needs. Upstream also loads the protocol's match
    /// (`-m P -p P`) without options, which matches every packet `-p P` lets through; leaving it
    /// out saves an xtables match per endpoint rule: 12% of a full iptables-nft load at 10k
    /// Services, and one match per new connection.
    pub(crate) fn proto(mut self, p: Protocol) -> Self {
        self.proto = Some(p);
        self
    }

    /// `-p P` and `-m P --dport PORT`.
    pub(crate) fn dport(mut self, p: Protocol, port: u16) -> Self {
        self.proto = Some(p);
        let _ = write!(self.matches, " -m {} --dport {port}", p.as_lower());
        self
    }

    /// Any other match, as `-m NAME OPTIONS`.
    pub(crate) fn m(mut self, text: &str) -> Self {
        self.matches.push(' ');
        self.matches.push_str(text);
        self
    }

    /// `-j TARGET [OPTIONS]`.
    pub(crate) fn jump(mut self, target: &str) -> Self {
        self.target = format!(" -j {target}");
        self
    }

    /// The rule's arguments (what follows `-A CHAIN `).
    pub(crate) fn build(self) -> String {
        let mut out = String::new();
        for (flag, part) in [("-s", &self.src), ("-d", &self.dst)] {
            if let Some((neg, net)) = part {
                let _ = write!(out, " {}{flag} {net}", if *neg { "! " } else { "" });
            }
        }
        if let Some(p) = self.proto {
            let _ = write!(out, " -p {}", p.as_lower());
        }
        out.push_str(&self.matches);
        out.push_str(&self.target);
        out.trim_start().to_string()
    }
}

/// A string argument as `iptables-save` prints it (libxtables' `xtables_save_string`): bare if
/// it is only letters, digits, `-` and `_`; otherwise double-quoted with `"`, `\` and `'`
/// escaped.
pub(crate) fn save_string(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if matches!(c, '"' | '\\' | '\'') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// One address as a host network (`10.0.0.1/32`, `fd00::1/128`).
pub(crate) fn host(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}/32"),
        IpAddr::V6(a) => format!("{a}/128"),
    }
}

/// A network as printed back: host bits cleared.
pub(crate) fn net(n: &IpNet) -> String {
    n.trunc().to_string()
}

/// The probability of rule `i` of `n` remaining endpoints, `1/n`, as `iptables-save` prints it
/// after upstream wrote it with 10 decimals: the kernel keeps `round(2^31 × p)` and save prints
/// that fraction with 11 decimals.
pub fn probability(n: usize) -> String {
    const SCALE: f64 = 2_147_483_648.0; // 0x80000000, xt_statistic's unit.
    let written = format!("{:.10}", 1.0 / n.max(1) as f64);
    let p: f64 = written.parse().unwrap_or(1.0);
    let stored = (p * SCALE).round();
    format!("{:.11}", stored / SCALE)
}

/// The masquerade mark in save form (`0x4000`).
pub(crate) fn hex(mark: u32) -> String {
    format!("{mark:#x}")
}

fn reject(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "REJECT --reject-with icmp-port-unreachable",
        IpFamily::V6 => "REJECT --reject-with icmp6-port-unreachable",
    }
}

fn recent_mask(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "255.255.255.255",
        IpFamily::V6 => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    }
}

/// The loopback network of a family, as NodePorts exclude it.
fn loopback(family: IpFamily) -> IpNet {
    match family {
        IpFamily::V4 => IpNet::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 0)), 8),
        IpFamily::V6 => IpNet::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 128),
    }
    .unwrap_or_default()
}

/// Where NodePorts answer, for one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NodePortDestinations {
    /// Every local address (`-m addrtype --dst-type LOCAL`), loopback excluded unless
    /// localhost NodePorts are on (IPv4 only).
    AllLocal,
    /// Local addresses inside these networks.
    Cidrs(Vec<IpNet>),
}

/// Everything besides the Service port itself that its rules depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RenderContext {
    pub family: IpFamily,
    pub mark: u32,
    pub masquerade_all: bool,
    /// Localhost NodePorts in effect (IPv4 only).
    pub localhost_node_ports: bool,
    /// Detect-local: the pod network of this family (upstream allows one per family).
    pub local_cidr: Option<IpNet>,
    pub node_ports: NodePortDestinations,
    /// The node's primary address of this family (`loadBalancerSourceRanges` that contain it
    /// also admit traffic the node sends to its own LoadBalancer IPs).
    pub node_ip: Option<IpAddr>,
    /// Large-cluster mode: no comments on per-endpoint rules.
    pub large: bool,
}

impl RenderContext {
    /// Resolves the configuration and the node for the planner's family. `large` is
    /// large-cluster mode.
    pub(crate) fn new(
        cfg: &PlanConfig,
        node: &NodeContext,
        node_addresses: &[IpAddr],
        large: bool,
    ) -> Self {
        let family = cfg.family;
        let localhost_node_ports = cfg.localhost_node_ports && family == IpFamily::V4;
        let of_family: Vec<IpNet> = node
            .node_port_addresses
            .iter()
            .filter(|n| IpFamily::of_net(n) == family)
            .map(IpNet::trunc)
            .collect();
        // Upstream: no CIDR of this family, or a zero CIDR, means every local address.
        let node_ports = if of_family.is_empty() || of_family.iter().any(|n| n.prefix_len() == 0) {
            NodePortDestinations::AllLocal
        } else {
            let lo = loopback(family);
            let mut cidrs: Vec<IpNet> = Vec::new();
            for n in of_family {
                // Upstream skips loopback node IPs unless localhost NodePorts are on.
                if lo.contains(&n) && !localhost_node_ports {
                    continue;
                }
                if !cidrs.contains(&n) {
                    cidrs.push(n);
                }
            }
            NodePortDestinations::Cidrs(cidrs)
        };
        RenderContext {
            family,
            mark: cfg.mark(),
            masquerade_all: cfg.masquerade_all,
            localhost_node_ports,
            local_cidr: node
                .local_cidrs
                .iter()
                .find(|n| IpFamily::of_net(n) == family)
                .map(IpNet::trunc),
            node_ports,
            node_ip: node_addresses
                .iter()
                .find(|a| IpFamily::of(a) == family)
                .copied(),
            large,
        }
    }
}

/// The shared chains each Service port adds rules to, in the order of [`Dispatch::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Dispatch {
    /// filter `KUBE-SERVICES`.
    FilterServices,
    /// filter `KUBE-EXTERNAL-SERVICES`.
    FilterExternalServices,
    /// filter `KUBE-NODEPORTS`.
    FilterNodePorts,
    /// filter `KUBE-PROXY-FIREWALL`.
    FilterProxyFirewall,
    /// nat `KUBE-SERVICES`.
    NatServices,
    /// nat `KUBE-NODEPORTS`.
    NatNodePorts,
}

impl Dispatch {
    pub(crate) const ALL: [Dispatch; 6] = [
        Dispatch::FilterServices,
        Dispatch::FilterExternalServices,
        Dispatch::FilterNodePorts,
        Dispatch::FilterProxyFirewall,
        Dispatch::NatServices,
        Dispatch::NatNodePorts,
    ];

    pub(crate) fn table(self) -> Table {
        match self {
            Dispatch::NatServices | Dispatch::NatNodePorts => Table::Nat,
            _ => Table::Filter,
        }
    }

    pub(crate) fn chain(self) -> &'static str {
        match self {
            Dispatch::FilterServices | Dispatch::NatServices => names::KUBE_SERVICES,
            Dispatch::FilterExternalServices => names::KUBE_EXTERNAL_SERVICES,
            Dispatch::FilterNodePorts | Dispatch::NatNodePorts => names::KUBE_NODEPORTS,
            Dispatch::FilterProxyFirewall => names::KUBE_PROXY_FIREWALL,
        }
    }
}

/// Everything one Service port contributes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PortRules {
    /// Its nat chains (SEP, SVC, SVL, EXT, FW), each after the chains it jumps to.
    pub chains: Vec<ChainWrite>,
    /// Its rules in the shared chains, indexed like [`Dispatch::ALL`].
    pub dispatch: [Vec<String>; 6],
    /// `internalTrafficPolicy: Local` with endpoints elsewhere but none here.
    pub no_local_internal: bool,
    /// `externalTrafficPolicy: Local` with endpoints elsewhere but none here.
    pub no_local_external: bool,
}

impl PortRules {
    fn push(&mut self, d: Dispatch, rule: String) {
        self.dispatch[d as usize].push(rule);
    }
}

fn of_family(ips: &[IpAddr], family: IpFamily) -> impl Iterator<Item = &IpAddr> {
    ips.iter().filter(move |ip| IpFamily::of(ip) == family)
}

/// Renders one Service port, or `None` if it has no ClusterIP of this family (a single-stack
/// Service of the other family: upstream's per-family proxier never sees it).
pub(crate) fn render_port(
    ctx: &RenderContext,
    port: &ServicePort,
    endpoints: &SelectedEndpoints,
) -> Option<PortRules> {
    render_port_parts(ctx, port, endpoints, true)
}

/// Like [`render_port`], but only its rules in the shared chains (and the no-local flags):
/// `chains` empty. Re-assembling the shared chains needs nothing more.
pub(crate) fn render_dispatch(
    ctx: &RenderContext,
    port: &ServicePort,
    endpoints: &SelectedEndpoints,
) -> Option<PortRules> {
    render_port_parts(ctx, port, endpoints, false)
}

fn render_port_parts(
    ctx: &RenderContext,
    port: &ServicePort,
    endpoints: &SelectedEndpoints,
    with_chains: bool,
) -> Option<PortRules> {
    let family = ctx.family;
    let vip = *of_family(&port.cluster_ips, family).next()?;
    let spn = port.name.to_string();
    let proto = port.name.protocol;
    let chains = names::service_chains(&port.name);
    let external_ips: Vec<&IpAddr> = of_family(&port.external_ips, family).collect();
    let lb_ips: Vec<&IpAddr> = of_family(&port.load_balancer_ips, family).collect();
    let source_ranges: Vec<&IpNet> = port
        .load_balancer_source_ranges
        .iter()
        .filter(|n| IpFamily::of_net(n) == family)
        .collect();

    // Upstream's per-family view of the port's policies.
    let externally_accessible =
        port.node_port.is_some() || !external_ips.is_empty() || !lb_ips.is_empty();
    let internal_local = port.internal_traffic_local;
    let external_local = port.external_traffic_local && externally_accessible;
    let uses_cluster = !internal_local || externally_accessible;
    let uses_local = internal_local || external_local;
    let pick = |set: &[Endpoint], used: bool| -> Vec<Endpoint> {
        if !used {
            return Vec::new();
        }
        set.iter()
            .filter(|e| IpFamily::of(&e.ip) == family)
            .cloned()
            .collect()
    };
    let cluster_eps = pick(&endpoints.cluster, uses_cluster);
    let local_eps = pick(&endpoints.local, uses_local);
    let has_endpoints = endpoints.has_any_for(family);

    let internal_eps = if internal_local {
        &local_eps
    } else {
        &cluster_eps
    };
    let internal_chain = if internal_local {
        &chains.svl
    } else {
        &chains.svc
    };
    let has_internal = has_endpoints && !internal_eps.is_empty();
    let external_eps = if external_local {
        &local_eps
    } else {
        &cluster_eps
    };
    let external_policy_chain = if external_local {
        &chains.svl
    } else {
        &chains.svc
    };
    let has_external = has_endpoints && !external_eps.is_empty();
    let uses_ext_chain = has_endpoints && externally_accessible;
    let uses_fw = has_endpoints && !lb_ips.is_empty() && !source_ranges.is_empty();
    let lb_target = if uses_fw { &chains.fw } else { &chains.ext };

    let mut out = PortRules {
        no_local_internal: has_endpoints && internal_local && local_eps.is_empty(),
        no_local_external: has_endpoints && external_local && local_eps.is_empty(),
        ..PortRules::default()
    };
    let no_endpoints = format!("{spn} has no endpoints");
    let no_local = format!("{spn} has no local endpoints");
    let (internal_filter, internal_filter_comment) = if has_endpoints {
        ("DROP", &no_local)
    } else {
        (reject(family), &no_endpoints)
    };
    let (external_filter, external_filter_comment) = (internal_filter, internal_filter_comment);
    let service_rule = |dst: &IpAddr, comment: &str| {
        Rule::new()
            .dst(host(dst))
            .comment(comment)
            .dport(proto, port.port)
    };

    // ClusterIP.
    if has_internal {
        let rule = service_rule(&vip, &format!("{spn} cluster IP")).jump(internal_chain);
        out.push(Dispatch::NatServices, rule.build());
    } else {
        let rule = service_rule(&vip, internal_filter_comment).jump(internal_filter);
        out.push(Dispatch::FilterServices, rule.build());
    }
    // ExternalIPs.
    for ip in &external_ips {
        if has_endpoints {
            let rule = service_rule(ip, &format!("{spn} external IP")).jump(&chains.ext);
            out.push(Dispatch::NatServices, rule.build());
        }
        if !has_external {
            let rule = service_rule(ip, external_filter_comment).jump(external_filter);
            out.push(Dispatch::FilterExternalServices, rule.build());
        }
    }
    // LoadBalancer IPs.
    for ip in &lb_ips {
        if has_endpoints {
            let rule = service_rule(ip, &format!("{spn} loadbalancer IP")).jump(lb_target);
            out.push(Dispatch::NatServices, rule.build());
        }
        if uses_fw {
            let comment = format!("{spn} traffic not accepted by {}", chains.fw);
            let rule = service_rule(ip, &comment).jump("DROP");
            out.push(Dispatch::FilterProxyFirewall, rule.build());
        }
    }
    if !has_external {
        for ip in &lb_ips {
            let rule = service_rule(ip, external_filter_comment).jump(external_filter);
            out.push(Dispatch::FilterExternalServices, rule.build());
        }
    }
    // NodePort.
    if let Some(node_port) = port.node_port {
        if has_endpoints {
            let rule = Rule::new()
                .comment(&spn)
                .dport(proto, node_port)
                .jump(&chains.ext);
            out.push(Dispatch::NatNodePorts, rule.build());
        }
        if !has_external {
            let local_dst = |r: Rule| {
                r.comment(external_filter_comment)
                    .m("-m addrtype --dst-type LOCAL")
                    .dport(proto, node_port)
                    .jump(external_filter)
                    .build()
            };
            match &ctx.node_ports {
                NodePortDestinations::AllLocal => {
                    out.push(Dispatch::FilterExternalServices, local_dst(Rule::new()));
                }
                NodePortDestinations::Cidrs(cidrs) => {
                    for c in cidrs {
                        let rule = local_dst(Rule::new().dst(net(c)));
                        out.push(Dispatch::FilterExternalServices, rule);
                    }
                }
            }
        }
    }
    // Health check node port: accepted whether or not there are local endpoints.
    if let Some(hc) = port.health_check_node_port {
        let rule = Rule::new()
            .comment(&format!("{spn} health check node port"))
            .dport(Protocol::Tcp, hc)
            .jump("ACCEPT");
        out.push(Dispatch::FilterNodePorts, rule.build());
    }

    if !with_chains {
        return Some(out);
    }
    // The Service port's own chains: endpoints first, then the chains that jump to them. Only
    // endpoints on this node have a chain (only they can hairpin); the others are DNATed by
    // their rule in the SVC/SVL chain.
    let mut reachable: Vec<&Endpoint> = cluster_eps.iter().filter(|e| e.is_local).collect();
    for ep in local_eps.iter().filter(|e| e.is_local) {
        if !reachable.iter().any(|e| e.ip == ep.ip && e.port == ep.port) {
            reachable.push(ep);
        }
    }
    let ep_comment = (!ctx.large).then_some(spn.as_str());
    for ep in reachable {
        out.chains.push(endpoint_chain(ctx, port, ep, ep_comment));
    }
    let masquerade_rule = || {
        let base = Rule::new();
        let base = if ctx.masquerade_all {
            base
        } else {
            match &ctx.local_cidr {
                Some(c) => base.not_src(net(c)),
                None => return None,
            }
        };
        Some(
            base.dst(host(&vip))
                .comment(&format!("{spn} cluster IP"))
                .dport(proto, port.port)
                .jump(names::KUBE_MARK_MASQ)
                .build(),
        )
    };
    for (chain, eps, internal) in [
        (&chains.svc, &cluster_eps, !internal_local),
        (&chains.svl, &local_eps, internal_local),
    ] {
        if eps.is_empty() {
            continue;
        }
        let mut rules = Vec::new();
        if internal && has_internal {
            rules.extend(masquerade_rule());
        }
        endpoint_rules(ctx, port, &spn, eps, &mut rules);
        out.chains.push(nat(chain, rules));
    }
    if uses_ext_chain {
        let mut rules = Vec::new();
        if !external_local {
            rules.push(
                Rule::new()
                    .comment(&format!(
                        "masquerade traffic for {spn} external destinations"
                    ))
                    .jump(names::KUBE_MARK_MASQ)
                    .build(),
            );
        } else if !cluster_eps.is_empty() {
            // Short-circuit: pods and the node itself reach every endpoint, as if they had gone
            // out to the load balancer and come back.
            if let Some(c) = &ctx.local_cidr {
                rules.push(
                    Rule::new()
                        .src(net(c))
                        .comment(&format!("pod traffic for {spn} external destinations"))
                        .jump(&chains.svc)
                        .build(),
                );
            }
            rules.push(
                Rule::new()
                    .comment(&format!(
                        "masquerade LOCAL traffic for {spn} external destinations"
                    ))
                    .m("-m addrtype --src-type LOCAL")
                    .jump(names::KUBE_MARK_MASQ)
                    .build(),
            );
            rules.push(
                Rule::new()
                    .comment(&format!(
                        "route LOCAL traffic for {spn} external destinations"
                    ))
                    .m("-m addrtype --src-type LOCAL")
                    .jump(&chains.svc)
                    .build(),
            );
        }
        if has_external {
            rules.push(Rule::new().jump(external_policy_chain).build());
        }
        out.chains.push(nat(&chains.ext, rules));
    }
    if uses_fw {
        out.chains
            .push(firewall_chain(ctx, &chains, &spn, &source_ranges, &lb_ips));
    }
    Some(out)
}

fn nat(chain: &str, rules: Vec<String>) -> ChainWrite {
    ChainWrite {
        table: Table::Nat,
        chain: chain.to_string(),
        rules,
    }
}

/// `KUBE-SEP-…` of an endpoint on this node: hairpin masquerade (the pod reaching itself
/// through the Service), then the DNAT (remembering the client for affinity).
fn endpoint_chain(
    ctx: &RenderContext,
    port: &ServicePort,
    ep: &Endpoint,
    comment: Option<&str>,
) -> ChainWrite {
    let chain = names::endpoint_chain(&port.name, ep);
    let hairpin = Rule::new()
        .src(host(&ep.ip))
        .maybe_comment(comment)
        .jump(names::KUBE_MARK_MASQ)
        .build();
    let dnat = dnat(ctx, port, ep, Rule::new().maybe_comment(comment), true);
    nat(&chain, vec![hairpin, dnat])
}

/// `rule` completed into the DNAT to `ep`, adding the client to the endpoint's affinity list
/// (`-m recent --set`, after the rule's other matches) if `remember` and the port has
/// ClientIP affinity.
fn dnat(
    ctx: &RenderContext,
    port: &ServicePort,
    ep: &Endpoint,
    mut rule: Rule,
    remember: bool,
) -> String {
    if remember && port.session_affinity_timeout.is_some() {
        rule = rule.m(&format!(
            "-m recent --set --name {} --mask {} --rsource",
            names::endpoint_chain(&port.name, ep),
            recent_mask(ctx.family)
        ));
    }
    rule.proto(port.name.protocol)
        .jump(&format!("DNAT --to-destination {ep}"))
        .build()
}

/// The endpoint rules of a `KUBE-SVC-…`/`KUBE-SVL-…` chain: affinity checks first, then a
/// random pick with probability `1/(n-i)` per rule, the last rule unconditional. A rule
/// reaches an endpoint on this node through its `KUBE-SEP-…` chain, and DNATs to any other
/// endpoint itself (upstream gives every endpoint a chain: 100k chains at 10k Services × 10,
/// which iptables-nft re-validates on every commit and iptables-legacy copies on every
/// restore).
///
/// Affinity lists are named after the endpoint's `KUBE-SEP-…` chain either way. A client
/// found on one goes to its endpoint again and its entry is refreshed: by the `KUBE-SEP-…`
/// chain's `--set`, or by `--update` where the rule DNATs itself.
fn endpoint_rules(
    ctx: &RenderContext,
    port: &ServicePort,
    spn: &str,
    eps: &[Endpoint],
    rules: &mut Vec<String>,
) {
    let comment = |ep: &Endpoint| (!ctx.large).then(|| format!("{spn} -> {ep}"));
    let to = |ep: &Endpoint, rule: Rule, remember: bool| -> String {
        if ep.is_local {
            rule.jump(&names::endpoint_chain(&port.name, ep)).build()
        } else {
            dnat(ctx, port, ep, rule, remember)
        }
    };
    if let Some(timeout) = port.session_affinity_timeout {
        for ep in eps {
            let check = if ep.is_local { "--rcheck" } else { "--update" };
            let rule = Rule::new()
                .maybe_comment(comment(ep).as_deref())
                .m(&format!(
                    "-m recent {check} --seconds {timeout} --reap --name {} --mask {} --rsource",
                    names::endpoint_chain(&port.name, ep),
                    recent_mask(ctx.family)
                ));
            rules.push(to(ep, rule, false));
        }
    }
    let n = eps.len();
    for (i, ep) in eps.iter().enumerate() {
        let mut rule = Rule::new().maybe_comment(comment(ep).as_deref());
        if i + 1 < n {
            rule = rule.m(&format!(
                "-m statistic --mode random --probability {}",
                probability(n - i)
            ));
        }
        rules.push(to(ep, rule, true));
    }
}

/// `KUBE-FW-…`: allowed sources continue to `KUBE-EXT-…`; the rest falls through (and is
/// dropped by filter `KUBE-PROXY-FIREWALL`, which sees it still addressed to the LB IP).
fn firewall_chain(
    ctx: &RenderContext,
    chains: &ServiceChainNames,
    spn: &str,
    source_ranges: &[&IpNet],
    lb_ips: &[&IpAddr],
) -> ChainWrite {
    let comment = format!("{spn} loadbalancer IP");
    let mut rules: Vec<String> = source_ranges
        .iter()
        .map(|r| {
            Rule::new()
                .src(net(r))
                .comment(&comment)
                .jump(&chains.ext)
                .build()
        })
        .collect();
    // The node reaching its own LoadBalancer IP (bound locally) uses that IP as its source.
    let allow_node = ctx
        .node_ip
        .is_some_and(|ip| source_ranges.iter().any(|r| r.contains(&ip)));
    if allow_node {
        for ip in lb_ips {
            rules.push(
                Rule::new()
                    .src(host(ip))
                    .comment(&comment)
                    .jump(&chains.ext)
                    .build(),
            );
        }
    }
    rules.push(
        Rule::new()
            .comment(&format!(
                "other traffic to {spn} will be dropped by KUBE-PROXY-FIREWALL"
            ))
            .build(),
    );
    nat(&chains.fw, rules)
}

/// The last rules of filter `KUBE-SERVICES`: traffic still addressed to a ClusterIP after DNAT
/// was for a port no Service uses, and is rejected (upstream's nftables `cluster-ips-check`,
/// "Reject traffic to invalid ports of ClusterIPs"; upstream's iptables mode lets it through,
/// kube-proxy-rs gives every mode the nftables behaviour). Traffic outside the smallest network
/// holding every ClusterIP returns after one rule, so the per-ClusterIP rules cost nothing to
/// connections that are not addressed to the Service range.
pub(crate) fn cluster_ip_rejects(family: IpFamily, vips: &[(String, IpAddr)]) -> Vec<String> {
    let Some(cover) = covering_net(vips.iter().map(|(_, ip)| *ip)) else {
        return Vec::new();
    };
    let mut out = vec![Rule::new()
        .not_dst(net(&cover))
        .comment("not addressed to a ClusterIP")
        .jump("RETURN")
        .build()];
    for (service, vip) in vips {
        out.push(
            Rule::new()
                .dst(host(vip))
                .comment(&format!("{service} cluster IP: no Service port here"))
                .jump(reject(family))
                .build(),
        );
    }
    out
}

/// The smallest network that holds every address (all of one family), or `None` without any.
fn covering_net(ips: impl Iterator<Item = IpAddr>) -> Option<IpNet> {
    let (mut lo, mut hi, mut v6) = (u128::MAX, 0u128, false);
    let mut any = false;
    for ip in ips {
        let n = match ip {
            IpAddr::V4(a) => u128::from(u32::from(a)),
            IpAddr::V6(a) => {
                v6 = true;
                u128::from(a)
            }
        };
        lo = lo.min(n);
        hi = hi.max(n);
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
    vec![Rule::new()
        .not_src("127.0.0.0/8".into())
        .dst("127.0.0.0/8".into())
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

#[cfg(test)]
mod tests;
