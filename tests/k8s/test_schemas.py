"""Every Kubernetes manifest in deploy/ against the Kubernetes API's own
schemas, strictly (an unknown field is an error), with kubernetes-validate.
KServe's kinds are not in its schemas: tests/integration/test_kserve_deploy.py
checks those."""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
MANIFESTS = sorted(glob.glob(os.path.join(ROOT, "deploy", "kubernetes", "*.yaml")))


@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_manifest_is_valid_against_the_kubernetes_schemas(path):
    tool = os.path.join(os.path.dirname(sys.executable), "kubernetes-validate")
    out = subprocess.run([tool, "--strict", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed" in out.stdout + out.stderr
    assert "Couldn't find schema" not in out.stdout + out.stderr


def test_a_wrong_field_is_caught():
    """The check can fail: a misspelt field in a copy of the Deployment."""
    import tempfile
    with open(os.path.join(ROOT, "deploy", "kubernetes", "attnserve.yaml")) as f:
        text = f.read().replace("terminationGracePeriodSeconds", "terminationGracePeriodSecond", 1)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    tool = os.path.join(os.path.dirname(sys.executable), "kubernetes-validate")
    out = subprocess.run([tool, "--strict", f.name], capture_output=True, text=True, timeout=120)
    os.unlink(f.name)
    assert out.returncode != 0, out.stdout + out.stderr
