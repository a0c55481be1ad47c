"""The first-use self-check's verdict for every custom kernel of a device.

On CUDA: lionbit's custom kernel set ("cuda", unchecked) against the ATen set
(backend/kernel_check.cpp, the check `LIONBIT_KERNELS=auto` runs at first
use), over several seeds, and the fused Lion apply and direction kernels,
one tensor a launch and a list a launch, against the torch path
(lionbit.kernel_choice.check_apply, check_direction, check_apply_list,
check_direction_list, check_apply_planes_list).
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

# The kernels the CUDA set brings of its own (backend/kernels_cuda.cpp); the
# rest are the ATen set's there.
CUSTOM_CUDA = ("pack", "pack_levels", "clean", "count_bits", "zero_codes", "encode_zeros", "decode_zeros",
               "count_code", "vote", "break_ties", "encode_trits", "decode_trits", "unpack")


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
        def direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out=None):
            before = int(np.unpackbits(zero.numpy()).sum())
            counts[1] += _C.lion_direction_into(g, m, b1, omb1, b2, omb2, sign, zero, off, update_momentum=update,
                                                m_out=m_out)
            counts[0] += int(np.unpackbits(zero.numpy()).sum()) - before
    for seed in range(args.seeds):
        case = kernel_choice.check_direction(direction, device, seed)
        if case is not None and verdicts.get("lion_direction", "ok") == "ok":
            verdicts["lion_direction"] = f"differs: {case} (seed {seed})"
    verdicts.setdefault("lion_direction", "ok")
    # The list kernels (many tensors a launch); on CPU the fused kernels tensor by tensor stand in.
    if device.type == "cuda":
        lists = {"lion_direction_list": (kernel_choice.check_direction_list, kernel_choice.LIST_CHECKS["cuda"][0]),
                 "lion_apply_list": (kernel_choice.check_apply_list, kernel_choice.LIST_CHECKS["cuda"][1]),
                 "lion_apply_planes_list": (kernel_choice.check_apply_planes_list,
                                            kernel_choice.LIST_CHECKS["cuda"][2])}
        lists = {name: (check, c.candidate) for name, (check, c) in lists.items()}
    else:
        def direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts=None, lengths=None,
                           m_outs=None):
            outs = m_outs or [None] * len(gs)
            if starts is not None:  # FSDP's chunks: the views the spans stand for
                gs = [g.view(-1)[a : a + k] for g, a, k in zip(gs, starts, lengths)]
                ms = [m.view(-1)[a : a + k] for m, a, k in zip(ms, starts, lengths)]
                outs = [o if o is None else o.view(-1)[a : a + k] for o, a, k in zip(outs, starts, lengths)]
            for g, m, off, out in zip(gs, ms, offsets, outs):
                if sign is None:
                    scratch = torch.zeros((g.numel() + 63) // 64 * 8, dtype=torch.uint8)
                    _C.lion_direction_into(g, m, b1, omb1, b2, omb2, scratch, scratch.clone(), 0, m_out=out)
                else:
                    direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, out)

        def apply_list(xs, deltas, lr, decay):
            for x, d in zip(xs, deltas):
                apply(x, d, lr, decay)
        lists = {"lion_direction_list": (kernel_choice.check_direction_list, direction_list),
                 "lion_apply_list": (kernel_choice.check_apply_list, apply_list),
                 "lion_apply_planes_list": (kernel_choice.check_apply_planes_list, _C.lion_apply_planes_list)}
    for name, (check, kernel) in lists.items():
        for seed in range(args.seeds):
            case = check(kernel, device, seed)
            if case is not None and verdicts.get(name, "ok") == "ok":
                verdicts[name] = f"differs: {case} (seed {seed})"
        verdicts.setdefault(name, "ok")
    print(f"kernel_verdicts: set '{candidate}' against 'aten' on {device}, {args.seeds} seeds; "
          f"lionbit.kernels: {lionbit.kernels(device)}")
    for name, verdict in verdicts.items():
        print(f"  {name:22s} {verdict}")
    bad = [n for n, v in verdicts.items() if v != "ok"]
    print(f"kernel_verdicts: {len(verdicts) - len(bad)}/{len(verdicts)} kernels agree" +
          (f"; differ: {', '.join(bad)}" if bad else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "set": candidate, "verdicts": verdicts}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
