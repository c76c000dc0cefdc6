//! The modes the harness knows: the proxy's mode registry ([`kp_proxy::modes::MODES`]), each
//! entry with its bench adapters.
//!
//! The harness keeps no list of its own. [`all`] walks the registry in order and asks
//! [`adapters`] for each entry's adapters; a mode upstream names that the registry does not
//! hold yet is reported as not built. A mode added to the registry without an adapter fails
//! this crate's tests unless [`NOT_BENCHED`] says why the harness cannot drive it yet.

use kp_iptables::Backend;
use kp_proxy::config::ProxyMode;
use kp_proxy::modes::MODES;

use crate::ebpf::Ebpf;
use crate::iptables::Iptables;
use crate::mode::ModeUnderTest;
use crate::nftables::Nftables;
use crate::userspace::Userspace;

/// The bench adapters of one registry mode, in report order: one per variant of the mode
/// the benchmark measures apart (iptables: one per backend). Empty for a mode the harness
/// cannot drive yet.
pub fn adapters(mode: ProxyMode) -> Vec<Box<dyn ModeUnderTest>> {
    match mode {
        ProxyMode::Nftables => vec![Box::new(Nftables)],
        ProxyMode::Iptables => vec![
            Box::new(Iptables {
                backend: Backend::Nft,
            }),
            Box::new(Iptables {
                backend: Backend::Legacy,
            }),
        ],
        ProxyMode::Userspace => vec![Box::new(Userspace)],
        ProxyMode::Ebpf => vec![Box::new(Ebpf)],
        ProxyMode::Ipvs => Vec::new(),
    }
}

/// Every mode built into the harness, in report order: the registry's order, each entry's
/// adapters in turn.
pub fn all() -> Vec<Box<dyn ModeUnderTest>> {
    MODES.iter().flat_map(|m| adapters(m.mode)).collect()
}

/// Registry modes the harness cannot drive yet, each with why; asking for one says so. A mode
/// here that gains an adapter fails this crate's tests until it leaves the list.
pub const NOT_BENCHED: &[(ProxyMode, &str)] = &[(
    ProxyMode::Ipvs,
    "IPVS runs only in the kp-vm guest on this machine (its kernel has no IP_VS): `bench vm` \
         measures it there, beside nftables in the same guest",
)];

/// Why the harness cannot drive registry mode `mode` yet, if it is in [`NOT_BENCHED`].
pub fn not_benched(mode: ProxyMode) -> Option<&'static str> {
    NOT_BENCHED
        .iter()
        .find(|(m, _)| *m == mode)
        .map(|(_, why)| *why)
}

/// The modes upstream names (or kube-proxy-rs adds) that the registry does not hold yet:
/// asking for one is an error that says so.
pub fn not_yet() -> Vec<&'static str> {
    ProxyMode::ALL
        .into_iter()
        .filter(|m| kp_proxy::modes::find(*m).is_none())
        .map(ProxyMode::as_str)
        .collect()
}

/// The modes named in `names`, in that order.
pub fn by_names(names: &[String]) -> anyhow::Result<Vec<Box<dyn ModeUnderTest>>> {
    let mut out = Vec::new();
    for name in names {
        let Some(mode) = all().into_iter().find(|m| m.name() == name) else {
            let known: Vec<&str> = all().iter().map(|m| m.name()).collect();
            if let Some(why) = MODES
                .iter()
                .find(|m| m.name() == name)
                .and_then(|m| not_benched(m.mode))
            {
                anyhow::bail!(
                    "mode {name}: not in the bench yet: {why} (available: {})",
                    known.join(", ")
                );
            }
            if not_yet().contains(&name.as_str()) {
                anyhow::bail!(
                    "mode {name}: kube-proxy-rs does not implement it yet, so it is not built into \
                     the bench (available: {})",
                    known.join(", ")
                );
            }
            anyhow::bail!("unknown mode {name} (available: {})", known.join(", "));
        };
        out.push(mode);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_registry_mode_has_a_bench_adapter_or_says_why_not() {
        for m in MODES {
            match (adapters(m.mode).is_empty(), not_benched(m.mode)) {
                (true, None) => panic!(
                    "mode {} is in kp_proxy::modes::MODES but has no bench adapter: add one in \
                     kp_bench::modes::adapters (or say why not in NOT_BENCHED)",
                    m.name()
                ),
                (false, Some(_)) => panic!(
                    "mode {} has a bench adapter now: take it off NOT_BENCHED",
                    m.name()
                ),
                (true, Some(_)) => {
                    let err = by_names(&[m.name().to_string()])
                        .err()
                        .expect(m.name())
                        .to_string();
                    assert!(err.contains("not in the bench yet"), "{err}");
                }
                (false, None) => {}
            }
        }
        for (mode, _) in NOT_BENCHED {
            assert!(
                adapters(*mode).is_empty(),
                "{} is listed in NOT_BENCHED but has adapters",
                mode.as_str()
            );
        }
    }

    #[test]
    fn every_adapter_is_named_after_its_registry_mode_and_runs_the_binary_in_it() {
        for m in MODES {
            for a in adapters(m.mode) {
                assert!(
                    a.name().starts_with(m.name()),
                    "adapter {} of mode {}",
                    a.name(),
                    m.name()
                );
                assert_eq!(a.mode(), m.mode, "adapter {}", a.name());
                assert!(
                    a.proxy_args()
                        .contains(&format!("--proxy-mode={}", m.name())),
                    "adapter {}: {:?}",
                    a.name(),
                    a.proxy_args()
                );
            }
        }
    }

    #[test]
    fn adapter_names_are_unique_and_in_registry_order() {
        let names: Vec<&str> = all().iter().map(|a| a.name()).collect();
        for n in &names {
            assert_eq!(names.iter().filter(|o| *o == n).count(), 1, "{n}");
        }
        let expected: Vec<&str> = MODES
            .iter()
            .flat_map(|m| {
                adapters(m.mode)
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(names, expected);
    }

    #[test]
    fn a_mode_the_registry_lacks_is_reported_as_not_built_and_an_unknown_one_as_unknown() {
        for name in not_yet() {
            assert!(
                kp_proxy::modes::MODES.iter().all(|m| m.name() != name),
                "{name}"
            );
            let err = by_names(&[name.to_string()]).err().expect(name).to_string();
            assert!(err.contains("does not implement it yet"), "{err}");
        }
        let err = by_names(&["nope".to_string()])
            .err()
            .expect("nope")
            .to_string();
        assert!(err.starts_with("unknown mode nope"), "{err}");
        for a in all() {
            assert!(err.contains(a.name()), "{err}");
        }
    }

    #[test]
    fn every_adapters_binary_flags_load_as_the_binary_loads_them() {
        for a in all() {
            let config = crate::proxy::binary_config(a.as_ref()).expect(a.name());
            assert_eq!(config.mode, a.mode(), "{}", a.name());
        }
    }
}
