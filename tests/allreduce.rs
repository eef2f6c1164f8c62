//! Allreduce over TCP loopback, ranks as threads and as processes: every p in {1,2,3,4,5,7,8},
//! counts {0, 1, 7, 1023, 2^20+3}, every dtype × op, in place and out of place, compared
//! exactly with the naive reference on integer-valued inputs.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn threads_full_matrix() {
    for p in RANKS {
        let bad = on_threads(p, Duration::from_secs(300), |c| sweep(c, &COUNTS));
        let bad: Vec<String> = bad.into_iter().flatten().collect();
        assert!(
            bad.is_empty(),
            "p={p}: {} failures, first: {:?}",
            bad.len(),
            &bad[..bad.len().min(5)]
        );
    }
}

/// The process variant: the parent spawns p copies of this test binary, each runs the sweep.
#[test]
fn processes_full_matrix() {
    if is_child() {
        let mut c = child_comm();
        let bad = sweep(&mut c, &COUNTS);
        for b in &bad {
            println!("FAIL {b}");
        }
        assert!(bad.is_empty());
        println!("CHILD-OK rank {}", c.rank());
        return;
    }
    for p in RANKS {
        let job = spawn_job(p, "processes_full_matrix", &[]);
        let res = wait_job(job, Duration::from_secs(300));
        for (rank, (code, out)) in res.iter().enumerate() {
            assert_eq!(*code, Some(0), "p={p} rank {rank} failed:\n{out}");
            assert!(
                out.contains("CHILD-OK"),
                "p={p} rank {rank} did not run the sweep:\n{out}"
            );
        }
    }
}
