//! The numbers of the kernel's nf_tables interface that kube-proxy-rs speaks: one list for the
//! encoder here, the reader in `kp-nftables` and the benchmark's probe. Names and values are
//! those of the Linux UAPI headers named above each group (`u8` for message types within the
//! nf_tables subsystem, `u16` for attribute types as they go on the wire). Netlink's own numbers
//! (`NLMSG_*`, `NLM_F_*`, `NLA_*`, `NFNL_*`, `NFPROTO_*`) are in `kp_netlink::abi`.
// The names are the kernel's; documenting each again would only repeat the header.
#![allow(missing_docs)]

use kp_core::model::IpFamily;
use kp_netlink::abi::{NFPROTO_IPV4, NFPROTO_IPV6};

// linux/netfilter.h (the protocol families and the rest of netlink's generic numbers are
// `kp_netlink::abi`'s)
pub const NF_DROP: i32 = 0;

// linux/netfilter/nf_tables.h: enum nf_tables_msg_types
pub const NFT_MSG_GETTABLE: u8 = 1;
pub const NFT_MSG_GETCHAIN: u8 = 4;
pub const NFT_MSG_GETRULE: u8 = 7;
pub const NFT_MSG_GETSET: u8 = 10;
pub const NFT_MSG_NEWSETELEM: u8 = 12;
pub const NFT_MSG_GETSETELEM: u8 = 13;
pub const NFT_MSG_DELSETELEM: u8 = 14;
pub const NFT_MSG_GETGEN: u8 = 16;
// enum nft_table_attributes
pub const NFTA_TABLE_NAME: u16 = 1;
pub const NFTA_TABLE_USERDATA: u16 = 6;
// enum nft_chain_attributes
pub const NFTA_CHAIN_TABLE: u16 = 1;
pub const NFTA_CHAIN_NAME: u16 = 3;
// enum nft_rule_attributes
pub const NFTA_RULE_TABLE: u16 = 1;
pub const NFTA_RULE_CHAIN: u16 = 2;
pub const NFTA_RULE_USERDATA: u16 = 7;
// enum nft_set_attributes
pub const NFTA_SET_TABLE: u16 = 1;
pub const NFTA_SET_NAME: u16 = 2;
pub const NFTA_SET_FLAGS: u16 = 3;
pub const NFTA_SET_KEY_LEN: u16 = 5;
pub const NFTA_SET_DATA_TYPE: u16 = 6;
pub const NFTA_SET_DATA_LEN: u16 = 7;
/// The number of elements (Linux 6.16 and later).
pub const NFTA_SET_COUNT: u16 = 20;
// enum nft_set_flags
pub const NFT_SET_ANONYMOUS: u32 = 0x1;
pub const NFT_SET_INTERVAL: u32 = 0x4;
pub const NFT_SET_MAP: u32 = 0x8;
// enum nft_set_elem_list_attributes
pub const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
pub const NFTA_SET_ELEM_LIST_SET: u16 = 2;
pub const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
// enum nft_list_attributes
pub const NFTA_LIST_ELEM: u16 = 1;
// enum nft_set_elem_attributes
pub const NFTA_SET_ELEM_KEY: u16 = 1;
pub const NFTA_SET_ELEM_DATA: u16 = 2;
pub const NFTA_SET_ELEM_FLAGS: u16 = 3;
pub const NFTA_SET_ELEM_USERDATA: u16 = 6;
pub const NFTA_SET_ELEM_KEY_END: u16 = 10;
// enum nft_set_elem_flags
pub const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;
pub const NFT_SET_ELEM_CATCHALL: u32 = 0x2;
// enum nft_data_types
pub const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
// enum nft_data_attributes
pub const NFTA_DATA_VALUE: u16 = 1;
pub const NFTA_DATA_VERDICT: u16 = 2;
// enum nft_verdict_attributes
pub const NFTA_VERDICT_CODE: u16 = 1;
pub const NFTA_VERDICT_CHAIN: u16 = 2;
// enum nft_verdicts
pub const NFT_GOTO: i32 = -4;
// enum nft_gen_attributes
pub const NFTA_GEN_ID: u16 = 1;

/// The `nfgenmsg` family of a table of `family`.
pub fn nfproto(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => NFPROTO_IPV4,
        IpFamily::V6 => NFPROTO_IPV6,
    }
}
