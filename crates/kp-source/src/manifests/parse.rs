//! Parsing manifest files, and tracking which file holds which object. No I/O, no clock.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::track::{Kind, Object, ObjectKey, SourceEvent};
use serde_json::Value;
use tracing::warn;

use crate::SourceError;

const CORE_V1: &str = "v1";
const DISCOVERY_V1: &str = "discovery.k8s.io/v1";

/// Parses one manifest file into its objects.
///
/// A `.json` file holds one JSON document; any other file is YAML and may hold several
/// documents separated by `---` lines. Each document is a v1 `Service`, a discovery.k8s.io/v1
/// `EndpointSlice`, a v1 `Node`, or a list of those: a v1 `List` (as `kubectl get -o yaml`
/// writes) or a typed `ServiceList`, `EndpointSliceList` or `NodeList` (whose items may omit
/// `apiVersion` and `kind`). Empty documents are skipped, so an empty file holds no objects.
///
/// The first document that fails (bad syntax, an unsupported kind, a field of the wrong type, no
/// `metadata.name`) fails the whole file, with an error naming the file and the document.
pub fn parse_file(path: &Path, text: &str) -> Result<Vec<Object>, SourceError> {
    let fail = |document, reason| SourceError::ManifestParse {
        path: path.to_path_buf(),
        document,
        reason,
    };
    let mut objects = Vec::new();
    if path.extension().is_some_and(|ext| ext == "json") {
        if text.trim().is_empty() {
            return Ok(objects);
        }
        let value: Value =
            serde_json::from_str(text).map_err(|err| fail(1, format!("invalid JSON: {err}")))?;
        decode_document(value, &mut objects).map_err(|reason| fail(1, reason))?;
        return Ok(objects);
    }
    for doc in split_documents(text) {
        if is_blank(doc.text) {
            continue;
        }
        let value: Value = match serde_saphyr::from_str(doc.text) {
            Ok(value) => value,
            Err(_) => {
                // Parse again with the lines before the document blanked out, so that the
                // error's line numbers count from the top of the file. Only on this error path,
                // to keep parsing linear.
                let padded = format!("{}{}", "\n".repeat(doc.first_line - 1), doc.text);
                // One line, without a source snippet: it goes into a log line.
                let options = serde_saphyr::options! { with_snippet: false };
                let reason = match serde_saphyr::from_str_with_options::<Value>(&padded, options) {
                    Err(err) => format!("invalid YAML: {err}"),
                    Ok(_) => "invalid YAML".to_string(),
                };
                return Err(fail(doc.index, reason));
            }
        };
        decode_document(value, &mut objects).map_err(|reason| fail(doc.index, reason))?;
    }
    Ok(objects)
}

/// One YAML document's text within a file.
#[derive(Debug, PartialEq, Eq)]
struct Document<'a> {
    /// Which document this is, counting from 1.
    index: usize,
    /// The line of the file its text starts on, counting from 1.
    first_line: usize,
    text: &'a str,
}

/// Splits a YAML stream at its document markers.
///
/// YAML forbids a line starting with `---` or `...` followed by a space or the line's end
/// inside any scalar (the spec's `c-forbidden`), so such lines always delimit documents and the
/// split never cuts through a value. Text after `---` on the same line belongs to the new
/// document. Text before the first marker counts as a document only if it holds something
/// other than comments; every `---` starts a document, even an empty one.
fn split_documents(text: &str) -> Vec<Document<'_>> {
    let mut docs = Vec::new();
    let mut start = 0;
    let mut first_line = 1;
    let mut explicit = false;
    let mut index = 0;
    let mut offset = 0;
    let mut line_no = 0;
    let mut finish = |start: usize, end: usize, first_line: usize, explicit: bool| {
        let body = &text[start..end];
        if explicit || !is_blank(body) {
            index += 1;
            docs.push(Document {
                index,
                first_line,
                text: body,
            });
        }
    };
    for line in text.split_inclusive('\n') {
        line_no += 1;
        let line_start = offset;
        offset += line.len();
        let content = line.trim_end_matches(['\n', '\r']);
        if let Some(rest) = marker_rest(content, "---") {
            finish(start, line_start, first_line, explicit);
            // The new document starts right after the marker, on this line.
            start = line_start + (content.len() - rest.len());
            first_line = line_no;
            explicit = true;
        } else if marker_rest(content, "...").is_some() {
            finish(start, line_start, first_line, explicit);
            start = offset;
            first_line = line_no + 1;
            explicit = false;
        }
    }
    finish(start, text.len(), first_line, explicit);
    docs
}

/// If `line` is the document marker `marker`, what follows it on the line.
fn marker_rest<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(marker)?;
    (rest.is_empty() || rest.starts_with([' ', '\t'])).then_some(rest)
}

/// Whether YAML text holds nothing but whitespace and comments.
fn is_blank(text: &str) -> bool {
    text.lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#')
    })
}

/// Decodes one document (an object or a list of objects) into `out`.
fn decode_document(value: Value, out: &mut Vec<Object>) -> Result<(), String> {
    if value.is_null() {
        return Ok(());
    }
    let (api_version, kind) = type_of(&value, None)?;
    let item_type = match (api_version.as_str(), kind.as_str()) {
        (CORE_V1, "List") => None,
        (CORE_V1, "ServiceList") => Some((CORE_V1, "Service")),
        (DISCOVERY_V1, "EndpointSliceList") => Some((DISCOVERY_V1, "EndpointSlice")),
        (CORE_V1, "NodeList") => Some((CORE_V1, "Node")),
        _ => {
            out.push(decode_object(value, None)?);
            return Ok(());
        }
    };
    let Value::Object(mut list) = value else {
        return Err("not a mapping".into());
    };
    let items = match list.remove("items") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(format!("{kind}: items is not a sequence")),
    };
    for (i, item) in items.into_iter().enumerate() {
        let obj =
            decode_object(item, item_type).map_err(|reason| format!("item {}: {reason}", i + 1))?;
        out.push(obj);
    }
    Ok(())
}

/// Reads `apiVersion` and `kind`, falling back to `default` (for the items of a typed list).
fn type_of(value: &Value, default: Option<(&str, &str)>) -> Result<(String, String), String> {
    let Value::Object(map) = value else {
        return Err("not a mapping".into());
    };
    let field = |name: &str| -> Result<Option<String>, String> {
        match map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("{name} is not a string")),
        }
    };
    match (field("apiVersion")?, field("kind")?, default) {
        (Some(api_version), Some(kind), _) => Ok((api_version, kind)),
        (None, None, Some((api_version, kind))) => Ok((api_version.into(), kind.into())),
        _ => Err("apiVersion and kind are required".into()),
    }
}

/// Decodes one Service, EndpointSlice or Node.
fn decode_object(value: Value, default: Option<(&str, &str)>) -> Result<Object, String> {
    let (api_version, kind) = type_of(&value, default)?;
    let obj = match (api_version.as_str(), kind.as_str()) {
        (CORE_V1, "Service") => Object::Service(Box::new(
            serde_json::from_value::<Service>(value).map_err(|err| format!("Service: {err}"))?,
        )),
        (DISCOVERY_V1, "EndpointSlice") => Object::EndpointSlice(Box::new(
            serde_json::from_value::<EndpointSlice>(value)
                .map_err(|err| format!("EndpointSlice: {err}"))?,
        )),
        (CORE_V1, "Node") => Object::Node(Box::new(
            serde_json::from_value::<Node>(value).map_err(|err| format!("Node: {err}"))?,
        )),
        _ => {
            return Err(format!(
                "unsupported kind {kind:?} (apiVersion {api_version:?}); expected v1 Service, \
                 discovery.k8s.io/v1 EndpointSlice, v1 Node or a list of them"
            ))
        }
    };
    if obj.key().name.is_empty() {
        return Err(format!("{kind}: metadata.name is required"));
    }
    Ok(obj)
}

/// Identifies an object across files.
type Key = (Kind, ObjectKey);

/// One object as a file holds it.
#[derive(Clone, Debug)]
struct Entry {
    /// When this version of the object appeared in this file: a counter over the whole set.
    /// Where several files hold the same object, the latest version wins.
    generation: u64,
    object: Object,
}

/// Which file holds which object, as of each file's last good parse, and what has been
/// reported from them.
///
/// Each change returns the [`SourceEvent`]s that bring a consumer from the old set of objects
/// to the new one: `Upsert` for an object that is new or changed, `Delete` for one that no file
/// holds any more. An object held by several files is reported as the version that appeared
/// most recently (last writer wins), with a warning.
#[derive(Debug, Default)]
pub struct ManifestSet {
    files: BTreeMap<PathBuf, BTreeMap<Key, Entry>>,
    /// What has been reported: the winning version of every object.
    reported: BTreeMap<Key, Object>,
    generation: u64,
}

impl ManifestSet {
    /// An empty set.
    pub fn new() -> Self {
        ManifestSet::default()
    }

    /// Sets the objects of the file `path` (added or changed), returning what to report.
    pub fn update_file(&mut self, path: &Path, objects: Vec<Object>) -> Vec<SourceEvent> {
        self.apply([(path.to_path_buf(), Some(objects))])
    }

    /// Forgets the file `path` (deleted), returning what to report.
    pub fn remove_file(&mut self, path: &Path) -> Vec<SourceEvent> {
        self.apply([(path.to_path_buf(), None)])
    }

    /// Applies several file changes at once: `Some(objects)` for a new or changed file, `None`
    /// for a removed one. Applying them together means an object that moves between files (a
    /// rename) is never reported as deleted in between.
    pub fn apply(
        &mut self,
        changes: impl IntoIterator<Item = (PathBuf, Option<Vec<Object>>)>,
    ) -> Vec<SourceEvent> {
        let mut affected = BTreeSet::new();
        for (path, objects) in changes {
            let old = self.files.remove(&path).unwrap_or_default();
            affected.extend(old.keys().cloned());
            let Some(objects) = objects else { continue };
            let mut entries = BTreeMap::new();
            for object in objects {
                let key = (object.kind(), object.key());
                let generation = match old.get(&key) {
                    Some(e) if same_object(&e.object, &object) => e.generation,
                    _ => {
                        self.generation += 1;
                        self.generation
                    }
                };
                if entries.contains_key(&key) {
                    warn!(
                        file = %path.display(),
                        "{} {} appears more than once in the file; using the last one",
                        key.0,
                        key.1
                    );
                }
                entries.insert(key.clone(), Entry { generation, object });
                affected.insert(key);
            }
            self.files.insert(path, entries);
        }

        let mut events = Vec::new();
        for key in affected {
            let holders: Vec<(&PathBuf, &Entry)> = self
                .files
                .iter()
                .filter_map(|(path, entries)| entries.get(&key).map(|e| (path, e)))
                .collect();
            let winner = holders.iter().max_by_key(|(_, e)| e.generation);
            if let (Some((winner_path, _)), true) = (winner, holders.len() > 1) {
                let files: Vec<String> = holders
                    .iter()
                    .map(|(p, _)| p.display().to_string())
                    .collect();
                warn!(
                    files = ?files,
                    using = %winner_path.display(),
                    "{} {} is defined in several files; using the most recently changed",
                    key.0,
                    key.1
                );
            }
            match winner {
                Some((_, entry)) => {
                    let unchanged = self
                        .reported
                        .get(&key)
                        .is_some_and(|old| same_object(old, &entry.object));
                    if !unchanged {
                        self.reported.insert(key, entry.object.clone());
                        events.push(SourceEvent::Upsert(entry.object.clone()));
                    }
                }
                None => {
                    if self.reported.remove(&key).is_some() {
                        events.push(SourceEvent::Delete(key.0, key.1));
                    }
                }
            }
        }
        events
    }

    /// The files currently holding a good parse.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.keys().map(PathBuf::as_path)
    }

    /// Number of distinct objects currently reported.
    pub fn len(&self) -> usize {
        self.reported.len()
    }

    /// Whether no object is currently reported.
    pub fn is_empty(&self) -> bool {
        self.reported.is_empty()
    }
}

fn same_object(a: &Object, b: &Object) -> bool {
    match (a, b) {
        (Object::Service(a), Object::Service(b)) => a == b,
        (Object::EndpointSlice(a), Object::EndpointSlice(b)) => a == b,
        (Object::Node(a), Object::Node(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests;
