//! Sparse allreduce and top-k compressed allreduce (DESIGN.md §3, issue #6).
//!
//! Two operations:
//! - [`sparse_all_reduce`]: the exact sum of sparse f32 vectors given by the user
//!   (embedding-style gradients); the result is the union of the entries, dense where it fills
//!   in ([`SparseResult`]). The values are the same whichever schedule runs; which entries of
//!   a sparse result are listed is not: entries whose sum is zero (explicit zeros included)
//!   may be left out (two-phase leaves them out, a region that went dense on the way lists
//!   only its non-zeros), as a dense result shows them.
//! - [`topk_all_reduce`]: a dense gradient in, the approximate global top-k sum out, with the
//!   residual of error feedback kept in a [`TopkState`].
//!
//! Three schedules ([`SparseAlgo`]), each in its own module with a pure `plan` and a `cost`:
//!
//! | schedule | messages on the critical path | words each rank receives (k entries per rank) |
//! |---|---|---|
//! | [`recursive_doubling`] (SparCML) | `log₂p` (+2 when folding) | `2k·log₂p` (same indices) … `2k(p−1)` (disjoint), at most `n·log₂p` |
//! | [`split_allgather`] (DSAR) | two all-to-all rounds (and a small allreduce above 16 MiB dense) | `2k(p−1)/p` … `2k(p−1)` (the union) |
//! | [`two_phase`] (Ok-Topk) | two all-to-all rounds, a balancing round, small allreduces | top-k: `≤ 6k(p−1)/p` |
//!
//! Entries travel as sparse streams ([`stream`]): sorted integer indices (u32, or u64 for
//! regions beyond 2³² positions) and f32 values behind a per-segment header, sent dense when
//! that is not larger (SparCML's byte rule). Everything received is validated; a peer with
//! another length or other arguments makes the call fail on every rank with
//! [`TransportError::Mismatch`] or [`TransportError::Protocol`].
//!
//! # Tags
//! Every message of these schedules uses the step `(schedule id << 8) | step` (below 4096) of
//! [`CollCtx::tag`]; the small allreduces of counts and thresholds inside [`two_phase`] (and
//! of the regions' byte lengths in [`split_allgather`]) use
//! [`crate::allreduce::recursive_doubling`]'s own steps.
//!
//! # Identical results
//! Every rank gets the same bits: the schedules that sum on several ranks
//! ([`recursive_doubling`]) combine exactly two operands per step with a commutative rule (see
//! [`stream::Acc`]); the others sum each region on one rank and every rank, the owner too,
//! decodes the same bytes.

pub mod recursive_doubling;
pub mod split_allgather;
pub mod stream;
pub mod topk;
pub mod two_phase;

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use chorus_transport::{AbortNotice, Op, Request, Result, Tag, Transport, TransportError, Wait};

pub use topk::{
    topk_all_reduce, topk_exact, ThresholdEstimator, TopkOptions, TopkState, TopkStats,
};

use crate::cost::Link;
use crate::{CollCtx, ParseNameError};
use stream::{prefers_dense, SegView};

/// A sparse f32 vector of dense length `n`: `indices` strictly increasing and below `n`, one
/// value per index. Indices are u64 in memory; on the wire they are u32 whenever the region
/// sent has at most 2³² positions, else u64 (never packed into floats).
///
/// ```
/// use chorus_algorithms::sparse::SparseVec;
/// let v = SparseVec::new(6, vec![1, 4], vec![2.0, -1.0]).unwrap();
/// assert_eq!(v.to_dense(), [0.0, 2.0, 0.0, 0.0, -1.0, 0.0]);
/// assert_eq!(SparseVec::from_dense(&v.to_dense()), v);
/// assert!(SparseVec::new(6, vec![4, 1], vec![1.0, 1.0]).is_err()); // not sorted
/// ```
#[derive(Clone, Debug, PartialEq, Default)]
pub struct SparseVec {
    /// The dense length.
    pub n: usize,
    /// Positions of the entries, strictly increasing, `< n`.
    pub indices: Vec<u64>,
    /// Values of the entries.
    pub values: Vec<f32>,
}

impl SparseVec {
    /// A validated sparse vector (see [`SparseVec::validate`]).
    pub fn new(n: usize, indices: Vec<u64>, values: Vec<f32>) -> std::result::Result<Self, String> {
        let v = SparseVec { n, indices, values };
        v.validate()?;
        Ok(v)
    }

    /// Checks the invariants: as many values as indices, indices strictly increasing and
    /// below `n`.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.indices.len() != self.values.len() {
            return Err(format!(
                "{} indices but {} values",
                self.indices.len(),
                self.values.len()
            ));
        }
        let mut prev = None;
        for (k, &i) in self.indices.iter().enumerate() {
            if i >= self.n as u64 {
                return Err(format!(
                    "index {i} (entry {k}) is not below the length {}",
                    self.n
                ));
            }
            if prev.is_some_and(|p| i <= p) {
                return Err(format!(
                    "indices are not strictly increasing at entry {k} ({} then {i})",
                    prev.unwrap_or_default()
                ));
            }
            prev = Some(i);
        }
        Ok(())
    }

    /// The non-zero entries of `dense`.
    pub fn from_dense(dense: &[f32]) -> Self {
        let mut v = SparseVec {
            n: dense.len(),
            ..Default::default()
        };
        for (i, &x) in dense.iter().enumerate() {
            if x != 0.0 {
                v.indices.push(i as u64);
                v.values.push(x);
            }
        }
        v
    }

    /// The dense vector (zeros where there is no entry).
    ///
    /// # Panics
    /// If an index is not below `n` (a vector that fails [`SparseVec::validate`]).
    pub fn to_dense(&self) -> Vec<f32> {
        let mut d = vec![0.0; self.n];
        for (&i, &v) in self.indices.iter().zip(&self.values) {
            d[i as usize] = v;
        }
        d
    }

    /// Number of entries.
    pub fn nnz(&self) -> usize {
        self.indices.len()
    }
}

/// The result of a sparse allreduce: sparse, or dense when it filled in (when the sparse form
/// would not be smaller: `entries·(index bytes + 4) ≥ n·4`, SparCML's byte rule).
#[derive(Clone, Debug, PartialEq)]
pub enum SparseResult {
    /// The entries of the sum.
    Sparse(SparseVec),
    /// The whole sum.
    Dense(Vec<f32>),
}

impl SparseResult {
    /// The dense length.
    pub fn len(&self) -> usize {
        match self {
            SparseResult::Sparse(v) => v.n,
            SparseResult::Dense(d) => d.len(),
        }
    }

    /// True for a vector of length zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dense vector.
    pub fn to_dense(&self) -> Vec<f32> {
        match self {
            SparseResult::Sparse(v) => v.to_dense(),
            SparseResult::Dense(d) => d.clone(),
        }
    }

    /// The dense vector, without a copy when it is dense already.
    pub fn into_dense(self) -> Vec<f32> {
        match self {
            SparseResult::Sparse(v) => v.to_dense(),
            SparseResult::Dense(d) => d,
        }
    }

    /// Number of non-zero values (the density of the result times its length).
    pub fn nnz(&self) -> usize {
        match self {
            SparseResult::Sparse(v) => v.values.iter().filter(|&&x| x != 0.0).count(),
            SparseResult::Dense(d) => d.iter().filter(|&&x| x != 0.0).count(),
        }
    }
}

/// A sparse allreduce schedule.
///
/// ```
/// use chorus_algorithms::sparse::SparseAlgo;
/// for a in SparseAlgo::ALL {
///     assert_eq!(SparseAlgo::parse(a.name()).unwrap(), a);
/// }
/// assert_eq!("dsar".parse::<SparseAlgo>().unwrap(), SparseAlgo::SplitAllgather);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SparseAlgo {
    /// SparCML's recursive doubling with the dense switch ([`recursive_doubling`]): few
    /// messages; best for small vectors and latency-bound cases.
    RecursiveDoubling,
    /// Split the index space into `p` regions, reduce each on its owner, allgather the
    /// owners' sums ([`split_allgather`], DSAR).
    SplitAllgather,
    /// Ok-Topk's two phases over balanced regions with a balanced allgatherv
    /// ([`two_phase`]); for top-k, `≤ 6k(p−1)/p` words per rank.
    TwoPhase,
}

impl SparseAlgo {
    /// Every schedule.
    pub const ALL: [SparseAlgo; 3] = [
        SparseAlgo::RecursiveDoubling,
        SparseAlgo::SplitAllgather,
        SparseAlgo::TwoPhase,
    ];

    /// The name in options and logs: `sparse_rd`, `dsar`, `two_phase`.
    pub const fn name(&self) -> &'static str {
        match self {
            SparseAlgo::RecursiveDoubling => "sparse_rd",
            SparseAlgo::SplitAllgather => "dsar",
            SparseAlgo::TwoPhase => "two_phase",
        }
    }

    /// The schedule named `s` (its [`SparseAlgo::name`], or `recursive_doubling`,
    /// `split_allgather`, `ok_topk`; case-insensitive, `-` for `_`).
    pub fn parse(s: &str) -> std::result::Result<Self, ParseNameError> {
        s.parse()
    }

    /// The number in this schedule's tags (bits 8..12 of the step).
    pub(crate) const fn id(&self) -> u64 {
        match self {
            SparseAlgo::RecursiveDoubling => 1,
            SparseAlgo::SplitAllgather => 2,
            SparseAlgo::TwoPhase => 3,
        }
    }

    /// The modelled time (seconds) of a sparse allreduce of vectors of length `n` with `nnz`
    /// entries each (uniformly random positions) over `p` ranks.
    pub fn cost(&self, n: usize, nnz: usize, p: usize, link: &Link) -> f64 {
        match self {
            SparseAlgo::RecursiveDoubling => recursive_doubling::cost(n, nnz, p, link),
            SparseAlgo::SplitAllgather => split_allgather::cost(n, nnz, p, link),
            SparseAlgo::TwoPhase => two_phase::cost(n, nnz, p, link),
        }
    }
}

impl fmt::Display for SparseAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SparseAlgo {
    type Err = ParseNameError;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let name = s.trim().to_ascii_lowercase().replace('-', "_");
        Ok(match name.as_str() {
            "sparse_rd" | "recursive_doubling" | "rd" => SparseAlgo::RecursiveDoubling,
            "dsar" | "split_allgather" => SparseAlgo::SplitAllgather,
            "two_phase" | "ok_topk" | "oktopk" => SparseAlgo::TwoPhase,
            _ => {
                return Err(ParseNameError {
                    what: "sparse allreduce algorithm",
                    input: s.to_string(),
                    expected: "sparse_rd, dsar, two_phase",
                })
            }
        })
    }
}

/// Payload bytes this rank moved in one call (segment headers and the small allreduces of
/// counts and thresholds included; the transport's own framing excluded).
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireStats {
    /// Bytes sent.
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
}

/// The exact sum of every rank's sparse vector. All ranks must pass vectors of the same `n`
/// and the same `algo`; every rank gets the identical result, sparse or dense (see
/// [`SparseResult`]), and the bytes it moved.
///
/// Errors: [`TransportError::InvalidArgument`] (nothing sent; the transport is still usable)
/// when `input` fails [`SparseVec::validate`]; [`TransportError::Mismatch`] when another rank
/// passed another `n` (for `n` above [`BOUND_ENTRIES_ABOVE_BYTES`] / 4, a
/// [`TransportError::Protocol`] naming that rank, found before any buffer is sized),
/// [`TransportError::Protocol`] when it chose another schedule or sent
/// bytes that are not a valid stream; otherwise the transport's errors. After those the
/// transport must be aborted.
pub fn sparse_all_reduce(
    ctx: &mut CollCtx<'_>,
    input: &SparseVec,
    algo: SparseAlgo,
) -> Result<(SparseResult, WireStats)> {
    input.validate().map_err(|e| {
        TransportError::InvalidArgument(format!("sparse_all_reduce: invalid input: {e}"))
    })?;
    let entries = Entries {
        n: input.n as u64,
        idx: &input.indices,
        val: &input.values,
    };
    let stamp = stream::Stamp::new(entries.n, &[KIND_SPARSE, algo.id()]);
    with_counting(ctx, |ctx| {
        let bound = entry_bound(ctx, entries)?;
        match algo {
            SparseAlgo::RecursiveDoubling => recursive_doubling::run(ctx, stamp, entries, bound),
            SparseAlgo::SplitAllgather => split_allgather::run(ctx, stamp, entries, bound),
            SparseAlgo::TwoPhase => two_phase::run(ctx, stamp, entries, bound),
        }
    })
}

/// Dense lengths (in bytes of f32) above which [`sparse_all_reduce`] first agrees on the
/// largest number of entries of any rank, so that its receive buffers are sized by the
/// entries rather than by `n`.
pub const BOUND_ENTRIES_ABOVE_BYTES: u64 = 16 << 20;

/// Entries of any rank, at most: `n`, or for large `n` the maximum over ranks (a small
/// allreduce, which also checks that every rank passed this `n` before anything is sized by
/// another rank's count; ranks that skip it, with a small `n`, fail on their next message).
fn entry_bound(ctx: &mut CollCtx<'_>, e: Entries<'_>) -> Result<u64> {
    if !bound_agreed(e.n, ctx.transport.size()) {
        return Ok(e.n);
    }
    let max = |ctx: &mut CollCtx<'_>, m: &mut [u64]| {
        crate::allreduce::run(
            crate::allreduce::Algorithm::RecursiveDoubling,
            ctx,
            None,
            bytemuck::cast_slice_mut(m),
            crate::DType::Uint64,
            crate::ReduceOp::Max,
        )
    };
    // The largest count, the largest n and the smallest n (as the largest !n).
    let mut m = [e.idx.len() as u64, e.n, !e.n];
    max(ctx, &mut m)?;
    let (largest, smallest) = (m[1], !m[2]);
    if largest != smallest {
        // Every rank sees the disagreement: name a rank whose n differs from this one's
        // (one more allreduce, on this failing path only).
        let rank = ctx.transport.rank() as u64;
        let mut who = [
            if e.n == smallest { rank } else { 0 },
            if e.n == largest { rank } else { 0 },
        ];
        max(ctx, &mut who)?;
        let (peer, theirs) = if e.n == largest {
            (who[0], smallest)
        } else {
            (who[1], largest)
        };
        return Err(TransportError::Protocol {
            peer: peer as usize,
            what: format!(
                "it passed a sparse vector of length {theirs}, this rank one of length {} \
                 (every rank must pass the same length)",
                e.n
            ),
        });
    }
    Ok(m[0].min(e.n))
}

/// Whether ranks agree on sizes before sizing buffers by them, for vectors of `n` positions
/// over `size` ranks: above [`BOUND_ENTRIES_ABOVE_BYTES`] of dense f32 and with peers
/// ([`entry_bound`]'s largest count; [`split_allgather`]'s lengths of the regions' sums).
pub(crate) fn bound_agreed(n: u64, size: usize) -> bool {
    size > 1 && n.saturating_mul(4) > BOUND_ENTRIES_ABOVE_BYTES
}

/// The first word of a [`sparse_all_reduce`] stamp.
const KIND_SPARSE: u64 = 0x5350_4152;

/// A rank's entries: sorted absolute indices and their values, of a vector of length `n`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entries<'a> {
    pub n: u64,
    pub idx: &'a [u64],
    pub val: &'a [f32],
}

impl<'a> Entries<'a> {
    /// The entries inside `lo..hi`.
    pub fn range(&self, lo: u64, hi: u64) -> (&'a [u64], &'a [f32]) {
        let a = self.idx.partition_point(|&i| i < lo);
        let b = self.idx.partition_point(|&i| i < hi);
        (&self.idx[a..b], &self.val[a..b])
    }
}

/// The tag of `step` (below 256) of schedule `alg` (below 16).
pub(crate) fn tag(ctx: &CollCtx<'_>, alg: u64, step: u64) -> Tag {
    debug_assert!(alg < 16 && step < 256);
    ctx.tag((alg << 8) | step)
}

/// The result for sorted entries `idx`/`val` of a vector of length `n`: dense when the byte
/// rule says so (values copied, zeros elsewhere).
pub(crate) fn finish(n: u64, idx: Vec<u64>, val: Vec<f32>) -> SparseResult {
    if prefers_dense(idx.len() as u64, n) {
        let mut d = vec![0.0; n as usize];
        for (&i, &v) in idx.iter().zip(&val) {
            d[i as usize] = v;
        }
        SparseResult::Dense(d)
    } else {
        SparseResult::Sparse(SparseVec {
            n: n as usize,
            indices: idx,
            values: val,
        })
    }
}

/// The result made of `views` (disjoint regions in increasing order; `peers[k]` sent
/// `views[k]`): dense when their entries (the non-zero values of dense views) pass the byte
/// rule, else their entries in order.
pub(crate) fn assemble(n: u64, views: &[SegView<'_>], peers: &[usize]) -> Result<SparseResult> {
    let mut end = 0u64;
    let mut total = 0u64;
    for (v, &peer) in views.iter().zip(peers) {
        if v.header.len == 0 {
            continue;
        }
        if v.header.start < end {
            return Err(TransportError::Protocol {
                peer,
                what: format!(
                    "sparse segment at {}.. overlaps the previous one (ending at {end})",
                    v.header.start
                ),
            });
        }
        end = v.header.start + v.header.len;
        let entries = if v.header.dense {
            v.values().filter(|&x| mag(x) != 0).count() as u64
        } else {
            v.count()
        };
        total = total.saturating_add(entries);
    }
    if prefers_dense(total, n) {
        let mut d = vec![0.0; n as usize];
        for v in views {
            v.write_to(&mut d);
        }
        return Ok(SparseResult::Dense(d));
    }
    let mut idx = Vec::with_capacity(total as usize);
    let mut val = Vec::with_capacity(total as usize);
    for v in views {
        v.append_to(&mut idx, &mut val, true);
    }
    Ok(SparseResult::Sparse(SparseVec {
        n: n as usize,
        indices: idx,
        values: val,
    }))
}

/// Posts every send and receive at once, waits for all of them, and returns the lengths
/// received.
pub(crate) fn exchange(
    t: &mut dyn Transport,
    deadline: Instant,
    sends: &[(usize, Tag, &[u8])],
    recvs: &mut [(usize, Tag, &mut [u8])],
) -> Result<Vec<usize>> {
    if sends.is_empty() && recvs.is_empty() {
        return Ok(Vec::new());
    }
    let mut sreq: Vec<Request> = sends
        .iter()
        .map(|&(peer, tag, b)| Request::send(peer, tag, b.len()))
        .collect();
    let mut rreq: Vec<Request> = recvs
        .iter()
        .map(|(peer, tag, b)| Request::recv(*peer, *tag, b.len()))
        .collect();
    for r in sreq.iter_mut().chain(rreq.iter_mut()) {
        t.post(r)?;
    }
    let mut ops: Vec<Op<'_, '_>> = Vec::with_capacity(sends.len() + recvs.len());
    for (r, s) in sreq.iter_mut().zip(sends) {
        ops.push(Op::send(r, s.2));
    }
    for (r, d) in rreq.iter_mut().zip(recvs.iter_mut()) {
        ops.push(Op::recv(r, &mut *d.2));
    }
    t.wait_all(&mut ops, deadline)?;
    drop(ops);
    Ok(rreq.iter().map(Request::bytes_done).collect())
}

/// Sends `sends` while receiving one message of at most `caps[k]` bytes from the `k`-th of
/// `peers` (all with tag `t`) into the context's scratch, and returns the received messages in
/// `peers` order, each cut to the length that arrived.
pub(crate) fn exchange_into_scratch<'c>(
    ctx: &'c mut CollCtx<'_>,
    t: Tag,
    sends: &[(usize, Tag, &[u8])],
    peers: impl IntoIterator<Item = usize>,
    caps: &[usize],
) -> Result<Vec<&'c [u8]>> {
    let deadline = ctx.deadline;
    let (tr, scratch) = ctx.transport_and_scratch(carve_len(caps))?;
    let mut bufs = carve(scratch, caps);
    let mut recvs: Vec<_> = peers
        .into_iter()
        .zip(bufs.iter_mut())
        .map(|(j, b)| (j, t, &mut **b))
        .collect();
    debug_assert_eq!(recvs.len(), caps.len(), "one capacity per peer");
    let got = exchange(tr, deadline, sends, &mut recvs)?;
    drop(recvs);
    Ok(bufs
        .into_iter()
        .zip(got)
        .map(|(b, g)| {
            let b: &'c [u8] = b;
            &b[..g]
        })
        .collect())
}

/// Cuts `buf` into slices of the given sizes (each start rounded up to 8 bytes, so values
/// read from an aligned buffer stay aligned).
pub(crate) fn carve<'s>(mut buf: &'s mut [u8], sizes: &[usize]) -> Vec<&'s mut [u8]> {
    let mut out = Vec::with_capacity(sizes.len());
    for &s in sizes {
        let (a, rest) = std::mem::take(&mut buf).split_at_mut(s);
        let pad = ((8 - s % 8) % 8).min(rest.len());
        buf = &mut rest[pad..];
        out.push(a);
    }
    out
}

/// Bytes [`carve`] needs for `sizes`.
pub(crate) fn carve_len(sizes: &[usize]) -> usize {
    sizes
        .iter()
        .map(|s| s.div_ceil(8).saturating_mul(8))
        .fold(0, usize::saturating_add)
}

/// A transport that counts the payload bytes moved through it.
struct Counting<'a, 't> {
    inner: &'a mut (dyn Transport + 't),
    stats: WireStats,
}

impl Transport for Counting<'_, '_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn post(&mut self, req: &mut Request) -> Result<()> {
        self.inner.post(req)
    }
    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> Result<bool> {
        const INLINE: usize = 32;
        let mut small = [0usize; INLINE];
        let mut large = Vec::new();
        let before: &mut [usize] = if ops.len() <= INLINE {
            &mut small[..ops.len()]
        } else {
            large.resize(ops.len(), 0);
            &mut large
        };
        for (b, op) in before.iter_mut().zip(ops.iter()) {
            *b = op.req.bytes_done();
        }
        let r = self.inner.progress(ops, wait);
        for (b, op) in before.iter().zip(ops.iter()) {
            let moved = op.req.bytes_done().saturating_sub(*b) as u64;
            match op.req.direction() {
                chorus_transport::Direction::Send => self.stats.bytes_sent += moved,
                chorus_transport::Direction::Recv => self.stats.bytes_received += moved,
            }
        }
        r
    }
    fn abort(&mut self, notice: &AbortNotice) {
        self.inner.abort(notice)
    }
}

/// Runs `f` on a context whose transport counts the bytes moved.
pub(crate) fn with_counting<R>(
    ctx: &mut CollCtx<'_>,
    f: impl FnOnce(&mut CollCtx<'_>) -> Result<R>,
) -> Result<(R, WireStats)> {
    let mut counting = Counting {
        inner: &mut *ctx.transport,
        stats: WireStats::default(),
    };
    let r = {
        let mut sub = CollCtx {
            transport: &mut counting,
            deadline: ctx.deadline,
            tag_base: ctx.tag_base,
            scratch: &mut *ctx.scratch,
        };
        f(&mut sub)
    }?;
    Ok((r, counting.stats))
}

/// The f32 magnitude of `v` as ordered bits (NaN above infinity, `−0.0` equal to `+0.0`).
#[inline]
pub(crate) fn mag(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in SparseAlgo::ALL {
            assert_eq!(a.name().parse::<SparseAlgo>().unwrap(), a);
            assert_eq!(
                a.to_string().to_uppercase().parse::<SparseAlgo>().unwrap(),
                a
            );
        }
        assert_eq!(
            "ok-topk".parse::<SparseAlgo>().unwrap(),
            SparseAlgo::TwoPhase
        );
        assert!("ring".parse::<SparseAlgo>().is_err());
    }

    #[test]
    fn sparse_vec_validation() {
        assert!(SparseVec::new(3, vec![0, 2], vec![1.0]).is_err());
        assert!(SparseVec::new(3, vec![0, 3], vec![1.0, 1.0]).is_err());
        assert!(SparseVec::new(3, vec![1, 1], vec![1.0, 1.0]).is_err());
        assert!(SparseVec::new(0, vec![], vec![]).is_ok());
        let r = finish(10, vec![1, 2, 3, 4, 5], vec![1.0; 5]);
        assert!(matches!(r, SparseResult::Dense(_)));
        assert_eq!(r.nnz(), 5);
        let r = finish(10, vec![1, 2, 3, 4], vec![1.0; 4]);
        assert!(matches!(r, SparseResult::Sparse(_)));
    }

    #[test]
    fn carve_keeps_alignment() {
        let sizes = [5, 0, 13, 8];
        let mut buf = vec![0u8; carve_len(&sizes)];
        let base = buf.as_ptr() as usize;
        let parts = carve(&mut buf, &sizes);
        let lens: Vec<_> = parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, sizes);
        for p in &parts {
            assert_eq!((p.as_ptr() as usize - base) % 8, 0);
        }
    }
}
