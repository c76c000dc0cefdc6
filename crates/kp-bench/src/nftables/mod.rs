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

use crate::cluster::CLUSTER_CIDR;
use crate::mode::{KernelInput, ModeUnderTest, Probe, ProbeTarget, Rendered, SyncTarget};
use netlink::{ElementReader, NFPROTO_IPV4};

/// The nftables mode, configured as the benchmark runs the binary: `--cluster-cidr` set
/// (detect-local by cluster CIDR), NodePorts on every local address, both families.
#[derive(Clone, Debug, Default)]
pub struct Nftables;

impl Nftables {
    fn config() -> NftablesConfig {
        let cidr = CLUSTER_CIDR.parse().map(|c| vec![c]).unwrap_or_default();
        NftablesConfig {
            detect_local: DetectLocal::ClusterCidr(cidr),
            node_ports: NodePortAddresses::AllLocal,
            ..NftablesConfig::default()
        }
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

    fn unavailable(&self) -> Option<String> {
        match std::process::Command::new("nft").arg("--version").output() {
            Ok(o) if o.status.success() => None,
            _ => Some("nft is not installed (apt-get install nftables)".into()),
        }
    }

    fn render_full(&self, state: &ProxyState) -> (Rendered, Vec<KernelInput>) {
        let cfg = Nftables::config();
        let node = NodeContext::resolve(&cfg.detect_local, &cfg.node_ports, state.node());
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
            Nftables::config(),
            NftCommand::in_netns(netns),
            Arc::new(Metrics::new()),
        ))
    }

    fn probe(&self, netns: &str) -> anyhow::Result<Box<dyn Probe>> {
        Ok(Box::new(NftProbe {
            reader: ElementReader::open(netns)?,
        }))
    }

    fn proxy_args(&self) -> Vec<String> {
        vec!["--proxy-mode=nftables".into()]
    }

    fn proxy_setup(&self) -> Vec<Vec<String>> {
        Vec::new()
    }
}
