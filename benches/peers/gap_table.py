#!/usr/bin/env python3
"""gap_table.py - the table of a gap_side_by_side.sh run: per size, the median time per call
(µs, max over ranks) of every entry over its rounds, chorus's share of the best peer (the peer's
time over chorus's: above 100 % chorus is faster), and what quickack does for `auto` and for
forced halving-doubling (time with it over time without).

    benches/peers/gap_table.py RAW        # RAW: lines "entry round size time_us wrong"
"""
import statistics
import sys

CHORUS = ["chorus", "chorus-noqa", "chorus-hd", "chorus-hd-noqa"]
PEERS = ["ompi-tcp", "ompi-tcp-ring", "torch-gloo"]


def parse(lines):
    """{(entry, size): [time_us, ...]} of the rows without wrong elements, the rows left out
    for wrong elements [(entry, size, wrong)], header comments. A wrong result's time says
    nothing of the entry's speed: it never counts (it could make a peer the best)."""
    times, wrong, notes = {}, [], []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            notes.append(line.lstrip("# "))
            continue
        entry, _round, size, t, w = line.split()
        if int(w) != 0:
            wrong.append((entry, int(size), int(w)))
            continue
        times.setdefault((entry, int(size)), []).append(float(t))
    return times, wrong, notes


def fmt_size(b):
    for unit, name in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= unit:
            return f"{b // unit} {name}"
    return f"{b} B"


def fmt_time(v):
    return "-" if v is None else (f"{v:.0f}" if v >= 1000 else f"{v:.1f}")


def table(times, wrong, notes):
    entries = [e for e in CHORUS + PEERS if any(k[0] == e for k in times)]
    sizes = sorted({s for _, s in times})
    med = {k: statistics.median(v) for k, v in times.items()}
    out = [f"*{n}*" for n in notes] + [""]
    out.append("| size | " + " | ".join(entries) +
               " | chorus / best peer (which) | quickack: auto | quickack: hd |")
    out.append("|---:|" + "---:|" * len(entries) + "---|---:|---:|")
    shares = []
    for s in sizes:
        row = [fmt_time(med.get((e, s))) for e in entries]
        peers = {e: med[(e, s)] for e in PEERS if (e, s) in med}
        share = "-"
        if peers and ("chorus", s) in med:
            best = min(peers, key=peers.get)
            pct = 100.0 * peers[best] / med[("chorus", s)]
            shares.append(pct)
            share = f"{pct:.0f} % ({best})"

        def ratio(on, off):
            if (on, s) in med and (off, s) in med:
                return f"{med[(on, s)] / med[(off, s)]:.2f}"
            return "-"

        out.append(f"| {fmt_size(s)} | " + " | ".join(row) +
                   f" | {share} | {ratio('chorus', 'chorus-noqa')} | "
                   f"{ratio('chorus-hd', 'chorus-hd-noqa')} |")
    counts = [len(v) for v in times.values()] or [0]
    out.append("")
    if shares:
        out.append(f"- chorus / best peer: lowest {min(shares):.0f} %; "
                   f"{sum(p >= 100 for p in shares)} of {len(shares)} sizes >= 100 %")
    out.append(f"- rounds per entry and size: {min(counts)}-{max(counts)}; "
               f"rows left out for wrong elements: {len(wrong)}"
               + "".join(f"; {e} at {fmt_size(s)} ({w} wrong)" for e, s, w in wrong))
    return "\n".join(out)


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        times, wrong, notes = parse(f)
    if not times:
        print(f"gap_table.py: no rows in {argv[1]}", file=sys.stderr)
        return 1
    print(table(times, wrong, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
