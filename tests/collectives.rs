//! Every collective other than allreduce (scan and exscan included) over TCP loopback and
//! shared memory, ranks as threads: p in
//! {1,2,3,4,5,7,8} × counts {0, 1, 7, 100003} × every schedule (the automatic choice and each
//! schedule forced through `CHORUS_ALGO`), in place and out of place, roots first and last,
//! compared exactly with naive references built from `reference::test_value`. Every dtype ×
//! op on the small counts (automatic choice; the forced schedules take every op in f32 and
//! every dtype with sum); f32 sum (root 0) and i32 max (last root) on the large one, and a
//! middle root (i64 on 7 elements, f64 on the large count). One
//! communicator per (p, schedule set) serves all cases. Then mismatches across ranks: each
//! must give an error on every rank (in the call or the next one), never a hang.

mod common;

use std::time::Duration;

use chorus::{CommError, Communicator, DType, Element, ErrorKind, P2p, ReduceOp};
use chorus_algorithms::reference::{count_wrong, expected, is_correct, test_value};

use common::*;

const SMALL: [usize; 3] = [0, 1, 7];
const LARGE: usize = 100_003;

/// `CHORUS_ALGO` values: automatic choice, then every schedule of every collective.
const ALGOS: [Option<&str>; 3] = [
    None,
    Some(
        "broadcast:ring;reduce:ring;allgather:ring;reduce_scatter:ring;alltoall:pairwise;\
         scan:chain;exscan:chain",
    ),
    Some(
        "broadcast:tree;reduce:tree;allgather:recursive_doubling;reduce_scatter:recursive_halving;\
         alltoall:linear;scan:recursive_doubling;exscan:recursive_doubling",
    ),
];

/// Run `f` on `size` threads, each with a communicator built with `algo` and `timeout`;
/// returns every rank's result, panicking after `watchdog`.
fn group<R: Send + 'static>(
    size: usize,
    transport: &str,
    algo: Option<&str>,
    timeout: Duration,
    watchdog: Duration,
    f: impl Fn(&mut Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let algo = algo.map(str::to_string);
    let transport = transport.to_string();
    let make = move |rank, addr| {
        let mut cfg = config(rank, size, addr);
        cfg.algo = algo.clone();
        cfg.transport = Some(transport.clone());
        cfg.timeout = timeout;
        cfg
    };
    on_threads_cfg(size, watchdog, make, f)
}

/// Rank `r`'s input element `i`.
fn input<T: Element>(r: usize, i: usize, op: ReduceOp, p: usize) -> T {
    test_value(r, i, op, p)
}

fn poison<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_f64(-77.0); n]
}

fn inputs<T: Element>(r: usize, n: usize, op: ReduceOp, p: usize) -> Vec<T> {
    (0..n).map(|i| input(r, i, op, p)).collect()
}

/// Collects failures of one rank.
struct Checker {
    bad: Vec<String>,
    rank: usize,
    size: usize,
}

impl Checker {
    fn ok(&mut self, what: &str, r: Result<(), CommError>) -> bool {
        match r {
            Ok(()) => true,
            Err(e) => panic!("rank {} p={}: {what}: {e}", self.rank, self.size),
        }
    }

    fn wrong(&mut self, what: String, wrong: usize) {
        if wrong > 0 {
            self.bad.push(format!(
                "rank {} p={} {what}: {wrong} wrong",
                self.rank, self.size
            ));
        }
    }
}

/// Every collective once for this type, op, count and root, both placements.
fn check_all<T: Element>(
    c: &mut Communicator,
    k: &mut Checker,
    n: usize,
    op: ReduceOp,
    root: usize,
) {
    let (r, p) = (c.rank(), c.size());
    let d = T::DTYPE.name();
    let tag = |coll: &str, inplace: bool| {
        format!(
            "{coll} {d} {} n={n} root={root} in_place={inplace}",
            op.name()
        )
    };
    let full = n * p;
    let mine: Vec<T> = inputs(r, n, op, p);

    // Broadcast (always in place).
    let mut b: Vec<T> = if r == root {
        inputs(root, n, op, p)
    } else {
        poison(n)
    };
    k.ok("broadcast", c.broadcast(&mut b, root));
    k.wrong(
        tag("broadcast", true),
        count_wrong(&b, &inputs(root, n, op, p), op),
    );

    // Reduce: the root gets the reduction; other ranks' buffers are untouched.
    let want: Vec<T> = (0..n).map(|i| expected(i, op, p)).collect();
    let mut out = poison::<T>(n);
    k.ok("reduce", c.reduce(Some(&mine), &mut out, op, root));
    let w = if r == root {
        count_wrong(&out, &want, op)
    } else {
        count_wrong(&out, &poison(n), op)
    };
    k.wrong(tag("reduce", false), w);
    let mut buf = mine.clone();
    k.ok("reduce in place", c.reduce(None, &mut buf, op, root));
    let w = if r == root {
        count_wrong(&buf, &want, op)
    } else {
        count_wrong(&buf, &mine, op)
    };
    k.wrong(tag("reduce", true), w);

    // Allgather.
    let gathered: Vec<T> = (0..p).flat_map(|j| inputs::<T>(j, n, op, p)).collect();
    let mut out = poison::<T>(full);
    k.ok("all_gather", c.all_gather(&mine, &mut out));
    k.wrong(tag("all_gather", false), count_wrong(&out, &gathered, op));
    let mut buf = poison::<T>(full);
    buf[r * n..(r + 1) * n].copy_from_slice(&mine);
    k.ok("all_gather in place", c.all_gather_in_place(&mut buf));
    k.wrong(tag("all_gather", true), count_wrong(&buf, &gathered, op));

    // Reduce-scatter: rank r's input is p blocks; it gets block r of the reduction.
    let rs_in: Vec<T> = inputs(r, full, op, p);
    let rs_want: Vec<T> = (r * n..(r + 1) * n).map(|i| expected(i, op, p)).collect();
    let mut out = poison::<T>(n);
    k.ok("reduce_scatter", c.reduce_scatter(&rs_in, &mut out, op));
    k.wrong(
        tag("reduce_scatter", false),
        count_wrong(&out, &rs_want, op),
    );
    let mut buf = rs_in.clone();
    k.ok(
        "reduce_scatter in place",
        c.reduce_scatter_in_place(&mut buf, op),
    );
    let mut want_buf = rs_in.clone();
    want_buf[r * n..(r + 1) * n].copy_from_slice(&rs_want);
    k.wrong(
        tag("reduce_scatter", true),
        count_wrong(&buf, &want_buf, op),
    );

    // All-to-all: block j of rank r's input goes to block r of rank j.
    let a_in: Vec<T> = inputs(r, full, op, p);
    let a_want: Vec<T> = (0..p)
        .flat_map(|j| (0..n).map(move |i| input::<T>(j, r * n + i, op, p)))
        .collect();
    let mut out = poison::<T>(full);
    k.ok("all_to_all", c.all_to_all(&a_in, &mut out));
    k.wrong(tag("all_to_all", false), count_wrong(&out, &a_want, op));
    let mut buf = a_in.clone();
    k.ok("all_to_all in place", c.all_to_all_in_place(&mut buf));
    k.wrong(tag("all_to_all", true), count_wrong(&buf, &a_want, op));

    // Gather.
    let mut out = poison::<T>(full);
    let recv = (r == root).then_some(&mut out[..]);
    k.ok("gather", c.gather(&mine, recv, root));
    let w = if r == root {
        count_wrong(&out, &gathered, op)
    } else {
        count_wrong(&out, &poison(full), op)
    };
    k.wrong(tag("gather", false), w);

    // Scatter: block j of the root's buffer goes to rank j.
    let s_in: Vec<T> = inputs(root, full, op, p);
    let s_want: Vec<T> = s_in[r * n..(r + 1) * n].to_vec();
    let mut out = poison::<T>(n);
    let send = (r == root).then_some(&s_in[..]);
    k.ok("scatter", c.scatter(send, &mut out, root));
    k.wrong(tag("scatter", false), count_wrong(&out, &s_want, op));

    // Scan and exclusive scan (avg has no prefix meaning): the reduction of the inputs of
    // ranks 0..=r (0..r), in place too; rank 0's exscan output is left as it was.
    if op != ReduceOp::Avg {
        let prefix = |upto: usize| {
            let ins: Vec<Vec<T>> = (0..upto).map(|j| inputs::<T>(j, n, op, p)).collect();
            chorus_algorithms::reference::all_reduce(&ins, op)
        };
        let mut out = poison::<T>(n);
        k.ok("scan", c.scan(&mine, &mut out, op));
        k.wrong(tag("scan", false), count_wrong(&out, &prefix(r + 1), op));
        let mut buf = mine.clone();
        k.ok("scan in place", c.scan_in_place(&mut buf, op));
        k.wrong(tag("scan", true), count_wrong(&buf, &prefix(r + 1), op));
        let mut out = poison::<T>(n);
        k.ok("exscan", c.exscan(&mine, &mut out, op));
        let want = if r == 0 { poison::<T>(n) } else { prefix(r) };
        k.wrong(tag("exscan", false), count_wrong(&out, &want, op));
        let mut buf = mine.clone();
        k.ok("exscan in place", c.exscan_in_place(&mut buf, op));
        let want = if r == 0 { mine.clone() } else { prefix(r) };
        k.wrong(tag("exscan", true), count_wrong(&buf, &want, op));
    }

    // A batch: this rank's buffer to every rank (itself included) and its two halves to the
    // next rank, while receiving from every rank (posted in reverse order) and the halves
    // from the previous rank, all at once.
    {
        let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
        let half = n / 2;
        let mut all: Vec<Vec<T>> = (0..p).map(|_| poison(n)).collect();
        let (mut h1, mut h2) = (poison::<T>(half), poison::<T>(n - half));
        let mut ops: Vec<P2p<'_>> = (0..p).map(|j| P2p::send(&mine, j)).collect();
        ops.push(P2p::send(&mine[..half], next));
        ops.push(P2p::send(&mine[half..], next));
        ops.extend(
            all.iter_mut()
                .enumerate()
                .rev()
                .map(|(j, b)| P2p::recv(b, j)),
        );
        ops.push(P2p::recv(&mut h1, prev));
        ops.push(P2p::recv(&mut h2, prev));
        k.ok("p2p_batch", c.p2p_batch(&mut ops));
        drop(ops);
        let wrong: usize = all
            .iter()
            .enumerate()
            .map(|(j, b)| count_wrong(b, &inputs(j, n, op, p), op))
            .sum();
        k.wrong(tag("p2p_batch from all", false), wrong);
        h1.extend(h2);
        k.wrong(
            tag("p2p_batch halves", false),
            count_wrong(&h1, &inputs(prev, n, op, p), op),
        );
    }

    // Send/recv around the ring, interleaved with the collectives: rank 0 starts, each rank
    // forwards what it got, rank 0 gets its own buffer back.
    if p > 1 {
        let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
        let mut got = poison::<T>(n);
        if r == 0 {
            k.ok("send", c.send(&mine, next));
            k.ok("recv", c.recv(&mut got, prev));
        } else {
            k.ok("recv", c.recv(&mut got, prev));
            k.ok("send", c.send(&got, next));
        }
        k.wrong(
            tag("send/recv", false),
            count_wrong(&got, &inputs(0, n, op, p), op),
        );
        // Everyone at once: send to the next rank, receive from the previous one.
        let mut got = poison::<T>(n);
        k.ok("send_recv", c.send_recv(&mine, next, &mut got, prev));
        k.wrong(
            tag("send_recv", false),
            count_wrong(&got, &inputs(prev, n, op, p), op),
        );
        // A batch on rank 0 meets plain receives and sends on the others.
        let mut got = poison::<T>(n);
        if r == 0 {
            let mut ops = [P2p::send(&mine, next), P2p::recv(&mut got, prev)];
            k.ok("p2p_batch", c.p2p_batch(&mut ops));
        } else {
            k.ok("recv", c.recv(&mut got, prev));
            k.ok("send", c.send(&got, next));
        }
        k.wrong(
            tag("p2p_batch ring", false),
            count_wrong(&got, &inputs(0, n, op, p), op),
        );
    }
}

macro_rules! each_dtype {
    ($f:ident, $($arg:expr),*) => {
        for dt in DType::ALL {
            match dt {
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
        }
    };
}

/// One rank's whole sweep; returns its failures. `full`: every dtype × op on the small
/// counts with the last rank as root; otherwise every op in f32 and every dtype with `Sum`,
/// root 0. The large count runs f32 sum with root 0 and i32 max with the last rank as root;
/// a middle root (`size / 2`) gets i64 sum on 7 elements and f64 sum on the large count.
fn sweep(c: &mut Communicator, full: bool) -> Vec<String> {
    let (rank, size) = (c.rank(), c.size());
    let mut k = Checker {
        bad: Vec::new(),
        rank,
        size,
    };
    let small_root = if full { size - 1 } else { 0 };
    for n in SMALL {
        for op in ReduceOp::ALL {
            if full || op == ReduceOp::Sum {
                each_dtype!(check_all, c, &mut k, n, op, small_root);
            } else {
                check_all::<f32>(c, &mut k, n, op, small_root);
            }
        }
    }
    check_all::<f32>(c, &mut k, LARGE, ReduceOp::Sum, 0);
    check_all::<i32>(c, &mut k, LARGE, ReduceOp::Max, size - 1);
    // A root in the middle (trees and rings rotate around it): an odd count, and a large one.
    check_all::<i64>(c, &mut k, 7, ReduceOp::Sum, size / 2);
    check_all::<f64>(c, &mut k, LARGE, ReduceOp::Sum, size / 2);
    c.barrier().expect("barrier");
    k.bad
}

/// Every (forced or chosen) schedule set × p over `transport`; `full_auto`: the whole dtype ×
/// op matrix for the automatic choice.
fn sweep_transport(transport: &str, full_auto: bool) {
    for algo in ALGOS {
        for p in RANKS {
            let full = full_auto && algo.is_none();
            let bad: Vec<String> = group(
                p,
                transport,
                algo,
                Duration::from_secs(60),
                Duration::from_secs(300),
                move |c| sweep(c, full),
            )
            .into_iter()
            .flatten()
            .collect();
            assert!(
                bad.is_empty(),
                "{transport} CHORUS_ALGO={algo:?} p={p}: {} failures, first: {:?}",
                bad.len(),
                &bad[..bad.len().min(5)]
            );
        }
    }
}

#[test]
fn every_collective_every_schedule_over_tcp() {
    sweep_transport("tcp", true);
}

#[test]
fn every_collective_every_schedule_over_shm() {
    sweep_transport("shm", false);
}

/// The result of a call that may fail, then of a barrier: a mismatch must surface on every
/// rank in one of the two.
fn error_then_barrier(c: &mut Communicator, r: Result<(), CommError>) -> Option<ErrorKind> {
    match r {
        Err(e) => Some(e.kind()),
        Ok(()) => c.barrier().err().map(|e| e.kind()),
    }
}

/// Runs `call` on a fresh group of `p` and checks that every rank reports an error (in the
/// call or the barrier after it), at least one of them a mismatch.
fn expect_mismatch(p: usize, what: &str, call: fn(&mut Communicator) -> Result<(), CommError>) {
    expect_errors(p, what, ErrorKind::Mismatch, call)
}

/// [`expect_mismatch`] with another kind of error expected on some rank.
fn expect_errors(
    p: usize,
    what: &str,
    kind: ErrorKind,
    call: fn(&mut Communicator) -> Result<(), CommError>,
) {
    let kinds = group(
        p,
        "auto",
        None,
        Duration::from_secs(5),
        Duration::from_secs(120),
        move |c| {
            // A correct call first: the communicator works.
            let mut v = [c.rank() as i32];
            c.broadcast(&mut v, 0).expect("warm-up broadcast");
            let r = call(c);
            error_then_barrier(c, r)
        },
    );
    assert!(
        kinds.iter().all(Option::is_some),
        "{what}: some rank saw no error: {kinds:?}"
    );
    assert!(
        kinds.contains(&Some(kind)),
        "{what}: no rank reported {kind:?}: {kinds:?}"
    );
}

#[test]
fn mismatches_across_ranks_are_errors_on_every_rank() {
    expect_mismatch(3, "broadcast counts", |c| {
        let mut v = vec![1.0f32; 10 + c.rank()];
        c.broadcast(&mut v, 0)
    });
    expect_mismatch(4, "broadcast roots", |c| {
        let mut v = vec![1.0f32; 1000];
        let root = usize::from(c.rank() == 2);
        c.broadcast(&mut v, root)
    });
    expect_mismatch(3, "reduce dtypes", |c| {
        if c.rank() == 1 {
            let mut v = vec![1i32; 8];
            c.reduce(None, &mut v, ReduceOp::Sum, 0)
        } else {
            let mut v = vec![1.0f32; 8];
            c.reduce(None, &mut v, ReduceOp::Sum, 0)
        }
    });
    expect_mismatch(3, "reduce_scatter ops", |c| {
        let op = if c.rank() == 0 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        let mut v = vec![1.0f64; 9];
        c.reduce_scatter_in_place(&mut v, op)
    });
    expect_mismatch(4, "allgather counts", |c| {
        let n = if c.rank() == 3 { 5 } else { 4 };
        let mut out = vec![0u8; 4 * n];
        c.all_gather(&vec![1u8; n], &mut out)
    });
    // Two ranks both act as the root and wait for each other: nothing wrong arrives, so
    // this one is only seen at the timeout.
    expect_errors(3, "gather roots", ErrorKind::Timeout, |c| {
        let root = c.rank() % 2;
        let mut out = [0i64; 6];
        let recv = (c.rank() == root).then_some(&mut out[..]);
        c.gather(&[1i64, 2], recv, root)
    });
    expect_mismatch(3, "scatter counts", |c| {
        let n = 3 + usize::from(c.rank() == 2);
        let send = vec![1i32; 3 * n];
        let mut out = vec![0i32; n];
        c.scatter((c.rank() == 0).then_some(&send[..]), &mut out, 0)
    });
    expect_mismatch(2, "all_to_all against all_gather", |c| {
        let mut out = vec![0u32; 8];
        if c.rank() == 0 {
            c.all_to_all(&[1u32; 8], &mut out)
        } else {
            c.all_gather(&[1u32; 4], &mut out)
        }
    });
    expect_mismatch(3, "p2p_batch dtypes", |c| {
        // Rank 1 receives a float32 where rank 0 sends int32 of the same bytes.
        let (r, p) = (c.rank(), c.size());
        let (mut fi, mut ff) = ([0i32; 4], [0f32; 4]);
        let prev = (r + p - 1) % p;
        let mut ops = if r == 1 {
            vec![P2p::send(&[1i32; 4], (r + 1) % p), P2p::recv(&mut ff, prev)]
        } else {
            vec![P2p::send(&[1i32; 4], (r + 1) % p), P2p::recv(&mut fi, prev)]
        };
        c.p2p_batch(&mut ops)
    });
    expect_mismatch(2, "p2p_batch against a shorter recv", |c| {
        let mut b = [0u64; 3];
        if c.rank() == 0 {
            c.p2p_batch(&mut [P2p::send(&[1u64; 2], 1), P2p::send(&[1u64; 2], 1)])
        } else {
            c.recv(&mut b, 0)
        }
    });
    expect_mismatch(3, "scan against exscan", |c| {
        let mut out = [0i32; 4];
        if c.rank() == 1 {
            c.exscan(&[1i32; 4], &mut out, ReduceOp::Sum)
        } else {
            c.scan(&[1i32; 4], &mut out, ReduceOp::Sum)
        }
    });
    expect_mismatch(4, "scan counts", |c| {
        let n = if c.rank() == 2 { 5 } else { 4 };
        let mut buf = vec![1u64; n];
        c.scan_in_place(&mut buf, ReduceOp::Max)
    });
    expect_mismatch(2, "send/recv lengths", |c| {
        if c.rank() == 0 {
            c.send(&[1i32; 5], 1)
        } else {
            let mut b = [0i32; 4];
            c.recv(&mut b, 0)
        }
    });
}

/// A scan whose first rank has nothing to reduce while the others have elements: the chain
/// (p = 4 takes it at every size) sends even an empty segment, so rank 1 reports the
/// mismatch at once rather than waiting for segments that never come. Rank 0 sends nothing
/// after its scan, so the mismatch can only come from the scan itself.
#[test]
fn an_empty_scan_against_a_longer_one_is_a_mismatch() {
    let kinds = group(
        4,
        "auto",
        Some("scan:chain"),
        Duration::from_secs(20),
        Duration::from_secs(120),
        |c| {
            let n = if c.rank() == 0 { 0 } else { 8 };
            let mut buf = vec![1u32; n];
            let r = c.scan_in_place(&mut buf, ReduceOp::Sum);
            if c.rank() == 0 {
                // Keep the connections open while the others run into the mismatch.
                std::thread::sleep(Duration::from_secs(2));
            }
            r.err().map(|e| e.kind())
        },
    );
    assert_eq!(kinds[1], Some(ErrorKind::Mismatch), "{kinds:?}");
}

/// Bad arguments are reported on the calling rank before anything is sent, and leave the
/// communicator usable.
#[test]
fn bad_arguments_leave_the_communicator_usable() {
    let res = group(
        3,
        "auto",
        None,
        Duration::from_secs(30),
        Duration::from_secs(120),
        |c| {
            let r = c.rank();
            let mut errors = Vec::new();
            let mut b = vec![0.0f32; 6];
            errors.push(c.broadcast(&mut b, 3).unwrap_err());
            errors.push(
                c.reduce(Some(&[1.0f32; 5]), &mut b, ReduceOp::Sum, r)
                    .unwrap_err(),
            );
            errors.push(c.all_gather(&[1.0f32; 3], &mut b).unwrap_err());
            errors.push(
                c.reduce_scatter(&[1.0f32; 6], &mut b, ReduceOp::Sum)
                    .unwrap_err(),
            );
            errors.push(c.all_to_all(&[1.0f32; 4], &mut b[..4]).unwrap_err());
            errors.push(c.gather(&[1.0f32; 2], None, r).unwrap_err());
            errors.push(c.scatter(None, &mut b[..2], r).unwrap_err());
            errors.push(c.send(&b, r).unwrap_err());
            errors.push(c.recv(&mut b, 7).unwrap_err());
            errors.push(
                c.scan(&[1.0f32; 3], &mut b[..3], ReduceOp::Avg)
                    .unwrap_err(),
            );
            errors.push(
                c.exscan(&[1.0f32; 3], &mut b[..2], ReduceOp::Sum)
                    .unwrap_err(),
            );
            let (mut x, mut y) = ([0i32; 2], [0i32; 3]);
            let next = (r + 1) % 3;
            // Refused whole before anything moves: a peer out of range, a send to itself
            // without its receive, a receive from itself of another length, a partial element.
            for mut ops in [
                vec![P2p::send(&[1i32; 2], next), P2p::recv(&mut x, 3)],
                vec![P2p::send(&[1i32; 2], next), P2p::send(&[1i32; 2], r)],
                vec![P2p::send(&[1i32; 2], r), P2p::recv(&mut y, r)],
                vec![P2p::recv_raw(&mut [0u8; 3], DType::Float16, next)],
            ] {
                errors.push(c.p2p_batch(&mut ops).unwrap_err());
            }
            errors.push(
                c.broadcast_raw(&mut [0u8; 7], DType::Float32, 0)
                    .unwrap_err(),
            );
            for e in &errors {
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
                assert!(e.is_usable(), "{e}");
            }
            // Still usable: a real collective works.
            let mut v = vec![r as f32; 3];
            c.broadcast(&mut v, 1).unwrap();
            assert!(v.iter().all(|x| is_correct(*x, 1.0, ReduceOp::Sum)));
            errors.len()
        },
    );
    assert!(res.iter().all(|&n| n == 16));
}

/// A root that refuses its own arguments while the others' reduce goes out (their sends
/// complete without it) does not take that data as its next call's result: the next call
/// fails as a mismatch on the root, and the others learn of it (a later call fails).
#[test]
fn a_refusal_on_the_root_alone_does_not_shift_its_later_calls() {
    let res = group(
        2,
        "tcp",
        None,
        Duration::from_secs(20),
        Duration::from_secs(60),
        |c| {
            let r = c.rank();
            let first = if r == 0 {
                let mut short = [0i32; 2];
                c.reduce(Some(&[1i32; 3]), &mut short, ReduceOp::Sum, 0)
            } else {
                c.reduce(Some(&[1i32; 3]), &mut [], ReduceOp::Sum, 0)
            };
            let mut out = [0i32; 3];
            let second = c.reduce(Some(&[10 + r as i32; 3]), &mut out, ReduceOp::Sum, 0);
            let third = c.barrier();
            (
                r,
                first.map_err(|e| e.kind()),
                second.map(|()| out),
                third.is_ok(),
            )
        },
    );
    let (_, first, second, _) = &res[0];
    assert_eq!(*first, Err(ErrorKind::InvalidArgument), "{res:?}");
    assert!(
        second.is_err(),
        "the root returned {second:?} for its second call: {res:?}"
    );
    let (_, first, second, third) = &res[1];
    assert!(first.is_ok(), "{res:?}");
    assert!(second.is_err() || !third, "rank 1 never learned: {res:?}");
}

/// A reduce-scatter whose receive block is not a whole number of elements is refused on the
/// calling rank before anything is sent (with an even p, the send buffer can be whole while
/// its blocks are not), and the communicator stays usable.
#[test]
fn reduce_scatter_blocks_of_partial_elements_are_refused() {
    let res = group(
        2,
        "auto",
        None,
        Duration::from_secs(30),
        Duration::from_secs(60),
        |c| {
            let e = c
                .reduce_scatter_raw(
                    Some(&[0u8; 4]),
                    &mut [0u8; 2],
                    DType::Float32,
                    ReduceOp::Sum,
                )
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            assert!(e.to_string().contains("receive buffer"), "{e}");
            let mut out = [0.0f32; 1];
            c.reduce_scatter(&[1.0f32, 2.0], &mut out, ReduceOp::Sum)
                .unwrap();
            out[0]
        },
    );
    assert_eq!(res, [2.0, 4.0]);
}

/// Rank `r`'s count for rank `j` in the v-collectives' sweep (zeros included). Salt 3 makes
/// rank 1's block for rank 2 larger than the alltoall's all-at-once limit, so that in one call
/// ranks 1 and 2 run the exchange step by step and the others all at once.
fn v_count(r: usize, j: usize, salt: usize) -> usize {
    if salt == 3 && (r, j) == (1, 2) {
        return chorus_algorithms::collectives::alltoall::ALL_AT_ONCE_BYTES / 4 + 3;
    }
    (r + 2 * j + salt) % 4
}

/// Allgatherv, alltoallv, reduce-scatterv, gatherv and scatterv, out of place and (allgatherv,
/// reduce-scatterv) in place, over every transport and p ∈ {1, 2, 3, 4, 5, 7, 8}, with blocks
/// of different sizes (zero included, one large) and (reduce-scatterv) equal ones: exact.
#[test]
fn v_collectives_match_the_reference() {
    for transport in ["tcp", "shm"] {
        for p in [1usize, 2, 3, 4, 5, 7, 8] {
            let bad = group(
                p,
                transport,
                None,
                Duration::from_secs(30),
                Duration::from_secs(120),
                move |c| {
                    let (r, p) = (c.rank(), c.size());
                    let mut bad = Vec::new();
                    for salt in 0..4 {
                        // allgatherv: rank j contributes v_count(j, 0, salt) + j values.
                        let counts: Vec<usize> = (0..p).map(|j| v_count(j, 0, salt) + j).collect();
                        let mine: Vec<i32> = (0..counts[r]).map(|i| (r * 100 + i) as i32).collect();
                        let want: Vec<i32> = (0..p)
                            .flat_map(|j| (0..counts[j]).map(move |i| (j * 100 + i) as i32))
                            .collect();
                        let mut got = vec![-1i32; want.len()];
                        c.all_gather_v(&mine, &mut got, &counts).unwrap();
                        if got != want {
                            bad.push(format!("all_gather_v salt {salt}: {got:?}"));
                        }
                        // In place: this rank's block already in the output.
                        let at: usize = counts[..r].iter().sum();
                        let mut inplace = vec![-1i32; want.len()];
                        inplace[at..at + counts[r]].copy_from_slice(&mine);
                        c.all_gather_v_raw(
                            None,
                            bytemuck::cast_slice_mut(&mut inplace),
                            &counts,
                            None,
                            DType::Int32,
                        )
                        .unwrap();
                        if inplace != want {
                            bad.push(format!("all_gather_v in place salt {salt}"));
                        }
                        // alltoallv: rank r sends v_count(r, j) values to rank j.
                        let sc: Vec<usize> = (0..p).map(|j| v_count(r, j, salt)).collect();
                        let rc: Vec<usize> = (0..p).map(|j| v_count(j, r, salt)).collect();
                        let send: Vec<f32> = (0..p)
                            .flat_map(|j| (0..sc[j]).map(move |i| (r * 1000 + j * 10 + i) as f32))
                            .collect();
                        let want: Vec<f32> = (0..p)
                            .flat_map(|j| (0..rc[j]).map(move |i| (j * 1000 + r * 10 + i) as f32))
                            .collect();
                        let mut got = vec![-1.0f32; want.len()];
                        c.all_to_all_v(&send, &sc, &mut got, &rc).unwrap();
                        if got != want {
                            bad.push(format!("all_to_all_v salt {salt}: {got:?} want {want:?}"));
                        }
                        // gather_v and scatter_v: rank j's block has v_count(j, 2, salt) + j
                        // values (the first rank's 100 003 with salt 3); the root moves round.
                        let mut counts: Vec<usize> =
                            (0..p).map(|j| v_count(j, 2, salt) + j).collect();
                        if salt == 3 {
                            counts[0] = 100_003;
                        }
                        let root = (salt * 3 + 1) % p;
                        let block =
                            |j: usize| (0..counts[j]).map(move |i| (j * 1000 + i) as u16 as f32);
                        let mine: Vec<f32> = block(r).collect();
                        let all: Vec<f32> = (0..p).flat_map(block).collect();
                        let mut got = vec![-1.0f32; all.len()];
                        let recv = (r == root).then_some((&mut got[..], &counts[..]));
                        c.gather_v(&mine, recv, root).unwrap();
                        if r == root && got != all {
                            bad.push(format!("gather_v salt {salt} root {root}"));
                        }
                        let mut got = vec![-1.0f32; counts[r]];
                        let send = (r == root).then_some((&all[..], &counts[..]));
                        c.scatter_v(send, &mut got, root).unwrap();
                        if got != mine {
                            bad.push(format!("scatter_v salt {salt} root {root}: {got:?}"));
                        }
                        // reduce_scatter_v: block j has v_count(j, 1, salt) values (the last
                        // 100 003 with salt 3), then all 3 (equal blocks); rank r's value i of
                        // block j is (r + 1)(i + j + 1).
                        let mut uneven: Vec<usize> = (0..p).map(|j| v_count(j, 1, salt)).collect();
                        if salt == 3 {
                            uneven[p - 1] = 100_003; // one large block among small ones
                        }
                        for counts in [uneven, vec![3; p]] {
                            let at: usize = counts[..r].iter().sum();
                            let input: Vec<i64> = (0..p)
                                .flat_map(|j| {
                                    (0..counts[j]).map(move |i| ((r + 1) * (i + j + 1)) as i64)
                                })
                                .collect();
                            let sum = (p * (p + 1) / 2) as i64;
                            let want: Vec<i64> =
                                (0..counts[r]).map(|i| sum * (i + r + 1) as i64).collect();
                            let mut got = vec![-1i64; counts[r]];
                            c.reduce_scatter_v(&input, &mut got, &counts, ReduceOp::Sum)
                                .unwrap();
                            if got != want {
                                bad.push(format!(
                                    "reduce_scatter_v {counts:?}: {got:?} want {want:?}"
                                ));
                            }
                            let mut inplace = input.clone();
                            c.reduce_scatter_v_in_place(&mut inplace, &counts, ReduceOp::Sum)
                                .unwrap();
                            let mut want_all = input.clone();
                            want_all[at..at + counts[r]].copy_from_slice(&want);
                            if inplace != want_all {
                                bad.push(format!("reduce_scatter_v in place {counts:?}"));
                            }
                            // Avg in f64: the sum divided by p once.
                            let input: Vec<f64> = input.iter().map(|&v| v as f64).collect();
                            let mut got = vec![-1.0f64; counts[r]];
                            c.reduce_scatter_v(&input, &mut got, &counts, ReduceOp::Avg)
                                .unwrap();
                            let want: Vec<f64> =
                                want.iter().map(|&v| v as f64 / p as f64).collect();
                            if got != want {
                                bad.push(format!("reduce_scatter_v avg {counts:?}: {got:?}"));
                            }
                        }
                    }
                    bad
                },
            );
            let bad: Vec<String> = bad.into_iter().flatten().collect();
            assert!(bad.is_empty(), "{transport} p={p}: {bad:#?}");
        }
    }
}

#[test]
fn v_collectives_that_disagree_fail_everywhere() {
    expect_mismatch(3, "all_gather_v counts", |c| {
        // Rank 2 thinks rank 0 contributes 3 values, the others 2.
        let counts = [if c.rank() == 2 { 3 } else { 2 }, 2, 2];
        let mine = vec![1i32; counts[c.rank()]];
        let mut out = vec![0i32; counts.iter().sum()];
        c.all_gather_v(&mine, &mut out, &counts)
    });
    // Counts that differ only in how a group of blocks is split, with recursive doubling
    // allowed (p = 4), end to end: every rank fails. (Here the tag's fingerprint tells the
    // counts apart; the unit test `allgatherv_counts_that_collide_in_the_tag_still_fail`
    // takes a pair whose fingerprints collide.)
    let res = group(
        4,
        "tcp",
        Some("allgather:recursive_doubling"),
        Duration::from_secs(5),
        Duration::from_secs(60),
        |c| {
            let counts = if c.rank() < 2 {
                [2, 3, 1, 1]
            } else {
                [3, 2, 1, 1]
            };
            let mine = vec![c.rank() as i32; counts[c.rank()]];
            let mut out = vec![0i32; 7];
            let r = c.all_gather_v(&mine, &mut out, &counts);
            error_then_barrier(c, r)
        },
    );
    assert!(
        res.iter().all(Option::is_some),
        "a rank returned Ok: {res:?}"
    );
    assert!(res.contains(&Some(ErrorKind::Mismatch)), "{res:?}");
    expect_mismatch(3, "reduce_scatter_v counts", |c| {
        // Rank 0 thinks block 1 has 3 values, the others 2.
        let counts = [1usize, if c.rank() == 0 { 3 } else { 2 }, 4];
        let input = vec![1.0f32; counts.iter().sum()];
        let mut out = vec![0.0f32; counts[c.rank()]];
        c.reduce_scatter_v(&input, &mut out, &counts, ReduceOp::Sum)
    });
    expect_mismatch(3, "reduce_scatter_v ops", |c| {
        let op = if c.rank() == 2 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        let counts = [1usize, 2, 3];
        let input = vec![1i32; 6];
        let mut out = vec![0i32; counts[c.rank()]];
        c.reduce_scatter_v(&input, &mut out, &counts, op)
    });
    expect_mismatch(3, "gather_v counts", |c| {
        // Rank 2 sends 3 values where the root (1) expects 2.
        let mine = vec![1i64; if c.rank() == 2 { 3 } else { 2 }];
        let counts = [2usize, 2, 2];
        let mut out = [0i64; 6];
        let recv = (c.rank() == 1).then_some((&mut out[..], &counts[..]));
        c.gather_v(&mine, recv, 1)
    });
    expect_mismatch(3, "scatter_v counts", |c| {
        // Rank 0 expects 1 value where the root (2) sends it 2.
        let counts = [2usize, 1, 1];
        let send = [5u8; 4];
        let mut out = vec![0u8; if c.rank() == 0 { 1 } else { counts[c.rank()] }];
        let send = (c.rank() == 2).then_some((&send[..], &counts[..]));
        c.scatter_v(send, &mut out, 2)
    });
    expect_mismatch(3, "all_to_all_v counts", |c| {
        // Rank 1 expects 2 values from rank 0, which sends it 1.
        let r = c.rank();
        let sc = [1usize, 1, 1];
        let rc = if r == 1 { [2usize, 1, 1] } else { [1, 1, 1] };
        let send = vec![1u32; sc.iter().sum()];
        let mut out = vec![0u32; rc.iter().sum()];
        c.all_to_all_v(&send, &sc, &mut out, &rc)
    });
    // Local mistakes: refused on the calling rank, the communicator usable.
    let res = group(
        2,
        "auto",
        None,
        Duration::from_secs(30),
        Duration::from_secs(60),
        |c| {
            let mut out = [0i32; 4];
            let errors = [
                c.all_gather_v(&[1i32; 2], &mut out, &[2, 2, 0])
                    .unwrap_err(),
                c.all_gather_v(&[1i32; 2], &mut out, &[2, 1]).unwrap_err(),
                c.all_gather_v(&[1i32; 3], &mut out, &[2, 2]).unwrap_err(),
                c.all_to_all_v(&[1i32; 2], &[1, 1], &mut out, &[2, 2])
                    .unwrap_err(),
                c.all_to_all_v(&[1i32; 2], &[2, 0], &mut out[..2], &[0, 2])
                    .unwrap_err(),
                c.all_to_all_v(&[1i32; 2], &[usize::MAX, 1], &mut out, &[2, 2])
                    .unwrap_err(),
                c.reduce_scatter_v(&[1i32; 4], &mut out[..1], &[1, 2], ReduceOp::Sum)
                    .unwrap_err(),
                c.reduce_scatter_v(&[1i32; 3], &mut out[..2], &[2, 2], ReduceOp::Sum)
                    .unwrap_err(),
                c.reduce_scatter_v(&[1i32; 3], &mut out[..1], &[1, 2, 0], ReduceOp::Sum)
                    .unwrap_err(),
                c.reduce_scatter_v(&[1.0f32; 3], &mut [0.0; 1], &[1, 2], ReduceOp::BitOr)
                    .unwrap_err(),
                // Every rank is the root here, each with a mistake of its own.
                c.gather_v(&[1i32; 2], None, c.rank()).unwrap_err(),
                c.gather_v(&[1i32; 2], Some((&mut out[..3], &[2, 2])), c.rank())
                    .unwrap_err(),
                c.gather_v(&[1i32; 1], Some((&mut out, &[2, 2])), c.rank())
                    .unwrap_err(),
                c.scatter_v(Some((&[1i32; 4], &[2, 2])), &mut [0; 1], c.rank())
                    .unwrap_err(),
                c.scatter_v(None, &mut [0i32; 1], c.rank()).unwrap_err(),
                c.scatter_v(Some((&[1i32; 4], &[2, 2, 0])), &mut [0; 2], c.rank())
                    .unwrap_err(),
                c.gather_v(&[1i32; 2], None, 2).unwrap_err(),
                // Displacements: overlapping receive blocks, too few, beyond the buffer, and
                // beyond memory.
                c.all_gather_v_displaced(&[1i32; 2], &mut out, &[2, 2], &[0, 1])
                    .unwrap_err(),
                c.all_gather_v_displaced(&[1i32; 2], &mut out, &[2, 2], &[0])
                    .unwrap_err(),
                c.all_gather_v_displaced(&[1i32; 2], &mut out, &[2, 2], &[3, 0])
                    .unwrap_err(),
                c.all_to_all_v_displaced(&[1i32; 2], &[1, 1], &[0, 0], &mut out, &[1, 1], &[2, 2])
                    .unwrap_err(),
                c.all_to_all_v_displaced(&[1i32; 2], &[1, 1], &[0, 2], &mut out, &[1, 1], &[0, 1])
                    .unwrap_err(),
                c.gather_v_displaced(&[1i32; 2], Some((&mut out, &[2, 2], &[2, 1])), c.rank())
                    .unwrap_err(),
                c.scatter_v_displaced(Some((&[1i32; 4], &[2, 2], &[0, 3])), &mut [0; 2], c.rank())
                    .unwrap_err(),
                c.scatter_v_displaced(
                    Some((&[1i32; 4], &[2, 2], &[0, usize::MAX / 2])),
                    &mut [0; 2],
                    c.rank(),
                )
                .unwrap_err(),
            ];
            for e in &errors {
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
                assert!(e.is_usable(), "{e}");
            }
            c.all_gather_v(&[c.rank() as i32; 2], &mut out, &[2, 2])
                .unwrap();
            out
        },
    );
    assert_eq!(res, [[0, 0, 1, 1], [0, 0, 1, 1]]);
}

/// Displacements for `counts` in one of three layouts (`style` mod 3): the blocks in reverse
/// rank order with gaps of `gap` elements before each; back to back (MPI's displacements of
/// packed blocks); even ranks' blocks first, then odd ranks', back to back. Returns the
/// displacements and the buffer's length.
fn v_layout(counts: &[usize], style: usize, gap: usize) -> (Vec<usize>, usize) {
    let p = counts.len();
    let order: Vec<usize> = match style % 3 {
        0 => (0..p).rev().collect(),
        1 => (0..p).collect(),
        _ => (0..p).step_by(2).chain((1..p).step_by(2)).collect(),
    };
    let gap = if style % 3 == 0 { gap } else { 0 };
    let mut displs = vec![0; p];
    let mut at = 0;
    for j in order {
        at += gap;
        displs[j] = at;
        at += counts[j];
    }
    (displs, at + gap)
}

/// `len` values of `fill` with `block(j)` at `displs[j]` for every rank `j`.
fn placed<T: Copy>(
    len: usize,
    fill: T,
    displs: &[usize],
    block: impl Fn(usize) -> Vec<T>,
) -> Vec<T> {
    let mut out = vec![fill; len];
    for (j, &d) in displs.iter().enumerate() {
        let b = block(j);
        out[d..d + b.len()].copy_from_slice(&b);
    }
    out
}

/// The v-collectives with MPI's displacements: every rank lays out its buffers in its own way
/// (reversed with gaps, packed, or even ranks first), in place too (allgatherv), with equal
/// blocks under each allgather schedule (recursive doubling sends groups of blocks that lie
/// apart here) and uneven ones (zeros, one large); scatterv from overlapping blocks. The gaps
/// keep their values; over every transport and p ∈ {1, 2, 3, 4, 5, 7, 8}.
#[test]
fn v_collectives_with_displacements_match_the_reference() {
    for (transport, algo) in [
        ("tcp", None),
        ("shm", None),
        ("tcp", Some("allgather:recursive_doubling")),
        ("shm", Some("allgather:ring")),
    ] {
        for p in [1usize, 2, 3, 4, 5, 7, 8] {
            let bad = group(
                p,
                transport,
                algo,
                Duration::from_secs(30),
                Duration::from_secs(120),
                move |c| {
                    let (r, p) = (c.rank(), c.size());
                    let mut bad = Vec::new();
                    for salt in 0..4 {
                        let style = r + salt;
                        // allgatherv: equal blocks (salt 0), else uneven ones.
                        let counts: Vec<usize> = (0..p)
                            .map(|j| {
                                if salt == 0 {
                                    3
                                } else {
                                    v_count(j, 0, salt) + j
                                }
                            })
                            .collect();
                        let block =
                            |j: usize| (0..counts[j]).map(|i| (j * 100 + i) as i32).collect();
                        let (displs, len) = v_layout(&counts, style, r + 1);
                        let want = placed(len, -7i32, &displs, block);
                        let mut got = vec![-7i32; len];
                        // An empty block's displacement is ignored, as in MPI.
                        let wild: Vec<usize> = (0..p)
                            .map(|j| {
                                if counts[j] == 0 {
                                    usize::MAX
                                } else {
                                    displs[j]
                                }
                            })
                            .collect();
                        c.all_gather_v_displaced(&block(r), &mut got, &counts, &wild)
                            .unwrap();
                        if got != want {
                            bad.push(format!("all_gather_v {counts:?} at {displs:?}: {got:?}"));
                        }
                        let mut inplace = vec![-7i32; len];
                        inplace[displs[r]..displs[r] + counts[r]].copy_from_slice(&block(r));
                        c.all_gather_v_raw(
                            None,
                            bytemuck::cast_slice_mut(&mut inplace),
                            &counts,
                            Some(&displs),
                            DType::Int32,
                        )
                        .unwrap();
                        if inplace != want {
                            bad.push(format!("all_gather_v in place at {displs:?}: {inplace:?}"));
                        }
                        // alltoallv: rank r sends v_count(r, j) values to rank j; each side
                        // laid out its own way.
                        let sc: Vec<usize> = (0..p).map(|j| v_count(r, j, salt)).collect();
                        let rc: Vec<usize> = (0..p).map(|j| v_count(j, r, salt)).collect();
                        let (sd, slen) = v_layout(&sc, style + 1, 2);
                        let (rd, rlen) = v_layout(&rc, style + 2, 1);
                        let send = placed(slen, -9.0f32, &sd, |j| {
                            (0..sc[j]).map(|i| (r * 1000 + j * 10 + i) as f32).collect()
                        });
                        let want = placed(rlen, -7.0f32, &rd, |j| {
                            (0..rc[j]).map(|i| (j * 1000 + r * 10 + i) as f32).collect()
                        });
                        let mut got = vec![-7.0f32; rlen];
                        c.all_to_all_v_displaced(&send, &sc, &sd, &mut got, &rc, &rd)
                            .unwrap();
                        if got != want {
                            bad.push(format!("all_to_all_v at {sd:?} {rd:?}: {got:?}"));
                        }
                        // gatherv and scatterv: the root lays out the blocks.
                        let mut counts: Vec<usize> =
                            (0..p).map(|j| v_count(j, 2, salt) + j).collect();
                        if salt == 3 {
                            counts[0] = 100_003;
                        }
                        let root = (salt * 3 + 1) % p;
                        let block = |j: usize| -> Vec<f64> {
                            (0..counts[j]).map(|i| (j * 1000 + i) as f64).collect()
                        };
                        let (displs, len) = v_layout(&counts, salt, 2);
                        let all = placed(len, -7.0f64, &displs, block);
                        let mut got = vec![-7.0f64; len];
                        let recv = (r == root).then_some((&mut got[..], &counts[..], &displs[..]));
                        c.gather_v_displaced(&block(r), recv, root).unwrap();
                        if r == root && got != all {
                            bad.push(format!("gather_v at {displs:?} root {root}: {got:?}"));
                        }
                        let mut got = vec![-1.0f64; counts[r]];
                        let send = (r == root).then_some((&all[..], &counts[..], &displs[..]));
                        c.scatter_v_displaced(send, &mut got, root).unwrap();
                        if got != block(r) {
                            bad.push(format!("scatter_v at {displs:?} root {root}: {got:?}"));
                        }
                        // scatterv from overlapping blocks: rank j gets the first j + 1 values.
                        let source: Vec<u8> = (0..p as u8).collect();
                        let counts: Vec<usize> = (1..=p).collect();
                        let zeros = vec![0; p];
                        let mut got = vec![0u8; r + 1];
                        let send = (r == root).then_some((&source[..], &counts[..], &zeros[..]));
                        c.scatter_v_displaced(send, &mut got, root).unwrap();
                        if got != source[..=r] {
                            bad.push(format!("scatter_v overlapping: {got:?}"));
                        }
                    }
                    bad
                },
            );
            for (r, b) in bad.iter().enumerate() {
                assert!(b.is_empty(), "{transport} {algo:?} p={p} rank {r}: {b:?}");
            }
        }
    }
}

/// Random batches: a plan of messages between random pairs of ranks (a rank to itself too),
/// of random lengths (empty, small, and up to 560 KB, beyond the transports' buffers) and two
/// dtypes; each
/// rank posts its sends and receives as one batch, the two lists interleaved at random (each
/// in plan order). Every message arrives whole, in order, over TCP and shared memory.
#[test]
fn random_batches_deliver_every_message_in_order() {
    for transport in ["tcp", "shm"] {
        for p in [2usize, 3, 5] {
            let bad = group(
                p,
                transport,
                None,
                Duration::from_secs(30),
                Duration::from_secs(120),
                move |c| {
                    let r = c.rank();
                    let mut bad = Vec::new();
                    for round in 0..6u64 {
                        // The same plan on every rank: a small LCG seeded by the round.
                        let mut s = round.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ p as u64;
                        let mut next = |m: u64| {
                            s = s
                                .wrapping_mul(6_364_136_223_846_793_005)
                                .wrapping_add(1_442_695_040_888_963_407);
                            (s >> 33) % m
                        };
                        let lens = [0usize, 1, 7, 300, 70_000];
                        // (from, to, elements, float64?)
                        let plan: Vec<(usize, usize, usize, bool)> = (0..3 * p)
                            .map(|_| {
                                let from = next(p as u64) as usize;
                                let to = next(p as u64) as usize;
                                (from, to, lens[next(5) as usize], next(2) == 1)
                            })
                            .collect();
                        let bytes_of = |k: usize, n: usize, f64s: bool| -> Vec<u8> {
                            if f64s {
                                let v: Vec<f64> =
                                    (0..n).map(|i| (k * 100_000 + i) as f64).collect();
                                bytemuck::cast_slice(&v).to_vec()
                            } else {
                                let v: Vec<u32> =
                                    (0..n).map(|i| (k * 100_000 + i) as u32).collect();
                                bytemuck::cast_slice(&v).to_vec()
                            }
                        };
                        let dtype = |f64s: bool| if f64s { DType::Float64 } else { DType::Uint32 };
                        let sends: Vec<(usize, Vec<u8>, DType)> = plan
                            .iter()
                            .enumerate()
                            .filter(|(_, m)| m.0 == r)
                            .map(|(k, m)| (m.1, bytes_of(k, m.2, m.3), dtype(m.3)))
                            .collect();
                        let want: Vec<(usize, Vec<u8>, DType)> = plan
                            .iter()
                            .enumerate()
                            .filter(|(_, m)| m.1 == r)
                            .map(|(k, m)| (m.0, bytes_of(k, m.2, m.3), dtype(m.3)))
                            .collect();
                        let mut got: Vec<Vec<u8>> =
                            want.iter().map(|w| vec![0xAB; w.1.len()]).collect();
                        // Interleave the sends and the receives at random, each in plan order.
                        let mut ops: Vec<P2p<'_>> = Vec::new();
                        let mut sends_left = sends.iter();
                        let mut recvs_left = want.iter().zip(got.iter_mut());
                        let (mut ns, mut nr) = (sends.len(), want.len());
                        while ns + nr > 0 {
                            if nr == 0 || (ns > 0 && next(2) == 0) {
                                let (to, b, d) = sends_left.next().expect("a send");
                                ops.push(P2p::send_raw(b, *d, *to));
                                ns -= 1;
                            } else {
                                let ((from, _, d), buf) = recvs_left.next().expect("a receive");
                                ops.push(P2p::recv_raw(buf, *d, *from));
                                nr -= 1;
                            }
                        }
                        if let Err(e) = c.p2p_batch(&mut ops) {
                            bad.push(format!("round {round}: {e}"));
                            break;
                        }
                        drop(ops);
                        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                            if &w.1 != g {
                                bad.push(format!("round {round}: receive {i} from {}", w.0));
                            }
                        }
                    }
                    bad
                },
            );
            let bad: Vec<String> = bad.into_iter().flatten().collect();
            assert!(bad.is_empty(), "{transport} p={p}: {bad:#?}");
        }
    }
}

/// The chain's segments: scans and exclusive scans of about 5 MiB (over 64 segments of 64 KiB,
/// so the tag's step bits wrap), not a whole number of segments, in u8 (max) and f64 (sum), in
/// place and out of place, over TCP and shared memory.
#[test]
fn scans_of_many_segments_on_the_chain() {
    for transport in ["tcp", "shm"] {
        let bad = group(
            3,
            transport,
            Some("scan:chain;exscan:chain"),
            Duration::from_secs(60),
            Duration::from_secs(120),
            |c| {
                let r = c.rank();
                let mut bad = Vec::new();
                let v8 = |j: usize, i: usize| ((i * 7 + j * 13) % 251) as u8;
                let n8 = (5 << 20) + 3;
                let x: Vec<u8> = (0..n8).map(|i| v8(r, i)).collect();
                let upto = |k: usize| -> Vec<u8> {
                    (0..n8)
                        .map(|i| (0..k).map(|j| v8(j, i)).max().unwrap_or(0))
                        .collect()
                };
                let mut out = vec![0u8; n8];
                c.scan(&x, &mut out, ReduceOp::Max).unwrap();
                if out != upto(r + 1) {
                    bad.push("u8 scan".to_string());
                }
                let mut buf = x.clone();
                c.exscan_in_place(&mut buf, ReduceOp::Max).unwrap();
                if buf != if r == 0 { x.clone() } else { upto(r) } {
                    bad.push("u8 exscan in place".to_string());
                }
                let v64 = |j: usize, i: usize| ((i % 1000) + 3 * j) as f64;
                let n64 = 700_001;
                let x: Vec<f64> = (0..n64).map(|i| v64(r, i)).collect();
                let sum = |k: usize| -> Vec<f64> {
                    (0..n64).map(|i| (0..k).map(|j| v64(j, i)).sum()).collect()
                };
                let mut buf = x.clone();
                c.scan_in_place(&mut buf, ReduceOp::Sum).unwrap();
                if buf != sum(r + 1) {
                    bad.push("f64 scan in place".to_string());
                }
                let mut out = vec![-1.0f64; n64];
                c.exscan(&x, &mut out, ReduceOp::Sum).unwrap();
                if r > 0 && out != sum(r) {
                    bad.push("f64 exscan".to_string());
                }
                if r == 0 && out.iter().any(|&v| v != -1.0) {
                    bad.push("f64 exscan wrote rank 0's output".to_string());
                }
                bad
            },
        );
        let bad: Vec<String> = bad.into_iter().flatten().collect();
        assert!(bad.is_empty(), "{transport}: {bad:?}");
    }
}
