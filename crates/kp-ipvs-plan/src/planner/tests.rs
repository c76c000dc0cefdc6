use super::*;

use std::sync::Arc;

use kp_core::model::{Endpoint, NodeInfo, Protocol, ServicePort, ServicePortName};
use kp_core::select::select;

use crate::VirtualServer;

/// xorshift64: the same sequence on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];
const NODE: [&str; 2] = ["192.0.2.1", "fd00::1"];

fn node_addresses() -> Vec<IpAddr> {
    NODE.iter().map(|a| ip(a)).collect()
}

fn config() -> Config {
    Config::new("rr", 0, Vec::new()).expect("config")
}

fn endpoint(i: u64, v6: bool, rng: &mut Rng) -> Endpoint {
    Endpoint {
        ip: if v6 {
            ip(&format!("fd00:10:244::{}", i + 1))
        } else {
            ip(&format!("10.244.1.{}", i + 1))
        },
        port: 8080,
        ready: !rng.chance(10),
        serving: true,
        terminating: rng.chance(10),
        is_local: i % 2 == 0,
        zone_hints: None,
    }
}

/// Service `n`'s ports, drawn: one or two, TCP or UDP, IPv4 or IPv6, sometimes with an
/// external IP or a LoadBalancer IP from a pool of two (so Services share them), a NodePort,
/// `Local` policies, source ranges, affinity; endpoints from a pool of five.
fn ports(n: u64, rng: &mut Rng) -> Vec<ServicePortState> {
    let count = 1 + rng.below(2);
    (0..count)
        .map(|p| {
            let v6 = rng.chance(30);
            let protocol = if rng.chance(70) {
                Protocol::Tcp
            } else {
                Protocol::Udp
            };
            let pick = |rng: &mut Rng, v4: &str, v6s: &str| -> Vec<IpAddr> {
                if rng.chance(40) {
                    let i = 1 + rng.below(2);
                    vec![ip(&if v6 {
                        format!("{v6s}{i}")
                    } else {
                        format!("{v4}{i}")
                    })]
                } else {
                    Vec::new()
                }
            };
            let external_ips = pick(rng, "203.0.113.", "2001:db8:1::");
            let load_balancer_ips = pick(rng, "198.51.100.", "2001:db8:2::");
            let port = ServicePort {
                name: ServicePortName {
                    service: ServiceName::new("ns", &format!("svc{n}")),
                    port: format!("p{p}"),
                    protocol,
                },
                cluster_ips: vec![if v6 {
                    ip(&format!("fd00:10:96::{}", n + 1))
                } else {
                    ip(&format!("10.96.0.{}", n + 1))
                }],
                // Ports of one Service differ; ports of Services sharing an address may not.
                port: 80 + p as u16 + rng.below(2) as u16,
                node_port: rng.chance(40).then(|| 30000 + (n * 2 + p) as u16),
                external_ips,
                load_balancer_ips,
                load_balancer_source_ranges: if rng.chance(30) {
                    vec![if v6 {
                        "2001:db8:9::/48".parse().unwrap()
                    } else {
                        "192.0.2.0/24".parse().unwrap()
                    }]
                } else {
                    Vec::new()
                },
                session_affinity_timeout: rng.chance(20).then_some(10800),
                internal_traffic_local: rng.chance(15),
                external_traffic_local: rng.chance(40),
                health_check_node_port: rng.chance(30).then(|| 31000 + n as u16),
            };
            let mut eps = Vec::new();
            for i in 0..5 {
                if rng.chance(50) {
                    eps.push(endpoint(i, v6, rng));
                }
            }
            ServicePortState {
                endpoints: select(&port, &eps, &NodeInfo::default()),
                port: Arc::new(port),
            }
        })
        .collect()
}

/// Every Service planned in one go, in name order: the reference.
fn in_one_go(services: &BTreeMap<ServiceName, Vec<ServicePortState>>) -> (Desired, Vec<Sets>) {
    let mut d = Desired::new();
    let mut sets: Vec<Sets> = FAMILIES.iter().map(|f| Sets::new(*f)).collect();
    let node = NodeContext::default();
    for ports in services.values() {
        for sps in ports {
            for s in sets.iter_mut() {
                let frontends = Frontends::of(sps, s.family());
                d.add(&frontends, &node_addresses(), &config());
                s.add(&frontends, &node_addresses(), &node);
            }
        }
    }
    (d, sets)
}

/// What the kernel would hold after each delta, applied to what it held before.
#[derive(Default)]
struct Kernel {
    virtual_servers: BTreeMap<ServiceKey, VirtualServer>,
    bound: BTreeSet<IpAddr>,
    sets: Vec<BTreeSet<(SetName, Entry)>>,
}

impl Kernel {
    fn apply(&mut self, delta: &Delta, planner: &Planner) {
        for (key, before) in &delta.virtual_servers {
            assert_eq!(
                self.virtual_servers.get(key).map(|v| &v.service),
                before.as_ref(),
                "{key}: the delta's record of what the kernel had"
            );
            match planner.virtual_server(key) {
                Some(vs) => self.virtual_servers.insert(*key, vs.clone()),
                None => self.virtual_servers.remove(key),
            };
        }
        for ip in &delta.bind {
            assert!(self.bound.insert(*ip), "{ip} bound twice");
        }
        for ip in &delta.unbind {
            assert!(self.bound.remove(ip), "{ip} unbound but not bound");
        }
        self.sets.resize(FAMILIES.len(), BTreeSet::new());
        for (i, sets) in self.sets.iter_mut().enumerate() {
            for change in delta.set_changes(i) {
                match change {
                    SetChange::Add(s, e) => assert!(sets.insert((s, e)), "{s:?} {e} added twice"),
                    SetChange::Del(s, e) => assert!(sets.remove(&(s, e)), "{s:?} {e} not there"),
                }
            }
        }
    }
}

/// The planner's whole virtual servers, as a map.
fn whole_of(planner: &Planner) -> BTreeMap<ServiceKey, VirtualServer> {
    planner
        .virtual_servers()
        .map(|(k, v)| (*k, v.clone()))
        .collect()
}

fn entries(sets: &Sets) -> BTreeSet<(SetName, Entry)> {
    SetName::ALL
        .iter()
        .flat_map(|s| sets.get(*s).iter().map(move |e| (*s, e)))
        .collect()
}

#[test]
fn changes_one_service_at_a_time_end_where_a_plan_in_one_go_does_and_deltas_say_exactly_what_moved()
{
    let node = NodeContext::default();
    let mut checked = 0;
    for seed in 1..=40u64 {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
        let mut planner = Planner::new(&FAMILIES);
        let mut services: BTreeMap<ServiceName, Vec<ServicePortState>> = BTreeMap::new();
        let mut kernel = Kernel::default();
        for _ in 0..60 {
            let n = rng.below(8);
            let name = ServiceName::new("ns", &format!("svc{n}"));
            let ports = if rng.chance(25) {
                Vec::new()
            } else {
                ports(n, &mut rng)
            };
            let rules_before = planner.local().all_rules().clone();
            let mut delta = planner.delta();
            planner.set_service(
                &name,
                &ports,
                &node_addresses(),
                &node,
                &config(),
                &mut delta,
            );
            if ports.is_empty() {
                services.remove(&name);
            } else {
                services.insert(name, ports);
            }
            kernel.apply(&delta, &planner);
            assert_eq!(
                delta.local,
                rules_before != *planner.local().all_rules(),
                "the delta says whether the Local rules changed"
            );

            let (whole, sets) = in_one_go(&services);
            let ours = whole_of(&planner);
            assert_eq!(&ours, whole.services(), "seed {seed}");
            assert_eq!(planner.bind_addresses(), whole.bind_addresses());
            assert_eq!(planner.local().all_rules(), whole.local().all_rules());
            assert_eq!(planner.sets(), sets.as_slice());
            // The kernel, changed only by the deltas, holds the whole.
            assert_eq!(kernel.virtual_servers, ours);
            assert_eq!(&kernel.bound, planner.bind_addresses());
            for (i, s) in planner.sets().iter().enumerate() {
                assert_eq!(kernel.sets[i], entries(s));
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 40 * 60);
}

#[test]
fn a_one_endpoint_change_names_only_that_services_virtual_servers() {
    let node = NodeContext::default();
    let mut rng = Rng(7);
    let mut planner = Planner::new(&FAMILIES);
    let mut delta = planner.delta();
    let all: Vec<(ServiceName, Vec<ServicePortState>)> = (0..50)
        .map(|n| {
            let mut p = ports(n, &mut rng);
            // Addresses of their own, so no virtual server is shared.
            for sps in &mut p {
                let port = Arc::make_mut(&mut sps.port);
                port.external_ips.clear();
                port.load_balancer_ips.clear();
            }
            (ServiceName::new("ns", &format!("svc{n}")), p)
        })
        .collect();
    planner.set_all(
        all.iter().map(|(n, p)| (n, p.clone())),
        &node_addresses(),
        &node,
        &config(),
        &mut delta,
    );
    // A full sync's plan is a plan in one go.
    let (whole, sets) = in_one_go(&all.iter().cloned().collect());
    assert_eq!(&whole_of(&planner), whole.services());
    assert_eq!(planner.bind_addresses(), whole.bind_addresses());
    assert_eq!(planner.sets(), sets.as_slice());
    // svc7's first port loses an endpoint, or gains one.
    let (name, mut ports) = all[7].clone();
    {
        let sps = &mut ports[0];
        let mut eps: Vec<Endpoint> = sps.endpoints.cluster.clone();
        if eps.len() > 1 {
            eps.pop();
        } else {
            eps.push(endpoint(4, sps.port.cluster_ips[0].is_ipv6(), &mut Rng(3)));
        }
        sps.endpoints = select(&sps.port, &eps, &NodeInfo::default());
    }
    let sps = ports[0].clone();
    let mut delta = planner.delta();
    planner.set_service(
        &name,
        &ports,
        &node_addresses(),
        &node,
        &config(),
        &mut delta,
    );
    assert!(!delta.virtual_servers.is_empty());
    let cluster_ip = sps.port.cluster_ips[0];
    for key in delta.virtual_servers.keys() {
        let ours = match key {
            ServiceKey::Addr { addr, port, .. } => {
                *addr == cluster_ip
                    || (node_addresses().contains(addr) && Some(*port) == sps.port.node_port)
            }
            ServiceKey::Fwmark { mark, .. } => {
                planner.local().mark_of(&sps.port.name) == Some(*mark)
            }
        };
        assert!(ours, "{key} is not svc7's first port's");
    }
    assert!(delta.bind.is_empty() && delta.unbind.is_empty());
}

#[test]
fn a_mark_stays_with_its_port_while_another_services_port_comes_and_goes() {
    let node = NodeContext::default();
    let mut rng = Rng(11);
    let mut planner = Planner::new(&FAMILIES);
    // Local Services with external IPs and endpoints: each port gets a short-circuit mark.
    let local = |n: u64, rng: &mut Rng| -> Vec<ServicePortState> {
        let mut p = ports(n, rng);
        p.truncate(1);
        let sps = &mut p[0];
        let port = Arc::make_mut(&mut sps.port);
        port.external_traffic_local = true;
        port.external_ips = vec![ip(if port.cluster_ips[0].is_ipv6() {
            "2001:db8:1::1"
        } else {
            "203.0.113.1"
        })];
        let eps: Vec<Endpoint> = (0..4)
            .map(|i| endpoint(i, port.cluster_ips[0].is_ipv6(), rng))
            .collect();
        sps.endpoints = select(&sps.port, &eps, &NodeInfo::default());
        p
    };
    let a = ServiceName::new("ns", "svc1");
    let b = ServiceName::new("ns", "svc2");
    let mut delta = planner.delta();
    let pa = local(1, &mut rng);
    planner.set_service(&a, &pa, &node_addresses(), &node, &config(), &mut delta);
    let name_a = pa[0].port.name.clone();
    let mark_of = |planner: &Planner| planner.local().mark_of(&name_a);
    let before = mark_of(&planner);
    assert!(before.is_some());
    for _ in 0..5 {
        let pb = local(2, &mut rng);
        planner.set_service(&b, &pb, &node_addresses(), &node, &config(), &mut delta);
        planner.set_service(&b, &[], &node_addresses(), &node, &config(), &mut delta);
        assert_eq!(mark_of(&planner), before);
    }
    // Gone with its Service: the whole state no longer holds the port's mark.
    planner.set_service(&a, &[], &node_addresses(), &node, &config(), &mut delta);
    assert_eq!(planner.local().marked().count(), 0);
    assert_eq!(planner.virtual_servers().count(), 0);
}
