//! Gather: every rank contributes a block of `b` bytes; the root ends with all `p` blocks,
//! block `j` from rank `j` (`n = p·b`).
//!
//! # Schedule: linear
//! The root posts one receive per rank, each straight into its block of the output, and
//! progresses them together (the messages overlap on the wire); every other rank sends its
//! block. The root receives `(p−1)/p·n` bytes: about `α + (p−1)/p·nβ` when the latencies
//! overlap, `(p−1)α + (p−1)/p·nβ` at worst ([`cost`] states the latter).

use chorus_transport::{Op, Request, Result};

use super::layout::Layout;
use super::{block, check_len, send_all, tag};
use crate::cost::Link;
use crate::CollCtx;

/// The modelled time of a gather of `bytes` bytes in all (`p` blocks).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let p = ranks as f64;
    (p - 1.0) * link.alpha + (p - 1.0) / p * bytes as f64 * link.beta
}

/// The ranks `rank` receives from (in block order; empty except at the root) and the rank it
/// sends to (`None` at the root).
///
/// ```
/// use chorus_algorithms::collectives::gather::plan;
/// assert_eq!(plan(2, 4, 2), (vec![0, 1, 3], None));
/// assert_eq!(plan(0, 4, 2), (vec![], Some(2)));
/// ```
pub fn plan(rank: usize, size: usize, root: usize) -> (Vec<usize>, Option<usize>) {
    if rank == root {
        ((0..size).filter(|&j| j != root).collect(), None)
    } else {
        (Vec::new(), Some(root))
    }
}

/// Gathers every rank's `send` into `recv` on `root` (`p` blocks; `None` or ignored on the
/// other ranks).
pub fn run(ctx: &mut CollCtx<'_>, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    if root >= size {
        return Err(super::invalid(
            "gather",
            format!("root {root} is not a rank of a group of {size}"),
        ));
    }
    let b = send.len();
    let t = tag(ctx, root, 0, 0);
    let (sources, dest) = plan(rank, size, root);
    if let Some(to) = dest {
        return send_all(&mut *ctx.transport, ctx.deadline, to, t, send);
    }
    let recv = match recv {
        Some(r) if r.len() == size * b => r,
        other => {
            return Err(super::invalid(
                "gather",
                format!(
                    "the root's output has {} bytes, not {size} blocks of {b}",
                    other.map_or(0, |r| r.len())
                ),
            ))
        }
    };
    recv[block(rank, b)].copy_from_slice(send);
    let mut reqs: Vec<Request> = sources.iter().map(|&j| Request::recv(j, t, b)).collect();
    for r in reqs.iter_mut() {
        ctx.transport.post(r)?;
    }
    let mut ops: Vec<Op<'_, '_>> = if b == 0 {
        // Nothing to lend but empty buffers (the messages must still be empty).
        reqs.iter_mut().map(|r| Op::recv(r, &mut [])).collect()
    } else {
        recv.chunks_mut(b)
            .enumerate()
            .filter(|(j, _)| *j != rank)
            .zip(reqs.iter_mut())
            .map(|((_, chunk), r)| Op::recv(r, chunk))
            .collect()
    };
    ctx.transport.wait_all(&mut ops, ctx.deadline)?;
    drop(ops);
    reqs.iter().try_for_each(|r| check_len(r, b))
}

/// Gatherv (`MPI_Gatherv`): rank `j` sends its `send`, and the root's `recv` gets it at
/// `blocks.block(j)` (blocks of any size, zero included; back to back as [`Layout::packed`]
/// or where displacements put them, not overlapping). `recv` and `blocks` are only needed on
/// the root (`None` elsewhere). The linear schedule of [`run`]; the root checks every block's
/// length (a rank that sends another is a mismatch).
pub fn run_v(
    ctx: &mut CollCtx<'_>,
    send: &[u8],
    recv: Option<(&mut [u8], &Layout)>,
    root: usize,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let bad = |m: String| Err(super::invalid("gather_v", m));
    if root >= size {
        return bad(format!("root {root} is not a rank of a group of {size}"));
    }
    let t = tag(ctx, root, 1, 0);
    if rank != root {
        return send_all(&mut *ctx.transport, ctx.deadline, root, t, send);
    }
    let Some((recv, layout)) = recv else {
        return bad("the root needs its output and the counts".into());
    };
    if layout.len() != size {
        return bad(format!("{} blocks for {size} ranks", layout.len()));
    }
    if let Some(m) = layout.misfit(recv.len(), true) {
        return bad(format!("the root's output: {m}"));
    }
    if layout.block(root).len() != send.len() {
        return bad(format!(
            "the root's input has {} bytes where its block has {}",
            send.len(),
            layout.block(root).len()
        ));
    }
    let mut blocks = layout.pieces(recv);
    blocks[root].copy_from_slice(send);
    let recvs: Vec<_> = blocks
        .into_iter()
        .enumerate()
        .filter(|(j, _)| *j != root)
        .map(|(j, b)| (j, t, b))
        .collect();
    super::exchange_all(&mut *ctx.transport, ctx.deadline, &[], recvs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_receives_from_every_other_rank() {
        for size in 1..=9 {
            for root in 0..size {
                for rank in 0..size {
                    let (from, to) = plan(rank, size, root);
                    if rank == root {
                        assert_eq!(to, None);
                        assert_eq!(from.len(), size - 1);
                        assert!(!from.contains(&root));
                    } else {
                        assert_eq!((from.len(), to), (0, Some(root)));
                    }
                }
            }
        }
    }
}
