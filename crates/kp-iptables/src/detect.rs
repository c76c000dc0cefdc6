//! Choosing the backend the node already uses, with the heuristic of upstream's
//! `iptables-wrapper` (kubernetes-sigs/iptables-wrappers): kubelet (1.17+) leaves hint chains
//! in the backend it uses, so those decide; otherwise the backend holding more rules wins, and
//! a tie (a fresh node) goes to nft.

use kp_core::model::IpFamily;

use crate::names::HINT_CHAINS;
use crate::readback::parse_save;
use crate::runner::{Backend, IptablesCommand};

/// What one backend shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendEvidence {
    /// Whether a kubelet hint chain is in its mangle table (IPv4 or IPv6).
    pub hint: bool,
    /// Its rules (`-A` lines of `iptables-save` and `ip6tables-save`).
    pub rules: usize,
}

/// The decision from what both backends show.
pub fn choose(nft: BackendEvidence, legacy: BackendEvidence) -> Backend {
    match (nft.hint, legacy.hint) {
        (true, _) => Backend::Nft,
        (false, true) => Backend::Legacy,
        _ if legacy.rules > nft.rules => Backend::Legacy,
        _ => Backend::Nft,
    }
}

/// Reads one backend's evidence. Legacy tables are read only if they exist, since reading one
/// would create it.
pub fn evidence(cmd: &IptablesCommand, backend: Backend) -> BackendEvidence {
    let mut ev = BackendEvidence::default();
    for family in IpFamily::ALL {
        if backend == Backend::Legacy && cmd.legacy_tables(family).is_empty() {
            continue;
        }
        let text = match cmd.save(backend, family, None) {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(error = %e, backend = %backend, "cannot read this backend");
                continue;
            }
        };
        ev.rules += text.lines().filter(|l| l.starts_with("-A ")).count();
        if let Ok(mangle) = parse_save(&text, "mangle") {
            ev.hint |= HINT_CHAINS.iter().any(|c| mangle.chains.contains_key(*c));
        }
    }
    ev
}

/// The backend kube-proxy should use on this node (or in namespace `netns`); logs the choice
/// with what each backend showed.
pub fn detect_backend(netns: Option<&str>) -> Backend {
    let cmd = match netns {
        Some(ns) => IptablesCommand::in_netns(ns),
        None => IptablesCommand::new(),
    };
    let nft = evidence(&cmd, Backend::Nft);
    let legacy = evidence(&cmd, Backend::Legacy);
    let chosen = choose(nft, legacy);
    tracing::info!(
        backend = %chosen,
        nft_rules = nft.rules,
        nft_kubelet_hint = nft.hint,
        legacy_rules = legacy.rules,
        legacy_kubelet_hint = legacy.hint,
        "chose the iptables backend"
    );
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(hint: bool, rules: usize) -> BackendEvidence {
        BackendEvidence { hint, rules }
    }

    #[test]
    fn kubelet_hints_win_then_rule_counts_then_nft() {
        assert_eq!(choose(ev(true, 0), ev(false, 100)), Backend::Nft);
        assert_eq!(choose(ev(false, 100), ev(true, 0)), Backend::Legacy);
        assert_eq!(choose(ev(true, 0), ev(true, 100)), Backend::Nft);
        assert_eq!(choose(ev(false, 3), ev(false, 4)), Backend::Legacy);
        assert_eq!(choose(ev(false, 4), ev(false, 3)), Backend::Nft);
        assert_eq!(choose(ev(false, 0), ev(false, 0)), Backend::Nft);
    }
}
