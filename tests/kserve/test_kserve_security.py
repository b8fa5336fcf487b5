"""Triton's own client (tritonclient[grpc]) against a server with TLS and
bearer tokens (issue 15): its ssl/root_certificates options and per-call
headers reach the KServe v2 front end, which answers UNAUTHENTICATED and
PERMISSION_DENIED as the attnserve.v1 front end does (tests/integration/
test_security.py has the full matrix with raw gRPC clients)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import harness  # noqa: E402

TOKEN_ALL = "triton-all-0123456789abcdef0123456789"
TOKEN_SDPA = "triton-sdpa-0123456789abcdef0123456789"


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=attnserve test ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _openssl("req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=d)
    with open(os.path.join(d, "server.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", "server.ext", "-out", "server.pem",
             cwd=d)
    with open(os.path.join(d, "tokens"), "w") as f:
        f.write(f"{TOKEN_ALL}\n{TOKEN_SDPA} sdpa\n")
    s = harness.ServerProcess("--tls-cert-file", os.path.join(d, "server.pem"),
                              "--tls-key-file", os.path.join(d, "server.key"),
                              "--auth-token-file", os.path.join(d, "tokens"),
                              "--backend=reference")
    s.ca = os.path.join(d, "ca.pem")
    yield s
    assert s.stop() == 0, s.log()


def _status(fn):
    try:
        fn()
        return "OK"
    except InferenceServerException as e:
        return e.status()


def test_tritonclient_tls_and_tokens(server):
    client = tc.InferenceServerClient(f"localhost:{server.port}", ssl=True,
                                      root_certificates=server.ca)
    auth = lambda token: {"authorization": f"Bearer {token}"}
    assert client.is_server_live() and client.is_server_ready()  # probes: no token
    assert _status(lambda: client.get_model_metadata("sdpa")) == "StatusCode.UNAUTHENTICATED"
    assert _status(lambda: client.get_model_metadata("demo-mha", headers=auth(TOKEN_SDPA))) == \
        "StatusCode.PERMISSION_DENIED"
    assert client.get_model_metadata("sdpa", headers=auth(TOKEN_SDPA)).name == "sdpa"
    index = client.get_model_repository_index(headers=auth(TOKEN_SDPA))
    assert [m.name for m in index.models] == ["sdpa"]

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 8)).astype(np.float32) for _ in range(3))
    inputs = []
    for name, array in (("query", q), ("key", k), ("value", v)):
        t = tc.InferInput(name, list(array.shape), "FP32")
        t.set_data_from_numpy(array)
        inputs.append(t)
    assert _status(lambda: client.infer("sdpa", inputs)) == "StatusCode.UNAUTHENTICATED"
    out = client.infer("sdpa", inputs, headers=auth(TOKEN_ALL)).as_numpy("output")
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(8)
    w = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(out, (w / w.sum(-1, keepdims=True)) @ v, rtol=1e-4, atol=1e-5)


def test_tritonclient_http_over_https_with_tokens(server):
    """With --tls-cert-file the KServe HTTP endpoint serves HTTPS with the same
    certificate (Debian's civetweb on OpenSSL 3: server/transport/civetweb_tls.h),
    and tritonclient.http with ssl=True and the CA reaches it, behind the
    same tokens; a client that does not trust the CA does not."""
    import tritonclient.http as th
    assert server.http_target is not None and "(HTTPS)" in server.log()
    port = server.http_target.rsplit(":", 1)[1]
    auth = {"Authorization": f"Bearer {TOKEN_ALL}"}
    c = th.InferenceServerClient(f"localhost:{port}", ssl=True,
                                 ssl_options={"ca_certs": server.ca})
    assert c.is_server_live() and c.is_server_ready()  # probes: no token
    with pytest.raises(InferenceServerException) as e:
        c.get_model_metadata("sdpa")
    assert e.value.status() == "401"
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 3, 8)).astype(np.float32) for _ in range(3))
    inputs = []
    for name, array in (("query", q), ("key", k), ("value", v)):
        t = th.InferInput(name, list(array.shape), "FP32")
        t.set_data_from_numpy(array, binary_data=True)
        inputs.append(t)
    out = c.infer("sdpa", inputs, headers=auth).as_numpy("output")
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(8)
    w = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(out, (w / w.sum(-1, keepdims=True)) @ v, rtol=1e-4, atol=1e-5)
    c.close()
    # Without the CA the certificate is not trusted: no answer.
    untrusting = th.InferenceServerClient(f"localhost:{port}", ssl=True)
    with pytest.raises(Exception):
        untrusting.is_server_live()


def test_tritonclient_http_with_tokens():
    """The HTTP endpoint behind the same bearer tokens: 401 without a token,
    403 for a model the token does not allow, health open to probes."""
    import tempfile
    import tritonclient.http as th
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "tokens"), "w") as f:
            f.write(f"{TOKEN_ALL}\n{TOKEN_SDPA} sdpa\n")
        s = harness.ServerProcess("--auth-token-file", os.path.join(d, "tokens"))
    try:
        q = np.random.default_rng(0).standard_normal((1, 2, 3, 4), dtype=np.float32)
        inputs = []
        for name in ("query", "key", "value"):
            t = th.InferInput(name, list(q.shape), "FP32")
            t.set_data_from_numpy(q)
            inputs.append(t)
        c = th.InferenceServerClient(s.http_target)
        assert c.is_server_live() and c.is_server_ready()  # no token: probes
        with pytest.raises(InferenceServerException) as e:
            c.infer("sdpa", inputs)
        assert e.value.status() == "401"
        r = c.infer("sdpa", inputs, headers={"Authorization": f"Bearer {TOKEN_SDPA}"})
        assert r.as_numpy("output").shape == (1, 2, 3, 4)
        with pytest.raises(InferenceServerException) as e:
            c.get_model_metadata("demo-mha", headers={"Authorization": f"Bearer {TOKEN_SDPA}"})
        assert e.value.status() == "403"
        assert c.get_model_metadata("demo-mha", headers={"Authorization": f"Bearer {TOKEN_ALL}"})
        c.close()
    finally:
        assert s.stop() == 0, s.log()
