//! The iptables dataplane (`--proxy-mode iptables`): sends the planner's restore inputs with
//! `iptables-restore --noflush --counters` on the node's backend (iptables-nft or
//! iptables-legacy, [`detect_backend`]), keeps upstream's canary chains, reads the tables back
//! with `iptables-save` to prove the kernel holds what we planned, and forgets its record after
//! any failure so the next sync is a full one. A full sync (the first of a process, a repair)
//! adopts what the kernel already holds: it reads our chains back and writes only those that
//! differ from the plan ([`Adoption`]). [`cleanup_all`] removes every chain the mode
//! owns from both backends, for `--cleanup` and for switching modes.
//!
//! Planning (what to send) is `kp-iptables-plan`'s; this crate only talks to the kernel.
//! Mirrors upstream `pkg/proxy/iptables/proxier.go` (`syncProxyRules`, `CleanupLeftovers`) and
//! `pkg/util/iptables` (the runner, `-w`, restore errors).

mod adopt;
mod cleanup;
mod dataplane;
mod detect;
mod names;
mod readback;
mod runner;
mod view;

pub use cleanup::{cleanup_all, cleanup_tables, cleanup_with};
pub use dataplane::{
    Adoption, IptablesConfig, IptablesDataplane, DEFAULT_ADOPT_CHAIN_LIMIT,
    DEFAULT_FULL_READBACK_LIMIT, DEFAULT_STEP_CHAINS, LIVE_STEP_FACTOR, READBACK_SAMPLE_CHAINS,
};
pub use detect::{choose, detect_backend, evidence, BackendEvidence};
pub use kp_core::node::{DetectLocal, NodePortAddresses};
pub use names::{
    is_owned_chain, is_service_chain, CANARY_CHAIN, CANARY_TABLES, FIXED_CHAINS, HINT_CHAINS,
    LOCALNET_CHAIN, LOCALNET_COMMENT, SERVICE_CHAIN_PREFIXES,
};
pub use readback::{canonical, compare, parse_save, split_args, SavedTable};
pub use runner::{Backend, CommandOutput, IptablesCommand, IptablesRunner, DEFAULT_WAIT_SECONDS};

/// What went wrong talking to the kernel. Every variant is retryable: the next sync is a full
/// rebuild.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tool could not be started or fed (not installed, no permission).
    #[error("cannot run {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// `iptables-restore` refused an input. Tables committed before the failing one (each
    /// `COMMIT` is its own) stay applied; nothing of the failing table is.
    #[error("{program} failed (exit {status:?}): {stderr}{}", failing_line.as_ref().map(|l| format!("\n  failing line {}: {l}", line.unwrap_or_default())).unwrap_or_default())]
    Restore {
        /// The restore program (`iptables-nft-restore`, ...).
        program: String,
        /// Its exit code.
        status: Option<i32>,
        /// What it printed.
        stderr: String,
        /// The input line it named, counting from 1.
        line: Option<usize>,
        /// That line's text.
        failing_line: Option<String>,
    },
    /// A single `iptables` or `iptables-save` command failed.
    #[error("`{command}` failed (exit {status:?}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit code.
        status: Option<i32>,
        /// What it printed.
        stderr: String,
    },
    /// `iptables-save` printed something this crate does not understand.
    #[error("cannot parse iptables-save output: {0}")]
    Parse(String),
    /// The planner refused a rule of a fixed or shared chain ([`kp_iptables_plan::validate`]):
    /// no restore of that family could load, so none was sent and the kernel keeps its rules.
    /// (A refused rule of one Service only leaves that Service out; the sync goes on.)
    #[error("planned rules failed validation: {0}")]
    Plan(Box<kp_iptables_plan::PlanError>),
    /// A sysctl could not be set (`route_localnet` for localhost NodePorts).
    #[error("cannot set sysctl {key}: {detail}")]
    Sysctl {
        /// The key.
        key: String,
        /// Why.
        detail: String,
    },
}

impl Error {
    /// Whether retrying can help: a tool that is missing or not permitted stays so.
    pub fn retry(&self) -> kp_core::dataplane::Retry {
        match self {
            Error::Spawn { source, .. } => kp_core::dataplane::Retry::of_spawn(source),
            _ => kp_core::dataplane::Retry::WithBackoff,
        }
    }

    /// The error as the sync loop handles it.
    pub fn into_dataplane(self) -> kp_core::dataplane::DataplaneError {
        kp_core::dataplane::DataplaneError::new(self.retry(), self)
    }
}
