//! Helpers shared by the kernel tests of this crate.

use std::collections::BTreeSet;

use kp_core::dataplane::Dataplane;
use kp_core::model::IpFamily;
use kp_iptables::{Backend, IptablesDataplane};
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
