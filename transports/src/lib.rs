//! Moving bytes between the ranks of a fully connected group.
//!
//! This crate knows nothing of dtypes or collectives. It offers:
//!
//! - the [`Transport`] trait: tagged, ordered, byte-oriented point-to-point messages with
//!   non-blocking progress and a deadline on every wait;
//! - [`tcp::TcpTransport`], the TCP implementation (socket2 + mio);
//! - [`shm::ShmTransport`], shared memory between the ranks of one host, and
//!   [`hybrid::HybridTransport`], which routes each peer to one of the two;
//! - [`rendezvous`]: the key-value store, authentication and address exchange that build a
//!   full mesh of connections;
//! - [`frame`]: the wire header every data message carries;
//! - `rdma` (cargo feature `rdma`, on by default): the RDMA device probe, protocol layer and a
//!   transport over a NIC trait, tested on an emulated NIC (no NIC over real verbs yet: a
//!   communicator that asks for RDMA falls back to TCP and says why).
//!
//! # The request model
//!
//! A [`Request`] describes one send or receive (peer, tag, length) and keeps its progress; it
//! does **not** hold the buffer. The buffer is handed over again, as an [`Op`], at every call to
//! [`Transport::progress`]. Between calls the caller owns its memory completely, so an algorithm
//! can reduce the bytes that have already arrived while the rest is still on the wire, and can
//! widen a send's [`Request::set_available`] limit as its input becomes ready.
//!
//! Messages between two ranks are matched in the order they were posted: the k-th receive
//! posted for peer `j` takes the k-th message `j` sent to this rank. The tag of that message must
//! equal the receive's tag, otherwise the receive fails with [`TransportError::Mismatch`]
//! (this is how collectives called in different orders on different ranks are detected).
//!
//! ```
//! use chorus_transport::{Request, Op, Transport};
//! # fn demo(t: &mut dyn Transport) -> Result<(), chorus_transport::TransportError> {
//! let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
//! let right = (t.rank() + 1) % t.size();
//! let left = (t.rank() + t.size() - 1) % t.size();
//! let out = [1u8; 16];
//! let mut inb = [0u8; 16];
//! let mut s = Request::send(right, 7, out.len());
//! let mut r = Request::recv(left, 7, inb.len());
//! t.post(&mut s)?;
//! t.post(&mut r)?;
//! t.wait_all(&mut [Op::send(&mut s, &out), Op::recv(&mut r, &mut inb)], deadline)?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod error;
pub mod frame;
pub mod hybrid;
pub mod ifaddr;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod rendezvous;
pub mod shm;
mod sweep;
pub mod tcp;

use std::fmt;
use std::time::{Duration, Instant};

pub use error::TransportError;
pub use shm::sys::fork_generation;

/// `from + d`, saturating about 136 years on where the sum does not fit an [`Instant`]: a
/// caller's `Duration::MAX` ("no limit") is a deadline never reached, not a panic.
pub fn deadline_from(from: Instant, d: Duration) -> Instant {
    from.checked_add(d)
        .or_else(|| from.checked_add(Duration::from_secs(1 << 32)))
        .unwrap_or(from)
}

/// [`deadline_from`] now: the deadline of a wait of `d`.
pub fn deadline_after(d: Duration) -> Instant {
    deadline_from(Instant::now(), d)
}

/// Writes `chorus: MSG` as one line to stderr, ignoring a stderr that is closed or broken
/// (`eprintln!` would panic, here inside a transport's acceptor and store threads).
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), "chorus: {}", format_args!($($arg)*));
    }};
}
pub(crate) use note;

/// Result type of this crate.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;

/// A message tag. Collectives encode the collective's sequence number and kind in it, so a
/// message from a different collective is detected rather than consumed.
pub type Tag = u64;

/// Whether a [`Request`] sends or receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Bytes go from this rank to the peer.
    Send,
    /// Bytes come from the peer to this rank.
    Recv,
}

/// One posted send or receive and its progress. The buffer is not stored here: it is passed
/// with every [`Transport::progress`] call inside an [`Op`].
#[derive(Clone, Debug)]
pub struct Request {
    dir: Direction,
    peer: usize,
    tag: Tag,
    /// Send: the message length. Receive: the capacity of the buffer.
    len: usize,
    /// Send: bytes of the payload the caller has made available (`<= len`).
    available: usize,
    /// Payload bytes moved so far.
    done: usize,
    /// Receive: the length announced by the message header, once it arrived.
    msg_len: Option<usize>,
    /// Position in the per-peer, per-direction order; set by [`Transport::post`].
    ticket: Option<u64>,
    complete: bool,
}

impl Request {
    /// A send of `len` bytes to `peer`, all available at once.
    pub fn send(peer: usize, tag: Tag, len: usize) -> Self {
        Self::new(Direction::Send, peer, tag, len, len)
    }

    /// A send of `len` bytes to `peer` of which only the first `available` may be read from the
    /// buffer so far; raise the limit with [`Request::set_available`].
    pub fn send_partial(peer: usize, tag: Tag, len: usize, available: usize) -> Self {
        Self::new(Direction::Send, peer, tag, len, available.min(len))
    }

    /// A receive of at most `capacity` bytes from `peer`.
    pub fn recv(peer: usize, tag: Tag, capacity: usize) -> Self {
        Self::new(Direction::Recv, peer, tag, capacity, 0)
    }

    fn new(dir: Direction, peer: usize, tag: Tag, len: usize, available: usize) -> Self {
        Request {
            dir,
            peer,
            tag,
            len,
            available,
            done: 0,
            msg_len: None,
            ticket: None,
            complete: false,
        }
    }

    /// Send or receive.
    pub fn direction(&self) -> Direction {
        self.dir
    }
    /// The peer rank.
    pub fn peer(&self) -> usize {
        self.peer
    }
    /// The tag.
    pub fn tag(&self) -> Tag {
        self.tag
    }
    /// Send: message length; receive: buffer capacity.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a zero-length request.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Payload bytes moved so far (for a receive: the prefix of the buffer that is valid).
    pub fn bytes_done(&self) -> usize {
        self.done
    }
    /// Receive: the length of the message, once its header arrived.
    pub fn message_len(&self) -> Option<usize> {
        self.msg_len
    }
    /// Whether the request finished.
    pub fn is_complete(&self) -> bool {
        self.complete
    }
    /// Whether [`Transport::post`] was called on it.
    pub fn is_posted(&self) -> bool {
        self.ticket.is_some()
    }
    /// Send: how many bytes the transport may read from the buffer so far.
    pub fn available(&self) -> usize {
        self.available
    }
    /// Send: allow the transport to read the first `bytes` bytes of the buffer (monotone;
    /// smaller values are ignored, larger ones clamped to the length).
    pub fn set_available(&mut self, bytes: usize) {
        self.available = self.available.max(bytes.min(self.len));
    }
    /// The ticket given at post time (transport-private).
    pub fn ticket(&self) -> Option<u64> {
        self.ticket
    }
    /// Set by transports at post time.
    pub fn set_ticket(&mut self, ticket: u64) {
        self.ticket = Some(ticket);
    }
    /// Record progress (for transport implementations).
    pub fn advance(&mut self, bytes: usize) {
        self.done += bytes;
        debug_assert!(self.done <= self.len);
    }
    /// Record the announced length of an incoming message (for transport implementations).
    pub fn set_message_len(&mut self, len: usize) {
        self.msg_len = Some(len);
    }
    /// Mark the request finished (for transport implementations).
    pub fn set_complete(&mut self) {
        self.complete = true;
    }
    /// The number of bytes this request still has to move, as far as known.
    pub fn remaining(&self) -> usize {
        match self.dir {
            Direction::Send => self.len - self.done,
            Direction::Recv => self.msg_len.unwrap_or(self.len) - self.done,
        }
    }
}

/// The buffer of a request, lent to the transport for one progress call.
#[derive(Debug)]
pub enum Buf<'b> {
    /// Source of a send; must be at least the request's length.
    Send(&'b [u8]),
    /// Destination of a receive; must be at least the request's capacity.
    Recv(&'b mut [u8]),
}

/// A request together with its buffer for one [`Transport::progress`] call.
#[derive(Debug)]
pub struct Op<'r, 'b> {
    /// The request.
    pub req: &'r mut Request,
    /// Its buffer.
    pub buf: Buf<'b>,
}

impl<'r, 'b> Op<'r, 'b> {
    /// A send request with its source buffer.
    pub fn send(req: &'r mut Request, buf: &'b [u8]) -> Self {
        Op {
            req,
            buf: Buf::Send(buf),
        }
    }
    /// A receive request with its destination buffer.
    pub fn recv(req: &'r mut Request, buf: &'b mut [u8]) -> Self {
        Op {
            req,
            buf: Buf::Recv(buf),
        }
    }
}

/// Refuses every call on a transport whose byte streams were lost earlier (`broken` says
/// why): the error the TCP, shared-memory and RDMA transports give after a fatal one.
pub(crate) fn check_usable(broken: &Option<String>) -> Result<()> {
    match broken {
        Some(why) => Err(TransportError::Aborted(why.clone())),
        None => Ok(()),
    }
}

/// The state a transport keeps for `peer` (`peers` has one entry per rank, `None` at this
/// rank's own), or the error for a peer that is not another rank of the group of `size` that
/// this rank, `rank`, belongs to: the lookup of the TCP and RDMA transports.
pub(crate) fn peer_entry<P>(
    peers: &mut [Option<P>],
    peer: usize,
    rank: usize,
    size: usize,
) -> Result<&mut P> {
    match peers.get_mut(peer) {
        Some(Some(p)) => Ok(p),
        _ => Err(TransportError::InvalidArgument(format!(
            "peer {peer} is not another rank of this group of {size} (this is rank {rank})"
        ))),
    }
}

/// What every transport's [`Transport::post`] checks first: the transport is usable
/// ([`check_usable`]) and the request was not posted before.
pub(crate) fn check_post(broken: &Option<String>, req: &Request) -> Result<()> {
    check_usable(broken)?;
    if req.is_posted() {
        return Err(TransportError::InvalidUsage(
            "request was already posted".into(),
        ));
    }
    Ok(())
}

/// Checks every transport does at the start of [`Transport::progress`]: each op was posted,
/// its buffer is at least the request's length, and a receive has a writable buffer.
pub fn check_ops(ops: &[Op<'_, '_>]) -> Result<()> {
    for op in ops {
        if !op.req.is_posted() {
            return Err(TransportError::InvalidUsage(
                "progress on a request that was not posted".into(),
            ));
        }
        let blen = match &op.buf {
            Buf::Send(b) => b.len(),
            Buf::Recv(b) => b.len(),
        };
        if blen < op.req.len() {
            return Err(TransportError::InvalidArgument(format!(
                "buffer of {blen} bytes for a request of {} bytes",
                op.req.len()
            )));
        }
        if matches!(
            (&op.buf, op.req.direction()),
            (Buf::Send(_), Direction::Recv)
        ) {
            return Err(TransportError::InvalidArgument(
                "a receive request needs a Buf::Recv buffer".into(),
            ));
        }
    }
    Ok(())
}

/// How long a [`Transport::progress`] call may block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Do what can be done without blocking and return.
    No,
    /// Block until at least one op moved bytes or completed, or every op is complete; fail with
    /// [`TransportError::Timeout`] at the deadline.
    Until(Instant),
    /// As [`Wait::Until`], but at the instant return `Ok(false)` instead of failing, and return
    /// early when woken through [`AbortHandle::wake`] (TCP; the others at the instant): for a
    /// progress loop that also has other things to look at, such as new requests to post.
    Poll(Instant),
}

impl Wait {
    /// The instant a blocking wait ends at, and whether it ends there without an error
    /// ([`Wait::Poll`]); `None` for [`Wait::No`].
    pub fn until(self) -> Option<(Instant, bool)> {
        match self {
            Wait::No => None,
            Wait::Until(d) => Some((d, false)),
            Wait::Poll(d) => Some((d, true)),
        }
    }
}

/// Why a rank gives up on a collective; sent to every peer by [`Transport::abort`] so that they
/// fail fast with an error naming the rank at fault instead of waiting for their timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortNotice {
    /// The rank whose loss or misbehaviour caused the abort, if known.
    pub culprit: Option<usize>,
    /// A one-line description.
    pub reason: String,
}

/// Asks a transport to abort from any thread, while a call may be running on it: the TCP and
/// shared-memory transports look at it whenever they wait (at once for TCP, within 10 ms for
/// shared memory), and then abort as [`Transport::abort`] does and fail the call with
/// [`TransportError::Aborted`]. A transport looks only at the handle installed with
/// [`Transport::set_abort_handle`]; clones share the request. The first notice requested wins.
#[derive(Clone, Default)]
pub struct AbortHandle {
    inner: std::sync::Arc<AbortShared>,
}

#[derive(Default)]
struct AbortShared {
    requested: std::sync::atomic::AtomicBool,
    /// A transport (or its owner) has aborted for the request: the peers were told.
    acted: std::sync::atomic::AtomicBool,
    notice: std::sync::Mutex<Option<AbortNotice>>,
    wakers: std::sync::Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl AbortHandle {
    /// A handle with nothing requested.
    pub fn new() -> AbortHandle {
        AbortHandle::default()
    }

    /// Request the abort (kept for good) and wake the transport if it is waiting.
    pub fn request(&self, notice: AbortNotice) {
        {
            let mut n = self.inner.notice.lock().unwrap_or_else(|p| p.into_inner());
            if n.is_none() {
                *n = Some(notice);
            }
        }
        self.inner
            .requested
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake();
    }

    /// Wake the transport from a [`Wait::Poll`] (without requesting anything): TCP returns
    /// from it at once; the other transports at its instant.
    pub fn wake(&self) {
        for wake in self
            .inner
            .wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            wake();
        }
    }

    /// Whether an abort was requested.
    pub fn is_requested(&self) -> bool {
        self.inner
            .requested
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether the transport has acted on the request (told the peers).
    pub fn acted(&self) -> bool {
        self.inner.acted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Record that the request was acted on: every peer has been told. For the transport's
    /// owner, after [`Transport::abort`] of the whole transport.
    #[doc(hidden)]
    pub fn mark_acted(&self) {
        self.inner
            .acted
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The notice requested, if any.
    pub fn requested(&self) -> Option<AbortNotice> {
        if !self.is_requested() {
            return None;
        }
        self.inner
            .notice
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Call `wake` on every request (a transport that sleeps in the kernel registers how to wake
    /// itself).
    pub(crate) fn add_waker(&self, wake: impl Fn() + Send + Sync + 'static) {
        self.inner
            .wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Box::new(wake));
    }
}

impl fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortHandle")
            .field("requested", &self.is_requested())
            .finish()
    }
}

/// The abort requested through `handle` (`AbortHandle::requested` of it; one atomic load
/// when none is), as this transport's error after `abort` has told the peers: what the
/// transports call where they wait.
pub(crate) fn requested_abort(
    requested: Option<AbortNotice>,
    abort: impl FnOnce(&AbortNotice),
) -> Result<()> {
    match requested {
        None => Ok(()),
        Some(notice) => {
            // The owner marks it done once every part of a composite transport has told its
            // peers (see `Communicator`'s handling of `Aborted`).
            abort(&notice);
            Err(TransportError::Aborted(format!(
                "aborted by this rank: {}",
                notice.reason
            )))
        }
    }
}

/// A fully connected group of `size` ranks exchanging tagged byte messages.
///
/// Ordering: per (peer, direction), requests complete in the order they were posted; a request
/// cannot move bytes before the earlier ones of the same peer and direction completed. All
/// requests that have to complete for a wait to finish must be passed to that wait.
///
/// Every implementation must pass the conformance suite in `chorus_transport::conformance`
/// (compiled under `cfg(any(test, feature = "conformance"))`).
pub trait Transport: Send {
    /// This rank, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// A short name for logs ("tcp", "shm").
    fn name(&self) -> &'static str;

    /// Enter a request into the per-peer order. Validates the peer and direction; does no I/O.
    fn post(&mut self, req: &mut Request) -> Result<()>;

    /// Move bytes for the given ops. With [`Wait::No`] it never blocks; with
    /// [`Wait::Until`] it blocks until something moved. Returns `true` once every op is complete.
    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> Result<bool>;

    /// Tell every peer (best effort, bounded time) that this rank gives up, then refuse further
    /// use. Peers blocked on this rank fail with [`TransportError::PeerAborted`].
    fn abort(&mut self, notice: &AbortNotice);

    /// Look at `handle` for aborts requested from other threads (see [`AbortHandle`]). The
    /// default ignores it: such a transport aborts only through [`Transport::abort`].
    fn set_abort_handle(&mut self, handle: AbortHandle) {
        let _ = handle;
    }

    /// The shared-memory transport underneath, when it reaches every rank of the group: its
    /// [`shm::ShmTransport::all_reduce`] then runs a whole allreduce through shared memory.
    /// `None` (the default) for transports without one.
    fn shared_memory(&mut self) -> Option<&mut shm::ShmTransport> {
        None
    }

    /// Whether one of `peers` is gone, looked at without blocking and without taking any data
    /// message: its connection closed, an abort notice it sent or that blames it (a notice
    /// read leaves the transport broken, as a wait that read it would), its process dead. For
    /// a rank that waits on something else than this transport (the set-up of a split's new
    /// communicator) and must not wait out its timeout for a peer that is gone. `None` (the
    /// default) where the transport cannot tell.
    fn lost_peer(&mut self, peers: &[usize]) -> Option<TransportError> {
        let _ = peers;
        None
    }

    /// Block until every op completes or the deadline passes. Ops that only the caller can
    /// move on (partial sends whose available bytes are all sent) are an error: nothing in
    /// this wait would make more bytes available.
    fn wait_all(&mut self, ops: &mut [Op<'_, '_>], deadline: Instant) -> Result<()> {
        let start = Instant::now();
        while !self.progress(ops, Wait::Until(deadline))? {
            let waits_for_caller = |op: &Op<'_, '_>| {
                op.req.direction() == Direction::Send
                    && !op.req.is_complete()
                    && op.req.available() == op.req.bytes_done()
                    && op.req.bytes_done() < op.req.len()
            };
            if ops
                .iter()
                .all(|op| op.req.is_complete() || waits_for_caller(op))
            {
                return Err(TransportError::InvalidUsage(
                    "wait_all on partial sends whose available bytes are all sent: only the \
                     caller can make more available"
                        .into(),
                ));
            }
            if Instant::now() >= deadline {
                return Err(TransportError::Timeout {
                    peer: sweep::timeout_peer(ops),
                    waited: start.elapsed(),
                });
            }
        }
        Ok(())
    }

    /// Blocking send of `buf` to `peer`.
    fn send(&mut self, peer: usize, tag: Tag, buf: &[u8], timeout: Duration) -> Result<()> {
        let mut req = Request::send(peer, tag, buf.len());
        self.post(&mut req)?;
        self.wait_all(&mut [Op::send(&mut req, buf)], deadline_after(timeout))
    }

    /// Blocking receive from `peer` into `buf`; returns the message length.
    fn recv(&mut self, peer: usize, tag: Tag, buf: &mut [u8], timeout: Duration) -> Result<usize> {
        let mut req = Request::recv(peer, tag, buf.len());
        self.post(&mut req)?;
        self.wait_all(&mut [Op::recv(&mut req, buf)], deadline_after(timeout))?;
        Ok(req.bytes_done())
    }

    /// Full-duplex: send `sbuf` to `to` while receiving from `from` into `rbuf` (the two may be
    /// the same peer). Never deadlocks on full kernel buffers. Returns the received length.
    #[allow(clippy::too_many_arguments)]
    fn send_recv(
        &mut self,
        to: usize,
        stag: Tag,
        sbuf: &[u8],
        from: usize,
        rtag: Tag,
        rbuf: &mut [u8],
        timeout: Duration,
    ) -> Result<usize> {
        let mut s = Request::send(to, stag, sbuf.len());
        let mut r = Request::recv(from, rtag, rbuf.len());
        self.post(&mut s)?;
        self.post(&mut r)?;
        self.wait_all(
            &mut [Op::send(&mut s, sbuf), Op::recv(&mut r, rbuf)],
            deadline_after(timeout),
        )?;
        Ok(r.bytes_done())
    }
}

/// Connections a listener of chorus's (the store's, a rank's data listener) lets wait to be
/// accepted: std's default of 128 drops the rest of a burst (512 ranks reaching the store at
/// once), and a client whose last handshake packet was dropped waits out its handshake
/// timeout. The kernel caps it at `net.core.somaxconn`.
pub(crate) const LISTEN_BACKLOG: i32 = 4096;

/// Re-`listen` a bound listener with [`LISTEN_BACKLOG`] (Linux takes a second `listen` as a
/// new backlog). Best effort: the old backlog stays if it fails.
pub(crate) fn deepen_backlog(listener: &std::net::TcpListener) {
    let _ = socket2::SockRef::from(listener).listen(LISTEN_BACKLOG);
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn post(&mut self, req: &mut Request) -> Result<()> {
        (**self).post(req)
    }
    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> Result<bool> {
        (**self).progress(ops, wait)
    }
    fn abort(&mut self, notice: &AbortNotice) {
        (**self).abort(notice)
    }
    fn set_abort_handle(&mut self, handle: AbortHandle) {
        (**self).set_abort_handle(handle)
    }
    fn shared_memory(&mut self) -> Option<&mut shm::ShmTransport> {
        (**self).shared_memory()
    }
    fn lost_peer(&mut self, peers: &[usize]) -> Option<TransportError> {
        (**self).lost_peer(peers)
    }
}

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
