//! `chorus-perf allreduce --compress SPEC | --topk R | --sparse D`: compressed and sparse
//! allreduce against the dense allreduce of the same data, in one run.
//!
//! Columns: size and count (float32), the compressed call's time and algbw/busbw (computed on
//! the dense bytes, so they compare with the plain table), bytes this rank put on the wire
//! (mean over ranks), the compression ratio (dense ring bytes 2(p−1)/p·size over wire bytes),
//! the relative error ‖compressed − dense‖/‖dense‖ of a first call with a fresh compressor,
//! the dense allreduce's time on the same data and the speed-up over it. For `--sparse`, the
//! non-zeros per rank and of the result replace the ratio and error (the result is exact; any
//! difference from the dense sum is counted as wrong). The compressed and the dense calls are
//! timed one by one on a fresh copy of the input, after a barrier: the copy is not timed.

use std::time::{Duration, Instant};

use chorus::compress::{Compressor, CompressorSpec};
use chorus::sparse::{SparseAlgo, SparseResult, SparseVec};
use chorus::{CommError, Communicator, ReduceOp};

use crate::cli::{Options, Output};
use crate::report::{format_time_us, json_gap, json_number, json_string};

/// splitmix64's finaliser: a well-mixed hash of `x`.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A deterministic pseudo-normal value for element `i` of rank `rank` (sum of 4 uniforms,
/// centred): gradient-like data whose compression error means something.
fn value(rank: usize, i: usize) -> f32 {
    let base = ((rank as u64) << 40) ^ ((i as u64) << 2);
    let acc: f32 = (0..4)
        .map(|j| (mix(base + j) >> 40) as f32 / (1u64 << 24) as f32)
        .sum();
    (acc - 2.0) * 1.7
}

fn mean_over_ranks(comm: &mut Communicator, v: f64) -> Result<f64, Box<CommError>> {
    let mut t = [v];
    comm.all_reduce(&mut t, ReduceOp::Avg)?;
    Ok(t[0])
}

fn max_over_ranks(comm: &mut Communicator, v: f64) -> Result<f64, Box<CommError>> {
    let mut t = [v];
    comm.all_reduce(&mut t, ReduceOp::Max)?;
    Ok(t[0])
}

/// The time of `call` on a fresh copy of `input` each time (compression consumes its input,
/// and top-k leaves it sparse): the copy and a barrier come before each timed call, so only
/// the collective is timed. Mean per call, max over ranks. A `gap` (`--gap`) is slept before
/// the barrier of every timed call.
fn time_fresh(
    comm: &mut Communicator,
    input: &[f32],
    warmup: u64,
    iters: u64,
    gap: Option<Duration>,
    mut call: impl FnMut(&mut Communicator, &mut [f32]) -> Result<(), Box<CommError>>,
) -> Result<f64, Box<CommError>> {
    let mut work = input.to_vec();
    let mut total = 0.0;
    for i in 0..warmup + iters {
        work.copy_from_slice(input);
        if let Some(gap) = gap.filter(|_| i >= warmup) {
            std::thread::sleep(gap);
        }
        comm.barrier()?;
        let t0 = Instant::now();
        call(comm, &mut work)?;
        if i >= warmup {
            total += t0.elapsed().as_secs_f64();
        }
    }
    max_over_ranks(comm, total / iters.max(1) as f64)
}

/// The time of the plain allreduce of `input`, measured as the compressed call is.
fn time_dense(
    comm: &mut Communicator,
    input: &[f32],
    warmup: u64,
    iters: u64,
    gap: Option<Duration>,
) -> Result<f64, Box<CommError>> {
    time_fresh(comm, input, warmup, iters, gap, |c, w| {
        Ok(c.all_reduce(w, ReduceOp::Sum)?)
    })
}

struct Row {
    bytes: u64,
    count: u64,
    /// Timed calls.
    iters: u64,
    /// Wrong elements over the ranks (sparse mode with -c 1; a lossy result is not checked).
    wrong: Option<u64>,
    seconds: f64,
    wire: f64,
    third: f64,
    fourth: f64,
    dense_seconds: f64,
    /// Fraction of the result's elements that are non-zero.
    density: f64,
}

/// Run the compressed (`opts.compress`) or sparse (`opts.sparse`) benchmark on this rank.
/// Returns the number of wrong elements (sparse mode checks exactness).
pub fn run(comm: &mut Communicator, opts: &Options) -> Result<u64, Box<CommError>> {
    let (rank, p) = (comm.rank(), comm.size());
    let show = rank == 0;
    let json = opts.output == Output::Json;
    let sparse_algo = match &opts.sparse_algo {
        Some(n) => Some(n.parse::<SparseAlgo>().map_err(|_| {
            CommError::invalid(
                "chorus-perf",
                format!("--sparse-algo {n:?}: expected sparse_rd, dsar or two_phase"),
            )
        })?),
        None => None,
    };
    let spec = match &opts.compress {
        Some(s) => Some(
            CompressorSpec::parse(s)
                .map_err(|m| CommError::invalid("chorus-perf", format!("--compress {s:?}: {m}")))?,
        ),
        None => None,
    };
    let mode = match (&spec, opts.sparse) {
        (Some(s), _) => format!("compress {s}"),
        (None, Some(d)) => format!(
            "sparse density {d} algo {}",
            sparse_algo.map_or("auto", |a| a.name())
        ),
        _ => unreachable!("run only with --compress or --sparse"),
    };
    if show && !json {
        println!(
            "# chorus-perf allreduce {mode}: {p} ranks, transport {}, float32 sum{}",
            comm.transport_name(),
            opts.gap.map_or_else(String::new, |g| format!(
                ", {} ms gap before every timed call",
                g.as_secs_f64() * 1e3
            ))
        );
        let last: [&str; 4] = if spec.is_some() {
            ["ratio", "rel_err", "speedup", " density"]
        } else {
            ["nnz/rank", "result_nnz", "speedup", ""]
        };
        println!(
            "# {:>12} {:>12} {:>10} {:>8} {:>8} {:>12} {:>8} {:>10} {:>10} {:>8}{:>10}",
            "size",
            "count",
            "time(us)",
            "algbw",
            "busbw",
            "wire_B/rank",
            last[0],
            last[1],
            "dense(us)",
            last[2],
            last[3]
        );
    }
    let factor = 2.0 * (p as f64 - 1.0) / p as f64;
    let mut wrong_total = 0u64;
    for point in opts.grid.points(4) {
        let n = point.count as usize;
        let bytes = point.bytes;
        let (warmup, iters) = opts.iters.for_size(bytes);
        let input: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
        let row = if let Some(spec) = &spec {
            // Reference: the dense sum.
            let mut dense = input.clone();
            comm.all_reduce(&mut dense, ReduceOp::Sum)?;
            // Accuracy of one call with a fresh compressor.
            let mut comp = Compressor::from_spec(spec.clone());
            let mut out = input.clone();
            comm.all_reduce_compressed(&mut out, ReduceOp::Sum, &mut comp)?;
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for (a, b) in out.iter().zip(&dense) {
                num += ((a - b) as f64).powi(2);
                den += (*b as f64).powi(2);
            }
            let rel = if den > 0.0 { (num / den).sqrt() } else { 0.0 };
            let density = out.iter().filter(|v| **v != 0.0).count() as f64 / n.max(1) as f64;
            let rel = max_over_ranks(comm, rel)?;
            let mut wire = 0u64;
            let seconds = time_fresh(comm, &input, warmup, iters, opts.gap, |c, w| {
                let r = c.all_reduce_compressed(w, ReduceOp::Sum, &mut comp)?;
                wire = r.bytes_sent;
                Ok(())
            })?;
            let dense_seconds = time_dense(comm, &input, warmup, iters, opts.gap)?;
            let wire = mean_over_ranks(comm, wire as f64)?;
            let ratio = if wire > 0.0 {
                bytes as f64 * factor / wire
            } else {
                1.0
            };
            Row {
                bytes,
                count: n as u64,
                iters,
                wrong: None,
                seconds,
                wire,
                third: ratio,
                fourth: rel,
                dense_seconds,
                density,
            }
        } else {
            let density = opts.sparse.unwrap_or(0.0);
            let sv = random_sparse(rank, n, density);
            // The exact sum, made here from every rank's input (small integers: exact in
            // f32), not by the library under test.
            let mut dense = vec![0.0f32; n];
            for r in 0..p {
                let other = random_sparse(r, n, density);
                for (&i, &v) in other.indices.iter().zip(&other.values) {
                    dense[i as usize] += v;
                }
            }
            let (result, _) = comm.sparse_all_reduce_stats(&sv, sparse_algo)?;
            let (got, result_nnz) = match result {
                SparseResult::Dense(d) => {
                    let nnz = d.iter().filter(|v| **v != 0.0).count();
                    (d, nnz)
                }
                SparseResult::Sparse(s) => (s.to_dense(), s.nnz()),
            };
            let wrong = if opts.check {
                let here = got.iter().zip(&dense).filter(|(a, b)| a != b).count() as u64;
                // Over the ranks (the larger of the sum and of any one rank's count, both made
                // by the library; and this rank's own).
                let sum = (mean_over_ranks(comm, here as f64)? * p as f64).round() as u64;
                let most = max_over_ranks(comm, here as f64)? as u64;
                let wrong = sum.max(most).max(here);
                wrong_total += wrong;
                Some(wrong)
            } else {
                None
            };
            let mut sent = 0u64;
            // Timed as the dense baseline is: a barrier before each call, each on its own (the
            // sparse call leaves its input as it was: nothing to copy).
            let seconds = time_fresh(comm, &[], warmup, iters, opts.gap, |c, _| {
                let (_, s) = c.sparse_all_reduce_stats(&sv, sparse_algo)?;
                sent = s.bytes_sent;
                Ok(())
            })?;
            let dense_seconds = time_dense(comm, &sv.to_dense(), warmup, iters, opts.gap)?;
            let wire = mean_over_ranks(comm, sent as f64)?;
            Row {
                bytes,
                count: n as u64,
                iters,
                wrong,
                seconds,
                wire,
                third: sv.nnz() as f64,
                fourth: result_nnz as f64,
                dense_seconds,
                density: result_nnz as f64 / n.max(1) as f64,
            }
        };
        if show {
            print_row(
                &row,
                spec.is_some(),
                opts,
                &mode,
                p,
                factor,
                comm.transport_name(),
            );
        }
    }
    if show && !json && opts.sparse.is_some() {
        if opts.check {
            println!(
                "# Out of bounds values : {wrong_total} {}",
                if wrong_total == 0 { "OK" } else { "FAILED" }
            );
        } else {
            println!("# Out of bounds values : N/A");
        }
    }
    Ok(wrong_total)
}

fn print_row(
    r: &Row,
    compressed: bool,
    opts: &Options,
    mode: &str,
    p: usize,
    factor: f64,
    transport: &str,
) {
    let algbw = if r.seconds > 0.0 {
        r.bytes as f64 / r.seconds / 1e9
    } else {
        0.0
    };
    let speedup = if r.seconds > 0.0 {
        r.dense_seconds / r.seconds
    } else {
        0.0
    };
    if opts.output == Output::Json {
        let (k3, k4) = if compressed {
            ("ratio", "rel_err")
        } else {
            ("nnz_per_rank", "result_nnz")
        };
        // The fields of every chorus-perf JSON line first (a float32 sum; the compressed
        // call runs in place, the sparse one into a new result), then this mode's own.
        let algorithm = if compressed {
            "auto".to_string()
        } else {
            opts.sparse_algo
                .clone()
                .unwrap_or_else(|| "auto".to_string())
        };
        let wrong = r
            .wrong
            .map_or_else(|| "null".to_string(), |w| w.to_string());
        println!(
            "{{\"collective\":\"allreduce\",\"size\":{},\"count\":{},\"type\":{},\"op\":\"sum\",\"root\":-1,\"inplace\":{compressed},\"ranks\":{p},\"algorithm\":{},\"transport\":{},\"iters\":{},\"gap_ms\":{},\"time_us\":{},\"algbw\":{},\"busbw\":{},\"wrong\":{wrong},\"mode\":{},\"wire_bytes_per_rank\":{},\"{k3}\":{},\"{k4}\":{},\"dense_time_us\":{},\"speedup\":{},\"result_density\":{}}}",
            r.bytes,
            r.count,
            // As every other row names it (`DType::name`).
            json_string(chorus::DType::Float32.name()),
            json_string(&algorithm),
            json_string(transport),
            r.iters,
            json_gap(opts.gap),
            // (A NaN relative error, an overflowing codec's, is `null`: JSON has no NaN.)
            json_number(r.seconds * 1e6, 3),
            json_number(algbw, 6),
            json_number(algbw * factor, 6),
            json_string(mode),
            json_number(r.wire, 0),
            json_number(r.third, 6),
            json_number(r.fourth, 6),
            json_number(r.dense_seconds * 1e6, 3),
            json_number(speedup, 4),
            json_number(r.density, 6)
        );
        return;
    }
    let third = if compressed {
        format!("{:.2}", r.third)
    } else {
        format!("{:.0}", r.third)
    };
    let fourth = if compressed {
        format!("{:.2e}", r.fourth)
    } else {
        format!("{:.0}", r.fourth)
    };
    let density = if compressed {
        format!(" {:>9.4}", r.density)
    } else {
        String::new()
    };
    println!(
        "  {:>12} {:>12} {:>10} {:>8.2} {:>8.2} {:>12} {:>8} {:>10} {:>10} {:>8.2}{density}",
        r.bytes,
        r.count,
        format_time_us(r.seconds * 1e6),
        algbw,
        algbw * factor,
        format!("{:.0}", r.wire),
        third,
        fourth,
        format_time_us(r.dense_seconds * 1e6),
        speedup
    );
}

/// A random sparse vector of `n` elements with about `density·n` non-zeros at positions drawn
/// per rank, integer values (so the sum is exact).
fn random_sparse(rank: usize, n: usize, density: f64) -> SparseVec {
    let threshold = (density.clamp(0.0, 1.0) * (1u64 << 32) as f64) as u64;
    let mut idx = Vec::new();
    let mut vals = Vec::new();
    for i in 0..n {
        let h = mix(((rank as u64) << 40) ^ (i as u64) ^ 0x5bd1_e995) >> 32;
        if h < threshold {
            idx.push(i as u64);
            vals.push(((i + rank) % 7) as f32 + 1.0);
        }
    }
    SparseVec::new(n, idx, vals).expect("sorted, in range")
}
