//! Times the manifest source's parsing, phase by phase, on one thread: the text's digest, the
//! YAML parser alone (every document skipped as `IgnoredAny`), decoding every object, and the
//! objects' digests. Prints the figures; asserts nothing about them.
//!
//! ```text
//! bench manifests --services 10000 --mode nftables --format yaml --out DIR
//! cargo run --release -p kp-source --example manifest_parse -- DIR [runs]
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kp_source::manifests::parse::{digest, for_each_object, split_yaml, text_digest};

/// A name and the options it stands for.
type Variant = (&'static str, fn() -> serde_saphyr::Options);

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: manifest_parse DIR [runs]"));
    let runs: usize = args.next().map_or(3, |r| r.parse().expect("runs"));
    let mut files: Vec<(PathBuf, String)> = std::fs::read_dir(&dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read");
            (p, text)
        })
        .collect();
    files.sort();
    let bytes: usize = files.iter().map(|(_, t)| t.len()).sum();
    println!(
        "{} files, {:.1} MB; one thread; best of {runs}",
        files.len(),
        bytes as f64 / 1e6
    );
    let mb = bytes as f64 / 1e6;
    let report = |what: &str, d: Duration| {
        println!(
            "  {what:<34} {:>8.1} ms  {:>6.1} MB/s",
            d.as_secs_f64() * 1e3,
            mb / d.as_secs_f64()
        );
    };
    let best = |f: &mut dyn FnMut() -> usize| {
        let mut best = Duration::MAX;
        let mut n = 0;
        for _ in 0..runs {
            let t = Instant::now();
            n = f();
            best = best.min(t.elapsed());
        }
        (best, n)
    };

    let (d, _) = best(&mut || {
        files
            .iter()
            .map(|(_, t)| text_digest(t)[0] as usize & 1)
            .sum()
    });
    report("text digests", d);

    let (d, docs) = best(&mut || {
        let mut docs = 0;
        for (_, text) in &files {
            for doc in split_yaml(text, 0) {
                let _: serde::de::IgnoredAny =
                    serde_saphyr::from_str(doc).expect("the YAML parses");
                docs += 1;
            }
        }
        docs
    });
    report(&format!("YAML parser alone ({docs} documents)"), d);

    let variants: [Variant; 3] = [
        (
            "  without budget",
            || serde_saphyr::options! { budget: None },
        ),
        ("  first key wins", || {
            serde_saphyr::options! {
                duplicate_keys: serde_saphyr::DuplicateKeyPolicy::FirstWins
            }
        }),
        ("  both", || {
            serde_saphyr::options! {
                budget: None,
                duplicate_keys: serde_saphyr::DuplicateKeyPolicy::FirstWins
            }
        }),
    ];
    for (name, options) in variants {
        let (d, _) = best(&mut || {
            let mut docs = 0;
            for (_, text) in &files {
                for doc in split_yaml(text, 0) {
                    let _: serde::de::IgnoredAny =
                        serde_saphyr::from_str_with_options(doc, options()).expect("parses");
                    docs += 1;
                }
            }
            docs
        });
        report(name, d);
    }

    let (d, objects) = best(&mut || {
        let mut n = 0;
        for (path, text) in &files {
            for_each_object(path, text, &mut |_| true, &mut |_, _| n += 1).expect("parses");
        }
        n
    });
    report(&format!("decode ({objects} objects)"), d);

    let (d, _) = best(&mut || {
        let mut n = 0;
        for (path, text) in &files {
            for_each_object(path, text, &mut |_| true, &mut |_, obj| {
                n += digest(&obj)[0] as usize & 1;
            })
            .expect("parses");
        }
        n
    });
    report("decode and digest", d);
}
