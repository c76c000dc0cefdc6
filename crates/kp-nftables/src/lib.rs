//! kp-nftables (being written).
