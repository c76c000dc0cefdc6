//! The order in which one sync's changes reach the kernel, so that no packet meets a half-made
//! state: no new connection refused, none sent out of the node, while a Service appears, goes,
//! or while the mode takes over from the iptables mode.
//!
//! What decides a packet's fate in this mode, in the order the kernel asks:
//!
//! 1. nat `PREROUTING` (or `OUTPUT` for the node's own traffic) runs `KUBE-SERVICES`. That
//!    chain is shared with the iptables mode: while the iptables mode's rules are in it (a
//!    switch, until this mode's first restore rewrites the chain), they DNAT a ClusterIP or
//!    NodePort connection to an endpoint here, before routing, and IPVS never sees it. Once
//!    this mode's rules are in it, they only mark and accept.
//! 2. Routing: an address bound to `kube-ipvs0` is local, so the packet goes to `INPUT`; an
//!    address not bound is routed like any other (out of the node, or dropped as an
//!    unallocated ClusterIP when `KUBE-IPVS-IPS` does not hold it).
//! 3. IPVS sees packets to local addresses only (its `LOCAL_IN` hook, after filter `INPUT`).
//!    A virtual server with real servers takes the connection; without a virtual server the
//!    local TCP stack answers: a reset, seen by the client as a refused connection.
//!
//! So, adding (a first sync, a new Service, a switch from iptables):
//!
//! 1. IPVS first: every virtual server and real server that is wanted (and the real-server
//!    changes of kept ones: adds, updates, graceful weight-0 drains, deletes). Nothing sends a
//!    packet to them yet.
//! 2. The ipsets (additions and removals; every set made if missing), which the rules match.
//! 3. The `kube-ipvs0` addresses: binding one changes nothing while the iptables mode's DNAT
//!    still takes the packet first, and IPVS is ready for it otherwise.
//! 4. The iptables chains, the moment the iptables mode's DNAT (in the shared `KUBE-SERVICES`)
//!    gives way to this mode's accept: the virtual servers, the set entries and the addresses
//!    are all in place by then. (The other way round, rules before addresses, would send a
//!    ClusterIP's packets out of the node until the address is bound.)
//!
//! Removing, the reverse of the states a Service went through:
//!
//! 5. (With 2 and 4) its set entries and the rules that matched them: while its address is
//!    bound and its virtual server exists, IPVS still serves it.
//! 6. Its address unbound: from here its packets are routed, and dropped as an unallocated
//!    ClusterIP (no longer in `KUBE-IPVS-IPS`).
//! 7. Its virtual servers deleted last, when nothing reaches them. Real servers removed from
//!    kept virtual servers are not deletions of this kind: they were drained (weight 0) or
//!    deleted in step 1, as graceful termination says.
//!
//! Upstream's ipvs proxier is close to this: it walks the Services creating each virtual
//! server, then binding its address (`syncService`), then adding its real servers
//! (`syncEndpoint`); restores the ipsets and the iptables rules after the walk; and only then
//! unbinds unused addresses and deletes unused virtual servers. Here the real servers are in
//! place before the address is bound too.

use std::net::IpAddr;

use kp_core::model::IpFamily;

use crate::addresses::AddressChanges;
use crate::ipset::SetChange;
use crate::Change;

/// One step of a sync, in the order [`steps`] gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// IPVS changes applied in the order given (a virtual server before its real servers).
    Ipvs(Vec<Change>),
    /// One family's `ipset restore` (every set created if missing, then the element changes).
    Sets {
        /// The family.
        family: IpFamily,
        /// Its element additions and removals.
        changes: Vec<SetChange>,
    },
    /// An address bound to `kube-ipvs0`.
    Bind(IpAddr),
    /// One family's chains restored (`iptables-restore --noflush`) and the jumps into them
    /// made sure of.
    Rules {
        /// The family.
        family: IpFamily,
        /// The restore input.
        text: String,
    },
    /// An address unbound from `kube-ipvs0`.
    Unbind(IpAddr),
}

/// What one sync changes, before it is put in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncChanges {
    /// The IPVS diff ([`crate::diff`]'s changes, in its order).
    pub ipvs: Vec<Change>,
    /// The families whose sets are restored, with their changes (a family listed with no
    /// change is still restored: a full sync makes every set).
    pub sets: Vec<(IpFamily, Vec<SetChange>)>,
    /// The addresses of `kube-ipvs0`.
    pub addresses: AddressChanges,
    /// The families whose chains are restored, with the restore input.
    pub rules: Vec<(IpFamily, String)>,
}

/// The steps of `changes` in the order that never steers a packet to something not there yet,
/// nor takes away something a packet is still steered to (see the module's description):
/// IPVS additions and real-server changes, sets, address binds, rules, address unbinds,
/// virtual-server deletions.
pub fn steps(changes: SyncChanges) -> Vec<Step> {
    let SyncChanges {
        ipvs,
        sets,
        addresses,
        rules,
    } = changes;
    let (deletes, first): (Vec<Change>, Vec<Change>) = ipvs
        .into_iter()
        .partition(|c| matches!(c, Change::DeleteService(_)));
    let mut out = Vec::new();
    if !first.is_empty() {
        out.push(Step::Ipvs(first));
    }
    out.extend(
        sets.into_iter()
            .map(|(family, changes)| Step::Sets { family, changes }),
    );
    out.extend(addresses.bind.into_iter().map(Step::Bind));
    out.extend(
        rules
            .into_iter()
            .map(|(family, text)| Step::Rules { family, text }),
    );
    out.extend(addresses.unbind.into_iter().map(Step::Unbind));
    if !deletes.is_empty() {
        out.push(Step::Ipvs(deletes));
    }
    out
}

#[cfg(test)]
mod tests;
