//! ClientIP affinity from outside the node, with real packets through the tc path.
//!
//! The fixture's `web` Service (NodePort 30080 on the node's address, three endpoints on the
//! node: pod-1..3) in kp_test's one-node lab. The socket hooks go on a cgroup of the test's own
//! (no client of this test is in it), the maps are pinned on a bpffs of its own, and
//! `kp-tc-attach` attaches the tc programs inside the lab's node namespace only (`kp_tc_outside`
//! on its uplink `eth0`, `kp_tc_reply` on the pod veths). Every connection comes from the lab's
//! client namespace, which stands for another host:
//!
//! - without affinity, 12 new connections from one address spread over more than one endpoint
//!   (so the rest of the test can fail);
//! - with `sessionAffinity: ClientIP`, 12 new connections from one address reach one endpoint,
//!   and 12 more later the same one; twelve client addresses stick each to one endpoint, not all
//!   to the same, and `kp_affinity_out` holds one entry per address;
//! - with a 1 s timeout, connections in quick succession still stick, and after the timeout
//!   the client is given a new pick: over ten such rounds more than one endpoint answers.
//!
//! Everything (cgroup, bpffs and so the links, lab) goes on drop, also when an assertion fails.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use aya::maps::{HashMap, Map, MapData, MapInfo};
use kp_core::dataplane::Dataplane;
use kp_ebpf::dataplane::Config;
use kp_ebpf::{names, MapSizes};
use kp_ebpf_plan::layout::{AFFINITY_KEY_SIZE, AFFINITY_OUTSIDE_KEY_SIZE, AFFINITY_VALUE_SIZE};
use kp_test::lab::{Lab, CLIENT_IP};
use kp_test::netns::require_root;

mod common;
use common::{pinned_config, started, Bpffs, Cgroup};
#[path = "common/outside.rs"]
mod outside;
use outside::{attach_tc, connect, distinct, tally_of, twelve_clients, update, web_with_affinity};

/// New connections per client in a batch.
const CONNECTIONS: usize = 12;

/// The client addresses `kp_affinity_out` (pinned in `dir`) holds entries for.
fn outside_affinity_clients(dir: &Path) -> BTreeSet<IpAddr> {
    let data = MapData::from_pin(dir.join(names::AFFINITY_OUTSIDE)).expect("open the pin");
    let map: HashMap<MapData, [u8; AFFINITY_OUTSIDE_KEY_SIZE], [u8; AFFINITY_VALUE_SIZE]> =
        HashMap::try_from(Map::from_map_data(data).expect("map")).expect("a hash map");
    map.keys()
        .map(|k| {
            let k = k.expect("read a key");
            let addr: [u8; 16] = k[..16].try_into().expect("16 bytes");
            let v6 = std::net::Ipv6Addr::from(addr);
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        })
        .collect()
}

#[test]
#[ignore = "needs root"]
fn client_ip_affinity_sticks_an_outside_client_to_one_endpoint_through_the_tc_path() {
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
    let sizes = MapSizes {
        affinity: 1024,
        ..MapSizes::default()
    };
    // The tc path goes in the lab node's namespace, below.
    let mut state = kp_flows::fixture::state();
    let mut dp = started(
        Config {
            sizes,
            ..pinned_config(&cgroup, &bpffs)
        },
        &state,
    );

    // Both affinity maps are pinned, sized by the one setting, with maps.h's layout as
    // kp-ebpf-plan's layout.rs states it.
    for (name, key) in [
        (names::AFFINITY, AFFINITY_KEY_SIZE),
        (names::AFFINITY_OUTSIDE, AFFINITY_OUTSIDE_KEY_SIZE),
    ] {
        let info = MapInfo::from_pin(bpffs.path.join(name)).expect("pinned affinity map");
        assert_eq!(
            (info.key_size(), info.value_size(), info.max_entries()),
            (key as u32, AFFINITY_VALUE_SIZE as u32, 1024),
            "{name}"
        );
    }

    // kp-tc-attach in the lab's node namespace, over the pinned maps.
    attach_tc(&lab, &bpffs.path);

    // Without affinity, one client's new connections spread (all on one of three endpoints:
    // 3 × 3^-12, about 1 in 177000).
    let spread = connect(&lab, CLIENT_IP, CONNECTIONS);
    assert!(
        distinct(&spread).len() > 1,
        "without affinity every connection reached one endpoint: {:?}",
        tally_of(&spread)
    );
    assert!(outside_affinity_clients(&bpffs.path).is_empty());

    // With ClientIP affinity, one endpoint per client address.
    update(&mut dp, &mut state, web_with_affinity(60));
    let first = connect(&lab, CLIENT_IP, CONNECTIONS);
    assert_eq!(
        distinct(&first).len(),
        1,
        "with affinity one client reached several endpoints: {:?}",
        tally_of(&first)
    );
    let again = connect(&lab, CLIENT_IP, CONNECTIONS);
    assert_eq!(
        distinct(&again),
        distinct(&first),
        "a later batch went elsewhere: {:?}",
        tally_of(&again)
    );

    // Other client addresses: each sticks to its own pick. Twelve addresses all given the same
    // endpoint would be 3^-11.
    let clients = twelve_clients(&lab);
    let mut picks = BTreeSet::new();
    for &client in &clients {
        let answers = connect(&lab, client, 4);
        let endpoints = distinct(&answers);
        assert_eq!(
            endpoints.len(),
            1,
            "{client} reached several endpoints: {:?}",
            tally_of(&answers)
        );
        picks.extend(endpoints.into_iter().map(str::to_string));
    }
    assert!(
        picks.len() > 1,
        "{} client addresses all stuck to {picks:?}: the key is not the address",
        clients.len()
    );
    let held = outside_affinity_clients(&bpffs.path);
    let want: BTreeSet<IpAddr> = clients.iter().map(|&c| IpAddr::V4(c)).collect();
    assert_eq!(held, want, "kp_affinity_out");

    // A 1 s timeout: quick connections still stick, one after the timeout may move.
    update(&mut dp, &mut state, web_with_affinity(1));
    let mut rounds = BTreeSet::new();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(1300));
        let answers = connect(&lab, CLIENT_IP, 3);
        let endpoints = distinct(&answers);
        assert_eq!(
            endpoints.len(),
            1,
            "within the timeout the client moved: {:?}",
            tally_of(&answers)
        );
        rounds.extend(endpoints.into_iter().map(str::to_string));
    }
    assert!(
        rounds.len() > 1,
        "after each timeout the client was given {rounds:?} again and again"
    );

    dp.cleanup().expect("cleanup");
    for name in names::ALL {
        assert!(!bpffs.path.join(name).exists(), "{name} still pinned");
    }
    assert!(!bpffs.path.join(names::tc_link("eth0")).exists());
}
