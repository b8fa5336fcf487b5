"""ctest entry for the tests against Hugging Face's own attention modules: a
venv under the build dir (cached; --system-site-packages so that Debian's
torch 1.13 and numpy are visible) with transformers 4.45.2, the newest that
imports with torch 1.13, from PyPI; then pytest on this folder's tests with
that venv's Python."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("ATTNSERVE_BUILD_DIR") or os.path.join(HERE, "..", "..", "build")
VENV = os.path.join(BUILD, "hf-venv")
PY = os.path.join(VENV, "bin", "python")
REQUIREMENTS = ["transformers==4.45.2"]


def main():
    stamp = os.path.join(VENV, ".installed-" + "-".join(REQUIREMENTS))
    if not os.path.exists(stamp):
        subprocess.check_call(["/usr/bin/python3", "-m", "venv", "--clear", "--system-site-packages", VENV])
        env = dict(os.environ, PIP_CACHE_DIR=os.path.join(BUILD, "pip-cache"),
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
        subprocess.check_call([PY, "-m", "pip", "install", "-q", *REQUIREMENTS], env=env)
        open(stamp, "w").close()
    tests = sorted(os.path.join(HERE, f) for f in os.listdir(HERE) if f.startswith("test_"))
    os.execv(PY, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *sys.argv[1:]])


if __name__ == "__main__":
    main()
