use super::*;

use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::{Endpoint, Protocol, ServicePort, ServicePortName};
use kp_core::select::SelectedEndpoints;

// ClusterIP 10.96.0.1, external IP 203.0.113.10, node 192.0.2.1, endpoints in 10.244.0.0/16.

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn frontend(addr: &str, port: u16) -> FrontendAddr {
    FrontendAddr {
        ip: ip(addr),
        port,
        protocol: Protocol::Tcp,
        scope: Scope::Socket,
    }
}

fn backend(addr: &str) -> Backend {
    Backend {
        ip: ip(addr),
        port: 8080,
        protocol: Protocol::Tcp,
    }
}

fn spec(addr: &str, backends: &[&str]) -> FrontendSpec {
    FrontendSpec {
        addr: frontend(addr, 80),
        backends: backends.iter().map(|b| backend(b)).collect(),
        drop_when_empty: false,
        affinity: None,
        cluster_ip: true,
        keep_source: false,
        source_ranges: None,
    }
}

fn svc(name: &str) -> ServiceName {
    ServiceName::new("web", name)
}

/// Applies ops to a model of the maps, checking after each one that every reachable slot
/// points at an existing backend (the order's promise).
fn apply(maps: &mut Contents, ops: &[Op]) {
    for op in ops {
        maps.apply(op);
        for (k, v) in maps.services.iter().filter(|(k, _)| k.slot == 0) {
            assert!(maps.rev_nat.contains_key(&v.rev_nat), "after {op:?}");
            for slot in 1..=v.count {
                let key = ServiceKey { slot, ..*k };
                let entry = maps.services.get(&key);
                let id = entry.map(|e| e.backend_id);
                assert!(
                    id.is_some_and(|id| maps.backends.contains_key(&id)),
                    "after {op:?}: slot {slot} of {k:?} reaches no backend"
                );
            }
        }
    }
}

fn backends_of(maps: &Contents, addr: FrontendAddr) -> BTreeSet<Backend> {
    let count = maps.services[&ServiceKey {
        frontend: addr,
        slot: 0,
    }]
        .count;
    (1..=count)
        .map(|slot| {
            let id = maps.services[&ServiceKey {
                frontend: addr,
                slot,
            }]
                .backend_id;
            maps.backends[&id]
        })
        .collect()
}

#[test]
fn a_frontend_gets_a_count_slot_and_one_slot_per_backend() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    let ops = planner
        .set_service(
            &svc("a"),
            &[spec("10.96.0.1", &["10.244.1.1", "10.244.2.1"])],
        )
        .expect("plan");
    apply(&mut maps, &ops);
    assert_eq!(maps, planner.contents());
    assert_eq!(maps.services.len(), 3);
    assert_eq!(
        backends_of(&maps, frontend("10.96.0.1", 80)),
        [backend("10.244.1.1"), backend("10.244.2.1")].into()
    );
    let rev = maps.rev_nat.values().next().expect("rev nat entry");
    assert_eq!((rev.ip, rev.port), (ip("10.96.0.1"), 80));
}

#[test]
fn removing_one_endpoint_of_many_moves_the_last_slot_into_its_place() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    let many: Vec<String> = (1..=100).map(|i| format!("10.244.1.{i}")).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    apply(
        &mut maps,
        &planner
            .set_service(&svc("a"), &[spec("10.96.0.1", &refs)])
            .expect("plan"),
    );
    let fewer: Vec<&str> = refs
        .iter()
        .copied()
        .filter(|b| *b != "10.244.1.7")
        .collect();
    let ops = planner
        .set_service(&svc("a"), &[spec("10.96.0.1", &fewer)])
        .expect("plan");
    // Slot 7 takes the last backend, slot 100 goes, the count drops, the backend goes.
    assert_eq!(ops.len(), 4, "{ops:?}");
    apply(&mut maps, &ops);
    assert_eq!(maps, planner.contents());
    let expected: BTreeSet<Backend> = fewer.iter().map(|b| backend(b)).collect();
    assert_eq!(backends_of(&maps, frontend("10.96.0.1", 80)), expected);
}

#[test]
fn adding_one_endpoint_writes_the_backend_its_slot_and_the_count() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    apply(
        &mut maps,
        &planner
            .set_service(&svc("a"), &[spec("10.96.0.1", &["10.244.1.1"])])
            .expect("plan"),
    );
    let ops = planner
        .set_service(
            &svc("a"),
            &[spec("10.96.0.1", &["10.244.1.1", "10.244.1.2"])],
        )
        .expect("plan");
    assert_eq!(ops.len(), 3, "{ops:?}");
    assert!(matches!(ops[0], Op::UpsertBackend(..)));
    assert!(matches!(ops[2], Op::UpsertService(k, v) if k.slot == 0 && v.count == 2));
    apply(&mut maps, &ops);
    assert_eq!(maps, planner.contents());
}

#[test]
fn a_backend_shared_by_two_services_stays_until_both_let_it_go() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    for name in ["a", "b"] {
        let addr = if name == "a" {
            "10.96.0.1"
        } else {
            "10.96.0.2"
        };
        apply(
            &mut maps,
            &planner
                .set_service(&svc(name), &[spec(addr, &["10.244.1.1"])])
                .expect("plan"),
        );
    }
    assert_eq!(maps.backends.len(), 1);
    apply(
        &mut maps,
        &planner.set_service(&svc("a"), &[]).expect("plan"),
    );
    assert_eq!(maps.backends.len(), 1);
    assert_eq!(
        backends_of(&maps, frontend("10.96.0.2", 80)),
        [backend("10.244.1.1")].into()
    );
    apply(
        &mut maps,
        &planner.set_service(&svc("b"), &[]).expect("plan"),
    );
    assert_eq!(maps, Contents::default());
    assert_eq!(planner.contents(), Contents::default());
}

#[test]
fn held_backends_leave_socket_frontends_that_have_others_and_no_outside_one() {
    let outside = |s: FrontendSpec| FrontendSpec {
        addr: FrontendAddr {
            scope: Scope::Outside,
            ..s.addr
        },
        ..s
    };
    let mut specs = vec![
        spec("10.96.0.1", &["10.244.0.1", "10.244.0.2", "10.244.0.3"]),
        spec("10.96.0.2", &["10.244.0.1"]),
        outside(spec("203.0.113.10", &["10.244.0.1", "10.244.0.2"])),
    ];
    let before = specs.clone();
    hold(&mut specs, &BTreeSet::new());
    assert_eq!(specs, before, "nothing held, nothing left out");
    let held: BTreeSet<Backend> = [backend("10.244.0.1"), backend("10.244.0.3")].into();
    hold(&mut specs, &held);
    assert_eq!(specs[0].backends, vec![backend("10.244.0.2")]);
    assert_eq!(
        specs[1].backends,
        vec![backend("10.244.0.1")],
        "a frontend whose every backend is held keeps them"
    );
    assert_eq!(specs[2], before[2], "the tc path's frontends keep theirs");
    // Another port of a held address is another backend.
    let other_port = Backend {
        port: 9090,
        ..backend("10.244.0.2")
    };
    let mut specs = vec![spec("10.96.0.1", &["10.244.0.2"])];
    specs[0].backends.push(other_port);
    hold(&mut specs, &[other_port].into());
    assert_eq!(specs[0].backends, vec![backend("10.244.0.2")]);
}

#[test]
fn a_frontend_without_endpoints_keeps_a_zero_count() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    apply(
        &mut maps,
        &planner
            .set_service(&svc("a"), &[spec("10.96.0.1", &[])])
            .expect("plan"),
    );
    let count = maps.services[&ServiceKey {
        frontend: frontend("10.96.0.1", 80),
        slot: 0,
    }];
    assert_eq!(count.count, 0);
    assert_eq!(maps.services.len(), 1);
}

#[test]
fn an_unchanged_service_costs_no_update() {
    let mut planner = Planner::new();
    let specs = [spec("10.96.0.1", &["10.244.1.1", "10.244.1.2"])];
    planner.set_service(&svc("a"), &specs).expect("plan");
    assert_eq!(
        planner.set_service(&svc("a"), &specs).expect("plan"),
        vec![]
    );
}

#[test]
fn keys_and_values_read_back_as_written() {
    let key = ServiceKey {
        frontend: FrontendAddr {
            ip: ip("fd00:10:96::1"),
            port: 53,
            protocol: Protocol::Udp,
            scope: Scope::Outside,
        },
        slot: 3,
    };
    assert_eq!(ServiceKey::from_bytes(&key.to_bytes()), Some(key));
    let v4 = ServiceKey {
        frontend: frontend("10.96.0.1", 443),
        slot: 0,
    };
    let bytes = v4.to_bytes();
    // The offsets maps.h relies on: mapped address, port in network order, protocol at 20.
    assert_eq!(&bytes[10..16], &[0xff, 0xff, 10, 96, 0, 1]);
    assert_eq!(&bytes[16..18], &[1, 187]);
    assert_eq!(bytes[20], 6);
    assert_eq!(ServiceKey::from_bytes(&bytes), Some(v4));
    let b = backend("10.244.1.1");
    assert_eq!(Backend::from_bytes(&b.to_bytes()), Some(b));
    let v = ServiceValue::slot(7, 2);
    assert_eq!(ServiceValue::from_bytes(&v.to_bytes()), Some(v));
    let head = ServiceValue {
        backend_id: 0,
        count: 3,
        rev_nat: 2,
        affinity: 10800,
        flags: FLAG_DROP_EMPTY,
    };
    let bytes = head.to_bytes();
    // maps.h: affinity at 8, flags at 12.
    assert_eq!(&bytes[8..12], &10800u32.to_ne_bytes());
    assert_eq!(bytes[12], 1);
    assert_eq!(ServiceValue::from_bytes(&bytes), Some(head));
    for (k, trie_len) in [
        (AddrKey::host(ip("10.96.0.1")), 128),
        (
            AddrKey {
                ip: ip("10.96.0.0"),
                len: 16,
            },
            112,
        ),
        (
            AddrKey {
                ip: ip("fd00:10:96::"),
                len: 112,
            },
            112,
        ),
    ] {
        assert_eq!(k.trie_len(), trie_len, "{k:?}");
        assert_eq!(AddrKey::from_trie(k.trie_len(), k.data()), Some(k));
    }
    assert_eq!(
        AddrKey::from_trie(95, AddrKey::host(ip("10.0.0.1")).data()),
        None
    );
    let r = RevNat {
        ip: ip("10.96.0.1"),
        port: 80,
    };
    assert_eq!(RevNat::from_bytes(&r.to_bytes()), Some(r));
}

fn endpoint(addr: &str, local: bool) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        is_local: local,
        zone_hints: None,
    }
}

#[test]
fn frontend_specs_cover_cluster_external_and_node_port_addresses() {
    let port = ServicePort {
        name: ServicePortName {
            service: svc("a"),
            port: "http".into(),
            protocol: Protocol::Tcp,
        },
        cluster_ips: vec![ip("10.96.0.1"), ip("fd00:10:96::1")],
        port: 80,
        node_port: Some(30080),
        external_ips: vec![ip("203.0.113.10")],
        load_balancer_ips: Vec::new(),
        load_balancer_source_ranges: Vec::new(),
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: true,
        health_check_node_port: None,
    };
    let selected = SelectedEndpoints {
        cluster: vec![endpoint("10.244.1.1", true), endpoint("10.244.2.1", false)],
        local: vec![endpoint("10.244.1.1", true)],
        has_any: true,
        has_any_by_family: [true, false],
    };
    let fronts = Frontends::new(&port, &selected, IpFamily::V4);
    let specs = frontend_specs(&fronts, &[ip("192.0.2.1"), ip("2001:db8::1")]);
    let addrs: Vec<(IpAddr, u16, Scope)> = specs
        .iter()
        .map(|s| (s.addr.ip, s.addr.port, s.addr.scope))
        .collect();
    assert_eq!(
        addrs,
        vec![
            (ip("10.96.0.1"), 80, Scope::Socket),
            (ip("203.0.113.10"), 80, Scope::Socket),
            (ip("203.0.113.10"), 80, Scope::Outside),
            (ip("192.0.2.1"), 30080, Scope::Socket),
            (ip("192.0.2.1"), 30080, Scope::Outside),
        ]
    );
    for s in &specs {
        match s.addr.scope {
            // Local external policy: traffic from the node short-circuits to every endpoint.
            Scope::Socket => {
                assert_eq!(s.backends.len(), 2, "{s:?}");
                assert!(!s.keep_source);
            }
            // From outside: the local endpoint only, the client's address kept.
            Scope::Outside => {
                assert_eq!(s.backends, vec![backend("10.244.1.1")], "{s:?}");
                assert!(s.keep_source);
                assert_eq!(s.source_ranges, None);
            }
        }
    }
}

#[test]
fn source_ranges_give_an_outside_frontend_and_their_map_entries() {
    let mut port = ServicePort {
        name: ServicePortName {
            service: svc("lb"),
            port: "http".into(),
            protocol: Protocol::Tcp,
        },
        cluster_ips: vec![ip("10.96.0.2")],
        port: 80,
        node_port: None,
        external_ips: Vec::new(),
        load_balancer_ips: vec![ip("203.0.113.20")],
        load_balancer_source_ranges: vec!["192.0.2.0/30".parse().expect("net")],
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: false,
        health_check_node_port: None,
    };
    let selected = SelectedEndpoints {
        cluster: vec![endpoint("10.244.1.1", true)],
        local: vec![endpoint("10.244.1.1", true)],
        has_any: true,
        has_any_by_family: [true, false],
    };
    let specs = frontend_specs(&Frontends::new(&port, &selected, IpFamily::V4), &[]);
    let outside: Vec<&FrontendSpec> = specs
        .iter()
        .filter(|s| s.addr.scope == Scope::Outside)
        .collect();
    assert_eq!(outside.len(), 1, "{specs:?}");
    assert_eq!(outside[0].addr.ip, ip("203.0.113.20"));
    assert!(!outside[0].keep_source);
    let want_range = AddrKey {
        ip: ip("192.0.2.0"),
        len: 30,
    };
    assert_eq!(outside[0].source_ranges, Some(vec![want_range]));
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    apply(
        &mut maps,
        &planner.set_service(&svc("lb"), &specs).expect("plan"),
    );
    assert_eq!(maps, planner.contents());
    let head = maps.services[&ServiceKey {
        frontend: outside[0].addr,
        slot: 0,
    }];
    assert_eq!(head.flags, FLAG_SRC_RANGES);
    assert_eq!(
        maps.ranges.iter().collect::<Vec<_>>(),
        [&RangeKey {
            rev_nat: head.rev_nat,
            prefix: want_range
        }]
    );
    let key = maps.ranges.iter().next().copied().expect("range");
    assert_eq!(RangeKey::from_trie(key.trie_len(), key.data()), Some(key));
    // Ranges of the other family only: still restricted, nothing admitted.
    port.load_balancer_source_ranges = vec!["2001:db8::/64".parse().expect("net")];
    let specs = frontend_specs(&Frontends::new(&port, &selected, IpFamily::V4), &[]);
    let outside = specs
        .iter()
        .find(|s| s.addr.scope == Scope::Outside)
        .expect("outside frontend");
    assert_eq!(outside.source_ranges, Some(Vec::new()));
    let ops = planner.set_service(&svc("lb"), &specs).expect("plan");
    assert!(ops.contains(&Op::DeleteRange(key)), "{ops:?}");
    apply(&mut maps, &ops);
    assert!(maps.ranges.is_empty());
    assert_eq!(maps, planner.contents());
    // The Service going removes its outside frontend and ranges too.
    apply(
        &mut maps,
        &planner.set_service(&svc("lb"), &[]).expect("plan"),
    );
    assert_eq!(maps, Contents::default());
}

#[test]
fn diff_repairs_drifted_maps_and_removes_strangers_without_exposing_a_dangling_slot() {
    let mut planner = Planner::new();
    planner
        .set_service(
            &svc("a"),
            &[spec("10.96.0.1", &["10.244.1.1", "10.244.1.2"])],
        )
        .expect("plan");
    let want = planner.contents();
    let mut have = want.clone();
    // Drift: a backend rewritten by someone, a stranger frontend with its own backend.
    let id = *have.backends.keys().next().expect("a backend");
    have.backends.insert(id, backend("10.244.9.9"));
    let mut other = Planner::new();
    other
        .set_service(&svc("x"), &[spec("10.96.0.99", &["10.244.8.1"])])
        .expect("plan");
    let stranger = other.contents();
    let shifted = |k: &ServiceKey| ServiceKey {
        frontend: FrontendAddr {
            port: 9999,
            ..k.frontend
        },
        ..*k
    };
    for (k, v) in &stranger.services {
        have.services.insert(
            shifted(k),
            ServiceValue {
                backend_id: if v.backend_id == 0 { 0 } else { 77 },
                rev_nat: 700,
                ..*v
            },
        );
    }
    have.backends.insert(77, backend("10.244.8.1"));
    have.rev_nat.insert(
        700,
        RevNat {
            ip: ip("10.96.0.99"),
            port: 9999,
        },
    );

    let ops = diff(&have, &want);
    assert_eq!(ops.len(), 1 + 2 + 1 + 1, "{ops:?}");
    let mut maps = have;
    apply(&mut maps, &ops);
    assert_eq!(maps, want);
    assert!(diff(&want, &want).is_empty());
}

#[test]
fn an_empty_frontend_says_whether_it_drops_and_a_flag_change_rewrites_only_its_head() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    apply(
        &mut maps,
        &planner
            .set_service(&svc("a"), &[spec("10.96.0.1", &[])])
            .expect("plan"),
    );
    let head = ServiceKey {
        frontend: frontend("10.96.0.1", 80),
        slot: 0,
    };
    assert_eq!(maps.services[&head].flags, 0);
    let dropping = FrontendSpec {
        drop_when_empty: true,
        affinity: Some(60),
        ..spec("10.96.0.1", &[])
    };
    let ops = planner.set_service(&svc("a"), &[dropping]).expect("plan");
    assert_eq!(ops.len(), 1, "{ops:?}");
    apply(&mut maps, &ops);
    assert_eq!(maps.services[&head].flags, FLAG_DROP_EMPTY);
    assert_eq!(maps.services[&head].affinity, 60);
    assert_eq!(maps, planner.contents());
}

#[test]
fn cluster_ips_reject_their_other_ports_and_service_cidrs_drop_the_rest() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    let external = FrontendSpec {
        cluster_ip: false,
        ..spec("203.0.113.10", &["10.244.1.1"])
    };
    apply(
        &mut maps,
        &planner
            .set_service(&svc("a"), &[spec("10.96.0.1", &["10.244.1.1"]), external])
            .expect("plan"),
    );
    apply(
        &mut maps,
        &planner.set_service_cidrs(&[(ip("10.96.7.7"), 16), (ip("fd00:10:96::"), 112)]),
    );
    let cidr = AddrKey {
        ip: ip("10.96.0.0"),
        len: 16,
    };
    assert_eq!(
        maps.addrs,
        [
            (AddrKey::host(ip("10.96.0.1")), AddrVerdict::Reject),
            (cidr, AddrVerdict::Drop),
            (
                AddrKey {
                    ip: ip("fd00:10:96::"),
                    len: 112
                },
                AddrVerdict::Drop
            ),
        ]
        .into()
    );
    assert_eq!(maps, planner.contents());
    assert!(planner
        .set_service_cidrs(&[(ip("10.96.0.0"), 16), (ip("fd00:10:96::"), 112)])
        .is_empty());
    // The Service goes: its ClusterIP's entry with it, the CIDR stays.
    let ops = planner.set_service(&svc("a"), &[]).expect("plan");
    apply(&mut maps, &ops);
    assert_eq!(maps.addrs.len(), 2);
    assert!(!maps.addrs.contains_key(&AddrKey::host(ip("10.96.0.1"))));
    assert_eq!(maps, planner.contents());
    assert_eq!(diff(&maps, &planner.contents()), vec![]);
}

#[test]
fn frontend_specs_take_the_policies_selection_and_say_what_an_empty_one_does() {
    let port = |itp_local: bool| ServicePort {
        name: ServicePortName {
            service: svc("itp"),
            port: "http".into(),
            protocol: Protocol::Tcp,
        },
        cluster_ips: vec![ip("10.96.0.85")],
        port: 80,
        node_port: None,
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        load_balancer_source_ranges: Vec::new(),
        session_affinity_timeout: Some(30),
        internal_traffic_local: itp_local,
        external_traffic_local: false,
        health_check_node_port: None,
    };
    // Endpoints on another node only.
    let remote_only = SelectedEndpoints {
        cluster: vec![endpoint("10.244.2.1", false)],
        local: Vec::new(),
        has_any: true,
        has_any_by_family: [true, false],
    };
    let local = port(true);
    let specs = frontend_specs(&Frontends::new(&local, &remote_only, IpFamily::V4), &[]);
    assert_eq!(specs.len(), 1);
    assert!(specs[0].backends.is_empty());
    assert!(specs[0].drop_when_empty, "{specs:?}");
    assert!(specs[0].cluster_ip);
    assert_eq!(specs[0].affinity, Some(30));
    let cluster = port(false);
    let specs = frontend_specs(&Frontends::new(&cluster, &remote_only, IpFamily::V4), &[]);
    assert_eq!(specs[0].backends, vec![backend("10.244.2.1")]);
    let none = SelectedEndpoints {
        cluster: Vec::new(),
        local: Vec::new(),
        has_any: false,
        has_any_by_family: [false, false],
    };
    let specs = frontend_specs(&Frontends::new(&local, &none, IpFamily::V4), &[]);
    assert!(specs[0].backends.is_empty() && !specs[0].drop_when_empty);
}

/// Applies ops as the kernel would: a delete of an entry the maps do not hold fails
/// (`ENOENT`), and after each op every reachable slot still reaches a backend.
fn apply_strict(maps: &mut Contents, ops: &[Op]) {
    for op in ops {
        let present = match op {
            Op::DeleteBackend(id) => maps.backends.contains_key(id),
            Op::DeleteRevNat(id) => maps.rev_nat.contains_key(id),
            Op::DeleteService(k) => maps.services.contains_key(k),
            Op::DeleteAddr(k) => maps.addrs.contains_key(k),
            Op::DeleteMaglev(id) => maps.maglev.contains_key(id),
            _ => true,
        };
        assert!(present, "{op:?} deletes an entry the maps do not hold");
        apply(maps, std::slice::from_ref(op));
    }
}

/// What each frontend resolves to, whatever the ids: its backends (by slot count and the set
/// they reach), its reverse-NAT entry and its head's flags; checks that no backend entry is
/// orphaned.
fn resolved(maps: &Contents) -> BTreeMap<FrontendAddr, (u16, BTreeSet<Backend>, RevNat, u8)> {
    let mut out = BTreeMap::new();
    let mut used = BTreeSet::new();
    for (k, head) in maps.services.iter().filter(|(k, _)| k.slot == 0) {
        let mut set = BTreeSet::new();
        for slot in 1..=head.count {
            let entry = maps.services[&ServiceKey { slot, ..*k }];
            assert_eq!(entry.rev_nat, head.rev_nat);
            used.insert(entry.backend_id);
            set.insert(maps.backends[&entry.backend_id]);
        }
        let rev = maps.rev_nat[&head.rev_nat];
        out.insert(k.frontend, (head.count, set, rev, head.flags));
    }
    let slots = maps.services.keys().filter(|k| k.slot != 0).count();
    let counted: usize = out.values().map(|v| usize::from(v.0)).sum();
    assert_eq!(slots, counted, "a slot beyond its frontend's count");
    let held: BTreeSet<u32> = maps.backends.keys().copied().collect();
    assert_eq!(held, used, "backend entries orphaned or missing");
    assert_eq!(
        maps.rev_nat.len(),
        out.len(),
        "orphaned reverse-NAT entries"
    );
    out
}

/// The specs of a generated Service `i` (as kp-bench's cluster shapes them): port 80 → 8080,
/// every fifth Service also 443 → 8443, every tenth also UDP 53 → 5353; each port on its
/// ClusterIP, on a NodePort of the node's address for odd `i`, and on an external IP for
/// every third.
fn generated_specs(i: u16, endpoints: &[IpAddr]) -> Vec<FrontendSpec> {
    let mut ports = vec![(Protocol::Tcp, 80, 8080)];
    if i.is_multiple_of(5) {
        ports.push((Protocol::Tcp, 443, 8443));
    }
    if i.is_multiple_of(10) {
        ports.push((Protocol::Udp, 53, 5353));
    }
    let mut out = Vec::new();
    for (k, (protocol, port, target)) in ports.into_iter().enumerate() {
        let backends: Vec<Backend> = endpoints
            .iter()
            .map(|ip| Backend {
                ip: *ip,
                port: target,
                protocol,
            })
            .collect();
        let mut addrs = vec![(IpAddr::from([10, 96, 0, i as u8]), port, true)];
        if i % 2 == 1 {
            addrs.push((ip("192.0.2.1"), 30000 + i * 3 + k as u16, false));
        }
        if i.is_multiple_of(3) {
            addrs.push((IpAddr::from([203, 0, 113, i as u8]), port, false));
        }
        for (a, p, cluster_ip) in addrs {
            out.push(FrontendSpec {
                addr: FrontendAddr {
                    ip: a,
                    port: p,
                    protocol,
                    scope: Scope::Socket,
                },
                backends: backends.clone(),
                drop_when_empty: false,
                affinity: None,
                cluster_ip,
                keep_source: false,
                source_ranges: None,
            });
        }
    }
    out
}

/// Each flagged frontend's Maglev table, entry by entry as the backends it names; checks that no
/// table is orphaned.
fn maglev_resolved(maps: &Contents) -> BTreeMap<FrontendAddr, Vec<Backend>> {
    let mut out = BTreeMap::new();
    let mut used = BTreeSet::new();
    for (k, head) in maps.services.iter().filter(|(k, _)| k.slot == 0) {
        if head.flags & FLAG_MAGLEV == 0 {
            continue;
        }
        used.insert(head.rev_nat);
        let named = maps.maglev[&head.rev_nat]
            .slots()
            .iter()
            .map(|&slot| maps.backends[&maps.services[&ServiceKey { slot, ..*k }].backend_id])
            .collect();
        out.insert(k.frontend, named);
    }
    let held: BTreeSet<u16> = maps.maglev.keys().copied().collect();
    assert_eq!(held, used, "Maglev tables orphaned or missing");
    out
}

#[test]
fn one_endpoint_changes_on_multi_port_services_match_a_full_plan() {
    for scheduler in [Scheduler::Random, Scheduler::Maglev] {
        one_endpoint_changes_match_a_full_plan(scheduler);
    }
}

fn one_endpoint_changes_match_a_full_plan(scheduler: Scheduler) {
    for (services, per) in [(20u16, 10u8), (20, 2), (30, 1)] {
        // Endpoint `j` of Service `i`; the last Service shares the first one's endpoints.
        let mut endpoints: Vec<Vec<IpAddr>> = (0..services)
            .map(|i| {
                (0..per)
                    .map(|j| IpAddr::from([10, 250, (i % (services - 1)) as u8, j]))
                    .collect()
            })
            .collect();
        let mut planner = Planner::with_scheduler(scheduler);
        let mut maps = Contents::default();
        for i in 0..services {
            let ops = planner
                .set_service(
                    &svc(&i.to_string()),
                    &generated_specs(i, &endpoints[usize::from(i)]),
                )
                .expect("plan");
            apply_strict(&mut maps, &ops);
        }
        for change in 0..60u16 {
            let i = (change * 7) % services;
            let j = usize::from(change) % usize::from(per);
            endpoints[usize::from(i)][j] =
                IpAddr::from([10, 251, (change / 200) as u8, (change % 200) as u8]);
            let ops = planner
                .set_service(
                    &svc(&i.to_string()),
                    &generated_specs(i, &endpoints[usize::from(i)]),
                )
                .expect("plan");
            apply_strict(&mut maps, &ops);
            // With tables, every fourth change against a full plan (each computes them all).
            if scheduler == Scheduler::Maglev && change % 4 != 3 {
                continue;
            }
            let mut fresh = Planner::with_scheduler(scheduler);
            for s in 0..services {
                fresh
                    .set_service(
                        &svc(&s.to_string()),
                        &generated_specs(s, &endpoints[usize::from(s)]),
                    )
                    .expect("full plan");
            }
            assert_eq!(
                resolved(&maps),
                resolved(&fresh.contents()),
                "{services} Services x {per}: after change {change} (Service {i})"
            );
            let tables = maglev_resolved(&maps);
            assert_eq!(
                tables,
                maglev_resolved(&fresh.contents()),
                "{scheduler:?}, {services} Services x {per}: Maglev tables after change {change}"
            );
            assert_eq!(tables.is_empty(), scheduler == Scheduler::Random);
            assert_eq!(maps, planner.contents(), "the planner's own record");
            // The planner read in place asks a stale plan's maps (and empty ones) for what its
            // listing does; every twelfth change, as each lists everything twice.
            if change % 12 == 11 {
                same_updates(&fresh.contents(), &planner);
                same_updates(&Contents::default(), &planner);
            }
        }
    }
}

/// `diff` against the planner read in place asks for the updates its listing
/// (`Planner::contents`) asks for, in the safe order, and they make the maps its listing.
fn same_updates(maps: &Contents, planner: &Planner) {
    let listed = diff(maps, &planner.contents());
    let read = diff(maps, planner);
    let sorted = |ops: &[Op]| {
        let mut v: Vec<String> = ops.iter().map(|o| format!("{o:?}")).collect();
        v.sort();
        v
    };
    assert_eq!(sorted(&read), sorted(&listed));
    assert!(read.windows(2).all(|w| w[0].rank() <= w[1].rank()));
    let mut written = maps.clone();
    apply_strict(&mut written, &read);
    assert_eq!(written, planner.contents());
}

#[test]
fn a_frontend_replaced_in_one_update_keeps_its_reverse_nat_entry() {
    let mut planner = Planner::new();
    let mut maps = Contents::default();
    let with_external = |external: &str| {
        let mut s = spec(external, &["10.244.1.1"]);
        s.cluster_ip = false;
        vec![spec("10.96.0.1", &["10.244.1.1"]), s]
    };
    for external in ["203.0.113.10", "203.0.113.11", "203.0.113.12"] {
        let ops = planner
            .set_service(&svc("a"), &with_external(external))
            .expect("plan");
        apply_strict(&mut maps, &ops);
        assert_eq!(maps, planner.contents());
        let mut fresh = Planner::new();
        fresh
            .set_service(&svc("a"), &with_external(external))
            .expect("full plan");
        assert_eq!(resolved(&maps), resolved(&fresh.contents()));
    }
}

/// Plans `service` with `specs`, then every Service handed an address, as the dataplane does.
fn set_with_handoffs(
    p: &mut Planner,
    service: &ServiceName,
    specs: &[FrontendSpec],
    specs_of: &dyn Fn(&ServiceName) -> Vec<FrontendSpec>,
) -> Vec<Op> {
    let mut ops = p.set_service(service, specs).expect("ids");
    for next in p.take_handoffs() {
        ops.extend(p.set_service(&next, &specs_of(&next)).expect("ids"));
    }
    ops
}

#[test]
fn an_address_two_services_share_goes_to_the_last_in_key_order_and_then_to_the_other() {
    // Services a and b both list external IP 203.0.113.10:80 (nothing allocates externalIPs);
    // each also has a ClusterIP of its own.
    let a_specs = vec![
        spec("10.96.0.1", &["10.244.1.1"]),
        spec("203.0.113.10", &["10.244.1.1"]),
    ];
    let b_specs = vec![
        spec("10.96.0.2", &["10.244.2.2"]),
        spec("203.0.113.10", &["10.244.2.2"]),
    ];
    let (a, b) = (svc("a"), svc("b"));
    let live: std::cell::RefCell<BTreeMap<ServiceName, Vec<FrontendSpec>>> = Default::default();
    let specs_of = |s: &ServiceName| live.borrow().get(s).cloned().unwrap_or_default();
    let shared = frontend("203.0.113.10", 80);
    let only = |b: &str| BTreeSet::from([backend(b)]);

    // Either order of arrival gives what a full plan gives: b, the last in key order.
    for first_b in [false, true] {
        let mut p = Planner::new();
        let mut maps = Contents::default();
        live.borrow_mut().clear();
        let order = if first_b {
            [(&b, &b_specs), (&a, &a_specs)]
        } else {
            [(&a, &a_specs), (&b, &b_specs)]
        };
        for (s, specs) in order {
            live.borrow_mut().insert(s.clone(), specs.clone());
            apply_strict(&mut maps, &set_with_handoffs(&mut p, s, specs, &specs_of));
        }
        assert_eq!(
            backends_of(&maps, shared),
            only("10.244.2.2"),
            "b first: {first_b}"
        );
        assert_eq!(resolved(&maps), resolved(&p.contents()));

        // An update of a (which waits) leaves b's backends there.
        let a_moved = vec![
            spec("10.96.0.1", &["10.244.1.9"]),
            spec("203.0.113.10", &["10.244.1.9"]),
        ];
        live.borrow_mut().insert(a.clone(), a_moved.clone());
        apply_strict(
            &mut maps,
            &set_with_handoffs(&mut p, &a, &a_moved, &specs_of),
        );
        assert_eq!(backends_of(&maps, shared), only("10.244.2.2"));

        // b deleted: the address is a's, with a's current backends, as a full plan has it.
        live.borrow_mut().remove(&b);
        apply_strict(&mut maps, &set_with_handoffs(&mut p, &b, &[], &specs_of));
        assert_eq!(backends_of(&maps, shared), only("10.244.1.9"));
        assert!(!maps
            .services
            .keys()
            .any(|k| k.frontend == frontend("10.96.0.2", 80)));
        assert_eq!(resolved(&maps), resolved(&p.contents()));

        // a deleted too: nothing is left.
        live.borrow_mut().remove(&a);
        apply_strict(&mut maps, &set_with_handoffs(&mut p, &a, &[], &specs_of));
        assert!(maps.services.is_empty(), "{:?}", maps.services);
        assert!(maps.backends.is_empty() && maps.rev_nat.is_empty());
    }

    // The one that waits leaving first changes nothing at the address.
    let mut p = Planner::new();
    let mut maps = Contents::default();
    live.borrow_mut().clear();
    for (s, specs) in [(&a, &a_specs), (&b, &b_specs)] {
        live.borrow_mut().insert(s.clone(), specs.clone());
        apply_strict(&mut maps, &set_with_handoffs(&mut p, s, specs, &specs_of));
    }
    live.borrow_mut().remove(&a);
    let ops = set_with_handoffs(&mut p, &a, &[], &specs_of);
    assert!(
        !ops.iter()
            .any(|op| matches!(op, Op::DeleteService(k) if k.frontend == shared)),
        "{ops:?}"
    );
    apply_strict(&mut maps, &ops);
    assert_eq!(backends_of(&maps, shared), only("10.244.2.2"));
}

#[test]
fn two_specs_for_one_address_in_one_call_leave_the_last_one_whole() {
    // What a Service listing one port number twice gave before validation refused it: each
    // spec's slots were planned in turn into one batch, and the first one's slot delete went
    // after the second one's write.
    let mut p = Planner::new();
    let mut maps = Contents::default();
    let vip = frontend("10.96.0.1", 80);
    for (first, second) in [
        (
            &["10.244.0.1", "10.244.0.2"][..],
            &["10.244.0.3", "10.244.0.4"][..],
        ),
        (&["10.244.0.1"][..], &["10.244.0.3", "10.244.0.4"][..]),
    ] {
        let ops = p
            .set_service(
                &svc("twice"),
                &[spec("10.96.0.1", first), spec("10.96.0.1", second)],
            )
            .expect("ids");
        apply_strict(&mut maps, &ops);
        assert_eq!(resolved(&maps), resolved(&p.contents()), "{ops:?}");
        let want: BTreeSet<Backend> = second.iter().map(|b| backend(b)).collect();
        assert_eq!(backends_of(&maps, vip), want);
    }
}

/// The backends a frontend's Maglev table names, entry by entry (through its slots), checking
/// that every entry is a slot within the count.
fn maglev_backends(maps: &Contents, addr: FrontendAddr) -> Vec<Backend> {
    let head = maps.services[&ServiceKey {
        frontend: addr,
        slot: 0,
    }];
    assert_ne!(
        head.flags & FLAG_MAGLEV,
        0,
        "{addr:?} is not flagged Maglev"
    );
    let table = &maps.maglev[&head.rev_nat];
    table
        .slots()
        .iter()
        .map(|&slot| {
            assert!(
                (1..=head.count).contains(&slot),
                "{addr:?}: slot {slot} of {}",
                head.count
            );
            maps.backends[&maps.services[&ServiceKey {
                frontend: addr,
                slot,
            }]
                .backend_id]
        })
        .collect()
}

fn addresses(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("10.244.1.{i}")).collect()
}

#[test]
fn with_maglev_each_frontend_with_backends_has_a_table_of_its_backends() {
    let mut planner = Planner::with_scheduler(Scheduler::Maglev);
    let mut maps = Contents::default();
    let names = addresses(5);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let ops = planner
        .set_service(
            &svc("a"),
            &[spec("10.96.0.1", &refs), spec("10.96.0.2", &[])],
        )
        .expect("plan");
    apply(&mut maps, &ops);
    assert_eq!(maps, planner.contents());
    let named = maglev_backends(&maps, frontend("10.96.0.1", 80));
    assert_eq!(named.len(), layout::MAGLEV_M);
    let set: BTreeSet<Backend> = named.iter().copied().collect();
    assert_eq!(set, backends_of(&maps, frontend("10.96.0.1", 80)));
    // Without backends: no table, no flag.
    assert_eq!(maps.maglev.len(), 1);
    let empty = maps.services[&ServiceKey {
        frontend: frontend("10.96.0.2", 80),
        slot: 0,
    }];
    assert_eq!(empty.flags & FLAG_MAGLEV, 0);

    // A random planner writes none.
    let mut random = Planner::new();
    let ops = random
        .set_service(&svc("a"), &[spec("10.96.0.1", &refs)])
        .expect("plan");
    assert!(!ops
        .iter()
        .any(|op| matches!(op, Op::UpsertMaglev(..) | Op::DeleteMaglev(..))));
    assert!(random.contents().maglev.is_empty());
}

#[test]
fn with_maglev_a_one_endpoint_change_rewrites_that_frontends_table_only() {
    let mut planner = Planner::with_scheduler(Scheduler::Maglev);
    let mut maps = Contents::default();
    let names = addresses(10);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let other = ["10.244.2.1", "10.244.2.2"];
    apply(
        &mut maps,
        &planner
            .set_service(&svc("a"), &[spec("10.96.0.1", &refs)])
            .expect("plan"),
    );
    apply(
        &mut maps,
        &planner
            .set_service(&svc("b"), &[spec("10.96.0.2", &other)])
            .expect("plan"),
    );
    let before = maglev_backends(&maps, frontend("10.96.0.1", 80));
    let untouched = maps.maglev.clone();

    // One endpoint leaves: its slot is refilled, and one table update follows.
    let fewer: Vec<&str> = refs
        .iter()
        .copied()
        .filter(|b| *b != "10.244.1.4")
        .collect();
    let ops = planner
        .set_service(&svc("a"), &[spec("10.96.0.1", &fewer)])
        .expect("plan");
    let tables: Vec<&Op> = ops
        .iter()
        .filter(|op| matches!(op, Op::UpsertMaglev(..) | Op::DeleteMaglev(..)))
        .collect();
    assert_eq!(tables.len(), 1, "{ops:?}");
    apply(&mut maps, &ops);
    assert_eq!(maps, planner.contents());
    let after = maglev_backends(&maps, frontend("10.96.0.1", 80));
    let gone = backend("10.244.1.4");
    assert!(!after.contains(&gone));
    let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
    let own = before.iter().filter(|b| **b == gone).count();
    assert!(
        moved >= own && moved < 2 * layout::MAGLEV_M / 10,
        "{moved}, own {own}"
    );
    // The other frontend's table is as it was.
    let b_rev = maps.services[&ServiceKey {
        frontend: frontend("10.96.0.2", 80),
        slot: 0,
    }]
        .rev_nat;
    assert_eq!(maps.maglev[&b_rev], untouched[&b_rev]);

    // A change that keeps the backends writes no table.
    let mut sticky = spec("10.96.0.1", &fewer);
    sticky.affinity = Some(60);
    let ops = planner.set_service(&svc("a"), &[sticky]).expect("plan");
    assert!(
        !ops.iter().any(|op| matches!(op, Op::UpsertMaglev(..))),
        "{ops:?}"
    );
    apply(&mut maps, &ops);

    // The last endpoints leave: the table goes with the flag; the Service goes: so does b's.
    let ops = planner
        .set_service(&svc("a"), &[spec("10.96.0.1", &[])])
        .expect("plan");
    assert!(ops.iter().any(|op| matches!(op, Op::DeleteMaglev(..))));
    apply(&mut maps, &ops);
    assert_eq!(maps.maglev.len(), 1);
    apply(
        &mut maps,
        &planner.set_service(&svc("b"), &[]).expect("plan"),
    );
    assert!(maps.maglev.is_empty());
    assert_eq!(maps, planner.contents());
}

#[test]
fn a_maglev_table_is_the_same_whatever_the_ids_and_order_of_its_backends() {
    let names = addresses(6);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut first = Planner::with_scheduler(Scheduler::Maglev);
    let mut first_maps = Contents::default();
    apply(
        &mut first_maps,
        &first
            .set_service(&svc("a"), &[spec("10.96.0.1", &refs)])
            .expect("plan"),
    );
    // Another planner that handed out other ids first, and lists the backends reversed.
    let mut second = Planner::with_scheduler(Scheduler::Maglev);
    let mut second_maps = Contents::default();
    apply(
        &mut second_maps,
        &second
            .set_service(
                &svc("z"),
                &[spec("10.96.0.9", &["10.244.9.1", "10.244.9.2"])],
            )
            .expect("plan"),
    );
    let reversed: Vec<&str> = refs.iter().rev().copied().collect();
    apply(
        &mut second_maps,
        &second
            .set_service(&svc("a"), &[spec("10.96.0.1", &reversed)])
            .expect("plan"),
    );
    let id = |maps: &Contents| {
        maps.services[&ServiceKey {
            frontend: frontend("10.96.0.1", 80),
            slot: 1,
        }]
            .backend_id
    };
    assert_ne!(id(&first_maps), id(&second_maps), "the ids should differ");
    assert_eq!(
        maglev_backends(&first_maps, frontend("10.96.0.1", 80)),
        maglev_backends(&second_maps, frontend("10.96.0.1", 80))
    );
}

#[test]
fn diff_and_a_full_plan_cover_the_maglev_tables() {
    let mut state_planner = Planner::with_scheduler(Scheduler::Maglev);
    let mut maps = Contents::default();
    let names = addresses(3);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    apply(
        &mut maps,
        &state_planner
            .set_service(&svc("a"), &[spec("10.96.0.1", &refs)])
            .expect("plan"),
    );
    let want = state_planner.contents();
    assert_eq!(diff(&maps, &want), vec![]);

    // A table rewritten behind the planner's back (every entry the first slot) is drift.
    let (rev, table) = maps.maglev.iter().next().expect("a table");
    let (rev, table) = (*rev, table.clone());
    let broken = MaglevTable::new(vec![1; layout::MAGLEV_M]).expect("table");
    assert_ne!(broken, table);
    maps.maglev.insert(rev, broken);
    assert_eq!(diff(&maps, &want), vec![Op::UpsertMaglev(rev, table)]);
    // So is a table nobody plans, and a missing one.
    maps.maglev.insert(
        rev + 100,
        MaglevTable::new(vec![1; layout::MAGLEV_M]).expect("t"),
    );
    maps.maglev.remove(&rev);
    let ops = diff(&maps, &want);
    assert!(ops.contains(&Op::DeleteMaglev(rev + 100)), "{ops:?}");
    assert!(ops
        .iter()
        .any(|op| matches!(op, Op::UpsertMaglev(r, _) if *r == rev)));
    apply(&mut maps, &ops);
    assert_eq!(maps, want);

    // A random plan of the same Service deletes the table and clears the flag.
    let mut random = Planner::new();
    random
        .set_service(&svc("a"), &[spec("10.96.0.1", &refs)])
        .expect("plan");
    let ops = diff(&maps, &random.contents());
    assert!(ops.contains(&Op::DeleteMaglev(rev)), "{ops:?}");
    apply(&mut maps, &ops);
    assert!(maps.maglev.is_empty());
}

#[test]
fn a_maglev_table_reads_back_from_its_bytes() {
    let slots: Vec<u16> = (0..layout::MAGLEV_M).map(|i| (i % 7 + 1) as u16).collect();
    let t = MaglevTable::new(slots.clone()).expect("table");
    let bytes = t.to_bytes();
    assert_eq!(bytes.len(), layout::MAGLEV_VALUE_SIZE);
    assert_eq!(
        &bytes[..4],
        [1u16.to_ne_bytes(), 2u16.to_ne_bytes()].concat()
    );
    assert_eq!(MaglevTable::from_bytes(&bytes), Some(t.clone()));
    assert_eq!(t.slot_for(layout::MAGLEV_M as u32 + 2), 3);
    // A slot 0 (never written) or another size does not read.
    let mut zero = bytes;
    zero[10] = 0;
    zero[11] = 0;
    assert_eq!(MaglevTable::from_bytes(&zero), None);
    assert_eq!(MaglevTable::from_bytes(&bytes[2..]), None);
    assert_eq!(MaglevTable::new(slots[1..].to_vec()), None);
}

#[test]
fn client_hashes_spread_over_the_table() {
    // Client addresses 192.0.2.0..=255: every entry index in range and far from all alike.
    let idx: BTreeSet<usize> = (0..=255u8)
        .map(|i| layout::maglev_index(layout::address_hash(IpAddr::from([192, 0, 2, i]))))
        .collect();
    assert!(idx.iter().all(|i| *i < layout::MAGLEV_M));
    assert!(idx.len() > 200, "{} distinct entries", idx.len());
    // The address as the programs see it: IPv4-mapped, so v4 and its mapped v6 agree.
    let v4 = IpAddr::from([192, 0, 2, 7]);
    let mapped = IpAddr::V6(std::net::Ipv4Addr::new(192, 0, 2, 7).to_ipv6_mapped());
    assert_eq!(layout::address_hash(v4), layout::address_hash(mapped));
    assert_ne!(layout::netns_hash(1), layout::netns_hash(1 << 32));
}

/// `spec` for UDP port 53 (dns), of the socket hooks or of outside traffic.
fn udp_spec(addr: &str, backends: &[&str], scope: Scope) -> FrontendSpec {
    let mut s = spec(addr, backends);
    s.addr.port = 53;
    s.addr.protocol = Protocol::Udp;
    s.addr.scope = scope;
    for b in &mut s.backends {
        b.port = 5353;
        b.protocol = Protocol::Udp;
    }
    s
}

fn stale(frontend: &str, backend: &str) -> StaleUdp {
    StaleUdp {
        frontend: SocketAddr::new(ip(frontend), 53),
        backend: SocketAddr::new(ip(backend), 5353),
    }
}

#[test]
fn a_udp_backend_that_leaves_a_frontend_is_stale_for_it_until_taken() {
    let mut planner = Planner::new();
    let dns = svc("dns");
    let both = [
        udp_spec("10.96.0.53", &["10.244.1.1", "10.244.2.2"], Scope::Socket),
        udp_spec("fd00:10:96::53", &["fd00:10:244::1"], Scope::Socket),
        // Outside traffic has no sockets to destroy; TCP none that stay stuck.
        udp_spec("203.0.113.10", &["10.244.1.1"], Scope::Outside),
        spec("10.96.0.53", &["10.244.1.1"]),
    ];
    planner.set_service(&dns, &both).unwrap();
    assert_eq!(planner.take_stale_udp(), []);

    // 10.244.1.1 leaves every frontend, the IPv6 Service port goes.
    let after = [
        udp_spec("10.96.0.53", &["10.244.2.2"], Scope::Socket),
        udp_spec("203.0.113.10", &[], Scope::Outside),
        spec("10.96.0.53", &[]),
    ];
    planner.set_service(&dns, &after).unwrap();
    assert_eq!(
        planner.take_stale_udp(),
        [
            stale("10.96.0.53", "10.244.1.1"),
            stale("fd00:10:96::53", "fd00:10:244::1"),
        ]
    );
    assert_eq!(planner.take_stale_udp(), [], "taken once");

    // Gone and back within the batches before a take: not stale.
    planner
        .set_service(&dns, &[udp_spec("10.96.0.53", &[], Scope::Socket)])
        .unwrap();
    planner
        .set_service(
            &dns,
            &[udp_spec("10.96.0.53", &["10.244.2.2"], Scope::Socket)],
        )
        .unwrap();
    assert_eq!(planner.take_stale_udp(), []);

    // The Service deleted: its frontend's last backend is stale.
    planner.set_service(&dns, &[]).unwrap();
    assert_eq!(
        planner.take_stale_udp(),
        [stale("10.96.0.53", "10.244.2.2")]
    );
}

#[test]
fn a_full_sync_finds_the_udp_pairs_the_maps_have_and_the_plan_has_not() {
    let dns = svc("dns");
    let plan = |backends: &[&str]| {
        let mut p = Planner::new();
        p.set_service(
            &dns,
            &[
                udp_spec("10.96.0.53", backends, Scope::Socket),
                udp_spec("10.96.0.54", backends, Scope::Outside),
            ],
        )
        .unwrap();
        p.contents()
    };
    let have = plan(&["10.244.1.1", "10.244.2.2"]);
    let want = plan(&["10.244.2.2", "10.244.3.3"]);
    assert_eq!(stale_udp(&have, &want), [stale("10.96.0.53", "10.244.1.1")]);
    assert_eq!(stale_udp(&want, &want), []);
    assert_eq!(stale_udp(&Contents::default(), &want), []);
}

#[test]
fn a_stale_udp_key_reads_back_with_the_offsets_the_iterator_uses() {
    let pair = StaleUdp {
        frontend: "10.96.0.53:53".parse().unwrap(),
        backend: "[fd00:10:244::1]:5353".parse().unwrap(),
    };
    let bytes = pair.to_bytes();
    assert_eq!(&bytes[10..16], &[0xff, 0xff, 10, 96, 0, 53]);
    assert_eq!(&bytes[32..36], &[0, 53, 0x14, 0xe9]);
    assert_eq!(StaleUdp::from_bytes(&bytes), Some(pair));
    assert_eq!(StaleUdp::from_bytes(&bytes[..39]), None);
}
