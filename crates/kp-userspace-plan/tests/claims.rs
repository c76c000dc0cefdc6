//! Two Service ports claiming one frontend (same address, port and protocol): the balancer
//! (which route a connection takes) and the redirect table (which verdict the kernel holds)
//! give it to the same Service port, by the nftables mode's rule: the first by rank (Service
//! namespace and name, then port name) holds it, whatever order the claims came in and
//! whatever a sync re-derived, so partial and full syncs agree; when the holder lets go, the
//! next by rank takes over.
//!
//! The frontend is a ClusterIP both Services list: `a-reject` has no endpoints (rejected),
//! `b-drop` has `internalTrafficPolicy: Local` with its only endpoint on another node
//! (dropped), so each verdict names its Service in all three: the balancer's pick, the
//! userspace redirect table's `no-endpoint-vips` element, and the nftables mode's.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kp_core::model::{IpFamily, Protocol};
use kp_core::node::{DetectLocal, NodeContext};
use kp_core::track::{Changes, Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_nftables_plan::element::{parse_tuple, Tuple};
use kp_userspace_plan::{
    Balancer, BalancerConfig, Pick, RedirectConfig, RedirectPlanner, Scheduler, SetId, SetKind,
};
use serde_json::json;

const VIP: &str = "10.96.7.7";

fn service(name: &str, extra: serde_json::Value) -> Object {
    let mut spec = json!({"clusterIP": VIP, "ports": [
        {"name": "p", "protocol": "TCP", "port": 80, "targetPort": 8080}]});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    let v = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"}, "spec": spec});
    Object::Service(Box::new(serde_json::from_value(v).expect("service")))
}

/// `b-drop`'s one endpoint, on another node.
fn remote_slice() -> Object {
    let v = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "b-drop-abcde", "namespace": "default",
            "labels": {"kubernetes.io/service-name": "b-drop"}},
        "addressType": "IPv4",
        "ports": [{"name": "p", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": ["10.244.9.9"], "conditions": {"ready": true},
            "nodeName": "another-node"}],
    });
    Object::EndpointSlice(Box::new(serde_json::from_value(v).expect("slice")))
}

fn a_reject() -> Object {
    service("a-reject", json!({}))
}

fn b_drop() -> Object {
    service("b-drop", json!({"internalTrafficPolicy": "Local"}))
}

/// Who holds the frontend, by the verdict it gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// `a-reject`: rejected.
    A,
    /// `b-drop`: dropped.
    B,
}

/// The three planners, synced alike.
struct Planners {
    balancer: Balancer,
    redirect: RedirectPlanner,
    nftables: kp_nftables_plan::Planner,
    node: NodeContext,
}

impl Planners {
    fn new() -> Planners {
        Planners {
            balancer: Balancer::new(BalancerConfig {
                scheduler: Scheduler::RoundRobin,
                masquerade_all: false,
                detect_local: DetectLocal::None,
                quarantine: Duration::from_secs(10),
            }),
            redirect: RedirectPlanner::new(RedirectConfig {
                proxy_port: 31000,
                transparent_mark: 0x4000,
                node_ports_restricted: false,
            }),
            nftables: kp_nftables_plan::Planner::new(kp_nftables_plan::PlanConfig::new(
                IpFamily::V4,
            )),
            node: kp_flows::node_context(),
        }
    }

    fn full(&mut self, state: &ProxyState) {
        self.balancer
            .sync(state, &self.node, &Changes::default(), true);
        self.redirect.full(state, &self.node);
        self.nftables.full(state, &self.node);
    }

    fn partial(&mut self, state: &ProxyState, changes: &Changes) {
        self.balancer.sync(state, &self.node, changes, false);
        self.redirect.partial(state, &self.node, changes);
        self.nftables
            .partial(state, &changes.services, &self.node, false);
    }

    /// The holder as each sees it: balancer, userspace redirect table, nftables mode.
    fn holders(&mut self) -> [Option<Holder>; 3] {
        let frontend = SocketAddr::new(VIP.parse().unwrap(), 80);
        let client = SocketAddr::new("192.0.2.1".parse().unwrap(), 40000);
        let pick = self
            .balancer
            .pick(Protocol::Tcp, frontend, client, false, Instant::now());
        let balancer = match pick {
            Pick::Reject => Some(Holder::A),
            Pick::Drop => Some(Holder::B),
            _ => None,
        };
        let key = parse_tuple(&format!("{VIP} . tcp . 80")).unwrap();
        let verdict = |v: Option<Option<Tuple>>| {
            let text = format!("{:?}", v??).to_lowercase();
            if text.contains("reject") {
                Some(Holder::A)
            } else if text.contains("drop") {
                Some(Holder::B)
            } else {
                None
            }
        };
        let redirect = verdict(
            self.redirect
                .expected_elements(SetId {
                    kind: SetKind::NoEndpointVips,
                    family: IpFamily::V4,
                })
                .get(&key)
                .cloned(),
        );
        let nftables = verdict(
            self.nftables
                .expected_value(kp_nftables_plan::SetId::NoEndpointVips, &key),
        );
        [balancer, redirect, nftables]
    }
}

fn apply(state: &mut ProxyState, event: SourceEvent) -> Changes {
    state.apply(event).expect("valid object");
    state.take_changes()
}

#[test]
fn two_service_ports_claiming_one_frontend_get_the_same_holder_in_the_balancer_and_the_table() {
    let mut state = kp_flows::load(kp_flows::NODE, vec![a_reject(), b_drop(), remote_slice()]);
    let mut p = Planners::new();
    let all = |h| [Some(h); 3];

    // A full sync claims in Service order: a-reject first.
    p.full(&state);
    assert_eq!(p.holders(), all(Holder::A), "after the first full sync");

    // a-reject changes (a second port): re-derived, it claims again and still comes first.
    let mut spec_ports = json!({"ports": [
        {"name": "p", "protocol": "TCP", "port": 80, "targetPort": 8080},
        {"name": "q", "protocol": "TCP", "port": 81, "targetPort": 8081}]});
    let changes = apply(
        &mut state,
        SourceEvent::Upsert(service("a-reject", spec_ports.take())),
    );
    assert!(changes.services.iter().any(|k| k.name == "a-reject"));
    p.partial(&state, &changes);
    assert_eq!(p.holders(), all(Holder::A), "after a-reject's partial sync");

    // A full sync: the same.
    p.full(&state);
    assert_eq!(p.holders(), all(Holder::A), "after the second full sync");

    // The holder goes: the claim waiting takes over; it comes back: it holds it again.
    let key = ObjectKey {
        namespace: "default".into(),
        name: "a-reject".into(),
    };
    let changes = apply(&mut state, SourceEvent::Delete(Kind::Service, key));
    p.partial(&state, &changes);
    assert_eq!(p.holders(), all(Holder::B), "after a-reject's removal");
    let changes = apply(&mut state, SourceEvent::Upsert(a_reject()));
    p.partial(&state, &changes);
    assert_eq!(p.holders(), all(Holder::A), "after a-reject came back");

    // b-drop goes: a-reject alone holds it, in all three.
    let key = ObjectKey {
        namespace: "default".into(),
        name: "b-drop".into(),
    };
    let changes = apply(&mut state, SourceEvent::Delete(Kind::Service, key));
    p.partial(&state, &changes);
    assert_eq!(p.holders(), all(Holder::A), "after b-drop's removal");
}
