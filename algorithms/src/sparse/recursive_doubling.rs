//! SparCML's sparse recursive doubling with the dense switch: `log₂p` rounds in which
//! partners exchange their whole running sums as sparse streams.
//!
//! # Words
//! - **running sum**: a rank's [`Acc`] — sorted entries, or dense once it filled in.
//! - **round** `r`: core rank `c` exchanges its running sum with core rank `c XOR 2^r` and both
//!   merge the two; afterwards each holds the sum of its aligned block of `2^(r+1)` core ranks.
//! - **dense switch**: when the two sums hold `len₁ + len₂` entries with
//!   `(len₁+len₂)·(index bytes + 4) ≥ n·4` (a dense operand counts `n`), both partners
//!   continue dense; both see both lengths, so they decide alike.
//! - **fold**: for `p` not a power of two, extra ranks hand their vector to a partner first
//!   and get the result last ([`crate::allreduce::exchange`]).
//!
//! # Steps
//! 1. Fold: an extra rank sends its entries and waits for step 3; its partner merges them.
//! 2. Rounds `r = 0..log₂p'`: exchange running sums with the round's partner, merge.
//! 3. Unfold: the partner sends the result to its extra rank.
//!
//! # Volume and cost
//! Round `r` sends the union of `2^r` vectors: `2k·2^r` words for disjoint indices, `2k`
//! for identical ones, never more than `n` words (the dense switch). In total between
//! `2k·log₂p` and `2k(p−1)` words, capped at `n·log₂p`. Latency `log₂p·α` (+2α folding):
//! the schedule for small vectors and latency-bound cases.

use chorus_transport::Result;

use super::stream::{self, prefers_dense, Acc, Expect, SegView, Stamp};
use super::{finish, tag, Entries, SparseResult};
use crate::allreduce::exchange::Role;
use crate::allreduce::recursive_doubling::Plan;
use crate::cost::{Link, REDUCE_SECONDS_PER_BYTE};
use crate::CollCtx;

/// This schedule's tag id.
const ALG: u64 = 1;
/// Tag step of the fold.
const FOLD_STEP: u64 = 0;
/// Tag step of the unfold.
const UNFOLD_STEP: u64 = 255;

/// The partners of `rank` in a group of `size`: the dense schedule's plan (the sparse
/// exchanges follow the same pairs).
///
/// ```
/// use chorus_algorithms::sparse::recursive_doubling::plan;
/// assert_eq!(plan(0, 4).partners, [1, 2]);
/// assert!(plan(0, 5).partners.is_empty()); // rank 0 folds onto rank 1
/// ```
pub fn plan(rank: usize, size: usize) -> Plan {
    crate::allreduce::recursive_doubling::plan(rank, size)
}

/// The expected number of distinct positions among `m` vectors of `nnz` uniformly random
/// positions in `0..n`.
pub(crate) fn expected_union(n: usize, nnz: usize, m: usize) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let d = (nnz as f64 / n as f64).min(1.0);
    n as f64 * (1.0 - (1.0 - d).powf(m as f64))
}

/// Bytes of a segment of `entries` expected entries of a region of `len` positions.
pub(crate) fn segment_bytes(entries: f64, len: usize) -> f64 {
    let w = stream::index_width(len as u64) as f64;
    (entries * (w + 4.0)).min(len as f64 * 4.0) + stream::HEADER_BYTES as f64
}

/// Modelled time of the schedule for vectors of length `n` with `nnz` uniformly random entries
/// on each of `p` ranks: round `r` moves the expected union of `2^r` vectors (capped by the
/// dense switch) and merges it; folding adds two messages.
pub fn cost(n: usize, nnz: usize, p: usize, link: &Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let core = 1usize << p.ilog2();
    let extra = p - core;
    let per_input = if extra > 0 { 2 } else { 1 };
    let mut t = 0.0;
    for r in 0..core.ilog2() {
        let b = segment_bytes(expected_union(n, nnz, per_input << r), n);
        t += link.alpha + b * (link.beta + REDUCE_SECONDS_PER_BYTE);
    }
    if extra > 0 {
        t += 2.0 * link.alpha
            + segment_bytes(nnz as f64, n) * link.beta
            + segment_bytes(expected_union(n, nnz, p), n) * link.beta;
    }
    t
}

/// Entries of `acc` as the partner counts them for the dense switch: `n` when it is sent
/// dense.
fn sent_count(acc: &Acc, n: u64) -> u64 {
    match acc {
        Acc::Dense(_) => n,
        Acc::Sparse { idx, .. } if prefers_dense(idx.len() as u64, n) => n,
        Acc::Sparse { idx, .. } => idx.len() as u64,
    }
}

/// Merges the partner's segment into `acc` (see the module documentation: dense when the two
/// lengths pass the byte rule, else the sparse union). Both partners compute the same values;
/// the sparse union also the same bits where the order of a sum shows in them (NaN payloads):
/// the lower rank's entries are its first operand on both sides (`other_lower`: the partner
/// is the lower). Dense merges add in place, each side the other's values to its own, which
/// can leave the partners with NaNs of different payloads (or ±0 where both hold −0 and a
/// sparse side turned +0): [`settle_order_bits`] settles those after the last round.
fn merge_in(acc: Acc, mine: u64, other: &SegView<'_>, n: u64, other_lower: bool) -> Acc {
    match acc {
        Acc::Sparse { idx, val } if !prefers_dense(mine.saturating_add(other.count()), n) => {
            // Neither side is dense (a dense operand counts n): the sparse union.
            let (mut oi, mut ov) = (Vec::new(), Vec::new());
            other.append_to(&mut oi, &mut ov, false);
            let (idx, val) = if other_lower {
                stream::merge((&oi, &ov), (&idx, &val))
            } else {
                stream::merge((&idx, &val), (&oi, &ov))
            };
            Acc::Sparse { idx, val }
        }
        // Dense: in place, the partner's values added (bits settled after the last round).
        Acc::Dense(mut d) => {
            other.add_to(&mut d, 0);
            Acc::Dense(d)
        }
        sparse => {
            let mut d = vec![0.0; n as usize];
            sparse.add_to(&mut d, 0);
            other.add_to(&mut d, 0);
            Acc::Dense(d)
        }
    }
}

/// Sends `send` (if any) while receiving a running sum of at most `bound` entries from
/// `from` with tag step `step`; calls `f` on the validated segment.
#[allow(clippy::too_many_arguments)]
fn exchange_with<R>(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    send: Option<(usize, &[u8])>,
    from: usize,
    step: u64,
    bound: u64,
    f: impl FnOnce(&SegView<'_>) -> R,
) -> Result<R> {
    let n = stamp.n;
    let cap = stream::max_segment_bytes(bound, n);
    let deadline = ctx.deadline;
    let t = tag(ctx, ALG, step);
    let (tr, scratch) = ctx.transport_and_scratch(cap)?;
    let sends: Vec<_> = send.map(|(p, b)| (p, t, b)).into_iter().collect();
    let got = super::exchange(tr, deadline, &sends, &mut [(from, t, &mut scratch[..])])?;
    let expect = Expect {
        region: Some((0, n)),
        max_entries: bound,
    };
    let view = SegView::parse(&scratch[..got[0]], from, stamp, expect)?;
    Ok(f(&view))
}

/// Sends `out` to `to` with tag step `step`.
fn send_to(ctx: &mut CollCtx<'_>, to: usize, step: u64, out: &[u8]) -> Result<()> {
    let t = tag(ctx, ALG, step);
    let deadline = ctx.deadline;
    super::exchange(ctx.transport, deadline, &[(to, t, out)], &mut []).map(|_| ())
}

/// Runs the schedule on this rank for `input` (at most `bound` entries on every rank).
pub(crate) fn run(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    input: Entries<'_>,
    bound: u64,
) -> Result<SparseResult> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = input.n;
    let mut acc = Acc::Sparse {
        idx: input.idx.to_vec(),
        val: input.val.to_vec(),
    };
    if size == 1 {
        return Ok(result(acc, n));
    }
    let plan = plan(rank, size);
    let mut out = Vec::new();
    // Entries of the partner's running sum, at most.
    let mut partner_bound = bound.min(n);
    // 1. Fold.
    match plan.fold.role {
        Role::Extra { partner } => {
            acc.encode(&mut out, stamp, 0, n);
            send_to(ctx, partner, FOLD_STEP, &out)?;
            // 3. (extra rank) The result, decoded from the partner's bytes.
            let all = bound.saturating_mul(size as u64).min(n);
            return exchange_with(ctx, stamp, None, partner, UNFOLD_STEP, all, |v| {
                if v.header.dense {
                    let mut d = vec![0.0; n as usize];
                    v.write_to(&mut d);
                    SparseResult::Dense(d)
                } else {
                    let (mut idx, mut val) = (Vec::new(), Vec::new());
                    v.append_to(&mut idx, &mut val, false);
                    finish(n, idx, val)
                }
            });
        }
        Role::Absorb { partner } => {
            let mine = sent_count(&acc, n);
            acc = exchange_with(ctx, stamp, None, partner, FOLD_STEP, partner_bound, |v| {
                merge_in(acc, mine, v, n, partner < rank)
            })?;
        }
        Role::Core => {}
    }
    if plan.fold.extra > 0 {
        partner_bound = partner_bound.saturating_mul(2).min(n);
    }
    // 2. Rounds: exchange running sums, merge.
    for (r, &partner) in plan.partners.iter().enumerate() {
        let mine = sent_count(&acc, n);
        out.clear();
        acc.encode(&mut out, stamp, 0, n);
        let send = Some((partner, &out[..]));
        let step = 1 + r as u64;
        acc = exchange_with(ctx, stamp, send, partner, step, partner_bound, |v| {
            merge_in(acc, mine, v, n, partner < rank)
        })?;
        partner_bound = partner_bound.saturating_mul(2).min(n);
    }
    // The partners of the last round added in place each in its own order: where that shows
    // in the bits (NaN payloads, the sign of a zero), they are settled alike on every rank,
    // before the folded ranks are sent theirs.
    if let Acc::Dense(d) = &mut acc {
        settle_order_bits(d);
    }
    // 3. Unfold.
    if let Role::Absorb { partner } = plan.fold.role {
        out.clear();
        acc.encode(&mut out, stamp, 0, n);
        send_to(ctx, partner, UNFOLD_STEP, &out)?;
    }
    Ok(result(acc, n))
}

/// Gives every NaN the one quiet NaN and every zero the positive sign: the bits in which
/// sums of the same values in other orders can differ (a pass over the values, about a
/// tenth of a dense round's time).
fn settle_order_bits(d: &mut [f32]) {
    for v in d.iter_mut() {
        if v.is_nan() {
            *v = f32::NAN;
        } else if super::mag(*v) == 0 {
            *v = 0.0;
        }
    }
}

/// The final result of a running sum (what its encoding decodes to, bit for bit).
fn result(acc: Acc, n: u64) -> SparseResult {
    match acc {
        Acc::Dense(d) => SparseResult::Dense(d),
        Acc::Sparse { idx, val } => finish(n, idx, val),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partners_pair_up() {
        for size in 1..=17 {
            let plans: Vec<Plan> = (0..size).map(|r| plan(r, size)).collect();
            for (r, p) in plans.iter().enumerate() {
                for (k, &q) in p.partners.iter().enumerate() {
                    assert_eq!(plans[q].partners[k], r);
                }
            }
        }
    }

    #[test]
    fn cost_grows_with_overlap_and_caps_at_dense() {
        let l = Link::GIGABIT_ETHERNET;
        assert_eq!(cost(1000, 10, 1, &l), 0.0);
        let n = 1 << 20;
        // More entries cost more, until the dense switch caps every round at n values.
        let small = cost(n, 100, 8, &l);
        let mid = cost(n, 10_000, 8, &l);
        let full = cost(n, n, 8, &l);
        let beyond = cost(n, 2 * n, 8, &l);
        assert!(small < mid && mid < full);
        assert!((full - beyond).abs() < 1e-12);
        // Dense rounds: log₂p messages of n values.
        let h = stream::HEADER_BYTES as f64;
        let dense = 3.0 * (l.alpha + (n as f64 * 4.0 + h) * (l.beta + REDUCE_SECONDS_PER_BYTE));
        assert!((full - dense).abs() / dense < 1e-9);
        assert!((expected_union(100, 100, 3) - 100.0).abs() < 1e-9);
        assert!((expected_union(100, 10, 1) - 10.0).abs() < 1e-9);
    }
}
