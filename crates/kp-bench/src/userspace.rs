//! The userspace mode under benchmark: `kp_userspace::UserspaceDataplane` in-process (its
//! relay threads enter the lab's node namespace, so the data path runs through this process),
//! the redirect planner alone for render timing and the bare baseline's input (`nft -f -`).
//!
//! Endpoints live in the proxy's balancer, not in the kernel: a one-endpoint change sends
//! nothing to the kernel, so its time is the dataplane's sync call (the balancer's update). For
//! the same reason the binary's programming latency cannot be read from the kernel: the probe
//! sees a Service's frontend in the redirect table (enough to know the first full sync is
//! live), and [`ModeUnderTest::probe_sees_endpoints`] says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::dataplane::SyncReport;
use kp_core::node::NodeContext;
use kp_core::track::{Changes, ProxyState};
use kp_metrics::Metrics;
use kp_nftables::NodePortAddresses;
use kp_proxy::config::ProxyMode;
use kp_userspace::{UserspaceConfig, UserspaceDataplane};
use kp_userspace_plan::names::{family_suffix, FAMILY, TABLE};
use kp_userspace_plan::{RedirectConfig, RedirectPlanner};

use crate::mode::{KernelInput, ModeUnderTest, Probe, ProbeTarget, Rendered, SyncTarget};

/// The port the render-only path plans for (the dataplane picks a free one when it starts).
const RENDER_PORT: u16 = 40_000;

/// The userspace mode, configured as the binary is from the bench's flags, with NodePorts on
/// every local address in-process (as the nftables adapter).
#[derive(Clone, Debug, Default)]
pub struct Userspace;

impl Userspace {
    fn config(&self) -> UserspaceConfig {
        let config = crate::proxy::binary_config(self).unwrap_or_else(|e| panic!("{e:#}"));
        let cfg = kp_proxy::modes::userspace_config(&config)
            .unwrap_or_else(|e| panic!("userspace: the binary's settings: {e}"));
        UserspaceConfig {
            node_ports: NodePortAddresses::AllLocal,
            ..cfg
        }
    }
}

/// The dataplane, started (runtime, listeners bound, policy routing installed) when made, as the
/// binary starts it before its first sync, so a timed full sync is the sync alone. A failed start
/// is the first sync's error.
struct Started {
    dataplane: UserspaceDataplane,
    start_failed: Option<String>,
}

impl Started {
    fn new(mut dataplane: UserspaceDataplane) -> Started {
        let start_failed = dataplane.start().err().map(|e| e.to_string());
        Started {
            dataplane,
            start_failed,
        }
    }
}

impl SyncTarget for Started {
    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> anyhow::Result<SyncReport> {
        if let Some(e) = &self.start_failed {
            anyhow::bail!("the userspace proxy did not start: {e}");
        }
        Ok(self.dataplane.sync(state, changes, full)?)
    }

    fn verify(&mut self) -> anyhow::Result<Vec<String>> {
        Ok(self.dataplane.verify()?)
    }
}

/// The churn soak's plan-only checker: the userspace dataplane writes through its own `nft`
/// and cannot be pointed at a sink, so the soak does not run this mode.
struct NoChecker;

impl SyncTarget for NoChecker {
    fn sync(&mut self, _: &ProxyState, _: &Changes, _: bool) -> anyhow::Result<SyncReport> {
        anyhow::bail!("the churn soak's kernel check is not built for userspace mode")
    }

    fn verify(&mut self) -> anyhow::Result<Vec<String>> {
        anyhow::bail!("the churn soak's kernel check is not built for userspace mode")
    }
}

/// Reads the redirect table's `redirect-vips` set with `nft get element`.
struct RedirectProbe {
    netns: String,
}

impl Probe for RedirectProbe {
    fn interval(&self) -> Duration {
        // One `nft` run per read.
        Duration::from_millis(20)
    }

    fn is_live(&mut self, t: &ProbeTarget) -> anyhow::Result<bool> {
        let set = format!(
            "redirect-vips-{}",
            family_suffix(kp_core::model::IpFamily::V4)
        );
        let element = format!("{{ {} . tcp . {} }}", t.vip, t.port);
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &self.netns, "nft", "get", "element"])
            .args([FAMILY, TABLE, &set, &element])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        Ok(out.success())
    }
}

impl ModeUnderTest for Userspace {
    fn name(&self) -> &'static str {
        "userspace"
    }

    fn mode(&self) -> ProxyMode {
        ProxyMode::Userspace
    }

    /// The mode, with a drain of one second: a stopped userspace proxy serves on while its
    /// rules stay (default 10 s), longer than a run waits for it to end.
    fn proxy_args(&self) -> Vec<String> {
        vec![
            format!("--proxy-mode={}", self.mode().as_str()),
            "--userspace-drain-timeout=1s".into(),
        ]
    }

    fn unavailable(&self) -> Option<String> {
        match std::process::Command::new("nft").arg("--version").output() {
            Ok(o) if o.status.success() => None,
            _ => Some("nft is not installed (apt-get install nftables)".into()),
        }
    }

    fn render_full(&self, state: &ProxyState) -> (Rendered, Vec<KernelInput>) {
        let cfg = self.config();
        let node = NodeContext::resolve(&cfg.balancer.detect_local, &cfg.node_ports, state);
        let start = Instant::now();
        let mut planner = RedirectPlanner::new(RedirectConfig {
            proxy_port: RENDER_PORT,
            transparent_mark: cfg.routing.mark,
            node_ports_restricted: cfg.node_ports != NodePortAddresses::AllLocal,
        });
        let tx = planner.full(state, &node);
        let rendered = Rendered {
            seconds: start.elapsed().as_secs_f64(),
            operations: tx.operations,
            bytes: tx.text.len(),
        };
        let input = KernelInput {
            command: vec!["nft".into(), "-f".into(), "-".into()],
            text: tx.text,
        };
        (rendered, vec![input])
    }

    fn dataplane(&self, netns: &str) -> Box<dyn SyncTarget> {
        Box::new(Started::new(UserspaceDataplane::new(
            self.config(),
            Some(netns),
            Arc::new(Metrics::new()),
        )))
    }

    fn checker(&self, _netns: &str, _sink: &std::path::Path) -> Box<dyn SyncTarget> {
        Box::new(NoChecker)
    }

    fn probe(&self, netns: &str) -> anyhow::Result<Box<dyn Probe>> {
        Ok(Box::new(RedirectProbe {
            netns: netns.to_string(),
        }))
    }

    fn probe_sees_endpoints(&self) -> bool {
        false
    }

    fn relays_in_process(&self) -> bool {
        true
    }

    fn proxy_setup(&self) -> Vec<Vec<String>> {
        Vec::new()
    }
}
