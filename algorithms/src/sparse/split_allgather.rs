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
//!
//! # Receive buffers
//! A region's sum holds at most the entries of every rank, `p` times the largest count (the
//! `bound` every rank passes: agreed for [`super::sparse_all_reduce`], `k` for top-k), so a
//! rank could size each of its `p−1` receives for that; but all the regions together hold
//! no more than that either, and sized one by one the buffers ask for up to `p−1` times what
//! can arrive (at `p = 64`, a vector of 10¹⁰ positions and 10⁶ entries a rank: 32 GB of
//! address space against the 0.5 GB the union can take). So for vectors above
//! [`super::BOUND_ENTRIES_ABOVE_BYTES`] the ranks first agree on the byte length of every
//! region's sum (a small allreduce of `p` numbers) and each receive is sized exactly. Below,
//! a receive is at most its region's dense size, and all of them together the vector's.

use chorus_transport::{Result, TransportError};

use super::recursive_doubling::{expected_union, segment_bytes};
use super::stream::{self, Acc, Expect, Part, SegView, Stamp};
use super::two_phase::count_vector;
use super::{assemble, bound_agreed, exchange_into_scratch, tag, Entries, SparseResult};
use crate::cost::{recursive_doubling_allreduce, Link, REDUCE_SECONDS_PER_BYTE};
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
    let lengths = match bound_agreed(n as u64, p) {
        true => recursive_doubling_allreduce(8 * p, p, link),
        false => 0.0,
    };
    2.0 * (p as f64 - 1.0) * link.alpha + lengths + split_and_sum_volume(n, nnz, p, link)
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
    let agree = bound_agreed(input.n, size);
    gather_regions(
        ctx,
        stamp,
        &acc,
        &bounds,
        region_bound,
        agree,
        tag(ctx, ALG, 1),
    )
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
/// (at most `region_bound` entries each; with `agree`, first agreeing on every sum's byte
/// length, which then sizes the receives: see the module docs), and assembles the result
/// from the bytes.
pub(crate) fn gather_regions(
    ctx: &mut CollCtx<'_>,
    stamp: Stamp,
    acc: &Acc,
    bounds: &[u64],
    region_bound: u64,
    agree: bool,
    t: chorus_transport::Tag,
) -> Result<SparseResult> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let region = |j: usize| (bounds[j], bounds[j + 1] - bounds[j]);
    let mut out = Vec::new();
    let (start, len) = region(rank);
    acc.encode(&mut out, stamp, start, len);
    let peers: Vec<usize> = (0..size).filter(|&j| j != rank).collect();
    let sends: Vec<_> = peers.iter().map(|&j| (j, t, &out[..])).collect();
    let most = |j: usize| stream::max_segment_bytes(region_bound, region(j).1);
    let caps: Vec<usize> = match agree {
        true => {
            // At most `region_bound` entries in all, each of an index as wide as the widest
            // region's and a value.
            let widest = (0..size).map(|j| region(j).1).max().unwrap_or(0);
            let union = stream::sparse_bytes(region_bound, widest);
            let lengths = agree_lengths(ctx, out.len(), &most, union)?;
            peers.iter().map(|&j| lengths[j]).collect()
        }
        false => peers.iter().map(|&j| most(j)).collect(),
    };
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

/// Every rank's byte length of its region's sum (this rank's is `mine`), agreed with a small
/// allreduce and checked ([`check_lengths`]).
fn agree_lengths(
    ctx: &mut CollCtx<'_>,
    mine: usize,
    most: &dyn Fn(usize) -> usize,
    union: u128,
) -> Result<Vec<usize>> {
    let lengths = count_vector(ctx, mine as u64)?;
    check_lengths(&lengths, ctx.transport.rank(), mine, most, union)
}

/// The checks of the agreed `lengths` of the regions' sums, so that a peer's garbage cannot
/// size the receives beyond what the call allows: this rank's own is `mine`, none is above
/// `most(j)` (what region `j`'s sum can take), and their payloads (the lengths without the
/// segment headers) add up to at most `union` bytes (what the entries of every rank take
/// sparse: a region's sum is at most its entries' sparse size, dense only where that is not
/// larger). A bad length is a [`TransportError::Protocol`] error naming the next rank (the
/// allreduce does not tell which one sent it).
fn check_lengths(
    lengths: &[u64],
    rank: usize,
    mine: usize,
    most: &dyn Fn(usize) -> usize,
    union: u128,
) -> Result<Vec<usize>> {
    let garbage = |what: String| TransportError::Protocol {
        peer: (rank + 1) % lengths.len(),
        what: format!("split-allgather: {what}: a peer sent garbage"),
    };
    let bad = lengths.iter().enumerate().find(|&(j, &l)| {
        usize::try_from(l).map_or(true, |l| l > most(j) || (j == rank && l != mine))
    });
    if let Some((j, &l)) = bad {
        return Err(garbage(format!(
            "the allreduced length of rank {j}'s region sum is {l} bytes (at most {} fit its \
             region, this rank's is {mine})",
            most(j)
        )));
    }
    let payload: u128 = lengths
        .iter()
        .map(|&l| u128::from(l.saturating_sub(stream::HEADER_BYTES as u64)))
        .sum();
    if payload > union {
        return Err(garbage(format!(
            "the allreduced lengths of the regions' sums carry {payload} bytes, more than the \
             {union} the entries of every rank can take"
        )));
    }
    Ok(lengths.iter().map(|&l| l as usize).collect())
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
        // Above the bound, one small allreduce more (the lengths of the regions' sums).
        let (at, above): (usize, usize) = ((16 << 20) / 4, (16 << 20) / 4 + 1);
        assert!(!bound_agreed(at as u64, 8) && bound_agreed(above as u64, 8));
        assert!(!bound_agreed(above as u64, 1));
        let extra = cost(above, 1000, 8, &l) - cost(at, 1000, 8, &l);
        assert!(extra >= recursive_doubling_allreduce(64, 8, &l), "{extra}");
    }

    #[test]
    fn agreed_lengths_are_checked() {
        let most = |j: usize| 100 * (j + 1);
        let all = u128::MAX;
        assert_eq!(
            check_lengths(&[50, 200, 0], 1, 200, &most, all).unwrap(),
            [50, 200, 0]
        );
        // Another length for this rank than its own, one beyond what its region takes.
        for (lengths, rank, mine) in [([50, 201, 0], 1, 200), ([101, 0, 0], 2, 0)] {
            let e = check_lengths(&lengths, rank, mine, &most, all).unwrap_err();
            assert!(
                matches!(&e, TransportError::Protocol { peer, .. } if *peer == (rank + 1) % 3),
                "{e}"
            );
        }
        let e = check_lengths(&[0, u64::MAX], 0, 0, &most, all).unwrap_err();
        assert!(e.to_string().contains("garbage"), "{e}");
        // Each within its region, together more than the entries can take (headers aside).
        let h = stream::HEADER_BYTES as u64;
        let wide = |_: usize| 1000;
        let mine = (h + 50) as usize;
        assert!(check_lengths(&[h + 50, h + 100, h], 0, mine, &wide, 150).is_ok());
        let e = check_lengths(&[h + 50, h + 101, h], 0, mine, &wide, 150).unwrap_err();
        assert!(e.to_string().contains("151 bytes"), "{e}");
    }
}
