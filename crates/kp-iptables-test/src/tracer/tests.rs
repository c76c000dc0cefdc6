//! Hand-written restore inputs in upstream's canonical form, traced.
//!
//! Addresses: node 192.0.2.1 (and pod gateway 10.244.1.1); cluster CIDR 10.244.0.0/16; pods
//! pod-1 10.244.1.2, pod-2 10.244.1.3, pod-3 10.244.2.4 (another node), pod-4 10.244.1.5 (a
//! client); ClusterIPs 10.96.0.0/16; LoadBalancer IP 198.51.100.20 with source range
//! 192.0.2.0/30; clients 192.0.2.2 (inside the range) and 192.0.2.5 (outside).

use std::collections::BTreeSet;

use super::*;
use kp_iptables_plan::restore::{ChainWrite, Restore, ServiceChains};

const FILTER: &str = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A KUBE-SERVICES -m comment --comment "default/empty:http has no endpoints" -m tcp -p tcp -d 10.96.0.20 --dport 80 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment "default/empty:http has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30020 -j REJECT
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-PROXY-FIREWALL -m comment --comment "default/lb:http traffic not accepted by KUBE-FW-LBLBLBLBLBLBLBLB" -m tcp -p tcp -d 198.51.100.20 --dport 80 -j DROP
COMMIT
"#;

const NAT: &str = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-WEBWEBWEBWEBWEBW - [0:0]
:KUBE-EXT-WEBWEBWEBWEBWEBW - [0:0]
:KUBE-SEP-WEB1WEB1WEB1WEB1 - [0:0]
:KUBE-SEP-WEB2WEB2WEB2WEB2 - [0:0]
:KUBE-SEP-WEB3WEB3WEB3WEB3 - [0:0]
:KUBE-SVC-STICKYSTICKYSTIC - [0:0]
:KUBE-SEP-STICKY1STICKY1ST - [0:0]
:KUBE-SEP-STICKY2STICKY2ST - [0:0]
:KUBE-SVC-LBLBLBLBLBLBLBLB - [0:0]
:KUBE-EXT-LBLBLBLBLBLBLBLB - [0:0]
:KUBE-FW-LBLBLBLBLBLBLBLB - [0:0]
:KUBE-SEP-LB1LB1LB1LB1LB1L - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-SVC-WEBWEBWEBWEBWEBW
-A KUBE-SERVICES -m comment --comment "default/sticky:http cluster IP" -m tcp -p tcp -d 10.96.0.30 --dport 80 -j KUBE-SVC-STICKYSTICKYSTIC
-A KUBE-SERVICES -m comment --comment "default/lb:http cluster IP" -m tcp -p tcp -d 10.96.0.60 --dport 80 -j KUBE-SVC-LBLBLBLBLBLBLBLB
-A KUBE-SERVICES -m comment --comment "default/lb:http loadbalancer IP" -m tcp -p tcp -d 198.51.100.20 --dport 80 -j KUBE-FW-LBLBLBLBLBLBLBLB
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -m comment --comment default/web:http -m tcp -p tcp --dport 30080 -j KUBE-EXT-WEBWEBWEBWEBWEBW
-A KUBE-EXT-WEBWEBWEBWEBWEBW -m comment --comment "masquerade traffic for default/web:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-WEBWEBWEBWEBWEBW -j KUBE-SVC-WEBWEBWEBWEBWEBW
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-WEB1WEB1WEB1WEB1
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http -> 10.244.1.3:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-WEB2WEB2WEB2WEB2
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http -> 10.244.2.4:8080" -j KUBE-SEP-WEB3WEB3WEB3WEB3
-A KUBE-SEP-WEB1WEB1WEB1WEB1 -m comment --comment default/web:http -s 10.244.1.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-WEB1WEB1WEB1WEB1 -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-WEB2WEB2WEB2WEB2 -m comment --comment default/web:http -s 10.244.1.3/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-WEB2WEB2WEB2WEB2 -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.3:8080
-A KUBE-SEP-WEB3WEB3WEB3WEB3 -m comment --comment default/web:http -s 10.244.2.4/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-WEB3WEB3WEB3WEB3 -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.2.4:8080
-A KUBE-SVC-STICKYSTICKYSTIC -m comment --comment "default/sticky:http cluster IP" -m tcp -p tcp -d 10.96.0.30 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-STICKYSTICKYSTIC -m comment --comment "default/sticky:http -> 10.244.1.2:8080" -m recent --name KUBE-SEP-STICKY1STICKY1ST --rcheck --seconds 60 --reap -j KUBE-SEP-STICKY1STICKY1ST
-A KUBE-SVC-STICKYSTICKYSTIC -m comment --comment "default/sticky:http -> 10.244.1.3:8080" -m recent --name KUBE-SEP-STICKY2STICKY2ST --rcheck --seconds 60 --reap -j KUBE-SEP-STICKY2STICKY2ST
-A KUBE-SVC-STICKYSTICKYSTIC -m comment --comment "default/sticky:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-STICKY1STICKY1ST
-A KUBE-SVC-STICKYSTICKYSTIC -m comment --comment "default/sticky:http -> 10.244.1.3:8080" -j KUBE-SEP-STICKY2STICKY2ST
-A KUBE-SEP-STICKY1STICKY1ST -m comment --comment default/sticky:http -s 10.244.1.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-STICKY1STICKY1ST -m comment --comment default/sticky:http -m recent --set --name KUBE-SEP-STICKY1STICKY1ST --mask 255.255.255.255 --rsource -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-STICKY2STICKY2ST -m comment --comment default/sticky:http -s 10.244.1.3/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-STICKY2STICKY2ST -m comment --comment default/sticky:http -m recent --set --name KUBE-SEP-STICKY2STICKY2ST --mask 255.255.255.255 --rsource -m tcp -p tcp -j DNAT --to-destination 10.244.1.3:8080
-A KUBE-FW-LBLBLBLBLBLBLBLB -m comment --comment "default/lb:http loadbalancer IP" -s 192.0.2.0/30 -j KUBE-EXT-LBLBLBLBLBLBLBLB
-A KUBE-FW-LBLBLBLBLBLBLBLB -m comment --comment "other traffic to default/lb:http will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-EXT-LBLBLBLBLBLBLBLB -m comment --comment "masquerade traffic for default/lb:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-LBLBLBLBLBLBLBLB -j KUBE-SVC-LBLBLBLBLBLBLBLB
-A KUBE-SVC-LBLBLBLBLBLBLBLB -m comment --comment "default/lb:http cluster IP" -m tcp -p tcp -d 10.96.0.60 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-LBLBLBLBLBLBLBLB -m comment --comment "default/lb:http -> 10.244.1.3:8080" -j KUBE-SEP-LB1LB1LB1LB1LB1L
-A KUBE-SEP-LB1LB1LB1LB1LB1L -m comment --comment default/lb:http -s 10.244.1.3/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-LB1LB1LB1LB1LB1L -m comment --comment default/lb:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.3:8080
COMMIT
"#;

/// The jumps from the built-in chains, as the applier prepends them (upstream's
/// `iptablesJumpChains`); `-I` puts each one first, so they are listed last-first.
const JUMPS: &str = r#"*filter
-I INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-I INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-I FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-I FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-I OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
COMMIT
*nat
-I PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
COMMIT
"#;

const V4: IpFamily = IpFamily::V4;
const V6: IpFamily = IpFamily::V6;

fn node_addresses() -> Vec<IpAddr> {
    ["192.0.2.1", "10.244.1.1", "fd00:10:244:1::1", "2001:db8::1"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect()
}

fn tracer_with(nat: &str) -> IptablesTracer {
    let mut t = IptablesTracer::new(node_addresses());
    t.apply(V4, &format!("{FILTER}{nat}"))
        .unwrap_or_else(|e| panic!("{e}"));
    t.apply(V4, JUMPS).unwrap_or_else(|e| panic!("{e}"));
    t
}

fn tracer() -> IptablesTracer {
    tracer_with(NAT)
}

fn packet(origin: Origin, src: &str, dst: &str, dport: u16) -> Packet {
    Packet {
        origin,
        src: src.parse().unwrap(),
        protocol: Protocol::Tcp,
        dst: dst.parse().unwrap(),
        dport,
    }
}

fn pod(src: &str, dst: &str, dport: u16) -> Packet {
    packet(Origin::Pod, src, dst, dport)
}

fn client(src: &str, dst: &str, dport: u16) -> Packet {
    packet(Origin::External, src, dst, dport)
}

fn node(dst: &str, dport: u16) -> Packet {
    packet(Origin::Node, "192.0.2.1", dst, dport)
}

fn eps(list: &[&str]) -> BTreeSet<(IpAddr, u16)> {
    list.iter()
        .map(|s| {
            let (ip, port) = s.rsplit_once(':').unwrap();
            let ip = ip.trim_start_matches('[').trim_end_matches(']');
            (ip.parse().unwrap(), port.parse().unwrap())
        })
        .collect()
}

fn dnat(list: &[&str], masquerade: bool, affinity: Option<u32>) -> Verdict {
    Verdict::Dnat {
        endpoints: eps(list),
        masquerade,
        affinity,
    }
}

const WEB: [&str; 3] = ["10.244.1.2:8080", "10.244.1.3:8080", "10.244.2.4:8080"];

fn unsupported_at(err: TraceError) -> usize {
    match err {
        TraceError::Unsupported { line, .. } => line,
        e => panic!("expected Unsupported, got {e}"),
    }
}

fn invalid_at(err: TraceError) -> usize {
    match err {
        TraceError::Invalid { line, .. } => line,
        e => panic!("expected Invalid, got {e}"),
    }
}

#[test]
fn statistic_rules_spread_a_service_evenly_over_every_endpoint() {
    let t = tracer();
    let p = pod("10.244.1.5", "10.96.0.10", 80);
    assert_eq!(t.trace(&p), dnat(&WEB, false, None));
    let branches = t.branches(&p).unwrap();
    assert_eq!(branches.len(), 3);
    for b in &branches {
        assert!(
            (b.probability - 1.0 / 3.0).abs() < 1e-6,
            "{:?} has probability {}",
            b.outcome,
            b.probability
        );
        assert!(
            b.rules.iter().any(|r| r.contains("-j DNAT")),
            "{:#?}",
            b.rules
        );
    }
    // Another port of the same address is not a Service.
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.10", 81)),
        Verdict::Untouched
    );
}

#[test]
fn client_ip_affinity_reports_the_rcheck_timeout() {
    let t = tracer();
    let p = pod("10.244.1.5", "10.96.0.30", 80);
    assert_eq!(
        t.trace(&p),
        dnat(&["10.244.1.2:8080", "10.244.1.3:8080"], false, Some(60))
    );
    // Affinity needs the endpoint to record the client: without `--set`, no affinity.
    let no_set = NAT.replace(
        "-m recent --set --name KUBE-SEP-STICKY1STICKY1ST --mask 255.255.255.255 --rsource ",
        "",
    );
    assert_ne!(no_set, NAT);
    let t = tracer_with(&no_set);
    assert_eq!(
        t.trace(&p),
        dnat(&["10.244.1.2:8080", "10.244.1.3:8080"], false, None)
    );
}

#[test]
fn kube_mark_masq_and_kube_postrouting_masquerade_off_cluster_sources() {
    let t = tracer();
    // From outside the cluster CIDR: marked, then masqueraded in POSTROUTING.
    assert_eq!(
        t.trace(&client("192.0.2.2", "10.96.0.10", 80)),
        dnat(&WEB, true, None)
    );
    // The node's own connection goes through nat OUTPUT and is masqueraded too.
    assert_eq!(t.trace(&node("10.96.0.10", 80)), dnat(&WEB, true, None));
    // A NodePort always masquerades (externalTrafficPolicy: Cluster).
    assert_eq!(
        t.trace(&client("192.0.2.2", "192.0.2.1", 30080)),
        dnat(&WEB, true, None)
    );
    assert_eq!(
        t.trace(&pod("10.244.1.5", "192.0.2.1", 30080)),
        dnat(&WEB, true, None)
    );
}

#[test]
fn hairpin_masquerades_only_the_branch_that_lands_on_the_client_itself() {
    let t = tracer();
    let p = pod("10.244.1.2", "10.96.0.10", 80);
    let branches = t.branches(&p).unwrap();
    for b in &branches {
        let to_self = b.outcome == Outcome::Dnat("10.244.1.2".parse().unwrap(), 8080);
        assert_eq!(b.masquerade, to_self, "{b:#?}");
    }
    // Not every branch is masqueraded, so the verdict is not.
    assert_eq!(t.trace(&p), dnat(&WEB, false, None));
    // A single-endpoint Service reached by its own endpoint: masqueraded.
    assert_eq!(
        t.trace(&pod("10.244.1.3", "10.96.0.60", 80)),
        dnat(&["10.244.1.3:8080"], true, None)
    );
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.60", 80)),
        dnat(&["10.244.1.3:8080"], false, None)
    );
}

#[test]
fn a_service_without_endpoints_is_rejected_in_filter() {
    let t = tracer();
    // Forwarded (FORWARD -> KUBE-SERVICES) and the node's own (OUTPUT -> KUBE-SERVICES).
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.20", 80)),
        Verdict::Reject
    );
    assert_eq!(t.trace(&node("10.96.0.20", 80)), Verdict::Reject);
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.20", 81)),
        Verdict::Untouched
    );
    // Its NodePort, delivered locally: INPUT -> KUBE-EXTERNAL-SERVICES.
    assert_eq!(
        t.trace(&client("192.0.2.2", "192.0.2.1", 30020)),
        Verdict::Reject
    );
}

#[test]
fn load_balancer_source_ranges_drop_through_kube_proxy_firewall() {
    let t = tracer();
    assert_eq!(
        t.trace(&client("192.0.2.2", "198.51.100.20", 80)),
        dnat(&["10.244.1.3:8080"], true, None)
    );
    assert_eq!(
        t.trace(&client("192.0.2.5", "198.51.100.20", 80)),
        Verdict::Drop
    );
    // Without the filter rule, traffic from outside the ranges would pass untranslated.
    let filter = FILTER
        .lines()
        .filter(|l| !l.contains("-d 198.51.100.20"))
        .map(|l| format!("{l}\n"))
        .collect::<String>();
    let mut t = IptablesTracer::new(node_addresses());
    t.apply(V4, &format!("{filter}{NAT}")).unwrap();
    t.apply(V4, JUMPS).unwrap();
    assert_eq!(
        t.trace(&client("192.0.2.5", "198.51.100.20", 80)),
        Verdict::Untouched
    );
}

#[test]
fn nodeports_answer_on_local_addresses_but_not_on_localhost() {
    let t = tracer();
    assert_eq!(t.trace(&node("192.0.2.1", 30080)), dnat(&WEB, true, None));
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.244.1.1", 30080)),
        dnat(&WEB, true, None)
    );
    // `! -d 127.0.0.0/8`: localhost is local but excluded.
    assert_eq!(t.trace(&node("127.0.0.1", 30080)), Verdict::Untouched);
    // Not a local address: not a NodePort.
    assert_eq!(
        t.trace(&client("192.0.2.2", "192.0.2.9", 30080)),
        Verdict::Untouched
    );
    // The same table with localhost NodePorts allowed.
    let t = tracer_with(&NAT.replace(" ! -d 127.0.0.0/8", ""));
    assert_eq!(t.trace(&node("127.0.0.1", 30080)), dnat(&WEB, true, None));
}

const NAT6: &str = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-V6V6V6V6V6V6V6V6 - [0:0]
:KUBE-SEP-V6AV6AV6AV6AV6AV - [0:0]
:KUBE-SEP-V6BV6BV6BV6BV6BV - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d fd00:10:96::10 --dport 80 -j KUBE-SVC-V6V6V6V6V6V6V6V6
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -m comment --comment default/web:http -m tcp -p tcp --dport 30080 -j KUBE-SVC-V6V6V6V6V6V6V6V6
-A KUBE-SVC-V6V6V6V6V6V6V6V6 -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d fd00:10:96::10 --dport 80 ! -s fd00:10:244::/48 -j KUBE-MARK-MASQ
-A KUBE-SVC-V6V6V6V6V6V6V6V6 -m comment --comment default/web:http -m tcp -p tcp --dport 30080 -j KUBE-MARK-MASQ
-A KUBE-SVC-V6V6V6V6V6V6V6V6 -m comment --comment "default/web:http -> [fd00:10:244:1::2]:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-V6AV6AV6AV6AV6AV
-A KUBE-SVC-V6V6V6V6V6V6V6V6 -m comment --comment "default/web:http -> [fd00:10:244:1::3]:8080" -j KUBE-SEP-V6BV6BV6BV6BV6BV
-A KUBE-SEP-V6AV6AV6AV6AV6AV -m comment --comment default/web:http -s fd00:10:244:1::2/128 -j KUBE-MARK-MASQ
-A KUBE-SEP-V6AV6AV6AV6AV6AV -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination [fd00:10:244:1::2]:8080
-A KUBE-SEP-V6BV6BV6BV6BV6BV -m comment --comment default/web:http -s fd00:10:244:1::3/128 -j KUBE-MARK-MASQ
-A KUBE-SEP-V6BV6BV6BV6BV6BV -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination [fd00:10:244:1::3]:8080
-I PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
COMMIT
"#;

#[test]
fn ipv6_tables_are_separate_and_dnat_to_bracketed_addresses() {
    let mut t = IptablesTracer::new(node_addresses());
    t.apply(V6, NAT6).unwrap();
    let v6 = ["[fd00:10:244:1::2]:8080", "[fd00:10:244:1::3]:8080"];
    assert_eq!(
        t.trace(&pod("fd00:10:244:1::5", "fd00:10:96::10", 80)),
        dnat(&v6, false, None)
    );
    assert_eq!(
        t.trace(&client("2001:db8::5", "fd00:10:96::10", 80)),
        dnat(&v6, true, None)
    );
    // NodePort on a local IPv6 address, not on ::1.
    assert_eq!(
        t.trace(&packet(Origin::Node, "2001:db8::1", "2001:db8::1", 30080)),
        dnat(&v6, true, None)
    );
    assert_eq!(
        t.trace(&packet(Origin::Node, "::1", "::1", 30080)),
        Verdict::Untouched
    );
    // The IPv4 tables are untouched by an IPv6 input.
    assert!(t.chain(V4, Table::Nat, "KUBE-SERVICES").is_none());
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.10", 80)),
        Verdict::Untouched
    );
    // Addresses and REJECT types of the other family are refused.
    let mut t = IptablesTracer::new(node_addresses());
    let err = t
        .apply(
            V6,
            "*nat\n:KUBE-X - [0:0]\n-A KUBE-X -d 10.96.0.10/32 -j RETURN\nCOMMIT\n",
        )
        .unwrap_err();
    assert_eq!(invalid_at(err), 3);
    let err = t
        .apply(
            V6,
            "*filter\n-A INPUT -j REJECT --reject-with icmp-port-unreachable\nCOMMIT\n",
        )
        .unwrap_err();
    assert_eq!(invalid_at(err), 2);
    t.apply(
        V6,
        "*filter\n-A INPUT -j REJECT --reject-with icmp6-port-unreachable\nCOMMIT\n",
    )
    .unwrap();
}

/// iptables-nft refuses a negated zero-length prefix (iptables-legacy takes it as a match that
/// never matches); so does the tracer, so a traced plan cannot carry one.
#[test]
fn a_negated_zero_length_prefix_is_refused() {
    let mut t = IptablesTracer::new(node_addresses());
    for (family, net) in [(V4, "0.0.0.0/0"), (V6, "::/0")] {
        for flag in ["-s", "-d"] {
            let err = t
                .apply(
                    family,
                    &format!(
                        "*filter\n:KUBE-X - [0:0]\n-A KUBE-X ! {flag} {net} -j RETURN\nCOMMIT\n"
                    ),
                )
                .unwrap_err();
            assert_eq!(invalid_at(err.clone()), 3, "{err}");
            assert!(err.to_string().contains("iptables-nft"), "{err}");
        }
    }
    t.apply(
        V4,
        "*filter\n:KUBE-X - [0:0]\n-A KUBE-X ! -d 0.0.0.0/1 -j RETURN\n-A KUBE-X -d 0.0.0.0/0 -j RETURN\nCOMMIT\n",
    )
    .unwrap();
}

#[test]
fn noflush_redeclaring_a_chain_flushes_it_and_leaves_the_others() {
    let mut t = tracer();
    t.apply(
        V4,
        r#"*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SVC-WEBWEBWEBWEBWEBW - [0:0]
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http -> 10.244.2.4:8080" -j KUBE-SEP-WEB3WEB3WEB3WEB3
COMMIT
"#,
    )
    .unwrap();
    // The built-in chain keeps its jump; the redeclared chain has only its new rule; the
    // endpoint chains it no longer uses still exist, untouched.
    assert_eq!(t.chain(V4, Table::Nat, "PREROUTING").unwrap().len(), 1);
    assert_eq!(
        t.chain(V4, Table::Nat, "KUBE-SVC-WEBWEBWEBWEBWEBW").unwrap(),
        ["-m comment --comment \"default/web:http -> 10.244.2.4:8080\" -j KUBE-SEP-WEB3WEB3WEB3WEB3"]
    );
    assert_eq!(
        t.chain(V4, Table::Nat, "KUBE-SEP-WEB1WEB1WEB1WEB1")
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.10", 80)),
        dnat(&["10.244.2.4:8080"], false, None)
    );
    // A chain with rules cannot be deleted; flushed first (as restore inputs do), it can.
    let err = t
        .apply(V4, "*nat\n-X KUBE-SEP-WEB1WEB1WEB1WEB1\nCOMMIT\n")
        .unwrap_err();
    assert_eq!(invalid_at(err), 2);
    t.apply(
        V4,
        "*nat\n:KUBE-SEP-WEB1WEB1WEB1WEB1 - [0:0]\n-X KUBE-SEP-WEB1WEB1WEB1WEB1\nCOMMIT\n",
    )
    .unwrap();
    assert!(t
        .chain(V4, Table::Nat, "KUBE-SEP-WEB1WEB1WEB1WEB1")
        .is_none());
    assert!(!t
        .chain_names(V4, Table::Nat)
        .contains(&"KUBE-SEP-WEB1WEB1WEB1WEB1".to_string()));
}

#[test]
fn deleting_a_referenced_or_built_in_chain_fails_and_changes_nothing() {
    let mut t = tracer();
    let before = t.chain_names(V4, Table::Nat);
    // KUBE-SERVICES and KUBE-EXT still jump to the SVC chain. The whole input is refused,
    // including the rule added before the failing line.
    let err = t
        .apply(
            V4,
            "*nat\n-A KUBE-SERVICES -d 10.96.0.99/32 -j KUBE-MARK-MASQ\n\
             :KUBE-SVC-WEBWEBWEBWEBWEBW - [0:0]\n-X KUBE-SVC-WEBWEBWEBWEBWEBW\nCOMMIT\n",
        )
        .unwrap_err();
    assert_eq!(invalid_at(err), 4);
    assert_eq!(t.chain_names(V4, Table::Nat), before);
    assert_eq!(t.chain(V4, Table::Nat, "KUBE-SERVICES").unwrap().len(), 5);
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.10", 80)),
        dnat(&WEB, false, None)
    );
    for bad in ["-X PREROUTING", "-X KUBE-NOPE"] {
        let err = t.apply(V4, &format!("*nat\n{bad}\nCOMMIT\n")).unwrap_err();
        assert_eq!(invalid_at(err), 2, "{bad}");
    }
    // Once nothing jumps to it, it goes.
    t.apply(
        V4,
        "*nat\n:KUBE-NODEPORTS - [0:0]\n:KUBE-EXT-WEBWEBWEBWEBWEBW - [0:0]\n\
         -X KUBE-EXT-WEBWEBWEBWEBWEBW\nCOMMIT\n",
    )
    .unwrap();
    assert!(t
        .chain(V4, Table::Nat, "KUBE-EXT-WEBWEBWEBWEBWEBW")
        .is_none());
}

#[test]
fn commit_refuses_jumps_to_missing_chains_loops_and_misplaced_nat() {
    let mut t = tracer();
    let err = t
        .apply(
            V4,
            "*nat\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j KUBE-SEP-GONE\nCOMMIT\n",
        )
        .unwrap_err();
    assert_eq!(invalid_at(err.clone()), 4, "{err}");
    assert!(err.to_string().contains("KUBE-SEP-GONE"), "{err}");
    // The chain may be created later in the same table, before COMMIT.
    t.apply(
        V4,
        "*nat\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j KUBE-SEP-LATE\n:KUBE-SEP-LATE - [0:0]\nCOMMIT\n",
    )
    .unwrap();
    let err = t
        .apply(
            V4,
            "*nat\n:KUBE-LOOP - [0:0]\n-A KUBE-LOOP -j KUBE-SERVICES\n\
             -A KUBE-SERVICES -j KUBE-LOOP\nCOMMIT\n",
        )
        .unwrap_err();
    assert!(err.to_string().contains("loop"), "{err}");
    // DNAT belongs to PREROUTING and OUTPUT, MASQUERADE to POSTROUTING.
    let err = t
        .apply(
            V4,
            "*nat\n-A KUBE-POSTROUTING -j KUBE-SEP-WEB1WEB1WEB1WEB1\nCOMMIT\n",
        )
        .unwrap_err();
    assert!(err.to_string().contains("POSTROUTING"), "{err}");
    let err = t
        .apply(V4, "*nat\n-A KUBE-SERVICES -j MASQUERADE\nCOMMIT\n")
        .unwrap_err();
    assert!(err.to_string().contains("MASQUERADE"), "{err}");
    // And filtering targets stay out of nat, NAT targets out of filter.
    for (table, rule) in [
        ("nat", "-j DROP"),
        ("nat", "-j REJECT"),
        ("filter", "-p tcp -j DNAT --to-destination 10.0.0.1:80"),
        ("filter", "-j MASQUERADE"),
    ] {
        let err = t
            .apply(V4, &format!("*{table}\n-A OUTPUT {rule}\nCOMMIT\n"))
            .unwrap_err();
        assert_eq!(invalid_at(err), 2, "{table} {rule}");
    }
}

#[test]
fn unknown_tables_commands_matches_options_and_targets_are_refused() {
    let mut t = tracer();
    for (text, line) in [
        ("*raw\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n", 1),
        (
            "*nat\n-A KUBE-SERVICES -m owner --uid-owner 0 -j RETURN\nCOMMIT\n",
            2,
        ),
        (
            "*nat\n-A KUBE-SERVICES -p tcp -m tcp --tcp-flags SYN SYN -j RETURN\nCOMMIT\n",
            2,
        ),
        ("*nat\n-A KUBE-SERVICES -j LOG\nCOMMIT\n", 2),
        ("*nat\n-A KUBE-SERVICES -o eth0 -j RETURN\nCOMMIT\n", 2),
        (
            "*nat\n-A KUBE-SERVICES -m statistic --mode nth --every 2 -j RETURN\nCOMMIT\n",
            2,
        ),
        (
            "*nat\n-A KUBE-SERVICES -m addrtype --dst-type UNICAST -j RETURN\nCOMMIT\n",
            2,
        ),
        // `--dport` with no protocol loaded: iptables does not know the option either.
        ("*nat\n-A KUBE-SERVICES --dport 80 -j RETURN\nCOMMIT\n", 2),
        (
            "*nat\n-A KUBE-SERVICES -m comment --comment x --frobnicate -j RETURN\nCOMMIT\n",
            2,
        ),
        ("*nat\n-R KUBE-SERVICES 1 -j RETURN\nCOMMIT\n", 2),
        ("*nat\n-A KUBE-SERVICES -p icmp -j RETURN\nCOMMIT\n", 2),
    ] {
        let err = t.apply(V4, text).unwrap_err();
        assert_eq!(unsupported_at(err), line, "{text}");
    }
    for (text, line) in [
        // `-m tcp` without `-p tcp` is refused by the kernel.
        (
            "*nat\n-A KUBE-SERVICES -m tcp --dport 80 -j RETURN\nCOMMIT\n",
            2,
        ),
        (
            "*nat\n-A KUBE-SERVICES -m comment --comment \"open -j RETURN\nCOMMIT\n",
            2,
        ),
        (
            "*nat\n-A KUBE-SERVICES -d 10.96.0.300 -j RETURN\nCOMMIT\n",
            2,
        ),
        ("*nat\n-A KUBE-NOPE -j RETURN\nCOMMIT\n", 2),
        (
            "*nat\n:KUBE-SVC-THIS-NAME-IS-FAR-TOO-LONG - [0:0]\nCOMMIT\n",
            2,
        ),
        ("*nat\n:KUBE-SERVICES ACCEPT [0:0]\nCOMMIT\n", 2),
        ("*nat\n-A KUBE-SERVICES -j RETURN\n", 3),
        ("-A KUBE-SERVICES -j RETURN\n", 1),
        (
            "*nat\n-A KUBE-SERVICES -m mark --mark 0x4000/0x4000 ! -j RETURN\nCOMMIT\n",
            2,
        ),
        ("*nat\n-A KUBE-SERVICES -p tcp -j DNAT\nCOMMIT\n", 2),
        (
            "*nat\n-A KUBE-SERVICES -j DNAT --to-destination 10.0.0.1:80\nCOMMIT\n",
            2,
        ),
        ("*nat\n-A KUBE-SERVICES -j RETURN -j ACCEPT\nCOMMIT\n", 2),
        (
            "*nat\n-A KUBE-SERVICES -m recent --set --seconds 5 -j RETURN\nCOMMIT\n",
            2,
        ),
        ("*nat\n-I KUBE-SERVICES 9 -j RETURN\nCOMMIT\n", 2),
        ("*nat\n-D KUBE-SERVICES -j ACCEPT\nCOMMIT\n", 2),
    ] {
        let err = t.apply(V4, text).unwrap_err();
        assert_eq!(invalid_at(err), line, "{text}");
    }
    let long = "x".repeat(256);
    let err = t
        .apply(
            V4,
            &format!("*nat\n-A KUBE-SERVICES -m comment --comment \"{long}\" -j RETURN\nCOMMIT\n"),
        )
        .unwrap_err();
    assert_eq!(invalid_at(err), 2);
    // Nothing of the refused inputs landed.
    assert_eq!(t.chain(V4, Table::Nat, "KUBE-SERVICES").unwrap().len(), 5);
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.10", 80)),
        dnat(&WEB, false, None)
    );
}

#[test]
fn removing_the_kube_mark_masq_jump_changes_the_verdict() {
    let p = client("192.0.2.2", "192.0.2.1", 30080);
    assert_eq!(tracer().trace(&p), dnat(&WEB, true, None));
    let broken: String = NAT
        .lines()
        .filter(|l| !(l.starts_with("-A KUBE-EXT-WEB") && l.ends_with("-j KUBE-MARK-MASQ")))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(broken.lines().count(), NAT.lines().count() - 1);
    assert_eq!(tracer_with(&broken).trace(&p), dnat(&WEB, false, None));
    // Nor does a mark alone masquerade: KUBE-POSTROUTING must do it.
    let no_masq: String = NAT
        .lines()
        .filter(|l| !l.contains("-j MASQUERADE"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(tracer_with(&no_masq).trace(&p), dnat(&WEB, false, None));
}

#[test]
fn branches_that_disagree_are_an_error_never_a_verdict_a_row_expects() {
    let mut t = tracer();
    t.apply(
        V4,
        "*nat\n-I KUBE-SERVICES -d 10.96.0.99/32 -m statistic --mode random --probability 0.5 \
         -j KUBE-SEP-WEB1WEB1WEB1WEB1\nCOMMIT\n",
    )
    .unwrap();
    let p = pod("10.244.1.5", "10.96.0.99", 80);
    let err = t.trace_all(&p).unwrap_err();
    assert!(matches!(err, TraceError::Inconsistent { .. }), "{err}");
    let v = t.trace(&p);
    for want in [
        Verdict::Untouched,
        Verdict::Drop,
        Verdict::Reject,
        dnat(&["10.244.1.2:8080"], false, None),
    ] {
        assert_ne!(v, want);
    }
}

#[test]
fn drop_policies_drop_what_no_rule_accepts() {
    let mut t = tracer();
    t.apply(V4, "*filter\n:FORWARD DROP [0:0]\nCOMMIT\n")
        .unwrap();
    // The built-in chain kept its jumps: only its policy changed.
    assert_eq!(t.chain(V4, Table::Filter, "FORWARD").unwrap().len(), 4);
    // Masquerade-marked traffic is accepted by KUBE-FORWARD; the pod's is not marked.
    assert_eq!(
        t.trace(&client("192.0.2.2", "10.96.0.10", 80)),
        dnat(&WEB, true, None)
    );
    assert_eq!(t.trace(&pod("10.244.1.5", "10.96.0.10", 80)), Verdict::Drop);
    // A DROP policy on a nat chain drops what no rule accepts or translates.
    t.apply(V4, "*nat\n:PREROUTING DROP [0:0]\nCOMMIT\n")
        .unwrap();
    assert_eq!(t.trace(&pod("10.244.1.5", "10.96.0.99", 80)), Verdict::Drop);
    assert_eq!(
        t.trace(&client("192.0.2.2", "10.96.0.10", 80)),
        dnat(&WEB, true, None)
    );
    let err = t
        .apply(V4, "*nat\n:KUBE-SERVICES ACCEPT [0:0]\nCOMMIT\n")
        .unwrap_err();
    assert_eq!(invalid_at(err), 2);
}

#[test]
fn jump_rules_can_be_deleted_and_reinserted_by_position() {
    let mut t = tracer();
    t.apply(
        V4,
        "*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         COMMIT\n",
    )
    .unwrap();
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.10", 80)),
        Verdict::Untouched
    );
    // The node's own traffic still goes through OUTPUT.
    assert_eq!(t.trace(&node("10.96.0.10", 80)), dnat(&WEB, true, None));
    t.apply(
        V4,
        "*nat\n-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -D OUTPUT 1\nCOMMIT\n",
    )
    .unwrap();
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.0.10", 80)),
        dnat(&WEB, false, None)
    );
    assert_eq!(t.trace(&node("10.96.0.10", 80)), Verdict::Untouched);
    // Equivalent spellings are the same rule to -D, as in the kernel.
    t.apply(
        V4,
        "*nat\n-D KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\nCOMMIT\n",
    )
    .unwrap();
    assert_eq!(
        t.trace(&client("192.0.2.2", "10.96.0.10", 80)),
        dnat(&WEB, false, None)
    );
}

#[test]
fn comments_quoting_and_rule_text_round_trip() {
    let mut t = IptablesTracer::new(node_addresses());
    t.apply(
        V4,
        r#"*nat
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -m comment --comment "say \"hi\"" -j RETURN
-A KUBE-SERVICES -m comment --comment bare -j RETURN
[0:0] -A KUBE-SERVICES -m comment --comment "" -j RETURN
COMMIT
"#,
    )
    .unwrap();
    assert_eq!(
        t.chain(V4, Table::Nat, "KUBE-SERVICES").unwrap(),
        [
            r#"-m comment --comment "say \"hi\"" -j RETURN"#,
            // iptables-save always quotes a comment.
            r#"-m comment --comment "bare" -j RETURN"#,
            r#"-m comment --comment "" -j RETURN"#,
        ]
    );
    assert_eq!(
        t.chain_names(V4, Table::Nat),
        [
            "INPUT",
            "KUBE-SERVICES",
            "OUTPUT",
            "POSTROUTING",
            "PREROUTING"
        ]
    );
    assert_eq!(
        t.chain_names(V4, Table::Filter),
        ["FORWARD", "INPUT", "OUTPUT"]
    );
}

#[test]
fn restore_inputs_rendered_by_restore_rs_apply_in_order() {
    let chain = |table, name: &str, rules: &[&str]| ChainWrite {
        table,
        chain: name.to_string(),
        rules: rules.iter().map(|r| r.to_string()).collect(),
    };
    let services = |rules: &[&str]| {
        vec![
            chain(Table::Nat, "KUBE-SERVICES", rules),
            chain(Table::Filter, "KUBE-SERVICES", &[]),
        ]
    };
    // Built field by field: the planner's lazy rendering state is private to it.
    let mut first = Restore::default();
    first.full = true;
    first.base_chains = vec![chain(
        Table::Nat,
        "KUBE-MARK-MASQ",
        &["-j MARK --or-mark 0x4000"],
    )];
    first.service_chains = (0..3)
        .map(|i| ServiceChains {
            service_port: format!("ns/s{i}:p"),
            chains: vec![
                chain(
                    Table::Nat,
                    &format!("KUBE-SEP-{i}"),
                    &[&format!(
                        "-m tcp -p tcp -j DNAT --to-destination 10.244.1.{}:8080",
                        i + 2
                    )],
                ),
                chain(
                    Table::Nat,
                    &format!("KUBE-SVC-{i}"),
                    &[&format!("-j KUBE-SEP-{i}")],
                ),
            ],
        })
        .collect();
    first.dispatch_chains = services(&[
        "-m tcp -p tcp -d 10.96.1.0 --dport 80 -j KUBE-SVC-0",
        "-m tcp -p tcp -d 10.96.1.1 --dport 80 -j KUBE-SVC-1",
        "-m tcp -p tcp -d 10.96.1.2 --dport 80 -j KUBE-SVC-2",
    ]);
    let mut t = IptablesTracer::new(node_addresses());
    for step in first.steps(2) {
        t.apply(V4, &step).unwrap_or_else(|e| panic!("{e}\n{step}"));
    }
    t.apply(
        V4,
        "*nat\n-I PREROUTING -j KUBE-SERVICES\nCOMMIT\n*filter\n-I FORWARD -j KUBE-SERVICES\nCOMMIT\n",
    )
    .unwrap();
    for i in 0..3 {
        assert_eq!(
            t.trace(&pod("10.244.1.5", &format!("10.96.1.{i}"), 80)),
            dnat(&[&format!("10.244.1.{}:8080", i + 2)], false, None)
        );
    }
    // The next sync drops s1: its chains are flushed and deleted after the dispatch rewrite.
    let mut second = Restore::default();
    second.dispatch_chains = services(&[
        "-m tcp -p tcp -d 10.96.1.0 --dport 80 -j KUBE-SVC-0",
        "-m tcp -p tcp -d 10.96.1.2 --dport 80 -j KUBE-SVC-2",
    ]);
    second.deleted_chains = vec![
        (Table::Nat, "KUBE-SVC-1".into()),
        (Table::Nat, "KUBE-SEP-1".into()),
    ];
    t.apply(V4, &second.text())
        .unwrap_or_else(|e| panic!("{e}\n{}", second.text()));
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.1.1", 80)),
        Verdict::Untouched
    );
    assert!(t.chain(V4, Table::Nat, "KUBE-SEP-1").is_none());
    assert_eq!(
        t.trace(&pod("10.244.1.5", "10.96.1.2", 80)),
        dnat(&["10.244.1.4:8080"], false, None)
    );
    // Deleting the chains while the dispatch chain still jumps to them is refused.
    let mut t2 = t.clone();
    let err = t2
        .apply(V4, "*nat\n:KUBE-SVC-0 - [0:0]\n-X KUBE-SVC-0\nCOMMIT\n")
        .unwrap_err();
    assert_eq!(invalid_at(err), 3);
}

#[test]
fn tokenizer_follows_iptables_restore_quoting() {
    let toks = tokenize(r#"-A X -m comment --comment "a b \"c\" d\\e \n" -j RETURN"#).unwrap();
    assert_eq!(
        toks,
        [
            "-A",
            "X",
            "-m",
            "comment",
            "--comment",
            "a b \"c\" d\\e \\n",
            "-j",
            "RETURN"
        ]
    );
    assert!(tokenize("-A X \"open").is_err());
    assert_eq!(join(&toks[4..6]), r#"--comment "a b \"c\" d\\e \\n""#);
}

#[test]
fn mark_targets_follow_the_kernel_arithmetic() {
    let parse = |rule: &str| {
        let args = tokenize(rule).unwrap();
        parse_rule(V4, Table::Nat.into(), &args).unwrap().target
    };
    let apply = |t: Target, mark: u32| match t {
        Target::Mark { value, mask } => (mark & !mask) ^ value,
        other => panic!("{other:?}"),
    };
    assert_eq!(apply(parse("-j MARK --or-mark 0x4000"), 0x8001), 0xc001);
    assert_eq!(apply(parse("-j MARK --xor-mark 0x4000"), 0xc001), 0x8001);
    assert_eq!(
        apply(parse("-j MARK --set-xmark 0x4000/0x0"), 0xc001),
        0x8001
    );
    assert_eq!(
        apply(parse("-j MARK --set-xmark 0x4000/0x4000"), 0x1),
        0x4001
    );
    assert_eq!(apply(parse("-j MARK --set-mark 0x10"), 0xffff), 0x10);
    assert_eq!(apply(parse("-j MARK --set-mark 0x10/0xf0"), 0xffff), 0xff1f);
    assert_eq!(apply(parse("-j MARK --and-mark 0xff"), 0x4321), 0x21);
}

/// What real `iptables-restore --noflush` makes of an input, compared with the tracer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    /// The tracer accepts it exactly when both backends do.
    Agrees,
    /// Both backends accept it; the tracer refuses it on purpose (see [`TraceError`]).
    Stricter,
}

fn kernel_base(family: IpFamily) -> String {
    let (vip, ep) = match family {
        IpFamily::V4 => ("10.96.0.1/32", "10.0.0.1:80"),
        IpFamily::V6 => ("fd00:10:96::1/128", "[fd00::1]:80"),
    };
    format!(
        "*filter\n:KUBE-SERVICES - [0:0]\n-A FORWARD -j KUBE-SERVICES\nCOMMIT\n\
         *nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SEP-A - [0:0]\n\
         :KUBE-UNUSED - [0:0]\n-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
         -A KUBE-SEP-A -p tcp -j DNAT --to-destination {ep}\n\
         -A KUBE-SERVICES -d {vip} -p tcp -m tcp --dport 80 -j KUBE-SEP-A\n\
         -A PREROUTING -j KUBE-SERVICES\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n"
    )
}

fn kernel_cases() -> Vec<(IpFamily, Kernel, String)> {
    use Kernel::{Agrees, Stricter};
    let nat = |body: &str| format!("*nat\n{body}\nCOMMIT\n");
    let filter = |body: &str| format!("*filter\n{body}\nCOMMIT\n");
    let mut v: Vec<(IpFamily, Kernel, String)> = vec![
        // The fixtures of these tests.
        (V4, Agrees, format!("{FILTER}{NAT}{JUMPS}")),
        (V6, Agrees, NAT6.to_string()),
    ];
    for body in [
        // Accepted.
        ":PREROUTING ACCEPT [0:0]\n:KUBE-SEP-A - [0:0]",
        ":PREROUTING DROP [0:0]",
        ":KUBE-UNUSED - [0:0]\n-X KUBE-UNUSED",
        "-D PREROUTING -j KUBE-SERVICES",
        "-D OUTPUT 1",
        "-I OUTPUT 1 -m comment --comment \"say \\\"hi\\\"\" -j KUBE-SERVICES",
        "-I OUTPUT 2 -j KUBE-MARK-MASQ",
        "[0:0] -A KUBE-UNUSED -j RETURN",
        "-A KUBE-UNUSED -m tcp -p tcp ! --dport 80:90 -j RETURN",
        "-A KUBE-UNUSED -p udp --sport 53 -j RETURN",
        "-A KUBE-UNUSED -p sctp -m sctp --dport 9 -j RETURN",
        "-A KUBE-UNUSED -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-UNUSED -j MARK --set-xmark 0x4000/0x0",
        "-A KUBE-UNUSED -j MARK --and-mark 0xff",
        "-A KUBE-UNUSED -m statistic --mode random --probability 0.2500000000 -g KUBE-SEP-A",
        "-A KUBE-UNUSED -m recent --name KUBE-SEP-A --rcheck --seconds 10800 --reap -j KUBE-SEP-A",
        "-A KUBE-UNUSED -m recent --set --name KUBE-SEP-A --mask 255.255.255.255 --rsource -j RETURN",
        "-A KUBE-UNUSED -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j RETURN",
        "-A KUBE-UNUSED -m addrtype ! --src-type LOCAL --dst-type LOCAL -j RETURN",
        "-A KUBE-UNUSED -s 10.0.0.0/255.0.0.0 -j RETURN",
        ":KUBE-NEW - [0:0]\n-A KUBE-SERVICES -j KUBE-NEW\n-A KUBE-NEW -j MASQUERADE",
        "-A POSTROUTING -j MASQUERADE --random-fully",
        // Refused.
        "-X KUBE-SEP-A",
        "-X KUBE-MARK-MASQ",
        "-X PREROUTING",
        "-X KUBE-NOPE",
        "-N KUBE-SEP-A",
        "-A KUBE-NOPE -j RETURN",
        "-A KUBE-UNUSED -j KUBE-NOPE",
        "-A KUBE-UNUSED -j DROP",
        "-A KUBE-UNUSED -j REJECT",
        "-A POSTROUTING -j KUBE-SEP-A",
        ":KUBE-M - [0:0]\n-A KUBE-M -j MASQUERADE\n-A OUTPUT -j KUBE-M",
        "-A KUBE-UNUSED -j KUBE-SERVICES\n-A KUBE-SEP-A -j KUBE-UNUSED",
        "-A KUBE-UNUSED -m tcp --dport 80 -j RETURN",
        "-A KUBE-UNUSED --dport 80 -j RETURN",
        "-A KUBE-UNUSED --dport 80 -p tcp -j RETURN",
        ":KUBE-SVC-THIS-NAME-IS-29-CHARS - [0:0]",
        ":KUBE-MASQ ACCEPT [0:0]",
        "-A KUBE-UNUSED -m recent --set --seconds 5 --name X -j RETURN",
        "-A KUBE-UNUSED -j DNAT --to-destination 10.0.0.1:80",
        "-I KUBE-UNUSED 2 -j RETURN",
        "-D KUBE-UNUSED -j RETURN",
        "-A KUBE-UNUSED -s 10.0.0.300 -j RETURN",
        // Accepted by both backends, refused by the tracer. (An unterminated quote swallows
        // the rest of the line, and the newline, into the comment.)
        "-A KUBE-UNUSED -m comment --comment \"open -j RETURN",
        "-A KUBE-UNUSED -o eth0 -j RETURN",
        // Detect-local by interface: a prefix, and one too long with its `+`.
        "-A KUBE-UNUSED ! -i veth+ -j RETURN",
        "-A KUBE-UNUSED -i abcdefghijklmno+ -j RETURN",
        "-A KUBE-UNUSED -j LOG",
        "-A KUBE-UNUSED -m recent --rcheck --name X -j RETURN",
        ":MARK - [0:0]",
    ] {
        let stricter = body.contains("-o eth0")
            || body.contains("LOG")
            || body.contains("--rcheck --name X")
            || body.starts_with(":MARK")
            || body.contains("\"open");
        v.push((V4, if stricter { Stricter } else { Agrees }, nat(body)));
    }
    let long = "x".repeat(256);
    v.extend([
        (
            V4,
            Stricter,
            nat(&format!(
                "-A KUBE-UNUSED -m comment --comment {long} -j RETURN"
            )),
        ),
        (V4, Stricter, "*raw\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n".into()),
        (V4, Agrees, "*nat\n-A KUBE-UNUSED -j RETURN\n".into()),
        (V4, Agrees, filter("-A KUBE-SERVICES -p tcp -j REJECT --reject-with tcp-reset")),
        (V4, Agrees, filter("-A KUBE-SERVICES -j REJECT --reject-with tcp-reset")),
        (V4, Agrees, filter(":FORWARD DROP [0:0]\n-A KUBE-SERVICES -j DROP")),
        (V4, Agrees, filter("-A KUBE-SERVICES -p tcp -j DNAT --to-destination 10.0.0.1:80")),
        (V4, Agrees, filter("-A KUBE-SERVICES -j MASQUERADE")),
        (V4, Agrees, filter("-A PREROUTING -j ACCEPT")),
        (V6, Agrees, filter("-A KUBE-SERVICES -j REJECT --reject-with icmp6-port-unreachable")),
        (V6, Agrees, filter("-A KUBE-SERVICES -j REJECT --reject-with icmp-port-unreachable")),
        (V6, Agrees, nat("-A KUBE-UNUSED -d 10.0.0.1 -j RETURN")),
        (V6, Agrees, nat("-A KUBE-UNUSED -p tcp -j DNAT --to-destination [fd00::2]:8080")),
        (V6, Agrees, nat("-A KUBE-UNUSED -p tcp -j DNAT --to-destination 10.0.0.1:80")),
        (
            V6,
            Agrees,
            nat("-A KUBE-UNUSED -m recent --set --name X --mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource"),
        ),
    ]);
    v
}

#[test]
fn the_tracer_loads_exactly_what_iptables_restore_loads() {
    if !kp_test::netns::require_root() {
        return;
    }
    use std::io::Write as _;
    let restore = |ns: &kp_test::netns::Netns, family: IpFamily, backend: &str, input: &str| {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        file.write_all(input.as_bytes()).expect("write input");
        let bin = match family {
            IpFamily::V4 => format!("iptables-{backend}-restore"),
            IpFamily::V6 => format!("ip6tables-{backend}-restore"),
        };
        let path = file.path().to_str().expect("utf-8 path");
        let out = ns
            .exec(&[&bin, "-w", "--noflush", path])
            .unwrap_or_else(|e| panic!("{bin}: {e}"));
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let mut failures = Vec::new();
    for (family, kind, input) in kernel_cases() {
        let ns = kp_test::netns::Netns::new("tracer").expect("namespace");
        let base = kernel_base(family);
        let mut kernel = Vec::new();
        for backend in ["legacy", "nft"] {
            let (ok, err) = restore(&ns, family, backend, &base);
            assert!(ok, "{backend} refused the base: {err}");
            kernel.push((backend, restore(&ns, family, backend, &input)));
        }
        let mut t = IptablesTracer::new(vec![]);
        t.apply(family, &base).unwrap();
        let traced = t.apply(family, &input);
        let both = kernel.iter().all(|(_, (ok, _))| *ok);
        let agree = match kind {
            Kernel::Agrees => traced.is_ok() == both,
            Kernel::Stricter => both && traced.is_err(),
        };
        if !agree {
            failures.push(format!(
                "{family:?} {kind:?}\n{input}tracer: {traced:?}\nkernel: {kernel:?}\n"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `-i` matches the interface the node's links put the packet on (`+` ends a prefix); the
/// node's own packets arrive on none, so `! -i` matches them. Without links, a packet from a
/// pod cannot be placed, and the trace says so instead of guessing.
#[test]
fn in_interface_follows_the_links_and_the_node_arrives_on_none() {
    let nat = NAT.replace(
        "--dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ",
        "--dport 80 ! -i veth+ -j KUBE-MARK-MASQ",
    );
    assert_ne!(nat, NAT);
    let links = kp_core::flow::Ingress::new()
        .route("0.0.0.0/0".parse().unwrap(), "eth0")
        .route("10.244.1.0/24".parse().unwrap(), "veth7");
    let t = tracer_with(&nat).with_ingress(links);
    let masquerade = |p: &Packet| match t.trace(p) {
        Verdict::Dnat { masquerade, .. } => masquerade,
        other => panic!("{p}: {other:?}"),
    };
    assert!(!masquerade(&pod("10.244.1.9", "10.96.0.10", 80)));
    assert!(masquerade(&packet(
        Origin::External,
        "192.0.2.2",
        "10.96.0.10",
        80
    )));
    assert!(masquerade(&packet(
        Origin::Node,
        "192.0.2.1",
        "10.96.0.10",
        80
    )));
    let exact = tracer_with(&nat.replace("! -i veth+", "! -i veth")).with_ingress(
        kp_core::flow::Ingress::new().route("10.244.1.0/24".parse().unwrap(), "veth7"),
    );
    assert!(matches!(
        exact.trace(&pod("10.244.1.9", "10.96.0.10", 80)),
        Verdict::Dnat {
            masquerade: true,
            ..
        }
    ));
    let blind = tracer_with(&nat);
    let caught = std::panic::catch_unwind(|| blind.trace(&pod("10.244.1.9", "10.96.0.10", 80)));
    assert!(caught.is_err());
}
