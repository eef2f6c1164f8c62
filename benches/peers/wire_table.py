#!/usr/bin/env python3
"""wire_table.py - the table of wire_bytes.sh: tbf-charged bytes per allreduce call, per peer.

    wire_table.py [--rate 1gbit] [--calls N1,N2] RAWDIR

RAWDIR holds, per peer and size, `PEER-SIZE.c0`, `.c1`, `.c2` (tbf counters before the first
launch, between the launches, after the second: one line per host, "egress_bytes egress_packets
ingress_bytes ingress_packets") and `PEER-SIZE.out2` (rank 0's table of the second launch).
Per call is (second launch's counts - first launch's) / (second launch's calls - first's); the
calls are read from the launches' tables (the peers' benchmarks stop early at large sizes, at
their byte budget), --calls only where a table does not say. Prints one markdown table per
size.
"""

import argparse
import os
import re
import statistics
import sys

ORDER = ["ref-tcp-ring", "ompi-tcp", "ompi-tcp-ring", "chorus-ring", "chorus-tree",
         "chorus-halving_doubling", "chorus-recursive_doubling", "chorus"]
UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8}


def rate_bytes_per_s(rate):
    m = re.fullmatch(r"([0-9.]+)([a-z]+)", rate.lower())
    if not m or m.group(2) not in UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit")
    return float(m.group(1)) * UNITS[m.group(2)]


def size_bytes(size):
    m = re.fullmatch(r"([0-9]+)([KMG]?)", size.upper())
    if not m:
        raise ValueError(f"size {size!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def read_counters(path):
    rows = [list(map(int, line.split())) for line in open(path) if line.strip()]
    if not rows or any(len(r) != 4 for r in rows):
        raise ValueError(f"{path}: expected one line of 4 counters per host")
    return rows


def per_call(c0, c1, c2, n1, n2):
    """Per host: (egress bytes, egress packets, ingress bytes, ingress packets) per call."""
    if not len(c0) == len(c1) == len(c2):
        raise ValueError(f"counters of {len(c0)}, {len(c1)} and {len(c2)} hosts")
    out = []
    for h0, h1, h2 in zip(c0, c1, c2):
        first = [b - a for a, b in zip(h0, h1)]
        second = [b - a for a, b in zip(h1, h2)]
        out.append([(s - f) / (n2 - n1) for f, s in zip(first, second)])
    return out


def data_line(path):
    """(calls, time per call in us) from a peers-format table's data line, or None."""
    try:
        for line in open(path):
            f = line.split()
            if f and not line.startswith("#") and f[0].isdigit() and len(f) >= 6:
                return int(f[4]), float(f[5])
    except (OSError, ValueError):
        pass
    return None


def collect(raw, n1, n2):
    table = {}
    for name in os.listdir(raw):
        m = re.fullmatch(r"(.+)-([0-9]+[KMGkmg]?)\.c2", name)
        if not m:
            continue
        peer, size = m.groups()
        base = os.path.join(raw, f"{peer}-{size}")
        first, second = data_line(f"{base}.out1"), data_line(f"{base}.out2")
        calls1 = first[0] if first else n1
        calls2 = second[0] if second else n2
        if calls2 <= calls1:
            raise ValueError(f"{base}: the second launch ran {calls2} calls, the first {calls1}")
        hosts = per_call(*(read_counters(f"{base}.c{i}") for i in range(3)), calls1, calls2)
        table.setdefault(size, {})[peer] = (hosts, second[1] if second else None)
    return table


def render(table, rate, n1, n2):
    bps = rate_bytes_per_s(rate)
    lines = [f"tbf-charged bytes per call (median of 4 hosts; a launch of {n2} calls minus one of "
             f"{n1}, fewer where a benchmark's byte budget stops it), {rate} = "
             f"{bps / 1e6:.0f} MB/s", ""]
    rank = {p: i for i, p in enumerate(ORDER)}
    for size in sorted(table, key=size_bytes):
        peers = sorted(table[size], key=lambda p: (rank.get(p, len(ORDER)), p))
        med = {p: [statistics.median(h[i] for h in table[size][p][0]) for i in range(4)]
               for p in peers}
        fewest = min(max(m[0], m[2]) for m in med.values())
        lines += [f"### {size}", "",
                  "| peer | sent B/call | received B/call | packets sent | over the fewest (B) "
                  "| us/call at the rate | us/call measured |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for p in peers:
            eb, ep, ib, _ = med[p]
            busiest = max(eb, ib)
            us = table[size][p][1]
            lines.append(f"| {p} | {eb:.0f} | {ib:.0f} | {ep:.1f} | {busiest - fewest:+.0f} "
                         f"| {busiest / bps * 1e6:.1f} | {'-' if us is None else f'{us:.1f}'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--calls", default="200,1200")
    ap.add_argument("raw")
    a = ap.parse_args(argv)
    n1, n2 = map(int, a.calls.split(","))
    print(render(collect(a.raw, n1, n2), a.rate, n1, n2))


if __name__ == "__main__":
    main(sys.argv[1:])
