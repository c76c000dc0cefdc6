//! The contract every dataplane mode implements, and the error every mode reports in.
//!
//! The trait is object-safe: the sync loop holds a `Box<dyn Dataplane>` chosen from the mode
//! registry at start, so one loop serves every mode. Mirrors upstream's `proxy.Provider`
//! (`pkg/proxy/types.go`), with the lifecycle a mode that is not a set of kernel rules needs
//! (a userspace proxy binds listeners; IPVS and UDP proxies expire state on a timer).
//!
//! The periodic drift check can run off the loop: a mode that can read the kernel on another
//! thread returns that read from [`Dataplane::begin_check`], the loop runs it on a thread of its
//! own and goes on applying changes, and hands what was read to [`Dataplane::finish_check`],
//! which compares it with the mode's record *as it is by then*. The mode keeps track of what it
//! wrote while the read ran, so that its own writes are never taken for drift, and says
//! whether a difference is certain ([`CheckOutcome::Drift`]: the loop repairs it with a full
//! sync) or could be the read racing a write ([`CheckOutcome::Unsure`]: the loop reads again).
//! A mode that does not implement the pair keeps the in-line check: its periodic full sync
//! reads and compares while the loop waits.

use std::any::Any;
use std::collections::BTreeSet;
use std::error::Error as StdError;
use std::fmt;
use std::net::SocketAddr;
use std::time::Instant;

use crate::model::Protocol;
use crate::track::{Changes, ProxyState};

#[cfg(test)]
mod tests;

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Whether the sync rewrote everything.
    pub full: bool,
    /// Size of what was sent to the kernel (for nftables: statements in the transaction).
    pub operations: usize,
    /// Service ports with no usable local endpoints under a Local policy:
    /// (internal, external) counts, for `kubeproxy_sync_proxy_rules_no_local_endpoints_total`.
    pub no_local_endpoints: (u64, u64),
}

/// An endpoint that the mode before a switch still answers for: IPVS keeps connection
/// entries (closing ones for two minutes) on a real server it still serves established
/// connections through, and rewrites a backend's answer to a new connection from a client port
/// one of them holds as if it came from the virtual server. A mode that connects clients
/// straight to backends ([`Dataplane::hold_backends`]) leaves such endpoints out of new
/// connections while it can.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HeldBackend {
    /// The protocol.
    pub protocol: Protocol,
    /// The endpoint's address and port.
    pub addr: SocketAddr,
}

/// What a read of the kernel taken off the loop returned, for the [`Dataplane::finish_check`] of
/// the mode that made it (the mode downcasts it to its own type).
pub struct CheckRead(pub Box<dyn Any + Send>);

impl fmt::Debug for CheckRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CheckRead(..)")
    }
}

/// A read of the kernel for the periodic drift check, to run on another thread: it must not
/// touch the mode's own state, only the kernel.
pub type KernelRead = Box<dyn FnOnce() -> CheckRead + Send>;

/// What a drift check found ([`Dataplane::finish_check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckOutcome {
    /// The kernel holds what the mode believes it programmed (its own writes during the read
    /// aside: those were acknowledged by the kernel after the read began).
    Clean,
    /// The kernel differs, for certain (nothing was committed while the read ran, or the read
    /// failed): the loop repairs with a full sync. Each line describes one difference.
    Drift(Vec<String>),
    /// Differences that a commit during the read may explain (a dump of a set that changed
    /// while it was read can skip an element): the loop reads again before repairing.
    Unsure(Vec<String>),
    /// A full sync ran since the read began and proved the kernel right by itself: nothing to
    /// do.
    Superseded,
}

/// Whether trying a failed operation again can help.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// A later attempt may succeed (a refused transaction, a busy lock, a read that raced a
    /// writer): the loop retries with backoff, and the retry is a full sync.
    WithBackoff,
    /// Nothing changes until an operator acts (no permission, a kernel module or a tool
    /// missing): retrying would only repeat the failure, so the proxy stops and says why. The
    /// rules already in the kernel stay in place.
    Never,
}

/// Linux errno values that mean "retrying cannot help". Raw numbers, as the kernel's ABI
/// defines them, so the pure core needs no libc.
mod errno {
    /// Operation not permitted.
    pub const EPERM: i32 = 1;
    /// Permission denied.
    pub const EACCES: i32 = 13;
    /// Protocol not supported (a netlink family whose module is not loaded).
    pub const EPROTONOSUPPORT: i32 = 93;
    /// Address family not supported.
    pub const EAFNOSUPPORT: i32 = 97;
}

impl Retry {
    /// What a kernel errno says about retrying: permission and missing-support errors never
    /// heal by themselves; everything else may.
    pub fn of_errno(errno: i32) -> Retry {
        match errno {
            errno::EPERM | errno::EACCES | errno::EPROTONOSUPPORT | errno::EAFNOSUPPORT => {
                Retry::Never
            }
            _ => Retry::WithBackoff,
        }
    }

    /// What an error starting or feeding a kernel tool says about retrying: a program that is
    /// not installed or not permitted stays so.
    pub fn of_spawn(e: &std::io::Error) -> Retry {
        match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => Retry::Never,
            _ => e.raw_os_error().map_or(Retry::WithBackoff, Retry::of_errno),
        }
    }
}

/// A dataplane operation failed. Carries the mode's own error (its typed detail stays
/// reachable through [`DataplaneError::source`]) and whether retrying can help.
pub struct DataplaneError {
    retry: Retry,
    inner: Box<dyn StdError + Send + Sync + 'static>,
}

impl DataplaneError {
    /// `inner`, with what it says about retrying.
    pub fn new(retry: Retry, inner: impl Into<Box<dyn StdError + Send + Sync + 'static>>) -> Self {
        DataplaneError {
            retry,
            inner: inner.into(),
        }
    }

    /// A failure that a later attempt may not repeat.
    pub fn transient(inner: impl Into<Box<dyn StdError + Send + Sync + 'static>>) -> Self {
        DataplaneError::new(Retry::WithBackoff, inner)
    }

    /// A failure no retry can cure.
    pub fn permanent(inner: impl Into<Box<dyn StdError + Send + Sync + 'static>>) -> Self {
        DataplaneError::new(Retry::Never, inner)
    }

    /// Whether retrying can help.
    pub fn retry(&self) -> Retry {
        self.retry
    }

    /// The mode's own error, to match on its typed detail.
    pub fn inner(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self.inner.as_ref()
    }
}

impl fmt::Debug for DataplaneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataplaneError")
            .field("retry", &self.retry)
            .field("inner", &self.inner)
            .finish()
    }
}

impl fmt::Display for DataplaneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner, f)
    }
}

impl StdError for DataplaneError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.inner.source()
    }
}

/// A dataplane mode: programs the node so that Service traffic reaches endpoints.
///
/// A mode keeps its own record of what it believes the kernel holds, so a partial sync sends
/// only what `changes` touched, and [`Dataplane::verify`] can compare that record with the
/// kernel. The loop calls, in order: [`Dataplane::start`] once, then [`Dataplane::sync`] for
/// every change batch (the first one full, after every initial list) and
/// [`Dataplane::tick`] whenever [`Dataplane::next_deadline`] passes, and
/// [`Dataplane::shutdown`] once when the proxy stops.
pub trait Dataplane: Send {
    /// Upstream's name for the mode (`nftables`, `iptables`, ...).
    fn mode(&self) -> &'static str;

    /// Prepares the mode before its first sync, on the loop's runtime (a userspace mode binds
    /// its listeners here). Called once; a failure stops the proxy.
    fn start(&mut self) -> Result<(), DataplaneError> {
        Ok(())
    }

    /// Programs the kernel from `state`. With `full`, everything is rewritten and drift
    /// repaired; otherwise only the Services in `changes` are. After an error the caller makes
    /// the next sync full.
    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError>;

    /// Reads the kernel state back and compares it with what the mode believes it programmed.
    /// Returns a description of every difference.
    fn verify(&mut self) -> Result<Vec<String>, DataplaneError>;

    /// Removes everything this mode installed.
    fn cleanup(&mut self) -> Result<(), DataplaneError>;

    /// When the mode next has work that no change triggers (IPVS graceful termination, UDP
    /// idle expiry): the loop calls [`Dataplane::tick`] once that time has passed.
    fn next_deadline(&self) -> Option<Instant> {
        None
    }

    /// Does the timed work due at `now`.
    fn tick(&mut self, _now: Instant) -> Result<(), DataplaneError> {
        Ok(())
    }

    /// Starts a periodic drift check off the loop: returns the read to run on another thread
    /// (see the module docs), or `None` when this mode checks in line, inside its full sync.
    /// Until [`Dataplane::finish_check`] is called, every sync the loop asks for is partial,
    /// and the mode records what it writes so that its own writes are not taken for drift.
    fn begin_check(&mut self) -> Option<KernelRead> {
        None
    }

    /// Compares what the read of [`Dataplane::begin_check`] returned with the mode's record as
    /// it is now. A read the mode cannot use is drift: nothing proves the kernel right.
    fn finish_check(&mut self, state: &ProxyState, read: CheckRead) -> CheckOutcome {
        let _ = (state, read);
        CheckOutcome::Drift(vec![format!(
            "the {} mode cannot check a read taken off the loop",
            self.mode()
        )])
    }

    /// The endpoints the mode before a switch still answers for ([`HeldBackend`]), replacing
    /// the last set (empty once that mode's state is gone). Returns whether that changes what
    /// the mode programs: the loop then makes the next sync full. A mode whose translation
    /// happens in netfilter (or in a proxy process) is not affected: an old IPVS entry's
    /// rewrite of a backend's answer gives it the same Service address that its own reverse NAT
    /// would, so the default ignores the set.
    fn hold_backends(&mut self, held: &BTreeSet<HeldBackend>) -> bool {
        let _ = held;
        false
    }

    /// The proxy is stopping: release what [`Dataplane::start`] took. Kernel rules stay in
    /// place, as upstream leaves them, so traffic keeps flowing until the next proxy adopts
    /// them.
    fn shutdown(&mut self) {}
}
