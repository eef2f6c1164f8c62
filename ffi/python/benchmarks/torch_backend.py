"""torch.distributed all_reduce over the chorus backend beside Gloo, in one job.

    chorus-run -n 4 python3 ffi/python/benchmarks/torch_backend.py [ROUNDS]

Every rank joins the default group on chorus (``init_process_group("chorus")``) and a Gloo
group of the same ranks (``new_group(backend="gloo")``), then times ``dist.all_reduce`` of
float32 tensors from 4 B to 16 MiB on each, alternating the two in ``ROUNDS`` rounds (default
5) so that both see the same machine. Rank 0 prints, per size, the median over rounds of the
mean time per call, for each backend, and their ratio. A benchmark, not a test.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

import chorus.backend  # noqa: F401 - registers "chorus"

SIZES = [4, 4 << 10, 256 << 10, 4 << 20, 16 << 20]


def per_call(t, group, iters):
    for _ in range(max(iters // 10, 2)):
        dist.all_reduce(t, group=group)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    # The slowest rank's time is the collective's.
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item() / iters


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    dist.init_process_group("chorus")
    gloo = dist.new_group(backend="gloo")
    me, p = dist.get_rank(), dist.get_world_size()
    times = {(n, b): [] for n in SIZES for b in ("chorus", "gloo")}
    for r in range(rounds):
        for n in SIZES:
            t = torch.ones(n // 4)
            iters = max(10, min(2000, (64 << 20) // max(n, 1) // 8))
            order = [("chorus", None), ("gloo", gloo)]
            if r % 2:
                order.reverse()
            for name, group in order:
                times[(n, name)].append(per_call(t, group, iters))
    if me == 0:
        print(f"all_reduce float32 sum, {p} ranks, {rounds} rounds; median of per-call means (us)")
        print(f"{'bytes':>10} {'chorus':>10} {'gloo':>10} {'chorus/gloo':>12}")
        for n in SIZES:
            c = statistics.median(times[(n, "chorus")]) * 1e6
            g = statistics.median(times[(n, "gloo")]) * 1e6
            print(f"{n:>10} {c:>10.1f} {g:>10.1f} {c / g:>12.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
