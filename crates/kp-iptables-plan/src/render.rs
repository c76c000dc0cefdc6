//! Rule text, in the canonical form `iptables-save` prints.
//!
//! Every rule is rendered exactly as `iptables-save` (legacy and nft backends alike, 1.8.9)
//! prints it back, so the applier can compare a table read back with what was planned, string
//! for string. That form differs from what upstream writes into `iptables-restore` in argument
//! order and spelling, never in meaning:
//! - the address and protocol part comes first, in the order `-s`, `-d`, `-p`, then the `-m`
//!   matches in the order given, then `-j` (upstream writes `-m comment … -m tcp -p tcp -d VIP
//!   --dport P`; save prints `-d VIP/32 -p tcp -m comment … -m tcp --dport P`);
//! - addresses carry their prefix length (`/32`, `/128`), networks are truncated to it;
//! - a comment is quoted unless it is made only of letters, digits, `-` and `_`;
//! - `MARK --or-mark M` prints as `--set-xmark M/M`, `--xor-mark M` as `--set-xmark M/0x0`;
//! - `recent` prints its defaults (`--mask 255.255.255.255 --rsource`) and puts `--name` after
//!   `--set`/`--rcheck --seconds T --reap`/`--update --seconds T --reap`;
//! - `REJECT` prints its default `--reject-with icmp-port-unreachable`
//!   (`icmp6-port-unreachable` for IPv6);
//! - `statistic --probability` is stored by the kernel as a 31-bit fraction and printed with 11
//!   decimals: upstream's `0.3333333333` reads back as `0.33333333349`. [`probability`] renders
//!   the value the kernel holds after upstream's 10-decimal input.
//!
//! The per-Service-port rules mirror upstream's `syncProxyRules` and
//! `writeServiceToEndpointRules`, except that only endpoints on this node get a `KUBE-SEP-…`
//! chain (see `port.rs`).
//!
//! | file | does |
//! |---|---|
//! | `rule.rs` | one rule in `iptables-save` form: the `Rule` builder, strings, addresses, probabilities |
//! | `chain.rs` | whole chains ([`ChainWrite`]) by [`Table`], and one Service port's chains ([`ServiceChains`]) |
//! | `context.rs` | [`PlanConfig`], and the node resolved for one family (`RenderContext`) |
//! | `port.rs` | one Service port, frontend by frontend (ClusterIP, external IPs, LoadBalancer IPs, NodePort), and its chains |
//! | `fixed.rs` | the fixed chains and the shared chains' tails |
//!
//! Nothing here knows the planner or restore inputs: they use it, never the other way round.

mod chain;
mod context;
mod fixed;
mod port;
mod rule;

pub use chain::{ChainWrite, ServiceChains, Table};
pub use context::PlanConfig;
pub use rule::probability;

pub(crate) use context::RenderContext;
pub(crate) use fixed::{
    cluster_ip_rejects, forward, jump_rules, kubelet_firewall, mark_masq, nodeports_jump,
    postrouting,
};
pub(crate) use port::{render_service, service_groups, Dispatch, PortRules};
pub(crate) use rule::save_string;

#[cfg(test)]
mod tests;
