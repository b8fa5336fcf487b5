"""Attention layers as other frameworks write them, for test_checkpoints.py:
PyTorch modules in the Hugging Face and GPT-NeoX styles, and NumPy float64
references for the layouts whose framework is not installable here (Keras) or
where an independent oracle is wanted (HF grouped-query attention)."""

import math
import os
import sys

import numpy as np
import torch
from torch import nn

TOOLS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
import export_torch  # noqa: E402,F401  (re-exported for the tests)


class HFStyleAttention(nn.Module):
    """A Llama/Qwen-like attention block without rotary embeddings: separate
    q/k/v/o projections and grouped-query heads (num_key_value_heads)."""

    def __init__(self, hidden, num_heads, num_kv_heads, head_dim, *, qkv_bias, o_bias,
                 out_dim=None, is_causal=False, scaling=None):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_kv_heads
        self.head_dim = head_dim
        self.is_causal = is_causal
        self.scaling = scaling if scaling is not None else head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_dim or hidden, bias=o_bias)

    def forward(self, hidden_states, attention_mask=None):
        """attention_mask: HF's additive float mask [B, 1, Lq, Lk] (0 = attend,
        a large negative = masked), or None."""
        b, l, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, l, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, l, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, l, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        groups = self.num_heads // self.num_key_value_heads
        k = k.repeat_interleave(groups, dim=1)  # HF repeat_kv
        v = v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) * self.scaling
        if self.is_causal:
            causal = torch.ones(l, l, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attention_mask is not None:
            scores = scores + attention_mask
        p = scores.softmax(dim=-1)
        out = (p @ v).transpose(1, 2).reshape(b, l, self.num_heads * self.head_dim)
        return self.o_proj(out)


class NeoXStyleAttention(nn.Module):
    """GPT-NeoX/Bloom style: one `query_key_value` linear whose output is
    reshaped to [B, L, H, 3*head_dim] and split (per-head layout), then `dense`."""

    def __init__(self, hidden, num_heads, bias=True):
        super().__init__()
        self.num_attention_heads = num_heads
        self.head_size = hidden // num_heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.dense = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x):
        b, l, _ = x.shape
        qkv = self.query_key_value(x).view(b, l, self.num_attention_heads, 3 * self.head_size)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_size, dim=-1))
        p = (q @ k.transpose(-1, -2) / math.sqrt(self.head_size)).softmax(dim=-1)
        return self.dense((p @ v).transpose(1, 2).reshape(b, l, -1))


class TinyDecoder(nn.Module):
    """A many-layer model whose checkpoint holds several attention layers; one
    is served through tensor_prefix."""

    def __init__(self, hidden=32, layers=3):
        super().__init__()
        self.embed = nn.Linear(8, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"self_attn": HFStyleAttention(hidden, 4, 2, hidden // 4, qkv_bias=True,
                                                         o_bias=False),
                           "mlp": nn.Linear(hidden, hidden)})
            for _ in range(layers))


def build_tiny_decoder():
    """Factory for export_torch.py --factory."""
    torch.manual_seed(11)
    return TinyDecoder()


# ---------------------------------------------------------------------------
# NumPy float64 references

def softmax_rows(scores, allowed=None):
    """Row softmax; rows with nothing allowed give zeros (attnserve's rule)."""
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(scores - m)
    s = p.sum(axis=-1, keepdims=True)
    return np.where(s > 0, p / np.where(s > 0, s, 1.0), 0.0)


def gqa_reference(xq, xk, xv, w, *, num_heads, num_kv_heads, head_dim, scale=None, causal=False,
                  allowed=None, additive=None):
    """Projection attention with grouped-query heads, in float64.

    w: {"wq","wk","wv","wo"} in PyTorch Linear layout [out, in], optional
    "bq","bk","bv","bo". allowed: bool broadcastable to [B, H, Lq, Lk] (True =
    may attend); additive: float mask added to the scaled scores.
    Returns (output [B, Lq, out], weights [B, H, Lq, Lk])."""
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    xq, xk, xv = f(xq), f(xk), f(xv)

    def proj(x, wname, bname):
        y = x @ f(w[wname]).T
        return y + f(w[bname]) if w.get(bname) is not None else y

    b, lq, lk = xq.shape[0], xq.shape[1], xk.shape[1]
    q = proj(xq, "wq", "bq").reshape(b, lq, num_heads, head_dim).transpose(0, 2, 1, 3)
    k = proj(xk, "wk", "bk").reshape(b, lk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = proj(xv, "wv", "bv").reshape(b, lk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    groups = num_heads // num_kv_heads
    k = np.repeat(k, groups, axis=1)
    v = np.repeat(v, groups, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * (scale if scale else 1.0 / math.sqrt(head_dim))
    ok = np.ones(scores.shape, dtype=bool)
    if causal:
        ok &= np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq)
    if allowed is not None:
        ok &= np.asarray(allowed, dtype=bool)
    if additive is not None:
        scores = scores + f(additive)
    p = softmax_rows(scores, ok)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(b, lq, num_heads * head_dim)
    return proj(out, "wo", "bo"), p


def keras_mha_reference(query, value, key, kw, *, num_heads, key_dim, attention_mask=None):
    """keras.layers.MultiHeadAttention(num_heads, key_dim) in float64, from its
    EinsumDense kernels: query/kernel [in, H, hd], query/bias [H, hd], ...,
    attention_output/kernel [H, hd, out], attention_output/bias [out].
    attention_mask: bool [B, Lq, Lk], True = attend (Keras' convention)."""
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    q = np.einsum("bld,dhk->blhk", f(query), f(kw["query/kernel"])) + f(kw["query/bias"])
    k = np.einsum("bld,dhk->blhk", f(key), f(kw["key/kernel"])) + f(kw["key/bias"])
    v = np.einsum("bld,dhk->blhk", f(value), f(kw["value/kernel"])) + f(kw["value/bias"])
    q = q * (1.0 / math.sqrt(key_dim))  # Keras scales the query before the dot product
    scores = np.einsum("bqhk,bshk->bhqs", q, k)
    allowed = None if attention_mask is None else np.asarray(attention_mask, bool)[:, None, :, :]
    p = softmax_rows(scores, allowed)
    ctx = np.einsum("bhqs,bshk->bqhk", p, v)
    out = np.einsum("bqhk,hkd->bqd", ctx, f(kw["attention_output/kernel"]))
    return out + f(kw["attention_output/bias"]), p
