//! The generator: hostile-but-structured Kubernetes objects as JSON values, and garbled
//! manifest text.
//!
//! Most objects must get past decoding and validation, or the renderers would only ever see the
//! fixture: so each object is built field by field from pools of valid values, and each field
//! is, with the object's own probability of trouble, replaced by an odd value of the right type
//! (a special address, port 0, a lower-case protocol), a hostile string carrying the
//! [marker](crate::hostile::MARKER), a value of the wrong type, or nothing. One object in
//! five has no trouble at all, so the accumulated state keeps growing valid Services with odd
//! corners (IPv4-compatible IPv6 ClusterIPs, `0.0.0.0/0` source ranges, 64 endpoints, affinity
//! timeouts of 1 and 86400 seconds) for the renderers.
//!
//! Alongside those: the flow fixture's objects (`kp_flows::fixture`) renamed into the pool and
//! mutated at random paths, and random JSON trees. Names come from small pools, so objects
//! replace each other and the state stays the size of a small cluster however long the run.

use serde_json::{json, Map, Value};

use crate::hostile::{self, ODD_ADDRESSES, ODD_CIDRS, ODD_INTEGERS, ODD_PROTOCOLS, ODD_WORDS};
use crate::rng::Rng;

/// Namespaces objects are put in.
pub const NAMESPACES: &[&str] = &["default", "kube-system", "ns-a", "b", "x-1"];

/// A valid DNS label of the longest allowed length (63), for names at the limit.
const LONG_LABEL: &str = "l23456789-123456789-123456789-123456789-123456789-123456789-12z";

/// Fixed Service names besides `svc-N`.
const SERVICE_NAMES: &[&str] = &["web", "dns", "lb", "local", "dual", "a", "0", LONG_LABEL];

/// How many `svc-N` names the pool holds: objects replace each other within it.
const POOL: usize = 48;

/// Valid port names.
const PORT_NAMES: &[&str] = &[
    "", "http", "https", "dns-udp", "p-1", "p-2", "9", LONG_LABEL,
];

/// Valid zones.
const ZONES: &[&str] = &["zone-a", "zone-b", "zone-c", ""];

/// This node and others.
const NODES: &[&str] = &[
    kp_flows::NODE,
    kp_flows::NODE,
    kp_flows::OTHER_NODE,
    "node-c",
];

/// Field names real objects use, for random trees that look like objects.
const FIELD_NAMES: &[&str] = &[
    "apiVersion",
    "kind",
    "metadata",
    "name",
    "namespace",
    "labels",
    "annotations",
    "spec",
    "status",
    "ports",
    "port",
    "nodePort",
    "targetPort",
    "protocol",
    "clusterIP",
    "clusterIPs",
    "externalIPs",
    "type",
    "endpoints",
    "addresses",
    "addressType",
    "conditions",
    "items",
    "cidrs",
    "podCIDRs",
    "loadBalancer",
    "ingress",
    "ip",
];

/// `apiVersion`/`kind` pairs, the supported ones first.
const TYPES: &[(&str, &str)] = &[
    ("v1", "Service"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("v1", "Node"),
    ("networking.k8s.io/v1", "ServiceCIDR"),
    ("v1", "Endpoints"),
    ("v1", "List"),
    ("v1", "ServiceList"),
    ("v1", "EndpointsList"),
    ("v1", "Pod"),
    ("discovery.k8s.io/v1beta1", "EndpointSlice"),
    ("networking.k8s.io/v1beta1", "ServiceCIDR"),
    ("apps/v1", "Deployment"),
    ("v2", "Service"),
    ("", ""),
];

/// Makes objects. Deterministic: the same seed gives the same objects.
#[derive(Clone, Debug)]
pub struct Generator {
    rng: Rng,
    fixtures: Vec<Value>,
    /// Per-mille chance that a field is in trouble, for the object being built.
    trouble: u32,
}

impl Generator {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Generator {
            rng: Rng::new(seed),
            fixtures: kp_flows::objects().iter().map(kp_flows::manifest).collect(),
            trouble: 0,
        }
    }

    /// The next object, as the JSON an API server or a manifest would hold.
    pub fn object(&mut self) -> Value {
        self.trouble = *self.rng.pick(&[0, 0, 5, 20, 60, 150, 400]);
        match self.rng.below(100) {
            0..=24 => self.service(),
            25..=44 => self.slice(),
            45..=52 => self.endpoints(),
            53..=57 => self.node(),
            58..=61 => self.service_cidr(),
            62..=83 => self.mutated_fixture(),
            84..=93 => {
                let mut v = match self.rng.below(5) {
                    0 => self.service(),
                    1 => self.slice(),
                    2 => self.node(),
                    3 => self.endpoints(),
                    _ => self.service_cidr(),
                };
                for _ in 0..1 + self.rng.below(4) {
                    mutate(&mut self.rng, &mut v);
                }
                v
            }
            _ => {
                let mut v = random_tree(&mut self.rng, 4);
                if let Value::Object(m) = &mut v {
                    let (api, kind) = *self.rng.pick(TYPES);
                    m.insert("apiVersion".into(), json!(api));
                    m.insert("kind".into(), json!(kind));
                }
                v
            }
        }
    }

    /// A random generator for the caller's own choices, forked from this one's stream.
    pub fn fork(&mut self) -> Rng {
        self.rng.fork()
    }

    /// Whether this field is in trouble.
    fn bad(&mut self) -> bool {
        self.rng.below(1000) < self.trouble as usize
    }

    /// `good`, or, when the field is in trouble, an odd value from `odd`, a hostile string, a
    /// value of another type, or null.
    fn field(
        &mut self,
        good: impl FnOnce(&mut Rng) -> Value,
        odd: impl FnOnce(&mut Rng) -> Value,
    ) -> Value {
        if !self.bad() {
            return good(&mut self.rng);
        }
        match self.rng.below(8) {
            0..=3 => odd(&mut self.rng),
            4 | 5 => json!(hostile::string(&mut self.rng)),
            6 => wrong_type(&mut self.rng),
            _ => Value::Null,
        }
    }

    /// Inserts `key: value` into `m` unless the field is dropped (a missing field is one kind
    /// of trouble).
    fn put(&mut self, m: &mut Map<String, Value>, key: &str, value: Value) {
        if self.bad() && self.rng.chance(1, 4) {
            return;
        }
        m.insert(key.to_string(), value);
    }

    /// A Service name from the pool (or an invalid one).
    fn name(&mut self) -> Value {
        self.field(
            |r| {
                if r.chance(1, 4) {
                    json!(*r.pick(SERVICE_NAMES))
                } else {
                    json!(format!("svc-{}", r.below(POOL)))
                }
            },
            |r| json!(*r.pick(&["", "Web", "web_1", "-web", "web-", "we.b", "web/x"])),
        )
    }

    /// A namespace from the pool (or an invalid one).
    fn namespace(&mut self) -> Value {
        self.field(
            |r| json!(*r.pick(NAMESPACES)),
            |r| json!(*r.pick(&["", "Default", "kube_system", "a.b", "ns-"])),
        )
    }

    /// A port number.
    fn port_number(&mut self) -> Value {
        self.field(
            |r| json!(*r.pick(&[80, 443, 53, 8080, 1, 65535, 3868, 9090])),
            odd_port,
        )
    }

    /// A protocol, TCP most often.
    fn protocol(&mut self) -> Value {
        self.field(
            |r| json!(*r.pick(&["TCP", "TCP", "UDP", "SCTP"])),
            |r| json!(*r.pick(ODD_PROTOCOLS)),
        )
    }

    /// An address of the family from `good`, or an odd one.
    fn address(&mut self, v6: bool, good: fn(&mut Rng, bool) -> String) -> Value {
        self.field(|r| json!(good(r, v6)), |r| json!(*r.pick(ODD_ADDRESSES)))
    }

    /// A network from `good`, or an odd one.
    fn cidr(&mut self, good: fn(&mut Rng) -> String) -> Value {
        self.field(|r| json!(good(r)), |r| json!(*r.pick(ODD_CIDRS)))
    }

    /// One of `good` (a type, a policy), or another word of the kind.
    fn word(&mut self, good: &'static [&'static str]) -> Value {
        self.field(|r| json!(*r.pick(good)), |r| json!(*r.pick(ODD_WORDS)))
    }

    /// Up to `max` items (rarely up to 69), one sometimes duplicated.
    fn list(&mut self, max: usize, mut item: impl FnMut(&mut Self) -> Value) -> Value {
        // Now and then far more than a real object holds, for the endpoint-count classes.
        let n = if self.rng.chance(1, 40) {
            self.rng.below(70)
        } else {
            self.rng.below(max + 1)
        };
        let mut items: Vec<Value> = (0..n).map(|_| item(self)).collect();
        if !items.is_empty() && self.bad() {
            // Duplicates: two ports of one name, the same address twice.
            let i = self.rng.below(items.len());
            items.push(items[i].clone());
        }
        Value::Array(items)
    }

    /// `metadata`, now and then with the headless label or a deletion timestamp.
    fn metadata(&mut self, namespaced: bool, name: Value) -> Value {
        let mut m = Map::new();
        self.put(&mut m, "name", name);
        if namespaced {
            let ns = self.namespace();
            self.put(&mut m, "namespace", ns);
        }
        if self.rng.chance(1, 8) {
            let mut labels = Map::new();
            labels.insert(
                kp_core::convert::LABEL_HEADLESS.into(),
                self.field(|_| json!(""), wrong_type),
            );
            m.insert("labels".into(), Value::Object(labels));
        }
        if self.rng.chance(1, 16) {
            m.insert("deletionTimestamp".into(), self.timestamp());
        }
        Value::Object(m)
    }

    /// An RFC 3339 timestamp, or a broken one.
    fn timestamp(&mut self) -> Value {
        self.field(
            |r| json!(format!("2024-01-{:02}T03:04:05Z", 1 + r.below(28))),
            |r| {
                json!(*r.pick(&[
                    "2024-13-01T00:00:00Z",
                    "2024-02-30T00:00:00Z",
                    "-1",
                    "1e309",
                    "2024-01-01T00:00:00.999999999999999999Z",
                    "9999999999-01-01T00:00:00Z",
                    "2024-01-01T00:00:60Z",
                    "",
                ]))
            },
        )
    }

    /// A Service: every field the proxy reads.
    pub fn service(&mut self) -> Value {
        let v6 = self.rng.chance(1, 4);
        let name = self.name();
        let mut spec = Map::new();
        let ty = self.word(&["ClusterIP", "NodePort", "LoadBalancer", "ClusterIP"]);
        self.put(&mut spec, "type", ty);
        let primary = self.address(v6, cluster_ip);
        let mut ips = vec![primary.clone()];
        if self.rng.chance(1, 3) {
            ips.push(self.address(!v6, cluster_ip));
        }
        self.put(&mut spec, "clusterIP", primary);
        let ips = Value::Array(ips);
        self.put(&mut spec, "clusterIPs", ips);
        let ports = self.list(4, |g| {
            let mut p = Map::new();
            let name = g.field(
                |r| json!(*r.pick(PORT_NAMES)),
                |r| json!(*r.pick(&["HTTP", "a_b", "-", "p.1"])),
            );
            g.put(&mut p, "name", name);
            let proto = g.protocol();
            g.put(&mut p, "protocol", proto);
            let port = g.port_number();
            g.put(&mut p, "port", port);
            let target = g.field(
                |r| json!(r.range(1, 65535)),
                |r| json!(*r.pick(&["http", "", "8080"])),
            );
            g.put(&mut p, "targetPort", target);
            if g.rng.chance(2, 3) {
                let np = g.field(|r| json!(r.range(30000, 32767)), odd_port);
                g.put(&mut p, "nodePort", np);
            }
            Value::Object(p)
        });
        self.put(&mut spec, "ports", ports);
        if self.rng.chance(1, 3) {
            let ext = self.list(3, |g| {
                let v6 = g.rng.chance(1, 3);
                g.address(v6, external_ip)
            });
            self.put(&mut spec, "externalIPs", ext);
        }
        if self.rng.chance(1, 3) {
            let ranges = self.list(3, |g| g.cidr(source_range));
            self.put(&mut spec, "loadBalancerSourceRanges", ranges);
        }
        if self.rng.chance(1, 4) {
            let aff = self.word(&["ClientIP", "None"]);
            self.put(&mut spec, "sessionAffinity", aff);
            let t = self.field(
                |r| json!(*r.pick(&[1, 60, 10800, 86400, 3600, 7])),
                |r| json!(*r.pick(&[0, -1, 86401, i32::MAX as i64, i64::MAX])),
            );
            spec.insert(
                "sessionAffinityConfig".into(),
                json!({"clientIP": {"timeoutSeconds": t}}),
            );
        }
        if self.rng.chance(1, 3) {
            let p = self.word(&["Local", "Cluster"]);
            self.put(&mut spec, "externalTrafficPolicy", p);
            let hc = self.field(|r| json!(r.range(30000, 32767)), odd_port);
            self.put(&mut spec, "healthCheckNodePort", hc);
        }
        if self.rng.chance(1, 4) {
            let p = self.word(&["Local", "Cluster"]);
            self.put(&mut spec, "internalTrafficPolicy", p);
        }
        let mut status = Map::new();
        if self.rng.chance(1, 3) {
            let ingress = self.list(3, |g| {
                let mut i = Map::new();
                let v6 = g.rng.chance(1, 3);
                let ip = g.address(v6, external_ip);
                g.put(&mut i, "ip", ip);
                if g.rng.chance(1, 3) {
                    let mode = g.word(&["VIP", "Proxy"]);
                    g.put(&mut i, "ipMode", mode);
                }
                if g.rng.chance(1, 6) {
                    i.insert("hostname".into(), json!(hostile::string(&mut g.rng)));
                }
                Value::Object(i)
            });
            status.insert("loadBalancer".into(), json!({ "ingress": ingress }));
        }
        let meta = self.metadata(true, name);
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": meta, "spec": spec, "status": status,
        })
    }

    /// An EndpointSlice joined (usually) to a Service of the pool. Services of the pool that
    /// [`endpoints_only`] picks get a slice of their own only now and then, so they are mostly
    /// served by their Endpoints, and a slice arriving or going flips them.
    pub fn slice(&mut self) -> Value {
        let v6 = self.rng.chance(1, 4);
        let mut service = self.name();
        if endpoints_only(&service) && !self.rng.chance(1, 10) {
            service = self.name();
        }
        let slice_name = self.field(
            |r| json!(format!("svc-{}-{}", r.below(POOL), r.below(3))),
            |r| json!(*r.pick(&["", "a..b", ".a", "A", "a_b"])),
        );
        let mut meta = self.metadata(true, slice_name);
        if let Value::Object(m) = &mut meta {
            let mut labels = Map::new();
            self.put(&mut labels, kp_core::convert::LABEL_SERVICE_NAME, service);
            m.insert("labels".into(), Value::Object(labels));
            if self.rng.chance(1, 3) {
                let t = self.timestamp();
                m.insert(
                    "annotations".into(),
                    json!({ kp_core::convert::ANNOTATION_TRIGGER_TIME: t }),
                );
            }
        }
        let family = self.field(
            |_| json!(if v6 { "IPv6" } else { "IPv4" }),
            |r| json!(*r.pick(&["FQDN", "ipv4", "IPv6", "IPv4", ""])),
        );
        let ports = self.list(3, |g| {
            let mut p = Map::new();
            let name = g.field(
                |r| json!(*r.pick(PORT_NAMES)),
                |r| json!(*r.pick(&["HTTP", "a_b"])),
            );
            g.put(&mut p, "name", name);
            let proto = g.protocol();
            g.put(&mut p, "protocol", proto);
            let port = g.port_number();
            g.put(&mut p, "port", port);
            Value::Object(p)
        });
        let endpoints = self.list(6, |g| {
            let mut e = Map::new();
            let addrs = vec![g.address(v6, pod_ip)];
            g.put(&mut e, "addresses", Value::Array(addrs));
            let mut c = Map::new();
            for cond in ["ready", "serving", "terminating"] {
                if g.rng.chance(2, 3) {
                    let b = g.field(|r| json!(r.chance(3, 4)), wrong_type);
                    c.insert(cond.into(), b);
                }
            }
            e.insert("conditions".into(), Value::Object(c));
            let node = g.field(
                |r| json!(*r.pick(NODES)),
                |r| json!(*r.pick(&["Node-A", "node_a", ""])),
            );
            g.put(&mut e, "nodeName", node);
            if g.rng.chance(1, 3) {
                let zones = g.list(2, |g| {
                    let z = g.field(|r| json!(*r.pick(ZONES)), wrong_type);
                    json!({ "name": z })
                });
                e.insert("hints".into(), json!({ "forZones": zones }));
                let zone = g.field(|r| json!(*r.pick(ZONES)), wrong_type);
                e.insert("zone".into(), zone);
            }
            Value::Object(e)
        });
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": meta, "addressType": family, "ports": ports, "endpoints": endpoints,
        })
    }

    /// A v1 Endpoints object named after a Service of the pool (it belongs to the Service of
    /// its own name): up to three subsets of ready and not-ready addresses (one family, or both
    /// mixed) and ports, the skip-mirror label or the leader-election annotation now and then,
    /// labels and annotations the mirrored slices copy, and rarely a subset past the
    /// mirroring limit of 1000 addresses.
    pub fn endpoints(&mut self) -> Value {
        let name = self.name();
        let mut meta = self.metadata(true, name);
        if let Value::Object(m) = &mut meta {
            let mut labels = match m.remove("labels") {
                Some(Value::Object(l)) => l,
                _ => Map::new(),
            };
            if self.rng.chance(1, 8) {
                // Only "true" skips: near misses as often, which must not.
                let skip = if self.rng.chance(1, 2) {
                    json!("true")
                } else {
                    self.field(
                        |r| json!(*r.pick(&["True", "TRUE", "false", "", "1", "yes", "true "])),
                        wrong_type,
                    )
                };
                labels.insert(kp_core::mirror::LABEL_SKIP_MIRROR.into(), skip);
            }
            if self.rng.chance(1, 10) {
                // Copied onto the mirrored slices: the service-name label is overwritten there,
                // any other rides along.
                let key = if self.rng.chance(1, 2) {
                    kp_core::convert::LABEL_SERVICE_NAME.to_string()
                } else {
                    hostile::string(&mut self.rng)
                };
                labels.insert(key, json!(hostile::string(&mut self.rng)));
            }
            if !labels.is_empty() {
                m.insert("labels".into(), Value::Object(labels));
            }
            let mut annotations = Map::new();
            if self.rng.chance(1, 4) {
                let t = self.timestamp();
                annotations.insert(kp_core::convert::ANNOTATION_TRIGGER_TIME.into(), t);
            }
            if self.rng.chance(1, 25) {
                annotations.insert(kp_core::mirror::ANNOTATION_LEADER.into(), json!("{}"));
            }
            if self.rng.chance(1, 10) {
                annotations.insert(
                    hostile::string(&mut self.rng),
                    json!(hostile::string(&mut self.rng)),
                );
            }
            if !annotations.is_empty() {
                m.insert("annotations".into(), Value::Object(annotations));
            }
        }
        let v6 = self.rng.chance(1, 4);
        let mixed = self.rng.chance(1, 4);
        let subsets = self.list(3, |g| g.subset(v6, mixed));
        let mut m = Map::new();
        m.insert("apiVersion".into(), json!("v1"));
        m.insert("kind".into(), json!("Endpoints"));
        m.insert("metadata".into(), meta);
        self.put(&mut m, "subsets", subsets);
        Value::Object(m)
    }

    /// One subset of an Endpoints object.
    fn subset(&mut self, v6: bool, mixed: bool) -> Value {
        let mut s = Map::new();
        let addresses = if self.rng.chance(1, 2500) {
            self.many_addresses(v6)
        } else {
            self.list(5, |g| g.endpoint_address(v6, mixed))
        };
        self.put(&mut s, "addresses", addresses);
        if self.rng.chance(1, 2) {
            let not_ready = self.list(3, |g| g.endpoint_address(v6, mixed));
            self.put(&mut s, "notReadyAddresses", not_ready);
        }
        let ports = self.list(3, |g| {
            let mut p = Map::new();
            let name = g.field(
                |r| json!(*r.pick(PORT_NAMES)),
                |r| json!(*r.pick(&["HTTP", "a_b", "-"])),
            );
            g.put(&mut p, "name", name);
            let proto = g.protocol();
            g.put(&mut p, "protocol", proto);
            let port = g.port_number();
            g.put(&mut p, "port", port);
            if g.rng.chance(1, 8) {
                let app = g.field(|_| json!("http"), |r| json!(hostile::string(r)));
                p.insert("appProtocol".into(), app);
            }
            Value::Object(p)
        });
        self.put(&mut s, "ports", ports);
        Value::Object(s)
    }

    /// One address of a subset, of the family `v6` or, in a dual-stack subset, either.
    fn endpoint_address(&mut self, v6: bool, mixed: bool) -> Value {
        let v6 = if mixed { self.rng.chance(1, 2) } else { v6 };
        let mut a = Map::new();
        let ip = self.address(v6, pod_ip);
        self.put(&mut a, "ip", ip);
        if self.rng.chance(2, 3) {
            let node = self.field(
                |r| json!(*r.pick(NODES)),
                |r| json!(*r.pick(&["Node-A", "node_a", ""])),
            );
            self.put(&mut a, "nodeName", node);
        }
        if self.rng.chance(1, 4) {
            let host = self.field(
                |r| json!(format!("pod-{}", r.below(8))),
                |r| json!(hostile::string(r)),
            );
            a.insert("hostname".into(), host);
        }
        if self.rng.chance(1, 4) {
            let pod = self.field(
                |r| json!(format!("pod-{}", r.below(8))),
                |r| json!(hostile::string(r)),
            );
            a.insert(
                "targetRef".into(),
                json!({"kind": "Pod", "name": pod, "namespace": "default"}),
            );
        }
        Value::Object(a)
    }

    /// Past the mirroring limit: 1000 to 1039 valid addresses of this node's pod range (cheap
    /// to make and to check), and now and then a hostile one at the end, past the limit.
    fn many_addresses(&mut self, v6: bool) -> Value {
        let n = 1000 + self.rng.below(40);
        let mut items: Vec<Value> = (0..n as u32)
            .map(|k| {
                let ip = if v6 {
                    ipv6(0xfd00_0010_0244_0001_0000_0000_0000_0000 | u128::from(k))
                } else {
                    ipv4(0x0af4_0000 | k)
                };
                json!({ "ip": ip, "nodeName": kp_flows::NODE })
            })
            .collect();
        if self.bad() {
            items.push(json!({ "ip": hostile::string(&mut self.rng) }));
        }
        Value::Array(items)
    }

    /// A Node, usually this one.
    pub fn node(&mut self) -> Value {
        let name = self.field(
            |r| json!(*r.pick(NODES)),
            |r| json!(*r.pick(&["", "NODE-A", "node-a."])),
        );
        let mut meta = self.metadata(false, name);
        if let Value::Object(m) = &mut meta {
            let zone = self.field(|r| json!(*r.pick(ZONES)), wrong_type);
            m.insert(
                "labels".into(),
                json!({ kp_core::convert::LABEL_ZONE: zone }),
            );
        }
        let cidrs = self.list(2, |g| g.cidr(pod_cidr));
        let first = self.cidr(pod_cidr);
        let mut spec = Map::new();
        self.put(&mut spec, "podCIDR", first);
        self.put(&mut spec, "podCIDRs", cidrs);
        if self.rng.chance(1, 6) {
            let key = self.word(&[kp_core::convert::TAINT_TO_BE_DELETED]);
            spec.insert(
                "taints".into(),
                json!([{ "key": key, "effect": "NoSchedule" }]),
            );
        }
        let addresses = self.list(4, |g| {
            let ty = g.word(&["InternalIP", "ExternalIP", "Hostname", "InternalIP"]);
            let v6 = g.rng.chance(1, 3);
            let addr = g.address(v6, node_ip);
            json!({ "type": ty, "address": addr })
        });
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": meta, "spec": spec, "status": { "addresses": addresses },
        })
    }

    /// A ServiceCIDR.
    pub fn service_cidr(&mut self) -> Value {
        let name = self.field(
            |r| json!(*r.pick(&["kubernetes", "extra", "second-range"])),
            |r| json!(*r.pick(&["", "Kubernetes", "a_b"])),
        );
        let meta = self.metadata(false, name);
        let cidrs = self.list(2, |g| g.cidr(service_range));
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": meta, "spec": { "cidrs": cidrs },
        })
    }

    /// One of the flow fixture's objects, moved into the name pool and mutated at random paths.
    fn mutated_fixture(&mut self) -> Value {
        let mut v = self.rng.pick(&self.fixtures).clone();
        if self.rng.chance(1, 2) {
            let name = self.name();
            if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
                m.insert("name".into(), name);
            }
        }
        for _ in 0..self.rng.below(4) {
            mutate(&mut self.rng, &mut v);
        }
        v
    }
}

/// Whether `name` is one of the pool's Services mostly left to their Endpoints (a quarter of
/// the `svc-N` names).
pub fn endpoints_only(name: &Value) -> bool {
    name.as_str()
        .and_then(|n| n.strip_prefix("svc-"))
        .and_then(|n| n.parse::<usize>().ok())
        .is_some_and(|n| n % 4 == 0)
}

/// Port-like odd values: range edges as numbers, and numbers as strings and floats.
fn odd_port(r: &mut Rng) -> Value {
    match r.below(6) {
        0 => json!(r.pick(ODD_INTEGERS).to_string()),
        1 => json!(*r.pick(&[80.5, 1e10, -0.0, 65535.0, f64::MIN_POSITIVE])),
        _ => json!(*r.pick(ODD_INTEGERS)),
    }
}

/// A value of a type no field expects where it is put.
fn wrong_type(r: &mut Rng) -> Value {
    match r.below(7) {
        0 => json!(r.chance(1, 2)),
        1 => json!(*r.pick(ODD_INTEGERS)),
        2 => json!(1.5e300),
        3 => json!([hostile::string(r)]),
        4 => json!({ "a": hostile::string(r) }),
        5 => json!(""),
        _ => Value::Null,
    }
}

/// An IPv4 address as std prints it.
fn ipv4(a: u32) -> String {
    std::net::Ipv4Addr::from(a).to_string()
}

/// An IPv6 address as std prints it (IPv4-compatible and mapped ones dotted).
fn ipv6(a: u128) -> String {
    std::net::Ipv6Addr::from(a).to_string()
}

/// An address inside `base/len` (the host part random; may be the network or top address).
fn in_v4(r: &mut Rng, base: u32, len: u32) -> String {
    let host = (r.next_u64() as u32).checked_shr(len).unwrap_or(0);
    ipv4(base | host)
}

/// An IPv6 address inside `base/len`.
fn in_v6(r: &mut Rng, base: u128, len: u32) -> String {
    let bits = (u128::from(r.next_u64()) << 64) | u128::from(r.next_u64());
    ipv6(base | bits.checked_shr(len).unwrap_or(0))
}

/// Any address of the family: anything the validation must sort out, specials included.
fn anywhere(r: &mut Rng, v6: bool) -> String {
    if v6 {
        match r.below(3) {
            // IPv4-compatible and IPv4-mapped forms, printed in their dotted spelling.
            0 => in_v6(r, 0, 96),
            1 => in_v6(r, 0xffff_0000_0000, 96),
            _ => in_v6(r, 0, 0),
        }
    } else {
        ipv4(r.next_u64() as u32)
    }
}

/// A ClusterIP: inside the fixture's Service CIDR, one in ten anywhere.
fn cluster_ip(r: &mut Rng, v6: bool) -> String {
    match (v6, r.below(10)) {
        (_, 0) => anywhere(r, v6),
        (false, _) => in_v4(r, 0x0a60_0000, 16),
        (true, _) => in_v6(r, 0xfd00_0010_0096_0000_0000_0000_0000_0000, 112),
    }
}

/// An external or LoadBalancer IP: a small range (so Services share some), or anywhere.
fn external_ip(r: &mut Rng, v6: bool) -> String {
    match (v6, r.below(6)) {
        (_, 0) => anywhere(r, v6),
        (false, _) => in_v4(r, 0xc633_6400, 24),
        (true, _) => in_v6(r, 0x2001_0db8_0000_0000_0000_0000_0000_0000, 64),
    }
}

/// An endpoint address: around this node's pod CIDR, one in eight anywhere.
fn pod_ip(r: &mut Rng, v6: bool) -> String {
    match (v6, r.below(8)) {
        (_, 0) => anywhere(r, v6),
        (false, _) => in_v4(r, 0x0af4_0000, 22),
        (true, _) => in_v6(r, 0xfd00_0010_0244_0001_0000_0000_0000_0000, 120),
    }
}

/// A Node address: the fixture node's, one in four anywhere.
fn node_ip(r: &mut Rng, v6: bool) -> String {
    match (v6, r.below(4)) {
        (_, 0) => anywhere(r, v6),
        (false, _) => kp_flows::NODE_IP.into(),
        (true, _) => kp_flows::NODE_IP6.into(),
    }
}

/// A network with a random prefix length, host bits sometimes left set.
fn net(r: &mut Rng, v6: bool, min_len: u32) -> String {
    let len = min_len + r.below((if v6 { 128 } else { 32 }) - min_len as usize + 1) as u32;
    let addr = anywhere(r, v6);
    format!("{addr}/{len}")
}

/// A `loadBalancerSourceRanges` entry.
fn source_range(r: &mut Rng) -> String {
    match r.below(4) {
        0 => {
            let v6 = r.chance(1, 3);
            net(r, v6, 0)
        }
        1 => "192.0.2.0/30".into(),
        2 => "0.0.0.0/0".into(),
        _ => format!("{}/24", in_v4(r, 0xc000_0200, 24)),
    }
}

/// A pod CIDR: the fixture node's, or any network.
fn pod_cidr(r: &mut Rng) -> String {
    match r.below(4) {
        0 => {
            let v6 = r.chance(1, 2);
            net(r, v6, 0)
        }
        1 => kp_flows::POD_CIDR6.into(),
        _ => kp_flows::POD_CIDR.into(),
    }
}

/// A ServiceCIDR range: the fixture's, another private one, or any network.
fn service_range(r: &mut Rng) -> String {
    match r.below(4) {
        0 => {
            let v6 = r.chance(1, 2);
            net(r, v6, 0)
        }
        1 => kp_flows::SERVICE_CIDR6.into(),
        2 => "192.168.50.0/24".into(),
        _ => kp_flows::SERVICE_CIDR.into(),
    }
}

/// A random JSON value, `depth` levels deep at most, with keys real objects use.
pub fn random_tree(r: &mut Rng, depth: u32) -> Value {
    let leaf = depth == 0 || r.chance(1, 3);
    if leaf {
        return match r.below(8) {
            0 => json!(hostile::string(r)),
            1 => json!(*r.pick(ODD_ADDRESSES)),
            2 => json!(*r.pick(ODD_CIDRS)),
            3 => json!(*r.pick(ODD_INTEGERS)),
            4 => json!(*r.pick(ODD_WORDS)),
            5 => json!(r.chance(1, 2)),
            6 => json!(-1.5e-300),
            _ => Value::Null,
        };
    }
    if r.chance(1, 3) {
        Value::Array((0..r.below(4)).map(|_| random_tree(r, depth - 1)).collect())
    } else {
        let mut m = Map::new();
        for _ in 0..r.below(5) {
            let key = if r.chance(1, 6) {
                hostile::string(r)
            } else {
                (*r.pick(FIELD_NAMES)).to_string()
            };
            m.insert(key, random_tree(r, depth - 1));
        }
        Value::Object(m)
    }
}

/// One random mutation somewhere in `v`: a value replaced (by a hostile string, an odd scalar
/// or a random tree), a key removed, an array element duplicated or dropped.
pub fn mutate(r: &mut Rng, v: &mut Value) {
    // Walk down a random path, stopping now and then (or at a leaf).
    let stop = r.chance(1, 4);
    match v {
        Value::Object(m) if !m.is_empty() && !stop => {
            let i = r.below(m.len());
            let key = m.keys().nth(i).cloned().unwrap_or_default();
            if r.chance(1, 6) {
                m.remove(&key);
            } else if let Some(child) = m.get_mut(&key) {
                mutate(r, child);
            }
            return;
        }
        Value::Array(a) if !a.is_empty() && !stop => {
            let i = r.below(a.len());
            match r.below(8) {
                0 => {
                    let dup = a[i].clone();
                    a.push(dup);
                }
                1 => {
                    a.remove(i);
                }
                _ => mutate(r, &mut a[i]),
            }
            return;
        }
        _ => {}
    }
    *v = match r.below(6) {
        0 | 1 => json!(hostile::string(r)),
        2 => wrong_type(r),
        3 => odd_port(r),
        4 => json!(*r.pick(ODD_ADDRESSES)),
        _ => random_tree(r, 2),
    };
}

/// Pieces of syntax spliced into manifest text: YAML's document markers, anchors, aliases,
/// tags and block scalars, JSON's brackets and escapes, a BOM, numbers YAML reads oddly.
const PIECES: &[&[u8]] = &[
    b"\n---\n",
    b"\n...\n",
    b"&a ",
    b"*a",
    b"!!binary ",
    b"!!str ",
    b"<<: *a\n",
    b"{",
    b"}",
    b"[",
    b"\"",
    b"'",
    b"\t",
    b"\r",
    b"\0",
    b"# ",
    b": ",
    b"- ",
    b"? ",
    b"|",
    b">-\n",
    b"%YAML 1.2\n",
    b"\xef\xbb\xbf",
    b"\\u0000",
    b"\\ud800",
    b"1e99999",
    b"-0",
    b"0x10",
    b"~",
    b"null",
    b"yes",
    b".inf",
    b".nan",
];

/// Openers repeated for deep nesting.
const OPENERS: &[&[u8]] = &[b"[", b"{a: ", b"- ", b"a:\n "];

/// Manifest text mangled at the byte level: cut, spliced, flipped, or given YAML's sharper
/// tools (anchors and aliases, tags, document markers, deep nesting). Always valid UTF-8, as
/// the source hands the parser a `&str`.
pub fn garble(r: &mut Rng, text: &str) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for _ in 0..1 + r.below(4) {
        let at = r.below(bytes.len() + 1);
        match r.below(9) {
            0 => bytes.truncate(at),
            1 if at < bytes.len() => bytes[at] ^= 1 << r.below(7),
            2 => {
                let piece = *r.pick(PIECES);
                bytes.splice(at..at, piece.iter().copied());
            }
            3 if !bytes.is_empty() => {
                let from = r.below(bytes.len());
                let len = r.below(bytes.len() - from + 1).min(200);
                let copy = bytes[from..from + len].to_vec();
                bytes.splice(at..at, copy);
            }
            4 if at < bytes.len() => {
                let end = (at + r.below(20)).min(bytes.len());
                bytes.drain(at..end);
            }
            5 => {
                let depth = *r.pick(&[10usize, 100, 200, 1000]);
                let open = *r.pick(OPENERS);
                bytes.splice(at..at, open.repeat(depth));
            }
            6 => {
                let junk: Vec<u8> = (0..r.below(40)).map(|_| r.next_u64() as u8).collect();
                bytes.splice(at..at, junk);
            }
            _ => {}
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// YAML's "billion laughs": nine levels of aliases, each ten of the one before. Its expansion
/// would hold a billion strings; a parser must refuse or bound it.
pub fn alias_bomb() -> String {
    let mut s = String::from("apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n");
    s.push_str("a0: &a0 [\"lol\"]\n");
    for i in 1..10 {
        let refs: Vec<String> = (0..10).map(|_| format!("*a{}", i - 1)).collect();
        s.push_str(&format!("a{i}: &a{i} [{}]\n", refs.join(", ")));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_objects_are_deterministic_and_mostly_of_the_five_kinds() {
        let (mut a, mut b) = (Generator::new(3), Generator::new(3));
        let mut typed = 0;
        for _ in 0..2000 {
            let (x, y) = (a.object(), b.object());
            assert_eq!(x, y);
            let kind = x.get("kind").and_then(Value::as_str).unwrap_or("");
            if [
                "Service",
                "EndpointSlice",
                "Node",
                "ServiceCIDR",
                "Endpoints",
            ]
            .contains(&kind)
            {
                typed += 1;
            }
        }
        assert!(typed > 1500, "{typed}");
    }

    #[test]
    fn garbled_text_stays_utf8_and_addresses_land_in_their_ranges() {
        let mut r = Rng::new(9);
        for _ in 0..200 {
            let _ = garble(&mut r, "apiVersion: v1\nkind: Service\n");
        }
        for _ in 0..100 {
            let a: std::net::Ipv4Addr = in_v4(&mut r, 0x0a60_0000, 16).parse().unwrap();
            assert_eq!(a.octets()[..2], [10, 96]);
        }
    }
}
