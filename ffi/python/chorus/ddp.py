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

The hook sums the bucket over the ranks with chorus and divides by the number of ranks
itself, as DDP's default hook does, so training gives the same result as with Gloo.
"""

import torch
import torch.distributed as dist

from . import Communicator

__all__ = ["allreduce_hook"]


def allreduce_hook(
    state: Communicator, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the gradients of ``bucket`` over the ranks of ``state`` (a
    :class:`chorus.Communicator`) in place; returns a completed future holding the bucket.

    The allreduce runs synchronously in the backward pass (the GIL is released meanwhile).
    """
    if not isinstance(state, Communicator):
        raise TypeError(
            f"allreduce_hook needs a chorus.Communicator as its state, not {type(state).__name__}"
        )
    grads = bucket.buffer()
    state.allreduce(grads, op="sum")
    grads.div_(state.size)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(grads)
    return fut
