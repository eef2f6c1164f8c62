//! Compressed and sparse allreduce through `Communicator`, over TCP and shared memory: results
//! identical on every rank and close to the dense sum, small tensors exact, 16-bit inputs,
//! sparse results exact, and the errors users hit (bad op, bad dtype, ranks disagreeing on
//! the method or the length) reported on every rank, never a hang.

mod common;

use std::time::{Duration, Instant};

use chorus::sparse::{SparseAlgo, SparseResult, SparseVec};
use chorus::{Communicator, Compressor, DType, ErrorKind, ReduceOp};
use common::*;

const WATCHDOG: Duration = Duration::from_secs(120);

fn gradient(rank: usize, n: usize, salt: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mut z = (rank as u64) << 40 ^ (i as u64) ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

fn dense_sum(p: usize, n: usize, salt: u64) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    for r in 0..p {
        for (o, g) in out.iter_mut().zip(gradient(r, n, salt)) {
            *o += g;
        }
    }
    out
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The cosine of the angle between `got` and `want`: 1 for the same direction, 0 for an
/// all-zero result, negative for one pointing away. A relative-error bound above 1 (the
/// stochastic codecs' noise is larger than the signal per element) would pass a result of
/// zeros; this would not.
fn cosine(got: &[f32], want: &[f32]) -> f64 {
    let dot: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let d = norm(got) * norm(want);
    if d == 0.0 {
        0.0
    } else {
        dot / d
    }
}

/// The least-squares gain of `got` against `want`: `⟨got, want⟩ / ⟨want, want⟩`.
fn gain(got: &[f32], want: &[f32]) -> f64 {
    let dot: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| g as f64 * w as f64)
        .sum();
    let norm: f64 = want.iter().map(|&w| (w as f64).powi(2)).sum();
    dot / norm
}

/// Rank 0's result broadcast to everyone: a rank whose result differs says so.
fn same_everywhere(c: &mut Communicator, v: &[f32]) -> bool {
    let mut r0 = v.to_vec();
    c.broadcast(&mut r0, 0).expect("broadcast");
    r0.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits())
}

/// Every method, sum and avg, a few sizes: identical everywhere, near the dense sum.
fn methods_on(transport: &'static str, p: usize) {
    let bad = on_threads_on(transport, p, WATCHDOG, move |c| {
        let mut bad = Vec::new();
        let methods = [
            ("fp16", 1e-3),
            ("bf16", 1e-2),
            ("int8", 0.05),
            ("int4", 0.6),
            ("ternary", 2.0),
            ("sign", 2.0),
            ("topk:0.5", 1.0),
            ("int8,schedule=sg", 0.05),
            ("topk:0.2,algo=dsar", 1.2),
            ("topk:0.2,algo=sparse_rd", 1.2),
        ];
        for (spec, tol) in methods {
            let mut comp = Compressor::new(&format!("{spec},min_bytes=0")).unwrap();
            for (n, salt) in [(1usize, 1u64), (37, 2), (5000, 3)] {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let mut g = gradient(c.rank(), n, salt);
                    let report = match c.all_reduce_compressed(&mut g, op, &mut comp) {
                        Ok(r) => r,
                        Err(e) => {
                            bad.push(format!("{spec} n={n}: {e}"));
                            return bad;
                        }
                    };
                    let mut want = dense_sum(c.size(), n, salt);
                    if op == ReduceOp::Avg {
                        want.iter_mut().for_each(|v| *v /= c.size() as f32);
                    }
                    let e = rel_err(&g, &want);
                    // The error bound is statistical: checked on the large tensor; small
                    // ones must still be finite.
                    if (n >= 1000 && e > tol) || !g.iter().all(|v| v.is_finite()) {
                        bad.push(format!(
                            "{spec} n={n} {op:?}: relative error {e:.3} > {tol}"
                        ));
                    }
                    let cos = cosine(&g, &want);
                    if n >= 1000 && cos < 0.5 {
                        bad.push(format!("{spec} n={n} {op:?}: cosine {cos:.3} < 0.5"));
                    }
                    // Unbiased codecs are not scaled (a wrong `Avg` divisor, a wrong scale):
                    // neither the cosine nor a loose error bound would see a gain.
                    let unbiased = !spec.starts_with("sign") && !spec.starts_with("topk");
                    let k = gain(&g, &want);
                    if n >= 1000 && unbiased && !(0.9..1.1).contains(&k) {
                        bad.push(format!("{spec} n={n} {op:?}: gain {k:.3} not near 1"));
                    }
                    if !same_everywhere(c, &g) {
                        bad.push(format!("{spec} n={n}: ranks differ"));
                    }
                    if !report.compressed || report.dense_bytes != 4 * n as u64 {
                        bad.push(format!("{spec} n={n}: report {report:?}"));
                    }
                }
            }
        }
        bad
    });
    let bad: Vec<String> = bad.into_iter().flatten().collect();
    assert!(bad.is_empty(), "{transport} p={p}: {bad:#?}");
}

#[test]
fn every_method_over_tcp() {
    for p in [1, 3, 4] {
        methods_on("tcp", p);
    }
}

#[test]
fn every_method_over_shm() {
    for p in [2, 5] {
        methods_on("shm", p);
    }
}

#[test]
fn small_tensors_exact_and_16_bit_inputs() {
    let res = on_threads(3, WATCHDOG, |c| {
        // Below min_bytes: the plain allreduce, exact.
        let mut comp = Compressor::new("sign").unwrap();
        let mut v = vec![(c.rank() + 1) as f32; 100];
        let r = c
            .all_reduce_compressed(&mut v, ReduceOp::Sum, &mut comp)
            .unwrap();
        assert!(!r.compressed);
        assert!(v.iter().all(|x| *x == 6.0), "{v:?}");
        // f16 and bf16 through the raw entry point, averaged.
        for dtype in [DType::Float16, DType::Bfloat16] {
            let mut comp = Compressor::new("int8,min_bytes=0").unwrap();
            let n = 3000;
            let mut bytes: Vec<u8> = (0..n)
                .flat_map(|_| match dtype {
                    DType::Float16 => {
                        half::f16::from_f32((c.rank() + 1) as f32 * 0.5).to_ne_bytes()
                    }
                    _ => half::bf16::from_f32((c.rank() + 1) as f32 * 0.5).to_ne_bytes(),
                })
                .collect();
            c.all_reduce_compressed_raw(&mut bytes, dtype, ReduceOp::Avg, &mut comp)
                .unwrap();
            for b in bytes.chunks_exact(2) {
                let x = match dtype {
                    DType::Float16 => half::f16::from_ne_bytes([b[0], b[1]]).to_f32(),
                    _ => half::bf16::from_ne_bytes([b[0], b[1]]).to_f32(),
                };
                assert!((x - 1.0).abs() < 0.02, "{dtype:?}: {x}");
            }
        }
        // min_bytes counts a 16-bit tensor's own bytes; dense_bytes counts it as f32 either
        // way, and the plain allreduce sends it as it is.
        for (n, compressed) in [(5000usize, false), (9000, true)] {
            let mut comp = Compressor::new("int8").unwrap(); // min_bytes 16384
            let mut bytes = vec![0u8; 2 * n];
            let r = c
                .all_reduce_compressed_raw(&mut bytes, DType::Float16, ReduceOp::Sum, &mut comp)
                .unwrap();
            assert_eq!(r.compressed, compressed, "{n} float16 values");
            assert_eq!(r.dense_bytes, 4 * n as u64, "{n}");
            if !compressed {
                // 2(p−1)/p of the 2n bytes at p = 3.
                assert_eq!(r.bytes_sent, (2 * n as u64) * 4 / 3, "{n}");
            }
        }
        // Bad arguments leave the communicator usable.
        let mut comp = Compressor::new("int8,min_bytes=0").unwrap();
        let mut v = vec![1.0f32; 64];
        let e = c
            .all_reduce_compressed(&mut v, ReduceOp::Max, &mut comp)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let mut ints = vec![0u8; 64];
        let e = c
            .all_reduce_compressed_raw(&mut ints, DType::Int32, ReduceOp::Sum, &mut comp)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let mut odd = vec![0u8; 7];
        let e = c
            .all_reduce_compressed_raw(&mut odd, DType::Float32, ReduceOp::Sum, &mut comp)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        // Another op is refused whatever the size: a small 16-bit tensor, below min_bytes,
        // as a large one.
        let mut big = Compressor::new("int8").unwrap(); // min_bytes 16384
        for dtype in [DType::Float16, DType::Bfloat16, DType::Float32] {
            let mut small = vec![0u8; 64];
            let e = c
                .all_reduce_compressed_raw(&mut small, dtype, ReduceOp::Max, &mut big)
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{dtype:?}");
        }
        // An empty tensor: ranks whose min_bytes differ (0 here on rank 0 alone) agree, and
        // the next call pairs.
        let spec = if c.rank() == 0 {
            "int8,min_bytes=0"
        } else {
            "int8"
        };
        let mut differs = Compressor::new(spec).unwrap();
        let mut empty: Vec<f32> = Vec::new();
        let r = c
            .all_reduce_compressed(&mut empty, ReduceOp::Sum, &mut differs)
            .unwrap();
        assert!(!r.compressed);
        let mut empty16: Vec<u8> = Vec::new();
        c.all_reduce_compressed_raw(&mut empty16, DType::Float16, ReduceOp::Sum, &mut differs)
            .unwrap();
        let mut one = vec![1.0f32; 4];
        c.all_reduce(&mut one, ReduceOp::Sum).unwrap();
        assert_eq!(one, [3.0; 4]);
        c.barrier().unwrap();
    });
    assert_eq!(res.len(), 3);
}

/// The ranks of a disagreement failed on what arrived, not by waiting out their 60 s
/// timeout.
fn quick(res: &[Result<(), ErrorKind>], start: Instant) {
    assert!(!res.contains(&Err(ErrorKind::Timeout)), "{res:?}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn ranks_disagreeing_fail_everywhere() {
    // Different methods.
    let start = Instant::now();
    let res = on_threads(3, WATCHDOG, |c| {
        let spec = if c.rank() == 1 {
            "int4,min_bytes=0"
        } else {
            "int8,min_bytes=0"
        };
        let mut comp = Compressor::new(spec).unwrap();
        let mut v = gradient(c.rank(), 4096, 9);
        c.all_reduce_compressed(&mut v, ReduceOp::Sum, &mut comp)
            .map(|_| ())
            .map_err(|e| e.kind())
    });
    assert!(res.iter().all(|r| r.is_err()), "{res:?}");
    quick(&res, start);
    // Different lengths.
    let start = Instant::now();
    let res = on_threads(4, WATCHDOG, |c| {
        let mut comp = Compressor::new("topk:0.1,min_bytes=0").unwrap();
        let n = if c.rank() == 2 { 5000 } else { 4000 };
        let mut v = gradient(c.rank(), n, 10);
        c.all_reduce_compressed(&mut v, ReduceOp::Sum, &mut comp)
            .map(|_| ())
            .map_err(|e| e.kind())
    });
    assert!(res.iter().all(|r| r.is_err()), "{res:?}");
    quick(&res, start);
    // Different dtypes of one length: float16 on rank 0, float32 elsewhere; also below
    // min_bytes (16 KiB by default), where the plain allreduce runs.
    for (spec, n) in [
        ("int8,min_bytes=0", 4096),
        ("topk:0.1,min_bytes=0", 4096),
        ("int8", 1000),
    ] {
        let start = Instant::now();
        let res = on_threads(3, WATCHDOG, move |c| {
            let mut comp = Compressor::new(spec).unwrap();
            let g = gradient(c.rank(), n, 11);
            let (mut bytes, dtype): (Vec<u8>, _) = if c.rank() == 0 {
                let b = g.iter().flat_map(|v| half::f16::from_f32(*v).to_ne_bytes());
                (b.collect(), DType::Float16)
            } else {
                (
                    g.iter().flat_map(|v| v.to_ne_bytes()).collect(),
                    DType::Float32,
                )
            };
            c.all_reduce_compressed_raw(&mut bytes, dtype, ReduceOp::Sum, &mut comp)
                .map(|_| ())
                .map_err(|e| e.kind())
        });
        assert!(res.iter().all(|r| r.is_err()), "{spec}: {res:?}");
        quick(&res, start);
    }
}

#[test]
fn sparse_all_reduce_is_exact_with_auto_and_every_algorithm() {
    for p in [1, 2, 3, 5] {
        let bad = on_threads(p, WATCHDOG, move |c| {
            let mut bad = Vec::new();
            let n = 3000;
            for density in [0.0, 0.01, 0.3, 1.0] {
                // Rank r holds integer values at its own random positions.
                let g = gradient(c.rank(), n, (density * 1000.0) as u64);
                let (mut idx, mut vals) = (Vec::new(), Vec::new());
                for (i, x) in g.iter().enumerate() {
                    if ((x + 1.0) / 2.0) < density as f32 {
                        idx.push(i as u64);
                        vals.push((i % 5) as f32 + c.rank() as f32);
                    }
                }
                let sv = SparseVec::new(n, idx, vals).unwrap();
                let mut want = sv.to_dense();
                c.all_reduce(&mut want, ReduceOp::Sum).unwrap();
                for algo in [
                    None,
                    Some(SparseAlgo::RecursiveDoubling),
                    Some(SparseAlgo::SplitAllgather),
                    Some(SparseAlgo::TwoPhase),
                ] {
                    let got = match c.sparse_all_reduce(&sv, algo).unwrap() {
                        SparseResult::Dense(d) => d,
                        SparseResult::Sparse(s) => s.to_dense(),
                    };
                    if got != want {
                        bad.push(format!("p={p} density={density} {algo:?}: wrong sum"));
                    }
                }
            }
            bad
        });
        let bad: Vec<String> = bad.into_iter().flatten().collect();
        assert!(bad.is_empty(), "{bad:#?}");
    }
}

#[test]
fn an_fp16_sum_beyond_its_range_reads_infinity_everywhere() {
    // 40000 on each of 2 ranks: each input fits fp16, their sum (80000) does not. It must not
    // come back as fp16's largest value (65504) with Ok, a finite wrong gradient no loss
    // scaler notices: it reads +inf on every rank, as in an fp16 allreduce. Their average
    // (40000) fits and is exact.
    for transport in ["tcp", "shm"] {
        let res = on_threads_on(transport, 2, WATCHDOG, |c| {
            let n = 5000;
            let mut comp = Compressor::new("fp16,min_bytes=0").unwrap();
            let mut sum = vec![40000.0f32; n];
            sum[7] = -40000.0;
            c.all_reduce_compressed(&mut sum, ReduceOp::Sum, &mut comp)
                .unwrap();
            let mut avg = vec![40000.0f32; n];
            c.all_reduce_compressed(&mut avg, ReduceOp::Avg, &mut comp)
                .unwrap();
            (sum, avg)
        });
        for (sum, avg) in res {
            assert!(
                sum.iter().enumerate().all(|(i, v)| *v
                    == if i == 7 {
                        f32::NEG_INFINITY
                    } else {
                        f32::INFINITY
                    }),
                "{transport}: {:?}",
                &sum[..10]
            );
            assert!(
                avg.iter().all(|v| *v == 40000.0),
                "{transport}: {:?}",
                &avg[..4]
            );
        }
    }
}

/// A compressor moved to another communicator starts that group's top-k state afresh (its
/// step count among it): rank 0's compressor made two calls on the world, rank 1 brings a
/// fresh one to the new communicator, and their calls there agree. (Kept, rank 0's step
/// count of 2 would meet rank 1's 0: a mismatch.)
#[test]
fn a_top_k_compressor_starts_afresh_on_another_communicator() {
    let res = on_threads(2, WATCHDOG, |c| {
        let mut comp = Compressor::new("topk:0.1,min_bytes=0").unwrap();
        for salt in 0..2 {
            let mut v = gradient(c.rank(), 4096, 20 + salt);
            c.all_reduce_compressed(&mut v, ReduceOp::Sum, &mut comp)
                .map_err(|e| e.to_string())?;
        }
        let mut other = c
            .split(Some(0), 0)
            .map_err(|e| e.to_string())?
            .expect("a member of color 0");
        if c.rank() == 1 {
            comp = Compressor::new("topk:0.1,min_bytes=0").unwrap();
        }
        let mut v = gradient(c.rank(), 4096, 30);
        other
            .all_reduce_compressed(&mut v, ReduceOp::Sum, &mut comp)
            .map_err(|e| e.to_string())?;
        Ok::<bool, String>(same_everywhere(&mut other, &v))
    });
    for (rank, r) in res.into_iter().enumerate() {
        assert_eq!(r, Ok(true), "rank {rank}");
    }
}
