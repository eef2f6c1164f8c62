//! `chorus-perf`: collective benchmarks for chorus with nccl-tests' options, columns and
//! conventions (DESIGN.md §1), plus the row format of the peers harness.
//!
//! ```text
//! chorus-perf allreduce --ranks 2 -b 8 -e 256M -f 4          # 2 local ranks, nccl-tests table
//! torchrun --no-python --nproc_per_node 4 chorus-perf allreduce --json   # any launcher
//! chorus-perf allreduce --format peers -b 8 -e 32M -f 4 -w 2 -n 50 -m 3 -B 256M  # peers rows
//! ```
//!
//! Without `--ranks` the process is one rank of a job the environment describes
//! (`chorus::Communicator::from_env`); rank 0 prints. See `chorus-perf -h`.
#![forbid(unsafe_code)]

mod calls;
mod cli;
mod collective;
mod compressed;
mod data;
mod launch;
mod progress;
mod report;
mod runner;
mod sizes;

use std::io::IsTerminal;
use std::process::ExitCode;

use chorus::{AllReduceOptions, Communicator, Config};

use crate::cli::{Command, Options, Output, UsageError};

/// Exit status: some element was wrong.
const EXIT_WRONG: u8 = 1;
/// Exit status: bad command line.
const EXIT_USAGE: u8 = 2;
/// Exit status: the communicator or a collective failed.
const EXIT_FAILED: u8 = 3;

fn usage_error(e: &UsageError) -> ExitCode {
    eprintln!("chorus-perf: {e}\n(chorus-perf -h shows the options)");
    ExitCode::from(EXIT_USAGE)
}

fn main() -> ExitCode {
    let args: Vec<String> = match std::env::args_os()
        .skip(1)
        .map(|a| a.into_string())
        .collect::<Result<_, _>>()
    {
        Ok(a) => a,
        Err(bad) => return usage_error(&UsageError(format!("argument {bad:?} is not UTF-8"))),
    };
    let opts = match cli::parse(&args) {
        Ok(Command::Help) => {
            print!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(o)) => *o,
        Err(e) => return usage_error(&e),
    };
    // Resolve the names before starting anything, so a typo is reported once.
    let resolved = (|| {
        Ok::<_, UsageError>((
            data::resolve_dtypes(&opts.datatype)?,
            data::resolve_ops(&opts.op)?,
            if opts.compare {
                data::resolve_algo_list(opts.algo.as_deref().unwrap_or("all"))?
            } else {
                vec![data::resolve_algo(opts.algo.as_deref())?]
            },
        ))
    })();
    let (mut dtypes, mut ops, algorithms) = match resolved {
        Ok(r) => r,
        Err(e) => return usage_error(&e),
    };
    if dtypes
        .iter()
        .all(|d| opts.grid.points(d.size() as u64).is_empty())
    {
        return usage_error(&UsageError(format!(
            "no size from -b to -e holds a whole element of -d {}",
            opts.datatype
        )));
    }
    if opts.collective.reduces() && ops.iter().any(|o| o.is_bitwise()) {
        // Bitwise ops exist for integers only: `-d all` keeps those, a float type is refused
        // here rather than by every rank at its first call.
        dtypes.retain(|d| !d.is_float());
        if dtypes.is_empty() {
            return usage_error(&UsageError(format!(
                "-o {}: bitwise ops need an integer -d (int8, uint8, int32, uint32, int64, \
                 uint64)",
                opts.op
            )));
        }
    }
    if !opts.collective.reduces() {
        // No op applies: the sweep runs once (as nccl-tests' "none"), fed as for a max (201
        // distinct values at any rank count: a block moved to the wrong place shows).
        ops = vec![chorus::ReduceOp::Max];
    }
    if opts.collective == collective::Collective::Barrier {
        // No data either: one type.
        dtypes.truncate(1);
    }
    if matches!(
        opts.collective,
        collective::Collective::Scan | collective::Collective::ExScan
    ) {
        // A prefix average means nothing: `-o all` leaves it out, `-o avg` is refused.
        ops.retain(|&o| o != chorus::ReduceOp::Avg);
        if ops.is_empty() {
            return usage_error(&UsageError(format!(
                "-o avg: {} has no average (use sum)",
                opts.collective
            )));
        }
    }
    if !opts.compare
        && algorithms[0].is_some()
        && opts.collective != collective::Collective::AllReduce
    {
        return usage_error(&UsageError(format!(
            "--algo names an allreduce algorithm; for {} set CHORUS_ALGO={}:<schedule>",
            opts.collective, opts.collective
        )));
    }

    if let Some(spec) = &opts.compress {
        if let Err(m) = chorus::CompressorSpec::parse(spec) {
            return usage_error(&UsageError(format!("--compress {spec:?}: {m}")));
        }
    }
    if let Some(name) = &opts.sparse_algo {
        if name.parse::<chorus::sparse::SparseAlgo>().is_err() {
            return usage_error(&UsageError(format!(
                "--sparse-algo {name:?}: expected sparse_rd, dsar or two_phase"
            )));
        }
    }
    if let Some(ranks) = opts.ranks {
        if let Some(e) = no_whole_blocks(&opts, &dtypes, ranks) {
            return usage_error(&e);
        }
        let child_args = match cli::without_ranks(&args) {
            Ok(a) => a,
            Err(e) => return usage_error(&e),
        };
        let progress = std::io::stderr().is_terminal() && opts.output != Output::Json;
        let code = launch::launch(ranks, &child_args, progress);
        return ExitCode::from(u8::try_from(code).unwrap_or(EXIT_FAILED));
    }

    run_rank(&opts, dtypes, ops, &algorithms)
}

/// The refusal of a sweep of a collective that splits its buffer into `ranks` blocks whose
/// every size rounds down to no block at all (`allgather --ranks 8 -b 4 -e 16`): it would
/// measure only an empty row. A sweep that asks for size 0 alone is measured as asked.
fn no_whole_blocks(opts: &Options, dtypes: &[chorus::DType], ranks: usize) -> Option<UsageError> {
    let c = opts.collective;
    let empty = |d: &chorus::DType| {
        let points = opts.grid.points(d.size() as u64);
        points.iter().any(|p| p.count > 0)
            && points
                .iter()
                .all(|p| calls::round_count(c, p.count, ranks) == 0)
    };
    (calls::blocked(c) && dtypes.iter().all(empty)).then(|| {
        UsageError(format!(
            "{c} splits its buffer into {ranks} blocks, and no size from -b to -e holds {ranks} \
             whole elements of -d {} (raise -e)",
            opts.datatype
        ))
    })
}

/// Be one rank of the job the environment describes.
fn run_rank(
    opts: &Options,
    dtypes: Vec<chorus::DType>,
    ops: Vec<chorus::ReduceOp>,
    algorithms: &[Option<chorus::Algorithm>],
) -> ExitCode {
    let mut config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "chorus-perf: {e}\n(start it with --ranks N, chorus-run, mpirun, srun or \
                 torchrun, or set CHORUS_RANK, CHORUS_WORLD_SIZE and CHORUS_ADDR)"
            );
            return ExitCode::from(EXIT_FAILED);
        }
    };
    if let Some(t) = opts.timeout {
        config.timeout = t;
    }
    if let Some(e) = no_whole_blocks(opts, &dtypes, config.size) {
        return usage_error(&e);
    }
    // What the header, rows and JSON call each entry.
    let variants: Vec<runner::Variant> = algorithms
        .iter()
        .map(|&algorithm| runner::Variant {
            label: match (algorithm, &config.algo) {
                (Some(a), _) => a.name().to_string(),
                (None, Some(env)) if !opts.compare => format!("auto (CHORUS_ALGO={env})"),
                (None, _) => "auto".to_string(),
            },
            call: AllReduceOptions {
                algorithm,
                timeout: None,
            },
        })
        .collect();
    let rank = config.rank;
    let mut comm = match Communicator::new(config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("chorus-perf: rank {rank}: cannot build the communicator: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    if opts.compress.is_some() || opts.sparse.is_some() {
        return match compressed::run(&mut comm, opts) {
            Ok(0) => ExitCode::SUCCESS,
            Ok(_) => ExitCode::from(EXIT_WRONG),
            Err(e) => {
                eprintln!("chorus-perf: rank {rank}: {e}");
                comm.abort(&format!("chorus-perf on rank {rank} failed: {e}"));
                ExitCode::from(EXIT_FAILED)
            }
        };
    }
    let result = runner::Runner::new(&mut comm, opts, dtypes, ops, variants).run();
    match result {
        Ok(outcome) if outcome.wrong.unwrap_or(0) > 0 || outcome.wrong_here > 0 => {
            ExitCode::from(EXIT_WRONG)
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chorus-perf: rank {rank}: {e}");
            comm.abort(&format!("chorus-perf on rank {rank} failed: {e}"));
            ExitCode::from(EXIT_FAILED)
        }
    }
}
