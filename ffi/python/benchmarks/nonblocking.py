"""What a nonblocking allreduce costs beside the blocking one, from Python.

    chorus-run -n 2 python3 ffi/python/benchmarks/nonblocking.py [ROUNDS]

Times ``comm.allreduce(x)`` (blocking), ``comm.allreduce(x, async_op=True).wait()`` (issued
to the communicator's thread and waited for at once: the hand-over both ways) and
``comm.allreduce(x, async_op=True).get_future().wait()`` (as a DDP hook's future, completed by
the futures thread) on float32 tensors of 4 B and 288 KiB, interleaved in ``ROUNDS`` rounds
(default 3). Rank 0 prints, per size and way, the median over rounds of the mean time per
call. A benchmark, not a test.
"""

import statistics
import sys
import time

import torch

import chorus

WAYS = ("blocking", "async+wait", "async+future")


def per_call(comm, x, way, iters):
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        if way == "blocking":
            comm.allreduce(x)
        elif way == "async+wait":
            comm.allreduce(x, async_op=True).wait()
        else:
            comm.allreduce(x, async_op=True).get_future().wait()
    return (time.perf_counter() - start) / iters


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    comm = chorus.init()
    results = {}
    for n in (1, 73728):
        x = torch.ones(n)
        for way in WAYS:
            per_call(comm, x, way, 20)  # warm up
        for _ in range(rounds):
            for way in WAYS:
                results.setdefault((n, way), []).append(per_call(comm, x, way, 300))
    if comm.rank == 0:
        print(f"{comm.size} ranks, median of {rounds} rounds, µs per call")
        for n in (1, 73728):
            row = "  ".join(
                f"{way} {statistics.median(results[(n, way)]) * 1e6:8.1f}" for way in WAYS
            )
            print(f"{n * 4:>8} B  {row}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
