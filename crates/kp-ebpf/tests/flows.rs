//! The packet-flow table with real sockets through the ebpf mode's socket load balancer.
//!
//! The programs are attached only to a cgroup this test creates, and the maps pinned only on a
//! bpffs it mounts; the test process moves into the cgroup while a row from the node or a pod
//! runs, so the client it starts (kp-echo, in the lab's node or pod namespace) is inside, and
//! moves back out before the cgroup is removed. A row from outside the node runs with the
//! process outside: the lab's client namespace stands for another host, whose sockets no
//! cgroup of this node holds. Everything (cgroup, bpffs, lab) goes on drop, also when an
//! assertion fails. One test in this binary: no other test runs while the process is inside.
//!
//! Rows run as the mode declares them (`Support::SOCKET_LB`): traffic from outside the node
//! must be left alone (no tc path), and backends see the client socket's own source.

use kp_core::dataplane::Dataplane;
use kp_core::flow::Origin;
use kp_core::node::NodePortAddresses;
use kp_core::track::Changes;
use kp_ebpf::dataplane::{Config, EbpfDataplane};
use kp_ebpf::MapSizes;
use kp_flows::{Expect, Support};
use kp_test::netns::require_root;

mod common;
use common::{Bpffs, Cgroup};

#[test]
#[ignore = "needs root"]
fn the_flow_table_with_real_sockets_through_the_socket_load_balancer() {
    if !require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _servers = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let cgroup = Cgroup::new();
    let bpffs = Bpffs::new();
    let mut dp = EbpfDataplane::new(Config {
        cgroup: cgroup.path.clone(),
        pin_dir: Some(bpffs.path.clone()),
        sizes: MapSizes::default(),
        node_ports: NodePortAddresses::Primary,
        tc: None,
    });
    dp.start().expect("load and attach");
    let state = kp_flows::state();
    dp.sync(&state, &Changes::default(), true)
        .expect("full sync");
    assert_eq!(dp.verify().expect("read back"), Vec::<String>::new());

    let mut failures = Vec::new();
    let (mut inside, mut outside) = (0, 0);
    for row in kp_flows::cases() {
        let case = row.for_mode(Support::SOCKET_LB);
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
            let _inside = cgroup.enter();
            kp_test::flows::check(&lab, &case)
        };
        failures.extend(result.err());
    }
    eprintln!("{inside} rows from the node and its pods, {outside} from outside");
    // The hooks are what serves those rows: the first one, with its client outside the
    // cgroup, is not served.
    let first = kp_flows::cases()
        .into_iter()
        .map(|row| row.for_mode(Support::SOCKET_LB))
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
    dp.cleanup().expect("cleanup");
    for name in kp_ebpf::names::ALL {
        assert!(!bpffs.path.join(name).exists(), "{name} still pinned");
    }
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
