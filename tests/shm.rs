//! Ranks on one host over shared memory: the allreduce matrix (direct shared-memory allreduce,
//! and ring over the shm transport) with ranks as threads and as processes, a rank killed in
//! the middle (named by every survivor, nothing left in /dev/shm), ranks that disagree on
//! CHORUS_TRANSPORT, and `CHORUS_TRANSPORT=rdma` on a host where RDMA cannot run (here: no
//! device, and no NIC over real verbs in this release): every rank warns why, falls back to
//! TCP and shared memory, and computes correctly.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use chorus::Communicator;
use common::*;

fn shm_config(rank: usize, size: usize, addr: std::net::SocketAddr) -> chorus::Config {
    let mut c = config(rank, size, addr);
    c.transport = Some("shm".into());
    c
}

/// Like `on_threads`, with CHORUS_TRANSPORT=shm and an optional forced algorithm.
fn on_shm_threads<R: Send + 'static>(
    size: usize,
    algo: Option<&'static str>,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let server = store();
    let addr = server.local_addr();
    let hs: Vec<_> = (0..size)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut cfg = shm_config(rank, size, addr);
                cfg.algo = algo.map(str::to_string);
                let mut c = Communicator::new(cfg).expect("communicator");
                if size > 1 {
                    assert_eq!(c.transport_name(), "shm");
                }
                f(&mut c)
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut out = Vec::new();
    for (rank, h) in hs.into_iter().enumerate() {
        while !h.is_finished() {
            assert!(
                Instant::now() < deadline,
                "watchdog: rank {rank} of {size} hangs"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        out.push(
            h.join()
                .unwrap_or_else(|_| panic!("rank {rank} of {size} panicked")),
        );
    }
    out
}

fn assert_clean(p: usize, bad: Vec<Vec<String>>) {
    let bad: Vec<String> = bad.into_iter().flatten().collect();
    assert!(
        bad.is_empty(),
        "p={p}: {} failures, first: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// Small counts (the one-phase path) on every group size; the large count (many two-phase
/// rounds) on a few. `tests/allreduce.rs` runs the whole matrix over the default transport,
/// which is shared memory on one host.
const SMALL_COUNTS: [usize; 4] = [0, 1, 7, 1023];

#[test]
fn direct_allreduce_threads_full_matrix() {
    for p in RANKS {
        let counts: &'static [usize] = if p <= 3 { &COUNTS } else { &SMALL_COUNTS };
        assert_clean(p, on_shm_threads(p, None, move |c| sweep(c, counts)));
    }
}

#[test]
fn ring_over_shm_threads() {
    for p in [2usize, 3] {
        assert_clean(
            p,
            on_shm_threads(p, Some("ring"), |c| sweep(c, &[0, 1, 7, 70_001])),
        );
    }
}

#[test]
fn direct_allreduce_processes() {
    if is_child() {
        let mut c = child_comm();
        assert_eq!(c.transport_name(), "shm");
        let bad = sweep(&mut c, &[0, 1, 7, 1023, 300_001]);
        for b in &bad {
            println!("FAIL {b}");
        }
        assert!(bad.is_empty());
        println!("CHILD-OK rank {}", c.rank());
        return;
    }
    for p in [2usize, 4] {
        let job = spawn_job(
            p,
            "direct_allreduce_processes",
            &[("CHORUS_TRANSPORT", "shm".to_string())],
        );
        for (rank, (code, out)) in wait_job(job, Duration::from_secs(240)).iter().enumerate() {
            assert_eq!(*code, Some(0), "p={p} rank {rank} failed:\n{out}");
            assert!(out.contains("CHILD-OK"), "p={p} rank {rank}:\n{out}");
        }
    }
}

/// Child side of the process tests that need a working communicator: an exact sweep, then
/// `CHILD-OK rank R over TRANSPORT` for the parent to read.
fn sweep_child() {
    let mut c = child_comm();
    let bad = sweep(&mut c, &[0, 1, 7, 1023, 70_001]);
    assert!(bad.is_empty(), "{bad:?}");
    println!("CHILD-OK rank {} over {}", c.rank(), c.transport_name());
}

/// Ranks of one machine and network namespace but different PID namespaces (containers that
/// share the host's network, `docker --network host`) cannot open each other's segments
/// through `/proc/<pid>/fd`: they are different hosts to chorus and talk over TCP. (Before,
/// `auto` chose shared memory and init failed on every rank.) Needs root for `unshare`; where
/// it cannot make a PID namespace it fails saying so, unless `CHORUS_SKIP_NETNS=1` (as the
/// namespace test).
#[test]
fn ranks_in_different_pid_namespaces_use_tcp() {
    if is_child() {
        return sweep_child();
    }
    let unshare = ["unshare", "--pid", "--fork", "--kill-child"];
    let probe = std::process::Command::new(unshare[0])
        .args(&unshare[1..])
        .arg("true")
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        if std::env::var("CHORUS_SKIP_NETNS").as_deref() == Ok("1") {
            // Past the test harness's capture of print!, so that the skip shows.
            let line = format!("SKIPPED: cannot make a PID namespace ({probe:?})\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            return;
        }
        panic!(
            "cannot make a PID namespace with unshare (needs root; set CHORUS_SKIP_NETNS=1 to \
             skip this test where that is impossible): {probe:?}"
        );
    }
    let job = spawn_job_wrapped(
        3,
        "ranks_in_different_pid_namespaces_use_tcp",
        |_| vec![("CHORUS_TRANSPORT", "auto".to_string())],
        |rank| match rank {
            1 => unshare.to_vec(),
            _ => Vec::new(),
        },
    );
    let done = wait_job(job, Duration::from_secs(120));
    for (rank, (code, out)) in done.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(out.contains("CHILD-OK"), "rank {rank}:\n{out}");
    }
    // Ranks 0 and 2 share a PID namespace: shared memory between them, TCP to rank 1.
    assert!(done[0].1.contains("over shm+tcp"), "{}", done[0].1);
    assert!(done[1].1.contains("over tcp"), "{}", done[1].1);
}

/// A rank with an invalid shared-memory setting is named to the others at init, which fail
/// at once instead of waiting for its segments until the init timeout (30 s here).
#[test]
fn an_invalid_shm_setting_on_one_rank_fails_every_rank_at_once() {
    if is_child() {
        return report_init_as_child();
    }
    let start = Instant::now();
    let job = spawn_job_with(
        3,
        "an_invalid_shm_setting_on_one_rank_fails_every_rank_at_once",
        |rank| {
            let mut env = vec![
                ("CHORUS_TRANSPORT", "auto".to_string()),
                ("CHORUS_INIT_TIMEOUT", "30".to_string()),
            ];
            if rank == 2 {
                env.push(("CHORUS_SHM_RING_BYTES", "lots".to_string()));
            }
            env
        },
    );
    let done = wait_job(job, Duration::from_secs(120));
    for (rank, (code, out)) in done.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank}:\n{out}");
        assert!(out.contains("INIT-ERROR"), "rank {rank}:\n{out}");
        assert!(out.contains("CHORUS_SHM_RING_BYTES"), "rank {rank}:\n{out}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
}

fn dev_shm() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A rank exits abruptly in the middle of large shared-memory allreduces: every survivor gets
/// an error naming it, and nothing of the job is left: each survivor, having dropped its
/// communicator, holds no memfd open or mapped (`kill_test_child`), and nothing is in
/// /dev/shm. (The segments are memfds, which the kernel frees with their last mapping and
/// which never appear there: that check guards against a change to named segments, which a
/// killed rank would leave behind.)
#[test]
fn killed_rank_is_named_and_leaves_nothing() {
    if is_child() {
        return kill_test_child("shm");
    }
    let before = dev_shm();
    for (p, victim) in [(4usize, 2usize), (2, 0), (3, 1)] {
        kill_test_parent("killed_rank_is_named_and_leaves_nothing", "shm", p, victim);
    }
    let after = dev_shm();
    let new: Vec<_> = after.difference(&before).collect();
    assert!(new.is_empty(), "left behind in /dev/shm: {new:?}");
}

/// Three ranks on this host initialising with `CHORUS_TRANSPORT` set to `asked[rank]` (`None`:
/// unset); each rank's error, if init failed.
fn init_with_transports(asked: [Option<&'static str>; 3]) -> Vec<Option<String>> {
    let server = store();
    let addr = server.local_addr();
    let hs: Vec<_> = (0..3)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut cfg = config_on(rank, 3, addr, "auto");
                cfg.init_timeout = Duration::from_secs(20);
                cfg.transport = asked[rank].map(str::to_string);
                Communicator::new(cfg).err().map(|e| e.to_string())
            })
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// One rank forces TCP while the others use the default: every rank fails at init with an
/// error saying so, instead of hanging on mismatched transports. The error names what each
/// rank set (`rdma`, which runs as `auto`, by its own name); `rdma` beside `auto` agrees.
#[test]
fn disagreeing_transport_choice_fails_everywhere() {
    for msg in init_with_transports([None, Some("tcp"), None]) {
        let msg = msg.expect("init succeeded with disagreeing transports");
        assert!(msg.contains("CHORUS_TRANSPORT"), "{msg}");
    }
    for (rank, msg) in init_with_transports([Some("rdma"), Some("tcp"), Some("rdma")])
        .into_iter()
        .enumerate()
    {
        let msg = msg.expect("init succeeded with disagreeing transports");
        assert!(msg.contains("CHORUS_TRANSPORT="), "{msg}");
        assert!(
            msg.contains("rdma") && msg.contains("tcp"),
            "rank {rank}: {msg}"
        );
        assert!(
            !msg.contains("auto"),
            "rank {rank} names what no rank set: {msg}"
        );
    }
    let agree = init_with_transports([Some("rdma"), None, Some("auto")]);
    assert!(agree.iter().all(Option::is_none), "{agree:?}");
}

#[test]
fn rdma_falls_back_to_tcp_and_says_why() {
    if is_child() {
        return sweep_child();
    }
    let job = spawn_job(
        3,
        "rdma_falls_back_to_tcp_and_says_why",
        &[
            ("CHORUS_TRANSPORT", "rdma".to_string()),
            ("CHORUS_DEBUG", "INFO".to_string()),
        ],
    );
    for (rank, (code, out)) in wait_job(job, Duration::from_secs(120)).iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank}:\n{out}");
        assert!(out.contains("CHILD-OK"), "rank {rank}:\n{out}");
        // Every rank falls back alike: rank 0 warns for the job, the others say it at INFO.
        let level = if rank == 0 { "WARN" } else { "INFO" };
        let warning = out
            .lines()
            .find(|l| l.contains(&format!("{level}: CHORUS_TRANSPORT=rdma: ")))
            .unwrap_or_else(|| panic!("rank {rank} did not say why it runs over TCP:\n{out}"));
        if rank > 0 {
            assert!(
                !out.contains("WARN: CHORUS_TRANSPORT=rdma"),
                "rank {rank} warned too:\n{out}"
            );
        }
        assert!(warning.contains(&format!("rank {rank}]")), "{warning}");
        assert!(warning.contains("; using TCP"), "{warning}");
        println!("{warning}");
        // The ranks, all on this host, keep shared memory between them, as `auto` does.
        assert!(out.contains("over shm"), "rank {rank}:\n{out}");
    }
}

/// Two "hosts" on this machine (`CHORUS_HOSTID`), two ranks each: shared memory within a host,
/// TCP between them, so that ring steps wait on both at once. A rank exits abruptly in the
/// middle of large allreduces; every survivor gets an error naming it within seconds, not at
/// the timeout (60 s here), whichever rank it is.
#[test]
fn killed_rank_of_a_two_host_job_is_named_quickly() {
    if is_child() {
        return kill_test_child("shm+tcp");
    }
    for victim in 0..4 {
        kill_test_parent_with(
            "killed_rank_of_a_two_host_job_is_named_quickly",
            4,
            victim,
            |rank| {
                vec![
                    ("CHORUS_TRANSPORT", "auto".to_string()),
                    ("CHORUS_ALGO", "ring".to_string()),
                    ("CHORUS_TIMEOUT", "60".to_string()),
                    ("CHORUS_HOSTID", format!("host-{}", rank / 2)),
                ]
            },
            Duration::from_secs(20),
        );
    }
}
