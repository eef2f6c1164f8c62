//! Point-to-point: one rank sends a buffer, another receives it.
//!
//! One message, `α + nβ`. Messages between two ranks are matched in the order they were
//! posted, together with the collectives' messages: a receive takes the next message its
//! peer sent to this rank, whatever it is. The receiver checks the tag (which carries the
//! dtype) and that exactly `buf.len()` bytes arrived; anything else is a
//! [`chorus_transport::TransportError::Mismatch`].

use chorus_transport::Result;

use super::{recv_exact, send_all};
use crate::cost::Link;
use crate::CollCtx;

/// The modelled time of one message of `bytes` bytes.
pub fn cost(bytes: usize, link: &Link) -> f64 {
    link.alpha + bytes as f64 * link.beta
}

fn check_peer(what: &str, peer: usize, ctx: &CollCtx<'_>) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    if peer >= size || peer == rank {
        return Err(super::invalid(
            what,
            format!("peer {peer} is not another rank of a group of {size} (this is rank {rank})"),
        ));
    }
    Ok(())
}

/// Sends `buf` to `peer` with tag `ctx.tag(0)`.
pub fn send(ctx: &mut CollCtx<'_>, buf: &[u8], peer: usize) -> Result<()> {
    check_peer("send", peer, ctx)?;
    let t = ctx.tag(0);
    send_all(&mut *ctx.transport, ctx.deadline, peer, t, buf)
}

/// Receives exactly `buf.len()` bytes from `peer` with tag `ctx.tag(0)`.
pub fn recv(ctx: &mut CollCtx<'_>, buf: &mut [u8], peer: usize) -> Result<()> {
    check_peer("recv", peer, ctx)?;
    let t = ctx.tag(0);
    recv_exact(&mut *ctx.transport, ctx.deadline, peer, t, buf)
}

/// Sends `send` to `to` while receiving exactly `recv.len()` bytes from `from` (the two may
/// be the same rank); both directions progress together, so a ring of these never deadlocks.
pub fn send_recv(
    ctx: &mut CollCtx<'_>,
    send: &[u8],
    to: usize,
    recv: &mut [u8],
    from: usize,
) -> Result<()> {
    check_peer("send_recv", to, ctx)?;
    check_peer("send_recv", from, ctx)?;
    let t = ctx.tag(0);
    super::exchange(
        &mut *ctx.transport,
        ctx.deadline,
        to,
        t,
        send,
        from,
        t,
        recv,
    )
}
