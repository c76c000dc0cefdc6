//! The kernel's generic netlink numbers, under their UAPI names: framing (`linux/netlink.h`),
//! netfilter's nfnetlink (`linux/netfilter/nfnetlink.h`, `linux/netfilter.h`) and generic
//! netlink's controller (`linux/genetlink.h`). The numbers of one subsystem's messages and
//! attributes (nf_tables, ctnetlink, IPVS) stay with the crate that speaks it. Values are `u16`
//! for message and attribute types, as they go on the wire.
// The names are the kernel's; documenting each again would only repeat the header.
#![allow(missing_docs)]

// linux/netlink.h: protocols (the third argument of socket(AF_NETLINK, ...))
pub const NETLINK_ROUTE: isize = 0;
pub const NETLINK_NETFILTER: isize = 12;
pub const NETLINK_GENERIC: isize = 16;

// linux/netlink.h: struct nlmsghdr
pub const NLMSG_HDRLEN: usize = 16;
pub const NLMSG_NOOP: u16 = 1;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLMSG_OVERRUN: u16 = 4;
/// Message types below this are netlink's own (the four above); the rest are the protocol's.
pub const NLMSG_MIN_TYPE: u16 = 0x10;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_ECHO: u16 = 0x8;
pub const NLM_F_DUMP_INTR: u16 = 0x10;
pub const NLM_F_DUMP_FILTERED: u16 = 0x20;
pub const NLM_F_ROOT: u16 = 0x100;
pub const NLM_F_MATCH: u16 = 0x200;
pub const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;
pub const NLM_F_REPLACE: u16 = 0x100;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
// linux/netlink.h: struct nlattr
pub const NLA_HDRLEN: usize = 4;
pub const NLA_ALIGNTO: usize = 4;
pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_F_NET_BYTEORDER: u16 = 0x4000;
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

// linux/netfilter/nfnetlink.h: subsystem ids (the high byte of a message type)
pub const NFNL_SUBSYS_NONE: u8 = 0;
pub const NFNL_SUBSYS_CTNETLINK: u8 = 1;
pub const NFNL_SUBSYS_CTNETLINK_EXP: u8 = 2;
pub const NFNL_SUBSYS_QUEUE: u8 = 3;
pub const NFNL_SUBSYS_ULOG: u8 = 4;
pub const NFNL_SUBSYS_OSF: u8 = 5;
pub const NFNL_SUBSYS_IPSET: u8 = 6;
pub const NFNL_SUBSYS_ACCT: u8 = 7;
pub const NFNL_SUBSYS_CTNETLINK_TIMEOUT: u8 = 8;
pub const NFNL_SUBSYS_CTHELPER: u8 = 9;
pub const NFNL_SUBSYS_NFTABLES: u8 = 10;
pub const NFNL_SUBSYS_NFT_COMPAT: u8 = 11;
pub const NFNL_MSG_BATCH_BEGIN: u16 = NLMSG_MIN_TYPE;
pub const NFNL_MSG_BATCH_END: u16 = NLMSG_MIN_TYPE + 1;
pub const NFNETLINK_V0: u8 = 0;
/// `sizeof(struct nfgenmsg)`.
pub const NFGENMSG_LEN: usize = 4;

// linux/netfilter.h
pub const NFPROTO_UNSPEC: u8 = 0;
pub const NFPROTO_INET: u8 = 1;
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

// linux/genetlink.h
/// `sizeof(struct genlmsghdr)`.
pub const GENL_HDRLEN: usize = 4;
pub const GENL_ID_CTRL: u16 = NLMSG_MIN_TYPE;
pub const CTRL_CMD_NEWFAMILY: u8 = 1;
pub const CTRL_CMD_GETFAMILY: u8 = 3;
pub const CTRL_ATTR_FAMILY_ID: u16 = 1;
pub const CTRL_ATTR_FAMILY_NAME: u16 = 2;
pub const CTRL_ATTR_VERSION: u16 = 3;
pub const CTRL_ATTR_HDRSIZE: u16 = 4;
pub const CTRL_ATTR_MAXATTR: u16 = 5;
pub const CTRL_ATTR_OPS: u16 = 6;
pub const CTRL_ATTR_MCAST_GROUPS: u16 = 7;
pub const CTRL_ATTR_MCAST_GRP_NAME: u16 = 1;
pub const CTRL_ATTR_MCAST_GRP_ID: u16 = 2;

// asm-generic/errno-base.h and errno.h: the errnos kube-proxy-rs tells apart
pub const EPERM: i32 = 1;
pub const ENOENT: i32 = 2;
pub const ESRCH: i32 = 3;
pub const EINTR: i32 = 4;
pub const EIO: i32 = 5;
pub const E2BIG: i32 = 7;
pub const EBADF: i32 = 9;
pub const EAGAIN: i32 = 11;
pub const ENOMEM: i32 = 12;
pub const EACCES: i32 = 13;
pub const EFAULT: i32 = 14;
pub const EBUSY: i32 = 16;
pub const EEXIST: i32 = 17;
pub const ENODEV: i32 = 19;
pub const ENOTDIR: i32 = 20;
pub const EINVAL: i32 = 22;
pub const ENFILE: i32 = 23;
pub const EMFILE: i32 = 24;
pub const ENOSPC: i32 = 28;
pub const ERANGE: i32 = 34;
pub const ELOOP: i32 = 40;
pub const ENOMSG: i32 = 42;
pub const ENODATA: i32 = 61;
pub const EPROTO: i32 = 71;
pub const EMSGSIZE: i32 = 90;
pub const EPROTONOSUPPORT: i32 = 93;
pub const EOPNOTSUPP: i32 = 95;
pub const EAFNOSUPPORT: i32 = 97;
pub const ENOBUFS: i32 = 105;
pub const ETIMEDOUT: i32 = 110;
pub const ECANCELED: i32 = 125;

/// The kernel name of an errno of the list above.
pub(crate) fn errno_name(errno: i32) -> Option<&'static str> {
    Some(match errno {
        EPERM => "EPERM",
        ENOENT => "ENOENT",
        ESRCH => "ESRCH",
        EINTR => "EINTR",
        EIO => "EIO",
        E2BIG => "E2BIG",
        EBADF => "EBADF",
        EAGAIN => "EAGAIN",
        ENOMEM => "ENOMEM",
        EACCES => "EACCES",
        EFAULT => "EFAULT",
        EBUSY => "EBUSY",
        EEXIST => "EEXIST",
        ENODEV => "ENODEV",
        ENOTDIR => "ENOTDIR",
        EINVAL => "EINVAL",
        ENFILE => "ENFILE",
        EMFILE => "EMFILE",
        ENOSPC => "ENOSPC",
        ERANGE => "ERANGE",
        ELOOP => "ELOOP",
        ENOMSG => "ENOMSG",
        ENODATA => "ENODATA",
        EPROTO => "EPROTO",
        EMSGSIZE => "EMSGSIZE",
        EPROTONOSUPPORT => "EPROTONOSUPPORT",
        EOPNOTSUPP => "EOPNOTSUPP",
        EAFNOSUPPORT => "EAFNOSUPPORT",
        ENOBUFS => "ENOBUFS",
        ETIMEDOUT => "ETIMEDOUT",
        ECANCELED => "ECANCELED",
        _ => return None,
    })
}
