"""Security of the real server (issue 15), with raw Python gRPC clients:
the credentials matrix (server TLS, mutual TLS, bearer tokens) with each
case's exact status code, certificates made by `openssl` here; rotation of
the server certificate without a restart; and requests larger than every
limit refused without the server's memory growing by their declared size.

Transport failures (handshake refused either way) reach a gRPC client as
UNAVAILABLE: that is the exact code gRPC gives for them."""

import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

import harness
import serving_util as su

ATTEND = "/attnserve.v1.AttentionService/Attend"
ATTEND_STREAM = "/attnserve.v1.AttentionService/AttendStream"
LIST_MODELS = "/attnserve.v1.AttentionService/ListModels"
GET_MODEL = "/attnserve.v1.AttentionService/GetModel"
HEALTH = "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}

TOKEN_ALL = "tok-all-0123456789abcdef0123456789abcdef"
TOKEN_SDPA = "tok-sdpa-0123456789abcdef0123456789abcdef"
TOKEN_WRONG = "tok-all-0123456789abcdef0123456789abcdeX"  # one character off


def _identity(x):
    return x


# ------------------------------------------------------------ protobuf stubs

@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    """attention_pb2, compiled here from proto/ (no dependency on the Python
    client package)."""
    from grpc_tools import protoc
    import grpc_tools
    out = str(tmp_path_factory.mktemp("pb"))
    root = os.path.join(os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", ".."), "proto")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{root}", f"-I{well_known}", f"--python_out={out}",
            "attnserve/v1/model_config.proto", "attnserve/v1/attention.proto"]
    assert protoc.main(args) == 0, args
    sys.path.insert(0, out)
    from attnserve.v1 import attention_pb2
    yield attention_pb2
    sys.path.remove(out)


def _tensor(pb, array):
    return pb.Tensor(dtype=pb.FLOAT32, shape=list(array.shape),
                     data=np.ascontiguousarray(array, dtype=np.float32).tobytes())


def _request(pb, model="sdpa", ident="r", shape=(1, 2, 4, 8), kv_len=None, **fields):
    rng = np.random.default_rng(0)
    b, h, lq, d = shape
    lk = kv_len or lq
    q = rng.standard_normal((b, h, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, h, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, h, lk, d)).astype(np.float32)
    return pb.AttendRequest(model=model, id=ident, query=_tensor(pb, q), key=_tensor(pb, k),
                            value=_tensor(pb, v), **fields)


def _code(fn):
    """The status code of a call (OK when it returns)."""
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _meta(token):
    return None if token is None else [("authorization", f"Bearer {token}")]


def _attend(channel, pb, token=None, model="sdpa", timeout=15):
    call = channel.unary_unary(ATTEND, request_serializer=_identity,
                               response_deserializer=pb.AttendResponse.FromString)
    return call(_request(pb, model=model).SerializeToString(), metadata=_meta(token),
                timeout=timeout)


def _health(channel, timeout=15):
    call = channel.unary_unary(HEALTH, request_serializer=_identity,
                               response_deserializer=_identity)
    return call(b"", timeout=timeout)


# -------------------------------------------------------------- certificates

def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)


class Pki:
    """Certificates made with the openssl command line (EC P-256, one day)."""

    def __init__(self, directory):
        self.dir = directory

    def path(self, name):
        return os.path.join(self.dir, name)

    def read(self, name):
        with open(self.path(name), "rb") as f:
            return f.read()

    def ca(self, name):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
                 "-subj", f"/CN=attnserve test {name}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=self.dir)

    def leaf(self, name, ca, server):
        """name.pem / name.key signed by `ca`; a server certificate names
        localhost and 127.0.0.1."""
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=attnserve test {name}", cwd=self.dir)
        ext = self.path(f"{name}.ext")
        with open(ext, "w") as f:
            f.write("basicConstraints=CA:FALSE\n")
            if server:
                f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                        "extendedKeyUsage=serverAuth\n")
            else:
                f.write("extendedKeyUsage=clientAuth\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-days", "1", "-extfile", ext, "-out", f"{name}.pem",
                 cwd=self.dir)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed (scripts/install-deps.sh installs it)")
    p = Pki(str(tmp_path_factory.mktemp("pki")))
    for ca in ("ca_a", "ca_b", "ca_c"):
        p.ca(ca)
    p.leaf("server_a", "ca_a", server=True)
    p.leaf("server_c", "ca_c", server=True)
    p.leaf("client_a", "ca_a", server=False)
    p.leaf("client_b", "ca_b", server=False)
    # The files the server watches: copies, so that rotation can replace them.
    shutil.copyfile(p.path("server_a.pem"), p.path("live.pem"))
    shutil.copyfile(p.path("server_a.key"), p.path("live.key"))
    with open(p.path("metrics_users"), "w") as f:
        f.write("# scrapers\nprometheus:s3cret:with-colon\n")
    with open(p.path("tokens"), "w") as f:
        f.write("# test tokens\n\n"
                f"{TOKEN_ALL}\n"
                f"{TOKEN_SDPA}   sdpa\n")
    return p


def _tls_channel(pki, port, ca, client=None, **options):
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.read(f"{ca}.pem"),
        private_key=pki.read(f"{client}.key") if client else None,
        certificate_chain=pki.read(f"{client}.pem") if client else None)
    # A distinct option per channel: Python grpc shares connections between
    # channels with the same target, credentials and options.
    opts = [("attnserve.test.channel", options.get("tag", 0))]
    return grpc.secure_channel(f"127.0.0.1:{port}", creds, options=opts)


# --------------------------------------------------- TLS + tokens (server 1)

@pytest.fixture(scope="module")
def tls_server(pki):
    server = harness.ServerProcess(
        "--tls-cert-file", pki.path("server_a.pem"), "--tls-key-file", pki.path("server_a.key"),
        "--auth-token-file", pki.path("tokens"), "--reflection=false", "--backend=reference")
    yield server
    assert server.stop() == 0, server.log()


def test_server_tls_right_ca_wrong_ca_plaintext(tls_server, pki, pb):
    with _tls_channel(pki, tls_server.port, "ca_a") as ch:
        assert _code(lambda: _attend(ch, pb, TOKEN_ALL)) == grpc.StatusCode.OK
    with _tls_channel(pki, tls_server.port, "ca_b") as ch:  # does not trust the server
        assert _code(lambda: _attend(ch, pb, TOKEN_ALL)) == grpc.StatusCode.UNAVAILABLE
        assert _code(lambda: _health(ch)) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(tls_server.target) as ch:  # plaintext to a TLS port
        assert _code(lambda: _attend(ch, pb, TOKEN_ALL)) == grpc.StatusCode.UNAVAILABLE


def test_tokens_none_wrong_restricted_right(tls_server, pki, pb):
    with _tls_channel(pki, tls_server.port, "ca_a") as ch:
        cases = [  # (token, model, expected code)
            (None, "sdpa", grpc.StatusCode.UNAUTHENTICATED),
            (TOKEN_WRONG, "sdpa", grpc.StatusCode.UNAUTHENTICATED),
            (TOKEN_ALL[:20], "sdpa", grpc.StatusCode.UNAUTHENTICATED),  # a prefix
            (TOKEN_SDPA, "sdpa", grpc.StatusCode.OK),
            (TOKEN_SDPA, "demo-mha", grpc.StatusCode.PERMISSION_DENIED),
            (TOKEN_SDPA, "", grpc.StatusCode.PERMISSION_DENIED),  # the default, demo-mha
            (TOKEN_SDPA, "no-such-model", grpc.StatusCode.PERMISSION_DENIED),  # no probing
            (TOKEN_ALL, "sdpa", grpc.StatusCode.OK),
            (TOKEN_ALL, "no-such-model", grpc.StatusCode.NOT_FOUND),
        ]
        got = [(t, m, _code(lambda: _attend(ch, pb, t, model=m))) for t, m, _ in cases]
        assert got == cases
        # A header that is not "Bearer <token>".
        call = ch.unary_unary(ATTEND, request_serializer=_identity, response_deserializer=_identity)
        for value in (TOKEN_ALL, f"Basic {TOKEN_ALL}", f"Bearer{TOKEN_ALL}"):
            assert _code(lambda: call(_request(pb).SerializeToString(), timeout=15,
                                      metadata=[("authorization", value)])) == \
                grpc.StatusCode.UNAUTHENTICATED
        # The scheme is case-insensitive.
        assert _code(lambda: call(_request(pb).SerializeToString(), timeout=15,
                                  metadata=[("authorization", f"bearer {TOKEN_ALL}")])) == \
            grpc.StatusCode.OK


def _https(server, pki, path, ca, client=None, token=None, body=None, timeout=10):
    """(status, body) of one HTTPS request to the KServe HTTP endpoint, or
    ("no TLS", reason) when no TLS session could be used."""
    ctx = ssl.create_default_context(cafile=pki.path(f"{ca}.pem"))
    if client:
        ctx.load_cert_chain(pki.path(f"{client}.pem"), pki.path(f"{client}.key"))
    req = urllib.request.Request(f"https://{server.http_target}{path}", data=body)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ssl.SSLError, ConnectionError) as e:
        return "no TLS", str(e)


def _sdpa_json():
    a = [[[[1.0, 0.0], [0.0, 1.0]]]]
    return json.dumps({"inputs": [{"name": n, "shape": [1, 1, 2, 2], "datatype": "FP32",
                                   "data": a} for n in ("query", "key", "value")]}).encode()


def test_https_with_the_grpc_certificate_and_the_same_tokens(tls_server, pki):
    """The KServe HTTP endpoint serves HTTPS with --tls-cert-file/--tls-key-file
    (Debian's civetweb on OpenSSL 3: server/transport/civetweb_tls.h), behind the
    same bearer tokens as the gRPC port."""
    assert "(HTTPS)" in tls_server.log()
    assert _https(tls_server, pki, "/v2/health/ready", "ca_a")[0] == 200  # probes: no token
    assert _https(tls_server, pki, "/v2", "ca_a")[0] == 401
    code, body = _https(tls_server, pki, "/v2", "ca_a", token=TOKEN_ALL)
    assert code == 200 and json.loads(body)["name"] == "attnserve"
    code, body = _https(tls_server, pki, "/v2/models/sdpa/infer", "ca_a", token=TOKEN_SDPA,
                        body=_sdpa_json())
    assert code == 200, body
    out = np.array(json.loads(body)["outputs"][0]["data"], np.float64).reshape(2, 2)
    p = np.exp(np.eye(2) / np.sqrt(2))
    np.testing.assert_allclose(out, (p / p.sum(-1, keepdims=True)) @ np.eye(2), rtol=1e-6)
    code, body = _https(tls_server, pki, "/v2/models/demo-mha/infer", "ca_a", token=TOKEN_SDPA,
                        body=_sdpa_json())
    assert code == 403 and b"not allow model 'demo-mha'" in body
    # A client that does not trust the server's CA gets no TLS session.
    assert _https(tls_server, pki, "/v2/health/ready", "ca_b")[0] == "no TLS"
    # Nor does plain HTTP reach the endpoint.
    try:
        with urllib.request.urlopen(f"http://{tls_server.http_target}/v2/health/ready",
                                    timeout=10) as r:
            plain = r.status
    except (urllib.error.URLError, ConnectionError) as e:
        plain = type(e).__name__
    assert plain != 200


def test_health_open_models_filtered_reflection_off(tls_server, pki, pb):
    with _tls_channel(pki, tls_server.port, "ca_a") as ch:
        assert _health(ch) == SERVING  # no token: probes need it
        list_models = ch.unary_unary(LIST_MODELS, request_serializer=_identity,
                                     response_deserializer=pb.ListModelsResponse.FromString)
        get_model = ch.unary_unary(GET_MODEL, request_serializer=_identity,
                                   response_deserializer=pb.ModelStatus.FromString)
        assert _code(lambda: list_models(b"", timeout=15)) == grpc.StatusCode.UNAUTHENTICATED
        all_names = {m.name for m in list_models(b"", timeout=15, metadata=_meta(TOKEN_ALL)).models}
        assert {"sdpa", "demo-mha"} <= all_names
        names = [m.name for m in list_models(b"", timeout=15, metadata=_meta(TOKEN_SDPA)).models]
        assert names == ["sdpa"]

        def get(name, token):
            return get_model(pb.GetModelRequest(name=name).SerializeToString(), timeout=15,
                             metadata=_meta(token))
        assert get("sdpa", TOKEN_SDPA).name == "sdpa"
        assert _code(lambda: get("demo-mha", TOKEN_SDPA)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: get("nope", TOKEN_SDPA)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: get("nope", TOKEN_ALL)) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: get("sdpa", None)) == grpc.StatusCode.UNAUTHENTICATED
        reflection = ch.stream_stream(REFLECTION, request_serializer=_identity,
                                      response_deserializer=_identity)
        assert _code(lambda: list(reflection(iter([b"\x3a\x00"]), timeout=15))) == \
            grpc.StatusCode.UNIMPLEMENTED


def test_stream_checks_token_per_call_and_model_per_message(tls_server, pki, pb):
    with _tls_channel(pki, tls_server.port, "ca_a") as ch:
        stream = ch.stream_stream(ATTEND_STREAM, request_serializer=_identity,
                                  response_deserializer=pb.AttendStreamResponse.FromString)
        msgs = [_request(pb, model=m, ident=m).SerializeToString()
                for m in ("sdpa", "demo-mha", "sdpa")]
        call = stream(iter(msgs), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = stream(iter(msgs), timeout=30, metadata=_meta(TOKEN_SDPA))
        answers = {a.id: a.code for a in call}
        assert call.code() == grpc.StatusCode.OK
        assert answers == {"sdpa": 0, "demo-mha": grpc.StatusCode.PERMISSION_DENIED.value[0]}


def test_token_never_in_log_or_metrics(tls_server, pki, pb):
    with _tls_channel(pki, tls_server.port, "ca_a") as ch:
        for t in (TOKEN_WRONG, TOKEN_SDPA):
            _code(lambda: _attend(ch, pb, t, model="demo-mha"))
    with urllib.request.urlopen(
            f"http://127.0.0.1:{su.metrics_port(tls_server)}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'code="UNAUTHENTICATED"' in text and 'code="PERMISSION_DENIED"' in text
    for secret in (TOKEN_ALL, TOKEN_SDPA, TOKEN_WRONG, "tok-"):
        assert secret not in text
        assert secret not in tls_server.log()


# ---------------------------------------------- mutual TLS, rotation (server 2)

@pytest.fixture(scope="module")
def mtls_server(pki):
    server = harness.ServerProcess(
        "--tls-cert-file", pki.path("live.pem"), "--tls-key-file", pki.path("live.key"),
        "--tls-client-ca-file", pki.path("ca_a.pem"), "--tls-reload-interval=1s",
        "--metrics-auth-file", pki.path("metrics_users"), "--backend=reference")
    yield server
    assert server.stop() == 0, server.log()


def test_mtls_no_cert_other_ca_right_cert(mtls_server, pki, pb):
    with _tls_channel(pki, mtls_server.port, "ca_a", tag=1) as ch:  # no client certificate
        assert _code(lambda: _attend(ch, pb)) == grpc.StatusCode.UNAVAILABLE
    with _tls_channel(pki, mtls_server.port, "ca_a", "client_b", tag=2) as ch:  # other CA
        assert _code(lambda: _attend(ch, pb)) == grpc.StatusCode.UNAVAILABLE
    with _tls_channel(pki, mtls_server.port, "ca_a", "client_a", tag=3) as ch:
        assert _code(lambda: _attend(ch, pb)) == grpc.StatusCode.OK
        assert _health(ch) == SERVING


def test_https_mutual_tls(mtls_server, pki):
    assert _https(mtls_server, pki, "/v2/health/ready", "ca_a")[0] == "no TLS"  # no certificate
    assert _https(mtls_server, pki, "/v2/health/ready", "ca_a", "client_b")[0] == "no TLS"
    assert _https(mtls_server, pki, "/v2/health/ready", "ca_a", "client_a")[0] == 200


def test_metrics_basic_auth(mtls_server):
    import base64
    import urllib.error
    url = f"http://127.0.0.1:{su.metrics_port(mtls_server)}/metrics"

    def status(user_password):
        req = urllib.request.Request(url)
        if user_password is not None:
            req.add_header("Authorization",
                           "Basic " + base64.b64encode(user_password.encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""
    assert status(None)[0] == 401
    assert status("prometheus:wrong")[0] == 401
    assert status("prometheus:s3cret")[0] == 401  # the password runs to the end of the line
    code, text = status("prometheus:s3cret:with-colon")
    assert code == 200 and "attnserve_build_info" in text
    assert "s3cret" not in mtls_server.log()


def test_certificate_rotation_without_restart(mtls_server, pki, pb):
    pid = mtls_server.proc.pid
    old = _tls_channel(pki, mtls_server.port, "ca_a", "client_a", tag=10)
    try:
        assert _code(lambda: _attend(old, pb)) == grpc.StatusCode.OK  # connection open
        # Replace certificate and key atomically (rename), as a secret
        # update does: the new certificate is signed by another CA, C.
        for ext in ("pem", "key"):
            tmp = pki.path(f"live.{ext}.new")
            shutil.copyfile(pki.path(f"server_c.{ext}"), tmp)
            os.replace(tmp, pki.path(f"live.{ext}"))
        deadline = time.monotonic() + 20
        tag = 100
        while True:  # a new connection trusting only C succeeds once reloaded
            tag += 1
            with _tls_channel(pki, mtls_server.port, "ca_c", "client_a", tag=tag) as ch:
                code = _code(lambda: _attend(ch, pb, timeout=5))
            if code == grpc.StatusCode.OK:
                break
            assert code == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() < deadline, "the rotated certificate was never served"
            time.sleep(0.2)
        # New connections trusting only A now fail: the old certificate is gone...
        with _tls_channel(pki, mtls_server.port, "ca_a", "client_a", tag=tag + 1) as ch:
            assert _code(lambda: _attend(ch, pb, timeout=5)) == grpc.StatusCode.UNAVAILABLE
        # ...on the HTTPS endpoint too, which re-reads the files on the same
        # interval (at a handshake).
        while _https(mtls_server, pki, "/v2/health/ready", "ca_c", "client_a")[0] != 200:
            assert time.monotonic() < deadline + 10, "HTTPS never served the rotated certificate"
            time.sleep(0.2)
        assert _https(mtls_server, pki, "/v2/health/ready", "ca_a", "client_a")[0] == "no TLS"
        # ...while the connection made before the rotation keeps working.
        for _ in range(3):
            assert _code(lambda: _attend(old, pb)) == grpc.StatusCode.OK
        assert mtls_server.proc.pid == pid and mtls_server.alive()
    finally:
        old.close()


# ---------------------------------------------------------- limits (server 3)

QUEUE_BYTES = 1_500_000


@pytest.fixture(scope="module")
def limits_server():
    server = harness.ServerProcess(
        "--max-queue-bytes", str(QUEUE_BYTES), "--max-queue-delay-us=3000000",
        "--max-message-bytes=4194304", "--backend=reference")
    yield server
    assert server.stop() == 0, server.log()


def _status_bytes(pid, field):
    """A /proc/PID/status memory line (VmRSS: resident now; VmHWM: its peak)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def _peak_rss_bytes(pid):
    return _status_bytes(pid, "VmHWM")


def test_requests_over_every_limit_do_not_grow_memory(limits_server, pb):
    pid = limits_server.proc.pid
    with grpc.insecure_channel(limits_server.target,
                               options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = ch.unary_unary(ATTEND, request_serializer=_identity, response_deserializer=_identity)
        assert _code(lambda: _attend(ch, pb)) == grpc.StatusCode.OK  # warm up
        before = _peak_rss_bytes(pid)
        rss_before = _status_bytes(pid, "VmRSS")
        declared = 0
        # 1. One tensor of 2^32 elements (16 GiB), in a few bytes.
        huge = pb.Tensor(dtype=pb.FLOAT32, shape=[1, 1, 1 << 16, 1 << 16], data=b"\0" * 16)
        big = pb.AttendRequest(model="sdpa", query=huge, key=huge, value=huge)
        declared += 4 << 32
        # 2. Weights of 2^28 elements (1 GiB) from 1.5 MiB of inputs.
        weights = _request(pb, shape=(1, 1, 1 << 14, 8), need_weights=True)
        declared += 4 << 28
        results = []
        for _ in range(3):
            for req in (big, weights):
                try:
                    call(req.SerializeToString(), timeout=30)
                    results.append(("OK", ""))
                except grpc.RpcError as e:
                    results.append((e.code().name, e.details()))
        assert all(code == "RESOURCE_EXHAUSTED" for code, _ in results), results
        assert "--max-tensor-elements" in results[0][1]
        assert "--max-returned-weights" in results[1][1]
        # 3. A message over --max-message-bytes (4 MiB) is refused by gRPC.
        oversized = _request(pb, shape=(1, 1, 1 << 15, 16)).SerializeToString()  # 6 MiB
        assert len(oversized) > 4 << 20
        assert _code(lambda: call(oversized, timeout=30)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        growth = _peak_rss_bytes(pid) - before
        rss_growth = _status_bytes(pid, "VmRSS") - rss_before
        assert growth < 64 << 20, (growth, declared)
        assert rss_growth < 64 << 20, (rss_growth, declared)
        assert _code(lambda: _attend(ch, pb)) == grpc.StatusCode.OK


def test_queue_bytes_refuses_at_once_and_serves_the_queued(limits_server, pb):
    # One request of ~1 MiB (inputs 768 KiB, output 256 KiB) waits in the
    # queue (max-queue-delay 3 s, a lone request); a second would take the
    # queue past 1.5 MB and is refused at once; the first is then served.
    req = _request(pb, shape=(1, 2, 512, 64)).SerializeToString()
    with grpc.insecure_channel(limits_server.target) as ch:
        call = ch.unary_unary(ATTEND, request_serializer=_identity, response_deserializer=_identity)
        first = call.future(req, timeout=30)
        samples_model = lambda: su.metric(su.scrape(limits_server), "attnserve_queue_depth",
                                          model="sdpa")
        su.wait_for(lambda: samples_model() == 1, 10, "the first request to be queued")
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queue-bytes" in e.value.details()
        assert time.monotonic() - start < 1.5
        assert first.result() is not None  # the queued request is served


# ------------------------------------- the same tokens on every front end

KSERVE = "/inference.GRPCInferenceService/"
OPEN_SESSION = "/attnserve.v1.AttentionService/OpenSession"
CLOSE_SESSION = "/attnserve.v1.AttentionService/CloseSession"


@pytest.fixture(scope="module")
def kpb(tmp_path_factory):
    """grpc_service_pb2 (KServe v2), compiled here from proto/inference."""
    from grpc_tools import protoc
    out = str(tmp_path_factory.mktemp("kpb"))
    root = os.path.join(os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", ".."), "proto")
    assert protoc.main(["protoc", f"-I{root}", f"--python_out={out}",
                        "inference/grpc_service.proto"]) == 0
    sys.path.insert(0, out)
    from inference import grpc_service_pb2
    yield grpc_service_pb2
    sys.path.remove(out)


def _kserve(channel, kpb, method, request, response_type, token=None):
    call = channel.unary_unary(KSERVE + method, request_serializer=_identity,
                               response_deserializer=response_type.FromString)
    return call(request.SerializeToString(), metadata=_meta(token), timeout=15)


def _infer_request(kpb, model):
    rng = np.random.default_rng(1)
    req = kpb.ModelInferRequest(model_name=model, id="k")
    for name in ("query", "key", "value"):
        t = req.inputs.add(name=name, datatype="FP32", shape=[1, 2, 4, 8])
        req.raw_input_contents.append(rng.standard_normal((1, 2, 4, 8)).astype("<f4").tobytes())
        del t
    return req


def test_kserve_front_end_enforces_the_same_tokens(tls_server, pki, kpb):
    """KServe v2 on the same port: health open, everything else behind the
    tokens, restricted tokens see and use only their models."""
    U, P, OK = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.OK)
    with _tls_channel(pki, tls_server.port, "ca_a", tag=7) as ch:
        live = _kserve(ch, kpb, "ServerLive", kpb.ServerLiveRequest(), kpb.ServerLiveResponse)
        ready = _kserve(ch, kpb, "ServerReady", kpb.ServerReadyRequest(), kpb.ServerReadyResponse)
        assert live.live and ready.ready  # no token: probes need them

        def infer(model, token):
            return _code(lambda: _kserve(ch, kpb, "ModelInfer", _infer_request(kpb, model),
                                         kpb.ModelInferResponse, token))
        assert [infer("sdpa", None), infer("sdpa", TOKEN_WRONG), infer("sdpa", TOKEN_SDPA),
                infer("demo-mha", TOKEN_SDPA), infer("sdpa", TOKEN_ALL)] == [U, U, OK, P, OK]

        def meta(model, token):
            return _code(lambda: _kserve(ch, kpb, "ModelMetadata",
                                         kpb.ModelMetadataRequest(name=model),
                                         kpb.ModelMetadataResponse, token))
        assert [meta("sdpa", None), meta("sdpa", TOKEN_SDPA), meta("demo-mha", TOKEN_SDPA),
                meta("nope", TOKEN_SDPA), meta("nope", TOKEN_ALL)] == \
            [U, OK, P, P, grpc.StatusCode.NOT_FOUND]
        for method, req, resp in (("ModelConfig", kpb.ModelConfigRequest(name="demo-mha"),
                                   kpb.ModelConfigResponse),
                                  ("ModelReady", kpb.ModelReadyRequest(name="demo-mha"),
                                   kpb.ModelReadyResponse),
                                  ("ModelStatistics", kpb.ModelStatisticsRequest(name="demo-mha"),
                                   kpb.ModelStatisticsResponse)):
            assert _code(lambda: _kserve(ch, kpb, method, req, resp, TOKEN_SDPA)) == P, method
            assert _code(lambda: _kserve(ch, kpb, method, req, resp)) == U, method
        assert _code(lambda: _kserve(ch, kpb, "ServerMetadata", kpb.ServerMetadataRequest(),
                                     kpb.ServerMetadataResponse)) == U
        index = _kserve(ch, kpb, "RepositoryIndex", kpb.RepositoryIndexRequest(),
                        kpb.RepositoryIndexResponse, TOKEN_SDPA)
        assert [m.name for m in index.models] == ["sdpa"]
        stats = _kserve(ch, kpb, "ModelStatistics", kpb.ModelStatisticsRequest(),
                        kpb.ModelStatisticsResponse, TOKEN_SDPA)
        assert [s.name for s in stats.model_stats] == ["sdpa"]

        stream = ch.stream_stream(KSERVE + "ModelStreamInfer", request_serializer=_identity,
                                  response_deserializer=kpb.ModelStreamInferResponse.FromString)
        msgs = []
        for m in ("sdpa", "demo-mha"):
            req = _infer_request(kpb, m)
            req.id = m
            msgs.append(req.SerializeToString())
        with pytest.raises(grpc.RpcError) as e:
            list(stream(iter(msgs), timeout=30))
        assert e.value.code() == U
        # Answers come in completion order (the refusal can overtake the
        # computed answer): match them by the id each one echoes.
        answers = {a.infer_response.id: a
                   for a in stream(iter(msgs), timeout=30, metadata=_meta(TOKEN_SDPA))}
        assert sorted(answers) == ["demo-mha", "sdpa"]
        assert answers["sdpa"].error_message == ""
        assert "do not allow model 'demo-mha'" in answers["demo-mha"].error_message


def test_sessions_follow_the_tokens(tls_server, pki, pb):
    with _tls_channel(pki, tls_server.port, "ca_a", tag=8) as ch:
        open_session = ch.unary_unary(OPEN_SESSION, request_serializer=_identity,
                                      response_deserializer=_identity)
        close_session = ch.unary_unary(CLOSE_SESSION, request_serializer=_identity,
                                       response_deserializer=_identity)
        req = pb.OpenSessionRequest(model="demo-mha").SerializeToString()
        assert _code(lambda: open_session(req, timeout=15)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: open_session(req, timeout=15, metadata=_meta(TOKEN_SDPA))) == \
            grpc.StatusCode.PERMISSION_DENIED
        close = pb.CloseSessionRequest(session_id="no-such-session").SerializeToString()
        assert _code(lambda: close_session(close, timeout=15)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: close_session(close, timeout=15, metadata=_meta(TOKEN_SDPA))) == \
            grpc.StatusCode.NOT_FOUND


def test_python_client_tls_and_token_options(tls_server, pki):
    """The package's own options (root_certificates=, token=) against this
    server: what a user of attnserve_client writes."""
    harness.use_python_client()
    from attnserve_client import AttentionClient, PermissionDeniedError, UnauthenticatedError
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    ca = pki.path("ca_a.pem")
    with AttentionClient(tls_server.target, root_certificates=ca, token=TOKEN_SDPA,
                         server_name_override="localhost") as c:
        out = c.attend(q, q, q, model="sdpa").output
        ref, _ = harness.reference_attention(q, q, q)
        assert np.allclose(out, ref, atol=1e-5)
        with pytest.raises(PermissionDeniedError):
            c.attend(q, q, q, model="demo-mha")
    with AttentionClient(tls_server.target, root_certificates=ca) as c:
        with pytest.raises(UnauthenticatedError):
            c.attend(q, q, q, model="sdpa")


def test_kserve_request_over_the_limits_does_not_grow_memory(limits_server, kpb):
    """16 GiB of declared tensors through ModelInfer: refused, RSS flat."""
    pid = limits_server.proc.pid
    with grpc.insecure_channel(limits_server.target) as ch:
        infer = ch.unary_unary(KSERVE + "ModelInfer", request_serializer=_identity,
                               response_deserializer=_identity)
        req = kpb.ModelInferRequest(model_name="sdpa")
        for name in ("query", "key", "value"):
            req.inputs.add(name=name, datatype="FP32", shape=[1, 1, 1 << 16, 1 << 16])
            req.raw_input_contents.append(b"\0" * 16)
        peak, rss = _peak_rss_bytes(pid), _status_bytes(pid, "VmRSS")
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                infer(req.SerializeToString(), timeout=30)
            assert e.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      grpc.StatusCode.INVALID_ARGUMENT), e.value
            assert "query" in e.value.details(), e.value.details()
        assert _peak_rss_bytes(pid) - peak < 64 << 20
        assert _status_bytes(pid, "VmRSS") - rss < 64 << 20


def test_attn_client_tls_and_token_flags(tls_server, pki):
    base = [harness.client_bin(), "--target", f"localhost:{tls_server.port}", "--model", "sdpa",
            "--seq", "4", "--heads", "2", "--head-dim", "8",
            "--tls-ca-file", pki.path("ca_a.pem")]
    token_file = pki.path("client_token")
    with open(token_file, "w") as f:
        f.write(TOKEN_SDPA + "\n")

    def run(args):
        return subprocess.run(args, capture_output=True, text=True, timeout=60)
    ok = run(base + ["--token-file", token_file])
    assert ok.returncode == 0, ok.stderr
    denied = run(base + ["--token", TOKEN_SDPA, "--model", "demo-mha"])
    assert denied.returncode == 2 and "PERMISSION_DENIED" in denied.stderr, denied.stderr
    anonymous = run(base)
    assert anonymous.returncode == 2 and "UNAUTHENTICATED" in anonymous.stderr, anonymous.stderr
    # Health over TLS needs no token (the probe docs/SECURITY.md gives Docker and Kubernetes).
    health = run([harness.client_bin(), "health", "--target", f"localhost:{tls_server.port}",
                  "--tls-ca-file", pki.path("ca_a.pem"), "--timeout-ms=3000"])
    assert health.returncode == 0, health.stderr
    # Not trusting the server's CA: the handshake fails.
    untrusted = run(base[:-1] + [pki.path("ca_b.pem"), "--token", TOKEN_SDPA])
    assert untrusted.returncode != 0 and "UNAVAILABLE" in untrusted.stderr, untrusted.stderr
