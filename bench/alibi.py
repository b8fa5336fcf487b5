#!/usr/bin/python3
"""ALiBi's cost on the cpu attention core, and PyTorch's on the same shapes.

attnserve: bench/engine_bench's CoreCausal (causal, no bias) and CoreCausalAlibi
(causal, BLOOM-style slopes 2^(-8h/H), the bias computed inside the kernel).
PyTorch 2 (the peer, in a virtualenv): scaled_dot_product_attention with
is_causal=True, and with ALiBi as PyTorch users serve it, one float mask
[H, Lq, Lk] of slope_h * (j - i) with the causal -inf folded in (built once,
outside the timing; SDPA takes no is_causal with a mask). Same threads, same
run. Prints a markdown table (docs/PERFORMANCE.md).

  /usr/bin/python3 bench/alibi.py --engine-bench build/bench/engine_bench \\
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


def torch_worker(args):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    out = {}
    for name, (b, lq, lk, h, d) in SHAPES.items():
        for dn, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            g = torch.Generator().manual_seed(1)
            q = (torch.rand(b, h, lq, d, generator=g) * 2 - 1).to(dtype)
            k = (torch.rand(b, h, lk, d, generator=g) * 2 - 1).to(dtype)
            v = (torch.rand(b, h, lk, d, generator=g) * 2 - 1).to(dtype)
            slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
            rel = torch.arange(lk)[None, :] - (torch.arange(lq)[:, None] + lk - lq)
            bias = slopes[:, None, None] * rel[None].float()
            bias = bias.masked_fill(rel[None] > 0, float("-inf")).to(dtype)
            causal = lq > 1  # a decode row sees every key: no causal mask to apply
            for kind, fn in (("plain", lambda: F.scaled_dot_product_attention(
                                 q, k, v, is_causal=causal)),
                             ("alibi", lambda: F.scaled_dot_product_attention(
                                 q, k, v, attn_mask=bias))):
                with torch.no_grad():
                    fn()
                    times = []
                    while len(times) < 3 or (sum(times) < args.min_time and len(times) < 200):
                        t0 = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - t0)
                out[f"{name}/{dn}/{kind}"] = statistics.median(times) * 1e3
    json.dump({"torch": torch.__version__, "ms": out}, sys.stdout)


def engine(args, threads):
    names = "|".join(SHAPES)
    flt = f"^CoreCausal(Alibi)?/({names})/(fp32|bf16)/threads:{threads}/"
    r = subprocess.run([args.engine_bench, f"--benchmark_filter={flt}",
                        f"--benchmark_min_time={args.min_time}", "--benchmark_format=json"],
                       check=True, capture_output=True, text=True)
    out = {}
    for bm in json.loads(r.stdout)["benchmarks"]:
        kind, shape, dn, _ = bm["name"].split("/", 3)
        out[f"{shape}/{dn}/{'alibi' if kind.endswith('Alibi') else 'plain'}"] = bm["real_time"]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine-bench", default="build/bench/engine_bench")
    p.add_argument("--torch2-python", required=False)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--torch-worker", action="store_true")
    args = p.parse_args()
    if args.torch_worker:
        args.threads = int(args.threads)
        return torch_worker(args)
    print("| shape | dtype | thr | attnserve causal | attnserve ALiBi | ALiBi cost | torch causal "
          "| torch ALiBi (mask) | ALiBi cost | attnserve vs torch, ALiBi |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        ours = engine(args, threads)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        r = subprocess.run([args.torch2_python or sys.executable, os.path.abspath(__file__),
                            "--torch-worker", "--threads", str(threads),
                            "--min-time", str(args.min_time)],
                           check=True, capture_output=True, text=True, env=env)
        theirs = json.loads(r.stdout)["ms"]
        for shape in SHAPES:
            for dn in ("fp32", "bf16"):
                a, b = ours[f"{shape}/{dn}/plain"], ours[f"{shape}/{dn}/alibi"]
                c, d = theirs[f"{shape}/{dn}/plain"], theirs[f"{shape}/{dn}/alibi"]
                print(f"| {shape} | {dn} | {threads} | {a:.3g} | {b:.3g} | {b / a:.2f}x | "
                      f"{c:.3g} | {d:.3g} | {d / c:.2f}x | {d / b:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
