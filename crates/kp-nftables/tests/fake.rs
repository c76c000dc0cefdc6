//! The nftables dataplane over `FakeNftables` (nf_tables in memory, its tables the tracer's,
//! element batches decoded from the bytes the kernel would get): the first full sync, a failed
//! transaction and the full sync after it, a one-endpoint partial sync, an affinity Service
//! losing an endpoint, the packet-flow table through whatever a sequence of syncs left, and the
//! read-back finding a change made behind the dataplane's back. No root: these run everywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kp_core::dataplane::{Dataplane, SyncReport};
use kp_core::flow::{Origin, Packet, Tracer, Verdict};
use kp_core::model::{IpFamily, Protocol};
use kp_core::track::{Changes, Object, ProxyState, SourceEvent};
use kp_metrics::Metrics;
use kp_nftables::{DetectLocal, NftablesConfig, NftablesDataplane};
use kp_nftables_plan::element::{Atom, Tuple};
use kp_nftables_test::FakeNftables;

/// The fake kernel of the flow table's node.
fn fake() -> FakeNftables {
    FakeNftables::new(kp_flows::node_addresses())
}

/// The fixture's settings: detect-local by the cluster CIDRs of both families.
fn config() -> NftablesConfig {
    NftablesConfig {
        detect_local: DetectLocal::ClusterCidr(vec![
            kp_flows::CLUSTER_CIDR.parse().unwrap(),
            kp_flows::CLUSTER_CIDR6.parse().unwrap(),
        ]),
        ..NftablesConfig::default()
    }
}

fn dataplane(fake: &FakeNftables) -> (NftablesDataplane, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    (
        NftablesDataplane::new(config(), fake.clone(), metrics.clone()),
        metrics,
    )
}

/// A sync through the [`Dataplane`] trait, as the proxy's loop runs it; the error as text.
fn sync(
    dp: &mut NftablesDataplane,
    state: &ProxyState,
    changes: &Changes,
    full: bool,
) -> Result<SyncReport, String> {
    Dataplane::sync(dp, state, changes, full).map_err(|e| e.to_string())
}

/// The read-back's differences between the fake's tables and the plan.
fn verify(dp: &mut NftablesDataplane) -> Vec<String> {
    Dataplane::verify(dp).expect("the fake's tables read back")
}

fn upsert(state: &mut ProxyState, o: Object) -> Changes {
    state.apply(SourceEvent::Upsert(o)).expect("valid object");
    state.take_changes()
}

/// Everything a family's table holds, one line per fact, as a read-back sees it (the chains
/// whose rule order does not matter sorted, as `verify` sorts them).
fn snapshot(fake: &FakeNftables) -> BTreeSet<String> {
    snapshot_with(fake, false)
}

/// [`snapshot`], without the endpoint-count classes whose sets are empty (with their rules),
/// when `without_empty_classes`: partial syncs leave a class a Service no longer uses in place,
/// empty, until the table is next replaced (see the plan crate's README), where a fresh full
/// sync makes only the classes in use.
fn snapshot_with(fake: &FakeNftables, without_empty_classes: bool) -> BTreeSet<String> {
    let tracer = fake.tracer();
    let mut out = BTreeSet::new();
    for family in IpFamily::ALL {
        let empty = |set: &str| tracer.elements(family, set).is_none_or(|e| e.is_empty());
        let dropped: BTreeSet<String> = tracer
            .set_names(family)
            .into_iter()
            .filter(|set| without_empty_classes && empty(set) && empty(&format!("{set}-endpoints")))
            .filter(|set| {
                matches!(
                    kp_nftables_plan::SetId::from_name(set),
                    Some(kp_nftables_plan::SetId::Class(..))
                )
            })
            .collect();
        let dropped_rule = |id: &str| {
            dropped
                .iter()
                .any(|set| id == format!("class-{set}") || id.starts_with(&format!("class-{set}-")))
        };
        out.insert(format!("{family:?} comment {:?}", tracer.comment(family)));
        for (chain, mut rules) in tracer.rule_ids(family) {
            if kp_nftables_plan::layout::UNORDERED_CHAINS.contains(&chain.as_str()) {
                rules.sort();
            }
            rules.retain(|id| !dropped_rule(id));
            out.insert(format!("{family:?} chain {chain} {rules:?}"));
        }
        for set in tracer.set_names(family) {
            let class = set.strip_suffix("-endpoints").unwrap_or(&set);
            if dropped.contains(class) {
                continue;
            }
            out.insert(format!("{family:?} set {set}"));
            for (k, v) in tracer.elements(family, &set).unwrap_or_default() {
                out.insert(format!("{family:?} {set} {k} : {v:?}"));
            }
        }
    }
    out
}

/// What a new dataplane's first sync of `state` leaves in a new fake.
fn fresh_render(state: &ProxyState) -> FakeNftables {
    let fresh = fake();
    let (mut dp, _) = dataplane(&fresh);
    sync(&mut dp, state, &Changes::default(), true).expect("a full sync into an empty kernel");
    fresh
}

#[track_caller]
fn assert_same_as_fresh(fake: &FakeNftables, state: &ProxyState, what: &str) {
    assert_same_as_fresh_with(fake, state, false, what);
}

#[track_caller]
fn assert_same_as_fresh_with(
    fake: &FakeNftables,
    state: &ProxyState,
    without_empty_classes: bool,
    what: &str,
) {
    let have = snapshot_with(fake, without_empty_classes);
    let want = snapshot_with(&fresh_render(state), without_empty_classes);
    let mut d: Vec<String> = have.difference(&want).map(|l| format!("- {l}")).collect();
    d.extend(want.difference(&have).map(|l| format!("+ {l}")));
    assert!(
        d.is_empty(),
        "{what}: the tables differ from a fresh full sync's:\n{}",
        d.join("\n")
    );
}

#[track_caller]
fn assert_rows_pass(fake: &FakeNftables, what: &str) {
    let failures = kp_flows::check_tracer(&fake.tracer());
    assert!(
        failures.is_empty(),
        "{what}: {} rows fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A connection from pod-4 (a client pod on this node) to `dst` port 80.
fn from_pod(dst: &str) -> Packet {
    Packet {
        origin: Origin::Pod,
        src: "10.244.1.14".parse().unwrap(),
        protocol: Protocol::Tcp,
        dst: dst.parse().unwrap(),
        dport: 80,
    }
}

/// The endpoint addresses a connection to `dst` port 80 may reach.
fn endpoints(fake: &FakeNftables, dst: &str) -> BTreeSet<String> {
    match fake.tracer().trace(&from_pod(dst)) {
        Verdict::Dnat { endpoints, .. } => endpoints.iter().map(|(a, _)| a.to_string()).collect(),
        other => panic!("{dst}: {other:?}"),
    }
}

fn ip(s: &str) -> Atom {
    Atom::Ip(s.parse().unwrap())
}

#[test]
fn the_first_sync_is_full_and_sends_each_table_as_structure_then_elements_then_its_jumps() {
    let fake = fake();
    let (mut dp, _) = dataplane(&fake);
    let state = kp_flows::state();
    let report = sync(&mut dp, &state, &Changes::default(), false).expect("first sync");
    assert!(report.full, "the first sync is full, asked or not");
    assert!(report.operations > 100, "{report:?}");
    // Per family: the structure with its regular chains' rules, its elements in one batch
    // (small here), then its base chains' jumps.
    assert_eq!((fake.scripts(), fake.batches()), (4, 2));
    let sent = dp.last_transaction();
    assert!(!sent.contains("add element"), "{sent}");
    assert!(
        sent.contains("add rule") && sent.contains("in 2 batches"),
        "{sent}"
    );
    let batch = fake.last_batch();
    assert!(batch.iter().all(|m| !m.delete));
    assert!(batch.iter().any(|m| m.family == IpFamily::V6));
    let web_endpoints = fake.elements(IpFamily::V4, "vips-3-endpoints").unwrap();
    assert_eq!(
        web_endpoints
            .keys()
            .filter(|k| k.atoms()[0] == ip("10.96.0.10"))
            .count(),
        3
    );
    assert_eq!(verify(&mut dp), Vec::<String>::new());
    assert_rows_pass(&fake, "after the first sync");

    // Nothing changed: a partial sync sends nothing, and a periodic full one reads the table
    // back, finds it as planned and sends nothing either.
    let generation = fake.generation();
    let report = sync(&mut dp, &state, &Changes::default(), false).unwrap();
    assert_eq!((report.full, report.operations), (false, 0));
    let report = sync(&mut dp, &state, &Changes::default(), true).unwrap();
    assert_eq!((report.full, report.operations), (false, 0));
    assert_eq!(fake.generation(), generation, "nothing to send");
    assert_eq!((fake.scripts(), fake.batches()), (4, 2));
}

#[test]
fn a_failed_transaction_is_counted_applies_nothing_and_the_next_sync_ends_where_a_fresh_full_sync_does(
) {
    let fake = fake();
    let (mut dp, metrics) = dataplane(&fake);
    let mut state = kp_flows::state();

    // The first sync's script fails: no table at all, and the failure is counted.
    fake.fail_next_transaction();
    sync(&mut dp, &state, &Changes::default(), true).expect_err("told to fail");
    assert_eq!(metrics.nftables_sync_failures.get(), 1);
    assert!(!fake.tracer().has_table(IpFamily::V4));
    sync(&mut dp, &state, &Changes::default(), false).expect("the table is built");
    let before = snapshot(&fake);

    // An endpoint change whose batch fails: counted, and nothing of it applied.
    let changes = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2", "pod-4"]))),
    );
    fake.fail_next_transaction();
    sync(&mut dp, &state, &changes, false).expect_err("told to fail");
    assert_eq!(metrics.nftables_sync_failures.get(), 2);
    assert_eq!(snapshot(&fake), before, "a failed batch applies nothing");

    // The next sync, with no new change to hand, is full: it reads the table back, adopts it,
    // sends the difference, and ends with the tables a fresh full sync of the state leaves.
    let scripts = fake.scripts();
    let report = sync(&mut dp, &state, &Changes::default(), false).unwrap();
    assert!(report.full, "the sync after a failure is full");
    assert_eq!(
        fake.scripts(),
        scripts,
        "adopted: no script, only the batch"
    );
    assert_eq!(
        report.operations, 5,
        "pod-3's slots (ClusterIP and NodePort) go to pod-4, which gets a hairpin element"
    );
    assert_same_as_fresh(&fake, &state, "after the failure");
    assert_eq!(
        endpoints(&fake, "10.96.0.10"),
        BTreeSet::from(["10.244.1.11", "10.244.1.12", "10.244.1.14"].map(String::from))
    );
    assert!(verify(&mut dp).is_empty());
}

#[test]
fn one_endpoint_change_sends_only_its_services_elements_and_leaves_what_a_full_sync_would() {
    let fake = fake();
    let (mut dp, _) = dataplane(&fake);
    let mut state = kp_flows::state();
    sync(&mut dp, &state, &Changes::default(), true).unwrap();
    let scripts = fake.scripts();

    // pod-3 leaves web, pod-4 joins: the class (three endpoints) stays.
    let changes = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2", "pod-4"]))),
    );
    let report = sync(&mut dp, &state, &changes, false).expect("partial sync");
    assert!(!report.full);
    assert_eq!(fake.scripts(), scripts, "no new class: nothing as text");
    let batch = fake.last_batch();
    // web's ClusterIP entry and its NodePort entry each replace the endpoint in pod-3's slot
    // (a deletion and an addition each), and pod-4 gets a hairpin element (pod-3 keeps its own:
    // other Services still send to it).
    let web = |k: &Tuple| {
        let a = k.atoms();
        a[0] == ip("10.96.0.10") || a.get(1) == Some(&Atom::Port(30080))
    };
    let pod4 = |k: &Tuple| k.atoms().contains(&ip("10.244.1.14"));
    let mut touched = Vec::new();
    for m in &batch {
        for k in m.elements.keys() {
            assert!(
                web(k) || pod4(k),
                "the batch touches {} {k}, not web's:\n{batch:?}",
                m.set
            );
            touched.push(format!(
                "{} {} {k}",
                if m.delete { "-" } else { "+" },
                m.set
            ));
        }
    }
    assert_eq!(touched.len(), report.operations, "{touched:?}");
    assert_eq!(touched.len(), 5, "{touched:?}");
    assert_eq!(
        endpoints(&fake, "10.96.0.10"),
        BTreeSet::from(["10.244.1.11", "10.244.1.12", "10.244.1.14"].map(String::from))
    );
    assert_same_as_fresh(&fake, &state, "after one endpoint change");
    assert!(verify(&mut dp).is_empty());
}

#[test]
fn an_endpoint_leaving_an_affinity_service_takes_the_choices_that_point_at_it_and_no_other() {
    let fake = fake();
    let (mut dp, _) = dataplane(&fake);
    let mut state = kp_flows::state();
    sync(&mut dp, &state, &Changes::default(), true).unwrap();
    // The packet path remembers two clients' choices for sticky (10.96.0.30:80, 60 s):
    // one on pod-1, one on pod-2.
    let choice = |client: &str, pod: &str| {
        (
            Tuple::new(vec![
                ip(client),
                ip("10.96.0.30"),
                Atom::Proto(Protocol::Tcp),
                Atom::Port(80),
            ]),
            Tuple::new(vec![ip(pod), Atom::Port(kp_flows::TCP_PORT)]),
        )
    };
    let on_pod1 = choice("192.0.2.7", "10.244.1.11");
    let on_pod2 = choice("192.0.2.8", "10.244.1.12");
    for (k, v) in [&on_pod1, &on_pod2] {
        fake.insert_element(IpFamily::V4, "affinity-60", k, Some(v))
            .expect("the affinity map exists");
    }

    // Another Service's change leaves the choices alone.
    let changes = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2", "pod-4"]))),
    );
    sync(&mut dp, &state, &changes, false).unwrap();
    assert_eq!(fake.elements(IpFamily::V4, "affinity-60").unwrap().len(), 2);

    // pod-2 leaves sticky: its choice goes, pod-1's stays.
    let changes = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::sticky_slice(&["pod-1"]))),
    );
    let report = sync(&mut dp, &state, &changes, false).unwrap();
    assert!(!report.full);
    let left = fake.elements(IpFamily::V4, "affinity-60").unwrap();
    assert_eq!(
        left,
        BTreeMap::from([(on_pod1.0.clone(), Some(on_pod1.1.clone()))]),
        "exactly the choice of pod-2 goes"
    );
    match fake.tracer().trace(&from_pod("10.96.0.30")) {
        Verdict::Dnat {
            endpoints,
            affinity,
            ..
        } => {
            assert_eq!(endpoints.len(), 1);
            assert_eq!(affinity, Some(60), "sticky keeps its affinity");
        }
        other => panic!("{other:?}"),
    }
    assert!(verify(&mut dp).is_empty());
}

#[test]
fn the_flow_table_passes_through_tables_built_by_a_sequence_of_partial_syncs() {
    let fake = fake();
    let (mut dp, metrics) = dataplane(&fake);
    // From an empty cluster, every object through its own partial sync, one of them failing on
    // the way (the sync after it is full and adopts the table), then a periodic full sync.
    let mut grown = ProxyState::new(kp_flows::NODE);
    sync(&mut dp, &grown, &Changes::default(), true).unwrap();
    let mut partial = 0;
    for (i, o) in kp_flows::objects().into_iter().enumerate() {
        let changes = upsert(&mut grown, o);
        if i == 5 {
            fake.fail_next_transaction();
            sync(&mut dp, &grown, &changes, false).expect_err("told to fail");
            continue;
        }
        let report =
            sync(&mut dp, &grown, &changes, false).unwrap_or_else(|e| panic!("object {i}: {e}"));
        partial += usize::from(!report.full);
    }
    assert!(partial > 20, "{partial} partial syncs");
    assert_eq!(metrics.nftables_sync_failures.get(), 1);
    let report = sync(&mut dp, &grown, &Changes::default(), true).unwrap();
    assert_eq!(
        (report.full, report.operations),
        (false, 0),
        "the read-back finds nothing to repair"
    );
    assert_rows_pass(&fake, "after the sequence");
    // A Service passed through four endpoints on the way: its class stays, empty.
    assert_eq!(fake.elements(IpFamily::V4, "vips-4"), Some(BTreeMap::new()));
    assert_same_as_fresh_with(&fake, &grown, true, "after the sequence");

    // The table can fail here: without web's entry in its class set, rows that expect web's
    // DNAT do.
    let mut broken = fake.tracer();
    let web = Tuple::new(vec![
        ip("10.96.0.10"),
        Atom::Proto(Protocol::Tcp),
        Atom::Port(80),
    ]);
    broken
        .remove_element(IpFamily::V4, "vips-3", &web)
        .expect("web's entry is there");
    assert!(!kp_flows::check_tracer(&broken).is_empty());
}

#[test]
fn verify_finds_what_changed_behind_the_dataplanes_back_and_a_periodic_full_sync_repairs_it() {
    let fake = fake();
    let (mut dp, metrics) = dataplane(&fake);
    let state = kp_flows::state();
    sync(&mut dp, &state, &Changes::default(), true).unwrap();
    assert!(verify(&mut dp).is_empty());

    // Someone deletes one of web's endpoints and adds a ClusterIP of their own.
    let slot = fake
        .elements(IpFamily::V4, "vips-3-endpoints")
        .unwrap()
        .into_keys()
        .find(|k| k.atoms()[0] == ip("10.96.0.10"))
        .unwrap();
    fake.apply_behind(&format!(
        "delete element ip kube-proxy vips-3-endpoints {{ {slot} }}\nadd element ip kube-proxy cluster-ips {{ 10.96.9.9 }}\n"
    ))
    .expect("an operator's nft");
    let diffs = verify(&mut dp);
    assert_eq!(diffs.len(), 2, "{diffs:?}");
    assert!(
        diffs
            .iter()
            .any(|d| d.contains("vips-3-endpoints") && d.contains("1 elements missing")),
        "{diffs:?}"
    );
    assert!(
        diffs
            .iter()
            .any(|d| d.contains("cluster-ips") && d.contains("1 extra")),
        "{diffs:?}"
    );

    // A partial sync does not look; the periodic full sync does, and sends only the repair.
    let report = sync(&mut dp, &state, &Changes::default(), false).unwrap();
    assert_eq!(report.operations, 0);
    let report = sync(&mut dp, &state, &Changes::default(), true).unwrap();
    assert!(report.full);
    assert_eq!(report.operations, 2, "one element back, one removed");
    assert_eq!(metrics.nftables_readback_mismatches.get(), 2);
    assert!(verify(&mut dp).is_empty());
    assert_same_as_fresh(&fake, &state, "after the repair");
}
