//! Nonblocking collectives: a [`Queue`] runs a communicator's calls on a thread of its own, in
//! the order they were issued, and hands back a [`Request`] for each (as `MPI_Iallreduce` and
//! its kin, or a CUDA stream for NCCL).
//!
//! ```no_run
//! use chorus::{Communicator, Queue, ReduceOp};
//!
//! let queue = Queue::new(Communicator::from_env()?);
//! let first = queue.all_reduce(vec![1.0f32; 1 << 20], ReduceOp::Sum);
//! let second = queue.all_reduce(vec![2.0f32; 1 << 20], ReduceOp::Sum);
//! // ... compute while both run ...
//! let (a, b) = (first.wait()?, second.wait()?);
//! # Ok::<(), chorus::CommError>(())
//! ```
//!
//! Every rank must issue the same calls in the same order, as with blocking calls; the queue
//! keeps that order on its thread. A blocking call through [`Queue::run`] waits for the calls
//! issued before it. The buffers travel with the calls (moved in, handed back by
//! [`Request::wait`]), so nothing can touch them while a call runs. A call that fails drops
//! its buffer with it (the error does not carry it back).
//!
//! A queue also runs point-to-point transfers ([`Queue::isend`], [`Queue::irecv`], as
//! `MPI_Isend`/`MPI_Irecv`), which progress on their own rather than in turn:
//!
//! ```no_run
//! # use chorus::{Communicator, Queue};
//! # let queue = Queue::new(Communicator::from_env()?);
//! let (r, p) = (queue.rank(), queue.size());
//! // Around a ring, sends before receives, of any size: they cannot deadlock.
//! let sent = queue.isend(vec![r as f32; 1 << 20], (r + 1) % p);
//! let got = queue.irecv(vec![0f32; 1 << 20], (r + p - 1) % p);
//! let (_, halo) = (sent.wait()?, got.wait()?);
//! # Ok::<(), chorus::CommError>(())
//! ```

mod p2p;

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use chorus_algorithms::{DType, Element, ReduceOp};

use crate::comm::{AbortHandle, Call, CollKind, Communicator, Process};
use crate::error::{CommError, ErrorKind};

/// A queued call: it runs holding the communicator, and calls its second argument just
/// before its request gets the result (so [`Queue::pending`] no longer counts a call whose
/// request a waiter already has).
type Job = Box<dyn FnOnce(&mut Communicator, &mut dyn FnMut()) + Send>;

/// What the queue runs, in the order issued.
enum Item {
    /// A call: the worker runs it holding the communicator.
    Call(Job),
    /// A point-to-point transfer: the worker posts it and progresses it with every other live
    /// one ([`p2p`]).
    P2p(p2p::Entry),
}

/// The bytes of a buffer sent by [`Queue::isend_buffer`].
pub trait SendBuffer: Send + 'static {
    /// The bytes to send (the same ones at every call while the transfer is live; asked
    /// for only once the calls issued before the transfer have ended).
    fn send_bytes(&self) -> &[u8];
    /// How many bytes, without making a slice of them.
    fn send_len(&self) -> usize;
}

/// The bytes of a buffer received into by [`Queue::irecv_buffer`].
pub trait RecvBuffer: Send + 'static {
    /// Where the message goes (the same memory at every call while the transfer is live;
    /// asked for only once the calls issued before the transfer have ended).
    fn recv_bytes(&mut self) -> &mut [u8];
    /// How many bytes, without making a slice of them.
    fn recv_len(&self) -> usize;
}

impl<T: Element> SendBuffer for Vec<T> {
    fn send_bytes(&self) -> &[u8] {
        crate::collectives::bytes(self)
    }
    fn send_len(&self) -> usize {
        std::mem::size_of_val(self.as_slice())
    }
}

impl<T: Element> RecvBuffer for Vec<T> {
    fn recv_bytes(&mut self) -> &mut [u8] {
        crate::collectives::bytes_mut(self)
    }
    fn recv_len(&self) -> usize {
        std::mem::size_of_val(self.as_slice())
    }
}

thread_local! {
    /// On a queue's thread: which queue (the address of its `Shared`), so that a call waiting
    /// for a request of its own queue fails instead of waiting for itself.
    static RUNNING_QUEUE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// On a thread inside a blocking call ([`Queue::run`], [`Queue::try_run`]): which queue.
    /// It holds the communicator, so waiting there for a transfer would wait for itself.
    static IN_CALL: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether this thread is inside a blocking call of the queue at `queue` (`IN_CALL`). After
/// the thread's locals are destroyed (a call from an `atexit` handler), never: no call can
/// have been marked since.
fn in_call_on(queue: usize) -> bool {
    IN_CALL
        .try_with(|q| q.borrow().contains(&queue))
        .unwrap_or(false)
}

/// Lock `m`, taking the data of a poisoned lock as it is (nothing here panics while holding
/// one; the communicator's own lock is handled apart).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Calls waiting for the worker, and how many were issued and finished.
struct Jobs {
    queue: VecDeque<Item>,
    /// Calls issued so far.
    issued: u64,
    /// Calls finished so far (they finish in the order issued).
    finished: u64,
    /// The queue is being dropped: the worker ends once the queue is empty.
    closing: bool,
    /// The worker thread, once started.
    worker: Option<ThreadId>,
    /// A thread (the worker, or one waiting for a transfer, or one issuing one) is
    /// progressing transfers: it holds the communicator, or is about to.
    driving: bool,
    /// Live transfers that no thread progresses, since this instant: the worker takes them
    /// over after [`GRACE`] (a thread that waits for one progresses them itself meanwhile).
    unattended: Option<Instant>,
    /// The worker has taken an item from the queue and not finished it: a transfer issued
    /// now must wait its turn behind it.
    busy: bool,
    /// Transfers were live when the last thread driving them stopped.
    live: bool,
    /// The worker sleeps until it is woken (with transfers issued lately, it looks at
    /// `unattended` every [`GRACE`] instead, unwoken).
    napping: bool,
    /// Collectives refused on this rank whose places are still to be used up, each as the
    /// count of calls issued before it ([`Queue::skip_refused_collective`]), in order.
    skips: VecDeque<u64>,
    /// Threads in [`Queue::wait_all`] (woken when a driving thread stops).
    waiting_all: usize,
    /// When the oldest transfer to this rank itself, waiting for its other half, times out:
    /// a waiting thread or the worker then drives, which fails it.
    unmatched_due: Option<Instant>,
}

impl Jobs {
    /// Whether a thread that waits for or tests a transfer may drive the transfers now:
    /// nobody drives, the worker is idle, no call is queued ahead, and something is there to
    /// move (posted, queued, or a transfer to this rank itself due to expire).
    fn free_to_drive(&self, now: Instant) -> bool {
        let (call_next, transfer_next) = match self.queue.front() {
            Some(Item::Call(_)) => (true, false),
            Some(Item::P2p(_)) => (false, true),
            None => (false, false),
        };
        let expiring = self.unmatched_due.is_some_and(|t| t <= now);
        !self.driving && !self.busy && !call_next && (self.live || transfer_next || expiring)
    }
}

/// How long live transfers wait, unattended, for a thread that waits for one of them to
/// progress them in its own time (no hand-over between threads) before the worker takes them
/// over (progress in the background), and how often the worker looks while transfers are
/// issued (it is not woken for each).
const GRACE: Duration = Duration::from_millis(2);

/// How long after the last live transfer the worker goes on looking every [`GRACE`] before it
/// sleeps until woken.
const STAY_AWAKE: Duration = Duration::from_millis(200);

struct Shared {
    comm: Mutex<Communicator>,
    /// The process that made the queue: a child forked since has no worker thread.
    process: Process,
    jobs: Mutex<Jobs>,
    /// Signalled when a job is queued, when one finishes and when the queue closes.
    changed: Condvar,
    /// Calls whose requests have their results (or were given up): counted just before the
    /// result is handed over, while `Jobs::finished` waits for the worker to let go of the
    /// communicator.
    answered: AtomicU64,
    /// Point-to-point transfers issued and not finished.
    transfers: Arc<AtomicUsize>,
    /// Requests of transfers the caller holds (issued, not yet waited for, given up or
    /// dropped): calls are refused while there are, which depends on the program's order
    /// only.
    held: Arc<AtomicUsize>,
    /// The transfers posted and not finished, locked after `comm` by the thread driving them
    /// (`Jobs::driving`): one issuing a transfer, one waiting for one, or the worker.
    engine: Mutex<p2p::Engine>,
    /// The communicator's abort handle: a thread waiting for a transfer to itself (nothing
    /// to progress) drives once an abort is requested, which fails it.
    abort: AbortHandle,
}

/// A communicator whose calls run on a thread of their own, in the order they are issued.
/// See the [module documentation](self).
///
/// The thread starts with the first nonblocking call and ends when the queue is dropped;
/// dropping the queue (or [`Queue::into_inner`]) first waits for every call issued. A queue
/// may be shared between threads (`&Queue` is enough to issue). Calls issued from two threads
/// at once are ordered as they reach the queue, and a blocking call ([`Queue::run`]) from one
/// thread is not ordered against a nonblocking call issued meanwhile from another: making the
/// order the same on every rank is the caller's business, as with two threads calling MPI.
pub struct Queue {
    shared: Arc<Shared>,
    abort: AbortHandle,
    worker: Mutex<Option<JoinHandle<()>>>,
    rank: usize,
    size: usize,
}

impl Queue {
    /// A queue over `comm`.
    pub fn new(comm: Communicator) -> Queue {
        let transfers = Arc::new(AtomicUsize::new(0));
        let abort = comm.abort_handle();
        Queue {
            abort: abort.clone(),
            rank: comm.rank(),
            size: comm.size(),
            shared: Arc::new(Shared {
                comm: Mutex::new(comm),
                process: Process::this(),
                jobs: Mutex::new(Jobs {
                    queue: VecDeque::new(),
                    issued: 0,
                    skips: VecDeque::new(),
                    finished: 0,
                    closing: false,
                    worker: None,
                    driving: false,
                    unattended: None,
                    busy: false,
                    live: false,
                    napping: false,
                    waiting_all: 0,
                    unmatched_due: None,
                }),
                changed: Condvar::new(),
                abort,
                engine: Mutex::new(p2p::Engine::new(Arc::clone(&transfers))),
                answered: AtomicU64::new(0),
                transfers,
                held: Arc::new(AtomicUsize::new(0)),
            }),
            worker: Mutex::new(None),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// An error in a child forked from the process that made the queue: its calls run in the
    /// parent, and the communicator's connections are the parent's.
    pub fn check_process(&self) -> Result<(), CommError> {
        self.shared.process.check("queued call", self.rank)
    }

    /// Abort the communicator, also while a call runs on it (its own thread's, or another
    /// thread's blocking call): the peers are told and their calls fail at once, the running
    /// call and every later one fail (see [`AbortHandle`]). Returns once the peers have been
    /// told: true; false if after `limit` a running call has neither waited nor ended (it tells
    /// them when it does), or at once when called on the queue's own thread or inside a
    /// blocking call on this queue ([`Queue::run`]): that call notices when it next waits or
    /// ends. In a forked child it does nothing (the
    /// parent still runs this rank) and returns true.
    pub fn abort(&self, reason: &str, limit: Duration) -> bool {
        if self.check_process().is_err() {
            return true;
        }
        self.abort.abort(reason);
        if lock(&self.shared.jobs).worker == Some(std::thread::current().id()) || self.in_own_call()
        {
            // A call on the queue's thread, or this thread's blocking call on it
            // (`Queue::run`), holds the communicator: it notices when it next waits, or
            // tells the peers when it ends.
            return false;
        }
        let end = chorus_transport::deadline_after(limit);
        loop {
            let acted = || {
                self.try_now(|c| {
                    c.abort(reason);
                    // Transfers to itself waiting for their other half fail now (a buffer
                    // whose drop panics there must not unwind into the caller's thread).
                    let _ = catch_unwind(AssertUnwindSafe(|| {
                        lock(&self.shared.engine).fail_unmatched_if_broken(c)
                    }));
                })
            };
            if self.abort.is_done() || acted().is_some() {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A handle that aborts the communicator from any thread (see [`AbortHandle`]).
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    /// Calls and point-to-point transfers issued and not yet finished.
    pub fn pending(&self) -> usize {
        if self.check_process().is_err() {
            return 0;
        }
        // `answered` first: a call is answered only after it was issued, so the two read in
        // this order never undercount (calls issued in between count as pending).
        let answered = self.shared.answered.load(Ordering::SeqCst);
        let issued = lock(&self.shared.jobs).issued;
        issued.saturating_sub(answered) as usize + self.transfers()
    }

    /// Point-to-point transfers ([`Queue::isend`], [`Queue::irecv`]) issued and not yet
    /// finished.
    pub fn transfers(&self) -> usize {
        self.shared.transfers.load(Ordering::SeqCst)
    }

    /// Requests of transfers that the caller holds: issued, and not yet waited for, given up
    /// ([`Request::detach`]) or dropped. Calls are refused while there are
    /// ([`Queue::calls_allowed`]).
    pub fn transfer_requests(&self) -> usize {
        self.shared.held.load(Ordering::SeqCst)
    }

    /// The refusal of a call `op` while the caller holds requests of transfers not yet
    /// waited for (an [`ErrorKind::InvalidUsage`] that leaves the communicator usable). The
    /// thread progressing transfers holds the communicator, and a collective would wait
    /// behind them (a peer that first makes the collective, then receives, would never be
    /// reached). The rule follows the program's order (a request is held until it is waited
    /// for, given up or dropped, however soon its transfer ended), so ranks that hold transfer
    /// requests at the same points refuse alike. Where they do not (rank 0 sends to rank 1
    /// and makes a collective before its `wait`, rank 1 makes the collective first), the ranks
    /// whose call was accepted wait for the refused one: until their timeout, or until the
    /// refused rank's next call, which fails as a mismatch on every rank: a refused
    /// collective of this queue ([`Queue::all_reduce`] and the others, and the C and Python
    /// collectives) uses up its place in the order of calls, as other refusals do
    /// ([`Communicator::skip_refused_call`]; when the next call starts), so that it can
    /// never pair with another call of the same shape and give the others wrong results. (A closure given to
    /// [`Queue::submit`] or [`Queue::run`] uses up nothing when refused: the queue does not
    /// know whether it makes a collective.) Wait for transfers before collectives on every
    /// rank. Transfers whose requests were given up or dropped are waited for by the call
    /// instead (each ends within the timeout).
    pub fn calls_allowed(&self, op: &'static str) -> Result<(), CommError> {
        match self.shared.held.load(Ordering::SeqCst) {
            0 => Ok(()),
            n => Err(CommError::new(
                ErrorKind::InvalidUsage,
                op,
                format!(
                    "{n} request(s) of point-to-point transfers (isend/irecv) of this queue are \
                     not yet waited for: calls on the communicator are refused until they are \
                     (or freed); wait for them first, or make the calls on a duplicate of the \
                     communicator (dup; chorus_comm_dup in C) kept for them"
                ),
            )
            .at_rank(self.rank)
            .with_usable(true)),
        }
    }

    /// Wait until no transfer is posted or queued before the call `op` (those whose requests
    /// were given up or dropped finish in the background, each within the communicator's
    /// timeout; transfers to this rank itself do not use the transport and are not waited
    /// for). An error inside a blocking call of this queue, which holds the communicator they
    /// need.
    fn settle_transfers(&self, op: &'static str) -> Result<(), CommError> {
        self.shared.process.check(op, self.rank)?;
        if self.transfers() > 0 && self.in_own_call() {
            return Err(CommError::new(
                ErrorKind::InvalidUsage,
                op,
                "point-to-point transfers are live, and this thread is inside a blocking call on \
                 the same queue, which holds the communicator they need",
            )
            .at_rank(self.rank)
            .with_usable(true));
        }
        // Posted transfers, and those queued before this call; not transfers to itself still
        // waiting for their other half (they do not use the transport).
        let pending = |jobs: &Jobs| {
            jobs.driving || jobs.live || jobs.queue.iter().any(|i| matches!(i, Item::P2p(_)))
        };
        let mut jobs = lock(&self.shared.jobs);
        while pending(&jobs) {
            jobs.waiting_all += 1;
            jobs = self
                .shared
                .changed
                .wait_timeout(jobs, GRACE)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            jobs.waiting_all -= 1;
        }
        Ok(())
    }

    /// Issue `call`: it runs on the queue's thread after every call issued before it, and its
    /// result goes to the returned request. A panic in `call` becomes an internal error, and
    /// the communicator is aborted (its state is unknown).
    ///
    /// `call` runs on the queue's thread: it must not wait for this queue, which would wait for
    /// itself. [`Queue::run`] and [`Queue::wait_all`] panic there (the call's request gets an
    /// internal error); waiting for a later request of the queue is an internal error.
    pub fn submit<T, F>(&self, call: F) -> Request<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Communicator) -> Result<T, CommError> + Send + 'static,
    {
        self.submit_as(false, call)
    }

    /// As [`Queue::submit`], for a call that makes one collective: refused while the caller
    /// holds transfer requests, it uses up the collective's place in the order of calls
    /// ([`Queue::skip_refused_collective`]).
    fn submit_collective<T, F>(&self, call: F) -> Request<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Communicator) -> Result<T, CommError> + Send + 'static,
    {
        self.submit_as(true, call)
    }

    /// Uses up the place of a collective refused on this rank in the order of calls
    /// ([`Communicator::skip_refused_call`]), after the calls issued before it and before
    /// the next; also while the caller holds transfer requests (a collective refused for
    /// them uses up its place too, see [`Queue::calls_allowed`]). Returns at once: the
    /// place is used up when the next call starts (with `CHORUS_CHECK_CALLS`, its
    /// comparison of calls then runs first, as one that refused). Not a queued call:
    /// transfers issued after it, which point-to-point tags keep apart from collectives,
    /// must not wait behind it for the transfers the caller holds. Nothing in a group of one.
    pub fn skip_refused_collective(&self) {
        if self.size > 1 {
            let mut jobs = lock(&self.shared.jobs);
            let after = jobs.issued;
            jobs.skips.push_back(after);
        }
    }

    /// Uses up, on `comm`, the places of the refused collectives ([`Queue::skip_refused_collective`])
    /// that come before a call run inline, after every call issued before it.
    fn settle_skips(&self, comm: &mut Communicator) {
        let n = take_skips(&mut lock(&self.shared.jobs), u64::MAX);
        skip_calls(comm, n);
    }

    fn submit_as<T, F>(&self, collective: bool, call: F) -> Request<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Communicator) -> Result<T, CommError> + Send + 'static,
    {
        // (In a forked child, submit_unchecked refuses with the fork's error first.)
        if self.shared.process.check("queued call", self.rank).is_ok() {
            if let Err(e) = self.calls_allowed("queued call") {
                if collective {
                    self.skip_refused_collective();
                }
                return Request {
                    slot: self.filled_slot(Err(e)),
                    driver: None,
                    held: None,
                };
            }
        }
        self.submit_unchecked(call)
    }

    /// A new request's slot, filled with `value`.
    fn filled_slot<T>(&self, value: Result<T, CommError>) -> Arc<Slot<T>> {
        let slot = self.slot();
        *lock(&slot.value) = Some(value);
        slot
    }

    /// [`Queue::submit`] without the transfer rule ([`Queue::calls_allowed`]).
    fn submit_unchecked<T, F>(&self, call: F) -> Request<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Communicator) -> Result<T, CommError> + Send + 'static,
    {
        let slot = self.slot();
        if let Err(e) = self.shared.process.check("queued call", self.rank) {
            // No worker here, and the communicator is the parent's: refuse at once.
            *lock(&slot.value) = Some(Err(e));
            return Request {
                slot,
                driver: None,
                held: None,
            };
        }
        let fill = Arc::clone(&slot);
        let rank = self.rank;
        let job: Job = Box::new(move |comm: &mut Communicator, answered: &mut dyn FnMut()| {
            let result = match catch_unwind(AssertUnwindSafe(|| call(&mut *comm))) {
                Ok(r) => r,
                Err(panic) => {
                    // (Caught too: the request is filled whatever happens.)
                    let _ = catch_unwind(AssertUnwindSafe(|| {
                        comm.abort("internal error in a queued call")
                    }));
                    Err(CommError::new(
                        ErrorKind::Internal,
                        "queued call",
                        format!("panicked: {}", panic_text(&*panic)),
                    )
                    .at_rank(rank))
                }
            };
            fill.fill(result, comm, answered);
        });
        if !self.start_worker() {
            // No thread to be had: run the call here, after those issued before it; not
            // inside a blocking call on this queue, which holds the communicator.
            if self.in_own_call() {
                *lock(&slot.value) = Some(Err(CommError::new(
                    ErrorKind::InvalidUsage,
                    "queued call",
                    "no thread could be started for the queue, and this call, issued inside a \
                     blocking call on it (Queue::run), cannot run before that call ends",
                )
                .at_rank(self.rank)));
                return Request {
                    slot,
                    driver: None,
                    held: None,
                };
            }
            self.wait_all();
            let mut comm = lock_comm(&self.shared.comm);
            self.settle_skips(&mut comm);
            job(&mut comm, &mut || {});
            comm.settle_abort();
            return Request {
                slot,
                driver: None,
                held: None,
            };
        }
        let mut jobs = lock(&self.shared.jobs);
        jobs.issued += 1;
        jobs.queue.push_back(Item::Call(job));
        drop(jobs);
        self.shared.changed.notify_all();
        Request {
            slot,
            driver: None,
            held: None,
        }
    }

    /// A new request's slot.
    fn slot<T>(&self) -> Arc<Slot<T>> {
        Arc::new(Slot {
            value: Mutex::new(None),
            done: Condvar::new(),
            process: Process::this(),
            rank: self.rank,
            queue: self.id(),
            detached: AtomicBool::new(false),
        })
    }

    /// Send `buf` to `peer` without waiting (as `MPI_Isend`); the request hands the buffer
    /// back once the transport is done with it. See [`Queue::isend_buffer`].
    pub fn isend<T: Element>(&self, buf: Vec<T>, peer: usize) -> Request<Vec<T>> {
        self.isend_buffer(buf, T::DTYPE, peer)
    }

    /// Receive into `buf` from `peer` without waiting (as `MPI_Irecv`); the request hands the
    /// buffer back filled. See [`Queue::isend_buffer`].
    pub fn irecv<T: Element>(&self, buf: Vec<T>, peer: usize) -> Request<Vec<T>> {
        self.irecv_buffer(buf, T::DTYPE, peer)
    }

    /// Send the bytes of `buf` (elements of `dtype`) to `peer` without waiting.
    ///
    /// Point-to-point transfers progress all live ones together and each on its own: none
    /// waits for a later one or for `wait`, so any order of sends and receives across the
    /// ranks completes (a ring of `isend`s before their `irecv`s, an exchange in either order,
    /// a send whose peer receives only after a message from this rank). The thread that
    /// issues a transfer posts it (and pushes a send as far as the socket takes it); a thread
    /// waiting for one progresses them all, as `MPI_Wait` does; transfers that no thread
    /// waits for are taken over by the queue's thread within a few milliseconds, so that they
    /// complete in the background (while this thread runs a collective on another
    /// communicator, say). Buffers of live transfers must not overlap, except sends'. Between two ranks, messages are matched in the order issued, with the blocking
    /// [`Communicator::send`]/[`Communicator::recv`] of a peer that uses no queue too; a
    /// receive takes exactly its buffer's length and dtype (anything else is an
    /// [`ErrorKind::Mismatch`], and the communicator is aborted, as for a blocking receive). A
    /// transfer to this rank itself is copied into its receive from itself, in order (a
    /// mismatch there fails both halves and leaves the communicator usable: nothing went on
    /// the wire).
    ///
    /// Each transfer must finish within the communicator's timeout of being posted, which it
    /// is once the calls issued before it have ended (the timeout of a transfer to this rank
    /// itself, waiting for its other half, counts from then too). While the caller holds a
    /// request of a transfer (not yet waited for, given up or dropped), the queue's calls
    /// ([`Queue::submit`], [`Queue::run`] and the collectives) are refused with
    /// [`ErrorKind::InvalidUsage`] ([`Queue::calls_allowed`]; a call made after the requests
    /// were given up waits for their transfers): wait for the transfers first, or keep a
    /// duplicate of the communicator ([`Communicator::dup`]) for point-to-point messages, as
    /// MPI keeps them apart from collectives by context. Dropping the request leaves the transfer running.
    /// Waiting for a transfer inside [`Queue::run`] on the same queue is refused (the call
    /// holds the communicator the transfer needs).
    pub fn isend_buffer<B: SendBuffer>(&self, buf: B, dtype: DType, peer: usize) -> Request<B> {
        self.transfer(
            Box::new(Sending {
                buf: Some(buf),
                slot: self.slot(),
            }),
            dtype,
            peer,
        )
    }

    /// Receive into the bytes of `buf` (elements of `dtype`) from `peer` without waiting; see
    /// [`Queue::isend_buffer`].
    pub fn irecv_buffer<B: RecvBuffer>(&self, buf: B, dtype: DType, peer: usize) -> Request<B> {
        self.transfer(
            Box::new(Receiving {
                buf: Some(buf),
                slot: self.slot(),
            }),
            dtype,
            peer,
        )
    }

    /// Issue a transfer (its request is in `t`), after checking what can be checked here.
    fn transfer<B: Send + 'static, X: Holds<B> + 'static>(
        &self,
        t: Box<X>,
        dtype: DType,
        peer: usize,
    ) -> Request<B> {
        let slot = Arc::clone(t.slot());
        // No slice of the buffer is made here: calls issued before may still use its memory.
        let op = if t.is_send() { "isend" } else { "irecv" };
        let len = t.byte_len();
        let refused = if let Err(e) = self.shared.process.check(op, self.rank) {
            Some(e)
        } else if peer >= self.size {
            Some(CommError::invalid(
                op,
                format!("peer {peer} is not a rank of this group of {}", self.size),
            ))
        } else if len % dtype.size() != 0 {
            Some(CommError::invalid(
                op,
                format!(
                    "a buffer of {len} bytes is not a whole number of {} elements",
                    dtype.name()
                ),
            ))
        } else if !self.start_worker() {
            Some(CommError::new(
                ErrorKind::System,
                op,
                "the queue's thread could not be started",
            ))
        } else {
            None
        };
        if let Some(e) = refused {
            *lock(&slot.value) = Some(Err(e.at_rank(self.rank)));
            return Request {
                slot,
                driver: None,
                held: None,
            };
        }
        let entry = p2p::Entry {
            peer,
            dtype,
            transfer: t,
            posted: Instant::now(),
        };
        let driver = Some(Arc::downgrade(&self.shared));
        // Counted as held by the caller until its request is waited for, given up or dropped.
        self.shared.held.fetch_add(1, Ordering::SeqCst);
        let held = Some(Arc::clone(&self.shared.held));
        let mut jobs = lock(&self.shared.jobs);
        self.shared.transfers.fetch_add(1, Ordering::SeqCst);
        if jobs.queue.is_empty() && !jobs.busy && !jobs.driving {
            // Nothing issued before it is waiting or running: this thread posts it and moves
            // what it can at once (a small send completes here), without waking the worker.
            // The communicator is free unless a blocking call of another thread holds it.
            if let Some(comm) = try_lock_comm(&self.shared.comm) {
                jobs.driving = true;
                drop(jobs);
                drive(&self.shared, comm, Some(entry), Drive::Step, None);
                return Request { slot, driver, held };
            }
        }
        jobs.queue.push_back(Item::P2p(entry));
        drop(jobs);
        self.shared.changed.notify_all();
        // The worker may be waiting on the transport for the live transfers.
        self.abort.wake();
        Request { slot, driver, held }
    }

    /// Start the worker thread if it is not running; false if no thread can be started.
    fn start_worker(&self) -> bool {
        let mut worker = lock(&self.worker);
        if worker.is_some() {
            return true;
        }
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name(format!("chorus-queue-r{}", self.rank))
            .spawn(move || work(&shared));
        match spawned {
            Ok(h) => {
                lock(&self.shared.jobs).worker = Some(h.thread().id());
                *worker = Some(h);
                true
            }
            Err(e) => {
                crate::log::log(
                    crate::log::Level::Warn,
                    Some(self.rank),
                    format_args!("could not start the queue's thread ({e}); calls run at once"),
                );
                false
            }
        }
    }

    /// Wait until every call issued before this one has finished (calls issued meanwhile by
    /// other threads are not waited for; nor are live point-to-point transfers, which have
    /// requests of their own). Panics on the queue's own thread, where it would wait for
    /// itself, and inside a blocking call on this queue ([`Queue::run`]) when there is
    /// something to wait for: the call holds the communicator the others need.
    pub fn wait_all(&self) {
        if self.shared.process.check("queued call", self.rank).is_err() {
            // The calls in flight at the fork ran in the parent; none will finish here.
            return;
        }
        let mut jobs = lock(&self.shared.jobs);
        assert!(
            jobs.worker != Some(std::thread::current().id()),
            "a call on a chorus Queue's thread waited for that queue (it would wait for itself)"
        );
        let ticket = jobs.issued;
        // Also while the worker leaves transfers that have all finished: it may still hold
        // the communicator for a moment.
        let pending =
            |jobs: &Jobs| jobs.finished < ticket || (jobs.driving && self.transfers() == 0);
        if pending(&jobs) && self.in_own_call() {
            drop(jobs);
            panic!(
                "Queue::wait_all inside a blocking call on the same chorus Queue (Queue::run) \
                 would wait for calls that need the communicator that call holds"
            );
        }
        while pending(&jobs) {
            jobs.waiting_all += 1;
            jobs = self
                .shared
                .changed
                .wait(jobs)
                .unwrap_or_else(|p| p.into_inner());
            jobs.waiting_all -= 1;
        }
    }
    /// Run `f` on this thread after every call issued before it (a blocking call, in order).
    /// Refused (`InvalidUsage`) inside another blocking call on this queue: `f` is given the
    /// communicator to make its calls on.
    ///
    /// A panic in `f` aborts the communicator (its state is unknown) and goes on.
    pub fn run<T>(
        &self,
        f: impl FnOnce(&mut Communicator) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        // In a forked child the lock may have been held by the parent's worker at the fork.
        self.shared.process.check("queued call", self.rank)?;
        if self.in_own_call() {
            return Err(CommError::new(
                ErrorKind::InvalidUsage,
                "call",
                "a blocking call on a chorus Queue inside another on the same queue (Queue::run), \
                 which holds the communicator; make the call on the communicator the closure is \
                 given",
            )
            .at_rank(self.rank));
        }
        self.calls_allowed("call")?;
        self.wait_all();
        self.settle_transfers("call")?;
        self.in_call(|| {
            guarded(lock_comm(&self.shared.comm), |c| {
                self.settle_skips(c);
                f(c)
            })
        })
    }

    /// This queue's identity in `IN_CALL` and in its requests: the address of its state.
    fn id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    /// Whether this thread is inside a blocking call of this queue (see `IN_CALL`).
    fn in_own_call(&self) -> bool {
        in_call_on(self.id())
    }

    /// Run `f` marked as inside a call of this queue (see `IN_CALL`).
    fn in_call<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore;
        impl Drop for Restore {
            fn drop(&mut self) {
                let _ = IN_CALL.try_with(|c| c.borrow_mut().pop());
            }
        }
        let id = self.id();
        let _ = IN_CALL.try_with(|c| c.borrow_mut().push(id));
        let _restore = Restore;
        f()
    }

    /// As [`Queue::run`], but refusing (`None`) instead of waiting when another thread is in a
    /// blocking call on the communicator, inside a blocking call on this queue, while the
    /// caller holds transfer requests ([`Queue::calls_allowed`]), or in a forked child.
    /// Transfers given up are waited for, as by [`Queue::run`]. A panic in `f` aborts the communicator (its state is unknown)
    /// and goes on.
    pub fn try_run<T>(&self, f: impl FnOnce(&mut Communicator) -> T) -> Option<T> {
        if self.check_process().is_err()
            || self.in_own_call()
            || self.calls_allowed("call").is_err()
        {
            return None;
        }
        self.wait_all();
        self.settle_transfers("call").ok()?;
        self.try_now(|c| {
            self.settle_skips(c);
            f(c)
        })
    }

    /// As [`Queue::try_run`], but without waiting for the calls issued before: `None` also
    /// while one of them runs. For what must not wait, such as [`Communicator::abort`]. It
    /// does not apply the transfer rules either ([`Queue::calls_allowed`]): a collective run
    /// through it while transfers are live may fail, stuck behind them.
    pub fn try_now<T>(&self, f: impl FnOnce(&mut Communicator) -> T) -> Option<T> {
        let guard = try_lock_comm(&self.shared.comm)?;
        Some(self.in_call(|| guarded(guard, f)))
    }

    /// Wait for every call issued, stop the thread and hand back the communicator.
    ///
    /// Panics on the queue's own thread.
    pub fn into_inner(self) -> Communicator {
        if let Err(e) = self.check_process() {
            panic!("Queue::into_inner in a forked child: {e}");
        }
        self.wait_all();
        self.close();
        let mut shared = Arc::clone(&self.shared);
        drop(self);
        // The worker has been joined and the queue is gone; a thread that waited for a
        // transfer may still hold the state for a moment after its transfer finished.
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            match Arc::try_unwrap(shared) {
                Ok(s) => {
                    let n = take_skips(&mut lock(&s.jobs), u64::MAX);
                    let mut comm = s.comm.into_inner().unwrap_or_else(|p| p.into_inner());
                    // (Here rather than at its next call, which the queue no longer sees.)
                    skip_calls(&mut comm, n);
                    return comm;
                }
                Err(back) if Instant::now() < end => {
                    shared = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => panic!("the queue's state is still held 60 s after its thread ended"),
            }
        }
    }

    /// Wait for every call, then end the worker thread. On the worker itself (a call that
    /// held the last reference to the queue) the thread ends after the calls still queued,
    /// unjoined.
    fn close(&self) {
        if self.shared.process.check("queued call", self.rank).is_err() {
            // The worker is the parent's: nothing to wait for or join here (and its lock may
            // have been held by a parent's thread at the fork).
            if let Ok(mut w) = self.worker.try_lock() {
                if let Some(h) = w.take() {
                    std::mem::forget(h);
                }
            }
            return;
        }
        let on_worker = lock(&self.shared.jobs).worker == Some(std::thread::current().id());
        if !on_worker {
            self.wait_all();
        }
        lock(&self.shared.jobs).closing = true;
        self.shared.changed.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            if !on_worker {
                // A worker's panic is caught per call; a join error cannot carry anything new.
                let _ = h.join();
            }
        }
    }

    /// Issue an allreduce of `buf` (see [`Communicator::all_reduce`]); the request hands the
    /// buffer back reduced.
    pub fn all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Request<Vec<T>> {
        self.submit_collective(move |c| c.all_reduce(&mut buf, op).map(|()| buf))
    }

    /// Issue a broadcast of `buf` from `root` (see [`Communicator::broadcast`]).
    pub fn broadcast<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Request<Vec<T>> {
        self.submit_collective(move |c| c.broadcast(&mut buf, root).map(|()| buf))
    }

    /// Issue a reduce of `buf` to `root` (see [`Communicator::reduce`]); `root`'s buffer comes
    /// back reduced, the others' as they were.
    pub fn reduce<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Request<Vec<T>> {
        self.submit_collective(move |c| c.reduce(None, &mut buf, op, root).map(|()| buf))
    }

    /// Issue an allgather of `send`: the request gives every rank's block, rank `j`'s at
    /// `j × send.len()` (see [`Communicator::all_gather`]).
    pub fn all_gather<T: Element>(&self, send: Vec<T>) -> Request<Vec<T>> {
        let p = self.size;
        self.submit_collective(move |c| {
            // Refused rather than a panic (overflow) or the end of the process (no memory).
            let n = send.len().checked_mul(p).filter(|&n| {
                n.checked_mul(std::mem::size_of::<T>())
                    .is_some_and(|b| b <= isize::MAX as usize)
            });
            let mut recv = Vec::new();
            if !n.is_some_and(|n| recv.try_reserve_exact(n).is_ok()) {
                c.check_usable("all_gather")?;
                // As the call's own refusals: the comparison of calls hears of it.
                let call = Call::new("all_gather", CollKind::AllGather, T::DTYPE, ReduceOp::Sum);
                return c.refusable(call, |c| {
                    Err(CommError::invalid(
                        "all_gather",
                        format!(
                            "cannot allocate the result: {} elements from each of {p} ranks",
                            send.len()
                        ),
                    )
                    .at_rank(c.rank()))
                });
            }
            recv.resize(n.unwrap_or(0), T::from_f64(0.0));
            c.all_gather(&send, &mut recv).map(|()| recv)
        })
    }

    /// Issue a reduce-scatter of `send` (p blocks): the request gives this rank's block of the
    /// reduction (see [`Communicator::reduce_scatter`]).
    pub fn reduce_scatter<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Request<Vec<T>> {
        let p = self.size;
        self.submit_collective(move |c| {
            // A length that does not split into p blocks is refused by the call itself.
            let mut recv = vec![T::from_f64(0.0); send.len() / p];
            c.reduce_scatter(&send, &mut recv, op).map(|()| recv)
        })
    }

    /// Issue an all-to-all on `buf` (p blocks; see [`Communicator::all_to_all`]).
    pub fn all_to_all<T: Element>(&self, mut buf: Vec<T>) -> Request<Vec<T>> {
        self.submit_collective(move |c| c.all_to_all_in_place(&mut buf).map(|()| buf))
    }

    /// Issue a barrier.
    pub fn barrier(&self) -> Request<()> {
        self.submit_collective(|c| c.barrier())
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.close();
    }
}

/// Lock the communicator. A poisoned lock cannot happen (calls run under `catch_unwind` while
/// they hold it, see [`guarded`]), but would be taken as it is: the communicator reports its
/// own state.
fn lock_comm(m: &Mutex<Communicator>) -> MutexGuard<'_, Communicator> {
    lock(m)
}

/// [`lock_comm`] without waiting: `None` while another thread holds the communicator.
fn try_lock_comm(m: &Mutex<Communicator>) -> Option<MutexGuard<'_, Communicator>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Run `f` on the locked communicator. A panic leaves the communicator's state unknown: it is
/// aborted, the lock released unpoisoned, and the panic goes on.
fn guarded<T>(
    mut guard: MutexGuard<'_, Communicator>,
    f: impl FnOnce(&mut Communicator) -> T,
) -> T {
    match catch_unwind(AssertUnwindSafe(|| f(&mut guard))) {
        Ok(r) => {
            // An abort requested after the call's last wait: the peers are told now.
            guard.settle_abort();
            r
        }
        Err(panic) => {
            guard.abort("internal error in a call");
            drop(guard);
            std::panic::resume_unwind(panic)
        }
    }
}

/// The text of a panic payload.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

/// The worker: run queued calls in order until the queue closes.
fn work(shared: &Shared) {
    RUNNING_QUEUE.with(|q| q.set(shared as *const Shared as usize));
    let mut last_transfer = Instant::now()
        .checked_sub(STAY_AWAKE)
        .unwrap_or_else(Instant::now);
    loop {
        let mut jobs = lock(&shared.jobs);
        jobs.busy = false;
        let item = loop {
            let transfer_next = matches!(jobs.queue.front(), Some(Item::P2p(_)));
            if !(transfer_next && jobs.driving) {
                if let Some(item) = jobs.queue.pop_front() {
                    jobs.busy = true;
                    break Some(item);
                }
            }
            if !jobs.driving {
                let due = jobs
                    .unattended
                    .is_some_and(|since| since.elapsed() >= GRACE)
                    || jobs.unmatched_due.is_some_and(|t| t <= Instant::now());
                // Closing: every live transfer is finished first.
                if due || (jobs.closing && jobs.live) {
                    jobs.busy = true;
                    break None;
                }
                if jobs.closing && jobs.queue.is_empty() {
                    drop(jobs);
                    // Transfers to itself still missing their other half never will have it.
                    let mut comm = lock_comm(&shared.comm);
                    let mut engine = lock(&shared.engine);
                    let _ = catch_unwind(AssertUnwindSafe(|| engine.drop_unmatched(&mut comm)));
                    return;
                }
            }
            if shared.transfers.load(Ordering::SeqCst) > 0 {
                last_transfer = Instant::now();
            }
            // Looking every GRACE for a while after the last transfer, so that a program
            // that issues transfers in a loop does not wake it each time.
            if last_transfer.elapsed() < STAY_AWAKE {
                jobs = shared
                    .changed
                    .wait_timeout(jobs, GRACE)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            } else {
                jobs.napping = true;
                jobs = shared.changed.wait(jobs).unwrap_or_else(|p| p.into_inner());
                jobs.napping = false;
            }
        };
        let first = match item {
            Some(Item::Call(job)) => Ok(job),
            Some(Item::P2p(entry)) => Err(Some(entry)),
            None => Err(None),
        };
        let (job, skips) = match first {
            Ok(job) => {
                // Transfers whose requests were given up may still be posted: they finish
                // first (a call cannot run behind them on the transport). Those issued after
                // the call stay queued; transfers to itself do not use the transport.
                loop {
                    if !jobs.driving && jobs.live {
                        jobs.driving = true;
                        jobs.unattended = None;
                        drop(jobs);
                        drive(shared, lock_comm(&shared.comm), None, Drive::Posted, None);
                        jobs = lock(&shared.jobs);
                        continue;
                    }
                    if !jobs.driving && !jobs.live {
                        break;
                    }
                    jobs = shared
                        .changed
                        .wait_timeout(jobs, GRACE)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                // The refused collectives issued after the calls before this one.
                let done = jobs.finished;
                let skips = take_skips(&mut jobs, done);
                drop(jobs);
                (job, skips)
            }
            Err(first) => {
                jobs.driving = true;
                jobs.unattended = None;
                drop(jobs);
                drive(
                    shared,
                    lock_comm(&shared.comm),
                    first,
                    Drive::ToTheEnd,
                    None,
                );
                continue;
            }
        };
        {
            let mut comm = lock_comm(&shared.comm);
            // The job fills its request whatever happens in the call; this keeps the worker
            // (and the count of finished calls) going even if telling the peers panics.
            let mut answered = false;
            let mut answer = || {
                if !std::mem::replace(&mut answered, true) {
                    shared.answered.fetch_add(1, Ordering::SeqCst);
                }
            };
            let _ = catch_unwind(AssertUnwindSafe(|| {
                skip_calls(&mut comm, skips);
                job(&mut comm, &mut answer);
                // An abort requested after the call's last wait: the peers are told now.
                comm.settle_abort();
            }));
            answer();
        }
        lock(&shared.jobs).finished += 1;
        shared.changed.notify_all();
    }
}

/// Takes the refused collectives due before a call that `finished` calls precede (those
/// refused after at most `finished` calls were issued): how many.
fn take_skips(jobs: &mut Jobs, finished: u64) -> usize {
    let n = jobs.skips.iter().take_while(|&&at| at <= finished).count();
    jobs.skips.drain(..n);
    n
}

/// Uses up `n` refused collectives' places on `comm` ([`Communicator::skip_refused_call`]).
fn skip_calls(comm: &mut Communicator, n: usize) {
    for _ in 0..n {
        comm.skip_refused_call();
    }
}

/// After a panic while transfers were progressed, their state is unknown: abort the
/// communicator and fail every transfer held (its later calls fail saying why).
fn abandon(comm: &mut Communicator, engine: &mut p2p::Engine) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        comm.abort("internal error in a point-to-point transfer")
    }));
    let _ = catch_unwind(AssertUnwindSafe(|| engine.abandon(comm)));
}

/// How far [`drive`] goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Drive {
    /// Post, and push a send without blocking (a thread issuing a transfer).
    Step,
    /// One slice (a thread waiting for a transfer).
    Slice,
    /// One step without blocking over every live transfer (a thread testing one).
    Peek,
    /// Until no transfer is live (the worker).
    ToTheEnd,
    /// Until none of the transfers already posted is live, posting none of those queued (the
    /// worker before a call: transfers issued after the call wait for it).
    Posted,
}

/// Progress transfers as the thread that set `jobs.driving` (and now holds `comm`): post
/// `first` and every transfer at the head of the queue, then move bytes, with every live
/// transfer. The worker (`to_the_end`) goes on until none is live; another thread makes one
/// step without blocking (issuing) or one slice (waiting), and leaves what is still live
/// unattended (the worker takes it over after [`GRACE`] unless a waiting thread does).
/// Clears `driving` when done.
fn drive(
    shared: &Shared,
    mut comm: MutexGuard<'_, Communicator>,
    first: Option<p2p::Entry>,
    how: Drive,
    end: Option<Instant>,
) {
    let to_the_end = matches!(how, Drive::ToTheEnd | Drive::Posted);
    let take_queued = how != Drive::Posted;
    let queued = || {
        if take_queued {
            next_transfer(shared)
        } else {
            None
        }
    };
    let mut engine = lock(&shared.engine);
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut next = first.or_else(queued);
        loop {
            while let Some(e) = next.take() {
                engine.admit(&mut comm, e);
                next = queued();
            }
            match how {
                Drive::Step => engine.push_last_send(&mut comm),
                Drive::Peek => engine.step(&mut comm, false, end),
                Drive::Slice | Drive::ToTheEnd | Drive::Posted => engine.step(&mut comm, true, end),
            }
            if !to_the_end || !engine.has_live() {
                // Transfers to itself time out like the others.
                engine.expire_unmatched(&mut comm);
                return;
            }
            next = queued();
        }
    }));
    if r.is_err() {
        abandon(&mut comm, &mut engine);
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        comm.settle_abort();
        // An abort (noticed now, or earlier): transfers to itself fail instead of waiting
        // out the timeout for a half that can no longer be issued.
        engine.fail_unmatched_if_broken(&mut comm);
    }));
    let live = engine.has_live();
    let unmatched_due = engine.unmatched_due(comm.config().timeout);
    drop(engine);
    drop(comm);
    let mut jobs = lock(&shared.jobs);
    jobs.driving = false;
    jobs.live = live;
    jobs.unmatched_due = unmatched_due;
    // A waiting thread goes on driving after its slice: it leaves the transfers unattended
    // only when it stops waiting (`drive_until`).
    let leave = live && how != Drive::Slice;
    if !live {
        jobs.unattended = None;
    } else if leave && jobs.unattended.is_none() {
        jobs.unattended = Some(Instant::now());
    }
    // Wake the worker (and `wait_all`) only when there is something for them: waking it at
    // every step costs a context switch each. It looks at unattended transfers every
    // `GRACE` by itself, unless it sleeps.
    // A transfer to this rank itself waiting for its other half is not live, but the worker
    // must be awake to fail it when due, should nobody wait for it.
    let wake = ((leave || unmatched_due.is_some()) && jobs.napping)
        || !jobs.queue.is_empty()
        || (jobs.waiting_all > 0 && !live);
    drop(jobs);
    if wake {
        shared.changed.notify_all();
    }
}

/// As a thread waiting for a transfer (`slot`) until `end`: progress every transfer while no
/// other thread does (the worker is busy with nothing, and no call is queued ahead), else
/// sleep on the request for a while; whether it finished.
fn drive_until<T>(shared: &Shared, slot: &Slot<T>, end: Option<Instant>) -> bool {
    let done = |finished: bool| {
        // Stopping: what this thread drove and left live is now unattended.
        let mut jobs = lock(&shared.jobs);
        if !jobs.driving && (jobs.live || jobs.unmatched_due.is_some()) {
            if jobs.live {
                jobs.unattended.get_or_insert_with(Instant::now);
            }
            // (A transfer to itself waiting for its other half needs the worker awake too,
            // to fail it when due.)
            if jobs.napping {
                drop(jobs);
                shared.changed.notify_all();
            }
        }
        finished
    };
    loop {
        if lock(&slot.value).is_some() {
            return done(true);
        }
        let now = Instant::now();
        if end.is_some_and(|e| now >= e) {
            return done(false);
        }
        let mut jobs = lock(&shared.jobs);
        // A transfer to itself waits for its other half, which an abort means will never
        // come: drive, which fails it.
        let aborted = shared.abort.is_requested()
            && jobs.unmatched_due.is_some()
            && !jobs.driving
            && !jobs.busy;
        if jobs.free_to_drive(now) || aborted {
            // Never blocks on the communicator (as `peek`): a blocking call of another thread
            // (`Queue::run`) may hold it for as long as that call lasts, past this wait's end.
            if let Some(comm) = try_lock_comm(&shared.comm) {
                jobs.driving = true;
                jobs.unattended = None;
                drop(jobs);
                drive(shared, comm, None, Drive::Slice, end);
                continue;
            }
        }
        // Someone else drives, or holds the communicator, or nothing is posted (a transfer to
        // this rank itself waits for its other half): sleep on the request for a while.
        drop(jobs);
        let nap = Duration::from_millis(1).min(end.map_or(Duration::MAX, |e| e - now));
        let value = lock(&slot.value);
        if value.is_none() {
            let _ = slot.done.wait_timeout(value, nap);
        }
    }
}

/// As a thread testing a transfer: one step without blocking over every transfer, when no
/// other thread progresses them (see [`drive_until`]).
fn peek(shared: &Shared) {
    let mut jobs = lock(&shared.jobs);
    if !jobs.free_to_drive(Instant::now()) {
        return;
    }
    // Never blocks on the communicator: a blocking call of another thread may hold it.
    let Some(comm) = try_lock_comm(&shared.comm) else {
        return;
    };
    jobs.driving = true;
    drop(jobs);
    drive(shared, comm, None, Drive::Peek, None);
}

/// The transfer at the head of the queue, if one is, and if the calls issued before it have
/// ended: none for a thread other than the worker while the worker runs an item it took (a
/// call issued before the head, which another thread's drive, started before the call was
/// taken, must not overtake).
fn next_transfer(shared: &Shared) -> Option<p2p::Entry> {
    let mut jobs = lock(&shared.jobs);
    if jobs.busy && jobs.worker != Some(std::thread::current().id()) {
        return None;
    }
    match jobs.queue.front() {
        Some(Item::P2p(_)) => match jobs.queue.pop_front() {
            Some(Item::P2p(e)) => Some(e),
            _ => unreachable!("the head was a transfer"),
        },
        _ => None,
    }
}

/// A transfer's buffer and request, as its type knows them.
trait Holds<B>: p2p::Transfer {
    fn slot(&self) -> &Arc<Slot<B>>;
}

/// An `isend`'s buffer, held until the transfer finishes.
struct Sending<B> {
    buf: Option<B>,
    slot: Arc<Slot<B>>,
}

/// An `irecv`'s buffer.
struct Receiving<B> {
    buf: Option<B>,
    slot: Arc<Slot<B>>,
}

impl<B: SendBuffer> p2p::Transfer for Sending<B> {
    fn buf(&mut self) -> p2p::Buf<'_> {
        p2p::Buf::Send(self.buf.as_ref().expect("held until finished").send_bytes())
    }
    fn is_send(&self) -> bool {
        true
    }
    fn byte_len(&self) -> usize {
        self.buf.as_ref().expect("held until finished").send_len()
    }
    fn finish(
        mut self: Box<Self>,
        result: Result<(), CommError>,
        comm: &mut Communicator,
        answered: &mut dyn FnMut(),
    ) {
        let buf = self.buf.take().expect("finished once");
        self.slot.fill(with_buffer(result, buf), comm, answered);
    }
}

/// A finished transfer's result: its buffer, or its error, the buffer dropped then. A buffer
/// whose drop panics does not keep the error from its request (a wait that would never end):
/// the panic is caught and said in the error.
fn with_buffer<B>(result: Result<(), CommError>, buf: B) -> Result<B, CommError> {
    match result {
        Ok(()) => Ok(buf),
        Err(e) if dropped_cleanly(buf) => Err(e),
        Err(e) => Err(e.with_detail(" (and its buffer panicked when dropped)")),
    }
}

/// Drops a transfer's buffer, catching a panic of its `Drop`: false if it panicked.
fn dropped_cleanly<B>(buf: B) -> bool {
    catch_unwind(AssertUnwindSafe(move || drop(buf))).is_ok()
}

impl<B: SendBuffer> Holds<B> for Sending<B> {
    fn slot(&self) -> &Arc<Slot<B>> {
        &self.slot
    }
}

impl<B: RecvBuffer> p2p::Transfer for Receiving<B> {
    fn buf(&mut self) -> p2p::Buf<'_> {
        p2p::Buf::Recv(self.buf.as_mut().expect("held until finished").recv_bytes())
    }
    fn is_send(&self) -> bool {
        false
    }
    fn byte_len(&self) -> usize {
        self.buf.as_ref().expect("held until finished").recv_len()
    }
    fn finish(
        mut self: Box<Self>,
        result: Result<(), CommError>,
        comm: &mut Communicator,
        answered: &mut dyn FnMut(),
    ) {
        let buf = self.buf.take().expect("finished once");
        self.slot.fill(with_buffer(result, buf), comm, answered);
    }
}

impl<B: RecvBuffer> Holds<B> for Receiving<B> {
    fn slot(&self) -> &Arc<Slot<B>> {
        &self.slot
    }
}

struct Slot<T> {
    value: Mutex<Option<Result<T, CommError>>>,
    done: Condvar,
    /// The process that issued the call, and the rank.
    process: Process,
    rank: usize,
    /// The queue it was issued on (the address of its `Shared`).
    queue: usize,
    /// Given up ([`Request::detach`]): the worker drops the result (set and read under the
    /// `value` lock).
    detached: AtomicBool,
}

impl<T> Slot<T> {
    /// Give the request its result (on the worker). A request given up whose call failed
    /// aborts the communicator: nothing else would report it, and the peers' part of that call
    /// may be left unmatched.
    ///
    /// `answered` is called once the result is as good as handed over: under the request's
    /// lock just before it is stored (a thread that then sees [`Queue::pending`] without the
    /// call finds the result there), or, for a request given up, after the abort.
    fn fill(
        &self,
        result: Result<T, CommError>,
        comm: &mut Communicator,
        answered: &mut dyn FnMut(),
    ) {
        let mut value = lock(&self.value);
        if self.detached.load(Ordering::SeqCst) {
            drop(value);
            // The result (a buffer, with what it holds) goes before `answered`; a buffer that
            // panics when dropped is said, as when its transfer fails (`with_buffer`), and
            // does not take the communicator down.
            let result = result.map(|buf| {
                if !dropped_cleanly(buf) {
                    crate::log::log(
                        crate::log::Level::Warn,
                        Some(self.rank),
                        format_args!(
                            "the buffer of a transfer whose request was given up panicked \
                             when dropped"
                        ),
                    );
                }
            });
            if let Err(e) = result {
                let why = format!(
                    "a call whose request was given up failed: {} ({}): {}",
                    e.op(),
                    e.kind().as_str(),
                    e.message()
                );
                crate::log::log(
                    crate::log::Level::Warn,
                    Some(self.rank),
                    format_args!("{why}"),
                );
                if comm.is_unbroken() {
                    comm.abort(&why);
                }
            }
            answered();
        } else {
            answered();
            *value = Some(result);
            drop(value);
            self.done.notify_all();
        }
    }

    /// An error when waiting would never end: in a forked child, or on the queue's own thread
    /// (a later call, which cannot run before the current one ends).
    fn unwaitable(&self) -> Result<(), CommError> {
        self.process.check("queued call", self.rank)?;
        if in_call_on(self.queue) {
            return Err(CommError::new(
                ErrorKind::InvalidUsage,
                "queued call",
                "waited for a request of a chorus Queue inside a blocking call on that queue \
                 (Queue::run), which holds the communicator the request needs",
            )
            .at_rank(self.rank));
        }
        if RUNNING_QUEUE.with(|q| q.get()) == self.queue {
            return Err(CommError::new(
                ErrorKind::Internal,
                "queued call",
                "a call on a chorus Queue's thread waited for a later request of that queue (it \
                 would wait for itself)",
            )
            .at_rank(self.rank));
        }
        Ok(())
    }
}

/// Waits for a request's call to finish without holding the request ([`Request::waiter`]).
pub struct RequestWaiter<T> {
    slot: Arc<Slot<T>>,
    driver: Option<std::sync::Weak<Shared>>,
}

impl<T> RequestWaiter<T> {
    /// As [`Request::wait_done`].
    pub fn wait_done(&self, limit: Duration) -> bool {
        wait_done_on(&self.slot, self.driver.as_ref(), limit)
    }

    /// As [`Request::test`].
    pub fn test(&self) -> bool {
        test_on(&self.slot, self.driver.as_ref())
    }
}

/// [`Request::test`] of the request whose slot is `slot` (and, for a transfer, whose queue is
/// `driver`).
fn test_on<T>(slot: &Slot<T>, driver: Option<&std::sync::Weak<Shared>>) -> bool {
    // In a forked child it is as done as it will get: `wait` gives the error.
    if slot.process.check("queued call", slot.rank).is_err() || lock(&slot.value).is_some() {
        return true;
    }
    if slot.unwaitable().is_ok() {
        if let Some(shared) = driver.and_then(std::sync::Weak::upgrade) {
            peek(&shared);
        }
    }
    lock(&slot.value).is_some()
}

/// [`Request::wait_done`] of the request whose slot is `slot` (and, for a transfer, whose
/// queue is `driver`).
fn wait_done_on<T>(
    slot: &Slot<T>,
    driver: Option<&std::sync::Weak<Shared>>,
    limit: Duration,
) -> bool {
    if slot.process.check("queued call", slot.rank).is_err() {
        return true;
    }
    let end = chorus_transport::deadline_after(limit);
    if lock(&slot.value).is_some() || slot.unwaitable().is_err() {
        return true;
    }
    if let Some(shared) = driver.and_then(std::sync::Weak::upgrade) {
        drive_until(&shared, slot, Some(end));
    }
    let mut value = lock(&slot.value);
    loop {
        if value.is_some() || slot.unwaitable().is_err() {
            return true;
        }
        let now = Instant::now();
        if now >= end {
            return false;
        }
        value = slot
            .done
            .wait_timeout(value, end - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// The result of a call issued on a [`Queue`], to come. Dropping it does not cancel the call.
#[must_use = "a request's result (and error) is only seen through wait"]
pub struct Request<T> {
    slot: Arc<Slot<T>>,
    /// For a transfer: its queue, whose transfers a thread waiting for it progresses.
    driver: Option<std::sync::Weak<Shared>>,
    /// For a transfer: the queue's count of requests the caller holds, counted out when this
    /// one is waited for, given up or dropped.
    held: Option<Arc<AtomicUsize>>,
}

impl<T> Drop for Request<T> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            held.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl<T> Request<T> {
    /// Whether the call has finished (its result is ready for [`Request::wait`]).
    ///
    /// For a transfer not yet finished, it first moves what the transport has without
    /// blocking, for every transfer of the queue, as `MPI_Test` does (unless another thread
    /// is progressing them).
    pub fn test(&self) -> bool {
        test_on(&self.slot, self.driver.as_ref())
    }

    /// Give the request up without waiting (as `MPI_Request_free`): the result of the call if
    /// it has finished; otherwise `None`, and the call goes on, its result dropped. Should it
    /// then fail, the communicator is aborted (the peers told), since nothing else would
    /// report the failure, and this rank's next call fails saying why; this holds even for an
    /// error that leaves the communicator usable (an argument error, which may have left the
    /// peers' part of that call unmatched). In a forked child it returns `None` at once. Dropping
    /// a request instead leaves a failure unreported.
    pub fn detach(self) -> Option<Result<T, CommError>> {
        if self
            .slot
            .process
            .check("queued call", self.slot.rank)
            .is_err()
        {
            // A forked child: the parent's worker may have held the lock at the fork.
            return None;
        }
        let mut value = lock(&self.slot.value);
        self.slot.detached.store(true, Ordering::SeqCst);
        value.take()
    }

    /// Wait for the call and take its result. For a transfer, this thread progresses the
    /// queue's transfers meanwhile, unless another thread does. Refused where waiting would
    /// never end (inside [`Queue::run`] on its queue, on the queue's own thread for a later
    /// call, in a forked child): the call then goes on as given up ([`Request::detach`]).
    pub fn wait(self) -> Result<T, CommError> {
        // First: in a forked child the parent's worker may have held the lock at the fork.
        self.slot.process.check("queued call", self.slot.rank)?;
        if let Some(r) = lock(&self.slot.value).take() {
            return r;
        }
        if let Err(e) = self.slot.unwaitable() {
            return self.refused(e);
        }
        self.drive_until(None);
        let mut value = lock(&self.slot.value);
        loop {
            if let Some(r) = value.take() {
                return r;
            }
            if let Err(e) = self.slot.unwaitable() {
                drop(value);
                return self.refused(e);
            }
            value = self
                .slot
                .done
                .wait(value)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// A wait refused with `e` (the request cannot be waited for here): the result if it came
    /// meanwhile; else `e`, and the call goes on as given up ([`Request::detach`]), so that a
    /// failure of it is still reported.
    fn refused(&self, e: CommError) -> Result<T, CommError> {
        let mut value = lock(&self.slot.value);
        if let Some(r) = value.take() {
            return r;
        }
        self.slot.detached.store(true, Ordering::SeqCst);
        Err(e)
    }

    /// Wait up to `limit` for the call to finish, without taking its result: whether it has
    /// (then [`Request::wait`] returns at once), or cannot be waited for here (inside
    /// [`Queue::run`] on its queue: then [`Request::wait`] returns that error at once).
    pub fn wait_done(&self, limit: Duration) -> bool {
        wait_done_on(&self.slot, self.driver.as_ref(), limit)
    }

    /// [`Request::wait_done`] apart from the request: the waiter keeps what it needs alive,
    /// so it may be called after the request was dropped or waited for elsewhere (on another
    /// thread, say); it then returns by `limit` as for any request.
    pub fn waiter(&self) -> RequestWaiter<T> {
        RequestWaiter {
            slot: Arc::clone(&self.slot),
            driver: self.driver.clone(),
        }
    }

    /// For a transfer: progress its queue's transfers until it finishes or `end`.
    fn drive_until(&self, end: Option<Instant>) {
        if let Some(shared) = self.driver.as_ref().and_then(std::sync::Weak::upgrade) {
            drive_until(&shared, &self.slot, end);
        }
    }

    /// Wait up to `limit` for the call: its result, or the request back if it is still running
    /// (where it cannot be waited for, the error [`Request::wait`] gives).
    pub fn wait_timeout(self, limit: Duration) -> Result<Result<T, CommError>, Request<T>> {
        if self.wait_done(limit) {
            // Finished (or never to finish here: `wait` says why), so this does not block.
            Ok(self.wait())
        } else {
            Err(self)
        }
    }
}
