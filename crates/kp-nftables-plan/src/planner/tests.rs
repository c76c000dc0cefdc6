//! The planner's record of the kernel: elements wanted by several Service ports, owners handing
//! over, and partial syncs that always leave the kernel (replayed by the tracer) holding what a
//! full build from scratch would.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::model::IpFamily;
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use serde_json::{json, Value};

use super::{NodeContext, Planner};
use crate::element::{Atom, Tuple};
use crate::layout::{PlanConfig, SetId};
use crate::NftTracer;

/// Test addresses per family: ClusterIPs, an external IP, endpoints (documentation and
/// private ranges only).
struct Addrs {
    family: IpFamily,
    cluster_ips: [&'static str; 3],
    external_ip: &'static str,
    lb_ip: &'static str,
    source_range: &'static str,
    endpoint_prefix: &'static str,
}

const V4: Addrs = Addrs {
    family: IpFamily::V4,
    cluster_ips: ["10.96.0.1", "10.96.0.2", "10.96.0.3"],
    external_ip: "203.0.113.1",
    lb_ip: "198.51.100.7",
    source_range: "192.0.2.0/24",
    endpoint_prefix: "10.0.0.",
};

const V6: Addrs = Addrs {
    family: IpFamily::V6,
    cluster_ips: ["fd00:96::1", "fd00:96::2", "fd00:96::3"],
    external_ip: "2001:db8::1",
    lb_ip: "2001:db8:1::7",
    source_range: "2001:db8:2::/48",
    endpoint_prefix: "fd00:10::",
};

fn service(name: &str, spec: Value) -> Object {
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "t"},
        "spec": spec,
    }))
    .expect("service");
    Object::Service(Box::new(svc))
}

fn service_with_lb(name: &str, spec: Value, lb_ip: &str) -> Object {
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "t"},
        "spec": spec,
        "status": {"loadBalancer": {"ingress": [{"ip": lb_ip}]}},
    }))
    .expect("service");
    Object::Service(Box::new(svc))
}

/// A slice for Service `name`: (address, on this node, ready) per endpoint, ports `http` (TCP
/// 8080) and `dns` (UDP 5353).
fn slice(name: &str, family: IpFamily, eps: &[(String, bool, bool)]) -> Object {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(ip, local, ready)| {
            json!({"addresses": [ip], "conditions": {"ready": ready, "serving": ready,
                   "terminating": !ready},
                   "nodeName": if *local { "node-0" } else { "node-1" }})
        })
        .collect();
    let slice: EndpointSlice = serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-x"), "namespace": "t",
            "labels": {"kubernetes.io/service-name": name}},
        "addressType": if family == IpFamily::V4 { "IPv4" } else { "IPv6" },
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080},
                  {"name": "dns", "protocol": "UDP", "port": 5353}],
        "endpoints": endpoints,
    }))
    .expect("slice");
    Object::EndpointSlice(Box::new(slice))
}

fn upsert(state: &mut ProxyState, obj: Object) {
    state.apply(SourceEvent::Upsert(obj)).expect("valid object");
}

fn delete(state: &mut ProxyState, kind: Kind, name: &str) {
    let key = ObjectKey {
        namespace: "t".into(),
        name: name.into(),
    };
    state.apply(SourceEvent::Delete(kind, key)).expect("delete");
}

fn new_state() -> ProxyState {
    let mut state = ProxyState::new("node-0");
    for k in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        state.apply(SourceEvent::Synced(k)).expect("synced");
    }
    state
}

fn planner(family: IpFamily) -> Planner {
    Planner::new(PlanConfig::new(family))
}

/// Syncs the changes so far into `p` and the tracer, checking the tracer accepts them and holds
/// as many elements per set as the planner believes.
fn sync(p: &mut Planner, state: &mut ProxyState, tracer: &mut NftTracer) -> String {
    let changes = state.take_changes();
    let tx = p.partial(state, &changes.services, &NodeContext::default(), false);
    tracer
        .apply(&tx.text)
        .unwrap_or_else(|e| panic!("{e}\n{}", tx.text));
    for set in p.all_sets() {
        assert_eq!(
            tracer.element_count(p.config().family, &set.name()),
            p.expected_elements(set).len(),
            "{set:?} after:\n{}",
            tx.text
        );
    }
    tx.text
}

/// A plan's elements with each entry's endpoints as a sorted list rather than by slot (a
/// partial sync keeps endpoints in their slots; a full build numbers them in order), leaving
/// out empty sets (classes stay declared after their last entry goes).
fn normalized(p: &Planner) -> BTreeMap<String, BTreeMap<Tuple, Vec<Option<Tuple>>>> {
    let mut out: BTreeMap<String, BTreeMap<Tuple, Vec<Option<Tuple>>>> = BTreeMap::new();
    for set in p.all_sets() {
        for (k, v) in p.expected_elements(set) {
            let key = match set {
                SetId::ClassEndpoints(..) => Tuple::new(&k.atoms()[..k.atoms().len() - 1]),
                _ => k,
            };
            let vals = out.entry(set.name()).or_default().entry(key).or_default();
            vals.push(v);
            vals.sort();
        }
    }
    out
}

#[test]
fn a_cluster_ip_shared_by_two_services_stays_until_both_are_gone() {
    let mut state = new_state();
    let mut p = planner(IpFamily::V4);
    let mut tracer = NftTracer::new(vec![]);
    tracer
        .apply(&p.full(&state, &NodeContext::default()).text)
        .expect("empty table");
    for (name, port) in [("a", 80), ("b", 81)] {
        upsert(
            &mut state,
            service(
                name,
                json!({"clusterIP": "10.96.0.1", "ports": [{"name": "http", "protocol": "TCP", "port": port}]}),
            ),
        );
    }
    sync(&mut p, &mut state, &mut tracer);
    assert_eq!(tracer.element_count(IpFamily::V4, "cluster-ips"), 1);
    assert_eq!(tracer.element_count(IpFamily::V4, "no-endpoint-vips"), 2);

    delete(&mut state, Kind::Service, "a");
    let text = sync(&mut p, &mut state, &mut tracer);
    assert!(!text.contains("cluster-ips"), "{text}");
    assert_eq!(tracer.element_count(IpFamily::V4, "cluster-ips"), 1);
    assert_eq!(tracer.element_count(IpFamily::V4, "no-endpoint-vips"), 1);

    delete(&mut state, Kind::Service, "b");
    let text = sync(&mut p, &mut state, &mut tracer);
    assert!(
        text.contains("delete element ip kube-proxy cluster-ips { 10.96.0.1 }"),
        "{text}"
    );
    assert_eq!(tracer.element_count(IpFamily::V4, "cluster-ips"), 0);
}

#[test]
fn an_entry_claimed_twice_keeps_the_first_claim_then_hands_over_to_the_second() {
    let mut state = new_state();
    let mut p = planner(IpFamily::V4);
    let mut tracer = NftTracer::new(vec![]);
    tracer
        .apply(&p.full(&state, &NodeContext::default()).text)
        .expect("empty table");
    let ep = |ip: &str| (ip.to_string(), false, true);
    // Both Services claim 203.0.113.1 TCP 80, with different endpoints.
    for (name, cip, eps) in [
        ("first", "10.96.0.1", vec![ep("10.0.0.1"), ep("10.0.0.2")]),
        ("second", "10.96.0.2", vec![ep("10.0.0.3"), ep("10.0.0.4")]),
    ] {
        upsert(
            &mut state,
            service(
                name,
                json!({"clusterIP": cip, "externalIPs": ["203.0.113.1"],
                       "ports": [{"name": "http", "protocol": "TCP", "port": 80}]}),
            ),
        );
        upsert(&mut state, slice(name, IpFamily::V4, &eps));
        sync(&mut p, &mut state, &mut tracer);
    }
    let key = Tuple::new(vec![
        Atom::Ip("203.0.113.1".parse().unwrap()),
        Atom::Proto(kp_core::model::Protocol::Tcp),
        Atom::Port(80),
    ]);
    let eps = |p: &Planner| -> Vec<String> {
        p.endpoints_of(&key)
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    assert_eq!(eps(&p), ["10.0.0.1 . 8080", "10.0.0.2 . 8080"]);

    // The first goes: the second's endpoints take the same slots, as a replacement.
    delete(&mut state, Kind::Service, "first");
    let text = sync(&mut p, &mut state, &mut tracer);
    assert_eq!(eps(&p), ["10.0.0.3 . 8080", "10.0.0.4 . 8080"]);
    assert!(
        text.contains("203.0.113.1 . tcp . 80 . 0 : 10.0.0.3 . 8080"),
        "{text}"
    );
    // And when the second goes too, the entry is gone.
    delete(&mut state, Kind::Service, "second");
    sync(&mut p, &mut state, &mut tracer);
    assert!(p.endpoints_of(&key).is_empty());
    assert_eq!(tracer.element_count(IpFamily::V4, "vips-2-endpoints"), 0);
    assert_eq!(tracer.element_count(IpFamily::V4, "vips-2"), 0);
}

/// A small deterministic generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A random Service `i`: shared ClusterIPs and endpoint addresses (so elements such as
/// `cluster-ips` and `hairpin` have several owners), but its own ports, so that no two
/// Services want different values under one key.
fn random_service(rng: &mut Rng, a: &Addrs, i: usize) -> Object {
    let port = 1000 + i as u16 * 10;
    let mut ports = vec![json!({"name": "http", "protocol": "TCP", "port": port})];
    if rng.chance(30) {
        ports.push(json!({"name": "dns", "protocol": "UDP", "port": port + 1}));
    }
    let family = if a.family == IpFamily::V4 {
        "IPv4"
    } else {
        "IPv6"
    };
    let mut spec = json!({
        "clusterIP": a.cluster_ips[rng.below(3) as usize],
        "ipFamilies": [family],
        "ports": ports,
    });
    if rng.chance(30) {
        spec["externalIPs"] = json!([a.external_ip]);
    }
    let lb = rng.chance(25);
    if lb || rng.chance(30) {
        spec["type"] = json!(if lb { "LoadBalancer" } else { "NodePort" });
        for (k, p) in spec["ports"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .enumerate()
        {
            p["nodePort"] = json!(30000 + i * 10 + k);
        }
        if rng.chance(50) {
            spec["externalTrafficPolicy"] = json!("Local");
        }
        if lb && rng.chance(50) {
            spec["loadBalancerSourceRanges"] = json!([a.source_range]);
        }
    }
    if rng.chance(25) {
        spec["internalTrafficPolicy"] = json!("Local");
    }
    if rng.chance(25) {
        spec["sessionAffinity"] = json!("ClientIP");
    }
    let name = format!("s{i}");
    if lb {
        service_with_lb(&name, spec, a.lb_ip)
    } else {
        service(&name, spec)
    }
}

fn random_slice(rng: &mut Rng, a: &Addrs, i: usize) -> Object {
    let mut eps: Vec<(String, bool, bool)> = Vec::new();
    for j in 1..=8 {
        if rng.chance(50) {
            let ready = !rng.chance(15);
            eps.push((format!("{}{j}", a.endpoint_prefix), j % 2 == 0, ready));
        }
    }
    slice(&format!("s{i}"), a.family, &eps)
}

fn partial_syncs_match_a_full_build(a: &Addrs) {
    for seed in 1..=12u64 {
        let mut rng = Rng(seed);
        let mut state = new_state();
        let mut p = planner(a.family);
        let mut tracer = NftTracer::new(vec![]);
        tracer
            .apply(&p.full(&state, &NodeContext::default()).text)
            .expect("empty table");
        for step in 0..60 {
            let i = rng.below(6) as usize;
            match rng.below(10) {
                0 => delete(&mut state, Kind::Service, &format!("s{i}")),
                1 => delete(&mut state, Kind::EndpointSlice, &format!("s{i}-x")),
                2..=4 => upsert(&mut state, random_service(&mut rng, a, i)),
                _ => upsert(&mut state, random_slice(&mut rng, a, i)),
            }
            sync(&mut p, &mut state, &mut tracer);
            let mut fresh = planner(a.family);
            fresh.full(&state, &NodeContext::default());
            assert_eq!(
                normalized(&p),
                normalized(&fresh),
                "seed {seed}, step {step}"
            );
        }
        // Owner numbers are reused: they stay within the ports alive at once, however many
        // changes went by.
        assert!(p.meta.next_owner < 40, "{}", p.meta.next_owner);
    }
}

#[test]
fn partial_syncs_keep_an_ipv4_table_equal_to_a_full_build() {
    partial_syncs_match_a_full_build(&V4);
}

#[test]
fn partial_syncs_keep_an_ipv6_table_equal_to_a_full_build() {
    partial_syncs_match_a_full_build(&V6);
}

#[test]
fn ipv6_elements_of_every_shape_render_and_read_back() {
    let a = &V6;
    let mut state = new_state();
    let spec = json!({
        "type": "LoadBalancer", "clusterIP": a.cluster_ips[0], "ipFamilies": ["IPv6"],
        "externalIPs": [a.external_ip], "loadBalancerSourceRanges": [a.source_range],
        "externalTrafficPolicy": "Local", "sessionAffinity": "ClientIP",
        "ports": [{"name": "http", "protocol": "TCP", "port": 443, "nodePort": 30443}],
    });
    upsert(&mut state, service_with_lb("web", spec, a.lb_ip));
    let eps: Vec<(String, bool, bool)> = (1..=3)
        .map(|j| (format!("{}{j}", a.endpoint_prefix), j == 1, true))
        .collect();
    upsert(&mut state, slice("web", IpFamily::V6, &eps));
    let mut p = planner(IpFamily::V6);
    let tx = p.full(&state, &NodeContext::default());
    let mut tracer = NftTracer::new(vec![]);
    tracer
        .apply(&tx.text)
        .unwrap_or_else(|e| panic!("{e}\n{}", tx.text));
    let mut shapes = BTreeSet::new();
    for set in p.all_sets() {
        let els = p.expected_elements(set);
        assert_eq!(
            tracer.element_count(IpFamily::V6, &set.name()),
            els.len(),
            "{set:?}"
        );
        for (k, v) in els {
            // What the text says is what the record holds.
            let line = match &v {
                Some(v) => format!("{k} : {v}"),
                None => k.to_string(),
            };
            assert!(tx.text.contains(&line), "{line} not in\n{}", tx.text);
            shapes.insert(set.name());
        }
    }
    for name in [
        "cluster-ips",
        "firewall-allow",
        "hairpin",
        "vips-3-endpoints",
        "nodeports-1-endpoints",
        "local-source-vips-3-endpoints",
    ] {
        assert!(shapes.contains(name), "no {name} element in {shapes:?}");
    }
}

/// The read-back's spelling of a tuple: slots as ports, single-address networks as addresses.
fn as_read_back(t: &Tuple) -> Tuple {
    Tuple::new(
        t.atoms()
            .iter()
            .map(|a| match *a {
                Atom::Slot(s) => Atom::Port(s as u16),
                Atom::Net(n) if n.prefix_len() == n.max_prefix_len() => Atom::Ip(n.addr()),
                a => a,
            })
            .collect::<Vec<_>>(),
    )
}

#[test]
fn every_expected_element_can_be_looked_up_one_at_a_time() {
    for a in [&V4, &V6] {
        let mut rng = Rng(7);
        let mut state = new_state();
        for i in 0..6 {
            upsert(&mut state, random_service(&mut rng, a, i));
            upsert(&mut state, random_slice(&mut rng, a, i));
        }
        let mut p = planner(a.family);
        let node = NodeContext {
            local_cidrs: vec![if a.family == IpFamily::V4 {
                "10.0.0.0/24"
            } else {
                "fd00:10::/64"
            }
            .parse()
            .unwrap()],
            node_port_addresses: vec![if a.family == IpFamily::V4 {
                "192.0.2.1/32"
            } else {
                "2001:db8::9/128"
            }
            .parse()
            .unwrap()],
        };
        p.full(&state, &node);
        let mut looked_up = 0;
        for set in p.all_sets() {
            let expected = p.expected_elements(set);
            assert_eq!(p.expected_len(set), expected.len(), "{set:?}");
            for (k, v) in &expected {
                assert_eq!(p.expected_value(set, k).as_ref(), Some(v), "{set:?} {k}");
                assert_eq!(
                    p.expected_value(set, &as_read_back(k)).as_ref(),
                    Some(v),
                    "{set:?} {k}"
                );
                looked_up += 1;
            }
        }
        assert!(looked_up > 50, "{looked_up}");
        // Keys that are not there, or not of the set's shape, are not found.
        let stranger = Tuple::new(vec![Atom::Ip(a.external_ip.parse().unwrap())]);
        assert_eq!(p.expected_value(SetId::ClusterIps, &stranger), None);
        assert_eq!(p.expected_value(SetId::Hairpin, &stranger), None);
        assert_eq!(
            p.expected_value(SetId::ClassEndpoints(crate::Route::Vips, 1), &stranger),
            None
        );
        assert_eq!(
            p.expected_value(SetId::ClusterIps, &Tuple::new(vec![])),
            None
        );
    }
}
