"""KServe v2 / Open Inference Protocol, driven by Triton's own Python client
(tritonclient.grpc) against a real attnserve on 127.0.0.1: wire compatibility
of our proto with Triton's, readiness, metadata, config, statistics and the
repository index, the model config's parameters for LLM layers (Gemma 4's,
DeepSeek's latent attention), ModelInfer on sdpa (NumPy oracle) and on a projection model
exported from torch.nn.MultiheadAttention (torch oracle), FP16 and BF16,
masks and key lengths, weights, sessions through the session_id parameter,
ModelStreamInfer with many requests and a bad one in the middle, and the exact
errors of a bad input, an unknown model and an unparseable message."""

import os
import queue
import subprocess
import sys
import tempfile
import urllib.request

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

ROOT = os.path.abspath(os.environ.get("ATTNSERVE_SOURCE_DIR") or
                       os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import harness  # noqa: E402

rng = np.random.default_rng(7)


@pytest.fixture(scope="module")
def torch_repo():
    """A torch.nn.MultiheadAttention exported as a model folder (by the
    project's exporter, under Debian's Python) and the module itself."""
    repo = tempfile.mkdtemp(prefix="attnserve-kserve-")
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1] + '/tools'); import export_torch\n"
        "torch.manual_seed(3)\n"
        "m = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()\n"
        "export_torch.export_module(m, sys.argv[2] + '/mha')\n"
        "torch.save(m.state_dict(), sys.argv[2] + '/state.pt')\n")
    subprocess.run(["/usr/bin/python3", "-c", script, ROOT, repo], check=True)
    _write_layer_feature_models(repo)
    import torch
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mha.load_state_dict(torch.load(os.path.join(repo, "state.pt")))
    os.remove(os.path.join(repo, "state.pt"))
    return repo, mha


def _write_layer_feature_models(repo):
    """Three LLM layers (random weights) whose features the model config's
    parameters name: Gemma 4's (QK-norm, value norm, partial RoPE, a window),
    the same reusing another layer's keys and values (kv_source) and
    DeepSeek's latent attention."""
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    from attnserve_client.export import write_model_folder

    def w(*shape):
        return rng.uniform(-0.2, 0.2, shape).astype(np.float32)
    gemma4 = dict(
        embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, weight_layout="SEPARATE_QKV",
        causal=True, scale=1.0, sliding_window=20, qk_norm=dict(eps=1e-6),
        v_norm=dict(eps=1e-6), rope=dict(type="default", theta=10000.0, rotary_dim=4))
    weights = {
        "q_proj.weight": w(32, 32), "k_proj.weight": w(16, 32), "v_proj.weight": w(16, 32),
        "o_proj.weight": w(32, 32), "q_norm.weight": 1 + w(8), "k_norm.weight": 1 + w(8)}
    write_model_folder(os.path.join(repo, "gemma4"), gemma4, weights)
    write_model_folder(os.path.join(repo, "gemma4-shared"),
                       dict(gemma4, kv_source="model.layers.3.self_attn"), weights)
    # ALiBi on a bare sdpa model: its slopes fix the query heads (two).
    os.makedirs(os.path.join(repo, "alibi-sdpa"))
    with open(os.path.join(repo, "alibi-sdpa", "config.pbtxt"), "w") as f:
        f.write('kind: "sdpa" causal: true alibi_slopes: [0.5, 0.125]\n')
    # A relative position bias (T5's form: no scale, four projections
    # without biases) reaching 3 keys each way.
    write_model_folder(os.path.join(repo, "t5"), dict(
        embed_dim=32, num_heads=4, head_dim=8, weight_layout="SEPARATE_QKV", scale=1.0,
        relative_bias_distance=3), {
        "q_proj.weight": w(32, 32), "k_proj.weight": w(32, 32), "v_proj.weight": w(32, 32),
        "o_proj.weight": w(32, 32), "relative_bias": 10 * w(4, 7)})
    # Relative position embeddings (DeBERTa's form: biases, both terms)
    # reaching 3 positions each way, scale 1 / sqrt(8 * 3).
    write_model_folder(os.path.join(repo, "deberta"), dict(
        embed_dim=32, num_heads=4, head_dim=8, weight_layout="SEPARATE_QKV",
        q_bias=True, k_bias=True, v_bias=True, scale=float(1 / np.sqrt(24)),
        relative_embeddings=dict(distance=3, content_to_position=True,
                                 position_to_content=True)), {
        "q_proj.weight": w(32, 32), "k_proj.weight": w(32, 32), "v_proj.weight": w(32, 32),
        "o_proj.weight": w(32, 32), "q_proj.bias": w(32), "k_proj.bias": w(32),
        "v_proj.bias": w(32), "relative_key": 10 * w(4, 8, 7), "relative_query": 10 * w(4, 8, 7)})
    write_model_folder(os.path.join(repo, "latent"), dict(
        embed_dim=32, num_heads=4, num_kv_heads=4, head_dim=12, weight_layout="SEPARATE_QKV",
        causal=True, rope=dict(type="default", theta=10000.0, interleaved=True),
        latent_attention=dict(kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=6)), {
        "q_proj.weight": w(48, 32), "kv_a_proj_with_mqa.weight": w(20, 32),
        "kv_a_layernorm.weight": 1 + w(16), "kv_b_proj.weight": w(4 * (8 + 6), 16),
        "o_proj.weight": w(32, 24)})


@pytest.fixture(scope="module")
def server(torch_repo):
    s = harness.ServerProcess("--model-repository", torch_repo[0])
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    c = tc.InferenceServerClient(server.target)
    yield c
    c.close()


def make_input(name, array, datatype=None):
    t = tc.InferInput(name, list(array.shape), datatype or tc.np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def reference(*args, **kw):
    """The NumPy float64 oracle's output (harness.reference_attention)."""
    return harness.reference_attention(*args, **kw)[0]


def qkv(b=2, h=4, lq=5, lk=7, d=8):
    return (rng.standard_normal((b, h, lq, d), dtype=np.float32),
            rng.standard_normal((b, h, lk, d), dtype=np.float32),
            rng.standard_normal((b, h, lk, d), dtype=np.float32))


def test_our_proto_is_wire_compatible_with_tritons():
    """Every message, field (number, type, label) and RPC of
    proto/inference/grpc_service.proto exists identically in Triton's."""
    from google.protobuf import descriptor_pb2
    from tritonclient.grpc import model_config_pb2, service_pb2
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ours.pb")
        subprocess.run(["protoc", "-I", os.path.join(ROOT, "proto"), f"--descriptor_set_out={out}",
                        os.path.join(ROOT, "proto", "inference", "grpc_service.proto")], check=True)
        ours = descriptor_pb2.FileDescriptorSet()
        with open(out, "rb") as f:
            ours.ParseFromString(f.read())
    theirs, service = {}, None
    for mod in (service_pb2, model_config_pb2):
        fd = descriptor_pb2.FileDescriptorProto()
        mod.DESCRIPTOR.CopyToProto(fd)

        def walk(msgs, prefix):
            for m in msgs:
                theirs[prefix + m.name] = m
                walk(m.nested_type, prefix + m.name + ".")
        walk(fd.message_type, ".inference.")
        for e in fd.enum_type:
            theirs[".inference." + e.name] = e
        service = service or (fd.service[0] if fd.service else None)
    fd = ours.file[0]
    assert fd.package == "inference"
    checked = 0

    def check(msgs, prefix):
        nonlocal checked
        for m in msgs:
            name = prefix + m.name
            assert name in theirs, f"{name} is not a Triton message"
            fields = {f.number: f for f in theirs[name].field}
            for f in m.field:
                g = fields.get(f.number)
                assert g is not None and (g.name, g.type, g.label, g.type_name) == \
                    (f.name, f.type, f.label, f.type_name), f"{name}.{f.name}"
                checked += 1
            check(m.nested_type, name + ".")
    check(fd.message_type, ".inference.")
    for e in fd.enum_type:
        assert {(v.name, v.number) for v in e.value} <= \
            {(v.name, v.number) for v in theirs[".inference." + e.name].value}
    rpcs = {m.name: m for m in service.method}
    for m in fd.service[0].method:
        g = rpcs[m.name]
        assert (g.input_type, g.output_type, g.client_streaming, g.server_streaming) == \
            (m.input_type, m.output_type, m.client_streaming, m.server_streaming), m.name
    assert checked > 80


def test_readiness_metadata_config_and_index(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("sdpa") and client.is_model_ready("mha", "1")
    assert not client.is_model_ready("no-such-model")
    assert not client.is_model_ready("sdpa", "2")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "attnserve"
    assert set(meta["extensions"]) == {"model_repository", "model_configuration",
                                       "binary_tensor_data", "parameters", "statistics"}
    m = client.get_model_metadata("mha", as_json=True)
    assert m["versions"] == ["1"]
    ins = {t["name"]: (t["datatype"], [int(s) for s in t["shape"]]) for t in m["inputs"]}
    assert ins["query"] == ("FP32", [-1, -1, 32]) and ins["key_lengths"] == ("INT64", [-1])
    outs = {t["name"]: [int(s) for s in t["shape"]] for t in m["outputs"]}
    assert outs == {"output": [-1, -1, 32], "weights": [-1, -1, -1, -1]}
    cfg = client.get_model_config("sdpa", as_json=True)["config"]
    assert cfg["name"] == "sdpa" and cfg["backend"] == "cpu"
    assert [i["name"] for i in cfg["input"]][:3] == ["query", "key", "value"]
    index = {m["name"]: m["state"] for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index == {"sdpa": "READY", "mha": "READY", "demo-mha": "READY"} or \
        {"sdpa", "mha"} <= set(index)
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("no-such-model")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert "unknown model 'no-such-model'" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.load_model("sdpa")
    # The default model control mode reads the repository once.
    assert e.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert "--model-control-mode=explicit" in e.value.message()


def test_model_config_parameters_name_the_layers_features(client):
    """ModelConfig's parameters say what each layer computes; a latent
    layer's metadata and config list no key or value input."""
    def params(model):
        cfg = client.get_model_config(model, as_json=True)["config"]
        return {k: v["string_value"] for k, v in cfg["parameters"].items()}, cfg
    gemma, _ = params("gemma4")
    assert gemma == {"kind": "projection", "num_heads": "4", "num_kv_heads": "2",
                     "head_dim": "8", "causal": "true", "rope_type": "default",
                     "rope_theta": "10000", "rotary_dim": "4", "sliding_window": "20",
                     "qk_norm": "true", "v_norm": "true"}, gemma
    latent, cfg = params("latent")
    assert latent["latent_attention"] == "true" and latent["kv_lora_rank"] == "16" and \
        latent["v_head_dim"] == "6" and latent["rotary_dim"] == "4", latent
    assert "v_norm" not in latent and "qk_norm" not in latent
    inputs = [i["name"] for i in cfg["input"]]
    assert inputs[0] == "query" and "key" not in inputs and "value" not in inputs, inputs
    # A KV-shared layer names its source and needs key and value (its input).
    shared, cfg = params("gemma4-shared")
    assert shared == dict(gemma, kv_source="model.layers.3.self_attn"), shared
    optional = {i["name"]: i.get("optional", False) for i in cfg["input"]}
    assert optional["key"] is False and optional["value"] is False, optional
    assert optional["query"] is False and len(optional) > 3, optional
    assert all(optional[n] for n in optional if n not in ("query", "key", "value")), optional
    assert params("gemma4")[1]["input"][1].get("optional") is True
    meta = client.get_model_metadata("latent", as_json=True)
    assert {"key", "value"}.isdisjoint(t["name"] for t in meta["inputs"])
    outs = {t["name"]: [int(s) for s in t["shape"]] for t in meta["outputs"]}
    assert outs["output"] == [-1, -1, 32]
    # Served: a causal request gives finite numbers of the output's shape.
    x = rng.uniform(-1, 1, (1, 5, 32)).astype(np.float32)
    inp = tc.InferInput("query", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    for model in ("gemma4", "latent"):
        out = client.infer(model, [inp], parameters={"causal": True}).as_numpy("output")
        assert out.shape == (1, 5, 32) and np.isfinite(out).all()
    # The shared layer with its own input as key and value is the layer whose
    # weights it holds; without them it is refused, naming the source.
    kv = [make_input("key", x), make_input("value", x)]
    shared_out = client.infer("gemma4-shared", [inp] + kv,
                              parameters={"causal": True}).as_numpy("output")
    own = client.infer("gemma4", [inp], parameters={"causal": True}).as_numpy("output")
    np.testing.assert_allclose(shared_out, own, rtol=1e-5, atol=1e-6)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("gemma4-shared", [inp], parameters={"causal": True})
    assert "key: required by model 'gemma4-shared'" in str(refused.value)
    assert "model.layers.3.self_attn" in str(refused.value)


def test_a_relative_bias_model_biases_each_score_by_its_distance(client, torch_repo):
    """A layer with a relative position bias (T5's) says its reach in its
    parameters and computes, without and with causal, what a NumPy float64
    layer does: each head's table value for clamp(j - p, -3, 3) added to
    the unscaled scores."""
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    from attnserve_client.export import read_safetensors
    cfg = client.get_model_config("t5", as_json=True)["config"]
    assert cfg["parameters"]["relative_bias_distance"]["string_value"] == "3"
    w = {n: np.asarray(t, np.float64)
         for n, t in read_safetensors(os.path.join(torch_repo[0], "t5",
                                                   "weights.safetensors")).items()}
    x = rng.uniform(-1, 1, (2, 9, 32)).astype(np.float32)
    heads = lambda t: t.reshape(2, 9, 4, 8).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = (heads(x @ w[f"{n}_proj.weight"].T) for n in "qkv")
    rel = np.arange(9)[None, :] - np.arange(9)[:, None]
    for causal in (False, True):
        s = q @ k.transpose(0, 1, 3, 2) + w["relative_bias"][:, np.clip(rel, -3, 3) + 3][None]
        if causal:
            s = np.where(rel > 0, -np.inf, s)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = (p @ v).transpose(0, 2, 1, 3).reshape(2, 9, 32) @ w["o_proj.weight"].T
        got = client.infer("t5", [make_input("query", x)],
                           parameters={"causal": causal}).as_numpy("output")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_relative_embeddings_join_each_score_by_its_distance(client, torch_repo):
    """A layer with relative position embeddings (DeBERTa's) says its reach
    in its parameters and computes, without and with causal and with a key
    length, what a NumPy float64 layer does: each head's query against its
    key table's column clamp(j - p, -3, 3) + 3 and each key against its
    query table's, added to Q K^T before the scale."""
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    from attnserve_client.export import read_safetensors
    cfg = client.get_model_config("deberta", as_json=True)["config"]
    assert cfg["parameters"]["relative_embedding_distance"]["string_value"] == "3"
    w = {n: np.asarray(t, np.float64)
         for n, t in read_safetensors(os.path.join(torch_repo[0], "deberta",
                                                   "weights.safetensors")).items()}
    x = rng.uniform(-1, 1, (2, 9, 32)).astype(np.float32)
    heads = lambda t: t.reshape(2, 9, 4, 8).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = (heads(x @ w[f"{n}_proj.weight"].T + w[f"{n}_proj.bias"]) for n in "qkv")
    rel = np.arange(9)[None, :] - np.arange(9)[:, None]
    column = np.clip(rel, -3, 3) + 3  # [i, j]
    # [b, h, i, j]: q_i . key_table[h][:, c(i, j)] and k_j . query_table[h][:, c(i, j)].
    c2p = np.einsum("bhid,hdij->bhij", q, w["relative_key"][:, :, column])
    p2c = np.einsum("bhjd,hdij->bhij", k, w["relative_query"][:, :, column])
    for causal, lengths in ((False, [9, 9]), (True, [9, 9]), (False, [9, 5])):
        s = (q @ k.transpose(0, 1, 3, 2) + c2p + p2c) / np.sqrt(24)
        s = np.where(np.arange(9)[None, None, None, :] < np.array(lengths)[:, None, None, None],
                     s, -np.inf)
        if causal:
            s = np.where(rel > 0, -np.inf, s)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = (p @ v).transpose(0, 2, 1, 3).reshape(2, 9, 32) @ w["o_proj.weight"].T
        got = client.infer("deberta", [make_input("query", x),
                                       make_input("key_lengths", np.array(lengths, np.int64))],
                           parameters={"causal": causal}).as_numpy("output")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_an_alibi_model_biases_each_head_by_its_slope(client):
    """An sdpa model with alibi_slopes says so in its parameters, computes
    softmax(QK^T * scale + slope_h * (j - i)) causal, as NumPy does with that
    bias as a float mask, and refuses a query of another head count, naming
    both."""
    cfg = client.get_model_config("alibi-sdpa", as_json=True)["config"]
    assert cfg["parameters"]["alibi"]["string_value"] == "true"
    q = rng.uniform(-1, 1, (2, 2, 9, 8)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 2, 9, 8)).astype(np.float32)
    v = rng.uniform(-1, 1, (2, 2, 9, 8)).astype(np.float32)
    got = client.infer("alibi-sdpa", [make_input("query", q), make_input("key", k),
                                      make_input("value", v)]).as_numpy("output")
    rel = np.arange(9)[None, :] - np.arange(9)[:, None]
    bias = np.array([0.5, 0.125])[:, None, None] * rel
    want = reference(q, k, v, causal=True, mask=bias[None])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = reference(q, k, v, causal=True)
    assert np.abs(plain - want).max() > 1e-2  # the bias counts
    three = rng.uniform(-1, 1, (1, 3, 9, 8)).astype(np.float32)
    kv = rng.uniform(-1, 1, (1, 3, 9, 8)).astype(np.float32)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("alibi-sdpa", [make_input("query", three), make_input("key", kv),
                                    make_input("value", kv)])
    assert "ALiBi slopes for 2 query heads" in str(refused.value), str(refused.value)
    assert "got 3" in str(refused.value)


def test_infer_sdpa_matches_numpy_with_masks_lengths_scale_and_weights(client):
    q, k, v = qkv()
    lengths = np.array([7, 4], np.int32)
    mask = rng.random((2, 1, 5, 7)) > 0.2
    mask[..., 0] = True
    inputs = [make_input("query", q), make_input("key", k), make_input("value", v),
              make_input("key_lengths", lengths), make_input("attn_mask", mask)]
    r = client.infer("sdpa", inputs, request_id="req-1",
                     parameters={"causal": True, "scale": 0.25, "need_weights": True})
    assert r.get_response().id == "req-1"
    want = reference(q, k, v, causal=True, key_lengths=lengths, mask=mask,
                                       scale=0.25)
    np.testing.assert_allclose(r.as_numpy("output"), want, rtol=1e-5, atol=1e-5)
    w = r.as_numpy("weights")
    assert w.shape == (2, 4, 5, 7)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert np.all(w[1, :, :, 4:] == 0)  # masked by key_lengths
    # requested_outputs honoured: only weights
    r = client.infer("sdpa", inputs[:3], outputs=[tc.InferRequestedOutput("weights")])
    assert r.as_numpy("output") is None and r.as_numpy("weights").shape == (2, 4, 5, 7)
    # INT64 key lengths, typed (non-raw) contents are tested through the stream below


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_infer_requests_give_the_same_answer(client, algorithm):
    """tritonclient's compression_algorithm: gRPC decompresses the message
    before the server's own parse takes the raw contents out of it."""
    q, k, v = qkv()
    inputs = [make_input("query", q), make_input("key", k), make_input("value", v)]
    plain = client.infer("sdpa", inputs, parameters={"causal": True})
    r = client.infer("sdpa", inputs, parameters={"causal": True}, compression_algorithm=algorithm)
    np.testing.assert_allclose(r.as_numpy("output"), reference(q, k, v, causal=True),
                               rtol=1e-5, atol=1e-5)
    assert np.array_equal(r.as_numpy("output"), plain.as_numpy("output"))


def test_per_request_window_softcap_and_sinks_match_numpy(client):
    """The sdpa options of today's layers as KServe parameters (window,
    softcap) and input (sinks), against the NumPy float64 oracle."""
    q, k, v = qkv(lq=6, lk=40)
    sinks = rng.uniform(-2, 2, 4).astype(np.float32)
    inputs = [make_input("query", q), make_input("key", k), make_input("value", v),
              make_input("sinks", sinks)]
    r = client.infer("sdpa", inputs, parameters={"causal": True, "window": 9, "softcap": 2.5})
    want = reference(q, k, v, causal=True, window=9, softcap=2.5, sinks=sinks)
    np.testing.assert_allclose(r.as_numpy("output"), want, rtol=1e-5, atol=1e-5)
    # Each option changes the answer (the test would see it ignored).
    for dropped in ({"window": 0}, {"softcap": 0.0}, {"sinks": None}):
        options = dict(causal=True, window=9, softcap=2.5, sinks=sinks)
        options.update(dropped)
        assert not np.allclose(reference(q, k, v, **options), want, atol=1e-4), dropped
    with pytest.raises(InferenceServerException, match="sinks.shape: must be \\[Hq\\] = \\[4\\]"):
        client.infer("sdpa", inputs[:3] + [make_input("sinks", sinks[:3])])
    with pytest.raises(InferenceServerException, match="window: must be >= 0"):
        client.infer("sdpa", inputs, parameters={"window": -1})


@pytest.mark.parametrize("dtype", ["FP16", "BF16"])
def test_infer_fp16_and_bf16(client, dtype):
    q, k, v = qkv()
    np_dtype = np.float16 if dtype == "FP16" else ml_dtypes.bfloat16
    q16, k16, v16 = (a.astype(np_dtype) for a in (q, k, v))
    r = client.infer("sdpa", [make_input("query", q16, dtype), make_input("key", k16, dtype),
                              make_input("value", v16, dtype)])
    out = r.as_numpy("output")
    assert r.get_output("output").datatype == dtype
    want = reference(*(a.astype(np.float32) for a in (q16, k16, v16)))
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=0, atol=2e-2 if dtype == "BF16" else 3e-3)


def test_infer_projection_model_matches_torch(client, torch_repo):
    import torch
    _, mha = torch_repo
    x = rng.standard_normal((2, 6, 32), dtype=np.float32)
    # self-attention: key and value omitted
    r = client.infer("mha", [make_input("query", x)], parameters={"need_weights": True,
                                                                 "average_weights": True})
    with torch.no_grad():
        want, want_w = mha(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x))
    np.testing.assert_allclose(r.as_numpy("output"), want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r.as_numpy("weights"), want_w.numpy(), rtol=1e-5, atol=1e-5)


def test_session_through_the_session_id_parameter(client, server):
    """Open a session (attnserve.v1 OpenSession), decode step by step over
    KServe v2, compare with one causal stateless request."""
    import grpc
    channel = grpc.insecure_channel(server.target)
    open_session = channel.unary_unary("/attnserve.v1.AttentionService/OpenSession")
    reply = open_session(b"\x0a\x04sdpa")  # OpenSessionRequest{model: "sdpa"}
    assert reply[0] == 0x0a
    session_id = reply[2:2 + reply[1]].decode()
    q, k, v = qkv(b=1, h=2, lq=6, lk=6, d=8)
    outs = []
    for t in range(6):
        sl = slice(t, t + 1)
        r = client.infer("sdpa", [make_input("query", q[:, :, sl].copy()),
                                  make_input("key", k[:, :, sl].copy()),
                                  make_input("value", v[:, :, sl].copy())],
                         parameters={"session_id": session_id})
        assert r.get_response().parameters["session_length"].int64_param == t + 1
        outs.append(r.as_numpy("output"))
    want = reference(q, k, v, causal=True)
    np.testing.assert_allclose(np.concatenate(outs, axis=2), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(InferenceServerException) as e:
        client.infer("sdpa", [make_input(n, a[:, :, :1].copy()) for n, a in
                              (("query", q), ("key", k), ("value", v))],
                     parameters={"session_id": "no-such-session"})
    assert e.value.status() == "StatusCode.NOT_FOUND" and "no-such-session" in e.value.message()
    channel.close()


def test_stream_many_requests_and_a_bad_one_in_the_middle(client):
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    sent = {}
    try:
        for i in range(40):
            q, k, v = qkv(b=1, h=2, lq=3, lk=4, d=8)
            if i == 17:  # a bad one: INT8 query
                inputs = [make_input("query", q.astype(np.int8)), make_input("key", k),
                          make_input("value", v)]
            else:
                inputs = [make_input("query", q), make_input("key", k), make_input("value", v),
                          make_input("key_lengths", np.array([3], np.int64))]
            client.async_stream_infer("sdpa", inputs, request_id=f"s{i}")
            sent[f"s{i}"] = (q, k, v)
        got = [results.get(timeout=60) for _ in range(40)]
    finally:
        client.stop_stream()
    errors = [e for r, e in got if e is not None]
    assert len(errors) == 1
    assert "input 'query': datatype must be FP32, FP16 or BF16, got 'INT8'" in errors[0].message()
    ok = {r.get_response().id: r.as_numpy("output") for r, e in got if e is None}
    assert set(ok) == set(sent) - {"s17"}
    for rid, out in ok.items():
        q, k, v = sent[rid]
        want = reference(q, k, v, key_lengths=np.array([3]))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_errors_have_exact_codes_and_messages(client, server):
    q, k, v = qkv()
    good = [make_input("query", q), make_input("key", k), make_input("value", v)]
    cases = [
        ("no-such-model", good, {}, "StatusCode.NOT_FOUND",
         "model: unknown model 'no-such-model'; available: "),
        ("sdpa", [make_input("query", q.astype(np.int32)), *good[1:]], {}, "StatusCode.INVALID_ARGUMENT",
         "input 'query': datatype must be FP32, FP16 or BF16, got 'INT32'"),
        ("sdpa", good + [make_input("bias", q)], {}, "StatusCode.INVALID_ARGUMENT",
         "input 'bias' is not an input of attention; inputs are query, key, value, attn_mask, key_lengths"),
        ("sdpa", good, {"temperature": 2.0}, "StatusCode.INVALID_ARGUMENT",
         "parameter 'temperature' is not supported; parameters are "),
        ("sdpa", good, {"causal": 1}, "StatusCode.INVALID_ARGUMENT",
         "parameter 'causal': must be a bool (bool_param)"),
        ("sdpa", [good[0], make_input("key", k[:, :, :3]), good[2]], {}, "StatusCode.INVALID_ARGUMENT",
         "key"),
    ]
    for model, inputs, params, code, message in cases:
        with pytest.raises(InferenceServerException) as e:
            client.infer(model, inputs, parameters=params)
        assert e.value.status() == code, (model, e.value.message())
        assert message in e.value.message(), e.value.message()
    import grpc
    with grpc.insecure_channel(server.target) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as e:
            infer(b"\xff\xff\xff")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("request could not be parsed as inference.ModelInferRequest")


def test_model_lookup_comes_first_and_refusals_count_under_the_model(client, server):
    """As Triton: an unknown model is NOT_FOUND whatever else is wrong; a request
    the mapping cannot express is refused by validation after the lookup, so it
    is counted under the model it named, not as "(unknown)"."""
    import re
    q, k, v = qkv()
    good = [make_input("query", q), make_input("key", k), make_input("value", v)]
    with pytest.raises(InferenceServerException) as e:
        client.infer("no-such-model", good + [make_input("bias", q)], parameters={"casual": True})
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert e.value.message().startswith("model: unknown model 'no-such-model'; available: ")
    with pytest.raises(InferenceServerException) as e:
        client.infer("sdpa", good, model_version="2")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert e.value.message() == (
        "model_version: model 'sdpa' has only version \"1\" (or \"\"), got \"2\"")

    metrics = re.search(r"metrics on (127\.0\.0\.1:\d+)", server.log()).group(1)

    def invalid_on_sdpa():
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        return sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("attnserve_requests_total") and 'model="sdpa"' in l
                   and 'code="INVALID_ARGUMENT"' in l)
    before = invalid_on_sdpa()
    with pytest.raises(InferenceServerException) as e:
        client.infer("sdpa", good + [make_input("bias", q)])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert invalid_on_sdpa() == before + 1


def test_priority_is_accepted_and_ignored(client):
    """tritonclient's priority= (Triton's reserved `priority` parameter)."""
    q, k, v = qkv()
    r = client.infer("sdpa", [make_input("query", q), make_input("key", k),
                              make_input("value", v)], priority=3)
    np.testing.assert_allclose(r.as_numpy("output"), reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_counted_in_metrics_and_statistics_like_attend(client, server):
    stats = client.get_inference_statistics("sdpa", as_json=True)["model_stats"][0]
    before = int(stats["inference_stats"]["success"].get("count", 0))
    q, k, v = qkv()
    client.infer("sdpa", [make_input("query", q), make_input("key", k), make_input("value", v)])
    stats = client.get_inference_statistics("sdpa", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) == before + 1
    assert int(stats["execution_count"]) >= 1 and int(stats["inference_stats"]["fail"]["count"]) >= 1
    import re
    metrics = re.search(r"metrics on (127\.0\.0\.1:\d+)", server.log()).group(1)
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    line = next(l for l in text.splitlines()
                if l.startswith("attnserve_requests_total") and 'model="sdpa"' in l and 'code="OK"' in l)
    assert float(line.split()[-1]) >= before + 1


def test_readme_example_runs_as_written(server, capsys):
    """README.md's "Calling it from Triton clients" example, executed (only the
    address changed to this test's server)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("### Calling it from Triton clients"):]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    exec(compile(code.replace("127.0.0.1:50051", server.target), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "(1, 8, 16, 64)"
