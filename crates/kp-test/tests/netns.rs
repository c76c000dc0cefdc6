//! The lab itself: it builds, carries real packets both ways in both families, and leaves
//! nothing behind, even when a test panics.
//!
//! No kube-proxy here: these requests go straight to pod IPs. Addresses follow the plan in
//! `kp_test::lab`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::panic::{self, AssertUnwindSafe};
use std::process::Command;
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use kp_test::lab::{CLIENT_ALIASES, CLIENT_ALIASES6, CLIENT_IP, CLIENT_IP6, POD_GATEWAY};
use kp_test::netns::{self, Netns};
use kp_test::{echo, require_root, Lab, Outcome, Proto, Request};

/// Root check, and this package's own kp-echo rather than a search for one.
fn setup() -> bool {
    echo::use_echo_binary(env!("CARGO_BIN_EXE_kp-echo"));
    require_root()
}

fn answered(backend: &str, client_seen: impl Into<IpAddr>) -> Outcome {
    Outcome::Answered {
        backend: backend.to_string(),
        client_seen: client_seen.into(),
    }
}

fn assert_gone(names: &[String]) {
    let listed = netns::list().expect("ip netns list");
    let left: Vec<&String> = names.iter().filter(|n| listed.contains(n)).collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

#[test]
#[ignore = "needs root"]
fn the_client_reaches_a_pod_directly_over_tcp_and_udp_in_both_families() {
    if !setup() {
        return;
    }
    let lab = Lab::new(2).unwrap();
    let _echo = lab.serve_echo(0, &[8080], &[5353]).unwrap();

    for proto in [Proto::Tcp, Proto::Udp] {
        let port = if proto == Proto::Tcp { 8080 } else { 5353 };
        assert_eq!(
            lab.request(lab.client(), proto, lab.pod_ip(0), port),
            answered("pod-0", CLIENT_IP),
            "{proto:?} over IPv4"
        );
        assert_eq!(
            lab.request(lab.client(), proto, lab.pod_ip6(0), port),
            answered("pod-0", CLIENT_IP6),
            "{proto:?} over IPv6"
        );
    }
}

#[test]
#[ignore = "needs root"]
fn pods_reach_each_other_and_the_node_reaches_pods_through_the_node() {
    if !setup() {
        return;
    }
    let lab = Lab::new(2).unwrap();
    let _echo = lab.serve_echo(1, &[8080], &[]).unwrap();

    assert_eq!(
        lab.request(lab.pod(0), Proto::Tcp, lab.pod_ip(1), 8080),
        answered("pod-1", lab.pod_ip(0))
    );
    assert_eq!(
        lab.request(lab.pod(0), Proto::Tcp, lab.pod_ip6(1), 8080),
        answered("pod-1", lab.pod_ip6(0))
    );
    assert_eq!(
        lab.request(lab.node(), Proto::Tcp, lab.pod_ip(1), 8080),
        answered("pod-1", POD_GATEWAY)
    );
}

#[test]
#[ignore = "needs root"]
fn a_client_alias_is_the_source_the_backend_sees() {
    if !setup() {
        return;
    }
    let lab = Lab::new(1).unwrap();
    let _echo = lab.serve_echo(0, &[8080], &[5353]).unwrap();

    let cases = [
        (lab.pod_ip(0), IpAddr::from(CLIENT_ALIASES[1])),
        (lab.pod_ip6(0), IpAddr::from(CLIENT_ALIASES6[2])),
    ];
    for (pod, alias) in cases {
        for (proto, port) in [(Proto::Tcp, 8080), (Proto::Udp, 5353)] {
            let req = Request::new(proto, pod, port).src_ip(alias).count(3);
            assert_eq!(
                lab.send(lab.client(), &req),
                vec![answered("pod-0", alias); 3],
                "{proto:?} from {alias}"
            );
        }
    }
}

#[test]
#[ignore = "needs root"]
fn a_fixed_source_port_can_be_reused_attempt_after_attempt() {
    if !setup() {
        return;
    }
    let lab = Lab::new(1).unwrap();
    let _echo = lab.serve_echo(0, &[8080], &[5353]).unwrap();

    for (proto, port) in [(Proto::Tcp, 8080), (Proto::Udp, 5353)] {
        let req = Request::new(proto, lab.pod_ip(0), port)
            .src_port(40123)
            .count(3);
        assert_eq!(
            lab.send(lab.client(), &req),
            vec![answered("pod-0", CLIENT_IP); 3],
            "{proto:?}"
        );
    }
}

#[test]
#[ignore = "needs root"]
fn failures_are_told_apart() {
    if !setup() {
        return;
    }
    let lab = Lab::new(1).unwrap();
    let _echo = lab.serve_echo(0, &[8080], &[5353]).unwrap();
    let short = Duration::from_millis(300);

    // Nothing listens on port 9: a RST for TCP, an ICMP port unreachable for UDP.
    for proto in [Proto::Tcp, Proto::Udp] {
        let req = Request::new(proto, lab.pod_ip(0), 9).timeout(short);
        assert_eq!(
            lab.send(lab.client(), &req),
            vec![Outcome::Refused],
            "{proto:?}"
        );
    }
    // The client has no route to 10.200.0.0/16.
    let nowhere: IpAddr = "10.200.0.1".parse().unwrap();
    assert_eq!(
        lab.request(lab.client(), Proto::Tcp, nowhere, 80),
        Outcome::Unreachable
    );
    // A ClusterIP nobody claims: the node forwards it out of its default route, back to the
    // client, which does not forward and drops it.
    let unclaimed: IpAddr = "10.96.0.99".parse().unwrap();
    let req = Request::new(Proto::Tcp, unclaimed, 80).timeout(short);
    assert_eq!(lab.send(lab.client(), &req), vec![Outcome::Timeout]);
}

#[test]
#[ignore = "needs root"]
fn namespaces_are_gone_after_the_lab_drops() {
    if !setup() {
        return;
    }
    let lab = Lab::new(2).unwrap();
    let names = lab.namespaces();
    assert_eq!(names.len(), 4);
    let listed = netns::list().unwrap();
    assert!(
        names.iter().all(|n| listed.contains(n)),
        "{names:?} not in {listed:?}"
    );
    drop(lab);
    assert_gone(&names);
}

#[test]
#[ignore = "needs root"]
fn namespaces_and_processes_are_gone_when_a_test_panics_midway() {
    if !setup() {
        return;
    }
    let seen: Mutex<Option<(Vec<String>, u32)>> = Mutex::new(None);
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let lab = Lab::new(2).unwrap();
        let echo = lab.serve_echo(0, &[8080], &[]).unwrap();
        *seen.lock().unwrap() = Some((lab.namespaces(), echo.id()));
        panic!("deliberate panic with the lab up");
    }));
    assert!(result.is_err(), "the closure should have panicked");
    let (names, pid) = seen.into_inner().unwrap().expect("lab was built");
    assert_gone(&names);
    // The guard reaped it, so not even a zombie is left under that pid.
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "kp-echo (pid {pid}) still exists"
    );
}

#[test]
#[ignore = "needs root"]
fn dropping_a_namespace_kills_processes_started_outside_a_guard() {
    if !setup() {
        return;
    }
    let ns = Netns::new("orphan").unwrap();
    let name = ns.name().to_string();
    let mut sleeper = Command::new("ip")
        .args(["netns", "exec", &name, "sleep", "600"])
        .spawn()
        .unwrap();
    // Wait until it is inside (ip execs sleep in place).
    for _ in 0..200 {
        if !ns.pids().is_empty() {
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(ns.pids(), vec![sleeper.id()]);
    drop(ns);
    let status = sleeper.wait().unwrap();
    assert!(
        !status.success(),
        "sleep should have been killed, got {status}"
    );
    assert_gone(&[name]);
}

#[test]
#[ignore = "needs root"]
fn two_labs_in_parallel_do_not_collide() {
    if !setup() {
        return;
    }
    let run = || {
        let lab = Lab::new(2).unwrap();
        let _echo = lab.serve_echo(1, &[8080], &[]).unwrap();
        let outcome = lab.request(lab.client(), Proto::Tcp, lab.pod_ip(1), 8080);
        (lab.namespaces(), outcome)
    };
    let (a, b) = thread::scope(|s| {
        let a = s.spawn(run);
        let b = s.spawn(run);
        (a.join().unwrap(), b.join().unwrap())
    });
    for (_, outcome) in [&a, &b] {
        assert_eq!(outcome, &answered("pod-1", CLIENT_IP));
    }
    let names_a: BTreeSet<&String> = a.0.iter().collect();
    let names_b: BTreeSet<&String> = b.0.iter().collect();
    assert!(
        names_a.is_disjoint(&names_b),
        "{names_a:?} and {names_b:?} overlap"
    );
    assert_gone(&a.0);
    assert_gone(&b.0);
}

#[test]
fn a_role_that_is_not_a_plain_word_is_refused_without_creating_anything() {
    for role in ["", "has space", "slash/", "much-too-long-for-a-role-name"] {
        assert!(Netns::new(role).is_err(), "{role:?}");
    }
}
