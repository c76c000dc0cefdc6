//! The standalone source: Service, EndpointSlice, Endpoints, Node and ServiceCIDR manifests in
//! a directory.
//!
//! v1 Endpoints objects are passed on as they are; kp-core mirrors them into EndpointSlices as a
//! cluster's EndpointSliceMirroring controller does (`kp_core::mirror`), and a Service's own
//! EndpointSlices win over them. An Endpoints subset with more addresses than the controller
//! mirrors is logged here, once per change of the object.
//!
//! Upstream has no such source; this one exists so that the proxy can run without an API server
//! (tests, appliances). It keeps the same contract as the API source: `Synced` after the first
//! read of the directory, and afterwards only changes.
//!
//! Every change under the directory (inotify, via `notify`) wakes the source; once the directory
//! has been quiet for a moment ([`QUIET`]) and no file written to is still open for writing
//! (waiting at most [`MAX_WAIT`]), it lists the directory again, re-parses only the files whose
//! text changed, and in a YAML file only the documents whose text changed (an edit of one
//! object decodes that object), and reports the difference ([`parse::ManifestSet`]). A file
//! whose metadata has not changed since a look long enough after its last change is not even
//! read again. Changed files are parsed in parallel, on as many threads as the process may use.
//!
//! A file that fails to read or parse keeps its last good content in force, so a half-written
//! or broken file never removes anything; write files atomically (write elsewhere, then rename
//! into the directory) to avoid reading one half-written. Mounted ConfigMaps, which swap a
//! `..data` symlink, work as they are.
//!
//! A file's failure is reported (logged and counted) once per change of the file, not once per
//! rescan: every rescan sees every file, and one busy file would otherwise repeat another's
//! error many times a second. A failed file is not even read again until its metadata (size,
//! times, inode) changes, so a file over the size limit costs one `stat` per rescan.

pub mod parse;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kp_core::track::{Kind, Object, SourceEvent};
use kp_metrics::Metrics;
use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::SourceError;
use parse::{
    digest, for_each_object, for_each_object_in, text_digest, Digest, ManifestSet, Wanted,
};

/// The `source` label of this source's error metric.
const SOURCE: &str = "manifests";

/// How long the directory must stay quiet after a change before it is read: tools that change
/// several files, or replace one in several steps (a ConfigMap's symlink swap, a delete and a
/// create), are read once they are done.
const QUIET: Duration = Duration::from_millis(4);

/// The longest a change waits for the directory to become quiet and for files written to be
/// closed: a writer that keeps a file open (an editor writing in several steps, `kubectl get
/// -o yaml > file` streaming) is waited for this long before the file is read anyway.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// Files larger than this are refused rather than read into memory.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// How long after a file's last change its [`Stamp`] is trusted to change with the next
/// change. File times come from a coarse clock (a tick of some milliseconds; whole seconds,
/// or two on FAT, on some filesystems), so a write in the same tick as a look may leave the
/// metadata as the look saw it; until then the file is read again at every rescan.
const SETTLE_SECS: i64 = 2;

/// [`SETTLE_SECS`] on a filesystem whose file times are finer than a millisecond (ext4, xfs,
/// btrfs, tmpfs): there they come from the kernel's coarse clock, which ticks at least every
/// 10 ms (HZ >= 100), so a change this long after the last one always changes the ctime. A
/// file just written is then read again by the rescans of the next 100 ms, not of 2 s.
const SETTLE_FINE_NANOS: i64 = 100_000_000;

/// A file of at most this many bytes is parsed once, its objects held until the whole file has
/// parsed; a larger one is parsed again to report its objects, rather than holding them all.
const KEEP_BYTES: usize = 512 * 1024;

/// Changed files are read and parsed in batches of about this many bytes, the files of a batch
/// in parallel: this bounds the text and parsed objects held at once.
const BATCH_BYTES: usize = 512 * 1024;

/// Reads the manifests in `dir` and follows changes to them, sending what it sees to `tx`.
/// Runs until `tx`'s receiver is dropped.
///
/// Reads every `*.yaml`, `*.yml` and `*.json` file directly in `dir` (not in subdirectories),
/// skipping hidden files (a leading `.`) and editor backups (a trailing `~`); see
/// [`parse::for_each_object`] for what a file may hold. After the first read it sends
/// `Synced(Service)`, `Synced(EndpointSlice)` and `Synced(Node)`. Errors in a file are logged
/// with the file and document, counted (`source="manifests"`, `reason` `read` or `parse`), and
/// leave the file's last good content in force; each is reported once per change of the file
/// (see the module's documentation).
///
/// Changed files are read in batches of about [`BATCH_BYTES`] and parsed in parallel (YAML
/// files in pieces of whole documents), then their objects sent file by file (waiting while
/// the channel is full); a file larger than [`KEEP_BYTES`] is parsed again to send its objects.
/// So memory holds a batch's text and the objects of its small files, never the directory.
///
/// Fails only at start-up: when inotify cannot watch `dir`, or `dir` cannot be listed.
pub async fn run_manifests(
    dir: PathBuf,
    tx: mpsc::Sender<SourceEvent>,
    metrics: Arc<Metrics>,
) -> Result<(), SourceError> {
    // One pending wake-up is enough: every wake-up re-lists the whole directory.
    let (wake_tx, mut wake_rx) = mpsc::channel::<()>(1);
    let activity = Arc::new(Mutex::new(Activity::default()));
    let watch_activity = activity.clone();
    let notify_metrics = metrics.clone();
    let notify_err = |source| SourceError::Notify {
        path: dir.clone(),
        source,
    };
    // Watch before the first read, so that nothing written in between is missed.
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        match res {
            Ok(event) if !wakes(&event.kind) => return,
            Ok(event) => lock(&watch_activity).observe(&event),
            Err(err) => {
                lock(&watch_activity).saw_change();
                // Typically the inotify queue overflowed; re-reading everything recovers.
                warn!(error = %err, "manifest directory watch error; re-reading the directory");
                notify_metrics.source_error(SOURCE, "watch");
            }
        }
        let _ = wake_tx.try_send(());
    })
    .map_err(notify_err)?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(notify_err)?;

    let (mut state, first) = rescan(DirState::new(dir, metrics), tx.clone()).await?;
    let Some(sent) = first? else {
        return Ok(());
    };
    info!(
        dir = %state.dir.display(),
        objects = state.set.len(),
        files = state.set.files().count(),
        sent,
        "read manifest directory"
    );
    for kind in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        if tx.send(SourceEvent::Synced(kind)).await.is_err() {
            return Ok(());
        }
    }

    loop {
        tokio::select! {
            _ = tx.closed() => return Ok(()),
            woken = wake_rx.recv() => {
                // `watcher` holds the sender and lives as long as this loop, so this is
                // `Some`; stop cleanly rather than spin if that ever changes.
                if woken.is_none() {
                    return Ok(());
                }
            }
        }
        settle_down(&activity, &mut wake_rx).await;
        let (next, result) = rescan(state, tx.clone()).await?;
        state = next;
        match result {
            Ok(Some(sent)) => debug!(changes = sent, "re-read manifest directory"),
            Ok(None) => return Ok(()),
            Err(err) => {
                error!(error = %err, "keeping the manifests already read");
                state.metrics.source_error(SOURCE, "read");
            }
        }
    }
}

/// Lists and reads the directory on a blocking thread, sending what changed to `tx` as it goes.
/// Returns the state back with the number of events sent, `None` if `tx`'s receiver is gone,
/// or why the directory could not be listed. Fails itself only if the reading thread died.
async fn rescan(
    mut state: DirState,
    tx: mpsc::Sender<SourceEvent>,
) -> Result<(DirState, Result<Option<usize>, SourceError>), SourceError> {
    let dir = state.dir.clone();
    tokio::task::spawn_blocking(move || {
        let result = state.rescan_blocking(&tx);
        (state, result)
    })
    .await
    .map_err(|err| SourceError::ManifestDir {
        path: dir,
        source: io::Error::other(format!("the manifest reader failed: {err}")),
    })
}

/// Whether a filesystem event may have changed a manifest. Opening or reading a file (which
/// this source itself does) does not; finishing a write does.
fn wakes(kind: &EventKind) -> bool {
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// What the watcher saw: how many changes, and which files are being written.
#[derive(Debug, Default)]
struct Activity {
    /// Changes seen so far.
    events: u64,
    /// When the last change was seen.
    last: Option<Instant>,
    /// Files written to and not closed since: their writer is probably not done.
    writing: HashSet<PathBuf>,
}

impl Activity {
    /// Counts a change whose kind is not known (a watch error).
    fn saw_change(&mut self) {
        self.events += 1;
        self.last = Some(Instant::now());
    }

    /// Records a change (one that [`wakes`] the source).
    fn observe(&mut self, event: &notify::Event) {
        self.saw_change();
        match event.kind {
            EventKind::Modify(ModifyKind::Data(_)) => {
                self.writing.extend(event.paths.iter().cloned());
            }
            EventKind::Access(AccessKind::Close(AccessMode::Write)) | EventKind::Remove(_) => {
                for path in &event.paths {
                    self.writing.remove(path);
                }
            }
            // A file renamed away is no longer written under its old name.
            EventKind::Modify(ModifyKind::Name(RenameMode::From | RenameMode::Both)) => {
                if let Some(path) = event.paths.first() {
                    self.writing.remove(path);
                }
            }
            _ => {}
        }
    }
}

fn lock(activity: &Mutex<Activity>) -> std::sync::MutexGuard<'_, Activity> {
    activity.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits, after a wake-up, until the directory is quiet ([`QUIET`] since the last change) and
/// no file written to is still open, or [`MAX_WAIT`] has passed; drops the wake-ups meanwhile.
/// The quiet period counts from the last change, not from the wake-up: a file written aside
/// and renamed into place is read `QUIET` after the rename.
async fn settle_down(activity: &Mutex<Activity>, wake_rx: &mut mpsc::Receiver<()>) {
    let start = Instant::now();
    let deadline = start + MAX_WAIT;
    loop {
        while wake_rx.try_recv().is_ok() {}
        let (last, writing) = {
            let a = lock(activity);
            (a.last, !a.writing.is_empty())
        };
        let now = Instant::now();
        let quiet_at = last.map_or(now, |last| last + QUIET);
        if (quiet_at <= now && !writing) || now >= deadline {
            return;
        }
        // Still being written: look again a quiet period later.
        let until = if quiet_at > now {
            quiet_at
        } else {
            now + QUIET
        };
        tokio::time::sleep_until(until.min(deadline).into()).await;
    }
}

/// Logs an Endpoints object whose subsets hold more addresses than are mirrored (as the
/// mirroring controller warns about it), before it is sent.
fn warn_truncated(obj: &Object) {
    let Object::Endpoints(endpoints) = obj else {
        return;
    };
    let skipped = kp_core::mirror::truncated(endpoints);
    if skipped > 0 {
        warn!(
            endpoints = %obj.key(),
            skipped,
            "at most {} addresses of an Endpoints subset are mirrored; the rest are left out",
            kp_core::mirror::MAX_ENDPOINTS_PER_SUBSET
        );
    }
}

/// Whether a file name is one this source reads.
fn is_manifest_name(name: &str) -> bool {
    if name.starts_with('.') || name.ends_with('~') {
        return false;
    }
    let ext = match name.rsplit_once('.') {
        Some((stem, ext)) if !stem.is_empty() => ext,
        _ => return false,
    };
    matches!(ext, "yaml" | "yml" | "json")
}

/// The receiver of the events is gone: stop.
struct Closed;

/// A file's metadata, enough to tell that it changed without reading it: writing changes its
/// size, mtime or ctime, and so do `chmod` and `chown` (ctime); replacing it (a rename into
/// place, a ConfigMap's symlink swap) changes its inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    /// The device holding the file.
    dev: u64,
    /// The file's inode on that device.
    ino: u64,
    /// Its size in bytes.
    size: u64,
    /// Seconds and nanoseconds since the epoch.
    mtime: (i64, i64),
    /// Seconds and nanoseconds since the epoch.
    ctime: (i64, i64),
}

impl Stamp {
    /// The stamp of a file with metadata `meta`.
    fn of(meta: &fs::Metadata) -> Stamp {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// Whether the file last changed long enough before `now` that its next change is sure
    /// to change the stamp (see [`SETTLE_SECS`] and [`SETTLE_FINE_NANOS`]). A file time in
    /// the future never is.
    fn settled(&self, now: SystemTime) -> bool {
        let Some(now) = now.duration_since(UNIX_EPOCH).ok().and_then(|d| {
            Some((
                i64::try_from(d.as_secs()).ok()?,
                i64::from(d.subsec_nanos()),
            ))
        }) else {
            return false;
        };
        let nanos =
            |(secs, nanos): (i64, i64)| i128::from(secs) * 1_000_000_000 + i128::from(nanos);
        // The kernel sets the ctime at every change, so its nanoseconds tell the filesystem's
        // granularity (a fine one shows a whole millisecond once in a thousand: it waits long).
        let window = if self.ctime.1 % 1_000_000 != 0 {
            i128::from(SETTLE_FINE_NANOS)
        } else {
            i128::from(SETTLE_SECS) * 1_000_000_000
        };
        nanos(self.mtime.max(self.ctime)) + window <= nanos(now)
    }
}

/// The files of the directory as a scan sees them: [`Disk`], or a test's fake.
trait Files {
    /// The metadata of the file, following symlinks; `None` if it is not a regular file.
    fn stamp(&mut self, path: &Path) -> io::Result<Option<Stamp>>;

    /// The text of the file; `None` if it is not a regular file. Fails for a file over
    /// [`MAX_FILE_BYTES`] or not UTF-8.
    fn read(&mut self, path: &Path) -> io::Result<Option<String>>;
}

/// The files as they are on disk.
struct Disk;

impl Files for Disk {
    fn stamp(&mut self, path: &Path) -> io::Result<Option<Stamp>> {
        let meta = fs::metadata(path)?;
        Ok(meta.is_file().then(|| Stamp::of(&meta)))
    }

    fn read(&mut self, path: &Path) -> io::Result<Option<String>> {
        read_file(path)
    }
}

/// What one look at a file saw. Two looks that saw the same are the same version of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Look {
    /// Its metadata, taken before reading it (so that a change while it is read changes the
    /// next look's stamp); `None` if even that failed.
    stamp: Option<Stamp>,
    /// The digest of its text; `None` if it could not be read.
    text: Option<Digest>,
}

/// What the source knows of a file from its last look.
#[derive(Debug)]
struct Seen {
    /// What the look saw.
    look: Look,
    /// Whether `look.stamp` was taken long enough after the file's last change that it is
    /// sure to differ once the file changes.
    settled: bool,
    /// Whether the file failed to read or parse at that look (and so was reported). Its last
    /// good content, if any, is still in force.
    failed: bool,
}

/// The directory's state between rescans.
struct DirState {
    dir: PathBuf,
    metrics: Arc<Metrics>,
    set: ManifestSet,
    /// What the last look at every file present saw, parsed or not, so that unchanged files
    /// are not parsed (or complained about) again, nor even read again once settled.
    seen: HashMap<PathBuf, Seen>,
    /// What the last good parse of each YAML file found, document by document.
    docs: HashMap<PathBuf, FileDocs>,
    /// [`KEEP_BYTES`], smaller in tests.
    keep_bytes: usize,
}

impl DirState {
    fn new(dir: PathBuf, metrics: Arc<Metrics>) -> Self {
        DirState {
            dir,
            metrics,
            set: ManifestSet::new(),
            seen: HashMap::new(),
            docs: HashMap::new(),
            keep_bytes: KEEP_BYTES,
        }
    }

    /// Lists and reads the directory, sending what changed since the previous call; returns
    /// the number of events sent, or `None` if the receiver is gone. Blocks.
    fn rescan_blocking(
        &mut self,
        tx: &mpsc::Sender<SourceEvent>,
    ) -> Result<Option<usize>, SourceError> {
        let listing = list_dir(&self.dir).map_err(|source| SourceError::ManifestDir {
            path: self.dir.clone(),
            source,
        })?;
        let mut emit = |ev: SourceEvent| {
            if let SourceEvent::Upsert(obj) = &ev {
                warn_truncated(obj);
            }
            tx.blocking_send(ev).is_ok()
        };
        // Taken before any file is looked at, so that a file is never thought settled early.
        let now = SystemTime::now();
        Ok(self.scan(listing, &mut Disk, now, &mut emit).ok())
    }

    /// Applies one read of the directory: `listing` names the manifest files present, `files`
    /// reads them, `now` is a time no later than the first look at a file, and `emit` sends
    /// one event (false: the receiver is gone). Returns the number of events sent. Files that
    /// fail to read or parse keep their last good content.
    fn scan(
        &mut self,
        listing: Vec<PathBuf>,
        files: &mut dyn Files,
        now: SystemTime,
        emit: &mut dyn FnMut(SourceEvent) -> bool,
    ) -> Result<usize, Closed> {
        let mut sent = 0;
        let mut present = BTreeSet::new();
        // Files read and changed, to parse together.
        let mut batch = Vec::new();
        let mut batch_bytes = 0;
        for path in listing {
            let stamp = match files.stamp(&path) {
                Ok(Some(stamp)) => Some(stamp),
                Ok(None) => continue,
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => {
                    present.insert(path.clone());
                    let look = Look {
                        stamp: None,
                        text: None,
                    };
                    let err = SourceError::ManifestRead {
                        path: path.clone(),
                        source,
                    };
                    self.failed(&path, look, false, "read", err);
                    continue;
                }
            };
            present.insert(path.clone());
            let settled = stamp.is_some_and(|s| s.settled(now));
            if self
                .seen
                .get(&path)
                .is_some_and(|seen| seen.settled && seen.look.stamp == stamp)
            {
                // Unchanged since a look that is sure to have seen its last change: reading it
                // again would read the same text (or fail again).
                continue;
            }
            let text = match files.read(&path) {
                Ok(Some(text)) => text,
                Ok(None) => {
                    present.remove(&path);
                    continue;
                }
                Err(err) if err.kind() == io::ErrorKind::NotFound => {
                    present.remove(&path);
                    continue;
                }
                Err(source) => {
                    // No text: once readable, it is parsed again even if its text is as before.
                    let look = Look { stamp, text: None };
                    let err = SourceError::ManifestRead {
                        path: path.clone(),
                        source,
                    };
                    self.failed(&path, look, settled, "read", err);
                    continue;
                }
            };
            let look = Look {
                stamp,
                text: Some(text_digest(&text)),
            };
            if let Some(seen) = self.seen.get_mut(&path) {
                if seen.look.text == look.text {
                    // The same text (a touch, a rename of the same content, a ConfigMap
                    // update of other files): not parsed again, and if it failed to parse,
                    // already reported. The new stamp saves reading it next time.
                    seen.look = look;
                    seen.settled = settled;
                    continue;
                }
            }
            batch_bytes += text.len();
            batch.push(Job {
                path,
                look,
                settled,
                text,
            });
            if batch_bytes >= BATCH_BYTES {
                sent += self.read_files(std::mem::take(&mut batch), emit)?;
                batch_bytes = 0;
            }
        }
        sent += self.read_files(batch, emit)?;

        let gone: Vec<PathBuf> = self
            .set
            .files()
            .chain(self.seen.keys().map(PathBuf::as_path))
            .filter(|path| !present.contains(*path))
            .map(Path::to_path_buf)
            .collect();
        for path in gone {
            // Forgotten with its failure: if it comes back, it is a new file.
            self.seen.remove(&path);
            self.docs.remove(&path);
            self.set.remove_file(&path);
        }

        let settled = self.set.settle();
        for (path, wanted) in settled.reread {
            // Only the text of the file's last good parse holds the versions in force.
            let good = self
                .seen
                .get(&path)
                .filter(|seen| !seen.failed)
                .and_then(|seen| seen.look.text);
            let text = match files.read(&path) {
                Ok(Some(text)) if good.is_some() && good == Some(text_digest(&text)) => text,
                // Changed since it was parsed (or broken, or gone): what is in force stays
                // until the file is read next.
                _ => {
                    warn!(
                        file = %path.display(),
                        objects = wanted.len(),
                        "cannot read the file again to report its objects; keeping their last reported versions"
                    );
                    for (_, key) in &wanted {
                        self.set.not_reported(key);
                    }
                    continue;
                }
            };
            sent += self.send_decoded(&path, &text, &wanted, emit)?;
        }
        for (kind, key) in settled.deleted {
            if !emit(SourceEvent::Delete(kind, key)) {
                return Err(Closed);
            }
            sent += 1;
        }
        Ok(sent)
    }

    /// Records that a file failed to read or parse at `look`, and reports it (logs `err` and
    /// counts it under `reason`) unless the previous look saw the same version fail.
    ///
    /// Every per-file failure goes through here, so that each is reported once per change of
    /// the file whatever its kind. The file's last good content stays in force.
    fn failed(
        &mut self,
        path: &Path,
        look: Look,
        settled: bool,
        reason: &'static str,
        err: SourceError,
    ) {
        let seen = self.seen.entry(path.to_path_buf()).or_insert(Seen {
            look,
            settled,
            failed: false,
        });
        let reported = seen.failed && seen.look == look;
        *seen = Seen {
            look,
            settled,
            failed: true,
        };
        if reported {
            debug!(error = %err, "still failing, unchanged");
            return;
        }
        error!(error = %err, "keeping the file's last good content");
        self.metrics.source_error(SOURCE, reason);
    }

    /// Parses new or changed files (in parallel) and sends what changed in them, file by file
    /// in order. A file that fails to parse keeps its last good content.
    fn read_files(
        &mut self,
        jobs: Vec<Job>,
        emit: &mut dyn FnMut(SourceEvent) -> bool,
    ) -> Result<usize, Closed> {
        let parsed = {
            let prev: Vec<Option<&FileDocs>> =
                jobs.iter().map(|job| self.docs.get(&job.path)).collect();
            parse_all(&jobs, &prev, parse_threads(), self.keep_bytes)
        };
        let mut sent = 0;
        for (job, parsed) in jobs.into_iter().zip(parsed) {
            let Job {
                path,
                look,
                settled,
                text,
            } = job;
            let Parsed {
                objects,
                kept,
                docs,
            } = match parsed {
                Ok(parsed) => parsed,
                Err(err) => {
                    self.failed(&path, look, settled, "parse", err);
                    continue;
                }
            };
            self.seen.insert(
                path.clone(),
                Seen {
                    look,
                    settled,
                    failed: false,
                },
            );
            let digests: Vec<Digest> = objects.iter().map(|(_, d)| *d).collect();
            let (wanted, keys) = self.set.update_file_keys(&path, objects);
            match &docs {
                Some(docs) => {
                    let objects = keys.into_iter().zip(digests).collect();
                    let docs = FileDocs {
                        docs: docs.clone(),
                        objects,
                    };
                    self.docs.insert(path.clone(), docs);
                }
                None => {
                    self.docs.remove(&path);
                }
            }
            sent += self.send_wanted(&path, &text, kept, docs.as_deref(), &wanted, emit)?;
        }
        Ok(sent)
    }

    /// Sends the `wanted` objects of a file: from `kept` (by ordinal; `None` where not kept),
    /// or else by decoding again the documents that hold them (`docs`: each YAML document's
    /// text digest and number of objects), or the whole `text` if that is not known.
    fn send_wanted(
        &mut self,
        path: &Path,
        text: &str,
        mut kept: Vec<Option<Object>>,
        docs: Option<&[(Digest, u32)]>,
        wanted: &[Wanted],
        emit: &mut dyn FnMut(SourceEvent) -> bool,
    ) -> Result<usize, Closed> {
        if wanted.is_empty() {
            return Ok(0);
        }
        let mut sent = 0;
        let Some(docs) = docs else {
            let mut missing = Vec::new();
            for (ordinal, key) in wanted {
                match kept.get_mut(*ordinal as usize).and_then(Option::take) {
                    Some(obj) => {
                        if !emit(SourceEvent::Upsert(obj)) {
                            return Err(Closed);
                        }
                        sent += 1;
                    }
                    None => missing.push((*ordinal, key.clone())),
                }
            }
            return Ok(sent + self.send_decoded(path, text, &missing, emit)?);
        };
        // Document by document, in file order: a document's objects are all kept or none are.
        let mut texts: Option<Vec<parse::YamlDocument<'_>>> = None;
        let mut rest = wanted;
        let mut start = 0usize;
        for (index, &(_, count)) in docs.iter().enumerate() {
            let end = start + count as usize;
            let n = rest.partition_point(|w| (w.0 as usize) < end);
            let (here, after) = rest.split_at(n);
            rest = after;
            let from = start;
            start = end;
            if here.is_empty() {
                continue;
            }
            if kept.get(here[0].0 as usize).is_some_and(Option::is_some) {
                for (ordinal, key) in here {
                    match kept.get_mut(*ordinal as usize).and_then(Option::take) {
                        Some(obj) => {
                            if !emit(SourceEvent::Upsert(obj)) {
                                return Err(Closed);
                            }
                            sent += 1;
                        }
                        None => self.set.not_reported(key),
                    }
                }
                continue;
            }
            let texts = texts.get_or_insert_with(|| parse::yaml_documents(text));
            let Some(doc) = texts.get(index) else {
                for (_, key) in here {
                    self.set.not_reported(key);
                }
                continue;
            };
            sent += self.decode_and_send(
                here,
                from,
                |want, f| for_each_object_in(path, doc, want, f),
                emit,
            )?;
        }
        for (_, key) in rest {
            self.set.not_reported(key);
        }
        Ok(sent)
    }

    /// Sends the `wanted` objects of the file `path` by decoding its whole `text` again.
    fn send_decoded(
        &mut self,
        path: &Path,
        text: &str,
        wanted: &[Wanted],
        emit: &mut dyn FnMut(SourceEvent) -> bool,
    ) -> Result<usize, Closed> {
        if wanted.is_empty() {
            return Ok(0);
        }
        self.decode_and_send(
            wanted,
            0,
            |want, f| for_each_object(path, text, want, f),
            emit,
        )
    }

    /// Decodes with `decode` (a whole file, or one of its documents whose objects are numbered
    /// from `from` in the file) and sends the `wanted` objects among them (sorted by ordinal).
    /// If the text no longer parses, the wanted objects are marked not reported.
    fn decode_and_send(
        &mut self,
        wanted: &[Wanted],
        from: usize,
        decode: impl FnOnce(
            &mut dyn FnMut(usize) -> bool,
            &mut dyn FnMut(usize, Object),
        ) -> Result<(), SourceError>,
        emit: &mut dyn FnMut(SourceEvent) -> bool,
    ) -> Result<usize, Closed> {
        let mut sent = 0;
        let mut next = 0;
        let mut closed = false;
        let decoded = decode(
            &mut |n| {
                wanted
                    .binary_search_by_key(&((from + n) as u32), |w| w.0)
                    .is_ok()
            },
            &mut |n, obj| {
                let n = from + n;
                while next < wanted.len() && (wanted[next].0 as usize) < n {
                    next += 1;
                }
                if closed || next == wanted.len() || wanted[next].0 as usize != n {
                    return;
                }
                next += 1;
                if emit(SourceEvent::Upsert(obj)) {
                    sent += 1;
                } else {
                    closed = true;
                }
            },
        );
        if closed {
            return Err(Closed);
        }
        if let Err(err) = decoded {
            // The same text parsed a moment ago; only a bug gets here.
            error!(error = %err, "a manifest that parsed before no longer does");
            for (_, key) in wanted {
                self.set.not_reported(key);
            }
        }
        Ok(sent)
    }
}

/// A new or changed file to parse.
struct Job {
    path: PathBuf,
    /// The look that read it.
    look: Look,
    settled: bool,
    text: String,
}

/// What the source keeps of a YAML file's last good parse so that a change decodes only the
/// documents whose text changed: each document's text digest and number of objects, and every
/// object's key and digest, in file order. A document's objects follow from its text alone.
#[derive(Debug)]
struct FileDocs {
    docs: Vec<(Digest, u32)>,
    objects: Vec<(Arc<parse::Key>, Digest)>,
}

/// One document's objects, as [`FileDocs`] holds them.
type DocObjects<'a> = &'a [(Arc<parse::Key>, Digest)];

impl FileDocs {
    /// The objects of each document, by the digest of its text.
    fn by_text(&self) -> HashMap<Digest, DocObjects<'_>> {
        let mut map = HashMap::with_capacity(self.docs.len());
        let mut start = 0usize;
        for &(text, count) in &self.docs {
            let end = start + count as usize;
            if let Some(objects) = self.objects.get(start..end) {
                map.insert(text, objects);
            }
            start = end;
        }
        map
    }
}

/// A file that parsed: every object's key and digest, in file order; the objects decoded, by
/// ordinal, if the text decoded is small ([`KEEP_BYTES`]) (`None` for the others, and for those
/// of unchanged documents, which were not decoded); and for a YAML file, each document's text
/// digest and number of objects.
struct Parsed {
    objects: Vec<(parse::Key, Digest)>,
    kept: Vec<Option<Object>>,
    docs: Option<Vec<(Digest, u32)>>,
}

/// Parses one whole file. The whole file must parse before any of it counts, so a large file
/// keeps only keys and digests (see [`Parsed`]).
fn parse_piece(path: &Path, text: &str, keep: bool) -> Result<Parsed, SourceError> {
    let mut objects = Vec::new();
    let mut kept = Vec::new();
    for_each_object(path, text, &mut |_| true, &mut |_, obj| {
        objects.push(((obj.kind(), obj.key()), digest(&obj)));
        kept.push(keep.then_some(obj));
    })?;
    Ok(Parsed {
        objects,
        kept,
        docs: None,
    })
}

/// The objects decoded from one YAML document.
struct DocParsed {
    objects: Vec<(parse::Key, Digest)>,
    kept: Vec<Option<Object>>,
}

/// Decodes one YAML document of the file `path`.
fn parse_doc(
    path: &Path,
    doc: &parse::YamlDocument<'_>,
    keep: bool,
) -> Result<DocParsed, SourceError> {
    let mut objects = Vec::new();
    let mut kept = Vec::new();
    for_each_object_in(path, doc, &mut |_| true, &mut |_, obj| {
        objects.push(((obj.kind(), obj.key()), digest(&obj)));
        kept.push(keep.then_some(obj));
    })?;
    Ok(DocParsed { objects, kept })
}

/// How many threads parse files: as many as the process may run on.
fn parse_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The documents of a YAML file are decoded in pieces of about this many bytes, in parallel,
/// when there is more than one thread to parse on: a large file, or a file that changed alone,
/// is not left to one.
const PIECE_BYTES: usize = 64 * 1024;

/// One piece of parsing work: a whole (JSON) file, or some documents of a YAML file.
enum Work {
    Whole(usize),
    Docs(usize, Vec<usize>),
}

/// What a piece of work gave: the whole file's result, or each document's (up to the first
/// that failed).
enum Done {
    Whole(Result<Parsed, SourceError>),
    Docs(Vec<Result<DocParsed, SourceError>>),
}

/// Parses `jobs` on up to `threads` threads; the results in the order of `jobs`. `prev` holds,
/// for each job, what its file's last good parse left ([`FileDocs`]): a YAML document whose
/// text it decoded before is not decoded again. The documents to decode are decoded in pieces
/// (see [`PIECE_BYTES`]); a file's error is that of its first failing document, as decoding
/// the whole file reports it.
fn parse_all(
    jobs: &[Job],
    prev: &[Option<&FileDocs>],
    threads: usize,
    keep_bytes: usize,
) -> Vec<Result<Parsed, SourceError>> {
    struct Plan<'t, 'p> {
        docs: Vec<(parse::YamlDocument<'t>, Digest)>,
        reused: Vec<Option<DocObjects<'p>>>,
        keep: bool,
    }
    // Each YAML file's documents and their digests, found on the parse threads too.
    let indices: Vec<usize> = (0..jobs.len()).collect();
    let plans: Vec<Option<Plan<'_, '_>>> = parallel_map(&indices, threads, |&i| {
        let job = &jobs[i];
        if job.path.extension().is_some_and(|ext| ext == "json") {
            return None;
        }
        let known = prev
            .get(i)
            .copied()
            .flatten()
            .map(FileDocs::by_text)
            .unwrap_or_default();
        let docs: Vec<_> = parse::yaml_documents(&job.text)
            .into_iter()
            .map(|doc| {
                let digest = text_digest(doc.text());
                (doc, digest)
            })
            .collect();
        let reused: Vec<_> = docs
            .iter()
            .map(|(_, digest)| known.get(digest).copied())
            .collect();
        let decode_bytes: usize = docs
            .iter()
            .zip(&reused)
            .filter(|(_, r)| r.is_none())
            .map(|((doc, _), _)| doc.text().len())
            .sum();
        Some(Plan {
            docs,
            reused,
            keep: decode_bytes <= keep_bytes,
        })
    });
    let mut work = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        let Some(plan) = plan else {
            work.push(Work::Whole(i));
            continue;
        };
        let mut piece = Vec::new();
        let mut piece_bytes = 0;
        for (k, ((doc, _), r)) in plan.docs.iter().zip(&plan.reused).enumerate() {
            if r.is_some() {
                continue;
            }
            piece.push(k);
            piece_bytes += doc.text().len();
            if threads > 1 && piece_bytes >= PIECE_BYTES {
                work.push(Work::Docs(i, std::mem::take(&mut piece)));
                piece_bytes = 0;
            }
        }
        if !piece.is_empty() {
            work.push(Work::Docs(i, piece));
        }
    }
    let done = parallel_map(&work, threads, |w| match w {
        Work::Whole(i) => Done::Whole(parse_piece(
            &jobs[*i].path,
            &jobs[*i].text,
            jobs[*i].text.len() <= keep_bytes,
        )),
        Work::Docs(i, docs) => {
            let mut out = Vec::with_capacity(docs.len());
            if let Some(plan) = &plans[*i] {
                for &k in docs {
                    let parsed = parse_doc(&jobs[*i].path, &plan.docs[k].0, plan.keep);
                    let failed = parsed.is_err();
                    out.push(parsed);
                    if failed {
                        break;
                    }
                }
            }
            Done::Docs(out)
        }
    });
    // Each job's decoded documents, by their index in the file.
    let mut whole: Vec<Option<Result<Parsed, SourceError>>> = jobs.iter().map(|_| None).collect();
    let mut decoded: Vec<HashMap<usize, Result<DocParsed, SourceError>>> =
        jobs.iter().map(|_| HashMap::new()).collect();
    for (w, d) in work.iter().zip(done) {
        match (w, d) {
            (Work::Whole(i), Done::Whole(r)) => whole[*i] = Some(r),
            (Work::Docs(i, docs), Done::Docs(results)) => {
                decoded[*i].extend(docs.iter().copied().zip(results));
            }
            _ => {}
        }
    }
    let mut out = Vec::with_capacity(jobs.len());
    for (i, plan) in plans.into_iter().enumerate() {
        let Some(plan) = plan else {
            out.push(whole[i].take().unwrap_or_else(|| {
                parse_piece(
                    &jobs[i].path,
                    &jobs[i].text,
                    jobs[i].text.len() <= keep_bytes,
                )
            }));
            continue;
        };
        let mut parsed = Parsed {
            objects: Vec::new(),
            kept: Vec::new(),
            docs: Some(Vec::with_capacity(plan.docs.len())),
        };
        let mut failed = None;
        for (k, ((doc, text), reused)) in plan.docs.iter().zip(&plan.reused).enumerate() {
            let count = match reused {
                Some(objects) => {
                    parsed
                        .objects
                        .extend(objects.iter().map(|(key, d)| ((**key).clone(), *d)));
                    parsed.kept.extend(objects.iter().map(|_| None));
                    objects.len()
                }
                None => {
                    // A piece stops at its first failure; a document it did not reach is
                    // decoded here (only a later failure in the same file gets here).
                    let result = decoded[i]
                        .remove(&k)
                        .unwrap_or_else(|| parse_doc(&jobs[i].path, doc, plan.keep));
                    match result {
                        Ok(d) => {
                            let count = d.objects.len();
                            parsed.objects.extend(d.objects);
                            parsed.kept.extend(d.kept);
                            count
                        }
                        Err(err) => {
                            failed = Some(err);
                            break;
                        }
                    }
                }
            };
            if let Some(docs) = &mut parsed.docs {
                docs.push((*text, u32::try_from(count).unwrap_or(u32::MAX)));
            }
        }
        out.push(match failed {
            Some(err) => Err(err),
            None => Ok(parsed),
        });
    }
    out
}

/// `f` over `items` on up to `threads` threads; the results in the order of `items`.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let threads = threads.min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                *results[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
            });
        }
    });
    // `scope` joined every thread, and together they took every index.
    results
        .into_iter()
        .zip(items)
        .map(|(slot, item)| {
            slot.into_inner()
                .unwrap_or_else(PoisonError::into_inner)
                .unwrap_or_else(|| f(item))
        })
        .collect()
}

/// The manifest files directly in `dir`, by name.
fn list_dir(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if is_manifest_name(name) {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// Reads one file, following symlinks; `None` if it is not a regular file.
fn read_file(path: &Path) -> io::Result<Option<String>> {
    let too_large = || io::Error::other(format!("file is larger than {MAX_FILE_BYTES} bytes"));
    let meta = fs::metadata(path)?;
    if !meta.is_file() {
        return Ok(None);
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    // Reading one byte past the limit tells a file that grew since its `stat` without
    // reading all of it.
    fs::File::open(path)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if u64::try_from(bytes.len()).map_or(true, |n| n > MAX_FILE_BYTES) {
        return Err(too_large());
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "file is not UTF-8"))
}

#[cfg(test)]
mod tests;
