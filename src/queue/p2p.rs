//! The queue's point-to-point transfers ([`Queue::isend`](super::Queue::isend) and
//! [`Queue::irecv`](super::Queue::irecv)): every live transfer is progressed together with the
//! others, and none waits for a later one, so any order of sends and receives across the ranks
//! completes, as `MPI_Isend`/`MPI_Irecv` do.
//!
//! Who progresses them (the queue's `drive`): the thread that issues a transfer posts it and
//! pushes a send as far as the socket takes it; a thread waiting for a transfer progresses all
//! of them in its own time (no hand-over between threads, as MPI progresses in `MPI_Wait`);
//! transfers that no thread waits for are taken over by the queue's thread after a short
//! grace, so that they complete in the background (a collective on another communicator
//! between an `isend` and its `wait`). Whoever progresses them holds the communicator, so the
//! queue refuses calls while the caller holds transfer requests (`Queue::calls_allowed`), and
//! a call made after requests were given up waits for their transfers.

use std::any::Any;
use std::collections::VecDeque;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_algorithms::DType;
use chorus_transport::{Direction, Op, Request as TReq, TransportError, Wait};

use crate::collectives::p2p_tag;
use crate::comm::Communicator;
use crate::error::{CommError, ErrorKind};

/// How long one wait of the worker lasts before it looks for new transfers. TCP is woken at
/// once when one is issued; shared memory has no such wake, and notices within this.
const SLICE: Duration = Duration::from_millis(2);

/// The error of a transfer whose buffer panicked when asked for its bytes.
fn buffer_panicked(op: &'static str, rank: usize) -> CommError {
    CommError::new(
        ErrorKind::Internal,
        op,
        "the transfer's buffer panicked when asked for its bytes (send_bytes or recv_bytes); \
         the communicator was aborted",
    )
    .at_rank(rank)
    .with_usable(false)
}

/// A transfer's buffer, lent to the transport while the transfer is live.
pub(crate) enum Buf<'a> {
    Send(&'a [u8]),
    Recv(&'a mut [u8]),
}

/// One transfer: its buffer and where its result goes (type-erased over the buffer's type).
pub(crate) trait Transfer: Send {
    /// The buffer (always the same memory, for sends the same bytes); asked for only by the
    /// thread driving the transfers, once the calls issued before it have ended.
    fn buf(&mut self) -> Buf<'_>;
    /// Whether it sends.
    fn is_send(&self) -> bool;
    /// The buffer's length in bytes, without making a slice of it.
    fn byte_len(&self) -> usize;
    /// Hand the buffer back with the result; `comm` aborts when a given-up transfer fails.
    /// `answered` runs once: just before a waiting request can see the result, or, given
    /// up, after the buffer (and what it holds) is gone.
    fn finish(
        self: Box<Self>,
        result: Result<(), CommError>,
        comm: &mut Communicator,
        answered: &mut dyn FnMut(),
    );
}

/// A transfer as issued: what the worker needs to post it.
pub(crate) struct Entry {
    pub(crate) peer: usize,
    pub(crate) dtype: DType,
    pub(crate) transfer: Box<dyn Transfer>,
    /// When it was posted, once the calls issued before it ended (when it was issued, until
    /// then): it must complete within the communicator's timeout of this. Not of its issue:
    /// calls ahead of it in the queue, each within its own timeout, may together take
    /// longer, and the transfer would then fail before it was ever tried.
    pub(crate) posted: Instant,
}

impl Entry {
    fn op(&self) -> &'static str {
        if self.transfer.is_send() {
            "isend"
        } else {
            "irecv"
        }
    }
}

/// A posted transfer.
struct Live {
    entry: Entry,
    req: TReq,
    deadline: Instant,
}

/// The transfers posted to the transport, and those between this rank and itself (matched in
/// order, copied without the transport); held by the thread driving them.
pub(crate) struct Engine {
    live: Vec<Live>,
    self_sends: VecDeque<Entry>,
    self_recvs: VecDeque<Entry>,
    /// Transfers issued and not finished (shared with the queue, which counts them in).
    unfinished: Arc<AtomicUsize>,
}

impl Engine {
    pub(crate) fn new(unfinished: Arc<AtomicUsize>) -> Engine {
        Engine {
            live: Vec::new(),
            self_sends: VecDeque::new(),
            self_recvs: VecDeque::new(),
            unfinished,
        }
    }

    /// Whether transfers are posted to the transport.
    pub(crate) fn has_live(&self) -> bool {
        !self.live.is_empty()
    }

    /// Finish `e`: counted out before its request can see the result, so that a caller who
    /// sees it may make a call at once, and, for a transfer given up, only after its buffer
    /// is let go (a caller who reads no transfers left may reuse the memory).
    fn finish(&self, e: Entry, result: Result<(), CommError>, comm: &mut Communicator) {
        /// Counts the transfer out once: when answered, or while unwinding from a panic in
        /// the finish (a buffer's `Drop`), so the count never stays up.
        struct CountOut<'a> {
            unfinished: &'a AtomicUsize,
            done: bool,
        }
        impl CountOut<'_> {
            fn now(&mut self) {
                if !std::mem::replace(&mut self.done, true) {
                    self.unfinished.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        impl Drop for CountOut<'_> {
            fn drop(&mut self) {
                self.now();
            }
        }
        let mut count = CountOut {
            unfinished: &self.unfinished,
            done: false,
        };
        e.transfer.finish(result, comm, &mut || count.now());
    }

    /// Post `e`, or finish it with the error that refuses it.
    pub(crate) fn admit(&mut self, comm: &mut Communicator, mut e: Entry) {
        let op = e.op();
        if let Err(err) = comm.check_usable(op) {
            self.finish(e, Err(err), comm);
            return self.fail_unmatched_if_broken(comm);
        }
        e.posted = Instant::now();
        if e.peer == comm.rank() {
            if e.transfer.is_send() {
                self.self_sends.push_back(e);
            } else {
                self.self_recvs.push_back(e);
            }
            return self.match_self(comm);
        }
        let tag = p2p_tag(e.dtype);
        let made = catch_unwind(AssertUnwindSafe(|| match e.transfer.buf() {
            Buf::Send(b) => TReq::send(e.peer, tag, b.len()),
            Buf::Recv(b) => TReq::recv(e.peer, tag, b.len()),
        }));
        let mut req = match made {
            Ok(req) => req,
            Err(panic) => {
                // Held only here: finished before the panic goes on (to `drive`, which
                // aborts the communicator and fails the other transfers).
                let err = buffer_panicked(e.op(), comm.rank());
                self.finish(e, Err(err), comm);
                resume_unwind(panic)
            }
        };
        if let Err(te) = comm.transport_mut().post(&mut req) {
            let err = comm.fail(op, te);
            return self.finish(e, Err(err), comm);
        }
        let deadline = chorus_transport::deadline_from(e.posted, comm.config().timeout);
        self.live.push(Live {
            entry: e,
            req,
            deadline,
        });
    }

    /// Pair sends to this rank with its receives from itself, in order.
    fn match_self(&mut self, comm: &mut Communicator) {
        while !self.self_sends.is_empty() && !self.self_recvs.is_empty() {
            let (mut s, mut r) = (
                self.self_sends.pop_front().expect("checked"),
                self.self_recvs.pop_front().expect("checked"),
            );
            let copied = catch_unwind(AssertUnwindSafe(|| {
                match (s.transfer.buf(), r.transfer.buf()) {
                    (Buf::Send(a), Buf::Recv(b)) if a.len() == b.len() && s.dtype == r.dtype => {
                        b.copy_from_slice(a);
                        Ok(())
                    }
                    (Buf::Send(a), Buf::Recv(b)) => Err(format!(
                        "a send of {} bytes of {} to this rank met a receive of {} bytes of {}",
                        a.len(),
                        s.dtype.name(),
                        b.len(),
                        r.dtype.name()
                    )),
                    _ => unreachable!("sends and receives are kept apart"),
                }
            }));
            let result = match copied {
                Ok(result) => result,
                Err(panic) => {
                    // Both halves are held only here: finished before the panic goes on.
                    let rank = comm.rank();
                    let done = vec![
                        (s, Err(buffer_panicked("isend", rank))),
                        (r, Err(buffer_panicked("irecv", rank))),
                    ];
                    let _ = self.finish_each(done, comm);
                    resume_unwind(panic)
                }
            };
            let mismatch = |op, m: &String| {
                CommError::new(ErrorKind::Mismatch, op, m.clone())
                    .at_rank(comm.rank())
                    .with_usable(true)
            };
            let (rs, rr) = match &result {
                Ok(()) => (Ok(()), Ok(())),
                Err(m) => (Err(mismatch("isend", m)), Err(mismatch("irecv", m))),
            };
            // Each finished whatever the other's buffer does when dropped (a panic).
            if let Some(panic) = self.finish_each(vec![(s, rs), (r, rr)], comm) {
                resume_unwind(panic)
            }
        }
    }

    /// Move the bytes of the transfer admitted last, if it is a send, as far as the transport
    /// takes them without blocking (a small send completes here): what the thread that issues
    /// a transfer does, without sweeping the other live ones (receives wait for a waiting
    /// thread or the worker).
    pub(crate) fn push_last_send(&mut self, comm: &mut Communicator) {
        let Some(l) = self.live.last_mut() else {
            return;
        };
        if l.req.direction() != Direction::Send {
            return;
        }
        let progress = {
            let op = match l.entry.transfer.buf() {
                Buf::Send(b) => Op::send(&mut l.req, b),
                Buf::Recv(_) => unreachable!("a send"),
            };
            comm.transport_mut().progress(&mut [op], Wait::No)
        };
        match progress {
            Err(e) => self.fail_all(comm, Direction::Send, e),
            Ok(true) => {
                let l = self.live.pop().expect("the last");
                self.finish(l.entry, Ok(()), comm);
            }
            Ok(false) => {}
        }
    }

    /// Progress the live transfers: for one slice (`block`), or without blocking. A
    /// transport error fails every transfer held (the communicator is then aborted as a
    /// blocking call's error would).
    pub(crate) fn step(&mut self, comm: &mut Communicator, block: bool, end: Option<Instant>) {
        if self.live.is_empty() {
            return;
        }
        let now = Instant::now();
        let first_deadline = self.live.iter().map(|l| l.deadline).min().expect("live");
        if now >= first_deadline {
            let late = self
                .live
                .iter()
                .filter(|l| l.deadline <= now)
                .min_by_key(|l| l.deadline)
                .expect("one is late");
            let e = TransportError::Timeout {
                peer: Some(late.req.peer()),
                waited: now - late.entry.posted,
            };
            let dir = late.req.direction();
            return self.fail_all(comm, dir, e);
        }
        let until = (now + SLICE)
            .min(first_deadline)
            .min(end.unwrap_or(first_deadline).max(now));
        let progress = {
            let mut ops: Vec<Op<'_, '_>> = self
                .live
                .iter_mut()
                .map(|l| match l.entry.transfer.buf() {
                    Buf::Send(b) => Op::send(&mut l.req, b),
                    Buf::Recv(b) => Op::recv(&mut l.req, b),
                })
                .collect();
            let wait = if block { Wait::Poll(until) } else { Wait::No };
            comm.transport_mut().progress(&mut ops, wait)
        };
        if let Err(e) = progress {
            // Those that finished before the error keep their result.
            self.finish_completed(comm);
            let dir = self.direction_of(&e);
            return self.fail_all(comm, dir, e);
        }
        // A receive must take exactly its buffer (as a blocking one): another length is a
        // mismatch, which leaves the byte streams in an unknown state.
        let short = self.live.iter().find(|l| {
            l.req.is_complete()
                && l.req.direction() == Direction::Recv
                && l.req.bytes_done() != l.req.len()
        });
        if let Some(l) = short {
            let e = TransportError::Mismatch {
                peer: l.req.peer(),
                expected_tag: l.req.tag(),
                got_tag: l.req.tag(),
                expected_len: l.req.len(),
                got_len: l.req.bytes_done(),
            };
            self.finish_completed(comm);
            return self.fail_all(comm, Direction::Recv, e);
        }
        self.finish_completed(comm);
    }

    /// Finish the live transfers that are complete: sends, and receives that took exactly
    /// their buffer.
    fn finish_completed(&mut self, comm: &mut Communicator) {
        let mut k = 0;
        while k < self.live.len() {
            let req = &self.live[k].req;
            let whole = req.direction() == Direction::Send || req.bytes_done() == req.len();
            if req.is_complete() && whole {
                let l = self.live.remove(k);
                self.finish(l.entry, Ok(()), comm);
            } else {
                k += 1;
            }
        }
    }

    /// Which kind of transfer a transport error of [`Self::step`] most likely came from: a
    /// malformed or mismatched message from a receive; otherwise the first live transfer with
    /// the rank the error names (the first one of all if it names none).
    fn direction_of(&self, e: &TransportError) -> Direction {
        let peer = match e {
            TransportError::Protocol { .. } | TransportError::Mismatch { .. } => {
                return Direction::Recv
            }
            TransportError::PeerClosed { peer } | TransportError::PeerAborted { peer, .. } => {
                Some(*peer)
            }
            TransportError::Timeout { peer, .. } | TransportError::Io { peer, .. } => *peer,
            _ => None,
        };
        peer.and_then(|p| self.live.iter().find(|l| l.req.peer() == p))
            .or(self.live.first())
            .map_or(Direction::Recv, |l| l.req.direction())
    }

    /// Fail every transfer held with `e` (reported through the communicator, which aborts;
    /// the failure is named after a transfer in direction `dir`, each request's error after
    /// its own).
    fn fail_all(&mut self, comm: &mut Communicator, dir: Direction, e: TransportError) {
        let op = match dir {
            Direction::Send => "isend",
            Direction::Recv => "irecv",
        };
        let err = comm.fail(op, e);
        if !self.live.is_empty() && comm.is_unbroken() {
            // Posted requests are dropped below, and with them the transport's order of
            // messages to their peers: the communicator cannot go on, whatever the error.
            comm.abort(&format!(
                "point-to-point transfers failed: {}",
                err.message()
            ));
        }
        let all = self
            .take_held(true)
            .into_iter()
            .map(|entry| {
                let mine = err.copy().with_op(entry.op());
                (entry, Err(mine))
            })
            .collect::<Vec<_>>();
        if let Some(panic) = self.finish_each(all, comm) {
            resume_unwind(panic);
        }
    }

    /// Takes the transfers held: the transfers to this rank itself waiting for their other
    /// half, and with `live` the posted ones first.
    fn take_held(&mut self, live: bool) -> Vec<Entry> {
        let posted = if live { self.live.len() } else { 0 };
        self.live
            .drain(..posted)
            .map(|l| l.entry)
            .chain(self.self_sends.drain(..))
            .chain(self.self_recvs.drain(..))
            .collect()
    }

    /// Finish every entry of `done` with its result, each even if another's finish panics
    /// (a buffer's `Drop`: an entry dropped unfinished would leave its request waiting
    /// forever); returns the first panic.
    fn finish_each(
        &self,
        done: Vec<(Entry, Result<(), CommError>)>,
        comm: &mut Communicator,
    ) -> Option<Box<dyn Any + Send>> {
        let mut first = None;
        for (entry, result) in done {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| self.finish(entry, result, comm)))
            {
                first.get_or_insert(panic);
            }
        }
        first
    }

    /// Once the communicator is broken (aborted): fail the transfers to this rank itself
    /// that wait for their other half, which can no longer be issued, with its error.
    pub(crate) fn fail_unmatched_if_broken(&mut self, comm: &mut Communicator) {
        if comm.is_unbroken() || (self.self_sends.is_empty() && self.self_recvs.is_empty()) {
            return;
        }
        let done: Vec<_> =
            self.take_held(false)
                .into_iter()
                .map(|entry| {
                    let err = comm.check_usable(entry.op()).err().unwrap_or_else(|| {
                        CommError::new(ErrorKind::Internal, entry.op(), "aborted")
                    });
                    (entry, Err(err))
                })
                .collect();
        if let Some(panic) = self.finish_each(done, comm) {
            resume_unwind(panic);
        }
    }

    /// Fail the transfers to this rank itself that have waited for their other half longer
    /// than the communicator's timeout (the communicator stays usable: nothing went on the
    /// wire).
    pub(crate) fn expire_unmatched(&mut self, comm: &mut Communicator) {
        let timeout = comm.config().timeout;
        let late = |q: &mut VecDeque<Entry>| {
            let n = q
                .iter()
                .take_while(|e| e.posted.elapsed() >= timeout)
                .count();
            q.drain(..n).collect::<Vec<_>>()
        };
        let mut held = late(&mut self.self_sends);
        held.extend(late(&mut self.self_recvs));
        self.fail_each(held, comm, |e| {
            let other = if e.transfer.is_send() {
                "receive"
            } else {
                "send"
            };
            (
                ErrorKind::Timeout,
                format!(
                    "a transfer to this rank itself found no {other} from itself within {:.1} s",
                    timeout.as_secs_f64()
                ),
                true,
            )
        });
    }

    /// When the oldest transfer to this rank itself that waits for its other half times out
    /// (`None`: none waits).
    pub(crate) fn unmatched_due(&self, timeout: Duration) -> Option<Instant> {
        let oldest = |q: &VecDeque<Entry>| q.front().map(|e| e.posted);
        match (oldest(&self.self_sends), oldest(&self.self_recvs)) {
            (Some(a), Some(b)) => Some(chorus_transport::deadline_from(a.min(b), timeout)),
            (a, b) => a.or(b).map(|t| chorus_transport::deadline_from(t, timeout)),
        }
    }

    /// Finish each of `held` with the error `why` describes (kind, message, whether the
    /// communicator stays usable).
    fn fail_each(
        &self,
        held: Vec<Entry>,
        comm: &mut Communicator,
        why: impl Fn(&Entry) -> (ErrorKind, String, bool),
    ) {
        let rank = comm.rank();
        let done = held
            .into_iter()
            .map(|entry| {
                let (kind, message, usable) = why(&entry);
                let err = CommError::new(kind, entry.op(), message)
                    .at_rank(rank)
                    .with_usable(usable);
                (entry, Err(err))
            })
            .collect();
        if let Some(panic) = self.finish_each(done, comm) {
            resume_unwind(panic);
        }
    }

    /// After a panic while progressing: fail every transfer still held with an internal
    /// error (the caller aborts the communicator).
    pub(crate) fn abandon(&mut self, comm: &mut Communicator) {
        let held = self.take_held(true);
        self.fail_each(held, comm, |_| {
            (
                ErrorKind::Internal,
                "a panic while point-to-point transfers progressed; the communicator was \
                 aborted"
                    .into(),
                false,
            )
        });
    }

    /// Fail what is held because the queue closes: transfers to itself still waiting for
    /// their other half.
    pub(crate) fn drop_unmatched(&mut self, comm: &mut Communicator) {
        let held = self.take_held(false);
        self.fail_each(held, comm, |_| {
            (
                ErrorKind::InvalidUsage,
                "a transfer between this rank and itself had no other half (a send to itself \
                 needs a receive from itself) when the queue was closed"
                    .into(),
                true,
            )
        });
    }
}
