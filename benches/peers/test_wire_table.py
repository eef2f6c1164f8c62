"""Tests of wire_table.py on made-up counter files (run by scripts/test.sh with pytest)."""
import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("wire_table", os.path.join(HERE, "wire_table.py"))
wire = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wire)


def write_peer(raw, peer, size, per_call, startup, us, n1=200, n2=1200):
    """Counters of 4 hosts around two launches of n1 and n2 calls; each launch also costs
    `startup` (bytes, packets) that the difference must remove. per_call: per host, 4 values."""
    now = [[1000 * h, 10 * h, 2000 * h, 20 * h] for h in range(4)]
    snaps = [[list(r) for r in now]]
    for n in (n1, n2):
        for h in range(4):
            for i in range(4):
                now[h][i] += per_call[h][i] * n + startup[i % 2]
        snaps.append([list(r) for r in now])
    for i, snap in enumerate(snaps):
        with open(os.path.join(raw, f"{peer}-{size}.c{i}"), "w") as f:
            f.writelines(" ".join(map(str, r)) + "\n" for r in snap)
    for i, n in ((1, n1), (2, n2)):
        with open(os.path.join(raw, f"{peer}-{size}.out{i}"), "w") as f:
            f.write("#       size(B)        count   type  redop  iters     time(us)  algbw  busbw  #wrong\n")
            f.write(f"{wire.size_bytes(size):>15} {wire.size_bytes(size) // 4:>12}  float    sum  {n} {us:>12.2f} 0.1 0.1 0\n")


def test_per_call_bytes_leave_out_start_up_and_name_the_fewest(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    # ref: 51787 B sent and received on every host; chorus: 51861 on three hosts, one odd host.
    write_peer(raw, "ref-tcp-ring", "32K", [[51787, 40, 51787, 40]] * 4, (90000, 70), 414.5)
    write_peer(raw, "chorus-halving_doubling", "32K",
               [[51861, 40, 51861, 40]] * 3 + [[60000, 50, 51861, 40]], (120000, 90), 415.0)
    table = wire.collect(str(raw), 200, 1200)
    hosts, us = table["32K"]["ref-tcp-ring"]
    assert us == 414.5
    assert hosts[0] == pytest.approx([51787, 40, 51787, 40])
    out = wire.render(table, "1gbit", 200, 1200)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    # Medians over hosts: the odd host does not move chorus's figure.
    assert "| 51861 | 51861 | 40.0 | +74 | 414.9 | 415.0 |" in rows["chorus-halving_doubling"]
    assert "| 51787 | 51787 | 40.0 | +0 | 414.3 | 414.5 |" in rows["ref-tcp-ring"]
    # The reference is listed first, whatever the directory order.
    assert out.index("ref-tcp-ring") < out.index("chorus-halving_doubling")


def test_calls_come_from_the_launches_tables(tmp_path):
    # A peer whose byte budget stopped its second launch at 1024 calls: per call is over 824.
    raw = tmp_path / "raw"
    raw.mkdir()
    write_peer(raw, "ompi-tcp", "2M", [[3293000, 2222, 3293000, 2222]] * 4, (5000, 9), 26350.0,
               n1=200, n2=1024)
    hosts, _ = wire.collect(str(raw), 200, 1200)["2M"]["ompi-tcp"]
    assert hosts[0] == pytest.approx([3293000, 2222, 3293000, 2222])


def test_rates_and_sizes():
    assert wire.rate_bytes_per_s("1gbit") == 125e6
    assert wire.rate_bytes_per_s("500mbit") == 62.5e6
    assert wire.size_bytes("512K") == 512 * 1024
    with pytest.raises(ValueError):
        wire.rate_bytes_per_s("fast")


def test_a_counter_file_with_a_missing_column_is_an_error(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_peer(raw, "ompi-tcp", "8K", [[13299, 14, 13300, 14]] * 4, (0, 0), 100.0)
    with open(raw / "ompi-tcp-8K.c1", "w") as f:
        f.write("1 2 3\n")
    with pytest.raises(ValueError):
        wire.collect(str(raw), 200, 1200)
