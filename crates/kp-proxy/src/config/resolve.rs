//! Merging (defaults ← file ← flags), validation and resolution into [`Config`].
//!
//! Validation mirrors upstream's `validation.Validate`, reporting every broken rule at once
//! with v1alpha1 field paths, and checks only the sync periods of the active mode (upstream
//! converts only that section). Resolution happens in the same pass, so a value is parsed once
//! and nothing unvalidated reaches [`Config`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

use super::flags::Flags;
use super::types::{
    DEFAULT_EBPF_AFFINITY_MAP_MAX, DEFAULT_EBPF_BACKENDS_MAP_MAX, DEFAULT_EBPF_CONNTRACK_MAP_MAX,
    DEFAULT_EBPF_SERVICES_MAP_MAX, NODE_PORT_ADDRESSES_PRIMARY,
};
use super::{
    parse_port_range, Config, ConfigError, Conntrack, Ebpf, FieldError, GoDuration, Ipvs,
    KubeProxyConfiguration, Loaded, LocalMode, NodePortAddress, ProxyMode, API_VERSION, KIND,
};

/// Upstream's IPVS schedulers (`kubeproxyconfig.IPVSSchedulerMethod`); empty means `rr`.
const IPVS_SCHEDULERS: [&str; 11] = [
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh",
];

/// Merges `file` (or nothing) with `flags` and resolves the result.
pub(super) fn resolve(
    flags: Flags,
    file: Option<KubeProxyConfiguration>,
) -> Result<Loaded, ConfigError> {
    let mut doc = file.unwrap_or_else(|| KubeProxyConfiguration {
        api_version: API_VERSION.to_owned(),
        kind: KIND.to_owned(),
        ..KubeProxyConfiguration::default()
    });
    doc.set_defaults();
    let mut check = Check::default();
    apply_flags(&mut doc, &flags, &mut check);
    doc.apply_platform_defaults();
    let config = build(&mut doc, flags, &mut check);
    if !check.errors.is_empty() {
        return Err(ConfigError::Invalid(check.errors));
    }
    Ok(Loaded {
        config,
        effective: doc,
        warnings: check.warnings,
    })
}

/// Collects broken rules and ignored settings while resolving.
#[derive(Default)]
struct Check {
    errors: Vec<FieldError>,
    warnings: Vec<String>,
    /// Field paths written by a flag, with the flag, so errors can name it.
    set_by_flag: Vec<(&'static str, &'static str)>,
}

impl Check {
    fn fail(&mut self, field: impl Into<String>, value: impl ToString, detail: impl Into<String>) {
        let field = field.into();
        // `nodePortAddresses[1]` was set by the flag that set `nodePortAddresses`.
        let base = field.split('[').next().unwrap_or_default();
        let flag = self
            .set_by_flag
            .iter()
            .find(|(path, _)| *path == base)
            .map(|&(_, flag)| flag);
        self.errors.push(FieldError {
            field,
            flag,
            value: value.to_string(),
            detail: detail.into(),
        });
    }

    /// Records that `flag` wrote `field`.
    fn set_by(&mut self, field: &'static str, flag: &'static str) {
        self.set_by_flag.push((field, flag));
    }

    /// A duration that must be greater than zero.
    fn positive(&mut self, field: &str, d: GoDuration) -> Duration {
        match d.to_std() {
            Some(std) if !std.is_zero() => std,
            _ => {
                self.fail(field, d, "must be greater than 0");
                Duration::ZERO
            }
        }
    }

    /// A duration that may be zero but not negative.
    fn non_negative(&mut self, field: &str, d: GoDuration) -> Duration {
        d.to_std().unwrap_or_else(|| {
            self.fail(field, d, "must be greater than or equal to 0");
            Duration::ZERO
        })
    }

    /// A timeout where zero means "leave the kernel's value" (`None`).
    fn timeout(&mut self, field: &str, d: GoDuration) -> Option<Duration> {
        Some(self.non_negative(field, d)).filter(|d| !d.is_zero())
    }

    fn masquerade_bit(&mut self, field: &str, bit: Option<i32>) -> u8 {
        let bit = bit.unwrap_or(super::types::DEFAULT_MASQUERADE_BIT);
        match u8::try_from(bit) {
            Ok(b) if b <= 31 => b,
            _ => {
                self.fail(field, bit, "must be within the range [0, 31]");
                0
            }
        }
    }

    fn count(&mut self, field: &str, n: Option<i32>, default: u32) -> u32 {
        match n.map(u32::try_from) {
            None => default,
            Some(Ok(n)) => n,
            Some(Err(_)) => {
                self.fail(
                    field,
                    n.unwrap_or_default(),
                    "must be greater than or equal to 0",
                );
                0
            }
        }
    }

    fn cidr(&mut self, field: &str, s: &str) -> Option<IpNet> {
        match s.trim().parse::<IpNet>() {
            Ok(net) if kp_core::convert::ipv4_embedded(&net) => {
                self.fail(field, s, EMBEDDED_IPV4);
                None
            }
            Ok(net) => Some(net.trunc()),
            Err(_) => {
                self.fail(field, s, "must be a valid CIDR (e.g. 10.100.0.0/16)");
                None
            }
        }
    }

    /// `healthzBindAddress` / `metricsBindAddress`: empty disables, otherwise `ip:port`.
    fn listen_address(&mut self, field: &str, s: &str) -> Option<SocketAddr> {
        if s.is_empty() {
            return None;
        }
        match s.parse::<SocketAddr>() {
            Ok(addr) if addr.port() != 0 => Some(addr),
            Ok(_) => {
                self.fail(field, s, "must be a valid port (1-65535)");
                None
            }
            Err(_) => {
                self.fail(field, s, "must be IP:port");
                None
            }
        }
    }
}

/// Writes the flags the user passed over the defaulted file.
fn apply_flags(doc: &mut KubeProxyConfiguration, flags: &Flags, check: &mut Check) {
    if let Some(mode) = &flags.proxy_mode {
        check.set_by("mode", "--proxy-mode");
        doc.mode.clone_from(mode);
    }
    // Sections a flag writes to depend on the mode, as upstream's `processV1Alpha1Flags` and
    // v1alpha1 conversion do: nftables mode has no flags of its own and takes the iptables
    // ones for its sync periods and --masquerade-all.
    let nftables = doc.mode == ProxyMode::Nftables.as_str();

    if let Some(path) = &flags.kubeconfig {
        doc.client_connection.kubeconfig = path.to_string_lossy().into_owned();
    }
    if let Some(name) = &flags.hostname_override {
        // Upstream only looks at a non-empty flag, and refuses one that trims to nothing.
        if !name.is_empty() {
            check.set_by("hostnameOverride", "--hostname-override");
            let trimmed = name.trim();
            if trimmed.is_empty() {
                check.fail("hostnameOverride", name, "must not be blank");
            } else {
                doc.hostname_override = trimmed.to_lowercase();
            }
        }
    }
    if let Some(ip) = flags.bind_address {
        check.set_by("bindAddress", "--bind-address");
        doc.bind_address = ip.to_string();
    }
    if let Some(addr) = &flags.healthz_bind_address {
        check.set_by("healthzBindAddress", "--healthz-bind-address");
        doc.healthz_bind_address.clone_from(addr);
    }
    if let Some(addr) = &flags.metrics_bind_address {
        check.set_by("metricsBindAddress", "--metrics-bind-address");
        doc.metrics_bind_address.clone_from(addr);
    }
    if let Some(cidrs) = &flags.cluster_cidr {
        check.set_by("clusterCIDR", "--cluster-cidr");
        doc.cluster_cidr.clone_from(cidrs);
    }
    if let Some(mode) = &flags.detect_local_mode {
        check.set_by("detectLocalMode", "--detect-local-mode");
        doc.detect_local_mode.clone_from(mode);
    }
    if let Some(name) = &flags.pod_bridge_interface {
        check.set_by("detectLocal.bridgeInterface", "--pod-bridge-interface");
        doc.detect_local.bridge_interface.clone_from(name);
    }
    if let Some(prefix) = &flags.pod_interface_name_prefix {
        check.set_by(
            "detectLocal.interfaceNamePrefix",
            "--pod-interface-name-prefix",
        );
        doc.detect_local.interface_name_prefix.clone_from(prefix);
    }
    if let Some(all) = flags.masquerade_all {
        if nftables {
            doc.nftables.masquerade_all = all;
        } else {
            doc.iptables.masquerade_all = all;
        }
    }
    if let Some(addresses) = &flags.nodeport_addresses {
        check.set_by("nodePortAddresses", "--nodeport-addresses");
        doc.node_port_addresses = addresses
            .iter()
            .filter(|a| !a.is_empty())
            .cloned()
            .collect();
    }
    if let Some(cidrs) = &flags.service_cidrs {
        check.set_by("serviceCIDRs", "--service-cidrs");
        doc.service_cidrs = cidrs.iter().filter(|c| !c.is_empty()).cloned().collect();
    }
    if let Some(bit) = flags.iptables_masquerade_bit {
        check.set_by("iptables.masqueradeBit", "--iptables-masquerade-bit");
        doc.iptables.masquerade_bit = Some(bit);
    }
    if let Some(d) = flags.iptables_sync_period {
        check.set_by("iptables.syncPeriod", "--iptables-sync-period");
        doc.iptables.sync_period = d;
        if nftables {
            check.set_by("nftables.syncPeriod", "--iptables-sync-period");
            doc.nftables.sync_period = d;
        }
    }
    if let Some(d) = flags.iptables_min_sync_period {
        check.set_by("iptables.minSyncPeriod", "--iptables-min-sync-period");
        doc.iptables.min_sync_period = d;
        if nftables {
            check.set_by("nftables.minSyncPeriod", "--iptables-min-sync-period");
            doc.nftables.min_sync_period = d;
        }
    }
    if let Some(on) = flags.iptables_localhost_nodeports {
        doc.iptables.localhost_node_ports = Some(on);
    }
    if let Some(scheduler) = &flags.ipvs_scheduler {
        check.set_by("ipvs.scheduler", "--ipvs-scheduler");
        doc.ipvs.scheduler.clone_from(scheduler);
    }
    if let Some(d) = flags.ipvs_sync_period {
        check.set_by("ipvs.syncPeriod", "--ipvs-sync-period");
        doc.ipvs.sync_period = d;
    }
    if let Some(d) = flags.ipvs_min_sync_period {
        check.set_by("ipvs.minSyncPeriod", "--ipvs-min-sync-period");
        doc.ipvs.min_sync_period = d;
    }
    if let Some(on) = flags.ipvs_strict_arp {
        doc.ipvs.strict_arp = on;
    }
    for (field, flag, value, slot) in [
        (
            "ebpf.servicesMapMax",
            "--bpf-services-map-max",
            flags.bpf_services_map_max,
            &mut doc.ebpf.services_map_max,
        ),
        (
            "ebpf.backendsMapMax",
            "--bpf-backends-map-max",
            flags.bpf_backends_map_max,
            &mut doc.ebpf.backends_map_max,
        ),
        (
            "ebpf.affinityMapMax",
            "--bpf-affinity-map-max",
            flags.bpf_affinity_map_max,
            &mut doc.ebpf.affinity_map_max,
        ),
        (
            "ebpf.conntrackMapMax",
            "--bpf-conntrack-map-max",
            flags.bpf_conntrack_map_max,
            &mut doc.ebpf.conntrack_map_max,
        ),
    ] {
        if let Some(n) = value {
            check.set_by(field, flag);
            *slot = Some(n);
        }
    }
    if let Some(range) = &flags.proxy_port_range {
        check.set_by("portRange", "--proxy-port-range");
        doc.port_range.clone_from(range);
    }
    if let Some(d) = flags.udp_timeout {
        check.set_by("udpIdleTimeout", "--udp-timeout");
        doc.udp_idle_timeout = d;
    }
    if let Some(d) = flags.config_sync_period {
        check.set_by("configSyncPeriod", "--config-sync-period");
        doc.config_sync_period = d;
    }
    if let Some(adj) = flags.oom_score_adj {
        check.set_by("oomScoreAdj", "--oom-score-adj");
        doc.oom_score_adj = Some(adj);
    }
    if let Some(n) = flags.conntrack_max_per_core {
        check.set_by("conntrack.maxPerCore", "--conntrack-max-per-core");
        doc.conntrack.max_per_core = Some(n);
    }
    if let Some(n) = flags.conntrack_min {
        check.set_by("conntrack.min", "--conntrack-min");
        doc.conntrack.min = Some(n);
    }
    if let Some(gates) = &flags.feature_gates {
        doc.feature_gates.extend(gates.iter().cloned());
    }
    if let Some(v) = flags.verbosity {
        doc.logging.verbosity = u32::from(v);
    }
    apply_newer_flags(doc, flags, check);
}

/// Upstream flags beyond the ones above: the rest of v1.28's and those added since, and the
/// deprecated and removed ones still found in DaemonSets (each with a warning).
fn apply_newer_flags(doc: &mut KubeProxyConfiguration, flags: &Flags, check: &mut Check) {
    if let Some(format) = &flags.logging_format {
        check.set_by("logging.format", "--logging-format");
        doc.logging.format.clone_from(format);
    }
    let conntrack = &mut doc.conntrack;
    if let Some(d) = flags.conntrack_tcp_timeout_established {
        check.set_by(
            "conntrack.tcpEstablishedTimeout",
            "--conntrack-tcp-timeout-established",
        );
        conntrack.tcp_established_timeout = Some(d);
    }
    if let Some(d) = flags.conntrack_tcp_timeout_close_wait {
        check.set_by(
            "conntrack.tcpCloseWaitTimeout",
            "--conntrack-tcp-timeout-close-wait",
        );
        conntrack.tcp_close_wait_timeout = Some(d);
    }
    if let Some(on) = flags.conntrack_tcp_be_liberal {
        conntrack.tcp_be_liberal = on;
    }
    if let Some(d) = flags.conntrack_udp_timeout {
        check.set_by("conntrack.udpTimeout", "--conntrack-udp-timeout");
        conntrack.udp_timeout = d;
    }
    if let Some(d) = flags.conntrack_udp_timeout_stream {
        check.set_by(
            "conntrack.udpStreamTimeout",
            "--conntrack-udp-timeout-stream",
        );
        conntrack.udp_stream_timeout = d;
    }
    if let Some(cidrs) = &flags.ipvs_exclude_cidrs {
        check.set_by("ipvs.excludeCIDRs", "--ipvs-exclude-cidrs");
        doc.ipvs.exclude_cidrs = cidrs.iter().filter(|c| !c.is_empty()).cloned().collect();
    }
    if let Some(d) = flags.ipvs_tcp_timeout {
        check.set_by("ipvs.tcpTimeout", "--ipvs-tcp-timeout");
        doc.ipvs.tcp_timeout = d;
    }
    if let Some(d) = flags.ipvs_tcpfin_timeout {
        check.set_by("ipvs.tcpFinTimeout", "--ipvs-tcpfin-timeout");
        doc.ipvs.tcp_fin_timeout = d;
    }
    if let Some(d) = flags.ipvs_udp_timeout {
        check.set_by("ipvs.udpTimeout", "--ipvs-udp-timeout");
        doc.ipvs.udp_timeout = d;
    }
    if let Some(on) = flags.bind_address_hard_fail {
        doc.bind_address_hard_fail = on;
    }
    let client = &mut doc.client_connection;
    if let Some(qps) = flags.kube_api_qps {
        check.set_by("clientConnection.qps", "--kube-api-qps");
        client.qps = qps;
    }
    if let Some(burst) = flags.kube_api_burst {
        check.set_by("clientConnection.burst", "--kube-api-burst");
        client.burst = burst;
    }
    if let Some(content_type) = &flags.kube_api_content_type {
        client.content_type.clone_from(content_type);
    }
    if let Some(on) = flags.profiling {
        doc.enable_profiling = on;
    }
    if let Some(version) = &flags.show_hidden_metrics_for_version {
        doc.show_hidden_metrics_for_version.clone_from(version);
    }
    let logging = &mut doc.logging;
    if let Some(items) = &flags.vmodule {
        logging.vmodule = items
            .iter()
            .map(|(file_pattern, verbosity)| super::types::VModuleItem {
                file_pattern: file_pattern.clone(),
                verbosity: *verbosity,
            })
            .collect();
    }
    if let Some(d) = flags.log_flush_frequency {
        logging.flush_frequency = d;
    }
    if let Some(size) = &flags.log_json_info_buffer_size {
        logging.options.json.info_buffer_size = super::types::Quantity(size.clone());
    }
    if let Some(on) = flags.log_json_split_stream {
        logging.options.json.split_stream = on;
    }
    if let Some(size) = &flags.log_text_info_buffer_size {
        logging.options.text.info_buffer_size = super::types::Quantity(size.clone());
    }
    if let Some(on) = flags.log_text_split_stream {
        logging.options.text.split_stream = on;
    }
    for (flag, port, address, replacement) in [
        (
            "--healthz-port",
            flags.healthz_port,
            &mut doc.healthz_bind_address,
            "--healthz-bind-address",
        ),
        (
            "--metrics-port",
            flags.metrics_port,
            &mut doc.metrics_bind_address,
            "--metrics-bind-address",
        ),
    ] {
        let Some(port) = port else { continue };
        // Upstream's `addressFromDeprecatedFlags`: 0 disables the server; another port is
        // appended only to an address without one, which a defaulted address never is.
        if port == 0 {
            address.clear();
        }
        check.warnings.push(format!(
            "{flag} is deprecated and will be removed; use {replacement} instead{}",
            if port == 0 {
                " (0 disables the server)"
            } else {
                " (it has no effect unless 0)"
            }
        ));
    }
    if flags.cleanup_iptables.is_some() {
        check
            .warnings
            .push("--cleanup-iptables is deprecated: use --cleanup instead".to_owned());
    }
    for flag in flags.legacy.given() {
        check.warnings.push(format!(
            "{flag} is deprecated and was removed from upstream kube-proxy; it is accepted \
             without effect (logs go to stderr)"
        ));
    }
    for (flag, given) in [
        ("--boot-id-file", flags.boot_id_file.is_some()),
        ("--machine-id-file", flags.machine_id_file.is_some()),
        ("--kube-api-qps", flags.kube_api_qps.is_some()),
        ("--kube-api-burst", flags.kube_api_burst.is_some()),
        (
            "--kube-api-content-type",
            flags.kube_api_content_type.is_some(),
        ),
        ("--log-flush-frequency", flags.log_flush_frequency.is_some()),
        (
            "--log-json-info-buffer-size",
            flags.log_json_info_buffer_size.is_some(),
        ),
        (
            "--log-json-split-stream",
            flags.log_json_split_stream.is_some(),
        ),
        (
            "--log-text-info-buffer-size",
            flags.log_text_info_buffer_size.is_some(),
        ),
        (
            "--log-text-split-stream",
            flags.log_text_split_stream.is_some(),
        ),
    ] {
        if given {
            check
                .warnings
                .push(format!("{flag} is accepted without effect"));
        }
    }
}

/// Validates the merged document and resolves it. Normalised values (the hostname) are
/// written back so that the effective configuration shows what is used.
fn build(doc: &mut KubeProxyConfiguration, flags: Flags, check: &mut Check) -> Config {
    let mode = doc.mode.parse::<ProxyMode>().unwrap_or_else(|detail| {
        check.fail("mode", &doc.mode, detail);
        ProxyMode::Iptables
    });

    // Sync periods and masquerading come from the active mode's section.
    let (section, sync, min_sync) = match mode {
        ProxyMode::Ipvs => ("ipvs", doc.ipvs.sync_period, doc.ipvs.min_sync_period),
        ProxyMode::Nftables => (
            "nftables",
            doc.nftables.sync_period,
            doc.nftables.min_sync_period,
        ),
        _ => (
            "iptables",
            doc.iptables.sync_period,
            doc.iptables.min_sync_period,
        ),
    };
    let sync_period = check.positive(&format!("{section}.syncPeriod"), sync);
    let min_sync_period = check.non_negative(&format!("{section}.minSyncPeriod"), min_sync);
    if min_sync > sync {
        check.fail(
            format!("{section}.syncPeriod"),
            sync,
            format!("must be greater than or equal to {section}.minSyncPeriod ({min_sync})"),
        );
    }
    let iptables_bit = check.masquerade_bit("iptables.masqueradeBit", doc.iptables.masquerade_bit);
    let nftables_bit = check.masquerade_bit("nftables.masqueradeBit", doc.nftables.masquerade_bit);
    let (masquerade_bit, masquerade_all) = if mode == ProxyMode::Nftables {
        (nftables_bit, doc.nftables.masquerade_all)
    } else {
        (iptables_bit, doc.iptables.masquerade_all)
    };

    let ipvs = build_ipvs(doc, mode == ProxyMode::Ipvs, check);
    let conntrack = build_conntrack(doc, check);
    let ebpf = build_ebpf(doc, check);

    if doc.client_connection.burst < 0 {
        check.fail(
            "clientConnection.burst",
            doc.client_connection.burst,
            "must be greater than or equal to 0",
        );
    }
    let oom_score_adj = doc
        .oom_score_adj
        .unwrap_or(super::types::DEFAULT_OOM_SCORE_ADJ);
    if !(-1000..=1000).contains(&oom_score_adj) {
        check.fail(
            "oomScoreAdj",
            oom_score_adj,
            "must be within the range [-1000, 1000]",
        );
    }
    let config_sync_period = check.positive("configSyncPeriod", doc.config_sync_period);
    let udp_idle_timeout = check.positive("udpIdleTimeout", doc.udp_idle_timeout);
    let userspace_drain_timeout = flags
        .userspace_drain_timeout
        .map_or(super::DEFAULT_USERSPACE_DRAIN_TIMEOUT, |d| {
            check.non_negative("--userspace-drain-timeout", d)
        });
    let bpf_handover_idle = flags
        .bpf_handover_idle
        .map_or(super::DEFAULT_BPF_HANDOVER_IDLE, |d| {
            check.non_negative("--bpf-handover-idle", d)
        });

    let bind_address = doc.bind_address.parse::<IpAddr>().unwrap_or_else(|_| {
        check.fail(
            "bindAddress",
            &doc.bind_address,
            "not a valid textual representation of an IP address",
        );
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    });
    let healthz_bind_address =
        check.listen_address("healthzBindAddress", &doc.healthz_bind_address);
    let metrics_bind_address =
        check.listen_address("metricsBindAddress", &doc.metrics_bind_address);

    let cluster_cidrs = build_cluster_cidrs(&doc.cluster_cidr, check);
    let detect_local_mode = build_detect_local_mode(doc, check);
    if detect_local_mode == LocalMode::ClusterCIDR && cluster_cidrs.is_empty() {
        check.warnings.push(
            "detectLocalMode is ClusterCIDR but clusterCIDR is empty: no traffic is treated as \
             local"
                .to_owned(),
        );
    }
    let node_port_addresses = build_node_port_addresses(&doc.node_port_addresses, check);
    let service_cidrs = build_service_cidrs(&doc.service_cidrs, check);

    let port_range = parse_port_range(&doc.port_range).unwrap_or_else(|detail| {
        check.fail("portRange", &doc.port_range, detail);
        None
    });

    let logging_format = match doc.logging.format.as_str() {
        "text" => super::LogFormat::Text,
        "json" => super::LogFormat::Json,
        other => {
            check.fail(
                "logging.format",
                other,
                "unsupported log format (\"text\" or \"json\")",
            );
            super::LogFormat::Text
        }
    };
    let verbosity = u8::try_from(doc.logging.verbosity).unwrap_or(u8::MAX);

    let hostname = if doc.hostname_override.is_empty() {
        None
    } else {
        let name = doc.hostname_override.trim().to_lowercase();
        if name.is_empty() {
            check.fail(
                "hostnameOverride",
                &doc.hostname_override,
                "must not be blank",
            );
            None
        } else {
            doc.hostname_override.clone_from(&name);
            Some(name)
        }
    };

    collect_warnings(doc, check);

    let kubeconfig = flags.kubeconfig.or_else(|| {
        Some(&doc.client_connection.kubeconfig)
            .filter(|k| !k.is_empty())
            .map(PathBuf::from)
    });

    Config {
        mode,
        config_file: flags.config,
        kubeconfig,
        master: flags.master.filter(|m| !m.is_empty()),
        manifests_dir: flags.manifests,
        hostname,
        bind_address,
        healthz_bind_address,
        metrics_bind_address,
        bind_address_hard_fail: doc.bind_address_hard_fail,
        cluster_cidrs,
        detect_local_mode,
        node_port_addresses,
        service_cidrs,
        masquerade_bit,
        masquerade_all,
        sync_period,
        min_sync_period,
        config_sync_period,
        localhost_nodeports: doc.iptables.localhost_node_ports.unwrap_or(false),
        ipvs,
        conntrack,
        port_range,
        udp_idle_timeout,
        userspace_drain_timeout,
        ebpf,
        bpf_handover_idle,
        bpf_cgroup_root: flags.bpf_cgroup_root,
        bpf_pin_dir: flags
            .bpf_pin_dir
            .unwrap_or_else(|| PathBuf::from(super::DEFAULT_BPF_PIN_DIR)),
        oom_score_adj,
        feature_gates: doc.feature_gates.clone(),
        cleanup: flags.cleanup.or(flags.cleanup_iptables).unwrap_or(false),
        write_config_to: flags.write_config_to,
        verbosity,
        logging_format,
        init_only: flags.init_only.unwrap_or(false),
    }
}

/// The ipvs section is validated only in ipvs mode, as upstream; in other modes whatever
/// parses is carried along unused.
fn build_ipvs(doc: &KubeProxyConfiguration, active: bool, check: &mut Check) -> Ipvs {
    let section = &doc.ipvs;
    let mut quiet = Check::default();
    let c = if active { check } else { &mut quiet };
    if !section.scheduler.is_empty() && !IPVS_SCHEDULERS.contains(&section.scheduler.as_str()) {
        c.fail(
            "ipvs.scheduler",
            &section.scheduler,
            format!(
                "must be one of {}, or blank (blank means rr)",
                IPVS_SCHEDULERS.join(", ")
            ),
        );
    }
    let exclude_cidrs = section
        .exclude_cidrs
        .iter()
        .enumerate()
        .filter_map(|(i, s)| c.cidr(&format!("ipvs.excludeCIDRs[{i}]"), s))
        .collect();
    Ipvs {
        scheduler: if section.scheduler.is_empty() {
            "rr".to_owned()
        } else {
            section.scheduler.clone()
        },
        exclude_cidrs,
        strict_arp: section.strict_arp,
        tcp_timeout: c.timeout("ipvs.tcpTimeout", section.tcp_timeout),
        tcp_fin_timeout: c.timeout("ipvs.tcpFinTimeout", section.tcp_fin_timeout),
        udp_timeout: c.timeout("ipvs.udpTimeout", section.udp_timeout),
    }
}

fn build_ebpf(doc: &KubeProxyConfiguration, check: &mut Check) -> Ebpf {
    let section = &doc.ebpf;
    let mut size = |field: &str, n: Option<u32>, default: u32| match n {
        Some(0) => {
            check.fail(field, 0, "must be greater than 0");
            default
        }
        Some(n) => n,
        None => default,
    };
    Ebpf {
        services_map_max: size(
            "ebpf.servicesMapMax",
            section.services_map_max,
            DEFAULT_EBPF_SERVICES_MAP_MAX,
        ),
        backends_map_max: size(
            "ebpf.backendsMapMax",
            section.backends_map_max,
            DEFAULT_EBPF_BACKENDS_MAP_MAX,
        ),
        affinity_map_max: size(
            "ebpf.affinityMapMax",
            section.affinity_map_max,
            DEFAULT_EBPF_AFFINITY_MAP_MAX,
        ),
        conntrack_map_max: size(
            "ebpf.conntrackMapMax",
            section.conntrack_map_max,
            DEFAULT_EBPF_CONNTRACK_MAP_MAX,
        ),
    }
}

fn build_conntrack(doc: &KubeProxyConfiguration, check: &mut Check) -> Conntrack {
    let section = &doc.conntrack;
    let optional = |check: &mut Check, field: &str, d: Option<GoDuration>| {
        d.and_then(|d| check.timeout(field, d))
    };
    Conntrack {
        max_per_core: check.count("conntrack.maxPerCore", section.max_per_core, 32 * 1024),
        min: check.count("conntrack.min", section.min, 128 * 1024),
        tcp_established_timeout: optional(
            check,
            "conntrack.tcpEstablishedTimeout",
            section.tcp_established_timeout,
        ),
        tcp_close_wait_timeout: optional(
            check,
            "conntrack.tcpCloseWaitTimeout",
            section.tcp_close_wait_timeout,
        ),
        tcp_be_liberal: section.tcp_be_liberal,
        udp_timeout: check.timeout("conntrack.udpTimeout", section.udp_timeout),
        udp_stream_timeout: check.timeout("conntrack.udpStreamTimeout", section.udp_stream_timeout),
    }
}

/// Why an IPv6 range of IPv4-mapped or -compatible addresses is refused.
const EMBEDDED_IPV4: &str = "an IPv4-mapped or IPv4-compatible IPv6 range (the kernel tools print \
     it in IPv4 form, so rules holding it never read back); give the IPv4 range instead";

/// `clusterCIDR`: empty, one CIDR, or one IPv4 and one IPv6 CIDR separated by a comma.
fn build_cluster_cidrs(value: &str, check: &mut Check) -> Vec<IpNet> {
    if value.trim().is_empty() {
        return Vec::new();
    }
    let parts: Vec<&str> = value.split(',').collect();
    if parts.len() > 2 {
        check.fail(
            "clusterCIDR",
            value,
            "only one CIDR allowed or a valid dual-stack pair \
             (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
        );
        return Vec::new();
    }
    let mut cidrs = Vec::with_capacity(parts.len());
    for part in parts {
        match part.trim().parse::<IpNet>() {
            Ok(net) if kp_core::convert::ipv4_embedded(&net) => {
                check.fail("clusterCIDR", value, EMBEDDED_IPV4);
                return Vec::new();
            }
            Ok(net) => cidrs.push(net.trunc()),
            Err(_) => {
                let example = "(e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)";
                let detail = if part.len() == value.len() {
                    format!("must be a valid CIDR block {example}")
                } else {
                    format!("{part:?} is not a valid CIDR block {example}")
                };
                check.fail("clusterCIDR", value, detail);
                return Vec::new();
            }
        }
    }
    if let [a, b] = cidrs[..] {
        if matches!(a, IpNet::V4(_)) == matches!(b, IpNet::V4(_)) {
            check.fail(
                "clusterCIDR",
                value,
                "two CIDRs must be a dual-stack pair: one IPv4 and one IPv6",
            );
            return Vec::new();
        }
    }
    cidrs
}

fn build_detect_local_mode(doc: &KubeProxyConfiguration, check: &mut Check) -> LocalMode {
    let local = &doc.detect_local;
    match doc.detect_local_mode.as_str() {
        "ClusterCIDR" => LocalMode::ClusterCIDR,
        "NodeCIDR" => LocalMode::NodeCIDR,
        "BridgeInterface" => {
            if local.bridge_interface.is_empty() {
                check.fail(
                    "detectLocal.bridgeInterface",
                    "",
                    "must not be empty when detectLocalMode is BridgeInterface",
                );
            } else {
                check_interface_name(
                    "detectLocal.bridgeInterface",
                    &local.bridge_interface,
                    check,
                );
            }
            LocalMode::BridgeInterface(local.bridge_interface.clone())
        }
        "InterfaceNamePrefix" => {
            if local.interface_name_prefix.is_empty() {
                check.fail(
                    "detectLocal.interfaceNamePrefix",
                    "",
                    "must not be empty when detectLocalMode is InterfaceNamePrefix",
                );
            } else {
                check_interface_name(
                    "detectLocal.interfaceNamePrefix",
                    &local.interface_name_prefix,
                    check,
                );
            }
            LocalMode::InterfaceNamePrefix(local.interface_name_prefix.clone())
        }
        other => {
            check.fail(
                "detectLocalMode",
                other,
                format!("must be one of {}", LocalMode::NAMES.join(", ")),
            );
            LocalMode::ClusterCIDR
        }
    }
}

/// An interface name (or prefix) for detect-local: the kernel's rules for names, and nothing
/// that could reach the rules as anything but a name (see [`kp_core::node::InterfaceName`]).
fn check_interface_name(field: &'static str, name: &str, check: &mut Check) {
    if let Err(e) = kp_core::node::InterfaceName::new(name) {
        check.fail(field, name, e.to_string());
    }
}

/// `nodePortAddresses`: CIDRs, or `primary` alone.
fn build_node_port_addresses(values: &[String], check: &mut Check) -> Vec<NodePortAddress> {
    let mut out = Vec::with_capacity(values.len());
    for (i, value) in values.iter().enumerate() {
        let field = format!("nodePortAddresses[{i}]");
        if value == NODE_PORT_ADDRESSES_PRIMARY {
            if values.len() > 1 {
                check.fail(field, value, "can't use both 'primary' and CIDRs");
            }
            out.push(NodePortAddress::Primary);
        } else if let Some(net) = check.cidr(&field, value) {
            out.push(NodePortAddress::Cidr(net));
        }
    }
    out
}

/// `serviceCIDRs`: CIDRs that overlap no special range (see kp-core's `special_service_cidr`).
fn build_service_cidrs(values: &[String], check: &mut Check) -> Vec<IpNet> {
    let mut out = Vec::with_capacity(values.len());
    for (i, value) in values.iter().enumerate() {
        let field = format!("serviceCIDRs[{i}]");
        if let Some(net) = check.cidr(&field, value) {
            match kp_core::convert::special_service_cidr(&net) {
                Some(reason) => check.fail(field, value, reason),
                None => out.push(net.trunc()),
            }
        }
    }
    out
}

/// Settings accepted for compatibility that change nothing here.
fn collect_warnings(doc: &KubeProxyConfiguration, check: &mut Check) {
    if !doc.feature_gates.is_empty() {
        let gates: Vec<String> = doc
            .feature_gates
            .iter()
            .map(|(name, on)| format!("{name}={on}"))
            .collect();
        check.warnings.push(format!(
            "feature gates are accepted but change nothing in kube-proxy-rs: {}",
            gates.join(",")
        ));
    }
    if doc.enable_profiling {
        check
            .warnings
            .push("enableProfiling has no effect: there is no /debug/pprof".to_owned());
    }
    if !doc.show_hidden_metrics_for_version.is_empty() {
        check
            .warnings
            .push("showHiddenMetricsForVersion has no effect: no metric is hidden".to_owned());
    }
    if doc.iptables.snat_node_internal_ip == Some(true) {
        check
            .warnings
            .push("iptables.snatNodeInternalIP is not implemented and has no effect".to_owned());
    }
    if !doc.logging.vmodule.is_empty() {
        check
            .warnings
            .push("logging.vmodule has no effect".to_owned());
    }
}
