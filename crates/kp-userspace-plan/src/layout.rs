//! The layout of the `inet kube-proxy-userspace` table: its chains, its sets (one per role and
//! IP family), and its fixed rules. Services only ever add and remove set and map elements
//! ([`crate::redirect`]); the rules below never change after the table is made.
//!
//! | hook (priority) | chain | does |
//! |---|---|---|
//! | prerouting (-150) | `mangle-prerouting` | marks packets for the proxy's transparent sockets |
//! | prerouting (-110) | `filter-prerouting` | source ranges; `Local` policy without local endpoints drops outside clients |
//! | output (-110) | `filter-output-pre-dnat` | source ranges; no-endpoint verdicts |
//! | prerouting, output (-100) | `nat-prerouting`, `nat-output` | redirects every frontend to the proxy port (with detect-local by interface, what arrives on the pods' interface(s) to the pod port) |
//! | input, forward (-110) | `filter-input`, `filter-forward` | no-endpoint verdicts |
//! | forward (-110), output (-90) | `filter-forward`, `filter-output-post-dnat` | unknown ClusterIP ports reject, unallocated ClusterIPs drop |

use kp_core::model::IpFamily;
use kp_core::node::LocalInterface;
pub use kp_nftables_plan::layout::{ChainDef, RuleDef};

use crate::names::*;

/// How the table is made: what its fixed rules say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedirectConfig {
    /// The proxy port every TCP and UDP frontend is redirected to (both families; SCTP
    /// frontends are rejected, the proxy has no SCTP socket).
    pub proxy_port: u16,
    /// The mark the mangle chain sets on packets for a transparent socket (policy routing
    /// sends them to the local stack).
    pub transparent_mark: u32,
    /// Whether NodePorts answer only on the addresses of the `nodeport-addresses` sets
    /// (`nodePortAddresses` configured, or `primary`); otherwise on every local address but
    /// loopback.
    pub node_ports_restricted: bool,
}

impl RedirectConfig {
    /// The pod port: with detect-local by interface, connections that arrive on the pods'
    /// interface(s) are redirected here instead of to the proxy port, and the proxy, which
    /// listens on both, takes what it accepts here for a pod's (see [`pod_port`]).
    pub fn pod_port(&self) -> Option<u16> {
        pod_port(self.proxy_port)
    }
}

/// The pod port of proxy port `proxy_port`: its sibling, `proxy_port + 1`; `None` for 65535,
/// which has none (the proxy does not take it with detect-local by interface, and a table
/// planned for it redirects every connection to the proxy port, as without the interface).
pub fn pod_port(proxy_port: u16) -> Option<u16> {
    proxy_port.checked_add(1)
}

/// The role of a set: with an IP family, a [`SetId`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SetKind {
    /// `cluster-ips`: address.
    ClusterIps,
    /// `service-cidrs`: network.
    ServiceCidrs,
    /// `pod-cidrs`: network.
    PodCidrs,
    /// `nodeport-addresses`: network.
    NodePortAddresses,
    /// `redirect-vips`: address . protocol . port.
    RedirectVips,
    /// `redirect-nodeports`: protocol . port.
    RedirectNodePorts,
    /// `no-endpoint-vips`: address . protocol . port : verdict.
    NoEndpointVips,
    /// `no-endpoint-nodeports`: protocol . port : verdict.
    NoEndpointNodePorts,
    /// `no-local-vips`: address . protocol . port.
    NoLocalVips,
    /// `no-local-nodeports`: protocol . port.
    NoLocalNodePorts,
    /// `firewall-vips`: address . protocol . port.
    FirewallVips,
    /// `firewall-allow`: address . protocol . port . network.
    FirewallAllow,
}

impl SetKind {
    /// Every kind, in declaration order.
    pub const ALL: [SetKind; 12] = [
        SetKind::ClusterIps,
        SetKind::ServiceCidrs,
        SetKind::PodCidrs,
        SetKind::NodePortAddresses,
        SetKind::RedirectVips,
        SetKind::RedirectNodePorts,
        SetKind::NoEndpointVips,
        SetKind::NoEndpointNodePorts,
        SetKind::NoLocalVips,
        SetKind::NoLocalNodePorts,
        SetKind::FirewallVips,
        SetKind::FirewallAllow,
    ];

    /// The name without the family suffix.
    pub fn base_name(self) -> &'static str {
        match self {
            SetKind::ClusterIps => CLUSTER_IPS,
            SetKind::ServiceCidrs => SERVICE_CIDRS,
            SetKind::PodCidrs => POD_CIDRS,
            SetKind::NodePortAddresses => NODEPORT_ADDRESSES,
            SetKind::RedirectVips => REDIRECT_VIPS,
            SetKind::RedirectNodePorts => REDIRECT_NODEPORTS,
            SetKind::NoEndpointVips => NO_ENDPOINT_VIPS,
            SetKind::NoEndpointNodePorts => NO_ENDPOINT_NODEPORTS,
            SetKind::NoLocalVips => NO_LOCAL_VIPS,
            SetKind::NoLocalNodePorts => NO_LOCAL_NODEPORTS,
            SetKind::FirewallVips => FIREWALL_VIPS,
            SetKind::FirewallAllow => FIREWALL_ALLOW,
        }
    }

    /// Whether its elements carry values (a verdict map).
    pub fn is_map(self) -> bool {
        matches!(self, SetKind::NoEndpointVips | SetKind::NoEndpointNodePorts)
    }

    /// Whether its elements hold networks (an interval set).
    pub fn is_interval(self) -> bool {
        matches!(
            self,
            SetKind::ServiceCidrs
                | SetKind::PodCidrs
                | SetKind::NodePortAddresses
                | SetKind::FirewallAllow
        )
    }
}

/// One set of the table: a role in one IP family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SetId {
    /// The role.
    pub kind: SetKind,
    /// The family of its addresses.
    pub family: IpFamily,
}

impl SetId {
    /// Every set of the table, IPv4 first.
    pub fn all() -> impl Iterator<Item = SetId> {
        IpFamily::ALL.into_iter().flat_map(|family| {
            SetKind::ALL
                .into_iter()
                .map(move |kind| SetId { kind, family })
        })
    }

    /// Its name (`redirect-vips-v4`).
    pub fn name(self) -> String {
        format!("{}-{}", self.kind.base_name(), family_suffix(self.family))
    }

    /// The set whose name is `name`, if it is one of ours.
    pub fn from_name(name: &str) -> Option<SetId> {
        SetId::all().find(|s| s.name() == name)
    }

    /// The body of its declaration: `type …; flags …;`.
    pub fn declaration(self) -> String {
        let addr = match self.family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        };
        let vip = format!("{addr} . inet_proto . inet_service");
        let np = "inet_proto . inet_service";
        let ty = match self.kind {
            SetKind::ClusterIps
            | SetKind::ServiceCidrs
            | SetKind::PodCidrs
            | SetKind::NodePortAddresses => addr.to_string(),
            SetKind::RedirectVips | SetKind::NoLocalVips | SetKind::FirewallVips => vip,
            SetKind::RedirectNodePorts | SetKind::NoLocalNodePorts => np.to_string(),
            SetKind::NoEndpointVips => format!("{vip} : verdict"),
            SetKind::NoEndpointNodePorts => format!("{np} : verdict"),
            SetKind::FirewallAllow => format!("{vip} . {addr}"),
        };
        if self.kind.is_interval() {
            format!("type {ty}; flags interval;")
        } else {
            format!("type {ty};")
        }
    }
}

/// Every chain of the table, in creation order. Priorities are numeric, as nft 1.0.6 does not
/// accept the symbolic `dstnat` on the output hook: mangle is -150, dstnat -100.
pub fn chains() -> Vec<ChainDef> {
    let base = |name, hook| ChainDef {
        name,
        hook: Some(hook),
    };
    let regular = |name| ChainDef { name, hook: None };
    vec![
        regular(SERVICES),
        regular(FIREWALL_CHECK),
        regular(NO_LOCAL_CHECK),
        regular(ENDPOINTS_CHECK),
        regular(CLUSTER_IPS_CHECK),
        regular(REJECT_PACKET),
        base(
            MANGLE_PREROUTING,
            "type filter hook prerouting priority -150; policy accept;",
        ),
        base(
            FILTER_PREROUTING,
            "type filter hook prerouting priority -110; policy accept;",
        ),
        base(
            FILTER_OUTPUT_PRE_DNAT,
            "type filter hook output priority -110; policy accept;",
        ),
        base(
            NAT_PREROUTING,
            "type nat hook prerouting priority -100; policy accept;",
        ),
        base(
            NAT_OUTPUT,
            "type nat hook output priority -100; policy accept;",
        ),
        base(
            FILTER_OUTPUT_POST_DNAT,
            "type filter hook output priority -90; policy accept;",
        ),
        base(
            FILTER_INPUT,
            "type filter hook input priority -110; policy accept;",
        ),
        base(
            FILTER_FORWARD,
            "type filter hook forward priority -110; policy accept;",
        ),
    ]
}

/// Expressions that differ between families.
struct Expr {
    ip: &'static str,
    nfproto: &'static str,
    loopback: &'static str,
    suffix: &'static str,
}

impl Expr {
    fn of(family: IpFamily) -> Expr {
        match family {
            IpFamily::V4 => Expr {
                ip: "ip",
                nfproto: "ipv4",
                loopback: "127.0.0.0/8",
                suffix: "v4",
            },
            IpFamily::V6 => Expr {
                ip: "ip6",
                nfproto: "ipv6",
                loopback: "::1",
                suffix: "v6",
            },
        }
    }

    /// `ip daddr . meta l4proto . th dport`.
    fn vip_key(&self) -> String {
        format!("{} daddr . meta l4proto . th dport", self.ip)
    }

    /// The match that makes a destination a NodePort address of this family.
    fn nodeport(&self, cfg: &RedirectConfig) -> String {
        if cfg.node_ports_restricted {
            format!("{} daddr @{NODEPORT_ADDRESSES}-{}", self.ip, self.suffix)
        } else {
            format!(
                "meta nfproto {} fib daddr type local {} daddr != {}",
                self.nfproto, self.ip, self.loopback
            )
        }
    }
}

/// `meta l4proto . th dport`.
const NODEPORT_KEY: &str = "meta l4proto . th dport";

/// The fixed rules of the table, in order (chain by chain, in the order each chain holds
/// them). Each rule's id is its comment. `local`: detect-local by interface, which decides
/// what the `Local` policy's check lets through as pod traffic (`iifname "veth*"`) instead of
/// the `pod-cidrs` sets, and sends what arrives on that interface to the pod port
/// ([`RedirectConfig::pod_port`]; `redirect-pod-*` rules, before the others): the proxy cannot
/// tell the interface of a connection it accepts, only the port it accepted it on. The node's
/// own connections (output hook: no input interface) go to the proxy port.
pub fn rules(cfg: &RedirectConfig, local: Option<&LocalInterface>) -> Vec<RuleDef> {
    let mut rules = Vec::new();
    let mut add =
        |chain: &'static str, id: String, text: String| rules.push(RuleDef { chain, id, text });
    let port = cfg.proxy_port;
    add(
        MANGLE_PREROUTING,
        "transparent".into(),
        format!(
            "meta l4proto {{ tcp, udp }} socket transparent 1 meta mark set {:#x} accept",
            cfg.transparent_mark
        ),
    );
    add(
        FILTER_PREROUTING,
        "firewall".into(),
        format!("ct state new jump {FIREWALL_CHECK}"),
    );
    add(
        FILTER_PREROUTING,
        "no-local".into(),
        format!("ct state new jump {NO_LOCAL_CHECK}"),
    );
    add(
        FILTER_OUTPUT_PRE_DNAT,
        "firewall".into(),
        format!("ct state new jump {FIREWALL_CHECK}"),
    );
    add(
        FILTER_OUTPUT_PRE_DNAT,
        "endpoints".into(),
        format!("ct state new jump {ENDPOINTS_CHECK}"),
    );
    add(
        NAT_PREROUTING,
        "services".into(),
        format!("jump {SERVICES}"),
    );
    add(NAT_OUTPUT, "services".into(), format!("jump {SERVICES}"));
    add(
        FILTER_OUTPUT_POST_DNAT,
        "cluster-ips".into(),
        format!("ct state new jump {CLUSTER_IPS_CHECK}"),
    );
    add(
        FILTER_INPUT,
        "endpoints".into(),
        format!("ct state new jump {ENDPOINTS_CHECK}"),
    );
    add(
        FILTER_FORWARD,
        "endpoints".into(),
        format!("ct state new jump {ENDPOINTS_CHECK}"),
    );
    add(
        FILTER_FORWARD,
        "cluster-ips".into(),
        format!("ct state new jump {CLUSTER_IPS_CHECK}"),
    );
    add(REJECT_PACKET, "reject".into(), "reject".into());
    // Not pod traffic, for the `Local` policy's check: outside `pod-cidrs`, or not arrived on
    // the pods' interface(s).
    let not_pod = |ip: &str, s: &str| match local {
        Some(i) => i.nft(true),
        None => format!("{ip} saddr != @{POD_CIDRS}-{s}"),
    };
    let pod_port = local.zip(cfg.pod_port());
    for family in IpFamily::ALL {
        let e = Expr::of(family);
        let (ip, s) = (e.ip, e.suffix);
        let vip = e.vip_key();
        let np = e.nodeport(cfg);
        // TCP and UDP only: the proxy has no SCTP socket (SCTP frontends are rejected).
        let redirect = format!("meta l4proto {{ tcp, udp }} redirect to :{port}");
        if let Some((i, pod)) = pod_port {
            let iif = i.nft(false);
            let to_pod = format!("meta l4proto {{ tcp, udp }} redirect to :{pod}");
            add(
                SERVICES,
                format!("redirect-pod-vips-{s}"),
                format!("{iif} {vip} @{REDIRECT_VIPS}-{s} {to_pod}"),
            );
            add(
                SERVICES,
                format!("redirect-pod-nodeports-{s}"),
                format!("{iif} {np} {NODEPORT_KEY} @{REDIRECT_NODEPORTS}-{s} {to_pod}"),
            );
        }
        add(
            SERVICES,
            format!("redirect-vips-{s}"),
            format!("{vip} @{REDIRECT_VIPS}-{s} {redirect}"),
        );
        add(
            SERVICES,
            format!("redirect-nodeports-{s}"),
            format!("{np} {NODEPORT_KEY} @{REDIRECT_NODEPORTS}-{s} {redirect}"),
        );
        add(
            FIREWALL_CHECK,
            format!("firewall-{s}"),
            format!("{vip} @{FIREWALL_VIPS}-{s} {vip} . {ip} saddr != @{FIREWALL_ALLOW}-{s} drop"),
        );
        add(
            NO_LOCAL_CHECK,
            format!("no-local-vips-{s}"),
            format!("{vip} @{NO_LOCAL_VIPS}-{s} {} drop", not_pod(ip, s)),
        );
        add(
            NO_LOCAL_CHECK,
            format!("no-local-nodeports-{s}"),
            format!(
                "{np} {NODEPORT_KEY} @{NO_LOCAL_NODEPORTS}-{s} {} drop",
                not_pod(ip, s)
            ),
        );
        add(
            ENDPOINTS_CHECK,
            format!("no-endpoint-vips-{s}"),
            format!("{vip} vmap @{NO_ENDPOINT_VIPS}-{s}"),
        );
        add(
            ENDPOINTS_CHECK,
            format!("no-endpoint-nodeports-{s}"),
            format!("{np} {NODEPORT_KEY} vmap @{NO_ENDPOINT_NODEPORTS}-{s}"),
        );
        add(
            CLUSTER_IPS_CHECK,
            format!("unknown-port-{s}"),
            format!("{ip} daddr @{CLUSTER_IPS}-{s} goto {REJECT_PACKET}"),
        );
        add(
            CLUSTER_IPS_CHECK,
            format!("unallocated-{s}"),
            format!("{ip} daddr @{SERVICE_CIDRS}-{s} drop"),
        );
    }
    // Chain by chain, each in the order added.
    let order: Vec<&str> = chains().iter().map(|c| c.name).collect();
    rules.sort_by_key(|r| order.iter().position(|c| *c == r.chain));
    rules
}

/// The start of the table's comment, before the proxy port.
const COMMENT_PREFIX: &str = "kube-proxy-rs userspace port ";

/// The table's comment: names the layout and its configuration, so a restarted proxy can tell
/// whether the table in the kernel was made by the same rules, and the proxy's ports, with
/// the pod port when `local` (detect-local by interface) sends connections there
/// ([`comment_ports`] reads them back).
pub fn table_comment(cfg: &RedirectConfig, local: Option<&LocalInterface>) -> String {
    let pod = match local.and(cfg.pod_port()) {
        Some(p) => format!(" pod-port {p}"),
        None => String::new(),
    };
    format!(
        "{COMMENT_PREFIX}{}{pod} mark {:#x}{}",
        cfg.proxy_port,
        cfg.transparent_mark,
        if cfg.node_ports_restricted {
            " nodeports restricted"
        } else {
            ""
        }
    )
}

/// The proxy port and the pod port (if the table has one) that a table comment
/// ([`table_comment`]) names; `None` for a comment of another shape.
pub fn comment_ports(comment: &str) -> Option<(u16, Option<u16>)> {
    let mut words = comment.strip_prefix(COMMENT_PREFIX)?.split_whitespace();
    let proxy = words.next()?.parse().ok()?;
    let pod = match words.next() {
        Some("pod-port") => Some(words.next()?.parse().ok()?),
        _ => None,
    };
    Some((proxy, pod))
}
