"""Tests of gap_table.py (run by scripts/test.sh through pytest)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import gap_table  # noqa: E402

RAW = """# gap_side_by_side: gap 30 ms
chorus 1 8 50.0 0
chorus 2 8 70.0 0
chorus 3 8 60.0 0
chorus-noqa 1 8 55.0 0
ompi-tcp 1 8 80.0 0
ompi-tcp 2 8 90.0 0
torch-gloo 1 8 1700.0 0
chorus 1 131072 700.0 0
chorus-noqa 1 131072 7000.0 0
chorus-hd 1 131072 710.0 0
chorus-hd-noqa 1 131072 7100.0 0
ompi-tcp 1 131072 650.0 0
torch-gloo 1 131072 9000.0 2
"""


def test_medians_shares_and_ratios():
    times, wrong, notes = gap_table.parse(RAW.splitlines())
    assert wrong == [("torch-gloo", 131072, 2)]
    # A row with wrong elements never counts: its time says nothing of the speed.
    assert ("torch-gloo", 131072) not in times
    assert notes == ["gap_side_by_side: gap 30 ms"]
    assert times[("chorus", 8)] == [50.0, 70.0, 60.0]
    out = gap_table.table(times, wrong, notes)
    lines = out.splitlines()
    head = next(l for l in lines if l.startswith("| size |"))
    # entries that have rows only, in a fixed order
    assert "ompi-tcp-ring" not in head
    assert head.index("chorus-noqa") < head.index("ompi-tcp") < head.index("torch-gloo")
    row8 = next(l for l in lines if l.startswith("| 8 B |"))
    # median 60 against ompi's median 85: 142 %; quickack 60 / 55
    assert "| 60.0 |" in row8 and "142 % (ompi-tcp)" in row8 and "| 1.09 |" in row8
    row128 = next(l for l in lines if l.startswith("| 128 KiB |"))
    assert "93 % (ompi-tcp)" in row128 and "| 0.10 | 0.10 |" in row128
    assert "lowest 93 %; 1 of 2 sizes >= 100 %" in out
    assert "rows left out for wrong elements: 1; torch-gloo at 128 KiB (2 wrong)" in out


def test_missing_entries_print_dashes():
    times, wrong, notes = gap_table.parse(["chorus 1 8 50.0 0"])
    out = gap_table.table(times, wrong, notes)
    row = next(l for l in out.splitlines() if l.startswith("| 8 B |"))
    assert row.endswith("| - | - | - |")
