#!/usr/bin/python3
"""attnserve's multi-head latent attention layer against transformers'.

One run, same machine: bench/engine_bench's LatentLayer benchmarks (the cpu
engine, DeepSeek's head shapes: nope 128 + rope 64, values 128, a key/value
latent of 512, interleaved RoPE, causal self-attention) next to transformers'
DeepseekV2Attention of the same dims in PyTorch 2 (attn_implementation
"sdpa": its fused scaled_dot_product_attention), fp32 and bf16, at each
thread count. Prints a markdown table of medians and ratios
(docs/PERFORMANCE.md records it).

  /usr/bin/python3 bench/latent_bench.py --engine-bench build/bench/engine_bench \\
      --torch2-python build/torch2-venv/bin/python [--threads 1,2] [--repetitions 5]

build/torch2-venv is the venv of tests/hf/current_transformers.sh (torch 2 and
transformers 5). The same file is the PyTorch worker (--torch-worker), run in
a subprocess per thread count so that the thread count is set before torch
loads.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name: batch, length, embed, heads, q_lora_rank (engine_bench's kLatentShapes)
SHAPES = {
    "V2Lite_B1_L512_E2048_H16": (1, 512, 2048, 16, 0),
    "V2Lite_B8_L128_E2048_H16": (8, 128, 2048, 16, 0),
    "QLora_B1_L512_E2048_H16": (1, 512, 2048, 16, 768),
}


def torch_worker(threads, repetitions):
    import torch
    torch.set_num_threads(threads)
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
    from transformers import DeepseekV2Config
    results = {}
    for name, (batch, length, embed, heads, q_lora) in SHAPES.items():
        config = DeepseekV2Config(hidden_size=embed, num_attention_heads=heads,
                                  num_key_value_heads=heads, q_lora_rank=q_lora or None,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, num_hidden_layers=1, intermediate_size=128,
                                  moe_intermediate_size=64, n_routed_experts=2,
                                  num_experts_per_tok=1, attention_bias=False)
        config._attn_implementation = "sdpa"
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            attn = m.DeepseekV2Attention(config, layer_idx=0).to(dtype).eval()
            rotary = m.DeepseekV2RotaryEmbedding(config)
            x = torch.randn(batch, length, embed, dtype=dtype)
            positions = torch.arange(length).unsqueeze(0).expand(batch, -1)
            with torch.no_grad():
                emb = rotary(x, positions)

                def run():
                    return attn(x, attention_mask=None, position_embeddings=emb)[0]
                run()
                times = []
                for _ in range(repetitions):
                    start = time.perf_counter()
                    run()
                    times.append((time.perf_counter() - start) * 1e3)
            results[f"{name}/{dtype_name}"] = statistics.median(times)
    print(json.dumps(results))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-bench", default="build/bench/engine_bench")
    p.add_argument("--torch2-python", required=False)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--torch-worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torch_worker:
        torch_worker(args.torch_worker, args.repetitions)
        return
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        out = subprocess.run(
            [args.engine_bench, f"--benchmark_filter=^LatentLayer/.*/threads:{threads}/",
             f"--benchmark_repetitions={args.repetitions}", "--benchmark_format=json",
             "--benchmark_report_aggregates_only=true"],
            check=True, capture_output=True, text=True).stdout
        ours = {}
        for b in json.loads(out)["benchmarks"]:
            if b.get("aggregate_name") == "median":
                key = b["run_name"].split("/", 1)[1].rsplit("/threads", 1)[0]
                ours[key] = b["real_time"]
        theirs = {}
        if args.torch2_python:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            out = subprocess.run([args.torch2_python, os.path.abspath(__file__), "--torch-worker",
                                  str(threads), "--repetitions", str(args.repetitions)],
                                 check=True, capture_output=True, text=True, env=env).stdout
            theirs = json.loads(out.strip().splitlines()[-1])
        for key in sorted(ours):
            peer = theirs.get(key)
            rows.append((key, threads, ours[key], peer,
                         f"{peer / ours[key]:.2f}x" if peer else "-"))
    print("| shape / dtype | thr | attnserve ms | transformers DeepseekV2Attention (sdpa) ms |"
          " speedup |")
    print("|---|---|---|---|---|")
    for key, threads, ms, peer, ratio in rows:
        print(f"| {key} | {threads} | {ms:.3g} | {peer:.3g} | {ratio} |" if peer else
              f"| {key} | {threads} | {ms:.3g} | - | - |")


if __name__ == "__main__":
    sys.exit(main())
