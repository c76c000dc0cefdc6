//! The periodic drift check off the sync loop ([`NftablesDataplane::begin_check`]) against a
//! real kernel: drift injected behind the dataplane's back is still found and repaired, and the
//! dataplane's own writes while the read runs are never taken for drift.

use kp_core::dataplane::CheckOutcome;
use kp_core::track::{Changes, Object, ProxyState, SourceEvent};
use kp_nftables::NftablesDataplane;
use kp_test::lab::Lab;

mod common;
use common::{assert_in_sync, dataplane};

/// Runs one check the way the loop does, with `meanwhile` between the read and the comparison
/// (what the loop does while the read runs on its thread).
fn check(
    dp: &mut NftablesDataplane,
    state: &mut ProxyState,
    meanwhile: impl FnOnce(&mut NftablesDataplane, &mut ProxyState),
) -> CheckOutcome {
    let read = dp
        .begin_check()
        .expect("the netlink backend reads off the loop");
    let read = std::thread::spawn(read).join().expect("the read");
    meanwhile(dp, state);
    kp_core::dataplane::Dataplane::finish_check(dp, state, read)
}

/// Deletes every element of set `set` of the node's `ip kube-proxy` table, as someone else
/// might.
fn flush_set(lab: &Lab, set: &str) {
    lab.node()
        .run(&["nft", "flush", "set", "ip", "kube-proxy", set])
        .expect("nft flush set");
}

/// A programmed dataplane over the flow table's state.
fn programmed(lab: &Lab) -> (NftablesDataplane, ProxyState) {
    let mut dp = dataplane(lab);
    let state = kp_flows::state();
    dp.sync(&state, &Changes::default(), true)
        .expect("first sync");
    assert_in_sync(&mut dp);
    (dp, state)
}

/// One endpoint of the web Service goes: a partial sync.
fn change_endpoints(dp: &mut NftablesDataplane, state: &mut ProxyState) {
    let slice = kp_flows::web_slice(&["pod-1"]);
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .unwrap();
    let changes = state.take_changes();
    let report = dp.sync(state, &changes, false).expect("partial sync");
    assert!(!report.full && report.operations > 0);
}

#[test]
#[ignore = "needs root"]
fn drift_injected_behind_the_dataplanes_back_is_found_off_the_loop_and_repaired() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let (mut dp, mut state) = programmed(&lab);
    assert_eq!(check(&mut dp, &mut state, |_, _| {}), CheckOutcome::Clean);

    flush_set(&lab, kp_nftables_plan::names::CLUSTER_IPS);
    let outcome = check(&mut dp, &mut state, |_, _| {});
    let CheckOutcome::Drift(diffs) = outcome else {
        panic!("nothing was committed during the read: the drift is certain: {outcome:?}");
    };
    assert!(diffs.iter().any(|d| d.contains("cluster-ips")), "{diffs:?}");
    // The loop's repair: a full sync, which adopts the table and sends what differs.
    let report = dp.sync(&state, &Changes::default(), true).expect("repair");
    assert!(report.full && report.operations > 0, "{report:?}");
    assert_in_sync(&mut dp);
    assert_eq!(check(&mut dp, &mut state, |_, _| {}), CheckOutcome::Clean);
}

#[test]
#[ignore = "needs root"]
fn the_dataplanes_own_writes_during_the_read_are_not_drift_but_anything_else_is() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let (mut dp, mut state) = programmed(&lab);

    // The read sees the table before a change; the comparison happens after it.
    let outcome = check(&mut dp, &mut state, change_endpoints);
    assert_eq!(outcome, CheckOutcome::Clean);
    assert_in_sync(&mut dp);

    // The same, over drift of another set behind the dataplane's back: something was
    // committed after the read began, so the check is unsure, and a second read finds the
    // drift for certain.
    flush_set(&lab, kp_nftables_plan::names::CLUSTER_IPS);
    let outcome = check(&mut dp, &mut state, |dp, state| {
        let slice = kp_flows::web_slice(&["pod-1", "pod-2"]);
        state
            .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
            .unwrap();
        let changes = state.take_changes();
        dp.sync(state, &changes, false).expect("partial sync");
    });
    assert!(
        matches!(&outcome, CheckOutcome::Unsure(d) if d.iter().any(|d| d.contains("cluster-ips"))),
        "{outcome:?}"
    );
    let outcome = check(&mut dp, &mut state, |_, _| {});
    assert!(matches!(outcome, CheckOutcome::Drift(_)), "{outcome:?}");
    dp.sync(&state, &Changes::default(), true).expect("repair");
    assert_in_sync(&mut dp);
}

/// The `ip kube-proxy` table as the kernel holds it, every set of ours read in full.
fn read_ip_table(lab: &Lab) -> kp_nftables::KernelTable {
    use kp_nftables_plan::{SetId, SetSchema};
    let schema = |name: &str| {
        SetId::from_name(name)
            .filter(|id| !id.is_dynamic())
            .map(SetSchema::of)
    };
    kp_nftables::netlink::read_table(
        kp_core::model::IpFamily::V4,
        Some(lab.node().name()),
        &schema,
    )
    .expect("read the table")
}

/// Runs `script` (nft commands separated by `;`) in the node's namespace, behind the
/// dataplane's back.
fn nft(lab: &Lab, script: &str) {
    lab.node().run(&["nft", script]).expect(script);
}

/// The one difference a check found for certain, which must name `set`.
fn the_drift(outcome: CheckOutcome, set: &str) -> String {
    let CheckOutcome::Drift(diffs) = outcome else {
        panic!("nothing was committed during the read: the drift is certain: {outcome:?}");
    };
    assert_eq!(diffs.len(), 1, "{diffs:?}");
    assert!(diffs[0].contains(&format!("set {set}:")), "{diffs:?}");
    diffs.into_iter().next().unwrap()
}

/// The check compares digests, not elements: one element missing, one extra, and one with
/// another value are each found, counted and named, and the repair ends the drift.
#[test]
#[ignore = "needs root"]
fn the_digest_check_finds_a_missing_an_extra_and_a_changed_element_and_names_each() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let (mut dp, mut state) = programmed(&lab);
    let table = read_ip_table(&lab);
    let cluster_ips = kp_nftables_plan::names::CLUSTER_IPS;

    // Missing: one ClusterIP deleted.
    let (gone, _) = table.sets[cluster_ips]
        .iter()
        .next()
        .expect("the fixture has ClusterIPs");
    nft(
        &lab,
        &format!("delete element ip kube-proxy {cluster_ips} {{ {gone} }}"),
    );
    let d = the_drift(check(&mut dp, &mut state, |_, _| {}), cluster_ips);
    assert!(
        d.contains("1 elements missing, 0 with another value, 0 extra")
            && d.contains(&format!("(e.g. {gone} missing)")),
        "{d}"
    );
    dp.sync(&state, &Changes::default(), true).expect("repair");
    assert_eq!(check(&mut dp, &mut state, |_, _| {}), CheckOutcome::Clean);

    // Extra: an address no Service has, added; named from the set read again.
    nft(
        &lab,
        &format!("add element ip kube-proxy {cluster_ips} {{ 10.96.123.45 }}"),
    );
    let d = the_drift(check(&mut dp, &mut state, |_, _| {}), cluster_ips);
    assert!(
        d.contains("0 elements missing, 0 with another value, 1 extra")
            && d.contains("(e.g. extra 10.96.123.45)"),
        "{d}"
    );
    dp.sync(&state, &Changes::default(), true).expect("repair");
    assert_eq!(check(&mut dp, &mut state, |_, _| {}), CheckOutcome::Clean);

    // Another value: one endpoint-map element made to point at another slot's endpoint.
    let (map, (key, other)) = table
        .sets
        .iter()
        .filter(|(name, _)| name.ends_with("-endpoints"))
        .find_map(|(name, els)| {
            let (k, v) = els.iter().next()?;
            let other = els.values().flatten().find(|o| Some(*o) != v.as_ref())?;
            Some((name.clone(), (k.clone(), other.clone())))
        })
        .expect("an endpoint map with two endpoints");
    nft(
        &lab,
        &format!(
            "delete element ip kube-proxy {map} {{ {key} }}; add element ip kube-proxy {map} {{ {key} : {other} }}"
        ),
    );
    let d = the_drift(check(&mut dp, &mut state, |_, _| {}), &map);
    assert!(
        d.contains("0 elements missing, 1 with another value, 0 extra")
            && d.contains(&format!("(e.g. {key} has another value)")),
        "{d}"
    );
    dp.sync(&state, &Changes::default(), true).expect("repair");
    assert_in_sync(&mut dp);
    assert_eq!(check(&mut dp, &mut state, |_, _| {}), CheckOutcome::Clean);
}

/// A key the dataplane writes while the read runs is left out on both sides, even where the
/// read saw the kernel differ from the plan for it; a difference elsewhere is still found.
#[test]
#[ignore = "needs root"]
fn keys_written_during_the_read_are_left_out_even_where_the_read_saw_them_differ() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let (mut dp, mut state) = programmed(&lab);
    let table = read_ip_table(&lab);
    let cluster_ips = kp_nftables_plan::names::CLUSTER_IPS;

    // Behind the dataplane's back, before the read: the web Service's (10.96.0.10 TCP 80,
    // three endpoints) first slot made to point at its second slot's endpoint, and a
    // ClusterIP no Service has added.
    let (map, els) = table
        .sets
        .iter()
        .filter(|(name, _)| name.ends_with("-endpoints"))
        .map(|(name, els)| {
            let web: Vec<_> = els
                .iter()
                .filter(|(k, _)| k.to_string().starts_with("10.96.0.10 . tcp . 80 . "))
                .collect();
            (name, web)
        })
        .find(|(_, web)| web.len() == 3)
        .expect("the web Service's endpoint-map elements");
    let (key, _) = els[0];
    let other = els[1].1.as_ref().expect("an endpoint");
    nft(
        &lab,
        &format!(
            "delete element ip kube-proxy {map} {{ {key} }}; add element ip kube-proxy {map} {{ {key} : {other} }}; add element ip kube-proxy {cluster_ips} {{ 10.96.123.45 }}"
        ),
    );
    // While the read runs, the dataplane rewrites the web Service's keys (one endpoint is left:
    // its dispatch moves to another class, so every element of its old one is deleted).
    let outcome = check(&mut dp, &mut state, change_endpoints);
    // A commit happened after the read began, so the check is unsure; the one difference is
    // the untouched ClusterIP, not the rewritten endpoint map.
    let CheckOutcome::Unsure(diffs) = outcome else {
        panic!("a commit happened during the read: {outcome:?}");
    };
    assert_eq!(diffs.len(), 1, "{diffs:?}");
    assert!(
        diffs[0].contains(&format!("set {cluster_ips}: 0 elements missing, 0 with another value, 1 extra (e.g. extra 10.96.123.45)")),
        "{diffs:?}"
    );
    // The loop's answer to an unsure check that stays unsure: a full sync, whose own check
    // (in line, on digests) finds the extra ClusterIP and repairs it.
    let report = dp.sync(&state, &Changes::default(), true).expect("repair");
    assert!(report.full && report.operations > 0, "{report:?}");
    assert_in_sync(&mut dp);
    assert_eq!(check(&mut dp, &mut state, |_, _| {}), CheckOutcome::Clean);
}
