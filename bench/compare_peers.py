#!/usr/bin/python3
"""Compares attnserve's CPU engine with the machine's ceilings and with PyTorch.

For each of the issue's shapes and thread counts, in one run: attnserve's fused
attention core and nn.MultiheadAttention-style layer (bench/engine_bench), the
oneDNN sgemm ceiling on the same GEMM sizes, a STREAM triad (for decode), the
extra peak RSS of a long sequence, and PyTorch's nn.MultiheadAttention and
attention core -- Debian's torch 1.13 on OpenBLAS (OPENBLAS_CORETYPE set to the
best kernel this OpenBLAS has for the CPU) and, when a PyTorch 2.x virtualenv
is given, its fused scaled_dot_product_attention; and, when a python with
PyPI's `openvino` is given, OpenVINO's CPU ScaledDotProductAttention (one op
compiled alone, fp32 and bf16 precision hints). Prints markdown tables of
times and ratios (docs/PERFORMANCE.md records them).

  /usr/bin/python3 bench/compare_peers.py --engine-bench build/bench/engine_bench \\
      [--torch2-python /tmp/venv-peers/bin/python] \\
      [--openvino-python /tmp/venv-peers/bin/python] [--threads 1,2] [--json out.json]

  (python3 -m venv /tmp/venv-peers && /tmp/venv-peers/bin/pip install torch numpy openvino)

Runs with Debian's /usr/bin/python3 (python3-torch). The same file is also the
PyTorch worker (--torch-worker) and the OpenVINO worker (--openvino-worker),
run in a subprocess per thread count so that OMP/OpenBLAS thread counts are set
before torch loads.
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# name, batch, q_len, kv_len, heads, head_dim, is_layer_shape
SHAPES = [
    ("B1_L128_E512_H8", 1, 128, 128, 8, 64, True),
    ("B8_L512_E768_H12", 8, 512, 512, 12, 64, True),
    ("B1_L2048_E1024_H16", 1, 2048, 2048, 16, 64, True),
    ("B32_L64_E256_H4", 32, 64, 64, 4, 64, True),
    ("decode_B16_Lk1024_H16_D64", 16, 1, 1024, 16, 64, False),
    ("long_B1_L8192_H16_D64", 1, 8192, 8192, 16, 64, False),
]


# ---------------------------------------------------------------- worker ---

def time_call(fn, min_time, min_reps=3, max_reps=200):
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    while len(times) < min_reps or (sum(times) < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_worker(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(int(args.threads))
    torch.manual_seed(0)
    has_sdpa = hasattr(F, "scaled_dot_product_attention")
    out = {"version": torch.__version__, "threads": torch.get_num_threads(),
           "blas": "", "results": {}}
    cfg = torch.__config__.show()
    for line in cfg.splitlines():
        if "BLAS_INFO" in line:
            out["blas"] = line.strip().split("BLAS_INFO=")[1].split(",")[0]
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
        lib.openblas_get_corename.restype = ctypes.c_char_p
        out["openblas_core"] = lib.openblas_get_corename().decode()
    except OSError:
        out["openblas_core"] = None

    def core(q, k, v):
        if has_sdpa:
            return F.scaled_dot_product_attention(q, k, v)
        # What nn.MultiheadAttention computes between its projections in 1.13.
        s = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        return torch.matmul(torch.softmax(s, dim=-1), v)

    with torch.inference_mode():
        for name, b, lq, lk, h, d, is_layer in SHAPES:
            for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                res = {}
                q = torch.randn(b, h, lq, d, dtype=dtype)
                k = torch.randn(b, h, lk, d, dtype=dtype)
                v = torch.randn(b, h, lk, d, dtype=dtype)
                long_unfused = lq * lk * b * h > (1 << 28) and not has_sdpa
                try:
                    if long_unfused:
                        # The unfused core would hold 2 x 4 GiB of scores;
                        # one head at a time is what a user would do.
                        def run_core():
                            for hh in range(h):
                                core(q[:, hh:hh + 1], k[:, hh:hh + 1], v[:, hh:hh + 1])
                        res["core_s"] = time_call(run_core, args.min_time, min_reps=2)
                        res["core_note"] = "one head at a time"
                    else:
                        res["core_s"] = time_call(lambda: core(q, k, v), args.min_time)
                except RuntimeError as e:  # e.g. a dtype this build lacks
                    res["core_error"] = str(e).splitlines()[0][:120]
                if is_layer:
                    e = h * d
                    mha = torch.nn.MultiheadAttention(e, h, batch_first=True).eval().to(dtype)
                    x = torch.randn(b, lq, e, dtype=dtype)
                    try:
                        res["mha_s"] = time_call(lambda: mha(x, x, x, need_weights=False),
                                                 args.min_time)
                    except RuntimeError as e:
                        res["mha_error"] = str(e).splitlines()[0][:120]
                out["results"][f"{name}/{dtype_name}"] = res
    json.dump(out, sys.stdout)


def openvino_worker(args):
    """OpenVINO's CPU plugin running one ScaledDotProductAttention op.

    The model is the op alone (parameters q, k, v in head layout, non-causal,
    no mask; scale 1/sqrt(d), the op's default), compiled for latency on
    `threads` threads with one stream. fp32 rows keep fp32 inference precision
    (the plugin would otherwise run bf16 on AMX CPUs); bf16 rows feed bf16
    tensors with bf16 inference precision. Inputs are bound once, so each
    timed call is one synchronous infer().
    """
    import numpy as np
    import openvino as ov
    try:
        from openvino import opset13 as ops
    except ImportError:
        from openvino.runtime import opset13 as ops

    threads = int(args.threads)
    core = ov.Core()
    out = {"version": ov.get_version(), "threads": threads, "results": {}}
    rng = np.random.default_rng(0)

    def tensor(shape, type_name):
        x = rng.standard_normal(shape, dtype=np.float32)
        if type_name == "f32":
            return ov.Tensor(x)
        t = ov.Tensor(ov.Type.bf16, list(shape))
        # bf16 = the top half of the fp32 bits, rounded to nearest even.
        bits = x.view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        t.data.view(np.uint16)[...] = bits.reshape(t.data.shape)
        return t

    for name, b, lq, lk, h, d, _ in SHAPES:
        for dtype_name, type_name in (("fp32", "f32"), ("bf16", "bf16")):
            res = {}
            try:
                et = ov.Type.f32 if type_name == "f32" else ov.Type.bf16
                q = ops.parameter([b, h, lq, d], et, name="q")
                k = ops.parameter([b, h, lk, d], et, name="k")
                v = ops.parameter([b, h, lk, d], et, name="v")
                sdpa = ops.scaled_dot_product_attention(q, k, v, causal=False)
                model = ov.Model([sdpa], [q, k, v], f"sdpa_{name}")
                compiled = core.compile_model(model, "CPU", {
                    "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
                    "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": type_name})
                req = compiled.create_infer_request()
                for i, shape in enumerate(((b, h, lq, d), (b, h, lk, d), (b, h, lk, d))):
                    req.set_input_tensor(i, tensor(shape, type_name))
                res["core_s"] = time_call(req.infer, args.min_time)
                res["exec_precision"] = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
            except Exception as e:  # a shape or type this plugin refuses
                res["core_error"] = str(e).splitlines()[0][:160]
            out["results"][f"{name}/{dtype_name}"] = res
    json.dump(out, sys.stdout)


# ---------------------------------------------------------------- driver ---

def run_engine_bench(path, threads, min_time, extra_filter=None):
    flt = extra_filter or f"(Core|GemmCeiling|Layer|LayerGemmCeiling|StreamTriad)/.*threads:{threads}/"
    cmd = [path, f"--benchmark_filter={flt}", "--benchmark_format=json",
           f"--benchmark_min_time={min_time}"]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    data = json.loads(proc.stdout)
    res = {}
    for bm in data["benchmarks"]:
        name = bm["name"].replace("/real_time", "")
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[bm["time_unit"]]
        res[name] = {"s": bm["real_time"] * scale, "cpu_s": bm["cpu_time"] * scale,
                     "GFLOPs": bm.get("GFLOPs"), "GBps": bm.get("GBps"),
                     "extra_MiB": bm.get("extra_MiB"), "label": bm.get("label", "")}
    return res, data.get("context", {})


def run_torch(python, threads, min_time, coretype):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
                "MKL_NUM_THREADS": str(threads)})
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    cmd = [python, os.path.abspath(__file__), "--torch-worker", "--threads", str(threads),
           "--min-time", str(min_time)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout)


def run_openvino(python, threads, min_time):
    cmd = [python, os.path.abspath(__file__), "--openvino-worker", "--threads", str(threads),
           "--min-time", str(min_time)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout)


def merge_best(store, t, res):
    """Keeps, per benchmark, the fastest of the runs so far."""
    cur = store.setdefault(t, {})
    for name, r in res.items():
        if name not in cur or r["s"] < cur[name]["s"]:
            cur[name] = r


def merge_torch(store, t, res):
    if t not in store or "results" not in store[t]:
        store[t] = res
        return
    for key, r in res.get("results", {}).items():
        cur = store[t]["results"].setdefault(key, {})
        for field in ("core_s", "mha_s"):
            if field in r and (field not in cur or r[field] < cur[field]):
                cur[field] = r[field]


def best_openblas_coretype():
    """The most specific OPENBLAS_CORETYPE this OpenBLAS accepts for this CPU."""
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
    except OSError:
        return None
    lib.openblas_get_corename.restype = ctypes.c_char_p
    detected = lib.openblas_get_corename().decode()
    # OpenBLAS reads the variable at load time, so each candidate needs a
    # fresh process; a name it does not know falls back to detection.
    for cand in ("SAPPHIRERAPIDS", "COOPERLAKE", "SKYLAKEX", "HASWELL"):
        probe = subprocess.run(
            [sys.executable, "-c",
             "import ctypes; l=ctypes.CDLL('libopenblas.so.0'); "
             "l.openblas_get_corename.restype=ctypes.c_char_p; print(l.openblas_get_corename().decode())"],
            env=dict(os.environ, OPENBLAS_CORETYPE=cand), capture_output=True, text=True)
        if probe.stdout.strip().lower() == cand.lower():
            return cand
    return detected.upper()


def machine_info():
    info = {"python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in lscpu.splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "L2 cache", "L3 cache",
                               "Hypervisor vendor"):
                info[key.strip()] = val.strip()
            if key.strip() == "Flags":
                flags = val.split()
                info["simd"] = " ".join(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx")))
    except OSError:
        pass
    try:
        info["loadavg_start"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    return info


def fmt_ms(s):
    return "-" if s is None else (f"{s * 1e3:.3g}" if s * 1e3 < 100 else f"{s * 1e3:.0f}")


def fmt_ratio(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-bench", default=None, help="path to engine_bench")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1 and all cores)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement")
    ap.add_argument("--torch-python", default="/usr/bin/python3", help="python with Debian's torch 1.13")
    ap.add_argument("--torch2-python", default=None, help="python of a PyTorch 2.x virtualenv (optional)")
    ap.add_argument("--openvino-python", default=None,
                    help="python with PyPI's openvino (optional; OpenVINO's CPU SDPA as a peer)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run everything this many times and keep each figure's best (a shared machine "
                         "only ever makes a measurement slower)")
    ap.add_argument("--json", default=None, help="also write every raw figure here")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--openvino-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        torch_worker(args)
        return
    if args.openvino_worker:
        openvino_worker(args)
        return

    if args.engine_bench is None:
        for cand in ("build/bench/engine_bench", "build-flash/bench/engine_bench"):
            if os.path.exists(cand):
                args.engine_bench = cand
                break
    if args.engine_bench is None or not os.path.exists(args.engine_bench):
        sys.exit("engine_bench not found: build it (cmake -DATTNSERVE_BUILD_BENCH=ON) and pass --engine-bench")
    ncpu = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, ncpu})
    for venv in ("/tmp/venv-peers", "/tmp/venv-torch2"):
        if args.torch2_python is None and os.path.exists(f"{venv}/bin/python"):
            args.torch2_python = f"{venv}/bin/python"
    if args.openvino_python is None and os.path.exists("/tmp/venv-peers/bin/python"):
        args.openvino_python = "/tmp/venv-peers/bin/python"

    coretype = best_openblas_coretype()
    info = machine_info()
    info["openblas_coretype"] = coretype
    info["command"] = " ".join([sys.executable] + sys.argv)
    raw = {"machine": info, "engine": {}, "torch1": {}, "torch2": {}, "openvino": {}}

    t_start = time.time()
    for rep in range(args.repeat):
        for t in threads:
            print(f"# round {rep + 1}, threads {t}: engine_bench ...", file=sys.stderr, flush=True)
            merge_best(raw["engine"], t, run_engine_bench(args.engine_bench, t, args.min_time)[0])
            print(f"# round {rep + 1}, threads {t}: torch 1.13 ...", file=sys.stderr, flush=True)
            merge_torch(raw["torch1"], t, run_torch(args.torch_python, t, args.min_time, coretype))
            if args.torch2_python:
                print(f"# round {rep + 1}, threads {t}: torch 2.x ...", file=sys.stderr, flush=True)
                merge_torch(raw["torch2"], t, run_torch(args.torch2_python, t, args.min_time, coretype))
            if args.openvino_python:
                print(f"# round {rep + 1}, threads {t}: OpenVINO ...", file=sys.stderr, flush=True)
                merge_torch(raw["openvino"], t, run_openvino(args.openvino_python, t, args.min_time))
    print("# peak RSS ...", file=sys.stderr, flush=True)
    rss, _ = run_engine_bench(args.engine_bench, 0, args.min_time, extra_filter="PeakRss/")
    raw["peak_rss"] = rss
    raw["machine"]["seconds"] = round(time.time() - t_start)
    try:
        info["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)

    t1v = next((raw["torch1"][t].get("version") for t in threads if "version" in raw["torch1"][t]), None)
    t2v = next((raw["torch2"][t].get("version") for t in threads if "version" in raw["torch2"].get(t, {})), None)
    ovv = next((raw["openvino"][t].get("version") for t in threads if "version" in raw["openvino"].get(t, {})), None)
    for t in threads:
        if "error" in raw["openvino"].get(t, {}):
            print(f"OpenVINO worker, {t} threads: {raw['openvino'][t]['error']}", file=sys.stderr)
        for key, r in raw["openvino"].get(t, {}).get("results", {}).items():
            if "core_error" in r:
                print(f"OpenVINO {key}, {t} threads: {r['core_error']}", file=sys.stderr)
    print(f"Machine: {info.get('Model name')}, {info.get('CPU(s)')} CPUs ({info.get('Hypervisor vendor', 'bare metal')}), "
          f"{info.get('simd')}; L2 {info.get('L2 cache')}, L3 {info.get('L3 cache')}")
    print(f"Load average at start/end: {info.get('loadavg_start')} / {info.get('loadavg_end')}; "
          f"OpenBLAS core: {coretype}; torch {t1v} (BLAS {raw['torch1'][threads[0]].get('blas')}, "
          f"OpenBLAS {raw['torch1'][threads[0]].get('openblas_core')})"
          + (f"; torch {t2v} (BLAS {raw['torch2'][threads[0]].get('blas')})" if t2v else "; torch 2.x: not measured")
          + (f"; OpenVINO {ovv}" if ovv else "; OpenVINO: not measured"))
    print(f"Command: {info['command']}")
    print()

    def eng(t, what, shape, dt):
        return raw["engine"][t].get(f"{what}/{shape}/{dt}/threads:{t}", {})

    def torch_res(which, t, shape, dt):
        return raw[which].get(t, {}).get("results", {}).get(f"{shape}/{dt}", {})

    print("Attention core (non-causal, no mask, head_dim 64), milliseconds and ratios:")
    print()
    print("| shape | thr | attnserve fp32 | sgemm ceiling | core/ceiling | attnserve bf16 | bf16 speedup "
          "| torch 1.13 core | ceiling/torch1.13 | torch 2 sdpa fp32 | torch 2 sdpa bf16 | attnserve vs torch2 (fp32, bf16) "
          "| OpenVINO sdpa fp32 | OpenVINO sdpa bf16 | attnserve vs OpenVINO (fp32, bf16) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, *_ in SHAPES:
        for t in threads:
            f = eng(t, "Core", name, "fp32").get("s")
            c = eng(t, "GemmCeiling", name, "fp32").get("s")
            bf = eng(t, "Core", name, "bf16").get("s")
            t1 = torch_res("torch1", t, name, "fp32").get("core_s")
            t2 = torch_res("torch2", t, name, "fp32").get("core_s")
            t2b = torch_res("torch2", t, name, "bf16").get("core_s")
            ov = torch_res("openvino", t, name, "fp32").get("core_s")
            ovb = torch_res("openvino", t, name, "bf16").get("core_s")
            print(f"| {name} | {t} | {fmt_ms(f)} | {fmt_ms(c)} | {fmt_ratio(ratio(c, f))} | {fmt_ms(bf)} "
                  f"({eng(t, 'Core', name, 'bf16').get('label', '')}) | {fmt_ratio(ratio(f, bf))}x | {fmt_ms(t1)} | "
                  f"{fmt_ratio(ratio(c, t1))} | {fmt_ms(t2)} | {fmt_ms(t2b)} | "
                  f"{fmt_ratio(ratio(t2, f))}x, {fmt_ratio(ratio(t2b, bf))}x | {fmt_ms(ov)} | {fmt_ms(ovb)} | "
                  f"{fmt_ratio(ratio(ov, f))}x, {fmt_ratio(ratio(ovb, bf))}x |")
    print()
    print("Layer forward (nn.MultiheadAttention, batch first, self-attention, biases, need_weights=False), ms:")
    print()
    print("| shape | thr | attnserve fp32 | sgemm ceiling | layer/ceiling | torch 1.13 MHA | speedup vs 1.13 "
          "| torch 2 MHA fp32 | speedup vs 2 | attnserve bf16 | torch 2 MHA bf16 | bf16 speedup vs 2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, *rest in SHAPES:
        if not rest[-1]:
            continue
        for t in threads:
            f = eng(t, "Layer", name, "fp32").get("s")
            c = eng(t, "LayerGemmCeiling", name, "fp32").get("s")
            bf = eng(t, "Layer", name, "bf16").get("s")
            t1 = torch_res("torch1", t, name, "fp32").get("mha_s")
            t2 = torch_res("torch2", t, name, "fp32").get("mha_s")
            t2b = torch_res("torch2", t, name, "bf16").get("mha_s")
            print(f"| {name} | {t} | {fmt_ms(f)} | {fmt_ms(c)} | {fmt_ratio(ratio(c, f))} | {fmt_ms(t1)} | "
                  f"{fmt_ratio(ratio(t1, f))}x | {fmt_ms(t2)} | {fmt_ratio(ratio(t2, f))}x | {fmt_ms(bf)} | "
                  f"{fmt_ms(t2b)} | {fmt_ratio(ratio(t2b, bf))}x |")
    print()
    print("Decode (B16 Lq1 Lk1024 H16 D64): K/V bytes read per second against a STREAM triad in the same run:")
    print()
    print("| thr | triad 128 MiB GB/s | triad 3 GiB GB/s | attnserve fp32 GB/s | fp32 / triad(128M, 3G) "
          "| attnserve bf16 GB/s | bf16 / triad(128M, 3G) | torch 1.13 core ms | torch 2 sdpa ms (fp32, bf16) "
          "| OpenVINO sdpa ms (fp32, bf16) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    dname = SHAPES[4][0]
    for t in threads:
        tri_s = raw["engine"][t].get(f"StreamTriad/MiB:128/threads:{t}", {}).get("GBps")
        tri_l = raw["engine"][t].get(f"StreamTriad/MiB:3072/threads:{t}", {}).get("GBps")
        f = eng(t, "Core", dname, "fp32").get("GBps")
        bf = eng(t, "Core", dname, "bf16").get("GBps")
        g = lambda x: "-" if x is None else f"{x / 1e9:.1f}"
        print(f"| {t} | {g(tri_s)} | {g(tri_l)} | {g(f)} | {fmt_ratio(ratio(f, tri_s))}, {fmt_ratio(ratio(f, tri_l))} "
              f"| {g(bf)} | {fmt_ratio(ratio(bf, tri_s))}, {fmt_ratio(ratio(bf, tri_l))} | "
              f"{fmt_ms(torch_res('torch1', t, dname, 'fp32').get('core_s'))} | "
              f"{fmt_ms(torch_res('torch2', t, dname, 'fp32').get('core_s'))}, "
              f"{fmt_ms(torch_res('torch2', t, dname, 'bf16').get('core_s'))} | "
              f"{fmt_ms(torch_res('openvino', t, dname, 'fp32').get('core_s'))}, "
              f"{fmt_ms(torch_res('openvino', t, dname, 'bf16').get('core_s'))} |")
    print()
    print("Memory: extra peak RSS of the core at L=8192 (B1 H16 D64, no weights), beyond inputs and outputs:")
    print()
    for k, v in sorted(rss.items()):
        print(f"- {k}: {v['extra_MiB']:.1f} MiB extra ({v['s'] * 1e3:.0f} ms)")
    print()
    print(f"(whole run: {raw['machine']['seconds']} s)")


if __name__ == "__main__":
    main()
