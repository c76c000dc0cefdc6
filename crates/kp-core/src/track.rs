//! The proxy's view of the cluster, and what changed since the last sync.
//!
//! Sources feed [`SourceEvent`]s; [`ProxyState::apply`] validates each object, keeps the last
//! good version of every object (an invalid update never removes what was working), and records
//! which Services changed. [`ProxyState::take_changes`] hands a sync exactly those Services.
//! Mirrors upstream `pkg/proxy/servicechangetracker.go` and `endpointschangetracker.go`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Endpoints, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::convert::{self, InvalidObject, ServiceDisposition};
use crate::logsafe::Escaped;
use crate::mirror;
use ipnet::IpNet;

use crate::model::{Endpoint, NodeInfo, ServiceKey, ServicePort, ServicePortName, SliceEndpoints};
use crate::select::{self, SelectedEndpoints};

/// The kinds of object the proxy watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// core/v1 Service.
    Service,
    /// discovery.k8s.io/v1 EndpointSlice.
    EndpointSlice,
    /// core/v1 Node (only this node).
    Node,
    /// networking.k8s.io/v1 ServiceCIDR: the ranges ClusterIPs are allocated from.
    ServiceCidr,
    /// core/v1 Endpoints, mirrored into EndpointSlices ([`crate::mirror`]). Only the manifest
    /// directory sends these (a cluster's mirroring controller writes the slices itself); they
    /// count as part of the EndpointSlice list, so there is no `Synced(Endpoints)` to wait for.
    Endpoints,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
            Kind::Endpoints => "Endpoints",
        })
    }
}

/// A watched object.
#[derive(Clone, Debug)]
pub enum Object {
    /// A Service.
    Service(Box<Service>),
    /// An EndpointSlice.
    EndpointSlice(Box<EndpointSlice>),
    /// A Node.
    Node(Box<Node>),
    /// A ServiceCIDR.
    ServiceCidr(Box<ServiceCIDR>),
    /// An Endpoints object (see [`Kind::Endpoints`]).
    Endpoints(Box<Endpoints>),
}

impl Object {
    /// The object's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::EndpointSlice(_) => Kind::EndpointSlice,
            Object::Node(_) => Kind::Node,
            Object::ServiceCidr(_) => Kind::ServiceCidr,
            Object::Endpoints(_) => Kind::Endpoints,
        }
    }

    /// The object's metadata.
    pub fn metadata(&self) -> &ObjectMeta {
        match self {
            Object::Service(s) => &s.metadata,
            Object::EndpointSlice(s) => &s.metadata,
            Object::Node(n) => &n.metadata,
            Object::ServiceCidr(c) => &c.metadata,
            Object::Endpoints(e) => &e.metadata,
        }
    }

    /// The object's namespace (empty for cluster-scoped Nodes and ServiceCIDRs) and name.
    pub fn key(&self) -> ObjectKey {
        let meta = self.metadata();
        ObjectKey {
            namespace: match self {
                Object::Node(_) | Object::ServiceCidr(_) => String::new(),
                _ => meta.namespace.clone().unwrap_or_else(|| "default".into()),
            },
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

/// Namespace and name of a watched object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// Namespace; empty for cluster-scoped objects.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// `namespace/name` (or `name`), with control characters escaped: the key of a rejected object
/// is whatever its author wrote, and goes into log lines.
impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            Escaped(&self.name).fmt(f)
        } else {
            write!(f, "{}/{}", Escaped(&self.namespace), Escaped(&self.name))
        }
    }
}

/// What a source reports. The contract: after `Synced(kind)`, the source has delivered every
/// object of that kind that exists; later it reports each change as `Upsert` or `Delete`. A
/// source that re-lists reports the objects that vanished meanwhile as `Delete`.
#[derive(Clone, Debug)]
pub enum SourceEvent {
    /// An object was added or changed.
    Upsert(Object),
    /// An object was removed.
    Delete(Kind, ObjectKey),
    /// The initial list of this kind is complete.
    Synced(Kind),
}

/// What applying one event did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The proxy's view changed; a sync is needed.
    Changed,
    /// Nothing the proxy programs changed.
    Unchanged,
}

/// An object that was rejected, and why. The previous good version (if any) stays in force.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {key}: {reason}")]
pub struct Rejected {
    /// The object's kind.
    pub kind: Kind,
    /// The object's key.
    pub key: ObjectKey,
    /// Why.
    pub reason: InvalidObject,
}

/// What changed since the previous [`ProxyState::take_changes`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Services whose ports or endpoints changed (including added and deleted ones).
    pub services: BTreeSet<ServiceKey>,
    /// Number of Service object changes included.
    pub service_changes: u64,
    /// Number of EndpointSlice (and Endpoints) object changes included.
    pub endpoint_changes: u64,
    /// The node-wide context of the rules changed: this Node in a way that affects them (zone,
    /// pod CIDRs, primary addresses), or the Service CIDRs. Every Service is planned again.
    pub node_changed: bool,
    /// `last-change-trigger-time` of the EndpointSlice changes included, as Unix seconds.
    pub trigger_times: Vec<f64>,
}

impl Changes {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.node_changed
    }
}

/// One Service port with its selected endpoints: the unit every dataplane programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortState {
    /// The port.
    pub port: Arc<ServicePort>,
    /// Its selected endpoints.
    pub endpoints: SelectedEndpoints,
}

/// The proxy's view of the cluster.
#[derive(Debug, Default)]
pub struct ProxyState {
    node_name: String,
    services: BTreeMap<ServiceKey, Vec<Arc<ServicePort>>>,
    /// Slices by (namespace, slice name).
    slices: HashMap<ObjectKey, SliceEndpoints>,
    /// Slice names per Service, sorted (a Service has a handful; a `Vec` costs a fraction of
    /// a `BTreeSet`'s node at 10k Services).
    slices_by_service: HashMap<ServiceKey, Vec<ObjectKey>>,
    /// Slices mirrored from Endpoints objects, by Service (an Endpoints is named after its
    /// Service), sorted by slice name. Used for a Service only while `slices_by_service` has no
    /// entry for it: a Service's own EndpointSlices win.
    mirrored: HashMap<ServiceKey, Vec<SliceEndpoints>>,
    node: NodeInfo,
    /// Service CIDRs from the configuration (our `serviceCIDRs` setting).
    configured_service_cidrs: Vec<IpNet>,
    /// Service CIDRs from ServiceCIDR objects, by object name.
    api_service_cidrs: BTreeMap<String, Vec<IpNet>>,
    synced: BTreeSet<Kind>,
    pending: Changes,
}

impl ProxyState {
    /// An empty view for the node `node_name`.
    pub fn new(node_name: impl Into<String>) -> Self {
        let node_name = node_name.into();
        ProxyState {
            node: NodeInfo {
                name: node_name.clone(),
                ..NodeInfo::default()
            },
            node_name,
            ..ProxyState::default()
        }
    }

    /// Sets the Service CIDRs given by configuration; they count alongside those of ServiceCIDR
    /// objects. Meant for start-up, before the first sync (it records a node-wide change).
    pub fn set_configured_service_cidrs(&mut self, cidrs: Vec<IpNet>) {
        let before = self.service_cidrs();
        self.configured_service_cidrs = cidrs.into_iter().map(|n| n.trunc()).collect();
        if self.service_cidrs() != before {
            self.pending.node_changed = true;
        }
    }

    /// The ranges ClusterIPs are allocated from, as far as this proxy knows them (configured,
    /// and from ServiceCIDR objects), aggregated: traffic to an address inside them that no
    /// Service holds is dropped, as upstream's nftables mode does. Empty when none is known.
    pub fn service_cidrs(&self) -> Vec<IpNet> {
        let all: Vec<IpNet> = self
            .configured_service_cidrs
            .iter()
            .chain(self.api_service_cidrs.values().flatten())
            .copied()
            .collect();
        IpNet::aggregate(&all)
    }

    /// This node's name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// This node's Node object, as last seen.
    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    /// Whether Services, EndpointSlices and this Node have all completed their initial list, so
    /// rules may be programmed without wiping state from partial data. The Node matters too: it
    /// carries the primary addresses NodePorts answer on and the podCIDRs of detect-local, and
    /// a first table built without them would replace working rules with broken ones. (A Node
    /// that does not exist still completes its list, empty.)
    pub fn ready_to_program(&self) -> bool {
        [Kind::Service, Kind::EndpointSlice, Kind::Node]
            .iter()
            .all(|k| self.synced.contains(k))
    }

    /// Whether the initial list of `kind` has completed.
    pub fn synced(&self, kind: Kind) -> bool {
        self.synced.contains(&kind)
    }

    /// Number of changes waiting for a sync: (service changes, endpoint changes).
    pub fn pending_counts(&self) -> (u64, u64) {
        (self.pending.service_changes, self.pending.endpoint_changes)
    }

    /// Applies one event. A rejected object leaves its previous good version in force.
    pub fn apply(&mut self, event: SourceEvent) -> Result<Applied, Rejected> {
        match event {
            SourceEvent::Synced(kind) => {
                self.synced.insert(kind);
                Ok(Applied::Changed)
            }
            SourceEvent::Upsert(obj) => {
                let (kind, key) = (obj.kind(), obj.key());
                let reject = |reason| Rejected {
                    kind,
                    key: key.clone(),
                    reason,
                };
                match obj {
                    Object::Service(svc) => {
                        let (skey, disp) = convert::service_ports(&svc).map_err(reject)?;
                        let ports = match disp {
                            // Not `collect()`: that would reuse the `ServicePort` buffer,
                            // keeping its whole capacity for a few pointers.
                            ServiceDisposition::Proxied(p) => {
                                let mut ports = Vec::with_capacity(p.len());
                                ports.extend(p.into_iter().map(Arc::new));
                                ports
                            }
                            ServiceDisposition::Ignored(_) => Vec::new(),
                        };
                        Ok(self.set_service(skey, ports))
                    }
                    Object::EndpointSlice(slice) => {
                        match convert::slice_endpoints(&slice, &self.node_name).map_err(reject)? {
                            Some(eps) => Ok(self.set_slice(key, Some(eps))),
                            None => Ok(self.set_slice(key, None)),
                        }
                    }
                    Object::Node(node) => {
                        if key.name != self.node_name {
                            return Ok(Applied::Unchanged);
                        }
                        let info = convert::node_info(&node).map_err(reject)?;
                        Ok(self.set_node(info))
                    }
                    Object::ServiceCidr(c) => {
                        let cidrs = convert::service_cidrs(&c).map_err(reject)?;
                        Ok(self.set_service_cidrs(key.name, Some(cidrs)))
                    }
                    Object::Endpoints(e) => {
                        let (service, slices, _) =
                            mirror::mirrored_endpoints(&e, &self.node_name).map_err(reject)?;
                        Ok(self.set_mirrored(service, slices))
                    }
                }
            }
            SourceEvent::Delete(Kind::ServiceCidr, key) => {
                Ok(self.set_service_cidrs(key.name, None))
            }
            SourceEvent::Delete(Kind::Service, key) => {
                Ok(self.set_service(ServiceKey::new(key.namespace, key.name), Vec::new()))
            }
            SourceEvent::Delete(Kind::EndpointSlice, key) => Ok(self.set_slice(key, None)),
            SourceEvent::Delete(Kind::Endpoints, key) => {
                Ok(self.set_mirrored(ServiceKey::new(key.namespace, key.name), Vec::new()))
            }
            SourceEvent::Delete(Kind::Node, key) => {
                if key.name != self.node_name {
                    return Ok(Applied::Unchanged);
                }
                Ok(self.set_node(NodeInfo {
                    name: self.node_name.clone(),
                    ..NodeInfo::default()
                }))
            }
        }
    }

    fn set_service(&mut self, key: ServiceKey, ports: Vec<Arc<ServicePort>>) -> Applied {
        let old = if ports.is_empty() {
            self.services.remove(&key)
        } else {
            self.services.insert(key.clone(), ports.clone())
        };
        if old.unwrap_or_default() == ports {
            return Applied::Unchanged;
        }
        self.pending.service_changes += 1;
        self.pending.services.insert(key);
        Applied::Changed
    }

    fn set_slice(&mut self, key: ObjectKey, eps: Option<SliceEndpoints>) -> Applied {
        if self.slices.get(&key) == eps.as_ref() {
            return Applied::Unchanged;
        }
        let new_service = eps.as_ref().map(|e| (e.service.clone(), e.trigger_time));
        let old = match eps {
            Some(e) => self.slices.insert(key.clone(), e),
            None => self.slices.remove(&key),
        };
        if let Some(o) = &old {
            if let Some(keys) = self.slices_by_service.get_mut(&o.service) {
                if let Ok(i) = keys.binary_search(&key) {
                    keys.remove(i);
                }
                if keys.is_empty() {
                    self.slices_by_service.remove(&o.service);
                }
            }
            self.pending.services.insert(o.service.clone());
        }
        if let Some((service, trigger_time)) = new_service {
            let keys = self
                .slices_by_service
                .entry(service.clone())
                .or_insert_with(|| Vec::with_capacity(1));
            if let Err(i) = keys.binary_search(&key) {
                keys.insert(i, key);
            }
            self.pending.services.insert(service);
            if let Some(t) = trigger_time {
                self.pending.trigger_times.push(t);
            }
        }
        self.pending.endpoint_changes += 1;
        Applied::Changed
    }

    /// Sets the slices mirrored from the Endpoints of `service` (none: it went, or mirrors
    /// nothing). Only that Service is touched, and only if no slice of its own shadows them.
    fn set_mirrored(&mut self, service: ServiceKey, mut slices: Vec<SliceEndpoints>) -> Applied {
        slices.sort_by(|a, b| a.slice_name.cmp(&b.slice_name));
        if self.mirrored.get(&service).map_or(&[][..], Vec::as_slice) == slices.as_slice() {
            return Applied::Unchanged;
        }
        let shadowed = self.slices_by_service.contains_key(&service);
        if slices.is_empty() {
            self.mirrored.remove(&service);
        } else {
            self.mirrored.insert(service.clone(), slices);
        }
        if shadowed {
            // Kept for when the Service's own slices go; nothing programmed changes now.
            return Applied::Unchanged;
        }
        self.pending.services.insert(service);
        self.pending.endpoint_changes += 1;
        Applied::Changed
    }

    fn set_node(&mut self, info: NodeInfo) -> Applied {
        if info == self.node {
            return Applied::Unchanged;
        }
        if info.zone != self.node.zone
            || info.pod_cidrs != self.node.pod_cidrs
            || info.addresses != self.node.addresses
        {
            self.pending.node_changed = true;
        }
        self.node = info;
        Applied::Changed
    }

    fn set_service_cidrs(&mut self, name: String, cidrs: Option<Vec<IpNet>>) -> Applied {
        if self.api_service_cidrs.get(&name) == cidrs.as_ref() {
            return Applied::Unchanged;
        }
        let before = self.service_cidrs();
        match cidrs {
            Some(c) => self.api_service_cidrs.insert(name, c),
            None => self.api_service_cidrs.remove(&name),
        };
        if self.service_cidrs() == before {
            // Another object or the configuration already covers the same ranges.
            return Applied::Unchanged;
        }
        self.pending.node_changed = true;
        Applied::Changed
    }

    /// Takes the changes recorded since the previous call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.pending)
    }

    /// All Service keys currently proxied.
    pub fn service_keys(&self) -> impl Iterator<Item = &ServiceKey> {
        self.services.keys()
    }

    /// Number of proxied Service ports.
    pub fn service_port_count(&self) -> usize {
        self.services.values().map(Vec::len).sum()
    }

    /// The ports of one Service (empty if not proxied).
    pub fn service_ports(&self, key: &ServiceKey) -> &[Arc<ServicePort>] {
        self.services.get(key).map(Vec::as_slice).unwrap_or(&[])
    }

    /// All endpoints of one Service port, merged over its slices and families. An address
    /// listed more than once counts once: an entry that is not terminating wins over one that
    /// is (the pod network reused a terminating pod's address, as upstream's
    /// `EndpointSliceCache`), and otherwise the slice with the lowest name wins. The slices are
    /// the Service's own EndpointSlices, or if it has none, those mirrored from its Endpoints.
    pub fn endpoints(&self, name: &ServicePortName) -> Vec<Endpoint> {
        let mut out: BTreeMap<(std::net::IpAddr, u16), Endpoint> = BTreeMap::new();
        let mut merge = |slice: &SliceEndpoints| {
            for p in &slice.ports {
                if p.port_name != name.port || p.protocol != name.protocol {
                    continue;
                }
                for ep in &p.endpoints {
                    let kept = out.entry((ep.ip, ep.port)).or_insert_with(|| ep.clone());
                    if kept.terminating && !ep.terminating {
                        *kept = ep.clone();
                    }
                }
            }
        };
        match self.slices_by_service.get(&name.service) {
            Some(keys) => keys
                .iter()
                .filter_map(|k| self.slices.get(k))
                .for_each(&mut merge),
            None => self
                .mirrored
                .get(&name.service)
                .into_iter()
                .flatten()
                .for_each(&mut merge),
        }
        out.into_values().collect()
    }

    /// The ports of one Service with their selected endpoints.
    pub fn service_state(&self, key: &ServiceKey) -> Vec<ServicePortState> {
        self.service_ports(key)
            .iter()
            .map(|port| ServicePortState {
                endpoints: select::select(port, &self.endpoints(&port.name), &self.node),
                port: port.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
