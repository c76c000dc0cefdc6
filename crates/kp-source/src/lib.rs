//! kp-source (being written).
