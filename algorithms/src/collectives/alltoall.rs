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

use super::layout::Layout;
use super::{block, exchange, exchange_all, tag};

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
    let (t, scratch) = ctx.transport_and_scratch(if send.is_some() { 0 } else { n })?;
    let input: &[u8] = match send {
        Some(s) => s,
        None => {
            scratch.copy_from_slice(recv);
            scratch
        }
    };
    recv[block(rank, b)].copy_from_slice(&input[block(rank, b)]);
    let layout = Layout::packed(&vec![b; size]).expect("the blocks fit in the buffer");
    let at_once = Algorithm::auto(allowed, b) == Algorithm::Linear;
    exchange_blocks(
        t, deadline, &steps, &tags, input, &layout, recv, &layout, at_once,
    )
}

/// The exchanges of `steps` (this rank's own block already copied): block `j` of `send` lies
/// at `so.block(j)`, block `j` of `recv` at `ro.block(j)` (blocks that do not overlap, checked
/// by the caller); the step-`k` messages
/// carry `tags[k]` either way. Posted all at once when `at_once` (and there is more than one
/// step), else step by step.
#[allow(clippy::too_many_arguments)]
fn exchange_blocks(
    t: &mut dyn Transport,
    deadline: Instant,
    steps: &[Step],
    tags: &[Tag],
    send: &[u8],
    so: &Layout,
    recv: &mut [u8],
    ro: &Layout,
    at_once: bool,
) -> Result<()> {
    if at_once && steps.len() > 1 {
        let sends: Vec<_> = steps
            .iter()
            .zip(tags)
            .map(|(s, &tg)| (s.to, tg, &send[so.block(s.to)]))
            .collect();
        let mut blocks: Vec<Option<&mut [u8]>> = ro.pieces(recv).into_iter().map(Some).collect();
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
            &send[so.block(s.to)],
            s.from,
            tg,
            &mut recv[ro.block(s.from)],
        )?;
    }
    Ok(())
}

/// Alltoallv: rank `r` sends `send_blocks.block(j)` of `send` to rank `j` and receives the
/// block of rank `j` into `recv_blocks.block(j)` of `recv` (blocks of any size, zero
/// included; back to back as [`Layout::packed`] or where displacements put them), by the
/// pairwise exchange of [`run`]. The length of rank `r`'s send block `j` must be that of rank
/// `j`'s receive block `r`: a rank that gets a block of another length fails with a mismatch.
/// Out of place only (`send` and `recv` are distinct buffers); send blocks may overlap, the
/// receive blocks may not.
pub fn run_v(
    ctx: &mut CollCtx<'_>,
    send: &[u8],
    send_blocks: &Layout,
    recv: &mut [u8],
    recv_blocks: &Layout,
    allowed: &[bool],
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let bad = |m: String| Err(super::invalid("all_to_all_v", m));
    if send_blocks.len() != size || recv_blocks.len() != size {
        return bad(format!(
            "{} send and {} receive blocks for {size} ranks",
            send_blocks.len(),
            recv_blocks.len()
        ));
    }
    if let Some(m) = send_blocks.misfit(send.len(), false) {
        return bad(format!("send buffer: {m}"));
    }
    if let Some(m) = recv_blocks.misfit(recv.len(), true) {
        return bad(format!("receive buffer: {m}"));
    }
    let (mine, theirs) = (send_blocks.block(rank), recv_blocks.block(rank));
    if mine.len() != theirs.len() {
        return bad(format!(
            "this rank sends itself {} bytes but receives {}",
            mine.len(),
            theirs.len()
        ));
    }
    recv[theirs].copy_from_slice(&send[mine]);
    let steps = plan(rank, size);
    let tags: Vec<_> = (0..steps.len()).map(|k| tag(ctx, 0, 0, k)).collect();
    let largest = (0..size)
        .map(|j| send_blocks.block(j).len().max(recv_blocks.block(j).len()))
        .max()
        .unwrap_or(0);
    let at_once = Algorithm::auto(allowed, largest) == Algorithm::Linear;
    exchange_blocks(
        &mut *ctx.transport,
        ctx.deadline,
        &steps,
        &tags,
        send,
        send_blocks,
        recv,
        recv_blocks,
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
