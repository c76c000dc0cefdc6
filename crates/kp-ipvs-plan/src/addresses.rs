//! The addresses bound to the dummy interface `kube-ipvs0` (upstream binds every ClusterIP,
//! external IP and LoadBalancer IP there so the node accepts their packets for IPVS, and
//! unbinds those no Service uses any more).

use std::collections::BTreeSet;
use std::net::IpAddr;

/// The dummy interface that holds the service addresses.
pub const DUMMY_INTERFACE: &str = "kube-ipvs0";

/// What to bind and unbind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressChanges {
    /// Addresses to add (as /32 or /128).
    pub bind: Vec<IpAddr>,
    /// Addresses to remove.
    pub unbind: Vec<IpAddr>,
}

impl AddressChanges {
    /// Whether nothing changes.
    pub fn is_empty(&self) -> bool {
        self.bind.is_empty() && self.unbind.is_empty()
    }
}

/// The changes that bring the interface's addresses `current` to `desired`. Addresses of a
/// family in neither set are left alone only if absent from `current`: every address on
/// `kube-ipvs0` is ours.
pub fn diff(desired: &BTreeSet<IpAddr>, current: &BTreeSet<IpAddr>) -> AddressChanges {
    AddressChanges {
        bind: desired.difference(current).copied().collect(),
        unbind: current.difference(desired).copied().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(a: &[&str]) -> BTreeSet<IpAddr> {
        a.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn a_new_service_address_is_bound_and_an_unused_one_unbound() {
        let d = diff(
            &set(&["10.96.0.1", "10.96.0.2", "fd00::1"]),
            &set(&["10.96.0.1", "10.96.0.9"]),
        );
        assert_eq!(
            d.bind,
            vec![
                "10.96.0.2".parse::<IpAddr>().unwrap(),
                "fd00::1".parse().unwrap()
            ]
        );
        assert_eq!(d.unbind, vec!["10.96.0.9".parse::<IpAddr>().unwrap()]);
        assert!(diff(&set(&["10.96.0.1"]), &set(&["10.96.0.1"])).is_empty());
    }
}
