//! Helpers shared by the integration tests: groups of ranks as threads or as processes, and
//! the allreduce sweep against the naive reference.
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::{AllReduceOptions, Communicator, Config, DType, Element, ReduceOp};
use chorus_algorithms::reference::{expected, is_correct, test_value};
use chorus_transport::rendezvous::StoreServer;

/// Ranks counts every sweep covers.
pub const RANKS: [usize; 7] = [1, 2, 3, 4, 5, 7, 8];
/// Element counts every sweep covers.
pub const COUNTS: [usize; 5] = [0, 1, 7, 1023, (1 << 20) + 3];

pub const TOKEN: &str = "integration-test-token";

/// A store on a free loopback port, hosted by the test itself.
pub fn store() -> StoreServer {
    StoreServer::bind(
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        TOKEN.as_bytes(),
    )
    .expect("store")
}

/// A test rank's configuration over TCP (tests that mean shared memory say so with
/// [`config_on`]).
pub fn config(rank: usize, size: usize, addr: SocketAddr) -> Config {
    config_on(rank, size, addr, "tcp")
}

/// A test rank's configuration over the named transport (`tcp`, `shm`, `auto`).
pub fn config_on(rank: usize, size: usize, addr: SocketAddr, transport: &str) -> Config {
    let mut c = Config::new(rank, size, addr.to_string());
    c.token = Some(TOKEN.to_string());
    c.host_store = Some(false);
    c.timeout = Duration::from_secs(60);
    c.transport = Some(transport.to_string());
    c.init_timeout = Duration::from_secs(60);
    c
}

/// Run `f` on `size` ranks as threads, each with its own communicator; panics (with the rank)
/// if one fails, and fails instead of hanging after `watchdog`.
pub fn on_threads<R: Send + 'static>(
    size: usize,
    watchdog: Duration,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    on_threads_on("tcp", size, watchdog, f)
}

/// [`on_threads`] over the named transport.
pub fn on_threads_on<R: Send + 'static>(
    transport: &'static str,
    size: usize,
    watchdog: Duration,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    on_threads_cfg(
        size,
        watchdog,
        move |rank, addr| config_on(rank, size, addr, transport),
        f,
    )
}

/// [`on_threads`] with each rank's configuration made by `make(rank, store_addr)`.
pub fn on_threads_cfg<R: Send + 'static>(
    size: usize,
    watchdog: Duration,
    make: impl Fn(usize, SocketAddr) -> Config + Send + Sync + Clone + 'static,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    on_threads_owned(size, watchdog, make, move |mut c| f(&mut c))
}

/// [`on_threads_owned`] over the named transport with a call timeout of `timeout`.
pub fn on_threads_timed<R: Send + 'static>(
    size: usize,
    transport: &'static str,
    timeout: Duration,
    watchdog: Duration,
    f: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let make = move |rank, addr| {
        let mut cfg = config_on(rank, size, addr, transport);
        cfg.timeout = timeout;
        cfg
    };
    on_threads_owned(size, watchdog, make, f)
}

/// [`on_threads_cfg`] handing each rank its communicator to own (to move into a
/// [`chorus::Queue`], say).
pub fn on_threads_owned<R: Send + 'static>(
    size: usize,
    watchdog: Duration,
    make: impl Fn(usize, SocketAddr) -> Config + Send + Sync + Clone + 'static,
    f: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let server = store();
    let addr = server.local_addr();
    let (tx, rx) = mpsc::channel();
    for rank in 0..size {
        let tx = tx.clone();
        let (f, make) = (f.clone(), make.clone());
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                f(Communicator::new(make(rank, addr)).expect("communicator"))
            }));
            let _ = tx.send((rank, r));
        });
    }
    drop(tx);
    let deadline = Instant::now() + watchdog;
    let mut out: Vec<Option<R>> = (0..size).map(|_| None).collect();
    for _ in 0..size {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((rank, Ok(r))) => out[rank] = Some(r),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {rank} of {size} panicked: {msg}")
            }
            Err(_) => {
                panic!("watchdog: ranks of a group of {size} still running after {watchdog:?}")
            }
        }
    }
    drop(server);
    out.into_iter().map(Option::unwrap).collect()
}

/// A 64-bit digest of a byte string (word-wise multiply-xorshift; not cryptographic).
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in words.by_ref() {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 29;
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 31;
    }
    h
}

/// One allreduce of `count` elements checked exactly against the naive reference; returns the
/// wrong elements this rank found.
///
/// Every rank checks its 1/p share of the indices against `reference::expected`, and all ranks
/// compare digests of their whole result (an allreduce of `[d, !d]` with max: equal on every
/// rank iff max(d) == min(d)). Together that checks every element of every rank's result while
/// computing the O(p) reference only once per element across the group.
pub fn check_one<T: Element>(
    c: &mut Communicator,
    count: usize,
    op: ReduceOp,
    inplace: bool,
) -> usize {
    check_one_with::<T>(c, count, op, inplace, &AllReduceOptions::default())
}

/// [`check_one`] with explicit options (e.g. a forced algorithm).
pub fn check_one_with<T: Element>(
    c: &mut Communicator,
    count: usize,
    op: ReduceOp,
    inplace: bool,
    opts: &AllReduceOptions,
) -> usize {
    let (rank, size) = (c.rank(), c.size());
    let input: Vec<T> = (0..count)
        .map(|i| test_value::<T>(rank, i, op, size))
        .collect();
    let got = if inplace {
        let mut b = input.clone();
        c.all_reduce_with(None, &mut b, op, opts)
            .unwrap_or_else(|e| panic!("{e}"));
        b
    } else {
        // Poison the output so an algorithm that forgets to write it is caught.
        let mut b = vec![T::from_f64(99.0); count];
        c.all_reduce_with(Some(&input), &mut b, op, opts)
            .unwrap_or_else(|e| panic!("{e}"));
        b
    };
    let (lo, hi) = (count * rank / size, count * (rank + 1) / size);
    let mut wrong = (lo..hi)
        .filter(|&i| !is_correct(got[i], expected::<T>(i, op, size), op))
        .count();
    let d = digest(bytemuck::cast_slice(&got));
    let mut dd = [d, !d];
    c.all_reduce(&mut dd, ReduceOp::Max)
        .unwrap_or_else(|e| panic!("{e}"));
    if dd[0] != !dd[1] {
        // Some rank holds a different result: count the whole buffer as wrong here.
        wrong += count.max(1);
    }
    wrong
}

macro_rules! for_dtype {
    ($dt:expr, $f:ident, $($arg:expr),*) => {
        match $dt {
            DType::Int8 => $f::<i8>($($arg),*),
            DType::Uint8 => $f::<u8>($($arg),*),
            DType::Int32 => $f::<i32>($($arg),*),
            DType::Uint32 => $f::<u32>($($arg),*),
            DType::Int64 => $f::<i64>($($arg),*),
            DType::Uint64 => $f::<u64>($($arg),*),
            DType::Float16 => $f::<half::f16>($($arg),*),
            DType::Float32 => $f::<f32>($($arg),*),
            DType::Float64 => $f::<f64>($($arg),*),
            DType::Bfloat16 => $f::<half::bf16>($($arg),*),
        }
    };
}

/// The full sweep on one communicator: every dtype × op × count, in place and out of place.
/// Returns a list of failures ("dtype op count inplace: wrong").
pub fn sweep(c: &mut Communicator, counts: &[usize]) -> Vec<String> {
    let default = AllReduceOptions::default();
    sweep_with(c, counts, &DType::ALL, &ReduceOp::ALL, &default)
}

/// [`sweep`] over the given dtypes and ops with explicit options (e.g. a forced algorithm).
pub fn sweep_with(
    c: &mut Communicator,
    counts: &[usize],
    dtypes: &[DType],
    ops: &[ReduceOp],
    opts: &AllReduceOptions,
) -> Vec<String> {
    let mut bad = Vec::new();
    for &count in counts {
        for &dt in dtypes {
            for &op in ops {
                for inplace in [true, false] {
                    let wrong = for_dtype!(dt, check_one_with, c, count, op, inplace, opts);
                    if wrong > 0 {
                        bad.push(format!(
                            "rank {} p={} {:?} {} {} count {count} inplace {inplace}: {wrong} wrong",
                            c.rank(),
                            c.size(),
                            opts.algorithm,
                            dt.name(),
                            op.name()
                        ));
                    }
                }
            }
        }
    }
    bad
}

/// Fails, naming `what`, the number of failures and the first few, unless every rank's list
/// of failures (as [`sweep`] returns them) is empty.
pub fn assert_no_failures(per_rank: Vec<Vec<String>>, what: &str) {
    let bad: Vec<String> = per_rank.into_iter().flatten().collect();
    assert!(
        bad.is_empty(),
        "{what}: {} failures, first: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// Children of a process-based test. They re-run this test binary (`current_exe`) filtered to
/// `test_name`, with CHORUS_* set and `CHORUS_TEST_CHILD=1`.
pub struct Job {
    pub children: Vec<Child>,
    pub server: StoreServer,
}

pub fn spawn_job(size: usize, test_name: &str, extra_env: &[(&str, String)]) -> Job {
    spawn_job_with(size, test_name, |_| extra_env.to_vec())
}

/// [`spawn_job`] with each rank's extra variables from `env_of(rank)`.
pub fn spawn_job_with<'a>(
    size: usize,
    test_name: &str,
    env_of: impl Fn(usize) -> Vec<(&'a str, String)>,
) -> Job {
    spawn_job_wrapped(size, test_name, env_of, |_| Vec::new())
}

/// [`spawn_job_with`], rank `r` started through the command `wrap(r)` (empty: directly), e.g.
/// `unshare --pid --fork`, which runs the test binary as its last argument.
pub fn spawn_job_wrapped<'a>(
    size: usize,
    test_name: &str,
    env_of: impl Fn(usize) -> Vec<(&'a str, String)>,
    wrap: impl Fn(usize) -> Vec<&'a str>,
) -> Job {
    let server = store();
    let addr = server.local_addr();
    let exe = std::env::current_exe().expect("test binary path");
    let children = (0..size)
        .map(|rank| {
            let wrapper = wrap(rank);
            let mut cmd = match wrapper.split_first() {
                Some((program, args)) => {
                    let mut c = Command::new(program);
                    c.args(args).arg(&exe);
                    c
                }
                None => Command::new(&exe),
            };
            cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
                .env("CHORUS_TEST_CHILD", "1")
                .env("CHORUS_RANK", rank.to_string())
                .env("CHORUS_WORLD_SIZE", size.to_string())
                .env("CHORUS_ADDR", addr.to_string())
                .env("CHORUS_TOKEN", TOKEN)
                .env("CHORUS_TRANSPORT", "tcp")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env_of(rank) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawn child rank")
        })
        .collect();
    Job { children, server }
}

/// Reads a child's pipe to its end on a thread, so that a child writing more than a pipe holds
/// never blocks on it.
pub fn drain(
    pipe: Option<impl std::io::Read + Send + 'static>,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut bytes);
        }
        bytes
    })
}

/// Wait for every child with a watchdog; returns (exit code, stdout+stderr) per rank.
pub fn wait_job(mut job: Job, watchdog: Duration) -> Vec<(Option<i32>, String)> {
    let outputs: Vec<_> = job
        .children
        .iter_mut()
        .map(|c| (drain(c.stdout.take()), drain(c.stderr.take())))
        .collect();
    let deadline = Instant::now() + watchdog;
    let mut done: Vec<Option<std::process::ExitStatus>> = vec![None; job.children.len()];
    while done.iter().any(Option::is_none) {
        if Instant::now() > deadline {
            for c in job.children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!("watchdog: job still running after {watchdog:?}");
        }
        for (i, c) in job.children.iter_mut().enumerate() {
            if done[i].is_none() {
                done[i] = c.try_wait().expect("try_wait");
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    outputs
        .into_iter()
        .zip(done)
        .map(|((out, err), st)| {
            let mut s = String::from_utf8_lossy(&out.join().unwrap()).into_owned();
            s.push_str(&String::from_utf8_lossy(&err.join().unwrap()));
            (st.and_then(|s| s.code()), s)
        })
        .collect()
}

/// True inside a child rank of a process test.
pub fn is_child() -> bool {
    std::env::var_os("CHORUS_TEST_CHILD").is_some()
}

/// The communicator of a child rank (the store is hosted by the parent test).
pub fn child_comm() -> Communicator {
    let mut c = Config::from_env().expect("config from env");
    c.host_store = Some(false);
    Communicator::new(c).expect("communicator")
}

/// Child side of a kill test: a warm-up allreduce, then rank `CHORUS_TEST_VICTIM` exits
/// (no goodbye) 30 ms into a stream of 16 MiB allreduces while the others must get an error
/// (printed as `ERR after …`), and the communicator refuses further work without hanging.
pub fn kill_test_child(transport: &str) {
    let victim: usize = std::env::var("CHORUS_TEST_VICTIM")
        .unwrap()
        .parse()
        .unwrap();
    let mut c = child_comm();
    assert_eq!(c.transport_name(), transport);
    let mut small = vec![1.0f32; 16];
    c.all_reduce(&mut small, chorus::ReduceOp::Sum).unwrap();
    if c.rank() == victim {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            std::process::exit(17);
        });
    }
    let mut big = vec![1.0f32; 1 << 22];
    let start = Instant::now();
    for _ in 0..2000 {
        if let Err(e) = c.all_reduce(&mut big, chorus::ReduceOp::Sum) {
            println!(
                "ERR after {:.2}s kind={:?} peer={:?}: {e}",
                start.elapsed().as_secs_f64(),
                e.kind(),
                e.peer()
            );
            assert!(!e.is_usable());
            assert!(c.all_reduce(&mut small, chorus::ReduceOp::Sum).is_err());
            // The failed communicator, once dropped, keeps no shared segment: no memfd left
            // open or mapped in this process.
            drop(c);
            let fds = std::fs::read_dir("/proc/self/fd")
                .expect("/proc/self/fd")
                .flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter(|l| l.to_string_lossy().starts_with("/memfd:"))
                .count();
            let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
            let mapped = maps.lines().filter(|l| l.contains("/memfd:")).count();
            assert_eq!((fds, mapped), (0, 0), "memfds left (open, mapped)");
            return;
        }
    }
    println!("NO-ERROR");
    std::process::exit(3);
}

/// Parent side of a kill test: runs `test_name` as a job of `p` ranks over `transport` with
/// `victim` exiting, and checks every survivor reported an error naming the victim, well
/// within the 30 s timeout.
pub fn kill_test_parent(test_name: &str, transport: &str, p: usize, victim: usize) {
    kill_test_parent_with(
        test_name,
        p,
        victim,
        |_| {
            vec![
                ("CHORUS_TRANSPORT", transport.to_string()),
                ("CHORUS_TIMEOUT", "30".to_string()),
            ]
        },
        Duration::from_secs(30),
    );
}

/// [`kill_test_parent`] with each rank's variables from `env_of(rank)` (the victim's number
/// added), every survivor's error due within `limit`.
pub fn kill_test_parent_with<'a>(
    test_name: &str,
    p: usize,
    victim: usize,
    env_of: impl Fn(usize) -> Vec<(&'a str, String)>,
    limit: Duration,
) {
    let job = spawn_job_with(p, test_name, |rank| {
        let mut env = env_of(rank);
        env.push(("CHORUS_TEST_VICTIM", victim.to_string()));
        env
    });
    let start = Instant::now();
    let res = wait_job(job, limit + Duration::from_secs(90));
    for (rank, (code, out)) in res.iter().enumerate() {
        if rank == victim {
            assert_eq!(*code, Some(17), "victim output:\n{out}");
            continue;
        }
        assert_eq!(*code, Some(0), "p={p} victim {victim} rank {rank}:\n{out}");
        let line = out
            .lines()
            .find(|l| l.contains("ERR after"))
            .unwrap_or_default();
        assert!(
            line.contains(&format!("rank {victim}")),
            "p={p} rank {rank} does not name rank {victim}: {line}\n{out}"
        );
    }
    assert!(
        start.elapsed() < limit,
        "victim {victim}: errors took {:?}",
        start.elapsed()
    );
}

/// The variables by which chorus-run sees that it was started as one of several tasks of
/// another launcher (and refuses to run), or is allowed to: removed from a chorus-run the
/// tests start, which may themselves run under a launcher (`srun -n2 cargo test`).
pub const OUTER_LAUNCHER_VARS: [&str; 6] = [
    "SLURM_STEP_NUM_TASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "CHORUS_RUN_NPROC",
    "TORCHELASTIC_RUN_ID",
    "CHORUS_RUN_NESTED",
];

/// The child side of a job whose init is meant to fail (see [`spawn_job_with`]): init from
/// the environment (the parent hosts the store), printing `JOINED` or `INIT-ERROR <error>`.
pub fn report_init_as_child() {
    let mut cfg = chorus::Config::from_env().expect("config from env");
    cfg.host_store = Some(false);
    match chorus::Communicator::new(cfg) {
        Ok(_) => println!("JOINED"),
        Err(e) => println!("INIT-ERROR {e}"),
    }
}
