use kp_core::model::{Protocol, ServiceKey as ServiceName};
use kp_core::node::NodePortAddresses;
use kp_core::track::{Object, ProxyState, SourceEvent};
use kp_ebpf_plan::{node_port_addresses, plan_state, service_specs, Planner};

use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// The fixture's maps as a full sync plans them, with the planner for later changes.
fn planned(state: &ProxyState) -> (Planner, EbpfTracer) {
    let planner = plan_state(state, &NodePortAddresses::Primary, &[]).expect("plan");
    let tracer = EbpfTracer::new(planner.contents(), kp_flows::node_addresses());
    (planner, tracer)
}

fn fixture() -> EbpfTracer {
    planned(&kp_flows::state()).1
}

/// The rows `tracer` fails, by name, as the mode declares them.
fn failing(tracer: &EbpfTracer) -> Vec<String> {
    crate::check_table(tracer)
}

fn names_row(failures: &[String], row: &str) -> bool {
    failures.iter().any(|f| f.starts_with(row))
}

#[test]
fn the_flow_table_passes_over_the_planned_maps() {
    let tracer = fixture();
    assert_eq!(tracer.problems(), Vec::<String>::new());
    let failures = failing(&tracer);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Without the declaration, exactly the rows it covers fail: the declaration is what lets them
/// pass, and it covers nothing the tracer passes anyway by luck.
#[test]
fn undeclared_the_table_fails_exactly_on_the_rows_the_declaration_covers() {
    let tracer = fixture();
    let failures = kp_flows::check_tracer(&tracer);
    let covered: Vec<&str> = kp_flows::cases()
        .into_iter()
        .filter(|c| crate::declared(c).is_some())
        .map(|c| c.name)
        .collect();
    assert!(covered.len() >= 3, "{covered:?}");
    assert_eq!(failures.len(), covered.len(), "{}", failures.join("\n"));
    for name in covered {
        assert!(names_row(&failures, name), "{name} passes undeclared");
    }
    // And the failures say why the row is held to something else.
    let failures = kp_flows::check_tracer_for(
        &EbpfTracer::new(Contents::default(), vec![]),
        crate::SUPPORT,
    );
    assert!(
        failures.iter().any(|f| f.contains(crate::SUPPORT.reason)),
        "{}",
        failures.join("\n")
    );
}

#[test]
fn from_outside_the_outside_entries_decide_source_and_backends() {
    // Without the outside-scope entries, externalTrafficPolicy Local rows from outside go to
    // every endpoint, masqueraded, and the source ranges are not checked.
    let mut tracer = fixture();
    tracer
        .maps_mut()
        .services
        .retain(|k, _| k.frontend.scope == kp_ebpf_plan::Scope::Socket);
    let failures = failing(&tracer);
    for row in [
        "externalTrafficPolicy Local: NodePort uses local endpoints and keeps the source",
        "externalTrafficPolicy Local: an ExternalIP uses local endpoints and keeps the source",
        "externalTrafficPolicy Local without local endpoints drops external traffic",
        "LoadBalancer IP from outside the source ranges drops",
    ] {
        assert!(names_row(&failures, row), "{row}: {}", failures.join("\n"));
    }
    // Without the ranges, every source is refused.
    let mut tracer = fixture();
    assert!(!tracer.maps().ranges.is_empty());
    tracer.maps_mut().ranges.clear();
    let failures = failing(&tracer);
    assert_eq!(failures.len(), 1, "{}", failures.join("\n"));
    assert!(names_row(
        &failures,
        "LoadBalancer IP from inside the source ranges is served"
    ));
    // Masquerading where the source is to be kept fails the Local rows.
    let mut tracer = fixture();
    for v in tracer.maps_mut().services.values_mut() {
        v.flags &= !kp_ebpf_plan::FLAG_KEEP_SOURCE;
    }
    let failures = failing(&tracer);
    assert!(
        names_row(
            &failures,
            "externalTrafficPolicy Local: NodePort uses local endpoints and keeps the source"
        ),
        "{}",
        failures.join("\n")
    );
}

#[test]
fn a_plan_with_a_wrong_backend_fails_the_table() {
    let mut tracer = fixture();
    let pod1 = ip("10.244.1.11");
    for b in tracer.maps_mut().backends.values_mut() {
        if b.ip == pod1 {
            b.ip = ip("10.244.1.99");
        }
    }
    let failures = failing(&tracer);
    assert!(
        names_row(&failures, "pod to ClusterIP spreads over all endpoints"),
        "{}",
        failures.join("\n")
    );
    assert!(names_row(&failures, "hairpin"), "{}", failures.join("\n"));
}

#[test]
fn a_frontend_that_rejects_instead_of_dropping_fails_the_table() {
    let mut tracer = fixture();
    for v in tracer.maps_mut().services.values_mut() {
        v.flags &= !kp_ebpf_plan::FLAG_DROP_EMPTY;
    }
    let failures = failing(&tracer);
    assert_eq!(failures.len(), 1, "{}", failures.join("\n"));
    assert!(names_row(
        &failures,
        "internalTrafficPolicy Local without local endpoints drops"
    ));
}

#[test]
fn without_the_address_map_unknown_ports_and_unallocated_cluster_ips_fail() {
    let mut tracer = fixture();
    tracer.maps_mut().addrs.clear();
    let failures = failing(&tracer);
    for row in [
        "a ClusterIP on a port no Service uses is rejected",
        "traffic to an unallocated ClusterIP is dropped",
        "UDP to an unallocated ClusterIP is dropped",
        "traffic to an unallocated IPv6 ClusterIP is dropped",
    ] {
        assert!(names_row(&failures, row), "{row}: {}", failures.join("\n"));
    }
}

#[test]
fn without_its_affinity_timeout_the_sticky_service_fails() {
    let mut tracer = fixture();
    for v in tracer.maps_mut().services.values_mut() {
        v.affinity = 0;
    }
    let failures = failing(&tracer);
    assert_eq!(failures.len(), 1, "{}", failures.join("\n"));
    assert!(names_row(&failures, "ClientIP affinity sticks"));
}

/// The affinity a verdict reports, `None` for anything but a DNAT.
fn affinity_of(v: &Verdict) -> Option<u32> {
    match v {
        Verdict::Dnat { affinity, .. } => *affinity,
        _ => None,
    }
}

/// From outside the node the tc path sticks the client's address as the socket hooks stick its
/// namespace: a packet from outside through a frontend with an affinity timeout reports it,
/// taken from the entry the tc path uses (the outside-scope one where there is one).
#[test]
fn from_outside_a_sticky_frontend_reports_its_affinity_timeout() {
    let mut tracer = fixture();
    let from_client = |dst: &str, dport| Packet {
        origin: Origin::External,
        src: ip(kp_flows::CLIENT),
        protocol: Protocol::Tcp,
        dst: ip(dst),
        dport,
    };
    // sticky's ClusterIP routed to the node (timeout 60 s): its socket-scope entry.
    let sticky = from_client("10.96.0.30", 80);
    let v = tracer.trace(&sticky);
    assert!(
        matches!(
            v,
            Verdict::Dnat {
                masquerade: true,
                ..
            }
        ),
        "{v:?}"
    );
    assert_eq!(affinity_of(&v), Some(60), "{v:?}");
    // web (no affinity) from outside reports none.
    assert_eq!(
        affinity_of(&tracer.trace(&from_client(kp_flows::NODE_IP, 30080))),
        None
    );

    // The Local-policy NodePort (30070) has an outside-scope entry beside its socket one; the
    // tc path reads the outside one's timeout only.
    let local = from_client(kp_flows::NODE_IP, 30070);
    let head = |scope| ServiceKey {
        frontend: FrontendAddr {
            ip: local.dst,
            port: local.dport,
            protocol: Protocol::Tcp,
            scope,
        },
        slot: 0,
    };
    let outside = head(kp_ebpf_plan::Scope::Outside);
    let socket = head(kp_ebpf_plan::Scope::Socket);
    assert!(tracer.maps().services.contains_key(&outside));
    assert_eq!(affinity_of(&tracer.trace(&local)), None);
    tracer
        .maps_mut()
        .services
        .get_mut(&socket)
        .expect("socket entry")
        .affinity = 30;
    assert_eq!(affinity_of(&tracer.trace(&local)), None);
    tracer
        .maps_mut()
        .services
        .get_mut(&outside)
        .expect("outside entry")
        .affinity = 20;
    let v = tracer.trace(&local);
    assert!(
        matches!(
            v,
            Verdict::Dnat {
                masquerade: false,
                ..
            }
        ),
        "{v:?}"
    );
    assert_eq!(affinity_of(&v), Some(20), "{v:?}");
}

#[test]
fn a_dangling_slot_is_a_problem_and_refuses_its_frontend() {
    let mut tracer = fixture();
    let web = FrontendAddr {
        ip: ip("10.96.0.10"),
        port: 80,
        protocol: Protocol::Tcp,
        scope: kp_ebpf_plan::Scope::Socket,
    };
    let id = tracer.maps().services[&ServiceKey {
        frontend: web,
        slot: 2,
    }]
        .backend_id;
    // pod-2 also backs other Services: point the slot at an id nobody holds.
    tracer
        .maps_mut()
        .services
        .get_mut(&ServiceKey {
            frontend: web,
            slot: 2,
        })
        .expect("slot 2")
        .backend_id = id + 10_000;
    let problems = tracer.problems();
    assert_eq!(problems.len(), 1, "{problems:?}");
    let p = Packet {
        origin: Origin::Pod,
        src: ip("10.244.1.14"),
        protocol: Protocol::Tcp,
        dst: web.ip,
        dport: 80,
    };
    assert_eq!(tracer.trace(&p), Verdict::Reject);
    tracer.maps_mut().rev_nat.clear();
    assert!(tracer.problems().len() > 10);
}

/// What each frontend leads to, whatever ids the maps use: its backends, flags and affinity.
fn resolved(
    maps: &Contents,
) -> std::collections::BTreeMap<FrontendAddr, (BTreeSet<Backend>, u8, u32)> {
    maps.services
        .iter()
        .filter(|(k, _)| k.slot == 0)
        .map(|(k, v)| {
            let backends = (1..=v.count)
                .map(|slot| {
                    let id = maps.services[&ServiceKey { slot, ..*k }].backend_id;
                    maps.backends[&id]
                })
                .collect();
            (k.frontend, (backends, v.flags, v.affinity))
        })
        .collect()
}

/// A slice update planned incrementally lands the maps where a fresh full plan puts them, and
/// the tracer follows: one endpoint, then none (rejected), then back.
#[test]
fn incremental_changes_reach_the_same_maps_as_a_full_plan() {
    let mut state = kp_flows::state();
    let (mut planner, mut tracer) = planned(&state);
    let web = ServiceName::new("default", "web");
    let p = Packet {
        origin: Origin::Pod,
        src: ip("10.244.1.14"),
        protocol: Protocol::Tcp,
        dst: ip("10.96.0.10"),
        dport: 80,
    };
    for (pods, want) in [
        (
            &["pod-2"][..],
            Some(BTreeSet::from([(ip("10.244.1.12"), kp_flows::TCP_PORT)])),
        ),
        (&[][..], None),
        (&["pod-1", "pod-2", "pod-3"][..], None),
    ] {
        state
            .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
                kp_flows::web_slice(pods),
            ))))
            .expect("slice");
        state.take_changes();
        let nodes = node_port_addresses(&NodePortAddresses::Primary, &state, &[]);
        let ops = planner
            .set_service(&web, &service_specs(&state, &web, &nodes))
            .expect("plan");
        assert!(ops.len() <= 8, "{} updates: {ops:?}", ops.len());
        tracer.apply(&ops);
        assert_eq!(
            resolved(tracer.maps()),
            resolved(&planned(&state).0.contents())
        );
        assert_eq!(tracer.maps().addrs, planned(&state).0.contents().addrs);
        match (tracer.trace(&p), want, pods.is_empty()) {
            (Verdict::Dnat { endpoints, .. }, Some(want), _) => assert_eq!(endpoints, want),
            (Verdict::Reject, None, true) => {}
            (Verdict::Dnat { endpoints, .. }, None, false) => {
                assert_eq!(endpoints.len(), 3)
            }
            (got, _, _) => panic!("{pods:?}: {got:?}"),
        }
        assert_eq!(tracer.problems(), Vec::<String>::new());
    }
    let failures = failing(&tracer);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Where NodePorts answer, per `nodePortAddresses`: the Node's addresses for `primary`, every
/// interface address when unset, those inside the CIDRs of their family otherwise.
#[test]
fn node_ports_answer_where_node_port_addresses_says() {
    let state = kp_flows::state();
    let local = [
        ip(kp_flows::NODE_POD_GATEWAY),
        ip(kp_flows::NODE_IP),
        ip(kp_flows::NODE_IP6),
    ];
    assert_eq!(
        node_port_addresses(&NodePortAddresses::Primary, &state, &local),
        vec![ip(kp_flows::NODE_IP), ip(kp_flows::NODE_IP6)]
    );
    assert_eq!(
        node_port_addresses(&NodePortAddresses::AllLocal, &state, &local),
        local.to_vec()
    );
    let v4_only = NodePortAddresses::Cidrs(vec!["192.0.2.0/24".parse().expect("cidr")]);
    assert_eq!(
        node_port_addresses(&v4_only, &state, &local),
        vec![ip(kp_flows::NODE_IP), ip(kp_flows::NODE_IP6)]
    );
    // Unset: the pod-network gateway answers too, which `primary` leaves alone.
    let planner = plan_state(&state, &NodePortAddresses::AllLocal, &local).expect("plan");
    let tracer = EbpfTracer::new(planner.contents(), kp_flows::node_addresses());
    let p = Packet {
        origin: Origin::Pod,
        src: ip("10.244.1.14"),
        protocol: Protocol::Tcp,
        dst: ip(kp_flows::NODE_POD_GATEWAY),
        dport: 30080,
    };
    assert!(matches!(tracer.trace(&p), Verdict::Dnat { .. }));
    assert_eq!(fixture().trace(&p), Verdict::Untouched);
}

/// Drift is what the frontends lead to, not the ids that encode it: maps numbered otherwise
/// agree with the plan; a frontend's head, a backend and an address entry lost or changed are
/// each named.
#[test]
fn differences_name_what_a_frontend_lost_whatever_ids_the_maps_use() {
    let planned = fixture();
    assert_eq!(planned.differences(&planned), Vec::<String>::new());

    // Every backend renumbered: other bytes in the maps, the same frontends.
    let mut renumbered = planned.clone();
    let maps = renumbered.maps_mut();
    maps.backends = maps
        .backends
        .iter()
        .map(|(id, b)| (id + 1000, *b))
        .collect();
    for (k, v) in maps.services.iter_mut() {
        if k.slot != 0 {
            v.backend_id += 1000;
        }
    }
    assert!(!kp_ebpf_plan::diff(renumbered.maps(), planned.maps()).is_empty());
    assert_eq!(renumbered.differences(&planned), Vec::<String>::new());

    let web = FrontendAddr {
        ip: ip("10.96.0.10"),
        port: 80,
        protocol: Protocol::Tcp,
        scope: Scope::Socket,
    };
    let mut lost_head = planned.clone();
    lost_head.maps_mut().services.remove(&ServiceKey {
        frontend: web,
        slot: 0,
    });
    let d = lost_head.differences(&planned);
    assert!(
        d.iter().any(|l| l
            == "kp_services: frontend 10.96.0.10:80/tcp (socket hooks) is missing from the kernel"),
        "{d:#?}"
    );
    // Its slots stay behind, which the programs would never reach: said too.
    assert!(d.iter().any(|l| l.starts_with("in the kernel: ")), "{d:#?}");

    let mut moved = planned.clone();
    let slot = moved.maps().services[&ServiceKey {
        frontend: web,
        slot: 1,
    }]
        .backend_id;
    moved
        .maps_mut()
        .backends
        .get_mut(&slot)
        .expect("backend")
        .port = 9;
    let d = moved.differences(&planned);
    assert!(
        d.iter().any(|l| l
            .starts_with("kp_services: frontend 10.96.0.10:80/tcp (socket hooks) leads to [")
            && l.contains(":9")),
        "{d:#?}"
    );

    let mut no_addr = planned.clone();
    let key = AddrKey::host(ip("10.96.0.10"));
    assert!(no_addr.maps_mut().addrs.remove(&key).is_some());
    let d = no_addr.differences(&planned);
    assert_eq!(
        d,
        ["kp_addrs: 10.96.0.10/32 (Reject) is missing from the kernel"],
        "{d:#?}"
    );
}

/// The fixture's maps as a full sync plans them under `sh`/`mh`.
fn planned_maglev() -> EbpfTracer {
    let planner = kp_ebpf_plan::plan_state_with(
        &kp_flows::state(),
        &NodePortAddresses::Primary,
        &[],
        kp_ebpf_plan::Scheduler::Maglev,
        &Default::default(),
    )
    .expect("plan");
    EbpfTracer::new(planner.contents(), kp_flows::node_addresses())
}

fn web_node_port_from(src: IpAddr) -> Packet {
    Packet {
        origin: Origin::External,
        src,
        protocol: Protocol::Tcp,
        dst: ip(kp_flows::NODE_IP),
        dport: 30080,
    }
}

#[test]
fn with_maglev_the_flow_table_passes_and_an_outside_client_is_named_its_backend() {
    let tracer = planned_maglev();
    assert!(!tracer.maps().maglev.is_empty());
    assert_eq!(tracer.problems(), Vec::<String>::new());
    let failures = failing(&tracer);
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // Each client address is given one of the frontend's backends, the one its hash selects;
    // 64 addresses are given more than one.
    let Verdict::Dnat { endpoints, .. } = tracer.trace(&web_node_port_from(ip("192.0.2.2"))) else {
        panic!("web's NodePort is no DNAT");
    };
    let mut given = BTreeSet::new();
    for i in 0..64u8 {
        let src = IpAddr::from([192, 0, 2, 100 + i]);
        let b = tracer
            .pick_outside(&web_node_port_from(src))
            .expect("a Maglev pick");
        assert!(
            endpoints.contains(&(b.ip, b.port)),
            "{b:?} not in {endpoints:?}"
        );
        // The same as reading the table by hand.
        let head = tracer
            .maps()
            .services
            .iter()
            .find(|(k, _)| {
                k.slot == 0 && k.frontend.ip == ip(kp_flows::NODE_IP) && k.frontend.port == 30080
            })
            .map(|(k, v)| (*k, *v))
            .expect("web's NodePort");
        let slot =
            tracer.maps().maglev[&head.1.rev_nat].slot_for(kp_ebpf_plan::layout::address_hash(src));
        let id = tracer.maps().services[&ServiceKey { slot, ..head.0 }].backend_id;
        assert_eq!(tracer.maps().backends[&id], b);
        given.insert(b);
    }
    assert!(given.len() > 1, "{given:?}");

    // A random plan names none.
    assert_eq!(
        fixture().pick_outside(&web_node_port_from(ip("192.0.2.2"))),
        None
    );
}

#[test]
fn differences_and_problems_cover_the_maglev_tables() {
    let planned = planned_maglev();
    assert_eq!(planned.differences(&planned), Vec::<String>::new());
    let (&rev, table) = planned
        .maps()
        .maglev
        .iter()
        .find(|(_, t)| t.shares().len() > 1)
        .expect("a table of two backends or more");
    let count = table.shares().len();

    // One entry moved to another slot of the frontend: drift, though nothing is broken.
    let mut moved = planned.clone();
    let mut slots = table.slots().to_vec();
    slots[0] = slots[0] % u16::try_from(count).expect("count") + 1;
    moved
        .maps_mut()
        .maglev
        .insert(rev, kp_ebpf_plan::MaglevTable::new(slots).expect("table"));
    assert_eq!(moved.problems(), Vec::<String>::new());
    let d = moved.differences(&planned);
    assert!(
        d.len() == 1
            && d[0].contains(&format!(
                "names another backend than the plan in 1 of {}",
                kp_ebpf_plan::layout::MAGLEV_M
            )),
        "{d:#?}"
    );

    // The table gone: drift and a problem (the flag names a table that is not there).
    let mut lost = planned.clone();
    lost.maps_mut().maglev.remove(&rev);
    assert!(lost
        .problems()
        .iter()
        .any(|p| p.contains("flagged Maglev but kp_maglev has no table")));
    assert!(lost
        .differences(&planned)
        .iter()
        .any(|l| l.contains("has no Maglev table where the plan has one")));

    // A slot beyond the count, and a table of no frontend.
    let mut beyond = planned.clone();
    beyond.maps_mut().maglev.insert(
        rev,
        kp_ebpf_plan::MaglevTable::new(vec![u16::MAX; kp_ebpf_plan::layout::MAGLEV_M])
            .expect("table"),
    );
    beyond.maps_mut().maglev.insert(
        u16::MAX,
        kp_ebpf_plan::MaglevTable::new(vec![1; kp_ebpf_plan::layout::MAGLEV_M]).expect("table"),
    );
    let p = beyond.problems();
    assert!(
        p.iter().any(|l| l.contains(&format!(
            "{} Maglev entries name a slot beyond",
            kp_ebpf_plan::layout::MAGLEV_M
        ))),
        "{p:#?}"
    );
    assert!(
        p.iter()
            .any(|l| l.contains("which no frontend flagged Maglev has")),
        "{p:#?}"
    );

    // Random maps against a Maglev plan: every table is missing.
    let d = fixture().differences(&planned);
    assert!(
        d.iter()
            .any(|l| l.contains("has no Maglev table where the plan has one")),
        "{d:#?}"
    );
}

/// What `ops` do to the flow table's rows step by step, from `tracer`'s maps: each row that at
/// some step is decided otherwise than over the full maps and not left untouched either.
fn refused_on_the_way(tracer: &EbpfTracer, ops: &[Op]) -> Vec<String> {
    let cases = kp_flows::cases();
    let before: Vec<Verdict> = cases.iter().map(|c| tracer.trace(&c.packet)).collect();
    let mut maps = tracer.clone();
    let mut refused = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        maps.apply(std::slice::from_ref(op));
        for (case, was) in cases.iter().zip(&before) {
            let now = maps.trace(&case.packet);
            if now != *was && now != Verdict::Untouched {
                refused.push(format!(
                    "step {step} ({op:?}): {}: {was:?} became {now:?}",
                    case.name
                ));
            }
        }
    }
    refused
}

/// A stopped ebpf mode's socket hooks stay attached a while after their pins go (the kernel
/// frees a link after an RCU grace period and a work item), so they meet every state the
/// hand-over empties the maps through: in each, every flow-table row is decided as over the
/// full maps or left untouched for the next mode's rules, never refused or dropped instead. In
/// the reverse order (slots before their heads, addresses last) some state refuses a row the
/// full maps serve: the order is what holds it.
#[test]
fn handing_over_never_refuses_what_the_full_maps_serve() {
    let tracer = fixture();
    let ops = kp_ebpf_plan::hand_over_deletions(
        tracer.maps().addrs.keys().copied(),
        tracer.maps().services.keys().copied(),
    );
    let refused = refused_on_the_way(&tracer, &ops);
    assert!(refused.is_empty(), "{}", refused.join("\n"));
    let mut emptied = tracer.clone();
    emptied.apply(&ops);
    assert!(emptied.maps().services.is_empty() && emptied.maps().addrs.is_empty());
    for case in kp_flows::cases() {
        assert_eq!(
            emptied.trace(&case.packet),
            Verdict::Untouched,
            "{}",
            case.name
        );
    }
    let reversed: Vec<Op> = ops.iter().rev().cloned().collect();
    let refused = refused_on_the_way(&tracer, &reversed);
    assert!(
        refused.iter().any(|r| r.contains("DeleteService"))
            && refused.iter().any(|r| r.contains("became Reject")),
        "{}",
        refused.join("\n")
    );
}
