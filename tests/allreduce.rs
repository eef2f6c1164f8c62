//! Allreduce, ranks as threads and as processes, over TCP loopback and over shared memory:
//! every p in {1,2,3,4,5,7,8}, counts {0, 1, 7, 1023, 2^20+3}, every dtype × op, in place and
//! out of place, compared exactly with the naive reference on integer-valued inputs.
//!
//! Ranks as threads run the whole matrix on each transport. Ranks as processes (what checks
//! separate address spaces, the launcher's environment and shared segments between processes)
//! run every dtype × op at the small counts and, at the large count, every op on one dtype of
//! each element width ([`LARGE_DTYPES`]): the schedules split buffers by bytes, and the reduce
//! kernels of every dtype × op are covered by the thread runs and the unit tests.

mod common;

use std::time::Duration;

use chorus::{AllReduceOptions, DType, ReduceOp};
use common::*;

/// One dtype of each element width (1, 2, 4 and 8 bytes), integer and floating point.
const LARGE_DTYPES: [DType; 4] = [DType::Int8, DType::Bfloat16, DType::Float32, DType::Int64];

fn threads_matrix(transport: &'static str) {
    for p in RANKS {
        let bad = on_threads_on(transport, p, Duration::from_secs(300), move |c| {
            if p > 1 {
                assert_eq!(c.transport_name(), transport, "wrong transport");
            }
            sweep(c, &COUNTS)
        });
        assert_no_failures(bad, &format!("{transport} p={p}"));
    }
}

/// The parent spawns p copies of this test binary per p; each child runs the sweep.
fn processes_matrix(test_name: &str, transport: &str) {
    if is_child() {
        let mut c = child_comm();
        if c.size() > 1 {
            assert_eq!(c.transport_name(), transport, "wrong transport");
        }
        let (small, large) = COUNTS.split_at(COUNTS.len() - 1);
        let mut bad = sweep(&mut c, small);
        let default = AllReduceOptions::default();
        bad.extend(sweep_with(
            &mut c,
            large,
            &LARGE_DTYPES,
            &ReduceOp::ALL,
            &default,
        ));
        for b in &bad {
            println!("FAIL {b}");
        }
        assert!(bad.is_empty());
        println!("CHILD-OK rank {}", c.rank());
        return;
    }
    for p in RANKS {
        let job = spawn_job(p, test_name, &[("CHORUS_TRANSPORT", transport.to_string())]);
        let res = wait_job(job, Duration::from_secs(300));
        for (rank, (code, out)) in res.iter().enumerate() {
            assert_eq!(
                *code,
                Some(0),
                "{transport} p={p} rank {rank} failed:\n{out}"
            );
            assert!(
                out.contains("CHILD-OK"),
                "{transport} p={p} rank {rank} did not run the sweep:\n{out}"
            );
        }
    }
}

#[test]
fn threads_tcp() {
    if !is_child() {
        threads_matrix("tcp");
    }
}

#[test]
fn threads_shm() {
    if !is_child() {
        threads_matrix("shm");
    }
}

#[test]
fn processes_tcp() {
    processes_matrix("processes_tcp", "tcp");
}

#[test]
fn processes_shm() {
    processes_matrix("processes_shm", "shm");
}

/// Every schedule ends with the same bits on every rank, also where `a ⊕ b` and `b ⊕ a`
/// differ in their bits: the max of +0 and −0, the sum of NaNs with different payloads.
#[test]
fn every_rank_ends_with_the_same_bits_where_order_shows() {
    for p in [2usize, 3, 4] {
        for algorithm in chorus::Algorithm::ALL {
            let bits = on_threads_on("tcp", p, Duration::from_secs(60), move |c| {
                let r = c.rank();
                let opts = AllReduceOptions {
                    algorithm: Some(algorithm),
                    timeout: None,
                };
                let mut zeros = vec![if r % 2 == 0 { 0.0f32 } else { -0.0 }; 5];
                c.all_reduce_with(None, &mut zeros, ReduceOp::Max, &opts)
                    .expect("max");
                let mut nans = vec![f32::from_bits(0x7fc0_0000 | (r as u32 + 1)); 5];
                c.all_reduce_with(None, &mut nans, ReduceOp::Sum, &opts)
                    .expect("sum");
                zeros
                    .iter()
                    .chain(&nans)
                    .map(|v| v.to_bits())
                    .collect::<Vec<u32>>()
            });
            for (rank, b) in bits.iter().enumerate() {
                assert_eq!(
                    b, &bits[0],
                    "{algorithm:?} p={p}: rank {rank} differs from rank 0"
                );
            }
        }
    }
}
