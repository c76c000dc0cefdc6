//! Conntrack reconciliation (being written).
