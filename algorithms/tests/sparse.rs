//! Sparse allreduce and top-k allreduce over the in-memory transport: every schedule against
//! the dense sum (integer values, exact) for ranks × densities × index patterns; the two-phase
//! top-k's wire bytes against Ok-Topk's bound; top-k and error feedback against a reference
//! computed here; and ranks that disagree, or send garbage, failing everywhere.

mod support;

use std::time::{Duration, Instant};

use chorus_algorithms::sparse::{
    self, topk_all_reduce, SparseAlgo, SparseResult, SparseVec, TopkOptions, TopkState, TopkStats,
};
use chorus_algorithms::{CollCtx, ReduceOp};
use chorus_transport::{AbortNotice, Transport, TransportError};
use support::{mem, run_group};

const RANKS: [usize; 7] = [1, 2, 3, 4, 5, 7, 8];
const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// Every rank has entries at the same positions.
    Identical,
    /// Rank r only at positions ≡ r (mod p).
    Disjoint,
    /// Each rank its own random positions.
    Random,
}

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
}

/// `m` distinct elements of `pool`, sorted, chosen by `seed`.
fn pick(mut pool: Vec<u64>, m: usize, seed: u64) -> Vec<u64> {
    let mut rng = Rng::new(seed);
    let m = m.min(pool.len());
    for i in 0..m {
        let j = i + rng.below(pool.len() - i);
        pool.swap(i, j);
    }
    pool.truncate(m);
    pool.sort_unstable();
    pool
}

/// Rank `rank`'s input: about `density·n` entries placed by `pattern`, small non-zero
/// integer values (sums are exact in any order).
fn input(rank: usize, p: usize, n: usize, density: f64, pattern: Pattern, seed: u64) -> SparseVec {
    let m = (density * n as f64).round() as usize;
    let indices = match pattern {
        Pattern::Identical => pick((0..n as u64).collect(), m, seed),
        Pattern::Disjoint => pick(
            (rank as u64..n as u64).step_by(p).collect(),
            m,
            seed + rank as u64,
        ),
        Pattern::Random => pick((0..n as u64).collect(), m, seed * 31 + rank as u64 + 1),
    };
    let values = indices
        .iter()
        .map(|&i| {
            let v = ((rank as u64 * 7 + i * 13) % 19) as f32 - 9.0;
            if v == 0.0 {
                10.0
            } else {
                v
            }
        })
        .collect();
    SparseVec::new(n, indices, values).expect("valid input")
}

fn ctx<'a>(t: &'a mut dyn Transport, scratch: &'a mut Vec<u8>, seq: u64) -> CollCtx<'a> {
    CollCtx {
        transport: t,
        deadline: Instant::now() + TIMEOUT,
        tag_base: seq << 16,
        scratch,
    }
}

/// What the communicator does on a non-recoverable error: tell the peers.
fn abort_on_error<T>(
    t: &mut dyn Transport,
    r: Result<T, TransportError>,
) -> Result<T, TransportError> {
    if let Err(e) = &r {
        if !e.is_recoverable() {
            t.abort(&AbortNotice {
                culprit: e.culprit(),
                reason: e.to_string(),
            });
        }
    }
    r
}

const DENSITIES: [f64; 5] = [0.0, 0.001, 0.01, 0.3, 1.0];
const PATTERNS: [Pattern; 3] = [Pattern::Identical, Pattern::Disjoint, Pattern::Random];

fn bits(r: &SparseResult) -> (bool, Vec<u32>) {
    (
        matches!(r, SparseResult::Dense(_)),
        r.to_dense().iter().map(|x| x.to_bits()).collect(),
    )
}

#[test]
fn sparse_all_reduce_equals_the_dense_sum() {
    let n = 3000;
    for p in RANKS {
        let cases: Vec<(SparseAlgo, f64, Pattern)> = SparseAlgo::ALL
            .into_iter()
            .flat_map(|a| {
                DENSITIES
                    .into_iter()
                    .flat_map(move |d| PATTERNS.map(|pt| (a, d, pt)))
            })
            .collect();
        let results = run_group(mem::group(p, 1 << 16, 4096), |rank, t| {
            let mut scratch = Vec::new();
            cases
                .iter()
                .enumerate()
                .map(|(seq, &(algo, d, pt))| {
                    let x = input(rank, p, n, d, pt, seq as u64);
                    let mut c = ctx(t, &mut scratch, seq as u64);
                    let r = sparse::sparse_all_reduce(&mut c, &x, algo);
                    abort_on_error(t, r)
                        .unwrap_or_else(|e| panic!("p={p} rank {rank} {algo} {d} {pt:?}: {e}"))
                })
                .collect::<Vec<_>>()
        });
        for (k, &(algo, d, pt)) in cases.iter().enumerate() {
            let what = format!("p={p} {algo} density {d} {pt:?}");
            let mut want = vec![0f32; n];
            for r in 0..p {
                let x = input(r, p, n, d, pt, k as u64);
                for (&i, &v) in x.indices.iter().zip(&x.values) {
                    want[i as usize] += v;
                }
            }
            let (ref0, _) = &results[0][k];
            assert_eq!(ref0.to_dense(), want, "{what}");
            assert_eq!(ref0.len(), n);
            // Dense exactly where the byte rule says the union filled in.
            if d == 1.0 {
                assert!(matches!(ref0, SparseResult::Dense(_)), "{what}");
            }
            if d <= 0.01 && !(p == 1 && d == 0.0) {
                assert!(matches!(ref0, SparseResult::Sparse(_)), "{what}");
            }
            for (r, rank) in results.iter().enumerate().skip(1) {
                assert_eq!(
                    bits(&rank[k].0),
                    bits(ref0),
                    "{what}: rank {r} differs from rank 0"
                );
            }
            if p == 1 {
                assert_eq!(
                    results[0][k].1,
                    Default::default(),
                    "{what}: one rank sends nothing"
                );
            }
        }
    }
}

/// Every rank ends with the same bits also where the order of a sum shows in them, NaNs of
/// different payloads (one per rank) and −0 at shared positions, while the running sums stay
/// sparse (the dense merges add in place, each side in its own order: see `merge_in`).
#[test]
fn every_rank_ends_with_the_same_bits_where_order_shows() {
    let n = 600;
    for p in [2usize, 3, 4, 5, 8] {
        // (density of even ranks, of odd ranks): low enough to stay sparse, and high enough
        // that running sums go dense (NaN payloads and zero signs then settled at the end).
        let cases: Vec<(SparseAlgo, f64, f64)> = SparseAlgo::ALL
            .into_iter()
            .flat_map(|a| {
                [
                    (a, 0.005, 0.005),
                    (a, 0.01, 0.02),
                    (a, 0.6, 0.6),
                    (a, 0.9, 0.05),
                ]
            })
            .collect();
        let results = run_group(mem::group(p, 1 << 16, 4096), |rank, t| {
            let mut scratch = Vec::new();
            cases
                .iter()
                .enumerate()
                .map(|(seq, &(algo, even, odd))| {
                    let d = if rank % 2 == 0 { even } else { odd };
                    let m = (d * n as f64).round() as usize;
                    // Positions 0.. shared by every rank, then this rank's own.
                    let mut indices: Vec<u64> = (0..6).collect();
                    indices.extend(pick(
                        (6..n as u64).collect(),
                        m,
                        seq as u64 * 7 + rank as u64,
                    ));
                    indices.sort_unstable();
                    indices.dedup();
                    let values = indices
                        .iter()
                        .map(|&i| match i {
                            0..=3 => f32::from_bits(0x7fc0_0000 | (rank as u32 + 1)),
                            4 | 5 => -0.0,
                            _ => 1.0 + i as f32,
                        })
                        .collect();
                    let x = SparseVec::new(n, indices, values).expect("valid input");
                    let mut c = ctx(t, &mut scratch, seq as u64);
                    let r = sparse::sparse_all_reduce(&mut c, &x, algo);
                    let (r, _) = abort_on_error(t, r)
                        .unwrap_or_else(|e| panic!("p={p} rank {rank} {algo}: {e}"));
                    bits(&r)
                })
                .collect::<Vec<_>>()
        });
        for (k, &(algo, even, odd)) in cases.iter().enumerate() {
            for (r, rank) in results.iter().enumerate().skip(1) {
                assert_eq!(
                    rank[k], results[0][k],
                    "p={p} {algo} densities {even}/{odd}: rank {r} differs from rank 0: {:x?} vs {:x?}", &rank[k].1[..6], &results[0][k].1[..6]
                );
            }
        }
    }
}

#[test]
fn empty_tiny_and_huge_vectors() {
    // Lengths 0, 1, 2 (every entry present on some ranks), and 2³³ (u64 indices in the
    // recursive-doubling stream; receive buffers sized by the entries, not by n).
    for p in [1usize, 3, 4] {
        let ns = [0usize, 1, 2, 1 << 33];
        let cases: Vec<(SparseAlgo, usize)> = SparseAlgo::ALL
            .into_iter()
            .flat_map(|a| ns.map(|n| (a, n)))
            .collect();
        let results = run_group(mem::group(p, 1 << 16, 4096), |rank, t| {
            let mut scratch = Vec::new();
            let mut out = Vec::new();
            for (seq, &(algo, n)) in cases.iter().enumerate() {
                let x = tiny_input(rank, n);
                let r = sparse::sparse_all_reduce(&mut ctx(t, &mut scratch, seq as u64), &x, algo);
                let r = abort_on_error(t, r);
                out.push(r.unwrap_or_else(|e| panic!("{algo} n={n} p={p}: {e}")).0);
                // Top-k of small dense vectors.
                if n <= 2 {
                    let mut data: Vec<f32> = (0..n).map(|i| (i + rank + 1) as f32).collect();
                    let opts = TopkOptions {
                        ratio: 0.5,
                        algo,
                        ..TopkOptions::default()
                    };
                    let mut c = ctx(t, &mut scratch, (seq + 100) as u64);
                    let mut st = TopkState::default();
                    let r = topk_all_reduce(&mut c, &mut data, ReduceOp::Sum, &opts, &mut st);
                    let s =
                        abort_on_error(t, r).unwrap_or_else(|e| panic!("topk {algo} n={n}: {e}"));
                    assert_eq!(s.k, n.div_ceil(2));
                    assert_eq!(data.iter().filter(|&&x| x != 0.0).count(), s.result_nnz);
                }
            }
            (out, scratch.len())
        });
        for (k, &(algo, n)) in cases.iter().enumerate() {
            let mut want: Vec<(u64, f32)> = Vec::new();
            for r in 0..p {
                let x = tiny_input(r, n);
                for (&i, &v) in x.indices.iter().zip(&x.values) {
                    match want.iter_mut().find(|e| e.0 == i) {
                        Some(e) => e.1 += v,
                        None => want.push((i, v)),
                    }
                }
            }
            want.sort_by_key(|e| e.0);
            for (r, (res, _)) in results.iter().enumerate() {
                let got: Vec<(u64, f32)> = match &res[k] {
                    SparseResult::Sparse(v) => v
                        .indices
                        .iter()
                        .copied()
                        .zip(v.values.iter().copied())
                        .collect(),
                    SparseResult::Dense(d) => d
                        .iter()
                        .enumerate()
                        .filter(|e| *e.1 != 0.0)
                        .map(|(i, &v)| (i as u64, v))
                        .collect(),
                };
                assert_eq!(got, want, "{algo} n={n} p={p} rank {r}");
                assert_eq!(res[k].len(), n);
            }
        }
        for (r, (_, scratch)) in results.iter().enumerate() {
            assert!(
                *scratch < 1 << 20,
                "p={p} rank {r}: {scratch} bytes of scratch"
            );
        }
    }
}

#[test]
fn split_allgather_sizes_its_receives_by_what_arrives() {
    // A vector of 2³³ positions, 10 000 entries a rank, all in region 0: the regions' sums
    // together hold at most 80 000 entries (640 KB encoded), but sized one by one, for
    // p times the largest count each, the 7 receives of the allgather asked for 7 times that.
    const P: usize = 8;
    const EACH: u64 = 10_000;
    let n = 1usize << 33;
    let results = run_group(mem::group(P, 1 << 16, 4096), |rank, t| {
        let mut scratch = Vec::new();
        let first = rank as u64 * EACH;
        let x = SparseVec::new(
            n,
            (first..first + EACH).collect(),
            (0..EACH).map(|i| (i % 7 + 1) as f32).collect(),
        )
        .unwrap();
        let r =
            sparse::sparse_all_reduce(&mut ctx(t, &mut scratch, 1), &x, SparseAlgo::SplitAllgather);
        let r = abort_on_error(t, r)
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
            .0;
        (r, scratch.len())
    });
    let union = P as u64 * EACH;
    for (rank, (r, scratch)) in results.iter().enumerate() {
        let SparseResult::Sparse(v) = r else {
            panic!("rank {rank}: a dense result of 2^33 positions")
        };
        assert_eq!(v.indices, (0..union).collect::<Vec<_>>(), "rank {rank}");
        assert!(v
            .values
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i as u64 % EACH % 7 + 1) as f32));
        // Step 1 takes up to 7 x 10 000 entries; the allgather's receives at most the union
        // (80 000 entries of 4-byte indices and values), not 7 x 80 000; scratch grows by
        // doubling.
        let most = 2 * ((union as usize) * 8 + 64 * P);
        assert!(
            *scratch <= most,
            "rank {rank}: {scratch} bytes of scratch, {most} at most"
        );
    }
}

#[test]
fn over_tcp() {
    // Real sockets: messages shorter than the receive buffers posted for them, several
    // messages in flight to every peer at once.
    let n = 20_000;
    for p in [3usize, 4] {
        let group = chorus_transport::tcp::local_group(p).expect("loopback group");
        let cases: Vec<(SparseAlgo, f64)> = SparseAlgo::ALL
            .into_iter()
            .flat_map(|a| [0.01, 1.0].map(|d| (a, d)))
            .collect();
        let results = run_group(group, |rank, t| {
            let mut scratch = Vec::new();
            let mut out = Vec::new();
            for (seq, &(algo, d)) in cases.iter().enumerate() {
                let x = input(rank, p, n, d, Pattern::Random, seq as u64);
                let r = sparse::sparse_all_reduce(&mut ctx(t, &mut scratch, seq as u64), &x, algo);
                out.push(
                    abort_on_error(t, r)
                        .unwrap_or_else(|e| panic!("{algo} {d}: {e}"))
                        .0,
                );
            }
            let mut st = TopkState::default();
            for step in 0..3u64 {
                let mut data = gradient(rank, step, n, false);
                let opts = TopkOptions::default();
                let r = topk_all_reduce(
                    &mut ctx(t, &mut scratch, 100 + step),
                    &mut data,
                    ReduceOp::Avg,
                    &opts,
                    &mut st,
                );
                abort_on_error(t, r).unwrap_or_else(|e| panic!("topk step {step}: {e}"));
                out.push(SparseResult::Dense(data));
            }
            out
        });
        for (k, &(algo, d)) in cases.iter().enumerate() {
            let mut want = vec![0f32; n];
            for r in 0..p {
                let x = input(r, p, n, d, Pattern::Random, k as u64);
                for (&i, &v) in x.indices.iter().zip(&x.values) {
                    want[i as usize] += v;
                }
            }
            assert_eq!(results[0][k].to_dense(), want, "{algo} {d} p={p}");
        }
        for (r, rank) in results.iter().enumerate().skip(1) {
            for (k, res) in rank.iter().enumerate() {
                assert_eq!(
                    bits(res),
                    bits(&results[0][k]),
                    "p={p} case {k}: rank {r} differs"
                );
            }
        }
    }
}

/// A few entries at both ends of `0..n`, overlapping between ranks.
fn tiny_input(rank: usize, n: usize) -> SparseVec {
    let mut idx: Vec<u64> = [
        0,
        rank as u64,
        n as u64 / 2,
        (n as u64).wrapping_sub(1 + rank.min(1) as u64),
    ]
    .into_iter()
    .filter(|&i| i < n as u64)
    .collect();
    idx.sort_unstable();
    idx.dedup();
    let vals = idx
        .iter()
        .map(|&i| (i % 5) as f32 + rank as f32 + 1.0)
        .collect();
    SparseVec::new(n, idx, vals).expect("valid")
}

/// Gradients of rank `rank` at `step`: a smooth random field, different per rank and step.
fn gradient(rank: usize, step: u64, n: usize, integer: bool) -> Vec<f32> {
    let mut rng = Rng::new(1000 * step + rank as u64 + 7);
    (0..n)
        .map(|_| {
            let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let v = (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let x = u * v * 4.0 + u * 0.1;
            if integer {
                (x * 40.0).round()
            } else {
                x
            }
        })
        .collect()
}

/// Per rank, per step: the result, the residual afterwards, the stats.
type TopkRun = Vec<Vec<(Vec<f32>, Vec<f32>, TopkStats)>>;

fn run_topk(
    p: usize,
    n: usize,
    steps: u64,
    op: ReduceOp,
    opts: TopkOptions,
    integer: bool,
) -> TopkRun {
    run_group(mem::group(p, 1 << 18, 16384), |rank, t| {
        let mut scratch = Vec::new();
        let mut state = TopkState::default();
        (0..steps)
            .map(|step| {
                let mut data = gradient(rank, step, n, integer);
                let mut c = ctx(t, &mut scratch, step);
                let r = topk_all_reduce(&mut c, &mut data, op, &opts, &mut state);
                let stats =
                    abort_on_error(t, r).unwrap_or_else(|e| panic!("rank {rank} step {step}: {e}"));
                (data, state.residual.clone(), stats)
            })
            .collect()
    })
}

#[test]
fn two_phase_topk_moves_at_most_6k_words() {
    let n = 1 << 20;
    let opts = TopkOptions::default();
    for p in [2usize, 4, 8] {
        let steps = 4;
        let out = run_topk(p, n, steps, ReduceOp::Sum, opts, false);
        let k = out[0][0].2.k;
        assert_eq!(k, n.div_ceil(100));
        let bound_words = 6.0 * k as f64 * (p - 1) as f64 / p as f64;
        // Headers: one segment per message of the three rounds. Control: the small
        // recursive-doubling allreduces (bounds, counts, four histogram digits of 256
        // u64), each sending at most log₂p + 1 messages.
        let rounds = (p.ilog2() + 1) as u64;
        let control = rounds * (8 * p as u64 * 2 + 4 * 256 * 8);
        let headers = 3 * (p as u64 - 1) * sparse::stream::HEADER_BYTES as u64;
        let bound = (bound_words * 4.0) as u64 + headers + control;
        for (rank, steps) in out.iter().enumerate() {
            for (step, (_, _, s)) in steps.iter().enumerate() {
                let data_words = |b: u64| b.saturating_sub(headers + control) as f64 / 4.0;
                eprintln!(
                    "p={p} rank {rank} step {step}: sent {} B, received {} B (≈{:.2}·k(p−1)/p words), bound {bound} B, exact {}",
                    s.wire.bytes_sent,
                    s.wire.bytes_received,
                    data_words(s.wire.bytes_received.max(s.wire.bytes_sent)) / (k as f64 * (p - 1) as f64 / p as f64),
                    s.exact_threshold
                );
                assert!(
                    s.wire.bytes_sent <= bound,
                    "p={p} rank {rank} step {step}: sent {}",
                    s.wire.bytes_sent
                );
                assert!(
                    s.wire.bytes_received <= bound,
                    "p={p} rank {rank} step {step}: received {}",
                    s.wire.bytes_received
                );
                // The global top-k: about k entries, never more (no ties with random floats).
                assert!(
                    s.result_nnz <= k && 2 * s.result_nnz >= k,
                    "p={p} step {step}: {} of k={k}",
                    s.result_nnz
                );
            }
        }
        // The estimated global threshold takes over after the first steps.
        let estimated = out[0].iter().filter(|s| !s.2.exact_threshold).count();
        assert!(
            estimated >= 1,
            "p={p}: every step needed the exact threshold"
        );
        // Every rank ends with the same bits.
        for (r, rank) in out.iter().enumerate().skip(1) {
            for (step, (data, _, _)) in rank.iter().enumerate() {
                let same = data
                    .iter()
                    .zip(&out[0][step].0)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "p={p} step {step}: rank {r} differs");
            }
        }
    }
}

/// The indices of the `k` largest magnitudes (lower index first among equals), ascending:
/// sorted here, independently of the library's selection.
fn naive_topk(x: &[f32], k: usize) -> Vec<u64> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].abs().total_cmp(&x[a].abs()).then(a.cmp(&b)));
    let mut idx: Vec<u64> = order[..k.min(x.len())].iter().map(|&i| i as u64).collect();
    idx.sort_unstable();
    idx
}

/// Replays the top-k steps on one thread: each rank's selection from `g + residual`, their
/// sum, what is kept, and the residuals.
fn reference_topk(
    p: usize,
    n: usize,
    steps: u64,
    op: ReduceOp,
    opts: TopkOptions,
) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
    let k = chorus_algorithms::sparse::topk::k_of(opts.ratio, n);
    let mut residual = vec![vec![0f32; n]; p];
    let mut out = Vec::new();
    for step in 0..steps {
        let mut sel = Vec::new();
        let mut sum = vec![0f32; n];
        for (r, res) in residual.iter_mut().enumerate() {
            let g = gradient(r, step, n, true);
            let x: Vec<f32> = if opts.error_feedback {
                g.iter().zip(res.iter()).map(|(a, b)| b + a).collect()
            } else {
                g
            };
            let idx = naive_topk(&x, k);
            for &i in &idx {
                sum[i as usize] += x[i as usize];
            }
            if opts.error_feedback {
                *res = x.clone();
            }
            sel.push(idx);
        }
        // Kept: everything (union schedules) or the k largest non-zero sums, ties included.
        let t = if opts.algo == SparseAlgo::TwoPhase && p > 1 {
            let mut m: Vec<f32> = sum.iter().map(|x| x.abs()).filter(|&x| x > 0.0).collect();
            m.sort_by(|a, b| b.total_cmp(a));
            if m.len() > k {
                m[k - 1]
            } else {
                0.0 // every non-zero sum
            }
        } else {
            -1.0
        };
        let kept = |i: usize| sum[i].abs() >= t && (t < 0.0 || sum[i] != 0.0);
        let result: Vec<f32> = (0..n)
            .map(|i| {
                if kept(i) {
                    if op == ReduceOp::Avg {
                        sum[i] / p as f32
                    } else {
                        sum[i]
                    }
                } else {
                    0.0
                }
            })
            .collect();
        if opts.error_feedback {
            for r in 0..p {
                for &i in &sel[r] {
                    if kept(i as usize) {
                        residual[r][i as usize] = 0.0;
                    }
                }
            }
        }
        out.push((result, residual.clone()));
    }
    out
}

#[test]
fn topk_and_error_feedback_match_a_reference() {
    let n = 5000;
    let steps = 3;
    for algo in SparseAlgo::ALL {
        for (p, op, ef) in [
            (1, ReduceOp::Sum, true),
            (3, ReduceOp::Avg, true),
            (4, ReduceOp::Sum, false),
            (5, ReduceOp::Sum, true),
        ] {
            let opts = TopkOptions {
                ratio: 0.02,
                error_feedback: ef,
                algo,
                exact_every: 1,
                rebalance_every: 2,
            };
            let got = run_topk(p, n, steps, op, opts, true);
            let want = reference_topk(p, n, steps, op, opts);
            for (step, (want_data, want_res)) in want.iter().enumerate() {
                let what = format!("{algo} p={p} {op} ef={ef} step {step}");
                for (r, rank) in got.iter().enumerate() {
                    let (data, residual, stats) = &rank[step];
                    assert_eq!(data, want_data, "{what} rank {r}: result");
                    if ef {
                        assert_eq!(residual, &want_res[r], "{what} rank {r}: residual");
                    } else {
                        assert!(residual.is_empty());
                    }
                    assert_eq!(
                        stats.result_nnz,
                        want_data.iter().filter(|&&x| x != 0.0).count(),
                        "{what}"
                    );
                }
            }
        }
    }
}

/// Runs `f` on every rank of a fresh group of `p` and returns each rank's outcome as a
/// string (`ok` or the error), failing the test if a rank takes longer than the deadline.
fn outcomes(
    p: usize,
    f: impl Fn(usize, &mut CollCtx<'_>) -> Result<(), TransportError> + Sync,
) -> Vec<String> {
    let start = Instant::now();
    let out = run_group(mem::group(p, 1 << 16, 4096), |rank, t| {
        let mut scratch = Vec::new();
        let mut c = CollCtx {
            transport: t,
            deadline: Instant::now() + Duration::from_secs(20),
            tag_base: 5 << 16,
            scratch: &mut scratch,
        };
        let r = f(rank, &mut c);
        match abort_on_error(t, r) {
            Ok(()) => "ok".to_string(),
            Err(e) => e.to_string(),
        }
    });
    // Failing ranks abort, so the others hear of it long before the deadline.
    assert!(start.elapsed() < Duration::from_secs(20), "{out:?}");
    out
}

#[test]
fn ranks_that_disagree_fail_everywhere() {
    for p in [2usize, 3, 4, 5] {
        for algo in SparseAlgo::ALL {
            // Another length on one rank.
            let out = outcomes(p, |rank, c| {
                let n = if rank == p - 1 { 1001 } else { 1000 };
                let x = SparseVec::new(n, vec![1, 7, 500], vec![1.0, 2.0, 3.0]).unwrap();
                sparse::sparse_all_reduce(c, &x, algo).map(|_| ())
            });
            assert!(out.iter().all(|o| o != "ok"), "{algo} p={p}: {out:?}");
            assert!(
                out.iter()
                    .any(|o| o.contains("bytes where") || o.contains("bytes, more than")),
                "{algo} p={p}: {out:?}"
            );
            // Lengths large enough that the ranks first agree on a bound for their buffers:
            // the disagreement is found there, naming the rank, before any buffer is sized.
            let big = 1usize << 33;
            let out = outcomes(p, |rank, c| {
                let n = if rank == p - 1 { big + 1 } else { big };
                let x = SparseVec::new(n, vec![1, 7, 500], vec![1.0, 2.0, 3.0]).unwrap();
                sparse::sparse_all_reduce(c, &x, algo).map(|_| ())
            });
            assert!(out.iter().all(|o| o != "ok"), "{algo} p={p}: {out:?}");
            let named = format!(
                "rank {} sent an invalid frame: it passed a sparse vector of length {}",
                p - 1,
                big + 1
            );
            assert!(out[0].contains(&named), "{algo} p={p}: {out:?}");
            assert!(
                out[p - 1].contains(&format!(
                    "length {big}, this rank one of length {}",
                    big + 1
                )),
                "{algo} p={p}: {out:?}"
            );
            // Options that differ on one rank: another ratio; error feedback off (its results
            // would drift from the others').
            let differing: [fn(usize, usize, SparseAlgo) -> TopkOptions; 2] = [
                |rank, _, algo| TopkOptions {
                    ratio: if rank == 0 { 0.02 } else { 0.01 },
                    algo,
                    ..TopkOptions::default()
                },
                |rank, p, algo| TopkOptions {
                    ratio: 0.01,
                    algo,
                    error_feedback: rank != p - 1,
                    ..TopkOptions::default()
                },
            ];
            for opts_of in differing {
                let out = outcomes(p, |rank, c| {
                    let mut data = gradient(rank, 0, 4000, false);
                    let opts = opts_of(rank, p, algo);
                    topk_all_reduce(
                        c,
                        &mut data,
                        ReduceOp::Sum,
                        &opts,
                        &mut TopkState::default(),
                    )
                    .map(|_| ())
                });
                assert!(out.iter().all(|o| o != "ok"), "{algo} p={p}: {out:?}");
            }
        }
        // Another schedule on one rank.
        let out = outcomes(p, |rank, c| {
            let algo = if rank == 0 {
                SparseAlgo::SplitAllgather
            } else {
                SparseAlgo::RecursiveDoubling
            };
            let x = SparseVec::new(100, vec![3], vec![1.0]).unwrap();
            sparse::sparse_all_reduce(c, &x, algo).map(|_| ())
        });
        assert!(out.iter().all(|o| o != "ok"), "p={p}: {out:?}");
    }
}

#[test]
fn garbage_from_a_peer_is_an_error_not_a_panic() {
    // Rank 1 sends rank 0 bytes that are not a sparse stream, under the right tag and size.
    for garbage in [
        vec![0u8; 40],
        vec![0xffu8; 200],
        b"SPR1\x00\x00\x00\x00".repeat(10),
    ] {
        let out = outcomes(2, |rank, c| {
            if rank == 1 {
                let t = c.tag((1 << 8) | 1); // recursive doubling, round 0
                c.transport.send(0, t, &garbage, Duration::from_secs(5))?;
                let mut sink = vec![0u8; 1 << 16];
                c.transport
                    .recv(0, t, &mut sink, Duration::from_secs(5))
                    .map(|_| ())
            } else {
                let x = SparseVec::new(1000, vec![1], vec![1.0]).unwrap();
                sparse::sparse_all_reduce(c, &x, SparseAlgo::RecursiveDoubling).map(|_| ())
            }
        });
        // Garbage behind a valid magic reads as another length: a mismatch.
        assert!(
            out[0].contains("invalid frame: sparse") || out[0].contains("bytes, more than"),
            "{out:?}"
        );
    }
}

#[test]
fn bad_arguments_are_refused_before_sending() {
    let out = outcomes(1, |_, c| {
        let bad = SparseVec {
            n: 10,
            indices: vec![3, 2],
            values: vec![1.0, 1.0],
        };
        let e = sparse::sparse_all_reduce(c, &bad, SparseAlgo::TwoPhase).unwrap_err();
        assert!(e.is_recoverable(), "{e}");
        let mut data = vec![1.0f32; 10];
        let mut st = TopkState::default();
        for ratio in [0.0, -1.0, 1.5, f64::NAN] {
            let opts = TopkOptions {
                ratio,
                ..TopkOptions::default()
            };
            let e = topk_all_reduce(c, &mut data, ReduceOp::Sum, &opts, &mut st).unwrap_err();
            assert!(e.is_recoverable(), "{e}");
        }
        let e = topk_all_reduce(
            c,
            &mut data,
            ReduceOp::Max,
            &TopkOptions::default(),
            &mut st,
        )
        .unwrap_err();
        assert!(e.is_recoverable(), "{e}");
        st.residual = vec![0.0; 3];
        let e = topk_all_reduce(
            c,
            &mut data,
            ReduceOp::Sum,
            &TopkOptions::default(),
            &mut st,
        )
        .unwrap_err();
        assert!(e.is_recoverable(), "{e}");
        assert_eq!(data, vec![1.0; 10], "nothing changed");
        Ok(())
    });
    assert_eq!(out, ["ok"]);
}

/// More infinities than k in one call: that call's result carries infinities (as a dense sum
/// would), and none is left in the residual to reach the finite calls after it.
#[test]
fn infinities_do_not_outlive_their_call() {
    let (n, p) = (10_000, 2);
    for algo in SparseAlgo::ALL {
        let opts = TopkOptions {
            algo,
            ..TopkOptions::default() // ratio 1 %: k = 100
        };
        let out = run_group(mem::group(p, 1 << 18, 16384), |rank, t| {
            let mut scratch = Vec::new();
            let mut state = TopkState::default();
            (0..4u64)
                .map(|step| {
                    let mut data = vec![1.0f32; n];
                    if step == 0 && rank == 0 {
                        data[..500].fill(f32::INFINITY);
                    }
                    let mut c = ctx(t, &mut scratch, step + 1);
                    let r = topk_all_reduce(&mut c, &mut data, ReduceOp::Sum, &opts, &mut state);
                    abort_on_error(t, r).unwrap_or_else(|e| panic!("{algo:?} step {step}: {e}"));
                    assert!(state.residual.iter().all(|r| r.is_finite()), "{algo:?}");
                    data
                })
                .collect::<Vec<_>>()
        });
        for (rank, steps) in out.iter().enumerate() {
            assert!(
                steps[0].iter().any(|v| v.is_infinite()),
                "{algo:?} rank {rank}"
            );
            for (step, d) in steps.iter().enumerate().skip(1) {
                assert!(
                    d.iter().all(|v| v.is_finite()),
                    "{algo:?} rank {rank} step {step}"
                );
            }
        }
    }
}

/// A union schedule applies every selected entry, also one whose sum cancels to exactly zero:
/// each rank's residual there is cleared whatever the result's format (a sparse result leaves
/// zero sums out, and the residual must not depend on that).
#[test]
fn a_selection_that_cancels_clears_its_residual() {
    let n = 4000;
    for algo in [SparseAlgo::RecursiveDoubling, SparseAlgo::SplitAllgather] {
        // Both ranks select elements 0..1100 (the first region travels dense, the result,
        // of fewer than n/2 entries, sparse), element 5 as +100 and -100: its sum is 0.
        let k = 1100;
        let opts = TopkOptions {
            ratio: k as f64 / n as f64,
            error_feedback: true,
            algo,
            exact_every: 1,
            rebalance_every: 2,
        };
        let got = run_group(mem::group(2, 1 << 18, 16384), move |rank, t| {
            let mut scratch = Vec::new();
            let mut state = TopkState::default();
            let mut data = vec![0.0f32; n];
            for (i, x) in data[..k].iter_mut().enumerate() {
                *x = 10.0 + i as f32 / 64.0;
            }
            data[5] = if rank == 0 { 100.0 } else { -100.0 };
            let mut c = ctx(t, &mut scratch, 0);
            let r = topk_all_reduce(&mut c, &mut data, ReduceOp::Sum, &opts, &mut state);
            abort_on_error(t, r).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            (data[5], state.residual[5])
        });
        for (rank, (value, residual)) in got.into_iter().enumerate() {
            assert_eq!(value, 0.0, "{algo} rank {rank}");
            assert_eq!(
                residual, 0.0,
                "{algo} rank {rank}: the residual kept what was sent"
            );
        }
    }
}
