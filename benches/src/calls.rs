//! How each collective is called, fed and checked by the runner.
//!
//! Buffers follow nccl-tests: for allreduce, broadcast, reduce and sendrecv the size is one
//! rank's buffer (`count` elements); for allgather, reduce-scatter, alltoall, their v-variants
//! (equal blocks), gather and scatter (and theirs) it is the whole p-rank buffer, `count`
//! rounded down to a multiple of p, of which each rank contributes or receives a block of
//! `count/p`; for scan and exscan, one rank's buffer. Rooted collectives use root 0.
//!
//! Inputs are `reference::test_value(rank, index)` where `index` is the element's position in
//! the sending rank's buffer, so every expected element is known without gathering inputs.

use std::time::{Duration, Instant};

use chorus::{AllReduceOptions, CommError, Communicator, Element, ReduceOp};
use chorus_algorithms::reference::{expected, expected_prefix, is_correct, test_value};

use crate::collective::Collective;
use crate::data;

/// This rank's seconds per call of `iters` timed calls of `f`: back to back after one barrier
/// (and, with `settle` (`--settle`), a sleep of it), or, with a `gap` (`--gap`), each after a
/// sleep of the gap and a barrier, timed on its own.
pub fn seconds_per_call<E>(
    comm: &mut Communicator,
    iters: u64,
    gap: Option<Duration>,
    settle: Option<Duration>,
    mut f: impl FnMut(&mut Communicator) -> Result<(), E>,
) -> Result<f64, E>
where
    E: From<CommError>,
{
    let iters = iters.max(1);
    let Some(gap) = gap else {
        comm.barrier()?;
        if let Some(settle) = settle {
            std::thread::sleep(settle);
        }
        let start = Instant::now();
        for _ in 0..iters {
            f(comm)?;
        }
        return Ok(start.elapsed().as_secs_f64() / iters as f64);
    };
    let mut total = 0.0;
    for _ in 0..iters {
        std::thread::sleep(gap);
        comm.barrier()?;
        let start = Instant::now();
        f(comm)?;
        total += start.elapsed().as_secs_f64();
    }
    Ok(total / iters as f64)
}

/// The root of the rooted collectives.
pub const ROOT: usize = 0;

/// Which placements a collective has: (out of place, in place). Broadcast is in place only;
/// alltoallv, gather, scatter and sendrecv have separate buffers only.
pub fn placements(c: Collective) -> (bool, bool) {
    match c {
        Collective::Broadcast => (false, true),
        Collective::Gather
        | Collective::Scatter
        | Collective::GatherV
        | Collective::ScatterV
        | Collective::SendRecv
        | Collective::AllToAllV
        | Collective::Barrier => (true, false),
        _ => (true, true),
    }
}

/// Whether the size is the whole p-rank buffer (split into p blocks).
pub fn blocked(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllGather
            | Collective::ReduceScatter
            | Collective::AllToAll
            | Collective::AllGatherV
            | Collective::AllToAllV
            | Collective::Gather
            | Collective::Scatter
            | Collective::ReduceScatterV
            | Collective::GatherV
            | Collective::ScatterV
    )
}

/// The element count actually used for a requested `count` (a multiple of `ranks` for the
/// blocked collectives).
pub fn round_count(c: Collective, count: u64, ranks: usize) -> u64 {
    if c == Collective::Barrier {
        // No data: every size is the one row of size 0.
        0
    } else if blocked(c) {
        count / ranks as u64 * ranks as u64
    } else {
        count
    }
}

/// The counts the v-variants pass: `ranks` equal blocks of `buf_len / ranks` elements (made
/// once per size, outside the timed loop).
pub fn v_counts(buf_len: usize, ranks: usize) -> Vec<usize> {
    vec![buf_len / ranks.max(1); ranks]
}

/// One call of `coll` on `buf` (`count` elements as [`round_count`] gives) with input `send`
/// (`None`: in place); `counts` are the v-variants' ([`v_counts`]).
pub fn call<T: Element>(
    comm: &mut Communicator,
    coll: Collective,
    send: Option<&[T]>,
    buf: &mut [T],
    op: ReduceOp,
    opts: &AllReduceOptions,
    counts: &[usize],
) -> Result<(), CommError> {
    let (rank, p) = (comm.rank(), comm.size());
    let n = buf.len();
    let b = n / p;
    let root = (rank == ROOT).then_some(());
    match (coll, send) {
        (Collective::AllReduce, s) => comm.all_reduce_with(s, buf, op, opts),
        (Collective::Broadcast, _) => comm.broadcast(buf, ROOT),
        (Collective::Reduce, s) => comm.reduce(s, buf, op, ROOT),
        (Collective::AllGather, Some(s)) => comm.all_gather(&s[..b], buf),
        (Collective::AllGather, None) => comm.all_gather_in_place(buf),
        (Collective::ReduceScatter, Some(s)) => comm.reduce_scatter(s, &mut buf[..b], op),
        (Collective::ReduceScatter, None) => comm.reduce_scatter_in_place(buf, op),
        (Collective::AllToAll, Some(s)) => comm.all_to_all(s, buf),
        (Collective::AllToAll, None) => comm.all_to_all_in_place(buf),
        (Collective::AllGatherV, Some(s)) => comm.all_gather_v(&s[..b], buf, counts),
        (Collective::AllGatherV, None) => comm.all_gather_v_in_place(buf, counts),
        (Collective::AllToAllV, s) => {
            let s = s.expect("alltoallv runs out of place");
            comm.all_to_all_v(s, counts, buf, counts)
        }
        (Collective::Gather, s) => {
            let s = s.expect("gather runs out of place");
            comm.gather(&s[..b], root.map(|_| buf), ROOT)
        }
        (Collective::Scatter, s) => {
            let s = s.expect("scatter runs out of place");
            comm.scatter(root.map(|_| s), &mut buf[..b], ROOT)
        }
        (Collective::ReduceScatterV, Some(s)) => {
            comm.reduce_scatter_v(s, &mut buf[..b], counts, op)
        }
        (Collective::ReduceScatterV, None) => comm.reduce_scatter_v_in_place(buf, counts, op),
        (Collective::GatherV, s) => {
            let s = s.expect("gatherv runs out of place");
            comm.gather_v(&s[..b], root.map(|_| (buf, counts)), ROOT)
        }
        (Collective::ScatterV, s) => {
            let s = s.expect("scatterv runs out of place");
            comm.scatter_v(root.map(|_| (s, counts)), &mut buf[..b], ROOT)
        }
        (Collective::Scan, Some(s)) => comm.scan(s, buf, op),
        (Collective::Scan, None) => comm.scan_in_place(buf, op),
        (Collective::ExScan, Some(s)) => comm.exscan(s, buf, op),
        (Collective::ExScan, None) => comm.exscan_in_place(buf, op),
        (Collective::Barrier, _) => comm.barrier(),
        (Collective::SendRecv, s) => {
            let s = s.expect("sendrecv runs out of place");
            if p == 1 {
                buf.copy_from_slice(s);
                return Ok(());
            }
            comm.send_recv(s, (rank + 1) % p, buf, (rank + p - 1) % p)
        }
    }
}

/// Fill `buf` as the in-place input of `coll` on `rank`.
pub fn fill_in_place<T: Element>(
    coll: Collective,
    buf: &mut [T],
    rank: usize,
    ranks: usize,
    op: ReduceOp,
) {
    let b = buf.len() / ranks;
    match coll {
        Collective::Broadcast if rank != ROOT => data::poison(buf),
        Collective::AllGather | Collective::AllGatherV => {
            data::poison(buf);
            data::fill(&mut buf[rank * b..(rank + 1) * b], rank, op, ranks);
        }
        _ => data::fill(buf, rank, op, ranks),
    }
}

/// Wrong elements of this rank's result of `coll` (the part of `buf` the collective defines
/// on this rank; nothing off the root for reduce and gather), an out-of-place run's output
/// poisoned with `poison` (see [`data::poison_value_of`]).
pub fn count_wrong<T: Element>(
    coll: Collective,
    in_place: bool,
    buf: &[T],
    rank: usize,
    ranks: usize,
    op: ReduceOp,
    poison: T,
) -> u64 {
    let b = buf.len() / ranks;
    let input = |r: usize, i: usize| test_value::<T>(r, i, op, ranks);
    let wrong = |got: &[T], want: &dyn Fn(usize) -> T| -> u64 {
        got.iter()
            .enumerate()
            .filter(|&(i, &g)| !is_correct(g, want(i), op))
            .count() as u64
    };
    // What the collective leaves as it was: the poison of an out-of-place run, or this
    // rank's input in place (the runner fills the buffer so before the checked call).
    let untouched = |got: &[T], from: usize| -> u64 {
        if in_place {
            wrong(got, &|i| input(rank, from + i))
        } else {
            wrong(got, &|_| poison)
        }
    };
    match coll {
        Collective::AllReduce => data::count_wrong(buf, op, ranks),
        Collective::Broadcast => wrong(buf, &|i| input(ROOT, i)),
        Collective::Reduce if rank == ROOT => wrong(buf, &|i| expected(i, op, ranks)),
        Collective::Gather | Collective::GatherV if rank == ROOT => {
            wrong(buf, &|i| input(i / b, i % b))
        }
        // Not written off the root.
        Collective::Reduce | Collective::Gather | Collective::GatherV => untouched(buf, 0),
        Collective::Scan => wrong(buf, &|i| expected_prefix(i, op, rank + 1, ranks)),
        // Rank 0's output, which no rank precedes, is left as it was.
        Collective::ExScan if rank == 0 => untouched(buf, 0),
        Collective::ExScan => wrong(buf, &|i| expected_prefix(i, op, rank, ranks)),
        Collective::AllGather | Collective::AllGatherV => wrong(buf, &|i| input(i / b, i % b)),
        Collective::ReduceScatter | Collective::ReduceScatterV => {
            let own = if in_place { rank * b } else { 0 };
            let mine = wrong(&buf[own..own + b], &|i| expected(rank * b + i, op, ranks));
            // In place the other blocks keep the input; out of place only the first block
            // of the buffer is the output.
            mine + untouched(&buf[..own], 0) + untouched(&buf[own + b..], own + b)
        }
        Collective::AllToAll | Collective::AllToAllV => {
            wrong(buf, &|i| input(i / b, rank * b + i % b))
        }
        Collective::Scatter | Collective::ScatterV => {
            wrong(&buf[..b], &|i| input(ROOT, rank * b + i)) + untouched(&buf[b..], b)
        }
        Collective::SendRecv => wrong(buf, &|i| input((rank + ranks - 1) % ranks, i)),
        // Nothing to check but that it returned (a barrier that returned early is not seen).
        Collective::Barrier => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_to_blocks() {
        assert_eq!(round_count(Collective::AllGather, 10, 4), 8);
        assert_eq!(round_count(Collective::Broadcast, 10, 4), 10);
        assert_eq!(round_count(Collective::Scatter, 3, 4), 0);
        assert_eq!(placements(Collective::Broadcast), (false, true));
        assert_eq!(placements(Collective::AllReduce), (true, true));
    }

    /// The checks accept the right answer and catch a wrong one.
    #[test]
    fn checks_catch_errors() {
        let (ranks, op) = (3, ReduceOp::Sum);
        // This test's ranks and op, the output poisoned with the first poison.
        fn wrong<T: Element>(coll: Collective, in_place: bool, buf: &[T], rank: usize) -> u64 {
            count_wrong(
                coll,
                in_place,
                buf,
                rank,
                3,
                ReduceOp::Sum,
                data::poison_value(),
            )
        }
        let b = 5;
        // Allgather on rank 1: block j holds rank j's input.
        let mut got: Vec<f32> = (0..ranks * b)
            .map(|i| test_value(i / b, i % b, op, ranks))
            .collect();
        assert_eq!(wrong(Collective::AllGather, false, &got, 1), 0);
        got[7] += 1.0;
        assert_eq!(wrong(Collective::AllGather, false, &got, 1), 1);
        // Reduce-scatter in place on rank 2: block 2 holds the result, the others keep the
        // input.
        let rs = Collective::ReduceScatter;
        let mut buf: Vec<f32> = (0..ranks * b)
            .map(|i| test_value(2, i, op, ranks))
            .collect();
        for i in 0..b {
            buf[2 * b + i] = expected(2 * b + i, op, ranks);
        }
        assert_eq!(wrong(rs, true, &buf, 2), 0);
        buf[1] += 1.0; // written over outside its own block
        assert_eq!(wrong(rs, true, &buf, 2), 1);
        // Out of place: the first block is the output, the rest keeps the poison.
        let mut out = vec![data::poison_value::<f32>(); ranks * b];
        for (i, v) in out.iter_mut().enumerate().take(b) {
            *v = expected(2 * b + i, op, ranks);
        }
        assert_eq!(wrong(rs, false, &out, 2), 0);
        out[b] = 0.0;
        assert_eq!(wrong(rs, false, &out, 2), 1);
        // Exscan's rank 0 and reduce off the root are not written.
        assert_eq!(wrong(Collective::ExScan, false, &out[b..], 0), 1);
        let kept: Vec<f32> = (0..b).map(|i| test_value(1, i, op, ranks)).collect();
        assert_eq!(wrong(Collective::Reduce, true, &kept, 1), 0);
        // In-place allgather input: own block filled, the rest poisoned.
        let mut buf = vec![0i32; ranks * b];
        fill_in_place(Collective::AllGather, &mut buf, 1, ranks, op);
        assert_eq!(wrong(Collective::AllGather, true, &buf, 1), 2 * b as u64);
        // Scan on rank 1: the sum of ranks 0 and 1; exscan: rank 0's alone.
        let two: Vec<i64> = (0..b)
            .map(|i| test_value::<i64>(0, i, op, ranks) + test_value::<i64>(1, i, op, ranks))
            .collect();
        assert_eq!(wrong(Collective::Scan, false, &two, 1), 0);
        assert_eq!(wrong(Collective::ExScan, false, &two, 1), b as u64);
        let one: Vec<i64> = (0..b).map(|i| test_value::<i64>(0, i, op, ranks)).collect();
        assert_eq!(wrong(Collective::ExScan, false, &one, 1), 0);
    }
}
