//! Stale UDP conntrack, the way a DNS resolver hits it: a client keeps sending from one source
//! port to a ClusterIP, the endpoint it talks to is deleted, and its next datagrams must reach a
//! remaining endpoint within one sync instead of vanishing into the stale conntrack entry.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kp_test::echo::{self, Proto, Request};
use kp_test::lab::Lab;

mod common;
use common::{edited_fixture, metric_sum, temp_dir, write_atomically, PROGRAMMED};

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
