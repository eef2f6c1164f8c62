//! How much of a nonblocking allreduce hides behind computation, measured as OSU's
//! `osu_iallreduce` does: per size, the pure time of a blocking allreduce; then the overall
//! time of issuing it nonblocking (`chorus::Queue`), computing for about that long on the
//! issuing thread, and waiting; overlap = 100 × (1 − (overall − compute) / pure), clamped to
//! 0–100. Every figure is the slowest rank's mean over the timed calls. Rank 0 prints one row
//! per size. A benchmark, not a test.
//!
//! ```sh
//! target/release/chorus-run -n 2 -- target/release/overlap -b 4K -e 16M -f 4 -n 50
//! ```
//!
//! Options: `-b SIZE` smallest bytes per rank (K/M suffixes) [4K], `-e SIZE` largest [16M],
//! `-f N` factor between sizes [4], `-n N` timed calls per size [50], `-w N` warm-up calls
//! [5]. The computation is a busy loop of arithmetic on one core (what a backward pass does to
//! a core while its gradients' allreduces run).

use std::hint::black_box;
use std::time::{Duration, Instant};

use chorus::{Communicator, Queue, ReduceOp};

#[path = "../size_arg.rs"]
mod size_arg;

const USAGE: &str = "usage: overlap [-b SIZE] [-e SIZE] [-f N] [-n N] [-w N]";

struct Args {
    min: usize,
    max: usize,
    factor: usize,
    iters: usize,
    warmup: usize,
}

fn usage(why: &str) -> ! {
    eprintln!("overlap: {why}\n{USAGE}");
    std::process::exit(2)
}

fn size(s: &str) -> usize {
    size_arg::parse(s).unwrap_or_else(|e| usage(&e))
}

fn parse() -> Args {
    let mut a = Args {
        min: 4 << 10,
        max: 16 << 20,
        factor: 4,
        iters: 50,
        warmup: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{arg} needs a value")))
        };
        let count = |v: String| v.parse::<usize>().unwrap_or_else(|_| usage("not a count"));
        match arg.as_str() {
            "-b" => a.min = size(&value()).max(4),
            "-e" => a.max = size(&value()),
            "-f" => a.factor = count(value()).max(2),
            "-n" => a.iters = count(value()).max(1),
            "-w" => a.warmup = count(value()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            other => usage(&format!("unknown option {other:?}")),
        }
    }
    if a.max < a.min {
        usage("-e is below -b");
    }
    a
}

/// Busy arithmetic on this core for `d`; returns how long it took.
fn compute(d: Duration) -> Duration {
    let start = Instant::now();
    let mut x = 1.0f64;
    while start.elapsed() < d {
        for _ in 0..256 {
            x = black_box(x * 1.000_000_1 + 1e-9);
        }
    }
    black_box(x);
    start.elapsed()
}

/// The slowest rank's value of `v`.
fn slowest(q: &Queue, v: f64) -> Result<f64, chorus::CommError> {
    let mut m = [v];
    q.run(|c| c.all_reduce(&mut m, ReduceOp::Max))?;
    Ok(m[0])
}

fn main() -> Result<(), chorus::CommError> {
    let a = parse();
    let q = Queue::new(Communicator::from_env()?);
    if q.rank() == 0 {
        println!(
            "# {} ranks; µs, the slowest rank's mean over {} calls",
            q.size(),
            a.iters
        );
        println!(
            "{:>10} {:>12} {:>12} {:>12} {:>9}",
            "bytes", "pure", "compute", "overall", "overlap%"
        );
    }
    let mut bytes = a.min;
    while bytes <= a.max {
        let mut buf = vec![1f32; bytes / 4];
        // Pure: blocking calls.
        for _ in 0..a.warmup {
            q.run(|c| c.all_reduce(&mut buf, ReduceOp::Sum))?;
        }
        q.run(|c| c.barrier())?;
        let t = Instant::now();
        for _ in 0..a.iters {
            q.run(|c| c.all_reduce(&mut buf, ReduceOp::Sum))?;
        }
        let pure = slowest(&q, t.elapsed().as_secs_f64() / a.iters as f64)?;
        // Overall: issue, compute for about the pure time, wait.
        let work = Duration::from_secs_f64(pure);
        for _ in 0..a.warmup {
            let r = q.all_reduce(std::mem::take(&mut buf), ReduceOp::Sum);
            compute(work);
            buf = r.wait()?;
        }
        q.run(|c| c.barrier())?;
        let mut computed = Duration::ZERO;
        let t = Instant::now();
        for _ in 0..a.iters {
            let r = q.all_reduce(std::mem::take(&mut buf), ReduceOp::Sum);
            computed += compute(work);
            buf = r.wait()?;
        }
        let overall = slowest(&q, t.elapsed().as_secs_f64() / a.iters as f64)?;
        let comp = slowest(&q, computed.as_secs_f64() / a.iters as f64)?;
        let overlap = (100.0 * (1.0 - (overall - comp) / pure)).clamp(0.0, 100.0);
        if q.rank() == 0 {
            println!(
                "{bytes:>10} {:>12.1} {:>12.1} {:>12.1} {overlap:>9.1}",
                pure * 1e6,
                comp * 1e6,
                overall * 1e6
            );
        }
        bytes = match bytes.checked_mul(a.factor) {
            Some(b) => b,
            None => break,
        };
    }
    Ok(())
}
