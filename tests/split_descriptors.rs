//! Communicators made by `dup` and dropped hold on to no file descriptors: the only test of
//! its binary, so that no other test opens or closes descriptors while it counts the
//! process's.

mod common;

use std::time::Duration;

use chorus::ReduceOp;

use common::*;

#[test]
fn copies_made_and_dropped_keep_no_descriptors() {
    let out = on_threads(3, Duration::from_secs(120), |c| {
        let fds = || {
            std::fs::read_dir("/proc/self/fd")
                .expect("/proc/self/fd lists this process's descriptors")
                .count()
        };
        let mut wrong = 0;
        // The three ranks are threads of this process: count at quiet points, between
        // barriers. One copy first, so that whatever a first use sets up once is there.
        drop(c.dup().unwrap_or_else(|e| panic!("{e}")));
        c.barrier().unwrap();
        let before = fds();
        c.barrier().unwrap();
        for _ in 0..8 {
            let mut d = c.dup().unwrap_or_else(|e| panic!("{e}"));
            wrong += check_one::<i32>(&mut d, 3, ReduceOp::Sum, true);
            drop(d);
            c.barrier().unwrap();
        }
        let after = fds();
        c.barrier().unwrap();
        (wrong, before, after)
    });
    for (rank, (wrong, before, after)) in out.into_iter().enumerate() {
        assert_eq!(wrong, 0, "rank {rank}");
        // Each copy of 3 ranks holds at least 4 descriptors per rank while it lives (sockets
        // to 2 peers, the store's); eight leaked copies would add dozens.
        assert!(
            after <= before + 2,
            "rank {rank}: {before} -> {after} descriptors"
        );
    }
}
