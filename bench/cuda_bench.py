#!/usr/bin/env python3
"""The CUDA backend's kernels against PyTorch on the same GPU, in one run.

Runs attnserve_cuda_bench (engine/cuda/cuda_bench.cc: our fused attention
kernel, our cuBLASLt projections, plain cuBLAS GEMMs and a large square GEMM
as the ceiling), then times torch.nn.functional.scaled_dot_product_attention
on the same attention shapes, and prints one Markdown table per part, ready
for docs/PERFORMANCE.md.

  python3 bench/cuda_bench.py [--bench build/engine/cuda/attnserve_cuda_bench] [--quick]

Needs a GPU, the benchmark binary (built with -DATTNSERVE_BUILD_BENCH=ON and
CUDA) and a CUDA build of PyTorch (without one the SDPA column says so).
"""
import argparse
import json
import os
import subprocess
import sys


def run_ours(binary, quick):
    cmd = [binary] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def torch_sdpa_tflops(row, iters=20):
    """TFLOP/s of PyTorch SDPA on the shape of one of our attention rows."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, "no torch"
    if not torch.cuda.is_available():
        return None, "torch without CUDA"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[row["dtype"]]
    b, h, l, d = row["batch"], row["heads"], row["seq"], row["head_dim"]
    q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=dtype) for _ in range(3))
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, is_causal=row["causal"])
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        F.scaled_dot_product_attention(q, k, v, is_causal=row["causal"])
    stop.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(stop) / iters
    flops = 4.0 * b * h * l * l * d * (0.5 if row["causal"] else 1.0)
    backend = "flash" if torch.backends.cuda.flash_sdp_enabled() else "default"
    return flops / (ms * 1e-3) / 1e12, f"torch {torch.__version__} ({backend})"


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default=os.path.join(root, "build", "engine", "cuda",
                                                        "attnserve_cuda_bench"))
    parser.add_argument("--quick", action="store_true", help="one sequence length only")
    args = parser.parse_args()

    rows = run_ours(args.bench, args.quick)
    device = next((r for r in rows if r["kind"] == "device"), {"name": "?", "sm": "?"})
    print(f"Device: {device['name']} (sm_{device['sm']}); command: "
          f"python3 bench/cuda_bench.py --bench {args.bench}{' --quick' if args.quick else ''}\n")

    print("| dtype | B | H | L | D | causal | attnserve kernel | attnserve TFLOP/s "
          "| torch SDPA TFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    torch_note = ""
    for r in (r for r in rows if r["kind"] == "attention"):
        theirs, torch_note = torch_sdpa_tflops(r)
        theirs_s = f"{theirs:.1f}" if theirs else "n/a"
        ratio = f"{r['tflops'] / theirs:.2f}" if theirs else "n/a"
        print(f"| {r['dtype']} | {r['batch']} | {r['heads']} | {r['seq']} | {r['head_dim']} "
              f"| {r['causal']} | {r['kernel']} | {r['tflops']:.1f} | {theirs_s} | {ratio} |")
    print(f"\nPyTorch: {torch_note}\n")

    ceilings = {r["dtype"]: r["tflops"] for r in rows if r["kind"] == "gemm_ceiling"}
    print("| dtype | rows x in -> out | projection TFLOP/s (bias fused) | cuBLAS same shape "
          "| cuBLAS ceiling | projection / ceiling |")
    print("|---|---|---|---|---|---|")
    for r in (r for r in rows if r["kind"] == "projection"):
        ceiling = ceilings.get(r["dtype"])
        ratio = f"{r['tflops'] / ceiling:.2f}" if ceiling else "n/a"
        print(f"| {r['dtype']} | {r['rows']} x {r['in']} -> {r['out']} | {r['tflops']:.1f} "
              f"| {r['cublas_same_shape_tflops']:.1f} | {ceiling or 0:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
