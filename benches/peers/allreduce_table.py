#!/usr/bin/env python3
"""allreduce_table.py RAW_DIR [SCENARIO ...] - the allreduce table of issue #4 from one run of
run_with_chorus.sh --algorithms (raw outputs of the peers harness, one file per launch).

For every scenario folder of RAW_DIR (loopback-np4, netns4-1gbit, ...; or only those named)
it prints one markdown table: per message size the median over launches of every chorus
schedule, of chorus `auto` and of every peer (time in us up to 128 B, busbw in MB/s above),
then two ratios of the medians of their times (at every size; a launch's rows that counted
wrong results are left out):
  auto / best schedule : auto against the fastest chorus schedule at that size
  chorus / best peer   : auto against the fastest peer (Open MPI default and forced ring,
                         Gloo, the reference ring; shared-memory peers are left out of the
                         TCP comparison), with one decimal and its own 90 % bootstrap
                         interval (the goal there is 100 %)
A ratio >= 100 % means auto is at least as fast.  With a second `auto` peer (run_with_chorus.sh
--null: chorus-tcp-again, chorus-again) the table adds its column and two null figures:
  again / auto         : the same program in other launches of the same run
  again / best schedule: the first ratio as the second copy would have scored it
so that the spread launch-to-launch noise alone gives the columns is in view.  With an `auto`
peer that keeps its tuning decisions in a file (run_with_chorus.sh --tune-file:
chorus-tcp-cached, chorus-cached) the table adds its column ("auto cached") and its ratio to the
best peer with that ratio's interval ("cached / best peer").  The column after
the first ratio is its 90 % bootstrap interval: every peer's launches resampled with replacement
(2000 times, a fixed seed), the medians and the best schedule taken again; the summary counts
the sizes whose interval lies wholly above 90 %, straddles it, or lies wholly below (a miss the
launches' noise does not explain). With few launches the interval is rough: with 3, a
resampled median is the smallest or largest launch a quarter of the time each, so the 5 % and
95 % ends are those launches and the interval covers the true median only about 75 % of the
time; the table says so below 8 launches.  Where chorus-perf
printed which schedule `auto` ran at each size (`# schedule SIZE NAME tuned|model|direct`
comments), a column counts them over the launches of `auto` (and one over its copy's), e.g.
`ring 3, hd 2` (`*` marks a schedule tuning had not settled, the model's choice), so a miss can
be told apart: a poor pick, or noise on the same pick.  Standard library only.
"""
import os
import random
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
BOOT_SAMPLES = 2000  # bootstrap resamples of the launches
BOOT_TAIL = 0.05  # each tail left out of the interval: a 90 % interval


def human(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def parse(path):
    """{size: (time_us, busbw)} of one launch; rows that counted wrong results are left out
    (their launch measured something else than a correct allreduce)"""
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = ROW_RE.match(line)
            if m and m.group(7) in ("0", "N/A"):
                rows[int(m.group(1))] = (float(m.group(4)), float(m.group(6)))
    return rows


def wrong_rows(path):
    """How many rows of one launch counted wrong results (left out by `parse`)"""
    n = 0
    with open(path, errors="replace") as f:
        for line in f:
            m = ROW_RE.match(line)
            if m and m.group(7) not in ("0", "N/A"):
                n += 1
    return n


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


def fastest(s):
    """How the fastest of several times at size s is found. (Comparisons use the time at
    every size: the busbw column of the files is rounded to 4 decimals of GB/s, 1 % of its
    value at a few hundred bytes on a 1 gbit link.)"""
    return min


def ratio(a, b, s):
    """a's speed over b's at size s, from their times, or None"""
    if a is None or b is None or a == 0 or b == 0:
        return None
    return b / a


def boot_interval(auto_vals, rival_vals, s, seed):
    """(low, high): the bootstrap interval of auto / the best of rival_vals at size s (the best
    schedule, or the best peer). auto_vals: auto's time per launch;
    rival_vals: {schedule or peer: values per launch}. Each list is
    resampled with replacement and the ratio of the medians taken again, BOOT_SAMPLES times;
    the interval leaves BOOT_TAIL out at each end. None without launches."""
    lists = [v for v in rival_vals.values() if v]
    if not auto_vals or not lists:
        return None
    rng = random.Random(seed)
    pick = fastest(s)
    got = []
    for _ in range(BOOT_SAMPLES):
        a = statistics.median(rng.choices(auto_vals, k=len(auto_vals)))
        b = pick(statistics.median(rng.choices(v, k=len(v))) for v in lists)
        r = ratio(a, b, s)
        if r is not None:
            got.append(r)
    if not got:
        return None
    got.sort()
    at = lambda q: got[round(q * (len(got) - 1))]  # noqa: E731
    return at(BOOT_TAIL), at(1 - BOOT_TAIL)


def interval_summary(spans, goal):
    """The summary line of bootstrap intervals [(size, low, high)] against goal (0.9 = 90 %):
    how many lie wholly at or above it, straddle it, or lie wholly below (named)."""
    above = sum(1 for _, lo, _ in spans if lo >= goal)
    below = [human(s) for s, _, hi in spans if hi < goal]
    pct = f"{goal * 100:.0f} %"
    return (f"- its 90 % bootstrap intervals: {above} of {len(spans)} sizes wholly >= {pct}, "
            f"{len(spans) - above - len(below)} straddle {pct}, "
            f"{len(below)} wholly below" + (f" ({', '.join(below)})" if below else ""))


def roles(peers):
    """(auto, again, cached, {schedule: peer}, [other peers]) for the peer names of one
    scenario; again is the second `auto` peer or None, cached the `auto` peer with a tuning
    file or None"""
    auto = "chorus-tcp" if "chorus-tcp" in peers else ("chorus" if "chorus" in peers else None)
    prefix = "chorus-tcp-" if auto == "chorus-tcp" else "chorus-"
    scheds = {s: prefix + s for s in SCHEDULES if prefix + s in peers}
    again = prefix + "again" if prefix + "again" in peers else None
    cached = prefix + "cached" if prefix + "cached" in peers else None
    others = [p for p in peers if not p.startswith("chorus") and "vader" not in p]
    return auto, again, cached, scheds, others


def table(name, folder):
    reps = defaultdict(list)
    chosen = defaultdict(list)
    wrong = defaultdict(int)  # peer -> rows left out for wrong results
    for fn in sorted(os.listdir(folder)):
        m = REP_RE.match(fn)
        if m:
            reps[m.group("name")].append(parse(os.path.join(folder, fn)))
            chosen[m.group("name")].append(picks(os.path.join(folder, fn)))
            wrong[m.group("name")] += wrong_rows(os.path.join(folder, fn))
    auto, again, cached, scheds, others = roles(reps)
    if auto is None or not scheds:
        return None
    # Every size any entry measured: one where auto had no correct row shows as such.
    sizes = sorted(set().union(*(r.keys() for rs in reps.values() for r in rs)))
    scale = 1000.0  # the benchmarks print GB/s
    cols = list(scheds.values()) + [auto] + ([again] if again else []) + ([cached] if cached else []) + others

    def values(peer, s):  # per launch: time (us), what the ratios compare
        return [r[s][0] for r in reps[peer] if s in r]

    def med(peer, s):
        v = values(peer, s)
        return statistics.median(v) if v else None

    def shown(peer, s):  # the median the table shows: time (us) up to LATENCY_MAX, busbw above
        if s <= LATENCY_MAX:
            return med(peer, s)
        v = [r[s][1] * scale for r in reps[peer] if s in r]
        return statistics.median(v) if v else None

    def label(c):
        if c == auto:
            return "auto"
        if c == again:
            return "auto again"
        if c == cached:
            return "auto cached"
        return c.replace("chorus-tcp-", "").replace("chorus-", "")

    null_cols = " | again / auto | again / best schedule" if again else ""
    cached_cols = " | cached / best peer (which) | 90 % interval (cached)" if cached else ""
    pickers = [c for c in ([auto] + ([again] if again else []) + ([cached] if cached else []))
               if any(chosen[c])]
    pick_cols = "".join(f" | {label(c)}: schedules" for c in pickers)
    out = [f"### {name}", "",
           f"time (us) up to {LATENCY_MAX} B, busbw (MB/s) above; median over launches "
           f"({', '.join(f'{c}: {len(reps[c])}' for c in cols)})", "",
           "| size | " + " | ".join(label(c) for c in cols)
           + " | auto / best schedule | 90 % interval | auto / best peer (which) | 90 % interval (peer)"
           + null_cols + cached_cols
           + pick_cols + " |",
           "|---:|" + "---:|" * (len(cols) + 4 + (2 if again else 0) + (2 if cached else 0))
           + "---|" * len(pickers)]
    worst_sched, worst_peer, nulls, null_sched = [], [], [], []
    spans = []  # (size, low, high) of the intervals
    peer_spans = []  # (size, low, high) of auto / best peer's intervals
    worst_cached, cached_spans = [], []  # the same for the cached auto
    for s in sizes:
        m = {c: med(c, s) for c in cols}
        cells = []
        for c in cols:
            v = shown(c, s)
            cells.append("—" if v is None else (f"{v:.1f}" if s <= LATENCY_MAX else f"{v:.0f}"))
        def best_of(names):
            v = [(c, m[c]) for c in names if m[c] is not None]
            if not v:
                return None, None
            return fastest(s)(v, key=lambda x: x[1])
        _, bs = best_of(scheds.values())
        bp_name, bp = best_of(others)
        r1 = ratio(m[auto], bs, s)
        r2 = ratio(m[auto], bp, s)
        if r1 is not None:
            worst_sched.append((r1, s))
        if r2 is not None:
            worst_peer.append((r2, s))
        auto_vals = values(auto, s)
        iv = boot_interval(auto_vals, {c: values(c, s) for c in scheds.values()}, s, s)
        if iv is not None:
            spans.append((s,) + iv)
        ivp = boot_interval(auto_vals, {c: values(c, s) for c in others}, s, s)
        if ivp is not None:
            peer_spans.append((s,) + ivp)
        c1 = "—" if r1 is None else f"{r1 * 100:.0f} %"
        ci = "—" if iv is None else f"{iv[0] * 100:.0f}–{iv[1] * 100:.0f} %"
        # one decimal: the goal against the peers is 100 %, and at the link a shortfall is small
        c2 = "—" if r2 is None else f"{r2 * 100:.1f} % ({bp_name})"
        cp = "—" if ivp is None else f"{ivp[0] * 100:.1f}–{ivp[1] * 100:.1f} %"
        row = f"| {human(s)} | " + " | ".join(cells) + f" | {c1} | {ci} | {c2} | {cp} |"
        if again:
            n1 = ratio(m[again], m[auto], s)
            n2 = ratio(m[again], bs, s)
            if n1 is not None:
                nulls.append((n1, s))
            if n2 is not None:
                null_sched.append((n2, s))
            row += " " + " | ".join("—" if x is None else f"{x * 100:.0f} %" for x in (n1, n2)) + " |"
        if cached:
            r3 = ratio(m[cached], bp, s)
            if r3 is not None:
                worst_cached.append((r3, s))
            iv3 = boot_interval(values(cached, s), {c: values(c, s) for c in others}, s, s)
            if iv3 is not None:
                cached_spans.append((s,) + iv3)
            row += (" " + ("—" if r3 is None else f"{r3 * 100:.1f} % ({bp_name})") + " | "
                    + ("—" if iv3 is None else f"{iv3[0] * 100:.1f}–{iv3[1] * 100:.1f} %") + " |")
        for c in pickers:
            row += f" {pick_counts(chosen[c], s) or '—'} |"
        out.append(row)
    out.append("")
    fewest = min(len(reps[c]) for c in cols)
    if fewest < 8:
        out.append(f"- intervals from as few as {fewest} launches are rough (see the module's "
                   "docs): a wholly-below there is a hint, not a verdict")
    left_out = {c: n for c, n in wrong.items() if n}
    if left_out:
        out.append("- rows left out for wrong results: "
                   + ", ".join(f"{label(c) if c in cols else c} {n}" for c, n in sorted(left_out.items())))
    for what, worst, spans_of, goal, digits in (
            ("auto / best schedule", worst_sched, spans, 0.9, 0),
            ("auto / best peer", worst_peer, peer_spans, 1.0, 1),
            ("auto cached / best peer", worst_cached, cached_spans, 1.0, 1)):
        if worst:
            r, s = min(worst)
            out.append(f"- {what}: lowest {r * 100:.{digits}f} % (at {human(s)}); "
                       f"{sum(1 for x, _ in worst if x >= goal)} of {len(worst)} sizes >= {goal * 100:.0f} %")
        if spans_of:
            out.append(interval_summary(spans_of, goal))
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
