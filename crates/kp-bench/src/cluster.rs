//! The benchmark cluster: the generator itself is kp-test's ([`kp_test::cluster`], re-exported
//! here whole), shared with the real API server's bulk loader
//! ([`kp_test::kube_apiserver`]). What only the benchmark needs is here: the [`Mix`] a run
//! reports, and the generated manifests as the typed objects the in-process dataplanes are fed.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::track::{Kind, Object, ProxyState, SourceEvent};
use serde_json::Value;

pub use kp_test::cluster::*;

/// How many of each kind a cluster holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Mix {
    /// Services.
    pub services: usize,
    /// Service ports (a multi-port Service counts each port).
    pub service_ports: usize,
    /// Endpoints over all slices.
    pub endpoints: usize,
    /// NodePort Services.
    pub node_port: usize,
    /// LoadBalancer Services (all with source ranges).
    pub load_balancer: usize,
    /// Services with ClientIP affinity.
    pub affinity: usize,
    /// Services with more than one port.
    pub multi_port: usize,
}

/// What a generated cluster holds, as the results report it.
pub trait MixOf {
    /// What the cluster holds.
    fn mix(&self) -> Mix;
}

impl MixOf for Cluster {
    fn mix(&self) -> Mix {
        let mut m = Mix {
            services: self.services,
            ..Mix::default()
        };
        for i in 0..self.services {
            let ports = ports_of(i).len();
            m.service_ports += ports;
            m.endpoints += self.per;
            m.multi_port += usize::from(ports > 1);
            match kind_of(i) {
                ServiceKind::NodePort => m.node_port += 1,
                ServiceKind::LoadBalancer => m.load_balancer += 1,
                ServiceKind::Affinity => m.affinity += 1,
                ServiceKind::ClusterIp => {}
            }
        }
        m
    }
}

/// A manifest as the typed object the proxy's sources produce.
pub fn to_object(manifest: &Value) -> anyhow::Result<Object> {
    let kind = manifest["kind"].as_str().unwrap_or_default();
    let name = manifest["metadata"]["name"].as_str().unwrap_or_default();
    let what = || format!("{kind} {name}");
    Ok(match kind {
        "Service" => Object::Service(Box::new(
            serde_json::from_value::<Service>(manifest.clone())
                .map_err(|e| anyhow::anyhow!("{}: {e}", what()))?,
        )),
        "EndpointSlice" => Object::EndpointSlice(Box::new(
            serde_json::from_value::<EndpointSlice>(manifest.clone())
                .map_err(|e| anyhow::anyhow!("{}: {e}", what()))?,
        )),
        "Node" => Object::Node(Box::new(
            serde_json::from_value::<Node>(manifest.clone())
                .map_err(|e| anyhow::anyhow!("{}: {e}", what()))?,
        )),
        _ => anyhow::bail!("{}: not a kind the proxy watches", what()),
    })
}

/// The proxy's view of `manifests` on [`NODE_NAME`], with every initial list complete and no
/// change pending. Fails on the first object the proxy rejects: a generator bug.
pub fn load_state(manifests: impl IntoIterator<Item = Value>) -> anyhow::Result<ProxyState> {
    let mut state = ProxyState::new(NODE_NAME);
    for m in manifests {
        let object = to_object(&m)?;
        state
            .apply(SourceEvent::Upsert(object))
            .map_err(|e| anyhow::anyhow!("the proxy rejects a generated object: {e}"))?;
    }
    for k in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        let _ = state.apply(SourceEvent::Synced(k));
    }
    state.take_changes();
    Ok(state)
}

#[cfg(test)]
mod tests;
