#!/usr/bin/env python3
"""allreduce_table.py RAW_DIR [SCENARIO ...] - the allreduce table of issue #4 from one run of
run_with_chorus.sh --algorithms (raw outputs of the peers harness, one file per launch).

For every scenario folder of RAW_DIR (loopback-np4, netns4-1gbit, ...; or only those named)
it prints one markdown table: per message size the median over launches of every chorus
schedule, of chorus `auto` and of every peer (time in us up to 128 B, busbw in MB/s above),
then two ratios of those medians:
  auto / best schedule : auto against the fastest chorus schedule at that size
  chorus / best peer   : auto against the fastest peer (Open MPI default and forced ring,
                         Gloo, the reference ring; shared-memory peers are left out of the
                         TCP comparison)
A ratio >= 100 % means auto is at least as fast.  With a second `auto` peer (run_with_chorus.sh
--null: chorus-tcp-again, chorus-again) the table adds its column and two null figures:
  again / auto         : the same program in other launches of the same run
  again / best schedule: the first ratio as the second copy would have scored it
so that the spread launch-to-launch noise alone gives the columns is in view.  Where chorus-perf
printed which schedule `auto` ran at each size (`# schedule SIZE NAME tuned|model|direct`
comments), a column counts them over the launches of `auto` (and one over its copy's), e.g.
`ring 3, hd 2` (`*` marks a schedule tuning had not settled, the model's choice), so a miss can
be told apart: a poor pick, or noise on the same pick.  Standard library only.
"""
import os
import re
import statistics
import sys
from collections import defaultdict

REP_RE = re.compile(r"^(?P<name>.+)\.rep(?P<k>\d+)\.txt$")
ROW_RE = re.compile(r"^\s*(?:\[\d+\]\s*)?(\d+)\s+(\d+)\s+\S+\s+\S+\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$")
SCHEDULES = ["ring", "tree", "halving_doubling", "recursive_doubling"]
PICK_RE = re.compile(r"^\s*(?:\[\d+\]\s*)?# schedule (\d+) (\S+) (tuned|model|direct)\s*$")
SHORT = {"halving_doubling": "hd", "recursive_doubling": "rd", "double_tree": "dt"}
LATENCY_MAX = 128  # bytes: up to here the table shows time, above it busbw


def human(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def parse(path):
    """{size: (time_us, busbw)} of one launch"""
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = ROW_RE.match(line)
            if m:
                rows[int(m.group(1))] = (float(m.group(4)), float(m.group(6)))
    return rows


def picks(path):
    """{size: schedule} that `auto` ran in one launch (from its `# schedule` comments; a
    schedule not (yet) settled by tuning, the model's choice, gets a trailing `*`)"""
    out = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = PICK_RE.match(line)
            if m:
                name = SHORT.get(m.group(2), m.group(2))
                out[int(m.group(1))] = name + ("*" if m.group(3) == "model" else "")
    return out


def pick_counts(launches, s):
    """'ring 3, hd 2': the schedules of size s over launches (most frequent first), or ''"""
    counts = defaultdict(int)
    for p in launches:
        if s in p:
            counts[p[s]] += 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def roles(peers):
    """(auto, again, {schedule: peer}, [other peers]) for the peer names of one scenario;
    again is the second `auto` peer or None"""
    auto = "chorus-tcp" if "chorus-tcp" in peers else ("chorus" if "chorus" in peers else None)
    prefix = "chorus-tcp-" if auto == "chorus-tcp" else "chorus-"
    scheds = {s: prefix + s for s in SCHEDULES if prefix + s in peers}
    again = prefix + "again" if prefix + "again" in peers else None
    others = [p for p in peers if not p.startswith("chorus") and "vader" not in p]
    return auto, again, scheds, others


def table(name, folder):
    reps = defaultdict(list)
    chosen = defaultdict(list)
    for fn in sorted(os.listdir(folder)):
        m = REP_RE.match(fn)
        if m:
            reps[m.group("name")].append(parse(os.path.join(folder, fn)))
            chosen[m.group("name")].append(picks(os.path.join(folder, fn)))
    auto, again, scheds, others = roles(reps)
    if auto is None or not scheds:
        return None
    sizes = sorted(set().union(*(r.keys() for r in reps[auto])))
    scale = 1000.0  # the benchmarks print GB/s
    cols = list(scheds.values()) + [auto] + ([again] if again else []) + others

    def med(peer, s):
        v = [r[s] for r in reps[peer] if s in r]
        if not v:
            return None
        if s <= LATENCY_MAX:
            return statistics.median(x[0] for x in v)
        return statistics.median(x[1] for x in v) * scale

    def better(a, b, s):  # ratio: a's speed over b's
        if a is None or b is None or a == 0 or b == 0:
            return None
        return b / a if s <= LATENCY_MAX else a / b

    def label(c):
        if c == auto:
            return "auto"
        if c == again:
            return "auto again"
        return c.replace("chorus-tcp-", "").replace("chorus-", "")

    null_cols = " | again / auto | again / best schedule" if again else ""
    pickers = [c for c in ([auto] + ([again] if again else [])) if any(chosen[c])]
    pick_cols = "".join(f" | {label(c)}: schedules" for c in pickers)
    out = [f"### {name}", "",
           f"time (us) up to {LATENCY_MAX} B, busbw (MB/s) above; median over launches "
           f"({', '.join(f'{c}: {len(reps[c])}' for c in cols)})", "",
           "| size | " + " | ".join(label(c) for c in cols)
           + " | auto / best schedule | auto / best peer (which)" + null_cols + pick_cols + " |",
           "|---:|" + "---:|" * (len(cols) + 2 + (2 if again else 0)) + "---|" * len(pickers)]
    worst_sched, worst_peer, nulls, null_sched = [], [], [], []
    for s in sizes:
        m = {c: med(c, s) for c in cols}
        cells = []
        for c in cols:
            v = m[c]
            cells.append("—" if v is None else (f"{v:.1f}" if s <= LATENCY_MAX else f"{v:.0f}"))
        def best_of(names):
            v = [(c, m[c]) for c in names if m[c] is not None]
            if not v:
                return None, None
            return (min if s <= LATENCY_MAX else max)(v, key=lambda x: x[1])
        _, bs = best_of(scheds.values())
        bp_name, bp = best_of(others)
        r1 = better(m[auto], bs, s)
        r2 = better(m[auto], bp, s)
        if r1 is not None:
            worst_sched.append((r1, s))
        if r2 is not None:
            worst_peer.append((r2, s))
        c1 = "—" if r1 is None else f"{r1 * 100:.0f} %"
        c2 = "—" if r2 is None else f"{r2 * 100:.0f} % ({bp_name})"
        row = f"| {human(s)} | " + " | ".join(cells) + f" | {c1} | {c2} |"
        if again:
            n1 = better(m[again], m[auto], s)
            n2 = better(m[again], bs, s)
            if n1 is not None:
                nulls.append((n1, s))
            if n2 is not None:
                null_sched.append((n2, s))
            row += " " + " | ".join("—" if x is None else f"{x * 100:.0f} %" for x in (n1, n2)) + " |"
        for c in pickers:
            row += f" {pick_counts(chosen[c], s) or '—'} |"
        out.append(row)
    out.append("")
    if worst_sched:
        r, s = min(worst_sched)
        out.append(f"- auto / best schedule: lowest {r * 100:.0f} % (at {human(s)}); "
                   f"{sum(1 for x, _ in worst_sched if x >= 0.9)} of {len(worst_sched)} sizes >= 90 %")
    if worst_peer:
        r, s = min(worst_peer)
        out.append(f"- auto / best peer: lowest {r * 100:.0f} % (at {human(s)}); "
                   f"{sum(1 for x, _ in worst_peer if x >= 1.0)} of {len(worst_peer)} sizes >= 100 %")
    if nulls:
        dev = sorted(abs(x - 1) for x, _ in nulls)
        out.append(f"- null, again / auto: {min(x for x, _ in nulls) * 100:.0f}–"
                   f"{max(x for x, _ in nulls) * 100:.0f} %, median deviation "
                   f"{statistics.median(dev) * 100:.0f} %; again / best schedule: "
                   f"{sum(1 for x, _ in null_sched if x >= 0.9)} of {len(null_sched)} sizes >= 90 %")
    out.append("")
    return "\n".join(out)


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    raw = sys.argv[1]
    wanted = sys.argv[2:]
    shown = 0
    for scen in sorted(os.listdir(raw)):
        folder = os.path.join(raw, scen)
        if not os.path.isdir(folder) or (wanted and scen not in wanted):
            continue
        t = table(scen, folder)
        if t:
            print(t)
            shown += 1
    if not shown:
        sys.exit(f"allreduce_table.py: no scenario with chorus schedules under {raw}")


if __name__ == "__main__":
    main()
