//! The contract every dataplane mode implements.

use crate::flow::{Packet, Verdict};
use crate::track::{Changes, ProxyState};

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

/// A dataplane mode: programs the node so that Service traffic reaches endpoints.
///
/// A mode keeps its own record of what it believes the kernel holds, so a partial sync sends
/// only what `changes` touched, and [`Dataplane::verify`] can compare that record with the
/// kernel.
pub trait Dataplane: Send {
    /// The mode's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Upstream's name for the mode (`nftables`, `iptables`, ...).
    fn mode(&self) -> &'static str;

    /// Programs the kernel from `state`. With `full`, everything is rewritten and drift
    /// repaired; otherwise only the Services in `changes` are. After an error the caller makes
    /// the next sync full.
    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, Self::Error>;

    /// Reads the kernel state back and compares it with what the mode believes it programmed.
    /// Returns a description of every difference.
    fn verify(&mut self) -> Result<Vec<String>, Self::Error>;

    /// Removes everything this mode installed.
    fn cleanup(&mut self) -> Result<(), Self::Error>;

    /// What a periodic full sync acts on: [`Dataplane::verify`]'s differences, or, when the
    /// kernel cannot be read, one difference saying so (nothing then proves the rules right,
    /// so the caller rebuilds them).
    fn drift(&mut self) -> Vec<String> {
        self.verify()
            .unwrap_or_else(|e| vec![format!("cannot read the kernel's rules back: {e}")])
    }
}

/// Follows a packet through a mode's rendered rules, without a kernel.
pub trait Tracer {
    /// What happens to `packet`.
    fn trace(&self, packet: &Packet) -> Verdict;
}
