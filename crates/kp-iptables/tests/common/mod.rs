//! Helpers shared by the kernel tests of this crate.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::collections::BTreeSet;

use kp_core::model::IpFamily;
use kp_iptables::{
    Backend, DetectLocal, IptablesCommand, IptablesConfig, IptablesDataplane, NodePortAddresses,
};
use kp_test::netns::Netns;

/// Asserts that the kernel holds what the dataplane planned (`what` names the moment; a
/// failure points at the caller).
#[track_caller]
pub fn assert_in_sync(dp: &mut IptablesDataplane, what: &str) {
    let diffs = dp.verify().expect("read-back works");
    assert!(
        diffs.is_empty(),
        "{what}: kernel differs from the plan ({} differences):\n{}",
        diffs.len(),
        diffs
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Every chain the restore inputs write or delete.
pub fn chains_named(inputs: &[String]) -> BTreeSet<String> {
    inputs
        .iter()
        .flat_map(|i| i.lines())
        .filter_map(|l| {
            l.strip_prefix(':')
                .or_else(|| l.strip_prefix("-A "))
                .or_else(|| l.strip_prefix("-X "))
        })
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Drift made by hand: deletes the first rule of nat `chain` in `ns` with `backend`'s tool.
pub fn delete_first_nat_rule(ns: &Netns, backend: Backend, chain: &str) {
    ns.run(&[
        &backend.program(IpFamily::V4, ""),
        "-w",
        "120",
        "-t",
        "nat",
        "-D",
        chain,
        "1",
    ])
    .expect("delete the rule");
}

/// The flow table's configuration on `backend`: detect-local by the cluster CIDRs of both
/// families, NodePorts on the node's primary addresses.
pub fn config(backend: Backend) -> IptablesConfig {
    IptablesConfig {
        detect_local: DetectLocal::ClusterCidr(vec![
            kp_flows::CLUSTER_CIDR.parse().unwrap(),
            kp_flows::CLUSTER_CIDR6.parse().unwrap(),
        ]),
        node_ports: NodePortAddresses::Primary,
        backend,
        ..IptablesConfig::default()
    }
}

/// The tools in `ns`. The legacy backend's lock is one file for every namespace on the
/// machine, so tests running in parallel wait for each other longer than the default 5 s.
pub fn command(ns: &Netns) -> IptablesCommand {
    IptablesCommand::in_netns(ns.name()).with_wait_seconds(120)
}
