//! What the tc-path tests share (`tc_affinity.rs`, `tc_maglev.rs`): kp_test's one-node lab with
//! the fixture's `web` Service (NodePort 30080 on the node's address, three endpoints: pod-1..3),
//! the tc programs attached in the lab's node namespace only, and connections from the lab's
//! client namespace, which stands for another host.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::Path;

use kp_core::dataplane::Dataplane;
use kp_core::track::{Object, ProxyState, SourceEvent};
use kp_ebpf::dataplane::EbpfDataplane;
use kp_test::echo::{Outcome, Proto, Request};
use kp_test::lab::{Lab, CLIENT_ALIASES, CLIENT_IP, NODE_IP};

/// `web`'s NodePort.
pub const NODE_PORT: u16 = 30080;

/// Runs `kp-tc-attach` in the lab's node namespace over the maps pinned in `pins`:
/// `kp_tc_outside` on its uplink `eth0`, `kp_tc_reply` on the pod veths.
pub fn attach_tc(lab: &Lab, pins: &Path) {
    let replies: Vec<String> = (0..lab.pod_count()).map(|i| format!("veth{i}")).collect();
    let out = lab
        .node()
        .run(&[
            env!("CARGO_BIN_EXE_kp-tc-attach"),
            &pins.to_string_lossy(),
            "eth0",
            &replies.join(","),
        ])
        .expect("kp-tc-attach in the lab's node namespace");
    assert_eq!(out.trim(), format!("attached {}", replies.len() + 1));
}

/// Twelve client addresses of the lab's client: its own, its aliases and eight more it is given
/// here (192.0.2.100-107).
pub fn twelve_clients(lab: &Lab) -> Vec<Ipv4Addr> {
    for i in 0..8u8 {
        lab.client()
            .add_addr("eth0", &format!("192.0.2.{}/24", 100 + i))
            .expect("client address");
    }
    std::iter::once(CLIENT_IP)
        .chain(CLIENT_ALIASES)
        .chain((0..8u8).map(|i| Ipv4Addr::new(192, 0, 2, 100 + i)))
        .collect()
}

/// `count` new TCP connections from `src` (an address of the lab's client) to the NodePort: the
/// endpoint each reached. Every one must be answered.
pub fn connect(lab: &Lab, src: Ipv4Addr, count: usize) -> Vec<String> {
    let req = Request::new(Proto::Tcp, NODE_IP.into(), NODE_PORT)
        .src_ip(src.into())
        .count(count);
    let outcomes = lab.send(lab.client(), &req);
    outcomes
        .iter()
        .map(|o| match o {
            Outcome::Answered { backend, .. } => backend.clone(),
            other => panic!("a connection from {src} was not answered ({other}): {outcomes:?}"),
        })
        .collect()
}

/// The distinct endpoints in `answers`.
pub fn distinct(answers: &[String]) -> BTreeSet<&str> {
    answers.iter().map(String::as_str).collect()
}

/// Answers counted by endpoint, for messages.
pub fn tally_of(answers: &[String]) -> BTreeMap<&str, usize> {
    let mut counts = BTreeMap::new();
    for a in answers {
        *counts.entry(a.as_str()).or_insert(0) += 1;
    }
    counts
}

/// The fixture's `web` Service, with `sessionAffinity: ClientIP` and `timeout` seconds.
pub fn web_with_affinity(timeout: u32) -> Object {
    let web = kp_flows::fixture::objects()
        .into_iter()
        .find(|o| matches!(o, Object::Service(s) if s.metadata.name.as_deref() == Some("web")))
        .expect("the fixture's web Service");
    let mut manifest = kp_flows::fixture::manifest(&web);
    manifest["spec"]["sessionAffinity"] = "ClientIP".into();
    manifest["spec"]["sessionAffinityConfig"] =
        serde_json::json!({"clientIP": {"timeoutSeconds": timeout}});
    Object::Service(Box::new(
        serde_json::from_value(manifest).expect("web with affinity"),
    ))
}

/// Applies `object` to `state` and syncs the changed Service (a partial sync), checking that the
/// maps are then as planned.
pub fn update(dp: &mut EbpfDataplane, state: &mut ProxyState, object: Object) {
    state
        .apply(SourceEvent::Upsert(object))
        .expect("Service update");
    let changes = state.take_changes();
    dp.sync(state, &changes, false).expect("partial sync");
    assert_eq!(dp.verify().expect("verify"), Vec::<String>::new());
}
