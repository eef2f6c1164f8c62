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

/// What one transfer of a [`batch`] moves.
#[derive(Debug)]
pub enum Transfer<'a> {
    /// Send these bytes.
    Send(&'a [u8]),
    /// Receive exactly this many bytes into the buffer.
    Recv(&'a mut [u8]),
}

/// One send or receive of a [`batch`]: its peer (this rank itself allowed), its full tag
/// (which the receiver checks) and its buffer.
#[derive(Debug)]
pub struct Item<'a> {
    /// The rank sent to or received from.
    pub peer: usize,
    /// The message's tag, whole (not a step under [`CollCtx::tag`]).
    pub tag: chorus_transport::Tag,
    /// The buffer and the direction.
    pub transfer: Transfer<'a>,
}

/// What [`check_batch`] looks at in one transfer: no buffer, so that a caller can check a
/// batch before it holds the buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The rank sent to or received from.
    pub peer: usize,
    /// The message's tag, whole.
    pub tag: chorus_transport::Tag,
    /// Its length in bytes.
    pub len: usize,
    /// A send (else a receive).
    pub send: bool,
}

impl Item<'_> {
    /// The transfer's [`Shape`].
    pub fn shape(&self) -> Shape {
        let (len, send) = match &self.transfer {
            Transfer::Send(b) => (b.len(), true),
            Transfer::Recv(b) => (b.len(), false),
        };
        Shape {
            peer: self.peer,
            tag: self.tag,
            len,
            send,
        }
    }
}

/// Checks a [`batch`] without moving anything: every peer is a rank of the group, every
/// message fits one frame, and the sends to this rank pair in order with the receives from
/// it, each pair of one tag and length. Returns the message for an invalid argument.
pub fn check_batch(rank: usize, size: usize, shapes: &[Shape]) -> std::result::Result<(), String> {
    let mut to_self = Vec::new();
    let mut from_self = Vec::new();
    for (i, it) in shapes.iter().enumerate() {
        if it.peer >= size {
            return Err(format!(
                "transfer {i}: peer {} is not a rank of a group of {size}",
                it.peer
            ));
        }
        let len = it.len;
        if len as u64 > chorus_transport::frame::MAX_PAYLOAD {
            // Refused here, before anything is posted: a post refused after others were made
            // would leave the transport's message order out of step.
            return Err(format!(
                "transfer {i}: {len} bytes is more than one message carries (2^40 - 1 bytes)"
            ));
        }
        if it.peer == rank {
            let side = if it.send {
                &mut to_self
            } else {
                &mut from_self
            };
            side.push((i, it.tag, len));
        }
    }
    if to_self.len() != from_self.len() {
        return Err(format!(
            "{} sends to this rank ({rank}) and {} receives from it: each send to itself needs \
             its receive in the same batch",
            to_self.len(),
            from_self.len()
        ));
    }
    for ((si, stag, slen), (ri, rtag, rlen)) in to_self.into_iter().zip(from_self) {
        if stag != rtag || slen != rlen {
            return Err(format!(
                "transfer {si} sends {slen} bytes to this rank where transfer {ri} receives \
                 {rlen}{}",
                if stag != rtag {
                    " of another dtype"
                } else {
                    ""
                }
            ));
        }
    }
    Ok(())
}

/// Runs every send and receive of `items` at once: all posted together (receives first) and
/// progressed together until all complete, so no order of them can deadlock ranks that all
/// take part with batches (as `MPI_Isend`/`MPI_Irecv` then `MPI_Waitall`, or NCCL's grouped
/// send/recv). Per peer and direction, the messages are matched in the order of `items`. A
/// send to this rank is copied into the receive from it of the same rank in that order.
///
/// Checks [`check_batch`] first and returns [`TransportError::InvalidArgument`] before
/// anything moves. A received message of another tag or length is a mismatch.
pub fn batch(ctx: &mut CollCtx<'_>, items: Vec<Item<'_>>) -> Result<()> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let shapes: Vec<Shape> = items.iter().map(Item::shape).collect();
    check_batch(rank, size, &shapes).map_err(|m| super::invalid("p2p_batch", m))?;
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    let mut self_sends = Vec::new();
    let mut self_recvs = Vec::new();
    for it in items {
        match it.transfer {
            Transfer::Send(b) if it.peer == rank => self_sends.push(b),
            Transfer::Recv(b) if it.peer == rank => self_recvs.push(b),
            Transfer::Send(b) => sends.push((it.peer, it.tag, b)),
            Transfer::Recv(b) => recvs.push((it.peer, it.tag, b)),
        }
    }
    for (s, r) in self_sends.into_iter().zip(self_recvs) {
        r.copy_from_slice(s);
    }
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    super::exchange_all(&mut *ctx.transport, ctx.deadline, &sends, recvs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes(items: &[Item<'_>]) -> Vec<Shape> {
        items.iter().map(Item::shape).collect()
    }

    fn send(peer: usize, tag: u64, b: &[u8]) -> Item<'_> {
        Item {
            peer,
            tag,
            transfer: Transfer::Send(b),
        }
    }

    fn recv(peer: usize, tag: u64, b: &mut [u8]) -> Item<'_> {
        Item {
            peer,
            tag,
            transfer: Transfer::Recv(b),
        }
    }

    #[test]
    fn a_batch_is_checked_before_anything_moves() {
        let (a, b) = ([1u8; 4], [2u8; 8]);
        let (mut x, mut y) = ([0u8; 4], [0u8; 8]);
        assert_eq!(check_batch(1, 3, &[]), Ok(()));
        let ok = [
            send(0, 5, &a),
            send(2, 5, &b),
            send(1, 5, &a),
            send(1, 6, &b),
        ];
        // Two sends to itself without receives.
        let e = check_batch(1, 3, &shapes(&ok)).unwrap_err();
        assert!(e.contains("2 sends to this rank (1) and 0 receives"), "{e}");
        let mut items = vec![send(1, 5, &a), recv(1, 5, &mut x), send(0, 7, &b)];
        assert_eq!(check_batch(1, 3, &shapes(&items)), Ok(()));
        items.push(recv(3, 5, &mut y));
        let e = check_batch(1, 3, &shapes(&items)).unwrap_err();
        assert!(e.contains("transfer 3: peer 3 is not a rank"), "{e}");
        // Paired in order: the first send to itself meets the first receive.
        let (mut x, mut y) = ([0u8; 4], [0u8; 8]);
        let crossed = [
            send(1, 5, &a),
            send(1, 5, &b),
            recv(1, 5, &mut y),
            recv(1, 5, &mut x),
        ];
        let e = check_batch(1, 3, &shapes(&crossed)).unwrap_err();
        assert!(
            e.contains("transfer 0 sends 4 bytes to this rank where transfer 2 receives 8"),
            "{e}"
        );
        let mut x = [0u8; 4];
        let other_dtype = [send(0, 5, &a), recv(0, 6, &mut x)];
        let e = check_batch(0, 1, &shapes(&other_dtype)).unwrap_err();
        assert!(e.ends_with("of another dtype"), "{e}");
    }
}
