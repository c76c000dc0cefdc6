//! A model of which endpoints a Service gets: those of its own EndpointSlices if it has any
//! (even an empty one), otherwise those mirrored from the v1 Endpoints object of its name.
//!
//! The harness tells the model every object `ProxyState` accepted and every deletion, and
//! checks [`ProxyState::endpoints`] against it: after each event for the Services the event
//! touched, and at each plan for every Service. At each plan it also checks that every Service
//! whose endpoints changed since the last plan is in the recorded `Changes`, so that the
//! planners' partial syncs see a flip of the precedence.
//!
//! A Service's own slices are converted as `ProxyState` converts them
//! (`kp_core::convert::slice_endpoints`): what is modelled here is which slices count. The
//! mirrored endpoints are modelled apart from `kp_core::mirror`, straight from the Endpoints
//! object as the mirroring controller reads it: nothing for an object labelled
//! `endpointslice.kubernetes.io/skip-mirror: "true"` or carrying the leader-election
//! annotation; otherwise, per subset, its first 1000 addresses (ready ones first, the
//! not-ready ones with `ready: false`) times its ports. The model also says when an Endpoints
//! must have been refused: an address among those 1000 that does not parse, a port out of
//! 1-65535, a protocol that is not TCP, UDP or SCTP, a name that is not a DNS label.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Endpoints;
use kp_core::convert;
use kp_core::mirror::{ANNOTATION_LEADER, LABEL_SKIP_MIRROR, MAX_ENDPOINTS_PER_SUBSET};
use kp_core::model::{Endpoint, Protocol, ServiceKey, SliceEndpoints};
use kp_core::track::{Kind, Object, ObjectKey, ProxyState};

/// The endpoints of one Service port by address and port, each with the values it may have
/// (several when an address is listed more than once with other conditions: which one wins is
/// `ProxyState`'s to choose).
type PortView = BTreeMap<(IpAddr, u16), BTreeSet<EndpointValue>>;

/// A Service's endpoints by port name and protocol.
pub type View = BTreeMap<(String, Protocol), PortView>;

/// An endpoint's fields, comparable.
type EndpointValue = (bool, bool, bool, bool, Option<BTreeSet<String>>);

fn value(e: &Endpoint) -> EndpointValue {
    (
        e.ready,
        e.serving,
        e.terminating,
        e.is_local,
        e.zone_hints.clone(),
    )
}

/// What an object will change in the model if `ProxyState` accepts it (see [`Model::prepare`]).
#[derive(Debug)]
pub enum Pending {
    /// An EndpointSlice: its key and its conversion (`None`: it names no Service or family).
    Slice(ObjectKey, Option<SliceEndpoints>),
    /// An Endpoints object: the Service it belongs to and its mirrored endpoints.
    Endpoints(ServiceKey, View),
    /// An Endpoints object the model says is invalid, and why.
    Invalid(String),
    /// A Service: its endpoints are looked up again for its new ports.
    Service(ServiceKey),
    /// Anything else, or an object the model expects to be refused anyway.
    Nothing,
}

/// The model.
#[derive(Debug, Default)]
pub struct Model {
    /// This node's name (for `is_local`).
    node: String,
    /// Accepted EndpointSlices that name a Service.
    own: HashMap<ObjectKey, SliceEndpoints>,
    /// Their keys by Service.
    own_by_service: HashMap<ServiceKey, BTreeSet<ObjectKey>>,
    /// Mirrored endpoints by Service (none: no Endpoints, or one that mirrors nothing).
    mirrored: HashMap<ServiceKey, View>,
    /// The view at the last plan of each Service touched since.
    at_plan: HashMap<ServiceKey, View>,
    /// Times a Service with mirrored endpoints got its first own slice or lost its last.
    pub flips: u64,
}

impl Model {
    /// An empty model for the node `node`.
    pub fn new(node: &str) -> Model {
        Model {
            node: node.to_string(),
            ..Model::default()
        }
    }

    /// What `obj` would change, worked out before `ProxyState::apply` takes it.
    pub fn prepare(&self, obj: &Object) -> Pending {
        match obj {
            Object::EndpointSlice(s) => match convert::slice_endpoints(s, &self.node) {
                Ok(eps) => Pending::Slice(obj.key(), eps),
                Err(_) => Pending::Nothing,
            },
            Object::Endpoints(e) => match mirrored_view(e, &self.node) {
                Ok((service, view)) => Pending::Endpoints(service, view),
                Err(why) => Pending::Invalid(why),
            },
            Object::Service(_) => {
                let key = obj.key();
                Pending::Service(ServiceKey::new(key.namespace, key.name))
            }
            _ => Pending::Nothing,
        }
    }

    /// Records an object `ProxyState` accepted; the Services whose endpoints to check now, or
    /// why the object should have been refused.
    pub fn accepted(&mut self, pending: Pending) -> Result<Vec<ServiceKey>, String> {
        match pending {
            Pending::Slice(key, eps) => Ok(self.set_slice(key, eps)),
            Pending::Endpoints(service, view) => {
                self.touch(&service);
                if view.is_empty() {
                    self.mirrored.remove(&service);
                } else {
                    self.mirrored.insert(service.clone(), view);
                }
                Ok(vec![service])
            }
            Pending::Invalid(why) => Err(why),
            Pending::Service(service) => Ok(vec![service]),
            Pending::Nothing => Ok(Vec::new()),
        }
    }

    /// Records a deletion; the Services to check now.
    pub fn deleted(&mut self, kind: Kind, key: &ObjectKey) -> Vec<ServiceKey> {
        match kind {
            Kind::EndpointSlice => self.set_slice(key.clone(), None),
            Kind::Endpoints => {
                let service = ServiceKey::new(key.namespace.clone(), key.name.clone());
                self.touch(&service);
                self.mirrored.remove(&service);
                vec![service]
            }
            _ => Vec::new(),
        }
    }

    fn set_slice(&mut self, key: ObjectKey, eps: Option<SliceEndpoints>) -> Vec<ServiceKey> {
        let mut touched = Vec::new();
        if let Some(old) = self.own.get(&key).map(|o| o.service.clone()) {
            self.touch(&old);
            if let Some(keys) = self.own_by_service.get_mut(&old) {
                keys.remove(&key);
                if keys.is_empty() {
                    self.own_by_service.remove(&old);
                    self.flips += u64::from(self.mirrored.contains_key(&old));
                }
            }
            self.own.remove(&key);
            touched.push(old);
        }
        if let Some(eps) = eps {
            let service = eps.service.clone();
            self.touch(&service);
            if !self.own_by_service.contains_key(&service) {
                self.flips += u64::from(self.mirrored.contains_key(&service));
            }
            self.own_by_service
                .entry(service.clone())
                .or_default()
                .insert(key.clone());
            self.own.insert(key, eps);
            touched.push(service);
        }
        touched
    }

    /// Remembers the view of `service` before its first change since the last plan.
    fn touch(&mut self, service: &ServiceKey) {
        if !self.at_plan.contains_key(service) {
            let view = self.view(service);
            self.at_plan.insert(service.clone(), view);
        }
    }

    /// The endpoints `service` should have: its own slices' if it has any, else mirrored.
    pub fn view(&self, service: &ServiceKey) -> View {
        let Some(keys) = self.own_by_service.get(service) else {
            return self.mirrored.get(service).cloned().unwrap_or_default();
        };
        let mut view = View::new();
        for slice in keys.iter().filter_map(|k| self.own.get(k)) {
            for p in &slice.ports {
                let port = view.entry((p.port_name.clone(), p.protocol)).or_default();
                for e in &p.endpoints {
                    port.entry((e.ip, e.port)).or_default().insert(value(e));
                }
            }
        }
        view
    }

    /// Whether the endpoints `state` gives each port of `service` are what the model says.
    pub fn check(&self, state: &ProxyState, service: &ServiceKey) -> Result<(), String> {
        let view = self.view(service);
        let source = if self.own_by_service.contains_key(service) {
            "its own EndpointSlices"
        } else if self.mirrored.contains_key(service) {
            "its mirrored Endpoints"
        } else {
            "nothing"
        };
        for port in state.service_ports(service) {
            let got = state.endpoints(&port.name);
            let empty = PortView::new();
            let want = view
                .get(&(port.name.port.clone(), port.name.protocol))
                .unwrap_or(&empty);
            let differs = got.len() != want.len()
                || got.iter().any(|e| {
                    want.get(&(e.ip, e.port))
                        .is_none_or(|values| !values.contains(&value(e)))
                });
            if differs {
                let show = |eps: Vec<String>| eps.into_iter().take(4).collect::<Vec<_>>();
                return Err(format!(
                    "{service} port {:?}/{}: endpoints {:?}, the model's (from {source}) {:?}",
                    port.name.port,
                    port.name.protocol.as_kubernetes(),
                    show(got.iter().map(ToString::to_string).collect()),
                    show(want.keys().map(|(ip, p)| show_key(*ip, *p)).collect()),
                ));
            }
        }
        Ok(())
    }

    /// How many Services the state proxies get mirrored endpoints (no own slice).
    pub fn mirrored_served(&self, state: &ProxyState) -> u64 {
        state
            .service_keys()
            .filter(|s| !self.own_by_service.contains_key(*s) && self.mirrored.contains_key(*s))
            .count() as u64
    }

    /// Every Service the state proxies, checked (see [`Model::check`]).
    pub fn check_all(&self, state: &ProxyState) -> Vec<String> {
        state
            .service_keys()
            .filter_map(|s| self.check(state, s).err())
            .collect()
    }

    /// At a plan: the Services the state proxies whose endpoints changed since the last plan
    /// but are not among `changed` (what `take_changes` recorded). Starts the next interval.
    pub fn unrecorded(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServiceKey>,
    ) -> Vec<ServiceKey> {
        let at_plan = std::mem::take(&mut self.at_plan);
        let mut out: Vec<ServiceKey> = at_plan
            .into_iter()
            .filter(|(s, before)| {
                !changed.contains(s)
                    && !state.service_ports(s).is_empty()
                    && self.view(s) != *before
            })
            .map(|(s, _)| s)
            .collect();
        out.sort();
        out
    }
}

/// An address and port as `Endpoint` shows itself.
fn show_key(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{ip}:{port}"),
        IpAddr::V6(ip) => format!("[{ip}]:{port}"),
    }
}

/// The endpoints an Endpoints object gives its Service, from the object alone, or why it is
/// invalid.
pub fn mirrored_view(e: &Endpoints, node: &str) -> Result<(ServiceKey, View), String> {
    let meta = &e.metadata;
    let namespace = meta.namespace.as_deref().unwrap_or("default");
    let name = meta.name.as_deref().ok_or("no name")?;
    for (what, v) in [("namespace", namespace), ("name", name)] {
        if convert::validate_dns_label("f", v).is_err() {
            return Err(format!("{what} {v:?} is not a DNS label"));
        }
    }
    let service = ServiceKey::new(namespace, name);
    let skipped = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SKIP_MIRROR))
        .is_some_and(|v| v == "true")
        || meta
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(ANNOTATION_LEADER));
    let mut view = View::new();
    if skipped {
        return Ok((service, view));
    }
    for subset in e.subsets.iter().flatten() {
        let mut ports = Vec::new();
        for p in subset.ports.iter().flatten() {
            if !(1..=65535).contains(&p.port) {
                return Err(format!("port {}", p.port));
            }
            let protocol = p.protocol.as_deref().unwrap_or("TCP");
            let protocol = match protocol {
                "TCP" => Protocol::Tcp,
                "UDP" => Protocol::Udp,
                "SCTP" => Protocol::Sctp,
                other => return Err(format!("protocol {other:?}")),
            };
            let name = p.name.clone().unwrap_or_default();
            if !name.is_empty() && convert::validate_dns_label("f", &name).is_err() {
                return Err(format!("port name {name:?}"));
            }
            ports.push((name, protocol, p.port as u16));
        }
        let ready = subset.addresses.iter().flatten().map(|a| (a, true));
        let not_ready = subset
            .not_ready_addresses
            .iter()
            .flatten()
            .map(|a| (a, false));
        for (a, ready) in ready.chain(not_ready).take(MAX_ENDPOINTS_PER_SUBSET) {
            let ip: IpAddr = a.ip.parse().map_err(|_| format!("address {:?}", a.ip))?;
            if let Some(n) = &a.node_name {
                if convert::validate_dns_subdomain("f", n).is_err() {
                    return Err(format!("nodeName {n:?}"));
                }
            }
            let is_local = a.node_name.as_deref() == Some(node);
            for (name, protocol, port) in &ports {
                view.entry((name.clone(), *protocol))
                    .or_default()
                    .entry((ip, *port))
                    .or_default()
                    .insert((ready, ready, false, is_local, None));
            }
        }
    }
    Ok((service, view))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use serde_json::json;

    fn endpoints(v: serde_json::Value) -> Object {
        Object::Endpoints(Box::new(serde_json::from_value(v).unwrap()))
    }

    fn service() -> Object {
        Object::Service(Box::new(
            serde_json::from_value(json!({
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {"clusterIP": "10.96.0.5", "ports": [{"port": 80, "name": "http"}]},
            }))
            .unwrap(),
        ))
    }

    fn slice(addresses: &[&str]) -> Object {
        let eps: Vec<_> = addresses
            .iter()
            .map(|a| json!({"addresses": [a]}))
            .collect();
        Object::EndpointSlice(Box::new(
            serde_json::from_value::<EndpointSlice>(json!({
                "metadata": {"name": "web-1", "namespace": "default",
                             "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"port": 8080, "name": "http"}],
                "endpoints": eps,
            }))
            .unwrap(),
        ))
    }

    /// Applies `obj` to both; the Services to check.
    fn apply(state: &mut ProxyState, model: &mut Model, obj: Object) -> Vec<ServiceKey> {
        let pending = model.prepare(&obj);
        state
            .apply(kp_core::track::SourceEvent::Upsert(obj))
            .unwrap();
        model.accepted(pending).unwrap()
    }

    #[test]
    fn own_slices_win_even_empty_and_the_mirrored_ones_come_back() {
        let mut state = ProxyState::new("node-a");
        let mut model = Model::new("node-a");
        let web = ServiceKey::new("default", "web");
        apply(&mut state, &mut model, service());
        let mirrored = endpoints(json!({
            "metadata": {"name": "web", "namespace": "default"},
            "subsets": [{"addresses": [{"ip": "10.244.0.9"}, {"ip": "fd00::9"}],
                         "notReadyAddresses": [{"ip": "10.244.0.10"}],
                         "ports": [{"port": 8080, "name": "http"}]}],
        }));
        apply(&mut state, &mut model, mirrored);
        model.check(&state, &web).unwrap();
        let view = model.view(&web);
        assert_eq!(view[&("http".to_string(), Protocol::Tcp)].len(), 3);
        state.take_changes();
        model.unrecorded(&state, &BTreeSet::new());

        // An empty slice of its own: nothing mirrored may remain.
        apply(&mut state, &mut model, slice(&[]));
        model.check(&state, &web).unwrap();
        assert!(model.view(&web).values().all(BTreeMap::is_empty));
        assert_eq!(model.flips, 1);
        // The change is recorded; a model that forgot it would name the Service.
        let changes = state.take_changes();
        assert!(model.unrecorded(&state, &changes.services).is_empty());

        let touched = model.deleted(
            Kind::EndpointSlice,
            &ObjectKey {
                namespace: "default".into(),
                name: "web-1".into(),
            },
        );
        state
            .apply(kp_core::track::SourceEvent::Delete(
                Kind::EndpointSlice,
                ObjectKey {
                    namespace: "default".into(),
                    name: "web-1".into(),
                },
            ))
            .unwrap();
        assert_eq!(touched, vec![web.clone()]);
        model.check(&state, &web).unwrap();
        assert_eq!(model.flips, 2);
        // Not recorded: reported.
        assert_eq!(
            model.unrecorded(&state, &BTreeSet::new()),
            vec![web.clone()]
        );

        // A state that leaked the mirrored endpoints would differ from the model.
        let other = Model::new("node-a");
        assert!(other.check(&state, &web).is_err());
    }

    #[test]
    fn the_mirrored_view_skips_truncates_and_refuses() {
        let many: Vec<_> = (0..1005u32)
            .map(|k| json!({"ip": std::net::Ipv4Addr::from(0x0af4_0000 | k).to_string()}))
            .collect();
        let e: Endpoints = serde_json::from_value(json!({
            "metadata": {"name": "web"},
            "subsets": [{"addresses": many, "notReadyAddresses": [{"ip": "not an ip"}],
                         "ports": [{"port": 80, "protocol": "UDP"}]}],
        }))
        .unwrap();
        // The bad address is past the limit: never read.
        let (service, view) = mirrored_view(&e, "n").unwrap();
        assert_eq!(service, ServiceKey::new("default", "web"));
        assert_eq!(view[&(String::new(), Protocol::Udp)].len(), 1000);

        let bad = |subset: serde_json::Value, labels: serde_json::Value| {
            let e: Endpoints = serde_json::from_value(json!({
                "metadata": {"name": "web", "labels": labels}, "subsets": [subset],
            }))
            .unwrap();
            mirrored_view(&e, "n")
        };
        let ok = json!({"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 80}]});
        assert!(bad(ok.clone(), json!({})).is_ok());
        for subset in [
            json!({"addresses": [{"ip": "10.0.0.1 "}], "ports": [{"port": 80}]}),
            json!({"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 65536}]}),
            json!({"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 80, "protocol": "tcp"}]}),
            json!({"ports": [{"port": 80, "name": "HTTP"}]}),
        ] {
            assert!(bad(subset.clone(), json!({})).is_err(), "{subset}");
            // Skipped: nothing read, nothing mirrored.
            let skip = json!({ LABEL_SKIP_MIRROR: "true" });
            assert!(bad(subset.clone(), skip).unwrap().1.is_empty());
            // Only "true" skips.
            assert!(bad(subset, json!({ LABEL_SKIP_MIRROR: "True" })).is_err());
        }
    }
}
