//! The crate's one error type.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong in a source.
///
/// Errors met while a source runs (a dropped watch, a broken manifest) are retried or waited out
/// by the source itself: they are logged and counted, never returned. Only set-up errors are
/// returned to the caller.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The kubeconfig file given with `--kubeconfig` could not be read or used.
    /// Not retryable: the flag or the file must be fixed.
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[source] kube::config::KubeconfigError),

    /// No `--kubeconfig` was given, and neither the in-cluster environment nor a default
    /// kubeconfig could be used. Not retryable.
    #[error("no API server configuration found: {0}")]
    InferConfig(#[source] kube::config::InferConfigError),

    /// The `--master` URL does not parse. Not retryable.
    #[error("invalid --master URL {url:?}: {reason}")]
    InvalidMaster {
        /// The URL as given.
        url: String,
        /// Why it was rejected.
        reason: String,
    },

    /// The Kubernetes client could not be built (TLS set-up, bad credentials in the config).
    /// Not retryable.
    #[error("building the Kubernetes client: {0}")]
    Client(#[source] kube::Error),

    /// A list or watch on the API server failed. Retryable: the watcher retries with backoff,
    /// and only logs and counts this.
    #[error("watching {kind}: {source}")]
    Watch {
        /// The kind being watched (`Service`, `EndpointSlice`, `Node` or `ServiceCIDR`).
        kind: kp_core::track::Kind,
        /// What kube-runtime reported.
        #[source]
        source: kube::runtime::watcher::Error,
    },

    /// The manifest directory could not be listed. Not retryable at start-up; later it is
    /// logged, counted and retried on the next change, keeping the objects already read.
    #[error("reading manifest directory {path}: {source}")]
    ManifestDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },

    /// A manifest file could not be read (permissions, not UTF-8, too large). Retryable: the
    /// file's last good content stays in force until it is fixed.
    #[error("reading manifest {path}: {source}")]
    ManifestRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },

    /// A document in a manifest file is not valid YAML/JSON, is of an unsupported kind, or does
    /// not deserialize. Retryable: the file's last good content stays in force until it is fixed.
    #[error("manifest {path}: document {document}: {reason}")]
    ManifestParse {
        /// The file.
        path: PathBuf,
        /// Which document in the file, counting from 1 (a JSON file is one document).
        document: usize,
        /// What is wrong with it.
        reason: String,
    },

    /// inotify could not be set up on the manifest directory. Not retryable.
    #[error("watching manifest directory {path}: {source}")]
    Notify {
        /// The directory.
        path: PathBuf,
        /// What notify reported.
        #[source]
        source: notify::Error,
    },
}
