"""Where a profiled GPU step waited: the device's idle gaps and what the host was doing in them.

Reads a Chrome trace of torch.profiler (gzipped or not; `bench/gpu_train_step.py --trace-dir`
writes one a kind, `make gpu-check` bundles them in logs.tgz under traces/) and prints:

  * the step's span, the device's busy ms (the union of kernels, copies and memsets) and
    idle ms within the span;
  * the largest idle gaps, each with the host operations that overlap it most (by name and
    thread: a gap under a long `lionbit::issue` on lionbit's worker thread, or under
    `cudaStreamSynchronize` on the main thread, says who made the device wait);
  * the host's synchronising CUDA calls (stream / event / device synchronise, blocking copies)
    with their count and ms.

A trace without device events (a CPU run) has no gaps: the totals say so.

    python tools/trace_summary.py TRACE[.json.gz] [--gaps 5] [--min-gap-ms 0.2] [--json OUT]
"""

import argparse
import collections
import gzip
import json
import os
import shutil
import sys

#: The trace's categories of device work (torch.profiler's Chrome export).
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Host events a gap is explained by: operators, CUDA runtime / driver calls, record_function ranges.
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")
#: Runtime calls that make the host wait for the device.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaStreamWaitEvent_blocking")


def write_gz(prof, path: str) -> None:
    """Writes a torch.profiler profile as a gzipped Chrome trace at ``path``
    (ending in .gz), the form this tool and `make gpu-check`'s bundle read."""
    plain = path[: -len(".gz")] if path.endswith(".gz") else path
    os.makedirs(os.path.dirname(os.path.abspath(plain)), exist_ok=True)
    prof.export_chrome_trace(plain)
    with open(plain, "rb") as raw, gzip.open(plain + ".gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    os.remove(plain)


def _events(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def merged(ranges) -> list:
    """(start, end) ranges sorted and merged where they overlap: the time they cover, once."""
    merged = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def summarize(events, gaps: int = 5, min_gap_ms: float = 0.2) -> dict:
    """The summary of a trace's complete events (dicts with cat, name, tid, ts, dur in us)."""
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    timed = device + host
    out = {"device_events": len(device), "host_events": len(host)}
    if not timed:
        return {**out, "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": [], "syncs": {}}
    start = min(e["ts"] for e in timed)
    end = max(e["ts"] + e["dur"] for e in timed)
    busy = merged((e["ts"], e["ts"] + e["dur"]) for e in device)
    out["span_ms"] = (end - start) / 1e3
    out["busy_ms"] = sum(b - a for a, b in busy) / 1e3
    idle, at = [], start
    for a, b in busy:
        if a > at:
            idle.append((at, a))
        at = b
    if device and end > at:
        idle.append((at, end))
    out["idle_ms"] = sum(b - a for a, b in idle) / 1e3 if device else 0.0
    largest = sorted((g for g in idle if g[1] - g[0] >= min_gap_ms * 1e3), key=lambda g: g[0] - g[1])[:gaps]
    out["gaps"] = []
    for a, b in sorted(largest):
        overlap = collections.Counter()
        for e in host:
            lo, hi = max(a, e["ts"]), min(b, e["ts"] + e["dur"])
            if hi > lo:
                overlap[(e["name"], e.get("tid"))] += hi - lo
        out["gaps"].append({
            "at_ms": (a - start) / 1e3, "ms": (b - a) / 1e3,
            "host": [{"name": n, "tid": t, "ms": v / 1e3} for (n, t), v in overlap.most_common(5)],
        })
    syncs = collections.defaultdict(lambda: [0, 0.0])
    for e in host:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"].startswith(SYNC_CALLS):
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e["dur"] / 1e3
    out["syncs"] = {name: {"calls": n, "ms": ms} for name, (n, ms) in sorted(syncs.items())}
    return out


def describe(s: dict) -> str:
    lines = [f"span {s['span_ms']:.2f} ms: device busy {s['busy_ms']:.2f} ms, idle {s['idle_ms']:.2f} ms "
             f"({s['device_events']} device events, {s['host_events']} host events)"]
    if not s["device_events"]:
        lines.append("no device events: a CPU trace has no gaps to explain")
    for g in s["gaps"]:
        lines.append(f"gap of {g['ms']:.2f} ms at {g['at_ms']:.2f} ms; the host meanwhile:")
        lines += [f"    {h['ms']:8.2f} ms  {h['name']} (thread {h['tid']})" for h in g["host"]]
    for name, v in s["syncs"].items():
        lines.append(f"sync {name}: {v['calls']} calls, {v['ms']:.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="+", help="Chrome trace files (.json or .json.gz)")
    ap.add_argument("--gaps", type=int, default=5, help="the largest idle gaps to explain (default 5)")
    ap.add_argument("--min-gap-ms", type=float, default=0.2, help="ignore gaps shorter than this (default 0.2)")
    ap.add_argument("--json", help="write the summaries here, by file")
    args = ap.parse_args(argv)
    out = {}
    for path in args.trace:
        out[path] = summarize(_events(path), args.gaps, args.min_gap_ms)
        print(f"== {path}\n{describe(out[path])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
