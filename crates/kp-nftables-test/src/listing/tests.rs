use super::*;
use crate::NftTracer;
use kp_core::flow::{Origin, Packet, Tracer, Verdict};
use kp_core::model::{IpFamily, Protocol};

/// The transaction below, applied with `nft -f` in a namespace of its own (nftables v1.0.6,
/// Linux 6.x), then listed with `nft list table ip kube-proxy`: [`LISTING`] is that listing,
/// byte for byte (tabs included). The rules are the planner's shapes (`kp-nftables-plan`'s
/// `layout.rs`), with one affinity entry added as the packet path would add it.
const WRITTEN: &str = include_str!("written.nft");
const LISTING: &str = include_str!("listed.txt");

fn packet(src: &str, dst: &str, proto: Protocol, dport: u16) -> Packet {
    Packet {
        origin: Origin::Pod,
        src: src.parse().unwrap(),
        protocol: proto,
        dst: dst.parse().unwrap(),
        dport,
    }
}

#[test]
fn a_listing_replays_into_the_same_table_as_the_transaction_that_made_it() {
    let mut written = NftTracer::new(vec![]);
    written.apply(WRITTEN).unwrap();
    let mut listed = NftTracer::new(vec![]);
    listed
        .apply_listing(LISTING)
        .unwrap_or_else(|e| panic!("{e}\n{}", transaction(LISTING).unwrap()));
    assert_eq!(
        listed.differences(&written, IpFamily::V4),
        Vec::<String>::new()
    );
    assert_eq!(listed.comment(IpFamily::V4), written.comment(IpFamily::V4));
    for p in [
        packet("10.244.1.4", "10.96.0.1", Protocol::Tcp, 80),
        packet("192.0.2.2", "10.96.0.1", Protocol::Tcp, 80),
        packet("10.244.1.4", "10.96.0.10", Protocol::Tcp, 80),
        packet("10.244.1.4", "10.96.0.10", Protocol::Udp, 53),
        packet("10.244.1.4", "10.96.0.10", Protocol::Tcp, 81),
        packet("10.244.1.4", "10.1.2.3", Protocol::Tcp, 81),
    ] {
        assert_eq!(listed.trace(&p), written.trace(&p), "{p}");
    }
    // The listing's own answers, so the comparison above cannot pass on two empty tables.
    assert!(matches!(
        listed.trace(&packet("10.244.1.4", "10.96.0.1", Protocol::Tcp, 80)),
        Verdict::Dnat { ref endpoints, masquerade: false, .. } if endpoints.len() == 2
    ));
    assert_eq!(
        listed.trace(&packet("10.244.1.4", "10.96.0.10", Protocol::Tcp, 80)),
        Verdict::Reject
    );
    assert_eq!(
        listed.trace(&packet("10.244.1.4", "10.96.0.10", Protocol::Udp, 53)),
        Verdict::Drop
    );
}

#[test]
fn what_the_kernel_adds_is_taken_off_and_durations_become_seconds() {
    let tx = transaction(LISTING).unwrap();
    assert!(tx.contains("timeout 10800s;"), "{tx}");
    assert!(!tx.contains("expires"), "{tx}");
    assert!(tx.contains("meta mark set meta mark or 0x00004000"), "{tx}");
    assert!(tx.contains("meta mark & 0x00004000 == 0 return"), "{tx}");
    // Printed `… : ip daddr . tcp dport` without its `meta l4proto tcp`: both come back.
    assert!(
        tx.contains("affinity-update meta l4proto tcp ct state new")
            && tx.contains(": ip daddr . th dport }"),
        "{tx}"
    );
    assert!(
        tx.contains("add element ip kube-proxy affinity-10800 { 192.0.2.2 . 10.96.0.1 . tcp . 80 : 10.0.0.1 . 8080 }"),
        "{tx}"
    );
    assert_eq!(seconds("3h"), Some(10_800));
    assert_eq!(seconds("1d2h3m4s"), Some(93_784));
    assert_eq!(seconds("2h59m59s940ms"), Some(10_799));
    assert_eq!(seconds("10800s"), Some(10_800));
    assert_eq!(seconds("3"), None);
    assert_eq!(seconds("3x"), None);
}

#[test]
fn a_changed_element_or_rule_shows_as_a_difference() {
    let mut written = NftTracer::new(vec![]);
    written.apply(WRITTEN).unwrap();
    let edited = LISTING
        .replace("10.96.0.1, 10.96.0.10", "10.96.0.1")
        .replace("\t\tjump services comment \"dispatch\"\n", "");
    let mut listed = NftTracer::new(vec![]);
    listed.apply_listing(&edited).unwrap();
    let d = listed.differences(&written, IpFamily::V4);
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(d.iter().any(|l| l.contains("nat-prerouting")), "{d:?}");
    assert!(
        d.iter()
            .any(|l| l.contains("cluster-ips") && l.contains("10.96.0.10")),
        "{d:?}"
    );
    // Endpoints in other slots are the same endpoints (a table adopted after a restart).
    let swapped = LISTING
        .replace(". 0 : 10.0.0.1", ". 0 : 10.0.0.X")
        .replace(". 1 : 10.0.0.2", ". 1 : 10.0.0.1")
        .replace("10.0.0.X", "10.0.0.2");
    let mut listed = NftTracer::new(vec![]);
    listed.apply_listing(&swapped).unwrap();
    assert_eq!(
        listed.differences(&written, IpFamily::V4),
        Vec::<String>::new()
    );
    // And a missing table is one difference.
    let empty = NftTracer::new(vec![]);
    assert_eq!(empty.differences(&written, IpFamily::V4).len(), 1);
}

#[test]
fn what_a_planner_never_renders_is_refused() {
    let flowtable = "table ip kube-proxy {\n\tflowtable f {\n\t\thook ingress priority 0\n\t}\n}\n";
    assert!(matches!(
        transaction(flowtable),
        Err(ListingError::Unsupported { line: 2, .. })
    ));
    assert!(matches!(
        transaction("table ip kube-proxy {\n\tchain c {\n"),
        Err(ListingError::Truncated(_))
    ));
    assert_eq!(transaction("").unwrap(), "");
    let mut t = NftTracer::new(vec![]);
    let counter =
        "table ip kube-proxy {\n\tchain c {\n\t\tcounter packets 0 bytes 0 accept\n\t}\n}\n";
    assert!(t.apply_listing(counter).is_err());
}
