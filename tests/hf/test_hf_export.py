"""Today's LLM attention layers, built from transformers' own classes with
random weights (no download), as attnserve exports and serves them.

Rotary position embeddings (default, linear, llama3 and YaRN scaling; partial
rotary) are served exactly: each layer is exported, served by the real
server, and compared with the module's own forward in float64 (short
sequences, where transformers' fp32 angles are exact enough) and with an
independent NumPy float64 implementation of transformers' RoPE formulas at
positions in the thousands (within 2e-5). A session's prefill then one token
a step equals one causal request. Whatever else a layer computes that
attnserve does not (windows placed by a model's own layer rule, other
RoPE scalings or layouts, other norms, sinks not one per head) is refused at
export by name. QK-norm (Qwen3, and Gemma3's 1 + w), sliding windows
(Mistral; Gemma2's and gpt-oss's every other layer), logit softcapping
(Gemma2) and attention sinks (gpt-oss) are served exactly too, and so are LongRoPE (Phi-3.5,
Phi-4-mini: its factors picked per request, a session's cached keys keeping theirs), QK-norm
over the whole projection (OLMo-2) and LayerNorm QK-norm with weights per head (Cohere's
use_qk_norm, Command R+; StableLM 2's qk_layernorm), gated attention (Qwen3-Next and Qwen3.5, the gate inside
q_proj; AFMoE, a gate_proj), Llama 4's chunked attention and query temperature, DeepSeek's
multi-head latent attention (LATENT_FAMILIES), QKV clipping (OLMo, OLMoE after its QK-norm,
DBRX's fused Wqkv: clip_qkv small enough that many features clamp, and their real 8), and the
same attention under other model types (MoE variants and others, MORE_FAMILIES). transformers
4.45.2 is the newest that imports with Debian's torch 1.13: families that need a newer one
(Qwen3, Gemma3, OLMo-2, Hunyuan, gpt-oss, Qwen3-Next, AFMoE, Llama 4, DeepSeek; Gemma 3n and
Gemma 4: their weightless norm of V, Gemma 4's proportional RoPE, head_dim per layer and values
from k_proj) are stood in for by modules built from transformers' parts;
tests/hf/current_transformers.py checks the real classes of transformers 5.x."""

import math
import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from attnserve_client.export import ExportError, export_module  # noqa: E402

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=256)
PHI3_ORIGINAL = 32
PHI3_LONGROPE = dict(type="longrope",
                     short_factor=[1.0, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 2.5],
                     long_factor=[1.0, 1.3, 2.0, 3.5, 6.0, 10.0, 16.0, 24.0])


def _served_module(family):
    """A module attnserve serves exactly, and how its RoPE is set up."""
    torch.manual_seed(hash(family) % 1000)
    if family in ("llama4", "llama4-nope"):
        m = _Llama4Attention(use_rope=family == "llama4")
    elif family == "ministral3":
        m = _Ministral3Attention()
    elif family in GEMMA4_FAMILIES:
        m = _Gemma4Attention(family)
    elif family.startswith("llama"):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention
        extra = {"llama": {},
                 "llama-linear": dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
                 "llama3": dict(rope_scaling=LLAMA3, max_position_embeddings=4096, rope_theta=5e5),
                 "llama-yarn": dict(rope_scaling=dict(rope_type="yarn", factor=4.0),
                                    max_position_embeddings=512)}[family]
        m = LlamaAttention(LlamaConfig(**COMMON, **extra), layer_idx=0)
    elif family in ("mistral-no-window", "mistral"):
        from transformers import MistralConfig
        from transformers.models.mistral.modeling_mistral import MistralAttention
        window = None if family == "mistral-no-window" else WINDOW
        m = MistralAttention(MistralConfig(**COMMON, sliding_window=window), layer_idx=0)
    elif family == "phi3":
        from transformers import Phi3Config
        from transformers.models.phi3.modeling_phi3 import Phi3Attention
        m = Phi3Attention(Phi3Config(**COMMON), layer_idx=0)  # one qkv_proj, GQA widths
    elif family == "phi3-mini-4k":
        # Phi-3-mini-4k's sliding window (2047 over its 4096 positions; WINDOW
        # here), which 4.45.2's module leaves to the mask it is given: the
        # windowed mask transformers 5.x builds in every attention path.
        from transformers import Phi3Config
        from transformers.models.phi3.modeling_phi3 import Phi3Attention
        m = Phi3Attention(Phi3Config(**COMMON, sliding_window=WINDOW), layer_idx=0)
    elif family == "phi3-longrope":
        # Phi-3.5 / Phi-4-mini's LongRoPE, its training context shrunk to 32
        # tokens so that short and long requests are both a few dozen; the
        # window, as theirs, wider than the model's positions.
        from transformers import Phi3Config
        from transformers.models.phi3.modeling_phi3 import Phi3Attention
        config = Phi3Config(**COMMON, rope_scaling=PHI3_LONGROPE, sliding_window=8192,
                            original_max_position_embeddings=PHI3_ORIGINAL,
                            max_position_embeddings=4096)
        m = Phi3Attention(config, layer_idx=0)
    elif family == "qwen2":
        from transformers import Qwen2Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
        m = Qwen2Attention(Qwen2Config(**COMMON, rope_theta=1e6), layer_idx=0)
    elif family == "gpt-neox":
        from transformers import GPTNeoXConfig
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention
        m = GPTNeoXAttention(GPTNeoXConfig(hidden_size=64, num_attention_heads=4,
                                           intermediate_size=128, rotary_pct=0.5), layer_idx=0)
    elif family.startswith("gemma2"):
        from transformers import Gemma2Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
        config = Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=WINDOW, attn_logit_softcapping=5.0)
        # Layer 0 slides over WINDOW keys, layer 1 attends to all.
        m = Gemma2Attention(config, layer_idx=0 if family == "gemma2-sliding" else 1)
    elif family in MORE_FAMILIES:
        # transformers 4.45.2's own class, with the model's own rotary class
        # where the module takes its position embeddings from the model.
        import importlib
        model_type, prefix, extra = MORE_FAMILIES[family]
        config = getattr(importlib.import_module(f"transformers.models.{model_type}."
                                                 f"configuration_{model_type}"),
                         f"{prefix}Config")(**COMMON, **extra)
        config._attn_implementation = "eager"
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_"
                                           f"{model_type}")
        with _layer_norm_without_bias(extra.get("qk_layernorm", False)):
            m = getattr(modeling, f"{prefix}Attention")(config, layer_idx=0)
        if getattr(m, "rotary_emb", None) is None:
            m.test_rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config=config)
        if family in ("cohere-qk-norm", "stablelm-qk-layernorm"):
            with torch.no_grad():  # every head's norm weights its own, far from 1
                for norm in (getattr(m, n, None) for n in ("q_norm", "k_norm", "q_layernorm",
                                                            "k_layernorm")):
                    for part in getattr(norm, "norms", [norm] if norm is not None else []):
                        part.weight.uniform_(0.5, 1.5)
    elif family in ("qwen3", "gemma3", "olmo2"):
        m = _QkNormAttention(family)
    elif family == "hunyuan":
        m = _QkNormAttention("hunyuan_v1_dense")
    elif family == "qwen3-next":
        m = _GatedAttention("qwen3_next")
    elif family == "afmoe":
        m = _GatedAttention("afmoe")

    elif family.startswith("gpt-oss"):
        m = _GptOssAttention(sliding=family == "gpt-oss-sliding")
    elif family in ("dbrx", "dbrx-clip"):
        # One Wqkv of rows [q | k | v] with grouped-query widths, out_proj;
        # DBRX's theta and clip_qkv 8 (its real ones), or CLIP.
        from transformers import DbrxConfig
        from transformers.models.dbrx.modeling_dbrx import DbrxAttention
        clip = 8 if family == "dbrx" else CLIP
        config = DbrxConfig(d_model=64, n_heads=4, n_layers=2, attn_config=dict(
            kv_n_heads=2, clip_qkv=clip, rope_theta=5e5))
        m = DbrxAttention(config, block_idx=0)
    elif family in LATENT_FAMILIES:
        m = _DeepseekV3Attention(family)
    else:
        raise AssertionError(family)
    with torch.no_grad():  # biases (Qwen2, NeoX) away from zero, so that they count
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.eval()


def _layer_norm_without_bias(needed):
    """A context in which nn.LayerNorm takes transformers 4.45.2's bias=False
    (StableLM's qk_layernorm), which torch 1.13's lacks: a LayerNorm whose bias
    is taken away, (x - mean) / sqrt(var + eps) * w as torch 2's computes;
    nothing changed unless needed."""
    import contextlib
    from unittest import mock
    if not needed:
        return contextlib.nullcontext()
    layer_norm = nn.LayerNorm

    def make(*args, bias=True, **kwargs):
        norm = layer_norm(*args, **kwargs)
        if not bias:
            norm.bias = None
        return norm
    return mock.patch.object(nn, "LayerNorm", make)


WINDOW = 16  # Mistral's sliding window in these tests (its real one is 4096)
# QKV clipping in these tests: about half the projected features of OLMo and
# DBRX here, more of OLMoE's normalised ones, lie beyond it (the real
# clip_qkv, 8, clamps none at these scales).
CLIP = 0.25
# Variants of the attention above by model type (docs/MODELS.md), with
# their 4.45.2 classes: (model type, class prefix, config fields).
MORE_FAMILIES = {"qwen2-moe": ("qwen2_moe", "Qwen2Moe", {}),
                 "mixtral": ("mixtral", "Mixtral", dict(sliding_window=WINDOW)),
                 "starcoder2": ("starcoder2", "Starcoder2", dict(sliding_window=WINDOW)),
                 "cohere": ("cohere", "Cohere", {}),  # interleaved pairs
                 # Command R+'s use_qk_norm: LayerNorm without a bias over each
                 # head of Q and K, before RoPE, weights [heads, head_dim].
                 "cohere-qk-norm": ("cohere", "Cohere", dict(use_qk_norm=True)),
                 # StableLM: rotate-half over a quarter of each head; StableLM 2
                 # 12B's qk_layernorm, the same LayerNorm as one norm per head.
                 "stablelm": ("stablelm", "StableLm", dict(use_qkv_bias=True)),
                 "stablelm-qk-layernorm": ("stablelm", "StableLm",
                                           dict(use_qkv_bias=True, qk_layernorm=True)),
                 "olmoe": ("olmoe", "Olmoe", {}),  # QK-norm over the projection
                 # QKV clipping: OLMo-7B-0424's 8, and CLIP; OLMoE's after its QK-norm.
                 "olmo-0424": ("olmo", "Olmo", dict(clip_qkv=8.0)),
                 "olmo-clip": ("olmo", "Olmo", dict(clip_qkv=CLIP)),
                 "olmoe-clip": ("olmoe", "Olmoe", dict(clip_qkv=CLIP)),
                 "granite": ("granite", "Granite", dict(attention_multiplier=0.2)),
                 "nemotron": ("nemotron", "Nemotron", dict(partial_rotary_factor=0.5))}
FAMILIES = ["llama", "llama-linear", "llama3", "llama-yarn", "mistral-no-window", "mistral",
            "qwen2", "phi3", "phi3-mini-4k", "phi3-longrope", "gpt-neox", "qwen3", "gemma3",
            "olmo2", "hunyuan", "gemma2-sliding", "gemma2-full", "gpt-oss-sliding", "gpt-oss-full", "qwen3-next",
            "afmoe", "llama4", "ministral3", "deepseek-v3", "deepseek-v3-q-proj", "longcat-flash",
            "mistral4", "dbrx", "dbrx-clip", *MORE_FAMILIES, "gemma3n", "gemma4-sliding",
            "gemma4-full", "gemma4-full-k-eq-v"]


class _GptOssAttention(nn.Module):
    """gpt-oss's attention as transformers 5.x writes it, from transformers'
    own parts (4.45.2 has no gpt-oss): biased q/k/v/o projections, YaRN RoPE,
    a sliding window on alternate layers (the module's own sliding_window),
    and a learned sink logit per head appended to each row of scores before
    the softmax and dropped after it (eager_attention_forward)."""

    def __init__(self, sliding):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 16
        self.config = LlamaConfig(**COMMON, rope_theta=150000.0, max_position_embeddings=512,
                                  rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                                    beta_slow=1.0))
        self.config.model_type = "gpt_oss"
        self.sliding_window = WINDOW if sliding else None
        self.q_proj, self.k_proj = nn.Linear(64, 64), nn.Linear(64, 32)
        self.v_proj, self.o_proj = nn.Linear(64, 32), nn.Linear(64, 64)
        self.sinks = nn.Parameter(torch.randn(4))
        self.rotary = LlamaRotaryEmbedding(config=self.config)

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, 4, 16).transpose(1, 2)
        k = self.k_proj(x).view(b, length, 2, 16).transpose(1, 2)
        v = self.v_proj(x).view(b, length, 2, 16).transpose(1, 2)
        cos, sin = self.rotary(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = repeat_kv(k, 2), repeat_kv(v, 2)
        s = q @ k.transpose(2, 3) * 16 ** -0.5 + attention_mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, length, -1)
        combined = torch.cat([s, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]
        out = (probs @ v).transpose(1, 2).reshape(b, length, 64)
        return (self.o_proj(out),)


class _QkNormAttention(nn.Module):
    """Qwen3's attention (Gemma3's, OLMo-2's) as transformers 5.x writes it,
    built from transformers' own parts (4.45.2 has none of the three):
    q/k/v/o projections, RMSNorm over each head of Q and K (LlamaRMSNorm is
    Qwen3RMSNorm; GemmaRMSNorm multiplies by 1 + w, as Gemma3RMSNorm does),
    or for OLMo-2 over the whole projection before it is split into heads
    (Olmo2RMSNorm(num_heads * head_dim), which in fp32 is LlamaRMSNorm), then
    RoPE, grouped-query eager attention. Hunyuan's norms (query_layernorm,
    key_layernorm) run after RoPE instead."""

    def __init__(self, kind="qwen3"):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 16
        self.config = LlamaConfig(**COMMON, rope_theta=5e5 if kind == "olmo2" else 1e6,
                                  rms_norm_eps=1e-6)
        self.config.model_type = kind
        self.q_proj, self.k_proj = nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False)
        self.v_proj, self.o_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 64, bias=False)
        norm = GemmaRMSNorm if kind == "gemma3" else LlamaRMSNorm
        self.whole = kind == "olmo2"
        q_width, k_width = (64, 32) if self.whole else (16, 16)
        q_norm, k_norm = norm(q_width, eps=1e-6), norm(k_width, eps=1e-6)
        with torch.no_grad():
            q_norm.weight.uniform_(0.5, 1.5)
            k_norm.weight.uniform_(0.5, 1.5)
        self.after_rope = kind == "hunyuan_v1_dense"
        if self.after_rope:
            self.query_layernorm, self.key_layernorm = q_norm, k_norm
        else:
            self.q_norm, self.k_norm = q_norm, k_norm
        self.rotary = LlamaRotaryEmbedding(config=self.config)

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
        b, length, _ = x.shape
        if self.whole:  # Olmo2Attention: norm, then split into heads
            q = self.q_norm(self.q_proj(x)).view(b, length, 4, 16).transpose(1, 2)
            k = self.k_norm(self.k_proj(x)).view(b, length, 2, 16).transpose(1, 2)
        elif self.after_rope:  # HunYuanDenseV1Attention: the norms come after RoPE
            q = self.q_proj(x).view(b, length, 4, 16).transpose(1, 2)
            k = self.k_proj(x).view(b, length, 2, 16).transpose(1, 2)
        else:
            q = self.q_norm(self.q_proj(x).view(b, length, 4, 16)).transpose(1, 2)
            k = self.k_norm(self.k_proj(x).view(b, length, 2, 16)).transpose(1, 2)
        v = self.v_proj(x).view(b, length, 2, 16).transpose(1, 2)
        cos, sin = self.rotary(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.after_rope:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        k, v = repeat_kv(k, 2), repeat_kv(v, 2)
        s = q @ k.transpose(2, 3) / math.sqrt(16) + attention_mask
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, length, 64)
        return (self.o_proj(out),)


class _GatedAttention(nn.Module):
    """Gated attention as transformers 5.x writes it, from transformers' own
    parts (4.45.2 has none of these models): Qwen3-Next's and Qwen3.5's
    (Qwen3NextAttention: q_proj yields each head's query and then its gate,
    QK-norm (1 + w) as GemmaRMSNorm computes it, RoPE on a quarter of each
    head) or AFMoE's local layers (AfmoeAttention: a gate_proj of its own,
    QK-norm, RoPE, a sliding window); then the attention output, heads
    concatenated, times sigmoid(gate), then o_proj."""

    def __init__(self, kind):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 16
        self.in_query = kind == "qwen3_next"
        self.config = LlamaConfig(**COMMON, rope_theta=1e7 if self.in_query else 1e4,
                                  rms_norm_eps=1e-6,
                                  partial_rotary_factor=0.25 if self.in_query else 1.0)
        self.config.model_type = kind
        self.q_proj = nn.Linear(64, 128 if self.in_query else 64, bias=False)
        self.k_proj, self.v_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
        self.o_proj = nn.Linear(64, 64, bias=False)
        norm = GemmaRMSNorm if self.in_query else LlamaRMSNorm
        self.q_norm, self.k_norm = norm(16, eps=1e-6), norm(16, eps=1e-6)
        if not self.in_query:
            self.gate_proj = nn.Linear(64, 64, bias=False)
            self.is_local_attention, self.sliding_window = True, WINDOW
        with torch.no_grad():  # gates over sigmoid's curve, not only near 0.5
            (self.q_proj if self.in_query else self.gate_proj).weight.mul_(4.0)
        self.rotary = LlamaRotaryEmbedding(config=self.config)

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
        b, length, _ = x.shape
        if self.in_query:  # Qwen3NextAttention: [q_h | gate_h] per head
            q, gate = torch.chunk(self.q_proj(x).view(b, length, 4, 32), 2, dim=-1)
            gate = gate.reshape(b, length, 64)
        else:
            q, gate = self.q_proj(x).view(b, length, 4, 16), self.gate_proj(x)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, length, 2, 16)).transpose(1, 2)
        v = self.v_proj(x).view(b, length, 2, 16).transpose(1, 2)
        cos, sin = self.rotary(v, position_ids)
        rd = cos.shape[-1]  # the rotary part, then the rest as it is
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rd], k[..., :rd], cos, sin)
        q, k = torch.cat([q_rot, q[..., rd:]], -1), torch.cat([k_rot, k[..., rd:]], -1)
        k, v = repeat_kv(k, 2), repeat_kv(v, 2)
        s = q @ k.transpose(2, 3) / math.sqrt(16) + attention_mask
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, length, 64)
        return (self.o_proj(out * torch.sigmoid(gate)),)


LLAMA4_CHUNK = 16  # Llama 4's attention_chunk_size in these tests (its real one is 8192)


class _Llama4Attention(nn.Module):
    """Llama 4's attention as transformers 5.x writes it (Llama4TextAttention),
    from transformers' own parts (4.45.2 has no Llama 4): on its RoPE layers,
    llama3-scaled rotary embeddings applied as a complex product (pairs 2i,
    2i + 1), then a weightless L2 norm of Q and K, and chunked attention
    (each query sees its own chunk of LLAMA4_CHUNK tokens, up to itself);
    on the others no RoPE and no norm, full causal attention and each query
    times log1p(floor((i + 1) / floor_scale)) * attn_scale + 1, i its index."""

    class _L2Norm(nn.Module):  # Llama4TextL2Norm
        def __init__(self, eps):
            super().__init__()
            self.eps = eps

        def forward(self, x):
            return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) +
                                            self.eps)).type_as(x)

    def __init__(self, use_rope):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 16
        # Llama 4 Scout's RoPE scaling: llama3 with equal low and high factors.
        self.config = LlamaConfig(**COMMON, rope_theta=5e5, rms_norm_eps=1e-5,
                                  rope_scaling=dict(rope_type="llama3", factor=16.0,
                                                    low_freq_factor=1.0, high_freq_factor=1.0,
                                                    original_max_position_embeddings=64))
        self.config.model_type = "llama4_text"
        self.config.attention_chunk_size = LLAMA4_CHUNK
        self.config.layer_types = ["chunked_attention"] * 3 + ["full_attention"]
        self.layer_idx = 0 if use_rope else 3
        self.use_rope, self.is_causal = use_rope, True
        self.attn_temperature_tuning, self.floor_scale, self.attn_scale = True, 4, 0.1
        self.q_proj, self.k_proj = nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False)
        self.v_proj, self.o_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 64, bias=False)
        if use_rope:
            self.qk_norm = self._L2Norm(1e-5)
        self.rotary = LlamaRotaryEmbedding(config=self.config)

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers.models.llama.modeling_llama import repeat_kv
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, 4, 16)
        k = self.k_proj(x).view(b, length, 2, 16)
        v = self.v_proj(x).view(b, length, 2, 16).transpose(1, 2)
        if self.use_rope:  # apply_rotary_emb: (x_2i + i x_2i+1) * e^(i angle)
            angles = position_ids[..., None].double() * self.rotary.inv_freq.double()
            cos, sin = torch.cos(angles)[:, :, None, :], torch.sin(angles)[:, :, None, :]

            def rotate(t):
                even, odd = t[..., 0::2], t[..., 1::2]
                return torch.stack([even * cos - odd * sin, even * sin + odd * cos],
                                   -1).flatten(-2).to(t.dtype)
            q, k = self.qk_norm(rotate(q)), self.qk_norm(rotate(k))
        elif self.attn_temperature_tuning:  # by the query's index
            index = torch.arange(length, dtype=torch.float64)
            scales = torch.log1p(torch.floor((index + 1.0) / self.floor_scale)) * \
                self.attn_scale + 1.0
            q = q * scales[None, :, None, None].to(q.dtype)
        q, k = q.transpose(1, 2), repeat_kv(k.transpose(1, 2), 2)
        v = repeat_kv(v, 2)
        s = q @ k.transpose(2, 3) / math.sqrt(16) + attention_mask
        if self.use_rope:  # transformers' chunked mask: the query's own chunk
            i = torch.arange(length)
            s = s.masked_fill((i[None, :] // LLAMA4_CHUNK) != (i[:, None] // LLAMA4_CHUNK),
                              float("-inf"))
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, length, 64)
        return (self.o_proj(out),)


MINISTRAL3_ORIGINAL = 16  # its original_max_position_embeddings here (its real one is 16384)


class _Ministral3Attention(nn.Module):
    """Ministral 3's attention as transformers 5.x writes it
    (Ministral3Attention), from transformers' own parts (4.45.2 has no
    Ministral 3): Llama's projections and rotate-half RoPE, then each query
    times 1 + beta * log(1 + floor(p / original_max_position_embeddings)), p
    its position id (get_llama_4_attn_scale; llama_4_scaling_beta 0.1 in
    rope_parameters)."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.config = LlamaConfig(**COMMON)
        self.config.model_type = "ministral3"
        self.config.rope_parameters = dict(rope_type="default", rope_theta=10000.0,
                                           llama_4_scaling_beta=0.1,
                                           original_max_position_embeddings=MINISTRAL3_ORIGINAL)
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 16
        self.is_causal = True
        self.q_proj, self.k_proj = nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False)
        self.v_proj, self.o_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 64, bias=False)
        self.rotary = LlamaRotaryEmbedding(config=self.config)

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, 4, 16).transpose(1, 2)
        k = self.k_proj(x).view(b, length, 2, 16).transpose(1, 2)
        v = repeat_kv(self.v_proj(x).view(b, length, 2, 16).transpose(1, 2), 2)
        cos, sin = self.rotary(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        scale = 1 + 0.1 * torch.log(1 + torch.floor(position_ids / MINISTRAL3_ORIGINAL))
        q = q * scale[:, None, :, None].to(q.dtype)
        s = q @ repeat_kv(k, 2).transpose(2, 3) / math.sqrt(16) + attention_mask
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, length, 64)
        return (self.o_proj(out),)


# Gemma 4's text attention (and Gemma 3n's), as _Gemma4Attention builds it:
# the model type, its layer (of five sliding layers and a full one), the
# layer's head_dim and KV heads (a full layer's are its own: global_head_dim,
# num_global_key_value_heads), attention_k_eq_v, the full layers' RoPE.
GEMMA4_PROPORTIONAL = dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6)
GEMMA4_FAMILIES = {
    "gemma4-sliding": ("gemma4_text", 0, 16, 2, False, GEMMA4_PROPORTIONAL),
    # Proportional RoPE on a quarter of a head of 32 (4 of its 16 pairs).
    "gemma4-full": ("gemma4_text", 5, 32, 2, False, GEMMA4_PROPORTIONAL),
    # Values from k_proj, one KV head; RoPE on half of each head, with a factor.
    "gemma4-full-k-eq-v": ("gemma4_text", 5, 32, 1, True, dict(
        GEMMA4_PROPORTIONAL, partial_rotary_factor=0.5, factor=8.0)),
    # Gemma3nTextAttention's full layer: default RoPE.
    "gemma3n": ("gemma3n_text", 5, 16, 2, False, dict(rope_type="default", rope_theta=1e6)),
}


class _Gemma4Attention(nn.Module):
    """Gemma 4's text attention as transformers 5.x writes it
    (Gemma4TextAttention; Gemma 3n's computes the same), from transformers'
    own parts (4.45.2 has neither): q/k/v/o projections of the layer's own
    head_dim, RMSNorm x * w over each head of Q and K (LlamaRMSNorm), a
    weightless RMSNorm of each value head (v_norm, Gemma4RMSNorm(with_scale=
    False): Llama 4's L2 norm), RoPE of the layer's type: default on sliding
    layers, proportional on full ones (_compute_proportional_rope_parameters:
    rotate-half over the whole head, frequency i theta^(-2i/head_dim) /
    factor for i < int(partial_rotary_factor * head_dim // 2), 0 for the
    rest), angles in the module's dtype; scale 1, the window on sliding
    layers (in the mask). With attention_k_eq_v, no v_proj: value =
    v_norm(k_proj(x)), before k_norm and RoPE. The config's head_dim and
    num_key_value_heads are the sliding layers' (16, 2), as Gemma 4's are."""

    def __init__(self, family):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        model_type, layer, hd, hkv, k_eq_v, full_rope = GEMMA4_FAMILIES[family]
        self.config = LlamaConfig(**COMMON, head_dim=16, rms_norm_eps=1e-6)
        self.config.model_type = model_type
        self.config.update(dict(
            layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=WINDOW,
            rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=1e4),
                                 full_attention=dict(full_rope)),
            attention_k_eq_v=k_eq_v, num_kv_shared_layers=0, use_bidirectional_attention=None))
        self.layer_idx, self.head_dim, self.scaling = layer, hd, 1.0
        self.sliding_window = WINDOW if layer < 5 else None
        self.is_causal, self.is_kv_shared_layer = True, False
        self.use_alternative_attention = k_eq_v
        self.q_proj, self.k_proj = nn.Linear(64, 4 * hd, bias=False), nn.Linear(64, hkv * hd,
                                                                               bias=False)
        self.v_proj = None if k_eq_v else nn.Linear(64, hkv * hd, bias=False)
        self.o_proj = nn.Linear(4 * hd, 64, bias=False)
        self.q_norm, self.k_norm = LlamaRMSNorm(hd, eps=1e-6), LlamaRMSNorm(hd, eps=1e-6)
        self.v_norm = _Llama4Attention._L2Norm(1e-6)
        with torch.no_grad():  # each feature's norm weight its own, far from 1
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def rope_parameters(self):
        return self.config.rope_parameters[self.config.layer_types[self.layer_idx]]

    def inv_freq(self):
        """The layer's inverse frequencies (head_dim / 2 of them), float64."""
        params, hd = self.rope_parameters(), self.head_dim
        inv = 1.0 / params["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        if params["rope_type"] == "proportional":
            inv[int(params["partial_rotary_factor"] * hd // 2):] = 0.0
            inv = inv / params.get("factor", 1.0)
        return inv

    def forward(self, x, attention_mask=None, position_ids=None, kv_source=None, kv_x=None):
        """kv_source, kv_x: a KV-shared layer's keys and values, those
        kv_source computes from its input kv_x (transformers' shared_kv_states)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
        b, length, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, length, -1, hd)).transpose(1, 2)
        kv, kv_x = (self, x) if kv_source is None else (kv_source, kv_x)
        k = kv.k_proj(kv_x).view(b, length, -1, hd)
        v = k if kv.v_proj is None else kv.v_proj(kv_x).view(b, length, -1, hd)
        k, v = kv.k_norm(k).transpose(1, 2), kv.v_norm(v).transpose(1, 2)
        angles = position_ids[..., None].double() * self.inv_freq()
        emb = torch.cat((angles, angles), dim=-1)
        q, k = apply_rotary_pos_emb(q, k, emb.cos().to(q.dtype), emb.sin().to(q.dtype))
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        s = q @ k.transpose(2, 3) * self.scaling + attention_mask
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, length, -1)
        return (self.o_proj(out),)


# Multi-head latent attention, as _DeepseekV3Attention builds it: the model
# type it claims, then (q_lora_rank, attention_bias, rope_interleave, RoPE
# scaling), with kv_lora_rank 32, 4 heads of 16 nope + 8 rotary query/key
# features and 12 value features.
DEEPSEEK_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
LATENT_FAMILIES = {
    # DeepSeek-V3: the query through its own latent, biases (attention_bias),
    # interleaved YaRN RoPE whose mscale and mscale_all_dim differ.
    "deepseek-v3": ("deepseek_v3", 24, True, True, DEEPSEEK_YARN),
    # DeepSeek-V2-Lite's form: one q_proj; rotate-half pairs, plain RoPE.
    "deepseek-v3-q-proj": ("deepseek_v3", None, False, False, None),
    # LongCat-Flash: its query and key/value latents times sqrt(hidden / rank).
    "longcat-flash": ("longcat_flash", 24, False, True, None),
    # Kimi Linear's latent layers: no RoPE at all.
    "kimi-linear": ("kimi_linear", None, False, True, None),
    # Mistral 4: DeepSeek-V3's form, and every query feature after RoPE times
    # 1 + beta * log(1 + floor(p / original_max_position_embeddings))
    # (get_llama_4_attn_scale, llama_4_scaling_beta in its rope parameters).
    "mistral4": ("mistral4", 24, False, True, dict(DEEPSEEK_YARN, llama_4_scaling_beta=0.1)),
}


class _DeepseekV3Attention(nn.Module):
    """Multi-head latent attention as transformers 5.x writes it
    (DeepseekV3Attention), from transformers' own parts (4.45.2 has no
    DeepSeek): the query from q_proj, or q_b_proj(RMSNorm(q_a_proj(x)));
    [latent | rotary key] = kv_a_proj_with_mqa(x), the latent through
    kv_a_layernorm and kv_b_proj into each head's nope key and value; RoPE on
    the last qk_rope_head_dim features of each query head and on the one
    rotary key all heads share, interleaved as apply_rotary_pos_emb_interleave
    (pairs (2i, 2i + 1), returned de-interleaved) or rotate-half; YaRN as
    5.x's _compute_yarn_parameters (original_max_position_embeddings, the
    cos/sin factor mscale / mscale_all_dim), and the softmax scale times
    mscale_all_dim's mscale squared (yarn_apply_mscale). LlamaRMSNorm is
    DeepseekV3RMSNorm (eps 1e-6, whatever the config's rms_norm_eps)."""

    def __init__(self, family):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        model_type, q_rank, bias, interleave, yarn = LATENT_FAMILIES[family]
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = 4, q_rank, 32
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = 16, 8, 12
        self.qk_head_dim = 24
        self.is_causal = True
        # What a DeepseekV3Config holds (head_dim: the rotary features).
        self.config = LlamaConfig(**dict(COMMON, num_key_value_heads=4), head_dim=8,
                                  rms_norm_eps=1e-5, rope_theta=1e4,
                                  max_position_embeddings=256 if yarn else 2048,
                                  rope_scaling=dict(yarn) if yarn else None)
        self.config.model_type = model_type
        self.config.update(dict(q_lora_rank=q_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=12, rope_interleave=interleave,
                                attention_bias=bias))
        if q_rank is None:
            self.q_proj = nn.Linear(64, 4 * 24, bias=False)
        else:
            self.q_a_proj = nn.Linear(64, q_rank, bias=bias)
            self.q_a_layernorm = LlamaRMSNorm(q_rank)
            self.q_b_proj = nn.Linear(q_rank, 4 * 24, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(64, 32 + 8, bias=bias)
        self.kv_a_layernorm = LlamaRMSNorm(32)
        self.kv_b_proj = nn.Linear(32, 4 * (16 + 12), bias=False)
        self.o_proj = nn.Linear(4 * 12, 64, bias=bias)
        self.scaling = 24 ** -0.5
        rotary = dict(rope_theta=1e4, head_dim=8, hidden_size=64, num_attention_heads=4)
        if yarn:
            def mscale(factor, m):
                return 0.1 * m * math.log(factor) + 1.0
            # 4.45.2's YaRN reads the correction range at max_position_embeddings
            # (5.x: at original_max_position_embeddings) and has no mscale.
            rotary.update(max_position_embeddings=yarn["original_max_position_embeddings"],
                          rope_scaling=dict(rope_type="yarn", factor=yarn["factor"],
                                            beta_fast=yarn["beta_fast"],
                                            beta_slow=yarn["beta_slow"],
                                            attention_factor=mscale(yarn["factor"],
                                                                    yarn["mscale"]) /
                                            mscale(yarn["factor"], yarn["mscale_all_dim"])))
            self.scaling *= mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
        self.rope = model_type != "kimi_linear"
        self.interleave = interleave
        self.rotary_emb = LlamaRotaryEmbedding(config=LlamaConfig(**rotary))
        if model_type == "longcat_flash":
            self.mla_scale_q_lora = (64 / q_rank) ** 0.5
            self.mla_scale_kv_lora = (64 / 32) ** 0.5
        with torch.no_grad():  # norm weights around 1, not at it
            self.kv_a_layernorm.weight.uniform_(0.5, 1.5)
            if q_rank is not None:
                self.q_a_layernorm.weight.uniform_(0.5, 1.5)

    @staticmethod
    def _interleaved(q, k, cos, sin):  # 5.x's apply_rotary_pos_emb_interleave
        cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
        sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
        q1, q2 = q[..., 0::2], q[..., 1::2]
        k1, k2 = k[..., 0::2], k[..., 1::2]
        return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
                torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        b, length, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, length, -1, 24).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [16, 8], dim=-1)
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [32, 8], dim=-1)
        kv_pass = self.kv_a_layernorm(kv_pass)
        if hasattr(self, "mla_scale_q_lora"):  # LongcatFlashMLA
            q_pass, q_rot = q_pass * self.mla_scale_q_lora, q_rot * self.mla_scale_q_lora
            kv_pass = kv_pass * self.mla_scale_kv_lora
        kv_pass = kv_pass.view(b, 1, length, 32)
        k_rot = k_rot.view(b, 1, length, 8)
        if self.rope:
            cos, sin = self.rotary_emb(x, position_ids)
            rotate = self._interleaved if self.interleave else apply_rotary_pos_emb
            q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        query = torch.cat((q_pass, q_rot), dim=-1)
        beta = (self.config.rope_scaling or {}).get("llama_4_scaling_beta")
        if beta:  # Mistral4Attention
            original = self.config.rope_scaling["original_max_position_embeddings"]
            band = 1 + beta * torch.log(1 + torch.floor(position_ids / original))
            query = query * band[:, None, :, None].to(query.dtype)
        kv = self.kv_b_proj(kv_pass).view(b, length, -1, 16 + 12).transpose(1, 2)
        k_pass, value = torch.split(kv, [16, 12], dim=-1)
        key = torch.cat((k_pass, k_rot.expand(-1, 4, -1, -1)), dim=-1)
        s = query @ key.transpose(2, 3) * self.scaling + attention_mask
        out = (s.softmax(-1) @ value).transpose(1, 2).reshape(b, length, 4 * 12)
        return (self.o_proj(out),)


def _module_forward(m, x, window=None, reach=None, kv=None):
    """The module's own causal forward in float64 (positions 0..L-1), with
    the mask transformers' models build for it: causal, and with a sliding
    window, keys p - window + 1 .. p (modeling_mistral's _update_causal_mask).
    reach: a bidirectional layer instead, keys with |p - j| <= reach (every
    key with reach L). kv: (source module, its input): a KV-shared layer's
    keys and values."""
    m = m.double()
    b, length, _ = x.shape
    mask = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    if window:
        mask = mask.masked_fill(torch.ones(length, length, dtype=torch.bool).tril(-window),
                                float("-inf"))
    if reach:
        i = torch.arange(length)
        mask = torch.zeros((length, length), dtype=torch.float64).masked_fill(
            (i[:, None] - i[None, :]).abs() > reach, float("-inf"))
    mask = mask.expand(b, 1, length, length)
    positions = torch.arange(length)[None].expand(b, length)
    x = torch.from_numpy(x).double()
    extra = {}
    if kv is not None:
        extra = dict(kv_source=kv[0].double(), kv_x=torch.from_numpy(kv[1]).double())
    with torch.no_grad():
        if hasattr(m, "test_rotary"):  # the model's rotary class computes cos and sin
            out = m(x, attention_mask=mask, position_embeddings=m.test_rotary(x, positions))[0]
        else:
            out = m(x, attention_mask=mask, position_ids=positions, **extra)[0]
    m.float()
    if kv is not None:
        kv[0].float()
    return out.numpy()


# --- an independent float64 NumPy implementation of transformers' formulas ---

def _np_inv_freq(rope, max_position):
    """(inverse frequencies, cos/sin factor) of a forward call whose largest
    position is max_position (LongRoPE's long factors past its training
    context, as transformers 5.x decides from max(position_ids) + 1)."""
    dim, theta = rope["rotary_dim"], rope["theta"]
    pos_freq = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = 1.0 / pos_freq
    kind = rope["type"]
    if kind == "linear":
        inv = inv / rope["factor"]
    elif kind == "llama3":
        old = rope["original_max_position_embeddings"]
        low_w, high_w = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_w, inv / rope["factor"], inv)
        smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] -
                                                              rope["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / rope["factor"] + smooth * scaled
        medium = ~(wavelen < high_w) & ~(wavelen > low_w)
        inv = np.where(medium, smoothed, scaled)
    elif kind == "yarn":
        orig = rope["original_max_position_embeddings"]

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(corr(rope["beta_fast"])), 0)
        high = min(math.ceil(corr(rope["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extra = 1 - ramp
        inv = (1.0 / (rope["factor"] * pos_freq)) * (1 - extra) + (1.0 / pos_freq) * extra
    elif kind == "longrope":
        long = max_position + 1 > rope["original_max_position_embeddings"]
        inv = 1.0 / (np.array(rope["long_factor" if long else "short_factor"]) * pos_freq)
    elif kind == "proportional":  # Gemma 4: its first `angles` pairs, the rest not at all
        inv = np.where(np.arange(dim // 2) < rope["angles"], inv, 0.0) / rope.get("factor", 1.0)
    return inv, rope.get("attention_factor", 1.0) if kind in ("yarn", "longrope") else 1.0


def _np_rotate(x, positions, rope):
    """x [B, L, H, D]: the first rotary_dim features rotated (rotate-half,
    or pairs (2i, 2i + 1) when interleaved) at `positions` ([L], or [B, L]),
    with the frequencies of one call over all of them."""
    inv, factor = _np_inv_freq(rope, positions.max())
    angles = positions[..., None].astype(np.float64) * inv  # [L or B, L, rotary_dim / 2]
    cos, sin = np.cos(angles) * factor, np.sin(angles) * factor
    cos, sin = cos[..., None, :], sin[..., None, :]  # over the heads
    half = rope["rotary_dim"] // 2
    x = x.copy()
    if rope.get("interleaved"):
        x1, x2 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = x1 * cos - x2 * sin
        x[..., 1:2 * half:2] = x2 * cos + x1 * sin
        return x
    x1, x2 = x[..., :half].copy(), x[..., half:2 * half].copy()
    x[..., :half] = x1 * cos - x2 * sin
    x[..., half:2 * half] = x2 * cos + x1 * sin
    return x


def _np_position_scaled(q, positions, config):
    """q [B, L, H, D] times Ministral 3's and Mistral 4's factor at each
    query's position (get_llama_4_attn_scale), when the config has one."""
    t = config.get("temperature_tuning")
    if not t:
        return q
    assert t["by_position"], t
    band = 1 + t["attn_scale"] * np.log(1 + np.floor(positions / t["floor_scale"]))
    return q * np.broadcast_to(band, q.shape[:2])[..., None, None]


def _np_latent_layer(x, weights, config, positions=None):
    """Causal multi-head latent attention of an exported layer
    (model_config.proto's LatentAttention), float64, from its weights; tokens
    at 0..L-1 or at `positions` [B, L]."""
    def lin(name, t):
        w = weights[f"{name}.weight"].astype(np.float64)
        b = weights.get(f"{name}.bias")
        return t @ w.T + (b.astype(np.float64) if b is not None else 0)

    def rms(t, name, eps):
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + eps) * \
            weights[f"{name}.weight"].astype(np.float64)
    m = config["latent_attention"]
    h, hd, rank = config["num_heads"], config["head_dim"], m["kv_lora_rank"]
    nope, dv = hd - m["qk_rope_head_dim"], m["v_head_dim"]
    bsz, length, _ = x.shape
    x = x.astype(np.float64)
    if m["q_lora_rank"]:
        q = lin("q_b_proj", rms(lin("q_a_proj", x), "q_a_layernorm", m["q_norm_eps"]))
    else:
        q = lin("q_proj", x)
    q = q.reshape(bsz, length, h, hd)
    latent = lin("kv_a_proj_with_mqa", x)
    kv = lin("kv_b_proj", rms(latent[..., :rank], "kv_a_layernorm", m["kv_norm_eps"]))
    kv = kv.reshape(bsz, length, h, nope + dv)
    k_rot = np.broadcast_to(latent[..., None, rank:], (bsz, length, h, hd - nope))
    k, v = np.concatenate([kv[..., :nope], k_rot], -1), kv[..., nope:]
    if config.get("rope"):
        pos = np.arange(length) if positions is None else positions
        q = np.concatenate([q[..., :nope], _np_rotate(q[..., nope:], pos, config["rope"])], -1)
        k = np.concatenate([k[..., :nope], _np_rotate(k[..., nope:], pos, config["rope"])], -1)
        q = _np_position_scaled(q, pos, config)  # Mistral 4: the whole query, after RoPE
    s = np.einsum("blhd,bmhd->bhlm", q, k) * config["scale"]
    s = s + np.triu(np.full((length, length), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return lin("o_proj", np.einsum("bhlm,bmhd->blhd", p, v).reshape(bsz, length, h * dv))


def _np_layer(x, weights, config, positions=None, clamp_first=False):
    """Causal self-attention of an exported layer, float64, from its weights;
    tokens at 0..L-1 or at `positions` [B, L]. With clamp_first, QKV clipping
    before the QK-norm: the order attnserve does not compute (OLMoE's is the
    norm, then the clamp), for tests that tell the two apart."""
    if config.get("latent_attention"):
        return _np_latent_layer(x, weights, config, positions)

    def lin(name, t):
        w = weights[f"{name}.weight"].astype(np.float64)
        b = weights.get(f"{name}.bias")
        return t @ w.T + (b.astype(np.float64) if b is not None else 0)
    h, hkv, hd = config["num_heads"], config.get("num_kv_heads") or config["num_heads"], \
        config["head_dim"]
    bsz, length, _ = x.shape
    x = x.astype(np.float64)
    if config["weight_layout"] == "FUSED_QKV_PER_HEAD":
        qkv = lin("query_key_value", x).reshape(bsz, length, h, 3 * hd)
        q, k, v = qkv[..., :hd], qkv[..., hd:2 * hd], qkv[..., 2 * hd:]
        out_name = "dense"
    else:
        gate = config.get("output_gate")
        if gate and gate["weights"] == "query_per_head":  # [q_h | gate_h] per head
            qg = lin("q_proj", x).reshape(bsz, length, h, 2 * hd)
            q, g = qg[..., :hd], qg[..., hd:].reshape(bsz, length, h * hd)
        else:
            q = lin("q_proj", x).reshape(bsz, length, h, hd)
            g = lin("gate_proj", x) if gate else None
        k = lin("k_proj", x).reshape(bsz, length, hkv, hd)
        v = lin("v_proj", x).reshape(bsz, length, hkv, hd)
        out_name = config["tensor_names"].get("out_weight", "o_proj.weight")[:-len(".weight")]
    if config.get("v_norm"):  # Gemma 3n, Gemma 4: each value head, no weight, before any clamp
        v = v / np.sqrt((v * v).mean(-1, keepdims=True) + config["v_norm"]["eps"])
    norm = config.get("qk_norm")

    def normed(t, w):
        shape = t.shape
        if norm.get("whole_projection"):  # OLMo-2: before the heads split
            t = t.reshape(bsz, length, -1)
        w = w.astype(np.float64) + (1.0 if norm["weight_offset"] else 0.0)
        if norm.get("per_head_weights"):  # Cohere, StableLM: head h's own weights
            w = w.reshape(-1, hd)
        if norm.get("subtract_mean"):  # Cohere, StableLM: LayerNorm without a bias
            t = t - t.mean(-1, keepdims=True)
        t = t / np.sqrt((t * t).mean(-1, keepdims=True) + norm["eps"]) * w
        return t.reshape(shape)
    clip = config.get("clip_qkv")

    def clamp(*ts):  # OLMo, OLMoE, DBRX: Q, K and V, before RoPE
        return [np.clip(t, -clip, clip) if clip else t for t in ts]
    if clamp_first:
        q, k, v = clamp(q, k, v)
    if norm and not norm.get("after_rope"):
        q, k = normed(q, weights["q_norm.weight"]), normed(k, weights["k_norm.weight"])
    if not clamp_first:
        q, k, v = clamp(q, k, v)
    pos = np.arange(length) if positions is None else positions
    q, k = _np_rotate(q, pos, config["rope"]), _np_rotate(k, pos, config["rope"])
    if norm and norm.get("after_rope"):  # Hunyuan
        q, k = normed(q, weights["q_norm.weight"]), normed(k, weights["k_norm.weight"])
    q = _np_position_scaled(q, pos, config)  # Ministral 3
    k, v = np.repeat(k, h // hkv, axis=2), np.repeat(v, h // hkv, axis=2)
    s = np.einsum("blhd,bmhd->bhlm", q, k) * (config.get("scale") or 1 / math.sqrt(hd))
    if config.get("softcap"):
        s = config["softcap"] * np.tanh(s / config["softcap"])
    s = s + np.triu(np.full((length, length), -np.inf), 1)
    if config.get("sliding_window"):
        s = s + np.tril(np.full((length, length), -np.inf), -config["sliding_window"])
    sink = weights["sinks"].astype(np.float64)[None, :, None, None] if config.get("sinks") \
        else np.full((1, h, 1, 1), -np.inf)
    top = np.maximum(s.max(-1, keepdims=True), sink)
    p = np.exp(s - top)
    p /= p.sum(-1, keepdims=True) + np.exp(sink - top)
    o = np.einsum("bhlm,bmhd->blhd", p, v).reshape(bsz, length, h * hd)
    if config.get("output_gate"):
        o = o / (1 + np.exp(-g))
    return lin(out_name, o)


def _rel(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every family exported into one repository, one real server."""
    import harness
    harness.use_python_client()
    from attnserve_client import AttentionClient
    from attnserve_client.export import read_safetensors
    repo = tmp_path_factory.mktemp("hf-repo")
    modules, configs, weights = {}, {}, {}
    for family in FAMILIES:
        modules[family] = _served_module(family)
        configs[family] = export_module(modules[family], str(repo / family))
        weights[family] = read_safetensors(str(repo / family / "weights.safetensors"))
    server = harness.ServerProcess("--model-repository", str(repo), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            yield client, modules, configs, weights
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_layers_are_served_as_the_module_computes_them(served, family):
    client, modules, configs, _ = served
    assert configs[family]["rope"]["type"] in ("default", "linear", "llama3", "yarn",
                                               "longrope")
    x = np.random.default_rng(1).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    want = _module_forward(modules[family], x, configs[family].get("sliding_window"))
    got = client.attend(x, model=family, causal=True).output
    assert _rel(got, want) < 2e-5, f"{family}: {_rel(got, want)}"


@pytest.mark.parametrize("family", ["llama", "llama3", "llama-yarn", "mistral", "gpt-neox",
                                    "phi3-longrope", "qwen3", "gemma3", "olmo2", "hunyuan",
                                    "gemma2-sliding",
                                    "gemma2-full", "gpt-oss-sliding", "gpt-oss-full",
                                    "qwen3-next", "afmoe", "deepseek-v3",
                                    "deepseek-v3-q-proj", "longcat-flash", "mistral4",
                                    "ministral3", "olmo-clip", "olmoe-clip", "dbrx-clip",
                                    "cohere-qk-norm", "stablelm-qk-layernorm", "gemma3n",
                                    "gemma4-sliding"])
def test_rope_at_positions_in_the_thousands_within_2e5_of_float64(served, family):
    client, _, configs, weights = served
    x = np.random.default_rng(2).uniform(-1, 1, (1, 3000, 64)).astype(np.float32)
    want = _np_layer(x, weights[family], configs[family])
    got = client.attend(x, model=family, causal=True).output
    # The last rows (positions near 3000) on their own, where fp32 angles
    # would have gone wrong.
    assert _rel(got[:, -64:], want[:, -64:]) < 2e-5, _rel(got[:, -64:], want[:, -64:])
    assert _rel(got, want) < 2e-5


@pytest.mark.parametrize("family", ["llama3", "qwen3", "olmo2", "hunyuan", "mistral",
                                    "phi3-mini-4k", "gemma2-sliding", "gpt-oss-sliding",
                                    "qwen3-next", "afmoe",
                                    "llama4", "ministral3", "deepseek-v3", "deepseek-v3-q-proj",
                                    "mistral4", "olmo-clip", "olmoe-clip", "dbrx-clip",
                                    "cohere-qk-norm", "stablelm-qk-layernorm", "gemma4-sliding",
                                    "gemma4-full", "gemma4-full-k-eq-v"])
def test_a_session_continues_its_positions(served, family):
    """Prefill 24 tokens, then 100 single-token steps: every step equals the
    matching row of one causal request over the whole sequence."""
    client, _, _, _ = served
    x = np.random.default_rng(3).uniform(-1, 1, (1, 124, 64)).astype(np.float32)
    whole = client.attend(x, model=family, causal=True).output
    with client.open_session(family) as session:
        prefill = session.attend(x[:, :24], causal=True).output
        assert _rel(prefill, whole[:, :24]) < 1e-5
        for t in range(24, 124):
            step = session.attend(x[:, t:t + 1], causal=True).output
            assert _rel(step, whole[:, t:t + 1]) < 1e-5, f"step {t}"


def test_longrope_picks_its_factors_per_request(served):
    """LongRoPE (Phi-3.5, Phi-4-mini): a request of up to the training
    context (32 tokens here) rotates with the short factors, a longer one
    with the long factors, as the module decides per forward call; and with
    explicit positions, by the largest of them (transformers 5.x's rule;
    4.x's Phi-3 counts tokens instead)."""
    client, modules, configs, weights = served
    config = configs["phi3-longrope"]
    rope = config["rope"]
    assert (rope["type"], rope["original_max_position_embeddings"]) == ("longrope", PHI3_ORIGINAL)
    assert rope["short_factor"] == PHI3_LONGROPE["short_factor"]
    assert rope["long_factor"] == PHI3_LONGROPE["long_factor"]
    assert math.isclose(rope["attention_factor"],
                        math.sqrt(1 + math.log(4096 / PHI3_ORIGINAL) / math.log(PHI3_ORIGINAL)))
    assert config["sliding_window"] == 8192  # as Phi-3.5's: wider than its positions
    rng = np.random.default_rng(6)
    x = rng.uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    got = {}
    for length in (20, 32, 33, 40):
        want = _module_forward(modules["phi3-longrope"], x[:, :length])
        got[length] = client.attend(x[:, :length], model="phi3-longrope", causal=True).output
        assert _rel(got[length], want) < 2e-5, f"{length} tokens: {_rel(got[length], want)}"
    # The same first 32 tokens, causal: as the last of 32 tokens they rotate
    # short, with a 33rd they rotate long.
    assert _rel(got[33][:, :32], got[32]) > 1e-3
    # Explicit positions: 20 tokens whose largest position is past the
    # training context rotate long; the same tokens at small positions short.
    for positions in (np.concatenate([np.arange(10), np.arange(30, 40)]),
                      np.concatenate([np.arange(10), np.arange(21, 31)])):
        positions = np.stack([positions, positions + 1])
        want = _np_layer(x[:, :20], weights["phi3-longrope"], config, positions)
        served_out = client.attend(x[:, :20], model="phi3-longrope", causal=True,
                                   positions=positions).output
        assert _rel(served_out, want) < 2e-5, (positions.max(), _rel(served_out, want))


def test_a_longrope_session_rotates_as_transformers_cache_does(served):
    """A session is a series of forward calls: its prefill of 24 tokens
    rotates short, each step past the training context long, while the keys
    it cached keep the rotation they were appended with, as transformers'
    DynamicCache keeps them; so the steps equal the module's cached steps,
    not one causal request over the whole sequence."""
    from transformers import DynamicCache
    client, modules, _, _ = served
    x = np.random.default_rng(7).uniform(-1, 1, (1, 44, 64)).astype(np.float32)
    m = modules["phi3-longrope"].double()
    cache, want = DynamicCache(), []
    mask = torch.full((24, 24), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        want.append(m(torch.from_numpy(x[:, :24]).double(), attention_mask=mask,
                      position_ids=torch.arange(24)[None], past_key_value=cache,
                      use_cache=True)[0].numpy())
        for t in range(24, 44):
            want.append(m(torch.from_numpy(x[:, t:t + 1]).double(),
                          position_ids=torch.tensor([[t]]), past_key_value=cache,
                          use_cache=True)[0].numpy())
    m.float()
    whole = client.attend(x, model="phi3-longrope", causal=True).output
    with client.open_session("phi3-longrope") as session:
        got = [session.attend(x[:, :24], causal=True).output]
        got += [session.attend(x[:, t:t + 1], causal=True).output for t in range(24, 44)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert _rel(g, w) < 2e-5, f"call {i}: {_rel(g, w)}"
    # Past the training context the cached short keys make the difference.
    assert _rel(got[-1], whole[:, -1:]) > 1e-3


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gpt-neox", "gemma2-full", "gpt-oss-full",
                                    "ministral3", "deepseek-v3", "mistral4", "olmo-clip",
                                    "dbrx-clip", "cohere-qk-norm", "gemma4-full"])
def test_left_padded_batches_with_explicit_positions(served, family):
    """A batch as generate() builds it: sequences left-padded to one length,
    an attention mask over the pads and position_ids = cumsum(mask) - 1 (pads
    at 0: attnserve asks that positions not decrease along a sequence, where
    generate() puts 1 on pads, which only masked keys carry). Served with the
    same mask and positions, every real token's row equals the module's own
    forward with those position_ids (float64)."""
    client, modules, _, _ = served
    lengths, length = [40, 23, 31], 40
    x = np.random.default_rng(4).uniform(-1, 1, (3, length, 64)).astype(np.float32)
    keep = np.arange(length)[None, :] >= (length - np.array(lengths))[:, None]  # [B, L]
    positions = np.where(keep, np.cumsum(keep, axis=1) - 1, 0)
    causal = np.tril(np.ones((length, length), bool))
    allowed = causal[None] & keep[:, None, :]  # [B, Lq, Lk]
    mask = torch.from_numpy(np.where(allowed, 0.0, float("-inf")))[:, None]
    m = modules[family].double()
    with torch.no_grad():
        want = m(torch.from_numpy(x).double(), attention_mask=mask,
                 position_ids=torch.from_numpy(positions))[0].numpy()
    m.float()
    got = client.attend(x, model=family, causal=True, attn_mask=keep[:, None, None, :],
                        positions=positions).output
    for b, n in enumerate(lengths):
        real = slice(length - n, length)
        assert _rel(got[b, real], want[b, real]) < 2e-5, f"sequence {b}: {_rel(got[b, real], want[b, real])}"


@pytest.mark.parametrize("family", ["llama", "llama-yarn", "qwen3", "gpt-oss-full", "ministral3",
                                    "deepseek-v3", "deepseek-v3-q-proj", "mistral4",
                                    "cohere-qk-norm", "gemma4-full-k-eq-v"])
def test_explicit_positions_with_gaps_match_the_module(served, family):
    """Positions that are no shift of 0..L-1 (RoPE is relative, so a shift
    changes nothing): increasing with random gaps, per sequence, in the
    thousands. Equal to the module's forward with those position_ids, and
    not to the answer without them."""
    client, modules, _, _ = served
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (2, 24, 64)).astype(np.float32)
    positions = np.cumsum(rng.integers(1, 200, (2, 24)), axis=1)
    mask = torch.full((24, 24), float("-inf"), dtype=torch.float64).triu(1).expand(2, 1, 24, 24)
    m = modules[family].double()
    with torch.no_grad():
        want = m(torch.from_numpy(x).double(), attention_mask=mask,
                 position_ids=torch.from_numpy(positions))[0].numpy()
    m.float()
    got = client.attend(x, model=family, causal=True, positions=positions).output
    assert _rel(got, want) < 2e-5, _rel(got, want)
    plain = client.attend(x, model=family, causal=True).output
    assert _rel(plain, want) > 1e-3


def test_positions_are_refused_where_they_would_change_nothing(served):
    client, _, _, _ = served
    x = np.zeros((1, 4, 64), np.float32)
    with pytest.raises(Exception) as e:
        client.attend(x, model="llama", positions=[[0, 1, 2]])
    assert "positions: must hold one position per key token, [B, Lk] = [1, 4]" in str(e.value)
    with client.open_session("llama") as session:
        with pytest.raises(Exception) as e:
            session.attend(x, causal=True, positions=[[0, 1, 2, 3]])
        assert "positions: not supported with session_id" in str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_batches_with_key_lengths(served, family):
    """Three sequences of 40, 23 and 31 tokens right-padded to 40, with
    key_lengths: each sequence's real rows equal the module's forward on
    that sequence alone (float64)."""
    client, modules, configs, _ = served
    lengths = [40, 23, 31]
    x = np.random.default_rng(6).uniform(-1, 1, (3, 40, 64)).astype(np.float32)
    got = client.attend(x, model=family, causal=True, key_lengths=lengths).output
    window = configs[family].get("sliding_window")
    # LongRoPE picks its factors per forward call: the padded batch is one
    # call of 40 positions, so its shorter sequences rotate with the long
    # factors, in transformers as here; their rows are the whole batch's.
    whole = _module_forward(modules[family], x, window) \
        if configs[family]["rope"]["type"] == "longrope" else None
    for b, n in enumerate(lengths):
        want = whole[b:b + 1, :n] if whole is not None else \
            _module_forward(modules[family], x[b:b + 1, :n], window)
        assert _rel(got[b:b + 1, :n], want) < 2e-5, f"sequence {b}: {_rel(got[b:b + 1, :n], want)}"


@pytest.mark.parametrize("family", ["llama3", "qwen3", "olmo2", "gemma2-sliding",
                                    "gpt-oss-sliding", "qwen3-next", "afmoe", "deepseek-v3",
                                    "deepseek-v3-q-proj", "olmo-clip", "olmoe-clip",
                                    "dbrx-clip", "ministral3", "mistral4", "cohere-qk-norm",
                                    "stablelm-qk-layernorm", "gemma4-sliding",
                                    "gemma4-full-k-eq-v"])
def test_bf16_layers_within_bf16_tolerance(tmp_path, family):
    """The same modules exported with precision bf16 (weights and products in
    bfloat16): within bf16's tolerance of the float64 forward."""
    import harness
    from attnserve_client import AttentionClient
    module = _served_module(family)
    config = export_module(module, str(tmp_path / family), precision="bf16")
    x = np.random.default_rng(7).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    want = _module_forward(module, x, config.get("sliding_window"))
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            got = client.attend(x, model=family, causal=True).output
    finally:
        assert server.stop() == 0, server.log()
    assert _rel(got, want) < 2e-2, _rel(got, want)


def _gemma4_original(module):
    """(weights, config) of a Gemma 4 layer as its module holds and computes
    it, for the NumPy layer, read from the module alone: its own projections
    and norms (v_proj: k_proj's with attention_k_eq_v) in their own feature
    order, and its proportional RoPE from its own parameters, over the whole
    head (the exporter's reordering is not used)."""
    weights = {n: t.detach().double().numpy() for n, t in module.state_dict().items()}
    if module.v_proj is None:
        weights["v_proj.weight"] = weights["k_proj.weight"]
    params, hd = module.rope_parameters(), module.head_dim
    rope = dict(type="proportional", theta=params["rope_theta"], rotary_dim=hd,
                angles=int(params["partial_rotary_factor"] * hd // 2),
                factor=params.get("factor", 1.0))
    config = dict(num_heads=module.q_proj.out_features // hd,
                  num_kv_heads=module.k_proj.out_features // hd, head_dim=hd,
                  weight_layout="SEPARATE_QKV", tensor_names={}, scale=module.scaling,
                  qk_norm=dict(eps=module.q_norm.variance_epsilon, weight_offset=False),
                  v_norm=dict(eps=module.v_norm.eps), rope=rope)
    return weights, config


@pytest.mark.parametrize("family", ["gemma4-full", "gemma4-full-k-eq-v"])
def test_gemma4_proportional_rope_is_served_exactly(served, family):
    """Gemma 4's full layers: proportional RoPE (rotate-half over the whole
    head, the first int(partial_rotary_factor * head_dim // 2) pairs (i, i +
    head_dim/2) at theta^(-2i/head_dim) / factor, the rest not rotated),
    served as rotate-half over 2 * angles features of Q and K whose features
    the exporter reorders, rotated pairs first (one order in Q and K: no score
    changes), with theta^(2 * angles / head_dim). At positions in the
    thousands the served layer equals the NumPy layer on the module's own
    weights and RoPE, and the module's own float64 forward; the exported
    config on the unreordered weights, or without v_norm, does not."""
    client, modules, configs, weights = served
    module, config = modules[family], configs[family]
    params, hd = module.rope_parameters(), module.head_dim
    angles = int(params["partial_rotary_factor"] * hd // 2)
    factor = params.get("factor", 1.0)
    assert config["rope"]["type"] == ("default" if factor == 1.0 else "linear")
    assert config["rope"]["rotary_dim"] == 2 * angles
    assert config["rope"].get("factor", 1.0) == factor
    assert math.isclose(config["rope"]["theta"], params["rope_theta"] ** (2 * angles / hd),
                        rel_tol=1e-12)
    # The layer's own head_dim and KV heads, not the config's (16, 2).
    assert (config["head_dim"], config["num_kv_heads"]) == (32, module.k_proj.out_features // 32)
    assert config["v_norm"] == {"eps": 1e-6} and config["scale"] == 1.0
    half = hd // 2
    order = [*range(angles), *range(half, half + angles), *range(angles, half),
             *range(half + angles, hd)]
    for name in ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight"):
        own = module.state_dict()[name].numpy()
        assert np.array_equal(weights[family][name],
                              own.reshape(-1, hd, *own.shape[1:])[:, order].reshape(own.shape))
    original, original_config = _gemma4_original(module)
    assert np.array_equal(weights[family]["v_proj.weight"], original["v_proj.weight"])
    x = np.random.default_rng(2).uniform(-1, 1, (1, 3000, 64)).astype(np.float32)
    got = client.attend(x, model=family, causal=True).output
    want = _np_layer(x, original, original_config)
    assert _rel(got[:, -64:], want[:, -64:]) < 2e-5, _rel(got[:, -64:], want[:, -64:])
    assert _rel(got, want) < 2e-5, _rel(got, want)
    assert _rel(got, _module_forward(module, x)) < 2e-5
    short = x[:, :256]
    assert _rel(_np_layer(short, original, config), want[:, :256]) > 1e-2  # not reordered
    assert _rel(_np_layer(short, weights[family], dict(config, v_norm=None)),
                want[:, :256]) > 1e-2


def test_v_norm_is_exported_and_reported(served):
    client, _, configs, _ = served
    for family in ("gemma3n", "gemma4-sliding", "gemma4-full", "gemma4-full-k-eq-v"):
        assert configs[family]["v_norm"] == {"eps": 1e-6}, family
        assert configs[family]["qk_norm"] == {"eps": 1e-6, "weight_offset": False}, family
    assert configs["gemma4-sliding"]["sliding_window"] == WINDOW
    assert "sliding_window" not in configs["gemma4-full"]
    reported = client.get_model("gemma4-sliding").config
    assert reported.HasField("v_norm") and reported.v_norm.eps == 1e-6
    assert not client.get_model("qwen3").config.HasField("v_norm")


def _gemma4_variant(change):
    """A Gemma 4 layer with one thing attnserve does not compute."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    m = _Gemma4Attention("gemma4-full" if change == "kv-shared" else "gemma4-sliding")
    if change in ("kv-shared", "kv-shared-by-config"):
        # A layer past num_kv_shared_layers' start: no k_proj, v_proj, k_norm,
        # v_norm; it attends to an earlier layer's keys and values.
        del m.k_proj, m.v_proj, m.k_norm, m.v_norm
        m.config.num_kv_shared_layers = 2
        if change == "kv-shared":
            m.is_kv_shared_layer = True
        else:  # transformers' kv_sharing_modes, read from the config
            del m.is_kv_shared_layer
            m.config.kv_sharing_modes = [None] * 3 + ["store", "reuse", "reuse"]
            m.layer_idx = 4
    elif change == "bidirectional-other-type":
        # A window both ways in a model type whose rule is not checked.
        m.config.use_bidirectional_attention = "all"
        m.sliding_window, m.is_causal = WINDOW // 2 + 1, False
        m.config.model_type = "gemma2"
    elif change == "v-norm-weight":
        m.v_norm = LlamaRMSNorm(16, eps=1e-6)
    elif change == "v-norm-other-type":
        m.config.model_type = "qwen3"
    elif change == "proportional-other-type":  # Gemma 3n's rotary class has no such type
        m = _Gemma4Attention("gemma3n")
        m.config.rope_parameters["full_attention"] = dict(GEMMA4_PROPORTIONAL)
    return m


@pytest.mark.parametrize("change,words", [
    ("kv-shared", ["_Gemma4Attention (layer 5) reuses the keys and values of an earlier layer",
                   "KV sharing, num_kv_shared_layers=2"]),
    ("kv-shared-by-config", ["(layer 4) reuses the keys and values of an earlier layer"]),
    ("bidirectional-other-type", ["a sliding window of 9 on a layer that is not causal, in a "
                                  "model of type 'gemma2'"]),
    ("v-norm-weight", ["v_norm LlamaRMSNorm with a weight"]),
    ("v-norm-other-type", ["norm of the values (v_norm) in a model of type 'qwen3'"]),
    ("proportional-other-type", ["RoPE scaling type 'proportional'"]),
])
def test_gemma_layers_that_attnserve_cannot_compute_are_refused_by_name(tmp_path, change, words):
    from attnserve_client.export import unsupported_features
    assert unsupported_features(_Gemma4Attention("gemma4-full-k-eq-v")) == []
    with pytest.raises(ExportError) as refused:
        export_module(_gemma4_variant(change), str(tmp_path / change))
    for word in words:
        assert word in str(refused.value), str(refused.value)
    assert not os.path.exists(tmp_path / change / "config.pbtxt"), "nothing is written"


def test_a_kv_shared_layer_is_served_with_its_sources_keys_and_values(tmp_path):
    """KV sharing (Gemma 3n's and Gemma 4's last num_kv_shared_layers): the
    layer's queries are its own, its keys and values those of the last
    earlier layer of its type (transformers' kv_sharing_modes "store"), from
    that layer's input. Exported from the whole model with the source's
    k_proj, v_proj and norms (kv_source names it), served with the source's
    input as key and value as the modules compute it (and not as its own
    input would give), in one request and in a session step by step; a
    request without key is refused, naming the source; a wrong source is
    refused at export."""
    import harness
    from attnserve_client import AttentionClient
    layers = {}
    for index in (2, 3, 4):
        m = layers[index] = _Gemma4Attention("gemma4-sliding")
        m.layer_idx = index
        m.config.num_hidden_layers, m.config.num_kv_shared_layers = 6, 2
    shared = layers[4]  # 4 and 5 reuse: layer 4's source is layer 3, the last sliding one
    del shared.k_proj, shared.v_proj, shared.k_norm, shared.v_norm
    shared.is_kv_shared_layer = True
    model = nn.ModuleDict({f"layer{i}": m for i, m in layers.items()})
    config = export_module(model, str(tmp_path / "shared"), submodule="layer4")
    assert config["kv_source"] == "layer3" and config["sliding_window"] == WINDOW
    assert (tmp_path / "shared" / "config.pbtxt").read_text().count('kv_source: "layer3"') == 1
    with pytest.raises(ExportError) as refused:
        export_module(model, str(tmp_path / "wrong"), submodule="layer4", kv_source="layer2")
    assert "is not the layer whose keys and values" in str(refused.value)
    assert "layer 3 (the last earlier layer of its type" in str(refused.value)

    rng = np.random.default_rng(10)
    x, xs = (rng.uniform(-1, 1, (2, 40, 64)).astype(np.float32) for _ in range(2))
    want = _module_forward(shared, x, WINDOW, kv=(layers[3], xs))
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            got = client.attend(x, xs, xs, model="shared", causal=True).output
            assert _rel(got, want) < 2e-5, _rel(got, want)
            own = _module_forward(shared, x, WINDOW, kv=(layers[3], x))
            assert _rel(got, own) > 1e-3
            with client.open_session("shared") as session:
                steps = [session.attend(x[:1, :20], xs[:1, :20], xs[:1, :20]).output]
                steps += [session.attend(x[:1, t:t + 1], xs[:1, t:t + 1], xs[:1, t:t + 1]).output
                          for t in range(20, 40)]
            assert _rel(np.concatenate(steps, axis=1), want[:1]) < 2e-5
            with pytest.raises(Exception) as refused:
                client.attend(x, model="shared", causal=True)
            assert "key: required by model 'shared'" in str(refused.value)
            assert "its keys and values are those of layer3" in str(refused.value)
    finally:
        assert server.stop() == 0, server.log()


class _ModernBertAttention(nn.Module):
    """ModernBERT's attention as transformers 5.x writes it
    (ModernBertAttention; 4.45.2 has none), from transformers' own parts: one
    Wqkv of rows [q | k | v] (no grouped queries), rotate-half RoPE of the
    layer type's theta (local 10000, global 160000), not causal, Wo; its local
    layers (layer_types "sliding_attention") see |i - j| <= local_attention //
    2 (config.sliding_window), the module's sliding_window that plus 1."""

    def __init__(self, layer, bias=False):
        super().__init__()
        from transformers import LlamaConfig
        self.config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
        self.config.model_type = "modernbert"
        self.config.update(dict(
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=160000.0),
                                 sliding_attention=dict(rope_type="default", rope_theta=1e4))))
        self.layer_idx, self.head_dim, self.is_causal = layer, 16, False
        self.sliding_window = WINDOW // 2 + 1 if layer > 0 else None
        self.Wqkv, self.Wo = nn.Linear(64, 3 * 64, bias=bias), nn.Linear(64, 64, bias=bias)

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        b, length, _ = x.shape
        q, k, v = self.Wqkv(x).view(b, length, 3, 4, 16).unbind(dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        theta = self.config.rope_parameters[self.config.layer_types[self.layer_idx]]["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        angles = position_ids[..., None].double() * inv
        emb = torch.cat((angles, angles), dim=-1)
        q, k = apply_rotary_pos_emb(q, k, emb.cos().to(q.dtype), emb.sin().to(q.dtype))
        s = q @ k.transpose(2, 3) * 16 ** -0.5 + attention_mask
        return (self.Wo((s.softmax(-1) @ v).transpose(1, 2).reshape(b, length, 64)),)


def _bert_modules():
    """BERT-style attention from transformers' own classes: BertAttention,
    RobertaAttention, XLMRobertaAttention (self.query/key/value, then
    output.dense: the rest of BertSelfOutput, dropout, residual and
    LayerNorm, is the caller's) and DistilBERT's attention (q_lin ... out_lin,
    the whole module), random weights with biases."""
    from transformers import BertConfig, DistilBertConfig, RobertaConfig, XLMRobertaConfig
    from transformers.models.bert.modeling_bert import BertAttention
    from transformers.models.distilbert import modeling_distilbert
    from transformers.models.roberta.modeling_roberta import RobertaAttention
    from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaAttention
    common = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                  attn_implementation="eager")
    torch.manual_seed(14)
    modules = {"bert": BertAttention(BertConfig(**common)),
               # BERT's own relative position embeddings (transformers 4.x):
               # the query's, and the query's and the key's, up to 47 apart.
               "bert-relative-key": BertAttention(BertConfig(
                   **common, max_position_embeddings=48, position_embedding_type="relative_key")),
               "bert-relative-key-query": BertAttention(BertConfig(
                   **common, max_position_embeddings=48,
                   position_embedding_type="relative_key_query")),
               "roberta": RobertaAttention(RobertaConfig(**common)),
               "xlm-roberta": XLMRobertaAttention(XLMRobertaConfig(**common)),
               "distilbert": modeling_distilbert.MultiHeadSelfAttention(DistilBertConfig(
                   dim=64, n_heads=4, hidden_dim=128, attn_implementation="eager"))}
    with torch.no_grad():
        for m in modules.values():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return {n: m.eval() for n, m in modules.items()}


def _bert_forward(name, m, x, lengths):
    """The attention of BERT-style module m in float64 on x [B, L, 64], each
    sequence's keys past its length masked (its attention_mask, additive)."""
    b, length, _ = x.shape
    keep = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    xt = torch.from_numpy(x).double()
    m = m.double()
    with torch.no_grad():
        if name == "distilbert":  # mask: [B, L], 1 = a key to keep
            out = m(xt, xt, xt, keep.to(torch.float64))[0]
        else:  # the extended mask the model builds: 0 or a large negative
            mask = torch.zeros(b, 1, 1, length, dtype=torch.float64).masked_fill(
                ~keep[:, None, None, :], torch.finfo(torch.float64).min)
            out = m.output.dense(m.self(xt, attention_mask=mask)[0])
    m.float()
    return out.numpy()


def test_bert_attention_is_served_as_its_modules_compute_it(tmp_path):
    """BERT, RoBERTa, XLM-R and DistilBERT (sentence-embedding encoders):
    not causal, the default scale, four projections with biases; served as
    the attention through output.dense (out_lin) computes it, with and
    without padding (key_lengths); BERT's relative_key and
    relative_key_query as relative position embeddings. A decoder's
    attention with them is refused, naming why."""
    import harness
    from attnserve_client import AttentionClient
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertAttention
    modules = _bert_modules()
    configs = {n: export_module(m, str(tmp_path / n)) for n, m in modules.items()}
    for name, config in configs.items():
        assert config["causal"] is False and config["num_heads"] == 4, name
        assert (config["q_bias"], config["out_bias"]) == (True, True), name
        assert "scale" not in config and "rope" not in config, name
        assert ("relative_embeddings" in config) is ("relative" in name), name
    assert configs["bert"]["tensor_names"]["out_weight"] == "output.dense.weight"
    assert configs["bert-relative-key-query"]["relative_embeddings"] == dict(
        distance=47, content_to_position=True, position_to_content=True)
    x = np.random.default_rng(15).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            for name, m in modules.items():
                for lengths in ([40, 40], [40, 23]):
                    want = _bert_forward(name, m, x, lengths)
                    got = client.attend(x, model=name, key_lengths=lengths).output
                    assert _rel(got, want) < 2e-5, (name, lengths, _rel(got, want))
    finally:
        assert server.stop() == 0, server.log()
    decoder = BertAttention(BertConfig(hidden_size=64, num_attention_heads=4, is_decoder=True,
                                       position_embedding_type="relative_key"))
    with pytest.raises(ExportError) as refused:
        export_module(decoder, str(tmp_path / "relative"), causal=True)
    assert "position_embedding_type 'relative_key'" in str(refused.value)
    assert "encoders only" in str(refused.value)


def _alibi_modules():
    """BLOOM's attention (BloomAttention) and MPT's (from a one-block
    MptModel, whose config says alibi_bias_max), random weights, 6 heads:
    not a power of two, so both slope rules' second halves count."""
    from transformers import BloomConfig, MptConfig, MptModel
    from transformers.models.bloom.modeling_bloom import BloomAttention
    torch.manual_seed(21)
    bloom = BloomAttention(BloomConfig(hidden_size=96, n_head=6), layer_idx=0)
    mpt = MptModel(MptConfig(d_model=96, n_heads=6, n_layers=1, max_seq_len=512,
                             attn_config=dict(clip_qkv=8.0, alibi_bias_max=8)))
    with torch.no_grad():
        for m in (bloom, mpt):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return bloom.eval(), mpt.eval()


def _alibi_forward(name, module, x, lengths):
    """The layer in float64 on x [B, L, 96], causal, each sequence's keys
    past its length masked, with the model's own ALiBi tensor: BLOOM's
    build_alibi_tensor of the attention mask (the residual BloomAttention
    adds is zero: it is the caller's), MPT's build_mpt_alibi_tensor."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
    b, length, _ = x.shape
    keep = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    hidden = torch.from_numpy(x).double()
    masked = torch.ones(length, length, dtype=torch.bool).triu(1)[None, None] | \
        ~keep[:, None, None, :]
    with torch.no_grad():
        if name == "bloom":
            m = module.double()
            alibi = build_alibi_tensor(keep.long(), m.num_heads, torch.float64)
            mask = torch.zeros(b, 1, length, length, dtype=torch.float64).masked_fill(
                masked, torch.finfo(torch.float64).min)
            out = m(hidden, torch.zeros_like(hidden), alibi, mask)[0]
        else:
            m = module.blocks[0].attn.double()
            bias = build_mpt_alibi_tensor(m.n_heads, module.config.max_seq_len).double()
            out = m(hidden, bias, attention_mask=masked)[0]
    module.float()
    return out.numpy()


def test_alibi_layers_are_served_as_bloom_and_mpt_compute_them(tmp_path):
    """BLOOM and MPT (ALiBi): each exported with its slopes by its model's
    rule, causal, and served as transformers computes the layer, with and
    without padding, over 300 keys (past one 256-key block of the cpu
    kernel); a session step by step equals one causal request. Falcon's
    ALiBi (rounded to bfloat16) and a caller-passed bias of an unknown model
    type are refused, naming them."""
    import harness
    harness.use_python_client()
    from attnserve_client import AttentionClient
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
    bloom, mpt = _alibi_modules()
    configs = {"bloom": export_module(bloom, str(tmp_path / "bloom")),
               "mpt": export_module(mpt, str(tmp_path / "mpt"), submodule="blocks.0.attn")}
    # The slopes are transformers' own (their float32 values, within 1 ulp).
    ones = torch.ones(1, 2, dtype=torch.long)
    want_slopes = {"bloom": build_alibi_tensor(ones, 6, torch.float32)[:, 0, 1].numpy(),
                   "mpt": -build_mpt_alibi_tensor(6, 2, 8)[:, 0, 0].numpy()}
    for name, config in configs.items():
        assert config["causal"] is True and config["num_heads"] == 6, name
        np.testing.assert_allclose(config["alibi_slopes"], want_slopes[name], rtol=2e-7)
    assert configs["mpt"]["clip_qkv"] == 8.0
    with open(tmp_path / "bloom" / "config.pbtxt") as f:
        assert "alibi_slopes: [" in f.read()
    x = np.random.default_rng(22).uniform(-1, 1, (2, 300, 96)).astype(np.float32)
    x[0, 7, 5] = 40.0  # past MPT's clamp of 8
    modules = {"bloom": bloom, "mpt": mpt}
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            for name, module in modules.items():
                for lengths in ([300, 300], [300, 123]):
                    want = _alibi_forward(name, module, x, lengths)
                    got = client.attend(x, model=name, key_lengths=lengths).output
                    assert _rel(got, want) < 2e-5, (name, lengths, _rel(got, want))
                    if lengths[1] < 300:  # padded rows past the length are the caller's
                        break
                whole = client.attend(x[:1, :60], model=name).output
                with client.open_session(name) as session:
                    got = [session.attend(x[:1, :20]).output]
                    got += [session.attend(x[:1, t:t + 1]).output for t in range(20, 60)]
                assert _rel(np.concatenate(got, axis=1), whole) < 1e-5, name
    finally:
        assert server.stop() == 0, server.log()

    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention
    falcon = FalconAttention(FalconConfig(hidden_size=64, num_attention_heads=4, alibi=True,
                                          multi_query=False, new_decoder_architecture=False),
                             layer_idx=0)

    class _OwnBias(nn.Module):  # q/k/v/o like Llama, and a bias its caller passes
        def __init__(self):
            super().__init__()
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(self, n, nn.Linear(64, 64))
            self.num_heads, self.head_dim = 4, 16

        def forward(self, hidden_states, position_bias):
            raise NotImplementedError

    for module, words in ((falcon, ["Falcon's ALiBi", "bfloat16"]),
                          (_OwnBias(), ["forward's `position_bias`", "known: ALiBi of bloom"])):
        with pytest.raises(ExportError) as refused:
            export_module(module, str(tmp_path / "refused"))
        for word in words:
            assert word in str(refused.value), str(refused.value)
    assert not os.path.exists(tmp_path / "refused" / "config.pbtxt")


def _spied(module, calls):
    """Wraps module.forward to record each call's (args, kwargs, output)."""
    forward = module.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out
    module.forward = spy


def _relative_bias_models():
    """Two-layer T5 and UMT5 (encoder and decoder) and MPNet models from
    transformers' own classes, random weights, each layer's relative bias
    table drawn wide (N(0, 1)) so that the bias moves the scores."""
    from transformers import MPNetConfig, MPNetModel, T5Config, T5Model, UMT5Config, UMT5Model
    torch.manual_seed(31)
    t5_like = dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, vocab_size=64,
                   num_decoder_layers=2, dropout_rate=0.0)
    models = {"t5": T5Model(T5Config(**t5_like)), "umt5": UMT5Model(UMT5Config(**t5_like)),
              "mpnet": MPNetModel(MPNetConfig(hidden_size=64, num_attention_heads=4,
                                              intermediate_size=128, num_hidden_layers=2,
                                              vocab_size=64))}
    with torch.no_grad():
        for model in models.values():
            for name, p in model.named_parameters():
                if "relative_attention_bias" in name:
                    p.normal_()
                else:
                    p.add_(torch.randn_like(p) * 0.05)
    return {n: m.eval() for n, m in models.items()}


def _relative_layer_calls(model, names, x, lengths):
    """Runs `model` in float64 on x [B, L, 64] (the decoder, if any, on the
    same x), each sequence's tokens past its length padded, and returns for
    each dotted module name its recorded (hidden states, key/value states,
    output): what the layer computes inside the whole model, with the bias
    the model gives it (T5: its stack's first layer's; MPNet: its
    encoder's)."""
    b, length, _ = x.shape
    keep = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    calls = {n: [] for n in names}
    model = model.double()
    for n in names:
        _spied(model.get_submodule(n), calls[n])
    xt = torch.from_numpy(x).double()
    try:
        with torch.no_grad():
            if hasattr(model, "decoder"):
                model(inputs_embeds=xt, attention_mask=keep, decoder_inputs_embeds=xt,
                      use_cache=False)
            else:
                model(inputs_embeds=xt, attention_mask=keep)
    finally:
        for n in names:
            del model.get_submodule(n).forward
        model.float()
    found = {}
    for n, ((args, kwargs, out),) in calls.items():
        hidden = args[0] if args else kwargs["hidden_states"]
        kv = kwargs.get("key_value_states")
        found[n] = (hidden.float().numpy(), None if kv is None else kv.float().numpy(),
                    out[0].numpy())
    return found


def test_relative_bias_layers_are_served_as_t5_and_mpnet_compute_them(tmp_path):
    """T5 and UMT5 (encoder self-attention, decoder self-attention, causal,
    and cross-attention) and MPNet (an encoder's, through attn.o): each
    exported from the whole model with its relative position bias (T5's
    second layers with the first layer's, UMT5's with their own, MPNet's
    with its encoder's) as one value per distance up to 128 keys, scale 1
    for T5; served as the layer computes it inside its model over 300
    tokens (past the buckets' max_distance both ways), with and without
    padding; a decoder session step by step equals one causal request.
    Exported alone, a T5 layer without its own bias and MPNet's attention
    are refused, naming where the bias is."""
    import harness
    harness.use_python_client()
    from attnserve_client import AttentionClient
    models = _relative_bias_models()
    layers = {  # name: (model, submodule, causal, relative bias, cross-attention)
        "t5-encoder": ("t5", "encoder.block.1.layer.0.SelfAttention", False, True, False),
        "t5-decoder": ("t5", "decoder.block.1.layer.0.SelfAttention", True, True, False),
        "t5-cross": ("t5", "decoder.block.1.layer.1.EncDecAttention", False, False, True),
        "umt5-encoder": ("umt5", "encoder.block.1.layer.0.SelfAttention", False, True, False),
        "umt5-decoder": ("umt5", "decoder.block.1.layer.0.SelfAttention", True, True, False),
        "mpnet": ("mpnet", "encoder.layer.1.attention", False, True, False),
    }
    for name, (model, submodule, causal, relative, _) in layers.items():
        config = export_module(models[model], str(tmp_path / name), submodule=submodule)
        assert config["causal"] is causal, name
        assert config.get("relative_bias_distance") == (128 if relative else None), name
        assert config.get("scale") == (None if model == "mpnet" else 1.0), name
    mpnet_inner = export_module(models["mpnet"], str(tmp_path / "mpnet-inner"),
                                submodule="encoder.layer.1.attention.attn")
    assert mpnet_inner["relative_bias_distance"] == 128
    x = np.random.default_rng(32).uniform(-1, 1, (2, 300, 64)).astype(np.float32)
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            for lengths in ([300, 300], [300, 211]):
                for model in ("t5", "umt5", "mpnet"):
                    # MPNetAttention's output is after its LayerNorm: the oracle is attn's.
                    names = {n: layers[n][1] + (".attn" if model == "mpnet" else "")
                             for n in layers if layers[n][0] == model}
                    if lengths[1] < 300 and model != "mpnet":  # padding: the encoders only
                        names = {n: s for n, s in names.items() if n.endswith("encoder")}
                    calls = _relative_layer_calls(models[model], list(names.values()), x,
                                                  lengths)
                    for name, submodule in names.items():
                        hidden, kv, want = calls[submodule]
                        kwargs = dict(key=kv, value=kv) if kv is not None else {}
                        got = client.attend(hidden, model=name, key_lengths=lengths,
                                            **kwargs).output
                        rows = lengths[1]  # padded queries' rows are the caller's
                        assert _rel(got[1, :rows], want[1, :rows]) < 2e-5, \
                            (name, lengths, _rel(got[1, :rows], want[1, :rows]))
                        assert _rel(got[0], want[0]) < 2e-5, (name, lengths, _rel(got[0], want[0]))
            got = client.attend(x[:1], model="mpnet-inner").output
            assert _rel(got, client.attend(x[:1], model="mpnet").output) < 1e-6
            for name in ("t5-decoder", "umt5-decoder"):
                whole = client.attend(x[:1, :170], model=name).output
                with client.open_session(name) as session:
                    got = [session.attend(x[:1, :20]).output]
                    got += [session.attend(x[:1, t:t + 1]).output for t in range(20, 150)]
                    got += [session.attend(x[:1, 150:170]).output]
                assert _rel(np.concatenate(got, axis=1), whole) < 1e-5, name
    finally:
        assert server.stop() == 0, server.log()

    for module, words in (
            (models["t5"].encoder.block[1].layer[0].SelfAttention,
             ["without a relative_attention_bias of its own", "submodule="]),
            (models["mpnet"].encoder.layer[1].attention.attn,
             ["MPNetEncoder.relative_attention_bias", "submodule="])):
        with pytest.raises(ExportError) as refused:
            export_module(module, str(tmp_path / "refused"))
        for word in words:
            assert word in str(refused.value), str(refused.value)
    assert not os.path.exists(tmp_path / "refused" / "config.pbtxt")


def _deberta_models():
    """Two-layer DeBERTa v2 models from transformers' own classes, random
    weights: v3's form (log buckets, 32 of them reaching 128 positions, the
    layer's own query and key projections for the positions, c2p and p2c),
    v2's without buckets and with pos_key_proj / pos_query_proj of their
    own, one with c2p alone; and v1's (in_proj per head, q_bias and v_bias,
    pos_proj and pos_q_proj, 128 relative positions)."""
    from transformers import DebertaConfig, DebertaModel, DebertaV2Config, DebertaV2Model
    torch.manual_seed(33)
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=512, relative_attention=True,
                  position_biased_input=False, norm_rel_ebd="layer_norm",
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    configs = {
        "deberta-v3": dict(position_buckets=32, max_relative_positions=128,
                           pos_att_type=["p2c", "c2p"], share_att_key=True),
        "deberta-v2": dict(position_buckets=-1, max_relative_positions=64,
                           pos_att_type=["p2c", "c2p"], share_att_key=False),
        "deberta-c2p": dict(position_buckets=32, max_relative_positions=128,
                            pos_att_type=["c2p"], share_att_key=True),
        "deberta-v1": {},
    }
    models = {}
    for name, extra in configs.items():
        model = DebertaV2Model(DebertaV2Config(**common, **extra)) if extra else \
            DebertaModel(DebertaConfig(**dict(common, norm_rel_ebd="none",
                                              max_position_embeddings=128),
                                       max_relative_positions=-1, pos_att_type=["c2p", "p2c"]))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        models[name] = model.eval()
    return models


def _deberta_layer_call(model, x, lengths):
    """(hidden states, attention output through output.dense) of layer 1's
    attention inside `model` run in float64 on x [B, L, 64], each
    sequence's tokens past its length padded: its DisentangledSelfAttention's
    input and output as recorded in the model's own run, then its output
    dense (DebertaV2SelfOutput's LayerNorm and residual are the caller's)."""
    length = x.shape[1]
    keep = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    attention = model.encoder.layer[1].attention
    calls = []
    model = model.double()
    _spied(attention.self, calls)
    try:
        with torch.no_grad():
            model(inputs_embeds=torch.from_numpy(x).double(), attention_mask=keep)
            (args, kwargs, out), = calls
            context = out[0] if isinstance(out, tuple) else out
            want = attention.output.dense(context)
    finally:
        del attention.self.forward
        model.float()
    hidden = args[0] if args else kwargs["hidden_states"]
    return hidden.float().numpy(), want.numpy()


def test_deberta_layers_are_served_as_deberta_computes_them(tmp_path):
    """DeBERTa's disentangled attention (DebertaV2Attention and v1's
    DebertaAttention through output.dense), exported from the whole model
    with its encoder's relative embeddings projected into per-distance
    tables: v3's log buckets with the layer's own projections, v2's plain
    distances with pos_key_proj and pos_query_proj, c2p alone, v1's in_proj
    per head with q_bias and v_bias and its pos_proj and pos_q_proj; scale 1
    / sqrt(head_dim * (1 + terms)).
    Served as the layer computes it inside its model over 300 tokens (past
    the buckets' reach both ways), with and without padding. Refused: its
    DisentangledSelfAttention alone (no output projection), the attention
    exported without its encoder, and v1's talking heads."""
    import harness
    harness.use_python_client()
    from attnserve_client import AttentionClient
    models = _deberta_models()
    reach = {"deberta-v3": 128, "deberta-v2": 64, "deberta-c2p": 128, "deberta-v1": 128}
    for name, model in models.items():
        config = export_module(model, str(tmp_path / name), submodule="encoder.layer.1.attention")
        embeddings = config["relative_embeddings"]
        assert embeddings["distance"] == reach[name], (name, embeddings)
        assert embeddings["content_to_position"] is True
        assert embeddings["position_to_content"] is (name != "deberta-c2p")
        terms = 2 if name == "deberta-c2p" else 3
        assert config["scale"] == pytest.approx(1 / math.sqrt(16 * terms)), name
        assert config["causal"] is False
    x = np.random.default_rng(34).uniform(-1, 1, (2, 300, 64)).astype(np.float32)
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            for lengths in ([300, 300], [300, 211]):
                for name, model in models.items():
                    hidden, want = _deberta_layer_call(model, x, lengths)
                    got = client.attend(hidden, model=name, key_lengths=lengths).output
                    rows = lengths[1]  # padded queries' rows are the caller's
                    assert _rel(got[1, :rows], want[1, :rows]) < 2e-5, \
                        (name, lengths, _rel(got[1, :rows], want[1, :rows]))
                    assert _rel(got[0], want[0]) < 2e-5, (name, lengths, _rel(got[0], want[0]))
    finally:
        assert server.stop() == 0, server.log()

    from transformers import DebertaConfig, DebertaModel
    talking = DebertaModel(DebertaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, intermediate_size=128,
                                         relative_attention=True, talking_head=True,
                                         pos_att_type=["c2p", "p2c"])).eval()
    attention = models["deberta-v3"].encoder.layer[1].attention
    for module, submodule, words in (
            (attention.self, None, ["no output projection", "DebertaV2Attention"]),
            (attention, None, ["DebertaV2Encoder.rel_embeddings", "submodule="]),
            (talking, "encoder.layer.0.attention", ["talking heads", "head_logits_proj"])):
        with pytest.raises(ExportError) as refused:
            export_module(module, str(tmp_path / "refused"), submodule=submodule)
        for word in words:
            assert word in str(refused.value), str(refused.value)
    assert not os.path.exists(tmp_path / "refused" / "config.pbtxt")


def test_falcon_layers_are_served_in_each_qkv_layout(tmp_path):
    """Falcon with RoPE (transformers 4.45's FalconAttention): its
    query_key_value in each layout, Falcon-7B's multi-query [queries | key |
    value], Falcon-40B's and 180B's groups per KV head
    (new_decoder_architecture), and per head with biases; served as the
    module computes it (its rotary class's cos and sin), and a session step
    by step equals one causal request."""
    import harness
    harness.use_python_client()
    from attnserve_client import AttentionClient
    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention, FalconRotaryEmbedding
    layouts = {"falcon-7b": dict(multi_query=True, new_decoder_architecture=False, bias=False),
               "falcon-40b": dict(new_decoder_architecture=True, num_kv_heads=2, bias=False),
               "falcon-per-head": dict(multi_query=False, new_decoder_architecture=False,
                                       bias=True)}
    torch.manual_seed(23)
    modules = {}
    for name, layout in layouts.items():
        config = FalconConfig(hidden_size=96, num_attention_heads=6 if name != "falcon-40b"
                              else 4, alibi=False, rope_theta=5000.0, **layout)
        config._attn_implementation = "eager"
        m = FalconAttention(config, layer_idx=0)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        modules[name] = m.eval()
        exported = export_module(m, str(tmp_path / name))
        assert exported["causal"] is True and exported["rope"]["interleaved"] is False
    x = np.random.default_rng(24).uniform(-1, 1, (2, 40, 96)).astype(np.float32)
    length = x.shape[1]
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client, torch.no_grad():
            for name, m in modules.items():
                md = m.double()
                xt = torch.from_numpy(x).double()
                positions = torch.arange(length)[None].expand(2, length)
                cos_sin = FalconRotaryEmbedding(config=m.config).double()(xt, positions)
                mask = torch.full((length, length), float("-inf"), dtype=torch.float64)
                mask = mask.triu(1).expand(2, 1, length, length)
                want = md(xt, alibi=None, attention_mask=mask, position_ids=positions,
                          position_embeddings=cos_sin)[0].numpy()
                m.float()
                got = client.attend(x, model=name).output
                assert _rel(got, want) < 2e-5, (name, _rel(got, want))
                with client.open_session(name) as session:
                    steps = [session.attend(x[:1, :16]).output]
                    steps += [session.attend(x[:1, t:t + 1]).output for t in range(16, 40)]
                assert _rel(np.concatenate(steps, axis=1), got[:1]) < 1e-5, name
    finally:
        assert server.stop() == 0, server.log()


def test_modernbert_layers_are_served_both_ways(tmp_path):
    """ModernBERT's global layer (every key) and local layer (|i - j| <= 8 of
    a local_attention of 16: attnserve's two-sided window of 9), Wqkv split
    into three projections, Wo, RoPE by layer type; served as the modules
    compute them."""
    import harness
    from attnserve_client import AttentionClient
    torch.manual_seed(11)
    modules = {"global": _ModernBertAttention(0), "local": _ModernBertAttention(1, bias=True)}
    configs = {n: export_module(m, str(tmp_path / n)) for n, m in modules.items()}
    assert configs["local"]["sliding_window"] == WINDOW // 2 + 1 and not configs["local"]["causal"]
    assert "sliding_window" not in configs["global"] and configs["global"]["num_kv_heads"] == 4
    assert configs["global"]["rope"]["theta"] == 160000.0
    assert configs["local"]["rope"]["theta"] == 1e4
    x = np.random.default_rng(12).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            for name, reach in (("global", 40), ("local", WINDOW // 2)):
                want = _module_forward(modules[name], x, reach=reach)
                got = client.attend(x, model=name).output
                assert _rel(got, want) < 2e-5, (name, _rel(got, want))
            assert _rel(got, _module_forward(modules["local"], x, reach=WINDOW // 2 + 1)) > 1e-3
    finally:
        assert server.stop() == 0, server.log()


def test_bidirectional_gemma4_layers_are_served_both_ways(tmp_path):
    """use_bidirectional_attention "all" (Gemma 4's embedding models): its
    full layers attend to every key (the module's is_causal), its sliding
    ones to the keys with |p - j| <= sliding_window (transformers' config
    halves the checkpoint's 16 to 16 // 2 + 1 = 9; masking_utils'
    sliding_window_bidirectional_overlay, inclusive): exported without causal,
    the sliding ones with attnserve's two-sided window of 10 (p - 9 .. p + 9),
    and served as the modules compute them under those masks. A layer whose
    window is two-sided is refused with causal=True, and a causal one with
    causal=False."""
    import harness
    from attnserve_client import AttentionClient
    modules = {}
    for name in ("gemma4-full", "gemma4-sliding"):
        m = modules[name] = _Gemma4Attention(name)
        m.config.use_bidirectional_attention, m.is_causal = "all", False
        if m.sliding_window:
            m.sliding_window = WINDOW // 2 + 1
    full = export_module(modules["gemma4-full"], str(tmp_path / "gemma4-full"))
    assert full["causal"] is False and "sliding_window" not in full
    sliding = export_module(modules["gemma4-sliding"], str(tmp_path / "gemma4-sliding"))
    assert sliding["causal"] is False and sliding["sliding_window"] == WINDOW // 2 + 2
    x = np.random.default_rng(9).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as client:
            for name, reach in (("gemma4-full", 40), ("gemma4-sliding", WINDOW // 2 + 1)):
                want = _module_forward(modules[name], x, reach=reach)
                got = client.attend(x, model=name).output
                assert _rel(got, want) < 2e-5, (name, _rel(got, want))
                # Causal, or one key less each way, is another answer.
                other = _module_forward(modules[name], x) if name == "gemma4-full" else \
                    _module_forward(modules[name], x, reach=reach - 1)
                assert _rel(got, other) > 1e-3, name
    finally:
        assert server.stop() == 0, server.log()
    with pytest.raises(ExportError) as refused:
        export_module(modules["gemma4-sliding"], str(tmp_path / "forced"), causal=True)
    assert "sliding window (10) is two-sided" in str(refused.value)
    assert "export it with causal=False" in str(refused.value)
    with pytest.raises(ExportError) as refused:
        export_module(_served_module("mistral"), str(tmp_path / "mistral"), causal=False)
    assert "is one-sided" in str(refused.value) and "causal=True" in str(refused.value)


def test_llama4_layers_are_exported_with_their_chunks_and_temperature(tmp_path, served):
    """Llama 4's RoPE layer (served with the families above): chunked
    attention, interleaved llama3 RoPE with Scout's equal low and high
    factors, the weightless L2 norm after RoPE as weights of 1. Its layer
    without RoPE: attention temperature tuning, by each query's index, in one
    request and in a session step by step; explicit positions are refused on
    the chunked layer."""
    import harness
    from attnserve_client import AttentionClient
    client, _, configs, weights = served
    chunked = configs["llama4"]
    assert chunked["attention_chunk"] == LLAMA4_CHUNK and chunked["causal"]
    assert chunked["rope"]["interleaved"] and chunked["rope"]["type"] == "llama3"
    assert chunked["qk_norm"] == {"eps": 1e-5, "weight_offset": False, "after_rope": True}
    assert np.all(weights["llama4"]["q_norm.weight"] == 1.0)
    assert "temperature_tuning" not in chunked
    with pytest.raises(Exception) as refused:
        client.attend(np.zeros((1, 4, 64), np.float32), model="llama4", causal=True,
                      positions=[[0, 1, 2, 3]])
    assert "chunked attention (attention_chunk 16) follows the token index" in str(refused.value)

    module = _served_module("llama4-nope")
    config = export_module(module, str(tmp_path / "llama4-nope"))
    assert config["temperature_tuning"] == {"floor_scale": 4.0, "attn_scale": 0.1}
    assert "rope" not in config and "qk_norm" not in config and "attention_chunk" not in config
    x = np.random.default_rng(8).uniform(-1, 1, (2, 48, 64)).astype(np.float32)
    want = _module_forward(module, x)
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as c:
            got = c.attend(x, model="llama4-nope", causal=True).output
            assert _rel(got, want) < 2e-5, _rel(got, want)
            with c.open_session("llama4-nope") as session:
                steps = [session.attend(x[:1, :20], causal=True).output]
                steps += [session.attend(x[:1, t:t + 1], causal=True).output
                          for t in range(20, 48)]
            assert _rel(np.concatenate(steps, axis=1), want[:1]) < 2e-5
    finally:
        assert server.stop() == 0, server.log()
    # Without the temperature the answer is another one.
    plain = _Llama4Attention(use_rope=False)
    plain.load_state_dict(module.state_dict())
    plain.attn_temperature_tuning = False
    assert _rel(_module_forward(plain, x), want) > 1e-3


def test_gemma2_exports_its_window_softcap_and_scale(served):
    client, _, configs, _ = served
    sliding, full = configs["gemma2-sliding"], configs["gemma2-full"]
    assert sliding["sliding_window"] == WINDOW and "sliding_window" not in full
    assert sliding["softcap"] == 5.0 and full["softcap"] == 5.0
    assert abs(sliding["scale"] - 24 ** -0.5) < 1e-7  # query_pre_attn_scalar, not head_dim
    reported = client.get_model("gemma2-sliding").config
    assert reported.sliding_window == WINDOW and reported.softcap == 5.0


def test_qk_norm_is_exported_and_reported(served):
    client, _, configs, _ = served
    assert configs["qwen3"]["qk_norm"] == {"eps": 1e-6, "weight_offset": False}
    assert configs["gemma3"]["qk_norm"]["weight_offset"] is True
    reported = client.get_model("gemma3").config
    assert reported.HasField("qk_norm") and reported.qk_norm.weight_offset
    assert reported.qk_norm.eps == 1e-6
    assert not client.get_model("llama").config.HasField("qk_norm")
    # OLMo-2: one norm over each token's whole Q (64 features) and K (32).
    assert configs["olmo2"]["qk_norm"] == {"eps": 1e-6, "weight_offset": False,
                                           "whole_projection": True}
    assert client.get_model("olmo2").config.qk_norm.whole_projection
    assert not reported.qk_norm.whole_projection
    # Hunyuan: per head, after RoPE.
    assert configs["hunyuan"]["qk_norm"] == {"eps": 1e-6, "weight_offset": False,
                                             "after_rope": True}
    assert client.get_model("hunyuan").config.qk_norm.after_rope


@pytest.mark.parametrize("family", ["cohere-qk-norm", "stablelm-qk-layernorm"])
def test_qk_layernorm_is_exported_with_weights_per_head(served, family):
    """Command R+'s use_qk_norm (CohereLayerNorm with weights [heads,
    head_dim]) and StableLM 2's qk_layernorm (one nn.LayerNorm per head): a
    LayerNorm without a bias over each head of Q and K, exported with each
    head's weights at its row of [heads, head_dim]; served as the NumPy layer
    computes it, which both flags change: without the mean subtracted, or
    with head 0's weights on every head, the answer is another."""
    client, modules, configs, weights = served
    config = configs[family]
    assert config["qk_norm"] == {"eps": 1e-5, "weight_offset": False, "subtract_mean": True,
                                 "per_head_weights": True}
    reported = client.get_model(family).config.qk_norm
    assert reported.subtract_mean and reported.per_head_weights and reported.eps == 1e-5
    assert not client.get_model("qwen3").config.qk_norm.subtract_mean
    w = weights[family]
    for name, heads in (("q", 4), ("k", 2)):
        norm = getattr(modules[family], f"{name}_norm", None) or \
            getattr(modules[family], f"{name}_layernorm")
        stored = torch.stack([n.weight for n in norm.norms]) if hasattr(norm, "norms") \
            else norm.weight
        assert w[f"{name}_norm.weight"].shape == (heads, 16)
        np.testing.assert_array_equal(w[f"{name}_norm.weight"], stored.detach().float().numpy())
    x = np.random.default_rng(8).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    want = _np_layer(x, w, config)
    got = client.attend(x, model=family, causal=True).output
    assert _rel(got, want) < 2e-5, _rel(got, want)
    rms = dict(config, qk_norm=dict(config["qk_norm"], subtract_mean=False))
    assert _rel(_np_layer(x, w, rms), want) > 1e-3
    shared = dict(w, **{n: np.broadcast_to(w[n][:1], w[n].shape) for n in ("q_norm.weight",
                                                                             "k_norm.weight")})
    assert _rel(_np_layer(x, shared, config), want) > 1e-3


def _beyond_clip(module, x):
    """The share of each of the module's projected Q, K and V features (Q and
    K after OLMoE's QK-norm) beyond its clip_qkv, on input x."""
    x = torch.from_numpy(x)
    with torch.no_grad():
        if hasattr(module, "Wqkv"):  # DBRX: rows [q | k | v]
            q, k, v = module.Wqkv(x).split([64, 32, 32], dim=-1)
            clip = module.clip_qkv
        else:
            q, k, v = module.q_proj(x), module.k_proj(x), module.v_proj(x)
            if hasattr(module, "q_norm"):
                q, k = module.q_norm(q), module.k_norm(k)
            clip = module.config.clip_qkv
    return [float((t.abs() > clip).double().mean()) for t in (q, k, v)]


@pytest.mark.parametrize("family", ["olmo-clip", "olmoe-clip", "dbrx-clip"])
def test_clip_qkv_clamps_as_the_module_does(served, family):
    """QKV clipping at CLIP: a good share of each of Q, K and V lies beyond
    it, so the answer tells clamping from not; the served answer is the
    module's (above) and the NumPy layer's with the clamp, and another than
    the same layer's without it."""
    client, modules, configs, weights = served
    assert configs[family]["clip_qkv"] == CLIP
    x = np.random.default_rng(1).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    shares = _beyond_clip(modules[family], x)
    assert min(shares) > 0.3, shares
    got = client.attend(x, model=family, causal=True).output
    assert _rel(got, _np_layer(x, weights[family], configs[family])) < 2e-5
    unclipped = {k: v for k, v in configs[family].items() if k != "clip_qkv"}
    assert _rel(got, _np_layer(x, weights[family], unclipped)) > 1e-2


@pytest.mark.parametrize("family", ["olmo-0424", "dbrx"])
def test_the_real_clip_of_8_binds_on_large_activations(served, family):
    """OLMo-7B-0424's and DBRX's clip_qkv of 8, exported as they are: inputs
    30 times those of the other tests put many features beyond 8, and the
    served answer is still the module's float64 one."""
    client, modules, configs, _ = served
    assert configs[family]["clip_qkv"] == 8.0
    x = (30 * np.random.default_rng(11).uniform(-1, 1, (2, 40, 64))).astype(np.float32)
    shares = _beyond_clip(modules[family], x)
    assert min(shares) > 0.1, shares
    got = client.attend(x, model=family, causal=True).output
    want = _module_forward(modules[family], x)
    assert _rel(got, want) < 2e-5, _rel(got, want)


def test_clip_qkv_is_exported_and_reported(served):
    """clip_qkv in the config and in GetModel; DBRX's Wqkv exported as the
    three projections its rows are (grouped-query widths), its out_proj by
    name, its attn_config's theta."""
    client, modules, configs, weights = served
    assert "clip_qkv" not in configs["olmoe"] and configs["olmoe-clip"]["qk_norm"] == {
        "eps": 1e-5, "weight_offset": False, "whole_projection": True}
    dbrx = configs["dbrx"]
    assert (dbrx["num_heads"], dbrx["num_kv_heads"], dbrx["head_dim"]) == (4, 2, 16)
    assert dbrx["weight_layout"] == "SEPARATE_QKV" and dbrx["causal"]
    assert dbrx["tensor_names"] == {"out_weight": "out_proj.weight", "out_bias": "out_proj.bias"}
    assert dbrx["rope"] == {"type": "default", "theta": 5e5, "rotary_dim": 16,
                            "interleaved": False}
    wqkv = modules["dbrx"].Wqkv.weight.detach().numpy()
    for name, rows in (("q_proj", slice(0, 64)), ("k_proj", slice(64, 96)),
                       ("v_proj", slice(96, 128))):
        np.testing.assert_array_equal(weights["dbrx"][f"{name}.weight"], wqkv[rows])
    assert sorted(weights["dbrx"]) == ["k_proj.weight", "out_proj.weight", "q_proj.weight",
                                       "v_proj.weight"]
    assert client.get_model("dbrx").config.clip_qkv == 8.0
    assert client.get_model("olmoe-clip").config.clip_qkv == CLIP
    assert client.get_model("olmoe").config.clip_qkv == 0


def test_olmoe_clamps_after_its_qk_norm(served):
    """OLMoE: q_norm(q_proj(x)) (one RMSNorm over the whole projection), then
    the clamp, then RoPE: attnserve's order. The clamp first would give
    another answer, which the served one is not."""
    client, modules, configs, weights = served
    config = configs["olmoe-clip"]
    x = np.random.default_rng(12).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    got = client.attend(x, model="olmoe-clip", causal=True).output
    assert _rel(got, _module_forward(modules["olmoe-clip"], x)) < 2e-5
    assert _rel(got, _np_layer(x, weights["olmoe-clip"], config)) < 2e-5
    other = _np_layer(x, weights["olmoe-clip"], config, clamp_first=True)
    assert _rel(got, other) > 1e-2, _rel(got, other)


def test_get_model_reports_the_resolved_rope(served):
    client, _, configs, _ = served
    model = client.get_model("llama3")
    rope = model.config.rope
    assert rope.type == "llama3"
    assert rope.theta == 5e5 and rope.factor == 8.0 and rope.rotary_dim == 16
    assert rope.original_max_position_embeddings == 256
    neox = client.get_model("gpt-neox").config.rope
    assert neox.type == "default" and neox.rotary_dim == 8  # rotary_pct 0.5 of 16


def test_latent_attention_is_exported_as_deepseek_computes_it(served):
    """DeepSeek-V3's latent attention: its dims, the norms' eps, the YaRN
    cos/sin factor mscale / mscale_all_dim and the softmax scale times
    mscale_all_dim's mscale squared, interleaved pairs, the biases of
    q_a_proj, kv_a_proj_with_mqa and o_proj; GetModel reports it. A request
    carries only the query: a key (and value) is refused, naming it."""
    client, modules, configs, weights = served
    config, module = configs["deepseek-v3"], modules["deepseek-v3"]
    assert config["latent_attention"] == dict(q_lora_rank=24, kv_lora_rank=32,
                                              qk_rope_head_dim=8, v_head_dim=12,
                                              q_norm_eps=1e-6, kv_norm_eps=1e-6)
    assert (config["num_heads"], config["num_kv_heads"], config["head_dim"]) == (4, 4, 24)
    assert config["causal"] and config["weight_layout"] == "SEPARATE_QKV"
    assert (config["q_bias"], config["k_bias"], config["v_bias"], config["out_bias"]) == \
        (True, True, False, True)
    yarn = DEEPSEEK_YARN
    mscale, mscale_all = (0.1 * m * math.log(yarn["factor"]) + 1 for m in
                          (yarn["mscale"], yarn["mscale_all_dim"]))
    assert config["scale"] == module.scaling
    assert math.isclose(config["scale"], 24 ** -0.5 * mscale_all ** 2)
    rope = config["rope"]
    assert (rope["type"], rope["rotary_dim"], rope["interleaved"]) == ("yarn", 8, True)
    assert rope["original_max_position_embeddings"] == 64 and rope["factor"] == 4.0
    assert math.isclose(rope["attention_factor"], mscale / mscale_all)
    assert sorted(weights["deepseek-v3"]) == sorted([
        "q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
        "kv_b_proj.weight", "o_proj.weight", "o_proj.bias"])
    plain = configs["deepseek-v3-q-proj"]
    assert plain["latent_attention"] == dict(q_lora_rank=0, kv_lora_rank=32, qk_rope_head_dim=8,
                                             v_head_dim=12, kv_norm_eps=1e-6)
    assert not plain["rope"]["interleaved"] and "scale" in plain
    assert not any((plain["q_bias"], plain["k_bias"], plain["out_bias"]))
    reported = client.get_model("deepseek-v3").config
    assert reported.HasField("latent_attention")
    assert (reported.latent_attention.q_lora_rank, reported.latent_attention.kv_lora_rank,
            reported.latent_attention.qk_rope_head_dim, reported.latent_attention.v_head_dim) == \
        (24, 32, 8, 12)
    assert reported.rope.rotary_dim == 8 and reported.q_bias and reported.k_bias
    assert not client.get_model("llama").config.HasField("latent_attention")
    x = np.random.default_rng(9).uniform(-1, 1, (1, 6, 64)).astype(np.float32)
    with pytest.raises(Exception) as refused:
        client.attend(x, x, x, model="deepseek-v3", causal=True)
    assert "key: not accepted by model 'deepseek-v3'" in str(refused.value), str(refused.value)
    # Without YaRN's mscale in the scale the answer is another one.
    other = client.attend(x, model="deepseek-v3", causal=True, scale=24 ** -0.5).output
    assert _rel(other, client.attend(x, model="deepseek-v3", causal=True).output) > 1e-3


def test_dsa_layers_are_served_dense_up_to_index_topk(tmp_path):
    """DeepSeek-V3.2's sparse attention (DSA): its indexer keeps each query's
    top min(index_topk, keys) keys, so up to index_topk keys the layer is
    DeepSeek-V3's dense latent attention (transformers' DeepseekV32Attention
    against the server: tests/hf/current_transformers.py). Exported with
    sparse_index_topk (the indexer's weights not needed), served as the dense
    module computes it up to 40 keys, in one request and in a session; 41
    keys are refused, in a request and in a session, naming the rule."""
    import harness
    from attnserve_client import AttentionClient
    module = _served_module("deepseek-v3")
    module.config.model_type, module.config.index_topk = "deepseek_v32", 40
    module.indexer = nn.Linear(64, 8)  # its weights are not exported
    config = export_module(module, str(tmp_path / "dsa"))
    assert config["sparse_index_topk"] == 40 and config["latent_attention"]["kv_lora_rank"] == 32
    from attnserve_client.export import read_safetensors
    assert "indexer.weight" not in read_safetensors(str(tmp_path / "dsa" / "weights.safetensors"))
    x = np.random.default_rng(13).uniform(-1, 1, (2, 41, 64)).astype(np.float32)
    want = _module_forward(module, x[:, :40])
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as c:
            assert c.get_model("dsa").config.sparse_index_topk == 40
            got = c.attend(x[:, :40], model="dsa", causal=True).output
            assert _rel(got, want) < 2e-5, _rel(got, want)
            with pytest.raises(Exception) as refused:
                c.attend(x, model="dsa", causal=True)
            assert "query: 41 keys; model 'dsa' is served for at most sparse_index_topk = 40" in \
                str(refused.value)
            with c.open_session("dsa") as session:
                steps = [session.attend(x[:1, :30]).output]
                steps += [session.attend(x[:1, t:t + 1]).output for t in range(30, 40)]
                assert _rel(np.concatenate(steps, axis=1), want[:1]) < 2e-5
                with pytest.raises(Exception) as refused:
                    session.attend(x[:1, 40:41])
                assert "holds 40 tokens; 1 more would pass its model's sparse_index_topk = 40" in \
                    str(refused.value)
    finally:
        assert server.stop() == 0, server.log()


def test_latent_layers_without_rope_and_from_a_whole_checkpoint(tmp_path):
    """Kimi Linear's latent layers (no RoPE) are served as their module
    computes them; so is LongCat-Flash exported from its whole model's
    state_dict (tensor_prefix), its query and latent scales folded into
    q_b_proj and kv_a_layernorm under the prefix."""
    import harness
    from attnserve_client import AttentionClient
    kimi = _served_module("kimi-linear")
    config = export_module(kimi, str(tmp_path / "kimi-linear"))
    assert "rope" not in config and config["latent_attention"]["q_lora_rank"] == 0
    longcat = _served_module("longcat-flash")
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].self_attn = longcat
    config = export_module(model, str(tmp_path / "longcat"), submodule="layers.0.self_attn",
                           full_state_dict=True)
    assert config["tensor_prefix"] == "layers.0.self_attn." and config["rope"]["interleaved"]
    x = np.random.default_rng(10).uniform(-1, 1, (2, 40, 64)).astype(np.float32)
    server = harness.ServerProcess("--model-repository", str(tmp_path), "--backend", "cpu")
    try:
        with AttentionClient(server.target, timeout=120) as c:
            for name, module in (("kimi-linear", kimi), ("longcat", longcat)):
                got = c.attend(x, model=name, causal=True).output
                want = _module_forward(module, x)
                assert _rel(got, want) < 2e-5, f"{name}: {_rel(got, want)}"
    finally:
        assert server.stop() == 0, server.log()


def _latent_variant(change):
    """The DeepSeek-V3 stand-in with one thing changed, as models that copy
    its attention change it."""
    m = _DeepseekV3Attention("deepseek-v3")
    if change == "layernorm":
        m.kv_a_layernorm = nn.LayerNorm(32)
    elif change == "gemma-norm":
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        m.q_a_layernorm = GemmaRMSNorm(24, eps=1e-6)
    elif change == "indexer":  # DeepSeek-V3.2
        m.indexer = nn.Linear(64, 8)
    elif change == "shared-indexer":  # a DSA layer that reuses another's top-k
        m.indexer, m.skip_topk = None, True
    elif change == "head-gate":  # Ling 3 (bailing_hybrid)
        m.g_proj = nn.Linear(64, 4, bias=False)
    elif change == "sinks":
        m.sinks = nn.Parameter(torch.zeros(4))
    elif change == "mystery":
        m.config.model_type = "mystery_mla"
    elif change == "dynamic":
        m.config.rope_scaling = dict(rope_type="dynamic", factor=2.0)
    elif change == "mistral4":
        m.config.rope_scaling = dict(DEEPSEEK_YARN, llama_4_scaling_beta=0.1)
    elif change == "rotary-width":
        m.config.head_dim = 16
    elif change == "q-bias":
        m.q_b_proj.bias = nn.Parameter(torch.zeros(96))
    elif change == "no-kv-b":
        del m.kv_b_proj
    elif change == "clip":
        m.config.clip_qkv = 8.0
    return m


@pytest.mark.parametrize("change,words", [
    ("layernorm", ["kv_a_layernorm LayerNorm", "not RMSNorm"]),
    ("gemma-norm", ["q_a_layernorm GemmaRMSNorm", "x * (1 + w)"]),
    ("indexer", ["sparse-attention indexer"]),
    ("shared-indexer", ["sparse-attention indexer"]),
    ("head-gate", ["gate on the attention output (g_proj"]),
    ("sinks", ["attention sinks"]),
    ("mystery", ["latent attention of model type 'mystery_mla'"]),
    ("dynamic", ["RoPE scaling type 'dynamic'"]),
    ("mistral4", ["llama_4_scaling_beta=0.1"]),
    ("rotary-width", ["RoPE over 16 features, not the qk_rope_head_dim 8"]),
    ("q-bias", ["a bias on q_b_proj"]),
    ("no-kv-b", ["without the linear(s) kv_b_proj"]),
    ("clip", ["QKV clipping (clip_qkv=8.0) on multi-head latent attention"]),
])
def test_latent_attention_that_attnserve_cannot_compute_is_refused_by_name(tmp_path, change,
                                                                          words):
    from attnserve_client.export import unsupported_features
    assert unsupported_features(_DeepseekV3Attention("deepseek-v3")) == []
    with pytest.raises(ExportError) as refused:
        export_module(_latent_variant(change), str(tmp_path / change))
    for word in words:
        assert word in str(refused.value), str(refused.value)
    assert not os.path.exists(tmp_path / change / "config.pbtxt"), "nothing is written"


# --- refused by name ---

def _refused_module(family):
    if family == "qwen2-windowed":
        from transformers import Qwen2Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
        config = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=256)
        return Qwen2Attention(config, layer_idx=0), ["sliding window of 256", "'qwen2'"]
    if family == "llama-dynamic":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention
        config = LlamaConfig(**COMMON, rope_scaling=dict(rope_type="dynamic", factor=2.0))
        return LlamaAttention(config, layer_idx=0), ["'dynamic'"]
    if family == "mpt-alone":
        # MPT's attention module keeps no config: its alibi_bias_max unknown.
        from transformers import MptConfig
        from transformers.models.mpt.modeling_mpt import MptAttention
        config = MptConfig(d_model=64, n_heads=4, attn_config=dict(clip_qkv=8.0))
        return MptAttention(config), ["MPT's ALiBi without the model's config",
                                      "alibi_bias_max"]
    raise AssertionError(family)


@pytest.mark.parametrize("family", ["qwen2-windowed", "llama-dynamic", "mpt-alone"])
def test_what_attnserve_cannot_compute_is_refused_by_name(tmp_path, family):
    module, words = _refused_module(family)
    with pytest.raises(ExportError) as refused:
        export_module(module, str(tmp_path / family))
    for word in words:
        assert word in str(refused.value), str(refused.value)
    assert not os.path.exists(tmp_path / family / "config.pbtxt"), "nothing is written"


class _StandIn(nn.Module):
    """q/k/v/o projections plus what a transformers 5.x module carries."""

    def __init__(self, config=None, qk_norm=False, sinks=False, gate=False):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(64, 64), nn.Linear(64, 32)
        self.v_proj, self.o_proj = nn.Linear(64, 32), nn.Linear(64, 64)
        if gate:
            self.gate_proj = nn.Linear(64, 64)
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 16
        if config is not None:
            self.config = config
        if qk_norm == "mixed":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm
            self.q_norm, self.k_norm = LlamaRMSNorm(16), LlamaRMSNorm(32)
        elif qk_norm == "gemma":
            from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
            self.q_norm, self.k_norm = GemmaRMSNorm(16), GemmaRMSNorm(16)
        elif qk_norm == "layernorm":
            self.q_norm, self.k_norm = nn.LayerNorm(16), nn.LayerNorm(16)
        elif qk_norm == "per_head_and_shared":  # Cohere's LayerNorm, [4, 16] and [16]
            from transformers.models.cohere.modeling_cohere import CohereLayerNorm
            self.q_norm, self.k_norm = CohereLayerNorm((4, 16)), CohereLayerNorm(16)
        elif qk_norm == "other_eps":
            self.q_norm, self.k_norm = _OtherEpsNorm(), _OtherEpsNorm()
        elif qk_norm == "after_rope":  # Hunyuan's names
            from transformers.models.llama.modeling_llama import LlamaRMSNorm
            self.query_layernorm, self.key_layernorm = LlamaRMSNorm(16), LlamaRMSNorm(16)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(2 if sinks == "wrong" else 4))


class _OtherEpsNorm(nn.Module):
    """An RMSNorm that says eps 1e-6 and adds 1e-2: on inputs of unit scale
    it computes about what it says, on small ones not."""

    def __init__(self):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(16)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * self.weight


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.mark.parametrize("module,words", [
    # QK-norm per head on Q and over the whole projection on K.
    (lambda: _StandIn(_Config(model_type="olmo2", rope_theta=1e4), qk_norm="mixed"),
     ["per head on one of Q and K"]),
    # QKV clipping (served for OLMo, OLMoE and DBRX) in a model type whose
    # clamp is not checked, with a limit attnserve cannot say (transformers
    # clamps every feature to 0 with 0), or with a QK-norm in another order
    # than OLMoE's (its norm, then the clamp, before RoPE).
    (lambda: _StandIn(_Config(model_type="llama", rope_theta=1e4, clip_qkv=8.0)),
     ["QKV clipping (clip_qkv=8.0) in a model of type 'llama'", "served: dbrx, mpt, olmo, olmoe"]),
    (lambda: _StandIn(_Config(model_type="olmo", rope_theta=1e4, clip_qkv=0.0)),
     ["QKV clipping with clip_qkv=0.0", "finite clip_qkv > 0"]),
    (lambda: _StandIn(_Config(model_type="olmo", rope_theta=1e4, clip_qkv=8.0),
                      qk_norm="gemma"),
     ["QKV clipping (clip_qkv=8.0) with a QK-norm before RoPE in a model of type 'olmo'"]),
    (lambda: _StandIn(_Config(model_type="olmoe", rope_theta=1e4, clip_qkv=8.0),
                      qk_norm="after_rope"),
     ["QKV clipping (clip_qkv=8.0) with a QK-norm after RoPE in a model of type 'olmoe'"]),
    # A LayerNorm with a bias over Q and K (attnserve's, Cohere's, has none).
    (lambda: _StandIn(_Config(model_type="qwen3", rope_theta=1e4), qk_norm="layernorm"),
     ["QK-norm LayerNorm with a bias"]),
    # Weights per head on Q and shared by the heads on K.
    (lambda: _StandIn(_Config(model_type="cohere", rope_theta=1e4),
                      qk_norm="per_head_and_shared"),
     ["weights per head on one of Q and K and shared by the heads on the other"]),
    # A norm whose eps is not the one it says (its numbers on a small probe).
    (lambda: _StandIn(_Config(model_type="qwen3", rope_theta=1e4), qk_norm="other_eps"),
     ["QK-norm _OtherEpsNorm, which computes none of", "1e-06"]),
    # Sinks that are not one per query head.
    (lambda: _StandIn(_Config(model_type="llama", rope_theta=1e4), sinks="wrong"),
     ["attention sinks of shape (2,)"]),
    # A window from the config of a model that places its windowed layers itself.
    (lambda: _StandIn(_Config(model_type="gpt_oss", sliding_window=128, rope_theta=1e4)),
     ["sliding window of 128 tokens in a model of type 'gpt_oss'"]),
    # What a model type computes that attnserve does not, named.
    (lambda: _StandIn(_Config(model_type="phimoe", rope_theta=1e4)),
     ["(phimoe)", "long factors transformers never applies"]),
    # A gate on the attention output of a model type whose gating is unknown.
    (lambda: _StandIn(_Config(model_type="llama", rope_theta=1e4), gate=True),
     ["gate on the attention output (gate_proj) of model type 'llama'"]),
    # Qwen3-Next's gate lives in q_proj: one only as wide as the query is not it.
    (lambda: _StandIn(_Config(model_type="qwen3_next", rope_theta=1e4)), ["gated attention"]),
    # RoPE of a model type whose pairing attnserve does not know.
    (lambda: _StandIn(_Config(model_type="mystery", rope_theta=1e4)), ["'mystery'"]),
    # Gemma3 in transformers 5.x: RoPE parameters per layer type.
    (lambda: _StandIn(_Config(model_type="gemma3_text", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), qk_norm="gemma"),
     ["per layer type", "full_attention"]),
])
def test_transformers_5_features_are_refused_too(tmp_path, module, words):
    with pytest.raises(ExportError) as refused:
        export_module(module(), str(tmp_path / "m"))
    for word in words:
        assert word in str(refused.value), str(refused.value)


@pytest.mark.parametrize("model_type,config,layer,rope,window", [
    # Cohere2 (Command R7B): RoPE (interleaved) on its sliding layers only.
    ("cohere2", {}, dict(sliding_window=16), "interleaved", 16),
    ("cohere2", {}, dict(sliding_window=None), None, None),
    # EXAONE 4: likewise, its modules keeping the window on every layer.
    ("exaone4", dict(sliding_window=16), dict(sliding_window=16, is_sliding=True), "half", 16),
    ("exaone4", dict(sliding_window=16), dict(sliding_window=16, is_sliding=False), None, None),
    ("exaone4", dict(sliding_window=None), dict(sliding_window=None, is_sliding=False), "half",
     None),
    # SmolLM3: every fourth layer without (its use_rope).
    ("smollm3", {}, dict(use_rope=True, sliding_window=None), "half", None),
    ("smollm3", {}, dict(use_rope=False, sliding_window=None), None, None),
    # AFMoE: RoPE and the window on its local layers, neither on its global ones.
    ("afmoe", {}, dict(is_local_attention=True, sliding_window=16), "half", 16),
    ("afmoe", {}, dict(is_local_attention=False, sliding_window=None), None, None),
])
def test_layers_without_rope_are_exported_without_it(tmp_path, model_type, config, layer, rope,
                                                      window):
    """Models that rotate on some layers only, by their own rules (transformers
    5.x; tests/hf/current_transformers.py checks them against the real
    classes): such a layer exports no rope, the others their pairing."""
    gated = model_type == "afmoe"  # its gate_proj, on every layer
    module = _StandIn(_Config(model_type=model_type, rope_theta=1e4, **config), gate=gated)
    for name, value in layer.items():
        setattr(module, name, value)
    exported = export_module(module, str(tmp_path / "m"))
    assert ("output_gate" in exported) == gated
    if rope is None:
        assert "rope" not in exported
    else:
        assert exported["rope"]["interleaved"] == (rope == "interleaved")
    assert exported.get("sliding_window") == window


def test_a_window_that_qwen2_does_not_use_is_not_a_feature(tmp_path):
    from attnserve_client.export import unsupported_features
    module = _StandIn(_Config(sliding_window=4096, use_sliding_window=False))
    assert unsupported_features(module) == []
    # A full-attention layer of a model that mixes both says so itself.
    full = _StandIn(_Config(model_type="gemma2", sliding_window=4096))
    full.sliding_window = None
    assert unsupported_features(full) == []
    sliding = _StandIn(_Config(model_type="gemma2", sliding_window=4096))
    assert "a sliding window of 4096 tokens" in unsupported_features(sliding)[0]


# --- what has no position embeddings inside the module is served as is ---

def test_opt_and_bart_attention_are_served_as_transformers_computes_them(tmp_path):
    import harness
    harness.use_python_client()
    from attnserve_client import AttentionClient
    from transformers import BartConfig, OPTConfig
    from transformers.models.bart.modeling_bart import BartAttention
    from transformers.models.opt.modeling_opt import OPTAttention

    torch.manual_seed(3)
    opt = OPTAttention(OPTConfig(hidden_size=64, num_attention_heads=4, enable_bias=True),
                       is_decoder=True).eval()
    bart = BartAttention(64, 8, is_decoder=False, bias=True).eval()
    for name, module in (("opt", opt), ("bart", bart)):
        config = export_module(module, str(tmp_path / name))
        assert "rope" not in config
    server = harness.ServerProcess("--model-repository", str(tmp_path))
    try:
        x = np.random.default_rng(4).uniform(-1, 1, (2, 11, 64)).astype(np.float32)
        causal = torch.full((11, 11), float("-inf")).triu(1).expand(2, 1, 11, 11).double()
        with AttentionClient(server.target, timeout=60) as c, torch.no_grad():
            for name, module, mask, is_causal in (("opt", opt, causal, True),
                                                 ("bart", bart, None, False)):
                want = module.double()(torch.from_numpy(x).double(),
                                       attention_mask=mask)[0].numpy()
                got = c.attend(x, model=name, causal=is_causal).output
                assert _rel(got, want) < 2e-5, f"{name}: {_rel(got, want)}"
    finally:
        assert server.stop() == 0, server.log()
