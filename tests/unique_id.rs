//! Communicators joined through a `UniqueId` (as NCCL's `ncclGetUniqueId` /
//! `ncclCommInitRank`), ranks as threads: over TCP and shared memory, the id's bytes carried
//! as another process would get them; an id whose secret was changed is refused.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::{Communicator, Config, ReduceOp, UniqueId};

use common::check_one;

/// Run `f` on `p` ranks as threads, each joining through `id`'s bytes (`forge`: a rank whose
/// copy of the id has another secret). Returns each rank's result.
fn through_id<R: Send + 'static>(
    p: usize,
    transport: &str,
    forge: Option<usize>,
    init_timeout: Duration,
    f: impl Fn(Result<Communicator, chorus::CommError>) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    // On loopback: the tests' traffic stays there (UniqueId::new would take this host's first
    // interface without a launcher's address in the environment).
    let id = UniqueId::new_on([127, 0, 0, 1].into()).expect("an id");
    let (tx, rx) = mpsc::channel();
    for rank in 0..p {
        let mut bytes = id.as_bytes().to_vec();
        if forge == Some(rank) {
            bytes[100] ^= 0xff;
        }
        let (tx, f, transport) = (tx.clone(), f.clone(), transport.to_string());
        std::thread::spawn(move || {
            let id = UniqueId::from_bytes(&bytes).expect("well-formed bytes");
            let mut cfg = Config::from_unique_id(&id, rank, p).expect("a configuration");
            cfg.transport = Some(transport);
            cfg.init_timeout = init_timeout;
            let _ = tx.send((rank, f(Communicator::new(cfg))));
        });
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut out: Vec<Option<R>> = (0..p).map(|_| None).collect();
    for _ in 0..p {
        let (rank, r) = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("every rank within the watchdog");
        out[rank] = Some(r);
    }
    out.into_iter().map(|r| r.expect("every rank")).collect()
}

#[test]
fn ranks_join_through_an_id() {
    for transport in ["tcp", "shm"] {
        for p in [1, 2, 4] {
            let wrong = through_id(p, transport, None, Duration::from_secs(60), |c| {
                let mut c = c.unwrap_or_else(|e| panic!("{e}"));
                let mut n = check_one::<f32>(&mut c, 100_003, ReduceOp::Sum, false);
                n += check_one::<i64>(&mut c, 7, ReduceOp::Max, true);
                n
            });
            assert!(
                wrong.iter().all(|&w| w == 0),
                "{transport} p={p}: {wrong:?}"
            );
        }
    }
}

#[test]
fn a_rank_with_another_secret_is_refused() {
    let start = Instant::now();
    let errs = through_id(3, "tcp", Some(2), Duration::from_secs(5), |c| {
        c.err().map(|e| e.to_string())
    });
    // Within the 5 s init timeout and a margin (the test's own bound is 120 s).
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    // The forged rank cannot authenticate with the store; without it the others cannot
    // complete the rendezvous. Every rank fails (within the init timeout), none hangs.
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.is_some(), "rank {rank} joined a job with a forged id");
    }
    assert!(
        errs[2].as_deref().unwrap().contains("auth"),
        "forged rank: {:?}",
        errs[2]
    );
}

/// Ranks that share an id but pass different numbers of ranks (rank 0 three, the others
/// four): every rank fails at once saying so, instead of waiting out the init timeout for a
/// fourth rank that will never come.
#[test]
fn ranks_given_different_sizes_fail_at_once() {
    let id = UniqueId::new_on([127, 0, 0, 1].into()).expect("an id");
    let start = Instant::now();
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let bytes = id.as_bytes().to_vec();
            std::thread::spawn(move || {
                let id = UniqueId::from_bytes(&bytes).expect("well-formed bytes");
                let size = if rank == 0 { 3 } else { 4 };
                if rank > 0 {
                    // Rank 0 takes the id's store, as the process that made the id would (in
                    // one process, the first communicator to start keeps it).
                    std::thread::sleep(Duration::from_millis(1000));
                }
                let mut cfg = Config::from_unique_id(&id, rank, size).expect("a configuration");
                cfg.transport = Some("tcp".into());
                cfg.init_timeout = Duration::from_secs(60);
                Communicator::new(cfg).err().map(|e| e.to_string())
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let e = h.join().expect("rank thread");
        let e = e.unwrap_or_else(|| panic!("rank {rank} made a communicator"));
        assert!(e.contains("group of"), "rank {rank}: {e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
}

/// Two processes given the same rank (here ranks 0, 1 and 1 of 3): the second to join is
/// refused at once, saying so, rather than both writing over each other's rendezvous and
/// the group failing later with a closed connection or a timeout.
#[test]
fn a_rank_given_twice_is_refused_at_once() {
    let id = UniqueId::new_on([127, 0, 0, 1].into()).expect("an id");
    let start = Instant::now();
    let handles: Vec<_> = [0usize, 1, 1]
        .into_iter()
        .enumerate()
        .map(|(k, rank)| {
            let bytes = id.as_bytes().to_vec();
            std::thread::spawn(move || {
                let id = UniqueId::from_bytes(&bytes).expect("well-formed bytes");
                if k > 0 {
                    // Rank 0 takes the id's store first (see above).
                    std::thread::sleep(Duration::from_millis(300 * k as u64));
                }
                let mut cfg = Config::from_unique_id(&id, rank, 3).expect("a configuration");
                cfg.transport = Some("tcp".into());
                cfg.init_timeout = Duration::from_secs(4);
                let r = Communicator::new(cfg).err().map(|e| e.to_string());
                (r, start.elapsed())
            })
        })
        .collect();
    let got: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect();
    let (dup, took) = &got[2];
    let dup = dup
        .as_deref()
        .expect("the second rank 1 made a communicator");
    assert!(
        dup.contains("rank 1 has joined this group already"),
        "{dup}"
    );
    assert!(
        *took < Duration::from_secs(3),
        "refused after {took:?}: {dup}"
    );
    // Rank 2 never came: the others fail within their timeout.
    for (k, (e, took)) in got.iter().take(2).enumerate() {
        assert!(
            e.is_some(),
            "process {k} made a communicator of 3 without rank 2"
        );
        assert!(*took < Duration::from_secs(20), "process {k}: {took:?}");
    }
}

/// A rank that cannot join through an id (its settings are invalid) tells the others through
/// the id's store: they fail at once naming it, not at their init timeout.
#[test]
fn a_rank_that_cannot_join_an_id_is_named_at_once() {
    let id = UniqueId::new_on("127.0.0.1".parse().unwrap()).expect("unique id");
    let bytes = *id.as_bytes();
    let joined = std::thread::spawn(move || {
        let id = UniqueId::from_bytes(&bytes).unwrap();
        let mut config = Config::from_unique_id(&id, 0, 2).unwrap();
        config.init_timeout = Duration::from_secs(60);
        let began = Instant::now();
        let e = Communicator::new(config).map(|_| ()).unwrap_err();
        (e.to_string(), began.elapsed())
    });
    let why = chorus::CommError::invalid("init", "CHORUS_TIMEOUT=\"soon\" is not a number");
    Communicator::announce_unique_id_failure(&id, 1, 2, &why);
    let (e, took) = joined.join().unwrap();
    assert!(e.contains("rank 1") && e.contains("CHORUS_TIMEOUT"), "{e}");
    assert!(took < Duration::from_secs(30), "{took:?}: {e}");
}
