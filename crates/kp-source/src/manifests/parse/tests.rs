use std::path::Path;

use kp_core::track::{Kind, Object, ObjectKey, SourceEvent};

use super::{parse_file, split_documents, ManifestSet};
use crate::SourceError;

fn service(name: &str, port: u16) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: ns\n\
         spec:\n  clusterIP: 10.96.0.10\n  ports:\n  - port: {port}\n    protocol: TCP\n"
    )
}

const SLICE: &str = "\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: ns
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: [10.0.0.1]
  conditions: {ready: true}
ports:
- port: 8080
  protocol: TCP
";

const NODE: &str = "\
apiVersion: v1
kind: Node
metadata:
  name: node-1
  labels:
    topology.kubernetes.io/zone: zone-a
";

/// `Kind name` of each object, in order.
fn names(objects: &[Object]) -> Vec<String> {
    objects
        .iter()
        .map(|o| format!("{} {}", o.kind(), o.key()))
        .collect()
}

fn show(events: &[SourceEvent]) -> Vec<String> {
    events
        .iter()
        .map(|ev| match ev {
            SourceEvent::Upsert(obj) => format!("upsert {} {}", obj.kind(), obj.key()),
            SourceEvent::Delete(kind, key) => format!("delete {kind} {key}"),
            SourceEvent::Synced(kind) => format!("synced {kind}"),
        })
        .collect()
}

fn parse(name: &str, text: &str) -> Vec<Object> {
    match parse_file(Path::new(name), text) {
        Ok(objects) => objects,
        Err(err) => panic!("{name}: {err}"),
    }
}

/// Parses text expected to fail, returning (document, reason) and checking the error names
/// the file.
fn parse_err(name: &str, text: &str) -> (usize, String) {
    match parse_file(Path::new(name), text) {
        Err(err @ SourceError::ManifestParse { .. }) => {
            let shown = err.to_string();
            assert!(
                shown.contains(name),
                "error does not name the file: {shown}"
            );
            let SourceError::ManifestParse {
                path,
                document,
                reason,
            } = err
            else {
                unreachable!()
            };
            assert_eq!(path, Path::new(name));
            assert!(shown.contains(&format!("document {document}")), "{shown}");
            (document, reason)
        }
        Err(other) => panic!("unexpected error kind: {other}"),
        Ok(objects) => panic!("parsed, but should not: {:?}", names(&objects)),
    }
}

#[test]
fn a_yaml_file_may_hold_several_documents_of_every_kind() {
    let text = format!("{}---\n{SLICE}---\n{NODE}", service("web", 80));
    let objects = parse("/m/all.yaml", &text);
    assert_eq!(
        names(&objects),
        ["Service ns/web", "EndpointSlice ns/web-abc", "Node node-1"]
    );
    let Object::Service(svc) = &objects[0] else {
        panic!("not a Service")
    };
    let port = &svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .expect("ports")[0];
    assert_eq!(port.port, 80);
    let Object::EndpointSlice(slice) = &objects[1] else {
        panic!("not a slice")
    };
    assert_eq!(
        slice.endpoints.as_deref().expect("endpoints")[0].addresses,
        ["10.0.0.1"]
    );
}

#[test]
fn empty_documents_comments_and_end_markers_are_skipped() {
    let text = format!(
        "# leading comment\n---\n{}---\n# nothing here\n---\n...\n---\n{}...\n",
        service("a", 80),
        service("b", 81)
    );
    assert_eq!(
        names(&parse("x.yaml", &text)),
        ["Service ns/a", "Service ns/b"]
    );
    assert!(parse("empty.yaml", "").is_empty());
    assert!(parse("empty.json", "  \n").is_empty());
    assert!(parse("null.yaml", "~\n").is_empty());
}

#[test]
fn a_missing_namespace_means_default_and_nodes_have_none() {
    let text = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\n";
    let objects = parse("x.yaml", text);
    assert_eq!(
        objects[0].key(),
        ObjectKey {
            namespace: "default".into(),
            name: "web".into()
        }
    );
    assert_eq!(parse("n.yaml", NODE)[0].key().namespace, "");
}

#[test]
fn a_v1_list_holds_objects_of_any_supported_kind() {
    let text = "\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: ns}
- apiVersion: v1
  kind: Node
  metadata: {name: node-1}
";
    assert_eq!(
        names(&parse("list.yaml", text)),
        ["Service ns/web", "Node node-1"]
    );
}

#[test]
fn typed_lists_supply_the_kind_of_their_items() {
    let text = "\
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
metadata: {resourceVersion: '7'}
items:
- metadata: {name: s1, namespace: ns}
  addressType: IPv4
  endpoints: []
- metadata: {name: s2, namespace: ns}
  addressType: IPv6
  endpoints: []
";
    assert_eq!(
        names(&parse("slices.yaml", text)),
        ["EndpointSlice ns/s1", "EndpointSlice ns/s2"]
    );
}

#[test]
fn a_bad_list_item_is_named_by_document_and_item() {
    let text = format!(
        "{}---\napiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  \
         metadata: {{name: ok}}\n- apiVersion: v1\n  kind: Pod\n  metadata: {{name: p}}\n",
        service("a", 80)
    );
    let (document, reason) = parse_err("/m/list.yaml", &text);
    assert_eq!(document, 2);
    assert!(reason.contains("item 2"), "{reason}");
    assert!(reason.contains("Pod"), "{reason}");
}

#[test]
fn json_files_hold_one_object_or_list() {
    let text = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","namespace":"ns"},
                   "spec":{"ports":[{"port":443,"targetPort":"https"}]}}"#;
    assert_eq!(names(&parse("svc.json", text)), ["Service ns/web"]);
    let list = r#"{"apiVersion":"v1","kind":"List","items":[
        {"apiVersion":"v1","kind":"Node","metadata":{"name":"n1"}},
        {"apiVersion":"v1","kind":"Node","metadata":{"name":"n2"}}]}"#;
    assert_eq!(names(&parse("nodes.json", list)), ["Node n1", "Node n2"]);
}

#[test]
fn invalid_json_is_document_one() {
    let (document, reason) = parse_err("bad.json", r#"{"apiVersion": "v1", "#);
    assert_eq!(document, 1);
    assert!(reason.contains("invalid JSON"), "{reason}");
}

#[test]
fn bad_yaml_names_the_file_and_the_document() {
    // The third document has an unclosed flow sequence.
    let text = format!(
        "{}---\n{}---\napiVersion: v1\nkind: Service\nmetadata: {{name: [broken\n",
        service("a", 80),
        service("b", 81)
    );
    let (document, reason) = parse_err("/etc/kp/bad.yaml", &text);
    assert_eq!(document, 3);
    assert!(reason.starts_with("invalid YAML"), "{reason}");
}

#[test]
fn document_numbers_count_a_leading_comment_block_only_if_it_holds_something() {
    // `---` first: the comment before it is not a document, so the broken one is the second.
    let text = format!("# header\n---\n{}---\nkind: [\n", service("a", 80));
    assert_eq!(parse_err("x.yaml", &text).0, 2);
    // Without a leading marker the first document starts at the top.
    let text = format!("{}---\nkind: [\n", service("a", 80));
    assert_eq!(parse_err("x.yaml", &text).0, 2);
}

#[test]
fn yaml_error_lines_count_from_the_top_of_the_file() {
    let text = format!("{}---\nkind: [\n", service("a", 80));
    let (_, reason) = parse_err("x.yaml", &text);
    // The service takes 10 lines, the marker the 11th; the bad flow sequence starts on the 12th.
    let bad_line = text
        .lines()
        .position(|l| l.starts_with("kind: ["))
        .map(|i| i + 1);
    assert_eq!(bad_line, Some(12));
    assert!(reason.contains("line 12"), "no absolute line in {reason}");
    assert!(!reason.contains('\n'), "not one line: {reason}");
}

#[test]
fn unknown_kinds_fail_the_file() {
    let text = format!(
        "{}---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: d}}\n",
        service("a", 80)
    );
    let (document, reason) = parse_err("x.yaml", &text);
    assert_eq!(document, 2);
    assert!(reason.contains("Deployment"), "{reason}");
    // A known kind under the wrong apiVersion is just as unknown.
    let (_, reason) = parse_err(
        "x.yaml",
        "apiVersion: discovery.k8s.io/v1beta1\nkind: EndpointSlice\nmetadata: {name: s}\n",
    );
    assert!(reason.contains("v1beta1"), "{reason}");
}

#[test]
fn documents_without_type_or_name_or_with_wrong_fields_fail() {
    let (_, reason) = parse_err("x.yaml", "metadata: {name: web}\n");
    assert!(reason.contains("apiVersion and kind"), "{reason}");
    let (_, reason) = parse_err(
        "x.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {namespace: ns}\n",
    );
    assert!(reason.contains("metadata.name"), "{reason}");
    let (_, reason) = parse_err(
        "x.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {ports: [{port: eighty}]}\n",
    );
    assert!(reason.starts_with("Service:"), "{reason}");
    let (_, reason) = parse_err("x.yaml", "- just\n- a list\n");
    assert!(reason.contains("not a mapping"), "{reason}");
}

#[test]
fn splitting_keeps_text_after_the_marker_and_tracks_lines() {
    let docs = split_documents("a: 1\n--- {b: 2}\n---\nc: 3\n");
    let got: Vec<(usize, usize, &str)> = docs
        .iter()
        .map(|d| (d.index, d.first_line, d.text))
        .collect();
    assert_eq!(
        got,
        [(1, 1, "a: 1\n"), (2, 2, " {b: 2}\n"), (3, 3, "\nc: 3\n")]
    );
    // `----` and `---x` are not markers.
    assert_eq!(split_documents("a: |\n  x\n----: 1\n").len(), 1);
}

fn svc_obj(name: &str, port: u16) -> Object {
    parse("t.yaml", &service(name, port)).remove(0)
}

#[test]
fn set_reports_new_objects_then_only_changes() {
    let mut set = ManifestSet::new();
    let a = Path::new("/m/a.yaml");
    let out = set.update_file(a, vec![svc_obj("web", 80), svc_obj("db", 5432)]);
    assert_eq!(
        show(&out),
        ["upsert Service ns/db", "upsert Service ns/web"]
    );
    // Same content again: nothing to report.
    assert!(set
        .update_file(a, vec![svc_obj("web", 80), svc_obj("db", 5432)])
        .is_empty());
    // One of the two objects in the file changes, the other one goes.
    let out = set.update_file(a, vec![svc_obj("web", 8080)]);
    assert_eq!(
        show(&out),
        ["delete Service ns/db", "upsert Service ns/web"]
    );
    assert_eq!(set.len(), 1);
}

#[test]
fn a_deleted_file_deletes_its_objects() {
    let mut set = ManifestSet::new();
    let (a, b) = (Path::new("/m/a.yaml"), Path::new("/m/b.yaml"));
    set.update_file(
        a,
        parse("a.yaml", &format!("{}---\n{SLICE}", service("web", 80))),
    );
    set.update_file(b, parse("b.yaml", NODE));
    let out = set.remove_file(a);
    assert_eq!(
        show(&out),
        ["delete Service ns/web", "delete EndpointSlice ns/web-abc"]
    );
    assert_eq!(set.files().collect::<Vec<_>>(), [b]);
    assert!(set.remove_file(a).is_empty());
}

#[test]
fn an_object_in_two_files_follows_the_last_writer_and_survives_either_removal() {
    let mut set = ManifestSet::new();
    let (a, b) = (Path::new("/m/a.yaml"), Path::new("/m/b.yaml"));
    set.update_file(a, vec![svc_obj("web", 80)]);
    let out = set.update_file(b, vec![svc_obj("web", 81)]);
    assert_eq!(show(&out), ["upsert Service ns/web"]);
    // `a` changes something else: its unchanged copy of web does not win back.
    assert!(
        set.update_file(a, vec![svc_obj("web", 80), svc_obj("x", 1)])
            .len()
            == 1
    );
    // `b` is removed: `a`'s version is reported.
    let out = set.remove_file(b);
    let [SourceEvent::Upsert(Object::Service(svc))] = &out[..] else {
        panic!("unexpected {:?}", show(&out))
    };
    assert_eq!(
        svc.spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .expect("ports")[0]
            .port,
        80
    );
    assert!(set.remove_file(a).len() == 2);
    assert!(set.is_empty());
}

#[test]
fn a_rename_applied_at_once_reports_nothing() {
    let mut set = ManifestSet::new();
    let (a, b) = (Path::new("/m/a.yaml"), Path::new("/m/b.yaml"));
    set.update_file(a, vec![svc_obj("web", 80)]);
    let out = set.apply([
        (a.to_path_buf(), None),
        (b.to_path_buf(), Some(vec![svc_obj("web", 80)])),
    ]);
    assert!(out.is_empty(), "{:?}", show(&out));
    let out = set.apply([(b.to_path_buf(), None)]);
    assert_eq!(show(&out), ["delete Service ns/web"]);
}

#[test]
fn kinds_with_the_same_name_are_different_objects() {
    let mut set = ManifestSet::new();
    let node = parse(
        "n.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: web}\n",
    );
    let svc = parse(
        "s.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: ''}\n",
    );
    let mut objects = node;
    objects.extend(svc);
    let out = set.update_file(Path::new("/m/x.yaml"), objects);
    assert_eq!(out.len(), 2);
    let kinds: Vec<Kind> = out
        .iter()
        .map(|e| match e {
            SourceEvent::Upsert(o) => o.kind(),
            _ => panic!("not an upsert"),
        })
        .collect();
    assert_eq!(kinds, [Kind::Service, Kind::Node]);
}
