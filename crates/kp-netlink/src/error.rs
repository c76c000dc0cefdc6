//! The kernel's answer to a refused request, typed by errno, and the framing error.

use crate::abi::{self, errno_name};

/// The kernel refused a request: the errno of an `NLMSG_ERROR` (or of an `NLMSG_DONE` that ends
/// a dump with an error), positive as in `errno.h`. Match on [`errno`](Self::errno) or the
/// helpers, never on the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[error("{} ({})", self.errno_label(), self.description())]
pub struct KernelError {
    /// The errno (`ENOENT` is 2).
    pub errno: i32,
}

impl KernelError {
    /// The error of errno `errno` (positive).
    pub fn new(errno: i32) -> KernelError {
        KernelError { errno }
    }

    /// The errno's kernel name (`ENOENT`) for the errnos kube-proxy-rs meets; `None` for others.
    pub fn name(&self) -> Option<&'static str> {
        errno_name(self.errno)
    }

    /// The name, or `errno N` for an errno without one here.
    pub fn errno_label(&self) -> String {
        self.name()
            .map_or_else(|| format!("errno {}", self.errno), str::to_string)
    }

    /// The C library's description (`No such file or directory`).
    pub fn description(&self) -> String {
        let text = std::io::Error::from_raw_os_error(self.errno).to_string();
        // std appends " (os error N)"; the errno is said elsewhere.
        match text.rfind(" (os error ") {
            Some(at) => text[..at].to_string(),
            None => text,
        }
    }

    /// `ENOENT`: the table, set, element, entry or family does not exist.
    pub fn is_not_found(&self) -> bool {
        self.errno == abi::ENOENT
    }

    /// `EPERM` or `EACCES`: the process lacks `CAP_NET_ADMIN` (or the namespace's owner does).
    pub fn is_permission_denied(&self) -> bool {
        matches!(self.errno, abi::EPERM | abi::EACCES)
    }

    /// `EEXIST`: an exclusive create met an existing object.
    pub fn is_exists(&self) -> bool {
        self.errno == abi::EEXIST
    }

    /// `EINVAL` or `EOPNOTSUPP`: this kernel does not understand the request (an attribute it
    /// does not know, an operation it lacks).
    pub fn is_not_supported(&self) -> bool {
        matches!(self.errno, abi::EINVAL | abi::EOPNOTSUPP)
    }

    /// `EBUSY`, `EAGAIN`, `EINTR`, `ENOMEM` or `ENOBUFS`: worth trying again later.
    pub fn is_transient(&self) -> bool {
        matches!(
            self.errno,
            abi::EBUSY | abi::EAGAIN | abi::EINTR | abi::ENOMEM | abi::ENOBUFS
        )
    }
}

/// Bytes that are not the netlink message or attribute they should be: a bug here, or a kernel
/// that speaks a layout we do not know. Not retryable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

impl From<String> for Malformed {
    fn from(s: String) -> Self {
        Malformed(s)
    }
}

impl From<&str> for Malformed {
    fn from(s: &str) -> Self {
        Malformed(s.to_string())
    }
}

impl From<Malformed> for String {
    fn from(m: Malformed) -> Self {
        m.0
    }
}
