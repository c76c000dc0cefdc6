//! `kube-proxy explain`: follows one packet through the live rules of the active mode, with
//! that mode's tracer fed from the kernel's own listing (ebpf mode: its pinned maps), and says
//! what happens to it. In userspace mode the kernel only redirects to the proxy: the endpoint
//! is the proxy's balancer's choice, answered from the objects when they are named.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use kp_core::flow::{Origin, Packet, Tracer, Verdict};
use kp_core::model::{IpFamily, Protocol, ServicePort};
use kp_core::track::ProxyState;
use kp_ebpf_plan::{FrontendAddr, Scope, ServiceKey, FLAG_DROP_EMPTY, FLAG_SRC_RANGES};
use kp_ebpf_test::EbpfTracer;
use kp_iptables_test::tracer::Outcome;
use kp_iptables_test::IptablesTracer;
use kp_nftables_plan::element::{Atom, Tuple};
use kp_nftables_test::elements::{atom_matches, Elements};
use kp_nftables_test::NftTracer;
use kp_userspace_plan::Scheduler;
use kp_userspace_test::{UserspaceTracer, Walked};
use serde_json::{json, Value};

use super::live::Live;

/// What `explain` found for one packet.
pub struct Answer {
    /// The packet.
    pub packet: Packet,
    /// What the rules do with it (`None`: the trace itself failed, see `error`).
    pub verdict: Option<Verdict>,
    /// Each endpoint with how likely the rules send a new connection there.
    pub endpoints: Vec<((IpAddr, u16), f64)>,
    /// The Service ports whose frontend the packet is addressed to (needs the objects).
    pub services: Vec<String>,
    /// Why it is dropped or rejected, in an operator's words.
    pub reason: Option<String>,
    /// The rules, set or map elements that decided, as the kernel holds them.
    pub decided_by: Vec<String>,
    /// A trace that failed (rules whose branches disagree, a limit reached).
    pub error: Option<String>,
}

/// Traces `packet` through the live rules.
pub fn trace(live: &Live, packet: &Packet, state: Option<&ProxyState>) -> Answer {
    let mut a = Answer {
        packet: packet.clone(),
        verdict: None,
        endpoints: Vec::new(),
        services: Vec::new(),
        reason: None,
        decided_by: Vec::new(),
        error: None,
    };
    match live {
        Live::Nftables { tracer, .. } => {
            let v = tracer.trace(packet);
            if let Verdict::Dnat { endpoints, .. } = &v {
                let p = 1.0 / endpoints.len().max(1) as f64;
                a.endpoints = endpoints.iter().map(|e| (*e, p)).collect();
            }
            a.decided_by = nft_elements(tracer, packet);
            a.reason = nft_reason(&v, &a.decided_by);
            a.verdict = Some(v);
        }
        Live::Iptables { tracer, .. } => iptables(&mut a, tracer),
        Live::Ipvs { tracer, .. } => {
            iptables(&mut a, tracer.iptables());
            if a.reason.is_none() && a.verdict == Some(Verdict::Reject) {
                a.reason = a
                    .decided_by
                    .last()
                    .filter(|r| r.starts_with("ipvs "))
                    .map(|r| {
                        format!(
                            "the virtual server has no real server to send a new connection to \
                             (no ready endpoint): IPVS answers ICMP port unreachable ({r})"
                        )
                    });
            }
        }
        Live::Userspace {
            tracer,
            listening,
            synced,
            ..
        } => userspace(&mut a, tracer, listening, *synced),
        Live::Ebpf { tracer, hooks, .. } => {
            if let Some(unhooked) = unhooked(hooks, packet) {
                // No program meets the connection: whatever the maps say, nothing is done.
                a.decided_by = vec![unhooked.clone()];
                a.reason = Some(unhooked);
                a.verdict = Some(Verdict::Untouched);
                return a;
            }
            let v = tracer.trace(packet);
            a.decided_by = ebpf_entries(tracer, packet);
            a.reason = ebpf_reason(tracer, &v, packet);
            if let Verdict::Dnat { endpoints, .. } = &v {
                // From outside under sh or mh, the tc path gives a new client the backend its
                // address's hash names in the frontend's Maglev table; otherwise the programs
                // pick a slot uniformly (`bpf_get_prandom_u32() % count`), and so do the socket
                // hooks under sh or mh for this explain, which does not know the client's
                // network namespace cookie they hash.
                let hashed = (packet.origin == Origin::External)
                    .then(|| tracer.pick_outside(packet))
                    .flatten()
                    .map(|b| (b.ip, b.port))
                    .filter(|b| endpoints.contains(b));
                match hashed {
                    Some(picked) => {
                        a.endpoints = endpoints
                            .iter()
                            .map(|e| (*e, if *e == picked { 1.0 } else { 0.0 }))
                            .collect();
                        a.decided_by.push(format!(
                            "kp_maglev: the table gives {}'s hash the backend {}",
                            packet.src,
                            endpoint_text(&picked.0, picked.1)
                        ));
                        a.reason = Some(format!(
                            "from outside, the tc path's Maglev table (--ipvs-scheduler sh or mh) \
                             sends a new connection from {} to {} (with ClientIP affinity on, a \
                             client that came within the timeout keeps the endpoint it had)",
                            packet.src,
                            endpoint_text(&picked.0, picked.1)
                        ));
                    }
                    None => {
                        let p = 1.0 / endpoints.len().max(1) as f64;
                        a.endpoints = endpoints.iter().map(|e| (*e, p)).collect();
                    }
                }
            }
            a.verdict = Some(v);
        }
    }
    if let Some(state) = state {
        let local = match live {
            Live::Nftables { .. }
            | Live::Iptables { .. }
            | Live::Ipvs { .. }
            | Live::Ebpf { .. }
            | Live::Userspace { .. } => super::live::local_addresses(),
        };
        let ports = matching_ports(state, packet, &local);
        a.services = ports
            .iter()
            .map(|(p, kind)| format!("{} ({kind})", p.name))
            .collect();
        if matches!(a.verdict, Some(Verdict::Drop | Verdict::Reject)) {
            if let Some(r) = state_reason(state, packet, &ports) {
                a.reason = Some(r);
            }
        }
    }
    a
}

/// The Service ports `p` is addressed to, each with the kind of frontend it hit.
pub fn matching_ports(
    state: &ProxyState,
    p: &Packet,
    local: &[IpAddr],
) -> Vec<(std::sync::Arc<ServicePort>, &'static str)> {
    let mut out = Vec::new();
    for key in state.service_keys() {
        for sp in state.service_ports(key) {
            if sp.name.protocol != p.protocol {
                continue;
            }
            let kind = if sp.port == p.dport && sp.cluster_ips.contains(&p.dst) {
                Some("ClusterIP")
            } else if sp.port == p.dport && sp.external_ips.contains(&p.dst) {
                Some("external IP")
            } else if sp.port == p.dport && sp.load_balancer_ips.contains(&p.dst) {
                Some("LoadBalancer IP")
            } else if sp.node_port == Some(p.dport) && (local.contains(&p.dst)) {
                Some("NodePort")
            } else {
                None
            };
            if let Some(k) = kind {
                out.push((sp.clone(), k));
            }
        }
    }
    out
}

/// Why a packet to these ports is dropped or rejected, from the objects.
fn state_reason(
    state: &ProxyState,
    p: &Packet,
    ports: &[(std::sync::Arc<ServicePort>, &'static str)],
) -> Option<String> {
    let family = if p.dst.is_ipv4() {
        IpFamily::V4
    } else {
        IpFamily::V6
    };
    if ports.is_empty() {
        let cluster_ip = state.service_keys().any(|k| {
            state
                .service_ports(k)
                .iter()
                .any(|sp| sp.cluster_ips.contains(&p.dst))
        });
        if cluster_ip {
            return Some(format!(
                "no Service has port {}/{} on ClusterIP {} (unknown port)",
                p.dport,
                p.protocol.as_lower(),
                p.dst
            ));
        }
        if state.service_cidrs().iter().any(|c| c.contains(&p.dst)) {
            return Some(format!(
                "{} is in a Service CIDR but no Service holds it (unallocated ClusterIP)",
                p.dst
            ));
        }
        return None;
    }
    for (sp, kind) in ports {
        let Some(st) = state
            .service_state(&sp.name.service)
            .into_iter()
            .find(|s| s.port.name == sp.name)
        else {
            continue;
        };
        let external = *kind != "ClusterIP";
        if !sp.load_balancer_source_ranges.is_empty()
            && *kind == "LoadBalancer IP"
            && !sp
                .load_balancer_source_ranges
                .iter()
                .any(|r| r.contains(&p.src))
        {
            return Some(format!(
                "{}: source {} is outside loadBalancerSourceRanges {:?}",
                sp.name,
                p.src,
                sp.load_balancer_source_ranges
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            ));
        }
        if !st.endpoints.has_any_for(family) {
            return Some(format!("{}: the Service port has no endpoints", sp.name));
        }
        let local_policy = if external {
            sp.external_traffic_local
        } else {
            sp.internal_traffic_local
        };
        if local_policy
            && st
                .endpoints
                .local
                .iter()
                .all(|e| e.ip.is_ipv4() != p.dst.is_ipv4())
        {
            let which = if external { "external" } else { "internal" };
            return Some(format!(
                "{}: {which}TrafficPolicy is Local and no endpoint is on this node",
                sp.name
            ));
        }
    }
    None
}

/// The atoms a set's element may be probed with for `p`: the key shapes our planner uses.
fn probes(p: &Packet) -> Vec<Vec<Atom>> {
    let (d, s, pr, port) = (
        Atom::Ip(p.dst),
        Atom::Ip(p.src),
        Atom::Proto(p.protocol),
        Atom::Port(p.dport),
    );
    vec![
        vec![d],
        vec![pr, port],
        vec![d, pr, port],
        vec![d, pr, port, s],
        vec![s, d, pr, port],
        vec![s, d],
    ]
}

fn tuple_text(t: &Tuple) -> String {
    t.atoms()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" . ")
}

fn key_matches(key: &[Atom], probe: &[Atom]) -> bool {
    key.len() == probe.len() && key.iter().zip(probe).all(|(a, b)| atom_matches(a, b))
}

/// The set and map elements of the live table that concern `p`, as `set NAME: ELEMENT`.
fn nft_elements(tracer: &NftTracer, p: &Packet) -> Vec<String> {
    let family = if p.dst.is_ipv4() {
        IpFamily::V4
    } else {
        IpFamily::V6
    };
    let sets = tracer
        .set_names(family)
        .into_iter()
        .filter_map(|name| Some((tracer.elements(family, &name)?, name)));
    elements_about(sets, p)
}

/// Of the sets and maps `sets` (elements and name), the elements that concern `p`, as
/// `set NAME: ELEMENT`.
fn elements_about(sets: impl Iterator<Item = (Elements, String)>, p: &Packet) -> Vec<String> {
    let probes = probes(p);
    let mut out = Vec::new();
    for (elements, name) in sets {
        for (k, v) in &elements {
            let atoms = k.atoms();
            let slotted = name.ends_with("-endpoints") && !atoms.is_empty();
            let key = if slotted {
                &atoms[..atoms.len() - 1]
            } else {
                atoms
            };
            if probes.iter().any(|pr| key_matches(key, pr)) {
                let el = match v {
                    Some(v) => format!("{} : {}", tuple_text(k), tuple_text(v)),
                    None => tuple_text(k),
                };
                out.push(format!("set {name}: {el}"));
            }
        }
    }
    out
}

fn nft_reason(v: &Verdict, decided_by: &[String]) -> Option<String> {
    let has = |set: &str| {
        decided_by
            .iter()
            .find(|l| l.starts_with(&format!("set {set}: ")))
    };
    match v {
        Verdict::Reject | Verdict::Drop => {}
        _ => return None,
    }
    if let Some(l) = has("no-endpoint-vips").or_else(|| has("no-endpoint-nodeports")) {
        return Some(if l.ends_with(": drop") {
            format!("no endpoint this traffic may use (none serving, or a Local traffic policy with no endpoint on this node): {l}")
        } else {
            format!("the Service port has no endpoints: {l}")
        });
    }
    if has("firewall-vips").is_some() && has("firewall-allow").is_none() {
        return Some("the source is outside the Service's loadBalancerSourceRanges".into());
    }
    if has("cluster-ips").is_some() {
        return Some("no Service has this port on this ClusterIP (unknown port)".into());
    }
    if has("service-cidrs").is_some() {
        return Some(
            "the address is in a Service CIDR but no Service holds it (unallocated ClusterIP)"
                .into(),
        );
    }
    None
}

/// [`trace`] through iptables' chains (the iptables mode's, or the ipvs mode's with its sets
/// and virtual servers): every branch's endpoint with its probability, and the rules on the
/// way.
fn iptables(a: &mut Answer, tracer: &IptablesTracer) {
    let packet = &a.packet;
    match tracer.branches(packet) {
        Ok(branches) => {
            let mut by_ep: BTreeMap<(IpAddr, u16), f64> = BTreeMap::new();
            let mut rules: Vec<String> = Vec::new();
            for b in &branches {
                if let Outcome::Dnat(ip, port) = b.outcome {
                    *by_ep.entry((ip, port)).or_default() += b.probability;
                }
                for r in &b.rules {
                    if !rules.contains(r) {
                        rules.push(r.clone());
                    }
                }
            }
            a.endpoints = by_ep.into_iter().collect();
            a.decided_by = rules;
            match tracer.trace_all(packet) {
                Ok(v) => {
                    a.reason = ipt_reason(&v, &a.decided_by);
                    a.verdict = Some(v);
                }
                Err(e) => a.error = Some(e.to_string()),
            }
        }
        Err(e) => a.error = Some(e.to_string()),
    }
}

fn ipt_reason(v: &Verdict, rules: &[String]) -> Option<String> {
    if !matches!(v, Verdict::Reject | Verdict::Drop) {
        return None;
    }
    let target = if *v == Verdict::Reject {
        "-j REJECT"
    } else {
        "-j DROP"
    };
    let rule = rules.iter().rev().find(|r| r.contains(target))?;
    let comment = rule
        .split_once("--comment \"")
        .and_then(|(_, c)| c.split_once('"'))
        .map(|(c, _)| c.to_string());
    Some(match comment {
        Some(c) => format!("{c} ({rule})"),
        None => rule.clone(),
    })
}

/// [`trace`] in userspace mode: the table decides whether the packet is redirected to the
/// proxy; which endpoint the proxy then connects to is its balancer's choice, which the kernel
/// does not hold. With the objects named (`synced`), the balancer the tracer holds, synced as
/// the proxy's, says which endpoints it picks from; a redirect to a port nothing listens on
/// (the proxy is not running) is refused.
fn userspace(a: &mut Answer, tracer: &UserspaceTracer, listening: &[u16], synced: bool) {
    let p = &a.packet;
    let sets = tracer
        .set_names()
        .into_iter()
        .filter_map(|name| Some((tracer.elements(&name)?, name)));
    a.decided_by = elements_about(sets, p);
    let port = match tracer.walk(p) {
        Walked::Untouched => {
            a.verdict = Some(Verdict::Untouched);
            return;
        }
        Walked::Drop => {
            a.verdict = Some(Verdict::Drop);
            return;
        }
        Walked::Reject => {
            a.verdict = Some(Verdict::Reject);
            a.reason = Some(
                "the redirect table rejects it (an unknown port on a ClusterIP, \
                 a Service port without endpoints, or SCTP, which the proxy has no socket for)"
                    .into(),
            );
            return;
        }
        Walked::Redirected(port) => port,
    };
    let role = if tracer.pod_port() == Some(port) {
        "the userspace proxy's pod port, for what arrives on the pods' interface(s): a pod's \
         connection, which keeps its source at a ClusterIP"
    } else {
        "the userspace proxy's port"
    };
    a.decided_by.insert(
        0,
        format!(
            "table inet {}: redirect to :{port} ({role})",
            kp_userspace_plan::names::TABLE
        ),
    );
    if !listening.contains(&port) {
        a.verdict = Some(Verdict::Reject);
        a.reason = Some(format!(
            "redirected to the userspace proxy's port {port}, where nothing listens (the proxy \
             is not running): the connection is refused"
        ));
        return;
    }
    if !synced {
        a.error = Some(format!(
            "redirected to the userspace proxy on port {port}; which endpoint it connects to is \
             the running proxy's choice: pass its object source (--config, --kubeconfig/--master \
             or --manifests) to list the endpoints it picks from"
        ));
        return;
    }
    let v = tracer.trace(p);
    if let Verdict::Dnat { endpoints, .. } = &v {
        let scheduler = tracer.scheduler();
        // The hashing schedulers pick from the client's or the frontend's address alone, so
        // the proxy's first choice is known here; the others depend on its live state (its
        // turn, its connection counts).
        let first = matches!(
            scheduler,
            Scheduler::SourceHashing | Scheduler::DestinationHashing
        )
        .then(|| tracer.attempts(p))
        .flatten()
        .and_then(|tries| tries.first().copied());
        match first {
            Some(ep) => {
                // Every endpoint stays listed (the verdict's), the others at no share: tried
                // only when the first fails.
                a.endpoints = endpoints
                    .iter()
                    .map(|e| (*e, if *e == ep { 1.0 } else { 0.0 }))
                    .collect();
                let hashed = if scheduler == Scheduler::SourceHashing {
                    "the client's address"
                } else {
                    "the frontend's address"
                };
                a.reason = Some(format!(
                    "redirected to the userspace proxy on port {port}, whose scheduler \
                     {scheduler} hashes {hashed}: it connects to {} first (the Service's \
                     other ready endpoints only when that one fails or is quarantined)",
                    SocketAddr::new(ep.0, ep.1)
                ));
            }
            None => {
                let share = 1.0 / endpoints.len().max(1) as f64;
                a.endpoints = endpoints.iter().map(|e| (*e, share)).collect();
                a.reason = Some(format!(
                    "redirected to the userspace proxy on port {port}, which connects to one \
                     of the Service's ready endpoints: its scheduler {scheduler}'s choice, \
                     which depends on the running proxy's state (the shares shown are an even \
                     spread)"
                ));
            }
        }
    }
    a.verdict = Some(v);
}

/// Why no socket hook of the ebpf mode meets `p` (from the node or a pod): the programs that
/// would (connect, and for UDP sendmsg too, of `p`'s family) have no link pinned in the pin
/// directory, so none is attached (the proxy pins every link it attaches). `None` when one is,
/// or for a packet from outside (the tc path).
fn unhooked(hooks: &[&'static str], p: &Packet) -> Option<String> {
    if p.origin == Origin::External {
        return None;
    }
    let family = if p.dst.is_ipv4() { "4" } else { "6" };
    let mut programs = vec![format!("kp_connect{family}")];
    if p.protocol == Protocol::Udp {
        programs.push(format!("kp_sendmsg{family}"));
    }
    if programs.iter().any(|p| hooks.contains(&p.as_str())) {
        return None;
    }
    Some(format!(
        "no socket hook meets it: {} {} not attached (no link pinned: {}), so the maps are \
         not consulted",
        programs.join(" and "),
        if programs.len() == 1 { "is" } else { "are" },
        programs
            .iter()
            .map(|p| kp_ebpf::names::link(p))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// Which of the ebpf mode's programs meets `p`: the socket hooks for the node's and its pods'
/// sockets, the tc path for a packet that arrives from outside the node.
fn ebpf_path(p: &Packet) -> &'static str {
    if p.origin == Origin::External {
        "tc path (kp_tc_outside on the interface the packet arrives on)"
    } else {
        "socket hooks (cgroup connect / sendmsg, before any packet is sent)"
    }
}

/// The map entries that concern `p`, as the programs look them up: the frontend's head and
/// slots (both scopes from outside, the socket one otherwise), the backends they name, its
/// source ranges, and the address entries holding the destination.
fn ebpf_entries(tracer: &EbpfTracer, p: &Packet) -> Vec<String> {
    let maps = tracer.maps();
    let mut out = vec![ebpf_path(p).to_string()];
    let scopes: &[Scope] = if p.origin == Origin::External {
        &[Scope::Outside, Scope::Socket]
    } else {
        &[Scope::Socket]
    };
    let dest = endpoint_text(&p.dst, p.dport);
    let proto = p.protocol.as_lower();
    for scope in scopes {
        let frontend = FrontendAddr {
            ip: p.dst,
            port: p.dport,
            protocol: p.protocol,
            scope: *scope,
        };
        let Some(head) = maps.services.get(&ServiceKey { frontend, slot: 0 }) else {
            continue;
        };
        let scope_word = match scope {
            Scope::Socket => "socket",
            Scope::Outside => "outside",
        };
        out.push(format!(
            "kp_services {dest}/{proto} ({scope_word}) slot 0: {} backend(s), rev_nat {}, \
             affinity {}s, flags {:#x}",
            head.count, head.rev_nat, head.affinity, head.flags
        ));
        for slot in 1..=head.count {
            match maps.services.get(&ServiceKey { frontend, slot }) {
                Some(v) => match maps.backends.get(&v.backend_id) {
                    Some(b) => out.push(format!(
                        "kp_services slot {slot} -> kp_backends {}: {}",
                        v.backend_id,
                        endpoint_text(&b.ip, b.port)
                    )),
                    None => out.push(format!(
                        "kp_services slot {slot} -> kp_backends {}: missing",
                        v.backend_id
                    )),
                },
                None => out.push(format!("kp_services slot {slot}: missing")),
            }
        }
        if head.flags & FLAG_SRC_RANGES != 0 {
            let ranges: Vec<String> = maps
                .ranges
                .iter()
                .filter(|r| r.rev_nat == head.rev_nat)
                .map(|r| format!("{}/{}", r.prefix.ip, r.prefix.len))
                .collect();
            out.push(format!(
                "kp_src_ranges rev_nat {}: [{}]",
                head.rev_nat,
                ranges.join(", ")
            ));
        }
        // The programs use the first scope found.
        return out;
    }
    for (k, v) in &maps.addrs {
        let net = ipnet::IpNet::new(k.ip, k.len).ok();
        if net.is_some_and(|n| n.contains(&p.dst)) {
            out.push(format!("kp_addrs {}/{}: {v:?}", k.ip, k.len));
        }
    }
    out
}

/// Why the ebpf mode's programs refuse `p`, or leave it alone where an operator would expect
/// otherwise.
fn ebpf_reason(tracer: &EbpfTracer, v: &Verdict, p: &Packet) -> Option<String> {
    let outside = p.origin == Origin::External;
    if *v == Verdict::Untouched && outside && p.protocol == Protocol::Sctp {
        return Some(
            "SCTP from outside the node is left alone: the tc path translates TCP and UDP only"
                .into(),
        );
    }
    if !matches!(v, Verdict::Drop | Verdict::Reject) {
        return None;
    }
    let maps = tracer.maps();
    let scopes: &[Scope] = if outside {
        &[Scope::Outside, Scope::Socket]
    } else {
        &[Scope::Socket]
    };
    let head = scopes.iter().find_map(|scope| {
        maps.services.get(&ServiceKey {
            frontend: FrontendAddr {
                ip: p.dst,
                port: p.dport,
                protocol: p.protocol,
                scope: *scope,
            },
            slot: 0,
        })
    });
    let tc = if outside {
        " (the tc path drops what the socket hooks reject)"
    } else {
        ""
    };
    if let Some(head) = head {
        if outside
            && head.flags & FLAG_SRC_RANGES != 0
            && !maps.ranges.iter().any(|r| {
                r.rev_nat == head.rev_nat
                    && ipnet::IpNet::new(r.prefix.ip, r.prefix.len)
                        .is_ok_and(|n| n.contains(&p.src))
            })
        {
            return Some("the source is outside the Service's loadBalancerSourceRanges".into());
        }
        if head.count == 0 {
            return Some(if head.flags & FLAG_DROP_EMPTY != 0 {
                "no endpoint this traffic may use (a Local traffic policy with no endpoint on \
                 this node)"
                    .to_string()
            } else {
                format!("the Service port has no endpoints{tc}")
            });
        }
        return Some(format!("a slot of this frontend leads to no backend{tc}"));
    }
    let addr = maps
        .addrs
        .iter()
        .filter(|(k, _)| ipnet::IpNet::new(k.ip, k.len).is_ok_and(|n| n.contains(&p.dst)))
        .max_by_key(|(k, _)| k.len)
        .map(|(_, v)| *v);
    match addr {
        Some(kp_ebpf_plan::AddrVerdict::Reject) => Some(format!(
            "no Service has this port on this ClusterIP (unknown port){tc}"
        )),
        Some(kp_ebpf_plan::AddrVerdict::Drop) => Some(
            "the address is in a Service CIDR but no Service holds it (unallocated ClusterIP)"
                .into(),
        ),
        None => None,
    }
}

fn verdict_word(v: &Verdict) -> &'static str {
    match v {
        Verdict::Dnat { .. } => "dnat",
        Verdict::Untouched => "untouched",
        Verdict::Drop => "drop",
        Verdict::Reject => "reject",
    }
}

fn origin_word(o: Origin) -> &'static str {
    match o {
        Origin::External => "external",
        Origin::Pod => "pod",
        Origin::Node => "node",
    }
}

fn endpoint_text(ip: &IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}:{port}"),
        IpAddr::V6(_) => format!("[{ip}]:{port}"),
    }
}

/// The answer as JSON.
pub fn to_json(a: &Answer) -> Value {
    let (masquerade, affinity) = match &a.verdict {
        Some(Verdict::Dnat {
            masquerade,
            affinity,
            ..
        }) => (Some(*masquerade), *affinity),
        _ => (None, None),
    };
    json!({
        "packet": {
            "origin": origin_word(a.packet.origin),
            "from": a.packet.src.to_string(),
            "protocol": a.packet.protocol.as_lower(),
            "to": a.packet.dst.to_string(),
            "port": a.packet.dport,
        },
        "verdict": a.verdict.as_ref().map(verdict_word),
        "endpoints": a.endpoints.iter().map(|((ip, port), p)| json!({
            "ip": ip.to_string(), "port": port, "probability": p,
        })).collect::<Vec<_>>(),
        "masquerade": masquerade,
        "affinitySeconds": affinity,
        "services": a.services,
        "reason": a.reason,
        "decidedBy": a.decided_by,
        "error": a.error,
    })
}

/// The answer for an operator.
pub fn to_text(a: &Answer) -> String {
    let mut s = String::new();
    let p = &a.packet;
    let _ = writeln!(
        s,
        "packet:  {} {} -> {} (from {})",
        p.protocol.as_lower(),
        p.src,
        endpoint_text(&p.dst, p.dport),
        origin_word(p.origin)
    );
    if !a.services.is_empty() {
        let _ = writeln!(s, "service: {}", a.services.join(", "));
    }
    match &a.verdict {
        None => {
            let _ = writeln!(
                s,
                "verdict: unknown: {}",
                a.error.as_deref().unwrap_or("the trace failed")
            );
        }
        Some(Verdict::Untouched) => {
            let _ = writeln!(
                s,
                "verdict: not a Service packet: left alone by kube-proxy's rules"
            );
        }
        Some(Verdict::Drop) => {
            let _ = writeln!(s, "verdict: DROPPED");
        }
        Some(Verdict::Reject) => {
            let _ = writeln!(s, "verdict: REJECTED (ICMP unreachable / TCP reset)");
        }
        Some(Verdict::Dnat {
            endpoints,
            masquerade,
            affinity,
        }) => {
            let _ = writeln!(
                s,
                "verdict: DNAT to one of {} endpoint{}",
                endpoints.len(),
                if endpoints.len() == 1 { "" } else { "s" }
            );
            for ((ip, port), prob) in &a.endpoints {
                let _ = writeln!(
                    s,
                    "  {:<28} {:>5.1}%",
                    endpoint_text(ip, *port),
                    prob * 100.0
                );
            }
            let _ = writeln!(
                s,
                "masquerade: {}",
                if *masquerade {
                    "yes: the endpoint sees the node's address"
                } else {
                    "no: the endpoint sees the client's address"
                }
            );
            if let Some(t) = affinity {
                let _ = writeln!(s, "affinity: ClientIP, {t}s: later connections from this client go to the endpoint it got first");
            }
        }
    }
    if let Some(r) = &a.reason {
        let _ = writeln!(s, "why:     {r}");
    }
    if !a.decided_by.is_empty() {
        let _ = writeln!(s, "decided by (live rules):");
        let mut seen = BTreeSet::new();
        for d in a.decided_by.iter().filter(|d| seen.insert(*d)) {
            let _ = writeln!(s, "  {d}");
        }
    }
    s
}

/// Parses `PROTO` (`tcp`, `udp`, `sctp`).
pub fn protocol(s: &str) -> Option<Protocol> {
    Protocol::ALL
        .into_iter()
        .find(|p| p.as_lower().eq_ignore_ascii_case(s))
}

/// Parses `DEST:PORT` (`[V6]:PORT` for IPv6).
pub fn destination(s: &str) -> Option<(IpAddr, u16)> {
    let addr: std::net::SocketAddr = s.parse().ok()?;
    Some((addr.ip(), addr.port()))
}

/// The origin a packet from `from` has: the node itself for one of its own addresses, a pod
/// for an address in the cluster CIDRs, else an external client.
pub fn infer_origin(from: IpAddr, local: &[IpAddr], cluster_cidrs: &[ipnet::IpNet]) -> Origin {
    if local.contains(&from) || from.is_loopback() {
        Origin::Node
    } else if cluster_cidrs.iter().any(|c| c.contains(&from)) {
        Origin::Pod
    } else {
        Origin::External
    }
}

/// The source address a node process uses towards `dst`: the one the kernel's route to `dst`
/// prefers (`ip route get`), else the first non-loopback address of its family (loopback when
/// there is none).
pub fn node_source(dst: IpAddr, local: &[IpAddr]) -> IpAddr {
    super::live::route_source(dst).unwrap_or_else(|| first_address(dst, local))
}

/// The first non-loopback, non-link-local address of `dst`'s family (loopback when none).
fn first_address(dst: IpAddr, local: &[IpAddr]) -> IpAddr {
    local
        .iter()
        .copied()
        .find(|a| {
            a.is_ipv4() == dst.is_ipv4()
                && !a.is_loopback()
                && !matches!(a, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
        })
        .unwrap_or(if dst.is_ipv4() {
            IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
        } else {
            IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_and_protocols_parse_as_operators_write_them() {
        assert_eq!(
            destination("10.96.0.10:80"),
            Some(("10.96.0.10".parse().unwrap(), 80))
        );
        assert_eq!(
            destination("[fd00:10:96::10]:53"),
            Some(("fd00:10:96::10".parse().unwrap(), 53))
        );
        assert_eq!(destination("10.96.0.10"), None);
        assert_eq!(protocol("TCP"), Some(Protocol::Tcp));
        assert_eq!(protocol("icmp"), None);
    }

    #[test]
    fn the_origin_follows_the_source_address() {
        let local: Vec<IpAddr> = vec!["192.0.2.1".parse().unwrap()];
        let cidrs = vec!["10.244.0.0/16".parse().unwrap()];
        let o = |s: &str| infer_origin(s.parse().unwrap(), &local, &cidrs);
        assert_eq!(o("192.0.2.1"), Origin::Node);
        assert_eq!(o("10.244.1.14"), Origin::Pod);
        assert_eq!(o("192.0.2.5"), Origin::External);
        assert_eq!(
            first_address("10.96.0.10".parse().unwrap(), &local),
            "192.0.2.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            first_address("fd00::1".parse().unwrap(), &local),
            "::1".parse::<IpAddr>().unwrap()
        );
    }
}
