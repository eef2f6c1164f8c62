//! Pieces shared by the recursive schedules ([`super::recursive_doubling`],
//! [`super::halving_doubling`]): folding a group whose size is not a power of two onto its
//! largest power-of-two subgroup, and the two combined steps they are written in
//! ("send while receiving" and "send while receiving and reducing").
//!
//! # Folding
//! Let `p'` be the largest power of two `≤ p` and `r = p − p'` the **extra** ranks. Among
//! ranks `0..2r`, each even rank hands its whole input to the odd rank after it and sits the
//! core schedule out; the odd rank **absorbs** it (reduces it into its own) and joins the
//! **core** of `p'` ranks as core rank `rank / 2`; ranks `≥ 2r` join as core rank `rank − r`.
//! When the core is done, each absorbing rank sends the final result back to its extra rank.
//! Folding costs two more messages of `n` bytes on the critical path (`2α + 2nβ`).

use std::time::Instant;

use chorus_transport::{Op, Request, Result, Tag, Transport, TransportError, Wait};

use crate::reduce::{finish_avg_bytes, reduce_bytes};
use crate::{DType, ReduceOp};

/// Bytes of newly arrived data worth a call to the reduce kernel before the whole message is
/// in (as the ring's segments).
pub const SEGMENT_BYTES: usize = 64 * 1024;

/// How one rank takes part in folding (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Runs the core schedule with its own input.
    Core,
    /// Sends its input to `partner` (the next rank) first, receives the result from it last.
    Extra {
        /// The absorbing rank.
        partner: usize,
    },
    /// Reduces `partner`'s (the previous rank's) input into its own first, sends it the
    /// result last.
    Absorb {
        /// The extra rank.
        partner: usize,
    },
}

/// A rank's place in a folded group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fold {
    /// What the rank does before and after the core schedule.
    pub role: Role,
    /// Its rank inside the core (`None` for an extra rank).
    pub core_rank: Option<usize>,
    /// `p'`, the largest power of two not above the group size.
    pub core_size: usize,
    /// `r = p − p'`.
    pub extra: usize,
}

impl Fold {
    /// The fold of `rank` in a group of `size`.
    ///
    /// ```
    /// use chorus_algorithms::allreduce::exchange::{Fold, Role};
    /// let f = Fold::new(0, 6); // p' = 4, r = 2: ranks 0 and 2 are extra
    /// assert_eq!(f.role, Role::Extra { partner: 1 });
    /// assert_eq!(Fold::new(3, 6).core_rank, Some(1));
    /// assert_eq!(Fold::new(5, 6).core_rank, Some(3));
    /// assert_eq!(Fold::new(5, 6).core_to_rank(1), 3);
    /// ```
    ///
    /// # Panics
    /// If `rank >= size`.
    pub fn new(rank: usize, size: usize) -> Fold {
        assert!(rank < size, "rank {rank} out of range for {size} ranks");
        let core_size = 1usize << size.ilog2();
        let extra = size - core_size;
        let (role, core_rank) = if rank >= 2 * extra {
            (Role::Core, Some(rank - extra))
        } else if rank % 2 == 0 {
            (Role::Extra { partner: rank + 1 }, None)
        } else {
            (Role::Absorb { partner: rank - 1 }, Some(rank / 2))
        };
        Fold {
            role,
            core_rank,
            core_size,
            extra,
        }
    }

    /// The group rank of core rank `core`.
    pub fn core_to_rank(&self, core: usize) -> usize {
        if core < self.extra {
            2 * core + 1
        } else {
            core + self.extra
        }
    }
}

/// The transport, deadline, reduction and scratch of one schedule run.
pub(crate) struct Exchanger<'a, 't> {
    pub t: &'a mut (dyn Transport + 't),
    pub deadline: Instant,
    pub dtype: DType,
    pub op: ReduceOp,
    /// At least as large as the largest message received.
    pub scratch: &'a mut [u8],
}

/// Fails unless a complete receive brought exactly `want` bytes.
fn check_len(r: &Request, want: usize) -> Result<()> {
    if r.bytes_done() != want {
        return Err(TransportError::Mismatch {
            peer: r.peer(),
            expected_tag: r.tag(),
            got_tag: r.tag(),
            expected_len: want,
            got_len: r.bytes_done(),
        });
    }
    Ok(())
}

/// See [`Exchanger::exchange`].
fn exchange(
    t: &mut dyn Transport,
    deadline: Instant,
    send: Option<(usize, Tag, &[u8])>,
    recv: Option<(usize, Tag, &mut [u8])>,
) -> Result<()> {
    let send = send.filter(|s| !s.2.is_empty());
    let recv = recv.filter(|r| !r.2.is_empty());
    let mut s = send.map(|(peer, tag, b)| (Request::send(peer, tag, b.len()), b));
    let mut r = recv.map(|(peer, tag, b)| (Request::recv(peer, tag, b.len()), b));
    if let Some((req, _)) = s.as_mut() {
        t.post(req)?;
    }
    if let Some((req, _)) = r.as_mut() {
        t.post(req)?;
    }
    let mut ops = Vec::with_capacity(2);
    if let Some((req, b)) = s.as_mut() {
        ops.push(Op::send(req, b));
    }
    if let Some((req, b)) = r.as_mut() {
        ops.push(Op::recv(req, b));
    }
    t.wait_all(&mut ops, deadline)?;
    drop(ops);
    if let Some((req, b)) = r.as_ref() {
        check_len(req, b.len())?;
    }
    Ok(())
}

impl Exchanger<'_, '_> {
    /// Sends `send` (peer, tag, bytes) while receiving exactly `recv.2.len()` bytes into
    /// `recv` (peer, tag, buffer); either may be absent. Zero-length messages are not sent:
    /// both sides' plans agree on which ones are empty.
    pub fn exchange(
        &mut self,
        send: Option<(usize, Tag, &[u8])>,
        recv: Option<(usize, Tag, &mut [u8])>,
    ) -> Result<()> {
        exchange(self.t, self.deadline, send, recv)
    }

    /// [`Exchanger::exchange`] receiving `len` bytes from `from` into the scratch buffer.
    pub fn exchange_to_scratch(
        &mut self,
        send: Option<(usize, Tag, &[u8])>,
        (from, tag): (usize, Tag),
        len: usize,
    ) -> Result<()> {
        let recv = Some((from, tag, &mut self.scratch[..len]));
        exchange(self.t, self.deadline, send, recv)
    }

    /// Sends `send` while receiving `dst.len()` bytes from `from` into scratch and reducing
    /// them into `dst` segment by segment as they arrive. Out of place, `fresh` is this rank's
    /// input for `dst`: each segment is copied from it just before being reduced. With
    /// `avg_ranks`, each reduced segment is then divided by that many ranks (the last
    /// reduction of an `Avg`). `dst` must not overlap `send`.
    pub fn send_recv_reduce(
        &mut self,
        send: Option<(usize, Tag, &[u8])>,
        (from, rtag): (usize, Tag),
        dst: &mut [u8],
        fresh: Option<&[u8]>,
        avg_ranks: Option<usize>,
    ) -> Result<()> {
        let want = dst.len();
        let send = send.filter(|s| !s.2.is_empty());
        let mut s = send.map(|(peer, tag, b)| (Request::send(peer, tag, b.len()), b));
        if let Some((req, _)) = s.as_mut() {
            self.t.post(req)?;
        }
        let mut incoming = Request::recv(from, rtag, want);
        if want > 0 {
            self.t.post(&mut incoming)?;
        }
        let elem = self.dtype.size();
        let mut reduced = 0;
        loop {
            let complete = want == 0 || incoming.is_complete();
            if complete && want > 0 {
                check_len(&incoming, want)?;
            }
            let arrived = if complete {
                want
            } else {
                incoming.bytes_done() / elem * elem
            };
            if arrived > reduced && (complete || arrived - reduced >= SEGMENT_BYTES) {
                let seg = &mut dst[reduced..arrived];
                if let Some(input) = fresh {
                    seg.copy_from_slice(&input[reduced..arrived]);
                }
                reduce_bytes(self.dtype, self.op, seg, &self.scratch[reduced..arrived]);
                if let Some(p) = avg_ranks {
                    finish_avg_bytes(self.dtype, seg, p);
                }
                reduced = arrived;
            }
            let sent = s.as_ref().map_or(true, |(req, _)| req.is_complete());
            if complete && sent {
                return Ok(());
            }
            let mut ops = Vec::with_capacity(2);
            if let Some((req, b)) = s.as_mut() {
                if !req.is_complete() {
                    ops.push(Op::send(req, b));
                }
            }
            if !complete {
                ops.push(Op::recv(&mut incoming, &mut self.scratch[..want]));
            }
            self.t.progress(&mut ops, Wait::Until(self.deadline))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(size: usize) {
        let folds: Vec<Fold> = (0..size).map(|r| Fold::new(r, size)).collect();
        let core = folds[0].core_size;
        assert!(core.is_power_of_two() && core <= size && 2 * core > size);
        // Core ranks are exactly 0..core, each once, and map back to their group rank.
        let mut seen = vec![false; core];
        for (r, f) in folds.iter().enumerate() {
            match f.role {
                Role::Extra { partner } => {
                    assert_eq!(f.core_rank, None);
                    assert_eq!(folds[partner].role, Role::Absorb { partner: r });
                }
                Role::Absorb { partner } => {
                    assert_eq!(folds[partner].role, Role::Extra { partner: r })
                }
                Role::Core => assert!(r >= 2 * f.extra),
            }
            if let Some(c) = f.core_rank {
                assert!(!seen[c], "core rank {c} twice");
                seen[c] = true;
                assert_eq!(f.core_to_rank(c), r);
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn small_groups_fold_onto_a_power_of_two() {
        for size in 1..=17 {
            check(size);
        }
        assert_eq!(Fold::new(0, 1).role, Role::Core);
        assert_eq!(Fold::new(2, 3).core_rank, Some(1));
    }

    proptest! {
        #[test]
        fn any_group_folds(size in 1usize..300) {
            check(size);
        }
    }
}
