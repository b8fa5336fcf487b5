"""deploy/kserve: the ServingRuntime and InferenceService that run attnserve
under KServe. No KServe schema is available offline (kubernetes-validate
bundles only Kubernetes' own kinds: tests/k8s), so this checks what KServe
relies on: the v2 protocols, one format the InferenceService names, the
ports and paths KServe routes and probes (REST 8080 with HTTP probes, gRPC
9000), the model repository at KServe's /mnt/models; and that the runtime's
own arguments start a real server whose HTTP probes answer 200."""

import os
import re
import urllib.request

import yaml

import harness
import serving_util as su

ROOT = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")


def _load(name):
    with open(os.path.join(ROOT, "deploy", "kserve", name)) as f:
        (doc,) = [d for d in yaml.safe_load_all(f) if d]
    return doc


def test_runtime_and_inference_service_agree():
    rt, isvc = _load("serving-runtime.yaml"), _load("inference-service.yaml")
    assert (rt["apiVersion"], rt["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert set(rt["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == rt["metadata"]["name"] and model["protocolVersion"] == "v2"
    formats = {f["name"] for f in rt["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    assert model["storageUri"].startswith(("pvc://", "s3://", "gs://"))
    (c,) = rt["spec"]["containers"]
    assert c["name"] == "kserve-container"  # the name KServe injects the storage into
    args = c["args"]
    assert su.flag_value(args, "--model-repository") == "/mnt/models"
    assert su.flag_value(args, "--http-address") == "0.0.0.0:8080"
    assert su.flag_value(args, "--address") == "0.0.0.0:9000"
    assert c["ports"][0]["containerPort"] == 8080
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    assert rt["spec"]["annotations"]["prometheus.kserve.io/port"] == \
        su.flag_value(args, "--metrics-address").rsplit(":", 1)[1]
    image = c["image"]
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        version = re.search(r"project\(attnserve VERSION (\S+)", f.read()).group(1)
    assert image == f"attnserve:{version}"


def test_runtime_arguments_start_a_server_whose_http_probes_answer(tmp_path):
    (c,) = _load("serving-runtime.yaml")["spec"]["containers"]
    args = [str(tmp_path) if a == "/mnt/models" else a for a in c["args"]]
    # Listen addresses on loopback with free ports (later flags win).
    server = harness.ServerProcess(*args, "--address", "127.0.0.1:0", "--http-address",
                                   "127.0.0.1:0", "--metrics-address", "127.0.0.1:0")
    try:
        for probe in ("readinessProbe", "livenessProbe"):
            path = c[probe]["httpGet"]["path"]
            with urllib.request.urlopen(f"http://{server.http_target}{path}", timeout=10) as r:
                assert r.status == 200, probe
    finally:
        assert server.stop() == 0, server.log()
