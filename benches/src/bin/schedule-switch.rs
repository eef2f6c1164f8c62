//! Per-call times of allreduce loops with a forced schedule per phase: what the first calls
//! of a schedule cost after another one ran (the connections it did not use sat idle), and
//! what calls cost after idle time (a training step's compute). Rank 0 prints one line per
//! phase: the mean time in µs of each window of calls.
//!
//! ```sh
//! tests/netns/cluster.sh up 4 1gbit
//! target/release/chorus-run --netns-prefix chorus-h -n 4 -- \
//!     target/release/schedule-switch --bytes 128K --calls 100 --window 1 --first 6 \
//!     halving_doubling ring halving_doubling
//! ```
//!
//! Options: `--bytes SIZE` per rank (K/M suffixes) [32K], `--calls N` per phase [100],
//! `--window N` calls per printed mean [10], `--first N` only print the first N calls of a
//! phase [all], `--gap MS` sleep and barrier before every call [none], `--tail SIZE` an
//! untimed allreduce of this size (the selector's choice) after every timed call [none].
//! Phases name schedules (`ring`, `tree`, `halving_doubling`, `recursive_doubling`, …); set
//! `CHORUS_TUNE=0` so the tail's choice does not tune.

use std::time::{Duration, Instant};

use chorus::{Algorithm, AllReduceOptions, Communicator, ReduceOp};

#[path = "../size_arg.rs"]
mod size_arg;

const USAGE: &str = "usage: schedule-switch [--bytes SIZE] [--calls N] [--window N] [--first N] \
                     [--gap MS] [--tail SIZE] SCHEDULE...";

struct Args {
    bytes: usize,
    calls: usize,
    window: usize,
    first: usize,
    gap: Option<Duration>,
    tail: usize,
    phases: Vec<Algorithm>,
}

fn usage(why: &str) -> ! {
    eprintln!("schedule-switch: {why}\n{USAGE}");
    std::process::exit(2)
}

fn size(s: &str) -> usize {
    size_arg::parse(s).unwrap_or_else(|e| usage(&e))
}

fn parse() -> Args {
    let mut a = Args {
        bytes: 32 << 10,
        calls: 100,
        window: 10,
        first: usize::MAX,
        gap: None,
        tail: 0,
        phases: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{arg} needs a value")))
        };
        let count = |v: String| v.parse::<usize>().unwrap_or_else(|_| usage("not a count"));
        match arg.as_str() {
            "--bytes" => a.bytes = size(&value()),
            "--calls" => a.calls = count(value()).max(1),
            "--window" => a.window = count(value()).max(1),
            "--first" => a.first = count(value()),
            "--gap" => match value().parse::<f64>() {
                Ok(ms) if ms > 0.0 && ms <= 60_000.0 => {
                    a.gap = Some(Duration::from_secs_f64(ms / 1e3))
                }
                _ => usage("--gap takes milliseconds in (0, 60000]"),
            },
            "--tail" => a.tail = size(&value()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            name => match name.parse::<Algorithm>() {
                Ok(algo) => a.phases.push(algo),
                Err(e) => usage(&format!("{name:?}: {e}")),
            },
        }
    }
    if a.phases.is_empty() {
        usage("name at least one schedule");
    }
    a
}

fn main() -> Result<(), chorus::CommError> {
    let a = parse();
    let mut comm = Communicator::from_env()?;
    let mut buf = vec![0f32; a.bytes / 4];
    let mut tail = vec![0f32; a.tail / 4];
    let mut times = Vec::with_capacity(a.calls);
    for algo in &a.phases {
        let opts = AllReduceOptions {
            algorithm: Some(*algo),
            timeout: None,
        };
        times.clear();
        for _ in 0..a.calls {
            if let Some(gap) = a.gap {
                std::thread::sleep(gap);
                comm.barrier()?;
            }
            let t = Instant::now();
            comm.all_reduce_with(None, &mut buf, ReduceOp::Sum, &opts)?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
            if !tail.is_empty() {
                comm.all_reduce(&mut tail, ReduceOp::Sum)?;
            }
        }
        if comm.rank() == 0 {
            let shown = &times[..a.first.min(times.len())];
            let means: Vec<String> = shown
                .chunks(a.window)
                .map(|w| format!("{:.0}", w.iter().sum::<f64>() / w.len() as f64))
                .collect();
            println!("{:<18} {}", algo.name(), means.join(" "));
        }
    }
    Ok(())
}
