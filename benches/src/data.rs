//! Everything that touches element types: resolving `-d`/`-o`/`--algo` names, dispatching a
//! run-time [`DType`] to a generic function, and the test inputs and the check (through
//! `chorus_algorithms::reference`).

use chorus::{Algorithm, DType, Element, ReduceOp};
use chorus_algorithms::reference;

use crate::cli::UsageError;

/// Call `$body` with the type alias `$t` bound to the Rust type of `$dtype`.
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            chorus::DType::Int8 => {
                type $t = i8;
                $body
            }
            chorus::DType::Uint8 => {
                type $t = u8;
                $body
            }
            chorus::DType::Int32 => {
                type $t = i32;
                $body
            }
            chorus::DType::Uint32 => {
                type $t = u32;
                $body
            }
            chorus::DType::Int64 => {
                type $t = i64;
                $body
            }
            chorus::DType::Uint64 => {
                type $t = u64;
                $body
            }
            chorus::DType::Float16 => {
                type $t = half::f16;
                $body
            }
            chorus::DType::Float32 => {
                type $t = f32;
                $body
            }
            chorus::DType::Float64 => {
                type $t = f64;
                $body
            }
            chorus::DType::Bfloat16 => {
                type $t = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_element;

/// `-d`: a dtype name or `all`.
pub fn resolve_dtypes(name: &str) -> Result<Vec<DType>, UsageError> {
    if name.eq_ignore_ascii_case("all") {
        return Ok(DType::ALL.to_vec());
    }
    name.parse()
        .map(|d| vec![d])
        .map_err(|e| UsageError(format!("-d: {e}")))
}

/// `-o`: an op name or `all`.
pub fn resolve_ops(name: &str) -> Result<Vec<ReduceOp>, UsageError> {
    if name.eq_ignore_ascii_case("all") {
        return Ok(ReduceOp::ALL.to_vec());
    }
    name.parse()
        .map(|o| vec![o])
        .map_err(|e| UsageError(format!("-o: {e}")))
}

/// `--algo` naming one schedule, or `auto` (the selector decides, as without `--algo`).
pub fn resolve_algo(name: Option<&str>) -> Result<Option<Algorithm>, UsageError> {
    match name {
        Some(n) if n.trim().eq_ignore_ascii_case("auto") => Ok(None),
        Some(n) => n
            .trim()
            .parse::<Algorithm>()
            .map(Some)
            .map_err(|e| UsageError(format!("--algo: {e} (or auto)"))),
        None => Ok(None),
    }
}

/// Resolve a comparison's `--algo` list: schedule names and `auto` (the selector, `None`),
/// comma-separated, or `all` (every schedule, then `auto`). Each entry at most once.
pub fn resolve_algo_list(list: &str) -> Result<Vec<Option<Algorithm>>, UsageError> {
    if list.trim().eq_ignore_ascii_case("all") {
        return Ok(Algorithm::ALL
            .into_iter()
            .map(Some)
            .chain(std::iter::once(None))
            .collect());
    }
    let mut out = Vec::new();
    for name in list.split(',') {
        let entry = if name.trim().eq_ignore_ascii_case("auto") {
            None
        } else {
            Some(
                name.parse::<Algorithm>()
                    .map_err(|e| UsageError(format!("--algo: {e} (or auto)")))?,
            )
        };
        if out.contains(&entry) {
            return Err(UsageError(format!(
                "--algo: {} is listed twice",
                name.trim()
            )));
        }
        out.push(entry);
    }
    Ok(out)
}

/// Fill `buf` with this rank's test inputs (element `i` of the buffer is input index `i`).
pub fn fill<T: Element>(buf: &mut [T], rank: usize, op: ReduceOp, ranks: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = reference::test_value(rank, i, op, ranks);
    }
}

/// Overwrite `buf` with a value no correct result is expected to hold everywhere, so that a
/// collective that does not write its output is caught: outside the inputs of a max (which
/// feed the collectives that do not reduce: −100..=100, 0..=200 for unsigned types), so not
/// one element left unwritten by them passes. A reduction's result may hold it (an 8-bit
/// `bor` gives 255 often): the check runs such a call again under [`poison_value_of`]'s
/// second value, which differs.
pub fn poison<T: Element>(buf: &mut [T]) {
    buf.fill(poison_value());
}

/// [`poison`] with the first or the `second` of [`poison_value_of`]'s values.
pub fn poison_with<T: Element>(buf: &mut [T], second: bool) {
    buf.fill(poison_value_of(second));
}

/// The value [`poison`] writes: −128, or 255 for the unsigned types.
pub fn poison_value<T: Element>() -> T {
    poison_value_of(false)
}

/// The first poison (−128, or 255 unsigned) or the `second` (−113, or 233 unsigned): both
/// outside the inputs of a max, both exact in every dtype, and different, so that an element
/// left unwritten is wrong under one of them at least, whatever the right result is.
pub fn poison_value_of<T: Element>(second: bool) -> T {
    let signed = T::from_f64(-1.0).to_f64() < 0.0;
    T::from_f64(match (signed, second) {
        (true, false) => -128.0,
        (true, true) => -113.0,
        (false, false) => 255.0,
        (false, true) => 233.0,
    })
}

/// Wrong elements of an allreduce result over `ranks` ranks of [`fill`]ed inputs, compared
/// element by element with the reference (no copy of the inputs is made).
pub fn count_wrong<T: Element>(got: &[T], op: ReduceOp, ranks: usize) -> u64 {
    got.iter()
        .enumerate()
        .filter(|&(i, &g)| !reference::is_correct(g, reference::expected::<T>(i, op, ranks), op))
        .count() as u64
}

/// A zero-filled vector of `n` elements.
pub fn zeros<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_f64(0.0); n]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(resolve_dtypes("float").unwrap(), vec![DType::Float32]);
        assert_eq!(resolve_dtypes("bf16").unwrap(), vec![DType::Bfloat16]);
        assert_eq!(resolve_dtypes("ALL").unwrap().len(), DType::ALL.len());
        assert!(resolve_dtypes("complex").unwrap_err().0.starts_with("-d: "));
        assert_eq!(resolve_ops("max").unwrap(), vec![ReduceOp::Max]);
        assert_eq!(resolve_ops("all").unwrap().len(), ReduceOp::ALL.len());
        assert_eq!(resolve_algo(Some("Auto")).unwrap(), None);
        assert_eq!(resolve_algo(Some(" ring")).unwrap(), Some(Algorithm::Ring));
        assert!(resolve_algo(Some("rign")).is_err());
        assert!(resolve_ops("nand").unwrap_err().0.starts_with("-o: "));
        assert_eq!(resolve_ops("bxor").unwrap(), vec![ReduceOp::BitXor]);
        assert_eq!(resolve_algo(None).unwrap(), None);
        assert!(resolve_algo(Some("no-such-algorithm")).is_err());
        let all = resolve_algo_list("all").unwrap();
        assert_eq!(all.len(), Algorithm::ALL.len() + 1);
        assert_eq!(all.last(), Some(&None));
        assert_eq!(
            resolve_algo_list("tree, AUTO").unwrap(),
            vec![Some(Algorithm::Tree), None]
        );
        assert!(resolve_algo_list("ring,ring")
            .unwrap_err()
            .0
            .contains("twice"));
        assert!(resolve_algo_list("ring,nope").is_err());
    }

    /// The check accepts exactly what the reference allreduce produces, and catches a wrong
    /// element, a poisoned buffer and a buffer holding only this rank's input.
    fn check_catches_errors<T: Element>() {
        let n = 257;
        for ranks in [1, 2, 3, 4] {
            for op in ReduceOp::ALL {
                let inputs: Vec<Vec<T>> = (0..ranks)
                    .map(|r| {
                        let mut v = zeros::<T>(n);
                        fill(&mut v, r, op, ranks);
                        v
                    })
                    .collect();
                let mut got = reference::all_reduce(&inputs, op);
                assert_eq!(count_wrong(&got, op, ranks), 0);
                let bad = T::from_f64(got[7].to_f64() + 8.0);
                got[7] = bad;
                assert_eq!(count_wrong(&got, op, ranks), 1, "{} {op}", T::DTYPE);
                poison(&mut got);
                assert!(
                    count_wrong(&got, op, ranks) > n as u64 / 2,
                    "{} {op}",
                    T::DTYPE
                );
                if ranks > 1 && op == ReduceOp::Sum {
                    assert!(count_wrong(&inputs[0], op, ranks) > n as u64 / 2);
                }
            }
        }
    }

    #[test]
    fn check_in_every_type() {
        with_element!(DType::Float32, T => check_catches_errors::<T>());
        for d in DType::ALL {
            with_element!(d, T => {
                assert_eq!(T::DTYPE, d);
                check_catches_errors::<T>();
            });
        }
    }

    /// The poison is no input of a max (what the collectives that do not reduce move): an
    /// element a collective left unwritten cannot pass as a value it moved.
    #[test]
    fn poison_is_no_input_of_a_max() {
        fn check<T: Element>() {
            let mut p = [T::from_f64(0.0)];
            poison(&mut p);
            let mut q = [T::from_f64(0.0)];
            poison_with(&mut q, true);
            // Two poisons that differ, each exactly what it says.
            assert!(p[0].to_f64() != q[0].to_f64(), "{}", T::DTYPE);
            assert_eq!(p[0].to_f64(), poison_value::<T>().to_f64());
            assert_eq!(q[0].to_f64(), poison_value_of::<T>(true).to_f64());
            for rank in 0..8 {
                for i in 0..2000 {
                    let v: T = reference::test_value(rank, i, ReduceOp::Max, 8);
                    assert!(v.to_f64() != p[0].to_f64(), "{} {rank} {i}", T::DTYPE);
                    assert!(v.to_f64() != q[0].to_f64(), "{} {rank} {i}", T::DTYPE);
                }
            }
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<f32>();
        check::<f64>();
        check::<half::f16>();
        check::<half::bf16>();
    }
}
