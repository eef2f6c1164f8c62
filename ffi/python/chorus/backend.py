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
thread with the GIL released; ``async_op=True`` returns work that is already complete.
Calls from several threads on one group wait for each other (the ranks must still make them
in the same order).
Timeouts are chorus's (``CHORUS_TIMEOUT``, ``CHORUS_INIT_TIMEOUT``), not the ``timeout`` of
``init_process_group``.

Point-to-point messages travel on a copy of the group's communicator (``dup``), so they
never meet its collectives. ``send`` and ``isend`` block until the message is handed to the
transport (large messages: until the peer receives them); ``batch_isend_irecv`` runs its k-th
send together with its k-th receive in one ``sendrecv``, so rings and pairwise exchanges of any
size complete.

Supported: ``all_reduce`` (sum, product, min, max, avg), ``broadcast``, ``reduce``,
``all_gather`` (tensors of different sizes too, through allgatherv),
``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all``,
``all_to_all_single`` (with split sizes too, through alltoallv), ``gather``, ``scatter``,
``barrier``, ``send`` and ``recv`` (tag 0: messages between two ranks are matched in order),
and what is built on them (``all_gather_object``, ``broadcast_object_list``, DDP). Not
supported, with an error saying so: ``recv`` from any source, bitwise reductions, other tags.
"""

import functools
import threading
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import (
    ChorusError,
    Communicator,
    InvalidArgumentError,
    UnsupportedError,
    init,
    unique_id,
)

__all__ = ["ProcessGroupChorus", "register"]

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


def _op(opts: Any) -> str:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for k, v in _OPS.items():
        if op == k:
            return v
    raise UnsupportedError(f"chorus backend: reduce op {op} is not supported (sum, product, min, max, avg)")


def _done(value: Any) -> Any:
    """A completed ``Work`` whose future holds ``value``. (A C++ work made from a future: a
    Python subclass of ``Work`` handed to C++, as DDP's reducer does, can be collected before
    C++ calls it.)"""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _flat(t: torch.Tensor, what: str, op: Optional[str] = None) -> torch.Tensor:
    """``t`` as the 1-D tensor chorus moves: a view sharing its memory."""
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"chorus backend: {what} is on {t.device}; chorus moves CPU tensors")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"chorus backend: {what} is not contiguous")
    if t.is_complex():
        if op not in (None, "sum", "avg"):
            raise UnsupportedError(f"chorus backend: {op} of complex tensors")
        t = torch.view_as_real(t)
    return t.reshape(-1)


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


_collective = _serial("_lock")
_p2p = _serial("_p2p_lock")


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
        # Sends and receives queued between _start_coalescing and _end_coalescing
        # (batch_isend_irecv): (is_send, tensor, peer, future).
        self._batch: Optional[List[Any]] = None

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # ---- collectives -------------------------------------------------------------------

    @_collective
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts)
        for i, t in enumerate(tensors):
            self.comm.allreduce(_flat(t, f"tensors[{i}]", op), op=op)
        return _done(tensors)

    @_collective
    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    @_collective
    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        for i, t in enumerate(tensors):
            self.comm.broadcast(_flat(t, f"tensors[{i}]"), root=root)
        return _done(tensors)

    @_collective
    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts)
        for i, t in enumerate(tensors):
            self.comm.reduce(_flat(t, f"tensors[{i}]", op), root=opts.rootRank, op=op)
        return _done(tensors)

    @_collective
    def allgather(
        self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, x in zip(outputs, inputs):
            self._allgather_list(out, x)
        return _done(outputs)

    @_collective
    def allgather_coalesced(
        self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        # One list per rank of one output per input.
        for j, x in enumerate(inputs):
            self._allgather_list([outs[j] for outs in outputs], x)
        return _done(outputs)

    def _allgather_list(self, out: Sequence[torch.Tensor], x: torch.Tensor) -> None:
        if len(out) != self.comm.size:
            raise InvalidArgumentError(
                f"chorus backend: all_gather needs {self.comm.size} output tensors, got {len(out)}"
            )
        src = _flat(x, "the input")
        counts = [_flat(o, "an output").numel() for o in out]
        if any(o.dtype != x.dtype for o in out):
            raise InvalidArgumentError("chorus backend: all_gather outputs must have the input's dtype")
        flat = torch.empty(sum(counts), dtype=src.dtype)
        if all(c == src.numel() for c in counts):
            self.comm.allgather(src, flat)
        else:
            self.comm.allgatherv(src, flat, counts)
        for o, part in zip(out, flat.split(counts)):
            _flat(o, "an output").copy_(part)

    @_collective
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self.comm.allgather(_flat(input, "the input"), _flat(output, "the output"))
        return _done([output])

    @_collective
    def reduce_scatter(
        self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = _op(opts)
        for out, ins in zip(outputs, inputs):
            if len(ins) != self.comm.size:
                raise InvalidArgumentError(
                    f"chorus backend: reduce_scatter needs {self.comm.size} inputs, got {len(ins)}"
                )
            o = _flat(out, "the output", op)
            if any(_flat(t, "an input", op).numel() != o.numel() for t in ins):
                raise InvalidArgumentError(
                    "chorus backend: reduce_scatter inputs must each have the output's size"
                )
            flat = torch.cat([_flat(t, "an input", op) for t in ins])
            self.comm.reduce_scatter(flat, o, op=op)
        return _done(outputs)

    @_collective
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
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
        src, dst = _flat(input, "the input"), _flat(output, "the output")
        p = self.comm.size
        if not output_split_sizes and not input_split_sizes:
            self.comm.alltoall(src, dst)
            return _done([output])
        # Split sizes count rows (the first dimension); chorus counts elements.
        def counts(t: torch.Tensor, splits: List[int], what: str) -> List[int]:
            rows = t.shape[0] if t.dim() > 0 else 1
            per_row = t.numel() // rows if rows else 0
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
            n = per_row * (2 if t.is_complex() else 1)
            return [s * n for s in splits]

        self.comm.alltoallv(
            src, counts(input, input_split_sizes, "the input"), dst,
            counts(output, output_split_sizes, "the output"),
        )
        return _done([output])

    @_collective
    def alltoall(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        p = self.comm.size
        if len(outputs) != p or len(inputs) != p:
            raise InvalidArgumentError(f"chorus backend: all_to_all needs {p} inputs and {p} outputs")
        ins = [_flat(t, "an input") for t in inputs]
        outs = [_flat(t, "an output") for t in outputs]
        if any(t.dtype != ins[0].dtype for t in ins + outs):
            raise InvalidArgumentError("chorus backend: all_to_all tensors must share one dtype")
        src = torch.cat(ins) if ins else torch.empty(0)
        dst = torch.empty(sum(t.numel() for t in outs), dtype=src.dtype)
        self.comm.alltoallv(src, [t.numel() for t in ins], dst, [t.numel() for t in outs])
        for o, part in zip(outs, dst.split([t.numel() for t in outs])):
            o.copy_(part)
        return _done(outputs)

    @_collective
    def gather(
        self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        root, p = opts.rootRank, self.comm.size
        for i, x in enumerate(inputs):
            src = _flat(x, "the input")
            if self.comm.rank == root:
                out = outputs[i]
                if len(out) != p:
                    raise InvalidArgumentError(f"chorus backend: gather needs {p} outputs on the root")
                flat = torch.empty(src.numel() * p, dtype=src.dtype)
                self.comm.gather(src, flat, root=root)
                for o, part in zip(out, flat.split(src.numel())):
                    _flat(o, "an output").copy_(part)
            else:
                self.comm.gather(src, None, root=root)
        return _done(outputs)

    @_collective
    def scatter(
        self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        root, p = opts.rootRank, self.comm.size
        for i, out in enumerate(outputs):
            dst = _flat(out, "the output")
            if self.comm.rank == root:
                ins = inputs[i]
                if len(ins) != p:
                    raise InvalidArgumentError(f"chorus backend: scatter needs {p} inputs on the root")
                src = torch.cat([_flat(t, "an input") for t in ins])
                self.comm.scatter(src, dst, root=root)
            else:
                self.comm.scatter(None, dst, root=root)
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

    @_p2p
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        self._tag(tag)
        flat = [_flat(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        if self._batch is not None:
            return self._queue(True, flat, dst, tensors)
        for t in flat:
            self.p2p.send(t, dst)
        return _done(tensors)

    @_p2p
    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        self._tag(tag)
        flat = [_flat(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        if self._batch is not None:
            return self._queue(False, flat, src, tensors)
        for t in flat:
            self.p2p.recv(t, src)
        return _done(tensors)

    # ---- batch_isend_irecv ---------------------------------------------------------------

    def _queue(self, is_send: bool, flat: List[torch.Tensor], peer: int, tensors: Any) -> Any:
        fut: torch.futures.Future = torch.futures.Future()
        assert self._batch is not None
        self._batch.append((is_send, flat, peer, fut, tensors))
        return torch._C._distributed_c10d._create_work_from_future(fut)

    def _start_coalescing(self) -> None:
        self._batch = []

    @_p2p
    def _end_coalescing(self, reqs: Any = None) -> None:
        """Run the batch: the k-th send together with the k-th receive (one ``sendrecv``,
        both directions at once, so that a ring or a pairwise exchange of messages larger
        than the transport's buffers cannot deadlock), then what is left in order."""
        batch, self._batch = self._batch or [], None
        sends = [(flat, peer, fut, ts) for is_send, flat, peer, fut, ts in batch if is_send]
        recvs = [(flat, peer, fut, ts) for is_send, flat, peer, fut, ts in batch if not is_send]
        try:
            for k in range(max(len(sends), len(recvs))):
                s = sends[k] if k < len(sends) else None
                r = recvs[k] if k < len(recvs) else None
                if s is not None and r is not None and len(s[0]) == len(r[0]):
                    for a, b in zip(s[0], r[0]):
                        self.p2p.sendrecv(a, s[1], b, r[1])
                else:
                    for one in (s, r):
                        if one is None:
                            continue
                        for t in one[0]:
                            (self.p2p.send if one is s else self.p2p.recv)(t, one[1])
                for one in (s, r):
                    if one is not None:
                        one[2].set_result(one[3])
        except BaseException as e:
            for _, _, _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(e)
            raise

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        raise UnsupportedError("chorus backend: recv from any source is not supported; name the source")


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroupChorus:
    """torch's backend constructor: the group's first rank makes a unique id and shares it
    through the group's store.

    The key carries a generation: every member counts itself in (``store.add``), so a group
    made again on a store that outlives it (``destroy_process_group``, then
    ``init_process_group`` on torchrun's agent store) never reads the last one's id. When
    the first rank cannot make an id, it leaves an error there instead, and every member
    fails with it at once."""
    if not isinstance(rank, int) or not isinstance(size, int) or not 0 <= rank < size:
        # torch 1.13 takes new_group([]) for the default group, with no rank and size 0.
        raise InvalidArgumentError(
            f"chorus backend: rank {rank} of a group of {size}: a group needs at least one rank"
        )
    generation = (store.add(_STORE_KEY + "/joined", 1) - 1) // size
    key = f"{_STORE_KEY}/{generation}"
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
    return ProcessGroupChorus(init(rank=rank, size=size, unique_id=uid))


def register() -> None:
    """Register the backend ``"chorus"`` with ``torch.distributed`` (done on import; calling
    it again does nothing)."""
    if getattr(dist.Backend, NAME.upper(), None) is None:
        dist.Backend.register_backend(NAME, _create)


register()
