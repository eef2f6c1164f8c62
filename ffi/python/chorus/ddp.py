"""A PyTorch DistributedDataParallel communication hook running chorus's allreduce.

DDP still needs a process group for its own start-up (parameter broadcast, bucket
rebuilding), e.g. Gloo; the hook moves the gradients themselves through chorus::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import chorus
    from chorus.ddp import allreduce_hook

    dist.init_process_group("gloo")
    comm = chorus.init()
    model = DDP(net)
    model.register_comm_hook(comm, allreduce_hook)

The hook averages the bucket over the ranks with chorus's ``avg`` (a sum, then a division
by the number of ranks); a float16 bucket is divided first and then summed, in that order as
DDP's default hook does (summing first could overflow float16 gradients). Training follows
Gloo's to rounding (sums in another order). A call refused before it runs (a closed
communicator, say) leaves a bucket that is not float16 as it was. The hooks run on CPU
tensors.

``allreduce_hook`` issues each bucket's allreduce and returns at once, so the backward pass
goes on computing the next buckets' gradients while chorus moves this one (DDP waits for the
futures at the end of the backward pass); ``sync_allreduce_hook`` runs the allreduce inside
the hook instead. The compressed hook runs inside the hook too.
"""

import warnings
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from . import Communicator, Compressor, _buffer

__all__ = [
    "allreduce_hook",
    "sync_allreduce_hook",
    "CompressedHookState",
    "compressed_allreduce_hook",
]


def _checked(comm: Communicator, grads: torch.Tensor) -> None:
    """Checks ``grads`` before a hook changes it: a bucket chorus refuses (a sparse or non-CPU
    one) is left as it was, and the refusal counts as the allreduce's call, as chorus's own
    refusals do."""
    try:
        _buffer(grads, "the bucket", writable=True)
    except Exception:
        comm._refused_call()
        raise


def _averaged(state: Communicator, bucket: dist.GradBucket, hook: str) -> Tuple[torch.Tensor, str]:
    """``bucket``'s gradients, ready to be averaged over the ranks in place, and the op that
    does it. Float16 buckets are divided by the number of ranks first, as DDP's default hook
    does (a float16 sum of undivided gradients can overflow where the average does not), and
    summed; the others are left as they are until chorus's ``avg`` runs, so that a call
    refused (a closed communicator, say) leaves the bucket as it was."""
    if not isinstance(state, Communicator):
        raise TypeError(f"{hook} needs a chorus.Communicator as its state, not {type(state).__name__}")
    grads = bucket.buffer()
    _checked(state, grads)
    if grads.dtype != torch.float16:
        return grads, "avg"
    grads.div_(state.size)
    return grads, "sum"


def allreduce_hook(
    state: Communicator, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the gradients of ``bucket`` over the ranks of ``state`` (a
    :class:`chorus.Communicator`) in place, in the background: the allreduce is issued on
    the communicator's thread and the returned future completes with the bucket when it is
    done (with its error if it fails: DDP raises it at the end of the backward pass)."""
    grads, op = _averaged(state, bucket, "allreduce_hook")
    return state.allreduce(grads, op=op, async_op=True).get_future()


def sync_allreduce_hook(
    state: Communicator, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """As :func:`allreduce_hook`, but the allreduce runs inside the hook (the GIL released
    meanwhile) and the returned future is already complete."""
    grads, op = _averaged(state, bucket, "sync_allreduce_hook")
    state.allreduce(grads, op=op)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(grads)
    return fut


class CompressedHookState:
    """State of :func:`compressed_allreduce_hook`: the communicator, the compressor spec, and
    one :class:`chorus.Compressor` per bucket (created on first use, so each bucket keeps its
    own error-feedback residual across steps). A bucket is its index and the parameters in
    it: when DDP rebuilds its buckets after the first step, a bucket whose parameters changed
    gets a fresh compressor rather than another bucket's residual::

        model.register_comm_hook(CompressedHookState(comm, "int8"), compressed_allreduce_hook)
    """

    def __init__(self, comm: Communicator, spec: str):
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a chorus.Communicator, not {type(comm).__name__}")
        self.comm = comm
        self.spec = spec
        Compressor(spec).close()  # validate the spec now, not in the backward pass
        self.compressors: Dict[int, Tuple[Tuple[int, ...], Compressor]] = {}
        self.warned_uncompressed = False

    def compressor(self, bucket: dist.GradBucket) -> Compressor:
        """The compressor of ``bucket`` (a new one if its parameters are not those the index
        had before)."""
        params = tuple(id(p) for p in bucket.parameters())
        kept = self.compressors.get(bucket.index())
        if kept is not None and kept[0] == params:
            return kept[1]
        if kept is not None:
            kept[1].close()
        comp = Compressor(self.spec)
        self.compressors[bucket.index()] = (params, comp)
        return comp


def compressed_allreduce_hook(
    state: CompressedHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks through chorus's compressed allreduce (the bucket's
    own compressor from ``state``); returns a completed future holding the bucket."""
    if not isinstance(state, CompressedHookState):
        raise TypeError(
            "compressed_allreduce_hook needs a chorus.ddp.CompressedHookState as its state, "
            f"not {type(state).__name__}"
        )
    grads = bucket.buffer()
    if grads.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        # Chorus compresses float32, float16 and bfloat16: a bucket of another dtype (a
        # float64 model) is averaged uncompressed, said once.
        if not state.warned_uncompressed:
            state.warned_uncompressed = True
            warnings.warn(
                f"chorus.ddp: {grads.dtype} buckets are averaged uncompressed (compression "
                "takes float32, float16 and bfloat16)",
                stacklevel=2,
            )
        grads, op = _averaged(state.comm, bucket, "compressed_allreduce_hook")
        state.comm.allreduce(grads, op=op)
        fut64: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut64.set_result(grads)
        return fut64
    comp = state.compressor(bucket)
    if grads.dtype == torch.float16:
        _checked(state.comm, grads)
        # A bucket below the spec's min_bytes goes uncompressed, and chorus's "avg" of float16
        # then sums in float16, which passes 65504 sooner than the average does: divided
        # first, as the other hooks do (compressed buckets only scale with it).
        grads.div_(state.comm.size)
        state.comm.allreduce(grads, op="sum", compressor=comp)
    else:
        state.comm.allreduce(grads, op="avg", compressor=comp)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(grads)
    return fut
