//! Plans kube-proxy-rs's nftables table: what the kernel should hold, and the smallest atomic
//! transaction that gets it there (`kp-nftables-test` holds the tracer that replays it).
//!
//! Pure: no processes, no sockets, no clock. `kp-nftables` sends the transactions (the structure
//! as nft text, element changes as a netlink batch encoded by [`netlink`]) and reads the table
//! back. The semantics are upstream's (`pkg/proxy/nftables/proxier.go`); the layout is not:
//! Services and endpoints live as set and map elements under a fixed handful of rules, so a
//! change costs the kernel work in proportion to the change (see `README.md`).

pub mod element;
pub mod layout;
pub mod names;
pub mod netlink;
pub mod planner;

pub use layout::{PlanConfig, Route, SetId};
pub use netlink::{ElementBatch, EncodedBatch, SetSchema};
pub use planner::{KernelTable, Mismatch, NodeContext, Planner, Transaction};
