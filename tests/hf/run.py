"""ctest entry for the tests against Hugging Face's own attention modules:
transformers 4.45.2 (the newest that imports with Debian's torch 1.13) from
PyPI in a venv under the build dir (tests/venv_runner.py), then pytest on
this folder's tests."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from venv_runner import run_pytest_in_venv  # noqa: E402

if __name__ == "__main__":
    tests = sorted(os.path.join(HERE, f) for f in os.listdir(HERE) if f.startswith("test_"))
    run_pytest_in_venv("hf-venv", ["transformers==4.45.2"], tests, sys.argv[1:])
