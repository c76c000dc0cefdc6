//! The sync loop with a fake dataplane, on paused time.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::dataplane::{
    CheckOutcome, CheckRead, Dataplane, DataplaneError, HeldBackend, KernelRead, SyncReport,
};
use kp_core::model::{IpFamily, Protocol};
use kp_core::sync::SyncSchedule;
use kp_core::track::{Changes, Kind, Object, ProxyState, SourceEvent};
use kp_metrics::Metrics;
use kp_serve::{ProxyHealth, SharedHealth};
use serde_json::json;
use tokio::sync::{mpsc, oneshot, watch};

use super::{programming_latencies, SyncLoop};
use crate::Fatal;

const MIN_SYNC: Duration = Duration::from_millis(100);
const SYNC_PERIOD: Duration = Duration::from_secs(30);

/// What the fake was asked to do, and when (on tokio's paused clock).
#[derive(Clone, Debug, PartialEq)]
enum Call {
    Start,
    Sync {
        full: bool,
        services: usize,
        at: Duration,
    },
    Tick,
    Shutdown,
    /// A drift check's read started.
    CheckBegin {
        at: Duration,
    },
    /// A drift check's read came back and was compared.
    CheckFinish {
        at: Duration,
    },
    /// Handed a set of held endpoints of this size.
    Hold(usize),
}

/// Drift checks off the loop, for a fake that offers them: each read blocks while `held`, and
/// each comparison answers the next scripted outcome (none left: clean).
#[derive(Default)]
struct Checks {
    held: Mutex<bool>,
    release: std::sync::Condvar,
    outcomes: Mutex<VecDeque<CheckOutcome>>,
    /// The thread each read ran on, in order.
    readers: Mutex<Vec<std::thread::ThreadId>>,
}

impl Checks {
    fn hold(&self) {
        *self.held.lock().unwrap() = true;
    }

    fn release(&self) {
        *self.held.lock().unwrap() = false;
        self.release.notify_all();
    }

    fn answer(&self, outcome: CheckOutcome) {
        self.outcomes.lock().unwrap().push_back(outcome);
    }
}

/// A dataplane that programs nothing: it records each call and answers syncs from a script
/// (an empty script answers success).
#[derive(Clone, Default)]
struct FakeDataplane {
    calls: Arc<Mutex<Vec<Call>>>,
    script: Arc<Mutex<VecDeque<Result<(), DataplaneError>>>>,
    deadline: Arc<Mutex<Option<std::time::Instant>>>,
    epoch: Option<tokio::time::Instant>,
    /// Set: the fake checks for drift off the loop.
    checks: Option<Arc<Checks>>,
    /// The held endpoints it was last handed.
    held: Arc<Mutex<BTreeSet<HeldBackend>>>,
}

impl FakeDataplane {
    fn new() -> Self {
        FakeDataplane {
            epoch: Some(tokio::time::Instant::now()),
            ..FakeDataplane::default()
        }
    }

    fn checking() -> (Self, Arc<Checks>) {
        let checks = Arc::new(Checks::default());
        let fake = FakeDataplane {
            checks: Some(checks.clone()),
            ..FakeDataplane::new()
        };
        (fake, checks)
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn syncs(&self) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| matches!(c, Call::Sync { .. }))
            .collect()
    }

    fn fail_next(&self, error: DataplaneError) {
        self.script.lock().unwrap().push_back(Err(error));
    }

    fn elapsed(&self) -> Duration {
        self.epoch.map(|e| e.elapsed()).unwrap_or_default()
    }
}

impl Dataplane for FakeDataplane {
    fn mode(&self) -> &'static str {
        "fake"
    }

    fn start(&mut self) -> Result<(), DataplaneError> {
        self.calls.lock().unwrap().push(Call::Start);
        Ok(())
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let services = if full {
            state.service_keys().count()
        } else {
            changes.services.len()
        };
        self.calls.lock().unwrap().push(Call::Sync {
            full,
            services,
            at: self.elapsed(),
        });
        self.script.lock().unwrap().pop_front().unwrap_or(Ok(()))?;
        Ok(SyncReport {
            full,
            operations: services,
            no_local_endpoints: (0, 0),
        })
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        Ok(Vec::new())
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        Ok(())
    }

    fn next_deadline(&self) -> Option<std::time::Instant> {
        *self.deadline.lock().unwrap()
    }

    fn tick(&mut self, _now: std::time::Instant) -> Result<(), DataplaneError> {
        self.calls.lock().unwrap().push(Call::Tick);
        *self.deadline.lock().unwrap() = None;
        Ok(())
    }

    fn shutdown(&mut self) {
        self.calls.lock().unwrap().push(Call::Shutdown);
    }

    fn hold_backends(&mut self, held: &BTreeSet<HeldBackend>) -> bool {
        self.calls.lock().unwrap().push(Call::Hold(held.len()));
        let mut last = self.held.lock().unwrap();
        let changed = *last != *held;
        *last = held.clone();
        changed
    }

    fn begin_check(&mut self) -> Option<KernelRead> {
        let checks = self.checks.clone()?;
        self.calls
            .lock()
            .unwrap()
            .push(Call::CheckBegin { at: self.elapsed() });
        Some(Box::new(move || {
            checks
                .readers
                .lock()
                .unwrap()
                .push(std::thread::current().id());
            let mut held = checks.held.lock().unwrap();
            while *held {
                held = checks.release.wait(held).unwrap();
            }
            CheckRead(Box::new(()))
        }))
    }

    fn finish_check(&mut self, _state: &ProxyState, read: CheckRead) -> CheckOutcome {
        assert!(read.0.downcast::<()>().is_ok(), "the fake's own read");
        self.calls
            .lock()
            .unwrap()
            .push(Call::CheckFinish { at: self.elapsed() });
        let checks = self.checks.as_ref().expect("a check was begun");
        let next = checks.outcomes.lock().unwrap().pop_front();
        next.unwrap_or(CheckOutcome::Clean)
    }
}

fn service(name: &str) -> SourceEvent {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"namespace": "web", "name": name},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]},
    }))
    .unwrap();
    SourceEvent::Upsert(Object::Service(Box::new(svc)))
}

/// A slice of Service `web/<service>` with one ready endpoint, changed at `trigger` (Unix
/// seconds), as the EndpointSlice controller stamps it.
fn slice(service: &str, ip: &str, trigger: f64) -> SourceEvent {
    let stamp = kp_serve::rfc3339::format(std::time::UNIX_EPOCH + Duration::from_secs_f64(trigger));
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {
            "namespace": "web",
            "name": format!("{service}-abc"),
            "labels": {"kubernetes.io/service-name": service},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": stamp},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }))
    .unwrap();
    SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice)))
}

fn synced_all() -> Vec<SourceEvent> {
    [Kind::Service, Kind::EndpointSlice, Kind::Node]
        .into_iter()
        .map(SourceEvent::Synced)
        .collect()
}

/// A running loop over `fake`: its event sender, its stop switch, and its outcome.
struct Running {
    tx: mpsc::Sender<SourceEvent>,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<(Result<(), Fatal>, Arc<Metrics>)>,
    health: SharedHealth,
}

impl Running {
    async fn send(&self, events: impl IntoIterator<Item = SourceEvent>) {
        for ev in events {
            self.tx.send(ev).await.unwrap();
        }
    }

    async fn stop(mut self) -> (Result<(), Fatal>, Arc<Metrics>) {
        let _ = self.stop.take().unwrap().send(());
        self.done.await.unwrap()
    }
}

fn start(fake: &FakeDataplane) -> Running {
    start_holding(fake, None)
}

/// [`start`], following `held` when given.
fn start_holding(
    fake: &FakeDataplane,
    held: Option<watch::Receiver<BTreeSet<HeldBackend>>>,
) -> Running {
    let (tx, rx) = mpsc::channel(64);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let metrics = Arc::new(Metrics::new());
    let health = SharedHealth::new(ProxyHealth::new(SYNC_PERIOD * 2, [IpFamily::V4]));
    let mut sync_loop = SyncLoop::new(
        ProxyState::new("node-a".to_string()),
        SyncSchedule::new(MIN_SYNC, SYNC_PERIOD),
        Box::new(fake.clone()),
        metrics.clone(),
        health.clone(),
        None,
    );
    if let Some(held) = held {
        sync_loop = sync_loop.with_held_backends(held);
    }
    let done = tokio::spawn(async move {
        let result = sync_loop
            .run(rx, async {
                let _ = stop_rx.await;
            })
            .await;
        (result, metrics)
    });
    Running {
        tx,
        stop: Some(stop_tx),
        done,
        health,
    }
}

/// While a check's read is out (begun, not finished), gives its thread real time, a paused
/// millisecond at a time, for at most 5 real seconds.
async fn check_settles(fake: &FakeDataplane) {
    let out = |c: &[Call]| {
        count(c, |c| matches!(c, Call::CheckBegin { .. }))
            > count(c, |c| matches!(c, Call::CheckFinish { .. }))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while out(&fake.calls()) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn wait(d: Duration) {
    tokio::time::sleep(d).await;
}

/// Waits (on paused time, while a read may block on another thread) until `cond` holds of the
/// fake's calls, at most `limit`.
async fn wait_for(fake: &FakeDataplane, limit: Duration, cond: impl Fn(&[Call]) -> bool) {
    let until = tokio::time::Instant::now() + limit;
    while !cond(&fake.calls()) {
        assert!(
            tokio::time::Instant::now() < until,
            "not within {limit:?}: {:?}",
            fake.calls()
        );
        // Real time for the read's thread to run, then a paused-time millisecond.
        std::thread::sleep(Duration::from_millis(1));
        wait(Duration::from_millis(1)).await;
    }
}

/// The (full, at) of every sync.
fn sync_times(fake: &FakeDataplane) -> Vec<(bool, Duration)> {
    fake.syncs()
        .iter()
        .map(|c| match c {
            Call::Sync { full, at, .. } => (*full, *at),
            _ => unreachable!(),
        })
        .collect()
}

fn count(calls: &[Call], f: impl Fn(&Call) -> bool) -> usize {
    calls.iter().filter(|c| f(c)).count()
}

fn metric(metrics: &Metrics, name: &str) -> String {
    let text = metrics.encode();
    text.lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
        .to_string()
}

#[tokio::test(start_paused = true)]
async fn the_first_sync_waits_for_every_initial_list_and_is_full() {
    let fake = FakeDataplane::new();
    let running = start(&fake);
    running
        .send([service("web"), slice("web", "10.244.1.5", 1_000_000.0)])
        .await;
    running
        .send([
            SourceEvent::Synced(Kind::Service),
            SourceEvent::Synced(Kind::EndpointSlice),
        ])
        .await;
    wait(Duration::from_secs(5)).await;
    assert_eq!(fake.calls(), [Call::Start], "no sync before the Node list");
    running.send([SourceEvent::Synced(Kind::Node)]).await;
    wait(Duration::from_secs(1)).await;
    assert!(
        matches!(
            fake.syncs()[..],
            [Call::Sync {
                full: true,
                services: 1,
                ..
            }]
        ),
        "{:?}",
        fake.calls()
    );
    let (result, _) = running.stop().await;
    assert!(result.is_ok());
    assert_eq!(fake.calls().last(), Some(&Call::Shutdown));
}

#[tokio::test(start_paused = true)]
async fn a_failed_sync_is_retried_with_backoff_and_the_retry_is_full() {
    let fake = FakeDataplane::new();
    let running = start(&fake);
    running.send(synced_all()).await;
    running.send([service("web")]).await;
    wait(Duration::from_secs(1)).await;
    // The first sync succeeded; the next change's partial sync fails twice.
    fake.fail_next(DataplaneError::transient(std::io::Error::other("refused")));
    fake.fail_next(DataplaneError::transient(std::io::Error::other("refused")));
    running.send([service("api")]).await;
    wait(Duration::from_secs(10)).await;
    let syncs = fake.syncs();
    let fulls: Vec<(bool, Duration)> = syncs
        .iter()
        .map(|c| match c {
            Call::Sync { full, at, .. } => (*full, *at),
            _ => unreachable!(),
        })
        .collect();
    assert!(fulls.len() >= 4, "{fulls:?}");
    assert!(!fulls[1].0, "a change syncs partially: {fulls:?}");
    assert!(fulls[2].0 && fulls[3].0, "retries are full: {fulls:?}");
    let first_wait = fulls[2].1 - fulls[1].1;
    let second_wait = fulls[3].1 - fulls[2].1;
    assert!(first_wait >= Duration::from_secs(1), "{fulls:?}");
    assert!(second_wait >= 2 * first_wait, "backoff doubles: {fulls:?}");
    let (result, _) = running.stop().await;
    assert!(result.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_failure_no_retry_can_cure_stops_the_loop() {
    let fake = FakeDataplane::new();
    fake.fail_next(DataplaneError::permanent(std::io::Error::from(
        std::io::ErrorKind::PermissionDenied,
    )));
    let running = start(&fake);
    running.send(synced_all()).await;
    running.send([service("web")]).await;
    let (result, _) = running.done.await.unwrap();
    match result {
        Err(Fatal::Dataplane { mode: "fake", .. }) => {}
        other => panic!("the loop went on: {other:?}"),
    }
    assert_eq!(fake.syncs().len(), 1, "tried once: {:?}", fake.calls());
}

#[tokio::test(start_paused = true)]
async fn a_periodic_full_sync_lets_the_mode_check_for_drift() {
    let fake = FakeDataplane::new();
    let running = start(&fake);
    running.send(synced_all()).await;
    running.send([service("web")]).await;
    wait(Duration::from_secs(1)).await;
    running.send([service("api")]).await;
    wait(SYNC_PERIOD * 2 + Duration::from_secs(1)).await;
    let fulls: Vec<bool> = fake
        .syncs()
        .iter()
        .map(|c| matches!(c, Call::Sync { full: true, .. }))
        .collect();
    assert_eq!(fulls, [true, false, true, true], "{:?}", fake.calls());
    running.stop().await.0.unwrap();
}

#[tokio::test(start_paused = true)]
async fn health_is_updated_by_each_sync_and_latency_is_observed_for_new_changes() {
    let fake = FakeDataplane::new();
    let running = start(&fake);
    let started = super::unix_now();
    running.send(synced_all()).await;
    // One slice changed a day before the proxy started (not this proxy's latency), one now.
    running
        .send([
            service("web"),
            slice("web", "10.244.1.5", started - 86_400.0),
            service("api"),
            slice("api", "10.244.1.6", started + 1.0),
        ])
        .await;
    wait(Duration::from_secs(1)).await;
    let status = running.health.status();
    assert!(status.healthy, "{status:?}");
    assert!(status.last_updated.is_some(), "{status:?}");
    let (result, metrics) = running.stop().await;
    result.unwrap();
    let text = metrics.encode();
    let count = text
        .lines()
        .find(|l| l.starts_with("kubeproxy_network_programming_duration_seconds_count"))
        .unwrap_or_else(|| panic!("no programming latency in:\n{text}"));
    assert!(count.ends_with(" 1"), "{count}");
}

#[tokio::test(start_paused = true)]
async fn the_modes_timer_runs_its_work_when_due() {
    let fake = FakeDataplane::new();
    *fake.deadline.lock().unwrap() =
        Some(tokio::time::Instant::now().into_std() + Duration::from_secs(3));
    let running = start(&fake);
    wait(Duration::from_secs(2)).await;
    assert!(!fake.calls().contains(&Call::Tick));
    wait(Duration::from_secs(2)).await;
    assert_eq!(fake.calls(), [Call::Start, Call::Tick]);
    running.stop().await.0.unwrap();
}

/// Measured against upstream's behaviour: the initial list's old trigger times (862 s summed
/// over 20 observations at start in one run) are not latencies of this proxy.
#[test]
fn trigger_times_from_before_the_start_are_not_observed() {
    let started_at = 1_000.0;
    let got: Vec<f64> = programming_latencies(
        &[10.0, 999.9, 1_000.0, 1_004.5, 1_011.0],
        started_at,
        1_010.0,
    )
    .collect();
    assert_eq!(got, [10.0, 5.5, 0.0]);
}

/// The bound of issue #17: a one-endpoint change is programmed within 20 ms, whatever periodic
/// work is running.
const CHANGE_BOUND: Duration = Duration::from_millis(20);

#[tokio::test(start_paused = true)]
async fn a_change_while_the_periodic_check_reads_is_applied_at_once_and_drift_is_still_repaired() {
    let (fake, checks) = FakeDataplane::checking();
    checks.hold();
    let running = start(&fake);
    running.send(synced_all()).await;
    running.send([service("web")]).await;
    wait(Duration::from_secs(1)).await;
    assert_eq!(sync_times(&fake).len(), 1, "{:?}", fake.calls());
    // The period passes: the check starts in place of a full sync, and its read hangs.
    wait(SYNC_PERIOD).await;
    let calls = fake.calls();
    assert_eq!(
        count(&calls, |c| matches!(c, Call::CheckBegin { .. })),
        1,
        "{calls:?}"
    );
    assert_eq!(
        sync_times(&fake).len(),
        1,
        "no full sync in line: {calls:?}"
    );
    // A change while the read runs: synced partially, at once.
    let sent = fake.elapsed();
    running.send([service("api")]).await;
    wait_for(&fake, Duration::from_secs(1), |c| {
        count(c, |c| matches!(c, Call::Sync { .. })) == 2
    })
    .await;
    let (full, at) = sync_times(&fake)[1];
    assert!(!full, "{:?}", fake.calls());
    assert!(at - sent <= CHANGE_BOUND, "waited {:?}", at - sent);
    assert!(
        !fake
            .calls()
            .iter()
            .any(|c| matches!(c, Call::CheckFinish { .. })),
        "the read is still running"
    );
    // The read comes back showing drift: a full sync repairs it.
    checks.answer(CheckOutcome::Drift(vec![
        "ip: set X: 1 elements missing".into()
    ]));
    checks.release();
    wait_for(&fake, Duration::from_secs(1), |c| {
        count(c, |c| matches!(c, Call::Sync { full: true, .. })) == 2
    })
    .await;
    let finished = fake
        .calls()
        .iter()
        .find_map(|c| match c {
            Call::CheckFinish { at } => Some(*at),
            _ => None,
        })
        .unwrap();
    let (full, at) = *sync_times(&fake).last().unwrap();
    assert!(full);
    assert!(
        at - finished <= MIN_SYNC,
        "repaired {:?} after",
        at - finished
    );
    running.stop().await.0.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_clean_check_counts_as_the_periods_full_sync_and_changes_never_wait_for_it() {
    let (fake, _checks) = FakeDataplane::checking();
    let running = start(&fake);
    running.send(synced_all()).await;
    running.send([service("web")]).await;
    // Changes every 700 ms across three periods, one of them as a check falls due.
    let mut sent = Vec::new();
    for i in 0..130u32 {
        wait(Duration::from_millis(700)).await;
        sent.push(fake.elapsed());
        running
            .send([slice("web", &format!("10.244.1.{}", i % 200 + 1), 0.0)])
            .await;
        // The read runs on a thread in real time; paused time would race through the periods
        // while that thread waits for a CPU (a loaded runner), so let it finish here first.
        check_settles(&fake).await;
    }
    // The reads run on a thread, in real time, while paused time runs on; the last change
    // may be synced just after the third read comes back.
    let changes = sent.len();
    wait_for(&fake, Duration::from_secs(5), |c| {
        count(c, |c| matches!(c, Call::CheckFinish { .. })) == 3
            && count(c, |c| matches!(c, Call::Sync { .. })) == 1 + changes
    })
    .await;
    let calls = fake.calls();
    let syncs = sync_times(&fake);
    assert_eq!(syncs.len(), 1 + sent.len(), "{calls:?}");
    assert!(syncs[1..].iter().all(|(full, _)| !full), "{syncs:?}");
    for (s, (_, at)) in sent.iter().zip(&syncs[1..]) {
        assert!(*at - *s <= CHANGE_BOUND, "waited {:?}", *at - *s);
    }
    let begun = count(&calls, |c| matches!(c, Call::CheckBegin { .. }));
    let finished = count(&calls, |c| matches!(c, Call::CheckFinish { .. }));
    assert_eq!((begun, finished), (3, 3), "one check a period: {calls:?}");
    let (result, metrics) = running.stop().await;
    result.unwrap();
    // The first sync and three checks are the full syncs; the changes the partial ones.
    assert!(metric(
        &metrics,
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
    )
    .ends_with(" 4"));
    assert!(metric(
        &metrics,
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count"
    )
    .ends_with(&format!(" {}", sent.len())));
}

#[tokio::test(start_paused = true)]
async fn an_unsure_check_reads_again_and_repairs_only_if_the_second_read_differs_too() {
    let (fake, checks) = FakeDataplane::checking();
    let running = start(&fake);
    running.send(synced_all()).await;
    running.send([service("web")]).await;
    // First period: unsure, then clean on the second read: no repair.
    checks.answer(CheckOutcome::Unsure(vec!["maybe".into()]));
    wait(SYNC_PERIOD).await;
    wait_for(&fake, Duration::from_secs(5), |c| {
        count(c, |c| matches!(c, Call::CheckFinish { .. })) == 2
    })
    .await;
    wait(Duration::from_secs(1)).await;
    let calls = fake.calls();
    assert_eq!(
        count(&calls, |c| matches!(c, Call::CheckBegin { .. })),
        2,
        "{calls:?}"
    );
    assert_eq!(sync_times(&fake).len(), 1, "{calls:?}");
    // Second period: unsure twice: a full sync repairs.
    checks.answer(CheckOutcome::Unsure(vec!["maybe".into()]));
    checks.answer(CheckOutcome::Unsure(vec!["still".into()]));
    wait(SYNC_PERIOD).await;
    wait_for(&fake, Duration::from_secs(5), |c| {
        count(c, |c| matches!(c, Call::Sync { full: true, .. })) == 2
    })
    .await;
    let calls = fake.calls();
    assert_eq!(
        count(&calls, |c| matches!(c, Call::CheckFinish { .. })),
        4,
        "{calls:?}"
    );
    let syncs = sync_times(&fake);
    assert_eq!(syncs.len(), 2, "{calls:?}");
    assert!(syncs[1].0, "the repair is full: {syncs:?}");
    // Every read ran on one thread of the loop's own (one malloc arena for all of them), not
    // on the loop's.
    let readers = checks.readers.lock().unwrap().clone();
    assert_eq!(readers.len(), 4);
    assert!(readers.iter().all(|t| *t == readers[0]), "{readers:?}");
    assert_ne!(readers[0], std::thread::current().id());
    running.stop().await.0.unwrap();
}

fn held(addrs: &[&str]) -> BTreeSet<HeldBackend> {
    addrs
        .iter()
        .map(|a| HeldBackend {
            protocol: Protocol::Tcp,
            addr: a.parse().unwrap(),
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn held_endpoints_reach_the_mode_before_its_first_sync_and_a_change_makes_the_next_sync_full()
{
    let fake = FakeDataplane::new();
    let (held_tx, held_rx) = watch::channel(held(&["10.244.1.5:8080"]));
    let running = start_holding(&fake, Some(held_rx));
    running
        .send([service("web"), slice("web", "10.244.1.5", 1_000_000.0)])
        .await;
    running.send(synced_all()).await;
    wait(Duration::from_secs(1)).await;
    let calls = fake.calls();
    assert!(
        matches!(
            calls[..],
            [Call::Start, Call::Hold(1), Call::Sync { full: true, .. }]
        ),
        "the set read before the first sync is handed over before it: {calls:?}"
    );
    // A change syncs partially, as ever.
    running
        .send([slice("web", "10.244.1.6", 1_000_001.0)])
        .await;
    wait(Duration::from_secs(1)).await;
    assert!(
        matches!(fake.syncs().last(), Some(Call::Sync { full: false, .. })),
        "{:?}",
        fake.calls()
    );
    // A new set, with no change of any object: one full sync.
    held_tx.send(held(&[])).unwrap();
    wait(Duration::from_secs(1)).await;
    let syncs = fake.syncs();
    assert_eq!(syncs.len(), 3, "{:?}", fake.calls());
    assert!(
        matches!(syncs[2], Call::Sync { full: true, .. }),
        "{syncs:?}"
    );
    // The same set again changes nothing the mode programs: no sync.
    held_tx.send(held(&[])).unwrap();
    wait(Duration::from_secs(1)).await;
    assert_eq!(fake.syncs().len(), 3, "{:?}", fake.calls());
    assert_eq!(count(&fake.calls(), |c| *c == Call::Hold(0)), 2);
    // The removal is done (the sender goes): the loop goes on.
    drop(held_tx);
    running
        .send([slice("web", "10.244.1.7", 1_000_002.0)])
        .await;
    wait(Duration::from_secs(1)).await;
    assert_eq!(fake.syncs().len(), 4, "{:?}", fake.calls());
    let (result, _) = running.stop().await;
    assert!(result.is_ok());
}
