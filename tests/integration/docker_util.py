"""Docker for the container tests: whether an engine answers, and the images
they run. attnserve_image() is the one place that decides which attnserve
image the tests use (ATTNSERVE_IMAGE, or a build of the project's Dockerfile)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.abspath(os.environ.get("ATTNSERVE_SOURCE_DIR")
                       or os.path.join(os.path.dirname(__file__), "..", ".."))
BASE_IMAGE = "debian:bookworm"
# Docker's layer cache makes a rebuild of an unchanged tree take seconds, so
# every test that builds this tag shares one build.
TEST_TAG = "attnserve:test"


def run(*argv, timeout=600, check=True, **kw):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited with {out.returncode}:\n{out.stdout[-4000:]}{out.stderr[-4000:]}")
    return out


def require_docker():
    """Skips the test (saying why) when no Docker engine answers or the base image is missing."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client (Debian package docker.io; scripts/install-deps.sh)")
    info = run("docker", "info", "--format", "{{.ServerVersion}}", timeout=60, check=False)
    if info.returncode != 0:
        pytest.skip(f"no Docker engine answers: {info.stderr.strip()[:300]}")
    if run("docker", "image", "inspect", BASE_IMAGE, timeout=60, check=False).returncode != 0:
        pytest.skip(f"base image {BASE_IMAGE} absent (no registry here: debootstrap + docker import)")


def attnserve_image():
    """The attnserve image under test: $ATTNSERVE_IMAGE if set (already built),
    else the project's Dockerfile built as TEST_TAG."""
    image = os.environ.get("ATTNSERVE_IMAGE")
    if image:
        run("docker", "image", "inspect", image, timeout=60)
        return image
    run("docker", "build", "-q", "-t", TEST_TAG, ROOT, timeout=1200)
    return TEST_TAG
