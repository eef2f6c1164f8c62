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
//!
//! # Scatter-gather (any codec)
//! 1. Round 1: for every other rank `j`, encode this rank's values of slice `j` (with error
//!    feedback: of `g + e`, keeping what was lost in `e`) and send them. Encode the own slice
//!    the same way and decode it: the sum starts there. Receive the other ranks' encodings of
//!    the own slice and add them, decoded, in f32. (Every contribution is quantized exactly
//!    once, so the error is the same whatever the number of ranks.)
//! 2. The owner adds its owner residual (error feedback) and encodes the sum once.
//! 3. Round 2: send that encoding to every rank, unchanged; receive every other slice's
//!    encoding. Every rank, the owner too, decodes all slices from the same bytes, so all ranks
//!    end bit-identical. `Avg` divides by `p` in f32 after decoding.
//!
//! # Integer domain (int8, int4, ternary)
//! 1. Round 1: send each owner this rank's range (largest magnitude, clipped for
//!    `ternary-clip`) of each of its chunks; the owner keeps the largest, exactly (ranges are
//!    compared as bit patterns).
//! 2. Round 2: each owner sends its chunks' shared ranges to every rank.
//! 3. Round 3: quantize every chunk at its shared step `range/L` by stochastic rounding and send
//!    each owner the packed codes (no scales: all ranks know them). The owner adds the codes
//!    of all ranks as integers, exactly (i32 lanes).
//! 4. Round 4: each owner sends its sums, packed in `⌈log₂(2·p·L + 1)⌉` bits each (int8: 9 bits
//!    at p = 2, 11 at p = 8), to every rank; every rank decodes `sum·step` (then `/p` for
//!    `Avg`).
//!
//! The reduce-scatter is done as a direct exchange rather than around a ring: the same
//! number of messages and bytes per rank, but each value travels as its `b`-bit code instead
//! of as a partial sum that needs wider lanes at every hop.
//!
//! # Volume (bytes each rank sends; receives as much), `n` values, `b` bits per code
//! - scatter-gather: `2·(p−1)/p · n·b/8`, plus 4 bytes per chunk and 16 per message of round 1;
//! - integer domain: `(p−1)/p · n·(b + ⌈log₂(2·p·L + 1)⌉)/8`, plus `2·(p−1)/p · 4` bytes per
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
//! Nothing a peer sends can make a rank panic or allocate: every scale, range and code is
//! checked. A problem is recorded, what depends on the bad data is marked (NaN values before
//! re-encoding, or a reserved all-ones sum), and the schedule finishes its rounds; every rank
//! then fails, the transport still in step. NaN or ±∞ in an input (which the scaled codecs
//! cannot carry) give [`TransportError::InvalidArgument`] on every rank, the transport usable;
//! invalid codes give [`TransportError::Protocol`] naming the rank that sent them.

use std::ops::Range;
use std::time::Instant;

use chorus_transport::{Op, Request, Result, Tag, Transport, TransportError, Wait};

use super::pack::{pack_codes, pack_uint, packed_len, unpack_codes, unpack_uint, width_for};
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
/// `op` is [`ReduceOp::Sum`] or [`ReduceOp::Avg`] (divided by the number of ranks in f32,
/// after decoding). With `opts.error_feedback`, `residual` carries what compression lost
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
            format!("the sum of elements {vals:?} (owned by rank {from}) is not finite: some rank's input holds NaN or inf there")
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
    let (me, p, codec, chunk) = (run.rank, run.size, run.codec, run.plan.chunk);
    let slices = run.plan.slices.clone();
    let own = slices[me].clone();
    let enc_len = |j: usize| codec.encoded_len(slices[j].len(), chunk);
    if let Some(r) = residual.as_deref_mut() {
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
    let (t, scratch) = ctx.transport_and_scratch(need);

    // Round 1: pieces out, own slice's pieces in and summed.
    {
        let (out_buf, rest) = split_aligned(scratch, out1);
        let mut outs = cut(out_buf, (0..p).map(piece));
        let mut inbox = cut(&mut rest[..in1], (0..p).map(in_len));
        let mut round = Round::new(p, tags[0], run.deadline);
        for i in run.order() {
            round.post_recv(t, i, HEADER_BYTES + enc_len(me))?;
        }
        let header = run.header();
        for k in 1..p {
            let j = (me + k) % p;
            let (h, body) = outs[j].split_at_mut(HEADER_BYTES);
            h.copy_from_slice(&header);
            let s = slices[j].clone();
            match residual.as_deref_mut() {
                Some(r) => {
                    codec.encode_with_feedback(&data[s.clone()], &mut r.local[s], chunk, body, rng)
                }
                None => codec.encode(&data[s], chunk, body, rng),
            }
            round.post_send(t, j, outs[j].len(), &mut run.stats)?;
            round.progress(t, |j| &*outs[j], &mut inbox, false)?;
        }
        // The own values go through the codec too (each contribution is quantized exactly
        // once, whoever owns it): they start the sum.
        let first = run.plan.chunks[me].start;
        let mine = &mut *inbox[me];
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
        if let Err(e) = codec.decode(mine, chunk, &mut data[own.clone()]) {
            let e = run.decode_error(e, me, first, false);
            run.record(e);
            data[own.clone()].fill(f32::NAN);
        }
        for i in run.order() {
            round.wait_recv(t, i, |j| &*outs[j], &mut inbox, &mut run.stats)?;
            let (h, body) = inbox[i].split_at(HEADER_BYTES);
            run.check_header(i, tags[0], h)?;
            if let Err(e) = codec.decode_add(body, chunk, &mut data[own.clone()]) {
                let e = run.decode_error(e, i, first, false);
                run.record(e);
                // Poison the sum: it re-encodes with NaN scales, so every rank fails.
                data[own.clone()].fill(f32::NAN);
            }
        }
        round.finish_sends(t, |j| &*outs[j], &mut inbox)?;
    }

    // Round 2: the owner's one re-quantization, then the codes go round unchanged.
    let mut slots = cut(&mut scratch[..all2], (0..p).map(enc_len));
    let mine = std::mem::take(&mut slots[me]);
    match residual {
        Some(r) => codec.encode_with_feedback(&data[own.clone()], &mut r.owner, chunk, mine, rng),
        None => codec.encode(&data[own.clone()], chunk, mine, rng),
    }
    let mine: &[u8] = mine;
    let mut round = Round::new(p, tags[1], run.deadline);
    for i in run.order() {
        round.post_recv(t, i, enc_len(i))?;
    }
    for k in 1..p {
        round.post_send(t, (me + k) % p, mine.len(), &mut run.stats)?;
    }
    round.progress(t, |_| mine, &mut slots, false)?;
    for i in std::iter::once(me).chain(run.order()) {
        if i != me {
            round.wait_recv(t, i, |_| mine, &mut slots, &mut run.stats)?;
        }
        let bytes: &[u8] = if i == me { mine } else { slots[i] };
        let s = slices[i].clone();
        if let Err(e) = codec.decode(bytes, chunk, &mut data[s.clone()]) {
            let e = run.decode_error(e, i, run.plan.chunks[i].start, true);
            run.record(e);
        }
        if run.avg {
            divide(&mut data[s], p);
        }
    }
    round.finish_sends(t, |_| mine, &mut slots)?;
    Ok(())
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
    let sums_len = |j: usize| per_chunk(j, sum_lanes.width);
    let ranges_len = |j: usize| HEADER_BYTES + 4 * chunks[j].len();
    let others = |f: &dyn Fn(usize) -> usize, j: usize| if j == me { 0 } else { f(j) };
    let out_len = |f: &dyn Fn(usize) -> usize| (0..p).map(|j| others(f, j)).sum::<usize>();
    let r1 = round_up(out_len(&ranges_len)) + p * ranges_len(me);
    let r3 = round_up(out_len(&codes_len)) + p * codes_len(me);
    let r4: usize = (0..p).map(sums_len).sum();
    let need = round_up(4 * total) + round_up(4 * own.len()) + r1.max(r3).max(r4);
    let (t, scratch) = ctx.transport_and_scratch(need);
    let (shared, rest) = split_aligned(scratch, 4 * total);
    let (sums, work) = split_aligned(rest, 4 * own.len());
    let values = |c: usize| c * chunk..((c + 1) * chunk).min(n);

    // Round 1: local ranges (of g + e with error feedback) to the owners, who keep the
    // largest of each chunk.
    {
        let local = |c: usize| -> u32 {
            let s = values(c);
            let range = match residual.as_deref() {
                Some(r) => stochastic::local_range_sum(&data[s.clone()], &r.local[s], lv.clip),
                None => stochastic::local_range(&data[s], lv.clip),
            };
            range.to_bits()
        };
        let (out_buf, rest) = split_aligned(work, out_len(&ranges_len));
        let mut outs = cut(out_buf, (0..p).map(|j| others(&ranges_len, j)));
        let mut inbox = cut(rest, (0..p).map(|i| others(&|_| ranges_len(me), i)));
        let mut round = Round::new(p, tags[0], run.deadline);
        for i in run.order() {
            round.post_recv(t, i, ranges_len(me))?;
        }
        let header = run.header();
        for k in 1..p {
            let j = (me + k) % p;
            let (h, body) = outs[j].split_at_mut(HEADER_BYTES);
            h.copy_from_slice(&header);
            for (b, c) in body.chunks_exact_mut(4).zip(chunks[j].clone()) {
                b.copy_from_slice(&local(c).to_le_bytes());
            }
            round.post_send(t, j, outs[j].len(), &mut run.stats)?;
            round.progress(t, |j| &*outs[j], &mut inbox, false)?;
        }
        let mine: &mut [u32] =
            bytemuck::cast_slice_mut(&mut shared[4 * chunks[me].start..4 * chunks[me].end]);
        for (m, c) in mine.iter_mut().zip(chunks[me].clone()) {
            *m = local(c);
        }
        for i in run.order() {
            round.wait_recv(t, i, |j| &*outs[j], &mut inbox, &mut run.stats)?;
            let (h, body) = inbox[i].split_at(HEADER_BYTES);
            run.check_header(i, tags[0], h)?;
            for (k, (m, b)) in mine.iter_mut().zip(body.chunks_exact(4)).enumerate() {
                let mut bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                if bits >= 0x8000_0000 {
                    // A negative range: no encoder sends that.
                    let what = format!("a negative range for chunk {}", chunks[me].start + k);
                    let e = run.garbage(i, what);
                    run.record(e);
                    bits = f32::NAN.to_bits();
                }
                // Non-negative floats order as their bit patterns (NaN above ∞ above the
                // finite ones), so the maximum is exact and the same on every rank.
                *m = (*m).max(bits);
            }
        }
        round.finish_sends(t, |j| &*outs[j], &mut inbox)?;
    }

    // Round 2: the shared ranges to everyone, straight into place.
    {
        let mut slots = cut(&mut shared[..], (0..p).map(|j| 4 * chunks[j].len()));
        let mine: &[u8] = std::mem::take(&mut slots[me]) as &[u8];
        let mut round = Round::new(p, tags[1], run.deadline);
        for i in run.order() {
            round.post_recv(t, i, 4 * chunks[i].len())?;
        }
        for k in 1..p {
            round.post_send(t, (me + k) % p, mine.len(), &mut run.stats)?;
        }
        for i in run.order() {
            round.wait_recv(t, i, |_| mine, &mut slots, &mut run.stats)?;
        }
        round.finish_sends(t, |_| mine, &mut slots)?;
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

    // Round 3: codes at the shared steps to the owners, who add them up exactly.
    let sums: &mut [i32] = bytemuck::cast_slice_mut(sums);
    {
        let (out_buf, rest) = split_aligned(work, out_len(&codes_len));
        let mut outs = cut(out_buf, (0..p).map(|j| others(&codes_len, j)));
        let mut inbox = cut(rest, (0..p).map(|i| others(&|_| codes_len(me), i)));
        let mut round = Round::new(p, tags[2], run.deadline);
        for i in run.order() {
            round.post_recv(t, i, codes_len(me))?;
        }
        let mut dither = Dither::new(rng);
        let mut q = [0i8; BLOCK];
        let mut quantize = |b: Range<usize>, c: usize, q: &mut [i8]| {
            let res = residual.as_deref_mut().map(|r| &mut r.local[b.clone()]);
            quantize_block(&data[b], res, range(c), lv, &mut dither, q);
        };
        for k in 1..p {
            let j = (me + k) % p;
            let mut pos = 0;
            for (c, b) in blocks(&chunks[j], &values) {
                let qb = &mut q[..b.len()];
                quantize(b, c, qb);
                let len = packed_len(qb.len(), lv.bits);
                pack_codes(qb, lv.bits, &mut outs[j][pos..pos + len]);
                pos += len;
            }
            round.post_send(t, j, outs[j].len(), &mut run.stats)?;
            round.progress(t, |j| &*outs[j], &mut inbox, false)?;
        }
        for (c, b) in blocks(&chunks[me], &values) {
            let qb = &mut q[..b.len()];
            quantize(b.clone(), c, qb);
            let dst = &mut sums[b.start - own.start..b.end - own.start];
            dst.iter_mut()
                .zip(qb.iter())
                .for_each(|(s, &v)| *s = i32::from(v));
        }
        for i in run.order() {
            round.wait_recv(t, i, |j| &*outs[j], &mut inbox, &mut run.stats)?;
            let mut pos = 0;
            for (c, b) in blocks(&chunks[me], &values) {
                let qb = &mut q[..b.len()];
                let len = packed_len(qb.len(), lv.bits);
                let ok = unpack_codes(&inbox[i][pos..pos + len], lv.bits, qb);
                pos += len;
                let dst = &mut sums[b.start - own.start..b.end - own.start];
                if ok {
                    dst.iter_mut()
                        .zip(qb.iter())
                        .for_each(|(s, &v)| *s = s.wrapping_add(i32::from(v)));
                } else {
                    let what = format!("chunk {c}: a reserved code or non-zero padding");
                    let e = run.garbage(i, what);
                    run.record(e);
                    // Marked: it goes out as the reserved all-ones sum.
                    let cv = values(c);
                    sums[cv.start - own.start..cv.end - own.start].fill(i32::MIN);
                }
            }
        }
        round.finish_sends(t, |j| &*outs[j], &mut inbox)?;
    }

    // Round 4: the sums, packed, to everyone; every rank decodes every slice.
    let lanes: &mut [u32] = bytemuck::cast_slice_mut(sums);
    for v in lanes.iter_mut() {
        *v = sum_lanes.lane(*v as i32);
    }
    let lanes: &[u32] = lanes;
    let mut slots = cut(&mut work[..r4], (0..p).map(sums_len));
    let mine = std::mem::take(&mut slots[me]);
    let mut pos = 0;
    for (_, b) in blocks(&chunks[me], &values) {
        let len = packed_len(b.len(), sum_lanes.width);
        let lane = &lanes[b.start - own.start..b.end - own.start];
        pack_uint(lane, sum_lanes.width, &mut mine[pos..pos + len]);
        pos += len;
    }
    let mine: &[u8] = mine;
    let mut round = Round::new(p, tags[3], run.deadline);
    for i in run.order() {
        round.post_recv(t, i, sums_len(i))?;
    }
    for k in 1..p {
        round.post_send(t, (me + k) % p, mine.len(), &mut run.stats)?;
    }
    round.progress(t, |_| mine, &mut slots, false)?;
    let mut lane = [0u32; BLOCK];
    for i in std::iter::once(me).chain(run.order()) {
        if i != me {
            round.wait_recv(t, i, |_| mine, &mut slots, &mut run.stats)?;
        }
        let bytes: &[u8] = if i == me { mine } else { slots[i] };
        let mut pos = 0;
        let mut bad = None;
        for (c, b) in blocks(&chunks[i], &values) {
            let len = packed_len(b.len(), sum_lanes.width);
            let lb = &mut lane[..b.len()];
            let padding_ok = unpack_uint(&bytes[pos..pos + len], sum_lanes.width, lb);
            pos += len;
            let step = stochastic::step_of(range(c), lv);
            let ok = sum_lanes.decode(lb, step, &mut data[b]);
            if !(ok && padding_ok) && bad.is_none() {
                bad = Some(c);
            }
        }
        if let Some(c) = bad {
            let what = format!("the sums of chunk {c} are marked invalid or out of range");
            let e = run.garbage(i, what);
            run.record(e);
        }
        if run.avg {
            divide(&mut data[slices[i].clone()], p);
        }
    }
    round.finish_sends(t, |_| mine, &mut slots)?;
    Ok(())
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

    /// The lane of a sum (poisoned sums, far outside, become the all-ones lane).
    fn lane(&self, sum: i32) -> u32 {
        let v = i64::from(sum) + i64::from(self.offset);
        if (0..=i64::from(self.max)).contains(&v) {
            v as u32
        } else {
            self.poison
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

/// The requests of one round: at most one send to and one receive from each peer.
struct Round {
    tag: Tag,
    deadline: Instant,
    send: Vec<Option<Request>>,
    recv: Vec<Option<Request>>,
}

impl Round {
    fn new(size: usize, tag: Tag, deadline: Instant) -> Round {
        Round {
            tag,
            deadline,
            send: vec![None; size],
            recv: vec![None; size],
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
        let Some(want) = self.recv[peer].as_ref().map(Request::len) else {
            return Ok(());
        };
        while !self.recv[peer].as_ref().is_some_and(Request::is_complete) {
            self.progress(t, out, inbox, true)?;
        }
        let got = self.recv[peer].as_ref().map_or(0, Request::bytes_done);
        if got != want {
            return Err(TransportError::Mismatch {
                peer,
                expected_tag: self.tag,
                got_tag: self.tag,
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
            let lanes: Vec<u32> = sums.iter().map(|&v| s.lane(v)).collect();
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
