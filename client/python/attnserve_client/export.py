"""Exports a PyTorch attention layer as an attnserve model folder
(config.pbtxt + weights.safetensors), so `attnserve --model-repository` serves it.

Recognised modules:
  * torch.nn.MultiheadAttention (layout TORCH_MHA; with or without bias,
    kdim/vdim != embed_dim). add_bias_kv / add_zero_attn are refused.
  * Hugging Face style: q_proj, k_proj, v_proj and o_proj (or out_proj / dense)
    nn.Linear children (layout SEPARATE_QKV; grouped-query heads).
  * One fused linear: `query_key_value` + `dense` (GPT-NeoX / Bloom, output laid
    out per head: layout FUSED_QKV_PER_HEAD; Falcon's multi-query and grouped
    layouts as three projections), or `qkv` + `proj`/`out_proj` with
    qkv_layout="per_head" (reshape [B, L, H, 3*hd]) or "packed" ([q | k | v],
    as timm does: exported as TORCH_MHA), or rows [q | k | v] with
    grouped-query widths: Phi-3's `qkv_proj` + `o_proj`, DBRX's `Wqkv` +
    `out_proj` (exported as the three projections they are, SEPARATE_QKV).
  * Multi-head latent attention (DeepSeek-V2/V3 and the models that copy
    DeepseekV3Attention): kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    and q_proj or q_a_proj + q_a_layernorm + q_b_proj (layout SEPARATE_QKV with
    `latent_attention`, DeepSeek's tensor names).

attnserve is batch first: inputs are [B, L, dim]. A module built with
batch_first=False computes the same function on transposed inputs.

From Python:
    from attnserve_client.export import export_module
    export_module(model, "repo/my-layer", submodule="encoder.layers.0.self_attn", causal=False)

From the shell (`python3 -m attnserve_client.export`, or tools/export_torch.py in a
checkout; the checkpoint is a whole pickled module, torch.save(model), or a
state_dict together with --factory building the module it belongs to):
    python3 -m attnserve_client.export repo/my-layer --checkpoint model.pt --module encoder.layers.0.self_attn
    python3 -m attnserve_client.export repo/my-layer --checkpoint sd.pt --factory mypkg.models:build --module attn
"""

import argparse
import copy
import importlib
import inspect
import json
import math
import os
import re
import struct
import sys

import numpy as np

try:
    import torch
except ImportError:  # write_safetensors still works with numpy arrays
    torch = None

__all__ = ["export_module", "describe_module", "unsupported_features", "write_safetensors",
           "read_safetensors", "write_model_folder", "config_text", "ExportError"]


class ExportError(ValueError):
    """The module cannot be exported as an attnserve layer (the message says why)."""


# ---------------------------------------------------------------------------
# safetensors: 8-byte little-endian header length, JSON header, raw bytes.

_NP_DTYPES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16"}


def _tensor_bytes(value):
    """(dtype name, shape, little-endian bytes) of a torch tensor or numpy array."""
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            # numpy has no bfloat16: the raw 16-bit patterns carry it.
            return "BF16", list(t.shape), t.view(torch.int16).numpy().astype("<i2").tobytes()
        value = t.numpy()
    a = np.ascontiguousarray(value)
    if a.dtype not in _NP_DTYPES:
        raise ExportError(f"cannot store dtype {a.dtype} (use float32, float16 or bfloat16)")
    return _NP_DTYPES[a.dtype], list(a.shape), a.astype(a.dtype.newbyteorder("<")).tobytes()


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor or array} to `path` (F32, F16 or BF16)."""
    header, chunks, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        dtype, shape, data = _tensor_bytes(tensors[name])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % 8)  # data starts 8-aligned, as other writers do
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for chunk in chunks:
            f.write(chunk)


def read_safetensors(path):
    """{name: float32 numpy array} of a file written by write_safetensors."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        chunk = data[begin:end]
        if info["dtype"] == "F32":
            a = np.frombuffer(chunk, "<f4")
        elif info["dtype"] == "F16":
            a = np.frombuffer(chunk, "<f2").astype(np.float32)
        elif info["dtype"] == "BF16":
            a = (np.frombuffer(chunk, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ExportError(f"{path}: tensor {name!r}: dtype {info['dtype']} not supported")
        out[name] = a.reshape(info["shape"]).astype(np.float32)
    return out


# ---------------------------------------------------------------------------
# config.pbtxt (text format of attnserve.v1.ModelConfig)

_ENUM_FIELDS = {"weight_layout"}
_FIELD_ORDER = ["name", "kind", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "query_dim",
                "key_dim", "value_dim", "out_dim", "q_bias", "k_bias", "v_bias", "out_bias",
                "weight_layout", "tensor_prefix", "tensor_names", "scale", "causal", "precision",
                "batching", "instances", "backend", "rope", "qk_norm", "sliding_window", "softcap",
                "sinks", "output_gate", "attention_chunk", "temperature_tuning",
                "latent_attention", "clip_qkv", "v_norm", "kv_source", "sparse_index_topk",
                "alibi_slopes", "relative_bias_distance", "relative_embeddings"]


def _scalar(field, value):
    if field in _ENUM_FIELDS:
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        # Shortest text that reads back as the same float32 (`scale` is a float).
        return str(np.float32(value)) if value else "0"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a valid text-format string literal for plain text


def _rope_scalar(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def config_text(config):
    """A ModelConfig dict -> text format. Only non-default fields are written."""
    lines = ["# attnserve model config (attnserve.v1.ModelConfig, text format); see docs/MODELS.md"]
    unknown = set(config) - set(_FIELD_ORDER)
    if unknown:
        raise ExportError(f"unknown ModelConfig fields {sorted(unknown)}")
    for field in _FIELD_ORDER:
        value = config.get(field)
        if value is None or value == "" or value == {} or (value is False and field != "causal"):
            continue
        if field == "tensor_names":
            for role in sorted(value):
                lines.append(f"tensor_names {{ key: {json.dumps(role)} value: {json.dumps(value[role])} }}")
        elif field == "batching":
            inner = " ".join(f"{k}: {int(v)}" for k, v in sorted(value.items()) if v)
            if inner:
                lines.append(f"batching {{ {inner} }}")
        elif field == "alibi_slopes":  # repeated float: one per query head
            lines.append(f"{field}: [{', '.join(repr(float(np.float32(x))) for x in value)}]")
        elif field in ("rope", "qk_norm", "output_gate", "temperature_tuning",
                       "latent_attention", "v_norm", "relative_embeddings"):
            # Floats as repr (shortest round-trip double): theta and factors are doubles.
            inner = " ".join(f"{k}: {json.dumps(v) if isinstance(v, str) else _rope_scalar(v)}"
                             for k, v in value.items() if v is not None)
            lines.append(f"{field} {{ {inner} }}")
        else:
            lines.append(f"{field}: {_scalar(field, value)}")
    return "\n".join(lines) + "\n"


def write_model_folder(folder, config, tensors, metadata=None):
    """Writes folder/config.pbtxt and folder/weights.safetensors."""
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "weights.safetensors"), tensors, metadata)
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write(config_text(config))


# ---------------------------------------------------------------------------
# Module -> (config, tensors)

def _first_attr(module, names):
    for n in names:
        v = getattr(module, n, None)
        if v is not None:
            return v
    cfg = getattr(module, "config", None)  # Hugging Face modules keep a config
    for n in names:
        v = getattr(cfg, n, None) if cfg is not None else None
        if v is not None:
            return v
    return None


def _linear(module, name):
    child = getattr(module, name, None)
    if child is not None and isinstance(child, torch.nn.Linear):
        return child
    return None


def _describe_mha(m):
    if m.bias_k is not None or m.bias_v is not None:
        raise ExportError("nn.MultiheadAttention(add_bias_kv=True) appends learned key/value "
                          "rows; attnserve does not serve that")
    if m.add_zero_attn:
        raise ExportError("nn.MultiheadAttention(add_zero_attn=True) is not supported by attnserve")
    tensors = {}
    if m._qkv_same_embed_dim:
        tensors["in_proj_weight"] = m.in_proj_weight
    else:
        tensors["q_proj_weight"] = m.q_proj_weight
        tensors["k_proj_weight"] = m.k_proj_weight
        tensors["v_proj_weight"] = m.v_proj_weight
    has_in_bias = m.in_proj_bias is not None
    if has_in_bias:
        tensors["in_proj_bias"] = m.in_proj_bias
    tensors["out_proj.weight"] = m.out_proj.weight
    has_out_bias = m.out_proj.bias is not None
    if has_out_bias:
        tensors["out_proj.bias"] = m.out_proj.bias
    config = dict(kind="mha", embed_dim=m.embed_dim, num_heads=m.num_heads,
                  head_dim=m.head_dim, query_dim=m.embed_dim, key_dim=m.kdim, value_dim=m.vdim,
                  out_dim=m.embed_dim, q_bias=has_in_bias, k_bias=has_in_bias, v_bias=has_in_bias,
                  out_bias=has_out_bias, weight_layout="TORCH_MHA")
    return config, tensors


def _heads(module, num_heads, num_kv_heads, head_dim, q_out):
    """Resolves (heads, kv heads, head_dim) from arguments, then the module's
    attributes (and its Hugging Face config)."""
    h = num_heads or _first_attr(module, ["num_heads", "n_heads", "num_attention_heads", "n_head"])
    hd = head_dim or _first_attr(module, ["head_dim", "head_size", "attention_head_size"])
    if h is None and hd:
        h = q_out // hd
    if h is None:
        raise ExportError("cannot tell the number of heads: pass num_heads=")
    h = int(h)
    hd = int(hd) if hd else q_out // h
    if h * hd != q_out:
        raise ExportError(f"num_heads {h} * head_dim {hd} != query projection width {q_out}")
    hkv = num_kv_heads or _first_attr(module, ["num_key_value_heads", "num_kv_heads", "n_kv_heads"])
    return h, (int(hkv) if hkv else None), hd


def _scale_of(module, head_dim):
    """A module's own softmax scale when it differs from 1/sqrt(head_dim)."""
    s = _first_attr(module, ["scaling", "scale", "softmax_scale"])
    if isinstance(s, (float, int)) and not isinstance(s, bool) and s > 0:
        if not math.isclose(float(s), 1.0 / math.sqrt(head_dim), rel_tol=1e-7):
            return float(s)
    return None


class _Rows:
    """Rows [start, stop) of a linear that packs several projections (or the
    rows `index` lists), as a Linear of its own (weight, bias, in_features,
    out_features)."""

    def __init__(self, linear, start=None, stop=None, index=None):
        rows = slice(start, stop) if index is None else torch.as_tensor(index)
        self.weight = linear.weight[rows]
        self.bias = linear.bias[rows] if linear.bias is not None else None
        self.in_features, self.out_features = linear.in_features, self.weight.shape[0]


def _describe_falcon(module, qkv, num_heads, head_dim):
    """Falcon's query_key_value, in each of its three layouts (transformers'
    FalconAttention._split_heads): with new_decoder_architecture (Falcon-40B,
    180B) a group of rows per KV head, [its queries | its key | its value];
    with multi_query (Falcon-7B) [every query | one key | one value]; else
    [q_h | k_h | v_h] per head. The first two are exported as the three
    projections they are, the third as FUSED_QKV_PER_HEAD."""
    config = getattr(module, "config", None)
    o = _linear(module, "dense")
    if o is None:
        raise ExportError("module has query_key_value but no dense output linear")
    h = int(num_heads or module.num_heads)
    hd = int(head_dim or module.head_dim)
    if _config_value(config, "new_decoder_architecture"):
        hkv = int(module.num_kv_heads)
        group = h // hkv

        def rows(g, i):  # the i-th head_dim rows of KV head g's group
            return range((g * (group + 2) + i) * hd, (g * (group + 2) + i + 1) * hd)
        q = [r for g in range(hkv) for i in range(group) for r in rows(g, i)]
        k = [r for g in range(hkv) for r in rows(g, group)]
        v = [r for g in range(hkv) for r in rows(g, group + 1)]
    elif _config_value(config, "multi_query"):
        hkv = 1
        q, k, v = list(range(h * hd)), list(range(h * hd, (h + 1) * hd)), \
            list(range((h + 1) * hd, (h + 2) * hd))
    else:
        return _describe_fused(module, qkv, "query_key_value", o, "dense", True, h, hd)
    if qkv.out_features != (h + 2 * hkv) * hd:
        raise ExportError(f"query_key_value has {qkv.out_features} outputs, not (num_heads {h} "
                          f"+ 2 * num_kv_heads {hkv}) * head_dim {hd}")
    parts = (_Rows(qkv, index=index) for index in (q, k, v))
    return _describe_separate(module, *parts, o, "dense", h, hkv, hd)


def _describe_separate(m, q, k, v, o, out_name, num_heads, num_kv_heads, head_dim):
    h, hkv, hd = _heads(m, num_heads, num_kv_heads, head_dim, q.out_features)
    if hkv is None:
        hkv = k.out_features // hd
    if k.out_features != hkv * hd or v.out_features != hkv * hd:
        raise ExportError(f"k_proj/v_proj widths {k.out_features}/{v.out_features} != "
                          f"num_kv_heads {hkv} * head_dim {hd}")
    tensors = {"q_proj.weight": q.weight, "k_proj.weight": k.weight, "v_proj.weight": v.weight,
               f"{out_name}.weight": o.weight}
    for prefix, lin in (("q_proj", q), ("k_proj", k), ("v_proj", v), (out_name, o)):
        if lin.bias is not None:
            tensors[f"{prefix}.bias"] = lin.bias
    names = {}
    if out_name != "o_proj":
        names = {"out_weight": f"{out_name}.weight", "out_bias": f"{out_name}.bias"}
    config = dict(kind="mha", embed_dim=q.in_features, num_heads=h, num_kv_heads=hkv, head_dim=hd,
                  query_dim=q.in_features, key_dim=k.in_features, value_dim=v.in_features,
                  out_dim=o.out_features, q_bias=q.bias is not None, k_bias=k.bias is not None,
                  v_bias=v.bias is not None, out_bias=o.bias is not None,
                  weight_layout="SEPARATE_QKV", tensor_names=names)
    return config, tensors


def _describe_fused(m, qkv, qkv_name, o, out_name, per_head, num_heads, head_dim):
    if qkv.out_features % 3:
        raise ExportError(f"{qkv_name} has {qkv.out_features} outputs, not a multiple of 3")
    h, hkv, hd = _heads(m, num_heads, None, head_dim, qkv.out_features // 3)
    if hkv not in (None, h):
        raise ExportError("a fused QKV linear with grouped-query heads is not supported")
    tensors = {f"{qkv_name}.weight": qkv.weight, f"{out_name}.weight": o.weight}
    if qkv.bias is not None:
        tensors[f"{qkv_name}.bias"] = qkv.bias
    if o.bias is not None:
        tensors[f"{out_name}.bias"] = o.bias
    has_bias = qkv.bias is not None
    config = dict(kind="mha", embed_dim=qkv.in_features, num_heads=h, head_dim=hd,
                  query_dim=qkv.in_features, key_dim=qkv.in_features, value_dim=qkv.in_features,
                  out_dim=o.out_features, q_bias=has_bias, k_bias=has_bias, v_bias=has_bias,
                  out_bias=o.bias is not None)
    if per_head:
        config["weight_layout"] = "FUSED_QKV_PER_HEAD"
        config["tensor_names"] = {"qkv_weight": f"{qkv_name}.weight", "qkv_bias": f"{qkv_name}.bias",
                                  "out_weight": f"{out_name}.weight", "out_bias": f"{out_name}.bias"}
    else:
        # [q | k | v] blocks: exactly nn.MultiheadAttention's packed in_proj.
        config["weight_layout"] = "TORCH_MHA"
        config["tensor_names"] = {"in_proj_weight": f"{qkv_name}.weight",
                                  "in_proj_bias": f"{qkv_name}.bias",
                                  "out_weight": f"{out_name}.weight", "out_bias": f"{out_name}.bias"}
    return config, tensors


def _config_value(config, name):
    """A Hugging Face config's field, or None."""
    return getattr(config, name, None) if config is not None else None


def _model_type(module):
    """The module's Hugging Face model type: its config's, or for a
    transformers class that keeps no config (BLOOM's and MPT's attention in
    transformers 4.x), the model folder its class is defined in."""
    model_type = _config_value(getattr(module, "config", None), "model_type")
    if model_type is None:
        found = re.match(r"transformers\.models\.(\w+)\.modeling_", type(module).__module__)
        model_type = found.group(1) if found else None
    return model_type


# Model types whose attention rotates Q and K as attnserve does: rotate-half
# pairs (i, i + d/2), except GPT-J style interleaved pairs (2i, 2i+1). Each
# is checked against transformers' own class (tests/hf). A module with rotary
# embeddings from any other model type is refused: some rotate in other ways,
# and PhiMoE's LongRoPE is not Phi-3's.
_ROPE_INTERLEAVED = {"llama": False, "mistral": False, "mixtral": False, "qwen2": False,
                     "qwen3": False, "gemma": False, "gemma2": False, "gemma3": False,
                     "gemma3_text": False, "phi3": False, "gpt_neox": False, "olmo": False,
                     "olmo2": False, "olmo3": False, "starcoder2": False, "gpt_oss": False,
                     "modernbert": False, "eurobert": False, "nomic_bert": False,
                     "gptj": True, "codegen": True, "falcon": False,
                     # MoE and other variants of the attention above
                     "qwen2_moe": False, "qwen3_moe": False, "olmoe": False, "flex_olmo": False,
                     "granite": False, "granitemoe": False, "glm4_moe": False,
                     "seed_oss": False, "arcee": False, "dots1": False, "apertus": False,
                     "ministral": False, "ministral3": False, "nemotron": False,
                     "vaultgemma": False,
                     "dbrx": False,
                     # rotate-half over a quarter of each head; qk_layernorm:
                     # LayerNorm per head, one norm each (StableLM 2)
                     "stablelm": False,
                     # interleaved pairs over the rotary part
                     "glm": True, "glm4": True, "ernie4_5": True, "ernie4_5_moe": True,
                     "helium": True, "cohere": True,
                     # RoPE on some layers only (_rope_skipped)
                     "cohere2": True, "smollm3": False, "exaone4": False,
                     # QK-norm after RoPE, NTK-alpha RoPE (a stretched theta)
                     "hunyuan_v1_dense": False, "hunyuan_v1_moe": False,
                     # gated attention (_OUTPUT_GATES); Qwen3.5's multimodal
                     # RoPE is the plain one for text (one position per token)
                     "qwen3_next": False, "qwen3_5_text": False, "qwen3_5_moe_text": False,
                     "afmoe": False,
                     # complex multiplication: pairs (2i, 2i+1); RoPE on three
                     # layers of four (_rope_skipped)
                     "llama4_text": True,
                     # QK-norm x * w, a weightless norm of V (v_norm_config);
                     # Gemma 4's proportional RoPE on its full layers
                     # (_proportional_angles)
                     "gemma3n_text": False, "gemma4_text": False, "embedding_gemma2_text": False,
                     # attention layers of hybrid models: Bamba (rotate-half
                     # over partial_rotary_factor), Falcon-H1 (keys times
                     # key_multiplier, folded into k_proj: _KEY_MULTIPLIED),
                     # LFM2 (QK-norm per head), MiniMax's full layers,
                     # MiniMax-M2 (QK-norm over the projection, partial),
                     # OLMo-Hybrid and Granite 4 (RoPE only when configured:
                     # _rope_skipped)
                     "bamba": False, "falcon_h1": False, "lfm2": False, "lfm2_moe": False,
                     "minimax": False, "minimax_m2": False, "olmo_hybrid": False,
                     "granitemoehybrid": False}
# Model types whose keys are multiplied by a scalar, the module's
# key_multiplier, after k_proj and before RoPE (Falcon-H1): folded into
# k_proj's weight and bias, the same product.
_KEY_MULTIPLIED = {"falcon_h1"}
# Gated attention: the model types whose attention output is multiplied by
# sigmoid of a projection of the layer's input (elementwise, before o_proj),
# and where that projection is: "query_per_head", inside q_proj (each head's
# query rows, then its gate rows: Qwen3-Next, Qwen3.5), or "separate", a
# gate_proj linear (AFMoE). Checked against transformers' own classes.
_OUTPUT_GATES = {"qwen3_next": "query_per_head", "qwen3_5_text": "query_per_head",
                 "qwen3_5_moe_text": "query_per_head", "afmoe": "separate"}
_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}
# Model types whose rotary class computes its "default" frequencies over the
# whole head, whatever partial_rotary_factor says (their own
# compute_default_rope_parameters).
_DEFAULT_ROPE_WHOLE_HEAD = {"gemma3n_text", "gemma4_text", "embedding_gemma2_text"}
# Model types whose "proportional" RoPE (Gemma 4's full layers) is served by
# a rewrite of Q's and K's features (_proportional_angles).
_PROPORTIONAL_ROPE = {"gemma4_text"}
# Model types whose `v_norm` (RMSNorm of each value head without a weight)
# is checked against transformers' own classes (tests/hf).
_V_NORM_TYPES = {"gemma3n_text", "gemma4_text", "embedding_gemma2_text"}
# Model types whose layers have dims of their own (Gemma 4's full layers),
# read from each module's head_dim and linears.
_DIMS_PER_LAYER = {"gemma4_text", "embedding_gemma2_text"}


# Model types whose attention computes something attnserve does not (yet),
# and what: refused by name before anything else is read.
_NOT_COMPUTED = {
    "phimoe": "PhiMoE's rotary embedding, whose LongRoPE long factors transformers never "
              "applies (it rotates with the short ones at every length and scales by "
              "long_mscale past the training context)",
}


# Multi-head latent attention (transformers' DeepseekV3Attention and the
# classes that copy it) by model type, and how each pairs its rotary
# features: True, (2i, 2i+1) (DeepSeek-V2's complex product, LongCat-Flash);
# False, (i, i + d/2) (MiniCPM3); "rope_interleave", as the config's flag
# says, True by default (DeepSeek-V3 and its copies: the interleaved path
# returns the rotated pairs de-interleaved, in Q and K alike, which changes
# no score); None, no RoPE (Kimi Linear's latent layers). Each is checked
# against transformers' own class (tests/hf/current_transformers.py).
_LATENT_ROPE = {"deepseek_v2": True, "deepseek_v3": "rope_interleave",
                "glm4_moe_lite": "rope_interleave", "youtu": "rope_interleave",
                "axk1": "rope_interleave", "mistral4": "rope_interleave",
                "longcat_flash": True, "minicpm3": False, "kimi_linear": None,
                "deepseek_v32": True, "glm_moe_dsa": True}
# Model types whose DSA indexer keeps each query's top min(index_topk, keys)
# keys (transformers' topk, then a mask of the rest): with at most
# index_topk keys every key is kept, dense attention; exported with
# sparse_index_topk, and the server refuses longer requests.
_DSA_DENSE_UP_TO = {"deepseek_v32", "glm_moe_dsa"}
# The children a latent layer has (DeepSeek's names); any other is refused,
# named, with what it computes where known.
_LATENT_CHILDREN = {"q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                    "kv_a_layernorm", "kv_b_proj", "o_proj", "rotary_emb"}
_LATENT_EXTRAS = {
    "indexer": "a sparse-attention indexer (DeepSeek-V3.2's DSA: each query attends to the "
               "top-k keys its indexer picks)",
    "g_proj": "a gate on the attention output (g_proj, one sigmoid per head)",
    "gate_proj": "a gate on the attention output (gate_proj)",
    "q_gate_proj": "a gate on the attention output (q_gate_proj, inside the query's "
                   "projection)",
    "k_rope_only_layernorm": "an RMSNorm of the rotary key (k_rope_only_layernorm)",
    "softmax_scaling": "a query scaling by position (softmax_scaling)",
}
# Scalars by which a latent layer multiplies its query, or its normalised
# key/value latent (LongCat-Flash's sqrt(hidden / rank)): folded into the
# weights that produce them (q_b_proj or q_proj; kv_a_layernorm), which is
# the same product.
_LATENT_SCALES = {"query": ("mla_scale_q_lora", "q_lora_scale"),
                  "kv": ("mla_scale_kv_lora", "kv_lora_scale")}


def _rope_skipped(module, config, model_type):
    """Whether this layer of a model that rotates on some layers only skips
    RoPE (NoPE layers), by the model's own rule: Cohere2 and EXAONE 4 rotate
    on their sliding-window layers only (EXAONE 4 on all when it has no
    window), SmolLM3 where config.no_rope_layers says (the module's
    use_rope), AFMoE on its local layers (is_local_attention), Llama 4 where
    config.no_rope_layers says (its use_rope)."""
    if model_type == "cohere2":
        return getattr(module, "sliding_window", None) is None
    if model_type == "exaone4":
        return bool(_config_value(config, "sliding_window")) and \
            not getattr(module, "is_sliding", False)
    if model_type == "smollm3":
        return not getattr(module, "use_rope", True)
    if model_type == "afmoe":  # RoPE on its local (sliding-window) layers only
        return not getattr(module, "is_local_attention", True)
    if model_type == "llama4_text":  # config.no_rope_layers: the module's use_rope
        return not getattr(module, "use_rope", True)
    if model_type == "granitemoehybrid":  # its model builds a rotary class for "rope" only
        return _config_value(config, "position_embedding_type") != "rope"
    if model_type == "olmo_hybrid":  # its model rotates only with a rope_theta
        return not (_config_value(config, "rope_parameters") or {}).get("rope_theta")
    if model_type in _LATENT_ROPE and _LATENT_ROPE[model_type] is None:
        return True  # Kimi Linear's latent attention: no RoPE at all
    return False


def _rope_interleaved(config, model_type):
    """Whether `model_type` rotates pairs (2i, 2i+1) (True) or (i, i + d/2)."""
    if model_type in _ROPE_INTERLEAVED:
        return _ROPE_INTERLEAVED[model_type]
    pairing = _LATENT_ROPE[model_type]
    if pairing == "rope_interleave":  # DeepSeek-V3: the config's flag, True by default
        return _config_value(config, "rope_interleave") is not False
    return pairing


def _has_rope(module, config):
    if _config_value(config, "model_type") in _ALIBI and _config_value(config, "alibi") is True:
        return False  # Falcon with ALiBi: its config keeps a rope_theta it does not use
    return (getattr(module, "rotary_emb", None) is not None or
            any(_config_value(config, n) is not None for n in (
                "rope_theta", "rope_scaling", "rope_parameters", "rotary_pct", "rotary_dim",
                "partial_rotary_factor", "rotary_emb_base")) or
            _config_value(config, "position_embedding_type") == "rotary")


def rope_config(module, head_dim):
    """The `rope` of an attnserve ModelConfig for `module`'s rotary position
    embeddings, read from its Hugging Face config as transformers' rope
    utilities read it (4.x: rope_theta/rope_scaling/partial_rotary_factor or
    rotary_pct; 5.x: rope_parameters); None when it has none. Gemma 4's
    proportional RoPE is written as the rotate-half it is on Q and K features
    reordered by describe_module (_proportional_rope). ExportError naming
    what attnserve cannot compute (a scaling type, a model type whose
    rotation layout is unknown)."""
    config = getattr(module, "config", None)
    if not _has_rope(module, config):
        return None
    model_type = _config_value(config, "model_type")
    if model_type not in _ROPE_INTERLEAVED and model_type not in _LATENT_ROPE:
        raise ExportError(f"rotary position embeddings of model type {model_type!r}, whose "
                          "feature pairing attnserve does not know (known: "
                          f"{', '.join(sorted(_ROPE_INTERLEAVED))})")
    if _rope_skipped(module, config, model_type):
        return None
    params = _layer_rope_parameters(module, config)
    kind = params.get("rope_type") or params.get("type") or "default"
    # DBRX in transformers 4.x keeps its theta in attn_config (5.x in
    # rope_parameters, which its rotary class reads).
    theta = params.get("rope_theta") or _config_value(config, "rope_theta") or \
        _config_value(config, "rotary_emb_base") or \
        _config_value(_config_value(config, "attn_config"), "rope_theta") or 10000.0
    if kind == "proportional" and model_type in _PROPORTIONAL_ROPE:
        return _proportional_rope(params, theta, head_dim)
    if model_type.startswith("hunyuan") and kind == "dynamic" and params.get("alpha"):
        # Hunyuan's "dynamic" with a fixed alpha only stretches the base:
        # theta * alpha^(d / (d - 2)) over the whole head, whatever the length.
        theta = theta * float(params["alpha"]) ** (head_dim / (head_dim - 2))
        kind = "default"
    if kind not in _ROPE_TYPES:
        raise ExportError(f"RoPE scaling type {kind!r} (attnserve computes "
                          f"{', '.join(sorted(_ROPE_TYPES))})")
    partial = (params.get("partial_rotary_factor") or
               _config_value(config, "partial_rotary_factor") or
               _config_value(config, "rotary_pct") or 1.0)
    if kind == "default" and model_type in _DEFAULT_ROPE_WHOLE_HEAD:
        partial = 1.0
    rotary_dim = _config_value(config, "rotary_dim") if model_type in ("gptj", "codegen") else None
    rope = dict(type=kind, theta=float(theta),
                rotary_dim=int(rotary_dim or int(head_dim * partial)),
                interleaved=_rope_interleaved(config, model_type))
    return _scaled_rope(rope, params, config)


def _layer_rope_parameters(module, config):
    """The RoPE parameters of `module`'s layer: rope_parameters (transformers
    5.x: those of the module's layer type where there is one set per type),
    with rope_scaling's (4.x) where they do not say."""
    params = dict(_config_value(config, "rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        # transformers 5.x (Gemma3): one set per layer type; the module's
        # layer (layer_idx in config.layer_types) picks its own.
        per_type = sorted(k for k, v in params.items() if isinstance(v, dict))
        layer = getattr(module, "layer_idx", None)
        types = _config_value(config, "layer_types")
        if layer is None or not types or layer >= len(types) or \
                not isinstance(params.get(types[layer]), dict):
            raise ExportError("RoPE parameters per layer type (transformers 5.x rope_parameters "
                              f"keyed by {per_type}) for a module that does not say its layer "
                              "type (layer_idx into config.layer_types)")
        params = dict(params[types[layer]])
    scaling = dict(_config_value(config, "rope_scaling") or {})
    params.update({k: v for k, v in scaling.items() if k not in params})
    return params


def _rotated_pairs(params, head_dim):
    """Gemma 4's proportional RoPE (transformers'
    _compute_proportional_rope_parameters): the number of pairs (i, i +
    head_dim/2) that rotate, int(partial_rotary_factor * head_dim // 2), the
    first ones, with frequencies theta^(-2i/head_dim) / factor; the others
    have frequency 0 and do not rotate."""
    return int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)


def _proportional_angles(module, head_dim):
    """_rotated_pairs of a module's layer with proportional RoPE, None for
    a layer without it."""
    config = getattr(module, "config", None)
    model_type = _config_value(config, "model_type")
    if model_type not in _PROPORTIONAL_ROPE or not _has_rope(module, config) or \
            _rope_skipped(module, config, model_type):
        return None
    params = _layer_rope_parameters(module, config)
    if (params.get("rope_type") or params.get("type")) != "proportional":
        return None
    return _rotated_pairs(params, head_dim)


def _proportional_rope(params, theta, head_dim):
    """The `rope` that serves proportional RoPE on Q and K whose features are
    reordered rotated pairs first (_rotary_first): rotate-half over the first
    2 * angles features, theta' = theta^(2 * angles / head_dim) so that
    theta'^(-2i / (2 * angles)) = theta^(-2i / head_dim), its factor as
    "linear"; None when no pair rotates."""
    angles = _rotated_pairs(params, head_dim)
    if angles <= 0:
        return None
    factor = float(params.get("factor", 1.0))
    rope = dict(type="default" if factor == 1.0 else "linear",
                theta=float(theta) ** (2 * angles / head_dim), rotary_dim=2 * angles,
                interleaved=False)
    if factor != 1.0:
        rope["factor"] = factor
    return rope


def _rotary_first(head_dim, angles):
    """Each head's feature order with proportional RoPE's rotated pairs (i,
    i + head_dim/2), i < angles, first: [0..angles-1, half..half+angles-1,
    then the rest in order]."""
    half = head_dim // 2
    return [*range(angles), *range(half, half + angles), *range(angles, half),
            *range(half + angles, head_dim)]


def _permuted_heads(tensor, order):
    """tensor [heads * head_dim (, in)] (or [head_dim]) with each head's rows
    in `order`."""
    t = tensor.detach()
    return t.reshape(-1, len(order), *t.shape[1:])[:, order].reshape(t.shape)


def _scaled_rope(rope, params, config):
    """`rope` with the fields of its scaling type, from `params`."""
    kind = rope["type"]
    max_positions = _config_value(config, "max_position_embeddings")
    if kind == "yarn" and params.get("factor") is None and max_positions and \
            params.get("original_max_position_embeddings"):
        # transformers 5.x (DeepSeek-V3's configs): the context's extension.
        params["factor"] = max_positions / params["original_max_position_embeddings"]
    if kind in ("linear", "llama3", "yarn"):
        rope["factor"] = float(params["factor"])
    if kind == "llama3":
        rope["low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        rope["high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
        rope["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    if kind == "yarn":
        factor = rope["factor"]
        rope["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or max_positions)
        rope["beta_fast"] = float(params.get("beta_fast") or 32)
        rope["beta_slow"] = float(params.get("beta_slow") or 1)

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            if params.get("mscale") and params.get("mscale_all_dim"):
                attention_factor = mscale(factor, params["mscale"]) / \
                    mscale(factor, params["mscale_all_dim"])
            else:
                attention_factor = mscale(factor)
        rope["attention_factor"] = float(attention_factor)
        if params.get("truncate") is False:
            rope["no_truncate"] = True
    if kind == "longrope":
        # Phi-3.5 / Phi-4-mini: transformers 4.x keeps the training context
        # on the config, 5.x in rope_parameters; the factor defaults to the
        # context's extension (max_position_embeddings over it).
        original = params.get("original_max_position_embeddings") or \
            _config_value(config, "original_max_position_embeddings")
        if not original:
            raise ExportError("RoPE scaling type 'longrope' without "
                              "original_max_position_embeddings")
        factor = params.get("factor") or (max_positions / original if max_positions else None)
        if factor is None:
            raise ExportError("RoPE scaling type 'longrope' without a factor or "
                              "max_position_embeddings")
        factor = float(factor)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else \
                math.sqrt(1 + math.log(factor) / math.log(original))
        rope.update(factor=factor, original_max_position_embeddings=int(original),
                    attention_factor=float(attention_factor))
        for name in ("short_factor", "long_factor"):
            if not params.get(name):
                raise ExportError(f"RoPE scaling type 'longrope' without its {name}")
            rope[name] = [float(f) for f in params[name]]
            if len(rope[name]) != rope["rotary_dim"] // 2:
                raise ExportError(f"RoPE {name} has {len(rope[name])} values, not rotary_dim / "
                                  f"2 = {rope['rotary_dim'] // 2}")
    return rope


def _qk_norms(module):
    """(Q's norm, K's norm, after RoPE?) of a module: its `q_norm` and
    `k_norm` children (StableLM's, Phi's and Persimmon's `q_layernorm` and
    `k_layernorm`), applied before RoPE, or Hunyuan's `query_layernorm` and
    `key_layernorm`, applied after it, or Llama 4's one weightless `qk_norm`
    for both, after it too; (None, None, False) without."""
    q, k = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if q is None and k is None:
        q, k = getattr(module, "q_layernorm", None), getattr(module, "k_layernorm", None)
    if q is None and k is None:
        q, k = getattr(module, "query_layernorm", None), getattr(module, "key_layernorm", None)
        if q is not None or k is not None:
            return q, k, True
        shared = getattr(module, "qk_norm", None)
        if isinstance(shared, torch.nn.Module):  # Llama 4: one weightless norm after RoPE
            return shared, shared, True
    return q, k, False


def _norm_computes(norm, eps, x, weight):
    """(subtract_mean, weight_offset) of the QK-norm form `norm` computes on
    probe x, over x's last dim with `weight` (broadcast over the rest), in
    float64: RMSNorm x / sqrt(mean(x^2) + eps) or LayerNorm without a bias
    (x - mean) / sqrt(var + eps), times weight or (1 + weight); None for
    none of them."""
    dtype = x.dtype
    with torch.no_grad():
        got = norm(x).double()
    x = x.double()
    rtol = 1e-3 if dtype in (torch.float32, torch.float64) else 2e-2
    for subtract_mean in (False, True):
        centred = x - x.mean(-1, keepdim=True) if subtract_mean else x
        normed = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)
        for offset in (False, True):
            want = normed * (1 + weight if offset else weight)
            if got.shape == want.shape and torch.allclose(got, want, rtol=rtol, atol=1e-5):
                return subtract_mean, offset
    return None


def _norm_form(norm, eps, x, weight):
    """Whether `norm` computes RMSNorm x * (1 + weight) (True) or
    x * weight (False) on probe x; ExportError for neither."""
    form = _norm_computes(norm, eps, x.flatten(), weight.flatten())
    if form is None or form[0]:
        raise ExportError(f"QK-norm {type(norm).__name__} computes neither RMSNorm x * w nor "
                          "x * (1 + w)")
    return form[1]


def _qk_norm_parts(norm):
    """The modules of a QK-norm that compute it: the norm itself, or its
    `norms`, one per head (StableLM's StableLmLayerNormPerHead)."""
    per_head = getattr(norm, "norms", None)
    return list(per_head) if isinstance(per_head, torch.nn.ModuleList) else [norm]


def _qk_norm_weight(norm):
    """A QK-norm's weight: its own, or its per-head norms' stacked into
    [heads, head_dim] (as Cohere stores its own); None without one."""
    parts = _qk_norm_parts(norm)
    if parts == [norm]:
        return getattr(norm, "weight", None)
    weights = [getattr(part, "weight", None) for part in parts]
    if any(w is None or w.dim() != 1 for w in weights) or len({w.shape for w in weights}) != 1:
        raise ExportError(f"QK-norm {type(norm).__name__} whose per-head norms do not each hold "
                          "a weight of one head's width")
    return torch.stack([w.detach() for w in weights])


def _qk_norm_form(norm, eps):
    """(subtract_mean, weight_offset) of a QK-norm module with a weight: what
    it computes over the last dim of probes shaped as its weight (one head, a
    whole projection, or [heads, head_dim], each head with its own weights;
    per-head norms each on one head), one of unit scale and one whose mean
    of squares is eps, so that another eps shows. Zero-centred weights
    (Gemma's 1 + w) and a subtracted mean (Cohere's LayerNorm) are told apart
    by these numbers, not by names. ExportError naming the norm for a bias
    or for any other form."""
    forms = set()
    for part in _qk_norm_parts(norm):
        if isinstance(getattr(part, "bias", None), torch.Tensor):
            raise ExportError(f"QK-norm {type(part).__name__} with a bias (attnserve's "
                              "LayerNorm form, Cohere's, has none)")
        weight = part.weight.detach().double()
        x = torch.linspace(-2.0, 3.0, weight.numel(), dtype=torch.float64).reshape(weight.shape)
        small = x * math.sqrt(eps) / torch.sqrt((x * x).mean(-1, keepdim=True))
        forms |= {_norm_computes(part, eps, probe.to(part.weight.dtype), weight)
                  for probe in (x, small)}
        if len(forms) != 1 or None in forms:
            raise ExportError(f"QK-norm {type(part).__name__}, which computes none of RMSNorm "
                              f"x / sqrt(mean(x^2) + {eps}) and LayerNorm without a bias "
                              f"(x - mean) / sqrt(var + {eps}), times w or (1 + w)")
    return forms.pop()


def qk_norm_config(module, head_dim):
    """The `qk_norm` of an attnserve ModelConfig for a module with norm
    children `q_norm` and `k_norm`: RMSNorm per head (Qwen3; Gemma3's adds 1
    to its weight) or over the whole projection before the heads are split
    (OLMo-2: weights as wide as q_proj's and k_proj's outputs), LayerNorm
    without a bias per head with weights [heads, head_dim] (Cohere's
    use_qk_norm; StableLM's qk_layernorm, one norm per head: subtract_mean,
    per_head_weights), or `query_layernorm` and `key_layernorm` after RoPE
    (Hunyuan); None without them. ExportError for a norm attnserve does not
    compute: another form (a bias among them), or weights of another shape."""
    q, k, after_rope = _qk_norms(module)
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise ExportError("QK-norm on only one of Q and K")
    if _qk_norm_weight(q) is None and _qk_norm_weight(k) is None:
        # Llama 4's L2 norm: RMSNorm without a weight, x / sqrt(mean(x^2) +
        # eps), as its numbers on a probe vector show: weights of 1.
        eps = float(getattr(q, "eps", None) or getattr(q, "variance_epsilon", None) or 1e-6)
        x = torch.linspace(-2.0, 3.0, head_dim, dtype=torch.float32)
        for norm in {id(q): q, id(k): k}.values():
            if _norm_form(norm, eps, x, torch.ones(head_dim, dtype=torch.float64)):
                raise ExportError(f"QK-norm {type(norm).__name__} without a weight that doubles")
        config = dict(eps=eps, weight_offset=False)
        if after_rope:
            config["after_rope"] = True
        return config
    widths = []
    for name, norm, proj in (("q_norm", q, "q_proj"), ("k_norm", k, "k_proj")):
        weight = _qk_norm_weight(norm)
        shape = None if weight is None else tuple(weight.shape)
        linear = _linear(module, proj)
        if shape == (head_dim,) and linear is not None and linear.out_features == head_dim:
            widths.append("either")  # one head: per head is over the projection
        elif shape == (head_dim,):
            widths.append("head")
        elif linear is not None and shape == (linear.out_features,):
            widths.append("projection")
        elif linear is not None and shape == (linear.out_features // head_dim, head_dim):
            widths.append("per_head")  # Cohere's [heads, head_dim]; StableLM's norms
        else:
            whole = f", {proj}'s width ({linear.out_features},) or its heads " \
                f"({linear.out_features // head_dim}, {head_dim})" if linear is not None else ""
            raise ExportError(f"QK-norm {name} with weight {shape}, neither shared by the heads "
                              f"({head_dim},){whole}")
    if "projection" in widths and ("head" in widths or "per_head" in widths):
        raise ExportError("QK-norm per head on one of Q and K and over the whole projection "
                          "on the other")
    if set(widths) == {"head", "per_head"}:
        raise ExportError("QK-norm with weights per head on one of Q and K and shared by the "
                          "heads on the other")
    first = _qk_norm_parts(q)[0]
    eps = getattr(first, "variance_epsilon", None) or getattr(first, "eps", None) or \
        _config_value(getattr(module, "config", None), "rms_norm_eps") or 1e-6
    forms = {_qk_norm_form(norm, float(eps)) for norm in (q, k)}
    if len(forms) != 1:
        raise ExportError("QK-norm of one form on Q and another on K (RMSNorm or LayerNorm, "
                          "x * w or x * (1 + w))")
    subtract_mean, offset = forms.pop()
    config = dict(eps=float(eps), weight_offset=offset)
    if "projection" in widths:
        config["whole_projection"] = True
    if after_rope:
        config["after_rope"] = True
    if subtract_mean:
        config["subtract_mean"] = True
    if "per_head" in widths:
        config["per_head_weights"] = True
    return config


# Model types whose sliding window is the whole story: every layer slides
# over the last `sliding_window` keys (p - W + 1 .. p), the rule attnserve
# computes. Others mix windowed and full layers by rules of their own.
_WINDOW_TYPES = {"mistral", "mixtral", "starcoder2",
                 "minimax"}  # MiniMax: every full-attention layer, as Mixtral


def sliding_window_of(module):
    """The `sliding_window` of an attnserve ModelConfig for `module`, or None
    when it attends to every key. A module that says its own window (None on
    the full-attention layers of models that mix both) is believed; else its
    config's, which Qwen2 uses only with use_sliding_window. ExportError for
    a window attnserve cannot place (model types that choose windowed layers
    by rules of their own)."""
    config = getattr(module, "config", None)
    if _config_value(config, "model_type") == "exaone4":
        # Its modules keep the config's window on every layer; the full ones
        # (not is_sliding) attend to every key.
        window = getattr(module, "sliding_window", None)
        return int(window) if window and getattr(module, "is_sliding", False) else None
    if hasattr(module, "sliding_window"):
        # The module's own word on its layer (Gemma 2: every other layer).
        window = module.sliding_window
        if window and getattr(module, "is_causal", None) is False:
            return _two_sided_window(config, int(window))
        return int(window) if window else None
    if _config_value(config, "use_sliding_window") is False:
        return None
    window = _config_value(config, "sliding_window")
    if not window:
        return None
    model_type = _config_value(config, "model_type")
    if model_type == "phi3":
        # Phi-3-mini-4k's 2047 (Phi-3.5's and Phi-4-mini's 262144 never bind
        # within their 131072 positions): served as transformers 5.x applies
        # it, in every attention path, each query seeing its last `window`
        # keys; 4.x applied it in its flash-attention path alone.
        return int(window)
    if model_type not in _WINDOW_TYPES:
        raise ExportError(f"a sliding window of {window} tokens in a model of type "
                          f"{model_type!r}, whose windowed layers attnserve cannot place "
                          f"(served: {', '.join(sorted(_WINDOW_TYPES))})")
    return int(window)


def _two_sided_window(config, window):
    """attnserve's window (without causal: keys p - W + 1 .. p + W - 1) for
    a bidirectional layer whose module slides `window`, by its model type's
    rule (transformers' configs already halve the checkpoint's window to
    (sliding_window // 2) + 1). ExportError for model types not checked."""
    model_type = _config_value(config, "model_type")
    bidirectional = _config_value(config, "use_bidirectional_attention")
    if model_type in ("gemma3_text", "gemma3") and bidirectional is True:
        # EmbeddingGemma: |i - j| < window (modeling_gemma3's
        # _bidirectional_window_overlay, exclusive).
        return window
    if model_type == "gemma4_text" and bidirectional == "all":
        # Gemma 4's bidirectional text layers: |i - j| <= window
        # (masking_utils' sliding_window_bidirectional_overlay, inclusive).
        return window + 1
    if model_type in ("modernbert", "embedding_gemma2_text"):
        # |i - j| <= radius (ModernBERT's local_attention // 2, EmbeddingGemma
        # 2's sliding_window), the module's window already that plus 1 (flash
        # attention's exclusive bound).
        return window
    raise ExportError(f"a sliding window of {window} on a layer that is not causal, in a model "
                      f"of type {model_type!r} (use_bidirectional_attention={bidirectional!r}), "
                      "whose two-sided window attnserve has not checked (served: EmbeddingGemma's "
                      "gemma3_text, Gemma 4's use_bidirectional_attention='all', ModernBERT, "
                      "EmbeddingGemma 2)")


def attention_chunk_of(module):
    """The `attention_chunk` of an attnserve ModelConfig for `module`: Llama
    4's attention_chunk_size on its chunked layers (config.layer_types), None
    elsewhere. ExportError for a chunk size on a model type that places its
    chunked layers by rules attnserve does not know."""
    config = getattr(module, "config", None)
    size = _config_value(config, "attention_chunk_size")
    if not size:
        return None
    model_type = _config_value(config, "model_type")
    if model_type != "llama4_text":
        raise ExportError(f"chunked attention (attention_chunk_size {size}) in a model of type "
                          f"{model_type!r}, whose chunked layers attnserve cannot place "
                          "(served: llama4_text)")
    types = _config_value(config, "layer_types")
    layer = getattr(module, "layer_idx", None)
    if types and layer is not None and layer < len(types):
        return int(size) if types[layer] == "chunked_attention" else None
    # transformers 4.x: the layers with RoPE are the chunked ones.
    return int(size) if getattr(module, "use_rope", False) else None


# Model types whose queries scale by their position's band after RoPE
# (transformers' get_llama_4_attn_scale: 1 + beta * log(1 + floor(position /
# original_max_position_embeddings)) with rope_parameters'
# llama_4_scaling_beta), checked against their classes: Ministral 3 on
# Llama's attention, Mistral 4 on latent attention (every query feature,
# after RoPE).
_POSITION_SCALED = {"ministral3", "mistral4"}


def _position_scaling(module):
    """Ministral 3's and Mistral 4's query scaling by position as a
    `temperature_tuning` (by_position), None without llama_4_scaling_beta."""
    config = getattr(module, "config", None)
    params = dict(_config_value(config, "rope_parameters") or {})
    for k, v in dict(_config_value(config, "rope_scaling") or {}).items():  # transformers 4.x
        params.setdefault(k, v)
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return None
    model_type = _config_value(config, "model_type")
    if model_type not in _POSITION_SCALED:
        raise ExportError(f"query scaling by position (rope_parameters llama_4_scaling_beta="
                          f"{beta}) on {'latent attention of ' if _is_latent(module) else ''}"
                          f"model type {model_type!r} (checked: {sorted(_POSITION_SCALED)})")
    original = params.get("original_max_position_embeddings") or \
        _config_value(config, "original_max_position_embeddings")
    if not original or not math.isfinite(float(beta)):
        raise ExportError("query scaling by position needs original_max_position_embeddings and "
                          f"a finite llama_4_scaling_beta, got {original!r} and {beta!r}")
    return dict(floor_scale=float(original), attn_scale=float(beta), by_position=True)


def temperature_tuning_of(module):
    """The `temperature_tuning` of an attnserve ModelConfig for `module`:
    Llama 4's attn_temperature_tuning on its layers without RoPE, Ministral
    3's query scaling by position, None elsewhere."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return _position_scaling(module)
    return dict(floor_scale=float(module.floor_scale), attn_scale=float(module.attn_scale))


# QKV clipping by model type: each clamps its projected Q, K and V to
# [-clip_qkv, clip_qkv] before RoPE, as attnserve does, and True where that
# follows its QK-norm (OLMoE: q_norm(q_proj(x)), then the clamp, attnserve's
# order too); False where it has none (a QK-norm there is of an order not
# checked). Each is checked against transformers' own class (tests/hf).
_CLIP_AFTER_NORM = {"olmo": False, "olmoe": True, "dbrx": False, "mpt": False}


def clip_qkv_of(module):
    """The `clip_qkv` of an attnserve ModelConfig for `module`: DBRX's
    attn_config.clip_qkv (the module's own clip_qkv), OLMo's and OLMoE's
    config.clip_qkv; None without. ExportError for a clamp attnserve does
    not compute: a limit that is not finite and > 0 (transformers clamps to
    [-0, 0] with 0, where attnserve's 0 means none), a model type whose
    clamp is not checked, a QK-norm in another order."""
    config = getattr(module, "config", None)
    clip = getattr(module, "clip_qkv", None)
    if clip is None:
        clip = _config_value(config, "clip_qkv")
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or \
            not math.isfinite(clip) or clip <= 0:
        raise ExportError(f"QKV clipping with clip_qkv={clip!r} (attnserve clamps to [-clip_qkv, "
                          "clip_qkv] with a finite clip_qkv > 0; transformers clamps with any "
                          "value it is given, every feature to 0 with 0)")
    model_type = _model_type(module)
    if model_type not in _CLIP_AFTER_NORM:
        raise ExportError(f"QKV clipping (clip_qkv={clip}) in a model of type {model_type!r}, "
                          "whose clamp attnserve has not checked against transformers "
                          f"(served: {', '.join(sorted(_CLIP_AFTER_NORM))})")
    q, k, after_rope = _qk_norms(module)
    if (q is not None or k is not None) and (after_rope or not _CLIP_AFTER_NORM[model_type]):
        where = "after RoPE" if after_rope else "before RoPE"
        raise ExportError(f"QKV clipping (clip_qkv={clip}) with a QK-norm {where} in a model of "
                          f"type {model_type!r}, whose order of the two is not checked "
                          "(attnserve clamps after the projections and a QK-norm before RoPE, "
                          "OLMoE's order, and before RoPE)")
    return float(clip)


def v_norm_config(module, head_dim):
    """The `v_norm` of an attnserve ModelConfig for a module with a `v_norm`
    child (Gemma 3n, Gemma 4): RMSNorm of each value head without a weight,
    v / sqrt(mean(v^2) + eps), checked on two probes as the QK-norms are;
    None without one. ExportError naming the norm for a weight, another
    form, or a model type whose value norm is not checked."""
    norm = getattr(module, "v_norm", None)
    if norm is None:
        return None
    model_type = _config_value(getattr(module, "config", None), "model_type")
    if model_type not in _V_NORM_TYPES:
        raise ExportError(f"a norm of the values (v_norm) in a model of type {model_type!r}, "
                          "whose value norm attnserve has not checked against transformers "
                          f"(served: {', '.join(sorted(_V_NORM_TYPES))})")
    if isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise ExportError(f"v_norm {type(norm).__name__} with a weight (attnserve's value norm "
                          "has none)")
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
    if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps > 0:
        raise ExportError(f"v_norm {type(norm).__name__} says no eps (eps or variance_epsilon)")
    proj = _linear(module, "k_proj") or _linear(module, "q_proj")
    dtype = proj.weight.dtype if proj is not None else torch.float32
    width = int(head_dim or 16)
    x = torch.linspace(-2.0, 3.0, width, dtype=torch.float64)
    for probe in (x, x * math.sqrt(eps) / torch.sqrt((x * x).mean())):
        if _norm_computes(norm, float(eps), probe.to(dtype),
                          torch.ones(width, dtype=torch.float64)) != (False, False):
            raise ExportError(f"v_norm {type(norm).__name__}, which computes something else "
                              f"than RMSNorm without a weight v / sqrt(mean(v^2) + {eps})")
    return dict(eps=float(eps))


def _kv_shared(module):
    """What a layer that takes its keys and values from an earlier layer
    (Gemma 3n's and Gemma 4's KV sharing: kv_sharing_modes "reuse", no
    k_proj or v_proj) computes, for a refusal; None for any other layer."""
    config = getattr(module, "config", None)
    shared = getattr(module, "is_kv_shared_layer", None)
    if shared is None:
        try:
            modes = _config_value(config, "kv_sharing_modes")
        except ValueError:  # transformers checks its layer types as it builds them
            modes = None
        layer = getattr(module, "layer_idx", None)
        shared = bool(modes and layer is not None and layer < len(modes) and
                      str(modes[layer]).startswith("reuse"))
    if not shared:
        return None
    return (f"reuses the keys and values of an earlier layer (KV sharing, num_kv_shared_layers="
            f"{_config_value(config, 'num_kv_shared_layers')})")


def kv_source_layer(config, layer):
    """The index of the layer whose keys and values KV-shared layer `layer`
    reuses: the last layer before the shared ones (the last
    num_kv_shared_layers) of the same layer type (transformers'
    kv_sharing_modes "store"); None when there is none (every layer shared:
    an assistant model reading another model's keys and values)."""
    layers = int(_config_value(config, "num_hidden_layers"))
    first_shared = layers - int(_config_value(config, "num_kv_shared_layers") or 0)
    types = list(_config_value(config, "layer_types"))
    for index in range(first_shared - 1, -1, -1):
        if types[index] == types[layer]:
            return index
    return None


def _with_kv_of(module, source):
    """A view of KV-shared `module` (its queries, output projection, config,
    window and RoPE) with `source`'s key and value parts: k_proj, v_proj,
    k_norm, v_norm, attention_k_eq_v. The modules are shared, not copied."""
    view = copy.copy(module)
    view._modules, view._parameters = dict(module._modules), dict(module._parameters)
    view._buffers = dict(module._buffers)
    for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
        setattr(view, name, getattr(source, name, None))
    view.use_alternative_attention = getattr(source, "use_alternative_attention", False)
    view.is_kv_shared_layer = False
    return view


def _check_kv_source(module, source):
    """ExportError unless `source` is the layer KV-shared `module` reuses."""
    config = getattr(module, "config", None)
    layer = getattr(module, "layer_idx", None)
    want = kv_source_layer(config, layer) if layer is not None else None
    got = getattr(source, "layer_idx", None)
    if want is None or got != want or type(source) is not type(module) or \
            _kv_shared(source) or getattr(source, "k_proj", None) is None:
        raise ExportError(f"kv_source {type(source).__name__} (layer {got}) is not the layer "
                          f"whose keys and values {type(module).__name__} (layer {layer}) "
                          f"reuses: {'none' if want is None else f'layer {want}'} (the last "
                          "earlier layer of its type before the shared ones)")


# ALiBi by model type: how each computes its slopes, one per head ("bloom":
# BLOOM's build_alibi_tensor, powers of 2^(-8/n) for the largest power of
# two n <= heads, then odd powers of 2^(-4/n) for the rest; "mpt": MPT's
# build_mpt_alibi_tensor, 2^(-k * alibi_bias_max / n) for the smallest power
# of two n >= heads, odd k first when heads is not a power of two), and
# "falcon": refused. Checked against transformers' own classes (tests/hf).
_ALIBI = {"bloom": "bloom", "mpt": "mpt", "falcon": "falcon"}


def _bloom_slopes(heads):
    closest = 2 ** int(math.floor(math.log2(heads)))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** k for k in range(1, closest + 1)]
    if closest != heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** k for k in range(1, 2 * min(closest, heads - closest), 2)]
    return slopes


def _mpt_slopes(heads, bias_max):
    n = 2 ** int(math.ceil(math.log2(heads)))
    slopes = [1.0 / 2.0 ** (k * (bias_max / n)) for k in range(1, n + 1)]
    if n != heads:
        slopes = (slopes[1::2] + slopes[::2])[:heads]
    return slopes


def alibi_slopes_of(module, num_heads=None, model_config=None):
    """The `alibi_slopes` of an attnserve ModelConfig for `module`: one per
    query head, by its model type's rule (BLOOM, MPT); None for a model type
    without ALiBi. model_config: the whole model's Hugging Face config, for
    a module that keeps none (MPT's in transformers 4.x). ExportError for
    MPT's module without either (its alibi_bias_max unknown), and for Falcon
    with `alibi` (transformers rounds its slopes and each slope * key index
    to bfloat16 (build_alibi_tensor), a bias no slope reproduces)."""
    config = getattr(module, "config", None) or model_config
    kind = _ALIBI.get(_model_type(module))
    if kind is None:
        return None
    heads = num_heads or _first_attr(module, ["num_heads", "n_heads"]) or \
        _config_value(config, "num_attention_heads")
    if kind == "bloom":
        return [float(x) for x in _bloom_slopes(heads)]
    if kind == "mpt":
        attn = _config_value(config, "attn_config")
        if attn is None:
            raise ExportError(f"MPT's ALiBi without the model's config ({type(module).__name__} "
                              "keeps none), so its attn_config.alibi_bias_max is unknown: export "
                              "it from the whole model (export_module(model, folder, "
                              "submodule=...))")
        bias_max = attn.get("alibi_bias_max", 8) if isinstance(attn, dict) else \
            _config_value(attn, "alibi_bias_max")
        return [float(x) for x in _mpt_slopes(heads, 8 if bias_max is None else bias_max)]
    if _config_value(config, "alibi") is True:
        raise ExportError("Falcon's ALiBi, whose bias transformers rounds to bfloat16 (the "
                          "slopes and each slope * key index, build_alibi_tensor's "
                          "`.bfloat16()`), which no linear bias reproduces")
    return None


# Model types whose scores get a learned relative position bias, each
# checked against transformers' own classes (tests/hf): T5's buckets
# (T5Attention and its copies; every UMT5 layer has its own), MPNet's
# (MPNetEncoder's, shared by its layers). LongT5's local attention and
# UDOP's 2D bias are not these.
_RELATIVE_BIAS = {"t5": "t5", "mt5": "t5", "umt5": "t5", "switch_transformers": "t5",
                  "mpnet": "mpnet"}
# MPNet's buckets reach 128 keys each way (relative_position_bucket's
# default, which compute_position_bias keeps).
_MPNET_MAX_DISTANCE = 128


def _relative_kind(module):
    """"t5", "mpnet" or None: the relative bias `module`'s model type adds."""
    return _RELATIVE_BIAS.get(_model_type(module))


def _relative_table(bias, distance, what):
    """(distance, table [heads, 2 * distance + 1]) of a bias [heads, N, N]
    over queries and keys 0 .. N - 1 (N > 2 * distance), each distance
    j - i's entry read off the bias and checked: the table must rebuild
    every score's bias exactly, each distance beyond `distance` the same as
    at it, or the model's bias is not one attnserve computes."""
    n = bias.shape[-1]
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    table = torch.stack([bias[:, max(-r, 0), max(r, 0)] for r in range(-distance, distance + 1)],
                        dim=1)
    rebuilt = table[:, rel.clamp(-distance, distance) + distance]
    if not torch.equal(rebuilt, bias):
        raise ExportError(f"{what}'s relative position bias is not one value per distance up to "
                          f"{distance} keys each way, the same beyond: not the relative bias "
                          "attnserve computes")
    return distance, table


def relative_bias_of(module, source=None):
    """(relative_bias_distance, table [num_heads, 2D + 1]) for an attnserve
    ModelConfig of `module` whose scores get a learned relative position
    bias (T5, mT5, UMT5, Switch Transformers, MPNet): each distance's bucket
    value, computed by the model's own code (its bucket rule's float log
    included) and checked; None for a module without one.
    source: the module that holds the bias: T5's layers without one of
    their own (has_relative_attention_bias False) take their stack's first
    self-attention layer's, and cross-attention none (source False); MPNet's
    layers their MPNetEncoder's. Default: the module itself (T5's first
    layers, UMT5's every layer); ExportError when it holds none and no
    source says whose (export from the whole model, submodule=)."""
    kind = _relative_kind(module)
    if kind is None or source is False:
        return None
    name = type(module).__name__
    with torch.no_grad():
        if kind == "mpnet":
            if source is None or not hasattr(source, "compute_position_bias"):
                raise ExportError(f"{name}'s relative position bias, which is its encoder's "
                                  "(MPNetEncoder.relative_attention_bias): export it from the "
                                  "whole model (export_module(model, folder, submodule=...))")
            n = 2 * _MPNET_MAX_DISTANCE + 1
            bias = source.compute_position_bias(torch.zeros(1, n, 1))[0].float()
            return _relative_table(bias, _MPNET_MAX_DISTANCE, name)
        if getattr(module, "pruned_heads", None):
            raise ExportError(f"{name} with pruned heads {sorted(module.pruned_heads)}")
        if getattr(module, "has_relative_attention_bias", False):
            source = module
        if source is None:
            if getattr(module, "is_decoder", False) and getattr(module, "is_causal", None) is False:
                return None  # transformers 5.x's cross-attention: no position bias
            raise ExportError(f"{name} without a relative_attention_bias of its own: in the "
                              "model its scores get its stack's first self-attention layer's "
                              "(or, as cross-attention, none), which the module alone does not "
                              "say: export it from the whole model (export_module(model, folder, "
                              "submodule=...))")
        distance = int(source.relative_attention_max_distance)
        n = 2 * distance + 1
        bias = source.compute_bias(n, n)[0].float()
        return _relative_table(bias, distance, name)


# Model types whose scores get relative position embeddings, DeBERTa's
# disentangled attention: DisentangledSelfAttention, which DebertaAttention
# (v1) and DebertaV2Attention (v2 and v3) wrap with their output dense;
# each checked against transformers' own classes (tests/hf). The module
# path's folder name where the module keeps no config.
_DISENTANGLED = {"deberta": 1, "deberta_v2": 2, "deberta-v2": 2}


def _deberta_parts(module):
    """(version, self-attention, output dense or None) of DeBERTa's
    attention: DebertaAttention or DebertaV2Attention (their `self` and
    `output.dense`), or a DisentangledSelfAttention alone (no output
    projection); None for any other module."""
    version = _DISENTANGLED.get(_model_type(module))
    if version is None:
        return None
    sa, out = getattr(module, "self", None), getattr(module, "output", None)
    if sa is not None and hasattr(sa, "pos_att_type"):
        return version, sa, _linear(out, "dense") if out is not None else None
    if hasattr(module, "pos_att_type"):
        return version, module, None
    return None


def _deberta_terms(sa):
    """(c2p, p2c, scale_factor) of a DisentangledSelfAttention: which
    relative terms its scores get and the factor its scale counts (1 + one
    per term, whether or not relative_attention is on, as its forward
    does); ExportError for a term transformers does not compute."""
    types = list(getattr(sa, "pos_att_type", None) or [])
    unknown = sorted(set(types) - {"c2p", "p2c"})
    if unknown:
        raise ExportError(f"{type(sa).__name__} with pos_att_type {unknown} (relative terms "
                          "other than c2p and p2c), which attnserve does not compute: refused "
                          "rather than served with different numbers")
    return "c2p" in types, "p2c" in types, 1 + len(types)


def _deberta_columns(version, sa):
    """(rows of the encoder's relative embeddings the module reads, column):
    column(i - j) is the row of those that the scores of query i and key j
    read. v2/v3: the first 2 * span rows, at clamp(bucket(i - j) + span) (its
    log buckets, when position_buckets > 0); v1: every row, at clamp(i - j +
    max_relative_positions) (its att_span slicing, whatever the length, reads
    the same rows)."""
    code = sys.modules[type(sa).__module__]
    if version == 1:
        reach = sa.max_relative_positions
        return 2 * reach, lambda delta: (delta + reach).clamp(0, 2 * reach - 1)
    span, buckets, max_position = sa.pos_ebd_size, sa.position_buckets, sa.max_relative_positions

    def column(delta):
        if buckets > 0 and max_position > 0:
            delta = code.make_log_bucket_position(delta, buckets, max_position)
        return (delta.long() + span).clamp(0, 2 * span - 1)
    return 2 * span, column


# BERT's own relative position embeddings (position_embedding_type,
# transformers 4.x): one learned vector per distance i - j, shared by the
# heads, that the query scores (relative_key) and the key too
# (relative_key_query).
_BERT_RELATIVE = {"relative_key": False, "relative_key_query": True}


def _bert_relative(module):
    """(relative_embeddings config, tables) of BERT's attention with its
    relative position embeddings (an encoder's: distance_embedding's vector
    for i - j + max_position_embeddings - 1, written out per distance for
    every head; transformers' forward fails past max_position_embeddings -
    1, where attnserve's last column goes on); None for any other module."""
    parts = _bert_parts(module)
    kind = getattr(parts[5], "position_embedding_type", None) if parts is not None else None
    if kind not in _BERT_RELATIVE:
        return None
    sa = parts[5]
    heads, dim = sa.num_attention_heads, sa.attention_head_size
    reach = sa.max_position_embeddings - 1
    with torch.no_grad():
        vectors = sa.distance_embedding.weight.float()  # [2 * reach + 1, dim], row i - j + reach
        columns = vectors[reach - torch.arange(-reach, reach + 1)]  # j - i = r: row -r + reach
        table = columns.t()[None].expand(heads, dim, 2 * reach + 1).contiguous()
    tables = {"relative_key": table}
    if _BERT_RELATIVE[kind]:
        tables["relative_query"] = table.clone()
    config = {"distance": reach, "content_to_position": True,
              "position_to_content": _BERT_RELATIVE[kind]}
    return config, tables


def relative_embeddings_of(module, source=None):
    """(relative_embeddings config, {"relative_key": ..., "relative_query":
    ...}) of DeBERTa's attention (v1, v2, v3), whose scores get
    content-to-position (c2p) and position-to-content (p2c) terms: each
    distance's vectors of the encoder's relative embeddings, through the
    layer's own query and key projections (v2's share_att_key) or its
    position projections (pos_key_proj / pos_query_proj; v1's pos_proj /
    pos_q_proj), laid out [heads, head_dim, 2D + 1] in the order of j - i, D
    where the columns stop changing; checked to rebuild the module's own
    relative scores over 2D + 2 positions. None without such terms (a layer
    whose model type is not DeBERTa's, or without relative_attention).
    source: the module holding the relative embeddings (the encoder's
    get_rel_embedding): ExportError when None (export from the whole model,
    submodule=)."""
    bert = _bert_relative(module)
    if bert is not None:
        return bert
    parts = _deberta_parts(module)
    if parts is None:
        return None
    version, sa, _ = parts
    c2p, p2c, factor = _deberta_terms(sa)
    if not getattr(sa, "relative_attention", False) or not (c2p or p2c):
        return None
    name = type(module).__name__
    if source is None or not hasattr(source, "get_rel_embedding"):
        encoder = "DebertaV2Encoder" if version == 2 else "DebertaEncoder"
        raise ExportError(f"{name}'s relative position embeddings, which are its encoder's "
                          f"({encoder}.rel_embeddings): export it from the whole model "
                          "(export_module(model, folder, submodule=...))")
    if getattr(sa, "pruned_heads", None):
        raise ExportError(f"{name} with pruned heads")
    heads, dim = sa.num_attention_heads, sa.attention_head_size
    rows, column = _deberta_columns(version, sa)
    scale = 1.0 / math.sqrt(dim * factor)
    with torch.no_grad():
        limit = 4 * (rows + 1)
        cols = column(torch.arange(-limit, limit + 1))
        changes = [d for d in range(1, limit + 1)
                   if cols[limit + d] != cols[limit + d - 1] or
                   cols[limit - d] != cols[limit - d + 1]]
        distance = max(changes, default=1)
        embeddings = source.get_rel_embedding()
        rel = embeddings[:rows].float()
        pick = column(-torch.arange(-distance, distance + 1))  # j - i = r: i - j = -r

        def table(linear):
            vectors = linear(rel).float().view(-1, heads, dim)  # [rows, heads, dim]
            return vectors.permute(1, 2, 0)[:, :, pick].contiguous()

        own = version == 2 and getattr(sa, "share_att_key", False)
        tables = {}
        if c2p:
            tables["relative_key"] = table(sa.key_proj if own else
                                           sa.pos_key_proj if version == 2 else sa.pos_proj)
        if p2c:
            tables["relative_query"] = table(sa.query_proj if own else
                                             sa.pos_query_proj if version == 2 else sa.pos_q_proj)
        # The module's own relative scores over 2D + 2 positions (past D both
        # ways) against the ones the tables give. v2 scales them itself; v1
        # takes the query already scaled and scales only p2c.
        n = 2 * distance + 2
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(heads, n, dim, generator=generator)
        k = torch.randn(heads, n, dim, generator=generator)
        if version == 2:
            expected = sa.disentangled_attention_bias(q, k, None, embeddings.float(), factor)
        else:  # its positions i - j, as its encoder passes them (get_rel_pos)
            relative = (torch.arange(n)[:, None] - torch.arange(n)[None, :])[None]
            expected = sa.disentangled_att_bias((q * scale)[None], k[None], relative,
                                                embeddings.float(), factor)[0]
        at = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-distance, distance) + \
            distance  # [i, j] -> column of j - i
        rebuilt = torch.zeros(heads, n, n)
        for key, features in (("relative_key", q), ("relative_query", k)):
            if key in tables:
                scores = torch.einsum("hnd,hdc->hnc", features, tables[key])  # [h, row, column]
                if key == "relative_key":
                    rebuilt += torch.gather(scores, 2, at.expand(heads, n, n))
                else:  # key j's score of column(j - i), placed at [i, j]
                    rebuilt += torch.gather(scores.transpose(1, 2), 1, at.expand(heads, n, n))
        rebuilt *= scale
        if not torch.allclose(rebuilt, expected.float(), rtol=1e-4,
                              atol=1e-5 * float(expected.abs().max())):
            raise ExportError(f"{name}'s relative position terms are not one vector per distance "
                              f"up to {distance} positions each way, the same beyond: not the "
                              "relative position embeddings attnserve computes")
    config = {"distance": distance, "content_to_position": c2p, "position_to_content": p2c}
    return config, tables


def _enclosing_with(model, name, attribute):
    """The nearest module of `model` enclosing the one at dotted `name` that
    has `attribute`, or None."""
    parts = name.split(".")
    for end in range(len(parts) - 1, -1, -1):
        outer = model.get_submodule(".".join(parts[:end]))
        if hasattr(outer, attribute):
            return outer
    return None


def _relative_bias_source(model, name, module):
    """The module in `model` that holds the relative bias of `module` (its
    dotted `name`): T5's stack's first self-attention layer (block 0 of the
    same stack), False for its cross-attention (EncDecAttention); MPNet's
    encoder, the nearest enclosing module with compute_position_bias;
    DeBERTa's (relative embeddings), the nearest with get_rel_embedding; None
    for a module that needs none or holds its own."""
    kind = _relative_kind(module)
    if _deberta_parts(module) is not None:  # DeBERTa's encoder: its relative embeddings
        return _enclosing_with(model, name, "get_rel_embedding")
    if kind == "mpnet":
        return _enclosing_with(model, name, "compute_position_bias")
    if kind != "t5" or getattr(module, "has_relative_attention_bias", False):
        return None
    if name.endswith("EncDecAttention"):
        return False
    found = re.fullmatch(r"(.*\.)?block\.\d+\.(.*SelfAttention)", name)
    if found:
        first = model.get_submodule(f"{found.group(1) or ''}block.0.{found.group(2)}")
        if getattr(first, "has_relative_attention_bias", False):
            return first
    return None


def _caller_biases(module):
    """What names a position bias `module`'s forward takes from its caller
    (`alibi`, `position_bias`, `relative_position_bias`, `attn_bias`), as
    refusals: attnserve knows only ALiBi's and the relative biases of the
    model types above."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return [f"a position bias its caller passes in (forward's `{name}`), of model type "
            f"{_model_type(module)!r}, whose bias attnserve does not know (known: ALiBi of "
            f"{', '.join(sorted(_ALIBI))}; relative biases of "
            f"{', '.join(sorted(_RELATIVE_BIAS))})"
            for name in ("alibi", "position_bias", "relative_position_bias", "attn_bias")
            if name in params]


def unsupported_features(module, head_dim=None, num_heads=None, model_config=None):
    """What `module` computes that attnserve does not (yet): rotary
    embeddings, sliding windows, QK-norms, value norms, QKV clipping and
    attention sinks of a kind attnserve does not compute (rope_config,
    sliding_window_of, qk_norm_config, v_norm_config and clip_qkv_of say
    which), keys and values reused from another layer (KV sharing). Read
    from the module's children and parameters and its Hugging Face `config`;
    head_dim and num_heads default to the module's own attributes. Empty when
    attnserve computes the module exactly."""
    if _is_latent(module):
        return _latent_unsupported(module)
    found = []
    config = getattr(module, "config", None)
    if _config_value(config, "model_type") in _NOT_COMPUTED:
        found.append(_NOT_COMPUTED[_config_value(config, "model_type")])
    shared = _kv_shared(module)
    if shared:
        found.append(f"a layer (layer {getattr(module, 'layer_idx', '?')}) that {shared}")
    head_dim = head_dim or getattr(module, "head_dim", None) or 0
    try:
        rope_config(module, head_dim)
    except ExportError as e:
        found.append(str(e))
    try:
        sliding_window_of(module)
    except ExportError as e:
        found.append(str(e))
    try:
        attention_chunk_of(module)
    except ExportError as e:
        found.append(str(e))
    model_type = _config_value(config, "model_type")
    multiplier = getattr(module, "key_multiplier", None)
    if multiplier is not None and model_type not in _KEY_MULTIPLIED:
        found.append(f"keys multiplied by key_multiplier={multiplier} in a model of type "
                     f"{model_type!r}, where attnserve has not checked where (served: "
                     f"{', '.join(sorted(_KEY_MULTIPLIED))})")
    for name in ("gate_proj", "gate", "g_proj"):
        if _linear(module, name) is not None and model_type not in _OUTPUT_GATES:
            # A gate attnserve would leave out: another number on every token.
            found.append(f"a gate on the attention output ({name}) of model type "
                         f"{model_type!r}, whose gating attnserve does not know (known: "
                         f"{', '.join(sorted(_OUTPUT_GATES))})")
    try:
        clip_qkv_of(module)
    except ExportError as e:
        found.append(str(e))
    try:
        alibi_slopes_of(module, num_heads, model_config)
    except ExportError as e:
        found.append(str(e))
    if _model_type(module) not in _ALIBI and _relative_kind(module) is None:
        # A bias its caller computes and attnserve would leave out.
        found += _caller_biases(module)
    if not shared:  # a shared layer has no k_norm nor v_norm: its keys are done
        for check in (qk_norm_config, v_norm_config):
            try:
                check(module, head_dim)
            except ExportError as e:
                found.append(str(e))
    sinks = getattr(module, "sinks", None)
    heads = num_heads or getattr(module, "num_heads", None) or \
        getattr(module, "num_attention_heads", None) or _config_value(config, "num_attention_heads")
    if sinks is not None and (getattr(sinks, "ndim", 0) != 1 or sinks.shape[0] != heads):
        found.append(f"attention sinks of shape {tuple(getattr(sinks, 'shape', ()))}, not one "
                     f"per query head ({heads},)")
    return found


def describe_module(module, *, num_heads=None, num_kv_heads=None, head_dim=None, qkv_layout=None,
                    kv_source=None, model_config=None, relative_bias_source=None):
    """(config dict, {local tensor name: tensor}) of one attention module.
    kv_source: for a layer that reuses an earlier layer's keys and values
    (KV sharing), that layer's module: its k_proj, v_proj and norms are
    exported, and config["kv_source"] names it. model_config: the whole
    model's Hugging Face config, read where the module keeps none (MPT's
    ALiBi in transformers 4.x). relative_bias_source: the module that holds
    a relative position bias the layer's scores get (relative_bias_of), or
    its relative position embeddings (DeBERTa's encoder,
    relative_embeddings_of)."""
    if torch is None:
        raise ExportError("PyTorch is not importable")
    if isinstance(module, torch.nn.MultiheadAttention):
        return _describe_mha(module)
    model_type = _config_value(getattr(module, "config", None), "model_type")
    if model_type in _NOT_COMPUTED:
        raise ExportError(f"{type(module).__name__} ({model_type}) uses "
                          f"{_NOT_COMPUTED[model_type]}, which attnserve does not compute yet: "
                          "refused rather than served with different numbers (docs/MODELS.md)")
    if _is_latent(module):
        return _describe_latent(module, num_heads)
    if hasattr(module, "slope_rate") and hasattr(module, "block_size"):
        # MiniMax's linear layers: qkv_proj, out_proj and output_gate, no softmax.
        raise ExportError(f"{type(module).__name__} is lightning attention "
                          "(linear attention with a decay per head, slope_rate), which attnserve "
                          "does not compute: refused rather than served with different numbers")
    shared = _kv_shared(module)
    if shared and kv_source is None:  # before its missing k_proj and v_proj are looked for
        raise ExportError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) "
                          f"{shared}, which is not given: export it from the whole model "
                          "(export_module(model, folder, submodule=...)), or pass kv_source, "
                          "the module of that layer")
    if shared:
        _check_kv_source(module, kv_source)
        config, tensors = describe_module(_with_kv_of(module, kv_source), num_heads=num_heads,
                                          num_kv_heads=num_kv_heads, head_dim=head_dim,
                                          qkv_layout=qkv_layout)
        config["kv_source"] = f"{type(kv_source).__name__} (layer {kv_source.layer_idx})"
        return config, tensors
    if kv_source is not None:
        raise ExportError(f"kv_source given for {type(module).__name__}, which computes its own "
                          "keys and values")
    config, tensors = _describe_projections(module, num_heads, num_kv_heads, head_dim, qkv_layout)
    missing = unsupported_features(module, config["head_dim"], config["num_heads"], model_config)
    if missing:
        # Served without them, the layer would answer with other numbers.
        raise ExportError(f"{type(module).__name__} uses {'; '.join(missing)}, which attnserve "
                          "does not compute yet: refused rather than served with different "
                          "numbers (docs/MODELS.md)")
    rope = rope_config(module, config["head_dim"])
    if rope is not None:
        config["rope"] = rope
    multiplier = getattr(module, "key_multiplier", None)
    if multiplier is not None:  # _KEY_MULTIPLIED: k_proj(x) * m, folded
        if "k_proj.weight" not in tensors or "qk_norm" in config or \
                _qk_norms(module)[0] is not None:
            raise ExportError(f"key_multiplier on keys without a k_proj of their own or "
                              "with a QK-norm (not checked)")
        for name in ("k_proj.weight", "k_proj.bias"):
            if name in tensors:
                tensors[name] = tensors[name].detach() * float(multiplier)
    window = sliding_window_of(module)
    if window is not None:
        config["sliding_window"] = window
    if getattr(module, "sinks", None) is not None:
        config["sinks"] = True
        tensors["sinks"] = module.sinks
    softcap = getattr(module, "attn_logit_softcapping", None) or \
        _config_value(getattr(module, "config", None), "attn_logit_softcapping")
    if softcap:
        config["softcap"] = float(softcap)
    gate, gate_tensors = output_gate_config(module, config["num_heads"], config["head_dim"])
    if gate is not None:
        config["output_gate"] = gate
        tensors.update(gate_tensors)
    qk_norm = qk_norm_config(module, config["head_dim"])
    if qk_norm is not None:
        config["qk_norm"] = qk_norm
        q_norm, k_norm, _ = _qk_norms(module)
        if _qk_norm_weight(q_norm) is None:  # Llama 4's: weights of 1
            tensors["q_norm.weight"] = torch.ones(config["head_dim"])
            tensors["k_norm.weight"] = torch.ones(config["head_dim"])
        else:  # as stored; StableLM's per-head norms stacked, [heads, head_dim]
            tensors["q_norm.weight"] = _qk_norm_weight(q_norm)
            tensors["k_norm.weight"] = _qk_norm_weight(k_norm)
    v_norm = v_norm_config(module, config["head_dim"])
    if v_norm is not None:
        config["v_norm"] = v_norm
    angles = _proportional_angles(module, config["head_dim"])
    if angles:
        # Gemma 4's proportional RoPE rotates pairs (i, i + head_dim/2) for i
        # < angles: the same permutation of each head's features in Q and K
        # (their projections, biases and QK-norm weights, which act per
        # feature) puts them first, where rope_config's rotate-half over 2 *
        # angles features turns them; it changes no score. A v_proj that is
        # k_proj (_keys_are_values) keeps the original order.
        order = _rotary_first(config["head_dim"], angles)
        for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                     "q_norm.weight", "k_norm.weight"):
            if name in tensors:
                tensors[name] = _permuted_heads(tensors[name], order)
    chunk = attention_chunk_of(module)
    if chunk is not None:
        config["attention_chunk"] = chunk
    temperature = temperature_tuning_of(module)
    if temperature is not None:
        config["temperature_tuning"] = temperature
    clip = clip_qkv_of(module)
    if clip is not None:
        config["clip_qkv"] = clip
    slopes = alibi_slopes_of(module, config["num_heads"], model_config)
    if slopes is not None:
        config["alibi_slopes"] = slopes
    relative = relative_bias_of(module, relative_bias_source)
    if relative is not None:
        distance, table = relative
        if table.shape[0] != config["num_heads"]:
            raise ExportError(f"a relative position bias of {table.shape[0]} heads for a layer "
                              f"of {config['num_heads']}")
        config["relative_bias_distance"] = distance
        tensors["relative_bias"] = table
    embeddings = relative_embeddings_of(module, relative_bias_source)
    if embeddings is not None:
        config["relative_embeddings"], tables = embeddings
        tensors.update(tables)
    if _relative_kind(module) == "t5" and "scale" not in config:
        config["scale"] = 1.0  # T5 does not scale its scores (transformers 4.x: no attribute)
    return config, tensors


def _is_latent(module):
    """Whether `module` is multi-head latent attention (DeepSeek's names)."""
    return any(hasattr(module, n) for n in ("kv_a_proj_with_mqa", "kv_b_proj"))


def _latent_linears(module):
    """{name: nn.Linear} of a latent module's projections; ExportError for a
    missing one."""
    names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    names += ["q_proj"] if _linear(module, "q_proj") is not None else ["q_a_proj", "q_b_proj"]
    linears = {n: _linear(module, n) for n in names}
    missing = [n for n, lin in linears.items() if lin is None]
    if missing:
        raise ExportError(f"multi-head latent attention without the linear(s) {', '.join(missing)} "
                          "(DeepSeek's: q_proj, or q_a_proj + q_a_layernorm + q_b_proj; "
                          "kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)")
    return linears


def _latent_dims(module, num_heads=None):
    """The `latent_attention` dims of a latent module (its attributes, else
    its config), and its num_heads, checked against its linears' shapes."""
    linears = _latent_linears(module)

    def dim(name):
        value = _first_attr(module, [name])
        if value is None or value is False:
            raise ExportError(f"multi-head latent attention that says no {name}")
        return int(value)
    h = num_heads or _first_attr(module, ["num_heads", "num_attention_heads"])
    if not h:
        raise ExportError("multi-head latent attention that says no num_heads: pass num_heads=")
    h = int(h)
    kv_rank, rope, nope, dv = (dim(n) for n in ("kv_lora_rank", "qk_rope_head_dim",
                                                  "qk_nope_head_dim", "v_head_dim"))
    q_rank = linears["q_a_proj"].out_features if "q_a_proj" in linears else 0
    query = linears.get("q_b_proj") or linears["q_proj"]
    for name, got, want in (
            ("kv_a_proj_with_mqa outputs", linears["kv_a_proj_with_mqa"].out_features,
             kv_rank + rope),
            ("kv_b_proj inputs", linears["kv_b_proj"].in_features, kv_rank),
            ("kv_b_proj outputs", linears["kv_b_proj"].out_features, h * (nope + dv)),
            ("query projection outputs", query.out_features, h * (nope + rope)),
            ("o_proj inputs", linears["o_proj"].in_features, h * dv)):
        if got != want:
            raise ExportError(f"multi-head latent attention whose {name} are {got}, not {want} "
                              f"(num_heads {h}, kv_lora_rank {kv_rank}, qk_nope_head_dim {nope}, "
                              f"qk_rope_head_dim {rope}, v_head_dim {dv})")
    return dict(num_heads=h, q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_nope_head_dim=nope,
                qk_rope_head_dim=rope, v_head_dim=dv)


def _latent_norm_eps(module, name, width):
    """eps of a latent module's RMSNorm child `name` (q_a_layernorm,
    kv_a_layernorm), checked to compute x / sqrt(mean(x^2) + eps) * w on two
    probes: one of unit scale, one whose mean of squares equals eps (so a
    wrong eps shows). ExportError naming the norm for any other form."""
    norm = getattr(module, name, None)
    weight = getattr(norm, "weight", None)
    shape = None if weight is None else tuple(weight.shape)
    if not isinstance(norm, torch.nn.Module) or shape != (width,):
        raise ExportError(f"{name} {type(norm).__name__} with weight {shape}, not an RMSNorm of "
                          f"({width},)")
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps > 0:
        raise ExportError(f"{name} {type(norm).__name__} says no eps (variance_epsilon or eps)")
    x = torch.linspace(-2.0, 3.0, width, dtype=torch.float64)
    for probe in (x, x * math.sqrt(eps) / torch.sqrt((x * x).mean())):
        try:
            offset = _norm_form(norm, float(eps), probe.to(weight.dtype),
                                weight.detach().double().flatten())
        except ExportError:
            offset = None
        if offset is not False:
            raise ExportError(f"{name} {type(norm).__name__}, which computes "
                              f"{'x * (1 + w)' if offset else 'something else'}, not RMSNorm "
                              f"x / sqrt(mean(x^2) + {eps}) * w")
    return float(eps)


def _latent_scale(module, which):
    """The scalar (1.0 without) a latent module multiplies its query
    (which="query") or its normalised key/value latent ("kv") by."""
    for name in _LATENT_SCALES[which]:
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    return 1.0


def _latent_rope(module, rope_dim):
    """The `rope` of a latent module (None without), over its
    qk_rope_head_dim features, as its model type pairs them."""
    config = getattr(module, "config", None)
    model_type = _config_value(config, "model_type")
    heads = _config_value(config, "num_attention_heads")
    hidden = _config_value(config, "hidden_size")
    # transformers' rotary class rotates config.head_dim (DeepSeek sets it to
    # qk_rope_head_dim) times any partial_rotary_factor (Mistral 4).
    head_dim = _config_value(config, "head_dim") or (hidden // heads if hidden and heads else
                                                     rope_dim)
    rope = rope_config(module, int(head_dim))
    if rope is None and _LATENT_ROPE.get(model_type) is not None:
        raise ExportError(f"multi-head latent attention of model type {model_type!r} without "
                          "RoPE parameters in its config (its rotary features rotate)")
    if rope is not None and rope["rotary_dim"] != rope_dim:
        raise ExportError(f"RoPE over {rope['rotary_dim']} features, not the qk_rope_head_dim "
                          f"{rope_dim} of multi-head latent attention")
    return rope


def _has_dsa_indexer(module):
    """Whether latent layer `module` selects keys by DSA's indexer (its own,
    or, on a "shared" layer, the previous layer's top-k: indexer None)."""
    return hasattr(module, "indexer") or hasattr(module, "skip_topk")


def _latent_unsupported(module):
    """What a latent module computes that attnserve does not: a model type
    whose RoPE pairing is unknown, children and parameters DeepSeek's
    attention has not (an indexer, gates, sinks), windows, norms of another
    form, a RoPE attnserve does not compute."""
    found = []
    config = getattr(module, "config", None)
    model_type = _config_value(config, "model_type")
    children = {n for n, c in module.named_children() if c is not None}
    if _has_dsa_indexer(module):
        children.add("indexer")  # None on DSA layers that reuse another's top-k
        if model_type in _DSA_DENSE_UP_TO and _config_value(config, "index_topk"):
            children.discard("indexer")  # dense up to index_topk keys (sparse_index_topk)
    for name in sorted(children - _LATENT_CHILDREN):
        found.append(_LATENT_EXTRAS.get(name) or
                     f"a child {name} ({type(getattr(module, name, None)).__name__}) that "
                     "DeepSeek's attention has not")
    for name in sorted(n for n, p in module.named_parameters(recurse=False) if p is not None):
        found.append("attention sinks" if name == "sinks" else
                     f"a parameter {name} that DeepSeek's attention has not")
    window = getattr(module, "sliding_window", None) or _config_value(config, "sliding_window")
    if window and _config_value(config, "use_sliding_window") is not False:
        found.append(f"a sliding window of {window} tokens on multi-head latent attention")
    if getattr(module, "attn_temperature_tuning", False):
        found.append("attention temperature tuning on multi-head latent attention")
    try:
        _position_scaling(module)  # Mistral 4's is served; another model type's refused
    except ExportError as e:
        found.append(str(e))
    clip = getattr(module, "clip_qkv", None) or _config_value(config, "clip_qkv")
    if clip:
        found.append(f"QKV clipping (clip_qkv={clip}) on multi-head latent attention")
    try:
        dims = _latent_dims(module)
    except ExportError as e:
        return found + [str(e)]
    for name in ("q_b_proj", "q_proj", "kv_b_proj"):
        lin = _linear(module, name)
        if lin is not None and lin.bias is not None:
            found.append(f"a bias on {name} (DeepSeek's has none)")
    norms = [("kv_a_layernorm", dims["kv_lora_rank"])]
    if dims["q_lora_rank"]:
        norms.insert(0, ("q_a_layernorm", dims["q_lora_rank"]))
    for name, width in norms:
        try:
            _latent_norm_eps(module, name, width)
        except ExportError as e:
            found.append(str(e))
    if model_type in _LATENT_ROPE:
        try:
            _latent_rope(module, dims["qk_rope_head_dim"])
        except ExportError as e:
            found.append(str(e))
    if getattr(module, "scaling", None) is None and getattr(module, "softmax_scale", None) is None:
        found.append("a softmax scale the module does not say (scaling or softmax_scale: "
                     "DeepSeek folds YaRN's mscale into it)")
    if model_type not in _LATENT_ROPE:
        found.append(f"multi-head latent attention of model type {model_type!r}, whose RoPE "
                     f"pairing and extras attnserve does not know (known: "
                     f"{', '.join(sorted(_LATENT_ROPE))})")
    return found


def latent_attention_config(module, num_heads=None):
    """The `latent_attention` of an attnserve ModelConfig for a module of
    multi-head latent attention (DeepSeek-V2/V3 and their copies), with the
    module's RMSNorm eps; ExportError naming what does not fit."""
    dims = _latent_dims(module, num_heads)
    latent = dict(q_lora_rank=dims["q_lora_rank"], kv_lora_rank=dims["kv_lora_rank"],
                  qk_rope_head_dim=dims["qk_rope_head_dim"], v_head_dim=dims["v_head_dim"])
    if dims["q_lora_rank"]:
        latent["q_norm_eps"] = _latent_norm_eps(module, "q_a_layernorm", dims["q_lora_rank"])
    latent["kv_norm_eps"] = _latent_norm_eps(module, "kv_a_layernorm", dims["kv_lora_rank"])
    return latent, dims


def _describe_latent(module, num_heads):
    """(config, tensors) of multi-head latent attention: DeepSeek's tensor
    names (the SEPARATE_QKV defaults of the latent roles), the module's own
    softmax scale (with YaRN's mscale), causal."""
    missing = _latent_unsupported(module)
    if missing:
        raise ExportError(f"{type(module).__name__} uses {'; '.join(missing)}, which attnserve "
                          "does not compute yet: refused rather than served with different "
                          "numbers (docs/MODELS.md)")
    latent, dims = latent_attention_config(module, num_heads)
    linears = _latent_linears(module)
    h, rope_dim = dims["num_heads"], dims["qk_rope_head_dim"]
    q_scale, kv_scale = _latent_scale(module, "query"), _latent_scale(module, "kv")
    tensors = {}
    for name, lin in linears.items():
        tensors[f"{name}.weight"] = lin.weight
        if lin.bias is not None:
            tensors[f"{name}.bias"] = lin.bias
    tensors["kv_a_layernorm.weight"] = module.kv_a_layernorm.weight
    if latent["q_lora_rank"]:
        tensors["q_a_layernorm.weight"] = module.q_a_layernorm.weight
    query = "q_b_proj.weight" if latent["q_lora_rank"] else "q_proj.weight"
    if q_scale != 1.0:
        tensors[query] = tensors[query].detach() * q_scale
    if kv_scale != 1.0:
        tensors["kv_a_layernorm.weight"] = tensors["kv_a_layernorm.weight"].detach() * kv_scale
    kv_a, o = linears["kv_a_proj_with_mqa"], linears["o_proj"]
    q_a = linears.get("q_a_proj")
    scale = getattr(module, "scaling", None) or getattr(module, "softmax_scale")
    config = dict(kind="mha", embed_dim=kv_a.in_features, num_heads=h, num_kv_heads=h,
                  head_dim=dims["qk_nope_head_dim"] + rope_dim, query_dim=kv_a.in_features,
                  key_dim=kv_a.in_features, value_dim=kv_a.in_features, out_dim=o.out_features,
                  q_bias=q_a is not None and q_a.bias is not None, k_bias=kv_a.bias is not None,
                  v_bias=False, out_bias=o.bias is not None, weight_layout="SEPARATE_QKV",
                  scale=float(scale), latent_attention=latent)
    rope = _latent_rope(module, rope_dim)
    if rope is not None:
        config["rope"] = rope
    temperature = _position_scaling(module)  # Mistral 4
    if temperature is not None:
        config["temperature_tuning"] = temperature
    if _has_dsa_indexer(module):  # of a type in _DSA_DENSE_UP_TO (_latent_unsupported)
        config["sparse_index_topk"] = int(_config_value(module.config, "index_topk"))
    return config, tensors


class _QueryOfGated:
    """A q_proj that holds each head's gate rows after its query rows
    (_OUTPUT_GATES "query_per_head"), seen as the query projection it holds:
    its tensors as they are, half its outputs."""

    def __init__(self, linear):
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features // 2


def output_gate_config(module, num_heads, head_dim):
    """The `output_gate` of an attnserve ModelConfig for a module of gated
    attention (_OUTPUT_GATES), with the gate's tensors: {} for
    "query_per_head" (they stay in q_proj.*), gate_proj.* for "separate";
    (None, {}) for other model types."""
    config = getattr(module, "config", None)
    where = _OUTPUT_GATES.get(_config_value(config, "model_type"))
    if where is None:
        return None, {}
    width = num_heads * head_dim
    if where == "query_per_head":
        q = _linear(module, "q_proj")
        if q is None or q.out_features != 2 * width:
            raise ExportError(f"gated attention whose q_proj has {getattr(q, 'out_features', 0)} "
                              f"outputs, not 2 * num_heads {num_heads} * head_dim {head_dim} "
                              "(each head's query, then its gate)")
        return dict(weights="query_per_head"), {}
    gate = _linear(module, "gate_proj")
    if gate is None or gate.out_features != width:
        raise ExportError(f"gated attention without a gate_proj of num_heads {num_heads} * "
                          f"head_dim {head_dim} outputs")
    tensors = {"gate_proj.weight": gate.weight}
    if gate.bias is not None:
        tensors["gate_proj.bias"] = gate.bias
    return dict(weights="separate", bias=gate.bias is not None), tensors


def _describe_stacked(module, qkv, qkv_name, out_name, num_heads, num_kv_heads, head_dim):
    """One linear of rows [q (H*hd) | k (Hkv*hd) | v (Hkv*hd)] (Phi-3's
    qkv_proj, DBRX's Wqkv), served as the three projections they are."""
    o = _linear(module, out_name)
    if o is None:
        raise ExportError(f"module has {qkv_name} but no {out_name} output linear")
    h, hkv, hd = _heads(module, num_heads, num_kv_heads, head_dim, o.in_features)
    hkv = hkv or h
    q_rows, kv_rows = h * hd, hkv * hd
    if qkv.out_features != q_rows + 2 * kv_rows:
        raise ExportError(f"{qkv_name} has {qkv.out_features} outputs, not num_heads {h} * "
                          f"head_dim {hd} + 2 * num_kv_heads {hkv} * head_dim")
    q, k, v = (_Rows(qkv, a, b) for a, b in ((0, q_rows), (q_rows, q_rows + kv_rows),
                                               (q_rows + kv_rows, q_rows + 2 * kv_rows)))
    return _describe_separate(module, q, k, v, o, out_name, h, hkv, hd)


# Model types whose Wqkv holds rows [q | k | v] (grouped-query widths), and
# their output linear.
_STACKED_WQKV = {"dbrx": "out_proj", "modernbert": "Wo", "mpt": "out_proj"}


def _keys_are_values(module):
    """Whether `module` takes its values from its key projection: Gemma 4's
    attention_k_eq_v on its full layers (use_alternative_attention, no
    v_proj): value = v_norm(k_proj(x)), k_proj's output before k_norm and
    RoPE, which a v_proj of k_proj's weights computes."""
    model_type = _config_value(getattr(module, "config", None), "model_type")
    return model_type == "gemma4_text" and getattr(module, "use_alternative_attention", False) \
        and getattr(module, "v_proj", "none") is None


def _bert_parts(module):
    """(q, k, v, o, out_name, self-attention module) of BERT's attention
    (BertAttention and its copies: RoBERTa, XLM-R, ...: `self.query`,
    `.key`, `.value`, then `output.dense`) and DistilBERT's (`q_lin`,
    `k_lin`, `v_lin`, `out_lin`); None for any other module."""
    sa, out = getattr(module, "self", None), getattr(module, "output", None)
    if sa is not None and out is not None and _linear(out, "dense") is not None:
        q, k, v = (_linear(sa, n) for n in ("query", "key", "value"))
        if q is not None and k is not None and v is not None:
            return q, k, v, _linear(out, "dense"), "output.dense", sa
    q, k, v, o = (_linear(module, n) for n in ("q_lin", "k_lin", "v_lin", "out_lin"))
    if q is not None and k is not None and v is not None and o is not None:
        return q, k, v, o, "out_lin", module
    return None


def _bert_causal(sa):
    """Whether BERT self-attention `sa` is causal: its own is_causal
    (transformers 5.x), else False for an encoder's; a decoder's (4.x
    is_decoder) module does not say whether it is causal self-attention or
    cross-attention, so it is refused without causal=."""
    causal = getattr(sa, "is_causal", None)
    if causal is not None:
        return bool(causal)
    if getattr(sa, "is_decoder", False):
        raise ExportError(f"{type(sa).__name__} of a decoder (is_decoder): causal self-attention "
                          "or cross-attention, which the module does not say; pass causal=")
    return False


def _describe_bert(module, parts, num_heads, head_dim):
    """BERT's attention: the projections and softmax of its self-attention,
    then output.dense; BertSelfOutput's dropout, residual and LayerNorm (the
    rest of BertAttention's forward) are not attention and stay with the
    caller. Its own relative position embeddings (relative_key,
    relative_key_query) on an encoder, as relative_embeddings."""
    q, k, v, o, out_name, sa = parts
    kind = getattr(sa, "position_embedding_type", None) or "absolute"
    if kind not in ("absolute", *_BERT_RELATIVE):
        raise ExportError(f"{type(sa).__name__} with position_embedding_type {kind!r}, which "
                          "attnserve does not compute: refused rather than served with different "
                          "numbers")
    if kind != "absolute" and getattr(sa, "is_decoder", False):
        # Its cross-attention places the queries at 0.. (top-left), its
        # cached decode at the last key: not one rule attnserve can follow.
        raise ExportError(f"{type(sa).__name__} of a decoder (is_decoder) with "
                          f"position_embedding_type {kind!r}: its relative positions in "
                          "cross-attention count from the first key, not attnserve's "
                          "bottom-right rule; served for encoders only")
    h = num_heads or _first_attr(sa, ["num_attention_heads", "n_heads"])
    hd = head_dim or _first_attr(sa, ["attention_head_size"]) or q.out_features // int(h)
    return _describe_separate(module, q, k, v, o, out_name, int(h), int(h), int(hd))


def _qkvo_parts(module):
    """(module holding them, q, k, v, o, out_name) of the attention of a
    relative-bias model type whose linears are named q, k, v, o (T5 and its
    copies; MPNetSelfAttention, and MPNetAttention through its `attn`, whose
    LayerNorm and residual stay with the caller, as BertSelfOutput's); None
    otherwise."""
    kind = _relative_kind(module)
    if kind is None:
        return None
    inner, prefix = module, ""
    if kind == "mpnet" and isinstance(getattr(module, "attn", None), torch.nn.Module):
        inner, prefix = module.attn, "attn."
    q, k, v, o = (_linear(inner, n) for n in ("q", "k", "v", "o"))
    if q is None or k is None or v is None or o is None:
        return None
    return inner, q, k, v, o, prefix + "o"


def _describe_deberta(module, parts, num_heads, head_dim):
    """DeBERTa's attention: its DisentangledSelfAttention's projections (v2's
    query_proj, key_proj and value_proj; v1's in_proj, [q_h | k_h | v_h] per
    head without a bias, and its q_bias and v_bias), then output.dense (the
    SelfOutput's dropout, residual and LayerNorm stay with the caller, as
    BERT's), scaled by 1 / sqrt(head_dim * (1 + its relative terms)). v1's
    talking heads (head_logits_proj, mixing the heads' scores) refused."""
    version, sa, o = parts
    if o is None:
        raise ExportError(f"{type(module).__name__} alone has no output projection: export "
                          f"{'DebertaV2Attention' if version == 2 else 'DebertaAttention'} (its "
                          "parent), whose output.dense is the attention's output projection")
    h = int(num_heads or sa.num_attention_heads)
    hd = int(head_dim or sa.attention_head_size)
    if version == 2:
        q, k, v = (_linear(sa, n) for n in ("query_proj", "key_proj", "value_proj"))
    else:
        if getattr(sa, "head_logits_proj", None) is not None or \
                getattr(sa, "head_weights_proj", None) is not None:
            raise ExportError(f"{type(sa).__name__} with talking heads (head_logits_proj, "
                              "head_weights_proj: each head's scores and probabilities mixed with "
                              "the others'), which attnserve does not compute: refused rather "
                              "than served with different numbers")
        # Head g's rows: [q_g | k_g | v_g] from g * 3 * head_dim.
        q, k, v = (_Rows(sa.in_proj, index=(torch.arange(h)[:, None] * 3 * hd + part * hd +
                                             torch.arange(hd)[None, :]).flatten())
                   for part in range(3))
        q.bias, v.bias = sa.q_bias, sa.v_bias
    config, tensors = _describe_separate(module, q, k, v, o, "output.dense", h, h, hd)
    config["scale"] = 1.0 / math.sqrt(hd * _deberta_terms(sa)[2])
    return config, tensors


def _describe_projections(module, num_heads, num_kv_heads, head_dim, qkv_layout):
    deberta = _deberta_parts(module)
    if deberta is not None:
        return _describe_deberta(module, deberta, num_heads, head_dim)
    bert = _bert_parts(module)
    if bert is not None:
        return _describe_bert(module, bert, num_heads, head_dim)
    qkvo = _qkvo_parts(module)
    if qkvo is not None:
        inner, q, k, v, o, out_name = qkvo
        hd = head_dim or getattr(inner, "key_value_proj_dim", None)  # T5's d_kv
        return _describe_separate(inner, q, k, v, o, out_name, num_heads, num_kv_heads, hd)
    q, k, v = (_linear(module, n) for n in ("q_proj", "k_proj", "v_proj"))
    model_type = _model_type(module)
    if v is None and k is not None and _keys_are_values(module):
        v = k
    if model_type in _DIMS_PER_LAYER and q is not None and k is not None:
        # Gemma 4's full layers have a head_dim and KV heads of their own
        # (global_head_dim, num_global_key_value_heads): the module's own
        # head_dim and linears say them, not the top-level config.
        hd = head_dim or getattr(module, "head_dim", None)
        if hd:
            num_heads = num_heads or q.out_features // int(hd)
            num_kv_heads = num_kv_heads or k.out_features // int(hd)
    if q is not None and _OUTPUT_GATES.get(model_type) == "query_per_head":
        h = num_heads or _first_attr(module, ("num_heads", "num_attention_heads"))
        hd = head_dim or _first_attr(module, ("head_dim",))
        if h and hd and q.out_features != 2 * h * hd:
            raise ExportError(f"gated attention ({model_type}) whose q_proj has "
                              f"{q.out_features} outputs, not 2 * num_heads {h} * head_dim {hd} "
                              "(each head's query, then its gate)")
        q = _QueryOfGated(q)
    if q is not None and k is not None and v is not None:
        for out_name in ("o_proj", "out_proj", "dense", "proj"):
            o = _linear(module, out_name)
            if o is not None:
                return _describe_separate(module, q, k, v, o, out_name, num_heads, num_kv_heads,
                                          head_dim)
        raise ExportError("module has q_proj/k_proj/v_proj but no o_proj, out_proj or dense linear")
    if _linear(module, "Wqkv") is not None:
        if model_type not in _STACKED_WQKV:
            raise ExportError(f"a fused Wqkv in {type(module).__name__} (model type "
                              f"{model_type!r}), whose attention attnserve does not know "
                              f"(served: {', '.join(sorted(_STACKED_WQKV))})")
        if model_type in ("modernbert", "mpt"):  # [q | k | v] of every head: no grouped queries
            num_kv_heads = num_kv_heads or num_heads or \
                _first_attr(module, ["n_heads"]) or \
                _config_value(getattr(module, "config", None), "num_attention_heads")
        return _describe_stacked(module, _linear(module, "Wqkv"), "Wqkv",
                                 _STACKED_WQKV[model_type], num_heads, num_kv_heads, head_dim)
    qkv = _linear(module, "qkv_proj")
    if qkv is not None:
        return _describe_stacked(module, qkv, "qkv_proj", "o_proj", num_heads, num_kv_heads,
                                 head_dim)
    qkv = _linear(module, "query_key_value")
    if qkv is not None and model_type == "falcon":
        return _describe_falcon(module, qkv, num_heads, head_dim)
    if qkv is not None:
        o = _linear(module, "dense")
        if o is None:
            raise ExportError("module has query_key_value but no dense output linear")
        if qkv_layout not in (None, "per_head"):
            raise ExportError("query_key_value (GPT-NeoX/Bloom style) is laid out per head")
        return _describe_fused(module, qkv, "query_key_value", o, "dense", True, num_heads, head_dim)
    qkv = _linear(module, "qkv")
    if qkv is not None:
        o = _linear(module, "proj") or _linear(module, "out_proj")
        if o is None:
            raise ExportError("module has qkv but no proj or out_proj output linear")
        if qkv_layout not in ("per_head", "packed"):
            raise ExportError("a `qkv` linear is laid out either per head ([q_h | k_h | v_h], "
                              "reshape [B, L, H, 3*hd]) or packed ([q | k | v], reshape "
                              "[B, L, 3, H, hd] as timm does): pass qkv_layout='per_head' or 'packed'")
        out_name = "proj" if _linear(module, "proj") is not None else "out_proj"
        return _describe_fused(module, qkv, "qkv", o, out_name, qkv_layout == "per_head",
                               num_heads, head_dim)
    biases = _caller_biases(module) if _relative_kind(module) is None else []
    raise ExportError(f"{type(module).__name__} is not a recognised attention module "
                      "(nn.MultiheadAttention, q_proj/k_proj/v_proj/o_proj, qkv_proj/o_proj, "
                      "Wqkv/out_proj, query_key_value/dense, qkv/proj)" +
                      "".join(f"; it takes {b}" for b in biases))


_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _find_kv_source(model, module):
    """(dotted name, module) in `model` of the layer whose keys and values
    KV-shared `module` reuses; (None, None) when it has none there."""
    layer = getattr(module, "layer_idx", None)
    want = kv_source_layer(module.config, layer) if layer is not None else None
    for name, child in model.named_modules():
        if type(child) is type(module) and getattr(child, "layer_idx", None) == want and \
                child is not module:
            return name, child
    return None, None


def export_module(model, folder, *, submodule=None, name=None, causal=None, scale=None,
                  precision="fp32", storage_dtype=None, full_state_dict=False, num_heads=None,
                  num_kv_heads=None, head_dim=None, qkv_layout=None, batching=None, instances=0,
                  backend="", kv_source=None):
    """Writes an attnserve model folder for `model` (or its attention child named
    by the dotted `submodule`). Returns the config dict written.

    causal: None = the module's own `is_causal` attribute if any, else True
      for latent attention and sliding windows, False otherwise. A sliding
      window is one-sided with causal and two-sided without (refused where
      that is not the module's).
    kv_source: a layer that reuses an earlier layer's keys and values (KV
      sharing: Gemma 3n's and Gemma 4's last num_kv_shared_layers) is
      exported with that layer's k_proj, v_proj and norms, and its requests
      must carry that layer's input as key and value; the layer is found in
      `model` when `submodule` is given, else pass it (a module, or a dotted
      name in `model`).
    scale: None = the module's own `scaling`/`scale` when it differs from
      1/sqrt(head_dim), else attnserve's default.
    precision: "fp32", "bf16" or "fp16" (weights and compute on the server).
    storage_dtype: dtype of the stored tensors ("float32", "bfloat16",
      "float16"); default: that of `precision`.
    full_state_dict: store the whole model's state_dict and point
      tensor_prefix at the submodule (as a many-layer checkpoint would be).
    """
    if torch is None:
        raise ExportError("PyTorch is not importable")
    if precision not in _PRECISION_DTYPES:
        raise ExportError(f"precision must be one of {sorted(_PRECISION_DTYPES)}, got {precision!r}")
    module = model.get_submodule(submodule) if submodule else model
    source_name = None
    if isinstance(kv_source, str):
        source_name, kv_source = kv_source, model.get_submodule(kv_source)
    elif kv_source is None and submodule and _kv_shared(module):
        source_name, kv_source = _find_kv_source(model, module)
    relative_source = _relative_bias_source(model, submodule, module) if submodule else None
    config, tensors = describe_module(module, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, qkv_layout=qkv_layout,
                                      kv_source=kv_source,
                                      model_config=getattr(model, "config", None),
                                      relative_bias_source=relative_source)
    if source_name:
        config["kv_source"] = source_name
    config["name"] = name or os.path.basename(os.path.normpath(folder))
    if causal is None:
        # Without the module's word: a latent layer is a decoder's (DeepSeek's
        # modules say so too), as is one that slides a window (one-sided).
        causal = getattr(module, "is_causal", None)
        if causal is None and _relative_kind(module) == "t5":
            # transformers 4.x: a decoder's self-attention (which alone holds
            # or takes the relative bias), not its cross-attention.
            causal = bool(getattr(module, "is_decoder", False)) and relative_source is not False
        bert = _bert_parts(module)
        if causal is None and bert is not None:
            causal = _bert_causal(bert[5])
        if causal is None:  # ALiBi's model types are decoders (BLOOM, MPT)
            causal = "latent_attention" in config or bool(config.get("sliding_window")) or \
                "alibi_slopes" in config
    config["causal"] = bool(causal)
    two_sided = getattr(module, "is_causal", None) is False
    if config.get("sliding_window") and two_sided == config["causal"]:
        # attnserve's window is one-sided with causal and two-sided without.
        raise ExportError(
            f"causal={config['causal']} on {type(module).__name__}, whose sliding window "
            f"({config['sliding_window']}) is {'two' if two_sided else 'one'}-sided: attnserve's "
            f"window is one-sided with causal and two-sided without; export it with "
            f"causal={not two_sided}")
    if scale is None:
        scale = _scale_of(module, config["head_dim"])
    if scale:
        config["scale"] = float(scale)
    config["precision"] = precision
    if batching:
        config["batching"] = dict(batching)
    if instances:
        config["instances"] = int(instances)
    if backend:
        config["backend"] = backend
    dtype = getattr(torch, storage_dtype or _PRECISION_DTYPES[precision])

    if full_state_dict and submodule:
        config["tensor_prefix"] = submodule + "."
        own = module.state_dict()
        # Tensors the export computed (weights of 1 for a weightless norm,
        # scales folded in) replace the checkpoint's under the prefix.
        computed = {config["tensor_prefix"] + n: t for n, t in tensors.items()
                    if n not in own or t.data_ptr() != own[n].data_ptr()}
        tensors = dict(model.state_dict())
        tensors.update(computed)
    tensors = {n: t.detach().to(dtype) for n, t in tensors.items() if torch.is_floating_point(t)}
    metadata = {"format": "pt", "producer": "attnserve_client.export",
                "module": type(module).__name__}
    write_model_folder(folder, config, tensors, metadata)
    return config


# ---------------------------------------------------------------------------
# CLI

def _load_model(checkpoint, factory):
    if factory:
        mod_name, _, fn_name = factory.partition(":")
        if not fn_name:
            raise ExportError(f"--factory must be module:callable, got {factory!r}")
        model = getattr(importlib.import_module(mod_name), fn_name)()
        if checkpoint:
            state = torch.load(checkpoint, map_location="cpu")
            if isinstance(state, dict) and "state_dict" in state:
                state = state["state_dict"]
            model.load_state_dict(state)
        return model
    if not checkpoint:
        raise ExportError("give --checkpoint (a pickled module) and/or --factory")
    # A pickled module is code as well as tensors: torch 2.6 and newer load
    # only tensors by default (weights_only=True), so it is asked for here,
    # for a file the caller chose (load only files you trust).
    obj = torch.load(checkpoint, map_location="cpu", weights_only=False)
    if isinstance(obj, torch.nn.Module):
        return obj
    raise ExportError(f"{checkpoint} holds a {type(obj).__name__}, not a module: a state_dict has "
                      "no structure to export; add --factory module:callable that builds the model")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="model folder to write (its name is the model name by default)")
    p.add_argument("--checkpoint", help="torch.save()d module, or a state_dict with --factory")
    p.add_argument("--factory", help="module:callable returning the model (for a state_dict)")
    p.add_argument("--module", default="", help="dotted name of the attention submodule")
    p.add_argument("--name", help="model name (default: the folder name)")
    causal = p.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_true", default=None)
    causal.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--scale", type=float, help="softmax scale (default: the module's, else 1/sqrt(head_dim))")
    p.add_argument("--precision", default="fp32", choices=sorted(_PRECISION_DTYPES))
    p.add_argument("--storage-dtype", choices=sorted(set(_PRECISION_DTYPES.values())))
    p.add_argument("--full-state-dict", action="store_true",
                   help="store the whole state_dict and set tensor_prefix to --module")
    p.add_argument("--num-heads", type=int)
    p.add_argument("--num-kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--qkv-layout", choices=["per_head", "packed"])
    p.add_argument("--backend", default="", choices=["", "auto", "cpu", "cuda", "reference"])
    p.add_argument("--kv-source", help="dotted name of the layer whose keys and values a "
                   "KV-shared --module reuses (default: found in the model)")
    args = p.parse_args(argv)
    try:
        model = _load_model(args.checkpoint, args.factory)
        model.eval()
        config = export_module(model, args.folder, submodule=args.module or None, name=args.name,
                               causal=args.causal, scale=args.scale, precision=args.precision,
                               storage_dtype=args.storage_dtype, full_state_dict=args.full_state_dict,
                               num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                               head_dim=args.head_dim, qkv_layout=args.qkv_layout,
                               backend=args.backend, kv_source=args.kv_source)
    except (ExportError, AttributeError, OSError, RuntimeError) as e:
        print(f"export_torch: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.folder}/config.pbtxt and weights.safetensors "
          f"({config['weight_layout']}, {config['num_heads']} heads, precision {config['precision']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
