"""Multi-process tests: every collective, dtype and error over 4 ranks started by chorus-run,
and the DDP example trained with the chorus hook and with Gloo under chorus-run and torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable


def launch(n, args, timeout=150, env=None):
    """Run ``args`` on ``n`` ranks with chorus-run (bounded by --timeout and a watchdog)."""
    cmd = [os.environ["CHORUS_RUN"], "-n", str(n), "--timeout", str(timeout - 10)]
    for k, v in (env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    cmd += ["--", *args]
    # Not the variables of a launcher that may have started the tests (chorus-run would
    # refuse to run as one of its tasks); Gloo on loopback (it would resolve the host name).
    outer = (
        "SLURM_STEP_NUM_TASKS",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "CHORUS_RUN_NPROC",
        "TORCHELASTIC_RUN_ID",
        "CHORUS_RUN_NESTED",
    )
    child_env = {k: v for k, v in os.environ.items() if k not in outer}
    child_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env)
    return r.returncode, r.stdout + r.stderr


def test_every_collective_and_dtype_on_4_ranks():
    code, out = launch(4, [PYTHON, str(HERE / "_worker.py"), "collectives"])
    assert code == 0, out
    assert out.count("ok collectives") == 4, out


def test_errors_on_4_ranks():
    code, out = launch(4, [PYTHON, str(HERE / "_worker.py"), "errors"], env={"CHORUS_TIMEOUT": "5"})
    assert code == 0, out
    assert out.count("ok errors") == 4, out
    assert "MismatchError" in out, out


def test_groups_on_4_ranks():
    """split, new_group (and a rank passing another list), dup used from a second thread."""
    code, out = launch(4, [PYTHON, str(HERE / "_worker.py"), "groups"])
    assert code == 0, out
    assert out.count("ok groups") == 4, out


@pytest.mark.parametrize("n", [1, 3, 4])
def test_nonblocking_collectives(n):
    code, out = launch(n, [PYTHON, str(HERE / "_worker.py"), "nonblocking"], env={"CHORUS_TIMEOUT": "10"})
    assert code == 0, out
    assert out.count("ok nonblocking") == n, out
    if n > 1:
        assert "async MismatchError" in out, out


@pytest.mark.parametrize("n", [1, 3])
def test_isend_and_irecv(n):
    code, out = launch(n, [PYTHON, str(HERE / "_worker.py"), "transfers"], env={"CHORUS_TIMEOUT": "10"})
    assert code == 0, out
    assert out.count("ok transfers") == n, out
    if n > 1:
        assert "transfer MismatchError" in out, out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_forked_child_cannot_disturb_its_parent(transport):
    code, out = launch(
        3, [PYTHON, str(HERE / "_worker.py"), "fork"], env={"CHORUS_TRANSPORT": transport}
    )
    assert code == 0, out
    assert out.count("ok fork") == 3, out


def test_compression_on_4_ranks():
    code, out = launch(4, [PYTHON, str(HERE / "_worker.py"), "compression"])
    assert code == 0, out
    assert out.count("ok compression") == 4, out


def final_loss(out):
    m = re.search(r"final loss ([0-9.]+)", out)
    assert m, out
    return float(m.group(1))


@pytest.mark.parametrize("buckets", ["default", "many"])
def test_ddp_hook_trains_like_gloo(workspace, buckets):
    """The background hook (several allreduces in flight with many buckets) and the one that
    runs inside the hook train to Gloo's loss."""
    script = str(workspace / "examples" / "ddp_train.py")
    env = {"OMP_NUM_THREADS": "1"}
    args = ["--steps", "100"] + (["--bucket-mb", "0.0001"] if buckets == "many" else [])
    code, out = launch(2, [PYTHON, script, "--hook", "gloo", *args], env=env)
    assert code == 0, out
    gloo_loss = final_loss(out)
    for hook in ("chorus", "chorus-sync"):
        code, out = launch(2, [PYTHON, script, "--hook", hook, *args], env=env)
        assert code == 0, out
        if buckets == "many":
            m = re.search(r"buckets (\d+) after the rebuild", out)
            assert m and int(m.group(1)) >= 3, out
        chorus_loss = final_loss(out)
        assert chorus_loss == pytest.approx(gloo_loss, rel=1e-4), (hook, chorus_loss, gloo_loss)
    assert chorus_loss < 0.5 * final_loss_at_start(workspace), "the model did not learn"


def test_torch_distributed_backend_on_1_to_4_ranks():
    """init_process_group("chorus"): every collective against the naive reference and Gloo."""
    for n in (1, 2, 4):
        code, out = launch(n, [PYTHON, str(HERE / "_torch_backend.py")])
        assert code == 0, out
        assert out.count("ok torch_backend") == n, out


def test_ddp_over_the_chorus_backend_trains_like_gloo(workspace):
    script = str(workspace / "examples" / "ddp_train.py")
    env = {"OMP_NUM_THREADS": "1"}
    # About one bucket per parameter, as large models have many.
    args = ["--steps", "100", "--bucket-mb", "0.0001"]
    code, out = launch(2, [PYTHON, script, "--hook", "backend", *args], env=env)
    assert code == 0, out
    backend_loss = final_loss(out)
    m = re.search(r"buckets (\d+) after the rebuild", out)
    assert m and int(m.group(1)) >= 3, out
    # chorus's background hook over the backend's own communicator.
    code, out = launch(2, [PYTHON, script, "--hook", "backend-hook", *args], env=env)
    assert code == 0, out
    assert final_loss(out) == pytest.approx(backend_loss, rel=1e-4), out
    code, out = launch(2, [PYTHON, script, "--hook", "gloo", *args], env=env)
    assert code == 0, out
    assert backend_loss == pytest.approx(final_loss(out), rel=1e-4), (backend_loss, final_loss(out))
    assert backend_loss < 0.5 * final_loss_at_start(workspace), "the model did not learn"


def test_ddp_compressed_hook_trains(workspace):
    """The compressed hook (int8 bucket by bucket) trains to about the same loss as Gloo."""
    script = str(workspace / "examples" / "ddp_train.py")
    env = {"OMP_NUM_THREADS": "1"}
    code, out = launch(2, [PYTHON, script, "--hook", "gloo", "--steps", "100"], env=env)
    assert code == 0, out
    gloo_loss = final_loss(out)
    code, out = launch(
        2,
        [PYTHON, script, "--hook", "chorus", "--compress", "int8,min_bytes=0", "--steps", "100"],
        env=env,
    )
    assert code == 0, out
    assert final_loss(out) == pytest.approx(gloo_loss, rel=0.05), (final_loss(out), gloo_loss)


def final_loss_at_start(workspace):
    """The loss after a single step (a baseline the trained loss must beat)."""
    code, out = launch(
        2,
        [PYTHON, str(workspace / "examples" / "ddp_train.py"), "--hook", "chorus", "--steps", "1"],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert code == 0, out
    return final_loss(out)


@pytest.mark.parametrize("hook", ["chorus", "backend"])
def test_ddp_example_runs_under_torchrun(workspace, hook):
    """The comm hook (chorus beside a Gloo group) and the backend (no Gloo) under torchrun."""
    torchrun = [PYTHON, "-m", "torch.distributed.run"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    r = subprocess.run(
        torchrun
        # torch 1.13 on Python 3.11 cannot parse the default "0" of --redirects/--tee
        # (IntFlag iteration skips 0); "1" (stdout to a log file, teed to the console) works.
        + ["--nproc_per_node", "2", "--master_port", str(_free_port()), "--redirects", "1", "--tee", "1",
           str(workspace / "examples" / "ddp_train.py"), "--hook", hook, "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # The same training as Gloo's under chorus-run: the gradients were averaged.
    code, ref = launch(
        2,
        [PYTHON, str(workspace / "examples" / "ddp_train.py"), "--hook", "gloo", "--steps", "20"],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert code == 0, ref
    assert final_loss(out) == pytest.approx(final_loss(ref), rel=1e-4), (out, ref)


def _free_port():
    """A port P for torchrun's store such that P + 1 (where chorus's store listens when it shares
    MASTER_ADDR) is free too, below Linux's ephemeral range (32768-60999) so that no outgoing
    connection of another test takes either port between this check and the launch."""
    import random
    import socket

    for _ in range(100):
        port = random.randrange(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports in 20000-32000")
