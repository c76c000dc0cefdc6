//! Parsing manifest files, and tracking which file holds which object. No I/O, no clock.
//!
//! Memory matters here: a directory may describe a whole cluster (10k Services with their
//! EndpointSlices is a 13 MB JSON file). So a file is decoded one object at a time, never as one
//! tree ([`for_each_object`]), and the set of objects ([`ManifestSet`]) keeps only each object's
//! key and a digest of its content, not the object: whoever needs an object again parses its
//! file again, which only happens when one file's version of an object must stand in for
//! another's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::{DefaultHasher, Hasher};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    EndpointSubset, Endpoints, Node, NodeSpec, NodeStatus, Service, ServiceSpec, ServiceStatus,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};
use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec, ServiceCIDRStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kp_core::track::{Kind, Object, ObjectKey};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Serialize;
use serde_json::Value;
use tracing::warn;

use crate::SourceError;

const CORE_V1: &str = "v1";
const DISCOVERY_V1: &str = "discovery.k8s.io/v1";
const NETWORKING_V1: &str = "networking.k8s.io/v1";

/// Parses one manifest file into its objects. See [`for_each_object`] for what a file may hold.
pub fn parse_file(path: &Path, text: &str) -> Result<Vec<Object>, SourceError> {
    let mut objects = Vec::new();
    for_each_object(path, text, &mut |_| true, &mut |_, obj| objects.push(obj))?;
    Ok(objects)
}

/// Decodes one manifest file object by object, calling `f` with each object's ordinal (its
/// position among the file's objects, from 0) and the object, in file order. Objects for which
/// `want(ordinal)` is false are only checked for syntax, not decoded, and not passed to `f`.
///
/// A `.json` file holds one JSON document; any other file is YAML and may hold several
/// documents separated by `---` lines. Each document is a v1 `Service`, a discovery.k8s.io/v1
/// `EndpointSlice`, a v1 `Endpoints` (mirrored into EndpointSlices by kp-core's `mirror`), a v1
/// `Node`, a networking.k8s.io/v1 `ServiceCIDR`, or a list of those: a v1 `List` (as `kubectl
/// get -o yaml` writes) or a typed `ServiceList`, `EndpointSliceList`, `EndpointsList`,
/// `NodeList` or `ServiceCIDRList` (whose items may omit `apiVersion` and `kind`). Empty documents are skipped, so an empty file holds no objects.
///
/// The first document that fails (bad syntax, an unsupported kind, a field of the wrong type, no
/// `metadata.name`) fails the whole file, with an error naming the file and the document; `f`
/// may have been called for the objects before it (once each). No document is held as a whole
/// tree: each is read once, field by field, when its `apiVersion` and `kind` come before the
/// fields that depend on them (as people and `kubectl` write them); otherwise, or when it fails,
/// twice (once for its type, once for its objects, with the error worded from that read). A
/// list's items are decoded one at a time.
pub fn for_each_object(
    path: &Path,
    text: &str,
    want: &mut dyn FnMut(usize) -> bool,
    f: &mut dyn FnMut(usize, Object),
) -> Result<(), SourceError> {
    let fail = |document, reason| SourceError::ManifestParse {
        path: path.to_path_buf(),
        document,
        reason,
    };
    let mut sink = Sink {
        next: 0,
        skip_below: 0,
        want,
        f,
        failure: None,
    };
    if path.extension().is_some_and(|ext| ext == "json") {
        if text.trim().is_empty() {
            return Ok(());
        }
        return decode_document(&Json(text), &mut sink).map_err(|reason| fail(1, reason));
    }
    for doc in yaml_documents(text) {
        decode_document(&Yaml(&doc.0), &mut sink).map_err(|reason| fail(doc.0.index, reason))?;
    }
    Ok(())
}

/// One document of a YAML file that holds something (see [`yaml_documents`]).
#[derive(Debug)]
pub struct YamlDocument<'a>(Document<'a>);

impl<'a> YamlDocument<'a> {
    /// The document's text (without its `---` marker).
    pub fn text(&self) -> &'a str {
        self.0.text
    }
}

/// The documents of a YAML file that [`for_each_object`] decodes, in file order: those that
/// hold something other than whitespace and comments. Decoding each with
/// [`for_each_object_in`] finds what decoding the file finds, object for object: a document's
/// objects depend on its text alone.
pub fn yaml_documents(text: &str) -> Vec<YamlDocument<'_>> {
    split_documents(text)
        .into_iter()
        .filter(|doc| !is_blank(doc.text))
        .map(YamlDocument)
        .collect()
}

/// Decodes one document of the YAML file `path` as [`for_each_object`] decodes it within the
/// file: the ordinals passed to `want` and `f` count from 0 within the document, and an error
/// names the document and the line as they are in the file.
pub fn for_each_object_in(
    path: &Path,
    doc: &YamlDocument<'_>,
    want: &mut dyn FnMut(usize) -> bool,
    f: &mut dyn FnMut(usize, Object),
) -> Result<(), SourceError> {
    let mut sink = Sink {
        next: 0,
        skip_below: 0,
        want,
        f,
        failure: None,
    };
    decode_document(&Yaml(&doc.0), &mut sink).map_err(|reason| SourceError::ManifestParse {
        path: path.to_path_buf(),
        document: doc.0.index,
        reason,
    })
}

/// Where decoded objects go: counts ordinals and asks whether each one is wanted.
struct Sink<'a> {
    next: usize,
    /// Ordinals below this were passed on already (by a one-pass try that then gave up).
    skip_below: usize,
    want: &'a mut dyn FnMut(usize) -> bool,
    f: &'a mut dyn FnMut(usize, Object),
    /// Why decoding stopped inside a list, when it was not the syntax.
    failure: Option<String>,
}

impl Sink<'_> {
    /// Takes the next ordinal; whether its object is wanted.
    fn take(&mut self) -> (usize, bool) {
        let n = self.next;
        self.next += 1;
        (n, n >= self.skip_below && (self.want)(n))
    }
}

/// One document's text in one syntax.
trait Syntax {
    /// Runs `seed` over the whole document, checking that nothing follows it.
    fn run<T, S>(&self, seed: S) -> Result<T, String>
    where
        S: for<'de> DeserializeSeed<'de, Value = T>;

    /// Decodes the whole document as a `T`.
    fn typed<T: de::DeserializeOwned>(&self) -> Result<T, String>;

    /// The reason for a syntax error met while reading the document.
    fn syntax_error(&self, err: String) -> String;
}

/// A JSON document.
struct Json<'a>(&'a str);

impl Syntax for Json<'_> {
    fn run<T, S>(&self, seed: S) -> Result<T, String>
    where
        S: for<'de> DeserializeSeed<'de, Value = T>,
    {
        let mut de = serde_json::Deserializer::from_str(self.0);
        let value = seed.deserialize(&mut de).map_err(|e| e.to_string())?;
        de.end().map_err(|e| e.to_string())?;
        Ok(value)
    }

    fn typed<T: de::DeserializeOwned>(&self) -> Result<T, String> {
        serde_json::from_str(self.0).map_err(|e| e.to_string())
    }

    fn syntax_error(&self, err: String) -> String {
        format!("invalid JSON: {err}")
    }
}

/// A YAML document within a file.
struct Yaml<'a, 'b>(&'b Document<'a>);

impl Yaml<'_, '_> {
    /// One line, without a source snippet: errors go into a log line.
    fn options() -> serde_saphyr::Options {
        serde_saphyr::options! { with_snippet: false }
    }

    /// The document with the lines before it blanked out, so that error line numbers count from
    /// the top of the file. Only built on error paths, to keep parsing linear.
    fn padded(&self) -> String {
        format!("{}{}", "\n".repeat(self.0.first_line - 1), self.0.text)
    }
}

impl Syntax for Yaml<'_, '_> {
    fn run<T, S>(&self, seed: S) -> Result<T, String>
    where
        S: for<'de> DeserializeSeed<'de, Value = T>,
    {
        serde_saphyr::with_deserializer_from_str_with_options(self.0.text, Self::options(), |de| {
            seed.deserialize(de)
        })
        .map_err(|e| e.to_string())
    }

    fn typed<T: de::DeserializeOwned>(&self) -> Result<T, String> {
        match serde_saphyr::from_str_with_options(self.0.text, Self::options()) {
            Ok(v) => Ok(v),
            // Again from the top of the file, for the line number.
            Err(err) => Err(
                match serde_saphyr::from_str_with_options::<T>(&self.padded(), Self::options()) {
                    Err(err) => err.to_string(),
                    Ok(_) => err.to_string(),
                },
            ),
        }
    }

    fn syntax_error(&self, _err: String) -> String {
        let options = Self::options();
        match serde_saphyr::from_str_with_options::<IgnoredAny>(&self.padded(), options) {
            Err(err) => format!("invalid YAML: {err}"),
            Ok(_) => "invalid YAML".to_string(),
        }
    }
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

/// Splits a YAML file's text into pieces of whole documents, each about `piece_bytes` long or
/// less, each but the first starting at a `---` line (see [`split_documents`]). Decoding the
/// pieces one after another finds the documents that decoding the whole text finds, in the
/// same order (numbering each piece's documents and lines from its own start, though).
pub fn split_yaml(text: &str, piece_bytes: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let (mut start, mut offset) = (0, 0);
    for line in text.split_inclusive('\n') {
        let content = line.trim_end_matches(['\n', '\r']);
        if offset - start >= piece_bytes && marker_rest(content, "---").is_some() {
            pieces.push(&text[start..offset]);
            start = offset;
        }
        offset += line.len();
    }
    pieces.push(&text[start..]);
    pieces
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

/// Decodes one document (an object or a list of objects) into `sink`.
///
/// Tries the one-pass decoder first ([`FastDoc`]); if it gives up (an error anywhere, or a
/// list whose type comes after its items), the document is decoded again by the two passes
/// below, which give the canonical result and error. Objects the first try already passed on
/// are not passed on again.
fn decode_document(doc: &impl Syntax, sink: &mut Sink<'_>) -> Result<(), String> {
    let start = sink.next;
    if !(sink.want)(start) {
        // Its (first) object is not wanted: the two passes skip an unwanted object after
        // reading only its type, where one pass would decode it in full.
        return decode_document_slowly(doc, sink);
    }
    if doc.run(FastDoc { sink: &mut *sink }).is_ok() {
        return Ok(());
    }
    let passed_on = sink.next;
    sink.next = start;
    let skip = std::mem::replace(&mut sink.skip_below, passed_on);
    let result = decode_document_slowly(doc, sink);
    sink.skip_below = skip;
    result
}

/// Decodes one document in two passes: its type first, then its objects.
fn decode_document_slowly(doc: &impl Syntax, sink: &mut Sink<'_>) -> Result<(), String> {
    // First pass: the document's type, skipping everything else (this also checks the syntax).
    let (api_version, kind) = match doc.run(ProbeSeed).map_err(|e| doc.syntax_error(e))? {
        Probe::Null => return Ok(()),
        Probe::NotMapping => return Err("not a mapping".into()),
        Probe::Mapping { api_version, kind } => type_of(api_version, kind, None)?,
    };
    let item_type = match list_item_type(&api_version, &kind) {
        Some(item_type) => item_type,
        None => {
            let (n, wanted) = sink.take();
            if wanted {
                let obj = decode_typed(doc, &api_version, &kind)?;
                (sink.f)(n, obj);
            }
            return Ok(());
        }
    };
    // Second pass: the items, one at a time.
    sink.failure = None;
    let seed = ListSeed {
        kind: &kind,
        item_type,
        sink,
    };
    match doc.run(seed) {
        Ok(()) => Ok(()),
        Err(err) => Err(sink.failure.take().unwrap_or_else(|| doc.syntax_error(err))),
    }
}

/// If `kind` (of `api_version`) is a list, the type its items default to: `Some(None)` for a
/// v1 `List`, whose items name their own.
fn list_item_type(api_version: &str, kind: &str) -> Option<Option<(&'static str, &'static str)>> {
    Some(match (api_version, kind) {
        (CORE_V1, "List") => None,
        (CORE_V1, "ServiceList") => Some((CORE_V1, "Service")),
        (DISCOVERY_V1, "EndpointSliceList") => Some((DISCOVERY_V1, "EndpointSlice")),
        (CORE_V1, "EndpointsList") => Some((CORE_V1, "Endpoints")),
        (CORE_V1, "NodeList") => Some((CORE_V1, "Node")),
        (NETWORKING_V1, "ServiceCIDRList") => Some((NETWORKING_V1, "ServiceCIDR")),
        _ => return None,
    })
}

/// Checks `apiVersion` and `kind` (falling back to `default`, for the items of a typed list).
fn type_of(
    api_version: Option<Value>,
    kind: Option<Value>,
    default: Option<(&str, &str)>,
) -> Result<(String, String), String> {
    let field = |name: &str, v: Option<Value>| -> Result<Option<String>, String> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(format!("{name} is not a string")),
        }
    };
    match (
        field("apiVersion", api_version)?,
        field("kind", kind)?,
        default,
    ) {
        (Some(api_version), Some(kind), _) => Ok((api_version, kind)),
        (None, None, Some((api_version, kind))) => Ok((api_version.into(), kind.into())),
        _ => Err("apiVersion and kind are required".into()),
    }
}

fn unsupported(api_version: &str, kind: &str) -> String {
    format!(
        "unsupported kind {kind:?} (apiVersion {api_version:?}); expected v1 Service, \
         discovery.k8s.io/v1 EndpointSlice, v1 Endpoints, v1 Node, networking.k8s.io/v1 \
         ServiceCIDR or a list of them"
    )
}

/// Decodes a whole document as the object its type names.
fn decode_typed(doc: &impl Syntax, api_version: &str, kind: &str) -> Result<Object, String> {
    let obj = match (api_version, kind) {
        (CORE_V1, "Service") => Object::Service(Box::new(
            doc.typed::<Service>()
                .map_err(|err| format!("Service: {err}"))?,
        )),
        (DISCOVERY_V1, "EndpointSlice") => Object::EndpointSlice(Box::new(
            doc.typed::<EndpointSlice>()
                .map_err(|err| format!("EndpointSlice: {err}"))?,
        )),
        (CORE_V1, "Endpoints") => Object::Endpoints(Box::new(
            doc.typed::<Endpoints>()
                .map_err(|err| format!("Endpoints: {err}"))?,
        )),
        (CORE_V1, "Node") => Object::Node(Box::new(
            doc.typed::<Node>().map_err(|err| format!("Node: {err}"))?,
        )),
        (NETWORKING_V1, "ServiceCIDR") => Object::ServiceCidr(Box::new(
            doc.typed::<ServiceCIDR>()
                .map_err(|err| format!("ServiceCIDR: {err}"))?,
        )),
        _ => return Err(unsupported(api_version, kind)),
    };
    named(obj, kind)
}

fn named(obj: Object, kind: &str) -> Result<Object, String> {
    if obj.key().name.is_empty() {
        return Err(format!("{kind}: metadata.name is required"));
    }
    Ok(obj)
}

/// Decodes one list item.
fn decode_item(value: Value, default: Option<(&str, &str)>) -> Result<Object, String> {
    let (api_version, kind) = match &value {
        Value::Object(map) => type_of(
            map.get("apiVersion").cloned(),
            map.get("kind").cloned(),
            default,
        )?,
        _ => return Err("not a mapping".into()),
    };
    let obj = match (api_version.as_str(), kind.as_str()) {
        (CORE_V1, "Service") => Object::Service(Box::new(
            serde_json::from_value::<Service>(value).map_err(|err| format!("Service: {err}"))?,
        )),
        (DISCOVERY_V1, "EndpointSlice") => Object::EndpointSlice(Box::new(
            serde_json::from_value::<EndpointSlice>(value)
                .map_err(|err| format!("EndpointSlice: {err}"))?,
        )),
        (CORE_V1, "Endpoints") => Object::Endpoints(Box::new(
            serde_json::from_value::<Endpoints>(value)
                .map_err(|err| format!("Endpoints: {err}"))?,
        )),
        (CORE_V1, "Node") => Object::Node(Box::new(
            serde_json::from_value::<Node>(value).map_err(|err| format!("Node: {err}"))?,
        )),
        (NETWORKING_V1, "ServiceCIDR") => Object::ServiceCidr(Box::new(
            serde_json::from_value::<ServiceCIDR>(value)
                .map_err(|err| format!("ServiceCIDR: {err}"))?,
        )),
        _ => return Err(unsupported(&api_version, &kind)),
    };
    named(obj, &kind)
}

/// What the first pass over a document found.
enum Probe {
    /// An empty document.
    Null,
    /// Something other than a mapping.
    NotMapping,
    /// A mapping, with its type fields (as written; checked later).
    Mapping {
        api_version: Option<Value>,
        kind: Option<Value>,
    },
}

/// The map keys the passes look at.
enum Field {
    ApiVersion,
    Kind,
    Items,
    Metadata,
    Spec,
    Status,
    AddressType,
    Endpoints,
    Ports,
    Subsets,
    Other,
}

struct FieldSeed;

impl<'de> DeserializeSeed<'de> for FieldSeed {
    type Value = Field;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Field, D::Error> {
        d.deserialize_str(FieldSeed)
    }
}

impl<'de> Visitor<'de> for FieldSeed {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
        Ok(match v {
            "apiVersion" => Field::ApiVersion,
            "kind" => Field::Kind,
            "items" => Field::Items,
            "metadata" => Field::Metadata,
            "spec" => Field::Spec,
            "status" => Field::Status,
            "addressType" => Field::AddressType,
            "endpoints" => Field::Endpoints,
            "ports" => Field::Ports,
            "subsets" => Field::Subsets,
            _ => Field::Other,
        })
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Field, E> {
        Ok(Field::Other)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Field, E> {
        Ok(Field::Other)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Field, E> {
        Ok(Field::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Field, E> {
        Ok(Field::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Field, E> {
        Ok(Field::Other)
    }
}

/// The first pass: the document's shape and type fields.
struct ProbeSeed;

impl<'de> DeserializeSeed<'de> for ProbeSeed {
    type Value = Probe;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Probe, D::Error> {
        d.deserialize_any(ProbeSeed)
    }
}

impl<'de> Visitor<'de> for ProbeSeed {
    type Value = Probe;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a manifest")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Probe, A::Error> {
        let (mut api_version, mut kind) = (None, None);
        while let Some(field) = map.next_key_seed(FieldSeed)? {
            match field {
                Field::ApiVersion => api_version = Some(map.next_value::<Value>()?),
                Field::Kind => kind = Some(map.next_value::<Value>()?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Probe::Mapping { api_version, kind })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Probe, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Probe::NotMapping)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Probe, E> {
        Ok(Probe::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Probe, E> {
        Ok(Probe::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Probe, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Probe, E> {
        Ok(Probe::NotMapping)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Probe, E> {
        Ok(Probe::NotMapping)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Probe, E> {
        Ok(Probe::NotMapping)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Probe, E> {
        Ok(Probe::NotMapping)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Probe, E> {
        Ok(Probe::NotMapping)
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Probe, E> {
        Ok(Probe::NotMapping)
    }
}

/// The second pass over a list: each item decoded and handed on as soon as it is read.
struct ListSeed<'s, 'a> {
    kind: &'s str,
    item_type: Option<(&'static str, &'static str)>,
    sink: &'s mut Sink<'a>,
}

impl<'de> DeserializeSeed<'de> for ListSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ListSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let ListSeed {
            kind,
            item_type,
            sink,
        } = self;
        while let Some(field) = map.next_key_seed(FieldSeed)? {
            match field {
                Field::Items => map.next_value_seed(ItemsSeed {
                    kind,
                    item_type,
                    sink: &mut *sink,
                    fast: false,
                })?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// A list's `items`.
struct ItemsSeed<'s, 'a> {
    kind: &'s str,
    item_type: Option<(&'static str, &'static str)>,
    sink: &'s mut Sink<'a>,
    /// Decode each item in one pass ([`FastObject`]), failing without a reason at the first
    /// problem, rather than through a tree with the reason recorded.
    fast: bool,
}

impl<'de> DeserializeSeed<'de> for ItemsSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl ItemsSeed<'_, '_> {
    fn not_a_sequence<E: de::Error>(self) -> Result<(), E> {
        self.sink.failure = Some(format!("{}: items is not a sequence", self.kind));
        Err(E::custom("items is not a sequence"))
    }
}

impl<'de> Visitor<'de> for ItemsSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence of objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0;
        loop {
            i += 1;
            let (n, wanted) = self.sink.take();
            if !wanted {
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    self.sink.next -= 1;
                    return Ok(());
                }
                continue;
            }
            if self.fast {
                let seed = FastObject {
                    default: self.item_type.and_then(|(a, k)| ObjType::of(a, k)),
                    items: None,
                };
                match seq.next_element_seed(seed) {
                    Ok(Some(Decoded::Object(obj))) => (self.sink.f)(n, obj),
                    Ok(None) => {
                        self.sink.next -= 1;
                        return Ok(());
                    }
                    // Not passed on: the two passes that take over decode it again.
                    Ok(Some(_)) => {
                        self.sink.next = n;
                        return Err(give_up());
                    }
                    Err(err) => {
                        self.sink.next = n;
                        return Err(err);
                    }
                }
                continue;
            }
            let Some(value) = seq.next_element::<Value>()? else {
                self.sink.next -= 1;
                return Ok(());
            };
            match decode_item(value, self.item_type) {
                Ok(obj) => (self.sink.f)(n, obj),
                Err(reason) => {
                    self.sink.failure = Some(format!("item {i}: {reason}"));
                    return Err(de::Error::custom("bad item"));
                }
            }
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        self.not_a_sequence()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.not_a_sequence()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.not_a_sequence()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.not_a_sequence()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.not_a_sequence()
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.not_a_sequence()
    }
}

/// The object types a manifest may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ObjType {
    Service,
    EndpointSlice,
    Endpoints,
    Node,
    ServiceCidr,
}

impl ObjType {
    fn of(api_version: &str, kind: &str) -> Option<ObjType> {
        Some(match (api_version, kind) {
            (CORE_V1, "Service") => ObjType::Service,
            (DISCOVERY_V1, "EndpointSlice") => ObjType::EndpointSlice,
            (CORE_V1, "Endpoints") => ObjType::Endpoints,
            (CORE_V1, "Node") => ObjType::Node,
            (NETWORKING_V1, "ServiceCIDR") => ObjType::ServiceCidr,
            _ => return None,
        })
    }

    fn kind(self) -> &'static str {
        match self {
            ObjType::Service => "Service",
            ObjType::EndpointSlice => "EndpointSlice",
            ObjType::Endpoints => "Endpoints",
            ObjType::Node => "Node",
            ObjType::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// The one-pass decoder of a whole document: an object, decoded field by field as the
/// k8s-openapi types decode themselves, or a list whose items are decoded the same way and
/// passed on as they are read.
///
/// It gives up (fails, with no useful reason) rather than decide anything the two-pass decoder
/// would decide differently: at any error, and at a list's `items` met before the list's type.
/// So whatever it accepts, the two passes would have accepted with the same objects, and what
/// it rejects goes to them for the verdict and its wording.
struct FastDoc<'s, 'a> {
    sink: &'s mut Sink<'a>,
}

impl<'de> DeserializeSeed<'de> for FastDoc<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        let decoded = FastObject {
            default: None,
            items: Some(self.sink),
        }
        .deserialize(d)?;
        match decoded {
            Decoded::Empty | Decoded::List => Ok(()),
            Decoded::Object(obj) => {
                let (n, wanted) = self.sink.take();
                if wanted {
                    (self.sink.f)(n, obj);
                }
                Ok(())
            }
        }
    }
}

/// What [`FastObject`] decoded.
enum Decoded {
    /// An empty document.
    Empty,
    /// A list, whose items went to the sink.
    List,
    Object(Object),
}

/// Decodes one mapping in one pass: a document (with `items` set: a list's items go there) or
/// a list item (`default`: its list's item type, if the list has one).
///
/// The type is taken from `apiVersion` and `kind` when both come before the fields that depend
/// on it, as they do in what people and `kubectl` write; the fields only EndpointSlices have
/// are decoded as such whenever they come; `spec` or `status` before the type is held as a tree
/// until the type is known.
struct FastObject<'s, 'a> {
    default: Option<ObjType>,
    items: Option<&'s mut Sink<'a>>,
}

impl<'de> DeserializeSeed<'de> for FastObject<'_, '_> {
    type Value = Decoded;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Decoded, D::Error> {
        d.deserialize_any(self)
    }
}

/// The typed `spec` and `status` of an object being decoded. One at a time lives on the stack
/// while its object is decoded, so its variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Body {
    Service(Option<ServiceSpec>, Option<ServiceStatus>),
    Node(Option<NodeSpec>, Option<NodeStatus>),
    ServiceCidr(Option<ServiceCIDRSpec>, Option<ServiceCIDRStatus>),
    /// EndpointSlices and Endpoints have neither.
    None,
}

impl Body {
    fn new(ty: ObjType) -> Body {
        match ty {
            ObjType::Service => Body::Service(None, None),
            ObjType::Node => Body::Node(None, None),
            ObjType::ServiceCidr => Body::ServiceCidr(None, None),
            ObjType::EndpointSlice | ObjType::Endpoints => Body::None,
        }
    }

    /// Decodes the next value as the `spec` (or `status`) of this type.
    fn next<'de, A: MapAccess<'de>>(&mut self, map: &mut A, spec: bool) -> Result<(), A::Error> {
        match (self, spec) {
            (Body::Service(s, _), true) => *s = map.next_value()?,
            (Body::Service(_, s), false) => *s = map.next_value()?,
            (Body::Node(s, _), true) => *s = map.next_value()?,
            (Body::Node(_, s), false) => *s = map.next_value()?,
            (Body::ServiceCidr(s, _), true) => *s = map.next_value()?,
            (Body::ServiceCidr(_, s), false) => *s = map.next_value()?,
            (Body::None, _) => {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }

    /// Sets the `spec` (or `status`) of this type from a tree.
    fn set<E: de::Error>(&mut self, value: Value, spec: bool) -> Result<(), E> {
        fn from<T: de::DeserializeOwned, E: de::Error>(v: Value) -> Result<T, E> {
            serde_json::from_value(v).map_err(E::custom)
        }
        match (self, spec) {
            (Body::Service(s, _), true) => *s = from(value)?,
            (Body::Service(_, s), false) => *s = from(value)?,
            (Body::Node(s, _), true) => *s = from(value)?,
            (Body::Node(_, s), false) => *s = from(value)?,
            (Body::ServiceCidr(s, _), true) => *s = from(value)?,
            (Body::ServiceCidr(_, s), false) => *s = from(value)?,
            (Body::None, _) => {}
        }
        Ok(())
    }
}

/// Gives up the one-pass decoding.
fn give_up<E: de::Error>() -> E {
    E::custom("left to the two-pass decoder")
}

impl<'de> Visitor<'de> for FastObject<'_, '_> {
    type Value = Decoded;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a manifest")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Decoded, E> {
        match self.items {
            Some(_) => Ok(Decoded::Empty),
            None => Err(give_up()),
        }
    }

    fn visit_none<E: de::Error>(self) -> Result<Decoded, E> {
        self.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Decoded, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Decoded, A::Error> {
        let FastObject { default, mut items } = self;
        let (mut api_version, mut kind) = (None::<Value>, None::<Value>);
        // The type, once known (or assumed from `default`), and whether the document is a list.
        let mut ty: Option<ObjType> = None;
        let mut list = false;
        let mut body = Body::None;
        let mut metadata: Option<ObjectMeta> = None;
        let mut address_type: Option<String> = None;
        let mut endpoints: Option<Vec<Endpoint>> = None;
        let mut ports: Option<Vec<EndpointPort>> = None;
        let mut subsets: Option<Vec<EndpointSubset>> = None;
        // `spec` and `status` met before the type.
        let (mut early_spec, mut early_status) = (None::<Value>, None::<Value>);
        // Settles the type from `apiVersion` and `kind` (or the default) when both are known.
        let settle = |api_version: &Option<Value>,
                      kind: &Option<Value>|
         -> Result<Option<(Option<ObjType>, bool)>, ()> {
            let as_str = |v: &Option<Value>| match v {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                None => Ok(None),
                Some(_) => Err(()),
            };
            match (as_str(api_version)?, as_str(kind)?) {
                (Some(a), Some(k)) => match ObjType::of(&a, &k) {
                    Some(t) => Ok(Some((Some(t), false))),
                    None if list_item_type(&a, &k).is_some() => Ok(Some((None, true))),
                    None => Err(()),
                },
                _ => Ok(None),
            }
        };
        while let Some(field) = map.next_key_seed(FieldSeed)? {
            match field {
                Field::ApiVersion => api_version = Some(map.next_value()?),
                Field::Kind => kind = Some(map.next_value()?),
                Field::Metadata if !list => metadata = map.next_value()?,
                Field::AddressType if ty.is_none_or(|t| t == ObjType::EndpointSlice) && !list => {
                    address_type = map.next_value()?
                }
                Field::Endpoints if ty.is_none_or(|t| t == ObjType::EndpointSlice) && !list => {
                    endpoints = map.next_value()?
                }
                Field::Ports if ty.is_none_or(|t| t == ObjType::EndpointSlice) && !list => {
                    ports = map.next_value()?
                }
                Field::Subsets if ty.is_none_or(|t| t == ObjType::Endpoints) && !list => {
                    subsets = map.next_value()?
                }
                Field::Spec | Field::Status | Field::Items => {
                    if ty.is_none() && !list {
                        match settle(&api_version, &kind).map_err(|()| give_up())? {
                            Some((t, l)) => (ty, list) = (t, l),
                            None => {
                                if let (Some(t), Field::Spec | Field::Status) = (default, &field) {
                                    ty = Some(t);
                                }
                            }
                        }
                        if let Some(t) = ty {
                            body = Body::new(t);
                            for (early, spec) in
                                [(early_spec.take(), true), (early_status.take(), false)]
                            {
                                if let Some(v) = early {
                                    body.set(v, spec)?;
                                }
                            }
                        }
                    }
                    match field {
                        Field::Items if list => {
                            let Some(sink) = items.as_deref_mut() else {
                                return Err(give_up());
                            };
                            let (a, k) = match (&api_version, &kind) {
                                (Some(Value::String(a)), Some(Value::String(k))) => (a, k),
                                _ => return Err(give_up()),
                            };
                            let item_type = list_item_type(a, k).ok_or_else(give_up)?;
                            map.next_value_seed(ItemsSeed {
                                kind: k,
                                item_type,
                                sink,
                                fast: true,
                            })?;
                        }
                        // Items before the type: only a second pass can tell what they are.
                        Field::Items if ty.is_none() && items.is_some() => return Err(give_up()),
                        Field::Spec | Field::Status if ty.is_some() => {
                            body.next(&mut map, matches!(field, Field::Spec))?
                        }
                        Field::Spec if !list => early_spec = Some(map.next_value()?),
                        Field::Status if !list => early_status = Some(map.next_value()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        // The type, as the two passes decide it (which also fail a type field that is there
        // but not a string).
        let non_string = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_string());
        if non_string(&api_version) || non_string(&kind) {
            return Err(give_up());
        }
        let (a, k) = type_of(
            api_version,
            kind,
            default.map(|t| match t {
                ObjType::Service => (CORE_V1, "Service"),
                ObjType::EndpointSlice => (DISCOVERY_V1, "EndpointSlice"),
                ObjType::Endpoints => (CORE_V1, "Endpoints"),
                ObjType::Node => (CORE_V1, "Node"),
                ObjType::ServiceCidr => (NETWORKING_V1, "ServiceCIDR"),
            }),
        )
        .map_err(|_| give_up())?;
        if items.is_some() && list_item_type(&a, &k).is_some() {
            // A list (perhaps without items): its items, if any, went to the sink.
            return if list || ty.is_none() {
                Ok(Decoded::List)
            } else {
                Err(give_up())
            };
        }
        let final_ty = ObjType::of(&a, &k).ok_or_else(give_up)?;
        if list || ty.is_some_and(|t| t != final_ty) {
            return Err(give_up());
        }
        if ty.is_none() {
            body = Body::new(final_ty);
            for (early, spec) in [(early_spec, true), (early_status, false)] {
                if let Some(v) = early {
                    body.set(v, spec)?;
                }
            }
        }
        let metadata = metadata.unwrap_or_default();
        let obj = match (final_ty, body) {
            (ObjType::Service, Body::Service(spec, status)) => Object::Service(Box::new(Service {
                metadata,
                spec,
                status,
            })),
            (ObjType::Node, Body::Node(spec, status)) => Object::Node(Box::new(Node {
                metadata,
                spec,
                status,
            })),
            (ObjType::ServiceCidr, Body::ServiceCidr(spec, status)) => {
                Object::ServiceCidr(Box::new(ServiceCIDR {
                    metadata,
                    spec,
                    status,
                }))
            }
            (ObjType::EndpointSlice, Body::None) => {
                Object::EndpointSlice(Box::new(EndpointSlice {
                    metadata,
                    address_type: address_type.unwrap_or_default(),
                    endpoints,
                    ports,
                }))
            }
            (ObjType::Endpoints, Body::None) => {
                Object::Endpoints(Box::new(Endpoints { metadata, subsets }))
            }
            _ => return Err(give_up()),
        };
        Ok(Decoded::Object(
            named(obj, final_ty.kind()).map_err(|_| give_up())?,
        ))
    }
}

/// A digest of an object's content: equal objects have equal digests, and different ones
/// (practically) never do. 128 bits, from two SipHash runs over the object's JSON; two `u64`s
/// rather than a `u128`, whose 16-byte alignment would pad every record that holds one.
pub type Digest = [u64; 2];

/// The digest of `obj`.
pub fn digest(obj: &Object) -> Digest {
    let mut w = DigestWriter(DefaultHasher::new(), DefaultHasher::new());
    w.0.write_u8(1);
    w.1.write_u8(2);
    // Serializing these types into a writer that cannot fail does not fail.
    let _ = match obj {
        Object::Service(s) => s.serialize(&mut serde_json::Serializer::new(&mut w)),
        Object::EndpointSlice(s) => s.serialize(&mut serde_json::Serializer::new(&mut w)),
        Object::Endpoints(e) => e.serialize(&mut serde_json::Serializer::new(&mut w)),
        Object::Node(n) => n.serialize(&mut serde_json::Serializer::new(&mut w)),
        Object::ServiceCidr(c) => c.serialize(&mut serde_json::Serializer::new(&mut w)),
    };
    [w.0.finish(), w.1.finish()]
}

/// The digest of a file's text.
pub fn text_digest(text: &str) -> Digest {
    let (mut a, mut b) = (DefaultHasher::new(), DefaultHasher::new());
    a.write_u8(1);
    b.write_u8(2);
    a.write(text.as_bytes());
    b.write(text.as_bytes());
    [a.finish(), b.finish()]
}

struct DigestWriter(DefaultHasher, DefaultHasher);

impl io::Write for DigestWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf);
        self.1.write(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Identifies an object across files.
pub type Key = (Kind, ObjectKey);

/// Identifies a file within a [`ManifestSet`].
type FileId = u32;

/// One object as one file holds it.
#[derive(Clone, Copy, Debug)]
struct Holder {
    file: FileId,
    /// When this version of the object appeared in this file: a counter over the whole set.
    /// Where several files hold the same object, the latest version wins.
    generation: u64,
    digest: Digest,
    /// Its position among the file's objects, to find it again.
    ordinal: u32,
}

/// What the consumer has been told about an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reported {
    /// Nothing, or that it is gone.
    Nothing,
    /// This version.
    Version(Digest),
    /// Some version, but not which: the next version that wins is reported whatever it is.
    Unknown,
}

#[derive(Debug)]
struct KeyState {
    /// The files holding the object (almost always one).
    holders: Vec<Holder>,
    reported: Reported,
}

/// A file the set knows about.
#[derive(Debug)]
struct FileState {
    id: FileId,
    /// The objects of its last good parse.
    keys: Vec<Arc<Key>>,
}

/// An object to report from a file's text: (ordinal in the file, key).
pub type Wanted = (u32, Arc<Key>);

/// Which file holds which object, as of each file's last good parse, and what has been
/// reported from them. Holds keys and digests only, never the objects themselves.
///
/// The objects of a file are reported as the file is read: [`ManifestSet::update_file`] says
/// which of them to send. Objects that lose their file (it went, or no longer holds them) are
/// settled at the end of a round of changes by [`ManifestSet::settle`], so an object that moves
/// between files (a rename) is never reported as deleted in between. An object held by several
/// files is reported as the version that appeared most recently (last writer wins), with a
/// warning.
#[derive(Debug, Default)]
pub struct ManifestSet {
    keys: HashMap<Arc<Key>, KeyState>,
    files: BTreeMap<PathBuf, FileState>,
    paths: HashMap<FileId, PathBuf>,
    next_file: FileId,
    generation: u64,
    /// Objects to settle at the end of the round.
    pending: BTreeSet<Arc<Key>>,
}

/// What [`ManifestSet::settle`] leaves to report.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Settled {
    /// Objects no file holds any more.
    pub deleted: Vec<Key>,
    /// Objects now won by a version in another file, which must be read again to report it:
    /// file → (ordinal, key), by ordinal.
    pub reread: BTreeMap<PathBuf, Vec<Wanted>>,
}

impl ManifestSet {
    /// An empty set.
    pub fn new() -> Self {
        ManifestSet::default()
    }

    fn file_id(&mut self, path: &Path) -> FileId {
        if let Some(f) = self.files.get(path) {
            return f.id;
        }
        let id = self.next_file;
        self.next_file += 1;
        self.files.insert(
            path.to_path_buf(),
            FileState {
                id,
                keys: Vec::new(),
            },
        );
        self.paths.insert(id, path.to_path_buf());
        id
    }

    /// Sets the objects of the file `path` (new or changed): each object's key and digest, in
    /// file order. Returns the objects to report now, by their ordinal in the file: those whose
    /// new version wins and differs from what was reported. They count as reported.
    pub fn update_file(&mut self, path: &Path, objects: Vec<(Key, Digest)>) -> Vec<Wanted> {
        self.update_file_keys(path, objects).0
    }

    /// [`ManifestSet::update_file`], also returning every object's key as the set shares it,
    /// by ordinal (a key held twice in the file, twice).
    pub fn update_file_keys(
        &mut self,
        path: &Path,
        objects: Vec<(Key, Digest)>,
    ) -> (Vec<Wanted>, Vec<Arc<Key>>) {
        let id = self.file_id(path);
        let old = self
            .files
            .get_mut(path)
            .map(|f| std::mem::take(&mut f.keys))
            .unwrap_or_default();
        // The file's previous versions, to keep their generation where unchanged.
        let mut previous: HashMap<Arc<Key>, Holder> = HashMap::with_capacity(old.len());
        for key in old {
            if let Some(state) = self.keys.get_mut(&key) {
                if let Some(i) = state.holders.iter().position(|h| h.file == id) {
                    previous.insert(key.clone(), state.holders.swap_remove(i));
                }
            }
            self.pending.insert(key);
        }
        // The last copy of a key within the file wins, as if the earlier ones were not there.
        let mut last: HashMap<&Key, usize> = HashMap::with_capacity(objects.len());
        for (i, (key, _)) in objects.iter().enumerate() {
            if last.insert(key, i).is_some() {
                warn!(
                    file = %path.display(),
                    "{} {} appears more than once in the file; using the last one",
                    key.0,
                    key.1
                );
            }
        }
        let last: BTreeSet<usize> = last.into_values().collect();
        let mut keys = Vec::with_capacity(last.len());
        let mut wanted = Vec::new();
        let mut by_ordinal = Vec::with_capacity(objects.len());
        for (ordinal, (key, digest)) in objects.into_iter().enumerate() {
            let key = match self.keys.get_key_value(&key) {
                Some((k, _)) => k.clone(),
                None => Arc::new(key),
            };
            by_ordinal.push(key.clone());
            if !last.contains(&ordinal) {
                continue;
            }
            let generation = match previous.get(&key) {
                Some(h) if h.digest == digest => h.generation,
                _ => {
                    self.generation += 1;
                    self.generation
                }
            };
            let holder = Holder {
                file: id,
                generation,
                digest,
                ordinal: ordinal as u32,
            };
            let state = self.keys.entry(key.clone()).or_insert(KeyState {
                holders: Vec::with_capacity(1),
                reported: Reported::Nothing,
            });
            state.holders.push(holder);
            if winner(&state.holders).is_some_and(|w| w.file == id)
                && state.reported != Reported::Version(digest)
            {
                state.reported = Reported::Version(digest);
                wanted.push((ordinal as u32, key.clone()));
            }
            if state.holders.len() == 1 {
                self.pending.remove(&key);
            } else {
                // Held elsewhere too: settle warns about the clash (and reports nothing more
                // if this version won).
                self.pending.insert(key.clone());
            }
            keys.push(key);
        }
        if let Some(f) = self.files.get_mut(path) {
            f.keys = keys;
        }
        (wanted, by_ordinal)
    }

    /// Forgets the file `path` (deleted). Its objects are settled by [`ManifestSet::settle`].
    pub fn remove_file(&mut self, path: &Path) {
        let Some(file) = self.files.remove(path) else {
            return;
        };
        self.paths.remove(&file.id);
        for key in file.keys {
            if let Some(state) = self.keys.get_mut(&key) {
                state.holders.retain(|h| h.file != file.id);
            }
            self.pending.insert(key);
        }
    }

    /// Settles the objects whose files changed under them in this round: deleted if no file
    /// holds them any more, or to be read again from the file whose version now wins. Both
    /// count as reported; see [`ManifestSet::not_reported`].
    pub fn settle(&mut self) -> Settled {
        let mut out = Settled::default();
        for key in std::mem::take(&mut self.pending) {
            let Some(state) = self.keys.get_mut(&key) else {
                continue;
            };
            let Some(win) = winner(&state.holders) else {
                if state.reported != Reported::Nothing {
                    out.deleted.push((*key).clone());
                }
                self.keys.remove(&key);
                continue;
            };
            if state.holders.len() > 1 {
                let files: Vec<String> = state
                    .holders
                    .iter()
                    .filter_map(|h| self.paths.get(&h.file))
                    .map(|p| p.display().to_string())
                    .collect();
                warn!(
                    files = ?files,
                    using = %self.paths.get(&win.file).map(|p| p.display().to_string()).unwrap_or_default(),
                    "{} {} is defined in several files; using the most recently changed",
                    key.0,
                    key.1
                );
            }
            if state.reported == Reported::Version(win.digest) {
                continue;
            }
            state.reported = Reported::Version(win.digest);
            if let Some(path) = self.paths.get(&win.file) {
                out.reread
                    .entry(path.clone())
                    .or_default()
                    .push((win.ordinal, key.clone()));
            }
        }
        for wanted in out.reread.values_mut() {
            wanted.sort();
        }
        out
    }

    /// Records that an object that was to be reported could not be (its file could not be
    /// read again): whatever version wins next is reported.
    pub fn not_reported(&mut self, key: &Key) {
        if let Some(state) = self.keys.get_mut(key) {
            state.reported = Reported::Unknown;
        }
    }

    /// The files currently holding a good parse.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.keys().map(PathBuf::as_path)
    }

    /// Number of distinct objects currently reported.
    pub fn len(&self) -> usize {
        self.keys
            .values()
            .filter(|s| s.reported != Reported::Nothing)
            .count()
    }

    /// Whether no object is currently reported.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The winning version among holders: the latest.
fn winner(holders: &[Holder]) -> Option<Holder> {
    holders.iter().max_by_key(|h| h.generation).copied()
}

#[cfg(test)]
mod tests;
