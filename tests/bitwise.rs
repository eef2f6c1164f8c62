//! The bitwise reductions (band, bor, bxor; MPI's `MPI_BAND`, `MPI_BOR`, `MPI_BXOR`), ranks as
//! threads over TCP and shared memory: allreduce by every schedule and by the automatic
//! choice, on every integer dtype, counts {0, 1, 7, 1023, 2^20+3} in place and out of place,
//! p ∈ {1, 2, 3, 4, 5, 8}, exact against the naive reference; reduce and reduce-scatter; and a
//! floating-point dtype refused on every path, the communicator still usable.

mod common;

use std::time::Duration;

use chorus::{Algorithm, AllReduceOptions, DType, ErrorKind, ReduceOp};
use chorus_algorithms::reference::{expected, test_value};
use common::*;

/// Every integer dtype.
fn integers() -> Vec<DType> {
    DType::ALL.into_iter().filter(|d| !d.is_float()).collect()
}

#[test]
fn allreduce_every_schedule_and_integer_dtype() {
    for transport in ["tcp", "shm"] {
        for p in [1usize, 2, 3, 4, 5, 8] {
            let bad = on_threads_on(transport, p, Duration::from_secs(300), move |c| {
                let mut bad = Vec::new();
                let ints = integers();
                assert_eq!(ints.len(), 6, "{ints:?}");
                let forced = Algorithm::ALL.into_iter().map(Some);
                for algorithm in std::iter::once(None).chain(forced) {
                    let opts = AllReduceOptions {
                        algorithm,
                        ..Default::default()
                    };
                    // The large count on one dtype of each width: the kernels of the others
                    // are the same code.
                    bad.extend(sweep_with(
                        c,
                        &COUNTS[..4],
                        &ints,
                        &ReduceOp::BITWISE,
                        &opts,
                    ));
                    bad.extend(sweep_with(
                        c,
                        &COUNTS[4..],
                        &[DType::Uint8, DType::Int64],
                        &ReduceOp::BITWISE,
                        &opts,
                    ));
                }
                bad
            });
            assert_no_failures(bad, &format!("{transport} p={p}"));
        }
    }
}

#[test]
fn reduce_and_reduce_scatter() {
    for p in [1usize, 3, 4] {
        let bad = on_threads_on("tcp", p, Duration::from_secs(120), move |c| {
            let (r, p) = (c.rank(), c.size());
            let mut bad = Vec::new();
            for op in ReduceOp::BITWISE {
                let n = 1031 * p;
                let mine: Vec<i32> = (0..n).map(|i| test_value(r, i, op, p)).collect();
                let want: Vec<i32> = (0..n).map(|i| expected(i, op, p)).collect();
                let root = p - 1;
                let mut out = vec![0i32; n];
                c.reduce(Some(&mine), &mut out, op, root).unwrap();
                if r == root && out != want {
                    bad.push(format!("reduce {op} p={p}"));
                }
                let mut block = vec![0i32; n / p];
                c.reduce_scatter(&mine, &mut block, op).unwrap();
                if block[..] != want[r * n / p..(r + 1) * n / p] {
                    bad.push(format!("reduce_scatter {op} p={p}"));
                }
            }
            bad
        });
        let bad: Vec<String> = bad.into_iter().flatten().collect();
        assert!(bad.is_empty(), "{bad:?}");
    }
}

#[test]
fn floating_point_dtypes_are_refused_and_the_communicator_stays_usable() {
    let out = on_threads(3, Duration::from_secs(60), |c| {
        let mut kinds = Vec::new();
        for op in ReduceOp::BITWISE {
            let mut x = vec![1.0f32; 6];
            kinds.push(c.all_reduce(&mut x, op).unwrap_err());
            let mut y = vec![1.0f64; 6];
            kinds.push(c.reduce(None, &mut y, op, 0).unwrap_err());
            let mut z = vec![half::bf16::ONE; 6];
            kinds.push(c.reduce_scatter_in_place(&mut z, op).unwrap_err());
        }
        let mut v = vec![c.rank() as u32 + 1; 4];
        c.all_reduce(&mut v, ReduceOp::BitOr).unwrap();
        (kinds, v)
    });
    for (rank, (errors, v)) in out.into_iter().enumerate() {
        for e in errors {
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "rank {rank}: {e}");
            assert!(e.is_usable(), "rank {rank}: {e}");
            assert!(e.to_string().contains("bitwise"), "rank {rank}: {e}");
        }
        assert_eq!(v, vec![1 | 2 | 3; 4], "rank {rank}");
    }
}
