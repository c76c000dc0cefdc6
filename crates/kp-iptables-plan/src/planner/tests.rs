//! The planner over the packet-flow fixture (`kp_flows`): what full and partial plans write,
//! delete and leave alone.

use super::*;
use kp_core::track::{Kind, Object, ObjectKey, SourceEvent};
use kp_flows::synthetic;

type Tables = BTreeMap<(Table, String), Vec<String>>;

/// The fixture's node: pods in the cluster CIDRs, NodePorts on the primary addresses.
fn node_ctx() -> NodeContext {
    kp_flows::node_context()
}

fn v4() -> Planner {
    Planner::new(PlanConfig::new(IpFamily::V4))
}

/// A kernel's view: what a sequence of restores leaves behind.
fn apply(kernel: &mut Tables, r: &Restore) {
    let r = r.clone().materialize();
    for g in &r.service_chains {
        for c in &g.chains {
            kernel.insert((c.table, c.chain.clone()), c.rules.clone());
        }
    }
    for c in r.base_chains.iter().chain(r.dispatch_chains.iter()) {
        kernel.insert((c.table, c.chain.clone()), c.rules.clone());
    }
    for d in &r.deleted_chains {
        kernel.remove(d);
    }
}

fn fresh(state: &ProxyState, node: &NodeContext) -> Tables {
    let mut p = v4();
    p.full(state, node);
    p.expected(state)
}

fn upsert(state: &mut ProxyState, o: Object) -> BTreeSet<ServiceKey> {
    state.apply(SourceEvent::Upsert(o)).unwrap();
    state.take_changes().services
}

fn web() -> ServicePortName {
    ServicePortName {
        service: ServiceKey::new("default", "web"),
        port: String::new(),
        protocol: kp_core::model::Protocol::Tcp,
    }
}

fn pod_endpoint(addr: &str) -> kp_core::model::Endpoint {
    kp_core::model::Endpoint {
        ip: addr.parse().unwrap(),
        port: kp_flows::TCP_PORT,
        ready: true,
        serving: true,
        terminating: false,
        is_local: true,
        zone_hints: None,
    }
}

/// Every `-j KUBE-…` target names a chain of the table.
fn assert_no_dangling_jumps(tables: &Tables) {
    for ((table, chain), rules) in tables {
        for r in rules {
            if let Some(target) = r.split(" -j ").nth(1) {
                let target = target.split(' ').next().unwrap();
                if target.starts_with("KUBE-") {
                    assert!(
                        tables.contains_key(&(*table, target.to_string())),
                        "{chain}: {r} jumps to a missing chain"
                    );
                }
            }
        }
    }
}

#[test]
fn a_full_plan_writes_every_chain_it_owns_in_a_stable_order() {
    let state = kp_flows::state();
    let mut p = v4();
    assert!(!p.programmed());
    let r = p.full(&state, &node_ctx()).materialize();
    assert!(r.full && p.programmed());
    assert_eq!(r.base_chains.len(), 1);
    assert_eq!(r.base_chains[0].chain, names::KUBE_MARK_MASQ);
    let dispatch: Vec<(Table, &str)> = r
        .dispatch_chains
        .iter()
        .map(|c| (c.table, c.chain.as_str()))
        .collect();
    assert_eq!(
        dispatch,
        [
            // First, so iptables-nft-restore meets its jump targets in descending order.
            (Table::Nat, "KUBE-SERVICES"),
            (Table::Filter, "KUBE-EXTERNAL-SERVICES"),
            (Table::Filter, "KUBE-FORWARD"),
            (Table::Filter, "KUBE-NODEPORTS"),
            (Table::Filter, "KUBE-PROXY-FIREWALL"),
            (Table::Filter, "KUBE-SERVICES"),
            (Table::Nat, "KUBE-NODEPORTS"),
            (Table::Nat, "KUBE-POSTROUTING"),
        ]
    );
    // nat KUBE-SERVICES: jumps by target, descending, and the NodePort jump last.
    let services = &r.dispatch_chains[0].rules;
    let targets: Vec<&str> = services
        .iter()
        .filter_map(|r| r.rsplit_once(" -j ").map(|(_, t)| t))
        .collect();
    assert!(targets.len() > 5, "{services:#?}");
    assert_eq!(targets.last(), Some(&names::KUBE_NODEPORTS));
    let jumps = &targets[..targets.len() - 1];
    assert!(jumps.windows(2).all(|w| w[0] >= w[1]), "{jumps:#?}");
    assert!(r.deleted_chains.is_empty());
    // Service groups sorted by Service port name; web6 is IPv6-only and not here.
    let groups: Vec<&str> = r
        .service_chains
        .iter()
        .map(|g| g.service_port.as_str())
        .collect();
    let mut sorted = groups.clone();
    sorted.sort();
    assert_eq!(groups, sorted);
    assert!(!groups.contains(&"default/web6"));
    assert!(
        !groups.contains(&"default/empty"),
        "no endpoints, no nat chains"
    );
    // expected() is exactly what was written.
    let expected = p.expected(&state);
    let written: BTreeSet<(Table, String)> = r
        .chain_names()
        .into_iter()
        .map(|(t, c)| (t, c.to_string()))
        .collect();
    assert_eq!(expected.keys().cloned().collect::<BTreeSet<_>>(), written);
    let mut kernel = Tables::new();
    apply(&mut kernel, &r);
    assert_eq!(kernel, expected);
    assert_no_dangling_jumps(&expected);
    // Same state, same text.
    assert_eq!(v4().full(&state, &node_ctx()).text(), r.text());
    // The NodePort jump is the last rule of nat KUBE-SERVICES, on the primary address only.
    let nat_services = &expected[&(Table::Nat, "KUBE-SERVICES".to_string())];
    assert!(nat_services
        .last()
        .unwrap()
        .starts_with("-d 192.0.2.1/32 -m comment --comment \"kubernetes service nodeports;"));
    // `empty` rejects. Every filter rule for a ClusterIP rejects or drops.
    let filter_services = &expected[&(Table::Filter, "KUBE-SERVICES".to_string())];
    assert!(filter_services.iter().any(|r| r.contains(
        "\"default/empty has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable"
    )));
    assert!(filter_services
        .iter()
        .all(|r| r.ends_with("-j DROP") || r.contains("-j REJECT") || r.ends_with("-j RETURN")));
    // Then every ClusterIP rejects the ports no Service uses, after the per-port rules, with one
    // RETURN in front for everything outside the Service CIDR, and the rest of the Service CIDR
    // (unallocated addresses) is dropped last.
    let tail = filter_services
        .iter()
        .position(|r| r.ends_with("-j RETURN"))
        .unwrap();
    assert_eq!(
        filter_services[tail],
        "! -d 10.96.0.0/16 -m comment --comment \"not addressed to a ClusterIP\" -j RETURN"
    );
    let (last, rejects) = filter_services[tail + 1..].split_last().unwrap();
    assert!(rejects.iter().all(|r| r.contains(": no Service port here")));
    assert_eq!(
        last,
        "-d 10.96.0.0/16 -m comment --comment \"drop traffic to unallocated ClusterIPs\" -j DROP"
    );
    assert!(filter_services[..tail]
        .iter()
        .all(|r| r.contains("-m tcp --dport") || r.contains("-m udp --dport")));
    let vips = state
        .service_keys()
        .filter(|k| p.services.contains_key(*k))
        .count();
    assert_eq!(rejects.len(), vips);
    assert!(filter_services.contains(
        &"-d 10.96.0.10/32 -m comment --comment \"default/web cluster IP: no Service port here\" -j REJECT --reject-with icmp-port-unreachable".to_string()
    ));
    // The Local-policy counts match the DROP rules rendered for them.
    let external = expected[&(Table::Filter, "KUBE-EXTERNAL-SERVICES".to_string())]
        .iter()
        .filter(|r| r.contains("has no local endpoints"))
        .map(|r| {
            let before = r.split(" has no local endpoints").next().unwrap();
            before.rsplit('"').next().unwrap().to_string()
        })
        .collect::<BTreeSet<_>>();
    let internal = filter_services
        .iter()
        .filter(|r| r.contains("has no local endpoints"))
        .count() as u64;
    assert_eq!(p.no_local_endpoints(), (internal, external.len() as u64));
    assert!(external.contains("default/local-none"), "{external:?}");
}

#[test]
fn the_ipv6_planner_sees_only_services_with_an_ipv6_clusterip() {
    let state = kp_flows::state();
    let mut p = Planner::new(PlanConfig::new(IpFamily::V6));
    let r = p.full(&state, &node_ctx()).materialize();
    let groups: Vec<&str> = r
        .service_chains
        .iter()
        .map(|g| g.service_port.as_str())
        .collect();
    assert!(groups.contains(&"default/web6") && groups.contains(&"default/dual"));
    assert!(!groups.contains(&"default/web"));
    let expected = p.expected(&state);
    let nat_services = &expected[&(Table::Nat, "KUBE-SERVICES".to_string())];
    assert!(nat_services
        .iter()
        .any(|r| r.starts_with("-d fd00:10:96::10/128 -p tcp")));
    assert!(nat_services.iter().all(|r| !r.contains("10.96.0.")));
    // NodePorts on the IPv6 primary address.
    assert!(nat_services
        .last()
        .unwrap()
        .starts_with(&format!("-d {}/128 ", kp_flows::NODE_IP6)));
    // IPv4-only endpoints: the IPv6 ClusterIP rejects, with ICMPv6.
    let filter_services = &expected[&(Table::Filter, "KUBE-SERVICES".to_string())];
    assert!(filter_services
        .iter()
        .any(|r| r.contains("default/dual-v4-only has no endpoints")
            && r.ends_with("-j REJECT --reject-with icmp6-port-unreachable")));
    assert_no_dangling_jumps(&expected);
}

#[test]
fn a_partial_plan_with_nothing_changed_sends_nothing() {
    let state = kp_flows::state();
    let mut p = v4();
    p.full(&state, &node_ctx());
    let r = p.partial(&state, &BTreeSet::new(), &node_ctx(), false);
    assert!(r.is_empty(), "{}", r.text());
    let all: BTreeSet<ServiceKey> = state.service_keys().cloned().collect();
    let r = p.partial(&state, &all, &node_ctx(), false);
    assert!(r.is_empty(), "{}", r.text());
    assert!(!r.full);
}

#[test]
fn an_endpoint_change_rewrites_the_svc_chain_and_only_the_sep_chains_that_changed() {
    let mut state = kp_flows::state();
    let mut p = v4();
    let mut kernel = Tables::new();
    apply(&mut kernel, &p.full(&state, &node_ctx()));
    let chains = names::service_chains(&web());
    let sep = |addr: &str| names::endpoint_chain(&web(), &pod_endpoint(addr));

    // pod-3 goes away.
    let changed = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2"]))),
    );
    let r = p.partial(&state, &changed, &node_ctx(), false);
    assert_eq!(r.service_chains.len(), 1);
    let written: Vec<&str> = r.service_chains[0]
        .chains
        .iter()
        .map(|c| c.chain.as_str())
        .collect();
    assert_eq!(written, [chains.svc.as_str()]);
    assert!(r.dispatch_chains.is_empty() && r.base_chains.is_empty());
    assert_eq!(r.deleted_chains, [(Table::Nat, sep("10.244.1.13"))]);
    apply(&mut kernel, &r);
    assert_eq!(kernel, p.expected(&state));

    // pod-4 comes: SVC and pod-4's new SEP chain.
    let changed = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2", "pod-4"]))),
    );
    let r = p.partial(&state, &changed, &node_ctx(), false);
    let written: BTreeSet<&str> = r.service_chains[0]
        .chains
        .iter()
        .map(|c| c.chain.as_str())
        .collect();
    assert_eq!(
        written,
        BTreeSet::from([chains.svc.as_str(), sep("10.244.1.14").as_str()])
    );
    assert!(r.deleted_chains.is_empty() && r.dispatch_chains.is_empty());
    apply(&mut kernel, &r);
    assert_eq!(kernel, p.expected(&state));
    assert_eq!(kernel, fresh(&state, &node_ctx()));
}

#[test]
fn losing_every_endpoint_moves_the_service_to_filter_rejects_and_deletes_its_chains() {
    let mut state = kp_flows::state();
    let mut p = v4();
    let mut kernel = Tables::new();
    apply(&mut kernel, &p.full(&state, &node_ctx()));
    let changed = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&[]))),
    );
    let r = p.partial(&state, &changed, &node_ctx(), false);
    assert!(r.service_chains.is_empty());
    let rewritten: BTreeSet<(Table, &str)> = r
        .dispatch_chains
        .iter()
        .map(|c| (c.table, c.chain.as_str()))
        .collect();
    assert_eq!(
        rewritten,
        BTreeSet::from([
            (Table::Filter, "KUBE-SERVICES"),
            (Table::Filter, "KUBE-EXTERNAL-SERVICES"),
            (Table::Nat, "KUBE-SERVICES"),
            (Table::Nat, "KUBE-NODEPORTS"),
        ])
    );
    let chains = names::service_chains(&web());
    let deleted: BTreeSet<&str> = r.deleted_chains.iter().map(|(_, c)| c.as_str()).collect();
    assert!(deleted.contains(chains.svc.as_str()) && deleted.contains(chains.ext.as_str()));
    assert_eq!(deleted.len(), 2 + 3, "SVC, EXT and three SEP chains");
    apply(&mut kernel, &r);
    assert_eq!(kernel, fresh(&state, &node_ctx()));
    assert_no_dangling_jumps(&kernel);
}

#[test]
fn a_full_plan_after_a_failed_restore_deletes_what_is_no_longer_planned() {
    let mut state = kp_flows::state();
    let mut p = v4();
    let mut kernel = Tables::new();
    apply(&mut kernel, &p.full(&state, &node_ctx()));

    // The Service goes; the partial restore that deletes its chains fails.
    state
        .apply(SourceEvent::Delete(
            Kind::Service,
            ObjectKey {
                namespace: "default".into(),
                name: "web".into(),
            },
        ))
        .unwrap();
    let changed = state.take_changes().services;
    let failed = p.partial(&state, &changed, &node_ctx(), false);
    assert!(!failed.deleted_chains.is_empty());
    p.invalidate();
    assert!(!p.programmed());

    // The next plan is full (also when asked for a partial) and deletes them again.
    let r = p.partial(&state, &BTreeSet::new(), &node_ctx(), false);
    assert!(r.full);
    let deleted: BTreeSet<&(Table, String)> = r.deleted_chains.iter().collect();
    for d in &failed.deleted_chains {
        assert!(deleted.contains(d), "{d:?} not deleted again");
    }
    apply(&mut kernel, &r);
    assert_eq!(kernel, p.expected(&state));

    // Once a partial confirms that restore, a later full does not delete them a third time.
    p.partial(&state, &BTreeSet::new(), &node_ctx(), false);
    assert!(p.full(&state, &node_ctx()).deleted_chains.is_empty());
}

#[test]
fn a_changed_node_context_replans_every_service() {
    let state = kp_flows::state();
    let mut p = v4();
    let mut kernel = Tables::new();
    apply(&mut kernel, &p.full(&state, &node_ctx()));
    let mut other = node_ctx();
    other.local_cidrs = vec!["10.244.1.0/24".parse().unwrap()];
    // Even when the caller does not flag it, a different context replans everything.
    let r = p.partial(&state, &BTreeSet::new(), &other, false);
    assert!(!r.full);
    // Every SVC chain with a masquerade rule changed (and every EXT chain of a Local policy).
    let rewritten = r.service_chains.len();
    assert!(rewritten >= 6, "{}", r.text());
    assert!(r.text().contains("! -s 10.244.1.0/24 -d 10.96.0.10/32"));
    // No SEP chain changed.
    assert!(!r.text().contains(":KUBE-SEP-"), "{}", r.text());
    apply(&mut kernel, &r);
    assert_eq!(kernel, fresh(&state, &other));
}

#[test]
fn crossing_the_large_cluster_threshold_rewrites_every_per_endpoint_rule() {
    // 80 Services × 10 endpoints, 11 of them with a second port: 910 endpoints.
    let mut state = kp_flows::load("node-0", synthetic::cluster(80, 10));
    let mut p = v4();
    let mut kernel = Tables::new();
    apply(&mut kernel, &p.full(&state, &NodeContext::default()));
    assert!(kernel.values().flatten().any(|r| r.contains(" -> 10.128.")));

    // One more Service with 100 endpoints on two ports: 1110.
    upsert(
        &mut state,
        Object::Service(Box::new(synthetic::service(80))),
    );
    let changed = upsert(
        &mut state,
        Object::EndpointSlice(Box::new(synthetic::slice(80, 100, &[]))),
    );
    assert_eq!(changed.len(), 1);
    let r = p.partial(&state, &changed, &NodeContext::default(), false);
    assert!(
        r.service_chains.len() > 80,
        "every port's chains are rewritten"
    );
    apply(&mut kernel, &r);
    assert_eq!(kernel, fresh(&state, &NodeContext::default()));
    for ((_, chain), rules) in &kernel {
        if chain.starts_with(names::SEP_PREFIX) {
            assert!(rules.iter().all(|r| !r.contains("-m comment")), "{rules:?}");
        }
    }

    // And back: the Service goes, comments come back.
    state
        .apply(SourceEvent::Delete(
            Kind::Service,
            ObjectKey {
                namespace: "bench".into(),
                name: "svc-80".into(),
            },
        ))
        .unwrap();
    let changed = state.take_changes().services;
    let r = p.partial(&state, &changed, &NodeContext::default(), false);
    apply(&mut kernel, &r);
    assert_eq!(kernel, fresh(&state, &NodeContext::default()));
    assert!(kernel.values().flatten().any(|r| r.contains(" -> 10.128.")));
}

#[test]
fn localhost_nodeports_add_kubelets_firewall_chain_and_its_jumps() {
    let state = kp_flows::state();
    let mut cfg = PlanConfig::new(IpFamily::V4);
    cfg.localhost_node_ports = true;
    let mut p = Planner::new(cfg.clone());
    p.full(&state, &NodeContext::default());
    let expected = p.expected(&state);
    assert!(expected.contains_key(&(Table::Filter, "KUBE-FIREWALL".to_string())));
    let nat_services = &expected[&(Table::Nat, "KUBE-SERVICES".to_string())];
    assert!(nat_services
        .last()
        .unwrap()
        .starts_with("-m comment --comment \"kubernetes service nodeports;"));
    let jumps = p.jump_rules();
    assert_eq!(jumps.len(), 14);
    assert!(jumps
        .iter()
        .any(|j| j.table == "filter" && j.chain == "INPUT" && j.args == "-j KUBE-FIREWALL"));

    // Not for IPv6, and not without localhost NodePorts.
    cfg.family = IpFamily::V6;
    let mut p6 = Planner::new(cfg);
    p6.full(&state, &NodeContext::default());
    assert!(!p6
        .expected(&state)
        .contains_key(&(Table::Filter, "KUBE-FIREWALL".to_string())));
    assert_eq!(p6.jump_rules().len(), 12);
    assert_eq!(v4().jump_rules().len(), 12);
}

/// The restore text as the planner rendered it before inputs were streamed (a `String` built
/// from held chains): per table in commit order, chain lines, deletions' chain lines, rules,
/// `-X`, `COMMIT`.
fn reference_text(writes: &[&ChainWrite], deleted: &[(Table, String)]) -> String {
    let mut out = String::new();
    for table in Table::COMMIT_ORDER {
        let w: Vec<&&ChainWrite> = writes.iter().filter(|c| c.table == table).collect();
        let d: Vec<&String> = deleted
            .iter()
            .filter(|(t, _)| *t == table)
            .map(|(_, c)| c)
            .collect();
        if w.is_empty() && d.is_empty() {
            continue;
        }
        out.push_str(&format!("*{}\n", table.as_str()));
        for c in &w {
            out.push_str(&format!(":{} - [0:0]\n", c.chain));
        }
        for c in &d {
            out.push_str(&format!(":{c} - [0:0]\n"));
        }
        for c in &w {
            for r in &c.rules {
                out.push_str(&format!("-A {} {r}\n", c.chain));
            }
        }
        for c in &d {
            out.push_str(&format!("-X {c}\n"));
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// Every chain a materialized restore writes, in its order: fixed, Service, dispatch chains.
fn all_writes<'r>(r: &'r Restore<'_>) -> Vec<&'r ChainWrite> {
    r.base_chains
        .iter()
        .chain(r.service_chains.iter().flat_map(|g| g.chains.iter()))
        .chain(r.dispatch_chains.iter())
        .collect()
}

/// The steps as they were cut before: fixed chains first, whole groups up to `max` chains,
/// dispatch chains and deletions last.
fn reference_steps(r: &Restore, max: usize) -> Vec<String> {
    let writes = all_writes(r);
    if writes.len() + r.deleted_chains.len() <= max.max(1) {
        return if r.is_empty() {
            Vec::new()
        } else {
            vec![reference_text(&writes, &r.deleted_chains)]
        };
    }
    let mut steps = Vec::new();
    let mut current: Vec<&ChainWrite> = r.base_chains.iter().collect();
    for g in &r.service_chains {
        if !current.is_empty() && current.len() + g.chains.len() > max {
            steps.push(reference_text(&current, &[]));
            current.clear();
        }
        current.extend(g.chains.iter());
    }
    if !current.is_empty() {
        steps.push(reference_text(&current, &[]));
    }
    let last: Vec<&ChainWrite> = r.dispatch_chains.iter().collect();
    if !last.is_empty() || !r.deleted_chains.is_empty() {
        steps.push(reference_text(&last, &r.deleted_chains));
    }
    steps
}

#[test]
fn a_full_plan_streams_the_same_bytes_as_its_materialized_chains() {
    let state = kp_flows::load("node-0", synthetic::cluster(120, 4));
    let mut p = v4();
    let lazy = p.full(&state, &NodeContext::default());
    assert!(lazy.service_chains.is_empty(), "rendered only when written");
    let held = lazy.clone().materialize();
    assert!(held.service_chains.len() > 120);
    assert_eq!(lazy.chain_count(), held.chain_count());
    assert_eq!(lazy.rule_count(), held.rule_count());
    assert_eq!(lazy.chain_names(), held.chain_names());
    let text = lazy.text();
    assert_eq!(
        text,
        reference_text(&all_writes(&held), &held.deleted_chains)
    );
    assert_eq!(text, held.text());
    for max in [1, 3, 7, 50, 400, 100_000] {
        let steps = lazy.steps(max);
        assert_eq!(steps, reference_steps(&held, max), "max {max}");
        let inputs = lazy.inputs(max);
        assert_eq!(
            inputs.iter().map(|i| i.chains()).sum::<usize>(),
            lazy.chain_count()
        );
        // Streaming into a writer gives each step's bytes.
        for (i, input) in inputs.iter().enumerate() {
            let mut out = Vec::new();
            lazy.write_input(input, &[], &mut out).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), steps[i]);
        }
    }
    // A partial plan (held chains) renders as before too.
    let mut state = state;
    state
        .apply(SourceEvent::Upsert(synthetic::endpoint_change(3, 120, 4)))
        .unwrap();
    let changed = state.take_changes().services;
    let r = p.partial(&state, &changed, &NodeContext::default(), false);
    assert!(!r.is_empty());
    assert_eq!(r.steps(2), reference_steps(&r, 2));
    assert_eq!(r.text(), reference_steps(&r, 1000).concat());
}

#[test]
fn extra_lines_go_after_the_table_line_and_before_commit_or_in_a_section_of_their_own() {
    let state = kp_flows::state();
    let mut p = v4();
    let r = p.full(&state, &node_ctx());
    let decls = vec![":KUBE-PROXY-CANARY - [0:0]".to_string()];
    let rules = vec!["-I PREROUTING -j KUBE-SERVICES".to_string()];
    let none: Vec<String> = Vec::new();
    let inputs = r.inputs(5);
    let last = inputs.last().unwrap();
    assert!(last.is_last());
    let text = r.input_text(
        last,
        &[crate::restore::Extra {
            table: Table::Nat,
            decls: &decls,
            rules: &rules,
        }],
    );
    let plain = r.input_text(last, &[]);
    let nat = plain.find("*nat\n").unwrap() + "*nat\n".len();
    let commit = nat + plain[nat..].find("COMMIT\n").unwrap();
    let want = format!(
        "{}{}\n{}{}\n{}",
        &plain[..nat],
        decls[0],
        &plain[nat..commit],
        rules[0],
        &plain[commit..]
    );
    assert_eq!(text, want);
    // An input without a filter section gets one at its end; empty extras change nothing.
    let first = &inputs[0];
    let plain = r.input_text(first, &[]);
    assert!(!plain.contains("*filter"));
    let extra = [
        crate::restore::Extra {
            table: Table::Filter,
            decls: &none,
            rules: &rules,
        },
        crate::restore::Extra {
            table: Table::Nat,
            decls: &none,
            rules: &none,
        },
    ];
    assert_eq!(
        r.input_text(first, &extra),
        format!("{plain}*filter\n{}\nCOMMIT\n", rules[0])
    );
}

/// An IPv6 `loadBalancerSourceRanges` entry kp-core accepts (any CIDR is a valid source range)
/// but iptables-save prints in another form (`::1.2.3.0/120`), so a rule holding it would never
/// read back as planned.
const ODD_RANGE: &str = "::102:300/120";

/// Dual-stack LoadBalancer Service `default/odd` (10.96.0.200, fd00:10:96::200) on TCP 80 with
/// `source_range` among its IPv6 source ranges, and its IPv6 endpoint on this node (pod-1).
fn odd_service(source_range: &str) -> [Object; 2] {
    let svc = serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "odd", "namespace": "default"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.200",
            "clusterIPs": ["10.96.0.200", "fd00:10:96::200"], "ipFamilies": ["IPv4", "IPv6"],
            "ipFamilyPolicy": "RequireDualStack",
            "loadBalancerSourceRanges": ["192.0.2.0/24", source_range],
            "ports": [{"protocol": "TCP", "port": 80, "targetPort": 8080, "nodePort": 30200}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.200"},
            {"ip": "2001:db8:b::200"}]}},
    });
    let slice = serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "odd-v6", "namespace": "default",
            "labels": {"kubernetes.io/service-name": "odd"}},
        "addressType": "IPv6",
        "ports": [{"name": "", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": ["fd00:10:244:1::11"], "conditions": {"ready": true},
            "nodeName": kp_flows::NODE}],
    });
    [
        Object::Service(Box::new(serde_json::from_value(svc).unwrap())),
        Object::EndpointSlice(Box::new(serde_json::from_value(slice).unwrap())),
    ]
}

/// A Service whose rules fail validation is left out of that family's tables, reported in
/// `Restore::errors`, and every other Service is planned; once it renders valid it is planned,
/// and if it turns invalid again its chains are deleted. An IPv4-compatible source range
/// ([`ODD_RANGE`]) is one.
#[test]
fn a_service_with_a_refused_rule_is_left_out_and_every_other_service_planned() {
    let mut objects = kp_flows::objects();
    objects.extend(odd_service(ODD_RANGE));
    let mut state = kp_flows::load(kp_flows::NODE, objects);
    let odd = ServiceKey::new("default", "odd");
    let node = node_ctx();

    let mut v4 = v4();
    let r = v4.full(&state, &node);
    assert_eq!(r.errors, [], "IPv4 renders it fine");
    assert!(v4.services.contains_key(&odd));

    let mut p = Planner::new(PlanConfig::new(IpFamily::V6));
    let r = p.full(&state, &node).materialize();
    assert!(p.programmed() && r.fatal().is_none());
    let [PlanError::Service {
        service,
        family,
        error,
        ..
    }] = r.errors.as_slice()
    else {
        panic!("{:#?}", r.errors);
    };
    assert_eq!((service, *family), (&odd, IpFamily::V6));
    assert_eq!(error.problem, crate::Problem::NotCanonical, "{error}");
    assert!(!r.text().contains("fd00:10:96::200"), "{}", r.text());
    assert!(!p.services.contains_key(&odd));
    assert!(
        r.text().contains("fd00:10:96::10/128"),
        "the others are planned"
    );
    let message = r.errors[0].to_string();
    assert!(
        message.starts_with("IPv6 Service default/odd left out: ") && message.contains("::102:300"),
        "{message}"
    );

    // Valid now: planned by a partial plan, which reports nothing.
    let changed = upsert(&mut state, odd_service("2001:db8:c::/64")[0].clone());
    let r = p.partial(&state, &changed, &node, false);
    assert_eq!(r.errors, []);
    assert!(p.services.contains_key(&odd));
    assert!(
        r.text().contains("-d fd00:10:96::200/128 -p tcp"),
        "{}",
        r.text()
    );
    let mut kernel = p.expected(&state);

    // Invalid again: its chains go, the shared chains no longer name it, the error is reported.
    let chains: Vec<String> = p.services[&odd].chains().map(|c| c.id.name()).collect();
    assert!(!chains.is_empty());
    let changed = upsert(&mut state, odd_service(ODD_RANGE)[0].clone());
    let r = p.partial(&state, &changed, &node, false);
    assert!(
        matches!(r.errors.as_slice(), [PlanError::Service { .. }]),
        "{:#?}",
        r.errors
    );
    for c in &chains {
        assert!(r.deleted_chains.contains(&(Table::Nat, c.clone())), "{c}");
    }
    apply(&mut kernel, &r);
    let mut fresh = Planner::new(PlanConfig::new(IpFamily::V6));
    let again = fresh.full(&state, &node);
    assert_eq!(again.errors.len(), 1);
    assert_eq!(kernel, fresh.expected(&state));
    assert_eq!(p.expected(&state), fresh.expected(&state));
    assert!(!format!("{kernel:?}").contains("default/odd"));
}

/// A rule of a shared chain that fails validation (here the NodePort jump of nat
/// `KUBE-SERVICES`, for a `nodePortAddresses` CIDR glibc prints in another form) cannot be left
/// out of one Service: the plan is empty, names the error as fatal, and the next plan is full.
#[test]
fn a_refused_shared_rule_empties_the_plan_and_the_next_one_is_full() {
    let state = kp_flows::state();
    let mut node = node_ctx();
    let mut p = Planner::new(PlanConfig::new(IpFamily::V6));
    assert!(p.full(&state, &node).fatal().is_none());
    assert!(p.programmed());

    node.node_port_addresses = vec!["::102:300/120".parse().unwrap()];
    for r in [
        p.partial(&state, &BTreeSet::new(), &node, true),
        p.full(&state, &node),
    ] {
        assert!(r.is_empty(), "{}", r.text());
        let Some(PlanError::Shared {
            table,
            chain,
            error,
            ..
        }) = r.fatal()
        else {
            panic!("{:#?}", r.errors);
        };
        assert_eq!((*table, chain.as_str()), (Table::Nat, "KUBE-SERVICES"));
        assert_eq!(error.problem, crate::Problem::NotCanonical);
        assert!(!p.programmed());
    }

    let node = node_ctx();
    let r = p.partial(&state, &BTreeSet::new(), &node, false);
    assert!(r.full && r.errors.is_empty() && !r.is_empty());
    assert!(p.programmed());
}

/// Every chain a materialized restore writes, by table and name.
fn written(r: &Restore<'_>) -> BTreeSet<(Table, String)> {
    all_writes(r)
        .into_iter()
        .map(|c| (c.table, c.chain.clone()))
        .collect()
}

/// Adopting what a kernel holds (a restart): a full plan trimmed with `Restore::retain` to the
/// chains whose planned digest differs from the kernel's streams the same bytes as its
/// materialized chains in any step size, writes exactly what a partial plan of the same change
/// writes, and, applied over that kernel with our chains it no longer plans deleted, leaves the
/// full plan's tables. Keeping everything changes nothing; keeping nothing leaves nothing to send.
#[test]
fn a_full_plan_trimmed_to_what_the_kernel_lacks_writes_what_a_partial_plan_would() {
    let (n, per) = (120, 4);
    let node = NodeContext::default();
    let mut state = kp_flows::load("node-0", synthetic::cluster(n, per));
    let mut before = v4();
    before.full(&state, &node);
    let kernel: Tables = before.expected(&state);

    // While the process is down: an endpoint replaced (on this node: a KUBE-SEP chain goes and
    // another comes), an endpoint elsewhere removed from a NodePort Service (its KUBE-SVC chain
    // changes, its KUBE-EXT and KUBE-SEP chains do not), a Service added and one removed.
    state
        .apply(SourceEvent::Upsert(synthetic::endpoint_change(0, n, per)))
        .unwrap();
    for o in [
        Object::EndpointSlice(Box::new(synthetic::slice(11, per, &[2]))),
        Object::Service(Box::new(synthetic::service(n))),
        Object::EndpointSlice(Box::new(synthetic::slice(n, per, &[]))),
    ] {
        state.apply(SourceEvent::Upsert(o)).unwrap();
    }
    state
        .apply(SourceEvent::Delete(
            Kind::Service,
            ObjectKey {
                namespace: "bench".into(),
                name: "svc-7".into(),
            },
        ))
        .unwrap();
    let changed = state.take_changes().services;
    assert_eq!(changed.len(), 4);
    let partial = before.partial(&state, &changed, &node, false).materialize();

    let mut p = v4();
    let full = p.full(&state, &node);
    let index = p.index();
    let differs =
        |t: Table, c: &str| kernel.get(&(t, c.to_string())).map(|r| digest(r)) != index.get(t, c);
    let mut trimmed = full.clone();
    trimmed.retain(differs);
    let mut held = full.clone().materialize();
    held.retain(differs);
    assert!(trimmed.full);
    // svc-11's port keeps only its KUBE-SVC chain: a group trimmed, not dropped.
    let svc11: Vec<&ServiceChains> = held
        .service_chains
        .iter()
        .filter(|g| g.service_port.starts_with("bench/svc-11:"))
        .collect();
    assert_eq!(svc11.len(), 1, "{svc11:#?}");
    let kept: Vec<&str> = svc11[0].chains.iter().map(|c| c.chain.as_str()).collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(kept[0].starts_with(names::SVC_PREFIX), "{kept:?}");

    // The lazy and the held forms agree, byte for byte and in counts.
    assert_eq!(
        trimmed.text(),
        reference_text(&all_writes(&held), &held.deleted_chains)
    );
    for max in [1, 2, 5, 1000] {
        assert_eq!(trimmed.steps(max), reference_steps(&held, max), "max {max}");
    }
    assert_eq!(trimmed.chain_count(), held.chain_count());
    assert_eq!(trimmed.rule_count(), held.rule_count());
    assert_eq!(trimmed.chain_names(), held.chain_names());
    assert_eq!(trimmed.clone().materialize(), held);

    // What it writes is what the partial plan writes: the changed Services' chains that
    // differ and the shared chains that differ.
    let w = written(&held);
    assert_eq!(w, written(&partial));
    assert!(w.contains(&(Table::Nat, names::KUBE_SERVICES.to_string())));
    assert!(w.len() < 12, "{w:#?}");
    assert!(full.chain_count() > 10 * w.len());

    // Over the kernel, with the chains no longer planned deleted (the applier adds those), it
    // leaves exactly the full plan's tables.
    let mut k = kernel.clone();
    apply(&mut k, &trimmed);
    let gone: Vec<(Table, String)> = k
        .keys()
        .filter(|(t, c)| index.get(*t, c).is_none())
        .cloned()
        .collect();
    assert_eq!(
        gone.iter()
            .map(|(t, c)| (*t, c.clone()))
            .collect::<BTreeSet<_>>(),
        partial
            .deleted_chains
            .iter()
            .cloned()
            .collect::<BTreeSet<_>>()
    );
    for g in &gone {
        k.remove(g);
    }
    assert_eq!(k, p.expected(&state));
    assert_no_dangling_jumps(&k);
    assert!(p.programmed(), "the next plan is partial");

    // Keeping everything is the full plan; keeping nothing sends nothing.
    let mut all = full.clone();
    all.retain(|_, _| true);
    assert_eq!(all.text(), full.text());
    assert_eq!(all.rule_count(), full.rule_count());
    let mut none = full.clone();
    none.retain(|_, _| false);
    assert!(none.is_empty());
    assert!(none.inputs(7).is_empty());
    assert_eq!((none.chain_count(), none.rule_count()), (0, 0));
}

/// The per-chain record keeps its rule count in the padding after the chain id: 128k of them
/// at 10k Services × 10 endpoints stay 24 bytes each.
#[test]
fn a_planned_chain_record_stays_24_bytes() {
    assert_eq!(std::mem::size_of::<ChainRec>(), 24);
}
