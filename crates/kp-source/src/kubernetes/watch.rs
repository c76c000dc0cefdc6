//! One kind's list-then-watch loop, as client-go's reflector runs it.
//!
//! - The first list asks for `resourceVersion=0`: any version the API server has, which it
//!   answers from its watch cache in one response (kube-apiserver ignores `limit` there), as
//!   client-go's informers do. A re-list (after 410 Gone, or a watch event without a
//!   resourceVersion) asks for the most recent version, a quorum read, in pages of
//!   [`LIST_PAGE_SIZE`], so that it never goes back in time.
//! - Each response is read item by item ([`PageReader`]) and each item decoded into what the
//!   proxy reads of it ([`Watched`]) and handed over before the next is read.
//! - Then it watches from the list's resourceVersion, with bookmarks, and re-watches from the
//!   last one seen when a watch ends; a 410 starts a list again.
//! - Errors are reported (logged and counted by the caller) and followed by a wait from the
//!   retry policy's backoff, which starts over whenever the API server answers with data.
//!
//! The events, in kube-runtime's terms (`Init`, `InitApply`, `InitDone`, `Apply`, `Delete`),
//! and its error kinds are kept: [`RelistTracker`] turns them into what the proxy is told.

use std::pin::pin;

use futures::StreamExt;
use kp_core::track::ObjectKey;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};
use tracing::warn;

use super::list::PageReader;
use super::slim::{KeyOnly, Watched};
use super::{Ctx, RelistTracker, Unavailable, LIST_PAGE_SIZE, SOURCE};

/// The selectors of one kind's list and watch.
#[derive(Clone, Debug, Default)]
pub(crate) struct Selectors {
    pub(crate) labels: Option<String>,
    pub(crate) fields: Option<String>,
}

/// Why [`watch_until`] returned.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stopped {
    /// `tx`'s receiver is gone.
    Closed,
    /// The kind is optional and the API server will not serve it to us.
    Unavailable(Unavailable),
}

/// What the loop does next.
#[derive(Debug)]
enum Next {
    /// List; from the watch cache (`resourceVersion=0`) or the most recent version.
    List { from_cache: bool },
    /// Watch from this resourceVersion.
    Watch(String),
}

/// How one step ended, short of the receiver going away.
enum Step {
    Next(Next),
    Failed(watcher::Error, Next),
}

/// The receiver is gone.
struct Closed;

/// One kind's loop.
struct Loop<'a, 'b> {
    client: &'a kube::Client,
    path: String,
    selectors: &'a Selectors,
    tracker: &'a mut RelistTracker,
    /// For an optional kind: what the log last said about its API.
    optional: Option<&'a mut Option<Unavailable>>,
    backoff: Box<dyn Backoff>,
    ctx: Ctx<'b>,
}

/// Lists and watches `K`, reporting through `tracker`, until `tx`'s receiver is dropped, or, for
/// an optional kind (`optional` holds what the log last said about its API), until the API
/// server refuses it as [`Unavailable`].
pub(crate) async fn watch_until<K: Watched>(
    client: &kube::Client,
    selectors: &Selectors,
    tracker: &mut RelistTracker,
    optional: Option<&mut Option<Unavailable>>,
    ctx: Ctx<'_>,
) -> Stopped {
    let mut run = Loop {
        client,
        path: K::url_path(),
        selectors,
        tracker,
        optional,
        backoff: ctx.retry.backoff(),
        ctx,
    };
    let mut next = Next::List { from_cache: true };
    loop {
        let step = tokio::select! {
            _ = ctx.tx.closed() => return Stopped::Closed,
            step = run.step::<K>(next) => step,
        };
        next = match step {
            Ok(Step::Next(next)) => next,
            Ok(Step::Failed(err, next)) => {
                if run.optional.is_some() {
                    if let Some(why) = Unavailable::of_error(&err) {
                        tracing::debug!(kind = %run.tracker.kind(), error = %err, "optional API not available");
                        return Stopped::Unavailable(why);
                    }
                }
                run.report(err);
                if run.wait().await.is_err() {
                    return Stopped::Closed;
                }
                next
            }
            Err(Closed) => return Stopped::Closed,
        };
    }
}

impl Loop<'_, '_> {
    async fn step<K: Watched>(&mut self, next: Next) -> Result<Step, Closed> {
        match next {
            Next::List { from_cache } => self.list::<K>(from_cache).await,
            Next::Watch(version) => self.watch::<K>(version).await,
        }
    }

    /// Lists every page, then reports `InitDone`.
    async fn list<K: Watched>(&mut self, from_cache: bool) -> Result<Step, Closed> {
        let retry = Next::List { from_cache };
        self.deliver(Event::Init).await?;
        let mut continue_token: Option<String> = None;
        // Where a list's time goes, for its log line: the API server's answer (until the
        // response headers arrive), then reading and decoding the items as they stream in.
        let started = std::time::Instant::now();
        let (mut answered, mut items, mut pages) = (std::time::Duration::ZERO, 0usize, 0usize);
        loop {
            // From the cache: `resourceVersion=0` and no limit (kube's client drops the version
            // when a limit is given, which would make it a quorum read). A continued list takes
            // its version from the token; the API server refuses both.
            let cached = from_cache && continue_token.is_none();
            let params = ListParams {
                label_selector: self.selectors.labels.clone(),
                field_selector: self.selectors.fields.clone(),
                limit: (!cached).then_some(LIST_PAGE_SIZE),
                continue_token: continue_token.take(),
                resource_version: cached.then(|| "0".to_string()),
                ..ListParams::default()
            };
            let opened = std::time::Instant::now();
            let mut page = match PageReader::open(self.client, &self.path, &params).await {
                Ok(page) => page,
                Err(err) => return Ok(Step::Failed(watcher::Error::InitialListFailed(err), retry)),
            };
            answered += opened.elapsed();
            pages += 1;
            loop {
                let object = match page.next_item().await {
                    Ok(Some(item)) => match serde_json::from_slice::<K>(item) {
                        Ok(object) => Ok(object),
                        Err(err) => Err(self.undecodable(item, err)),
                    },
                    Ok(None) => break,
                    Err(err) => {
                        return Ok(Step::Failed(watcher::Error::InitialListFailed(err), retry))
                    }
                };
                items += 1;
                match object {
                    Ok(object) => self.deliver(Event::InitApply(object.into_object())).await?,
                    // Kept, not reported: its last good version (if any) stays in force.
                    Err(Some(key)) => self.tracker.keep(key),
                    Err(None) => {}
                }
            }
            let meta = match page.finish() {
                Ok(meta) => meta,
                Err(err) => return Ok(Step::Failed(watcher::Error::InitialListFailed(err), retry)),
            };
            self.backoff.reset();
            let version = meta.resource_version.filter(|v| !v.is_empty());
            continue_token = meta.continue_.filter(|c| !c.is_empty());
            if continue_token.is_some() {
                continue;
            }
            let Some(version) = version else {
                return Ok(Step::Failed(watcher::Error::NoResourceVersion, retry));
            };
            tracing::info!(
                kind = %self.tracker.kind(),
                objects = items,
                pages,
                from_cache = from_cache,
                seconds = started.elapsed().as_secs_f64(),
                answer_seconds = answered.as_secs_f64(),
                "listed"
            );
            self.deliver(Event::InitDone).await?;
            if let Some(said) = self.optional.as_deref_mut() {
                if said.take().is_some() {
                    tracing::info!(kind = %self.tracker.kind(), "the API server serves this kind now; watching it");
                }
            }
            return Ok(Step::Next(Next::Watch(version)));
        }
    }

    /// Watches from `version` until the watch ends or must give way to a list.
    async fn watch<K: Watched>(&mut self, mut version: String) -> Result<Step, Closed> {
        let params = WatchParams {
            label_selector: self.selectors.labels.clone(),
            field_selector: self.selectors.fields.clone(),
            ..WatchParams::default()
        };
        let request = match kube::core::Request::new(&self.path).watch(&params, &version) {
            Ok(request) => request,
            Err(err) => {
                let err = watcher::Error::WatchStartFailed(kube::Error::BuildRequest(err));
                return Ok(Step::Failed(err, Next::Watch(version)));
            }
        };
        let stream = match self.client.request_events::<K>(request).await {
            Ok(stream) => stream,
            Err(err) => {
                // The version may be gone as an HTTP answer, not only as a watch event.
                let next = match &err {
                    kube::Error::Api(status) if status.code == 410 => {
                        Next::List { from_cache: false }
                    }
                    _ => Next::Watch(version),
                };
                return Ok(Step::Failed(watcher::Error::WatchStartFailed(err), next));
            }
        };
        let mut stream = pin!(stream);
        while let Some(event) = stream.next().await {
            let (event, object_version) = match event {
                Ok(WatchEvent::Added(obj) | WatchEvent::Modified(obj)) => {
                    let v = obj.resource_version().unwrap_or_default().to_string();
                    (Event::Apply(obj.into_object()), v)
                }
                Ok(WatchEvent::Deleted(obj)) => {
                    let v = obj.resource_version().unwrap_or_default().to_string();
                    (Event::Delete(obj.into_object()), v)
                }
                Ok(WatchEvent::Bookmark(bookmark)) => {
                    self.backoff.reset();
                    version = bookmark.metadata.resource_version;
                    continue;
                }
                Ok(WatchEvent::Error(status)) => {
                    // 410 Gone: the version left the API server's window; list again.
                    if status.code == 410 {
                        let err = watcher::Error::WatchError(status);
                        return Ok(Step::Failed(err, Next::List { from_cache: false }));
                    }
                    self.report(watcher::Error::WatchError(status));
                    self.wait().await?;
                    continue;
                }
                // An event that does not decode, or a read error: reported, and the watch goes
                // on (it ends by itself if the connection is gone).
                Err(err) => {
                    self.report(watcher::Error::WatchFailed(err));
                    self.wait().await?;
                    continue;
                }
            };
            if object_version.is_empty() {
                let err = watcher::Error::NoResourceVersion;
                return Ok(Step::Failed(err, Next::List { from_cache: false }));
            }
            self.backoff.reset();
            version = object_version;
            self.deliver(event).await?;
        }
        // The watch timed out or the connection closed: watch again from where it stopped.
        Ok(Step::Next(Next::Watch(version)))
    }

    /// Hands one event to the tracker and what it reports to the consumer.
    async fn deliver(&mut self, event: Event<kp_core::track::Object>) -> Result<(), Closed> {
        for out in self.tracker.handle(event) {
            self.ctx.tx.send(out).await.map_err(|_| Closed)?;
        }
        Ok(())
    }

    /// An item of a list that does not decode: logged and counted, and its key returned if it
    /// has one, so that a re-list does not take it for deleted.
    fn undecodable(&self, item: &[u8], err: serde_json::Error) -> Option<ObjectKey> {
        let kind = self.tracker.kind();
        let key = serde_json::from_slice::<KeyOnly>(item).ok().and_then(|k| {
            let name = k.metadata.name?;
            let namespace = match kind {
                kp_core::track::Kind::Node | kp_core::track::Kind::ServiceCidr => String::new(),
                _ => k.metadata.namespace.unwrap_or_else(|| "default".into()),
            };
            Some(ObjectKey { namespace, name })
        });
        match &key {
            Some(key) => {
                warn!(%kind, %key, error = %err, "skipping an object that does not decode")
            }
            None => warn!(%kind, error = %err, "skipping an object that does not decode"),
        }
        self.ctx.metrics.source_error(SOURCE, "decode");
        key
    }

    /// Logs and counts an error.
    fn report(&self, source: watcher::Error) {
        let kind = self.tracker.kind();
        let reason = super::error_reason(&source);
        let err = crate::SourceError::Watch { kind, source };
        warn!(%kind, reason, error = %err, "Kubernetes API error; retrying with backoff");
        self.ctx.metrics.source_error(SOURCE, reason);
    }

    /// Waits as the backoff says after an error.
    async fn wait(&mut self) -> Result<(), Closed> {
        let Some(delay) = self.backoff.next() else {
            return Ok(());
        };
        tokio::select! {
            _ = self.ctx.tx.closed() => Err(Closed),
            _ = tokio::time::sleep(delay) => Ok(()),
        }
    }
}
