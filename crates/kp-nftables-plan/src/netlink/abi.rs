//! The numbers of the kernel's netlink and nf_tables interface that kube-proxy-rs speaks: one
//! list for the encoder here, the reader in `kp-nftables` and the benchmark's probe. Names and
//! values are those of the Linux UAPI headers named above each group (`u16` for message types
//! and attribute types as they go on the wire).
// The names are the kernel's; documenting each again would only repeat the header.
#![allow(missing_docs)]

use kp_core::model::IpFamily;

// linux/netlink.h
pub const NLMSG_HDRLEN: usize = 16;
pub const NLMSG_NOOP: u16 = 1;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP_INTR: u16 = 0x10;
/// `NLM_F_ROOT | NLM_F_MATCH`.
pub const NLM_F_DUMP: u16 = 0x100 | 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLA_HDRLEN: usize = 4;
pub const NLA_F_NESTED: u16 = 0x8000;
/// Clears `NLA_F_NESTED | NLA_F_NET_BYTEORDER` from an attribute type.
pub const NLA_TYPE_MASK: u16 = !(0x8000 | 0x4000);

// linux/netfilter/nfnetlink.h
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub const NFNL_MSG_BATCH_END: u16 = 0x11;
pub const NFNETLINK_V0: u8 = 0;
/// `sizeof(struct nfgenmsg)`.
pub const NFGENMSG_LEN: usize = 4;

// linux/netfilter.h
pub const NFPROTO_UNSPEC: u8 = 0;
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;
pub const NF_DROP: i32 = 0;

// linux/netfilter/nf_tables.h: enum nf_tables_msg_types
pub const NFT_MSG_GETTABLE: u16 = 1;
pub const NFT_MSG_GETCHAIN: u16 = 4;
pub const NFT_MSG_GETRULE: u16 = 7;
pub const NFT_MSG_GETSET: u16 = 10;
pub const NFT_MSG_NEWSETELEM: u16 = 12;
pub const NFT_MSG_GETSETELEM: u16 = 13;
pub const NFT_MSG_DELSETELEM: u16 = 14;
pub const NFT_MSG_GETGEN: u16 = 16;
// enum nft_table_attributes
pub const NFTA_TABLE_NAME: u16 = 1;
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
