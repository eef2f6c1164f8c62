//! Reduction operators.

use std::fmt;
use std::str::FromStr;

use crate::ParseNameError;

/// How the ranks' elements are combined. The discriminants are NCCL's `ncclRedOp_t` and part
/// of the C ABI.
///
/// Integer `Sum` and `Prod` wrap around like C's unsigned arithmetic. `Avg` reduces like `Sum`
/// and divides by the number of ranks at the end (integer division for integer types), so
/// the sum must fit the type: a wrapped integer sum is divided as it is (two `u8` 200s
/// average to 72), and f16 values whose sum passes 65504 average to ∞ (scale them by 1/p
/// first, or reduce in f32). The bitwise operators (numbers 5–7, past NCCL's) take integer
/// dtypes only.
///
/// ```
/// use chorus_algorithms::ReduceOp;
/// assert_eq!("max".parse::<ReduceOp>().unwrap(), ReduceOp::Max);
/// assert_eq!(ReduceOp::from_i32(4), Some(ReduceOp::Avg));
/// assert_eq!(ReduceOp::Prod.name(), "prod");
/// ```
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum = 0,
    /// Product.
    Prod = 1,
    /// Maximum.
    Max = 2,
    /// Minimum.
    Min = 3,
    /// Sum divided by the number of ranks.
    Avg = 4,
    /// Bitwise and (integer dtypes only; as `MPI_BAND`).
    BitAnd = 5,
    /// Bitwise or (integer dtypes only; as `MPI_BOR`).
    BitOr = 6,
    /// Bitwise exclusive or (integer dtypes only; as `MPI_BXOR`).
    BitXor = 7,
}

impl ReduceOp {
    /// The arithmetic operators, in discriminant order (every dtype takes them).
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The bitwise operators, for integer dtypes (MPI's `MPI_BAND`, `MPI_BOR`, `MPI_BXOR`;
    /// NCCL has none).
    pub const BITWISE: [ReduceOp; 3] = [ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor];

    /// Whether this is one of [`ReduceOp::BITWISE`].
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }

    /// The name nccl-tests prints ("sum", "prod", "max", "min", "avg").
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
            ReduceOp::BitAnd => "band",
            ReduceOp::BitOr => "bor",
            ReduceOp::BitXor => "bxor",
        }
    }

    /// The operator with NCCL number `v`, if any.
    pub const fn from_i32(v: i32) -> Option<ReduceOp> {
        Some(match v {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Prod,
            2 => ReduceOp::Max,
            3 => ReduceOp::Min,
            4 => ReduceOp::Avg,
            5 => ReduceOp::BitAnd,
            6 => ReduceOp::BitOr,
            7 => ReduceOp::BitXor,
            _ => return None,
        })
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = ParseNameError;

    /// Accepts the names above (case-insensitive) and "product", "mean", "average".
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "max" => ReduceOp::Max,
            "min" => ReduceOp::Min,
            "avg" | "mean" | "average" => ReduceOp::Avg,
            "band" | "and" => ReduceOp::BitAnd,
            "bor" | "or" => ReduceOp::BitOr,
            "bxor" | "xor" => ReduceOp::BitXor,
            _ => {
                return Err(ParseNameError {
                    what: "reduction",
                    input: s.to_string(),
                    expected: "sum, prod, max, min, avg, band, bor, bxor",
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbering_and_names_round_trip() {
        for (i, op) in ReduceOp::ALL.iter().enumerate() {
            assert_eq!(*op as i32, i as i32);
            assert_eq!(ReduceOp::from_i32(i as i32), Some(*op));
            assert_eq!(op.name().parse::<ReduceOp>().unwrap(), *op);
        }
        for op in ReduceOp::BITWISE {
            assert_eq!(ReduceOp::from_i32(op as i32), Some(op));
            assert_eq!(op.name().parse::<ReduceOp>().unwrap(), op);
            assert!(op.is_bitwise());
        }
        assert_eq!(ReduceOp::from_i32(8), None);
        assert!("nand".parse::<ReduceOp>().is_err());
    }
}
