#!/usr/bin/env python3
"""Host <-> device copy bandwidth on this GPU at the request sizes the serving
benchmark uses (bench/gpu_session.sh serve): the peer for the server's copy
path. Pinned and pageable host memory, host-to-device and device-to-host,
median of 20 copies each, timed with CUDA events through PyTorch."""
import statistics

import torch


def gbps(nbytes, src, dst, reps=20):
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    t = statistics.median(times)
    return nbytes / t / 1e9, t * 1e6


def main():
    print(f"device: {torch.cuda.get_device_name()}")
    print("| bytes | host memory | H2D GB/s | H2D us | D2H GB/s | D2H us |")
    print("|---|---|---|---|---|---|")
    for mib in (1.5, 12, 64):
        n = int(mib * 2**20)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for pinned in (True, False):
            host = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory() if pinned else \
                torch.randint(0, 255, (n,), dtype=torch.uint8)
            h2d, h2d_us = gbps(n, host, dev)
            d2h, d2h_us = gbps(n, dev, host)
            print(f"| {mib} MiB | {'pinned' if pinned else 'pageable'} | {h2d:.1f} | {h2d_us:.0f} "
                  f"| {d2h:.1f} | {d2h_us:.0f} |")


if __name__ == "__main__":
    main()
