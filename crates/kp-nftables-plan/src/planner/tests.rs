//! The planner's record of the kernel: elements wanted by several Service ports, owners handing
//! over, and partial syncs that always leave the kernel (replayed by the tracer) holding what a
//! full build from scratch would.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::model::IpFamily;
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_nftables_test::NftTracer;
use serde_json::{json, Value};

use super::{KernelTable, NodeContext, Planner, TransactionSink};
use crate::element::{canonical, Atom, ElementDigest, Tuple};
use crate::layout::{PlanConfig, SetId};
use crate::ElementBatch;

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

/// An empty IPv4 table, programmed: the state, the planner and the tracer holding it.
fn empty_v4_table() -> (ProxyState, Planner, NftTracer) {
    let state = new_state();
    let mut p = planner(IpFamily::V4);
    let mut tracer = NftTracer::new(vec![]);
    tracer
        .apply(&p.full(&state, &NodeContext::default()).text)
        .expect("empty table");
    (state, p, tracer)
}

/// The dispatch key of external IP 203.0.113.1, TCP port 80.
fn external_key() -> Tuple {
    Tuple::new(vec![
        Atom::Ip("203.0.113.1".parse().unwrap()),
        Atom::Proto(kp_core::model::Protocol::Tcp),
        Atom::Port(80),
    ])
}

/// The endpoints `p` holds behind `key`, as text.
fn endpoint_list(p: &Planner, key: &Tuple) -> Vec<String> {
    p.endpoints_of(key)
        .iter()
        .map(ToString::to_string)
        .collect()
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
    let (mut state, mut p, mut tracer) = empty_v4_table();
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
    let key = external_key();
    let eps = |p: &Planner| endpoint_list(p, &key);
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

/// Two Services listing the same external IP and port (nothing allocates externalIPs): the
/// entry carries the first one's endpoints in name order, whatever order the claims came in and
/// whatever changed since, as a full build of the same state has it. Before ranks, a partial
/// sync kept whichever Service claimed first, and a change to the holder handed the entry to
/// the other (found by kp-fuzz).
#[test]
fn an_entry_two_services_want_goes_to_the_first_in_name_order_after_any_history() {
    let (mut state, mut p, mut tracer) = empty_v4_table();
    let ep = |ip: &str| (ip.to_string(), false, true);
    let shared = |name: &str, cip: &str| {
        service(
            name,
            json!({"clusterIP": cip, "externalIPs": ["203.0.113.1"],
                   "ports": [{"name": "http", "protocol": "TCP", "port": 80}]}),
        )
    };
    let key = external_key();
    let eps = |p: &Planner| endpoint_list(p, &key);
    let same_as_full = |p: &Planner, state: &ProxyState, step: &str| {
        let mut fresh = planner(IpFamily::V4);
        fresh.full(state, &NodeContext::default());
        assert_eq!(normalized(p), normalized(&fresh), "{step}");
    };
    // `z` first, then `a`: `a` takes the entry over.
    upsert(&mut state, shared("z", "10.96.0.2"));
    upsert(&mut state, slice("z", IpFamily::V4, &[ep("10.0.0.9")]));
    sync(&mut p, &mut state, &mut tracer);
    upsert(&mut state, shared("a", "10.96.0.1"));
    upsert(&mut state, slice("a", IpFamily::V4, &[ep("10.0.0.1")]));
    let text = sync(&mut p, &mut state, &mut tracer);
    assert_eq!(eps(&p), ["10.0.0.1 . 8080"], "{text}");
    same_as_full(&p, &state, "a added after z");

    // A change to `a` keeps it there, with its new endpoint.
    upsert(&mut state, slice("a", IpFamily::V4, &[ep("10.0.0.2")]));
    sync(&mut p, &mut state, &mut tracer);
    assert_eq!(eps(&p), ["10.0.0.2 . 8080"]);
    same_as_full(&p, &state, "a changed");

    // A change to `z` moves nothing.
    upsert(&mut state, slice("z", IpFamily::V4, &[ep("10.0.0.8")]));
    let text = sync(&mut p, &mut state, &mut tracer);
    assert_eq!(eps(&p), ["10.0.0.2 . 8080"]);
    assert!(!text.contains("203.0.113.1 . tcp . 80 . 0 :"), "{text}");
    same_as_full(&p, &state, "z changed");

    // `a` goes: `z` has it; `a` comes back: `a` has it again.
    delete(&mut state, Kind::Service, "a");
    sync(&mut p, &mut state, &mut tracer);
    assert_eq!(eps(&p), ["10.0.0.8 . 8080"]);
    same_as_full(&p, &state, "a deleted");
    upsert(&mut state, shared("a", "10.96.0.1"));
    sync(&mut p, &mut state, &mut tracer);
    assert_eq!(eps(&p), ["10.0.0.2 . 8080"]);
    same_as_full(&p, &state, "a back");
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
            ..NodeContext::default()
        };
        p.full(&state, &node);
        let mut looked_up = 0;
        for set in p.all_sets() {
            let expected = p.expected_elements(set);
            assert_eq!(p.expected_len(set), expected.len(), "{set:?}");
            // Iterating lends the same elements, each once.
            let mut lent = BTreeMap::new();
            p.for_each_expected(set, |k, v| {
                let old = lent.insert(Tuple::new(k.to_vec()), v.map(|v| Tuple::new(v.to_vec())));
                assert!(old.is_none(), "{set:?}: {k:?} lent twice");
            });
            assert_eq!(lent, expected, "{set:?}");
            for (k, v) in &expected {
                assert_eq!(p.expected_value(set, k).as_ref(), Some(v), "{set:?} {k}");
                assert_eq!(
                    p.expected_value(set, &as_read_back(k)).as_ref(),
                    Some(v),
                    "{set:?} {k}"
                );
                // The check's digests of the read-back spelling are the plan's.
                let digest = |k: &Tuple, v: &Option<Tuple>| {
                    ElementDigest::of(k.atoms(), v.as_ref().map(Tuple::atoms))
                };
                assert_eq!(
                    digest(&as_read_back(k), &v.as_ref().map(as_read_back)),
                    digest(k, v),
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

// --- Adopting a table read back from the kernel ----------------------------------------------

/// Node settings with interval elements of every kind, single addresses among them (which the
/// read-back spells as plain addresses).
fn adopt_node(a: &Addrs) -> NodeContext {
    let nets = |v: &[&str]| v.iter().map(|n| n.parse().unwrap()).collect::<Vec<_>>();
    match a.family {
        IpFamily::V4 => NodeContext {
            local_cidrs: nets(&["10.244.0.0/16"]),
            node_port_addresses: nets(&["192.0.2.1/32", "198.51.100.0/24"]),
            node_ips: vec!["192.0.2.1".parse().unwrap()],
            service_cidrs: nets(&["10.96.0.0/16"]),
            local_interface: None,
        },
        IpFamily::V6 => NodeContext {
            local_cidrs: nets(&["fd00:10::/48"]),
            node_port_addresses: nets(&["2001:db8::1/128", "2001:db8:5::/64"]),
            node_ips: vec!["2001:db8::1".parse().unwrap()],
            service_cidrs: nets(&["fd00:96::/112"]),
            local_interface: None,
        },
    }
}

fn adopt_config(family: IpFamily) -> PlanConfig {
    PlanConfig {
        detect_local: true,
        node_ports_restricted: true,
        ..PlanConfig::new(family)
    }
}

/// What the kernel holds after `p`'s transactions, as the read-back reports it: every set (the
/// dynamic affinity maps empty), canonical spellings, the chains' rule ids, the table comment.
fn kernel_of(p: &Planner) -> KernelTable {
    let mut chains = p.expected_chains();
    // The kernel lists rules in the order they were added, which for the unordered chains
    // need not be sorted.
    for c in crate::layout::UNORDERED_CHAINS {
        if let Some(rules) = chains.get_mut(*c) {
            rules.reverse();
        }
    }
    KernelTable {
        chains,
        sets: p
            .all_sets()
            .into_iter()
            .map(|s| {
                let els = p
                    .expected_elements(s)
                    .iter()
                    .map(|(k, v)| (canonical(k), v.as_ref().map(canonical)))
                    .collect();
                (s.name(), els)
            })
            .collect(),
        comment: Some(crate::layout::table_comment(p.config())),
    }
}

/// Element changes that turn `from` into `to`: a deletion for each element `to` does not hold
/// (or holds with another value), an addition for each element `from` does not hold.
fn element_difference(from: &KernelTable, to: &KernelTable) -> usize {
    let empty = BTreeMap::new();
    let names: BTreeSet<&String> = from.sets.keys().chain(to.sets.keys()).collect();
    let mut n = 0;
    for name in names {
        let (a, b) = (
            from.sets.get(name).unwrap_or(&empty),
            to.sets.get(name).unwrap_or(&empty),
        );
        n += a.iter().filter(|(k, v)| b.get(*k) != Some(*v)).count();
        n += b.iter().filter(|(k, v)| a.get(*k) != Some(*v)).count();
    }
    n
}

fn random_state(a: &Addrs, seed: u64, services: usize) -> ProxyState {
    let mut rng = Rng(seed);
    let mut state = new_state();
    for i in 0..services {
        upsert(&mut state, random_service(&mut rng, a, i));
        upsert(&mut state, random_slice(&mut rng, a, i));
    }
    let _ = state.take_changes();
    state
}

fn adopting_an_unchanged_table_sends_nothing(a: &Addrs) {
    let node = adopt_node(a);
    for seed in 1..=6u64 {
        let state = random_state(a, seed, 12);
        let mut before = Planner::new(adopt_config(a.family));
        before.full(&state, &node);
        let kernel = kernel_of(&before);
        let mut p = Planner::new(adopt_config(a.family));
        let mut batch = ElementBatch::new();
        let tx = p.adopt(&state, &node, &kernel, &mut batch).expect("adopt");
        assert_eq!(tx.operations, 0, "seed {seed}: {}", tx.text);
        assert!(tx.text.is_empty() && batch.is_empty(), "seed {seed}");
        assert!(p.programmed());
        assert_eq!(
            kernel_of(&p),
            kernel,
            "seed {seed}: the record is the kernel's"
        );
    }
}

#[test]
fn adopting_an_unchanged_ipv4_table_sends_nothing() {
    adopting_an_unchanged_table_sends_nothing(&V4);
}

#[test]
fn adopting_an_unchanged_ipv6_table_sends_nothing() {
    adopting_an_unchanged_table_sends_nothing(&V6);
}

#[test]
fn adopting_keeps_the_kernels_slot_assignment_where_the_endpoints_are_the_same() {
    let a = &V4;
    let node = adopt_node(a);
    let ep = |j: u32| (format!("{}{j}", a.endpoint_prefix), false, true);
    let mut state = new_state();
    upsert(
        &mut state,
        service(
            "web",
            json!({"clusterIP": a.cluster_ips[0], "ports": [{"name": "http", "protocol": "TCP", "port": 80}]}),
        ),
    );
    upsert(&mut state, slice("web", a.family, &[ep(1), ep(2), ep(3)]));
    let mut before = Planner::new(adopt_config(a.family));
    before.full(&state, &node);
    let _ = state.take_changes();
    // Endpoint 1 is replaced by 9: 9 takes slot 0, so the slots are no longer in address order.
    upsert(&mut state, slice("web", a.family, &[ep(9), ep(2), ep(3)]));
    let changes = state.take_changes();
    before.partial(&state, &changes.services, &node, false);
    let kernel = kernel_of(&before);
    let endpoints = SetId::ClassEndpoints(crate::layout::Route::Vips, 3);
    let fresh = {
        let mut f = Planner::new(adopt_config(a.family));
        f.full(&state, &node);
        f.expected_elements(endpoints)
    };
    assert_ne!(
        fresh,
        before.expected_elements(endpoints),
        "a fresh plan would number the slots in address order"
    );

    let mut p = Planner::new(adopt_config(a.family));
    let mut batch = ElementBatch::new();
    let tx = p.adopt(&state, &node, &kernel, &mut batch).expect("adopt");
    assert_eq!(tx.operations, 0, "{}", tx.text);
    assert_eq!(
        p.expected_elements(endpoints),
        before.expected_elements(endpoints)
    );

    // Where the endpoints differ, those that stay keep their slots: replacing endpoint 2 (in
    // slot 1) while down costs one slot.
    upsert(&mut state, slice("web", a.family, &[ep(9), ep(7), ep(3)]));
    let _ = state.take_changes();
    let mut p = Planner::new(adopt_config(a.family));
    let mut batch = ElementBatch::new();
    let tx = p.adopt(&state, &node, &kernel, &mut batch).expect("adopt");
    assert_eq!(tx.operations, 2, "one slot's deletion and addition");
    assert_eq!(element_difference(&kernel, &kernel_of(&p)), 2);
    let slot = |p: &Planner, s: u32| {
        let key = Tuple::new(vec![
            Atom::Ip(a.cluster_ips[0].parse().unwrap()),
            Atom::Proto(kp_core::model::Protocol::Tcp),
            Atom::Port(80),
            Atom::Slot(s),
        ]);
        p.expected_value(endpoints, &key)
            .flatten()
            .map(|v| v.to_string())
    };
    assert_eq!(slot(&p, 0), slot(&before, 0));
    assert_eq!(
        slot(&p, 1).as_deref(),
        Some(&*format!("{}7 . 8080", a.endpoint_prefix))
    );
    assert_eq!(slot(&p, 2), slot(&before, 2));
}

fn adopting_a_changed_cluster_sends_exactly_the_difference(a: &Addrs) {
    let node = adopt_node(a);
    for seed in 1..=8u64 {
        // The kernel holds an older state; meanwhile Services changed, came and went.
        let old = random_state(a, seed, 14);
        let mut before = Planner::new(adopt_config(a.family));
        before.full(&old, &node);
        let kernel = kernel_of(&before);
        let mut state = random_state(a, seed, 14);
        let mut rng = Rng(seed * 7919);
        for i in 0..14 {
            match rng.below(4) {
                0 => delete(&mut state, Kind::Service, &format!("s{i}")),
                1 => upsert(&mut state, random_slice(&mut rng, a, i)),
                _ => {}
            }
        }
        for i in 14..17 {
            upsert(&mut state, random_service(&mut rng, a, i));
            upsert(&mut state, random_slice(&mut rng, a, i));
        }
        let _ = state.take_changes();
        let mut p = Planner::new(adopt_config(a.family));
        let mut batch = ElementBatch::new();
        let tx = p.adopt(&state, &node, &kernel, &mut batch).expect("adopt");
        assert!(p.programmed());
        let after = kernel_of(&p);
        // The batch holds exactly the element difference, the text only new classes.
        let text_ops = tx.text.lines().count();
        assert_eq!(
            batch.elements(),
            element_difference(&kernel, &after),
            "seed {seed}"
        );
        assert_eq!(tx.operations, batch.elements() + text_ops, "seed {seed}");
        assert!(
            tx.text.lines().all(|l| l.starts_with("add set")
                || l.starts_with("add map")
                || l.starts_with("add rule")),
            "seed {seed}: {}",
            tx.text
        );
        // The kernel's classes stay; the plan is a fresh full plan's, up to slot numbering.
        for name in kernel.sets.keys() {
            assert!(after.sets.contains_key(name), "seed {seed}: {name} dropped");
        }
        let mut fresh = Planner::new(adopt_config(a.family));
        fresh.full(&state, &node);
        let nonempty = |p: &Planner| {
            let mut n = normalized(p);
            n.retain(|_, v| !v.is_empty());
            n
        };
        assert_eq!(nonempty(&p), nonempty(&fresh), "seed {seed}");
    }
}

#[test]
fn adopting_a_changed_ipv4_cluster_sends_exactly_the_difference() {
    adopting_a_changed_cluster_sends_exactly_the_difference(&V4);
}

#[test]
fn adopting_a_changed_ipv6_cluster_sends_exactly_the_difference() {
    adopting_a_changed_cluster_sends_exactly_the_difference(&V6);
}

#[test]
fn a_table_of_another_structure_is_not_adopted() {
    let a = &V4;
    let node = adopt_node(a);
    let state = random_state(a, 3, 10);
    let mut before = Planner::new(adopt_config(a.family));
    before.full(&state, &node);
    let good = kernel_of(&before);
    let refused = |kernel: &KernelTable, why: &str| {
        let mut p = Planner::new(adopt_config(a.family));
        let mut batch = ElementBatch::new();
        let err = p
            .adopt(&state, &node, kernel, &mut batch)
            .expect_err("not adoptable");
        assert!(err.0.contains(why), "{err}");
        assert!(batch.is_empty() && !p.programmed());
    };
    let mut k = good.clone();
    k.comment = None;
    refused(&k, "no layout comment");
    // Another configuration (another masquerade bit) is another layout.
    let mut k = good.clone();
    k.comment = Some(crate::layout::table_comment(&PlanConfig {
        masquerade_mark: 1 << 15,
        ..adopt_config(a.family)
    }));
    refused(&k, "comment");
    let mut k = good.clone();
    k.chains.get_mut("masquerading").unwrap().remove(0);
    refused(&k, "chain masquerading holds rules");
    let mut k = good.clone();
    k.chains.insert("intruder".into(), vec![]);
    refused(&k, "chain intruder is not one of ours");
    let mut k = good.clone();
    k.sets.insert("intruders".into(), BTreeMap::new());
    refused(&k, "set intruders is not one of ours");
    let mut k = good.clone();
    k.sets.remove("hairpin");
    refused(&k, "set hairpin is missing");
    // A class set without its endpoint map.
    let mut k = good.clone();
    k.sets.insert("vips-9".into(), BTreeMap::new());
    refused(&k, "set vips-9-endpoints is missing");
}

#[test]
fn set_ids_are_recognised_by_name() {
    use crate::layout::Route;
    let mut ids = SetId::FIXED.to_vec();
    for r in [
        Route::Vips,
        Route::NodePorts,
        Route::LocalSourceVips,
        Route::LocalSourceNodePorts,
    ] {
        ids.extend([SetId::Class(r, 1), SetId::ClassEndpoints(r, 12)]);
    }
    ids.extend([
        SetId::Affinity(10800),
        SetId::AffinityVips(60),
        SetId::AffinityNodePorts(1),
    ]);
    for id in ids {
        assert_eq!(SetId::from_name(&id.name()), Some(id), "{}", id.name());
    }
    for name in [
        "vips-0",
        "vips-03",
        "vips-x",
        "vips-3-endpoint",
        "vips",
        "affinity-60-other",
        "affinity-",
        "local-source-3",
        "other",
    ] {
        assert_eq!(SetId::from_name(name), None, "{name}");
    }
}

/// A sink that keeps what it is handed as values, in order: statements as text, element changes
/// as `add SET KEY : VALUE` / `delete SET KEY`.
#[derive(Default)]
struct FakeSink(Vec<String>);

impl TransactionSink for FakeSink {
    fn statement(&mut self, line: std::fmt::Arguments<'_>) {
        self.0.push(line.to_string());
    }

    fn add_element(&mut self, family: IpFamily, set: SetId, key: &[Atom], value: Option<&[Atom]>) {
        let key = Tuple::new(key);
        let value = value
            .map(|v| format!(" : {}", Tuple::new(v)))
            .unwrap_or_default();
        self.0
            .push(format!("add {family:?} {} {key}{value}", set.name()));
    }

    fn delete_element(&mut self, family: IpFamily, set: SetId, key: &[Atom]) {
        self.0.push(format!(
            "delete {family:?} {} {}",
            set.name(),
            Tuple::new(key)
        ));
    }
}

/// nft text as the [`FakeSink`] would have kept it: one line per element change.
fn one_change_per_line(family: IpFamily, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let element = ["add element ", "delete element "]
            .iter()
            .find_map(|verb| line.strip_prefix(verb).map(|rest| (verb.trim_end(), rest)));
        let Some((verb, rest)) = element else {
            out.push(line.to_string());
            continue;
        };
        let verb = verb.split(' ').next().unwrap();
        // `ip kube-proxy SET { a, b }`
        let mut words = rest.splitn(4, ' ');
        let (_, _, set) = (words.next(), words.next(), words.next().unwrap());
        let body = words
            .next()
            .unwrap()
            .trim_start_matches("{ ")
            .trim_end_matches(" }");
        for el in body.split(", ") {
            out.push(format!("{verb} {family:?} {set} {el}"));
        }
    }
    out
}

/// `lines` with the elements of each run of changes to one set sorted: two planners built apart
/// hash their records apart, so they list a set's elements in different orders.
fn sorted_runs(mut lines: Vec<String>) -> Vec<String> {
    let run_of = |l: &str| {
        let w: Vec<&str> = l.splitn(4, ' ').collect();
        (w.len() == 4 && (w[0] == "add" || w[0] == "delete") && w[1].starts_with('V'))
            .then(|| format!("{} {}", w[0], w[2]))
    };
    let mut start = 0;
    while start < lines.len() {
        let run = run_of(&lines[start]);
        let mut end = start + 1;
        while run.is_some() && end < lines.len() && run_of(&lines[end]) == run {
            end += 1;
        }
        lines[start..end].sort();
        start = end;
    }
    lines
}

#[track_caller]
fn assert_same_statements(family: IpFamily, text: &str, sink: &FakeSink) {
    let want = sorted_runs(one_change_per_line(family, text));
    let have = sorted_runs(sink.0.clone());
    let first = want.iter().zip(&have).position(|(w, h)| w != h);
    assert!(
        first.is_none() && want.len() == have.len(),
        "{} lines against {}; first difference at {first:?}: {:?} against {:?}",
        want.len(),
        have.len(),
        first.map(|i| &want[i]),
        first.map(|i| &have[i])
    );
}

#[test]
fn the_text_sink_writes_exactly_the_statements_and_element_changes_a_sink_is_handed() {
    for a in [&V4, &V6] {
        let node = adopt_node(a);
        let mut state = random_state(a, 7, 12);
        let mut text = Planner::new(adopt_config(a.family));
        let mut typed = Planner::new(adopt_config(a.family));
        let tx = text.full(&state, &node);
        let mut sink = FakeSink::default();
        let written = typed.full_into(&state, &node, &mut sink);
        assert_eq!(written.operations, tx.operations);
        assert_same_statements(a.family, &tx.text, &sink);

        // A partial sync that deletes and adds: the same again, grouped by set and kind.
        let mut rng = Rng(99);
        for i in 0..4 {
            upsert(&mut state, random_slice(&mut rng, a, i));
        }
        let changes = state.take_changes();
        let tx = text.partial(&state, &changes.services, &node, false);
        let mut sink = FakeSink::default();
        let written = typed.partial_into(&state, &changes.services, &node, false, &mut sink);
        assert!(tx.text.contains("delete element"), "{}", tx.text);
        assert_eq!(
            (written.operations, written.removes_endpoints),
            (tx.operations, tx.removes_endpoints)
        );
        assert_same_statements(a.family, &tx.text, &sink);
    }
}

/// Detect-local by interface: the ClusterIP masquerade rule and the Local-policy short-circuit
/// match the ingress interface instead of `pod-cidrs` (upstream's `iifname != "cbr0"` and
/// `iifname "veth*"`), in both families, and the table's comment tells the forms apart so an
/// adopted table of another form is replaced.
#[test]
fn detect_local_by_interface_matches_iifname() {
    use crate::layout::{class_rules, fixed_rules, table_comment, Route};
    use kp_core::node::{InterfaceName, LocalInterface};
    let name = |s: &str| InterfaceName::new(s).unwrap();
    for family in IpFamily::ALL {
        let ip = crate::names::family(family);
        let cidrs = PlanConfig {
            detect_local: true,
            ..PlanConfig::new(family)
        };
        let mut comments = BTreeSet::from([table_comment(&cidrs)]);
        for (local, not_from_pods, from_pods) in [
            (
                LocalInterface::Bridge(name("cbr0")),
                "iifname != \"cbr0\"",
                "iifname \"cbr0\"",
            ),
            (
                LocalInterface::Prefix(name("veth")),
                "iifname != \"veth*\"",
                "iifname \"veth*\"",
            ),
        ] {
            let cfg = PlanConfig {
                local_interface: Some(local),
                ..cidrs.clone()
            };
            let masq = fixed_rules(&cfg)
                .into_iter()
                .find(|r| r.id == "cluster-ips")
                .expect("the ClusterIP masquerade rule");
            assert_eq!(
                masq.text,
                format!(
                    "{ip} daddr @cluster-ips {not_from_pods} meta mark set meta mark or 0x4000"
                )
            );
            let short = class_rules(&cfg, Route::LocalSourceVips, 2);
            let pods = short
                .iter()
                .find(|r| r.id.ends_with("-from-pods"))
                .expect("the short-circuit for pods");
            assert!(
                pods.text.starts_with(&format!("{from_pods} {ip} daddr")),
                "{}",
                pods.text
            );
            for r in fixed_rules(&cfg).iter().chain(&short) {
                assert!(!r.text.contains("@pod-cidrs"), "{}", r.text);
            }
            assert!(comments.insert(table_comment(&cfg)));
        }
    }
}

/// A sink that keeps the base chains' rules apart from every other statement.
#[derive(Default)]
struct BaseRules {
    statements: Vec<String>,
    base: Vec<String>,
}

impl TransactionSink for BaseRules {
    fn statement(&mut self, line: std::fmt::Arguments<'_>) {
        self.statements.push(line.to_string());
    }

    fn base_chain_rule(&mut self, line: std::fmt::Arguments<'_>) {
        self.base.push(line.to_string());
    }

    fn add_element(&mut self, _: IpFamily, _: SetId, _: &[Atom], _: Option<&[Atom]>) {}

    fn delete_element(&mut self, _: IpFamily, _: SetId, _: &[Atom]) {}
}

#[test]
fn a_full_write_hands_the_base_chains_rules_over_as_such_and_only_those() {
    for family in [IpFamily::V4, IpFamily::V6] {
        let mut p = planner(family);
        let mut sink = BaseRules::default();
        p.full_into(&new_state(), &NodeContext::default(), &mut sink);
        let fam = if family == IpFamily::V4 { "ip" } else { "ip6" };
        let base: Vec<&str> = crate::layout::chains()
            .into_iter()
            .filter(|c| c.hook.is_some())
            .map(|c| c.name)
            .collect();
        let in_base = |line: &str| {
            base.iter()
                .any(|c| line.starts_with(&format!("add rule {fam} kube-proxy {c} ")))
        };
        assert!(!sink.base.is_empty());
        assert!(sink.base.iter().all(|l| in_base(l)), "{:?}", sink.base);
        // Every base chain has its jumps.
        for c in &base {
            assert!(
                sink.base
                    .iter()
                    .any(|l| l.starts_with(&format!("add rule {fam} kube-proxy {c} "))),
                "{c}: {:?}",
                sink.base
            );
        }
        let stray: Vec<&String> = sink.statements.iter().filter(|l| in_base(l)).collect();
        assert!(stray.is_empty(), "{stray:?}");
        assert!(sink.statements.iter().any(|l| l.starts_with("add rule")));
    }
}
