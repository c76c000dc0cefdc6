//! Policy routing for the return path of transparent connections, over `NETLINK_ROUTE` with
//! `kp-netlink` (the messages of `ip rule` and `ip route`, built here).
//!
//! A connection the proxy opens from the client's address (`Source::Client`) gets its replies
//! addressed to that client, which is not a local address. The redirect table marks packets
//! of such sockets in mangle prerouting (`socket transparent 1 meta mark set MARK`), and these
//! two entries per family deliver them locally, to the transparent socket:
//!
//! ```text
//! ip rule add fwmark MARK lookup TABLE priority PRIORITY
//! ip route add local default dev lo table TABLE
//! ```

use kp_netlink::abi::{NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST};
use kp_netlink::{attr, message, Protocol, Socket};

use crate::Error;

// linux/rtnetlink.h
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_NEWRULE: u16 = 32;
const RTM_DELRULE: u16 = 33;
const RTN_LOCAL: u8 = 2;
const RT_SCOPE_HOST: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RTA_OIF: u16 = 4;
const RTA_TABLE: u16 = 15;
// linux/fib_rules.h
const FR_ACT_TO_TBL: u8 = 1;
const FRA_PRIORITY: u16 = 6;
const FRA_FWMARK: u16 = 10;
const FRA_TABLE: u16 = 15;
const FRA_FWMASK: u16 = 16;
// asm-generic/errno-base.h: what deleting a route that is not there answers.
const ESRCH: i32 = 3;
// linux/socket.h
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// The loopback device's index: always 1 in a network namespace.
const LOOPBACK_INDEX: u32 = 1;

/// The defaults: mark `0x4000_0000` (bit 30; the masquerade bit defaults to 14 and
/// Kubernetes' drop bit to 15), table and priority 27504 (`0x6b70`, "kp"), before `main`.
pub const DEFAULT: PolicyRouting = PolicyRouting {
    mark: 0x4000_0000,
    table: 0x6b70,
    priority: 0x6b70,
};

/// Where the return path lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyRouting {
    /// The firewall mark of packets for transparent sockets.
    pub mark: u32,
    /// The routing table holding the local default route.
    pub table: u32,
    /// The rule's priority: before `main` (32766).
    pub priority: u32,
}

impl PolicyRouting {
    /// Installs the rule and the route for both families; entries already there are kept.
    pub fn install(&self, netns: Option<&str>) -> Result<(), Error> {
        let mut s = open(netns)?;
        for family in [AF_INET, AF_INET6] {
            self.exchange(&mut s, family, true)?;
        }
        Ok(())
    }

    /// Removes the rules and the routes of both families; missing ones are fine.
    pub fn remove(&self, netns: Option<&str>) -> Result<(), Error> {
        let mut s = open(netns)?;
        for family in [AF_INET, AF_INET6] {
            self.exchange(&mut s, family, false)?;
        }
        Ok(())
    }

    fn exchange(&self, s: &mut Socket, family: u8, add: bool) -> Result<(), Error> {
        let flags = if add {
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
        } else {
            NLM_F_REQUEST | NLM_F_ACK
        };
        let rule_kind = if add { RTM_NEWRULE } else { RTM_DELRULE };
        let route_kind = if add { RTM_NEWROUTE } else { RTM_DELROUTE };
        // A rule added twice (by hand, or a crashed proxy's) would be deleted one at a time.
        let rounds = if add { 1 } else { 8 };
        for _ in 0..rounds {
            let done = tolerate(
                add,
                s.request(
                    |b, seq| self.rule(b, seq, rule_kind, flags, family),
                    |_| Ok(()),
                ),
                "rule",
            )?;
            if !done {
                break;
            }
        }
        tolerate(
            add,
            s.request(
                |b, seq| self.route(b, seq, route_kind, flags, family),
                |_| Ok(()),
            ),
            "route",
        )?;
        Ok(())
    }

    fn rule(&self, buf: &mut Vec<u8>, seq: u32, kind: u16, flags: u16, family: u8) {
        let m = message::begin(buf, kind, flags, seq);
        // struct fib_rule_hdr: family, dst_len, src_len, tos, table, res1, res2, action, flags.
        buf.extend_from_slice(&[family, 0, 0, 0, 0, 0, 0, FR_ACT_TO_TBL]);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        attr::put_u32(buf, FRA_PRIORITY, self.priority);
        attr::put_u32(buf, FRA_FWMARK, self.mark);
        attr::put_u32(buf, FRA_FWMASK, self.mark);
        attr::put_u32(buf, FRA_TABLE, self.table);
        message::end(buf, m);
    }

    fn route(&self, buf: &mut Vec<u8>, seq: u32, kind: u16, flags: u16, family: u8) {
        let m = message::begin(buf, kind, flags, seq);
        // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
        buf.extend_from_slice(&[family, 0, 0, 0, 0, RTPROT_BOOT, RT_SCOPE_HOST, RTN_LOCAL]);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        attr::put_u32(buf, RTA_TABLE, self.table);
        attr::put_u32(buf, RTA_OIF, LOOPBACK_INDEX);
        message::end(buf, m);
    }
}

fn open(netns: Option<&str>) -> Result<Socket, Error> {
    Socket::open(Protocol::Route, netns).map_err(|e| Error::Routing {
        op: "open a NETLINK_ROUTE socket".into(),
        detail: e.to_string(),
        errno: e.kernel(),
    })
}

/// Whether the request did something; an existing entry on add, or a missing one on delete,
/// is the state asked for.
fn tolerate(
    add: bool,
    r: Result<kp_netlink::socket::Answered, kp_netlink::socket::Error>,
    what: &str,
) -> Result<bool, Error> {
    match r {
        Ok(_) => Ok(true),
        Err(e) if add && e.kernel().is_some_and(|k| k.is_exists()) => Ok(false),
        // A missing rule is ENOENT, a missing route ESRCH.
        Err(e) if !add && (e.is_not_found() || e.kernel().is_some_and(|k| k.errno == ESRCH)) => {
            Ok(false)
        }
        Err(e) => Err(Error::Routing {
            op: format!(
                "{} the transparent return {what}",
                if add { "add" } else { "delete" }
            ),
            detail: e.to_string(),
            errno: e.kernel(),
        }),
    }
}
