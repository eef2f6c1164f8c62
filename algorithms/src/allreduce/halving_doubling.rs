//! Recursive halving-doubling allreduce (Rabenseifner): a reduce-scatter by recursive
//! halving, then an allgather by recursive doubling. The bytes of the ring in `2·log₂p`
//! messages instead of `2(p−1)`: the schedule for mid-size messages.
//!
//! # Words
//! - **block**: the buffer of `count` elements is cut into `p'` blocks (the core size, see
//!   fold), block `b` laid out as the ring's chunk `b` ([`super::ring::chunk_range`]). A rank's
//!   **range** is a run of consecutive blocks; it starts as all `p'` blocks.
//! - **halving step** (mask `m = p'/2, p'/4, …, 1`): core rank `c` pairs with `c XOR m`, splits
//!   its range in two, keeps the lower half if bit `m` of `c` is clear (the upper one
//!   otherwise), sends the other half and reduces the partner's copy of the kept half into its
//!   own, segment by segment as it arrives. After the last step core rank `c` owns block `c`,
//!   fully reduced.
//! - **doubling step** (mask `m = 1, 2, …, p'/2`): the halving steps in reverse; each rank sends
//!   its range and receives the partner's (the half it gave away), doubling what it holds.
//! - **fold**: for `p` not a power of two, the extra ranks hand their input to a core rank first
//!   and get the result back at the end (see [`super::exchange`]).
//!
//! # Steps (rank `r`, `n` bytes)
//! 1. Fold (extra and absorbing ranks only): `n` bytes to the absorbing rank, reduced there.
//! 2. `log₂p'` halving steps of `n/2, n/4, …, n/p'` bytes; the last one divides the owned
//!    block by `p` for `Avg` (each element once).
//! 3. `log₂p'` doubling steps of `n/p', …, n/2` bytes, received straight into the output.
//! 4. Unfold: `n` bytes back to each extra rank.
//!
//! Out of place, the first halving step sends from the input and copies the kept half into
//! the output segment by segment just before reducing it; the other half is overwritten by the
//! doubling steps, so nothing else is copied.
//!
//! # Volume and cost
//! Each core rank sends `2(p'−1)/p'·n` bytes in `2·log₂p'` messages:
//! `2·log₂p'·α + 2(p'−1)/p'·nβ`, plus `2(α + nβ)` when folding ([`cost()`]).

use std::ops::Range;

use chorus_transport::Result;

use super::exchange::{Exchanger, Fold, Role};
use super::ring::{chunk_range, split_pair};
use crate::cost::{self, Link};
use crate::{CollCtx, DType, ReduceOp};

/// The step-number space of this schedule's tags (see [`super::step_tag`]).
const ALG_ID: u64 = 2;
/// Tag step of the fold.
const FOLD_STEP: u64 = 0;
/// Tag step of the unfold.
const UNFOLD_STEP: u64 = 0xfff;

/// One exchange with a partner: what goes out, where what comes in lands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The partner's group rank.
    pub peer: usize,
    /// Byte range of the buffer sent.
    pub send: Range<usize>,
    /// Byte range the partner's message is for (reduced into, or overwritten).
    pub recv: Range<usize>,
}

/// A rank's halving-doubling schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Its part in folding the group onto a power of two.
    pub fold: Fold,
    /// The halving steps (reduce the message into `recv`); empty for an extra rank.
    pub halving: Vec<Step>,
    /// The doubling steps (copy the message into `recv`); empty for an extra rank.
    pub doubling: Vec<Step>,
    /// The byte range fully reduced here after the halving steps (`None` for an extra rank).
    pub owned: Option<Range<usize>>,
}

/// The halving-doubling schedule of `rank` in a group of `size` for `count` elements of
/// `elem_size` bytes.
///
/// ```
/// use chorus_algorithms::allreduce::halving_doubling::plan;
/// let p = plan(2, 4, 8, 4); // core rank 2 of 4; blocks of 2 elements (8 bytes)
/// assert_eq!((p.halving[0].peer, p.halving[0].recv.clone()), (0, 16..32));
/// assert_eq!((p.halving[1].peer, p.halving[1].recv.clone()), (3, 16..24));
/// assert_eq!(p.owned, Some(16..24));
/// assert_eq!(p.doubling[0].send, 16..24);
/// assert_eq!(p.doubling[1].recv, 0..16);
/// ```
///
/// # Panics
/// If `rank >= size`.
pub fn plan(rank: usize, size: usize, count: usize, elem_size: usize) -> Plan {
    let fold = Fold::new(rank, size);
    let Some(c) = fold.core_rank else {
        return Plan {
            fold,
            halving: Vec::new(),
            doubling: Vec::new(),
            owned: None,
        };
    };
    let q = fold.core_size;
    // Byte range of blocks lo..hi.
    let blocks = |lo: usize, hi: usize| {
        chunk_range(lo, q, count, elem_size).start..chunk_range(hi, q, count, elem_size).start
    };
    let (mut lo, mut hi) = (0, q);
    let mut halving = Vec::new();
    let mut mask = q / 2;
    while mask > 0 {
        let mid = (lo + hi) / 2;
        let (keep, give) = if c & mask == 0 {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        halving.push(Step {
            peer: fold.core_to_rank(c ^ mask),
            send: blocks(give.0, give.1),
            recv: blocks(keep.0, keep.1),
        });
        (lo, hi) = keep;
        mask /= 2;
    }
    let doubling = halving
        .iter()
        .rev()
        .map(|s| Step {
            peer: s.peer,
            send: s.recv.clone(),
            recv: s.send.clone(),
        })
        .collect();
    Plan {
        fold,
        halving,
        doubling,
        owned: Some(blocks(lo, hi)),
    }
}

/// The modelled time of a halving-doubling allreduce of `bytes` bytes over `ranks` ranks (see
/// [`cost::halving_doubling_allreduce`]).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    cost::halving_doubling_allreduce(bytes, ranks, link)
}

/// Runs the halving-doubling allreduce on this rank (arguments as
/// [`crate::allreduce::run`], which validates them).
pub fn run(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = recv.len();
    if size == 1 || n == 0 {
        if let Some(input) = send {
            recv.copy_from_slice(input);
        }
        return Ok(());
    }
    let plan = plan(rank, size, n / dtype.size(), dtype.size());
    let steps = plan.halving.len() as u64;
    let tag = |s: u64| ctx.tag(super::step_tag(ALG_ID, s));
    let (fold_tag, unfold_tag) = (tag(FOLD_STEP), tag(UNFOLD_STEP));
    let tags: Vec<_> = (0..2 * steps).map(|k| tag(1 + k)).collect();
    let deadline = ctx.deadline;
    // The fold receives `n` bytes, the first halving step at most half of them.
    let scratch_len = match plan.fold.role {
        Role::Core => plan.halving.first().map_or(0, |s| s.recv.len()),
        _ => n,
    };
    let (t, scratch) = ctx.transport_and_scratch(scratch_len)?;
    let mut ex = Exchanger {
        t,
        deadline,
        dtype,
        op,
        scratch,
    };
    // `fresh`: the input, while the output does not hold this rank's data yet.
    let mut fresh = send;

    // 1. Fold.
    match plan.fold.role {
        Role::Extra { partner } => {
            ex.exchange(Some((partner, fold_tag, fresh.unwrap_or(&*recv))), None)?;
            // 4. (extra rank) The final result, already divided for `Avg`.
            return ex.exchange(None, Some((partner, unfold_tag, recv)));
        }
        Role::Absorb { partner } => {
            ex.send_recv_reduce(None, (partner, fold_tag), recv, fresh, None)?;
            fresh = None;
        }
        Role::Core => {}
    }
    // 2. Halving: send the half given away, reduce the partner's copy of the kept half.
    for (k, s) in plan.halving.iter().enumerate() {
        let avg = (op == ReduceOp::Avg && k + 1 == plan.halving.len()).then_some(size);
        let tag = tags[k];
        match fresh.take() {
            Some(input) => {
                let (src, dst) = (&input[s.send.clone()], &mut recv[s.recv.clone()]);
                let own = Some(&input[s.recv.clone()]);
                ex.send_recv_reduce(Some((s.peer, tag, src)), (s.peer, tag), dst, own, avg)?;
            }
            None => {
                let (src, dst) = split_pair(recv, s.send.clone(), s.recv.clone());
                ex.send_recv_reduce(Some((s.peer, tag, src)), (s.peer, tag), dst, None, avg)?;
            }
        }
    }
    // 3. Doubling: send what is held, receive the partner's part in place.
    for (k, s) in plan.doubling.iter().enumerate() {
        let tag = tags[plan.halving.len() + k];
        let (src, dst) = split_pair(recv, s.send.clone(), s.recv.clone());
        ex.exchange(Some((s.peer, tag, src)), Some((s.peer, tag, dst)))?;
    }
    // 4. Unfold.
    if let Role::Absorb { partner } = plan.fold.role {
        ex.exchange(Some((partner, unfold_tag, recv)), None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Simulates the group's plans on sets of contributions per element (bit `r`: rank `r`'s
    /// input), with one-byte elements.
    fn check_group(size: usize, count: usize) {
        let plans: Vec<Plan> = (0..size).map(|r| plan(r, size, count, 1)).collect();
        let full: u64 = if size == 64 {
            u64::MAX
        } else {
            (1 << size) - 1
        };
        let mut have: Vec<Vec<u64>> = (0..size).map(|r| vec![1 << r; count]).collect();
        for (r, p) in plans.iter().enumerate() {
            if let Role::Absorb { partner } = p.fold.role {
                let theirs = have[partner].clone();
                for (mine, t) in have[r].iter_mut().zip(theirs) {
                    assert_eq!(*mine & t, 0);
                    *mine |= t;
                }
            }
        }
        let steps = plans[size - 1].halving.len();
        for k in 0..steps {
            let before = have.clone();
            for (r, p) in plans.iter().enumerate().filter(|(_, p)| p.owned.is_some()) {
                let (s, q) = (&p.halving[k], &plans[p.halving[k].peer].halving[k]);
                assert_eq!(q.peer, r);
                assert_eq!(q.send, s.recv, "rank {r} step {k}: sizes agree");
                assert!(s.send.end <= s.recv.start || s.recv.end <= s.send.start);
                for i in s.recv.clone() {
                    assert_eq!(before[r][i] & before[s.peer][i], 0, "counted twice");
                    have[r][i] = before[r][i] | before[s.peer][i];
                }
            }
        }
        for (r, p) in plans.iter().enumerate() {
            if let Some(o) = &p.owned {
                assert!(o.clone().all(|i| have[r][i] == full), "rank {r} owns {o:?}");
            }
        }
        for k in 0..steps {
            let before = have.clone();
            for (r, p) in plans.iter().enumerate().filter(|(_, p)| p.owned.is_some()) {
                let (s, q) = (&p.doubling[k], &plans[p.doubling[k].peer].doubling[k]);
                assert_eq!(q.send, s.recv);
                for i in s.recv.clone() {
                    assert_eq!(before[s.peer][i], full, "doubling forwards final data");
                    have[r][i] = full;
                }
            }
        }
        for (r, p) in plans.iter().enumerate() {
            if let Role::Extra { partner } = p.fold.role {
                have[r] = have[partner].clone();
            }
        }
        for (r, h) in have.iter().enumerate() {
            assert!(h.iter().all(|&m| m == full), "rank {r}: {h:?}");
        }
    }

    #[test]
    fn small_groups() {
        for size in 1..=17 {
            for count in [0, 1, 2, 3, 7, 8, 9, 31, 100] {
                check_group(size, count);
            }
        }
    }

    #[test]
    fn halving_sizes_halve() {
        let p = plan(0, 8, 800, 4);
        let lens: Vec<usize> = p.halving.iter().map(|s| s.send.len()).collect();
        assert_eq!(lens, [1600, 800, 400]);
        assert_eq!(p.owned, Some(0..400));
    }

    proptest! {
        #[test]
        fn every_element_reduced_once(size in 1usize..=40, count in 0usize..300) {
            check_group(size, count);
        }
    }
}
