"""Markdown tables and PNG plots from the benchmark JSON files.

    python bench/report.py bench/results/collectives.json
    python bench/report.py --kernels bench/results/cpu_kernels.json
    python bench/report.py --training bench/results/training.json
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict


def _mb(b):
    return "n/a" if b is None else f"{b / 1e6:,.3f}"


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None (saying so) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib missing: no plots (pip install -r tools/requirements-bench.txt)")
        return None
    return plt


def _label(d: int) -> str:
    return f"{d >> 20}M" if d % (1 << 20) == 0 else str(d)


def _timeline_table(doc: dict) -> str:
    """lionbit's own timeline of a call (LIONBIT_TRACE, slowest rank's
    medians) against the wire time of its bytes at the iperf3 rate."""
    rate = {(c["link"], c["world_size"]): c["iperf3"]["received_bps"] for c in doc.get("iperf3", [])
            if c.get("iperf3") and c["iperf3"].get("received_bps")}
    rows = [r for r in doc["results"] if r.get("lionbit_timeline_ms")]
    if not rows:
        return ""
    lines = ["", "lionbit's timeline per call (ms, slowest rank, medians; `LIONBIT_TRACE`): pack = the whole "
             "tensor, header = its round incl. waiting for the slowest rank, pipeline = until the last chunk's "
             "phase 2 arrived (earlier chunks' unpack overlapped), tail = after it; wire ms = wire bytes at the "
             "iperf3 rate; link busy = wire ms / pipeline.", "",
             "| link | N | d | impl | pack | header | pipeline | tail | total | wire ms | link busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["link"] != "1gbit", r["link"], r["world_size"], r["numel"])):
        t = r["lionbit_timeline_ms"]
        bps = rate.get((r["link"], r["world_size"]))
        wire_ms = r["wire_bytes_per_rank"] * 8 / bps * 1e3 if bps and r.get("wire_bytes_per_rank") else None
        busy = f"{wire_ms / t['pipeline'] * 100:.0f} %" if wire_ms and t["pipeline"] > 0 else "n/a"
        lines.append(f"| {r['link']} | {r['world_size']} | {_label(r['numel'])} | {r['impl']} | {t['pack']:.1f} | "
                     f"{t['header']:.1f} | {t['pipeline']:.1f} | {t['tail']:.1f} | {t['total']:.1f} | "
                     f"{'n/a' if wire_ms is None else format(wire_ms, '.1f')} | {busy} |")
    return "\n".join(lines) + "\n"


def collectives(path: str) -> str:
    with open(path) as f:
        doc = json.load(f)
    res = doc["results"]
    base = os.path.splitext(path)[0]
    by = defaultdict(dict)
    for r in res:
        by[(r["link"], r["world_size"], r["numel"])][r["impl"]] = r
    lines = ["| link | N | d | impl | median ms | vs gloo_fp32 | vs lionbit_vote | payload MB/rank | wire MB/rank "
             "| payload / 1-bit | wire / 1-bit | fp32-equiv busbw Gbit/s | wire Gbit/s | comm-only ms "
             "| not ranks (run) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(by, key=lambda k: (k[0] != "1gbit", k[0], k[1], k[2])):
        link, n, d = key
        cases = by[key]
        f32 = cases.get("gloo_fp32", {}).get("median_s")
        vote = cases.get("lionbit_vote", {}).get("median_s")
        for impl, r in cases.items():
            t = r["median_s"]
            lines.append(
                f"| {link} | {n} | {_label(d)} | {impl} | {t * 1e3:,.1f} | "
                f"{(f32 / t) if f32 else float('nan'):.1f}x | {(t / vote) if vote else float('nan'):.2f}x | "
                f"{_mb(r['bytes_per_rank'])} | {_mb(r.get('wire_bytes_per_rank'))} | "
                f"{r['payload_over_1bit']:.3f} | "
                f"{'n/a' if r.get('wire_over_1bit') is None else format(r['wire_over_1bit'], '.3f')} | "
                f"{r['busbw_fp32_equiv_gbps']:.2f} | "
                f"{'n/a' if r.get('wire_gbps') is None else format(r['wire_gbps'], '.3f')} | "
                f"{'' if r.get('comm_s') is None else format(r['comm_s'] * 1e3, ',.1f')} | "
                f"{'n/a' if r.get('cpu_other_cores') is None else format(r['cpu_other_cores'], '.2f')} |")
    table = "\n".join(lines) + "\n" + _timeline_table(doc)
    with open(base + ".md", "w") as f:
        f.write(table)
    plt = _pyplot()
    if plt is None:
        print(table)
        return table
    links = sorted({r["link"] for r in res})
    ns = sorted({r["world_size"] for r in res})
    impls = list(dict.fromkeys(r["impl"] for r in res))
    # One figure per link: time vs d, one panel per N.
    for link in links:
        fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 3.8), squeeze=False)
        for ax, n in zip(axes[0], ns):
            for impl in impls:
                pts = sorted((r["numel"], r["median_s"]) for r in res
                             if r["link"] == link and r["world_size"] == n and r["impl"] == impl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("d (elements)")
            ax.set_ylabel("median time (ms)")
            ax.set_title(f"{link}, N = {n}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{base}_time_{link}.png", dpi=90)
        plt.close(fig)
    # Bytes per rank on the wire / payload vs N at the largest d.
    dmax = max(r["numel"] for r in res)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    link0 = links[0]
    w = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        pts = sorted((r["world_size"], r.get("wire_bytes_per_rank") or r["bytes_per_rank"]) for r in res
                     if r["link"] == link0 and r["numel"] == dmax and r["impl"] == impl)
        if pts:
            ax.bar([ns.index(p[0]) + i * w for p in pts], [p[1] / 1e6 for p in pts], width=w, label=impl)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(ns))], [f"N = {n}" for n in ns])
    ax.set_yscale("log")
    ax.set_ylabel("MB per rank on the wire")
    ax.set_title(f"bytes per rank, d = {_label(dmax)} ({link0} interface counters)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{base}_bytes.png", dpi=90)
    plt.close(fig)
    print(table)
    print(f"report: {base}.md, {base}_time_*.png, {base}_bytes.png")
    return table


def kernel_rates(path: str) -> dict:
    """Google Benchmark's JSON -> {run_name: bytes per second}, the median of the
    repetitions (or the single run when there are no aggregates)."""
    with open(path) as f:
        doc = json.load(f)
    rows = [b for b in doc["benchmarks"] if b.get("aggregate_name", "median") == "median"]
    return {b["run_name"]: b["bytes_per_second"] for b in rows}


def kernels(path: str) -> str:
    """Table of Google Benchmark's JSON: GB/s (median of repetitions) and the ratio to read_bw."""
    bw = kernel_rates(path)
    read = max((v for k, v in bw.items() if k.startswith("BM_read_bw")), default=None)
    lines = ["| kernel | GB/s | / read bandwidth of one core |", "|---|---|---|"]
    for name, v in bw.items():
        lines.append(f"| {name.replace('/real_time', '')} | {v / 1e9:.2f} | {v / read:.2f} |")
    table = "\n".join(lines) + "\n"
    base = os.path.splitext(path)[0]
    with open(base + ".md", "w") as f:
        f.write(table)
    print(table)
    return table


def _x(v):
    return "n/a" if v is None else f"{v:.2f}x"


def _ms(s):
    return "n/a" if s is None else f"{s * 1e3:,.1f}"


def training(path: str, md: str | None = None, png: str | None = None) -> str:
    """Suite 3: the table of step times and its split, and stacked bars (compute floor vs exposed comm)."""
    with open(path) as f:
        doc = json.load(f)
    res = doc["results"]
    base = os.path.splitext(path)[0]
    md, png = md or base + ".md", png or base + ".png"
    # --interleave runs: each config's median ratio of step i to the floor's step i.
    by_step = any(r.get("vs_floor_by_step") is not None for r in res)
    lines = ["| impl | link | N | median step ms | mean step ms | fwd+bwd ms | opt ms | exposed comm ms "
             "| comm-alone ms | hidden % | vs floor | " + ("vs floor, step by step | " if by_step else "")
             + "vs fused-Lion floor | vs lion_fp32 | payload MB/rank | wire MB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if by_step else "")]
    links = sorted({r["link"] for r in res}, key=lambda lk: (lk != "1gbit", lk))
    order = list(dict.fromkeys(r["impl"] for r in res))
    for link in links:
        for r in sorted((r for r in res if r["link"] == link), key=lambda r: (r["world_size"], order.index(r["impl"]))):
            h, vf, vl = r.get("hidden_fraction"), r.get("vs_floor"), r.get("speedup_vs_lion_fp32")
            vff = r.get("vs_floor_fused_lion")
            lines.append(
                f"| {r['impl']} | {link} | {r['world_size']} | {_ms(r['median_s'])} | {_ms(r.get('mean_s'))} | "
                f"{_ms(r['fwd_bwd_s'])} | "
                f"{_ms(r['opt_s'])} | {_ms(r.get('exposed_comm_s')) if r['impl'] != 'no_comm' else '(floor)'} | "
                f"{_ms(r.get('comm_alone_s')) if r.get('comm_alone_s') is not None else '-'} | "
                f"{'-' if h is None else format(100 * h, '.0f')} | "
                f"{'n/a' if vf is None else format(vf, '.2f') + 'x'} | "
                + (f"{_x(r.get('vs_floor_by_step'))} | " if by_step else "")
                + f"{'n/a' if vff is None else format(vff, '.2f') + 'x'} | "
                f"{'n/a' if vl is None else format(vl, '.2f') + 'x'} | "
                f"{_mb(r['bytes_per_rank'])} | {_mb(r.get('wire_bytes_per_rank'))} |")
    table = "\n".join(lines) + "\n"
    with open(md, "w") as f:
        f.write(table)
    plt = _pyplot()
    if plt is None:
        print(table)
        return table
    ns = sorted({r["world_size"] for r in res})
    panels = [(lk, n) for lk in links for n in ns]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, (link, n) in zip(axes[0], panels):
        rows = sorted((r for r in res if r["link"] == link and r["world_size"] == n),
                      key=lambda r: order.index(r["impl"]))
        x = range(len(rows))
        step = [r["median_s"] * 1e3 for r in rows]
        floor = [(r.get("floor_s") or r["median_s"]) * 1e3 for r in rows]
        base_ = [min(s, f_) for s, f_ in zip(step, floor)]
        exposed = [max(0.0, s - f_) for s, f_ in zip(step, floor)]
        ax.bar(x, base_, color="#8da0cb", label="compute (no_comm floor)")
        ax.bar(x, exposed, bottom=base_, color="#fc8d62", label="exposed communication")
        for i, r in enumerate(rows):
            h = r.get("hidden_fraction")
            if h is not None:
                ax.text(i, step[i], f"{100 * h:.0f}% hidden", ha="center", va="bottom", fontsize=7)
        ff = next((r.get("floor_fused_lion_s") for r in rows if r.get("floor_fused_lion_s")), None)
        if ff:
            ax.axhline(ff * 1e3, color="k", ls="--", lw=0.8, label="floor with fused Lion (est.)")
        ax.set_xticks(list(x), [r["impl"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{link}, N = {n}")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("median step time (ms)")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"DDP training step, {res[0]['numel'] / 1e6:.1f}M parameters", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    print(table)
    print(f"report: {md}, {png}")
    return table


if __name__ == "__main__":
    if sys.argv[1] == "--kernels":
        kernels(sys.argv[2])
    elif sys.argv[1] == "--training":
        training(sys.argv[2])
    else:
        collectives(sys.argv[1])
