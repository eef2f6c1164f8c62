//! What to send where, and how to combine it: dtypes, reduce kernels, collective schedules and
//! their costs. Schedules run over any [`chorus_transport::Transport`].
//!
//! The `chorus` crate builds on its public items.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod allreduce;
pub mod collectives;
pub mod compress;
pub mod context;
pub mod cost;
pub mod dtype;
mod halfconv;
pub mod op;
pub mod reduce;
pub mod reference;
pub mod sparse;

pub use context::CollCtx;
pub use dtype::{DType, Element};
pub use op::ReduceOp;

use std::fmt;

/// A name that [`std::str::FromStr`] did not recognise (a dtype, a reduction or an algorithm).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseNameError {
    /// What was being parsed ("dtype", "reduction", "allreduce algorithm").
    pub what: &'static str,
    /// The text given.
    pub input: String,
    /// The accepted names, comma separated.
    pub expected: &'static str,
}

impl fmt::Display for ParseNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?} (expected one of: {})",
            self.what, self.input, self.expected
        )
    }
}

impl std::error::Error for ParseNameError {}
