"""The deployment files agree with the binary and with each other: the
Kubernetes and Docker arguments are flags attnserve accepts and starts with,
ports line up across Dockerfile, compose, Prometheus and Kubernetes, and
promtool accepts the Prometheus config."""

import os
import re
import subprocess

import pytest
import yaml

import harness

ROOT = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
ADDRESS_FLAGS = ("--address", "--metrics-address", "--http-address")


def _load_all(path):
    with open(os.path.join(ROOT, path)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _deployment_container():
    docs = _load_all("deploy/kubernetes/attnserve.yaml")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container, docs


def _without_addresses(args):
    """Drops the listen-address flags (tests listen on 127.0.0.1:0 only)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ADDRESS_FLAGS:
            skip = True
            continue
        if a.split("=", 1)[0] in ADDRESS_FLAGS:
            continue
        out.append(a)
    return out


def _dockerfile():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        return f.read()


def test_kubernetes_args_start_the_server_and_grace_fits_the_pod(tmp_path):
    deployment, container, _ = _deployment_container()
    args = container["args"]
    # The manifest's model volume, here an empty repository.
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    args = [str(tmp_path) if a in mounts else a for a in args]
    server = harness.ServerProcess(*_without_addresses(args))
    try:
        from attnserve_client import AttentionClient
        with AttentionClient(server.target) as c:
            assert c.health() == "SERVING"
    finally:
        assert server.stop() == 0
    joined = " ".join(args)
    grace = re.search(r"--shutdown-grace[ =](\d+)s", joined)
    assert grace, f"the manifest should set --shutdown-grace explicitly: {args}"
    pod_grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pod_grace > int(grace.group(1)), "Kubernetes would SIGKILL before the drain ends"


def test_ports_agree_everywhere():
    _, container, docs = _deployment_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9464, "http": 8000}
    args = " ".join(container["args"])
    assert "0.0.0.0:50051" in args and "0.0.0.0:9464" in args and "0.0.0.0:8000" in args
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "attnserve"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "metrics", "http"}
    annotations = _load_all("deploy/kubernetes/attnserve.yaml")[0]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9464"

    dockerfile = _dockerfile()
    assert re.search(r"^EXPOSE 50051 9464 8000$", dockerfile, re.M)
    assert "--address=0.0.0.0:50051" in dockerfile and "--metrics-address=0.0.0.0:9464" in dockerfile
    assert "--http-address=0.0.0.0:8000" in dockerfile

    (compose,) = _load_all("deploy/docker-compose.yml")
    # Loopback by default; the host port can move, the container port cannot.
    ports = compose["services"]["attnserve"]["ports"]
    assert [p.rsplit(":", 1)[1] for p in ports] == ["50051", "9464", "8000"]
    assert all(p.startswith("${ATTNSERVE_BIND:-127.0.0.1}:") for p in ports), ports
    (prom,) = _load_all("deploy/prometheus/prometheus.yml")
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["attnserve:9464"]


def test_dockerfile_entrypoint_flags_are_accepted():
    entry = re.search(r'^ENTRYPOINT \[(.*)\]$', _dockerfile(), re.M)
    assert entry
    argv = [a.strip().strip('"') for a in entry.group(1).split(",")]
    assert argv[0] == "/usr/local/bin/attnserve"
    assert _without_addresses(argv[1:]) == []  # only listen addresses: nothing else to check
    # The image runs as a numeric non-root user (Kubernetes' runAsNonRoot checks it).
    user = re.findall(r"^USER (\S+)$", _dockerfile(), re.M)
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"


def test_promtool_accepts_the_prometheus_config():
    out = subprocess.run(["promtool", "check", "config",
                          os.path.join(ROOT, "deploy/prometheus/prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
