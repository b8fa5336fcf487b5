#!/usr/bin/env python3
"""The CUDA backend's kernels against PyTorch on the same GPU, in one run.

Runs attnserve_cuda_bench (engine/cuda/cuda_bench.cc: the attention core as
the engine runs it, cuDNN's SDPA through the cuDNN frontend where cuDNN
loads, and the fused kernel written here; our cuBLASLt projections, plain
cuBLAS GEMMs and a large square GEMM as the ceiling), then times
torch.nn.functional.scaled_dot_product_attention on the same attention shapes with each of PyTorch's backends (flash, cuDNN,
memory-efficient), and prints one Markdown table per part, ready for
docs/CUDA.md.

  python3 bench/cuda_bench.py [--bench build/engine/cuda/attnserve_cuda_bench] [--quick]
                              [--json FILE]

Needs a GPU, the benchmark binary (built with -DATTNSERVE_BUILD_BENCH=ON and
CUDA) and a CUDA build of PyTorch (without one the torch columns say n/a).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

BACKENDS = ("flash", "cudnn", "efficient")


def run_ours(binary, quick):
    cmd = [binary] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def flops_of(row):
    b, h, l, d = row["batch"], row["heads"], row["seq"], row["head_dim"]
    return 4.0 * b * h * l * l * d * (0.5 if row["causal"] else 1.0)


def torch_sdpa_tflops(row, backend, iters=10, reps=5):
    """TFLOP/s (median of `reps` timings of `iters` calls) of PyTorch's SDPA
    with one backend forced, on the shape of one of our attention rows; None
    when that backend refuses the shape or is missing."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[row["dtype"]]
    b, h, l, d = row["batch"], row["heads"], row["seq"], row["head_dim"]
    q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=dtype) for _ in range(3))
    try:
        with sdpa_kernel([which]):
            for _ in range(3):
                F.scaled_dot_product_attention(q, k, v, is_causal=row["causal"])
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    F.scaled_dot_product_attention(q, k, v, is_causal=row["causal"])
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop) / iters)
    except RuntimeError:
        return None
    return flops_of(row) / (statistics.median(times) * 1e-3) / 1e12


def fmt(x):
    return f"{x:.1f}" if x else "n/a"


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "n/a"


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default=os.path.join(root, "build", "engine", "cuda",
                                                        "attnserve_cuda_bench"))
    parser.add_argument("--quick", action="store_true",
                        help="one sequence length for fp16/bf16; every fp32 and layer-feature row")
    parser.add_argument("--json", help="also write every row (ours and torch's) to this file")
    args = parser.parse_args()

    rows = run_ours(args.bench, args.quick)
    device = next((r for r in rows if r["kind"] == "device"), {"name": "?", "sm": "?"})
    try:
        import torch
        torch_note = f"torch {torch.__version__}, CUDA {torch.version.cuda}, " \
                     f"cuDNN {torch.backends.cudnn.version()}"
    except ImportError:
        torch_note = "torch not installed"
    print(f"Device: {device['name']} (sm_{device['sm']}); {torch_note}; command: "
          f"python3 bench/cuda_bench.py{' --quick' if args.quick else ''}\n")

    # One line per shape: what the engine runs there (cuDNN where it has a
    # row, else the kernel written here), the kernel written here beside it,
    # and the first call's time (cuDNN's plan build) for a new shape.
    print("| dtype | B | H | L | D | causal | attnserve path | attnserve TFLOP/s "
          "| own kernel TFLOP/s | first call ms | torch flash | torch cuDNN | torch efficient "
          "| vs flash | vs cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    shapes = {}
    for r in (r for r in rows if r["kind"] == "attention"):
        key = (r["dtype"], r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"])
        if r["kernel"] == "flash-fp32":
            continue  # in the fp32 list below
        path = r["kernel"] in ("cudnn", "unfused")  # the engine's path; else our kernel
        shapes.setdefault(key, {})["path" if path else "own"] = r
    for pair in shapes.values():
        own = pair.get("own")
        r = pair.get("path", own)
        for backend in BACKENDS:
            r["torch_" + backend] = torch_sdpa_tflops(r, backend)
        path = r["kernel"] + (f" (bucket {r['bucket']})" if r["kernel"] == "cudnn"
                              and r.get("bucket", r["seq"]) != r["seq"] else "")
        first = f"{r['first_call_ms']:.1f}" if r["kernel"] == "cudnn" else "n/a"
        print(f"| {r['dtype']} | {r['batch']} | {r['heads']} | {r['seq']} | {r['head_dim']} "
              f"| {r['causal']} | {path} | {r['tflops']:.1f} "
              f"| {fmt(own['tflops'] if own else None)} | {first} | {fmt(r['torch_flash'])} "
              f"| {fmt(r['torch_cudnn'])} | {fmt(r['torch_efficient'])} "
              f"| {ratio(r['tflops'], r['torch_flash'])} | {ratio(r['tflops'], r['torch_cudnn'])} |",
              flush=True)

    print("\nfp32 rows: the attnserve path is the unfused path with 3xTF32 GEMMs (exact fp32 "
          "products on TF32 tensor cores); the own-kernel column is the same path with full-fp32 "
          "cuBLAS GEMMs; 'fused' is the fused fp32 kernel (3xTF32 inside the flash loop, "
          "ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1). Against torch's efficient backend (the issue's "
          "fp32 peer):")
    fused = {(r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"]): r
             for r in rows if r["kind"] == "attention" and r["kernel"] == "flash-fp32"}
    for pair in shapes.values():
        r, own = pair.get("path"), pair.get("own")
        if r is None or r["dtype"] != "fp32":
            continue
        f = fused.get((r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"]))
        print(f"- B {r['batch']} H {r['heads']} L {r['seq']} D {r['head_dim']} causal "
              f"{r['causal']}: 3xTF32 {r['tflops']:.1f}, full fp32 "
              f"{fmt(own['tflops'] if own else None)}, fused {fmt(f['tflops'] if f else None)}, "
              f"torch efficient {fmt(r['torch_efficient'])}: "
              f"{ratio(r['tflops'], r['torch_efficient'])}x "
              f"(full fp32 {ratio(own['tflops'] if own else None, r['torch_efficient'])}x, "
              f"fused {ratio(f['tflops'] if f else None, r['torch_efficient'])}x)")

    features = [r for r in rows if r["kind"] == "layer_feature"]
    if features:
        print("\nToday's layers' rules cuDNN does not take (bf16, causal, D 128; TFLOP/s over the "
              "score pairs a row sees): the fused kernel written here (the engine's route with "
              "ATTNSERVE_CUDA_EXPERIMENTAL_FUSED=1) against the default route: the unfused path "
              "(widening to fp32 included), or the general kernel where one head's scores exceed "
              "the unfused path's memory bound:\n")
        print("| rule | B | H | L | fused ms | fused TFLOP/s | default route | default ms "
              "| default TFLOP/s | fused speedup |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        by_feature = {}
        for r in features:
            by_feature.setdefault(r["feature"], {})[r["kernel"]] = r
        for name, k in by_feature.items():
            f = k.get("flash")
            route = "unfused" if "unfused" in k else "general"
            u = k.get(route)
            r = f or u
            ms = lambda x: f"{x['ms']:.3f}" if x else "n/a"  # noqa: E731
            print(f"| {name} | {r['batch']} | {r['heads']} | {r['seq']} "
                  f"| {ms(f)} | {fmt(f['tflops'] if f else None)} | {route if u else 'n/a'} "
                  f"| {ms(u)} | {fmt(u['tflops'] if u else None)} "
                  f"| {ratio(u['ms'] if u else None, f['ms'] if f else None)} |")

    ceilings = {r["dtype"]: r["tflops"] for r in rows if r["kind"] == "gemm_ceiling"}
    print("\n| dtype | rows x in -> out | projection TFLOP/s (bias fused) | cuBLAS same shape "
          "| cuBLAS ceiling | projection / same shape | projection / ceiling |")
    print("|---|---|---|---|---|---|---|")
    for r in (r for r in rows if r["kind"] == "projection"):
        ceiling = ceilings.get(r["dtype"])
        print(f"| {r['dtype']} | {r['rows']} x {r['in']} -> {r['out']} | {r['tflops']:.1f} "
              f"| {r['cublas_same_shape_tflops']:.1f} | {fmt(ceiling)} "
              f"| {ratio(r['tflops'], r['cublas_same_shape_tflops'])} "
              f"| {ratio(r['tflops'], ceiling)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
