use super::*;

use std::collections::BTreeSet;

use kp_core::model::{Endpoint, NodeInfo, ServiceKey as K8sKey, ServicePort, ServicePortName};
use kp_core::select::{select, SelectedEndpoints};
use kp_netlink::ipvs::Forward;

// ClusterIP 10.96.0.1, external IP 203.0.113.10, LoadBalancer IP 198.51.100.10, NodePort
// 30080 on the node's 192.0.2.1 (and fd00::1, of the other family); endpoints 10.244.1.5 (this
// node), 10.244.2.5 and 10.244.2.6 (another).

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn port(protocol: CoreProtocol) -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: K8sKey::new("web", "api"),
            port: "http".into(),
            protocol,
        },
        cluster_ips: vec![ip("10.96.0.1")],
        port: 80,
        node_port: Some(30080),
        external_ips: vec![ip("203.0.113.10")],
        load_balancer_ips: vec![ip("198.51.100.10")],
        load_balancer_source_ranges: Vec::new(),
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: false,
        health_check_node_port: None,
    }
}

fn ep(addr: &str, local: bool) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        is_local: local,
        zone_hints: None::<BTreeSet<String>>,
    }
}

fn endpoints() -> Vec<Endpoint> {
    vec![
        ep("10.244.1.5", true),
        ep("10.244.2.5", false),
        ep("10.244.2.6", false),
    ]
}

fn selected(port: &ServicePort, eps: &[Endpoint]) -> SelectedEndpoints {
    select(port, eps, &NodeInfo::default())
}

const NODE: [&str; 2] = ["192.0.2.1", "fd00::1"];

fn rr() -> Config {
    Config::new("rr", 0, Vec::new()).expect("config")
}

fn desired(port: &ServicePort, eps: &[Endpoint], config: &Config) -> Desired {
    let sel = selected(port, eps);
    let mut d = Desired::new();
    let node: Vec<IpAddr> = NODE.iter().map(|a| ip(a)).collect();
    d.add(&Frontends::new(port, &sel, IpFamily::V4), &node, config);
    d
}

fn key(addr: &str, port: u16, protocol: Protocol) -> ServiceKey {
    ServiceKey::Addr {
        addr: ip(addr),
        protocol,
        port,
    }
}

fn tcp(addr: &str, port: u16) -> ServiceKey {
    key(addr, port, Protocol::Tcp)
}

/// The kernel in memory: applies changes as IPVS does, refusing what it refuses (a
/// destination of a missing service, a duplicate, a missing one), so a plan in the wrong order
/// fails here.
#[derive(Debug, Default, Clone)]
struct Kernel(BTreeMap<ServiceKey, (Service, Vec<DestinationState>)>);

impl Kernel {
    fn apply(&mut self, changes: &[Change]) {
        for c in changes {
            match c {
                Change::AddService(s) => {
                    assert!(
                        self.0.insert(s.key, (s.clone(), Vec::new())).is_none(),
                        "EEXIST {c:?}"
                    )
                }
                Change::UpdateService(s) => {
                    self.0.get_mut(&s.key).expect("ESRCH").0 = s.clone();
                }
                Change::DeleteService(k) => {
                    self.0.remove(k).expect("ESRCH");
                }
                Change::AddDestination(k, d) => {
                    let dests = &mut self.0.get_mut(k).expect("ESRCH").1;
                    assert!(
                        !dests
                            .iter()
                            .any(|s| (s.destination.addr, s.destination.port) == (d.addr, d.port)),
                        "EEXIST {c:?}"
                    );
                    dests.push(DestinationState {
                        destination: *d,
                        active_connections: 0,
                        inactive_connections: 0,
                        persistent_connections: 0,
                    });
                }
                Change::UpdateDestination(k, d) => {
                    let dests = &mut self.0.get_mut(k).expect("ESRCH").1;
                    let s = dests
                        .iter_mut()
                        .find(|s| (s.destination.addr, s.destination.port) == (d.addr, d.port))
                        .expect("ENOENT");
                    s.destination = *d;
                }
                Change::DeleteDestination(k, addr, port) => {
                    let dests = &mut self.0.get_mut(k).expect("ESRCH").1;
                    let before = dests.len();
                    dests.retain(|s| (s.destination.addr, s.destination.port) != (*addr, *port));
                    assert_eq!(dests.len() + 1, before, "ENOENT {c:?}");
                }
            }
        }
    }

    fn dump(&self) -> Vec<(Service, Vec<DestinationState>)> {
        self.0.values().cloned().collect()
    }

    fn connections(&mut self, k: &ServiceKey, addr: &str, active: u32, inactive: u32) {
        let dests = &mut self.0.get_mut(k).expect("service").1;
        let s = dests
            .iter_mut()
            .find(|s| s.destination.addr == ip(addr))
            .expect("destination");
        s.active_connections = active;
        s.inactive_connections = inactive;
    }
}

/// Applies the plan to `kernel` and checks that a second diff has nothing left to do (but
/// draining).
fn converge(want: &Desired, kernel: &mut Kernel, config: &Config) -> Plan {
    let plan = diff(want, &kernel.dump(), config);
    kernel.apply(&plan.changes);
    let again = diff(want, &kernel.dump(), config);
    assert_eq!(again.changes, Vec::new(), "not converged after {plan:?}");
    plan
}

#[test]
fn every_frontend_gets_a_virtual_server_and_the_nodeport_one_per_node_address_of_its_family() {
    let config = rr();
    let d = desired(&port(CoreProtocol::Tcp), &endpoints(), &config);
    let keys: Vec<ServiceKey> = d.services().keys().copied().collect();
    let mut want = vec![
        tcp("10.96.0.1", 80),
        tcp("203.0.113.10", 80),
        tcp("198.51.100.10", 80),
        tcp("192.0.2.1", 30080),
    ];
    want.sort();
    assert_eq!(keys, want);
    let bound: Vec<IpAddr> = d.bind_addresses().iter().copied().collect();
    assert_eq!(
        bound,
        [ip("10.96.0.1"), ip("198.51.100.10"), ip("203.0.113.10")],
        "the node's own address is not bound to kube-ipvs0"
    );
    for vs in d.services().values() {
        assert_eq!(vs.service.scheduler, "rr");
        assert_eq!(vs.service.flags, 0);
        let reals: Vec<_> = vs.destinations.values().collect();
        assert_eq!(reals.len(), 3, "{:?}", vs.service.key);
        assert!(reals
            .iter()
            .all(|r| r.forward == Forward::Masquerade && r.weight == 1));
    }
}

#[test]
fn client_ip_affinity_makes_a_persistent_virtual_server_with_the_service_s_timeout() {
    let mut p = port(CoreProtocol::Tcp);
    p.session_affinity_timeout = Some(10800);
    let config = Config::new(
        "sh",
        abi::IP_VS_SVC_F_SCHED_SH_PORT | abi::IP_VS_SVC_F_HASHED,
        Vec::new(),
    )
    .expect("config");
    let d = desired(&p, &endpoints(), &config);
    let vs = &d.services()[&tcp("10.96.0.1", 80)];
    assert_eq!(vs.service.scheduler, "sh");
    // Only scheduler flags are taken from the configuration.
    assert_eq!(
        vs.service.flags,
        abi::IP_VS_SVC_F_PERSISTENT | abi::IP_VS_SVC_F_SCHED_SH_PORT
    );
    assert_eq!(vs.service.timeout, 10800);
}

#[test]
fn external_traffic_policy_local_leaves_external_virtual_servers_only_this_node_s_endpoints() {
    let mut p = port(CoreProtocol::Tcp);
    p.external_traffic_local = true;
    let d = desired(&p, &endpoints(), &rr());
    let reals = |k: ServiceKey| -> Vec<IpAddr> {
        d.services()[&k]
            .destinations
            .keys()
            .map(|(a, _)| a)
            .collect()
    };
    assert_eq!(reals(tcp("10.96.0.1", 80)).len(), 3);
    assert_eq!(reals(tcp("192.0.2.1", 30080)), [ip("10.244.1.5")]);
    assert_eq!(reals(tcp("203.0.113.10", 80)), [ip("10.244.1.5")]);
}

#[test]
fn external_traffic_policy_local_short_circuits_pods_and_the_node_through_a_fwmark_virtual_server()
{
    let mut p = port(CoreProtocol::Tcp);
    p.external_traffic_local = true;
    let config = rr();
    let d = desired(&p, &endpoints(), &config);
    let fwmarks: Vec<(&ServiceKey, &VirtualServer)> = d
        .services()
        .iter()
        .filter(|(k, _)| matches!(k, ServiceKey::Fwmark { .. }))
        .collect();
    assert_eq!(fwmarks.len(), 1, "one per Service port and family");
    let (k, vs) = fwmarks[0];
    let ServiceKey::Fwmark { mark, ipv6 } = *k else {
        unreachable!()
    };
    assert!(!ipv6);
    assert!(local::is_short_circuit_mark(mark));
    // The cluster-wide endpoints.
    assert_eq!(vs.destinations.len(), 3);
    // Every external address (the NodePort on the node's IPv4 address) is marked for it; none
    // is dropped, as this node has an endpoint.
    let rules: Vec<&local::LocalRule> = d.local().rules(IpFamily::V4).collect();
    let addrs: Vec<(IpAddr, u16)> = rules.iter().map(|r| (r.address, r.port)).collect();
    assert_eq!(
        addrs,
        [
            (ip("192.0.2.1"), 30080),
            (ip("198.51.100.10"), 80),
            (ip("203.0.113.10"), 80)
        ]
    );
    assert!(rules.iter().all(|r| r.mark == Some(mark) && !r.drop));
    // The kernel takes it and converges; the next diff leaves the fwmark server alone.
    let mut kernel = Kernel::default();
    converge(&d, &mut kernel, &config);
    assert!(kernel.0.contains_key(k));
    // The Service turns Cluster: the fwmark virtual server is ours to delete.
    let plan = converge(
        &desired(&port(CoreProtocol::Tcp), &endpoints(), &config),
        &mut kernel,
        &config,
    );
    assert!(
        plan.changes.contains(&Change::DeleteService(*k)),
        "{:?}",
        plan.changes
    );
}

#[test]
fn local_policies_without_local_endpoints_drop_what_is_not_short_circuited() {
    let remote = vec![ep("10.244.2.5", false), ep("10.244.2.6", false)];
    let mut p = port(CoreProtocol::Tcp);
    p.external_traffic_local = true;
    let d = desired(&p, &remote, &rr());
    let rules: Vec<&local::LocalRule> = d.local().rules(IpFamily::V4).collect();
    assert_eq!(rules.len(), 3);
    assert!(
        rules.iter().all(|r| r.drop && r.mark.is_some()),
        "{rules:?}"
    );
    // internalTrafficPolicy Local: the ClusterIP is dropped for everyone (no short-circuit).
    let mut p = port(CoreProtocol::Tcp);
    p.internal_traffic_local = true;
    let d = desired(&p, &remote, &rr());
    let rules: Vec<&local::LocalRule> = d.local().rules(IpFamily::V4).collect();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].address, ip("10.96.0.1"));
    assert!(rules[0].drop && rules[0].mark.is_none());
    // No endpoints anywhere is a rejection (the empty virtual server), not a drop.
    let d = desired(&p, &[], &rr());
    assert_eq!(d.local().rules(IpFamily::V4).count(), 0);
}

#[test]
fn a_new_service_is_added_before_its_real_servers_and_the_kernel_converges() {
    let config = rr();
    let d = desired(&port(CoreProtocol::Tcp), &endpoints(), &config);
    let mut kernel = Kernel::default();
    let plan = converge(&d, &mut kernel, &config);
    assert_eq!(plan.changes.len(), 4 + 4 * 3);
    assert!(plan.draining.is_empty());
    assert_eq!(kernel.0.len(), 4);
}

#[test]
fn one_endpoint_change_is_one_add_and_one_delete_per_virtual_server_for_udp() {
    let config = rr();
    let p = port(CoreProtocol::Udp);
    let mut kernel = Kernel::default();
    converge(&desired(&p, &endpoints(), &config), &mut kernel, &config);
    // 10.244.2.6 replaced by 10.244.2.7; the old one still has UDP flows: deleted anyway.
    for k in kernel.0.keys().copied().collect::<Vec<_>>() {
        kernel.connections(&k, "10.244.2.6", 0, 4);
    }
    let mut eps = endpoints();
    eps[2] = ep("10.244.2.7", false);
    let plan = converge(&desired(&p, &eps, &config), &mut kernel, &config);
    let k = key("10.96.0.1", 80, Protocol::Udp);
    let for_cluster_ip: Vec<&Change> = plan
        .changes
        .iter()
        .filter(|c| matches!(c, Change::AddDestination(s, _) | Change::DeleteDestination(s, ..) if *s == k))
        .collect();
    assert_eq!(
        for_cluster_ip,
        [
            &Change::AddDestination(k, Destination::masquerade(ip("10.244.2.7"), 8080, 1)),
            &Change::DeleteDestination(k, ip("10.244.2.6"), 8080),
        ]
    );
    assert_eq!(plan.changes.len(), 2 * 4);
    assert!(plan.draining.is_empty());
}

#[test]
fn a_removed_tcp_real_server_drains_at_weight_zero_and_goes_when_its_connections_end() {
    let config = rr();
    let p = port(CoreProtocol::Tcp);
    let mut kernel = Kernel::default();
    converge(&desired(&p, &endpoints(), &config), &mut kernel, &config);
    let k = tcp("10.96.0.1", 80);
    kernel.connections(&k, "10.244.2.6", 1, 2);
    let fewer = desired(&p, &endpoints()[..2], &config);

    // First: weight 0 where connections remain, deleted where none.
    let plan = diff(&fewer, &kernel.dump(), &config);
    let draining = Destination::masquerade(ip("10.244.2.6"), 8080, 0);
    assert!(plan
        .changes
        .contains(&Change::UpdateDestination(k, draining)));
    assert!(plan.changes.contains(&Change::DeleteDestination(
        tcp("192.0.2.1", 30080),
        ip("10.244.2.6"),
        8080
    )));
    assert_eq!(
        plan.draining,
        [Draining {
            service: k,
            addr: ip("10.244.2.6"),
            port: 8080,
            connections: 3
        }]
    );
    kernel.apply(&plan.changes);

    // While connections last, nothing more to do, still draining.
    let plan = diff(&fewer, &kernel.dump(), &config);
    assert_eq!(plan.changes, []);
    assert_eq!(plan.draining.len(), 1);

    // Connections ended: deleted.
    kernel.connections(&k, "10.244.2.6", 0, 0);
    let plan = diff(&fewer, &kernel.dump(), &config);
    assert_eq!(
        plan.changes,
        [Change::DeleteDestination(k, ip("10.244.2.6"), 8080)]
    );
    assert!(plan.draining.is_empty());
}

#[test]
fn a_draining_real_server_that_comes_back_gets_its_weight_again() {
    let config = rr();
    let p = port(CoreProtocol::Sctp);
    let mut kernel = Kernel::default();
    converge(&desired(&p, &endpoints(), &config), &mut kernel, &config);
    let k = key("10.96.0.1", 80, Protocol::Sctp);
    kernel.connections(&k, "10.244.2.6", 1, 0);
    let plan = diff(
        &desired(&p, &endpoints()[..2], &config),
        &kernel.dump(),
        &config,
    );
    kernel.apply(&plan.changes);
    assert_eq!(plan.draining.len(), 1, "SCTP drains as TCP does");

    // Where it drained, its weight comes back; where it had no connections, it was deleted
    // and is added again.
    let back = converge(&desired(&p, &endpoints(), &config), &mut kernel, &config);
    let returned = Destination::masquerade(ip("10.244.2.6"), 8080, 1);
    assert_eq!(back.changes[0], Change::UpdateDestination(k, returned));
    assert_eq!(back.changes.len(), 4);
    assert!(back.changes[1..]
        .iter()
        .all(|c| matches!(c, Change::AddDestination(s, d) if *s != k && *d == returned)));
}

#[test]
fn a_changed_scheduler_updates_the_virtual_servers_in_place() {
    let p = port(CoreProtocol::Tcp);
    let mut kernel = Kernel::default();
    converge(&desired(&p, &endpoints(), &rr()), &mut kernel, &rr());
    let lc = Config::new("lc", 0, Vec::new()).expect("config");
    let plan = converge(&desired(&p, &endpoints(), &lc), &mut kernel, &lc);
    assert_eq!(plan.changes.len(), 4);
    assert!(plan
        .changes
        .iter()
        .all(|c| matches!(c, Change::UpdateService(s) if s.scheduler == "lc")));
}

#[test]
fn stale_virtual_servers_are_deleted_but_excluded_and_fwmark_ones_are_left_alone() {
    let exclude = vec!["172.16.0.0/12".parse().expect("net")];
    let config = Config::new("rr", 0, exclude).expect("config");
    let mut kernel = Kernel::default();
    kernel.apply(&[
        Change::AddService(Service::new(tcp("10.96.0.99", 443), "rr")),
        Change::AddDestination(
            tcp("10.96.0.99", 443),
            Destination::masquerade(ip("10.244.9.9"), 8443, 1),
        ),
        Change::AddService(Service::new(tcp("172.16.5.5", 80), "wlc")),
        Change::AddService(Service::new(
            ServiceKey::Fwmark {
                mark: 7,
                ipv6: false,
            },
            "rr",
        )),
    ]);
    let plan = converge(
        &desired(&port(CoreProtocol::Tcp), &endpoints(), &config),
        &mut kernel,
        &config,
    );
    let deleted: Vec<&Change> = plan
        .changes
        .iter()
        .filter(|c| matches!(c, Change::DeleteService(_)))
        .collect();
    assert_eq!(deleted, [&Change::DeleteService(tcp("10.96.0.99", 443))]);
    assert!(kernel.0.contains_key(&tcp("172.16.5.5", 80)));
    assert_eq!(kernel.0.len(), 4 + 2);
}

#[test]
fn a_port_without_endpoints_keeps_its_virtual_servers_empty() {
    let config = rr();
    let d = desired(&port(CoreProtocol::Tcp), &[], &config);
    assert_eq!(d.services().len(), 4);
    assert!(d.services().values().all(|vs| vs.destinations.is_empty()));
}

#[test]
fn scheduler_names_the_kernel_cannot_take_are_refused() {
    for bad in ["", "round-robin", "averyveryverylongname", "r r"] {
        assert_eq!(
            Config::new(bad, 0, Vec::new()),
            Err(Error::Scheduler(bad.to_string()))
        );
    }
    assert!(Config::new("lblcr", 0, Vec::new()).is_ok());
}

#[test]
fn real_servers_are_sorted_one_per_address_and_port_the_last_given_kept() {
    let draining = Destination::masquerade(ip("10.0.0.2"), 80, 0);
    let tunnel = Destination {
        forward: Forward::Tunnel,
        ..Destination::masquerade(ip("10.0.0.3"), 80, 1)
    };
    let given = [
        Destination::masquerade(ip("fd00::1"), 80, 1),
        Destination::masquerade(ip("10.0.0.2"), 80, 1),
        Destination::masquerade(ip("10.0.0.1"), 81, 1),
        tunnel,
        draining,
        Destination::masquerade(ip("10.0.0.4"), 80, 1),
        Destination::masquerade(ip("10.0.0.1"), 81, 1),
        Destination::masquerade(ip("10.0.0.1"), 80, 1),
    ];
    let reals: Reals = given.into_iter().collect();
    // Packed (the planner's kind at an IPv4 address) and plain ones interleave in order; of
    // 10.0.0.2:80 the last given (draining) is kept.
    let want = [
        Destination::masquerade(ip("10.0.0.1"), 80, 1),
        Destination::masquerade(ip("10.0.0.1"), 81, 1),
        draining,
        tunnel,
        Destination::masquerade(ip("10.0.0.4"), 80, 1),
        Destination::masquerade(ip("fd00::1"), 80, 1),
    ];
    assert_eq!(reals.values().collect::<Vec<_>>(), want);
    assert_eq!(
        reals.keys().collect::<Vec<_>>(),
        want.iter().map(|d| (d.addr, d.port)).collect::<Vec<_>>()
    );
    for d in want {
        assert_eq!(reals.get(&(d.addr, d.port)), Some(d), "{d:?}");
    }
    assert!(!reals.contains_key(&(ip("10.0.0.1"), 82)));
    assert!(!reals.contains_key(&(ip("fd00::2"), 80)));
    assert_eq!(reals.len(), 6);
    assert_eq!(format!("{reals:?}").matches("addr").count(), 6);
    let again: Reals = want.into_iter().rev().collect();
    assert_eq!(again, reals, "one form whatever the order given");
}

#[test]
fn whole_virtual_server_deletions_are_split_off_and_the_rest_keep_their_order() {
    let config = rr();
    let mut kernel = Kernel::default();
    // A stale virtual server beside the wanted ones, and a stale real server of a wanted one.
    let web = tcp("10.96.0.1", 80);
    kernel.apply(&[
        Change::AddService(Service::new(tcp("10.96.0.99", 443), "rr")),
        Change::AddService(Service::new(web, "rr")),
        Change::AddDestination(web, Destination::masquerade(ip("10.244.9.9"), 8080, 1)),
    ]);
    let d = desired(&port(CoreProtocol::Tcp), &endpoints(), &config);
    let mut plan = diff(&d, &kernel.dump(), &config);
    let before = plan.changes.clone();
    let deletions = plan.split_off_deletions();
    assert_eq!(deletions, [Change::DeleteService(tcp("10.96.0.99", 443))]);
    assert!(!plan
        .changes
        .iter()
        .any(|c| matches!(c, Change::DeleteService(_))));
    let kept: Vec<&Change> = before
        .iter()
        .filter(|c| !matches!(c, Change::DeleteService(_)))
        .collect();
    assert_eq!(plan.changes.iter().collect::<Vec<_>>(), kept);
    // The stale real server of the kept virtual server goes with the first part (it had no
    // connections), as do the additions.
    assert!(plan
        .changes
        .iter()
        .any(|c| matches!(c, Change::DeleteDestination(k, _, 8080) if *k == web)));
    assert!(plan
        .changes
        .iter()
        .any(|c| matches!(c, Change::AddService(_))));
    // Applied in two goes, the kernel ends where one go takes it.
    kernel.apply(&plan.changes);
    kernel.apply(&deletions);
    assert!(diff(&d, &kernel.dump(), &config).changes.is_empty());
}
