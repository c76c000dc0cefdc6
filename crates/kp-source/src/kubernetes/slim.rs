//! What the proxy reads of each watched object, decoded straight from the API server's JSON.
//!
//! A real API server's objects carry much the proxy never reads: `managedFields` (often the
//! biggest part of an EndpointSlice), `uid`, timestamps, owner references, `kubectl`'s
//! last-applied annotation, the `targetRef` of every endpoint, a Node's images and conditions.
//! Decoding into the full k8s-openapi types would allocate all of it, for every object of every
//! list and watch event, only to drop it after conversion. These types skip it while parsing
//! (serde ignores unknown fields without allocating them) and keep only the fields
//! `kp_core::convert` reads; [`Watched::into_object`] then builds the k8s-openapi object the
//! rest of the proxy takes, with everything else left empty.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Service, ServiceSpec, ServiceStatus};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice,
};
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kp_core::convert::{
    ANNOTATION_TRIGGER_TIME, LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME,
    LABEL_ZONE,
};
use kp_core::track::{Kind, Object};
use kube::Resource;
use serde::de::{DeserializeOwned, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// The labels the proxy reads, of any kind: all others are dropped while decoding.
const KEPT_LABELS: [&str; 4] = [
    LABEL_SERVICE_PROXY_NAME,
    LABEL_HEADLESS,
    LABEL_SERVICE_NAME,
    LABEL_ZONE,
];

/// The annotations the proxy reads.
const KEPT_ANNOTATIONS: [&str; 1] = [ANNOTATION_TRIGGER_TIME];

/// A kind as the watchers decode it.
pub(crate) trait Watched: DeserializeOwned + Clone + fmt::Debug + Send + 'static {
    /// The kind.
    const KIND: Kind;
    /// The collection's path on the API server, e.g. `/api/v1/services`.
    fn url_path() -> String;
    /// The object's resourceVersion, if it has one.
    fn resource_version(&self) -> Option<&str>;
    /// The object as the rest of the proxy takes it.
    fn into_object(self) -> Object;
}

/// The metadata the proxy reads.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SlimMeta {
    name: Option<String>,
    namespace: Option<String>,
    resource_version: Option<String>,
    deletion_timestamp: Option<Time>,
    #[serde(default, deserialize_with = "kept_labels")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default, deserialize_with = "kept_annotations")]
    annotations: Option<BTreeMap<String, String>>,
}

impl From<SlimMeta> for ObjectMeta {
    fn from(m: SlimMeta) -> ObjectMeta {
        ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            resource_version: m.resource_version,
            deletion_timestamp: m.deletion_timestamp,
            labels: m.labels,
            annotations: m.annotations,
            ..ObjectMeta::default()
        }
    }
}

fn kept_labels<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptKeys(&KEPT_LABELS))
}

fn kept_annotations<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptKeys(&KEPT_ANNOTATIONS))
}

/// Decodes a string map (labels, annotations), keeping only the entries whose key is listed;
/// `None` when none is. The values of other entries are skipped unallocated.
struct KeptKeys(&'static [&'static str]);

impl<'de> Visitor<'de> for KeptKeys {
    type Value = Option<BTreeMap<String, String>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of strings to strings, or null")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kept = BTreeMap::new();
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if self.0.contains(&key.as_ref()) {
                let value: String = map.next_value()?;
                kept.insert(key.into_owned(), value);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok((!kept.is_empty()).then_some(kept))
    }
}

/// A map key, borrowed from the input where it has no escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

/// A Service: metadata as [`SlimMeta`], spec and status whole (the proxy reads most of them).
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct SlimService {
    #[serde(default)]
    metadata: SlimMeta,
    spec: Option<ServiceSpec>,
    status: Option<ServiceStatus>,
}

impl Watched for SlimService {
    const KIND: Kind = Kind::Service;

    fn url_path() -> String {
        Service::url_path(&(), None)
    }

    fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }

    fn into_object(self) -> Object {
        Object::Service(Box::new(Service {
            metadata: self.metadata.into(),
            spec: self.spec,
            status: self.status,
        }))
    }
}

/// An EndpointSlice, without what the proxy never reads of its endpoints (`targetRef`,
/// `hostname`, `deprecatedTopology`).
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SlimEndpointSlice {
    #[serde(default)]
    metadata: SlimMeta,
    address_type: String,
    endpoints: Option<Vec<SlimEndpoint>>,
    ports: Option<Vec<EndpointPort>>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SlimEndpoint {
    addresses: Vec<String>,
    conditions: Option<EndpointConditions>,
    hints: Option<EndpointHints>,
    node_name: Option<String>,
    zone: Option<String>,
}

impl Watched for SlimEndpointSlice {
    const KIND: Kind = Kind::EndpointSlice;

    fn url_path() -> String {
        EndpointSlice::url_path(&(), None)
    }

    fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }

    fn into_object(self) -> Object {
        let endpoints = self.endpoints.map(|eps| {
            eps.into_iter()
                .map(|ep| Endpoint {
                    addresses: ep.addresses,
                    conditions: ep.conditions,
                    hints: ep.hints,
                    node_name: ep.node_name,
                    zone: ep.zone,
                    ..Endpoint::default()
                })
                .collect()
        });
        Object::EndpointSlice(Box::new(EndpointSlice {
            metadata: self.metadata.into(),
            address_type: self.address_type,
            endpoints,
            ports: self.ports,
        }))
    }
}

/// A Node: its spec (pod CIDRs, taints) and, of its status, only the addresses (a real Node's
/// status also lists every image it holds, its conditions and its daemon endpoints).
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct SlimNode {
    #[serde(default)]
    metadata: SlimMeta,
    spec: Option<NodeSpec>,
    status: Option<SlimNodeStatus>,
}

#[derive(Clone, Debug, Deserialize)]
struct SlimNodeStatus {
    addresses: Option<Vec<k8s_openapi::api::core::v1::NodeAddress>>,
}

impl Watched for SlimNode {
    const KIND: Kind = Kind::Node;

    fn url_path() -> String {
        Node::url_path(&(), None)
    }

    fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }

    fn into_object(self) -> Object {
        Object::Node(Box::new(Node {
            metadata: self.metadata.into(),
            spec: self.spec,
            status: self.status.map(|s| NodeStatus {
                addresses: s.addresses,
                ..NodeStatus::default()
            }),
        }))
    }
}

/// A ServiceCIDR: small and rare, but decoded the same way for its metadata.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct SlimServiceCidr {
    #[serde(default)]
    metadata: SlimMeta,
    spec: Option<k8s_openapi::api::networking::v1::ServiceCIDRSpec>,
}

impl Watched for SlimServiceCidr {
    const KIND: Kind = Kind::ServiceCidr;

    fn url_path() -> String {
        ServiceCIDR::url_path(&(), None)
    }

    fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }

    fn into_object(self) -> Object {
        Object::ServiceCidr(Box::new(ServiceCIDR {
            metadata: self.metadata.into(),
            spec: self.spec,
            status: None,
        }))
    }
}

/// Only the key of an object, for one whose whole does not decode.
#[derive(Debug, Deserialize)]
pub(crate) struct KeyOnly {
    #[serde(default)]
    pub(crate) metadata: KeyMeta,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct KeyMeta {
    pub(crate) name: Option<String>,
    pub(crate) namespace: Option<String>,
}

#[cfg(test)]
mod tests;
