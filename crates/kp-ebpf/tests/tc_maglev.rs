//! The `sh`/`mh` schedulers (Maglev tables) with real packets, in kp_test's one-node lab with
//! the fixture's `web` Service (NodePort 30080, three endpoints on the node: pod-1..3), as
//! `tc_affinity.rs` sets it up (`common/outside.rs`): socket hooks on a cgroup of the test's
//! own, maps on a bpffs of its own, `kp-tc-attach` in the lab's node namespace only.
//!
//! - with Maglev, 12 new TCP connections (other source ports) from one client outside the node
//!   all reach one endpoint, the one the pinned table names for that address's hash
//!   (`layout::address_hash`, the programs' hash); twelve client addresses each reach the one
//!   the table names for them, not all the same;
//! - from the node's pods (the socket hooks, the client's network namespace hashed): 12
//!   connections from one pod's namespace to the ClusterIP reach one endpoint; with ClientIP
//!   affinity on, the socket hooks record the namespace's cookie in `kp_affinity`, and the
//!   endpoint is the one the ClusterIP's table names for that cookie's hash
//!   (`layout::netns_hash`);
//! - `kp_maglev` is pinned with maps.h's layout, and a table rewritten behind the dataplane's
//!   back is drift for `verify`, repaired by a full sync;
//! - the same dataplane restarted with a random pick deletes the tables (a full sync), and the
//!   same connections spread again (so the checks above can fail).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use aya::maps::{HashMap, Map, MapData, MapInfo};
use kp_core::dataplane::Dataplane;
use kp_core::track::Changes;
use kp_ebpf::dataplane::{Config, EbpfDataplane};
use kp_ebpf::{names, MapSizes, Scheduler};
use kp_ebpf_plan::layout::{
    address_hash, netns_hash, AFFINITY_KEY_SIZE, AFFINITY_VALUE_SIZE, MAGLEV_M, MAGLEV_VALUE_SIZE,
};
use kp_ebpf_plan::{Contents, ServiceKey, FLAG_MAGLEV};
use kp_test::echo::{Outcome, Proto, Request};
use kp_test::lab::{Lab, CLIENT_IP, NODE_IP};
use kp_test::netns::require_root;

mod common;
use common::{Bpffs, Cgroup};
#[path = "common/outside.rs"]
mod outside;
use outside::{
    attach_tc, connect, distinct, tally_of, twelve_clients, update, web_with_affinity, NODE_PORT,
};

/// `web`'s ClusterIP and port.
const WEB_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// The slot-0 entry of `web`'s frontend at `ip:port` in `maps`.
fn head_of(maps: &Contents, ip: Ipv4Addr, port: u16) -> ServiceKey {
    *maps
        .services
        .keys()
        .find(|k| k.slot == 0 && k.frontend.ip == IpAddr::from(ip) && k.frontend.port == port)
        .expect("web's frontend")
}

/// `web`'s NodePort entry (slot 0) in `maps`.
fn node_port_head(maps: &Contents) -> ServiceKey {
    head_of(maps, NODE_IP, NODE_PORT)
}

/// The endpoint (the lab's pod name) the Maglev table in `maps` gives a client of hash `hash`
/// at frontend `head`: entry `hash % M`, a slot, its backend.
fn table_pick(lab: &Lab, maps: &Contents, head: ServiceKey, hash: u32) -> String {
    let value = maps.services[&head];
    assert_ne!(
        value.flags & FLAG_MAGLEV,
        0,
        "{head:?} is not flagged Maglev"
    );
    let slot = maps.maglev[&value.rev_nat].slot_for(hash);
    let id = maps.services[&ServiceKey { slot, ..head }].backend_id;
    let backend = maps.backends[&id];
    (1..=3)
        .find(|&i| lab.pod_ip(i) == backend.ip)
        .map(|i| lab.pod_name(i))
        .unwrap_or_else(|| panic!("{backend:?} is no pod of the lab"))
}

/// The endpoint the NodePort's table gives `client` (its address's hash).
fn outside_pick(lab: &Lab, maps: &Contents, client: Ipv4Addr) -> String {
    table_pick(lab, maps, node_port_head(maps), address_hash(client.into()))
}

/// The `kp_affinity` entries (pinned in `pins`) under reverse-NAT id `rev_nat`: each client
/// network namespace's cookie.
fn affinity_cookies(pins: &std::path::Path, rev_nat: u16) -> Vec<u64> {
    let data = MapData::from_pin(pins.join(names::AFFINITY)).expect("open the pin");
    let map: HashMap<MapData, [u8; AFFINITY_KEY_SIZE], [u8; AFFINITY_VALUE_SIZE]> =
        HashMap::try_from(Map::from_map_data(data).expect("map")).expect("a hash map");
    map.keys()
        .map(|k| k.expect("read a key"))
        .filter(|k| u16::from_ne_bytes([k[8], k[9]]) == rev_nat)
        .map(|k| u64::from_ne_bytes(k[..8].try_into().expect("8 bytes")))
        .collect()
}

/// `count` new TCP connections from pod `pod`'s namespace to `web`'s ClusterIP: the endpoint
/// each reached.
fn connect_from_pod(lab: &Lab, pod: usize, count: usize) -> Vec<String> {
    let req = Request::new(Proto::Tcp, WEB_VIP.into(), 80).count(count);
    let outcomes = lab.send(lab.pod(pod), &req);
    outcomes
        .iter()
        .map(|o| match o {
            Outcome::Answered { backend, .. } => backend.clone(),
            other => panic!("a connection from pod {pod} was not answered ({other}): {outcomes:?}"),
        })
        .collect()
}

/// Overwrites the Maglev table under `rev_nat` in the pinned map with every entry slot 1.
fn overwrite_table(pins: &std::path::Path, rev_nat: u16) {
    let data = MapData::from_pin(pins.join(names::MAGLEV)).expect("open the pin");
    let mut map: HashMap<MapData, [u8; 2], [u8; MAGLEV_VALUE_SIZE]> =
        HashMap::try_from(Map::from_map_data(data).expect("map")).expect("a hash map");
    let ones = [1u16; MAGLEV_M];
    let mut bytes = [0u8; MAGLEV_VALUE_SIZE];
    for (chunk, slot) in bytes.chunks_exact_mut(2).zip(ones) {
        chunk.copy_from_slice(&slot.to_ne_bytes());
    }
    map.insert(rev_nat.to_ne_bytes(), bytes, 0)
        .expect("overwrite the table");
}

#[test]
#[ignore = "needs root"]
fn sh_sends_each_client_to_the_endpoint_its_hash_names() {
    if !require_root() {
        return;
    }
    let lab = Lab::new(4).expect("lab");
    let _pods: Vec<_> = (1..=3)
        .map(|i| {
            lab.serve_echo(i, &[kp_flows::TCP_PORT], &[])
                .expect("echo server")
        })
        .collect();
    let cgroup = Cgroup::new();
    let bpffs = Bpffs::new();
    // No tc path: not in this process's namespace (the machine's own); in the lab node's, below.
    let config = |scheduler| Config {
        pin_dir: Some(bpffs.path.clone()),
        scheduler,
        ..Config::new(cgroup.path.clone())
    };
    let mut dp = EbpfDataplane::new(config(Scheduler::Maglev));
    dp.start().expect("load and attach");
    let mut state = kp_flows::fixture::state();
    dp.sync(&state, &Changes::default(), true)
        .expect("full sync");
    assert_eq!(dp.verify().expect("verify"), Vec::<String>::new());

    // kp_maglev: pinned with maps.h's layout (as layout.rs states it), sized as kp_rev_nat.
    let info = MapInfo::from_pin(bpffs.path.join(names::MAGLEV)).expect("pinned kp_maglev");
    assert_eq!(
        (info.key_size(), info.value_size(), info.max_entries()),
        (2, MAGLEV_VALUE_SIZE as u32, MapSizes::default().rev_nat)
    );
    let maps = kp_ebpf::read_pinned(&bpffs.path).expect("read the pins");
    assert!(!maps.maglev.is_empty());

    attach_tc(&lab, &bpffs.path);

    // One client: every new connection to the endpoint its address hashes to.
    let answers = connect(&lab, CLIENT_IP, 12);
    assert_eq!(
        distinct(&answers),
        BTreeSet::from([outside_pick(&lab, &maps, CLIENT_IP).as_str()]),
        "{CLIENT_IP}: {:?}",
        tally_of(&answers)
    );
    // Twelve clients: each to the endpoint the table names for it.
    let clients = twelve_clients(&lab);
    let mut picks = BTreeSet::new();
    for &client in &clients {
        let answers = connect(&lab, client, 4);
        let want = outside_pick(&lab, &maps, client);
        assert_eq!(
            distinct(&answers),
            BTreeSet::from([want.as_str()]),
            "{client}: {:?}",
            tally_of(&answers)
        );
        picks.insert(want);
    }
    assert!(
        picks.len() > 1,
        "{} clients all hash to {picks:?}",
        clients.len()
    );

    // From a pod (the socket hooks): its network namespace's connections stick to one endpoint.
    lab.place_in_cgroup(Some(&cgroup.path));
    let from_pod = connect_from_pod(&lab, 0, 12);
    lab.place_in_cgroup(None);
    assert_eq!(
        distinct(&from_pod).len(),
        1,
        "from pod 0: {:?}",
        tally_of(&from_pod)
    );
    // With ClientIP affinity the hooks record the namespace's cookie: its hash names the
    // endpoint in the ClusterIP's table (affinity comes first, but finds nothing yet).
    update(&mut dp, &mut state, web_with_affinity(60));
    lab.place_in_cgroup(Some(&cgroup.path));
    let sticky = connect_from_pod(&lab, 0, 4);
    lab.place_in_cgroup(None);
    let vip = head_of(&maps, WEB_VIP, 80);
    let vip_rev_nat = maps.services[&vip].rev_nat;
    let cookies = affinity_cookies(&bpffs.path, vip_rev_nat);
    assert_eq!(cookies.len(), 1, "one client namespace: {cookies:?}");
    assert_eq!(
        distinct(&sticky),
        BTreeSet::from([table_pick(&lab, &maps, vip, netns_hash(cookies[0])).as_str()]),
        "from pod 0 with affinity: {:?}",
        tally_of(&sticky)
    );
    assert_eq!(distinct(&sticky), distinct(&from_pod));

    // A table rewritten behind the dataplane's back is drift; a full sync repairs it.
    let web_rev_nat = maps.services[&node_port_head(&maps)].rev_nat;
    overwrite_table(&bpffs.path, web_rev_nat);
    let drift = dp.verify().expect("verify");
    assert!(
        drift.len() == 1 && drift[0].contains(&format!("UpsertMaglev({web_rev_nat},")),
        "{drift:#?}"
    );
    dp.sync(&state, &Changes::default(), true)
        .expect("full sync");
    assert_eq!(dp.verify().expect("verify"), Vec::<String>::new());

    // Restarted with a random pick (and web without affinity again): the tables go, and the
    // same connections spread (all on one of three endpoints: 3 × 3^-12).
    drop(dp);
    let state = kp_flows::fixture::state(); // without the affinity set above
    let mut random = EbpfDataplane::new(config(Scheduler::Random));
    random.start().expect("restart");
    random
        .sync(&state, &Changes::default(), true)
        .expect("full sync");
    assert_eq!(random.verify().expect("verify"), Vec::<String>::new());
    assert!(kp_ebpf::read_pinned(&bpffs.path)
        .expect("read the pins")
        .maglev
        .is_empty());
    let spread = connect(&lab, CLIENT_IP, 12);
    assert!(
        distinct(&spread).len() > 1,
        "with rr every connection reached one endpoint: {:?}",
        tally_of(&spread)
    );
    lab.place_in_cgroup(Some(&cgroup.path));
    let from_pod = connect_from_pod(&lab, 0, 12);
    lab.place_in_cgroup(None);
    assert!(
        distinct(&from_pod).len() > 1,
        "with rr every connection from pod 0 reached one endpoint: {:?}",
        tally_of(&from_pod)
    );

    random.cleanup().expect("cleanup");
    for name in names::ALL {
        assert!(!bpffs.path.join(name).exists(), "{name} still pinned");
    }
}
