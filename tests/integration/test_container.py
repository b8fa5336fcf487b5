"""The Docker image as a user runs it: built from the project's Dockerfile (with
the binaries this build just made, --build-arg PREBUILT), started with the
Kubernetes manifest's hardening (read-only root, no capabilities, no privilege
escalation, a CPU quota), used from the host through ports published on
127.0.0.1: non-root, HEALTHCHECK healthy, health/Attend//metrics, a model
exported from a real torch module mounted read-only and compared with torch,
an unreadable model folder, and `docker stop` with requests in flight.

Needs a Docker engine: uses the running one, else starts dockerd itself (data
root cached under the build dir), and makes the debian:bookworm base with
debootstrap when absent (no registry is needed). Skips only when no dockerd
can run here."""

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest

import harness
from attnserve_client import AttentionClient
from docker_util import docker, image  # noqa: F401 (fixtures)

from docker_util import ROOT

UID = 10001


def _project_version():
    import re
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(attnserve VERSION (\S+)", f.read()).group(1)



class Container:
    def __init__(self, docker, image, *args, volumes=(), name_hint="c", detach=True, health_interval="1s"):
        self.docker = docker
        self.name = f"attnserve-test-{name_hint}-{uuid.uuid4().hex[:8]}"
        cmd = ["run", "--name", self.name, "--read-only", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges", "--cpus", "1.5",
               "--health-interval", health_interval,
               "-p", "127.0.0.1::50051", "-p", "127.0.0.1::9464", "-p", "127.0.0.1::8000"]
        for v in volumes:
            cmd += ["-v", v]
        if detach:
            cmd.append("-d")
        self.out = docker(*cmd, image["tag"], *args, check=False, timeout=120)

    def port(self, inside):
        out = self.docker("port", self.name, f"{inside}/tcp").stdout.split()[0]
        host, port = out.rsplit(":", 1)
        assert host == "127.0.0.1", out
        return int(port)

    def state(self):
        return json.loads(self.docker("inspect", self.name).stdout)[0]["State"]

    def logs(self):
        out = self.docker("logs", self.name, check=False)
        return out.stdout + out.stderr

    def remove(self):
        self.docker("rm", "-f", self.name, check=False)


def _wait_healthy(c, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.state()
        health = st.get("Health", {}).get("Status")
        if health == "healthy":
            return st
        if not st["Running"]:
            pytest.fail(f"container exited {st['ExitCode']}:\n{c.logs()}")
        time.sleep(0.2)
    pytest.fail(f"not healthy within {timeout}s ({c.state().get('Health')}):\n{c.logs()}")


@pytest.fixture(scope="module")
def torch_repo():
    """A model repository exported from a real torch.nn.MultiheadAttention,
    readable by the container's uid (a+rX) but owned by whoever runs the test."""
    import torch
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import export_torch
    torch.manual_seed(5)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    repo = tempfile.mkdtemp(prefix="attnserve-repo-")
    export_torch.export_module(mha, os.path.join(repo, "torch-mha"))
    for dirpath, dirs, files in os.walk(repo):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    yield repo, mha
    shutil.rmtree(repo, ignore_errors=True)


def test_image_metadata(image):
    cfg = image["info"]["Config"]
    assert cfg["User"] == f"{UID}:{UID}"
    labels = cfg["Labels"]
    assert labels["org.opencontainers.image.version"] == _project_version()
    assert labels["org.opencontainers.image.revision"] == image["revision"]
    assert labels["org.opencontainers.image.source"] == f"file://{os.path.abspath(ROOT)}"
    assert cfg["Healthcheck"]["Test"][0] == "CMD"
    # The runtime stage carries no compiler, headers or test frameworks.
    size_mb = image["info"]["Size"] / 1e6
    assert size_mb < 400, f"image is {size_mb:.0f} MB"


def test_serves_from_the_host_as_non_root_and_matches_torch(docker, image, torch_repo):
    import torch
    repo, mha = torch_repo
    c = Container(docker, image, "--model-repository", "/models", volumes=[f"{repo}:/models:ro"],
                  name_hint="serve")
    try:
        assert c.out.returncode == 0, c.out.stderr
        _wait_healthy(c)
        # PID 1 is attnserve itself, as uid 10001.
        status = docker("exec", c.name, "cat", "/proc/1/status").stdout
        uids = [l.split()[1:] for l in status.splitlines() if l.startswith("Uid:")][0]
        assert uids == [str(UID)] * 4, status
        assert "attnserve" in docker("exec", c.name, "cat", "/proc/1/cmdline").stdout
        # --threads 0 follows --cpus 1.5 (rounded down).
        assert "engine threads 1 (CPU limit 1.50" in c.logs(), c.logs()

        target = f"127.0.0.1:{c.port(50051)}"
        with AttentionClient(target, timeout=60) as client:
            assert client.health() == "SERVING"
            assert "torch-mha" in [m.name for m in client.list_models()]
            x = np.random.default_rng(1).standard_normal((2, 9, 64)).astype(np.float32)
            got = client.attend(x, model="torch-mha").output
            with torch.no_grad():
                t = torch.from_numpy(x)
                want = mha(t, t, t, need_weights=False)[0].numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        with urllib.request.urlopen(f"http://127.0.0.1:{c.port(9464)}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'attnserve_requests_total{code="OK",model="torch-mha"} 1' in text, text[:2000]
    finally:
        c.remove()


@pytest.mark.parametrize("locked_dir, message", [
    ("", "--model-repository /models: cannot list: Permission denied"),
    ("private-model", "/models/private-model/config.pbtxt: cannot read: Permission denied"),
], ids=["repository", "model-folder"])
def test_unreadable_model_folder_names_the_path_and_the_uid(docker, image, torch_repo, locked_dir, message):
    """A folder made on the host with mode 0700 (owner only) and mounted: the
    server (uid 10001) exits 1 naming the path and its uid."""
    if os.getuid() == UID:
        pytest.skip(f"the test runs as uid {UID} itself")
    repo, _ = torch_repo
    host = tempfile.mkdtemp(prefix="attnserve-locked-")
    try:
        shutil.copytree(os.path.join(repo, "torch-mha"), os.path.join(host, "private-model"))
        os.chmod(host, 0o755)
        os.chmod(os.path.join(host, locked_dir), 0o700)
        c = Container(docker, image, "--model-repository", "/models", volumes=[f"{host}:/models:ro"],
                      name_hint="locked")
        try:
            assert c.out.returncode == 0, c.out.stderr
            deadline = time.monotonic() + 60
            while c.state()["Running"] and time.monotonic() < deadline:
                time.sleep(0.2)
            st = c.state()
            logs = c.logs()
            assert not st["Running"] and st["ExitCode"] == 1, (st, logs)
            assert message in logs, logs
            assert f"attnserve runs as uid {UID}, gid {UID}" in logs, logs
        finally:
            c.remove()
    finally:
        shutil.rmtree(host, ignore_errors=True)


def test_https_in_the_image(docker, image, tmp_path):
    """The image serves the KServe HTTP endpoint over HTTPS with the gRPC
    port's certificate: its OpenSSL 3 compatibility libraries for civetweb
    (server/transport/civetweb_tls.h) are installed beside the binary."""
    import subprocess
    import urllib.request
    import ssl
    certs = tmp_path / "certs"
    certs.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "server.key", "-out",
                    "server.pem", "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1"], cwd=certs, check=True, capture_output=True)
    for f in certs.iterdir():
        os.chmod(f, 0o644)
    os.chmod(certs, 0o755)
    c = Container(docker, image, "--tls-cert-file=/certs/server.pem",
                  "--tls-key-file=/certs/server.key", volumes=[f"{certs}:/certs:ro"],
                  name_hint="https")
    try:
        assert c.out.returncode == 0, c.out.stderr
        url = f"https://127.0.0.1:{c.port(8000)}/v2/health/ready"
        ctx = ssl.create_default_context(cafile=str(certs / "server.pem"))
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
                    assert r.status == 200
                    break
            except (OSError, ssl.SSLError):
                assert c.state()["Running"], c.logs()
                assert time.monotonic() < deadline, c.logs()
                time.sleep(0.3)
        assert "(HTTPS)" in c.logs()
    finally:
        c.remove()


def test_docker_stop_with_requests_in_flight(docker, image):
    """8 requests accepted (held in the queue by a long batching delay) when
    `docker stop` (default 10 s timeout) sends SIGTERM to PID 1: all 8 answer
    OK, the container exits 0, and the stop returns within 1 s of the last
    answer."""
    c = Container(docker, image, "--threads", "1", "--max-batch-requests", "64", "--max-batch-tokens", "0",
                  "--max-queue-delay-us", "60000000", name_hint="stop")
    try:
        assert c.out.returncode == 0, c.out.stderr
        _wait_healthy(c)
        target = f"127.0.0.1:{c.port(50051)}"
        metrics = f"http://127.0.0.1:{c.port(9464)}/metrics"
        rng = np.random.default_rng(8)
        with AttentionClient(target, timeout=120) as client:
            reqs = []
            for i in range(8):
                q, k, v = (rng.standard_normal((1, 4, 256, 32)).astype(np.float32) for _ in range(3))
                reqs.append((client.build_request(q, k, v, model="sdpa", request_id=f"r{i}"), q, k, v))
            answered = []
            futures = []
            for r, *_ in reqs:
                f = client.stub.Attend.future(r, timeout=120)
                f.add_done_callback(lambda f: answered.append(time.monotonic()))
                futures.append(f)
            deadline = time.monotonic() + 60
            while True:
                with urllib.request.urlopen(metrics, timeout=10) as r:
                    text = r.read().decode()
                if 'attnserve_inflight_requests{model="sdpa"} 8' in text:
                    break
                assert time.monotonic() < deadline, "8 requests never in flight"
                time.sleep(0.05)
            stop_done = []
            stopper = threading.Thread(target=lambda: (docker("stop", c.name, timeout=60),
                                                       stop_done.append(time.monotonic())))
            stopper.start()
            for (r, q, k, v), f in zip(reqs, futures):
                resp = f.result(timeout=60)
                assert resp.id == r.id
                got = np.frombuffer(resp.output.data, np.float32).reshape(q.shape)
                np.testing.assert_allclose(got, harness.reference_attention(q, k, v)[0], rtol=1e-4, atol=1e-5)
            stopper.join(60)
        assert stop_done, "docker stop did not return"
        st = c.state()
        assert st["ExitCode"] == 0, (st, c.logs())
        assert not st["OOMKilled"]
        lag = stop_done[0] - max(answered)
        assert lag <= 1.0, f"docker stop returned {lag:.2f}s after the last answer:\n{c.logs()}"
        assert "attnserve: stopped" in c.logs()
    finally:
        c.remove()
