"""DistributedLion's local work per step against plain torch Lion (foreach ops).

One process, world size 1 on the "lionbit" backend (on CUDA: NCCL underneath),
so DistributedLion's step is its local work: the direction and its 1-bit pack,
the sign all-reduce's own kernels (count / vote, unpack) on one rank's planes,
the momentum update and the fused apply. The reference is Lion written with
torch's foreach ops (the fastest plain-torch Lion: one kernel per op over all
tensors), momentum in the parameters' dtype. Parameters: a stack of
4096 x 10240 matrices (default ~1B parameters) in bf16, gradients random.

    python bench/gpu_lion_step.py [--params 1e9] [--device cuda] [--json FILE]

Prints one line per method: median ms per step over --steps timed steps
(after 3 warm-ups), and the ratio to torch Lion. Goal: DistributedLion <= 1.0x.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import lionbit

TORCH = "torch Lion (foreach, bf16 momentum)"


def lion_foreach(params, grads, momenta, lr, wd, b1, b2):
    """Lion (Chen et al. 2023) in foreach ops: x = x(1 - lr wd) - lr sign(b1 m + (1 - b1) g);
    m = b2 m + (1 - b2) g."""
    torch._foreach_mul_(params, 1.0 - lr * wd)
    update = torch._foreach_mul(momenta, b1)
    torch._foreach_add_(update, grads, alpha=1.0 - b1)
    torch._foreach_sign_(update)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(momenta, b2)
    torch._foreach_add_(momenta, grads, alpha=1.0 - b2)


def timed(step, device, steps):
    """Median wall-clock ms of step() (the device synchronised around each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_step(step, device):
    """Prints where one step's host and device time goes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e9, help="parameters in all (default 1e9)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's top operators of one DistributedLion step")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_lion_step: no CUDA device; nothing to measure")
        return 0
    rows, cols = 4096, 10240
    if args.params < rows * cols:
        rows, cols = 256, 1024
    count = max(1, round(args.params / (rows * cols)))
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(rows, cols, device=device, dtype=dtype, generator=gen) * 0.02 for _ in range(count)]
    grads = [torch.randn(rows, cols, device=device, dtype=dtype, generator=gen) for _ in range(count)]
    n = count * rows * cols
    lr, wd, betas = 1e-4, 0.1, (0.9, 0.99)
    print(f"gpu_lion_step: {n / 1e9:.3f}B parameters ({count} x {rows}x{cols}, bf16) on {device}, "
          f"lionbit kernels {lionbit.kernels(device)}")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("lionbit", store=dist.HashStore(), rank=0, world_size=1)
    results = {}
    try:
        momenta = [torch.zeros_like(p) for p in params]
        results[TORCH] = timed(lambda: lion_foreach(params, grads, momenta, lr, wd, *betas), device, args.steps)
        momenta.clear()
        for label, kwargs in (
            ("DistributedLion (bf16 momentum)", {"momentum_dtype": torch.bfloat16}),
            ("DistributedLion (fp32 momentum, default)", {}),
            ("DistributedLion fused=False (bf16 momentum)", {"momentum_dtype": torch.bfloat16, "fused": False}),
        ):
            leaves = [torch.nn.Parameter(p) for p in params]
            for leaf, g in zip(leaves, grads):
                leaf.grad = g
            opt = lionbit.DistributedLion(leaves, lr=lr, betas=betas, weight_decay=wd, **kwargs)
            results[label] = timed(opt.step, device, args.steps)
            if args.profile and label == "DistributedLion (bf16 momentum)":
                profile_step(opt.step, device)
            del opt, leaves
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()

    base = results[TORCH]
    print(f"{'method':46s} {'ms/step':>9s} {'x torch':>8s}")
    for label, ms in results.items():
        print(f"{label:46s} {ms:9.2f} {ms / base:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "device": str(device), "dtype": "bfloat16", "steps": args.steps,
                       "ms_per_step": results, "ratio_to_torch": {k: v / base for k, v in results.items()},
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
