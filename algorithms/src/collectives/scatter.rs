//! Scatter: the root holds `p` blocks of `b` bytes (`n = p·b`); rank `j` ends with block `j`.
//!
//! # Schedule: linear
//! The root copies its own block and posts one send per rank, each straight from its block,
//! progressed together; every other rank receives exactly `b` bytes. The root sends
//! `(p−1)/p·n` bytes: [`cost`] `(p−1)α + (p−1)/p·nβ` (less when the latencies overlap).

use chorus_transport::{Op, Request, Result};

use super::layout::Layout;
use super::{block, recv_exact, tag};
use crate::cost::Link;
use crate::CollCtx;

/// The modelled time of a scatter of `bytes` bytes in all (`p` blocks).
pub fn cost(bytes: usize, ranks: usize, link: &Link) -> f64 {
    super::gather::cost(bytes, ranks, link)
}

/// The ranks `rank` sends to (block order; empty except at the root) and the rank it
/// receives from (`None` at the root): the gather's plan, reversed.
///
/// ```
/// use chorus_algorithms::collectives::scatter::plan;
/// assert_eq!(plan(1, 3, 1), (vec![0, 2], None));
/// assert_eq!(plan(0, 3, 1), (vec![], Some(1)));
/// ```
pub fn plan(rank: usize, size: usize, root: usize) -> (Vec<usize>, Option<usize>) {
    super::gather::plan(rank, size, root)
}

/// Scatters the root's `send` (`p` blocks; `None` or ignored on the other ranks) so that
/// every rank's `recv` gets its block.
pub fn run(ctx: &mut CollCtx<'_>, send: Option<&[u8]>, recv: &mut [u8], root: usize) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    if root >= size {
        return Err(super::invalid(
            "scatter",
            format!("root {root} is not a rank of a group of {size}"),
        ));
    }
    let b = recv.len();
    let t = tag(ctx, root, 0, 0);
    let (dests, source) = plan(rank, size, root);
    if let Some(from) = source {
        return recv_exact(&mut *ctx.transport, ctx.deadline, from, t, recv);
    }
    let send = match send {
        Some(s) if s.len() == size * b => s,
        other => {
            return Err(super::invalid(
                "scatter",
                format!(
                    "the root's input has {} bytes, not {size} blocks of {b}",
                    other.map_or(0, <[u8]>::len)
                ),
            ))
        }
    };
    recv.copy_from_slice(&send[block(rank, b)]);
    let mut reqs: Vec<Request> = dests.iter().map(|&j| Request::send(j, t, b)).collect();
    for r in reqs.iter_mut() {
        ctx.transport.post(r)?;
    }
    let mut ops: Vec<Op<'_, '_>> = reqs
        .iter_mut()
        .zip(&dests)
        .map(|(r, &j)| Op::send(r, &send[block(j, b)]))
        .collect();
    ctx.transport.wait_all(&mut ops, ctx.deadline)
}

/// Scatterv (`MPI_Scatterv`): the root's `send` holds rank `j`'s block at
/// `blocks.block(j)` (blocks of any size, zero included; back to back as
/// [`Layout::packed`] or where displacements put them, overlapping or not), and rank `j`'s
/// `recv` gets its block (exactly `recv.len()` bytes: a block of another length is a
/// mismatch). `send` and `blocks` are only needed on the root (`None` elsewhere). The linear
/// schedule of [`run`].
pub fn run_v(
    ctx: &mut CollCtx<'_>,
    send: Option<(&[u8], &Layout)>,
    recv: &mut [u8],
    root: usize,
) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let bad = |m: String| Err(super::invalid("scatter_v", m));
    if root >= size {
        return bad(format!("root {root} is not a rank of a group of {size}"));
    }
    let t = tag(ctx, root, 1, 0);
    if rank != root {
        return recv_exact(&mut *ctx.transport, ctx.deadline, root, t, recv);
    }
    let Some((send, layout)) = send else {
        return bad("the root needs its input and the counts".into());
    };
    if layout.len() != size {
        return bad(format!("{} blocks for {size} ranks", layout.len()));
    }
    if let Some(m) = layout.misfit(send.len(), false) {
        return bad(format!("the root's input: {m}"));
    }
    if layout.block(root).len() != recv.len() {
        return bad(format!(
            "the root's output has {} bytes where its block has {}",
            recv.len(),
            layout.block(root).len()
        ));
    }
    recv.copy_from_slice(&send[layout.block(root)]);
    let sends: Vec<_> = (0..size)
        .filter(|&j| j != root)
        .map(|j| (j, t, &send[layout.block(j)]))
        .collect();
    super::exchange_all(&mut *ctx.transport, ctx.deadline, &sends, Vec::new())
}
