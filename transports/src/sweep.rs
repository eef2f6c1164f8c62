//! The loop each transport's `progress` starts with: drive every incomplete op, and again
//! while something moved (completing one request can unblock the next one queued behind it on
//! the same peer).

use std::time::Instant;

use crate::{Direction, Op, Result, TransportError, Wait};

/// Outcome of trying to move bytes for one op.
pub(crate) enum Moved {
    /// Some bytes moved (or the op completed).
    Yes,
    /// Nothing could move: it waits for the peer (a socket that would block, a full ring, no
    /// credits, nothing arrived).
    Blocked,
    /// A send whose available bytes all went: waits for the caller.
    NeedsData,
    /// The op is not at the head of its peer's queue.
    NotHead,
}

/// What a sweep over a wait's ops found.
pub(crate) struct Swept {
    /// Some op moved.
    pub moved: bool,
    /// Every op is complete.
    pub all_done: bool,
    /// Some op waits for its peer.
    pub blocked: bool,
    /// Some send waits for the caller's bytes.
    pub needs_data: bool,
}

/// Drives every incomplete op of `ops` with `drive`, again while something moved; the first
/// error ends the sweep.
pub(crate) fn sweep<'r, 'b>(
    ops: &mut [Op<'r, 'b>],
    mut drive: impl FnMut(&mut Op<'r, 'b>) -> Result<Moved>,
) -> Result<Swept> {
    let mut s = Swept {
        moved: false,
        all_done: true,
        blocked: false,
        needs_data: false,
    };
    loop {
        let mut again = false;
        s.all_done = true;
        s.blocked = false;
        s.needs_data = false;
        for op in ops.iter_mut() {
            if op.req.is_complete() {
                continue;
            }
            match drive(op)? {
                Moved::Yes => {
                    s.moved = true;
                    again = true;
                }
                Moved::Blocked => s.blocked = true,
                Moved::NeedsData => s.needs_data = true,
                Moved::NotHead => {}
            }
            if !op.req.is_complete() {
                s.all_done = false;
            }
        }
        if !again || s.all_done {
            return Ok(s);
        }
    }
}

/// The timeout of a wait ([`Wait::Until`]) whose deadline passed while bytes still moved
/// (`None` while it has not, and for other waits): a peer that trickles its bytes must not
/// hold a schedule's loop of waits past the call's timeout.
pub(crate) fn deadline_passed(
    wait: Wait,
    ops: &[Op<'_, '_>],
    started: Instant,
) -> Option<TransportError> {
    match wait {
        Wait::Until(d) if Instant::now() >= d => Some(TransportError::Timeout {
            peer: timeout_peer(ops),
            waited: started.elapsed(),
        }),
        _ => None,
    }
}

/// The error of a wait none of whose pending ops can move.
pub(crate) fn stuck_behind_others() -> TransportError {
    TransportError::InvalidUsage(
        "every pending request waits behind an earlier request of the same peer that is not \
         part of this wait"
            .into(),
    )
}

/// The peer a timeout names: that of the first incomplete receive (the peer this rank waits to
/// hear from), else that of the first incomplete op.
pub(crate) fn timeout_peer(ops: &[Op<'_, '_>]) -> Option<usize> {
    ops.iter()
        .find(|o| !o.req.is_complete() && o.req.direction() == Direction::Recv)
        .or_else(|| ops.iter().find(|o| !o.req.is_complete()))
        .map(|o| o.req.peer())
}

/// A schedule's loop of waits for tests: `wait` (one wait, until a deadline 200 ms from the
/// start) every 10 ms (the schedule's work between its waits) until it fails or 2 s pass;
/// the error and when it came, `None` if none came.
#[cfg(test)]
pub(crate) fn loop_of_waits(
    mut wait: impl FnMut(Wait) -> Result<bool>,
) -> Option<(TransportError, std::time::Duration)> {
    use std::time::Duration;
    let start = Instant::now();
    let deadline = start + Duration::from_millis(200);
    while start.elapsed() < Duration::from_secs(2) {
        match wait(Wait::Until(deadline)) {
            Ok(done) => assert!(!done, "the wait completed"),
            Err(e) => return Some((e, start.elapsed())),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Checks that [`loop_of_waits`] ended in a timeout naming peer 1 within a second, with the
/// receive `req` of `len` bytes partly done.
#[cfg(test)]
pub(crate) fn assert_timed_out(
    outcome: Option<(TransportError, std::time::Duration)>,
    req: &crate::Request,
    len: usize,
) {
    let (e, took) = outcome.expect("the loop of waits outlasted its deadline");
    assert!(
        matches!(e, TransportError::Timeout { peer: Some(1), .. }),
        "{e}"
    );
    assert!(
        took < std::time::Duration::from_secs(1),
        "timed out after {took:?}"
    );
    assert!(req.bytes_done() > 0 && req.bytes_done() < len);
}
