"""Tests of run_with_chorus.sh's shuffled round order (run by scripts/test.sh with pytest)."""
import os
import re
import subprocess

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
