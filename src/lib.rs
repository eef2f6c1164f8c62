//! # chorus — collective communication for CPUs and ordinary networks
//!
//! A [`Communicator`] connects `size` ranks (processes, possibly on several hosts) and runs
//! collectives over them. Build one from the environment your launcher sets
//! ([`Communicator::from_env`]; `chorus-run`, torchrun and srun are understood, mpirun with
//! `CHORUS_ADDR` exported, as it names no rendezvous address) or from
//! an explicit [`Config`], or through a [`UniqueId`] one process made and handed to the others
//! (as NCCL's `ncclCommInitRank`). [`Communicator::split`] and [`Communicator::dup`] make
//! communicators of their own connections for groups of its ranks.
//!
//! ```no_run
//! use chorus::{Communicator, ReduceOp};
//!
//! let mut comm = Communicator::from_env()?;
//! let mut grad = vec![comm.rank() as f32; 1024];
//! comm.all_reduce(&mut grad, ReduceOp::Sum)?;
//! # Ok::<(), chorus::CommError>(())
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod algo_spec;
mod collectives;
pub mod comm;
pub mod compress;
pub mod config;
pub mod error;
pub mod log;
pub mod queue;
pub mod select;
mod split;
pub mod tune_file;
pub mod unique_id;

pub use chorus_algorithms::allreduce::Algorithm;
pub use chorus_algorithms::collectives::layout::Layout;
pub use chorus_algorithms::{DType, Element, ReduceOp};
pub use collectives::{reduction_refusal, P2p, P2pShape};
pub use comm::{AbortHandle, AllReduceOptions, Communicator};
pub use compress::{CompressionReport, Compressor, CompressorSpec};

/// Sparse vectors and the sparse allreduce algorithms (see
/// [`Communicator::sparse_all_reduce`]).
pub mod sparse {
    pub use chorus_algorithms::sparse::{SparseAlgo, SparseResult, SparseVec, WireStats};
}
pub use config::Config;
pub use error::{CommError, ErrorKind};
pub use queue::{Queue, RecvBuffer, Request, RequestWaiter, SendBuffer};
pub use unique_id::{UniqueId, UNIQUE_ID_BYTES};

/// The library version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The README's code blocks compile as doc tests, so the quick start cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
