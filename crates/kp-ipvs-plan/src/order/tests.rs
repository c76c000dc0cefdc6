use super::*;

use std::collections::{BTreeMap, BTreeSet};

use kp_core::frontend::Frontends;
use kp_core::model::{
    Endpoint, NodeInfo, Protocol as CoreProtocol, ServiceKey as K8sKey, ServicePort,
    ServicePortName,
};
use kp_core::node::NodeContext;
use kp_core::select::select;
use kp_netlink::ipvs::{Destination, DestinationState, Protocol, Service, ServiceKey};

use crate::addresses;
use crate::ipset::{self, Entry, SetName, Sets};
use crate::{diff, Config, Desired};

// The web Service: ClusterIP 10.96.0.10:80/TCP, NodePort 30080 on the node's 192.0.2.1,
// endpoints 10.244.1.5 and 10.244.2.5 (port 8080).

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

const CLUSTER_IP: &str = "10.96.0.10";
const NODE_IP: &str = "192.0.2.1";

fn web() -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: K8sKey::new("default", "web"),
            port: "http".into(),
            protocol: CoreProtocol::Tcp,
        },
        cluster_ips: vec![ip(CLUSTER_IP)],
        port: 80,
        node_port: Some(30080),
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        load_balancer_source_ranges: Vec::new(),
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: false,
        health_check_node_port: None,
    }
}

fn endpoint(addr: &str) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        is_local: false,
        zone_hints: None,
    }
}

/// The virtual servers and sets of the web Service (`with_web`) or of nothing.
fn plan(with_web: bool) -> (Desired, Sets) {
    let config = Config::new("rr", 0, Vec::new()).expect("config");
    let mut desired = Desired::new();
    let mut sets = Sets::new(IpFamily::V4);
    if with_web {
        let port = web();
        let eps = vec![endpoint("10.244.1.5"), endpoint("10.244.2.5")];
        let sel = select(&port, &eps, &NodeInfo::default());
        let frontends = Frontends::new(&port, &sel, IpFamily::V4);
        let node = [ip(NODE_IP)];
        desired.add(&frontends, &node, &config);
        sets.add(&frontends, &node, &NodeContext::default());
    }
    (desired, sets)
}

/// What a new TCP connection meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Answered by an endpoint (DNAT by the iptables mode's leftover rules, or IPVS).
    Served,
    /// Sent on by routing, out of the node: the address is not local and not known as a
    /// Service address.
    RoutedOut,
    /// Dropped as traffic to an unallocated ClusterIP (not in `KUBE-IPVS-IPS`).
    Dropped,
    /// Reset by the node's TCP stack: the address is local but no virtual server (or none
    /// with a real server of non-zero weight) takes the connection.
    Refused,
}

/// A node as the packets see it (one family), changed step by step.
#[derive(Debug, Clone, Default)]
struct Node {
    /// The iptables mode's rules in the shared `KUBE-SERVICES` (a switch): they DNAT every
    /// frontend before routing, until this mode restores its chains.
    leftover_dnat: bool,
    /// This mode's chains restored.
    rules: bool,
    /// IPVS: each virtual server's real servers and their weights.
    ipvs: BTreeMap<ServiceKey, BTreeMap<(IpAddr, u16), u32>>,
    /// `KUBE-IPVS-IPS`.
    ipvs_ips: BTreeSet<IpAddr>,
    /// Every element of every set, for the diff of the next sync.
    sets: BTreeMap<SetName, BTreeSet<Entry>>,
    /// `kube-ipvs0`'s addresses.
    bound: BTreeSet<IpAddr>,
}

impl Node {
    fn apply(&mut self, step: &Step) {
        match step {
            Step::Ipvs(changes) => {
                for c in changes {
                    match c {
                        Change::AddService(s) => {
                            assert!(self.ipvs.insert(s.key, BTreeMap::new()).is_none());
                        }
                        Change::UpdateService(_) => {}
                        Change::DeleteService(k) => {
                            self.ipvs.remove(k).expect("ESRCH");
                        }
                        Change::AddDestination(k, d) | Change::UpdateDestination(k, d) => {
                            self.ipvs
                                .get_mut(k)
                                .expect("ESRCH")
                                .insert((d.addr, d.port), d.weight);
                        }
                        Change::DeleteDestination(k, a, p) => {
                            self.ipvs
                                .get_mut(k)
                                .expect("ESRCH")
                                .remove(&(*a, *p))
                                .expect("ENOENT");
                        }
                    }
                }
            }
            Step::Sets { changes, .. } => {
                for c in changes {
                    match c {
                        ipset::SetChange::Add(set, e) => {
                            self.sets.entry(*set).or_default().insert(*e);
                        }
                        ipset::SetChange::Del(set, e) => {
                            self.sets.entry(*set).or_default().remove(e);
                        }
                    }
                }
                self.ipvs_ips = self
                    .sets
                    .get(&SetName::IpvsIps)
                    .into_iter()
                    .flatten()
                    .filter_map(|e| match e {
                        Entry::Ip(ip) => Some(*ip),
                        _ => None,
                    })
                    .collect();
            }
            Step::Bind(ip) => {
                self.bound.insert(*ip);
            }
            Step::Rules { .. } => {
                self.rules = true;
                self.leftover_dnat = false;
            }
            Step::Unbind(ip) => {
                self.bound.remove(ip);
            }
        }
    }

    /// A new connection to `addr:port`; `service_address` says whether the address is a
    /// Service's own (bound to `kube-ipvs0`) rather than the node's.
    fn connect(&self, addr: &str, port: u16, service_address: bool) -> Fate {
        let addr = ip(addr);
        if self.leftover_dnat {
            return Fate::Served;
        }
        if service_address && !self.bound.contains(&addr) {
            return if self.ipvs_ips.contains(&addr) || !self.rules {
                Fate::RoutedOut
            } else {
                Fate::Dropped
            };
        }
        let key = ServiceKey::Addr {
            addr,
            protocol: Protocol::Tcp,
            port,
        };
        match self.ipvs.get(&key) {
            Some(reals) if reals.values().any(|w| *w > 0) => Fate::Served,
            _ => Fate::Refused,
        }
    }

    /// The web Service's ClusterIP and NodePort.
    fn fates(&self) -> [Fate; 2] {
        [
            self.connect(CLUSTER_IP, 80, true),
            self.connect(NODE_IP, 30080, false),
        ]
    }

    /// The kernel's IPVS as a dump.
    fn dump(&self) -> Vec<(Service, Vec<DestinationState>)> {
        self.ipvs
            .iter()
            .map(|(k, reals)| {
                let dests = reals
                    .iter()
                    .map(|((a, p), w)| DestinationState {
                        destination: Destination::masquerade(*a, *p, *w),
                        active_connections: 0,
                        inactive_connections: 0,
                        persistent_connections: 0,
                    })
                    .collect();
                (Service::new(*k, "rr"), dests)
            })
            .collect()
    }

    fn current_sets(&self) -> Sets {
        let mut s = Sets::new(IpFamily::V4);
        for (set, entries) in &self.sets {
            for e in entries {
                s.insert(*set, *e);
            }
        }
        s
    }
}

/// What a sync towards `desired`/`sets` changes on `node` (the rules restored as on a full
/// sync).
fn sync_changes(node: &Node, desired: &Desired, sets: &Sets) -> SyncChanges {
    let config = Config::new("rr", 0, Vec::new()).expect("config");
    SyncChanges {
        ipvs: diff(desired, &node.dump(), &config).changes,
        sets: vec![(IpFamily::V4, ipset::diff(sets, &node.current_sets()))],
        addresses: addresses::diff(desired.bind_addresses(), &node.bound),
        rules: vec![(IpFamily::V4, "*nat\nCOMMIT\n".to_string())],
    }
}

/// Applies `steps` to `node`, the fates of the web Service's frontends after each.
fn walk(node: &mut Node, steps: &[Step]) -> Vec<(String, [Fate; 2])> {
    let mut out = vec![("before".to_string(), node.fates())];
    for s in steps {
        node.apply(s);
        out.push((format!("{s:?}"), node.fates()));
    }
    out
}

/// The order before this module: addresses bound, sets, rules, all IPVS changes, addresses
/// unbound.
fn old_order(c: SyncChanges) -> Vec<Step> {
    let mut out: Vec<Step> = c.addresses.bind.iter().map(|a| Step::Bind(*a)).collect();
    for (family, changes) in c.sets {
        out.push(Step::Sets { family, changes });
    }
    for (family, text) in c.rules {
        out.push(Step::Rules { family, text });
    }
    out.push(Step::Ipvs(c.ipvs));
    out.extend(c.addresses.unbind.iter().map(|a| Step::Unbind(*a)));
    out
}

/// IPVS, sets, rules, then addresses.
fn rules_before_addresses(c: SyncChanges) -> Vec<Step> {
    let mut out = vec![Step::Ipvs(c.ipvs)];
    for (family, changes) in c.sets {
        out.push(Step::Sets { family, changes });
    }
    for (family, text) in c.rules {
        out.push(Step::Rules { family, text });
    }
    out.extend(c.addresses.bind.iter().map(|a| Step::Bind(*a)));
    out
}

/// The node just after a switch from the iptables mode: its rules DNAT the web Service, this
/// mode has nothing yet.
fn switched_from_iptables() -> Node {
    Node {
        leftover_dnat: true,
        ..Node::default()
    }
}

#[test]
fn a_switch_from_the_iptables_mode_serves_every_new_connection_at_every_step() {
    let (desired, sets) = plan(true);
    let mut node = switched_from_iptables();
    let steps = steps(sync_changes(&node, &desired, &sets));
    let fates = walk(&mut node, &steps);
    for (step, f) in &fates {
        assert_eq!(*f, [Fate::Served; 2], "after {step}:\n{fates:#?}");
    }
    // And it is IPVS that serves at the end, with nothing left to change.
    assert!(node.rules && !node.leftover_dnat);
    assert!(node.bound.contains(&ip(CLUSTER_IP)));
    let again = sync_changes(&node, &desired, &sets);
    assert!(again.ipvs.is_empty() && again.sets[0].1.is_empty());
    assert!(again.addresses.is_empty());
}

#[test]
fn the_orders_this_one_replaces_lose_connections_in_the_model() {
    // The model can tell: the order the mode had (rules before IPVS) refuses both frontends
    // between the restore and the IPVS changes; rules before addresses send the ClusterIP's
    // packets out of the node until its address is bound.
    let (desired, sets) = plan(true);
    let node = switched_from_iptables();
    let old = walk(
        &mut node.clone(),
        &old_order(sync_changes(&node, &desired, &sets)),
    );
    assert!(
        old.iter().any(|(_, f)| *f == [Fate::Refused; 2]),
        "{old:#?}"
    );
    let late = walk(
        &mut node.clone(),
        &rules_before_addresses(sync_changes(&node, &desired, &sets)),
    );
    assert!(
        late.iter().any(|(_, f)| f[0] == Fate::RoutedOut),
        "{late:#?}"
    );
}

#[test]
fn a_removed_service_is_served_until_its_address_goes_then_dropped_never_routed_out() {
    let (desired, sets) = plan(true);
    let mut node = Node::default();
    let steps_in = steps(sync_changes(&node, &desired, &sets));
    walk(&mut node, &steps_in);
    assert_eq!(node.fates(), [Fate::Served; 2]);
    let (nothing, no_sets) = plan(false);
    let steps_out = steps(sync_changes(&node, &nothing, &no_sets));
    let fates = walk(&mut node, &steps_out);
    // The ClusterIP: served, then dropped (an unallocated ClusterIP), never sent out of the
    // node nor reset while something of the Service is left; served again never.
    let cluster: Vec<Fate> = fates.iter().map(|(_, f)| f[0]).collect();
    let served = cluster.iter().take_while(|f| **f == Fate::Served).count();
    assert!(served >= 2, "{fates:#?}");
    assert!(
        cluster[served..].iter().all(|f| *f == Fate::Dropped),
        "{fates:#?}"
    );
    // The NodePort is served until its virtual server goes, last.
    let node_port: Vec<Fate> = fates.iter().map(|(_, f)| f[1]).collect();
    let (last, before) = node_port.split_last().unwrap();
    assert!(before.iter().all(|f| *f == Fate::Served), "{fates:#?}");
    assert_eq!(*last, Fate::Refused);
    assert!(node.ipvs.is_empty() && node.bound.is_empty() && node.ipvs_ips.is_empty());
}

#[test]
fn steps_go_ipvs_sets_binds_rules_unbinds_then_virtual_server_deletions() {
    let svc = |a: &str| ServiceKey::Addr {
        addr: ip(a),
        protocol: Protocol::Tcp,
        port: 80,
    };
    let real = Destination::masquerade(ip("10.244.1.5"), 8080, 1);
    let add = Change::AddService(Service::new(svc("10.96.0.10"), "rr"));
    let add_real = Change::AddDestination(svc("10.96.0.10"), real);
    let drain = Change::UpdateDestination(svc("10.96.0.11"), Destination { weight: 0, ..real });
    let gone_real = Change::DeleteDestination(svc("10.96.0.11"), ip("10.244.2.5"), 8080);
    let delete = Change::DeleteService(svc("10.96.0.12"));
    let set_add = ipset::SetChange::Add(SetName::IpvsIps, Entry::Ip(ip("10.96.0.10")));
    let set_del = ipset::SetChange::Del(SetName::IpvsIps, Entry::Ip(ip("10.96.0.12")));
    let got = steps(SyncChanges {
        ipvs: vec![
            add.clone(),
            add_real.clone(),
            drain.clone(),
            delete.clone(),
            gone_real.clone(),
        ],
        sets: vec![
            (IpFamily::V4, vec![set_add, set_del]),
            (IpFamily::V6, Vec::new()),
        ],
        addresses: AddressChanges {
            bind: vec![ip("10.96.0.10")],
            unbind: vec![ip("10.96.0.12")],
        },
        rules: vec![(IpFamily::V4, "v4".into()), (IpFamily::V6, "v6".into())],
    });
    assert_eq!(
        got,
        vec![
            Step::Ipvs(vec![add, add_real, drain, gone_real]),
            Step::Sets {
                family: IpFamily::V4,
                changes: vec![set_add, set_del]
            },
            Step::Sets {
                family: IpFamily::V6,
                changes: Vec::new()
            },
            Step::Bind(ip("10.96.0.10")),
            Step::Rules {
                family: IpFamily::V4,
                text: "v4".into()
            },
            Step::Rules {
                family: IpFamily::V6,
                text: "v6".into()
            },
            Step::Unbind(ip("10.96.0.12")),
            Step::Ipvs(vec![delete]),
        ]
    );
    // Nothing to do is no step.
    assert!(steps(SyncChanges::default()).is_empty());
}
