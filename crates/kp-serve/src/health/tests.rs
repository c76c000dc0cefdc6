use super::*;
use std::time::UNIX_EPOCH;

const SYNC_PERIOD: Duration = Duration::from_secs(30);

/// A fixed instant, then offsets from it: no test reads the real clock.
fn t(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

fn v4() -> ProxyHealth {
    ProxyHealth::new(health_timeout(SYNC_PERIOD), [IpFamily::V4])
}

fn node(exists: bool, deleting: bool, to_be_deleted: bool) -> NodeInfo {
    NodeInfo {
        name: "node-a".into(),
        exists,
        deleting,
        to_be_deleted,
        ..NodeInfo::default()
    }
}

#[test]
fn health_timeout_is_two_sync_periods() {
    assert_eq!(health_timeout(SYNC_PERIOD), Duration::from_secs(60));
}

#[test]
fn a_fresh_proxy_is_healthy_with_nothing_to_report() {
    let s = v4().status(t(0));
    assert!(s.healthy);
    assert!(s.node_eligible);
    assert_eq!(s.last_updated, None);
    assert_eq!(s.current_time, t(0));
    assert!(s.families.is_empty());
}

#[test]
fn a_family_that_never_synced_stays_healthy_however_long_a_change_waits() {
    // Upstream only judges families present in lastUpdatedMap.
    let mut h = v4();
    h.queued_update(t(0));
    assert!(h.status(t(3600)).healthy);
}

#[test]
fn a_synced_proxy_is_healthy() {
    let mut h = v4();
    h.updated(t(0));
    let s = h.status(t(1000));
    assert!(s.healthy);
    assert_eq!(s.last_updated, Some(t(0)));
    assert_eq!(
        s.families.get(&IpFamily::V4),
        Some(&ProxierHealth {
            last_updated: t(0),
            healthy: true
        })
    );
}

#[test]
fn a_change_queued_for_less_than_the_timeout_is_not_late() {
    let mut h = v4();
    h.updated(t(0));
    h.queued_update(t(10));
    assert!(h.status(t(10 + 59)).healthy);
}

#[test]
fn a_change_queued_for_the_whole_timeout_makes_the_proxy_unhealthy() {
    let mut h = v4();
    h.updated(t(0));
    h.queued_update(t(10));
    let s = h.status(t(10 + 60));
    assert!(!s.healthy);
    assert!(!s.livez_ok());
    assert_eq!(
        s.families.get(&IpFamily::V4),
        Some(&ProxierHealth {
            last_updated: t(0),
            healthy: false
        })
    );
}

#[test]
fn only_the_oldest_queued_change_counts() {
    let mut h = v4();
    h.updated(t(0));
    h.queued_update(t(10));
    h.queued_update(t(50));
    assert!(
        !h.status(t(70)).healthy,
        "the clock started at the first queued change"
    );
}

#[test]
fn a_completed_sync_clears_the_queue_and_restores_health() {
    let mut h = v4();
    h.updated(t(0));
    h.queued_update(t(10));
    assert!(!h.status(t(100)).healthy);
    h.updated(t(101));
    let s = h.status(t(500));
    assert!(s.healthy);
    assert_eq!(s.last_updated, Some(t(101)));
}

#[test]
fn a_clock_that_steps_back_does_not_make_a_change_late() {
    let mut h = v4();
    h.updated(t(0));
    h.queued_update(t(100));
    assert!(h.status(t(50)).healthy);
}

#[test]
fn one_late_family_makes_the_whole_proxy_unhealthy() {
    let mut h = ProxyHealth::new(health_timeout(SYNC_PERIOD), [IpFamily::V6, IpFamily::V4]);
    assert_eq!(h.families(), &[IpFamily::V4, IpFamily::V6]);
    h.updated(t(0));
    h.updated_for(IpFamily::V6, t(5));
    h.queued_update_for(IpFamily::V4, t(10));
    let s = h.status(t(80));
    assert!(!s.healthy);
    assert!(!s.families[&IpFamily::V4].healthy);
    assert!(s.families[&IpFamily::V6].healthy);
    assert_eq!(
        s.last_updated,
        Some(t(5)),
        "the most recent sync of any family"
    );
}

#[test]
fn queued_update_and_updated_touch_every_configured_family() {
    let mut h = ProxyHealth::new(health_timeout(SYNC_PERIOD), IpFamily::ALL);
    h.updated(t(0));
    h.queued_update(t(1));
    let s = h.status(t(61));
    assert_eq!(s.families.len(), 2);
    assert!(s.families.values().all(|f| !f.healthy));
}

#[test]
fn the_node_is_eligible_until_seen_and_then_as_its_object_says() {
    let mut h = v4();
    assert!(h.node_eligible(), "start-up grace before the Node is seen");
    h.set_node(&node(true, false, false));
    assert!(h.node_eligible());
    h.set_node(&node(true, false, true));
    assert!(!h.node_eligible(), "ToBeDeletedByClusterAutoscaler");
    h.set_node(&node(true, true, false));
    assert!(!h.node_eligible(), "deletionTimestamp set");
    h.set_node(&node(false, false, false));
    assert!(!h.node_eligible(), "Node gone");
}

#[test]
fn an_ineligible_node_fails_healthz_but_not_livez() {
    let mut h = v4();
    h.updated(t(0));
    h.set_node(&node(true, true, false));
    let s = h.status(t(1));
    assert!(s.healthy);
    assert!(s.livez_ok());
    assert!(!s.healthz_ok());
}

#[test]
fn shared_health_reads_its_clock() {
    let now = Arc::new(Mutex::new(t(0)));
    let clock = now.clone();
    let shared = SharedHealth::with_clock(v4(), move || *clock.lock().expect("clock"));
    shared.updated();
    shared.queued_update();
    *now.lock().expect("clock") = t(59);
    assert!(shared.status().healthy);
    *now.lock().expect("clock") = t(60);
    let s = shared.status();
    assert!(!s.healthy);
    assert_eq!(s.current_time, t(60));
    shared.updated();
    assert!(shared.status().healthy);
}
