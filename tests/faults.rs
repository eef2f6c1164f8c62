//! Failures must surface as clear errors on every rank within the timeout — never a hang, a
//! panic or a wrong result: a rank that dies mid-allreduce, ranks that disagree on the call,
//! a rank that never shows up, and strangers connecting to the job's ports.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::{AllReduceOptions, Communicator, ErrorKind, ReduceOp};
use chorus_transport::rendezvous::{connect_handshake, StoreClient};
use common::*;

/// A rank exits (process::exit, no goodbye) in the middle of a large allreduce; every other
/// rank must return an error naming it, well within the timeout.
#[test]
fn rank_exits_mid_allreduce() {
    if is_child() {
        return kill_test_child("tcp");
    }
    for (p, victim) in [(4usize, 2usize), (3, 0), (5, 4)] {
        kill_test_parent("rank_exits_mid_allreduce", "tcp", p, victim);
    }
}

/// Ranks disagree on the count, or on the dtype: every rank gets an error, at least one a
/// mismatch, nobody hangs until the timeout.
#[test]
fn mismatched_calls_fail_everywhere() {
    let res = on_threads(3, Duration::from_secs(60), |c| {
        let n = if c.rank() == 1 { 1000 } else { 1200 };
        let mut v = vec![1.0f32; n];
        let opts = AllReduceOptions {
            timeout: Some(Duration::from_secs(20)),
            ..Default::default()
        };
        let start = Instant::now();
        let e = c
            .all_reduce_with(None, &mut v, ReduceOp::Sum, &opts)
            .unwrap_err();
        (e.kind(), e.to_string(), start.elapsed())
    });
    assert!(
        res.iter().any(|(k, _, _)| *k == ErrorKind::Mismatch),
        "{res:?}"
    );
    for (_, msg, took) in &res {
        assert!(*took < Duration::from_secs(15), "took {took:?}: {msg}");
    }

    let res = on_threads(3, Duration::from_secs(60), |c| {
        let opts = AllReduceOptions {
            timeout: Some(Duration::from_secs(20)),
            ..Default::default()
        };
        let r = if c.rank() == 2 {
            let mut v = vec![1i32; 64];
            c.all_reduce_with(None, &mut v, ReduceOp::Sum, &opts)
        } else {
            let mut v = vec![1.0f32; 64];
            c.all_reduce_with(None, &mut v, ReduceOp::Sum, &opts)
        };
        let e = r.unwrap_err();
        (e.kind(), e.to_string())
    });
    let mm: Vec<_> = res
        .iter()
        .filter(|(k, _)| *k == ErrorKind::Mismatch)
        .collect();
    assert!(!mm.is_empty(), "{res:?}");
    assert!(
        mm.iter()
            .any(|(_, m)| m.contains("int32") && m.contains("float")),
        "{mm:?}"
    );
}

/// Counts that differ while the schedule's messages happen to have equal lengths: on 2 ranks
/// halving-doubling with 1 and 2 elements exchanges 4-byte messages only, so lengths and tags
/// agreed and the rank with 1 element returned a wrong sum as if all was well. The call's
/// fingerprint in the tag makes it a mismatch on every rank.
#[test]
fn counts_that_differ_behind_equal_message_lengths_fail_everywhere() {
    use chorus::Algorithm;
    let res = on_threads(2, Duration::from_secs(60), |c| {
        let n = if c.rank() == 0 { 1 } else { 2 };
        let mut v = vec![1.0f32; n];
        let opts = AllReduceOptions {
            algorithm: Some(Algorithm::HalvingDoubling),
            timeout: Some(Duration::from_secs(10)),
        };
        c.all_reduce_with(None, &mut v, ReduceOp::Sum, &opts)
            .map(|()| v)
            .map_err(|e| (e.kind(), e.to_string()))
    });
    every_rank_failed_one_with_a_mismatch(&res, "different counts");
}

/// One rank forces the very schedule the other's `auto` picks: the messages agree, but the
/// rank that forced it skipped the tuner's step, and the ranks would fall out of step at a
/// later call (one revisiting a rival schedule, the other not). A forced schedule is part of
/// the call's fingerprint, so the call itself fails, on every rank.
#[test]
fn a_schedule_forced_on_one_rank_only_fails_everywhere() {
    let res = on_threads(2, Duration::from_secs(60), |c| {
        c.set_tuning(false);
        let mut v = vec![1.0f32; 1024];
        let auto = c.selected_algorithm(4096);
        let opts = AllReduceOptions {
            algorithm: (c.rank() == 0).then_some(auto),
            timeout: Some(Duration::from_secs(10)),
        };
        c.all_reduce_with(None, &mut v, ReduceOp::Sum, &opts)
            .map_err(|e| (e.kind(), e.to_string()))
    });
    every_rank_failed_one_with_a_mismatch(&res, "");
}

/// Every rank's call failed, and at least one rank's with a mismatch whose message contains
/// `text`.
fn every_rank_failed_one_with_a_mismatch<T: std::fmt::Debug>(
    res: &[Result<T, (ErrorKind, String)>],
    text: &str,
) {
    assert!(
        res.iter().all(Result::is_err),
        "a rank returned Ok: {res:?}"
    );
    assert!(
        res.iter()
            .any(|r| matches!(r, Err((ErrorKind::Mismatch, m)) if m.contains(text))),
        "{res:?}"
    );
}

/// Ranks that never reach the rendezvous (one not started, one with another token): the ranks
/// that did join time out naming them, as Gloo's store names the workers that did not join.
#[test]
fn ranks_that_never_join_are_named() {
    let server = store();
    let addr = server.local_addr();
    let hs: Vec<_> = [0usize, 1, 3]
        .into_iter()
        .map(|rank| {
            std::thread::spawn(move || {
                let mut cfg = config(rank, 4, addr);
                cfg.init_timeout = Duration::from_secs(3);
                if rank == 3 {
                    cfg.token = Some("another job's secret".into());
                }
                let start = Instant::now();
                let e = Communicator::new(cfg).map(|_| ()).unwrap_err();
                (rank, e.kind(), e.to_string(), start.elapsed())
            })
        })
        .collect();
    for h in hs {
        let (rank, kind, msg, took) = h.join().expect("rank thread");
        assert!(took < Duration::from_secs(20), "rank {rank} took {took:?}");
        if rank == 3 {
            continue;
        }
        assert_eq!(kind, ErrorKind::Timeout, "rank {rank}: {msg}");
        assert!(
            msg.contains("ranks [2, 3] of 4 never reached the store at"),
            "rank {rank}: {msg}"
        );
    }
}

/// A rank that never calls the collective: the others time out naming a rank, and the
/// bad-argument errors before that leave the communicator usable.
#[test]
fn absent_rank_times_out() {
    // Survivors that have their error (rank 2 stays until then, bounded).
    let failed = Arc::new(AtomicUsize::new(0));
    let res = on_threads(3, Duration::from_secs(60), move |c| {
        // A bad argument first: usable afterwards.
        let e = c
            .all_reduce_into(&[1.0f32; 3], &mut [0.0f32; 4], ReduceOp::Sum)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.is_usable());
        if c.rank() == 2 {
            let start = Instant::now();
            while failed.load(Ordering::SeqCst) < 2 && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(10));
            }
            return None;
        }
        let mut v = vec![1.0f32; 100];
        let opts = AllReduceOptions {
            timeout: Some(Duration::from_millis(800)),
            ..Default::default()
        };
        let start = Instant::now();
        let e = c
            .all_reduce_with(None, &mut v, ReduceOp::Sum, &opts)
            .unwrap_err();
        let took = start.elapsed();
        failed.fetch_add(1, Ordering::SeqCst);
        Some((e.kind(), e.to_string(), took))
    });
    let errors: Vec<_> = res.into_iter().flatten().collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    for r in &errors {
        assert!(
            matches!(r.0, ErrorKind::Timeout | ErrorKind::Remote),
            "{r:?}"
        );
        assert!(r.2 < Duration::from_secs(5), "{r:?}");
        // Each names a rank: the absent one, or a survivor that gave up waiting (which one
        // waits on whom depends on the schedule and on which deadline fires first).
        assert!((0..3).any(|k| r.1.contains(&format!("rank {k}"))), "{r:?}");
    }
}

fn garbage(addr: SocketAddr, bytes: &[u8]) {
    if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
        let _ = s.write_all(bytes);
    }
}

/// Strangers connect to the rendezvous port and to the data ports with garbage, with nothing,
/// and with a wrong token, while the job sets up: the job completes with correct results.
#[test]
fn strangers_do_not_disturb_the_job() {
    let server = store();
    let addr = server.local_addr();
    let size = 3;
    let mut ranks = Vec::new();
    for rank in 0..size {
        ranks.push(std::thread::spawn(move || {
            if rank == 2 {
                // Keep the others' data listeners waiting while the strangers knock.
                std::thread::sleep(Duration::from_millis(1500));
            }
            let mut c = Communicator::new(config(rank, size, addr)).expect("communicator");
            let mut v: Vec<f32> = (0..10_000)
                .map(|i| (i % 100) as f32 + rank as f32)
                .collect();
            c.all_reduce(&mut v, ReduceOp::Sum).expect("allreduce");
            v.iter()
                .enumerate()
                .all(|(i, x)| *x == 3.0 * (i % 100) as f32 + 3.0)
        }));
    }
    // The rendezvous port: garbage, silence, an oversized length, a wrong token.
    garbage(addr, b"GET / HTTP/1.0\r\n\r\n");
    garbage(addr, &[0xff; 4096]);
    let _silent = TcpStream::connect(addr).unwrap();
    assert!(StoreClient::connect(
        addr,
        b"wrong token",
        Instant::now() + Duration::from_secs(3)
    )
    .is_err());
    // The data ports, once published: read them with the right token, as an insider would.
    let mut spy = StoreClient::connect(
        addr,
        TOKEN.as_bytes(),
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap();
    for j in 0..2 {
        let a: SocketAddr = String::from_utf8(
            spy.get(
                &format!("addr/{j}"),
                Instant::now() + Duration::from_secs(5),
            )
            .unwrap(),
        )
        .unwrap()
        .parse()
        .unwrap();
        garbage(a, &[0u8; 64]);
        garbage(a, b"CHRH\x01\x00\x00\x00garbage-garbage-garbage");
        let _silent = TcpStream::connect(a).unwrap();
        // A well-formed hello claiming to be rank 2, then a handshake with the wrong token.
        // The communicator's id, then its size.
        let id = spy
            .get("comm_id", Instant::now() + Duration::from_secs(5))
            .unwrap()[..8]
            .to_vec();
        if let Ok(mut s) = TcpStream::connect(a) {
            let mut h = Vec::new();
            h.extend_from_slice(b"CHRH");
            // The hello's version is the frame version of this release.
            h.extend_from_slice(&u32::from(chorus_transport::frame::VERSION).to_le_bytes());
            h.extend_from_slice(&id);
            h.extend_from_slice(&2u32.to_le_bytes());
            h.extend_from_slice(&(j as u32).to_le_bytes());
            s.write_all(&h).unwrap();
            let ctx = format!(
                "data/{:016x}/2/{j}",
                u64::from_le_bytes(id.as_slice().try_into().unwrap())
            );
            assert!(connect_handshake(
                &mut s,
                b"wrong token",
                ctx.as_bytes(),
                Instant::now() + Duration::from_secs(3)
            )
            .is_err());
        }
    }
    for r in ranks {
        assert!(r.join().expect("rank thread"), "wrong allreduce result");
    }
}

/// Ranks whose settings would make them pick different schedules (a configured link, the
/// allowed algorithms) fail init on every rank, naming the setting, instead of a mismatch or a
/// timeout at some later call.
#[test]
fn ranks_with_different_schedule_settings_fail_init_everywhere() {
    type Tweak = fn(usize, &mut chorus::Config);
    let cases: [(Tweak, &str); 3] = [
        (
            |r, c| c.alpha_us = Some(if r == 1 { 1.0 } else { 1000.0 }),
            "CHORUS_ALPHA_US",
        ),
        (
            |r, c| c.algo = (r == 2).then(|| "ring".to_string()),
            "CHORUS_ALGO",
        ),
        (
            |r, c| c.algo = Some(if r == 0 { "^tree" } else { "^ring" }.to_string()),
            "CHORUS_ALGO",
        ),
    ];
    for (tweak, name) in cases {
        let out = three_ranks(tweak, |_, c| c.map(|_| ()));
        for (rank, r) in out.into_iter().enumerate() {
            let e = r.expect_err("init must fail");
            assert_eq!(e.kind(), ErrorKind::Mismatch, "rank {rank}: {e}");
            assert!(e.to_string().contains(name), "rank {rank}: {e}");
        }
    }
}

/// A rank whose own settings are invalid fails init with its error, and says so where the
/// others wait for its address: they fail at once naming it and the setting, instead of
/// waiting out their init timeout (20 s here).
#[test]
fn a_rank_with_an_invalid_setting_fails_init_everywhere_at_once() {
    type Tweak = fn(usize, &mut chorus::Config);
    let cases: [(Tweak, usize, &str); 3] = [
        (
            |r, c| {
                if r == 1 {
                    c.transport = Some("bogus".into());
                }
            },
            1,
            "CHORUS_TRANSPORT",
        ),
        (
            |r, c| {
                if r == 0 {
                    c.algo = Some("allreduce:no_such_schedule".into());
                }
            },
            0,
            "no_such_schedule",
        ),
        (
            |r, c| {
                if r == 2 {
                    c.socket_ifname = Some("no-such-if0".into());
                }
            },
            2,
            "no-such-if0",
        ),
    ];
    for (tweak, bad, what) in cases {
        let out = three_ranks(tweak, |_, c| {
            let started = std::time::Instant::now();
            (c.map(|_| ()), started.elapsed())
        });
        for (rank, (r, took)) in out.into_iter().enumerate() {
            let e = r.expect_err("init must fail");
            let text = e.to_string();
            assert!(text.contains(what), "rank {rank}: {text}");
            if rank == bad {
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "rank {rank}: {text}");
            } else {
                assert!(text.contains(&format!("rank {bad}")), "rank {rank}: {text}");
                // Not a timing claim: waiting would have taken the 20 s init timeout.
                assert!(
                    took < Duration::from_secs(15),
                    "rank {rank}: {took:?} {text}"
                );
            }
        }
    }
}

/// With `check_calls`, calls that differ in a way no message shows (every rank a root, so no
/// rank receives) fail on every rank, naming each rank's call, and leave the communicator
/// usable; calls that agree run as usual.
#[test]
fn checked_calls_catch_what_no_message_shows() {
    let out: Vec<Vec<String>> = three_ranks(
        |_, cfg| {
            cfg.check_calls = true;
            cfg.timeout = Duration::from_secs(20);
        },
        |rank, c| {
            let mut c = c.expect("communicator");
            let mut errors = Vec::new();
            // Every rank its own root: each would only send, and keep its own block.
            let send = [rank as i32; 6];
            let mut block = [0i32; 2];
            let e = c.scatter(Some(&send[..]), &mut block, rank).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            assert!(e.is_usable(), "{e}");
            errors.push(e.to_string());
            // One rank reduces where the others broadcast the same bytes.
            let mut v = [1.0f32; 4];
            let e = if rank == 1 {
                let mut out = [0.0f32; 4];
                c.reduce(Some(&v), &mut out, ReduceOp::Sum, 0)
            } else {
                c.broadcast(&mut v, 0)
            }
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            errors.push(e.to_string());
            // The root refuses its own arguments (a send buffer of the wrong size): the
            // others, in the comparison of the same call, fail at once naming it, instead of
            // waiting out their timeout for a root that sends nothing.
            let send = [1i32; 5];
            let mut block = [0i32; 2];
            let e = c
                .scatter((rank == 0).then_some(&send[..]), &mut block, 0)
                .unwrap_err();
            if rank == 0 {
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            } else {
                assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
                let m = e.to_string();
                assert!(
                    m.contains("rank 0: scatter") && m.contains("refused its arguments"),
                    "{m}"
                );
            }
            assert!(e.is_usable(), "{e}");
            // The same through the allreduce, rank 2 passing buffers of different lengths.
            let mut out = [0.0f32; 4];
            let input = vec![1.0f32; if rank == 2 { 3 } else { 4 }];
            let e = c
                .all_reduce_into(&input, &mut out, ReduceOp::Sum)
                .unwrap_err();
            if rank == 2 {
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            } else {
                let m = e.to_string();
                assert!(
                    m.contains("rank 2: all_reduce") && m.contains("refused"),
                    "{m}"
                );
            }
            // Every rank refuses (a root out of range): each reports its own error.
            let e = c.broadcast(&mut [0u8; 4], 7).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            // A binding refused rank 1's call before chorus saw its arguments (a NULL buffer
            // in C): the others fail at once naming it, not at their timeout, and the ranks
            // stay in step.
            let mut y = [1.0f32; 3];
            if rank == 1 {
                c.skip_refused_call();
            } else {
                let e = c.all_reduce(&mut y, ReduceOp::Sum).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
                let m = e.to_string();
                assert!(m.contains("rank 1: a call that refused"), "{m}");
                assert!(e.is_usable(), "{e}");
            }
            // Calls that agree still work, checked.
            let mut x = [rank as f32 + 1.0; 5];
            c.all_reduce(&mut x, ReduceOp::Sum).expect("allreduce");
            assert_eq!(x, [6.0; 5]);
            // One rank with tuning off skips the tuner's step: named at the call, not found
            // out hundreds of calls later.
            c.set_tuning(rank != 1);
            let e = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            let m = e.to_string();
            assert!(m.contains("tuning off") && m.contains("tuning on"), "{m}");
            // A forced schedule steps no tuner: the difference does not matter there.
            let ring = chorus::AllReduceOptions {
                algorithm: Some(chorus::Algorithm::Ring),
                timeout: None,
            };
            c.all_reduce_with(None, &mut x, ReduceOp::Sum, &ring)
                .expect("forced ring with tuning differing");
            c.set_tuning(true);
            c.barrier().expect("barrier");
            // Counts that differ pair by pair (alltoallv, gatherv, scatterv): every rank fails
            // naming the pair, before any data moves, and the communicator goes on.
            let p = 3;
            let sc: Vec<usize> = (0..p)
                .map(|j| if rank == 2 && j == 0 { 2 } else { 1 })
                .collect();
            let rc = vec![1usize; p];
            let send = vec![rank as i32; sc.iter().sum()];
            let mut recv = vec![0i32; p];
            let e = c.all_to_all_v(&send, &sc, &mut recv, &rc).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            assert!(e.is_usable(), "{e}");
            errors.push(e.to_string());
            let mine = vec![1i64; if rank == 2 { 3 } else { 2 }];
            let counts = [2usize, 2, 2];
            let mut out = [0i64; 6];
            let recv = (rank == 1).then_some((&mut out[..], &counts[..]));
            let e = c.gather_v(&mine, recv, 1).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            errors.push(e.to_string());
            let counts = [1usize, 4, 1];
            let send = [7u8; 6];
            let mut block = vec![0u8; if rank == 1 { 3 } else { counts[rank] }];
            let e = c
                .scatter_v(
                    (rank == 0).then_some((&send[..], &counts[..])),
                    &mut block,
                    0,
                )
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            errors.push(e.to_string());
            let mut out = [0i64; 6];
            let counts = [2usize, 2, 2];
            let recv = (rank == 1).then_some((&mut out[..], &counts[..]));
            c.gather_v(&[rank as i64; 2], recv, 1)
                .expect("gather_v that agrees");
            if rank == 1 {
                assert_eq!(out, [0, 0, 1, 1, 2, 2]);
            }
            let mut comp = chorus::Compressor::new("int8,min_bytes=0").unwrap();
            let mut g = vec![1.0f32; 4096];
            c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut comp)
                .expect("compressed allreduce");
            assert!(g.iter().all(|v| (v - 3.0).abs() < 0.1), "{:?}", &g[..4]);
            errors
        },
    );
    for (rank, errors) in out.iter().enumerate() {
        assert!(
            errors[0].contains("root 0") && errors[0].contains("root 2"),
            "{rank}: {errors:?}"
        );
        assert!(
            errors[1].contains("broadcast") && errors[1].contains("reduce"),
            "{rank}: {errors:?}"
        );
        for (k, want) in [
            (2, "rank 0 expects 1 elements from rank 2, which sends it 2"),
            (3, "rank 1 expects 2 elements from rank 2, which sends it 3"),
            (4, "rank 1 expects 3 elements from rank 0, which sends it 4"),
        ] {
            assert!(errors[k].contains(want), "{rank}: {}", errors[k]);
        }
    }
}

/// Values of `CHORUS_ALGO` written differently with the same effect agree.
#[test]
fn schedule_settings_that_mean_the_same_agree() {
    let specs = ["ring", " Ring ;", "RING"];
    let out = three_ranks(
        |rank, cfg| cfg.algo = Some(specs[rank].to_string()),
        |_, c| {
            let mut c = c?;
            let mut v = [1.0f32; 3];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok::<_, chorus::CommError>(v)
        },
    );
    for (rank, r) in out.into_iter().enumerate() {
        assert_eq!(r.unwrap_or_else(|e| panic!("rank {rank}: {e}")), [3.0; 3]);
    }
}

/// Three ranks as threads of a fresh store, each configured by `tweak(rank, config)` (20 s
/// init timeout) and then given the outcome of `Communicator::new` in `f`: every rank's
/// result, in rank order.
fn three_ranks<R: Send>(
    tweak: impl Fn(usize, &mut chorus::Config) + Sync,
    f: impl Fn(usize, Result<Communicator, chorus::CommError>) -> R + Sync,
) -> Vec<R> {
    let server = store();
    let addr = server.local_addr();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let (tweak, f) = (&tweak, &f);
                s.spawn(move || {
                    let mut cfg = config(rank, 3, addr);
                    cfg.init_timeout = Duration::from_secs(20);
                    tweak(rank, &mut cfg);
                    f(rank, Communicator::new(cfg))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A rank that fails after it joined, in a way no check of the settings catches (here its
/// `CHORUS_HOSTID` is longer than the store takes a value), says so where the others wait
/// for its address: they fail at once, naming it, instead of waiting out their init timeout
/// (30 s here) with an error that names nobody.
#[test]
fn a_rank_that_fails_after_joining_is_named_to_the_others_at_once() {
    if is_child() {
        return report_init_as_child();
    }
    let start = Instant::now();
    let job = spawn_job_with(
        3,
        "a_rank_that_fails_after_joining_is_named_to_the_others_at_once",
        |rank| {
            let mut env = vec![("CHORUS_INIT_TIMEOUT", "30".to_string())];
            if rank == 1 {
                env.push(("CHORUS_HOSTID", "h".repeat(100_000)));
            }
            env
        },
    );
    let done = wait_job(job, Duration::from_secs(120));
    for (rank, (code, out)) in done.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank}:\n{out}");
        assert!(out.contains("INIT-ERROR"), "rank {rank}:\n{out}");
        assert!(out.contains("rank 1"), "rank {rank}:\n{out}");
        assert!(out.contains("limit"), "rank {rank}:\n{out}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

/// An abort asked for through the handle while no call runs makes the communicator report
/// itself unusable at once, and dropping it then tells the peers its reason (not only that
/// the connections closed).
#[test]
fn an_abort_asked_for_between_calls_reaches_the_peers_when_dropped() {
    let out = on_threads_owned(
        2,
        Duration::from_secs(60),
        |rank, addr| {
            let mut cfg = config_on(rank, 2, addr, "tcp");
            cfg.timeout = Duration::from_secs(20);
            cfg
        },
        |mut c| {
            c.barrier().unwrap();
            if c.rank() == 0 {
                assert!(c.is_usable());
                c.abort_handle().abort("the job gives up");
                assert!(!c.is_usable());
                drop(c);
                return String::new();
            }
            let mut v = vec![1.0f32; 4];
            let e = c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            e.to_string()
        },
    );
    assert!(out[1].contains("the job gives up"), "{}", out[1]);
}
