//! Allreduce: every rank ends with the element-wise reduction of all ranks' buffers.
//!
//! One module per schedule; [`run`] validates the arguments once and dispatches. Every schedule
//! finishes `Avg` itself (divides by the number of ranks, once per element), so callers get the
//! final values.
//!
//! | schedule | messages on the critical path | bytes sent per rank | best for |
//! |---|---|---|---|
//! | [`ring`] | `2(p−1)` | `2(p−1)/p·n` | large `n` |
//! | [`halving_doubling`] | `2·log₂p` | `2(p−1)/p·n` | mid-size `n` |
//! | [`recursive_doubling`] | `log₂p` | `log₂p·n` | tiny `n` |
//! | [`tree`] | `≈ 2·log₂p + n/segment` | `≤ 3n` (inner ranks) | large `p`, mid `n` |
//! | [`double_tree`] | `≈ 2·log₂p + n/(2·segment)` | `≤ 2n` (inner ranks) | large `p`, mid `n` |
//!
//! (`p` rounded down to a power of two for the recursive schedules, plus two messages of `n`
//! bytes when it is not one.)
//!
//! Tags: the low 16 bits of a tag are the step ([`CollCtx::tag`]); the recursive and tree
//! schedules put their own number in bits 12..16 of it ([`step_tag`]), so ranks that picked
//! different schedules for the same call fail with a tag mismatch instead of misreading each
//! other's messages.

pub mod double_tree;
pub mod exchange;
pub mod halving_doubling;
pub mod recursive_doubling;
pub mod ring;
pub mod tree;

use std::fmt;
use std::str::FromStr;

use chorus_transport::{Result, TransportError};

use crate::cost::Link;
use crate::{CollCtx, DType, ParseNameError, ReduceOp};

/// An allreduce schedule.
///
/// ```
/// use chorus_algorithms::allreduce::Algorithm;
/// assert_eq!("ring".parse::<Algorithm>().unwrap(), Algorithm::Ring);
/// assert_eq!(Algorithm::Ring.name(), "ring");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Reduce-scatter then allgather around a ring ([`ring`]): bandwidth-optimal, 2(p−1)
    /// latencies.
    Ring,
    /// Pipelined binary tree ([`tree`]): reduce to rank 0 and broadcast back, in segments.
    Tree,
    /// Recursive halving then doubling, Rabenseifner's ([`halving_doubling`]):
    /// bandwidth-optimal in 2·log₂p latencies.
    HalvingDoubling,
    /// Whole-buffer exchanges in log₂p rounds ([`recursive_doubling`]): tiny messages.
    RecursiveDoubling,
    /// Two pipelined binary trees, one per half of the buffer, inner ranks of one being
    /// leaves of the other ([`double_tree`]).
    DoubleTree,
}

impl Algorithm {
    /// Every schedule (the selector's candidates).
    pub const ALL: [Algorithm; 5] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::HalvingDoubling,
        Algorithm::RecursiveDoubling,
        Algorithm::DoubleTree,
    ];

    /// The name used by `CHORUS_ALGO` and in logs.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::HalvingDoubling => "halving_doubling",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::DoubleTree => "double_tree",
        }
    }

    /// The bytes all ranks together send and reduce in an allreduce of `bytes` bytes over
    /// `ranks` ranks (`p`, and `p'` the largest power of two `≤ p` with `r = p − p'` ranks
    /// folded onto it): where ranks share cores, every byte any rank copies or reduces takes
    /// the same cores, so this total ranks the schedules there, not one link's time.
    /// - ring, tree, double tree: `2(p−1)·n` sent and `(p−1)·n` reduced (every byte crosses
    ///   each ring step once; every tree edge carries `n` up and `n` down), `3(p−1)·n`;
    /// - halving-doubling: `3(p'−1)·n`, plus `3r·n` for the folded ranks (each sends its
    ///   buffer, which its partner reduces, and receives the result);
    /// - recursive doubling: `2·p'·log₂p'·n` (every rank sends and reduces the whole buffer
    ///   every round), plus `3r·n`.
    ///
    /// ```
    /// use chorus_algorithms::allreduce::Algorithm;
    /// let n = 1 << 20;
    /// assert_eq!(Algorithm::Ring.host_work(n, 4), 9.0 * n as f64);
    /// assert_eq!(Algorithm::Tree.host_work(n, 4), Algorithm::Ring.host_work(n, 4));
    /// assert_eq!(Algorithm::HalvingDoubling.host_work(n, 5), 12.0 * n as f64);
    /// assert_eq!(Algorithm::RecursiveDoubling.host_work(n, 4), 16.0 * n as f64);
    /// assert_eq!(Algorithm::Ring.host_work(n, 1), 0.0);
    /// ```
    pub fn host_work(self, bytes: usize, ranks: usize) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let n = bytes as f64;
        let p = ranks as f64;
        let (core, extra) = crate::cost::fold(ranks);
        let folded = 3.0 * extra * n;
        match self {
            Algorithm::Ring | Algorithm::Tree | Algorithm::DoubleTree => 3.0 * (p - 1.0) * n,
            Algorithm::HalvingDoubling => 3.0 * (core - 1.0) * n + folded,
            Algorithm::RecursiveDoubling => 2.0 * core * core.log2() * n + folded,
        }
    }

    /// The modelled time (seconds) of an allreduce of `bytes` bytes over `ranks` ranks.
    pub fn cost(self, bytes: usize, ranks: usize, link: &Link) -> f64 {
        match self {
            Algorithm::Ring => ring::cost(bytes, ranks, link),
            Algorithm::Tree => tree::cost(bytes, ranks, link),
            Algorithm::HalvingDoubling => halving_doubling::cost(bytes, ranks, link),
            Algorithm::RecursiveDoubling => recursive_doubling::cost(bytes, ranks, link),
            Algorithm::DoubleTree => double_tree::cost(bytes, ranks, link),
        }
    }
}

/// The step number, below 2^16, of step `step` (below 2^12) of the schedule numbered `alg`
/// (below 16): `alg` in bits 12..16. Pass it to [`CollCtx::tag`].
pub(crate) const fn step_tag(alg: u64, step: u64) -> u64 {
    (alg << 12) | step
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = ParseNameError;

    /// Accepts the names of [`Algorithm::name`], case-insensitively, with `-` for `_`.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let name = s.trim().to_ascii_lowercase().replace('-', "_");
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| ParseNameError {
                what: "allreduce algorithm",
                input: s.to_string(),
                expected: "ring, tree, halving_doubling, recursive_doubling, double_tree",
            })
    }
}

/// Runs an allreduce of `recv` (in place when `send` is `None`, else from `send` into `recv`)
/// with schedule `alg`. Every rank must call it with the same length, dtype, op and tag base.
///
/// Errors: [`TransportError::InvalidArgument`] (nothing was sent; the transport is still
/// usable) if the length is not a multiple of the dtype size or `send` and `recv` differ in
/// length; otherwise the transport's errors, and [`TransportError::Mismatch`] if a peer's
/// message has another length than this rank expects (ranks disagree on the count or dtype).
/// After those the transport must be aborted. An empty buffer moves nothing (as NCCL's and
/// MPI's count 0): a rank that passes one where the others pass data returns at once, and
/// the others fail as the next call's messages show the disagreement (or at their timeout);
/// `CHORUS_CHECK_CALLS` catches it in the call itself.
pub fn run(
    alg: Algorithm,
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    validate(send, recv, dtype)?;
    match alg {
        Algorithm::Ring => ring::run(ctx, send, recv, dtype, op),
        Algorithm::Tree => tree::run(ctx, send, recv, dtype, op),
        Algorithm::HalvingDoubling => halving_doubling::run(ctx, send, recv, dtype, op),
        Algorithm::RecursiveDoubling => recursive_doubling::run(ctx, send, recv, dtype, op),
        Algorithm::DoubleTree => double_tree::run(ctx, send, recv, dtype, op),
    }
}

fn validate(send: Option<&[u8]>, recv: &[u8], dtype: DType) -> Result<()> {
    if recv.len() % dtype.size() != 0 {
        return Err(TransportError::InvalidArgument(format!(
            "allreduce: buffer of {} bytes is not a whole number of {dtype} elements ({} bytes each)",
            recv.len(),
            dtype.size()
        )));
    }
    if let Some(s) = send {
        if s.len() != recv.len() {
            return Err(TransportError::InvalidArgument(format!(
                "allreduce: send buffer has {} bytes but receive buffer {}",
                s.len(),
                recv.len()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
            assert_eq!(
                a.to_string().to_uppercase().parse::<Algorithm>().unwrap(),
                a
            );
        }
        assert!("double_tree_x".parse::<Algorithm>().is_err());
        assert_eq!(
            "Halving-Doubling".parse::<Algorithm>().unwrap(),
            Algorithm::HalvingDoubling
        );
    }

    #[test]
    fn validation() {
        assert!(validate(None, &[0; 8], DType::Float64).is_ok());
        assert!(validate(None, &[0; 6], DType::Float32).is_err());
        assert!(validate(Some(&[0; 4]), &[0; 8], DType::Float32).is_err());
        assert!(validate(Some(&[0; 8]), &[0; 8], DType::Float32).is_ok());
    }
}
