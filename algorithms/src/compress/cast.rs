//! fp16 and bf16: each value rounded to the nearest half-precision value, 2 bytes
//! little-endian, no scales (the chunk size plays no part).
//!
//! Values are rounded as a cast rounds them (torch's `.half()`, the fp16 compression of torch's
//! DDP hook and Horovod): an fp16 value beyond ±65504 (after rounding) becomes ±∞, so a sum
//! that overflows the format reads ±∞ on every rank, as in an fp16 allreduce, where a loss
//! scaler sees it, rather than a finite wrong value; infinities and NaNs pass through as
//! themselves. bf16 keeps f32's range: only a value that rounds past f32's largest steps back
//! to bf16's largest finite value.
//! Bounds: fp16 keeps 11 significant bits for `6.1e-5 ≤ |x| ≤ 65504` (error ≤ `|x|·2⁻¹¹`) and
//! is absolute below (error ≤ `2⁻²⁵`); bf16 keeps 8 bits over f32's whole range (error ≤
//! `|x|·2⁻⁸`, absolute `2⁻¹³⁴` among f32 subnormals).

use half::{f16, slice::HalfFloatSliceExt};

use super::{apply, Mode, BLOCK};
use crate::halfconv::{bf16_to_f32, f32_to_bf16};

/// Which half-precision format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Half {
    F16,
    Bf16,
}

/// Encodes `x` into `out` (`2·x.len()` bytes).
pub(crate) fn encode(h: Half, x: &[f32], out: &mut [u8]) {
    debug_assert_eq!(out.len(), 2 * x.len());
    match h {
        Half::F16 => {
            let mut narrow = [f16::ZERO; BLOCK];
            for (xs, os) in x.chunks(BLOCK).zip(out.chunks_mut(2 * BLOCK)) {
                let m = xs.len();
                narrow[..m].convert_from_f32_slice(xs);
                for (o, v) in os.chunks_exact_mut(2).zip(&narrow[..m]) {
                    o.copy_from_slice(&v.to_bits().to_le_bytes());
                }
            }
        }
        Half::Bf16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                let b = f32_to_bf16(v);
                // A finite value that rounded up to infinity: step back to the largest finite.
                let overflowed = b & 0x7fff == 0x7f80 && v.is_finite();
                let b = b - u16::from(overflowed);
                o.copy_from_slice(&b.to_le_bytes());
            }
        }
    }
}

/// Decodes `bytes` (`2·out.len()` bytes) into `out` as `mode` says. Every bit pattern is a
/// value, so there is nothing to reject.
pub(crate) fn decode(h: Half, bytes: &[u8], out: &mut [f32], mode: Mode) {
    debug_assert_eq!(bytes.len(), 2 * out.len());
    let mut narrow = [f16::ZERO; BLOCK];
    let mut wide = [0f32; BLOCK];
    for (bs, os) in bytes.chunks(2 * BLOCK).zip(out.chunks_mut(BLOCK)) {
        let m = os.len();
        match h {
            Half::F16 => {
                for (v, b) in narrow.iter_mut().zip(bs.chunks_exact(2)) {
                    *v = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                }
                narrow[..m].convert_to_f32_slice(&mut wide[..m]);
            }
            Half::Bf16 => {
                for (w, b) in wide.iter_mut().zip(bs.chunks_exact(2)) {
                    *w = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
        }
        apply(mode, os, &wide[..m]);
    }
}
