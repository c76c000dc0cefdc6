use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use super::*;

#[test]
fn a_thousand_services_hold_the_issues_mix() {
    let m = Cluster::new(1000, 10).mix();
    assert_eq!(
        m,
        Mix {
            services: 1000,
            service_ports: 1000 + 100 + 20,
            endpoints: 10_000,
            node_port: 100,
            load_balancer: 50,
            affinity: 50,
            multi_port: 100,
        }
    );
}

#[test]
fn every_generated_object_is_accepted_and_every_port_is_proxied() {
    let c = Cluster::new(300, 4);
    let state = load_state(c.manifests()).unwrap();
    assert_eq!(state.service_port_count(), c.mix().service_ports);
    assert!(state.ready_to_program());
    let keys: Vec<_> = state.service_keys().cloned().collect();
    assert_eq!(keys.len(), 300);
    for k in &keys {
        for sps in state.service_state(k) {
            assert_eq!(sps.endpoints.cluster.len(), 4, "{k:?} {:?}", sps.port);
        }
    }
}

#[test]
fn node_ports_are_unique_across_the_cluster() {
    let c = Cluster::new(30_000, 1);
    let mut seen = BTreeSet::new();
    for i in 0..c.services {
        let svc = c.service_json(i);
        for p in svc["spec"]["ports"].as_array().unwrap() {
            if let Some(np) = p["nodePort"].as_u64() {
                assert!(seen.insert(np), "nodePort {np} used twice");
                assert!((30000..=65535).contains(&np));
            }
        }
    }
    let m = c.mix();
    assert!(seen.len() >= m.node_port + m.load_balancer);
}

#[test]
fn load_balancers_carry_source_ranges_and_an_ingress_ip() {
    let c = Cluster::new(20, 2);
    let lb = c.service_json(10);
    assert_eq!(lb["spec"]["type"], "LoadBalancer");
    assert_eq!(
        lb["spec"]["loadBalancerSourceRanges"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert!(lb["status"]["loadBalancer"]["ingress"][0]["ip"].is_string());
    assert_eq!(c.service_json(0)["spec"]["type"], "NodePort");
}

#[test]
fn each_change_replaces_exactly_one_endpoint_even_when_a_service_repeats() {
    // 5 Services and 40 changes: every Service is changed several times.
    let c = Cluster::new(5, 3);
    let mut stream = ChangeStream::new(&c);
    let mut current: Vec<BTreeSet<String>> = (0..5)
        .map(|i| {
            c.initial_endpoints(i)
                .iter()
                .map(|a| a.to_string())
                .collect()
        })
        .collect();
    for _ in 0..40 {
        let ch = stream.next_change();
        let after: BTreeSet<String> = ch.slice["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["addresses"][0].as_str().unwrap().to_string())
            .collect();
        let before = &current[ch.service];
        assert_eq!(
            before.difference(&after).cloned().collect::<Vec<_>>(),
            vec![ch.old.to_string()]
        );
        assert_eq!(
            after.difference(before).cloned().collect::<Vec<_>>(),
            vec![ch.new.to_string()]
        );
        assert_eq!(stream.endpoints(ch.service).len(), 3);
        current[ch.service] = after;
    }
}

#[test]
fn the_datapath_service_is_outside_the_generated_range() {
    let c = Cluster::new(10, 1);
    assert_eq!(c.datapath_ip(), cluster_ip(10));
    let [svc, slice] = c.datapath_json(Ipv4Addr::new(10, 244, 1, 10));
    let state = load_state(c.manifests().chain([svc, slice])).unwrap();
    assert_eq!(state.service_keys().count(), 11);
}
