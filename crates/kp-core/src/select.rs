//! Endpoint selection for one Service port: which endpoints serve cluster traffic, which serve
//! node-local traffic, and whether the port has any usable endpoint at all.
//!
//! Mirrors upstream `pkg/proxy/topology.go` (`CategorizeEndpoints`):
//! - Ready endpoints are used; when none are, serving-and-terminating ones are the fallback. The
//!   fallback is decided separately for the cluster set and the local set.
//! - Topology hints narrow the cluster set to this node's zone, but only when every ready
//!   endpoint carries hints and at least one is hinted for this zone.
//! - Each IP family is selected on its own, as upstream runs one proxier per family: IPv6
//!   endpoints being ready does not stop IPv4 traffic from falling back to terminating IPv4
//!   endpoints, and IPv6 endpoints without hints do not switch off topology for IPv4.

use crate::model::{Endpoint, IpFamily, NodeInfo, ServicePort};

/// The endpoints a dataplane programs for one Service port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SelectedEndpoints {
    /// Endpoints for `Cluster` traffic policy (topology applied). Empty when unused.
    pub cluster: Vec<Endpoint>,
    /// Node-local endpoints for `Local` traffic policy. Empty when unused.
    pub local: Vec<Endpoint>,
    /// Whether any endpoint anywhere can serve (decides REJECT versus DROP).
    pub has_any: bool,
    /// `has_any` per family, indexed by `IpFamily as usize`: each family's table decides
    /// REJECT versus DROP on its own endpoints, as upstream's per-family proxiers do.
    pub has_any_by_family: [bool; 2],
}

impl SelectedEndpoints {
    /// Whether any endpoint of `family` can serve.
    pub fn has_any_for(&self, family: IpFamily) -> bool {
        self.has_any_by_family[family as usize]
    }

    /// Endpoints for traffic from inside the cluster (ClusterIP), per `internalTrafficPolicy`.
    pub fn internal<'a>(&'a self, port: &ServicePort) -> &'a [Endpoint] {
        if port.internal_traffic_local {
            &self.local
        } else {
            &self.cluster
        }
    }

    /// Endpoints for traffic from outside (NodePort, ExternalIP, LoadBalancer), per
    /// `externalTrafficPolicy`.
    pub fn external<'a>(&'a self, port: &ServicePort) -> &'a [Endpoint] {
        if port.external_policy_local() {
            &self.local
        } else {
            &self.cluster
        }
    }
}

/// Whether the port needs the cluster-wide set. With `externalTrafficPolicy: Local` it still
/// does, to short-circuit traffic from pods and the node itself.
fn uses_cluster_endpoints(port: &ServicePort) -> bool {
    !port.internal_traffic_local || port.has_external()
}

fn uses_local_endpoints(port: &ServicePort) -> bool {
    port.internal_traffic_local || port.external_policy_local()
}

fn usable_fallback(ep: &Endpoint) -> bool {
    ep.serving && ep.terminating
}

/// Whether topology hints may narrow the cluster set.
fn can_use_topology(endpoints: &[Endpoint], node: &NodeInfo) -> Option<String> {
    let zone = node.zone.as_ref().filter(|z| !z.is_empty())?;
    let mut has_for_zone = false;
    for ep in endpoints.iter().filter(|e| e.ready) {
        let hints = ep.zone_hints.as_ref().filter(|h| !h.is_empty())?;
        has_for_zone |= hints.contains(zone);
    }
    has_for_zone.then(|| zone.clone())
}

/// Selects the endpoints for `port` from all of its endpoints, as seen from `node`. The result
/// lists IPv4 endpoints before IPv6 ones, each family in the order given.
pub fn select(port: &ServicePort, endpoints: &[Endpoint], node: &NodeInfo) -> SelectedEndpoints {
    let mut out = SelectedEndpoints::default();
    for family in IpFamily::ALL {
        let of_family: Vec<Endpoint> = endpoints
            .iter()
            .filter(|e| IpFamily::of(&e.ip) == family)
            .cloned()
            .collect();
        let selected = select_family(port, &of_family, node);
        out.cluster.extend(selected.cluster);
        out.local.extend(selected.local);
        out.has_any |= selected.has_any;
        out.has_any_by_family[family as usize] = selected.has_any;
    }
    out
}

/// [`select`] for endpoints of one family.
fn select_family(port: &ServicePort, endpoints: &[Endpoint], node: &NodeInfo) -> SelectedEndpoints {
    let mut out = SelectedEndpoints::default();
    if uses_cluster_endpoints(port) {
        let zone = can_use_topology(endpoints, node);
        out.cluster = endpoints
            .iter()
            .filter(|e| e.ready)
            .filter(|e| match (&zone, &e.zone_hints) {
                (Some(z), Some(h)) => h.contains(z),
                (Some(_), None) => false,
                (None, _) => true,
            })
            .cloned()
            .collect();
        if out.cluster.is_empty() {
            out.cluster = endpoints
                .iter()
                .filter(|e| usable_fallback(e))
                .cloned()
                .collect();
        }
        out.has_any = !out.cluster.is_empty();
    }
    if !uses_local_endpoints(port) {
        return out;
    }
    let mut local_ready = false;
    let mut local_fallback = false;
    for ep in endpoints {
        if ep.ready {
            out.has_any = true;
            local_ready |= ep.is_local;
        } else if usable_fallback(ep) {
            out.has_any = true;
            local_fallback |= ep.is_local;
        }
    }
    if local_ready {
        out.local = endpoints
            .iter()
            .filter(|e| e.is_local && e.ready)
            .cloned()
            .collect();
    } else if local_fallback {
        out.local = endpoints
            .iter()
            .filter(|e| e.is_local && usable_fallback(e))
            .cloned()
            .collect();
    }
    out
}

#[cfg(test)]
mod tests;
