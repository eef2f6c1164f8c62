//! All-to-all: every rank holds `p` blocks of `b` bytes (`n = p·b`); block `j` of rank `r`
//! ends as block `r` of rank `j`.
//!
//! # Schedule: pairwise exchange
//! The own block is copied locally; then `p−1` steps: at step `s = 1..p` rank `r` sends block
//! `r+s` to rank `r+s` and receives block `r−s` from rank `r−s` (mod p), straight into the
//! output. Every rank sends and receives one block per step, so no rank is flooded:
//! `(p−1)α + (p−1)/p·nβ`. In place (`send` `None`) the input is first copied to scratch.
//!
//! # Schedule: linear
//! The `p−1` exchanges are posted at once instead of one step after another, as MPI's linear
//! all-to-all does for small messages: one latency instead of `p−1`, but every link carries
//! `p−1` flows at once.
//!
//! The automatic choice ([`Algorithm::auto`]) is linear where a rank's blocks are small (at
//! most [`ALL_AT_ONCE_BYTES`] each), pairwise above; `CHORUS_ALGO` (`alltoall:pairwise`,
//! `alltoall:linear`) forces one. Each pair of ranks exchanges one message each way per call,
//! with the tag of its step either way, so ranks that decide differently (the blocks of an
//! alltoallv differ) still match.

use std::time::Instant;

use chorus_transport::{Result, Tag, Transport};

use super::{block, exchange, exchange_all, pieces, tag};

/// The largest block a rank sends or receives for the exchanges to be posted all at once.
pub const ALL_AT_ONCE_BYTES: usize = 16 << 10;
use crate::cost::Link;
use crate::CollCtx;

/// An all-to-all schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every exchange posted at once.
    Linear,
    /// One exchange after another.
    Pairwise,
}

impl Algorithm {
    /// Every schedule.
    pub const ALL: [Algorithm; 2] = [Algorithm::Linear, Algorithm::Pairwise];

    /// The name used in logs and `CHORUS_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Linear => "linear",
            Algorithm::Pairwise => "pairwise",
        }
    }

    /// The schedule for blocks of at most `largest_block` bytes among those `allowed` (in the
    /// order of [`Algorithm::ALL`]): the only one allowed, or linear up to
    /// [`ALL_AT_ONCE_BYTES`] and pairwise above.
    pub fn auto(allowed: &[bool], largest_block: usize) -> Algorithm {
        match allowed {
            [true, false] => Algorithm::Linear,
            [false, true] => Algorithm::Pairwise,
            _ if largest_block <= ALL_AT_ONCE_BYTES => Algorithm::Linear,
            _ => Algorithm::Pairwise,
        }
    }
}

/// One step: the peers of the exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The rank this one sends its block `to` to.
    pub to: usize,
    /// The rank whose block for this one arrives (it lands in block `from`).
    pub from: usize,
}

/// The `p−1` steps of `rank` in a group of `size`.
///
/// ```
/// use chorus_algorithms::collectives::alltoall::plan;
/// let s = plan(1, 4);
/// assert_eq!((s[0].to, s[0].from), (2, 0));
/// assert_eq!((s[2].to, s[2].from), (0, 2));
/// ```
pub fn plan(rank: usize, size: usize) -> Vec<Step> {
    (1..size)
        .map(|s| Step {
            to: (rank + s) % size,
            from: (rank + size - s) % size,
        })
        .collect()
}

/// The modelled time of an all-to-all of `bytes` bytes per rank (all `p` blocks).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let p = ranks as f64;
    (p - 1.0) * link.alpha + (p - 1.0) / p * bytes as f64 * link.beta
}

/// Exchanges blocks: `send` (or, `None`, `recv` itself) holds the `p` outgoing blocks,
/// `recv` receives the `p` incoming ones, by the schedule [`Algorithm::auto`] picks among
/// those `allowed`.
pub fn run(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    allowed: &[bool],
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = recv.len();
    if n % size != 0 || send.is_some_and(|s| s.len() != n) {
        return Err(super::invalid(
            "all_to_all",
            format!(
                "input of {} bytes and output of {n} bytes are not both {size} equal blocks",
                send.map_or(n, <[u8]>::len)
            ),
        ));
    }
    let b = n / size;
    let steps = plan(rank, size);
    let tags: Vec<_> = (0..steps.len()).map(|k| tag(ctx, 0, 0, k)).collect();
    let deadline = ctx.deadline;
    let (t, scratch) = ctx.transport_and_scratch(if send.is_some() { 0 } else { n });
    let input: &[u8] = match send {
        Some(s) => s,
        None => {
            scratch.copy_from_slice(recv);
            scratch
        }
    };
    recv[block(rank, b)].copy_from_slice(&input[block(rank, b)]);
    let offsets: Vec<usize> = (0..=size).map(|j| j * b).collect();
    let at_once = Algorithm::auto(allowed, b) == Algorithm::Linear;
    exchange_blocks(
        t, deadline, &steps, &tags, input, &offsets, recv, &offsets, at_once,
    )
}

/// The exchanges of `steps` (this rank's own block already copied): block `j` of `send` lies
/// at `so[j]..so[j + 1]`, block `j` of `recv` at `ro[j]..ro[j + 1]`; the step-`k` messages
/// carry `tags[k]` either way. Posted all at once when `at_once` (and there is more than one
/// step), else step by step.
#[allow(clippy::too_many_arguments)]
fn exchange_blocks(
    t: &mut dyn Transport,
    deadline: Instant,
    steps: &[Step],
    tags: &[Tag],
    send: &[u8],
    so: &[usize],
    recv: &mut [u8],
    ro: &[usize],
    at_once: bool,
) -> Result<()> {
    if at_once && steps.len() > 1 {
        let sends: Vec<_> = steps
            .iter()
            .zip(tags)
            .map(|(s, &tg)| (s.to, tg, &send[so[s.to]..so[s.to + 1]]))
            .collect();
        let mut blocks: Vec<Option<&mut [u8]>> = pieces(recv, ro).into_iter().map(Some).collect();
        let recvs = steps
            .iter()
            .zip(tags)
            .map(|(s, &tg)| (s.from, tg, blocks[s.from].take().expect("each block once")))
            .collect();
        return exchange_all(t, deadline, &sends, recvs);
    }
    for (s, &tg) in steps.iter().zip(tags) {
        exchange(
            t,
            deadline,
            s.to,
            tg,
            &send[so[s.to]..so[s.to + 1]],
            s.from,
            tg,
            &mut recv[ro[s.from]..ro[s.from + 1]],
        )?;
    }
    Ok(())
}

/// Alltoallv: rank `r` sends `send_counts[j]` bytes to rank `j` (its blocks back to back in
/// rank order in `send`) and receives `recv_counts[j]` bytes from rank `j` (back to back in
/// `recv`), any of them zero, by the pairwise exchange of [`run`]. Rank `r`'s
/// `send_counts[j]` must be rank `j`'s `recv_counts[r]`: a rank that gets a block of another
/// length fails with a mismatch. Out of place only (`send` and `recv` are distinct buffers).
pub fn run_v(
    ctx: &mut CollCtx<'_>,
    send: &[u8],
    send_counts: &[usize],
    recv: &mut [u8],
    recv_counts: &[usize],
    allowed: &[bool],
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let bad = |m: String| Err(super::invalid("all_to_all_v", m));
    if send_counts.len() != size || recv_counts.len() != size {
        return bad(format!(
            "{} send and {} receive counts for {size} ranks",
            send_counts.len(),
            recv_counts.len()
        ));
    }
    let (Some(so), Some(ro)) = (super::offsets(send_counts), super::offsets(recv_counts)) else {
        return bad("the counts overflow".into());
    };
    if so[size] != send.len() || ro[size] != recv.len() {
        return bad(format!(
            "buffers of {} and {} bytes where the counts add up to {} and {}",
            send.len(),
            recv.len(),
            so[size],
            ro[size]
        ));
    }
    if send_counts[rank] != recv_counts[rank] {
        return bad(format!(
            "this rank sends itself {} bytes but receives {}",
            send_counts[rank], recv_counts[rank]
        ));
    }
    recv[ro[rank]..ro[rank + 1]].copy_from_slice(&send[so[rank]..so[rank + 1]]);
    let steps = plan(rank, size);
    let tags: Vec<_> = (0..steps.len()).map(|k| tag(ctx, 0, 0, k)).collect();
    let largest = send_counts
        .iter()
        .chain(recv_counts)
        .copied()
        .max()
        .unwrap_or(0);
    let at_once = Algorithm::auto(allowed, largest) == Algorithm::Linear;
    exchange_blocks(
        &mut *ctx.transport,
        ctx.deadline,
        &steps,
        &tags,
        send,
        &so,
        recv,
        &ro,
        at_once,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_reaches_its_rank_once() {
        for size in 1..=17 {
            let plans: Vec<Vec<Step>> = (0..size).map(|r| plan(r, size)).collect();
            for (r, p) in plans.iter().enumerate() {
                assert_eq!(p.len(), size - 1);
                let mut from: Vec<usize> = p.iter().map(|s| s.from).collect();
                from.push(r);
                from.sort_unstable();
                assert_eq!(from, (0..size).collect::<Vec<_>>());
                for (k, s) in p.iter().enumerate() {
                    // The sender of this step sends to this rank in the same step.
                    assert_eq!(plans[s.from][k].to, r);
                }
            }
        }
    }
}
