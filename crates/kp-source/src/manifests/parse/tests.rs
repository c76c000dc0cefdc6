use std::path::Path;

use kp_core::track::{Kind, Object, ObjectKey};

use super::{
    decode_document_slowly, digest, for_each_object, is_blank, parse_file, split_documents, Digest,
    FastDoc, Json, Key, ManifestSet, Settled, Sink, Syntax, Wanted, Yaml,
};
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

fn key(name: &str) -> Key {
    (
        Kind::Service,
        ObjectKey {
            namespace: "ns".into(),
            name: name.into(),
        },
    )
}

/// Objects to give the set: name and a version number standing in for the content.
fn objs(list: &[(&str, u64)]) -> Vec<(Key, Digest)> {
    list.iter().map(|(n, v)| (key(n), [*v, 0])).collect()
}

/// Names of the wanted objects, with their ordinals.
fn wanted(w: &[Wanted]) -> Vec<(u32, String)> {
    w.iter().map(|(n, k)| (*n, k.1.name.clone())).collect()
}

fn deleted(s: &Settled) -> Vec<String> {
    s.deleted.iter().map(|k| k.1.name.clone()).collect()
}

#[test]
fn set_reports_new_objects_then_only_changes() {
    let mut set = ManifestSet::new();
    let a = Path::new("/m/a.yaml");
    let out = set.update_file(a, objs(&[("web", 1), ("db", 1)]));
    assert_eq!(wanted(&out), [(0, "web".into()), (1, "db".into())]);
    assert_eq!(set.settle(), Settled::default());
    // Same content again: nothing to report.
    assert!(set
        .update_file(a, objs(&[("web", 1), ("db", 1)]))
        .is_empty());
    assert_eq!(set.settle(), Settled::default());
    // One of the two objects in the file changes, the other one goes.
    let out = set.update_file(a, objs(&[("web", 2)]));
    assert_eq!(wanted(&out), [(0, "web".into())]);
    let settled = set.settle();
    assert_eq!(deleted(&settled), ["db"]);
    assert!(settled.reread.is_empty());
    assert_eq!(set.len(), 1);
}

#[test]
fn the_last_copy_of_an_object_within_a_file_counts() {
    let mut set = ManifestSet::new();
    let a = Path::new("/m/a.yaml");
    let out = set.update_file(a, objs(&[("web", 1), ("db", 1), ("web", 2)]));
    assert_eq!(wanted(&out), [(1, "db".into()), (2, "web".into())]);
    assert_eq!(set.settle(), Settled::default());
    assert_eq!(set.len(), 2);
}

#[test]
fn a_deleted_file_deletes_its_objects() {
    let mut set = ManifestSet::new();
    let (a, b) = (Path::new("/m/a.yaml"), Path::new("/m/b.yaml"));
    set.update_file(a, objs(&[("web", 1), ("db", 1)]));
    set.update_file(b, objs(&[("x", 1)]));
    set.settle();
    set.remove_file(a);
    let settled = set.settle();
    assert_eq!(deleted(&settled), ["db", "web"]);
    assert_eq!(set.files().collect::<Vec<_>>(), [b]);
    set.remove_file(a);
    assert_eq!(set.settle(), Settled::default());
}

#[test]
fn an_object_in_two_files_follows_the_last_writer_and_survives_either_removal() {
    let mut set = ManifestSet::new();
    let (a, b) = (Path::new("/m/a.yaml"), Path::new("/m/b.yaml"));
    set.update_file(a, objs(&[("web", 80)]));
    set.settle();
    let out = set.update_file(b, objs(&[("web", 81)]));
    assert_eq!(wanted(&out), [(0, "web".into())]);
    assert_eq!(set.settle(), Settled::default());
    // `a` changes something else: its unchanged copy of web does not win back.
    let out = set.update_file(a, objs(&[("web", 80), ("x", 1)]));
    assert_eq!(wanted(&out), [(1, "x".into())]);
    assert_eq!(set.settle(), Settled::default());
    // `b` is removed: `a`'s version must be read again from `a`, where it is the first object.
    set.remove_file(b);
    let settled = set.settle();
    assert!(settled.deleted.is_empty());
    let reread: Vec<(&Path, Vec<(u32, String)>)> = settled
        .reread
        .iter()
        .map(|(p, w)| (p.as_path(), wanted(w)))
        .collect();
    assert_eq!(reread, [(a, vec![(0, "web".to_string())])]);
    set.remove_file(a);
    assert_eq!(deleted(&set.settle()), ["web", "x"]);
    assert!(set.is_empty());
}

#[test]
fn a_rename_applied_at_once_reports_nothing() {
    let mut set = ManifestSet::new();
    let (a, b) = (Path::new("/m/a.yaml"), Path::new("/m/b.yaml"));
    set.update_file(a, objs(&[("web", 80)]));
    set.settle();
    set.remove_file(a);
    assert!(set.update_file(b, objs(&[("web", 80)])).is_empty());
    assert_eq!(set.settle(), Settled::default());
    set.remove_file(b);
    assert_eq!(deleted(&set.settle()), ["web"]);
}

#[test]
fn an_object_that_could_not_be_reported_is_reported_with_its_next_version() {
    let mut set = ManifestSet::new();
    let (a, b) = (Path::new("/m/a.yaml"), Path::new("/m/b.yaml"));
    set.update_file(a, objs(&[("web", 80)]));
    set.update_file(b, objs(&[("web", 81)]));
    set.settle();
    set.remove_file(b);
    let settled = set.settle();
    assert_eq!(settled.reread.len(), 1);
    // `a` could not be read again; when it is next read, even unchanged, web is reported.
    set.not_reported(&key("web"));
    assert_eq!(
        wanted(&set.update_file(a, objs(&[("web", 80)]))),
        [(0, "web".into())]
    );
    // And it still counts as reported, so its removal is a delete.
    set.remove_file(a);
    assert_eq!(deleted(&set.settle()), ["web"]);
}

#[test]
fn kinds_with_the_same_name_are_different_objects() {
    let node = parse(
        "n.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: web}\n",
    );
    let svc = parse(
        "s.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: ''}\n",
    );
    let objects: Vec<(Key, Digest)> = node
        .iter()
        .chain(&svc)
        .map(|o| ((o.kind(), o.key()), digest(o)))
        .collect();
    let mut set = ManifestSet::new();
    let out = set.update_file(Path::new("/m/x.yaml"), objects);
    let kinds: Vec<Kind> = out.iter().map(|(_, k)| k.0).collect();
    assert_eq!(kinds, [Kind::Node, Kind::Service]);
}

#[test]
fn digests_follow_the_content_not_the_spelling() {
    let a = parse("a.yaml", &service("web", 80)).remove(0);
    let json = r#"{"kind":"Service","apiVersion":"v1","metadata":{"namespace":"ns","name":"web"},
        "spec":{"ports":[{"protocol":"TCP","port":80}],"clusterIP":"10.96.0.10"}}"#;
    let b = parse("b.json", json).remove(0);
    assert_eq!(digest(&a), digest(&b));
    let c = parse("c.yaml", &service("web", 81)).remove(0);
    assert_ne!(digest(&a), digest(&c));
    let d = parse("d.yaml", &service("db", 80)).remove(0);
    assert_ne!(digest(&a), digest(&d));
}

#[test]
fn unwanted_objects_are_skipped_but_keep_their_ordinals() {
    let text = format!(
        "{}---\napiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  \
         metadata: {{name: n1}}\n- apiVersion: v1\n  kind: Node\n  metadata: {{name: n2}}\n\
         ---\n{}",
        service("a", 80),
        service("b", 81)
    );
    let mut got = Vec::new();
    for_each_object(
        Path::new("x.yaml"),
        &text,
        &mut |n| n % 2 == 0,
        &mut |n, o| got.push(format!("{n} {}", o.key())),
    )
    .expect("parses");
    assert_eq!(got, ["0 ns/a", "2 n2"]);
    let mut all = 0;
    for_each_object(Path::new("x.yaml"), &text, &mut |_| true, &mut |_, _| {
        all += 1
    })
    .expect("parses");
    assert_eq!(all, 4);
}

#[test]
fn a_json_list_is_decoded_whatever_the_order_of_its_fields() {
    // `kind` after `items`, as every serializer that sorts keys writes it; typed-list items
    // without their own type.
    let text = r#"{"apiVersion":"v1","items":[{"metadata":{"name":"s1","namespace":"ns"}},
        {"metadata":{"name":"s2","namespace":"ns"}}],"kind":"ServiceList","metadata":{}}"#;
    assert_eq!(
        names(&parse("list.json", text)),
        ["Service ns/s1", "Service ns/s2"]
    );
    let (_, reason) = parse_err(
        "list.json",
        r#"{"items":[{"metadata":{"name":"s1"}}, 7],"kind":"ServiceList","apiVersion":"v1"}"#,
    );
    assert!(reason.contains("item 2"), "{reason}");
    let (_, reason) = parse_err(
        "list.json",
        r#"{"items":{"a":1},"kind":"List","apiVersion":"v1"}"#,
    );
    assert!(reason.contains("items is not a sequence"), "{reason}");
    let (_, reason) = parse_err("x.json", r#"{"apiVersion":"v1","kind":"List"} trailing"#);
    assert!(reason.contains("invalid JSON"), "{reason}");
}

/// Every object of a file, in full, decoded by the two passes alone.
fn slowly(name: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut want = |_| true;
    let mut f = |_, obj: Object| out.push(format!("{obj:?}"));
    let mut sink = Sink {
        next: 0,
        skip_below: 0,
        want: &mut want,
        f: &mut f,
        failure: None,
    };
    if name.ends_with(".json") {
        decode_document_slowly(&Json(text), &mut sink).expect("parses");
    } else {
        for doc in split_documents(text) {
            if !is_blank(doc.text) {
                decode_document_slowly(&Yaml(&doc), &mut sink).expect("parses");
            }
        }
    }
    out
}

/// Whether the one-pass decoder takes every document of a YAML file by itself.
fn one_pass_takes(text: &str) -> bool {
    let mut want = |_| true;
    let mut f = |_, _: Object| {};
    let mut sink = Sink {
        next: 0,
        skip_below: 0,
        want: &mut want,
        f: &mut f,
        failure: None,
    };
    split_documents(text)
        .iter()
        .filter(|doc| !is_blank(doc.text))
        .all(|doc| Yaml(doc).run(FastDoc { sink: &mut sink }).is_ok())
}

/// An EndpointSlice as `kubectl get -o yaml` writes it: keys sorted, so the fields only
/// slices have come before `kind`.
const SORTED_SLICE: &str = "\
addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses: [10.0.0.2]
  conditions: {ready: false, serving: true}
  nodeName: node-1
  zone: zone-a
kind: EndpointSlice
metadata:
  annotations: {endpoints.kubernetes.io/last-change-trigger-time: '2026-01-01T00:00:00Z'}
  labels: {kubernetes.io/service-name: web}
  name: web-def
  namespace: ns
ports:
- {name: http, port: 8080, protocol: TCP}
";

#[test]
fn the_one_pass_decoder_takes_common_documents_and_agrees_with_the_two_passes() {
    let late_type = "spec:\n  clusterIP: 10.96.0.11\n  ports: [{port: 81}]\n\
                     status: {loadBalancer: {ingress: [{ip: 192.0.2.9}]}}\n\
                     metadata: {name: late, namespace: ns}\nkind: Service\napiVersion: v1\n";
    let node = "apiVersion: v1\nkind: Node\nmetadata: {name: n1, labels: {a: b}}\n\
                spec: {podCIDRs: [10.244.0.0/24], taints: [{key: k, effect: NoSchedule}]}\n\
                status: {addresses: [{type: InternalIP, address: 192.0.2.1}]}\n";
    let cidr = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: c}\n\
                spec: {cidrs: [10.96.0.0/16]}\n";
    let typed_list = "apiVersion: v1\nkind: ServiceList\nmetadata: {resourceVersion: '7'}\n\
                      items:\n- metadata: {name: s1, namespace: ns}\n  spec: {ports: [{port: 1}]}\n\
                      - apiVersion: v1\n  kind: Service\n  metadata: {name: s2}\n";
    let mut v1_list = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for doc in [service("s3", 83).as_str(), SORTED_SLICE, NODE] {
        for (i, line) in doc.lines().enumerate() {
            v1_list.push_str(if i == 0 { "- " } else { "  " });
            v1_list.push_str(line);
            v1_list.push('\n');
        }
    }
    for (what, text) in [
        ("a Service", service("a", 80)),
        ("a slice", SLICE.to_string()),
        ("a slice with sorted keys", SORTED_SLICE.to_string()),
        ("spec and status before the type", late_type.to_string()),
        ("a Node", node.to_string()),
        ("a ServiceCIDR", cidr.to_string()),
        ("a typed list", typed_list.to_string()),
        ("a v1 List", v1_list.clone()),
        (
            "all of them",
            [service("a", 80), SLICE.into(), late_type.into(), v1_list].join("---\n"),
        ),
    ] {
        assert!(one_pass_takes(&text), "{what}: left to the two passes");
        let fast: Vec<String> = parse("x.yaml", &text)
            .iter()
            .map(|o| format!("{o:?}"))
            .collect();
        assert!(!fast.is_empty(), "{what}");
        assert_eq!(fast, slowly("x.yaml", &text), "{what}");
    }
}

#[test]
fn documents_the_one_pass_decoder_leaves_get_the_two_passes_result() {
    // Items before the list's type (as serializers that sort keys write JSON).
    let json_list = r#"{"apiVersion":"v1","items":[{"apiVersion":"v1","kind":"Service",
        "metadata":{"name":"s1","namespace":"ns"}}],"kind":"List"}"#;
    // The same field twice in JSON: the last one counts, as k8s-openapi decodes it.
    let twice = r#"{"apiVersion":"v1","spec":{"ports":[{"port":1}]},"kind":"Service",
        "metadata":{"name":"a"},"spec":{"ports":[{"port":2}]}}"#;
    // A list item that names its own type in a typed list.
    let own_type = "apiVersion: v1\nkind: ServiceList\nitems:\n\
                    - {apiVersion: v1, kind: Node, metadata: {name: n9}}\n";
    for (name, text) in [
        ("l.json", json_list),
        ("t.json", twice),
        ("o.yaml", own_type),
    ] {
        let fast: Vec<String> = parse(name, text).iter().map(|o| format!("{o:?}")).collect();
        assert_eq!(fast, slowly(name, text), "{name}");
    }
    assert!(format!("{:?}", parse("t.json", twice)).contains("port: 2"));
    assert_eq!(names(&parse("o.yaml", own_type)), ["Node n9"]);
}

#[test]
fn a_list_that_fails_part_way_passes_each_good_item_on_once() {
    let text = "apiVersion: v1\nkind: List\nitems:\n\
                - {apiVersion: v1, kind: Service, metadata: {name: a}}\n\
                - {apiVersion: v1, kind: Service, metadata: {name: b}}\n\
                - {apiVersion: v1, kind: Service, metadata: {name: c}, spec: {ports: [{port: x}]}}\n";
    let mut seen = Vec::new();
    let err = for_each_object(Path::new("x.yaml"), text, &mut |_| true, &mut |n, _| {
        seen.push(n)
    })
    .expect_err("item 3 is bad");
    assert_eq!(seen, [0, 1]);
    let SourceError::ManifestParse { reason, .. } = err else {
        panic!("{err}")
    };
    assert!(reason.starts_with("item 3: Service:"), "{reason}");
}

#[test]
fn yaml_splits_into_pieces_of_whole_documents() {
    let text = format!(
        "# head\n{}",
        ["a: 1\n", "b: |\n  ---x\n", "c: 3\n"].join("---\n")
    );
    let pieces = super::split_yaml(&text, 4);
    assert_eq!(pieces.concat(), text);
    assert_eq!(pieces.len(), 3, "{pieces:?}");
    assert!(
        pieces[1..].iter().all(|p| p.starts_with("---\n")),
        "{pieces:?}"
    );
    let docs: usize = pieces.iter().map(|p| split_documents(p).len()).sum();
    assert_eq!(docs, split_documents(&text).len());
    assert_eq!(super::split_yaml(&text, 1 << 20), [text.as_str()]);
}

/// A v1 Endpoints, as the walkthroughs write one for a Service without a selector.
const ENDPOINTS: &str = "\
apiVersion: v1
kind: Endpoints
metadata:
  name: web
  namespace: ns
  labels: {app: web}
subsets:
- addresses:
  - {ip: 10.0.0.1, nodeName: node-1}
  notReadyAddresses:
  - ip: 10.0.0.2
  ports:
  - {name: http, port: 8080, protocol: TCP}
";

#[test]
fn endpoints_objects_and_lists_of_them_are_accepted() {
    let text = format!("{}---\n{ENDPOINTS}", service("web", 80));
    let objects = parse("/m/web.yaml", &text);
    assert_eq!(names(&objects), ["Service ns/web", "Endpoints ns/web"]);
    let Object::Endpoints(ep) = &objects[1] else {
        panic!("not an Endpoints")
    };
    let subset = &ep.subsets.as_deref().expect("subsets")[0];
    assert_eq!(
        subset.addresses.as_deref().expect("addresses")[0].ip,
        "10.0.0.1"
    );
    assert_eq!(
        subset.not_ready_addresses.as_deref().expect("not ready")[0].ip,
        "10.0.0.2"
    );
    assert_eq!(subset.ports.as_deref().expect("ports")[0].port, 8080);

    let typed = "apiVersion: v1\nkind: EndpointsList\nitems:\n\
                 - metadata: {name: a, namespace: ns}\n  subsets: [{addresses: [{ip: 10.0.0.3}]}]\n";
    assert_eq!(names(&parse("l.yaml", typed)), ["Endpoints ns/a"]);
    let json = r#"{"apiVersion":"v1","kind":"List","items":[
        {"apiVersion":"v1","kind":"Endpoints","metadata":{"name":"b","namespace":"ns"},
         "subsets":[{"addresses":[{"ip":"10.0.0.4"}],"ports":[{"port":80}]}]}]}"#;
    assert_eq!(names(&parse("l.json", json)), ["Endpoints ns/b"]);
    // A wrong field type fails the file as for any other kind.
    let (_, reason) = parse_err(
        "x.yaml",
        "apiVersion: v1\nkind: Endpoints\nmetadata: {name: c}\nsubsets: {a: b}\n",
    );
    assert!(reason.contains("Endpoints"), "{reason}");
}

#[test]
fn the_one_pass_decoder_takes_endpoints_and_agrees_with_the_two_passes() {
    // `kubectl get -o yaml` sorts keys: `subsets` comes after `kind` but a stray `ports` or
    // `spec` may come before it.
    let sorted = "apiVersion: v1\nkind: Endpoints\nmetadata: {name: s, namespace: ns}\n\
                  subsets:\n- addresses: [{ip: 10.0.0.5, hostname: h, targetRef: {kind: Pod, name: p}}]\n  \
                  ports: [{port: 81, appProtocol: http}]\n";
    let late = "subsets: [{addresses: [{ip: 10.0.0.6}], ports: [{port: 82}]}]\n\
                metadata: {name: late}\nkind: Endpoints\napiVersion: v1\n";
    let mut v1_list = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for doc in [ENDPOINTS, SLICE] {
        for (i, line) in doc.lines().enumerate() {
            v1_list.push_str(if i == 0 { "- " } else { "  " });
            v1_list.push_str(line);
            v1_list.push('\n');
        }
    }
    for (what, text) in [
        ("an Endpoints", ENDPOINTS.to_string()),
        ("sorted keys", sorted.to_string()),
        ("subsets before the type", late.to_string()),
        ("in a v1 List", v1_list),
    ] {
        assert!(one_pass_takes(&text), "{what}: left to the two passes");
        let fast: Vec<String> = parse("x.yaml", &text)
            .iter()
            .map(|o| format!("{o:?}"))
            .collect();
        assert!(!fast.is_empty(), "{what}");
        assert_eq!(fast, slowly("x.yaml", &text), "{what}");
    }
}
