#!/usr/bin/env python3
"""compare_table.py - one markdown table from several launches of a chorus-perf comparison.

    compare_table.py OUT1 OUT2 ...

Each OUT is the table output of one launch of
    chorus-perf allreduce --algo all --rounds N ...
(rank 0's stdout, with or without chorus-run's "[0] " prefix). Per size the table gives every
entry's median busbw over the launches (MB/s; time in us up to 128 B), then per launch the best
forced schedule and auto's share of it: of the medians over rounds / paired by round.
"""
import re
import statistics
import sys

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+([\d.]+|NaN)x\s*$")
BEST = re.compile(r"^#  best schedule: (\S+); auto ([\d.]+) %(?: \(paired by round ([\d.]+) %\))?")


def human(size):
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def parse(path):
    rows = {}  # size -> {entry: (time_us, busbw)}
    best = {}  # size -> (schedule, share, paired)
    wrong_auto = set()  # sizes where auto's own result was wrong: no share for them
    order = []
    last = None
    ranks = None
    with open(path) as f:
        for line in f:
            line = re.sub(r"^\[\d+\] ", "", line.rstrip("\n"))
            m = re.match(r"^# chorus-perf: ranks (\d+),", line)
            if m:
                ranks = int(m.group(1))
            m = ROW.match(line)
            if m:
                size, entry = int(m.group(1)), m.group(5)
                last = size
                if m.group(9) not in ("0", "N/A"):
                    # A wrong result: its time says nothing (and must not be a best).
                    if entry == "auto":
                        wrong_auto.add(size)
                    continue
                if ranks is None:
                    sys.exit(f"{path}: no '# chorus-perf: ranks N' header line")
                t = float(m.group(6))
                # busbw in MB/s from the time (the table's GB/s has 2 decimals)
                bw = size / t * 2 * (ranks - 1) / ranks if t > 0 else 0.0
                rows.setdefault(size, {})[entry] = (t, bw)
                if entry not in order:
                    order.append(entry)
                continue
            m = BEST.match(line)
            if m and last is not None and last not in wrong_auto:
                best[last] = (m.group(1), float(m.group(2)), float(m.group(3) or "nan"))
    for size in wrong_auto:
        best[size] = ("auto wrong", float("nan"), float("nan"))
    return rows, best, order


def main(paths):
    if not paths:
        sys.exit(__doc__)
    runs = [parse(p) for p in paths]
    order = runs[0][2]
    sizes = sorted(set().union(*(r[0].keys() for r in runs)))
    head = ["size"] + order + [f"launch {i + 1}: best, auto share (paired)" for i in range(len(runs))]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for s in sizes:
        cells = [human(s)]
        for e in order:
            vals = [r[0][s][e] for r in runs if s in r[0] and e in r[0][s]]
            if not vals:
                cells.append("")
            elif s <= 128:
                cells.append(f"{statistics.median(v[0] for v in vals):.1f}")
            else:
                cells.append(f"{statistics.median(v[1] for v in vals):.0f}")
        for r in runs:
            b = r[1].get(s)
            if b and b[1] != b[1]:
                cells.append(b[0])  # auto's result was wrong: no share
            elif b:
                paired = "" if b[2] != b[2] else f" ({b[2]:.1f} %)"
                cells.append(f"{b[0]}: {b[1]:.1f} %{paired}")
            else:
                cells.append("")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
