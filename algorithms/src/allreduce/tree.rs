//! Pipelined binary-tree allreduce: a reduce up a binary tree to rank 0 and a broadcast back
//! down, both cut into segments so that every level of the tree works at once.
//!
//! # Words
//! - **tree**: the binary heap over ranks — rank `r`'s parent is `(r−1)/2`, its children
//!   `2r+1` and `2r+2` (those `< p`); depth `⌊log₂p⌋`.
//! - **segment**: the buffer is cut into segments of [`SEGMENT_BYTES`] (whole elements; the
//!   last one shorter). Each segment travels up and down on its own: a rank reduces segment
//!   `k` from its children and passes it up while segment `k+1` is still arriving, and the
//!   root starts sending segment `k` down as soon as it is reduced.
//! - **window**: at most [`WINDOW`] segments are in progress on a rank at once; a child's
//!   segment lands in one of `WINDOW` scratch slots per child.
//!
//! # Steps (rank `r`, per segment `k`)
//! 1. Receive segment `k` from each child (into scratch) and reduce it into the output
//!    (out of place, the input's segment is copied there first; a leaf has nothing to
//!    receive and sends its input as it is).
//! 2. Send the result to the parent; at the root, divide it by `p` for `Avg` instead.
//! 3. Receive the final segment from the parent into the output (not at the root) and forward
//!    it to the children byte by byte as it arrives.
//!
//! # Volume and cost
//! Every rank but the root sends `n` bytes up and every rank with children sends `n` bytes
//! down to each of them: an inner rank moves `n` in from below, `n` out above, `n` in from above
//! and `2n` out below. With `m` segments of `s` bytes and depth `d`, the critical path is about
//! `(2d + m)` segment steps of `α + 2sβ`: `≈ (2d + m)·α + 2(2d·s + n)·β`
//! ([`cost()`]), as long as the window covers a leaf's round trip (`d + 1 ≤ WINDOW`, up to
//! 15 ranks); deeper, segments follow each other `(d + 1)/WINDOW` steps apart. Few messages on the
//! critical path for large `p` when `n` is small to medium; the ring moves fewer bytes per
//! rank for large `n`.

use std::ops::Range;

use chorus_transport::{Op, Request, Result, Transport, TransportError, Wait};

use crate::cost::{self, Link};
use crate::reduce::{finish_avg_bytes, reduce_bytes};
use crate::{CollCtx, DType, ReduceOp};

/// The step-number space of this schedule's tags (see [`super::step_tag`]).
const ALG_ID: u64 = 3;
/// Tags of segment `k` going up: `k mod 2048`; going down: `2048 + k mod 2048` (matching is by
/// order, the tag only checks it).
const TAG_SPAN: u64 = 2048;

/// Target size of a segment in bytes (rounded down to whole elements, at least one).
pub const SEGMENT_BYTES: usize = 64 * 1024;

/// Segments in progress on a rank at once.
pub const WINDOW: usize = 4;

/// A rank's place in the tree and the segments of its buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The rank segments go up to and come down from (`None` at the root, rank 0).
    pub parent: Option<usize>,
    /// The ranks segments come up from and go down to (zero, one or two).
    pub children: Vec<usize>,
    /// The byte ranges of the segments, in order; they partition the buffer.
    pub segments: Vec<Range<usize>>,
}

/// The tree schedule of `rank` in a group of `size` for `count` elements of `elem_size`
/// bytes.
///
/// ```
/// use chorus_algorithms::allreduce::tree::{plan, SEGMENT_BYTES};
/// let p = plan(1, 5, SEGMENT_BYTES / 4 + 1, 4);
/// assert_eq!((p.parent, p.children.clone()), (Some(0), vec![3, 4]));
/// assert_eq!(p.segments, [0..SEGMENT_BYTES, SEGMENT_BYTES..SEGMENT_BYTES + 4]);
/// ```
///
/// # Panics
/// If `rank >= size` or `elem_size` is zero.
pub fn plan(rank: usize, size: usize, count: usize, elem_size: usize) -> Plan {
    assert!(rank < size, "rank {rank} out of range for {size} ranks");
    assert!(elem_size > 0, "zero element size");
    let seg = (SEGMENT_BYTES / elem_size).max(1) * elem_size;
    let bytes = count * elem_size;
    Plan {
        parent: (rank > 0).then(|| (rank - 1) / 2),
        children: [2 * rank + 1, 2 * rank + 2]
            .into_iter()
            .filter(|&c| c < size)
            .collect(),
        segments: (0..bytes.div_ceil(seg))
            .map(|k| k * seg..((k + 1) * seg).min(bytes))
            .collect(),
    }
}

/// The modelled time of a pipelined-tree allreduce of `bytes` bytes over `ranks` ranks (see
/// [`cost::tree_allreduce`]).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    cost::tree_allreduce(bytes, ranks, SEGMENT_BYTES, link)
}

/// One segment's requests on this rank.
struct Seg {
    range: Range<usize>,
    /// From each child, into its scratch slot.
    up_recv: Vec<Request>,
    /// To the parent, released once reduced.
    up_send: Option<Request>,
    /// From the parent, into the output.
    down_recv: Option<Request>,
    /// To each child, released as the final bytes are known.
    down_send: Vec<Request>,
    reduced: bool,
}

impl Seg {
    fn finished(&self) -> bool {
        self.reduced
            && self.up_send.as_ref().map_or(true, Request::is_complete)
            && self.down_recv.as_ref().map_or(true, Request::is_complete)
            && self.down_send.iter().all(Request::is_complete)
    }
}

/// Fails unless a complete receive brought exactly `want` bytes.
fn check_len(r: &Request, want: usize) -> Result<()> {
    if r.is_complete() && r.bytes_done() != want {
        return Err(TransportError::Mismatch {
            peer: r.peer(),
            expected_tag: r.tag(),
            got_tag: r.tag(),
            expected_len: want,
            got_len: r.bytes_done(),
        });
    }
    Ok(())
}

/// Runs the pipelined tree allreduce on this rank (arguments as
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
    let node = Node {
        parent: plan.parent,
        children: plan.children,
    };
    let segments: Vec<(usize, Range<usize>)> = plan.segments.into_iter().map(|r| (0, r)).collect();
    run_segments(ctx, send, recv, dtype, op, ALG_ID, &[node], &segments)
}

/// A rank's place in one tree: used by [`run_segments`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Node {
    /// The rank segments go up to and come down from (`None` at the root).
    pub(crate) parent: Option<usize>,
    /// The ranks segments come up from and go down to (at most two).
    pub(crate) children: Vec<usize>,
}

/// The pipelined tree machinery, over several trees at once: segment `(t, range)` of
/// `segments` goes up and down tree `trees[t]` (this rank's place in it), in the order given
/// (every rank must pass the same segments in the same order, and the same trees up to its own
/// place in them). The ranges must be disjoint, non-empty and within `recv`; `alg` is the
/// schedule number of the tags ([`super::step_tag`]). A tree's root divides by `p` for `Avg`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_segments(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    alg: u64,
    trees: &[Node],
    segments: &[(usize, Range<usize>)],
) -> Result<()> {
    let size = ctx.transport.size();
    let tag_base = ctx.tag(super::step_tag(alg, 0));
    let up_tag = |k: usize| tag_base | (k as u64 % TAG_SPAN);
    let down_tag = |k: usize| tag_base | (TAG_SPAN + k as u64 % TAG_SPAN);
    let slot_len = segments.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    let max_kids = trees.iter().map(|t| t.children.len()).max().unwrap_or(0);
    let deadline = ctx.deadline;
    let (t, scratch) = ctx.transport_and_scratch(max_kids * WINDOW * slot_len)?;
    // slots[child][w]: the scratch slot of window position `w` for a segment's `child`-th child.
    let mut slots: Vec<Vec<&mut [u8]>> = if max_kids == 0 || slot_len == 0 {
        Vec::new()
    } else {
        scratch
            .chunks_mut(WINDOW * slot_len)
            .take(max_kids)
            .map(|c| c.chunks_mut(slot_len).collect())
            .collect()
    };

    let nseg = segments.len();
    let mut segs: Vec<Seg> = Vec::with_capacity(nseg);
    // Segments lo..segs.len() are in progress; below lo they are finished.
    let mut lo = 0;
    while lo < nseg {
        // Enter new segments into the window, posting their requests in segment order.
        while segs.len() < nseg && segs.len() < lo + WINDOW {
            let k = segs.len();
            let (tree, range) = &segments[k];
            let node = &trees[*tree];
            let len = range.len();
            let mut s = Seg {
                range: range.clone(),
                up_recv: node
                    .children
                    .iter()
                    .map(|&c| Request::recv(c, up_tag(k), len))
                    .collect(),
                up_send: node
                    .parent
                    .map(|p| Request::send_partial(p, up_tag(k), len, 0)),
                down_recv: node.parent.map(|p| Request::recv(p, down_tag(k), len)),
                down_send: node
                    .children
                    .iter()
                    .map(|&c| Request::send_partial(c, down_tag(k), len, 0))
                    .collect(),
                reduced: false,
            };
            for r in s.up_recv.iter_mut().chain(&mut s.up_send) {
                t.post(r)?;
            }
            for r in s.down_recv.iter_mut().chain(&mut s.down_send) {
                t.post(r)?;
            }
            segs.push(s);
        }
        // 1–2. Reduce the segments whose children's parts are all in; release them upwards
        // (or, at the root, downwards).
        for (k, s) in segs.iter_mut().enumerate().skip(lo) {
            for r in &s.up_recv {
                check_len(r, s.range.len())?;
            }
            if !s.reduced && s.up_recv.iter().all(Request::is_complete) {
                let dst = &mut recv[s.range.clone()];
                let nkids = s.up_recv.len();
                if nkids > 0 {
                    if let Some(input) = send {
                        dst.copy_from_slice(&input[s.range.clone()]);
                    }
                }
                for slots in slots.iter().take(nkids) {
                    reduce_bytes(dtype, op, dst, &slots[k % WINDOW][..dst.len()]);
                }
                s.reduced = true;
                match s.up_send.as_mut() {
                    Some(up) => up.set_available(dst.len()),
                    None => {
                        if op == ReduceOp::Avg {
                            finish_avg_bytes(dtype, dst, size);
                        }
                        let len = dst.len();
                        s.down_send.iter_mut().for_each(|d| d.set_available(len));
                    }
                }
            }
            // 3. Release what came down so far to the children.
            if let Some(down) = &s.down_recv {
                check_len(down, s.range.len())?;
                let got = down.bytes_done();
                s.down_send.iter_mut().for_each(|d| d.set_available(got));
            }
        }
        let before = lo;
        while lo < segs.len() && segs[lo].finished() {
            lo += 1;
        }
        if lo != before {
            continue; // enter and release the next segments first
        }
        progress_window(t, &mut segs[lo..], lo, &mut slots, recv, send, deadline)?;
    }
    Ok(())
}

/// One blocking progress call over the requests of segments `first..` that can move.
fn progress_window(
    t: &mut dyn Transport,
    segs: &mut [Seg],
    first: usize,
    slots: &mut [Vec<&mut [u8]>],
    recv: &mut [u8],
    send: Option<&[u8]>,
    deadline: std::time::Instant,
) -> Result<()> {
    let mut ops = Vec::new();
    let mut forwards = Vec::new();
    // Each child's slots in the window's order: segment `first + i` uses slot `(first+i) % W`.
    let mut kid_slots: Vec<_> = slots
        .iter_mut()
        .map(|s| {
            let (a, b) = s.split_at_mut(first % WINDOW);
            b.iter_mut().chain(a.iter_mut())
        })
        .collect();
    // The output cut along the window's segments (disjoint, in any order).
    let mut by_start: Vec<usize> = (0..segs.len()).collect();
    by_start.sort_by_key(|&i| segs[i].range.start);
    let mut outs: Vec<Option<&mut [u8]>> = (0..segs.len()).map(|_| None).collect();
    let (mut rest, mut at) = (&mut recv[..], 0);
    for i in by_start {
        let range = &segs[i].range;
        let tail = std::mem::take(&mut rest).split_at_mut(range.start - at).1;
        let (out, tail) = tail.split_at_mut(range.len());
        outs[i] = Some(out);
        (rest, at) = (tail, range.end);
    }
    for (s, out) in segs.iter_mut().zip(outs) {
        let out = out.expect("one output per segment");
        let leaf_input = send.filter(|_| s.up_recv.is_empty());
        // Every child position advances, whether or not this segment's tree uses it.
        let mine: Vec<&mut &mut [u8]> = kid_slots
            .iter_mut()
            .map(|it| it.next().expect("one slot per window position"))
            .collect();
        for (r, slot) in s.up_recv.iter_mut().zip(mine) {
            if !r.is_complete() {
                ops.push(Op::recv(r, &mut slot[..out.len()]));
            }
        }
        let up_pending = s.up_send.as_ref().is_some_and(|u| !u.is_complete());
        let down_pending = s.down_recv.as_ref().is_some_and(|d| !d.is_complete());
        if down_pending && !up_pending {
            // Receiving into the output: the children's sends of this segment go separately.
            let down = s.down_recv.as_mut().expect("pending");
            ops.push(Op::recv(down, out));
            continue;
        }
        let out: &[u8] = out;
        if let Some(up) = s.up_send.as_mut() {
            if up.available() > up.bytes_done() {
                let src = leaf_input.map_or(out, |i| &i[s.range.clone()]);
                ops.push(Op::send(up, src));
            }
        }
        if !down_pending {
            for d in s.down_send.iter_mut() {
                if d.available() > d.bytes_done() {
                    ops.push(Op::send(d, out));
                }
            }
        }
    }
    if ops.is_empty() {
        // Not an argument error (which would leave this rank usable while its peers wait):
        // the schedule lost its way, and the communicator with it.
        return Err(TransportError::Io {
            peer: None,
            during: "the tree allreduce",
            source: std::io::Error::other("no request can move (internal error)"),
        });
    }
    t.progress(&mut ops, Wait::Until(deadline))?;
    drop(ops);
    // Forward what has arrived of segments still coming down (non-blocking, their own call:
    // the receive holds the same bytes mutably above).
    let recv: &[u8] = recv;
    for s in segs.iter_mut() {
        let out = &recv[s.range.clone()];
        if s.down_recv.as_ref().is_some_and(|d| !d.is_complete()) {
            let got = s.down_recv.as_ref().map_or(0, Request::bytes_done);
            for d in s.down_send.iter_mut() {
                d.set_available(got);
                if d.available() > d.bytes_done() {
                    forwards.push(Op::send(d, out));
                }
            }
        }
    }
    if !forwards.is_empty() {
        t.progress(&mut forwards, Wait::No)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(size: usize, count: usize, elem: usize) {
        let plans: Vec<Plan> = (0..size).map(|r| plan(r, size, count, elem)).collect();
        assert_eq!(plans[0].parent, None);
        for (r, p) in plans.iter().enumerate() {
            // Parent and child links agree, and every rank reaches the root.
            for &c in &p.children {
                assert_eq!(plans[c].parent, Some(r));
            }
            if let Some(q) = p.parent {
                assert!(plans[q].children.contains(&r));
            }
            let (mut at, mut depth) = (r, 0);
            while let Some(q) = plans[at].parent {
                at = q;
                depth += 1;
                assert!(depth <= size.ilog2(), "rank {r} deeper than log2 p");
            }
            // Segments partition the buffer in whole elements, the same on every rank.
            assert_eq!(p.segments, plans[0].segments);
            let mut end = 0;
            for s in &p.segments {
                assert_eq!(s.start, end);
                assert!(!s.is_empty() && s.len() % elem == 0 && s.len() <= SEGMENT_BYTES.max(elem));
                end = s.end;
            }
            assert_eq!(end, count * elem);
        }
        // The reduce covers every rank exactly once: subtree sizes sum up.
        fn subtree(plans: &[Plan], r: usize) -> usize {
            1 + plans[r]
                .children
                .iter()
                .map(|&c| subtree(plans, c))
                .sum::<usize>()
        }
        assert_eq!(subtree(&plans, 0), size);
    }

    #[test]
    fn small_groups() {
        for size in 1..=17 {
            for count in [0, 1, 7, SEGMENT_BYTES / 8 + 3] {
                for elem in [1, 2, 8] {
                    check(size, count, elem);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn trees_and_segments(size in 1usize..=64, count in 0usize..200_000, elem in prop::sample::select(vec![1usize, 2, 4, 8])) {
            check(size, count, elem);
        }
    }
}
