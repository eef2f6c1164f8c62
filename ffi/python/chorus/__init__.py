"""chorus: collective communication for CPUs and ordinary networks, from Python.

Start the ranks with a launcher (``chorus-run -n 4 python train.py``, torchrun, mpirun,
srun), then::

    import numpy as np
    import chorus

    comm = chorus.init()                 # reads the launcher's environment
    grad = np.full(1024, comm.rank, dtype=np.float32)
    comm.allreduce(grad, op="sum")       # in place; returns grad
    comm.barrier()

Every collective works in place on numpy arrays and PyTorch CPU tensors (C-contiguous, native
byte order). Errors raise subclasses of :class:`ChorusError`, one per C status code; argument
errors (:class:`InvalidArgumentError`) leave the communicator usable (a refused collective
still counts as this rank's call: every rank makes the same calls, refused ones included; do
not retry it), errors involving a peer
(:class:`RemoteError`, :class:`ChorusTimeoutError`, :class:`MismatchError`) make it unusable:
call :meth:`Communicator.abort` and build a new one. The GIL is released while a collective
runs. Every collective also takes ``async_op=True``: it is issued and returns a
:class:`Request` at once (as ``MPI_Iallreduce``), and runs on the communicator's own thread
while Python goes on. For PyTorch DDP see :mod:`chorus.ddp`.
"""

import atexit
import contextlib
import functools
import ctypes
import operator
import numbers
import os
import sys
import threading
import time
import weakref
import zlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from . import _lib
from ._lib import lib

__all__ = [
    "ChorusError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "ChorusSystemError",
    "RemoteError",
    "ChorusTimeoutError",
    "MismatchError",
    "UnsupportedError",
    "InternalError",
    "Communicator",
    "Compressor",
    "Request",
    "init",
    "unique_id",
    "version",
    "DTYPES",
    "OPS",
]


def version() -> str:
    """The version of the loaded C library, e.g. ``"0.1.0"``."""
    return lib.chorus_version().decode()


__version__ = version()

# ---- errors ----------------------------------------------------------------------------


class ChorusError(Exception):
    """A chorus call failed. ``status`` is the C status code, ``message`` the details (which
    rank, which call, which peer, whether the communicator is still usable)."""

    status: int = -1

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class InvalidArgumentError(ChorusError, ValueError):
    """A bad argument (wrong dtype, size, device, layout, root...). Nothing was sent; the
    communicator is still usable, and a refused collective still counts as this rank's call.
    Status 1."""

    status = 1


class InvalidUsageError(ChorusError, RuntimeError):
    """A call not allowed now: the communicator is aborted, closed, broken by an earlier
    error, or in use by another thread. Status 2."""

    status = 2


class ChorusSystemError(ChorusError, OSError, RuntimeError):
    """An operating-system error (socket, address). Status 3."""

    status = 3


class RemoteError(ChorusError, ConnectionError, RuntimeError):
    """A peer was lost, aborted or sent garbage. The communicator is unusable. Status 4."""

    status = 4


class ChorusTimeoutError(ChorusError, TimeoutError, RuntimeError):
    """A peer did not answer in time. The communicator is unusable. Status 5. (Also a
    ``RuntimeError``, as Gloo's timeouts are, like :class:`RemoteError` and
    :class:`ChorusSystemError`: ``except RuntimeError`` around torch.distributed calls
    catches them.)"""

    status = 5


class MismatchError(ChorusError, RuntimeError):
    """Ranks called different collectives or with different sizes, dtypes or ops. The
    communicator is unusable. Status 6."""

    status = 6


class UnsupportedError(ChorusError, NotImplementedError):
    """Not supported by this build or for these arguments. Status 7."""

    status = 7


class InternalError(ChorusError, RuntimeError):
    """A bug in chorus. Status 8."""

    status = 8


_ERRORS = {
    cls.status: cls
    for cls in (
        InvalidArgumentError,
        InvalidUsageError,
        ChorusSystemError,
        RemoteError,
        ChorusTimeoutError,
        MismatchError,
        UnsupportedError,
        InternalError,
    )
}


class _KeptLastError:
    """Saves this thread's last error message and puts it back on exit: for finalizers, which
    the garbage collector may run between a failed call and the reading of its message (their
    own calls into chorus would overwrite it)."""

    def __enter__(self) -> "_KeptLastError":
        self._saved = lib.chorus_last_error()
        return self

    def __exit__(self, *exc: Any) -> None:
        lib.chorus_set_last_error(self._saved)


def _check(status: int, message: Optional[bytes] = None) -> None:
    """Raise the exception of a non-zero status with its message: ``message`` (this thread's
    last error, read right after the call), or this thread's last error now."""
    if status == 0:
        return
    if message is None:
        message = lib.chorus_last_error()
    detail = (message or b"").decode(errors="replace")
    name = lib.chorus_status_string(status).decode()
    cls = _ERRORS.get(status, ChorusError)
    raise cls(detail or name, status)


# ---- dtypes and ops --------------------------------------------------------------------

#: C dtype numbers (NCCL's) by name.
DTYPES: Dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
#: C op numbers (NCCL's) by name.
OPS: Dict[str, int] = {
    "sum": 0,
    "prod": 1,
    "max": 2,
    "min": 3,
    "avg": 4,
    # Bitwise, integer dtypes only (as MPI's MPI_BAND, MPI_BOR, MPI_BXOR).
    "band": 5,
    "bor": 6,
    "bxor": 7,
}
_OP_ALIASES = {"product": "prod", "mean": "avg", "average": "avg", "and": "band", "or": "bor", "xor": "bxor"}


def _op_code(op: str) -> int:
    if not isinstance(op, str):
        raise InvalidArgumentError(f"op must be a string such as 'sum', not {op!r}")
    key = _OP_ALIASES.get(op.lower(), op.lower())
    if key not in OPS:
        raise InvalidArgumentError(f"unknown op {op!r}: expected one of {', '.join(OPS)}")
    return OPS[key]


class _Buffer:
    """A contiguous CPU buffer: address, element count, C dtype, and the object owning it;
    ``written``: the torch tensor to mark written (see :func:`_mark_written`) once the call
    that writes it is made, after every argument was checked."""

    __slots__ = ("ptr", "count", "dtype", "itemsize", "obj", "written")

    def __init__(
        self, ptr: int, count: int, dtype: int, itemsize: int, obj: Any, written: Any = None
    ):
        self.ptr, self.count, self.dtype, self.itemsize, self.obj = (
            ptr,
            count,
            dtype,
            itemsize,
            obj,
        )
        self.written = written

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


def _torch_buffer(t: Any, what: str, writable: bool) -> _Buffer:
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"{what} is on device {t.device}; chorus works on CPU tensors (use .cpu())"
        )
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{what} has layout {t.layout}; chorus needs a dense tensor")
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what} is not contiguous (strides {tuple(t.stride())}); pass .contiguous() and "
            "copy the result back"
        )
    names = {
        torch.int8: "int8",
        torch.uint8: "uint8",
        torch.int32: "int32",
        torch.int64: "int64",
        torch.float16: "float16",
        torch.float32: "float32",
        torch.float64: "float64",
        torch.bfloat16: "bfloat16",
    }
    # Unsigned 32- and 64-bit tensors, where this torch has them (2.3 and later).
    for bits in (32, 64):
        unsigned = getattr(torch, f"uint{bits}", None)
        if unsigned is not None:
            names[unsigned] = f"uint{bits}"
    name = names.get(t.dtype)
    if name is None:
        raise InvalidArgumentError(
            f"{what} has dtype {t.dtype}; supported: {', '.join(str(d) for d in names)}"
        )
    if getattr(t, "is_neg", None) is not None and t.is_neg():
        # Its memory holds the negation of what it shows (a lazy negation view).
        raise InvalidArgumentError(f"{what} is a negative view; resolve it first (.resolve_neg())")
    if writable and t.requires_grad and torch.is_grad_enabled():
        # chorus writes its memory behind autograd's back: a leaf would change under its
        # gradient.
        raise InvalidArgumentError(
            f"{what} requires grad; use it under torch.no_grad() or pass .grad / .detach()"
        )
    written = t if writable else None
    # Held by the buffer (and so by a nonblocking call's request): a view of the memory
    # itself, which `t.data = ...`, `t.set_(...)` or `module.to(...)` before the call
    # completes would otherwise free under it (`resize_` of `t` meanwhile stays forbidden).
    return _Buffer(t.data_ptr(), t.numel(), DTYPES[name], t.element_size(), t.detach(), written)


def _mark_all_written(bufs: Iterable[Any]) -> None:
    """Marks the tensors of ``bufs`` that a call about to be made writes (others are skipped):
    only then, so that a call refused by a check in Python leaves them as they were."""
    for b in bufs:
        if isinstance(b, _Buffer) and b.written is not None:
            _mark_written(b.written)


def _mark_written(t: Any) -> None:
    """Tells autograd that ``t``'s memory is about to change, as an in-place operation does
    (its version counter, shared with its views and ``.detach()``, goes up): a tensor saved
    for backward (``x`` in ``loss = (w * x).sum()``), then overwritten by a collective, makes
    backward fail ("modified by an inplace operation") instead of giving wrong gradients."""
    torch = sys.modules["torch"]
    if getattr(t, "is_inference", None) is not None and t.is_inference():
        return  # no version counter: autograd cannot have saved it
    with torch.no_grad():
        t.view(-1)[:0].zero_()


def _numpy_buffer(a: Any, what: str, writable: bool) -> _Buffer:
    if not a.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous (strides {a.strides}); pass np.ascontiguousarray(x) "
            "and copy the result back"
        )
    if writable and not a.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only")
    dt = a.dtype
    code = _NUMPY_CODES.get(dt)
    if code is None:
        name = dt.name  # (computed by numpy in Python, about 1 us: hence the cache)
        if name not in DTYPES or (dt.byteorder not in ("=", "|") and dt.itemsize > 1):
            if name not in DTYPES:
                raise InvalidArgumentError(
                    f"{what} has dtype {dt}; supported: {', '.join(DTYPES)}"
                )
            raise InvalidArgumentError(f"{what} has non-native byte order ({dt.str})")
        code = _NUMPY_CODES[dt] = DTYPES[name]
    return _Buffer(a.ctypes.data, a.size, code, dt.itemsize, a)


#: The chorus dtype code of each numpy dtype accepted so far (only supported, native-order
#: ones: as many entries as DTYPES at most).
_NUMPY_CODES: Dict[Any, int] = {}


def _buffer(x: Any, what: str, writable: bool = True) -> _Buffer:
    """The buffer of a numpy array or PyTorch tensor, checked."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _torch_buffer(x, what, writable)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return _numpy_buffer(x, what, writable)
    raise InvalidArgumentError(
        f"{what} must be a numpy array or a PyTorch CPU tensor, not {type(x).__name__}"
    )


def _same_dtype(a: _Buffer, b: _Buffer, call: str) -> None:
    if a.dtype != b.dtype:
        names = {v: k for k, v in DTYPES.items()}
        raise InvalidArgumentError(
            f"{call}: input is {names[a.dtype]} but output is {names[b.dtype]}"
        )


def _p2p_ops(ops: Any, call: str) -> Tuple[Any, List[Tuple[_Buffer, Any, bool]]]:
    """The ``chorus_p2p_op`` array of ``ops`` (each ``("send", x, peer)`` or ``("recv", out,
    peer)``), checked, and per op its buffer, the array or tensor and whether it is a send."""
    try:
        n = len(ops)
    except TypeError:
        raise InvalidArgumentError(
            f"{call}: ops must be a sequence of (kind, buffer, peer), not {type(ops).__name__}"
        ) from None
    arr = (_lib.P2pOp * max(n, 1))()
    parsed: List[Tuple[_Buffer, Any, bool]] = []
    for i, op in enumerate(ops):
        if not isinstance(op, (tuple, list)) or len(op) != 3:
            raise InvalidArgumentError(
                f"{call}: ops[{i}] must be (\"send\" or \"recv\", buffer, peer), not {op!r}"
            )
        kind, x, peer = op
        if kind not in ("send", "recv"):
            raise InvalidArgumentError(
                f"{call}: ops[{i}] kind {kind!r} must be \"send\" or \"recv\""
            )
        is_send = kind == "send"
        b = _buffer(x, f"{call}: ops[{i}] buffer", writable=not is_send)
        e = arr[i]
        e.buf, e.count, e.dtype = b.ptr, b.count, b.dtype
        e.peer = _int(peer, f"{call}: ops[{i}] peer")
        e.kind = _lib.P2P_SEND if is_send else _lib.P2P_RECV
        parsed.append((b, x, is_send))
    return arr, parsed


def _seconds(value: Any, what: str) -> float:
    """``value`` (a real number, not a bool) as a float for C, which checks its range; a
    number too large for a float is infinity, refused there as any value out of range."""
    if _is_bool(value) or not (
        isinstance(value, numbers.Real) or hasattr(type(value), "__float__")
    ):
        raise InvalidArgumentError(f"{what} must be a number of seconds, not {value!r}")
    try:
        return float(value)
    except OverflowError:
        return float("inf")
    except (TypeError, ValueError) as e:  # a tensor of several elements, say
        raise InvalidArgumentError(f"{what} must be a number of seconds, not {value!r}") from e


#: Per thread: whether the collective in progress has called into the C library yet.
_reached = threading.local()


def _counting_refusals(comm_of: Callable[[Any], "Communicator"]) -> Callable[[Any], Any]:
    """A decorator for a collective: refused by a check of this package before it reached the
    C library (a root's missing ``out``, an unsupported form, a closed compressor, a value
    Python cannot convert), the call still uses up its place in the order
    of collectives on ``comm_of(self)``, as a refusal inside chorus does
    (``chorus_comm_refused_call``), so that the others' messages of that call are not taken
    for this rank's next one. Nested uses count a refusal once."""

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
            outer = getattr(_reached, "value", None)
            _reached.value = False
            try:
                return method(self, *args, **kwargs)
            except Exception:
                # Whatever stopped the call before C (a bad argument, an unsupported form, a
                # closed compressor, a value Python cannot convert): its place goes.
                if not _reached.value:
                    _reached.value = True  # counted: not again by an enclosing use
                    comm_of(self)._refused_call()
                raise
            finally:
                # What reached C (or was counted) inside counts for the enclosing use too.
                _reached.value = bool(_reached.value) or bool(outer)

        return checked

    return wrap


#: A collective of :class:`Communicator` (see :func:`_counting_refusals`).
_collective = _counting_refusals(lambda comm: comm)


class _Handle:
    """A handle of the C library that :meth:`take` (closing) gives up only while no call uses
    it: ctypes releases the GIL during a call, so another thread may try to close meanwhile,
    and freeing then would free what the call is using."""

    def __init__(self, h: ctypes.c_void_p, what: str):
        self._h: Optional[ctypes.c_void_p] = h
        self._what = what
        self._mu = threading.Condition()
        self._calls = 0
        # Of `_calls`, aborts: :meth:`take` waits for those rather than refusing (an abort
        # from another thread ends what close() waited for, and is out a moment later).
        self._aborts = 0

    @property
    def closed(self) -> bool:
        return self._h is None

    @contextlib.contextmanager
    def use(self, abort: bool = False) -> Iterator[ctypes.c_void_p]:
        """The handle, for one call (an abort: ``abort``); :class:`InvalidUsageError` once
        closed."""
        with self._mu:
            if self._h is None:
                raise InvalidUsageError(f"the {self._what} is closed")
            self._calls += 1
            self._aborts += abort
            h = self._h
        try:
            yield h
        finally:
            with self._mu:
                self._calls -= 1
                self._aborts -= abort
                self._mu.notify_all()

    def take(self) -> Optional[ctypes.c_void_p]:
        """The handle, which is closed from now on (None if it already was);
        :class:`InvalidUsageError` while another thread is inside a call with it."""
        with self._mu:
            # Aborts end quickly (the C library bounds them at 10 s): waited for.
            self._mu.wait_for(lambda: self._calls == 0 or self._calls != self._aborts, timeout=15.0)
            if self._calls:
                raise InvalidUsageError(
                    f"the {self._what} is in use by another thread; close it after that call "
                    "returns"
                )
            h, self._h = self._h, None
        return h


# ---- the communicator ------------------------------------------------------------------


class Communicator:
    """A group of ranks running collectives together (build one with :func:`init`).

    Every rank must call the same collectives in the same order with matching sizes, dtypes
    and ops. Calls on one communicator must not overlap in time (a second thread gets
    :class:`InvalidUsageError`), except :meth:`abort`, which ends a call running in another
    thread. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, handle: ctypes.c_void_p):
        self._handle = _Handle(handle, "communicator")
        self._completer_q: Optional[Any] = None
        self._completer_mu = threading.Lock()
        self._pid = os.getpid()
        # Requests issued and maybe still running: close() waits for them while abort() can
        # still reach the communicator.
        self._inflight: Any = weakref.WeakSet()
        self._inflight_mu = threading.Lock()
        # Buffers of transfers whose requests were dropped unwaited (given up, as
        # chorus_request_free): kept until no transfer runs (looked at as each transfer is
        # issued) or close(), which waits for every transfer.
        self._given_up: List[Any] = []
        self._given_up_mu = threading.Lock()
        r, s = ctypes.c_int(-1), ctypes.c_int(-1)
        _check(lib.chorus_comm_rank(handle, ctypes.byref(r)))
        _check(lib.chorus_comm_size(handle, ctypes.byref(s)))
        self._rank, self._size = r.value, s.value

    @property
    def rank(self) -> int:
        """This rank, ``0 <= rank < size``."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._size

    def _refused_call(self) -> None:
        """A collective this package refused before calling chorus still takes its place
        (``chorus_comm_refused_call``; see :func:`_counting_refusals`)."""
        try:
            with self._handle.use() as h:
                lib.chorus_comm_refused_call(h)
        except ChorusError:
            pass  # closed: the next call says so

    def _call(self, fn: Any, *args: Any, writes: Iterable[Any] = ()) -> None:
        """``fn(handle, *args)``, its status checked; the buffers ``writes`` (those of them
        that are torch tensors) are marked written first (:func:`_mark_written`)."""
        with self._handle.use() as h:
            _mark_all_written(writes)
            _reached.value = True
            _check(fn(h, *args))

    def _issue(
        self, name: str, args: Tuple[Any, ...], result: Any, keep: Tuple[Any, ...], async_op: bool
    ) -> Any:
        """Run the C collective ``chorus_<name>`` on ``args`` and return ``result``; or, with
        ``async_op``, issue ``chorus_i<name>`` and return a :class:`Request` for it that keeps
        ``keep`` (the buffers the call uses) alive until it completes (the counts are copied
        when it is issued)."""
        if not async_op:
            self._call(getattr(lib, "chorus_" + name), *args, writes=keep)
            return result
        nonblocking = lib.chorus_iallreduce if name == "allreduce_opts" else getattr(lib, "chorus_i" + name)
        # Made first, holding the buffers, so that nothing can free them once the call runs.
        req = Request(result, keep, self._completer)
        self._call(nonblocking, *args, ctypes.byref(req._h), writes=keep)
        with self._inflight_mu:
            self._inflight.add(req)
        return req

    def _completer(self) -> Any:
        """This communicator's futures thread (see :meth:`Request.get_future`), started on
        first use and ended by :meth:`close`."""
        with self._completer_mu:
            if self._completer_q is None:
                self._completer_q = _Completer(self)
            return self._completer_q

    @_collective
    def allreduce(
        self,
        x: Any,
        op: str = "sum",
        compressor: Optional["Compressor"] = None,
        *,
        algorithm: Optional[str] = None,
        timeout: Optional[float] = None,
        async_op: bool = False,
    ) -> Any:
        """Replace ``x`` on every rank by the element-wise reduction of everyone's ``x``.

        ``op``: ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"avg"``, or for integers
        ``"band"``, ``"bor"``, ``"bxor"``. ``algorithm`` forces a schedule (e.g. ``"ring"``);
        ``timeout`` (seconds) overrides the communicator's for this call (0: the
        communicator's; otherwise from 0.001 to one year). With a :class:`Compressor` (one per tensor, kept across steps) the
        allreduce is compressed: float32, float16 or bfloat16 data, ``"sum"`` or ``"avg"``;
        ``algorithm`` and ``timeout`` do not apply then. Returns ``x``; with ``async_op``, a
        :class:`Request` whose :meth:`~Request.wait` returns ``x`` (not with a compressor).
        """
        b = _buffer(x, "x")
        if compressor is not None:
            if not isinstance(compressor, Compressor):
                raise InvalidArgumentError(
                    f"compressor must be a chorus.Compressor, not {type(compressor).__name__}"
                )
            if algorithm is not None or timeout is not None:
                raise InvalidArgumentError(
                    "algorithm and timeout do not apply to a compressed allreduce"
                )
            if async_op:
                raise UnsupportedError("a compressed allreduce has no nonblocking form")
            op_code = _op_code(op)
            with compressor._handle.use() as c:
                self._call(
                    lib.chorus_allreduce_compressed, b.ptr, b.count, b.dtype, op_code, c, writes=(b,)
                )
            return x
        opts = None
        if algorithm is not None or timeout is not None:
            o = _lib.Options()
            o.size = ctypes.sizeof(_lib.Options)
            o.algorithm = _c_str(algorithm, "algorithm") if algorithm is not None else None
            o.timeout_seconds = _seconds(timeout, "allreduce: timeout") if timeout is not None else 0.0
            opts = ctypes.byref(o)
        args = (b.ptr, b.ptr, b.count, b.dtype, _op_code(op), opts)
        return self._issue("allreduce_opts", args, x, (b,), async_op)

    @_collective
    def barrier(self, *, async_op: bool = False) -> Any:
        """Block until every rank has called ``barrier`` (with ``async_op``: a
        :class:`Request` that completes then)."""
        return self._issue("barrier", (), None, (), async_op)

    @_collective
    def broadcast(self, x: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Copy ``x`` of rank ``root`` into ``x`` on every rank (same size everywhere).
        Returns ``x``."""
        b = _buffer(x, "x")
        args = (b.ptr, b.count, b.dtype, _int(root, "root"))
        return self._issue("broadcast", args, x, (b,), async_op)

    @_collective
    def reduce(self, x: Any, root: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce everyone's ``x`` into ``x`` of rank ``root`` (in place; ``x`` on the other
        ranks is left unchanged). Returns ``x``."""
        b = _buffer(x, "x")
        args = (b.ptr, b.ptr, b.count, b.dtype, _op_code(op), _int(root, "root"))
        return self._issue("reduce", args, x, (b,), async_op)

    @_collective
    def allgather(self, x: Any, out: Any, *, async_op: bool = False) -> Any:
        """Gather every rank's ``x`` into ``out`` (``size`` times as many elements), rank
        ``j``'s at block ``j``. Returns ``out``."""
        s, r = _buffer(x, "x", writable=False), _buffer(out, "out")
        _same_dtype(s, r, "allgather")
        if r.count != s.count * self.size:
            raise InvalidArgumentError(
                f"allgather: out has {r.count} elements, need {self.size} x {s.count}"
            )
        return self._issue("allgather", (s.ptr, r.ptr, s.count, s.dtype), out, (s, r), async_op)

    @_collective
    def allgatherv(
        self,
        x: Any,
        out: Any,
        counts: Sequence[int],
        *,
        displs: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``x`` into ``out``, rank ``j``'s ``x`` holding ``counts[j]``
        elements (any, zero included; as ``MPI_Allgatherv``, or torch's ``all_gather`` of
        tensors of different sizes): back to back in rank order, or, with ``displs``, rank
        ``j``'s block at element ``displs[j]`` of ``out`` (blocks not overlapping, in any
        order; the gaps keep their values). Every rank passes the same ``counts``; each lays
        out its own ``out``. Returns ``out``."""
        s, r = _buffer(x, "x", writable=False), _buffer(out, "out")
        _same_dtype(s, r, "allgatherv")
        c = self._counts(counts, "counts")
        d = self._layout(c, displs, "displs", r.count, "out", "allgatherv")
        if s.count != c[self.rank]:
            raise InvalidArgumentError(
                f"allgatherv: x has {s.count} elements, need counts[{self.rank}] = "
                f"{c[self.rank]}"
            )
        arr = (ctypes.c_size_t * len(c))(*c)
        return self._issue("allgatherv", (s.ptr, r.ptr, arr, d, s.dtype), out, (s, r), async_op)

    @_collective
    def alltoallv(
        self,
        x: Any,
        send_counts: Sequence[int],
        out: Any,
        recv_counts: Sequence[int],
        *,
        send_displs: Optional[Sequence[int]] = None,
        recv_displs: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Any:
        """Send ``send_counts[j]`` elements of ``x`` to rank ``j`` and receive
        ``recv_counts[j]`` elements from rank ``j`` into ``out`` (as ``MPI_Alltoallv``, or
        torch's ``all_to_all_single`` with split sizes). The blocks lie back to back in rank
        order, or at ``send_displs[j]`` of ``x`` (they may overlap) and ``recv_displs[j]`` of
        ``out`` (they may not; the gaps keep their values). This rank's ``send_counts[j]``
        must be rank ``j``'s ``recv_counts[rank]``. Returns ``out``."""
        s, r = _buffer(x, "x", writable=False), _buffer(out, "out")
        _same_dtype(s, r, "alltoallv")
        sc = self._counts(send_counts, "send_counts")
        rc = self._counts(recv_counts, "recv_counts")
        sd = self._layout(sc, send_displs, "send_displs", s.count, "x", "alltoallv")
        rd = self._layout(rc, recv_displs, "recv_displs", r.count, "out", "alltoallv")
        sa = (ctypes.c_size_t * len(sc))(*sc)
        ra = (ctypes.c_size_t * len(rc))(*rc)
        args = (s.ptr, sa, sd, r.ptr, ra, rd, s.dtype)
        return self._issue("alltoallv", args, out, (s, r), async_op)

    def _layout(
        self,
        counts: List[int],
        displs: Optional[Sequence[int]],
        what: str,
        have: int,
        buf: str,
        op: str,
    ) -> Any:
        """Checks that a buffer of ``have`` elements holds the blocks of ``counts``: back to
        back (``displs`` None; exactly their sum) or at ``displs`` (every non-empty block
        inside it). Returns the displacements for C (None: back to back)."""
        if displs is None:
            if have != sum(counts):
                raise InvalidArgumentError(
                    f"{op}: {buf} has {have} elements where the counts add up to {sum(counts)}"
                )
            return None
        d = self._counts(displs, what, ignore=[c == 0 for c in counts])
        for j, (c, at) in enumerate(zip(counts, d)):
            if c and at + c > have:
                raise InvalidArgumentError(
                    f"{op}: block {j} ({c} elements at {at}) lies beyond the {have} elements "
                    f"of {buf}"
                )
        return (ctypes.c_size_t * len(d))(*d)

    def _counts(
        self, counts: Sequence[int], what: str, ignore: Optional[List[bool]] = None
    ) -> List[int]:
        """``counts`` as ``size`` non-negative ints; entry ``j`` is not range-checked (and
        passed as 0) where ``ignore[j]`` (the displacement of an empty block, as in MPI)."""
        c = []
        try:
            for v in counts:
                if _is_bool(v):
                    raise TypeError
                c.append(operator.index(v))
        except TypeError:
            raise InvalidArgumentError(f"{what} must be a sequence of ints") from None
        if len(c) != self.size:
            raise InvalidArgumentError(f"{what} has {len(c)} entries for {self.size} ranks")
        if ignore is not None:
            c = [0 if skip else v for v, skip in zip(c, ignore)]
        if any(not 0 <= v < 2**62 for v in c):
            raise InvalidArgumentError(f"{what} holds a negative or huge count")
        return c

    @_collective
    def reduce_scatter(self, x: Any, out: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce everyone's ``x`` (``size`` blocks) and leave block ``rank`` of the result in
        ``out``. Returns ``out``."""
        s, r = _buffer(x, "x", writable=False), _buffer(out, "out")
        _same_dtype(s, r, "reduce_scatter")
        if s.count != r.count * self.size:
            raise InvalidArgumentError(
                f"reduce_scatter: x has {s.count} elements, need {self.size} x {r.count}"
            )
        args = (s.ptr, r.ptr, r.count, s.dtype, _op_code(op))
        return self._issue("reduce_scatter", args, out, (s, r), async_op)

    @_collective
    def reduce_scatterv(
        self, x: Any, out: Any, counts: Sequence[int], op: str = "sum", *, async_op: bool = False
    ) -> Any:
        """Reduce everyone's ``x`` (``size`` blocks back to back, block ``j`` of ``counts[j]``
        elements, any, zero included) and leave block ``rank`` of the result in ``out``
        (``counts[rank]`` elements), as ``MPI_Reduce_scatter`` or torch's ``reduce_scatter``
        of tensors of different sizes. Every rank passes the same ``counts``. Returns
        ``out``."""
        s, r = _buffer(x, "x", writable=False), _buffer(out, "out")
        _same_dtype(s, r, "reduce_scatterv")
        c = self._counts(counts, "counts")
        if s.count != sum(c) or r.count != c[self.rank]:
            raise InvalidArgumentError(
                f"reduce_scatterv: x has {s.count} elements and out {r.count}, need the sum of "
                f"the counts {sum(c)} and counts[{self.rank}] = {c[self.rank]}"
            )
        arr = (ctypes.c_size_t * len(c))(*c)
        args = (s.ptr, r.ptr, arr, s.dtype, _op_code(op))
        return self._issue("reduce_scatterv", args, out, (s, r), async_op)

    @_collective
    def alltoall(self, x: Any, out: Any, *, async_op: bool = False) -> Any:
        """Block ``j`` of this rank's ``x`` becomes block ``rank`` of rank ``j``'s ``out``
        (both ``size`` equal blocks). ``out`` may be ``x`` (in place). Returns ``out``."""
        s, r = _buffer(x, "x", writable=False), _buffer(out, "out")
        _same_dtype(s, r, "alltoall")
        if s.count != r.count or s.count % self.size:
            raise InvalidArgumentError(
                f"alltoall: x and out need the same number of elements, a multiple of "
                f"{self.size} (got {s.count} and {r.count})"
            )
        args = (s.ptr, r.ptr, s.count // self.size, s.dtype)
        return self._issue("alltoall", args, out, (s, r), async_op)

    @_collective
    def gather(self, x: Any, out: Any = None, root: int = 0, *, async_op: bool = False) -> Any:
        """Gather every rank's ``x`` into ``out`` on rank ``root`` (``size`` blocks; ``out``
        is only needed there). Returns ``out``."""
        s = _buffer(x, "x", writable=False)
        root = _int(root, "root")
        ptr, r = None, None
        if self.rank == root:
            if out is None:
                raise InvalidArgumentError("gather: the root needs an output buffer")
            r = _buffer(out, "out")
            _same_dtype(s, r, "gather")
            if r.count != s.count * self.size:
                raise InvalidArgumentError(
                    f"gather: out has {r.count} elements, need {self.size} x {s.count}"
                )
            ptr = r.ptr
        return self._issue("gather", (s.ptr, ptr, s.count, s.dtype, root), out, (s, r), async_op)

    @_collective
    def scatter(self, x: Any, out: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Block ``j`` of ``x`` on rank ``root`` (``size`` blocks; ``x`` is only needed there,
        pass ``None`` elsewhere) goes to ``out`` of rank ``j``. Returns ``out``."""
        r = _buffer(out, "out")
        root = _int(root, "root")
        ptr, s = None, None
        if self.rank == root:
            if x is None:
                raise InvalidArgumentError("scatter: the root needs an input buffer")
            s = _buffer(x, "x", writable=False)
            _same_dtype(s, r, "scatter")
            if s.count != r.count * self.size:
                raise InvalidArgumentError(
                    f"scatter: x has {s.count} elements, need {self.size} x {r.count}"
                )
            ptr = s.ptr
        return self._issue("scatter", (ptr, r.ptr, r.count, r.dtype, root), out, (s, r), async_op)

    @_collective
    def gatherv(
        self,
        x: Any,
        out: Any = None,
        counts: Optional[Sequence[int]] = None,
        root: int = 0,
        *,
        displs: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``x`` (any size, zero included) into ``out`` on rank ``root``,
        rank ``j``'s of ``counts[j]`` elements (as ``MPI_Gatherv``): back to back in rank
        order, or at element ``displs[j]`` of ``out`` (blocks not overlapping, in any order;
        the gaps keep their values). ``out``, ``counts`` and ``displs`` are only needed on the
        root. A rank whose ``x`` is not its count makes the root fail with
        :class:`MismatchError`. Returns ``out``."""
        s = _buffer(x, "x", writable=False)
        root = _int(root, "root")
        ptr, arr, d, r = None, None, None, None
        if self.rank == root:
            if out is None or counts is None:
                raise InvalidArgumentError("gatherv: the root needs out and counts")
            r = _buffer(out, "out")
            _same_dtype(s, r, "gatherv")
            c = self._counts(counts, "counts")
            d = self._layout(c, displs, "displs", r.count, "out", "gatherv")
            if s.count != c[root]:
                raise InvalidArgumentError(
                    f"gatherv: x has {s.count} elements, need counts[{root}] = {c[root]}"
                )
            ptr, arr = r.ptr, (ctypes.c_size_t * len(c))(*c)
        args = (s.ptr, s.count, ptr, arr, d, s.dtype, root)
        return self._issue("gatherv", args, out, (s, r), async_op)

    @_collective
    def scatterv(
        self,
        x: Any,
        counts: Optional[Sequence[int]],
        out: Any,
        root: int = 0,
        *,
        displs: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Any:
        """Block ``j`` of ``x`` on rank ``root`` (``counts[j]`` elements, any, zero included;
        back to back in rank order, or at element ``displs[j]`` of ``x``, overlapping or not)
        goes to ``out`` of rank ``j`` (as ``MPI_Scatterv``). ``x``, ``counts`` and ``displs``
        are only needed on the root (pass ``None`` elsewhere). A rank whose ``out`` is not its
        count fails with :class:`MismatchError`. Returns ``out``."""
        r = _buffer(out, "out")
        root = _int(root, "root")
        ptr, arr, d, s = None, None, None, None
        if self.rank == root:
            if x is None or counts is None:
                raise InvalidArgumentError("scatterv: the root needs x and counts")
            s = _buffer(x, "x", writable=False)
            _same_dtype(s, r, "scatterv")
            c = self._counts(counts, "counts")
            d = self._layout(c, displs, "displs", s.count, "x", "scatterv")
            if r.count != c[root]:
                raise InvalidArgumentError(
                    f"scatterv: out has {r.count} elements, need counts[{root}] = {c[root]}"
                )
            ptr, arr = s.ptr, (ctypes.c_size_t * len(c))(*c)
        args = (ptr, arr, d, r.ptr, r.count, r.dtype, root)
        return self._issue("scatterv", args, out, (s, r), async_op)

    @_collective
    def scan(
        self, x: Any, out: Any = None, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        """Inclusive prefix reduction (as ``MPI_Scan``): ``out`` of rank ``r`` gets the
        reduction of ``x`` of ranks ``0..=r``; in place (into ``x``) when ``out`` is None.
        ``op`` is any but ``"avg"``. Returns ``out`` (or ``x``)."""
        return self._scan("scan", x, out, op, async_op)

    @_collective
    def exscan(
        self, x: Any, out: Any = None, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        """Exclusive prefix reduction (as ``MPI_Exscan``): ``out`` of rank ``r`` gets the
        reduction of ``x`` of ranks ``0..r``; rank 0's ``out`` is left as it was. In place
        (into ``x``) when ``out`` is None. Returns ``out`` (or ``x``)."""
        return self._scan("exscan", x, out, op, async_op)

    def _scan(self, name: str, x: Any, out: Any, op: str, async_op: bool) -> Any:
        if out is None:
            b = _buffer(x, "x")
            args = (b.ptr, b.ptr, b.count, b.dtype, _op_code(op))
            return self._issue(name, args, x, (b,), async_op)
        s, r = _buffer(x, "x", writable=False), _buffer(out, "out")
        _same_dtype(s, r, name)
        if s.count != r.count:
            raise InvalidArgumentError(f"{name}: x has {s.count} elements and out {r.count}")
        args = (s.ptr, r.ptr, s.count, s.dtype, _op_code(op))
        return self._issue(name, args, out, (s, r), async_op)

    def send(self, x: Any, peer: int) -> None:
        """Send ``x`` to rank ``peer``, which must :meth:`recv` the same size and dtype."""
        b = _buffer(x, "x", writable=False)
        self._call(lib.chorus_send, b.ptr, b.count, b.dtype, _int(peer, "peer"))

    def recv(self, x: Any, peer: int) -> Any:
        """Receive into ``x`` exactly what rank ``peer`` sends. Returns ``x``."""
        b = _buffer(x, "x")
        self._call(lib.chorus_recv, b.ptr, b.count, b.dtype, _int(peer, "peer"), writes=(b,))
        return x

    def isend(self, x: Any, peer: int) -> "Request":
        """Start sending ``x`` to rank ``peer`` (as ``MPI_Isend``); returns a :class:`Request`
        whose :meth:`~Request.wait` returns ``x``. Do not write ``x`` until then.

        Transfers started with :meth:`isend` and :meth:`irecv` progress all live ones together
        and each on its own: none waits for a later one or for ``wait``, so any order of sends
        and receives across the ranks completes (a thread in ``wait`` drives them; the
        communicator's thread does in the background). Buffers of live transfers must not
        overlap, except sends' (a receive into memory a live transfer of this communicator
        uses, or a send from memory a live receive of it writes, is refused:
        :class:`InvalidArgumentError`; those of another communicator, a :meth:`dup` included,
        are not compared). Between two
        ranks messages are matched in the order issued (with :meth:`send` and :meth:`recv`
        too); a receive takes exactly its buffer's size and dtype. ``peer`` may be this rank.
        Each transfer must complete within the communicator's timeout. While a transfer's
        request is held (neither waited for nor dropped), the communicator's collectives are
        refused (:class:`InvalidUsageError`): keep a :meth:`dup` of it for point-to-point
        messages to run both at once. A request dropped unwaited gives its transfer up (it
        goes on; its buffers are kept until :meth:`close`), and a later collective waits for
        it first: a peer that receives only after that collective would wait for its timeout.
        A request kept alive by something else (an interactive shell's ``_``, a traceback)
        is still held."""
        b = _buffer(x, "x", writable=False)
        return self._transfer(lib.chorus_isend, b, x, peer)

    def irecv(self, x: Any, peer: int) -> "Request":
        """Start receiving into ``x`` exactly what rank ``peer`` sends (as ``MPI_Irecv``);
        returns a :class:`Request` whose :meth:`~Request.wait` returns ``x`` filled. Do not
        touch ``x`` until then. See :meth:`isend`."""
        b = _buffer(x, "x")
        return self._transfer(lib.chorus_irecv, b, x, peer)

    def _running_transfers(self) -> Optional[int]:
        """How many transfers run (``chorus_comm_transfers``); None once closed or failing."""
        n = ctypes.c_size_t(0)
        try:
            with self._handle.use() as h:
                status = lib.chorus_comm_transfers(h, ctypes.byref(n))
        except InvalidUsageError:
            return None
        return n.value if status == 0 else None

    def _wait_transfers(self) -> None:
        """Wait until no transfer runs (see :meth:`close`); at once if closed or failing."""
        pause = 0.0005
        while self._running_transfers():
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _release_given_up(self) -> None:
        """Let go of the buffers of given-up transfers once none runs any more (a loop of
        dropped isends must not keep every buffer until close())."""
        if not self._given_up:
            return
        with self._given_up_mu:
            # Buffers are only ever appended: the first `k` are of transfers issued before
            # the count is read, so all finished if it reads 0. Those appended meanwhile (a
            # transfer issued and dropped on another thread) are kept.
            k = len(self._given_up)
            # (None when closed: the call about to be made says so.)
            if self._running_transfers() == 0:
                del self._given_up[:k]

    def _transfer(self, fn: Any, b: Any, x: Any, peer: int) -> "Request":
        self._release_given_up()
        # Made first, holding the buffer, so that nothing can free it once the transfer runs.
        req = Request(x, (b, x), self._completer)
        # Dropped unwaited, it gives the transfer up (which goes on) rather than waiting for
        # it: its buffers move to the communicator until no transfer runs (or close()).
        req._given_up = self._given_up
        self._call(
            fn, b.ptr, b.count, b.dtype, _int(peer, "peer"), ctypes.byref(req._h), writes=(b,)
        )
        with self._inflight_mu:
            self._inflight.add(req)
        return req

    def sendrecv(self, x: Any, dest: int, out: Any, source: int) -> Any:
        """Send ``x`` to rank ``dest`` while receiving into ``out`` exactly what rank
        ``source`` sends, both at once (as ``MPI_Sendrecv``): a ring of these cannot
        deadlock, unlike blocking :meth:`send` calls larger than the transport buffers. With
        ``dest`` and ``source`` both this rank it copies. Returns ``out``."""
        s = _buffer(x, "x", writable=False)
        r = _buffer(out, "out")
        _same_dtype(s, r, "sendrecv")
        self._call(
            lib.chorus_sendrecv,
            s.ptr,
            s.count,
            _int(dest, "dest"),
            r.ptr,
            r.count,
            _int(source, "source"),
            s.dtype,
            writes=(r,),
        )
        return out

    def p2p_batch(self, ops: Sequence[Tuple[str, Any, int]], *, async_op: bool = False) -> Any:
        """Run every send and receive of ``ops`` at once, as torch's ``batch_isend_irecv``,
        NCCL's grouped send/recv, or ``MPI_Isend``/``MPI_Irecv`` and ``MPI_Waitall``: each op
        is ``("send", x, peer)`` or ``("recv", out, peer)``; all are posted together and
        progressed together, so their order cannot deadlock ranks that all use batches (a
        halo exchange with both neighbours, a pipeline's activations and gradients). Per peer and direction, messages are matched in order with this rank's
        and the peer's other point-to-point calls (the peer may answer with :meth:`recv`,
        :meth:`send`, :meth:`sendrecv` or a batch). A receive takes exactly its buffer's
        size and dtype. A send to this rank itself is copied into the receive from itself of
        the same order in the batch. Sends may share a buffer; a receive's buffer must not
        overlap any other. Returns the receive buffers, in order (with ``async_op``, a
        :class:`Request` whose ``wait()`` returns them)."""
        arr, parsed = _p2p_ops(ops, "p2p_batch")
        keep = tuple(b for b, _, _ in parsed)
        received = [x for _, x, is_send in parsed if not is_send]
        return self._issue("p2p_batch", (arr, len(parsed)), received, keep, async_op)

    def batch_isend_irecv(self, ops: Sequence[Tuple[str, Any, int]]) -> List["Request"]:
        """Start every send and receive of ``ops`` as :meth:`isend` and :meth:`irecv` would,
        in their order, with one call into the library (as torch's ``batch_isend_irecv``):
        each op is ``("send", x, peer)`` or ``("recv", out, peer)``. Returns their
        :class:`Request` objects, in order; a send's ``wait()`` returns its buffer, a
        receive's the filled one. Every op is checked before any starts (an error starts
        none). A receive's buffer must not overlap any other buffer of the batch; sends may
        share one. The transfers behave as :meth:`isend`'s: each progresses on its own and
        completes by itself, and while their requests are held the communicator's
        collectives are refused. Unlike :meth:`p2p_batch`, which waits for (or returns one
        request for) the whole batch on the communicator's queue."""
        self._release_given_up()
        arr, parsed = _p2p_ops(ops, "batch_isend_irecv")
        n = len(parsed)
        # Made first, holding the buffers, so that nothing can free them once the
        # transfers run.
        reqs = [Request(x, (b, x), self._completer) for b, x, _ in parsed]
        handles = (ctypes.c_void_p * max(n, 1))()
        size = ctypes.sizeof(ctypes.c_void_p)
        for i, r in enumerate(reqs):
            r._given_up = self._given_up
            # Each request's handle is its entry of the array the library fills (the view
            # keeps the array alive): no copying afterwards, which an exception could cut
            # short and leave a started transfer without its request.
            r._h = ctypes.c_void_p.from_buffer(handles, i * size)
        self._call(
            lib.chorus_batch_isend_irecv, arr, n, handles, writes=[b for b, _, _ in parsed]
        )
        for r in reqs:
            with self._inflight_mu:
                self._inflight.add(r)
        return reqs

    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Split into disjoint communicators, as ``MPI_Comm_split`` and ``ncclCommSplit``:
        the ranks passing the same ``color`` (an int, 0 or more) form a new communicator,
        ranked by ``key`` (ties by their rank here). ``color=None`` joins none and returns
        None. Every rank must call it. The new communicator has its own connections and is
        independent of this one: close either first, or use both from two threads."""
        handle = ctypes.c_void_p()
        try:
            c = -1 if color is None else _int(color, "color")
            if c < 0 and color is not None:
                raise InvalidArgumentError(f"split: color {color} must be 0 or more, or None")
            k = _int(key, "key")
        except InvalidArgumentError:
            # Still take part with a color the library refuses, so that the other ranks
            # fail at once (naming this rank) instead of waiting out their timeout.
            with contextlib.suppress(ChorusError):
                self._call(lib.chorus_comm_split, -2, 0, ctypes.byref(handle))
            raise
        self._call(lib.chorus_comm_split, c, k, ctypes.byref(handle))
        return Communicator(handle) if handle.value else None

    def dup(self) -> "Communicator":
        """A new communicator of the same ranks in the same order with its own connections
        (``MPI_Comm_dup``): collectives on it never meet this one's."""
        handle = ctypes.c_void_p()
        self._call(lib.chorus_comm_dup, ctypes.byref(handle))
        return Communicator(handle)

    def split_by_host(self) -> "Communicator":
        """The ranks on this rank's host, as a communicator of their own, in their order here
        (``MPI_Comm_split_type`` with ``MPI_COMM_TYPE_SHARED``; torch's local groups). A
        host is what shared memory goes by: ``CHORUS_HOSTID`` when set, else hostname, boot
        id, network namespace and PID namespace. Every rank must call it."""
        handle = ctypes.c_void_p()
        self._call(lib.chorus_comm_split_host, ctypes.byref(handle))
        return Communicator(handle)

    def new_group(self, ranks: Sequence[int]) -> Optional["Communicator"]:
        """A communicator of ``ranks`` (ranks of this one), ranked in increasing rank order
        whatever the order listed, as ``torch.distributed.new_group(ranks)``; None on the
        ranks not listed. Every rank must call it with the same ranks. The members check that
        they got exactly those ranks (a rank that passed others gives :class:`MismatchError`
        on every member of the group it landed in; a rank whose list is refused makes the
        others fail at once, as :meth:`split` does)."""
        try:
            try:
                listed = sorted(_int(r, "ranks[i]") for r in ranks)
            except TypeError:
                raise InvalidArgumentError(
                    "new_group: ranks must be a sequence of ints"
                ) from None
            if len(set(listed)) != len(listed) or not all(0 <= r < self.size for r in listed):
                raise InvalidArgumentError(
                    f"new_group: ranks {listed} must be distinct ranks of 0..{self.size - 1}"
                )
        except InvalidArgumentError:
            # Still take part in the split with a color the library refuses, as split()
            # does, so that the other ranks fail at once instead of waiting out their timeout.
            with contextlib.suppress(ChorusError):
                self._call(lib.chorus_comm_split, -2, 0, ctypes.byref(ctypes.c_void_p()))
            raise
        # Ranks that pass different lists get different colors (a digest of the list), so
        # they never join one group by accident; a collision is caught by the check below.
        color = zlib.crc32(repr(listed).encode()) & 0x7FFFFFFF
        mine = listed.index(self.rank) if self.rank in listed else None
        group = self.split(color if mine is not None else None, mine or 0)
        if group is None:
            return None
        seen = (ctypes.c_int64 * group.size)()
        me = ctypes.c_int64(self.rank)
        group._call(lib.chorus_allgather, ctypes.byref(me), seen, 1, DTYPES["int64"])
        if list(seen) != listed:
            group.close()
            raise MismatchError(
                f"new_group: rank {self.rank} listed ranks {listed}, but the group formed of "
                f"ranks {list(seen)} (every rank must pass the same list)"
            )
        return group

    def set_timeout(self, seconds: float) -> None:
        """Set the timeout of this communicator's later calls and transfers (what
        ``CHORUS_TIMEOUT`` set at init), in seconds from 0.001 to one year: each fails with
        :class:`ChorusTimeoutError` when it has not completed within it. Communicators split
        or duplicated from this one afterwards start from it."""
        value = _seconds(seconds, "set_timeout: seconds")
        self._call(lib.chorus_comm_set_timeout, ctypes.c_double(value))

    def abort(self) -> None:
        """Tell every peer this rank gives up (their calls fail at once) and make this
        communicator unusable. It may be called from another thread while a call runs (a
        watchdog's way out of a hang, as ``ncclCommAbort``): that call fails with
        :class:`InvalidUsageError` where it next waits (at once over TCP, within 10 ms over
        shared memory). Call :meth:`close` afterwards; during a :meth:`close` that waits for
        transfers (a dropped ``isend`` whose peer never receives), it cuts that wait short.
        In a child forked from this process it does nothing (the parent still runs this
        rank)."""
        if os.getpid() != self._pid:
            return
        with self._handle.use(abort=True) as h:
            _check(lib.chorus_comm_abort(h))

    def close(self) -> None:
        """Free the communicator and close its connections. Idempotent. While another thread
        is inside a call on it, raises :class:`InvalidUsageError` and leaves it open."""
        if os.getpid() != self._pid:
            # A forked child: the communicator is the parent's (a parent's thread may have been
            # inside a call at the fork); this copy is just dropped.
            self._handle._h = None
            return
        # The nonblocking calls in flight first, while abort() from another thread can still
        # end one that hangs (their errors stay with their requests).
        with self._inflight_mu:  # another thread may be issuing a call meanwhile
            inflight = list(self._inflight)
        for req in inflight:
            try:
                req.wait()
            except ChorusError:
                pass
        # Then the transfers still running (those whose requests were dropped), likewise: each
        # ends within the timeout, or at once after an abort; chorus_comm_destroy would wait
        # for them where abort() no longer reaches.
        self._wait_transfers()
        h = self._handle.take()
        if h is not None:
            status = lib.chorus_comm_destroy(h)
            if status != 0:
                # Not freed (a call of another thread began meanwhile): still open, its
                # futures thread too.
                with self._handle._mu:
                    self._handle._h = h
                _check(status)
            # Destroy waited for every transfer, those given up too.
            self._given_up.clear()
            # The futures thread completes what it holds (destroy waited for the calls),
            # then ends. Kept, stopped: futures asked for later fail instead of starting a
            # thread.
            with self._completer_mu:
                completer = self._completer_q
                if completer is None:
                    self._completer_q = _Completer(self, start=False)
            if completer is not None:
                completer.stop()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self, _kept: Any = _KeptLastError) -> None:
        try:
            with _kept():
                self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        state = "closed" if self._handle.closed else "open"
        return f"<chorus.Communicator rank {self._rank} of {self._size}, {state}>"


#: Buffers of requests whose finaliser could not wait for them (kept alive on purpose).
_ORPHANED: List[Any] = []


class Request:
    """A collective issued with ``async_op=True``, or a transfer of :meth:`Communicator.isend`
    or :meth:`Communicator.irecv`, running on its communicator's thread (as an MPI request or
    a torch ``Work``). The buffers belong to the call until it completes: do not read or write
    them before :meth:`wait` returns (or :meth:`test` says True), nor resize a tensor or its
    storage (``resize_``, ``untyped_storage().resize_``), which frees the memory the call
    uses (the request keeps the tensor, not its old memory).

    The calls of a communicator run in the order they were issued, and a blocking call waits
    for those issued before it; transfers run on their own (see :meth:`Communicator.isend`).
    A transfer's request dropped without :meth:`wait` gives the transfer up: it goes on, its
    buffers kept by the communicator until no transfer of it runs any more (or until
    :meth:`Communicator.close`), and should it fail, the communicator is aborted. A
    collective's request dropped without :meth:`wait` waits in its finaliser, so that the
    buffers it holds outlive the call; its error, if any, is then lost.
    """

    def __init__(self, result: Any, keep: Tuple[Any, ...], completer: Any):
        # Written by the C call that issues it; NULL again once completed.
        self._h = ctypes.c_void_p()
        self._result = result
        self._keep: Optional[Tuple[Any, ...]] = keep
        self._error: Optional[ChorusError] = None
        self._cv = threading.Condition()
        self._busy = False  # a thread is waiting in chorus_wait
        self._completer = completer
        self._pid = os.getpid()
        # For a transfer: where its buffers go if it is dropped unwaited (see __del__).
        self._given_up: Optional[List[Any]] = None

    def _check_process(self) -> None:
        """Refuse in a child forked after the call was issued: it runs in the parent (and a
        parent's thread may have been waiting for it at the fork)."""
        if os.getpid() != self._pid:
            raise InvalidUsageError(
                f"this request was issued by process {self._pid}, and this is process "
                f"{os.getpid()}, forked from it: its call runs in the parent"
            )

    def wait(self) -> Any:
        """Wait for the call; returns what the blocking form returns (the output buffer) or
        raises its error (every time it is asked)."""
        self._check_process()
        with self._cv:
            while self._busy:
                self._cv.wait()
            mine = self._h.value is not None
            self._busy = mine
        if mine:
            # Without the lock, so that test() from another thread does not wait meanwhile.
            status: Optional[int] = None
            message: Optional[bytes] = None
            try:
                status = lib.chorus_wait(ctypes.byref(self._h))
                # At once: a request the garbage collector frees before the message is read
                # (its __del__ calls the library) would overwrite it.
                message = lib.chorus_last_error() if status else None
            finally:
                # Also when an exception (Ctrl-C) arrives as the C call returns: the request
                # is then complete, its status lost.
                with self._cv:
                    if self._h.value is None:
                        self._keep, self._error = None, self._outcome(status, message)
                    self._busy = False
                    self._cv.notify_all()
        if self._error is not None:
            raise self._error
        return self._result

    def test(self) -> bool:
        """Whether the call has completed (then :meth:`wait` returns at once). False while
        another thread is inside :meth:`wait` for it; True in a child forked after it was issued
        (where :meth:`wait` raises)."""
        if os.getpid() != self._pid:
            return True
        with self._cv:
            if self._busy:
                return False
            if self._h.value is None:
                return True
            done = ctypes.c_int(0)
            status: Optional[int] = None
            message: Optional[bytes] = None
            try:
                status = lib.chorus_test(ctypes.byref(self._h), ctypes.byref(done))
                message = lib.chorus_last_error() if status else None  # at once, as in wait
            finally:
                if self._h.value is None:  # completed (and freed by the library)
                    self._keep, self._error = None, self._outcome(status, message)
            if self._h.value is None:
                return True
            _check(status if status is not None else 0, message)
            return False

    is_completed = test

    @staticmethod
    def _outcome(status: Optional[int], message: Optional[bytes] = None) -> Optional["ChorusError"]:
        """The error of a completed call's status and message (read in the thread that made
        the C call), or, if an exception took the status before it was stored, an internal
        error."""
        if status is None:
            return InternalError("the call's status was lost to an exception (e.g. Ctrl-C)")
        return _error_of(status, message)

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` completed with :meth:`wait`'s result (or error) when the
        call completes: what a DDP communication hook returns. A thread of the communicator's
        completes these futures: those of collectives in the order ``get_future`` was called
        (they complete in that order), those of transfers as each completes (one may need
        what a later future's callback does)."""
        torch = sys.modules.get("torch")
        if torch is None:
            raise UnsupportedError("get_future needs PyTorch (import torch first)")
        self._check_process()
        fut = torch.futures.Future()
        self._completer().put((self, fut))
        return fut

    def _completed(self) -> bool:
        """Whether the call has completed and its outcome is kept (waited, or tested true)."""
        with self._cv:
            return self._h.value is None and not self._busy

    # (The module's globals are bound as defaults: at interpreter exit they may be gone.)
    def __del__(self, _kept: Any = _KeptLastError, _orphaned: Any = _ORPHANED) -> None:
        if self._h.value is None:
            return  # completed: nothing to do
        try:
            with _kept():
                self._finalize()
        except BaseException:  # noqa: BLE001 - never raise from a finaliser
            # The call may still be running (e.g. at interpreter exit): keep its buffers
            # alive for good rather than free memory it may write.
            _orphaned.append(self._keep)

    def _finalize(self) -> None:
        """What ``__del__`` does: a transfer is given up, a collective waited for."""
        if self._h.value is not None:
            if self._given_up is not None and os.getpid() == self._pid:
                # A transfer: given up, not waited for (a ring of dropped isends followed
                # by receives must not wait here); if it is still running, its buffers
                # stay with the communicator until no transfer runs (or close()).
                done = ctypes.c_int(0)
                lib.chorus_test(ctypes.byref(self._h), ctypes.byref(done))
                if self._h.value is not None:
                    self._given_up.append(self._keep)
                    lib.chorus_request_free(ctypes.byref(self._h))
            else:
                lib.chorus_wait(ctypes.byref(self._h))

    def __repr__(self) -> str:
        state = "running" if self._h.value is not None else ("failed" if self._error else "done")
        return f"<chorus.Request {state}>"



def _error_of(status: int, message: Optional[bytes] = None) -> Optional["ChorusError"]:
    """The exception of a status (None for success) and its message (read in the thread that
    made the call, right after it)."""
    try:
        _check(status, message)
    except ChorusError as e:
        return e
    return None


class _Completer:
    """A daemon thread that completes the futures of (request, future) pairs put on its
    queue: a collective's by waiting for it, transfers' as they complete. :meth:`stop` ends it after what it holds; every one still running is
    stopped at interpreter exit, its communicator aborted if a call still runs after 5 s (a
    daemon thread still inside torch's ``set_result`` when the interpreter finalises is
    killed there, and the process aborts). Futures asked for after it stopped fail."""

    def __init__(self, owner: "Communicator", start: bool = True) -> None:
        import queue
        import weakref

        self.q: Any = queue.SimpleQueue()
        self.owner = weakref.ref(owner)
        # Made stopped (``start`` false): no thread, for a closed communicator's futures.
        self.stopped = not start
        self.mu = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        if start:
            self.thread = threading.Thread(target=self._run, name="chorus-futures", daemon=True)
            with _COMPLETERS_MU:
                _COMPLETERS.add(self)
            self.thread.start()

    def put(self, item: Any) -> None:
        if threading.current_thread() is self.thread:
            # From a callback of a future this thread is completing: queued behind the item
            # in hand, it would wait for itself. Completed here instead.
            self._complete(*item)
            return
        # Under the lock stop() takes to mark the end: a pair is either queued before the
        # end marker (and completed) or refused, never queued after the thread has gone.
        with self.mu:
            refused = self.stopped
            if not refused:
                self.q.put(item)
        if refused:
            if item[0]._completed():
                # Completed already: its outcome needs no thread (nor waits for any future).
                self._complete(*item)
                return
            item[1].set_exception(InvalidUsageError("the communicator's futures thread has stopped"))

    @staticmethod
    def _complete(req: Any, fut: Any) -> None:
        try:
            result = req.wait()
        except Exception as e:  # noqa: BLE001 - handed to the future
            outcome: Any = (fut.set_exception, e)
        else:
            outcome = (fut.set_result, result)
        try:
            outcome[0](outcome[1])
        except Exception:  # noqa: BLE001 - a future completed already; the thread goes on
            pass

    def stop(self, timeout: float = 30.0, abort_if_stuck: bool = False) -> None:
        """End the thread after the pairs it holds (their calls finish within their
        timeout), waiting up to ``timeout`` seconds; with ``abort_if_stuck``, a call still
        running then is aborted (from this thread) and waited for a little longer."""
        with self.mu:
            self.stopped = True
            self.q.put(None)
        if self.thread is not None and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
            owner = self.owner()
            if abort_if_stuck and self.thread.is_alive() and owner is not None:
                try:
                    owner.abort()
                except ChorusError:
                    pass
                self.thread.join(timeout)
        with _COMPLETERS_MU:
            _COMPLETERS.discard(self)

    def _run(self) -> None:
        import queue
        import time

        q = self.q
        # (request, future) pairs not yet completed, in the order they came.
        pending: List[Any] = []
        stopping = False
        nap = _NAP_MIN
        while True:
            # What has arrived; blocking for it only with nothing pending.
            while not stopping:
                try:
                    item = q.get_nowait() if pending else q.get()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                pending.append(item)
                del item
            if not pending:
                # stop(): pairs put while it ran (after `stopped` was read) fail rather than
                # wait for good.
                while True:
                    try:
                        late = q.get_nowait()
                    except queue.Empty:
                        return
                    if late is not None:
                        try:
                            late[1].set_exception(
                                InvalidUsageError("the communicator's futures thread has stopped")
                            )
                        except Exception:  # noqa: BLE001 - completed already
                            pass
            if all(req._given_up is None for req, _ in pending):
                # Collectives only: the first is waited for (they complete, and their futures
                # are completed, in the order issued: a hook whose callbacks issue
                # collectives issues them in the same order on every rank).
                self._complete(*pending.pop(0))
                nap = _NAP_MIN
                continue
            # Transfers complete in any order, and one may wait for what a later future's
            # callback does: whichever are done complete first; collectives still in order
            # (none after the first not done). Looked at again after a short nap (doubling
            # up to _NAP_MAX) while none is done.
            still = []
            collective_waiting = False
            for req, fut in pending:
                if req._given_up is None and collective_waiting:
                    still.append((req, fut))
                    continue
                try:
                    done = req.test()
                except Exception:  # noqa: BLE001 - wait() raises it into the future
                    done = True
                if done:
                    self._complete(req, fut)
                else:
                    still.append((req, fut))
                    collective_waiting = collective_waiting or req._given_up is None
            if len(still) < len(pending):
                nap = _NAP_MIN
            else:
                time.sleep(nap)
                nap = min(nap * 2, _NAP_MAX)
            pending = still


#: The completer's first and longest naps while transfers it holds are running (seconds).
_NAP_MIN, _NAP_MAX = 0.0001, 0.002


_COMPLETERS: "set[_Completer]" = set()
# Re-entrant: a garbage collection while it is held (an allocation under it) may finalise a
# communicator, whose close stops its completer, which takes it again on the same thread.
_COMPLETERS_MU = threading.RLock()


def _forget_completers_in_child() -> None:
    """In a forked child the futures threads are the parent's (and their lock may have been
    held at the fork)."""
    global _COMPLETERS, _COMPLETERS_MU
    _COMPLETERS = set()
    _COMPLETERS_MU = threading.RLock()


os.register_at_fork(after_in_child=_forget_completers_in_child)


@atexit.register
def _stop_completers() -> None:
    with _COMPLETERS_MU:
        # (A copy made in C, which a completer leaving the set meanwhile cannot disturb, as
        # it could a Python-level iteration.)
        running = _COMPLETERS.copy()
    for c in running:
        # A call still running at exit is aborted: the thread must not be inside torch when
        # the interpreter finalises.
        c.stop(timeout=5.0, abort_if_stuck=True)


class Compressor:
    """Compression state of one tensor (gradient bucket), for
    ``comm.allreduce(x, op, compressor=c)``: the method, its options and the error-feedback
    residual. Keep one per tensor across steps; every rank uses the same spec.

    ``spec`` is ``method[:argument][,key=value]...``: methods ``"fp16"``, ``"bf16"``,
    ``"int8"``, ``"int4"``, ``"sign"``, ``"ternary"``, ``"topk:R"`` (0 < R <= 1); keys
    ``ef=on|off`` (error feedback, default on for sign and topk), ``min_bytes=N`` (smaller
    tensors go uncompressed, default 16384), ``chunk=N``, ``clip=on`` (ternary),
    ``schedule=scatter_gather|ring``, ``algo=two_phase|dsar|sparse_rd`` (top-k), ``seed=N``.
    A bad spec raises :class:`InvalidArgumentError`.
    """

    def __init__(self, spec: str):
        h = ctypes.c_void_p()
        _check(lib.chorus_compressor_create(ctypes.byref(h), _c_str(spec, "spec")))
        self._handle = _Handle(h, "compressor")
        self.spec = spec

    def last_report(self) -> Dict[str, int]:
        """What the last compressed allreduce did: ``compressed`` (0/1), ``bytes_sent``,
        ``bytes_received``, ``dense_bytes``, ``k`` and ``result_nnz`` (top-k)."""
        r = _lib.CompressionReport()
        r.size = ctypes.sizeof(_lib.CompressionReport)
        with self._handle.use() as h:
            _check(lib.chorus_compressor_report(h, ctypes.byref(r)))
        return {name: int(getattr(r, name)) for name, _ in _lib.CompressionReport._fields_[1:]}

    def close(self) -> None:
        """Free the compressor (idempotent). While another thread is inside a call using it,
        raises :class:`InvalidUsageError` and leaves it open."""
        h = self._handle.take()
        if h is not None:
            _check(lib.chorus_compressor_destroy(h))

    def __del__(self, _kept: Any = _KeptLastError) -> None:
        try:
            with _kept():
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"chorus.Compressor({self.spec!r})"


def _is_bool(v: Any) -> bool:
    """Whether ``v`` is a boolean: Python's, or numpy's and torch's (whose ``dtype`` is of
    kind ``b``, or is ``torch.bool``), which some releases let ``operator.index`` take."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return True
    dt = getattr(v, "dtype", None)
    return getattr(dt, "kind", None) == "b" or str(dt) == "torch.bool"


def _int(v: Any, what: str) -> int:
    """``v`` as a C int: a Python or numpy integer (not a bool), in range."""
    if _is_bool(v):
        raise InvalidArgumentError(f"{what} must be an int, not {v!r}")
    try:
        v = operator.index(v)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, not {v!r}") from None
    if not -(2**31) <= v < 2**31:
        raise InvalidArgumentError(f"{what} {v} is out of range")
    return v


def _c_str(v: Any, what: str) -> bytes:
    """``v`` as a NUL-terminated C string: a str without NUL characters (C would stop at one,
    so ``token="\\0secret"`` would arrive as no token at all)."""
    if not isinstance(v, str):
        raise InvalidArgumentError(f"{what} must be a str, not {type(v).__name__}")
    if "\0" in v:
        raise InvalidArgumentError(f"{what} contains a NUL character")
    return v.encode()


def unique_id() -> bytes:
    """Make a unique id (as NCCL's ``ncclGetUniqueId``): starts a rendezvous store in this
    process with a fresh secret, and returns the 128 bytes every rank passes to
    ``init(rank, size, unique_id=...)``. Hand them to the other ranks as you like (a torch
    store, ``mpi4py``'s ``bcast``, a file); treat them as a password. This process must stay
    alive until every rank's ``init`` has returned."""
    uid = _lib.UniqueId()
    _check(lib.chorus_get_unique_id(ctypes.byref(uid)))
    return bytes(bytearray(uid))


def init(
    rank: Optional[int] = None,
    size: Optional[int] = None,
    addr: Optional[str] = None,
    token: Optional[str] = None,
    unique_id: Optional[bytes] = None,
) -> Communicator:
    """Join a communicator; blocks until every rank has joined.

    Without arguments, from the environment the launchers set (``CHORUS_RANK``,
    ``CHORUS_WORLD_SIZE``, ``CHORUS_ADDR``, ``CHORUS_TOKEN``, ``CHORUS_TIMEOUT``...; torchrun's
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, Open MPI's, MPICH's, Slurm's).
    With ``rank``, ``size`` and ``addr`` (``"host:port"`` of the rendezvous store, hosted by
    rank 0), explicitly; ``token`` is the shared secret authenticating connections. With
    ``rank``, ``size`` and ``unique_id`` (from :func:`unique_id`, the same on every rank), as
    NCCL's ``ncclCommInitRank``. With explicit arguments the other settings (timeouts,
    interface, transport, algorithms) still come from ``CHORUS_*`` variables when set, but
    not the token: ``token=None`` means connections are checked, not authenticated
    (``CHORUS_TOKEN`` is not read).
    """
    handle = ctypes.c_void_p()
    if unique_id is not None:
        if addr is not None or token is not None:
            raise InvalidArgumentError("init: give unique_id or addr and token, not both")
        if rank is None or size is None:
            raise InvalidArgumentError("init: unique_id needs rank and size")
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != _lib.UNIQUE_ID_BYTES:
            raise InvalidArgumentError(
                f"init: unique_id must be the {_lib.UNIQUE_ID_BYTES} bytes unique_id() returns"
            )
        uid = _lib.UniqueId.from_buffer_copy(bytes(unique_id))
        _check(
            lib.chorus_comm_init_rank(
                ctypes.byref(handle), _int(size, "size"), uid, _int(rank, "rank")
            )
        )
        return Communicator(handle)
    if rank is None and size is None and addr is None and token is None:
        _check(lib.chorus_comm_init_env(ctypes.byref(handle)))
    else:
        if rank is None or size is None or addr is None:
            raise InvalidArgumentError("init: give rank, size and addr together (or none)")
        _check(
            lib.chorus_comm_init(
                ctypes.byref(handle),
                _int(rank, "rank"),
                _int(size, "size"),
                _c_str(addr, "addr"),
                _c_str(token, "token") if token is not None else None,
            )
        )
    return Communicator(handle)


def _status_names() -> Tuple[str, ...]:
    """The C library's description of every status code 0..8 (for tests and messages)."""
    return tuple(lib.chorus_status_string(i).decode() for i in range(9))
