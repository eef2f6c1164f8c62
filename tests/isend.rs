//! Point-to-point transfers that progress on their own ([`chorus::Queue::isend`] and
//! [`chorus::Queue::irecv`], as `MPI_Isend`/`MPI_Irecv`), ranks as threads over TCP loopback
//! and shared memory: patterns that deadlock when transfers run one batch at a time or at
//! `wait` (a ring of large sends before their receives; a receive posted before a send that
//! the peer answers only after receiving; a large send with a collective on another
//! communicator before its `wait`), exact data at sizes 0, 1, odd and large, order between two
//! ranks, transfers to itself, interplay with a peer's blocking calls, the refusal of calls
//! while transfers are live, and errors (a wrong length, a receive never sent) on every rank
//! within the timeout.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::{Communicator, ErrorKind, Queue, ReduceOp};

use common::*;

const WATCHDOG: Duration = Duration::from_secs(120);

/// Run `f` on `size` threads, each with its own communicator on `transport` (call timeout
/// `timeout`).
fn ranks<R: Send + 'static>(
    size: usize,
    transport: &'static str,
    timeout: Duration,
    f: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    on_threads_timed(size, transport, timeout, WATCHDOG, f)
}

/// The `k`-th message from `from` to `to`, of `n` elements.
fn msg(from: usize, to: usize, k: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (from as u32) << 24 ^ (to as u32) << 16 ^ (k as u32) << 12 ^ i as u32)
        .collect()
}

/// Every rank sends three messages of each size to each rank (itself included) before it
/// receives any; the receives are issued in an order unlike the sends', and waited in
/// reverse. Large messages exceed what the kernel buffers, so a send completes only while
/// its peer's receive is live.
#[test]
fn sends_before_receives_complete_in_any_order() {
    for transport in ["tcp", "shm"] {
        for p in [1usize, 2, 3, 5] {
            let out = ranks(p, transport, Duration::from_secs(60), move |c| {
                let q = Queue::new(c);
                let r = q.rank();
                let sizes = [0usize, 1, 1001, 1 << 20];
                let mut sends = Vec::new();
                for (s, &n) in sizes.iter().enumerate() {
                    for k in 0..3 {
                        for d in 0..p {
                            let to = (r + d) % p;
                            sends.push(q.isend(msg(r, to, 3 * s + k, n), to));
                        }
                    }
                }
                let mut recvs = Vec::new();
                for (s, &n) in sizes.iter().enumerate() {
                    for k in 0..3 {
                        for d in 0..p {
                            let from = (r + p - d) % p;
                            recvs.push((from, 3 * s + k, n, q.irecv(vec![0u32; n], from)));
                        }
                    }
                }
                let mut bad = Vec::new();
                for (from, k, n, req) in recvs.into_iter().rev() {
                    let got = req.wait().expect("irecv");
                    if got != msg(from, r, k, n) {
                        bad.push(format!("message {k} from {from} ({n} elements)"));
                    }
                }
                for s in sends {
                    s.wait().expect("isend");
                }
                assert_eq!(q.transfers(), 0);
                // Calls are accepted again once the transfers are done.
                let mut one = vec![1u32];
                q.run(|c| c.all_reduce(&mut one, ReduceOp::Sum)).unwrap();
                assert_eq!(one, [p as u32]);
                bad
            });
            for (r, bad) in out.iter().enumerate() {
                assert!(bad.is_empty(), "{transport} p={p} rank {r}: wrong {bad:?}");
            }
        }
    }
}

/// Rank 0 posts a receive, then a large send, and waits for the send first; rank 1 answers
/// the send, and only then sends what rank 0 receives. A transfer that waited for an
/// earlier one (transfers run one batch at a time) would deadlock here.
#[test]
fn a_send_does_not_wait_for_an_earlier_receive() {
    for transport in ["tcp", "shm"] {
        ranks(2, transport, Duration::from_secs(30), |c| {
            let q = Queue::new(c);
            let big = 4 << 20;
            if q.rank() == 0 {
                let r = q.irecv(vec![0u8; 5], 1);
                let s = q.isend(vec![7u8; big], 1);
                assert_eq!(s.wait().unwrap().len(), big);
                assert_eq!(r.wait().unwrap(), b"later");
            } else {
                let got = q.irecv(vec![0u8; big], 0).wait().unwrap();
                assert!(got.iter().all(|&b| b == 7));
                q.isend(b"later".to_vec(), 0).wait().unwrap();
            }
        });
    }
}

/// The torch backend's pattern: point-to-point messages on a duplicate of the communicator,
/// a collective on the original between a large `isend` and its `wait`, and a peer that makes
/// the collective before it receives. Transfers that waited for `wait` deadlock here.
#[test]
fn a_collective_between_isend_and_wait_on_another_communicator() {
    for transport in ["tcp", "shm"] {
        ranks(3, transport, Duration::from_secs(30), |mut c| {
            let q = Queue::new(c.dup().expect("dup"));
            let big = 4 << 20;
            let mut sum = vec![c.rank() as f64 + 1.0; 1000];
            match c.rank() {
                0 => {
                    let s = q.isend(vec![3i32; big / 4], 1);
                    c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                    s.wait().unwrap();
                }
                1 => {
                    c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                    let got = q.irecv(vec![0i32; big / 4], 0).wait().unwrap();
                    assert!(got.iter().all(|&x| x == 3));
                }
                _ => c.all_reduce(&mut sum, ReduceOp::Sum).unwrap(),
            }
            assert!(sum.iter().all(|&x| x == 6.0));
        });
    }
}

/// Transfers match a peer's blocking calls, in order, both ways.
#[test]
fn transfers_meet_a_peers_blocking_calls() {
    ranks(2, "tcp", Duration::from_secs(30), |mut c| {
        if c.rank() == 0 {
            let q = Queue::new(c);
            let a = q.isend(msg(0, 1, 0, 3000), 1);
            let b = q.isend(msg(0, 1, 1, 5), 1);
            let back = q.irecv(vec![0u32; 70_000], 1);
            assert_eq!(back.wait().unwrap(), msg(1, 0, 2, 70_000));
            a.wait().unwrap();
            b.wait().unwrap();
        } else {
            let mut x = vec![0u32; 3000];
            let mut y = vec![0u32; 5];
            c.recv(&mut x, 0).unwrap();
            c.recv(&mut y, 0).unwrap();
            assert_eq!((x, y), (msg(0, 1, 0, 3000), msg(0, 1, 1, 5)));
            c.send(&msg(1, 0, 2, 70_000), 0).unwrap();
        }
    });
}

/// While transfers are live, the queue refuses calls (the communicator stays usable); a
/// transfer to itself without its other half keeps them refused, and the half completes it.
#[test]
fn calls_are_refused_while_transfers_are_live() {
    ranks(2, "tcp", Duration::from_secs(30), |c| {
        let q = Queue::new(c);
        let r = q.rank();
        let mine = q.isend(vec![r as u8; 10], r);
        let e = q
            .all_reduce(vec![1.0f32], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(
            e.is_usable() && e.to_string().contains("isend/irecv"),
            "{e}"
        );
        let e = q.run(|c| c.barrier()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert_eq!(q.transfers(), 1);
        // The other half: a receive from itself (of another length first is a mismatch).
        assert_eq!(q.irecv(vec![0u8; 10], r).wait().unwrap(), vec![r as u8; 10]);
        mine.wait().unwrap();
        let bad = q.isend(vec![1u8; 4], r);
        let e = q.irecv(vec![0u8; 3], r).wait().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        assert_eq!(bad.wait().unwrap_err().kind(), ErrorKind::Mismatch);
        // The refusal follows the program's order, not the transfer's progress: a request not
        // yet waited for refuses calls even when its transfer is done (a small send to the
        // other rank completes as it is issued), and dropping the request gives it up.
        let other = 1 - r;
        let small = q.isend(vec![9u8; 4], other);
        let start = Instant::now();
        while q.transfers() > 0 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!((q.transfers(), q.transfer_requests()), (0, 1));
        let e = q.run(|c| c.barrier()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        drop(small);
        assert_eq!(q.transfer_requests(), 0);
        assert_eq!(q.irecv(vec![0u8; 4], other).wait().unwrap(), [9u8; 4]);
        // A peer outside the group is refused at once.
        let e = q.isend(vec![0u8; 1], 2).wait().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert_eq!(q.transfers(), 0);
        // Waiting for a transfer inside a blocking call on the queue (which holds the
        // communicator) is refused rather than waiting for itself.
        let e = q
            .run(|_| q.isend(vec![5u8; 2], r).wait().map(drop))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert_eq!(q.irecv(vec![0u8; 2], r).wait().unwrap(), [5, 5]);
        assert_eq!(q.transfers(), 0);
        q.all_reduce(vec![1.0f32], ReduceOp::Sum).wait().unwrap()
    });
}

/// A transfer's timeout counts from when it is posted, after the calls issued before it: two
/// collectives ahead of it that take most of the timeout each (a late peer: 2.5 s of 4) do
/// not make it fail before it was ever tried.
#[test]
fn a_transfer_queued_behind_calls_has_its_whole_timeout() {
    let out = ranks(2, "tcp", Duration::from_secs(4), |c| {
        let q = Queue::new(c);
        let n = 1 << 20; // 4 MiB: more than the kernel buffers, so the send needs its receive
        if q.rank() == 0 {
            let a = q.all_reduce(vec![1.0f32], ReduceOp::Sum);
            let b = q.all_reduce(vec![1.0f32], ReduceOp::Sum);
            let send = q.isend(vec![3u32; n], 1);
            let sent = send.wait().map(|v| v.len());
            (a.wait().map(|v| v[0]), b.wait().map(|v| v[0]), sent)
        } else {
            std::thread::sleep(Duration::from_millis(2500));
            let a = q.all_reduce(vec![1.0f32], ReduceOp::Sum).wait();
            std::thread::sleep(Duration::from_millis(2500));
            let b = q.all_reduce(vec![1.0f32], ReduceOp::Sum).wait();
            let got = q.irecv(vec![0u32; n], 0).wait();
            let ok = got.map(|v| v.iter().filter(|&&x| x == 3).count());
            (a.map(|v| v[0]), b.map(|v| v[0]), ok)
        }
    });
    for (rank, (a, b, t)) in out.into_iter().enumerate() {
        assert_eq!(a.unwrap(), 2.0, "rank {rank}");
        assert_eq!(b.unwrap(), 2.0, "rank {rank}");
        assert_eq!(t.unwrap(), 1 << 20, "rank {rank}");
    }
}

/// A collective refused on one rank only, for a transfer request it holds, uses up its place
/// in the order of calls: that rank's next collective of the same shape does not pair with
/// the others' refused one (which gave them its values as theirs, silently wrong); both fail
/// as a mismatch instead, within the timeout. With `check_calls`, the others fail in the
/// comparison, naming the refusal, when the refusing rank makes its next call, and the
/// communicator stays usable.
#[test]
fn a_collective_refused_on_one_rank_does_not_pair_with_its_next() {
    for check in [false, true] {
        let make = move |rank, addr| {
            let mut cfg = config_on(rank, 2, addr, "tcp");
            cfg.timeout = Duration::from_secs(20);
            cfg.check_calls = check;
            cfg
        };
        let out = on_threads_owned(2, WATCHDOG, make, |c| {
            let q = Queue::new(c);
            let start = Instant::now();
            let (a, b) = if q.rank() == 0 {
                // A send to itself, whose request is held until its receive.
                let send = q.isend(vec![7u8; 4], 0);
                let a = q.all_reduce(vec![1.0f32], ReduceOp::Sum).wait();
                assert_eq!(q.irecv(vec![0u8; 4], 0).wait().unwrap(), [7u8; 4]);
                send.wait().unwrap();
                (a, q.all_reduce(vec![100.0f32], ReduceOp::Sum).wait())
            } else {
                let a = q.all_reduce(vec![1.0f32], ReduceOp::Sum).wait();
                (a, q.all_reduce(vec![100.0f32], ReduceOp::Sum).wait())
            };
            (q.rank(), a, b, start.elapsed())
        });
        for (rank, a, b, took) in out {
            let what = format!("check_calls {check}, rank {rank}: {a:?} {b:?} {took:?}");
            // No sum of one rank's first allreduce with the other's second.
            for r in [&a, &b] {
                assert!(!matches!(r, Ok(v) if v[0] == 101.0), "{what}");
            }
            assert!(took < Duration::from_secs(15), "{what}");
            let a = a.as_ref().unwrap_err();
            if rank == 0 {
                assert_eq!(a.kind(), ErrorKind::InvalidUsage, "{what}");
                assert!(a.to_string().contains("isend/irecv"), "{what}");
            } else {
                // (Or rank 0's abort notice, where rank 0 saw the mismatch first.)
                assert!(
                    [ErrorKind::Mismatch, ErrorKind::Remote].contains(&a.kind()),
                    "{what}"
                );
            }
            if check {
                // The others learnt of the refusal in the comparison; the ranks stayed in
                // step, and the next allreduce pairs.
                assert!(a.is_usable(), "{what}");
                assert_eq!(b.as_ref().unwrap()[0], 200.0, "{what}");
            } else {
                // Rank 0's second call has a later place than rank 1's first: a mismatch
                // there, and the communicator broken on both.
                assert!(b.is_err(), "{what}");
            }
        }
    }
}

/// A refused collective's place is used up without waiting for the transfers the caller
/// holds: both ranks send 4 MiB (more than the kernel buffers, so each send needs the other's
/// receive), make a collective that is refused, then receive. The receives are not held back
/// behind the refusal, the exchange completes, and the next collective, refused alike on
/// both, pairs.
#[test]
fn a_refused_collective_does_not_hold_back_later_transfers() {
    for transport in ["tcp", "shm"] {
        let out = ranks(2, transport, Duration::from_secs(20), |c| {
            let q = Queue::new(c);
            let (me, other) = (q.rank(), 1 - q.rank());
            let n = 1 << 20;
            let start = Instant::now();
            let send = q.isend(vec![me as u32; n], other);
            let refused = q.all_reduce(vec![1.0f32], ReduceOp::Sum).wait();
            let got = q.irecv(vec![0u32; n], other).wait();
            let sent = send.wait();
            let next = q.all_reduce(vec![1.0f32], ReduceOp::Sum).wait();
            (
                refused.map(drop),
                got,
                sent.map(drop),
                next,
                start.elapsed(),
            )
        });
        for (rank, (refused, got, sent, next, took)) in out.into_iter().enumerate() {
            let what = format!("{transport} rank {rank}: {took:?}");
            assert_eq!(
                refused.unwrap_err().kind(),
                ErrorKind::InvalidUsage,
                "{what}"
            );
            let got = got.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(got.iter().all(|&x| x == 1 - rank as u32), "{what}");
            sent.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(
                next.unwrap_or_else(|e| panic!("{what}: {e}")),
                [2.0],
                "{what}"
            );
            assert!(took < Duration::from_secs(10), "{what}");
        }
    }
}

/// A receive of the wrong length fails on the receiver as a mismatch, and the sender (whose
/// peer aborted) fails too, both well within the timeout.
#[test]
fn a_wrong_length_fails_both_ranks() {
    for transport in ["tcp", "shm"] {
        let out = ranks(2, transport, Duration::from_secs(20), |c| {
            let q = Queue::new(c);
            let start = Instant::now();
            let e = if q.rank() == 0 {
                let first = q.isend(vec![1u8; 100], 1).wait();
                first
                    .and_then(|_| q.irecv(vec![0u8; 1], 1).wait())
                    .unwrap_err()
            } else {
                q.irecv(vec![0u8; 64], 0).wait().unwrap_err()
            };
            (e.kind(), e.to_string(), start.elapsed())
        });
        assert_eq!(out[1].0, ErrorKind::Mismatch, "{}", out[1].1);
        assert!(
            out[1].1.contains("100") || out[1].1.contains("64"),
            "{}",
            out[1].1
        );
        for (r, (_, m, took)) in out.iter().enumerate() {
            assert!(
                *took < Duration::from_secs(10),
                "{transport} rank {r}: {took:?} {m}"
            );
        }
    }
}

/// A transfer to this rank itself without its other half times out like any other, and the
/// communicator stays usable (nothing went on the wire).
#[test]
fn an_unmatched_transfer_to_itself_times_out() {
    // The ranks meet before their collectives: each spent about a second on its timers, and
    // one running late on a busy machine must not make the other's barrier time out.
    let met = Arc::new(std::sync::Barrier::new(2));
    ranks(2, "tcp", Duration::from_millis(500), move |c| {
        let q = Queue::new(c);
        let start = Instant::now();
        let e = q.isend(vec![1u8; 4], q.rank()).wait().unwrap_err();
        let took = start.elapsed();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.is_usable(), "{e}");
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_secs(5),
            "{took:?}"
        );
        assert_eq!(q.transfers(), 0);
        // One nobody waits for times out too (the queue's thread fails it), and calls are
        // accepted again.
        drop(q.irecv(vec![0u8; 4], q.rank()));
        let start = Instant::now();
        while q.transfers() > 0 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(q.transfers(), 0, "the unmatched receive did not time out");
        met.wait();
        q.barrier().wait().unwrap();
        // A call that has finished is taken inside a blocking call on the queue (only a
        // request still running would wait for itself there).
        let done = q.all_reduce(vec![1i32], chorus::ReduceOp::Sum);
        let got = q.run(|_| done.wait()).unwrap();
        assert_eq!(got, [2]);
    });
}

/// A transfer to itself given up while the queue's thread sleeps (nothing happened for a
/// while) still times out: nothing else would wake that thread to fail it.
#[test]
fn a_given_up_transfer_to_itself_wakes_the_sleeping_worker() {
    let left = ranks(1, "tcp", Duration::from_millis(300), |c| {
        let q = Queue::new(c);
        q.barrier().wait().unwrap(); // the queue's thread runs, then sleeps
        std::thread::sleep(Duration::from_millis(600));
        drop(q.irecv(vec![0u8; 4], 0));
        let start = Instant::now();
        while q.transfers() > 0 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        q.transfers()
    });
    assert_eq!(
        left,
        [0],
        "the given-up receive from itself never timed out"
    );
}

/// A receive that nothing will match times out after the communicator's timeout, naming the
/// peer, and later transfers are refused (the communicator is unusable).
#[test]
fn an_unmatched_receive_times_out() {
    let given_up = Arc::new(AtomicBool::new(false));
    let out = ranks(2, "tcp", Duration::from_millis(600), move |c| {
        let q = Queue::new(c);
        if q.rank() == 0 {
            let start = Instant::now();
            let e = q.irecv(vec![0u8; 8], 1).wait().unwrap_err();
            let took = start.elapsed();
            let later = q.isend(vec![0u8; 8], 1).wait().unwrap_err();
            given_up.store(true, Ordering::SeqCst);
            Some((e.kind(), e.peer(), took, later.is_usable()))
        } else {
            // Keep the connection open until rank 0 has given up (bounded).
            let start = Instant::now();
            while !given_up.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(10));
            }
            None
        }
    });
    let (kind, peer, took, usable) = out[0].unwrap();
    assert_eq!((kind, peer, usable), (ErrorKind::Timeout, Some(1), false));
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(5),
        "{took:?}"
    );
}

/// Transfers waited for by several threads at once, and by none: a thread waiting for one
/// progresses all of them, the others wait their turn, and transfers nobody waits for
/// complete in the background.
#[test]
fn transfers_waited_from_several_threads_or_none() {
    ranks(3, "tcp", Duration::from_secs(30), |c| {
        let q = std::sync::Arc::new(Queue::new(c));
        let (r, p) = (q.rank(), q.size());
        let big = 1 << 20;
        let sends: Vec<_> = (1..p)
            .map(|d| q.isend(msg(r, (r + d) % p, 0, big), (r + d) % p))
            .collect();
        let waiters: Vec<_> = (1..p)
            .map(|d| {
                let from = (r + p - d) % p;
                let req = q.irecv(vec![0u32; big], from);
                std::thread::spawn(move || (from, req.wait().expect("irecv")))
            })
            .collect();
        for w in waiters {
            let (from, got) = w.join().expect("waiter");
            assert!(got == msg(from, r, 0, big), "from {from}");
        }
        // Nobody waits for these sends: they complete on their own (the requests are
        // dropped), and the queue's drop waits for them.
        drop(sends);
        let q = std::sync::Arc::try_unwrap(q).ok().expect("one owner");
        q.into_inner().barrier().unwrap();
    });
}

/// Transfers completed by polling `test` alone (as `MPI_Test` loops do), then collected.
#[test]
fn polling_test_completes_transfers() {
    for transport in ["tcp", "shm"] {
        ranks(2, transport, Duration::from_secs(30), |c| {
            let q = Queue::new(c);
            let (r, other) = (q.rank(), 1 - q.rank());
            let n = 1 << 20;
            let s = q.isend(msg(r, other, 0, n), other);
            let g = q.irecv(vec![0u32; n], other);
            let end = Instant::now() + Duration::from_secs(20);
            let mut polls = 0u64;
            while !(s.test() && g.test()) {
                assert!(Instant::now() < end, "not done after {polls} polls");
                polls += 1;
            }
            s.wait().unwrap();
            assert!(g.wait().unwrap() == msg(other, r, 0, n));
        });
    }
}

/// A transfer given up (its request dropped) is finished before a call issued after it, and
/// transfers issued after that call wait for it: here rank 1 sends what rank 0 receives only
/// after the allreduce, so a receive posted ahead of the allreduce would hold it until the
/// timeout.
#[test]
fn a_call_after_a_given_up_transfer_keeps_its_place() {
    ranks(2, "tcp", Duration::from_secs(20), |c| {
        let q = Queue::new(c);
        // More than the kernel buffers: the send is still live when the allreduce is issued.
        let big = 64 << 20;
        let start = Instant::now();
        if q.rank() == 0 {
            drop(q.isend(vec![1u8; big], 1));
            let sum = q.all_reduce(vec![1i32; 4], chorus::ReduceOp::Sum);
            let late = q.irecv(vec![0u8; 3], 1);
            assert_eq!(sum.wait().unwrap(), [2; 4]);
            assert_eq!(late.wait().unwrap(), [7u8; 3]);
        } else {
            std::thread::sleep(Duration::from_millis(300));
            assert!(q
                .irecv(vec![0u8; big], 0)
                .wait()
                .unwrap()
                .iter()
                .all(|&b| b == 1));
            let sum = q.all_reduce(vec![1i32; 4], chorus::ReduceOp::Sum);
            assert_eq!(sum.wait().unwrap(), [2; 4]);
            q.isend(vec![7u8; 3], 0).wait().unwrap();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    });
}

/// Four ranks as processes on two "hosts" (`CHORUS_HOSTID`): shared memory within a host, TCP
/// between them. Every rank sends 4 MiB to each other rank before receiving (the waits
/// progress both transports at once), and the exchange is exact.
#[test]
fn transfers_over_shared_memory_and_tcp_at_once() {
    if is_child() {
        let c = child_comm();
        let transport = c.transport_name();
        let q = Queue::new(c);
        let (r, p) = (q.rank(), q.size());
        let n = 1 << 20;
        let sends: Vec<_> = (1..p)
            .map(|d| q.isend(msg(r, (r + d) % p, 0, n), (r + d) % p))
            .collect();
        let recvs: Vec<_> = (1..p)
            .map(|d| {
                let from = (r + p - d) % p;
                (from, q.irecv(vec![0u32; n], from))
            })
            .collect();
        for (from, req) in recvs.into_iter().rev() {
            assert!(
                req.wait().expect("irecv") == msg(from, r, 0, n),
                "from {from}"
            );
        }
        for s in sends {
            s.wait().expect("isend");
        }
        println!("CHILD-OK rank {r} over {transport}");
        return;
    }
    let job = spawn_job_with(4, "transfers_over_shared_memory_and_tcp_at_once", |rank| {
        vec![
            ("CHORUS_HOSTID", format!("host-{}", rank / 2)),
            ("CHORUS_TRANSPORT", "auto".to_string()),
        ]
    });
    for (rank, (code, out)) in wait_job(job, Duration::from_secs(120)).iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(out.contains("CHILD-OK"), "rank {rank}:\n{out}");
        assert!(out.contains("over shm+tcp"), "rank {rank}:\n{out}");
    }
}

/// A send buffer whose `send_bytes` panics (a user's buffer type with a bug).
struct Exploding(Vec<u8>);

impl chorus::SendBuffer for Exploding {
    fn send_bytes(&self) -> &[u8] {
        panic!("exploding buffer (expected by the test)")
    }
    fn send_len(&self) -> usize {
        self.0.len()
    }
}

/// A buffer that panics when asked for its bytes fails its transfer (and the communicator,
/// aborted) instead of leaving its request waiting forever; the count of transfers comes
/// back to 0. To a peer and to itself.
#[test]
fn a_buffer_that_panics_fails_its_transfer() {
    ranks(2, "tcp", Duration::from_secs(30), |c| {
        let me = c.rank();
        let q = Queue::new(c);
        let peer = if me == 0 { 1 } else { me };
        let (to, send) = if me == 0 {
            (
                peer,
                q.isend_buffer(Exploding(vec![1; 8]), chorus::DType::Uint8, peer),
            )
        } else {
            // To itself: the receive is matched with the exploding send.
            let r = q.irecv(vec![0u8; 8], me);
            let s = q.isend_buffer(Exploding(vec![1; 8]), chorus::DType::Uint8, me);
            let e = r.wait().expect_err("matched with a panicking send");
            assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
            (me, s)
        };
        let Err(e) = send.wait() else {
            panic!("the send to {to} succeeded")
        };
        assert_eq!(e.kind(), ErrorKind::Internal, "to {to}: {e}");
        assert!(e.message().contains("panicked"), "{e}");
        assert!(!e.is_usable(), "{e}");
        assert_eq!(q.transfers(), 0);
        // Aborted: a later call fails at once.
        let e = q.barrier().wait().expect_err("an aborted communicator");
        assert!(!e.is_usable(), "{e}");
    });
}

/// An abort fails a transfer to itself that waits for its other half at once (through
/// `Queue::abort` or the communicator's abort handle), not at the timeout, and as unusable.
#[test]
fn an_abort_fails_a_transfer_to_itself_waiting_for_its_other_half() {
    for by_handle in [false, true] {
        ranks(2, "tcp", Duration::from_secs(60), move |c| {
            let me = c.rank();
            let q = Arc::new(Queue::new(c));
            let waiter = {
                let q = Arc::clone(&q);
                std::thread::spawn(move || {
                    let start = Instant::now();
                    let r = q.irecv(vec![0u8; 4], me).wait();
                    (r.err(), start.elapsed())
                })
            };
            // Whether or not the receive was issued yet, it must fail (issued after the
            // abort, it is refused at once).
            std::thread::sleep(Duration::from_millis(100));
            if by_handle {
                q.abort_handle().abort("the test aborts");
            } else {
                assert!(q.abort("the test aborts", Duration::from_secs(10)));
            }
            let (e, took) = waiter.join().expect("waiter");
            let e = e.expect("the receive failed");
            assert!(!e.is_usable(), "{e}");
            assert!(took < Duration::from_secs(20), "{took:?}: {e}");
            assert_eq!(q.transfers(), 0);
        });
    }
}

/// `Queue::abort` inside a blocking call on the same queue returns at once (the call holds
/// the communicator; it notices the abort when it next waits).
#[test]
fn abort_inside_run_returns_at_once() {
    ranks(2, "tcp", Duration::from_secs(60), |c| {
        let q = Queue::new(c);
        let start = Instant::now();
        let r = q.run(|c| {
            assert!(!q.abort("inside run", Duration::MAX));
            c.barrier()
        });
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{:?}",
            start.elapsed()
        );
        let e = r.expect_err("aborted");
        assert!(!e.is_usable(), "{e}");
    });
}

/// A send buffer that panics when dropped.
#[derive(Debug)]
struct DropBomb(Vec<u8>);

impl chorus::SendBuffer for DropBomb {
    fn send_bytes(&self) -> &[u8] {
        &self.0
    }
    fn send_len(&self) -> usize {
        self.0.len()
    }
}

impl Drop for DropBomb {
    fn drop(&mut self) {
        panic!("a buffer that panics when dropped (expected by the test)")
    }
}

/// A send buffer whose drop panics (after a failed send to this rank itself, which drops it)
/// leaves neither request without a result: both fail, the send saying its buffer panicked,
/// and the count of transfers comes back to 0.
#[test]
fn a_send_buffer_that_panics_when_dropped_leaves_no_receive_waiting() {
    ranks(1, "tcp", Duration::from_secs(30), |c| {
        let q = Queue::new(c);
        // Lengths differ: the pair fails as a mismatch, and the send's buffer is dropped.
        let r = q.irecv(vec![0u8; 4], 0);
        let issued = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            q.isend_buffer(DropBomb(vec![1; 8]), chorus::DType::Uint8, 0)
        }));
        let start = Instant::now();
        let got = r.wait_timeout(Duration::from_secs(10));
        assert!(
            start.elapsed() < Duration::from_secs(9),
            "the receive waited on"
        );
        let Ok(result) = got else {
            panic!("the receive has no result")
        };
        assert!(result.is_err(), "{result:?}");
        let s = issued.expect("the send was issued");
        let e = s.wait().expect_err("the send failed");
        assert!(e.message().contains("panicked when dropped"), "{e}");
        let t = Instant::now();
        while q.transfers() != 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(q.transfers(), 0);
    });
}

/// A transfer given up (its request detached) whose buffer panics when dropped after it
/// succeeds: the panic is said and caught; the communicator is not aborted for it.
#[test]
fn a_given_up_transfer_whose_buffer_panics_when_dropped_leaves_the_communicator() {
    ranks(1, "tcp", Duration::from_secs(30), |c| {
        let q = Queue::new(c);
        // To itself: the send waits for its receive, given up meanwhile.
        let s = q.isend_buffer(DropBomb(vec![3; 8]), chorus::DType::Uint8, 0);
        assert!(
            s.detach().is_none(),
            "the send finished before its receive was issued"
        );
        let got = q.irecv(vec![0u8; 8], 0).wait().expect("the receive");
        assert_eq!(got, vec![3u8; 8]);
        let t = Instant::now();
        while q.transfers() != 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(q.transfers(), 0);
        q.barrier()
            .wait()
            .expect("a call after it: the communicator goes on");
    });
}
