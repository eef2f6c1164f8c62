//! Allgather: every rank contributes a block of `b` bytes; every rank ends with all `p`
//! blocks, block `j` from rank `j` (`n = p·b` bytes).
//!
//! # Schedules
//! - [`Algorithm::Ring`]: `p−1` steps; at step `s` rank `r` sends block `r−s` to `r+1` and
//!   receives block `r−s−1` from `r−1` (mod p), straight into the output. Each rank sends
//!   `(p−1)·b = (p−1)/p·n` bytes: `(p−1)α + (p−1)/p·nβ`.
//! - [`Algorithm::RecursiveDoubling`] (p a power of two; otherwise the ring runs): `log₂p`
//!   steps; at step `k` rank `r` exchanges with `r xor 2^k` the `2^k` blocks it holds (blocks
//!   `⌊r/2^k⌋·2^k …`), so the data doubles each step: `log₂p·α + (p−1)/p·nβ`.
//!
//! Out of place the own block is first copied from the input; in place (`send` `None`) it is
//! already at block `r` of the output.
//!
//! Allgatherv ([`run_v`]) runs the same steps on blocks of their own sizes wherever a
//! [`Layout`] puts them. A step's blocks always travel as one message; where they do not lie
//! back to back in this rank's output (recursive doubling's groups under displacements), they
//! are gathered into a staging buffer to be sent, and received into one to be spread.

use std::ops::Range;

use chorus_transport::Result;

use super::broadcast::cheapest;
use super::layout::Layout;
use super::{block, disjoint, exchange, tag};
use crate::cost::Link;
use crate::CollCtx;

/// An allgather schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring; `p−1` steps.
    Ring,
    /// Recursive doubling; `log₂p` steps (p a power of two).
    RecursiveDoubling,
}

impl Algorithm {
    /// Every schedule.
    pub const ALL: [Algorithm; 2] = [Algorithm::Ring, Algorithm::RecursiveDoubling];

    /// The name used in logs and `CHORUS_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive_doubling",
        }
    }

    /// The schedule that actually runs on `ranks` ranks (recursive doubling needs a power of
    /// two and falls back to the ring).
    pub fn effective(self, ranks: usize) -> Algorithm {
        match self {
            Algorithm::RecursiveDoubling if !ranks.is_power_of_two() => Algorithm::Ring,
            a => a,
        }
    }

    const fn id(self) -> u8 {
        match self {
            Algorithm::Ring => 0,
            Algorithm::RecursiveDoubling => 1,
        }
    }

    /// The modelled time of an allgather whose result is `bytes` bytes over `ranks` ranks.
    ///
    /// ```
    /// use chorus_algorithms::collectives::allgather::Algorithm;
    /// use chorus_algorithms::cost::Link;
    /// let l = Link::TCP_LOOPBACK;
    /// assert!(Algorithm::RecursiveDoubling.cost(64, 8, &l) < Algorithm::Ring.cost(64, 8, &l));
    /// // Not a power of two: recursive doubling is the ring.
    /// assert_eq!(Algorithm::RecursiveDoubling.cost(64, 6, &l), Algorithm::Ring.cost(64, 6, &l));
    /// ```
    pub fn cost(self, bytes: usize, ranks: usize, link: &Link) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let p = ranks as f64;
        let volume = (p - 1.0) / p * bytes as f64 * link.beta;
        match self.effective(ranks) {
            Algorithm::Ring => (p - 1.0) * link.alpha + volume,
            Algorithm::RecursiveDoubling => super::ceil_log2(ranks) as f64 * link.alpha + volume,
        }
    }

    /// The cheapest schedule for a result of `bytes` bytes over `ranks` ranks.
    pub fn select(bytes: usize, ranks: usize, link: &Link) -> Algorithm {
        cheapest(&Algorithm::ALL, |a| a.cost(bytes, ranks, link))
    }
}

/// One step: exchange with a peer (the same peer both ways for recursive doubling).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Where this rank's message goes.
    pub to: usize,
    /// Where the incoming message comes from.
    pub from: usize,
    /// The blocks sent.
    pub send_blocks: Range<usize>,
    /// The blocks received.
    pub recv_blocks: Range<usize>,
}

/// The steps of `rank` in a group of `size` (the schedule actually run, see
/// [`Algorithm::effective`]).
///
/// ```
/// use chorus_algorithms::collectives::allgather::{plan, Algorithm};
/// let s = plan(Algorithm::RecursiveDoubling, 2, 4);
/// assert_eq!((s[0].to, s[0].send_blocks.clone(), s[0].recv_blocks.clone()), (3, 2..3, 3..4));
/// assert_eq!((s[1].to, s[1].send_blocks.clone(), s[1].recv_blocks.clone()), (0, 2..4, 0..2));
/// ```
pub fn plan(alg: Algorithm, rank: usize, size: usize) -> Vec<Step> {
    match alg.effective(size) {
        Algorithm::Ring => {
            let r = rank + size;
            (0..size - 1)
                .map(|s| {
                    let sb = (r - s) % size;
                    let rb = (r - s - 1) % size;
                    Step {
                        to: (rank + 1) % size,
                        from: (rank + size - 1) % size,
                        send_blocks: sb..sb + 1,
                        recv_blocks: rb..rb + 1,
                    }
                })
                .collect()
        }
        Algorithm::RecursiveDoubling => {
            let mut steps = Vec::new();
            let mut width = 1;
            while width < size {
                let partner = rank ^ width;
                let mine = rank / width * width;
                let theirs = partner / width * width;
                steps.push(Step {
                    to: partner,
                    from: partner,
                    send_blocks: mine..mine + width,
                    recv_blocks: theirs..theirs + width,
                });
                width *= 2;
            }
            steps
        }
    }
}

/// Gathers every rank's block into `recv` (`p` blocks). `send` is this rank's block, or
/// `None` when it is already at block `rank` of `recv`.
pub fn run(
    alg: Algorithm,
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    if recv.len() % size != 0 || send.is_some_and(|s| s.len() * size != recv.len()) {
        return Err(super::invalid(
            "all_gather",
            format!(
                "output of {} bytes is not {size} blocks of the {}-byte input",
                recv.len(),
                send.map_or(recv.len() / size, <[u8]>::len)
            ),
        ));
    }
    let b = recv.len() / size;
    if let Some(s) = send {
        recv[block(rank, b)].copy_from_slice(s);
    }
    let layout = Layout::packed(&vec![b; size]).expect("the blocks fit in the buffer");
    run_v(alg, ctx, None, recv, &layout)
}

/// Allgatherv: rank `j` contributes a block of any size (zero included), and every rank
/// ends with rank `j`'s block at `blocks.block(j)` of `recv` (back to back as
/// [`Layout::packed`] or where displacements put them, not overlapping). `send` is this
/// rank's block, or `None` when it is already in place in `recv`. The schedules are those of
/// [`run`], on blocks of their own sizes; a step's blocks travel as one message whatever the
/// layout (blocks that are not back to back in this rank's buffer are gathered into, or
/// spread from, a staging buffer), so ranks may lay their blocks out differently. Every rank
/// must pass the same block sizes; a rank that gets a block of another length fails with a
/// mismatch.
pub fn run_v(
    alg: Algorithm,
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    blocks: &Layout,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let bad = |m: String| Err(super::invalid("all_gather_v", m));
    if blocks.len() != size {
        return bad(format!("{} blocks for {size} ranks", blocks.len()));
    }
    if let Some(m) = blocks.misfit(recv.len(), true) {
        return bad(format!("output: {m}"));
    }
    let own = blocks.block(rank);
    if let Some(s) = send {
        if s.len() != own.len() {
            return bad(format!(
                "input of {} bytes where this rank's block has {}",
                s.len(),
                own.len()
            ));
        }
        recv[own].copy_from_slice(s);
    }
    let alg = alg.effective(size);
    for (k, step) in plan(alg, rank, size).iter().enumerate() {
        let t = tag(ctx, 0, alg.id(), k);
        let spans = (
            blocks.span(step.send_blocks.clone()),
            blocks.span(step.recv_blocks.clone()),
        );
        if let (Some(out), Some(inb)) = spans {
            let (out, inb) = disjoint(recv, out, inb);
            exchange(
                &mut *ctx.transport,
                ctx.deadline,
                step.to,
                t,
                out,
                step.from,
                t,
                inb,
            )?;
            continue;
        }
        // Blocks apart in this rank's buffer: one message each way all the same.
        let out: Vec<u8> = step
            .send_blocks
            .clone()
            .flat_map(|j| recv[blocks.block(j)].iter().copied())
            .collect();
        let mut inb = vec![
            0u8;
            step.recv_blocks
                .clone()
                .map(|j| blocks.block(j).len())
                .sum()
        ];
        exchange(
            &mut *ctx.transport,
            ctx.deadline,
            step.to,
            t,
            &out,
            step.from,
            t,
            &mut inb,
        )?;
        let mut at = 0;
        for j in step.recv_blocks.clone() {
            let b = blocks.block(j);
            recv[b.clone()].copy_from_slice(&inb[at..at + b.len()]);
            at += b.len();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the plans: what a rank sends it holds, what it receives is what the sender
    /// sends, and every rank ends with every block.
    fn check(alg: Algorithm, size: usize) {
        let plans: Vec<Vec<Step>> = (0..size).map(|r| plan(alg, r, size)).collect();
        let mut have: Vec<Vec<bool>> = (0..size)
            .map(|r| (0..size).map(|j| j == r).collect())
            .collect();
        let steps = plans[0].len();
        for k in 0..steps {
            let mut next = have.clone();
            for (r, p) in plans.iter().enumerate() {
                let s = &p[k];
                assert!(
                    s.send_blocks.clone().all(|j| have[r][j]),
                    "rank {r} step {k}"
                );
                let sender = &plans[s.from][k];
                assert_eq!(sender.to, r);
                assert_eq!(sender.send_blocks, s.recv_blocks);
                for j in s.recv_blocks.clone() {
                    assert!(!have[r][j], "rank {r} receives block {j} twice");
                    next[r][j] = true;
                }
            }
            have = next;
        }
        assert!(
            have.iter().all(|h| h.iter().all(|&x| x)),
            "{alg:?} p={size}"
        );
    }

    #[test]
    fn every_rank_ends_with_every_block() {
        for size in 1..=17 {
            check(Algorithm::Ring, size);
            check(Algorithm::RecursiveDoubling, size);
            assert_eq!(plan(Algorithm::Ring, 0, size).len(), size - 1);
        }
        assert_eq!(plan(Algorithm::RecursiveDoubling, 5, 16).len(), 4);
    }

    #[test]
    fn selection() {
        let l = Link::TCP_LOOPBACK;
        assert_eq!(Algorithm::select(8, 8, &l), Algorithm::RecursiveDoubling);
        assert_eq!(Algorithm::select(8, 7, &l), Algorithm::Ring);
    }
}
