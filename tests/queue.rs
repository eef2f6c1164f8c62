//! Nonblocking collectives through [`chorus::Queue`], ranks as threads over TCP loopback and
//! shared memory: a mix of calls issued back to back, interleaved with blocking ones and
//! waited in reverse order, exact against the naive references; a call that cannot finish yet
//! (one rank has not issued it) leaves the issuer free; errors (a mismatch, a panic in a
//! call, a dead peer) reach every rank's requests within the timeout; dropping a queue waits
//! for its calls.

mod common;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use chorus::{CommError, ErrorKind, Queue, ReduceOp};

use common::*;

/// Run `f` on `size` threads, each with a queue over its own communicator on `transport`
/// (call timeout `timeout`); every rank's result, failing instead of hanging after `watchdog`.
fn queues<R: Send + 'static>(
    size: usize,
    transport: &'static str,
    timeout: Duration,
    watchdog: Duration,
    f: impl Fn(Queue) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    on_threads_timed(size, transport, timeout, watchdog, move |c| {
        f(Queue::new(c))
    })
}

/// Rank `r`'s element `i` of call `k` (integer-valued, so sums are exact in f64).
fn val(k: usize, r: usize, i: usize) -> f64 {
    ((k * 31 + r * 7 + i * 3) % 23) as f64 - 11.0
}

fn data(k: usize, r: usize, n: usize) -> Vec<f64> {
    (0..n).map(|i| val(k, r, i)).collect()
}

#[test]
fn mixed_calls_in_order_match_the_references() {
    for transport in ["tcp", "shm"] {
        for p in [1usize, 2, 3, 4, 5] {
            let got = queues(
                p,
                transport,
                Duration::from_secs(60),
                Duration::from_secs(120),
                move |q| {
                    let r = q.rank();
                    let sizes = [0usize, 1, 7, 100_003];
                    // Issue everything, blocking calls in between, then wait in reverse order.
                    let mut sums = Vec::new();
                    for (k, &n) in sizes.iter().enumerate() {
                        sums.push((k, n, q.all_reduce(data(k, r, n), ReduceOp::Sum)));
                    }
                    let root = p - 1;
                    let bcast = q.broadcast(
                        if r == root {
                            data(10, r, 1001)
                        } else {
                            vec![-1.0; 1001]
                        },
                        root,
                    );
                    let reduce = q.reduce(data(11, r, 513), ReduceOp::Max, 0);
                    // A blocking call waits for those before it, and runs before those after.
                    let mut blocking = data(12, r, 33);
                    q.run(|c| c.all_reduce(&mut blocking, ReduceOp::Sum))
                        .expect("blocking call");
                    let gather = q.all_gather(data(13, r, 5));
                    let scatter = q.reduce_scatter(data(14, r, 3 * p), ReduceOp::Sum);
                    let a2a = q.all_to_all(data(15, r, 2 * p));
                    let barrier = q.barrier();
                    let mut polls = 0;
                    while !barrier.test() && polls < 100_000 {
                        polls += 1;
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    barrier.wait().expect("barrier");
                    let mut bad = Vec::new();
                    let mut check = |what: &str, got: Vec<f64>, want: Vec<f64>| {
                        if got != want {
                            bad.push(format!("rank {r} p={p} {transport}: {what} wrong"));
                        }
                    };
                    check(
                        "all_to_all",
                        a2a.wait().expect("all_to_all"),
                        (0..p)
                            .flat_map(|j| data(15, j, 2 * p)[2 * r..2 * r + 2].to_vec())
                            .collect(),
                    );
                    check(
                        "reduce_scatter",
                        scatter.wait().expect("reduce_scatter"),
                        (3 * r..3 * r + 3)
                            .map(|i| (0..p).map(|j| val(14, j, i)).sum())
                            .collect(),
                    );
                    check(
                        "all_gather",
                        gather.wait().expect("all_gather"),
                        (0..p).flat_map(|j| data(13, j, 5)).collect(),
                    );
                    check(
                        "blocking all_reduce",
                        blocking,
                        (0..33)
                            .map(|i| (0..p).map(|j| val(12, j, i)).sum())
                            .collect(),
                    );
                    let reduced = reduce.wait().expect("reduce");
                    if r == 0 {
                        check(
                            "reduce",
                            reduced,
                            (0..513)
                                .map(|i| (0..p).map(|j| val(11, j, i)).fold(f64::MIN, f64::max))
                                .collect(),
                        );
                    }
                    check(
                        "broadcast",
                        bcast.wait().expect("broadcast"),
                        data(10, root, 1001),
                    );
                    while let Some((k, n, req)) = sums.pop() {
                        check(
                            &format!("all_reduce {n}"),
                            req.wait().expect("all_reduce"),
                            (0..n).map(|i| (0..p).map(|j| val(k, j, i)).sum()).collect(),
                        );
                    }
                    assert_eq!(q.pending(), 0);
                    // The communicator comes back usable.
                    let mut c = q.into_inner();
                    let mut one = [1u32];
                    c.all_reduce(&mut one, ReduceOp::Sum)
                        .expect("after into_inner");
                    if one[0] != p as u32 {
                        bad.push(format!(
                            "rank {r}: all_reduce after into_inner gave {}",
                            one[0]
                        ));
                    }
                    bad
                },
            );
            let bad: Vec<String> = got.into_iter().flatten().collect();
            assert!(bad.is_empty(), "{bad:#?}");
        }
    }
}

#[test]
fn the_issuer_is_free_while_a_call_cannot_finish() {
    // Rank 1 issues its allreduce only after rank 0 has seen its own still running: rank 0's
    // call cannot have finished then, and rank 0 got there without waiting for it.
    let (tx, rx) = mpsc::channel::<bool>();
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let got = queues(
        2,
        "tcp",
        Duration::from_secs(30),
        Duration::from_secs(60),
        move |q| {
            if q.rank() == 0 {
                let req = q.all_reduce(vec![1.0f32; 1 << 16], ReduceOp::Sum);
                let running = !req.test();
                let req = match req.wait_timeout(Duration::from_millis(50)) {
                    Ok(r) => panic!("finished before rank 1 issued its call: {r:?}"),
                    Err(req) => req,
                };
                tx.send(running).expect("rank 1 listens");
                req.wait().expect("all_reduce")[0]
            } else {
                let running = rx.lock().unwrap().recv().expect("rank 0 reports");
                assert!(running, "rank 0's call finished before rank 1 issued it");
                q.all_reduce(vec![1.0f32; 1 << 16], ReduceOp::Sum)
                    .wait()
                    .expect("all_reduce")[0]
            }
        },
    );
    assert_eq!(got, vec![2.0, 2.0]);
}

#[test]
fn a_mismatch_fails_every_rank_and_the_calls_after_it() {
    for transport in ["tcp", "shm"] {
        // A long call timeout: the errors must come from the mismatch, well before it.
        let got = queues(
            3,
            transport,
            Duration::from_secs(60),
            Duration::from_secs(90),
            |q| {
                let n = if q.rank() == 1 { 9 } else { 8 };
                let bad = q.all_reduce(vec![1i32; n], ReduceOp::Sum);
                let after = q.all_reduce(vec![1i32; 4], ReduceOp::Sum);
                let start = Instant::now();
                let (bad, after) = (bad.wait(), after.wait());
                (bad.map(|_| ()), after.map(|_| ()), start.elapsed())
            },
        );
        for (rank, (bad, after, took)) in got.into_iter().enumerate() {
            let e: CommError = bad.expect_err("a mismatched count must fail");
            assert!(
                matches!(e.kind(), ErrorKind::Mismatch | ErrorKind::Remote),
                "rank {rank} {transport}: {e}"
            );
            // The communicator is broken: the call issued after fails too.
            let e = after.expect_err("the call after a mismatch must fail");
            assert!(!e.is_usable(), "rank {rank} {transport}: {e}");
            assert!(
                took < Duration::from_secs(20),
                "rank {rank} waited {took:?}"
            );
        }
    }
}

#[test]
fn a_panic_in_a_call_is_an_error_and_aborts_for_everyone() {
    let got = queues(
        3,
        "tcp",
        Duration::from_secs(60),
        Duration::from_secs(90),
        |q| {
            let r = q.rank();
            let first = q.submit(move |c| {
                // Every rank past its init first: an abort that reaches a rank still in its
                // init fails the init instead (as it should, but not what is tested here).
                c.barrier()?;
                if r == 2 {
                    panic!("rank 2 fails on purpose");
                }
                let mut v = [1u8; 4];
                c.all_reduce(&mut v, ReduceOp::Sum).map(|()| v[0])
            });
            let start = Instant::now();
            (first.wait(), start.elapsed())
        },
    );
    for (rank, (res, took)) in got.into_iter().enumerate() {
        let e = res.expect_err("every rank's call fails");
        if rank == 2 {
            assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
            assert!(e.to_string().contains("on purpose"), "{e}");
        } else {
            // Told by rank 2's abort, not by their timeout.
            assert_eq!(e.kind(), ErrorKind::Remote, "rank {rank}: {e}");
        }
        assert!(
            took < Duration::from_secs(20),
            "rank {rank} waited {took:?}"
        );
    }
}

#[test]
fn a_panic_in_a_blocking_call_aborts_for_everyone() {
    let got = queues(
        3,
        "tcp",
        Duration::from_secs(60),
        Duration::from_secs(90),
        |q| {
            let r = q.rank();
            let start = Instant::now();
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                q.run(|c| {
                    // Every rank past its init first (as in the test above).
                    c.barrier()?;
                    if r == 0 {
                        panic!("rank 0 fails on purpose");
                    }
                    c.barrier()
                })
            }));
            let after = q.run(|c| c.barrier());
            let panicked = res.is_err();
            (
                panicked,
                res.ok().and_then(|r| r.err()),
                after.err(),
                start.elapsed(),
            )
        },
    );
    for (rank, (panicked, err, after, took)) in got.into_iter().enumerate() {
        if rank == 0 {
            assert!(panicked, "the panic goes on");
        } else {
            let e = err.expect("the barrier fails");
            assert_eq!(e.kind(), ErrorKind::Remote, "rank {rank}: {e}");
        }
        // The communicator was aborted: it refuses the next call, on rank 0 too.
        assert!(
            after.is_some(),
            "rank {rank}: a call after the panic succeeded"
        );
        assert!(
            took < Duration::from_secs(20),
            "rank {rank} waited {took:?}"
        );
    }
}

#[test]
fn a_call_that_waits_for_its_own_queue_fails_instead_of_hanging() {
    let got = queues(
        1,
        "tcp",
        Duration::from_secs(10),
        Duration::from_secs(60),
        |q| {
            let q = Arc::new(q);
            let inner = Arc::clone(&q);
            let waited = q.submit(move |_| {
                inner.wait_all();
                Ok(())
            });
            let e = waited.wait().expect_err("waiting on its own queue");
            assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
            assert!(e.to_string().contains("wait for itself"), "{e}");
            // A call that waits for a later request of its own queue.
            let (tx, rx) = mpsc::channel::<chorus::Request<()>>();
            let waiter = q.submit(move |_| rx.recv().expect("the later request").wait());
            tx.send(q.barrier()).expect("the waiting call listens");
            let e = waiter
                .wait()
                .expect_err("waiting on a later request of its own queue");
            assert!(e.to_string().contains("wait for itself"), "{e}");
            1
        },
    );
    assert_eq!(got, vec![1]);
    // A call holding the last reference to its queue ends it without joining itself.
    let got = queues(
        1,
        "tcp",
        Duration::from_secs(10),
        Duration::from_secs(60),
        |q| {
            let q = Arc::new(q);
            let last = Arc::clone(&q);
            let r = q.submit(move |c| {
                std::thread::sleep(Duration::from_millis(50));
                drop(last);
                let mut v = [1u8];
                c.all_reduce(&mut v, ReduceOp::Sum).map(|()| v[0])
            });
            drop(q);
            r.wait().expect("the call that dropped its queue")
        },
    );
    assert_eq!(got, vec![1]);
}

#[test]
fn dropping_a_queue_waits_for_its_calls() {
    let got = queues(
        4,
        "shm",
        Duration::from_secs(30),
        Duration::from_secs(60),
        |q| {
            let reqs: Vec<_> = (0..20)
                .map(|k| q.all_reduce(vec![k as u64; 1000], ReduceOp::Sum))
                .collect();
            drop(q);
            reqs.into_iter()
                .enumerate()
                .all(|(k, r)| r.test() && r.wait().expect("all_reduce") == vec![4 * k as u64; 1000])
        },
    );
    assert_eq!(got, vec![true; 4]);
}

#[test]
fn a_queue_is_shared_between_threads() {
    // Two threads of each rank issue on one queue, one after the other by a handshake, so the
    // order is the same on every rank.
    let got = queues(
        3,
        "tcp",
        Duration::from_secs(30),
        Duration::from_secs(60),
        |q| {
            let q = Arc::new(q);
            let (tx, rx) = mpsc::channel();
            let q2 = Arc::clone(&q);
            let other = std::thread::spawn(move || {
                let first = q2.all_reduce(vec![1u32; 10], ReduceOp::Sum);
                tx.send(()).unwrap();
                first.wait().expect("from the second thread")[0]
            });
            rx.recv().unwrap();
            let second = q
                .all_reduce(vec![2u32; 10], ReduceOp::Sum)
                .wait()
                .expect("second")[0];
            (other.join().unwrap(), second)
        },
    );
    assert_eq!(got, vec![(3, 6); 3]);
}

#[test]
fn an_abort_from_another_thread_ends_a_waiting_call() {
    for transport in ["tcp", "shm"] {
        // Rank 1 joins after 3 s; rank 0's main thread aborts at 0.5 s the call that its
        // queue's thread is waiting in; a blocking call after it is refused.
        let got = queues(
            2,
            transport,
            Duration::from_secs(60),
            Duration::from_secs(90),
            |q| {
                if q.rank() == 1 {
                    std::thread::sleep(Duration::from_secs(3));
                    // Rank 0 entered this barrier before it aborted, so the barrier may complete;
                    // then the next call meets the abort.
                    let e = match q.barrier().wait() {
                        Err(e) => e,
                        Ok(()) => q.barrier().wait().expect_err("rank 0 aborted"),
                    };
                    // Told by rank 0's notice (not by a closed connection).
                    assert!(e.to_string().contains("on purpose"), "{e}");
                    return (e.kind(), Duration::ZERO);
                }
                let waiting = q.barrier();
                std::thread::sleep(Duration::from_millis(500));
                let start = Instant::now();
                assert!(q.abort("on purpose", Duration::from_secs(10)));
                let e = waiting.wait().expect_err("the aborted barrier");
                assert!(e.to_string().contains("on purpose"), "{e}");
                let after = q.run(|c| c.barrier()).expect_err("a call after the abort");
                assert!(!after.is_usable());
                (e.kind(), start.elapsed())
            },
        );
        assert_eq!(
            got[1].0,
            ErrorKind::Remote,
            "{transport}: rank 1 learns of the abort"
        );
        assert_eq!(got[0].0, ErrorKind::InvalidUsage, "{transport}");
        assert!(
            got[0].1 < Duration::from_secs(2),
            "{transport}: took {:?}",
            got[0].1
        );
    }
}

/// A request given up (`detach`, as `MPI_Request_free`): a finished call's result comes back;
/// a call still queued goes on, and when it fails (here an argument error only the
/// communicator checks) the communicator is aborted, so that every rank hears of it at its
/// next call instead of waiting for a collective this rank skipped.
#[test]
fn a_failure_of_a_given_up_request_aborts_for_everyone() {
    // Ranks 1 and 2 join rank 0's barrier only once its bad call was given up.
    let given_up = Arc::new(std::sync::Barrier::new(3));
    let got = queues(
        3,
        "tcp",
        Duration::from_secs(30),
        Duration::from_secs(90),
        move |q| {
            let done = q.barrier();
            let start = Instant::now();
            while !done.test() && start.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let finished = done.detach();
            assert!(
                matches!(finished, Some(Ok(()))),
                "{:?}",
                finished.map(|r| r.err())
            );
            let start = Instant::now();
            let barrier = if q.rank() == 0 {
                // The barrier keeps the queue busy until the others join: the bad call is
                // still queued when its request is given up.
                let first = q.barrier();
                let bad = q.submit(|c| c.broadcast(&mut [1i32; 3], 99));
                let detached = bad.detach();
                given_up.wait();
                assert!(detached.is_none(), "the call ran before its barrier");
                first
                    .wait()
                    .expect("rank 0's barrier ends before the bad call runs");
                Ok(())
            } else {
                given_up.wait();
                // May already fail: an abort ends the peers' calls at once, even one that
                // still waits for a third rank.
                q.barrier().wait()
            };
            let next = barrier.and_then(|()| q.run(|c| c.barrier()));
            (next, start.elapsed())
        },
    );
    for (rank, (next, took)) in got.into_iter().enumerate() {
        let e = next.expect_err("a call after a failed given-up request must fail");
        assert!(!e.is_usable(), "rank {rank}: {e}");
        assert!(e.to_string().contains("given up"), "rank {rank}: {e}");
        assert!(
            took < Duration::from_secs(20),
            "rank {rank} waited {took:?}"
        );
    }
}

#[test]
fn a_waited_call_is_no_longer_pending() {
    // The worker hands a request its result before it lets go of the communicator; a waiter
    // that then asks how many calls are pending must not count the call it just waited for.
    let got = queues(
        2,
        "tcp",
        Duration::from_secs(30),
        Duration::from_secs(120),
        |q| {
            let mut late = 0;
            for _ in 0..300 {
                let req = q.all_reduce(vec![1u32; 4], ReduceOp::Sum);
                assert_eq!(req.wait().expect("all_reduce"), vec![2u32; 4]);
                if q.pending() != 0 {
                    late += 1;
                }
            }
            late
        },
    );
    assert_eq!(
        got,
        vec![0, 0],
        "calls still pending after their requests were waited for"
    );
}

#[test]
fn a_timeout_of_duration_max_means_no_limit() {
    // A caller's "wait for ever" (Duration::MAX) as the communicator's init and call
    // timeouts, a call's own timeout, and the limits of a queue's waits: none panics adding
    // it to the clock, and the calls work.
    for transport in ["tcp", "shm"] {
        let make = move |rank, addr| {
            let mut cfg = config_on(rank, 2, addr, transport);
            cfg.timeout = Duration::MAX;
            cfg.init_timeout = Duration::MAX;
            cfg
        };
        let got = on_threads_owned(2, Duration::from_secs(60), make, |mut c| {
            let mut x = vec![c.rank() as f64 + 1.0; 5];
            let opts = chorus::AllReduceOptions {
                timeout: Some(Duration::MAX),
                ..Default::default()
            };
            c.all_reduce_with(None, &mut x, ReduceOp::Sum, &opts)
                .unwrap();
            let q = Queue::new(c);
            let r = q.all_reduce(x, ReduceOp::Sum);
            assert!(r.wait_done(Duration::MAX));
            r.wait().unwrap()
        });
        for y in got {
            assert_eq!(y, vec![6.0; 5], "{transport}");
        }
    }
}

/// Inside a blocking call on a queue (`Queue::run`), which holds the communicator: another
/// blocking call on that queue is refused (`run`: an error, `try_run`: `None`) instead of
/// deadlocking on the communicator's lock, and `wait_all` with a call pending panics with a
/// message instead of waiting forever for a call that needs the lock. (Before, the nested
/// `run` and the `wait_all` hung; the watchdog ends such a run.)
#[test]
fn nested_blocking_calls_on_one_queue_are_refused() {
    let out = queues(
        1,
        "tcp",
        Duration::from_secs(20),
        Duration::from_secs(60),
        |q| {
            let nested = q
                .run(|_| {
                    let inner = q.run(|c| c.barrier()).map(|()| "ran");
                    let tried = q.try_run(|c| c.barrier());
                    // Nothing pending: wait_all returns.
                    q.wait_all();
                    Ok((inner, tried.is_none()))
                })
                .expect("outer call");
            let e = nested.0.expect_err("nested run");
            assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
            assert!(nested.1, "try_run inside run ran");
            // The queue still works.
            q.run(|c| c.barrier()).expect("a call after the refusals");
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                q.run(|_| {
                    let pending = q.barrier();
                    q.wait_all();
                    drop(pending);
                    Ok(())
                })
            }));
            let payload = panicked.expect_err("wait_all with a pending call inside run");
            let text = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            assert!(text.contains("Queue::wait_all inside"), "{text}");
            e.to_string()
        },
    );
    assert!(
        out[0].contains("inside another on the same queue"),
        "{}",
        out[0]
    );
}

/// A request's waiter (what `chorus_waitany` sleeps on) stays usable after the request is
/// dropped, by another thread say: it returns once the call finishes.
#[test]
fn a_waiter_outlives_its_request() {
    let got = on_threads_owned(
        2,
        Duration::from_secs(60),
        |r, a| config_on(r, 2, a, "tcp"),
        |c| {
            let rank = c.rank();
            let q = Queue::new(c);
            if rank == 1 {
                // Joins late: rank 0's request is dropped while its call is still running.
                std::thread::sleep(Duration::from_millis(200));
            }
            let r = q.all_reduce(vec![rank as i64 + 1; 3], ReduceOp::Sum);
            let waiter = r.waiter();
            drop(r);
            let t = Instant::now();
            let mut done = false;
            while !done && t.elapsed() < Duration::from_secs(30) {
                done = waiter.wait_done(Duration::from_millis(50));
            }
            // The call went on without its request: the next one still lines up.
            let mut x = vec![rank as i64; 2];
            q.run(|c| c.all_reduce(&mut x, ReduceOp::Sum)).unwrap();
            (done, x)
        },
    );
    for (rank, (done, x)) in got.into_iter().enumerate() {
        assert!(done, "rank {rank}: the waiter never saw the call finish");
        assert_eq!(x, vec![1, 1], "rank {rank}");
    }
}

/// A transfer's wait with a time limit keeps to it while another thread's blocking call
/// (`Queue::run`) holds the communicator: it neither blocks until that call ends nor keeps the
/// transfer from completing afterwards.
#[test]
fn a_timed_transfer_wait_keeps_its_limit_beside_a_blocking_call() {
    let got = queues(
        2,
        "tcp",
        Duration::from_secs(60),
        Duration::from_secs(60),
        |q| {
            if q.rank() == 1 {
                // Late to the barrier: rank 0's blocking call holds its communicator meanwhile.
                std::thread::sleep(Duration::from_millis(1500));
                q.run(|c| c.barrier()).unwrap();
                q.isend(vec![7.0f32; 4], 0).wait().unwrap();
                return (Duration::ZERO, vec![]);
            }
            std::thread::scope(|s| {
                let blocking = s.spawn(|| q.run(|c| c.barrier()));
                std::thread::sleep(Duration::from_millis(200));
                let r = q.irecv(vec![0.0f32; 4], 1);
                let t = Instant::now();
                let r = r
                    .wait_timeout(Duration::from_millis(100))
                    .expect_err("nothing was sent yet");
                let took = t.elapsed();
                blocking.join().unwrap().unwrap();
                (took, r.wait().unwrap())
            })
        },
    );
    let (took, buf) = &got[0];
    assert!(
        *took < Duration::from_millis(700),
        "a 100 ms wait took {took:?}"
    );
    assert_eq!(buf, &vec![7.0f32; 4]);
}
