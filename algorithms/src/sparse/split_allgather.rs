//! Split-and-allgather (DSAR): split the index space into `p` regions, reduce each region on
//! its owner, then allgather the owners' sums.
//!
//! # Words
//! - **region** `j`: the positions `⌊j·n/p⌋..⌊(j+1)·n/p⌋`, owned by rank `j` ([`plan`]).
//! - **split**: the entries of a rank's vector that fall in region `j`.
//!
//! # Steps (rank `r`)
//! 1. Split and reduce: send each rank `j ≠ r` the split for region `j` (a sparse stream,
//!    dense when that is smaller) while receiving every rank's split for region `r`; sum them
//!    with this rank's own, in rank order ([`stream::sum_parts`]).
//! 2. Allgather: send the sum of region `r` to every rank while receiving every other
//!    region's; every rank decodes the same bytes into the result.
//!
//! # Volume and cost
//! With `k` entries per rank spread evenly: step 1 sends `k(p−1)/p` entries; step 2 sends the
//! owner's sum (between `k/p` and `min(k, n/p)` entries) to `p−1` ranks and receives the
//! other `p−1` sums: between `2k(p−1)/p` words (identical indices) and `2k(p−1)` (disjoint),
//! never more than the dense `n(p−1)/p` values. Two all-to-all rounds: modelled as `(p−1)α`
//! each (the messages leave one after another), plus the bytes ([`cost`]).

use chorus_transport::Result;

use super::recursive_doubling::{expected_union, segment_bytes};
use super::stream::{self, Acc, Expect, Part, SegView, Stamp};
use super::{assemble, exchange_into_scratch, tag, Entries, SparseResult};
use crate::cost::{Link, REDUCE_SECONDS_PER_BYTE};
use crate::CollCtx;

/// This schedule's tag id.
const ALG: u64 = 2;

/// The `p + 1` boundaries of the uniform regions of `0..n`: region `j` is
/// `b[j]..b[j+1]` with `b[j] = ⌊j·n/p⌋`.
///
/// ```
/// use chorus_algorithms::sparse::split_allgather::plan;
/// assert_eq!(plan(10, 3), [0, 3, 6, 10]);
/// assert_eq!(plan(2, 4), [0, 0, 1, 1, 2]);
/// ```
pub fn plan(n: u64, p: usize) -> Vec<u64> {
    (0..=p as u128)
        .map(|j| (j * n as u128 / p.max(1) as u128) as u64)
        .collect()
}

/// Modelled time for vectors of length `n` with `nnz` uniformly random entries on each of
/// `p` ranks: two all-to-all rounds of `(p−1)α` plus the bytes each rank sends (its splits,
/// then its region's sum `p−1` times) and the merging of what it receives.
pub fn cost(n: usize, nnz: usize, p: usize, link: &Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    2.0 * (p as f64 - 1.0) * link.alpha + split_and_sum_volume(n, nnz, p, link)
}

/// The part of the modelled time that grows with the data, shared with the two-phase
/// schedule: each rank sends its `p−1` splits and its region's sum `p−1` times, and merges
/// the splits it receives (`p > 1`).
pub(crate) fn split_and_sum_volume(n: usize, nnz: usize, p: usize, link: &Link) -> f64 {
    let pf = p as f64;
    let region = n.div_ceil(p);
    let split = segment_bytes(nnz as f64 / pf, region);
    let sum = segment_bytes(expected_union(n, nnz, p) / pf, region);
    (pf - 1.0) * (split + sum) * link.beta + (pf - 1.0) * split * REDUCE_SECONDS_PER_BYTE
}

/// Runs the schedule on this rank for `input` (at most `bound` entries on every rank).
pub(crate) fn run(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    input: Entries<'_>,
    bound: u64,
) -> Result<SparseResult> {
    let size = ctx.transport.size();
    let bounds = plan(input.n, size);
    let (acc, _) = split_reduce(ctx, stamp, input, &bounds, bound, tag(ctx, ALG, 0))?;
    let region_bound = bound.saturating_mul(size as u64);
    gather_regions(ctx, stamp, &acc, &bounds, region_bound, tag(ctx, ALG, 1))
}

/// Step 1 (shared with [`super::two_phase`]): sends every rank its region's split of `input`
/// (regions `bounds[j]..bounds[j+1]`, at most `bound` entries per rank and region) and
/// returns the sum of this rank's region, and every rank's [`Stamp::aux`] (in rank order).
pub(crate) fn split_reduce(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    input: Entries<'_>,
    bounds: &[u64],
    bound: u64,
    t: chorus_transport::Tag,
) -> Result<(Acc, Vec<u64>)> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let region = |j: usize| (bounds[j], bounds[j + 1] - bounds[j]);
    let (start, len) = region(rank);
    // The splits for the other ranks, one after another in `out`.
    let mut out = Vec::new();
    let mut ends = Vec::with_capacity(size);
    for j in 0..size {
        if j != rank {
            let (s, l) = region(j);
            let (idx, val) = input.range(s, s + l);
            stream::encode_sparse(&mut out, stamp, s, l, idx, val);
        }
        ends.push(out.len());
    }
    let peers: Vec<usize> = (0..size).filter(|&j| j != rank).collect();
    let sends: Vec<_> = peers
        .iter()
        .map(|&j| {
            let from = if j == 0 { 0 } else { ends[j - 1] };
            (j, t, &out[from..ends[j]])
        })
        .collect();
    let cap = stream::max_segment_bytes(bound, len);
    let caps = vec![cap; peers.len()];
    let msgs = exchange_into_scratch(ctx, t, &sends, peers.iter().copied(), &caps)?;
    let expect = Expect {
        region: Some((start, len)),
        max_entries: bound,
    };
    let mut parts = Vec::with_capacity(size);
    let mut aux = Vec::with_capacity(size);
    let mut received = peers.iter().zip(&msgs);
    for j in 0..size {
        if j == rank {
            let (idx, val) = input.range(start, start + len);
            parts.push(Part::Local(idx, val));
            aux.push(stamp.aux);
        } else if let Some((&peer, &b)) = received.next() {
            let v = SegView::parse(b, peer, stamp, expect)?;
            aux.push(v.header.aux);
            parts.push(Part::View(v));
        }
    }
    Ok((stream::sum_parts(&parts, start, len), aux))
}

/// Step 2: sends this rank's region sum to every rank while receiving every other region's
/// (at most `region_bound` entries each), and assembles the result from the bytes.
pub(crate) fn gather_regions(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    acc: &Acc,
    bounds: &[u64],
    region_bound: u64,
    t: chorus_transport::Tag,
) -> Result<SparseResult> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let region = |j: usize| (bounds[j], bounds[j + 1] - bounds[j]);
    let mut out = Vec::new();
    let (start, len) = region(rank);
    acc.encode(&mut out, stamp, start, len);
    let peers: Vec<usize> = (0..size).filter(|&j| j != rank).collect();
    let sends: Vec<_> = peers.iter().map(|&j| (j, t, &out[..])).collect();
    let caps: Vec<usize> = peers
        .iter()
        .map(|&j| stream::max_segment_bytes(region_bound, region(j).1))
        .collect();
    let msgs = exchange_into_scratch(ctx, t, &sends, peers.iter().copied(), &caps)?;
    let mut views = Vec::with_capacity(size);
    let mut received = peers.iter().zip(&msgs);
    for j in 0..size {
        let (s, l) = region(j);
        let expect = Expect {
            region: Some((s, l)),
            max_entries: region_bound,
        };
        if j == rank {
            // This rank's own bytes, decoded like everyone else's.
            views.push(SegView::parse(&out, rank, stamp, expect)?);
        } else if let Some((&peer, &b)) = received.next() {
            views.push(SegView::parse(b, peer, stamp, expect)?);
        }
    }
    let ranks: Vec<usize> = (0..size).collect();
    assemble(stamp.n, &views, &ranks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn regions_tile_the_index_space(n in 0u64..1_000_000, p in 1usize..64) {
            let b = plan(n, p);
            prop_assert_eq!(b.len(), p + 1);
            prop_assert_eq!(b[0], 0);
            prop_assert_eq!(b[p], n);
            for w in b.windows(2) {
                prop_assert!(w[0] <= w[1]);
                prop_assert!(w[1] - w[0] <= n.div_ceil(p as u64));
            }
        }
    }

    #[test]
    fn cost_is_cheaper_than_recursive_doubling_once_the_sum_fills_in() {
        let l = Link::GIGABIT_ETHERNET;
        assert_eq!(cost(100, 10, 1, &l), 0.0);
        let rd = super::super::recursive_doubling::cost;
        // Dense-ish sums over 8 ranks: 2(p−1)/p·n values instead of log₂p·n.
        assert!(cost(1 << 24, 1 << 22, 8, &l) < rd(1 << 24, 1 << 22, 8, &l));
        // Sparse disjoint entries: about the same bytes (the allgather of the union).
        let (d, r) = (cost(1 << 24, 1 << 14, 8, &l), rd(1 << 24, 1 << 14, 8, &l));
        assert!(d < 1.3 * r && r < 1.3 * d, "{d} {r}");
        // Tiny vectors: recursive doubling's log₂p latencies win.
        assert!(rd(1000, 10, 8, &l) < cost(1000, 10, 8, &l));
    }
}
