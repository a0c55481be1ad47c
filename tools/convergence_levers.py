#!/usr/bin/env python3
"""The levers experiment's grid (docs/convergence_protocol.md, "The levers
experiment"): every variant on both tasks, at N = 4 and 8 and two global
batch sizes per task, seeds 0-2; one torchrun per (task, N, batch).

    make convergence-levers                        # = python tools/convergence_levers.py
    python tools/convergence_levers.py --dry-run   # the commands, nothing run
    python tools/convergence_levers.py --table-only            # the tables again from the JSON
    python tools/convergence_levers.py --tasks digits --ranks 4 --steps 20 --seeds 1 \\
        --variants vote,avg,lion,adamw --json /tmp/levers.json  # a smoke run

Each invocation runs `env -u LOCAL_WORLD_SIZE OMP_NUM_THREADS=1 torchrun
--standalone --nproc-per-node N examples/convergence_<task>.py --variants ...
--batch B --steps T --seeds 0-2 --json ...`. The single-process baselines
(lion, adamw) do not depend on N: they run once per (task, batch), in the
N = 4 invocation, and the tables show them in both N columns.

Results: docs/benchmarks/convergence_levers.json (rewritten after every
invocation, so an interrupted grid keeps what it finished; --resume skips the
invocations already there) and docs/benchmarks/convergence_levers.md (the
Markdown tables for docs/convergence.md; also printed). Run it with the
venv's Python (the torchrun next to it is used).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The pre-registered grid. Steps are the same at both batch sizes of a task.
TASKS = {
    "digits": dict(script="examples/convergence_digits.py", batches=[64, 256], steps=150,
                   headline="test accuracy %", fmt="{:.2f}"),
    "text": dict(script="examples/convergence_text.py", batches=[16, 64], steps=200,
                 headline="test bits per byte (lower is better)", fmt="{:.3f}"),
}
RANKS = [4, 8]
SEEDS = "0-2"
DISTRIBUTED = ["vote", "vote_alt", "avg", "l1_p4", "l1_p8", "vote_ms10", "vote_ms100"]
SINGLE = ["lion", "adamw"]  # N-independent: once per (task, batch), in the N = min(ranks) invocation

LABELS = {
    "vote": "vote (today)", "vote_alt": "vote, tie_break alternate", "vote_rand": "vote, tie_break random",
    "avg": "avg", "l1_p4": "l1, 4 bits", "l1_p8": "l1, 8 bits", "vote_ms10": "vote, momentum sync k = 10",
    "vote_ms100": "vote, momentum sync k = 100", "vote_nv": "node vote (hierarchy node_vote)",
    "vote_alt_nv": "node vote, tie_break alternate", "lion": "Lion, single process", "adamw": "AdamW, single process",
}


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return ""


def invocations(tasks, ranks, variants, seeds, steps, per_node=None):
    """(task, N, batch, steps, variants) for every torchrun of the grid, in run order."""
    out = []
    for task in tasks:
        t = TASKS[task]
        for batch in t["batches"]:
            for n in ranks:
                names = [v for v in variants if v not in SINGLE or n == min(ranks)]
                if names:
                    out.append(dict(task=task, world_size=n, batch=batch, steps=steps or t["steps"],
                                    variants=names, seeds=seeds, per_node=per_node))
    return out


def command(inv, json_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", str(inv["world_size"]), TASKS[inv["task"]]["script"],
            "--variants", ",".join(inv["variants"]), "--batch", str(inv["batch"]), "--steps", str(inv["steps"]),
            "--seeds", inv["seeds"], "--json", json_path] + (
        ["--per-node", str(inv["per_node"])] if inv.get("per_node") else [])


def same(a, b):
    keys = ("task", "world_size", "batch", "steps", "variants", "seeds", "per_node")
    return all(a.get(k) == b.get(k) for k in keys)


def fmt_bytes(b):
    return f"{b / 1e3:,.1f} kB" if b >= 1e3 else f"{b:,.0f} B"


def tables(doc) -> str:
    """Markdown: per task, the headline metric (mean [min, max] over the seeds)
    and bytes sent per rank per step, per variant, N and batch."""
    runs = [r for r in doc["runs"] if r.get("result")]
    out = []
    for task in dict.fromkeys(r["task"] for r in runs):
        t = TASKS[task]
        mine = [r for r in runs if r["task"] == task]
        ns = sorted({r["world_size"] for r in mine})
        batches = sorted({r["batch"] for r in mine})
        cols = [(n, b) for b in batches for n in ns]
        per_node = mine[0].get("per_node")

        def col(n, b):
            return f"N = {n}" + (f" ({n // per_node} nodes × {per_node})" if per_node else "") + f", batch {b}"

        cell = {}  # (variant, n, batch) -> (summary, result)
        for r in mine:
            for v, rec in r["result"]["variants"].items():
                targets = ns if rec["kind"] == "single process" else [r["world_size"]]
                for n in targets:
                    cell[(v, n, r["batch"])] = (rec["summary"], r["result"])
        variants = list(dict.fromkeys(v for (v, _n, _b) in cell))
        first = mine[0]["result"]
        head = first["headline"]
        seeds = first["seeds"]
        f = t["fmt"]
        which = (f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}"
                 if seeds == list(range(seeds[0], seeds[-1] + 1)) else f"seeds {seeds}")
        out.append(f"### {task}: {t['headline']}, mean [min, max] over {which}\n")
        out.append(f"{first['steps']} steps at every batch; global batch split across the N ranks; "
                   f"{first['setup'].get('model')}.\n")
        out.append("| variant | " + " | ".join(col(n, b) for n, b in cols) + " |")
        out.append("| --- |" + " ---: |" * len(cols))
        for v in variants:
            row = []
            for n, b in cols:
                got = cell.get((v, n, b))
                if got is None:
                    row.append("—")
                    continue
                s = got[0][head]
                row.append(f"{f.format(s['mean'])} [{f.format(s['min'])}, {f.format(s['max'])}]")
            out.append(f"| {LABELS.get(v, v)} | " + " | ".join(row) + " |")
        out.append("")
        out.append(f"### {task}: bytes sent per rank per step (mean over ranks and seeds)\n")
        out.append("| variant | " + " | ".join(col(n, b) for n, b in cols) + " |")
        out.append("| --- |" + " ---: |" * len(cols))
        for v in variants:
            if v in SINGLE:
                continue
            row = []
            for n, b in cols:
                got = cell.get((v, n, b))
                row.append("—" if got is None else fmt_bytes(got[0]["bytes_per_step"]))
            out.append(f"| {LABELS.get(v, v)} | " + " | ".join(row) + " |")
        d = first.get("params")
        if d:
            out.append("| fp32 DDP all-reduce, 2(N−1)/N · 4d (reference) | "
                       + " | ".join(fmt_bytes(2 * (n - 1) / n * 4 * d) for n, _b in cols) + " |")
            out.append("| 1 bit per parameter each way, 2(N−1)/N · d/8 (reference) | "
                       + " | ".join(fmt_bytes(2 * (n - 1) / n * d / 8) for n, _b in cols) + " |")
        out.append("")
        secs = [r["wall_seconds"] for r in mine]
        out.append(f"(torchrun invocations: {len(mine)}, {sum(secs) / 60:.1f} min wall in all; d = {d:,} parameters; "
                   f"the single-process rows run once per batch and appear under both N.)\n")
    return "\n".join(out)


def write(doc, json_path, md_path):
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    md = tables(doc)
    if md_path:
        with open(md_path, "w") as f:
            f.write(md)
    return md


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--ranks", default=",".join(map(str, RANKS)))
    p.add_argument("--variants", default=",".join(DISTRIBUTED + SINGLE))
    p.add_argument("--seeds", default=SEEDS)
    p.add_argument("--steps", type=int, default=None, help="override every task's steps (smoke runs)")
    p.add_argument("--per-node", type=int, default=None,
                   help="the hierarchy variants (vote_nv, vote_alt_nv) see nodes of this many ranks")
    p.add_argument("--json", default=os.path.join(ROOT, "docs", "benchmarks", "convergence_levers.json"))
    p.add_argument("--md", default=None, help="Markdown tables (default: the JSON's name with .md)")
    p.add_argument("--resume", action="store_true", help="skip invocations the JSON already holds")
    p.add_argument("--keep-going", action="store_true", help="go on after an invocation fails")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--table-only", action="store_true", help="only rewrite the tables from the JSON")
    a = p.parse_args()
    md_path = a.md or os.path.splitext(a.json)[0] + ".md"

    if a.table_only:
        with open(a.json) as f:
            doc = json.load(f)
        print(write(doc, a.json, md_path))
        return 0

    tasks = a.tasks.split(",")
    ranks = [int(n) for n in a.ranks.split(",")]
    invs = invocations(tasks, ranks, a.variants.split(","), a.seeds, a.steps, a.per_node)
    if a.dry_run:
        for inv in invs:
            print("env -u LOCAL_WORLD_SIZE OMP_NUM_THREADS=1 " + " ".join(command(inv, "OUT.json")))
        return 0

    doc = dict(meta=dict(git=git_commit(), started=datetime.datetime.now().isoformat(timespec="seconds"),
                         host=platform.node(), cores=os.cpu_count(), python=sys.version.split()[0],
                         argv=sys.argv[1:]), runs=[])
    if a.resume and os.path.exists(a.json):
        with open(a.json) as f:
            doc = json.load(f)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    t_grid = time.perf_counter()
    failed = 0
    for i, inv in enumerate(invs):
        if a.resume and any(same(r, inv) and r.get("returncode") == 0 for r in doc["runs"]):
            print(f"[{i + 1}/{len(invs)}] {inv['task']} N={inv['world_size']} batch {inv['batch']}: done, skipped",
                  flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = command(inv, out)
            load = os.getloadavg()[0]
            print(f"\n[{i + 1}/{len(invs)}] {inv['task']} N={inv['world_size']} batch {inv['batch']} "
                  f"steps {inv['steps']} seeds {inv['seeds']} ({len(inv['variants'])} variants); load {load:.1f}; "
                  f"{(time.perf_counter() - t_grid) / 60:.1f} min so far", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
            wall = time.perf_counter() - t0
            result = None
            if rc == 0:
                with open(out) as f:
                    result = json.load(f)
        doc["runs"] = [r for r in doc["runs"] if not same(r, inv)]
        doc["runs"].append(dict(inv, command="env -u LOCAL_WORLD_SIZE OMP_NUM_THREADS=1 " + " ".join(cmd[:-2]),
                                returncode=rc, wall_seconds=wall, load_before=load, result=result))
        print(f"  -> rc {rc}, {wall:.0f} s", flush=True)
        write(doc, a.json, md_path)
        if rc != 0:
            failed += 1
            if not a.keep_going:
                print(f"invocation failed (rc {rc}); the JSON keeps the rest; --resume --keep-going to go on",
                      file=sys.stderr)
                return 1
    doc["meta"]["wall_seconds"] = time.perf_counter() - t_grid
    print("\n" + write(doc, a.json, md_path))
    walls = [r["wall_seconds"] for r in doc["runs"]]
    print(f"grid: {len(walls)} invocations, {sum(walls) / 60:.1f} min "
          f"(median {statistics.median(walls):.0f} s); {a.json}, {md_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
