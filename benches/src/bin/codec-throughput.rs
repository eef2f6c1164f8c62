//! Encode and decode throughput of the gradient codecs (one thread), in GB/s of f32 input:
//! the issue's goal is encode + decode ≥ 4 GB/s per core.
//!
//! ```sh
//! cargo run --release -p chorus-benches --bin codec-throughput -- [values] [chunk] [reps]
//! ```
//! Defaults: 4 Mi values (16 MiB, beyond the caches), chunk 1024, the best of 7 repetitions.

use std::hint::black_box;
use std::time::Instant;

use chorus_algorithms::compress::{Codec, Rng, DEFAULT_CHUNK};

fn arg(i: usize, default: usize) -> usize {
    match std::env::args().nth(i) {
        Some(s) => s.parse().unwrap_or_else(|_| {
            eprintln!("usage: codec-throughput [values] [chunk] [reps]; got {s:?}");
            std::process::exit(2)
        }),
        None => default,
    }
}

/// The best time in seconds of `reps` runs of `f`.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let n = arg(1, 4 << 20);
    let chunk = arg(2, DEFAULT_CHUNK).max(1);
    let reps = arg(3, 7);
    let mut rng = Rng::new(1, 0);
    // Gradient-like values: zero-mean, a spread of magnitudes.
    let x: Vec<f32> = (0..n)
        .map(|_| (rng.next_f32() - 0.5) * (1.0 + 8.0 * rng.next_f32()).powi(2))
        .collect();
    let gb = (4 * n) as f64 / 1e9;
    println!("{n} values, chunk {chunk}, best of {reps}; GB/s of f32 input");
    println!(
        "{:>13} {:>9} {:>9} {:>9} {:>11} {:>15}",
        "codec", "encode", "decode", "dec+add", "enc+dec", "bytes/value"
    );
    let only = std::env::var("CODEC").ok().and_then(|s| Codec::parse(&s));
    for codec in Codec::ALL
        .into_iter()
        .filter(|c| only.map_or(true, |o| o == *c))
    {
        let len = codec.encoded_len(n, chunk);
        let mut bytes = vec![0u8; len];
        let mut y = vec![0f32; n];
        let enc = best(reps, || {
            codec.encode(black_box(&x), chunk, &mut bytes, &mut rng);
        });
        let dec = best(reps, || {
            codec
                .decode(black_box(&bytes), chunk, &mut y)
                .expect("own encoding decodes");
        });
        let add = best(reps, || {
            codec
                .decode_add(black_box(&bytes), chunk, &mut y)
                .expect("own encoding decodes");
        });
        black_box(&y);
        println!(
            "{:>13} {:>9.2} {:>9.2} {:>9.2} {:>11.2} {:>15.3}",
            codec.name(),
            gb / enc,
            gb / dec,
            gb / add,
            gb / (enc + dec),
            len as f64 / n as f64
        );
    }
}
