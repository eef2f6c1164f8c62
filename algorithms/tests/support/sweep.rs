//! The allreduce sweep shared by the transport-specific integration tests: every case runs
//! on every rank and is compared with the naive reference.

use std::time::{Duration, Instant};

use chorus_algorithms::allreduce::{self, Algorithm};
use chorus_algorithms::reference::{count_wrong, expected, test_value};
use chorus_algorithms::{CollCtx, DType, Element, ReduceOp};
use chorus_transport::{Transport, TransportError};
use half::{bf16, f16};

use super::run_group;

pub const RANKS: [usize; 7] = [1, 2, 3, 4, 5, 7, 8];
pub const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub dtype: DType,
    pub op: ReduceOp,
    pub count: usize,
    pub in_place: bool,
}

/// How a test runs one allreduce: `(ctx, input of an out-of-place call, buffer, dtype, op)`.
pub type Run<'a> = dyn FnMut(&mut CollCtx<'_>, Option<&[u8]>, &mut [u8], DType, ReduceOp) -> Result<(), TransportError>
    + 'a;

/// Runs one allreduce of [`test_value`] inputs with `run` on this rank; returns its number of
/// wrong elements.
fn one<T: Element>(
    run: &mut Run<'_>,
    t: &mut dyn Transport,
    scratch: &mut Vec<u8>,
    seq: u64,
    case: Case,
) -> Result<usize, TransportError> {
    let (rank, size) = (t.rank(), t.size());
    let input: Vec<T> = (0..case.count)
        .map(|i| test_value(rank, i, case.op, size))
        .collect();
    let want: Vec<T> = (0..case.count)
        .map(|i| expected(i, case.op, size))
        .collect();
    let mut ctx = CollCtx {
        transport: t,
        deadline: Instant::now() + TIMEOUT,
        tag_base: seq << 16,
        scratch,
    };
    let got = if case.in_place {
        let mut buf = input;
        let bytes = bytemuck::cast_slice_mut(&mut buf);
        run(&mut ctx, None, bytes, T::DTYPE, case.op)?;
        buf
    } else {
        // Garbage in the output: everything must be overwritten.
        let mut buf = vec![T::from_f64(99.0); case.count];
        let send = Some(bytemuck::cast_slice(&input));
        let bytes = bytemuck::cast_slice_mut(&mut buf);
        run(&mut ctx, send, bytes, T::DTYPE, case.op)?;
        buf
    };
    Ok(count_wrong(&got, &want, case.op))
}

/// [`run_case_with`] by schedule `alg`.
pub fn run_case(
    alg: Algorithm,
    t: &mut dyn Transport,
    scratch: &mut Vec<u8>,
    seq: u64,
    case: Case,
) -> Result<usize, TransportError> {
    let mut run = |ctx: &mut CollCtx<'_>, send: Option<&[u8]>, recv: &mut [u8], d, op| {
        allreduce::run(alg, ctx, send, recv, d, op)
    };
    run_case_with(&mut run, t, scratch, seq, case)
}

/// [`one`] for the element type of `case.dtype`.
pub fn run_case_with(
    run: &mut Run<'_>,
    t: &mut dyn Transport,
    scratch: &mut Vec<u8>,
    seq: u64,
    case: Case,
) -> Result<usize, TransportError> {
    match case.dtype {
        DType::Int8 => one::<i8>(run, t, scratch, seq, case),
        DType::Uint8 => one::<u8>(run, t, scratch, seq, case),
        DType::Int32 => one::<i32>(run, t, scratch, seq, case),
        DType::Uint32 => one::<u32>(run, t, scratch, seq, case),
        DType::Int64 => one::<i64>(run, t, scratch, seq, case),
        DType::Uint64 => one::<u64>(run, t, scratch, seq, case),
        DType::Float16 => one::<f16>(run, t, scratch, seq, case),
        DType::Float32 => one::<f32>(run, t, scratch, seq, case),
        DType::Float64 => one::<f64>(run, t, scratch, seq, case),
        DType::Bfloat16 => one::<bf16>(run, t, scratch, seq, case),
    }
}

/// Runs every case, in order, on groups of each size in `ranks` made by `group` (one group per size, reused
/// across cases like a communicator), and fails listing every wrong or failed case.
pub fn sweep<T, G>(cases: &[Case], ranks: &[usize], group: G)
where
    T: Transport + 'static,
    G: Fn(usize) -> Vec<T>,
{
    let mut failures = Vec::new();
    for &p in ranks {
        let results = run_group(group(p), |_rank, t| {
            let mut scratch = Vec::new();
            let mut out = Vec::new();
            for (seq, case) in cases.iter().enumerate() {
                let r = run_case(Algorithm::Ring, t, &mut scratch, seq as u64, *case);
                let failed = r.is_err();
                out.push(r.map_err(|e| e.to_string()));
                if failed {
                    break; // dropping the transport makes the peers fail fast too
                }
            }
            out
        });
        for (rank, rs) in results.iter().enumerate() {
            for (case, r) in cases.iter().zip(rs) {
                match r {
                    Ok(0) => {}
                    Ok(wrong) => {
                        failures.push(format!("p={p} rank {rank} {case:?}: {wrong} wrong"))
                    }
                    Err(e) => failures.push(format!("p={p} rank {rank} {case:?}: {e}")),
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

pub fn cases(dtypes: &[DType], ops: &[ReduceOp], counts: &[usize]) -> Vec<Case> {
    let mut v = Vec::new();
    for &dtype in dtypes {
        for &op in ops {
            for &count in counts {
                for in_place in [true, false] {
                    v.push(Case {
                        dtype,
                        op,
                        count,
                        in_place,
                    });
                }
            }
        }
    }
    v
}
