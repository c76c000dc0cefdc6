//! kube-proxy binary (being written).
mod config;
fn main() {}
