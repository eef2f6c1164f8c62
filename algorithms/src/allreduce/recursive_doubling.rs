//! Recursive doubling allreduce: `log₂p` rounds of whole-buffer exchanges; the schedule for
//! tiny messages, where only the number of messages on the critical path matters.
//!
//! # Words
//! - **round** `k`: core rank `c` exchanges its whole (partially reduced) buffer with core rank
//!   `c XOR 2^k` — one send and one receive posted together — and reduces what it received
//!   into its buffer. After round `k` every core rank holds the reduction of the `2^(k+1)`
//!   inputs of its aligned block of core ranks; after the last, of all of them. Both partners
//!   combine the same two partial results in the same order (the lower rank's first), so
//!   every rank ends with the same bits.
//! - **fold**: for `p` not a power of two, the extra ranks first hand their input to a core
//!   rank and get the result back at the end (see [`super::exchange`]).
//!
//! # Steps (rank `r`, `n` bytes)
//! 1. Fold: an extra rank sends its `n` bytes to its partner and waits for step 4; the
//!    absorbing partner reduces them into its own.
//! 2. Rounds `k = 0..log₂p'`: exchange `n` bytes with the round's partner, reduce.
//! 3. `Avg`: divide by `p`, once, on the core ranks.
//! 4. Unfold: an absorbing rank sends the result to its extra rank.
//!
//! Out of place, round 0 (or the fold) sends straight from the input and copies it to the
//! output just before the first reduction: no other copy is made.
//!
//! # Volume and cost
//! Each core rank sends `log₂p'` messages of `n` bytes (`n·log₂p'` in total), two more on the
//! critical path when folding: `log₂p'·(α + nβ)`, plus `2(α + nβ)` when `p` is not a power of
//! two ([`cost()`]). Cheapest for tiny `n`; the bytes grow with `log p`, so the ring or halving-
//! doubling take over from a few KiB.

use chorus_transport::Result;

use super::exchange::{Exchanger, Fold, Role};
use crate::cost::{self, Link};
use crate::reduce::{finish_avg_bytes, reduce_bytes};
use crate::{CollCtx, DType, ReduceOp};

/// The step-number space of this schedule's tags (see [`super::step_tag`]).
const ALG_ID: u64 = 1;
/// Tag step of the fold.
const FOLD_STEP: u64 = 0;
/// Tag step of the unfold.
const UNFOLD_STEP: u64 = 0xfff;

/// A rank's recursive-doubling schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Its part in folding the group onto a power of two.
    pub fold: Fold,
    /// The group rank it exchanges with in each round (empty for an extra rank).
    pub partners: Vec<usize>,
}

/// The recursive-doubling schedule of `rank` in a group of `size` (it does not depend on the
/// buffer size).
///
/// ```
/// use chorus_algorithms::allreduce::recursive_doubling::plan;
/// assert_eq!(plan(0, 4).partners, [1, 2]);
/// assert_eq!(plan(1, 3).partners, [2]); // rank 1 absorbs rank 0, then pairs with 2
/// assert!(plan(0, 3).partners.is_empty());
/// ```
///
/// # Panics
/// If `rank >= size`.
pub fn plan(rank: usize, size: usize) -> Plan {
    let fold = Fold::new(rank, size);
    let partners = match fold.core_rank {
        Some(c) => (0..fold.core_size.ilog2())
            .map(|k| fold.core_to_rank(c ^ (1 << k)))
            .collect(),
        None => Vec::new(),
    };
    Plan { fold, partners }
}

/// The modelled time of a recursive-doubling allreduce of `bytes` bytes over `ranks` ranks
/// (see [`cost::recursive_doubling_allreduce`]).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    cost::recursive_doubling_allreduce(bytes, ranks, link)
}

/// Runs the recursive-doubling allreduce on this rank (arguments as
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
    let plan = plan(rank, size);
    let tag = |s: u64| ctx.tag(super::step_tag(ALG_ID, s));
    let (fold_tag, unfold_tag) = (tag(FOLD_STEP), tag(UNFOLD_STEP));
    let round_tags: Vec<_> = (0..plan.partners.len() as u64)
        .map(|k| tag(1 + k))
        .collect();
    let deadline = ctx.deadline;
    let (t, scratch) = ctx.transport_and_scratch(n)?;
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
            let mine = fresh.unwrap_or(recv);
            ex.exchange(Some((partner, fold_tag, mine)), None)?;
            // 4. (extra rank) The final result, already divided for `Avg`.
            return ex.exchange(None, Some((partner, unfold_tag, recv)));
        }
        Role::Absorb { partner } => {
            ex.send_recv_reduce(None, (partner, fold_tag), recv, fresh, None)?;
            fresh = None;
        }
        Role::Core => {}
    }
    // 2. Rounds: exchange whole buffers, reduce.
    for (&partner, &rtag) in plan.partners.iter().zip(&round_tags) {
        let mine = fresh.unwrap_or(recv);
        ex.exchange_to_scratch(Some((partner, rtag, mine)), (partner, rtag), n)?;
        if let Some(input) = fresh.take() {
            recv.copy_from_slice(input);
        }
        // The lower rank's partial result first on both sides: `a ⊕ b` and `b ⊕ a` can differ
        // in their bits (max of +0 and −0, the payload of two NaNs), and the partners must end
        // with the same.
        if partner < rank {
            reduce_bytes(dtype, op, &mut ex.scratch[..n], recv);
            recv.copy_from_slice(&ex.scratch[..n]);
        } else {
            reduce_bytes(dtype, op, recv, &ex.scratch[..n]);
        }
    }
    // 3. Divide once.
    if op == ReduceOp::Avg {
        finish_avg_bytes(dtype, recv, size);
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

    /// Simulates the group's plans on sets of contributions (bit `r`: rank `r`'s input).
    fn check_group(size: usize) {
        let plans: Vec<Plan> = (0..size).map(|r| plan(r, size)).collect();
        let full: u128 = if size == 128 {
            u128::MAX
        } else {
            (1 << size) - 1
        };
        let mut have: Vec<u128> = (0..size).map(|r| 1 << r).collect();
        // Fold.
        for (r, p) in plans.iter().enumerate() {
            if let Role::Absorb { partner } = p.fold.role {
                assert_eq!(have[r] & have[partner], 0);
                have[r] |= have[partner];
            }
        }
        let rounds = plans[size - 1].partners.len();
        assert_eq!(1 << rounds, plans[0].fold.core_size);
        for k in 0..rounds {
            let before = have.clone();
            for (r, p) in plans.iter().enumerate() {
                if p.fold.core_rank.is_none() {
                    assert!(p.partners.is_empty());
                    continue;
                }
                let q = p.partners[k];
                assert_eq!(plans[q].partners[k], r, "round {k}: partners pair up");
                assert_eq!(
                    before[r] & before[q],
                    0,
                    "rank {r} round {k}: counted twice"
                );
                have[r] = before[r] | before[q];
            }
        }
        // Unfold.
        for (r, p) in plans.iter().enumerate() {
            if let Role::Extra { partner } = p.fold.role {
                have[r] = have[partner];
            }
        }
        assert!(have.iter().all(|&h| h == full), "{have:?}");
    }

    #[test]
    fn small_groups() {
        for size in 1..=17 {
            check_group(size);
        }
    }

    proptest! {
        #[test]
        fn every_rank_gets_every_input_once(size in 1usize..=128) {
            check_group(size);
        }
    }
}
