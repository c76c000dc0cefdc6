//! kp-test (being written).
