//! The manifest directory source against a real directory and real inotify.
//!
//! Every wait is bounded by a timeout, so a change that is never reported fails the test
//! instead of hanging it.

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kp_core::track::{Object, SourceEvent};
use kp_metrics::Metrics;
use kp_source::run_manifests;
use tokio::sync::mpsc;
use tokio::time::timeout;

/// How long a change may take to be reported: the brief allows well under a second, the test
/// allows 2 s so a loaded machine does not make it flaky.
const CHANGE_DEADLINE: Duration = Duration::from_secs(2);

fn service(name: &str, port: u16) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: ns\n\
         spec:\n  clusterIP: 10.96.0.10\n  ports:\n  - name: http\n    port: {port}\n    protocol: TCP\n"
    )
}

const SLICE: &str = "\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: ns
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
endpoints:
- addresses: [10.0.0.1]
ports:
- {name: http, port: 8080, protocol: TCP}
";

const NODE_JSON: &str = r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"node-1"}}"#;

fn show(ev: &SourceEvent) -> String {
    match ev {
        SourceEvent::Upsert(obj) => format!("upsert {} {}", obj.kind(), obj.key()),
        SourceEvent::Delete(kind, key) => format!("delete {kind} {key}"),
        SourceEvent::Synced(kind) => format!("synced {kind}"),
    }
}

async fn next(rx: &mut mpsc::Receiver<SourceEvent>, waiting_for: &str) -> SourceEvent {
    match timeout(CHANGE_DEADLINE, rx.recv()).await {
        Ok(Some(ev)) => ev,
        Ok(None) => panic!("source stopped while waiting for {waiting_for}"),
        Err(_) => panic!("no event within {CHANGE_DEADLINE:?} while waiting for {waiting_for}"),
    }
}

/// Receives `n` events, rendered, sorted (their order within one change is not part of the
/// contract).
async fn next_n(rx: &mut mpsc::Receiver<SourceEvent>, n: usize, waiting_for: &str) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(show(&next(rx, waiting_for).await));
    }
    out.sort();
    out
}

/// Writes a file the way tools should: elsewhere in the directory (a hidden name, which the
/// source ignores), then renamed into place.
fn write_atomic(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, text).expect("write temp file");
    fs::rename(&tmp, dir.join(name)).expect("rename into place");
}

fn source_errors(metrics: &Metrics, reason: &str) -> u64 {
    let prefix =
        format!("kubeproxy_rs_source_errors_total{{source=\"manifests\",reason=\"{reason}\"}} ");
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

/// Waits (up to 10 s) for the parse-error count to reach `want`: a broken file and another
/// file's change may be seen by two rescans in either order, so the count may trail the event.
async fn wait_source_errors(metrics: &Metrics, reason: &str, want: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let n = source_errors(metrics, reason);
        if n == want || std::time::Instant::now() >= deadline {
            assert_eq!(n, want, "{reason} errors");
            return;
        }
        assert!(n < want, "{reason} errors: {n}, more than {want}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_reports_the_directory_then_follows_live_edits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    fs::write(
        path.join("web.yaml"),
        format!("{}---\n{SLICE}", service("web", 80)),
    )
    .expect("write");
    fs::write(path.join("node.json"), NODE_JSON).expect("write");
    fs::write(path.join("notes.txt"), "not a manifest").expect("write");
    fs::write(path.join(".hidden.yaml"), service("hidden", 1)).expect("write");

    let metrics = Arc::new(Metrics::new());
    let (tx, mut rx) = mpsc::channel(64);
    let source = tokio::spawn(run_manifests(path.clone(), tx, metrics.clone()));

    // The initial read, then Synced for every kind.
    assert_eq!(
        next_n(&mut rx, 3, "the initial objects").await,
        [
            "upsert EndpointSlice ns/web-1",
            "upsert Node node-1",
            "upsert Service ns/web"
        ]
    );
    assert_eq!(
        next_n(&mut rx, 3, "Synced").await,
        ["synced EndpointSlice", "synced Node", "synced Service"]
    );

    // Edit in place: the port changes.
    fs::write(
        path.join("web.yaml"),
        format!("{}---\n{SLICE}", service("web", 8080)),
    )
    .expect("write");
    let ev = next(&mut rx, "the edited Service").await;
    let SourceEvent::Upsert(Object::Service(svc)) = &ev else {
        panic!("expected the Service, got {}", show(&ev))
    };
    let ports = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .expect("ports");
    assert_eq!(ports[0].port, 8080);

    // Drop the slice from the file.
    write_atomic(&path, "web.yaml", &service("web", 8080));
    assert_eq!(
        show(&next(&mut rx, "the slice's deletion").await),
        "delete EndpointSlice ns/web-1"
    );

    // A broken file reports nothing; the next good change is the next event.
    write_atomic(
        &path,
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: [\n",
    );
    write_atomic(&path, "db.yml", &service("db", 5432));
    assert_eq!(show(&next(&mut rx, "db.yml").await), "upsert Service ns/db");
    wait_source_errors(&metrics, "parse", 1).await;

    // Breaking a good file keeps its objects: deleting another file is the next event.
    write_atomic(
        &path,
        "db.yml",
        "apiVersion: v1\nkind: Service\nmetadata: [\n",
    );
    fs::remove_file(path.join("node.json")).expect("remove");
    assert_eq!(
        show(&next(&mut rx, "the Node's deletion").await),
        "delete Node node-1"
    );
    wait_source_errors(&metrics, "parse", 2).await;

    // Fixing it back to the same content reports nothing; removing it deletes its Service.
    write_atomic(&path, "db.yml", &service("db", 5432));
    fs::remove_file(path.join("db.yml")).expect("remove");
    assert_eq!(
        show(&next(&mut rx, "db's deletion").await),
        "delete Service ns/db"
    );

    // Dropping the receiver stops the source.
    drop(rx);
    let stopped = timeout(CHANGE_DEADLINE, source)
        .await
        .expect("source did not stop");
    assert!(matches!(stopped, Ok(Ok(()))), "{stopped:?}");
}

#[tokio::test]
async fn an_empty_directory_is_synced_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tx, mut rx) = mpsc::channel(8);
    let _source = tokio::spawn(run_manifests(
        dir.path().to_path_buf(),
        tx,
        Arc::new(Metrics::new()),
    ));
    let got: Vec<String> = vec![
        show(&next(&mut rx, "Synced").await),
        show(&next(&mut rx, "Synced").await),
        show(&next(&mut rx, "Synced").await),
    ];
    assert_eq!(
        got,
        ["synced Service", "synced EndpointSlice", "synced Node"]
    );
    // Nothing else is pending.
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn a_missing_directory_fails_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tx, _rx) = mpsc::channel(8);
    let res = timeout(
        CHANGE_DEADLINE,
        run_manifests(dir.path().join("absent"), tx, Arc::new(Metrics::new())),
    )
    .await
    .expect("did not fail promptly");
    let err = res.expect_err("a missing directory must fail");
    assert!(err.to_string().contains("absent"), "{err}");
}

/// The source's size limit for one file (`MAX_FILE_BYTES`, private to the source).
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// Makes `name` a file over the size limit without writing it: a sparse file. Sizes it in
/// place (one write to the directory entry's inode), so the source sees it change once.
fn set_size(dir: &Path, name: &str, len: u64) {
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(name))
        .expect("open");
    file.set_len(len).expect("set_len");
}

/// Rewrites `good.yaml` `n` times, waiting each time for its change: `n` rescans of the whole
/// directory, each of which sees every other file again.
async fn rescan_n(dir: &Path, rx: &mut mpsc::Receiver<SourceEvent>, round: &mut u16, n: usize) {
    for _ in 0..n {
        *round += 1;
        write_atomic(dir, "good.yaml", &service("good", *round));
        assert_eq!(
            show(&next(rx, "good.yaml's change").await),
            "upsert Service ns/good"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_file_is_reported_once_per_change_not_per_rescan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    fs::write(path.join("good.yaml"), service("good", 1)).expect("write");
    set_size(&path, "big.yaml", MAX_FILE_BYTES + 1);
    fs::write(path.join("latin1.yaml"), b"kind: Service # caf\xe9\n").expect("write");

    let metrics = Arc::new(Metrics::new());
    let (tx, mut rx) = mpsc::channel(64);
    let _source = tokio::spawn(run_manifests(path.clone(), tx, metrics.clone()));
    assert_eq!(
        show(&next(&mut rx, "the good file").await),
        "upsert Service ns/good"
    );
    assert_eq!(
        next_n(&mut rx, 3, "Synced").await,
        ["synced EndpointSlice", "synced Node", "synced Service"]
    );
    // Both bad files were reported by the first read, before Synced.
    assert_eq!(source_errors(&metrics, "read"), 2, "after the first read");

    // Other files' changes rescan the directory; the unchanged bad files stay quiet.
    let mut round = 1;
    rescan_n(&path, &mut rx, &mut round, 20).await;
    assert_eq!(source_errors(&metrics, "read"), 2, "after 20 rescans");

    // The big file changes but is still too big: reported once more, then quiet again.
    set_size(&path, "big.yaml", MAX_FILE_BYTES + 2);
    wait_source_errors(&metrics, "read", 3).await;
    rescan_n(&path, &mut rx, &mut round, 5).await;
    assert_eq!(
        source_errors(&metrics, "read"),
        3,
        "after the big file changed"
    );

    // The same for the file that is not UTF-8.
    let latin1_again = b"kind: Service # na\xefve\n";
    write_atomic_bytes(&path, "latin1.yaml", latin1_again);
    wait_source_errors(&metrics, "read", 4).await;
    rescan_n(&path, &mut rx, &mut round, 5).await;
    assert_eq!(
        source_errors(&metrics, "read"),
        4,
        "after latin1.yaml changed"
    );

    // Fixed, both are read as usual.
    write_atomic(&path, "big.yaml", &service("big", 80));
    assert_eq!(
        show(&next(&mut rx, "the fixed big file").await),
        "upsert Service ns/big"
    );
    write_atomic(&path, "latin1.yaml", &service("latin1", 80));
    assert_eq!(
        show(&next(&mut rx, "the fixed latin1.yaml").await),
        "upsert Service ns/latin1"
    );
    assert_eq!(source_errors(&metrics, "read"), 4, "after the fixes");

    // Broken again with the text it had before it was fixed: a change, so reported. Its last
    // good content stays: removing it is what deletes its Service.
    write_atomic_bytes(&path, "latin1.yaml", latin1_again);
    wait_source_errors(&metrics, "read", 5).await;
    fs::remove_file(path.join("latin1.yaml")).expect("remove");
    assert_eq!(
        show(&next(&mut rx, "latin1.yaml's removal").await),
        "delete Service ns/latin1"
    );
    // Removal forgets the failure: the same bad text again is reported again.
    write_atomic_bytes(&path, "latin1.yaml", latin1_again);
    wait_source_errors(&metrics, "read", 6).await;
    rescan_n(&path, &mut rx, &mut round, 5).await;
    assert_eq!(source_errors(&metrics, "read"), 6, "at the end");
    assert_eq!(source_errors(&metrics, "parse"), 0);
    assert!(rx.try_recv().is_err(), "nothing else is pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_file_is_reported_once_per_change_not_per_rescan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    fs::write(path.join("good.yaml"), service("good", 1)).expect("write");
    let broken = "apiVersion: v1\nkind: Service\nmetadata: {name: [\n";
    fs::write(path.join("broken.yaml"), broken).expect("write");

    let metrics = Arc::new(Metrics::new());
    let (tx, mut rx) = mpsc::channel(64);
    let _source = tokio::spawn(run_manifests(path.clone(), tx, metrics.clone()));
    assert_eq!(
        next_n(&mut rx, 4, "the first read").await,
        [
            "synced EndpointSlice",
            "synced Node",
            "synced Service",
            "upsert Service ns/good"
        ]
    );
    assert_eq!(source_errors(&metrics, "parse"), 1, "after the first read");
    let mut round = 1;
    rescan_n(&path, &mut rx, &mut round, 10).await;
    assert_eq!(source_errors(&metrics, "parse"), 1, "after 10 rescans");

    // Broken differently: reported once more.
    write_atomic(&path, "broken.yaml", &format!("{broken}# still\n"));
    wait_source_errors(&metrics, "parse", 2).await;
    rescan_n(&path, &mut rx, &mut round, 5).await;
    assert_eq!(source_errors(&metrics, "parse"), 2, "after the change");
    assert_eq!(source_errors(&metrics, "read"), 0);
}

/// [`write_atomic`] for bytes that are not text.
fn write_atomic_bytes(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, bytes).expect("write temp file");
    fs::rename(&tmp, dir.join(name)).expect("rename into place");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_in_several_steps_is_read_once_the_writer_is_done() {
    use std::io::Write;

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    let both = |port| format!("{}---\n{}", service("a", port), service("b", port));
    fs::write(path.join("ab.yaml"), both(80)).expect("write");
    let (tx, mut rx) = mpsc::channel(64);
    let _source = tokio::spawn(run_manifests(path.clone(), tx, Arc::new(Metrics::new())));
    assert_eq!(
        next_n(&mut rx, 5, "the first read").await,
        [
            "synced EndpointSlice",
            "synced Node",
            "synced Service",
            "upsert Service ns/a",
            "upsert Service ns/b"
        ]
    );

    // Rewritten in place, in steps with pauses longer than the quiet period: after the first
    // step the file holds only `a`, a state that would delete `b` if it were read.
    let mut file = fs::File::create(path.join("ab.yaml")).expect("truncate");
    file.write_all(service("a", 81).as_bytes()).expect("write");
    file.flush().expect("flush");
    tokio::time::sleep(Duration::from_millis(30)).await;
    file.write_all(b"---\n").expect("write");
    tokio::time::sleep(Duration::from_millis(30)).await;
    file.write_all(service("b", 81).as_bytes()).expect("write");
    drop(file);
    // One consistent read: both changed, nothing deleted in between.
    assert_eq!(
        next_n(&mut rx, 2, "the rewritten file").await,
        ["upsert Service ns/a", "upsert Service ns/b"]
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(rx.try_recv().is_err(), "nothing else is reported");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_is_reported_quickly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    // Other files, to read around the one that changes.
    for i in 0..20 {
        let text: Vec<String> = (0..20).map(|k| service(&format!("s{i}-{k}"), 80)).collect();
        fs::write(path.join(format!("f{i:02}.yaml")), text.join("---\n")).expect("write");
    }
    let (tx, mut rx) = mpsc::channel(1024);
    let _source = tokio::spawn(run_manifests(path.clone(), tx, Arc::new(Metrics::new())));
    let mut synced = 0;
    while synced < 3 {
        if let SourceEvent::Synced(_) = next(&mut rx, "the first read").await {
            synced += 1;
        }
    }
    let mut took = Vec::new();
    for round in 1..=10u16 {
        let start = std::time::Instant::now();
        write_atomic(&path, "web.yaml", &service("web", 8000 + round));
        assert_eq!(
            show(&next(&mut rx, "the change").await),
            "upsert Service ns/web"
        );
        took.push(start.elapsed());
    }
    took.sort();
    println!("change to event: median {:?}, max {:?}", took[5], took[9]);
    // Generous: a loaded machine may stall any one change, but not most of them.
    assert!(
        took[5] < Duration::from_millis(500),
        "median change took {:?}",
        took[5]
    );
}

/// A v1 Endpoints for Service `ns/web`, ready at `ip` and not ready at 10.0.0.99.
fn endpoints(ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Endpoints\nmetadata:\n  name: web\n  namespace: ns\nsubsets:\n\
         - addresses:\n  - ip: {ip}\n  notReadyAddresses:\n  - ip: 10.0.0.99\n  ports:\n\
         \x20 - name: http\n    port: 8080\n    protocol: TCP\n"
    )
}

/// The endpoints of `ns/web`'s port `http` in `state`: `ip:port` and whether ready.
fn web_endpoints(state: &kp_core::track::ProxyState) -> Vec<(String, bool)> {
    let name = kp_core::model::ServicePortName {
        service: kp_core::model::ServiceKey::new("ns", "web"),
        port: "http".into(),
        protocol: kp_core::model::Protocol::Tcp,
    };
    state
        .endpoints(&name)
        .iter()
        .map(|e| (e.to_string(), e.ready))
        .collect()
}

/// Receives one event and applies it to `state`, returning it rendered.
async fn apply_next(
    rx: &mut mpsc::Receiver<SourceEvent>,
    state: &mut kp_core::track::ProxyState,
    waiting_for: &str,
) -> String {
    let ev = next(rx, waiting_for).await;
    let shown = show(&ev);
    state.apply(ev).expect("accepted");
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_with_a_v1_endpoints_gets_its_endpoints_and_follows_edits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    fs::write(path.join("web.yaml"), service("web", 80)).expect("write");
    fs::write(path.join("web-endpoints.yaml"), endpoints("10.0.0.1")).expect("write");

    let (tx, mut rx) = mpsc::channel(64);
    let _source = tokio::spawn(run_manifests(path.clone(), tx, Arc::new(Metrics::new())));
    let mut state = kp_core::track::ProxyState::new("node-1");
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(apply_next(&mut rx, &mut state, "the initial read").await);
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "synced EndpointSlice",
            "synced Node",
            "synced Service",
            "upsert Endpoints ns/web",
            "upsert Service ns/web",
        ]
    );
    assert_eq!(
        web_endpoints(&state),
        [
            ("10.0.0.1:8080".into(), true),
            ("10.0.0.99:8080".into(), false)
        ]
    );
    let selected = state.service_state(&kp_core::model::ServiceKey::new("ns", "web"));
    assert_eq!(
        selected[0].endpoints.cluster.len(),
        1,
        "the ready one is used"
    );

    // Editing the Endpoints file moves the Service to the new address.
    write_atomic(&path, "web-endpoints.yaml", &endpoints("10.0.0.2"));
    assert_eq!(
        apply_next(&mut rx, &mut state, "the edited Endpoints").await,
        "upsert Endpoints ns/web"
    );
    assert_eq!(
        web_endpoints(&state),
        [
            ("10.0.0.2:8080".into(), true),
            ("10.0.0.99:8080".into(), false)
        ]
    );

    // A real EndpointSlice for the Service wins; removing it brings the Endpoints back.
    let slice = SLICE.replace("10.0.0.1", "10.0.0.3");
    write_atomic(&path, "web-slice.yaml", &slice);
    assert_eq!(
        apply_next(&mut rx, &mut state, "the slice").await,
        "upsert EndpointSlice ns/web-1"
    );
    assert_eq!(web_endpoints(&state), [("10.0.0.3:8080".into(), true)]);
    fs::remove_file(path.join("web-slice.yaml")).expect("remove");
    assert_eq!(
        apply_next(&mut rx, &mut state, "the slice's deletion").await,
        "delete EndpointSlice ns/web-1"
    );
    assert_eq!(
        web_endpoints(&state),
        [
            ("10.0.0.2:8080".into(), true),
            ("10.0.0.99:8080".into(), false)
        ]
    );

    // Removing the Endpoints file leaves the Service without endpoints.
    fs::remove_file(path.join("web-endpoints.yaml")).expect("remove");
    assert_eq!(
        apply_next(&mut rx, &mut state, "the Endpoints' deletion").await,
        "delete Endpoints ns/web"
    );
    assert!(web_endpoints(&state).is_empty());
}
