//! The table that keeps conntrack and netfilter's NAT hooks on (`kp_ebpf::nat_hooks`), in a
//! lab's node namespace: made, checked, made again over a change, and removed; and what it is
//! for. A TCP connection another table's DNAT sent to a pod stalls once that table goes
//! (nothing in the namespace needs conntrack any more, so the kernel stops looking connections
//! up and applying their translation), and goes on to its end when the mode's table is there.

use std::net::IpAddr;
use std::time::Duration;

use kp_ebpf::nat_hooks::{NatHooks, TABLE};
use kp_test::echo;
use kp_test::lab::Lab;
use kp_test::netns::require_root;

/// Where the old mode's stand-in DNAT sends connections from.
const FRONTEND: &str = "10.96.77.7";

#[test]
#[ignore = "needs root"]
fn the_table_is_made_checked_and_removed() {
    if !require_root() {
        return;
    }
    let lab = Lab::new(1).expect("lab");
    let hooks = NatHooks::new(Some(lab.node().name()));
    let missing = hooks.check().expect("check");
    assert_eq!(missing, vec![format!("table inet {TABLE} is missing")]);
    assert!(hooks.ensure().expect("install"));
    // Again: there as it should be, so nothing is written.
    assert!(!hooks.ensure().expect("install again"));
    assert_eq!(hooks.check().expect("check"), Vec::<String>::new());
    lab.node()
        .run(&["nft", "add", "rule", "inet", TABLE, "nat-output", "counter"])
        .expect("a rule of someone else's");
    assert_eq!(
        hooks.check().expect("check"),
        vec![format!(
            "table inet {TABLE}: chain nat-output has a rule not the mode's"
        )]
    );
    // Made again as it should be.
    assert!(hooks.ensure().expect("install over it"));
    assert_eq!(hooks.check().expect("check"), Vec::<String>::new());
    hooks.remove().expect("remove");
    assert_eq!(hooks.check().expect("check").len(), 1);
    hooks.remove().expect("remove what is gone");
}

/// A stream from pod 0 through a DNAT of the test's own (the old mode's rules) to pod 1; the
/// DNAT's table is deleted a second in. Returns the stream's result.
fn stream_across_the_removal(lab: &Lab, hooks: Option<&NatHooks>) -> echo::StreamResult {
    let node = lab.node();
    let pod = lab.pod_ip(1);
    for cmd in [
        "add table ip kpt-old-mode".to_string(),
        "add chain ip kpt-old-mode pre { type nat hook prerouting priority -100 ; }".to_string(),
        format!("add rule ip kpt-old-mode pre ip daddr {FRONTEND} tcp dport 80 dnat to {pod}:8080"),
    ] {
        node.run(&["nft", &cmd]).expect("the old mode's DNAT");
    }
    if let Some(hooks) = hooks {
        hooks.ensure().expect("install the NAT hooks");
    }
    let frontend: IpAddr = FRONTEND.parse().unwrap();
    let mut stream = echo::spawn_stream(
        lab.pod(0),
        frontend,
        80,
        Duration::from_millis(10),
        Duration::from_secs(3),
    )
    .expect("stream");
    std::thread::sleep(Duration::from_secs(1));
    node.run(&["nft", "delete", "table", "ip", "kpt-old-mode"])
        .expect("remove the old mode's DNAT");
    let result = echo::finished_stream(&mut stream, Duration::from_secs(20)).expect("result");
    if let Some(hooks) = hooks {
        hooks.remove().expect("remove the NAT hooks");
    }
    result
}

#[test]
#[ignore = "needs root"]
fn a_connection_translated_before_goes_on_once_the_old_nat_chains_are_gone() {
    if !require_root() {
        return;
    }
    let lab = Lab::new(2).expect("lab");
    let _server = lab.serve_echo(1, &[8080], &[]).expect("echo server");
    let hooks = NatHooks::new(Some(lab.node().name()));

    // Without the table: the stream stalls (what a switch to ebpf mode did before).
    let without = stream_across_the_removal(&lab, None);
    eprintln!("without the NAT hooks: {without:?}");
    assert!(
        without.failed.is_some() || without.echoed < without.sent,
        "without the NAT hooks the connection should stall: {without:?}"
    );

    // With it: every line comes back, without a pause.
    let with = stream_across_the_removal(&lab, Some(&hooks));
    eprintln!("with the NAT hooks: {with:?}");
    assert_eq!(with.failed, None, "{with:?}");
    assert_eq!(with.sent, with.echoed, "{with:?}");
    assert!(with.sent >= 200, "{with:?}");
    assert!(with.max_gap < Duration::from_millis(250), "{with:?}");
}
