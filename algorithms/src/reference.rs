//! A naive reference allreduce, deterministic test inputs and the comparison rule.
//!
//! # Checking results (nccl-tests' `#wrong`)
//!
//! Inputs from [`test_value`] are small integers chosen per operator so that every partial
//! result of any reduction order is exactly representable in every dtype (for up to 8 ranks;
//! see [`test_value`]). Results are therefore compared with **tolerance 0**, except `Avg` on
//! floating-point types, where the final division rounds once in the type (f16/bf16 twice:
//! through f32), and up to [`AVG_ULP_TOLERANCE`] units in the last place are accepted.
//! Integer `Avg` is the integer division of the (wrapped) sum and compares exactly.
//!
//! ```
//! use chorus_algorithms::{reference, ReduceOp};
//! let p = 3;
//! let inputs: Vec<Vec<f32>> = (0..p)
//!     .map(|r| (0..10).map(|i| reference::test_value(r, i, ReduceOp::Sum, p)).collect())
//!     .collect();
//! let want = reference::all_reduce(&inputs, ReduceOp::Sum);
//! assert_eq!(want[4], reference::expected::<f32>(4, ReduceOp::Sum, p));
//! let mut got = want.clone();
//! assert_eq!(reference::count_wrong(&got, &want, ReduceOp::Sum), 0);
//! got[7] += 1.0;
//! assert_eq!(reference::count_wrong(&got, &want, ReduceOp::Sum), 1);
//! ```

use crate::{DType, Element, ReduceOp};

/// Units in the last place by which a floating-point `Avg` result may differ from the
/// reference.
pub const AVG_ULP_TOLERANCE: u64 = 2;

/// The allreduce of `inputs` (one vector per rank, all of the same length), computed element by
/// element in `f64` and converted once to `T`: integers wrap (as the kernels' wrapping
/// arithmetic does), floats round once. For [`test_value`] inputs the `f64` computation is
/// exact, so this equals what any reduction order gives.
///
/// # Panics
/// If `inputs` is empty or the vectors have different lengths.
pub fn all_reduce<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    assert!(!inputs.is_empty(), "all_reduce: no ranks");
    let n = inputs[0].len();
    assert!(
        inputs.iter().all(|v| v.len() == n),
        "all_reduce: inputs of different lengths"
    );
    (0..n)
        .map(|i| naive(inputs.iter().map(|v| v[i]), op, inputs.len()))
        .collect()
}

/// The reference result at `index` of a scan: the reduction of the [`test_value`]s of ranks
/// `0..upto` of a group of `ranks` (`upto` ≥ 1).
pub fn expected_prefix<T: Element>(index: usize, op: ReduceOp, upto: usize, ranks: usize) -> T {
    naive(
        (0..upto).map(|r| test_value::<T>(r, index, op, ranks)),
        op,
        upto,
    )
}

/// The reference result at `index` of an allreduce over `ranks` ranks whose inputs are
/// [`test_value`]s — without materialising the inputs (for large buffers).
pub fn expected<T: Element>(index: usize, op: ReduceOp, ranks: usize) -> T {
    naive(
        (0..ranks).map(|r| test_value::<T>(r, index, op, ranks)),
        op,
        ranks,
    )
}

fn naive<T: Element>(values: impl Iterator<Item = T>, op: ReduceOp, ranks: usize) -> T {
    let acc = values
        .map(T::to_f64)
        .reduce(|a, b| match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
            // The test values of the bitwise operators are integers of the dtype's range.
            ReduceOp::BitAnd => ((a as i64) & (b as i64)) as f64,
            ReduceOp::BitOr => ((a as i64) | (b as i64)) as f64,
            ReduceOp::BitXor => ((a as i64) ^ (b as i64)) as f64,
        })
        .expect("at least one rank");
    match op {
        ReduceOp::Avg if T::DTYPE.is_float() => T::from_f64(acc / ranks as f64),
        // Integer division of the wrapped sum, rounding toward zero.
        ReduceOp::Avg => T::from_f64((T::from_f64(acc).to_f64() / ranks as f64).trunc()),
        _ => T::from_f64(acc),
    }
}

#[inline]
fn is_signed(d: DType) -> bool {
    !matches!(d, DType::Uint8 | DType::Uint32 | DType::Uint64)
}

/// SplitMix64: a well-mixed hash of the position, so inputs differ between ranks and indices.
#[inline]
fn mix(rank: usize, index: usize, op: ReduceOp) -> u64 {
    let mut z = (rank as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(op as u64 + 1);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The deterministic input of `rank` at `index` for an allreduce with `op` over `ranks` ranks.
///
/// Values are integers (negative ones only for signed and float types):
/// - `Sum`/`Avg`: |v| ≤ m = max(1, ⌊120/ranks⌋), so every partial sum stays within ±240
///   (exact in bf16, which holds integers up to 256, and in i8/u8 without wrapping);
/// - `Prod`: v ∈ {−1, 1, 2} ({1, 2} unsigned) on ranks 0..8 and ±1 beyond (unsigned: {1, 3}
///   on ranks 8..36, so that a rank left out shows, and 1 beyond), so products are ± powers
///   of two up to 2^8, times 3^28 at most for the unsigned types (exact in f64, which the
///   reference computes in; integer types wrap consistently, floats stay exact);
/// - `Max`/`Min`: v ∈ [−100, 100] ([0, 200] unsigned);
/// - `BitXor`: any 8-bit pattern; `BitAnd` (`BitOr`): 8-bit patterns whose bits are each
///   clear (set) with probability about 1/max(p, 2), so that a half to three quarters of the
///   result's bits differ from the operator's identity up to 256 ranks and a rank left out
///   shows (signed types take the pattern as an `i8`).
///
/// Hence every reduction order gives the same result in every dtype for `Prod`, `Max`, `Min`
/// at any rank count and for `Sum`/`Avg` up to 120 ranks.
pub fn test_value<T: Element>(rank: usize, index: usize, op: ReduceOp, ranks: usize) -> T {
    let h = mix(rank, index, op);
    let signed = is_signed(T::DTYPE);
    let v: i64 = match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let m = (120 / ranks.max(1)).max(1) as u64;
            let v = (h % (2 * m + 1)) as i64;
            if signed {
                v - m as i64
            } else {
                v
            }
        }
        ReduceOp::Prod if rank < 8 => match (signed, h % 3) {
            (true, 0) => -1,
            (_, 1) => 2,
            (false, 0) => 2,
            _ => 1,
        },
        ReduceOp::Prod if signed => {
            if h % 2 == 0 {
                -1
            } else {
                1
            }
        }
        ReduceOp::Prod if rank < 36 => {
            if h % 2 == 0 {
                3
            } else {
                1
            }
        }
        ReduceOp::Prod => 1,
        ReduceOp::Max | ReduceOp::Min => {
            let v = (h % 201) as i64;
            if signed {
                v - 100
            } else {
                v
            }
        }
        // 8-bit patterns (integer dtypes; the communicator refuses the bitwise operators for
        // floats), as an i8 for the signed types.
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {
            let pattern = match op {
                ReduceOp::BitXor => (h % 256) as u8,
                _ => {
                    // Bit b differs from the identity (set for AND, clear for OR) with
                    // probability about 1/p: byte b of the hash below 256/p.
                    let below = (256 / ranks.max(2) as u64).max(1);
                    let mut odd = 0u8;
                    for b in 0..8 {
                        if (h >> (8 * b)) & 0xff < below {
                            odd |= 1 << b;
                        }
                    }
                    if op == ReduceOp::BitAnd {
                        !odd
                    } else {
                        odd
                    }
                }
            };
            if signed {
                i64::from(pattern as i8)
            } else {
                i64::from(pattern)
            }
        }
    };
    T::from_f64(v as f64)
}

/// The distance between two floats in units in the last place (`None` for integer types).
fn ulp_distance<T: Element>(a: T, b: T) -> Option<u64> {
    if !T::DTYPE.is_float() {
        return None;
    }
    // Map the sign-magnitude bit pattern onto a line where adjacent floats are adjacent.
    fn ordered(bits: u64, sign: u64) -> i128 {
        if bits & sign != 0 {
            -((bits & !sign) as i128)
        } else {
            bits as i128
        }
    }
    let key = |x: T| -> i128 {
        let bytes = bytemuck::bytes_of(&x);
        match bytes.len() {
            2 => ordered(u16::from_ne_bytes([bytes[0], bytes[1]]) as u64, 1 << 15),
            4 => ordered(
                u32::from_ne_bytes(bytes.try_into().expect("4 bytes")) as u64,
                1 << 31,
            ),
            _ => ordered(
                u64::from_ne_bytes(bytes.try_into().expect("8 bytes")),
                1 << 63,
            ),
        }
    };
    Some((key(a) - key(b)).unsigned_abs().min(u64::MAX as u128) as u64)
}

/// Whether `got` is acceptable where `want` was expected (see the module documentation).
pub fn is_correct<T: Element>(got: T, want: T, op: ReduceOp) -> bool {
    if got == want {
        return true;
    }
    if T::DTYPE.is_float() && got.to_f64().is_nan() && want.to_f64().is_nan() {
        return true;
    }
    op == ReduceOp::Avg
        && !got.to_f64().is_nan()
        && !want.to_f64().is_nan()
        && ulp_distance(got, want).is_some_and(|d| d <= AVG_ULP_TOLERANCE)
}

/// The number of wrong elements of `got` (nccl-tests' `#wrong`): tolerance 0, or
/// [`AVG_ULP_TOLERANCE`] ulp for `Avg` on floats. Missing or extra elements count as wrong.
pub fn count_wrong<T: Element>(got: &[T], want: &[T], op: ReduceOp) -> usize {
    let common = got
        .iter()
        .zip(want)
        .filter(|(g, w)| !is_correct(**g, **w, op))
        .count();
    common + got.len().abs_diff(want.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::{finish_avg_slice, reduce_slice};
    use half::{bf16, f16};

    /// Reduces the test inputs in forward, reverse and pairwise-tree order with the real
    /// kernels; all must match the reference exactly (or within the avg tolerance).
    fn exact_in_every_order<T: Element>() {
        let n = 300;
        for ranks in 1..=8 {
            for op in ReduceOp::ALL {
                let inputs: Vec<Vec<T>> = (0..ranks)
                    .map(|r| (0..n).map(|i| test_value(r, i, op, ranks)).collect())
                    .collect();
                let want = all_reduce(&inputs, op);
                let ex: Vec<T> = (0..n).map(|i| expected(i, op, ranks)).collect();
                assert_eq!(ex, want);

                let fold = |order: &[usize]| {
                    let mut acc = inputs[order[0]].clone();
                    for &r in &order[1..] {
                        reduce_slice(op, &mut acc, &inputs[r]);
                    }
                    acc
                };
                let forward: Vec<usize> = (0..ranks).collect();
                let reverse: Vec<usize> = (0..ranks).rev().collect();
                let mut tree = inputs.clone();
                let mut width = 1;
                while width < ranks {
                    for i in (0..ranks).step_by(2 * width) {
                        if i + width < ranks {
                            let (lo, hi) = tree.split_at_mut(i + width);
                            reduce_slice(op, &mut lo[i], &hi[0]);
                        }
                    }
                    width *= 2;
                }
                for mut got in [fold(&forward), fold(&reverse), tree.swap_remove(0)] {
                    if op == ReduceOp::Avg {
                        finish_avg_slice(&mut got, ranks);
                    }
                    assert_eq!(
                        count_wrong(&got, &want, op),
                        0,
                        "{} {op} p={ranks}",
                        T::DTYPE
                    );
                }
            }
        }
    }

    #[test]
    fn test_inputs_are_exact_in_every_order() {
        exact_in_every_order::<i8>();
        exact_in_every_order::<u8>();
        exact_in_every_order::<i32>();
        exact_in_every_order::<u32>();
        exact_in_every_order::<i64>();
        exact_in_every_order::<u64>();
        exact_in_every_order::<f16>();
        exact_in_every_order::<f32>();
        exact_in_every_order::<f64>();
        exact_in_every_order::<bf16>();
    }

    #[test]
    fn inputs_vary() {
        let v: Vec<f32> = (0..100)
            .map(|i| test_value(1, i, ReduceOp::Max, 4))
            .collect();
        let distinct: std::collections::BTreeSet<i64> = v.iter().map(|x| *x as i64).collect();
        assert!(distinct.len() > 30);
        assert_ne!(
            test_value::<i32>(0, 5, ReduceOp::Sum, 4),
            test_value::<i32>(1, 5, ReduceOp::Sum, 4)
        );
    }

    #[test]
    fn tolerance_rule() {
        let one = 1.0f32;
        let next = f32::from_bits(one.to_bits() + 2);
        let far = f32::from_bits(one.to_bits() + 3);
        assert!(is_correct(next, one, ReduceOp::Avg));
        assert!(!is_correct(far, one, ReduceOp::Avg));
        assert!(!is_correct(next, one, ReduceOp::Sum));
        assert!(is_correct(-0.0f32, 0.0, ReduceOp::Sum));
        assert!(is_correct(f32::from_bits(1), -0.0f32, ReduceOp::Avg));
        assert!(!is_correct(f32::NAN, 1.0, ReduceOp::Avg));
        assert!(!is_correct(4i32, 5, ReduceOp::Avg));
        assert_eq!(count_wrong(&[1i32, 2, 3], &[1, 0], ReduceOp::Sum), 2);
    }
}
