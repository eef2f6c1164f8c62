//! Every allreduce schedule over the in-memory transport against the naive reference: ranks ×
//! counts × dtypes × ops × in place / out of place, tight buffers that split elements, and
//! ranks that disagree (on the count, or on the schedule) failing instead of hanging.

mod support;

use std::time::{Duration, Instant};

use chorus_algorithms::allreduce::{self, Algorithm};
use chorus_algorithms::{CollCtx, DType, ReduceOp};
use chorus_transport::{Transport, TransportError};
use support::sweep::{cases, run_case, Case, RANKS};
use support::{mem, run_group};

/// The schedules this file checks (the ring has its own tests).
const SCHEDULES: [Algorithm; 4] = [
    Algorithm::RecursiveDoubling,
    Algorithm::HalvingDoubling,
    Algorithm::Tree,
    Algorithm::DoubleTree,
];

/// Every schedule × case on one group per size (reused across schedules and cases).
fn sweep(cases: &[Case], ranks: &[usize], capacity: usize, frame: usize) {
    sweep_on(cases, ranks, &SCHEDULES, |p| mem::group(p, capacity, frame));
}

/// [`sweep`] of `schedules` on the groups `make(p)` builds.
fn sweep_on<T: Transport + 'static>(
    cases: &[Case],
    ranks: &[usize],
    schedules: &[Algorithm],
    make: impl Fn(usize) -> Vec<T>,
) {
    let mut failures = Vec::new();
    for &p in ranks {
        let results = run_group(make(p), |_rank, t| {
            let mut scratch = Vec::new();
            let mut out = Vec::new();
            let mut seq = 0;
            for &alg in schedules {
                for case in cases {
                    seq += 1;
                    match run_case(alg, t, &mut scratch, seq, *case) {
                        Ok(0) => {}
                        Ok(wrong) => out.push(format!("{alg} {case:?}: {wrong} wrong")),
                        Err(e) => {
                            out.push(format!("{alg} {case:?}: {e}"));
                            return out; // dropping the transport makes the peers fail too
                        }
                    }
                }
            }
            out
        });
        for (rank, rs) in results.into_iter().enumerate() {
            failures.extend(rs.into_iter().map(|f| format!("p={p} rank {rank} {f}")));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

/// Every schedule, the ring too, over the RDMA transport on its emulated NIC, with rings of
/// 8 slots of 4 KiB: messages span many chunks and wait for credits.
#[test]
fn over_the_rdma_transport() {
    use chorus_transport::rdma::{nic::mem_group, transport::RdmaTransport};
    let cases = cases(
        &[DType::Float32, DType::Int8, DType::Float64],
        &[ReduceOp::Sum, ReduceOp::Max],
        &[0, 1, 7, 1023, 70_001],
    );
    let mut schedules = SCHEDULES.to_vec();
    schedules.push(Algorithm::Ring);
    sweep_on(&cases, &[2, 3, 4, 5, 7], &schedules, |p| {
        mem_group(p, 8, 4096)
            .into_iter()
            .enumerate()
            .map(|(rank, nic)| RdmaTransport::new(rank, p, nic).expect("rdma transport"))
            .collect()
    });
}

#[test]
fn every_dtype_and_op_small_counts() {
    let cases = cases(&DType::ALL, &ReduceOp::ALL, &[0, 1, 7, 1023]);
    sweep(&cases, &RANKS, 64 * 1024, 4096);
}

#[test]
fn large_counts() {
    let large = (1 << 19) + 3;
    let mut all = cases(&[DType::Float32], &[ReduceOp::Sum], &[large]);
    all.extend(cases(&[DType::Bfloat16], &[ReduceOp::Avg], &[large]));
    sweep(&all, &[2, 3, 5, 8], 256 * 1024, 16 * 1024);
}

/// Tiny buffers and frames that split elements: back-pressure, partial segments, arrivals
/// that end mid-element, tree segments queued behind each other.
#[test]
fn tight_buffers_and_odd_frames() {
    let all = cases(
        &[DType::Float64, DType::Float16, DType::Int32],
        &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min],
        &[3, 40_011],
    );
    sweep(&all, &[2, 3, 4, 6], 1000, 99);
}

fn run_on(t: &mut dyn Transport, alg: Algorithm, buf: &mut [f32]) -> Result<(), TransportError> {
    let mut scratch = Vec::new();
    let mut ctx = CollCtx {
        transport: t,
        deadline: Instant::now() + Duration::from_secs(20),
        tag_base: 7 << 16,
        scratch: &mut scratch,
    };
    let bytes = bytemuck::cast_slice_mut(buf);
    allreduce::run(alg, &mut ctx, None, bytes, DType::Float32, ReduceOp::Sum)
}

#[test]
fn different_counts_fail_instead_of_hanging() {
    for alg in SCHEDULES {
        for p in [2, 3, 4, 5] {
            let start = Instant::now();
            let results = run_group(mem::group(p, 64 * 1024, 4096), |rank, t| {
                let count = if rank == 1 { 1000 } else { 1001 };
                run_on(t, alg, &mut vec![1.0f32; count])
            });
            // Every rank fails (the ranks that meet no wrong length directly see a peer that
            // failed go away), well before the 20 s deadline: nobody waits it out, nobody
            // succeeds silently with a result of the wrong length.
            assert!(
                results.iter().all(Result::is_err),
                "{alg} p={p}: {results:?}"
            );
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{alg} p={p}: {:?}",
                start.elapsed()
            );
            assert!(
                results
                    .iter()
                    .any(|r| matches!(r, Err(TransportError::Mismatch { .. }))),
                "{alg} p={p}: {results:?}"
            );
        }
    }
}

#[test]
fn ranks_running_different_schedules_are_told() {
    for p in [2, 4] {
        let start = Instant::now();
        let results = run_group(mem::group(p, 64 * 1024, 4096), |rank, t| {
            let alg = if rank == 0 {
                Algorithm::RecursiveDoubling
            } else {
                Algorithm::HalvingDoubling
            };
            run_on(t, alg, &mut vec![1.0f32; 64])
        });
        assert!(results.iter().all(Result::is_err), "p={p}: {results:?}");
        assert!(start.elapsed() < Duration::from_secs(10), "p={p}");
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(TransportError::Mismatch { .. }))),
            "p={p}: {results:?}"
        );
    }
}
