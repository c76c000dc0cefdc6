use super::*;

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Service;
use serde_json::{json, Value};

use crate::model::{Endpoint, Protocol, ServicePortName};
use crate::track::{Applied, Kind, Object, ObjectKey, ProxyState, SourceEvent};

// ClusterIPs in 10.96.0.0/16 and fd00:96::/112, endpoints in 10.244.0.0/16 and fd00:244::/64.
// This node is "node-a".

const NODE: &str = "node-a";

/// Endpoints `web/<name>` with the given subsets and metadata fields merged in.
fn endpoints_with(name: &str, meta: Value, subsets: Value) -> Endpoints {
    let mut metadata = json!({"namespace": "web", "name": name});
    if let (Some(m), Value::Object(extra)) = (metadata.as_object_mut(), meta) {
        m.extend(extra);
    }
    serde_json::from_value(json!({"metadata": metadata, "subsets": subsets})).expect("Endpoints")
}

fn endpoints(name: &str, subsets: Value) -> Endpoints {
    endpoints_with(name, json!({}), subsets)
}

/// The (address, ready) pairs of a mirrored slice.
fn addrs(slice: &EndpointSlice) -> Vec<(String, bool)> {
    slice
        .endpoints
        .iter()
        .flatten()
        .map(|e| {
            let ready = e.conditions.as_ref().and_then(|c| c.ready);
            (e.addresses.join(","), ready.expect("ready is set"))
        })
        .collect()
}

fn label<'a>(slice: &'a EndpointSlice, key: &str) -> Option<&'a str> {
    slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
}

#[test]
fn ready_addresses_mirror_as_ready_and_not_ready_ones_as_not_ready() {
    let ep = endpoints(
        "api",
        json!([{
            "addresses": [{"ip": "10.244.1.1", "nodeName": "node-a", "hostname": "api-0",
                           "targetRef": {"kind": "Pod", "namespace": "web", "name": "api-0"}}],
            "notReadyAddresses": [{"ip": "10.244.1.2"}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}],
        }]),
    );
    let m = mirror(&ep).expect("mirrors");
    assert_eq!(m.truncated, 0);
    assert_eq!(m.slices.len(), 1);
    let s = &m.slices[0];
    assert_eq!(s.address_type, "IPv4");
    assert_eq!(
        addrs(s),
        vec![("10.244.1.1".into(), true), ("10.244.1.2".into(), false)]
    );
    let first = &s.endpoints.as_ref().expect("endpoints")[0];
    assert_eq!(first.node_name.as_deref(), Some("node-a"));
    assert_eq!(first.hostname.as_deref(), Some("api-0"));
    assert_eq!(
        first.target_ref.as_ref().and_then(|r| r.name.as_deref()),
        Some("api-0")
    );
    // Serving and terminating stay unset, as the controller leaves them.
    let cond = first.conditions.as_ref().expect("conditions");
    assert_eq!((cond.serving, cond.terminating), (None, None));
    assert_eq!(
        s.ports,
        Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            app_protocol: Some("http".into()),
        }])
    );
    assert_eq!(label(s, LABEL_SERVICE_NAME), Some("api"));
    assert_eq!(label(s, LABEL_MANAGED_BY), Some(MIRRORING_CONTROLLER));
    assert_eq!(s.metadata.namespace.as_deref(), Some("web"));

    // In the model: the ready one is ready and serving, the other neither.
    let (service, slices, _) = mirrored_endpoints(&ep, NODE).expect("converts");
    assert_eq!(service, ServiceKey::new("web", "api"));
    let eps = &slices[0].ports[0].endpoints;
    assert_eq!(
        eps.iter()
            .map(|e| (e.ip.to_string(), e.ready, e.serving, e.is_local))
            .collect::<Vec<_>>(),
        vec![
            ("10.244.1.1".into(), true, true, true),
            ("10.244.1.2".into(), false, false, false),
        ]
    );
}

#[test]
fn addresses_split_by_family_and_subsets_with_the_same_ports_share_a_slice() {
    let ep = endpoints(
        "api",
        json!([
            {"addresses": [{"ip": "10.244.1.1"}, {"ip": "fd00:244::1"}],
             "ports": [{"name": "a", "port": 80}, {"name": "b", "port": 81}]},
            // The same ports in another order: the same slice.
            {"addresses": [{"ip": "10.244.1.2"}],
             "ports": [{"name": "b", "port": 81}, {"name": "a", "port": 80}]},
            // Other ports: a slice of their own.
            {"addresses": [{"ip": "10.244.1.3"}], "ports": [{"name": "a", "port": 90}]},
        ]),
    );
    let m = mirror(&ep).expect("mirrors");
    let summary: Vec<(String, Vec<(String, bool)>)> = m
        .slices
        .iter()
        .map(|s| (s.address_type.clone(), addrs(s)))
        .collect();
    assert_eq!(
        summary,
        vec![
            (
                "IPv4".into(),
                vec![("10.244.1.1".into(), true), ("10.244.1.2".into(), true)]
            ),
            ("IPv6".into(), vec![("fd00:244::1".into(), true)]),
            ("IPv4".into(), vec![("10.244.1.3".into(), true)]),
        ]
    );
    let names: BTreeSet<_> = m.slices.iter().map(|s| s.metadata.name.clone()).collect();
    assert_eq!(
        names.len(),
        3,
        "every slice has a name of its own: {names:?}"
    );
    // Unset protocols and names become the API's defaults.
    let p = &m.slices[2].ports.as_ref().expect("ports")[0];
    assert_eq!(
        (p.name.as_deref(), p.protocol.as_deref()),
        (Some("a"), Some("TCP"))
    );
}

#[test]
fn at_most_1000_addresses_of_a_subset_are_mirrored_ready_ones_first() {
    let ip = |i: usize| json!({"ip": format!("10.244.{}.{}", i / 250, i % 250 + 1)});
    let ready: Vec<Value> = (0..900).map(ip).collect();
    let not_ready: Vec<Value> = (900..1200).map(ip).collect();
    let ep = endpoints(
        "api",
        json!([
            {"addresses": ready, "notReadyAddresses": not_ready, "ports": [{"port": 80}]},
            {"addresses": [{"ip": "10.244.200.1"}], "ports": [{"port": 80}]},
        ]),
    );
    let m = mirror(&ep).expect("mirrors");
    assert_eq!(m.truncated, 200);
    assert_eq!(truncated(&ep), 200);
    let got = addrs(&m.slices[0]);
    // The limit is per subset: the second subset's address is mirrored too.
    assert_eq!(got.len(), 1001);
    assert_eq!(got.iter().filter(|(_, r)| *r).count(), 901);
    assert!(got.contains(&("10.244.200.1".into(), true)));
    assert!(got.contains(&("10.244.3.250".into(), false)), "address 999");
    assert!(!got.contains(&("10.244.4.1".into(), false)), "address 1000");
}

#[test]
fn skip_mirror_and_leader_election_objects_mirror_nothing() {
    let subsets = json!([{"addresses": [{"ip": "10.244.1.1"}], "ports": [{"port": 80}]}]);
    let skip = endpoints_with(
        "api",
        json!({"labels": {LABEL_SKIP_MIRROR: "true"}}),
        subsets.clone(),
    );
    assert_eq!(mirror(&skip), Ok(Mirrored::default()));
    let lock = endpoints_with(
        "api",
        json!({"annotations": {ANNOTATION_LEADER: "{}"}}),
        subsets.clone(),
    );
    assert_eq!(mirror(&lock), Ok(Mirrored::default()));
    // Any other value of the label mirrors.
    let other = endpoints_with(
        "api",
        json!({"labels": {LABEL_SKIP_MIRROR: "false"}}),
        subsets,
    );
    assert_eq!(mirror(&other).expect("mirrors").slices.len(), 1);
}

#[test]
fn labels_and_annotations_are_copied_but_the_trigger_time() {
    let ep = endpoints_with(
        "api",
        json!({
            "labels": {"app": "api", LABEL_SERVICE_NAME: "other"},
            "annotations": {ANNOTATION_TRIGGER_TIME: "2024-01-01T00:00:00Z", "team": "a"},
        }),
        json!([{"addresses": [{"ip": "10.244.1.1"}], "ports": [{"port": 80}]}]),
    );
    let s = &mirror(&ep).expect("mirrors").slices[0];
    assert_eq!(label(s, "app"), Some("api"));
    // The Service is the Endpoints' own, whatever its labels say.
    assert_eq!(label(s, LABEL_SERVICE_NAME), Some("api"));
    let annotations = s.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations.keys().collect::<Vec<_>>(),
        vec!["team"],
        "the controller drops the trigger time"
    );
}

#[test]
fn a_long_name_still_gives_valid_slice_names() {
    let name = "a".repeat(63);
    let ep = endpoints(
        &name,
        json!([{"addresses": [{"ip": "10.244.1.1"}], "ports": [{"port": 80}]}]),
    );
    let (service, slices, _) = mirrored_endpoints(&ep, NODE).expect("converts");
    assert_eq!(service.name, name);
    assert_eq!(slices.len(), 1);
    assert!(slices[0].slice_name.len() <= 63);
}

#[test]
fn invalid_objects_are_rejected_whole_with_the_field_named() {
    let sub = |addr: Value, ports: Value| json!([{"addresses": [addr], "ports": ports}]);
    let cases = [
        (
            endpoints(
                "api",
                sub(json!({"ip": "10.244.1.300"}), json!([{"port": 80}])),
            ),
            "subsets.addresses.ip",
        ),
        (
            endpoints(
                "api",
                json!([{"notReadyAddresses": [{"ip": "127.0.0.1"}], "ports": [{"port": 80}]}]),
            ),
            "subsets.notReadyAddresses.ip",
        ),
        (
            endpoints(
                "api",
                sub(json!({"ip": "10.244.1.1"}), json!([{"port": 70000}])),
            ),
            "subsets.ports.port",
        ),
        (
            endpoints(
                "api",
                sub(json!({"ip": "10.244.1.1"}), json!([{"port": 0}])),
            ),
            "subsets.ports.port",
        ),
        (
            endpoints(
                "api",
                sub(
                    json!({"ip": "10.244.1.1"}),
                    json!([{"name": "x\" accept", "port": 80}]),
                ),
            ),
            "subsets.ports.name",
        ),
        (
            endpoints(
                "api",
                sub(
                    json!({"ip": "10.244.1.1", "nodeName": "a b"}),
                    json!([{"port": 80}]),
                ),
            ),
            "subsets.addresses.nodeName",
        ),
        (
            endpoints(
                "api\n; flush",
                sub(json!({"ip": "10.244.1.1"}), json!([{"port": 80}])),
            ),
            "metadata.name",
        ),
    ];
    for (ep, field) in cases {
        let err = mirror(&ep).expect_err("rejected");
        assert!(err.to_string().contains(field), "{err} names {field}");
    }
    let proto = endpoints(
        "api",
        sub(
            json!({"ip": "10.244.1.1"}),
            json!([{"port": 80, "protocol": "ICMP"}]),
        ),
    );
    assert_eq!(mirror(&proto), Err(InvalidObject::Protocol("ICMP".into())));
}

// Precedence and change tracking in `ProxyState`.

fn service() -> Object {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"namespace": "web", "name": "api"},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "http", "port": 80}]},
    }))
    .expect("Service");
    Object::Service(Box::new(svc))
}

fn endpoints_object(name: &str, ips: &[&str]) -> Object {
    let addresses: Vec<Value> = ips.iter().map(|ip| json!({"ip": ip})).collect();
    Object::Endpoints(Box::new(endpoints(
        name,
        json!([{"addresses": addresses, "ports": [{"name": "http", "port": 8080}]}]),
    )))
}

fn slice_object(ips: &[&str]) -> Object {
    let eps: Vec<Value> = ips.iter().map(|ip| json!({"addresses": [ip]})).collect();
    Object::EndpointSlice(Box::new(
        serde_json::from_value(json!({
            "metadata": {"namespace": "web", "name": "api-abc", "labels": {LABEL_SERVICE_NAME: "api"}},
            "addressType": "IPv4",
            "endpoints": eps,
            "ports": [{"name": "http", "port": 8080}],
        }))
        .expect("EndpointSlice"),
    ))
}

fn port_name(service: &str) -> ServicePortName {
    ServicePortName {
        service: ServiceKey::new("web", service),
        port: "http".into(),
        protocol: Protocol::Tcp,
    }
}

fn ips(state: &ProxyState, service: &str) -> Vec<String> {
    state
        .endpoints(&port_name(service))
        .iter()
        .map(Endpoint::to_string)
        .collect()
}

fn apply(state: &mut ProxyState, obj: Object) -> Applied {
    state.apply(SourceEvent::Upsert(obj)).expect("accepted")
}

fn touched(state: &mut ProxyState) -> Vec<String> {
    state
        .take_changes()
        .services
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn a_service_with_only_endpoints_gets_the_mirrored_endpoints() {
    let mut state = ProxyState::new(NODE);
    apply(&mut state, service());
    apply(
        &mut state,
        endpoints_object("api", &["10.244.1.1", "10.244.1.2"]),
    );
    assert_eq!(ips(&state, "api"), ["10.244.1.1:8080", "10.244.1.2:8080"]);
    let states = state.service_state(&ServiceKey::new("web", "api"));
    assert_eq!(states[0].endpoints.cluster.len(), 2);

    let changes = state.take_changes();
    assert_eq!(changes.endpoint_changes, 1);
    // Editing it touches that Service only; deleting it removes its endpoints.
    apply(&mut state, endpoints_object("other", &["10.244.9.9"]));
    touched(&mut state);
    apply(&mut state, endpoints_object("api", &["10.244.1.3"]));
    assert_eq!(touched(&mut state), ["web/api"]);
    assert_eq!(ips(&state, "api"), ["10.244.1.3:8080"]);
    assert_eq!(
        apply(&mut state, endpoints_object("api", &["10.244.1.3"])),
        Applied::Unchanged
    );
    state
        .apply(SourceEvent::Delete(
            Kind::Endpoints,
            ObjectKey {
                namespace: "web".into(),
                name: "api".into(),
            },
        ))
        .expect("deleted");
    assert_eq!(touched(&mut state), ["web/api"]);
    assert!(ips(&state, "api").is_empty());
}

#[test]
fn endpoints_that_arrive_before_their_service_take_effect_when_it_does() {
    let mut state = ProxyState::new(NODE);
    apply(&mut state, endpoints_object("api", &["10.244.1.1"]));
    assert!(state
        .service_state(&ServiceKey::new("web", "api"))
        .is_empty());
    apply(&mut state, service());
    let states = state.service_state(&ServiceKey::new("web", "api"));
    assert_eq!(states[0].endpoints.cluster.len(), 1);
}

#[test]
fn a_services_own_slices_win_over_mirrored_endpoints_and_give_way_when_they_go() {
    let mut state = ProxyState::new(NODE);
    apply(&mut state, service());
    apply(&mut state, endpoints_object("api", &["10.244.1.1"]));
    touched(&mut state);

    // A slice added after the Endpoints replaces them.
    apply(&mut state, slice_object(&["10.244.2.1"]));
    assert_eq!(touched(&mut state), ["web/api"]);
    assert_eq!(ips(&state, "api"), ["10.244.2.1:8080"]);

    // While shadowed, a change to the Endpoints programs nothing, but is kept.
    assert_eq!(
        apply(&mut state, endpoints_object("api", &["10.244.1.5"])),
        Applied::Unchanged
    );
    assert!(touched(&mut state).is_empty());
    assert_eq!(ips(&state, "api"), ["10.244.2.1:8080"]);

    // The slice removed: the latest mirrored endpoints take effect again.
    state
        .apply(SourceEvent::Delete(
            Kind::EndpointSlice,
            ObjectKey {
                namespace: "web".into(),
                name: "api-abc".into(),
            },
        ))
        .expect("deleted");
    assert_eq!(touched(&mut state), ["web/api"]);
    assert_eq!(ips(&state, "api"), ["10.244.1.5:8080"]);
}

#[test]
fn an_invalid_endpoints_update_is_rejected_and_the_previous_version_stays() {
    let mut state = ProxyState::new(NODE);
    apply(&mut state, service());
    apply(&mut state, endpoints_object("api", &["10.244.1.1"]));
    touched(&mut state);
    let err = state
        .apply(SourceEvent::Upsert(endpoints_object("api", &["not-an-ip"])))
        .expect_err("rejected");
    assert_eq!(err.kind, Kind::Endpoints);
    assert_eq!(err.key.to_string(), "web/api");
    assert!(touched(&mut state).is_empty());
    assert_eq!(ips(&state, "api"), ["10.244.1.1:8080"]);
}

#[test]
fn a_skip_mirror_update_withdraws_the_mirrored_endpoints() {
    let mut state = ProxyState::new(NODE);
    apply(&mut state, service());
    apply(&mut state, endpoints_object("api", &["10.244.1.1"]));
    touched(&mut state);
    let mut skipped = endpoints(
        "api",
        json!([{"addresses": [{"ip": "10.244.1.1"}], "ports": [{"name": "http", "port": 8080}]}]),
    );
    skipped.metadata.labels = Some([(LABEL_SKIP_MIRROR.to_string(), "true".to_string())].into());
    apply(&mut state, Object::Endpoints(Box::new(skipped)));
    assert_eq!(touched(&mut state), ["web/api"]);
    assert!(ips(&state, "api").is_empty());
}

// A model of the precedence: each Service sees its own slice if it has one (even an empty
// one), else its Endpoints; a change is recorded for exactly the Services whose view changed
// (and, for a change of a slice, its Service: a slice change is always replanned).

use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Sets (or with `None`, deletes) Service `svc`'s slice to these pod numbers.
    Slice(usize, Option<Vec<u8>>),
    /// The same for its Endpoints.
    Endpoints(usize, Option<Vec<u8>>),
}

fn arb_op() -> impl Strategy<Value = Op> {
    let pods = prop::option::of(prop::collection::vec(1u8..6, 0..4));
    prop_oneof![
        (0usize..2, pods.clone()).prop_map(|(s, p)| Op::Slice(s, p)),
        (0usize..2, pods).prop_map(|(s, p)| Op::Endpoints(s, p)),
    ]
}

const SERVICES: [&str; 2] = ["api", "db"];

fn pod_ips(pods: &[u8]) -> Vec<String> {
    pods.iter().map(|p| format!("10.244.1.{p}")).collect()
}

fn model_view(slice: &Option<Vec<u8>>, eps: &Option<Vec<u8>>) -> Vec<String> {
    let pods: BTreeSet<u8> = slice
        .as_ref()
        .or(eps.as_ref())
        .into_iter()
        .flatten()
        .copied()
        .collect();
    pods.iter().map(|p| format!("10.244.1.{p}:8080")).collect()
}

fn service_named(name: &str) -> Object {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"namespace": "web", "name": name},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "http", "port": 80}]},
    }))
    .expect("Service");
    Object::Service(Box::new(svc))
}

fn slice_for(name: &str, pods: &[u8]) -> Object {
    let eps: Vec<Value> = pod_ips(pods)
        .into_iter()
        .map(|ip| json!({"addresses": [ip]}))
        .collect();
    Object::EndpointSlice(Box::new(
        serde_json::from_value(json!({
            "metadata": {"namespace": "web", "name": format!("{name}-own"),
                         "labels": {LABEL_SERVICE_NAME: name}},
            "addressType": "IPv4",
            "endpoints": eps,
            "ports": [{"name": "http", "port": 8080}],
        }))
        .expect("EndpointSlice"),
    ))
}

proptest! {
    #[test]
    fn precedence_follows_the_model_and_changes_touch_only_their_service(
        ops in prop::collection::vec(arb_op(), 1..40)
    ) {
        let mut state = ProxyState::new(NODE);
        for name in SERVICES {
            apply(&mut state, service_named(name));
        }
        state.take_changes();
        let mut slices: [Option<Vec<u8>>; 2] = [None, None];
        let mut eps: [Option<Vec<u8>>; 2] = [None, None];
        for op in ops {
            let before: Vec<Vec<String>> =
                (0..2).map(|s| model_view(&slices[s], &eps[s])).collect();
            let (svc, is_slice) = match &op {
                Op::Slice(s, p) => {
                    let name = SERVICES[*s];
                    match p {
                        Some(p) => { apply(&mut state, slice_for(name, p)); }
                        None => {
                            state.apply(SourceEvent::Delete(Kind::EndpointSlice, ObjectKey {
                                namespace: "web".into(),
                                name: format!("{name}-own"),
                            })).expect("deleted");
                        }
                    }
                    slices[*s] = p.clone();
                    (*s, true)
                }
                Op::Endpoints(s, p) => {
                    let name = SERVICES[*s];
                    match p {
                        Some(p) => {
                            let ips = pod_ips(p);
                            let refs: Vec<&str> = ips.iter().map(String::as_str).collect();
                            apply(&mut state, endpoints_object(name, &refs));
                        }
                        None => {
                            state.apply(SourceEvent::Delete(Kind::Endpoints, ObjectKey {
                                namespace: "web".into(),
                                name: name.into(),
                            })).expect("deleted");
                        }
                    }
                    eps[*s] = p.clone();
                    (*s, false)
                }
            };
            let changed: BTreeSet<String> = state
                .take_changes()
                .services
                .iter()
                .map(|k| k.name.clone())
                .collect();
            for s in 0..2 {
                let want = model_view(&slices[s], &eps[s]);
                prop_assert_eq!(ips(&state, SERVICES[s]), want.clone(), "{}", SERVICES[s]);
                if want != before[s] {
                    prop_assert!(changed.contains(SERVICES[s]), "{:?} unrecorded", op);
                }
                if s != svc {
                    prop_assert!(!changed.contains(SERVICES[s]), "{:?} touched {}", op, SERVICES[s]);
                }
            }
            // An Endpoints change that changes no view (shadowed, or the same) records nothing.
            if !is_slice && model_view(&slices[svc], &eps[svc]) == before[svc] {
                prop_assert!(changed.is_empty(), "{:?} recorded {:?}", op, changed);
            }
        }
    }
}
