"""ctest entry for the KServe v2 tests: a venv under the build dir (cached;
--system-site-packages so Debian's numpy and torch are visible) with Triton's
own Python client, tritonclient[grpc] (and ml_dtypes for BF16) from PyPI,
then pytest on test_kserve.py with that venv's Python."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("ATTNSERVE_BUILD_DIR") or os.path.join(HERE, "..", "..", "build")
VENV = os.path.join(BUILD, "kserve-venv")
PY = os.path.join(VENV, "bin", "python")
REQUIREMENTS = ["tritonclient[grpc]>=2.40", "ml_dtypes>=0.3"]


def main():
    stamp = os.path.join(VENV, ".installed")
    if not os.path.exists(stamp):
        subprocess.check_call(["/usr/bin/python3", "-m", "venv", "--clear", "--system-site-packages", VENV])
        env = dict(os.environ, PIP_CACHE_DIR=os.path.join(BUILD, "pip-cache"),
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
        subprocess.check_call([PY, "-m", "pip", "install", "-q", *REQUIREMENTS], env=env)
        open(stamp, "w").close()
    os.execv(PY, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, "test_kserve.py"),
                  *sys.argv[1:]])


if __name__ == "__main__":
    main()
