//! A restarted proxy over the table its predecessor left: the first (full) sync adopts the table
//! and sends only what differs, keeps the ClientIP affinity choices the packet path wrote, and
//! leaves the kernel equal to the plan; a table of another structure is replaced instead.
//!
//! Each test builds its own lab of network namespaces (deleted when it ends). Run as root:
//! `cargo test -p kp-nftables --test restart -- --include-ignored`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::dataplane::SyncReport;
use kp_core::model::IpFamily;
use kp_core::track::{Changes, Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_nftables::netlink::{self, SetSchema};
use kp_nftables::NftablesDataplane;
use kp_nftables_plan::element::Tuple;
use kp_nftables_plan::SetId;
use kp_test::echo::{tally, Proto, Request};
use kp_test::lab::Lab;
use serde_json::json;

mod common;
use common::{assert_in_sync, dataplane};

/// A new process's first sync: full, over whatever the kernel holds.
fn restart(lab: &Lab, state: &ProxyState) -> (NftablesDataplane, SyncReport) {
    let mut dp = dataplane(lab);
    let report = dp
        .sync(state, &Changes::default(), true)
        .expect("first sync after the restart");
    assert!(report.full, "a restarted proxy's first sync is full");
    (dp, report)
}

/// The ClientIP affinity choices the kernel remembers for timeout `t` (IPv4).
fn affinity(lab: &Lab, t: u32) -> BTreeMap<Tuple, Option<Tuple>> {
    netlink::read_set(
        IpFamily::V4,
        Some(lab.node().name()),
        &SetId::Affinity(t).name(),
        &SetSchema::of(SetId::Affinity(t)),
    )
    .expect("read the affinity map")
    .unwrap_or_default()
}

/// The number of element changes the last transaction sent over netlink (0 if none).
fn netlink_elements(dp: &NftablesDataplane) -> usize {
    dp.last_transaction()
        .lines()
        .find_map(|l| l.strip_prefix("# netlink: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn upsert(state: &mut ProxyState, o: Object) {
    state.apply(SourceEvent::Upsert(o)).expect("valid object");
}

/// A Service nothing else in the fixture resembles: seven endpoints (a class of its own,
/// `vips-7`) and ClientIP affinity of 77 s (an affinity timeout of its own).
fn lonely_service() -> [Object; 2] {
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "lonely", "namespace": "restart"},
        "spec": {"clusterIP": "10.96.0.77", "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 77}},
            "ports": [{"protocol": "TCP", "port": 80, "targetPort": 8080}]},
    }))
    .unwrap();
    let endpoints: Vec<_> = (1..=7)
        .map(|i| json!({"addresses": [format!("10.244.2.{}", 100 + i)], "conditions": {"ready": true}, "nodeName": kp_flows::OTHER_NODE}))
        .collect();
    let slice: EndpointSlice = serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "lonely-abcde", "namespace": "restart",
            "labels": {"kubernetes.io/service-name": "lonely"}},
        "addressType": "IPv4", "ports": [{"protocol": "TCP", "port": 8080}],
        "endpoints": endpoints,
    }))
    .unwrap();
    [
        Object::Service(Box::new(svc)),
        Object::EndpointSlice(Box::new(slice)),
    ]
}

#[test]
#[ignore = "needs root"]
fn a_restart_over_an_unchanged_table_sends_nothing_and_keeps_affinity_choices() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let state = kp_flows::state();
    let mut before = dataplane(&lab);
    before
        .sync(&state, &Changes::default(), true)
        .expect("first sync");
    // A client of the ClientIP-affinity Service: the packet path remembers its choice.
    let sticky = "10.96.0.30".parse().unwrap();
    let seen = tally(&lab.send(lab.pod(4), &Request::new(Proto::Tcp, sticky, 80).count(3)));
    assert_eq!(seen.len(), 1, "affinity holds before the restart: {seen:?}");
    let remembered = affinity(&lab, 60);
    assert!(
        !remembered.is_empty(),
        "the packet path wrote no affinity entry"
    );
    drop(before);

    let (mut dp, report) = restart(&lab, &state);
    assert_eq!(
        report.operations,
        0,
        "nothing differs, so nothing is sent:\n{}",
        dp.last_transaction()
    );
    assert!(
        !dp.last_transaction().contains("delete table"),
        "the table was replaced:\n{}",
        dp.last_transaction()
    );
    assert_eq!(netlink_elements(&dp), 0, "{}", dp.last_transaction());
    assert_in_sync(&mut dp);
    let kept = affinity(&lab, 60);
    for (k, v) in &remembered {
        assert_eq!(kept.get(k), Some(v), "affinity entry {k} was lost");
    }
    let again = tally(&lab.send(lab.pod(4), &Request::new(Proto::Tcp, sticky, 80).count(3)));
    assert_eq!(
        again, seen,
        "the client sticks to the same pod across the restart"
    );
    kp_test::flows::assert_all(&lab);

    // Adopted means programmed: the next change is a partial sync.
    let mut state = state;
    upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2"]))),
    );
    let changes = state.take_changes();
    let report = dp.sync(&state, &changes, false).expect("partial sync");
    assert!(!report.full, "the sync after adopting is partial");
    assert!(report.operations > 0 && report.operations <= 20);
    assert_in_sync(&mut dp);
}

#[test]
#[ignore = "needs root"]
fn a_restart_after_changes_made_while_down_sends_only_the_difference() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    // What the previous process programmed: the fixture with web's pod-4 still serving, a
    // Service "ext" not yet created, and a Service "lonely" in classes of its own.
    let mut old = kp_flows::state();
    upsert(
        &mut old,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&[
            "pod-1", "pod-2", "pod-3", "pod-4",
        ]))),
    );
    old.apply(SourceEvent::Delete(
        Kind::Service,
        ObjectKey {
            namespace: "default".into(),
            name: "ext".into(),
        },
    ))
    .expect("delete ext");
    for o in lonely_service() {
        upsert(&mut old, o);
    }
    let _ = old.take_changes();
    let mut before = dataplane(&lab);
    let full = before
        .sync(&old, &Changes::default(), true)
        .expect("first sync")
        .operations;
    assert!(
        before.last_transaction().contains("vips-7"),
        "lonely has a class of its own"
    );
    drop(before);

    // While no proxy ran: pod-4 left web, ext was created, lonely was deleted.
    let state = kp_flows::state();
    let (mut dp, report) = restart(&lab, &state);
    assert!(
        !dp.last_transaction().contains("delete table"),
        "the table was replaced:\n{}",
        dp.last_transaction()
    );
    // ext brings a class the old table lacks (a NodePort with 3 endpoints): its declarations
    // and rule go as text, the elements in the batch.
    let sent = netlink_elements(&dp);
    let text: Vec<&str> = dp
        .last_transaction()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect();
    assert!(
        text.iter().all(|l| l.contains("nodeports-3")) && text.len() == 3,
        "{}",
        dp.last_transaction()
    );
    assert!(
        sent > 0 && sent <= 40 && report.operations == sent + 3,
        "{sent} element changes, {} operations (a full sync is {full}):\n{}",
        report.operations,
        dp.last_transaction()
    );
    assert_in_sync(&mut dp);
    kp_test::flows::assert_all(&lab);
    // lonely's classes stay, empty, as a partial sync would leave them.
    let sets = lab
        .node()
        .run(&["nft", "list", "sets", "ip"])
        .expect("list sets");
    assert!(
        sets.contains("vips-7") && sets.contains("affinity-77-vips"),
        "{sets}"
    );
    assert!(dp
        .sync(&state, &Changes::default(), true)
        .is_ok_and(|r| !r.full && r.operations == 0));
}

#[test]
#[ignore = "needs root"]
fn a_table_of_another_structure_is_replaced_and_ends_equal_to_the_plan() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let state = kp_flows::state();
    dataplane(&lab)
        .sync(&state, &Changes::default(), true)
        .expect("first sync");

    // A chain nobody planned.
    lab.node()
        .run(&["nft", "add", "chain", "ip", "kube-proxy", "intruder"])
        .unwrap();
    let (mut dp, _) = restart(&lab, &state);
    assert!(
        dp.last_transaction().contains("delete table ip kube-proxy"),
        "an extra chain means another structure: replace"
    );
    assert_in_sync(&mut dp);
    let chains = lab
        .node()
        .run(&["nft", "list", "chains", "ip"])
        .expect("list chains");
    assert!(!chains.contains("intruder"), "{chains}");

    // A rule deleted behind our back.
    lab.node()
        .delete_nft_rule("ip", "kube-proxy", "masquerading", "hairpin")
        .unwrap();
    let (mut dp, _) = restart(&lab, &state);
    assert!(
        dp.last_transaction().contains("delete table ip kube-proxy"),
        "a missing rule means another structure: replace"
    );
    assert_in_sync(&mut dp);
    kp_test::flows::assert_all(&lab);

    // A table an older version left: no layout comment.
    lab.node()
        .run(&["nft", "delete", "table", "ip", "kube-proxy"])
        .unwrap();
    let text: String = dp
        .last_transaction()
        .lines()
        .map(|l| match l.split_once(" { comment ") {
            Some((add_table, _)) if l.starts_with("add table ") => format!("{add_table}\n"),
            _ => format!("{l}\n"),
        })
        .collect();
    assert!(!text.contains("layout"), "{}", &text[..300]);
    lab.node()
        .run(&["sh", "-c", &format!("nft -f - <<'EOF'\n{text}EOF")])
        .unwrap();
    let (mut dp, _) = restart(&lab, &state);
    assert!(
        dp.last_transaction().contains("delete table ip kube-proxy"),
        "a table without our layout comment is replaced"
    );
    assert_in_sync(&mut dp);
    // Replaced, it is ours again: the next restart adopts it.
    let (mut dp, report) = restart(&lab, &state);
    assert_eq!(report.operations, 0, "{}", dp.last_transaction());
    assert_in_sync(&mut dp);
}

#[test]
#[ignore = "needs root"]
fn tables_read_ahead_are_adopted_unless_the_kernel_changed_since() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = Lab::new(1).expect("lab");
    let state = kp_flows::state();
    dataplane(&lab)
        .sync(&state, &Changes::default(), true)
        .expect("first sync");

    let mut dp = dataplane(&lab);
    dp.read_ahead();
    let report = dp
        .sync(&state, &Changes::default(), true)
        .expect("sync over the tables read ahead");
    assert!(
        report.full && report.operations == 0,
        "{}",
        dp.last_transaction()
    );
    assert_in_sync(&mut dp);

    // Something changes the table after it was read: the read is stale, so the sync reads
    // again and repairs what changed.
    let mut dp = dataplane(&lab);
    dp.read_ahead();
    std::thread::sleep(std::time::Duration::from_millis(300));
    lab.node()
        .run(&[
            "nft",
            "delete",
            "element",
            "ip",
            "kube-proxy",
            "cluster-ips",
            "{ 10.96.0.10 }",
        ])
        .unwrap();
    let report = dp
        .sync(&state, &Changes::default(), true)
        .expect("sync after a change behind our back");
    assert_eq!(report.operations, 1, "{}", dp.last_transaction());
    assert_in_sync(&mut dp);
}
