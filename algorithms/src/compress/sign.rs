//! 1-bit sign with a per-chunk scale.
//!
//! A chunk of `m` values is sent as its scale `s = mean |x|` (f32, little-endian; the value of
//! `c` minimising `Σ (x − c·sign x)²`) and one bit per value, set for negative values, eight to
//! a byte, the first value in the lowest bit. Each value decodes as `±s`. Biased: use it with
//! error feedback ([`super::Codec::encode_with_feedback`]). A chunk holding NaN or ±∞ is sent
//! with a NaN scale and zero bits; decoding reports it.

use super::pack::packed_len;
use super::rng::LANES;
use super::stochastic::check_step;
use super::{CodecError, Mode};

/// For each byte of codes, the sign bits of its 8 values (bit `j` of the byte → bit 31 of
/// value `j`).
const SIGN_BITS: [[u32; 8]; 256] = {
    let mut t = [[0u32; 8]; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 8 {
            t[b][j] = ((b as u32 >> j) & 1) << 31;
            j += 1;
        }
        b += 1;
    }
    t
};

/// Bytes of one encoded chunk of `m` values.
pub(crate) fn chunk_bytes(m: usize) -> usize {
    4 + packed_len(m, 1)
}

/// Encodes `x` chunk by chunk into `out`.
pub(crate) fn encode(x: &[f32], chunk: usize, out: &mut [u8]) {
    let mut pos = 0;
    for xs in x.chunks(chunk) {
        let len = chunk_bytes(xs.len());
        let (head, bits) = out[pos..pos + len].split_at_mut(4);
        pos += len;
        let Some(scale) = mean_magnitude(xs) else {
            head.copy_from_slice(&f32::NAN.to_le_bytes());
            bits.fill(0);
            continue;
        };
        head.copy_from_slice(&scale.to_le_bytes());
        let mut groups = xs.chunks_exact(8);
        for (b, g) in bits.iter_mut().zip(&mut groups) {
            *b = (0..8).fold(0u8, |acc, j| acc | u8::from(g[j] < 0.0) << j);
        }
        let rest = groups.remainder();
        if !rest.is_empty() {
            bits[xs.len() / 8] =
                (0..rest.len()).fold(0u8, |acc, j| acc | u8::from(rest[j] < 0.0) << j);
        }
    }
}

/// Error feedback in one pass over memory: per chunk, `residual += x` (kept in cache),
/// encoded as [`encode`] would encode it, then `residual −= ±scale`. The same bytes and
/// residual as encoding `x + residual` and subtracting its decoding; a chunk that held NaN or
/// ±∞ (or whose residual overflowed) has its residual dropped.
pub(crate) fn encode_with_feedback(x: &[f32], residual: &mut [f32], chunk: usize, out: &mut [u8]) {
    let mut pos = 0;
    for (xs, rs) in x.chunks(chunk).zip(residual.chunks_mut(chunk)) {
        let len = chunk_bytes(xs.len());
        let (head, bits) = out[pos..pos + len].split_at_mut(4);
        pos += len;
        rs.iter_mut().zip(xs).for_each(|(r, &v)| *r += v);
        let Some(scale) = mean_magnitude(rs) else {
            head.copy_from_slice(&f32::NAN.to_le_bytes());
            bits.fill(0);
            rs.fill(0.0);
            continue;
        };
        head.copy_from_slice(&scale.to_le_bytes());
        let s = scale.to_bits();
        let mut groups = rs.chunks_exact_mut(8);
        for (b, g) in bits.iter_mut().zip(&mut groups) {
            let byte = (0..8).fold(0u8, |acc, j| acc | u8::from(g[j] < 0.0) << j);
            *b = byte;
            for (j, r) in g.iter_mut().enumerate() {
                *r -= f32::from_bits(s | SIGN_BITS[usize::from(byte)][j]);
            }
        }
        let rest = groups.into_remainder();
        if !rest.is_empty() {
            let byte = (0..rest.len()).fold(0u8, |acc, j| acc | u8::from(rest[j] < 0.0) << j);
            bits[xs.len() / 8] = byte;
            for (j, r) in rest.iter_mut().enumerate() {
                *r -= f32::from_bits(s | SIGN_BITS[usize::from(byte)][j]);
            }
        }
        if !super::all_finite(rs) {
            rs.fill(0.0);
        }
    }
}

/// The mean magnitude of a chunk, `None` if it holds NaN or ±∞.
fn mean_magnitude(xs: &[f32]) -> Option<f32> {
    // Lane-wise accumulators (see `stochastic::Stats`); each term divided by the length
    // first, so the sum stays finite.
    let inv_m = 1.0 / xs.len() as f32;
    let mut sum = [0f32; LANES];
    let mut bad = [0u32; LANES];
    let mut add = |v: &[f32]| {
        for ((s, b), &v) in sum.iter_mut().zip(&mut bad).zip(v) {
            *s += v.abs() * inv_m;
            *b |= u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000);
        }
    };
    let mut lanes = xs.chunks_exact(LANES);
    for v in &mut lanes {
        add(v);
    }
    add(lanes.remainder());
    if bad.iter().any(|&b| b != 0) {
        return None;
    }
    // Rounding can carry a sum of values near f32::MAX just past it.
    Some(sum.iter().sum::<f32>().min(f32::MAX))
}

/// Decodes `bytes` into `out` as `mode` says, checking every scale and the padding bits.
pub(crate) fn decode(
    bytes: &[u8],
    chunk: usize,
    out: &mut [f32],
    mode: Mode,
) -> Result<(), CodecError> {
    let mut pos = 0;
    for (c, os) in out.chunks_mut(chunk).enumerate() {
        let m = os.len();
        let len = chunk_bytes(m);
        let (head, bits) = bytes[pos..pos + len].split_at(4);
        pos += len;
        let scale = f32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        check_step(scale, 1, c)?;
        if m % 8 != 0 && bits[m / 8] >> (m % 8) != 0 {
            return Err(CodecError::Invalid {
                chunk: c,
                what: "non-zero padding bits",
            });
        }
        let s = scale.to_bits();
        // Each byte's 8 values are the scale with the byte's bits as sign bits.
        let value = |b: u8, j: usize| f32::from_bits(s | SIGN_BITS[usize::from(b)][j]);
        let mut groups = os.chunks_exact_mut(8);
        match mode {
            Mode::Set => (&mut groups)
                .zip(bits)
                .for_each(|(g, &b)| g.iter_mut().enumerate().for_each(|(j, o)| *o = value(b, j))),
            Mode::Add => (&mut groups).zip(bits).for_each(|(g, &b)| {
                g.iter_mut()
                    .enumerate()
                    .for_each(|(j, o)| *o += value(b, j))
            }),
            Mode::Sub => (&mut groups).zip(bits).for_each(|(g, &b)| {
                g.iter_mut()
                    .enumerate()
                    .for_each(|(j, o)| *o -= value(b, j))
            }),
        }
        let rest = groups.into_remainder();
        if !rest.is_empty() {
            let b = bits[m / 8];
            for (j, o) in rest.iter_mut().enumerate() {
                let x = value(b, j);
                *o = match mode {
                    Mode::Set => x,
                    Mode::Add => *o + x,
                    Mode::Sub => *o - x,
                };
            }
        }
    }
    Ok(())
}
