//! Reduction operators.

use std::fmt;
use std::str::FromStr;

use crate::ParseNameError;

/// How the ranks' elements are combined. The discriminants are NCCL's `ncclRedOp_t` and part
/// of the C ABI.
///
/// Integer `Sum` and `Prod` wrap around like C's unsigned arithmetic. `Avg` reduces like `Sum`
/// and divides by the number of ranks at the end (integer division for integer types).
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
}

impl ReduceOp {
    /// Every operator, in discriminant order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The name nccl-tests prints ("sum", "prod", "max", "min", "avg").
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
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
            _ => {
                return Err(ParseNameError {
                    what: "reduction",
                    input: s.to_string(),
                    expected: "sum, prod, max, min, avg",
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
        assert_eq!(ReduceOp::from_i32(5), None);
        assert!("xor".parse::<ReduceOp>().is_err());
    }
}
