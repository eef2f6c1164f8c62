//! Every collective other than allreduce: one module per collective, each with its schedules,
//! a pure `plan` that says who sends what to whom, and the schedules' costs.
//!
//! | module | schedules | each rank sends (n = bytes of the whole result) |
//! |---|---|---|
//! | [`broadcast`] | binomial tree, pipelined chain | tree: up to ⌈log₂p⌉·n (root); chain: n |
//! | [`reduce`] | binomial tree, pipelined chain | n (one message to the parent) |
//! | [`allgather`] | ring, recursive doubling (p a power of two) | (p−1)/p·n |
//! | [`reduce_scatter`] | ring, recursive halving (p a power of two) | (p−1)/p·n |
//! | [`alltoall`] | pairwise exchange (its steps posted at once for blocks up to 16 KiB) | (p−1)/p·n |
//! | [`gather`] | linear (root receives from all at once) | n/p (root: none) |
//! | [`scatter`] | linear (root sends to all at once) | root (p−1)/p·n |
//! | [`scan`] | recursive doubling, pipelined chain (inclusive and exclusive) | doubling: up to ⌈log₂p⌉·n; chain: n |
//! | [`barrier`] | dissemination | ⌈log₂p⌉ empty messages |
//! | [`p2p`] | send / receive | the buffer |
//!
//! # Words
//! - **block**: the part of a `p`-rank buffer that belongs to one rank (allgather, gather,
//!   reduce-scatter, scatter, alltoall): `p` blocks of equal size, block `j` at `j·b`. The
//!   v-collectives' blocks have sizes of their own and lie where a [`layout::Layout`] says
//!   (back to back, or at MPI's displacements).
//! - **virtual rank**: a rank renumbered so that the root is 0, `v = (r − root) mod p`;
//!   rooted schedules are written in virtual ranks.
//! - **step**: one round of messages; the low bits of a message's tag.
//! - **segment**: a part of a message handled while the rest is still arriving (pipelined
//!   schedules forward or reduce segment by segment, see [`crate::allreduce::ring`]).
//!
//! # Tags
//! Inside a call's tag space ([`CollCtx::tag`]), these schedules use the 16 step bits as
//! `root mod 256 (bits 8..16) | schedule id (bits 6..8) | step mod 64 (bits 0..6)`
//! ([`tag`]). Messages between two ranks are matched in order, so the step only has to agree
//! between sender and receiver; the root and schedule bits make ranks that disagree on the root
//! (or, through different sizes, on the schedule) fail with a mismatch instead of exchanging
//! the wrong data. Every receiver also checks the length of what arrived.
//!
//! # Errors
//! Arguments are validated by the caller (the communicator); the schedules still check what
//! they rely on and return [`TransportError::InvalidArgument`] before sending anything.
//! [`TransportError::Mismatch`] means a peer's message had another tag or length than this
//! rank expected: the ranks called the collective with different counts, dtypes, ops, roots
//! or collectives. After any error other than an invalid argument the transport must be
//! aborted.

pub mod allgather;
pub mod alltoall;
pub mod barrier;
pub mod broadcast;
pub mod gather;
pub mod layout;
pub mod p2p;
pub mod reduce;
pub mod reduce_scatter;
pub mod scan;
pub mod scatter;

use std::ops::Range;
use std::time::Instant;

use chorus_transport::{Op, Request, Result, Tag, Transport, TransportError, Wait};

use crate::CollCtx;

/// The tag of `step` of schedule `schedule` (0..4) for a collective rooted at `root` (0 for
/// unrooted ones); see the module documentation for the layout.
pub fn tag(ctx: &CollCtx<'_>, root: usize, schedule: u8, step: usize) -> Tag {
    ctx.tag(step_bits(root, schedule, step))
}

/// Where each block of `counts` bytes starts when the blocks lie back to back, and (last
/// entry) where they end: `counts.len() + 1` offsets, or `None` when the sum overflows.
///
/// ```
/// use chorus_algorithms::collectives::offsets;
/// assert_eq!(offsets(&[3, 0, 2]), Some(vec![0, 3, 3, 5]));
/// assert_eq!(offsets(&[usize::MAX, 1]), None);
/// ```
pub fn offsets(counts: &[usize]) -> Option<Vec<usize>> {
    let mut out = Vec::with_capacity(counts.len() + 1);
    let mut at = 0usize;
    out.push(0);
    for &c in counts {
        at = at.checked_add(c)?;
        out.push(at);
    }
    Some(out)
}

/// The 16 step bits of [`tag`].
pub fn step_bits(root: usize, schedule: u8, step: usize) -> u64 {
    (((root & 0xff) as u64) << 8) | (((schedule & 0x3) as u64) << 6) | (step & 0x3f) as u64
}

/// The virtual rank of `rank` when `root` is the root: `(rank − root) mod size`.
pub fn virtual_rank(rank: usize, root: usize, size: usize) -> usize {
    (rank + size - root) % size
}

/// The real rank of virtual rank `v`: `(v + root) mod size`.
pub fn real_rank(v: usize, root: usize, size: usize) -> usize {
    (v + root) % size
}

/// Byte range of block `j` of blocks of `block` bytes.
pub fn block(j: usize, block: usize) -> Range<usize> {
    j * block..(j + 1) * block
}

/// Borrows two disjoint ranges of `buf`, the first shared and the second mutable.
///
/// # Panics
/// If the ranges overlap.
pub(crate) fn disjoint(
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
        let (lo, hi) = buf.split_at_mut(shared.end);
        (
            &lo[shared.clone()],
            &mut hi[mutable.start - shared.end..mutable.end - shared.end],
        )
    }
}

/// The shape of a rooted schedule on one rank: where its data comes from and goes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeNode {
    /// The rank this one receives from (broadcast) or sends to (reduce); `None` at the root.
    pub parent: Option<usize>,
    /// The ranks this one sends to (broadcast) or receives from (reduce), in broadcast
    /// order: largest subtree first.
    pub children: Vec<usize>,
}

/// A rooted spanning tree: a binomial tree (depth ⌈log₂p⌉) or a chain `root → root+1 → …`
/// (depth p−1, one child per rank, best for pipelining large messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tree {
    /// Binomial tree: virtual rank `v` receives from `v` with its lowest set bit cleared and
    /// sends to `v + 2^k` for every `2^k` below that bit (while `< p`).
    Binomial,
    /// Chain in virtual-rank order.
    Chain,
}

impl Tree {
    /// The node of `rank` in the tree over `size` ranks rooted at `root`.
    ///
    /// ```
    /// use chorus_algorithms::collectives::Tree;
    /// let n = Tree::Binomial.node(0, 8, 0);
    /// assert_eq!((n.parent, n.children), (None, vec![4, 2, 1]));
    /// assert_eq!(Tree::Binomial.node(6, 8, 0).parent, Some(4));
    /// assert_eq!(Tree::Chain.node(2, 4, 3).children, vec![]);
    /// assert_eq!(Tree::Chain.node(2, 4, 3).parent, Some(1));
    /// ```
    ///
    /// # Panics
    /// If `rank` or `root` is not below `size`.
    pub fn node(self, rank: usize, size: usize, root: usize) -> TreeNode {
        assert!(rank < size && root < size, "rank/root out of range");
        let v = virtual_rank(rank, root, size);
        let real = |v: usize| real_rank(v, root, size);
        match self {
            Tree::Binomial => {
                let low = if v == 0 {
                    size.next_power_of_two()
                } else {
                    1 << v.trailing_zeros()
                };
                let parent = (v != 0).then(|| real(v - low));
                let mut children = Vec::new();
                let mut mask = low >> 1;
                while mask > 0 {
                    if v + mask < size {
                        children.push(real(v + mask));
                    }
                    mask >>= 1;
                }
                TreeNode { parent, children }
            }
            Tree::Chain => TreeNode {
                parent: (v != 0).then(|| real(v - 1)),
                children: if v + 1 < size {
                    vec![real(v + 1)]
                } else {
                    Vec::new()
                },
            },
        }
    }

    /// The depth of the tree (messages on the longest root-to-leaf path).
    pub fn depth(self, size: usize) -> usize {
        match self {
            // The path to `v` has one message per set bit of `v`.
            Tree::Binomial => (0..size)
                .map(|v| v.count_ones() as usize)
                .max()
                .unwrap_or(0),
            Tree::Chain => size.saturating_sub(1),
        }
    }
}

/// ⌈log₂ n⌉ (0 for n ≤ 1).
pub fn ceil_log2(n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        (usize::BITS - (n - 1).leading_zeros()) as usize
    }
}

/// A [`TransportError::Mismatch`] for a message of `got` bytes where `want` were expected.
pub(crate) fn length_mismatch(peer: usize, tag: Tag, want: usize, got: usize) -> TransportError {
    TransportError::Mismatch {
        peer,
        expected_tag: tag,
        got_tag: tag,
        expected_len: want,
        got_len: got,
    }
}

/// Fails unless the complete receive `r` brought exactly `want` bytes.
pub(crate) fn check_len(r: &Request, want: usize) -> Result<()> {
    if r.bytes_done() != want {
        return Err(length_mismatch(r.peer(), r.tag(), want, r.bytes_done()));
    }
    Ok(())
}

/// An [`TransportError::InvalidArgument`] naming the collective.
pub(crate) fn invalid(what: &str, msg: String) -> TransportError {
    TransportError::InvalidArgument(format!("{what}: {msg}"))
}

/// Sends `out` to `to` while receiving exactly `inb.len()` bytes from `from` (one step of an
/// exchange); a message of another length is a mismatch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn exchange(
    t: &mut dyn Transport,
    deadline: Instant,
    to: usize,
    stag: Tag,
    out: &[u8],
    from: usize,
    rtag: Tag,
    inb: &mut [u8],
) -> Result<()> {
    let mut s = Request::send(to, stag, out.len());
    let mut r = Request::recv(from, rtag, inb.len());
    t.post(&mut s)?;
    t.post(&mut r)?;
    t.wait_all(
        &mut [Op::send(&mut s, out), Op::recv(&mut r, inb)],
        deadline,
    )?;
    check_len(&r, inb.len())
}

/// Sends every `(peer, tag, data)` of `sends` while receiving exactly `buf.len()` bytes for
/// every `(peer, tag, buf)` of `recvs`, all posted at once (receives first) and progressed
/// together; a message of another length is a mismatch.
pub(crate) fn exchange_all(
    t: &mut dyn Transport,
    deadline: Instant,
    sends: &[(usize, Tag, &[u8])],
    recvs: Vec<(usize, Tag, &mut [u8])>,
) -> Result<()> {
    let want: Vec<usize> = recvs.iter().map(|(_, _, b)| b.len()).collect();
    let mut rreq: Vec<Request> = recvs
        .iter()
        .map(|(peer, tag, b)| Request::recv(*peer, *tag, b.len()))
        .collect();
    let mut sreq: Vec<Request> = sends
        .iter()
        .map(|(peer, tag, d)| Request::send(*peer, *tag, d.len()))
        .collect();
    for r in rreq.iter_mut().chain(sreq.iter_mut()) {
        t.post(r)?;
    }
    let mut ops: Vec<Op<'_, '_>> = sreq
        .iter_mut()
        .zip(sends)
        .map(|(r, (_, _, d))| Op::send(r, d))
        .collect();
    ops.extend(
        rreq.iter_mut()
            .zip(recvs)
            .map(|(r, (_, _, b))| Op::recv(r, b)),
    );
    t.wait_all(&mut ops, deadline)?;
    drop(ops);
    rreq.iter().zip(want).try_for_each(|(r, n)| check_len(r, n))
}

/// Receives exactly `buf.len()` bytes from `from`.
pub(crate) fn recv_exact(
    t: &mut dyn Transport,
    deadline: Instant,
    from: usize,
    tag: Tag,
    buf: &mut [u8],
) -> Result<()> {
    let mut r = Request::recv(from, tag, buf.len());
    t.post(&mut r)?;
    t.wait_all(&mut [Op::recv(&mut r, buf)], deadline)?;
    check_len(&r, buf.len())
}

/// Sends `buf` to `to`.
pub(crate) fn send_all(
    t: &mut dyn Transport,
    deadline: Instant,
    to: usize,
    tag: Tag,
    buf: &[u8],
) -> Result<()> {
    let mut s = Request::send(to, tag, buf.len());
    t.post(&mut s)?;
    t.wait_all(&mut [Op::send(&mut s, buf)], deadline)
}

/// Receives `buf` from `parent` (unless this rank is the source, `parent` `None`) while
/// forwarding every byte that arrived to each of `children`: the message crosses a tree
/// cut-through, not store-and-forward.
///
/// The receive and the sends share `buf`, so they are progressed in separate calls: block on
/// the receive, then push what arrived to the children without blocking; once the receive is
/// complete, block on the sends.
pub(crate) fn relay(
    t: &mut dyn Transport,
    deadline: Instant,
    parent: Option<(usize, Tag)>,
    children: &[(usize, Tag)],
    buf: &mut [u8],
) -> Result<()> {
    let n = buf.len();
    let mut incoming = parent.map(|(peer, tag)| Request::recv(peer, tag, n));
    if let Some(r) = incoming.as_mut() {
        t.post(r)?;
    }
    let ready = if incoming.is_some() { 0 } else { n };
    let mut sends: Vec<Request> = children
        .iter()
        .map(|&(peer, tag)| Request::send_partial(peer, tag, n, ready))
        .collect();
    for s in sends.iter_mut() {
        t.post(s)?;
    }
    loop {
        let mut received_all = true;
        if let Some(r) = incoming.as_mut() {
            if !r.is_complete() {
                t.progress(&mut [Op::recv(r, buf)], Wait::Until(deadline))?;
            }
            if r.is_complete() {
                check_len(r, n)?;
            } else {
                received_all = false;
            }
            for s in sends.iter_mut() {
                s.set_available(r.bytes_done());
            }
        }
        let mut ops: Vec<Op<'_, '_>> = sends
            .iter_mut()
            .filter(|s| !s.is_complete() && (received_all || s.available() > s.bytes_done()))
            .map(|s| Op::send(s, buf))
            .collect();
        if received_all {
            if ops.is_empty() {
                return Ok(());
            }
            t.progress(&mut ops, Wait::Until(deadline))?;
        } else if !ops.is_empty() {
            t.progress(&mut ops, Wait::No)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank is reached exactly once from the root, parents and children agree, and the
    /// depth is as stated.
    fn check_tree(tree: Tree, size: usize, root: usize) {
        let nodes: Vec<TreeNode> = (0..size).map(|r| tree.node(r, size, root)).collect();
        assert_eq!(nodes[root].parent, None);
        let mut depth = vec![usize::MAX; size];
        depth[root] = 0;
        let mut frontier = vec![root];
        let mut seen = 1;
        while let Some(r) = frontier.pop() {
            for &c in &nodes[r].children {
                assert_eq!(nodes[c].parent, Some(r), "{tree:?} p={size} root={root}");
                assert_eq!(depth[c], usize::MAX, "rank {c} reached twice");
                depth[c] = depth[r] + 1;
                seen += 1;
                frontier.push(c);
            }
        }
        assert_eq!(seen, size, "{tree:?} p={size} root={root}: not spanning");
        assert_eq!(*depth.iter().max().unwrap(), tree.depth(size));
    }

    #[test]
    fn trees_span_every_group() {
        for size in 1..=33 {
            for root in [0, size / 2, size - 1] {
                check_tree(Tree::Binomial, size, root);
                check_tree(Tree::Chain, size, root);
            }
        }
    }

    #[test]
    fn tag_bits() {
        assert_eq!(step_bits(0, 0, 0), 0);
        assert_eq!(step_bits(3, 1, 5), (3 << 8) | (1 << 6) | 5);
        assert_eq!(step_bits(256 + 3, 1, 64 + 5), step_bits(3, 1, 5));
        assert!(step_bits(usize::MAX, 3, usize::MAX) < 1 << 16);
        assert_eq!(ceil_log2(1), 0);
        assert_eq!(ceil_log2(2), 1);
        assert_eq!(ceil_log2(5), 3);
        assert_eq!(ceil_log2(8), 3);
    }
}
