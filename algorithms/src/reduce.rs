//! Reduce kernels: `dst[i] = dst[i] ⊕ src[i]`, typed and on raw bytes.
//!
//! The loops are plain element-wise zips over slices so that LLVM vectorises them (check with
//! `opt-level = 3`: f32 sum runs at memory speed). Integer `Sum`/`Prod` wrap like C. `Avg`
//! reduces like `Sum`; the division by the number of ranks is a separate pass,
//! [`finish_avg_bytes`], which a schedule runs once on the part of the buffer it finalises.
//! f16 and bf16 are widened to f32, combined, and rounded back once (for `Sum` this is the
//! correctly rounded half-precision sum: f32 does not always hold it exactly, but with at
//! least 2·11 + 1 bits of precision a sum rounded first to f32 and then to f16 (or bf16)
//! rounds as the exact sum would); f16 in blocks of
//! [`HALF_BLOCK`] elements through half's slice helpers (F16C where the CPU has it), bf16 in one
//! fused, vectorised pass.
//!
//! ```
//! use chorus_algorithms::{reduce, DType, ReduceOp};
//! let mut a = [1.0f32, 2.0, 3.0];
//! reduce::reduce_slice(ReduceOp::Max, &mut a, &[0.0, 5.0, 1.0]);
//! assert_eq!(a, [1.0, 5.0, 3.0]);
//!
//! let mut bytes = 7i32.to_ne_bytes();
//! reduce::reduce_bytes(DType::Int32, ReduceOp::Sum, &mut bytes, &5i32.to_ne_bytes());
//! reduce::finish_avg_bytes(DType::Int32, &mut bytes, 2);
//! assert_eq!(i32::from_ne_bytes(bytes), 6);
//! ```

use half::{bf16, f16};

use half::slice::HalfFloatSliceExt;

use crate::halfconv::{bf16_to_f32, f32_to_bf16};
use crate::{DType, Element, ReduceOp};

/// Elements of f16 widened to f32 at a time (two 1 KiB stack buffers).
pub const HALF_BLOCK: usize = 256;

/// Bytes staged at a time through an aligned stack buffer when a byte slice is not aligned
/// for its element type (a multiple of every element size).
const STAGE_BYTES: usize = 4096;

/// Calls `$f::<T>(args...)` with `T` the Rust type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::Int8 => $f::<i8>($($arg),*),
            DType::Uint8 => $f::<u8>($($arg),*),
            DType::Int32 => $f::<i32>($($arg),*),
            DType::Uint32 => $f::<u32>($($arg),*),
            DType::Int64 => $f::<i64>($($arg),*),
            DType::Uint64 => $f::<u64>($($arg),*),
            DType::Float16 => $f::<f16>($($arg),*),
            DType::Float32 => $f::<f32>($($arg),*),
            DType::Float64 => $f::<f64>($($arg),*),
            DType::Bfloat16 => $f::<bf16>($($arg),*),
        }
    };
}

/// `dst[i] = dst[i] ⊕ src[i]` for every `i` (`Avg` adds; see [`finish_avg_bytes`]).
///
/// # Panics
/// If the lengths differ.
pub fn reduce_slice<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "reduce_slice: lengths differ");
    // `T` is exactly the type named by `T::DTYPE`, so these casts never fail.
    use bytemuck::{cast_slice as c, cast_slice_mut as m};
    match T::DTYPE {
        DType::Int8 => reduce_i8(op, m(dst), c(src)),
        DType::Uint8 => reduce_u8(op, m(dst), c(src)),
        DType::Int32 => reduce_i32(op, m(dst), c(src)),
        DType::Uint32 => reduce_u32(op, m(dst), c(src)),
        DType::Int64 => reduce_i64(op, m(dst), c(src)),
        DType::Uint64 => reduce_u64(op, m(dst), c(src)),
        DType::Float32 => reduce_f32(op, m(dst), c(src)),
        DType::Float64 => reduce_f64(op, m(dst), c(src)),
        DType::Float16 => reduce_f16(op, m(dst), c(src)),
        DType::Bfloat16 => reduce_bf16(op, m(dst), c(src)),
    }
}

/// [`reduce_slice`] on raw bytes holding elements of `dtype` in native byte order. The slices
/// need not be aligned (unaligned ones are staged through an aligned buffer, slower).
///
/// # Panics
/// If the lengths differ or are not a multiple of the element size.
pub fn reduce_bytes(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_bytes: lengths differ");
    assert_eq!(
        dst.len() % dtype.size(),
        0,
        "reduce_bytes: length is not a multiple of the {dtype} size"
    );
    dispatch!(dtype, reduce_bytes_as(op, dst, src))
}

/// Finishes an average: divides every element of `buf` (which holds sums) by `ranks`.
/// Integers: integer division of the (wrapped) sum, rounding toward zero like C. Floats:
/// division in the type itself; f16 and bf16 divide in f32 and round once.
///
/// # Panics
/// If `ranks` is zero or the length is not a multiple of the element size.
pub fn finish_avg_bytes(dtype: DType, buf: &mut [u8], ranks: usize) {
    assert!(ranks > 0, "finish_avg_bytes: zero ranks");
    assert_eq!(
        buf.len() % dtype.size(),
        0,
        "finish_avg_bytes: length is not a multiple of the {dtype} size"
    );
    if ranks > 1 {
        dispatch!(dtype, finish_avg_bytes_as(buf, ranks))
    }
}

/// Divides integers through a wider type so that `ranks` never wraps in the element type.
macro_rules! avg_int {
    ($buf:expr, $ranks:expr, $wide:ty) => {{
        let p = $ranks as $wide;
        for x in $buf.iter_mut() {
            *x = (*x as $wide / p) as _;
        }
    }};
}
/// [`finish_avg_bytes`] on a typed slice.
pub fn finish_avg_slice<T: Element>(buf: &mut [T], ranks: usize) {
    assert!(ranks > 0, "finish_avg_slice: zero ranks");
    if ranks == 1 {
        return;
    }
    use bytemuck::cast_slice_mut as m;
    match T::DTYPE {
        DType::Int8 => avg_int!(m::<T, i8>(buf), ranks, i64),
        DType::Uint8 => avg_int!(m::<T, u8>(buf), ranks, u64),
        DType::Int32 => avg_int!(m::<T, i32>(buf), ranks, i64),
        DType::Uint32 => avg_int!(m::<T, u32>(buf), ranks, u64),
        DType::Int64 => avg_int!(m::<T, i64>(buf), ranks, i64),
        DType::Uint64 => avg_int!(m::<T, u64>(buf), ranks, u64),
        DType::Float32 => {
            let p = ranks as f32;
            m::<T, f32>(buf).iter_mut().for_each(|x| *x /= p);
        }
        DType::Float64 => {
            let p = ranks as f64;
            m::<T, f64>(buf).iter_mut().for_each(|x| *x /= p);
        }
        DType::Float16 => avg_f16(m(buf), ranks),
        DType::Bfloat16 => avg_bf16(m(buf), ranks),
    }
}

fn avg_f16(buf: &mut [f16], ranks: usize) {
    let p = ranks as f32;
    let mut wide = [0f32; HALF_BLOCK];
    for block in buf.chunks_mut(HALF_BLOCK) {
        let w = &mut wide[..block.len()];
        block.convert_to_f32_slice(w);
        w.iter_mut().for_each(|x| *x /= p);
        block.convert_from_f32_slice(w);
    }
}

fn avg_bf16(buf: &mut [bf16], ranks: usize) {
    let p = ranks as f32;
    let bits: &mut [u16] = bytemuck::cast_slice_mut(buf);
    bits.iter_mut()
        .for_each(|x| *x = f32_to_bf16(bf16_to_f32(*x) / p));
}

fn is_aligned<T>(bytes: &[u8]) -> bool {
    bytes.as_ptr() as usize % std::mem::align_of::<T>() == 0
}

fn reduce_bytes_as<T: Element>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    if is_aligned::<T>(dst) && is_aligned::<T>(src) {
        return reduce_slice::<T>(op, bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    }
    // u64 storage is aligned for every element type.
    let mut a = [0u64; STAGE_BYTES / 8];
    let mut b = [0u64; STAGE_BYTES / 8];
    for (d, s) in dst.chunks_mut(STAGE_BYTES).zip(src.chunks(STAGE_BYTES)) {
        let ab = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut a)[..d.len()];
        let bb = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut b)[..d.len()];
        ab.copy_from_slice(d);
        bb.copy_from_slice(s);
        reduce_slice::<T>(op, bytemuck::cast_slice_mut(ab), bytemuck::cast_slice(bb));
        d.copy_from_slice(ab);
    }
}

fn finish_avg_bytes_as<T: Element>(buf: &mut [u8], ranks: usize) {
    if is_aligned::<T>(buf) {
        return finish_avg_slice::<T>(bytemuck::cast_slice_mut(buf), ranks);
    }
    let mut a = [0u64; STAGE_BYTES / 8];
    for d in buf.chunks_mut(STAGE_BYTES) {
        let ab = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut a)[..d.len()];
        ab.copy_from_slice(d);
        finish_avg_slice::<T>(bytemuck::cast_slice_mut(ab), ranks);
        d.copy_from_slice(ab);
    }
}

/// Integer kernels: wrapping sum and product, like C.
macro_rules! int_kernel {
    ($name:ident, $t:ty) => {
        fn $name(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
            let pairs = dst.iter_mut().zip(src);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, b)| *a = a.wrapping_add(*b)),
                ReduceOp::Prod => pairs.for_each(|(a, b)| *a = a.wrapping_mul(*b)),
                ReduceOp::Max => pairs.for_each(|(a, b)| *a = (*a).max(*b)),
                ReduceOp::Min => pairs.for_each(|(a, b)| *a = (*a).min(*b)),
                ReduceOp::BitAnd => pairs.for_each(|(a, b)| *a &= *b),
                ReduceOp::BitOr => pairs.for_each(|(a, b)| *a |= *b),
                ReduceOp::BitXor => pairs.for_each(|(a, b)| *a ^= *b),
            }
        }
    };
}

int_kernel!(reduce_i8, i8);
int_kernel!(reduce_u8, u8);
int_kernel!(reduce_i32, i32);
int_kernel!(reduce_u32, u32);
int_kernel!(reduce_i64, i64);
int_kernel!(reduce_u64, u64);

/// Float kernels. `Max`/`Min` follow IEEE maxNum/minNum (a NaN operand is ignored). The
/// bitwise operators combine the bit patterns (the communicator refuses them for floats, as
/// MPI does; this keeps the kernels total).
macro_rules! float_kernel {
    ($name:ident, $t:ty) => {
        fn $name(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
            let pairs = dst.iter_mut().zip(src);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, b)| *a += *b),
                ReduceOp::Prod => pairs.for_each(|(a, b)| *a *= *b),
                ReduceOp::Max => pairs.for_each(|(a, b)| *a = a.max(*b)),
                ReduceOp::Min => pairs.for_each(|(a, b)| *a = a.min(*b)),
                ReduceOp::BitAnd => {
                    pairs.for_each(|(a, b)| *a = <$t>::from_bits(a.to_bits() & b.to_bits()))
                }
                ReduceOp::BitOr => {
                    pairs.for_each(|(a, b)| *a = <$t>::from_bits(a.to_bits() | b.to_bits()))
                }
                ReduceOp::BitXor => {
                    pairs.for_each(|(a, b)| *a = <$t>::from_bits(a.to_bits() ^ b.to_bits()))
                }
            }
        }
    };
}

float_kernel!(reduce_f32, f32);
float_kernel!(reduce_f64, f64);

/// f16: blocks widened to f32 with half's slice helpers (F16C instructions where available).
fn reduce_f16(op: ReduceOp, dst: &mut [f16], src: &[f16]) {
    if op.is_bitwise() {
        let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
        return bits_u16(op, dst, bytemuck::cast_slice(src));
    }
    let mut a = [0f32; HALF_BLOCK];
    let mut b = [0f32; HALF_BLOCK];
    for (d, s) in dst.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
        let n = d.len();
        d.convert_to_f32_slice(&mut a[..n]);
        s.convert_to_f32_slice(&mut b[..n]);
        reduce_f32(op, &mut a[..n], &b[..n]);
        d.convert_from_f32_slice(&a[..n]);
    }
}

/// bf16: one fused pass, widening, combining in f32 and rounding each element.
fn reduce_bf16(op: ReduceOp, dst: &mut [bf16], src: &[bf16]) {
    let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
    let src: &[u16] = bytemuck::cast_slice(src);
    let pairs = dst.iter_mut().zip(src);
    let w = bf16_to_f32;
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, b)| *a = f32_to_bf16(w(*a) + w(*b))),
        ReduceOp::Prod => pairs.for_each(|(a, b)| *a = f32_to_bf16(w(*a) * w(*b))),
        ReduceOp::Max => pairs.for_each(|(a, b)| *a = f32_to_bf16(w(*a).max(w(*b)))),
        ReduceOp::Min => pairs.for_each(|(a, b)| *a = f32_to_bf16(w(*a).min(w(*b)))),
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => bits_u16(op, dst, src),
    }
}

/// The bitwise operators on 16-bit patterns (f16, bf16).
fn bits_u16(op: ReduceOp, dst: &mut [u16], src: &[u16]) {
    let pairs = dst.iter_mut().zip(src);
    match op {
        ReduceOp::BitAnd => pairs.for_each(|(a, b)| *a &= *b),
        ReduceOp::BitOr => pairs.for_each(|(a, b)| *a |= *b),
        _ => pairs.for_each(|(a, b)| *a ^= *b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The obvious per-element definition, computed in f64 and wrapped back.
    fn naive<T: Element>(op: ReduceOp, a: T, b: T) -> T {
        let (x, y) = (a.to_f64(), b.to_f64());
        T::from_f64(match op {
            ReduceOp::Sum | ReduceOp::Avg => x + y,
            ReduceOp::Prod => x * y,
            ReduceOp::Max => x.max(y),
            ReduceOp::Min => x.min(y),
            ReduceOp::BitAnd => return T::from_f64(((x as i64) & (y as i64)) as f64),
            ReduceOp::BitOr => return T::from_f64(((x as i64) | (y as i64)) as f64),
            ReduceOp::BitXor => return T::from_f64(((x as i64) ^ (y as i64)) as f64),
        })
    }

    fn check_type<T: Element>() {
        let n = 3 * HALF_BLOCK + 5;
        // Small values, negative ones only where representable, so `naive` stays exact
        // (wrapping has its own test).
        let shift = if T::from_f64(-1.0).to_f64() < 0.0 {
            1.0
        } else {
            0.0
        };
        let a: Vec<T> = (0..n)
            .map(|i| T::from_f64(((i * 7) % 23) as f64 - 5.0 * shift))
            .collect();
        let b: Vec<T> = (0..n)
            .map(|i| T::from_f64(((i * 5) % 19) as f64 - 9.0 * shift))
            .collect();
        for op in ReduceOp::ALL {
            let want: Vec<T> = a.iter().zip(&b).map(|(x, y)| naive(op, *x, *y)).collect();
            let mut got = a.clone();
            reduce_slice(op, &mut got, &b);
            assert_eq!(got, want, "{} {op}", T::DTYPE);

            // The byte path, aligned and shifted by one byte (unaligned for every size > 1).
            let bytes_a: &[u8] = bytemuck::cast_slice(&a);
            let bytes_b: &[u8] = bytemuck::cast_slice(&b);
            for shift in [0, 1] {
                let mut da = vec![0u8; bytes_a.len() + 1];
                let mut db = vec![0u8; bytes_b.len() + 1];
                da[shift..shift + bytes_a.len()].copy_from_slice(bytes_a);
                db[1 - shift..1 - shift + bytes_b.len()].copy_from_slice(bytes_b);
                let len = bytes_a.len();
                reduce_bytes(
                    T::DTYPE,
                    op,
                    &mut da[shift..shift + len],
                    &db[1 - shift..1 - shift + len],
                );
                let got: Vec<T> = da[shift..shift + len]
                    .chunks(T::DTYPE.size())
                    .map(bytemuck::pod_read_unaligned)
                    .collect();
                assert_eq!(got, want, "{} {op} shift {shift}", T::DTYPE);
            }
        }
    }

    #[test]
    fn every_type_and_op_matches_the_naive_definition() {
        check_type::<i8>();
        check_type::<u8>();
        check_type::<i32>();
        check_type::<u32>();
        check_type::<i64>();
        check_type::<u64>();
        check_type::<f16>();
        check_type::<f32>();
        check_type::<f64>();
        check_type::<bf16>();
    }

    #[test]
    fn integers_wrap() {
        let mut a = [i8::MAX, 100u8 as i8, -128];
        reduce_slice(ReduceOp::Sum, &mut a, &[1, 100, -1]);
        assert_eq!(a, [i8::MIN, -56, 127]);
        let mut b = [u32::MAX, 1 << 31];
        reduce_slice(ReduceOp::Prod, &mut b, &[2, 2]);
        assert_eq!(b, [u32::MAX - 1, 0]);
    }

    #[test]
    fn avg_divides_in_the_type() {
        let mut i = [7i32, -7, 8];
        finish_avg_slice(&mut i, 2);
        assert_eq!(i, [3, -3, 4]);
        let mut u = [255u8, 200];
        finish_avg_slice(&mut u, 300);
        assert_eq!(u, [0, 0]);
        let mut f = [3.0f32, 1.0];
        finish_avg_slice(&mut f, 4);
        assert_eq!(f, [0.75, 0.25]);
        let mut h = vec![f16::from_f32(3.0); HALF_BLOCK + 1];
        finish_avg_slice(&mut h, 3);
        assert!(h.iter().all(|x| *x == f16::from_f32(1.0)));
        // Unaligned bytes.
        let mut raw = [0u8; 9];
        raw[1..9].copy_from_slice(&10.0f64.to_ne_bytes());
        finish_avg_bytes(DType::Float64, &mut raw[1..9], 4);
        assert_eq!(f64::from_ne_bytes(raw[1..9].try_into().unwrap()), 2.5);
    }

    #[test]
    fn half_max_ignores_nan_like_f32() {
        let mut a = [bf16::NAN, bf16::from_f32(1.0)];
        reduce_slice(ReduceOp::Max, &mut a, &[bf16::from_f32(2.0), bf16::NAN]);
        assert_eq!(a, [bf16::from_f32(2.0), bf16::from_f32(1.0)]);
    }
}
