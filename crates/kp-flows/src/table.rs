//! The rows: for a packet from some client, which endpoints may answer and with which source
//! address, or whether it is dropped, rejected or left alone.
//!
//! Expectations are upstream kube-proxy's (`pkg/proxy/nftables/proxier.go` and
//! `pkg/proxy/iptables/proxier.go`, which agree on every row unless a comment says otherwise).

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_core::flow::Tracer;
use kp_core::flow::{Origin, Packet, Verdict};
use kp_core::model::Protocol;

use crate::fixture::pod;
use crate::{
    CLIENT, CLIENT6, CLIENT_OUTSIDE, CLIENT_OUTSIDE6, NODE, NODE_IP, NODE_IP6, NODE_POD_GATEWAY,
    NODE_POD_GATEWAY_V6, SCTP_PORT, TCP_PORT, UDP_PORT,
};

/// A row's `from` for the node sending from the LoadBalancer IP it connects to (the IP is local
/// on the node); real-packet runs add it to the node's loopback for the row.
pub const NODE_FROM_LB_IP: &str = "node-from-lb-ip";

/// What a row expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Answered by one of these pods (every one of them, over enough tries).
    Pods {
        /// Pod names.
        pods: Vec<&'static str>,
        /// The pods' port.
        port: u16,
        /// Whether the pod sees the node's address instead of the client's.
        masquerade: bool,
        /// ClientIP affinity timeout, if the client sticks to one pod.
        affinity: Option<u32>,
    },
    /// Not handled by the proxy at all.
    Untouched,
    /// Silently dropped.
    Drop,
    /// Rejected.
    Reject,
}

/// One row of the table.
#[derive(Clone, Debug)]
pub struct Case {
    /// What the row shows.
    pub name: &'static str,
    /// Where the client sits: `client`, `client-outside`, `node`, [`NODE_FROM_LB_IP`], or a pod
    /// name.
    pub from: &'static str,
    /// The packet.
    pub packet: Packet,
    /// What must happen.
    pub expect: Expect,
    /// The row needs endpoints on a second node (real-packet runs need a two-node lab).
    pub needs_second_node: bool,
}

impl Case {
    /// Whether the row sends SCTP, which real-packet runs skip (loudly) on kernels without it.
    pub fn needs_sctp(&self) -> bool {
        self.packet.protocol == Protocol::Sctp
    }

    /// The row as a mode with `support` must pass it: unchanged, except for what the mode
    /// declares it does not do ([`Support`]):
    /// - without SCTP, an SCTP row must be rejected (as an unknown port is), not left
    ///   unanswered;
    /// - without the path for traffic from outside the node, a row whose packet arrives from
    ///   outside must be left alone ([`Expect::Untouched`]: nothing of the mode answers it);
    /// - with that path but without SCTP on it, an SCTP row from outside is left alone too;
    ///   without rejects on it, what upstream rejects from outside is dropped;
    /// - without source NAT (for the row's origin: [`Support::source_nat`], or
    ///   [`Support::outside_source_nat`] from outside), a backend sees the client socket's own
    ///   source: a pod's address, a bound address as bound, and for the node's unbound sockets
    ///   the node's address on the link towards the backend (what a masqueraded row expects).
    ///   So a row expects masquerade exactly when it comes from `node`.
    pub fn for_mode(&self, support: Support) -> Case {
        let mut case = self.clone();
        let outside = self.packet.origin == Origin::External;
        if self.needs_sctp() && !support.sctp {
            case.expect = Expect::Reject;
        }
        if outside {
            if !support.from_outside || (self.needs_sctp() && !support.outside_sctp) {
                case.expect = Expect::Untouched;
            } else if case.expect == Expect::Reject && !support.outside_reject {
                case.expect = Expect::Drop;
            }
        }
        let source_nat = if outside {
            support.outside_source_nat
        } else {
            support.source_nat
        };
        if !source_nat {
            if let Expect::Pods { masquerade, .. } = &mut case.expect {
                *masquerade = self.from == "node";
            }
        }
        case
    }

    /// Whether [`Case::for_mode`] changes the row for a mode with `support`.
    pub fn changed_for(&self, support: Support) -> bool {
        self.for_mode(support).expect != self.expect
    }
}

/// What a mode proxies of what the table holds. Every row is checked in every mode; a mode
/// that does not carry something declares it here, with the reason, and is held to a
/// behaviour the row still checks ([`Case::for_mode`]), so the row is neither dropped nor
/// passed silently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Support {
    /// Whether SCTP Services are proxied.
    pub sctp: bool,
    /// Whether traffic that arrives from outside the node (on its interfaces) is proxied.
    pub from_outside: bool,
    /// Whether the mode rewrites the source of a connection from the node or its pods where
    /// upstream masquerades.
    pub source_nat: bool,
    /// Whether the mode rewrites the source of traffic from outside the node where upstream
    /// masquerades (with [`Support::from_outside`]).
    pub outside_source_nat: bool,
    /// Whether what upstream rejects from outside the node is rejected (a TCP reset, an ICMP
    /// error); `false`: it is dropped. With [`Support::from_outside`].
    pub outside_reject: bool,
    /// Whether SCTP from outside the node is proxied (with [`Support::from_outside`] and
    /// [`Support::sctp`]); `false`: it is left alone.
    pub outside_sctp: bool,
    /// Why the mode lacks what it lacks; empty for a mode that lacks nothing.
    pub reason: &'static str,
}

impl Support {
    /// Every protocol and path of the table (the kernel modes).
    pub const ALL: Support = Support {
        sctp: true,
        from_outside: true,
        source_nat: true,
        outside_source_nat: true,
        outside_reject: true,
        outside_sctp: true,
        reason: "",
    };
    /// TCP and UDP only (userspace mode: the proxy has no SCTP socket).
    pub const NO_SCTP: Support = Support {
        sctp: false,
        reason: "the userspace proxy has no SCTP socket",
        ..Support::ALL
    };
    /// Socket load balancing (the ebpf mode without its tc path): cgroup hooks rewrite the
    /// destination a socket on the node or in its pods connects or sends to, so traffic that
    /// arrives from outside the node meets no program, and no source is ever rewritten.
    pub const SOCKET_LB: Support = Support {
        sctp: true,
        from_outside: false,
        source_nat: false,
        outside_source_nat: false,
        outside_reject: false,
        outside_sctp: false,
        reason: "socket load balancing only: traffic from outside the node meets no program \
                 (the tc path is not attached), and backends see the client socket's own source",
    };
    /// The ebpf mode: socket load balancing for the node and its pods (no source rewritten,
    /// as [`Support::SOCKET_LB`]) and the tc path for traffic from outside the node, which
    /// translates TCP and UDP to a backend and masquerades where upstream does, but drops what
    /// upstream rejects (no TCP reset or ICMP error is built in tc) and leaves SCTP alone.
    pub const SOCKET_LB_TC: Support = Support {
        sctp: true,
        from_outside: true,
        source_nat: false,
        outside_source_nat: true,
        outside_reject: false,
        outside_sctp: false,
        reason: "socket load balancing for the node and its pods: backends see the client \
                 socket's own source; the tc path for traffic from outside the node: TCP and \
                 UDP only (SCTP left alone), and what upstream rejects is dropped (no TCP \
                 reset or ICMP error is built in tc)",
    };
}

fn ip(s: &str) -> IpAddr {
    s.parse()
        .unwrap_or_else(|e| panic!("fixture address {s}: {e}"))
}

/// Where a row's packet enters and its source address, in the destination's family.
fn source_of(from: &str, dst: IpAddr) -> (Origin, IpAddr) {
    let v6 = dst.is_ipv6();
    let pick = |v4: &str, v6_addr: &str| ip(if v6 { v6_addr } else { v4 });
    match from {
        "client" => (Origin::External, pick(CLIENT, CLIENT6)),
        "client-outside" => (Origin::External, pick(CLIENT_OUTSIDE, CLIENT_OUTSIDE6)),
        // A connection to a loopback address leaves from the same loopback address.
        "node" if dst.is_loopback() => (Origin::Node, dst),
        // The node reaching its own LoadBalancer IP where that IP is local (bound, or routed
        // locally as GCE does): the connection leaves from the LoadBalancer IP itself.
        NODE_FROM_LB_IP => (Origin::Node, dst),
        "node" => (Origin::Node, pick(NODE_IP, NODE_IP6)),
        p => {
            let pod = pod(p);
            let v6_addr = pod
                .v6
                .unwrap_or_else(|| panic!("fixture pod {p} has no IPv6 address"));
            (Origin::Pod, pick(pod.v4, v6_addr))
        }
    }
}

fn row(
    name: &'static str,
    from: &'static str,
    proto: Protocol,
    dst: &str,
    dport: u16,
    expect: Expect,
) -> Case {
    let dst = ip(dst);
    let (origin, src) = source_of(from, dst);
    let needs_second_node = matches!(&expect, Expect::Pods { pods, .. }
        if pods.iter().any(|p| pod(p).node != NODE));
    Case {
        name,
        from,
        packet: Packet {
            origin,
            src,
            protocol: proto,
            dst,
            dport,
        },
        expect,
        needs_second_node,
    }
}

/// Answered by `pods` on the echo servers' TCP port.
fn to(pods: &[&'static str], masquerade: bool) -> Expect {
    to_port(pods, TCP_PORT, masquerade)
}

fn to_port(pods: &[&'static str], port: u16, masquerade: bool) -> Expect {
    Expect::Pods {
        pods: pods.to_vec(),
        port,
        masquerade,
        affinity: None,
    }
}

const KEPT: bool = false;
const MASQUERADED: bool = true;

/// Every row.
pub fn cases() -> Vec<Case> {
    use Protocol::{Sctp, Tcp, Udp};
    let web = ["pod-1", "pod-2", "pod-3"];
    vec![
        // --- ClusterIP -------------------------------------------------------------------
        row(
            "pod to ClusterIP spreads over all endpoints, source kept",
            "pod-4",
            Tcp,
            "10.96.0.10",
            80,
            to(&web, KEPT),
        ),
        row(
            "external client to ClusterIP is masqueraded",
            "client",
            Tcp,
            "10.96.0.10",
            80,
            to(&web, MASQUERADED),
        ),
        row(
            "node to ClusterIP is masqueraded",
            "node",
            Tcp,
            "10.96.0.10",
            80,
            to(&web, MASQUERADED),
        ),
        // Upstream nftables: the `cluster-ips-check` chain, after DNAT, rejects anything still
        // addressed to a ClusterIP ("Reject traffic to invalid ports of ClusterIPs"). Upstream
        // iptables leaves it alone; kube-proxy-rs gives every mode the nftables behaviour.
        row(
            "a ClusterIP on a port no Service uses is rejected",
            "pod-4",
            Tcp,
            "10.96.0.10",
            81,
            Expect::Reject,
        ),
        row(
            "a Service without endpoints rejects",
            "pod-4",
            Tcp,
            "10.96.0.20",
            80,
            Expect::Reject,
        ),
        // Upstream nftables: after the ClusterIP checks, anything still addressed to a Service
        // CIDR is for an address no Service holds ("Drop traffic to unallocated ClusterIPs").
        // The fixture's ServiceCIDR object holds 10.96.0.0/16 and fd00:10:96::/112.
        row(
            "traffic to an unallocated ClusterIP is dropped",
            "pod-4",
            Tcp,
            "10.96.0.99",
            80,
            Expect::Drop,
        ),
        row(
            "the node's traffic to an unallocated ClusterIP is dropped",
            "node",
            Tcp,
            "10.96.0.99",
            80,
            Expect::Drop,
        ),
        row(
            "UDP to an unallocated ClusterIP is dropped",
            "pod-4",
            Udp,
            "10.96.0.99",
            53,
            Expect::Drop,
        ),
        row(
            "traffic to an unallocated IPv6 ClusterIP is dropped",
            "pod-4",
            Tcp,
            "fd00:10:96::99",
            80,
            Expect::Drop,
        ),
        row(
            "traffic outside the Service CIDRs is left alone",
            "pod-4",
            Tcp,
            "10.97.0.10",
            80,
            Expect::Untouched,
        ),
        // --- NodePort and nodePortAddresses --------------------------------------------
        row(
            "NodePort from outside reaches every endpoint, masqueraded",
            "client",
            Tcp,
            NODE_IP,
            30080,
            to(&web, MASQUERADED),
        ),
        row(
            "NodePort from a pod to the node's primary address",
            "pod-4",
            Tcp,
            NODE_IP,
            30080,
            to(&web, MASQUERADED),
        ),
        row(
            "NodePorts answer only on the primary address (nodePortAddresses: primary)",
            "pod-4",
            Tcp,
            NODE_POD_GATEWAY,
            30080,
            Expect::Untouched,
        ),
        row(
            "NodePorts do not answer outside clients on another node address either",
            "client",
            Tcp,
            NODE_POD_GATEWAY,
            30080,
            Expect::Untouched,
        ),
        // Localhost NodePorts are off in the table's configuration: `primary` never includes
        // 127.0.0.1, and nftables mode never supports them. Upstream iptables mode with
        // `localhostNodePorts: true` (its default) and nodePortAddresses covering 127.0.0.1
        // would DNAT this (and set route_localnet); a table run with that config would expect
        // the `web` endpoints, masqueraded.
        row(
            "localhost NodePorts are off: 127.0.0.1 is left alone",
            "node",
            Tcp,
            "127.0.0.1",
            30080,
            Expect::Untouched,
        ),
        // route_localnet has no IPv6 twin: upstream never serves NodePorts on ::1.
        row(
            "IPv6 localhost never has NodePorts",
            "node",
            Tcp,
            "::1",
            30120,
            Expect::Untouched,
        ),
        // --- UDP and SCTP ------------------------------------------------------------------
        row(
            "UDP ClusterIP",
            "pod-4",
            Udp,
            "10.96.0.53",
            53,
            to_port(&["pod-1", "pod-2"], UDP_PORT, KEPT),
        ),
        row(
            "UDP from outside is masqueraded",
            "client",
            Udp,
            "10.96.0.53",
            53,
            to_port(&["pod-1", "pod-2"], UDP_PORT, MASQUERADED),
        ),
        row(
            "a UDP Service without endpoints rejects (ICMP port unreachable)",
            "pod-4",
            Udp,
            "10.96.0.54",
            53,
            Expect::Reject,
        ),
        row(
            "SCTP ClusterIP",
            "pod-4",
            Sctp,
            "10.96.0.132",
            SCTP_PORT,
            to_port(&["pod-1", "pod-2"], SCTP_PORT, KEPT),
        ),
        // --- Session affinity ------------------------------------------------------------
        row(
            "ClientIP affinity sticks with its timeout",
            "pod-4",
            Tcp,
            "10.96.0.30",
            80,
            Expect::Pods {
                pods: vec!["pod-1", "pod-2"],
                port: TCP_PORT,
                masquerade: KEPT,
                affinity: Some(60),
            },
        ),
        // --- ExternalIPs and LoadBalancers -------------------------------------------------
        row(
            "ExternalIP from outside is masqueraded",
            "client",
            Tcp,
            "198.51.100.10",
            80,
            to(&["pod-3"], MASQUERADED),
        ),
        row(
            "LoadBalancer IP from inside the source ranges is served",
            "client",
            Tcp,
            "198.51.100.20",
            80,
            to(&["pod-1", "pod-2"], MASQUERADED),
        ),
        row(
            "LoadBalancer IP from outside the source ranges drops",
            "client-outside",
            Tcp,
            "198.51.100.20",
            80,
            Expect::Drop,
        ),
        // Upstream (both proxiers, "allowFromNode"): source ranges that hold a node address
        // also admit the node's own traffic to the LoadBalancer IP, which carries that IP as
        // its source. External policy Cluster: masqueraded, as any node-sourced external hit.
        row(
            "the node reaches its LoadBalancer IP when the source ranges hold its address",
            NODE_FROM_LB_IP,
            Tcp,
            "198.51.100.20",
            80,
            to(&["pod-1", "pod-2"], MASQUERADED),
        ),
        row(
            "LoadBalancer NodePort is not subject to source ranges",
            "client-outside",
            Tcp,
            NODE_IP,
            30050,
            to(&["pod-1", "pod-2"], MASQUERADED),
        ),
        // --- Hairpin -------------------------------------------------------------------------
        row(
            "hairpin: a pod reaching itself through its Service is masqueraded",
            "pod-1",
            Tcp,
            "10.96.0.60",
            80,
            to(&["pod-1"], MASQUERADED),
        ),
        row(
            "another pod reaching the same Service keeps its source",
            "pod-4",
            Tcp,
            "10.96.0.60",
            80,
            to(&["pod-1"], KEPT),
        ),
        // --- IPv6 and dual-stack -------------------------------------------------------------
        row(
            "single-stack IPv6 ClusterIP",
            "pod-4",
            Tcp,
            "fd00:10:96::10",
            80,
            to(&["pod-1", "pod-2"], KEPT),
        ),
        row(
            "dual-stack Service over IPv4",
            "pod-4",
            Tcp,
            "10.96.0.120",
            80,
            to(&["pod-1", "pod-2"], KEPT),
        ),
        row(
            "dual-stack Service over IPv6 reaches an endpoint on another node, source kept",
            "pod-4",
            Tcp,
            "fd00:10:96::120",
            80,
            to(&["pod-2", "remote-1"], KEPT),
        ),
        row(
            "IPv6 NodePort on the node's primary IPv6 address, masqueraded",
            "client",
            Tcp,
            NODE_IP6,
            30120,
            to(&["pod-2", "remote-1"], MASQUERADED),
        ),
        // Upstream runs one proxier per family; the IPv6 one sees no endpoints and rejects.
        row(
            "a dual-stack Service without IPv6 endpoints rejects on its IPv6 ClusterIP",
            "pod-4",
            Tcp,
            "fd00:10:96::121",
            80,
            Expect::Reject,
        ),
        row(
            "the same Service still serves its IPv4 ClusterIP",
            "pod-4",
            Tcp,
            "10.96.0.121",
            80,
            to(&["pod-1"], KEPT),
        ),
        // --- externalTrafficPolicy: Local ----------------------------------------------------
        row(
            "externalTrafficPolicy Local: NodePort uses local endpoints and keeps the source",
            "client",
            Tcp,
            NODE_IP,
            30070,
            to(&["pod-2"], KEPT),
        ),
        row(
            "externalTrafficPolicy Local: an ExternalIP uses local endpoints and keeps the source",
            "client",
            Tcp,
            "198.51.100.70",
            80,
            to(&["pod-2"], KEPT),
        ),
        // Upstream's external chain sends pod-sourced traffic ("short-circuit pod traffic")
        // to the cluster set unmasqueraded: the pod's own node is not a load balancer hop.
        row(
            "externalTrafficPolicy Local: pods short-circuit to every endpoint",
            "pod-4",
            Tcp,
            NODE_IP,
            30070,
            to(&["pod-2", "remote-1"], KEPT),
        ),
        row(
            "externalTrafficPolicy Local: pods short-circuit an ExternalIP to every endpoint",
            "pod-4",
            Tcp,
            "198.51.100.70",
            80,
            to(&["pod-2", "remote-1"], KEPT),
        ),
        // ... and node-sourced traffic too, but masqueraded ("masquerade local traffic").
        row(
            "externalTrafficPolicy Local: the node short-circuits too, masqueraded",
            "node",
            Tcp,
            NODE_IP,
            30070,
            to(&["pod-2", "remote-1"], MASQUERADED),
        ),
        row(
            "externalTrafficPolicy Local without local endpoints drops external traffic",
            "client",
            Tcp,
            NODE_IP,
            30071,
            Expect::Drop,
        ),
        row(
            "externalTrafficPolicy Local without local endpoints still serves pods",
            "pod-4",
            Tcp,
            NODE_IP,
            30071,
            to(&["remote-1"], KEPT),
        ),
        row(
            "ClusterIP of an externalTrafficPolicy Local Service uses every endpoint",
            "pod-4",
            Tcp,
            "10.96.0.70",
            80,
            to(&["pod-2", "remote-1"], KEPT),
        ),
        // --- internalTrafficPolicy: Local ----------------------------------------------------
        row(
            "internalTrafficPolicy Local: pods use only local endpoints",
            "pod-4",
            Tcp,
            "10.96.0.85",
            80,
            to(&["pod-3"], KEPT),
        ),
        row(
            "internalTrafficPolicy Local: the node uses only local endpoints, masqueraded",
            "node",
            Tcp,
            "10.96.0.85",
            80,
            to(&["pod-3"], MASQUERADED),
        ),
        // Endpoints exist on another node, so this is not "no endpoints" (REJECT): both
        // upstream modes DROP ("has no local endpoints"), as for externalTrafficPolicy Local.
        row(
            "internalTrafficPolicy Local without local endpoints drops",
            "pod-4",
            Tcp,
            "10.96.0.86",
            80,
            Expect::Drop,
        ),
        // --- Terminating endpoints (upstream `CategorizeEndpoints`) --------------------------
        row(
            "with no ready endpoint, serving terminating endpoints take the traffic",
            "pod-4",
            Tcp,
            "10.96.0.90",
            80,
            to(&["pod-1"], KEPT),
        ),
        row(
            "terminating endpoints are unused while any endpoint is ready",
            "pod-4",
            Tcp,
            "10.96.0.91",
            80,
            to(&["pod-3"], KEPT),
        ),
        // The fallback is decided per set: the local set has no ready endpoint and falls back
        // to its serving terminating one; the cluster set has a ready one elsewhere.
        row(
            "externalTrafficPolicy Local falls back to a local serving terminating endpoint",
            "client",
            Tcp,
            NODE_IP,
            30092,
            to(&["pod-2"], KEPT),
        ),
        row(
            "the same Service's ClusterIP uses only the ready endpoint on another node",
            "pod-4",
            Tcp,
            "10.96.0.92",
            80,
            to(&["remote-1"], KEPT),
        ),
        // --- Topology hints (upstream `canUseTopology`) -----------------------------------
        row(
            "topology hints: only endpoints hinted for this node's zone",
            "pod-4",
            Tcp,
            "10.96.0.100",
            80,
            to(&["pod-1", "pod-2"], KEPT),
        ),
        row(
            "topology hints are ignored unless every endpoint has them",
            "pod-4",
            Tcp,
            "10.96.0.101",
            80,
            to(&["pod-1", "pod-2", "pod-3"], KEPT),
        ),
        row(
            "topology hints are ignored when none is for this node's zone",
            "pod-4",
            Tcp,
            "10.96.0.102",
            80,
            to(&["pod-1", "pod-2"], KEPT),
        ),
        // --- Endpoints on another node ---------------------------------------------------
        row(
            "a Service with every endpoint on another node, from outside, is masqueraded",
            "client",
            Tcp,
            NODE_IP,
            30110,
            to(&["remote-1"], MASQUERADED),
        ),
        row(
            "a pod reaches an endpoint on another node with its own source",
            "pod-4",
            Tcp,
            "10.96.0.110",
            80,
            to(&["remote-1"], KEPT),
        ),
    ]
}

/// The verdict a row expects, in tracer terms.
pub fn expected_verdict(case: &Case) -> Verdict {
    match &case.expect {
        Expect::Pods {
            pods: names,
            port,
            masquerade,
            affinity,
        } => {
            let v6 = case.packet.dst.is_ipv6();
            let endpoints: BTreeSet<(IpAddr, u16)> = names
                .iter()
                .map(|n| {
                    let p = pod(n);
                    let addr = if v6 {
                        p.v6.unwrap_or_else(|| panic!("fixture pod {n} has no IPv6 address"))
                    } else {
                        p.v4
                    };
                    (ip(addr), *port)
                })
                .collect();
            Verdict::Dnat {
                endpoints,
                masquerade: *masquerade,
                affinity: *affinity,
            }
        }
        Expect::Untouched => Verdict::Untouched,
        Expect::Drop => Verdict::Drop,
        Expect::Reject => Verdict::Reject,
    }
}

/// The node's own addresses, for tracers (`fib daddr type local`): its primary addresses, its
/// pod-network gateways and loopback.
pub fn node_addresses() -> Vec<IpAddr> {
    [
        NODE_IP,
        NODE_IP6,
        NODE_POD_GATEWAY,
        NODE_POD_GATEWAY_V6,
        "127.0.0.1",
        "::1",
    ]
    .into_iter()
    .map(ip)
    .collect()
}

/// Runs every row through `tracer`; returns one message per failing row.
pub fn check_tracer(tracer: &impl Tracer) -> Vec<String> {
    check_tracer_for(tracer, Support::ALL)
}

/// Detect-local by interface, checked through a mode's tracer: `traced(detect, links)` is the
/// mode's full plan for the fixture with `detect` (see [`crate::node_context_with`]) replayed
/// into its tracer over `links`. Every row passes with each form of
/// [`crate::interface_detect_locals`], as with the cluster CIDRs; with prefix `cali`, which no
/// pod interface has, some rows fail, and only rows from pods (their ClusterIP traffic is
/// masqueraded): the interface match decides. Panics naming the rows that went wrong.
pub fn check_detect_local_by_interface<T: Tracer>(
    traced: impl Fn(&kp_core::node::DetectLocal, kp_core::flow::Ingress) -> T,
) {
    check_detect_local_by_interface_for(Support::ALL, traced);
}

/// [`check_detect_local_by_interface`] for a mode with `support`: each row as
/// [`Case::for_mode`] makes it.
pub fn check_detect_local_by_interface_for<T: Tracer>(
    support: Support,
    traced: impl Fn(&kp_core::node::DetectLocal, kp_core::flow::Ingress) -> T,
) {
    for (detect, links) in crate::interface_detect_locals() {
        let failures = check_tracer_for(&traced(&detect, links), support);
        assert!(
            failures.is_empty(),
            "{detect:?}: {} rows failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    let elsewhere = kp_core::node::DetectLocal::InterfaceNamePrefix(
        kp_core::node::InterfaceName::new("cali").expect("interface name"),
    );
    let failures = check_tracer_for(&traced(&elsewhere, crate::ingress()), support);
    assert!(!failures.is_empty(), "prefix cali changed no row");
    for f in &failures {
        assert!(f.contains("Pod "), "only rows from pods change: {f}");
    }
}

/// [`check_tracer`] for a mode with `support`: each row as [`Case::for_mode`] makes it.
pub fn check_tracer_for(tracer: &impl Tracer, support: Support) -> Vec<String> {
    cases()
        .iter()
        .filter_map(|row| {
            let case = row.for_mode(support);
            let want = expected_verdict(&case);
            let got = tracer.trace(&case.packet);
            let declared = if row.changed_for(support) {
                format!(" (row as declared for this mode: {})", support.reason)
            } else {
                String::new()
            };
            (got != want).then(|| {
                format!(
                    "{}{declared}: {}\n    want {want:?}\n    got  {got:?}",
                    case.name, case.packet
                )
            })
        })
        .collect()
}
