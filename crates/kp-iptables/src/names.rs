//! The chain and table names this dataplane reads, keeps and deletes, in one place, so the
//! modules that read (`view`), adopt (`adopt`), write (`dataplane`), clean up (`cleanup`) and
//! detect (`detect`) agree without importing each other for a name.
//!
//! The planner's chains are named in `kp_iptables_plan::names` and used from there; this adds
//! what only the dataplane handles: upstream's canary, kubelet's chains, and which chains are
//! ours by name (upstream `pkg/proxy/iptables/proxier.go`: `kubeProxyCanaryChain`,
//! `isServiceChainName`, `CleanupLeftovers`).

use kp_iptables_plan::names::{
    EXT_PREFIX, FW_PREFIX, KUBE_EXTERNAL_SERVICES, KUBE_FIREWALL, KUBE_FORWARD, KUBE_MARK_MASQ,
    KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_PROXY_FIREWALL, KUBE_SERVICES, SEP_PREFIX, SVC_PREFIX,
    SVL_PREFIX,
};

/// The canary chain kube-proxy keeps in mangle, nat and filter: if it vanishes, someone flushed
/// the tables.
pub const CANARY_CHAIN: &str = "KUBE-PROXY-CANARY";

/// The tables a canary lives in.
pub const CANARY_TABLES: [&str; 3] = ["mangle", "nat", "filter"];

/// Fixed chains kube-proxy owns in nat and filter.
pub const FIXED_CHAINS: [&str; 8] = [
    KUBE_SERVICES,
    KUBE_EXTERNAL_SERVICES,
    KUBE_NODEPORTS,
    KUBE_FORWARD,
    KUBE_PROXY_FIREWALL,
    KUBE_POSTROUTING,
    KUBE_MARK_MASQ,
    CANARY_CHAIN,
];

/// Prefixes of the per-Service and per-endpoint chains.
pub const SERVICE_CHAIN_PREFIXES: [&str; 5] =
    [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX];

/// The chain kubelet created before 1.27 and kube-proxy now fills with one rule when localhost
/// NodePorts are on; it is ours to delete only if that rule is all it holds.
pub const LOCALNET_CHAIN: &str = KUBE_FIREWALL;

/// The comment of that rule (as `kp-iptables-plan`'s `render/fixed.rs` writes it).
pub const LOCALNET_COMMENT: &str = "block incoming localnet connections";

/// Chains kubelet creates in the backend it programs (backend detection looks for them).
pub const HINT_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// Whether `chain` is a per-Service or per-endpoint chain.
pub fn is_service_chain(chain: &str) -> bool {
    SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
}

/// Whether `chain` in a nat or filter table belongs to kube-proxy by its name alone.
pub fn is_owned_chain(chain: &str) -> bool {
    FIXED_CHAINS.contains(&chain) || is_service_chain(chain)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownership_is_by_name() {
        for c in [
            "KUBE-SVC-ABC",
            "KUBE-SEP-X",
            "KUBE-FW-1",
            "KUBE-SVL-2",
            "KUBE-EXT-3",
            "KUBE-MARK-MASQ",
            "KUBE-PROXY-CANARY",
        ] {
            assert!(is_owned_chain(c), "{c}");
        }
        for c in [
            "KUBE-MARK-DROP",
            "KUBE-KUBELET-CANARY",
            "KUBE-IPTABLES-HINT",
            "KUBE-FIREWALL",
            "KUBE-SVCX",
            "MY-CHAIN",
        ] {
            assert!(!is_owned_chain(c), "{c}");
        }
    }

    #[test]
    fn service_chains_are_the_planners() {
        for c in [
            "KUBE-SVC-A",
            "KUBE-SEP-B",
            "KUBE-SERVICES",
            "KUBE-SVCX",
            "X",
        ] {
            assert_eq!(
                is_service_chain(c),
                kp_iptables_plan::names::is_service_chain(c),
                "{c}"
            );
        }
    }
}
