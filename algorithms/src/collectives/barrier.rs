//! Barrier: no rank leaves before every rank entered.
//!
//! # Schedule: dissemination
//! `⌈log₂p⌉` steps; at step `k` rank `r` sends an empty message to `r + 2^k` and waits for
//! the one from `r − 2^k` (mod p). After step `k` a rank has heard, directly or through the
//! chain, from the `2^(k+1) − 1` ranks before it, so after the last step from everyone. No
//! payload: `⌈log₂p⌉·α`, for any `p` (no power of two needed, no root).

use chorus_transport::Result;

use super::{exchange, tag};
use crate::cost::Link;
use crate::CollCtx;

/// The (send to, receive from) peers of each step of `rank`.
///
/// ```
/// use chorus_algorithms::collectives::barrier::plan;
/// assert_eq!(plan(0, 5), vec![(1, 4), (2, 3), (4, 1)]);
/// assert!(plan(0, 1).is_empty());
/// ```
pub fn plan(rank: usize, size: usize) -> Vec<(usize, usize)> {
    let mut steps = Vec::new();
    let mut d = 1;
    while d < size {
        steps.push(((rank + d) % size, (rank + size - d) % size));
        d *= 2;
    }
    steps
}

/// The modelled time of a barrier over `ranks` ranks.
pub fn cost(ranks: usize, link: &Link) -> f64 {
    super::ceil_log2(ranks) as f64 * link.alpha
}

/// Waits until every rank called it.
pub fn run(ctx: &mut CollCtx<'_>) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    for (k, (to, from)) in plan(rank, size).into_iter().enumerate() {
        let t = tag(ctx, 0, 0, k);
        exchange(
            &mut *ctx.transport,
            ctx.deadline,
            to,
            t,
            &[],
            from,
            t,
            &mut [],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates knowledge: after the last step every rank has heard from every rank.
    #[test]
    fn everyone_hears_from_everyone() {
        for size in 1..=40usize {
            let plans: Vec<_> = (0..size).map(|r| plan(r, size)).collect();
            let mut knows: Vec<u64> = (0..size).map(|r| 1u64 << r).collect();
            for k in 0..plans[0].len() {
                let mut next = knows.clone();
                for (r, p) in plans.iter().enumerate() {
                    let (_, from) = p[k];
                    assert_eq!(plans[from][k].0, r, "p={size} step {k}");
                    next[r] |= knows[from];
                }
                knows = next;
            }
            let full = if size == 64 {
                u64::MAX
            } else {
                (1u64 << size) - 1
            };
            assert!(knows.iter().all(|&m| m == full), "p={size}");
            assert_eq!(plans[0].len(), super::super::ceil_log2(size));
        }
    }
}
