"""ctest entry for the schema check of the Kubernetes manifests: a venv under
the build dir (cached) with kubernetes-validate from PyPI (it bundles the
Kubernetes API's JSON schemas), then pytest on test_schemas.py with it."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from venv_runner import run_pytest_in_venv  # noqa: E402

REQUIREMENTS = ["kubernetes-validate>=1.30"]

if __name__ == "__main__":
    run_pytest_in_venv("k8s-venv", REQUIREMENTS, [os.path.join(HERE, "test_schemas.py")],
                       sys.argv[1:])
