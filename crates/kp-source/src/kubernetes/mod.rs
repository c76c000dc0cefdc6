//! The Kubernetes API source: one list-then-watch loop per kind (Services, EndpointSlices,
//! this node's Node, ServiceCIDRs), see the `watch` module.
//!
//! Mirrors upstream `pkg/proxy/config/config.go` (`ServiceConfig`, `EndpointSliceConfig`,
//! `NodeConfig`, `ServiceCIDRConfig`) and the informer selectors in
//! `cmd/kube-proxy/app/server.go`. Where upstream's informers keep a cache and diff it on
//! re-list, `RelistTracker` keeps only each object's key and resourceVersion, which is enough to
//! report what vanished.
//!
//! What keeps a large initial list fast and small (measured against kube-apiserver v1.28.7 at
//! 10k Services x 10 endpoints, see the commit that introduced it): the first list is served from
//! the API server's watch cache (`resourceVersion=0`, as client-go's informers ask) in one
//! response instead of 40 quorum-read pages per kind; each response is split into its items
//! while it is read and each item decoded and handed over before the next is read (`list`
//! module), never the whole page at once; and only what the proxy reads of each object is
//! decoded (`slim` module: no `managedFields`, no unread labels or annotations, no endpoint
//! `targetRef`, no Node images). The watchers run on a thread of their own (see
//! [`run_kubernetes_with`]).
//!
//! What is left of the list's time at 10k is the API server's: kube-apiserver v1.28.7's trace
//! shows it spends most of an unpaged list encoding 27 MB of EndpointSlices as JSON (0.8-1.8 s
//! for the whole list with curl, 10 s while our proxy listed on a loaded machine) before the
//! first byte is sent. Upstream kube-proxy asks
//! for protobuf (`--kube-api-content-type`), which is cheaper to encode; this client only
//! speaks JSON.
//!
//! ServiceCIDRs (`networking.k8s.io/v1`, GA in Kubernetes 1.33) are optional: an API server
//! that does not serve them, or a role that may not list them, is not an error but a state,
//! said once in the log and asked about again every [`SERVICE_CIDR_RECHECK`] (see
//! [`run_kubernetes_with`]); meanwhile only the configured Service CIDRs are known.

mod list;
mod slim;
mod tracker;
mod watch;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::networking::v1::ServiceCIDR;
use kp_core::convert::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};
use kp_core::track::{Kind, SourceEvent};
use kp_metrics::Metrics;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::Status;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::SourceError;

use slim::{SlimEndpointSlice, SlimNode, SlimService, SlimServiceCidr, Watched};
pub(crate) use tracker::RelistTracker;
use watch::{watch_until, Selectors, Stopped};

/// The `source` label of this source's error metric.
const SOURCE: &str = "kubernetes";

/// How long an optional API that is not served to us (ServiceCIDRs on a cluster older than
/// 1.33, or not granted by RBAC) waits before it is asked for again, with [`RetryPolicy::Default`].
///
/// Rare on purpose: what it waits for is a control-plane upgrade or an RBAC change, and every
/// node asks. One list of at most one object per node every 5 minutes is nothing to an API
/// server, which answers a 403 or 404 before touching storage.
pub const SERVICE_CIDR_RECHECK: Duration = Duration::from_secs(300);

/// How the watchers wait after an error before they list or watch again, and how long an
/// optional API that is not served waits before it is asked for again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RetryPolicy {
    /// kube-runtime's `DefaultBackoff`, taken from client-go's reflector: 0.8 s doubling to 30 s,
    /// with jitter, starting over after 2 minutes without errors. Kind to a struggling API
    /// server; use it in production. An API that is not served is asked for again every
    /// [`SERVICE_CIDR_RECHECK`].
    #[default]
    Default,
    /// Starts at `initial`, doubles after each consecutive error up to `max`, without jitter,
    /// and starts over after any success. Meant for tests against a fake API server.
    Exponential {
        /// Delay after the first error.
        initial: Duration,
        /// Longest delay.
        max: Duration,
        /// How long an API that is not served waits before it is asked for again (what
        /// [`SERVICE_CIDR_RECHECK`] is for `Default`).
        recheck: Duration,
    },
}

impl RetryPolicy {
    /// How long an API that is not served to us waits before it is asked for again.
    fn recheck(self) -> Duration {
        match self {
            RetryPolicy::Default => SERVICE_CIDR_RECHECK,
            RetryPolicy::Exponential { recheck, .. } => recheck,
        }
    }

    fn backoff(self) -> Box<dyn Backoff> {
        match self {
            RetryPolicy::Default => Box::new(DefaultBackoff::default()),
            RetryPolicy::Exponential { initial, max, .. } => Box::new(Doubling {
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

/// Objects per page of a re-list (a quorum read from etcd, after 410 Gone), client-go's
/// default. The first list asks the API server's watch cache, which kube-apiserver (up to at
/// least 1.28) answers in one response whatever the limit. Either way the response is read
/// item by item, so the page size does not change this proxy's memory, only the API server's.
pub const LIST_PAGE_SIZE: u32 = 500;

/// Label selector for Services: upstream skips those another proxy owns and headless ones.
fn service_selector() -> String {
    format!("!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}")
}

/// Label selector for EndpointSlices: upstream skips those of Services another proxy owns.
fn endpoint_slice_selector() -> String {
    format!("!{LABEL_SERVICE_PROXY_NAME}")
}

/// Watches Services, EndpointSlices, the Node `node_name` and ServiceCIDRs with
/// [`RetryPolicy::Default`], sending what it sees to `tx`. Runs until `tx`'s receiver is dropped.
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

/// Watches Services, EndpointSlices, the Node `node_name` and ServiceCIDRs, sending what it sees
/// to `tx`, and waiting as `retry` says after errors. Runs until `tx`'s receiver is dropped.
///
/// Each kind reports `Synced(kind)` once its first list is complete, and again after every
/// re-list. Objects that vanished while the watch was broken are reported as `Delete` when the
/// re-list that proves it completes; errors alone (an outage, a dropped watch, a 410) never
/// produce a `Delete`. Errors are logged and counted (`source="kubernetes"`, `reason` one of
/// `list`, `watch` or `relist`), then retried. A listed object that does not decode is skipped,
/// logged and counted (`reason="decode"`); its last good version, if any, stays in force.
///
/// ServiceCIDRs are the exception to "errors are retried": when listing or watching them is
/// answered 404 (an API server older than 1.33 does not serve them) or 403 (kube-proxy's role
/// does not grant them; also what a cluster older than 1.33 answers the stock role, as it
/// authorizes before it looks the resource up), the watcher stops. That is logged once, not
/// counted, and reported as `Synced(ServiceCIDR)`: nothing more can be known, and only the
/// configured `serviceCIDRs` apply. ServiceCIDRs already reported stay (a 404 proves nothing
/// about them: during an upgrade, API servers of both versions answer in turn). Every
/// `retry`-given recheck ([`SERVICE_CIDR_RECHECK`] in production) a list of at most one object
/// asks again, quietly while the answer stays the same; any other answer hands over to the
/// watcher again, which lists (reporting what vanished meanwhile) and watches as for any kind.
///
/// The watchers run on a thread of their own (`kp-source-api`, with a single-threaded tokio
/// runtime), which also drives their HTTP connections; this future only waits for it. Decoding
/// lists is the source's one big churn of short-lived memory, and glibc's malloc serves each
/// thread from an arena of its own and keeps freed memory in the arena it came from: on one
/// thread, the watchers' decoding reuses one arena, instead of leaving a high-water mark in the
/// arena of every runtime worker it happened to run on.
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

/// Runs the four watchers until `tx`'s receiver is dropped.
async fn watch_all(
    client: kube::Client,
    node_name: String,
    tx: mpsc::Sender<SourceEvent>,
    metrics: Arc<Metrics>,
    retry: RetryPolicy,
) {
    let ctx = Ctx {
        retry,
        tx: &tx,
        metrics: &metrics,
    };
    let services = watch_kind::<SlimService>(
        &client,
        Selectors {
            labels: Some(service_selector()),
            fields: None,
        },
        ctx,
    );
    let slices = watch_kind::<SlimEndpointSlice>(
        &client,
        Selectors {
            labels: Some(endpoint_slice_selector()),
            fields: None,
        },
        ctx,
    );
    let nodes = watch_kind::<SlimNode>(
        &client,
        Selectors {
            labels: None,
            fields: Some(format!("metadata.name={node_name}")),
        },
        ctx,
    );
    let service_cidrs = watch_service_cidrs(&client, ctx);
    tokio::join!(services, slices, nodes, service_cidrs);
}

/// What every watcher shares.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    retry: RetryPolicy,
    tx: &'a mpsc::Sender<SourceEvent>,
    metrics: &'a Metrics,
}

/// Runs one watcher of a kind every API server serves until `tx`'s receiver is dropped.
async fn watch_kind<K: Watched>(client: &kube::Client, selectors: Selectors, ctx: Ctx<'_>) {
    let mut tracker = RelistTracker::new(K::KIND);
    watch_until::<K>(client, &selectors, &mut tracker, None, ctx).await;
}

/// Why the API server will not serve an optional kind to us.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unavailable {
    /// 404: it does not serve the resource (ServiceCIDRs before Kubernetes 1.33).
    NotServed,
    /// 403: kube-proxy's role may not list or watch it. What the stock role gets on a cluster
    /// older than 1.33, too: kube-apiserver authorizes a request before it looks up its
    /// resource.
    Forbidden,
}

impl Unavailable {
    /// Whether `status` says the resource is not served to us. By code as well as reason:
    /// kube's client makes a Status of its own, reason and all, from an error whose body is
    /// not one (a proxy's plain-text 404).
    fn of_status(status: &Status) -> Option<Unavailable> {
        if status.code == 404 || status.is_not_found() {
            Some(Unavailable::NotServed)
        } else if status.code == 403 || status.is_forbidden() {
            Some(Unavailable::Forbidden)
        } else {
            None
        }
    }

    /// Whether a watcher error says the resource is not served to us: only a refused list or
    /// watch request does. (An `ERROR` event inside a watch is about that watch.)
    fn of_error(err: &watcher::Error) -> Option<Unavailable> {
        match err {
            watcher::Error::InitialListFailed(kube::Error::Api(status))
            | watcher::Error::WatchStartFailed(kube::Error::Api(status)) => {
                Unavailable::of_status(status)
            }
            _ => None,
        }
    }

    /// Logs the state once it is entered: a 404 is what every cluster older than 1.33 answers,
    /// so it is news but no warning; a 403 may be a role to fix.
    fn log(self, kind: Kind, recheck: Duration) {
        match self {
            Unavailable::NotServed => info!(
                %kind,
                recheck_secs = recheck.as_secs(),
                "the API server does not serve ServiceCIDRs (networking.k8s.io/v1, Kubernetes \
                 1.33 and later); only the configured Service CIDRs (serviceCIDRs) are used; \
                 asking again now and then"
            ),
            Unavailable::Forbidden => warn!(
                %kind,
                recheck_secs = recheck.as_secs(),
                "not allowed to list and watch ServiceCIDRs (networking.k8s.io/v1): expected \
                 before Kubernetes 1.33, else grant them to kube-proxy's role, as upstream's \
                 system:node-proxier does; only the configured Service CIDRs (serviceCIDRs) are \
                 used; asking again now and then"
            ),
        }
    }
}

/// Runs the ServiceCIDR watcher until `tx`'s receiver is dropped, stopping it while the API
/// server does not serve ServiceCIDRs to us (see [`run_kubernetes_with`]).
///
/// Decided by the watcher's own list and watch requests rather than by API discovery
/// (`GET /apis/networking.k8s.io/v1`): discovery cannot tell that the role forbids the
/// resource, so the 403 would need handling anyway, and the answers that matter come for
/// free with the requests the watcher makes in any case.
async fn watch_service_cidrs(client: &kube::Client, ctx: Ctx<'_>) {
    let kind = Kind::ServiceCidr;
    let api = Api::<ServiceCIDR>::all(client.clone());
    let selectors = Selectors::default();
    let recheck = ctx.retry.recheck();
    // One tracker for every run of the watcher, so that the list after a pause reports what
    // vanished meanwhile.
    let mut tracker = RelistTracker::new(kind);
    // What the log last said about the API: `None` until it is found unavailable, and again
    // once it is listed.
    let mut said: Option<Unavailable> = None;
    loop {
        let why = match watch_until::<SlimServiceCidr>(
            client,
            &selectors,
            &mut tracker,
            Some(&mut said),
            ctx,
        )
        .await
        {
            Stopped::Closed => return,
            Stopped::Unavailable(why) => why,
        };
        if said != Some(why) {
            why.log(kind, recheck);
            said = Some(why);
        }
        // Nothing more can be known; the consumer must not wait for it.
        if ctx.tx.send(SourceEvent::Synced(kind)).await.is_err() {
            return;
        }
        // Asked quietly: a list of at most one object, not the watcher, whose error reports
        // would repeat what was said.
        loop {
            tokio::select! {
                _ = ctx.tx.closed() => return,
                _ = tokio::time::sleep(recheck) => {}
            }
            let answer = api.list(&ListParams::default().limit(1)).await;
            let still = match &answer {
                Err(kube::Error::Api(status)) => Unavailable::of_status(status),
                _ => None,
            };
            match still {
                Some(now) => {
                    if said != Some(now) {
                        now.log(kind, recheck);
                        said = Some(now);
                    }
                }
                // Served now, or another error: the watcher takes over, and logs and counts
                // errors as for any kind.
                None => break,
            }
        }
    }
}

/// The `reason` label for a watcher error.
fn error_reason(err: &watcher::Error) -> &'static str {
    match err {
        watcher::Error::InitialListFailed(_) | watcher::Error::NoResourceVersion => "list",
        // 410 Gone: the resourceVersion left the API server's window; the watcher re-lists.
        watcher::Error::WatchError(status) if status.code == 410 => "relist",
        watcher::Error::WatchStartFailed(kube::Error::Api(status)) if status.code == 410 => {
            "relist"
        }
        watcher::Error::WatchError(_)
        | watcher::Error::WatchStartFailed(_)
        | watcher::Error::WatchFailed(_) => "watch",
    }
}

#[cfg(test)]
mod tests;
