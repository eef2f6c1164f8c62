"""One rank of the multi-process Python tests (started by test_multiprocess.py through
chorus-run). ``python _worker.py collectives|errors|compression|groups|nonblocking|fork``; prints ``ok <mode>`` on success,
raises (non-zero exit) on the first wrong result."""

import sys
import threading
import time

import numpy as np
import torch

import chorus

NP_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]
TORCH_DTYPES = {
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}
OPS = ["sum", "prod", "max", "min", "avg"]
N = 6  # elements per block


def inputs(rank, count):
    """1, 2 or 3: sums, products (3^4 = 81), maxima, minima and averages stay exact."""
    return 1 + (np.arange(count) + 2 * rank) % 3


def reduced(op, size, count, is_float):
    stack = np.stack([inputs(r, count) for r in range(size)]).astype(np.float64)
    if op == "sum":
        return stack.sum(0)
    if op == "prod":
        return stack.prod(0)
    if op == "max":
        return stack.max(0)
    if op == "min":
        return stack.min(0)
    s = stack.sum(0) / size
    return s if is_float else np.floor(s)


class Backend:
    """Makes and reads buffers of one kind (numpy arrays or torch tensors)."""

    def __init__(self, kind, dtype):
        self.kind, self.dtype = kind, dtype
        self.is_float = "float" in dtype

    def make(self, values):
        values = np.asarray(values, dtype=np.float64)
        if self.kind == "numpy":
            return values.astype(self.dtype)
        return torch.tensor(values, dtype=torch.float64).to(TORCH_DTYPES[self.dtype])

    def read(self, x):
        if self.kind == "numpy":
            return x.astype(np.float64)
        return x.to(torch.float64).numpy()


def check(what, got, want):
    if not np.array_equal(got, np.asarray(want, dtype=np.float64)):
        raise AssertionError(f"{what}: got {got}, want {want}")


def collectives(comm):
    p, me = comm.size, comm.rank
    root = p - 1
    cases = [("numpy", d) for d in NP_DTYPES] + [("torch", d) for d in TORCH_DTYPES]
    for kind, dt in cases:
        b = Backend(kind, dt)
        tag = f"{kind} {dt}"
        for op in OPS:
            for count in (0, 1, 1000):
                x = b.make(inputs(me, count))
                assert comm.allreduce(x, op=op) is x
                check(f"{tag} allreduce {op} n={count}", b.read(x), reduced(op, p, count, b.is_float))
        x = b.make(np.arange(N) + 1 if me == root else np.zeros(N))
        comm.broadcast(x, root=root)
        check(f"{tag} broadcast", b.read(x), np.arange(N) + 1)
        x = b.make(inputs(me, N))
        comm.reduce(x, root=0, op="max")
        if me == 0:
            check(f"{tag} reduce", b.read(x), reduced("max", p, N, b.is_float))
        x, out = b.make(np.arange(N) + me + 1), b.make(np.zeros(N * p))
        comm.allgather(x, out)
        want = np.concatenate([np.arange(N) + r + 1 for r in range(p)])
        check(f"{tag} allgather", b.read(out), want)
        x, out = b.make(inputs(me, N * p)), b.make(np.zeros(N))
        comm.reduce_scatter(x, out, op="sum")
        check(f"{tag} reduce_scatter", b.read(out), reduced("sum", p, N * p, b.is_float)[me * N:(me + 1) * N])
        x = b.make(np.concatenate([np.full(N, me * 10 + j) for j in range(p)]))
        out = b.make(np.zeros(N * p))
        comm.alltoall(x, out)
        check(f"{tag} alltoall", b.read(out), np.concatenate([np.full(N, j * 10 + me) for j in range(p)]))
        comm.alltoall(x, x)
        check(f"{tag} alltoall in place", b.read(x), np.concatenate([np.full(N, j * 10 + me) for j in range(p)]))
        x = b.make(np.arange(N) + me)
        out = b.make(np.zeros(N * p)) if me == root else None
        comm.gather(x, out, root=root)
        if me == root:
            check(f"{tag} gather", b.read(out), np.concatenate([np.arange(N) + r for r in range(p)]))
        x = b.make(np.arange(N * p)) if me == 0 else None
        out = b.make(np.zeros(N))
        comm.scatter(x, out, root=0)
        check(f"{tag} scatter", b.read(out), np.arange(N) + me * N)
        if p > 1:
            right, left = (me + 1) % p, (me - 1) % p
            x, got = b.make(np.full(N, me)), b.make(np.zeros(N))
            if me % 2 == 0:
                comm.send(x, right)
                comm.recv(got, left)
            else:
                comm.recv(got, left)
                comm.send(x, right)
            check(f"{tag} send/recv", b.read(got), np.full(N, left))
        # allgatherv and alltoallv, blocks of different sizes (zeros included).
        counts = [(j * 3 + 1) % 4 for j in range(p)]
        x, out = b.make(np.arange(counts[me]) + 10 * me), b.make(np.zeros(sum(counts)))
        assert comm.allgatherv(x, out, counts) is out
        want = np.concatenate([np.arange(c) + 10 * j for j, c in enumerate(counts)])
        check(f"{tag} allgatherv", b.read(out), want)
        sc = [(me + 2 * j) % 4 for j in range(p)]
        rc = [(j + 2 * me) % 4 for j in range(p)]
        x = b.make(np.concatenate([np.arange(c) + 30 * me + 3 * j for j, c in enumerate(sc)]))
        out = b.make(np.zeros(sum(rc)))
        assert comm.alltoallv(x, sc, out, rc) is out
        want = np.concatenate([np.arange(c) + 30 * j + 3 * me for j, c in enumerate(rc)])
        check(f"{tag} alltoallv", b.read(out), want)
        # The same with displacements: rank j's block in reverse rank order with a gap of 2
        # before each; the gaps keep their 99. Each rank lays out its own buffers.
        def reversed_layout(cs, gap):
            d, at = [0] * p, 0
            for j in reversed(range(p)):
                at += gap
                d[j] = at
                at += cs[j]
            return d, at + gap

        def placed(cs, d, n, block):
            buf = np.full(n, 99)
            for j, c in enumerate(cs):
                buf[d[j]:d[j] + c] = block(j)
            return buf

        counts = [(j * 3 + 1) % 4 for j in range(p)]
        d, n = reversed_layout(counts, 2 + me)
        x, out = b.make(np.arange(counts[me]) + 10 * me), b.make(np.full(n, 99))
        # An empty block's displacement is ignored, as in MPI.
        wild = [2**64 - 1 if c == 0 else at for c, at in zip(counts, d)]
        assert comm.allgatherv(x, out, counts, displs=wild) is out
        check(f"{tag} allgatherv displs", b.read(out), placed(counts, d, n, lambda j: np.arange(counts[j]) + 10 * j))
        sd = [0] * p  # every block read from the start: overlapping send blocks
        x = b.make(np.arange(4) + 30 * me)
        rd, n = reversed_layout(rc, 1)
        out = b.make(np.full(n, 99))
        req = comm.alltoallv(x, sc, out, rc, send_displs=sd, recv_displs=rd, async_op=True)
        assert req.wait() is out
        check(f"{tag} alltoallv displs", b.read(out), placed(rc, rd, n, lambda j: np.arange(rc[j]) + 30 * j))
        root = 0
        d, n = reversed_layout(counts, 1)
        x = b.make(np.arange(counts[me]) + 10 * me)
        out = b.make(np.full(n, 99)) if me == root else None
        comm.gatherv(x, out, counts if me == root else None, root=root, displs=d if me == root else None)
        if me == root:
            check(f"{tag} gatherv displs", b.read(out), placed(counts, d, n, lambda j: np.arange(counts[j]) + 10 * j))
        got = b.make(np.zeros(counts[me]))
        comm.scatterv(out, counts if me == root else None, got, root=root, displs=d if me == root else None)
        check(f"{tag} scatterv displs", b.read(got), np.arange(counts[me]) + 10 * me)
        # scan and exscan: rank r's value i is r + i + 1
        x = b.make(np.arange(N) + me + 1)
        out = b.make(np.full(N, 7))
        assert comm.scan(x, out) is out
        check(f"{tag} scan", b.read(out), sum(np.arange(N) + r + 1 for r in range(me + 1)))
        out = b.make(np.full(N, 7))
        req = comm.exscan(x, out, async_op=True)
        assert req.wait() is out
        want = np.full(N, 7) if me == 0 else sum(np.arange(N) + r + 1 for r in range(me))
        check(f"{tag} exscan", b.read(out), want)
        assert comm.scan(x, op="max") is x
        check(f"{tag} scan max in place", b.read(x), np.arange(N) + me + 1)
        # gatherv to the last rank, scatterv back: rank j's block of (j + 2) % 4 values
        root = p - 1
        counts = [(j + 2) % 4 for j in range(p)]
        x = b.make(np.arange(counts[me]) + 10 * me)
        out = b.make(np.zeros(sum(counts))) if me == root else None
        assert comm.gatherv(x, out, counts if me == root else None, root=root) is out
        if me == root:
            check(f"{tag} gatherv", b.read(out), np.concatenate([np.arange(c) + 10 * j for j, c in enumerate(counts)]))
        got = b.make(np.zeros(counts[me]))
        req = comm.scatterv(out, counts if me == root else None, got, root=root, async_op=True)
        assert req.wait() is got
        check(f"{tag} scatterv", b.read(got), np.arange(counts[me]) + 10 * me)
        # reduce_scatterv: block j of (3j + 1) % 4 values (zeros included); rank r's value i
        # of block j is (r + 1)(i + j + 1)
        counts = [(j * 3 + 1) % 4 for j in range(p)]
        x = b.make(np.concatenate([np.arange(c) + j + 1 for j, c in enumerate(counts)]) * (me + 1))
        out = b.make(np.zeros(counts[me]))
        assert comm.reduce_scatterv(x, out, counts) is out
        check(f"{tag} reduce_scatterv", b.read(out), (np.arange(counts[me]) + me + 1) * (p * (p + 1) // 2))
        req = comm.reduce_scatterv(x, out, counts, op="max", async_op=True)
        assert req.wait() is out
        check(f"{tag} reduce_scatterv max", b.read(out), (np.arange(counts[me]) + me + 1) * p)
        # sendrecv around the ring, everyone sending first (a copy on one rank).
        right, left = (me + 1) % p, (me - 1) % p
        x, got = b.make(np.full(N, me + 3)), b.make(np.zeros(N))
        assert comm.sendrecv(x, right, got, left) is got
        check(f"{tag} sendrecv", b.read(got), np.full(N, left + 3))
    # Messages far beyond the transport buffers (4 MiB), which blocking sends around a ring
    # could not carry.
    big = np.arange(1 << 20, dtype=np.int32) + me
    got = np.zeros_like(big)
    comm.sendrecv(big, (me + 1) % p, got, (me - 1) % p)
    assert np.array_equal(got, np.arange(1 << 20, dtype=np.int32) + (me - 1) % p), "big sendrecv"
    # A batch: the same 4 MiB to both neighbours and a tensor to itself, the receives after
    # every send, then the same batch issued and waited for.
    right, left = (me + 1) % p, (me - 1) % p
    for async_op in (False, True):
        from_l, from_r = np.zeros_like(big), np.zeros_like(big)
        mine, back = torch.arange(5, dtype=torch.float64) + me, torch.zeros(5, dtype=torch.float64)
        ops = [("send", big, left), ("send", big, right), ("send", mine, me),
               ("recv", from_l, left), ("recv", from_r, right), ("recv", back, me)]
        out = comm.p2p_batch(ops, async_op=async_op)
        if async_op:
            out = out.wait()
        assert len(out) == 3 and out[0] is from_l and out[2] is back, "p2p_batch result"
        assert np.array_equal(from_l, np.arange(1 << 20, dtype=np.int32) + left), "batch from left"
        assert np.array_equal(from_r, np.arange(1 << 20, dtype=np.int32) + right), "batch from right"
        assert torch.equal(back, mine), "batch to itself"
    assert comm.p2p_batch([]) == []
    comm.barrier()

    # Options: a forced algorithm and a per-call timeout.
    x = np.ones(100, dtype=np.float32)
    comm.allreduce(x, algorithm="ring", timeout=30)
    check("allreduce with options", x.astype(np.float64), np.full(100, p))

    # The GIL is released during a collective: while rank 0 sleeps before the barrier, a
    # Python thread on the other ranks keeps counting.
    if me == 0:
        time.sleep(0.5)
        comm.barrier()
    else:
        counter = [0]
        stop = threading.Event()

        def count():
            while not stop.is_set():
                counter[0] += 1

        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.05)
        before = counter[0]
        comm.barrier()
        during = counter[0] - before
        stop.set()
        t.join()
        if during < 1000:
            raise AssertionError(f"a Python thread ran only {during} times during a barrier: GIL held?")


def expect(exc, f, what):
    try:
        f()
    except exc as e:
        assert isinstance(e, chorus.ChorusError) and e.message, what
        return e
    raise AssertionError(f"{what}: no {exc.__name__}")


def close_cut_short_by_abort(d, limit):
    """close() ``d`` on a thread, abort() it 0.3 s later from this one: close must end
    within ``limit`` seconds of its start."""
    closer = threading.Thread(target=d.close)
    t0 = time.perf_counter()
    closer.start()
    time.sleep(0.3)
    d.abort()
    closer.join(30)
    took = time.perf_counter() - t0
    assert not closer.is_alive() and took < limit, f"close kept waiting ({took:.1f} s)"


def errors(comm):
    p, me = comm.size, comm.rank
    x = np.ones(8, dtype=np.float32)
    E = chorus.InvalidArgumentError
    expect(E, lambda: comm.allreduce(np.ones(16, np.float32)[::2]), "non-contiguous numpy")
    expect(E, lambda: comm.allreduce(torch.ones(4, 4).t()), "non-contiguous torch")
    expect(E, lambda: comm.allreduce(torch.ones(4, device="meta")), "wrong device")
    expect(E, lambda: comm.allreduce(torch.ones(4, dtype=torch.complex64)), "complex")
    expect(E, lambda: comm.allreduce(np.ones(4, dtype=bool)), "bool")
    expect(E, lambda: comm.allreduce(np.ones(4, dtype=">f4")), "big endian")
    expect(E, lambda: comm.allreduce([1.0, 2.0]), "a list")
    expect(E, lambda: comm.allreduce(x, op="median"), "op")
    expect(E, lambda: comm.allreduce(x, algorithm="nope"), "algorithm")
    expect(E, lambda: comm.allreduce(x, timeout=-1), "timeout")
    expect(E, lambda: comm.allreduce(x, timeout=True), "bool timeout")
    expect(E, lambda: comm.allreduce(x, timeout="5"), "str timeout")
    expect(E, lambda: comm.allreduce(x, timeout=10**400), "huge timeout")
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    expect(E, lambda: comm.allreduce(ro), "read-only")
    expect(E, lambda: comm.allreduce(torch.ones(3, requires_grad=True)), "leaf requiring grad")
    e = expect(E, lambda: comm.allreduce(torch.ones(3, requires_grad=True) * 2), "non-leaf requiring grad")
    assert "requires grad" in e.message, e.message
    e = expect(E, lambda: comm.allreduce(torch._neg_view(torch.ones(3))), "negative view")
    assert "negative view" in e.message, e.message
    expect(E, lambda: comm.allgather(x, np.zeros(8 * p + 1, np.float32)), "allgather size")
    expect(E, lambda: comm.allgather(x, np.zeros(8 * p, np.float64)), "allgather dtype")
    expect(E, lambda: comm.broadcast(x, root=p), "root out of range")
    expect(E, lambda: comm.broadcast(x, root=-1), "negative root")
    expect(E, lambda: comm.send(x, me), "send to self")
    expect(E, lambda: comm.sendrecv(x, me, np.zeros(8, np.float64), me), "sendrecv dtypes")
    expect(E, lambda: comm.sendrecv(x, p, np.zeros(8, np.float32), me), "sendrecv dest")
    y = np.zeros(8, np.float32)
    nxt = (me + 1) % p
    expect(E, lambda: comm.p2p_batch([("put", x, nxt)]), "p2p_batch kind")
    expect(E, lambda: comm.p2p_batch([("send", x)]), "p2p_batch op shape")
    expect(E, lambda: comm.p2p_batch(("send", x, nxt)), "p2p_batch not a list of ops")
    expect(E, lambda: comm.p2p_batch(5), "p2p_batch not a sequence")
    expect(E, lambda: comm.p2p_batch([("send", x, p)]), "p2p_batch peer")
    expect(E, lambda: comm.p2p_batch([("recv", ro, nxt)]), "p2p_batch read-only receive")
    expect(E, lambda: comm.p2p_batch([("send", x, nxt), ("recv", x, nxt)]), "p2p_batch overlap")
    expect(E, lambda: comm.p2p_batch([("send", x, me), ("recv", y[:4], me)]), "p2p_batch to itself")
    expect(E, lambda: comm.p2p_batch([("send", x, me)], async_op=True), "p2p_batch unpaired")
    expect(E, lambda: comm.scan(x, op="avg"), "scan avg")
    expect(E, lambda: comm.exscan(x, np.zeros(7, np.float32)), "exscan sizes")
    expect(E, lambda: comm.gatherv(x, None, None, root=me), "gatherv without out")
    expect(E, lambda: comm.scatterv(x, [8] * p, np.zeros(7, np.float32), root=me), "scatterv counts")
    expect(E, lambda: comm.reduce_scatterv(x, np.zeros(7, np.float32), [8] + [0] * (p - 1)), "reduce_scatterv out size")
    expect(E, lambda: comm.reduce_scatterv(x, np.zeros(8, np.float64), [8] + [0] * (p - 1)), "reduce_scatterv dtypes")
    expect(E, lambda: comm.allgatherv(x, np.zeros(8 * p, np.float32), [8] * (p + 1)), "allgatherv counts")
    expect(E, lambda: comm.allgatherv(x, np.zeros(8 * p, np.float32), [-1] + [8] * (p - 1)), "negative count")
    expect(E, lambda: comm.allgatherv(x, np.zeros(8 * p, np.float32), [8] * p, displs=[1] * p), "allgatherv displs overlap" if p > 1 else "allgatherv displs beyond out")
    expect(E, lambda: comm.allgatherv(x, np.zeros(8 * p, np.float32), [8] * p, displs=[8 * p] * p), "allgatherv displs beyond out")
    expect(E, lambda: comm.alltoallv(x, [8] + [0] * (p - 1), np.zeros(8, np.float32), [8] * p, send_displs=[0] * (p + 1)), "alltoallv displs count")
    expect(E, lambda: comm.scatterv(x, [4] * p, np.zeros(4, np.float32), root=me, displs=[5] * p), "scatterv displs beyond x")
    expect(E, lambda: comm.alltoallv(x, [True] * p, np.zeros(8, np.float32), [8] * p), "bool counts")
    expect(E, lambda: comm.alltoallv(x, [np.True_] * p, np.zeros(8, np.float32), [8] * p), "numpy bool counts")
    # Still usable after all of that.
    comm.allreduce(x)
    assert (x == p).all(), x
    # A mismatch: the last rank gives another count. Every rank gets an error, never a hang.
    y = np.ones(100 + (me == p - 1), dtype=np.float32)
    e = expect((chorus.MismatchError, chorus.RemoteError, chorus.ChorusTimeoutError),
               lambda: comm.allreduce(y), "mismatched counts")
    print(f"rank {me}: {type(e).__name__}: {e.message}", flush=True)
    expect(chorus.InvalidUsageError, comm.barrier, "a broken communicator")
    comm.abort()
    comm.close()
    expect(chorus.InvalidUsageError, comm.barrier, "a closed communicator")


def compression(comm):
    p, me = comm.size, comm.rank
    n = 5000
    mine = np.random.default_rng(100 + me).standard_normal(n).astype(np.float32)
    dense = np.zeros(n, dtype=np.float64)
    for r in range(p):
        dense += np.random.default_rng(100 + r).standard_normal(n).astype(np.float32)
    for spec, tol in [("fp16", 1e-3), ("bf16", 1e-2), ("int8", 0.05), ("ternary", 1.5),
                      ("sign", 1.5), ("topk:0.3", 1.0)]:
        c = chorus.Compressor(spec + ",min_bytes=0")
        for kind in ("numpy", "torch"):
            x = mine.copy() if kind == "numpy" else torch.from_numpy(mine.copy())
            assert comm.allreduce(x, op="sum", compressor=c) is x
            got = np.asarray(x, dtype=np.float64)
            rel = np.linalg.norm(got - dense) / np.linalg.norm(dense)
            assert rel < tol, f"{spec} {kind}: relative error {rel}"
            # A bound above 1 passes a result of zeros; the direction must be right too.
            cos = float(got @ dense) / (np.linalg.norm(got) * np.linalg.norm(dense) or 1.0)
            assert cos > 0.3, f"{spec} {kind}: cosine {cos}"
            # identical on every rank
            digest = np.array([float(np.sum(got * np.arange(n)))], dtype=np.float64)
            ref = digest.copy()
            comm.broadcast(ref, root=0)
            assert ref[0] == digest[0], f"{spec}: ranks differ"
            r = c.last_report()
            assert r["compressed"] == 1 and r["dense_bytes"] == 4 * n and r["bytes_sent"] > 0, r
            if spec in ("int8", "ternary", "sign"):
                assert r["bytes_sent"] < 4 * n, (spec, r)
        c.close()
    # float16 / bfloat16 tensors, avg
    for dt in (torch.float16, torch.bfloat16):
        c = chorus.Compressor("int8,min_bytes=0")
        x = torch.full((1000,), float(me + 1), dtype=dt)
        comm.allreduce(x, op="avg", compressor=c)
        want = (p + 1) / 2
        assert torch.allclose(x.float(), torch.full((1000,), want), rtol=0.05), (dt, x[:4])
    # The last call's report is read while another call on the compressor runs (a metrics
    # thread, say): it neither waits for that call nor makes it fail.
    c = chorus.Compressor("int8,min_bytes=0")
    x = np.ones(4096, np.float32)
    if me == 0:
        done = {}

        def run():
            try:
                comm.allreduce(x, op="sum", compressor=c)
                done["ok"] = True
            except Exception as e:  # noqa: BLE001 (reported below)
                done["err"] = e

        th = threading.Thread(target=run)
        th.start()
        time.sleep(0.3)  # inside the call, waiting for the others
        began = time.monotonic()
        assert c.last_report()["compressed"] == 0, "a report before any call"
        assert time.monotonic() - began < 0.2, "the report waited for the call"
        th.join(60)
        assert done.get("ok"), done
    else:
        time.sleep(1.0)
        comm.allreduce(x, op="sum", compressor=c)
    assert np.allclose(x, p, rtol=0.05), x[:4]
    assert c.last_report()["compressed"] == 1
    c.close()
    # Small tensors go uncompressed (exact).
    c = chorus.Compressor("sign")
    x = np.full(10, me + 1.0, dtype=np.float32)
    comm.allreduce(x, op="sum", compressor=c)
    assert (x == p * (p + 1) / 2).all() and c.last_report()["compressed"] == 0, x
    E = chorus.InvalidArgumentError
    expect(E, lambda: chorus.Compressor("int3"), "bad spec")
    expect(E, lambda: chorus.Compressor("topk:2"), "bad ratio")
    expect(E, lambda: comm.allreduce(np.ones(8, np.int32), compressor=c), "int dtype")
    expect(E, lambda: comm.allreduce(np.ones(8, np.float32), op="max", compressor=c), "max op")
    expect(E, lambda: comm.allreduce(np.ones(8, np.float32), compressor="int8"), "a str")
    comm.barrier()


def groups(comm):
    p, me = comm.size, comm.rank
    E = chorus.InvalidArgumentError
    # By parity, ranked in reverse.
    half = comm.split(me % 2, key=-me)
    want = [r for r in range(p - 1, -1, -1) if r % 2 == me % 2]
    assert (half.rank, half.size) == (want.index(me), len(want)), (half, want)
    seen = np.zeros(half.size, dtype=np.int64)
    half.allgather(np.array([me], dtype=np.int64), seen)
    assert list(seen) == want, (seen, want)
    t = torch.full((1000,), float(me))
    half.allreduce(t, op="sum")
    assert (t == float(sum(want))).all(), t[:4]
    # torch.distributed.new_group's shape: [3, 1] ranked in increasing order, None elsewhere.
    g = comm.new_group([3, 1])
    if me in (3, 1):
        assert (g.rank, g.size) == ([1, 3].index(me), 2), g
        x = np.array([me], dtype=np.int32)
        g.broadcast(x, root=0)
        assert x[0] == 1, x
        g.close()
    else:
        assert g is None, g
    # A rank listing other ranks: each group it lands in fails on every member.
    listed = [0, 1] if me == 0 else [0, 1, 2]
    if me in listed:
        e = expect(chorus.MismatchError, lambda: comm.new_group(listed), "different lists")
        assert "same list" in e.message, e.message
    else:
        assert comm.new_group(listed) is None
    # A copy used from another thread while this one uses the parent.
    d = comm.dup()
    assert (d.rank, d.size) == (me, p), d
    box = {}

    def on_copy():
        try:
            for i in range(20):
                y = np.full(4096, float(i + me), dtype=np.float32)
                d.allreduce(y, op="max")
                assert (y == float(i + p - 1)).all(), (i, y[:4])
            box["ok"] = True
        except BaseException as err:  # noqa: BLE001 - reported below
            box["err"] = err

    th = threading.Thread(target=on_copy)
    th.start()
    for i in range(20):
        z = np.full(1000, 1.0, dtype=np.float64)
        comm.allreduce(z, op="sum")
        assert (z == p).all(), z[:4]
    th.join(60)
    assert not th.is_alive(), "the copy's thread did not finish"
    assert box.get("ok"), box.get("err")
    d.close()
    # A bad color on the last rank only: the others fail at once, naming it.
    if me == p - 1:
        expect(E, lambda: comm.split(True), "bool color")
    else:
        e = expect(chorus.MismatchError, lambda: comm.split(0), "another rank's bad color")
        assert "color" in e.message, e.message
    comm.barrier()
    # A list refused on the last rank only: the others fail at once too.
    if me == p - 1:
        expect(E, lambda: comm.new_group([0, p]), "rank out of range, one rank")
    else:
        began = time.monotonic()
        e = expect(chorus.MismatchError, lambda: comm.new_group([0, 1]), "a rank's bad list")
        assert "color" in e.message, e.message
        assert time.monotonic() - began < 20, "not at once"
    comm.barrier()
    # Bad arguments, alike on every rank.
    expect(E, lambda: comm.split(-2), "negative color")
    expect(E, lambda: comm.split(True), "bool color")
    expect(E, lambda: comm.split(2**31), "color out of range")
    expect(E, lambda: comm.new_group([0, 0]), "repeated rank")
    expect(E, lambda: comm.new_group([p]), "rank out of range")
    expect(E, lambda: comm.new_group(5), "not a list")
    # The half outlives the parent's use and is closed last.
    half.barrier()
    half.close()
    comm.barrier()


def nonblocking(comm):
    """Every collective with async_op=True, issued back to back with a blocking call among
    them and waited in reverse order; polling; futures; errors at issue and at completion."""
    p, me = comm.size, comm.rank
    root = p - 1
    for kind, dtype in [("numpy", "float32"), ("torch", "int64")]:
        b = Backend(kind, dtype)
        big = b.make(inputs(me, 100003))
        reqs = [("allreduce", comm.allreduce(big, async_op=True), reduced("sum", p, 100003, b.is_float))]
        bc = b.make(np.arange(N) * (me == root))
        reqs.append(("broadcast", comm.broadcast(bc, root=root, async_op=True), np.arange(N)))
        red = b.make(inputs(me, N))
        r = comm.reduce(red, root=0, op="max", async_op=True)
        reqs.append(("reduce", r, reduced("max", p, N, b.is_float) if me == 0 else inputs(me, N)))
        one = b.make([1])
        comm.allreduce(one)  # blocking, after those issued before it
        check("blocking allreduce among async ones", b.read(one), [p])
        ag = b.make(np.zeros(N * p))
        reqs.append(("allgather", comm.allgather(b.make(np.full(N, me)), ag, async_op=True),
                     np.repeat(np.arange(p), N)))
        rs = b.make(np.zeros(N))
        reqs.append(("reduce_scatter",
                     comm.reduce_scatter(b.make(inputs(me, N * p)), rs, async_op=True),
                     reduced("sum", p, N * p, b.is_float)[me * N:(me + 1) * N]))
        a2a_in = b.make(np.arange(N * p) + 1000 * me)
        a2a = b.make(np.zeros(N * p))
        reqs.append(("alltoall", comm.alltoall(a2a_in, a2a, async_op=True),
                     np.concatenate([np.arange(me * N, (me + 1) * N) + 1000 * j for j in range(p)])))
        ga = b.make(np.zeros(N * p)) if me == root else None
        g = comm.gather(b.make(np.full(N, me)), ga, root=root, async_op=True)
        reqs.append(("gather", g, np.repeat(np.arange(p), N) if me == root else None))
        sc_out = b.make(np.zeros(N))
        sc_in = b.make(np.arange(N * p)) if me == root else None
        reqs.append(("scatter", comm.scatter(sc_in, sc_out, root=root, async_op=True),
                     np.arange(me * N, (me + 1) * N)))
        counts = [(j % 3) + 1 for j in range(p)]
        agv = b.make(np.zeros(sum(counts)))
        reqs.append(("allgatherv",
                     comm.allgatherv(b.make(np.full(counts[me], me)), agv, counts, async_op=True),
                     np.concatenate([np.full(c, j) for j, c in enumerate(counts)])))
        # alltoallv: rank r sends (r + j) % 3 elements to rank j.
        sc = [(me + j) % 3 for j in range(p)]
        rc = [(j + me) % 3 for j in range(p)]
        v_in = b.make(np.concatenate([np.full(sc[j], 10 * me + j) for j in range(p)] + [np.zeros(0)]))
        v_out = b.make(np.zeros(sum(rc)))
        reqs.append(("alltoallv", comm.alltoallv(v_in, sc, v_out, rc, async_op=True),
                     np.concatenate([np.full(rc[j], 10 * j + me) for j in range(p)] + [np.zeros(0)])))
        bar = comm.barrier(async_op=True)
        for _ in range(100000):
            if bar.test():
                break
            time.sleep(0.0005)
        assert bar.test() and bar.wait() is None, "barrier did not complete"
        for what, req, want in reversed(reqs):
            got = req.wait()
            assert req.test() and req.wait() is got, what
            if want is not None:
                check(f"async {what} {kind} {dtype}", b.read(got), want)
    # test() from another thread while one waits returns at once (False until done).
    slow = comm.allreduce(np.ones(1 << 20, np.float32), async_op=True)
    waiter = threading.Thread(target=slow.wait)
    waiter.start()
    t0 = time.perf_counter()
    polled = slow.test()
    assert time.perf_counter() - t0 < 0.5, "test() waited for the call"
    waiter.join()
    assert slow.test() and (slow.wait() == p).all(), polled
    # Futures (what a DDP hook returns), in and out of order.
    t = torch.full((1000,), float(me))
    f1 = comm.allreduce(t, async_op=True).get_future()
    f2 = comm.allreduce(torch.ones(10), async_op=True).get_future()
    assert torch.equal(f2.wait(), torch.full((10,), float(p)))
    assert f1.wait() is t and torch.equal(t, torch.full((1000,), float(p * (p - 1) / 2)))
    # A future's callback that waits for another request's future (as PowerSGD's hooks chain
    # them) runs on the futures thread: it must not wait behind itself. Rank 0 issues late, so
    # that the others attach the callback while their first call still runs.
    if me == 0:
        time.sleep(0.2)
    first = comm.allreduce(torch.ones(4), async_op=True).get_future()
    chained = first.then(
        lambda f: comm.allreduce(torch.full((2,), 2.0), async_op=True).get_future().wait()
    )
    assert torch.equal(chained.wait(), torch.full((2,), 2.0 * p)), chained.wait()
    # A request dropped unwaited waits in its finaliser: the calls after it are undisturbed.
    comm.allreduce(np.ones(1 << 16, np.float32), async_op=True)
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    check("after a dropped request", x, [p] * 4)
    # Argument errors the bindings see are raised when issuing; nothing is issued then.
    E = chorus.InvalidArgumentError
    expect(E, lambda: comm.allreduce(x, op="median", async_op=True), "async op")
    # A root out of range is the communicator's to check: the request reports it.
    expect(E, lambda: comm.broadcast(x, root=p, async_op=True).wait(), "async root")
    expect(E, lambda: comm.allgather(x, np.zeros(3, np.float32), async_op=True), "async size")
    expect(chorus.UnsupportedError,
           lambda: comm.allreduce(x, compressor=chorus.Compressor("int8"), async_op=True),
           "async compressed")
    comm.allreduce(x)
    check("usable after refused async calls", x, [p * p] * 4)
    # abort() from another thread ends a call that waits (as ncclCommAbort), on a copy.
    if p > 1:
        d = comm.dup()
        if me == 0:
            got = {}

            def blocked():
                t0 = time.perf_counter()
                try:
                    d.barrier()
                except chorus.InvalidUsageError as e:
                    got["error"] = e
                got["took"] = time.perf_counter() - t0

            th = threading.Thread(target=blocked)
            th.start()
            time.sleep(0.3)
            d.abort()
            th.join(30)
            assert "error" in got and "aborted" in got["error"].message, got
            assert got["took"] < 1.5, got
        else:
            time.sleep(2.0)
            # Rank 0 entered the first barrier before aborting: it may complete, and then the
            # second meets the abort.
            try:
                d.barrier()
                d.barrier()
                raise AssertionError("two barriers after a peer aborted succeeded")
            except chorus.RemoteError as e:
                assert "aborted" in e.message, e.message
        d.close()
    # close() waits for a nonblocking call in flight, and abort() from another thread still
    # reaches it meanwhile.
    if p > 1:
        d = comm.dup()
        if me == 0:
            pending = d.barrier(async_op=True)  # the others join only after 2 s
            close_cut_short_by_abort(d, 1.5)
            expect(chorus.InvalidUsageError, pending.wait, "the aborted call in flight")
        else:
            time.sleep(2.0)
            try:
                d.barrier()
                d.barrier()
            except chorus.RemoteError:
                pass
            d.close()
    # close() that waits in chorus_comm_destroy for a dropped send whose peer never receives
    # it: abort() from another thread cuts that wait short too.
    if p > 1:
        d = comm.dup()
        if me == 0:
            d.isend(np.ones(1 << 20), 1)  # 8 MiB, dropped at once: given up, still running
            close_cut_short_by_abort(d, 3.0)
            expect(chorus.InvalidUsageError, d.barrier, "a communicator closed after abort")
        else:
            time.sleep(1.0)
            d.close()
    # A mismatch surfaces in the requests (and futures) of every rank, never a hang.
    d = comm.dup()
    y = np.ones(100 + (me == p - 1), dtype=np.float32)
    bad = d.allreduce(y, async_op=True)
    after = d.allreduce(np.ones(4, np.float32), async_op=True).get_future()
    if p > 1:
        e = expect((chorus.MismatchError, chorus.RemoteError, chorus.ChorusTimeoutError),
                   bad.wait, "async mismatch")
        print(f"rank {me}: async {type(e).__name__}: {e.message}", flush=True)
        expect(chorus.ChorusError, bad.wait, "async mismatch, asked again")
        try:
            after.wait()
        except chorus.ChorusError:
            pass
        else:
            raise AssertionError("the call after a failed one succeeded")
    d.close()
    comm.allreduce(x)
    check("the parent after its dup failed", x, [p * p * p] * 4)


def transfers(comm):
    """isend/irecv: a ring of 4 MiB sends before their receives, waited in reverse; to itself;
    a collective on a dup between a large isend and its wait while the peer reduces first;
    collectives refused while transfers are live; a wrong length fails both ranks."""
    me, p = comm.rank, comm.size
    right, left = (me + 1) % p, (me - 1) % p
    n = 1 << 20
    outs = [np.arange(n, dtype=np.int32) + 1000 * me + k for k in range(2)]
    ins = [np.zeros(n, dtype=np.int32) for _ in range(2)]
    sends = [comm.isend(o, right) for o in outs]
    recvs = [comm.irecv(x, left) for x in ins]
    for r in reversed(recvs):
        r.wait()
    for s in sends:
        assert s.wait() is not None
    for k in range(2):
        check(f"ring message {k}", ins[k][:4], list(np.arange(4) + 1000 * left + k))
        assert (ins[k] == np.arange(n, dtype=np.int32) + 1000 * left + k).all()
    # The same ring as one batch (sends first), and a batch's sends to itself matched in
    # its order by receives issued one by one.
    ins = [np.zeros(n, dtype=np.int32) for _ in range(2)]
    reqs = comm.batch_isend_irecv(
        [("send", outs[0], right), ("send", outs[1], right), ("recv", ins[0], left),
         ("recv", ins[1], left)]
    )
    assert len(reqs) == 4 and all(isinstance(r, chorus.Request) for r in reqs)
    assert reqs[3].wait() is ins[1] and reqs[2].wait() is ins[0]
    assert reqs[0].wait() is outs[0] and reqs[1].wait() is outs[1]
    for k in range(2):
        assert (ins[k] == np.arange(n, dtype=np.int32) + 1000 * left + k).all(), ins[k][:4]
    first, second = np.zeros(2), np.zeros(2)
    sent = comm.batch_isend_irecv([("send", np.array([1.0, 2.0]), me),
                                   ("send", np.array([3.0, 4.0]), me)])
    comm.irecv(first, me).wait()
    comm.irecv(second, me).wait()
    [r.wait() for r in sent]
    check("a batch to itself, in order", list(first) + list(second), [1.0, 2.0, 3.0, 4.0])
    # A bad op starts none of the batch: the receive from itself after it gets what follows.
    expect(chorus.InvalidArgumentError,
           lambda: comm.batch_isend_irecv([("send", np.ones(2), me), ("recv", np.ones(2), p)]),
           "a batch with a peer outside")
    expect(chorus.InvalidArgumentError,
           lambda: comm.batch_isend_irecv([("send", first, me), ("recv", first, me)]),
           "a receive overlapping a send")
    assert comm.batch_isend_irecv([]) == []
    got = comm.irecv(np.zeros(2), me)
    comm.isend(np.array([5.0, 6.0]), me).wait()
    check("nothing started by refused batches", got.wait(), [5.0, 6.0])
    back = np.zeros(3, dtype=np.float64)
    w = comm.isend(np.array([1.5, 2.5, 3.5]), me)
    assert comm.irecv(back, me).wait() is back
    w.wait()
    check("to itself", back, [1.5, 2.5, 3.5])
    # A collective on a dup between a large isend and its wait, the peer receiving first
    # (a send that waited for its wait() would never reach it).
    d = comm.dup()
    if p > 1:
        big = np.full(n, float(me + 7))
        x = np.ones(8)
        if me == 0:
            w = comm.isend(big, 1)
            d.allreduce(x)
            w.wait()
        elif me == 1:
            got = comm.irecv(np.zeros(n), 0).wait()
            assert (got == 7.0).all(), got[:4]
            d.allreduce(x)
        else:
            d.allreduce(x)
        check("the dup's allreduce", x, [float(p)] * 8)
    # A dropped isend gives its transfer up rather than waiting: a ring of dropped large
    # sends, then the receives, completes.
    if p > 1:
        comm.isend(np.full(n, float(me)), right)  # dropped at once
        got = comm.recv(np.zeros(n), left)
        assert (got == float(left)).all(), got[:4]
    # Collectives are refused while a transfer is live; the communicator stays usable.
    pending = comm.irecv(np.zeros(2), me)
    expect(chorus.InvalidUsageError, lambda: comm.allreduce(np.ones(2)), "allreduce while live")
    comm.isend(np.array([7.0, 8.0]), me).wait()
    check("the late receive from itself", pending.wait(), [7.0, 8.0])
    y = np.ones(2)
    comm.allreduce(y)
    check("allreduce after the transfers", y, [float(p)] * 2)
    expect(chorus.InvalidArgumentError, lambda: comm.isend(np.ones(1), p), "a peer outside")
    # A receive into memory a live transfer uses is refused (the send goes on).
    o = np.arange(8.0)
    s1 = comm.isend(o[:4], me)
    e = expect(chorus.InvalidArgumentError, lambda: comm.irecv(o[2:6], me), "overlapping receive")
    assert "overlaps" in e.message, e.message
    got = comm.irecv(np.zeros(4), me).wait()
    s1.wait()
    check("the send beside a refused receive", got, [0.0, 1.0, 2.0, 3.0])
    # The buffers of dropped transfers are let go once no transfer runs, not kept to close().
    if p > 1 and me < 2:
        if me == 0:
            for _ in range(4):
                comm.isend(np.full(n, 3.0), 1)  # dropped at once; rank 1 receives later
            assert len(comm._given_up) == 4, len(comm._given_up)
            d.barrier()
            comm.barrier()  # waits for the given-up transfers
        else:
            d.barrier()
            for _ in range(4):
                assert (comm.recv(np.zeros(n), 0) == 3.0).all()
            comm.barrier()
        w = comm.isend(np.ones(1), me)
        comm.irecv(np.ones(1), me).wait()
        w.wait()
        assert not comm._given_up, len(comm._given_up)
    elif p > 1:
        d.barrier()
        comm.barrier()
    # A transfer's future completes when the transfer does, not after an earlier one's:
    # rank 0's receive waits for what its send's future callback sends (a futures thread
    # that waited for the receive first would wait for good).
    if p > 1 and me < 2:
        if me == 0:
            a = np.zeros(3)
            f_a = comm.irecv(a, 1).get_future()
            r_b = comm.isend(np.full(3, 5.0), 1)
            r_b.get_future().then(lambda _: comm.isend(np.ones(1), 1))
            f_a.wait()
            r_b.wait()
            check("a receive after a later future's callback", a, [7.0] * 3)
        else:
            check("the send before it", comm.recv(np.zeros(3), 0), [5.0] * 3)
            comm.recv(np.zeros(1), 0)  # sent by rank 0's callback
            comm.send(np.full(3, 7.0), 0)
    # A wrong length fails both ranks (their communicator is aborted; the dup goes on).
    if p > 1 and me < 2:
        if me == 0:
            expect(chorus.ChorusError, lambda: (comm.isend(np.ones(5), 1).wait(),
                                                comm.irecv(np.ones(1), 1).wait()), "sender")
        else:
            e = expect(chorus.MismatchError, lambda: comm.irecv(np.zeros(4), 0).wait(), "receiver")
            print(f"rank {me}: transfer {type(e).__name__}: {e.message}", flush=True)
    y = np.ones(2)
    d.allreduce(y)
    check("the dup after a failed transfer", y, [float(p)] * 2)
    d.close()


def forked(comm):
    """A child forked from a rank (as a DataLoader worker is) cannot use the communicator: every
    call fails at once, nothing hangs, and closing it there leaves the parent's untouched."""
    import os

    p, me = comm.size, comm.rank
    # First with no nonblocking call made (no queue thread holds the communicators): the
    # child's close drops them for real. A dup's first rank hosts the dup's store.
    d = comm.dup()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            d.allreduce(np.ones(4, np.float32))
            code = 1
        except chorus.InvalidUsageError as e:
            code = 0 if "forked" in e.message else 1
        try:
            d.close()
            comm.close()
        except BaseException as e:  # noqa: BLE001 - reported through the exit code
            print(f"child of rank {me}: close: {type(e).__name__}: {e}", flush=True)
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"first child status {status}"
    for _ in range(3):  # the parent's copies (shared memory, store) are untouched
        y = np.full(1000, me, np.float32)
        d.allreduce(y)
        check("the dup after the child closed it", y[:3], [p * (p - 1) / 2] * 3)
    d.close()
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    in_flight = comm.allreduce(np.ones(1 << 20, np.float32), async_op=True)
    future = comm.allreduce(torch.ones(8), async_op=True).get_future()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for what, call in [
                ("allreduce", lambda: comm.allreduce(np.ones(4, np.float32))),
                ("async allreduce", lambda: comm.allreduce(np.ones(4, np.float32), async_op=True).wait()),
                ("barrier", comm.barrier),
                ("dup", comm.dup),
            ]:
                try:
                    call()
                    print(f"child of rank {me}: {what} succeeded", flush=True)
                    code = 1
                except chorus.InvalidUsageError as e:
                    if "forked" not in e.message:
                        print(f"child of rank {me}: {what}: {e.message}", flush=True)
                        code = 1
            try:
                in_flight.wait()  # issued by the parent: done there, or refused here
            except chorus.InvalidUsageError:
                pass
            comm.abort()
            comm.close()
        except BaseException as e:  # noqa: BLE001 - reported through the exit code
            print(f"child of rank {me}: {type(e).__name__}: {e}", flush=True)
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    check("in flight at the fork", in_flight.wait()[:4], [p] * 4)
    assert torch.equal(future.wait(), torch.full((8,), float(p)))
    # The parent's communicator, its connections, segments and store, are untouched.
    for _ in range(3):
        y = np.full(1000, me, np.float32)
        comm.allreduce(y)
        check("after the child", y[:3], [p * (p - 1) / 2] * 3)
    d = comm.dup()
    z = np.ones(4, np.float32)
    d.allreduce(z)
    check("a dup after the child", z, [p] * 4)
    d.close()


def main():
    mode = sys.argv[1]
    comm = chorus.init()
    modes = {"collectives": collectives, "errors": errors, "compression": compression,
             "groups": groups, "nonblocking": nonblocking, "fork": forked,
             "transfers": transfers}
    modes[mode](comm)
    comm.close()
    print(f"ok {mode} rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
