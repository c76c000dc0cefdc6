//! Running a short piece of work inside a named network namespace (`/var/run/netns/NAME`, as
//! `ip netns add` makes them) without moving the caller.
//!
//! A socket belongs for good to the namespace it was created in, so a short-lived thread enters
//! the namespace (`setns(2)`), creates the socket and ends; the caller's threads never change
//! namespace. Needs `CAP_SYS_ADMIN`.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Where `ip netns add` puts its namespaces.
pub const NETNS_DIR: &str = "/var/run/netns";

/// Why the work could not run in the namespace (the work's own error is returned as is).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Empty, `.`, `..`, or holding `/` or NUL. Not retryable.
    #[error("{0:?} is not a namespace name")]
    BadName(String),
    /// `/var/run/netns/NAME` cannot be opened (usually: no such namespace). Retryable if the
    /// namespace is being created.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `setns(2)` failed (no `CAP_SYS_ADMIN`, not a network namespace). Not retryable.
    #[error("cannot enter the namespace: {0}")]
    Enter(#[source] std::io::Error),
    /// The thread could not be started. Retryable.
    #[error("cannot start a thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The work panicked.
    #[error("the namespace thread panicked")]
    Panicked,
}

/// The path of namespace `name`, once the name is checked (no path tricks).
pub fn path(name: &str) -> Result<PathBuf, Error> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(Error::BadName(name.to_string()));
    }
    Ok(Path::new(NETNS_DIR).join(name))
}

/// Runs `work` on a new thread that has entered network namespace `name`, and returns its
/// result. `thread` names the thread (for debuggers and panics).
pub fn run_in<T, E>(
    name: &str,
    thread: &str,
    work: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<Result<T, E>, Error>
where
    T: Send + 'static,
    E: Send + 'static,
{
    let path = path(name)?;
    let ns = File::open(&path).map_err(|source| Error::Open { path, source })?;
    run_in_file(ns, thread, work)
}

/// [`run_in`] for a namespace already open: `ns` is a network namespace file (a
/// `/proc/PID/ns/net`, or a bind mount of one such as `ip netns add` makes).
pub fn run_in_file<T, E>(
    ns: File,
    thread: &str,
    work: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<Result<T, E>, Error>
where
    T: Send + 'static,
    E: Send + 'static,
{
    std::thread::Builder::new()
        .name(thread.to_string())
        .spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| Error::Enter(e.into()))?;
            Ok(work())
        })
        .map_err(Error::Thread)?
        .join()
        .map_err(|_| Error::Panicked)?
}
