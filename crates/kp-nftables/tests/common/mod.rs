//! What the kernel test files share: the dataplane as the flow table runs it, and the checks
//! that the kernel equals the plan.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::sync::Arc;

use kp_metrics::Metrics;
use kp_nftables::{DetectLocal, NftCommand, NftablesConfig, NftablesDataplane};
use kp_test::lab::Lab;

/// A dataplane programming `lab`'s node with the fixture's settings (detect-local by the
/// cluster CIDRs of both families).
pub fn dataplane(lab: &Lab) -> NftablesDataplane {
    let cfg = NftablesConfig {
        detect_local: DetectLocal::ClusterCidr(vec![
            kp_flows::CLUSTER_CIDR.parse().unwrap(),
            kp_flows::CLUSTER_CIDR6.parse().unwrap(),
        ]),
        ..NftablesConfig::default()
    };
    NftablesDataplane::new(
        cfg,
        NftCommand::in_netns(lab.node().name()),
        Arc::new(Metrics::new()),
    )
}

/// Fails unless the kernel's tables equal the dataplane's plan.
pub fn assert_in_sync(dp: &mut NftablesDataplane) {
    let diffs = dp.verify().expect("read-back works");
    assert!(
        diffs.is_empty(),
        "kernel differs from the plan:\n{}",
        diffs.join("\n")
    );
}
