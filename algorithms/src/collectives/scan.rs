//! Scan (`MPI_Scan`, an inclusive prefix reduction) and exclusive scan (`MPI_Exscan`): rank
//! `r` ends with the element-wise reduction of the inputs of ranks `0..=r` (inclusive) or
//! `0..r` (exclusive; rank 0, which has no ranks before it, keeps its output as it was).
//!
//! # Schedule: recursive doubling (Hillis–Steele)
//! Each rank keeps a *window*: the reduction of the inputs of a run of ranks ending with its
//! own, at first just its input. At step `k` (distance `d = 2^k < p`) rank `r` sends its window
//! to `r + d` (if there is one) and receives the window of `r − d` (if there is one), which
//! covers the ranks just before its own window: it folds it in, and its window then covers
//! `2d` ranks, clipped at rank 0. After `⌈log₂p⌉` steps the window is the inclusive scan. The
//! exclusive scan is the reduction of the windows received, which cover `0..r` exactly once.
//! Each step is at most one message of `n` bytes each way and one reduction:
//! [`cost`] `⌈log₂p⌉(α + nβ)`.
//!
//! The ops are commutative (sum, product, min, max and the bitwise ones), so the order of the
//! folds does not change an integer result; a floating-point sum may round differently from a
//! left-to-right one. `Avg` has no prefix meaning and is refused by the caller.

use chorus_transport::{Result, Tag};

use super::{ceil_log2, exchange_all, tag};
use crate::cost::Link;
use crate::reduce::reduce_bytes;
use crate::{CollCtx, DType, ReduceOp};

/// The modelled time of a scan of `bytes` bytes per rank over `ranks` ranks.
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    ceil_log2(ranks) as f64 * (link.alpha + bytes as f64 * link.beta)
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

/// Scans: `recv` gets the reduction of the `send` of ranks `0..=rank` (`exclusive`: `0..rank`,
/// and rank 0's `recv` is left as it was). With `send` `None`, `recv` holds the input.
pub fn run(
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
    let steps = plan(rank, size);
    let tags: Vec<_> = (0..steps.len()).map(|k| tag(ctx, 0, 0, k)).collect();
    let deadline = ctx.deadline;
    let (t, scratch) = ctx.transport_and_scratch(3 * n);
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

#[cfg(test)]
mod tests {
    use super::*;

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
