//! The nftables mode under benchmark: `kp_nftables::NftablesDataplane` in-process, the planner
//! alone for render timing and the bare baseline's input (`nft -f -`), and a netlink element
//! read for the latency probe.

pub mod netlink;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::track::ProxyState;
use kp_metrics::Metrics;
use kp_nftables::{DetectLocal, NftCommand, NftablesConfig, NftablesDataplane, NodePortAddresses};
use kp_nftables_plan::names::TABLE;
use kp_nftables_plan::{NodeContext, PlanConfig, Planner, Route, SetId};
use kp_proxy::config::ProxyMode;

use crate::mode::{KernelInput, ModeUnderTest, Probe, ProbeTarget, Rendered, SyncTarget};
use netlink::{ElementReader, NFPROTO_IPV4};

/// The nftables mode, configured as the benchmark runs the binary: `--cluster-cidr` set
/// (detect-local by cluster CIDR), NodePorts on every local address, both families.
#[derive(Clone, Debug, Default)]
pub struct Nftables;

impl Nftables {
    /// The in-process dataplane's settings: [`Nftables::binary_config`] with NodePorts on every
    /// local address.
    fn config(&self) -> NftablesConfig {
        NftablesConfig {
            node_ports: NodePortAddresses::AllLocal,
            ..self.binary_config()
        }
    }

    /// The binary's own settings as the bench starts it in nftables mode, computed as the binary
    /// computes them: the registry's [`kp_proxy::modes::nftables_config`] of the configuration
    /// the binary resolves from the bench's flags ([`crate::proxy::binary_config`]). Its
    /// NodePorts answer on the node's primary address only, the binary's default
    /// `nodePortAddresses` in this mode (as upstream's). The kernel check plans with these.
    fn binary_config(&self) -> NftablesConfig {
        // The bench's own constant flags; `modes::tests` loads them for every adapter.
        let config = crate::proxy::binary_config(self).unwrap_or_else(|e| panic!("{e:#}"));
        kp_proxy::modes::nftables_config(&config)
            .unwrap_or_else(|e| panic!("nftables: the binary's settings: {e}"))
    }
}

/// Reads `vips-N-endpoints` elements over netlink.
struct NftProbe {
    reader: ElementReader,
}

impl Probe for NftProbe {
    fn interval(&self) -> Duration {
        // A read takes tens of microseconds and takes no lock the proxy needs.
        Duration::from_millis(1)
    }

    fn is_live(&mut self, t: &ProbeTarget) -> anyhow::Result<bool> {
        let n = t.endpoints as u32;
        let map = SetId::ClassEndpoints(Route::Vips, n).name();
        // Key: ipv4_addr . inet_proto . inet_service . integer, each field in a 4-byte
        // register: address in network order, protocol byte, port in network order, the slot
        // (`numgen random mod N`) in host order.
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|slot| {
                let mut k = t.vip.octets().to_vec();
                k.extend_from_slice(&[6, 0, 0, 0]);
                k.extend_from_slice(&t.port.to_be_bytes());
                k.extend_from_slice(&[0, 0]);
                k.extend_from_slice(&slot.to_ne_bytes());
                k
            })
            .collect();
        let Some(elements) = self.reader.get(NFPROTO_IPV4, TABLE, &map, &keys)? else {
            return Ok(false);
        };
        // Value: ipv4_addr . inet_service.
        let mut want = t.endpoint.octets().to_vec();
        want.extend_from_slice(&t.target_port.to_be_bytes());
        Ok(elements.iter().any(|e| {
            e.value
                .as_deref()
                .is_some_and(|v| v.len() >= 6 && v[..6] == want[..])
        }))
    }
}

impl ModeUnderTest for Nftables {
    fn name(&self) -> &'static str {
        "nftables"
    }

    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn unavailable(&self) -> Option<String> {
        match std::process::Command::new("nft").arg("--version").output() {
            Ok(o) if o.status.success() => None,
            _ => Some("nft is not installed (apt-get install nftables)".into()),
        }
    }

    fn render_full(&self, state: &ProxyState) -> (Rendered, Vec<KernelInput>) {
        let cfg = self.config();
        let node = NodeContext::resolve(&cfg.detect_local, &cfg.node_ports, state);
        let start = Instant::now();
        let mut operations = 0;
        // One transaction for every family, as the dataplane sends it.
        let mut text = String::new();
        for family in &cfg.families {
            let mut planner = Planner::new(PlanConfig {
                masquerade_mark: 1 << cfg.masquerade_bit,
                masquerade_all: cfg.masquerade_all,
                detect_local: cfg.detect_local != DetectLocal::None,
                node_ports_restricted: cfg.node_ports != NodePortAddresses::AllLocal,
                ..PlanConfig::new(*family)
            });
            let tx = planner.full(state, &node);
            operations += tx.operations;
            text.push_str(&tx.text);
        }
        let rendered = Rendered {
            seconds: start.elapsed().as_secs_f64(),
            operations,
            bytes: text.len(),
        };
        let input = KernelInput {
            command: vec!["nft".into(), "-f".into(), "-".into()],
            text,
        };
        (rendered, vec![input])
    }

    fn dataplane(&self, netns: &str) -> Box<dyn SyncTarget> {
        Box::new(NftablesDataplane::new(
            self.config(),
            NftCommand::in_netns(netns),
            Arc::new(Metrics::new()),
        ))
    }

    fn checker(&self, netns: &str, sink: &std::path::Path) -> Box<dyn SyncTarget> {
        // A stand-in program sees every write as text (no netlink batches), while the read-back
        // in `verify` still asks the namespace's kernel over netlink.
        Box::new(NftablesDataplane::new(
            self.binary_config(),
            NftCommand::in_netns(netns).with_program(sink),
            Arc::new(Metrics::new()),
        ))
    }

    fn probe(&self, netns: &str) -> anyhow::Result<Box<dyn Probe>> {
        Ok(Box::new(NftProbe {
            reader: ElementReader::open(netns)?,
        }))
    }

    fn proxy_setup(&self) -> Vec<Vec<String>> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel check plans as the binary does (detect-local by the bench's cluster CIDR,
    /// NodePorts on the primary address); the in-process dataplane differs only in its NodePorts.
    #[test]
    fn the_binary_settings_come_from_the_flags_and_the_in_process_ones_differ_only_in_node_ports() {
        let binary = Nftables.binary_config();
        assert_eq!(binary.node_ports, NodePortAddresses::Primary);
        let cidr = crate::cluster::CLUSTER_CIDR.parse().unwrap();
        assert_eq!(binary.detect_local, DetectLocal::ClusterCidr(vec![cidr]));
        let in_process = Nftables.config();
        assert_eq!(in_process.node_ports, NodePortAddresses::AllLocal);
        let in_process = NftablesConfig {
            node_ports: NodePortAddresses::Primary,
            ..in_process
        };
        assert_eq!(format!("{in_process:?}"), format!("{binary:?}"));
    }
}
