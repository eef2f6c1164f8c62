"""A halo exchange through torch.distributed's ``batch_isend_irecv``, on chorus or Gloo.

    chorus-run -n 4 python3 ffi/python/benchmarks/halo.py chorus|gloo [ROUNDS]

Every rank sends a float32 tensor to each neighbour on a ring and receives one from each, as
one ``dist.batch_isend_irecv`` of four ops ``[isend left, isend right, irecv left, irecv
right]``, waited for at once (what a 1-D domain decomposition or a pipeline's boundary
exchange does every step). Sizes 8 B to 4 MiB per message. The first exchange of each size
is checked. Rank 0 prints, per size, the median over ``ROUNDS`` rounds (default 3) of the
mean time per exchange. A benchmark, not a test.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 4 << 20)


def exchange(to_l, to_r, from_l, from_r, left, right):
    ops = [
        dist.P2POp(dist.isend, to_l, left),
        dist.P2POp(dist.isend, to_r, right),
        dist.P2POp(dist.irecv, from_l, left),
        dist.P2POp(dist.irecv, from_r, right),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "chorus"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if backend == "chorus":
        import chorus.backend  # noqa: F401 - registers the backend
    dist.init_process_group(backend)
    me, p = dist.get_rank(), dist.get_world_size()
    left, right = (me - 1) % p, (me + 1) % p
    results = {}
    for nbytes in SIZES:
        n = nbytes // 4
        to_l, to_r = torch.full((n,), 10.0 * me + 1), torch.full((n,), 10.0 * me + 2)
        from_l, from_r = torch.zeros(n), torch.zeros(n)
        exchange(to_l, to_r, from_l, from_r, left, right)
        if p > 2:
            ok = bool((from_l == 10.0 * left + 2).all() and (from_r == 10.0 * right + 1).all())
            assert ok, f"rank {me}: wrong halo at {nbytes} B"
        iters = max(3, min(200, (16 << 20) // (nbytes * 4)))
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                exchange(to_l, to_r, from_l, from_r, left, right)
            results.setdefault(nbytes, []).append((time.perf_counter() - start) / iters)
    if me == 0:
        print(f"{backend}: {p} ranks, median of {rounds} rounds, µs per exchange "
              f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')})")
        for nbytes in SIZES:
            t = statistics.median(results[nbytes])
            print(f"{nbytes:>9} B  {t * 1e6:10.1f} µs  {2 * nbytes / t / 1e6:8.1f} MB/s out",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
