#!/usr/bin/env python3
"""Compares paged_decode_bench builds in alternating runs on a shared host.

Each run of each binary measures one decode step (PagedDecode) and its peer,
the read of the same K/V (ReadKv), in one process, and reports their ratio;
the binaries take turns, ROUNDS times, and the median ratio of each is
printed. On a host whose memory bandwidth other tenants share, the ratio
taken inside one process is the steady figure, not either time alone.

  python3 bench/paged_decode_compare.py [--rounds 6] [--threads 2] \\
      [--shape S32_Lk4096_H8_KV8_D128/fp16/block:16] BIN [BIN ...]

BIN: paged_decode_bench binaries (e.g. build/bench/paged_decode_bench and
one built from another commit). docs/PERFORMANCE.md, "Paged decode".
"""
import argparse
import json
import statistics
import subprocess


def run_once(binary, shape, threads, min_time):
    out = subprocess.run(
        [binary, f"--benchmark_filter=^(ReadKv|PagedDecode)/{shape}/threads:{threads}/",
         f"--benchmark_min_time={min_time}", "--benchmark_format=json"],
        capture_output=True, text=True, check=True).stdout
    times = {b["name"].split("/")[0]: b["real_time"] for b in json.loads(out)["benchmarks"]}
    if set(times) != {"ReadKv", "PagedDecode"}:
        raise SystemExit(f"{binary}: no ReadKv and PagedDecode for shape {shape}, threads {threads}")
    return times["PagedDecode"], times["ReadKv"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="S32_Lk4096_H8_KV8_D128/fp16/block:16")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per benchmark")
    ap.add_argument("binaries", nargs="+")
    a = ap.parse_args()
    runs = {b: [] for b in a.binaries}
    for _ in range(a.rounds):
        for b in a.binaries:
            runs[b].append(run_once(b, a.shape, a.threads, a.min_time))
    print(f"shape {a.shape}, {a.threads} thread(s), {a.rounds} rounds; ms are medians")
    for b, rs in runs.items():
        ratios = [p / r for p, r in rs]
        print(f"{b}: decode {statistics.median(p for p, _ in rs):.1f} ms, "
              f"read {statistics.median(r for _, r in rs):.1f} ms, decode/read median "
              f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
