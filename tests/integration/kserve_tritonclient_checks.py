"""KServe v2 checks with tritonclient, run by test_kserve.py inside its venv
(not collected on their own: tritonclient is not importable outside it).

Oracles: harness.reference_attention (NumPy float64) for `sdpa`, PyTorch's
nn.MultiheadAttention in float64 for a projection model exported to a model
repository; Triton's own generated descriptors for the wire format. Errors
are asserted by status code and exact message."""

import os
import re
import subprocess
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from google.protobuf import descriptor_pb2
from torch import nn
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import harness
import serving_util

SOURCE = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FP32 = dict(rtol=1e-5, atol=1e-5)


def _mha(seed, *args, **kw):
    torch.manual_seed(seed)
    return nn.MultiheadAttention(*args, batch_first=True, **kw).eval()


@pytest.fixture(scope="module")
def mha():
    return _mha(31, 32, 4)


@pytest.fixture(scope="module")
def server(tmp_path_factory, mha):
    import sys
    sys.path.insert(0, os.path.join(SOURCE, "tools"))
    import export_torch
    repo = tmp_path_factory.mktemp("repository")
    export_torch.export_module(mha, str(repo / "mha"))
    server = harness.ServerProcess("--model-repository", str(repo))
    yield server
    code = server.stop()
    assert code == 0, f"attnserve exited with {code} after SIGTERM:\n{server.log()}"


@pytest.fixture(scope="module")
def client(server):
    with grpcclient.InferenceServerClient(server.target) as c:
        yield c


def tensor(name, array, datatype=None):
    datatype = datatype or {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16",
                            np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.bool_): "BOOL",
                            np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}[array.dtype]
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def qkv(rng, b=2, hq=4, hkv=2, lq=5, lk=7, d=8):
    return (rng.standard_normal((b, hq, lq, d)).astype(np.float32),
            rng.standard_normal((b, hkv, lk, d)).astype(np.float32),
            rng.standard_normal((b, hkv, lk, d)).astype(np.float32))


def expect_error(call, code, message):
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() == f"StatusCode.{code}", e.value
    assert e.value.message() == message


# ------------------------------------------------------------------ wire

def _descriptors(fd):
    """{message full name: {field number: (name, type, label, type_name)}}."""
    out = {}

    def walk(prefix, messages):
        for m in messages:
            full = f"{prefix}.{m.name}"
            out[full] = {f.number: (f.name, f.type, f.label, f.type_name) for f in m.field}
            walk(full, m.nested_type)
    walk("." + fd.package, fd.message_type)
    return out


def test_proto_is_wire_compatible_with_tritons(tmp_path):
    """Every message and RPC we declare has Triton's names, numbers and types
    (tritonclient's generated descriptors are the oracle)."""
    out = tmp_path / "ours.pb"
    subprocess.run(["protoc", f"--proto_path={SOURCE}/proto", f"--descriptor_set_out={out}",
                    "--include_imports", "inference/grpc_service.proto"], check=True)
    ours = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    theirs = {}
    for module in (service_pb2, model_config_pb2):
        fd = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(fd)
        theirs.update(_descriptors(fd))
    checked = 0
    for fd in ours.file:
        if fd.package != "inference":
            continue
        for name, fields in _descriptors(fd).items():
            assert name in theirs, f"{name} is not a Triton message"
            for number, field in fields.items():
                assert theirs[name].get(number) == field, f"{name} field {number}"
                checked += 1
        for service in fd.service:
            triton = {m.name: m for m in
                      service_pb2.DESCRIPTOR.services_by_name[service.name].methods}
            for m in service.method:
                t = triton[m.name]
                assert (m.input_type, m.output_type) == ("." + t.input_type.full_name,
                                                         "." + t.output_type.full_name)
                assert m.client_streaming == t.client_streaming
                assert m.server_streaming == t.server_streaming
    assert checked > 100


# ------------------------------------------------------------------ health, metadata

def test_health_and_readiness(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("sdpa")
    assert client.is_model_ready("mha", "1")
    assert not client.is_model_ready("mha", "2")
    assert not client.is_model_ready("no-such-model")


def test_server_metadata(client):
    md = client.get_server_metadata(as_json=True)
    assert md["name"] == "attnserve"
    assert md["version"]
    assert set(md["extensions"]) == {"model_configuration", "statistics", "parameters"}


def test_model_metadata_dynamic_dims(client):
    md = client.get_model_metadata("sdpa", as_json=True)
    assert md["name"] == "sdpa" and md["versions"] == ["1"] and md["platform"] == "attnserve"
    inputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in md["inputs"]}
    assert inputs == {"query": ("FP32", [-1] * 4), "key": ("FP32", [-1] * 4),
                      "value": ("FP32", [-1] * 4), "attn_mask": ("BOOL", [-1] * 4),
                      "key_lengths": ("INT64", [-1])}
    md = client.get_model_metadata("mha", as_json=True)
    inputs = {t["name"]: [int(d) for d in t["shape"]] for t in md["inputs"]}
    outputs = {t["name"]: [int(d) for d in t["shape"]] for t in md["outputs"]}
    assert inputs["query"] == [-1, -1, 32] and inputs["key"] == [-1, -1, 32]
    assert outputs == {"output": [-1, -1, 32], "weights": [-1, 4, -1, -1]}


def test_model_config_parses_with_tritonclient(client):
    cfg = client.get_model_config("mha").config
    assert cfg.name == "mha" and cfg.max_batch_size == 0 and cfg.backend == "cpu"
    assert [(i.name, i.optional) for i in cfg.input] == [
        ("query", False), ("key", True), ("value", True), ("attn_mask", True),
        ("key_lengths", True)]
    assert cfg.input[0].data_type == model_config_pb2.TYPE_FP32
    assert list(cfg.output[0].dims) == [-1, -1, 32]
    assert cfg.parameters["num_heads"].string_value == "4"
    assert cfg.parameters["kind"].string_value == "mha"


def test_unknown_model_and_version(client):
    expect_error(lambda: client.get_model_metadata("no-such-model"), "NOT_FOUND",
                 "model: unknown model 'no-such-model'; available: demo-mha, mha, sdpa")
    expect_error(lambda: client.get_model_config("sdpa", "2"), "NOT_FOUND",
                 "model 'sdpa' has no version '2' (attnserve serves version \"1\" of each model; "
                 "an empty version means it)")


def test_repository_index_and_unimplemented_load(client):
    index = client.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["state"]) for m in index] == [
        ("demo-mha", "READY"), ("mha", "READY"), ("sdpa", "READY")]
    expect_error(lambda: client.load_model("sdpa"), "UNIMPLEMENTED",
                 "RepositoryModelLoad: attnserve loads its models once, at startup "
                 "(--model-repository); restart it to change them")


# ------------------------------------------------------------------ inference

def test_sdpa_matches_numpy_and_echoes_id(client):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng)
    r = client.infer("sdpa", [tensor("query", q), tensor("key", k), tensor("value", v)],
                     request_id="req-7", parameters={"need_weights": True})
    want, want_w = harness.reference_attention(q, k, v)
    np.testing.assert_allclose(r.as_numpy("output"), want, **FP32)
    np.testing.assert_allclose(r.as_numpy("weights"), want_w, **FP32)
    resp = r.get_response()
    assert (resp.id, resp.model_name, resp.model_version) == ("req-7", "sdpa", "1")
    assert [o.datatype for o in resp.outputs] == ["FP32", "FP32"]


def test_requested_outputs_are_honoured(client):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng)
    inputs = [tensor("query", q), tensor("key", k), tensor("value", v)]
    # No need_weights parameter: asking for weights is enough.
    r = client.infer("sdpa", inputs, outputs=[grpcclient.InferRequestedOutput("weights")])
    assert [o.name for o in r.get_response().outputs] == ["weights"]
    np.testing.assert_allclose(r.as_numpy("weights"), harness.reference_attention(q, k, v)[1],
                               **FP32)
    # Default: the output only.
    r = client.infer("sdpa", inputs)
    assert [o.name for o in r.get_response().outputs] == ["output"]
    r = client.infer("sdpa", inputs, outputs=[grpcclient.InferRequestedOutput("output")],
                     parameters={"need_weights": True})
    assert [o.name for o in r.get_response().outputs] == ["output"]


def test_parameters_causal_scale_average(client):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, lq=4, lk=6)
    inputs = [tensor("query", q), tensor("key", k), tensor("value", v)]
    r = client.infer("sdpa", inputs, parameters={"causal": True, "scale": 0.3,
                                                 "need_weights": True, "average_weights": True})
    want, want_w = harness.reference_attention(q, k, v, causal=True, scale=0.3)
    np.testing.assert_allclose(r.as_numpy("output"), want, **FP32)
    np.testing.assert_allclose(r.as_numpy("weights"), want_w.mean(axis=1), **FP32)
    # An integer scale is a number too.
    r = client.infer("sdpa", inputs, parameters={"scale": 1})
    np.testing.assert_allclose(r.as_numpy("output"),
                               harness.reference_attention(q, k, v, scale=1.0)[0], **FP32)


def test_masks_and_key_lengths(client):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, b=3, lq=4, lk=6)
    base = [tensor("query", q), tensor("key", k), tensor("value", v)]
    bool_mask = rng.random((3, 1, 4, 6)) < 0.7
    bool_mask[..., 0] = True
    r = client.infer("sdpa", base + [tensor("attn_mask", bool_mask)])
    np.testing.assert_allclose(r.as_numpy("output"),
                               harness.reference_attention(q, k, v, mask=bool_mask)[0], **FP32)
    float_mask = rng.standard_normal((4, 6)).astype(np.float32)
    r = client.infer("sdpa", base + [tensor("attn_mask", float_mask)])
    np.testing.assert_allclose(r.as_numpy("output"),
                               harness.reference_attention(q, k, v, mask=float_mask)[0], **FP32)
    lengths = [6, 2, 4]
    want = harness.reference_attention(q, k, v, key_lengths=lengths)[0]
    for dtype in (np.int32, np.int64):
        r = client.infer("sdpa", base + [tensor("key_lengths", np.array(lengths, dtype))])
        np.testing.assert_allclose(r.as_numpy("output"), want, **FP32)


@pytest.mark.parametrize("dtype,datatype,tol", [(np.float16, "FP16", 2e-3),
                                                (ml_dtypes.bfloat16, "BF16", 1.6e-2)])
def test_half_precision_inputs(client, dtype, datatype, tol):
    rng = np.random.default_rng(5)
    q, k, v = (x.astype(dtype) for x in qkv(rng))
    r = client.infer("sdpa", [tensor("query", q), tensor("key", k), tensor("value", v)])
    out = r.get_response().outputs[0]
    assert out.datatype == datatype
    got = r.as_numpy("output").astype(np.float64)
    want = harness.reference_attention(*(x.astype(np.float64) for x in (q, k, v)))[0]
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


def _torch_mha(module, x, key_padding_mask=None):
    with torch.no_grad():
        m = module.double()
        out, w = m(*(torch.from_numpy(x).double(),) * 3, key_padding_mask=key_padding_mask,
                   average_attn_weights=False)
        module.float()
    return out.numpy(), w.numpy()


def test_projection_model_matches_torch(client, mha):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    # Self-attention: key and value left out.
    r = client.infer("mha", [tensor("query", x)], parameters={"need_weights": True})
    want, want_w = _torch_mha(mha, x)
    np.testing.assert_allclose(r.as_numpy("output"), want, **FP32)
    np.testing.assert_allclose(r.as_numpy("weights"), want_w, **FP32)
    # Padding as key_lengths.
    lengths = np.array([5, 3], np.int64)
    pad = torch.from_numpy(np.arange(5)[None, :] >= lengths[:, None])
    r = client.infer("mha", [tensor("query", x), tensor("key", x), tensor("value", x),
                             tensor("key_lengths", lengths)])
    np.testing.assert_allclose(r.as_numpy("output"), _torch_mha(mha, x, pad)[0], **FP32)


def test_stream_many_requests(client):
    rng = np.random.default_rng(7)
    n = 64
    cases = [qkv(rng, b=1, lq=int(rng.integers(1, 6)), lk=int(rng.integers(1, 9)))
             for _ in range(n)]
    results, errors, done = {}, [], threading.Event()

    def callback(result, error):
        if error is not None:
            errors.append(error)
        else:
            results[result.get_response().id] = result.as_numpy("output")
        if len(results) + len(errors) == n + 1:
            done.set()

    client.start_stream(callback=callback)
    try:
        for i, (q, k, v) in enumerate(cases):
            client.async_stream_infer("sdpa", [tensor("query", q), tensor("key", k),
                                               tensor("value", v)], request_id=f"s{i}")
        # A bad request in the middle of the stream: answered, the stream goes on.
        client.async_stream_infer("sdpa", [tensor("query", cases[0][0])], request_id="bad")
        assert done.wait(60), f"{len(results)} results, {len(errors)} errors"
    finally:
        client.stop_stream()
    assert [e.message() for e in errors] == [
        "key: required by model 'sdpa' (no projections: key [B, Hkv, Lk, Dk] and value "
        "[B, Hkv, Lk, Dv] must be given)"]
    assert sorted(results) == sorted(f"s{i}" for i in range(n))
    for i, (q, k, v) in enumerate(cases):
        np.testing.assert_allclose(results[f"s{i}"], harness.reference_attention(q, k, v)[0],
                                   **FP32)


# ------------------------------------------------------------------ errors

def test_bad_input_exact_status_and_message(client):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng)
    expect_error(lambda: client.infer("sdpa", [tensor("query", q[0]), tensor("key", k),
                                               tensor("value", v)]),
                 "INVALID_ARGUMENT",
                 "query.shape: expected rank 4 [B, Hq, Lq, Dk] for model 'sdpa', got rank 3 "
                 "[4, 5, 8]")
    expect_error(lambda: client.infer("sdpa", [tensor("query", q), tensor("key", k),
                                               tensor("value", v), tensor("mask", q)]),
                 "INVALID_ARGUMENT",
                 "inputs[3]: unknown input 'mask' (attnserve models take query, key, value, "
                 "attn_mask, key_lengths)")
    expect_error(lambda: client.infer("sdpa", [tensor("query", q), tensor("key", k),
                                               tensor("value", v)], parameters={"casual": True}),
                 "INVALID_ARGUMENT",
                 "parameters: unknown parameter 'casual' (attnserve takes causal, scale, "
                 "need_weights, average_weights, timeout, priority, "
                 "triton_enable_empty_final_response)")
    expect_error(lambda: client.infer("sdpa", [tensor("query", q), tensor("key", k),
                                               tensor("value", v)], parameters={"causal": 1}),
                 "INVALID_ARGUMENT",
                 "parameters['causal']: must be a bool (bool_param), got int64_param")
    expect_error(lambda: client.infer("sdpa", [tensor("query", q.astype(np.float64), "FP64"),
                                               tensor("key", k), tensor("value", v)]),
                 "INVALID_ARGUMENT",
                 "query.datatype: must be FP32, FP16 or BF16 (attn_mask: BOOL or the query's "
                 "type), got 'FP64'")


def test_unknown_model_exact_status_and_message(client):
    q, k, v = qkv(np.random.default_rng(9))
    # The model lookup comes first, whatever else is wrong.
    expect_error(lambda: client.infer("no-such-model", [tensor("query", q), tensor("bogus", k)]),
                 "NOT_FOUND",
                 "model: unknown model 'no-such-model'; available: demo-mha, mha, sdpa")


def _stub(server):
    channel = grpc.insecure_channel(server.target)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_typed_contents_and_their_rules(server):
    """tritonclient always sends raw bytes; other clients send typed contents."""
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, b=1)
    req = service_pb2.ModelInferRequest(model_name="sdpa", id="typed")
    for name, a in (("query", q), ("key", k), ("value", v)):
        t = req.inputs.add(name=name, datatype="FP32", shape=a.shape)
        t.contents.fp32_contents.extend(a.ravel().tolist())
    t = req.inputs.add(name="key_lengths", datatype="INT32", shape=[1])
    t.contents.int_contents.append(5)
    channel, stub = _stub(server)
    with channel:
        resp = stub.ModelInfer(req, timeout=30)
        assert resp.id == "typed" and list(resp.outputs[0].shape) == list(q.shape)
        got = np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(q.shape)
        np.testing.assert_allclose(got, harness.reference_attention(q, k, v, key_lengths=[5])[0],
                                   **FP32)

        bad = service_pb2.ModelInferRequest()
        bad.CopyFrom(req)
        bad.inputs[0].contents.fp32_contents.pop()
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(bad, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (
            "query.contents.fp32_contents: expected 160 values for shape [1, 4, 5, 8], got 159")

        half = service_pb2.ModelInferRequest()
        half.CopyFrom(req)
        half.inputs[0].datatype = "FP16"
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(half, timeout=30)
        assert e.value.details() == ("query: FP16 data must be sent in raw_input_contents (the "
                                     "typed contents have no field for it)")


def test_unparseable_message_is_invalid_argument_and_counted(server):
    before = serving_util.metric(serving_util.scrape(server), "attnserve_requests_total",
                                 code="INVALID_ARGUMENT")
    channel = grpc.insecure_channel(server.target)
    with channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\x0a\xff\xff", timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(
        "request could not be parsed as inference.ModelInferRequest: ")
    after = serving_util.metric(serving_util.scrape(server), "attnserve_requests_total",
                                code="INVALID_ARGUMENT")
    assert after == before + 1


def test_metrics_and_statistics_count_kserve_requests_like_attend(client, server):
    def ok():
        return serving_util.metric(serving_util.scrape(server), "attnserve_requests_total",
                                   model="sdpa", code="OK")
    stats_before = client.get_inference_statistics("sdpa").model_stats[0]
    before = ok()
    q, k, v = qkv(np.random.default_rng(11))
    for _ in range(3):
        client.infer("sdpa", [tensor("query", q), tensor("key", k), tensor("value", v)])
    assert ok() == before + 3
    stats = client.get_inference_statistics("sdpa").model_stats[0]
    assert stats.name == "sdpa" and stats.version == "1"
    assert stats.inference_count == stats_before.inference_count + 3
    assert stats.inference_stats.success.count == stats_before.inference_stats.success.count + 3
    assert stats.execution_count >= stats_before.execution_count + 1
    assert stats.inference_stats.compute_infer.ns > stats_before.inference_stats.compute_infer.ns
    assert stats.last_inference > 0


# ------------------------------------------------------------------ docs

def _examples():
    """The Python example of README.md and docs/API.md (marked as such)."""
    blocks = []
    for doc in ("README.md", "docs/API.md"):
        text = open(os.path.join(SOURCE, doc)).read()
        m = re.search(r"<!-- example: kserve-python -->\s*```python\n(.*?)```", text, re.S)
        assert m, f"{doc}: no example marked <!-- example: kserve-python -->"
        blocks.append((doc, m.group(1)))
    return blocks


@pytest.mark.parametrize("doc,code", _examples())
def test_docs_example_runs_as_written(server, doc, code, tmp_path):
    assert "127.0.0.1:50051" in code
    script = tmp_path / "example.py"
    script.write_text(code.replace("127.0.0.1:50051", server.target))
    import sys
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "req-1 (1, 8, 16, 64) (1, 8, 16, 32)"
