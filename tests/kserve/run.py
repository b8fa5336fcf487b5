"""ctest entry for the KServe v2 tests: a venv under the build dir (cached;
--system-site-packages so Debian's numpy and torch are visible) with Triton's
own Python client, tritonclient[grpc,http] (and ml_dtypes for BF16) from PyPI,
then pytest on test_kserve.py, test_kserve_http.py, test_kserve_security.py,
test_model_control.py and test_kserve_shm.py with that venv's Python."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from venv_runner import run_pytest_in_venv  # noqa: E402

REQUIREMENTS = ["tritonclient[grpc,http]>=2.40", "ml_dtypes>=0.3"]

if __name__ == "__main__":
    run_pytest_in_venv("kserve-venv", REQUIREMENTS,
                       [os.path.join(HERE, "test_kserve.py"),
                        os.path.join(HERE, "test_kserve_http.py"),
                        os.path.join(HERE, "test_kserve_security.py"),
                        os.path.join(HERE, "test_model_control.py"),
                        os.path.join(HERE, "test_kserve_shm.py")], sys.argv[1:])
