//! The rendered rules are canonical: the kernel accepts every restore input, and
//! `iptables-save` prints back exactly [`Planner::expected`], rule for rule, with the nft and
//! the legacy backends, for IPv4 and IPv6. This is what lets the applier verify the tables by
//! comparing strings.
//!
//! Two more proofs hold the validator ([`kp_iptables_plan::validate`]) to the real tools: its
//! documented findings (what each backend refuses, or prints back differently) are checked
//! against both, and every restore input of a broad set of generated plans (the flow fixture
//! plus random clusters: dual-stack, two unrelated Service ranges per family, affinity, source
//! ranges, external and LoadBalancer IPs, NodePorts, Local policies, every node setting) loads
//! on both and reads back as planned.
//!
//! Root only: each test works in its own network namespace (`kp_test::netns::Netns`, deleted on
//! drop) and skips loudly without root.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;

use kp_core::model::IpFamily;
use kp_core::track::{Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_iptables_plan::validate::{self, Problem};
use kp_iptables_plan::{names, NodeContext, PlanConfig, Planner, Restore, Table};
use kp_test::netns::{require_root, Netns};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

mod common;

type Tables = BTreeMap<(Table, String), Vec<String>>;

const BACKENDS: [&str; 2] = ["nft", "legacy"];

fn tool(family: IpFamily, backend: &str, what: &str) -> String {
    let base = match family {
        IpFamily::V4 => "iptables",
        IpFamily::V6 => "ip6tables",
    };
    format!("{base}-{backend}-{what}")
}

/// Feeds one input to `iptables-restore --noflush` inside `ns`; the tool's complaint if it
/// refuses it.
fn try_restore(ns: &Netns, family: IpFamily, backend: &str, input: &str) -> Result<(), String> {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(input.as_bytes())
        .expect("write restore input");
    let path = file.path().to_str().expect("utf-8 temp path").to_string();
    let bin = tool(family, backend, "restore");
    ns.run(&[&bin, "-w", "--noflush", &path])
        .map(|_| ())
        .map_err(|e| e.to_string())
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

/// What the validator's docs say about one rule (`None`: it passes), checked on both backends.
type Finding = (IpFamily, Table, String, Option<Problem>);

fn findings() -> Vec<Finding> {
    use IpFamily::{V4, V6};
    use Problem::*;
    use Table::{Filter, Nat};
    let m4 = "--mask 255.255.255.255 --rsource -j RETURN";
    let m6 = "--mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -j RETURN";
    let set = |name: &str| format!("-m recent --set --name {name} {m4}");
    let rcheck =
        |t: &str| format!("-m recent --rcheck --seconds {t} --reap --name KUBE-SEP-X {m4}");
    let p = |v: &str| format!("-m statistic --mode random --probability {v} -j RETURN");
    let comments = |n: usize, len: usize| {
        let c = "a".repeat(len);
        let mut r: String = (0..n)
            .map(|_| format!("-m comment --comment {c} "))
            .collect();
        r.push_str("-j RETURN");
        r
    };
    let s = |v: &str| v.to_string();
    vec![
        (V4, Filter, s("! -d 0.0.0.0/0 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN"), Some(RefusedByNft)),
        (V6, Filter, s("! -d ::/0 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN"), Some(RefusedByNft)),
        (V4, Filter, s("! -s 0.0.0.0/0 -j RETURN"), Some(RefusedByNft)),
        (V4, Filter, s("-d 0.0.0.0/0 -j RETURN"), Some(NotCanonical)),
        (V6, Filter, s("-s ::/0 -j RETURN"), Some(NotCanonical)),
        (V4, Filter, s("! -d 0.0.0.0/1 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN"), None),
        (V6, Filter, s("! -d 2001:db8:50::10/128 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN"), None),
        (V4, Filter, s("-d 10.0.0.1/8 -j RETURN"), Some(NotCanonical)),
        (V4, Filter, s("-d 10.0.0.0/33 -j RETURN"), Some(Refused)),
        (V6, Filter, s("-d fd00::/129 -j RETURN"), Some(Refused)),
        (V6, Filter, s("-d 10.0.0.1/32 -j RETURN"), Some(Refused)),
        (V6, Filter, s("-d ::102:304/128 -j RETURN"), Some(NotCanonical)),
        (V6, Filter, s("-d ::ffff:10.0.0.1/128 -j RETURN"), None),
        (V4, Filter, comments(1, 255), None),
        (V4, Filter, comments(1, 256), Some(NotCanonical)),
        (V4, Filter, s("-m comment --comment \"\" -j RETURN"), None),
        (V4, Filter, s("-m comment --comment \"a\\\"b\\\\c\\'d é\" -j RETURN"), None),
        (V4, Filter, s("-m comment --comment \"abc -j RETURN"), Some(Meaningless)),
        (V4, Filter, s("-p tcp -m tcp --dport 0 -j RETURN"), Some(Meaningless)),
        (V4, Filter, s("-p tcp -m tcp --dport 65536 -j RETURN"), Some(Refused)),
        (V4, Filter, s("-p tcp -m udp --dport 80 -j RETURN"), Some(Refused)),
        (V6, Filter, s("-p sctp -m sctp --dport 3868 -j RETURN"), None),
        (V4, Nat, s("-p tcp -j DNAT --to-destination 10.0.0.1:0"), Some(Meaningless)),
        (V6, Nat, s("-p udp -j DNAT --to-destination [fd00::1]:53"), None),
        (V4, Nat, s("-j DNAT --to-destination 10.0.0.1:80"), Some(Refused)),
        (V4, Filter, s("-p tcp -j DNAT --to-destination 10.0.0.1:80"), Some(Refused)),
        (V4, Nat, p("0.33333333349"), None),
        (V4, Nat, p("0.3333333333"), Some(NotCanonical)),
        (V4, Nat, p("1.5"), Some(Refused)),
        (V4, Nat, p("-0.1"), Some(Refused)),
        (V4, Nat, p("0.00000000000"), Some(Meaningless)),
        (V4, Nat, p("1.00000000000"), Some(Meaningless)),
        (V4, Nat, set(&"A".repeat(199)), None),
        (V4, Nat, set(&"A".repeat(200)), Some(NotCanonical)),
        (V4, Nat, set("."), Some(Refused)),
        (V4, Nat, set(".."), Some(Refused)),
        (V4, Nat, set("a/b"), Some(Refused)),
        (V4, Nat, set(".a_b-1"), None),
        (V4, Nat, rcheck("0"), Some(Refused)),
        (V4, Nat, rcheck("1"), None),
        (V4, Nat, rcheck("2147483647"), None),
        (V4, Nat, rcheck("2147483648"), Some(NotCanonical)),
        (V4, Nat, rcheck("4294967295"), Some(NotCanonical)),
        (V4, Nat, rcheck("4294967296"), Some(Refused)),
        (V4, Nat, s("-m recent --update --seconds 10800 --reap --name KUBE-SEP-X --mask 255.255.255.255 --rsource -j RETURN"), None),
        (V6, Nat, format!("-m recent --set --name KUBE-SEP-X {m6}"), None),
        (V4, Nat, format!("-m recent --set --name KUBE-SEP-X {m6}"), Some(Refused)),
        (V4, Nat, s("-m mark ! --mark 0x80000000/0x80000000 -j RETURN"), None),
        (V4, Nat, s("-j MARK --set-xmark 0x1/0x1"), None),
        (V4, Nat, s("-j MARK --set-xmark 0x100000000/0x100000000"), Some(Refused)),
        (V4, Filter, s("-j REJECT --reject-with icmp6-port-unreachable"), Some(Refused)),
        (V6, Filter, s("-j REJECT --reject-with icmp-port-unreachable"), Some(Refused)),
        (V6, Filter, s("-j REJECT --reject-with icmp6-port-unreachable"), None),
        (V4, Nat, s("-j REJECT --reject-with icmp-port-unreachable"), Some(Refused)),
        (V4, Filter, s("-j MASQUERADE --random-fully"), Some(Refused)),
        (V4, Nat, s("-j MASQUERADE --random-fully"), None),
        (V4, Filter, s("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"), None),
        (V4, Filter, s("-m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"), Some(NotCanonical)),
        (V4, Nat, s("! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j RETURN"), None),
        (V4, Filter, comments(31, 250), None),
        (V4, Filter, comments(40, 255), Some(Refused)),
        (V4, Filter, comments(61, 1), Some(Unvetted)),
        (V4, Filter, comments(62, 1), Some(Refused)),
    ]
}

/// The validator's findings, on the real tools: each rule in a chain of its own, one input
/// each. Refused: both backends fail the input (`RefusedByNft`: only iptables-nft). Passing:
/// both load it and iptables-save prints it as written. Not canonical: both load it and print
/// it otherwise. Meaningless (and the one unvetted case listed): both load it. Chain names too.
#[test]
fn the_validators_findings_hold_on_both_backends() {
    if !require_root() {
        return;
    }
    let cases = findings();
    for backend in BACKENDS {
        let ns = Netns::new("ipt-findings").expect("namespace");
        for (i, (family, table, args, claim)) in cases.iter().enumerate() {
            let chain = format!("KPV-{i}");
            assert_eq!(
                validate::rule(*family, *table, &chain, args)
                    .err()
                    .map(|e| e.problem),
                *claim,
                "the validator on {args}"
            );
            let input = format!(
                "*{}\n:{chain} - [0:0]\n-A {chain} {args}\nCOMMIT\n",
                table.as_str()
            );
            let loaded = try_restore(&ns, *family, backend, &input);
            let refused = match claim {
                Some(Problem::Refused) => true,
                Some(Problem::RefusedByNft) => backend == "nft",
                _ => false,
            };
            assert_eq!(
                loaded.is_err(),
                refused,
                "{backend} {family:?} {args}: {loaded:?}"
            );
        }
        for family in IpFamily::ALL {
            let saved = save(&ns, family, backend);
            for (i, (_, table, args, claim)) in
                cases.iter().enumerate().filter(|(_, c)| c.0 == family)
            {
                let got = saved.get(&(*table, format!("KPV-{i}")));
                match claim {
                    None => assert_eq!(got, Some(&vec![args.clone()]), "{backend} {family:?}"),
                    Some(Problem::NotCanonical) => {
                        let got = got.unwrap_or_else(|| panic!("{backend}: {args} not loaded"));
                        assert_ne!(
                            got,
                            &vec![args.clone()],
                            "{backend} {family:?}: printed as written"
                        );
                    }
                    // No claim about the spelling; these load (the validator is stricter).
                    Some(Problem::Meaningless | Problem::Unvetted) => {
                        assert!(got.is_some(), "{backend}: {args}")
                    }
                    Some(Problem::RefusedByNft) if backend == "legacy" => {
                        assert_eq!(got, Some(&vec![args.clone()]), "{backend} {family:?}");
                    }
                    _ => assert!(got.is_none(), "{backend}: {args} loaded"),
                }
            }
        }
        for (name, claim) in [
            ("KUBE-SVC-ABCDEFGHIJKLMNOPQRS", None),
            ("KUBE-SVC-ABCDEFGHIJKLMNOPQRST", Some(Problem::Refused)),
            ("ACCEPT", Some(Problem::Refused)),
            ("-X", Some(Problem::RefusedByNft)),
        ] {
            assert_eq!(
                validate::chain_name(name).err().map(|e| e.problem),
                claim,
                "{name}"
            );
            let loaded = try_restore(
                &ns,
                IpFamily::V4,
                backend,
                &format!("*filter\n:{name} - [0:0]\nCOMMIT\n"),
            );
            let refused = match claim {
                Some(Problem::RefusedByNft) => backend == "nft",
                other => other.is_some(),
            };
            assert_eq!(loaded.is_err(), refused, "{backend} {name}: {loaded:?}");
        }
    }
}

/// One restore in `ns`, cut into inputs of at most `step` chains, as the applier sends them.
fn apply_steps(
    ns: &Netns,
    family: IpFamily,
    backend: &str,
    r: &Restore,
    step: usize,
) -> Result<(), TestCaseError> {
    for input in r.steps(step) {
        try_restore(ns, family, backend, &input).map_err(|e| {
            TestCaseError::fail(format!(
                "{backend} {family:?} refused an input: {e}\n--- input ---\n{input}"
            ))
        })?;
    }
    Ok(())
}

/// The broad proof that what the planner renders is what both backends accept: random
/// clusters on top of the flow fixture (see `common`), each planned full and then partially
/// (some Services gone, some added), every input restored with iptables-nft and
/// iptables-legacy, IPv4 and IPv6, in a fresh namespace, and read back exactly as planned.
/// Every plan must also be free of validation errors (nothing left out).
#[test]
fn every_generated_plan_loads_on_both_backends_and_reads_back_exactly() {
    if !require_root() {
        return;
    }
    let strategy = (
        prop::collection::vec(common::service(), 4..28),
        common::setup(),
        prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        prop::collection::vec(common::service(), 0..3),
        1usize..60,
    );
    // About 0.5 s a cluster (four namespaces, a dozen restores and saves).
    const CASES: u32 = 40;
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        max_shrink_iters: 32,
        ..Config::default()
    });
    let started = std::time::Instant::now();
    let result = runner.run(&strategy, |(services, setup, gone, added, step)| {
        let state = kp_flows::load(kp_flows::NODE, common::objects(&services, true));
        let node = setup.node(&state);
        let keys: Vec<_> = state.service_keys().cloned().collect();
        let mut later = kp_flows::load(kp_flows::NODE, common::objects(&services, true));
        for g in &gone {
            let key = g.get(&keys);
            later
                .apply(SourceEvent::Delete(
                    Kind::Service,
                    ObjectKey {
                        namespace: key.namespace.clone(),
                        name: key.name.clone(),
                    },
                ))
                .unwrap();
        }
        for (k, s) in added.iter().enumerate() {
            for o in s.objects(services.len() + k) {
                later.apply(SourceEvent::Upsert(o)).unwrap();
            }
        }
        let changes = later.take_changes();
        for backend in BACKENDS {
            for family in IpFamily::ALL {
                let ns = Netns::new("ipt-gen").expect("namespace");
                let mut planner = Planner::new(setup.config(family));
                let full = planner.full(&state, &node);
                prop_assert_eq!(&full.errors, &vec![]);
                apply_steps(&ns, family, backend, &full, step)?;
                try_restore(&ns, family, backend, &jump_input(&planner))
                    .map_err(TestCaseError::fail)?;
                assert_read_back(&ns, family, backend, &planner, &state, "generated, full");
                let partial =
                    planner.partial(&later, &changes.services, &node, changes.node_changed);
                prop_assert_eq!(&partial.errors, &vec![]);
                apply_steps(&ns, family, backend, &partial, step)?;
                assert_read_back(&ns, family, backend, &planner, &later, "generated, partial");
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!(
        "{CASES} generated clusters on both backends, both families: {:?}",
        started.elapsed()
    );
}
