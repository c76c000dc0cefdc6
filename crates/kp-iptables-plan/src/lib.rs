//! Plans kube-proxy-rs's iptables mode: upstream's `KUBE-*` chains in the filter and nat
//! tables, rendered as `iptables-restore --noflush` input, with partial restores that rewrite
//! only what changed (`kp-iptables-test` holds the tracer that replays them).
//!
//! Pure: no processes, no clock. `kp-iptables` runs the restores and reads the tables back.
//! The semantics and chain names are upstream's (`pkg/proxy/iptables/proxier.go`).

pub mod names;
pub mod planner;
pub mod render;
pub mod restore;
pub mod validate;

pub use kp_core::node::NodeContext;
pub use names::ChainId;
pub use planner::{digest, ChainIndex, JumpRule, PlanConfig, PlanError, Planner};
pub use restore::{ChainWrite, Extra, Input, Restore, ServiceChains, Table};
pub use validate::{Problem, RuleError};
