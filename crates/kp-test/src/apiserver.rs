//! A scripted fake Kubernetes API server for whole-binary tests: the list and watch endpoints
//! kube-rs's `watcher` uses for Services, EndpointSlices, Nodes and ServiceCIDRs, served by axum
//! from an in-memory store, with outages on demand, and able to listen inside a lab namespace.
//!
//! [`FakeApiServer`] owns its own thread and tokio runtime, so synchronous tests (the kind that
//! drive [`Lab`](crate::Lab)s) script it with plain method calls, and an async test's runtime
//! can be paused without stopping it. What it speaks:
//!
//! - `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`, `/api/v1/nodes`,
//!   `/apis/networking.k8s.io/v1/servicecidrs`, and the namespaced forms of the first two. A list answers every object at once with the
//!   store's current `metadata.resourceVersion`, paged by `limit` and `continue` as kube-rs asks
//!   (a continue token names the last object sent, so a page costs the same however deep into
//!   the list it is).
//! - `?watch=true&resourceVersion=N` streams newline-delimited `{"type", "object"}` events of
//!   every change after N, then follows new changes. Without a resourceVersion, or with `0`,
//!   it starts with an `ADDED` event per object. `sendInitialEvents=true` is answered the same
//!   way and ends the initial events with the `k8s.io/initial-events-end` bookmark.
//!   `timeoutSeconds` ends the watch cleanly; `allowWatchBookmarks=true` lets
//!   [`FakeApiServer::send_bookmarks`] reach it. A resourceVersion older than the last
//!   [`FakeApiServer::compact`] gets one `ERROR` event with a 410 `Expired` Status, as the real
//!   API server sends after etcd compaction.
//! - `labelSelector` (`k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (..)`, `k notin (..)`) and
//!   `fieldSelector` (`a.b=v`, `a.b!=v` on any field, typically `metadata.name`) are applied to
//!   lists and watches. As upstream, an object that stops matching is reported `DELETED` and
//!   one that starts matching `ADDED`.
//! - Anything else is a 404 Status; every request is counted ([`FakeApiServer::requests`]).
//!   [`FakeApiServer::serve_service_cidrs`]`(false)` makes the ServiceCIDR paths such a 404 too,
//!   as on an API server older than 1.33. The fake serves no discovery (`/api`, `/apis`), so
//!   there is nothing else to keep in line with it.
//!
//! Scripting: [`FakeApiServer::upsert`] and [`FakeApiServer::delete`] change the store and reach
//! open watches at once; [`FakeApiServer::set_outage`] (or `set_available(false)`) cuts every
//! connection or answers every request with an error status; [`FakeApiServer::drop_watches`]
//! ends watches cleanly; [`FakeApiServer::compact`] makes older resourceVersions 410 Gone;
//! [`FakeApiServer::hold_lists`] keeps one kind's lists unanswered, to order a client's lists;
//! [`FakeApiServer::serve_service_cidrs`] switches the ServiceCIDR API off and on, as a cluster
//! older than 1.33, and its upgrade, would.
//!
//! All kinds share one resourceVersion counter, as they share etcd's revision.
//!
//! It mirrors the idea, not the code, of kube-rs's `mock_tests.rs` and client-go's
//! `FakeWatcher`, at the level of the HTTP protocol, because the binary under test builds its
//! own client. The source crate's own tests (`kp-source/tests/fake_apiserver.rs`) script single
//! requests instead; use them for exact request sequences and this server for behaviour over
//! time.

mod store;

use std::collections::BTreeMap;
use std::future::{Future, IntoFuture};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::Response;
use axum::serve::Listener;
use axum::Router;
use kp_core::track::{Kind, Object};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot, watch};

use crate::netns::Netns;
use crate::{Error, Result};
use store::{EventType, Filter, Store};

/// How long shutting the server down waits for its tasks.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Watch events buffered per watch before the watch waits for its client.
const WATCH_BUFFER: usize = 256;

/// How the API server fails while it is unavailable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outage {
    /// Every connection is closed without an answer: open ones at once (watches break off
    /// mid-stream), new ones as soon as they are accepted. What clients see of an API server
    /// that crashed or restarts. Clients get a transport error, which kube-rs does not retry
    /// by itself, so its watchers see the failure at once.
    Disconnect,
    /// Every request is answered with this HTTP status and a `Status` body, and open watches
    /// break off. What clients see of a load balancer without a healthy API server behind it
    /// (503), or of an overloaded one (429). kube-rs's client retries 429, 503 and 504 by
    /// itself before its watchers see an error.
    Status(u16),
}

/// How many requests one path received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestCounts {
    /// List requests (`watch` absent or false), answered or not.
    pub lists: u64,
    /// Watch requests, answered or not.
    pub watches: u64,
    /// Requests answered with an error: an outage status, 4xx, or a watch's 410.
    pub failed: u64,
}

/// One request the server answered, in order of arrival.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    /// The URL path.
    pub path: String,
    /// The query parameters, decoded.
    pub query: BTreeMap<String, String>,
    /// Whether it was a watch.
    pub watch: bool,
    /// The HTTP status answered; for a watch refused with an `ERROR` event, that event's code.
    pub status: u16,
}

/// A fake Kubernetes API server on a loopback address; stops, with all its connections, when
/// dropped.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    url: String,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the HTTP side and the test side share.
#[derive(Debug)]
struct Shared {
    state: Mutex<ServerState>,
    /// Bumped after every change to `state` that watches or connections must look at.
    changed: watch::Sender<u64>,
}

/// Everything behind the lock.
#[derive(Debug, Default)]
struct ServerState {
    store: Store,
    outage: Option<Outage>,
    /// Watches started in an older epoch end: bumped by `drop_watches` and by every outage.
    epoch: u64,
    /// Connections accepted before the latest change of this are cut: bumped when a
    /// `Disconnect` outage starts.
    cuts: u64,
    /// Bumped by `send_bookmarks`.
    bookmarks: u64,
    open_watches: BTreeMap<Kind, usize>,
    /// Kinds whose lists wait for `release_lists`.
    held: std::collections::BTreeSet<Kind>,
    /// Lists waiting for `release_lists` right now.
    held_lists: BTreeMap<Kind, usize>,
    /// Kinds whose API is not served (`serve_service_cidrs(false)`): their paths are 404s.
    unserved: std::collections::BTreeSet<Kind>,
    requests: BTreeMap<String, RequestCounts>,
    log: Vec<RequestRecord>,
    refused_connections: u64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ServerState> {
        // A panic while the lock was held cannot leave the plain data inconsistent enough to
        // matter to a test; go on rather than poison every later call.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the state, then wakes every watch and connection to look at it again.
    fn update<T>(&self, f: impl FnOnce(&mut ServerState) -> T) -> T {
        let out = f(&mut self.lock());
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
        out
    }
}

impl FakeApiServer {
    /// Starts a server on `127.0.0.1:0` in the namespace this process runs in.
    pub fn start() -> Result<FakeApiServer> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| Error::Io {
            what: "binding the fake API server to 127.0.0.1:0".into(),
            source,
        })?;
        FakeApiServer::serve(listener)
    }

    /// Starts a server on `127.0.0.1:0` inside `netns`, so that a process started there (a
    /// kube-proxy in [`Lab::node`](crate::Lab::node)) reaches it at [`FakeApiServer::url`].
    ///
    /// The listening socket is created by a short-lived thread that enters the namespace
    /// (`setns(2)` on `/var/run/netns/NAME`) and binds there; a socket keeps the namespace it
    /// was created in, so the server's own thread, in the test's namespace, serves it. Needs
    /// root (CAP_SYS_ADMIN).
    pub fn start_in(netns: &Netns) -> Result<FakeApiServer> {
        let what = format!(
            "binding the fake API server to 127.0.0.1:0 in netns {}",
            netns.name()
        );
        let listener = kp_netlink::netns::run_in(netns.name(), "kp-apiserver-bind", || {
            std::net::TcpListener::bind("127.0.0.1:0")
        })
        .map_err(io::Error::other)
        .and_then(|bound| bound)
        .map_err(|source| Error::Io { what, source })?;
        FakeApiServer::serve(listener)
    }

    fn serve(listener: std::net::TcpListener) -> Result<FakeApiServer> {
        let io_error = |what: &str| {
            let what = what.to_string();
            move |source| Error::Io { what, source }
        };
        let addr = listener
            .local_addr()
            .map_err(io_error("reading the fake API server's address"))?;
        listener
            .set_nonblocking(true)
            .map_err(io_error("making the fake API server's socket non-blocking"))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_error("starting the fake API server's runtime"))?;
        let listener = {
            let _context = runtime.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(io_error("registering the fake API server's socket"))?
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(ServerState::default()),
            changed: watch::Sender::new(0),
        });
        let router = Router::new().fallback(handle).with_state(shared.clone());
        let listener = GatedListener {
            inner: listener,
            shared: shared.clone(),
        };
        let (shutdown, stop) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("kp-apiserver-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(async move {
                    tokio::select! {
                        result = axum::serve(listener, router).into_future() => {
                            if let Err(e) = result {
                                eprintln!("kp-test: the fake API server stopped: {e}");
                            }
                        }
                        _ = stop => {}
                    }
                });
                // Open watches and connections are dropped with their tasks.
                runtime.shutdown_timeout(SHUTDOWN_GRACE);
            })
            .map_err(io_error("starting the fake API server's thread"))?;
        Ok(FakeApiServer {
            addr,
            url: format!("http://{addr}"),
            shared,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`: the server's URL, valid inside the namespace it listens in.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Creates or replaces an object of `kind` and tells open watches. Returns the new
    /// resourceVersion.
    ///
    /// `apiVersion`, `kind`, `metadata.namespace` (`default`, for namespaced kinds) and
    /// `metadata.uid` are filled in when missing; `metadata.resourceVersion` is always set.
    /// Fails if the object has no name, another kind, or a namespace although its kind has
    /// none.
    pub fn upsert(&self, kind: Kind, object: Value) -> Result<u64> {
        self.shared
            .update(|s| s.store.upsert(kind, object))
            .map_err(Error::InvalidArgument)
    }

    /// [`FakeApiServer::upsert`] for a typed object.
    pub fn upsert_object(&self, object: &Object) -> Result<u64> {
        self.upsert(object.kind(), kp_flows::manifest(object))
    }

    /// Upserts every object (such as `kp_flows::objects()`); returns the last resourceVersion.
    pub fn load_objects(&self, objects: impl IntoIterator<Item = Object>) -> Result<u64> {
        let mut rv = self.resource_version();
        for object in objects {
            rv = self.upsert_object(&object)?;
        }
        Ok(rv)
    }

    /// Deletes an object and tells open watches; returns the deletion's resourceVersion, or
    /// `None` if there was no such object. `namespace` is ignored for Nodes.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> Option<u64> {
        self.shared
            .update(|s| s.store.delete(kind, namespace, name))
    }

    /// The stored object, as the server would answer it.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        self.shared.lock().store.get(kind, namespace, name).cloned()
    }

    /// The current resourceVersion (0 before the first change).
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().store.resource_version()
    }

    /// `false` starts an [`Outage::Disconnect`]; `true` ends any outage.
    pub fn set_available(&self, available: bool) {
        self.set_outage((!available).then_some(Outage::Disconnect));
    }

    /// Starts an outage (`Some`), switches to another kind of outage, or ends it (`None`).
    ///
    /// Starting one breaks every open watch off mid-stream; the objects and their history are
    /// kept, so clients that come back resume their watches without a relist (unless
    /// [`FakeApiServer::compact`] says otherwise).
    pub fn set_outage(&self, outage: Option<Outage>) {
        self.shared.update(|s| {
            if outage.is_some() && s.outage != outage {
                s.epoch += 1;
            }
            if outage == Some(Outage::Disconnect) && s.outage != outage {
                s.cuts += 1;
            }
            s.outage = outage;
        });
    }

    /// The current outage, if any.
    pub fn outage(&self) -> Option<Outage> {
        self.shared.lock().outage
    }

    /// Ends every open watch cleanly, as the API server does when a watch times out; clients
    /// watch again from the last resourceVersion they saw.
    pub fn drop_watches(&self) {
        self.shared.update(|s| s.epoch += 1);
    }

    /// Forgets the history before the current resourceVersion, as etcd compaction does: a watch
    /// that starts from an older one is answered with 410 Gone, so its client must list again.
    /// Open watches are not affected; combine with [`FakeApiServer::drop_watches`] to force
    /// clients through the 410.
    pub fn compact(&self) {
        self.shared.update(|s| s.store.compact());
    }

    /// Sends a `BOOKMARK` with the current resourceVersion to every open watch that asked for
    /// bookmarks (`allowWatchBookmarks=true`).
    pub fn send_bookmarks(&self) {
        self.shared.update(|s| s.bookmarks += 1);
    }

    /// From now on, lists of `kind` wait unanswered until [`FakeApiServer::release_lists`]
    /// (or an outage, which answers them as it answers everything). Watches are not held.
    /// Shows what a client does when one collection is slow to list, as a loaded API server's
    /// biggest ones are.
    pub fn hold_lists(&self, kind: Kind) {
        self.shared.update(|s| s.held.insert(kind));
    }

    /// Answers the held lists of `kind`, and those that come later at once.
    pub fn release_lists(&self, kind: Kind) {
        self.shared.update(|s| s.held.remove(&kind));
    }

    /// Whether the ServiceCIDR API (`networking.k8s.io/v1`, GA in Kubernetes 1.33) is served;
    /// it is until this says otherwise.
    ///
    /// `false` answers its list and watch requests with the 404 `NotFound` Status a 1.28 API
    /// server sends (to a client allowed to ask: RBAC answers 403 first otherwise), and ends
    /// open ServiceCIDR watches cleanly, so that their clients' next watch meets the 404 too.
    /// Objects stored meanwhile are kept, and are there again once `true` serves the API again,
    /// as after an upgrade.
    pub fn serve_service_cidrs(&self, served: bool) {
        self.shared.update(|s| {
            if served {
                s.unserved.remove(&Kind::ServiceCidr);
            } else {
                s.unserved.insert(Kind::ServiceCidr);
            }
        });
    }

    /// How many lists of `kind` are waiting for [`FakeApiServer::release_lists`] right now.
    pub fn held_lists(&self, kind: Kind) -> usize {
        self.shared
            .lock()
            .held_lists
            .get(&kind)
            .copied()
            .unwrap_or(0)
    }

    /// How many watches of `kind` are open right now.
    pub fn open_watches(&self, kind: Kind) -> usize {
        self.shared
            .lock()
            .open_watches
            .get(&kind)
            .copied()
            .unwrap_or(0)
    }

    /// Requests so far, per URL path.
    pub fn requests(&self) -> BTreeMap<String, RequestCounts> {
        self.shared.lock().requests.clone()
    }

    /// Every request so far, in order.
    pub fn request_log(&self) -> Vec<RequestRecord> {
        self.shared.lock().log.clone()
    }

    /// Connections closed unanswered during [`Outage::Disconnect`]s (their requests were never
    /// read, so they are in no other count).
    pub fn refused_connections(&self) -> u64 {
        self.shared.lock().refused_connections
    }

    /// Polls `done` every 20 ms until it holds, for at most `timeout`. The error names `what`
    /// and the requests seen so far.
    pub fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&FakeApiServer) -> bool,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            if done(self) {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(Error::NotReady {
                    what: what.to_string(),
                    after: start.elapsed(),
                    detail: format!("requests so far: {:?}", self.requests()),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The collection a path names, and the namespace it is limited to.
fn route(path: &str) -> Option<(Kind, Option<String>)> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segments.as_slice() {
        ["api", "v1", "services"] => Some((Kind::Service, None)),
        ["api", "v1", "namespaces", ns, "services"] => Some((Kind::Service, Some(ns.to_string()))),
        ["apis", "discovery.k8s.io", "v1", "endpointslices"] => Some((Kind::EndpointSlice, None)),
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices"] => {
            Some((Kind::EndpointSlice, Some(ns.to_string())))
        }
        ["api", "v1", "nodes"] => Some((Kind::Node, None)),
        ["apis", "networking.k8s.io", "v1", "servicecidrs"] => Some((Kind::ServiceCidr, None)),
        _ => None,
    }
}

/// Every request lands here: a list of a held kind waits for its release, then [`respond`]
/// answers.
async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    if method == Method::GET && !is_watch(&query) {
        if let Some((kind, _)) = route(uri.path()) {
            wait_for_release(&shared, kind).await;
        }
    }
    respond(&shared, &method, uri.path(), query)
}

fn is_watch(query: &BTreeMap<String, String>) -> bool {
    query.get("watch").is_some_and(|w| w == "true" || w == "1")
}

/// Counts a held list until dropped (answered, or abandoned by its client).
struct HeldList {
    shared: Arc<Shared>,
    kind: Kind,
}

impl Drop for HeldList {
    fn drop(&mut self) {
        if let Some(n) = self.shared.lock().held_lists.get_mut(&self.kind) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Returns once lists of `kind` are not held, or an outage answers them.
async fn wait_for_release(shared: &Arc<Shared>, kind: Kind) {
    let mut changed = shared.changed.subscribe();
    let mut held: Option<HeldList> = None;
    loop {
        let released = {
            let mut state = shared.lock();
            // An unserved kind is answered at once, with its 404.
            let released = !state.held.contains(&kind)
                || state.outage.is_some()
                || state.unserved.contains(&kind);
            if !released && held.is_none() {
                *state.held_lists.entry(kind).or_default() += 1;
            }
            released
        };
        // `held`, if any, is dropped (and uncounted) only after the lock above is released.
        if released {
            return;
        }
        held.get_or_insert_with(|| HeldList {
            shared: shared.clone(),
            kind,
        });
        if changed.changed().await.is_err() {
            return;
        }
    }
}

/// Answers one request and records it. Synchronous: the lock is never held across an await.
fn respond(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    query: BTreeMap<String, String>,
) -> Response {
    let watch = is_watch(&query);
    let mut state = shared.lock();
    let (status, response) = if let Some(outage) = state.outage {
        // A `Disconnect` outage closes connections before their requests are read; one that
        // raced past the check gets a 503.
        let code = match outage {
            Outage::Status(code) => code,
            Outage::Disconnect => 503,
        };
        (
            code,
            status_response(code, "the fake API server is unavailable"),
        )
    } else if method != Method::GET {
        (
            405,
            status_response(405, &format!("{method} is not served")),
        )
    } else if route(path).is_some_and(|(kind, _)| state.unserved.contains(&kind)) {
        // What a real API server answers for a resource it does not know, list or watch alike.
        (
            404,
            status_response(404, "the server could not find the requested resource"),
        )
    } else if let Some((kind, namespace)) = route(path) {
        match Filter::new(
            namespace,
            query.get("labelSelector").map(String::as_str),
            query.get("fieldSelector").map(String::as_str),
        ) {
            Err(e) => (400, status_response(400, &e)),
            Ok(filter) if watch => start_watch(shared, &mut state, kind, filter, &query),
            Ok(filter) => match page(&query, state.store.resource_version()) {
                Err(e) => (400, status_response(400, &e)),
                Ok(Page { rv, after, limit }) => {
                    let after = after
                        .as_ref()
                        .map(|(ns, name)| (ns.as_str(), name.as_str()));
                    let (items, next) = state.store.list_page(kind, &filter, after.as_ref(), limit);
                    let mut metadata = json!({"resourceVersion": rv.to_string()});
                    if let Some((namespace, name)) = next {
                        metadata["continue"] = json!(format!("{rv}:{namespace}/{name}"));
                    }
                    let body = json!({
                        "apiVersion": store::info(kind).api_version,
                        "kind": store::info(kind).list_kind,
                        "metadata": metadata,
                        "items": items,
                    });
                    (200, json_response(200, &body))
                }
            },
        }
    } else {
        (
            404,
            status_response(404, &format!("the fake API server does not serve {path}")),
        )
    };
    let counts = state.requests.entry(path.to_string()).or_default();
    if watch {
        counts.watches += 1;
    } else {
        counts.lists += 1;
    }
    if status >= 400 {
        counts.failed += 1;
    }
    state.log.push(RequestRecord {
        path: path.to_string(),
        query,
        watch,
        status,
    });
    response
}

/// What one list request asks for.
#[derive(Debug, PartialEq, Eq)]
struct Page {
    /// The resourceVersion the list reports.
    rv: u64,
    /// The (namespace, name) the page starts after; `None` for the first page.
    after: Option<(String, String)>,
    /// At most this many objects; `None` for all.
    limit: Option<usize>,
}

/// Paging of a list, from `limit` and `continue`. A continue token is `RV:NAMESPACE/NAME`: the
/// next page starts after that object (the real API server's tokens also carry the key to start
/// after, encoded), and later pages report the first page's resourceVersion, so a watch started
/// from it replays every change made while the pages were read (the real API server serves the
/// pages from a snapshot; the end state is the same).
fn page(query: &BTreeMap<String, String>, current_rv: u64) -> Result<Page, String> {
    let limit = match query.get("limit").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(l) => Some(
            l.parse::<usize>()
                .map_err(|_| format!("limit {l:?} is not a number"))?,
        ),
    };
    match query.get("continue").map(String::as_str) {
        None | Some("") => Ok(Page {
            rv: current_rv,
            after: None,
            limit,
        }),
        Some(token) => {
            let bad = || format!("continue token {token:?} is not valid");
            let (rv, key) = token.split_once(':').ok_or_else(bad)?;
            let (namespace, name) = key.split_once('/').ok_or_else(bad)?;
            if name.is_empty() {
                return Err(bad());
            }
            Ok(Page {
                rv: rv.parse().map_err(|_| bad())?,
                after: Some((namespace.to_string(), name.to_string())),
                limit,
            })
        }
    }
}

/// What a watch was asked for.
struct WatchSpec {
    kind: Kind,
    filter: Filter,
    /// Changes up to this resourceVersion have been sent (or were never asked for).
    after: u64,
    epoch: u64,
    bookmarks: Option<u64>,
    deadline: Option<tokio::time::Instant>,
}

/// Validates a watch request and starts streaming it. Returns the status to record and the
/// response.
fn start_watch(
    shared: &Arc<Shared>,
    state: &mut ServerState,
    kind: Kind,
    filter: Filter,
    query: &BTreeMap<String, String>,
) -> (u16, Response) {
    let rv = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(rv) => match rv.parse::<u64>() {
            Ok(rv) => Some(rv),
            Err(_) => {
                let msg = format!("resourceVersion {rv:?} is not a number");
                return (400, status_response(400, &msg));
            }
        },
    };
    let initial_events = query.get("sendInitialEvents").is_some_and(|v| v == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(|t| tokio::time::Instant::now() + Duration::from_secs(t));
    let mut first = Vec::new();
    let status = match rv {
        Some(rv) if !initial_events => match state.store.check_start(rv) {
            Ok(()) => 200,
            Err(gone) => {
                let msg = format!("too old resource version: {rv} ({})", gone.oldest);
                first.push(line("ERROR", status_body(410, "Expired", &msg)));
                410
            }
        },
        _ => {
            for object in state.store.list(kind, &filter) {
                first.push(line(EventType::Added.as_str(), object));
            }
            if initial_events {
                first.push(bookmark(kind, state.store.resource_version(), true));
            }
            200
        }
    };
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(WATCH_BUFFER.max(first.len()));
    for l in first {
        // The channel is new and holds at least this many.
        let _ = tx.try_send(Ok(l));
    }
    if status == 200 {
        let spec = WatchSpec {
            kind,
            filter,
            after: rv
                .filter(|_| !initial_events)
                .unwrap_or(state.store.resource_version()),
            epoch: state.epoch,
            bookmarks: (query
                .get("allowWatchBookmarks")
                .is_some_and(|v| v == "true")
                || initial_events)
                .then_some(state.bookmarks),
            deadline: timeout,
        };
        *state.open_watches.entry(kind).or_default() += 1;
        tokio::spawn(run_watch(shared.clone(), spec, tx));
    }
    // For a refused watch, `tx` is dropped here and the stream ends after the ERROR event.
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let response = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap_or_default();
    (status, response)
}

/// Counts an open watch until dropped.
struct OpenWatch {
    shared: Arc<Shared>,
    kind: Kind,
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        if let Some(n) = self.shared.lock().open_watches.get_mut(&self.kind) {
            *n = n.saturating_sub(1);
        }
    }
}

/// How a watch ends.
enum End {
    /// Cleanly: the chunked body is terminated and the client watches again.
    Clean,
    /// Broken off mid-stream: the client sees a transport error.
    Abort,
}

/// Streams the changes a watch asked for into `tx` until its client goes away, it times out, or
/// the test ends it.
async fn run_watch(shared: Arc<Shared>, mut spec: WatchSpec, tx: mpsc::Sender<io::Result<Bytes>>) {
    let _open = OpenWatch {
        shared: shared.clone(),
        kind: spec.kind,
    };
    let mut changed = shared.changed.subscribe();
    loop {
        changed.borrow_and_update();
        let (lines, end) = {
            let state = shared.lock();
            if state.epoch != spec.epoch || state.unserved.contains(&spec.kind) {
                let end = if state.outage.is_some() {
                    End::Abort
                } else {
                    End::Clean
                };
                (Vec::new(), Some(end))
            } else {
                let mut lines: Vec<Bytes> = state
                    .store
                    .events_since(spec.kind, spec.after, &spec.filter)
                    .into_iter()
                    .map(|(_, event, object)| line(event.as_str(), object))
                    .collect();
                spec.after = state.store.resource_version();
                if let Some(seen) = &mut spec.bookmarks {
                    if *seen != state.bookmarks {
                        *seen = state.bookmarks;
                        lines.push(bookmark(spec.kind, spec.after, false));
                    }
                }
                (lines, None)
            }
        };
        for l in lines {
            if tx.send(Ok(l)).await.is_err() {
                return;
            }
        }
        match end {
            Some(End::Clean) => return,
            Some(End::Abort) => {
                let cut = io::Error::new(io::ErrorKind::ConnectionAborted, "API server outage");
                let _ = tx.send(Err(cut)).await;
                return;
            }
            None => {}
        }
        let timed_out = async {
            match spec.deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = changed.changed() => if result.is_err() { return },
            _ = timed_out => return,
            _ = tx.closed() => return,
        }
    }
}

/// One watch event line.
fn line(event: &str, object: Value) -> Bytes {
    let mut text = json!({"type": event, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

/// A `BOOKMARK` event line at `rv`; `initial_end` marks the end of `sendInitialEvents`.
fn bookmark(kind: Kind, rv: u64, initial_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        json!({
            "apiVersion": store::info(kind).api_version,
            "kind": kind.to_string(),
            "metadata": metadata,
        }),
    )
}

/// The `reason` the real API server gives with `code`.
fn reason(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        410 => "Expired",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "Unknown",
    }
}

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Status", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

fn status_response(code: u16, message: &str) -> Response {
    json_response(code, &status_body(code, reason(code), message))
}

fn json_response(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

/// The listener: refuses connections during an [`Outage::Disconnect`], and hands out streams
/// that the next one cuts.
struct GatedListener {
    inner: tokio::net::TcpListener,
    shared: Arc<Shared>,
}

impl Listener for GatedListener {
    type Io = GatedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (GatedStream, SocketAddr) {
        loop {
            let (stream, addr) = match self.inner.accept().await {
                Ok(accepted) => accepted,
                // Out of file descriptors and the like: wait, as axum's own listener does.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let cuts = {
                let mut state = self.shared.lock();
                if state.outage == Some(Outage::Disconnect) {
                    state.refused_connections += 1;
                    None
                } else {
                    Some(state.cuts)
                }
            };
            // As a real API server's (Go sets it on every TCP connection): without it a watch
            // event written in pieces to an idle connection waits for the client's delayed ACK
            // (40 ms).
            let _ = stream.set_nodelay(true);
            match cuts {
                Some(cuts) => return (GatedStream::new(stream, self.shared.clone(), cuts), addr),
                None => drop(stream),
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection that fails every read and write once a `Disconnect` outage starts, so that
/// hyper closes it (kept-alive idle connections included).
struct GatedStream {
    stream: tokio::net::TcpStream,
    cut: Pin<Box<dyn Future<Output = ()> + Send>>,
    is_cut: bool,
}

impl GatedStream {
    fn new(stream: tokio::net::TcpStream, shared: Arc<Shared>, cuts: u64) -> GatedStream {
        // Subscribed before the first check, so no change can slip between the two.
        let mut changed = shared.changed.subscribe();
        let cut = Box::pin(async move {
            loop {
                let cut_now = shared.lock().cuts != cuts;
                if cut_now {
                    return;
                }
                if changed.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        });
        GatedStream {
            stream,
            cut,
            is_cut: false,
        }
    }

    /// Whether the connection is cut; registers `cx` to be woken when it is.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.is_cut && self.cut.as_mut().poll(cx).is_ready() {
            self.is_cut = true;
        }
        if self.is_cut {
            Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "API server outage",
            ))
        } else {
            Ok(())
        }
    }
}

impl AsyncRead for GatedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for GatedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
