#!/usr/bin/python3
"""The ctest entry pyclient.package: builds the attnserve-client sdist and wheel
(python -m build, PyPI packages), installs the wheel into a fresh venv with no
system site-packages and runs the client tests there from a directory outside
the checkout, then again in a venv that sees Debian's torch for the PyTorch
drop-in and the generation example. Venvs, pip's cache and the build tool live
under $ATTNSERVE_BUILD_DIR/pyclient, so later runs download nothing.

    ATTNSERVE_BIN=build/server/attnserve ATTNSERVE_BUILD_DIR=build \\
        ATTNSERVE_SOURCE_DIR=. client/python/tests/run_suite.py
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.normpath(os.path.join(HERE, "..", "..", ".."))
BUILD = os.environ.get("ATTNSERVE_BUILD_DIR") or os.path.join(SOURCE, "build")
CACHE = os.path.join(BUILD, "pyclient")
PLAIN_TESTS = ["test_client.py", "test_aio.py", "test_sessions.py", "test_security.py", "test_wire.py"]
TORCH_TESTS = ["test_torch.py", "test_generate.py"]


def run(cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def pip_env():
    env = dict(os.environ, PIP_CACHE_DIR=os.path.join(CACHE, "pip-cache"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    return env


def venv(path, system_site=False, clear=True):
    if clear or not os.path.exists(os.path.join(path, "bin", "python")):
        run([sys.executable, "-m", "venv", "--clear", *(["--system-site-packages"] if system_site else []), path])
    return os.path.join(path, "bin", "python")


def main():
    if not os.environ.get("ATTNSERVE_BIN"):
        sys.exit("run_suite.py: set ATTNSERVE_BIN (ctest does)")
    os.makedirs(CACHE, exist_ok=True)
    env = pip_env()

    # 1. sdist + wheel with the standard front end, exactly as a user would.
    tools = venv(os.path.join(CACHE, "tools-venv"), clear=False)
    if subprocess.run([tools, "-c", "import build"], capture_output=True).returncode != 0:
        run([tools, "-m", "pip", "install", "-q", "build"], env=env)
    dist = tempfile.mkdtemp(prefix="dist-", dir=CACHE)
    stage = tempfile.mkdtemp(prefix="attnserve-pyclient-tests-")  # outside the checkout
    try:
        run([tools, "-m", "build", "--outdir", dist, os.path.join(SOURCE, "client", "python")], env=env)
        wheel = glob.glob(os.path.join(dist, "attnserve_client-*.whl"))
        sdist = glob.glob(os.path.join(dist, "attnserve_client-*.tar.gz"))
        assert len(wheel) == 1 and len(sdist) == 1, os.listdir(dist)

        for name in PLAIN_TESTS + TORCH_TESTS + ["conftest.py"]:
            shutil.copy(os.path.join(HERE, name), stage)
        shutil.copy(os.path.join(SOURCE, "tests", "integration", "harness.py"), stage)
        test_env = dict(env, ATTNSERVE_EXPECT_INSTALLED="1", ATTNSERVE_SOURCE_DIR=SOURCE)

        # 2. A fresh venv, PyPI only: the package must work without the checkout.
        py = venv(os.path.join(CACHE, "venv-clean"))
        run([py, "-m", "pip", "install", "-q", wheel[0], "pytest"], env=env)
        run([py, "-m", "pip", "list"], env=env)
        run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *PLAIN_TESTS], cwd=stage, env=test_env)

        # 3. Debian's torch (PyPI's wheels are gigabytes) plus the wheel's own deps.
        py = venv(os.path.join(CACHE, "venv-torch"), system_site=True)
        run([py, "-m", "pip", "install", "-q", wheel[0]], env=env)
        run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TORCH_TESTS], cwd=stage, env=test_env)
    except subprocess.CalledProcessError as e:
        print(f"run_suite.py: {' '.join(e.cmd)} exited with {e.returncode}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(dist, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
