//! The conformance suite every [`Transport`] must pass, written once and run against each
//! backend (`run_all(&make_group)`). Ranks run as threads; every scenario is guarded by a
//! watchdog so a hang fails the test instead of stalling CI.
#![allow(missing_docs)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::{AbortNotice, Op, Request, Transport, TransportError, Wait};

/// Makes a connected group of `n` transports (index = rank).
pub type MakeGroup<'a> = &'a dyn Fn(usize) -> Vec<Box<dyn Transport>>;

const WATCHDOG: Duration = Duration::from_secs(60);
const T: Duration = Duration::from_secs(20);

/// Run `f(rank, transport)` on every rank of a fresh group of `n`, each on its own thread, and
/// collect the results (index = rank). Panics if a rank panics or the watchdog fires.
pub fn on_group<R: Send + 'static>(
    make: MakeGroup<'_>,
    n: usize,
    f: impl Fn(usize, &mut dyn Transport) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let group = make(n);
    assert_eq!(group.len(), n);
    let (tx, rx) = mpsc::channel();
    for (rank, mut t) in group.into_iter().enumerate() {
        assert_eq!(t.rank(), rank);
        assert_eq!(t.size(), n);
        let tx = tx.clone();
        let f = f.clone();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank, &mut *t)));
            let _ = tx.send((rank, r));
            // Keep the transport alive until the result is delivered.
            drop(t);
        });
    }
    drop(tx);
    let deadline = Instant::now() + WATCHDOG;
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(r))) => out[rank] = Some(r),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {rank} panicked: {msg}");
            }
            Err(_) => panic!("watchdog: a rank did not finish within {WATCHDOG:?}"),
        }
    }
    out.into_iter()
        .map(|r| r.expect("every rank reported"))
        .collect()
}

fn pattern(from: usize, to: usize, len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ (from * 31 + to * 7) as u8 ^ salt
        })
        .collect()
}

/// Every scenario.
pub fn run_all(make: MakeGroup<'_>) {
    ping_pong(make);
    ring_exchange_large(make);
    all_to_all(make);
    ordered_tags(make);
    nonblocking_and_partial(make);
    poll_ends_without_error(make);
    tag_mismatch(make);
    too_long_for_buffer(make);
    shorter_message(make);
    invalid_arguments(make);
    timeout(make);
    peer_closed(make);
    abort_propagates(make);
    abort_mid_message(make);
    abort_from_another_thread(make);
    waiting_for_the_callers_bytes(make);
}

pub fn ping_pong(make: MakeGroup<'_>) {
    for len in [0usize, 1, 1000, 3 << 20] {
        on_group(make, 2, move |rank, t| {
            let mut buf = vec![0u8; len];
            if rank == 0 {
                t.send(1, 5, &pattern(0, 1, len, 0), T).unwrap();
                let n = t.recv(1, 6, &mut buf, T).unwrap();
                assert_eq!(n, len);
                assert_eq!(buf, pattern(1, 0, len, 1));
            } else {
                let n = t.recv(0, 5, &mut buf, T).unwrap();
                assert_eq!(n, len);
                assert_eq!(buf, pattern(0, 1, len, 0));
                t.send(0, 6, &pattern(1, 0, len, 1), T).unwrap();
            }
        });
    }
}

/// Everyone sends 8 MiB right while receiving from the left: needs full-duplex progress.
pub fn ring_exchange_large(make: MakeGroup<'_>) {
    for n in [2usize, 3, 4] {
        on_group(make, n, move |rank, t| {
            let len = 8 << 20;
            let right = (rank + 1) % n;
            let left = (rank + n - 1) % n;
            let out = pattern(rank, right, len, 2);
            let mut inb = vec![0u8; len];
            let got = t.send_recv(right, 1, &out, left, 1, &mut inb, T).unwrap();
            assert_eq!(got, len);
            assert!(inb == pattern(left, rank, len, 2), "ring payload corrupted");
        });
    }
}

/// Every rank posts sends to and receives from every other rank at once.
pub fn all_to_all(make: MakeGroup<'_>) {
    let n = 4;
    on_group(make, n, move |rank, t| {
        let len = 1 << 20;
        let outs: Vec<Vec<u8>> = (0..n).map(|j| pattern(rank, j, len, 3)).collect();
        let mut ins: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; len]).collect();
        let mut sreq: Vec<Request> = (0..n).map(|j| Request::send(j, 9, len)).collect();
        let mut rreq: Vec<Request> = (0..n).map(|j| Request::recv(j, 9, len)).collect();
        for j in (0..n).filter(|&j| j != rank) {
            t.post(&mut sreq[j]).unwrap();
            t.post(&mut rreq[j]).unwrap();
        }
        let mut ops: Vec<Op> = Vec::new();
        for ((j, s), (r, ib)) in sreq
            .iter_mut()
            .enumerate()
            .zip(rreq.iter_mut().zip(ins.iter_mut()))
        {
            if j != rank {
                ops.push(Op::send(s, &outs[j]));
                ops.push(Op::recv(r, ib));
            }
        }
        t.wait_all(&mut ops, Instant::now() + T).unwrap();
        drop(ops);
        for (j, ib) in ins.iter().enumerate().filter(|&(j, _)| j != rank) {
            assert!(*ib == pattern(j, rank, len, 3), "from {j} corrupted");
        }
    });
}

/// Several messages to the same peer, posted together, arrive in order with their tags.
pub fn ordered_tags(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        let lens = [10usize, 0, 70_000, 3];
        if rank == 0 {
            let bufs: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| pattern(0, 1, l, k as u8))
                .collect();
            let mut reqs: Vec<Request> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| Request::send(1, 100 + k as u64, l))
                .collect();
            for r in reqs.iter_mut() {
                t.post(r).unwrap();
            }
            let mut ops: Vec<Op> = reqs
                .iter_mut()
                .zip(bufs.iter())
                .map(|(r, b)| Op::send(r, b))
                .collect();
            t.wait_all(&mut ops, Instant::now() + T).unwrap();
        } else {
            for (k, &l) in lens.iter().enumerate() {
                let mut b = vec![0u8; l];
                assert_eq!(t.recv(0, 100 + k as u64, &mut b, T).unwrap(), l);
                assert_eq!(b, pattern(0, 1, l, k as u8));
            }
        }
    });
}

/// Non-blocking progress returns at once; a send whose data becomes available piecewise
/// completes once all of it is available.
pub fn nonblocking_and_partial(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        let len = 300_000;
        if rank == 0 {
            let data = pattern(0, 1, len, 4);
            let mut req = Request::send_partial(1, 3, len, 0);
            t.post(&mut req).unwrap();
            for k in 1..=10 {
                req.set_available(len * k / 10);
                let done = t
                    .progress(&mut [Op::send(&mut req, &data)], Wait::No)
                    .unwrap();
                if k < 10 {
                    assert!(!done);
                }
            }
            t.wait_all(&mut [Op::send(&mut req, &data)], Instant::now() + T)
                .unwrap();
        } else {
            let mut b = vec![0u8; len];
            let mut req = Request::recv(0, 3, len);
            t.post(&mut req).unwrap();
            // Nothing may have arrived yet; Wait::No must not block.
            let _ = t
                .progress(&mut [Op::recv(&mut req, &mut b)], Wait::No)
                .unwrap();
            let mut last = 0;
            let deadline = Instant::now() + T;
            while !t
                .progress(&mut [Op::recv(&mut req, &mut b)], Wait::Until(deadline))
                .unwrap()
            {
                assert!(Instant::now() < deadline, "the receive did not complete");
                assert!(req.bytes_done() >= last);
                last = req.bytes_done();
                // The received prefix is valid while the rest is in flight.
                assert_eq!(b[..last], pattern(0, 1, len, 4)[..last]);
            }
            assert_eq!(b, pattern(0, 1, len, 4));
        }
    });
}

/// `Wait::Poll` returns `Ok(false)` at its instant when nothing moved (no timeout, the
/// transport stays usable), and a loop of polls completes a message sent later.
pub fn poll_ends_without_error(make: MakeGroup<'_>) {
    // Rank 1's polls that ended with nothing (usize::MAX once it is done or has failed):
    // rank 0 sends only after two, whatever the machine's load.
    let empty = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    on_group(make, 2, move |rank, t| {
        use std::sync::atomic::Ordering::SeqCst;
        struct MaxOnDrop(std::sync::Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for MaxOnDrop {
            fn drop(&mut self) {
                self.0.store(usize::MAX, SeqCst);
            }
        }
        let len = 100_000;
        if rank == 0 {
            let start = Instant::now();
            while empty.load(SeqCst) < 2 && start.elapsed() < T {
                std::thread::sleep(Duration::from_millis(5));
            }
            t.send(1, 9, &pattern(0, 1, len, 6), T).unwrap();
        } else {
            let _done = MaxOnDrop(empty.clone());
            let mut b = vec![0u8; len];
            let mut req = Request::recv(0, 9, len);
            t.post(&mut req).unwrap();
            let start = Instant::now();
            let slice = Duration::from_millis(50);
            let done = t
                .progress(&mut [Op::recv(&mut req, &mut b)], Wait::Poll(start + slice))
                .unwrap();
            let took = start.elapsed();
            assert!(!done && req.bytes_done() == 0, "nothing was sent yet");
            assert!(took >= slice && took < Duration::from_secs(5), "{took:?}");
            empty.store(1, SeqCst);
            let end = Instant::now() + T;
            let mut polls = 0;
            while !t
                .progress(
                    &mut [Op::recv(&mut req, &mut b)],
                    Wait::Poll(Instant::now() + slice),
                )
                .unwrap()
            {
                polls += 1;
                empty.store(1 + polls, SeqCst);
                assert!(Instant::now() < end, "the receive did not complete");
            }
            assert!(
                polls >= 1,
                "the first polls ended before the message was sent"
            );
            assert_eq!(b, pattern(0, 1, len, 6));
        }
    });
}

pub fn tag_mismatch(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        if rank == 0 {
            t.send(1, 1, b"abc", T).unwrap();
        } else {
            let mut b = [0u8; 3];
            match t.recv(0, 2, &mut b, T) {
                Err(TransportError::Mismatch {
                    peer: 0,
                    expected_tag: 2,
                    got_tag: 1,
                    ..
                }) => {}
                other => panic!("expected a tag mismatch, got {other:?}"),
            }
        }
    });
}

pub fn too_long_for_buffer(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        if rank == 0 {
            let _ = t.send(1, 1, &[7u8; 5000], T);
        } else {
            let mut b = [0u8; 100];
            match t.recv(1 - rank, 1, &mut b, T) {
                Err(TransportError::Mismatch {
                    peer: 0,
                    got_len: 5000,
                    expected_len: 100,
                    ..
                }) => {}
                other => panic!("expected a length mismatch, got {other:?}"),
            }
        }
    });
}

pub fn shorter_message(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        if rank == 0 {
            t.send(1, 1, &[7u8; 10], T).unwrap();
            t.send(1, 2, &[8u8; 4], T).unwrap();
        } else {
            let mut b = [0u8; 100];
            assert_eq!(t.recv(0, 1, &mut b, T).unwrap(), 10);
            assert_eq!(&b[..10], &[7u8; 10]);
            assert_eq!(t.recv(0, 2, &mut b, T).unwrap(), 4);
            assert_eq!(&b[..4], &[8u8; 4]);
        }
    });
}

pub fn invalid_arguments(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        let other = 1 - rank;
        let e = t.send(rank, 1, b"x", T).unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e}");
        let e = t.send(7, 1, b"x", T).unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e}");
        let mut r = Request::send(other, 1, 10);
        t.post(&mut r).unwrap();
        let e = t
            .progress(&mut [Op::send(&mut r, b"short")], Wait::No)
            .unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e}");
        assert!(e.is_recoverable());
        // Still usable: finish that request properly and exchange once more.
        t.wait_all(&mut [Op::send(&mut r, b"0123456789")], Instant::now() + T)
            .unwrap();
        let mut b = [0u8; 10];
        assert_eq!(t.recv(other, 1, &mut b, T).unwrap(), 10);
        assert_eq!(&b, b"0123456789");
    });
}

pub fn timeout(make: MakeGroup<'_>) {
    // Set by rank 1 when it is done (or has failed): until then rank 0 keeps its transport.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let res = on_group(make, 2, move |rank, t| {
        struct SetOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for SetOnDrop {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        if rank == 1 {
            let _done = SetOnDrop(done.clone());
            let mut b = [0u8; 4];
            let start = Instant::now();
            let e = t
                .recv(0, 1, &mut b, Duration::from_millis(300))
                .unwrap_err();
            let took = start.elapsed();
            assert!(
                matches!(e, TransportError::Timeout { peer: Some(0), .. }),
                "{e}"
            );
            assert!(
                took >= Duration::from_millis(300),
                "returned early: {took:?}"
            );
            // A timed-out transport refuses further use.
            assert!(t.send(0, 1, b"x", T).is_err());
        }
        // Rank 0 says nothing, and keeps its transport open until rank 1 is done (bounded:
        // rank 1's own waits are).
        if rank == 0 {
            let deadline = Instant::now() + T;
            while !done.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    });
    assert_eq!(res.len(), 2);
}

pub fn peer_closed(make: MakeGroup<'_>) {
    for n in [2usize, 3] {
        on_group(make, n, move |rank, t| {
            if rank == n - 1 {
                return; // drops its transport: connections close
            }
            let mut b = vec![0u8; 1 << 20];
            let e = t.recv(n - 1, 1, &mut b, T).unwrap_err();
            assert!(
                matches!(e, TransportError::PeerClosed { peer } if peer == n - 1),
                "rank {rank}: {e}"
            );
        });
    }
}

pub fn abort_propagates(make: MakeGroup<'_>) {
    on_group(make, 3, |rank, t| match rank {
        1 => {
            t.abort(&AbortNotice {
                culprit: Some(2),
                reason: "rank 2 is gone".into(),
            });
            assert!(t.send(0, 1, b"x", T).is_err());
            std::thread::sleep(Duration::from_millis(300));
        }
        0 => {
            let mut b = [0u8; 8];
            match t.recv(1, 1, &mut b, T) {
                Err(TransportError::PeerAborted {
                    peer: 1,
                    culprit: Some(2),
                    reason,
                }) => {
                    assert!(reason.contains("rank 2"), "{reason}")
                }
                other => panic!("expected an abort notice, got {other:?}"),
            }
        }
        _ => std::thread::sleep(Duration::from_millis(300)),
    });
}

/// An abort requested through the [`crate::AbortHandle`] from another thread while rank 0
/// waits in a receive that would otherwise wait for 20 s: the receive fails with
/// [`TransportError::Aborted`] within 2 s, and rank 1 learns of it from the notice.
pub fn abort_from_another_thread(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        let mut b = [0u8; 8];
        if rank == 0 {
            let handle = crate::AbortHandle::new();
            t.set_abort_handle(handle.clone());
            let asker = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                handle.request(AbortNotice {
                    culprit: None,
                    reason: "asked from another thread".into(),
                });
            });
            let start = Instant::now();
            let r = t.recv(1, 1, &mut b, T);
            asker.join().unwrap();
            assert!(matches!(r, Err(TransportError::Aborted(_))), "{r:?}");
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "{:?}",
                start.elapsed()
            );
            // Stay until rank 1 has read the notice.
            std::thread::sleep(Duration::from_millis(500));
        } else {
            match t.recv(0, 1, &mut b, T) {
                Err(TransportError::PeerAborted {
                    peer: 0, reason, ..
                }) => {
                    assert!(reason.contains("another thread"), "{reason}")
                }
                other => panic!("expected an abort notice, got {other:?}"),
            }
        }
    });
}

/// A blocking wait on a partial send whose available bytes have all gone out is refused at
/// once (only the caller can make more bytes available), not a spin until the deadline.
pub fn waiting_for_the_callers_bytes(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        if rank == 1 {
            return;
        }
        let len = 1000;
        let data = pattern(0, 1, len, 6);
        let mut req = Request::send_partial(1, 5, len, len / 2);
        t.post(&mut req).unwrap();
        let start = Instant::now();
        let r = t.wait_all(&mut [Op::send(&mut req, &data)], start + T);
        assert!(
            matches!(r, Err(TransportError::InvalidUsage(_))),
            "expected a refusal, got {r:?}"
        );
        assert!(
            start.elapsed() < T / 2,
            "refused after {:?}",
            start.elapsed()
        );
    });
}

/// A sender that aborts halfway through a message: the receiver fails with the notice and
/// never completes the receive with padding.
pub fn abort_mid_message(make: MakeGroup<'_>) {
    on_group(make, 2, |rank, t| {
        let len = 200_000;
        if rank == 0 {
            let data = pattern(0, 1, len, 5);
            let mut req = Request::send_partial(1, 4, len, len / 2);
            t.post(&mut req).unwrap();
            let deadline = Instant::now() + T;
            while req.bytes_done() < len / 2 {
                assert!(Instant::now() < deadline, "half the message was not sent");
                t.progress(&mut [Op::send(&mut req, &data)], Wait::No)
                    .unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
            t.abort(&AbortNotice {
                culprit: None,
                reason: "gave up".into(),
            });
            std::thread::sleep(Duration::from_millis(300));
        } else {
            let mut b = vec![0u8; len];
            match t.recv(0, 4, &mut b, T) {
                Err(TransportError::PeerAborted {
                    peer: 0, reason, ..
                }) => {
                    assert!(reason.contains("gave up"), "{reason}")
                }
                other => panic!("expected an abort, got {other:?}"),
            }
        }
    });
}
