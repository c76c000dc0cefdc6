//! The nftables dataplane against a real kernel, inside a lab of network namespaces.

use std::sync::Arc;

use kp_core::track::{Changes, Object, SourceEvent};
use kp_metrics::Metrics;
use kp_nftables::{NftCommand, NftablesConfig, NftablesDataplane};
use kp_test::echo::{tally, Proto, Request};
use kp_test::lab::Lab;

mod common;
use common::{assert_in_sync, dataplane};

#[test]
#[ignore = "needs root"]
fn the_flow_table_passes_with_real_packets_and_the_kernel_matches_the_plan_after_every_sync() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let mut dp = dataplane(&lab);
    let mut state = kp_flows::state();

    let report = dp
        .sync(&state, &Changes::default(), true)
        .expect("first sync");
    assert!(report.full);
    assert_in_sync(&mut dp);
    let failures = kp_test::flows::check_all(&lab);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The real-packet checker can fail: the first row, expecting a drop, must not pass.
    let mut wrong = kp_flows::cases()[0].clone();
    wrong.expect = kp_flows::Expect::Drop;
    assert!(kp_test::flows::check(&lab, &wrong).is_err());

    // A live endpoint change is a small partial transaction, and traffic follows it.
    let slice = kp_flows::web_slice(&["pod-1", "pod-2"]);
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .unwrap();
    let changes = state.take_changes();
    let report = dp.sync(&state, &changes, false).expect("partial sync");
    assert!(!report.full);
    assert!(
        report.operations <= 20,
        "{} operations:\n{}",
        report.operations,
        dp.last_transaction()
    );
    assert_in_sync(&mut dp);
    let web = "10.96.0.10".parse().unwrap();
    let seen = tally(&lab.send(lab.pod(4), &Request::new(Proto::Tcp, web, 80).count(30)));
    assert_eq!(
        seen.keys().cloned().collect::<Vec<_>>(),
        ["pod-1", "pod-2"],
        "{seen:?}"
    );

    // A periodic full sync with nothing changed behind our back rewrites nothing.
    let report = dp
        .sync(&state, &Changes::default(), true)
        .expect("verified sync");
    assert!(!report.full, "no drift, so no rebuild");
    assert_eq!(report.operations, 0);

    // Drift is found and repaired by the next full sync.
    lab.node()
        .run(&[
            "nft",
            "delete",
            "element",
            "ip",
            "kube-proxy",
            "cluster-ips",
            "{ 10.96.0.10 }",
        ])
        .unwrap();
    assert!(
        !dp.verify().unwrap().is_empty(),
        "read-back must notice the missing element"
    );
    let report = dp.sync(&state, &Changes::default(), true).expect("repair");
    assert!(report.full);
    assert_in_sync(&mut dp);
    // An element nobody planned is noticed as well.
    lab.node()
        .run(&[
            "nft",
            "add",
            "element",
            "ip",
            "kube-proxy",
            "cluster-ips",
            "{ 10.96.99.99 }",
        ])
        .unwrap();
    let diffs = dp.verify().unwrap();
    assert!(
        diffs
            .iter()
            .any(|d| d.contains("cluster-ips") && d.contains("1 extra")),
        "{diffs:?}"
    );
    dp.sync(&state, &Changes::default(), true).expect("repair");
    assert_in_sync(&mut dp);

    // Someone flushes the whole ruleset: repaired too, and traffic flows again.
    lab.node().run(&["nft", "flush", "ruleset"]).unwrap();
    dp.sync(&state, &Changes::default(), true).expect("rebuild");
    assert_in_sync(&mut dp);
    let seen = tally(&lab.send(lab.pod(4), &Request::new(Proto::Tcp, web, 80).count(20)));
    assert_eq!(
        seen.keys().cloned().collect::<Vec<_>>(),
        ["pod-1", "pod-2"],
        "{seen:?}"
    );
}

/// Detect-local by interface with real packets: `InterfaceNamePrefix` `veth` (the lab's pods
/// sit behind `vethI`) passes every row as the cluster CIDRs do, and the kernel reads back as
/// planned. With a prefix no pod interface has, a pod's ClusterIP connection is masqueraded:
/// the kernel's `iifname` match decides.
#[test]
#[ignore = "needs root"]
fn the_flow_table_passes_with_real_packets_and_detect_local_by_interface_prefix() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let by_prefix = |prefix: &str| {
        let cfg = NftablesConfig {
            detect_local: kp_nftables::DetectLocal::InterfaceNamePrefix(
                kp_core::node::InterfaceName::new(prefix).unwrap(),
            ),
            ..NftablesConfig::default()
        };
        let mut dp = NftablesDataplane::new(
            cfg,
            NftCommand::in_netns(lab.node().name()),
            Arc::new(Metrics::new()),
        );
        dp.sync(&kp_flows::state(), &Changes::default(), true)
            .expect("first sync");
        assert_in_sync(&mut dp);
        dp
    };
    let veth = by_prefix(kp_flows::POD_VETH_PREFIX);
    assert!(veth.last_transaction().contains("iifname != \"veth*\""));
    let failures = kp_test::flows::check_all(&lab);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    drop(veth);
    let _elsewhere = by_prefix("cali");
    let pod_to_cluster_ip = kp_flows::cases()
        .into_iter()
        .find(|c| c.from == "pod-4" && c.packet.dst.to_string() == "10.96.0.10")
        .expect("the row from pod-4 to the web ClusterIP");
    assert!(kp_test::flows::check(&lab, &pod_to_cluster_ip).is_err());
    let mut masqueraded = pod_to_cluster_ip.clone();
    if let kp_flows::Expect::Pods { masquerade, .. } = &mut masqueraded.expect {
        *masquerade = true;
    }
    kp_test::flows::check(&lab, &masqueraded).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
#[ignore = "needs root"]
fn cleanup_removes_both_tables() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = Lab::new(1).expect("lab");
    let mut dp = dataplane(&lab);
    dp.sync(&kp_flows::state(), &Changes::default(), true)
        .expect("sync");
    dp.cleanup().expect("cleanup");
    let tables = lab.node().run(&["nft", "list", "tables"]).unwrap();
    assert!(!tables.contains("kube-proxy"), "{tables}");
    // Cleaning up twice is fine.
    dp.cleanup().expect("second cleanup");
}

#[test]
#[ignore = "needs root"]
fn one_endpoint_change_among_5000_services_reaches_the_kernel_as_two_element_operations() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = kp_test::netns::Netns::new("scale").expect("netns");
    let mut dp = NftablesDataplane::new(
        NftablesConfig::default(),
        NftCommand::in_netns(ns.name()),
        Arc::new(Metrics::new()),
    );
    let mut state = kp_flows::load("node-0", kp_flows::synthetic::cluster(5000, 10));
    dp.sync(&state, &Changes::default(), true)
        .expect("full sync");

    // Service 4324 is a plain ClusterIP; replace its endpoint 3.
    let mut slice = kp_flows::synthetic::slice(4324, 10, &[]);
    if let Some(eps) = slice.endpoints.as_mut() {
        eps[3].addresses = vec!["10.200.0.1".into()];
    }
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .unwrap();
    let changes = state.take_changes();
    let report = dp.sync(&state, &changes, false).expect("partial sync");
    assert!(!report.full);
    assert_eq!(report.operations, 2, "{}", dp.last_transaction());
    // No structure changed, so no nft at all: the two element changes went in one netlink batch.
    assert_eq!(
        dp.last_transaction(),
        "# netlink: 2 element changes in 2 messages\n"
    );
    assert_in_sync(&mut dp);
}
