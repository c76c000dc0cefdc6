use super::*;

const BASE: &str = "add table ip kube-proxy
add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority dstnat; policy accept; }
add chain ip kube-proxy nat-postrouting { type nat hook postrouting priority srcnat; policy accept; }
add set ip kube-proxy vips-2 { type ipv4_addr . inet_proto . inet_service; }
add map ip kube-proxy vips-2-endpoints { typeof ip daddr . meta l4proto . th dport . numgen random mod 2 : ip daddr . th dport; }
add element ip kube-proxy vips-2 { 10.96.0.1 . tcp . 80 }
add element ip kube-proxy vips-2-endpoints { 10.96.0.1 . tcp . 80 . 0 : 10.0.0.1 . 8080, 10.96.0.1 . tcp . 80 . 1 : 10.0.0.2 . 8080 }
add rule ip kube-proxy nat-prerouting ip daddr . meta l4proto . th dport @vips-2 dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 2 map @vips-2-endpoints comment \"x\"
";

fn packet(dst: &str, dport: u16) -> Packet {
    Packet {
        origin: Origin::External,
        src: "192.0.2.2".parse().unwrap(),
        protocol: Protocol::Tcp,
        dst: dst.parse().unwrap(),
        dport,
    }
}

#[test]
fn random_dispatch_reaches_every_slot() {
    let mut t = NftTracer::new(vec![]);
    t.apply(BASE).unwrap();
    let Verdict::Dnat {
        endpoints,
        masquerade,
        affinity,
    } = t.trace(&packet("10.96.0.1", 80))
    else {
        panic!("expected DNAT");
    };
    let want: BTreeSet<(IpAddr, u16)> = [("10.0.0.1", 8080), ("10.0.0.2", 8080)]
        .iter()
        .map(|(i, p)| (i.parse().unwrap(), *p))
        .collect();
    assert_eq!(endpoints, want);
    assert!(!masquerade);
    assert_eq!(affinity, None);
    assert_eq!(t.trace(&packet("10.96.0.1", 81)), Verdict::Untouched);
}

#[test]
fn unknown_rule_shapes_are_refused() {
    let mut t = NftTracer::new(vec![]);
    t.apply(BASE).unwrap();
    let err = t
        .apply("add rule ip kube-proxy nat-prerouting tcp dport 80 counter accept comment \"y\"")
        .unwrap_err();
    assert!(matches!(err, TraceError::Unsupported { .. }), "{err}");
    let err = t.apply("flush ruleset").unwrap_err();
    assert!(matches!(err, TraceError::Unsupported { .. }), "{err}");
}

#[test]
fn deleting_a_missing_element_is_an_error_as_in_the_kernel() {
    let mut t = NftTracer::new(vec![]);
    t.apply(BASE).unwrap();
    let err = t
        .apply("delete element ip kube-proxy vips-2 { 10.96.0.9 . tcp . 80 }")
        .unwrap_err();
    assert!(matches!(err, TraceError::Invalid { .. }), "{err}");
    let err = t
        .apply("add element ip kube-proxy vips-2 { 10.96.0.1 . tcp . 80 }")
        .unwrap_err();
    assert!(matches!(err, TraceError::Invalid { .. }), "{err}");
}

#[test]
fn a_rule_naming_a_missing_set_is_refused() {
    let mut t = NftTracer::new(vec![]);
    t.apply(BASE).unwrap();
    let err = t
        .apply(
            "add rule ip kube-proxy nat-prerouting ip daddr . meta l4proto . th dport @nope drop",
        )
        .unwrap_err();
    assert!(matches!(err, TraceError::Invalid { .. }), "{err}");
}

/// `iifname` matches the interface the node's links put a packet on (`*` ends a prefix;
/// `!=` negates); without links, a packet from outside cannot be placed and the trace panics.
#[test]
fn iifname_follows_the_links() {
    let rules = |m: &str| {
        format!("{BASE}add rule ip kube-proxy nat-prerouting {m} drop comment \"z\"\n").replace(
            "add rule ip kube-proxy nat-prerouting ip daddr",
            "add rule ip kube-proxy nat-postrouting ip daddr",
        )
    };
    let links = kp_core::flow::Ingress::new()
        .route("0.0.0.0/0".parse().unwrap(), "eth0")
        .route("192.0.2.0/24".parse().unwrap(), "veth3");
    for (m, dropped) in [
        ("iifname \"veth*\"", true),
        ("iifname \"veth3\"", true),
        ("iifname \"veth\"", false),
        ("iifname != \"veth*\"", false),
        ("iifname != \"cbr0\"", true),
        ("iifname \"eth*\"", false),
    ] {
        let mut t = NftTracer::new(vec![]).with_ingress(links.clone());
        t.apply(&rules(m)).unwrap_or_else(|e| panic!("{m}: {e}"));
        assert_eq!(
            t.trace(&packet("10.96.0.1", 80)) == Verdict::Drop,
            dropped,
            "{m}"
        );
    }
    let mut blind = NftTracer::new(vec![]);
    blind.apply(&rules("iifname \"veth*\"")).unwrap();
    assert!(std::panic::catch_unwind(|| blind.trace(&packet("10.96.0.1", 80))).is_err());
    let mut t = NftTracer::new(vec![]);
    let err = t.apply(&rules("iifname \"a/b\"")).unwrap_err();
    assert!(matches!(err, TraceError::Unsupported { .. }), "{err}");
}
