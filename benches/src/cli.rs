//! Command-line parsing: nccl-tests' options plus the peers harness's `-m`/`-B` and
//! chorus's own (`--algo`, `--inplace`, `--json`, `--format`, `--ranks`).
//!
//! Options take their value as `-b 8`, `-b8`, `--minbytes 8` or `--minbytes=8`, like
//! getopt_long. Data type, op and algorithm names are kept as text here and resolved by
//! `data.rs`, so this module knows nothing of chorus.

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use crate::collective::Collective;
use crate::sizes::{IterPolicy, SizeGrid, Step};

/// The usage text (`-h`).
pub const USAGE: &str = "\
chorus-perf - collective benchmarks for chorus (nccl-tests conventions)

USAGE:
    chorus-perf COLLECTIVE [OPTIONS]
    COLLECTIVE: allreduce, broadcast, reduce, allgather, reduce_scatter, alltoall,
                allgatherv, alltoallv, gather, scatter, sendrecv, reduce_scatterv,
                gatherv, scatterv, scan, exscan, barrier
    Sizes are per rank for allreduce, broadcast, reduce, sendrecv, scan and exscan, and of
    the whole p-rank buffer (rounded down to p blocks) for the others; roots are rank 0;
    the v-variants run with equal blocks (reduce_scatterv's then run as reduce_scatter).
    Broadcast runs in place only; alltoallv, gather(v), scatter(v) and sendrecv out of
    place only. Scan and exscan take -o (not avg); the collectives that do not reduce run
    once whatever -o says. Barrier moves no data: one row of size 0, its time the figure,
    nothing checked (#wrong N/A).

Without --ranks the process is one rank of a job described by the environment (CHORUS_RANK,
CHORUS_WORLD_SIZE, CHORUS_ADDR, ... or what torchrun, mpirun, srun set); rank 0 prints.

OPTIONS:
    -b, --minbytes SIZE      smallest size in bytes (per rank; the whole p-rank buffer for
                             the collectives that split one), K/M/G = 1024 powers [8]
    -e, --maxbytes SIZE      largest size [32M]
    -f, --stepfactor N       multiply the size by N each step [2]
    -i, --stepbytes SIZE     add SIZE each step instead of multiplying
    -n, --iters N            timed iterations per size; the maximum with -B [20]
    -w, --warmup_iters N     warm-up iterations per size; the maximum with -B [5]
    -m, --min_iters N        the minimum of timed iterations, with -B only [1] (not
                             nccl-tests' -m, aggregated calls per iteration)
    -B, --budget SIZE        per size run clamp(BUDGET / size, -m, -n) iterations, and end the
                             size list at -e exactly (peers/src/bench_common.h rules)
    -c, --check 0|1          check every element of one more call's result after timing [1]
                             (not with --compress/--topk, whose error is measured instead)
    -d, --datatype NAME|all  int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 [float]
    -o, --op NAME|all        sum prod min max avg, band bor bxor (integers) [sum]
    -a, --average 0|1|2|3    time reported: 0 rank 0's, 1 mean, 2 min, 3 max over ranks
                             [1; 3 with --format peers, like the peers harness]
        --algo NAME          force an allreduce algorithm (default, or `auto`: the selector
                             decides; other collectives: CHORUS_ALGO=broadcast:ring and the like)
        --algo A,B,...|all   allreduce: compare schedules in one launch (`auto` is the
                             selector; `all` is every schedule and auto): per size, --rounds
                             rounds each time a block of every entry, in shuffled order, out
                             of place; a row per entry with the median over rounds and the
                             spread (slowest / fastest round), then each entry's share of the
                             best forced schedule
        --rounds N           rounds of a comparison; the iterations of a size are split
                             over them [5]
        --inplace 0|1|2      0 out-of-place, 1 in-place, 2 both [2; 0 with --format peers]
        --json               one JSON object per line per size and placement
        --format FMT         table (nccl-tests columns), peers (bench_common.h rows), json
        --ranks N            start N local ranks of this program on 127.0.0.1 and show rank 0
    -T, --timeout SECS       timeout of each collective, 0.001 to one year (default:
                             CHORUS_TIMEOUT or 300)
    -t, --nthreads 1         threads per rank (nccl-tests' option): one only; start more
                             ranks with --ranks or a launcher
        --gap MS             before every timed call sleep MS milliseconds (a training step's
                             compute between its collectives), then a barrier, and time each
                             call on its own; warm-up calls stay back to back [no gap]
        --settle MS          after the barrier before each size's timed calls, every rank
                             idles MS milliseconds first (a rate-capped link's token bucket
                             fills up again; for studying shapers, see
                             benches/results/2026-11-27-tbf-credit.md) [off]
        --compress SPEC      allreduce: compressed float allreduce (a chorus::Compressor spec:
                             fp16 bf16 int8 int4 sign ternary topk:R, options ef=on|off ...);
                             adds wire bytes per rank, compression ratio, relative error against
                             the dense result and the dense allreduce's time
        --topk RATIO         allreduce: the same as --compress topk:RATIO
        --sparse DENSITY     allreduce: sparse_all_reduce of random sparse vectors with this
                             fraction of non-zeros per rank, against the dense allreduce
        --sparse-algo NAME   with --sparse: sparse_rd, dsar or two_phase [cost model]
    -h, --help               this text

EXIT STATUS: 0 ok; 1 wrong results; 2 usage error; 3 a rank failed.
";

/// A command-line mistake; `main` prints it with a pointer to `-h` and exits with 2.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn usage_err<T>(msg: impl Into<String>) -> Result<T, UsageError> {
    Err(UsageError(msg.into()))
}

/// Which time `-a` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Average {
    /// Rank 0's own time.
    Rank0,
    /// The mean over ranks.
    Mean,
    /// The minimum over ranks.
    Min,
    /// The maximum over ranks.
    Max,
}

impl Average {
    /// A short description for the header.
    pub fn describe(self) -> &'static str {
        match self {
            Average::Rank0 => "rank 0",
            Average::Mean => "mean over ranks",
            Average::Min => "min over ranks",
            Average::Max => "max over ranks",
        }
    }
}

/// Which placements to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Separate send and receive buffers.
    pub out_of_place: bool,
    /// One buffer.
    pub in_place: bool,
}

/// What rank 0 prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// nccl-tests' table.
    Table,
    /// One JSON object per line.
    Json,
    /// The rows of peers/src/bench_common.h.
    Peers,
}

/// Everything a run needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The collective.
    pub collective: Collective,
    /// The sizes.
    pub grid: SizeGrid,
    /// Iterations per size.
    pub iters: IterPolicy,
    /// Check one call's result after the timed block.
    pub check: bool,
    /// `-d` as given (a type name or `all`).
    pub datatype: String,
    /// `-o` as given (an op name or `all`).
    pub op: String,
    /// `-a`.
    pub average: Average,
    /// `--algo`.
    pub algo: Option<String>,
    /// `--algo` names a list (or `all`): a side-by-side comparison in one launch.
    pub compare: bool,
    /// `--rounds`: rounds of a comparison.
    pub rounds: u64,
    /// `--inplace`.
    pub placement: Placement,
    /// `--json` / `--format`.
    pub output: Output,
    /// `--ranks`: self-launch this many local ranks.
    pub ranks: Option<usize>,
    /// `-T`.
    pub timeout: Option<Duration>,
    /// `--gap`: idle time before every timed call.
    pub gap: Option<Duration>,
    /// `--settle`: idle time between the barrier and a size's timed calls.
    pub settle: Option<Duration>,
    /// `--compress` / `--topk`: a compressor spec.
    pub compress: Option<String>,
    /// `--sparse`: density of the sparse inputs.
    pub sparse: Option<f64>,
    /// `--sparse-algo`.
    pub sparse_algo: Option<String>,
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Print the usage text.
    Help,
    /// Run a benchmark.
    Run(Box<Options>),
}

/// The options, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Opt {
    MinBytes,
    MaxBytes,
    StepFactor,
    StepBytes,
    Iters,
    Warmup,
    MinIters,
    Budget,
    Check,
    Datatype,
    Op,
    Average,
    Algo,
    Rounds,
    Inplace,
    Json,
    Format,
    Ranks,
    Timeout,
    Threads,
    Gap,
    Settle,
    Compress,
    Topk,
    Sparse,
    SparseAlgo,
    Help,
}

/// (option, short letter, long name, takes a value)
const SPECS: &[(Opt, Option<char>, &str, bool)] = &[
    (Opt::MinBytes, Some('b'), "minbytes", true),
    (Opt::MaxBytes, Some('e'), "maxbytes", true),
    (Opt::StepFactor, Some('f'), "stepfactor", true),
    (Opt::StepBytes, Some('i'), "stepbytes", true),
    (Opt::Iters, Some('n'), "iters", true),
    (Opt::Warmup, Some('w'), "warmup_iters", true),
    (Opt::MinIters, Some('m'), "min_iters", true),
    (Opt::Budget, Some('B'), "budget", true),
    (Opt::Check, Some('c'), "check", true),
    (Opt::Datatype, Some('d'), "datatype", true),
    (Opt::Op, Some('o'), "op", true),
    (Opt::Average, Some('a'), "average", true),
    (Opt::Algo, None, "algo", true),
    (Opt::Rounds, None, "rounds", true),
    (Opt::Inplace, None, "inplace", true),
    (Opt::Json, None, "json", false),
    (Opt::Format, None, "format", true),
    (Opt::Ranks, None, "ranks", true),
    (Opt::Timeout, Some('T'), "timeout", true),
    (Opt::Threads, Some('t'), "nthreads", true),
    (Opt::Gap, None, "gap", true),
    (Opt::Settle, None, "settle", true),
    (Opt::Compress, None, "compress", true),
    (Opt::Topk, None, "topk", true),
    (Opt::Sparse, None, "sparse", true),
    (Opt::SparseAlgo, None, "sparse-algo", true),
    (Opt::Help, Some('h'), "help", false),
];

/// One recognised piece of the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Token {
    /// An option, its value, and the argument indices it spans.
    Opt(Opt, Option<String>, Range<usize>),
    /// A positional argument.
    Positional(String),
}

fn tokenize(args: &[String]) -> Result<Vec<Token>, UsageError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        let start = i;
        i += 1;
        // (spec, value attached to the same argument)
        let (spec, attached) = if let Some(long) = a.strip_prefix("--") {
            let (name, value) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            match SPECS.iter().find(|s| s.2 == name) {
                Some(s) => (s, value),
                None => return usage_err(format!("unknown option --{name}")),
            }
        } else if a.len() > 1 && a.starts_with('-') {
            let mut chars = a[1..].chars();
            let c = chars.next().unwrap_or('-');
            let rest: String = chars.collect();
            match SPECS.iter().find(|s| s.1 == Some(c)) {
                Some(s) => (s, (!rest.is_empty()).then_some(rest)),
                None => return usage_err(format!("unknown option -{c}")),
            }
        } else {
            out.push(Token::Positional(a.clone()));
            continue;
        };
        let (opt, short, long, takes_value) = *spec;
        let shown = short.map_or_else(|| format!("--{long}"), |c| format!("-{c}/--{long}"));
        let value = match (takes_value, attached) {
            (false, None) => None,
            (false, Some(_)) => return usage_err(format!("{shown} takes no value")),
            (true, Some(v)) => Some(v),
            (true, None) => match args.get(i) {
                Some(v) => {
                    i += 1;
                    Some(v.clone())
                }
                None => return usage_err(format!("{shown} needs a value")),
            },
        };
        out.push(Token::Opt(opt, value, start..i));
    }
    Ok(out)
}

/// Parse a byte size: a number with an optional `K`, `M`, `G` or `T` suffix (powers of 1024,
/// any case, optionally followed by `B` or `iB`); fractions are allowed (`1.5K` = 1536).
pub fn parse_size(s: &str) -> Result<u64, UsageError> {
    let bad = || UsageError(format!("bad size '{s}' (examples: 8, 64K, 1.5M, 2G)"));
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix(['B', 'b']).filter(|r| !r.is_empty()))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(bad()),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(bad());
    }
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty() {
        return Err(bad());
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let mut bytes = whole.checked_mul(1u64 << shift).ok_or_else(bad)?;
    if !frac.is_empty() {
        let f: f64 = format!("0.{frac}").parse().map_err(|_| bad())?;
        bytes = bytes
            .checked_add((f * (1u64 << shift) as f64) as u64)
            .ok_or_else(bad)?;
    }
    Ok(bytes)
}

/// The largest `-n`, `-w` and `-m` (their sums stay far from overflowing).
const MAX_ITERS: u64 = 1_000_000_000;
/// The most sizes one run may have (`-i` steps).
const MAX_SIZES: u64 = 100_000;

/// This host's memory (`MemTotal` of `/proc/meminfo`), if it can be read.
fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn parse_int(what: &str, v: &str, min: u64, max: u64) -> Result<u64, UsageError> {
    match v.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ if max == u64::MAX => usage_err(format!("{what}: '{v}' is not an integer >= {min}")),
        _ => usage_err(format!("{what}: '{v}' is not an integer in {min}..={max}")),
    }
}

/// Parse the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, UsageError> {
    let mut collective = None;
    let mut min_bytes = 8;
    let mut max_bytes = 32 << 20;
    let mut factor = None;
    let mut step_bytes = None;
    let mut iters = 20;
    let mut warmup = 5;
    let mut min_iters = None;
    let mut budget = None;
    let mut check = None;
    let mut datatype = "float".to_string();
    let mut op = "sum".to_string();
    let mut average = None;
    let mut algo: Option<String> = None;
    let mut rounds = None;
    let mut inplace = None;
    let mut json = false;
    let mut format = None;
    let mut ranks = None;
    let mut timeout = None;
    let mut gap = None;
    let mut settle = None;
    let mut compress: Option<String> = None;
    let mut sparse = None;
    let mut sparse_algo = None;

    for tok in tokenize(args)? {
        let (opt, value) = match tok {
            Token::Positional(p) => {
                if collective.is_some() {
                    return usage_err(format!("unexpected argument '{p}'"));
                }
                match Collective::from_name(&p) {
                    Some(c) => collective = Some(c),
                    None => return usage_err(format!("unknown collective '{p}'")),
                }
                continue;
            }
            Token::Opt(opt, value, _) => (opt, value.unwrap_or_default()),
        };
        let v = value.as_str();
        match opt {
            Opt::Help => return Ok(Command::Help),
            Opt::MinBytes => min_bytes = parse_size(v)?,
            Opt::MaxBytes => max_bytes = parse_size(v)?,
            Opt::StepFactor => factor = Some(parse_int("-f", v, 2, u64::MAX)?),
            Opt::StepBytes => {
                let b = parse_size(v)?;
                if b == 0 {
                    return usage_err("-i: the step must be at least 1 byte");
                }
                step_bytes = Some(b);
            }
            Opt::Iters => iters = parse_int("-n", v, 1, MAX_ITERS)?,
            Opt::Warmup => warmup = parse_int("-w", v, 0, MAX_ITERS)?,
            Opt::MinIters => min_iters = Some(parse_int("-m", v, 1, MAX_ITERS)?),
            Opt::Threads => {
                if v.trim() != "1" {
                    return usage_err(
                        "-t: chorus-perf runs one thread per rank; start more ranks (--ranks, \
                         or a launcher) instead (the timeout is -T)",
                    );
                }
            }
            Opt::Budget => budget = Some(parse_size(v)?),
            Opt::Check => check = Some(parse_int("-c", v, 0, 1)? == 1),
            Opt::Datatype => datatype = v.to_string(),
            Opt::Op => op = v.to_string(),
            Opt::Average => {
                average = Some(match parse_int("-a", v, 0, 3)? {
                    0 => Average::Rank0,
                    1 => Average::Mean,
                    2 => Average::Min,
                    _ => Average::Max,
                })
            }
            Opt::Algo => algo = Some(v.to_string()),
            Opt::Rounds => rounds = Some(parse_int("--rounds", v, 1, 1000)?),
            Opt::Inplace => inplace = Some(parse_int("--inplace", v, 0, 2)?),
            Opt::Json => json = true,
            Opt::Format => {
                format = Some(match v {
                    "table" | "nccl" => Output::Table,
                    "peers" => Output::Peers,
                    "json" => Output::Json,
                    _ => return usage_err(format!("--format: '{v}' is not table, peers or json")),
                })
            }
            Opt::Ranks => ranks = Some(parse_int("--ranks", v, 1, 4096)? as usize),
            Opt::Timeout => match v
                .trim()
                .parse::<f64>()
                .ok()
                .and_then(chorus::config::timeout_from_secs)
            {
                // The range CHORUS_TIMEOUT accepts: 1 ms to one year.
                Some(t) => timeout = Some(t),
                None => {
                    return usage_err(format!(
                        "-T: '{v}' is not a number of seconds from 0.001 (1 ms) to one year"
                    ))
                }
            },
            Opt::Gap => match v.trim().parse::<f64>() {
                Ok(ms) if ms > 0.0 && ms <= 60_000.0 => {
                    gap = Some(Duration::from_secs_f64(ms / 1e3))
                }
                _ => {
                    return usage_err(format!(
                        "--gap: '{v}' is not a number of milliseconds in (0, 60000]"
                    ))
                }
            },
            Opt::Settle => match v.trim().parse::<f64>() {
                Ok(ms) if ms > 0.0 && ms <= 1000.0 => {
                    settle = Some(Duration::from_secs_f64(ms / 1e3))
                }
                _ => {
                    return usage_err(format!(
                        "--settle: '{v}' is not a number of milliseconds in (0, 1000]"
                    ))
                }
            },
            Opt::Compress => compress = Some(v.to_string()),
            Opt::Topk => match v.trim().parse::<f64>() {
                Ok(r) if r > 0.0 && r <= 1.0 => compress = Some(format!("topk:{r}")),
                _ => return usage_err(format!("--topk: '{v}' is not a ratio in (0, 1]")),
            },
            Opt::Sparse => match v.trim().parse::<f64>() {
                Ok(d) if (0.0..=1.0).contains(&d) => sparse = Some(d),
                _ => return usage_err(format!("--sparse: '{v}' is not a density in [0, 1]")),
            },
            Opt::SparseAlgo => sparse_algo = Some(v.to_string()),
        }
    }

    let Some(collective) = collective else {
        return usage_err("no collective given (e.g. chorus-perf allreduce)");
    };
    if (compress.is_some() || sparse.is_some()) && collective != Collective::AllReduce {
        return usage_err("--compress, --topk and --sparse apply to allreduce only");
    }
    if compress.is_some() && sparse.is_some() {
        return usage_err("--sparse and --compress/--topk exclude each other");
    }
    if sparse_algo.is_some() && sparse.is_none() {
        return usage_err("--sparse-algo needs --sparse");
    }
    let output = match (json, format) {
        (true, Some(Output::Table | Output::Peers)) => {
            return usage_err("--json and --format table/peers exclude each other")
        }
        (true, _) => Output::Json,
        (false, f) => f.unwrap_or(Output::Table),
    };
    let step = match (factor, step_bytes) {
        (Some(_), Some(_)) => return usage_err("give -f or -i, not both"),
        (None, Some(b)) => Step::Bytes(b),
        (f, None) => Step::Factor(f.unwrap_or(2)),
    };
    if min_bytes > max_bytes {
        return usage_err(format!(
            "-b {min_bytes} is larger than -e {max_bytes}: no size to run"
        ));
    }
    if let Step::Bytes(b) = step {
        if (max_bytes - min_bytes) / b >= MAX_SIZES {
            return usage_err(format!(
                "-b {min_bytes} -e {max_bytes} -i {b} makes more than {MAX_SIZES} sizes"
            ));
        }
    }
    if let Some(total) = host_memory_bytes() {
        // A send and a receive buffer of -e per rank, times the ranks started here; the
        // compressed and sparse modes hold about six (the input, the dense reference, the
        // result, the timed copy, the error-feedback residual, the codec's work space).
        let local = ranks.unwrap_or(1) as u64;
        let (copies, what) = if compress.is_some() || sparse.is_some() {
            (6, "six buffers (--compress, --topk, --sparse)")
        } else {
            (2, "a send and a receive buffer")
        };
        if max_bytes.saturating_mul(copies).saturating_mul(local) > total {
            return usage_err(format!(
                "-e {max_bytes}: {what} of that size for each of {local} rank(s) here do not \
                 fit in this host's {total} bytes of memory"
            ));
        }
    }
    let peers = output == Output::Peers;
    let compare = algo
        .as_deref()
        .is_some_and(|a| a.contains(',') || a.trim().eq_ignore_ascii_case("all"));
    if compare {
        if collective != Collective::AllReduce {
            return usage_err("--algo with a list compares allreduce schedules only");
        }
        if compress.is_some() || sparse.is_some() {
            return usage_err("--algo with a list excludes --compress, --topk and --sparse");
        }
        if peers {
            return usage_err("--format peers takes one algorithm per launch, not a list");
        }
        if matches!(inplace, Some(1 | 2)) {
            return usage_err("--algo with a list runs out of place only (--inplace 0)");
        }
    } else if rounds.is_some() {
        return usage_err("--rounds needs --algo with a list of schedules");
    }
    if settle.is_some() && gap.is_some() {
        return usage_err("--settle and --gap: --gap already idles before every timed call");
    }
    if compress.is_some() || sparse.is_some() {
        // These modes run float32 sum against a dense baseline of the selector's schedule and
        // report the slowest rank: options that would change that are refused, not ignored.
        let ignored = [
            (algo.is_some(), "--algo"),
            (!datatype.eq_ignore_ascii_case("float"), "-d"),
            (!op.eq_ignore_ascii_case("sum"), "-o"),
            (average.is_some(), "-a"),
            (inplace.is_some(), "--inplace"),
            (matches!(format, Some(Output::Peers)), "--format peers"),
            (settle.is_some(), "--settle"),
        ];
        if let Some((_, name)) = ignored.iter().find(|(set, _)| *set) {
            return usage_err(format!(
                "{name} does not apply with --compress, --topk or --sparse (float32 sum, \
                 the slowest rank's time)"
            ));
        }
        if compress.is_some() && check.is_some() {
            return usage_err(
                "-c does not apply with --compress or --topk: a lossy result is not checked \
                 but measured (its relative error against the dense sum)",
            );
        }
    }
    // 1 is the default either way (peer harnesses pass `-m 1` to every benchmark alike).
    if min_iters.is_some_and(|m| m > 1) && budget.is_none() {
        return usage_err(
            "-m sets the minimum of timed iterations under -B, and there is no -B (nccl-tests' \
             -m, aggregated calls per iteration, is not supported)",
        );
    }
    let min_iters = min_iters.unwrap_or(1);
    let placement = match (inplace, peers || compare) {
        (Some(1 | 2), true) => {
            return usage_err("--format peers prints out-of-place rows only (--inplace 0)")
        }
        (Some(0), _) | (None, true) => (true, false),
        (Some(1), _) => (false, true),
        _ => (true, true),
    };
    Ok(Command::Run(Box::new(Options {
        collective,
        grid: SizeGrid {
            min_bytes,
            max_bytes,
            step,
            include_max: budget.is_some() || peers,
        },
        iters: IterPolicy {
            iters,
            warmup,
            min_iters,
            budget,
        },
        // A barrier moves no data: nothing to check (its #wrong is N/A, not a 0 that says
        // something was).
        check: check.unwrap_or(true) && collective != Collective::Barrier,
        datatype,
        op,
        average: average.unwrap_or(if peers { Average::Max } else { Average::Mean }),
        algo,
        compare,
        rounds: rounds.unwrap_or(5),
        placement: Placement {
            out_of_place: placement.0,
            in_place: placement.1,
        },
        output,
        ranks,
        timeout,
        gap,
        settle,
        compress,
        sparse,
        sparse_algo,
    })))
}

/// The arguments with every `--ranks N` / `--ranks=N` removed: what the self-launched ranks get.
pub fn without_ranks(args: &[String]) -> Result<Vec<String>, UsageError> {
    let mut drop = vec![false; args.len()];
    for tok in tokenize(args)? {
        if let Token::Opt(Opt::Ranks, _, span) = tok {
            for i in span {
                drop[i] = true;
            }
        }
    }
    Ok(args
        .iter()
        .zip(drop)
        .filter(|(_, d)| !d)
        .map(|(a, _)| a.clone())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn run(s: &str) -> Options {
        match parse(&args(s)) {
            Ok(Command::Run(o)) => *o,
            other => panic!("{s}: {other:?}"),
        }
    }

    fn err(s: &str) -> String {
        match parse(&args(s)) {
            Err(UsageError(m)) => m,
            other => panic!("{s}: expected an error, got {other:?}"),
        }
    }

    #[test]
    fn sizes_with_suffixes() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("32M").unwrap(), 32 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("1.5K").unwrap(), 1536);
        assert_eq!(parse_size("256MB").unwrap(), 256 << 20);
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("8B").unwrap(), 8);
        for bad in [
            "",
            "K",
            "-8",
            "8X",
            "1e3",
            "1..5",
            ".",
            "8 M",
            "99999999999999999999G",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(parse_size("20000000000G").is_err());
    }

    #[test]
    fn defaults_are_nccl_tests() {
        let o = run("allreduce");
        assert_eq!(o.collective, Collective::AllReduce);
        assert_eq!(
            o.grid,
            SizeGrid {
                min_bytes: 8,
                max_bytes: 32 << 20,
                step: Step::Factor(2),
                include_max: false
            }
        );
        assert_eq!(
            o.iters,
            IterPolicy {
                iters: 20,
                warmup: 5,
                min_iters: 1,
                budget: None
            }
        );
        assert!(o.check);
        assert_eq!((o.datatype.as_str(), o.op.as_str()), ("float", "sum"));
        assert_eq!(o.average, Average::Mean);
        assert_eq!(
            o.placement,
            Placement {
                out_of_place: true,
                in_place: true
            }
        );
        assert_eq!(o.output, Output::Table);
        assert_eq!((o.ranks, o.timeout, o.algo), (None, None, None));
    }

    #[test]
    fn peers_harness_arguments() {
        // exactly what run_all.sh passes (full mode), after the wrapper's own arguments
        let o = run("allreduce --format peers -b 8 -e 256M -f 4 -w 5 -n 200 -m 3 -B 2G");
        assert_eq!(
            o.grid,
            SizeGrid {
                min_bytes: 8,
                max_bytes: 256 << 20,
                step: Step::Factor(4),
                include_max: true
            }
        );
        assert_eq!(
            o.iters,
            IterPolicy {
                iters: 200,
                warmup: 5,
                min_iters: 3,
                budget: Some(2 << 30)
            }
        );
        assert_eq!(o.output, Output::Peers);
        assert_eq!(o.average, Average::Max);
        assert!(o.placement.out_of_place && !o.placement.in_place);
        // -B alone switches to the bench_common size rule
        assert!(run("allreduce -B 1G").grid.include_max);
        // an explicit -a wins over the peers default
        assert_eq!(run("allreduce --format peers -a 1").average, Average::Mean);
    }

    #[test]
    fn value_spellings() {
        let o = run("allreduce -b1K --maxbytes=1M --stepbytes 4K -n5 -w0 -c 0 -d all -o max");
        assert_eq!(o.grid.min_bytes, 1024);
        assert_eq!(o.grid.max_bytes, 1 << 20);
        assert_eq!(o.grid.step, Step::Bytes(4096));
        assert_eq!((o.iters.iters, o.iters.warmup), (5, 0));
        assert!(!o.check);
        assert_eq!((o.datatype.as_str(), o.op.as_str()), ("all", "max"));
        let o = run("--json --algo ring --inplace 1 -a 0 -T 2.5 -t 1 allreduce --ranks=4");
        assert_eq!(o.output, Output::Json);
        assert_eq!(o.algo.as_deref(), Some("ring"));
        assert!(!o.placement.out_of_place && o.placement.in_place);
        assert_eq!(o.average, Average::Rank0);
        assert_eq!(o.timeout, Some(Duration::from_millis(2500)));
        assert_eq!(o.ranks, Some(4));
        assert_eq!(o.gap, None);
        assert_eq!(
            run("allreduce --gap 30").gap,
            Some(Duration::from_millis(30))
        );
        assert_eq!(
            run("allreduce --gap=0.5").gap,
            Some(Duration::from_micros(500))
        );
        for bad in ["0", "-1", "nan", "60001", "x"] {
            assert!(
                err(&format!("allreduce --gap {bad}")).contains("--gap"),
                "{bad}"
            );
        }
        assert_eq!(o.settle, None);
        assert_eq!(
            run("allreduce --settle 0.3").settle,
            Some(Duration::from_micros(300))
        );
        for bad in ["0", "1001", "x", "0.3 --gap 1", "0.3 --compress int8"] {
            assert!(
                err(&format!("allreduce --settle {bad}")).contains("--settle"),
                "{bad}"
            );
        }
        assert_eq!(run("allreduce --format json").output, Output::Json);
        assert_eq!(parse(&args("allreduce -h")), Ok(Command::Help));
        assert_eq!(parse(&args("--help")), Ok(Command::Help));
        assert_eq!(run("reduce_scatter").collective, Collective::ReduceScatter);
    }

    /// A list after --algo (or `all`) is a comparison: out of place, 5 rounds unless told.
    #[test]
    fn algorithm_lists_compare() {
        let o = run("allreduce --algo ring,auto");
        assert!(o.compare);
        assert_eq!(o.rounds, 5);
        assert!(o.placement.out_of_place && !o.placement.in_place);
        let o = run("allreduce --algo all --rounds 3 --json");
        assert!(o.compare);
        assert_eq!(o.rounds, 3);
        let o = run("allreduce --algo ring");
        assert!(!o.compare);
        assert!(o.placement.in_place);
        assert!(err("broadcast --algo ring,tree").contains("allreduce schedules only"));
        assert!(err("allreduce --algo ring,tree --format peers").contains("one algorithm"));
        assert!(err("allreduce --algo ring,tree --inplace 2").contains("out of place only"));
        assert!(err("allreduce --algo ring,tree --topk 0.1").contains("excludes"));
        assert!(err("allreduce --algo ring --rounds 3").contains("needs --algo"));
        assert!(err("allreduce --algo all --rounds 0").contains("--rounds"));
    }

    #[test]
    fn errors() {
        assert!(err("").contains("no collective"));
        assert!(err("allgatherx").contains("unknown collective"));
        assert!(err("allreduce broadcast").contains("unexpected"));
        assert!(err("allreduce -x 1").contains("unknown option -x"));
        assert!(err("allreduce --bogus").contains("unknown option --bogus"));
        assert!(err("allreduce -b").contains("needs a value"));
        assert!(err("allreduce --json=1").contains("takes no value"));
        assert!(err("allreduce -f 1").contains("-f"));
        assert!(err("allreduce -f 2 -i 8").contains("not both"));
        assert!(err("allreduce -i 0").contains("-i"));
        assert!(err("allreduce -n 0").contains("-n"));
        assert!(err("allreduce -n 18446744073709551615").contains("-n"));
        assert!(err("allreduce -w 2000000000").contains("-w"));
        assert!(err("allreduce -b 0 -e 1T -i 1").contains("sizes"));
        assert!(err("allreduce -e 16777215T").contains("memory"));
        assert!(err("allreduce -c 2").contains("-c"));
        assert!(err("allreduce -a 4").contains("-a"));
        assert!(err("allreduce -b 1M -e 1K").contains("larger"));
        assert!(err("allreduce --inplace 3").contains("--inplace"));
        assert!(err("allreduce --format peers --inplace 2").contains("out-of-place"));
        assert!(err("allreduce --format csv").contains("--format"));
        assert!(err("allreduce --json --format peers").contains("exclude"));
        assert!(err("allreduce --ranks 0").contains("--ranks"));
        assert!(err("allreduce -T 0").contains("-T"));
        assert!(err("allreduce -T soon").contains("-T"));
        assert!(err("allreduce -T 0.000001").contains("-T"));
        assert!(err("allreduce -T 1e9").contains("-T"));
        // nccl-tests' -t (threads) and -m (aggregated calls) are not taken for a timeout or
        // a minimum that would do nothing.
        assert!(err("allreduce -t 2").contains("one thread per rank"));
        assert!(err("allreduce -m 4").contains("no -B"));
        assert!(err("allreduce -e 12Q").contains("bad size"));
    }

    #[test]
    fn ranks_are_removed_for_the_children() {
        let a = args("allreduce --ranks 4 -b 8 --ranks=2 -e 1M --algo ring");
        assert_eq!(
            without_ranks(&a).unwrap(),
            args("allreduce -b 8 -e 1M --algo ring")
        );
        // a value that looks like --ranks belongs to its option
        let a = args("allreduce --algo --ranks -n 3");
        assert_eq!(without_ranks(&a).unwrap(), a);
    }
}
