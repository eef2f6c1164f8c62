#!/usr/bin/python3
"""gloo_gap_bench.py - torch.distributed all_reduce (backend "gloo") after idle time, the peer
of `chorus-perf allreduce --gap MS`: per size, the warm-up calls back to back, then every timed
call after a sleep of MS milliseconds and a barrier, timed on its own; the mean per call, max
over ranks, in the peers format (the rows of gloo_allreduce_bench.py in ../shared/peers).

Launch one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
GLOO_SOCKET_IFNAME set, e.g. on the testbed (tests/netns/cluster.sh up 4 1gbit):

    for r in 0 1 2 3; do
        RANK=$r WORLD_SIZE=4 MASTER_ADDR=10.78.0.1 MASTER_PORT=29600 GLOO_SOCKET_IFNAME=eth0 \\
            ip netns exec chorus-h$((r + 1)) /usr/bin/python3 gloo_gap_bench.py --gap 30 &
    done; wait

The result is checked once per size against the exact sum of integer-valued inputs.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist


def parse_size(s):
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip()
    if s and s[-1].lower() in mult:
        return int(float(s[:-1]) * mult[s[-1].lower()])
    return int(float(s))


def sizes_of(lo, hi, factor):
    out, s = [], lo
    while s <= hi:
        out.append(max(4, s // 4 * 4))
        s *= factor
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", type=parse_size, default=8)
    ap.add_argument("-e", type=parse_size, default=2 << 20)
    ap.add_argument("-f", type=int, default=4)
    ap.add_argument("-w", type=int, default=3)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--gap", type=float, default=30.0, help="milliseconds before every timed call")
    a = ap.parse_args(argv)
    if not 0 < a.gap <= 60000 or a.n < 1 or a.f < 2 or a.b < 1 or a.e < a.b:
        ap.error("need 0 < --gap <= 60000, -n >= 1, -f >= 2 and 1 <= -b <= -e")

    dist.init_process_group(backend="gloo", init_method="env://")
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"# gloo_gap_bench: nranks={p}  in-place float32 sum  torch={torch.__version__} "
              f"gap_ms={a.gap:g}")
        print("#%14s %12s %6s %6s %6s %12s %12s %12s %8s" % (
            "size(B)", "count", "type", "redop", "iters", "time(us)", "algbw(GB/s)",
            "busbw(GB/s)", "#wrong"))
        sys.stdout.flush()
    wrong_total = 0
    for nbytes in sizes_of(a.b, a.e, a.f):
        count = nbytes // 4
        t = torch.zeros(count, dtype=torch.float32)
        for _ in range(a.w):
            dist.all_reduce(t)
        total = 0.0
        for _ in range(a.n):
            time.sleep(a.gap / 1e3)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            total += time.perf_counter() - t0
        dt = torch.tensor([total / a.n], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        # Rank r holds (i % 7) + r: the sum is exact in float32.
        idx = torch.arange(count, dtype=torch.float32)
        t.copy_(torch.remainder(idx, 7) + rank)
        dist.all_reduce(t)
        want = torch.remainder(idx, 7) * p + p * (p - 1) / 2
        bad = torch.tensor([int((t != want).sum())], dtype=torch.int64)
        dist.all_reduce(bad)
        wrong_total += int(bad.item())
        if rank == 0:
            sec = dt.item()
            algbw = nbytes / sec / 1e9
            busbw = algbw * 2.0 * (p - 1) / p
            print("%15d %12d %6s %6s %6d %12.2f %12.4f %12.4f %8d" % (
                nbytes, count, "float", "sum", a.n, sec * 1e6, algbw, busbw, bad.item()))
            sys.stdout.flush()
    dist.destroy_process_group()
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main())
