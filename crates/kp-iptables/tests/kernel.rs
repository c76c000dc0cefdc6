//! The iptables dataplane against real kernels, on both backends, inside labs of network
//! namespaces: the packet-flow table with real packets, live changes, the canary, drift repair
//! and cleanup.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::model::IpFamily;
use kp_core::track::{Changes, Object, SourceEvent};
use kp_iptables::{
    parse_save, Backend, IptablesCommand, IptablesConfig, IptablesDataplane, NodePortAddresses,
};
use kp_metrics::Metrics;
use kp_test::echo::{tally, Outcome, Proto, Request};
use kp_test::lab::Lab;
use kp_test::netns::Netns;

mod common;
use common::{assert_in_sync, chains_named, command, config, delete_first_nat_rule};

fn dataplane(ns: &Netns, backend: Backend, metrics: Arc<Metrics>) -> IptablesDataplane {
    IptablesDataplane::new(config(backend), command(ns), metrics)
}

const WEB: &str = "10.96.0.10";

/// The pods that answered `tries` connections from pod-4 to the web ClusterIP.
fn web_backends(lab: &Lab, tries: usize) -> Vec<String> {
    let outcomes = lab.send(
        lab.pod(4),
        &Request::new(Proto::Tcp, WEB.parse().unwrap(), 80).count(tries),
    );
    let answered: Vec<Outcome> = outcomes
        .into_iter()
        .filter(|o| matches!(o, Outcome::Answered { .. }))
        .collect();
    tally(&answered).into_keys().collect()
}

fn flow_table(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let metrics = Arc::new(Metrics::new());
    let mut dp = dataplane(lab.node(), backend, metrics.clone());
    let mut state = kp_flows::state();

    let report = dp
        .sync(&state, &Changes::default(), true)
        .expect("first sync");
    assert!(report.full);
    assert_in_sync(&mut dp, "read-back");
    kp_test::flows::assert_all(&lab);
    // The real-packet checker can fail: the first row, expecting a drop, must not pass.
    let mut wrong = kp_flows::cases()[0].clone();
    wrong.expect = kp_flows::Expect::Drop;
    assert!(kp_test::flows::check(&lab, &wrong).is_err());
    let nat_rules = metrics.encode();
    assert!(
        nat_rules.contains("kubeproxy_sync_proxy_rules_iptables_total{table=\"nat\"}"),
        "{nat_rules}"
    );

    // A live endpoint change rewrites only the web Service's chains, and traffic follows it.
    let slice = kp_flows::web_slice(&["pod-1", "pod-2"]);
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .unwrap();
    let changes = state.take_changes();
    let report = dp.sync(&state, &changes, false).expect("partial sync");
    assert!(!report.full);
    let web_key = changes.services.iter().next().expect("web changed").clone();
    let mut allowed: BTreeSet<String> = BTreeSet::new();
    let fixed = kp_iptables::FIXED_CHAINS.map(str::to_string);
    for p in state.service_ports(&web_key) {
        let names = kp_iptables_plan::names::service_chains(&p.name);
        allowed.extend([names.svc, names.svl, names.ext, names.fw]);
    }
    let named = chains_named(dp.last_inputs());
    assert!(!named.is_empty(), "nothing sent for an endpoint change");
    for c in &named {
        assert!(
            allowed.contains(c) || fixed.contains(c) || c.starts_with("KUBE-SEP-"),
            "the partial restore touches {c}, which is not the web Service's:\n{}",
            dp.last_inputs().join("\n")
        );
    }
    assert!(
        report.operations <= 30,
        "{} operations:\n{}",
        report.operations,
        dp.last_inputs().join("\n")
    );
    assert_in_sync(&mut dp, "read-back");
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2"]);

    // A periodic full sync with nothing changed behind our back rewrites nothing.
    let report = dp
        .sync(&state, &Changes::default(), true)
        .expect("verified sync");
    assert!(!report.full, "no drift, so no rebuild");
    assert_eq!(report.operations, 0);
    assert!(dp.last_inputs().is_empty());

    // Drift (a rule deleted by hand) is found and repaired by the next full sync.
    delete_first_nat_rule(lab.node(), backend, "KUBE-SERVICES");
    let diffs = dp.verify().unwrap();
    assert!(
        diffs.iter().any(|d| d.contains("KUBE-SERVICES")),
        "read-back must notice the missing rule: {diffs:?}"
    );
    let mismatches = metrics.iptables_readback_mismatches.get();
    let report = dp.sync(&state, &Changes::default(), true).expect("repair");
    assert!(report.full);
    assert!(metrics.iptables_readback_mismatches.get() > mismatches);
    assert_in_sync(&mut dp, "read-back");

    // Drift inside a Service chain: the planner keeps a digest of it, not its rules, and the
    // read-back still names the chain; the periodic sync (which renders it again from the
    // state to show the rule) counts exactly that one difference and repairs it.
    let svc = state
        .service_ports(&web_key)
        .iter()
        .map(|p| kp_iptables_plan::names::service_chains(&p.name).svc)
        .next()
        .expect("web has a port");
    delete_first_nat_rule(lab.node(), backend, &svc);
    let diffs = dp.verify().unwrap();
    assert_eq!(diffs.len(), 1, "{diffs:#?}");
    assert!(
        diffs[0].contains(&format!("chain {svc}: rules differ from the plan")),
        "{diffs:#?}"
    );
    let mismatches = metrics.iptables_readback_mismatches.get();
    let report = dp
        .sync(&state, &Changes::default(), true)
        .expect("repair a Service chain");
    assert!(report.full);
    assert_eq!(metrics.iptables_readback_mismatches.get(), mismatches + 1);
    assert_in_sync(&mut dp, "read-back");

    // Back to the fixture's endpoints: the whole table passes again.
    let slice = kp_flows::web_slice(&["pod-1", "pod-2", "pod-3"]);
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .unwrap();
    let changes = state.take_changes();
    let report = dp.sync(&state, &changes, false).expect("partial sync back");
    assert!(!report.full);
    assert_in_sync(&mut dp, "read-back");
    kp_test::flows::assert_all(&lab);
}

#[test]
#[ignore = "needs root"]
fn nft_backend_passes_the_flow_table_follows_changes_and_matches_the_plan_after_every_sync() {
    flow_table(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_passes_the_flow_table_follows_changes_and_matches_the_plan_after_every_sync() {
    flow_table(Backend::Legacy);
}

fn canary(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = Lab::new(5).expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let mut dp = dataplane(lab.node(), backend, Arc::new(Metrics::new()));
    let state = kp_flows::state();
    dp.sync(&state, &Changes::default(), true)
        .expect("first sync");
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2", "pod-3"]);

    // Someone flushes and deletes every chain of the nat table.
    let iptables = backend.program(IpFamily::V4, "");
    for op in ["-F", "-X"] {
        lab.node()
            .run(&[&iptables, "-w", "120", "-t", "nat", op])
            .unwrap();
    }
    let nat = parse_save(
        &command(lab.node())
            .save(backend, IpFamily::V4, Some("nat"))
            .unwrap(),
        "nat",
    )
    .unwrap();
    assert!(!nat.chains.contains_key("KUBE-PROXY-CANARY"));
    assert!(
        web_backends(&lab, 3).is_empty(),
        "without the nat rules nothing answers on the ClusterIP"
    );

    // The next periodic sync notices the missing canary and rebuilds; traffic flows again.
    let report = dp.sync(&state, &Changes::default(), true).expect("rebuild");
    assert!(report.full, "a missing canary means a rebuild");
    assert_in_sync(&mut dp, "read-back");
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2", "pod-3"]);
}

#[test]
#[ignore = "needs root"]
fn nft_backend_rebuilds_after_someone_flushes_nat() {
    canary(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_rebuilds_after_someone_flushes_nat() {
    canary(Backend::Legacy);
}

/// A stand-in for iptables-restore that reads its input and fails as a kernel refusal would.
fn failing_restore(dir: &std::path::Path) -> std::path::PathBuf {
    let script = dir.join("restore");
    kp_test::write_executable(
        &script,
        "#!/bin/sh\ncat >/dev/null\necho 'iptables-restore: line 3 failed' >&2\nexit 1\n",
    )
    .unwrap();
    script
}

fn failed_restore(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = Lab::new(5).expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let metrics = Arc::new(Metrics::new());
    let mut dp = dataplane(lab.node(), backend, metrics.clone());
    let mut state = kp_flows::state();
    dp.sync(&state, &Changes::default(), true)
        .expect("first sync");

    let dir = std::env::temp_dir().join(format!(
        "kp-ipt-fail-{}-{}",
        std::process::id(),
        backend.as_str()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dp.set_command(command(lab.node()).with_restore_program(failing_restore(&dir)));

    let slice = kp_flows::web_slice(&["pod-1"]);
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .unwrap();
    let changes = state.take_changes();
    let err = dp.sync(&state, &changes, false).unwrap_err();
    match &err {
        kp_iptables::Error::Restore {
            line, failing_line, ..
        } => {
            assert_eq!(*line, Some(3), "{err}");
            assert!(failing_line.is_some(), "{err}");
        }
        other => panic!("expected a restore error, got {other}"),
    }
    assert_eq!(metrics.iptables_restore_failures.get(), 1);
    assert_eq!(metrics.iptables_partial_restore_failures.get(), 1);

    // The old rules are intact and still serving.
    assert_eq!(web_backends(&lab, 30), ["pod-1", "pod-2", "pod-3"]);

    // A sync while restores still fail is a full one, and fails as a full one.
    let err = dp.sync(&state, &Changes::default(), false).unwrap_err();
    assert!(matches!(err, kp_iptables::Error::Restore { .. }), "{err}");
    assert_eq!(metrics.iptables_restore_failures.get(), 2);
    assert_eq!(metrics.iptables_partial_restore_failures.get(), 1);
    assert_eq!(web_backends(&lab, 20), ["pod-1", "pod-2", "pod-3"]);

    // Once restores work again, the next sync is a full one (even if asked for a partial) and
    // brings the change.
    dp.set_command(command(lab.node()));
    let report = dp
        .sync(&state, &Changes::default(), false)
        .expect("sync after the failure");
    assert!(report.full, "the sync after a failed restore must be full");
    assert_in_sync(&mut dp, "read-back");
    assert_eq!(web_backends(&lab, 20), ["pod-1"]);
    assert_eq!(metrics.iptables_restore_failures.get(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs root"]
fn nft_backend_a_failed_restore_keeps_the_old_rules_and_the_next_sync_is_full() {
    failed_restore(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_a_failed_restore_keeps_the_old_rules_and_the_next_sync_is_full() {
    failed_restore(Backend::Legacy);
}

/// Every chain in mangle, filter and nat that is not built in, and every rule, of one family.
fn dump(
    cmd: &IptablesCommand,
    backend: Backend,
    family: IpFamily,
) -> (BTreeSet<String>, Vec<String>) {
    let mut chains = BTreeSet::new();
    let mut rules = Vec::new();
    for t in ["mangle", "filter", "nat"] {
        let saved = parse_save(&cmd.save(backend, family, Some(t)).unwrap(), t).unwrap();
        for (c, rs) in &saved.chains {
            if !saved.builtin.contains(c) {
                chains.insert(format!("{t}/{c}"));
            }
            rules.extend(rs.iter().map(|r| format!("{t}/{c} {r}")));
        }
    }
    (chains, rules)
}

fn cleanup(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipt-cleanup").expect("netns");
    let cmd = command(&ns);
    // Someone else's chains, created before kube-proxy starts: kubelet's, and one of a user's
    // with a rule and a jump from INPUT.
    for family in IpFamily::ALL {
        for t in ["mangle", "nat", "filter"] {
            cmd.run_ok(backend, family, &["-t", t, "-N", "KUBE-KUBELET-CANARY"])
                .unwrap();
        }
        cmd.run_ok(backend, family, &["-N", "MY-CHAIN"]).unwrap();
        cmd.run_ok(
            backend,
            family,
            &[
                "-A", "MY-CHAIN", "-p", "tcp", "--dport", "22", "-j", "ACCEPT",
            ],
        )
        .unwrap();
        cmd.run_ok(backend, family, &["-A", "INPUT", "-j", "MY-CHAIN"])
            .unwrap();
    }
    let before: Vec<_> = IpFamily::ALL.map(|f| dump(&cmd, backend, f)).to_vec();

    let mut dp = dataplane(&ns, backend, Arc::new(Metrics::new()));
    dp.sync(&kp_flows::state(), &Changes::default(), true)
        .expect("sync");
    for (i, family) in IpFamily::ALL.into_iter().enumerate() {
        let (chains, _) = dump(&cmd, backend, family);
        assert!(
            chains.len() > before[i].0.len() + 10,
            "{family:?}: the sync programmed nothing: {chains:?}"
        );
    }

    dp.cleanup().expect("cleanup");
    for (i, family) in IpFamily::ALL.into_iter().enumerate() {
        let after = dump(&cmd, backend, family);
        assert_eq!(
            after, before[i],
            "{backend} {family:?}: cleanup left or removed something"
        );
    }
    // Cleaning up twice is fine.
    dp.cleanup().expect("second cleanup");
    // And the dataplane programs again afterwards.
    dp.sync(&kp_flows::state(), &Changes::default(), true)
        .expect("sync after cleanup");
    assert_in_sync(&mut dp, "read-back");
}

#[test]
#[ignore = "needs root"]
fn nft_backend_cleanup_removes_everything_ours_and_nothing_else() {
    cleanup(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_cleanup_removes_everything_ours_and_nothing_else() {
    cleanup(Backend::Legacy);
}

/// Chains left by an earlier run (a Service deleted while kube-proxy was down) are deleted by
/// the first sync.
#[test]
#[ignore = "needs root"]
fn the_first_sync_deletes_chains_an_earlier_run_left_behind() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipt-leftover").expect("netns");
    let cmd = command(&ns);
    cmd.restore(
        Backend::Nft,
        IpFamily::V4,
        "*nat\n:KUBE-SVC-LEFTOVERLEFTOVER - [0:0]\n:KUBE-SEP-LEFTOVERLEFTOVER - [0:0]\n-A KUBE-SVC-LEFTOVERLEFTOVER -j KUBE-SEP-LEFTOVERLEFTOVER\n-A KUBE-SEP-LEFTOVERLEFTOVER -p tcp -j DNAT --to-destination 10.1.1.1:80\nCOMMIT\n",
    )
    .unwrap();
    let mut dp = dataplane(&ns, Backend::Nft, Arc::new(Metrics::new()));
    dp.sync(&kp_flows::state(), &Changes::default(), true)
        .expect("sync");
    let (chains, _) = dump(&cmd, Backend::Nft, IpFamily::V4);
    assert!(!chains.iter().any(|c| c.contains("LEFTOVER")), "{chains:?}");
    assert_in_sync(&mut dp, "read-back");
}

/// With `nodePortAddresses` covering 127.0.0.1 and `localhostNodePorts` (upstream's iptables
/// defaults), the node reaches NodePorts on 127.0.0.1: `route_localnet` is set in the node's
/// namespace, and our `KUBE-FIREWALL` guards it; cleanup removes that chain too.
fn localhost_node_ports(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = Lab::new(5).expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let cfg = IptablesConfig {
        node_ports: NodePortAddresses::AllLocal,
        ..config(backend)
    };
    assert!(cfg.localhost_node_ports_effective());
    let mut dp = IptablesDataplane::new(cfg, command(lab.node()), Arc::new(Metrics::new()));
    assert_eq!(
        lab.node()
            .run(&["sysctl", "-n", "net.ipv4.conf.all.route_localnet"])
            .unwrap()
            .trim(),
        "0"
    );
    dp.sync(&kp_flows::state(), &Changes::default(), true)
        .expect("sync");
    assert_in_sync(&mut dp, "read-back");
    assert_eq!(
        lab.node()
            .run(&["sysctl", "-n", "net.ipv4.conf.all.route_localnet"])
            .unwrap()
            .trim(),
        "1"
    );
    let outcomes = lab.send(
        lab.node(),
        &Request::new(Proto::Tcp, "127.0.0.1".parse().unwrap(), 30080).count(30),
    );
    let seen: Vec<String> = tally(&outcomes).into_keys().collect();
    assert_eq!(seen, ["pod-1", "pod-2", "pod-3"], "{outcomes:?}");
    let (chains, _) = dump(&command(lab.node()), backend, IpFamily::V4);
    assert!(chains.contains("filter/KUBE-FIREWALL"), "{chains:?}");

    dp.cleanup().expect("cleanup");
    let (chains, rules) = dump(&command(lab.node()), backend, IpFamily::V4);
    assert!(chains.is_empty(), "{chains:?}");
    assert!(rules.is_empty(), "{rules:?}");
}

#[test]
#[ignore = "needs root"]
fn nft_backend_answers_node_ports_on_localhost_when_asked_to() {
    localhost_node_ports(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_answers_node_ports_on_localhost_when_asked_to() {
    localhost_node_ports(Backend::Legacy);
}

/// Synthetic Service `i` moved to ClusterIP `ip` (of either family), with its endpoints when
/// `with_endpoints` (IPv4 ones, so an IPv6 Service has none and is rejected in filter).
fn moved_service(i: usize, ip: &str, with_endpoints: bool) -> Vec<Object> {
    let mut svc = kp_flows::synthetic::service(i);
    if let Some(spec) = svc.spec.as_mut() {
        spec.cluster_ip = Some(ip.to_string());
        spec.cluster_ips = Some(vec![ip.to_string()]);
        let family = if ip.contains(':') { "IPv6" } else { "IPv4" };
        spec.ip_families = Some(vec![family.to_string()]);
    }
    let mut out = vec![Object::Service(Box::new(svc))];
    if with_endpoints {
        out.push(Object::EndpointSlice(Box::new(kp_flows::synthetic::slice(
            i,
            2,
            &[],
        ))));
    }
    out
}

/// ClusterIPs from two unrelated Service ranges (10.96.0.0/16 and 192.168.50.0/24;
/// fd00:10:96::/112 and 2001:db8:50::/112), as clusters with several Service CIDRs have: the
/// smallest network holding them is the whole address space. iptables-nft refuses the
/// negated zero-length prefix `! -d 0.0.0.0/0` (`RULE_APPEND failed (Invalid argument)`), which
/// once failed every restore of the filter table: a full sync, then a partial one adding a
/// Service without endpoints in the second range, must load on both backends and in both
/// families, and read back exactly as planned.
fn two_service_ranges(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipt-ranges").expect("netns");
    let metrics = Arc::new(Metrics::new());
    let mut dp = dataplane(&ns, backend, metrics.clone());
    let mut objects = kp_flows::objects();
    objects.extend(moved_service(1, "192.168.50.10", true));
    objects.extend(moved_service(2, "2001:db8:50::10", false));
    let mut state = kp_flows::load(kp_flows::NODE, objects);
    let report = dp
        .sync(&state, &Changes::default(), true)
        .unwrap_or_else(|e| panic!("{backend}: full sync: {e}"));
    assert!(report.full);
    assert_in_sync(&mut dp, "full sync");

    for o in moved_service(3, "192.168.50.30", false)
        .into_iter()
        .chain(moved_service(4, "2001:db8:50::40", false))
    {
        state.apply(SourceEvent::Upsert(o)).unwrap();
    }
    let changes = state.take_changes();
    let report = dp
        .sync(&state, &changes, false)
        .unwrap_or_else(|e| panic!("{backend}: partial sync: {e}"));
    assert!(!report.full);
    assert_in_sync(&mut dp, "partial sync");
    assert_eq!(metrics.iptables_restore_failures.get(), 0);
    let filter = dp.last_inputs().join("\n");
    for vip in ["192.168.50.30/32", "2001:db8:50::40/128"] {
        assert!(
            filter.contains(&format!(
                "-d {vip} -p tcp -m comment --comment \"bench/svc-"
            )),
            "the new Service's REJECT for {vip} was not sent:\n{filter}"
        );
    }
}

#[test]
#[ignore = "needs root"]
fn nft_backend_loads_clusterips_from_two_unrelated_ranges() {
    two_service_ranges(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_loads_clusterips_from_two_unrelated_ranges() {
    two_service_ranges(Backend::Legacy);
}

/// A rule the planner's validator refuses never reaches iptables-restore. Of one Service (an
/// IPv4-compatible IPv6 `loadBalancerSourceRanges` entry, `::102:300/120`, which kp-core accepts
/// as any CIDR but iptables-save prints `::1.2.3.0/120`, so it would never read back as planned):
/// that Service is left out of the IPv6 tables, logged and counted, and everything else syncs.
/// Of a shared chain (a `nodePortAddresses` CIDR of that form, in nat `KUBE-SERVICES`' NodePort
/// jump): the sync fails with a plan error before sending anything for IPv6, whose rules stay as
/// they were, and a good configuration syncs again.
fn validation_failures(backend: Backend) {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipt-valid").expect("netns");
    let metrics = Arc::new(Metrics::new());
    let mut dp = dataplane(&ns, backend, metrics.clone());
    let odd: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "odd", "namespace": "default"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.200",
            "clusterIPs": ["10.96.0.200", "fd00:10:96::200"], "ipFamilies": ["IPv4", "IPv6"],
            "ipFamilyPolicy": "RequireDualStack",
            "loadBalancerSourceRanges": ["192.0.2.0/24", "::102:300/120"],
            "ports": [{"protocol": "TCP", "port": 80, "nodePort": 30200}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.200"},
            {"ip": "2001:db8:b::200"}]}},
    }))
    .unwrap();
    let odd_endpoints: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "odd-v6", "namespace": "default",
            "labels": {"kubernetes.io/service-name": "odd"}},
        "addressType": "IPv6",
        "ports": [{"name": "", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": ["fd00:10:244:1::11"], "conditions": {"ready": true},
            "nodeName": kp_flows::NODE}],
    }))
    .unwrap();
    let mut objects = kp_flows::objects();
    objects.push(Object::Service(Box::new(odd)));
    objects.push(Object::EndpointSlice(Box::new(odd_endpoints)));
    let state = kp_flows::load(kp_flows::NODE, objects);
    dp.sync(&state, &Changes::default(), true)
        .unwrap_or_else(|e| panic!("{backend}: one invalid Service must not fail the sync: {e}"));
    assert_in_sync(&mut dp, "with a Service left out");
    let counted = metrics.encode();
    assert!(
        counted.contains("kubeproxy_rs_invalid_objects_total{kind=\"Service\"} 1"),
        "{counted}"
    );
    let cmd = command(&ns);
    let (_, v4_rules) = dump(&cmd, backend, IpFamily::V4);
    assert!(v4_rules.iter().any(|r| r.contains("-d 10.96.0.200/32")));
    let (_, v6_rules) = dump(&cmd, backend, IpFamily::V6);
    assert!(v6_rules.iter().all(|r| !r.contains("fd00:10:96::200")));
    assert!(v6_rules.iter().any(|r| r.contains("-d fd00:10:96::10/128")));

    // The same rules, planned by a process whose nodePortAddresses the validator refuses.
    let odd_config = IptablesConfig {
        node_ports: NodePortAddresses::Cidrs(vec![
            "192.0.2.1/32".parse().unwrap(),
            "::102:300/120".parse().unwrap(),
        ]),
        ..config(backend)
    };
    let mut odd_dp = IptablesDataplane::new(odd_config, command(&ns), metrics.clone());
    let err = odd_dp.sync(&state, &Changes::default(), true).unwrap_err();
    match &err {
        kp_iptables::Error::Plan(e) => match e.as_ref() {
            kp_iptables_plan::PlanError::Shared { chain, .. } => {
                assert_eq!(chain, "KUBE-SERVICES", "{err}")
            }
            other => panic!("expected a shared chain's error, got {other}"),
        },
        other => panic!("expected a plan error, got {other}"),
    }
    assert_eq!(
        dump(&cmd, backend, IpFamily::V6).1,
        v6_rules,
        "IPv6 rules touched"
    );
    assert_eq!(
        metrics.iptables_restore_failures.get(),
        0,
        "nothing was refused"
    );

    dp.sync(&state, &Changes::default(), true)
        .expect("a good configuration syncs");
    assert_in_sync(&mut dp, "after the good configuration synced");
    assert_eq!(dump(&cmd, backend, IpFamily::V6).1, v6_rules);
}

#[test]
#[ignore = "needs root"]
fn nft_backend_leaves_out_services_with_invalid_rules_and_sends_nothing_for_invalid_shared_rules() {
    validation_failures(Backend::Nft);
}

#[test]
#[ignore = "needs root"]
fn legacy_backend_leaves_out_services_with_invalid_rules_and_sends_nothing_for_invalid_shared_rules(
) {
    validation_failures(Backend::Legacy);
}
