"""Suite 2b: the sign kernels of the CPU's SIMD set against the device-generic
ATen set (what a GPU falls back to, and what ``LIONBIT_KERNELS=aten`` runs),
on the CPU, one thread. Prints the median time of each kernel and the GB/s of
its input; the ATen set exists to be right on every device, not fast.

    python bench/kernel_sets.py [--elems 16777216] [--reps 7]
"""

import argparse
import os
import statistics
import time

import torch

from lionbit import _test_hooks


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elems", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.elems
    words = (n + 63) // 64
    g = torch.Generator().manual_seed(0)
    rows = []

    def plane():
        return torch.randint(0, 256, (words * 8,), dtype=torch.uint8, generator=g)

    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(n, generator=g).to(dtype)
        sign, zero = torch.zeros(words * 8, dtype=torch.uint8), torch.zeros(words * 8, dtype=torch.uint8)
        nbytes = src.numel() * src.element_size()
        for s in ("simd", "aten"):
            t = timed(lambda s=s: _test_hooks.kernel_pack(s, src, sign, zero, 0), args.reps)
            rows.append((f"pack {str(dtype)[6:]}", s, t, nbytes))
    for ranks in (2, 4, 8):
        signs = [plane() for _ in range(ranks)]
        zeros = [None] * ranks
        out_s, out_t = torch.empty(words * 8, dtype=torch.uint8), torch.empty(words * 8, dtype=torch.uint8)
        for s in ("simd", "aten"):
            t = timed(lambda s=s: _test_hooks.kernel_vote(s, signs, zeros, out_s, out_t), args.reps)
            rows.append((f"vote N={ranks}", s, t, ranks * words * 8))
    for nplanes in (1, 2):
        planes = [plane() for _ in range(nplanes)]
        lut = torch.arange(1 << nplanes, dtype=torch.float32)
        dst = torch.empty(n, dtype=torch.float32)
        for s in ("simd", "aten"):
            t = timed(lambda s=s: _test_hooks.kernel_unpack(s, planes, lut, dst), args.reps)
            rows.append((f"unpack {nplanes} plane(s) -> float32", s, t, n * 4))
    load = os.getloadavg()[0]
    print(f"{n} elements, 1 thread, load average {load:.2f} (2 cores; above ~1.1 the figures are not figures)")
    print("| kernel | set | ms | GB/s | ATen / SIMD |\n|---|---|---|---|---|")
    simd = {}
    for name, s, t, nbytes in rows:
        if s == "simd":
            simd[name] = t
        ratio = f"{t / simd[name]:.1f}×" if s == "aten" else ""
        print(f"| {name} | {s} | {t * 1e3:.2f} | {nbytes / t / 1e9:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
