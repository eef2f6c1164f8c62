//! Top-k selection throughput (one thread), in GB/s of f32 input, against one pass over the
//! same memory: a copy and a sum. The goal is selection at about the speed of one pass.
//!
//! ```sh
//! cargo run --release -p chorus-benches --bin topk-throughput -- [values] [reps]
//! ```
//! Defaults: 16 Mi values (64 MiB, beyond the caches), the median of 7 repetitions. Each
//! repetition selects from a different vector of the same distribution, as successive
//! gradients: the sampled selection reuses and corrects its threshold from the previous one.
//!
//! Rows: `memcpy` (copy into another buffer), `sum` (read once), `topk_exact` (partition of
//! every magnitude), `sampled` (threshold estimate, one pass, exact result),
//! `sampled+ef` (`residual += g; g = 0` fused with the pass: error feedback's whole local
//! work). Every selection is checked against `topk_exact`.

use std::hint::black_box;
use std::time::Instant;

use chorus_algorithms::sparse::{topk_exact, ThresholdEstimator};

fn arg(i: usize, default: usize) -> usize {
    match std::env::args().nth(i) {
        Some(s) => s.parse().unwrap_or_else(|_| {
            eprintln!("usage: topk-throughput [values] [reps]; got {s:?}");
            std::process::exit(2)
        }),
        None => default,
    }
}

/// Gradient-like vectors: zero-mean, a spread of magnitudes, a different one per `seed`.
fn vector(n: usize, seed: u64) -> Vec<f32> {
    // splitmix64
    let mut s = seed;
    let mut next = move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|_| (next() - 0.5) * (1.0 + 8.0 * next()).powi(2))
        .collect()
}

/// The median time in seconds of `reps` runs of `f(rep)`.
fn median(reps: usize, mut f: impl FnMut(usize)) -> f64 {
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|r| {
            let start = Instant::now();
            f(r);
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let n = arg(1, 16 << 20);
    let reps = arg(2, 7);
    let inputs: Vec<Vec<f32>> = (0..3).map(|s| vector(n, s + 1)).collect();
    let gb = (4 * n) as f64 / 1e9;
    println!(
        "{n} values ({:.0} MiB), median of {reps}; GB/s of f32 input",
        gb * 1e9 / (1 << 20) as f64
    );
    let mut dst = vec![0f32; n];
    let copy = median(reps, |r| dst.copy_from_slice(black_box(&inputs[r % 3])));
    let sum = median(reps, |r| {
        // Eight accumulators so the loop vectorises.
        let mut acc = [0f32; 8];
        for c in inputs[r % 3].chunks_exact(8) {
            for (a, x) in acc.iter_mut().zip(c) {
                *a += x;
            }
        }
        black_box(acc);
    });
    println!("{:>8} {:>7.2}", "memcpy", gb / copy);
    println!("{:>8} {:>7.2}", "sum", gb / sum);
    println!(
        "{:>8} {:>7} {:>8} {:>10} {:>12} {:>7}",
        "k/n", "exact", "sampled", "sampled+ef", "candidates/k", "passes"
    );
    for ratio in [0.01, 0.001] {
        let k = chorus_algorithms::sparse::topk::k_of(ratio, n);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let exact = median(reps, |r| topk_exact(black_box(&inputs[r % 3]), k, &mut a));
        // Untimed: the first (sampled) guess, then a check on every input.
        let mut est = ThresholdEstimator::default();
        let mut wrong = 0;
        for x in inputs.iter().chain(&inputs) {
            est.select(x, k, &mut b);
            topk_exact(x, k, &mut a);
            wrong += (a != b) as usize;
        }
        let sampled = median(reps, |r| est.select(black_box(&inputs[r % 3]), k, &mut b));
        let (cand, passes) = (est.last_candidates(), est.last_passes());
        // Error feedback: data is zeroed by the pass, so refill it outside the timing.
        let mut residual = vec![0f32; n];
        let mut data = inputs[0].clone();
        let mut ef = ThresholdEstimator::default();
        ef.select_accumulate(&mut data, &mut residual, k, &mut b);
        let mut times = Vec::new();
        for r in 0..reps.max(1) {
            data.copy_from_slice(&inputs[r % 3]);
            for &i in &b {
                residual[i as usize] = 0.0;
            }
            let start = Instant::now();
            ef.select_accumulate(black_box(&mut data), &mut residual, k, &mut b);
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let ef_t = times[times.len() / 2];
        let (ef_cand, ef_passes) = (ef.last_candidates(), ef.last_passes());
        println!(
            "{:>8} {:>7.2} {:>8.2} {:>10.2} {:>5.2} {:>5.2}    {} {}",
            ratio,
            gb / exact,
            gb / sampled,
            gb / ef_t,
            cand as f64 / k as f64,
            ef_cand as f64 / k as f64,
            passes,
            ef_passes
        );
        if wrong > 0 {
            eprintln!("topk-throughput: sampled selection differed from topk_exact {wrong} times");
            std::process::exit(1);
        }
    }
}
