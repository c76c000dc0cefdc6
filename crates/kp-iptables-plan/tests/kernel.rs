//! The rendered rules are canonical: the kernel accepts every restore input, and
//! `iptables-save` prints back exactly [`Planner::expected`], rule for rule, with the nft and
//! the legacy backends, for IPv4 and IPv6. This is what lets the applier verify the tables by
//! comparing strings.
//!
//! Root only: each test works in its own network namespace (`kp_test::netns::Netns`, deleted on
//! drop) and skips loudly without root.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;

use kp_core::model::IpFamily;
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_iptables_plan::{names, NodeContext, PlanConfig, Planner, Restore, Table};
use kp_test::netns::{require_root, Netns};

type Tables = BTreeMap<(Table, String), Vec<String>>;

const BACKENDS: [&str; 2] = ["nft", "legacy"];

fn tool(family: IpFamily, backend: &str, what: &str) -> String {
    let base = match family {
        IpFamily::V4 => "iptables",
        IpFamily::V6 => "ip6tables",
    };
    format!("{base}-{backend}-{what}")
}

/// Feeds one input to `iptables-restore --noflush` inside `ns`.
fn restore(ns: &Netns, family: IpFamily, backend: &str, input: &str) {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(input.as_bytes())
        .expect("write restore input");
    let path = file.path().to_str().expect("utf-8 temp path").to_string();
    let bin = tool(family, backend, "restore");
    if let Err(e) = ns.run(&[&bin, "-w", "--noflush", &path]) {
        panic!("{bin} refused the input: {e}\n--- input ---\n{input}");
    }
}

/// Every chain of the filter and nat tables as `iptables-save` prints it.
fn save(ns: &Netns, family: IpFamily, backend: &str) -> Tables {
    let bin = tool(family, backend, "save");
    let text = ns
        .run(&[&bin])
        .unwrap_or_else(|e| panic!("{bin} failed: {e}"));
    let mut out = Tables::new();
    let mut table = None;
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = match t {
                "filter" => Some(Table::Filter),
                "nat" => Some(Table::Nat),
                _ => None,
            };
        } else if let (Some(t), Some(chain)) = (table, line.strip_prefix(':')) {
            let name = chain.split(' ').next().unwrap_or_default();
            out.entry((t, name.to_string())).or_default();
        } else if let (Some(t), Some(rule)) = (table, line.strip_prefix("-A ")) {
            let (chain, args) = rule.split_once(' ').unwrap_or((rule, ""));
            out.entry((t, chain.to_string()))
                .or_default()
                .push(args.to_string());
        }
    }
    out
}

const BUILT_IN: [&str; 5] = ["INPUT", "FORWARD", "OUTPUT", "PREROUTING", "POSTROUTING"];

/// The saved tables equal what the planner expects: our chains rule for rule, no other chains
/// but the built-in ones, and the built-in chains holding exactly the jump rules.
fn assert_read_back(
    ns: &Netns,
    family: IpFamily,
    backend: &str,
    planner: &Planner,
    state: &ProxyState,
    what: &str,
) {
    let saved = save(ns, family, backend);
    let expected = planner.expected(state);
    for (key, rules) in &expected {
        match saved.get(key) {
            Some(got) if got == rules => {}
            Some(got) => {
                let diff: Vec<String> = rules
                    .iter()
                    .zip(got.iter())
                    .filter(|(a, b)| a != b)
                    .map(|(a, b)| format!("  planned {a}\n  saved   {b}"))
                    .collect();
                panic!(
                    "{what} ({backend}, {family:?}): {key:?} differs ({} planned, {} saved):\n{}",
                    rules.len(),
                    got.len(),
                    diff.join("\n")
                );
            }
            None => panic!("{what} ({backend}, {family:?}): {key:?} missing from iptables-save"),
        }
    }
    let mut jumps: BTreeMap<(Table, String), BTreeSet<String>> = BTreeMap::new();
    for j in planner.jump_rules() {
        let table = if j.table == "nat" {
            Table::Nat
        } else {
            Table::Filter
        };
        jumps
            .entry((table, j.chain.to_string()))
            .or_default()
            .insert(j.args);
    }
    for (key, rules) in &saved {
        if BUILT_IN.contains(&key.1.as_str()) {
            let got: BTreeSet<String> = rules.iter().cloned().collect();
            assert_eq!(
                got,
                jumps.get(key).cloned().unwrap_or_default(),
                "{what} ({backend}, {family:?}): jump rules in {key:?}"
            );
            assert_eq!(got.len(), rules.len(), "duplicate jump rules in {key:?}");
        } else {
            assert!(
                expected.contains_key(key),
                "{what} ({backend}, {family:?}): stale chain {key:?} left in the kernel"
            );
        }
    }
}

/// The jump rules as one restore input, each inserted at the top as upstream does.
fn jump_input(planner: &Planner) -> String {
    let mut out = String::new();
    for table in ["filter", "nat"] {
        out.push_str(&format!("*{table}\n"));
        for j in planner.jump_rules().iter().filter(|j| j.table == table) {
            out.push_str(&format!("-I {} 1 {}\n", j.chain, j.args));
        }
        out.push_str("COMMIT\n");
    }
    out
}

fn apply(ns: &Netns, family: IpFamily, backend: &str, r: &Restore, max_chains: usize) {
    for step in r.steps(max_chains) {
        restore(ns, family, backend, &step);
    }
}

fn upsert(state: &mut ProxyState, o: Object) -> BTreeSet<kp_core::model::ServiceKey> {
    state.apply(SourceEvent::Upsert(o)).expect("valid object");
    state.take_changes().services
}

#[test]
fn the_fixture_reads_back_exactly_as_planned_full_and_partial() {
    if !require_root() {
        return;
    }
    for backend in BACKENDS {
        for family in IpFamily::ALL {
            let ns = Netns::new("ipt-plan").expect("namespace");
            let node = kp_flows::node_context();
            let mut state = kp_flows::state();
            let mut planner = Planner::new(PlanConfig::new(family));
            let full = planner.full(&state, &node);
            restore(&ns, family, backend, &full.text());
            restore(&ns, family, backend, &jump_input(&planner));
            assert_read_back(&ns, family, backend, &planner, &state, "full");

            // An endpoint goes, a Service goes: partial restores, cut into small steps.
            let mut changed = upsert(
                &mut state,
                Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2"]))),
            );
            state
                .apply(SourceEvent::Delete(
                    Kind::Service,
                    ObjectKey {
                        namespace: "default".into(),
                        name: "sticky".into(),
                    },
                ))
                .expect("delete");
            changed.extend(state.take_changes().services);
            let r = planner.partial(&state, &changed, &node, false);
            assert!(!r.deleted_chains.is_empty() || family == IpFamily::V6);
            apply(&ns, family, backend, &r, 2);
            assert_read_back(&ns, family, backend, &planner, &state, "partial");

            // The last endpoint goes: the Service moves to filter REJECTs.
            let changed = upsert(
                &mut state,
                Object::EndpointSlice(Box::new(kp_flows::web_slice(&[]))),
            );
            let r = planner.partial(&state, &changed, &node, false);
            apply(&ns, family, backend, &r, 1000);
            assert_read_back(&ns, family, backend, &planner, &state, "no endpoints");

            // A failed restore, then a full plan over what the kernel still holds.
            let changed = upsert(
                &mut state,
                Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-3"]))),
            );
            let _lost = planner.partial(&state, &changed, &node, false);
            planner.invalidate();
            let r = planner.full(&state, &node);
            apply(&ns, family, backend, &r, 1000);
            assert_read_back(
                &ns,
                family,
                backend,
                &planner,
                &state,
                "full after a failure",
            );
        }
    }
}

#[test]
fn every_option_reads_back_exactly_as_planned() {
    if !require_root() {
        return;
    }
    // 120 synthetic Services: above 1000 endpoints (no per-endpoint comments), LoadBalancers
    // with source ranges, affinity, UDP; plus the fixture's policies.
    let mut objects = kp_flows::objects();
    objects.extend(kp_flows::synthetic::cluster(120, 10));
    let state = kp_flows::load(kp_flows::NODE, objects);
    let mut node = kp_flows::node_context();
    node.node_port_addresses = vec![
        "192.0.2.0/24".parse().unwrap(),
        "127.0.0.1/32".parse().unwrap(),
        "2001:db8::/64".parse().unwrap(),
    ];
    for backend in BACKENDS {
        for family in IpFamily::ALL {
            let ns = Netns::new("ipt-opts").expect("namespace");
            let mut cfg = PlanConfig::new(family);
            cfg.masquerade_all = true;
            cfg.localhost_node_ports = true;
            cfg.masquerade_bit = 5;
            let mut planner = Planner::new(cfg);
            let r = planner.full(&state, &node);
            if family == IpFamily::V4 {
                assert!(r.text().contains(":KUBE-FIREWALL - [0:0]"));
                assert!(!r.text().contains("-> 10.128."), "large-cluster mode");
            }
            apply(&ns, family, backend, &r, 100);
            restore(&ns, family, backend, &jump_input(&planner));
            assert_read_back(&ns, family, backend, &planner, &state, "options");
            let svc = planner
                .expected(&state)
                .keys()
                .filter(|(_, c)| names::is_service_chain(c))
                .count();
            // Enough chains for the restore to come in several steps of 100.
            assert!(family == IpFamily::V6 || svc > 200, "{svc} service chains");
        }
    }
}

#[test]
fn detect_local_off_and_all_local_nodeports_read_back_exactly() {
    if !require_root() {
        return;
    }
    let state = kp_flows::state();
    for family in IpFamily::ALL {
        let ns = Netns::new("ipt-plain").expect("namespace");
        let mut planner = Planner::new(PlanConfig::new(family));
        let r = planner.full(&state, &NodeContext::default());
        apply(&ns, family, "nft", &r, 1000);
        restore(&ns, family, "nft", &jump_input(&planner));
        assert_read_back(&ns, family, "nft", &planner, &state, "defaults");
    }
}
