"""End-to-end tests of the real attnserve binary through its proto: a Python
gRPC client (generated stubs), health, reflection, malformed requests, message
size limits and clean shutdown. Oracle: harness.reference_attention (NumPy float64)."""

import concurrent.futures
import os
import signal

import grpc
import numpy as np
import pytest

import harness
from attnserve_client import AttentionClient, stubs

pb = stubs.attention_pb2


def _sdpa_inputs(rng, b=2, hq=4, hkv=2, lq=6, lk=9, dk=16, dv=8):
    return (rng.standard_normal((b, hq, lq, dk)).astype(np.float32),
            rng.standard_normal((b, hkv, lk, dk)).astype(np.float32),
            rng.standard_normal((b, hkv, lk, dv)).astype(np.float32))


def _assert_fp32_close(got, want):
    # fp32 contract: relative error <= 1e-5 of the output's scale.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_health_serving(client):
    assert client.health() == "SERVING"


def test_list_models_has_builtins(client):
    models = {m.name: m for m in client.list_models()}
    assert {"sdpa", "demo-mha"} <= models.keys(), models.keys()
    assert models["sdpa"].config.kind == "sdpa"
    mha = models["demo-mha"]
    assert mha.config.kind == "mha"
    assert mha.config.embed_dim == 512 and mha.config.num_heads == 8
    assert mha.is_default and not models["sdpa"].is_default
    assert all(m.state == pb.ModelStatus.READY for m in models.values())


def test_get_model(client):
    assert client.get_model("sdpa").name == "sdpa"
    with pytest.raises(grpc.RpcError) as e:
        client.get_model("nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in e.value.details()


@pytest.mark.parametrize("case", [
    dict(),
    dict(causal=True),
    dict(causal=True, lq=9, lk=5),  # Lq > Lk: the first rows see no key
    dict(key_lengths=[9, 4]),
    dict(key_lengths=[0, 9]),  # a sequence with no keys at all
    dict(mask="bool"),
    dict(mask="float", scale=0.3),
    dict(hq=6, hkv=3, dv=16, causal=True, key_lengths=[7, 9], mask="bool"),
])
def test_sdpa_matches_numpy(client, case):
    case = dict(case)
    rng = np.random.default_rng(len(str(case)))
    shape = {k: case.pop(k) for k in ("hq", "hkv", "lq", "lk", "dv") if k in case}
    q, k, v = _sdpa_inputs(rng, **shape)
    mask = case.pop("mask", None)
    lq, lk = q.shape[2], k.shape[2]
    if mask == "bool":
        mask = rng.random((q.shape[0], 1, lq, lk)) < 0.7
    elif mask == "float":
        mask = rng.standard_normal((lq, lk)).astype(np.float32)
    res = client.attend(q, k, v, model="sdpa", attn_mask=mask, need_weights=True, request_id="r1", **case)
    want, want_w = harness.reference_attention(q, k, v, mask=mask, **case)
    assert res.id == "r1"
    assert res.output.dtype == np.float32 and res.output.shape == want.shape
    _assert_fp32_close(res.output, want)
    assert res.weights.shape == want_w.shape
    np.testing.assert_allclose(res.weights, want_w, rtol=1e-5, atol=1e-6)
    assert res.timing.total_us >= res.timing.compute_us >= 0
    assert res.timing.batch_requests >= 1


def test_sdpa_average_weights(client):
    q, k, v = _sdpa_inputs(np.random.default_rng(7))
    res = client.attend(q, k, v, model="sdpa", causal=True, average_weights=True)
    _, w = harness.reference_attention(q, k, v, causal=True)
    assert res.weights.shape == (q.shape[0], q.shape[2], k.shape[2])
    np.testing.assert_allclose(res.weights, w.mean(axis=1), rtol=1e-5, atol=1e-6)


def test_demo_mha_self_attention(client):
    x = np.random.default_rng(3).standard_normal((2, 16, 512)).astype(np.float32)
    self_attn = client.attend(x, model="demo-mha").output
    assert self_attn.shape == (2, 16, 512)
    assert np.isfinite(self_attn).all() and np.abs(self_attn).max() > 0
    # Omitting key/value means key = value = query; the empty model name means demo-mha.
    explicit = client.attend(x, x, x).output
    _assert_fp32_close(explicit, self_attn)
    # Cross attention and per-sequence padding change the answer only where they should.
    mem = np.random.default_rng(4).standard_normal((2, 5, 512)).astype(np.float32)
    cross = client.attend(x, mem, mem, model="demo-mha").output
    assert cross.shape == (2, 16, 512)
    padded = client.attend(x, np.concatenate([mem, x[:, :3]], axis=1), np.concatenate([mem, x[:, :3]], axis=1),
                           model="demo-mha", key_lengths=[5, 5]).output
    _assert_fp32_close(padded, cross)


def test_concurrent_requests_each_match_numpy(client):
    # Many requests in flight at once (they may share batches on the server):
    # every answer must still be its own request's answer.
    rng = np.random.default_rng(11)
    cases = []
    for i in range(24):
        lq, lk = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        cases.append((_sdpa_inputs(rng, b=1 + i % 2, lq=lq, lk=lk), bool(i % 3 == 0), f"c{i}"))

    def run(case):
        (q, k, v), causal, rid = case
        res = client.attend(q, k, v, model="sdpa", causal=causal, request_id=rid)
        return res, harness.reference_attention(q, k, v, causal=causal)[0], rid

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for res, want, rid in pool.map(run, cases):
            assert res.id == rid
            _assert_fp32_close(res.output, want)


def test_reused_request_memory_never_mixes_requests(client):
    # Tensors go from the wire into reused request memory, and results leave
    # from it (server/transport/attend_wire.h). Requests of falling sizes land
    # in buffers that earlier, larger requests freed; each must answer its
    # own inputs exactly, unary and in a stream, masks and weights included.
    rng = np.random.default_rng(2026)
    cases = []
    for lq in (2560, 2048, 2047, 1500, 64, 63):  # 5 MiB of query first: over 4 MiB kept per buffer
        q = rng.standard_normal((1, 8, lq, 64)).astype(np.float32)
        k = rng.standard_normal((1, 8, 8, 64)).astype(np.float32)
        v = rng.standard_normal((1, 8, 8, 32)).astype(np.float32)
        mask = rng.random((1, 1, lq, 8)) < 0.8
        cases.append(dict(query=q, key=k, value=v, attn_mask=mask, model="sdpa",
                          need_weights=True, request_id=f"lq{lq}"))
    for c in cases:
        res = client.attend(c["query"], c["key"], c["value"], model="sdpa", attn_mask=c["attn_mask"],
                            need_weights=True, request_id=c["request_id"])
        want, want_w = harness.reference_attention(c["query"], c["key"], c["value"], mask=c["attn_mask"])
        assert res.id == c["request_id"]
        _assert_fp32_close(res.output, want)
        np.testing.assert_allclose(res.weights, want_w, rtol=1e-5, atol=1e-6)
    for c, res in zip(cases[::-1], client.attend_stream(cases[::-1])):
        want, want_w = harness.reference_attention(c["query"], c["key"], c["value"], mask=c["attn_mask"])
        assert res.id == c["request_id"]
        _assert_fp32_close(res.output, want)
        np.testing.assert_allclose(res.weights, want_w, rtol=1e-5, atol=1e-6)


def _good_sdpa(rng=None):
    rng = rng or np.random.default_rng(0)
    q, k, v = _sdpa_inputs(rng, b=2, hq=4, hkv=2, lq=4, lk=5, dk=8, dv=8)
    return q, k, v


def _request(client, **overrides):
    """A valid sdpa request, then `overrides` applied to the proto."""
    q, k, v = _good_sdpa()
    req = client.build_request(q, k, v, model="sdpa")
    for field, value in overrides.items():
        if callable(value):
            value(req)
        else:
            setattr(req, field, value)
    return req


def _set_tensor(field, array=None, shape=None, dtype=None, data=None):
    def apply(req):
        t = getattr(req, field)
        if array is not None:
            from attnserve_client import encode_tensor
            t.CopyFrom(encode_tensor(array))
        if shape is not None:
            del t.shape[:]
            t.shape.extend(shape)
        if dtype is not None:
            t.dtype = dtype
        if data is not None:
            t.data = data
    return apply


def _clear(field):
    return lambda req: req.ClearField(field)


def _key_lengths(values):
    def apply(req):
        del req.key_lengths[:]
        req.key_lengths.extend(values)
    return apply


MALFORMED = [
    # (name, overrides, expected code, words the message must contain: the field
    # and the values seen; a tuple = any one of them)
    ("short data", dict(q=_set_tensor("query", data=b"\0" * 12)), "INVALID_ARGUMENT", ["query", "1024", "12"]),
    ("long data", dict(q=_set_tensor("query", data=b"\0" * (2 * 4 * 4 * 8 * 4 + 4))), "INVALID_ARGUMENT", ["query", "1028"]),
    ("rank 3 query", dict(q=_set_tensor("query", shape=[2, 4, 32])), "INVALID_ARGUMENT", ["query", "rank", "[2, 4, 32]"]),
    ("rank 5 key", dict(k=_set_tensor("key", shape=[2, 2, 5, 8, 1])), "INVALID_ARGUMENT", ["key", "rank"]),
    ("zero dim", dict(q=_set_tensor("query", shape=[2, 4, 0, 8], data=b"")), "INVALID_ARGUMENT", ["query"]),
    ("negative dim", dict(q=_set_tensor("query", shape=[2, -4, 4, 8])), "INVALID_ARGUMENT", ["query", "-4"]),
    ("overflowing shape", dict(q=_set_tensor("query", shape=[1 << 40, 1 << 40, 1 << 40, 8], data=b"")),
     "INVALID_ARGUMENT", ["query", "overflow"]),
    ("dtype unset", dict(q=_set_tensor("query", dtype=pb.DATA_TYPE_UNSPECIFIED)), "INVALID_ARGUMENT", ["query", "dtype"]),
    ("bool query", dict(q=_set_tensor("query", array=np.ones((2, 4, 4, 8), dtype=bool))), "INVALID_ARGUMENT",
     ["query"]),
    ("mixed dtypes", dict(k=_set_tensor("key", array=np.zeros((2, 2, 5, 8), dtype=np.float16))),
     "INVALID_ARGUMENT", ["key"]),
    ("missing query", dict(q=_clear("query")), "INVALID_ARGUMENT", ["query"]),
    ("key without value", dict(v=_clear("value")), "INVALID_ARGUMENT", ["value"]),
    ("Hq not a multiple of Hkv", dict(k=_set_tensor("key", array=np.zeros((2, 3, 5, 8), np.float32)),
                                      v=_set_tensor("value", array=np.zeros((2, 3, 5, 8), np.float32))),
     "INVALID_ARGUMENT", [("key", "head"), "4", "3"]),
    ("key/value length mismatch", dict(v=_set_tensor("value", array=np.zeros((2, 2, 6, 8), np.float32))),
     "INVALID_ARGUMENT", ["value", "6"]),
    ("batch mismatch", dict(k=_set_tensor("key", array=np.zeros((3, 2, 5, 8), np.float32))),
     "INVALID_ARGUMENT", [("key", "batch"), "3"]),
    ("Dk mismatch", dict(k=_set_tensor("key", array=np.zeros((2, 2, 5, 7), np.float32))),
     "INVALID_ARGUMENT", ["key", "7"]),
    ("key_lengths count", dict(kl=_key_lengths([5])), "INVALID_ARGUMENT", ["key_lengths"]),
    ("key_lengths too long", dict(kl=_key_lengths([5, 6])), "INVALID_ARGUMENT", ["key_lengths", "6"]),
    ("key_lengths negative", dict(kl=_key_lengths([-1, 5])), "INVALID_ARGUMENT", ["key_lengths", "-1"]),
    ("mask not broadcastable", dict(m=_set_tensor("attn_mask", array=np.ones((3, 5), dtype=bool))),
     "INVALID_ARGUMENT", ["attn_mask", "[3, 5]"]),
    ("mask rank 1", dict(m=_set_tensor("attn_mask", array=np.ones((5,), dtype=bool))),
     "INVALID_ARGUMENT", ["attn_mask"]),
    ("mask byte size", dict(m=_set_tensor("attn_mask", array=np.ones((4, 5), dtype=bool), data=b"\1" * 19)),
     "INVALID_ARGUMENT", ["attn_mask", "19"]),
    ("negative scale", dict(scale=-1.0), "INVALID_ARGUMENT", ["scale", "-1"]),
    ("nan scale", dict(scale=float("nan")), "INVALID_ARGUMENT", ["scale", "nan"]),
    ("inf scale", dict(scale=float("inf")), "INVALID_ARGUMENT", ["scale", "inf"]),
    ("unknown model", dict(model="nope"), "NOT_FOUND", ["nope"]),
    # Non-finite inputs and overflowing scores are refused, never answered
    # with silently different numbers (issue 14).
    ("+inf key", dict(k=_set_tensor("key", array=np.where(np.arange(2 * 2 * 5 * 8).reshape(2, 2, 5, 8) == 9,
                                                          np.inf, 0).astype(np.float32))),
     "INVALID_ARGUMENT", ["key.data: element [0, 0, 1, 1] is +inf", "--nonfinite-inputs=reject"]),
    ("nan float mask", dict(m=_set_tensor("attn_mask", array=np.array([[0, np.nan, 0, 0, 0]] * 4, np.float32))),
     "INVALID_ARGUMENT", ["attn_mask.data: element [0, 1] is NaN", "may hold -inf"]),
    ("+inf float mask", dict(m=_set_tensor("attn_mask", array=np.array([[0, 0, 0, 0, np.inf]] * 4, np.float16))),
     "INVALID_ARGUMENT", ["attn_mask.data: element [0, 4] is +inf"]),
    ("scores overflow", dict(scale=3e38), "INVALID_ARGUMENT", ["query/key/scale", "exceeds FLT_MAX"]),
]


@pytest.mark.parametrize("name,overrides,code,words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_rejected_then_serves(client, server, name, overrides, code, words):
    req = _request(client, **overrides)
    with pytest.raises(grpc.RpcError) as e:
        client.attend_request(req)
    assert e.value.code() == getattr(grpc.StatusCode, code), e.value.details()
    for w in words:
        alternatives = w if isinstance(w, tuple) else (w,)
        assert any(a.lower() in e.value.details().lower() for a in alternatives), \
            f"none of {alternatives} in {e.value.details()!r}"
    # The server is still up and answers a good request correctly.
    assert server.alive()
    q, k, v = _good_sdpa(np.random.default_rng(1))
    _assert_fp32_close(client.attend(q, k, v, model="sdpa").output, harness.reference_attention(q, k, v)[0])


def test_nan_query_refused_with_the_documented_message(client):
    q, k, v = _good_sdpa()
    q[0, 1, 2, 3] = np.nan
    with pytest.raises(grpc.RpcError) as e:
        client.attend(q, k, v, model="sdpa")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == ("query.data: element [0, 1, 2, 3] is NaN; non-finite inputs are "
                                 "refused (--nonfinite-inputs=reject)"), e.value.details()
    # bf16 on the wire: the same rule on the 16-bit pattern.
    with pytest.raises(grpc.RpcError) as e:
        client.attend(q, k, v, model="sdpa", input_dtype="bf16")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "query.data: element [0, 1, 2, 3] is NaN" in e.value.details()


def test_work_per_request_is_bounded():
    # The request: 1.5 MB buying 2^34 attention scores (seconds of a
    # core) is refused before any compute; a lower flag refuses smaller ones.
    srv = harness.ServerProcess("--max-multiply-adds", "1000000")
    try:
        with AttentionClient(srv.target) as c:
            x = np.ones((1, 1, 131072, 1), np.float32)
            with pytest.raises(grpc.RpcError) as e:
                c.attend(x, x, x, model="sdpa", timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "17179869184 attention scores" in e.value.details()
            assert "limit of 268435456 per request (--max-attention-scores)" in e.value.details()
            q, k, v = _sdpa_inputs(np.random.default_rng(3), b=1, hq=8, hkv=8, lq=64, lk=64, dk=64, dv=64)
            with pytest.raises(grpc.RpcError) as e:
                c.attend(q, k, v, model="sdpa")
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "4194304 multiply-adds" in e.value.details()
            assert "limit of 1000000 per request (--max-multiply-adds)" in e.value.details()
            small = _sdpa_inputs(np.random.default_rng(4), b=1, hq=2, hkv=2, lq=8, lk=8, dk=8, dv=8)
            _assert_fp32_close(c.attend(*small, model="sdpa").output, harness.reference_attention(*small)[0])
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


def _environ_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry)


@pytest.mark.parametrize("given, expected", [
    ({}, {b"OMP_WAIT_POLICY": b"active", b"GOMP_SPINCOUNT": b"1000"}),
    ({"OMP_WAIT_POLICY": "passive"}, {b"OMP_WAIT_POLICY": b"passive", b"GOMP_SPINCOUNT": None}),
    ({"GOMP_SPINCOUNT": "20000"}, {b"OMP_WAIT_POLICY": None, b"GOMP_SPINCOUNT": b"20000"}),
])
def test_openmp_workers_spin_briefly_unless_the_operator_says_otherwise(given, expected):
    # attnserve re-executes itself with short libgomp spins (server/main.cc):
    # the environment it computes under is its own /proc environ, same pid.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    srv = harness.ServerProcess(env={**env, **given})
    try:
        environ = _environ_of(srv.proc.pid)
        for name, value in expected.items():
            assert environ.get(name) == value, (name, environ.get(name))
        with AttentionClient(srv.target) as c:  # and it serves
            small = _sdpa_inputs(np.random.default_rng(5), b=1, hq=2, hkv=2, lq=8, lk=8, dk=8, dv=8)
            _assert_fp32_close(c.attend(*small, model="sdpa").output, harness.reference_attention(*small)[0])
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


def test_nonfinite_propagate_is_refused_at_startup():
    import subprocess
    proc = subprocess.run([harness.server_bin(), "--address", "127.0.0.1:0", "--http-address",
                           "127.0.0.1:0", "--metrics-address", "127.0.0.1:0", "--nonfinite-inputs=propagate"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--nonfinite-inputs: 'propagate'" in proc.stderr and "not implemented" in proc.stderr, proc.stderr


def test_demo_mha_wrong_feature_dim(client):
    with pytest.raises(grpc.RpcError) as e:
        client.attend(np.zeros((1, 4, 100), np.float32), model="demo-mha")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "query" in e.value.details() and "512" in e.value.details(), e.value.details()


def _reflection_call(channel, **request):
    from attnserve.grpc_ext.reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]),
                                               timeout=30))
    assert len(responses) == 1
    return responses[0]


def test_reflection_lists_and_describes_the_service(client):
    resp = _reflection_call(client.channel, list_services="")
    names = {s.name for s in resp.list_services_response.service}
    assert "attnserve.v1.AttentionService" in names, names
    assert "grpc.health.v1.Health" in names, names

    from google.protobuf import descriptor_pb2
    resp = _reflection_call(client.channel, file_containing_symbol="attnserve.v1.AttentionService")
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in resp.file_descriptor_response.file_descriptor_proto]
    services = {s.name: {m.name for m in s.method} for f in files for s in f.service}
    assert services.get("AttentionService", set()) >= {"Attend", "AttendStream", "ListModels", "GetModel"}


def test_oversize_message_is_resource_exhausted():
    srv = harness.ServerProcess("--max-message-bytes", "1048576")
    try:
        with AttentionClient(srv.target) as c:
            rng = np.random.default_rng(5)
            small = _sdpa_inputs(rng, b=1, hq=2, hkv=2, lq=64, lk=64, dk=64, dv=64)  # ~100 KiB
            _assert_fp32_close(c.attend(*small, model="sdpa").output, harness.reference_attention(*small)[0])
            big_q = rng.standard_normal((1, 8, 512, 64)).astype(np.float32)  # 1 MiB query alone
            big_kv = rng.standard_normal((1, 8, 512, 64)).astype(np.float32)
            with pytest.raises(grpc.RpcError) as e:
                c.attend(big_q, big_kv, big_kv, model="sdpa")
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert c.health() == "SERVING"
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate],
                         ids=["gzip", "deflate"])
def test_compressed_requests_are_served_and_bounded_once_decompressed(server, compression):
    """gRPC's message compression, as a client turns it on: the server's own
    parse of Attend (tensors straight into request memory) sees the message
    decompressed, unary and streamed; a compressed message over
    --max-message-bytes (64 MiB) once decompressed is refused."""
    channel = grpc.insecure_channel(server.target, compression=compression,
                                    options=[("grpc.max_send_message_length", 1 << 30)])
    with AttentionClient(server.target, channel=channel) as c:
        rng = np.random.default_rng(11)
        q, k, v = _sdpa_inputs(rng, lq=64, lk=128)
        _assert_fp32_close(c.attend(q, k, v, model="sdpa", causal=True).output,
                           harness.reference_attention(q, k, v, causal=True)[0])
        outs = list(c.attend_stream([{"query": q, "key": k, "value": v, "model": "sdpa"}] * 3))
        for r in outs:
            _assert_fp32_close(r.output, harness.reference_attention(q, k, v)[0])
        zeros = np.zeros((1, 1, 1 << 22, 8), np.float32)  # 128 MiB, about 130 KB compressed
        with pytest.raises(grpc.RpcError) as e:
            c.attend(zeros, zeros[:, :, :8], zeros[:, :, :8], model="sdpa")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert c.health() == "SERVING"


class _CountingRelay:
    """A TCP relay on 127.0.0.1 in front of `target` that counts the bytes the
    server sends back: what the answers weigh on the wire."""

    def __init__(self, target):
        import socket
        import threading
        host, port = target.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.server_bytes = 0
        self._lock = threading.Lock()
        self._sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket
        import threading
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._upstream)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src, dst, count):
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.server_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def close(self):
        self._listener.close()
        for s in self._sockets:
            s.close()


@pytest.mark.parametrize("level", ["none", "low", "high"])
def test_answers_are_compressed_at_the_level_the_operator_sets(level):
    """--grpc-response-compression-level: a 1 MiB answer of zeros (value all
    zeros) crosses the wire in a few kilobytes once compressed, and whole
    without; the client reads the same answer either way."""
    srv = harness.ServerProcess("--grpc-response-compression-level", level)
    relay = _CountingRelay(srv.target)
    try:
        with AttentionClient(relay.target) as c:
            rng = np.random.default_rng(12)
            q = rng.standard_normal((1, 4, 1024, 64)).astype(np.float32)  # 1 MiB
            k = rng.standard_normal((1, 4, 64, 64)).astype(np.float32)
            r = c.attend(q, k, np.zeros_like(k), model="sdpa")
            assert r.output.shape == q.shape and not r.output.any()
        if level == "none":
            assert relay.server_bytes > q.nbytes, relay.server_bytes
        else:
            assert relay.server_bytes < q.nbytes // 16, relay.server_bytes
    finally:
        relay.close()
        code = srv.stop()
    assert code == 0, srv.log()


def test_an_unknown_compression_level_is_refused_at_startup():
    import subprocess
    proc = subprocess.run([harness.server_bin(), "--address", "127.0.0.1:0", "--http-address",
                           "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
                           "--grpc-response-compression-level=gzip"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--grpc-response-compression-level: expected none, low, medium or high, got 'gzip'" \
        in proc.stderr, proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_exits_zero(sig):
    srv = harness.ServerProcess()
    with AttentionClient(srv.target) as c:
        assert c.health() == "SERVING"
    code = srv.stop(sig)
    assert code == 0, f"exit code {code} after {sig.name}:\n{srv.log()}"


def test_max_attention_scores_bounds_the_work_of_one_request():
    # B*Hq*Lq*Lk = 1*2*6*9 = 108 scores fit a limit of 108; one more key does not, and is
    # refused before any compute with the flag named.
    server = harness.ServerProcess("--max-attention-scores=108")
    try:
        client = AttentionClient(server.target)
        rng = np.random.default_rng(7)
        q, k, v = _sdpa_inputs(rng, b=1, hq=2, hkv=1, lq=6, lk=9)
        out = client.attend(q, k, v, model="sdpa").output
        _assert_fp32_close(out, harness.reference_attention(q, k, v)[0])
        q, k, v = _sdpa_inputs(rng, b=1, hq=2, hkv=1, lq=6, lk=10)
        with pytest.raises(grpc.RpcError) as e:
            client.attend(q, k, v, model="sdpa")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        for words in ("[1, 2, 6, 10]", "limit of 108", "--max-attention-scores"):
            assert words in e.value.details(), e.value.details()
    finally:
        server.stop()


def test_projection_model_overflow_refused_before_compute(client):
    # demo-mha's scores come from projected inputs: the bounds use its weights
    # (largest row sum of |W| and bias), so inputs whose projections or
    # scores could overflow float32 are refused instead of answered with
    # rows the engine re-weighted over the finite keys.
    x = np.zeros((1, 4, 512), np.float32)
    x[0, 1, 3] = 1e38
    with pytest.raises(grpc.RpcError) as e:
        client.attend(x, model="demo-mha")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "query.data: its projection may overflow float32: max|query| 1e+38" in e.value.details()
    x[0, 1, 3] = 1e19  # projects to about 1e20: fine alone, its scores are not
    with pytest.raises(grpc.RpcError) as e:
        client.attend(x, model="demo-mha")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "query/key/scale: scores may overflow float32: max|projected query|" in e.value.details()
    x[0, 1, 3] = 3.0
    out = client.attend(x, model="demo-mha").output
    assert out.shape == (1, 4, 512) and np.isfinite(out).all()


def test_nonfinite_inputs_are_refused_and_minus_inf_masks_answered(client):
    # PyTorch would return NaN rows for these; attnserve refuses them rather than answering
    # with silently different (finite) rows.
    rng = np.random.default_rng(11)
    q, k, v = _sdpa_inputs(rng)
    q[0, 1, 3, 7] = np.nan
    with pytest.raises(grpc.RpcError) as e:
        client.attend(q, k, v, model="sdpa")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "query.data: element [0, 1, 3, 7] is NaN" in e.value.details(), e.value.details()
    q, k, v = _sdpa_inputs(rng)
    mask = np.zeros((q.shape[2], k.shape[2]), dtype=np.float32)
    mask[:, 0] = -np.inf  # masked, the SDPA convention
    got = client.attend(q, k, v, model="sdpa", attn_mask=mask).output
    _assert_fp32_close(got, harness.reference_attention(q, k, v, mask=mask)[0])
