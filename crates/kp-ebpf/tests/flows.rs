//! The packet-flow table with real packets through the ebpf mode: the socket load balancer for
//! rows from the node and its pods, the tc path for rows from outside the node.
//!
//! The socket programs are attached only to a cgroup this test creates, and the maps pinned
//! only on a bpffs it mounts; the test process moves into the cgroup while a row from the node
//! or a pod runs, so the client it starts (kp-echo, in the lab's node or pod namespace) is
//! inside, and moves back out before the cgroup is removed. A row from outside the node runs
//! with the process outside: the lab's client namespace stands for another host, whose sockets
//! no cgroup of this node holds; its packets meet the tc programs, which `kp-tc-attach`
//! attaches inside the lab's node namespace only (`kp_tc_outside` on its uplink `eth0`,
//! `kp_tc_reply` on the link to node-b and the pod veths), over the maps pinned on the test's
//! bpffs, with the links pinned beside them. Everything (cgroup, bpffs and so the links, lab)
//! goes on drop, also when an assertion fails. One test in this binary: no other test runs
//! while the process is inside.
//!
//! Rows run as the mode declares them (`Support::SOCKET_LB_TC`, as the tracer in
//! `kp-ebpf-test` does): backends of the node's and pods' connections see the client socket's
//! own source; from outside, rows are upstream's except that a reject is a drop and SCTP is
//! left alone. Before the tc programs are attached, and after cleanup, an outside row must fail.

use std::path::Path;
use std::time::{Duration, Instant};

use kp_core::dataplane::Dataplane;
use kp_core::flow::Origin;
use kp_flows::{Case, Expect, Support};
use kp_test::lab::Lab;
use kp_test::netns::require_root;

mod common;
use common::{pinned_config, started, Bpffs, Cgroup};

/// What the mode declares, for every row.
const SUPPORT: Support = Support::SOCKET_LB_TC;

/// Rows from outside the node the table must run through the tc path (14 today; SCTP rows
/// from outside, left alone, would not count).
const MIN_OUTSIDE_ROWS: usize = 12;

/// Attaches the tc programs in the lab's node namespace over the maps pinned in `dir`, with
/// `kp-tc-attach`, which pins their links there.
fn attach_tc(lab: &Lab, dir: &Path) {
    let replies: Vec<String> = std::iter::once("eth1".to_string())
        .chain((0..lab.pod_count()).map(|i| format!("veth{i}")))
        .collect();
    let out = lab
        .node()
        .run(&[
            env!("CARGO_BIN_EXE_kp-tc-attach"),
            &dir.to_string_lossy(),
            "eth0",
            &replies.join(","),
        ])
        .expect("kp-tc-attach in the lab's node namespace");
    assert_eq!(
        out.trim(),
        format!("attached {}", replies.len() + 1),
        "kp-tc-attach"
    );
}

/// The first row from outside the node that expects an answer: what the tc path serves.
fn first_outside_row() -> Case {
    kp_flows::cases()
        .into_iter()
        .map(|row| row.for_mode(SUPPORT))
        .find(|c| c.packet.origin == Origin::External && matches!(c.expect, Expect::Pods { .. }))
        .expect("a row from outside")
}

#[test]
#[ignore = "needs root"]
fn the_flow_table_with_real_packets_through_the_socket_hooks_and_the_tc_path() {
    if !require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _servers = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let cgroup = Cgroup::new();
    let bpffs = Bpffs::new();
    // The tc path goes in the lab node's namespace, below.
    let state = kp_flows::state();
    let mut dp = started(pinned_config(&cgroup, &bpffs), &state);
    assert_eq!(dp.verify().expect("read back"), Vec::<String>::new());

    // Without the tc programs, nothing answers a client outside the node.
    let outside_row = first_outside_row();
    assert!(
        kp_test::flows::check(&lab, &outside_row).is_err(),
        "{} passes without the tc path",
        outside_row.name
    );
    attach_tc(&lab, &bpffs.path);
    assert!(bpffs.path.join(kp_ebpf::names::tc_link("eth0")).exists());

    let mut failures = Vec::new();
    let (mut inside, mut outside) = (0, 0);
    for row in kp_flows::cases() {
        let case = row.for_mode(SUPPORT);
        if case.needs_sctp() {
            if let Err(why) = kp_test::echo::sctp_support() {
                let banner = "!".repeat(72);
                eprintln!("{banner}\n!! SKIPPED flow row `{}`: {why}\n!! The tracer (kp-ebpf-test) still checks it.\n{banner}", case.name);
                continue;
            }
        }
        let result = if case.packet.origin == Origin::External {
            outside += 1;
            kp_test::flows::check(&lab, &case)
        } else {
            inside += 1;
            lab.place_in_cgroup(Some(&cgroup.path));
            let result = kp_test::flows::check(&lab, &case);
            lab.place_in_cgroup(None);
            result
        };
        if let Err(e) = result {
            let why = if row.changed_for(SUPPORT) {
                format!(" (row as declared for this mode: {})", SUPPORT.reason)
            } else {
                String::new()
            };
            failures.push(format!("{e}{why}"));
        }
    }
    eprintln!("{inside} rows from the node and its pods, {outside} from outside");
    // The hooks are what serves those rows: the first one, with its client outside the
    // cgroup, is not served.
    let first = kp_flows::cases()
        .into_iter()
        .map(|row| row.for_mode(SUPPORT))
        .find(|c| c.packet.origin == Origin::Pod && matches!(c.expect, Expect::Pods { .. }))
        .expect("a row from a pod");
    assert!(
        kp_test::flows::check(&lab, &first).is_err(),
        "{} passes outside the cgroup",
        first.name
    );
    assert!(
        inside >= 30,
        "only {inside} rows ran through the socket hooks"
    );
    assert!(
        outside >= MIN_OUTSIDE_ROWS,
        "only {outside} rows ran through the tc path"
    );
    dp.cleanup().expect("cleanup");
    for name in kp_ebpf::names::ALL {
        assert!(!bpffs.path.join(name).exists(), "{name} still pinned");
    }
    assert!(!bpffs.path.join(kp_ebpf::names::tc_link("eth0")).exists());
    // Removing the pins detached the tc programs. The kernel frees a link whose last pin goes
    // from a work queue, so the detach may trail the unlink a little on a busy machine.
    let deadline = Instant::now() + Duration::from_secs(5);
    while kp_test::flows::check(&lab, &outside_row).is_ok() {
        assert!(
            Instant::now() < deadline,
            "{} still passes 5 s after cleanup",
            outside_row.name
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
