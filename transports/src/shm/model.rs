//! Exhaustive interleaving checks of the shared-memory protocols (a model check in place of
//! `loom`): each protocol is written as small per-rank state machines over shared variables, and
//! a depth-first search runs every interleaving of their steps (visited states are memoised),
//! asserting the safety property at every step and the absence of lost wake-ups / deadlocks at
//! the end. Steps are atomic and sequentially consistent: the code pairs every publication with
//! release/acquire and every sleep/wake decision with a `SeqCst` fence, which is what makes the
//! sequentially consistent model the right one for those decisions.
//!
//! 1. [`sleep_wake_never_loses_a_wakeup`]: the *sleeping* flag / bell / futex handshake of
//!    `ShmTransport::stall` and `notify`.
//! 2. [`ring_never_overwrites_or_reads_early`]: the ring's head/tail counters with wrap-around.
//! 3. [`direct_allreduce_halves_are_never_overwritten_early`]: progress counters and the two
//!    arena halves of the direct allreduce (small and large rounds mixed).

use std::collections::HashSet;
use std::hash::Hash;

/// Explores every interleaving from `init`. `step(state, t)` returns the successor when thread
/// `t` can move (None: finished or blocked) and panics if a safety property breaks; `done`
/// tells whether a state with no enabled step is a correct end (otherwise: deadlock).
fn explore<S: Clone + Eq + Hash>(
    init: S,
    threads: usize,
    step: impl Fn(&S, usize) -> Option<S>,
    done: impl Fn(&S) -> bool,
) -> usize {
    let mut seen = HashSet::new();
    let mut stack = vec![init];
    while let Some(s) = stack.pop() {
        if !seen.insert(s.clone()) {
            continue;
        }
        let mut any = false;
        for t in 0..threads {
            if let Some(n) = step(&s, t) {
                any = true;
                stack.push(n);
            }
        }
        assert!(
            any || done(&s),
            "deadlock or lost wake-up in a reachable state"
        );
        assert!(
            seen.len() < 5_000_000,
            "state space too large for the model"
        );
    }
    seen.len()
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct SleepWake {
    // shared
    cond: bool,
    sleeping: bool,
    bell: u32,
    /// The waiter is inside futex_wait (compared equal and went to sleep).
    asleep: bool,
    // waiter
    w_pc: u8,
    w_snap: u32,
    // waker
    k_pc: u8,
    k_saw_sleeping: bool,
}

#[test]
fn sleep_wake_never_loses_a_wakeup() {
    let init = SleepWake {
        cond: false,
        sleeping: false,
        bell: 0,
        asleep: false,
        w_pc: 0,
        w_snap: 0,
        k_pc: 0,
        k_saw_sleeping: false,
    };
    let states = explore(
        init,
        2,
        |s, t| {
            let mut n = s.clone();
            if t == 0 {
                // Waiter (stall + re-check): check; arm; re-check; futex_wait; disarm.
                match s.w_pc {
                    0 => {
                        n.w_pc = if s.cond { 10 } else { 1 };
                    }
                    1 => {
                        n.sleeping = true;
                        n.w_pc = 2;
                    }
                    2 => {
                        n.w_snap = s.bell;
                        n.w_pc = 3;
                    }
                    3 => {
                        // The caller re-drives its ops before sleeping.
                        n.w_pc = if s.cond { 9 } else { 4 };
                    }
                    4 => {
                        // futex_wait: sleeps only if the bell still equals the snapshot.
                        if s.bell == s.w_snap {
                            n.asleep = true;
                            n.w_pc = 5;
                        } else {
                            n.w_pc = 9;
                        }
                    }
                    5 => {
                        if s.asleep {
                            return None; // blocked until woken (timeouts not modelled)
                        }
                        n.w_pc = 9;
                    }
                    9 => {
                        n.sleeping = false;
                        n.w_pc = 0;
                    }
                    _ => return None,
                }
            } else {
                // Waker (publish + notify): cond = 1; fence; load sleeping; bump bell; wake.
                match s.k_pc {
                    0 => {
                        n.cond = true;
                        n.k_pc = 1;
                    }
                    1 => {
                        n.k_saw_sleeping = s.sleeping;
                        n.k_pc = if s.sleeping { 2 } else { 4 };
                    }
                    2 => {
                        n.bell = s.bell.wrapping_add(1);
                        n.k_pc = 3;
                    }
                    3 => {
                        n.asleep = false;
                        n.k_pc = 4;
                    }
                    _ => return None,
                }
            }
            Some(n)
        },
        |s| s.w_pc == 10 && s.k_pc == 4,
    );
    assert!(states > 20, "{states}");
}

/// Producer writes `MSGS` values through a ring of `RING` slots; consumer reads them.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct RingModel {
    slots: [u8; 3],
    head: u8,
    tail: u8,
    // producer
    p_pos: u8,
    p_tail_seen: u8,
    p_pc: u8,
    // consumer
    c_pos: u8,
    c_head_seen: u8,
    c_pc: u8,
}

#[test]
fn ring_never_overwrites_or_reads_early() {
    const RING: u8 = 3;
    const MSGS: u8 = 7;
    let init = RingModel {
        slots: [0; 3],
        head: 0,
        tail: 0,
        p_pos: 0,
        p_tail_seen: 0,
        p_pc: 0,
        c_pos: 0,
        c_head_seen: 0,
        c_pc: 0,
    };
    explore(
        init,
        2,
        |s, t| {
            let mut n = s.clone();
            if t == 0 {
                if s.p_pos == MSGS && s.head == MSGS {
                    return None;
                }
                match s.p_pc {
                    // load tail (acquire)
                    0 => {
                        n.p_tail_seen = s.tail;
                        n.p_pc = 1;
                    }
                    // write one byte if there is room, or publish what was written
                    1 => {
                        let used = s.p_pos - s.p_tail_seen;
                        assert!(used <= RING);
                        if used < RING && s.p_pos < MSGS {
                            let slot = (s.p_pos % RING) as usize;
                            // The consumer must have finished with this slot.
                            assert!(
                                s.p_pos < RING || s.tail > s.p_pos - RING,
                                "producer overwrote an unconsumed slot"
                            );
                            n.slots[slot] = s.p_pos + 1;
                            n.p_pos += 1;
                        } else {
                            n.p_pc = 2;
                        }
                    }
                    // publish head (release)
                    _ => {
                        n.head = s.p_pos;
                        n.p_pc = 0;
                    }
                }
            } else {
                if s.c_pos == MSGS {
                    return None;
                }
                match s.c_pc {
                    0 => {
                        n.c_head_seen = s.head;
                        n.c_pc = if s.head > s.c_pos { 1 } else { 0 };
                        if n == *s {
                            return None; // spinning on an unchanged head: blocked
                        }
                    }
                    1 => {
                        if s.c_pos < s.c_head_seen {
                            let v = s.slots[(s.c_pos % RING) as usize];
                            assert_eq!(
                                v,
                                s.c_pos + 1,
                                "consumer read a slot before it was written"
                            );
                            n.c_pos += 1;
                        } else {
                            n.c_pc = 2;
                        }
                    }
                    _ => {
                        n.tail = s.c_pos;
                        n.c_pc = 0;
                    }
                }
            }
            Some(n)
        },
        |s| s.c_pos == MSGS && s.head == MSGS,
    );
}

/// Ranks run `ROUNDS` rounds of the direct allreduce; round kinds alternate small (one phase)
/// and large (two phases). Each arena half holds the round number last written there.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Arena {
    half: [[u8; 2]; 3],
    progress: [u8; 3],
    pc: [u8; 3],
    round: [u8; 3],
}

fn large(round: u8) -> bool {
    round % 3 != 1
}

#[test]
fn direct_allreduce_halves_are_never_overwritten_early() {
    for ranks in [2usize, 3] {
        check_arena(ranks, 2);
    }
}

/// The negative control: with a single half, a fast rank overwrites what a slow one still
/// reads, and the model must find it.
#[test]
#[should_panic(expected = "overwritten")]
fn one_half_would_be_overwritten_early() {
    check_arena(2, 1);
}

fn check_arena(ranks: usize, halves: u8) {
    const ROUNDS: u8 = 5;
    {
        let init = Arena {
            half: [[u8::MAX; 2]; 3],
            progress: [0; 3],
            pc: [0; 3],
            round: [0; 3],
        };
        // Progress a rank has after finishing `rounds` rounds.
        let phases = |rounds: u8| -> u8 { (0..rounds).map(|r| 1 + large(r) as u8).sum() };
        explore(
            init,
            ranks,
            |s, r| {
                let t = s.round[r];
                if t == ROUNDS {
                    return None;
                }
                let h = (t % halves) as usize;
                let base = phases(t);
                let all_reached = |v: u8| (0..ranks).all(|k| s.progress[k] >= v);
                // Invariant: a rank between a wait and its next publication (pc 3 or 5) is
                // reading every rank's half of its round, which must still hold that round.
                for k in 0..ranks {
                    if s.pc[k] == 3 || s.pc[k] == 5 {
                        let hk = (s.round[k] % halves) as usize;
                        for m in 0..ranks {
                            assert_eq!(
                                s.half[m][hk], s.round[k],
                                "rank {k} reads rank {m}'s half while it is overwritten"
                            );
                        }
                    }
                }
                let mut n = s.clone();
                match s.pc[r] {
                    // copy-in: write my half h
                    0 => {
                        n.half[r][h] = t;
                        n.pc[r] = 1;
                    }
                    // publish
                    1 => {
                        n.progress[r] = base + 1;
                        n.pc[r] = 2;
                    }
                    // wait for everyone's copy-in, then read (pc 3)
                    2 => {
                        if !all_reached(base + 1) {
                            return None;
                        }
                        n.pc[r] = 3;
                    }
                    // reading done: small rounds end here, large ones publish the reduce
                    3 if large(t) => {
                        n.progress[r] = base + 2;
                        n.pc[r] = 4;
                    }
                    3 => {
                        n.pc[r] = 0;
                        n.round[r] = t + 1;
                    }
                    // large: wait for everyone's reduce, then copy out (pc 5)
                    4 => {
                        if !all_reached(base + 2) {
                            return None;
                        }
                        n.pc[r] = 5;
                    }
                    _ => {
                        n.pc[r] = 0;
                        n.round[r] = t + 1;
                    }
                }
                Some(n)
            },
            |s| s.round.iter().take(ranks).all(|&t| t == ROUNDS),
        );
    }
}
