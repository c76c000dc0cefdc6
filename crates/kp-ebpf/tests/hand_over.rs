//! `kp_ebpf::hand_over` over a stopped ebpf mode's real pins: the maps the loader pinned on a
//! bpffs of the test's own, the tc programs attached by `kp-tc-attach` in kp_test's lab (its node
//! namespace only), and connection-table entries written the way the tc programs stamp them.
//!
//! - An entry stamped a unit after the clock reading the walk started with (a connection the
//!   programs carry, used while a large table is walked) keeps the programs: it was read as
//!   twenty hours old once, and the programs went from under a live connection (ebpf -> ipvs in
//!   the guest's switching test, one run in three).
//! - Entries last used longer ago than the idle time do not: the pins go.
//! - The socket hooks, whose links the kernel frees a while after their pins go, never refuse
//!   a call to a frontend while the maps are emptied (kp-sockpeer's non-blocking connects from
//!   the test's cgroup and the lab's node namespace, as fast as they go, across the hand-over).

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use aya::maps::{HashMap, Map, MapData};
use kp_ebpf::{hand_over, names, HandOver};
use kp_ebpf_plan::layout::{ct_clock, CT_KEY_SIZE, CT_SEEN_OFFSET, CT_VALUE_SIZE};
use kp_ebpf_plan::{AddrVerdict, Scope};
use kp_test::lab::Lab;
use kp_test::netns::require_root;

mod common;
use common::{pinned_config, started, Bpffs, Cgroup};
// Only its tc attachment is used here.
#[allow(dead_code)]
#[path = "common/outside.rs"]
mod outside;
use outside::attach_tc;

const IDLE: Duration = Duration::from_secs(2);

/// A stopped ebpf mode of the fixture: its pins (socket hooks on the test's cgroup, tc programs
/// in the lab's node namespace) left for the next mode, as a switch leaves them. The maps are
/// emptied only where tc programs stay for their connections (tcx links).
fn stopped() -> (Lab, Cgroup, Bpffs) {
    let lab = Lab::new(1).expect("lab");
    let cgroup = Cgroup::new();
    let bpffs = Bpffs::new();
    let dp = started(pinned_config(&cgroup, &bpffs), &kp_flows::fixture::state());
    attach_tc(&lab, &bpffs.path);
    drop(dp);
    (lab, cgroup, bpffs)
}

/// Writes connection-table entry `n` (any tuple: hand_over reads stamps only) into the pinned
/// `kp_ct`, stamped `units` of the table's clock after now (negative: before).
fn stamp(pins: &std::path::Path, n: u8, units: i32) {
    let data = MapData::from_pin(pins.join(names::CT)).expect("open the pinned kp_ct");
    let mut ct: HashMap<MapData, [u8; CT_KEY_SIZE], [u8; CT_VALUE_SIZE]> =
        HashMap::try_from(Map::from_map_data(data).expect("map")).expect("a hash map");
    let mut key = [0u8; CT_KEY_SIZE];
    key[0] = n;
    let mut value = [0u8; CT_VALUE_SIZE];
    let seen = ct_clock(kp_ebpf::monotonic_ns().expect("the clock"))
        .wrapping_add_signed(i16::try_from(units).expect("a few units"));
    value[CT_SEEN_OFFSET..CT_SEEN_OFFSET + 2].copy_from_slice(&seen.to_ne_bytes());
    ct.insert(key, value, 0).expect("write the entry");
}

#[test]
#[ignore = "needs root"]
fn a_connection_used_during_the_walk_keeps_the_tc_programs_and_idle_ones_do_not() {
    if !require_root() {
        return;
    }
    let (_lab, _cgroup, bpffs) = stopped();

    // Idle ones, and one stamped a unit after the clock was read (the walk's start, before).
    for n in 0..50 {
        stamp(&bpffs.path, n, -10);
    }
    stamp(&bpffs.path, 200, 1);
    match hand_over(&bpffs.path, IDLE).expect("hand over") {
        HandOver::Carrying { entries, last_used } => {
            assert_eq!(entries, 1);
            assert_eq!(last_used, Duration::ZERO);
        }
        HandOver::Gone => panic!("the tc programs went from under a connection in use"),
    }
    assert!(bpffs.path.join(names::CT).exists());

    // Once every entry was last used longer ago than the idle time: gone, pins and all.
    stamp(&bpffs.path, 200, -5);
    assert_eq!(
        hand_over(&bpffs.path, IDLE).expect("hand over"),
        HandOver::Gone
    );
    // (The bpffs's own `maps.debug` and `progs.debug` stay.)
    let left: Vec<_> = std::fs::read_dir(&bpffs.path)
        .expect("the pin directory")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("kp_"))
        .collect();
    assert!(left.is_empty(), "pins left: {left:?}");
}

/// `kp-sockpeer connects MILLIS TARGETS...` in `cgroup` and the lab's node namespace, started.
fn connects(
    cgroup: &Cgroup,
    lab: &Lab,
    millis: u64,
    targets: &[SocketAddr],
) -> std::process::Child {
    common::sockpeer(cgroup, lab.node())
        .args(["connects", &millis.to_string()])
        .args(targets.iter().map(ToString::to_string))
        .stdout(Stdio::piped())
        .spawn()
        .expect("running kp-sockpeer")
}

/// Each target's (attempts, refused, timed out) from a finished `connects`.
fn counted(child: std::process::Child) -> Vec<(String, [u64; 3])> {
    let out = child.wait_with_output().expect("kp-sockpeer");
    assert!(out.status.success(), "kp-sockpeer failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let w: Vec<&str> = line.split_whitespace().collect();
            let n = |i: usize| w[i].parse::<u64>().expect("a count");
            (w[0].to_string(), [n(2), n(4), n(6)])
        })
        .collect()
}

#[test]
#[ignore = "needs root"]
fn the_socket_hooks_never_refuse_a_frontend_while_the_maps_are_emptied() {
    if !require_root() {
        return;
    }
    let (lab, cgroup, bpffs) = stopped();
    let maps = kp_ebpf::read_pinned(&bpffs.path).expect("the pinned maps");
    // Every TCP frontend of the socket hooks with backends, v4 and v6.
    let served: Vec<SocketAddr> = maps
        .services
        .iter()
        .filter(|(k, v)| {
            k.slot == 0
                && v.count > 0
                && k.frontend.scope == Scope::Socket
                && k.frontend.protocol == kp_core::model::Protocol::Tcp
        })
        .map(|(k, _)| k.frontend.socket_addr())
        .collect();
    assert!(served.len() >= 4, "{served:?}");
    // A ClusterIP's port no Service uses: the hooks refuse it while attached.
    let unused = maps
        .addrs
        .iter()
        .find(|(k, v)| **v == AddrVerdict::Reject && k.ip.is_ipv4() && k.len == 32)
        .map(|(k, _)| SocketAddr::new(k.ip, 1))
        .expect("a ClusterIP's address");
    let before = counted(connects(&cgroup, &lab, 100, &[unused, served[0]]));
    assert!(
        before[0].1[0] > 0 && before[0].1[1] == before[0].1[0] && before[1].1[1] == 0,
        "the hooks are not what the client meets: {before:?}"
    );

    let client = connects(&cgroup, &lab, 1500, &served);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        hand_over(&bpffs.path, IDLE).expect("hand over"),
        HandOver::Gone
    );
    let seen = counted(client);
    eprintln!("connects across the hand-over: {seen:?}");
    for (target, [attempts, refused, timed_out]) in &seen {
        assert!(*attempts > 100, "{target}: only {attempts} calls");
        assert!(
            *refused == 0 && *timed_out == 0,
            "{target}: {refused} of {attempts} calls refused, {timed_out} timed out, while the maps were emptied"
        );
    }
}
