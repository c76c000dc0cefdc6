//! The planned table in a real kernel: every transaction loads, and the kernel then holds what
//! the planner's record says. Each test makes its own network namespace (kp-test deletes it).

use std::collections::BTreeMap;
use std::io::Write;

use kp_core::track::{Kind, Object, ObjectKey, SourceEvent};
use kp_test::netns::{require_root, Netns};
use kp_userspace_plan::{RedirectConfig, RedirectPlanner, SetId, Transaction};
use serde_json::Value;

fn config(restricted: bool) -> RedirectConfig {
    RedirectConfig {
        proxy_port: 31000,
        transparent_mark: 0x4000,
        node_ports_restricted: restricted,
    }
}

fn load(ns: &Netns, tx: &Transaction) {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(tx.text.as_bytes()).expect("write");
    let path = file.path().to_str().expect("utf-8 path").to_string();
    let out = ns.exec(&["nft", "-f", &path]).expect("nft runs");
    assert!(
        out.status.success(),
        "nft -f failed: {}\n--- transaction ---\n{}",
        String::from_utf8_lossy(&out.stderr),
        tx.text
    );
}

/// Rule comments per chain and element counts per set, as the kernel lists them.
fn read_back(ns: &Netns) -> (BTreeMap<String, Vec<String>>, BTreeMap<String, usize>) {
    let json = ns
        .run(&["nft", "-j", "list", "table", "inet", "kube-proxy-userspace"])
        .expect("list table");
    let doc: Value = serde_json::from_str(&json).expect("nft JSON");
    let mut chains: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut sets: BTreeMap<String, usize> = BTreeMap::new();
    for item in doc["nftables"].as_array().expect("nftables array") {
        if let Some(c) = item.get("chain") {
            chains
                .entry(c["name"].as_str().expect("name").to_string())
                .or_default();
        } else if let Some(r) = item.get("rule") {
            chains
                .entry(r["chain"].as_str().expect("chain").to_string())
                .or_default()
                .push(r["comment"].as_str().unwrap_or("<none>").to_string());
        } else if let Some(s) = item.get("set").or_else(|| item.get("map")) {
            let n = s["elem"].as_array().map_or(0, Vec::len);
            sets.insert(s["name"].as_str().expect("name").to_string(), n);
        }
    }
    (chains, sets)
}

fn assert_matches_record(ns: &Netns, p: &RedirectPlanner) {
    let (chains, sets) = read_back(ns);
    assert_eq!(chains, p.expected_chains());
    let want: BTreeMap<String, usize> = SetId::all()
        .map(|s| (s.name(), p.expected_elements(s).len()))
        .collect();
    assert_eq!(sets, want);
}

#[test]
#[ignore = "needs root"]
fn the_full_table_and_element_changes_load_and_read_back_as_planned() {
    if !require_root() {
        return;
    }
    for restricted in [true, false] {
        let ns = Netns::new("us-plan").expect("namespace");
        let mut state = kp_flows::state();
        let node = kp_flows::node_context();
        let mut p = RedirectPlanner::new(config(restricted));
        load(&ns, &p.full(&state, &node));
        assert_matches_record(&ns, &p);
        // The last endpoint goes: redirects become rejects.
        state
            .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
                kp_flows::web_slice(&[]),
            ))))
            .expect("slice");
        let changes = state.take_changes();
        let tx = p.sync(&state, &node, &changes, false);
        assert_eq!(tx.operations, 4);
        load(&ns, &tx);
        assert_matches_record(&ns, &p);
        // A Service with source ranges goes, then the table is replaced whole again.
        let lb = ObjectKey {
            namespace: "default".into(),
            name: "lb".into(),
        };
        state
            .apply(SourceEvent::Delete(Kind::Service, lb))
            .expect("delete");
        let changes = state.take_changes();
        load(&ns, &p.sync(&state, &node, &changes, false));
        assert_matches_record(&ns, &p);
        load(&ns, &p.full(&state, &node));
        assert_matches_record(&ns, &p);
    }
}

/// The node's own connections through the loaded table, in a namespace of their own: a
/// listener on the proxy port stands in for the proxy. Frontends with endpoints reach it;
/// what the kernel is to refuse or drop never does.
#[test]
#[ignore = "needs root"]
fn the_kernel_redirects_frontends_to_the_proxy_port_and_refuses_the_rest() {
    use kp_test::echo::{self, Outcome, Proto, Request};
    use std::net::IpAddr;
    use std::time::Duration;

    if !require_root() {
        return;
    }
    let ns = Netns::new("us-plan-pkt").expect("namespace");
    // The node's primary address and a route towards the Service CIDR.
    // (A veth pair with both ends inside: this kernel has no dummy links.)
    ns.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
    ])
    .expect("veth");
    ns.add_addr("eth0", "192.0.2.1/24").expect("address");
    ns.link_up("eth0").expect("up");
    ns.link_up("eth1").expect("up");
    ns.add_route_dev("10.96.0.0/16", "eth0").expect("route");
    let state = kp_flows::state();
    let mut p = RedirectPlanner::new(config(true));
    load(&ns, &p.full(&state, &kp_flows::node_context()));
    let _proxy = echo::serve(&ns, "proxy", &[31000], &[]).expect("listener on the proxy port");
    let ask = |ip: &str, port: u16| -> Outcome {
        let ip: IpAddr = ip.parse().expect("ip");
        let req = Request::new(Proto::Tcp, ip, port).timeout(Duration::from_millis(500));
        echo::request(&ns, &req).remove(0)
    };
    // 30071: externalTrafficPolicy Local without local endpoints; the node short-circuits.
    for (ip, port) in [
        ("10.96.0.10", 80),
        ("192.0.2.1", 30080),
        ("10.96.0.70", 80),
        ("192.0.2.1", 30071),
    ] {
        assert_eq!(
            ask(ip, port).backend(),
            Some("proxy"),
            "{ip}:{port} is redirected to the proxy port"
        );
    }
    assert_eq!(
        ask("10.96.0.10", 81),
        Outcome::Refused,
        "unknown ClusterIP port"
    );
    assert_eq!(ask("10.96.0.20", 80), Outcome::Refused, "no endpoints");
    assert_eq!(
        ask("10.96.0.86", 80),
        Outcome::Timeout,
        "internal Local, none local"
    );
    assert_eq!(
        ask("10.96.0.99", 80),
        Outcome::Timeout,
        "unallocated ClusterIP"
    );
}
