//! The tuning file (`CHORUS_TUNE_FILE`, `chorus::tune_file`), ranks as threads over TCP:
//! decisions made by one launch's trials are written by rank 0 and start the next launch of the
//! same kind decided (the same on every rank, results exact); a file whose link differs is not
//! used and its section is replaced; a file that does not parse is not used and left as it is
//! (it may be a newer release's); ranks that disagree about the file fail instead of hanging.
//! No timing is asserted.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::tune_file::TuneFile;
use chorus::{Algorithm, Communicator, ErrorKind, ReduceOp};
use common::*;

const WATCHDOG: Duration = Duration::from_secs(240);
/// Ranks of every launch.
const P: usize = 3;
/// Element counts (f32) in buckets tuned by dedicated trials on their first call.
const COUNTS: [usize; 2] = [7, 1023];

/// The link every launch is given (about what the probe measures for ranks as threads).
const LINK_ALPHA_US: f64 = 20.0;
const LINK_BETA_GBPS: f64 = 0.25;

/// A fresh directory for one test's file (removed by the test).
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("chorus-tune-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The schedules decided for `COUNTS` on one rank.
type Held = Vec<Option<Algorithm>>;

/// One launch of `P` ranks with `file` as the tuning file: per rank, the schedules decided for
/// `COUNTS` before the first call and after a few checked calls of each.
fn launch(file: &Path) -> Vec<(Held, Held)> {
    let file = Arc::new(file.to_path_buf());
    on_threads_cfg(
        P,
        WATCHDOG,
        move |rank, addr| {
            let mut c = config(rank, P, addr);
            c.tune_file = Some(file.as_ref().clone());
            // Configured link figures: a file is used only on a link like its own, and the
            // probe's figures, taken while the other tests' ranks share the two cores, can
            // differ by more than the match allows between two launches.
            c.alpha_us = Some(LINK_ALPHA_US);
            c.beta_gbps = Some(LINK_BETA_GBPS);
            c
        },
        |c: &mut Communicator| {
            c.set_tuning(true);
            let held = |c: &Communicator| COUNTS.map(|n| c.tuned_algorithm(n * 4)).to_vec();
            let before = held(c);
            for &n in &COUNTS {
                for call in 0..3 {
                    let wrong = check_one::<f32>(c, n, ReduceOp::Sum, call % 2 == 0);
                    assert_eq!(wrong, 0, "rank {} count {n} call {call}", c.rank());
                }
            }
            (before, held(c))
        },
    )
}

fn bucket_bytes(count: usize) -> usize {
    (count * 4).next_power_of_two()
}

#[test]
fn decisions_carry_over_to_the_next_launch() {
    let dir = scratch("carry");
    let path = dir.join("tune.txt");

    // First launch: nothing to restore; trials decide and rank 0 writes the file.
    let first = launch(&path);
    let decided = first[0].1.clone();
    for (rank, (before, after)) in first.iter().enumerate() {
        assert!(
            before.iter().all(Option::is_none),
            "rank {rank}: {before:?}"
        );
        assert!(after.iter().all(Option::is_some), "rank {rank}: {after:?}");
        assert_eq!(after, &decided, "rank {rank} disagrees with rank 0");
    }
    let file = TuneFile::read(&path)
        .unwrap()
        .expect("rank 0 wrote the file");
    assert_eq!(file.sections.len(), 1);
    let section = &file.sections[0];
    assert_eq!(
        (section.key.ranks, section.key.hosts, section.key.per_host),
        (P, 1, P)
    );
    assert_eq!(section.key.transport, "tcp");
    for (n, want) in COUNTS.iter().zip(&decided) {
        let b = section
            .buckets
            .iter()
            .find(|b| b.bytes == bucket_bytes(*n))
            .unwrap_or_else(|| panic!("no bucket for {n} elements in {section:?}"));
        assert_eq!(Some(b.chosen), *want);
        assert!(b.times.len() >= 2, "the trials' candidates are kept: {b:?}");
    }

    // Second launch: every rank holds the file's decisions before its first call.
    let second = launch(&path);
    for (rank, (before, after)) in second.iter().enumerate() {
        assert_eq!(
            before, &decided,
            "rank {rank} did not restore the decisions"
        );
        assert_eq!(after, &decided, "rank {rank}");
    }
    assert_eq!(TuneFile::read(&path).unwrap().unwrap().sections.len(), 1);

    // A section made on a link far from this one is not used, and is replaced.
    let mut stale = TuneFile::read(&path).unwrap().unwrap();
    stale.sections[0].link.beta /= 1000.0;
    std::fs::write(&path, stale.format()).unwrap();
    let third = launch(&path);
    for (rank, (before, after)) in third.iter().enumerate() {
        assert!(
            before.iter().all(Option::is_none),
            "rank {rank}: {before:?}"
        );
        assert!(after.iter().all(Option::is_some), "rank {rank}: {after:?}");
    }
    let replaced = TuneFile::read(&path).unwrap().unwrap();
    assert_eq!(replaced.sections.len(), 1);
    assert!(replaced.sections[0].link.beta > stale.sections[0].link.beta * 10.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_that_does_not_parse_is_ignored_and_left_as_it_is() {
    let dir = scratch("garbage");
    let path = dir.join("tune.txt");
    let garbage = b"\x00\xffnot a tuning file\nbucket 7 warp\n";
    std::fs::write(&path, garbage).unwrap();
    let out = launch(&path);
    for (rank, (before, after)) in out.iter().enumerate() {
        assert!(
            before.iter().all(Option::is_none),
            "rank {rank}: {before:?}"
        );
        // The trials still decide every bucket; only the file is not touched.
        assert!(after.iter().all(Option::is_some), "rank {rank}: {after:?}");
    }
    assert_eq!(std::fs::read(&path).unwrap(), garbage);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_that_disagree_about_the_file_fail_instead_of_hanging() {
    let dir = scratch("disagree");
    let path = dir.join("tune.txt");
    let server = store();
    let addr = server.local_addr();
    let start = Instant::now();
    let out: Vec<Result<(), ErrorKind>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..P)
            .map(|rank| {
                let path = path.clone();
                s.spawn(move || {
                    let mut cfg = config(rank, P, addr);
                    cfg.timeout = Duration::from_secs(20);
                    if rank != 1 {
                        cfg.tune_file = Some(path);
                    }
                    let mut c = Communicator::new(cfg).map_err(|e| e.kind())?;
                    c.set_tuning(true);
                    let mut v = vec![rank as f32; 500];
                    c.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| e.kind())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(server);
    for (rank, r) in out.iter().enumerate() {
        let kind = r.expect_err("a rank that disagrees about the tuning file must fail");
        // At init, naming the setting (CHORUS_TUNE_FILE set or not).
        assert_eq!(kind, ErrorKind::Mismatch, "rank {rank}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
