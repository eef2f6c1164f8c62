"""Tests of run_with_chorus.sh's shuffled round order (run by scripts/test.sh with pytest)."""
import os
import re
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "run_with_chorus.sh")


def shuffled(seed, items):
    """chorus_shuffled as run_with_chorus.sh writes it into the harness copy"""
    text = open(SCRIPT).read()
    m = re.search(r"^chorus_shuffled\(\) \{.*?^\}$", text, re.S | re.M)
    assert m, "no chorus_shuffled in run_with_chorus.sh"
    out = subprocess.run(["bash", "-c", m.group(0) + '\nchorus_shuffled "$@"', "-", str(seed)] + items,
                         check=True, capture_output=True, text=True).stdout
    return out.split("\n")[:-1]


def test_every_round_launches_every_peer_once():
    peers = [f"peer{i}=cmd {i} x" for i in range(10)]
    for seed in range(1, 16):
        got = shuffled(seed, peers)
        assert sorted(got) == sorted(peers)


def test_orders_differ_between_rounds_and_repeat_across_runs():
    peers = [f"p{i}" for i in range(10)]
    orders = [tuple(shuffled(k, peers)) for k in range(1, 16)]
    assert orders == [tuple(shuffled(k, peers)) for k in range(1, 16)]
    assert len(set(orders)) == len(orders)
    # No peer keeps one neighbour before it in every round.
    before = {p: {o[o.index(p) - 1] if o.index(p) else None for o in orders} for p in peers}
    assert all(len(b) > 1 for b in before.values())


def test_one_peer():
    assert shuffled(1, ["only=x"]) == ["only=x"]


PEERS_DIR = os.path.join(HERE, "..", "..", "..", "shared", "peers")


def prepare(tmp_path, *args):
    """run_with_chorus.sh --prepare-only on the shared harness; the patched run_all.sh's text"""
    if not os.path.isfile(os.path.join(PEERS_DIR, "run_all.sh")):
        pytest.skip("no peers harness next to the workspace")
    work = tmp_path / "work"
    env = dict(os.environ, PEERS_DIR=PEERS_DIR, CHORUS_PERF="/bin/true")
    r = subprocess.run(["bash", SCRIPT, "--workdir", str(work), "--prepare-only", *args],
                       env=env, capture_output=True, text=True)
    return r, (work / "run_all.sh").read_text() if r.returncode == 0 else ""


def test_hosts_sets_the_testbed_size(tmp_path):
    r, text = prepare(tmp_path, "--hosts", "3", "--algorithms")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^NN=3$", text, re.M) and not re.search(r"^NN=4$", text, re.M)
    assert '"chorus-ring=chorus_netns ring"' in text


def test_default_keeps_four_hosts_and_bad_counts_fail(tmp_path):
    r, text = prepare(tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^NN=4$", text, re.M)
    for bad in ["0", "x", "3 4"]:
        r, _ = prepare(tmp_path, "--hosts", bad)
        assert r.returncode != 0 and "--hosts" in r.stderr, (bad, r.stderr)
