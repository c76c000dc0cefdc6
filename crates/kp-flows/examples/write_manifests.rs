//! Prints the fixture as one JSON List (for manual runs: `> dir/cluster.json`).
fn main() {
    println!("{}", kp_flows::manifest_list());
}
