//! Asks the kernel for a few elements of one nftables map by key (`NFT_MSG_GETSETELEM` without
//! the dump flag): what `nft get element ip kube-proxy MAP { KEY, … }` asks, without nft's cache
//! load, which lists every set first and takes 1.5 s at 10k Services. One request is answered in
//! tens of microseconds whatever the map's size, so the programming-latency probe can poll every
//! millisecond.
//!
//! Read-only. Message layouts are the kernel UAPI's (`linux/netfilter/nf_tables.h`), with the
//! constants of `kp_nftables_plan::netlink::abi`; framing and the socket are `kp-netlink`'s.

use std::time::Duration;

use kp_netlink::abi::{NFNL_SUBSYS_NFTABLES, NLM_F_ACK};
use kp_netlink::{attr, message, nfnl, Protocol, Socket};

pub use kp_netlink::abi::NFPROTO_IPV4;
use kp_nftables_plan::netlink::abi::*;

/// A NETLINK_NETFILTER socket in one network namespace.
pub struct ElementReader {
    socket: Socket,
}

/// One element as the kernel holds it: key bytes and, for a map, value bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawElement {
    /// The key, as concatenated registers.
    pub key: Vec<u8>,
    /// The value, for a map.
    pub value: Option<Vec<u8>>,
}

impl ElementReader {
    /// A reader for the namespace `/var/run/netns/NAME`. The socket is created by a short-lived
    /// thread that enters the namespace; the caller's threads stay where they are.
    pub fn open(netns: &str) -> anyhow::Result<ElementReader> {
        let socket = Socket::open(Protocol::Netfilter, Some(netns))?;
        socket.set_receive_timeout(Duration::from_secs(5))?;
        Ok(ElementReader { socket })
    }

    /// The elements of `set` in `table` (family `family`) with these keys. `Ok(None)` when the
    /// kernel has no such table, set, or one of the keys (ENOENT).
    pub fn get(
        &mut self,
        family: u8,
        table: &str,
        set: &str,
        keys: &[Vec<u8>],
    ) -> anyhow::Result<Option<Vec<RawElement>>> {
        let mut out = Vec::new();
        let r = self.socket.request(
            |buf, seq| encode(buf, family, seq, table, set, keys),
            |m| {
                let (_, body) = nfnl::NfGenMsg::parse(m.payload)?;
                parse_elements(body, &mut out)
            },
        );
        match r {
            Ok(_) => Ok(Some(out)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(anyhow::anyhow!("netlink get element {table} {set}: {e}")),
        }
    }
}

fn encode(buf: &mut Vec<u8>, family: u8, seq: u32, table: &str, set: &str, keys: &[Vec<u8>]) {
    let m = nfnl::begin(
        buf,
        NFNL_SUBSYS_NFTABLES,
        NFT_MSG_GETSETELEM,
        NLM_F_ACK,
        seq,
        family,
    );
    attr::put_str(buf, NFTA_SET_ELEM_LIST_TABLE, table);
    attr::put_str(buf, NFTA_SET_ELEM_LIST_SET, set);
    attr::put_nested(buf, NFTA_SET_ELEM_LIST_ELEMENTS, |list| {
        for key in keys {
            attr::put_nested(list, NFTA_LIST_ELEM, |el| {
                attr::put_nested(el, NFTA_SET_ELEM_KEY, |k| {
                    attr::put(k, NFTA_DATA_VALUE, key)
                });
            });
        }
    });
    message::end(buf, m);
}

fn data_value(nested: &[u8]) -> Result<Option<Vec<u8>>, kp_netlink::Malformed> {
    let d: [Option<&[u8]>; 2] = attr::table(nested)?;
    Ok(d[usize::from(NFTA_DATA_VALUE)].map(<[u8]>::to_vec))
}

fn parse_elements(body: &[u8], out: &mut Vec<RawElement>) -> Result<(), kp_netlink::Malformed> {
    let top: [Option<&[u8]>; 4] = attr::table(body)?;
    let Some(list) = top[usize::from(NFTA_SET_ELEM_LIST_ELEMENTS)] else {
        return Ok(());
    };
    for el in attr::attrs(list) {
        let el = el?;
        if el.kind != NFTA_LIST_ELEM {
            continue;
        }
        let a: [Option<&[u8]>; 3] = attr::table(el.payload)?;
        let key = match a[usize::from(NFTA_SET_ELEM_KEY)] {
            Some(k) => data_value(k)?,
            None => None,
        };
        let value = match a[usize::from(NFTA_SET_ELEM_DATA)] {
            Some(v) => data_value(v)?,
            None => None,
        };
        let key = key.ok_or("an element without a key")?;
        out.push(RawElement { key, value });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_netlink::abi::{NFGENMSG_LEN, NLMSG_HDRLEN};

    fn attrs(b: &[u8]) -> Vec<(u16, Vec<u8>)> {
        attr::attrs(b)
            .map(|a| a.map(|a| (a.kind, a.payload.to_vec())))
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn a_request_nests_each_key_in_its_own_list_element() {
        let mut msg = Vec::new();
        encode(
            &mut msg,
            NFPROTO_IPV4,
            7,
            "t",
            "m",
            &[vec![1, 2, 3, 4], vec![5, 6, 7, 8]],
        );
        assert_eq!(
            msg.len() as u32,
            u32::from_ne_bytes(msg[0..4].try_into().unwrap())
        );
        assert_eq!(u16::from_ne_bytes([msg[4], msg[5]]), (10 << 8) | 13);
        let body = &msg[NLMSG_HDRLEN + NFGENMSG_LEN..];
        let top = attrs(body);
        assert_eq!(top[0], (NFTA_SET_ELEM_LIST_TABLE, b"t\0".to_vec()));
        assert_eq!(top[1], (NFTA_SET_ELEM_LIST_SET, b"m\0".to_vec()));
        let keys: Vec<Vec<u8>> = attrs(&top[2].1)
            .into_iter()
            .map(|(k, el)| {
                assert_eq!(k, NFTA_LIST_ELEM);
                let (k, key) = attrs(&el).remove(0);
                assert_eq!(k, NFTA_SET_ELEM_KEY);
                data_value(&key).unwrap().unwrap()
            })
            .collect();
        assert_eq!(keys, vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
    }

    #[test]
    fn a_reply_element_yields_its_key_and_value() {
        let mut body = Vec::new();
        attr::put_nested(&mut body, NFTA_SET_ELEM_LIST_ELEMENTS, |list| {
            attr::put_nested(list, NFTA_LIST_ELEM, |el| {
                attr::put_nested(el, NFTA_SET_ELEM_KEY, |k| {
                    attr::put(k, NFTA_DATA_VALUE, &[9; 16])
                });
                attr::put_nested(el, NFTA_SET_ELEM_DATA, |d| {
                    attr::put(d, NFTA_DATA_VALUE, &[1; 8])
                });
            });
        });
        let mut out = Vec::new();
        parse_elements(&body, &mut out).unwrap();
        assert_eq!(
            out,
            vec![RawElement {
                key: vec![9; 16],
                value: Some(vec![1; 8])
            }]
        );
    }
}
