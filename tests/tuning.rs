//! Online tuning of the allreduce schedule (`chorus::select`), ranks as threads over TCP:
//! results stay exact through the trial and the steady phases, every rank settles on the same
//! schedule, forced schedules and `set_tuning(false)` are never tuned, and ranks that disagree
//! about tuning fail with an error instead of mixing messages. No timing is asserted: which
//! schedule wins depends on the machine.

mod common;

use std::time::{Duration, Instant};

use chorus::{Algorithm, AllReduceOptions, Communicator, ErrorKind, ReduceOp};
use common::*;

const WATCHDOG: Duration = Duration::from_secs(240);

/// Element counts (f32/i32) landing in different buckets: tiny, small, mid (dedicated trials)
/// and above `DEDICATED_MAX_BYTES` (tuned on the caller's calls, or, on ranks that do not
/// outnumber the cores, decided by the model where it ties the ring and halving-doubling).
const COUNTS: [usize; 5] = [1, 7, 1023, 65_539, (1 << 20) + 5];
/// Calls per count: enough to go through every online trial (at most one block per schedule:
/// an untimed call and `ONLINE_CPU_BOUND_RUNS` timed ones where ranks outnumber cores, as
/// these threads do on small machines) and stay in the steady phase.
const CALLS: usize = Algorithm::ALL.len() * (chorus::select::ONLINE_CPU_BOUND_RUNS + 1) + 2;

/// The schedule every bucket settled on, per rank.
fn tune_and_check(c: &mut Communicator) -> Vec<Option<Algorithm>> {
    c.set_tuning(true);
    for &count in &COUNTS {
        for call in 0..CALLS {
            // Alternate in place and out of place, integers and floats (exact either way).
            let wrong = if call % 2 == 0 {
                check_one::<f32>(c, count, ReduceOp::Sum, call % 4 == 0)
            } else {
                check_one::<i32>(c, count, ReduceOp::Sum, false)
            };
            assert_eq!(wrong, 0, "rank {} count {count} call {call}", c.rank());
        }
    }
    COUNTS
        .iter()
        .map(|&n| {
            let bytes = n * 4;
            let t = c.tuned_algorithm(bytes);
            assert_eq!(Some(c.selected_algorithm(bytes)), t);
            t
        })
        .collect()
}

#[test]
fn ranks_agree_through_trial_and_steady_phases() {
    for p in [2, 3, 4, 5] {
        let per_rank = on_threads(p, WATCHDOG, tune_and_check);
        for (r, got) in per_rank.iter().enumerate() {
            assert!(got.iter().all(Option::is_some), "p={p} rank {r}: {got:?}");
            assert_eq!(got, &per_rank[0], "p={p}: rank {r} disagrees with rank 0");
        }
    }
}

#[test]
fn revisits_keep_results_exact_and_ranks_in_step() {
    // The ring and halving-doubling send the same messages at p=2, so the trials keep the
    // other as a rival and a long run of calls goes through revisits (the rival's calls, the
    // agreement, maybe a switch). Every call must stay exact, and the ranks must hold the same
    // schedule after every call.
    for p in [2, 3] {
        let out = on_threads_cfg(
            p,
            WATCHDOG,
            move |rank, addr| {
                let mut c = config(rank, p, addr);
                c.algo = Some("ring,halving_doubling".into());
                c
            },
            |c| {
                c.set_tuning(true);
                let mut held = Vec::with_capacity(400);
                for call in 0..400 {
                    let wrong = if call % 3 == 0 {
                        check_one::<f32>(c, 301, ReduceOp::Sum, call % 2 == 0)
                    } else {
                        check_one::<i32>(c, 301, ReduceOp::Sum, call % 2 == 0)
                    };
                    assert_eq!(wrong, 0, "rank {} call {call}", c.rank());
                    held.push(c.tuned_algorithm(1204));
                }
                held
            },
        );
        for (r, held) in out.iter().enumerate() {
            assert!(held.iter().all(Option::is_some), "p={p} rank {r}");
            assert_eq!(held, &out[0], "p={p}: rank {r} holds another schedule");
        }
    }
}

#[test]
fn forced_and_disabled_paths_are_not_tuned() {
    // The option forces a schedule without touching the bucket; tuning off keeps the model's
    // choice; CHORUS_ALGO naming one schedule leaves nothing to tune.
    let out = on_threads(3, WATCHDOG, |c| {
        c.set_tuning(true);
        let forced = AllReduceOptions {
            algorithm: Some(Algorithm::Ring),
            ..Default::default()
        };
        for _ in 0..4 {
            assert_eq!(
                check_one_with::<f32>(c, 1000, ReduceOp::Sum, true, &forced),
                0
            );
        }
        assert_eq!(c.tuned_algorithm(4000), None);
        c.set_tuning(false);
        assert!(!c.tuning());
        for _ in 0..4 {
            assert_eq!(check_one::<f32>(c, 30_000, ReduceOp::Max, false), 0);
            assert_eq!(check_one::<i32>(c, 300_000, ReduceOp::Sum, true), 0);
        }
        assert_eq!(c.tuned_algorithm(120_000), None);
        assert_eq!(c.tuned_algorithm(1_200_000), None);
        assert_eq!(
            c.selected_algorithm(120_000),
            c.selector().select(120_000),
            "the model's choice"
        );
        // Tuning on again: the next call of the bucket tunes it.
        c.set_tuning(true);
        assert_eq!(check_one::<f32>(c, 1000, ReduceOp::Sum, false), 0);
        c.tuned_algorithm(4000)
    });
    assert!(
        out[0].is_some() && out.iter().all(|a| *a == out[0]),
        "{out:?}"
    );

    let out = on_threads_cfg(
        3,
        WATCHDOG,
        |rank, addr| {
            let mut c = config(rank, 3, addr);
            c.algo = Some("allreduce:tree".into());
            c
        },
        |c| {
            for count in [1, 5000, 300_000] {
                assert_eq!(check_one::<f32>(c, count, ReduceOp::Sum, true), 0);
            }
            [4, 20_000, 1_200_000].map(|b| c.selected_algorithm(b))
        },
    );
    assert!(
        out.iter().flatten().all(|&a| a == Algorithm::Tree),
        "{out:?}"
    );

    // A subset: tuning chooses within it.
    let out = on_threads_cfg(
        3,
        WATCHDOG,
        |rank, addr| {
            let mut c = config(rank, 3, addr);
            c.algo = Some("ring,recursive_doubling".into());
            c
        },
        |c| {
            c.set_tuning(true);
            for _ in 0..4 {
                assert_eq!(check_one::<i32>(c, 2000, ReduceOp::Sum, false), 0);
            }
            c.tuned_algorithm(8000)
        },
    );
    assert!(
        out.iter().all(|a| *a == out[0])
            && matches!(out[0], Some(Algorithm::Ring | Algorithm::RecursiveDoubling)),
        "{out:?}"
    );
}

#[test]
fn ranks_that_disagree_about_tuning_fail_instead_of_mixing() {
    let start = Instant::now();
    let out = on_threads_cfg(
        3,
        WATCHDOG,
        |rank, addr| {
            let mut c = config(rank, 3, addr);
            c.timeout = Duration::from_secs(20);
            c
        },
        |c| {
            c.set_tuning(c.rank() != 1);
            let mut v = vec![c.rank() as f32; 500];
            let r = c.all_reduce(&mut v, ReduceOp::Sum);
            (r.map_err(|e| e.kind()), c.is_usable())
        },
    );
    for (rank, (r, usable)) in out.iter().enumerate() {
        let kind = r.expect_err("a rank that disagrees about tuning must fail, not mix data");
        assert!(
            matches!(kind, ErrorKind::Mismatch | ErrorKind::Remote),
            "rank {rank}: {kind:?}"
        );
        assert!(!usable, "rank {rank}");
    }
    // Told by what arrived, not by waiting out the 20 s timeout.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}
