//! The standalone source: Service, EndpointSlice and Node manifests in a directory.
//!
//! Upstream has no such source; this one exists so that the proxy can run without an API server
//! (tests, appliances). It keeps the same contract as the API source: `Synced` after the first
//! read of the directory, and afterwards only changes.
//!
//! Every change under the directory (inotify, via `notify`) wakes the source; after a short
//! debounce it lists the directory again, re-parses only the files whose text changed, and
//! reports the difference ([`parse::ManifestSet`]). A file that fails to read or parse keeps its
//! last good content in force, so a half-written or broken file never removes anything; write
//! files atomically (write elsewhere, then rename into the directory) to avoid reading one
//! half-written. Mounted ConfigMaps, which swap a `..data` symlink, work as they are.

pub mod parse;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kp_core::track::{Kind, Object, SourceEvent};
use kp_metrics::Metrics;
use notify::event::{AccessKind, AccessMode};
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::SourceError;
use parse::{parse_file, ManifestSet};

/// The `source` label of this source's error metric.
const SOURCE: &str = "manifests";

/// How long to wait after a change for more changes before reading: editors and `kubectl`
/// often write a file in several steps.
const DEBOUNCE: Duration = Duration::from_millis(50);

/// Files larger than this are refused rather than read into memory.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// Reads the manifests in `dir` and follows changes to them, sending what it sees to `tx`.
/// Runs until `tx`'s receiver is dropped.
///
/// Reads every `*.yaml`, `*.yml` and `*.json` file directly in `dir` (not in subdirectories),
/// skipping hidden files (a leading `.`) and editor backups (a trailing `~`); see
/// [`parse::parse_file`] for what a file may hold. After the first read it sends
/// `Synced(Service)`, `Synced(EndpointSlice)` and `Synced(Node)`. Errors in a file are logged
/// with the file and document, counted (`source="manifests"`, `reason` `read` or `parse`), and
/// leave the file's last good content in force.
///
/// Fails only at start-up: when inotify cannot watch `dir`, or `dir` cannot be listed.
pub async fn run_manifests(
    dir: PathBuf,
    tx: mpsc::Sender<SourceEvent>,
    metrics: Arc<Metrics>,
) -> Result<(), SourceError> {
    // One pending wake-up is enough: every wake-up re-lists the whole directory.
    let (wake_tx, mut wake_rx) = mpsc::channel::<()>(1);
    let notify_metrics = metrics.clone();
    let notify_err = |source| SourceError::Notify {
        path: dir.clone(),
        source,
    };
    // Watch before the first read, so that nothing written in between is missed.
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        match res {
            Ok(event) if !wakes(&event.kind) => return,
            Ok(_) => {}
            Err(err) => {
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

    let mut state = DirState::new(dir, metrics);
    let events = state.rescan().await?;
    info!(
        dir = %state.dir.display(),
        objects = state.set.len(),
        files = state.set.files().count(),
        "read manifest directory"
    );
    for event in events
        .into_iter()
        .chain([Kind::Service, Kind::EndpointSlice, Kind::Node].map(SourceEvent::Synced))
    {
        if tx.send(event).await.is_err() {
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
        tokio::time::sleep(DEBOUNCE).await;
        while wake_rx.try_recv().is_ok() {}
        let events = match state.rescan().await {
            Ok(events) => events,
            Err(err) => {
                error!(error = %err, "keeping the manifests already read");
                state.metrics.source_error(SOURCE, "read");
                continue;
            }
        };
        debug!(changes = events.len(), "re-read manifest directory");
        for event in events {
            if tx.send(event).await.is_err() {
                return Ok(());
            }
        }
    }
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

/// The directory's state between rescans.
struct DirState {
    dir: PathBuf,
    metrics: Arc<Metrics>,
    set: ManifestSet,
    /// The text of every file as last read, parsed or not, so unchanged files are not parsed
    /// (or complained about) again.
    texts: HashMap<PathBuf, String>,
}

impl DirState {
    fn new(dir: PathBuf, metrics: Arc<Metrics>) -> Self {
        DirState {
            dir,
            metrics,
            set: ManifestSet::new(),
            texts: HashMap::new(),
        }
    }

    /// Lists and reads the directory, and returns what changed since the previous call.
    async fn rescan(&mut self) -> Result<Vec<SourceEvent>, SourceError> {
        let dir = self.dir.clone();
        let files = tokio::task::spawn_blocking(move || read_dir_files(&dir))
            .await
            .map_err(|err| io::Error::other(err.to_string()))
            .and_then(|res| res)
            .map_err(|source| SourceError::ManifestDir {
                path: self.dir.clone(),
                source,
            })?;

        Ok(self.apply_read(files))
    }

    /// Applies one read of the directory (each file's text, or why it could not be read),
    /// returning what changed. Files that fail to read or parse keep their last good content.
    fn apply_read(&mut self, files: BTreeMap<PathBuf, io::Result<String>>) -> Vec<SourceEvent> {
        let mut changes: Vec<(PathBuf, Option<Vec<Object>>)> = Vec::new();
        let gone: BTreeSet<PathBuf> = self
            .set
            .files()
            .map(Path::to_path_buf)
            .chain(self.texts.keys().cloned())
            .filter(|path| !files.contains_key(path))
            .collect();
        for path in gone {
            self.texts.remove(&path);
            changes.push((path, None));
        }
        for (path, read) in files {
            let text = match read {
                Ok(text) => text,
                Err(source) => {
                    // Read it again next time, even if its text turns out unchanged.
                    self.texts.remove(&path);
                    let err = SourceError::ManifestRead { path, source };
                    error!(error = %err, "keeping the file's last good content");
                    self.metrics.source_error(SOURCE, "read");
                    continue;
                }
            };
            if self.texts.get(&path) == Some(&text) {
                continue;
            }
            match parse_file(&path, &text) {
                Ok(objects) => changes.push((path.clone(), Some(objects))),
                Err(err) => {
                    error!(error = %err, "keeping the file's last good content");
                    self.metrics.source_error(SOURCE, "parse");
                }
            }
            self.texts.insert(path, text);
        }
        self.set.apply(changes)
    }
}

/// Reads every manifest file in `dir`: its text, or why it could not be read. Files that vanish
/// while being read are left out, as if listed a moment later.
fn read_dir_files(dir: &Path) -> io::Result<BTreeMap<PathBuf, io::Result<String>>> {
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !is_manifest_name(name) {
            continue;
        }
        let path = entry.path();
        match read_file(&path) {
            Ok(Some(text)) => {
                files.insert(path, Ok(text));
            }
            Ok(None) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => {
                files.insert(path, Err(err));
            }
        }
    }
    Ok(files)
}

/// Reads one file, following symlinks; `None` if it is not a regular file.
fn read_file(path: &Path) -> io::Result<Option<String>> {
    let meta = fs::metadata(path)?;
    if !meta.is_file() {
        return Ok(None);
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(io::Error::other(format!(
            "file is larger than {MAX_FILE_BYTES} bytes"
        )));
    }
    let bytes = fs::read(path)?;
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "file is not UTF-8"))
}

#[cfg(test)]
mod tests;
