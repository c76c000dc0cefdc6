//! Partial restores touch only what changed, and any sequence of them (including failed ones)
//! leaves the tables exactly as a fresh full plan of the final state would.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use kp_core::model::{IpFamily, ServiceKey, ServicePortName};
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_flows::synthetic;
use kp_iptables_plan::{names, PlanConfig, Planner, Restore, Table};
use proptest::prelude::*;

type Tables = BTreeMap<(Table, String), Vec<String>>;

/// What the kernel holds after `r` (as `iptables-restore --noflush` applies it).
fn apply(kernel: &mut Tables, r: &Restore) {
    let r = r.clone().materialize();
    let groups = r.service_chains.iter().flat_map(|g| g.chains.iter());
    for c in r
        .base_chains
        .iter()
        .chain(groups)
        .chain(r.dispatch_chains.iter())
    {
        kernel.insert((c.table, c.chain.clone()), c.rules.clone());
    }
    for d in &r.deleted_chains {
        kernel.remove(d);
    }
}

/// Only the first `groups` Service groups of `r` (a restore cut into steps that failed part
/// way: the dispatch chains and deletions come last, so they are lost).
fn apply_prefix(kernel: &mut Tables, r: &Restore, groups: usize) {
    let r = r.clone().materialize();
    let chains = r
        .service_chains
        .iter()
        .take(groups)
        .flat_map(|g| g.chains.iter());
    for c in r.base_chains.iter().chain(chains) {
        kernel.insert((c.table, c.chain.clone()), c.rules.clone());
    }
}

fn fresh(state: &ProxyState, node: &NodeContext) -> Tables {
    let mut p = Planner::new(PlanConfig::new(IpFamily::V4));
    p.full(state, node);
    p.expected(state)
}

/// Every chain a restore input names: chain lines, rule chains, deletions, and the jump
/// targets of rules outside the dispatch chains (a rewritten `KUBE-SERVICES` names every
/// Service's chains).
fn chains_named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(':') {
            out.insert(rest.split(' ').next().unwrap_or_default().to_string());
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let chain = rest.split(' ').next().unwrap_or_default();
            out.insert(chain.to_string());
            if DISPATCH.contains(&chain) {
                continue;
            }
            if let Some(target) = rest.split(" -j ").nth(1) {
                let target = target.split(' ').next().unwrap_or_default();
                if target.starts_with("KUBE-") {
                    out.insert(target.to_string());
                }
            }
        } else if let Some(rest) = line.strip_prefix("-X ") {
            out.insert(rest.to_string());
        }
    }
    out
}

/// The chains a Service may own: its ports' SVC/SVL/EXT/FW chains and the SEP chains of
/// every endpoint it has, had, or is given, in `states`.
fn service_chain_names(states: &[&ProxyState], key: &ServiceKey) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for state in states {
        for port in state.service_ports(key) {
            let n = names::service_chains(&port.name);
            out.extend([n.svc, n.svl, n.ext, n.fw]);
            for ep in state.endpoints(&port.name) {
                out.insert(names::endpoint_chain(&port.name, &ep));
            }
        }
    }
    out
}

const DISPATCH: [&str; 7] = [
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-PROXY-FIREWALL",
    "KUBE-POSTROUTING",
    "KUBE-FORWARD",
    "KUBE-MARK-MASQ",
];

fn key(i: usize) -> ServiceKey {
    ServiceKey::new("bench", format!("svc-{i}"))
}

fn http(i: usize) -> ServicePortName {
    ServicePortName {
        service: key(i),
        port: "http".into(),
        protocol: kp_core::model::Protocol::Tcp,
    }
}

/// Checks that `r` names only `allowed` chains and the dispatch chains.
fn assert_only(r: &Restore, allowed: &BTreeSet<String>, key: &ServiceKey) {
    for chain in chains_named(&r.text()) {
        assert!(
            allowed.contains(&chain) || DISPATCH.contains(&chain.as_str()),
            "{chain} is not {key}'s nor a dispatch chain:\n{}",
            r.text()
        );
    }
}

#[test]
fn changes_among_5000_services_touch_only_the_changed_service() {
    let mut state = kp_flows::load("node-0", synthetic::cluster(5000, 2));
    let node = NodeContext::default();
    let mut planner = Planner::new(PlanConfig::new(IpFamily::V4));
    let start = Instant::now();
    let full = planner.full(&state, &node);
    let full_time = start.elapsed();
    let mut kernel = Tables::new();
    apply(&mut kernel, &full);
    eprintln!(
        "full plan of 5000 Services: {full_time:?}, {} chains, {} rules",
        full.chain_names().len(),
        full.rule_count()
    );

    // Service 4321 (a NodePort): endpoint 1 (on node-7, not this node) moves to a new
    // address; then endpoint 0 (on this node, node-0) does.
    let svc = names::service_chains(&http(4321)).svc;
    for (moved, to) in [(1usize, "10.200.0.1"), (0, "10.200.0.2")] {
        let before = state.endpoints(&http(4321));
        assert_eq!(before[moved].is_local, moved == 0);
        let mut slice = synthetic::slice(4321, 2, &[]);
        if let Some(eps) = slice.endpoints.as_mut() {
            // The first move stays in the second slice.
            eps[1].addresses = vec!["10.200.0.1".into()];
            eps[moved].addresses = vec![to.into()];
        }
        let mut allowed = service_chain_names(&[&state], &key(4321));
        state
            .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
            .unwrap();
        let changes = state.take_changes();
        allowed.extend(service_chain_names(&[&state], &key(4321)));
        let start = Instant::now();
        let r = planner.partial(&state, &changes.services, &node, false);
        eprintln!("one-endpoint partial plan: {:?}", start.elapsed());
        let after = state.endpoints(&http(4321));
        let new = after.iter().find(|e| e.ip.to_string() == to).unwrap();
        let written: BTreeSet<String> = r
            .service_chains
            .iter()
            .flat_map(|g| g.chains.iter().map(|c| c.chain.clone()))
            .collect();
        if moved == 0 {
            // The endpoint on this node has a chain (hairpin): the new one is written, the
            // old one deleted.
            let old_sep = names::endpoint_chain(&http(4321), &before[0]);
            let new_sep = names::endpoint_chain(&http(4321), new);
            assert_eq!(written, BTreeSet::from([svc.clone(), new_sep]));
            assert_eq!(r.deleted_chains, [(Table::Nat, old_sep)]);
        } else {
            // An endpoint elsewhere is DNATed by its rule in SVC: one chain rewritten.
            assert_eq!(written, BTreeSet::from([svc.clone()]));
            assert!(r.deleted_chains.is_empty());
            assert!(r.service_chains[0].chains[0]
                .rules
                .iter()
                .any(|rule| rule.ends_with(&format!("-j DNAT --to-destination {to}:8080"))));
        }
        assert!(r.dispatch_chains.is_empty() && r.base_chains.is_empty());
        assert_eq!(r.steps(1000).len(), 1);
        assert_only(&r, &allowed, &key(4321));
        // A few chain lines, the deletion, and the chains' rules: the size of the change, not
        // the table.
        assert!(r.text().lines().count() < 20, "{}", r.text());
        apply(&mut kernel, &r);
        assert_eq!(kernel, planner.expected(&state));
    }

    // Service 4325 (a LoadBalancer with source ranges) is deleted.
    let mut owned: BTreeSet<String> = service_chain_names(&[&state], &key(4325));
    owned.retain(|c| kernel.contains_key(&(Table::Nat, c.clone())));
    assert!(owned.iter().any(|c| c.starts_with(names::FW_PREFIX)));
    let states_before = service_chain_names(&[&state], &key(4325));
    state
        .apply(SourceEvent::Delete(
            Kind::Service,
            ObjectKey {
                namespace: "bench".into(),
                name: "svc-4325".into(),
            },
        ))
        .unwrap();
    let changes = state.take_changes();
    let r = planner.partial(&state, &changes.services, &node, false);
    let deleted: BTreeSet<String> = r.deleted_chains.iter().map(|(_, c)| c.clone()).collect();
    assert_eq!(deleted, owned, "exactly its chains are deleted");
    assert!(r.service_chains.is_empty());
    let dispatch: BTreeSet<(Table, &str)> = r
        .dispatch_chains
        .iter()
        .map(|c| (c.table, c.chain.as_str()))
        .collect();
    assert_eq!(
        dispatch,
        BTreeSet::from([
            (Table::Nat, "KUBE-SERVICES"),
            (Table::Nat, "KUBE-NODEPORTS"),
            (Table::Filter, "KUBE-PROXY-FIREWALL"),
            // Its ClusterIP no longer rejects unused ports.
            (Table::Filter, "KUBE-SERVICES"),
        ])
    );
    assert_only(&r, &states_before, &key(4325));
    apply(&mut kernel, &r);
    assert_eq!(kernel, planner.expected(&state));

    // A new Service: its chains are created and the dispatch chains rewritten.
    state
        .apply(SourceEvent::Upsert(Object::Service(Box::new(
            synthetic::service(5000),
        ))))
        .unwrap();
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
            synthetic::slice(5000, 2, &[]),
        ))))
        .unwrap();
    let changes = state.take_changes();
    let start = Instant::now();
    let r = planner.partial(&state, &changes.services, &node, false);
    eprintln!(
        "Service-added partial plan (shared chains rendered again): {:?}",
        start.elapsed()
    );
    assert_eq!(r.service_chains.len(), 1);
    assert_eq!(
        r.service_chains[0].chains.len(),
        2,
        "the SEP chain of its endpoint on this node, and SVC"
    );
    let dispatch: Vec<(Table, &str)> = r
        .dispatch_chains
        .iter()
        .map(|c| (c.table, c.chain.as_str()))
        .collect();
    assert_eq!(
        dispatch,
        [
            (Table::Nat, "KUBE-SERVICES"),
            (Table::Filter, "KUBE-SERVICES")
        ]
    );
    assert!(r.deleted_chains.is_empty());
    assert_only(&r, &service_chain_names(&[&state], &key(5000)), &key(5000));
    apply(&mut kernel, &r);
    assert_eq!(kernel, planner.expected(&state));
    assert_eq!(kernel, fresh(&state, &node));
}

/// One step of a random history.
#[derive(Clone, Debug)]
enum Op {
    /// Delete the fixture object at this index if present, else restore it.
    Toggle(usize),
    /// Synthetic Service `i` with `per` endpoints, some left out.
    Synthetic {
        i: usize,
        per: usize,
        missing: Vec<usize>,
    },
    /// Synthetic Service `i` goes.
    DropSynthetic(usize),
    /// The `web` Service's endpoints.
    Web(Vec<&'static str>),
    /// Detect-local switches between cluster CIDR and node CIDR.
    DetectLocal(bool),
    /// The next restore fails part way: only this many Service groups land.
    Fail(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let pods = prop::sample::subsequence(vec!["pod-1", "pod-2", "pod-3", "pod-4"], 0..=4);
    prop_oneof![
        (0..kp_flows::objects().len()).prop_map(Op::Toggle),
        (0usize..8, 0usize..5, prop::collection::vec(0usize..5, 0..3))
            .prop_map(|(i, per, missing)| Op::Synthetic { i, per, missing }),
        (0usize..8).prop_map(Op::DropSynthetic),
        pods.prop_map(Op::Web),
        any::<bool>().prop_map(Op::DetectLocal),
        (0usize..4).prop_map(Op::Fail),
    ]
}

fn node_context(state: &ProxyState, node_cidr: bool) -> NodeContext {
    let detect = if node_cidr {
        DetectLocal::NodeCidr
    } else {
        DetectLocal::ClusterCidr(vec![kp_flows::CLUSTER_CIDR.parse().unwrap()])
    };
    NodeContext::resolve(&detect, &NodePortAddresses::Primary, state)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn any_sequence_of_partial_plans_ends_where_a_fresh_full_plan_would(
        ops in prop::collection::vec(op(), 1..14)
    ) {
        let objects = kp_flows::objects();
        let mut present = vec![true; objects.len()];
        let mut state = kp_flows::state();
        let mut node_cidr = false;
        let mut planner = Planner::new(PlanConfig::new(IpFamily::V4));
        let mut kernel = Tables::new();
        apply(&mut kernel, &planner.full(&state, &node_context(&state, node_cidr)));
        let mut fail_next: Option<usize> = None;
        for op in ops {
            match op {
                Op::Toggle(i) => {
                    let o = objects[i].clone();
                    let event = if present[i] {
                        SourceEvent::Delete(o.kind(), o.key())
                    } else {
                        SourceEvent::Upsert(o)
                    };
                    present[i] = !present[i];
                    state.apply(event).unwrap();
                }
                Op::Synthetic { i, per, missing } => {
                    state.apply(SourceEvent::Upsert(Object::Service(Box::new(synthetic::service(i))))).unwrap();
                    state.apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(synthetic::slice(i, per, &missing))))).unwrap();
                }
                Op::DropSynthetic(i) => {
                    let key = ObjectKey { namespace: "bench".into(), name: format!("svc-{i}") };
                    state.apply(SourceEvent::Delete(Kind::Service, key)).unwrap();
                }
                Op::Web(pods) => {
                    state.apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(kp_flows::web_slice(&pods))))).unwrap();
                }
                Op::DetectLocal(on) => node_cidr = on,
                Op::Fail(groups) => {
                    fail_next = Some(groups);
                    continue;
                }
            }
            let changes = state.take_changes();
            let node = node_context(&state, node_cidr);
            let r = planner.partial(&state, &changes.services, &node, changes.node_changed);
            match fail_next.take() {
                Some(groups) => {
                    apply_prefix(&mut kernel, &r, groups);
                    planner.invalidate();
                }
                None => {
                    apply(&mut kernel, &r);
                    let want = fresh(&state, &node);
                    prop_assert_eq!(&planner.expected(&state), &want);
                    prop_assert_eq!(&kernel, &want);
                }
            }
        }
        // Whatever happened last, one more plan converges.
        let node = node_context(&state, node_cidr);
        let r = planner.partial(&state, &BTreeSet::new(), &node, false);
        apply(&mut kernel, &r);
        let want = fresh(&state, &node);
        prop_assert_eq!(&planner.expected(&state), &want);
        prop_assert_eq!(&kernel, &want);
    }
}

/// The chains a restore writes, with their rules.
fn written(r: &Restore) -> Tables {
    let mut out = Tables::new();
    apply(&mut out, r);
    out
}

/// Each change makes a partial plan write exactly the chains whose text a fresh full plan
/// renders differently (the planner compares digests, not text), and delete exactly those a
/// fresh plan no longer has: an endpoint's probability only, an affinity timeout only (the
/// `KUBE-SVC` chain's `--seconds`, not the `KUBE-SEP` chains), comments only (large-cluster
/// mode), nothing at all (the same objects again), a new Service.
#[test]
fn partial_plans_rewrite_exactly_the_chains_whose_text_changed() {
    let node = NodeContext::default();
    let mut state = kp_flows::load("node-0", synthetic::cluster(60, 4));
    let mut planner = Planner::new(PlanConfig::new(IpFamily::V4));
    planner.full(&state, &node);
    let affinity = |timeout: i32| {
        let mut s = synthetic::service(12);
        let spec = s.spec.as_mut().unwrap();
        assert_eq!(spec.session_affinity.as_deref(), Some("ClientIP"));
        spec.session_affinity_config = Some(k8s_openapi::api::core::v1::SessionAffinityConfig {
            client_ip: Some(k8s_openapi::api::core::v1::ClientIPConfig {
                timeout_seconds: Some(timeout),
            }),
        });
        Object::Service(Box::new(s))
    };
    let slice = |i: usize, per: usize, missing: &[usize]| {
        Object::EndpointSlice(Box::new(synthetic::slice(i, per, missing)))
    };
    let steps: Vec<(&str, Vec<Object>)> = vec![
        // Endpoint 0 is on this node (node-0): it has a KUBE-SEP chain.
        ("one endpoint fewer: probabilities", vec![slice(4, 4, &[0])]),
        ("the endpoint back", vec![slice(4, 4, &[])]),
        ("affinity timeout", vec![affinity(600)]),
        ("same objects again", vec![affinity(600), slice(4, 4, &[])]),
        (
            "a new Service",
            vec![
                Object::Service(Box::new(synthetic::service(60))),
                slice(60, 3, &[]),
            ],
        ),
        (
            "large-cluster mode: comments only",
            vec![
                Object::Service(Box::new(synthetic::service(61))),
                slice(61, 900, &[]),
            ],
        ),
        ("affinity timeout in large-cluster mode", vec![affinity(30)]),
    ];
    let mut saw_probability_only = false;
    for (what, objects) in steps {
        let before = fresh(&state, &node);
        for o in objects {
            state.apply(SourceEvent::Upsert(o)).unwrap();
        }
        let changes = state.take_changes();
        let after = fresh(&state, &node);
        let r = planner.partial(&state, &changes.services, &node, changes.node_changed);
        let wrote = written(&r);
        let differs: Tables = after
            .iter()
            .filter(|(k, v)| before.get(*k) != Some(*v))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(
            wrote.keys().collect::<Vec<_>>(),
            differs.keys().collect::<Vec<_>>(),
            "{what}"
        );
        assert_eq!(wrote, differs, "{what}");
        let gone: Vec<(Table, String)> = before
            .keys()
            .filter(|k| !after.contains_key(*k))
            .cloned()
            .collect();
        assert_eq!(r.deleted_chains, gone, "{what}");
        assert_eq!(planner.expected(&state), after, "{what}");
        match what {
            "the endpoint back" => {
                // The SVC chain (probabilities) and the returning endpoint's SEP chain; the
                // other endpoints are elsewhere and have none.
                let svc = names::service_chains(&http(4)).svc;
                assert!(wrote.contains_key(&(Table::Nat, svc)), "{what}");
                assert_eq!(wrote.len(), 2, "{what}: {:#?}", wrote.keys());
                saw_probability_only = true;
            }
            "affinity timeout" => {
                let svc = names::service_chains(&http(12)).svc;
                assert_eq!(
                    wrote.keys().collect::<Vec<_>>(),
                    [&(Table::Nat, svc)],
                    "{what}"
                );
            }
            "same objects again" => assert!(r.is_empty(), "{what}: {}", r.text()),
            "large-cluster mode: comments only" => {
                // Every SVC chain, and the SEP chain of each endpoint on this node.
                assert!(
                    wrote.len() > 120,
                    "{what}: every per-endpoint comment goes: {}",
                    wrote.len()
                );
            }
            _ => {}
        }
    }
    assert!(saw_probability_only);
}
