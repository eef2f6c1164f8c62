"""Build step of the chorus Python package: builds the C library with cargo and bundles it.

``pip install ./ffi/python`` runs ``cargo build --release -p chorus-ffi`` in the workspace two
directories up and copies ``libchorus_ffi.so`` into the package as ``chorus/libchorus.so``, so
``import chorus`` needs no compiler. Set ``CHORUS_LIBRARY=/path/to/libchorus.so`` to bundle a
library built elsewhere instead (no cargo run).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - wheel is a build requirement
    bdist_wheel = None

HERE = Path(__file__).resolve().parent
WORKSPACE = HERE.parent.parent


def _built_library() -> Path:
    """Path of the C library to bundle, building it with cargo unless CHORUS_LIBRARY is set."""
    given = os.environ.get("CHORUS_LIBRARY")
    if given:
        path = Path(given)
        if not path.is_file():
            sys.exit(f"CHORUS_LIBRARY={given}: no such file")
        return path
    if not (WORKSPACE / "ffi" / "Cargo.toml").is_file():
        sys.exit(
            f"cannot find the chorus workspace at {WORKSPACE} to build the C library; "
            "build it (cargo build --release -p chorus-ffi) and set CHORUS_LIBRARY"
        )
    cargo = os.environ.get("CARGO", "cargo")
    try:
        subprocess.run(
            [cargo, "build", "--release", "-p", "chorus-ffi"], cwd=WORKSPACE, check=True
        )
        meta = subprocess.run(
            [cargo, "metadata", "--format-version", "1", "--no-deps"],
            cwd=WORKSPACE,
            check=True,
            capture_output=True,
        )
    except FileNotFoundError:
        sys.exit("building chorus needs Rust's cargo on PATH (https://rustup.rs)")
    target = Path(json.loads(meta.stdout)["target_directory"])
    return target / "release" / "libchorus_ffi.so"


class BuildPyWithLibrary(build_py):
    """build_py that also puts libchorus.so into the built package."""

    def run(self):
        super().run()
        dest = Path(self.build_lib) / "chorus" / "libchorus.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_built_library(), dest)
        os.chmod(dest, 0o755)


cmdclass = {"build_py": BuildPyWithLibrary}

if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        """The wheel holds a native library: tag it for this platform, any Python 3."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass)
