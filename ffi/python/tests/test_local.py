"""In-process tests: a group of one, a group of two ranks on two threads, argument checks,
error classes, and the GIL being released during a collective."""

import threading
import warnings
import time

import numpy as np
import pytest
import torch

import chorus


@pytest.fixture(scope="module")
def solo():
    with chorus.init(rank=0, size=1, addr="127.0.0.1:0") as c:
        yield c


def test_version_and_statuses():
    assert chorus.version() == chorus.__version__
    assert len(set(chorus._status_names())) == 9
    assert issubclass(chorus.InvalidArgumentError, ValueError)
    assert issubclass(chorus.ChorusTimeoutError, TimeoutError)
    statuses = [c.status for c in chorus._ERRORS.values()]
    assert sorted(statuses) == list(range(1, 9))


def test_a_tensor_saved_for_backward_then_overwritten_fails_backward(solo):
    """chorus writes in place behind autograd's back; it says so as an in-place op does, so
    that backward fails instead of using the overwritten values."""
    w = torch.ones(3, requires_grad=True)
    x = torch.full((3,), 2.0)
    loss = (w * x).sum()  # autograd saves x
    solo.allreduce(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Also through a view or .detach() (they share the counter), and for a received tensor.
    y = torch.full((4,), 3.0)
    loss = (w.sum() * y[1:]).sum()
    solo.allreduce(y.detach()[:2])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Another tensor written: backward runs.
    z = torch.full((3,), 2.0)
    loss = (w * z).sum()
    solo.allreduce(torch.zeros(1))
    loss.backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))
    # Inference tensors have no counter and are accepted as before.
    with torch.inference_mode():
        t = torch.ones(2)
    solo.allreduce(t)
    # A call refused by Python's own checks writes nothing and so leaves backward alone,
    # in every form (blocking, nonblocking, transfers, one-sided output).
    x = torch.full((3,), 2.0)
    loss = (w * x).sum()
    out = torch.zeros(3)
    refused = [
        lambda: solo.allreduce(x, op="nope"),
        lambda: solo.allreduce(x, op="nope", async_op=True),
        lambda: solo.allreduce(x, op="sum", algorithm=7),
        lambda: solo.reduce(x, root="0"),
        lambda: solo.broadcast(x, root=None),
        lambda: solo.recv(x, peer="0"),
        lambda: solo.irecv(x, peer=1.5),
        lambda: solo.sendrecv(out, 0, x, source="0"),
        lambda: solo.allgather(torch.zeros(1, dtype=torch.int32), x),
        lambda: solo.scan(out, x, op="nope"),
    ]
    for call in refused:
        with pytest.raises((chorus.InvalidArgumentError, TypeError)):
            call()
    w.grad = None
    loss.backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_a_nonblocking_call_holds_the_memory_it_uses(solo):
    """`t.data = ...` before the call completes would free the memory chorus writes; the
    request holds that memory itself, not just the tensor object."""
    t = torch.arange(4.0)
    ptr = t.data_ptr()
    req = solo.allreduce(t, async_op=True)
    t.data = torch.zeros(4)
    held = [b.obj for b in req._keep if isinstance(b, chorus._Buffer)]
    assert [h.data_ptr() for h in held] == [ptr]
    req.wait()
    assert torch.equal(held[0], torch.arange(4.0))


def test_finalizers_keep_the_message_of_a_failed_call(solo):
    """The garbage collector may finalize a request, a compressor or a communicator between a
    failed call and the reading of its message: their calls into chorus leave it as it was."""
    lib = chorus._lib.lib
    for make in (
        lambda: solo.allreduce(np.ones(4, np.float32), async_op=True),
        lambda: chorus.Compressor("int8"),
        lambda: chorus.init(rank=0, size=1, addr="127.0.0.1:0"),
    ):
        obj = make()
        lib.chorus_set_last_error(b"rank 0: what the failed call said")
        del obj  # its finalizer calls chorus (wait, destroy)
        assert lib.chorus_last_error() == b"rank 0: what the failed call said"
    lib.chorus_set_last_error(None)
    assert lib.chorus_last_error() == b""


def test_group_of_one_keeps_values(solo):
    assert (solo.rank, solo.size) == (0, 1)
    for dt in ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]:
        x = np.arange(7).astype(dt)
        for op in chorus.OPS:
            if op.startswith("b") and dt.startswith("float"):
                # Bitwise operators take integers only.
                with pytest.raises(chorus.InvalidArgumentError, match="bitwise"):
                    solo.allreduce(x, op=op)
                continue
            assert solo.allreduce(x, op=op) is x
            np.testing.assert_array_equal(x, np.arange(7).astype(dt))
    t = torch.arange(5, dtype=torch.bfloat16)
    solo.allreduce(t, op="avg")
    assert torch.equal(t, torch.arange(5, dtype=torch.bfloat16))


def test_unique_id_init_on_two_threads(monkeypatch):
    # The store on loopback (without a launcher's address, the first interface that is not).
    monkeypatch.setenv("CHORUS_SOCKET_IFNAME", "lo")
    uid = chorus.unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    assert chorus.unique_id() != uid
    sums = [None, None]

    def rank(r):
        with chorus.init(rank=r, size=2, unique_id=uid) as c:
            x = np.full(1000, r + 1.0, dtype=np.float32)
            c.allreduce(x)
            sums[r] = float(x[0])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sums == [3.0, 3.0], sums
    with pytest.raises(chorus.InvalidArgumentError):
        chorus.init(rank=0, size=2, unique_id=uid[:-1])
    with pytest.raises(chorus.InvalidArgumentError):
        chorus.init(rank=0, size=2, unique_id=b"x" * 128)
    with pytest.raises(chorus.InvalidArgumentError):
        chorus.init(rank=0, size=2, unique_id=uid, addr="127.0.0.1:1")
    with pytest.raises(chorus.InvalidArgumentError):
        chorus.init(unique_id=uid)


def test_explicit_init_still_reads_the_chorus_settings(monkeypatch):
    # As NCCL's explicit init reads NCCL_*: a bad CHORUS_TIMEOUT is refused, naming it.
    monkeypatch.setenv("CHORUS_TIMEOUT", "abc")
    with pytest.raises(chorus.InvalidArgumentError, match="CHORUS_TIMEOUT"):
        chorus.init(rank=0, size=1, addr="127.0.0.1:0")
    monkeypatch.setenv("CHORUS_SOCKET_IFNAME", "lo")
    with pytest.raises(chorus.InvalidArgumentError, match="CHORUS_TIMEOUT"):
        chorus.init(rank=0, size=1, unique_id=chorus.unique_id())


def test_groups_of_a_group_of_one(solo):
    assert solo.split(None) is None
    assert solo.new_group([]) is None
    for g in (solo.split(3, key=-5), solo.dup(), solo.new_group([0]), solo.split_by_host()):
        assert (g.rank, g.size) == (0, 1), g
        x = np.arange(4, dtype=np.float32)
        g.allreduce(x)
        np.testing.assert_array_equal(x, np.arange(4, dtype=np.float32))
        g.close()
    with pytest.raises(chorus.InvalidArgumentError):
        solo.split(-1)
    with pytest.raises(chorus.InvalidArgumentError):
        solo.new_group([1])


def test_argument_errors_leave_it_usable(solo):
    with pytest.raises(chorus.InvalidArgumentError, match="contiguous"):
        solo.allreduce(np.ones(10)[::2])
    with pytest.raises(chorus.InvalidArgumentError, match="device"):
        solo.allreduce(torch.ones(2, device="meta"))
    with pytest.raises(chorus.InvalidArgumentError, match="dtype"):
        solo.allreduce(np.ones(2, dtype=np.complex64))
    with pytest.raises(chorus.InvalidArgumentError, match="root"):
        solo.broadcast(np.ones(2), root=1)
    with pytest.raises(chorus.InvalidArgumentError, match="options.timeout"):
        solo.allreduce(np.ones(2), timeout=float("nan"))
    x = np.ones(3)
    solo.allreduce(x)
    assert (x == 1).all()


def test_init_errors():
    with pytest.raises(chorus.InvalidArgumentError):
        chorus.init(rank=3, size=2, addr="127.0.0.1:1")
    with pytest.raises(chorus.InvalidArgumentError):
        chorus.init(rank=0, size=2)
    # C stops at a NUL: a token "\0secret" would arrive as no token at all.
    with pytest.raises(chorus.InvalidArgumentError, match="token contains a NUL"):
        chorus.init(rank=0, size=1, addr="127.0.0.1:0", token="\0secret")
    with pytest.raises(chorus.InvalidArgumentError, match="addr must be a str"):
        chorus.init(rank=0, size=1, addr=b"127.0.0.1:0")
    with pytest.raises(chorus.InvalidArgumentError, match="spec contains a NUL"):
        chorus.Compressor("int8\0,ef=on")
    # More ranks than the library takes is refused before anything is allocated for them.
    with pytest.raises(chorus.InvalidArgumentError, match="ranks"):
        chorus.init(rank=0, size=2**31 - 1, addr="127.0.0.1:0")


def test_numpy_integers_and_strings_as_arguments(solo):
    x = np.ones(3, dtype=np.int64)
    solo.broadcast(x, root=np.int64(0))
    solo.reduce(x, root=np.int32(0))
    with pytest.raises(chorus.InvalidArgumentError, match="root must be an int"):
        solo.broadcast(x, root=0.0)
    with pytest.raises(chorus.InvalidArgumentError, match="root must be an int"):
        solo.broadcast(x, root=True)
    with pytest.raises(chorus.InvalidArgumentError, match="algorithm must be a str"):
        solo.allreduce(x, algorithm=1)
    with pytest.raises(chorus.InvalidArgumentError, match="algorithm contains a NUL"):
        solo.allreduce(x, algorithm="ring\0")
    assert (x == 1).all()


def _free_addr():
    """127.0.0.1 and a port free a moment ago, below Linux's ephemeral range (32768-60999):
    no outgoing connection of another test takes it before rank 0's store binds it."""
    import random
    import socket

    for _ in range(100):
        port = random.randrange(20000, 32000)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            return f"127.0.0.1:{port}"
        except OSError:
            continue
    raise RuntimeError("no free port in 20000-32000")


def test_two_ranks_on_threads_and_the_gil_is_released():
    """Two communicators in one process, each driven by its own thread: only possible if the
    GIL is released while a call blocks (rank 1 waits in init and barrier for rank 0)."""
    addr = _free_addr()
    comms = [None, None]
    results = {}

    def rank_main(r):
        c = chorus.init(rank=r, size=2, addr=addr, token="t")
        comms[r] = c
        x = np.full(4, r + 1.0, dtype=np.float32)
        c.allreduce(x)
        results[r] = x.copy()
        if r == 0:
            time.sleep(0.3)  # rank 1 waits in the barrier meanwhile
        c.barrier()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    ticks = 0
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        ticks += 1
        time.sleep(0.001)
    for t in threads:
        t.join(timeout=1)
    assert not any(t.is_alive() for t in threads), "watchdog: ranks still running"
    for r in (0, 1):
        np.testing.assert_array_equal(results[r], np.full(4, 3.0, dtype=np.float32))
        comms[r].close()
    assert ticks > 50, f"the main thread ran only {ticks} times while the ranks blocked"


def _until_inside(handle) -> None:
    """Wait until another thread is in a call with ``handle`` (its Python wrapper counts it
    just before the C call), then give that call a moment to be inside the library: no hook
    says when it is, and starting a thread is the slow part on a busy machine."""
    deadline = time.monotonic() + 10
    while handle._calls == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert handle._calls == 1, "the other thread did not start its call within 10 s"
    time.sleep(0.3)


def test_one_communicator_from_two_threads_at_once_is_refused():
    addr = _free_addr()
    comms = {}

    def init(r):
        comms[r] = chorus.init(rank=r, size=2, addr=addr)

    ts = [threading.Thread(target=init, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(timeout=60) for t in ts]
    c0, c1 = comms[0], comms[1]
    # Thread A blocks in a barrier on c0 (rank 1 is not there yet); the main thread's call on
    # c0 meanwhile must be refused, not interleaved.
    a = threading.Thread(target=c0.barrier)
    a.start()
    # Bound the main thread's call, so that a late start fails the test in seconds instead
    # of hanging it.
    _until_inside(c0._handle)
    with pytest.raises(chorus.InvalidUsageError, match="another thread"):
        c0.allreduce(np.ones(2), timeout=10)
    # Nor may it be freed under the call (ctypes released the GIL): close is refused and the
    # communicator stays open.
    with pytest.raises(chorus.InvalidUsageError, match="in use by another thread"):
        c0.close()
    assert "open" in repr(c0)
    c1.barrier()
    a.join(timeout=30)
    assert not a.is_alive()
    # The same for a compressor in use by a compressed allreduce.
    k0, k1 = chorus.Compressor("int8,min_bytes=0"), chorus.Compressor("int8,min_bytes=0")
    x0, x1 = np.ones(4096, dtype=np.float32), np.ones(4096, dtype=np.float32)
    a = threading.Thread(target=c0.allreduce, args=(x0,), kwargs={"compressor": k0})
    a.start()
    _until_inside(k0._handle)
    with pytest.raises(chorus.InvalidUsageError, match="compressor is in use"):
        k0.close()
    c1.allreduce(x1, compressor=k1)
    a.join(timeout=30)
    assert not a.is_alive()
    np.testing.assert_allclose(x0, 2.0, rtol=0.02)
    k0.close()
    k1.close()
    with pytest.raises(chorus.InvalidUsageError, match="closed"):
        k0.last_report()
    c0.close()
    c1.close()
    c0.close()  # idempotent
    with pytest.raises(chorus.InvalidUsageError, match="closed"):
        c0.barrier()


class _Bucket:
    """What the DDP hooks use of a ``torch.distributed.GradBucket``."""

    def __init__(self, index, buf, params):
        self._index, self._buf, self._params = index, buf, params

    def index(self):
        return self._index

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params


def _on_two_ranks(fn):
    """``fn(comm)`` on two ranks, each a thread with its own communicator; the results."""
    addr = _free_addr()
    out, errors = {}, []

    def rank_main(r):
        try:
            with chorus.init(rank=r, size=2, addr=addr) as c:
                out[r] = fn(c)
        except BaseException as e:  # noqa: BLE001 - reported below (pytest's failures too)
            errors.append(e)

    ts = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(timeout=60) for t in ts]
    assert not any(t.is_alive() for t in ts), "watchdog: ranks still running"
    assert not errors, errors
    assert sorted(out) == [0, 1], out
    return out


def test_a_refusal_of_the_package_is_compared_with_check_calls(monkeypatch):
    """With CHORUS_CHECK_CALLS=1, a call the package refuses before calling in (a dtype chorus
    does not reduce) takes part in the comparison of calls: the other rank fails at once,
    naming it, not at its timeout, and the ranks stay in step."""
    monkeypatch.setenv("CHORUS_CHECK_CALLS", "1")
    monkeypatch.setenv("CHORUS_TIMEOUT", "30")

    def body(c):
        began = time.monotonic()
        if c.rank == 0:
            with pytest.raises(chorus.InvalidArgumentError):
                c.allreduce(np.ones(3, dtype=np.complex64))
            message = ""
        else:
            with pytest.raises(chorus.MismatchError) as e:
                c.allreduce(np.ones(3, dtype=np.float32))
            message = e.value.message
        took = time.monotonic() - began
        x = np.ones(2, dtype=np.float32)
        c.allreduce(x)
        return message, took, x.tolist()

    out = _on_two_ranks(body)
    assert "rank 0: a call that refused" in out[1][0], out[1][0]
    for message, took, x in out.values():
        assert took < 15 and x == [2.0, 2.0], (message, took, x)


def test_set_timeout_bounds_later_calls():
    """A timeout set after init is the later calls': a rank that waits for a late one fails
    within it (a ChorusTimeoutError, also a RuntimeError as Gloo's); bad values are refused."""
    assert issubclass(chorus.ChorusTimeoutError, RuntimeError)
    assert issubclass(chorus.RemoteError, RuntimeError)

    def body(c):
        for bad in (0, -1, float("nan"), 1e9, 10**400, "5", True):
            with pytest.raises(chorus.InvalidArgumentError):
                c.set_timeout(bad)
        c.set_timeout(np.float32(30))
        c.set_timeout(torch.tensor(30.0))  # what float() takes, as before
        for bad in (torch.ones(2), "5", complex(1, 0)):
            with pytest.raises(chorus.InvalidArgumentError):
                c.set_timeout(bad)
        c.set_timeout(0.5)
        c.barrier()  # both here: fine
        began = time.monotonic()
        if c.rank == 1:
            time.sleep(3)
        try:
            c.barrier()
        except chorus.ChorusError as e:
            return type(e), time.monotonic() - began
        return None, time.monotonic() - began

    out = _on_two_ranks(body)
    kind, took = out[0]
    assert kind is chorus.ChorusTimeoutError and took < 2.5, (kind, took)


def test_a_root_refused_in_python_does_not_take_the_refused_calls_data():
    """Rank 1, the root, forgets its output (refused by this package before C); rank 0's block
    goes out. The root's next gather must not return that block as its own result."""

    def run(c):
        x = np.full(2, 10 * (c.rank + 1), dtype=np.int32)
        if c.rank == 1:
            with pytest.raises(chorus.InvalidArgumentError, match="output"):
                c.gather(x, None, root=1)
        else:
            c.gather(x, None, root=1)
        out = np.zeros(4, dtype=np.int32) if c.rank == 1 else None
        try:
            c.gather(x + 1, out, root=1)
        except chorus.ChorusError as e:
            return type(e).__name__
        return out

    got = _on_two_ranks(run)
    assert isinstance(got[1], str), f"the root's second gather returned {got[1]}"


def test_ddp_hook_divides_before_it_sums():
    """float16 gradients of 40000 on two ranks: their sum (80000) overflows float16, their
    average does not; DDP's default hook divides first, and so must ours."""
    from chorus.ddp import allreduce_hook

    def run(c):
        g = torch.full((64,), 40000.0, dtype=torch.float16)
        fut = allreduce_hook(c, _Bucket(0, g, [torch.zeros(1)]))
        return fut.wait()

    for r, g in _on_two_ranks(run).items():
        assert torch.isfinite(g).all(), f"rank {r}: {g[:4]}"
        assert torch.equal(g, torch.full((64,), 40000.0, dtype=torch.float16)), g[:4]


def test_compressed_hook_keeps_a_compressor_per_bucket_and_its_parameters():
    from chorus.ddp import CompressedHookState, compressed_allreduce_hook

    def run(c):
        state = CompressedHookState(c, "int8,min_bytes=0")
        p1, p2 = torch.zeros(1), torch.zeros(1)
        seen = []
        for params in ([p1], [p1], [p2]):  # the last: DDP rebuilt bucket 0 with other params
            g = torch.ones(4096)
            compressed_allreduce_hook(state, _Bucket(0, g, params)).wait()
            assert torch.allclose(g, torch.ones(4096), rtol=0.02), g[:4]
            seen.append(state.compressors[0][1])
        return seen

    for seen in _on_two_ranks(run).values():
        assert seen[0] is seen[1], "the same bucket got a new compressor"
        assert seen[2] is not seen[1], "a rebuilt bucket kept another bucket's compressor"


def test_ddp_hooks_leave_a_refused_bucket_as_it_was():
    """A call refused (here: the communicator closed) leaves a float32 bucket undivided, so
    that a caller that catches the error and retries does not average twice."""
    from chorus.ddp import allreduce_hook, sync_allreduce_hook

    def run(c):
        c.barrier()
        c.close()
        left = []
        for hook in (allreduce_hook, sync_allreduce_hook):
            g = torch.full((8,), 3.0)
            with pytest.raises(chorus.InvalidUsageError):
                hook(c, _Bucket(0, g, [torch.zeros(1)])).wait()
            left.append(g)
        return left

    for left in _on_two_ranks(run).values():
        for g in left:
            assert torch.equal(g, torch.full((8,), 3.0)), g


def test_compressed_hook_averages_buckets_it_cannot_compress():
    """A float64 bucket (a double-precision model) is averaged uncompressed, with one
    warning, instead of failing every backward pass."""
    from chorus.ddp import CompressedHookState, compressed_allreduce_hook

    def run(c):
        state = CompressedHookState(c, "int8,min_bytes=0")
        got = []
        for _ in range(2):
            g = torch.full((4096,), float(c.rank + 1), dtype=torch.float64)
            compressed_allreduce_hook(state, _Bucket(0, g, [torch.zeros(1)])).wait()
            got.append(g)
        return got, state.warned_uncompressed

    with warnings.catch_warnings(record=True) as caught:  # (the ranks are threads)
        warnings.simplefilter("always")
        results = _on_two_ranks(run)
    for r, (got, warned) in results.items():
        assert warned, f"rank {r} did not say the buckets went uncompressed"
        for g in got:
            assert torch.equal(g, torch.full((4096,), 1.5, dtype=torch.float64)), (r, g[:4])
    said = [w for w in caught if "uncompressed" in str(w.message)]
    assert 1 <= len(said) <= 2, [str(w.message) for w in caught]


@pytest.mark.skipif(not hasattr(torch, "uint32"), reason="this torch has no uint32 tensors")
def test_unsigned_torch_tensors_reduce_as_numpy_arrays_do():
    def run(c):
        outs = []
        for dt in (torch.uint32, torch.uint64):
            t = torch.full((5,), 2**31 + c.rank, dtype=dt)
            c.allreduce(t, op="max")
            outs.append(int(t[0]))
        return outs

    for got in _on_two_ranks(run).values():
        assert got == [2**31 + 1, 2**31 + 1], got


def test_backend_group_keys_agree_across_group_sizes_on_one_store():
    """Groups made one after another on one store (torchrun's agent store outlives
    ``destroy_process_group``): every member of a group reads the key its first rank writes,
    and never an earlier group's, also when the sizes differ in between."""
    import chorus.backend as backend

    class Store:  # the part of torch's Store the backend uses to pick the key
        def __init__(self):
            self.counts = {}

        def add(self, key, n):
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]

    store = Store()
    seen = set()
    for size in [3, 2, 3, 4, 2, 1, 3]:
        keys = {backend._group_key(store, size) for _ in range(size)}
        assert len(keys) == 1, (size, keys)
        assert not keys & seen, (size, keys, seen)
        seen |= keys


def test_backend_stand_ins_are_copied_in_issue_order_and_never_after_a_failure():
    """A receive the torch backend took into a stand-in (its tensor was another live
    transfer's) is copied over once done: after the earlier ops on that memory (the later
    receive wins, whichever is waited first), and not at all when it failed."""
    import chorus.backend as backend

    class Req:  # what _P2P uses of a chorus.Request
        def __init__(self, error=None):
            self.error = error

        def test(self):
            return True

        def wait(self):
            if self.error is not None:
                raise self.error

    target = torch.zeros(4)
    first = backend._P2P(False, [target], 1, [target])
    first.copies, first.reqs = [(torch.full((4,), 1.0), target)], [Req()]
    second = backend._P2P(False, [target], 2, [target])
    second.copies, second.reqs, second.deps = [(torch.full((4,), 2.0), target)], [Req()], [first]
    second.wait()  # waited first: the first's copy still goes first
    assert (target == 2.0).all(), target
    first.wait()
    assert (target == 2.0).all(), target  # copied once, already
    failed = backend._P2P(False, [target], 1, [target])
    failed.copies = [(torch.full((4,), 7.0), target)]
    failed.reqs = [Req(chorus.ChorusError("lost the peer"))]
    assert failed.done()
    assert (target == 2.0).all(), target
    with pytest.raises(chorus.ChorusError):
        failed.wait()
    assert (target == 2.0).all(), target


def test_futures_of_collectives_complete_in_order_among_transfers():
    """With transfers pending too, the futures thread completes transfers' futures as they
    finish, but collectives' only in the order issued (a DDP hook's callbacks may issue
    collectives, which must come in the same order on every rank)."""
    order = []

    # X cannot finish before all four are queued, however late this thread runs.
    go = threading.Event()

    class Req:  # what the futures thread uses of a chorus.Request
        def __init__(self, name, transfer, ready_after, gate=None):
            self.name, self.calls, self.ready_after, self.gate = name, 0, ready_after, gate
            self._given_up = [] if transfer else None

        def test(self):
            if self.gate is not None and not self.gate.is_set():
                return False
            self.calls += 1
            return self.calls > self.ready_after

        def wait(self):
            while not self.test():
                time.sleep(0.001)
            order.append(self.name)
            return self.name

    class Owner:
        pass

    owner = Owner()
    done = chorus._Completer(owner)
    futs = []
    try:
        # A transfer that takes a while keeps the thread polling; then a slow collective, a
        # ready one behind it, and a ready transfer arrive together.
        for name, transfer, after in [("X", True, 30), ("A", False, 10), ("B", False, 0), ("T", True, 0)]:
            f = torch.futures.Future()
            done.put((Req(name, transfer, after, go if name == "X" else None), f))
            futs.append(f)
        go.set()
        for f in futs:
            f.wait()
    finally:
        done.stop()
    assert order.index("B") > order.index("A"), order
    assert order.index("T") < order.index("X"), order


@pytest.mark.parametrize("how", ["explicit", "env"])
def test_an_invalid_setting_on_one_rank_fails_the_others_at_once(how):
    """A rank whose CHORUS_* variable is invalid fails its init at once, explicit or from the
    environment, and tells the others: they fail naming it, not at their init timeout (60 s
    here)."""
    import os
    import subprocess
    import sys

    addr = _free_addr()
    join = {
        "explicit": "chorus.init(rank=int(sys.argv[1]), size=2, addr=sys.argv[2])",
        "env": "chorus.init()",
    }[how]
    code = (
        "import chorus, sys\n"
        "try:\n"
        f"    {join}\n"
        "except chorus.ChorusError as e:\n"
        "    print(type(e).__name__, e.message)\n"
        "    sys.exit(3)\n"
        "print('joined')\n"
    )
    env = dict(os.environ, CHORUS_INIT_TIMEOUT="60", PYTHONPATH=os.pathsep.join(sys.path))
    for k in [k for k in env if k.startswith("CHORUS_") and k not in ("CHORUS_LIBRARY",
                                                                   "CHORUS_INIT_TIMEOUT")]:
        del env[k]
    bad = dict(env, CHORUS_TIMEOUT="soon")
    began = time.monotonic()

    def rank_env(r, e):
        if how == "env":
            return dict(e, CHORUS_RANK=str(r), CHORUS_WORLD_SIZE="2", CHORUS_ADDR=addr)
        return e

    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(r), addr], env=rank_env(r, e),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r, e in ((0, env), (1, bad))
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    took = time.monotonic() - began
    assert [p.returncode for p in procs] == [3, 3], outs
    assert "CHORUS_TIMEOUT" in outs[1], outs[1]
    assert "rank 1" in outs[0] and "CHORUS_TIMEOUT" in outs[0], outs[0]
    assert took < 30, (took, outs)


def test_the_future_of_a_completed_request_outlives_the_communicator():
    """``get_future`` of a request already waited gives its result, also after ``close``
    (no futures thread is needed, or started); an error likewise."""

    def run(c):
        # A future before: the communicator's futures thread runs, and stops at close.
        y = np.ones(2, dtype=np.float32)
        c.allreduce(y, async_op=True).get_future().wait()
        x = np.full(4, float(c.rank + 1), dtype=np.float32)
        req = c.allreduce(x, async_op=True)
        req.wait()
        c.close()
        fut = req.get_future()
        return fut.wait().tolist()

    for got in _on_two_ranks(run).values():
        assert got == [3.0] * 4, got

    def run_without_one_before(c):
        # No future before close: the one asked for after starts no thread either.
        x = np.full(4, float(c.rank + 1), dtype=np.float32)
        req = c.allreduce(x, async_op=True)
        req.wait()
        c.close()
        threads = lambda: sum(t.name == "chorus-futures" for t in threading.enumerate())  # noqa: E731
        before = threads()
        fut = req.get_future()
        return fut.wait().tolist(), threads() - before

    for got, started in _on_two_ranks(run_without_one_before).values():
        assert got == [3.0] * 4 and started == 0, (got, started)
