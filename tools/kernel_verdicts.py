"""The first-use self-check's verdict for every custom kernel of a device.

On CUDA: lionbit's custom kernel set ("cuda", unchecked) against the ATen set
(backend/kernel_check.cpp, the check `LIONBIT_KERNELS=auto` runs at first
use), over several seeds, and the fused Lion apply and direction kernels
against the torch path (lionbit.kernel_choice.check_apply, check_direction).
On CPU (no GPU): the SIMD set against the ATen set and the CPU fused apply
and direction, the same checks on the CPU's kernels. Prints one line per kernel: ok, or the first case that disagrees.

    python tools/kernel_verdicts.py [--device cuda:0] [--seeds 5] [--json FILE]
"""

import argparse
import json
import sys

import numpy as np
import torch

import lionbit
from lionbit import _C, kernel_choice

# The kernels a set may bring of its own (backend/kernel_set.hpp); the CUDA
# set's custom ones are the first six, the rest are the ATen set's there.
CUSTOM_CUDA = ("pack", "pack_levels", "count_code", "vote", "break_ties", "unpack")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", help="write the verdicts here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not lionbit.built_with_cuda:
        print("kernel_verdicts: lionbit was built without the CUDA path")
        return 1
    candidate = "cuda" if device.type == "cuda" else "simd"
    verdicts = {name: "ok" for name in CUSTOM_CUDA}
    for seed in range(args.seeds):
        for kernel, case in _C.check_kernel_sets(candidate, "aten", str(device), seed):
            if verdicts.get(kernel, "ok") == "ok":
                verdicts[kernel] = f"differs: {case} (seed {seed})"
    if device.type == "cuda":
        apply = kernel_choice.CHECKS["cuda"].candidate
    else:
        def apply(x, delta, lr, decay):
            _C.lion_apply(x, delta, lr, decay)
    for seed in range(args.seeds):
        case = kernel_choice.check_apply(apply, device, seed)
        if case is not None and verdicts.get("lion_apply", "ok") == "ok":
            verdicts["lion_apply"] = f"differs: {case} (seed {seed})"
    verdicts.setdefault("lion_apply", "ok")
    if device.type == "cuda":
        direction = kernel_choice.DIRECTION_CHECKS["cuda"].candidate
    else:
        def direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update):
            before = int(np.unpackbits(zero.numpy()).sum())
            counts[1] += _C.lion_direction_into(g, m, b1, omb1, b2, omb2, sign, zero, off, update_momentum=update)
            counts[0] += int(np.unpackbits(zero.numpy()).sum()) - before
    for seed in range(args.seeds):
        case = kernel_choice.check_direction(direction, device, seed)
        if case is not None and verdicts.get("lion_direction", "ok") == "ok":
            verdicts["lion_direction"] = f"differs: {case} (seed {seed})"
    verdicts.setdefault("lion_direction", "ok")
    print(f"kernel_verdicts: set '{candidate}' against 'aten' on {device}, {args.seeds} seeds; "
          f"lionbit.kernels: {lionbit.kernels(device)}")
    for name, verdict in verdicts.items():
        print(f"  {name:14s} {verdict}")
    bad = [n for n, v in verdicts.items() if v != "ok"]
    print(f"kernel_verdicts: {len(verdicts) - len(bad)}/{len(verdicts)} kernels agree" +
          (f"; differ: {', '.join(bad)}" if bad else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "set": candidate, "verdicts": verdicts}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
