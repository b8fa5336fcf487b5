"""deploy/kubernetes/attnserve.yaml is fit for a real cluster: parsed (PyYAML)
and checked for what an operator needs: a pinned image pulled only when absent,
gRPC startup/readiness/liveness probes, CPU and memory requests and limits
(the CPU limit is what --threads 0 follows), a hardened securityContext that
matches the image's user, models from a read-only volume, a stop budget that
covers preStop + --shutdown-grace, and a PodDisruptionBudget, an autoscaler on
queue depth (through deploy/kubernetes/prometheus-adapter.yaml's rule, on a
series a real server exports) and a headless Service that select the
Deployment's pods."""

import os
import re

import pytest
import yaml

import harness
import serving_util as su

ROOT = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
MANIFEST = os.path.join(ROOT, "deploy", "kubernetes", "attnserve.yaml")


@pytest.fixture(scope="module")
def docs():
    with open(MANIFEST) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"want one {kind} {name or ''}, got {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def deployment(docs):
    return _one(docs, "Deployment")


@pytest.fixture(scope="module")
def pod(deployment):
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod):
    (c,) = pod["containers"]
    return c


def _seconds(duration):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert m, f"unexpected duration {duration!r}"
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


def _cpus(quantity):
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_image_is_pinned_and_pulled_only_when_absent(container):
    image = container["image"]
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest" and "/" not in tag, f"pin a version tag: {image}"
    assert container["imagePullPolicy"] == "IfNotPresent"
    # The tag the docs build: the project's version (the image's version label).
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        version = re.search(r"project\(attnserve VERSION (\S+)", f.read()).group(1)
    assert tag == version, f"image tag {tag} != project version {version}"


def test_grpc_probes(container):
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    # Startup allows model loading before liveness may restart the pod.
    s = container["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] >= 30


def test_requests_and_limits_and_threads_follow_the_cpu_limit(container):
    res = container["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(res[kind]), f"{kind} needs cpu and memory: {res}"
    assert _cpus(res["limits"]["cpu"]) >= _cpus(res["requests"]["cpu"])
    # --threads 0 (the default) reads the CPU limit from the cgroup.
    assert (su.flag_value(container["args"], "--threads") or "0") == "0"
    assert _cpus(res["limits"]["cpu"]) >= 1, "below one CPU the engine still runs one thread"


def test_security_context(pod, container):
    psc, csc = pod["securityContext"], container["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"] and not csc["capabilities"].get("add")
    assert not csc.get("privileged")
    # The uid is the image's numeric USER (a mounted volume must be readable by it).
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        user = re.findall(r"^USER (\d+):(\d+)$", f.read(), re.M)[-1]
    assert (str(psc["runAsUser"]), str(psc["runAsGroup"])) == user
    assert pod.get("automountServiceAccountToken") is False


def test_models_come_from_a_read_only_volume(pod, container):
    repo = su.flag_value(container["args"], "--model-repository")
    assert repo, "the manifest should serve a model repository"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == repo]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert set(volume) - {"name"}, "the volume needs a source"


def test_stop_budget_covers_prestop_and_the_drain(pod, container):
    grace = _seconds(su.flag_value(container["args"], "--shutdown-grace"))
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] in ("/bin/sleep", "sleep")
    pre_stop = float(command[1])
    # The kubelet sends SIGKILL terminationGracePeriodSeconds after starting
    # preStop; the exit itself takes under a second after the drain
    # (tests/integration/test_shutdown.py).
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + grace + 1
    # The default grace also fits docker stop's 10 s.
    assert grace <= 9


def test_disruption_budget_autoscaler_and_services_select_the_pods(docs, deployment):
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "minAvailable" in pdb["spec"] or "maxUnavailable" in pdb["spec"]

    hpa = _one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert pdb["spec"].get("minAvailable", 0) < hpa["spec"]["minReplicas"], "the PDB would block every drain"

    services = [d for d in docs if d["kind"] == "Service"]
    headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
    assert len(headless) == 1, "a headless Service for client-side round_robin"
    for s in services:
        assert s["spec"]["selector"].items() <= labels.items()
        grpc_ports = [p for p in s["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc_ports and grpc_ports[0]["appProtocol"] == "grpc"


def test_rolling_update_keeps_capacity(deployment):
    ru = deployment["spec"]["strategy"]["rollingUpdate"]
    assert ru["maxUnavailable"] == 0 and ru["maxSurge"] >= 1


def test_autoscaler_scales_on_queue_depth_that_the_server_exports(docs):
    """The HPA's Pods metric is what the prometheus-adapter rule serves, and
    the rule's series is one a real server exports (with the model label the
    rule sums over), scraped from a running attnserve."""
    hpa = _one(docs, "HorizontalPodAutoscaler")
    pods = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods, "scale on queue depth, not CPU alone"
    metric = pods[0]["metric"]["name"]
    assert pods[0]["target"]["type"] == "AverageValue" and float(pods[0]["target"]["averageValue"]) > 0
    with open(os.path.join(ROOT, "deploy", "kubernetes", "prometheus-adapter.yaml")) as f:
        (adapter,) = [d for d in yaml.safe_load_all(f) if d]
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    (rule,) = [r for r in rules if r["name"]["as"] == metric]
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"
    assert "sum(<<.Series>>" in rule["metricsQuery"] and "by (<<.GroupBy>>)" in rule["metricsQuery"]
    server = harness.ServerProcess()
    try:
        samples = su.scrape(server)
    finally:
        assert server.stop() == 0
    exported = [labels for name, labels in samples if name == series]
    assert any(("model", "demo-mha") in labels for labels in exported), \
        f"{series} with a model label is not among the server's metrics"
    assert su.metric(samples, series, model="demo-mha") == 0  # idle: nothing queued
