//! The iptables dataplane over `FakeIptables` (the tools in memory, its tables the tracer's):
//! the first full sync, a failed restore and the full sync after it, a one-endpoint partial
//! sync, an affinity Service losing an endpoint, and the packet-flow table through whatever a
//! sequence of syncs left. No root: these run everywhere, both backends' code paths each
//! (the fake answers `nft list chains` for the nft backend, whole saves for legacy).

use std::collections::BTreeSet;
use std::sync::Arc;

use kp_core::dataplane::{Dataplane, SyncReport};
use kp_core::flow::{Origin, Packet, Tracer, Verdict};
use kp_core::model::{IpFamily, Protocol};
use kp_core::track::{Changes, Object, ProxyState, SourceEvent};
use kp_iptables::{parse_save, Backend, IptablesConfig, IptablesDataplane};
use kp_iptables_test::FakeIptables;
use kp_metrics::Metrics;

mod common;
use common::{chains_named, config};

/// The fake tools of the flow table's node.
fn fake() -> FakeIptables {
    FakeIptables::new(kp_flows::node_addresses())
}

/// A sync through the [`Dataplane`] trait, as the proxy's loop runs it; the error as text.
fn sync(
    dp: &mut IptablesDataplane,
    state: &ProxyState,
    changes: &Changes,
    full: bool,
) -> Result<SyncReport, String> {
    Dataplane::sync(dp, state, changes, full).map_err(|e| e.to_string())
}

/// The read-back's differences between the tables and the plan.
fn verify(dp: &mut IptablesDataplane) -> Vec<String> {
    Dataplane::verify(dp).expect("the fake's tables read back")
}

fn dataplane(fake: &FakeIptables, cfg: IptablesConfig) -> (IptablesDataplane, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    (
        IptablesDataplane::new(cfg, fake.clone(), metrics.clone()),
        metrics,
    )
}

/// What a new dataplane's first sync of `state` leaves in new tools.
fn fresh_render(state: &ProxyState, backend: Backend) -> FakeIptables {
    let fresh = fake();
    let (mut dp, _) = dataplane(&fresh, config(backend));
    sync(&mut dp, state, &Changes::default(), true).expect("a full sync into empty tables");
    fresh
}

/// The lines in which two fakes' `iptables-save` of `backend` differ (`-` only in `have`, `+`
/// only in `want`), over both families.
fn differences(have: &FakeIptables, want: &FakeIptables, backend: Backend) -> Vec<String> {
    let mut out = Vec::new();
    for family in IpFamily::ALL {
        let a = have.save(backend, family);
        let b = want.save(backend, family);
        let a: BTreeSet<&str> = a.lines().collect();
        let b: BTreeSet<&str> = b.lines().collect();
        out.extend(a.difference(&b).map(|l| format!("{family:?} - {l}")));
        out.extend(b.difference(&a).map(|l| format!("{family:?} + {l}")));
    }
    out
}

#[track_caller]
fn assert_same_as_fresh(fake: &FakeIptables, state: &ProxyState, backend: Backend, what: &str) {
    let d = differences(fake, &fresh_render(state, backend), backend);
    assert!(
        d.is_empty(),
        "{backend}: {what}: the tables differ from a fresh full sync's:\n{}",
        d.join("\n")
    );
}

#[track_caller]
fn assert_rows_pass(fake: &FakeIptables, backend: Backend, what: &str) {
    let failures = kp_flows::check_tracer(&fake.tracer(backend));
    assert!(
        failures.is_empty(),
        "{backend}: {what}: {} rows fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn upsert(state: &mut ProxyState, o: Object) -> Changes {
    state.apply(SourceEvent::Upsert(o)).expect("valid object");
    state.take_changes()
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
fn endpoints(fake: &FakeIptables, backend: Backend, dst: &str) -> BTreeSet<String> {
    match fake.tracer(backend).trace(&from_pod(dst)) {
        Verdict::Dnat { endpoints, .. } => endpoints.iter().map(|(a, _)| a.to_string()).collect(),
        other => panic!("{dst}: {other:?}"),
    }
}

#[test]
fn the_first_sync_is_full_and_builds_every_chain_canary_and_jump_from_nothing() {
    for backend in Backend::ALL {
        let fake = fake();
        let (mut dp, _) = dataplane(&fake, config(backend));
        let state = kp_flows::state();
        let report = sync(&mut dp, &state, &Changes::default(), false).expect("first sync");
        assert!(
            report.full,
            "{backend}: the first sync is full, asked or not"
        );
        assert!(report.operations > 100, "{backend}: {report:?}");
        for family in IpFamily::ALL {
            let save = fake.save(backend, family);
            for table in ["mangle", "nat", "filter"] {
                let t = parse_save(&save, table).expect("the fake's save parses");
                assert!(
                    t.chains.contains_key("KUBE-PROXY-CANARY"),
                    "{backend} {family:?} {table}: no canary"
                );
            }
            let nat = parse_save(&save, "nat").unwrap();
            assert!(
                nat.chains["PREROUTING"]
                    .iter()
                    .any(|r| r.ends_with("-j KUBE-SERVICES")),
                "{backend} {family:?}: no jump from PREROUTING"
            );
        }
        assert_eq!(verify(&mut dp), Vec::<String>::new());
        assert_rows_pass(&fake, backend, "after the first sync");

        // Nothing changed: a partial sync sends nothing, and a periodic full one reads the
        // tables back, finds them as planned and sends nothing either.
        let restores = fake.restores();
        let report = sync(&mut dp, &state, &Changes::default(), false).unwrap();
        assert_eq!((report.full, report.operations), (false, 0));
        let report = sync(&mut dp, &state, &Changes::default(), true).unwrap();
        assert_eq!((report.full, report.operations), (false, 0));
        assert_eq!(fake.restores(), restores, "{backend}: nothing to send");
    }
}

#[test]
fn a_failed_restore_makes_the_next_sync_full_and_it_ends_where_a_fresh_full_sync_does() {
    for backend in Backend::ALL {
        let fake = fake();
        let (mut dp, metrics) = dataplane(&fake, config(backend));
        let mut state = kp_flows::state();
        sync(&mut dp, &state, &Changes::default(), true).unwrap();
        let before = fake.save(backend, IpFamily::V4);

        // An endpoint change whose restore fails: counted, and nothing of it applied.
        let changes = upsert(
            &mut state,
            Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1"]))),
        );
        fake.fail_next_restore();
        sync(&mut dp, &state, &changes, false).expect_err("the restore fails");
        assert_eq!(metrics.iptables_restore_failures.get(), 1);
        assert_eq!(metrics.iptables_partial_restore_failures.get(), 1);
        assert_eq!(fake.save(backend, IpFamily::V4), before);

        // The next sync, with no new change to hand, is full: it ends with the change applied
        // and the tables a fresh full sync of the same state leaves.
        let report = sync(&mut dp, &state, &Changes::default(), false).unwrap();
        assert!(report.full, "{backend}: the sync after a failure is full");
        assert_same_as_fresh(&fake, &state, backend, "after the failure");
        assert_eq!(
            endpoints(&fake, backend, "10.96.0.10"),
            BTreeSet::from(["10.244.1.11".to_string()])
        );
        assert!(verify(&mut dp).is_empty());
    }
}

#[test]
fn a_full_sync_failing_half_way_leaves_half_built_tables_that_the_next_sync_completes() {
    // Small steps with the nft backend, so the first sync is many restores; the third fails.
    let backend = Backend::Nft;
    let fake = fake();
    let cfg = IptablesConfig {
        step_chains: 4,
        ..config(backend)
    };
    let (mut dp, metrics) = dataplane(&fake, cfg);
    let state = kp_flows::state();
    fake.fail_restore_after(2);
    sync(&mut dp, &state, &Changes::default(), true).expect_err("the third restore fails");
    assert_eq!(metrics.iptables_restore_failures.get(), 1);
    // Two inputs went in: some Service chains exist, but nothing jumps to them yet.
    let nat = parse_save(&fake.save(backend, IpFamily::V4), "nat").unwrap();
    assert!(nat.chains.keys().any(|c| c.starts_with("KUBE-SVC-")));
    assert!(!nat.chains.contains_key("KUBE-SERVICES") || nat.chains["PREROUTING"].is_empty());

    // The next sync adopts what is there and writes only the rest.
    let restores = fake.restores();
    let report = sync(&mut dp, &state, &Changes::default(), false).unwrap();
    assert!(report.full);
    let adopted = &dp.last_adoption()[0];
    assert_eq!(adopted.fallback, None);
    assert!(adopted.kept > 0 && adopted.written > 0, "{adopted:?}");
    assert!(fake.restores() > restores);
    assert_same_as_fresh(&fake, &state, backend, "after the half-way failure");
    assert_rows_pass(&fake, backend, "after the half-way failure");
}

#[test]
fn one_endpoint_change_rewrites_only_its_services_chains_and_leaves_what_a_full_sync_would() {
    for backend in Backend::ALL {
        let fake = fake();
        let (mut dp, _) = dataplane(&fake, config(backend));
        let mut state = kp_flows::state();
        sync(&mut dp, &state, &Changes::default(), true).unwrap();
        let web = "10.96.0.10";
        let was = endpoints(&fake, backend, web);
        assert!(was.len() > 2, "{was:?}");

        let changes = upsert(
            &mut state,
            Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2"]))),
        );
        let report = sync(&mut dp, &state, &changes, false).expect("partial sync");
        assert!(!report.full);
        assert!(report.operations <= 30, "{report:?}");
        let key = changes.services.iter().next().expect("web changed");
        let mut allowed: BTreeSet<String> = kp_iptables::FIXED_CHAINS.map(String::from).into();
        for p in state.service_ports(key) {
            let n = kp_iptables_plan::names::service_chains(&p.name);
            allowed.extend([n.svc, n.svl, n.ext, n.fw]);
        }
        for c in chains_named(dp.last_inputs()) {
            assert!(
                allowed.contains(&c) || c.starts_with("KUBE-SEP-"),
                "{backend}: the partial restore touches {c}, not web's:\n{}",
                dp.last_inputs().join("\n")
            );
        }
        assert_eq!(
            endpoints(&fake, backend, web),
            BTreeSet::from(["10.244.1.11".to_string(), "10.244.1.12".to_string()])
        );
        assert_same_as_fresh(&fake, &state, backend, "after one endpoint change");
    }
}

#[test]
fn an_endpoint_leaving_an_affinity_service_takes_its_recent_list_and_no_other() {
    for backend in Backend::ALL {
        let fake = fake();
        let (mut dp, _) = dataplane(&fake, config(backend));
        let mut state = kp_flows::state();
        sync(&mut dp, &state, &Changes::default(), true).unwrap();
        assert!(fake.take_purged_recent().is_empty());
        // The recent list of sticky's pod-2 (10.244.1.12): the one its DNAT rule sets.
        let nat = parse_save(&fake.save(backend, IpFamily::V4), "nat").unwrap();
        let lists: BTreeSet<String> = nat
            .chains
            .values()
            .flatten()
            .filter(|r| r.contains("--set") && r.contains("--to-destination 10.244.1.12:"))
            .filter_map(|r| {
                let words = kp_iptables::split_args(r);
                words
                    .windows(2)
                    .find(|w| w[0] == "--name")
                    .map(|w| w[1].clone())
            })
            .collect();
        assert_eq!(
            lists.len(),
            1,
            "{backend}: pod-2 is in one affinity Service"
        );

        let changes = upsert(
            &mut state,
            Object::EndpointSlice(Box::new(kp_flows::sticky_slice(&["pod-1"]))),
        );
        let report = sync(&mut dp, &state, &changes, false).unwrap();
        assert!(!report.full);
        let purged: BTreeSet<String> = fake
            .take_purged_recent()
            .into_iter()
            .map(|(_, n)| n)
            .collect();
        assert_eq!(purged, lists, "{backend}: exactly pod-2's list goes");
        match fake.tracer(backend).trace(&from_pod("10.96.0.30")) {
            Verdict::Dnat {
                endpoints,
                affinity,
                ..
            } => {
                assert_eq!(endpoints.len(), 1);
                assert_eq!(affinity, Some(60), "pod-1 keeps its affinity");
            }
            other => panic!("{other:?}"),
        }
        assert_same_as_fresh(&fake, &state, backend, "after the affinity change");
    }
}

#[test]
fn a_rebuild_that_rewrites_every_chain_in_steps_never_drops_a_recent_list_it_keeps() {
    // Without adoption a full sync rewrites every chain; in inputs of two chains, the chains
    // naming one list may land in different commits. The kernel frees a list with its last
    // rule, so a rebuild that flushed first, or deleted a chain in one commit and wrote it in
    // a later one, would lose every client's affinity.
    let backend = Backend::Nft;
    let fake = fake();
    let cfg = IptablesConfig {
        step_chains: 2,
        adopt: false,
        ..config(backend)
    };
    let (mut dp, _) = dataplane(&fake, cfg);
    let mut changed = kp_flows::state();
    sync(&mut dp, &changed, &Changes::default(), true).unwrap();
    fake.take_purged_recent();
    // A failure makes the next sync a rebuild.
    fake.fail_next_restore();
    let changes = upsert(
        &mut changed,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-3"]))),
    );
    sync(&mut dp, &changed, &changes, false).expect_err("told to fail");
    let restores = fake.restores();
    let report = sync(&mut dp, &changed, &Changes::default(), false).unwrap();
    assert!(report.full);
    assert!(fake.restores() > restores + 5, "a rebuild in many inputs");
    assert_eq!(fake.take_purged_recent(), Vec::new());
    assert_same_as_fresh(&fake, &changed, backend, "after the rebuild");
}

#[test]
fn the_flow_table_passes_through_tables_built_by_a_sequence_of_syncs() {
    for backend in Backend::ALL {
        let fake = fake();
        let cfg = IptablesConfig {
            step_chains: 3,
            ..config(backend)
        };
        let (mut dp, _) = dataplane(&fake, cfg);
        // From an empty cluster, every object through its own partial sync, one of them
        // failing on the way (the sync after it is full), then a periodic full sync.
        let mut grown = ProxyState::new(kp_flows::NODE);
        sync(&mut dp, &grown, &Changes::default(), true).unwrap();
        for (i, o) in kp_flows::objects().into_iter().enumerate() {
            let changes = upsert(&mut grown, o);
            if i == 5 {
                fake.fail_next_restore();
                sync(&mut dp, &grown, &changes, false).expect_err("told to fail");
                continue;
            }
            sync(&mut dp, &grown, &changes, false)
                .unwrap_or_else(|e| panic!("{backend}: object {i}: {e}"));
        }
        let report = sync(&mut dp, &grown, &Changes::default(), true).unwrap();
        assert_eq!(
            report.operations, 0,
            "{backend}: the read-back finds nothing to repair"
        );
        assert_rows_pass(&fake, backend, "after the sequence");
        assert_same_as_fresh(&fake, &grown, backend, "after the sequence");

        // The table can fail here: without the jump from PREROUTING, rows that expect a DNAT
        // from outside do.
        let mut broken = fake.tracer(backend);
        for family in IpFamily::ALL {
            broken
                .apply(
                    family,
                    "*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n",
                )
                .expect("the jump is there to delete");
        }
        assert!(!kp_flows::check_tracer(&broken).is_empty());
    }
}

#[test]
fn cleanup_removes_every_chain_of_ours_and_the_jumps_to_them_and_nothing_else() {
    let backend = Backend::Legacy;
    let fake = fake();
    let (mut dp, _) = dataplane(&fake, config(backend));
    sync(&mut dp, &kp_flows::state(), &Changes::default(), true).unwrap();
    // Someone else's chain, jumped to from INPUT, itself jumping to one of ours.
    kp_iptables::IptablesRunner::restore(
        &fake,
        backend,
        IpFamily::V4,
        "*filter\n:MY-CHAIN - [0:0]\n-A MY-CHAIN -s 192.0.2.9/32 -j KUBE-SERVICES\n-A MY-CHAIN -j ACCEPT\n-A INPUT -j MY-CHAIN\nCOMMIT\n",
    )
    .expect("a chain of someone else's");

    Dataplane::cleanup(&mut dp).expect("cleanup");
    for family in IpFamily::ALL {
        let save = fake.save(backend, family);
        for table in ["mangle", "nat", "filter"] {
            let t = parse_save(&save, table).unwrap();
            let ours: Vec<&String> = t
                .chains
                .keys()
                .filter(|c| kp_iptables::is_owned_chain(c))
                .collect();
            assert!(ours.is_empty(), "{family:?} {table}: {ours:?} left");
            for (chain, rules) in &t.chains {
                assert!(
                    !rules.iter().any(|r| r.contains("-j KUBE-")),
                    "{family:?} {table} {chain}: a jump to a chain of ours is left: {rules:?}"
                );
            }
        }
    }
    let filter = parse_save(&fake.save(backend, IpFamily::V4), "filter").unwrap();
    assert_eq!(filter.chains["MY-CHAIN"], ["-j ACCEPT"]);
    assert_eq!(filter.chains["INPUT"], ["-j MY-CHAIN"]);
}
