//! kp-serve (being written).
