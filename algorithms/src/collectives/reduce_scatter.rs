//! Reduce-scatter: every rank contributes `p` blocks of `b` bytes (`n = p·b`); rank `r` ends
//! with block `r` of the element-wise reduction.
//!
//! # Schedules
//! - [`Algorithm::Ring`]: `p−1` steps. At step `s` rank `r` sends its partial result of block
//!   `r−s−1` to `r+1` and receives the partial of block `r−s−2` from `r−1` (mod p), which it
//!   combines with its own input block; step 0 sends the input block itself. The last block
//!   received is block `r`, complete. Each rank sends `(p−1)/p·n` bytes:
//!   `(p−1)α + (p−1)/p·nβ`. Partials alternate between two scratch blocks.
//! - [`Algorithm::RecursiveHalving`] (p a power of two; otherwise the ring runs): the rank
//!   copies its input to scratch; at step `k` (distance `d = p/2, p/4, …, 1`) it sends the
//!   half of its current window of blocks that does not contain block `r` to `r xor d` and
//!   reduces the other half with what that partner sends. Each rank sends `n/2 + n/4 + … =
//!   (p−1)/p·n` bytes in `log₂p` steps: `log₂p·α + (p−1)/p·nβ`, plus the copy of the input
//!   (`n` bytes at [`MEMCPY_BYTES_PER_S`]), which makes the ring the better choice for large
//!   inputs (measured on loopback TCP, p=4, 8 MiB: ring 0.76 GB/s busbw, halving 0.34).
//!
//! `Avg` divides the final block by `p`, once. In place (`send` `None`) the output buffer
//! holds the `p` input blocks and the result overwrites block `r` only.

use std::ops::Range;

use chorus_transport::Result;

use super::broadcast::cheapest;
use super::{block, disjoint, exchange, tag};
use crate::cost::Link;
use crate::reduce::{finish_avg_bytes, reduce_bytes};
use crate::{CollCtx, DType, ReduceOp};

/// Memory copy bandwidth assumed by the cost model (DESIGN.md §5: 9.6–13.8 GB/s one thread).
pub const MEMCPY_BYTES_PER_S: f64 = 10e9;

/// A reduce-scatter schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring; `p−1` steps.
    Ring,
    /// Recursive halving; `log₂p` steps (p a power of two).
    RecursiveHalving,
}

impl Algorithm {
    /// Every schedule.
    pub const ALL: [Algorithm; 2] = [Algorithm::Ring, Algorithm::RecursiveHalving];

    /// The name used in logs and `CHORUS_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveHalving => "recursive_halving",
        }
    }

    /// The schedule that actually runs on `ranks` ranks (recursive halving needs a power of
    /// two and falls back to the ring).
    pub fn effective(self, ranks: usize) -> Algorithm {
        match self {
            Algorithm::RecursiveHalving if !ranks.is_power_of_two() => Algorithm::Ring,
            a => a,
        }
    }

    const fn id(self) -> u8 {
        match self {
            Algorithm::Ring => 0,
            Algorithm::RecursiveHalving => 1,
        }
    }

    /// The modelled time of a reduce-scatter of `bytes` input bytes (all `p` blocks) over
    /// `ranks` ranks.
    pub fn cost(self, bytes: usize, ranks: usize, link: &Link) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let p = ranks as f64;
        let volume = (p - 1.0) / p * bytes as f64 * link.beta;
        match self.effective(ranks) {
            Algorithm::Ring => (p - 1.0) * link.alpha + volume,
            Algorithm::RecursiveHalving => {
                super::ceil_log2(ranks) as f64 * link.alpha
                    + volume
                    + bytes as f64 / MEMCPY_BYTES_PER_S
            }
        }
    }

    /// The cheapest schedule.
    pub fn select(bytes: usize, ranks: usize, link: &Link) -> Algorithm {
        cheapest(&Algorithm::ALL, |a| a.cost(bytes, ranks, link))
    }
}

/// One step of a rank's schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Where this rank's partial goes.
    pub to: usize,
    /// Where the incoming partial comes from.
    pub from: usize,
    /// The blocks sent (partial results).
    pub send_blocks: Range<usize>,
    /// The blocks received and combined.
    pub recv_blocks: Range<usize>,
}

/// The steps of `rank` in a group of `size` (the schedule actually run).
///
/// ```
/// use chorus_algorithms::collectives::reduce_scatter::{plan, Algorithm};
/// let s = plan(Algorithm::RecursiveHalving, 1, 4);
/// assert_eq!((s[0].to, s[0].send_blocks.clone(), s[0].recv_blocks.clone()), (3, 2..4, 0..2));
/// assert_eq!((s[1].to, s[1].send_blocks.clone(), s[1].recv_blocks.clone()), (0, 0..1, 1..2));
/// let s = plan(Algorithm::Ring, 0, 3);
/// assert_eq!((s[1].send_blocks.clone(), s[1].recv_blocks.clone()), (1..2, 0..1));
/// ```
pub fn plan(alg: Algorithm, rank: usize, size: usize) -> Vec<Step> {
    match alg.effective(size) {
        Algorithm::Ring => {
            let r = rank + 2 * size;
            (0..size - 1)
                .map(|s| {
                    let sb = (r - s - 1) % size;
                    let rb = (r - s - 2) % size;
                    Step {
                        to: (rank + 1) % size,
                        from: (rank + size - 1) % size,
                        send_blocks: sb..sb + 1,
                        recv_blocks: rb..rb + 1,
                    }
                })
                .collect()
        }
        Algorithm::RecursiveHalving => {
            let mut steps = Vec::new();
            let mut d = size / 2;
            while d >= 1 {
                let base = rank / (2 * d) * (2 * d);
                let (keep, give) = if rank & d == 0 {
                    (base..base + d, base + d..base + 2 * d)
                } else {
                    (base + d..base + 2 * d, base..base + d)
                };
                steps.push(Step {
                    to: rank ^ d,
                    from: rank ^ d,
                    send_blocks: give,
                    recv_blocks: keep,
                });
                d /= 2;
            }
            steps
        }
    }
}

/// Reduce-scatters: `send` holds `p` blocks and `recv` gets block `rank` of the reduction;
/// with `send` `None`, `recv` holds the `p` input blocks and block `rank` gets the result.
pub fn run(
    alg: Algorithm,
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = send.map_or(recv.len(), <[u8]>::len);
    let b = n / size;
    let out_ok = match send {
        Some(_) => recv.len() * size == n,
        None => n % size == 0,
    };
    if !out_ok || b % dtype.size() != 0 {
        return Err(super::invalid(
            "reduce_scatter",
            format!(
                "input of {n} bytes and output of {} bytes are not {size} blocks and one block \
                 of {dtype} elements",
                recv.len()
            ),
        ));
    }
    let alg = alg.effective(size);
    let steps = plan(alg, rank, size);
    let deadline = ctx.deadline;
    let tags: Vec<_> = (0..steps.len()).map(|k| tag(ctx, 0, alg.id(), k)).collect();
    let bytes = |blocks: &Range<usize>| blocks.start * b..blocks.end * b;
    let input: &[u8] = send.unwrap_or(recv);
    // The reduced block `rank` ends in `result`, a part of scratch.
    let result: &[u8] = match alg {
        Algorithm::Ring => {
            let (t, scratch) = ctx.transport_and_scratch(2 * b)?;
            for (k, s) in steps.iter().enumerate() {
                // Send the partial of the step before (step 0: the input block), receive the
                // next partial into the other scratch block and combine it with the input.
                let (mine, other) = if k % 2 == 0 {
                    (0..b, b..2 * b)
                } else {
                    (b..2 * b, 0..b)
                };
                let (prev, cur) = disjoint(scratch, other, mine);
                let out = if k == 0 {
                    &input[bytes(&s.send_blocks)]
                } else {
                    prev
                };
                exchange(t, deadline, s.to, tags[k], out, s.from, tags[k], cur)?;
                reduce_bytes(dtype, op, cur, &input[bytes(&s.recv_blocks)]);
            }
            match steps.len() {
                0 => {
                    scratch[..b].copy_from_slice(&input[block(rank, b)]);
                    &scratch[..b]
                }
                k if (k - 1) % 2 == 0 => &scratch[..b],
                _ => &scratch[b..2 * b],
            }
        }
        Algorithm::RecursiveHalving => {
            let (t, scratch) = ctx.transport_and_scratch(n + n / 2)?;
            let (acc, incoming) = scratch.split_at_mut(n);
            acc.copy_from_slice(input);
            for (k, s) in steps.iter().enumerate() {
                // Give away the half without block `rank`, combine the partner's half.
                let keep = bytes(&s.recv_blocks);
                let inb = &mut incoming[..keep.len()];
                let (out, dst) = disjoint(acc, bytes(&s.send_blocks), keep);
                exchange(t, deadline, s.to, tags[k], out, s.from, tags[k], inb)?;
                reduce_bytes(dtype, op, dst, inb);
            }
            &acc[block(rank, b)]
        }
    };
    let out = match send {
        Some(_) => &mut recv[..],
        None => &mut recv[block(rank, b)],
    };
    out.copy_from_slice(result);
    if op == ReduceOp::Avg {
        finish_avg_bytes(dtype, out, size);
    }
    Ok(())
}

/// Reduce-scatterv (`MPI_Reduce_scatter`): block `j` of the input has `counts[j]` bytes (any,
/// zero included, whole elements), back to back in rank order; rank `r` ends with block `r`
/// of the reduction, in `recv` (`counts[r]` bytes), or with `send` `None` in its place in
/// `recv`, which then holds the whole input. The ring of [`run`] on blocks of their own sizes:
/// every block goes round the ring and each hop checks its length, so ranks that disagree
/// about a count fail with a mismatch.
pub fn run_v(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    counts: &[usize],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let bad = |m: String| Err(super::invalid("reduce_scatter_v", m));
    if counts.len() != size {
        return bad(format!("{} counts for {size} ranks", counts.len()));
    }
    let Some(off) = super::offsets(counts) else {
        return bad("the counts overflow".into());
    };
    if counts.iter().any(|c| c % dtype.size() != 0) {
        return bad(format!("a count is not a whole number of {dtype} elements"));
    }
    let n = send.map_or(recv.len(), <[u8]>::len);
    let out_len = if send.is_some() { counts[rank] } else { n };
    if n != off[size] || recv.len() != out_len {
        return bad(format!(
            "input of {n} bytes and output of {} bytes where the counts add up to {} and this \
             rank's is {}",
            recv.len(),
            off[size],
            counts[rank]
        ));
    }
    let blk = |j: usize| off[j]..off[j + 1];
    let steps = plan(Algorithm::Ring, rank, size);
    let deadline = ctx.deadline;
    let tags: Vec<_> = (0..steps.len())
        .map(|k| tag(ctx, 0, Algorithm::Ring.id(), k))
        .collect();
    let input: &[u8] = send.unwrap_or(recv);
    let widest = counts.iter().copied().max().unwrap_or(0);
    let (t, scratch) = ctx.transport_and_scratch(2 * widest)?;
    // As in `run`: partials alternate between two scratch halves of the widest block.
    let mut last = 0..0;
    for (k, s) in steps.iter().enumerate() {
        let (sb, rb) = (s.send_blocks.start, s.recv_blocks.start);
        let (mine, other) = if k % 2 == 0 {
            (0..widest, widest..2 * widest)
        } else {
            (widest..2 * widest, 0..widest)
        };
        let (prev, cur) = disjoint(scratch, other, mine.clone());
        let out = if k == 0 {
            &input[blk(sb)]
        } else {
            &prev[..counts[sb]]
        };
        let cur = &mut cur[..counts[rb]];
        exchange(t, deadline, s.to, tags[k], out, s.from, tags[k], cur)?;
        reduce_bytes(dtype, op, cur, &input[blk(rb)]);
        last = mine.start..mine.start + counts[rb];
    }
    let out = match send {
        Some(_) => &mut recv[..],
        None => &mut recv[blk(rank)],
    };
    match (steps.is_empty(), send) {
        (false, _) => out.copy_from_slice(&scratch[last]),
        (true, Some(s)) => out.copy_from_slice(s),
        (true, None) => {}
    }
    if op == ReduceOp::Avg {
        finish_avg_bytes(dtype, out, size);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the plans on sets of contributions: a rank only sends partials it holds, each
    /// contribution is counted once, and rank `r` ends with block `r` from every rank.
    fn check(alg: Algorithm, size: usize) {
        let plans: Vec<Vec<Step>> = (0..size).map(|r| plan(alg, r, size)).collect();
        // have[r][j]: ranks whose block j rank r's partial of block j contains.
        let mut have: Vec<Vec<u64>> = (0..size).map(|r| vec![1u64 << r; size]).collect();
        for k in 0..plans[0].len() {
            let mut next = have.clone();
            for (r, p) in plans.iter().enumerate() {
                let s = &p[k];
                let sender = &plans[s.from][k];
                assert_eq!(sender.to, r);
                assert_eq!(sender.send_blocks, s.recv_blocks);
                for j in s.recv_blocks.clone() {
                    let got = have[s.from][j];
                    let base = have[r][j];
                    assert_eq!(base & got, 0, "{alg:?} p={size} rank {r} step {k}: twice");
                    next[r][j] = base | got;
                }
            }
            have = next;
        }
        let full = (1u64 << size) - 1;
        for (r, h) in have.iter().enumerate() {
            assert_eq!(h[r], full, "{alg:?} p={size}: rank {r}");
        }
    }

    #[test]
    fn every_rank_ends_with_its_block_reduced() {
        for size in 1..=17 {
            check(Algorithm::Ring, size);
            check(Algorithm::RecursiveHalving, size);
        }
        assert_eq!(plan(Algorithm::RecursiveHalving, 3, 8).len(), 3);
        assert_eq!(plan(Algorithm::RecursiveHalving, 3, 6).len(), 5);
    }

    #[test]
    fn selection() {
        let l = Link::TCP_LOOPBACK;
        assert_eq!(Algorithm::select(64, 8, &l), Algorithm::RecursiveHalving);
        assert_eq!(Algorithm::select(64 << 20, 8, &l), Algorithm::Ring);
        assert_eq!(Algorithm::select(64, 6, &l), Algorithm::Ring);
    }
}
