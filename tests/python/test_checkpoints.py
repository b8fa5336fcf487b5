"""Real checkpoints served by the real attnserve, the framework as the oracle.

Each layer is built in PyTorch (or written by hand in the Keras layout, with a
NumPy reference since Keras is not installable here), exported to a model
repository with tools/export_torch.py, served by `attnserve --model-repository`
and called through the Python gRPC client. The masks each framework uses are
translated as docs/MODELS.md shows; every example there is exercised here.

Error measure: rel = max|got - want| / max|want| over the whole tensor, against
a float64 evaluation of the framework's own module (or the NumPy reference).
  fp32 models: rel <= 1e-5 (the project's fp32 contract).
  bf16 models: rel <= 1e-2 (weights, and on the server projections and the
    attention core, rounded to bf16's 8-bit mantissa, 2^-8 = 3.9e-3 per
    rounding; measured 3.1e-3 with fp32 inputs, 3.7e-3 with bf16 inputs).
  fp16 models: rel <= 2e-3 (2^-11 = 4.9e-4 per rounding; measured 4.7e-4 with
    fp32 inputs, 6.0e-4 with fp16 inputs).
Bad models: every case asserts the exit code and the file, tensor/field and
expected vs actual in the message.
"""

import copy
import json
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
import torch
from torch import nn

import harness
from checkpoint_models import (HFStyleAttention, NeoXStyleAttention, TinyDecoder, export_torch,
                               gqa_reference, keras_mha_reference)

FP32_TOL = 1e-5
BF16_TOL = 1e-2
FP16_TOL = 2e-3
EXPORT = os.path.join(os.path.dirname(export_torch.__file__), "export_torch.py")


def rel_err(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_close(got, want, tol=FP32_TOL, what="output"):
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def f64(module):
    """A float64 copy of a module: the oracle runs in double precision."""
    return copy.deepcopy(module).double().eval()


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def torch_mha(module, q, k, v, **kw):
    """nn.MultiheadAttention (batch_first) in float64 on numpy inputs."""
    with torch.no_grad():
        out, w = f64(module)(torch.from_numpy(q).double(), torch.from_numpy(k).double(),
                             torch.from_numpy(v).double(), **kw)
    return out.numpy(), (None if w is None else w.numpy())


# ---------------------------------------------------------------------------
# The repository every positive test shares (one server for the file).

def _mha(seed, *args, **kw):
    torch.manual_seed(seed)
    return nn.MultiheadAttention(*args, batch_first=True, **kw).eval()


def _keras_weights(rng, d_in, heads, head_dim, d_out):
    return {
        "query/kernel": rand(rng, d_in, heads, head_dim) * 0.3,
        "query/bias": rand(rng, heads, head_dim) * 0.1,
        "key/kernel": rand(rng, d_in, heads, head_dim) * 0.3,
        "key/bias": rand(rng, heads, head_dim) * 0.1,
        "value/kernel": rand(rng, d_in, heads, head_dim) * 0.3,
        "value/bias": rand(rng, heads, head_dim) * 0.1,
        "attention_output/kernel": rand(rng, heads, head_dim, d_out) * 0.3,
        "attention_output/bias": rand(rng, d_out) * 0.1,
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> the framework object (module or weights) exported under that name."""
    repo = tmp_path_factory.mktemp("repository")
    m = {}
    m["mha-bias"] = _mha(1, 32, 4)
    m["mha-nobias"] = _mha(2, 32, 4, bias=False)
    m["mha-kvdim"] = _mha(3, 24, 3, kdim=10, vdim=14)
    m["mha-bf16"] = _mha(4, 32, 4)
    for name in ("mha-bias", "mha-nobias", "mha-kvdim"):
        export_torch.export_module(m[name], str(repo / name))
    export_torch.export_module(m["mha-bf16"], str(repo / "mha-bf16"), precision="bf16")
    m["mha-fp16"] = _mha(4, 32, 4)
    export_torch.export_module(m["mha-fp16"], str(repo / "mha-fp16"), precision="fp16")

    torch.manual_seed(5)
    m["hf-gqa"] = HFStyleAttention(64, 8, 2, 8, qkv_bias=True, o_bias=False).eval()
    export_torch.export_module(m["hf-gqa"], str(repo / "hf-gqa"))

    # Input width 20 != embed width 4 * 8 = 32, no q/k/v bias, biased output
    # projection back to 20, a decoder layer (causal).
    torch.manual_seed(6)
    m["narrow-causal"] = HFStyleAttention(20, 4, 4, 8, qkv_bias=False, o_bias=True,
                                          is_causal=True).eval()
    export_torch.export_module(m["narrow-causal"], str(repo / "narrow-causal"))

    # Scaled by 1/sqrt(embed_dim) instead of 1/sqrt(head_dim).
    torch.manual_seed(7)
    m["hf-fullscale"] = HFStyleAttention(32, 4, 4, 8, qkv_bias=True, o_bias=True,
                                         scaling=32 ** -0.5).eval()
    export_torch.export_module(m["hf-fullscale"], str(repo / "hf-fullscale"))

    torch.manual_seed(8)
    m["neox-fused"] = NeoXStyleAttention(48, 6).eval()
    export_torch.export_module(m["neox-fused"], str(repo / "neox-fused"))

    # One layer of a many-layer checkpoint, picked by tensor_prefix.
    torch.manual_seed(9)
    m["decoder-layer1"] = TinyDecoder().eval()
    export_torch.export_module(m["decoder-layer1"], str(repo / "decoder-layer1"),
                               submodule="layers.1.self_attn", full_state_dict=True)

    # Keras layout, written by hand (no Keras here): EinsumDense kernels.
    rng = np.random.default_rng(10)
    m["keras"] = _keras_weights(rng, 12, 3, 5, 12)
    export_torch.write_model_folder(str(repo / "keras"), dict(
        name="keras", embed_dim=12, num_heads=3, head_dim=5, q_bias=True, k_bias=True,
        v_bias=True, out_bias=True, weight_layout="KERAS_DENSE"), m["keras"])
    # kind "sdpa": no weights file, only attention options.
    (repo / "sdpa-causal").mkdir()
    (repo / "sdpa-causal" / "config.pbtxt").write_text('kind: "sdpa"\ncausal: true\nscale: 0.25\n')
    m["_repo"] = repo
    return m


@pytest.fixture(scope="module")
def repo_server(models):
    server = harness.ServerProcess("--model-repository", str(models["_repo"]))
    yield server
    code = server.stop()
    assert code == 0, f"attnserve exited with {code} after SIGTERM:\n{server.log()}"


@pytest.fixture(scope="module")
def rc(repo_server):
    from attnserve_client import AttentionClient
    with AttentionClient(repo_server.target, timeout=60) as c:
        yield c


# ---------------------------------------------------------------------------
# nn.MultiheadAttention

@pytest.mark.parametrize("name", ["mha-bias", "mha-nobias"])
def test_mha_self_attention_matches_torch(models, rc, name):
    rng = np.random.default_rng(100)
    x = rand(rng, 3, 7, 32)
    want, _ = torch_mha(models[name], x, x, x, need_weights=False)
    # key/value omitted = self-attention; and sent explicitly.
    assert_close(rc.attend(x, model=name).output, want)
    assert_close(rc.attend(x, x, x, model=name).output, want)


def test_mha_kdim_vdim_cross_attention(models, rc):
    rng = np.random.default_rng(101)
    q, k, v = rand(rng, 2, 4, 24), rand(rng, 2, 9, 10), rand(rng, 2, 9, 14)
    want, _ = torch_mha(models["mha-kvdim"], q, k, v, need_weights=False)
    assert want.shape == (2, 4, 24)
    assert_close(rc.attend(q, k, v, model="mha-kvdim").output, want)


def test_cross_attention_lq_ne_lk(models, rc):
    rng = np.random.default_rng(102)
    q, kv = rand(rng, 2, 3, 32), rand(rng, 2, 11, 32)
    want, want_w = torch_mha(models["mha-bias"], q, kv, kv, average_attn_weights=False)
    got = rc.attend(q, kv, kv, model="mha-bias", need_weights=True)
    assert_close(got.output, want)
    assert_close(got.weights, want_w, what="weights")


@pytest.mark.parametrize("average", [True, False])
def test_mha_need_weights(models, rc, average):
    rng = np.random.default_rng(103)
    q, kv = rand(rng, 2, 5, 32), rand(rng, 2, 6, 32)
    want, want_w = torch_mha(models["mha-bias"], q, kv, kv, need_weights=True,
                             average_attn_weights=average)
    got = rc.attend(q, kv, kv, model="mha-bias", need_weights=True, average_weights=average)
    assert got.weights.shape == ((2, 5, 6) if average else (2, 4, 5, 6))
    assert_close(got.output, want)
    assert_close(got.weights, want_w, what="weights")


def test_mha_key_padding_mask_as_key_lengths_and_as_bool_mask(models, rc):
    # MODELS.md: key_padding_mask (True = pad) -> key_lengths when the padding
    # is a suffix, or attn_mask = ~key_padding_mask[:, None, None, :] (BOOL).
    rng = np.random.default_rng(104)
    q, kv = rand(rng, 3, 4, 32), rand(rng, 3, 6, 32)
    lengths = np.array([6, 2, 4])
    kpm = np.arange(6)[None, :] >= lengths[:, None]  # True = padding
    want, want_w = torch_mha(models["mha-bias"], q, kv, kv, key_padding_mask=torch.from_numpy(kpm))
    got = rc.attend(q, kv, kv, model="mha-bias", key_lengths=lengths, need_weights=True,
                    average_weights=True)
    assert_close(got.output, want)
    assert_close(got.weights, want_w, what="weights")
    got = rc.attend(q, kv, kv, model="mha-bias", attn_mask=~kpm[:, None, None, :])
    assert_close(got.output, want)

    # Padding that is not a suffix only fits the BOOL mask.
    kpm = rng.random((3, 6)) < 0.4
    kpm[:, 0] = False  # keep a key per row (torch gives NaN for fully padded rows)
    want, _ = torch_mha(models["mha-bias"], q, kv, kv, key_padding_mask=torch.from_numpy(kpm))
    assert_close(rc.attend(q, kv, kv, model="mha-bias", attn_mask=~kpm[:, None, None, :]).output, want)


def test_mha_float_attn_mask_passes_as_is(models, rc):
    # MODELS.md: a float attn_mask is added to the scores by both: send it
    # unchanged. torch's 3-D [B*H, Lq, Lk] form reshapes to [B, H, Lq, Lk].
    rng = np.random.default_rng(105)
    q, kv = rand(rng, 2, 5, 32), rand(rng, 2, 7, 32)
    mask2d = rand(rng, 5, 7)
    want, _ = torch_mha(models["mha-bias"], q, kv, kv, attn_mask=torch.from_numpy(mask2d).double())
    assert_close(rc.attend(q, kv, kv, model="mha-bias", attn_mask=mask2d).output, want)

    mask3d = rand(rng, 2 * 4, 5, 7)
    want, _ = torch_mha(models["mha-bias"], q, kv, kv, attn_mask=torch.from_numpy(mask3d).double())
    got = rc.attend(q, kv, kv, model="mha-bias", attn_mask=mask3d.reshape(2, 4, 5, 7))
    assert_close(got.output, want)


def test_mha_bool_attn_mask_is_inverted(models, rc):
    # MODELS.md: nn.MultiheadAttention's bool attn_mask is True = masked;
    # attnserve's BOOL is True = may attend: send ~mask.
    rng = np.random.default_rng(106)
    q, kv = rand(rng, 2, 5, 32), rand(rng, 2, 7, 32)
    masked = rng.random((5, 7)) < 0.5
    masked[:, 3] = False
    want, _ = torch_mha(models["mha-bias"], q, kv, kv, attn_mask=torch.from_numpy(masked))
    assert_close(rc.attend(q, kv, kv, model="mha-bias", attn_mask=~masked).output, want)


def test_mha_causal_mask_is_the_causal_flag(models, rc):
    # MODELS.md: torch's upper-triangular causal mask (is_causal) = causal=True.
    rng = np.random.default_rng(107)
    x = rand(rng, 2, 6, 32)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True = masked (future)
    want, _ = torch_mha(models["mha-bias"], x, x, x, attn_mask=causal)
    assert_close(rc.attend(x, model="mha-bias", causal=True).output, want)


@pytest.mark.parametrize("precision,tol", [("bf16", BF16_TOL), ("fp16", FP16_TOL)])
def test_mha_reduced_precision(models, rc, precision, tol):
    name = f"mha-{precision}"
    assert rc.get_model(name).config.precision == precision
    rng = np.random.default_rng(108)
    x = rand(rng, 2, 6, 32)
    want, _ = torch_mha(models[name], x, x, x, need_weights=False)
    for input_dtype in (None, precision):
        got = rc.attend(x, model=name, input_dtype=input_dtype).output
        assert_close(got, want, tol=tol, what=f"{precision} model, {input_dtype or 'fp32'} input")


# ---------------------------------------------------------------------------
# Hugging Face style, fused QKV, Keras

def _linear_weights(module):
    w = {"wq": module.q_proj.weight, "wk": module.k_proj.weight, "wv": module.v_proj.weight,
         "wo": module.o_proj.weight, "bq": module.q_proj.bias, "bk": module.k_proj.bias,
         "bv": module.v_proj.bias, "bo": module.o_proj.bias}
    return {k: (None if t is None else t.detach().numpy()) for k, t in w.items()}


def test_hf_gqa_matches_numpy_reference_and_the_module(models, rc):
    m = models["hf-gqa"]
    rng = np.random.default_rng(200)
    x = rand(rng, 2, 9, 64)
    want, want_p = gqa_reference(x, x, x, _linear_weights(m), num_heads=8, num_kv_heads=2,
                                 head_dim=8)
    with torch.no_grad():
        module_out = f64(m)(torch.from_numpy(x).double()).numpy()
    assert rel_err(want, module_out) < 1e-12  # the NumPy reference is the module
    got = rc.attend(x, model="hf-gqa", need_weights=True)
    assert_close(got.output, want)
    assert_close(got.weights, want_p, what="weights")


def test_hf_additive_and_padding_masks(models, rc):
    # MODELS.md: HF's 2-D attention_mask [B, Lk] (1 = attend) -> key_lengths
    # or a BOOL [B, 1, 1, Lk]; its 4-D additive float mask passes as is.
    m = models["hf-gqa"]
    rng = np.random.default_rng(201)
    x = rand(rng, 2, 7, 64)
    attention_mask = np.array([[1] * 7, [1] * 4 + [0] * 3])
    additive = np.where(attention_mask[:, None, None, :] == 1, 0.0,
                        np.finfo(np.float32).min).astype(np.float32)
    additive = np.broadcast_to(additive, (2, 1, 7, 7)).copy()
    with torch.no_grad():
        want = f64(m)(torch.from_numpy(x).double(), torch.from_numpy(additive).double()).numpy()
    assert_close(rc.attend(x, model="hf-gqa", attn_mask=additive).output, want)
    assert_close(rc.attend(x, model="hf-gqa", key_lengths=attention_mask.sum(1)).output, want)
    assert_close(rc.attend(x, model="hf-gqa",
                           attn_mask=attention_mask[:, None, None, :].astype(bool)).output, want)


def test_narrow_input_no_qkv_bias_biased_output_causal(models, rc):
    m = models["narrow-causal"]
    status = rc.get_model("narrow-causal")
    assert status.config.causal and status.config.query_dim == 20
    assert status.config.num_heads * status.config.head_dim == 32
    assert (status.config.q_bias, status.config.out_bias) == (False, True)
    rng = np.random.default_rng(202)
    x = rand(rng, 2, 6, 20)
    with torch.no_grad():
        want = f64(m)(torch.from_numpy(x).double()).numpy()
    ref, _ = gqa_reference(x, x, x, _linear_weights(m), num_heads=4, num_kv_heads=4, head_dim=8,
                           causal=True)
    assert rel_err(ref, want) < 1e-12
    # The model is causal by configuration: the request need not ask.
    got = rc.attend(x, model="narrow-causal").output
    assert got.shape == (2, 6, 20)
    assert_close(got, want)


def test_scale_by_full_width(models, rc):
    m = models["hf-fullscale"]
    assert rc.get_model("hf-fullscale").config.scale == pytest.approx(32 ** -0.5, rel=1e-7)
    rng = np.random.default_rng(203)
    x = rand(rng, 2, 5, 32)
    with torch.no_grad():
        want = f64(m)(torch.from_numpy(x).double()).numpy()
    assert_close(rc.attend(x, model="hf-fullscale").output, want)


def test_fused_qkv_per_head(models, rc):
    m = models["neox-fused"]
    assert rc.get_model("neox-fused").config.weight_layout == 3  # FUSED_QKV_PER_HEAD
    rng = np.random.default_rng(204)
    x = rand(rng, 2, 8, 48)
    with torch.no_grad():
        want = f64(m)(torch.from_numpy(x).double()).numpy()
    assert_close(rc.attend(x, model="neox-fused").output, want)


def test_one_layer_of_a_many_layer_checkpoint(models, rc):
    m = models["decoder-layer1"]
    status = rc.get_model("decoder-layer1")
    assert status.config.tensor_prefix == "layers.1.self_attn."
    rng = np.random.default_rng(205)
    x = rand(rng, 2, 5, 32)
    with torch.no_grad():
        want = f64(m.layers[1]["self_attn"])(torch.from_numpy(x).double()).numpy()
        other = f64(m.layers[0]["self_attn"])(torch.from_numpy(x).double()).numpy()
    got = rc.attend(x, model="decoder-layer1").output
    assert_close(got, want)
    assert rel_err(got, other) > 1e-2  # really layer 1, not layer 0


def test_keras_layout_with_keras_mask(models, rc):
    # MODELS.md: Keras' attention_mask [B, Lq, Lk] is True = attend, as
    # attnserve's BOOL: add the head axis, [B, 1, Lq, Lk].
    kw = models["keras"]
    rng = np.random.default_rng(206)
    q, v = rand(rng, 2, 4, 12), rand(rng, 2, 6, 12)
    want, want_p = keras_mha_reference(q, v, v, kw, num_heads=3, key_dim=5)
    got = rc.attend(q, v, v, model="keras", need_weights=True)
    assert_close(got.output, want)
    assert_close(got.weights, want_p, what="weights")

    mask = rng.random((2, 4, 6)) < 0.6
    mask[:, :, 0] = True
    want, _ = keras_mha_reference(q, v, v, kw, num_heads=3, key_dim=5, attention_mask=mask)
    assert_close(rc.attend(q, v, v, model="keras", attn_mask=mask[:, None]).output, want)


def test_sdpa_kind_from_the_repository(rc):
    rng = np.random.default_rng(207)
    q, k, v = rand(rng, 2, 4, 3, 8), rand(rng, 2, 2, 5, 8), rand(rng, 2, 2, 5, 6)
    want, _ = harness.reference_attention(q, k, v, causal=True, scale=0.25)
    assert_close(rc.attend(q, k, v, model="sdpa-causal").output, want)


def test_list_and_get_model_report_full_config(models, rc):
    listed = {s.name: s for s in rc.list_models()}
    expected = {"mha-bias", "mha-nobias", "mha-kvdim", "mha-bf16", "mha-fp16", "hf-gqa", "narrow-causal",
                "hf-fullscale", "neox-fused", "decoder-layer1", "keras", "sdpa-causal"}
    assert expected <= set(listed)
    for name in expected:
        assert listed[name].state == 1, f"{name}: {listed[name].reason}"  # READY
    c = rc.get_model("hf-gqa").config
    assert (c.kind, c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim) == ("mha", 64, 8, 2, 8)
    assert (c.query_dim, c.key_dim, c.value_dim, c.out_dim) == (64, 64, 64, 64)
    assert (c.q_bias, c.k_bias, c.v_bias, c.out_bias) == (True, True, True, False)
    assert c.weight_layout == 2 and c.precision == "fp32" and c.backend == "auto"
    c = rc.get_model("mha-kvdim").config
    assert (c.key_dim, c.value_dim, c.weight_layout) == (10, 14, 1)
    c = rc.get_model("keras").config  # written by hand with defaults left out
    assert (c.num_kv_heads, c.query_dim, c.out_dim, c.weight_layout) == (3, 12, 12, 4)


# ---------------------------------------------------------------------------
# The export tool from the command line, on a checkpoint file

def test_export_cli_from_checkpoint_files(tmp_path):
    # A whole pickled module (torch.save(model)): nn.TransformerEncoder's layer 1.
    torch.manual_seed(12)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2).eval()
    torch.save(encoder, tmp_path / "encoder.pt")
    repo = tmp_path / "repo"
    subprocess.run(["/usr/bin/python3", EXPORT, str(repo / "enc1"), "--checkpoint",
                    str(tmp_path / "encoder.pt"), "--module", "layers.1.self_attn"], check=True)
    # A state_dict plus the factory that builds its model.
    torch.save(TinyDecoder().state_dict(), tmp_path / "decoder_sd.pt")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["/usr/bin/python3", EXPORT, str(repo / "dec2"), "--checkpoint",
                    str(tmp_path / "decoder_sd.pt"), "--factory", "checkpoint_models:TinyDecoder",
                    "--module", "layers.2.self_attn", "--full-state-dict", "--causal"],
                   check=True, env=env)
    bad = subprocess.run(["/usr/bin/python3", EXPORT, str(repo / "x"), "--checkpoint",
                          str(tmp_path / "decoder_sd.pt")], capture_output=True, text=True)
    assert bad.returncode == 1 and "not a module" in bad.stderr

    decoder = TinyDecoder()
    decoder.load_state_dict(torch.load(tmp_path / "decoder_sd.pt"))
    server = harness.ServerProcess("--model-repository", str(repo))
    try:
        from attnserve_client import AttentionClient
        with AttentionClient(server.target) as c:
            rng = np.random.default_rng(300)
            x = rand(rng, 2, 5, 16)
            want, _ = torch_mha(encoder.layers[1].self_attn, x, x, x, need_weights=False)
            assert_close(c.attend(x, model="enc1").output, want)
            x = rand(rng, 2, 5, 32)
            attn = f64(decoder.layers[2]["self_attn"])
            attn.is_causal = True
            with torch.no_grad():
                want = attn(torch.from_numpy(x).double()).numpy()
            assert_close(c.attend(x, model="dec2").output, want)
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------------------
# Bad models

def _good_mha_folder(folder, seed=20):
    export_torch.export_module(_mha(seed, 16, 2), str(folder))


def _rewrite_header(path, edit):
    """Rewrites a safetensors header through `edit(dict)`, keeping the data."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _drop_tensor(folder, name):
    tensors = export_torch.read_safetensors(str(folder / "weights.safetensors"))
    del tensors[name]
    export_torch.write_safetensors(str(folder / "weights.safetensors"), tensors)


def _reshape_tensor(folder, name, shape):
    tensors = export_torch.read_safetensors(str(folder / "weights.safetensors"))
    tensors[name] = np.zeros(shape, np.float32)
    export_torch.write_safetensors(str(folder / "weights.safetensors"), tensors)


def _append_config(folder, text):
    with open(folder / "config.pbtxt", "a") as f:
        f.write(text)


def _truncate(folder, keep_bytes_less):
    path = folder / "weights.safetensors"
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) - keep_bytes_less])


def _lie_about_offsets(folder):
    def edit(h):
        begin, end = h["out_proj.weight"]["data_offsets"]
        h["out_proj.weight"]["data_offsets"] = [begin, end + 1000000]
    _rewrite_header(folder / "weights.safetensors", edit)


def _lie_about_size(folder):
    def edit(h):
        begin, end = h["in_proj_bias"]["data_offsets"]
        h["in_proj_bias"]["data_offsets"] = [begin, end - 4]
    _rewrite_header(folder / "weights.safetensors", edit)


def _forget_out_bias_flag(folder):
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace("out_bias: true\n", ""))


# (case, how to break a good folder, words the message must hold)
BAD_MODELS = [
    ("missing-tensor", lambda d: _drop_tensor(d, "out_proj.weight"),
     ["weights.safetensors", "tensor 'out_proj.weight' is missing", "expected shape [16, 16]"]),
    ("wrong-shape", lambda d: _reshape_tensor(d, "in_proj_weight", (48, 15)),
     ["weights.safetensors", "tensor 'in_proj_weight'", "has shape [48, 15]", "expected [48, 16]"]),
    ("unknown-field", lambda d: _append_config(d, "num_layers: 3\n"),
     ["config.pbtxt:", "no field named \"num_layers\""]),
    ("bad-value", lambda d: _append_config(d, "num_kv_heads: 3\n"),
     ["config.pbtxt", "num_kv_heads", "num_heads (2) must be a multiple of num_kv_heads (3)"]),
    ("truncated", lambda d: _truncate(d, 100),
     ["weights.safetensors", "tensor 'out_proj.weight'", "exceeds the data section", "truncated"]),
    ("lying-offsets", _lie_about_offsets,
     ["weights.safetensors", "tensor 'out_proj.weight'", "exceeds the data section"]),
    ("lying-size", _lie_about_size,
     ["weights.safetensors", "tensor 'in_proj_bias'", "span 188 bytes", "expected 192",
      "F32 shape [48]"]),
    ("no-weights", lambda d: os.remove(d / "weights.safetensors"),
     ["weights.safetensors", "cannot open"]),
    ("forgotten-bias-flag", _forget_out_bias_flag,
     ["weights.safetensors", "tensor 'out_proj.bias'", "out_bias is false"]),
]


def _run_server_expecting_failure(repo, *extra):
    proc = subprocess.run([harness.server_bin(), "--address", "127.0.0.1:0", "--http-address",
                           "127.0.0.1:0", "--metrics-address", "127.0.0.1:0", "--model-repository", str(repo), *extra],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("case,breaker,words", BAD_MODELS, ids=[c[0] for c in BAD_MODELS])
def test_bad_model_stops_a_strict_server(tmp_path, case, breaker, words):
    _good_mha_folder(tmp_path / "good")
    folder = tmp_path / case
    _good_mha_folder(folder)
    breaker(folder)
    code, log = _run_server_expecting_failure(tmp_path)
    assert code != 0, f"attnserve started with a bad model:\n{log}"
    assert "listening on" not in log
    assert f"model '{case}'" in log, log
    for w in words:
        assert w in log, f"{w!r} not in:\n{log}"


def test_non_strict_serves_the_rest_and_reports_the_bad_ones(tmp_path):
    for case, breaker, _ in BAD_MODELS:
        _good_mha_folder(tmp_path / case)
        breaker(tmp_path / case)
    good = _mha(20, 16, 2)
    export_torch.export_module(good, str(tmp_path / "good"))
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--strict-model-loading=false")
    try:
        from attnserve_client import AttentionClient
        import grpc
        with AttentionClient(server.target) as c:
            listed = {s.name: s for s in c.list_models()}
            assert listed["good"].state == 1  # READY
            for case, _, words in BAD_MODELS:
                status = c.get_model(case)
                assert status.state == 2, f"{case}: state {status.state}"  # FAILED
                assert listed[case].state == 2
                for w in words:
                    assert w in status.reason, f"{case}: {w!r} not in {status.reason!r}"
                with pytest.raises(grpc.RpcError) as e:
                    c.attend(np.zeros((1, 2, 16), np.float32), model=case)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "not ready" in e.value.details()
            x = np.random.default_rng(400).standard_normal((2, 3, 16)).astype(np.float32)
            want, _ = torch_mha(good, x, x, x, need_weights=False)
            assert_close(c.attend(x, model="good").output, want)
        assert "not ready" in server.log()
        import serving_util
        samples = serving_util.scrape(server)
        def ready(model, backend):
            return samples[("attnserve_model_ready", frozenset({("model", model), ("backend", backend)}))]
        assert ready("good", "cpu") == 1
        for case, _, _ in BAD_MODELS:
            assert ready(case, "") == 0
    finally:
        assert server.stop() == 0


def test_duplicate_and_builtin_names(tmp_path):
    _good_mha_folder(tmp_path / "a")
    _good_mha_folder(tmp_path / "b")
    (tmp_path / "b" / "config.pbtxt").write_text(
        (tmp_path / "b" / "config.pbtxt").read_text().replace('name: "b"', 'name: "a"'))
    code, log = _run_server_expecting_failure(tmp_path)
    assert code != 0 and "model name 'a' is already used by" in log, log
    shutil.rmtree(tmp_path / "b")
    _good_mha_folder(tmp_path / "demo-mha")
    code, log = _run_server_expecting_failure(tmp_path)
    assert code != 0 and "'demo-mha' is already taken" in log, log


def test_missing_repository_directory(tmp_path):
    code, log = _run_server_expecting_failure(tmp_path / "nope")
    assert code != 0 and "not a directory" in log and str(tmp_path / "nope") in log
