//! Every allreduce algorithm through the communicator over TCP loopback and over shared memory
//! (ranks as threads),
//! against the naive reference: p ∈ {1,2,3,4,5,7,8} × counts {0, 1, 7, 1023} × every dtype ×
//! op, in place and out of place, plus a large odd count on a few dtype/op pairs; one
//! communicator per p, reused for every algorithm and case. Also: the selector's choice is the
//! same on every rank and follows `CHORUS_ALGO`.

mod common;

use std::time::Duration;

use chorus::{Algorithm, AllReduceOptions, Communicator, DType, ReduceOp};
use common::*;

const SMALL: [usize; 4] = [0, 1, 7, 1023];
const LARGE: usize = (1 << 18) + 3;

#[test]
fn every_algorithm_matches_the_reference_over_tcp() {
    every_algorithm("tcp");
}

/// The same schedules over shared-memory messages (an explicit algorithm bypasses the direct
/// same-host allreduce, so the message schedules themselves run over shm).
#[test]
fn every_algorithm_matches_the_reference_over_shm() {
    every_algorithm("shm");
}

fn every_algorithm(transport: &'static str) {
    for p in RANKS {
        let bad = on_threads_on(transport, p, Duration::from_secs(300), |c| {
            let mut bad = Vec::new();
            for alg in Algorithm::ALL {
                let opts = AllReduceOptions {
                    algorithm: Some(alg),
                    ..Default::default()
                };
                bad.extend(sweep_with(c, &SMALL, &DType::ALL, &ReduceOp::ALL, &opts));
                let (f32s, halves) = ([DType::Float32], [DType::Bfloat16, DType::Int64]);
                bad.extend(sweep_with(c, &[LARGE], &f32s, &[ReduceOp::Sum], &opts));
                bad.extend(sweep_with(c, &[LARGE], &halves, &[ReduceOp::Avg], &opts));
            }
            bad
        });
        assert_no_failures(bad, &format!("{transport} p={p}"));
    }
}

/// What a rank's selector chose for a few sizes.
fn choices(c: &mut Communicator) -> Vec<Algorithm> {
    [0usize, 8, 4096, 1 << 16, 1 << 20, 1 << 26]
        .iter()
        .map(|&b| c.selected_algorithm(b))
        .collect()
}

#[test]
fn every_rank_selects_the_same_algorithm() {
    for p in [2, 3, 4] {
        let all = on_threads(p, Duration::from_secs(60), |c| {
            // The measured link is agreed on, so the tables are identical.
            let link = c.selector().link();
            assert!(link.alpha > 0.0 && link.beta > 0.0, "{link:?}");
            let picks = choices(c);
            // Default options use the selector's choice and give the right result.
            assert!(check_one::<f32>(c, 5000, ReduceOp::Sum, true) == 0);
            (picks, link.alpha.to_bits(), link.beta.to_bits())
        });
        assert!(all.windows(2).all(|w| w[0] == w[1]), "p={p}: {all:?}");
        // Tiny messages never go to the ring when other schedules are allowed (2(p−1) latencies
        // against log₂p) — unless p = 2, where they coincide.
        if p > 2 {
            assert_ne!(all[0].0[1], Algorithm::Ring, "p={p}: {all:?}");
        }
    }
}

#[test]
fn chorus_algo_edits_the_table() {
    // Through the per-communicator config (the environment is process-wide).
    let picks = on_threads_with_algo(3, "allreduce:ring");
    assert!(
        picks.iter().flatten().all(|&a| a == Algorithm::Ring),
        "{picks:?}"
    );
    let picks = on_threads_with_algo(3, "^ring,tree,double_tree");
    assert!(
        picks
            .iter()
            .flatten()
            .all(|&a| a == Algorithm::HalvingDoubling || a == Algorithm::RecursiveDoubling),
        "{picks:?}"
    );
}

/// Selector choices of every rank of a group whose config sets `CHORUS_ALGO` to `algo`.
fn on_threads_with_algo(size: usize, algo: &'static str) -> Vec<Vec<Algorithm>> {
    let server = store();
    let addr = server.local_addr();
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut cfg = config(rank, size, addr);
                cfg.algo = Some(algo.to_string());
                let mut c = Communicator::new(cfg).expect("communicator");
                let picks = choices(&mut c);
                c.barrier().expect("barrier");
                picks
            })
        })
        .collect();
    // Bounded: every rank has the config's timeouts (60 s) on each wait.
    handles
        .into_iter()
        .map(|h| h.join().expect("rank panicked"))
        .collect()
}
