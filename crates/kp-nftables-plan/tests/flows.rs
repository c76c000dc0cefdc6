//! The packet-flow table, through the tracer, over the rules the planner renders.

use kp_core::model::IpFamily;
use kp_core::track::{ProxyState, SourceEvent};
use kp_nftables_plan::{NodeContext, PlanConfig, Planner};
use kp_nftables_test::NftTracer;

fn state() -> ProxyState {
    kp_flows::state()
}

fn planners() -> Vec<Planner> {
    IpFamily::ALL
        .into_iter()
        .map(|f| {
            let mut cfg = PlanConfig::new(f);
            cfg.detect_local = true;
            // nftables mode's default, nodePortAddresses: primary.
            cfg.node_ports_restricted = true;
            Planner::new(cfg)
        })
        .collect()
}

fn node() -> NodeContext {
    kp_flows::node_context()
}

#[test]
fn every_flow_row_passes_through_the_rendered_table() {
    let state = state();
    let mut tracer = NftTracer::new(kp_flows::node_addresses());
    for mut p in planners() {
        let tx = p.full(&state, &node());
        tracer
            .apply(&tx.text)
            .unwrap_or_else(|e| panic!("{e}\n{}", tx.text));
    }
    let failures = kp_flows::check_tracer(&tracer);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn rows_still_pass_when_the_table_was_built_by_partial_syncs() {
    // Start from an empty cluster, then add every Service through partial syncs.
    let full = state();
    let mut empty = ProxyState::new(kp_flows::NODE);
    let mut tracer = NftTracer::new(kp_flows::node_addresses());
    let mut ps = planners();
    for p in &mut ps {
        tracer.apply(&p.full(&empty, &node()).text).unwrap();
    }
    for o in kp_flows::objects() {
        empty.apply(SourceEvent::Upsert(o)).unwrap();
        let changes = empty.take_changes();
        for p in &mut ps {
            let tx = p.partial(&empty, &changes.services, &node(), changes.node_changed);
            tracer
                .apply(&tx.text)
                .unwrap_or_else(|e| panic!("{e}\n{}", tx.text));
        }
    }
    let failures = kp_flows::check_tracer(&tracer);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // And the partially-built table holds exactly what a full build holds.
    for (p, mut fresh) in ps.iter().zip(planners()) {
        fresh.full(&full, &node());
        for set in fresh.all_sets() {
            assert_eq!(
                p.expected_elements(set),
                fresh.expected_elements(set),
                "{set:?}"
            );
        }
    }
}

#[test]
fn the_table_catches_a_ruleset_without_masquerading() {
    // The tracer is itself tested: drop the masquerade rules and the masquerade rows must fail.
    let state = state();
    let mut tracer = NftTracer::new(kp_flows::node_addresses());
    for mut p in planners() {
        let tx = p.full(&state, &node());
        let broken: String = tx
            .text
            .lines()
            .filter(|l| !l.contains("masquerade fully-random"))
            .map(|l| format!("{l}\n"))
            .collect();
        tracer.apply(&broken).unwrap();
    }
    let failures = kp_flows::check_tracer(&tracer);
    let masq_rows = kp_flows::cases()
        .iter()
        .filter(|c| {
            matches!(
                c.expect,
                kp_flows::Expect::Pods {
                    masquerade: true,
                    ..
                }
            )
        })
        .count();
    assert_eq!(failures.len(), masq_rows, "{}", failures.join("\n"));
}

/// Detect-local by interface (`InterfaceNamePrefix` veth, `BridgeInterface` cbr0), each over
/// the links it is run with: every row passes as with the cluster CIDRs. With a prefix no pod
/// interface has, only rows from pods change (their ClusterIP traffic is masqueraded): the
/// `iifname` match decides.
#[test]
fn every_flow_row_passes_with_detect_local_by_interface() {
    let state = state();
    let traced = |detect: &kp_core::node::DetectLocal, links: kp_core::flow::Ingress| {
        let node = kp_flows::node_context_with(detect);
        let mut tracer = NftTracer::new(kp_flows::node_addresses()).with_ingress(links);
        for f in IpFamily::ALL {
            let mut cfg = PlanConfig::new(f);
            cfg.detect_local = true;
            cfg.local_interface = detect.interface();
            cfg.node_ports_restricted = true;
            let tx = Planner::new(cfg).full(&state, &node);
            assert!(tx.text.contains("iifname"), "{detect:?}");
            tracer
                .apply(&tx.text)
                .unwrap_or_else(|e| panic!("{e}\n{}", tx.text));
        }
        tracer
    };
    kp_flows::check_detect_local_by_interface(traced);
}
