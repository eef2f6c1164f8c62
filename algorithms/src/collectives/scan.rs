//! Scan (`MPI_Scan`, an inclusive prefix reduction) and exclusive scan (`MPI_Exscan`): rank
//! `r` ends with the element-wise reduction of the inputs of ranks `0..=r` (inclusive) or
//! `0..r` (exclusive; rank 0, which has no ranks before it, keeps its output as it was).
//!
//! # Schedules
//!
//! ## [`Algorithm::RecursiveDoubling`] (Hillis–Steele)
//! Each rank keeps a *window*: the reduction of the inputs of a run of ranks ending with its
//! own, at first just its input. At step `k` (distance `d = 2^k < p`) rank `r` sends its window
//! to `r + d` (if there is one) and receives the window of `r − d` (if there is one), which
//! covers the ranks just before its own window: it folds it in, and its window then covers
//! `2d` ranks, clipped at rank 0. After `⌈log₂p⌉` steps the window is the inclusive scan. The
//! exclusive scan is the reduction of the windows received, which cover `0..r` exactly once.
//! Each step is at most one message of `n` bytes each way and one reduction; a rank that both
//! sends and receives pays two message latencies: `⌈log₂p⌉(2α + nβ)`. The choice for small
//! buffers on many ranks (from p = 8).
//!
//! ## [`Algorithm::Chain`] (pipelined)
//! Rank `r` receives the prefix of ranks `0..r` from `r − 1` segment by segment
//! ([`SEGMENT_BYTES`]), folds its own input into each segment and passes it on to `r + 1`
//! while the next segment arrives: every rank sends `n` bytes once, and the last rank is done
//! after `p − 1 + S − 1` steps of one segment (`S` segments): `(p + S − 2)(α + (n/S)β)`. The
//! choice for large buffers, where recursive doubling sends `⌈log₂p⌉·n`.
//!
//! The ops are commutative (sum, product, min, max and the bitwise ones), so the order of the
//! folds does not change an integer result; a floating-point sum may round differently from a
//! left-to-right one. `Avg` has no prefix meaning and is refused by the caller.

use chorus_transport::{Result, Tag};

use super::{ceil_log2, exchange_all, tag};
use crate::cost::Link;
use crate::reduce::reduce_bytes;
use crate::{CollCtx, DType, ReduceOp};

/// The segment of the chain: large enough to amortise a message's latency, small enough to
/// keep the ranks of a chain busy at once.
pub const SEGMENT_BYTES: usize = 64 << 10;

/// A scan schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Recursive doubling; `⌈log₂p⌉` steps of the whole buffer.
    RecursiveDoubling,
    /// A pipelined chain of segments; every rank sends the buffer once.
    Chain,
}

impl Algorithm {
    /// Every schedule.
    pub const ALL: [Algorithm; 2] = [Algorithm::RecursiveDoubling, Algorithm::Chain];

    /// The name used in logs and `CHORUS_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::Chain => "chain",
        }
    }

    const fn id(self) -> u8 {
        match self {
            Algorithm::RecursiveDoubling => 0,
            Algorithm::Chain => 1,
        }
    }

    /// The modelled time of a scan of `bytes` bytes per rank over `ranks` ranks.
    pub fn cost(self, bytes: usize, ranks: usize, link: &Link) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        match self {
            // Every step a rank both sends and receives: two message latencies. Measured at
            // p = 4 (one host, and 4 hosts at 1 gbit), the chain's three hops beat recursive
            // doubling's two exchanges at every size, back to back and one call at a time,
            // which one latency per step would not predict.
            Algorithm::RecursiveDoubling => {
                ceil_log2(ranks) as f64 * (2.0 * link.alpha + bytes as f64 * link.beta)
            }
            Algorithm::Chain => {
                let segments = bytes.div_ceil(SEGMENT_BYTES).max(1);
                let seg = bytes as f64 / segments as f64;
                (ranks + segments - 2) as f64 * (link.alpha + seg * link.beta)
            }
        }
    }

    /// The cheapest schedule.
    pub fn select(bytes: usize, ranks: usize, link: &Link) -> Algorithm {
        super::broadcast::cheapest(&Algorithm::ALL, |a| a.cost(bytes, ranks, link))
    }
}

/// One step of a rank's schedule: where its window goes and whose window comes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// `rank + d`, if it exists.
    pub to: Option<usize>,
    /// `rank − d`, if it exists.
    pub from: Option<usize>,
}

/// The steps of `rank` in a group of `size`.
///
/// ```
/// use chorus_algorithms::collectives::scan::{plan, Step};
/// assert_eq!(plan(0, 3), vec![Step { to: Some(1), from: None }, Step { to: Some(2), from: None }]);
/// assert_eq!(plan(2, 3), vec![Step { to: None, from: Some(1) }, Step { to: None, from: Some(0) }]);
/// assert!(plan(0, 1).is_empty());
/// ```
pub fn plan(rank: usize, size: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut d = 1;
    while d < size {
        steps.push(Step {
            to: (rank + d < size).then_some(rank + d),
            from: rank.checked_sub(d),
        });
        d *= 2;
    }
    steps
}

/// Scans with `alg`: `recv` gets the reduction of the `send` of ranks `0..=rank` (`exclusive`:
/// `0..rank`, and rank 0's `recv` is left as it was). With `send` `None`, `recv` holds the
/// input.
pub fn run(
    alg: Algorithm,
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    exclusive: bool,
) -> Result<()> {
    let what = if exclusive { "exscan" } else { "scan" };
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = recv.len();
    if send.is_some_and(|s| s.len() != n) || n % dtype.size() != 0 {
        return Err(super::invalid(
            what,
            format!(
                "input of {} bytes and output of {n} bytes are not one buffer of {dtype} elements",
                send.map_or(n, <[u8]>::len)
            ),
        ));
    }
    if op == ReduceOp::Avg {
        return Err(super::invalid(what, "avg has no prefix meaning".into()));
    }
    if alg == Algorithm::Chain {
        return chain(ctx, send, recv, dtype, op, exclusive);
    }
    let steps = plan(rank, size);
    let tags: Vec<_> = (0..steps.len())
        .map(|k| tag(ctx, 0, Algorithm::RecursiveDoubling.id(), k))
        .collect();
    let deadline = ctx.deadline;
    let (t, scratch) = ctx.transport_and_scratch(3 * n)?;
    let (window, rest) = scratch.split_at_mut(n);
    let (incoming, before) = rest.split_at_mut(n);
    window.copy_from_slice(send.unwrap_or(recv));
    let mut have_before = false;
    for (k, s) in steps.iter().enumerate() {
        let sends: Vec<(usize, Tag, &[u8])> =
            s.to.map(|to| (to, tags[k], &window[..]))
                .into_iter()
                .collect();
        let recvs: Vec<(usize, Tag, &mut [u8])> = s
            .from
            .map(|from| (from, tags[k], &mut incoming[..]))
            .into_iter()
            .collect();
        exchange_all(t, deadline, &sends, recvs)?;
        drop(sends);
        if s.from.is_some() {
            reduce_bytes(dtype, op, window, incoming);
            if exclusive {
                if have_before {
                    reduce_bytes(dtype, op, before, incoming);
                } else {
                    before.copy_from_slice(incoming);
                    have_before = true;
                }
            }
        }
    }
    match (exclusive, have_before) {
        (false, _) => recv.copy_from_slice(window),
        (true, true) => recv.copy_from_slice(before),
        (true, false) => {}
    }
    Ok(())
}

/// [`Algorithm::Chain`]: segment `k` of the prefix comes from `r − 1` while segment `k − 1`,
/// with this rank's input folded in, goes to `r + 1`.
fn chain(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    exclusive: bool,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = recv.len();
    let prev = rank.checked_sub(1);
    let next = (rank + 1 < size).then_some(rank + 1);
    // Segments of whole elements.
    let seg = (SEGMENT_BYTES / dtype.size()).max(1) * dtype.size();
    // At least one segment, empty for an empty buffer: every link of the chain carries a
    // message, so a rank called with a different count hears of it instead of waiting for
    // segments that never come.
    let segments = n.div_ceil(seg).max(1);
    let part = |k: usize| k * seg..((k + 1) * seg).min(n);
    // A segment's tag is its index: sent at step k + 1, received at step k.
    let tags: Vec<_> = (0..segments)
        .map(|k| tag(ctx, 0, Algorithm::Chain.id(), k))
        .collect();
    let deadline = ctx.deadline;
    let width = seg.min(n);
    let (t, scratch) = ctx.transport_and_scratch(2 * width)?;
    let (incoming, fwd) = scratch.split_at_mut(width);
    for k in 0..=segments {
        // Send the prefix through this rank of segment k − 1 (in `fwd` since the step before)
        // while segment k of the one before arrives; the wait ends both, so `fwd` is then
        // free for segment k.
        let sends: Vec<(usize, Tag, &[u8])> = next
            .filter(|_| k > 0)
            .map(|to| (to, tags[k - 1], &fwd[..part(k - 1).len()]))
            .into_iter()
            .collect();
        let recvs: Vec<(usize, Tag, &mut [u8])> = prev
            .filter(|_| k < segments)
            .map(|from| (from, tags[k], &mut incoming[..part(k).len()]))
            .into_iter()
            .collect();
        if !(sends.is_empty() && recvs.is_empty()) {
            exchange_all(&mut *t, deadline, &sends, recvs)?;
        }
        drop(sends);
        if k == segments {
            break;
        }
        let range = part(k);
        let cur = &mut fwd[..range.len()];
        cur.copy_from_slice(&send.unwrap_or(recv)[range.clone()]);
        if prev.is_some() {
            reduce_bytes(dtype, op, cur, &incoming[..range.len()]);
        }
        if !exclusive {
            recv[range].copy_from_slice(cur);
        } else if prev.is_some() {
            recv[range.clone()].copy_from_slice(&incoming[..range.len()]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection() {
        let l = Link::TCP_LOOPBACK;
        assert_eq!(Algorithm::select(64, 8, &l), Algorithm::RecursiveDoubling);
        assert_eq!(Algorithm::select(64, 4, &l), Algorithm::Chain);
        assert_eq!(Algorithm::select(64 << 20, 8, &l), Algorithm::Chain);
        assert_eq!(
            Algorithm::select(64 << 20, 2, &l),
            Algorithm::RecursiveDoubling
        );
        assert_eq!(Algorithm::Chain.cost(1 << 20, 1, &l), 0.0);
    }

    /// Simulates the plans on sets of ranks: each rank's window is a run ending with its own
    /// rank, the windows it receives are disjoint, and after the last step the window is
    /// `0..=r` and the received ones cover `0..r`.
    #[test]
    fn windows_end_as_the_prefixes() {
        for size in 1..=33usize {
            let plans: Vec<Vec<Step>> = (0..size).map(|r| plan(r, size)).collect();
            let mut window: Vec<u64> = (0..size).map(|r| 1u64 << r).collect();
            let mut before = vec![0u64; size];
            let steps = plans[0].len();
            assert_eq!(steps, ceil_log2(size));
            for k in 0..steps {
                let sent = window.clone();
                for (r, plan) in plans.iter().enumerate() {
                    let s = plan[k];
                    if let Some(to) = s.to {
                        assert_eq!(plans[to][k].from, Some(r), "p={size} step {k}");
                    }
                    if let Some(from) = s.from {
                        assert_eq!(window[r] & sent[from], 0, "p={size} rank {r}: twice");
                        assert_eq!(before[r] & sent[from], 0);
                        window[r] |= sent[from];
                        before[r] |= sent[from];
                    }
                }
            }
            for r in 0..size {
                assert_eq!(window[r], (1u64 << (r + 1)) - 1, "p={size} rank {r}");
                assert_eq!(before[r], (1u64 << r) - 1, "p={size} rank {r}");
            }
        }
    }
}
