//! The netlink reader against a real kernel: tables rendered by the real planner and loaded
//! with nft into a namespace of the test's own, then read back both ways. The reader must agree
//! with `nft -j list table` (parsed by `parse_table`) and with the planner, and must notice a
//! change made behind the planner's back.
//!
//! Run: `cargo test -p kp-nftables --test netlink -- --include-ignored` (as root).
//! `KP_NETLINK_SERVICES=10000` scales the timing test up (default 2000 Services × 10 endpoints).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use kp_core::model::IpFamily;
use kp_core::track::{Kind, ProxyState, SourceEvent};
use kp_nftables::netlink::{self, SetSchema};
use kp_nftables::{canonical, parse_table, Error, KernelTable, NftCommand};
use kp_nftables_plan::element::{Atom, NoEndpointVerdict, Tuple};
use kp_nftables_plan::names::{self, TABLE};
use kp_nftables_plan::{layout, NodeContext, PlanConfig, Planner};
use kp_test::netns::{require_root, Netns};

/// detect-local and restricted NodePorts, so that both single-field interval sets hold
/// elements.
fn plan_config(family: IpFamily) -> PlanConfig {
    PlanConfig {
        detect_local: true,
        node_ports_restricted: true,
        ..PlanConfig::new(family)
    }
}

/// NodePort addresses chosen for the interval edge cases: a range starting at address zero,
/// a single address, two adjacent ranges that do not merge into one prefix, and a range
/// reaching the top of the address space (nft stores no end for it).
fn node_context() -> NodeContext {
    let nets = [kp_flows::CLUSTER_CIDR, "fd00:10:244::/48"];
    let node_ports = [
        "0.0.0.0/8",
        "192.0.2.1/32",
        "198.51.100.0/25",
        "198.51.100.128/26",
        "255.255.255.0/24",
        "::/16",
        "2001:db8::1/128",
        "2001:db8:1::/49",
        "2001:db8:1:8000::/50",
        "ffff::/16",
    ];
    NodeContext {
        local_cidrs: nets.iter().map(|n| n.parse().unwrap()).collect(),
        node_port_addresses: node_ports.iter().map(|n| n.parse().unwrap()).collect(),
        ..NodeContext::default()
    }
}

/// Plans full tables for both families and loads them into `ns`.
fn load(ns: &Netns, state: &ProxyState) -> Vec<Planner> {
    let nft = NftCommand::in_netns(ns.name());
    IpFamily::ALL
        .into_iter()
        .map(|f| {
            let mut p = Planner::new(plan_config(f));
            let tx = p.full(state, &node_context());
            nft.run(&tx.text)
                .unwrap_or_else(|e| panic!("loading the {f:?} table: {e}"));
            p
        })
        .collect()
}

/// The schema of every set the planner made, none for the dynamic ones (as `verify` skips them).
fn schemas(p: &Planner) -> HashMap<String, SetSchema> {
    p.all_sets()
        .into_iter()
        .filter(|s| !s.is_dynamic())
        .map(|s| (s.name(), SetSchema::of(s)))
        .collect()
}

fn read_netlink(ns: &Netns, p: &Planner) -> KernelTable {
    let schemas = schemas(p);
    netlink::read_table(p.config().family, Some(ns.name()), &|name| {
        schemas.get(name).cloned()
    })
    .expect("netlink read")
}

fn read_nft(ns: &Netns, family: IpFamily) -> KernelTable {
    let json = NftCommand::in_netns(ns.name())
        .json(&["list", "table", names::family(family), TABLE])
        .expect("nft list table");
    parse_table(&json).expect("parse nft output")
}

/// What the planner says each chain holds, in the order a full load puts the rules.
fn planned_chains(p: &Planner) -> BTreeMap<String, Vec<String>> {
    let mut chains: BTreeMap<String, Vec<String>> = layout::chains()
        .into_iter()
        .map(|c| (c.name.to_string(), Vec::new()))
        .collect();
    for r in p.all_rules() {
        chains.entry(r.chain.to_string()).or_default().push(r.id);
    }
    chains
}

fn planned_sets(p: &Planner) -> BTreeMap<String, Option<BTreeMap<Tuple, Option<Tuple>>>> {
    p.all_sets()
        .into_iter()
        .map(|s| {
            let els = (!s.is_dynamic()).then(|| {
                p.expected_elements(s)
                    .iter()
                    .map(|(k, v)| (canonical(k), v.as_ref().map(canonical)))
                    .collect()
            });
            (s.name(), els)
        })
        .collect()
}

/// Differences between the netlink reading and nft's, one line each.
fn differences_from_nft(netlink: &KernelTable, nft: &KernelTable, p: &Planner) -> Vec<String> {
    let mut d = Vec::new();
    if netlink.chains != nft.chains {
        d.push(format!(
            "chains: netlink {:?}\n        nft {:?}",
            netlink.chains, nft.chains
        ));
    }
    let names = |t: &KernelTable| t.sets.keys().cloned().collect::<BTreeSet<_>>();
    if names(netlink) != names(nft) {
        d.push(format!(
            "set names: netlink {:?}, nft {:?}",
            names(netlink),
            names(nft)
        ));
    }
    let dynamic: BTreeSet<String> = p
        .all_sets()
        .into_iter()
        .filter(|s| s.is_dynamic())
        .map(|s| s.name())
        .collect();
    for (name, els) in &netlink.sets {
        if dynamic.contains(name) {
            continue;
        }
        if nft.sets.get(name) != Some(els) {
            d.push(format!(
                "set {name}: netlink {els:?}\n        nft {:?}",
                nft.sets.get(name)
            ));
        }
    }
    d
}

/// Differences between the netlink reading and the plan, one line each.
fn differences_from_plan(netlink: &KernelTable, p: &Planner) -> Vec<String> {
    let mut d = Vec::new();
    let chains = planned_chains(p);
    if netlink.chains != chains {
        d.push(format!(
            "chains: kernel {:?}\n        plan {chains:?}",
            netlink.chains
        ));
    }
    let sets = planned_sets(p);
    let names: BTreeSet<&String> = sets.keys().collect();
    let have: BTreeSet<&String> = netlink.sets.keys().collect();
    if names != have {
        d.push(format!("set names: kernel {have:?}, plan {names:?}"));
    }
    for (name, want) in &sets {
        let Some(want) = want else { continue };
        let have = netlink.sets.get(name);
        if have != Some(want) {
            let missing: Vec<_> = want
                .iter()
                .filter(|(k, v)| have.and_then(|h| h.get(*k)) != Some(v))
                .map(|(k, _)| k.to_string())
                .take(5)
                .collect();
            let extra: Vec<_> = have
                .into_iter()
                .flatten()
                .filter(|(k, _)| !want.contains_key(*k))
                .map(|(k, _)| k.to_string())
                .take(5)
                .collect();
            d.push(format!(
                "set {name}: missing or different {missing:?}, unexpected {extra:?}"
            ));
        }
    }
    d
}

/// Atoms of every kind the reader decodes, so a test proves it met them all.
#[derive(Debug, Default)]
struct Seen {
    nets: usize,
    single_addresses_in_interval_sets: usize,
    rejects: usize,
    drops: usize,
    map_values: usize,
    concatenated_ranges: usize,
}

fn tally(t: &KernelTable, seen: &mut Seen) {
    for (name, els) in &t.sets {
        for (k, v) in els {
            for a in k.atoms() {
                match a {
                    Atom::Net(_) => seen.nets += 1,
                    Atom::Ip(_) if name == names::NODEPORT_ADDRESSES => {
                        seen.single_addresses_in_interval_sets += 1
                    }
                    _ => {}
                }
            }
            if name == names::FIREWALL_ALLOW {
                seen.concatenated_ranges += 1;
            }
            match v.as_ref().map(|v| v.atoms()) {
                Some([Atom::Verdict(NoEndpointVerdict::Reject)]) => seen.rejects += 1,
                Some([Atom::Verdict(NoEndpointVerdict::Drop)]) => seen.drops += 1,
                Some(_) => seen.map_values += 1,
                None => {}
            }
        }
    }
}

#[test]
#[ignore = "needs root"]
fn the_netlink_reader_agrees_with_nft_and_with_the_plan_on_the_fixture_tables() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("netlink").expect("netns");
    let planners = load(&ns, &kp_flows::state());
    let mut seen = Seen::default();
    for p in &planners {
        let family = p.config().family;
        let netlink = read_netlink(&ns, p);
        let nft = read_nft(&ns, family);
        let d = differences_from_nft(&netlink, &nft, p);
        assert!(
            d.is_empty(),
            "{family:?}: netlink differs from nft:\n{}",
            d.join("\n")
        );
        let d = differences_from_plan(&netlink, p);
        assert!(
            d.is_empty(),
            "{family:?}: netlink differs from the plan:\n{}",
            d.join("\n")
        );
        tally(&netlink, &mut seen);
    }
    // The fixture must exercise every decoding path, or agreement proves little.
    assert!(seen.nets >= 11, "{seen:?}");
    assert!(seen.single_addresses_in_interval_sets >= 2, "{seen:?}");
    assert!(seen.rejects >= 1, "{seen:?}");
    assert!(seen.drops >= 1, "{seen:?}");
    assert!(seen.map_values >= 4, "{seen:?}");
    assert!(seen.concatenated_ranges >= 1, "{seen:?}");
}

#[test]
#[ignore = "needs root"]
fn the_netlink_reader_notices_an_element_deleted_behind_the_planners_back() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("netlink").expect("netns");
    let planners = load(&ns, &kp_flows::state());
    let v4 = &planners[0];
    assert_eq!(v4.config().family, IpFamily::V4);
    assert!(differences_from_plan(&read_netlink(&ns, v4), v4).is_empty());

    ns.run(&[
        "nft",
        "delete",
        "element",
        "ip",
        TABLE,
        names::CLUSTER_IPS,
        "{ 10.96.0.10 }",
    ])
    .expect("nft delete element");
    let d = differences_from_plan(&read_netlink(&ns, v4), v4);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(
        d[0].starts_with("set cluster-ips: missing or different [\"10.96.0.10\"], unexpected []"),
        "{d:?}"
    );

    // An element of a concatenated interval set, and of a verdict map.
    ns.run(&[
        "nft",
        "delete",
        "element",
        "ip",
        TABLE,
        names::FIREWALL_ALLOW,
        "{ 198.51.100.20 . tcp . 80 . 192.0.2.0/30 }",
    ])
    .expect("nft delete firewall element");
    let d = differences_from_plan(&read_netlink(&ns, v4), v4);
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(d[1].starts_with("set firewall-allow: missing"), "{d:?}");

    // A rule deleted by hand changes its chain's list.
    ns.run(&["nft", "flush", "chain", "ip", TABLE, names::REJECT_PACKET])
        .expect("nft flush chain");
    let d = differences_from_plan(&read_netlink(&ns, v4), v4);
    assert!(d[0].starts_with("chains:"), "{d:?}");
}

#[test]
#[ignore = "needs root"]
fn a_missing_table_is_an_error_naming_enoent() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("netlink").expect("netns");
    let err = netlink::read_table(IpFamily::V6, Some(ns.name()), &|_| None)
        .expect_err("no table was loaded");
    let msg = err.to_string();
    assert!(matches!(err, Error::Netlink { .. }), "{err:?}");
    assert!(
        msg.contains("netlink error -ENOENT (table missing)"),
        "{msg}"
    );

    let missing = netlink::read_table(IpFamily::V4, Some("kp-no-such-namespace"), &|_| None)
        .expect_err("no such namespace");
    assert!(
        missing
            .to_string()
            .contains("/var/run/netns/kp-no-such-namespace"),
        "{missing}"
    );
}

#[test]
#[ignore = "needs root"]
fn the_netlink_reader_agrees_with_nft_at_scale_and_is_faster() {
    if !require_root() {
        return;
    }
    let n: usize = std::env::var("KP_NETLINK_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let per = 10;
    let mut state = ProxyState::new("node-0");
    for o in kp_flows::synthetic::cluster(n, per) {
        state.apply(SourceEvent::Upsert(o)).unwrap();
    }
    state.apply(SourceEvent::Synced(Kind::Service)).unwrap();
    state
        .apply(SourceEvent::Synced(Kind::EndpointSlice))
        .unwrap();
    state.take_changes();

    let ns = Netns::new("netlink").expect("netns");
    let t = Instant::now();
    let planners = load(&ns, &state);
    let load_time = t.elapsed();
    let v4 = &planners[0];
    let elements: usize = v4
        .all_sets()
        .into_iter()
        .map(|s| v4.expected_elements(s).len())
        .sum();

    let t = Instant::now();
    let netlink = read_netlink(&ns, v4);
    let netlink_time = t.elapsed();
    let t = Instant::now();
    let json = NftCommand::in_netns(ns.name())
        .json(&["list", "table", "ip", TABLE])
        .expect("nft list table");
    let nft_time = t.elapsed();
    let t = Instant::now();
    let nft = parse_table(&json).expect("parse");
    let parse_time = t.elapsed();
    eprintln!(
        "{n} services x {per} endpoints, {elements} elements (ip table): load {:.3} s; \
         netlink read {:.3} s; nft -j list table {:.3} s + parse_table {:.3} s",
        load_time.as_secs_f64(),
        netlink_time.as_secs_f64(),
        nft_time.as_secs_f64(),
        parse_time.as_secs_f64(),
    );

    let d = differences_from_nft(&netlink, &nft, v4);
    assert!(d.is_empty(), "netlink differs from nft:\n{}", d.join("\n"));
    let d = differences_from_plan(&netlink, v4);
    assert!(
        d.is_empty(),
        "netlink differs from the plan:\n{}",
        d.join("\n")
    );
    let read: usize = netlink.sets.values().map(BTreeMap::len).sum();
    assert!(read >= n * per, "only {read} elements read");
}

#[test]
#[ignore = "needs root"]
fn a_large_endpoint_map_read_by_lookups_still_shows_missing_and_extra_elements() {
    if !require_root() {
        return;
    }
    // 600 Services × 10 endpoints: `vips-10-endpoints` holds about 6,900 elements, enough to be
    // read by looking its keys up rather than by a dump.
    let mut state = ProxyState::new("node-0");
    for o in kp_flows::synthetic::cluster(600, 10) {
        state.apply(SourceEvent::Upsert(o)).unwrap();
    }
    state.take_changes();
    let ns = Netns::new("netlink").expect("netns");
    let planners = load(&ns, &state);
    let v4 = &planners[0];
    let agree = |what: &str| {
        let netlink = read_netlink(&ns, v4);
        let d = differences_from_nft(&netlink, &read_nft(&ns, IpFamily::V4), v4);
        assert!(
            d.is_empty(),
            "{what}: netlink differs from nft:\n{}",
            d.join("\n")
        );
        differences_from_plan(&netlink, v4)
    };
    assert!(agree("as loaded").is_empty());

    // A slot missing (the lookups stop there and go on after it) ...
    let vip = kp_flows::synthetic::cluster_ip(4);
    ns.run(&[
        "nft",
        "delete",
        "element",
        "ip",
        TABLE,
        "vips-10-endpoints",
        &format!("{{ {vip} . tcp . 80 . 3 }}"),
    ])
    .expect("nft delete element");
    let d = agree("a slot deleted");
    assert!(
        d.len() == 1 && d[0].contains("vips-10-endpoints") && d[0].contains(&vip),
        "{d:?}"
    );
    // ... and an element of no entry, which no lookup asks for: the kernel's count says the
    // map holds more than was found, so it is dumped.
    ns.run(&[
        "nft",
        "add",
        "element",
        "ip",
        TABLE,
        "vips-10-endpoints",
        "{ 10.99.0.1 . tcp . 80 . 3 : 10.1.1.1 . 80 }",
    ])
    .expect("nft add element");
    let d = agree("an element of no entry added");
    assert!(d.len() == 1 && d[0].contains("10.99.0.1"), "{d:?}");
}

/// The kernel grows a hash set's table a while after many additions, and a dump that runs
/// meanwhile can skip elements (and send others twice) without flagging itself interrupted: a
/// bare dump read right after a full sync of 5,000 Services once missed 412 ClusterIPs. The
/// reader compares each set's distinct elements with the kernel's count and reads again.
/// Each round adds 60,000 addresses to an empty set with nft and reads the set at once.
/// `KP_NETLINK_GROW_ROUNDS` sets the rounds (default 12).
#[test]
#[ignore = "needs root"]
fn a_set_read_while_its_hash_table_grows_holds_every_element() {
    if !require_root() {
        return;
    }
    const ELEMENTS: u32 = 60_000;
    let rounds: usize = std::env::var("KP_NETLINK_GROW_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(12);
    let ns = Netns::new("netlink").expect("netns");
    let nft = NftCommand::in_netns(ns.name());
    let set = names::CLUSTER_IPS;
    // A new set each round: its hash table starts small and grows while it is filled.
    let declaration = format!(
        "add table ip {TABLE}\ndelete table ip {TABLE}\n\
         add table ip {TABLE}\nadd set ip {TABLE} {set} {{ type ipv4_addr; }}\n"
    );
    let addresses: Vec<String> = (0..ELEMENTS)
        .map(|i| std::net::Ipv4Addr::from(0x0a00_0000 + i).to_string())
        .collect();
    let fill = format!(
        "add element ip {TABLE} {set} {{ {} }}\n",
        addresses.join(", ")
    );
    let schema = SetSchema::of(kp_nftables_plan::SetId::ClusterIps);
    let mut short = Vec::new();
    for round in 0..rounds {
        nft.run(&declaration).expect("declare the set");
        nft.run(&fill).expect("fill the set");
        let read = netlink::read_set(IpFamily::V4, Some(ns.name()), set, &schema)
            .expect("read the set")
            .expect("the set exists");
        if read.len() != ELEMENTS as usize {
            short.push(format!("round {round}: {} of {ELEMENTS}", read.len()));
        }
        // The whole-table read checks each set the same way.
        let table = netlink::read_table(IpFamily::V4, Some(ns.name()), &|n| {
            (n == set).then_some(schema.clone())
        })
        .expect("read the table");
        let read = table.sets.get(set).map_or(0, BTreeMap::len);
        if read != ELEMENTS as usize {
            short.push(format!("round {round} (table): {read} of {ELEMENTS}"));
        }
    }
    assert!(short.is_empty(), "reads missed elements: {short:?}");
}
