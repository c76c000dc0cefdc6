//! Prints a cluster as one JSON `v1 List` for the manifest-directory source: the flow fixture,
//! or with `N PER` a synthetic cluster of N Services with PER endpoints each.
//!
//! `cargo run -p kp-flows --example write_manifests -- 10000 10 > dir/cluster.json`

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    match args.first() {
        None => println!("{}", kp_flows::manifest_list()),
        Some(&n) => {
            let per = args.get(1).copied().unwrap_or(10);
            println!(
                "{}",
                kp_flows::manifest_list_of(&kp_flows::synthetic::cluster(n, per))
            );
        }
    }
}
