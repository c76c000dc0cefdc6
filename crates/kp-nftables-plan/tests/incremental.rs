//! Partial syncs cost work in proportion to the change, not to the cluster.

use kp_core::model::IpFamily;
use kp_core::track::{Kind, Object, ProxyState, SourceEvent};
use kp_flows::synthetic;
use kp_nftables_plan::{NftTracer, NodeContext, PlanConfig, Planner};

fn loaded(n: usize, per: usize) -> (ProxyState, Planner, String) {
    let mut state = ProxyState::new("node-0");
    for o in synthetic::cluster(n, per) {
        state.apply(SourceEvent::Upsert(o)).unwrap();
    }
    state.apply(SourceEvent::Synced(Kind::Service)).unwrap();
    state
        .apply(SourceEvent::Synced(Kind::EndpointSlice))
        .unwrap();
    state.take_changes();
    let mut planner = Planner::new(PlanConfig::new(IpFamily::V4));
    let tx = planner.full(&state, &NodeContext::default());
    (state, planner, tx.text)
}

#[test]
fn one_endpoint_change_among_5000_services_is_a_handful_of_elements() {
    let (mut state, mut planner, full) = loaded(5000, 10);
    let mut tracer = NftTracer::new(vec![]);
    tracer.apply(&full).unwrap();

    // Replace endpoint 3 of service 4324, a plain ClusterIP (same count: one slot changes).
    let mut slice = synthetic::slice(4324, 10, &[]);
    if let Some(eps) = slice.endpoints.as_mut() {
        eps[3].addresses = vec!["10.200.0.1".into()];
    }
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .unwrap();
    let changes = state.take_changes();
    let tx = planner.partial(&state, &changes.services, &NodeContext::default(), false);
    // One map element replaced (delete + add). Both endpoints run on other nodes, so no
    // hairpin element changes.
    assert_eq!(tx.operations, 2, "{}", tx.text);
    assert_eq!(tx.text.lines().count(), 2, "{}", tx.text);
    assert!(tx.text.contains("10.200.0.1"), "{}", tx.text);
    assert!(tx
        .text
        .lines()
        .all(|l| l.starts_with("delete element") || l.starts_with("add element")));
    tracer.apply(&tx.text).unwrap();

    // Remove one endpoint: the entry moves from the 10-class to the 9-class.
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
            synthetic::slice(18, 10, &[4]),
        ))))
        .unwrap();
    let changes = state.take_changes();
    let tx = planner.partial(&state, &changes.services, &NodeContext::default(), false);
    // 10 old slots + class key out, 9 new slots + class key in, hairpin pair out, plus the new
    // class's set, map and rule: proportional to the Service, not the cluster.
    assert!(
        tx.operations <= 25,
        "{} operations:\n{}",
        tx.operations,
        tx.text
    );
    tracer.apply(&tx.text).unwrap();

    // A no-op change sends nothing.
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
            synthetic::slice(18, 10, &[4]),
        ))))
        .unwrap();
    let changes = state.take_changes();
    let tx = planner.partial(&state, &changes.services, &NodeContext::default(), false);
    assert!(tx.is_empty(), "{}", tx.text);
}

#[test]
fn deleting_a_service_removes_exactly_its_elements() {
    let (mut state, mut planner, full) = loaded(50, 3);
    let mut tracer = NftTracer::new(vec![]);
    tracer.apply(&full).unwrap();
    let before = tracer.element_count(IpFamily::V4, "vips-3-endpoints");
    state
        .apply(SourceEvent::Delete(
            Kind::Service,
            kp_core::track::ObjectKey {
                namespace: "bench".into(),
                name: "svc-2".into(),
            },
        ))
        .unwrap();
    let changes = state.take_changes();
    let tx = planner.partial(&state, &changes.services, &NodeContext::default(), false);
    tracer.apply(&tx.text).unwrap();
    assert_eq!(
        tracer.element_count(IpFamily::V4, "vips-3-endpoints"),
        before - 3
    );
    // The Service's endpoints no longer exist, and it is not in the no-endpoint map either.
    assert_eq!(tracer.element_count(IpFamily::V4, "no-endpoint-vips"), 0);
}
