#!/usr/bin/env python3
"""When DistributedLion pays on GPUs, on paper: a step's exchange and update projected by
lionbit.estimate on the kernel rates that `make gpu-check` measured.

    python bench/gpu_step_projection.py --gpu-rates docs/benchmarks/gpu_check_h200_5.json

For 1.3B and 7B parameters on 2, 8 and 64 nodes of 8 GPUs (NVLink inside the node; 10, 25,
100 and 400 Gbit/s a node between nodes) it runs lionbit.estimate.step_estimates (the same
model as `python -m lionbit.estimate ... --gpu-rates FILE --step`) and writes, under --out:
gpu_step_projection.json (every method's step, exchange and update), gpu_step_projection.md
(the table of docs/cost-model.md) and gpu_step_projection.png (the other methods' steps over
DistributedLion's; matplotlib, optional). Standard library only
otherwise; seconds to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from netns import load_estimate  # noqa: E402  (standard library only)

estimate = load_estimate()

PARAMS = (1.3e9, 7e9)
NODES = (2, 8, 64)
LINKS = ("10gbit", "25gbit", "100gbit", "400gbit")
COLUMNS = ("distributed_lion", "lion_bf16", "adamw_bf16", "powersgd_adamw", "hsdp_lion", "hsdp_adamw_bf16")


def projection(rates) -> list:
    """One row a (params, nodes, link): every STEP_METHODS step, and the verdicts."""
    rows = []
    for d in PARAMS:
        for link in LINKS:
            for nodes in NODES:
                c = estimate.Cluster(nodes=nodes, inter_bytes_per_s=estimate.parse_rate(link))
                steps = {e.method: e for e in estimate.step_estimates(d, c, rates)}
                rows.append({"params": d, "nodes": nodes, "ranks": c.ranks, "link": link, "steps": steps})
    return rows


# DistributedLion against each other method of its regime: (label, DistributedLion's row, the other's)
VERSUS = (
    ("Lion + bf16 all-reduce / DistributedLion", "distributed_lion", "lion_bf16"),
    ("PowerSGD + AdamW / DistributedLion", "distributed_lion", "powersgd_adamw"),
    ("HSDP + AdamW (bf16) / HSDP + DistributedLion", "hsdp_lion", "hsdp_adamw_bf16"),
)


def ratio(steps: dict, mine: str, other: str) -> float:
    """The other's step over DistributedLion's: > 1 where DistributedLion is faster."""
    return steps[other].time_s / steps[mine].time_s


def table(rows: list) -> str:
    """docs/cost-model.md's table: step ms per method, then the other's step over
    DistributedLion's (> 1: DistributedLion faster)."""
    head = ("| params | link per node | nodes (N) | DL | Lion + bf16 | AdamW + bf16 | PowerSGD + AdamW | HSDP DL "
            "| HSDP AdamW bf16 | Lion / DL | PowerSGD / DL | HSDP AdamW / HSDP DL |")
    out = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        s = r["steps"]
        cells = [estimate.count_label(r["params"]), estimate.rate_label(estimate.parse_rate(r["link"])),
                 f"{r['nodes']} ({r['ranks']})", *(f"{s[m].time_s * 1e3:,.0f}" for m in COLUMNS),
                 *(f"{ratio(s, mine, other):.2f}x" for _, mine, other in VERSUS)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary(rows: list, rates) -> str:
    """One line: each comparison's range over the grid, the other's step over DistributedLion's
    (> 1: DistributedLion faster); the figure make gpu-check shows."""
    parts = []
    for label, mine, other in VERSUS:
        r = [ratio(row["steps"], mine, other) for row in rows]
        parts.append(f"{label} {min(r):.2f}-{max(r):.2f}x")
    return f"on {rates.device}'s kernels, {len(rows)} cases: " + "; ".join(parts)


def plot(rows: list, rates, path: str) -> bool:
    try:
        import matplotlib  # optional: the plot only
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print("gpu_step_projection: matplotlib missing: no plot (pip install -r tools/requirements-bench.txt)")
        return False
    gbits = [estimate.parse_rate(link) * 8 / 1e9 for link in LINKS]
    styles = ("-", "--", ":")
    fig, axes = plt.subplots(1, len(PARAMS), figsize=(10, 4.8), sharey=True)
    for ax, d in zip(axes, PARAMS):
        for i, (_, mine, other) in enumerate(VERSUS):
            for nodes, ls in zip(NODES, styles):
                pts = [ratio(r["steps"], mine, other) for r in rows if r["params"] == d and r["nodes"] == nodes]
                ax.plot(gbits, pts, marker="o", ms=3, ls=ls, color=f"C{i}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(gbits, [f"{g:g}" for g in gbits])
        ax.set_xlabel("Gbit/s a node between nodes (8 GPUs a node, NVLink inside)")
        ax.set_title(f"{estimate.count_label(d)} parameters", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("the other's step / DistributedLion's (> 1: lionbit faster)", fontsize=8)
    handles = [Line2D([], [], color=f"C{i}", label=label) for i, (label, _, _) in enumerate(VERSUS)]
    handles += [Line2D([], [], color="grey", ls=ls, label=f"{nodes} nodes") for nodes, ls in zip(NODES, styles)]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7)
    fig.suptitle(f"A step's exchange + update on {rates.device}'s measured kernels (lionbit.estimate)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu-rates", required=True, type=estimate.arg_type(estimate.gpu_rates),
                   help="a make gpu-check JSON, e.g. docs/benchmarks/gpu_check_h200_5.json")
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "bench", "results"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rows = projection(a.gpu_rates)
    stem = os.path.join(a.out, "gpu_step_projection")
    with open(stem + ".json", "w") as f:
        doc = {"gpu_rates": dataclasses.asdict(a.gpu_rates),
               "rows": [r | {"steps": [dataclasses.asdict(e) for e in r["steps"].values()]} for r in rows]}
        json.dump(doc, f, indent=1)
    text = table(rows)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    if plot(rows, a.gpu_rates, stem + ".png"):
        print(f"gpu_step_projection: {stem}.png")
    print(summary(rows, a.gpu_rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
