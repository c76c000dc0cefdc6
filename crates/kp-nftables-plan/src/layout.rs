//! The shape of the table: a fixed set of chains and rules, plus one small group of objects per
//! endpoint-count class and per affinity timeout. Services and endpoints are never chains or
//! rules; they are elements of the sets and maps declared here.
//!
//! Why this shape (see `README.md` in this crate): nf_tables re-validates every chain reachable
//! by a jump on each commit, so per-service and per-endpoint chains make every change pay for
//! the whole table. Elements cost the same whatever the table's size.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use kp_core::model::IpFamily;
use kp_core::node::LocalInterface;

use crate::names::{self, *};

/// How the planner renders the table. Everything here is fixed for the life of the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// The table's IP family.
    pub family: IpFamily,
    /// The masquerade mark (`1 << masqueradeBit`).
    pub masquerade_mark: u32,
    /// Masquerade all Service traffic (`masqueradeAll`).
    pub masquerade_all: bool,
    /// Whether a detect-local mode is configured (the `pod-cidrs` set decides what is local,
    /// unless `local_interface` is set).
    pub detect_local: bool,
    /// Detect-local by the interface a packet arrives on (`BridgeInterface`,
    /// `InterfaceNamePrefix`): `iifname` decides what is local instead of `pod-cidrs`.
    pub local_interface: Option<LocalInterface>,
    /// Whether NodePorts answer only on the addresses in the `nodeport-addresses` set
    /// (`nodePortAddresses` CIDRs or `primary`); otherwise on every local address but loopback.
    pub node_ports_restricted: bool,
}

impl PlanConfig {
    /// Upstream's defaults for `family`: mark bit 14, no detect-local, NodePorts on all addresses.
    pub fn new(family: IpFamily) -> Self {
        PlanConfig {
            family,
            masquerade_mark: 1 << 14,
            masquerade_all: false,
            detect_local: false,
            local_interface: None,
            node_ports_restricted: false,
        }
    }
}

/// Which key a dispatch class matches, and on which condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Route {
    /// `daddr . l4proto . dport`: ClusterIPs, ExternalIPs, LoadBalancer IPs.
    Vips,
    /// `l4proto . dport` on a NodePort address.
    NodePorts,
    /// Like `Vips`, for pod- and node-sourced traffic to `externalTrafficPolicy: Local` entries,
    /// which upstream short-circuits to the cluster-wide endpoints.
    LocalSourceVips,
    /// Like `NodePorts`, short-circuited.
    LocalSourceNodePorts,
}

impl Route {
    fn prefix(self) -> &'static str {
        match self {
            Route::Vips => "vips",
            Route::NodePorts => "nodeports",
            Route::LocalSourceVips => "local-source-vips",
            Route::LocalSourceNodePorts => "local-source-nodeports",
        }
    }

    /// The short-circuit route for the same key (`Vips` → `LocalSourceVips`).
    pub fn local_source(self) -> Route {
        if self.keyed_by_address() {
            Route::LocalSourceVips
        } else {
            Route::LocalSourceNodePorts
        }
    }

    /// The set of this route's keys that are always masqueraded (`externalTrafficPolicy: Cluster`).
    pub fn masquerade_set(self) -> SetId {
        if self.keyed_by_address() {
            SetId::MasqVips
        } else {
            SetId::MasqNodePorts
        }
    }

    /// The set of this route's keys with `externalTrafficPolicy: Local`.
    pub fn local_policy_set(self) -> SetId {
        if self.keyed_by_address() {
            SetId::LocalPolicyVips
        } else {
            SetId::LocalPolicyNodePorts
        }
    }

    /// The verdict map for this route's keys without usable endpoints.
    pub fn no_endpoint_set(self) -> SetId {
        if self.keyed_by_address() {
            SetId::NoEndpointVips
        } else {
            SetId::NoEndpointNodePorts
        }
    }

    /// The set of this route's keys with ClientIP affinity of `timeout` seconds.
    pub fn affinity_set(self, timeout: u32) -> SetId {
        if self.keyed_by_address() {
            SetId::AffinityVips(timeout)
        } else {
            SetId::AffinityNodePorts(timeout)
        }
    }

    /// Whether the key is `daddr . l4proto . dport` (else `l4proto . dport`).
    pub fn keyed_by_address(self) -> bool {
        matches!(self, Route::Vips | Route::LocalSourceVips)
    }
}

/// Identifies a set or map in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SetId {
    /// [`names::CLUSTER_IPS`].
    ClusterIps,
    /// [`names::POD_CIDRS`].
    PodCidrs,
    /// [`names::SERVICE_CIDRS`].
    ServiceCidrs,
    /// [`names::NODEPORT_ADDRESSES`].
    NodePortAddresses,
    /// [`names::MASQ_VIPS`].
    MasqVips,
    /// [`names::MASQ_NODEPORTS`].
    MasqNodePorts,
    /// [`names::LOCAL_POLICY_VIPS`].
    LocalPolicyVips,
    /// [`names::LOCAL_POLICY_NODEPORTS`].
    LocalPolicyNodePorts,
    /// [`names::NO_ENDPOINT_VIPS`].
    NoEndpointVips,
    /// [`names::NO_ENDPOINT_NODEPORTS`].
    NoEndpointNodePorts,
    /// [`names::FIREWALL_VIPS`].
    FirewallVips,
    /// [`names::FIREWALL_ALLOW`].
    FirewallAllow,
    /// [`names::HAIRPIN`].
    Hairpin,
    /// The keys of one dispatch class: entries with exactly N endpoints.
    Class(Route, u32),
    /// The endpoints of one dispatch class: `key . slot → endpoint address . port`.
    ClassEndpoints(Route, u32),
    /// VIP entries with ClientIP affinity of this timeout.
    AffinityVips(u32),
    /// NodePorts with ClientIP affinity of this timeout.
    AffinityNodePorts(u32),
    /// The affinity memory itself (dynamic, written by the packet path).
    Affinity(u32),
}

impl SetId {
    /// The fixed sets and maps, present in every table.
    pub const FIXED: [SetId; 13] = [
        SetId::ClusterIps,
        SetId::PodCidrs,
        SetId::ServiceCidrs,
        SetId::NodePortAddresses,
        SetId::MasqVips,
        SetId::MasqNodePorts,
        SetId::LocalPolicyVips,
        SetId::LocalPolicyNodePorts,
        SetId::NoEndpointVips,
        SetId::NoEndpointNodePorts,
        SetId::FirewallVips,
        SetId::FirewallAllow,
        SetId::Hairpin,
    ];

    /// The object's name.
    pub fn name(self) -> String {
        match self {
            SetId::ClusterIps => CLUSTER_IPS.into(),
            SetId::PodCidrs => POD_CIDRS.into(),
            SetId::ServiceCidrs => SERVICE_CIDRS.into(),
            SetId::NodePortAddresses => NODEPORT_ADDRESSES.into(),
            SetId::MasqVips => MASQ_VIPS.into(),
            SetId::MasqNodePorts => MASQ_NODEPORTS.into(),
            SetId::LocalPolicyVips => LOCAL_POLICY_VIPS.into(),
            SetId::LocalPolicyNodePorts => LOCAL_POLICY_NODEPORTS.into(),
            SetId::NoEndpointVips => NO_ENDPOINT_VIPS.into(),
            SetId::NoEndpointNodePorts => NO_ENDPOINT_NODEPORTS.into(),
            SetId::FirewallVips => FIREWALL_VIPS.into(),
            SetId::FirewallAllow => FIREWALL_ALLOW.into(),
            SetId::Hairpin => HAIRPIN.into(),
            SetId::Class(r, n) => format!("{}-{n}", r.prefix()),
            SetId::ClassEndpoints(r, n) => format!("{}-{n}-endpoints", r.prefix()),
            SetId::AffinityVips(t) => format!("affinity-{t}-vips"),
            SetId::AffinityNodePorts(t) => format!("affinity-{t}-nodeports"),
            SetId::Affinity(t) => format!("affinity-{t}"),
        }
    }

    /// The set or map called `name` in our table, if it is one of ours: the inverse of
    /// [`SetId::name`], so a table read back from the kernel can be recognised set by set
    /// (`vips-3-endpoints` is `ClassEndpoints(Vips, 3)`). Endpoint counts and timeouts are
    /// positive and spelled without leading zeros, as `name` spells them.
    pub fn from_name(name: &str) -> Option<SetId> {
        if let Some(id) = SetId::FIXED.into_iter().find(|s| s.name() == name) {
            return Some(id);
        }
        let number = |s: &str| {
            s.parse::<u32>()
                .ok()
                .filter(|n| *n > 0 && n.to_string() == s)
        };
        if let Some(rest) = name.strip_prefix("affinity-") {
            let id = match rest.split_once('-') {
                None => SetId::Affinity(number(rest)?),
                Some((t, "vips")) => SetId::AffinityVips(number(t)?),
                Some((t, "nodeports")) => SetId::AffinityNodePorts(number(t)?),
                Some(_) => return None,
            };
            return Some(id);
        }
        // Longest prefixes first: `local-source-vips-` before `vips-`.
        for route in [
            Route::LocalSourceVips,
            Route::LocalSourceNodePorts,
            Route::Vips,
            Route::NodePorts,
        ] {
            let Some(rest) = name
                .strip_prefix(route.prefix())
                .and_then(|r| r.strip_prefix('-'))
            else {
                continue;
            };
            return match rest.strip_suffix("-endpoints") {
                Some(n) => Some(SetId::ClassEndpoints(route, number(n)?)),
                None => Some(SetId::Class(route, number(rest)?)),
            };
        }
        None
    }

    /// Whether the kernel writes this object's elements (so the read-back check skips them).
    pub fn is_dynamic(self) -> bool {
        matches!(self, SetId::Affinity(_))
    }

    /// Whether this is a map (else a set).
    pub fn is_map(self) -> bool {
        matches!(
            self,
            SetId::NoEndpointVips
                | SetId::NoEndpointNodePorts
                | SetId::ClassEndpoints(..)
                | SetId::Affinity(_)
        )
    }

    /// The `add set`/`add map` statement body (what goes between the braces).
    pub fn declaration(self, family: IpFamily) -> String {
        let addr = match family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        };
        let ip = names::family(family);
        let vip = format!("{addr} . inet_proto . inet_service");
        let np = "inet_proto . inet_service";
        match self {
            SetId::ClusterIps => format!("type {addr};"),
            SetId::PodCidrs | SetId::ServiceCidrs | SetId::NodePortAddresses => {
                format!("type {addr}; flags interval;")
            }
            SetId::MasqVips | SetId::LocalPolicyVips | SetId::FirewallVips => format!("type {vip};"),
            SetId::AffinityVips(_) => format!("type {vip};"),
            SetId::MasqNodePorts | SetId::LocalPolicyNodePorts | SetId::AffinityNodePorts(_) => {
                format!("type {np};")
            }
            SetId::NoEndpointVips => format!("type {vip} : verdict;"),
            SetId::NoEndpointNodePorts => format!("type {np} : verdict;"),
            SetId::FirewallAllow => format!("type {vip} . {addr}; flags interval;"),
            SetId::Hairpin => format!("type {addr} . {addr};"),
            SetId::Class(r, _) if r.keyed_by_address() => format!("type {vip};"),
            SetId::Class(..) => format!("type {np};"),
            SetId::ClassEndpoints(r, n) => {
                let key = if r.keyed_by_address() {
                    format!("{ip} daddr . meta l4proto . th dport")
                } else {
                    "meta l4proto . th dport".into()
                };
                format!("typeof {key} . numgen random mod {n} : {ip} daddr . th dport;")
            }
            SetId::Affinity(t) => format!(
                "type {addr} . {addr} . inet_proto . inet_service : {addr} . inet_service; flags dynamic,timeout; timeout {t}s;"
            ),
        }
    }
}

/// What the table's comment says about the table: the version of its layout for `cfg`.
///
/// The read-back check recognises rules by their ids (comments), not by their text, so a table
/// left by another version of the layout, or by another configuration (another masquerade bit,
/// detect-local mode, NodePort addresses), can hold the same ids with other rules in them. The
/// comment is a hash of everything the layout renders for `cfg` besides elements (chains and
/// hooks, fixed rules, the rules and declarations of every kind of class), so a table that
/// carries it has exactly the rules and set types this version would make for the same classes,
/// and one that does not must be replaced rather than adopted.
pub fn table_comment(cfg: &PlanConfig) -> String {
    // FNV-1a (64 bits): stable across builds and Rust versions, unlike `DefaultHasher`.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |s: &str| {
        for b in s.bytes().chain([0]) {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for c in chains() {
        feed(c.name);
        feed(c.hook.unwrap_or(""));
    }
    let mut rules = fixed_rules(cfg);
    let mut sets = SetId::FIXED.to_vec();
    for route in [
        Route::Vips,
        Route::NodePorts,
        Route::LocalSourceVips,
        Route::LocalSourceNodePorts,
    ] {
        rules.extend(class_rules(cfg, route, 1));
        sets.extend([SetId::Class(route, 1), SetId::ClassEndpoints(route, 1)]);
    }
    rules.extend(affinity_rules(cfg, 1));
    sets.extend([
        SetId::Affinity(1),
        SetId::AffinityVips(1),
        SetId::AffinityNodePorts(1),
    ]);
    for r in &rules {
        feed(r.chain);
        feed(&r.id);
        feed(&r.text);
    }
    for s in sets {
        feed(&s.name());
        feed(&s.declaration(cfg.family));
    }
    format!("kube-proxy-rs layout {hash:016x}")
}

/// A chain of the table: base chains carry their hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainDef {
    /// The chain's name.
    pub name: &'static str,
    /// `type … hook … priority …;` for base chains.
    pub hook: Option<&'static str>,
}

/// Whether `name` is one of the table's base chains (it has a hook).
pub fn is_base_chain(name: &str) -> bool {
    chains().iter().any(|c| c.name == name && c.hook.is_some())
}

/// Every chain of the table, in creation order. Priorities are numeric because nft 1.0.6 does
/// not accept the symbolic `dstnat` on the output hook: dstnat is -100, srcnat 100, filter 0.
pub fn chains() -> Vec<ChainDef> {
    let base = |name, hook| ChainDef {
        name,
        hook: Some(hook),
    };
    let regular = |name| ChainDef { name, hook: None };
    vec![
        regular(SERVICE_MASQUERADE),
        regular(SERVICE_AFFINITY),
        regular(SERVICE_LOCAL_SOURCE),
        regular(SERVICE_DISPATCH),
        regular(SERVICES),
        regular(FIREWALL_CHECK),
        regular(REJECT_PACKET),
        regular(ENDPOINTS_CHECK),
        regular(MASQUERADING),
        regular(AFFINITY_UPDATE),
        base(
            NAT_PREROUTING,
            "type nat hook prerouting priority -100; policy accept;",
        ),
        base(
            NAT_OUTPUT,
            "type nat hook output priority -100; policy accept;",
        ),
        base(
            NAT_POSTROUTING,
            "type nat hook postrouting priority 100; policy accept;",
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
            FILTER_INPUT,
            "type filter hook input priority 0; policy accept;",
        ),
        base(
            FILTER_FORWARD,
            "type filter hook forward priority 0; policy accept;",
        ),
        base(
            FILTER_OUTPUT,
            "type filter hook output priority 0; policy accept;",
        ),
        base(
            AFFINITY_POSTROUTING,
            "type filter hook postrouting priority 90; policy accept;",
        ),
        base(
            AFFINITY_INPUT,
            "type filter hook input priority 10; policy accept;",
        ),
    ]
}

/// Chains that only hold per-class rules, whose order does not matter (each class matches a
/// disjoint set of keys). New classes are appended to them by partial syncs.
pub const UNORDERED_CHAINS: &[&str] = &[
    SERVICE_AFFINITY,
    SERVICE_LOCAL_SOURCE,
    SERVICE_DISPATCH,
    AFFINITY_UPDATE,
];

/// A rule: its chain, its text (without the comment), and a stable id (its comment), by which
/// the read-back check recognises it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleDef {
    /// The chain it goes in.
    pub chain: &'static str,
    /// The stable id, rendered as the rule's comment.
    pub id: String,
    /// The rule body.
    pub text: String,
}

/// Expressions that differ between families.
struct Expr {
    ip: &'static str,
    loopback: &'static str,
}

impl Expr {
    fn of(family: IpFamily) -> Expr {
        match family {
            IpFamily::V4 => Expr {
                ip: "ip",
                loopback: "127.0.0.0/8",
            },
            IpFamily::V6 => Expr {
                ip: "ip6",
                loopback: "::1",
            },
        }
    }

    fn vip_key(&self) -> String {
        format!("{} daddr . meta l4proto . th dport", self.ip)
    }
}

const NODEPORT_KEY: &str = "meta l4proto . th dport";

/// The match that makes a destination a NodePort address.
fn nodeport_match(cfg: &PlanConfig) -> String {
    let e = Expr::of(cfg.family);
    if !cfg.node_ports_restricted {
        format!("fib daddr type local {} daddr != {}", e.ip, e.loopback)
    } else {
        format!("fib daddr type local {} daddr @{NODEPORT_ADDRESSES}", e.ip)
    }
}

/// The fixed rules of the table, in order.
pub fn fixed_rules(cfg: &PlanConfig) -> Vec<RuleDef> {
    let e = Expr::of(cfg.family);
    let ip = e.ip;
    let vip = e.vip_key();
    let np = nodeport_match(cfg);
    let mark = cfg.masquerade_mark;
    let set_mark = format!("meta mark set meta mark or {mark:#x}");
    let mut rules = Vec::new();
    let mut add = |chain: &'static str, id: &str, text: String| {
        rules.push(RuleDef {
            chain,
            id: id.to_string(),
            text,
        })
    };
    add(NAT_PREROUTING, "dispatch", format!("jump {SERVICES}"));
    add(NAT_OUTPUT, "dispatch", format!("jump {SERVICES}"));
    add(
        NAT_POSTROUTING,
        "masquerade",
        format!("jump {MASQUERADING}"),
    );
    add(
        FILTER_PREROUTING,
        "firewall",
        format!("ct state new jump {FIREWALL_CHECK}"),
    );
    add(
        FILTER_OUTPUT_PRE_DNAT,
        "firewall",
        format!("ct state new jump {FIREWALL_CHECK}"),
    );
    for chain in [FILTER_INPUT, FILTER_FORWARD, FILTER_OUTPUT] {
        add(
            chain,
            "endpoints",
            format!("ct state new jump {ENDPOINTS_CHECK}"),
        );
    }
    add(
        AFFINITY_POSTROUTING,
        "affinity",
        format!("jump {AFFINITY_UPDATE}"),
    );
    add(
        AFFINITY_INPUT,
        "affinity",
        format!("jump {AFFINITY_UPDATE}"),
    );
    for (i, chain) in [
        SERVICE_MASQUERADE,
        SERVICE_AFFINITY,
        SERVICE_LOCAL_SOURCE,
        SERVICE_DISPATCH,
    ]
    .into_iter()
    .enumerate()
    {
        add(SERVICES, &format!("step-{i}"), format!("jump {chain}"));
    }
    // Masquerade marking: before any DNAT, because DNAT ends the walk.
    if cfg.masquerade_all {
        add(
            SERVICE_MASQUERADE,
            "cluster-ips",
            format!("{ip} daddr @{CLUSTER_IPS} {set_mark}"),
        );
    } else if let Some(not_local) = not_local_match(cfg) {
        add(
            SERVICE_MASQUERADE,
            "cluster-ips",
            format!("{ip} daddr @{CLUSTER_IPS} {not_local} {set_mark}"),
        );
    }
    add(
        SERVICE_MASQUERADE,
        "external-vips",
        format!("{vip} @{MASQ_VIPS} {set_mark}"),
    );
    add(
        SERVICE_MASQUERADE,
        "external-nodeports",
        format!("{np} {NODEPORT_KEY} @{MASQ_NODEPORTS} {set_mark}"),
    );
    add(
        SERVICE_MASQUERADE,
        "local-policy-vips-from-node",
        format!("fib saddr type local {vip} @{LOCAL_POLICY_VIPS} {set_mark}"),
    );
    add(
        SERVICE_MASQUERADE,
        "local-policy-nodeports-from-node",
        format!("fib saddr type local {np} {NODEPORT_KEY} @{LOCAL_POLICY_NODEPORTS} {set_mark}"),
    );
    add(
        FIREWALL_CHECK,
        "source-ranges",
        format!("{vip} @{FIREWALL_VIPS} {vip} . {ip} saddr != @{FIREWALL_ALLOW} drop"),
    );
    add(
        ENDPOINTS_CHECK,
        "vips",
        format!("{vip} vmap @{NO_ENDPOINT_VIPS}"),
    );
    add(
        ENDPOINTS_CHECK,
        "nodeports",
        format!("{np} {NODEPORT_KEY} vmap @{NO_ENDPOINT_NODEPORTS}"),
    );
    // After DNAT (these hooks run at filter priority), a destination that is still a ClusterIP
    // matched no Service port: upstream's nftables mode rejects it rather than letting it leak
    // to the default route.
    add(
        ENDPOINTS_CHECK,
        "cluster-ip-unknown-port",
        format!("{ip} daddr @{CLUSTER_IPS} reject"),
    );
    // ... and one still addressed to a Service CIDR is for an address no Service holds:
    // dropped, as upstream's nftables mode does ("Drop traffic to unallocated ClusterIPs"),
    // rather than routed out of the node.
    add(
        ENDPOINTS_CHECK,
        "unallocated-cluster-ip",
        format!("{ip} daddr @{SERVICE_CIDRS} drop"),
    );
    add(REJECT_PACKET, "reject", "reject".into());
    add(
        MASQUERADING,
        "hairpin",
        format!("ct status dnat {ip} saddr . {ip} daddr @{HAIRPIN} masquerade fully-random"),
    );
    add(
        MASQUERADING,
        "unmarked",
        format!("meta mark & {mark:#x} == 0 return"),
    );
    add(
        MASQUERADING,
        "clear-mark",
        format!("meta mark set meta mark xor {mark:#x}"),
    );
    add(MASQUERADING, "marked", "masquerade fully-random".into());
    rules
}

/// What detect-local calls pod traffic: `ip saddr @pod-cidrs`, or the ingress interface
/// (`iifname "cbr0"`, `iifname "veth*"`). `None` without detect-local.
fn local_match(cfg: &PlanConfig) -> Option<String> {
    match (&cfg.local_interface, cfg.detect_local) {
        (Some(i), _) => Some(i.nft(false)),
        (None, true) => Some(format!("{} saddr @{POD_CIDRS}", Expr::of(cfg.family).ip)),
        (None, false) => None,
    }
}

/// The negation of [`local_match`]: `ip saddr != @pod-cidrs`, `iifname != "cbr0"`. The node's
/// own packets (output hook) have no input interface, so `iifname !=` matches them, as it does
/// upstream.
fn not_local_match(cfg: &PlanConfig) -> Option<String> {
    match (&cfg.local_interface, cfg.detect_local) {
        (Some(i), _) => Some(i.nft(true)),
        (None, true) => Some(format!("{} saddr != @{POD_CIDRS}", Expr::of(cfg.family).ip)),
        (None, false) => None,
    }
}

/// The objects and rules of one dispatch class (`route`, `n` endpoints).
pub fn class_rules(cfg: &PlanConfig, route: Route, n: u32) -> Vec<RuleDef> {
    let e = Expr::of(cfg.family);
    let ip = e.ip;
    let set = SetId::Class(route, n).name();
    let map = SetId::ClassEndpoints(route, n).name();
    let (matcher, key) = if route.keyed_by_address() {
        (String::new(), e.vip_key())
    } else {
        (
            format!("{} ", nodeport_match(cfg)),
            NODEPORT_KEY.to_string(),
        )
    };
    let dnat =
        format!("{matcher}{key} @{set} dnat {ip} to {key} . numgen random mod {n} map @{map}");
    let id = format!("class-{set}");
    match route {
        Route::Vips | Route::NodePorts => vec![RuleDef {
            chain: SERVICE_DISPATCH,
            id,
            text: dnat,
        }],
        Route::LocalSourceVips | Route::LocalSourceNodePorts => {
            let mut v = Vec::new();
            if let Some(local) = local_match(cfg) {
                v.push(RuleDef {
                    chain: SERVICE_LOCAL_SOURCE,
                    id: format!("{id}-from-pods"),
                    text: format!("{local} {dnat}"),
                });
            }
            v.push(RuleDef {
                chain: SERVICE_LOCAL_SOURCE,
                id: format!("{id}-from-node"),
                text: format!("fib saddr type local {dnat}"),
            });
            v
        }
    }
}

/// The rules of one affinity timeout class.
pub fn affinity_rules(cfg: &PlanConfig, timeout: u32) -> Vec<RuleDef> {
    let e = Expr::of(cfg.family);
    let ip = e.ip;
    let vip = e.vip_key();
    let np = nodeport_match(cfg);
    let map = SetId::Affinity(timeout).name();
    let vips = SetId::AffinityVips(timeout).name();
    let nps = SetId::AffinityNodePorts(timeout).name();
    let client = format!("{ip} saddr . {ip} daddr . meta l4proto . th dport");
    let mut v = vec![
        RuleDef {
            chain: SERVICE_AFFINITY,
            id: format!("{map}-vips"),
            text: format!("{vip} @{vips} dnat {ip} to {client} map @{map}"),
        },
        RuleDef {
            chain: SERVICE_AFFINITY,
            id: format!("{map}-nodeports"),
            text: format!("{np} {NODEPORT_KEY} @{nps} dnat {ip} to {client} map @{map}"),
        },
    ];
    // Record the choice after DNAT. `ct original proto-dst` needs a protocol dependency to be
    // usable in a concatenation, hence one rule per protocol.
    let remembered = format!(
        "{ip} saddr . ct original {ip} daddr . meta l4proto . ct original proto-dst : {ip} daddr . th dport"
    );
    for proto in kp_core::model::Protocol::ALL {
        let p = proto.as_lower();
        let mut s = String::new();
        let _ = write!(
            s,
            "meta l4proto {p} ct state new ct status dnat ct original {ip} daddr . meta l4proto . ct original proto-dst @{vips} update @{map} {{ {remembered} }}"
        );
        v.push(RuleDef {
            chain: AFFINITY_UPDATE,
            id: format!("{map}-vips-{p}"),
            text: s,
        });
        v.push(RuleDef {
            chain: AFFINITY_UPDATE,
            id: format!("{map}-nodeports-{p}"),
            text: format!(
                "meta l4proto {p} ct state new ct status dnat meta l4proto . ct original proto-dst @{nps} update @{map} {{ {remembered} }}"
            ),
        });
    }
    v
}

/// The rules of a table holding `classes` and `affinities`, in order per chain.
pub fn rules_for(
    cfg: &PlanConfig,
    classes: &BTreeSet<(Route, u32)>,
    affinities: &BTreeSet<u32>,
) -> Vec<RuleDef> {
    let mut rules = fixed_rules(cfg);
    for &(route, n) in classes {
        rules.extend(class_rules(cfg, route, n));
    }
    for &t in affinities {
        rules.extend(affinity_rules(cfg, t));
    }
    rules
}

/// Rule ids per chain of a table holding `classes` and `affinities`, every chain listed;
/// chains whose rule order does not matter ([`UNORDERED_CHAINS`]) sorted.
pub fn chains_for(
    cfg: &PlanConfig,
    classes: &BTreeSet<(Route, u32)>,
    affinities: &BTreeSet<u32>,
) -> BTreeMap<String, Vec<String>> {
    let mut chains: BTreeMap<String, Vec<String>> = chains()
        .into_iter()
        .map(|c| (c.name.to_string(), Vec::new()))
        .collect();
    for r in rules_for(cfg, classes, affinities) {
        chains.entry(r.chain.to_string()).or_default().push(r.id);
    }
    for c in UNORDERED_CHAINS {
        if let Some(v) = chains.get_mut(*c) {
            v.sort();
        }
    }
    chains
}
