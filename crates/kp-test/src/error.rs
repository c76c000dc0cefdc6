use std::io;
use std::process::ExitStatus;
use std::time::Duration;

/// Everything that can go wrong while building namespaces, labs or echo servers.
///
/// These are test-support errors: a test that meets one should fail, not retry, unless a
/// variant says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A command could not be started at all (binary missing, fork failed). Not retryable.
    #[error("could not run `{command}`: {source}")]
    Spawn {
        /// The command line, for the message.
        command: String,
        /// Why the operating system refused.
        #[source]
        source: io::Error,
    },
    /// A command ran and exited unsuccessfully. Not retryable: the arguments or the machine
    /// are wrong (for example not root, or an address already in use).
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line, for the message.
        command: String,
        /// How it exited.
        status: ExitStatus,
        /// What it printed on standard error, trimmed.
        stderr: String,
    },
    /// A process did not become ready in time, or exited while we waited for it.
    /// Retryable only if the machine is merely slow.
    #[error("waited {after:?} for {what}: {detail}")]
    NotReady {
        /// What we waited for.
        what: String,
        /// How long we waited.
        after: Duration,
        /// Why we gave up (timed out, or the process exited), with the end of its log.
        detail: String,
    },
    /// The kp-echo binary could not be found or built. Not retryable.
    #[error("kp-echo binary unavailable: {0}")]
    EchoBinary(String),
    /// A caller passed an argument the lab cannot honour (an empty role, too many pods).
    /// Not retryable.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The process is stopping and creates no more namespaces
    /// ([`crate::netns::remove_own`]). Not retryable.
    #[error("no new network namespaces: this process is stopping")]
    Stopping,
    /// A request to a real API server ([`crate::kube_apiserver`]) failed, after retries when
    /// the server was only busy. Not retryable.
    #[error("{what}: {detail}")]
    Api {
        /// The request.
        what: String,
        /// The server's or the client's error.
        detail: String,
    },
    /// A local file (a process log) could not be created or read. Not retryable.
    #[error("{what}: {source}")]
    Io {
        /// The file and what we tried to do with it.
        what: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
}

/// Results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
