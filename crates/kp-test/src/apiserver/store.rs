//! The fake API server's memory: the objects of each kind, one resourceVersion counter for all
//! of them (as etcd's revision), and the history of changes that watches replay.
//!
//! Nothing here knows about HTTP or time, so the list and watch semantics are tested without a
//! server (`tests.rs`).

use std::collections::BTreeMap;
use std::ops::Bound;

use kp_core::track::Kind;
use serde_json::{json, Value};

/// A namespace (empty for cluster-scoped kinds) and a name, borrowed.
pub(super) type ObjectKeyRef<'a> = (&'a str, &'a str);

/// Where a kind lives in the API: its group version, its list kind and its URL segment.
pub(super) struct KindInfo {
    /// `apiVersion` of objects and lists of this kind.
    pub api_version: &'static str,
    /// `kind` of the list response.
    pub list_kind: &'static str,
    /// Whether objects live in a namespace.
    pub namespaced: bool,
}

/// The API facts about `kind`.
pub(super) fn info(kind: Kind) -> KindInfo {
    match kind {
        Kind::Service => KindInfo {
            api_version: "v1",
            list_kind: "ServiceList",
            namespaced: true,
        },
        Kind::EndpointSlice => KindInfo {
            api_version: "discovery.k8s.io/v1",
            list_kind: "EndpointSliceList",
            namespaced: true,
        },
        Kind::Node => KindInfo {
            api_version: "v1",
            list_kind: "NodeList",
            namespaced: false,
        },
        Kind::ServiceCidr => KindInfo {
            api_version: "networking.k8s.io/v1",
            list_kind: "ServiceCIDRList",
            namespaced: false,
        },
        Kind::Endpoints => KindInfo {
            api_version: "v1",
            list_kind: "EndpointsList",
            namespaced: true,
        },
    }
}

/// What a watch reports for one change, as the `type` of a watch event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventType {
    /// The object is new to this watch (created, or it started matching the selectors).
    Added,
    /// The object changed and still matches.
    Modified,
    /// The object is gone for this watch (deleted, or it stopped matching the selectors).
    Deleted,
}

impl EventType {
    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One recorded change.
#[derive(Clone, Debug)]
struct Change {
    /// The resourceVersion the change created.
    rv: u64,
    kind: Kind,
    /// The object before the change, if it existed.
    old: Option<Value>,
    /// The object after the change; for a deletion, the last state stamped with `rv`.
    object: Value,
    /// Whether the change deleted the object.
    deleted: bool,
}

/// The store could not serve a watch from the resourceVersion asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Gone {
    /// The oldest resourceVersion a watch may still start from.
    pub oldest: u64,
}

/// The objects, the counter and the history.
#[derive(Debug, Default)]
pub(super) struct Store {
    rv: u64,
    /// Every object, by kind, namespace (empty for cluster-scoped kinds) and name.
    objects: BTreeMap<(Kind, String, String), Value>,
    /// Every change, oldest first.
    history: Vec<Change>,
    /// Watches from a resourceVersion below this are answered with 410 Gone.
    oldest: u64,
    /// Numbers the uids given to objects created without one.
    uids: u64,
}

impl Store {
    /// The current resourceVersion: that of the newest change, 0 before any.
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Creates or replaces an object, filling in `apiVersion`, `kind`, a namespace (`default`,
    /// for namespaced kinds) and a uid where missing, and stamping the new resourceVersion.
    /// Returns that resourceVersion.
    pub fn upsert(&mut self, kind: Kind, mut object: Value) -> Result<u64, String> {
        let info = info(kind);
        let Some(fields) = object.as_object_mut() else {
            return Err(format!("a {kind} must be a JSON object"));
        };
        match fields.get("kind").and_then(Value::as_str) {
            None => {
                fields.insert("kind".into(), json!(kind.to_string()));
            }
            Some(k) if k == kind.to_string() => {}
            Some(other) => return Err(format!("object of kind {other} given as a {kind}")),
        }
        fields
            .entry("apiVersion")
            .or_insert_with(|| json!(info.api_version));
        let meta = fields.entry("metadata").or_insert_with(|| json!({}));
        let Some(meta) = meta.as_object_mut() else {
            return Err(format!("the metadata of a {kind} must be a JSON object"));
        };
        let name = match meta.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => return Err(format!("a {kind} needs metadata.name")),
        };
        let namespace = if info.namespaced {
            meta.entry("namespace")
                .or_insert_with(|| json!("default"))
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{kind} {name}: metadata.namespace must be a string"))?
        } else {
            if meta.contains_key("namespace") {
                return Err(format!(
                    "{kind} {name} is cluster-scoped: remove its namespace"
                ));
            }
            String::new()
        };
        let key = (kind, namespace, name);
        let old = self.objects.get(&key).cloned();
        let uid = old
            .as_ref()
            .and_then(|o| o["metadata"]["uid"].as_str().map(str::to_string));
        if !meta.contains_key("uid") {
            let uid = uid.unwrap_or_else(|| {
                self.uids += 1;
                format!("00000000-0000-4000-8000-{:012}", self.uids)
            });
            meta.insert("uid".into(), json!(uid));
        }
        self.rv += 1;
        meta.insert("resourceVersion".into(), json!(self.rv.to_string()));
        self.objects.insert(key, object.clone());
        self.history.push(Change {
            rv: self.rv,
            kind,
            old,
            object,
            deleted: false,
        });
        Ok(self.rv)
    }

    /// Deletes an object; returns the resourceVersion of the deletion, or `None` if there was
    /// no such object. `namespace` is ignored for cluster-scoped kinds.
    pub fn delete(&mut self, kind: Kind, namespace: &str, name: &str) -> Option<u64> {
        let namespace = if info(kind).namespaced { namespace } else { "" };
        let key = (kind, namespace.to_string(), name.to_string());
        let old = self.objects.remove(&key)?;
        self.rv += 1;
        let mut object = old.clone();
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.history.push(Change {
            rv: self.rv,
            kind,
            old: Some(old),
            object,
            deleted: true,
        });
        Some(self.rv)
    }

    /// The object, if it exists.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<&Value> {
        let namespace = if info(kind).namespaced { namespace } else { "" };
        self.objects
            .get(&(kind, namespace.to_string(), name.to_string()))
    }

    /// The objects of `kind` that `filter` selects, ordered by namespace and name.
    pub fn list(&self, kind: Kind, filter: &Filter) -> Vec<Value> {
        self.list_page(kind, filter, None, None).0
    }

    /// One page of [`Store::list`]: at most `limit` objects whose (namespace, name) sorts after
    /// `after` (from the first, without it), and the key of the page's last object if more
    /// follow. The next page starts after that key, as the real API server's continue tokens
    /// do: where a page starts is found at once, however deep into the list, and an object
    /// deleted or created between two pages never shifts the rest out of sight.
    pub fn list_page(
        &self,
        kind: Kind,
        filter: &Filter,
        after: Option<&ObjectKeyRef<'_>>,
        limit: Option<usize>,
    ) -> (Vec<Value>, Option<(String, String)>) {
        let start = match after {
            Some((namespace, name)) => {
                Bound::Excluded((kind, namespace.to_string(), name.to_string()))
            }
            None => Bound::Included((kind, String::new(), String::new())),
        };
        let selected = self
            .objects
            .range((start, Bound::Unbounded))
            .take_while(|((k, _, _), _)| *k == kind)
            .filter(|(_, o)| filter.matches(o));
        let mut page = Vec::new();
        let mut last: Option<(&String, &String)> = None;
        for ((_, namespace, name), object) in selected {
            if limit.is_some_and(|l| page.len() >= l) {
                // Another object follows the full page.
                let next = last.map(|(namespace, name)| (namespace.clone(), name.clone()));
                return (page, next);
            }
            page.push(object.clone());
            last = Some((namespace, name));
        }
        (page, None)
    }

    /// Forgets the history up to now: watches must start from the current resourceVersion or
    /// later, older ones get 410 Gone (as after etcd compaction). Watches already open go on.
    pub fn compact(&mut self) {
        self.oldest = self.rv;
    }

    /// Whether a watch may start from `rv`.
    pub fn check_start(&self, rv: u64) -> Result<(), Gone> {
        if rv < self.oldest {
            Err(Gone {
                oldest: self.oldest,
            })
        } else {
            Ok(())
        }
    }

    /// What a watch of `kind` through `filter` that has seen everything up to `after` must
    /// report next, with the resourceVersion of each event.
    ///
    /// A change that makes an object start matching is `ADDED`, one that makes it stop
    /// matching is `DELETED`, as the real API server reports them.
    pub fn events_since(
        &self,
        kind: Kind,
        after: u64,
        filter: &Filter,
    ) -> Vec<(u64, EventType, Value)> {
        let start = self.history.partition_point(|c| c.rv <= after);
        self.history[start..]
            .iter()
            .filter(|c| c.kind == kind)
            .filter_map(|c| {
                let was = c.old.as_ref().is_some_and(|o| filter.matches(o));
                let event = if c.deleted {
                    was.then_some(EventType::Deleted)
                } else {
                    match (was, filter.matches(&c.object)) {
                        (false, true) => Some(EventType::Added),
                        (true, true) => Some(EventType::Modified),
                        (true, false) => Some(EventType::Deleted),
                        (false, false) => None,
                    }
                };
                event.map(|e| (c.rv, e, c.object.clone()))
            })
            .collect()
    }
}

/// Which objects a request asks for: a namespace (from the path) and the `labelSelector` and
/// `fieldSelector` query parameters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Filter {
    /// Only objects in this namespace.
    pub namespace: Option<String>,
    labels: Vec<LabelTerm>,
    fields: Vec<FieldTerm>,
}

/// One term of a label selector.
#[derive(Clone, Debug, PartialEq, Eq)]
enum LabelTerm {
    /// `key`
    Exists(String),
    /// `!key`
    NotExists(String),
    /// `key=v`, `key==v`, `key in (v1,v2)`
    In(String, Vec<String>),
    /// `key!=v`, `key notin (v1,v2)`: also true when the label is missing.
    NotIn(String, Vec<String>),
}

/// One term of a field selector: a dotted path into the object, equal or not to a value.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FieldTerm {
    path: Vec<String>,
    value: String,
    equal: bool,
}

impl Filter {
    /// Parses the selectors; an empty or missing selector selects everything.
    pub fn new(
        namespace: Option<String>,
        labels: Option<&str>,
        fields: Option<&str>,
    ) -> Result<Filter, String> {
        Ok(Filter {
            namespace,
            labels: split_terms(labels.unwrap_or(""))
                .into_iter()
                .map(|t| parse_label_term(&t))
                .collect::<Result<_, _>>()?,
            fields: split_terms(fields.unwrap_or(""))
                .into_iter()
                .map(|t| parse_field_term(&t))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Whether `object` is selected.
    pub fn matches(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        if let Some(ns) = &self.namespace {
            if meta["namespace"].as_str() != Some(ns) {
                return false;
            }
        }
        let label = |key: &str| meta["labels"][key].as_str();
        let labels_ok = self.labels.iter().all(|term| match term {
            LabelTerm::Exists(k) => label(k).is_some(),
            LabelTerm::NotExists(k) => label(k).is_none(),
            LabelTerm::In(k, vs) => label(k).is_some_and(|v| vs.iter().any(|x| x == v)),
            LabelTerm::NotIn(k, vs) => !label(k).is_some_and(|v| vs.iter().any(|x| x == v)),
        });
        labels_ok
            && self.fields.iter().all(|term| {
                let found = term
                    .path
                    .iter()
                    .try_fold(object, |v, segment| v.get(segment));
                // A missing field compares as the empty string, as the API server's field sets do.
                let actual = match found {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Null) | None => String::new(),
                    Some(other) => other.to_string(),
                };
                (actual == term.value) == term.equal
            })
    }
}

/// Splits a selector at the commas that are not inside `( )`; drops empty terms.
fn split_terms(selector: &str) -> Vec<String> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut current = String::new();
    for c in selector.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    terms.push(current);
    terms
        .into_iter()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_label_term(term: &str) -> Result<LabelTerm, String> {
    if let Some(key) = term.strip_prefix('!') {
        return Ok(LabelTerm::NotExists(key.trim().to_string()));
    }
    if let Some((key, value)) = term.split_once("!=") {
        return Ok(LabelTerm::NotIn(
            key.trim().to_string(),
            vec![value.trim().to_string()],
        ));
    }
    if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(LabelTerm::In(
            key.trim().to_string(),
            vec![value.trim().to_string()],
        ));
    }
    let words: Vec<&str> = term.splitn(3, char::is_whitespace).collect();
    match words.as_slice() {
        [key] => Ok(LabelTerm::Exists(key.to_string())),
        [key, op, set] => {
            let values = set
                .trim()
                .strip_prefix('(')
                .and_then(|s| s.strip_suffix(')'))
                .ok_or_else(|| format!("label selector term `{term}`: expected `(v1,v2)`"))?
                .split(',')
                .map(|v| v.trim().to_string())
                .collect();
            match *op {
                "in" => Ok(LabelTerm::In(key.to_string(), values)),
                "notin" => Ok(LabelTerm::NotIn(key.to_string(), values)),
                _ => Err(format!(
                    "label selector term `{term}`: unknown operator `{op}`"
                )),
            }
        }
        _ => Err(format!("label selector term `{term}` is not understood")),
    }
}

fn parse_field_term(term: &str) -> Result<FieldTerm, String> {
    let (path, value, equal) = if let Some((p, v)) = term.split_once("!=") {
        (p, v, false)
    } else if let Some((p, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        (p, v, true)
    } else {
        return Err(format!(
            "field selector term `{term}`: expected `field=value`"
        ));
    };
    Ok(FieldTerm {
        path: path.trim().split('.').map(str::to_string).collect(),
        value: value.trim().to_string(),
        equal,
    })
}
