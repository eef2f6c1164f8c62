//! Ok-Topk's two-phase sparse allreduce: a reduce-scatter over balanced index regions, then a
//! balanced allgatherv. For top-k the owners keep only the entries above a global threshold,
//! which bounds what every rank moves by `6k(p−1)/p` words.
//!
//! # Words
//! - **region** `j`: `bounds[j]..bounds[j+1]`, owned by rank `j`. The bounds are
//!   **balanced**: the nnz-weighted means of the ranks' index quantiles, agreed with a small
//!   allreduce ([`boundaries`]); top-k re-balances every `rebalance_every` steps.
//! - **global list**: the kept entries of every region, concatenated in region order
//!   (= index order); `K` entries, owner `j` holding `counts[j]` of them.
//! - **chunk** `r`: the positions `⌊K·r/p⌋..⌊K·(r+1)/p⌋` of the global list, which rank `r`
//!   holds after balancing ([`balance_plan`]).
//! - **threshold** (top-k): a magnitude `t`; owners keep the summed entries with `|v| ≥ t`.
//!   Exact (the k-th largest magnitude over all regions, found by a radix select over
//!   allreduced histograms) every `exact_every` steps, and whenever the estimate kept more
//!   than `k` or fewer than `k/2` entries; between, the previous one, corrected by how many
//!   it kept.
//!
//! # Steps (rank `r`)
//! 1. (when due) Agree on balanced bounds: allreduce `p` numbers.
//! 2. Split and reduce (step 1 of [`super::split_allgather`]): each region's entries to
//!    its owner, which sums them.
//! 3. Keep: every entry (sparse allreduce) or those above the threshold (top-k); allreduce
//!    the per-owner counts.
//! 4. Balance: send the parts of this rank's kept entries that belong to other chunks.
//! 5. Allgatherv: send the chunk to every rank while receiving theirs; every rank decodes
//!    the same bytes into the result.
//!
//! # Volume (top-k, `k` entries per rank, balanced regions, `K ≤ k` kept)
//! Step 2 sends and receives about `k(p−1)/p` entries, step 4 at most `K/p`… `K(p−1)/p`
//! (little when the regions are balanced), step 5 `K(p−1)/p`: at most `6k(p−1)/p` words
//! (index + value each), plus segment headers and the small allreduces.

use std::ops::Range;

use chorus_transport::{Result, Tag, TransportError};

use super::split_allgather::{split_and_sum_volume, split_reduce};
use super::stream::{self, Acc, Expect, SegView, Stamp};
use super::{assemble, exchange_into_scratch, mag, tag, Entries, SparseResult};
use crate::allreduce::{self, Algorithm};
use crate::cost::{recursive_doubling_allreduce, Link};
use crate::{CollCtx, Element, ReduceOp};

/// This schedule's tag id.
const ALG: u64 = 3;
const SPLIT_STEP: u64 = 0;
const BALANCE_STEP: u64 = 1;
const GATHER_STEP: u64 = 2;

/// This rank's contribution to the balanced bounds: `[m, m·q₁, …, m·q_{p−1}]` for its `m`
/// sorted indices, `q_j` the index at position `⌊j·m/p⌋`.
///
/// ```
/// use chorus_algorithms::sparse::two_phase::quantile_sums;
/// assert_eq!(quantile_sums(&[0, 10, 20, 30], 2), [4.0, 80.0]);
/// ```
pub fn quantile_sums(idx: &[u64], p: usize) -> Vec<f64> {
    let m = idx.len();
    let mut s = Vec::with_capacity(p);
    s.push(m as f64);
    for j in 1..p {
        let q = if m == 0 { 0 } else { idx[j * m / p] };
        s.push(m as f64 * q as f64);
    }
    s
}

/// The `p + 1` region bounds of `0..n` from the summed [`quantile_sums`] of all ranks: the
/// nnz-weighted mean quantiles, rounded and made non-decreasing; uniform when no rank has an
/// entry.
///
/// ```
/// use chorus_algorithms::sparse::two_phase::boundaries;
/// assert_eq!(boundaries(&[8.0, 160.0], 100, 2), [0, 20, 100]);
/// assert_eq!(boundaries(&[0.0, 0.0], 100, 2), [0, 50, 100]);
/// ```
pub fn boundaries(sums: &[f64], n: u64, p: usize) -> Vec<u64> {
    if sums.len() != p || sums[0] <= 0.0 || !sums.iter().all(|s| s.is_finite()) {
        return super::split_allgather::plan(n, p);
    }
    let mut b = Vec::with_capacity(p + 1);
    b.push(0u64);
    for &s in &sums[1..] {
        let q = (s / sums[0]).round();
        let q = if q.is_finite() && q > 0.0 {
            q.min(n as f64) as u64
        } else {
            0
        };
        let prev = *b.last().unwrap_or(&0);
        b.push(q.clamp(prev, n));
    }
    b.push(n);
    b
}

/// Who sends what in the balancing step (step 4), for one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalancePlan {
    /// The positions of the global list this rank holds afterwards.
    pub chunk: Range<u64>,
    /// `(rank, positions in this rank's own kept list)` to send.
    pub sends: Vec<(usize, Range<u64>)>,
    /// `(owner, entries)` making up the chunk, in owner order (the owner may be this rank).
    pub pieces: Vec<(usize, u64)>,
}

/// Chunk `r` of a global list of `total` entries over `p` ranks.
pub fn chunk(total: u64, p: usize, r: usize) -> Range<u64> {
    let at = |j: usize| (total as u128 * j as u128 / p as u128) as u64;
    at(r)..at(r + 1)
}

fn intersect(a: &Range<u64>, b: &Range<u64>) -> Range<u64> {
    a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start))
}

/// The balancing plan of `rank` when owner `j` kept `counts[j]` entries.
///
/// ```
/// use chorus_algorithms::sparse::two_phase::balance_plan;
/// // Rank 0 kept all 6 entries; 3 ranks end with 2 each.
/// let p = balance_plan(&[6, 0, 0], 0);
/// assert_eq!(p.sends, [(1, 2..4), (2, 4..6)]);
/// assert_eq!(balance_plan(&[6, 0, 0], 2).pieces, [(0, 2)]);
/// ```
pub fn balance_plan(counts: &[u64], rank: usize) -> BalancePlan {
    let p = counts.len();
    let total = counts.iter().fold(0u64, |a, &c| a.saturating_add(c));
    let mut owned = Vec::with_capacity(p);
    let mut at = 0u64;
    for &c in counts {
        owned.push(at..at.saturating_add(c));
        at = at.saturating_add(c);
    }
    let mine = chunk(total, p, rank);
    let own = &owned[rank];
    let sends = (0..p)
        .filter(|&q| q != rank)
        .filter_map(|q| {
            let i = intersect(own, &chunk(total, p, q));
            (!i.is_empty()).then(|| (q, i.start - own.start..i.end - own.start))
        })
        .collect();
    let pieces = (0..p)
        .filter_map(|j| {
            let i = intersect(&owned[j], &mine);
            (!i.is_empty()).then_some((j, i.end - i.start))
        })
        .collect();
    BalancePlan {
        chunk: mine,
        sends,
        pieces,
    }
}

/// Modelled time for vectors of length `n` with `nnz` uniformly random entries on each of
/// `p` ranks, every entry kept: two small allreduces (bounds, counts), the split round and the
/// allgatherv at `(p−1)α` each, and a balancing message.
pub fn cost(n: usize, nnz: usize, p: usize, link: &Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    2.0 * recursive_doubling_allreduce(8 * p, p, link)
        + (2.0 * (p as f64 - 1.0) + 1.0) * link.alpha
        + split_and_sum_volume(n, nnz, p, link)
}

/// Sums `v` over all ranks (a small recursive-doubling allreduce).
pub(crate) fn allreduce_sum<T: Element>(ctx: &mut CollCtx<'_>, v: &mut [T]) -> Result<()> {
    let bytes = bytemuck::cast_slice_mut(v);
    allreduce::run(
        Algorithm::RecursiveDoubling,
        ctx,
        None,
        bytes,
        T::DTYPE,
        ReduceOp::Sum,
    )
}

/// Step 1: the balanced bounds for this call's indices (identical on every rank).
pub(crate) fn agree_bounds(ctx: &mut CollCtx<'_>, idx: &[u64], n: u64) -> Result<Vec<u64>> {
    let p = ctx.transport.size();
    let mut sums = quantile_sums(idx, p);
    allreduce_sum(ctx, &mut sums)?;
    Ok(boundaries(&sums, n, p))
}

/// The entries of `acc` (region starting at `start`) with magnitude bits `≥ t` (`t ≥ 1`: zeros
/// are never kept).
fn keep(acc: &Acc, start: u64, t: u32) -> (Vec<u64>, Vec<f32>) {
    let t = t.max(1);
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    match acc {
        Acc::Sparse { idx: i, val: v } => {
            for (&i, &v) in i.iter().zip(v) {
                if mag(v) >= t {
                    idx.push(i);
                    val.push(v);
                }
            }
        }
        Acc::Dense(d) => {
            for (k, &v) in d.iter().enumerate() {
                if mag(v) >= t {
                    idx.push(start + k as u64);
                    val.push(v);
                }
            }
        }
    }
    (idx, val)
}

/// Checks the allreduced per-owner counts: this rank's own, no owner above its region's
/// length, and all of them together at most `max_count` (the entries of every rank: they
/// size buffers, so a peer's garbage must not make a rank allocate for a vector of `n`
/// entries when a few were passed). Garbage from a peer is a [`TransportError::Protocol`]
/// error (naming the next rank: the allreduce does not tell which one sent it).
fn check_counts(
    counts: &[u64],
    bounds: &[u64],
    rank: usize,
    mine: usize,
    max_count: u64,
) -> Result<()> {
    let bad = counts
        .iter()
        .enumerate()
        .find(|&(j, &c)| c > bounds[j + 1] - bounds[j] || (j == rank && c != mine as u64));
    let garbage = |what: String| TransportError::Protocol {
        peer: (rank + 1) % counts.len(),
        what,
    };
    if let Some((j, &c)) = bad {
        return Err(garbage(format!(
            "two-phase: the allreduced count of rank {j} is {c} (region of {}, this rank kept \
             {mine}): a peer sent garbage",
            bounds[j + 1] - bounds[j]
        )));
    }
    let total = counts.iter().fold(0u64, |a, &c| a.saturating_add(c));
    if total > max_count {
        return Err(garbage(format!(
            "two-phase: the allreduced counts add up to {total} entries, more than the \
             {max_count} the ranks passed: a peer sent garbage"
        )));
    }
    Ok(())
}

/// Steps 3–5 for `mine`, this rank's kept entries, every owner's count being `counts` (owner
/// `j` of region `bounds[j]..bounds[j+1]`), at most `max_count` in all.
pub(crate) fn balanced_allgatherv(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    mine: (&[u64], &[f32]),
    counts: &[u64],
    bounds: &[u64],
    max_count: u64,
) -> Result<SparseResult> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = stamp.n;
    check_counts(counts, bounds, rank, mine.0.len(), max_count)?;
    let plan = balance_plan(counts, rank);
    // 4. Balance.
    let t = tag(ctx, ALG, BALANCE_STEP);
    let mut out = Vec::new();
    let mut ends = Vec::with_capacity(plan.sends.len());
    for (_, r) in &plan.sends {
        let (idx, val) = (
            &mine.0[r.start as usize..r.end as usize],
            &mine.1[r.start as usize..r.end as usize],
        );
        let (s, e) = (idx[0], idx[idx.len() - 1] + 1);
        stream::encode_sparse(&mut out, stamp, s, e - s, idx, val);
        ends.push(out.len());
    }
    let sends: Vec<(usize, Tag, &[u8])> = plan
        .sends
        .iter()
        .enumerate()
        .map(|(k, (q, _))| (*q, t, &out[if k == 0 { 0 } else { ends[k - 1] }..ends[k]]))
        .collect();
    let incoming: Vec<(usize, u64)> = plan
        .pieces
        .iter()
        .copied()
        .filter(|&(j, _)| j != rank)
        .collect();
    let caps: Vec<usize> = incoming
        .iter()
        .map(|&(_, c)| stream::max_segment_bytes(c, n))
        .collect();
    let from = incoming.iter().map(|&(j, _)| j);
    let msgs = exchange_into_scratch(ctx, t, &sends, from, &caps)?;
    // The chunk: the pieces in owner order.
    let want = plan.chunk.end - plan.chunk.start;
    let (mut cidx, mut cval) = (
        Vec::with_capacity(want as usize),
        Vec::with_capacity(want as usize),
    );
    let mut received = incoming.iter().zip(&msgs);
    let own_start = counts[..rank].iter().sum::<u64>();
    for &(j, c) in &plan.pieces {
        let before = cidx.len();
        if j == rank {
            let from = plan.chunk.start.max(own_start) - own_start;
            let r = from as usize..(from + c) as usize;
            cidx.extend_from_slice(&mine.0[r.clone()]);
            cval.extend_from_slice(&mine.1[r]);
        } else if let Some((&(peer, _), &b)) = received.next() {
            // Owner `j`'s entries lie in its region, so the pieces in owner order are sorted.
            let expect = Expect {
                region: None,
                max_entries: c,
            };
            let v = SegView::parse(b, peer, stamp, expect)?;
            v.append_to(&mut cidx, &mut cval, true);
            let region = bounds[j]..bounds[j + 1];
            let bad = if cidx.len() - before != c as usize {
                Some(format!(
                    "{} entries where {c} were expected",
                    cidx.len() - before
                ))
            } else if let Some(&i) = cidx[before..].iter().find(|&&i| !region.contains(&i)) {
                Some(format!(
                    "index {i} outside the region {region:?} of rank {j}, whose entries it sent"
                ))
            } else {
                None
            };
            if let Some(what) = bad {
                return Err(TransportError::Protocol {
                    peer,
                    what: format!("two-phase balancing: {what}"),
                });
            }
        }
        // Every piece in order after the one before it (the own piece too: a peer's piece
        // before it was checked against its owner's region, which lies below this rank's).
        if before > 0 && cidx.get(before).is_some_and(|&i| i <= cidx[before - 1]) {
            return Err(TransportError::Protocol {
                peer: if j == rank { (rank + 1) % size } else { j },
                what: "two-phase balancing: entries out of order".into(),
            });
        }
    }
    // 5. Allgatherv.
    let t = tag(ctx, ALG, GATHER_STEP);
    out.clear();
    if let (Some(&s), Some(&e)) = (cidx.first(), cidx.last()) {
        stream::encode_sparse(&mut out, stamp, s, e + 1 - s, &cidx, &cval);
    }
    let peers: Vec<usize> = (0..size)
        .filter(|&j| j != rank && !chunk(plan_total(counts), size, j).is_empty())
        .collect();
    let sends: Vec<(usize, Tag, &[u8])> = if out.is_empty() {
        Vec::new()
    } else {
        (0..size)
            .filter(|&j| j != rank)
            .map(|j| (j, t, &out[..]))
            .collect()
    };
    let total = plan_total(counts);
    let caps: Vec<usize> = peers
        .iter()
        .map(|&j| {
            let c = chunk(total, size, j);
            stream::max_segment_bytes(c.end - c.start, n)
        })
        .collect();
    let msgs = exchange_into_scratch(ctx, t, &sends, peers.iter().copied(), &caps)?;
    let mut views = Vec::with_capacity(size);
    let mut senders = Vec::with_capacity(size);
    let mut received = peers.iter().zip(&msgs);
    for j in 0..size {
        let c = chunk(total, size, j);
        if c.is_empty() {
            continue;
        }
        let expect = Expect {
            region: None,
            max_entries: c.end - c.start,
        };
        if j == rank {
            views.push(SegView::parse(&out, rank, stamp, expect)?);
        } else if let Some((&peer, &b)) = received.next() {
            let v = SegView::parse(b, peer, stamp, expect)?;
            // Exactly the chunk's entries, each non-zero by construction (a dense segment's
            // zeros are positions nobody sent): fewer or more would be accepted alike by
            // every rank, a wrong result that no one notices.
            let got = if v.header.dense {
                v.entries().filter(|&(_, x)| mag(x) != 0).count() as u64
            } else {
                v.count()
            };
            if got != c.end - c.start {
                return Err(TransportError::Protocol {
                    peer,
                    what: format!(
                        "two-phase gather: {got} entries where its chunk holds {}",
                        c.end - c.start
                    ),
                });
            }
            views.push(v);
        }
        senders.push(j);
    }
    assemble(n, &views, &senders)
}

fn plan_total(counts: &[u64]) -> u64 {
    counts.iter().fold(0u64, |a, &c| a.saturating_add(c))
}

/// The per-owner counts: this rank's `mine` in its slot, summed over ranks.
pub(crate) fn count_vector(ctx: &mut CollCtx<'_>, mine: u64) -> Result<Vec<u64>> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let mut counts = vec![0u64; size];
    counts[rank] = mine;
    allreduce_sum(ctx, &mut counts)?;
    Ok(counts)
}

/// Runs the exact sparse allreduce on this rank for `input` (at most `bound` entries on every
/// rank).
pub(crate) fn run(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    input: Entries<'_>,
    bound: u64,
) -> Result<SparseResult> {
    let size = ctx.transport.size();
    if size == 1 {
        return Ok(super::finish(
            input.n,
            input.idx.to_vec(),
            input.val.to_vec(),
        ));
    }
    let rank = ctx.transport.rank();
    // 1. Balanced bounds.
    let bounds = agree_bounds(ctx, input.idx, input.n)?;
    // 2. Split and reduce.
    let t = tag(ctx, ALG, SPLIT_STEP);
    let (acc, _) = split_reduce(ctx, stamp, input, &bounds, bound, t)?;
    // 3. Keep every non-zero sum.
    let (idx, val) = keep(&acc, bounds[rank], 1);
    let counts = count_vector(ctx, idx.len() as u64)?;
    // 4, 5. The union holds at most `bound` entries of each rank.
    let max_count = bound.saturating_mul(size as u64);
    balanced_allgatherv(ctx, stamp, (&idx, &val), &counts, &bounds, max_count)
}

/// What top-k keeps between steps.
#[derive(Clone, Debug, Default)]
pub(crate) struct TopkPlan {
    /// The region bounds (`p + 1`), empty before the first step.
    pub bounds: Vec<u64>,
    /// The estimate of the global threshold.
    pub estimator: GlobalEstimator,
    /// The last threshold used (magnitude bits).
    pub threshold: Option<u32>,
}

/// Estimates the global threshold of two-phase top-k from step to step.
///
/// The threshold moves with the gradients' scale, which every rank sees in its own k-th
/// magnitude: each rank sends its own in the headers of step 2, so every rank knows their
/// mean `m` without another message, and the estimate is `ratio·m`. After every step that
/// kept `K` entries with `ratio` `r`, the ratio moves towards keeping `0.85k`:
/// `r·(0.85k/K)^(1/e)` (the factor clamped to 0.8…1.25), `e = d ln K / d ln r` the elasticity
/// measured from the last two steps (smoothed; −5 until measured). Error feedback piles the
/// residual up just under the threshold, so `e` is large (around −15): a fixed correction
/// would oscillate. Every rank computes the same numbers.
#[derive(Clone, Debug, Default)]
pub(crate) struct GlobalEstimator {
    ratio: Option<f64>,
    /// `d ln K / d ln r`; 0 until measured.
    elasticity: f64,
    /// `(ln r, ln K)` of the last step.
    last: Option<(f64, f64)>,
}

impl GlobalEstimator {
    /// Kept entries aimed at, per `k`.
    const TARGET: f64 = 0.85;
    /// The elasticity assumed until measured.
    const PRIOR: f64 = -5.0;

    /// The threshold (magnitude bits) to try when the ranks' mean local k-th magnitude is
    /// `mean_kth`.
    fn estimate(&self, mean_kth: f64) -> Option<u32> {
        let e = (self.ratio? * mean_kth) as f32;
        (e.is_finite() && e >= 0.0).then(|| mag(e).max(1))
    }

    /// Records that threshold `t` kept `kept` entries when the mean local k-th magnitude
    /// was `mean_kth`, and prepares the next estimate.
    fn observe(&mut self, t: u32, mean_kth: f64, kept: u64, k: u64) {
        let r = f32::from_bits(t) as f64 / mean_kth;
        if !(r.is_finite() && r > 0.0 && k > 0) {
            *self = GlobalEstimator::default();
            return;
        }
        let (lr, lk) = (r.ln(), (kept.max(1) as f64).ln());
        if let Some((pr, pk)) = self.last {
            let e = (lk - pk) / (lr - pr);
            if (lr - pr).abs() > 1e-4 && e.is_finite() && e < -0.5 {
                let smoothed = if self.elasticity == 0.0 {
                    e
                } else {
                    0.5 * (self.elasticity + e)
                };
                self.elasticity = smoothed.clamp(-200.0, -0.5);
            }
        }
        self.last = Some((lr, lk));
        let e = if self.elasticity == 0.0 {
            Self::PRIOR
        } else {
            self.elasticity
        };
        let f = ((Self::TARGET * k as f64 / kept.max(1) as f64).ln() / e).exp();
        self.ratio = Some(r * f.clamp(0.8, 1.25));
    }
}

/// One top-k step's outcome.
pub(crate) struct TopkOutcome {
    pub result: SparseResult,
    /// Magnitude bits of the threshold used (entries kept had `|sum| ≥` it).
    pub threshold: u32,
    /// Whether it was exact this step.
    pub exact: bool,
}

/// Runs a top-k step: `input` is this rank's local top-k (`k` entries at most, the smallest
/// magnitude `local_kth`); keeps about `k` of the summed entries (exactly the `k` largest when
/// the threshold is exact, ties included).
///
/// The estimate ([`GlobalEstimator`]) is accepted when it keeps between `k/2` and `k`
/// entries; otherwise the threshold is found exactly.
#[allow(clippy::too_many_arguments)]
pub(crate) fn topk(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    input: Entries<'_>,
    local_kth: u32,
    k: u64,
    st: &mut TopkPlan,
    exact_due: bool,
    rebalance_due: bool,
) -> Result<TopkOutcome> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = input.n;
    if size == 1 {
        // One rank: its top-k is the global top-k.
        let result = super::finish(n, input.idx.to_vec(), input.val.to_vec());
        return Ok(TopkOutcome {
            result,
            threshold: 0,
            exact: true,
        });
    }
    // 1. Balanced bounds, when due.
    if rebalance_due || st.bounds.len() != size + 1 || st.bounds.last() != Some(&n) {
        st.bounds = agree_bounds(ctx, input.idx, n)?;
    }
    let bounds = st.bounds.clone();
    // 2. Split and reduce.
    let t = tag(ctx, ALG, SPLIT_STEP);
    let stamp = stamp.with_aux(local_kth as u64);
    let (acc, auxes) = split_reduce(ctx, stamp, input, &bounds, k, t)?;
    // The ranks' mean local k-th magnitude (the same on every rank: the same words, summed
    // in rank order); NaN if a word is not a magnitude.
    let mean_kth = auxes
        .iter()
        .map(|&a| match u32::try_from(a) {
            Ok(m) if m <= 0x7f80_0000 => f32::from_bits(m) as f64,
            _ => f64::NAN,
        })
        .sum::<f64>()
        / size as f64;
    // 3. The threshold: the estimate if it kept between k/2 and k entries, else exact.
    let mags: Vec<u32> = match &acc {
        Acc::Sparse { val, .. } => val.iter().map(|&v| mag(v)).filter(|&m| m > 0).collect(),
        Acc::Dense(d) => d.iter().map(|&v| mag(v)).filter(|&m| m > 0).collect(),
    };
    let count_at = |t: u32| mags.iter().filter(|&&m| m >= t).count() as u64;
    let estimate = if exact_due {
        None
    } else {
        st.estimator.estimate(mean_kth)
    };
    let mut chosen = None;
    if let Some(t) = estimate {
        let counts = count_vector(ctx, count_at(t))?;
        let kept = plan_total(&counts);
        st.estimator.observe(t, mean_kth, kept, k);
        // (Checked in this order, 2·kept cannot overflow.)
        if kept <= k && (2 * kept >= k || t <= 1) {
            chosen = Some((t, counts, false));
        }
    }
    let (t, counts, exact) = match chosen {
        Some(c) => c,
        None => {
            let t = exact_threshold(ctx, &mags, k)?;
            let counts = count_vector(ctx, count_at(t))?;
            st.estimator.observe(t, mean_kth, plan_total(&counts), k);
            (t, counts, true)
        }
    };
    st.threshold = Some(t.max(1));
    let (idx, val) = keep(&acc, bounds[rank], t);
    // 4, 5.
    // At most the k entries each rank passed in.
    let max_count = k.saturating_mul(size as u64);
    let result = balanced_allgatherv(ctx, stamp, (&idx, &val), &counts, &bounds, max_count)?;
    Ok(TopkOutcome {
        result,
        threshold: t.max(1),
        exact,
    })
}

/// The magnitude bits of the `k`-th largest of every rank's `mags` (non-zero), found digit by
/// digit from the top with allreduced histograms (8, 8, 8 and 7 bits); 1 (keep every non-zero)
/// when there are at most `k`. Stops early when a bucket ends exactly at `k`.
fn exact_threshold(ctx: &mut CollCtx<'_>, mags: &[u32], k: u64) -> Result<u32> {
    if k == 0 {
        return Ok(u32::MAX);
    }
    const DIGITS: [(u32, u32); 4] = [(23, 8), (15, 8), (7, 8), (0, 7)];
    let mut cand: Vec<u32> = mags.to_vec();
    let mut prefix = 0u32;
    let mut above = 0u64;
    for (shift, bits) in DIGITS {
        let mask = (1u32 << bits) - 1;
        let mut hist = vec![0u64; 1 << bits];
        for &m in &cand {
            hist[((m >> shift) & mask) as usize] += 1;
        }
        allreduce_sum(ctx, &mut hist)?;
        let mut cum = above;
        let mut pick = None;
        // Saturating: the counts come from peers.
        for b in (0..hist.len()).rev() {
            if cum.saturating_add(hist[b]) >= k {
                pick = Some(b as u32);
                break;
            }
            cum = cum.saturating_add(hist[b]);
        }
        // Fewer than k in total (only possible at the first digit): keep everything.
        let Some(b) = pick else {
            return Ok(1);
        };
        prefix |= b << shift;
        if cum.saturating_add(hist[b as usize]) == k {
            return Ok(prefix.max(1));
        }
        above = cum;
        cand.retain(|&m| (m >> shift) & mask == b);
    }
    Ok(prefix.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn garbage_counts_are_refused() {
        let bounds = [0, 10, 20];
        assert!(check_counts(&[3, 10], &bounds, 0, 3, u64::MAX).is_ok());
        assert!(check_counts(&[3, 11], &bounds, 0, 3, u64::MAX).is_err());
        assert!(check_counts(&[4, 1], &bounds, 0, 3, u64::MAX).is_err());
        let e = check_counts(&[3, u64::MAX], &bounds, 0, 3, u64::MAX).unwrap_err();
        assert!(!e.is_recoverable(), "{e}");
        // Within every region, but more entries in all than the ranks passed (two ranks of at
        // most 5 each): a huge region must not size a buffer by a peer's word.
        assert!(check_counts(&[3, 7], &bounds, 0, 3, 10).is_ok());
        let e = check_counts(&[3, 8], &bounds, 0, 3, 10).unwrap_err();
        assert!(e.to_string().contains("add up to 11"), "{e}");
    }

    /// Rank 0 of two, hostile, sends rank 1 a balancing piece outside its own region (which
    /// would leave rank 1's chunk unsorted), or a gather chunk of the wrong size: rank 1 fails
    /// with a protocol error naming rank 0, and never panics.
    type RankBody = Box<dyn FnOnce(&mut CollCtx<'_>) -> Result<()> + Send>;

    #[test]
    fn a_peer_piece_outside_its_region_or_of_the_wrong_size_is_refused() {
        use std::time::{Duration, Instant};
        let bounds = [0u64, 500, 1000];
        let stamp = Stamp::new(1000, &[7]);
        for hostile in ["region", "gather"] {
            let mut g = chorus_transport::tcp::local_group(2).unwrap();
            let t1 = g.pop().unwrap();
            let t0 = g.pop().unwrap();
            let run = |mut t: chorus_transport::tcp::TcpTransport, f: RankBody| {
                std::thread::spawn(move || {
                    let mut scratch = Vec::new();
                    let mut ctx = CollCtx {
                        transport: &mut t,
                        deadline: Instant::now() + Duration::from_secs(20),
                        tag_base: 5 << 16,
                        scratch: &mut scratch,
                    };
                    f(&mut ctx)
                })
            };
            // Counts [4, 2]: chunks of 3; rank 1's chunk is rank 0's 4th entry, then its own 2.
            let evil = run(
                t0,
                Box::new(move |ctx| {
                    let mut out = Vec::new();
                    if hostile == "region" {
                        // Index 560 lies in rank 1's region, not in rank 0's (0..500).
                        stream::encode_sparse(&mut out, stamp, 560, 1, &[560], &[1.0]);
                        let t = tag(ctx, ALG, BALANCE_STEP);
                        crate::collectives::send_all(&mut *ctx.transport, ctx.deadline, 1, t, &out)
                    } else {
                        // An honest balancing piece, then a gather chunk of 2 entries, not 3.
                        stream::encode_sparse(&mut out, stamp, 10, 1, &[10], &[1.0]);
                        let t = tag(ctx, ALG, BALANCE_STEP);
                        crate::collectives::send_all(
                            &mut *ctx.transport,
                            ctx.deadline,
                            1,
                            t,
                            &out,
                        )?;
                        out.clear();
                        stream::encode_sparse(&mut out, stamp, 1, 2, &[1, 2], &[1.0, 1.0]);
                        let t = tag(ctx, ALG, GATHER_STEP);
                        crate::collectives::send_all(&mut *ctx.transport, ctx.deadline, 1, t, &out)
                    }
                }),
            );
            let honest = run(
                t1,
                Box::new(move |ctx| {
                    let (idx, val) = ([559u64, 561], [2.0f32, 3.0]);
                    balanced_allgatherv(ctx, stamp, (&idx, &val), &[4, 2], &bounds, u64::MAX)
                        .map(|_| ())
                }),
            );
            let e = honest.join().unwrap().unwrap_err();
            assert!(
                matches!(e, TransportError::Protocol { peer: 0, .. }),
                "{hostile}: {e}"
            );
            let _ = evil.join().unwrap();
        }
    }

    #[test]
    fn bounds_follow_the_indices() {
        // Every index in the first tenth: the regions split it.
        let idx: Vec<u64> = (0..100).collect();
        let s = quantile_sums(&idx, 4);
        assert_eq!(boundaries(&s, 1000, 4), [0, 25, 50, 75, 1000]);
        // Non-finite or empty sums: uniform.
        assert_eq!(boundaries(&[0.0, 0.0, 0.0], 9, 3), [0, 3, 6, 9]);
        assert_eq!(boundaries(&[1.0, f64::NAN], 9, 2), [0, 4, 9]);
    }

    proptest! {
        #[test]
        fn balancing_moves_every_position_to_its_chunk(
            counts in proptest::collection::vec(0u64..50, 1..10)
        ) {
            let p = counts.len();
            let total: u64 = counts.iter().sum();
            let plans: Vec<BalancePlan> = (0..p).map(|r| balance_plan(&counts, r)).collect();
            // Chunks tile the global list, and differ by at most one entry.
            let mut at = 0;
            for pl in &plans {
                prop_assert_eq!(pl.chunk.start, at);
                at = pl.chunk.end;
                prop_assert!(pl.chunk.end - pl.chunk.start <= total.div_ceil(p as u64));
                // The pieces fill the chunk.
                let filled: u64 = pl.pieces.iter().map(|&(_, c)| c).sum();
                prop_assert_eq!(filled, pl.chunk.end - pl.chunk.start);
            }
            prop_assert_eq!(at, total);
            // What j sends to r is what r expects from j.
            for (j, pj) in plans.iter().enumerate() {
                for (r, range) in &pj.sends {
                    let expected = plans[*r].pieces.iter().find(|&&(o, _)| o == j).map(|&(_, c)| c);
                    prop_assert_eq!(Some(range.end - range.start), expected);
                }
                for (r, pr) in plans.iter().enumerate() {
                    if r != j && pr.pieces.iter().any(|&(o, _)| o == j) {
                        prop_assert!(pj.sends.iter().any(|(q, _)| *q == r));
                    }
                }
            }
        }

        #[test]
        fn bounds_are_monotone(
            sums in proptest::collection::vec(0.0f64..1e9, 1..9), n in 0u64..1_000_000
        ) {
            let p = sums.len();
            let b = boundaries(&sums, n, p);
            prop_assert_eq!(b.len(), p + 1);
            prop_assert_eq!(b[0], 0);
            prop_assert_eq!(b[p], n);
            prop_assert!(b.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn two_phase_costs_more_latency_than_dsar_for_uniform_entries() {
        let l = Link::GIGABIT_ETHERNET;
        let dsar = super::super::split_allgather::cost;
        assert!(cost(1 << 20, 1 << 10, 8, &l) > dsar(1 << 20, 1 << 10, 8, &l));
        assert_eq!(cost(10, 1, 1, &l), 0.0);
    }
}
