//! The reconciler against the real kernel: conntrack entries made by real datagrams through a
//! lab's node namespace, listed and deleted over ctnetlink.
//!
//! Each test builds a `kp_test::Lab` (node, client, two pods running kp-echo), programs a few
//! DNAT rules in the node namespace with `nft -f` (standing in for the dataplane), sends UDP
//! datagrams from the client with a fixed source port (so every datagram of one test flow
//! reuses one conntrack entry), and runs `Conntrack::reconcile` with a planner fed a
//! `ProxyState` built from Service and EndpointSlice objects. Addresses follow the lab's plan:
//! ClusterIPs in 10.96.0.0/16 and fd00:10:96::/112, pods 10.244.1.10 (pod-0) and 10.244.1.11
//! (pod-1), node 192.0.2.1, client 192.0.2.2. `198.51.100.99` is a DNAT that is no Service
//! of ours (another agent's translation on the node).
//!
//! Root is needed; without it every test prints a SKIPPED banner and returns.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_conntrack::Conntrack;
use kp_core::conntrack::{ConntrackPlanner, FlowEntry};
use kp_core::model::{IpFamily, Protocol};
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_test::lab::{NODE_IP, NODE_IP6};
use kp_test::{require_root, ChildGuard, Lab, Outcome, Proto, Request};
use serde_json::{json, Value};

const BOTH: &[IpFamily] = &[IpFamily::V4, IpFamily::V6];
/// The port every pod's kp-echo serves UDP and TCP on.
const BACKEND_PORT: u16 = 5353;
/// The address of a translation on the node that is not a Service.
const FOREIGN_VIP: &str = "198.51.100.99";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn node_addrs() -> Vec<IpAddr> {
    vec![NODE_IP.into(), NODE_IP6.into()]
}

/// A lab with two pods serving kp-echo, and the guards that keep the servers running.
fn lab() -> (Lab, Vec<ChildGuard>) {
    let lab = Lab::new(2).expect("lab");
    let servers = (0..2)
        .map(|i| {
            lab.serve_echo(i, &[BACKEND_PORT], &[BACKEND_PORT])
                .expect("kp-echo")
        })
        .collect();
    (lab, servers)
}

/// Replaces the node's test NAT table with `rules` (nft rule text for a prerouting nat chain).
fn program(lab: &Lab, rules: &[String]) {
    let mut text = String::from(
        "table inet kpt-conntrack\ndelete table inet kpt-conntrack\n\
         table inet kpt-conntrack {\n chain pre {\n  type nat hook prerouting priority dstnat;\n",
    );
    for rule in rules {
        text.push_str("  ");
        text.push_str(rule);
        text.push('\n');
    }
    text.push_str(" }\n}\n");
    let path = std::env::temp_dir().join(format!("{}.nft", lab.node().name()));
    std::fs::write(&path, &text).expect("write ruleset");
    let out = lab
        .node()
        .run(&["nft", "-f", path.to_str().expect("utf-8 path")]);
    let _ = std::fs::remove_file(&path);
    if let Err(e) = out {
        panic!("nft -f failed: {e}\n{text}");
    }
}

/// `ip daddr VIP udp dport PORT dnat ip to POD:5353`.
fn dnat(proto: &str, vip: &str, port: u16, to: IpAddr) -> String {
    match to {
        IpAddr::V4(to) => {
            format!("ip daddr {vip} {proto} dport {port} dnat ip to {to}:{BACKEND_PORT}")
        }
        IpAddr::V6(to) => {
            format!("ip6 daddr {vip} {proto} dport {port} dnat ip6 to [{to}]:{BACKEND_PORT}")
        }
    }
}

/// One datagram (or TCP request) from the client, from source port `sport`.
fn send(lab: &Lab, proto: Proto, dst: &str, port: u16, sport: u16) -> Outcome {
    let req = Request::new(proto, ip(dst), port)
        .src_port(sport)
        .timeout(Duration::from_millis(400));
    lab.send(lab.client(), &req).swap_remove(0)
}

fn answered_by(outcome: &Outcome) -> &str {
    outcome.backend().unwrap_or("nobody")
}

fn new_state() -> ProxyState {
    let mut state = ProxyState::new("lab-node");
    for kind in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        state.apply(SourceEvent::Synced(kind)).expect("synced");
    }
    state
}

fn upsert_service(state: &mut ProxyState, name: &str, spec: Value) {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"namespace": "web", "name": name},
        "spec": spec,
    }))
    .expect("Service JSON");
    state
        .apply(SourceEvent::Upsert(Object::Service(Box::new(svc))))
        .expect("Service accepted");
}

fn delete_service(state: &mut ProxyState, name: &str) {
    let key = ObjectKey {
        namespace: "web".into(),
        name: name.into(),
    };
    state
        .apply(SourceEvent::Delete(Kind::Service, key))
        .expect("deleted");
}

/// Sets the endpoints of Service `web/<service>`, port `dns` (UDP and TCP) 5353.
fn set_endpoints(state: &mut ProxyState, service: &str, family: &str, addrs: &[IpAddr]) {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}, "nodeName": "lab-node"}))
        .collect();
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {
            "namespace": "web",
            "name": format!("{service}-{}", family.to_lowercase()),
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": family,
        "endpoints": endpoints,
        "ports": [
            {"name": "dns", "port": BACKEND_PORT, "protocol": "UDP"},
            {"name": "dns-tcp", "port": BACKEND_PORT, "protocol": "TCP"},
        ],
    }))
    .expect("EndpointSlice JSON");
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .expect("EndpointSlice accepted");
}

/// All entries of the node, both families, UDP, TCP and SCTP.
fn entries(ct: &Conntrack) -> Vec<FlowEntry> {
    let mut out = Vec::new();
    for family in IpFamily::ALL {
        for protocol in Protocol::ALL {
            out.extend(ct.list(family, protocol).expect("list"));
        }
    }
    out
}

/// The entry of the client flow from `sport` to `dst`, if the kernel still has it.
fn flow<'a>(
    all: &'a [FlowEntry],
    protocol: Protocol,
    dst: &str,
    sport: u16,
) -> Option<&'a FlowEntry> {
    all.iter()
        .find(|e| e.protocol == protocol && e.orig_dst == ip(dst) && e.orig_sport == sport)
}

#[test]
fn a_removed_endpoint_loses_its_udp_flows_and_other_flows_stay() {
    if !require_root() {
        return;
    }
    let (lab, _servers) = lab();
    let (pod0, pod1, pod0_6, pod1_6) =
        (lab.pod_ip(0), lab.pod_ip(1), lab.pod_ip6(0), lab.pod_ip6(1));
    let node_ip = NODE_IP.to_string();
    let dataplane = |to: IpAddr, to6: IpAddr| {
        vec![
            dnat("udp", "10.96.0.10", 53, to),
            dnat("tcp", "10.96.0.10", 53, to),
            dnat("udp", "fd00:10:96::10", 53, to6),
            dnat("udp", &node_ip, 30053, to),
            dnat("udp", FOREIGN_VIP, 53, pod0),
        ]
    };
    program(&lab, &dataplane(pod0, pod0_6));
    let mut state = new_state();
    upsert_service(
        &mut state,
        "dns",
        json!({
            "type": "NodePort",
            "clusterIPs": ["10.96.0.10", "fd00:10:96::10"],
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "nodePort": 30053},
            ],
        }),
    );
    set_endpoints(&mut state, "dns", "IPv4", &[pod0]);
    set_endpoints(&mut state, "dns", "IPv6", &[pod0_6]);
    let mut planner = ConntrackPlanner::new();
    planner.update(&state, BOTH);

    let flows = [
        (Proto::Udp, Protocol::Udp, "10.96.0.10", 53, 40001),
        (Proto::Udp, Protocol::Udp, "fd00:10:96::10", 53, 40002),
        (Proto::Udp, Protocol::Udp, node_ip.as_str(), 30053, 40003),
        (Proto::Tcp, Protocol::Tcp, "10.96.0.10", 53, 40004),
        (Proto::Udp, Protocol::Udp, FOREIGN_VIP, 53, 40005),
    ];
    for (proto, _, dst, port, sport) in flows {
        assert_eq!(
            answered_by(&send(&lab, proto, dst, port, sport)),
            "pod-0",
            "{dst}:{port}"
        );
    }
    let ct = Conntrack::in_netns(lab.node().name());
    let before = entries(&ct);
    for (_, protocol, dst, _, sport) in flows {
        assert!(
            flow(&before, protocol, dst, sport).is_some(),
            "no entry for {dst} from {sport}: {before:?}"
        );
    }
    let to_pod0 = flow(&before, Protocol::Udp, "10.96.0.10", 40001).expect("entry");
    assert_eq!(
        (to_pod0.reply_src, to_pod0.reply_sport),
        (pod0, BACKEND_PORT)
    );

    // Nothing changed: nothing is stale.
    assert_eq!(
        ct.reconcile(&mut planner, &node_addrs())
            .expect("reconcile"),
        0
    );
    assert_eq!(entries(&ct).len(), before.len());

    // pod-0 leaves the Service; the dataplane now sends new flows to pod-1.
    program(&lab, &dataplane(pod1, pod1_6));
    set_endpoints(&mut state, "dns", "IPv4", &[pod1]);
    set_endpoints(&mut state, "dns", "IPv6", &[pod1_6]);
    planner.update(&state, BOTH);
    // The kernel keeps translating the old flow to pod-0: this is what the reconciler is for.
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.10", 53, 40001)),
        "pod-0"
    );

    assert_eq!(
        ct.reconcile(&mut planner, &node_addrs())
            .expect("reconcile"),
        3
    );
    let after = entries(&ct);
    for (_, protocol, dst, _, sport) in &flows[..3] {
        assert!(
            flow(&after, *protocol, dst, *sport).is_none(),
            "{dst} from {sport} survived"
        );
    }
    // TCP entries and other translations are not the reconciler's.
    for (_, protocol, dst, _, sport) in &flows[3..] {
        assert!(
            flow(&after, *protocol, dst, *sport).is_some(),
            "{dst} from {sport} was deleted"
        );
    }
    // The same client socket now reaches the remaining endpoint.
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.10", 53, 40001)),
        "pod-1"
    );
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "fd00:10:96::10", 53, 40002)),
        "pod-1"
    );
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, &node_ip, 30053, 40003)),
        "pod-1"
    );
}

#[test]
fn flows_that_met_a_service_without_endpoints_are_translated_once_it_has_one() {
    if !require_root() {
        return;
    }
    let (lab, _servers) = lab();
    let pod0 = lab.pod_ip(0);
    // No endpoint: no translation (the window upstream's "0 to N endpoints" case is about).
    program(&lab, &[dnat("udp", FOREIGN_VIP, 53, pod0)]);
    let mut state = new_state();
    upsert_service(
        &mut state,
        "empty",
        json!({"clusterIP": "10.96.0.30", "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}),
    );
    let mut planner = ConntrackPlanner::new();
    planner.update(&state, BOTH);
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.30", 53, 40011)),
        "nobody"
    );
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, FOREIGN_VIP, 53, 40012)),
        "pod-0"
    );
    let ct = Conntrack::in_netns(lab.node().name());
    let untranslated = flow(&entries(&ct), Protocol::Udp, "10.96.0.30", 40011)
        .cloned()
        .expect("entry");
    assert_eq!(untranslated.reply_src, ip("10.96.0.30"));

    // Still no endpoint: the entry stays.
    assert_eq!(
        ct.reconcile(&mut planner, &node_addrs())
            .expect("reconcile"),
        0
    );
    assert!(flow(&entries(&ct), Protocol::Udp, "10.96.0.30", 40011).is_some());

    // An endpoint appears and the dataplane translates new flows to it...
    program(
        &lab,
        &[
            dnat("udp", "10.96.0.30", 53, pod0),
            dnat("udp", FOREIGN_VIP, 53, pod0),
        ],
    );
    set_endpoints(&mut state, "empty", "IPv4", &[pod0]);
    planner.update(&state, BOTH);
    // ...but not the client's existing flow, until its entry goes.
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.30", 53, 40011)),
        "nobody"
    );
    assert_eq!(
        ct.reconcile(&mut planner, &node_addrs())
            .expect("reconcile"),
        1
    );
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.30", 53, 40011)),
        "pod-0"
    );
    assert!(flow(&entries(&ct), Protocol::Udp, FOREIGN_VIP, 40012).is_some());
}

#[test]
fn flows_to_a_deleted_service_are_deleted() {
    if !require_root() {
        return;
    }
    let (lab, _servers) = lab();
    let pod0 = lab.pod_ip(0);
    program(
        &lab,
        &[
            dnat("udp", "10.96.0.40", 53, pod0),
            dnat("udp", FOREIGN_VIP, 53, pod0),
        ],
    );
    let mut state = new_state();
    upsert_service(
        &mut state,
        "gone",
        json!({"clusterIP": "10.96.0.40", "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}),
    );
    set_endpoints(&mut state, "gone", "IPv4", &[pod0]);
    let mut planner = ConntrackPlanner::new();
    planner.update(&state, BOTH);
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.40", 53, 40021)),
        "pod-0"
    );
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, FOREIGN_VIP, 53, 40022)),
        "pod-0"
    );

    delete_service(&mut state, "gone");
    program(&lab, &[dnat("udp", FOREIGN_VIP, 53, pod0)]);
    planner.update(&state, BOTH);
    // The deleted Service's flow still reaches its old endpoint.
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.40", 53, 40021)),
        "pod-0"
    );

    let ct = Conntrack::in_netns(lab.node().name());
    assert_eq!(
        ct.reconcile(&mut planner, &node_addrs())
            .expect("reconcile"),
        1
    );
    let after = entries(&ct);
    assert!(flow(&after, Protocol::Udp, "10.96.0.40", 40021).is_none());
    assert!(flow(&after, Protocol::Udp, FOREIGN_VIP, 40022).is_some());
    // Cleaned up: the planner no longer needs to remember it.
    assert_eq!(planner.forgotten().count(), 0);
    assert_eq!(
        answered_by(&send(&lab, Proto::Udp, "10.96.0.40", 53, 40021)),
        "nobody"
    );
}

/// Inserts an entry with `conntrack -I` inside the namespace (test setup only).
fn insert(ns: &kp_test::Netns, args: &[&str]) -> Result<(), String> {
    let mut argv = vec!["conntrack", "-I"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["-t", "120"]);
    ns.run(&argv).map(drop).map_err(|e| e.to_string())
}

#[test]
fn sctp_entries_are_listed_and_stale_ones_deleted() {
    if !require_root() {
        return;
    }
    let ns = kp_test::Netns::new("ct-sctp").expect("netns");
    let sctp = |sport: &str, reply_src: &str| {
        insert(
            &ns,
            &[
                "-p",
                "sctp",
                "-s",
                "192.0.2.2",
                "-d",
                "10.96.0.50",
                "--sport",
                sport,
                "--dport",
                "53",
                "-r",
                reply_src,
                "-q",
                "192.0.2.2",
                "--reply-port-src",
                "5353",
                "--reply-port-dst",
                sport,
                "--state",
                "ESTABLISHED",
                "--orig-vtag",
                "1",
                "--reply-vtag",
                "2",
            ],
        )
    };
    if let Err(e) = sctp("40031", "10.244.1.10") {
        let banner = "!".repeat(72);
        eprintln!("\n{banner}\n!! SKIPPED: this kernel cannot track SCTP ({e})\n{banner}\n");
        return;
    }
    sctp("40032", "10.244.1.11").expect("second SCTP entry");
    let mut state = new_state();
    upsert_service(
        &mut state,
        "sctp",
        json!({"clusterIP": "10.96.0.50", "ports": [{"name": "dns", "port": 53, "protocol": "SCTP"}]}),
    );
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"namespace": "web", "name": "sctp-ipv4", "labels": {"kubernetes.io/service-name": "sctp"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.244.1.11"], "conditions": {"ready": true}}],
        "ports": [{"name": "dns", "port": 5353, "protocol": "SCTP"}],
    }))
    .expect("slice");
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .expect("slice accepted");
    let mut planner = ConntrackPlanner::new();
    planner.update(&state, BOTH);

    let ct = Conntrack::in_netns(ns.name());
    let listed = ct.list(IpFamily::V4, Protocol::Sctp).expect("list");
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(ct
        .list(IpFamily::V4, Protocol::Udp)
        .expect("list")
        .is_empty());
    assert_eq!(
        ct.reconcile(&mut planner, &node_addrs())
            .expect("reconcile"),
        1
    );
    let left = ct.list(IpFamily::V4, Protocol::Sctp).expect("list");
    assert_eq!(left.len(), 1);
    assert_eq!(
        (left[0].orig_sport, left[0].reply_src),
        (40032, ip("10.244.1.11"))
    );
}

#[test]
fn listing_reads_both_tuples_and_deleting_twice_is_not_an_error() {
    if !require_root() {
        return;
    }
    let ns = kp_test::Netns::new("ct-list").expect("netns");
    insert(
        &ns,
        &[
            "-p",
            "udp",
            "-s",
            "2001:db8::2",
            "-d",
            "fd00:10:96::10",
            "--sport",
            "40041",
            "--dport",
            "53",
            "-r",
            "fd00:10:244:1::10",
            "-q",
            "2001:db8::2",
            "--reply-port-src",
            "5353",
            "--reply-port-dst",
            "40041",
        ],
    )
    .expect("conntrack -I");
    insert(
        &ns,
        &[
            "-p",
            "udp",
            "-s",
            "192.0.2.2",
            "-d",
            "10.96.0.10",
            "--sport",
            "40042",
            "--dport",
            "53",
            "-r",
            "10.244.1.10",
            "-q",
            "192.0.2.2",
            "--reply-port-src",
            "5353",
            "--reply-port-dst",
            "40042",
            "--zone",
            "7",
        ],
    )
    .expect("conntrack -I");
    let ct = Conntrack::in_netns(ns.name());
    let v6 = ct.list(IpFamily::V6, Protocol::Udp).expect("list");
    assert_eq!(v6.len(), 1, "{v6:?}");
    let e = &v6[0];
    assert_eq!(
        (
            e.protocol,
            e.orig_src,
            e.orig_dst,
            e.orig_sport,
            e.orig_dport,
            e.reply_src,
            e.reply_sport,
            e.zone
        ),
        (
            Protocol::Udp,
            ip("2001:db8::2"),
            ip("fd00:10:96::10"),
            40041,
            53,
            ip("fd00:10:244:1::10"),
            5353,
            0
        )
    );
    assert!(e.id.is_some());
    let v4 = ct.list(IpFamily::V4, Protocol::Udp).expect("list");
    assert_eq!(v4.len(), 1, "{v4:?}");
    assert_eq!(v4[0].zone, 7);
    assert!(ct
        .list(IpFamily::V4, Protocol::Tcp)
        .expect("list")
        .is_empty());

    let all: Vec<FlowEntry> = v4.iter().chain(&v6).cloned().collect();
    assert_eq!(ct.delete(&all).expect("delete"), 2);
    assert_eq!(ct.delete(&all).expect("delete again"), 0);
    assert!(ct
        .list(IpFamily::V6, Protocol::Udp)
        .expect("list")
        .is_empty());
    assert!(ct
        .list(IpFamily::V4, Protocol::Udp)
        .expect("list")
        .is_empty());
}

#[test]
fn a_delete_carries_the_entry_id_and_spares_an_entry_with_another() {
    if !require_root() {
        return;
    }
    let ns = kp_test::Netns::new("ct-id").expect("netns");
    let args = [
        "-p",
        "udp",
        "-s",
        "192.0.2.2",
        "-d",
        "10.96.0.10",
        "--sport",
        "40051",
        "--dport",
        "53",
        "-r",
        "10.244.1.10",
        "-q",
        "192.0.2.2",
        "--reply-port-src",
        "5353",
        "--reply-port-dst",
        "40051",
    ];
    insert(&ns, &args).expect("conntrack -I");
    let ct = Conntrack::in_netns(ns.name());
    let listed = ct.list(IpFamily::V4, Protocol::Udp).expect("list");
    assert_eq!(listed.len(), 1);
    let id = listed[0].id.expect("the kernel reports ids");
    // What a delete looks like when a newer entry took the tuple between list and delete.
    let other = FlowEntry {
        id: Some(id ^ 1),
        ..listed[0].clone()
    };
    assert_eq!(ct.delete(&[other]).expect("delete"), 0);
    assert_eq!(ct.list(IpFamily::V4, Protocol::Udp).expect("list").len(), 1);
    assert_eq!(ct.delete(&listed).expect("delete"), 1);
    assert!(ct
        .list(IpFamily::V4, Protocol::Udp)
        .expect("list")
        .is_empty());
}

#[test]
fn a_missing_namespace_is_a_socket_error() {
    let ct = Conntrack::in_netns("kpt-no-such-namespace");
    let err = ct
        .list(IpFamily::V4, Protocol::Udp)
        .expect_err("no namespace");
    assert!(matches!(err, kp_conntrack::Error::Socket { .. }), "{err}");
    let bad = Conntrack::in_netns("../etc");
    assert!(matches!(
        bad.list(IpFamily::V4, Protocol::Udp),
        Err(kp_conntrack::Error::Socket { .. })
    ));
}

#[test]
fn ten_thousand_stale_entries_go_in_one_reconcile_and_the_rest_stay() {
    if !require_root() {
        return;
    }
    const SERVICES: usize = 200;
    const PER_KIND: usize = 10_000;
    let ns = kp_test::Netns::new("ct-scale").expect("netns");
    // UDP flows to 200 ClusterIPs: even ones to the serving endpoint 10.244.1.10, odd ones to
    // 10.244.1.11, which serves nothing; and as many TCP flows. Loaded with `conntrack -R`.
    let mut lines = String::new();
    for i in 0..2 * PER_KIND {
        let (src, sport) = (format!("192.0.2.{}", 2 + i / 50_000), 10_000 + i % 50_000);
        let svc = format!("10.96.0.{}", 1 + i % SERVICES);
        let ep = format!("10.244.1.{}", 10 + i % 2);
        lines.push_str(&format!(
            "-I -p udp -s {src} -d {svc} --sport {sport} --dport 53 -r {ep} -q {src} \
             --reply-port-src 5353 --reply-port-dst {sport} -t 600\n"
        ));
    }
    for i in 0..PER_KIND {
        let sport = 10_000 + i;
        lines.push_str(&format!(
            "-I -p tcp -s 192.0.2.9 -d 10.96.0.1 --sport {sport} --dport 53 -r 10.244.1.11 \
             -q 192.0.2.9 --reply-port-src 5353 --reply-port-dst {sport} --state ESTABLISHED -t 600\n"
        ));
    }
    let path = std::env::temp_dir().join(format!("{}.ct", ns.name()));
    std::fs::write(&path, lines).expect("write entries");
    let loaded = ns.run(&["conntrack", "-R", path.to_str().expect("utf-8 path")]);
    let _ = std::fs::remove_file(&path);
    loaded.expect("conntrack -R");

    let mut state = new_state();
    for s in 1..=SERVICES {
        let name = format!("svc-{s}");
        upsert_service(
            &mut state,
            &name,
            json!({"clusterIP": format!("10.96.0.{s}"), "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            ]}),
        );
        set_endpoints(&mut state, &name, "IPv4", &[ip("10.244.1.10")]);
    }
    let mut planner = ConntrackPlanner::new();
    planner.update(&state, BOTH);

    let ct = Conntrack::in_netns(ns.name());
    let start = std::time::Instant::now();
    let deleted = ct
        .reconcile(&mut planner, &node_addrs())
        .expect("reconcile");
    let took = start.elapsed();
    eprintln!(
        "reconcile of {} UDP + {PER_KIND} TCP entries: {deleted} deleted in {took:?}",
        2 * PER_KIND
    );
    assert_eq!(deleted, PER_KIND);
    let udp = ct.list(IpFamily::V4, Protocol::Udp).expect("list");
    assert_eq!(udp.len(), PER_KIND);
    assert!(udp.iter().all(|e| e.reply_src == ip("10.244.1.10")));
    assert_eq!(
        ct.list(IpFamily::V4, Protocol::Tcp).expect("list").len(),
        PER_KIND
    );
    // A second pass finds nothing more.
    assert_eq!(
        ct.reconcile(&mut planner, &node_addrs())
            .expect("reconcile"),
        0
    );
}

#[test]
fn closed_tcp_entries_are_listed_apart_from_open_ones() {
    if !require_root() {
        return;
    }
    let ns = kp_test::Netns::new("ct-closed").expect("netns");
    let tcp = |sport: &str, state: &str| {
        insert(
            &ns,
            &[
                "-p",
                "tcp",
                "-s",
                "192.0.2.2",
                "-d",
                "10.96.0.10",
                "--sport",
                sport,
                "--dport",
                "80",
                "-r",
                "10.244.1.10",
                "-q",
                "192.0.2.2",
                "--reply-port-src",
                "8080",
                "--reply-port-dst",
                sport,
                "--state",
                state,
            ],
        )
        .unwrap_or_else(|e| panic!("inserting a {state} entry: {e}"))
    };
    tcp("40001", "ESTABLISHED");
    tcp("40002", "TIME_WAIT");
    tcp("40003", "CLOSE");
    tcp("40004", "FIN_WAIT");
    tcp("40005", "CLOSE_WAIT");
    let ct = Conntrack::in_netns(ns.name());
    assert_eq!(ct.list(IpFamily::V4, Protocol::Tcp).expect("list").len(), 5);
    let mut closed: Vec<u16> = ct
        .list_closed_tcp(IpFamily::V4)
        .expect("list closed")
        .iter()
        .map(|e| e.orig_sport)
        .collect();
    closed.sort();
    // Half-closed connections (FIN_WAIT, CLOSE_WAIT) may still carry data: not closed.
    assert_eq!(closed, [40002, 40003]);
    assert!(ct.list_closed_tcp(IpFamily::V6).expect("list").is_empty());
}
