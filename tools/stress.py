#!/usr/bin/env python3
"""Determinism and stress runs (the long versions of tests/python/test_stress.py).

    python tools/stress.py                       # both parts, full size
    python tools/stress.py --part steps --steps 1000 --worlds 2,3,4,5
    python tools/stress.py --part collectives --collectives 10000 --world 3

(a) steps: DistributedLion for --steps steps at each world size (plain module
    with vote, DDP-attached with vote, DDP-attached with avg and bfloat16
    momentum); a SHA-256 of every parameter is compared across ranks every
    --check-every steps. Any disagreement is a mismatch.
(b) collectives: --collectives random collectives (sign all-reduce
    vote/avg/sum over random sizes, dtypes, zero densities, sync and async
    batches, interleaved with forwarded all_reduce/broadcast/all_gather), each
    checked against a float64 reference from an all_gather of torch.sign;
    resident memory (VmRSS) per rank at the start (after 20 calls), middle
    and end.
Exit status 1 on any mismatch.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

from harness import run_ranks, values  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["steps", "collectives", "both"], default="both")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--check-every", type=int, default=50)
    ap.add_argument("--worlds", default="2,3,4,5")
    ap.add_argument("--collectives", type=int, default=10000)
    ap.add_argument("--world", type=int, default=3, help="world size of the collectives part")
    ap.add_argument("--chunk-elems", default="100000",
                    help="LIONBIT_CHUNK_ELEMS for the collectives part (small: many pipelined chunks)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bad = 0
    if args.part in ("steps", "both"):
        print(f"(a) DistributedLion, {args.steps} steps, hash check every {args.check_every} steps")
        for n in [int(w) for w in args.worlds.split(",")]:
            start = time.time()
            res = values(run_ranks("test_stress:lion_steps", n, timeout=7200, pg_timeout=300,
                                   kwargs={"steps": args.steps, "seed": args.seed, "check_every": args.check_every}))
            for setup in res[0]:
                finals = {r[setup]["hash"] for r in res}
                mism = res[0][setup]["mismatches"] + (len(finals) != 1)
                bad += mism
                print(f"  N={n} {setup:22s} checks {res[0][setup]['checks']:3d}, mismatches {mism}, "
                      f"final hash {res[0][setup]['hash']} on all ranks: {len(finals) == 1}, "
                      f"weights moved: {res[0][setup]['moved']}, loss(rank 0) {res[0][setup]['last_loss']:.3f}")
            print(f"  N={n}: {time.time() - start:.0f}s", flush=True)
    if args.part in ("collectives", "both"):
        n = args.world
        print(f"(b) {args.collectives} random collectives at N={n} (LIONBIT_CHUNK_ELEMS={args.chunk_elems})")
        start = time.time()
        res = values(run_ranks("test_stress:random_collectives", n, timeout=14400, pg_timeout=300,
                               kwargs={"count": args.collectives, "seed": args.seed},
                               env={"LIONBIT_CHUNK_ELEMS": args.chunk_elems}))
        for rank, r in enumerate(res):
            bad += r["n_mismatches"]
            rss = r["rss_mb"]
            print(f"  rank {rank}: mismatches {r['n_mismatches']} {r['mismatches'][:3]}, ran {r['kinds']}, "
                  f"sign calls (stats) {r['sign_calls']}")
            print(f"    RSS MB after malloc_trim: start {rss['start']:.0f} middle {rss['middle']:.0f}"
                  f" end {rss['end']:.0f}"
                  f" (untrimmed: start {rss['start_untrimmed']:.0f} end {rss['end_untrimmed']:.0f});"
                  f" every tenth: {[mb for _, mb in rss['samples']]}")
        print(f"  {time.time() - start:.0f}s", flush=True)
    print("stress:", "clean" if bad == 0 else f"{bad} MISMATCHES")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
