//! The rules of one Service port, frontend by frontend ([`kp_core::frontend`]): its rules in the
//! shared chains (nat `KUBE-SERVICES` and `KUBE-NODEPORTS`, filter `KUBE-SERVICES`,
//! `KUBE-EXTERNAL-SERVICES`, `KUBE-NODEPORTS`, `KUBE-PROXY-FIREWALL`) and its own nat chains
//! (`KUBE-SVC`, `KUBE-SVL`, `KUBE-EXT`, `KUBE-FW`, `KUBE-SEP`). Mirrors upstream's
//! `syncProxyRules` and `writeServiceToEndpointRules`, except that only endpoints on this node
//! get a `KUBE-SEP-…` chain (see [`endpoint_rules`]).

use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::frontend::{Frontend, FrontendKind, Frontends, TrafficPolicy};
use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceKey, ServicePort, ServicePortName};
use kp_core::select::SelectedEndpoints;
use kp_core::track::ProxyState;

use super::chain::{nat, ChainWrite, ServiceChains, Table};
use super::context::{NodePortDestinations, RenderContext};
use super::rule::{host, net, probability, recent_mask, reject, Rule};
use crate::names::{self, ServiceChainNames};

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

/// A Service port's frontends in the renderer's family, with the names its rules use.
struct PortView<'a> {
    fronts: Frontends<'a>,
    /// The ClusterIP of the family.
    vip: IpAddr,
    /// Upstream's `ServicePortName` spelling, for comments.
    spn: String,
    chains: ServiceChainNames,
}

impl PortView<'_> {
    fn port(&self) -> &ServicePort {
        self.fronts.port()
    }

    /// The chain of the endpoints `policy` leaves: `KUBE-SVC-…` or `KUBE-SVL-…`.
    fn policy_chain(&self, policy: TrafficPolicy) -> &str {
        match policy {
            TrafficPolicy::Cluster => &self.chains.svc,
            TrafficPolicy::Local => &self.chains.svl,
        }
    }

    /// Whether the external frontends have endpoints under their policy.
    fn has_external(&self) -> bool {
        let eps = self.fronts.endpoints(self.fronts.external_policy());
        self.fronts.has_endpoints() && !eps.is_empty()
    }

    /// Whether the LoadBalancer IPs go through `KUBE-FW-…`: source ranges of this family
    /// (upstream's per-family reading: ranges of the other family only filter nothing here).
    fn uses_firewall(&self) -> bool {
        self.fronts.has_endpoints()
            && self
                .fronts
                .iter()
                .filter_map(|f| f.source_ranges())
                .any(|r| r.of_family().next().is_some())
    }

    /// The rule that matches traffic to `dst` on the Service port.
    fn service_rule(&self, dst: &IpAddr, comment: &str) -> Rule {
        let port = self.port();
        Rule::new()
            .dst(host(dst))
            .comment(comment)
            .dport(port.name.protocol, port.port)
    }

    /// The filter target and comment for traffic that finds no endpoint: REJECT when the port
    /// has none of this family anywhere, DROP when a Local policy has none here.
    fn no_endpoints(&self, family: IpFamily) -> (&'static str, String) {
        if self.fronts.has_endpoints() {
            ("DROP", format!("{} has no local endpoints", self.spn))
        } else {
            (reject(family), format!("{} has no endpoints", self.spn))
        }
    }
}

fn render_port_parts(
    ctx: &RenderContext,
    port: &ServicePort,
    endpoints: &SelectedEndpoints,
    with_chains: bool,
) -> Option<PortRules> {
    let fronts = Frontends::new(port, endpoints, ctx.family);
    let view = PortView {
        vip: fronts.cluster_ip()?,
        spn: port.name.to_string(),
        chains: names::service_chains(&port.name),
        fronts,
    };
    let has_endpoints = view.fronts.has_endpoints();
    let local_eps = view.fronts.local_endpoints();
    let mut out = PortRules {
        no_local_internal: has_endpoints
            && view.fronts.internal_policy() == TrafficPolicy::Local
            && local_eps.is_empty(),
        no_local_external: has_endpoints
            && view.fronts.external_policy() == TrafficPolicy::Local
            && local_eps.is_empty(),
        ..PortRules::default()
    };
    for f in view.fronts.iter() {
        frontend_rules(ctx, &view, &f, &mut out);
    }
    // Health check node port: accepted whether or not there are local endpoints.
    if let Some(hc) = port.health_check_node_port {
        let rule = Rule::new()
            .comment(&format!("{} health check node port", view.spn))
            .dport(Protocol::Tcp, hc)
            .jump("ACCEPT");
        out.push(Dispatch::FilterNodePorts, rule.build());
    }
    if with_chains {
        port_chains(ctx, &view, &mut out);
    }
    Some(out)
}

/// One frontend's rules in the shared chains: the jump to the port's chains in nat
/// `KUBE-SERVICES` or `KUBE-NODEPORTS`, and the filter rules for traffic that finds no
/// endpoint or comes from outside the source ranges.
fn frontend_rules(ctx: &RenderContext, view: &PortView<'_>, f: &Frontend<'_>, out: &mut PortRules) {
    let spn = &view.spn;
    let chains = &view.chains;
    let has_endpoints = f.has_endpoints;
    let (no_endpoints_target, no_endpoints_comment) = view.no_endpoints(ctx.family);
    match (f.kind, f.address) {
        (FrontendKind::ClusterIp, Some(ip)) => {
            if has_endpoints && !f.endpoints.is_empty() {
                let rule = view
                    .service_rule(&ip, &format!("{spn} cluster IP"))
                    .jump(view.policy_chain(f.policy));
                out.push(Dispatch::NatServices, rule.build());
            } else {
                let rule = view
                    .service_rule(&ip, &no_endpoints_comment)
                    .jump(no_endpoints_target);
                out.push(Dispatch::FilterServices, rule.build());
            }
        }
        (FrontendKind::ExternalIp, Some(ip)) => {
            if has_endpoints {
                let rule = view
                    .service_rule(&ip, &format!("{spn} external IP"))
                    .jump(&chains.ext);
                out.push(Dispatch::NatServices, rule.build());
            }
            if !view.has_external() {
                let rule = view
                    .service_rule(&ip, &no_endpoints_comment)
                    .jump(no_endpoints_target);
                out.push(Dispatch::FilterExternalServices, rule.build());
            }
        }
        (FrontendKind::LoadBalancer { .. }, Some(ip)) => {
            let uses_fw = view.uses_firewall();
            if has_endpoints {
                let target = if uses_fw { &chains.fw } else { &chains.ext };
                let rule = view
                    .service_rule(&ip, &format!("{spn} loadbalancer IP"))
                    .jump(target);
                out.push(Dispatch::NatServices, rule.build());
            }
            if uses_fw {
                let comment = format!("{spn} traffic not accepted by {}", chains.fw);
                let rule = view.service_rule(&ip, &comment).jump("DROP");
                out.push(Dispatch::FilterProxyFirewall, rule.build());
            }
            if !view.has_external() {
                let rule = view
                    .service_rule(&ip, &no_endpoints_comment)
                    .jump(no_endpoints_target);
                out.push(Dispatch::FilterExternalServices, rule.build());
            }
        }
        (FrontendKind::NodePort, _) => {
            if has_endpoints {
                let rule = Rule::new()
                    .comment(spn)
                    .dport(f.protocol, f.port)
                    .jump(&chains.ext);
                out.push(Dispatch::NatNodePorts, rule.build());
            }
            if !view.has_external() {
                let local_dst = |r: Rule| {
                    r.comment(&no_endpoints_comment)
                        .m("-m addrtype --dst-type LOCAL")
                        .dport(f.protocol, f.port)
                        .jump(no_endpoints_target)
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
        // Every frontend but a NodePort has an address.
        (_, None) => {}
    }
}

/// The Service port's own chains: endpoints first, then the chains that jump to them. Only
/// endpoints on this node have a chain (only they can hairpin); the others are DNATed by
/// their rule in the SVC/SVL chain.
fn port_chains(ctx: &RenderContext, view: &PortView<'_>, out: &mut PortRules) {
    let fronts = &view.fronts;
    let cluster_eps = fronts.cluster_endpoints();
    let local_eps = fronts.local_endpoints();
    let mut reachable: Vec<&Endpoint> =
        cluster_eps.iter().copied().filter(|e| e.is_local).collect();
    for ep in local_eps.iter().filter(|e| e.is_local) {
        if !reachable.iter().any(|e| e.ip == ep.ip && e.port == ep.port) {
            reachable.push(ep);
        }
    }
    let ep_comment = (!ctx.large).then_some(view.spn.as_str());
    for ep in reachable {
        out.chains
            .push(endpoint_chain(ctx, view.port(), ep, ep_comment));
    }
    let internal = fronts.internal_policy();
    let has_internal = fronts.has_endpoints() && !fronts.endpoints(internal).is_empty();
    for policy in [TrafficPolicy::Cluster, TrafficPolicy::Local] {
        let eps = fronts.endpoints(policy);
        if eps.is_empty() {
            continue;
        }
        let mut rules = Vec::new();
        if policy == internal && has_internal {
            rules.extend(cluster_ip_masquerade(ctx, view));
        }
        endpoint_rules(ctx, view.port(), &view.spn, eps, &mut rules);
        out.chains.push(nat(view.policy_chain(policy), rules));
    }
    if fronts.has_endpoints() && fronts.externally_accessible() {
        out.chains.push(external_chain(ctx, view));
    }
    if view.uses_firewall() {
        out.chains.push(firewall_chain(ctx, view));
    }
}

/// The first rule of the ClusterIP's policy chain: traffic from outside the pod network, or
/// not arrived on the pods' interfaces with detect-local by interface (or all of it, with
/// `masqueradeAll`) is marked for masquerade. `None` without detect-local.
fn cluster_ip_masquerade(ctx: &RenderContext, view: &PortView<'_>) -> Option<String> {
    let base = Rule::new();
    let base = if ctx.masquerade_all {
        base
    } else if let Some(i) = &ctx.local_interface {
        // Not arrived on the pods' interface(s): `! -i cbr0`, `! -i veth+`.
        base.local_iface(i, true)
    } else {
        match &ctx.local_cidr {
            // A pod network of every address leaves no off-node client to masquerade (and
            // `! -s 0.0.0.0/0` is refused by iptables-nft).
            Some(c) if c.prefix_len() > 0 => base.not_src(net(c)),
            _ => return None,
        }
    };
    let port = view.port();
    Some(
        base.dst(host(&view.vip))
            .comment(&format!("{} cluster IP", view.spn))
            .dport(port.name.protocol, port.port)
            .jump(names::KUBE_MARK_MASQ)
            .build(),
    )
}

/// `KUBE-EXT-…`, where external IPs, LoadBalancer IPs and the NodePort lead: with
/// `externalTrafficPolicy: Cluster` every packet is marked for masquerade; with `Local`, pods
/// and the node itself are short-circuited to `KUBE-SVC-…` (the node's traffic masqueraded).
/// Then the policy's endpoints, if any.
fn external_chain(ctx: &RenderContext, view: &PortView<'_>) -> ChainWrite {
    let spn = &view.spn;
    let fronts = &view.fronts;
    let mut rules = Vec::new();
    match fronts.external_policy() {
        TrafficPolicy::Cluster => rules.push(
            Rule::new()
                .comment(&format!(
                    "masquerade traffic for {spn} external destinations"
                ))
                .jump(names::KUBE_MARK_MASQ)
                .build(),
        ),
        // Short-circuit: pods and the node itself reach every endpoint, as if they had gone
        // out to the load balancer and come back.
        TrafficPolicy::Local if !fronts.cluster_endpoints().is_empty() => {
            let from_pods = match (&ctx.local_interface, &ctx.local_cidr) {
                (Some(i), _) => Some(Rule::new().local_iface(i, false)),
                (None, Some(c)) => Some(Rule::new().src(net(c))),
                (None, None) => None,
            };
            if let Some(r) = from_pods {
                rules.push(
                    r.comment(&format!("pod traffic for {spn} external destinations"))
                        .jump(&view.chains.svc)
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
                    .jump(&view.chains.svc)
                    .build(),
            );
        }
        TrafficPolicy::Local => {}
    }
    if view.has_external() {
        let chain = view.policy_chain(fronts.external_policy());
        rules.push(Rule::new().jump(chain).build());
    }
    nat(&view.chains.ext, rules)
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
    eps: &[&Endpoint],
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
fn firewall_chain(ctx: &RenderContext, view: &PortView<'_>) -> ChainWrite {
    let spn = &view.spn;
    let ext = &view.chains.ext;
    let comment = format!("{spn} loadbalancer IP");
    let lbs: Vec<Frontend<'_>> = view
        .fronts
        .iter()
        .filter(|f| f.source_ranges().is_some())
        .collect();
    let ranges: Vec<&IpNet> = lbs
        .first()
        .and_then(|f| f.source_ranges())
        .map(|r| r.of_family().collect())
        .unwrap_or_default();
    let mut rules: Vec<String> = ranges
        .iter()
        .map(|r| Rule::new().src(net(r)).comment(&comment).jump(ext).build())
        .collect();
    // The node reaching its own LoadBalancer IP (bound locally) uses that IP as its source.
    let allow_node = ctx
        .node_ip
        .is_some_and(|ip| ranges.iter().any(|r| r.contains(&ip)));
    if allow_node {
        for ip in lbs.iter().filter_map(|f| f.address) {
            rules.push(
                Rule::new()
                    .src(host(&ip))
                    .comment(&comment)
                    .jump(ext)
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
    nat(&view.chains.fw, rules)
}

/// A Service's ports with a ClusterIP of `ctx`'s family, rendered, by port name.
pub(crate) fn render_service(
    ctx: &RenderContext,
    state: &ProxyState,
    key: &ServiceKey,
    with_chains: bool,
) -> Vec<(ServicePortName, PortRules)> {
    let mut ports: Vec<(ServicePortName, PortRules)> = state
        .service_state(key)
        .iter()
        .filter_map(|ps| {
            let r = if with_chains {
                render_port(ctx, &ps.port, &ps.endpoints)
            } else {
                render_dispatch(ctx, &ps.port, &ps.endpoints)
            };
            r.map(|r| (ps.port.name.clone(), r))
        })
        .collect();
    ports.sort_by(|a, b| a.0.cmp(&b.0));
    ports
}

/// A Service's chain groups as a full plan writes them: its ports with chains, by name.
pub(crate) fn service_groups(
    ctx: &RenderContext,
    state: &ProxyState,
    key: &ServiceKey,
) -> Vec<ServiceChains> {
    render_service(ctx, state, key, true)
        .into_iter()
        .filter(|(_, p)| !p.chains.is_empty())
        .map(|(name, p)| ServiceChains {
            service_port: name.to_string(),
            chains: p.chains,
        })
        .collect()
}
