//! The modes the harness knows.

use kp_iptables::Backend;

use crate::iptables::Iptables;
use crate::mode::ModeUnderTest;
use crate::nftables::Nftables;

/// Every mode built into the harness, in report order.
pub fn all() -> Vec<Box<dyn ModeUnderTest>> {
    vec![
        Box::new(Nftables),
        Box::new(Iptables {
            backend: Backend::Nft,
        }),
        Box::new(Iptables {
            backend: Backend::Legacy,
        }),
    ]
}

/// Modes upstream has that are not built into the harness yet; asking for one is an error
/// that says so.
pub const NOT_YET: &[&str] = &["ipvs"];

/// The modes named in `names`, in that order.
pub fn by_names(names: &[String]) -> anyhow::Result<Vec<Box<dyn ModeUnderTest>>> {
    let mut out = Vec::new();
    for name in names {
        let Some(mode) = all().into_iter().find(|m| m.name() == name) else {
            let known: Vec<&str> = all().iter().map(|m| m.name()).collect();
            if NOT_YET.contains(&name.as_str()) {
                anyhow::bail!(
                    "mode {name}: its dataplane is not built into the bench yet (available: {})",
                    known.join(", ")
                );
            }
            anyhow::bail!("unknown mode {name} (available: {})", known.join(", "));
        };
        out.push(mode);
    }
    Ok(out)
}
