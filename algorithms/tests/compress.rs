//! Codecs and the compressed allreduce: round-trip bounds, unbiasedness, error-feedback
//! conservation, both schedules over the in-memory transport (bit-identical ranks, error
//! against the dense sum, no growth with the number of ranks) and ranks or peers that
//! misbehave.

mod support;

use std::time::{Duration, Instant};

use chorus_algorithms::compress::{
    all_reduce_compressed, plan, Codec, CodecError, CompressedOptions, Residual, Rng, Schedule,
    WireStats, DEFAULT_CHUNK,
};
use chorus_algorithms::{CollCtx, ReduceOp};
use chorus_transport::{AbortNotice, Buf, Op, Request, Transport, TransportError, Wait};
use proptest::prelude::*;
use support::{mem, run_group};

const TIMEOUT: Duration = Duration::from_secs(60);

/// A standard normal draw (Box–Muller).
fn gaussian(rng: &mut Rng) -> f32 {
    let u1 = f64::from(rng.next_f32()).max(1e-12);
    let u2 = f64::from(rng.next_f32());
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// The input of `rank` in case `case`: independent standard normals.
fn input(case: u64, rank: usize, n: usize) -> Vec<f32> {
    let mut rng = Rng::new(0xda7a ^ case, rank as u64);
    (0..n).map(|_| gaussian(&mut rng)).collect()
}

/// ‖got − want‖ / ‖want‖ and the cosine between them.
fn rel_err_and_cos(got: &[f32], want: &[f64]) -> (f64, f64) {
    let (mut err, mut norm, mut dot, mut gnorm) = (0.0, 0.0, 0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        let g = f64::from(g);
        err += (g - w).powi(2);
        norm += w * w;
        dot += g * w;
        gnorm += g * g;
    }
    ((err / norm).sqrt(), dot / (norm.sqrt() * gnorm.sqrt()))
}

// ---------------------------------------------------------------------------------------------
// Codecs on their own.

/// Values over f32's whole range: zeros, subnormals, tiny, ordinary and huge magnitudes.
fn any_value() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(0.0f32),
        Just(-0.0f32),
        (-1e3f32..1e3f32),
        (-1.0f32..1.0f32),
        (any::<bool>(), -149i32..128, 0.0f32..1.0).prop_map(|(neg, e, m)| {
            let v = (1.0 + m) * 2f32.powi(e.min(127));
            let v = if v.is_finite() { v } else { f32::MAX };
            if neg {
                -v
            } else {
                v
            }
        }),
    ]
}

fn chunk_ranges(n: usize, chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..n.div_ceil(chunk)).map(move |c| c * chunk..((c + 1) * chunk).min(n))
}

/// Checks `y = decode(encode(x))` against the codec's bound (see the codec documentation).
fn check_bound(codec: Codec, x: &[f32], y: &[f32], chunk: usize) -> Result<(), String> {
    let fail = |i: usize, why: &str| Err(format!("{codec} x[{i}]={:e} y={:e}: {why}", x[i], y[i]));
    match codec {
        Codec::F16 => {
            for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
                // As a cast rounds: from 65520 (halfway to the next power of two's first
                // step) up, infinity; between 65504 and 65520, the largest finite value.
                if a.abs() >= 65520.0 {
                    if b != f32::INFINITY.copysign(a) {
                        return fail(i, "does not overflow to infinity as a cast does");
                    }
                } else if a.abs() > 65504.0 {
                    if b != 65504f32.copysign(a) {
                        return fail(i, "does not round to fp16's largest value");
                    }
                } else if (a - b).abs() > (a.abs() * 2f32.powi(-11)).max(2f32.powi(-25)) {
                    return fail(i, "beyond half an fp16 ulp");
                }
            }
        }
        Codec::Bf16 => {
            for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
                let tol = (a.abs() * 2f32.powi(-8)).max(2f32.powi(-133));
                if !b.is_finite() || f64::from(a - b).abs() > f64::from(tol) {
                    return fail(i, "beyond half a bf16 ulp");
                }
            }
        }
        Codec::Int8 | Codec::Int4 | Codec::Ternary { clip: false } => {
            let levels = match codec {
                Codec::Int8 => 127.0,
                Codec::Int4 => 7.0,
                _ => 1.0,
            };
            for r in chunk_ranges(x.len(), chunk) {
                let range = x[r.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
                let step = f64::from(range) / levels;
                for i in r {
                    let err = (f64::from(x[i]) - f64::from(y[i])).abs();
                    // One step, plus the f32 rounding of the decoded value (half an ulp of a
                    // value up to the range: up to 127 × 2^-24 of a step for int8, which a
                    // value at the range rounded down one step shows), plus the rounding of a
                    // step that underflows f32.
                    let rounding = f64::from(x[i].abs().max(y[i].abs())) * 2f64.powi(-23);
                    if err > step * (1.0 + 1e-6) + rounding + 1e-42 {
                        return fail(i, &format!("beyond one step {step:e}"));
                    }
                }
            }
        }
        Codec::Ternary { clip: true } => {
            for r in chunk_ranges(x.len(), chunk) {
                let range = x[r.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
                for i in r {
                    if y[i].abs() > range || y[i] * x[i] < 0.0 {
                        return fail(i, "beyond the range or of the wrong sign");
                    }
                }
            }
        }
        Codec::Sign => {
            for r in chunk_ranges(x.len(), chunk) {
                let mean =
                    x[r.clone()].iter().map(|v| f64::from(v.abs())).sum::<f64>() / r.len() as f64;
                for i in r {
                    let ok_mag = (f64::from(y[i].abs()) - mean).abs() <= mean * 1e-4 + 1e-44;
                    let ok_sign = x[i] == 0.0 || (y[i] < 0.0) == (x[i] < 0.0) || y[i] == 0.0;
                    if !(ok_mag && ok_sign) {
                        return fail(i, &format!("not ±mean|x| = {mean:e}"));
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn decode_of_encode_is_within_bound(
        x in prop::collection::vec(any_value(), 0..2100),
        chunk in prop::sample::select(vec![1usize, 7, 64, 1000, 1024]),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed, 0);
        for codec in Codec::ALL {
            let mut bytes = vec![0u8; codec.encoded_len(x.len(), chunk)];
            codec.encode(&x, chunk, &mut bytes, &mut rng);
            let mut y = vec![f32::NAN; x.len()];
            codec.decode(&bytes, chunk, &mut y).map_err(|e| TestCaseError::fail(e.to_string()))?;
            check_bound(codec, &x, &y, chunk).map_err(TestCaseError::fail)?;
            // decode_add adds the same values.
            let mut z = vec![1.0f32; x.len()];
            codec.decode_add(&bytes, chunk, &mut z).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for (a, b) in z.iter().zip(&y) {
                prop_assert!(*a == 1.0 + *b || (a.is_nan() && b.is_nan()));
            }
        }
    }

    /// Random bytes, of the right length or not, never panic a decoder.
    #[test]
    fn garbage_never_panics(
        bytes in prop::collection::vec(any::<u8>(), 0..600),
        n in 0usize..700,
        chunk in prop::sample::select(vec![0usize, 1, 5, 64, 1024]),
    ) {
        let mut out = vec![0f32; n];
        for codec in Codec::ALL {
            let _ = codec.decode(&bytes, chunk, &mut out);
            if chunk > 0 {
                // The right length with random contents.
                let len = codec.encoded_len(n, chunk);
                let fitted: Vec<u8> = bytes.iter().copied().cycle().take(len).collect();
                if len == 0 || !bytes.is_empty() {
                    let _ = codec.decode_add(&fitted, chunk, &mut out);
                }
            }
        }
    }

    /// Error feedback: what was sent plus the new residual is what was given (g + old
    /// residual), to f32 rounding.
    #[test]
    fn error_feedback_conserves(
        g in prop::collection::vec(-100.0f32..100.0, 0..1500),
        seed in any::<u64>(),
        chunk in prop::sample::select(vec![3usize, 64, 1024]),
    ) {
        let mut rng = Rng::new(seed, 1);
        for codec in Codec::ALL {
            let old: Vec<f32> = g.iter().map(|_| gaussian(&mut rng)).collect();
            let mut e = old.clone();
            let mut bytes = vec![0u8; codec.encoded_len(g.len(), chunk)];
            codec.encode_with_feedback(&g, &mut e, chunk, &mut bytes, &mut rng);
            let mut sent = vec![0f32; g.len()];
            codec.decode(&bytes, chunk, &mut sent).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for i in 0..g.len() {
                let given = g[i] + old[i];
                let tol = 4.0 * f32::EPSILON * (given.abs() + sent[i].abs());
                prop_assert!((sent[i] + e[i] - given).abs() <= tol,
                    "{codec} i={i}: sent {} + residual {} != given {}", sent[i], e[i], given);
            }
        }
    }
}

#[test]
fn error_feedback_telescopes_over_many_steps() {
    // Over T steps, Σ sent = Σ g − e_T: the sign codec's bias does not accumulate.
    let n = 3000;
    let mut rng = Rng::new(5, 0);
    for codec in Codec::ALL {
        let mut e = vec![0f32; n];
        let mut sent_sum = vec![0f64; n];
        let mut given_sum = vec![0f64; n];
        let mut bytes = vec![0u8; codec.encoded_len(n, 512)];
        let mut sent = vec![0f32; n];
        for _ in 0..40 {
            let g: Vec<f32> = (0..n).map(|_| gaussian(&mut rng)).collect();
            codec.encode_with_feedback(&g, &mut e, 512, &mut bytes, &mut rng);
            codec.decode(&bytes, 512, &mut sent).unwrap();
            for i in 0..n {
                sent_sum[i] += f64::from(sent[i]);
                given_sum[i] += f64::from(g[i]);
            }
        }
        for i in 0..n {
            let drift = sent_sum[i] + f64::from(e[i]) - given_sum[i];
            assert!(drift.abs() < 1e-3, "{codec} i={i}: drift {drift}");
        }
    }
}

/// Non-finite input is encoded as such and reported on decode (fp16/bf16 carry it); with
/// error feedback, the residual of that chunk is dropped, not carried.
#[test]
fn non_finite_input() {
    let mut x = vec![0.5f32; 40];
    x[13] = f32::NAN;
    x[30] = f32::INFINITY;
    for codec in Codec::ALL {
        let mut bytes = vec![0u8; codec.encoded_len(40, 16)];
        codec.encode(&x, 16, &mut bytes, &mut Rng::new(1, 1));
        let mut y = vec![0f32; 40];
        let r = codec.decode(&bytes, 16, &mut y);
        if matches!(codec, Codec::F16 | Codec::Bf16) {
            r.unwrap();
            assert!(y[13].is_nan() && y[30] == f32::INFINITY);
        } else {
            assert_eq!(r, Err(CodecError::NonFinite { chunk: 0 }), "{codec}");
        }
        let mut e = vec![0.25f32; 40];
        codec.encode_with_feedback(&x, &mut e, 16, &mut bytes, &mut Rng::new(1, 1));
        assert!(e[..32].iter().all(|&v| v == 0.0), "{codec}: {e:?}");
        assert!(e.iter().all(|v| v.is_finite()), "{codec}");
    }
}

/// fp16 with error feedback: a finite value past fp16's range goes as ∞ and its residual
/// entry is dropped, while the other values of its chunk keep theirs.
#[test]
fn fp16_overflow_drops_only_its_own_residual() {
    let mut x = vec![1.0001f32; 16];
    x[5] = 1.0e5;
    let codec = Codec::F16;
    let mut bytes = vec![0u8; codec.encoded_len(16, 16)];
    let mut e = vec![0f32; 16];
    codec.encode_with_feedback(&x, &mut e, 16, &mut bytes, &mut Rng::new(1, 1));
    let mut y = vec![0f32; 16];
    codec.decode(&bytes, 16, &mut y).unwrap();
    assert_eq!(y[5], f32::INFINITY);
    assert_eq!(e[5], 0.0);
    for i in (0..16).filter(|&i| i != 5) {
        assert_eq!(e[i], x[i] - y[i], "entry {i}: {e:?}");
        assert!(e[i] != 0.0, "entry {i}: {e:?}");
    }
}

/// Monte-Carlo: the mean of many decodes of the same values approaches them. The tolerance
/// is five standard deviations of the mean (each decode is within one step and its variance
/// at most step²/4), well below the bias of rounding to nearest (up to half a step).
#[test]
fn stochastic_codecs_are_unbiased() {
    const TRIALS: usize = 20_000;
    // Fractions of the range at quarter-, tenth- and third-step positions, and the range.
    let x: Vec<f32> = (0..64)
        .map(|i| {
            let f = (i as f32 * 0.37).sin() * 0.999;
            if i == 0 {
                1.0
            } else {
                f
            }
        })
        .collect();
    for codec in [Codec::Int8, Codec::Int4, Codec::Ternary { clip: false }] {
        let levels = match codec {
            Codec::Int8 => 127.0,
            Codec::Int4 => 7.0,
            _ => 1.0,
        };
        let step = 1.0 / levels;
        let mut rng = Rng::new(11, 0);
        let mut bytes = vec![0u8; codec.encoded_len(64, 64)];
        let mut y = vec![0f32; 64];
        let mut mean = vec![0f64; 64];
        for _ in 0..TRIALS {
            codec.encode(&x, 64, &mut bytes, &mut rng);
            codec.decode(&bytes, 64, &mut y).unwrap();
            for (m, &v) in mean.iter_mut().zip(&y) {
                *m += f64::from(v) / TRIALS as f64;
            }
        }
        let tol = 5.0 * (step * step / 4.0 / TRIALS as f64).sqrt();
        assert!(tol < 0.05 * step, "the test could not see a bias");
        let mut nearest_biased = 0;
        for i in 0..64 {
            let xi = f64::from(x[i]);
            assert!(
                (mean[i] - xi).abs() < tol,
                "{codec} x[{i}]={xi}: mean of decodes {} (tolerance {tol})",
                mean[i]
            );
            // Rounding to nearest would have been caught here.
            let nearest = (xi / step).round() * step;
            nearest_biased += usize::from((nearest - xi).abs() > tol);
        }
        assert!(nearest_biased > 32, "{codec}: too few values off the grid");
    }
}

// ---------------------------------------------------------------------------------------------
// The compressed allreduce over the in-memory transport.

#[derive(Clone, Copy, Debug)]
struct Case {
    codec: Codec,
    schedule: Schedule,
    n: usize,
    chunk: usize,
    op: ReduceOp,
    /// Calls made with the same inputs (error feedback is carried between them).
    calls: usize,
    ef: bool,
}

/// What one rank got for one case.
#[derive(Debug)]
struct Got {
    /// The mean over the calls of the results.
    mean: Vec<f32>,
    last: Vec<f32>,
    stats: WireStats,
    /// Payload bytes the transport carried from this rank during the case's last call.
    counted: u64,
    residual: Residual,
}

fn run_cases(p: usize, cases: &[Case]) -> Vec<Vec<Result<Got, TransportError>>> {
    let group = mem::group(p, 256 * 1024, 8192);
    let counters: Vec<_> = group.iter().map(|t| t.sent_counter()).collect();
    run_group(group, |rank, t| {
        let mut scratch = Vec::new();
        let mut seq = 1u64;
        cases
            .iter()
            .enumerate()
            .map(|(k, case)| {
                let x = input(k as u64, rank, case.n);
                let opts = CompressedOptions {
                    codec: case.codec,
                    chunk: case.chunk,
                    schedule: Some(case.schedule),
                    error_feedback: case.ef,
                };
                let mut rng = Rng::new(77, rank as u64);
                let mut residual = Residual::default();
                let mut mean = vec![0f32; case.n];
                let mut last = Vec::new();
                let mut stats = WireStats::default();
                let mut counted = 0;
                for _ in 0..case.calls {
                    let before = counters[rank].get();
                    let mut data = x.clone();
                    let mut ctx = CollCtx {
                        transport: &mut *t,
                        deadline: Instant::now() + TIMEOUT,
                        tag_base: seq << 16,
                        scratch: &mut scratch,
                    };
                    seq += 1;
                    stats = all_reduce_compressed(
                        &mut ctx,
                        &mut data,
                        case.op,
                        &opts,
                        &mut rng,
                        Some(&mut residual),
                    )?;
                    counted = counters[rank].get() - before;
                    for (m, v) in mean.iter_mut().zip(&data) {
                        *m += v / case.calls as f32;
                    }
                    last = data;
                }
                Ok(Got {
                    mean,
                    last,
                    stats,
                    counted,
                    residual,
                })
            })
            .collect()
    })
}

/// The exact result of case `k`.
fn exact(k: usize, case: &Case, p: usize) -> Vec<f64> {
    let mut sum = vec![0f64; case.n];
    for r in 0..p {
        for (s, v) in sum.iter_mut().zip(input(k as u64, r, case.n)) {
            *s += f64::from(v);
        }
    }
    if case.op == ReduceOp::Avg {
        sum.iter_mut().for_each(|s| *s /= p as f64);
    }
    sum
}

/// Upper bound of the relative error of one call and lower bound of the cosine with the
/// exact result, for independent normal inputs (loose: about twice what is measured).
fn quality_bound(codec: Codec) -> (f64, f64) {
    match codec {
        Codec::F16 => (2e-3, 0.999),
        Codec::Bf16 => (1.5e-2, 0.999),
        Codec::Int8 => (0.05, 0.99),
        Codec::Int4 => (0.5, 0.85),
        Codec::Ternary { .. } => (2.6, 0.3),
        Codec::Sign => (1.2, 0.45),
    }
}

fn schedules(codec: Codec) -> Vec<Schedule> {
    if codec.integer_ring() {
        vec![Schedule::ScatterGather, Schedule::IntegerRing]
    } else {
        vec![Schedule::ScatterGather]
    }
}

/// Runs every case on `p` ranks: all succeed, ranks are bit-identical, the residuals have the
/// documented sizes. Returns per case the relative error and cosine of rank 0's last result.
fn check_group(p: usize, cases: &[Case]) -> Vec<(f64, f64)> {
    let results = run_cases(p, cases);
    let mut quality = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        let got: Vec<&Got> = results
            .iter()
            .enumerate()
            .map(|(r, res)| {
                res[k]
                    .as_ref()
                    .unwrap_or_else(|e| panic!("p={p} rank {r} {case:?}: {e}"))
            })
            .collect();
        for (r, g) in got.iter().enumerate() {
            assert_eq!(g.last.len(), case.n);
            let same = g
                .last
                .iter()
                .zip(&got[0].last)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "p={p} {case:?}: rank {r} differs from rank 0");
            if case.ef {
                let own = plan(case.n, p, case.chunk).slices[r].len();
                assert_eq!(g.residual.local.len(), case.n);
                let want = if p > 1 && case.schedule == Schedule::ScatterGather {
                    own
                } else {
                    0
                };
                assert_eq!(g.residual.owner.len(), want, "{case:?}");
            }
            if p == 1 {
                assert_eq!(g.stats, WireStats::default());
            } else {
                assert!(g.stats.bytes_sent > 0 && g.stats.bytes_received > 0);
            }
        }
        let want = exact(k, case, p);
        quality.push(rel_err_and_cos(&got[0].last, &want));
    }
    quality
}

fn all_codec_cases(ns: &[usize], chunk: usize) -> Vec<Case> {
    let mut cases = Vec::new();
    for codec in Codec::ALL {
        for schedule in schedules(codec) {
            for &n in ns {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    cases.push(Case {
                        codec,
                        schedule,
                        n,
                        chunk,
                        op,
                        calls: 1,
                        ef: codec.is_biased(),
                    });
                }
            }
        }
    }
    cases
}

#[test]
fn every_codec_and_schedule_on_1_to_8_ranks() {
    let mut by_p = Vec::new();
    for p in [1, 2, 3, 4, 5, 8] {
        // Small and odd sizes (n < p, n not a multiple of the chunk) and one large enough to
        // measure the error on.
        let cases = all_codec_cases(&[0, 1, 5, 1001, 20_000], 256);
        let quality = check_group(p, &cases);
        for (case, &(err, cos)) in cases.iter().zip(&quality) {
            if case.n < 1000 {
                continue;
            }
            if p == 1 {
                // Nothing to compress on one rank: the input comes back.
                assert!(err < 1e-7, "p=1 {case:?}: {err}");
                continue;
            }
            let (max_err, min_cos) = quality_bound(case.codec);
            if std::env::var("SHOWQ").is_ok() && case.n == 20_000 && case.op == ReduceOp::Sum {
                eprintln!(
                    "QQ p={p} {} {:?} err={err:.4} cos={cos:.4}",
                    case.codec, case.schedule
                );
            }
            assert!(
                err <= max_err && cos >= min_cos,
                "p={p} {case:?}: relative error {err:.4} (bound {max_err}), cosine {cos:.4} (bound {min_cos})"
            );
        }
        by_p.push((p, cases, quality));
    }
    // The error does not grow with the number of ranks: p = 8 against p = 2, large cases.
    let at = |p: usize| by_p.iter().find(|(q, ..)| *q == p).unwrap();
    let (_, cases, q2) = at(2);
    let (_, _, q8) = at(8);
    for ((case, &(e2, _)), &(e8, _)) in cases.iter().zip(q2).zip(q8) {
        if case.n == 20_000 {
            assert!(
                e8 <= 1.3 * e2,
                "{case:?}: relative error {e2:.4} at p=2 grows to {e8:.4} at p=8"
            );
        }
    }
}

/// Tensors of many groups (the schedules compute, send and consume about 64 Ki values at a
/// time, overlapping them): results agree across ranks and stay within the bounds, with and
/// without error feedback, chunks that do not divide the group or the tensor.
#[test]
fn large_tensors_stream_group_by_group() {
    let mut cases = Vec::new();
    for (codec, schedule, ef, op) in [
        (Codec::Int8, Schedule::IntegerRing, false, ReduceOp::Sum),
        (Codec::Int8, Schedule::IntegerRing, true, ReduceOp::Avg),
        (
            Codec::Ternary { clip: false },
            Schedule::IntegerRing,
            false,
            ReduceOp::Sum,
        ),
        (Codec::Int4, Schedule::ScatterGather, false, ReduceOp::Avg),
        (Codec::Sign, Schedule::ScatterGather, true, ReduceOp::Sum),
        (Codec::F16, Schedule::ScatterGather, false, ReduceOp::Sum),
    ] {
        cases.push(Case {
            codec,
            schedule,
            n: 300_001,
            chunk: 1000,
            op,
            calls: 1,
            ef,
        });
    }
    for p in [2, 3] {
        let quality = check_group(p, &cases);
        for (case, &(err, cos)) in cases.iter().zip(&quality) {
            let (max_err, min_cos) = quality_bound(case.codec);
            assert!(
                err <= max_err && cos >= min_cos,
                "p={p} {case:?}: relative error {err:.4} (bound {max_err}), cosine {cos:.4} (bound {min_cos})"
            );
        }
    }
}

/// The naive alternative, re-quantizing the partial sum at every hop of a ring (and once more
/// for the allgather), shows the growth the schedules avoid: this is what the check above
/// would catch.
#[test]
fn requantizing_every_hop_would_grow_like_sqrt_p() {
    let n = 20_000;
    let naive = |p: usize| {
        let mut rng = Rng::new(3, 3);
        let codec = Codec::Int8;
        let mut bytes = vec![0u8; codec.encoded_len(n, DEFAULT_CHUNK)];
        let mut partial = vec![0f32; n];
        let mut exact = vec![0f64; n];
        for r in 0..p {
            let x = input(99, r, n);
            for i in 0..n {
                partial[i] += x[i];
                exact[i] += f64::from(x[i]);
            }
            // Each hop forwards a re-quantized partial sum.
            codec.encode(&partial.clone(), DEFAULT_CHUNK, &mut bytes, &mut rng);
            codec.decode(&bytes, DEFAULT_CHUNK, &mut partial).unwrap();
        }
        rel_err_and_cos(&partial, &exact).0
    };
    let (e2, e8) = (naive(2), naive(8));
    assert!(e8 > 1.5 * e2, "naive ring: {e2} at p=2, {e8} at p=8");
}

/// Error feedback in the schedule: with the same inputs call after call, the mean of the
/// results converges to the exact sum (the residuals carry what each call lost), far closer
/// than one call; without it, sign's bias stays.
#[test]
fn error_feedback_averages_out_over_calls() {
    let mut cases = Vec::new();
    for (codec, schedule) in [
        (Codec::Sign, Schedule::ScatterGather),
        (Codec::Int4, Schedule::ScatterGather),
        (Codec::Int4, Schedule::IntegerRing),
        (Codec::Ternary { clip: true }, Schedule::IntegerRing),
    ] {
        for ef in [true, false] {
            cases.push(Case {
                codec,
                schedule,
                n: 4096,
                chunk: 512,
                op: ReduceOp::Sum,
                calls: 40,
                ef,
            });
        }
    }
    let p = 4;
    let results = run_cases(p, &cases);
    for (k, case) in cases.iter().enumerate() {
        let got = results[0][k].as_ref().unwrap();
        let want = exact(k, case, p);
        let (one, _) = rel_err_and_cos(&got.last, &want);
        let (mean, _) = rel_err_and_cos(&got.mean, &want);
        if case.ef {
            assert!(
                mean < 0.12 * one,
                "{case:?}: mean of 40 calls {mean:.4}, one call {one:.4}"
            );
        } else if case.codec == Codec::Sign {
            assert!(
                mean > 0.5 * one,
                "{case:?}: without error feedback sign should stay biased ({mean:.4} vs {one:.4})"
            );
        } else if case.codec == Codec::Int4 {
            // Unbiased without feedback too: 40 calls' noise averages down by about 1/√40.
            assert!(
                mean < 0.35 * one,
                "{case:?}: mean of 40 calls {mean:.4}, one call {one:.4}"
            );
        }
        if case.codec == Codec::Int4 {
            // An unbiased codec's result is not scaled: cosine alone would not see a gain.
            let g = gain(&got.last, &want);
            assert!((0.97..1.03).contains(&g), "{case:?}: gain {g:.4}");
        }
    }
}

/// The least-squares gain of `got` against `want`: `⟨got, want⟩ / ⟨want, want⟩`.
fn gain(got: &[f32], want: &[f64]) -> f64 {
    let dot: f64 = got.iter().zip(want).map(|(&g, &w)| f64::from(g) * w).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    dot / norm
}

#[test]
fn bytes_on_the_wire_match_the_formulas() {
    let (n, chunk, p) = (1 << 16, 1024, 4);
    let mut cases = Vec::new();
    for (codec, schedule) in [
        (Codec::Int8, Schedule::ScatterGather),
        (Codec::Int8, Schedule::IntegerRing),
        (Codec::Ternary { clip: false }, Schedule::IntegerRing),
        (Codec::Sign, Schedule::ScatterGather),
        (Codec::F16, Schedule::ScatterGather),
    ] {
        cases.push(Case {
            codec,
            schedule,
            n,
            chunk,
            op: ReduceOp::Sum,
            calls: 1,
            ef: false,
        });
    }
    let results = run_cases(p, &cases);
    let chunks = n / chunk;
    let dense = 2.0 * (p - 1) as f64 / p as f64 * (4 * n) as f64;
    for (k, case) in cases.iter().enumerate() {
        let got = results[0][k].as_ref().unwrap();
        let s = got.stats;
        // Bits per value of each codec, written out here rather than taken from the codec.
        let bits = match case.codec {
            Codec::Int8 => 8.0,
            Codec::Ternary { .. } => 2.0,
            Codec::Sign => 1.0,
            Codec::F16 => 16.0,
            other => panic!("no formula for {other:?}"),
        };
        let share = (p - 1) as f64 / p as f64;
        let want = match case.schedule {
            Schedule::ScatterGather => {
                2.0 * share * (n as f64 * bits / 8.0)
                    + if case.codec == Codec::F16 {
                        0.0
                    } else {
                        2.0 * share * 4.0 * chunks as f64
                    }
                    + 16.0 * (p - 1) as f64
            }
            Schedule::IntegerRing => {
                let lv = if case.codec == Codec::Int8 { 127 } else { 1 };
                let width = 32 - (2 * p as u32 * lv).leading_zeros();
                // Codes and sums, then every chunk's range (and a header) to every peer.
                share * n as f64 * (bits + f64::from(width)) / 8.0
                    + (p - 1) as f64 * 4.0 * chunks as f64
                    + 16.0 * (p - 1) as f64
            }
        };
        assert_eq!(s.bytes_sent as f64, want, "{case:?}");
        // What the transport carried, counted by the transport.
        assert_eq!(got.counted, s.bytes_sent, "{case:?}");
        assert_eq!(s.bytes_received, s.bytes_sent, "{case:?}");
        assert!(s.bytes_sent as f64 <= 0.56 * dense);
    }
}

// ---------------------------------------------------------------------------------------------
// Ranks and peers that misbehave.

fn one_call(
    t: &mut dyn Transport,
    scratch: &mut Vec<u8>,
    seq: u64,
    data: &mut [f32],
    opts: &CompressedOptions,
) -> Result<WireStats, TransportError> {
    let rank = t.rank() as u64;
    let mut ctx = CollCtx {
        transport: t,
        deadline: Instant::now() + TIMEOUT,
        tag_base: seq << 16,
        scratch,
    };
    let mut residual = Residual::default();
    all_reduce_compressed(
        &mut ctx,
        data,
        ReduceOp::Sum,
        opts,
        &mut Rng::new(1, rank),
        Some(&mut residual),
    )
}

fn opts(codec: Codec, schedule: Schedule) -> CompressedOptions {
    CompressedOptions {
        schedule: Some(schedule),
        ..CompressedOptions::new(codec)
    }
}

/// Every rank fails, none by timing out (a rank that gives up drops its transport, so its
/// peers see it closed).
fn assert_all_fail_fast<T: std::fmt::Debug>(what: &str, results: &[Result<T, TransportError>]) {
    for (r, res) in results.iter().enumerate() {
        match res {
            Ok(v) => panic!("{what}: rank {r} succeeded with {v:?}"),
            Err(TransportError::Timeout { .. }) => panic!("{what}: rank {r} timed out"),
            Err(_) => {}
        }
    }
}

#[test]
fn ranks_that_disagree_fail_everywhere() {
    for (codec, schedule) in [
        (Codec::Int8, Schedule::ScatterGather),
        (Codec::Ternary { clip: false }, Schedule::IntegerRing),
        (Codec::Sign, Schedule::ScatterGather),
    ] {
        for p in [2, 3, 4] {
            // 1001 and 1002 ternary values pack into the same number of bytes: the header
            // catches it.
            for (n_rank1, n_others) in [(1000, 1001), (1002, 1001), (0, 5)] {
                let results = run_group(mem::group(p, 64 * 1024, 4096), |rank, t| {
                    let n = if rank == 1 { n_rank1 } else { n_others };
                    let mut data = vec![1.0f32; n];
                    one_call(t, &mut Vec::new(), 3, &mut data, &opts(codec, schedule))
                });
                let what = format!("{codec} {schedule:?} p={p} n={n_rank1}/{n_others}");
                assert_all_fail_fast(&what, &results);
                assert!(
                    results
                        .iter()
                        .any(|r| matches!(r, Err(TransportError::Mismatch { .. }))),
                    "{what}: {results:?}"
                );
            }
        }
    }
    // Another codec, or another schedule, on one rank: a tag mismatch.
    for (a, b) in [
        (
            opts(Codec::Int8, Schedule::ScatterGather),
            opts(Codec::Int4, Schedule::ScatterGather),
        ),
        (
            opts(Codec::Int8, Schedule::ScatterGather),
            opts(Codec::Int8, Schedule::IntegerRing),
        ),
    ] {
        let results = run_group(mem::group(3, 64 * 1024, 4096), |rank, t| {
            let mut data = vec![1.0f32; 3000];
            let o = if rank == 2 { b } else { a };
            one_call(t, &mut Vec::new(), 3, &mut data, &o)
        });
        assert_all_fail_fast("codec/schedule mismatch", &results);
        assert!(results.iter().any(|r| matches!(
            r,
            Err(TransportError::Mismatch { expected_tag, got_tag, .. }) if expected_tag != got_tag
        )));
    }
}

#[test]
fn bad_arguments_are_refused_before_sending() {
    let results = run_group(mem::group(2, 64 * 1024, 4096), |_, t| {
        let mut data = vec![1.0f32; 100];
        let mut scratch = Vec::new();
        let mut errs = Vec::new();
        let bad = [
            (ReduceOp::Max, opts(Codec::Int8, Schedule::ScatterGather)),
            (
                ReduceOp::Sum,
                CompressedOptions {
                    chunk: 0,
                    ..opts(Codec::Int8, Schedule::ScatterGather)
                },
            ),
            (ReduceOp::Sum, opts(Codec::Sign, Schedule::IntegerRing)),
            (ReduceOp::Sum, opts(Codec::F16, Schedule::IntegerRing)),
        ];
        for (op, o) in bad {
            let mut ctx = CollCtx {
                transport: &mut *t,
                deadline: Instant::now() + TIMEOUT,
                tag_base: 1 << 16,
                scratch: &mut scratch,
            };
            errs.push(all_reduce_compressed(
                &mut ctx,
                &mut data,
                op,
                &o,
                &mut Rng::new(0, 0),
                None,
            ));
        }
        // Error feedback without a residual.
        let mut ctx = CollCtx {
            transport: &mut *t,
            deadline: Instant::now() + TIMEOUT,
            tag_base: 1 << 16,
            scratch: &mut scratch,
        };
        let o = opts(Codec::Sign, Schedule::ScatterGather);
        errs.push(all_reduce_compressed(
            &mut ctx,
            &mut data,
            ReduceOp::Sum,
            &o,
            &mut Rng::new(0, 0),
            None,
        ));
        // The transport is still usable.
        let ok = one_call(
            t,
            &mut scratch,
            2,
            &mut data,
            &opts(Codec::Int8, Schedule::IntegerRing),
        );
        (errs, ok)
    });
    for (errs, ok) in results {
        for e in errs {
            assert!(
                matches!(e, Err(TransportError::InvalidArgument(_))),
                "{e:?}"
            );
        }
        ok.unwrap();
    }
}

/// NaN or ±∞ in one rank's input: every rank fails with an invalid argument, all messages
/// done, and the next call on the same transports works.
#[test]
fn non_finite_input_fails_every_rank_and_leaves_the_group_usable() {
    for (codec, schedule) in [
        (Codec::Int8, Schedule::ScatterGather),
        (Codec::Int8, Schedule::IntegerRing),
        (Codec::Sign, Schedule::ScatterGather),
        (Codec::Ternary { clip: true }, Schedule::IntegerRing),
    ] {
        let p = 4;
        let results = run_group(mem::group(p, 64 * 1024, 4096), |rank, t| {
            let mut scratch = Vec::new();
            let mut data = vec![1.0f32; 5000];
            if rank == 2 {
                data[4321] = f32::NAN;
                data[17] = f32::NEG_INFINITY;
            }
            let o = CompressedOptions {
                chunk: 512,
                ..opts(codec, schedule)
            };
            let bad = one_call(t, &mut scratch, 5, &mut data, &o);
            let mut data = vec![1.0f32; 5000];
            let good = one_call(t, &mut scratch, 6, &mut data, &o).map(|_| data[4321]);
            (bad, good)
        });
        for (r, (bad, good)) in results.into_iter().enumerate() {
            match bad {
                Err(TransportError::InvalidArgument(m)) => {
                    assert!(m.contains("NaN or inf"), "{m}")
                }
                other => panic!("{codec} {schedule:?} rank {r}: {other:?}"),
            }
            let v = good.unwrap();
            assert!((v - p as f32).abs() < 0.1, "{v}");
        }
    }
}

/// A transport that overwrites byte `at` of every message it sends with `byte`: a peer
/// sending data no encoder makes.
struct Corrupting<T> {
    inner: T,
    at: usize,
    byte: u8,
}

impl<T: Transport> Transport for Corrupting<T> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> &'static str {
        "corrupting"
    }
    fn post(&mut self, req: &mut Request) -> chorus_transport::Result<()> {
        self.inner.post(req)
    }
    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> chorus_transport::Result<bool> {
        let copies: Vec<Option<Vec<u8>>> = ops
            .iter()
            .map(|op| match &op.buf {
                Buf::Send(b) if b.len() > self.at => {
                    let mut c = b.to_vec();
                    c[self.at] = self.byte;
                    Some(c)
                }
                _ => None,
            })
            .collect();
        let mut forwarded: Vec<Op<'_, '_>> = ops
            .iter_mut()
            .zip(&copies)
            .map(|(op, copy)| Op {
                req: &mut *op.req,
                buf: match (&mut op.buf, copy) {
                    (_, Some(c)) => Buf::Send(c),
                    (Buf::Send(b), None) => Buf::Send(b),
                    (Buf::Recv(b), None) => Buf::Recv(b),
                },
            })
            .collect();
        self.inner.progress(&mut forwarded, wait)
    }
    fn abort(&mut self, notice: &AbortNotice) {
        self.inner.abort(notice)
    }
}

#[test]
fn invalid_codes_from_a_peer_fail_every_rank() {
    for schedule in [Schedule::ScatterGather, Schedule::IntegerRing] {
        let p = 3;
        let transports: Vec<Box<dyn Transport>> = mem::group(p, 64 * 1024, 4096)
            .into_iter()
            .enumerate()
            .map(|(r, t)| -> Box<dyn Transport> {
                if r == 1 {
                    // Byte 20: a code of the first chunk in every kind of message; 0x80 is
                    // the reserved int8 code.
                    Box::new(Corrupting {
                        inner: t,
                        at: 20,
                        byte: 0x80,
                    })
                } else {
                    Box::new(t)
                }
            })
            .collect();
        let results = run_group(transports, |_, t| {
            let mut data: Vec<f32> = (0..3000).map(|i| (i as f32).sin()).collect();
            one_call(
                t,
                &mut Vec::new(),
                9,
                &mut data,
                &opts(Codec::Int8, schedule),
            )
        });
        assert_all_fail_fast(&format!("{schedule:?}"), &results);
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(TransportError::Protocol { peer: 1, .. }))),
            "{schedule:?}: {results:?}"
        );
    }
}

/// The average over `p` ranks of `v` everywhere (4096 values) through `codec` and `schedule`:
/// every rank's result.
fn average_of(
    p: usize,
    v: f32,
    codec: Codec,
    schedule: Schedule,
) -> Vec<Result<Vec<f32>, TransportError>> {
    run_group(mem::group(p, 1 << 18, 8192), |rank, t| {
        let mut scratch = Vec::new();
        let mut data = vec![v; 4096];
        let mut ctx = CollCtx {
            transport: t,
            deadline: Instant::now() + TIMEOUT,
            tag_base: 1 << 16,
            scratch: &mut scratch,
        };
        all_reduce_compressed(
            &mut ctx,
            &mut data,
            ReduceOp::Avg,
            &opts(codec, schedule),
            &mut Rng::new(1, rank as u64),
            None,
        )
        .map(|_| data)
    })
}

/// Scatter-gather's owner sums in f32; a sum beyond f32's range from finite values is summed
/// again in f64, so their average comes back finite (as the integer ring's does).
#[test]
fn scatter_gather_average_of_values_whose_sum_overflows_f32() {
    let v = 2.5e38f32;
    for codec in [
        Codec::Int8,
        Codec::Int4,
        Codec::Ternary { clip: false },
        Codec::Bf16,
    ] {
        let out = average_of(2, v, codec, Schedule::ScatterGather);
        for (rank, r) in out.into_iter().enumerate() {
            let d = r.unwrap_or_else(|e| panic!("{codec:?} rank {rank}: {e}"));
            assert!(
                d.iter()
                    .all(|&x| x.is_finite() && ((x - v) / v).abs() < 1e-2),
                "{codec:?} rank {rank}: {:?}",
                &d[..4]
            );
        }
    }
}

/// fp16 carries values up to 65504: an average of values within that range comes back exact
/// even when their sum lies beyond it (the owner divides before it re-encodes).
#[test]
fn fp16_average_of_values_whose_sum_overflows_fp16() {
    for p in [2usize, 3, 8] {
        let out = average_of(p, 40000.0, Codec::F16, Schedule::ScatterGather);
        for (rank, r) in out.into_iter().enumerate() {
            let d = r.unwrap_or_else(|e| panic!("p={p} rank {rank}: {e}"));
            assert!(
                d.iter().all(|&v| v == 40000.0),
                "p={p} rank {rank}: {:?}",
                &d[..4]
            );
        }
    }
}

/// The owner residual belongs to the slice it was made for: marked for another place (as
/// after a renumbering that keeps the length), the next call starts it from zero, exactly as
/// a residual without one.
#[test]
fn the_owner_residual_follows_its_slice() {
    let n = 4096;
    let results = run_group(mem::group(2, 1 << 18, 8192), |rank, t| {
        let mut scratch = Vec::new();
        let sign = opts(Codec::Sign, Schedule::ScatterGather);
        // Calls 2 and 3: the same input.
        let mut call = |seq: u64, residual: &mut Residual, rng: &mut Rng| {
            let data = input(9 + seq.min(2), rank, n);
            residual_call(t, &mut scratch, seq, data, &sign, residual, rng)
        };
        let mut rng = Rng::new(3, rank as u64);
        let mut moved = Residual::default();
        call(1, &mut moved, &mut rng)?;
        assert!(moved.owner.iter().any(|&v| v != 0.0));
        moved.owner_slice = if moved.owner_slice.start == 0 {
            n / 2..n
        } else {
            0..n / 2
        };
        let mut fresh = Residual {
            local: moved.local.clone(),
            ..Residual::default()
        };
        let mut rng2 = rng.clone();
        let a = call(2, &mut moved, &mut rng)?;
        let b = call(3, &mut fresh, &mut rng2)?;
        Ok::<_, TransportError>((a, b, moved.owner, fresh.owner))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (a, b, moved, fresh) = r.unwrap();
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "rank {rank}"
        );
        assert!(
            moved
                .iter()
                .zip(&fresh)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "rank {rank}"
        );
    }
}

/// A tensor of another length starts from no residual, the owner's included, even where this
/// rank owns the same elements as before (2 ranks: rank 0 owns the first 1024 of 2048 and of
/// 1500 elements).
#[test]
fn the_owner_residual_is_reset_with_the_length() {
    let results = run_group(mem::group(2, 1 << 18, 8192), |rank, t| {
        let mut scratch = Vec::new();
        let sign = CompressedOptions {
            chunk: 1024,
            ..opts(Codec::Sign, Schedule::ScatterGather)
        };
        // Calls 2 and 3: the same input.
        let mut call = |seq: u64, n: usize, residual: &mut Residual, rng: &mut Rng| {
            let data = input(20 + seq.min(2), rank, n);
            residual_call(t, &mut scratch, seq, data, &sign, residual, rng)
        };
        let mut rng = Rng::new(5, rank as u64);
        let mut used = Residual::default();
        call(1, 2048, &mut used, &mut rng)?;
        let slice = used.owner_slice.clone();
        assert!(used.owner.iter().any(|&v| v != 0.0));
        let mut fresh = Residual::default();
        let mut rng2 = rng.clone();
        let a = call(2, 1500, &mut used, &mut rng)?;
        let b = call(3, 1500, &mut fresh, &mut rng2)?;
        Ok::<_, TransportError>((slice, used.owner_slice, a, b))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (before, after, a, b) = r.unwrap();
        if rank == 0 {
            assert_eq!(
                (before.clone(), after.clone()),
                (0..1024, 0..1024),
                "the case tested"
            );
        }
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "rank {rank} (owned {before:?}, then {after:?})"
        );
    }
}

/// One compressed sum of `data` with error feedback in `residual`, call `seq` of a group.
fn residual_call(
    t: &mut dyn Transport,
    scratch: &mut Vec<u8>,
    seq: u64,
    mut data: Vec<f32>,
    opts: &CompressedOptions,
    residual: &mut Residual,
    rng: &mut Rng,
) -> Result<Vec<f32>, TransportError> {
    let mut ctx = CollCtx {
        transport: t,
        deadline: Instant::now() + TIMEOUT,
        tag_base: seq << 16,
        scratch,
    };
    all_reduce_compressed(
        &mut ctx,
        &mut data,
        ReduceOp::Sum,
        opts,
        rng,
        Some(residual),
    )
    .map(|_| data)
}

/// The integer ring's average scales the step, not the decoded sum: values whose sum lies
/// beyond f32's range average to a finite mean.
#[test]
fn integer_ring_average_of_values_whose_sum_overflows_f32() {
    let v = 2.5e38f32;
    for codec in [Codec::Int8, Codec::Int4] {
        let out = average_of(2, v, codec, Schedule::IntegerRing);
        for (rank, r) in out.into_iter().enumerate() {
            let d = r.unwrap_or_else(|e| panic!("{codec:?} rank {rank}: {e}"));
            assert!(
                d.iter()
                    .all(|&x| x.is_finite() && ((x - v) / v).abs() < 1e-5),
                "{codec:?} rank {rank}: {:?}",
                &d[..4]
            );
        }
    }
}

/// A slice whose sum is not finite (here an overflow of f32: every value 3e38 on both ranks)
/// leaves the owner residual as it was, whether the call fails (the scaled codecs) or not
/// (fp16, which carries ±∞): a caller that skips the step keeps what feedback owes.
#[test]
fn an_overflowing_sum_leaves_the_owner_residual() {
    for codec in [Codec::Int8, Codec::Sign, Codec::F16] {
        let results = run_group(mem::group(2, 64 * 1024, 4096), |rank, t| {
            let o = CompressedOptions {
                chunk: 512,
                error_feedback: true,
                ..opts(codec, Schedule::ScatterGather)
            };
            let mut scratch = Vec::new();
            let mut residual = Residual::default();
            let mut rng = Rng::new(3, rank as u64);
            let mut call = |seq: u64, data: &mut Vec<f32>, residual: &mut Residual| {
                let mut ctx = CollCtx {
                    transport: &mut *t,
                    deadline: Instant::now() + TIMEOUT,
                    tag_base: seq << 16,
                    scratch: &mut scratch,
                };
                all_reduce_compressed(&mut ctx, data, ReduceOp::Sum, &o, &mut rng, Some(residual))
            };
            let mut data = input(9, rank, 2048);
            call(1, &mut data, &mut residual).unwrap();
            let before = residual.owner.clone();
            let mut huge = vec![3e38f32; 2048];
            let second = call(2, &mut huge, &mut residual).map(|_| ());
            (before, residual.owner.clone(), second)
        });
        for (r, (before, after, second)) in results.into_iter().enumerate() {
            assert!(
                before.iter().any(|v| *v != 0.0),
                "{codec} rank {r}: no owner residual to keep"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&before), bits(&after), "{codec} rank {r} ({second:?})");
        }
    }
}
