use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use kp_core::track::SourceEvent;
use kp_metrics::Metrics;
use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind};
use notify::EventKind;

use super::{is_manifest_name, wakes, DirState};

fn service(name: &str, port: u16) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\n\
         spec: {{ports: [{{port: {port}}}]}}\n"
    )
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

/// One read of the directory: file name to text, or `None` for a file that fails to read.
fn read(files: &[(&str, Option<&str>)]) -> BTreeMap<PathBuf, io::Result<String>> {
    files
        .iter()
        .map(|(name, text)| {
            let text = match text {
                Some(t) => Ok(t.to_string()),
                None => Err(io::Error::new(io::ErrorKind::PermissionDenied, "denied")),
            };
            (PathBuf::from("/m").join(name), text)
        })
        .collect()
}

fn errors(metrics: &Metrics, reason: &str) -> u64 {
    let line =
        format!("kubeproxy_rs_source_errors_total{{source=\"manifests\",reason=\"{reason}\"}} ");
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&line).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn state() -> (DirState, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    (DirState::new(PathBuf::from("/m"), metrics.clone()), metrics)
}

#[test]
fn a_broken_file_keeps_its_last_good_content_and_is_counted() {
    let (mut dir, metrics) = state();
    let good = format!("{}---\n{}", service("a", 80), service("b", 81));
    let out = dir.apply_read(read(&[
        ("x.yaml", Some(&good)),
        ("y.yaml", Some(&service("c", 82))),
    ]));
    assert_eq!(
        show(&out),
        [
            "upsert Service ns/a",
            "upsert Service ns/b",
            "upsert Service ns/c"
        ]
    );

    // x.yaml breaks (and drops b); y.yaml changes. Only y's change is reported.
    let broken = format!("{}---\nkind: [\n", service("a", 80));
    let out = dir.apply_read(read(&[
        ("x.yaml", Some(&broken)),
        ("y.yaml", Some(&service("c", 83))),
    ]));
    assert_eq!(show(&out), ["upsert Service ns/c"]);
    assert_eq!(errors(&metrics, "parse"), 1);

    // The same broken text again is neither parsed nor counted again.
    let out = dir.apply_read(read(&[
        ("x.yaml", Some(&broken)),
        ("y.yaml", Some(&service("c", 83))),
    ]));
    assert!(out.is_empty());
    assert_eq!(errors(&metrics, "parse"), 1);

    // Fixed: now b goes.
    let out = dir.apply_read(read(&[
        ("x.yaml", Some(&service("a", 80))),
        ("y.yaml", Some(&service("c", 83))),
    ]));
    assert_eq!(show(&out), ["delete Service ns/b"]);
}

#[test]
fn an_unreadable_file_keeps_its_objects() {
    let (mut dir, metrics) = state();
    dir.apply_read(read(&[("x.yaml", Some(&service("a", 80)))]));
    let out = dir.apply_read(read(&[("x.yaml", None)]));
    assert!(out.is_empty());
    assert_eq!(errors(&metrics, "read"), 1);
    // Readable again with the same text: nothing changed, nothing to report.
    assert!(dir
        .apply_read(read(&[("x.yaml", Some(&service("a", 80)))]))
        .is_empty());
}

#[test]
fn a_deleted_file_deletes_its_objects_even_if_it_was_broken_last() {
    let (mut dir, _) = state();
    dir.apply_read(read(&[
        ("x.yaml", Some(&service("a", 80))),
        ("y.yaml", Some(&service("b", 81))),
    ]));
    dir.apply_read(read(&[
        ("x.yaml", Some("kind: [")),
        ("y.yaml", Some(&service("b", 81))),
    ]));
    let out = dir.apply_read(read(&[("y.yaml", Some(&service("b", 81)))]));
    assert_eq!(show(&out), ["delete Service ns/a"]);
    let out = dir.apply_read(read(&[]));
    assert_eq!(show(&out), ["delete Service ns/b"]);
}

#[test]
fn a_file_that_never_parsed_has_nothing_to_delete() {
    let (mut dir, _) = state();
    dir.apply_read(read(&[("x.yaml", Some("kind: ["))]));
    assert!(dir.apply_read(read(&[])).is_empty());
}

#[test]
fn only_visible_yaml_and_json_files_are_manifests() {
    for name in ["svc.yaml", "a.b.yml", "list.json"] {
        assert!(is_manifest_name(name), "{name}");
    }
    for name in [
        ".svc.yaml",
        ".svc.yaml.swp",
        "svc.yaml~",
        "svc.yaml.bak",
        "yaml",
        ".yaml",
        "..data",
        "svc.txt",
    ] {
        assert!(!is_manifest_name(name), "{name}");
    }
}

#[test]
fn reading_a_file_does_not_wake_the_source_but_writing_does() {
    assert!(!wakes(&EventKind::Access(AccessKind::Open(
        AccessMode::Any
    ))));
    assert!(!wakes(&EventKind::Access(AccessKind::Close(
        AccessMode::Read
    ))));
    assert!(wakes(&EventKind::Access(AccessKind::Close(
        AccessMode::Write
    ))));
    assert!(wakes(&EventKind::Create(CreateKind::File)));
    assert!(wakes(&EventKind::Modify(ModifyKind::Any)));
    assert!(wakes(&EventKind::Any));
}

fn port_of(ev: &SourceEvent) -> i32 {
    match ev {
        SourceEvent::Upsert(kp_core::track::Object::Service(svc)) => svc
            .spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .map_or(0, |p| p[0].port),
        _ => 0,
    }
}

#[test]
fn a_file_with_many_objects_reports_each_once_then_only_changes() {
    // More objects than are kept from the first pass, so they are parsed again to be sent.
    let n = super::KEEP_PARSED + 50;
    let text = |changed: usize| -> String {
        (0..n)
            .map(|i| service(&format!("s{i}"), if i == changed { 81 } else { 80 }))
            .collect::<Vec<_>>()
            .join("---\n")
    };
    let (mut dir, _) = state();
    let out = dir.apply_read(read(&[("big.yaml", Some(&text(n)))]));
    assert_eq!(out.len(), n);
    let mut names = show(&out);
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n);
    let out = dir.apply_read(read(&[("big.yaml", Some(&text(n - 1)))]));
    assert_eq!(show(&out), [format!("upsert Service ns/s{}", n - 1)]);
    assert_eq!(port_of(&out[0]), 81);
}

#[test]
fn an_object_in_two_files_falls_back_to_the_other_file_when_the_winner_goes() {
    let (mut dir, _) = state();
    let a = format!("{}---\n{}", service("x", 1), service("web", 80));
    dir.apply_read(read(&[("a.yaml", Some(&a))]));
    let out = dir.apply_read(read(&[
        ("a.yaml", Some(&a)),
        ("b.yaml", Some(&service("web", 81))),
    ]));
    assert_eq!(show(&out), ["upsert Service ns/web"]);
    assert_eq!(port_of(&out[0]), 81);
    // b goes: a's version is read again from a and reported.
    let out = dir.apply_read(read(&[("a.yaml", Some(&a))]));
    assert_eq!(show(&out), ["upsert Service ns/web"]);
    assert_eq!(port_of(&out[0]), 80);
}

#[test]
fn a_fallback_that_cannot_be_read_again_waits_for_its_file_to_be_fixed() {
    let (mut dir, _) = state();
    let a = service("web", 80);
    dir.apply_read(read(&[
        ("a.yaml", Some(&a)),
        ("b.yaml", Some(&service("web", 81))),
    ]));
    // a breaks (keeping web:80 in force), then b goes: web:80 cannot be read from a, so the
    // reported version (81) stays.
    dir.apply_read(read(&[
        ("a.yaml", Some("kind: [")),
        ("b.yaml", Some(&service("web", 81))),
    ]));
    let out = dir.apply_read(read(&[("a.yaml", Some("kind: ["))]));
    assert!(out.is_empty(), "{:?}", show(&out));
    // a is fixed: web:80 is reported, and a's removal then deletes it.
    let out = dir.apply_read(read(&[("a.yaml", Some(&a))]));
    assert_eq!(show(&out), ["upsert Service ns/web"]);
    assert_eq!(port_of(&out[0]), 80);
    assert_eq!(show(&dir.apply_read(read(&[]))), ["delete Service ns/web"]);
}

#[test]
fn a_renamed_file_reports_nothing() {
    let (mut dir, _) = state();
    let text = format!("{}---\n{}", service("a", 80), service("b", 81));
    dir.apply_read(read(&[("x.yaml", Some(&text))]));
    assert!(dir.apply_read(read(&[("y.yaml", Some(&text))])).is_empty());
    let out = dir.apply_read(read(&[]));
    assert_eq!(show(&out), ["delete Service ns/a", "delete Service ns/b"]);
}
