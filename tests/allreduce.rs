//! Allreduce, ranks as threads and as processes, over TCP loopback and over shared memory:
//! every p in {1,2,3,4,5,7,8}, counts {0, 1, 7, 1023, 2^20+3}, every dtype × op, in place and
//! out of place, compared exactly with the naive reference on integer-valued inputs.

mod common;

use std::time::Duration;

use common::*;

fn threads_matrix(transport: &'static str) {
    for p in RANKS {
        let bad = on_threads_on(transport, p, Duration::from_secs(300), move |c| {
            if p > 1 {
                assert_eq!(c.transport_name(), transport, "wrong transport");
            }
            sweep(c, &COUNTS)
        });
        let bad: Vec<String> = bad.into_iter().flatten().collect();
        assert!(
            bad.is_empty(),
            "{transport} p={p}: {} failures, first: {:?}",
            bad.len(),
            &bad[..bad.len().min(5)]
        );
    }
}

/// The parent spawns p copies of this test binary per p; each child runs the sweep.
fn processes_matrix(test_name: &str, transport: &str) {
    if is_child() {
        let mut c = child_comm();
        if c.size() > 1 {
            assert_eq!(c.transport_name(), transport, "wrong transport");
        }
        let bad = sweep(&mut c, &COUNTS);
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
