//! Broadcast: the root's buffer of `n` bytes ends on every rank.
//!
//! # Schedules
//! - [`Algorithm::Tree`], binomial tree ([`Tree::Binomial`]): virtual rank `v` receives from
//!   its parent and sends to its children, largest subtree first. The root sends `n` bytes to
//!   each of its ⌈log₂p⌉ children, every other rank to fewer; the longest path has ⌈log₂p⌉
//!   messages: `⌈log₂p⌉·(α + nβ)`. Best for small messages.
//! - [`Algorithm::Ring`], pipelined chain ([`Tree::Chain`]): `root → root+1 → …`; each rank
//!   forwards every byte as soon as it arrived (one message per link, cut-through), so each
//!   rank sends `n` bytes once and the time is `(p−1)α + nβ` plus the pipeline's fill,
//!   `(p−2)` segments. Best for large messages.
//!
//! # Steps (rank `r`, both schedules)
//! 1. Post the receive from the parent (none at the root) and one send per child, with
//!    nothing available yet.
//! 2. As bytes arrive, make them available to every child's send ([`super::relay`]).
//! 3. Wait for the sends.

use chorus_transport::Result;

use super::{relay, tag, Tree, TreeNode};
use crate::cost::Link;
use crate::CollCtx;

/// Bytes of the pipeline's unit in the cost model (the size of a socket write that a chain
/// rank forwards before the next arrives).
pub const PIPELINE_SEGMENT: usize = 64 * 1024;

/// A broadcast schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Binomial tree; ⌈log₂p⌉ latencies.
    Tree,
    /// Pipelined chain; each rank sends the buffer once.
    Ring,
}

impl Algorithm {
    /// Every schedule.
    pub const ALL: [Algorithm; 2] = [Algorithm::Tree, Algorithm::Ring];

    /// The name used in logs and `CHORUS_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Tree => "tree",
            Algorithm::Ring => "ring",
        }
    }

    /// The schedule id in the tags.
    pub(crate) const fn id(self) -> u8 {
        match self {
            Algorithm::Tree => 0,
            Algorithm::Ring => 1,
        }
    }

    /// The spanning tree the schedule uses.
    pub const fn tree(self) -> Tree {
        match self {
            Algorithm::Tree => Tree::Binomial,
            Algorithm::Ring => Tree::Chain,
        }
    }

    /// The modelled time of broadcasting `bytes` bytes over `ranks` ranks.
    ///
    /// ```
    /// use chorus_algorithms::collectives::broadcast::Algorithm;
    /// use chorus_algorithms::cost::Link;
    /// let l = Link::TCP_LOOPBACK;
    /// assert!(Algorithm::Tree.cost(8, 8, &l) < Algorithm::Ring.cost(8, 8, &l));
    /// assert!(Algorithm::Ring.cost(64 << 20, 8, &l) < Algorithm::Tree.cost(64 << 20, 8, &l));
    /// ```
    pub fn cost(self, bytes: usize, ranks: usize, link: &Link) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let n = bytes as f64;
        match self {
            Algorithm::Tree => super::ceil_log2(ranks) as f64 * (link.alpha + n * link.beta),
            Algorithm::Ring => {
                let fill = (ranks - 2) as f64 * bytes.min(PIPELINE_SEGMENT) as f64;
                (ranks - 1) as f64 * link.alpha + (n + fill) * link.beta
            }
        }
    }

    /// The cheapest schedule for `bytes` bytes over `ranks` ranks.
    pub fn select(bytes: usize, ranks: usize, link: &Link) -> Algorithm {
        cheapest(&Algorithm::ALL, |a| a.cost(bytes, ranks, link))
    }
}

/// The entry of `all` with the lowest `cost` (the first on ties).
pub(crate) fn cheapest<A: Copy>(all: &[A], cost: impl Fn(A) -> f64) -> A {
    let mut best = all[0];
    for &a in &all[1..] {
        if cost(a) < cost(best) {
            best = a;
        }
    }
    best
}

/// Who `rank` receives from and sends to.
pub fn plan(alg: Algorithm, rank: usize, size: usize, root: usize) -> TreeNode {
    alg.tree().node(rank, size, root)
}

/// Broadcasts `buf` from `root` (every rank passes a buffer of the same length; the root's is
/// the input, the others' the output).
pub fn run(alg: Algorithm, ctx: &mut CollCtx<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    if root >= size {
        return Err(super::invalid(
            "broadcast",
            format!("root {root} is not a rank of a group of {size}"),
        ));
    }
    if size == 1 {
        return Ok(());
    }
    let node = plan(alg, rank, size, root);
    let t = tag(ctx, root, alg.id(), 0);
    let parent = node.parent.map(|p| (p, t));
    let children: Vec<_> = node.children.iter().map(|&c| (c, t)).collect();
    relay(&mut *ctx.transport, ctx.deadline, parent, &children, buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_switches_from_tree_to_ring() {
        let l = Link::TCP_LOOPBACK;
        assert_eq!(Algorithm::select(8, 8, &l), Algorithm::Tree);
        assert_eq!(Algorithm::select(256 << 20, 8, &l), Algorithm::Ring);
        // Two ranks: both are one message; the tie goes to the tree.
        assert_eq!(Algorithm::select(1 << 20, 2, &l), Algorithm::Tree);
        assert_eq!(Algorithm::Tree.cost(1 << 20, 1, &l), 0.0);
    }

    #[test]
    fn plans_are_the_trees() {
        let n = plan(Algorithm::Ring, 0, 4, 1);
        assert_eq!((n.parent, n.children), (Some(3), vec![]));
        let n = plan(Algorithm::Tree, 1, 4, 1);
        assert_eq!((n.parent, n.children), (None, vec![3, 2]));
    }
}
