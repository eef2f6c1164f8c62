//! Every collective other than allreduce, on [`Communicator`]: typed methods for Rust callers
//! and `_raw` byte methods (the C ABI's entry points).
//!
//! Each call validates its arguments on the calling rank before anything is sent (an
//! [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) error leaves the
//! communicator usable), chooses a schedule from its cost model (or `CHORUS_ALGO`, e.g.
//! `broadcast:ring;allgather:recursive_doubling`), and runs it through the same path as
//! allreduce. Ranks that disagree on the collective, the dtype, the op, the root or the sizes
//! get an [`ErrorKind::Mismatch`](crate::ErrorKind::Mismatch) error on the rank that notices
//! (a receiving rank), and every other rank fails at the latest at its next call, because the
//! communicator is aborted. A rank that only sends in a collective (the root of a broadcast,
//! a leaf of a reduce or gather) can return before the mismatch is seen. Ranks that disagree
//! on the root can also find nothing wrong in what arrives: two ranks that both take
//! themselves for the root of a gather or reduce wait for each other, which ends at the
//! timeout, and when every rank takes itself for the root of a broadcast or scatter, none
//! receives and each returns its own buffer. `CHORUS_CHECK_CALLS=1` compares every call's
//! arguments across the ranks first and names the disagreement.
//!
//! In place means: `broadcast` always; `reduce` with `send` `None` (the input is `recv`);
//! `all_gather` (and `all_gather_v`) with `send` `None` (this rank's block is already at its
//! place in `recv`); `reduce_scatter` (and `reduce_scatter_v`) with `send` `None` (`recv`
//! holds all `p` input blocks, the result overwrites block `rank`); `all_to_all` with `send`
//! `None`; `scan` and `exscan` with `send` `None` (the input is `recv`; rank 0's exscan keeps
//! its input).

use chorus_algorithms::collectives::layout::Layout;
use chorus_algorithms::collectives::{
    allgather, alltoall, broadcast, gather, p2p, reduce, reduce_scatter, scan, scatter,
};
use chorus_algorithms::cost::Link;
use chorus_algorithms::{DType, Element, ReduceOp};

use crate::comm::{tag_base, Call, CollKind, Communicator};
use crate::error::{CommError, ErrorKind};
use crate::log::{self, Level};

/// One send or receive of [`Communicator::p2p_batch`].
#[derive(Debug)]
pub struct P2p<'a> {
    peer: usize,
    dtype: DType,
    buf: P2pBuf<'a>,
}

#[derive(Debug)]
enum P2pBuf<'a> {
    Send(&'a [u8]),
    Recv(&'a mut [u8]),
}

impl<'a> P2p<'a> {
    /// Send `buf` to `peer`.
    pub fn send<T: Element>(buf: &'a [T], peer: usize) -> P2p<'a> {
        P2p::send_raw(bytes(buf), T::DTYPE, peer)
    }

    /// Receive exactly `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(buf: &'a mut [T], peer: usize) -> P2p<'a> {
        P2p::recv_raw(bytes_mut(buf), T::DTYPE, peer)
    }

    /// [`P2p::send`] of raw bytes holding `dtype` elements.
    pub fn send_raw(buf: &'a [u8], dtype: DType, peer: usize) -> P2p<'a> {
        P2p {
            peer,
            dtype,
            buf: P2pBuf::Send(buf),
        }
    }

    /// [`P2p::recv`] into raw bytes holding `dtype` elements.
    pub fn recv_raw(buf: &'a mut [u8], dtype: DType, peer: usize) -> P2p<'a> {
        P2p {
            peer,
            dtype,
            buf: P2pBuf::Recv(buf),
        }
    }

    /// The peer.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Whether this is a send.
    pub fn is_send(&self) -> bool {
        matches!(self.buf, P2pBuf::Send(_))
    }

    /// The tag of the message: a point-to-point message's, which carries the dtype.
    fn tag(&self) -> u64 {
        p2p_tag(self.dtype)
    }

    /// The transfer's shape: what [`P2p::check_batch`] looks at.
    pub fn shape(&self) -> P2pShape {
        let (len, send) = match &self.buf {
            P2pBuf::Send(b) => (b.len(), true),
            P2pBuf::Recv(b) => (b.len(), false),
        };
        P2pShape {
            peer: self.peer,
            dtype: self.dtype,
            len,
            send,
        }
    }

    /// Checks `ops` as [`Communicator::p2p_batch`] does on rank `rank` of `size` before
    /// anything moves (whole elements, peers in range, messages that fit a frame, every send
    /// to this rank paired in order with a receive from it of the same length and dtype): an
    /// [`ErrorKind::InvalidArgument`] error, the communicator untouched.
    pub fn check_batch(ops: &[P2p<'_>], rank: usize, size: usize) -> Result<(), CommError> {
        let shapes: Vec<P2pShape> = ops.iter().map(P2p::shape).collect();
        P2pShape::check_batch(&shapes, rank, size)
    }
}

/// A transfer of a batch without its buffer: for callers that check a batch before its
/// buffers may be touched (the C ABI's nonblocking form, refused at once when it is wrong).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pShape {
    /// The rank sent to or received from.
    pub peer: usize,
    /// The elements' dtype.
    pub dtype: DType,
    /// The length in bytes.
    pub len: usize,
    /// A send (else a receive).
    pub send: bool,
}

impl P2pShape {
    /// [`P2p::check_batch`] on shapes.
    pub fn check_batch(ops: &[P2pShape], rank: usize, size: usize) -> Result<(), CommError> {
        const OP: &str = "p2p_batch";
        let invalid = |m: String| CommError::invalid(OP, m).at_rank(rank);
        let mut shapes = Vec::with_capacity(ops.len());
        for (i, o) in ops.iter().enumerate() {
            let what = if o.send { "send" } else { "receive" };
            if o.len % o.dtype.size() != 0 {
                return Err(invalid(format!(
                    "transfer {i} ({what}) of {} bytes is not a whole number of {} elements \
                     ({} bytes each)",
                    o.len,
                    o.dtype.name(),
                    o.dtype.size()
                )));
            }
            shapes.push(p2p::Shape {
                peer: o.peer,
                tag: p2p_tag(o.dtype),
                len: o.len,
                send: o.send,
            });
        }
        p2p::check_batch(rank, size, &shapes).map_err(invalid)
    }
}

/// The tag of a point-to-point message of `dtype` elements (send, recv, the batch and the
/// queue's isend/irecv, which all match each other).
pub(crate) fn p2p_tag(dtype: DType) -> u64 {
    tag_base(0, CollKind::SendRecv, dtype, NO_OP)
}

/// The op field of the tags of collectives that do not reduce.
const NO_OP: ReduceOp = ReduceOp::Sum;

pub(crate) fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

pub(crate) fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// A digest of an allgatherv's counts, which every rank must pass alike (FNV-1a over the
/// counts as words).
fn counts_digest(counts: &[usize]) -> u64 {
    counts.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &c| {
        (h ^ c as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The schedule of a call: the cheapest (by `cost`) of `all` whose entry in `allowed` (what
/// `CHORUS_ALGO` allows, resolved at init, in the order of `all`) is set. The value was
/// checked at init to leave every collective a schedule.
fn choose<A: Copy>(allowed: &[bool], all: &[A], cost: impl Fn(A) -> f64) -> A {
    let mut best: Option<A> = None;
    for (&a, &ok) in all.iter().zip(allowed) {
        if ok && !best.is_some_and(|b| cost(a) >= cost(b)) {
            best = Some(a);
        }
    }
    best.unwrap_or(all[0])
}

/// Why a reduction of `dtype` elements by `op` is refused, if it is: a bitwise operator on a
/// floating-point dtype (as MPI refuses `MPI_BAND` on `MPI_FLOAT`), or, for a prefix
/// reduction (`prefix`: scan, exscan), an average, which has no prefix meaning. The
/// collectives refuse these when they run; the C layer asks before it issues a nonblocking
/// one.
pub fn reduction_refusal(dtype: DType, op: ReduceOp, prefix: bool) -> Option<String> {
    if op.is_bitwise() && dtype.is_float() {
        return Some(format!(
            "{} is a bitwise operator: it takes integer dtypes, not {}",
            op.name(),
            dtype.name()
        ));
    }
    (prefix && op == ReduceOp::Avg)
        .then(|| "avg has no prefix meaning: scan with sum and divide by rank + 1".to_string())
}

/// The counts of a rooted v-collective in elements, for the pairwise check of
/// [`Communicator::run_call_pairs`]: this rank's own block of `own_bytes`, with the root
/// (zero elsewhere), and, on the root (`layout`), every rank's block in the root's buffer
/// (zeros off the root).
fn rooted_counts(
    p: usize,
    root: usize,
    own_bytes: usize,
    layout: Option<&Layout>,
    dtype: DType,
) -> (Vec<u64>, Vec<u64>) {
    let size = dtype.size() as u64;
    let mut own = vec![0u64; p];
    own[root] = own_bytes as u64 / size;
    let blocks = match layout {
        Some(l) => (0..p).map(|j| l.block(j).len() as u64 / size).collect(),
        None => vec![0; p],
    };
    (own, blocks)
}

impl Communicator {
    /// The α/β the selector measured (or was given) for this communicator.
    fn link(&self) -> Link {
        self.selector().link()
    }

    pub(crate) fn invalid(&self, op: &'static str, msg: String) -> CommError {
        CommError::invalid(op, msg).at_rank(self.rank())
    }

    /// Fails for a bitwise operator on a floating-point dtype (as MPI refuses `MPI_BAND` on
    /// `MPI_FLOAT`); see [`reduction_refusal`].
    pub(crate) fn check_op(
        &self,
        op_name: &'static str,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        match reduction_refusal(dtype, op, false) {
            Some(why) => Err(self.invalid(op_name, why)),
            None => Ok(()),
        }
    }

    /// Fails unless `len` bytes are whole `dtype` elements.
    fn check_whole(
        &self,
        op: &'static str,
        what: &str,
        len: usize,
        dtype: DType,
    ) -> Result<(), CommError> {
        if len % dtype.size() != 0 {
            return Err(self.invalid(
                op,
                format!(
                    "{what} of {len} bytes is not a whole number of {} elements ({} bytes each)",
                    dtype.name(),
                    dtype.size()
                ),
            ));
        }
        Ok(())
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<(), CommError> {
        if root >= self.size() {
            return Err(self.invalid(
                op,
                format!("root {root} is not a rank of this group of {}", self.size()),
            ));
        }
        Ok(())
    }

    /// `len × p` bytes, or an error if that overflows.
    fn times_p(&self, op: &'static str, len: usize) -> Result<usize, CommError> {
        len.checked_mul(self.size()).ok_or_else(|| {
            self.invalid(op, format!("{len} bytes × {} ranks overflows", self.size()))
        })
    }

    fn trace(&self, what: std::fmt::Arguments<'_>) {
        log::log(Level::Trace, Some(self.rank()), what);
    }

    /// Broadcast: `buf` of `root` is copied into `buf` of every rank (same length
    /// everywhere).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.broadcast_raw(bytes_mut(buf), T::DTYPE, root)
    }

    /// [`Communicator::broadcast`] on raw bytes holding `dtype` elements.
    pub fn broadcast_raw(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let call = Call::new("broadcast", CollKind::Broadcast, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "broadcast";
            c.check_whole(OP, "buffer", buf.len(), dtype)?;
            c.check_root(OP, root)?;
            let (size, link) = (c.size(), c.link());
            let alg = choose(&c.algos().broadcast, &broadcast::Algorithm::ALL, |a| {
                a.cost(buf.len(), size, &link)
            });
            c.trace(format_args!(
                "broadcast {} B from {root} with {}",
                buf.len(),
                alg.name()
            ));
            c.run_call(call, &[buf.len() as u64, root as u64], |ctx| {
                broadcast::run(alg, ctx, buf, root)
            })
        })
    }

    /// Reduce: `recv` of `root` gets the element-wise reduction of every rank's input, which
    /// is `send`, or `recv` itself when `send` is `None` (in place). `Avg` divides by the
    /// number of ranks once. On the other ranks `recv` is not written (with `send` given it
    /// is ignored and may be empty).
    pub fn reduce<T: Element>(
        &mut self,
        send: Option<&[T]>,
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        self.reduce_raw(send.map(bytes), bytes_mut(recv), T::DTYPE, op, root)
    }

    /// [`Communicator::reduce`] on raw bytes holding `dtype` elements.
    pub fn reduce_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        let call = Call::new("reduce", CollKind::Reduce, dtype, op);
        self.refusable(call, |c| {
            const OP: &str = "reduce";
            c.check_root(OP, root)?;
            c.check_op(OP, dtype, op)?;
            let n = send.map_or(recv.len(), <[u8]>::len);
            c.check_whole(OP, "input", n, dtype)?;
            if c.rank() == root && recv.len() != n {
                return Err(c.invalid(
                    OP,
                    format!(
                        "the root's send buffer has {n} bytes, its receive buffer {}",
                        recv.len()
                    ),
                ));
            }
            let (size, link) = (c.size(), c.link());
            let alg = choose(&c.algos().reduce, &reduce::Algorithm::ALL, |a| {
                a.cost(n, size, &link)
            });
            c.trace(format_args!(
                "reduce {n} B {} {} to {root} with {}",
                dtype.name(),
                op.name(),
                alg.name()
            ));
            c.run_call(call, &[n as u64, root as u64], |ctx| {
                reduce::run(alg, ctx, send, recv, dtype, op, root)
            })
        })
    }

    /// Allgather: `recv` (p × `send.len()` elements) gets every rank's `send`, rank `j`'s at
    /// block `j`.
    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        self.all_gather_raw(Some(bytes(send)), bytes_mut(recv), T::DTYPE)
    }

    /// In-place allgather: this rank's block is already at block `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<(), CommError> {
        self.all_gather_raw(None, bytes_mut(buf), T::DTYPE)
    }

    /// [`Communicator::all_gather`] on raw bytes; `send` `None` is in place.
    pub fn all_gather_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError> {
        let call = Call::new("all_gather", CollKind::AllGather, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "all_gather";
            c.check_blocks(OP, send, recv.len(), dtype, true)?;
            let (size, link) = (c.size(), c.link());
            let alg = choose(&c.algos().allgather, &allgather::Algorithm::ALL, |a| {
                a.cost(recv.len(), size, &link)
            });
            c.trace(format_args!(
                "all_gather {} B with {}",
                recv.len(),
                alg.name()
            ));
            c.run_call(call, &[recv.len() as u64], |ctx| {
                allgather::run(alg, ctx, send, recv)
            })
        })
    }

    /// Allgatherv (`MPI_Allgatherv` with the blocks back to back; torch's `all_gather` of
    /// tensors of different sizes): rank `j` contributes `send` of `counts[j]` elements (any,
    /// zero included), and every rank ends with every rank's block in rank order in `recv`
    /// (`Σ counts` elements). Every rank passes the same `counts`; ranks that do not fail.
    /// Blocks of different sizes run the ring (`CHORUS_ALGO`'s `allgather:` choice applies to
    /// equal blocks).
    pub fn all_gather_v<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<(), CommError> {
        self.all_gather_v_raw(Some(bytes(send)), bytes_mut(recv), counts, None, T::DTYPE)
    }

    /// [`Communicator::all_gather_v`] with MPI's displacements: rank `j`'s block lands at
    /// element `displs[j]` of `recv` (blocks that do not overlap, in any order, with gaps
    /// left as they were). Each rank lays out its own `recv` as it likes; only the counts
    /// must agree.
    pub fn all_gather_v_displaced<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        displs: &[usize],
    ) -> Result<(), CommError> {
        self.all_gather_v_raw(
            Some(bytes(send)),
            bytes_mut(recv),
            counts,
            Some(displs),
            T::DTYPE,
        )
    }

    /// [`Communicator::all_gather_v`] in place: this rank's block is already at its place in
    /// `buf` (after the blocks of the ranks before it).
    pub fn all_gather_v_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        counts: &[usize],
    ) -> Result<(), CommError> {
        self.all_gather_v_raw(None, bytes_mut(buf), counts, None, T::DTYPE)
    }

    /// [`Communicator::all_gather_v`] on raw bytes (`counts` and `displs` still in
    /// elements): the blocks back to back when `displs` is `None`, else at `displs`. `send`
    /// `None` is in place: this rank's block is already at its place in `recv`.
    pub fn all_gather_v_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        counts: &[usize],
        displs: Option<&[usize]>,
        dtype: DType,
    ) -> Result<(), CommError> {
        let call = Call::new("all_gather_v", CollKind::AllGatherV, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "all_gather_v";
            let layout = c.layout(
                OP,
                "receive buffer",
                recv.len(),
                counts,
                displs,
                dtype,
                true,
            )?;
            let total = layout.total();
            if let Some(s) = send {
                if s.len() != layout.block(c.rank()).len() {
                    return Err(c.invalid(
                        OP,
                        format!(
                            "the send buffer has {} bytes where this rank's count is {} elements",
                            s.len(),
                            counts[c.rank()]
                        ),
                    ));
                }
            }
            // Blocks of different sizes go round the ring, where every block reaches every rank
            // by itself and each hop checks its length, so ranks that disagree about any count
            // fail. Recursive doubling sends groups of blocks, whose sums can agree where the
            // counts do not (ranks that disagree about whether the blocks are equal run different
            // schedules, whose tags differ). The choice rests on the counts alone, never on the
            // layout, which each rank picks for itself.
            let uniform = counts.windows(2).all(|w| w[0] == w[1]);
            let alg = if uniform {
                let (size, link) = (c.size(), c.link());
                choose(&c.algos().allgather, &allgather::Algorithm::ALL, |a| {
                    a.cost(total, size, &link)
                })
            } else {
                allgather::Algorithm::Ring
            };
            c.trace(format_args!("all_gather_v {total} B with {}", alg.name()));
            // Every rank passes the same counts: their digest goes into the tag.
            let digest = counts_digest(counts);
            c.run_call(call, &[total as u64, digest], |ctx| {
                allgather::run_v(alg, ctx, send, recv, &layout)
            })
        })
    }

    /// Alltoallv (`MPI_Alltoallv` with the blocks back to back; torch's
    /// `all_to_all_single` with split sizes): this rank sends `send_counts[j]` elements to rank
    /// `j` (its blocks in rank order in `send`) and receives `recv_counts[j]` elements from
    /// rank `j` (in rank order in `recv`), any of them zero. This rank's `send_counts[j]`
    /// must be rank `j`'s `recv_counts[r]`: a rank that gets a block of another length fails
    /// with a mismatch.
    pub fn all_to_all_v<T: Element>(
        &mut self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        self.all_to_all_v_raw(
            bytes(send),
            (send_counts, None),
            bytes_mut(recv),
            (recv_counts, None),
            T::DTYPE,
        )
    }

    /// [`Communicator::all_to_all_v`] with MPI's displacements: the block for rank `j` is
    /// read at element `send_displs[j]` of `send` (send blocks may overlap) and the block from
    /// rank `j` lands at element `recv_displs[j]` of `recv` (receive blocks may not; gaps are
    /// left as they were).
    pub fn all_to_all_v_displaced<T: Element>(
        &mut self,
        send: &[T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<(), CommError> {
        self.all_to_all_v_raw(
            bytes(send),
            (send_counts, Some(send_displs)),
            bytes_mut(recv),
            (recv_counts, Some(recv_displs)),
            T::DTYPE,
        )
    }

    /// [`Communicator::all_to_all_v`] on raw bytes: each side's counts and displacements
    /// (`None`: back to back) still in elements.
    pub fn all_to_all_v_raw(
        &mut self,
        send: &[u8],
        send_blocks: (&[usize], Option<&[usize]>),
        recv: &mut [u8],
        recv_blocks: (&[usize], Option<&[usize]>),
        dtype: DType,
    ) -> Result<(), CommError> {
        let call = Call::new("all_to_all_v", CollKind::AllToAllV, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "all_to_all_v";
            let (sc, sd) = send_blocks;
            let (rc, rd) = recv_blocks;
            let so = c.layout(OP, "send buffer", send.len(), sc, sd, dtype, false)?;
            let ro = c.layout(OP, "receive buffer", recv.len(), rc, rd, dtype, true)?;
            let me = c.rank();
            if sc[me] != rc[me] {
                return Err(c.invalid(
                    OP,
                    format!(
                        "this rank sends itself {} elements but receives {}",
                        sc[me], rc[me]
                    ),
                ));
            }
            let allowed = c.algos().alltoall.clone();
            let largest = (0..c.size())
                .map(|j| so.block(j).len().max(ro.block(j).len()))
                .max()
                .unwrap_or(0);
            c.trace(format_args!(
                "all_to_all_v {} B out, {} B in, {}",
                so.total(),
                ro.total(),
                alltoall::Algorithm::auto(&allowed, largest).name()
            ));
            // The counts differ from rank to rank by design: they are compared pair by pair
            // (with CHORUS_CHECK_CALLS), else the lengths of the messages check them.
            let counts = |v: &[usize]| v.iter().map(|&n| n as u64).collect();
            c.run_call_pairs(
                call,
                &[],
                |_| (counts(sc), counts(rc)),
                |ctx| alltoall::run_v(ctx, send, &so, recv, &ro, &allowed),
            )
        })
    }

    /// `counts` (elements, one per rank) in bytes of `dtype`, and their total, checked: one per
    /// rank, and no total beyond what memory can hold.
    fn byte_counts(
        &self,
        op: &'static str,
        counts: &[usize],
        dtype: DType,
    ) -> Result<(Vec<usize>, usize), CommError> {
        if counts.len() != self.size() {
            return Err(self.invalid(
                op,
                format!("{} counts for {} ranks", counts.len(), self.size()),
            ));
        }
        let bytes: Option<Vec<usize>> =
            counts.iter().map(|c| c.checked_mul(dtype.size())).collect();
        let total = bytes
            .as_deref()
            .and_then(chorus_algorithms::collectives::offsets)
            .map(|off| off[counts.len()]);
        match (bytes, total) {
            (Some(b), Some(total)) => Ok((b, total)),
            _ => Err(self.invalid(
                op,
                "the counts add up to more bytes than memory holds".into(),
            )),
        }
    }

    /// The layout of a v-collective's buffer of `len` bytes (`what`): the blocks of `counts`
    /// elements of `dtype` back to back (`displs` `None`; the buffer exactly their sum) or at
    /// `displs` elements each (`size` of them; the buffer holds every block). Blocks of a
    /// buffer written to (`writable`) must not overlap.
    #[allow(clippy::too_many_arguments)]
    fn layout(
        &self,
        op: &'static str,
        what: &str,
        len: usize,
        counts: &[usize],
        displs: Option<&[usize]>,
        dtype: DType,
        writable: bool,
    ) -> Result<Layout, CommError> {
        let (bytes, total) = self.byte_counts(op, counts, dtype)?;
        let Some(displs) = displs else {
            if len != total {
                return Err(self.invalid(
                    op,
                    format!("the {what} has {len} bytes where the counts add up to {total}"),
                ));
            }
            return Ok(Layout::packed(&bytes).expect("the sum was checked"));
        };
        if displs.len() != self.size() {
            return Err(self.invalid(
                op,
                format!(
                    "{} displacements for {} ranks ({what})",
                    displs.len(),
                    self.size()
                ),
            ));
        }
        let layout = Layout::of_elements(counts, Some(displs), dtype.size()).ok_or_else(|| {
            self.invalid(
                op,
                format!("the {what}'s displacements reach beyond what memory holds"),
            )
        })?;
        match layout.misfit(len, writable) {
            Some(m) => Err(self.invalid(op, format!("{what}: {m}"))),
            None => Ok(layout),
        }
    }

    /// Checks `p` blocks against one: `gathers` — `send` is one block and `full` p blocks
    /// (allgather); otherwise `send` is p blocks and `full` one block (reduce-scatter). With
    /// `send` `None`, `full` is p blocks of whole elements.
    fn check_blocks(
        &self,
        op: &'static str,
        send: Option<&[u8]>,
        other: usize,
        dtype: DType,
        gathers: bool,
    ) -> Result<(), CommError> {
        let p = self.size();
        match send {
            None => {
                self.check_whole(op, "buffer", other, dtype)?;
                if other % (p * dtype.size()) != 0 {
                    return Err(self.invalid(
                        op,
                        format!(
                            "the buffer of {other} bytes is not {p} blocks of whole {} \
                             elements",
                            dtype.name()
                        ),
                    ));
                }
            }
            Some(s) => {
                self.check_whole(op, "send buffer", s.len(), dtype)?;
                self.check_whole(op, "receive buffer", other, dtype)?;
                let (block, full, what) = if gathers {
                    (s.len(), other, "receive")
                } else {
                    (other, s.len(), "send")
                };
                if self.times_p(op, block)? != full {
                    return Err(self.invalid(
                        op,
                        format!(
                            "the {what} buffer must hold {p} blocks of {block} bytes ({} bytes), \
                             not {full}",
                            block * p
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Reduce-scatter: `recv` gets block `rank` of the reduction of every rank's `send`
    /// (p × `recv.len()` elements). `Avg` divides by the number of ranks once.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce_scatter_raw(Some(bytes(send)), bytes_mut(recv), T::DTYPE, op)
    }

    /// In-place reduce-scatter: `buf` holds the p input blocks; block `rank` gets the result
    /// (the other blocks keep the input).
    pub fn reduce_scatter_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce_scatter_raw(None, bytes_mut(buf), T::DTYPE, op)
    }

    /// [`Communicator::reduce_scatter`] on raw bytes; `send` `None` is in place (`recv` is
    /// then the whole p-block buffer).
    pub fn reduce_scatter_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let call = Call::new("reduce_scatter", CollKind::ReduceScatter, dtype, op);
        self.refusable(call, |c| {
            const OP: &str = "reduce_scatter";
            c.check_op(OP, dtype, op)?;
            c.check_blocks(OP, send, recv.len(), dtype, false)?;
            let total = send.map_or(recv.len(), <[u8]>::len);
            let (size, link) = (c.size(), c.link());
            let alg = choose(
                &c.algos().reduce_scatter,
                &reduce_scatter::Algorithm::ALL,
                |a| a.cost(total, size, &link),
            );
            c.trace(format_args!(
                "reduce_scatter {total} B {} {} with {}",
                dtype.name(),
                op.name(),
                alg.name()
            ));
            c.run_call(call, &[total as u64], |ctx| {
                reduce_scatter::run(alg, ctx, send, recv, dtype, op)
            })
        })
    }

    /// Reduce-scatterv (`MPI_Reduce_scatter`; torch's `reduce_scatter` of tensors of different
    /// sizes): `send` holds p blocks back to back, block `j` of `counts[j]` elements (any, zero
    /// included), and `recv` (`counts[rank]` elements) gets block `rank` of the reduction of
    /// every rank's `send`. Every rank passes the same `counts`; ranks that do not fail.
    /// Equal blocks run as [`Communicator::reduce_scatter`] (its schedules and
    /// `CHORUS_ALGO`'s choice); blocks of different sizes go round the ring. `Avg` divides by
    /// the number of ranks once.
    pub fn reduce_scatter_v<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce_scatter_v_raw(Some(bytes(send)), bytes_mut(recv), counts, T::DTYPE, op)
    }

    /// [`Communicator::reduce_scatter_v`] in place: `buf` holds the p input blocks, and block
    /// `rank` (after the blocks of the ranks before it) gets the result.
    pub fn reduce_scatter_v_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce_scatter_v_raw(None, bytes_mut(buf), counts, T::DTYPE, op)
    }

    /// [`Communicator::reduce_scatter_v`] on raw bytes (`counts` still in elements); `send`
    /// `None` is in place (`recv` is then the whole input).
    pub fn reduce_scatter_v_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        const OP: &str = "reduce_scatter_v";
        let checked = self.check_reduce_scatter_v(send, recv.len(), counts, dtype, op);
        let uniform = counts.windows(2).all(|w| w[0] == w[1]);
        if checked.is_ok() && uniform {
            // Equal blocks: the reduce-scatter, whose schedules suit them.
            return self.reduce_scatter_raw(send, recv, dtype, op);
        }
        let call = Call::new(OP, CollKind::ReduceScatterV, dtype, op);
        self.refusable(call, |c| {
            let (byte_counts, total) = checked?;
            c.trace(format_args!(
                "reduce_scatter_v {total} B {} {} with ring",
                dtype.name(),
                op.name()
            ));
            // Every rank passes the same counts: their digest goes into the tag.
            let digest = counts_digest(counts);
            c.run_call(call, &[total as u64, digest], |ctx| {
                reduce_scatter::run_v(ctx, send, recv, &byte_counts, dtype, op)
            })
        })
    }

    /// The arguments of [`Communicator::reduce_scatter_v_raw`]: the byte counts and their sum.
    fn check_reduce_scatter_v(
        &self,
        send: Option<&[u8]>,
        recv_len: usize,
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(Vec<usize>, usize), CommError> {
        const OP: &str = "reduce_scatter_v";
        self.check_op(OP, dtype, op)?;
        let (byte_counts, total) = self.byte_counts(OP, counts, dtype)?;
        let (what, have, want) = match send {
            Some(s) if s.len() != total => ("send", s.len(), total),
            Some(_) => ("receive", recv_len, byte_counts[self.rank()]),
            None => ("in-place", recv_len, total),
        };
        if have != want {
            return Err(self.invalid(
                OP,
                format!(
                    "the {what} buffer has {have} bytes where the counts make it {want} \
                     (counts {:?} elements of {})",
                    &counts[..counts.len().min(16)],
                    dtype.name()
                ),
            ));
        }
        Ok((byte_counts, total))
    }

    /// All-to-all: block `j` of this rank's `send` becomes block `rank` of rank `j`'s `recv`
    /// (both p blocks of equal size).
    pub fn all_to_all<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        self.all_to_all_raw(Some(bytes(send)), bytes_mut(recv), T::DTYPE)
    }

    /// In-place all-to-all on `buf` (p blocks).
    pub fn all_to_all_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<(), CommError> {
        self.all_to_all_raw(None, bytes_mut(buf), T::DTYPE)
    }

    /// [`Communicator::all_to_all`] on raw bytes; `send` `None` is in place.
    pub fn all_to_all_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError> {
        let call = Call::new("all_to_all", CollKind::AllToAll, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "all_to_all";
            if let Some(s) = send {
                if s.len() != recv.len() {
                    return Err(c.invalid(
                        OP,
                        format!(
                            "send buffer has {} bytes, receive buffer {}",
                            s.len(),
                            recv.len()
                        ),
                    ));
                }
            }
            c.check_blocks(OP, None, recv.len(), dtype, true)?;
            let allowed = c.algos().alltoall.clone();
            let block = recv.len() / c.size();
            c.trace(format_args!(
                "all_to_all {} B {}",
                recv.len(),
                alltoall::Algorithm::auto(&allowed, block).name()
            ));
            c.run_call(call, &[recv.len() as u64], |ctx| {
                alltoall::run(ctx, send, recv, &allowed)
            })
        })
    }

    /// Gather: `recv` of `root` (p × `send.len()` elements) gets every rank's `send`, rank
    /// `j`'s at block `j`. `recv` is only used on the root (`None` elsewhere is fine).
    pub fn gather<T: Element>(
        &mut self,
        send: &[T],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<(), CommError> {
        self.gather_raw(bytes(send), recv.map(bytes_mut), T::DTYPE, root)
    }

    /// [`Communicator::gather`] on raw bytes.
    pub fn gather_raw(
        &mut self,
        send: &[u8],
        recv: Option<&mut [u8]>,
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let call = Call::new("gather", CollKind::Gather, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "gather";
            c.check_root(OP, root)?;
            c.check_whole(OP, "send buffer", send.len(), dtype)?;
            let recv = if c.rank() == root {
                let want = c.times_p(OP, send.len())?;
                match recv {
                    Some(r) if r.len() == want => Some(r),
                    r => {
                        return Err(c.invalid(
                            OP,
                            format!(
                            "the root's receive buffer must hold {} blocks of {} bytes ({want} \
                             bytes), not {}",
                            c.size(),
                            send.len(),
                            r.map_or("none".to_string(), |r| r.len().to_string())
                        ),
                        ))
                    }
                }
            } else {
                None
            };
            c.trace(format_args!("gather {} B to {root}", send.len()));
            c.run_call(call, &[send.len() as u64, root as u64], |ctx| {
                gather::run(ctx, send, recv, root)
            })
        })
    }

    /// Scatter: block `j` of `root`'s `send` (p × `recv.len()` elements) goes to rank `j`'s
    /// `recv`. `send` is only used on the root (`None` elsewhere is fine).
    pub fn scatter<T: Element>(
        &mut self,
        send: Option<&[T]>,
        recv: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        self.scatter_raw(send.map(bytes), bytes_mut(recv), T::DTYPE, root)
    }

    /// [`Communicator::scatter`] on raw bytes.
    pub fn scatter_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let call = Call::new("scatter", CollKind::Scatter, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "scatter";
            c.check_root(OP, root)?;
            c.check_whole(OP, "receive buffer", recv.len(), dtype)?;
            let send = if c.rank() == root {
                let want = c.times_p(OP, recv.len())?;
                match send {
                    Some(s) if s.len() == want => Some(s),
                    s => {
                        return Err(c.invalid(
                            OP,
                            format!(
                                "the root's send buffer must hold {} blocks of {} bytes ({want} \
                             bytes), not {}",
                                c.size(),
                                recv.len(),
                                s.map_or("none".to_string(), |s| s.len().to_string())
                            ),
                        ))
                    }
                }
            } else {
                None
            };
            c.trace(format_args!("scatter {} B from {root}", recv.len()));
            c.run_call(call, &[recv.len() as u64, root as u64], |ctx| {
                scatter::run(ctx, send, recv, root)
            })
        })
    }

    /// Gatherv (`MPI_Gatherv` with the blocks back to back): every rank sends its `send` (any
    /// length, zero included) and the root's `recv` gets them in rank order, rank `j`'s of
    /// `counts[j]` elements. `recv` and `counts` are only needed on the root (`None`
    /// elsewhere), as in MPI; the root checks every block's length, and a rank that sends
    /// another length than its count makes the root fail with a mismatch (and every rank at
    /// its next call).
    pub fn gather_v<T: Element>(
        &mut self,
        send: &[T],
        recv: Option<(&mut [T], &[usize])>,
        root: usize,
    ) -> Result<(), CommError> {
        let recv = recv.map(|(r, c)| (bytes_mut(r), c, None));
        self.gather_v_raw(bytes(send), recv, T::DTYPE, root)
    }

    /// [`Communicator::gather_v`] with MPI's displacements: on the root, rank `j`'s block
    /// lands at element `displs[j]` of `recv` (`(recv, counts, displs)`; blocks that do not
    /// overlap, in any order, gaps left as they were).
    pub fn gather_v_displaced<T: Element>(
        &mut self,
        send: &[T],
        recv: Option<(&mut [T], &[usize], &[usize])>,
        root: usize,
    ) -> Result<(), CommError> {
        let recv = recv.map(|(r, c, d)| (bytes_mut(r), c, Some(d)));
        self.gather_v_raw(bytes(send), recv, T::DTYPE, root)
    }

    /// [`Communicator::gather_v`] on raw bytes: on the root `(recv, counts, displs)`, counts
    /// and displacements (`None`: back to back) still in elements.
    #[allow(clippy::type_complexity)]
    pub fn gather_v_raw(
        &mut self,
        send: &[u8],
        recv: Option<(&mut [u8], &[usize], Option<&[usize]>)>,
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let call = Call::new("gather_v", CollKind::GatherV, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "gather_v";
            c.check_root(OP, root)?;
            c.check_whole(OP, "send buffer", send.len(), dtype)?;
            let recv = if c.rank() == root {
                let Some((r, counts, displs)) = recv else {
                    return Err(c.invalid(OP, "the root needs a receive buffer and counts".into()));
                };
                let layout =
                    c.layout(OP, "receive buffer", r.len(), counts, displs, dtype, true)?;
                if send.len() != layout.block(root).len() {
                    return Err(c.invalid(
                        OP,
                        format!(
                            "the root's send buffer has {} bytes where its count makes {}",
                            send.len(),
                            layout.block(root).len()
                        ),
                    ));
                }
                Some((r, layout))
            } else {
                None
            };
            c.trace(format_args!("gather_v {} B to {root}", send.len()));
            let (mut buf, layout) = match recv {
                Some((r, l)) => (Some(r), Some(l)),
                None => (None, None),
            };
            c.run_call_pairs(
                call,
                &[root as u64],
                // To the root, its own block; the root expects every rank's.
                |p| rooted_counts(p, root, send.len(), layout.as_ref(), dtype),
                |ctx| {
                    let recv = buf
                        .as_mut()
                        .zip(layout.as_ref())
                        .map(|(r, l)| (&mut **r, l));
                    gather::run_v(ctx, send, recv, root)
                },
            )
        })
    }

    /// Scatterv (`MPI_Scatterv` with the blocks back to back): the root's `send` holds the
    /// blocks in rank order, rank `j`'s of `counts[j]` elements (any, zero included), and every
    /// rank's `recv` gets its block. `send` and `counts` are only needed on the root (`None`
    /// elsewhere), as in MPI; a rank whose `recv` has another length than its count fails with
    /// a mismatch (and every rank at its next call).
    pub fn scatter_v<T: Element>(
        &mut self,
        send: Option<(&[T], &[usize])>,
        recv: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        let send = send.map(|(s, c)| (bytes(s), c, None));
        self.scatter_v_raw(send, bytes_mut(recv), T::DTYPE, root)
    }

    /// [`Communicator::scatter_v`] with MPI's displacements: on the root, rank `j`'s block is
    /// read at element `displs[j]` of `send` (`(send, counts, displs)`; blocks in any order,
    /// overlapping or not).
    pub fn scatter_v_displaced<T: Element>(
        &mut self,
        send: Option<(&[T], &[usize], &[usize])>,
        recv: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        let send = send.map(|(s, c, d)| (bytes(s), c, Some(d)));
        self.scatter_v_raw(send, bytes_mut(recv), T::DTYPE, root)
    }

    /// [`Communicator::scatter_v`] on raw bytes: on the root `(send, counts, displs)`, counts
    /// and displacements (`None`: back to back) still in elements.
    #[allow(clippy::type_complexity)]
    pub fn scatter_v_raw(
        &mut self,
        send: Option<(&[u8], &[usize], Option<&[usize]>)>,
        recv: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let call = Call::new("scatter_v", CollKind::ScatterV, dtype, NO_OP);
        self.refusable(call, |c| {
            const OP: &str = "scatter_v";
            c.check_root(OP, root)?;
            c.check_whole(OP, "receive buffer", recv.len(), dtype)?;
            let send = if c.rank() == root {
                let Some((s, counts, displs)) = send else {
                    return Err(c.invalid(OP, "the root needs a send buffer and counts".into()));
                };
                let layout = c.layout(OP, "send buffer", s.len(), counts, displs, dtype, false)?;
                if recv.len() != layout.block(root).len() {
                    return Err(c.invalid(
                        OP,
                        format!(
                            "the root's receive buffer has {} bytes where its count makes {}",
                            recv.len(),
                            layout.block(root).len()
                        ),
                    ));
                }
                Some((s, layout))
            } else {
                None
            };
            c.trace(format_args!("scatter_v {} B from {root}", recv.len()));
            let recv_len = recv.len();
            c.run_call_pairs(
                call,
                &[root as u64],
                // The mirror of gather_v's: the root sends every rank's block.
                |p| {
                    let (own, blocks) =
                        rooted_counts(p, root, recv_len, send.as_ref().map(|(_, l)| l), dtype);
                    (blocks, own)
                },
                |ctx| {
                    let send = send.as_ref().map(|(s, l)| (*s, l));
                    scatter::run_v(ctx, send, recv, root)
                },
            )
        })
    }

    /// Scan (`MPI_Scan`, an inclusive prefix reduction): `recv` of rank `r` gets the
    /// element-wise reduction (`op`) of `send` of ranks `0..=r` (same length everywhere).
    /// Recursive doubling (`⌈log₂p⌉` steps) or a pipelined chain (each rank sends the buffer
    /// once), by the cost model: recursive doubling for small buffers on many ranks (from
    /// p = 8 on loopback's costs), the chain for large ones and for few ranks; `CHORUS_ALGO`
    /// (`scan:chain`, `exscan:recursive_doubling`) overrides it. `Avg` is refused (it has no
    /// prefix meaning).
    pub fn scan<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.scan_raw(Some(bytes(send)), bytes_mut(recv), T::DTYPE, op, false)
    }

    /// [`Communicator::scan`] in place: `buf` holds the input and gets the result.
    pub fn scan_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.scan_raw(None, bytes_mut(buf), T::DTYPE, op, false)
    }

    /// Exclusive scan (`MPI_Exscan`): `recv` of rank `r` gets the reduction of `send` of ranks
    /// `0..r`; rank 0's `recv`, which no rank precedes, is left as it was.
    pub fn exscan<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.scan_raw(Some(bytes(send)), bytes_mut(recv), T::DTYPE, op, true)
    }

    /// [`Communicator::exscan`] in place (rank 0's `buf` keeps its input).
    pub fn exscan_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.scan_raw(None, bytes_mut(buf), T::DTYPE, op, true)
    }

    /// [`Communicator::scan`] (or, `exclusive`, [`Communicator::exscan`]) on raw bytes; `send`
    /// `None` is in place.
    pub fn scan_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        exclusive: bool,
    ) -> Result<(), CommError> {
        let (name, kind) = if exclusive {
            ("exscan", CollKind::ExScan)
        } else {
            ("scan", CollKind::Scan)
        };
        let call = Call::new(name, kind, dtype, op);
        self.refusable(call, |c| {
            if let Some(why) = reduction_refusal(dtype, op, true) {
                return Err(c.invalid(name, why));
            }
            c.check_whole(name, "receive buffer", recv.len(), dtype)?;
            if let Some(s) = send {
                if s.len() != recv.len() {
                    return Err(c.invalid(
                        name,
                        format!(
                            "the send buffer has {} bytes and the receive buffer {}",
                            s.len(),
                            recv.len()
                        ),
                    ));
                }
            }
            let (size, link, n) = (c.size(), c.link(), recv.len());
            let allowed = if exclusive {
                &c.algos().exscan
            } else {
                &c.algos().scan
            };
            let alg = choose(allowed, &scan::Algorithm::ALL, |a| a.cost(n, size, &link));
            c.trace(format_args!(
                "{name} {n} B {} {} with {}",
                dtype.name(),
                op.name(),
                alg.name()
            ));
            c.run_call(call, &[n as u64], |ctx| {
                scan::run(alg, ctx, send, recv, dtype, op, exclusive)
            })
        })
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<(), CommError> {
        if peer >= self.size() || peer == self.rank() {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} is not another rank of this group of {}",
                    self.size()
                ),
            ));
        }
        Ok(())
    }

    /// Send `buf` to `peer`, which must call [`Communicator::recv`] with a buffer of the
    /// same length and type. Messages between two ranks, point-to-point or collective, are
    /// matched in the order they were sent: `peer` must receive this one before it takes
    /// part in a collective that receives from this rank. Returns once the data is handed to
    /// the transport (not necessarily received).
    pub fn send<T: Element>(&mut self, buf: &[T], peer: usize) -> Result<(), CommError> {
        self.send_raw(bytes(buf), T::DTYPE, peer)
    }

    /// [`Communicator::send`] on raw bytes.
    pub fn send_raw(&mut self, buf: &[u8], dtype: DType, peer: usize) -> Result<(), CommError> {
        const OP: &str = "send";
        self.check_whole(OP, "buffer", buf.len(), dtype)?;
        self.check_peer(OP, peer)?;
        self.trace(format_args!("send {} B to {peer}", buf.len()));
        // Only two ranks take part: the collective sequence number must not advance.
        let tag = p2p_tag(dtype);
        self.run_tagged(OP, tag, None, |ctx| p2p::send(ctx, buf, peer))
    }

    /// Receive exactly `buf.len()` elements from `peer` (see [`Communicator::send`]); a
    /// message of another length or type is an [`ErrorKind::Mismatch`](crate::ErrorKind).
    pub fn recv<T: Element>(&mut self, buf: &mut [T], peer: usize) -> Result<(), CommError> {
        self.recv_raw(bytes_mut(buf), T::DTYPE, peer)
    }

    /// Send `send` to `to` while receiving exactly `recv.len()` elements from `from`, both at
    /// once (a ring of these cannot deadlock, unlike blocking [`Communicator::send`]s). The
    /// peers may use `send`/`recv` or `send_recv` on their side. With `to` and `from` both
    /// this rank (a ring of one, as `MPI_Sendrecv` allows) it copies `send` into `recv`, which
    /// must then be as long.
    pub fn send_recv<T: Element>(
        &mut self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<(), CommError> {
        self.send_recv_raw(bytes(send), to, bytes_mut(recv), from, T::DTYPE)
    }

    /// [`Communicator::send_recv`] on raw bytes.
    pub fn send_recv_raw(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        dtype: DType,
    ) -> Result<(), CommError> {
        const OP: &str = "send_recv";
        self.check_whole(OP, "send buffer", send.len(), dtype)?;
        self.check_whole(OP, "receive buffer", recv.len(), dtype)?;
        if to == self.rank() && from == self.rank() {
            self.check_usable(OP)?;
            if send.len() != recv.len() {
                return Err(CommError::new(
                    ErrorKind::Mismatch,
                    OP,
                    format!(
                        "to itself: {} bytes sent where {} are received",
                        send.len(),
                        recv.len()
                    ),
                )
                .at_rank(self.rank())
                .with_usable(true));
            }
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.check_peer(OP, to)?;
        self.check_peer(OP, from)?;
        // Refused before the send is posted: a receive the transport refused after it would
        // leave its message order to `to` out of step (as `batch_isend_irecv` checks).
        for (what, len) in [("send", send.len()), ("receive", recv.len())] {
            if len as u64 > chorus_transport::frame::MAX_PAYLOAD {
                return Err(CommError::invalid(
                    OP,
                    format!("the {what} buffer's {len} bytes are more than one message carries (2^40 - 1 bytes)"),
                )
                .at_rank(self.rank()));
            }
        }
        self.trace(format_args!(
            "send_recv {} B to {to}, {} B from {from}",
            send.len(),
            recv.len()
        ));
        let tag = p2p_tag(dtype);
        self.run_tagged(OP, tag, None, |ctx| {
            p2p::send_recv(ctx, send, to, recv, from)
        })
    }

    /// Run every send and receive of `ops` at once (as torch's `batch_isend_irecv`, NCCL's
    /// grouped `ncclSend`/`ncclRecv`, or `MPI_Isend`/`MPI_Irecv` and `MPI_Waitall`): all are
    /// posted together and progressed together until all complete, so the order of a batch's
    /// sends and receives cannot deadlock it when every rank involved takes part with a batch
    /// of its own (a halo exchange with both neighbours, a pipeline stage's activations and
    /// gradients, an all-to-all of one's own design). A peer answering with blocking calls
    /// must make them in an order that can complete.
    ///
    /// Per peer and direction, messages are matched in order, with this rank's other
    /// point-to-point calls and with the peer's: the peer may receive a batch's sends with
    /// [`Communicator::recv`], [`Communicator::send_recv`] or a batch of its own. Every receive
    /// takes exactly its buffer's length and dtype (anything else is an
    /// [`ErrorKind::Mismatch`]). A send to this rank itself is copied into the receive from
    /// itself of the same order in the batch, which must be as long and of the same dtype.
    /// Send buffers may be the same buffer; the borrow rules keep receive buffers apart.
    ///
    /// ```no_run
    /// # use chorus::{Communicator, P2p};
    /// # fn halo(comm: &mut Communicator, edge_l: &[f32], edge_r: &[f32]) -> Result<(), chorus::CommError> {
    /// let (r, p) = (comm.rank(), comm.size());
    /// let (left, right) = ((r + p - 1) % p, (r + 1) % p);
    /// let (mut ghost_l, mut ghost_r) = (vec![0f32; edge_l.len()], vec![0f32; edge_r.len()]);
    /// comm.p2p_batch(&mut [
    ///     P2p::send(edge_l, left),
    ///     P2p::send(edge_r, right),
    ///     P2p::recv(&mut ghost_l, left),
    ///     P2p::recv(&mut ghost_r, right),
    /// ])?;
    /// # Ok(()) }
    /// ```
    pub fn p2p_batch(&mut self, ops: &mut [P2p<'_>]) -> Result<(), CommError> {
        const OP: &str = "p2p_batch";
        P2p::check_batch(ops, self.rank(), self.size())?;
        let items: Vec<p2p::Item<'_>> = ops
            .iter_mut()
            .map(|o| p2p::Item {
                peer: o.peer,
                tag: o.tag(),
                transfer: match &mut o.buf {
                    P2pBuf::Send(b) => p2p::Transfer::Send(b),
                    P2pBuf::Recv(b) => p2p::Transfer::Recv(b),
                },
            })
            .collect();
        self.trace(format_args!("p2p_batch of {} transfers", items.len()));
        let tag = tag_base(0, CollKind::SendRecv, DType::Uint8, NO_OP);
        self.run_tagged(OP, tag, None, |ctx| p2p::batch(ctx, items))
    }

    /// [`Communicator::recv`] on raw bytes.
    pub fn recv_raw(&mut self, buf: &mut [u8], dtype: DType, peer: usize) -> Result<(), CommError> {
        const OP: &str = "recv";
        self.check_whole(OP, "buffer", buf.len(), dtype)?;
        self.check_peer(OP, peer)?;
        self.trace(format_args!("recv {} B from {peer}", buf.len()));
        let tag = p2p_tag(dtype);
        self.run_tagged(OP, tag, None, |ctx| p2p::recv(ctx, buf, peer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo_spec::AlgoSpec;
    use crate::{Config, ErrorKind};

    #[test]
    fn algo_override_grammar() {
        let a = AlgoSpec::parse("allreduce:ring;broadcast:ring;allgather:recursive_doubling")
            .unwrap()
            .resolve();
        assert!(a.allreduce_restricted);
        let bcast = |allowed: &[bool], costs: [f64; 2]| choose(allowed, &[0usize, 1], |i| costs[i]);
        assert_eq!(bcast(&a.broadcast, [1.0, 2.0]), 1); // tree, ring: ring forced
        assert_eq!(bcast(&a.reduce, [1.0, 2.0]), 0); // nothing said: the cheaper
        assert_eq!(bcast(&a.reduce, [3.0, 2.0]), 1);
        assert_eq!(bcast(&a.allgather, [1.0, 2.0]), 1); // ring, recursive doubling
        let tree = AlgoSpec::parse("tree").unwrap().resolve();
        assert_eq!(bcast(&tree.reduce, [3.0, 2.0]), 0);
        // The allgather knows no tree: left alone.
        assert_eq!(tree.allgather, [true, true]);
        // An exclusion is honoured, and a list of several leaves the choice to the costs.
        let no_tree = AlgoSpec::parse("reduce:^tree").unwrap().resolve();
        assert_eq!(bcast(&no_tree.reduce, [1.0, 2.0]), 1);
        assert!(!no_tree.allreduce_restricted);
        let both = AlgoSpec::parse("reduce:ring,tree").unwrap().resolve();
        assert_eq!(bcast(&both.reduce, [3.0, 2.0]), 1);
        assert_eq!(bcast(&both.reduce, [1.0, 2.0]), 0);
    }

    /// Counts that differ only in how a group of blocks is split, and whose digests fall on the
    /// same 16 bits of the tag: recursive doubling would carry them in messages of equal
    /// lengths and tags, and return Ok with wrong blocks. Unequal blocks go round the ring,
    /// where every hop checks every block: every rank fails.
    #[test]
    fn allgatherv_counts_that_collide_in_the_tag_still_fail() {
        // The arguments `all_gather_v_raw` puts in the tag: total bytes (of i32) and digest.
        let bits = |c: &[usize; 4]| {
            let total = 4 * c.iter().sum::<usize>() as u64;
            crate::comm::call_bits(&[total, counts_digest(c)])
        };
        let (a, b) = (1..1024usize)
            .flat_map(|x| (x + 1..1024usize).map(move |y| ([x, y, 1, 1], [y, x, 1, 1])))
            .find(|(a, b)| bits(a) == bits(b))
            .expect("a collision of 16 bits among 522 753 pairs");
        let server =
            chorus_transport::rendezvous::StoreServer::bind("127.0.0.1:0".parse().unwrap(), b"t")
                .unwrap();
        let addr = server.local_addr();
        let handles: Vec<_> = (0..4)
            .map(|r| {
                let counts = if r < 2 { a } else { b };
                std::thread::spawn(move || {
                    let mut cfg = Config::new(r, 4, addr.to_string());
                    cfg.token = Some("t".into());
                    cfg.host_store = Some(false);
                    cfg.transport = Some("tcp".into());
                    cfg.algo = Some("allgather:recursive_doubling".into());
                    cfg.timeout = std::time::Duration::from_secs(5);
                    cfg.init_timeout = std::time::Duration::from_secs(30);
                    let mut c = Communicator::new(cfg).unwrap();
                    let mine = vec![r as i32; counts[r]];
                    let mut out = vec![0i32; counts.iter().sum()];
                    match c.all_gather_v(&mine, &mut out, &counts) {
                        Err(e) => Some(e.kind()),
                        Ok(()) => c.barrier().err().map(|e| e.kind()),
                    }
                })
            })
            .collect();
        let res: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            res.iter().all(Option::is_some),
            "a rank returned Ok: {res:?}"
        );
        assert!(res.contains(&Some(ErrorKind::Mismatch)), "{res:?}");
    }

    /// A group of one: every collective is a local copy, and bad arguments are reported
    /// without breaking the communicator.
    #[test]
    fn group_of_one() {
        let mut c = Communicator::new(Config::new(0, 1, "127.0.0.1:0")).unwrap();
        let mut v = [1i32, 2, 3];
        c.broadcast(&mut v, 0).unwrap();
        assert_eq!(v, [1, 2, 3]);
        let mut out = [0i32; 3];
        c.reduce(Some(&[4, 5, 6]), &mut out, ReduceOp::Avg, 0)
            .unwrap();
        assert_eq!(out, [4, 5, 6]);
        c.all_gather(&[7, 8, 9], &mut out).unwrap();
        assert_eq!(out, [7, 8, 9]);
        c.reduce_scatter(&[1, 1, 1], &mut out, ReduceOp::Sum)
            .unwrap();
        assert_eq!(out, [1, 1, 1]);
        c.all_to_all(&[3, 2, 1], &mut out).unwrap();
        assert_eq!(out, [3, 2, 1]);
        c.gather(&[5, 5, 5], Some(&mut out), 0).unwrap();
        assert_eq!(out, [5, 5, 5]);
        c.scatter(Some(&[6, 6, 6]), &mut out, 0).unwrap();
        assert_eq!(out, [6, 6, 6]);
        let e = c.broadcast(&mut v, 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = c.send(&v, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = c.all_gather(&[1, 2], &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = c.gather(&[1, 2], None, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = c
            .reduce_raw(None, &mut [0u8; 6], DType::Float32, ReduceOp::Sum, 0)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(c.is_usable());
        c.barrier().unwrap();
    }
}
