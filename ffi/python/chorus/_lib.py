"""Loading libchorus and declaring the C functions (ctypes; no compiler needed).

ctypes' ``CDLL`` releases the GIL for the duration of every foreign call, so other Python
threads run while a collective waits on the network.
"""

import ctypes
import ctypes.util
import os
from pathlib import Path

c_int = ctypes.c_int
c_int32 = ctypes.c_int32
c_size_t = ctypes.c_size_t
c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p


class Options(ctypes.Structure):
    """``chorus_options`` (version 1): size, algorithm name, timeout in seconds."""

    _fields_ = [
        ("size", c_size_t),
        ("algorithm", c_char_p),
        ("timeout_seconds", ctypes.c_double),
    ]


class CompressionReport(ctypes.Structure):
    """``chorus_compression_report`` (version 1)."""

    _fields_ = [
        ("size", c_size_t),
        ("compressed", c_int32),
        ("bytes_sent", ctypes.c_uint64),
        ("bytes_received", ctypes.c_uint64),
        ("dense_bytes", ctypes.c_uint64),
        ("k", ctypes.c_uint64),
        ("result_nnz", ctypes.c_uint64),
    ]


def _candidates():
    """Where the library may be, in order: CHORUS_LIBRARY, the bundled copy, the system."""
    given = os.environ.get("CHORUS_LIBRARY")
    if given:
        yield given
        return
    yield str(Path(__file__).with_name("libchorus.so"))
    found = ctypes.util.find_library("chorus")
    if found:
        yield found


def _load() -> ctypes.CDLL:
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError(
        "chorus: cannot load the C library libchorus.so ("
        + "; ".join(errors or ["not found"])
        + "). Install the package with `pip install ./ffi/python` (which builds and bundles "
        "it), or point CHORUS_LIBRARY at a libchorus.so / libchorus_ffi.so."
    )


lib = _load()

_comm_pp = ctypes.POINTER(c_void_p)
UNIQUE_ID_BYTES = 128


class UniqueId(ctypes.Structure):
    """``chorus_unique_id``."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class P2pOp(ctypes.Structure):
    """``chorus_p2p_op``."""

    _fields_ = [
        ("buf", c_void_p),
        ("count", c_size_t),
        ("dtype", c_int32),
        ("peer", c_int),
        ("kind", c_int32),
    ]


P2P_SEND, P2P_RECV = 0, 1

_PROTOTYPES = {
    "chorus_status_string": (c_char_p, [c_int32]),
    "chorus_last_error": (c_char_p, []),
    "chorus_set_last_error": (None, [c_char_p]),
    "chorus_version": (c_char_p, []),
    "chorus_comm_init_env": (c_int32, [_comm_pp]),
    "chorus_comm_init": (c_int32, [_comm_pp, c_int, c_int, c_char_p, c_char_p]),
    "chorus_comm_rank": (c_int32, [c_void_p, ctypes.POINTER(c_int)]),
    "chorus_comm_size": (c_int32, [c_void_p, ctypes.POINTER(c_int)]),
    "chorus_comm_transfers": (c_int32, [c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
    "chorus_comm_abort": (c_int32, [c_void_p]),
    "chorus_comm_refused_call": (c_int32, [c_void_p]),
    "chorus_comm_set_timeout": (c_int32, [c_void_p, ctypes.c_double]),
    "chorus_comm_destroy": (c_int32, [c_void_p]),
    "chorus_comm_split": (c_int32, [c_void_p, c_int, c_int, _comm_pp]),
    "chorus_comm_dup": (c_int32, [c_void_p, _comm_pp]),
    "chorus_comm_split_host": (c_int32, [c_void_p, _comm_pp]),
    "chorus_get_unique_id": (c_int32, [ctypes.POINTER(UniqueId)]),
    "chorus_comm_init_rank": (c_int32, [_comm_pp, c_int, UniqueId, c_int]),
    "chorus_allreduce_opts": (
        c_int32,
        [c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int32, ctypes.POINTER(Options)],
    ),
    "chorus_barrier": (c_int32, [c_void_p]),
    "chorus_broadcast": (c_int32, [c_void_p, c_void_p, c_size_t, c_int32, c_int]),
    "chorus_reduce": (c_int32, [c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int32, c_int]),
    "chorus_allgather": (c_int32, [c_void_p, c_void_p, c_void_p, c_size_t, c_int32]),
    "chorus_reduce_scatter": (
        c_int32,
        [c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int32],
    ),
    "chorus_alltoall": (c_int32, [c_void_p, c_void_p, c_void_p, c_size_t, c_int32]),
    "chorus_gather": (c_int32, [c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int]),
    "chorus_scatter": (c_int32, [c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int]),
    "chorus_send": (c_int32, [c_void_p, c_void_p, c_size_t, c_int32, c_int]),
    "chorus_recv": (c_int32, [c_void_p, c_void_p, c_size_t, c_int32, c_int]),
    "chorus_isend": (c_int32, [c_void_p, c_void_p, c_size_t, c_int32, c_int, _comm_pp]),
    "chorus_irecv": (c_int32, [c_void_p, c_void_p, c_size_t, c_int32, c_int, _comm_pp]),
    "chorus_allgatherv": (c_int32, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int32]),
    "chorus_alltoallv": (
        c_int32,
        [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int32],
    ),
    "chorus_sendrecv": (
        c_int32,
        [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_size_t, c_int, c_int32],
    ),
    "chorus_p2p_batch": (c_int32, [c_void_p, ctypes.POINTER(P2pOp), c_size_t]),
    "chorus_batch_isend_irecv": (
        c_int32,
        [c_void_p, ctypes.POINTER(P2pOp), c_size_t, ctypes.POINTER(c_void_p)],
    ),
    "chorus_gatherv": (
        c_int32,
        [c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_void_p, c_int32, c_int],
    ),
    "chorus_scatterv": (
        c_int32,
        [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int],
    ),
    "chorus_scan": (c_int32, [c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int32]),
    "chorus_exscan": (c_int32, [c_void_p, c_void_p, c_void_p, c_size_t, c_int32, c_int32]),
    "chorus_reduce_scatterv": (
        c_int32,
        [c_void_p, c_void_p, c_void_p, c_void_p, c_int32, c_int32],
    ),
    "chorus_compressor_create": (c_int32, [_comm_pp, c_char_p]),
    "chorus_compressor_destroy": (c_int32, [c_void_p]),
    "chorus_compressor_report": (c_int32, [c_void_p, ctypes.POINTER(CompressionReport)]),
    "chorus_allreduce_compressed": (
        c_int32,
        [c_void_p, c_void_p, c_size_t, c_int32, c_int32, c_void_p],
    ),
}

# The nonblocking forms take the blocking form's arguments and a `chorus_request **` last.
for _name in (
    "barrier",
    "broadcast",
    "reduce",
    "allgather",
    "reduce_scatter",
    "alltoall",
    "gather",
    "scatter",
    "allgatherv",
    "alltoallv",
    "p2p_batch",
    "reduce_scatterv",
    "gatherv",
    "scatterv",
    "scan",
    "exscan",
):
    _PROTOTYPES["chorus_i" + _name] = (c_int32, _PROTOTYPES["chorus_" + _name][1] + [_comm_pp])
_PROTOTYPES["chorus_iallreduce"] = (c_int32, _PROTOTYPES["chorus_allreduce_opts"][1] + [_comm_pp])
_PROTOTYPES["chorus_wait"] = (c_int32, [_comm_pp])
_PROTOTYPES["chorus_request_free"] = (c_int32, [_comm_pp])
_PROTOTYPES["chorus_test"] = (c_int32, [_comm_pp, ctypes.POINTER(c_int)])

for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _f = getattr(lib, _name)
    _f.restype = _restype
    _f.argtypes = _argtypes
