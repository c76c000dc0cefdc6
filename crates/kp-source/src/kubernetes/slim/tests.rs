use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kp_core::convert;
use kp_core::track::Object;
use serde_json::{json, Value};

use super::{SlimEndpointSlice, SlimNode, SlimService, SlimServiceCidr, Watched};

/// What a real API server adds to every object: the proxy reads none of it.
fn server_metadata(mut meta: Value) -> Value {
    let extra = json!({
        "uid": "6907da6e-2dd2-46ab-8f8e-7304d829d99d",
        "generation": 3,
        "creationTimestamp": "2026-11-28T10:34:52Z",
        "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "api", "uid": "u"}],
        "managedFields": [{
            "manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
            "time": "2026-11-28T10:34:52Z", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}}, "f:endpoints": {}}
        }],
    });
    for (k, v) in extra.as_object().unwrap() {
        meta[k] = v.clone();
    }
    meta
}

fn decode<K: Watched>(v: &Value) -> Object {
    serde_json::from_value::<K>(v.clone())
        .expect("decodes")
        .into_object()
}

#[test]
fn a_slice_keeps_what_the_proxy_reads_and_converts_as_the_full_object_does() {
    let v = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": server_metadata(json!({
            "name": "api-x1", "namespace": "web", "resourceVersion": "42",
            "labels": {"kubernetes.io/service-name": "api",
                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                       "app": "api"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-11-28T10:00:00Z",
                            "kubectl.kubernetes.io/last-applied-configuration": "{\"big\": true}"}
        })),
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true, "serving": true, "terminating": false},
             "nodeName": "node-1", "zone": "a", "hostname": "h",
             "hints": {"forZones": [{"name": "a"}]},
             "targetRef": {"kind": "Pod", "namespace": "web", "name": "api-0", "uid": "p"}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": false, "serving": true, "terminating": true},
             "nodeName": "node-2"}
        ],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}]
    });
    let slim = match decode::<SlimEndpointSlice>(&v) {
        Object::EndpointSlice(s) => s,
        other => panic!("{other:?}"),
    };
    let full: EndpointSlice = serde_json::from_value(v).unwrap();
    for node in ["node-1", "node-2"] {
        assert_eq!(
            convert::slice_endpoints(&slim, node),
            convert::slice_endpoints(&full, node)
        );
    }
    let meta = &slim.metadata;
    assert_eq!(meta.resource_version.as_deref(), Some("42"));
    assert!(meta.managed_fields.is_none() && meta.uid.is_none() && meta.owner_references.is_none());
    assert_eq!(
        meta.labels.as_ref().unwrap().keys().collect::<Vec<_>>(),
        ["kubernetes.io/service-name"]
    );
    assert_eq!(
        meta.annotations
            .as_ref()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["endpoints.kubernetes.io/last-change-trigger-time"]
    );
    let eps = slim.endpoints.as_ref().unwrap();
    assert!(eps
        .iter()
        .all(|e| e.target_ref.is_none() && e.hostname.is_none()));
    assert_eq!(eps[0].zone.as_deref(), Some("a"));
    assert_eq!(slim.ports, full.ports);
}

#[test]
fn a_service_converts_as_the_full_object_does() {
    let cases = [
        json!({"metadata": server_metadata(json!({"name": "api", "namespace": "web", "resourceVersion": "7",
                   "labels": {"app": "api"}, "annotations": {"note": "x"}})),
               "spec": {"type": "NodePort", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080, "protocol": "TCP"}],
                        "externalTrafficPolicy": "Local", "healthCheckNodePort": 31000,
                        "sessionAffinity": "ClientIP",
                        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}},
               "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.7"}]}}}),
        // Labels the proxy does read: another proxy's, headless.
        json!({"metadata": {"name": "other", "namespace": "web",
                   "labels": {"service.kubernetes.io/service-proxy-name": "x"}},
               "spec": {"clusterIP": "10.96.0.11", "ports": [{"port": 80}]}}),
        json!({"metadata": {"name": "hl", "namespace": "web",
                   "labels": {"service.kubernetes.io/headless": ""}},
               "spec": {"clusterIP": "10.96.0.12", "ports": [{"port": 80}]}}),
    ];
    for v in cases {
        let slim = match decode::<SlimService>(&v) {
            Object::Service(s) => s,
            other => panic!("{other:?}"),
        };
        let full: Service = serde_json::from_value(v).unwrap();
        assert_eq!(convert::service_ports(&slim), convert::service_ports(&full));
        assert_eq!(slim.spec, full.spec);
        assert_eq!(slim.status, full.status);
        assert!(slim.metadata.managed_fields.is_none() && slim.metadata.annotations.is_none());
    }
}

#[test]
fn a_node_keeps_its_spec_addresses_zone_and_deletion() {
    let v = json!({
        "metadata": server_metadata(json!({"name": "node-0", "resourceVersion": "9",
            "deletionTimestamp": "2026-11-28T10:40:00Z",
            "labels": {"topology.kubernetes.io/zone": "zone-a", "kubernetes.io/hostname": "node-0"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"}})),
        "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24", "fd00::/64"],
                 "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"},
                                 {"type": "Hostname", "address": "node-0"}],
                   "images": [{"names": ["registry/image:1"], "sizeBytes": 1000}],
                   "conditions": [{"type": "Ready", "status": "True"}],
                   "nodeInfo": {"architecture": "amd64", "bootID": "", "containerRuntimeVersion": "",
                                "kernelVersion": "", "kubeProxyVersion": "", "kubeletVersion": "",
                                "machineID": "", "operatingSystem": "linux", "osImage": "", "systemUUID": ""}}
    });
    let slim = match decode::<SlimNode>(&v) {
        Object::Node(n) => n,
        other => panic!("{other:?}"),
    };
    let full: Node = serde_json::from_value(v).unwrap();
    assert_eq!(convert::node_info(&slim), convert::node_info(&full));
    assert!(convert::node_info(&slim).unwrap().deleting);
    let status = slim.status.as_ref().unwrap();
    assert!(status.images.is_none() && status.conditions.is_none() && status.node_info.is_none());
    assert_eq!(slim.spec, full.spec);
}

#[test]
fn a_service_cidr_converts_as_the_full_object_does() {
    let v = json!({"metadata": server_metadata(json!({"name": "kubernetes", "resourceVersion": "3"})),
                   "spec": {"cidrs": ["10.96.0.0/16", "fd00:10:96::/112"]},
                   "status": {"conditions": []}});
    let slim = match decode::<SlimServiceCidr>(&v) {
        Object::ServiceCidr(c) => c,
        other => panic!("{other:?}"),
    };
    let full: ServiceCIDR = serde_json::from_value(v).unwrap();
    assert_eq!(convert::service_cidrs(&slim), convert::service_cidrs(&full));
}

#[test]
fn labels_and_annotations_must_still_be_string_maps() {
    for bad in [
        json!({"metadata": {"name": "a", "labels": ["x"]}, "addressType": "IPv4"}),
        json!({"metadata": {"name": "a", "labels": {"kubernetes.io/service-name": 3}}, "addressType": "IPv4"}),
    ] {
        assert!(serde_json::from_value::<SlimEndpointSlice>(bad).is_err());
    }
    // Null maps are absent maps.
    let ok = json!({"metadata": {"name": "a", "labels": null, "annotations": null}, "addressType": "IPv4"});
    let Object::EndpointSlice(s) = decode::<SlimEndpointSlice>(&ok) else {
        unreachable!()
    };
    assert!(s.metadata.labels.is_none());
}

#[test]
fn escaped_keys_are_matched_after_unescaping() {
    // "kubernetes.io/service-name" with its slash escaped, as any JSON encoder may write it.
    let text = r#"{"metadata": {"name": "a", "labels": {"kubernetes.io\/service-name": "api"}}, "addressType": "IPv4"}"#;
    let Object::EndpointSlice(s) = serde_json::from_str::<SlimEndpointSlice>(text)
        .unwrap()
        .into_object()
    else {
        unreachable!()
    };
    assert_eq!(
        s.metadata.labels.unwrap()["kubernetes.io/service-name"],
        "api"
    );
}
