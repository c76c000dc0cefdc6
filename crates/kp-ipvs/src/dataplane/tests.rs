use super::*;

fn ips(a: &[&str]) -> Vec<IpAddr> {
    a.iter().map(|s| s.parse().expect("address")).collect()
}

/// The node's interfaces hold 192.0.2.1, 198.51.100.7 and 2001:db8::1; its Node reports
/// 192.0.2.1 and 2001:db8::1.
fn setup() -> (NodeContext, BTreeSet<IpAddr>) {
    let node = NodeContext {
        node_ips: ips(&["192.0.2.1", "2001:db8::1"]),
        ..NodeContext::default()
    };
    let local = ips(&["192.0.2.1", "198.51.100.7", "2001:db8::1"])
        .into_iter()
        .collect();
    (node, local)
}

#[test]
fn nodeports_answer_on_every_local_address_by_default() {
    let (node, local) = setup();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::AllLocal, &node, &local),
        ips(&["192.0.2.1", "198.51.100.7", "2001:db8::1"])
    );
}

#[test]
fn primary_is_the_nodes_own_addresses_and_none_before_it_reports_them() {
    let (node, local) = setup();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::Primary, &node, &local),
        ips(&["192.0.2.1", "2001:db8::1"])
    );
    let unknown = NodeContext::default();
    assert!(node_port_addresses(&NodePortAddresses::Primary, &unknown, &local).is_empty());
}

#[test]
fn cidrs_keep_the_local_addresses_inside_them_per_family() {
    let (mut node, local) = setup();
    // An IPv4 range only: IPv4 addresses inside it; IPv6 has no range, so every local one.
    let cidrs = vec!["198.51.100.0/24".parse().unwrap()];
    node.node_port_addresses = cidrs.clone();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::Cidrs(cidrs), &node, &local),
        ips(&["198.51.100.7", "2001:db8::1"])
    );
    // A zero-length range means every address of its family.
    let cidrs = vec![
        "0.0.0.0/0".parse().unwrap(),
        "2001:db8:ffff::/48".parse().unwrap(),
    ];
    node.node_port_addresses = cidrs.clone();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::Cidrs(cidrs), &node, &local),
        ips(&["192.0.2.1", "198.51.100.7"])
    );
}

#[test]
fn conn_reuse_mode_is_set_to_zero_only_from_4_1_to_before_5_9() {
    assert_eq!(conn_reuse_mode("5.4.0-150-generic\n"), Some("0"));
    assert_eq!(conn_reuse_mode("4.1.12"), Some("0"));
    assert_eq!(conn_reuse_mode("5.8.18-100.fc31.x86_64"), Some("0"));
    assert_eq!(conn_reuse_mode("5.9.0"), None);
    assert_eq!(conn_reuse_mode("6.1.0-56-amd64"), None);
    assert_eq!(conn_reuse_mode("3.10.0-1160.el7.x86_64"), None);
    assert_eq!(conn_reuse_mode(""), None);
}

// The order of a sync's kernel operations, recorded by a kernel in memory.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kp_ipvs_plan::Change;
use kp_netlink::ipvs::ServiceKey;

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    /// A dump or listing.
    Read(&'static str),
    /// A virtual server or real server added or changed, or a real server removed.
    Ipvs(Change),
    /// A virtual server deleted.
    IpvsDelete(ServiceKey),
    /// An `ipset restore`.
    Sets(String),
    /// An address bound.
    Bind(IpAddr),
    /// A family's chains restored, with what IPVS and `kube-ipvs0` held at that moment.
    Rules(IpFamily, BTreeSet<ServiceKey>, BTreeSet<IpAddr>),
    /// An address unbound.
    Unbind(IpAddr),
}

impl Op {
    /// Where the operation belongs in a sync: reads, IPVS, sets, binds, rules, unbinds,
    /// virtual-server deletions.
    fn rank(&self) -> u8 {
        match self {
            Op::Read(_) => 0,
            Op::Ipvs(_) => 1,
            Op::Sets(_) => 2,
            Op::Bind(_) => 3,
            Op::Rules(..) => 4,
            Op::Unbind(_) => 5,
            Op::IpvsDelete(_) => 6,
        }
    }
}

/// IPVS and `kube-ipvs0` in memory; every operation appended to a log the test keeps.
#[derive(Default)]
struct Recorder {
    log: Arc<Mutex<Vec<Op>>>,
    ipvs: BTreeMap<ServiceKey, (Service, Vec<DestinationState>)>,
    bound: BTreeSet<IpAddr>,
}

impl Recorder {
    fn record(&self, op: Op) {
        self.log.lock().unwrap().push(op);
    }
}

/// A virtual server's real servers; panics as IPVS refuses (`ESRCH`) where there is none.
fn real_servers<'a>(
    ipvs: &'a mut BTreeMap<ServiceKey, (Service, Vec<DestinationState>)>,
    key: &ServiceKey,
) -> &'a mut Vec<DestinationState> {
    &mut ipvs
        .get_mut(key)
        .expect("ESRCH: a real server of no service")
        .1
}

impl Kernel for Recorder {
    fn ipvs_dump(&mut self) -> Result<Vec<(Service, Vec<DestinationState>)>, DataplaneError> {
        self.record(Op::Read("ipvs"));
        Ok(self.ipvs.values().cloned().collect())
    }

    fn ipvs_apply(&mut self, changes: &[Change]) -> Result<(), DataplaneError> {
        for c in changes {
            match c {
                Change::AddService(s) => {
                    assert!(self.ipvs.insert(s.key, (s.clone(), Vec::new())).is_none());
                }
                Change::UpdateService(s) => self.ipvs.get_mut(&s.key).expect("ESRCH").0 = s.clone(),
                Change::DeleteService(k) => {
                    self.ipvs.remove(k).expect("ESRCH");
                    self.record(Op::IpvsDelete(*k));
                    continue;
                }
                Change::AddDestination(k, d) | Change::UpdateDestination(k, d) => {
                    let list = real_servers(&mut self.ipvs, k);
                    list.retain(|s| (s.destination.addr, s.destination.port) != (d.addr, d.port));
                    list.push(DestinationState {
                        destination: *d,
                        active_connections: 0,
                        inactive_connections: 0,
                        persistent_connections: 0,
                    });
                }
                Change::DeleteDestination(k, a, p) => {
                    real_servers(&mut self.ipvs, k)
                        .retain(|s| (s.destination.addr, s.destination.port) != (*a, *p));
                }
            }
            self.record(Op::Ipvs(c.clone()));
        }
        Ok(())
    }

    fn addresses(&mut self) -> Result<BTreeSet<IpAddr>, DataplaneError> {
        self.record(Op::Read("addresses"));
        Ok(self.bound.clone())
    }

    fn node_addresses(&mut self) -> Result<BTreeSet<IpAddr>, DataplaneError> {
        self.record(Op::Read("node addresses"));
        Ok(BTreeSet::new())
    }

    fn bind(&mut self, ip: IpAddr) -> Result<(), DataplaneError> {
        self.bound.insert(ip);
        self.record(Op::Bind(ip));
        Ok(())
    }

    fn unbind(&mut self, ip: IpAddr) -> Result<(), DataplaneError> {
        self.bound.remove(&ip);
        self.record(Op::Unbind(ip));
        Ok(())
    }

    fn ipset_save(&mut self) -> Result<String, DataplaneError> {
        self.record(Op::Read("ipset save"));
        Ok(String::new())
    }

    fn ipset_restore(&mut self, text: &str) -> Result<(), DataplaneError> {
        self.record(Op::Sets(text.to_string()));
        Ok(())
    }

    fn restore_rules(&mut self, family: IpFamily, _text: &str) -> Result<(), DataplaneError> {
        let keys = self.ipvs.keys().copied().collect();
        self.record(Op::Rules(family, keys, self.bound.clone()));
        Ok(())
    }
}

/// The flow table's fixture, both families, over a [`Recorder`]; its log.
fn recorded() -> (IpvsDataplane, Arc<Mutex<Vec<Op>>>) {
    let node = kp_flows::node_context();
    let settings = IpvsSettings {
        families: vec![IpFamily::V4, IpFamily::V6],
        ipvs: kp_ipvs_plan::Config::new("rr", 0, Vec::new()).expect("config"),
        masquerade_bit: 14,
        masquerade_all: false,
        node_port_addresses: node.node_ips.clone(),
        node,
        strict_arp: false,
        timeouts: crate::Timeouts::default(),
        netns: None,
        resolve: None,
    };
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    (
        IpvsDataplane::with_kernel(settings, Box::new(recorder)),
        log,
    )
}

/// The log so far, emptied; checks the operations went in their order.
fn take_in_order(log: &Mutex<Vec<Op>>) -> Vec<Op> {
    let ops = std::mem::take(&mut *log.lock().unwrap());
    for w in ops.windows(2) {
        assert!(
            w[0].rank() <= w[1].rank(),
            "{:?} came before {:?}:\n{ops:#?}",
            w[0],
            w[1]
        );
    }
    ops
}

#[test]
fn the_first_sync_makes_ipvs_then_sets_then_addresses_before_the_rules_steer_to_them() {
    // As after a switch from the iptables mode: the first (full) sync on an empty IPVS. When
    // each family's chains replace the iptables mode's DNAT in the shared KUBE-SERVICES, every
    // virtual server and every address is there already.
    let (mut dp, log) = recorded();
    let state = kp_flows::state();
    dp.sync(&state, &Changes::default(), true).expect("sync");
    let ops = take_in_order(&log);
    let want_services: BTreeSet<ServiceKey> = dp.desired().services().keys().copied().collect();
    let want_bound = dp.desired().bind_addresses().clone();
    assert!(
        want_services.len() > 10 && want_bound.len() > 5,
        "{want_bound:?}"
    );
    let mut families = Vec::new();
    for op in &ops {
        if let Op::Rules(family, services, bound) = op {
            families.push(*family);
            assert_eq!(services, &want_services, "{family:?}: IPVS at the restore");
            assert_eq!(bound, &want_bound, "{family:?}: kube-ipvs0 at the restore");
        }
    }
    assert_eq!(families, [IpFamily::V4, IpFamily::V6]);
    let sets = ops.iter().filter(|o| matches!(o, Op::Sets(_))).count();
    assert_eq!(sets, 2, "one ipset restore per family on a full sync");
    // Real servers too: every add of a destination is before the first set restore.
    assert!(ops
        .iter()
        .any(|o| matches!(o, Op::Ipvs(Change::AddDestination(..)))));
    // A second sync of the same state changes nothing.
    dp.sync(&state, &Changes::default(), false).expect("sync");
    let again = take_in_order(&log);
    assert!(again.iter().all(|o| matches!(o, Op::Read(_))), "{again:#?}");
}

#[test]
fn a_removed_service_loses_set_entries_then_its_address_then_its_virtual_servers() {
    let (mut dp, log) = recorded();
    dp.sync(&kp_flows::state(), &Changes::default(), true)
        .expect("sync");
    take_in_order(&log);
    // The web Service (ClusterIP 10.96.0.10) goes.
    let web: IpAddr = "10.96.0.10".parse().unwrap();
    assert!(dp.desired().bind_addresses().contains(&web));
    let objects = kp_flows::objects()
        .into_iter()
        .filter(|o| {
            !matches!(o, kp_core::track::Object::Service(s)
                if s.metadata.name.as_deref() == Some("web"))
        })
        .collect();
    let state = kp_flows::load(kp_flows::NODE, objects);
    dp.sync(&state, &Changes::default(), false).expect("sync");
    assert!(!dp.desired().bind_addresses().contains(&web));
    let ops = take_in_order(&log);
    let at = |want: &dyn Fn(&Op) -> bool| ops.iter().position(want);
    let sets = at(
        &|o| matches!(o, Op::Sets(t) if t.contains(&format!("del KUBE-CLUSTER-IP {web},tcp:80"))),
    )
    .unwrap_or_else(|| panic!("the ClusterIP's set entry removed: {ops:#?}"));
    let unbind = at(&|o| *o == Op::Unbind(web)).expect("unbound");
    let delete = at(
        &|o| matches!(o, Op::IpvsDelete(ServiceKey::Addr { addr, port: 80, .. }) if *addr == web),
    )
    .expect("its virtual server deleted");
    assert!(sets < unbind && unbind < delete, "{ops:#?}");
    // A removal binds nothing.
    assert!(!ops.iter().any(|o| matches!(o, Op::Bind(_))), "{ops:#?}");
}
