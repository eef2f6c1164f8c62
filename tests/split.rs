//! `Communicator::split` and `dup`, ranks as threads over TCP and shared memory: the groups'
//! membership and order (by key, ties by rank), collectives on the new communicators
//! interleaved with the parent's, nested splits, a rank with no color, independence (the
//! parent dropped first, a copy dropped first), and a split that other ranks do not make.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::{Communicator, ErrorKind, ReduceOp};

use common::*;

const WATCHDOG: Duration = Duration::from_secs(120);

/// What the ranks of a new communicator learn about it: (its rank, its size, the parent
/// ranks of its members in its rank order, gathered through the new communicator itself).
fn members_through(child: &mut Communicator, parent_rank: usize) -> (usize, usize, Vec<u64>) {
    let mut all = vec![u64::MAX; child.size()];
    child
        .all_gather(&[parent_rank as u64], &mut all)
        .unwrap_or_else(|e| panic!("{e}"));
    (child.rank(), child.size(), all)
}

/// The parent ranks of color `rank % 2` among `p`, ordered by key `-rank`.
fn want_members(p: usize, rank: usize) -> Vec<u64> {
    (0..p as u64)
        .rev()
        .filter(|r| r % 2 == (rank % 2) as u64)
        .collect()
}

#[test]
fn split_by_parity_in_reverse_order() {
    for transport in ["tcp", "shm"] {
        for p in [1, 2, 3, 4, 5, 7] {
            let out = on_threads_on(transport, p, WATCHDOG, move |c| {
                let rank = c.rank();
                let mut child = c
                    .split(Some((rank % 2) as u32), -(rank as i64))
                    .unwrap_or_else(|e| panic!("{e}"))
                    .expect("a color gives a communicator");
                let seen = members_through(&mut child, rank);
                // Collectives on the child, checked against the naive reference for its size,
                // with the parent's in between.
                let mut wrong = check_one::<f32>(&mut child, 1023, ReduceOp::Sum, false);
                wrong += check_one::<i32>(c, 7, ReduceOp::Max, true);
                wrong += check_one::<f64>(&mut child, 100_003, ReduceOp::Avg, true);
                let mut b = [rank as u32; 3];
                child.broadcast(&mut b, 0).unwrap_or_else(|e| panic!("{e}"));
                // Split the child again: every second of its ranks, in its own order.
                let cr = child.rank();
                let grand = child
                    .split((cr % 2 == 0).then_some(0), 0)
                    .unwrap_or_else(|e| panic!("{e}"));
                let grand_seen = grand.map(|mut g| {
                    wrong += check_one::<i64>(&mut g, 1, ReduceOp::Sum, false);
                    (g.rank(), g.size())
                });
                wrong += check_one::<f32>(c, 1 << 16, ReduceOp::Sum, false);
                (rank, seen, b[0], grand_seen, wrong)
            });
            for (rank, (cr, cs, members), root_value, grand, wrong) in out {
                let want = want_members(p, rank);
                let at = want.iter().position(|&r| r == rank as u64).unwrap();
                assert_eq!((cr, cs), (at, want.len()), "{transport} p={p} rank {rank}");
                assert_eq!(members, want, "{transport} p={p} rank {rank}");
                assert_eq!(root_value as u64, want[0], "{transport} p={p} rank {rank}");
                let want_grand = (at % 2 == 0).then_some((at / 2, want.len().div_ceil(2)));
                assert_eq!(grand, want_grand, "{transport} p={p} rank {rank}");
                assert_eq!(wrong, 0, "{transport} p={p} rank {rank}");
            }
        }
    }
}

#[test]
fn equal_keys_keep_the_parent_order_and_no_color_gives_none() {
    let out = on_threads(5, WATCHDOG, |c| {
        let rank = c.rank();
        // Rank 2 joins nothing; the others one group, keys 1 1 - 0 0.
        let color = (rank != 2).then_some(7);
        let key = i64::from(rank < 2);
        let child = c.split(color, key).unwrap_or_else(|e| panic!("{e}"));
        let seen = child.map(|mut g| {
            let s = members_through(&mut g, rank);
            assert_eq!(check_one::<u8>(&mut g, 7, ReduceOp::Max, true), 0);
            s
        });
        // The parent is still whole.
        assert_eq!(check_one::<f32>(c, 1023, ReduceOp::Sum, true), 0);
        (rank, seen)
    });
    for (rank, seen) in out {
        if rank == 2 {
            assert!(seen.is_none());
            continue;
        }
        let (cr, cs, members) = seen.expect("a group");
        assert_eq!(members, vec![3, 4, 0, 1]);
        assert_eq!(cs, 4);
        assert_eq!(members[cr], rank as u64);
    }
}

#[test]
fn dup_is_independent_of_its_parent() {
    // The copy dropped first: the parent goes on. (That copies hold on to no descriptors is
    // tested alone in its process: tests/split_descriptors.rs.)
    let out = on_threads(3, WATCHDOG, |c| {
        let mut wrong = 0;
        let mut d = c.dup().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.rank(), d.size()), (c.rank(), c.size()));
        wrong += check_one::<f32>(&mut d, 4099, ReduceOp::Sum, false);
        wrong += check_one::<f32>(c, 4099, ReduceOp::Min, false);
        drop(d);
        wrong += check_one::<f32>(c, 17, ReduceOp::Sum, true);
        wrong
    });
    for (rank, wrong) in out.into_iter().enumerate() {
        assert_eq!(wrong, 0, "rank {rank}");
    }
}

#[test]
fn the_new_communicator_outlives_its_parent() {
    let p = 4;
    let server = store();
    let addr = server.local_addr();
    let (tx, rx) = mpsc::channel();
    for rank in 0..p {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(move || {
                let mut parent = Communicator::new(config(rank, p, addr)).expect("communicator");
                let mut child = parent
                    .split(Some((rank / 2) as u32), rank as i64)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .expect("a color");
                // Everyone drops the parent (the children's stores are their own, hosted by
                // parent ranks 0 and 2), then the children run.
                parent.barrier().unwrap();
                drop(parent);
                let mut v = vec![(rank + 1) as f32; 1000];
                child.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                let want = if rank < 2 { 3.0 } else { 7.0 };
                v.iter().all(|&x| x == want)
            });
            let _ = tx.send((rank, r.is_ok_and(|ok| ok)));
        });
    }
    drop(tx);
    let deadline = Instant::now() + WATCHDOG;
    for _ in 0..p {
        let (rank, ok) = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("every rank within the watchdog");
        assert!(ok, "rank {rank}");
    }
    drop(server);
}

#[test]
fn a_split_the_others_do_not_make_fails_everywhere() {
    // Rank 0 calls a barrier while the others split: with and without CHORUS_CHECK_CALLS,
    // every rank gets an error (a mismatch, or the error its peers' abort brings) in time.
    for check in [true, false] {
        let make = move |rank, addr| {
            let mut cfg = config(rank, 3, addr);
            cfg.check_calls = check;
            cfg.timeout = Duration::from_secs(20);
            cfg
        };
        let out = on_threads_cfg(3, WATCHDOG, make, |c| {
            let t = Instant::now();
            let r = if c.rank() == 0 {
                c.barrier().err()
            } else {
                c.split(Some(0), 0).err()
            };
            (r, t.elapsed())
        });
        for (rank, (err, took)) in out.into_iter().enumerate() {
            let e = err.unwrap_or_else(|| panic!("check={check} rank {rank}: no error"));
            if check {
                assert_eq!(e.kind(), ErrorKind::Mismatch, "rank {rank}: {e}");
                assert!(e.to_string().contains("split"), "rank {rank}: {e}");
            }
            assert!(took < Duration::from_secs(15), "rank {rank}: {took:?}");
        }
    }
}

#[test]
fn a_bad_color_on_one_rank_fails_the_split_everywhere_at_once() {
    let out = on_threads(4, WATCHDOG, |c| {
        let t = Instant::now();
        let color = if c.rank() == 2 { -7 } else { 0 };
        let r = c.split_raw(color, 0).err();
        // Everyone still usable: a barrier, then a good split.
        c.barrier().unwrap();
        let again = c.split(Some(0), 0).unwrap().map(|g| g.size());
        (r, t.elapsed(), again)
    });
    for (rank, (err, took, again)) in out.into_iter().enumerate() {
        let e = err.unwrap_or_else(|| panic!("rank {rank}: no error"));
        let want = if rank == 2 {
            ErrorKind::InvalidArgument
        } else {
            ErrorKind::Mismatch
        };
        assert_eq!(e.kind(), want, "rank {rank}: {e}");
        assert!(e.to_string().contains("color"), "rank {rank}: {e}");
        assert!(e.is_usable(), "rank {rank}: {e}");
        // Nothing waited for the 60 s timeout of the test configuration.
        assert!(took < Duration::from_secs(20), "rank {rank}: {took:?}");
        assert_eq!(again, Some(4), "rank {rank}");
    }
}

#[test]
fn split_by_host_on_one_host_keeps_everyone() {
    for transport in ["tcp", "shm"] {
        let out = on_threads_on(transport, 3, WATCHDOG, |c| {
            let mut local = c.split_by_host().unwrap_or_else(|e| panic!("{e}"));
            let wrong = check_one::<i32>(&mut local, 1023, ReduceOp::Sum, false);
            (c.rank(), local.rank(), local.size(), wrong)
        });
        for (rank, local_rank, local_size, wrong) in out {
            assert_eq!((local_rank, local_size, wrong), (rank, 3, 0), "{transport}");
        }
    }
}

/// Ranks as processes that say they are on two hosts (`CHORUS_HOSTID` by parity):
/// `split_by_host` groups them by host, in rank order.
#[test]
fn split_by_host_groups_ranks_by_host() {
    const NAME: &str = "split_by_host_groups_ranks_by_host";
    if is_child() {
        let mut c = child_comm();
        let rank = c.rank();
        let mut local = c.split_by_host().unwrap_or_else(|e| panic!("{e}"));
        let (lr, ls, members) = members_through(&mut local, rank);
        let want: Vec<u64> = (0..5u64).filter(|r| r % 2 == (rank % 2) as u64).collect();
        assert_eq!(members, want, "rank {rank}");
        assert_eq!((lr, ls), (rank / 2, want.len()), "rank {rank}");
        println!("HOST-GROUP-OK {rank}");
        return;
    }
    let job = spawn_job_with(5, NAME, |rank| {
        vec![("CHORUS_HOSTID", format!("test-host-{}", rank % 2))]
    });
    for (rank, (code, out)) in wait_job(job, WATCHDOG).into_iter().enumerate() {
        assert_eq!(code, Some(0), "rank {rank}:\n{out}");
        assert!(
            out.contains(&format!("HOST-GROUP-OK {rank}")),
            "rank {rank}:\n{out}"
        );
    }
}

/// With the link configured and the allreduce forced (no collective at init), a copy that its
/// first rank, which hosts the copy's store, drops at once still comes up on every other rank
/// (they meet before init returns, so the store outlives their reads).
#[test]
fn a_copy_dropped_at_once_by_its_store_host_comes_up_everywhere() {
    let got = on_threads_owned(
        4,
        Duration::from_secs(120),
        |r, a| {
            let mut c = config_on(r, 4, a, "tcp");
            c.alpha_us = Some(50.0);
            c.beta_gbps = Some(1.0);
            c.algo = Some("allreduce:ring".into());
            c
        },
        |mut c| {
            let rank = c.rank();
            let mut failed = Vec::new();
            for k in 0..30 {
                match c.dup() {
                    Ok(d) if rank == 0 => drop(d),
                    Ok(d) => {
                        std::thread::sleep(Duration::from_millis(2));
                        drop(d);
                    }
                    Err(e) => failed.push(format!("copy {k}: {e}")),
                }
                c.barrier().expect("barrier");
            }
            failed
        },
    );
    for (rank, failed) in got.iter().enumerate() {
        assert!(failed.is_empty(), "rank {rank}: {failed:?}");
    }
}

/// The new group of a split failing to start (here its members disagree on `CHORUS_TUNE`,
/// which rank 1 changed after the parent started) leaves the communicator split usable: the
/// error says so, names this rank in its numbering, and the parent's next call runs.
#[test]
fn a_new_group_that_fails_to_start_leaves_the_parent_usable() {
    if is_child() {
        let mut cfg = chorus::Config::from_env().expect("config from env");
        cfg.host_store = Some(false);
        let mut c = Communicator::new(cfg).expect("parent");
        let rank = c.rank();
        if rank == 1 {
            std::env::set_var("CHORUS_TUNE", "0");
        }
        // Reversed keys: the new group numbers the ranks the other way round.
        let e = c.split(Some(0), -(rank as i64)).map(|_| ()).unwrap_err();
        println!(
            "SPLIT-ERROR usable={} rank={:?} peer={:?} {e}",
            e.is_usable(),
            e.rank(),
            e.peer()
        );
        let mut v = vec![1.0f32; 4];
        c.all_reduce(&mut v, ReduceOp::Sum)
            .expect("the parent still runs");
        println!("PARENT-SUM {}", v[0]);
        return;
    }
    let job = spawn_job_with(
        3,
        "a_new_group_that_fails_to_start_leaves_the_parent_usable",
        |_| vec![("CHORUS_INIT_TIMEOUT", "30".to_string())],
    );
    let done = wait_job(job, Duration::from_secs(120));
    for (rank, (code, out)) in done.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank}:\n{out}");
        assert!(
            out.contains(&format!("SPLIT-ERROR usable=true rank=Some({rank})")),
            "rank {rank}:\n{out}"
        );
        assert!(out.contains("CHORUS_TUNE"), "rank {rank}:\n{out}");
        assert!(out.contains("PARENT-SUM 3"), "rank {rank}:\n{out}");
    }
}
