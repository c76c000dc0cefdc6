//! Random clusters (`common`), planned full and then partially: no rule fails validation, the
//! tracer (which refuses what iptables-restore or the kernel would) takes every input, the
//! traced tables are what the planner says it wrote, and with ClusterIPs in two unrelated
//! ranges an unused port of every ClusterIP is rejected while unallocated addresses of either
//! range are left alone. `tests/kernel.rs` feeds the same kind of plans to both real backends.

use std::collections::BTreeSet;

use kp_core::flow::Tracer;
use kp_core::flow::{Origin, Packet, Verdict};
use kp_core::model::{IpFamily, Protocol};
use kp_core::track::{Kind, ObjectKey, SourceEvent};
use kp_iptables_plan::{Planner, Table};
use kp_iptables_test::IptablesTracer;
use proptest::prelude::*;

mod common;

fn from_pod(dst: std::net::IpAddr, protocol: Protocol, dport: u16) -> Packet {
    let src = match IpFamily::of(&dst) {
        IpFamily::V4 => "10.244.1.14",
        IpFamily::V6 => "fd00:10:244:1::14",
    };
    Packet {
        origin: Origin::Pod,
        src: src.parse().unwrap(),
        protocol,
        dst,
        dport,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn generated_clusters_plan_valid_rules_that_reject_unused_clusterip_ports(
        services in prop::collection::vec(common::service(), 1..24),
        setup in common::setup(),
        gone in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        added in prop::collection::vec(common::service(), 0..3),
        step in 1usize..40,
    ) {
        let mut state = kp_flows::load(kp_flows::NODE, common::objects(&services, false));
        let node = setup.node(&state);
        // The lab's links: some setups detect local traffic by interface (`-i`).
        let mut tracer =
            IptablesTracer::new(kp_flows::node_addresses()).with_ingress(kp_flows::ingress());
        let mut planners: Vec<Planner> = IpFamily::ALL
            .into_iter()
            .map(|f| Planner::new(setup.config(f)))
            .collect();
        for p in &mut planners {
            let family = p.config().family;
            let r = p.full(&state, &node);
            prop_assert_eq!(&r.errors, &vec![], "{:?}", family);
            for input in r.steps(step) {
                tracer.apply(family, &input).map_err(|e| TestCaseError::fail(format!("{family:?}: {e}\n{input}")))?;
            }
            tracer.apply(family, &common::jumps(p)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }

        // Every ClusterIP rejects a port none of its Service's ports use; an address of either
        // range that no Service holds (and no ServiceCIDR declares) is left alone.
        for svc in state.service_keys() {
            let ports = state.service_ports(svc);
            let used: BTreeSet<u16> = ports.iter().map(|p| p.port).collect();
            let unused = (1u16..).find(|p| !used.contains(p)).unwrap();
            for vip in ports.iter().flat_map(|p| p.cluster_ips.iter()).collect::<BTreeSet<_>>() {
                let packet = from_pod(*vip, Protocol::Tcp, unused);
                prop_assert_eq!(tracer.trace(&packet), Verdict::Reject, "{}", packet);
            }
        }
        for free in ["10.96.200.200", "192.168.50.255", "fd00:10:96::ffff:ffff", "2001:db8:50::ffff:ffff"] {
            let packet = from_pod(free.parse().unwrap(), Protocol::Tcp, 80);
            prop_assert_eq!(tracer.trace(&packet), Verdict::Untouched, "{}", packet);
        }

        // Some Services go, some come: partial plans, in steps.
        let keys: Vec<_> = state.service_keys().cloned().collect();
        for g in &gone {
            let key = g.get(&keys);
            state.apply(SourceEvent::Delete(Kind::Service, ObjectKey {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
            })).unwrap();
        }
        for (k, s) in added.iter().enumerate() {
            for o in s.objects(services.len() + k) {
                state.apply(SourceEvent::Upsert(o)).unwrap();
            }
        }
        let changes = state.take_changes();
        for p in &mut planners {
            let family = p.config().family;
            let r = p.partial(&state, &changes.services, &node, changes.node_changed);
            prop_assert_eq!(&r.errors, &vec![], "{:?}", family);
            for input in r.steps(step) {
                tracer.apply(family, &input).map_err(|e| TestCaseError::fail(format!("{family:?}: {e}\n{input}")))?;
            }
            for ((table, chain), rules) in p.expected(&state) {
                prop_assert_eq!(tracer.chain(family, table, &chain), Some(rules.as_slice()), "{:?} {:?} {}", family, table, chain);
            }
            let owned = p.expected(&state).keys().filter(|(t, _)| *t == Table::Nat).count();
            prop_assert_eq!(tracer.chain_names(family, Table::Nat).len(), owned + 4);
        }
    }
}
