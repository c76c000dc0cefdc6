//! Stale UDP conntrack, the way a DNS resolver hits it: a client keeps sending from one source
//! port to a ClusterIP, the endpoint it talks to is deleted, and its next datagrams must reach a
//! remaining endpoint within one sync instead of vanishing into the stale conntrack entry.
//!
//! ebpf mode has no conntrack entry to go stale but a socket: a resolver that keeps one
//! connected UDP socket was sent to the endpoint at connect, and its sends name no address for
//! a hook to rewrite. The mode destroys that socket within one sync, and the resolver's next
//! one goes to a remaining endpoint.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kp_test::echo::{self, Proto, Request};
use kp_test::lab::Lab;

mod common;
mod ebpf_lab;
use common::{edited_fixture, eventually, metric_sum, temp_dir, write_atomically, PROGRAMMED};

/// The resolver's fixed source port.
const SOURCE_PORT: u16 = 40053;

fn dns() -> IpAddr {
    "10.96.0.53".parse().unwrap()
}

/// One datagram from pod-4's fixed source port to the dns Service: who answered, if anyone.
fn ask(lab: &Lab) -> Option<String> {
    let req = Request::new(Proto::Udp, dns(), 53)
        .src_port(SOURCE_PORT)
        .timeout(Duration::from_millis(100));
    lab.send(lab.pod(4), &req)
        .first()
        .and_then(|o| o.backend().map(str::to_string))
}

/// The fixture without `pod` in the dns Service's EndpointSlice.
fn dns_without(pod: &str) -> String {
    let ip = kp_flows::pods()
        .into_iter()
        .find(|p| p.name == pod)
        .map(|p| p.v4)
        .unwrap();
    edited_fixture(|item| {
        if item["kind"] == "EndpointSlice"
            && item["metadata"]["labels"]["kubernetes.io/service-name"] == "dns"
        {
            item["endpoints"]
                .as_array_mut()
                .unwrap()
                .retain(|e| e["addresses"][0] != ip);
        }
    })
}

fn no_blackhole_after_an_endpoint_is_deleted(mode: &str) {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    // The dns Service's two pods; each can be stopped on its own.
    let mut servers: BTreeMap<String, _> = [1, 2]
        .into_iter()
        .map(|i| {
            let name = lab.pod_name(i);
            let guard = echo::serve_on(lab.pod(i), &name, &[(Proto::Udp, kp_flows::UDP_PORT)])
                .expect("echo server");
            (name, guard)
        })
        .collect();
    let dir = temp_dir(&format!("conntrack-{mode}"));
    let cluster = dir.0.join("cluster.json");
    write_atomically(&cluster, &kp_flows::manifest_list());
    let mut proxy =
        common::spawn_proxy_in_mode(&lab, mode, &[], &["--manifests", dir.0.to_str().unwrap()]);
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(30))
        .expect("first sync");

    // The resolver talks to one pod; conntrack pins its source port there.
    let first = ask(&lab).expect("the dns Service answers");
    for _ in 0..5 {
        assert_eq!(
            ask(&lab).as_deref(),
            Some(first.as_str()),
            "one flow, one pod"
        );
    }

    // That pod is deleted: it stops answering, then leaves the EndpointSlice.
    let mut gone = servers.remove(&first).unwrap();
    gone.terminate(Duration::from_secs(2)).unwrap();
    let deleted_at = Instant::now();
    write_atomically(&cluster, &dns_without(&first));

    // Keep asking every 50 ms from the same port, as a resolver does. Once the proxy has
    // synced the removal, every datagram must be answered by the remaining pod.
    let mut answered_at = None;
    while deleted_at.elapsed() < Duration::from_secs(5) {
        if let Some(who) = ask(&lab) {
            assert_ne!(who, first, "a deleted pod cannot answer");
            answered_at = Some(deleted_at.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let answered_at = answered_at.unwrap_or_else(|| {
        panic!(
            "blackhole: no answer for 5 s after the endpoint was deleted\n{}",
            proxy.log()
        )
    });
    // Sync period here is 1 s and min sync 100 ms: within one sync, with margin.
    assert!(answered_at < Duration::from_millis(1500), "{answered_at:?}");
    for _ in 0..10 {
        let who = ask(&lab);
        assert!(
            who.is_some() && who.as_deref() != Some(first.as_str()),
            "{who:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        metric_sum(
            lab.node(),
            "kubeproxy_conntrack_reconciler_deleted_entries_total"
        ) >= 1.0,
        "the stale entry was deleted by the reconciler"
    );
    proxy.terminate(Duration::from_secs(5)).unwrap();
}

#[test]
#[ignore = "needs root"]
fn nftables_mode_leaves_no_udp_blackhole() {
    no_blackhole_after_an_endpoint_is_deleted("nftables");
}

#[test]
#[ignore = "needs root"]
fn iptables_mode_leaves_no_udp_blackhole() {
    no_blackhole_after_an_endpoint_is_deleted("iptables");
}

/// Every query of a `kp-echo resolver` run so far: who answered, or the failure's word.
fn resolver_answers(client: &kp_test::netns::ChildGuard) -> Vec<String> {
    echo::resolver_queries(&client.log())
        .into_iter()
        .map(|(_, o)| o.label())
        .collect()
}

#[test]
#[ignore = "needs root"]
fn ebpf_mode_destroys_a_resolvers_socket_to_a_deleted_endpoint() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let (first, second) = (lab.pod_name(1), lab.pod_name(2));
    let _servers: Vec<_> = [1, 2]
        .into_iter()
        .map(|i| {
            echo::serve_on(
                lab.pod(i),
                &lab.pod_name(i),
                &[(Proto::Udp, kp_flows::UDP_PORT)],
            )
            .expect("echo server")
        })
        .collect();
    let sandbox = ebpf_lab::Sandbox::new("stale-udp");
    sandbox.admit(&lab);
    // The dns Service starts with the first pod only, so the resolver's socket goes there.
    let dir = temp_dir("stale-udp-ebpf");
    let cluster = dir.0.join("cluster.json");
    write_atomically(&cluster, &dns_without(&second));
    let flags = sandbox.flags();
    let mut source: Vec<&str> = flags.iter().map(String::as_str).collect();
    source.extend(["--manifests", dir.0.to_str().unwrap()]);
    let mut proxy = common::spawn_proxy_in_mode(&lab, "ebpf", &[], &source);
    proxy
        .wait_for_log(PROGRAMMED, Duration::from_secs(30))
        .expect("first sync");

    let resolver = echo::spawn_resolver(
        lab.pod(4),
        dns(),
        53,
        Duration::from_millis(50),
        Duration::from_millis(100),
        Duration::from_secs(8),
    )
    .expect("resolver");
    eventually(
        "the resolver is answered by the first pod",
        Duration::from_secs(3),
        || {
            resolver_answers(&resolver)
                .iter()
                .filter(|b| **b == first)
                .count()
                >= 3
        },
    );

    // The first pod goes silently (no ICMP error tells the client), and the second one
    // replaces it in the EndpointSlice.
    let pod = lab.pod(1);
    pod.run(&["nft", "add", "table", "inet", "kpt-gone"])
        .expect("nft");
    pod.run(&[
        "nft",
        "add",
        "chain",
        "inet",
        "kpt-gone",
        "input",
        "{ type filter hook input priority 0; }",
    ])
    .expect("nft");
    pod.run(&[
        "nft", "add", "rule", "inet", "kpt-gone", "input", "meta", "l4proto", "udp", "drop",
    ])
    .expect("nft");
    let before = resolver_answers(&resolver).len();
    write_atomically(&cluster, &dns_without(&first));

    // Sync period 1 s, min sync 100 ms: within one sync, with margin.
    let took = eventually(
        "the resolver is answered by the second pod",
        Duration::from_secs(5),
        || resolver_answers(&resolver)[before..].contains(&second),
    );
    assert!(
        took < Duration::from_millis(1500),
        "{took:?} after the EndpointSlice changed\n{}",
        proxy.log()
    );
    let after = resolver_answers(&resolver)[before..].to_vec();
    let at = after.iter().position(|b| *b == second).unwrap();
    assert!(
        after[..at].iter().all(|b| *b != first),
        "the silent pod answered: {after:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let settled = resolver_answers(&resolver)[before + at..].to_vec();
    assert!(
        settled.iter().all(|b| *b == second),
        "the resolver stays with the second pod: {settled:?}"
    );
    assert_eq!(
        metric_sum(
            lab.node(),
            "kubeproxy_rs_ebpf_stale_udp_sockets_destroyed_total"
        ),
        1.0,
        "one socket destroyed\n{}",
        proxy.log()
    );
    eprintln!("ebpf: the resolver was answered by the second pod {took:?} after the change");
    proxy.terminate(Duration::from_secs(5)).unwrap();
}
