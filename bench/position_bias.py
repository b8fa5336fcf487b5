#!/usr/bin/python3
"""A position bias's cost on the cpu attention core, and PyTorch's on the same shapes.

--bias alibi: ALiBi (BLOOM, MPT), causal. attnserve: bench/engine_bench's CoreCausal (no
bias) and CoreCausalAlibi (BLOOM-style slopes 2^(-8h/H), the bias computed inside the kernel).
PyTorch: one float mask [H, Lq, Lk] of slope_h * (j - i) with the causal -inf folded in.

--bias relative: a learned relative position bias (T5, MPNet), a table of 128 keys each way
(values in [-1, 1]), causal (a decoder's) and not (an encoder's). attnserve: Core /
CoreRelative and CoreCausal / CoreCausalRelative. PyTorch: the float mask [H, Lq, Lk] of
table[h, clamp(j - i, -128, 128)] that a T5 or MPNet layer adds (and the causal -inf).

--bias embeddings: relative position embeddings (DeBERTa v3's disentangled attention: each
query against a key vector per distance, each key against a query vector per distance), 512
positions each way, not causal (an encoder's), the encoder shapes. attnserve: Core /
CoreEmbedded. PyTorch: what DeBERTa v3 computes per call, its best form: Q and K against the
2 x 256 bucket vectors (two batched matmuls), each score's bucket gathered (the bucket index
built once, outside the timing, as DeBERTa's encoder builds it once for its layers), added
as the float mask of scaled_dot_product_attention.

PyTorch 2 (the peer, in a virtualenv): scaled_dot_product_attention without a mask (is_causal
when causal), and with the bias as its mask (built once, outside the timing; SDPA takes no
is_causal with a mask). Same threads, same run. Prints a markdown table (docs/PERFORMANCE.md).

  /usr/bin/python3 bench/position_bias.py --bias relative --engine-bench build/bench/engine_bench \\
      --torch2-python build/torch2-venv/bin/python [--threads 1,2] [--min-time 0.3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# engine_bench shape name: (batch, q_len, kv_len, heads, head_dim)
SHAPES = {
    "B8_L512_E768_H12": (8, 512, 512, 12, 64),
    "B1_L2048_E1024_H16": (1, 2048, 2048, 16, 64),
    "decode_B16_Lk1024_H16_D64": (16, 1, 1024, 16, 64),
}
DISTANCE = 128  # the relative bias's reach, T5's and MPNet's max_distance
# bias: [(causal, engine_bench's plain benchmark, its biased one)]
RUNS = {"alibi": [(True, "CoreCausal", "CoreCausalAlibi")],
        "relative": [(False, "Core", "CoreRelative"), (True, "CoreCausal", "CoreCausalRelative")],
        "embeddings": [(False, "Core", "CoreEmbedded")]}
# The shapes of each mode (DeBERTa is an encoder: no decode).
MODE_SHAPES = {"embeddings": ["B8_L512_E768_H12", "B1_L2048_E1024_H16"]}
SPAN = 256  # DeBERTa v3's position_buckets: 2 x 256 bucket vectors


def shapes(kind):
    return {n: s for n, s in SHAPES.items() if n in MODE_SHAPES.get(kind, SHAPES)}


def deberta_buckets(torch, lq, lk):
    """DeBERTa v3's bucket of i - j (make_log_bucket_position, 256 buckets up
    to 512 positions), as the row of its 2 x 256 vectors: [Lq, Lk]."""
    rel = (torch.arange(lq)[:, None] + lk - lq) - torch.arange(lk)[None, :]
    mid, top = SPAN // 2, 512
    absolute = rel.abs().clamp(min=mid).float()
    log_pos = torch.ceil(torch.log(absolute / mid) / torch.log(torch.tensor((top - 1) / mid)) *
                         (mid - 1)) + mid
    bucket = torch.where(rel.abs() <= mid, rel.float(), log_pos * torch.sign(rel.float()))
    return (bucket.long() + SPAN).clamp(0, 2 * SPAN - 1)


def torch_bias(torch, kind, lq, lk, h, causal):
    """The float mask [H, Lq, Lk] a PyTorch user passes for the bias."""
    rel = torch.arange(lk)[None, :] - (torch.arange(lq)[:, None] + lk - lq)
    if kind == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
        bias = slopes[:, None, None] * rel[None].float()
    else:
        g = torch.Generator().manual_seed(7)
        table = torch.rand(h, 2 * DISTANCE + 1, generator=g) * 2 - 1
        bias = table[:, rel.clamp(-DISTANCE, DISTANCE) + DISTANCE]
    return bias.masked_fill(rel[None] > 0, float("-inf")) if causal else bias


def torch_worker(args):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    out = {}
    for name, (b, lq, lk, h, d) in shapes(args.bias).items():
        for dn, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            g = torch.Generator().manual_seed(1)
            q = (torch.rand(b, h, lq, d, generator=g) * 2 - 1).to(dtype)
            k = (torch.rand(b, h, lk, d, generator=g) * 2 - 1).to(dtype)
            v = (torch.rand(b, h, lk, d, generator=g) * 2 - 1).to(dtype)
            for causal, _, _ in RUNS[args.bias]:
                is_causal = causal and lq > 1  # a decode row sees every key
                if args.bias == "embeddings":
                    pk = (torch.rand(h, 2 * SPAN, d, generator=g) * 2 - 1).to(dtype)
                    pq = (torch.rand(h, 2 * SPAN, d, generator=g) * 2 - 1).to(dtype)
                    at = deberta_buckets(torch, lq, lk)
                    c2p_at, p2c_at = at.expand(b, h, lq, lk), at.t().expand(b, h, lk, lq)

                    def biased():
                        c2p = torch.gather(q @ pk.transpose(-1, -2), -1, c2p_at)
                        p2c = torch.gather(k @ pq.transpose(-1, -2), -1, p2c_at)
                        mask = (c2p + p2c.transpose(-1, -2)) * (1.0 / (3 * d) ** 0.5)
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                              scale=1.0 / (3 * d) ** 0.5)
                else:
                    bias = torch_bias(torch, args.bias, lq, lk, h, causal).to(dtype)

                    def biased():
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
                for kind, fn in (("plain", lambda: F.scaled_dot_product_attention(
                                     q, k, v, is_causal=is_causal)),
                                 ("biased", biased)):
                    with torch.no_grad():
                        fn()
                        times = []
                        while len(times) < 3 or (sum(times) < args.min_time and len(times) < 200):
                            t0 = time.perf_counter()
                            fn()
                            times.append(time.perf_counter() - t0)
                    out[f"{name}/{dn}/{causal}/{kind}"] = statistics.median(times) * 1e3
    json.dump({"torch": torch.__version__, "ms": out}, sys.stdout)


def engine(args, threads):
    names = "|".join(shapes(args.bias))
    benches = "|".join(b for run in RUNS[args.bias] for b in run[1:])
    flt = f"^({benches})/({names})/(fp32|bf16)/threads:{threads}/"
    r = subprocess.run([args.engine_bench, f"--benchmark_filter={flt}",
                        f"--benchmark_min_time={args.min_time}", "--benchmark_format=json"],
                       check=True, capture_output=True, text=True)
    out = {}
    for bm in json.loads(r.stdout)["benchmarks"]:
        bench, shape, dn, _ = bm["name"].split("/", 3)
        for causal, plain, biased in RUNS[args.bias]:
            if bench in (plain, biased):
                kind = "plain" if bench == plain else "biased"
                out[f"{shape}/{dn}/{causal}/{kind}"] = bm["real_time"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--bias", choices=sorted(RUNS), default="relative")
    p.add_argument("--engine-bench", default="build/bench/engine_bench")
    p.add_argument("--torch2-python", required=False)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--torch-worker", action="store_true")
    args = p.parse_args(argv)
    if args.torch_worker:
        args.threads = int(args.threads)
        return torch_worker(args)
    what = {"alibi": "ALiBi", "relative": "relative bias",
            "embeddings": "relative embeddings"}[args.bias]
    causal_column = args.bias == "relative"  # ALiBi's runs are causal, DeBERTa's not
    print(f"| shape | dtype | thr |{' causal |' if causal_column else ''} attnserve plain | "
          f"attnserve {what} | cost | torch plain | torch {what} (mask) | cost | "
          f"attnserve vs torch, {what} |")
    print("|---|---|---|" + ("---|" if causal_column else "") + "---|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        ours = engine(args, threads)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        r = subprocess.run([args.torch2_python or sys.executable, os.path.abspath(__file__),
                            "--torch-worker", "--bias", args.bias, "--threads", str(threads),
                            "--min-time", str(args.min_time)],
                           check=True, capture_output=True, text=True, env=env)
        theirs = json.loads(r.stdout)["ms"]
        for shape in shapes(args.bias):
            for dn in ("fp32", "bf16"):
                for causal, _, _ in RUNS[args.bias]:
                    key = f"{shape}/{dn}/{causal}"
                    a, b = ours[f"{key}/plain"], ours[f"{key}/biased"]
                    c, d = theirs[f"{key}/plain"], theirs[f"{key}/biased"]
                    row = f"| {shape} | {dn} | {threads} |"
                    if causal_column:
                        row += f" {'yes' if causal else 'no'} |"
                    print(f"{row} {a:.3g} | {b:.3g} | {b / a:.2f}x | {c:.3g} | {d:.3g} | "
                          f"{d / c:.2f}x | {d / b:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
