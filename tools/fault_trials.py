#!/usr/bin/env python3
"""Repeated fault trials: a rank SIGKILLed mid sign all-reduce and mid DDP
step (DistributedLion attached). Counts hangs and wrong/missing/late errors
and prints the survivors' time from the kill to their error.

    python tools/fault_trials.py                  # 20 trials of each scenario
    python tools/fault_trials.py --trials 5 --scenarios sign --pg-timeout 10

Each trial picks a world size (2..4), a victim and a kill delay at random
(seeded: --seed). A trial is "ok" when every survivor raised an error naming
lionbit and the op within the group timeout + 10 s. Exit status 1 if any
trial was not ok. The rank functions live in tests/python/test_faults.py.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

import test_faults  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20, help="trials per scenario (default 20)")
    ap.add_argument("--scenarios", default="sign,ddp", help="comma list of: sign, ddp")
    ap.add_argument("--pg-timeout", type=float, default=30.0, help="init_process_group timeout, seconds")
    ap.add_argument("--max-world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-v", "--verbose", action="store_true", help="print every survivor's error")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    workdir = tempfile.mkdtemp(prefix="lionbit-faults-")
    failures = hangs = 0
    summary = []
    for scenario in args.scenarios.split(","):
        counts, times = {}, []
        start = time.time()
        for i in range(args.trials):
            n = rng.randint(2, args.max_world)
            victim = rng.randrange(n)
            delay = rng.uniform(1.0, 4.0)
            extra = {}
            if scenario == "ddp":
                extra["kill_in_backward"] = rng.random() < 0.7
            seed = rng.randrange(1 << 30)
            t = test_faults.run_trial(scenario, n, victim, delay, seed, args.pg_timeout, workdir, **extra)
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
            hangs += t["outcome"] == "hang"
            line = (f"{scenario} trial {i + 1:2d}: N={n} victim={victim} delay={delay:.2f}s {extra or ''} "
                    f"-> {t['outcome']}")
            if "worst_s" in t:
                times.append(t["worst_s"])
                line += f", slowest survivor error {t['worst_s']:.2f}s after the kill"
            print(line, flush=True)
            if t["outcome"] != "ok":
                failures += 1
                print(f"  detail: {t.get('detail')}", flush=True)
            elif args.verbose:
                for e in t["errors"]:
                    print(f"    {e[:300]}")
        tt = (f"time to error: median {statistics.median(times):.2f}s, max {max(times):.2f}s" if times else "")
        summary.append(f"{scenario}: {args.trials} trials in {time.time() - start:.0f}s: "
                       + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"; {tt}")
    print("\nsummary (group timeout %.0fs, allowed %.0fs):" % (args.pg_timeout, args.pg_timeout + test_faults.SLACK_S))
    for s in summary:
        print("  " + s)
    print(f"  total: {failures} trial(s) not ok, {hangs} hang(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
