//! kp-nftables-plan (being written).
