#!/usr/bin/python3
"""Decode through a session of a multi-head latent attention layer, against
transformers' cached decode.

One run, same machine, DeepSeek-V2-Lite's attention dims (16 heads, nope 128 +
rope 64, values 128, a key/value latent of 512, hidden 2048), fp32: after a
prefill of C tokens, the median time of one decode step (one new token).

- attnserve: the server's cpu engine, a session (its cache holds the
  compressed latent; each step attends with the queries absorbed into the
  latent, docs/API.md), timed at the client around each Attend call over
  loopback gRPC (so it includes the RPC).
- transformers: DeepseekV2Attention in PyTorch 2 (sdpa) with a DynamicCache,
  which caches the compressed latent too and expands every cached token
  through kv_b_proj at each step; timed in process around the module call.

  build/hf-venv/bin/python bench/latent_decode_bench.py \\
      --server build/server/attnserve --torch2-python build/torch2-venv/bin/python \\
      [--contexts 1024,4096] [--threads 1,2] [--steps 16]

Prints a markdown table (docs/PERFORMANCE.md records it). build/hf-venv has
the client's grpcio and numpy; build/torch2-venv is the venv of
tests/hf/current_transformers.sh. The same file is the PyTorch worker
(--torch-worker), run in a subprocess per thread count.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EMBED, HEADS, NOPE, ROPE, DV, RANK = 2048, 16, 128, 64, 128, 512


def torch_worker(threads, contexts, steps):
    import torch
    torch.set_num_threads(threads)
    from transformers import DeepseekV2Config, DynamicCache
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
    config = DeepseekV2Config(hidden_size=EMBED, num_attention_heads=HEADS,
                              num_key_value_heads=HEADS, q_lora_rank=None, kv_lora_rank=RANK,
                              qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV,
                              num_hidden_layers=1, intermediate_size=128,
                              moe_intermediate_size=64, n_routed_experts=2,
                              num_experts_per_tok=1, attention_bias=False)
    config._attn_implementation = "sdpa"
    attn = m.DeepseekV2Attention(config, layer_idx=0).eval()
    rotary = m.DeepseekV2RotaryEmbedding(config)
    results = {}
    with torch.no_grad():
        for context in contexts:
            cache = DynamicCache(config=config)
            x = torch.randn(1, context + steps, EMBED)
            positions = torch.arange(context + steps).unsqueeze(0)
            emb = rotary(x, positions)
            attn(x[:, :context], attention_mask=None, cache=cache,
                 position_embeddings=emb[:, :context])
            times = []
            for t in range(context, context + steps):
                start = time.perf_counter()
                attn(x[:, t:t + 1], attention_mask=None, cache=cache,
                     position_embeddings=emb[:, t:t + 1])
                times.append((time.perf_counter() - start) * 1e3)
            results[str(context)] = statistics.median(times)
    print(json.dumps(results))


def write_model(folder):
    import numpy as np
    sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
    from attnserve_client.export import write_model_folder
    rng = np.random.default_rng(3)

    def weight(out, inp):
        return (rng.uniform(-1, 1, (out, inp)) / np.sqrt(inp)).astype(np.float32)
    tensors = {"q_proj.weight": weight(HEADS * (NOPE + ROPE), EMBED),
               "kv_a_proj_with_mqa.weight": weight(RANK + ROPE, EMBED),
               "kv_a_layernorm.weight": rng.uniform(0.5, 1.5, RANK).astype(np.float32),
               "kv_b_proj.weight": weight(HEADS * (NOPE + DV), RANK),
               "o_proj.weight": weight(EMBED, HEADS * DV)}
    config = dict(kind="mha", embed_dim=EMBED, num_heads=HEADS, num_kv_heads=HEADS,
                  head_dim=NOPE + ROPE, weight_layout="SEPARATE_QKV", causal=True,
                  rope=dict(type="default", theta=10000.0, rotary_dim=ROPE, interleaved=True),
                  latent_attention=dict(q_lora_rank=0, kv_lora_rank=RANK,
                                        qk_rope_head_dim=ROPE, v_head_dim=DV))
    write_model_folder(folder, config, tensors)


def attnserve_times(server, threads, contexts, steps):
    import numpy as np
    sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
    from attnserve_client import AttentionClient
    repo = tempfile.mkdtemp(prefix="attnserve-latent-decode-")
    write_model(os.path.join(repo, "v2lite"))
    proc = subprocess.Popen([server, "--address", "127.0.0.1:0", "--metrics-address",
                             "127.0.0.1:0", "--backend", "cpu", f"--threads={threads}",
                             "--model-repository", repo, "--kv-cache-bytes", str(1 << 30)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = None
    for line in proc.stdout:
        found = re.search(r"listening on (\S+)", line)
        if found:
            address = found.group(1)
            break
    results = {}
    try:
        client = AttentionClient(address)
        rng = np.random.default_rng(4)
        for context in contexts:
            x = rng.uniform(-1, 1, (1, context + steps, EMBED)).astype(np.float32)
            with client.open_session("v2lite") as session:
                for start in range(0, context, 512):
                    session.attend(x[:, start:min(start + 512, context)], causal=True)
                times = []
                for t in range(context, context + steps):
                    begin = time.perf_counter()
                    session.attend(x[:, t:t + 1], causal=True)
                    times.append((time.perf_counter() - begin) * 1e3)
            results[str(context)] = statistics.median(times)
    finally:
        proc.terminate()
        proc.wait(30)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=os.path.join(HERE, "..", "build", "server", "attnserve"))
    p.add_argument("--torch2-python", required=True)
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--torch-worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.torch_worker:
        torch_worker(args.torch_worker, contexts, args.steps)
        return 0
    print("| context | thr | attnserve session step ms | transformers DynamicCache step ms |"
          " speedup |")
    print("|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        ours = attnserve_times(args.server, threads, contexts, args.steps)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        out = subprocess.run([args.torch2_python, os.path.abspath(__file__), "--torch-worker",
                              str(threads), "--contexts", args.contexts, "--steps",
                              str(args.steps), "--torch2-python", args.torch2_python],
                             check=True, capture_output=True, text=True, env=env).stdout
        theirs = json.loads(out.strip().splitlines()[-1])
        for context in contexts:
            a, t = ours[str(context)], theirs[str(context)]
            print(f"| {context} | {threads} | {a:.3g} | {t:.3g} | {t / a:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
