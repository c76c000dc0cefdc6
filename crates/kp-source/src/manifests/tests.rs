use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kp_core::track::SourceEvent;
use kp_metrics::Metrics;
use notify::event::{AccessKind, AccessMode, CreateKind, DataChange, ModifyKind, RenameMode};
use notify::EventKind;

use super::parse::text_digest;
use super::{
    is_manifest_name, parse_all, parse_piece, wakes, Activity, DirState, Files, Job, Look, Stamp,
};

/// A directory of fake files, counting how often each is read.
#[derive(Default)]
struct Fake {
    files: BTreeMap<PathBuf, FakeFile>,
    reads: BTreeMap<PathBuf, usize>,
}

/// A fake file: its metadata, or why it cannot be had; its text, or why it cannot be read.
struct FakeFile {
    stamp: io::Result<Stamp>,
    text: io::Result<String>,
}

fn copy_err(err: &io::Error) -> io::Error {
    io::Error::new(err.kind(), err.to_string())
}

impl Files for Fake {
    fn stamp(&mut self, path: &Path) -> io::Result<Option<Stamp>> {
        match self.files.get(path) {
            Some(file) => file.stamp.as_ref().map(|s| Some(*s)).map_err(copy_err),
            None => Err(io::ErrorKind::NotFound.into()),
        }
    }

    fn read(&mut self, path: &Path) -> io::Result<Option<String>> {
        *self.reads.entry(path.to_path_buf()).or_default() += 1;
        match self.files.get(path) {
            Some(file) => file
                .text
                .as_ref()
                .map(|t| Some(t.clone()))
                .map_err(copy_err),
            None => Err(io::ErrorKind::NotFound.into()),
        }
    }
}

impl Fake {
    fn set(&mut self, name: &str, stamp: io::Result<Stamp>, text: io::Result<String>) {
        self.files.insert(path(name), FakeFile { stamp, text });
    }

    fn reads(&self, name: &str) -> usize {
        self.reads.get(&path(name)).copied().unwrap_or(0)
    }
}

fn path(name: &str) -> PathBuf {
    PathBuf::from("/m").join(name)
}

/// A stamp for a file that last changed at `changed` (seconds since the epoch).
fn stamp(ino: u64, size: u64, changed: i64) -> Stamp {
    Stamp {
        dev: 1,
        ino,
        size,
        mtime: (changed, 0),
        ctime: (changed, 0),
    }
}

/// Long ago: a stamp that is settled.
const LONG_AGO: i64 = 1_000_000_000;

fn now_secs() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after the epoch");
    i64::try_from(now.as_secs()).expect("in range")
}

fn denied() -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, "denied")
}

impl DirState {
    /// One read of the fake directory, returning what it sends.
    fn scan_fake(&mut self, fake: &mut Fake) -> Vec<SourceEvent> {
        let listing = fake.files.keys().cloned().collect();
        let mut events = Vec::new();
        let mut emit = |ev| {
            events.push(ev);
            true
        };
        let _ = self.scan(listing, fake, SystemTime::now(), &mut emit);
        events
    }

    /// One read of the directory, given as each file's text (or why it could not be read),
    /// returning what it sends. Each file's stamp follows from its text (or error), as if
    /// every change were a rename into place long ago.
    fn apply_read(&mut self, files: BTreeMap<PathBuf, io::Result<String>>) -> Vec<SourceEvent> {
        let mut fake = Fake::default();
        for (path, text) in files {
            let key = match &text {
                Ok(text) => text.clone(),
                Err(err) => format!("error: {err}"),
            };
            let digest = text_digest(&key);
            let stamp = Ok(stamp(digest[0], digest[1], LONG_AGO));
            fake.files.insert(path, FakeFile { stamp, text });
        }
        self.scan_fake(&mut fake)
    }
}

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
                None => Err(denied()),
            };
            (path(name), text)
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
    // A file larger than is kept from the first pass, so its objects are parsed again to be
    // sent.
    let n = 300;
    let text = |changed: usize| -> String {
        (0..n)
            .map(|i| service(&format!("s{i}"), if i == changed { 81 } else { 80 }))
            .collect::<Vec<_>>()
            .join("---\n")
    };
    let (mut dir, _) = state();
    dir.keep_bytes = 1024;
    assert!(text(n).len() > dir.keep_bytes);
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

/// The rescans the other files' changes cause: each sees every file again.
fn rescan_n(dir: &mut DirState, fake: &mut Fake, n: usize) {
    for _ in 0..n {
        assert!(dir.scan_fake(fake).is_empty());
    }
}

#[test]
fn an_unreadable_file_is_reported_and_read_once_per_change_of_its_metadata() {
    let (mut dir, metrics) = state();
    let mut fake = Fake::default();
    let too_large = || io::Error::other("file is larger than 16777216 bytes");
    fake.set(
        "big.yaml",
        Ok(stamp(1, 1 << 30, LONG_AGO)),
        Err(too_large()),
    );
    fake.set(
        "latin1.yaml",
        Ok(stamp(2, 10, LONG_AGO)),
        Err(io::Error::new(io::ErrorKind::InvalidData, "not UTF-8")),
    );
    fake.set("denied.yaml", Ok(stamp(3, 10, LONG_AGO)), Err(denied()));
    assert!(dir.scan_fake(&mut fake).is_empty());
    assert_eq!(errors(&metrics, "read"), 3);

    rescan_n(&mut dir, &mut fake, 10);
    assert_eq!(
        errors(&metrics, "read"),
        3,
        "reported again while unchanged"
    );
    for name in ["big.yaml", "latin1.yaml", "denied.yaml"] {
        assert_eq!(fake.reads(name), 1, "{name} read again while unchanged");
    }

    // Changed, still failing: read and reported once more.
    fake.set(
        "big.yaml",
        Ok(stamp(1, 1 << 31, LONG_AGO)),
        Err(too_large()),
    );
    rescan_n(&mut dir, &mut fake, 5);
    assert_eq!(errors(&metrics, "read"), 4);
    assert_eq!(fake.reads("big.yaml"), 2);

    // Fixed: read as usual.
    fake.set(
        "denied.yaml",
        Ok(stamp(3, 10, LONG_AGO + 1)),
        Ok(service("a", 80)),
    );
    assert_eq!(show(&dir.scan_fake(&mut fake)), ["upsert Service ns/a"]);
    assert_eq!(errors(&metrics, "read"), 4);
}

#[test]
fn a_failed_file_that_changed_just_now_is_read_again_but_reported_once() {
    // Its metadata might not change with a write in the same clock tick, so it is read at
    // every rescan until it settles; failing the same way is not reported again.
    let (mut dir, metrics) = state();
    let mut fake = Fake::default();
    fake.set("x.yaml", Ok(stamp(1, 10, now_secs())), Err(denied()));
    dir.scan_fake(&mut fake);
    rescan_n(&mut dir, &mut fake, 3);
    assert_eq!(fake.reads("x.yaml"), 4);
    assert_eq!(errors(&metrics, "read"), 1);
    // Written within the same tick, stamp unchanged: seen at once.
    fake.set("x.yaml", Ok(stamp(1, 10, now_secs())), Ok(service("a", 80)));
    assert_eq!(show(&dir.scan_fake(&mut fake)), ["upsert Service ns/a"]);
}

#[test]
fn a_file_without_metadata_is_reported_once_until_it_has_some() {
    let (mut dir, metrics) = state();
    let mut fake = Fake::default();
    fake.set("x.yaml", Err(denied()), Ok(service("a", 80)));
    dir.scan_fake(&mut fake);
    rescan_n(&mut dir, &mut fake, 5);
    assert_eq!(errors(&metrics, "read"), 1);
    assert_eq!(fake.reads("x.yaml"), 0);
    fake.set("x.yaml", Ok(stamp(1, 10, LONG_AGO)), Ok(service("a", 80)));
    assert_eq!(show(&dir.scan_fake(&mut fake)), ["upsert Service ns/a"]);
}

#[test]
fn a_broken_file_is_reported_once_per_change_of_its_text_and_not_read_while_unchanged() {
    let (mut dir, metrics) = state();
    let mut fake = Fake::default();
    fake.set("x.yaml", Ok(stamp(1, 7, LONG_AGO)), Ok("kind: [".into()));
    dir.scan_fake(&mut fake);
    rescan_n(&mut dir, &mut fake, 5);
    assert_eq!(errors(&metrics, "parse"), 1);
    assert_eq!(fake.reads("x.yaml"), 1);

    // Replaced by the same text (a ConfigMap update of another key): read once, not reported.
    fake.set("x.yaml", Ok(stamp(2, 7, LONG_AGO)), Ok("kind: [".into()));
    rescan_n(&mut dir, &mut fake, 5);
    assert_eq!(errors(&metrics, "parse"), 1);
    assert_eq!(fake.reads("x.yaml"), 2);

    // Broken differently: reported.
    fake.set("x.yaml", Ok(stamp(3, 8, LONG_AGO)), Ok("kind: [[".into()));
    rescan_n(&mut dir, &mut fake, 5);
    assert_eq!(errors(&metrics, "parse"), 2);

    // Unreadable, then readable with the text that failed before: both are changes.
    fake.set("x.yaml", Ok(stamp(4, 8, LONG_AGO)), Err(denied()));
    rescan_n(&mut dir, &mut fake, 2);
    fake.set("x.yaml", Ok(stamp(5, 8, LONG_AGO)), Ok("kind: [[".into()));
    rescan_n(&mut dir, &mut fake, 2);
    assert_eq!(errors(&metrics, "read"), 1);
    assert_eq!(errors(&metrics, "parse"), 3);
}

#[test]
fn a_removed_file_is_forgotten_with_its_failure() {
    let (mut dir, metrics) = state();
    let mut fake = Fake::default();
    fake.set("x.yaml", Ok(stamp(1, 10, LONG_AGO)), Err(denied()));
    dir.scan_fake(&mut fake);
    fake.files.clear();
    dir.scan_fake(&mut fake);
    assert!(dir.seen.is_empty(), "{:?}", dir.seen);
    // Back as it was: a new file, read and reported.
    fake.set("x.yaml", Ok(stamp(1, 10, LONG_AGO)), Err(denied()));
    dir.scan_fake(&mut fake);
    assert_eq!(errors(&metrics, "read"), 2);
    assert_eq!(fake.reads("x.yaml"), 2);
}

#[test]
fn a_stamp_settles_some_seconds_after_the_file_changed() {
    let at = |secs: u64| UNIX_EPOCH + Duration::from_secs(secs);
    let s = stamp(1, 1, 1_000);
    assert!(!s.settled(at(1_000)));
    assert!(!s.settled(at(1_001)));
    assert!(s.settled(at(1_002)));
    // A file time in the future (a skewed network filesystem) never settles.
    assert!(!stamp(1, 1, 5_000).settled(at(1_002)));
    let ctime_later = Stamp {
        ctime: (1_005, 0),
        ..s
    };
    assert!(!ctime_later.settled(at(1_003)));
}

#[test]
fn a_good_file_unchanged_since_a_settled_look_is_not_read_again() {
    let (mut dir, _) = state();
    let mut fake = Fake::default();
    fake.set("x.yaml", Ok(stamp(1, 10, LONG_AGO)), Ok(service("a", 80)));
    assert_eq!(show(&dir.scan_fake(&mut fake)), ["upsert Service ns/a"]);
    rescan_n(&mut dir, &mut fake, 5);
    assert_eq!(fake.reads("x.yaml"), 1);
    // Its metadata changes: read again, and the change reported.
    fake.set(
        "x.yaml",
        Ok(stamp(1, 10, LONG_AGO + 1)),
        Ok(service("a", 81)),
    );
    assert_eq!(show(&dir.scan_fake(&mut fake)), ["upsert Service ns/a"]);
    assert_eq!(fake.reads("x.yaml"), 2);
    // Changed just now: read at every rescan until it settles, in case a write in the same
    // clock tick left the metadata as it was.
    fake.set("x.yaml", Ok(stamp(1, 10, now_secs())), Ok(service("a", 81)));
    rescan_n(&mut dir, &mut fake, 3);
    assert_eq!(fake.reads("x.yaml"), 5);
    fake.set("x.yaml", Ok(stamp(1, 10, now_secs())), Ok(service("a", 82)));
    assert_eq!(show(&dir.scan_fake(&mut fake)), ["upsert Service ns/a"]);
}

fn event(kind: EventKind, paths: &[&str]) -> notify::Event {
    let mut ev = notify::Event::new(kind);
    for p in paths {
        ev = ev.add_path(path(p));
    }
    ev
}

#[test]
fn a_file_written_to_counts_as_being_written_until_closed_removed_or_renamed_away() {
    let mut a = Activity::default();
    let modify = EventKind::Modify(ModifyKind::Data(DataChange::Any));
    a.observe(&event(EventKind::Create(CreateKind::File), &["x.yaml"]));
    assert!(a.writing.is_empty(), "created, not yet written");
    a.observe(&event(modify, &["x.yaml"]));
    a.observe(&event(modify, &["y.yaml"]));
    a.observe(&event(modify, &[".z.yaml.tmp"]));
    assert_eq!(a.writing.len(), 3);
    a.observe(&event(
        EventKind::Access(AccessKind::Close(AccessMode::Write)),
        &["x.yaml"],
    ));
    a.observe(&event(
        EventKind::Remove(notify::event::RemoveKind::File),
        &["y.yaml"],
    ));
    a.observe(&event(
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)),
        &[".z.yaml.tmp", "z.yaml"],
    ));
    assert!(a.writing.is_empty(), "{:?}", a.writing);
    assert_eq!(a.events, 7);
}

#[test]
fn files_parsed_in_parallel_come_back_in_order_each_with_its_own_result() {
    let jobs: Vec<Job> = (0..9)
        .map(|i| {
            let text = if i == 4 {
                "kind: [".to_string()
            } else {
                (0..i + 1)
                    .map(|k| service(&format!("f{i}-s{k}"), 80))
                    .collect::<Vec<_>>()
                    .join("---\n")
            };
            Job {
                path: path(&format!("f{i}.yaml")),
                look: Look {
                    stamp: None,
                    text: None,
                },
                settled: false,
                text,
            }
        })
        .collect();
    let parallel = parse_all(&jobs, &[], 3, 1 << 20);
    assert_eq!(parallel.len(), jobs.len());
    for (job, got) in jobs.iter().zip(parallel) {
        let want = parse_piece(&job.path, &job.text, true);
        match (got, want) {
            (Ok(got), Ok(want)) => {
                assert_eq!(got.objects, want.objects, "{}", job.path.display());
                assert_eq!(got.kept.iter().flatten().count(), want.objects.len());
            }
            (Err(got), Err(want)) => assert_eq!(got.to_string(), want.to_string()),
            (got, _) => panic!("{}: {:?}", job.path.display(), got.is_ok()),
        }
    }
}

#[test]
fn a_file_parsed_in_pieces_gives_what_it_gives_whole() {
    let text = (0..1400)
        .map(|k| service(&format!("s{k}"), 80))
        .collect::<Vec<_>>()
        .join("---\n");
    assert!(text.len() > 2 * super::PIECE_BYTES);
    let job = |text: &str| Job {
        path: path("big.yaml"),
        look: Look {
            stamp: None,
            text: None,
        },
        settled: false,
        text: text.to_string(),
    };
    let got = parse_all(&[job(&text)], &[], 2, usize::MAX)
        .remove(0)
        .expect("parses");
    let want = parse_piece(&path("big.yaml"), &text, true).expect("parses");
    assert_eq!(got.objects.len(), 1400);
    assert_eq!(got.objects, want.objects);
    assert_eq!(got.kept.iter().flatten().count(), 1400);

    // Broken near the end: the error is the one for the whole file, its document counted from
    // the top.
    let broken = format!("{text}---\nkind: [\n");
    let Err(got) = parse_all(&[job(&broken)], &[], 2, usize::MAX).remove(0) else {
        panic!("parsed")
    };
    let Err(want) = parse_piece(&path("big.yaml"), &broken, true) else {
        panic!("parsed")
    };
    assert_eq!(got.to_string(), want.to_string());
    assert!(got.to_string().contains("document 1401"), "{got}");
}

#[test]
fn a_stamp_on_a_fine_grained_filesystem_settles_a_tenth_of_a_second_after_the_change() {
    let at = |secs: u64, millis: u64| {
        UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(millis)
    };
    // ext4 or tmpfs: nanoseconds that are not whole milliseconds.
    let fine = Stamp {
        mtime: (1_000, 123_456_789),
        ctime: (1_000, 123_456_789),
        ..stamp(1, 1, 1_000)
    };
    assert!(!fine.settled(at(1_000, 124)));
    assert!(!fine.settled(at(1_000, 223)));
    assert!(fine.settled(at(1_000, 224)));
    // A later mtime (set with `touch -d`) counts from itself.
    let later = Stamp {
        mtime: (1_000, 900_000_001),
        ..fine
    };
    assert!(!later.settled(at(1_000, 999)));
    assert!(later.settled(at(1_001, 1)));
    // Whole seconds or whole milliseconds: a coarse filesystem, or one that cannot be told
    // from one; the long wait.
    let coarse = Stamp {
        ctime: (1_000, 5_000_000),
        ..fine
    };
    assert!(!coarse.settled(at(1_001, 0)));
    assert!(coarse.settled(at(1_002, 124)));
}

/// `n` Services in one file, one document each; Service `changed` has port 81.
fn services(names: &[&str], changed: Option<&str>) -> String {
    names
        .iter()
        .map(|n| service(n, if Some(*n) == changed { 81 } else { 80 }))
        .collect::<Vec<_>>()
        .join("---\n")
}

#[test]
fn an_edit_sends_only_the_changed_documents_objects_whatever_moved() {
    let (mut dir, _) = state();
    let all = ["a", "b", "c", "d"];
    let out = dir.apply_read(read(&[("f.yaml", Some(&services(&all, None)))]));
    assert_eq!(out.len(), 4);
    // One Service changed.
    let out = dir.apply_read(read(&[("f.yaml", Some(&services(&all, Some("c"))))]));
    assert_eq!(show(&out), ["upsert Service ns/c"]);
    assert_eq!(port_of(&out[0]), 81);
    // A document inserted before others: only it is new.
    let out = dir.apply_read(read(&[(
        "f.yaml",
        Some(&services(&["a", "x", "b", "c", "d"], Some("c"))),
    )]));
    assert_eq!(show(&out), ["upsert Service ns/x"]);
    // Documents reordered and one removed: only the deletion.
    let out = dir.apply_read(read(&[(
        "f.yaml",
        Some(&services(&["d", "c", "b", "a"], Some("c"))),
    )]));
    assert_eq!(show(&out), ["delete Service ns/x"]);
    // The last change, after the moves, still reaches the right object.
    let out = dir.apply_read(read(&[(
        "f.yaml",
        Some(&services(&["d", "c", "b", "a"], None)),
    )]));
    assert_eq!(show(&out), ["upsert Service ns/c"]);
    assert_eq!(port_of(&out[0]), 80);
}

/// A YAML file of `names` (see [`services`]) to parse.
fn job(name: &str, text: String) -> Job {
    Job {
        path: path(name),
        look: Look {
            stamp: None,
            text: None,
        },
        settled: false,
        text,
    }
}

#[test]
fn a_changed_file_decodes_only_the_documents_whose_text_changed() {
    let names: Vec<String> = (0..50).map(|i| format!("s{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let (mut dir, _) = state();
    let before = services(&names, None);
    dir.apply_read(read(&[("f.yaml", Some(&before))]));
    let prev = dir
        .docs
        .get(&path("f.yaml"))
        .expect("its documents are known");
    assert_eq!(prev.docs.len(), 50);
    let after = services(&names, Some("s17"));
    for threads in [1, 2] {
        let got = parse_all(
            &[job("f.yaml", after.clone())],
            &[Some(prev)],
            threads,
            1 << 20,
        )
        .remove(0)
        .expect("parses");
        // Only the changed document was decoded (its object kept); the others' keys and
        // digests came from the last parse, and agree with a parse of the whole file.
        let decoded: Vec<usize> = (0..got.kept.len())
            .filter(|&i| got.kept[i].is_some())
            .collect();
        assert_eq!(decoded, [17]);
        let whole = parse_piece(&path("f.yaml"), &after, false).expect("parses");
        assert_eq!(got.objects, whole.objects);
        assert_eq!(got.docs.as_ref().map(Vec::len), Some(50));
    }
    // A document broken after unchanged ones: the error names it as the whole file does.
    let broken = format!("{before}---\nkind: [\n");
    let Err(got) = parse_all(&[job("f.yaml", broken.clone())], &[Some(prev)], 2, 1 << 20).remove(0)
    else {
        panic!("parsed")
    };
    let Err(whole) = parse_piece(&path("f.yaml"), &broken, false) else {
        panic!("parsed")
    };
    assert_eq!(got.to_string(), whole.to_string());
    assert!(got.to_string().contains("document 51"), "{got}");
}

#[test]
fn a_wanted_object_of_an_unchanged_document_is_decoded_from_that_document_alone() {
    let (mut dir, _) = state();
    let text = format!(
        "{}---\n{}---\napiVersion: v1\nkind: List\nitems:\n- {}\n- {}\n",
        service("a", 80),
        service("b", 81),
        service("c", 82).trim_end().replace('\n', "\n  "),
        service("d", 83).trim_end().replace('\n', "\n  "),
    );
    assert_eq!(dir.apply_read(read(&[("f.yaml", Some(&text))])).len(), 4);
    let docs = dir.docs.get(&path("f.yaml")).expect("known").docs.clone();
    assert_eq!(docs.iter().map(|d| d.1).collect::<Vec<_>>(), [1, 1, 2]);
    // Nothing kept: b and d (ordinals 1 and 3) come from decoding their documents again.
    let wanted: Vec<_> = dir
        .docs
        .get(&path("f.yaml"))
        .expect("known")
        .objects
        .iter()
        .enumerate()
        .filter(|(i, _)| [1, 3].contains(i))
        .map(|(i, (key, _))| (i as u32, key.clone()))
        .collect();
    let mut events = Vec::new();
    let sent = dir
        .send_wanted(
            &path("f.yaml"),
            &text,
            (0..4).map(|_| None).collect(),
            Some(&docs),
            &wanted,
            &mut |ev| {
                events.push(ev);
                true
            },
        )
        .unwrap_or(0);
    assert_eq!(sent, 2);
    assert_eq!(
        show(&events),
        ["upsert Service ns/b", "upsert Service ns/d"]
    );
    assert_eq!(events.iter().map(port_of).collect::<Vec<_>>(), [81, 83]);
}

#[test]
fn a_removed_file_forgets_its_documents() {
    let (mut dir, _) = state();
    dir.apply_read(read(&[("f.yaml", Some(&services(&["a"], None)))]));
    assert!(dir.docs.contains_key(&path("f.yaml")));
    let out = dir.apply_read(read(&[]));
    assert_eq!(show(&out), ["delete Service ns/a"]);
    assert!(dir.docs.is_empty());
}

#[tokio::test]
async fn the_quiet_period_counts_from_the_last_change_not_from_the_wake_up() {
    use futures::FutureExt;
    let (_wake_tx, mut wake_rx) = tokio::sync::mpsc::channel::<()>(1);
    let activity = std::sync::Mutex::new(Activity::default());
    // The last change (a rename into place) was a quiet period ago: read at once.
    activity.lock().expect("lock").last = Some(std::time::Instant::now() - 2 * super::QUIET);
    assert!(super::settle_down(&activity, &mut wake_rx)
        .now_or_never()
        .is_some());
    // A file still open for writing: wait, however long ago the last change.
    activity
        .lock()
        .expect("lock")
        .writing
        .insert(path("x.yaml"));
    assert!(super::settle_down(&activity, &mut wake_rx)
        .now_or_never()
        .is_none());
    // A change just now: wait for the quiet period, then read.
    activity.lock().expect("lock").writing.clear();
    let t = std::time::Instant::now();
    activity.lock().expect("lock").last = Some(t);
    assert!(super::settle_down(&activity, &mut wake_rx)
        .now_or_never()
        .is_none());
    super::settle_down(&activity, &mut wake_rx).await;
    assert!(t.elapsed() >= super::QUIET);
}
