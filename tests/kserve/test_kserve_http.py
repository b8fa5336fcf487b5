"""KServe v2 over HTTP/REST against the real server, with Triton's own
tritonclient.http and with curl: health, metadata, config, statistics, the
repository index, inference in JSON and with the binary tensor data extension
(FP16/BF16 only as binary), answers identical to the gRPC front end's and
to the NumPy float64 oracle, sessions, Triton's error codes with the gRPC
front end's messages, gzip and deflate bodies both ways (Content-Encoding,
Accept-Encoding), and hostile input (lying lengths, oversize and malformed
bodies, compression bombs, a slow client), each a clear 4xx with the server
alive."""

import gzip
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

rng = np.random.default_rng(2026)


@pytest.fixture(scope="module")
def server():
    s = harness.ServerProcess("--http-max-body-bytes", "4194304", "--http-request-timeout", "2s")
    assert s.http_target, s.log()
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    c = th.InferenceServerClient(server.http_target)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc_client(server):
    c = tg.InferenceServerClient(server.target)
    yield c
    c.close()


def qkv(b=2, h=4, lq=5, lk=7, d=8):
    return (rng.standard_normal((b, h, lq, d), dtype=np.float32),
            rng.standard_normal((b, h // 2, lk, d), dtype=np.float32),
            rng.standard_normal((b, h // 2, lk, d), dtype=np.float32))


def http_inputs(arrays, binary, datatype=None):
    out = []
    for name, a in arrays:
        t = th.InferInput(name, list(a.shape), datatype or th.np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a, binary_data=binary)
        out.append(t)
    return out


def grpc_inputs(arrays, datatype=None):
    out = []
    for name, a in arrays:
        t = tg.InferInput(name, list(a.shape), datatype or tg.np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def http(server, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one plain HTTP request."""
    req = urllib.request.Request(f"http://{server.http_target}{path}", data=body, method=method,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_health_metadata_config_and_index(client, server):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("sdpa") and client.is_model_ready("demo-mha", "1")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "attnserve"
    assert set(meta["extensions"]) == {"model_repository", "model_configuration",
                                       "binary_tensor_data", "parameters", "statistics"}
    m = client.get_model_metadata("sdpa")
    assert m["name"] == "sdpa" and m["versions"] == ["1"]
    assert {"name": "query", "datatype": "FP32", "shape": [-1, -1, -1, -1]} in m["inputs"]
    config = client.get_model_config("demo-mha")
    assert config["name"] == "demo-mha" and config["backend"] in ("cpu", "reference")
    index = client.get_model_repository_index()
    assert {x["name"] for x in index} >= {"sdpa", "demo-mha"}
    assert all(x["state"] == "READY" for x in index)
    with pytest.raises(InferenceServerException, match="404|not found|unknown model"):
        client.get_model_metadata("nope")


@pytest.mark.parametrize("binary", [False, True])
def test_infer_matches_numpy_and_the_grpc_front_end(client, grpc_client, binary):
    q, k, v = qkv()
    mask = rng.random((2, 1, 5, 7)) > 0.2
    mask[..., 0] = True
    lengths = np.array([7, 4], np.int64)
    arrays = [("query", q), ("key", k), ("value", v), ("attn_mask", mask),
              ("key_lengths", lengths)]
    params = {"causal": True, "scale": 0.25}
    outputs = [th.InferRequestedOutput("output", binary_data=binary),
               th.InferRequestedOutput("weights", binary_data=binary)]
    r = client.infer("sdpa", http_inputs(arrays, binary), outputs=outputs, request_id="h-1",
                     parameters=params)
    assert r.get_response()["id"] == "h-1"
    want, want_w = harness.reference_attention(q, k, v, causal=True, key_lengths=lengths,
                                               mask=mask, scale=0.25)
    np.testing.assert_allclose(r.as_numpy("output"), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r.as_numpy("weights"), want_w, rtol=1e-5, atol=1e-6)
    g = grpc_client.infer("sdpa", grpc_inputs(arrays), parameters=params,
                          outputs=[tg.InferRequestedOutput("output"),
                                   tg.InferRequestedOutput("weights")])
    # The same request path: the same bits (JSON floats round-trip exactly).
    assert np.array_equal(r.as_numpy("output"), g.as_numpy("output"))
    assert np.array_equal(r.as_numpy("weights"), g.as_numpy("weights"))


@pytest.mark.parametrize("dtype", ["FP16", "BF16"])
def test_fp16_and_bf16_only_as_binary(server, client, grpc_client, dtype):
    q, k, v = qkv()
    np_dtype = np.float16 if dtype == "FP16" else ml_dtypes.bfloat16
    arrays = [(n, a.astype(np_dtype)) for n, a in (("query", q), ("key", k), ("value", v))]
    r = client.infer("sdpa", http_inputs(arrays, True, dtype))
    assert r.get_output("output")["datatype"] == dtype
    g = grpc_client.infer("sdpa", grpc_inputs(arrays, dtype))
    assert np.array_equal(r.as_numpy("output").view(np.uint16), g.as_numpy("output").view(np.uint16))
    # JSON has no such numbers: refused naming the rule, as Triton does.
    body = {"inputs": [{"name": "query", "shape": [1, 1, 1, 2], "datatype": dtype, "data": [1, 2]}]}
    status, _, out = http(server, "POST", "/v2/models/sdpa/infer", json.dumps(body).encode())
    assert status == 400 and b"must be sent as binary data" in out, out


def test_projection_model_self_attention_and_json_output(client, grpc_client):
    x = rng.standard_normal((2, 6, 512), dtype=np.float32)
    r = client.infer("demo-mha", http_inputs([("query", x)], False),
                     parameters={"causal": True})
    g = grpc_client.infer("demo-mha", grpc_inputs([("query", x)]), parameters={"causal": True})
    assert np.array_equal(r.as_numpy("output"), g.as_numpy("output"))


def test_curl_json_request_from_the_shell(server):
    body = json.dumps({"inputs": [
        {"name": "query", "shape": [1, 1, 2, 2], "datatype": "FP32", "data": [[1, 0], [0, 1]]},
        {"name": "key", "shape": [1, 1, 2, 2], "datatype": "FP32", "data": [1, 0, 0, 1]},
        {"name": "value", "shape": [1, 1, 2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}],
        "parameters": {"causal": True}})
    out = subprocess.run(["curl", "-sS", "-f", "-X", "POST", "-H", "Content-Type: application/json",
                          "--data-binary", body, f"http://{server.http_target}/v2/models/sdpa/infer"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    q = np.array([[[[1, 0], [0, 1]]]], np.float32)
    want, _ = harness.reference_attention(q, q, np.array([[[[1, 2], [3, 4]]]], np.float32),
                                          causal=True)
    assert answer["outputs"][0]["shape"] == [1, 1, 2, 2]
    np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(1, 1, 2, 2), want,
                               rtol=1e-6)


def test_session_through_the_session_id_parameter(server, client):
    """Open a session (attnserve.v1 OpenSession, raw bytes: this venv's
    protobuf is not the stubs'), decode step by step over HTTP."""
    import grpc
    with grpc.insecure_channel(server.target) as channel:
        reply = channel.unary_unary("/attnserve.v1.AttentionService/OpenSession")(b"\x0a\x04sdpa")
    session_id = reply[2:2 + reply[1]].decode()
    q, k, v = qkv(b=1, lq=6, lk=6)
    for t in range(6):
        arrays = [("query", q[:, :, t:t + 1]), ("key", k[:, :, t:t + 1]),
                  ("value", v[:, :, t:t + 1])]
        r = client.infer("sdpa", http_inputs(arrays, True), parameters={"session_id": session_id})
        assert r.get_response()["parameters"]["session_length"] == t + 1
        want, _ = harness.reference_attention(q[:, :, t:t + 1], k[:, :, :t + 1],
                                              v[:, :, :t + 1], causal=True)
        np.testing.assert_allclose(r.as_numpy("output"), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(InferenceServerException, match="no-such-session"):
        client.infer("sdpa", http_inputs(arrays, True), parameters={"session_id": "no-such-session"})


def test_errors_have_tritons_codes_and_the_grpc_messages(server, grpc_client):
    q, k, v = qkv()
    body = {"inputs": [{"name": "query", "shape": list(q.shape), "datatype": "FP32",
                        "data": q.ravel().tolist()}]}
    status, _, out = http(server, "POST", "/v2/models/sdpa/infer", json.dumps(body).encode())
    assert status == 400
    message = json.loads(out)["error"]
    with pytest.raises(InferenceServerException) as e:
        grpc_client.infer("sdpa", grpc_inputs([("query", q)]))
    assert message == e.value.message(), (message, e.value.message())
    assert http(server, "POST", "/v2/models/nope/infer", b"{}")[0] == 404
    assert http(server, "GET", "/v2/models/sdpa/versions/7")[0] == 404
    assert http(server, "GET", "/v2/models/sdpa/infer")[0] == 405
    assert http(server, "GET", "/v2/nothing/here")[0] == 404
    status, _, out = http(server, "POST", "/v2/models/sdpa/infer", b'{"inputs": [')
    assert status == 400 and b"malformed JSON at offset" in out
    status, _, out = http(server, "POST", "/v2/models/sdpa/infer", b'{"temperature": 1}')
    assert status == 400
    assert '"temperature" is not a field of an infer request' in json.loads(out)["error"]


def test_lying_lengths_and_oversize_bodies_are_clear_4xx(server, client):
    # Inference-Header-Content-Length past the body.
    status, _, out = http(server, "POST", "/v2/models/sdpa/infer", b"{}",
                          {"Inference-Header-Content-Length": "100"})
    assert status == 400 and b"Inference-Header-Content-Length" in out
    # binary_data_size past the binary part.
    header = json.dumps({"inputs": [{"name": "query", "shape": [1, 1, 1, 2], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 64}}]}).encode()
    status, _, out = http(server, "POST", "/v2/models/sdpa/infer", header + b"\0" * 8,
                          {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and b"runs past the binary data" in out
    # Over --http-max-body-bytes (4 MiB): 413 before the body is read.
    status, _, out = http(server, "POST", "/v2/models/sdpa/infer", b"x" * (5 << 20))
    assert status == 413 and b"--http-max-body-bytes" in out
    # A Content-Length that promises more than is sent: the server waits
    # --http-request-timeout (2 s), then drops the connection; still serving.
    with socket.create_connection(("127.0.0.1", int(server.http_target.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v2/models/sdpa/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{}")
        s.settimeout(10)
        start = time.monotonic()
        try:
            while s.recv(4096):
                pass
        except (ConnectionResetError, socket.timeout):
            pass
        assert time.monotonic() - start < 9
    assert client.is_server_live()


@pytest.mark.parametrize("binary", [False, True])
def test_gzip_and_deflate_bodies_as_tritonclient_sends_and_reads_them(client, binary):
    q, k, v = qkv()
    arrays = [("query", q), ("key", k), ("value", v)]
    want, _ = harness.reference_attention(q, k, v)
    plain = client.infer("sdpa", http_inputs(arrays, binary),
                         outputs=[th.InferRequestedOutput("output", binary_data=binary)])
    np.testing.assert_allclose(plain.as_numpy("output"), want, rtol=1e-5, atol=1e-5)
    for request in (None, "gzip", "deflate"):
        for answer in (None, "gzip", "deflate"):
            r = client.infer("sdpa", http_inputs(arrays, binary),
                             outputs=[th.InferRequestedOutput("output", binary_data=binary)],
                             request_compression_algorithm=request,
                             response_compression_algorithm=answer)
            assert np.array_equal(r.as_numpy("output"), plain.as_numpy("output")), (request, answer)


def test_answers_are_compressed_as_accept_encoding_asks(server):
    q, k, v = qkv()
    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": a.nbytes}}
                         for n, a in (("query", q), ("key", k), ("value", v))],
              "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}
    head = json.dumps(header).encode()
    body = head + q.tobytes() + k.tobytes() + v.tobytes()
    want, _ = harness.reference_attention(q, k, v)
    for accept, coding, decompress in (("gzip", "gzip", gzip.decompress),
                                       ("deflate", "deflate", zlib.decompress),
                                       ("br;q=1, deflate;q=0.5, gzip;q=0.8", "gzip", gzip.decompress),
                                       ("gzip;q=0, br", None, None)):
        status, headers, out = http(server, "POST", "/v2/models/sdpa/infer", gzip.compress(body),
                                    {"Inference-Header-Content-Length": str(len(head)),
                                     "Content-Encoding": "gzip", "Accept-Encoding": accept})
        assert status == 200, out
        assert headers.get("Content-Encoding") == coding, (accept, headers)
        if coding is not None:
            assert headers.get("Vary") == "Accept-Encoding"
            assert int(headers["Content-Length"]) == len(out)
            out = decompress(out)
        n = int(headers["Inference-Header-Content-Length"])  # of the JSON before compression
        answer = json.loads(out[:n])
        assert answer["outputs"][0]["parameters"]["binary_data_size"] == len(out) - n
        got = np.frombuffer(out[n:], np.float32).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_encodings_and_compression_bombs_are_clear_4xx(server, client):
    def post(body, encoding):
        return http(server, "POST", "/v2/models/sdpa/infer", body, {"Content-Encoding": encoding})

    status, _, out = post(b"{}", "br")
    assert status == 415 and b"Content-Encoding: 'br' is not supported" in out
    status, _, out = post(gzip.compress(b"{}"), "gzip, gzip")
    assert status == 415 and b"one coding" in out
    status, _, out = post(gzip.compress(b'{"inputs": []}')[:-6], "gzip")
    assert status == 400 and b"gzip data ends early" in out
    status, _, out = post(b"not deflate at all", "deflate")
    assert status == 400 and b"not valid deflate data" in out
    # 5 MiB of zeros in a few kilobytes, over the fixture's 4 MiB limit
    # once decompressed: 413 when the limit is passed.
    bomb = gzip.compress(b"\0" * (5 << 20))
    assert len(bomb) < 64 << 10
    status, _, out = post(bomb, "gzip")
    assert status == 413 and b"once decompressed" in out and b"--http-max-body-bytes" in out
    # The JSON inside a valid gzip body is judged as any other.
    status, _, out = post(gzip.compress(b'{"temperature": 1}'), "gzip")
    assert status == 400
    assert '"temperature" is not a field of an infer request' in json.loads(out)["error"]
    assert client.is_server_live()


def test_slowloris_client_is_cut_off(server, client):
    """Headers sent a byte at a time, slower than --http-request-timeout:
    the connection is closed while other clients are served."""
    port = int(server.http_target.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(10)
        start = time.monotonic()
        closed = False
        for byte in b"GET /v2/health/live HTTP/1.1\r\nX-Slow: " + b"a" * 200:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            assert client.is_server_live()
            time.sleep(0.05)
            if time.monotonic() - start > 6:
                break
        if not closed:
            try:
                closed = s.recv(4096) == b""
            except (ConnectionResetError, socket.timeout):
                closed = True
        assert closed, "the slow client was never cut off"
