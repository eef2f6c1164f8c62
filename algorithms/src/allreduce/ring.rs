//! Ring allreduce: a reduce-scatter followed by an allgather around the ring `r → r+1`.
//!
//! # Words
//! - **chunk**: the buffer of `count` elements is cut into `p` chunks; chunk `c` starts at
//!   element `c·⌊count/p⌋ + min(c, count mod p)` and the first `count mod p` chunks hold one
//!   element more, so sizes differ by at most one element (chunks are empty when
//!   `count < p`). After the reduce-scatter, chunk `r+1 (mod p)` is fully reduced on rank `r`,
//!   which **owns** it.
//! - **step**: one message to the right neighbour (`r+1`) and one from the left (`r−1`);
//!   there are `2(p−1)` steps, each message one chunk.
//! - **segment**: the part of a chunk handled at once while its message is still arriving:
//!   at least [`SEGMENT_BYTES`] of newly arrived whole elements, or whatever is left when the
//!   message is complete.
//!
//! # Steps (rank `r`, chunk numbers mod `p`)
//! 1. Reduce-scatter, steps `s = 0..p−1`: send chunk `r−s`, receive chunk `r−s−1` into
//!    scratch and reduce it into the buffer segment by segment. The last of these completes
//!    the owned chunk `r+1`; for `Avg` each of its segments is divided by `p` right away.
//! 2. Allgather, steps `s = 0..p−1`: send chunk `r+1−s`, receive chunk `r−s` directly into
//!    the buffer (its final value).
//!
//! Every step sends the chunk received in the step before. So that send is posted a step
//! early with nothing available, and its limit ([`Request::set_available`]) is raised as
//! segments are reduced (or, in the allgather, arrive): forwarding overlaps receiving, and a
//! chunk crosses the ring pipelined rather than store-and-forward.
//!
//! Out of place, step 0 sends straight from the input, and each segment of a reduce-scatter
//! is first copied from the input into the output (hot in cache) and then reduced; the own
//! chunk `r` is never copied since the allgather overwrites it.
//!
//! # Slices
//! A buffer whose chunks would exceed [`SLICE_BYTES`] is reduced in **slices**: consecutive
//! ranges of at most `p` such chunks, each a complete ring allreduce of its own (the steps
//! above), one after another (NCCL's ring loops over its buffer the same way). Unsliced, a
//! step of a 32 MiB buffer on 4 ranks receives, reduces and forwards 8 MiB per rank: the data
//! the ranks touch between a segment's arrival, its reduction and its forwarding outgrows the
//! caches. In slices a step handles at most [`SLICE_BYTES`] per rank. A rank starts its next
//! slice as soon as its own part of the last one is done, so slices overlap by about a step
//! across the ring; the cost model leaves their boundaries out (on the 1 gbit testbed, sliced
//! and unsliced forced rings both moved 119 MB/s busbw from 512 KiB to 64 MiB). [`slices`]
//! cuts them; [`run_sliced`] takes another chunk limit (tests use tiny ones to run many
//! slices on small buffers).
//!
//! # Volume and cost
//! Each rank sends `2(p−1)` messages of about `n/p` bytes, `2(p−1)/p·n` bytes in total, and
//! receives as much: `2(p−1)α + 2(p−1)/p·nβ` ([`cost()`]). One rank, or an empty buffer, sends
//! nothing.

use std::ops::Range;

use chorus_transport::{Op, Request, Result, Tag, Transport, TransportError, Wait};

use crate::cost::{self, Link};
use crate::reduce::{finish_avg_bytes, reduce_bytes};
use crate::{CollCtx, DType, ReduceOp};

/// Bytes of newly arrived data worth a call to the reduce kernel before the message is
/// complete (smaller pieces spend more on calls than they gain in overlap).
pub const SEGMENT_BYTES: usize = 64 * 1024;

/// Largest chunk of a slice in bytes (see the module docs): the buffer is reduced in slices
/// of at most `p` such chunks, one after another. Each step's data then stays in the caches
/// between its arrival, its reduction and its forwarding. On 4 ranks over TCP loopback (2
/// cores, 32 MiB L3), forced ring loops of 32 and 64 MiB moved 700–900 MB/s busbw unsliced
/// (chunks of 8 and 16 MiB) and 1100–1670 MB/s in slices of 512 KiB chunks, level with 256
/// KiB and ahead of 1 MiB chunks.
pub const SLICE_BYTES: usize = 512 * 1024;

/// One step of a rank's schedule: what goes right, what comes from the left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The chunk sent to the right neighbour.
    pub send_chunk: usize,
    /// The chunk received from the left neighbour.
    pub recv_chunk: usize,
    /// Byte range of the buffer sent to the right neighbour.
    pub send: Range<usize>,
    /// Byte range of the buffer the left neighbour's message is for.
    pub recv: Range<usize>,
    /// Reduce-scatter (combine the message into the range) or allgather (overwrite it).
    pub reduce: bool,
}

/// A rank's complete ring schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The neighbour messages come from.
    pub left: usize,
    /// The neighbour messages go to.
    pub right: usize,
    /// The chunk this rank owns (fully reduced) after the reduce-scatter.
    pub owned_chunk: usize,
    /// Its byte range (the whole buffer for one rank).
    pub owned: Range<usize>,
    /// The largest chunk in bytes (the scratch a reduce-scatter receive needs).
    pub max_chunk: usize,
    /// The `2(p−1)` steps: reduce-scatter first, then allgather (none for one rank).
    pub steps: Vec<Step>,
}

/// Byte range of chunk `chunk` of a buffer of `count` elements of `elem_size` bytes split
/// over `size` ranks.
pub fn chunk_range(chunk: usize, size: usize, count: usize, elem_size: usize) -> Range<usize> {
    let (base, extra) = (count / size, count % size);
    let start = chunk * base + chunk.min(extra);
    let len = base + usize::from(chunk < extra);
    start * elem_size..(start + len) * elem_size
}

/// The ring schedule of `rank` in a group of `size` for `count` elements of `elem_size` bytes.
///
/// ```
/// use chorus_algorithms::allreduce::ring::plan;
/// let p = plan(0, 2, 5, 4);
/// assert_eq!(p.steps.len(), 2);
/// assert_eq!(p.steps[0].send, 0..12); // own chunk: 3 elements
/// assert_eq!(p.steps[0].recv, 12..20); // the other chunk, reduced here
/// assert_eq!(p.owned, 12..20);
/// assert_eq!(p.steps[1].send, p.steps[0].recv); // forwarded next
/// ```
///
/// # Panics
/// If `size` is zero or `rank >= size`.
pub fn plan(rank: usize, size: usize, count: usize, elem_size: usize) -> Plan {
    assert!(rank < size, "rank {rank} out of range for {size} ranks");
    let chunk = |c: usize| chunk_range(c, size, count, elem_size);
    let step = |send_chunk: usize, recv_chunk: usize, reduce: bool| Step {
        send_chunk,
        recv_chunk,
        send: chunk(send_chunk),
        recv: chunk(recv_chunk),
        reduce,
    };
    // Chunk numbers are mod `size`; `rank + 2·size` keeps the subtractions from underflowing.
    let r = rank + 2 * size;
    let mut steps = Vec::with_capacity(2 * (size - 1));
    for s in 0..size - 1 {
        steps.push(step((r - s) % size, (r - s - 1) % size, true));
    }
    for s in 0..size - 1 {
        steps.push(step((r + 1 - s) % size, (r - s) % size, false));
    }
    let owned_chunk = (rank + 1) % size;
    Plan {
        left: (rank + size - 1) % size,
        right: (rank + 1) % size,
        owned_chunk,
        owned: if size == 1 {
            0..count * elem_size
        } else {
            chunk(owned_chunk)
        },
        max_chunk: count.div_ceil(size) * elem_size,
        steps,
    }
}

/// The modelled time of a ring allreduce of `bytes` bytes over `ranks` ranks (see
/// [`cost::ring_allreduce`]).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    cost::ring_allreduce(bytes, ranks, link)
}

/// Runs the ring allreduce on this rank (arguments as [`crate::allreduce::run`], which
/// validates them).
pub fn run(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    run_sliced(ctx, send, recv, dtype, op, SLICE_BYTES)
}

/// [`run`] with slices of chunks up to `slice_bytes` instead of [`SLICE_BYTES`] (0: one
/// slice, the whole buffer): every rank must pass the same value.
pub fn run_sliced(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    slice_bytes: usize,
) -> Result<()> {
    let size = ctx.transport.size();
    let count = recv.len() / dtype.size();
    // One rank, or nothing to reduce: the result is the input.
    if size == 1 || count == 0 {
        if let Some(input) = send {
            recv.copy_from_slice(input);
        }
        return Ok(());
    }
    let (steps, elem) = (2 * (size as u64 - 1), dtype.size());
    // Tags repeat every `reuse` slices: slices run one after another, and messages between
    // two ranks arrive in order, so a repeated tag cannot meet an older slice's message. They
    // stay below 2^12: bits 12..16 name the other schedules ([`super::step_tag`]; the ring's
    // number is 0), so ranks that chose differently fail with a tag mismatch.
    let reuse = (STEP_TAGS / steps).max(1);
    for (s, range) in slices(count, size, elem, slice_bytes)
        .into_iter()
        .enumerate()
    {
        let input = send.map(|i| &i[range.clone()]);
        let tag0 = (s as u64 % reuse) * steps;
        run_slice(ctx, input, &mut recv[range], dtype, op, tag0)?;
    }
    Ok(())
}

/// The byte ranges of the slices a buffer of `count` elements of `elem_size` bytes is reduced
/// in over `size` ranks: as few as keep every chunk of a slice within `slice_bytes` (at least
/// one element), balanced to within one element, in order. One slice (the whole buffer) when
/// `slice_bytes` is 0, for one rank or for an empty buffer.
///
/// ```
/// use chorus_algorithms::allreduce::ring::{slices, SLICE_BYTES};
/// // 32 MiB of f32 over 4 ranks: 16 slices of 2 MiB, chunks of 512 KiB.
/// let s = slices(8 << 20, 4, 4, SLICE_BYTES);
/// assert_eq!(s.len(), 16);
/// assert!(s.iter().all(|r| r.len() == 2 << 20));
/// assert_eq!(slices(10, 4, 4, SLICE_BYTES), vec![0..40]);
/// ```
pub fn slices(
    count: usize,
    size: usize,
    elem_size: usize,
    slice_bytes: usize,
) -> Vec<Range<usize>> {
    let n = match (slice_bytes, size) {
        (0, _) | (_, 0..=1) => 1,
        _ => {
            let per_slice = (slice_bytes / elem_size.max(1)).max(1).saturating_mul(size);
            count.div_ceil(per_slice).max(1)
        }
    };
    (0..n)
        .map(|s| chunk_range(s, n, count, elem_size))
        .collect()
}

/// Distinct step tags of the ring: those below the schedule number's bits (12..16).
const STEP_TAGS: u64 = 1 << 12;

/// One ring allreduce over the whole of `recv` (one slice), its tags from step `tag0` on.
fn run_slice(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    tag0: u64,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let count = recv.len() / dtype.size();
    let plan = plan(rank, size, count, dtype.size());
    let tags: Vec<Tag> = (0..plan.steps.len() as u64)
        // Beyond 2^12 steps (p > 2048) the steps' tags wrap too: each step's messages come
        // from one rank, in order.
        .map(|k| ctx.tag((tag0 + k) % STEP_TAGS))
        .collect();
    let deadline = ctx.deadline;
    let (transport, scratch) = ctx.transport_and_scratch(plan.max_chunk)?;
    let mut ring = Ring {
        t: transport,
        deadline,
        dtype,
        op,
        size,
        left: plan.left,
        input: send,
        buf: recv,
        scratch,
    };

    // Step 0 sends this rank's own chunk, all of it available at once.
    let mut current = Request::send(plan.right, tags[0], plan.steps[0].send.len());
    ring.t.post(&mut current)?;
    for (k, step) in plan.steps.iter().enumerate() {
        // Post this step's receive, and the next step's send with nothing available yet.
        let mut incoming = Request::recv(plan.left, tags[k], step.recv.len());
        ring.t.post(&mut incoming)?;
        let mut next = match plan.steps.get(k + 1) {
            Some(n) => Some(Request::send_partial(
                plan.right,
                tags[k + 1],
                n.send.len(),
                0,
            )),
            None => None,
        };
        if let Some(n) = next.as_mut() {
            ring.t.post(n)?;
        }
        if step.reduce {
            // Reduce-scatter: reduce each arrived segment, release it to the next send.
            let finish_avg = op == ReduceOp::Avg && k == size - 2;
            ring.recv_reduce_send(
                k,
                step,
                &mut current,
                &mut incoming,
                next.as_mut(),
                finish_avg,
            )?;
        } else {
            // Allgather: receive in place, release each arrived byte to the next send.
            ring.recv_copy_send(step, &mut current, &mut incoming, next.as_mut())?;
        }
        match next {
            Some(n) => current = n,
            None => break,
        }
    }
    Ok(())
}

/// The state one rank's ring holds while it runs.
struct Ring<'r, 't> {
    t: &'r mut (dyn Transport + 't),
    deadline: std::time::Instant,
    dtype: DType,
    op: ReduceOp,
    size: usize,
    left: usize,
    /// The input of an out-of-place call.
    input: Option<&'r [u8]>,
    /// The output (and, in place, the input).
    buf: &'r mut [u8],
    /// At least one chunk.
    scratch: &'r mut [u8],
}

impl Ring<'_, '_> {
    /// Fails unless a complete receive brought exactly its chunk.
    fn check_complete(&self, incoming: &Request, want: usize) -> Result<bool> {
        if !incoming.is_complete() {
            return Ok(false);
        }
        if incoming.bytes_done() != want {
            return Err(TransportError::Mismatch {
                peer: self.left,
                expected_tag: incoming.tag(),
                got_tag: incoming.tag(),
                expected_len: want,
                got_len: incoming.bytes_done(),
            });
        }
        Ok(true)
    }

    /// A reduce-scatter step: `current` sends `step.send`, `incoming` lands in scratch and is
    /// reduced into `step.recv`, which `next` forwards as it becomes final for this step.
    fn recv_reduce_send(
        &mut self,
        k: usize,
        step: &Step,
        current: &mut Request,
        incoming: &mut Request,
        mut next: Option<&mut Request>,
        finish_avg: bool,
    ) -> Result<()> {
        let want = step.recv.len();
        let elem = self.dtype.size();
        let mut reduced = 0;
        loop {
            let complete = self.check_complete(incoming, want)?;
            let arrived = incoming.bytes_done() / elem * elem;
            if arrived > reduced && (complete || arrived - reduced >= SEGMENT_BYTES) {
                let seg = step.recv.start + reduced..step.recv.start + arrived;
                let dst = &mut self.buf[seg.clone()];
                if let Some(input) = self.input {
                    dst.copy_from_slice(&input[seg]);
                }
                reduce_bytes(self.dtype, self.op, dst, &self.scratch[reduced..arrived]);
                if finish_avg {
                    finish_avg_bytes(self.dtype, dst, self.size);
                }
                reduced = arrived;
                if let Some(n) = next.as_deref_mut() {
                    n.set_available(reduced);
                }
            }
            if complete && current.is_complete() {
                return Ok(());
            }
            let source = match (k, self.input) {
                (0, Some(input)) => &input[step.send.clone()],
                _ => &self.buf[step.send.clone()],
            };
            let mut ops = Vec::with_capacity(3);
            if !current.is_complete() {
                ops.push(Op::send(current, source));
            }
            if !complete {
                ops.push(Op::recv(incoming, &mut self.scratch[..want]));
            }
            if let Some(n) = next.as_deref_mut() {
                if n.available() > n.bytes_done() {
                    ops.push(Op::send(n, &self.buf[step.recv.clone()]));
                }
            }
            self.t.progress(&mut ops, Wait::Until(self.deadline))?;
        }
    }

    /// An allgather step: `current` sends `step.send`, `incoming` lands in `step.recv`, which
    /// `next` forwards byte by byte as it arrives.
    fn recv_copy_send(
        &mut self,
        step: &Step,
        current: &mut Request,
        incoming: &mut Request,
        mut next: Option<&mut Request>,
    ) -> Result<()> {
        let want = step.recv.len();
        loop {
            let complete = self.check_complete(incoming, want)?;
            if let Some(n) = next.as_deref_mut() {
                n.set_available(incoming.bytes_done());
            }
            if complete && current.is_complete() {
                return Ok(());
            }
            // Forward what arrived. It shares its buffer with the receive, so it gets its own
            // non-blocking call; it can only move once `current` is done (per-peer order).
            if let Some(n) = next.as_deref_mut() {
                if current.is_complete() && n.available() > n.bytes_done() {
                    let arrived = &self.buf[step.recv.clone()];
                    self.t.progress(&mut [Op::send(n, arrived)], Wait::No)?;
                }
            }
            // Wait for this step's send and receive.
            let (source, target) = split_pair(self.buf, step.send.clone(), step.recv.clone());
            let mut ops = Vec::with_capacity(2);
            if !current.is_complete() {
                ops.push(Op::send(current, source));
            }
            if !complete {
                ops.push(Op::recv(incoming, target));
            }
            self.t.progress(&mut ops, Wait::Until(self.deadline))?;
        }
    }
}

/// Borrows two disjoint ranges of `buf`, the first shared and the second mutable.
pub(crate) fn split_pair(
    buf: &mut [u8],
    shared: Range<usize>,
    mutable: Range<usize>,
) -> (&[u8], &mut [u8]) {
    if shared.start >= mutable.end {
        let (lo, hi) = buf.split_at_mut(mutable.end);
        (
            &hi[shared.start - mutable.end..shared.end - mutable.end],
            &mut lo[mutable],
        )
    } else {
        assert!(shared.end <= mutable.start, "overlapping ranges");
        let cut = shared.end;
        let (lo, hi) = buf.split_at_mut(cut);
        (&lo[shared], &mut hi[mutable.start - cut..mutable.end - cut])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Checks a whole group's plans by simulating the schedule on sets of contributions: each
    /// rank's chunk is the bitmask of ranks whose input it contains.
    fn check_group(size: usize, count: usize, elem: usize) {
        // Chunks partition the buffer, in order, with sizes differing by at most one element.
        let mut end = 0;
        let lens: Vec<usize> = (0..size)
            .map(|c| {
                let r = chunk_range(c, size, count, elem);
                assert_eq!(r.start, end);
                end = r.end;
                r.len()
            })
            .collect();
        assert_eq!(end, count * elem);
        assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= elem);

        let plans: Vec<Plan> = (0..size).map(|r| plan(r, size, count, elem)).collect();
        let full: u64 = if size == 64 {
            u64::MAX
        } else {
            (1 << size) - 1
        };
        // have[r][c]: the ranks whose input rank r's copy of chunk c contains.
        let mut have: Vec<Vec<u64>> = (0..size).map(|r| vec![1 << r; size]).collect();
        for p in &plans {
            assert_eq!(p.steps.len(), 2 * (size - 1));
            assert_eq!(*lens.iter().max().unwrap(), p.max_chunk);
        }
        for k in 0..2 * (size - 1) {
            let mut next = have.clone();
            for (r, p) in plans.iter().enumerate() {
                let step = &p.steps[k];
                // What the left neighbour sends is what this rank expects to receive.
                let left = &plans[p.left].steps[k];
                assert_eq!(left.send, step.recv, "rank {r} step {k}");
                assert_eq!(plans[p.left].right, r);
                // Each send is the chunk received in the step before.
                if k > 0 {
                    assert_eq!(step.send, p.steps[k - 1].recv);
                }
                assert_eq!(step.reduce, k < size - 1);
                assert_eq!(step.send, chunk_range(step.send_chunk, size, count, elem));
                assert_eq!(step.recv, chunk_range(step.recv_chunk, size, count, elem));
                assert_eq!(left.send_chunk, step.recv_chunk);
                let c = step.recv_chunk;
                let got = have[p.left][c];
                if step.reduce {
                    assert_eq!(have[r][c] & got, 0, "rank {r} step {k}: counted twice");
                    next[r][c] = have[r][c] | got;
                } else {
                    assert_eq!(got, full, "allgather forwards a final chunk");
                    next[r][c] = got;
                }
            }
            have = next;
            if k == size - 2 {
                for (r, p) in plans.iter().enumerate() {
                    let c = p.owned_chunk;
                    assert_eq!(p.owned, chunk_range(c, size, count, elem));
                    assert_eq!(have[r][c], full, "rank {r} owns a reduced chunk");
                    assert_eq!(p.steps[k].recv_chunk, c);
                }
            }
        }
        for (r, h) in have.iter().enumerate() {
            assert!(h.iter().all(|&m| m == full), "rank {r} ends with {h:?}");
        }
    }

    #[test]
    fn small_groups() {
        for size in 1..=9 {
            for count in [0, 1, 2, 7, 8, 9, 100] {
                for elem in [1, 2, 4, 8] {
                    check_group(size, count, elem);
                }
            }
        }
    }

    #[test]
    fn one_rank_has_no_steps() {
        let p = plan(0, 1, 10, 4);
        assert!(p.steps.is_empty());
        assert_eq!(p.owned, 0..40);
    }

    #[test]
    fn split_pair_borrows_either_order() {
        let mut b = [0u8, 1, 2, 3, 4, 5];
        let (s, m) = split_pair(&mut b, 0..2, 3..6);
        assert_eq!(s, &[0, 1]);
        assert_eq!(m, &mut [3, 4, 5]);
        let (s, m) = split_pair(&mut b, 4..6, 0..3);
        assert_eq!(s, &[4, 5]);
        assert_eq!(m, &mut [0, 1, 2]);
        let (s, m) = split_pair(&mut b, 2..2, 2..2);
        assert!(s.is_empty() && m.is_empty());
    }

    proptest! {
        #[test]
        fn plans_are_consistent(size in 1usize..=24, count in 0usize..2000, elem in prop::sample::select(vec![1usize, 2, 4, 8])) {
            check_group(size, count, elem);
        }

        #[test]
        fn chunk_sizes_are_balanced(size in 1usize..=64, count in 0usize..100_000) {
            let lens: Vec<usize> = (0..size).map(|c| chunk_range(c, size, count, 1).len()).collect();
            prop_assert_eq!(lens.iter().sum::<usize>(), count);
            prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
    }
}
