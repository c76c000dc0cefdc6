//! The iptables dataplane (being written).
