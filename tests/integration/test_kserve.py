"""The KServe v2 / Open Inference Protocol front end driven by Triton's own
Python client (tritonclient[grpc] from PyPI).

tritonclient needs a newer grpcio and protobuf than Debian's, so it lives in a
virtual environment under the build dir (made with --system-site-packages, so
Debian's numpy, torch and pytest stay visible; cached across runs). This file
builds it and runs the checks, kserve_tritonclient_checks.py, under its
Python. PyPI must be reachable the first time: without it this test fails
(CI has PyPI)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = os.path.join(HERE, "kserve_tritonclient_checks.py")
# What the venv must hold; the version floor is the first tritonclient that
# takes BF16 inputs as ml_dtypes.bfloat16 arrays.
REQUIREMENT = "tritonclient[grpc]>=2.50"


def _venv_dir():
    build = os.environ.get("ATTNSERVE_BUILD_DIR")
    if not build:
        pytest.fail("$ATTNSERVE_BUILD_DIR is not set: run this test through ctest")
    return os.path.join(build, "kserve-venv")


def _venv_python():
    """The venv's python, created and filled on first use."""
    venv = _venv_dir()
    python = os.path.join(venv, "bin", "python")
    probe = [python, "-c", "import tritonclient.grpc, ml_dtypes"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    # Debian's interpreter, whatever `python3` is on PATH: the venv must see
    # Debian's numpy and torch.
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv], check=True)
    pip = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                          REQUIREMENT], capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.fail(f"pip install {REQUIREMENT} into {venv} failed (is PyPI reachable?):\n"
                    f"{pip.stdout}\n{pip.stderr}")
    check = subprocess.run(probe, capture_output=True, text=True)
    assert check.returncode == 0, f"tritonclient does not import in {venv}:\n{check.stderr}"
    return python


def test_tritonclient_against_attnserve():
    python = _venv_python()
    env = dict(os.environ)
    env["PYTHONPATH"] = HERE
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", CHECKS],
                         env=env, cwd=os.path.dirname(os.path.dirname(HERE)),
                         capture_output=True, text=True, timeout=600)
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    assert run.returncode == 0, f"kserve_tritonclient_checks.py failed:\n{run.stdout[-20000:]}"
