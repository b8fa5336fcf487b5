"""Parity of the served `sdpa` model with PyTorch (Debian's torch 1.13, which has
no F.scaled_dot_product_attention): the oracle is softmax(q k^T * scale + mask) v
in float64, masks built in PyTorch, over seeded random shapes, every mask kind,
every dtype, GQA, cross attention, Dv != Dk and both weight layouts.
demo-mha is not compared with nn.MultiheadAttention here: that needs the
model's weights, which the server cannot export yet (a later issue adds it).

Tolerances (|got - want| <= rtol*|want| + atol*max(1, max|v|)), inputs rounded
to the wire dtype before the oracle sees them, so only the server's own
arithmetic is measured:
  fp32 output: rtol = atol = 1e-5     (the project's fp32 contract)
  fp16 output: rtol = atol = 1.5e-3   (fp16 rounds at 2^-11 = 4.9e-4; measured max 4.4e-4)
  bf16 output: rtol = atol = 1e-2     (bf16 rounds at 2^-8 = 3.9e-3; measured max 3.3e-3)
Weights (in [0, 1]): |got - want| <= rtol*|want| + atol with fp32 1e-5 / 1e-6,
fp16 and bf16 the output figures above.
"""

import math

import numpy as np
import pytest
import torch

from attnserve_client import stubs

pb = stubs.attention_pb2

TOL = {"fp32": 1e-5, "fp16": 1.5e-3, "bf16": 1e-2}
WEIGHT_ATOL = {"fp32": 1e-6, "fp16": 1.5e-3, "bf16": 1e-2}
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
WIRE_NAME = {pb.FLOAT32: "fp32", pb.FLOAT16: "fp16", pb.BFLOAT16: "bf16"}

# Mask kinds: the shapes DESIGN.md lists as broadcastable to [B, Hq, Lq, Lk].
MASK_KINDS = [
    "none", "causal", "key_lengths",
    "bool_2d", "bool_b1", "bool_1h", "bool_full",
    "float_2d", "float_b1", "float_1h", "float_full",
    "causal+key_lengths+bool", "causal+float",
]
DTYPES = ["fp32", "fp16", "bf16"]


def to_wire(t, dtype):
    """A torch tensor in `dtype` -> the numpy array the client sends (bf16 as bits)."""
    if dtype == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return t.to(TORCH_DTYPE[dtype]).numpy()


def torch_oracle(q, k, v, *, scale, causal=False, key_lengths=None, mask=None):
    """float64 (output [B,Hq,Lq,Dv], weights [B,Hq,Lq,Lk]); rows with no visible
    key are zeros (DESIGN.md), where torch.softmax would give NaN."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) * scale
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(lq, lk).tril(diagonal=lk - lq).bool()
    if key_lengths is not None:
        allowed &= torch.arange(lk)[None, None, None, :] < torch.tensor(key_lengths)[:, None, None, None]
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed &= mask
        else:
            scores = scores + mask.double()
            allowed &= mask != float("-inf")  # an all -inf row is a fully masked row
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(allowed.any(dim=-1, keepdim=True), p, torch.zeros_like(p))
    return (p @ v).numpy(), p.numpy()


def make_case(seed, mask_kind, dtype):
    g = torch.Generator().manual_seed(seed)
    r = np.random.default_rng(seed)
    b = int(r.integers(1, 4))
    hkv = int(r.choice([1, 2, 3]))
    hq = hkv * int(r.choice([1, 2, 4]))
    lq, lk = int(r.integers(1, 25)), int(r.integers(1, 25))
    dk = int(r.choice([8, 16, 32, 64, 80]))
    dv = dk if r.random() < 0.5 else int(r.choice([8, 24, 64]))
    scale = 0.0 if r.random() < 0.5 else float(r.uniform(0.05, 1.0))
    case = dict(seed=seed, mask_kind=mask_kind, dtype=dtype, shape=(b, hq, hkv, lq, lk, dk, dv), scale=scale,
                causal=False, key_lengths=None, mask=None)
    # Inputs rounded to the wire dtype once; the oracle uses the rounded values.
    q = torch.randn(b, hq, lq, dk, generator=g).to(TORCH_DTYPE[dtype])
    k = torch.randn(b, hkv, lk, dk, generator=g).to(TORCH_DTYPE[dtype])
    v = torch.randn(b, hkv, lk, dv, generator=g).to(TORCH_DTYPE[dtype])
    case.update(q=q, k=k, v=v)

    parts = mask_kind.split("+")
    if "causal" in parts:
        case["causal"] = True
    if "key_lengths" in parts:
        case["key_lengths"] = [int(n) for n in r.integers(0, lk + 1, size=b)]
    kind = next((p for p in parts if p.startswith(("bool", "float"))), None)
    if kind in ("bool", "float"):
        kind = kind + "_full"
    if kind:
        family, layout = kind.split("_")
        shape = {"2d": (lq, lk), "b1": (b, 1, lq, lk), "1h": (1, hq, lq, lk), "full": (b, hq, lq, lk)}[layout]
        if family == "bool":
            case["mask"] = torch.rand(shape, generator=g) < 0.75
        else:
            # Finite values only: how an all -inf row should behave is pinned
            # down by the bool and length masks instead.
            m = torch.randn(shape, generator=g) * 2.0
            # Half the cases send the mask in the inputs' dtype, half in fp32.
            case["mask"] = m.to(TORCH_DTYPE[dtype]) if r.random() < 0.5 else m
    weights = r.choice(["none", "per_head", "averaged"])
    case.update(need_weights=weights != "none", average_weights=weights == "averaged")
    return case


def run_case(client, case, output_dtype=None):
    dtype = case["dtype"]
    mask = case["mask"]
    if mask is not None and mask.dtype != torch.bool:
        mask_wire = to_wire(mask, {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[mask.dtype])
    else:
        mask_wire = None if mask is None else mask.numpy()
    res = client.attend(to_wire(case["q"], dtype), to_wire(case["k"], dtype), to_wire(case["v"], dtype),
                        model="sdpa", causal=case["causal"], key_lengths=case["key_lengths"], attn_mask=mask_wire,
                        scale=case["scale"], need_weights=case["need_weights"],
                        average_weights=case["average_weights"], output_dtype=output_dtype)
    scale = case["scale"] or 1.0 / math.sqrt(case["q"].shape[-1])
    want, want_w = torch_oracle(case["q"], case["k"], case["v"], scale=scale, causal=case["causal"],
                                key_lengths=case["key_lengths"], mask=mask)
    return res, want, want_w


def check(res, want, want_w, case, out_dtype):
    label = {k: case[k] for k in ("seed", "mask_kind", "dtype", "shape", "scale", "key_lengths")}
    out_wire = WIRE_NAME[res.response.output.dtype]
    assert out_wire == out_dtype, (label, out_wire)
    got = res.output.astype(np.float64)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    assert np.isfinite(got).all(), label
    tol = TOL[out_dtype]
    v_scale = max(1.0, float(case["v"].abs().max()))
    err = np.abs(got - want) - tol * np.abs(want)
    assert err.max() <= tol * v_scale, (label, "max abs error", float(np.abs(got - want).max()))
    # Rows with no visible key are exact zeros.
    dead = ~(want_w > 0).any(axis=-1)
    assert (got[dead] == 0).all(), label

    if not case["need_weights"]:
        assert res.weights is None, label
        return
    if case["average_weights"]:
        want_w = want_w.mean(axis=1)
    assert res.weights is not None and res.weights.shape == want_w.shape, (label, getattr(res.weights, "shape", None))
    w_dtype = WIRE_NAME[res.response.weights.dtype]
    w_err = np.abs(res.weights.astype(np.float64) - want_w)
    assert (w_err - TOL[w_dtype] * want_w).max() <= WEIGHT_ATOL[w_dtype], (label, "max weight error", float(w_err.max()))


CASES = [(seed, kind, dtype) for kind in MASK_KINDS for dtype in DTYPES for seed in range(3)]


@pytest.mark.parametrize("seed,mask_kind,dtype", CASES, ids=[f"{k}-{d}-{s}" for s, k, d in CASES])
def test_sdpa_matches_torch(client, seed, mask_kind, dtype):
    case = make_case(1000 * seed + 17 * MASK_KINDS.index(mask_kind) + DTYPES.index(dtype), mask_kind, dtype)
    res, want, want_w = run_case(client, case)
    check(res, want, want_w, case, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seed", range(4))
def test_low_precision_inputs_fp32_output(client, dtype, seed):
    # output_dtype fp32 isolates the engine's arithmetic from the final rounding.
    case = make_case(5000 + seed, "causal+key_lengths+bool", dtype)
    res, want, want_w = run_case(client, case, output_dtype="fp32")
    got = res.output.astype(np.float64)
    assert res.response.output.dtype == pb.FLOAT32
    # No output rounding, but P (and scores) may be held in the input dtype.
    tol = TOL[dtype] / 2
    v_scale = max(1.0, float(case["v"].abs().max()))
    assert (np.abs(got - want) - tol * np.abs(want)).max() <= tol * v_scale


EDGES = ["decode_lq1", "single_key", "lq_gt_lk_causal", "all_lengths_zero", "bool_rows_all_false",
         "float_rows_all_neg_inf", "large_scores"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("edge", EDGES)
def test_edge_cases(client, dtype, edge):
    g = torch.Generator().manual_seed(EDGES.index(edge))
    b, hq, hkv, lq, lk, dk, dv = 2, 4, 2, 6, 9, 32, 32
    causal, key_lengths, mask, scale = False, None, None, 0.0
    if edge == "decode_lq1":
        lq, causal = 1, True
    elif edge == "single_key":
        lk = 1
    elif edge == "lq_gt_lk_causal":
        lq, lk, causal = 12, 5, True  # the first 7 query rows see no key
    elif edge == "all_lengths_zero":
        key_lengths = [0, 0]
    elif edge == "bool_rows_all_false":
        mask = torch.rand(b, 1, lq, lk, generator=g) < 0.6
        mask[:, :, ::2, :] = False
    elif edge == "float_rows_all_neg_inf":
        mask = torch.randn(lq, lk, generator=g)
        mask[::3, :] = float("-inf")
        mask[1::3, ::2] = float("-inf")
    elif edge == "large_scores":
        scale = 4.0  # logits in the hundreds: the row-max subtraction must hold
    q = torch.randn(b, hq, lq, dk, generator=g).to(TORCH_DTYPE[dtype])
    k = torch.randn(b, hkv, lk, dk, generator=g).to(TORCH_DTYPE[dtype])
    v = torch.randn(b, hkv, lk, dv, generator=g).to(TORCH_DTYPE[dtype])
    case = dict(seed=edge, mask_kind=edge, dtype=dtype, shape=(b, hq, hkv, lq, lk, dk, dv), scale=scale,
                causal=causal, key_lengths=key_lengths, mask=mask, q=q, k=k, v=v,
                need_weights=True, average_weights=False)
    res, want, want_w = run_case(client, case)
    check(res, want, want_w, case, dtype)



LARGE = [  # (b, hq, hkv, lq, lk, dk, dv, mask kind): past any kernel's tile sizes
    (1, 8, 2, 257, 513, 128, 64, "causal+key_lengths+bool"),
    (2, 4, 4, 128, 128, 64, 64, "causal"),
    (1, 16, 1, 65, 1031, 64, 128, "float_b1"),
    (3, 2, 2, 1, 700, 96, 96, "key_lengths"),
    (1, 4, 2, 300, 40, 32, 16, "causal+float"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LARGE, ids=[f"{s[3]}x{s[4]}-{s[7]}" for s in LARGE])
def test_larger_shapes(client, shape, dtype):
    b, hq, hkv, lq, lk, dk, dv, kind = shape
    g = torch.Generator().manual_seed(lq * 7919 + lk)
    r = np.random.default_rng(lq * 7919 + lk)
    parts = kind.split("+")
    mask = None
    if "bool" in parts:
        mask = torch.rand(b, hq, lq, lk, generator=g) < 0.9
    elif any(p.startswith("float") for p in parts):
        mask = torch.randn((b, 1, lq, lk) if "float_b1" in parts else (lq, lk), generator=g)
    case = dict(seed=shape, mask_kind=kind, dtype=dtype, shape=shape, scale=0.0, causal="causal" in parts,
                key_lengths=[int(n) for n in r.integers(lk // 2, lk + 1, size=b)] if "key_lengths" in parts else None,
                mask=mask, need_weights=True, average_weights=b > 1,
                q=torch.randn(b, hq, lq, dk, generator=g).to(TORCH_DTYPE[dtype]),
                k=torch.randn(b, hkv, lk, dk, generator=g).to(TORCH_DTYPE[dtype]),
                v=torch.randn(b, hkv, lk, dv, generator=g).to(TORCH_DTYPE[dtype]))
    res, want, want_w = run_case(client, case)
    check(res, want, want_w, case, dtype)


def torch_modern_oracle(q, k, v, *, scale, window, softcap, sinks):
    """float64 causal attention with a sliding window, softcapping and sinks
    as Hugging Face's eager paths compute them (Mistral's window mask,
    Gemma 2's tanh cap before the mask, gpt-oss's sink column appended to the
    scores and dropped after the softmax)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    allowed = (j <= i) & (j > i - window if window else True)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = torch.tensor(sinks, dtype=torch.float64).reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return (p @ v).numpy(), p.numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", ["window", "softcap", "sinks", "all"])
def test_per_request_window_softcap_and_sinks(client, dtype, options):
    """attnserve.v1's window, softcap and sinks on the bare sdpa model, with
    weights (which sum to less than 1 with a sink), prefill and decode rows."""
    g = torch.Generator().manual_seed(len(options) + DTYPES.index(dtype))
    for lq, lk in ((7, 300), (1, 700)):
        q = (torch.randn(2, 4, lq, 32, generator=g) * 2).to(TORCH_DTYPE[dtype])
        k = torch.randn(2, 2, lk, 32, generator=g).to(TORCH_DTYPE[dtype])
        v = torch.randn(2, 2, lk, 24, generator=g).to(TORCH_DTYPE[dtype])
        window = 37 if options in ("window", "all") else 0
        softcap = 1.5 if options in ("softcap", "all") else 0.0
        sinks = ([4.0, -1.0, 8.0, 0.0] if options in ("sinks", "all") else None)
        res = client.attend(to_wire(q, dtype), to_wire(k, dtype), to_wire(v, dtype), model="sdpa",
                            causal=True, need_weights=True, window=window, softcap=softcap,
                            sinks=sinks)
        want, want_w = torch_modern_oracle(q, k, v, scale=32 ** -0.5, window=window,
                                           softcap=softcap, sinks=sinks)
        tol = TOL[dtype]
        got = res.output.astype(np.float64)
        assert (np.abs(got - want) - tol * np.abs(want)).max() <= tol, (lq, lk)
        got_w = res.weights.astype(np.float64)
        assert (np.abs(got_w - want_w) - tol * np.abs(want_w)).max() <= WEIGHT_ATOL[dtype]
        if window:
            assert np.all(got_w[..., : lk - lq - window + 1] == 0)
        if sinks is not None:
            assert got_w.sum(-1).min() < 0.99  # the sink took its share
