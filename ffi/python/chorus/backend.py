"""chorus as a ``torch.distributed`` backend.

Importing this module registers the backend ``"chorus"``; then every ``torch.distributed``
call runs over chorus, DistributedDataParallel included::

    import torch.distributed as dist
    import chorus.backend  # registers "chorus"

    dist.init_process_group("chorus")  # under torchrun or chorus-run, as for "gloo"
    dist.all_reduce(t)
    model = torch.nn.parallel.DistributedDataParallel(net)

Each process group (the default one and every ``new_group``) gets its own chorus
communicator: the group's first rank makes a unique id (:func:`chorus.unique_id`) and puts it in
the group's torch store, where the others read it. Collectives run as chorus runs them, on CPU
tensors (contiguous; complex tensors as pairs of reals for sums and averages), in the calling
thread with the GIL released; ``async_op=True`` returns work that is already complete. For
DDP with the gradients' allreduces overlapping the backward pass, register chorus's hook on
the group's communicator (:func:`communicator`).
Calls from several threads on one group wait for each other (the ranks must still make them
in the same order).
The ``timeout`` of ``init_process_group``/``new_group`` is the group's calls' (as with Gloo),
unless ``CHORUS_TIMEOUT`` is set; the group's setup itself waits ``CHORUS_INIT_TIMEOUT``
(300 s by default). A transfer (``isend``/``irecv``) must complete within the timeout of being
posted, once the calls issued before it have ended.

Data-moving collectives (broadcast, the gathers, scatters and all-to-alls) and
point-to-point messages move bytes, so they take any dtype (bool, int16, complex, ...);
reductions take chorus's dtypes.

Point-to-point messages travel on a copy of the group's communicator (``dup``), so they
never meet its collectives, and as bytes (Gloo does not check dtypes either). Each
``isend``/``irecv`` (and each op of ``batch_isend_irecv``, started together when the batch
closes, so that a batch with an op refused starts none of them, with torch 1.13 and 2.0;
from torch 2.1 ``batch_isend_irecv`` hands CPU tensors to the backend one op at a time, as
separate ``isend``/``irecv`` calls, and the ops before a refused one have started, as with
Gloo) is a chorus transfer that runs on its own: it never waits for ``wait()``, for a
later transfer or for a collective, so exchanges of any size and pattern complete, with
collectives between a transfer and its ``wait()`` too, as with Gloo. ``send``/``recv`` are
the same, waited for at once. The group keeps the transfers it started until they finish, so
dropping a work neither waits nor frees a tensor in use.

Supported: ``all_reduce`` (sum, product, min, max, avg; band, bor and bxor on integer
tensors), ``broadcast``, ``reduce``,
``all_gather`` (tensors of different sizes too, through allgatherv),
``all_gather_into_tensor``, ``reduce_scatter`` (tensors of different sizes too, through
reduce_scatterv), ``reduce_scatter_tensor``, ``all_to_all``,
``all_to_all_single`` (with split sizes too, through alltoallv), ``gather`` and ``scatter``
(tensors of different sizes too, through gatherv and scatterv),
``barrier``, ``send`` and ``recv`` (tag 0: messages between two ranks are matched in order),
and what is built on them (``all_gather_object``, ``broadcast_object_list``, DDP). Not
supported, with an error saying so: ``recv`` from any source, ``PREMUL_SUM``, bitwise
reductions of floating-point tensors, other tags, the multi-device forms
(``all_reduce_multigpu`` and kin: several tensors per rank).
"""

import functools
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import (
    ChorusError,
    Communicator,
    InvalidArgumentError,
    UnsupportedError,
    _counting_refusals,
    init,
    unique_id,
)

__all__ = ["ProcessGroupChorus", "communicator", "register"]

NAME = "chorus"
_STORE_KEY = "chorus/unique_id"

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}
if hasattr(dist.ReduceOp, "AVG"):
    _OPS[dist.ReduceOp.AVG] = "avg"
for _name, _chorus in (("BAND", "band"), ("BOR", "bor"), ("BXOR", "bxor")):
    if hasattr(dist.ReduceOp, _name):
        _OPS[getattr(dist.ReduceOp, _name)] = _chorus


def _op(opts: Any) -> str:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for k, v in _OPS.items():
        if op == k:
            return v
    raise UnsupportedError(
        f"chorus backend: reduce op {op} is not supported (sum, product, min, max, avg, "
        "band, bor, bxor)"
    )


def _done(value: Any) -> Any:
    """A completed ``Work`` whose future holds ``value``. (A C++ work made from a future: a
    Python subclass of ``Work`` handed to C++, as DDP's reducer does, can be collected before
    C++ calls it.)"""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _flat(t: torch.Tensor, what: str, op: Optional[str] = None) -> torch.Tensor:
    """``t`` as the 1-D tensor chorus reduces: a view sharing its memory."""
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"chorus backend: {what} is on {t.device}; chorus moves CPU tensors")
    if t.layout != torch.strided:
        # (Asked before is_contiguous, which a sparse tensor answers with torch's error.)
        raise InvalidArgumentError(f"chorus backend: {what} is a {t.layout} tensor; chorus moves dense tensors")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"chorus backend: {what} is not contiguous")
    if t.is_conj() or t.is_neg():
        # Its memory holds other values than it shows (a lazy conjugate or negation).
        raise InvalidArgumentError(
            f"chorus backend: {what} is a conjugate or negative view; resolve it first "
            "(resolve_conj(), resolve_neg())"
        )
    if t.is_complex():
        if op not in (None, "sum", "avg"):
            raise UnsupportedError(f"chorus backend: {op} of complex tensors")
        t = torch.view_as_real(t)
    # Detached, as c10d's collectives are not differentiable: a tensor that requires grad
    # (a forward pass's max for a vocabulary-parallel softmax, a loss to log) is reduced as
    # Gloo reduces it, its memory shared.
    return t.detach().reshape(-1)


def _bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``'s memory as a 1-D uint8 view, for the collectives that only move data."""
    return _flat(t, what).view(torch.uint8)


def _one_tensor(tensors: List[torch.Tensor], call: str) -> None:
    """The multi-device forms (``all_reduce_multigpu`` and kin: several tensors per rank,
    combined across all of them) are not supported: one tensor per rank."""
    if len(tensors) != 1:
        raise UnsupportedError(
            f"chorus backend: {call} of {len(tensors)} tensors per rank (the multi-device form) "
            "is not supported; pass one tensor"
        )


def _root(opts: Any) -> int:
    return int(getattr(opts, "rootRank", 0))


class _P2P:
    """One send or receive of the backend: its tensors' bytes and, once started, a chorus
    transfer (``isend``/``irecv``) per tensor."""

    __slots__ = (
        "is_send", "data", "peer", "tensors", "reqs", "error", "fut", "bufs", "copies", "deps",
        "mu",
    )

    def __init__(self, is_send: bool, data: List[torch.Tensor], peer: int, tensors: Any):
        self.is_send, self.data, self.peer, self.tensors = is_send, data, peer, tensors
        self.reqs: List[Any] = []
        # Set instead of reqs when the op could not start (its batch failed).
        self.error: Optional[BaseException] = None
        self.fut: Optional[torch.futures.Future] = None
        # What chorus moves, per tensor: the tensor itself, or a copy where its memory is
        # another live transfer's (see `_start`).
        self.bufs: List[torch.Tensor] = list(data)
        # (received into, the tensor it belongs in): copied over once the transfer is done,
        # after the earlier ops `deps` that use that memory (their copies first).
        self.copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.deps: List["_P2P"] = []
        self.mu = threading.Lock()

    def _settle(self, ok: bool) -> None:
        """Once the op's transfers are done: the copies over the tensors received into
        through stand-ins, after the ops they depend on have ended (none after a failure,
        which leaves the tensors as they were). Once; a second caller returns only after
        the first has copied."""
        with self.mu:
            if not self.copies:
                return
            for d in self.deps:
                d._finish_quietly()
            if ok:
                for got, target in self.copies:
                    target.copy_(got)
            self.copies, self.deps = [], []

    def _finish_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - its own waiter reports it
            pass

    def wait(self) -> Any:
        if self.error is not None:
            raise self.error
        try:
            for r in self.reqs:
                r.wait()  # raises the transfer's error
        except BaseException:
            self._settle(False)
            raise
        self._settle(True)
        return self.tensors

    def done(self) -> bool:
        if self.error is not None:
            return True
        if not all(r.test() for r in self.reqs) or not all(d.done() for d in self.deps):
            return False
        ok = True
        try:
            for r in self.reqs:
                r.wait()  # done: returns at once, or raises its error
        except Exception:  # noqa: BLE001 - reported by wait()
            ok = False
        self._settle(ok)
        return True

    def future(self) -> torch.futures.Future:
        """A future completed with the tensors (or the error) when every transfer is done."""
        if self.fut is None:
            if self.error is not None or not self.reqs:
                fut: torch.futures.Future = torch.futures.Future()
                if self.error is not None:
                    fut.set_exception(self.error)
                else:
                    fut.set_result(self.tensors)
                self.fut = fut
            else:
                tensors = self.tensors

                settle = self._settle

                def result(f: torch.futures.Future) -> Any:
                    try:
                        for one in f.value():
                            one.value()  # raises its error
                    except BaseException:
                        settle(False)
                        raise
                    settle(True)
                    return tensors

                all_done = torch.futures.collect_all([r.get_future() for r in self.reqs])
                self.fut = all_done.then(result)
        return self.fut


class _TransferWork(dist._Work):
    """The work of a backend ``isend``/``irecv`` (one op), or of a batch of them (the work
    torch 2.1 and later take from ``_end_coalescing``): its transfers run on their own, and
    ``wait()`` waits for them."""

    def __init__(self, *ops: _P2P):
        super().__init__()
        self._ops = ops

    def _done(self) -> bool:
        return all(op.done() for op in self._ops)

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the transfers; with a ``timeout`` (a ``timedelta`` or seconds; zero or
        None: none), raise ``RuntimeError`` once it passes (the transfers go on: wait again)."""
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if limit:
            deadline = time.monotonic() + float(limit)
            pause = 0.0005
            while not self._done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"chorus: the transfer did not complete within {float(limit):g} s "
                        "(it goes on; wait again for it)"
                    )
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.05)
        for op in self._ops:
            op.wait()
        return True

    def is_completed(self) -> bool:
        return self._done()

    def is_success(self) -> bool:
        if not self._done():
            return False
        try:
            for op in self._ops:
                op.wait()
        except Exception:  # noqa: BLE001 - a failed transfer
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        if len(self._ops) == 1:
            return self._ops[0].future()
        # Every op's, then their first error or the last one's value.
        every = torch.futures.collect_all([op.future() for op in self._ops])
        return every.then(lambda f: [g.wait() for g in f.value()][-1] if self._ops else None)

    def result(self) -> Any:
        value = None
        for op in self._ops:
            value = op.wait()
        return value


def _serial(lock_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the method holding the group's lock ``lock_name``: calls from several threads wait
    for each other (as Gloo queues them) rather than being refused by the communicator."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def locked(self: "ProcessGroupChorus", *args: Any, **kwargs: Any) -> Any:
            with getattr(self, lock_name):
                return f(self, *args, **kwargs)

        return locked

    return wrap


# _checked_first: a group call that is several chorus collectives checks every part before
# the first part goes: a part refused by this module after an earlier part reached chorus
# would not be counted as a call (see `chorus._counting_refusals`), and this rank's next call
# would take the peers' part instead.


def _collective(f: Callable[..., Any]) -> Callable[..., Any]:
    """A collective of the group: run holding its lock, and refused by a check of this module
    before it reached chorus, still counted as the group's call on this rank (see
    ``chorus._counting_refusals``)."""
    return _serial("_lock")(_counting_refusals(lambda group: group.comm)(f))


class ProcessGroupChorus(dist.ProcessGroup):
    """A ``torch.distributed`` process group over one chorus communicator (see the module
    documentation). Made by ``init_process_group("chorus")`` and ``new_group``."""

    def __init__(self, comm: Communicator):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._lock = threading.RLock()
        self._p2p_lock = threading.RLock()
        # Point-to-point messages travel on a copy of their own, so that a message a peer has
        # not received yet never meets the collectives (Gloo keeps them apart by tags).
        self.p2p = comm.dup()
        # Point-to-point ops started and maybe not finished (under _p2p_lock).
        self._started: List[_P2P] = []
        # Each thread's batch between _start_coalescing and _end_coalescing
        # (batch_isend_irecv): .batch, a list of _P2P, and .failed, an error while queuing.
        self._tls = threading.local()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # ---- collectives -------------------------------------------------------------------

    @_collective
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        _one_tensor(tensors, "all_reduce")
        return self.allreduce_coalesced(tensors, opts)

    @_collective
    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        # All checked before anything goes (see `_checked_first`). One tensor in place;
        # several, as Gloo does, reduced as one flat copy and copied back: a tensor listed
        # twice (or views that overlap) is then reduced once, not once per listing.
        op = _op(opts)
        flats = [_flat(t, f"tensors[{i}]", op) for i, t in enumerate(tensors)]
        if any(t.dtype != tensors[0].dtype for t in tensors):
            # (As Gloo; checked on the tensors, before a complex one is viewed as reals.)
            raise InvalidArgumentError(
                "chorus backend: all_reduce_coalesced needs tensors of one dtype"
            )
        if len(flats) == 1:
            self.comm.allreduce(flats[0], op=op)
        elif flats:
            joined = torch.cat(flats)
            self.comm.allreduce(joined, op=op)
            # Written back as chorus writes one tensor, inference tensors included (which
            # an in-place op outside inference mode refuses).
            with torch.inference_mode(any(f.is_inference() for f in flats)):
                at = 0
                for f in flats:
                    f.copy_(joined[at : at + f.numel()])
                    at += f.numel()
        return _done(tensors)

    @_collective
    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        _one_tensor(tensors, "broadcast")
        self.comm.broadcast(_bytes(tensors[0], "the tensor"), root=_root(opts))
        return _done(tensors)

    @_collective
    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        _one_tensor(tensors, "reduce")
        op = _op(opts)
        self.comm.reduce(_flat(tensors[0], "the tensor", op), root=_root(opts), op=op)
        return _done(tensors)

    @_collective
    def allgather(
        self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        _one_tensor(inputs, "all_gather")
        self._allgather_list(outputs[0], inputs[0])
        return _done(outputs)

    @_collective
    def allgather_coalesced(
        self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        # One list per rank of one output per input; all checked before the first goes.
        lists = [self._allgather_check([outs[j] for outs in outputs], x) for j, x in enumerate(inputs)]
        for checked in lists:
            self._allgather_run(*checked)
        return _done(outputs)

    def _blocks(
        self, tensors: Sequence[torch.Tensor], like: torch.Tensor, call: str, what: str,
        same_size: bool,
    ) -> List[torch.Tensor]:
        """The byte views of ``tensors``, one per rank of the group, each of ``like``'s
        dtype (and size, with ``same_size``)."""
        p = self.comm.size
        if len(tensors) != p:
            raise InvalidArgumentError(f"chorus backend: {call} needs {p} {what}s, got {len(tensors)}")
        views = [_bytes(t, f"an {what}") for t in tensors]
        size = _bytes(like, "a tensor").numel()
        if any(t.dtype != like.dtype for t in tensors) or (
            same_size and any(v.numel() != size for v in views)
        ):
            raise InvalidArgumentError(
                f"chorus backend: {call}: each {what} must have the dtype"
                + (" and size" if same_size else "")
                + f" of {tuple(like.shape)} {like.dtype}"
            )
        return views

    def _allgather_list(self, out: Sequence[torch.Tensor], x: torch.Tensor) -> None:
        self._allgather_run(*self._allgather_check(out, x))

    def _allgather_check(
        self, out: Sequence[torch.Tensor], x: torch.Tensor
    ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        return self._blocks(out, x, "all_gather", "output", same_size=False), _bytes(x, "the input")

    def _allgather_run(self, outs: List[torch.Tensor], src: torch.Tensor) -> None:
        counts = [o.numel() for o in outs]
        flat = torch.empty(sum(counts), dtype=torch.uint8)
        if all(c == src.numel() for c in counts):
            self.comm.allgather(src, flat)
        else:
            self.comm.allgatherv(src, flat, counts)
        for o, part in zip(outs, flat.split(counts)):
            o.copy_(part)

    @_collective
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if input.dtype != output.dtype:
            raise InvalidArgumentError("chorus backend: all_gather_into_tensor needs one dtype")
        self.comm.allgather(_bytes(input, "the input"), _bytes(output, "the output"))
        return _done([output])

    @_collective
    def reduce_scatter(
        self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = _op(opts)
        # All checked before the first goes (see `_checked_first`).
        calls = []
        for out, ins in zip(outputs, inputs):
            if len(ins) != self.comm.size:
                raise InvalidArgumentError(
                    f"chorus backend: reduce_scatter needs {self.comm.size} inputs, got {len(ins)}"
                )
            if any(t.dtype != out.dtype for t in ins):
                raise InvalidArgumentError("chorus backend: reduce_scatter needs one dtype")
            o = _flat(out, "the output", op)
            flats = [_flat(t, "an input", op) for t in ins]
            if any(t.dtype != o.dtype for t in flats):
                raise InvalidArgumentError("chorus backend: reduce_scatter needs one dtype")
            counts = [t.numel() for t in flats]
            if counts[self.comm.rank] != o.numel():
                raise InvalidArgumentError(
                    f"chorus backend: reduce_scatter: the output has {o.numel()} elements where "
                    f"this rank's input has {counts[self.comm.rank]}"
                )
            calls.append((flats, o, counts))
        for flats, o, counts in calls:
            # Concatenated here, part by part: a later part may read what an earlier one wrote.
            flat = torch.cat(flats)
            if all(n == o.numel() for n in counts):
                self.comm.reduce_scatter(flat, o, op=op)
            else:
                # Tensors of different sizes (as NCCL's backend takes them): every rank's
                # input j has rank j's output size.
                self.comm.reduce_scatterv(flat, o, counts, op=op)
        return _done(outputs)

    @_collective
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if input.dtype != output.dtype:
            raise InvalidArgumentError("chorus backend: reduce_scatter_tensor needs one dtype")
        op = _op(opts)
        self.comm.reduce_scatter(_flat(input, "the input", op), _flat(output, "the output", op), op=op)
        return _done([output])

    @_collective
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: Any = None,
    ) -> Any:
        if input.dtype != output.dtype:
            raise InvalidArgumentError("chorus backend: all_to_all_single needs one dtype")
        src, dst = _bytes(input, "the input"), _bytes(output, "the output")
        p = self.comm.size

        # Split sizes count rows (the first dimension); chorus counts bytes.
        def counts(t: torch.Tensor, b: torch.Tensor, splits: List[int], what: str) -> List[int]:
            rows = t.shape[0] if t.dim() > 0 else 1
            per_row = b.numel() // rows if rows else 0
            if not splits:
                if rows % p:
                    raise InvalidArgumentError(
                        f"chorus backend: all_to_all_single: {what} has {rows} rows, not a multiple of {p}"
                    )
                splits = [rows // p] * p
            if len(splits) != p or sum(splits) != rows:
                raise InvalidArgumentError(
                    f"chorus backend: all_to_all_single: {what} split sizes {list(splits)} do not "
                    f"split its {rows} rows {p} ways"
                )
            return [s * per_row for s in splits]

        send = counts(input, src, input_split_sizes, "the input")
        recv = counts(output, dst, output_split_sizes, "the output")
        # alltoallv always: a rank whose own blocks happen to be equal must make the same call
        # as a rank whose blocks are not (it runs the same pairwise exchange as alltoall).
        self.comm.alltoallv(src, send, dst, recv)
        return _done([output])

    @_collective
    def alltoall(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        if not inputs:
            raise InvalidArgumentError(f"chorus backend: all_to_all needs {self.comm.size} inputs")
        ins = self._blocks(inputs, inputs[0], "all_to_all", "input", same_size=False)
        outs = self._blocks(outputs, inputs[0], "all_to_all", "output", same_size=False)
        src = torch.cat(ins) if ins else torch.empty(0, dtype=torch.uint8)
        dst = torch.empty(sum(t.numel() for t in outs), dtype=torch.uint8)
        self.comm.alltoallv(src, [t.numel() for t in ins], dst, [t.numel() for t in outs])
        for o, part in zip(outs, dst.split([t.numel() for t in outs])):
            o.copy_(part)
        return _done(outputs)

    @_collective
    def gather(
        self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        # gatherv always: only the root knows every size, so tensors of different sizes
        # (rank j's input the size of the root's output j) work as well as equal ones.
        root = _root(opts)
        # All checked before the first goes (see `_checked_first`).
        calls = []
        for i, x in enumerate(inputs):
            src = _bytes(x, "the input")
            if self.comm.rank == root:
                calls.append((src, self._blocks(outputs[i], x, "gather", "output", same_size=False)))
            else:
                calls.append((src, None))
        for src, outs in calls:
            if outs is not None:
                counts = [o.numel() for o in outs]
                flat = torch.empty(sum(counts), dtype=torch.uint8)
                self.comm.gatherv(src, flat, counts, root=root)
                for o, part in zip(outs, flat.split(counts)):
                    o.copy_(part)
            else:
                self.comm.gatherv(src, None, None, root=root)
        return _done(outputs)

    @_collective
    def scatter(
        self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        # scatterv always, as gather above.
        root = _root(opts)
        # All checked before the first goes (see `_checked_first`).
        calls = []
        for i, out in enumerate(outputs):
            dst = _bytes(out, "the output")
            if self.comm.rank == root:
                calls.append((dst, self._blocks(inputs[i], out, "scatter", "input", same_size=False)))
            else:
                calls.append((dst, None))
        for dst, ins in calls:
            if ins is not None:
                self.comm.scatterv(torch.cat(ins), [t.numel() for t in ins], dst, root=root)
            else:
                self.comm.scatterv(None, None, dst, root=root)
        return _done(outputs)

    @_collective
    def barrier(self, opts: Any = None) -> Any:
        self.comm.barrier()
        return _done(None)

    # ---- point to point ----------------------------------------------------------------

    @staticmethod
    def _tag(tag: int) -> None:
        if tag != 0:
            raise UnsupportedError(
                f"chorus backend: send/recv tag {tag}: chorus matches the messages between two "
                "ranks in order and supports tag 0 only"
            )

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._p2p_op(True, tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._p2p_op(False, tensors, src, tag)

    def _p2p_op(self, is_send: bool, tensors: List[torch.Tensor], peer: int, tag: int) -> Any:
        tls = self._tls
        batch = getattr(tls, "batch", None)
        try:
            self._tag(tag)
            if not 0 <= peer < self.p2p.size:
                raise InvalidArgumentError(
                    f"chorus backend: peer {peer} is not a rank of this group of {self.p2p.size}"
                )
            data = [_bytes(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        except Exception as e:
            if batch is not None:
                # The batch must not run without this op: fail all of it (nothing sent).
                tls.failed = e
            raise
        op = _P2P(is_send, data, peer, tensors)
        if batch is not None:
            batch.append(op)
        else:
            self._start([op])
        return _TransferWork(op)

    def _start_coalescing(self, *_device: Any) -> None:
        # (torch 2.0 and later pass a device; it does not matter here: CPU tensors only.)
        if getattr(self._tls, "batch", None) is not None:
            raise InvalidArgumentError("chorus backend: a batch of sends and receives is already open")
        self._tls.batch, self._tls.failed = [], None
        # An exception being handled as the batch opens (the batch made inside an `except`)
        # is not the batch's: only another one at its end is (see `_end_coalescing`).
        self._tls.handling = sys.exc_info()[1]

    def _end_coalescing(self, *_reqs_or_device: Any) -> dist._Work:
        """Start the batch; the work of all of it (torch 2.1 and later wait for it, or hand
        it to the caller; earlier versions ignore it and wait for each op's)."""
        tls = self._tls
        batch, failed = getattr(tls, "batch", None) or [], getattr(tls, "failed", None)
        tls.batch, tls.failed = None, None
        handling, tls.handling = getattr(tls, "handling", None), None
        if failed is None and sys.exc_info()[1] not in (None, handling):
            # torch ends the batch from a `finally` while an error of its own (a peer outside
            # the group, say) propagates: the ops queued before it are not started either,
            # or the peer's next receives would take them.
            failed = sys.exc_info()[1]
        if failed is not None:
            for op in batch:
                op.error = failed
            return _TransferWork(*batch)
        self._start(batch)
        return _TransferWork(*batch)

    def _start(self, ops: List[_P2P]) -> None:
        """Start the transfers of ``ops``, in order, on the group's point-to-point
        communicator, with one call (chorus ``batch_isend_irecv``): each runs on its own, so
        no order of sends and receives across the ranks, and no collective before a
        ``wait()``, can deadlock them. If they cannot start, none does, and every op fails.

        chorus refuses a receive into memory another live transfer uses, and a send from
        memory a live receive writes; Gloo takes both (the data race is the caller's). So a
        receive into such memory goes into a stand-in, copied over once it is done (as if
        its message arrived then), and such a send goes from a copy taken now."""
        def span(t: torch.Tensor) -> Tuple[int, int]:
            return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

        with self._p2p_lock:
            # Kept until they finish: dropping a work must not wait for its transfers (a
            # chorus Request's finaliser would) nor free what they use.
            self._started = [o for o in self._started if not o.done()]
            # (start, end, written, op) of the memory live ops use: what chorus moves for
            # them, and the tensors their stand-ins are still to be copied over.
            held = []
            for o in self._started:
                held += [span(b) + (not o.is_send, o) for b in o.bufs if b.numel()]
                held += [span(t) + (True, o) for _, t in o.copies if t.numel()]
            batch = []
            for op in ops:
                op.bufs = []
                for t in op.data:
                    b = t
                    if t.numel():
                        s, e = span(t)
                        clash = [(w, o) for hs, he, w, o in held if s < he and hs < e]
                        if not op.is_send and clash:
                            b = torch.empty_like(t)
                            op.copies.append((b, t))
                            op.deps += [o for _, o in clash if o is not op and o not in op.deps]
                            held.append((s, e, True, op))
                        elif op.is_send and any(w for w, _ in clash):
                            b = t.clone()
                        held.append(span(b) + (not op.is_send, op))
                    op.bufs.append(b)
                    batch.append(("send" if op.is_send else "recv", b, op.peer))
            self._started.extend(ops)
            try:
                reqs = self.p2p.batch_isend_irecv(batch)
                k = 0
                for op in ops:
                    op.reqs = reqs[k : k + len(op.data)]
                    k += len(op.data)
            except BaseException as e:
                # (Ctrl-C too: an op must not look done with its tensors unfilled.)
                for op in ops:
                    if not op.reqs:
                        op.error = e
                raise

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        raise UnsupportedError("chorus backend: recv from any source is not supported; name the source")


def _group_key(store: Any, size: int) -> str:
    """The store key of the unique id of a group of ``size`` ranks made on ``store`` (torch's
    store of that group, under the group's name). The key carries the group's size and a
    generation: every member counts itself in among the groups of its size made on this
    store, so a group made again there (``destroy_process_group``, then
    ``init_process_group`` and ``new_group`` on torchrun's agent store, which outlives them)
    gets a new key on every member, also when groups of other sizes were made there in
    between. (A member of an earlier group of the same size that never counted itself in,
    one that died first, would shift the count: the group then fails at init.)"""
    generation = (store.add(f"{_STORE_KEY}/joined/{size}", 1) - 1) // size
    return f"{_STORE_KEY}/{size}/{generation}"


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroupChorus:
    """torch's backend constructor: the group's first rank makes a unique id and shares it
    through the group's store.

    The key is the group's (:func:`_group_key`), so a group made again on a store that
    outlives it never reads the last one's id. When the first rank cannot make an id, it
    leaves an error there instead, and every member fails with it at once."""
    if not isinstance(rank, int) or not isinstance(size, int) or not 0 <= rank < size:
        # torch 1.13 takes new_group([]) for the default group, with no rank and size 0.
        raise InvalidArgumentError(
            f"chorus backend: rank {rank} of a group of {size}: a group needs at least one rank"
        )
    key = _group_key(store, size)
    if rank == 0:
        try:
            uid = unique_id()
        except Exception as e:
            store.set(key, b"error:" + str(e).encode())
            raise
        store.set(key, uid)
    else:
        uid = bytes(store.get(key))
        if uid.startswith(b"error:"):
            raise ChorusError(
                "chorus backend: the group's first rank could not start it: "
                + uid[len(b"error:"):].decode(errors="replace")
            )
    comm = init(rank=rank, size=size, unique_id=uid)
    if not os.environ.get("CHORUS_TIMEOUT", "").strip():
        # The group's timeout (torch's default: 30 min), as Gloo takes it, unless chorus's
        # own is set; before the point-to-point copy is made, which starts from it.
        try:
            # (A longer one, such as timedelta.max for "none", is taken as chorus's longest.)
            comm.set_timeout(min(timeout.total_seconds(), 365 * 24 * 3600))
        except BaseException:
            comm.close()
            raise
    return ProcessGroupChorus(comm)


def communicator(group: Any = None) -> Communicator:
    """The chorus communicator of a process group of this backend (``None``: the default
    group), for chorus's own calls on the group's ranks: its nonblocking collectives, or the
    DDP hook that overlaps each bucket's allreduce with the backward pass, which the backend's
    synchronous ``allreduce`` does not::

        model.register_comm_hook(chorus.backend.communicator(), chorus.ddp.allreduce_hook)

    Its calls and the group's run on one communicator: every rank must make them in the same
    order, as with the group's own, and not from two threads at once (the group's calls wait
    for each other; a call on this communicator while another thread is in one on the group
    is refused with :class:`~chorus.InvalidUsageError`). A hook whose future's callbacks issue
    collectives (PowerSGD's pattern) should use a :meth:`~chorus.Communicator.dup` of it."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, ProcessGroupChorus):
        raise InvalidArgumentError(
            f"communicator: {type(group).__name__} is not a process group of the chorus backend"
        )
    return group.comm


def register() -> None:
    """Register the backend ``"chorus"`` with ``torch.distributed`` (done on import; calling
    it again does nothing)."""
    if getattr(dist.Backend, NAME.upper(), None) is None:
        dist.Backend.register_backend(NAME, _create)


register()
