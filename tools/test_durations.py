#!/usr/bin/env python3
"""Per-file times of a pytest run, from its ``--durations=0`` table.

    PYTEST_ADDOPTS=--durations=0 make test > after.log
    python3 tools/test_durations.py after.log [--before before.log] [--json out.json]

prints a Markdown table of the test files, slowest first: seconds (setup +
call + teardown of every test in the file; pytest leaves out those under
5 ms), beside the same for --before when given. --json writes {"machine",
"total_s", "files": {name: seconds}} (and "before" likewise) for
docs/benchmarks/test_durations.json, which keeps one entry per machine:
"machine" names this one's CPU and instruction set (from /proc/cpuinfo), the
key of its entry there. Standard library only.
"""

import argparse
import json
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")


def per_file(path: str) -> dict:
    seconds = defaultdict(float)
    inside = False
    with open(path, errors="replace") as f:
        for line in f:
            if "slowest durations" in line:
                inside = True
                continue
            if not inside:
                continue
            m = LINE.match(line)
            if m is None:
                if line.startswith("="):
                    break
                continue
            name = m.group(3).split("::")[0].rsplit("/", 1)[-1]
            seconds[name] += float(m.group(1))
    if not inside:
        sys.exit(f"{path}: no '--durations=0' table (run pytest with --durations=0)")
    return {name: round(s, 1) for name, s in seconds.items()}


def machine(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This machine's CPU and widest x86 vector ISA, e.g. "Intel Xeon, AVX-512"
    or "AMD EPYC, AVX2": what the figures of test_durations.json are keyed by."""
    model, flags = "unknown CPU", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    for vendor, family in (("Intel", "Xeon"), ("AMD", "EPYC")):
        if vendor in model and family in model:
            model = f"{vendor} {family}"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model}, {isa}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--before")
    parser.add_argument("--json")
    args = parser.parse_args()
    after = per_file(args.log)
    before = per_file(args.before) if args.before else {}
    names = sorted(set(after) | set(before), key=lambda n: -max(after.get(n, 0.0), before.get(n, 0.0)))
    print("| file | s before | s after |" if before else "| file | s |")
    print("| --- | ---: | ---: |" if before else "| --- | ---: |")
    for n in names:
        was = f" {before.get(n, 0.0):.1f} |" if before else ""
        print(f"| {n} |{was} {after.get(n, 0.0):.1f} |")
    total = round(sum(after.values()), 1)
    print(f"| all | {sum(before.values()):.1f} | {total:.1f} |" if before else f"| all | {total:.1f} |")
    if args.json:
        doc = {"machine": machine(), "total_s": total, "files": after}
        if before:
            doc["before"] = {"total_s": round(sum(before.values()), 1), "files": before}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
