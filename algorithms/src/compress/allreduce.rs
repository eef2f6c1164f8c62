//! Compressed allreduce of f32 data: two schedules that quantize each contribution once, so
//! the error does not grow with the number of ranks (re-quantizing partial sums at every hop of
//! a ring makes it grow like √p, DESIGN §3).
//!
//! # Words
//! - **chunk**: `chunk` consecutive values sharing one scale (the last one may be shorter).
//! - **slice**: the whole chunks one rank **owns**: the `⌈n/chunk⌉` chunks are dealt out in
//!   order, the first `chunks mod p` ranks getting one more ([`plan`]). Slices of small
//!   tensors can be empty.
//! - **round**: every rank sends one message to every other rank and receives one from each,
//!   all posted at once; messages of a round share a tag. Received messages are processed in
//!   a fixed order (from rank `r−1` down), so results are reproducible run to run.
//! - **group**: whole chunks, at least 64 Ki values and about a sixteenth of the tensor, the
//!   unit of pipelining (tensors of up to 256 Ki values are one group). Sends are
//!   posted empty and widened group by group as their bytes are computed
//!   ([`Request::set_available`]), the transport is given a chance to move bytes after each
//!   group, and received messages are consumed group by group (or chunk by chunk) as their
//!   bytes arrive. So encoding, the wire and decoding overlap, which is what matters when the
//!   ranks share cores or a link.
//!
//! # Scatter-gather (any codec)
//! 1. Round 1: for every other rank `j`, encode this rank's values of slice `j` (with error
//!    feedback: of `g + e`, keeping what was lost in `e`) group by group and send them. Encode
//!    the own slice the same way and decode it: the sum starts there. Add the other ranks'
//!    encodings of the own slice, decoded, in f32, as they arrive (rank by rank in the fixed
//!    order, so the f32 sums are reproducible). (Every contribution is quantized exactly once,
//!    so the error is the same whatever the number of ranks.)
//! 2. The owner divides the sum by `p` for `Avg` (in f32; a group whose f32 sum overflowed
//!    is summed again in f64 first), adds its owner residual (error feedback) and encodes the
//!    result once.
//! 3. Round 2: send that encoding to every rank, unchanged, group by group as it is encoded;
//!    decode every other slice's encoding as it arrives. Every rank, the owner too, decodes
//!    all slices from the same bytes, so all ranks end bit-identical.
//!
//! # Integer domain (int8, int4, ternary)
//! 1. Round 1: send every rank this rank's range (largest magnitude, clipped for
//!    `ternary-clip`) of every chunk; each rank keeps the largest of each, exactly (ranges
//!    are compared as bit patterns), so all ranks hold the same shared ranges after one round
//!    trip.
//! 2. Round 2: quantize every chunk at its shared step `range/L` by stochastic rounding and send
//!    each owner the packed codes (no scales: all ranks know them), a group of every owner's
//!    slice in turn. The owner adds the codes of all ranks as integers, exactly (i32 lanes),
//!    a group as soon as every rank's codes for it have arrived.
//! 3. Round 3, overlapping round 2: each owner sends the sums of each finished group, packed
//!    in `w = ⌈log₂(2·p·L + 1)⌉` bits each (int8: 9 bits at p = 2, 11 at p = 8; widths 9 to 16
//!    as a plane of low bytes and a plane of the high `w − 8` bits, per block of 256), to
//!    every rank; every rank decodes `sum·step` (then `/p` for `Avg`) as they arrive.
//!
//! The reduce-scatter is done as a direct exchange rather than around a ring: the same
//! number of messages and bytes per rank, but each value travels as its `b`-bit code instead
//! of as a partial sum that needs wider lanes at every hop.
//!
//! # Volume (bytes each rank sends; receives as much), `n` values, `b` bits per code
//! - scatter-gather: `2·(p−1)/p · n·b/8`, plus 4 bytes per chunk and 16 per message of round 1;
//! - integer domain: `(p−1)/p · n·(b + ⌈log₂(2·p·L + 1)⌉)/8`, plus `(p−1) · 4` bytes per
//!   chunk (the ranges) and 16 per message of round 1.
//!
//! # Wire format
//! Each message of round 1 starts with a 16-byte header: `"CMP1"`, the chunk size (u32) and
//! the number of values (u64), little-endian. A rank whose header differs from its own fails
//! with [`TransportError::Mismatch`] (another count) or [`TransportError::Protocol`]; the
//! codec, schedule and op are part of the tag, so ranks that disagree on those fail with a tag
//! mismatch. Message lengths are then determined by the header, and the transport checks them.
//!
//! # Bad data
//! Nothing a peer sends can make a rank panic or allocate beyond what the call's own size
//! bounds (an average whose f32 sum overflowed is summed again in f64, with buffers of up to
//! the owned slice, allocated fallibly): every scale, range and code is
//! checked. A problem is recorded, what depends on the bad data is marked (NaN values before
//! re-encoding, or a reserved all-ones sum), and the schedule finishes its rounds; every rank
//! then fails, the transport still in step. NaN or ±∞ in an input (which the scaled codecs
//! cannot carry) give [`TransportError::InvalidArgument`] on every rank, the transport usable.
//! Invalid codes give [`TransportError::Protocol`] naming the rank that sent them on the
//! rank that received them; the other ranks see only what was marked: under scatter-gather
//! they fail as for a non-finite input (until the receiver's abort reaches them), under the
//! integer ring with a `Protocol` error naming the owner whose sums were marked. A sum of
//! `Sum` beyond f32's range fails as a non-finite input does under scatter-gather, and gives
//! ±∞ under the integer ring. One exception to finishing the rounds: under the integer ring a
//! rank whose shared ranges are not finite stops after round 1 (every rank holds the same
//! ranges, so all stop alike), which a peer that sends a NaN range to some ranks only (no
//! encoder does) turns into a wait until the others' timeout.

use std::ops::Range;
use std::time::Instant;

use chorus_transport::{Direction, Op, Request, Result, Tag, Transport, TransportError, Wait};

use super::pack::{
    block_len, pack_block, pack_codes, packed_len, unpack_block, unpack_codes, width_for,
};
use super::rng::Dither;
use super::stochastic::{self, Levels};
use super::{
    apply, Codec, CodecError, CompressedOptions, Mode, Residual, Rng, Schedule, WireStats, BLOCK,
};
use crate::{CollCtx, ReduceOp};

/// Bytes of the header of each round-1 message.
pub const HEADER_BYTES: usize = 16;
const MAGIC: [u8; 4] = *b"CMP1";

/// Scratch regions start on this boundary (typed views need 4).
const ALIGN: usize = 64;

/// Which chunks and values each rank owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Values per scale.
    pub chunk: usize,
    /// Per rank: the chunks it owns (indices into the `⌈n/chunk⌉` chunks).
    pub chunks: Vec<Range<usize>>,
    /// Per rank: the values it owns (whole chunks, the last possibly short).
    pub slices: Vec<Range<usize>>,
}

/// The slices of `n` values in chunks of `chunk` over `size` ranks.
///
/// ```
/// use chorus_algorithms::compress::plan;
/// let p = plan(2500, 2, 1024); // chunks of 1024, 1024, 452
/// assert_eq!(p.chunks, vec![0..2, 2..3]);
/// assert_eq!(p.slices, vec![0..2048, 2048..2500]);
/// ```
///
/// # Panics
/// If `size` or `chunk` is zero.
pub fn plan(n: usize, size: usize, chunk: usize) -> Plan {
    assert!(
        size > 0 && chunk > 0,
        "plan of zero ranks or chunk size zero"
    );
    let total = n.div_ceil(chunk);
    let (base, extra) = (total / size, total % size);
    let chunks: Vec<Range<usize>> = (0..size)
        .map(|j| {
            let start = j * base + j.min(extra);
            start..start + base + usize::from(j < extra)
        })
        .collect();
    let slices = chunks
        .iter()
        .map(|c| (c.start * chunk).min(n)..(c.end * chunk).min(n))
        .collect();
    Plan {
        chunk,
        chunks,
        slices,
    }
}

/// Allreduces `data` (f32, in place) with compression; every rank must pass the same length,
/// options and op, and its own `rng` stream (e.g. `Rng::new(seed, rank)`).
///
/// `op` is [`ReduceOp::Sum`] or [`ReduceOp::Avg`] (divided by the number of ranks: by the
/// owner before it re-encodes under scatter-gather, after decoding under the integer ring). With `opts.error_feedback`, `residual` carries what compression lost
/// from one call to the next on this tensor (see [`Residual`] for when it is reset). One rank returns its input unchanged (nothing to compress); with error
/// feedback the residual is added first and cleared.
///
/// Every rank ends with bit-identical values. Returns the bytes this rank sent and received.
///
/// Errors: [`TransportError::InvalidArgument`] before anything is sent for a bad op, chunk
/// size, schedule or a missing residual; [`TransportError::InvalidArgument`] on every rank,
/// after all messages, if an input holds NaN or ±∞ that the codec cannot carry (the output is
/// then unspecified, the transport usable); [`TransportError::Mismatch`] or
/// [`TransportError::Protocol`] if ranks disagree on the arguments or a peer sends invalid
/// data, and the transport's errors (after those the transport must be aborted).
pub fn all_reduce_compressed(
    ctx: &mut CollCtx<'_>,
    data: &mut [f32],
    op: ReduceOp,
    opts: &CompressedOptions,
    rng: &mut Rng,
    mut residual: Option<&mut Residual>,
) -> Result<WireStats> {
    let schedule = opts.schedule();
    validate(op, opts, schedule, ctx.transport.size(), residual.is_some())?;
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let n = data.len();
    let residual = if opts.error_feedback {
        residual.take()
    } else {
        None
    };
    if size == 1 {
        if let Some(r) = residual {
            resize_zeroed(&mut r.local, n);
            apply(Mode::Add, data, &r.local);
            r.local.fill(0.0);
            r.owner.clear();
        }
        return Ok(WireStats::default());
    }
    let plan = plan(n, size, opts.chunk);
    let mut run = Run {
        rank,
        size,
        n,
        codec: opts.codec,
        plan,
        avg: op == ReduceOp::Avg,
        deadline: ctx.deadline,
        stats: WireStats::default(),
        fault: None,
    };
    let cfg = opts.codec.id()
        | u64::from(schedule == Schedule::IntegerRing) << 3
        | u64::from(run.avg) << 4;
    let tags = [0, 1, 2, 3].map(|round| ctx.tag(cfg << 2 | round));
    match schedule {
        Schedule::ScatterGather => scatter_gather(ctx, &mut run, &tags, data, rng, residual)?,
        Schedule::IntegerRing => integer(ctx, &mut run, &tags, data, rng, residual)?,
    }
    match run.fault {
        Some(e) => Err(e),
        None => Ok(run.stats),
    }
}

fn validate(
    op: ReduceOp,
    opts: &CompressedOptions,
    schedule: Schedule,
    size: usize,
    has_residual: bool,
) -> Result<()> {
    let invalid = |m: String| {
        Err(TransportError::InvalidArgument(format!(
            "compressed allreduce: {m}"
        )))
    };
    if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        return invalid(format!("op {} is not sum or avg", op.name()));
    }
    if opts.chunk == 0 || u32::try_from(opts.chunk).is_err() {
        return invalid(format!("chunk size {} is not in 1..2^32", opts.chunk));
    }
    if schedule == Schedule::IntegerRing {
        let Some(lv) = opts.codec.levels() else {
            return invalid(format!(
                "codec {} has no integer-domain schedule (int8, int4 and ternary do)",
                opts.codec
            ));
        };
        // Sums travel as unsigned values below 2·p·L + 1 in at most 32 bits.
        if size.saturating_mul(2 * lv.max as usize) >= i32::MAX as usize {
            return invalid(format!("{size} ranks are too many for exact i32 sums"));
        }
    }
    if opts.error_feedback && !has_residual {
        return invalid("error feedback is on but no residual was given".into());
    }
    Ok(())
}

/// What one rank's call knows and has done.
struct Run {
    rank: usize,
    size: usize,
    n: usize,
    codec: Codec,
    plan: Plan,
    avg: bool,
    deadline: Instant,
    stats: WireStats,
    /// The first problem found in a peer's data (returned after the last round).
    fault: Option<TransportError>,
}

impl Run {
    /// Peers in the order their messages are processed: `r−1, r−2, …`.
    fn order(&self) -> impl Iterator<Item = usize> {
        let (r, p) = (self.rank, self.size);
        (1..p).map(move |k| (r + p - k) % p)
    }

    fn record(&mut self, e: TransportError) {
        self.fault.get_or_insert(e);
    }

    /// The error for a chunk that decoded as NaN or ±∞: which values, and from whom.
    fn non_finite(&self, chunk: usize, from: usize, owner_sum: bool) -> TransportError {
        let c = self.plan.chunk;
        let vals = chunk * c..((chunk + 1) * c).min(self.n);
        let who = if owner_sum {
            format!(
                "the sum of elements {vals:?} (owned by rank {from}) is not finite: some rank's \
                 input holds NaN or inf there, or the sum overflows float32"
            )
        } else {
            format!("rank {from}'s input holds NaN or inf in elements {vals:?}")
        };
        TransportError::InvalidArgument(format!(
            "compressed allreduce: {who}; codec {} cannot carry them",
            self.codec
        ))
    }

    /// The error for bytes no encoder makes.
    fn garbage(&self, from: usize, what: String) -> TransportError {
        TransportError::Protocol {
            peer: from,
            what: format!("compressed allreduce ({}): {what}", self.codec),
        }
    }

    /// Turns a decode error on data from `from` (starting at global chunk `first`) into the
    /// schedule's error.
    fn decode_error(
        &self,
        e: CodecError,
        from: usize,
        first: usize,
        owner_sum: bool,
    ) -> TransportError {
        match e {
            CodecError::NonFinite { chunk } => self.non_finite(first + chunk, from, owner_sum),
            CodecError::Invalid { chunk, what } => {
                self.garbage(from, format!("chunk {}: {what}", first + chunk))
            }
            other => self.garbage(from, other.to_string()),
        }
    }

    fn header(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[..4].copy_from_slice(&MAGIC);
        h[4..8].copy_from_slice(&(self.plan.chunk as u32).to_le_bytes());
        h[8..].copy_from_slice(&(self.n as u64).to_le_bytes());
        h
    }

    /// Checks a peer's header against this rank's arguments.
    fn check_header(&self, from: usize, tag: Tag, h: &[u8]) -> Result<()> {
        let mine = self.header();
        if h[..4] != MAGIC {
            return Err(self.garbage(from, "not a compressed-allreduce message".into()));
        }
        let chunk = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let mut nb = [0u8; 8];
        nb.copy_from_slice(&h[8..16]);
        let n = u64::from_le_bytes(nb);
        if n != self.n as u64 {
            // Reported in bytes of f32 data, as the dense schedules report lengths.
            return Err(TransportError::Mismatch {
                peer: from,
                expected_tag: tag,
                got_tag: tag,
                expected_len: self.n.saturating_mul(4),
                got_len: usize::try_from(n).unwrap_or(usize::MAX).saturating_mul(4),
            });
        }
        if h != mine {
            return Err(self.garbage(
                from,
                format!("chunk size {chunk} there, {} here", self.plan.chunk),
            ));
        }
        Ok(())
    }
}

fn resize_zeroed(v: &mut Vec<f32>, len: usize) {
    if v.len() != len {
        v.clear();
        v.resize(len, 0.0);
    }
}

/// Splits `buf` into consecutive pieces of `lens` bytes.
fn cut(mut buf: &mut [u8], lens: impl Iterator<Item = usize>) -> Vec<&mut [u8]> {
    let mut out = Vec::new();
    for len in lens {
        let (head, rest) = std::mem::take(&mut buf).split_at_mut(len);
        out.push(head);
        buf = rest;
    }
    out
}

/// Splits off the first `len` bytes, the rest starting [`ALIGN`]-aligned (if `buf` is).
fn split_aligned(buf: &mut [u8], len: usize) -> (&mut [u8], &mut [u8]) {
    let (a, b) = buf.split_at_mut(len.next_multiple_of(ALIGN));
    (&mut a[..len], b)
}

fn round_up(len: usize) -> usize {
    len.next_multiple_of(ALIGN)
}

fn divide(data: &mut [f32], size: usize) {
    let p = size as f32;
    data.iter_mut().for_each(|v| *v /= p);
}

/// Scatter-gather (see the module documentation).
fn scatter_gather(
    ctx: &mut CollCtx<'_>,
    run: &mut Run,
    tags: &[Tag; 4],
    data: &mut [f32],
    rng: &mut Rng,
    mut residual: Option<&mut Residual>,
) -> Result<()> {
    let (me, p, codec, chunk, n) = (run.rank, run.size, run.codec, run.plan.chunk, run.n);
    let slices = run.plan.slices.clone();
    let own = slices[me].clone();
    let enc_len = |j: usize| codec.encoded_len(slices[j].len(), chunk);
    if let Some(r) = residual.as_deref_mut() {
        // Another tensor (another length) or another slice of it: the owner's residual
        // belongs to neither.
        if r.local.len() != run.n || r.owner_slice != own {
            r.owner.clear();
            r.owner_slice = own.clone();
        }
        resize_zeroed(&mut r.local, run.n);
        resize_zeroed(&mut r.owner, own.len());
    }
    // Round 1 needs the outgoing pieces and p incoming ones; round 2 the p encoded slices.
    let piece = |j: usize| {
        if j == me {
            0
        } else {
            HEADER_BYTES + enc_len(j)
        }
    };
    let out1: usize = (0..p).map(piece).sum();
    let in_len = |i: usize| enc_len(me) + if i == me { 0 } else { HEADER_BYTES };
    let in1: usize = (0..p).map(in_len).sum();
    let all2: usize = (0..p).map(enc_len).sum();
    let need = (round_up(out1) + in1).max(all2);
    let (t, scratch) = ctx.transport_and_scratch(need)?;

    // Round 1: pieces out, own slice's pieces in and summed.
    let mut poisoned = false;
    {
        let (out_buf, rest) = split_aligned(scratch, out1);
        let mut outs = cut(out_buf, (0..p).map(piece));
        let mut inbox = cut(&mut rest[..in1], (0..p).map(in_len));
        let mut round = Round::new(p, me, 1, tags[0], run.deadline);
        for i in run.order() {
            round.post_recv(t, i, HEADER_BYTES + enc_len(me))?;
        }
        let header = run.header();
        // Every send is posted with its first group and widened group by group as it is
        // encoded.
        for k in 1..p {
            let j = (me + k) % p;
            outs[j][..HEADER_BYTES].copy_from_slice(&header);
            let mut pos = HEADER_BYTES;
            for g in groups(slices[j].clone(), chunk, n) {
                let len = codec.encoded_len(g.len(), chunk);
                let body = &mut outs[j][pos..pos + len];
                match residual.as_deref_mut() {
                    Some(r) => codec.encode_with_feedback(
                        &data[g.clone()],
                        &mut r.local[g],
                        chunk,
                        body,
                        rng,
                    ),
                    None => codec.encode(&data[g], chunk, body, rng),
                }
                pos += len;
                round.offer(t, j, tags[0], outs[j].len(), pos, &mut run.stats)?;
                round.progress(t, |j| &*outs[j], &mut inbox, false)?;
            }
            round.offer(t, j, tags[0], outs[j].len(), pos, &mut run.stats)?;
        }
        round.progress(t, |j| &*outs[j], &mut inbox, false)?;
        // The own values go through the codec too (each contribution is quantized exactly
        // once, whoever owns it): they start the sum.
        let first = run.plan.chunks[me].start;
        let mine = &mut *inbox[me];
        // (Encoded whole before any of it is overwritten by the decoded sum.)
        match residual.as_deref_mut() {
            Some(r) => codec.encode_with_feedback(
                &data[own.clone()],
                &mut r.local[own.clone()],
                chunk,
                mine,
                rng,
            ),
            None => codec.encode(&data[own.clone()], chunk, mine, rng),
        }
        // The sum, group by group so that it stays in cache: the own piece decoded, then the
        // peers' pieces added in a fixed order (r−1, r−2, …: f32 sums are reproducible), each
        // as soon as it has arrived.
        for i in run.order() {
            let got = round.wait_bytes(t, i, HEADER_BYTES, |j| &*outs[j], &mut inbox)?;
            if got >= HEADER_BYTES {
                run.check_header(i, tags[0], &inbox[i][..HEADER_BYTES])?;
            }
        }
        'groups: for g in groups(own.clone(), chunk, n) {
            let from = codec.encoded_len(g.start - own.start, chunk);
            let to = from + codec.encoded_len(g.len(), chunk);
            let gfirst = first + (g.start - own.start) / chunk;
            if let Err(e) = codec.decode(&inbox[me][from..to], chunk, &mut data[g.clone()]) {
                let e = run.decode_error(e, me, gfirst, false);
                run.record(e);
                poisoned = true;
            }
            for i in run.order() {
                let need = HEADER_BYTES + to;
                if round.wait_bytes(t, i, need, |j| &*outs[j], &mut inbox)? < need {
                    break 'groups; // a short message: `wait_recv` reports it
                }
                let body = &inbox[i][HEADER_BYTES + from..need];
                if let Err(e) = codec.decode_add(body, chunk, &mut data[g.clone()]) {
                    let e = run.decode_error(e, i, gfirst, false);
                    run.record(e);
                    poisoned = true;
                }
            }
        }
        if poisoned {
            // The sum re-encodes with NaN scales, so every rank fails.
            data[own.clone()].fill(f32::NAN);
        }
        for i in run.order() {
            // Fails here if a message was shorter than posted.
            round.wait_recv(t, i, |j| &*outs[j], &mut inbox, &mut run.stats)?;
        }
        // An average is divided before the owner re-quantizes it, not after: the sum of p
        // values a codec carries (fp16's ±65504) can lie beyond its range where their mean
        // does not. Nor need the sum fit in f32: a group whose f32 sum overflowed is summed
        // again from the same codes in f64 (the others keep their f32 sum, bit for bit).
        if run.avg {
            for g in groups(own.clone(), chunk, n) {
                let sum = &mut data[g.clone()];
                if poisoned || sum.iter().all(|v| v.is_finite()) {
                    divide(sum, p);
                    continue;
                }
                let from = codec.encoded_len(g.start - own.start, chunk);
                let to = from + codec.encoded_len(g.len(), chunk);
                let pieces = std::iter::once(&inbox[me][from..to]).chain(
                    run.order()
                        .map(|i| &inbox[i][HEADER_BYTES + from..HEADER_BYTES + to]),
                );
                // (Fallible: a group is up to the owned slice, whose size the caller chose.)
                let mut wide = crate::context::try_zeroed::<f64>(g.len())?;
                let mut one = crate::context::try_zeroed::<f32>(g.len())?;
                for body in pieces {
                    // Decoded once already, without error (or the slice is poisoned).
                    if codec.decode(body, chunk, &mut one).is_err() {
                        one.fill(f32::NAN);
                    }
                    wide.iter_mut()
                        .zip(&one)
                        .for_each(|(w, &v)| *w += f64::from(v));
                }
                // A non-finite input gives the same non-finite mean as in f32.
                let count = p as f64;
                sum.iter_mut()
                    .zip(&wide)
                    .for_each(|(v, &w)| *v = (w / count) as f32);
            }
        }
        round.finish_sends(t, |j| &*outs[j], &mut inbox)?;
    }

    // Round 2: the owner's one re-quantization, then the codes go round unchanged.
    let mut slots = cut(&mut scratch[..all2], (0..p).map(enc_len));
    let mine = std::mem::take(&mut slots[me]);
    let mut round = Round::new(p, me, 1, tags[1], run.deadline);
    for i in run.order() {
        round.post_recv(t, i, enc_len(i))?;
    }
    let mut pos = 0;
    for g in groups(own.clone(), chunk, n) {
        let len = codec.encoded_len(g.len(), chunk);
        let out = &mut mine[pos..pos + len];
        let o = g.start - own.start..g.end - own.start;
        // A poisoned sum fails every rank, and one that is not finite (NaN or ±∞ in an
        // input, or an overflow) either fails every rank or carries NaN or ±∞ in its
        // result (fp16, bf16): the owner residual stays as it was, untouched by it.
        let finite = super::all_finite(&data[g.clone()]);
        match residual.as_deref_mut().filter(|_| !poisoned && finite) {
            // The owner residual is kept in units of the sum, whatever the op, so that a
            // compressor used for sums and averages in turn stays consistent: an average
            // takes its p-th part and gives back p times what its encoding lost.
            Some(r) if run.avg => {
                divide(&mut r.owner[o.clone()], p);
                codec.encode_with_feedback(&data[g], &mut r.owner[o.clone()], chunk, out, rng);
                // (Back in units of the sum; one beyond f32's range is dropped, as a
                // non-finite residual is.)
                for e in &mut r.owner[o] {
                    *e *= p as f32;
                    if !e.is_finite() {
                        *e = 0.0;
                    }
                }
            }
            Some(r) => codec.encode_with_feedback(&data[g], &mut r.owner[o], chunk, out, rng),
            None => codec.encode(&data[g], chunk, out, rng),
        }
        pos += len;
        round.offer_all(t, 0, tags[1], mine.len(), pos, &mut run.stats)?;
        round.progress(t, |_| &*mine, &mut slots, false)?;
    }
    round.offer_all(t, 0, tags[1], mine.len(), pos, &mut run.stats)?;
    let mine: &[u8] = mine;
    for i in std::iter::once(me).chain(run.order()) {
        let s = slices[i].clone();
        let first = run.plan.chunks[i].start;
        let mut pos = 0;
        for g in groups(s.clone(), chunk, n) {
            let len = codec.encoded_len(g.len(), chunk);
            if i != me {
                let got = round.wait_bytes(t, i, pos + len, |_| mine, &mut slots)?;
                if got < pos + len {
                    break; // a short message: `wait_recv` reports it
                }
            }
            let bytes: &[u8] = if i == me { mine } else { slots[i] };
            let gfirst = first + (g.start - s.start) / chunk;
            if let Err(e) = codec.decode(&bytes[pos..pos + len], chunk, &mut data[g.clone()]) {
                let e = run.decode_error(e, i, gfirst, true);
                run.record(e);
            }
            pos += len;
        }
        if i != me {
            round.wait_recv(t, i, |_| mine, &mut slots, &mut run.stats)?;
        }
    }
    round.finish_sends(t, |_| mine, &mut slots)?;
    Ok(())
}

/// `values` (whole chunks of `chunk` from its start, the last possibly short) cut into groups
/// of whole chunks of at least [`GROUP`] values and about a sixteenth of the tensor's `n`:
/// the unit in which the schedules encode, send and decode, so that bytes move while the
/// rest is computed. Tensors of up to [`PIPELINE_MIN`] values are one group: their messages
/// are short, and waking up for each piece would cost more than the overlap saves.
fn groups(values: Range<usize>, chunk: usize, n: usize) -> impl Iterator<Item = Range<usize>> {
    let step = if n <= PIPELINE_MIN {
        values.len().max(1)
    } else {
        (GROUP.max(n / 16) / chunk).max(1) * chunk
    };
    let end = values.end;
    (values.start..end)
        .step_by(step)
        .map(move |s| s..(s + step).min(end))
}

/// Integer domain (see the module documentation).
fn integer(
    ctx: &mut CollCtx<'_>,
    run: &mut Run,
    tags: &[Tag; 4],
    data: &mut [f32],
    rng: &mut Rng,
    mut residual: Option<&mut Residual>,
) -> Result<()> {
    let (me, p, chunk, n) = (run.rank, run.size, run.plan.chunk, run.n);
    let lv = run.codec.levels().expect("validated: a stochastic codec");
    let chunks = run.plan.chunks.clone();
    let slices = run.plan.slices.clone();
    let own = slices[me].clone();
    let total = n.div_ceil(chunk);
    if let Some(r) = residual.as_deref_mut() {
        resize_zeroed(&mut r.local, n);
        r.owner.clear();
    }
    let sum_lanes = SumLanes::new(p, lv);
    // Codes and sums of a slice are packed chunk by chunk, each chunk from a byte boundary.
    let per_chunk = |j: usize, bits: u32| -> usize {
        let len = slices[j].len();
        (len / chunk) * packed_len(chunk, bits) + packed_len(len % chunk, bits)
    };
    let codes_len = |j: usize| per_chunk(j, lv.bits);
    // Sums travel block by block (see `pack_block`).
    let sum_bytes = |m: usize| {
        let w = sum_lanes.width;
        (m / BLOCK) * block_len(BLOCK, w) + block_len(m % BLOCK, w)
    };
    let sums_len = |j: usize| {
        let len = slices[j].len();
        (len / chunk) * sum_bytes(chunk) + sum_bytes(len % chunk)
    };
    let ranges_len = HEADER_BYTES + 4 * total;
    let others = |f: &dyn Fn(usize) -> usize, j: usize| if j == me { 0 } else { f(j) };
    let out_len = |f: &dyn Fn(usize) -> usize| (0..p).map(|j| others(f, j)).sum::<usize>();
    let r1 = round_up(ranges_len) + p * ranges_len;
    let r23 = round_up(out_len(&codes_len))
        + round_up((p - 1) * codes_len(me))
        + round_up(sums_len(me))
        + out_len(&sums_len);
    let need = round_up(4 * total) + round_up(4 * own.len()) + r1.max(r23);
    let (t, scratch) = ctx.transport_and_scratch(need)?;
    let (shared, rest) = split_aligned(scratch, 4 * total);
    let (sums, work) = split_aligned(rest, 4 * own.len());
    let values = |c: usize| c * chunk..((c + 1) * chunk).min(n);

    // Round 1: every rank's local ranges (of g + e with error feedback) to every rank;
    // each keeps the largest of each chunk, so all hold the same shared ranges after one
    // round trip.
    {
        let (out_buf, rest) = split_aligned(work, ranges_len);
        let mut inbox = cut(rest, (0..p).map(|i| if i == me { 0 } else { ranges_len }));
        let mut round = Round::new(p, me, 1, tags[0], run.deadline);
        for i in run.order() {
            round.post_recv(t, i, ranges_len)?;
        }
        let (h, body) = out_buf.split_at_mut(HEADER_BYTES);
        h.copy_from_slice(&run.header());
        for (b, c) in body.chunks_exact_mut(4).zip(0..total) {
            let s = values(c);
            let range = match residual.as_deref() {
                Some(r) => stochastic::local_range_sum(&data[s.clone()], &r.local[s], lv.clip),
                None => stochastic::local_range(&data[s], lv.clip),
            };
            b.copy_from_slice(&range.to_bits().to_le_bytes());
        }
        let out: &[u8] = out_buf;
        for k in 1..p {
            round.post_send(t, (me + k) % p, out.len(), &mut run.stats)?;
        }
        round.progress(t, |_| out, &mut inbox, false)?;
        shared.copy_from_slice(&out[HEADER_BYTES..]);
        let mine: &mut [u32] = bytemuck::cast_slice_mut(&mut shared[..]);
        for i in run.order() {
            round.wait_recv(t, i, |_| out, &mut inbox, &mut run.stats)?;
            let (h, body) = inbox[i].split_at(HEADER_BYTES);
            run.check_header(i, tags[0], h)?;
            let mut negative = 0u32;
            for (m, b) in mine.iter_mut().zip(body.chunks_exact(4)) {
                let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                // Non-negative floats order as their bit patterns (NaN above ∞ above the
                // finite ones), so the maximum is exact and the same on every rank. A
                // negative range (sign bit set, above every NaN) no encoder sends: it is
                // caught below, and poisons the chunk as a NaN range would.
                negative |= bits & 0x8000_0000;
                *m = (*m).max(bits);
            }
            if negative != 0 {
                let c = body
                    .chunks_exact(4)
                    .position(|b| b[3] & 0x80 != 0)
                    .unwrap_or(0);
                let e = run.garbage(i, format!("a negative range for chunk {c}"));
                run.record(e);
            }
        }
        round.finish_sends(t, |_| out, &mut inbox)?;
    }
    let shared: &[u32] = bytemuck::cast_slice(&shared[..]);
    // Every rank holds the same ranges now: a NaN or infinite one fails all ranks alike,
    // before any code is sent.
    if let Some(c) = shared.iter().position(|&b| b >= 0x7f80_0000) {
        if run.fault.is_none() {
            let owner = (0..p).find(|&j| chunks[j].contains(&c)).unwrap_or(me);
            let e = run.non_finite(c, owner, true);
            run.record(e);
        }
        return Ok(());
    }
    let range = |c: usize| f32::from_bits(shared[c]);

    // Rounds 2 and 3, overlapped group by group (whole chunks, about `GROUP` values):
    // each rank quantizes a group of every owner's slice in turn and lets it go at once; an
    // owner adds up a group of its slice as soon as every rank's codes for it have arrived
    // (exactly, as integers: the order does not matter) and sends its sums to every rank at
    // once; every rank decodes the slices as their sums arrive. Round 2's messages are in
    // slots `0..p` of the round, round 3's in `p..2p`.
    let sums: &mut [i32] = bytemuck::cast_slice_mut(sums);
    let (out_buf, rest) = split_aligned(work, out_len(&codes_len));
    let (in_buf, rest) = split_aligned(rest, (p - 1) * codes_len(me));
    let (mine, rest) = split_aligned(rest, sums_len(me));
    let mut outs = cut(out_buf, (0..p).map(|j| others(&codes_len, j)));
    let mut inbox = cut(in_buf, (0..p).map(|i| others(&|_| codes_len(me), i)));
    inbox.extend(cut(rest, (0..p).map(|i| others(&sums_len, i))));
    let mut round = Round::new(p, me, 2, tags[2], run.deadline);
    for i in run.order() {
        let (codes, sums_in) = (
            Request::recv(i, tags[2], codes_len(me)),
            Request::recv(i, tags[3], sums_len(i)),
        );
        round.post_at(t, i, codes, &mut run.stats)?;
        round.post_at(t, p + i, sums_in, &mut run.stats)?;
    }
    // Sends are posted with their first group (a round-3 send to a rank after the round-2
    // send to it: messages are matched in order) and widened as groups are computed.
    // Byte offsets of a chunk-aligned value position `v` of slice `j` in its codes and sums.
    let code_off = |j: usize, v: usize| {
        let d = v - slices[j].start;
        (d / chunk) * packed_len(chunk, lv.bits) + packed_len(d % chunk, lv.bits)
    };
    let sum_off = |v: usize| {
        let d = v - own.start;
        (d / chunk) * sum_bytes(chunk) + sum_bytes(d % chunk)
    };
    let group_blocks = |g: &Range<usize>| {
        let cs = g.start / chunk..g.end.div_ceil(chunk);
        cs.flat_map(move |c| {
            let v = c * chunk..((c + 1) * chunk).min(n);
            (v.start..v.end)
                .step_by(BLOCK)
                .map(move |s| (c, s..(s + BLOCK).min(v.end)))
        })
    };
    let own_groups: Vec<Range<usize>> = groups(own.clone(), chunk, n).collect();
    let ngroups = (0..p)
        .map(|j| groups(slices[j].clone(), chunk, n).count())
        .max()
        .unwrap_or(0);
    let mut dither = Dither::new(rng);
    let mut q = [0i8; BLOCK];
    let mut lane = [0u32; BLOCK];
    let mut quantize = |b: Range<usize>, c: usize, q: &mut [i8]| {
        let res = residual.as_deref_mut().map(|r| &mut r.local[b.clone()]);
        quantize_block(&data[b], res, range(c), lv, &mut dither, q);
    };
    // Own groups summed and sent so far.
    let mut finished = 0;
    let peers: Vec<usize> = run.order().collect();
    // Adds up own group `gr` (every rank's codes for it in `inbox`), records a malformed
    // chunk, and returns the bytes of `mine` ready to send.
    let finish = |gr: &Range<usize>,
                  inbox: &[&mut [u8]],
                  sums: &mut [i32],
                  mine: &mut [u8],
                  q: &mut [i8; BLOCK],
                  lane: &mut [u32; BLOCK],
                  run: &mut Run| {
        let (sent, fault) = finish_group(
            gr,
            &own,
            &peers,
            lv,
            sum_lanes,
            inbox,
            code_off(me, gr.start),
            sum_off(gr.start),
            &values,
            chunk,
            sums,
            mine,
            q,
            lane,
        );
        if let Some((i, c)) = fault {
            let e = run.garbage(i, format!("chunk {c}: a reserved code or non-zero padding"));
            run.record(e);
        }
        sent
    };
    for g in 0..ngroups {
        for k in 1..p {
            let j = (me + k) % p;
            let Some(gr) = groups(slices[j].clone(), chunk, n).nth(g) else {
                continue;
            };
            let mut pos = code_off(j, gr.start);
            for (c, b) in group_blocks(&gr) {
                let qb = &mut q[..b.len()];
                quantize(b, c, qb);
                let len = packed_len(qb.len(), lv.bits);
                pack_codes(qb, lv.bits, &mut outs[j][pos..pos + len]);
                pos += len;
            }
            round.offer(t, j, tags[2], outs[j].len(), pos, &mut run.stats)?;
            round.progress(
                t,
                |s| if s < p { &*outs[s] } else { &*mine },
                &mut inbox,
                false,
            )?;
        }
        if let Some(gr) = own_groups.get(g) {
            for (c, b) in group_blocks(gr) {
                let qb = &mut q[..b.len()];
                quantize(b.clone(), c, qb);
                let dst = &mut sums[b.start - own.start..b.end - own.start];
                dst.iter_mut()
                    .zip(qb.iter())
                    .for_each(|(s, &v)| *s = i32::from(v));
            }
        }
        // Sum and send the own groups whose codes have all arrived (without waiting).
        while finished <= g && finished < own_groups.len() {
            let gr = &own_groups[finished];
            let need = code_off(me, gr.end);
            if run.order().any(|i| round.arrived(i) < need) {
                break;
            }
            let sent = finish(gr, &inbox, sums, mine, &mut q, &mut lane, run);
            round.offer_all(t, p, tags[3], mine.len(), sent, &mut run.stats)?;
            finished += 1;
        }
    }
    // The rest, waiting for the codes.
    while finished < own_groups.len() {
        let gr = &own_groups[finished];
        let need = code_off(me, gr.end);
        for i in run.order() {
            round.wait_bytes(
                t,
                i,
                need,
                |s| if s < p { &*outs[s] } else { &*mine },
                &mut inbox,
            )?;
        }
        if run.order().any(|i| round.arrived(i) < need) {
            break; // a short message: `wait_recv` reports it below
        }
        let sent = finish(gr, &inbox, sums, mine, &mut q, &mut lane, run);
        round.offer_all(t, p, tags[3], mine.len(), sent, &mut run.stats)?;
        round.progress(
            t,
            |s| if s < p { &*outs[s] } else { &*mine },
            &mut inbox,
            false,
        )?;
        finished += 1;
    }
    for i in run.order() {
        round.wait_recv(
            t,
            i,
            |s| if s < p { &*outs[s] } else { &*mine },
            &mut inbox,
            &mut run.stats,
        )?;
    }
    // Every slice decoded, the peers' chunk by chunk as their sums arrive.
    let mine: &[u8] = mine;
    let out = |s: usize| if s < p { &*outs[s] } else { mine };
    for i in std::iter::once(me).chain(run.order()) {
        let mut pos = 0;
        let mut bad = None;
        for c in chunks[i].clone() {
            let cv = values(c);
            let len = sum_bytes(cv.len());
            if i != me {
                let got = round.wait_bytes(t, p + i, pos + len, out, &mut inbox)?;
                if got < pos + len {
                    break; // a short message: `wait_recv` reports it
                }
            }
            let bytes: &[u8] = if i == me { mine } else { &*inbox[p + i] };
            // An average scales the step, not the decoded sum: p·L steps can lie beyond f32's
            // range where their p-th part does not.
            let step = stochastic::step_of(range(c), lv);
            let step = if run.avg { step / p as f32 } else { step };
            for b in (cv.start..cv.end).step_by(BLOCK) {
                let b = b..(b + BLOCK).min(cv.end);
                let len = block_len(b.len(), sum_lanes.width);
                let lb = &mut lane[..b.len()];
                let padding_ok = unpack_block(&bytes[pos..pos + len], sum_lanes.width, lb);
                pos += len;
                let out = &mut data[b];
                let ok = sum_lanes.decode(lb, step, out);
                if !(ok && padding_ok) && bad.is_none() {
                    bad = Some(c);
                }
            }
        }
        if i != me {
            round.wait_recv(t, p + i, out, &mut inbox, &mut run.stats)?;
        }
        if let Some(c) = bad {
            let what = format!("the sums of chunk {c} are marked invalid or out of range");
            let e = run.garbage(i, what);
            run.record(e);
        }
    }
    round.finish_sends(t, out, &mut inbox)?;
    Ok(())
}

/// Adds the peers' codes of the own group `gr` (whole chunks of `values`) to `sums` (which
/// hold the own codes) and packs the group's sums into `mine`; returns the bytes of `mine`
/// now complete and the first peer and chunk whose codes were invalid (that chunk's sums are
/// then marked, and go out as the reserved all-ones lane).
#[allow(clippy::too_many_arguments)]
fn finish_group(
    gr: &Range<usize>,
    own: &Range<usize>,
    peers: &[usize],
    lv: Levels,
    sum_lanes: SumLanes,
    inbox: &[&mut [u8]],
    code_off: usize,
    sum_off: usize,
    values: &dyn Fn(usize) -> Range<usize>,
    chunk: usize,
    sums: &mut [i32],
    mine: &mut [u8],
    q: &mut [i8; BLOCK],
    lane: &mut [u32; BLOCK],
) -> (usize, Option<(usize, usize)>) {
    let mut fault = None;
    let cs = gr.start / chunk..gr.end.div_ceil(chunk);
    for &i in peers {
        let mut pos = code_off;
        for c in cs.clone() {
            let cv = values(c);
            let mut ok = true;
            for b in (cv.start..cv.end).step_by(BLOCK) {
                let b = b..(b + BLOCK).min(cv.end);
                let qb = &mut q[..b.len()];
                let len = packed_len(qb.len(), lv.bits);
                ok &= unpack_codes(&inbox[i][pos..pos + len], lv.bits, qb);
                pos += len;
                let dst = &mut sums[b.start - own.start..b.end - own.start];
                dst.iter_mut()
                    .zip(qb.iter())
                    .for_each(|(s, &x)| *s = s.wrapping_add(i32::from(x)));
            }
            if !ok {
                fault.get_or_insert((i, c));
                sums[cv.start - own.start..cv.end - own.start].fill(i32::MIN);
            }
        }
    }
    let mut pos = sum_off;
    for (_, b) in blocks(&cs, &values) {
        let len = block_len(b.len(), sum_lanes.width);
        let lb = &mut lane[..b.len()];
        sum_lanes.lanes(&sums[b.start - own.start..b.end - own.start], lb);
        pack_block(lb, sum_lanes.width, &mut mine[pos..pos + len]);
        pos += len;
    }
    (pos, fault)
}

/// The blocks (at most [`BLOCK`] values, never across chunks) of the chunks `cs`, with their
/// chunk; `values(c)` is the value range of chunk `c`.
fn blocks<'a>(
    cs: &Range<usize>,
    values: &'a impl Fn(usize) -> Range<usize>,
) -> impl Iterator<Item = (usize, Range<usize>)> + 'a {
    cs.clone().flat_map(move |c| {
        let v = values(c);
        (v.start..v.end)
            .step_by(BLOCK)
            .map(move |s| (c, s..(s + BLOCK).min(v.end)))
    })
}

/// Quantizes `x` (one block of one chunk) at `range` into `q`; with `res`, quantizes
/// `x + res` and leaves in `res` what rounding lost.
fn quantize_block(
    x: &[f32],
    res: Option<&mut [f32]>,
    range: f32,
    lv: Levels,
    dither: &mut Dither,
    q: &mut [i8],
) {
    match res {
        None => stochastic::round_block(x, range, lv, dither, q),
        Some(r) => {
            apply(Mode::Add, r, x);
            stochastic::round_block(r, range, lv, dither, q);
            let step = stochastic::step_of(range, lv);
            r.iter_mut()
                .zip(q.iter())
                .for_each(|(e, &k)| *e -= f32::from(k) * step);
        }
    }
}

/// How exact sums of `p` codes in `−L..=L` travel: offset by `p·L` to `0..=2·p·L`, in the
/// fewest bits holding that; the all-ones lane (always above `2·p·L`) marks a poisoned sum.
#[derive(Clone, Copy, Debug)]
struct SumLanes {
    offset: i32,
    max: u32,
    width: u32,
    poison: u32,
}

impl SumLanes {
    fn new(p: usize, lv: Levels) -> SumLanes {
        // Validated: 2·p·L < 2^31.
        let offset = (p as i64 * i64::from(lv.max)) as i32;
        let max = 2 * offset as u32;
        let width = width_for(max);
        let poison = if width == 32 {
            u32::MAX
        } else {
            (1 << width) - 1
        };
        SumLanes {
            offset,
            max,
            width,
            poison,
        }
    }

    /// The lane of every sum (poisoned sums, far outside, become the all-ones lane).
    fn lanes(&self, sums: &[i32], out: &mut [u32]) {
        let (offset, max, poison) = (self.offset as u32, self.max, self.poison);
        for (o, &s) in out.iter_mut().zip(sums) {
            // In range exactly when `s + p·L` lands in `0..=2·p·L` without wrapping.
            let v = (s as u32).wrapping_add(offset);
            *o = if v <= max { v } else { poison };
        }
    }

    /// `out = (lane − p·L)·step`; false if a lane is out of range.
    fn decode(&self, lanes: &[u32], step: f32, out: &mut [f32]) -> bool {
        let mut bad = false;
        for (o, &v) in out.iter_mut().zip(lanes) {
            bad |= v > self.max;
            *o = (v as i32).wrapping_sub(self.offset) as f32 * step;
        }
        !bad
    }
}

/// Values in a group: the unit in which the schedules compute, send and consume, so that
/// bytes move while the rest is computed (a fraction of a millisecond of work: links stay
/// busy, yet the transport is called few enough times that its cost does not show).
const GROUP: usize = 1 << 16;

/// Tensors of at most this many values are not pipelined (see [`groups`]).
const PIPELINE_MIN: usize = 1 << 18;

/// The requests of one round: at most one send to and one receive from each peer.
struct Round {
    /// The number of ranks.
    peers: usize,
    /// This rank.
    me: usize,
    tag: Tag,
    deadline: Instant,
    send: Vec<Option<Request>>,
    recv: Vec<Option<Request>>,
}

impl Round {
    /// A round of `phases` exchanges (slots `phase·peers + peer`) among `peers` ranks.
    fn new(peers: usize, me: usize, phases: usize, tag: Tag, deadline: Instant) -> Round {
        Round {
            peers,
            me,
            tag,
            deadline,
            send: vec![None; phases * peers],
            recv: vec![None; phases * peers],
        }
    }

    /// Posts a send of `len` bytes to `peer` (none if empty: both sides know).
    fn post_send(
        &mut self,
        t: &mut dyn Transport,
        peer: usize,
        len: usize,
        stats: &mut WireStats,
    ) -> Result<()> {
        if len > 0 {
            let mut r = Request::send(peer, self.tag, len);
            t.post(&mut r)?;
            self.send[peer] = Some(r);
            stats.bytes_sent += len as u64;
        }
        Ok(())
    }

    /// Lets the send in slot `slot` (to the peer `slot mod peers`) of `len` bytes read the
    /// first `bytes` bytes of its buffer, posting it (with `tag`) if it is not yet: a send is
    /// posted only once it has bytes to go, so the message never starts with a header
    /// alone (none if `len` is zero).
    #[allow(clippy::too_many_arguments)]
    fn offer(
        &mut self,
        t: &mut dyn Transport,
        slot: usize,
        tag: Tag,
        len: usize,
        bytes: usize,
        stats: &mut WireStats,
    ) -> Result<()> {
        match self.send[slot].as_mut() {
            Some(r) => r.set_available(bytes),
            None => {
                let r = Request::send_partial(slot % self.peers, tag, len, bytes);
                self.post_at(t, slot, r, stats)?;
            }
        }
        Ok(())
    }

    /// [`Round::offer`] of one buffer to every other rank, in slots `first + peer`.
    fn offer_all(
        &mut self,
        t: &mut dyn Transport,
        first: usize,
        tag: Tag,
        len: usize,
        bytes: usize,
        stats: &mut WireStats,
    ) -> Result<()> {
        for k in 1..self.peers {
            let peer = (self.me + k) % self.peers;
            self.offer(t, first + peer, tag, len, bytes, stats)?;
        }
        Ok(())
    }

    /// Bytes of the message in receive slot `slot` that have arrived so far.
    fn arrived(&self, slot: usize) -> usize {
        self.recv[slot].as_ref().map_or(0, Request::bytes_done)
    }

    /// Posts `r` (a send or a receive; none if empty) in slot `slot`. A round that overlaps
    /// two exchanges has `2·size` slots: the first exchange's message to or from `peer` in
    /// slot `peer`, the second's in slot `size + peer`.
    fn post_at(
        &mut self,
        t: &mut dyn Transport,
        slot: usize,
        mut r: Request,
        stats: &mut WireStats,
    ) -> Result<()> {
        if r.is_empty() {
            return Ok(());
        }
        t.post(&mut r)?;
        match r.direction() {
            Direction::Send => {
                stats.bytes_sent += r.len() as u64;
                self.send[slot] = Some(r);
            }
            Direction::Recv => self.recv[slot] = Some(r),
        }
        Ok(())
    }

    /// Blocks until at least `need` bytes of the message from `peer` have arrived or it is
    /// complete (a shorter message: [`Round::wait_recv`] reports it); returns the bytes that
    /// have arrived. Every send must be fully available (nothing else would move).
    fn wait_bytes<'b>(
        &mut self,
        t: &mut dyn Transport,
        peer: usize,
        need: usize,
        out: impl Fn(usize) -> &'b [u8] + Copy,
        inbox: &mut [&mut [u8]],
    ) -> Result<usize> {
        loop {
            let Some(r) = self.recv[peer].as_ref() else {
                return Ok(0);
            };
            if r.bytes_done() >= need || r.is_complete() {
                return Ok(r.bytes_done());
            }
            self.progress(t, out, inbox, true)?;
        }
    }

    /// Posts a receive of exactly `len` bytes from `peer` (none if empty).
    fn post_recv(&mut self, t: &mut dyn Transport, peer: usize, len: usize) -> Result<()> {
        if len > 0 {
            let mut r = Request::recv(peer, self.tag, len);
            t.post(&mut r)?;
            self.recv[peer] = Some(r);
        }
        Ok(())
    }

    /// Moves bytes for every unfinished request: `out(j)` is the buffer of the send to `j`,
    /// `inbox[i]` that of the receive from `i`. Blocks (until something moved) if `wait`.
    fn progress<'b>(
        &mut self,
        t: &mut dyn Transport,
        out: impl Fn(usize) -> &'b [u8],
        inbox: &mut [&mut [u8]],
        wait: bool,
    ) -> Result<()> {
        let mut ops = Vec::with_capacity(self.send.len() + self.recv.len());
        for (j, r) in self.send.iter_mut().enumerate() {
            if let Some(r) = r.as_mut().filter(|r| !r.is_complete()) {
                ops.push(Op::send(r, out(j)));
            }
        }
        for (r, b) in self.recv.iter_mut().zip(inbox.iter_mut()) {
            if let Some(r) = r.as_mut().filter(|r| !r.is_complete()) {
                ops.push(Op::recv(r, b));
            }
        }
        if !ops.is_empty() {
            let wait = if wait {
                Wait::Until(self.deadline)
            } else {
                Wait::No
            };
            t.progress(&mut ops, wait)?;
        }
        Ok(())
    }

    /// Blocks until the message from `peer` is complete; fails unless it had the length
    /// posted.
    fn wait_recv<'b>(
        &mut self,
        t: &mut dyn Transport,
        peer: usize,
        out: impl Fn(usize) -> &'b [u8] + Copy,
        inbox: &mut [&mut [u8]],
        stats: &mut WireStats,
    ) -> Result<()> {
        let Some((want, from, tag)) = self.recv[peer]
            .as_ref()
            .map(|r| (r.len(), r.peer(), r.tag()))
        else {
            return Ok(());
        };
        while !self.recv[peer].as_ref().is_some_and(Request::is_complete) {
            self.progress(t, out, inbox, true)?;
        }
        let got = self.recv[peer].as_ref().map_or(0, Request::bytes_done);
        if got != want {
            return Err(TransportError::Mismatch {
                peer: from,
                expected_tag: tag,
                got_tag: tag,
                expected_len: want,
                got_len: got,
            });
        }
        stats.bytes_received += got as u64;
        Ok(())
    }

    /// Blocks until every send is complete (their buffers are reused next).
    fn finish_sends<'b>(
        &mut self,
        t: &mut dyn Transport,
        out: impl Fn(usize) -> &'b [u8] + Copy,
        inbox: &mut [&mut [u8]],
    ) -> Result<()> {
        while self.send.iter().flatten().any(|r| !r.is_complete()) {
            self.progress(t, out, inbox, true)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Slices are whole chunks, in order, covering every value once, and no rank owns
        /// more than one chunk more than another.
        #[test]
        fn plans_partition_into_whole_chunks(n in 0usize..50_000, size in 1usize..20, chunk in 1usize..3000) {
            let pl = plan(n, size, chunk);
            prop_assert_eq!(pl.slices.len(), size);
            let (mut next_chunk, mut next_value) = (0, 0);
            for (c, s) in pl.chunks.iter().zip(&pl.slices) {
                prop_assert_eq!(c.start, next_chunk);
                prop_assert_eq!(s.start, next_value);
                prop_assert_eq!(s.start, (c.start * chunk).min(n));
                prop_assert!(s.end == n || s.end % chunk == 0);
                next_chunk = c.end;
                next_value = s.end;
            }
            prop_assert_eq!(next_chunk, n.div_ceil(chunk));
            prop_assert_eq!(next_value, n);
            let lens: Vec<usize> = pl.chunks.iter().map(|c| c.len()).collect();
            prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn sum_lanes_are_exact_and_poison_is_out_of_range() {
        for (p, lv, width) in [
            (2, stochastic::INT8, 9),
            (8, stochastic::INT8, 11),
            (2, stochastic::INT4, 5),
            (4, stochastic::ternary(false), 4),
            (64, stochastic::ternary(true), 8),
        ] {
            let s = SumLanes::new(p, lv);
            assert_eq!(s.width, width, "p={p} {lv:?}");
            let most = p as i32 * lv.max;
            let sums = [-most, -1, 0, 1, most, i32::MIN, i32::MIN + 5];
            let mut lanes = vec![0u32; sums.len()];
            s.lanes(&sums, &mut lanes);
            assert!(lanes.iter().all(|&l| l < 1 << s.width));
            let mut out = [0f32; 5];
            assert!(s.decode(&lanes[..5], 0.5, &mut out));
            assert_eq!(out, [-0.5 * most as f32, -0.5, 0.0, 0.5, 0.5 * most as f32]);
            assert!(lanes[5..].iter().all(|&l| l == s.poison));
            assert!(!s.decode(&lanes[5..], 0.5, &mut out[..2]));
        }
    }

    #[test]
    fn blocks_stay_inside_chunks() {
        let values = |c: usize| c * 600..((c + 1) * 600).min(1500);
        let b: Vec<(usize, Range<usize>)> = blocks(&(1..3), &values).collect();
        assert_eq!(
            b,
            vec![
                (1, 600..856),
                (1, 856..1112),
                (1, 1112..1200),
                (2, 1200..1456),
                (2, 1456..1500)
            ]
        );
    }
}
