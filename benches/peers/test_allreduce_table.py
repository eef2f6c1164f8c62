"""Tests of allreduce_table.py on made-up raw files (run by scripts/test.sh with pytest)."""
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("allreduce_table", os.path.join(HERE, "allreduce_table.py"))
table_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table_mod)

HEADER = "#       size(B)        count   type  redop  iters     time(us)  algbw(GB/s)  busbw(GB/s)   #wrong\n"


def write(folder, peer, rep, rows):
    """rows: {size: (time_us, busbw_GBps)}"""
    with open(os.path.join(folder, f"{peer}.rep{rep}.txt"), "w") as f:
        f.write(HEADER)
        for size, (t, bw) in rows.items():
            f.write(f"{size:>15} {size // 4:>12}  float    sum    200 {t:>12.2f} {bw:>12.4f} {bw:>12.4f}        0\n")


def at_busbw(bw):
    """(time, busbw) of a 1 MiB-class row whose busbw is bw GB/s: the time follows from it
    (the table compares times, and shows busbw above 128 B)."""
    return 1000.0 / bw, bw


def scenario(tmp_path, again):
    folder = tmp_path / "loopback-np4"
    folder.mkdir()
    big = 1 << 20
    # Per schedule: three launches; the medians are the middle values.
    launches = {
        "chorus-tcp-ring": [(80.0, 1.0), (90.0, 1.2), (100.0, 1.1)],       # 90 us, 1.1 GB/s
        "chorus-tcp-tree": [(40.0, 0.5), (50.0, 0.6), (45.0, 0.7)],        # 45 us, 0.6
        "chorus-tcp-halving_doubling": [(60.0, 0.9), (60.0, 0.9), (60.0, 0.9)],
        "chorus-tcp-recursive_doubling": [(42.0, 0.4), (44.0, 0.4), (43.0, 0.4)],  # 43 us
        "chorus-tcp": [(50.0, 1.0), (47.0, 0.979), (60.0, 0.5)],           # 50 us, 0.979
        "ompi-tcp": [(55.0, 0.8), (55.0, 0.8), (55.0, 0.8)],
        "ompi-vader": [(1.0, 9.0), (1.0, 9.0), (1.0, 9.0)],                # left out
    }
    if again:
        launches["chorus-tcp-again"] = [(43.0, 1.21), (43.0, 1.21), (43.0, 1.21)]
    for peer, rows in launches.items():
        for k, (t, bw) in enumerate(rows, 1):
            write(folder, peer, k, {8: (t, 0.0), big: at_busbw(bw)})
    return folder


def cells(text, size):
    for line in text.splitlines():
        if line.startswith(f"| {size} |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row {size} in\n{text}")


def test_ratios_against_the_best_schedule_and_peer(tmp_path):
    text = table_mod.table("loopback-np4", str(scenario(tmp_path, again=False)))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    assert header[:6] == ["size", "ring", "tree", "halving_doubling", "recursive_doubling", "auto"]
    assert "ompi-vader" not in header and "auto again" not in header
    small = dict(zip(header, cells(text, "8 B")))
    # Time up to 128 B: auto 50 us against recursive doubling's 43 us and Open MPI's 55.
    assert small["auto"] == "50.0"
    assert small["auto / best schedule"] == "86 %"
    assert small["auto / best peer (which)"] == "110.0 % (ompi-tcp)"
    large = dict(zip(header, cells(text, "1 MiB")))
    # busbw above: auto 979 MB/s against the ring's 1100 (89 %).
    assert large["auto"] == "979" and large["ring"] == "1100"
    assert large["auto / best schedule"] == "89 %"
    assert "0 of 2 sizes >= 90 %" in text
    # Three launches: the intervals are said to be rough.
    assert "intervals from as few as 3 launches are rough" in text


def test_rows_with_wrong_results_are_left_out(tmp_path):
    folder = tmp_path / "loopback-np4"
    folder.mkdir()
    for peer, times in [("chorus-tcp-ring", [50.0] * 3), ("chorus-tcp", [40.0, 42.0, 44.0]),
                        ("ompi-tcp", [50.0] * 3)]:
        for k, t in enumerate(times, 1):
            write(folder, peer, k, {8: (t, 0.0)})
    # A fourth launch of auto, far faster, with wrong results: not in the medians.
    with open(folder / "chorus-tcp.rep4.txt", "w") as f:
        f.write(HEADER)
        f.write(f"{8:>15} {2:>12}  float    sum    200 {1.0:>12.2f} {0.0:>12.4f} {0.0:>12.4f}        3\n")
    text = table_mod.table("loopback-np4", str(folder))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    small = dict(zip(header, cells(text, "8 B")))
    assert small["auto"] == "42.0", small
    assert small["auto / best peer (which)"] == "119.0 % (ompi-tcp)", small
    assert "- rows left out for wrong results: auto 1" in text, text


def test_a_size_auto_got_wrong_everywhere_still_shows(tmp_path):
    folder = tmp_path / "loopback-np4"
    folder.mkdir()
    for peer in ["chorus-tcp-ring", "chorus-tcp", "ompi-tcp"]:
        for k in (1, 2, 3):
            write(folder, peer, k, {8: (50.0, 0.0)})
            if peer != "chorus-tcp":
                with open(folder / f"{peer}.rep{k}.txt", "a") as f:
                    f.write(f"{64:>15} {16:>12}  float    sum    200 {60.0:>12.2f} {0.0:>12.4f} {0.0:>12.4f}        0\n")
            else:
                with open(folder / f"{peer}.rep{k}.txt", "a") as f:
                    f.write(f"{64:>15} {16:>12}  float    sum    200 {1.0:>12.2f} {0.0:>12.4f} {0.0:>12.4f}        5\n")
    text = table_mod.table("loopback-np4", str(folder))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    row = dict(zip(header, cells(text, "64 B")))
    assert row["auto"] == "—" and row["auto / best peer (which)"] == "—", row
    assert "- rows left out for wrong results: auto 3" in text, text


def test_null_column(tmp_path):
    text = table_mod.table("loopback-np4", str(scenario(tmp_path, again=True)))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    assert header[6] == "auto again"
    small = dict(zip(header, cells(text, "8 B")))
    assert small["again / auto"] == "116 %"          # 50 / 43
    assert small["again / best schedule"] == "100 %"
    large = dict(zip(header, cells(text, "1 MiB")))
    assert large["again / auto"] == "124 %"          # 1210 / 979
    assert large["again / best schedule"] == "110 %"
    assert "null, again / auto: 116–124 %" in text
    assert "again / best schedule: 2 of 2 sizes >= 90 %" in text


def test_schedule_picks(tmp_path):
    folder = scenario(tmp_path, again=True)
    big = 1 << 20
    # auto's launches name their schedules (as chorus-perf prints them, behind launch.sh's
    # rank prefix or not); the copy's do not, so it gets no picks column.
    for k, (small, large) in enumerate([("rd", "ring"), ("tree", "halving_doubling"), ("rd", "ring")], 1):
        with open(folder / f"chorus-tcp.rep{k}.txt", "a") as f:
            long = {"rd": "recursive_doubling"}.get(small, small)
            f.write(f"# schedule 8 {long} tuned\n")
            f.write(f"[0] # schedule {big} {large} {'model' if k == 2 else 'tuned'}\n")
    text = table_mod.table("loopback-np4", str(folder))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    assert header[-1] == "auto: schedules" and "auto again: schedules" not in header
    assert dict(zip(header, cells(text, "8 B")))["auto: schedules"] == "rd 2, tree 1"
    assert dict(zip(header, cells(text, "1 MiB")))["auto: schedules"] == "ring 2, hd* 1"
    # The comments do not change the numbers.
    assert dict(zip(header, cells(text, "8 B")))["auto"] == "50.0"


def test_no_picks_column_without_comments(tmp_path):
    text = table_mod.table("loopback-np4", str(scenario(tmp_path, again=False)))
    assert "schedules" not in text.splitlines()[4]


def test_bootstrap_interval():
    # Launches that never vary give a point: auto at 80 % of the best schedule (times, at
    # every size).
    assert table_mod.boot_interval([10.0] * 5, {"ring": [8.0] * 5, "tree": [50.0] * 5}, 1 << 20, 1) == (0.8, 0.8)
    # Times up to 128 B: auto 50 us against the fastest schedule's 40 us.
    assert table_mod.boot_interval([50.0] * 3, {"rd": [40.0] * 3, "ring": [90.0] * 3}, 8, 1) == (0.8, 0.8)
    # A noisy auto: its launches run either as fast as the schedule or half as fast, so the
    # resampled medians reach both ends and the interval spans them.
    lo, hi = table_mod.boot_interval([10.0, 20.0, 10.0, 20.0, 10.0, 20.0], {"ring": [10.0] * 6}, 1 << 20, 1)
    assert lo == 0.5 and hi == 1.0
    # The same seed gives the same interval; no launches give none.
    noisy = ([9.0, 7.0, 10.0, 8.0], {"ring": [10.0, 9.5, 11.0]})
    assert table_mod.boot_interval(*noisy, 1 << 20, 7) == table_mod.boot_interval(*noisy, 1 << 20, 7)
    # Its ends lie between the ratios the resampled medians can make: the ring's 9.5-11 us
    # against auto's 7-10 us (times: auto is ahead), i.e. 0.95 to 11/7, and not at one point.
    lo, hi = table_mod.boot_interval(*noisy, 1 << 20, 7)
    assert 0.95 <= lo < hi <= 11 / 7, (lo, hi)
    assert table_mod.boot_interval([], {"ring": [1.0]}, 8, 1) is None


def test_interval_column_and_summary(tmp_path):
    text = table_mod.table("loopback-np4", str(scenario(tmp_path, again=False)))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    assert header[header.index("auto / best schedule") + 1] == "90 % interval"
    # 1 MiB: halving-doubling's launches are all 900 MB/s and the ring's 1000-1200; auto's
    # 500-1000, so the interval runs from below half to above 90 %.
    iv = dict(zip(header, cells(text, "1 MiB")))["90 % interval"]
    lo, hi = (int(x) for x in iv.rstrip(" %").split("–"))
    assert lo <= 50 and 90 <= hi <= 100
    assert "its 90 % bootstrap intervals: 0 of 2 sizes wholly >= 90 %" in text


def test_peer_interval_column_and_summary(tmp_path):
    # Against the peers the goal is 100 %: auto 1 % short in every launch is a miss the
    # launches' noise does not explain, and the summary names it; a tie straddles.
    folder = tmp_path / "netns4-1gbit"
    folder.mkdir()
    big = 32 << 10
    launches = {
        "chorus-ring": [(400.0, 0.118), (400.0, 0.119), (400.0, 0.118)],
        "chorus-halving_doubling": [(400.0, 0.119), (400.0, 0.119), (400.0, 0.119)],
        "chorus": [(43.0, 0.1188), (44.0, 0.1188), (45.0, 0.1188)],       # 44 us, 118.8 MB/s
        "ompi-tcp": [(56.0, 0.120), (55.0, 0.120), (57.0, 0.120)],        # 56 us, 120 MB/s
        "ref-tcp-ring": [(170.0, 0.1195), (170.0, 0.1195), (170.0, 0.1195)],
    }
    for peer, rows in launches.items():
        for k, (t, bw) in enumerate(rows, 1):
            write(folder, peer, k, {8: (t, 0.0), big: at_busbw(bw)})
    text = table_mod.table("netns4-1gbit", str(folder))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    assert header[header.index("auto / best peer (which)") + 1] == "90 % interval (peer)"
    large = dict(zip(header, cells(text, "32 KiB")))
    assert large["auto / best peer (which)"] == "99.0 % (ompi-tcp)"
    assert large["90 % interval (peer)"] == "99.0–99.0 %"
    small = dict(zip(header, cells(text, "8 B")))
    lo, hi = (float(x) for x in small["90 % interval (peer)"].rstrip(" %").split("–"))
    assert 100.0 < lo <= hi  # 43-45 us against 55-57: wholly faster
    assert "- auto / best peer: lowest 99.0 % (at 32 KiB); 1 of 2 sizes >= 100 %" in text
    assert ("- its 90 % bootstrap intervals: 1 of 2 sizes wholly >= 100 %, 0 straddle 100 %, "
            "1 wholly below (32 KiB)") in text


def test_cached_auto_column_and_ratio(tmp_path):
    # An auto peer with a tuning file gets its own column and its own ratio to the best peer.
    folder = tmp_path / "netns4-1gbit"
    folder.mkdir()
    big = 32 << 10
    launches = {
        "chorus-halving_doubling": [(400.0, 0.119), (400.0, 0.119), (400.0, 0.119)],
        "chorus": [(44.0, 0.1180), (44.0, 0.1180), (44.0, 0.1180)],
        "chorus-cached": [(42.0, 0.1200), (42.0, 0.1200), (42.0, 0.1200)],
        "ompi-tcp": [(56.0, 0.120), (55.0, 0.120), (57.0, 0.120)],
    }
    for peer, rows in launches.items():
        for k, (t, bw) in enumerate(rows, 1):
            write(folder, peer, k, {8: (t, 0.0), big: at_busbw(bw)})
    text = table_mod.table("netns4-1gbit", str(folder))
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    assert header[header.index("auto") + 1] == "auto cached"
    assert len(text.splitlines()[5].split("|")) == len(header) + 2
    large = dict(zip(header, cells(text, "32 KiB")))
    assert large["auto cached"] == "120"
    assert large["auto / best peer (which)"] == "98.3 % (ompi-tcp)"
    assert large["cached / best peer (which)"] == "100.0 % (ompi-tcp)"
    assert large["90 % interval (cached)"] == "100.0–100.0 %"
    # The cached peer is not a peer of auto's ratio, and not a schedule.
    assert "- auto cached / best peer: lowest 100.0 % (at 32 KiB); 2 of 2 sizes >= 100 %" in text
