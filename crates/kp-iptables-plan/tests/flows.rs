//! The packet-flow table, through the tracer, over the rules the planner renders.

use std::collections::BTreeSet;

use kp_core::flow::Tracer;
use kp_core::model::IpFamily;
use kp_core::track::{ProxyState, SourceEvent};
use kp_iptables_plan::{NodeContext, PlanConfig, Planner, Restore, Table};
use kp_iptables_test::IptablesTracer;

mod common;

fn state() -> ProxyState {
    kp_flows::state()
}

fn planners() -> Vec<Planner> {
    IpFamily::ALL
        .into_iter()
        .map(|f| Planner::new(PlanConfig::new(f)))
        .collect()
}

fn node() -> NodeContext {
    kp_flows::node_context()
}

fn apply(tracer: &mut IptablesTracer, family: IpFamily, text: &str) {
    tracer
        .apply(family, text)
        .unwrap_or_else(|e| panic!("{family:?}: {e}\n{text}"));
}

fn full_tracer(edit: impl Fn(&str) -> String) -> IptablesTracer {
    let state = state();
    let mut tracer = IptablesTracer::new(kp_flows::node_addresses());
    for mut p in planners() {
        let family = p.config().family;
        let restore = p.full(&state, &node());
        apply(&mut tracer, family, &edit(&restore.text()));
        apply(&mut tracer, family, &common::jumps(&p));
    }
    tracer
}

fn assert_rows_pass(tracer: &IptablesTracer) {
    let failures = kp_flows::check_tracer(tracer);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_flow_row_passes_through_the_rendered_tables() {
    let tracer = full_tracer(str::to_string);
    assert_rows_pass(&tracer);
    // Every row's verdict is consistent over its random branches, not just the merged one.
    for case in kp_flows::cases() {
        tracer
            .trace_all(&case.packet)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    }
}

#[test]
fn rows_still_pass_when_the_tables_were_built_by_partial_syncs_in_steps() {
    // Start from an empty cluster, then add every object through partial syncs, each sent in
    // small steps as the applier would.
    let mut grown = ProxyState::new(kp_flows::NODE);
    let mut tracer = IptablesTracer::new(kp_flows::node_addresses());
    let mut ps = planners();
    for p in &mut ps {
        let family = p.config().family;
        apply(&mut tracer, family, &p.full(&grown, &node()).text());
        apply(&mut tracer, family, &common::jumps(p));
    }
    let mut steps = 0;
    for o in kp_flows::objects() {
        grown.apply(SourceEvent::Upsert(o)).unwrap();
        let changes = grown.take_changes();
        for p in &mut ps {
            let family = p.config().family;
            let restore: Restore =
                p.partial(&grown, &changes.services, &node(), changes.node_changed);
            for step in restore.steps(3) {
                apply(&mut tracer, family, &step);
                steps += 1;
            }
        }
    }
    assert!(steps > kp_flows::objects().len(), "only {steps} steps");
    assert_rows_pass(&tracer);
    // The tracer's tables hold exactly what the planners say they wrote.
    for p in &ps {
        let family = p.config().family;
        for ((table, chain), rules) in p.expected(&grown) {
            assert_eq!(
                tracer.chain(family, table, &chain),
                Some(rules.as_slice()),
                "{family:?} {table:?} {chain}"
            );
        }
        for table in Table::ALL {
            let owned = p
                .expected(&grown)
                .keys()
                .filter(|(t, _)| *t == table)
                .count();
            let builtin = match table {
                Table::Filter => 3,
                Table::Nat => 4,
            };
            assert_eq!(
                tracer.chain_names(family, table).len(),
                owned + builtin,
                "{family:?} {table:?}: {:?}",
                tracer.chain_names(family, table)
            );
        }
    }
}

/// The rows `tracer` gets wrong.
fn failing(tracer: &IptablesTracer) -> BTreeSet<&'static str> {
    kp_flows::cases()
        .into_iter()
        .filter(|c| tracer.trace(&c.packet) != kp_flows::expected_verdict(c))
        .map(|c| c.name)
        .collect()
}

/// Drops every line containing `needle` from a restore input.
fn without(needle: &'static str) -> impl Fn(&str) -> String {
    move |text| {
        text.lines()
            .filter(|l| !l.contains(needle))
            .map(|l| format!("{l}\n"))
            .collect()
    }
}

/// The tracer is itself tested: break the rules and exactly the rows that depend on what was
/// removed must start failing (rows already failing on the intact rules are left out).
fn assert_breaks(needle: &'static str, rows: impl Fn(&kp_flows::Expect) -> bool) {
    let before = failing(&full_tracer(str::to_string));
    let after = failing(&full_tracer(without(needle)));
    let newly: BTreeSet<&str> = after.difference(&before).copied().collect();
    let want: BTreeSet<&str> = kp_flows::cases()
        .into_iter()
        .filter(|c| rows(&c.expect))
        .map(|c| c.name)
        .filter(|n| !before.contains(n))
        .collect();
    assert!(!want.is_empty(), "{needle}: no row depends on it");
    assert_eq!(newly, want, "{needle}");
}

#[test]
fn the_table_catches_a_ruleset_without_masquerading() {
    assert_breaks("-j MASQUERADE", |e| {
        matches!(
            e,
            kp_flows::Expect::Pods {
                masquerade: true,
                ..
            }
        )
    });
    assert_breaks("-j KUBE-MARK-MASQ", |e| {
        matches!(
            e,
            kp_flows::Expect::Pods {
                masquerade: true,
                ..
            }
        )
    });
}

#[test]
fn the_table_catches_a_ruleset_without_rejects_or_drops() {
    assert_breaks("-j REJECT", |e| *e == kp_flows::Expect::Reject);
    assert_breaks("-j DROP", |e| *e == kp_flows::Expect::Drop);
}

/// Detect-local by interface (`InterfaceNamePrefix` veth, `BridgeInterface` cbr0), each over
/// the links it is run with: every row passes as with the cluster CIDRs, since the table's
/// pods arrive on the pods' interfaces and its other clients do not. With a prefix no pod
/// interface has, the rows from pods to a ClusterIP are masqueraded instead, and fail: the
/// match decides.
#[test]
fn every_flow_row_passes_with_detect_local_by_interface() {
    let state = state();
    let traced = |detect: &kp_core::node::DetectLocal, links: kp_core::flow::Ingress| {
        let node = kp_flows::node_context_with(detect);
        assert!(node.local_cidrs.is_empty());
        let mut tracer = IptablesTracer::new(kp_flows::node_addresses()).with_ingress(links);
        for mut p in planners() {
            let family = p.config().family;
            let restore = p.full(&state, &node);
            assert!(restore.text().contains(" -i "), "{detect:?}");
            apply(&mut tracer, family, &restore.text());
            apply(&mut tracer, family, &common::jumps(&p));
        }
        tracer
    };
    kp_flows::check_detect_local_by_interface(traced);
}
