//! Element types of the buffers collectives work on.
//!
//! [`DType`] is the run-time tag (numbered as NCCL's `ncclDataType_t`, which the C ABI exposes);
//! [`Element`] is the compile-time side, implemented by the Rust type behind each tag.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::ParseNameError;

/// The element type of a buffer. The discriminants are NCCL's and part of the C ABI.
///
/// ```
/// use chorus_algorithms::DType;
/// let t: DType = "bf16".parse().unwrap();
/// assert_eq!(t, DType::Bfloat16);
/// assert_eq!(t.size(), 2);
/// assert_eq!(t.name(), "bfloat16");
/// assert_eq!(DType::from_i32(7), Some(DType::Float32));
/// ```
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `i8`.
    Int8 = 0,
    /// `u8`.
    Uint8 = 1,
    /// `i32`.
    Int32 = 2,
    /// `u32`.
    Uint32 = 3,
    /// `i64`.
    Int64 = 4,
    /// `u64`.
    Uint64 = 5,
    /// IEEE 754 binary16 ([`half::f16`]).
    Float16 = 6,
    /// `f32`.
    Float32 = 7,
    /// `f64`.
    Float64 = 8,
    /// bfloat16 ([`half::bf16`]).
    Bfloat16 = 9,
}

const DTYPE_NAMES: &str =
    "int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16 \
                           (or aliases such as i32, f32, float32, f16, fp16, bf16, f64)";

impl DType {
    /// Every dtype, in discriminant order.
    pub const ALL: [DType; 10] = [
        DType::Int8,
        DType::Uint8,
        DType::Int32,
        DType::Uint32,
        DType::Int64,
        DType::Uint64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
        DType::Bfloat16,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Int8 | DType::Uint8 => 1,
            DType::Float16 | DType::Bfloat16 => 2,
            DType::Int32 | DType::Uint32 | DType::Float32 => 4,
            DType::Int64 | DType::Uint64 | DType::Float64 => 8,
        }
    }

    /// The name nccl-tests prints ("float", "half", "bfloat16", "int32", ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Int8 => "int8",
            DType::Uint8 => "uint8",
            DType::Int32 => "int32",
            DType::Uint32 => "uint32",
            DType::Int64 => "int64",
            DType::Uint64 => "uint64",
            DType::Float16 => "half",
            DType::Float32 => "float",
            DType::Float64 => "double",
            DType::Bfloat16 => "bfloat16",
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::Float16 | DType::Float32 | DType::Float64 | DType::Bfloat16
        )
    }

    /// The dtype with NCCL number `v`, if any.
    pub const fn from_i32(v: i32) -> Option<DType> {
        Some(match v {
            0 => DType::Int8,
            1 => DType::Uint8,
            2 => DType::Int32,
            3 => DType::Uint32,
            4 => DType::Int64,
            5 => DType::Uint64,
            6 => DType::Float16,
            7 => DType::Float32,
            8 => DType::Float64,
            9 => DType::Bfloat16,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = ParseNameError;

    /// Accepts the nccl-tests names, Rust, NumPy and PyTorch spellings, case-insensitively.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "int8" | "i8" | "char" => DType::Int8,
            "uint8" | "u8" | "byte" => DType::Uint8,
            "int32" | "i32" | "int" => DType::Int32,
            "uint32" | "u32" => DType::Uint32,
            "int64" | "i64" | "long" => DType::Int64,
            "uint64" | "u64" => DType::Uint64,
            "half" | "float16" | "f16" | "fp16" => DType::Float16,
            "float" | "float32" | "f32" | "fp32" => DType::Float32,
            "double" | "float64" | "f64" | "fp64" => DType::Float64,
            "bfloat16" | "bf16" => DType::Bfloat16,
            _ => {
                return Err(ParseNameError {
                    what: "dtype",
                    input: s.to_string(),
                    expected: DTYPE_NAMES,
                })
            }
        })
    }
}

/// A Rust type that can be the element of a collective's buffer.
///
/// Implemented for `i8, u8, i32, u32, i64, u64, f16, f32, f64, bf16`; [`Element::DTYPE`] ties
/// each to its [`DType`]. The conversions exist for test inputs and reference results.
pub trait Element: bytemuck::Pod + Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The run-time tag of this type.
    const DTYPE: DType;
    /// Converts from `f64`. Floats round to nearest; integers truncate toward zero and wrap
    /// modulo 2^bits like C's conversion of an in-range value to an unsigned type, so a
    /// reference computed exactly in `f64` matches wrapping integer arithmetic.
    fn from_f64(v: f64) -> Self;
    /// Converts to `f64` (exact for every type except 64-bit integers beyond 2^53).
    fn to_f64(self) -> f64;
}

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                // Through i64 where it holds the value (a hardware conversion); only values
                // beyond ±2^63 (u64's upper half) take the slower i128 route. Both truncate
                // toward zero and keep the same low bits.
                if v.abs() < 9.0e18 {
                    v as i64 as $t
                } else {
                    v as i128 as $t
                }
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}

int_element!(i8, DType::Int8);
int_element!(u8, DType::Uint8);
int_element!(i32, DType::Int32);
int_element!(u32, DType::Uint32);
int_element!(i64, DType::Int64);
int_element!(u64, DType::Uint64);

impl Element for f32 {
    const DTYPE: DType = DType::Float32;
    #[inline]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::Float64;
    #[inline]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::Float16;
    #[inline]
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    #[inline]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bfloat16;
    #[inline]
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    #[inline]
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbering_names_and_parsing_round_trip() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as i32, i as i32);
            assert_eq!(DType::from_i32(i as i32), Some(*d));
            assert_eq!(d.name().parse::<DType>().unwrap(), *d);
            assert_eq!(d.to_string().to_uppercase().parse::<DType>().unwrap(), *d);
        }
        assert_eq!(DType::from_i32(10), None);
        assert_eq!(DType::from_i32(-1), None);
        assert_eq!("fp16".parse::<DType>().unwrap(), DType::Float16);
        assert_eq!("f32".parse::<DType>().unwrap(), DType::Float32);
        assert_eq!("float32".parse::<DType>().unwrap(), DType::Float32);
        assert_eq!("i32".parse::<DType>().unwrap(), DType::Int32);
        let e = "complex64".parse::<DType>().unwrap_err();
        assert!(e.to_string().contains("complex64"));
    }

    #[test]
    fn element_sizes_match_dtypes() {
        fn check<T: Element>() {
            assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size());
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<f16>();
        check::<f32>();
        check::<f64>();
        check::<bf16>();
    }

    #[test]
    fn integer_conversion_wraps() {
        assert_eq!(<i8 as Element>::from_f64(256.0), 0);
        assert_eq!(<i8 as Element>::from_f64(128.0), -128);
        assert_eq!(<u8 as Element>::from_f64(-1.0), 255);
        assert_eq!(<u64 as Element>::from_f64(-2.0), u64::MAX - 1);
        assert_eq!(<i32 as Element>::from_f64(-7.9), -7);
        // Both sides of the i64 fast path agree with the wide conversion.
        for v in [
            8.9e18, -8.9e18, 9.1e18, -9.1e18, 1.8e19, -1.8e19, 3.0e19, 1e300, -1e300, 0.5,
        ] {
            assert_eq!(<u64 as Element>::from_f64(v), v as i128 as u64, "{v}");
            assert_eq!(<i64 as Element>::from_f64(v), v as i128 as i64, "{v}");
            assert_eq!(<u8 as Element>::from_f64(v), v as i128 as u8, "{v}");
        }
        assert_eq!(<u64 as Element>::from_f64(f64::NAN), 0);
        assert_eq!(<u64 as Element>::from_f64(f64::INFINITY), u64::MAX);
    }
}
