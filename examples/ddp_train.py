"""Data-parallel training with PyTorch DDP, gradients averaged by chorus.

A small MLP (the student) learns a fixed random MLP (the teacher) from data each rank draws
from its own seed. Run it with either launcher:

    chorus-run -n 4 python3 examples/ddp_train.py --hook chorus
    torchrun --nproc_per_node 4 examples/ddp_train.py --hook chorus

(Debian's torch 1.13 on Python 3.11 also needs ``--redirects 1 --tee 1`` with torchrun: it
cannot parse their default.)

``--hook chorus`` overlaps each bucket's allreduce with the rest of the backward pass,
``--hook chorus-sync`` runs it inside the hook. ``--hook gloo`` uses DDP's own allreduce over
Gloo instead, ``--hook backend-hook`` chorus's hook over the backend's own communicator (no
Gloo, and the allreduces in the background), and ``--hook backend`` DDP's own
allreduce over chorus as the ``torch.distributed`` backend (``chorus.backend``: the process
group itself is chorus, no Gloo at all); all print the same final loss
(up to float rounding), which is what ``ffi/python/tests`` checks, and rank 0's mean time per
step. ``--hidden`` widens the model (4096: 295 KB of gradients per step; lower ``--lr`` then). Needs the chorus Python
package (``pip install ./ffi/python``, or ``CHORUS_LIBRARY`` and ``PYTHONPATH=ffi/python``).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--hook",
        choices=["chorus", "chorus-sync", "gloo", "backend", "backend-hook"],
        default="chorus",
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=32, help="width of the hidden layers")
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="hidden layers (each after the first a hidden x hidden linear layer: DDP then "
        "has gradients to move while the backward pass computes the earlier layers')",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="DDP's bucket cap in MiB, its first bucket's too (small values: about one bucket "
        "per parameter); default: DDP's (25 MiB, the first bucket 1 MiB)",
    )
    p.add_argument(
        "--compress",
        default=None,
        help="with --hook chorus: a compressor spec for the gradients, e.g. int8 or topk:0.1",
    )
    args = p.parse_args()

    # Both launchers set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; DDP needs a process
    # group for its set-up even when a chorus hook moves the gradients.
    if args.hook in ("backend", "backend-hook"):
        import chorus.backend  # noqa: F401 - registers the "chorus" backend

        dist.init_process_group("chorus")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same teacher and initial student on every rank
    h = args.hidden

    def mlp() -> nn.Module:
        layers = [nn.Linear(16, h), nn.Tanh()]
        for _ in range(args.layers - 1):
            layers += [nn.Linear(h, h), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(h, 1))

    teacher, student = mlp(), mlp()
    if args.bucket_mb is not None:
        # DDP caps its first bucket apart (1 MiB), also after it rebuilds its buckets.
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(args.bucket_mb * 2**20)
        model = DDP(student, bucket_cap_mb=args.bucket_mb)
    else:
        model = DDP(student)

    comm = None
    if args.hook == "backend-hook":
        # The backend's own communicator, with chorus's hook: each bucket's allreduce in the
        # background (the backend's allreduce runs synchronously).
        import chorus.backend
        from chorus.ddp import allreduce_hook

        model.register_comm_hook(chorus.backend.communicator(), allreduce_hook)
    if args.hook in ("chorus", "chorus-sync"):
        import chorus
        from chorus.ddp import (
            CompressedHookState,
            allreduce_hook,
            compressed_allreduce_hook,
            sync_allreduce_hook,
        )

        comm = chorus.init()  # the same launcher environment
        assert (comm.rank, comm.size) == (rank, world)
        if args.compress:
            state = CompressedHookState(comm, args.compress)
            model.register_comm_hook(state, compressed_allreduce_hook)
        else:
            hook = allreduce_hook if args.hook == "chorus" else sync_allreduce_hook
            model.register_comm_hook(comm, hook)

    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    loss = torch.tensor(0.0)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(args.batch, 16, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start

    # The mean over ranks of the last step's loss, computed the same way for both hooks.
    final = loss.detach().clone()
    dist.all_reduce(final)
    final /= world
    if rank == 0:
        print(f"hook {args.hook} ranks {world} steps {args.steps} final loss {final.item():.8f}")
        print(f"mean step {seconds / max(args.steps, 1) * 1e3:.3f} ms on rank 0")
        sizes = model._get_ddp_logging_data().get("rebuilt_bucket_sizes") or ""
        print(f"buckets {len([b for b in str(sizes).split(',') if b.strip()])} after the rebuild")
    if comm is not None:
        comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    main()
