//! Generic netlink (`NETLINK_GENERIC`): the `genlmsghdr` after `nlmsghdr`, and the controller's
//! `CTRL_CMD_GETFAMILY`, which turns a family name (`IPVS`) into the message type its requests
//! carry: `genl ctrl get name IPVS`.

use crate::abi::{
    CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME, CTRL_ATTR_HDRSIZE, CTRL_ATTR_MAXATTR,
    CTRL_ATTR_MCAST_GROUPS, CTRL_ATTR_MCAST_GRP_ID, CTRL_ATTR_MCAST_GRP_NAME, CTRL_ATTR_VERSION,
    CTRL_CMD_GETFAMILY, CTRL_CMD_NEWFAMILY, GENL_ID_CTRL, NLM_F_ACK, NLM_F_REQUEST,
};
use crate::attr;
use crate::message::{self, Message, Start};
use crate::Malformed;

/// `struct genlmsghdr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenlHeader {
    /// `cmd`: the family's command.
    pub cmd: u8,
    /// `version`: the family's interface version.
    pub version: u8,
}

impl GenlHeader {
    /// Appends the 4 bytes (`reserved` zero).
    pub fn emit(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&[self.cmd, self.version, 0, 0]);
    }

    /// Splits a message payload into its `genlmsghdr` and the attributes after it.
    pub fn parse(payload: &[u8]) -> Result<(GenlHeader, &[u8]), Malformed> {
        match payload {
            [cmd, version, _, _, rest @ ..] => Ok((
                GenlHeader {
                    cmd: *cmd,
                    version: *version,
                },
                rest,
            )),
            _ => Err("a reply without genlmsghdr".into()),
        }
    }
}

/// Starts a generic netlink request of family `family` (its resolved id): header and
/// `genlmsghdr`; append attributes, then [`message::end`]. `NLM_F_REQUEST` is added to `flags`.
pub fn begin(buf: &mut Vec<u8>, family: u16, flags: u16, seq: u32, header: GenlHeader) -> Start {
    let start = message::begin(buf, family, NLM_F_REQUEST | flags, seq);
    header.emit(buf);
    start
}

/// `genl ctrl get name NAME`: asks the controller for one family, with an acknowledgement.
pub fn get_family_request(buf: &mut Vec<u8>, seq: u32, name: &str) {
    let start = begin(
        buf,
        GENL_ID_CTRL,
        NLM_F_ACK,
        seq,
        GenlHeader {
            cmd: CTRL_CMD_GETFAMILY,
            version: 1,
        },
    );
    attr::put_str(buf, CTRL_ATTR_FAMILY_NAME, name);
    message::end(buf, start);
}

/// A generic netlink family as the controller describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    /// The message type of its requests (`CTRL_ATTR_FAMILY_ID`).
    pub id: u16,
    /// Its name.
    pub name: String,
    /// Its interface version.
    pub version: u32,
    /// The size of its own header after `genlmsghdr`.
    pub hdrsize: u32,
    /// Its highest attribute type.
    pub maxattr: u32,
    /// Its multicast groups: (name, id).
    pub mcast_groups: Vec<(String, u32)>,
}

/// Reads the controller's `CTRL_CMD_NEWFAMILY` answer to [`get_family_request`].
pub fn parse_family(msg: &Message<'_>) -> Result<Family, Malformed> {
    if msg.kind() != GENL_ID_CTRL {
        return Err(Malformed(format!(
            "message type {:#x} is not the controller's",
            msg.kind()
        )));
    }
    let (header, body) = GenlHeader::parse(msg.payload)?;
    if header.cmd != CTRL_CMD_NEWFAMILY {
        return Err(Malformed(format!(
            "controller command {} is not CTRL_CMD_NEWFAMILY",
            header.cmd
        )));
    }
    let a: [Option<&[u8]>; 8] = attr::table(body)?;
    let optional = |i: u16, what| {
        a[usize::from(i)]
            .map(|p| attr::u32_ne(Some(p), what))
            .transpose()
    };
    let mut mcast_groups = Vec::new();
    if let Some(groups) = a[usize::from(CTRL_ATTR_MCAST_GROUPS)] {
        for group in attr::attrs(groups) {
            let g: [Option<&[u8]>; 3] = attr::table(group?.payload)?;
            mcast_groups.push((
                attr::str(g[usize::from(CTRL_ATTR_MCAST_GRP_NAME)], "group name")?.to_string(),
                attr::u32_ne(g[usize::from(CTRL_ATTR_MCAST_GRP_ID)], "group id")?,
            ));
        }
    }
    Ok(Family {
        id: attr::u16_ne(a[usize::from(CTRL_ATTR_FAMILY_ID)], "family id")?,
        name: attr::str(a[usize::from(CTRL_ATTR_FAMILY_NAME)], "family name")?.to_string(),
        version: optional(CTRL_ATTR_VERSION, "family version")?.unwrap_or(0),
        hdrsize: optional(CTRL_ATTR_HDRSIZE, "family header size")?.unwrap_or(0),
        maxattr: optional(CTRL_ATTR_MAXATTR, "family maxattr")?.unwrap_or(0),
        mcast_groups,
    })
}
