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
