use super::*;

use std::net::IpAddr;

use proptest::prelude::*;
use serde_json::{json, Value};

use crate::model::Protocol;

// ClusterIPs in 10.96.0.0/16, endpoints in 10.244.0.0/16. This node is "node-a".

const NODE: &str = "node-a";

fn service_object(namespace: &str, name: &str, spec: Value) -> Object {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name},
        "spec": spec,
    }))
    .expect("Service JSON");
    Object::Service(Box::new(svc))
}

/// Service `web/<name>` with one TCP port `http`.
fn service(name: &str, port: u16) -> Object {
    service_object(
        "web",
        name,
        json!({"clusterIP": "10.96.0.1", "ports": [{"name": "http", "port": port}]}),
    )
}

/// An endpoint of a slice: `{"addresses": [ip], ...}` with the given conditions.
fn ep(ip: &str, conditions: Value) -> Value {
    json!({"addresses": [ip], "conditions": conditions})
}

fn ready(ip: &str) -> Value {
    ep(ip, json!({"ready": true}))
}

fn slice_object(
    namespace: &str,
    name: &str,
    labels: Value,
    endpoints: Vec<Value>,
    annotations: Value,
) -> Object {
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name, "labels": labels, "annotations": annotations},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }))
    .expect("EndpointSlice JSON");
    Object::EndpointSlice(Box::new(slice))
}

/// Slice `web/<name>` of Service `web/<service>`.
fn slice(name: &str, service: &str, endpoints: Vec<Value>) -> Object {
    slice_object("web", name, json!({LABEL: service}), endpoints, json!({}))
}

const LABEL: &str = "kubernetes.io/service-name";

fn node_object(name: &str, zone: Option<&str>, taints: Value) -> Object {
    let labels = match zone {
        Some(z) => json!({"topology.kubernetes.io/zone": z}),
        None => json!({}),
    };
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"podCIDR": "10.244.1.0/24", "taints": taints},
    }))
    .expect("Node JSON");
    Object::Node(Box::new(node))
}

fn upsert(state: &mut ProxyState, obj: Object) -> Applied {
    state.apply(SourceEvent::Upsert(obj)).expect("accepted")
}

fn key(namespace: &str, name: &str) -> ObjectKey {
    ObjectKey {
        namespace: namespace.into(),
        name: name.into(),
    }
}

fn svc_key(name: &str) -> ServiceKey {
    ServiceKey::new("web", name)
}

fn http(name: &str) -> ServicePortName {
    ServicePortName {
        service: svc_key(name),
        port: "http".into(),
        protocol: Protocol::Tcp,
    }
}

fn addrs(eps: &[Endpoint]) -> Vec<String> {
    eps.iter().map(ToString::to_string).collect()
}

fn services(names: &[&str]) -> BTreeSet<ServiceKey> {
    names.iter().map(|n| svc_key(n)).collect()
}

#[test]
fn a_service_and_its_slice_join_by_label() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(
        &mut state,
        slice(
            "api-x1",
            "api",
            vec![ready("10.244.0.1"), ready("10.244.0.2")],
        ),
    );
    upsert(&mut state, slice("db-x1", "db", vec![ready("10.244.0.9")]));

    let ports = state.service_state(&svc_key("api"));
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].port.port, 80);
    assert_eq!(
        addrs(&ports[0].endpoints.cluster),
        ["10.244.0.1:8080", "10.244.0.2:8080"]
    );
    assert!(ports[0].endpoints.has_any);
}

#[test]
fn a_slice_in_another_namespace_does_not_join() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(
        &mut state,
        slice_object(
            "other",
            "api-x1",
            json!({LABEL: "api"}),
            vec![ready("10.244.0.1")],
            json!({}),
        ),
    );
    assert!(state.endpoints(&http("api")).is_empty());
    assert!(!state.service_state(&svc_key("api"))[0].endpoints.has_any);
}

#[test]
fn a_slice_port_joins_only_the_service_port_of_the_same_name_and_protocol() {
    let mut state = ProxyState::new(NODE);
    upsert(
        &mut state,
        service_object(
            "web",
            "api",
            json!({"clusterIP": "10.96.0.1", "ports": [
                {"name": "http", "port": 80},
                {"name": "dns", "port": 53, "protocol": "UDP"},
            ]}),
        ),
    );
    upsert(
        &mut state,
        slice("api-x1", "api", vec![ready("10.244.0.1")]),
    );
    let dns = ServicePortName {
        service: svc_key("api"),
        port: "dns".into(),
        protocol: Protocol::Udp,
    };
    assert!(state.endpoints(&dns).is_empty());
    let udp_http = ServicePortName {
        protocol: Protocol::Udp,
        ..http("api")
    };
    assert!(state.endpoints(&udp_http).is_empty());
    assert_eq!(addrs(&state.endpoints(&http("api"))), ["10.244.0.1:8080"]);
}

#[test]
fn several_slices_merge_and_a_shared_address_counts_once() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(
        &mut state,
        slice(
            "api-x1",
            "api",
            vec![ready("10.244.0.1"), ready("10.244.0.2")],
        ),
    );
    upsert(
        &mut state,
        slice(
            "api-x2",
            "api",
            vec![ready("10.244.0.2"), ready("10.244.0.3")],
        ),
    );
    assert_eq!(
        addrs(&state.endpoints(&http("api"))),
        ["10.244.0.1:8080", "10.244.0.2:8080", "10.244.0.3:8080"]
    );
}

#[test]
fn a_shared_address_takes_the_entry_that_is_not_terminating() {
    // The pod network reused the address of a terminating pod: the running pod wins, whichever
    // slice lists it (as upstream's EndpointSliceCache).
    let terminating = ep(
        "10.244.0.5",
        json!({"ready": false, "serving": true, "terminating": true}),
    );
    for (first, second) in [("api-a", "api-b"), ("api-b", "api-a")] {
        let mut state = ProxyState::new(NODE);
        upsert(&mut state, service("api", 80));
        upsert(&mut state, slice(first, "api", vec![terminating.clone()]));
        upsert(&mut state, slice(second, "api", vec![ready("10.244.0.5")]));
        let eps = state.endpoints(&http("api"));
        assert_eq!(eps.len(), 1);
        assert!(
            eps[0].ready && !eps[0].terminating,
            "{first} then {second}: {eps:?}"
        );
    }
}

#[test]
fn deleting_a_slice_removes_its_endpoints() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(
        &mut state,
        slice("api-x1", "api", vec![ready("10.244.0.1")]),
    );
    upsert(
        &mut state,
        slice("api-x2", "api", vec![ready("10.244.0.2")]),
    );
    state.take_changes();

    let applied = state.apply(SourceEvent::Delete(
        Kind::EndpointSlice,
        key("web", "api-x1"),
    ));
    assert_eq!(applied, Ok(Applied::Changed));
    assert_eq!(addrs(&state.endpoints(&http("api"))), ["10.244.0.2:8080"]);
    assert_eq!(state.take_changes().services, services(&["api"]));

    state
        .apply(SourceEvent::Delete(
            Kind::EndpointSlice,
            key("web", "api-x2"),
        ))
        .expect("accepted");
    assert!(state.endpoints(&http("api")).is_empty());
    let sel = &state.service_state(&svc_key("api"))[0].endpoints;
    assert!(!sel.has_any, "a Service whose slices are gone must reject");
}

#[test]
fn deleting_an_unknown_slice_changes_nothing() {
    let mut state = ProxyState::new(NODE);
    let applied = state.apply(SourceEvent::Delete(Kind::EndpointSlice, key("web", "nope")));
    assert_eq!(applied, Ok(Applied::Unchanged));
    assert!(state.take_changes().is_empty());
}

#[test]
fn a_slice_relabelled_to_another_service_leaves_the_first() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(&mut state, service("db", 80));
    upsert(&mut state, slice("x1", "api", vec![ready("10.244.0.1")]));
    state.take_changes();

    upsert(&mut state, slice("x1", "db", vec![ready("10.244.0.1")]));
    assert!(state.endpoints(&http("api")).is_empty());
    assert_eq!(addrs(&state.endpoints(&http("db"))), ["10.244.0.1:8080"]);
    assert_eq!(state.take_changes().services, services(&["api", "db"]));
}

#[test]
fn a_slice_that_loses_its_service_label_leaves_the_service() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(&mut state, slice("x1", "api", vec![ready("10.244.0.1")]));
    state.take_changes();

    upsert(
        &mut state,
        slice_object("web", "x1", json!({}), vec![ready("10.244.0.1")], json!({})),
    );
    assert!(state.endpoints(&http("api")).is_empty());
    assert_eq!(state.take_changes().services, services(&["api"]));
}

/// Defect: a rejected object's name reached the log raw, so a name with a newline forged a log
/// line (CR and NUL got through too). What a rejection prints is one line, whatever the name.
#[test]
fn a_rejection_names_a_hostile_object_on_one_line() {
    let mut state = ProxyState::new(NODE);
    let hostile = "api\nINFO kube_proxy: forged line\r\0\u{1b}[2K";
    let bad = service_object("web\nx", hostile, json!({"clusterIP": "10.96.0.1"}));
    let err = state.apply(SourceEvent::Upsert(bad)).expect_err("rejected");
    let line = err.to_string();
    assert!(!line.chars().any(char::is_control), "{line:?}");
    assert!(
        line.starts_with("Service web\\nx/api\\nINFO kube_proxy: forged line\\r\\0\\u{1b}[2K: "),
        "{line}"
    );
}

#[test]
fn an_invalid_service_update_is_rejected_and_the_previous_version_stays() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    state.take_changes();

    let bad = service_object(
        "web",
        "api",
        json!({"clusterIP": "10.0.0.300", "ports": [{"name": "http", "port": 8080}]}),
    );
    let err = state.apply(SourceEvent::Upsert(bad)).expect_err("rejected");
    assert_eq!(err.kind, Kind::Service);
    assert_eq!(err.key, key("web", "api"));
    assert!(matches!(
        err.reason,
        InvalidObject::Address {
            field: "spec.clusterIPs",
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "Service web/api: invalid spec.clusterIPs \"10.0.0.300\""
    );

    let ports = state.service_ports(&svc_key("api"));
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].port, 80);
    assert_eq!(
        ports[0].cluster_ips,
        ["10.96.0.1".parse::<IpAddr>().expect("address")]
    );
    assert!(
        state.take_changes().is_empty(),
        "a rejected object records no change"
    );
    assert_eq!(state.pending_counts(), (0, 0));
}

#[test]
fn an_invalid_slice_update_is_rejected_and_the_previous_endpoints_stay() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(
        &mut state,
        slice("api-x1", "api", vec![ready("10.244.0.1")]),
    );
    state.take_changes();

    let err = state
        .apply(SourceEvent::Upsert(slice(
            "api-x1",
            "api",
            vec![ready("10.244.0.1; drop")],
        )))
        .expect_err("rejected");
    assert_eq!(
        (err.kind, err.key),
        (Kind::EndpointSlice, key("web", "api-x1"))
    );
    assert_eq!(addrs(&state.endpoints(&http("api"))), ["10.244.0.1:8080"]);
    assert!(state.take_changes().is_empty());
}

#[test]
fn take_changes_lists_exactly_the_touched_services_and_resets() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(&mut state, service("db", 5432));
    upsert(
        &mut state,
        slice("cache-x1", "cache", vec![ready("10.244.0.7")]),
    );
    upsert(
        &mut state,
        slice("api-x1", "api", vec![ready("10.244.0.1")]),
    );
    assert_eq!(state.pending_counts(), (2, 2));

    let changes = state.take_changes();
    assert_eq!(changes.services, services(&["api", "cache", "db"]));
    assert_eq!((changes.service_changes, changes.endpoint_changes), (2, 2));
    assert!(!changes.node_changed);

    assert_eq!(state.take_changes(), Changes::default());
    assert_eq!(state.pending_counts(), (0, 0));

    upsert(&mut state, service("db", 5433));
    assert_eq!(state.take_changes().services, services(&["db"]));
}

#[test]
fn reapplying_an_identical_object_records_no_change() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(
        &mut state,
        slice("api-x1", "api", vec![ready("10.244.0.1")]),
    );
    upsert(&mut state, node_object(NODE, Some("zone-a"), json!([])));
    state.take_changes();

    assert_eq!(upsert(&mut state, service("api", 80)), Applied::Unchanged);
    assert_eq!(
        upsert(
            &mut state,
            slice("api-x1", "api", vec![ready("10.244.0.1")])
        ),
        Applied::Unchanged
    );
    assert_eq!(
        upsert(&mut state, node_object(NODE, Some("zone-a"), json!([]))),
        Applied::Unchanged
    );
    assert_eq!(state.take_changes(), Changes::default());
}

#[test]
fn a_change_the_proxy_does_not_program_records_no_change() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    state.take_changes();
    let Object::Service(mut svc) = service("api", 80) else {
        unreachable!()
    };
    svc.metadata.resource_version = Some("42".into());
    svc.metadata.annotations = Some([("team".to_string(), "payments".to_string())].into());
    assert_eq!(upsert(&mut state, Object::Service(svc)), Applied::Unchanged);
    assert!(state.take_changes().is_empty());
}

#[test]
fn a_service_that_becomes_headless_is_removed() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    state.take_changes();

    let headless = service_object(
        "web",
        "api",
        json!({"clusterIP": "None", "ports": [{"name": "http", "port": 80}]}),
    );
    assert_eq!(upsert(&mut state, headless.clone()), Applied::Changed);
    assert!(state.service_ports(&svc_key("api")).is_empty());
    assert_eq!(state.service_keys().count(), 0);
    assert_eq!(state.take_changes().services, services(&["api"]));

    // Still headless: nothing to do.
    assert_eq!(upsert(&mut state, headless), Applied::Unchanged);
    assert!(state.take_changes().is_empty());
}

#[test]
fn deleting_a_service_removes_it() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    upsert(&mut state, service("db", 5432));
    assert_eq!(state.service_port_count(), 2);
    state.take_changes();

    assert_eq!(
        state.apply(SourceEvent::Delete(Kind::Service, key("web", "api"))),
        Ok(Applied::Changed)
    );
    assert_eq!(
        state.service_keys().cloned().collect::<Vec<_>>(),
        [svc_key("db")]
    );
    assert_eq!(state.service_port_count(), 1);
    assert_eq!(state.take_changes().services, services(&["api"]));

    assert_eq!(
        state.apply(SourceEvent::Delete(Kind::Service, key("web", "api"))),
        Ok(Applied::Unchanged)
    );
}

#[test]
fn rules_may_be_programmed_only_after_services_slices_and_the_node_are_listed() {
    let kinds = [Kind::Service, Kind::EndpointSlice, Kind::Node];
    // Whatever order the three lists complete in, programming waits for the last one.
    for first in 0..3 {
        for second in 0..3 {
            if first == second {
                continue;
            }
            let last = 3 - first - second;
            let mut state = ProxyState::new(NODE);
            assert!(!state.ready_to_program());
            for (i, k) in [first, second].into_iter().enumerate() {
                state
                    .apply(SourceEvent::Synced(kinds[k]))
                    .expect("accepted");
                assert!(state.synced(kinds[k]));
                assert!(
                    !state.ready_to_program(),
                    "ready after {} of 3 lists",
                    i + 1
                );
            }
            state
                .apply(SourceEvent::Synced(kinds[last]))
                .expect("accepted");
            assert!(state.ready_to_program());
        }
    }
}

#[test]
fn events_for_other_nodes_are_ignored() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, node_object(NODE, Some("zone-a"), json!([])));
    state.take_changes();
    let before = state.node().clone();

    assert_eq!(
        upsert(&mut state, node_object("node-b", Some("zone-b"), json!([]))),
        Applied::Unchanged
    );
    assert_eq!(
        state.apply(SourceEvent::Delete(Kind::Node, key("", "node-b"))),
        Ok(Applied::Unchanged)
    );
    assert_eq!(state.node(), &before);
    assert!(state.take_changes().is_empty());
}

#[test]
fn this_nodes_zone_change_marks_the_node_changed() {
    let mut state = ProxyState::new(NODE);
    assert!(!state.node().exists);
    assert_eq!(
        upsert(&mut state, node_object(NODE, Some("zone-a"), json!([]))),
        Applied::Changed
    );
    assert!(state.node().eligible());
    assert_eq!(state.node().zone.as_deref(), Some("zone-a"));
    let changes = state.take_changes();
    assert!(changes.node_changed && !changes.is_empty());

    upsert(&mut state, node_object(NODE, Some("zone-b"), json!([])));
    assert!(state.take_changes().node_changed);
}

#[test]
fn this_nodes_zone_drives_topology() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, service("api", 80));
    let hinted =
        |ip: &str, zone: &str| json!({"addresses": [ip], "hints": {"forZones": [{"name": zone}]}});
    upsert(
        &mut state,
        slice(
            "api-x1",
            "api",
            vec![
                hinted("10.244.0.1", "zone-a"),
                hinted("10.244.0.2", "zone-b"),
            ],
        ),
    );
    let cluster =
        |state: &ProxyState| addrs(&state.service_state(&svc_key("api"))[0].endpoints.cluster);
    assert_eq!(cluster(&state), ["10.244.0.1:8080", "10.244.0.2:8080"]);
    upsert(&mut state, node_object(NODE, Some("zone-b"), json!([])));
    assert_eq!(cluster(&state), ["10.244.0.2:8080"]);
}

#[test]
fn a_taint_changes_eligibility_but_not_selection() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, node_object(NODE, Some("zone-a"), json!([])));
    state.take_changes();

    let tainted = node_object(
        NODE,
        Some("zone-a"),
        json!([{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]),
    );
    assert_eq!(upsert(&mut state, tainted), Applied::Changed);
    assert!(!state.node().eligible());
    assert!(!state.take_changes().node_changed);
}

#[test]
fn deleting_this_node_makes_it_absent() {
    let mut state = ProxyState::new(NODE);
    upsert(&mut state, node_object(NODE, Some("zone-a"), json!([])));
    state.take_changes();

    assert_eq!(
        state.apply(SourceEvent::Delete(Kind::Node, key("", NODE))),
        Ok(Applied::Changed)
    );
    assert!(!state.node().exists);
    assert!(!state.node().eligible());
    assert_eq!(state.node().name, NODE);
    assert!(
        state.take_changes().node_changed,
        "the zone and pod CIDRs are gone"
    );
}

#[test]
fn endpoints_on_this_node_are_local() {
    let mut state = ProxyState::new(NODE);
    upsert(
        &mut state,
        service_object(
            "web",
            "api",
            json!({"clusterIP": "10.96.0.1", "internalTrafficPolicy": "Local", "ports": [{"name": "http", "port": 80}]}),
        ),
    );
    upsert(
        &mut state,
        slice(
            "api-x1",
            "api",
            vec![
                json!({"addresses": ["10.244.0.1"], "nodeName": NODE}),
                json!({"addresses": ["10.244.0.2"], "nodeName": "node-b"}),
            ],
        ),
    );
    let st = &state.service_state(&svc_key("api"))[0];
    assert_eq!(addrs(st.endpoints.internal(&st.port)), ["10.244.0.1:8080"]);
}

#[test]
fn trigger_times_of_slice_changes_are_collected() {
    let mut state = ProxyState::new(NODE);
    let annotated = |time: &str, ip: &str| {
        slice_object(
            "web",
            "api-x1",
            json!({LABEL: "api"}),
            vec![ready(ip)],
            json!({"endpoints.kubernetes.io/last-change-trigger-time": time}),
        )
    };
    upsert(&mut state, annotated("2021-01-01T00:00:00Z", "10.244.0.1"));
    upsert(&mut state, annotated("2021-01-01T00:00:05Z", "10.244.0.2"));
    upsert(
        &mut state,
        slice("api-x2", "api", vec![ready("10.244.0.3")]),
    );
    assert_eq!(
        state.take_changes().trigger_times,
        [1_609_459_200.0, 1_609_459_205.0]
    );
    assert!(state.take_changes().trigger_times.is_empty());
}

// ---- Property: the state equals a model replayed from the same events ----

const SERVICES: usize = 3;
const SLICES: usize = 4;
const ADDRESSES: u8 = 4;

fn svc_name(i: usize) -> String {
    format!("svc-{i}")
}

fn slice_name(j: usize) -> String {
    format!("slice-{j}")
}

/// One endpoint of a generated slice: address index and conditions.
#[derive(Clone, Debug, PartialEq)]
struct GenEndpoint {
    address: u8,
    ready: bool,
    terminating: bool,
}

impl GenEndpoint {
    fn ip(&self) -> String {
        format!("10.244.0.{}", self.address + 1)
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// A valid Service with one port `http` of this number.
    Service(usize, u16),
    /// A headless version of the Service.
    Headless(usize),
    /// A Service with a malformed ClusterIP.
    BadService(usize),
    DeleteService(usize),
    /// A valid slice joined to Service `.1`.
    Slice(usize, usize, Vec<GenEndpoint>),
    /// A slice with a malformed address.
    BadSlice(usize, usize),
    DeleteSlice(usize),
}

fn arb_step() -> impl Strategy<Value = Step> {
    let gen_ep =
        (0..ADDRESSES, any::<bool>(), any::<bool>()).prop_map(|(address, ready, terminating)| {
            GenEndpoint {
                address,
                ready,
                terminating,
            }
        });
    prop_oneof![
        3 => (0..SERVICES, prop_oneof![Just(80u16), Just(81u16)]).prop_map(|(i, p)| Step::Service(i, p)),
        1 => (0..SERVICES).prop_map(Step::Headless),
        1 => (0..SERVICES).prop_map(Step::BadService),
        1 => (0..SERVICES).prop_map(Step::DeleteService),
        4 => (0..SLICES, 0..SERVICES, prop::collection::vec(gen_ep, 0..4))
            .prop_map(|(j, i, eps)| Step::Slice(j, i, eps)),
        1 => (0..SLICES, 0..SERVICES).prop_map(|(j, i)| Step::BadSlice(j, i)),
        1 => (0..SLICES).prop_map(Step::DeleteSlice),
    ]
}

fn event(step: &Step) -> SourceEvent {
    let gen_slice = |j: usize, i: usize, eps: Vec<Value>| {
        SourceEvent::Upsert(slice(&slice_name(j), &svc_name(i), eps))
    };
    match step {
        Step::Service(i, port) => SourceEvent::Upsert(service(&svc_name(*i), *port)),
        Step::Headless(i) => SourceEvent::Upsert(service_object(
            "web",
            &svc_name(*i),
            json!({"clusterIP": "None", "ports": [{"name": "http", "port": 80}]}),
        )),
        Step::BadService(i) => SourceEvent::Upsert(service_object(
            "web",
            &svc_name(*i),
            json!({"clusterIP": "10.96.0.300", "ports": [{"name": "http", "port": 80}]}),
        )),
        Step::DeleteService(i) => SourceEvent::Delete(Kind::Service, key("web", &svc_name(*i))),
        Step::Slice(j, i, eps) => gen_slice(
            *j,
            *i,
            eps.iter()
                .map(|e| {
                    ep(
                        &e.ip(),
                        json!({"ready": e.ready, "serving": e.ready || e.terminating, "terminating": e.terminating}),
                    )
                })
                .collect(),
        ),
        Step::BadSlice(j, i) => gen_slice(*j, *i, vec![ready("10.244.0.256")]),
        Step::DeleteSlice(j) => SourceEvent::Delete(Kind::EndpointSlice, key("web", &slice_name(*j))),
    }
}

/// The simplest store: the last good object of each kind and name.
#[derive(Clone, Debug, Default, PartialEq)]
struct Model {
    /// Proxied Services: index → port number.
    services: BTreeMap<usize, u16>,
    /// Slices: index → (Service index, endpoints).
    slices: BTreeMap<usize, (usize, Vec<GenEndpoint>)>,
}

impl Model {
    /// Applies a step; returns whether the object was accepted.
    fn apply(&mut self, step: &Step) -> bool {
        match step {
            Step::Service(i, port) => {
                self.services.insert(*i, *port);
            }
            Step::Headless(i) | Step::DeleteService(i) => {
                self.services.remove(i);
            }
            Step::Slice(j, i, eps) => {
                self.slices.insert(*j, (*i, eps.clone()));
            }
            Step::DeleteSlice(j) => {
                self.slices.remove(j);
            }
            Step::BadService(_) | Step::BadSlice(..) => return false,
        }
        true
    }

    /// The endpoints of Service `i`, as (address, ready, terminating): each address once, a
    /// non-terminating entry preferred, then the lowest slice name.
    fn endpoints(&self, i: usize) -> BTreeMap<u8, (bool, bool)> {
        let mut out: BTreeMap<u8, (bool, bool)> = BTreeMap::new();
        for (svc, eps) in self.slices.values() {
            if *svc != i {
                continue;
            }
            for e in eps {
                let entry = out.entry(e.address).or_insert((e.ready, e.terminating));
                if entry.1 && !e.terminating {
                    *entry = (e.ready, e.terminating);
                }
            }
        }
        out
    }

    /// Everything the proxy programs for Service `i`.
    fn view(&self, i: usize) -> (Option<u16>, BTreeMap<u8, (bool, bool)>) {
        (self.services.get(&i).copied(), self.endpoints(i))
    }
}

fn actual_view(state: &ProxyState, i: usize) -> (Option<u16>, BTreeMap<u8, (bool, bool)>) {
    let ports = state.service_ports(&svc_key(&svc_name(i)));
    assert!(ports.len() <= 1);
    let endpoints = state
        .endpoints(&http(&svc_name(i)))
        .into_iter()
        .map(|e| {
            let IpAddr::V4(v4) = e.ip else {
                panic!("IPv6 endpoint {e}")
            };
            assert_eq!(e.port, 8080);
            (v4.octets()[3] - 1, (e.ready, e.terminating))
        })
        .collect();
    (ports.first().map(|p| p.port), endpoints)
}

/// The Services whose stored object a step changed: its own Service, or a slice's old and
/// new Service when the slice changed.
fn touched(step: &Step, before: &Model, after: &Model) -> BTreeSet<usize> {
    match step {
        Step::Service(i, _) | Step::Headless(i) | Step::BadService(i) | Step::DeleteService(i) => {
            if before.services.get(i) != after.services.get(i) {
                [*i].into()
            } else {
                BTreeSet::new()
            }
        }
        Step::Slice(j, ..) | Step::BadSlice(j, _) | Step::DeleteSlice(j) => {
            let (old, new) = (before.slices.get(j), after.slices.get(j));
            if old == new {
                BTreeSet::new()
            } else {
                old.into_iter().chain(new).map(|(i, _)| *i).collect()
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn the_state_equals_a_model_replayed_from_the_same_events(steps in prop::collection::vec(arb_step(), 0..40)) {
        let mut state = ProxyState::new(NODE);
        let mut model = Model::default();
        for step in &steps {
            let before = model.clone();
            let accepted = model.apply(step);
            let result = state.apply(event(step));
            prop_assert_eq!(result.is_ok(), accepted, "{:?}: {:?}", step, result);

            let changes = state.take_changes();
            let changed: BTreeSet<usize> = (0..SERVICES).filter(|i| before.view(*i) != model.view(*i)).collect();
            let reported: BTreeSet<usize> = (0..SERVICES)
                .filter(|i| changes.services.contains(&svc_key(&svc_name(*i))))
                .collect();
            prop_assert!(changed.is_subset(&reported), "{:?}: changed {:?}, reported {:?}", step, changed, reported);
            prop_assert_eq!(&reported, &touched(step, &before, &model), "{:?}", step);
            prop_assert_eq!(changes.services.len(), reported.len(), "unknown Service reported: {:?}", changes.services);
            prop_assert_eq!(result == Ok(Applied::Changed), !changes.services.is_empty(), "{:?}", step);

            for i in 0..SERVICES {
                prop_assert_eq!(actual_view(&state, i), model.view(i), "Service {} after {:?}", i, step);
            }
        }
        let keys: Vec<ServiceKey> = state.service_keys().cloned().collect();
        let expected: Vec<ServiceKey> = model.services.keys().map(|i| svc_key(&svc_name(*i))).collect();
        prop_assert_eq!(keys, expected);
    }
}

fn service_cidr(name: &str, cidrs: Value) -> Object {
    Object::ServiceCidr(Box::new(
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}}))
            .expect("ServiceCIDR JSON"),
    ))
}

#[test]
fn service_cidr_objects_change_the_node_context_and_their_deletion_undoes_it() {
    let mut state = ProxyState::new(NODE);
    assert!(state.service_cidrs().is_empty());
    upsert(
        &mut state,
        service_cidr("kubernetes", json!(["10.96.0.0/16"])),
    );
    assert!(state.take_changes().node_changed);
    assert_eq!(
        state.service_cidrs(),
        ["10.96.0.0/16".parse::<IpNet>().unwrap()]
    );
    // The same ranges again, or covered ones, change nothing.
    assert_eq!(
        state
            .apply(SourceEvent::Upsert(service_cidr(
                "kubernetes",
                json!(["10.96.0.0/16"])
            )))
            .unwrap(),
        Applied::Unchanged
    );
    state.set_configured_service_cidrs(vec!["10.96.0.0/12".parse().unwrap()]);
    assert!(state.take_changes().node_changed);
    state
        .apply(SourceEvent::Delete(
            Kind::ServiceCidr,
            key("", "kubernetes"),
        ))
        .unwrap();
    assert!(
        !state.take_changes().node_changed,
        "still covered by the configuration"
    );
    assert_eq!(
        state.service_cidrs(),
        ["10.96.0.0/12".parse::<IpNet>().unwrap()]
    );
}

#[test]
fn a_service_cidr_that_would_cut_the_node_off_is_rejected_and_the_last_good_one_stays() {
    let mut state = ProxyState::new(NODE);
    upsert(
        &mut state,
        service_cidr("kubernetes", json!(["10.96.0.0/16"])),
    );
    state.take_changes();
    for bad in [
        "0.0.0.0/0",
        "127.0.0.0/16",
        "::/0",
        "fe80::/64",
        "10.96.0.0/33",
        "x",
    ] {
        let err = state
            .apply(SourceEvent::Upsert(service_cidr(
                "kubernetes",
                json!([bad]),
            )))
            .expect_err(bad);
        assert_eq!(err.kind, Kind::ServiceCidr);
        assert!(err.to_string().contains("spec.cidrs"), "{err}");
    }
    assert_eq!(
        state.service_cidrs(),
        ["10.96.0.0/16".parse::<IpNet>().unwrap()]
    );
    assert!(state.take_changes().is_empty());
}
