"""Runs pytest in a venv under the build dir (cached; --system-site-packages,
so that Debian's numpy, torch and grpcio stay visible) with packages from
PyPI that Debian does not have: the ctest entries of tests/kserve (Triton's
own client) and tests/hf (transformers) go through it."""

import os
import subprocess
import sys


def run_pytest_in_venv(name, requirements, tests, args):
    """Creates BUILD/name with `requirements` once (a stamp file records
    them), then execs its Python on pytest over `tests` plus `args`."""
    here = os.path.dirname(os.path.abspath(__file__))
    build = os.environ.get("ATTNSERVE_BUILD_DIR") or os.path.join(here, "..", "build")
    venv = os.path.join(build, name)
    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, ".installed-" + "-".join(requirements).replace("/", "_"))
    if not os.path.exists(stamp):
        subprocess.check_call(["/usr/bin/python3", "-m", "venv", "--clear",
                               "--system-site-packages", venv])
        env = dict(os.environ, PIP_CACHE_DIR=os.path.join(build, "pip-cache"),
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
        subprocess.check_call([python, "-m", "pip", "install", "-q", *requirements], env=env)
        open(stamp, "w").close()
    os.execv(python, [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *args])
