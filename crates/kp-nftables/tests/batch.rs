//! Element changes sent as one netlink batch (the default path) against the all-text path
//! (`nft -f` for everything): the same cluster and the same changes, programmed into two network
//! namespaces of the test's own, must leave the kernel holding the same tables, as nft lists
//! them and as the netlink reader reads them, after the full sync and after every partial sync.
//! Also: a batch the kernel refuses applies nothing, is counted, and is followed by a rebuild.
//!
//! Run as root: `cargo test -p kp-nftables --test batch -- --include-ignored`.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kp_core::model::IpFamily;
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_flows::synthetic;
use kp_metrics::Metrics;
use kp_nftables::netlink::{self, SetSchema};
use kp_nftables::{
    parse_table, DetectLocal, KernelTable, NftCommand, NftablesConfig, NftablesDataplane,
    NodePortAddresses,
};
use kp_nftables_plan::names::{self, TABLE};
use kp_nftables_plan::SetId;
use kp_test::netns::{require_root, Netns};

/// Pod CIDRs from the Node (so that a Node change is a partial sync of interval elements), and
/// NodePort CIDRs at the edges of the address space: from address zero, a single address,
/// adjacent ranges, up to the top (an interval with no end element).
fn config() -> NftablesConfig {
    let nets = [
        "0.0.0.0/8",
        "192.0.2.1/32",
        "198.51.100.0/25",
        "198.51.100.128/26",
        "255.255.255.0/24",
        "::/16",
        "2001:db8::1/128",
        "ffff::/16",
    ];
    NftablesConfig {
        detect_local: DetectLocal::NodeCidr,
        node_ports: NodePortAddresses::Cidrs(nets.iter().map(|n| n.parse().unwrap()).collect()),
        ..NftablesConfig::default()
    }
}

struct Pair {
    batch: NftablesDataplane,
    text: NftablesDataplane,
    batch_ns: Netns,
    text_ns: Netns,
    metrics: Arc<Metrics>,
}

impl Pair {
    fn new(role: &str) -> Pair {
        let batch_ns = Netns::new(&format!("{role}-nl")).expect("netns");
        let text_ns = Netns::new(&format!("{role}-tx")).expect("netns");
        let metrics = Arc::new(Metrics::new());
        let batch = NftablesDataplane::new(
            config(),
            NftCommand::in_netns(batch_ns.name()),
            metrics.clone(),
        );
        // The same nft, named explicitly: a stand-in program gets every change as text.
        let text = NftablesDataplane::new(
            config(),
            NftCommand::in_netns(text_ns.name()).with_program("nft"),
            Arc::new(Metrics::new()),
        );
        Pair {
            batch,
            text,
            batch_ns,
            text_ns,
            metrics,
        }
    }

    /// Syncs both; returns whether the batch side's sync was full.
    fn sync(&mut self, state: &mut ProxyState, full: bool) -> bool {
        let changes = state.take_changes();
        let r = self
            .batch
            .sync(state, &changes, full)
            .unwrap_or_else(|e| panic!("netlink path: {e}"));
        let t = self
            .text
            .sync(state, &changes, full)
            .unwrap_or_else(|e| panic!("text path: {e}"));
        assert_eq!(
            (r.full, r.operations),
            (t.full, t.operations),
            "both paths plan the same operations"
        );
        r.full
    }

    fn assert_same(&mut self, step: &str) {
        for f in IpFamily::ALL {
            let a = read_nft(&self.batch_ns, f);
            let b = read_nft(&self.text_ns, f);
            assert!(!a.sets.is_empty(), "{step}: {f:?} table is empty");
            assert_equal(step, f, "nft lists", &a, &b);
            let a = read_netlink(&self.batch_ns, f, &a);
            let b = read_netlink(&self.text_ns, f, &b);
            assert_equal(step, f, "netlink reads", &a, &b);
        }
        for dp in [&mut self.batch, &mut self.text] {
            let diffs = dp.verify().expect("read-back");
            assert!(diffs.is_empty(), "{step}: {}", diffs.join("\n"));
        }
    }
}

/// Fails naming the chains and sets that differ (a table is too long to print whole).
fn assert_equal(step: &str, f: IpFamily, how: &str, a: &KernelTable, b: &KernelTable) {
    if a == b {
        return;
    }
    let mut d = Vec::new();
    if a.chains != b.chains {
        d.push(format!("chains: {:?}\n  vs {:?}", a.chains, b.chains));
    }
    let names: std::collections::BTreeSet<&String> = a.sets.keys().chain(b.sets.keys()).collect();
    for n in names {
        let (x, y) = (a.sets.get(n), b.sets.get(n));
        if x != y {
            let only = |p: Option<&std::collections::BTreeMap<_, _>>,
                        q: Option<&std::collections::BTreeMap<_, _>>| {
                p.into_iter()
                    .flatten()
                    .filter(|(k, v)| q.and_then(|q| q.get(*k)) != Some(*v))
                    .map(|(k, v)| format!("{k} : {v:?}"))
                    .take(5)
                    .collect::<Vec<_>>()
            };
            d.push(format!(
                "set {n}: netlink side only {:?}; text side only {:?}",
                only(x, y),
                only(y, x)
            ));
        }
    }
    panic!(
        "{step}: {f:?} tables differ as {how} them:\n{}",
        d.join("\n")
    );
}

fn read_nft(ns: &Netns, family: IpFamily) -> KernelTable {
    let json = NftCommand::in_netns(ns.name())
        .json(&["list", "table", names::family(family), TABLE])
        .expect("nft list table");
    parse_table(&json).expect("parse nft output")
}

/// Every set, dynamic ones included (no traffic runs here, so they are empty on both sides).
fn read_netlink(ns: &Netns, family: IpFamily, listed: &KernelTable) -> KernelTable {
    let mut ids: HashMap<String, SetId> = HashMap::new();
    for name in listed.sets.keys() {
        let id = all_set_ids().into_iter().find(|s| &s.name() == name);
        ids.insert(
            name.clone(),
            id.unwrap_or_else(|| panic!("unknown set {name}")),
        );
    }
    netlink::read_table(family, Some(ns.name()), &|name| {
        ids.get(name).map(|id| SetSchema::of(*id))
    })
    .expect("netlink read")
}

fn all_set_ids() -> Vec<SetId> {
    use kp_nftables_plan::Route;
    let mut v = SetId::FIXED.to_vec();
    for route in [
        Route::Vips,
        Route::NodePorts,
        Route::LocalSourceVips,
        Route::LocalSourceNodePorts,
    ] {
        for n in 1..=12 {
            v.push(SetId::Class(route, n));
            v.push(SetId::ClassEndpoints(route, n));
        }
    }
    for t in [10, 60, 100, 300, 3600, 10800] {
        v.extend([
            SetId::Affinity(t),
            SetId::AffinityVips(t),
            SetId::AffinityNodePorts(t),
        ]);
    }
    v
}

fn upsert(state: &mut ProxyState, o: Object) {
    state.apply(SourceEvent::Upsert(o)).expect("valid object");
}

fn delete(state: &mut ProxyState, kind: Kind, name: &str, namespace: &str) {
    state
        .apply(SourceEvent::Delete(
            kind,
            ObjectKey {
                namespace: namespace.into(),
                name: name.into(),
            },
        ))
        .expect("delete");
}

fn node(pod_cidrs: &[&str]) -> Object {
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": kp_flows::NODE, "labels": {"topology.kubernetes.io/zone": kp_flows::ZONE}},
        "spec": {"podCIDR": pod_cidrs[0], "podCIDRs": pod_cidrs},
        "status": {"addresses": [
            {"type": "InternalIP", "address": kp_flows::NODE_IP},
            {"type": "InternalIP", "address": kp_flows::NODE_IP6},
        ]},
    }))
    .unwrap();
    Object::Node(Box::new(node))
}

#[test]
#[ignore = "needs root"]
fn the_netlink_path_leaves_the_kernel_exactly_as_the_text_path_does() {
    if !require_root() {
        return;
    }
    let mut pair = Pair::new("batch-eq");
    // The fixture (dual-stack, every policy) and 60 synthetic Services with 3 endpoints
    // (NodePorts, LoadBalancers with source ranges, ClientIP affinity, UDP ports).
    let mut objects = kp_flows::objects();
    objects.extend(synthetic::cluster(60, 3));
    let mut state = kp_flows::load(kp_flows::NODE, objects);
    assert!(pair.sync(&mut state, true), "first sync is full");
    assert!(
        pair.batch.last_transaction().contains("# netlink:"),
        "a fresh table is filled over netlink:\n{}",
        &pair.batch.last_transaction()[..200.min(pair.batch.last_transaction().len())]
    );
    pair.assert_same("full sync");

    type Step = (&'static str, Box<dyn Fn(&mut ProxyState)>);
    let steps: Vec<Step> = vec![
        (
            "one endpoint replaced",
            Box::new(|s| upsert(s, synthetic::endpoint_change(1, 60, 3))),
        ),
        (
            "endpoints removed (class moves), an affinity Service among them",
            Box::new(|s| {
                upsert(
                    s,
                    Object::EndpointSlice(Box::new(synthetic::slice(12, 3, &[1]))),
                );
                upsert(
                    s,
                    Object::EndpointSlice(Box::new(synthetic::slice(21, 3, &[0, 2]))),
                );
            }),
        ),
        (
            "fixture web endpoints changed",
            Box::new(|s| {
                upsert(
                    s,
                    Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2"]))),
                )
            }),
        ),
        (
            "a LoadBalancer with source ranges and a NodePort Service deleted",
            Box::new(|s| {
                delete(s, Kind::Service, "svc-5", "bench");
                delete(s, Kind::EndpointSlice, "svc-5-abcde", "bench");
                delete(s, Kind::Service, "svc-11", "bench");
            }),
        ),
        (
            "Services added: LoadBalancer with ranges, NodePort, affinity, 5 endpoints",
            Box::new(|s| {
                for i in [65, 71, 72, 73] {
                    upsert(s, Object::Service(Box::new(synthetic::service(i))));
                    let per = if i == 73 { 5 } else { 3 };
                    upsert(
                        s,
                        Object::EndpointSlice(Box::new(synthetic::slice(i, per, &[]))),
                    );
                }
            }),
        ),
        (
            "a Service loses all endpoints (reject), another gains them back",
            Box::new(|s| {
                delete(s, Kind::EndpointSlice, "svc-25-abcde", "bench");
                upsert(
                    s,
                    Object::EndpointSlice(Box::new(synthetic::slice(21, 3, &[]))),
                );
            }),
        ),
        (
            "the Node's pod CIDRs change",
            Box::new(|s| upsert(s, node(&["10.244.7.0/24", "fd00:10:244:7::/64"]))),
        ),
    ];
    for (step, change) in steps {
        change(&mut state);
        assert!(!pair.sync(&mut state, false), "{step}: partial");
        pair.assert_same(step);
    }
    assert_eq!(pair.metrics.nftables_sync_failures.get(), 0);

    // A restart: a new dataplane finds the table. The netlink side adopts it (its structure is
    // ours) and sends nothing, the text side replaces it in one transaction; both end equal to
    // their plans. (Slots may differ between the two now: the adopted table keeps its own.)
    pair.batch = NftablesDataplane::new(
        config(),
        NftCommand::in_netns(pair.batch_ns.name()),
        pair.metrics.clone(),
    );
    pair.text = NftablesDataplane::new(
        config(),
        NftCommand::in_netns(pair.text_ns.name()).with_program("nft"),
        Arc::new(Metrics::new()),
    );
    let _ = state.take_changes();
    let r = pair
        .batch
        .sync(&state, &Default::default(), true)
        .expect("netlink path restart");
    assert!(
        r.full && r.operations == 0,
        "{}",
        pair.batch.last_transaction()
    );
    assert!(
        pair.batch.last_transaction().is_empty(),
        "an existing table of our structure is adopted, not replaced"
    );
    let t = pair
        .text
        .sync(&state, &Default::default(), true)
        .expect("text path restart");
    assert!(t.full);
    assert!(pair
        .text
        .last_transaction()
        .contains("delete table ip kube-proxy"));
    for dp in [&mut pair.batch, &mut pair.text] {
        let diffs = dp.verify().expect("read-back");
        assert!(diffs.is_empty(), "restart: {}", diffs.join("\n"));
    }
}

#[test]
#[ignore = "needs root"]
fn a_refused_batch_applies_nothing_is_counted_and_the_next_sync_rebuilds() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("batch-fail").expect("netns");
    let metrics = Arc::new(Metrics::new());
    let mut dp = NftablesDataplane::new(
        NftablesConfig::default(),
        NftCommand::in_netns(ns.name()),
        metrics.clone(),
    );
    let mut state = kp_flows::load("node-0", synthetic::cluster(40, 3));
    dp.sync(&state, &Default::default(), true)
        .expect("full sync");

    // Someone deletes svc-7's ClusterIP behind our back. Deleting svc-7 then asks the kernel to
    // delete a missing element: the whole batch, including its other deletions, is refused.
    let vip = synthetic::cluster_ip(7);
    ns.run(&[
        "nft",
        "delete",
        "element",
        "ip",
        TABLE,
        "cluster-ips",
        &format!("{{ {vip} }}"),
    ])
    .unwrap();
    let before = read_nft(&ns, IpFamily::V4);
    delete(&mut state, Kind::Service, "svc-7", "bench");
    let changes = state.take_changes();
    let err = dp.sync(&state, &changes, false).unwrap_err();
    assert!(
        matches!(&err, kp_nftables::Error::Netlink { errno: Some(k), .. } if k.is_not_found()),
        "{err}"
    );
    assert_eq!(metrics.nftables_sync_failures.get(), 1);
    assert_eq!(
        read_nft(&ns, IpFamily::V4),
        before,
        "nothing of a refused batch is applied"
    );
    let endpoints = SetId::ClassEndpoints(kp_nftables_plan::Route::Vips, 3).name();
    assert!(before.sets[&endpoints]
        .keys()
        .any(|k| k.to_string().starts_with(&format!("{vip} "))));

    // The next sync is full: the table exists and is ours, so it is adopted, and the repair is
    // the difference (svc-7's other elements deleted).
    let r = dp
        .sync(&state, &Default::default(), false)
        .expect("rebuild");
    assert!(r.full);
    assert!(dp.verify().unwrap().is_empty());
    let after = read_nft(&ns, IpFamily::V4);
    assert!(!after.sets[&endpoints]
        .keys()
        .any(|k| k.to_string().starts_with(&format!("{vip} "))));
}

#[test]
#[ignore = "needs root"]
fn affinity_entries_pointing_at_a_removed_endpoint_are_deleted_and_others_kept() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("batch-aff").expect("netns");
    let mut dp = NftablesDataplane::new(
        NftablesConfig::default(),
        NftCommand::in_netns(ns.name()),
        Arc::new(Metrics::new()),
    );
    // Synthetic Service 12 has ClientIP affinity (10800 s) and three endpoints.
    let mut state = kp_flows::load("node-0", synthetic::cluster(20, 3));
    dp.sync(&state, &Default::default(), true)
        .expect("full sync");
    let vip = synthetic::cluster_ip(12);
    let (gone, kept) = (
        synthetic::endpoint_ip(12, 1, 3),
        synthetic::endpoint_ip(12, 2, 3),
    );
    let entries = format!(
        "{{ 192.0.2.7 . {vip} . tcp . 80 : {gone} . 8080, 192.0.2.8 . {vip} . tcp . 80 : {kept} . 8080 }}"
    );
    ns.run(&[
        "nft",
        "add",
        "element",
        "ip",
        TABLE,
        "affinity-10800",
        &entries,
    ])
    .unwrap();
    let schema = SetSchema::of(SetId::Affinity(10800));
    let read = || {
        netlink::read_set(IpFamily::V4, Some(ns.name()), "affinity-10800", &schema)
            .expect("read")
            .expect("the map exists")
    };
    assert_eq!(read().len(), 2);

    // Endpoint 1 goes away: the entry pinned to it is deleted, the other stays.
    upsert(
        &mut state,
        Object::EndpointSlice(Box::new(synthetic::slice(12, 3, &[1]))),
    );
    let changes = state.take_changes();
    dp.sync(&state, &changes, false).expect("partial sync");
    let left = read();
    assert_eq!(left.len(), 1, "{left:?}");
    let (k, v) = left.iter().next().unwrap();
    assert!(k.to_string().starts_with("192.0.2.8 "), "{k}");
    assert_eq!(v.as_ref().unwrap().to_string(), format!("{kept} . 8080"));
}
