//! Reduce: the root ends with the element-wise reduction of every rank's `n` bytes.
//!
//! # Schedules
//! The trees of [`super::broadcast`], walked upwards:
//! - [`Algorithm::Tree`], binomial tree: each rank combines its children's partial results
//!   (nearest first: those subtrees finish first) with its input and sends one message to its parent. The root
//!   receives ⌈log₂p⌉ messages: `⌈log₂p⌉·(α + nβ)`. Best for small messages.
//! - [`Algorithm::Ring`], pipelined chain `root ← root+1 ← …`: each rank reduces the partial
//!   result of its successor into its own input **segment by segment** as it arrives, and
//!   forwards each reduced segment at once: every rank sends `n` bytes once,
//!   `(p−1)α + nβ` plus the pipeline's fill. Best for large messages.
//!
//! # Steps (rank `r`)
//! 1. A leaf sends its input to its parent; done.
//! 2. Otherwise, for every child but the last: receive its partial result into scratch and
//!    reduce it into the accumulator (the root's output, or scratch on other ranks, first
//!    filled with the input).
//! 3. The last child: reduce each arrived segment into the accumulator and make it available
//!    to the send to the parent (none at the root).
//! 4. `Avg`: the root divides the result by `p`, once.
//!
//! Only the root writes its output buffer: on other ranks `recv` is left as it was (in place
//! it is the input).

use chorus_transport::{Op, Request, Result, Tag, Transport, Wait};

use super::broadcast::{cheapest, PIPELINE_SEGMENT};
use super::{check_len, recv_exact, send_all, tag, Tree, TreeNode};
use crate::allreduce::ring::SEGMENT_BYTES;
use crate::cost::Link;
use crate::reduce::{finish_avg_bytes, reduce_bytes};
use crate::{CollCtx, DType, ReduceOp};

/// A reduce schedule.
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

    const fn id(self) -> u8 {
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

    /// The modelled time of reducing `bytes` bytes over `ranks` ranks (the broadcast's:
    /// the same messages in the other direction).
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

/// Who `rank` receives partial results from (in the order it combines them: nearest child
/// first, whose subtree finishes first) and sends to.
///
/// ```
/// use chorus_algorithms::collectives::reduce::{plan, Algorithm};
/// let n = plan(Algorithm::Tree, 0, 8, 0);
/// assert_eq!(n.children, vec![1, 2, 4]);
/// assert_eq!(plan(Algorithm::Tree, 5, 8, 0).parent, Some(4));
/// ```
pub fn plan(alg: Algorithm, rank: usize, size: usize, root: usize) -> TreeNode {
    let mut node = alg.tree().node(rank, size, root);
    node.children.reverse();
    node
}

/// Reduces every rank's input into `recv` on `root`. The input is `send`, or `recv` itself
/// when `send` is `None`. On the root `send` and `recv` have the same length; on other ranks
/// `recv` is only read (in place) or ignored.
#[allow(clippy::too_many_arguments)]
pub fn run(
    alg: Algorithm,
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    if root >= size {
        return Err(super::invalid(
            "reduce",
            format!("root {root} is not a rank of a group of {size}"),
        ));
    }
    let n = send.map_or(recv.len(), <[u8]>::len);
    if n % dtype.size() != 0 || (rank == root && recv.len() != n) {
        return Err(super::invalid(
            "reduce",
            format!(
                "input of {n} bytes, output of {} bytes for {dtype} elements",
                recv.len()
            ),
        ));
    }
    let node = plan(alg, rank, size, root);
    let t = tag(ctx, root, alg.id(), 0);
    let children: Vec<(usize, Tag)> = node.children.iter().map(|&c| (c, t)).collect();
    let parent = node.parent.map(|p| (p, t));
    let deadline = ctx.deadline;
    if rank == root {
        let (transport, incoming) = ctx.transport_and_scratch(n)?;
        if children.is_empty() {
            if let Some(s) = send {
                recv.copy_from_slice(s);
            }
        } else {
            let combine = Combine {
                t: transport,
                deadline,
                dtype,
                op,
            };
            combine.run(&children, None, send, recv, incoming)?;
        }
        if op == ReduceOp::Avg {
            finish_avg_bytes(dtype, recv, size);
        }
        return Ok(());
    }
    let input: &[u8] = send.unwrap_or(recv);
    let (to, stag) = parent.expect("a rank other than the root has a parent");
    if children.is_empty() {
        return send_all(&mut *ctx.transport, deadline, to, stag, input);
    }
    let (transport, scratch) = ctx.transport_and_scratch(2 * n)?;
    let (acc, incoming) = scratch.split_at_mut(n);
    let combine = Combine {
        t: transport,
        deadline,
        dtype,
        op,
    };
    combine.run(&children, parent, Some(input), acc, incoming)
}

/// Combines the children's partial results into an accumulator, forwarding the last one's
/// segments as they are reduced.
struct Combine<'a, 't> {
    t: &'a mut (dyn Transport + 't),
    deadline: std::time::Instant,
    dtype: DType,
    op: ReduceOp,
}

impl Combine<'_, '_> {
    /// `acc` ends with `input ⊕ children` (`input` `None`: `acc` already holds the input) and
    /// is sent to `parent` as it becomes final. `children` is not empty.
    fn run(
        self,
        children: &[(usize, Tag)],
        parent: Option<(usize, Tag)>,
        mut input: Option<&[u8]>,
        acc: &mut [u8],
        incoming: &mut [u8],
    ) -> Result<()> {
        let n = acc.len();
        let elem = self.dtype.size();
        let (&(last, last_tag), first) = children.split_last().expect("children");
        // Every child but the last, whole messages.
        for &(c, ctag) in first {
            recv_exact(&mut *self.t, self.deadline, c, ctag, incoming)?;
            if let Some(i) = input.take() {
                acc.copy_from_slice(i);
            }
            reduce_bytes(self.dtype, self.op, acc, incoming);
        }
        // The last child, segment by segment, each forwarded once reduced.
        let mut r = Request::recv(last, last_tag, n);
        self.t.post(&mut r)?;
        let mut s = parent.map(|(p, ptag)| Request::send_partial(p, ptag, n, 0));
        if let Some(s) = s.as_mut() {
            self.t.post(s)?;
        }
        let mut reduced = 0;
        loop {
            let complete = r.is_complete();
            if complete {
                check_len(&r, n)?;
            }
            let arrived = r.bytes_done() / elem * elem;
            if arrived > reduced && (complete || arrived - reduced >= SEGMENT_BYTES) {
                let seg = reduced..arrived;
                if let Some(i) = input {
                    acc[seg.clone()].copy_from_slice(&i[seg.clone()]);
                }
                reduce_bytes(self.dtype, self.op, &mut acc[seg.clone()], &incoming[seg]);
                reduced = arrived;
                if let Some(s) = s.as_mut() {
                    s.set_available(reduced);
                }
            }
            let sent = s.as_ref().map_or(true, Request::is_complete);
            if complete && sent {
                return Ok(());
            }
            let mut ops = Vec::with_capacity(2);
            if !complete {
                ops.push(Op::recv(&mut r, &mut *incoming));
            }
            if let Some(s) = s.as_mut() {
                // Once the receive is complete everything is reduced (also when n = 0).
                if !s.is_complete() && (complete || s.available() > s.bytes_done()) {
                    ops.push(Op::send(s, &*acc));
                }
            }
            self.t.progress(&mut ops, Wait::Until(self.deadline))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the plans on sets of contributions: every rank's message holds its subtree,
    /// and the root ends with everyone, each rank counted once.
    #[test]
    fn plans_combine_every_rank_once() {
        for alg in Algorithm::ALL {
            for size in 1..=20usize {
                for root in [0, size / 3, size - 1] {
                    let nodes: Vec<TreeNode> =
                        (0..size).map(|r| plan(alg, r, size, root)).collect();
                    fn subtree(nodes: &[TreeNode], r: usize) -> u64 {
                        nodes[r].children.iter().fold(1 << r, |acc, &c| {
                            let s = subtree(nodes, c);
                            assert_eq!(acc & s, 0, "counted twice");
                            acc | s
                        })
                    }
                    assert_eq!(subtree(&nodes, root), (1u64 << size) - 1);
                    // Nearest child first (the binomial subtrees that finish first).
                    if alg == Algorithm::Tree {
                        for (r, n) in nodes.iter().enumerate() {
                            let dist: Vec<usize> =
                                n.children.iter().map(|&c| (c + size - r) % size).collect();
                            assert!(dist.windows(2).all(|w| w[0] < w[1]), "{dist:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn selection() {
        let l = Link::GIGABIT_ETHERNET;
        assert_eq!(Algorithm::select(8, 4, &l), Algorithm::Tree);
        assert_eq!(Algorithm::select(64 << 20, 4, &l), Algorithm::Ring);
    }
}
