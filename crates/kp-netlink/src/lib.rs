//! Netlink for kube-proxy-rs: one pure bytes⇄types layer under one socket layer, as
//! rust-netlink splits `netlink-packet-*` from `netlink-sys`/`rtnetlink`.
//!
//! The pure part (always built; no sockets, no I/O, used by the planner crates): message framing
//! ([`message`]: `nlmsghdr`, splitting datagrams, telling `NLMSG_ERROR`/`NLMSG_DONE` and
//! `NLM_F_DUMP_INTR` apart), attributes with alignment and nesting ([`attr`]), nfnetlink's
//! `nfgenmsg` and batches ([`nfnl`]), generic netlink's `genlmsghdr` and the controller's family
//! lookup ([`genl`]), IPVS's services and destinations over generic netlink ([`ipvs`]), ipset's
//! element add and delete requests over nfnetlink ([`ipset`]), the
//! kernel's refusal as a typed errno ([`KernelError`]), and the kernel's numbers under their
//! UAPI names ([`abi`]).
//!
//! The socket part (feature `socket`): [`socket::Socket`] opens a `NETLINK_NETFILTER`,
//! `NETLINK_GENERIC` or `NETLINK_ROUTE` socket in the current network namespace or in a named one
//! ([`netns`]), and runs requests, dumps (retried while interrupted), pipelined acknowledged
//! requests and nfnetlink batches.
//!
//! What it leaves to others: the messages and attributes of each subsystem (nf_tables in
//! `kp-nftables-plan`/`kp-nftables`, ctnetlink in `kp-conntrack`; IPVS's few messages are here,
//! its client is `kp-ipvs`), and what an errno means to a caller (a missing table is a state, a missing permission a fault).
//! It mirrors no upstream file: upstream kube-proxy reaches netlink through
//! `github.com/vishvananda/netlink` and `knftables` (which runs `nft`).

pub mod abi;
pub mod attr;
mod error;
pub mod genl;
pub mod ipset;
pub mod ipvs;
pub mod message;
#[cfg(feature = "socket")]
pub mod netns;
pub mod nfnl;
#[cfg(feature = "socket")]
pub mod socket;

pub use error::{KernelError, Malformed};
pub use message::{messages, Control, Header, Message};
#[cfg(feature = "socket")]
pub use socket::{Protocol, Socket};

#[cfg(test)]
mod tests;
