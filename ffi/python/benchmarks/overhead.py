"""Cost of calling chorus from Python: an 8-byte allreduce, timed in Python.

    chorus-run -n 2 python3 ffi/python/benchmarks/overhead.py [ITERS]

Prints, on rank 0, the mean time of one ``comm.allreduce`` of 2 float32 on the launched
group (compare with ``chorus-perf allreduce -b 8 -e 8 --inplace 1 -n ITERS --ranks 2``, the
same call from Rust), and the binding's own cost: the same call on a group of one, where
chorus does no communication, through the Python API and through the raw ctypes function.
A benchmark, not a test: figures vary with the machine.
"""

import ctypes
import sys
import time

import numpy as np

import chorus
from chorus._lib import lib


def mean_us(f, iters):
    for _ in range(min(iters // 10, 1000)):
        f()
    t = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t) / iters * 1e6


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    comm = chorus.init()
    x = np.ones(2, dtype=np.float32)
    comm.barrier()
    group = mean_us(lambda: comm.allreduce(x), iters)
    if comm.rank == 0:
        solo = chorus.init(rank=0, size=1, addr="127.0.0.1:0")
        api = mean_us(lambda: solo.allreduce(x), iters * 5)
        ptr = x.ctypes.data
        with solo._handle.use() as h:
            raw = mean_us(lambda: lib.chorus_allreduce_opts(h, ptr, ptr, 2, 7, 0, None), iters * 5)
        solo.close()
        print(f"allreduce 8 B, {comm.size} ranks, Python API: {group:.2f} us/call ({iters} calls)")
        print(f"group of one (no communication): Python API {api:.2f} us, raw ctypes call {raw:.2f} us")
    comm.barrier()
    comm.close()


if __name__ == "__main__":
    main()
