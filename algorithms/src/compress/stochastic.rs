//! int8, int4 and ternary: a scale per chunk and stochastically rounded integer codes.
//!
//! A chunk of `m` values with **range** `r` (its largest magnitude; for clipped ternary at most
//! 2.5 times the chunk's root mean square, TernGrad's 2.5σ with σ measured around zero) is sent
//! as its **step** `s = r / L` (f32, little-endian) followed by `m` codes `q ∈ [−L, L]` packed
//! in `b` bits: int8 `L = 127, b = 8`; int4 `L = 7, b = 4`; ternary `L = 1, b = 2` (TernGrad's
//! `s·sign(g)·Bernoulli(|g|/s)` is exactly the stochastic rounding of `g/s` to {−1, 0, 1}).
//! The value decodes as `q·s`.
//!
//! Stochastic rounding: `y = x/s` becomes `⌊y⌋ + 1` with probability `y − ⌊y⌋`, else `⌊y⌋`,
//! so `E[q·s] = x` (up to f32 rounding of `1/s`) and `|q·s − x| < s`. Values clipped to the
//! range lose what lies beyond it (the only bias, clipped ternary only).
//!
//! A chunk holding NaN or ±∞ is sent with a NaN step and zero codes; decoding reports it.
//! Ranges below `2⁻¹⁰⁰` are handled by rescaling by a power of two first; a step that
//! underflows f32 (ranges below ~`10⁻⁴³`) decodes as zero.
//!
//! The integer-domain schedule uses the same rounding with a range shared by all ranks
//! ([`round_block`] with the common range), sending only the codes.

use super::pack::{pack_codes, packed_len, unpack_codes};
use super::rng::{Dither, Rng, LANES};
use super::{CodecError, Mode, BLOCK};

/// The integer grid of one codec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Levels {
    /// `L`: codes are `−L..=L`.
    pub max: i32,
    /// Bits per packed code.
    pub bits: u32,
    /// Clip the range at 2.5 root mean squares.
    pub clip: bool,
}

/// int8.
pub(crate) const INT8: Levels = Levels {
    max: 127,
    bits: 8,
    clip: false,
};
/// int4.
pub(crate) const INT4: Levels = Levels {
    max: 7,
    bits: 4,
    clip: false,
};

/// Ternary, optionally clipped.
pub(crate) const fn ternary(clip: bool) -> Levels {
    Levels {
        max: 1,
        bits: 2,
        clip,
    }
}

/// Bytes of one encoded chunk of `m` values.
pub(crate) fn chunk_bytes(lv: Levels, m: usize) -> usize {
    4 + packed_len(m, lv.bits)
}

/// The range of a chunk (see the module documentation); NaN if a value is not finite.
pub(crate) fn local_range(x: &[f32], clip: bool) -> f32 {
    if clip {
        range_of::<true>(x)
    } else {
        range_of::<false>(x)
    }
}

/// [`local_range`], the sum of squares computed only when clipping (`CLIP`).
fn range_of<const CLIP: bool>(x: &[f32]) -> f32 {
    let mut s = Stats::default();
    let mut lanes = x.chunks_exact(LANES);
    for v in &mut lanes {
        s.add::<CLIP>(v.try_into().expect("LANES values"));
    }
    let mut tail = [0f32; LANES];
    tail[..lanes.remainder().len()].copy_from_slice(lanes.remainder());
    s.add::<CLIP>(&tail);
    s.range(x.len(), CLIP)
}

/// [`local_range`] of `x + e` (error feedback), without storing the sum.
pub(crate) fn local_range_sum(x: &[f32], e: &[f32], clip: bool) -> f32 {
    debug_assert_eq!(x.len(), e.len());
    let mut s = Stats::default();
    let mut sum = [0f32; LANES];
    for (a, b) in x.chunks(LANES).zip(e.chunks(LANES)) {
        // A short last piece leaves zeros in the other lanes, which change nothing.
        sum.fill(0.0);
        for ((d, &u), &v) in sum.iter_mut().zip(a).zip(b) {
            *d = u + v;
        }
        s.add::<true>(&sum);
    }
    s.range(x.len(), clip)
}

/// Per-lane largest magnitude, NaN flag and sum of squares of a chunk: independent
/// accumulators per lane let the compiler keep them in vector registers (a single accumulator
/// would be a serial chain of float operations it may not reorder).
struct Stats {
    amax: [f32; LANES],
    nan: [u32; LANES],
    sumsq: [f32; LANES],
}

impl Default for Stats {
    fn default() -> Stats {
        Stats {
            amax: [0.0; LANES],
            nan: [0; LANES],
            sumsq: [0.0; LANES],
        }
    }
}

impl Stats {
    /// Adds `LANES` values; their squares only if `SQ` (clipping needs them).
    #[inline(always)]
    fn add<const SQ: bool>(&mut self, v: &[f32; LANES]) {
        let lanes = self.amax.iter_mut().zip(&mut self.nan).zip(&mut self.sumsq);
        for (((m, nan), sq), &x) in lanes.zip(v) {
            let a = x.abs();
            // `>` keeps the accumulator on NaN (flagged separately); ∞ wins like any value.
            *m = if a > *m { a } else { *m };
            *nan |= u32::from(x.is_nan());
            if SQ {
                *sq += x * x;
            }
        }
    }

    /// The range of `len` values: NaN if one was NaN or ±∞; clipped at 2.5 rms if asked.
    fn range(&self, len: usize, clip: bool) -> f32 {
        let amax = self.amax.iter().fold(0f32, |m, &a| m.max(a));
        if self.nan.iter().any(|&f| f != 0) || amax.is_infinite() {
            return f32::NAN;
        }
        if clip && len > 0 {
            let sumsq: f32 = self.sumsq.iter().sum();
            let limit = 2.5 * (sumsq / len as f32).sqrt();
            // A zero limit means the squares underflowed, an infinite one that they
            // overflowed: no meaningful σ, no clipping.
            if limit > 0.0 && limit < amax {
                return limit;
            }
        }
        amax
    }
}

/// The step of a range: `range / L`, rounded down where rounding to nearest would make
/// `L·step` overflow (a range at `f32::MAX`), so that the largest code decodes finite.
pub(crate) fn step_of(range: f32, lv: Levels) -> f32 {
    let step = range / lv.max as f32;
    if step.is_finite() && !(step * lv.max as f32).is_finite() {
        // The next f32 toward zero (`f32::next_down`, newer than this crate's MSRV): `step`
        // is positive and finite here.
        f32::from_bits(step.to_bits() - 1)
    } else {
        step
    }
}

/// Stochastically rounds `x / (range/L)`, clamped to `±L`, into `q` (same length), drawing
/// the uniforms from `dither`. `range` must be finite; a zero range gives zero codes.
///
/// With `y` the scaled value and `u` uniform in `(−½, ½)`, `q` is `y + u` rounded to the
/// nearest integer: `⌊y⌋ + 1` with probability `y − ⌊y⌋`, else `⌊y⌋`. (The f32 addition
/// moves that probability by at most 2⁻¹⁷, the uniforms' resolution is 2⁻²³.) `q` stays in
/// `−L..=L` ([`round_one`]).
pub(crate) fn round_block(x: &[f32], range: f32, lv: Levels, dither: &mut Dither, q: &mut [i8]) {
    debug_assert!(x.len() == q.len() && range.is_finite());
    if range <= 0.0 {
        q.fill(0);
        return;
    }
    let lim = lv.max as f32;
    if range >= 1e-30 {
        round_scaled(x, 1.0, lim / range, lim, dither, q);
    } else {
        // `L / range` overflows f32 for ranges below ~1e-37: scale tiny values up by 2^100
        // first (exact: a power of two).
        let pre = 2f32.powi(100);
        round_scaled(x, pre, lim / (range * pre), lim, dither, q);
    }
}

/// `y + u` rounded to the nearest integer in `−lim..=lim` (`|u| < ½`, `lim` a small integer).
#[inline(always)]
pub(crate) fn round_one(y: f32, u: f32, lim: f32) -> i8 {
    // Adding 1.5·2^23 to a value below 2^22 in magnitude rounds it to the nearest integer,
    // held in the low mantissa bits: a float-to-int conversion the compiler vectorises
    // (Rust's saturating `as i32` it does not).
    const MAGIC: f32 = 12_582_912.0;
    // Clamping the sum (not `y`) at ±(lim + ¼) changes nothing that rounds into range, and
    // catches both values beyond the range (clipping) and a sum that f32 rounded up to
    // exactly ±(lim + ½), which would round to even outside it.
    let w = y + u;
    let w = if w < -lim - 0.25 { -lim - 0.25 } else { w };
    let w = if w > lim + 0.25 { lim + 0.25 } else { w };
    ((w + MAGIC).to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32) as i8
}

/// [`round_block`] of `x·pre·inv`.
#[inline(always)]
fn round_scaled(x: &[f32], pre: f32, inv: f32, lim: f32, dither: &mut Dither, q: &mut [i8]) {
    if pre == 1.0 {
        round_lanes::<false>(x, pre, inv, lim, dither, q);
    } else {
        round_lanes::<true>(x, pre, inv, lim, dither, q);
    }
}

/// [`round_scaled`], the pre-scaling a constant choice so the loop has no branch.
#[inline(always)]
fn round_lanes<const PRE: bool>(
    x: &[f32],
    pre: f32,
    inv: f32,
    lim: f32,
    dither: &mut Dither,
    q: &mut [i8],
) {
    let lanes = |xv: &[f32], u: &[f32; LANES], qv: &mut [i8]| {
        let mut k = [0i32; LANES];
        for ((k, &v), &u) in k.iter_mut().zip(xv).zip(u) {
            let y = if PRE { v * pre * inv } else { v * inv };
            *k = i32::from(round_one(y, u, lim));
        }
        for (o, &k) in qv.iter_mut().zip(&k) {
            *o = k as i8;
        }
    };
    let mut xs = x.chunks_exact(LANES);
    let mut qs = q.chunks_exact_mut(LANES);
    for (xv, qv) in (&mut xs).zip(&mut qs) {
        let u = dither.next_centred();
        lanes(xv, &u, qv);
    }
    if !xs.remainder().is_empty() {
        let u = dither.next_centred();
        lanes(xs.remainder(), &u, qs.into_remainder());
    }
}

/// Encodes `x` chunk by chunk into `out` (see [`super::Codec::encoded_len`]).
pub(crate) fn encode(lv: Levels, x: &[f32], chunk: usize, out: &mut [u8], rng: &mut Rng) {
    let mut dither = Dither::new(rng);
    let mut q = [0i8; BLOCK];
    let mut pos = 0;
    for xs in x.chunks(chunk) {
        let len = chunk_bytes(lv, xs.len());
        let (head, codes) = out[pos..pos + len].split_at_mut(4);
        pos += len;
        let range = local_range(xs, lv.clip);
        if !range.is_finite() {
            head.copy_from_slice(&f32::NAN.to_le_bytes());
            codes.fill(0);
            continue;
        }
        head.copy_from_slice(&step_of(range, lv).to_le_bytes());
        let code_block = packed_len(BLOCK, lv.bits);
        for (xb, cb) in xs.chunks(BLOCK).zip(codes.chunks_mut(code_block)) {
            let qb = &mut q[..xb.len()];
            round_block(xb, range, lv, &mut dither, qb);
            pack_codes(qb, lv.bits, cb);
        }
    }
}

/// Decodes `bytes` into `out` as `mode` says, checking every scale and code.
pub(crate) fn decode(
    lv: Levels,
    bytes: &[u8],
    chunk: usize,
    out: &mut [f32],
    mode: Mode,
) -> Result<(), CodecError> {
    let mut q = [0i8; BLOCK];
    let mut pos = 0;
    for (c, os) in out.chunks_mut(chunk).enumerate() {
        let len = chunk_bytes(lv, os.len());
        let (head, codes) = bytes[pos..pos + len].split_at(4);
        pos += len;
        let step = f32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        check_step(step, lv.max, c)?;
        let code_block = packed_len(BLOCK, lv.bits);
        for (ob, cb) in os.chunks_mut(BLOCK).zip(codes.chunks(code_block)) {
            let qb = &mut q[..ob.len()];
            if !unpack_codes(cb, lv.bits, qb) {
                return Err(CodecError::Invalid {
                    chunk: c,
                    what: "a reserved code or non-zero padding",
                });
            }
            apply_scaled(mode, ob, qb, step);
        }
    }
    Ok(())
}

/// `out (op)= q·step` element by element.
pub(crate) fn apply_scaled(mode: Mode, out: &mut [f32], q: &[i8], step: f32) {
    let pairs = out.iter_mut().zip(q);
    match mode {
        Mode::Set => pairs.for_each(|(o, &k)| *o = f32::from(k) * step),
        Mode::Add => pairs.for_each(|(o, &k)| *o += f32::from(k) * step),
        Mode::Sub => pairs.for_each(|(o, &k)| *o -= f32::from(k) * step),
    }
}

/// A step read from the wire must be finite, not negative, and small enough that its largest
/// code (`max`: `L`, or 1 for a sign scale) times it is finite: an encoder makes the step of a
/// finite range over `L`, so only a broken or hostile peer sends more, and its codes would
/// decode to infinities.
pub(crate) fn check_step(step: f32, max: i32, chunk: usize) -> Result<(), CodecError> {
    if !step.is_finite() || !(step * max as f32).is_finite() {
        return Err(CodecError::NonFinite { chunk });
    }
    if step.is_sign_negative() {
        return Err(CodecError::Invalid {
            chunk,
            what: "a negative scale",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_code_of_any_finite_range_decodes_finite() {
        for lv in [INT8, INT4, ternary(false)] {
            for range in [
                f32::MAX,
                f32::from_bits(f32::MAX.to_bits() - 1),
                1e38,
                1.0,
                1e-38,
            ] {
                let step = step_of(range, lv);
                let top = step * lv.max as f32;
                assert!(top.is_finite(), "{} {range}: {top}", lv.max);
                assert!(check_step(step, lv.max, 0).is_ok(), "{} {range}", lv.max);
            }
        }
    }

    #[test]
    fn ranges() {
        assert_eq!(local_range(&[1.0, -3.0, 2.0], false), 3.0);
        assert!(local_range(&[1.0, f32::INFINITY], false).is_nan());
        assert!(local_range(&[f32::NAN, 1.0], true).is_nan());
        assert_eq!(local_range(&[], true), 0.0);
        // One outlier among many small values is clipped at 2.5 rms ...
        let mut x = vec![0.1f32; 999];
        x.push(100.0);
        let r = local_range(&x, true);
        assert!(r < 10.0 && r > 2.5 * 3.0, "{r}");
        // ... a constant chunk is not.
        assert_eq!(local_range(&[0.5; 16], true), 0.5);
        // Squares that underflow or overflow disable clipping.
        assert_eq!(local_range(&[1e-30, -1e-25], true), 1e-25);
        assert_eq!(local_range(&[3e38, 1.0], true), 3e38);
    }

    #[test]
    fn rounding_never_leaves_the_range() {
        // The extreme uniforms at the extreme values: y + u may round (in f32) to exactly
        // ±(L + ½), which must not become a code beyond ±L.
        let u_max = 0.5 - 2f32.powi(-24);
        for lv in [INT8, INT4, ternary(false)] {
            let l = lv.max as f32;
            for y in [
                l,
                -l,
                l - 1e-6,
                -l + 1e-6,
                l * 1.0001,
                -l * 1.0001,
                3.0 * l,
                -3.0 * l,
            ] {
                for u in [u_max, -u_max, 0.0, 0.25, -0.25] {
                    let q = i32::from(round_one(y, u, l));
                    assert!(q.abs() <= lv.max, "{lv:?} y={y} u={u}: {q}");
                    // A neighbour of y (f32 rounding of y + u may tip a sum a hair from a
                    // half-integer to the other side: probability below 2^-17).
                    let clamped = y.clamp(-l, l);
                    assert!((q as f32 - clamped).abs() <= 1.0, "{lv:?} y={y} u={u}: {q}");
                }
            }
        }
        // Stochastic rounding of an interior value: down or up only.
        assert_eq!(round_one(2.3, -0.49, 127.0), 2);
        assert_eq!(round_one(2.3, 0.21, 127.0), 3);
        assert_eq!(round_one(-2.3, 0.49, 127.0), -2);
        assert_eq!(round_one(-2.3, -0.21, 127.0), -3);
    }

    #[test]
    fn rounding_stays_on_the_grid_and_hits_exact_values() {
        let mut rng = Rng::new(1, 2);
        let mut d = Dither::new(&mut rng);
        let x = [0.0, 1.0, -1.0, 0.5, 127.0, -127.0, 200.0, -1e-3];
        let mut q = [0i8; 8];
        round_block(&x, 127.0, INT8, &mut d, &mut q);
        assert_eq!(&q[..3], &[0, 1, -1]);
        assert!(q[3] == 0 || q[3] == 1);
        assert_eq!(&q[4..7], &[127, -127, 127]);
        assert!(q[7] == 0 || q[7] == -1);
        round_block(&x, 0.0, INT8, &mut d, &mut q);
        assert_eq!(q, [0; 8]);
    }
}
