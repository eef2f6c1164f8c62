//! The ring allreduce over the in-memory transport against the naive reference: ranks ×
//! counts × dtypes × ops × in place / out of place, plus error cases.

mod support;

use std::time::{Duration, Instant};

use chorus_algorithms::allreduce::{self, Algorithm};
use chorus_algorithms::{CollCtx, DType, ReduceOp};
use chorus_transport::TransportError;
use support::sweep::{cases, sweep, RANKS, TIMEOUT};
use support::{mem, run_group};

#[test]
fn every_dtype_and_op_small_counts() {
    let cases = cases(&DType::ALL, &ReduceOp::ALL, &[0, 1, 7, 1023]);
    sweep(&cases, &RANKS, |p| mem::group(p, 64 * 1024, 4096));
}

#[test]
fn large_counts() {
    let large = (1 << 20) + 3;
    let mut cases = cases(&[DType::Float32], &[ReduceOp::Sum], &[large]);
    cases.extend(self::cases(&[DType::Bfloat16], &[ReduceOp::Avg], &[large]));
    sweep(&cases, &RANKS, |p| mem::group(p, 256 * 1024, 16 * 1024));
}

/// Tiny buffers and frames that split elements: exercises back-pressure, partial segments
/// and arrivals that end mid-element.
#[test]
fn tight_buffers_and_odd_frames() {
    let cases = cases(
        &[DType::Float64, DType::Float16, DType::Int32],
        &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min],
        &[20_011],
    );
    sweep(&cases, &[2, 3, 4], |p| mem::group(p, 1000, 99));
}

#[test]
fn different_counts_fail_instead_of_hanging() {
    for p in [2, 3, 4] {
        let started = Instant::now();
        let results = run_group(mem::group(p, 64 * 1024, 4096), |rank, t| {
            let count = if rank == 1 { 1000 } else { 1001 };
            let mut buf = vec![1.0f32; count];
            let mut scratch = Vec::new();
            let mut ctx = CollCtx {
                transport: t,
                deadline: Instant::now() + Duration::from_secs(20),
                tag_base: 7 << 16,
                scratch: &mut scratch,
            };
            allreduce::run(
                Algorithm::Ring,
                &mut ctx,
                None,
                bytemuck::cast_slice_mut(&mut buf),
                DType::Float32,
                ReduceOp::Sum,
            )
        });
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "took until the timeout"
        );
        assert!(results.iter().all(|r| r.is_err()), "p={p}: {results:?}");
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(TransportError::Mismatch { .. }))),
            "p={p}: {results:?}"
        );
    }
}

#[test]
fn bad_arguments_leave_the_transport_usable() {
    let results = run_group(mem::group(3, 64 * 1024, 4096), |_rank, t| {
        let mut scratch = Vec::new();
        let mut ctx = CollCtx {
            transport: t,
            deadline: Instant::now() + TIMEOUT,
            tag_base: 1 << 16,
            scratch: &mut scratch,
        };
        let mut odd = [0u8; 6];
        let e1 = allreduce::run(
            Algorithm::Ring,
            &mut ctx,
            None,
            &mut odd,
            DType::Float32,
            ReduceOp::Sum,
        );
        let mut out = [0u8; 8];
        let e2 = allreduce::run(
            Algorithm::Ring,
            &mut ctx,
            Some(&[0u8; 4]),
            &mut out,
            DType::Float32,
            ReduceOp::Sum,
        );
        let mut buf = [2i64, 3];
        let ok = allreduce::run(
            Algorithm::Ring,
            &mut ctx,
            None,
            bytemuck::cast_slice_mut(&mut buf),
            DType::Int64,
            ReduceOp::Prod,
        );
        (e1, e2, ok, buf)
    });
    for (e1, e2, ok, buf) in results {
        assert!(matches!(e1, Err(TransportError::InvalidArgument(_))));
        assert!(matches!(e2, Err(TransportError::InvalidArgument(_))));
        ok.unwrap();
        assert_eq!(buf, [8, 27]);
    }
}

/// Many slices on small buffers (chunk limits below an element included), in place and out
/// of place, and a run whose slices outnumber the tags of a call (they repeat).
#[test]
fn slices_of_every_size_match_the_reference() {
    use chorus_algorithms::allreduce::ring::{run_sliced, slices};
    use support::sweep::{run_case_with, Case};
    let sliced = |slice_bytes: usize| {
        move |ctx: &mut CollCtx<'_>, send: Option<&[u8]>, recv: &mut [u8], d, op| {
            run_sliced(ctx, send, recv, d, op, slice_bytes)
        }
    };
    let all = cases(
        &[DType::Float32, DType::Float16],
        &[ReduceOp::Sum, ReduceOp::Avg],
        &[1, 7, 1000, 4099],
    );
    // Chunks of one element are slow on the threads of the test: small counts only.
    let runs: Vec<(usize, Case)> = [1, 100, 4096]
        .into_iter()
        .flat_map(|b| all.iter().map(move |&c| (b, c)))
        .filter(|&(b, c)| b > 1 || c.count < 1000)
        .collect();
    for p in [2, 3, 4, 5, 7] {
        let results = run_group(mem::group(p, 64 * 1024, 4096), |_rank, t| {
            let mut scratch = Vec::new();
            let mut wrong = Vec::new();
            for (seq, &(slice_bytes, case)) in runs.iter().enumerate() {
                let r = run_case_with(&mut sliced(slice_bytes), t, &mut scratch, seq as u64, case);
                wrong.push((slice_bytes, case, r.map_err(|e| e.to_string())));
            }
            wrong
        });
        for (rank, r) in results.iter().enumerate() {
            assert!(r.iter().all(|w| w.2 == Ok(0)), "p={p} rank {rank}: {r:?}");
        }
    }
    // Two ranks, one byte per chunk: 35 000 slices, more than the 32 768 that a call's tags
    // number (two steps each).
    let count = 70_000;
    assert!(slices(count, 2, 1, 1).len() > (1 << 16) / 2);
    let case = Case {
        dtype: DType::Uint8,
        op: ReduceOp::Max,
        count,
        in_place: false,
    };
    let results = run_group(mem::group(2, 64 * 1024, 4096), |_rank, t| {
        run_case_with(&mut sliced(1), t, &mut Vec::new(), 1, case)
    });
    for r in results {
        assert_eq!(r.unwrap(), 0);
    }
}
