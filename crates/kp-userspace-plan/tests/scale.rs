//! A one-endpoint change costs the same at any number of Services: the balancer rebuilds the
//! changed Service's routes only, and the redirect table does not change at all.

use std::time::Duration;

use kp_core::node::{DetectLocal, NodeContext};
use kp_core::track::{Changes, SourceEvent};
use kp_userspace_plan::{Balancer, BalancerConfig, RedirectConfig, RedirectPlanner, Scheduler};

fn cost_of_one_endpoint_change(n: usize) -> (usize, usize, usize) {
    let mut state = kp_flows::load("node-a", kp_flows::synthetic::cluster(n, 10));
    let node = NodeContext::default();
    let mut balancer = Balancer::new(BalancerConfig {
        scheduler: Scheduler::RoundRobin,
        masquerade_all: false,
        detect_local: DetectLocal::None,
        quarantine: Duration::from_secs(10),
    });
    balancer.sync(&state, &node, &Changes::default(), true);
    let mut planner = RedirectPlanner::new(RedirectConfig {
        proxy_port: 31000,
        transparent_mark: 0x4000,
        node_ports_restricted: false,
    });
    let full = planner.full(&state, &node);
    assert!(
        full.operations > n,
        "{n} Services, {} operations",
        full.operations
    );
    state
        .apply(SourceEvent::Upsert(kp_flows::synthetic::endpoint_change(
            1, n, 10,
        )))
        .expect("slice");
    let changes = state.take_changes();
    balancer.sync(&state, &node, &changes, false);
    let tx = planner.sync(&state, &node, &changes, false);
    let s = balancer.last_sync();
    (s.services, s.routes_built, tx.operations)
}

#[test]
fn a_one_endpoint_change_costs_the_same_at_100_and_at_3000_services() {
    let small = cost_of_one_endpoint_change(100);
    let large = cost_of_one_endpoint_change(3000);
    assert_eq!(small.0, 1);
    assert_eq!(small, large);
    // An endpoint change leaves every frontend's verdict as it was: no nft work at all.
    assert_eq!(large.2, 0);
}
