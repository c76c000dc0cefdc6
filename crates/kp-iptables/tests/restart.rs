//! A restart over what an earlier process programmed, on both backends, in labs of network
//! namespaces: the new process's first (full) sync reads the kernel's chains back and sends only
//! what differs. Over an unchanged table it sends nothing, and ClientIP affinity (the kernel's
//! `recent` tables) survives; after changes made while it was down it sends exactly the chains
//! that changed; a chain tampered with is repaired; a read-back that fails falls back to
//! rewriting everything.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::model::IpFamily;
use kp_core::node::NodeContext;
use kp_core::track::{Changes, Object, ProxyState, SourceEvent};
use kp_iptables::{Backend, IptablesConfig, IptablesDataplane, CANARY_CHAIN};
use kp_iptables_plan::{names, PlanConfig, Planner, Table};
use kp_metrics::Metrics;
use kp_test::netns::Netns;

mod common;
use common::{assert_in_sync, chains_named, command, config, delete_first_nat_rule};

/// A kube-proxy process's dataplane: a new one is a restarted process, knowing nothing.
fn process(ns: &Netns, backend: Backend) -> IptablesDataplane {
    IptablesDataplane::new(config(backend), command(ns), Arc::new(Metrics::new()))
}

/// The restore inputs of the last sync, for failure messages.
fn sent(dp: &IptablesDataplane) -> String {
    dp.last_inputs().join("\n")
}

/// Asserts that what the last sync sent is at most bookkeeping (the canaries, the jumps from
/// the built-in chains): no chain of ours written or deleted.
#[track_caller]
fn assert_only_bookkeeping(dp: &IptablesDataplane) {
    for line in dp.last_inputs().iter().flat_map(|i| i.lines()) {
        let ok = line.starts_with('*')
            || line == "COMMIT"
            || line == format!(":{CANARY_CHAIN} - [0:0]")
            || line.starts_with("-I ");
        assert!(ok, "`{line}` is not bookkeeping:\n{}", sent(dp));
    }
}

/// The affinity row of the flow table: pod-4 to the sticky Service 10.96.0.30:80.
fn affinity_row() -> kp_flows::Case {
    kp_flows::cases()
        .into_iter()
        .find(|c| c.name.contains("ClientIP affinity"))
        .expect("the flow table has an affinity row")
}

/// Every `recent` table of the node's namespace (`/proc/net/xt_recent/*`) with its entries as
/// the kernel prints them (source, TTL, last seen and packet times in jiffies: a table that
/// was destroyed and created again, or an entry refreshed, reads differently).
fn recent_tables(ns: &Netns) -> BTreeMap<String, String> {
    let out = ns
        .run(&[
            "sh",
            "-c",
            "for f in /proc/net/xt_recent/*; do [ -e \"$f\" ] && echo \"== $f\" && cat \"$f\"; done; true",
        ])
        .expect("read /proc/net/xt_recent");
    let mut tables = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in out.lines() {
        if let Some(name) = line.strip_prefix("== /proc/net/xt_recent/") {
            current = Some(name.to_string());
            tables.insert(name.to_string(), String::new());
        } else if let Some(name) = &current {
            if let Some(text) = tables.get_mut(name) {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    tables
}

/// 1. A restart over an unchanged table: the new process's full sync sends nothing (at most
///    a canary or a jump), the drift check finds nothing, the affinity entry a real connection
///    made survives untouched (as it does a rewrite of every chain), and the next sync is
///    partial.
fn unchanged(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let mut state = kp_flows::state();
    let mut before = process(lab.node(), backend);
    before
        .sync(&state, &Changes::default(), true)
        .expect("first process: first sync");
    assert_in_sync(&mut before, "first process");

    // A real connection through the lab leaves pod-4's address in the recent table of the
    // sticky Service's endpoint it reached.
    let row = affinity_row();
    kp_test::flows::check(&lab, &row).unwrap_or_else(|e| panic!("{}: {e}", row.name));
    let pod4 = kp_flows::pods()
        .into_iter()
        .find(|p| p.name == "pod-4")
        .expect("pod-4")
        .v4;
    let recent = recent_tables(lab.node());
    assert!(
        recent.values().any(|t| t.contains(&format!("src={pod4} "))),
        "no affinity entry for {pod4}: {recent:#?}"
    );
    drop(before);

    let mut after = process(lab.node(), backend);
    let report = after
        .sync(&state, &Changes::default(), true)
        .expect("restarted process: first sync");
    assert!(report.full, "the first sync of a process is a full one");
    assert_only_bookkeeping(&after);
    assert_eq!(report.operations, 0, "{}", sent(&after));
    assert!(after.last_inputs().is_empty(), "{}", sent(&after));
    let adoption = after.last_adoption();
    assert_eq!(adoption.len(), 2, "{adoption:#?}");
    for a in adoption {
        assert_eq!(a.fallback, None, "{a:#?}");
        assert_eq!((a.written, a.deleted), (0, 0), "{a:#?}");
        assert!(a.planned > 10 && a.kept == a.planned, "{a:#?}");
    }
    assert_in_sync(&mut after, "restarted process");
    assert_eq!(
        recent_tables(lab.node()),
        recent,
        "the recent tables changed across the restart"
    );
    // A rewrite of every chain (adoption off, as before it) keeps them too: each chain that
    // names a recent table is rewritten within one restore input, whose new rules take a
    // reference on the table before the old rules drop theirs.
    let mut rewrite = IptablesDataplane::new(
        IptablesConfig {
            adopt: false,
            ..config(backend)
        },
        command(lab.node()),
        Arc::new(Metrics::new()),
    );
    let report = rewrite
        .sync(&state, &Changes::default(), true)
        .expect("a rewrite of every chain");
    assert!(report.operations > 100);
    assert_eq!(recent_tables(lab.node()), recent, "a rewrite lost them");
    drop(rewrite);
    // The client still reaches the pod it was pinned to.
    kp_test::flows::check(&lab, &row).unwrap_or_else(|e| panic!("{}: {e}", row.name));

    // The planner of the restarted process is programmed: the next change is a partial sync.
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
            kp_flows::web_slice(&["pod-1", "pod-2"]),
        ))))
        .unwrap();
    let changes = state.take_changes();
    let report = after
        .sync(&state, &changes, false)
        .expect("partial sync after the restart");
    assert!(!report.full);
    assert_in_sync(&mut after, "partial sync after the restart");
}

#[test]
#[ignore = "needs root"]
fn nft_backend_a_restart_over_an_unchanged_table_sends_nothing_and_keeps_affinity() {
    unchanged(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_a_restart_over_an_unchanged_table_sends_nothing_and_keeps_affinity() {
    unchanged(Backend::Legacy);
}

/// Synthetic Service `i` (a plain ClusterIP Service on TCP 80) at ClusterIP `ip`, away from the
/// fixture's addresses, with `per` endpoints elsewhere, the first `local` of them on this node
/// (which gives them `KUBE-SEP` chains).
fn extra_service(i: usize, ip: &str, per: usize, local: usize) -> [Object; 2] {
    let mut svc = kp_flows::synthetic::service(i);
    if let Some(spec) = svc.spec.as_mut() {
        spec.cluster_ip = Some(ip.to_string());
        spec.cluster_ips = Some(vec![ip.to_string()]);
    }
    let mut slice: EndpointSlice = kp_flows::synthetic::slice(i, per, &[]);
    for e in slice.endpoints.iter_mut().flatten().take(local) {
        e.node_name = Some(kp_flows::NODE.to_string());
    }
    [
        Object::Service(Box::new(svc)),
        Object::EndpointSlice(Box::new(slice)),
    ]
}

/// What the planner plans for `state`, per family, by table and chain.
fn planned(
    state: &ProxyState,
    cfg: &IptablesConfig,
) -> BTreeMap<(IpFamily, Table, String), Vec<String>> {
    let node = NodeContext::resolve(&cfg.detect_local, &cfg.node_ports, state);
    let mut out = BTreeMap::new();
    for family in IpFamily::ALL {
        let mut p = Planner::new(PlanConfig::new(family));
        p.full(state, &node);
        for ((t, c), rules) in p.expected(state) {
            out.insert((family, t, c), rules);
        }
    }
    out
}

/// 2. Changes while the process was down (an endpoint on this node removed, a Service added
///    and one removed): the restart writes and deletes exactly the chains that differ between
///    the two plans, the drift check is clean, and the flow table passes with real packets.
fn changed_while_down(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let mut objects = kp_flows::objects();
    objects.extend(extra_service(1000, "10.96.7.1", 3, 2));
    objects.extend(extra_service(1002, "10.96.7.2", 2, 0));
    let old = kp_flows::load(kp_flows::NODE, objects);
    let mut before = process(lab.node(), backend);
    before
        .sync(&old, &Changes::default(), true)
        .expect("first process: first sync");
    assert_in_sync(&mut before, "first process");
    drop(before);

    // While it is down: svc-1000 loses one of its two endpoints on this node, svc-1002 is
    // deleted, svc-1006 is created.
    let mut state = kp_flows::load(kp_flows::NODE, kp_flows::objects());
    let [svc, mut slice] = extra_service(1000, "10.96.7.1", 3, 2);
    if let Object::EndpointSlice(s) = &mut slice {
        if let Some(eps) = s.endpoints.as_mut() {
            eps.remove(0);
        }
    }
    for o in [svc, slice]
        .into_iter()
        .chain(extra_service(1006, "10.96.7.6", 2, 1))
    {
        state.apply(SourceEvent::Upsert(o)).unwrap();
    }
    state.take_changes();
    let cfg = config(backend);
    let (then, now) = (planned(&old, &cfg), planned(&state, &cfg));
    type Chains = BTreeMap<IpFamily, BTreeSet<(Table, String)>>;
    let mut differ: Chains = BTreeMap::new();
    let mut gone: Chains = BTreeMap::new();
    for ((f, t, c), rules) in &now {
        if then.get(&(*f, *t, c.clone())) != Some(rules) {
            differ.entry(*f).or_default().insert((*t, c.clone()));
        }
    }
    for (f, t, c) in then.keys() {
        if !now.contains_key(&(*f, *t, c.clone())) {
            gone.entry(*f).or_default().insert((*t, c.clone()));
        }
    }
    let v4 = |m: &Chains| m.get(&IpFamily::V4).cloned().unwrap_or_default();
    let nat = |m: &Chains, prefix: &str| {
        v4(m)
            .iter()
            .any(|(t, c)| *t == Table::Nat && c.starts_with(prefix))
    };
    // The oracle itself: svc-1000's KUBE-SVC rewritten and one KUBE-SEP gone, svc-1002's
    // chains gone, svc-1006's new, and the dispatch chains.
    assert!(nat(&gone, names::SEP_PREFIX), "{gone:#?}");
    assert!(nat(&gone, names::SVC_PREFIX), "{gone:#?}");
    assert!(nat(&differ, names::KUBE_SERVICES), "{differ:#?}");
    assert!(v4(&differ).len() < 10, "{differ:#?}");

    let mut after = process(lab.node(), backend);
    let report = after
        .sync(&state, &Changes::default(), true)
        .expect("restarted process: first sync");
    assert!(report.full);
    let expected: BTreeSet<String> = differ
        .values()
        .chain(gone.values())
        .flatten()
        .map(|(_, c)| c.clone())
        .collect();
    let mut named = chains_named(after.last_inputs());
    named.remove(CANARY_CHAIN);
    assert_eq!(named, expected, "{}", sent(&after));
    for a in after.last_adoption() {
        let f = a.family;
        assert_eq!(a.fallback, None, "{a:#?}");
        let want = (
            differ.get(&f).map_or(0, BTreeSet::len),
            gone.get(&f).map_or(0, BTreeSet::len),
        );
        assert_eq!((a.written, a.deleted), want, "{a:#?}");
        assert_eq!(a.kept + a.written, a.planned, "{a:#?}");
    }
    assert_in_sync(&mut after, "restarted process");
    kp_test::flows::assert_all(&lab);
}

#[test]
#[ignore = "needs root"]
fn nft_backend_a_restart_after_changes_while_down_sends_only_the_chains_that_changed() {
    changed_while_down(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_a_restart_after_changes_while_down_sends_only_the_chains_that_changed() {
    changed_while_down(Backend::Legacy);
}

/// 3. Chains tampered with while the process was down (a rule deleted from the web Service's
///    `KUBE-SVC` chain and from `KUBE-POSTROUTING`): the restart rewrites those two, and only
///    them, and traffic flows as planned.
fn tampered(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let state = kp_flows::state();
    let mut before = process(lab.node(), backend);
    before
        .sync(&state, &Changes::default(), true)
        .expect("first process: first sync");
    drop(before);

    let web = state
        .service_ports(&kp_core::model::ServiceKey::new("default", "web"))
        .iter()
        .map(|p| names::service_chains(&p.name).svc)
        .next()
        .expect("web has a port");
    for chain in [web.as_str(), names::KUBE_POSTROUTING] {
        delete_first_nat_rule(lab.node(), backend, chain);
    }

    let mut after = process(lab.node(), backend);
    after
        .sync(&state, &Changes::default(), true)
        .expect("restarted process: first sync");
    let named = chains_named(after.last_inputs());
    let want: BTreeSet<String> = [web.clone(), names::KUBE_POSTROUTING.to_string()].into();
    assert_eq!(named, want, "{}", sent(&after));
    for a in after.last_adoption() {
        let written = if a.family == IpFamily::V4 { 2 } else { 0 };
        assert_eq!(
            (a.fallback.as_deref(), a.written),
            (None, written),
            "{a:#?}"
        );
    }
    assert_in_sync(&mut after, "repaired");
    kp_test::flows::assert_all(&lab);
}

#[test]
#[ignore = "needs root"]
fn nft_backend_a_restart_repairs_chains_tampered_with_while_down() {
    tampered(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_a_restart_repairs_chains_tampered_with_while_down() {
    tampered(Backend::Legacy);
}

/// A stand-in for iptables-save that fails.
fn failing_save(dir: &std::path::Path) -> std::path::PathBuf {
    let script = dir.join("save");
    kp_test::write_executable(
        &script,
        "#!/bin/sh\necho 'iptables-save: cannot read' >&2\nexit 1\n",
    )
    .unwrap();
    script
}

/// When the tables cannot be read whole, the restart rewrites every chain, as before adoption,
/// and says why. With nft the chain names still come from `nft list chains`: a failing
/// iptables-nft-save, or more chains than `adopt_chain_limit`, falls back. With legacy the save
/// is the only read: if it fails the sync fails (nothing is known of the kernel), and the next
/// one adopts.
fn read_back_fails(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipt-adopt-fail").expect("netns");
    let state = kp_flows::state();
    let mut before = process(&ns, backend);
    before
        .sync(&state, &Changes::default(), true)
        .expect("first process: first sync");
    drop(before);

    let dir = std::env::temp_dir().join(format!(
        "kp-ipt-adopt-{}-{}",
        std::process::id(),
        backend.as_str()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut after = process(&ns, backend);
    after.set_command(command(&ns).with_save_program(failing_save(&dir)));
    match backend {
        Backend::Nft => {
            let report = after
                .sync(&state, &Changes::default(), true)
                .expect("a full restore without the read-back");
            assert!(report.operations > 0);
            for a in after.last_adoption() {
                let why = a.fallback.as_deref().unwrap_or_default();
                assert!(why.contains("cannot read the tables whole"), "{a:#?}");
                assert_eq!((a.written, a.kept), (a.planned, 0), "{a:#?}");
            }
            after.set_command(command(&ns));
            assert_in_sync(&mut after, "after the full restore");

            // Too many chains to read whole: the same.
            let mut big = IptablesDataplane::new(
                IptablesConfig {
                    adopt_chain_limit: 1,
                    ..config(backend)
                },
                command(&ns),
                Arc::new(Metrics::new()),
            );
            big.sync(&state, &Changes::default(), true)
                .expect("a full restore without the read-back");
            for a in big.last_adoption() {
                let why = a.fallback.as_deref().unwrap_or_default();
                assert!(why.contains("more than 1"), "{a:#?}");
                assert_eq!(a.written, a.planned, "{a:#?}");
            }
            assert_in_sync(&mut big, "after the full restore");
        }
        Backend::Legacy => {
            let err = after
                .sync(&state, &Changes::default(), true)
                .expect_err("nothing is known of the kernel");
            assert!(err.to_string().contains("cannot read"), "{err}");
            after.set_command(command(&ns));
            let report = after
                .sync(&state, &Changes::default(), false)
                .expect("the next sync");
            assert!(report.full);
            assert_eq!(report.operations, 0, "{}", sent(&after));
            assert_in_sync(&mut after, "after the failed read");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs root"]
fn nft_backend_a_restart_that_cannot_read_the_tables_rewrites_everything() {
    read_back_fails(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_a_restart_that_cannot_read_the_tables_fails_and_the_next_sync_adopts() {
    read_back_fails(Backend::Legacy);
}
