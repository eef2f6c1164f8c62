//! `CHORUS_TRANSPORT=rdma` on a host where RDMA cannot run (here: no device, and no verbs data
//! path in this release): every rank warns why, falls back to TCP and computes correctly.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn rdma_falls_back_to_tcp_and_says_why() {
    if is_child() {
        let mut c = child_comm();
        let bad = sweep(&mut c, &[0, 1, 7, 1023, 70_001]);
        assert!(bad.is_empty(), "{bad:?}");
        println!("CHILD-OK rank {} over {}", c.rank(), c.transport_name());
        return;
    }
    let job = spawn_job(
        3,
        "rdma_falls_back_to_tcp_and_says_why",
        &[("CHORUS_TRANSPORT", "rdma".to_string())],
    );
    for (rank, (code, out)) in wait_job(job, Duration::from_secs(120)).iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank}:\n{out}");
        assert!(out.contains("CHILD-OK"), "rank {rank}:\n{out}");
        let warning = out
            .lines()
            .find(|l| l.contains("WARN: CHORUS_TRANSPORT=rdma: "))
            .unwrap_or_else(|| panic!("rank {rank} did not say why it runs over TCP:\n{out}"));
        assert!(warning.contains(&format!("rank {rank}]")), "{warning}");
        assert!(warning.contains("; using TCP"), "{warning}");
        println!("{warning}");
        // The ranks, all on this host, keep shared memory between them, as `auto` does.
        assert!(out.contains("over shm"), "rank {rank}:\n{out}");
    }
}
