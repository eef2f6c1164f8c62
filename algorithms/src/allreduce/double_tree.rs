//! Double binary tree allreduce: the buffer is cut in two halves, half 0 is allreduced over
//! tree A and half 1 over tree B at the same time, with the [`tree`](super::tree) schedule's
//! pipelined reduce-then-broadcast. The trees are chosen so that the ranks that are inner
//! nodes of one are leaves of the other: every rank forwards to children in at most one tree,
//! so the per-rank load of the single tree's inner ranks is shared out.
//!
//! # Words
//! - **tree A**: the binary heap over ranks — rank `r`'s parent is `(r−1)/2`, its children
//!   `2r+1` and `2r+2` (those `< p`); root rank 0.
//! - **tree B**: the mirror of A — rank `r` takes the place of rank `p−1−r` in A; root rank
//!   `p−1`. A's inner ranks are `0..⌊p/2⌋` and B's are `p−⌊p/2⌋..p`, which never meet, so
//!   every rank is a leaf in at least one tree (for odd `p` rank `⌊p/2⌋` is a leaf in both).
//! - **halves**: half 0 is the first `⌈count/2⌉` elements, half 1 the rest; each is cut into
//!   segments of [`SEGMENT_BYTES`](super::tree::SEGMENT_BYTES) and the segments of the two
//!   halves alternate in one pipeline (A0, B0, A1, B1, …) sharing the tree schedule's window.
//!
//! # Steps (rank `r`, per segment)
//! As [`tree`](super::tree), on the tree of the segment's half: reduce from the children and
//! pass up; the root divides for `Avg` and the result comes back down and is forwarded as it
//! arrives.
//!
//! # Volume and cost
//! An inner rank of A sends `n/2` up and `n/2` to each child in A and `n/2` up in B: `2n`
//! bytes, against `3n` for the single tree's inner ranks; leaves in both send `n`. Each link
//! carries `n/2` each way per tree. The critical path is about `2d + m/2` steps of `α + 3sβ`
//! for `m` segments in all: `≈ 2d·α + 1.5·nβ` for large `n` ([`cost()`]).

use std::ops::Range;

use chorus_transport::Result;

use super::tree::{self, Node, SEGMENT_BYTES};
use crate::cost::{self, Link};
use crate::{CollCtx, DType, ReduceOp};

/// The step-number space of this schedule's tags (see [`super::step_tag`]).
const ALG_ID: u64 = 4;

/// A rank's place in one tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    /// The rank segments go up to and come down from (`None` at the root).
    pub parent: Option<usize>,
    /// The ranks segments come up from and go down to (zero, one or two).
    pub children: Vec<usize>,
}

/// A rank's places in both trees and the segments of its buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The place in tree A (index 0, half 0) and tree B (index 1, half 1).
    pub trees: [Place; 2],
    /// The segments in pipeline order: the tree (0 or 1) and the byte range. Each tree's
    /// segments are consecutive and ascending; together they partition the buffer.
    pub segments: Vec<(usize, Range<usize>)>,
}

/// Rank `rank`'s place in the binary heap over `size` ranks (tree A).
fn heap(rank: usize, size: usize) -> Place {
    Place {
        parent: (rank > 0).then(|| (rank - 1) / 2),
        children: [2 * rank + 1, 2 * rank + 2]
            .into_iter()
            .filter(|&c| c < size)
            .collect(),
    }
}

/// The double-tree schedule of `rank` in a group of `size` for `count` elements of `elem_size`
/// bytes.
///
/// ```
/// use chorus_algorithms::allreduce::double_tree::plan;
/// let p = plan(1, 4, 10, 4);
/// assert_eq!((p.trees[0].parent, p.trees[0].children.clone()), (Some(0), vec![3]));
/// assert_eq!((p.trees[1].parent, p.trees[1].children.clone()), (Some(3), vec![]));
/// assert_eq!(p.segments, [(0, 0..20), (1, 20..40)]);
/// ```
///
/// # Panics
/// If `rank >= size` or `elem_size` is zero.
pub fn plan(rank: usize, size: usize, count: usize, elem_size: usize) -> Plan {
    assert!(rank < size, "rank {rank} out of range for {size} ranks");
    assert!(elem_size > 0, "zero element size");
    let mirror = |r: usize| size - 1 - r;
    let b = heap(mirror(rank), size);
    let trees = [
        heap(rank, size),
        Place {
            parent: b.parent.map(mirror),
            children: b.children.into_iter().map(mirror).collect(),
        },
    ];
    let seg = (SEGMENT_BYTES / elem_size).max(1) * elem_size;
    let split = count.div_ceil(2) * elem_size;
    let halves = [0..split, split..count * elem_size];
    let cut = |h: &Range<usize>| -> Vec<Range<usize>> {
        (0..h.len().div_ceil(seg))
            .map(|k| h.start + k * seg..(h.start + (k + 1) * seg).min(h.end))
            .collect()
    };
    let (a, b) = (cut(&halves[0]), cut(&halves[1]));
    let mut segments = Vec::with_capacity(a.len() + b.len());
    for k in 0..a.len().max(b.len()) {
        segments.extend(a.get(k).map(|r| (0, r.clone())));
        segments.extend(b.get(k).map(|r| (1, r.clone())));
    }
    Plan { trees, segments }
}

/// The modelled time of a double-tree allreduce of `bytes` bytes over `ranks` ranks (see
/// [`cost::double_tree_allreduce`]).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    cost::double_tree_allreduce(bytes, ranks, SEGMENT_BYTES, link)
}

/// Runs the double binary tree allreduce on this rank (arguments as
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
    let trees = plan.trees.map(|p| Node {
        parent: p.parent,
        children: p.children,
    });
    tree::run_segments(ctx, send, recv, dtype, op, ALG_ID, &trees, &plan.segments)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(size: usize, count: usize, elem: usize) {
        let plans: Vec<Plan> = (0..size).map(|r| plan(r, size, count, elem)).collect();
        for t in 0..2 {
            let roots: Vec<usize> = (0..size)
                .filter(|&r| plans[r].trees[t].parent.is_none())
                .collect();
            assert_eq!(roots.len(), 1, "tree {t} has one root");
            for (r, p) in plans.iter().enumerate() {
                let place = &p.trees[t];
                assert!(place.children.len() <= 2);
                for &c in &place.children {
                    assert_eq!(plans[c].trees[t].parent, Some(r));
                }
                if let Some(q) = place.parent {
                    assert!(plans[q].trees[t].children.contains(&r));
                }
                let (mut at, mut depth) = (r, 0);
                while let Some(q) = plans[at].trees[t].parent {
                    at = q;
                    depth += 1;
                    assert!(depth <= size.ilog2(), "rank {r} deeper than log2 p in {t}");
                }
                assert_eq!(at, roots[0]);
            }
            // Every rank is in the tree exactly once: the subtree of the root covers them.
            fn members(plans: &[Plan], t: usize, r: usize, seen: &mut Vec<bool>) {
                assert!(!seen[r], "rank {r} twice in tree {t}");
                seen[r] = true;
                for &c in &plans[r].trees[t].children {
                    members(plans, t, c, seen);
                }
            }
            let mut seen = vec![false; size];
            members(&plans, t, roots[0], &mut seen);
            assert!(seen.iter().all(|&s| s));
        }
        // No rank is inner in both trees; at most one (odd p) is a leaf in both.
        let inner = |r: usize, t: usize| !plans[r].trees[t].children.is_empty();
        assert!((0..size).all(|r| !(inner(r, 0) && inner(r, 1))));
        if size > 1 {
            let leaf_both = (0..size).filter(|&r| !inner(r, 0) && !inner(r, 1)).count();
            assert_eq!(leaf_both, size % 2, "size {size}");
        }
        // Segments: the same on every rank, whole elements, each tree's ascending and
        // consecutive, alternating, together a partition of the buffer.
        let segs = &plans[0].segments;
        assert!(plans.iter().all(|p| &p.segments == segs));
        let mut sorted: Vec<Range<usize>> = segs.iter().map(|(_, r)| r.clone()).collect();
        sorted.sort_by_key(|r| r.start);
        let mut end = 0;
        for r in &sorted {
            assert_eq!(r.start, end);
            assert!(!r.is_empty() && r.len() % elem == 0 && r.len() <= SEGMENT_BYTES.max(elem));
            end = r.end;
        }
        assert_eq!(end, count * elem);
        for t in 0..2 {
            let mine: Vec<&Range<usize>> = segs
                .iter()
                .filter(|(u, _)| *u == t)
                .map(|(_, r)| r)
                .collect();
            assert!(mine.windows(2).all(|w| w[0].end == w[1].start));
        }
        let a = segs.iter().filter(|(t, _)| *t == 0).count();
        let b = segs.len() - a;
        assert!(a == b || a == b + 1, "{a} vs {b}");
        for (i, (t, _)) in segs.iter().enumerate() {
            if i < 2 * b {
                assert_eq!(*t, i % 2);
            }
        }
    }

    #[test]
    fn small_groups() {
        for size in 1..=17 {
            for count in [0, 1, 2, 7, SEGMENT_BYTES / 8 + 3, SEGMENT_BYTES / 2 + 1] {
                for elem in [1, 2, 8] {
                    check(size, count, elem);
                }
            }
        }
    }

    #[test]
    fn inner_ranks_are_leaves_in_the_other_tree() {
        let p = 6;
        let inner: Vec<Vec<usize>> = (0..2)
            .map(|t| {
                (0..p)
                    .filter(|&r| !plan(r, p, 1, 4).trees[t].children.is_empty())
                    .collect()
            })
            .collect();
        assert_eq!(inner, [vec![0, 1, 2], vec![3, 4, 5]]);
    }

    proptest! {
        #[test]
        fn trees_and_segments(size in 1usize..=64, count in 0usize..200_000, elem in prop::sample::select(vec![1usize, 2, 4, 8])) {
            check(size, count, elem);
        }
    }
}
