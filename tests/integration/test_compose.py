"""deploy/docker-compose.yml run as a user would on a host without registry
access: attnserve and Prometheus (the Debian-package stand-in of
deploy/docker-compose.offline.yml) come up healthy on loopback ports, and
Prometheus scrapes attnserve through the compose network and loads the alert
rules. Grafana is left out (it is not packaged in Debian, so there is no image
to run; test_dashboard.py checks the dashboard). The Docker engine and the
attnserve image are test_container's (docker_util): a clean machine starts
dockerd instead of skipping."""

import json
import os
import shutil
import time
import urllib.parse
import urllib.request

import pytest

import docker_util as du
import serving_util as su
from docker_util import docker, image  # noqa: F401 (fixtures)
from prometheus_util import free_port

COMPOSE = os.path.join(du.ROOT, "deploy", "docker-compose.yml")
OFFLINE = os.path.join(du.ROOT, "deploy", "docker-compose.offline.yml")


def _http_json(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except OSError:
        return None


def _health(docker, compose, service):
    cid = compose("ps", "-q", service).stdout.strip()
    if not cid:
        return None
    out = docker("inspect", "--format", "{{.State.Health.Status}}", cid, check=False)
    return out.stdout.strip()


def test_compose_brings_up_attnserve_and_prometheus_scraping_it(docker, image):
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (Debian package docker-compose; scripts/install-deps.sh)")
    env = dict(docker.env,
               ATTNSERVE_IMAGE=image["tag"],
               ATTNSERVE_GRPC_PORT=str(free_port()),
               ATTNSERVE_METRICS_PORT=str(free_port()),
               PROMETHEUS_PORT=str(free_port()))
    project = f"attnserve-test-{os.getpid()}"

    def compose(*args, timeout=600, check=True):
        return du.run(["docker-compose", "-p", project, "-f", COMPOSE, "-f", OFFLINE, *args],
                       timeout=timeout, check=check, env=env)

    try:
        compose("build", "prometheus", timeout=900)
        compose("up", "-d", "attnserve", "prometheus", timeout=300)
        start = time.monotonic()
        su.wait_for(lambda: _health(docker, compose, "attnserve") == "healthy" and
                    _health(docker, compose, "prometheus") == "healthy", 120, "both services to be healthy",
                    interval=1)
        print(f"healthy after {time.monotonic() - start:.1f} s")

        # Published on loopback only, at the ports asked for.
        for service, port in (("attnserve", 50051), ("attnserve", 9464), ("prometheus", 9090)):
            mapped = compose("port", service, str(port)).stdout.strip()
            assert mapped.startswith("127.0.0.1:"), (service, port, mapped)
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{env['ATTNSERVE_METRICS_PORT']}/metrics", timeout=10).read().decode()
        assert "attnserve_requests_total" in metrics

        prom = f"http://127.0.0.1:{env['PROMETHEUS_PORT']}/api/v1"

        def attnserve_target_up():
            body = _http_json(f"{prom}/targets")
            targets = body["data"]["activeTargets"] if body else []
            return [t for t in targets if t["labels"]["job"] == "attnserve" and t["health"] == "up"]

        (target,) = su.wait_for(attnserve_target_up, 60, "Prometheus to scrape attnserve", interval=1)
        assert target["scrapeUrl"] == "http://attnserve:9464/metrics" and target["lastError"] == ""
        q = _http_json(f"{prom}/query?" + urllib.parse.urlencode(
            {"query": 'attnserve_model_ready{model="demo-mha"}'}))
        assert [r["value"][1] for r in q["data"]["result"]] == ["1"], q

        groups = _http_json(f"{prom}/rules")["data"]["groups"]
        rules = {r["name"] for g in groups for r in g["rules"]}
        assert {"AttnserveTargetDown", "AttnserveHighErrorRatio", "AttnserveHighP99Latency",
                "AttnserveQueueSaturated"} <= rules
    finally:
        logs = compose("logs", "--no-color", "--tail=50", check=False, timeout=120)
        down = compose("down", "-v", "--timeout", "20", check=False, timeout=300)
        if down.returncode != 0:
            print(logs.stdout, logs.stderr)
        assert down.returncode == 0, down.stdout + down.stderr
