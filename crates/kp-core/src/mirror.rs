//! Mirroring v1 Endpoints into EndpointSlices, as a cluster's EndpointSliceMirroring controller
//! does, for sources that hand the proxy Endpoints objects (the manifest directory: walkthroughs
//! and hand-written manifests often hold an `Endpoints` rather than an `EndpointSlice`).
//!
//! [`mirror`] turns one Endpoints object into the EndpointSlices the controller would write:
//! one per distinct set of ports and address family (two subsets with the same ports share a
//! slice), each subset's `addresses` with `conditions.ready: true` and its `notReadyAddresses`
//! with `conditions.ready: false`, `nodeName`, `hostname` and `targetRef` carried, and at most
//! [`MAX_ENDPOINTS_PER_SUBSET`] addresses of a subset mirrored (ready ones first). An Endpoints
//! labelled `endpointslice.kubernetes.io/skip-mirror: "true"`, or carrying the leader-election
//! annotation, is not mirrored. [`mirrored_endpoints`] then converts them as any slice is
//! converted ([`crate::convert::slice_endpoints`]); [`crate::track::ProxyState`] uses them for a
//! Service only while no real EndpointSlice names it.
//!
//! Unlike the controller, which skips an address that is not an IP and lets the API server
//! refuse a slice that does not validate, an Endpoints holding anything invalid (an address, a
//! port, a name) is rejected whole, as a bad EndpointSlice is, so its last good version stays.
//! The controller mirrors only for a Service without a selector; here a Service's own slices win
//! instead, which gives the same result where both exist.
//!
//! Mirrors upstream `pkg/controller/endpointslicemirroring` (`reconciler.go`, `utils.go`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{EndpointAddress, EndpointSubset, Endpoints};
use k8s_openapi::api::discovery::v1::{
    Endpoint as SliceEndpoint, EndpointConditions, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::convert::{self, InvalidObject, ANNOTATION_TRIGGER_TIME, LABEL_SERVICE_NAME};
use crate::model::{IpFamily, ServiceKey, SliceEndpoints};

/// Label that keeps an Endpoints object from being mirrored when set to `"true"`.
pub const LABEL_SKIP_MIRROR: &str = "endpointslice.kubernetes.io/skip-mirror";
/// Label naming the controller that manages an EndpointSlice.
pub const LABEL_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
/// The mirroring controller's name, as it labels the slices it writes.
pub const MIRRORING_CONTROLLER: &str = "endpointslicemirroring-controller.k8s.io";
/// Annotation of the Endpoints objects old components used as leader-election locks; the
/// controller does not mirror those.
pub const ANNOTATION_LEADER: &str = "control-plane.alpha.kubernetes.io/leader";
/// Annotation `kubectl apply` writes; not copied onto mirrored slices.
const ANNOTATION_LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
/// The most addresses mirrored from one subset (upstream's `--mirroring-max-endpoints-per-subset`
/// default); the rest are left out.
pub const MAX_ENDPOINTS_PER_SUBSET: usize = 1000;

/// The EndpointSlices mirrored from one Endpoints object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Mirrored {
    /// The slices, in the order their port set and family first appear in the subsets.
    pub slices: Vec<EndpointSlice>,
    /// Addresses left out because their subset held more than [`MAX_ENDPOINTS_PER_SUBSET`].
    pub truncated: usize,
}

/// Whether the Endpoints object is one the controller leaves alone.
pub fn skipped(endpoints: &Endpoints) -> bool {
    let meta = &endpoints.metadata;
    meta.labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SKIP_MIRROR))
        .is_some_and(|v| v == "true")
        || meta
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(ANNOTATION_LEADER))
}

/// How many addresses of `endpoints` [`mirror`] leaves out over the per-subset limit (none for
/// an object that is not mirrored at all), without converting it.
pub fn truncated(endpoints: &Endpoints) -> usize {
    if skipped(endpoints) {
        return 0;
    }
    endpoints
        .subsets
        .iter()
        .flatten()
        .map(|s| {
            let total = s.addresses.as_ref().map_or(0, Vec::len)
                + s.not_ready_addresses.as_ref().map_or(0, Vec::len);
            total.saturating_sub(MAX_ENDPOINTS_PER_SUBSET)
        })
        .sum()
}

/// The Service an Endpoints object belongs to: its own namespace and name, validated.
pub fn service_key(endpoints: &Endpoints) -> Result<ServiceKey, InvalidObject> {
    let namespace = endpoints.metadata.namespace.as_deref().unwrap_or("default");
    convert::validate_dns_label("metadata.namespace", namespace)?;
    let name = endpoints
        .metadata
        .name
        .as_deref()
        .ok_or(InvalidObject::Missing("metadata.name"))?;
    // The name is the Service's, and becomes the slices' `kubernetes.io/service-name`.
    convert::validate_dns_label("metadata.name", name)?;
    Ok(ServiceKey::new(namespace, name))
}

/// The EndpointSlices the mirroring controller would write for `endpoints` (none for a skipped
/// object), or why the object is invalid. Validates every field that reaches the model: the
/// names, each mirrored address (a parseable IP outside the special ranges), `nodeName`, and
/// each port's number, name and protocol.
pub fn mirror(endpoints: &Endpoints) -> Result<Mirrored, InvalidObject> {
    let service = service_key(endpoints)?;
    if skipped(endpoints) {
        return Ok(Mirrored::default());
    }
    let mut groups: Vec<Group> = Vec::new();
    // Each group's index, by family and its ports sorted for comparison.
    let mut index: BTreeMap<(usize, Vec<PortKey>), usize> = BTreeMap::new();
    let mut truncated = 0;
    for subset in endpoints.subsets.iter().flatten() {
        let ports = subset_ports(subset)?;
        let mut key: Vec<PortKey> = ports.iter().map(PortKey::of).collect();
        key.sort();
        // This subset's group for each family, once it has an address of that family.
        let mut slot: [Option<usize>; 2] = [None, None];
        let addresses = subset.addresses.iter().flatten().map(|a| (a, true));
        let not_ready = subset
            .not_ready_addresses
            .iter()
            .flatten()
            .map(|a| (a, false));
        let total = subset.addresses.as_ref().map_or(0, Vec::len)
            + subset.not_ready_addresses.as_ref().map_or(0, Vec::len);
        let mut added = 0;
        for (address, ready) in addresses.chain(not_ready) {
            if added == MAX_ENDPOINTS_PER_SUBSET {
                break;
            }
            let (ip, endpoint) = address_endpoint(address, ready)?;
            let family = IpFamily::of(&ip);
            let group = *slot[family as usize].get_or_insert_with(|| {
                *index
                    .entry((family as usize, key.clone()))
                    .or_insert_with(|| {
                        groups.push(Group {
                            ports: ports.clone(),
                            family,
                            endpoints: Vec::new(),
                        });
                        groups.len() - 1
                    })
            });
            groups[group].endpoints.push((ip, endpoint));
            added += 1;
        }
        truncated += total - added;
    }
    let slices = groups
        .into_iter()
        .enumerate()
        .map(|(i, mut g)| {
            // By address, each endpoint once (the controller keeps a set): the order the
            // addresses were written in, or a repeated one, changes nothing programmed, so it
            // must not change the slices either.
            g.endpoints.sort_by_key(|(ip, _)| *ip);
            g.endpoints.dedup();
            let eps = g.endpoints.into_iter().map(|(_, e)| e).collect();
            slice(endpoints, &service, i, g.ports, g.family, eps)
        })
        .collect();
    Ok(Mirrored { slices, truncated })
}

/// [`mirror`], converted into the model as [`convert::slice_endpoints`] converts any slice:
/// the Service, its mirrored slices' endpoints (for the node `node_name`), and how many
/// addresses were left out over the per-subset limit.
pub fn mirrored_endpoints(
    endpoints: &Endpoints,
    node_name: &str,
) -> Result<(ServiceKey, Vec<SliceEndpoints>, usize), InvalidObject> {
    let service = service_key(endpoints)?;
    let mirrored = mirror(endpoints)?;
    let mut out = Vec::with_capacity(mirrored.slices.len());
    for slice in &mirrored.slices {
        if let Some(eps) = convert::slice_endpoints(slice, node_name)? {
            out.push(eps);
        }
    }
    Ok((service, out, mirrored.truncated))
}

/// The endpoints of one mirrored slice: one set of ports, one family.
struct Group {
    ports: Vec<EndpointPort>,
    family: IpFamily,
    /// Each endpoint with its address.
    endpoints: Vec<(IpAddr, SliceEndpoint)>,
}

/// A port as compared between subsets: name, number, protocol, appProtocol.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PortKey(String, i32, String, Option<String>);

impl PortKey {
    fn of(p: &EndpointPort) -> PortKey {
        PortKey(
            p.name.clone().unwrap_or_default(),
            p.port.unwrap_or_default(),
            p.protocol.clone().unwrap_or_else(|| "TCP".into()),
            p.app_protocol.clone(),
        )
    }
}

/// A subset's ports as slice ports, validated.
fn subset_ports(subset: &EndpointSubset) -> Result<Vec<EndpointPort>, InvalidObject> {
    let mut out = Vec::with_capacity(subset.ports.as_ref().map_or(0, Vec::len));
    for p in subset.ports.iter().flatten() {
        if !(1..=65535).contains(&p.port) {
            return Err(InvalidObject::Port {
                field: "subsets.ports.port",
                value: p.port.into(),
            });
        }
        let name = p.name.clone().unwrap_or_default();
        if !name.is_empty() {
            convert::validate_dns_label("subsets.ports.name", &name)?;
        }
        let protocol = p.protocol.clone().unwrap_or_else(|| "TCP".into());
        if crate::model::Protocol::from_kubernetes(&protocol).is_none() {
            return Err(InvalidObject::Protocol(protocol));
        }
        out.push(EndpointPort {
            name: Some(name),
            port: Some(p.port),
            protocol: Some(protocol),
            app_protocol: p.app_protocol.clone(),
        });
    }
    Ok(out)
}

/// One address as a slice endpoint, validated, with the address parsed.
fn address_endpoint(
    address: &EndpointAddress,
    ready: bool,
) -> Result<(IpAddr, SliceEndpoint), InvalidObject> {
    let field = if ready {
        "subsets.addresses.ip"
    } else {
        "subsets.notReadyAddresses.ip"
    };
    let ip = convert::parse_service_ip(field, &address.ip)?;
    if let Some(node) = &address.node_name {
        convert::validate_dns_subdomain("subsets.addresses.nodeName", node)?;
    }
    let endpoint = SliceEndpoint {
        // Written back in canonical form, as the controller does.
        addresses: vec![ip.to_string()],
        conditions: Some(EndpointConditions {
            ready: Some(ready),
            ..EndpointConditions::default()
        }),
        hostname: address.hostname.clone().filter(|h| !h.is_empty()),
        node_name: address.node_name.clone(),
        target_ref: address.target_ref.clone(),
        ..SliceEndpoint::default()
    };
    Ok((ip, endpoint))
}

/// The mirrored slice number `index` of `endpoints`: its labels (with the Service's name and
/// the controller's), its annotations but the trigger time and `kubectl`'s last applied
/// configuration, a name derived from the Endpoints' name.
fn slice(
    endpoints: &Endpoints,
    service: &ServiceKey,
    index: usize,
    ports: Vec<EndpointPort>,
    family: IpFamily,
    eps: Vec<SliceEndpoint>,
) -> EndpointSlice {
    let meta = &endpoints.metadata;
    let mut labels = meta.labels.clone().unwrap_or_default();
    labels.insert(LABEL_SERVICE_NAME.into(), service.name.clone());
    labels.insert(LABEL_MANAGED_BY.into(), MIRRORING_CONTROLLER.into());
    let annotations: BTreeMap<String, String> = meta
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| *k != ANNOTATION_TRIGGER_TIME && *k != ANNOTATION_LAST_APPLIED)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // The controller names its slices `<name>-<random>`; a fixed suffix keeps the result a
    // function of the object. The name is a DNS label (checked), so cutting it is safe, and
    // the cut keeps the slice name a single label of at most 63 characters.
    let base = &service.name[..service.name.len().min(48)];
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{base}-mirror-{index}")),
            namespace: Some(service.namespace.clone()),
            labels: Some(labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..ObjectMeta::default()
        },
        address_type: match family {
            IpFamily::V4 => "IPv4".into(),
            IpFamily::V6 => "IPv6".into(),
        },
        endpoints: Some(eps),
        ports: Some(ports),
    }
}

#[cfg(test)]
mod tests;
