//! The Kubernetes API source: one kube-runtime `watcher` per kind.
//!
//! Mirrors upstream `pkg/proxy/config/config.go` (`ServiceConfig`, `EndpointSliceConfig`,
//! `NodeConfig`) and the informer selectors in `cmd/kube-proxy/app/server.go`. Where upstream's
//! informers keep a cache and diff it on re-list, `RelistTracker` keeps only each
//! object's key and resourceVersion, which is enough to report what vanished. Lists are read
//! in pages of [`LIST_PAGE_SIZE`], and the watchers run on a thread of their own (see
//! [`run_kubernetes_with`]): both keep the peak memory of a large initial list down.

mod tracker;

use std::fmt::Debug;
use std::path::Path;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::convert::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};
use kp_core::track::{Kind, Object, SourceEvent};
use kp_metrics::Metrics;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::utils::{Backoff, WatchStreamExt};
use kube::runtime::watcher::{self, watcher, DefaultBackoff};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::{debug, error, warn};

use crate::SourceError;

pub(crate) use tracker::RelistTracker;

/// The `source` label of this source's error metric.
const SOURCE: &str = "kubernetes";

/// How the watchers wait after an error before they list or watch again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RetryPolicy {
    /// kube-runtime's `DefaultBackoff`, taken from client-go's reflector: 0.8 s doubling to 30 s,
    /// with jitter, starting over after 2 minutes without errors. Kind to a struggling API
    /// server; use it in production.
    #[default]
    Default,
    /// Starts at `initial`, doubles after each consecutive error up to `max`, without jitter,
    /// and starts over after any success. Meant for tests against a fake API server.
    Exponential {
        /// Delay after the first error.
        initial: Duration,
        /// Longest delay.
        max: Duration,
    },
}

impl RetryPolicy {
    fn backoff(self) -> Box<dyn Backoff> {
        match self {
            RetryPolicy::Default => Box::new(DefaultBackoff::default()),
            RetryPolicy::Exponential { initial, max } => Box::new(Doubling {
                initial,
                max,
                next: initial,
            }),
        }
    }
}

/// The backoff of [`RetryPolicy::Exponential`].
struct Doubling {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Iterator for Doubling {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let current = self.next.min(self.max);
        self.next = current.saturating_mul(2).min(self.max);
        Some(current)
    }
}

impl Backoff for Doubling {
    fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// Builds a client the way upstream's `--kubeconfig` and `--master` flags do.
///
/// With `kubeconfig`, that file's current context is used. Without it, kube-rs infers the
/// configuration: `$KUBECONFIG` or `~/.kube/config`, else the in-cluster service account.
/// `master` replaces the server URL of whichever configuration was found; given alone, with
/// nothing to infer, it is used without credentials (as upstream does).
pub async fn client_from(
    kubeconfig: Option<&Path>,
    master: Option<&str>,
) -> Result<kube::Client, SourceError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(SourceError::Kubeconfig)?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(SourceError::Kubeconfig)?
        }
        None => match (kube::Config::infer().await, master) {
            (Ok(config), _) => config,
            (Err(err), Some(url)) => {
                debug!(error = %err, "no kubeconfig or in-cluster config; using --master alone");
                kube::Config::new(parse_master(url)?)
            }
            (Err(err), None) => return Err(SourceError::InferConfig(err)),
        },
    };
    if let Some(url) = master {
        config.cluster_url = parse_master(url)?;
    }
    // kube's client would retry 429/503/504 on its own, up to 15 times with a backoff that can
    // reach minutes, invisibly: the watchers' own backoff (capped, logged and counted) is the
    // one that should decide, as client-go's reflector does.
    config.default_retry = false;
    // A server that goes silent without closing the connection must not stall a watch forever:
    // watches ask for at most 290 s, so a read that waits longer than that is dead.
    config.read_timeout.get_or_insert(WATCH_READ_TIMEOUT);
    kube::Client::try_from(config).map_err(SourceError::Client)
}

/// Longest silence tolerated on a connection to the API server (watches time out after 290 s).
const WATCH_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(330);

fn parse_master<U>(url: &str) -> Result<U, SourceError>
where
    U: std::str::FromStr,
    U::Err: std::fmt::Display,
{
    url.parse()
        .map_err(|err: U::Err| SourceError::InvalidMaster {
            url: url.to_string(),
            reason: err.to_string(),
        })
}

/// Objects per page of the initial lists (and re-lists).
///
/// kube-runtime lists a page, decodes all of it, then hands its objects over one by one; a page
/// of EndpointSlices is the biggest short-lived allocation of the whole start-up, and the
/// allocator keeps that memory in the decoding thread's arena after the page is gone. Measured against kp-test's fake API server at 10k Services ×
/// 10 endpoints: client-go's 500 costs about 6 MiB more peak RSS than 250, and lists no faster;
/// 100 saves 2 MiB more but adds about 0.2 s of round trips to the initial list.
pub const LIST_PAGE_SIZE: u32 = 250;

/// Label selector for Services: upstream skips those another proxy owns and headless ones.
fn service_selector() -> String {
    format!("!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}")
}

/// Label selector for EndpointSlices: upstream skips those of Services another proxy owns.
fn endpoint_slice_selector() -> String {
    format!("!{LABEL_SERVICE_PROXY_NAME}")
}

/// Watches Services, EndpointSlices and the Node `node_name` with [`RetryPolicy::Default`],
/// sending what it sees to `tx`. Runs until `tx`'s receiver is dropped.
///
/// See [`run_kubernetes_with`].
pub async fn run_kubernetes(
    client: kube::Client,
    node_name: String,
    tx: mpsc::Sender<SourceEvent>,
    metrics: Arc<Metrics>,
) {
    run_kubernetes_with(client, node_name, tx, metrics, RetryPolicy::Default).await;
}

/// Watches Services, EndpointSlices and the Node `node_name`, sending what it sees to `tx`, and
/// waiting as `retry` says after errors. Runs until `tx`'s receiver is dropped.
///
/// Each kind reports `Synced(kind)` once its first list is complete, and again after every
/// re-list. Objects that vanished while the watch was broken are reported as `Delete` when the
/// re-list that proves it completes; errors alone (an outage, a dropped watch, a 410) never
/// produce a `Delete`. Errors are logged and counted (`source="kubernetes"`, `reason` one of
/// `list`, `watch` or `relist`), then retried.
///
/// The watchers run on a thread of their own (`kp-source-api`, with a single-threaded tokio
/// runtime), which also drives their HTTP connections; this future only waits for it. Decoding
/// list pages is the source's one big churn of short-lived memory, and glibc's malloc serves
/// each thread from an arena of its own and keeps freed memory in the arena it came from: on
/// one thread, the three watchers' pages reuse one arena, instead of leaving a high-water mark
/// in the arena of every runtime worker they happened to run on (at 10k Services × 10
/// endpoints, about 3 MiB of the process's peak RSS, besides what [`LIST_PAGE_SIZE`] saves).
/// The thread ends, like this future, once `tx`'s receiver is dropped; dropping this future
/// alone does not stop it.
pub async fn run_kubernetes_with(
    client: kube::Client,
    node_name: String,
    tx: mpsc::Sender<SourceEvent>,
    metrics: Arc<Metrics>,
    retry: RetryPolicy,
) {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("kp-source-api".into())
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => {
                    runtime.block_on(watch_all(client, node_name, tx, metrics, retry));
                }
                // Out of threads or file descriptors: nothing can be watched, and dropping
                // `tx` tells the consumer the source stopped.
                Err(err) => {
                    error!(error = %err, "cannot start the Kubernetes API source's runtime")
                }
            }
            let _ = done_tx.send(());
        });
    match thread {
        Ok(_) => {
            let _ = done_rx.await;
        }
        Err(err) => error!(error = %err, "cannot start the Kubernetes API source's thread"),
    }
}

/// Runs the three watchers until `tx`'s receiver is dropped.
async fn watch_all(
    client: kube::Client,
    node_name: String,
    tx: mpsc::Sender<SourceEvent>,
    metrics: Arc<Metrics>,
    retry: RetryPolicy,
) {
    let services = watch_kind(
        Api::<Service>::all(client.clone()),
        watcher::Config::default()
            .page_size(LIST_PAGE_SIZE)
            .labels(&service_selector()),
        Kind::Service,
        |svc| Object::Service(Box::new(svc)),
        retry,
        &tx,
        &metrics,
    );
    let slices = watch_kind(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default()
            .page_size(LIST_PAGE_SIZE)
            .labels(&endpoint_slice_selector()),
        Kind::EndpointSlice,
        |slice| Object::EndpointSlice(Box::new(slice)),
        retry,
        &tx,
        &metrics,
    );
    let nodes = watch_kind(
        Api::<Node>::all(client),
        watcher::Config::default()
            .page_size(LIST_PAGE_SIZE)
            .fields(&format!("metadata.name={node_name}")),
        Kind::Node,
        |node| Object::Node(Box::new(node)),
        retry,
        &tx,
        &metrics,
    );
    tokio::join!(services, slices, nodes);
}

/// Runs one watcher until `tx`'s receiver is dropped.
async fn watch_kind<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    wrap: fn(K) -> Object,
    retry: RetryPolicy,
    tx: &mpsc::Sender<SourceEvent>,
    metrics: &Metrics,
) where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut stream = pin!(watcher(api, config).backoff(retry.backoff()));
    let mut tracker = RelistTracker::new(kind);
    loop {
        let next = tokio::select! {
            _ = tx.closed() => return,
            next = stream.next() => next,
        };
        let event = match next {
            Some(Ok(event)) => event,
            Some(Err(source)) => {
                let reason = error_reason(&source);
                let err = SourceError::Watch { kind, source };
                warn!(%kind, reason, error = %err, "Kubernetes API error; retrying with backoff");
                metrics.source_error(SOURCE, reason);
                continue;
            }
            // kube-runtime's watcher never ends; if it ever did there would be nothing to do.
            None => return,
        };
        for out in tracker.handle(map_event(event, wrap)) {
            if tx.send(out).await.is_err() {
                return;
            }
        }
    }
}

/// The `reason` label for a watcher error.
fn error_reason(err: &watcher::Error) -> &'static str {
    match err {
        watcher::Error::InitialListFailed(_) | watcher::Error::NoResourceVersion => "list",
        // 410 Gone: the resourceVersion left the API server's window; kube-runtime re-lists.
        watcher::Error::WatchError(status) if status.code == 410 => "relist",
        watcher::Error::WatchError(_)
        | watcher::Error::WatchStartFailed(_)
        | watcher::Error::WatchFailed(_) => "watch",
    }
}

fn map_event<K>(event: watcher::Event<K>, wrap: fn(K) -> Object) -> watcher::Event<Object> {
    match event {
        watcher::Event::Apply(obj) => watcher::Event::Apply(wrap(obj)),
        watcher::Event::Delete(obj) => watcher::Event::Delete(wrap(obj)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(obj) => watcher::Event::InitApply(wrap(obj)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

#[cfg(test)]
mod tests;
