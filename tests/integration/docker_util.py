"""Docker for the container tests (test_container, test_compose): one engine
and one attnserve image for both.

The engine: the running one, else a dockerd this module starts (its own
socket, data root cached under the build dir) -- so a clean CI machine, where
nothing runs dockerd, runs these tests instead of skipping them. They skip
only where no dockerd can run at all. The base: debian:bookworm made with
debootstrap + docker import when absent (no registry is needed). The image:
the project's Dockerfile built around the binaries this build just made
(--build-arg PREBUILT), in a context of just what that needs; plain
`docker build .` compiles from source instead, which takes ~6-9 minutes on
2 cores (docs/OPERATIONS.md, "The container test")."""

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid

import pytest

import harness

ROOT = os.path.abspath(os.environ.get("ATTNSERVE_SOURCE_DIR")
                       or os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("ATTNSERVE_BUILD_DIR") or os.path.join(ROOT, "build")
BASE = "debian:bookworm"


def run(args, timeout=600, check=True, env=None, **kw):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if check and out.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


class Docker:
    """The docker CLI against one engine (DOCKER_HOST when we started it)."""

    def __init__(self, env):
        self.env = env

    def __call__(self, *args, timeout=600, check=True):
        return run(["docker", *args], timeout=timeout, check=check, env=self.env)


def _start_dockerd():
    """Starts a private dockerd (its own socket, data root under the build
    dir so images and layers stay cached between runs). Returns (env, proc)
    or skips with the reason."""
    if shutil.which("dockerd") is None:
        pytest.skip("no Docker engine runs and dockerd is not installed (scripts/install-deps.sh "
                    "installs docker.io)")
    run_dir = tempfile.mkdtemp(prefix="attnd-")  # short: unix socket paths are limited to 107 bytes
    data_root = os.path.join(BUILD, "docker-cache", "data")
    os.makedirs(data_root, exist_ok=True)
    sock = os.path.join(run_dir, "docker.sock")
    log = open(os.path.join(run_dir, "dockerd.log"), "w")
    proc = subprocess.Popen(["dockerd", "--data-root", data_root, "--exec-root", os.path.join(run_dir, "exec"),
                             "--pidfile", os.path.join(run_dir, "dockerd.pid"), "-H", f"unix://{sock}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    env = dict(os.environ, DOCKER_HOST=f"unix://{sock}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if subprocess.run(["docker", "info"], capture_output=True, env=env, timeout=30).returncode == 0:
            return env, proc
        time.sleep(0.5)
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)
    with open(os.path.join(run_dir, "dockerd.log")) as f:
        tail = f.read()[-2000:]
    pytest.skip(f"dockerd cannot run here (exit {proc.returncode}):\n{tail}")


@pytest.fixture(scope="module")
def docker():
    if shutil.which("docker") is None:
        pytest.skip("the docker CLI is not installed (scripts/install-deps.sh installs docker.io)")
    # The legacy builder: Debian's docker.io 20.10 has no buildx, and the
    # Dockerfile needs nothing BuildKit-only.
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    started = None
    if subprocess.run(["docker", "info"], capture_output=True, env=env, timeout=60).returncode != 0:
        env, started = _start_dockerd()
        env["DOCKER_BUILDKIT"] = "0"
    d = Docker(env)
    try:
        yield d
    finally:
        if started is not None:
            started.terminate()
            try:
                started.wait(60)
            except subprocess.TimeoutExpired:
                started.kill()


def _ensure_base(docker):
    if docker("image", "inspect", BASE, check=False).returncode == 0:
        return
    if shutil.which("debootstrap") is None:
        pytest.fail(f"{BASE} is absent and debootstrap is not installed (scripts/install-deps.sh)")
    with tempfile.TemporaryDirectory(prefix="bookworm-") as rootfs:
        run(["debootstrap", "--variant=minbase", "bookworm", rootfs], timeout=900)
        # As Debian's published image: no package lists or downloaded packages (80 MB).
        run(["sh", "-c", f"rm -rf {rootfs}/var/cache/apt/archives/*.deb {rootfs}/var/lib/apt/lists/*"])
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(["docker", "import", "-", BASE], stdin=tar.stdout, capture_output=True,
                             text=True, env=docker.env, timeout=600)
        tar.wait()
        assert imp.returncode == 0, imp.stderr


@pytest.fixture(scope="module")
def image(docker):
    """The image, built from the project's Dockerfile around this build's
    binaries (stripped), in a context of just what that needs."""
    _ensure_base(docker)
    revision = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory(prefix="attnserve-ctx-") as ctx:
        shutil.copy(os.path.join(ROOT, "Dockerfile"), ctx)
        shutil.copy(os.path.join(ROOT, ".dockerignore"), ctx)
        os.makedirs(os.path.join(ctx, "scripts"))
        shutil.copy(os.path.join(ROOT, "scripts", "install-deps.sh"), os.path.join(ctx, "scripts"))
        os.makedirs(os.path.join(ctx, "prebuilt"))
        for b in (harness.server_bin(), harness.client_bin()):
            run(["strip", "-o", os.path.join(ctx, "prebuilt", os.path.basename(b)), b])
        # HTTPS's compatibility libraries (server/transport/civetweb_tls.h).
        tls_libs = os.path.join(os.path.dirname(os.path.dirname(harness.server_bin())), "lib",
                                "civetweb-tls")
        os.makedirs(os.path.join(ctx, "prebuilt", "civetweb-tls"))
        for lib in ("libssl.so", "libcrypto.so"):
            shutil.copy(os.path.join(tls_libs, lib), os.path.join(ctx, "prebuilt", "civetweb-tls"))
        # One tag per checkout, so that concurrent checkouts do not overwrite each other.
        tag = f"attnserve-test:{uuid.uuid5(uuid.NAMESPACE_URL, os.path.abspath(ROOT)).hex[:12]}"
        docker("build", "-q", "-t", tag, "--build-arg", "PREBUILT=prebuilt", "--build-arg",
               f"REVISION={revision}", "--build-arg", f"SOURCE=file://{os.path.abspath(ROOT)}", ctx,
               timeout=900)
    info = json.loads(docker("image", "inspect", tag).stdout)[0]
    return {"tag": tag, "info": info, "revision": revision}
