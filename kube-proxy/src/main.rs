//! kube-proxy binary (being written).
fn main() {}
