//! The iptables mode under benchmark, once per backend (`iptables-nft`, `iptables-legacy`):
//! `kp_iptables::IptablesDataplane` in-process, its planner alone for render timing and the
//! bare baseline's restore inputs (`iptables-restore --noflush --counters`), and
//! `iptables -S KUBE-SVC-…` for the latency probe.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceKey, ServicePortName};
use kp_core::node::NodeContext;
use kp_core::track::ProxyState;
use kp_iptables::{
    Backend, DetectLocal, IptablesCommand, IptablesConfig, IptablesDataplane, DEFAULT_STEP_CHAINS,
};
use kp_iptables_plan::{names, PlanConfig, Planner, Restore};
use kp_metrics::Metrics;
use kp_proxy::config::ProxyMode;

use crate::cluster::CLUSTER_CIDR;
use crate::mode::{KernelInput, ModeUnderTest, Probe, ProbeTarget, Rendered, SyncTarget};

/// The iptables mode on one backend, configured as the benchmark runs the binary:
/// `--cluster-cidr` set, NodePorts on every local address, both families.
#[derive(Clone, Copy, Debug)]
pub struct Iptables {
    /// The backend.
    pub backend: Backend,
}

impl Iptables {
    fn config(self) -> IptablesConfig {
        let cidr = CLUSTER_CIDR.parse().map(|c| vec![c]).unwrap_or_default();
        IptablesConfig {
            detect_local: DetectLocal::ClusterCidr(cidr),
            backend: self.backend,
            step_chains: DEFAULT_STEP_CHAINS,
            ..IptablesConfig::default()
        }
    }

    /// The binary's own settings as the bench starts it in iptables mode: [`Iptables::config`]
    /// but without localhost NodePorts, which the binary turns off by default (CVE-2020-8558).
    /// The kernel check plans with these.
    ///
    /// Written out rather than taken from the registry's [`kp_proxy::modes::iptables_config`]:
    /// that one also detects the backend by listing the tables of a namespace, and the
    /// render-only path has no namespace (and the bench sets the backend itself). A test holds
    /// the two equal but for the backend.
    fn binary_config(self) -> IptablesConfig {
        IptablesConfig {
            localhost_node_ports: false,
            ..self.config()
        }
    }
}

/// Chains written or deleted plus rules written, as the dataplane counts a restore.
fn operations(r: &Restore) -> usize {
    r.chain_count() + r.rule_count()
}

/// Asks the backend whether the Service port's `KUBE-SVC-…` chain reaches the endpoint: DNATs
/// to it, or (an endpoint on this node) jumps to its `KUBE-SEP-…` chain (named by upstream's
/// hash, which includes the endpoint).
struct IptProbe {
    netns: String,
    backend: Backend,
}

impl Probe for IptProbe {
    fn interval(&self) -> Duration {
        match self.backend {
            Backend::Nft => Duration::from_millis(1),
            // iptables-legacy takes the machine's xtables lock even to list: a probe that
            // listed back to back would keep the proxy's restores waiting for it.
            Backend::Legacy => Duration::from_millis(20),
        }
    }

    fn is_live(&mut self, t: &ProbeTarget) -> anyhow::Result<bool> {
        let name = ServicePortName {
            service: ServiceKey {
                namespace: t.namespace.clone(),
                name: t.service.clone(),
            },
            port: t.port_name.clone(),
            protocol: Protocol::Tcp,
        };
        let endpoint = Endpoint {
            ip: t.endpoint.into(),
            port: t.target_port,
            ready: true,
            serving: true,
            terminating: false,
            is_local: false,
            zone_hints: None,
        };
        let svc = names::service_chains(&name).svc;
        let sep = names::endpoint_chain(&name, &endpoint);
        let program = self.backend.program(IpFamily::V4, "");
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.netns,
                &program,
                "-w",
                "5",
                "-t",
                "nat",
                "-S",
                &svc,
            ])
            .stdin(std::process::Stdio::null())
            .output()?;
        // Exit 1: no such chain yet.
        if !out.status.success() {
            return Ok(false);
        }
        let jump = format!("-j {sep}");
        let dnat = format!("-j DNAT --to-destination {}:{}", t.endpoint, t.target_port);
        Ok(String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            let l = l.trim_end();
            l.ends_with(&jump) || l.ends_with(&dnat)
        }))
    }
}

impl ModeUnderTest for Iptables {
    fn name(&self) -> &'static str {
        match self.backend {
            Backend::Nft => "iptables-nft",
            Backend::Legacy => "iptables-legacy",
        }
    }

    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn unavailable(&self) -> Option<String> {
        let program = self.backend.program(IpFamily::V4, "-restore");
        match std::process::Command::new(&program)
            .arg("--version")
            .output()
        {
            Ok(o) if o.status.success() => None,
            _ => Some(format!(
                "{program} is not installed (apt-get install iptables)"
            )),
        }
    }

    fn render_full(&self, state: &ProxyState) -> (Rendered, Vec<KernelInput>) {
        let cfg = self.config();
        let node = NodeContext::resolve(&cfg.detect_local, &cfg.node_ports, state);
        let localhost = cfg.localhost_node_ports_effective();
        let start = Instant::now();
        let mut operations_total = 0;
        let mut inputs = Vec::new();
        for family in &cfg.families {
            let mut pc = PlanConfig::new(*family);
            pc.masquerade_bit = cfg.masquerade_bit;
            pc.masquerade_all = cfg.masquerade_all;
            pc.localhost_node_ports = localhost && *family == IpFamily::V4;
            let restore = Planner::new(pc).full(state, &node);
            operations_total += operations(&restore);
            // As the dataplane sends them: one input with legacy, steps with nft.
            match self.backend {
                Backend::Legacy => inputs.push((*family, restore.text())),
                Backend::Nft => inputs.extend(
                    restore
                        .steps(cfg.step_chains.max(1))
                        .into_iter()
                        .map(|s| (*family, s)),
                ),
            }
        }
        let rendered = Rendered {
            seconds: start.elapsed().as_secs_f64(),
            operations: operations_total,
            bytes: inputs.iter().map(|(_, s)| s.len()).sum(),
        };
        let inputs = inputs
            .into_iter()
            .map(|(family, text)| KernelInput {
                command: vec![
                    self.backend.program(family, "-restore"),
                    "-w".into(),
                    "5".into(),
                    "--noflush".into(),
                    "--counters".into(),
                ],
                text,
            })
            .collect();
        (rendered, inputs)
    }

    fn dataplane(&self, netns: &str) -> Box<dyn SyncTarget> {
        Box::new(IptablesDataplane::new(
            self.config(),
            IptablesCommand::in_netns(netns),
            Arc::new(Metrics::new()),
        ))
    }

    fn checker(&self, netns: &str, sink: &std::path::Path) -> Box<dyn SyncTarget> {
        // Restores go to the sink. What the dataplane's full sync still does to the kernel is
        // idempotent and already done by the binary: the mangle canary chain if missing (and
        // `route_localnet=1`, which the binary's settings never ask for). Whole tables are
        // compared, not a sample (iptables-nft-save takes minutes at 10k × 10; the check is the
        // point).
        Box::new(IptablesDataplane::new(
            IptablesConfig {
                full_readback_limit: u64::MAX,
                ..self.binary_config()
            },
            IptablesCommand::in_netns(netns).with_restore_program(sink),
            Arc::new(Metrics::new()),
        ))
    }

    fn probe(&self, netns: &str) -> anyhow::Result<Box<dyn Probe>> {
        Ok(Box::new(IptProbe {
            netns: netns.into(),
            backend: self.backend,
        }))
    }

    fn proxy_setup(&self) -> Vec<Vec<String>> {
        // kubelet's hint chain in this backend's mangle table: kube-proxy picks the backend
        // the node's kubelet uses, as upstream's iptables-wrapper does.
        vec![vec![
            self.backend.program(IpFamily::V4, ""),
            "-w".into(),
            "5".into(),
            "-t".into(),
            "mangle".into(),
            "-N".into(),
            kp_iptables::HINT_CHAINS[0].into(),
        ]]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bench's iptables settings are the binary's: what the registry computes from the
    /// configuration the binary resolves from the bench's flags, the detected backend aside.
    #[test]
    fn the_binary_settings_are_the_registrys_from_the_same_flags() {
        for backend in [Backend::Nft, Backend::Legacy] {
            let mode = Iptables { backend };
            let config = crate::proxy::binary_config(&mode).unwrap();
            // A namespace that does not exist: detection finds no evidence there, and the
            // backend is replaced with the bench's anyway.
            let registry =
                kp_proxy::modes::iptables_config(&config, Some("kp-bench-no-such-netns")).unwrap();
            let registry = IptablesConfig {
                backend,
                ..registry
            };
            assert_eq!(
                format!("{:?}", mode.binary_config()),
                format!("{registry:?}"),
                "{}",
                mode.name()
            );
        }
    }
}
