"""Finding what the tests run: the C library and the chorus-run launcher.

``CHORUS_LIBRARY`` (a libchorus.so or libchorus_ffi.so) and ``CHORUS_RUN`` (the chorus-run
binary) win; otherwise the workspace's cargo target directory is searched (release, then
debug). ``scripts/test.sh`` builds both and sets the variables.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

WORKSPACE = Path(__file__).resolve().parents[3]


def _target_dir() -> Path:
    try:
        meta = subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--no-deps"],
            cwd=WORKSPACE,
            check=True,
            capture_output=True,
            timeout=60,
        )
        return Path(json.loads(meta.stdout)["target_directory"])
    except (OSError, subprocess.SubprocessError, ValueError):
        return WORKSPACE / "target"


def _find(env: str, names) -> str:
    if os.environ.get(env):
        return os.environ[env]
    target = _target_dir()
    for profile in ("release", "debug"):
        for name in names:
            p = target / profile / name
            if p.exists():
                return str(p)
    raise pytest.UsageError(
        f"{env} is not set and none of {names} is built under {target}; run "
        "`cargo build -p chorus-ffi -p chorus` or set the variable"
    )


def pytest_configure(config):
    os.environ["CHORUS_LIBRARY"] = _find("CHORUS_LIBRARY", ["libchorus_ffi.so", "deps/libchorus_ffi.so"])
    os.environ["CHORUS_RUN"] = _find("CHORUS_RUN", ["chorus-run"])
    # The package under test is this checkout's, not an installed one.
    pkg = str(WORKSPACE / "ffi" / "python")
    os.environ["PYTHONPATH"] = pkg + os.pathsep + os.environ.get("PYTHONPATH", "")
    import sys

    sys.path.insert(0, pkg)


@pytest.fixture(scope="session")
def workspace() -> Path:
    return WORKSPACE
