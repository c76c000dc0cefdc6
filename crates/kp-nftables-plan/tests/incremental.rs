//! Partial syncs cost work in proportion to the change, not to the cluster.

use kp_core::model::IpFamily;
use kp_core::track::{Kind, Object, ProxyState, SourceEvent};
use kp_flows::synthetic;
use kp_nftables_plan::{NodeContext, PlanConfig, Planner};
use kp_nftables_test::NftTracer;

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

#[test]
fn split_transactions_keep_only_structure_in_the_text_and_match_the_text_form() {
    use kp_nftables_plan::ElementBatch;
    // Two planners fed the same changes: one all-text, one split.
    let (mut state, mut text_planner, full_text) = loaded(200, 3);
    let mut split_planner = Planner::new(PlanConfig::new(IpFamily::V4));
    let mut batch = ElementBatch::new();
    let full_split = split_planner.full_split(&state, &NodeContext::default(), &mut batch);
    assert!(!full_split.text.contains("element"), "{}", full_split.text);
    assert!(full_split
        .text
        .contains("add map ip kube-proxy vips-3-endpoints"));
    assert_eq!(
        full_split
            .text
            .lines()
            .filter(|l| l.starts_with("add rule"))
            .count(),
        full_text
            .lines()
            .filter(|l| l.starts_with("add rule"))
            .count()
    );
    let element_lines: usize = full_text
        .lines()
        .filter(|l| l.starts_with("add element"))
        .map(|l| l.matches(", ").count() + 1)
        .sum();
    assert_eq!(batch.elements(), element_lines);
    assert!(batch.errors().is_empty(), "{:?}", batch.errors());
    assert!(batch.finish().is_some());

    // One endpoint replaced: no structure, only element changes.
    state
        .apply(SourceEvent::Upsert(synthetic::endpoint_change(3, 200, 3)))
        .unwrap();
    let changes = state.take_changes();
    let text = text_planner.partial(&state, &changes.services, &NodeContext::default(), false);
    let mut batch = ElementBatch::new();
    let split = split_planner.partial_split(
        &state,
        &changes.services,
        &NodeContext::default(),
        false,
        &mut batch,
    );
    assert_eq!(split.text, "");
    assert!(text.operations > 0);
    assert_eq!(split.operations, text.operations);
    assert_eq!(batch.elements(), text.operations);
    assert_eq!(split.removes_endpoints, text.removes_endpoints);

    // A Service moving to a new endpoint count: the new class's declarations and rule are text,
    // its elements are in the batch.
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
            synthetic::slice(4, 5, &[]),
        ))))
        .unwrap();
    let changes = state.take_changes();
    let text = text_planner.partial(&state, &changes.services, &NodeContext::default(), false);
    let mut batch = ElementBatch::new();
    let split = split_planner.partial_split(
        &state,
        &changes.services,
        &NodeContext::default(),
        false,
        &mut batch,
    );
    assert!(
        split.text.contains("add set ip kube-proxy vips-5 "),
        "{}",
        split.text
    );
    assert!(split.text.contains("add rule"), "{}", split.text);
    assert!(!split.text.contains("element"), "{}", split.text);
    assert_eq!(split.operations, text.operations);
    let structure = split.text.lines().count();
    assert_eq!(batch.elements(), split.operations - structure);
}
