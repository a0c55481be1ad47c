"""Suite 4: a cost model of the sign all-reduce and its alternatives.

    python bench/cost_model.py                    # docs/benchmarks/*.json in, bench/results/cost_model.* out
    python bench/cost_model.py --kernels bench/results/cpu_kernels.json \\
        --collectives bench/results/collectives.json --json bench/results/cost_model.json
    python bench/cost_model.py --quick            # a smaller projection grid

From the measured kernel throughput (suite 2's Google Benchmark JSON) and the
byte formulas of backend/ (checked against suite 1's byte counters), it
predicts the time of one collective of d float32 elements per rank and the
communication of a DDP training step, as

    time = latency + bandwidth + kernels                 (no overlap: an upper bound)
    latency   = alpha * (dependent message steps) + o * (messages of an all-to-all)
    bandwidth = payload bytes per rank / goodput,  goodput = line rate / 8 / wire_overhead
    kernels   = kappa * (bytes each kernel reads or writes / its measured GB/s on one core)

with one core per rank for the kernels (kappa = 1) unless the ranks share
cores (the emulated cluster: kappa = N / cores). It then

  1. validates: predicts every suite-1 case (N <= 8) and prints predicted vs
     measured and the relative error, for an ideal cluster (nominal link, a
     core per rank) and for the emulated one (iperf3 goodput, kappa = N / cores,
     a wait for a core per dependent step where the ranks outnumber the cores);
  2. projects: N 2 .. 4096, d 125M .. 70B, links 10 .. 400 Gbit/s;
  3. predicts the communication of a DDP training step: fp32 buckets vs
     DistributedLion's vote, overlapped with the backward pass;
  4. projects one step's communication onto clusters of nodes of 8 GPUs
     (NVLink inside, 25 .. 400 Gbit/s between, 2 .. 512 nodes, 1B .. 70B
     parameters) with the two-level model of lionbit.estimate: the flat vote,
     the exact hierarchical vote, the node vote, NCCL-style ring and
     hierarchical all-reduces (GPU kernel rates assumed, not measured).

Every term and assumption is spelled out in docs/benchmarks.md, "Suite 4".
Needs only the Python standard library (matplotlib for the plots, optional).
Output: JSON (suite "cost_model", impl, world_size, numel, link, median_s =
predicted seconds, bytes_per_rank, plus measured_s / rel_error on validation
rows; kind "topology": bytes per link instead of per rank), a Markdown file and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs", "benchmarks")   # the committed suite results
sys.path.insert(0, HERE)

import report  # noqa: E402
from collectives import IMPLS, numel_label, parse_numel  # noqa: E402  (no torch at import)
from netns import load_estimate, parse_rate  # noqa: E402  (standard library only)

estimate = load_estimate()

# --- constants of the wire format (signbits/, backend/) -------------------------
# lionbit's wire (chunks, shards, header, tie counts, trits, zero lists): stated once, in
# the package (lionbit.estimate.sign_wire, checked against lionbit._C by the tests).
WIRE = load_estimate()
WORD_BITS = WIRE.WORD_BITS
DEFAULT_CHUNK_ELEMS = 0  # 0: lionbit's default for N (estimate.default_chunk_elems)

# --- defaults of the model (documented in docs/benchmarks.md) ----------------
ALPHA_S = 50e-6        # latency of one dependent message step (datacenter TCP + Gloo)
# The emulated cluster of suite 1 has no link delay, but where its ranks (with their Gloo
# and lionbit threads and the veth softirqs) outnumber its 2 cores, a rank that waits for a
# message waits for a core too. There each dependent step is charged one scheduler slice
# instead of alpha: Linux's default base slice, 0.70 ms * (1 + log2(cores)) since 6.15
# (kernel/sched/fair.c), 1.4 ms on 2 cores. A kernel default, not fitted to the data
# (docs/benchmarks.md, Suite 4).
ALPHA_EMULATED_S = 1.4e-3
MSG_OVERHEAD_S = 5e-6  # software cost of each further message an all-to-all posts at once
WIRE_OVERHEAD = 1.05   # wire bytes / payload bytes for TCP/IPv4 + Ethernet at 1500 MTU
BUCKET_MB = 25         # DDP's default bucket_cap_mb
FLOPS_PER_RANK = 4e14  # effective training FLOP/s of one rank (e.g. ~40 % of an H100's bf16 peak)
TOKENS_PER_RANK = 16384

PROJ_N = [2, 8, 64, 512, 4096]
PROJ_D = {"125M": 125e6, "1.3B": 1.3e9, "7B": 7e9, "70B": 70e9}
PROJ_LINKS = ["10gbit", "25gbit", "100gbit", "400gbit"]
PROJ_IMPLS = ["lionbit_vote", "lionbit_vote_tiefree", "lionbit_avg", "gloo_fp32", "gloo_bf16",
              "allgather_bits", "int8_counts"]
# What-ifs (not built): log-depth all-gathers / all-reduce, and lionbit with 256M-element chunks.
WHATIF_CHUNK = 1 << 28
WHATIF_IMPLS = ["whatif_vote_log", "whatif_fp32_log"]
QUICK_N, QUICK_D, QUICK_LINKS = [8, 512, 4096], ["1.3B", "70B"], ["10gbit", "400gbit"]
# 4. topology (lionbit.estimate): nodes of TOPO_GPUS GPUs, NVLink inside, these rates between.
TOPO_GPUS = 8
TOPO_NODES = [2, 4, 8, 16, 32, 64, 128, 256, 512]
TOPO_LINKS = ["25gbit", "100gbit", "400gbit"]
TOPO_D = {"1B": 1e9, "7B": 7e9, "13B": 13e9, "70B": 70e9}
TOPO_QUICK_NODES, TOPO_QUICK_D = [2, 16, 128, 512], ["7B", "70B"]
TOPO_PLOT_D = "7B"

# Memory traffic (bytes per element) of the torch code the two torch baselines of
# suite 1 run around their collective (bench/collectives.py, worker()):
#   int8_counts: sign(x) r4 w4, i8.copy_ r4 w1, sign(i8) r1 w1, buf.copy_(i8) r1 w4
TORCH_INT8_BYTES = 24.0
#   allgather_bits pack: (x>0) r4 w1, .to(uint8) r1 w1, * weights r1 w1, .sum(1) r1 w1/8, copy r1/8 w1/8
TORCH_BITS_PACK_BYTES = 10.375
#   its count per element: (g >> shifts) r N/8 w N, & 1 r N w N, .to(int16) r N w 2N, .sum(0) r 2N w 2
#   (8.125 N), then 2*ones, -n, sign, .to(float32), copy into out: 28
TORCH_BITS_COUNT_BYTES_PER_RANK = 8.125
TORCH_BITS_COUNT_BYTES = 28.0


# =============================================================================
# inputs
# =============================================================================

@dataclass(frozen=True)
class Kernels(WIRE.CoreRates):
    """One core's kernel throughput (suite 2): the package's CoreRates (pack, unpack, read,
    the vote's a + b N seconds an output element, unpack_trits), and the BM_vote points the
    vote's line was fitted to."""
    vote_points: tuple = ()


def load_kernels(path: str) -> Kernels:
    rates = report.kernel_rates(path)

    def one(prefix: str) -> float:
        for k, v in rates.items():
            if k.startswith(prefix + "/"):
                return v
        raise SystemExit(f"cost_model: {path} has no {prefix} benchmark")

    pts = []  # (N, seconds per output element)
    for k, v in rates.items():
        parts = k.split("/")
        if parts[0] == "BM_vote":
            n_out, n = int(parts[1]), int(parts[2])
            words = (n_out + WORD_BITS - 1) // WORD_BITS
            pts.append((n, n * words * 8 / v / n_out))   # BM_vote reports N planes' bytes
    if not pts:
        raise SystemExit(f"cost_model: {path} has no BM_vote benchmark")
    pts.sort()
    if len(pts) == 1:
        a, b = pts[0][1], 0.0
    else:
        b, a = statistics.linear_regression([p[0] for p in pts], [p[1] for p in pts])
    read = max(v for k, v in rates.items() if k.startswith("BM_read_bw"))  # first and last of the run
    trits = next((v for k, v in rates.items() if k.startswith("BM_unpack_trits/")), 0.0)  # older runs lack it
    return Kernels(pack=one("BM_pack"), unpack=one("BM_unpack"), read=read,
                   vote_a=a, vote_b=b, vote_points=tuple(pts), unpack_trits=trits)


@dataclass
class Link:
    name: str
    goodput: float              # payload bytes/s per rank and direction
    alpha: float = ALPHA_S
    msg_overhead: float = MSG_OVERHEAD_S


def nominal_link(name: str, wire_overhead: float, alpha: float, overhead: float) -> Link:
    return Link(name, parse_rate(name) / 8 / wire_overhead, alpha, overhead)


@dataclass
class Cpu:
    k: Kernels
    kappa: float = 1.0                    # ranks per core (>= 1): multiplies every compute term
    torch_rates: Optional[dict] = None    # fitted bytes/s of the torch baselines' code; None: ideal kernels


# =============================================================================
# the model
# =============================================================================

@functools.lru_cache(maxsize=None)
def suite1_tie_fraction(n: int) -> float:
    """Fraction of elements whose vote ties (sum of signs = 0) at even N for
    suite 1's training-like input: x_i = s + 0.5 e_i, s, e_i ~ N(0, 1), so
    P(x_i > 0 | s) = Phi(2 s) and P(tie) = E_s[C(N, N/2) (p (1 - p))^(N/2)].
    Odd N cannot tie (the input has no exact zeros)."""
    if n % 2:
        return 0.0
    logc = math.lgamma(n + 1) - 2 * math.lgamma(n // 2 + 1)
    steps, lo, hi = 24000, -6.0, 6.0
    h = (hi - lo) / steps
    tot = 0.0
    for i in range(steps + 1):
        s = lo + i * h
        p = 0.5 * (1 + math.erf(math.sqrt(2) * s))
        q = p * (1 - p)
        if q <= 0:
            continue
        w = 0.5 if i in (0, steps) else 1.0
        tot += w * math.exp(-0.5 * s * s + logc + (n // 2) * math.log(q))
    return tot * h / math.sqrt(2 * math.pi)


def torch_traffic(impl: str, n: int, d: int) -> float:
    """Bytes of memory traffic of the torch code a suite-1 baseline runs around its collective."""
    if impl == "int8_counts":
        return TORCH_INT8_BYTES * d
    return (TORCH_BITS_PACK_BYTES + TORCH_BITS_COUNT_BYTES_PER_RANK * n + TORCH_BITS_COUNT_BYTES) * d


def core_rates(cpu: Cpu) -> "WIRE.CoreRates":
    return dataclasses.replace(cpu.k, kappa=cpu.kappa)


def link_rates(link: Link) -> "WIRE.LinkRates":
    return WIRE.LinkRates(goodput=link.goodput, alpha=link.alpha, msg_overhead=link.msg_overhead)


def lionbit_terms(op: str, n: int, d: int, link: Link, cpu: Cpu, tie_fraction: float,
                  chunk_request: int = DEFAULT_CHUNK_ELEMS, log_allgather: bool = False) -> dict:
    """lionbit.all_reduce_sign (op "vote" or "avg") on this machine's measured rates: the
    package's model, lionbit.estimate.sign_allreduce_on_link (its docstring states it)."""
    return WIRE.sign_allreduce_on_link(op, n, d, link_rates(link), core_rates(cpu), tie_fraction, chunk_request,
                                       log_allgather)


def ring_allreduce_terms(n: int, d: int, elem: int, reduce_read: int, link: Link, cpu: Cpu,
                         log_steps: bool = False) -> dict:
    """Gloo's ring all-reduce on this machine's measured rates: lionbit.estimate's
    ring_allreduce_on_link (2(N-1) steps, 2(N-1)/N elem d bytes, the reduction at one core's
    read bandwidth; log_steps: the recursive halving + doubling what-if)."""
    return WIRE.ring_allreduce_on_link(n, d, elem, reduce_read, link_rates(link), core_rates(cpu), log_steps)


# The suite-1 impls predict() models.
MODELLED = ("lionbit_vote", "lionbit_vote_tiefree", "lionbit_avg", "gloo_fp32", "gloo_bf16", "int8_counts",
            "allgather_bits")


def predict(impl: str, n: int, d: int, link: Link, cpu: Cpu, tie_fraction: Optional[float] = None,
            chunk_request: int = DEFAULT_CHUNK_ELEMS) -> dict:
    """Terms of one collective of d float32 elements per rank, for a suite-1 impl name."""
    if impl in ("lionbit_vote", "lionbit_vote_tiefree"):
        f = 0.0 if impl.endswith("tiefree") else (suite1_tie_fraction(n) if tie_fraction is None else tie_fraction)
        return lionbit_terms("vote", n, d, link, cpu, f, chunk_request)
    if impl == "lionbit_avg":
        return lionbit_terms("avg", n, d, link, cpu, 0.0, chunk_request)
    if impl == "gloo_fp32":
        return ring_allreduce_terms(n, d, 4, 8, link, cpu)
    if impl == "gloo_bf16":
        return ring_allreduce_terms(n, d, 2, 4, link, cpu)
    if impl == "int8_counts":
        # An int8 sum of N signs wraps past N = 127: from N = 128 on the counts need int16.
        elem = 1 if n <= 127 else 2
        t = ring_allreduce_terms(n, d, elem, 2 * elem, link, cpu)
        if cpu.torch_rates and impl in cpu.torch_rates:   # suite 1's torch code at its fitted rate
            extra = torch_traffic(impl, n, d) / cpu.torch_rates[impl]
        else:   # ideal: a float->int8 sign pass (r4 w1) and back (r1 w4) at read bandwidth
            extra = 10 * d / cpu.k.read
        return WIRE.terms(t["bytes"], t["latency_s"], t["bandwidth_s"], t["kernel_s"] + cpu.kappa * extra,
                      steps=t["steps"], comm_s=t["latency_s"] + t["bandwidth_s"])
    if impl == "allgather_bits":
        nbytes = (n - 1) * d / 8
        lat = (n - 1) * link.alpha
        if cpu.torch_rates and impl in cpu.torch_rates:
            kern = torch_traffic(impl, n, d) / cpu.torch_rates[impl]
        else:   # ideal: lionbit's kernels, every rank counting all d elements over N planes
            kern = 4 * d / cpu.k.pack + cpu.k.vote_s(d, n) + 4 * d / cpu.k.unpack
        return WIRE.terms(nbytes, lat, nbytes / link.goodput, cpu.kappa * kern, steps=n - 1,
                      comm_s=lat + nbytes / link.goodput)
    raise ValueError(impl)


# =============================================================================
# 1. validation against suite 1
# =============================================================================

def load_collectives(paths: list) -> list:
    """Every suite-1 result with its file's iperf3 checks and core count attached."""
    out = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        cores = doc.get("meta", {}).get("machine", {}).get("cores") or os.cpu_count()
        iperf = {(c["link"], c["world_size"]): (c.get("iperf3") or {}).get("received_bps")
                 for c in doc.get("iperf3", [])}
        for r in doc["results"]:
            r = dict(r)
            r["_file"] = os.path.basename(p)
            r["_cores"] = cores
            r["_iperf3_bps"] = iperf.get((r["link"], r["world_size"]))
            out.append(r)
    return out


def measured_wire_overhead(rows: list) -> Optional[float]:
    """Median wire bytes / payload bytes over the cases of 16M elements and more (TCP/IP +
    Ethernet headers and ACKs; at 1M the fixed per-collective packets weigh more)."""
    v = [r["wire_bytes_per_rank"] / r["bytes_per_rank"] for r in rows
         if r.get("wire_bytes_per_rank") and r["numel"] >= 16 << 20 and r["link"] != "loopback"]
    return statistics.median(v) if v else None


def fit_torch_rates(rows: list) -> dict:
    """The two fitted constants: the throughput (bytes of memory traffic per second) of the
    torch code around the collective of int8_counts and allgather_bits, each from ONE suite-1
    case (the one with the fewest ranks, then the most elements, then the slowest link):
    rate = traffic / (median_s - comm_s) * kappa of that case."""
    rates, cal = {}, {}
    for impl in ("int8_counts", "allgather_bits"):
        cands = [r for r in rows if r["impl"] == impl and r.get("comm_s") and r["link"] != "loopback"]
        if not cands:
            continue
        r = min(cands, key=lambda r: (r["world_size"], -r["numel"], parse_rate(r["link"])))
        n, d = r["world_size"], r["numel"]
        kappa = max(1.0, n / r["_cores"])
        rates[impl] = torch_traffic(impl, n, d) / (r["median_s"] - r["comm_s"]) * kappa
        cal[impl] = {"link": r["link"], "world_size": n, "numel": d, "file": r["_file"],
                     "bytes_per_s": rates[impl]}
    return {"rates": rates, "calibration": cal}


def validate(rows: list, k: Kernels, wire_overhead: float, alpha: float, alpha_emulated: float,
             overhead: float, torch_fit: dict) -> list:
    """Each suite-1 case with a link rate and N <= 8, predicted twice:
    ideal     the nominal line rate / wire overhead, alpha, a core per rank (kappa = 1);
    emulated  the iperf3 goodput measured for that (link, N), kappa = N / cores on every
              compute term, and where the ranks outnumber the cores (N > cores) a wait for a
              core, alpha_emulated, per dependent step instead of alpha."""
    out = []
    for r in rows:
        n, d, impl, link = r["world_size"], r["numel"], r["impl"], r["link"]
        if n > 8 or link == "loopback" or impl not in IMPLS or impl not in MODELLED:
            continue   # the tie rules' variants (suite 1's ties file) have no model of their own
        ideal_link = nominal_link(link, wire_overhead, alpha, overhead)
        ideal = predict(impl, n, d, ideal_link, Cpu(k, 1.0, torch_fit["rates"]))
        ip = r.get("_iperf3_bps")
        kappa = max(1.0, n / r["_cores"])
        emu_link = Link(link, (ip / 8) if ip else ideal_link.goodput,
                        alpha_emulated if n > r["_cores"] else alpha, overhead)
        emu = predict(impl, n, d, emu_link, Cpu(k, kappa, torch_fit["rates"]))
        cal = torch_fit["calibration"].get(impl, {})
        rec = {
            "suite": "cost_model", "kind": "validation", "impl": impl, "world_size": n, "numel": d,
            "link": link, "median_s": emu["time_s"], "bytes_per_rank": emu["bytes"],
            "measured_s": r["median_s"], "rel_error": emu["time_s"] / r["median_s"] - 1,
            "median_s_ideal": ideal["time_s"], "rel_error_ideal": ideal["time_s"] / r["median_s"] - 1,
            "measured_bytes_per_rank": r["bytes_per_rank"],
            "kappa": kappa, "goodput_gbps": emu_link.goodput * 8 / 1e9,
            "terms": {key: emu[key] for key in ("latency_s", "bandwidth_s", "kernel_s")},
            "steps": emu["steps"],
            "calibration_case": bool(cal) and cal["link"] == link and cal["world_size"] == n and cal["numel"] == d,
            "source": r["_file"],
        }
        if r.get("comm_s") is not None and "comm_s" in emu:
            rec["measured_comm_s"] = r["comm_s"]
            rec["predicted_comm_s"] = emu["comm_s"]
            rec["rel_error_comm"] = emu["comm_s"] / r["comm_s"] - 1
        out.append(rec)
    return out


def error_summary(val: list) -> list:
    """Per impl (and all): median and max |relative error|, emulated and ideal cluster."""
    rows = []
    groups = [(impl, [v for v in val if v["impl"] == impl]) for impl in IMPLS]
    groups.append(("all", val))
    for link in dict.fromkeys(v["link"] for v in val):
        groups.append((f"all, {link} only", [v for v in val if v["link"] == link]))
    for name, vs in groups:
        if not vs:
            continue
        e = [abs(v["rel_error"]) for v in vs]
        ei = [abs(v["rel_error_ideal"]) for v in vs]
        signed = [v["rel_error"] for v in vs]
        rows.append({"impl": name, "cases": len(vs),
                     "median_abs_err": statistics.median(e), "max_abs_err": max(e),
                     "median_signed_err": statistics.median(signed),
                     "median_abs_err_ideal": statistics.median(ei), "max_abs_err_ideal": max(ei)})
    return rows


# =============================================================================
# 2. projection and 3. training step
# =============================================================================

def project(k: Kernels, links: list, ns: list, ds: dict, wire_overhead: float, alpha: float,
            overhead: float, tie_fraction: Optional[float], chunk: int) -> list:
    out = []
    cpu = Cpu(k)   # a core per rank, ideal kernels for the baselines
    for link_name in links:
        link = nominal_link(link_name, wire_overhead, alpha, overhead)
        for dn, d in ds.items():
            d = int(d)
            for n in ns:
                f = suite1_tie_fraction(n) if tie_fraction is None else tie_fraction
                for impl in PROJ_IMPLS:
                    t = predict(impl, n, d, link, cpu, f, chunk)
                    out.append(_proj_row("projection", impl, n, d, dn, link_name, t,
                                         tie_fraction=f if impl == "lionbit_vote" else 0.0))
                for impl in WHATIF_IMPLS:
                    out.append(_proj_row("whatif", impl, n, d, dn, link_name, whatif(impl, n, d, link, cpu, f)))
    return out


def whatif(impl: str, n: int, d: int, link: Link, cpu: Cpu, tie_fraction: float) -> dict:
    """Not built, for comparison at large N: lionbit's vote with 256M-element chunks and
    recursive-doubling all-gathers (ceil(log2 N) steps, the same bytes); the fp32 all-reduce
    by recursive halving + doubling (2 ceil(log2 N) steps, the same bytes)."""
    if impl == "whatif_vote_log":
        return lionbit_terms("vote", n, d, link, cpu, tie_fraction, WHATIF_CHUNK, log_allgather=True)
    return ring_allreduce_terms(n, d, 4, 8, link, cpu, log_steps=True)


def crossovers(k: Kernels, links: list, ds: dict, wire_overhead: float, alpha: float, overhead: float,
               tie_fraction: Optional[float], chunk: int) -> list:
    """Per link, over N = 2, 4, .. 4096 at the largest d (d >> the chunk: the ratios hardly
    depend on d): the first N at which the vote (as built, and the what-if) is latency-bound
    (latency > bandwidth + kernels), its kernels / communication at N = 8, and the largest N
    at which it beats the fp32 ring."""
    out, cpu = [], Cpu(k)
    dn, d = max(ds.items(), key=lambda kv: kv[1])
    d = int(d)
    for link_name in links:
        link = nominal_link(link_name, wire_overhead, alpha, overhead)
        row = {"link": link_name, "model": dn, "vote_latency_bound_from_n": None,
               "whatif_latency_bound_from_n": None, "vote_kernels_over_comm_n8": None,
               "vote_beats_fp32_up_to_n": None}
        for n in (2 ** i for i in range(1, 13)):
            f = suite1_tie_fraction(n) if tie_fraction is None else tie_fraction
            v = lionbit_terms("vote", n, d, link, cpu, f, chunk)
            w = whatif("whatif_vote_log", n, d, link, cpu, f)
            for key, t in (("vote_latency_bound_from_n", v), ("whatif_latency_bound_from_n", w)):
                if row[key] is None and t["latency_s"] > t["bandwidth_s"] + t["kernel_s"]:
                    row[key] = n
            if v["time_s"] < ring_allreduce_terms(n, d, 4, 8, link, cpu)["time_s"]:
                row["vote_beats_fp32_up_to_n"] = n
            if n == 8:
                row["vote_kernels_over_comm_n8"] = v["kernel_s"] / (v["latency_s"] + v["bandwidth_s"])
        out.append(row)
    return out


def _proj_row(kind, impl, n, d, dn, link_name, t, **extra) -> dict:
    return {"suite": "cost_model", "kind": kind, "impl": impl, "world_size": n, "numel": d,
            "model": dn, "link": link_name, "median_s": t["time_s"], "bytes_per_rank": t["bytes"],
            "terms": {key: t[key] for key in ("latency_s", "bandwidth_s", "kernel_s")},
            "bound": t["bound"], **({"chunks": t["chunks"]} if "chunks" in t else {}), **extra}


def training(k: Kernels, links: list, ns: list, ds: dict, wire_overhead: float, alpha: float,
             overhead: float, tie_fraction: Optional[float], chunk: int, bucket_mb: float,
             flops: float, tokens: int) -> list:
    """The communication of one DDP step of a P-parameter model and the step time:

    buckets  = ceil(P / (bucket_mb MB of float32)), DDP's bucketing; one collective each
    comm     = sum over buckets of the collective: DDP fp32: Gloo's ring all-reduce (+ its
               reduction); DistributedLion (vote): the sign all-reduce (pack, vote, unpack
               on one core, as in its DDP hook, which packs inside the fused Lion
               direction kernel); and the two what-ifs of project() per bucket
    compute  = 6 P tokens / flops (2 FLOPs per parameter and token forward, 4 backward);
               backward = 2/3 of it, the time DDP hides bucket communication behind
    step     = compute + max(the last bucket's collective, comm - backward)

    The optimizer's own update (momentum, apply) is the same work on both sides: left out."""
    out = []
    cpu = Cpu(k)
    belems = int(bucket_mb * 2 ** 20 / 4)
    for link_name in links:
        link = nominal_link(link_name, wire_overhead, alpha, overhead)
        for dn, p in ds.items():
            p = int(p)
            nb = math.ceil(p / belems)
            last = p - (nb - 1) * belems
            comp = 6 * p * tokens / flops
            bwd = comp * 2 / 3
            for n in ns:
                f = suite1_tie_fraction(n) if tie_fraction is None else tie_fraction
                per = {"ddp_fp32": lambda m: ring_allreduce_terms(n, m, 4, 8, link, cpu),
                       "distributed_lion_vote": lambda m: lionbit_terms("vote", n, m, link, cpu, f, chunk),
                       "ddp_fp32_whatif_log": lambda m: whatif("whatif_fp32_log", n, m, link, cpu, f),
                       "distributed_lion_whatif_log": lambda m: whatif("whatif_vote_log", n, m, link, cpu, f)}
                for impl, fn in per.items():
                    tb, tl = fn(belems), fn(last)
                    comm = (nb - 1) * tb["time_s"] + tl["time_s"]
                    exposed = max(tl["time_s"], comm - bwd)
                    out.append({"suite": "cost_model", "kind": "training", "impl": impl, "world_size": n,
                                "numel": p, "model": dn, "link": link_name, "median_s": comp + exposed,
                                "bytes_per_rank": (nb - 1) * tb["bytes"] + tl["bytes"], "comm_s": comm,
                                "exposed_comm_s": exposed, "compute_s": comp, "backward_s": bwd, "buckets": nb,
                                "terms": {key: (nb - 1) * tb[key] + tl[key]
                                          for key in ("latency_s", "bandwidth_s", "kernel_s")}})
    return out


# =============================================================================
# 4. topology: nodes of GPUs (lionbit.estimate)
# =============================================================================

def topology(nodes: list, links: list, ds: dict, gpus: int = TOPO_GPUS) -> list:
    """One step's communication of d parameters on M nodes of `gpus` GPUs, per method of
    lionbit.estimate (its docstring states every formula and assumption): NVLink inside a
    node, `link` per node between nodes, its assumed GPU kernel rates and latencies."""
    out = []
    for link_name in links:
        for dn, d in ds.items():
            for m in nodes:
                c = estimate.Cluster(nodes=m, gpus_per_node=gpus, inter_bytes_per_s=estimate.parse_rate(link_name))
                es = estimate.estimate_all(d, c)
                best = estimate.recommend(es)
                for e in es:
                    out.append({"suite": "cost_model", "kind": "topology", "impl": e.method, "world_size": c.ranks,
                                "nodes": m, "gpus_per_node": gpus, "numel": int(d), "model": dn, "link": link_name,
                                "median_s": e.time_s, "inter_bytes_per_node": e.inter_bytes_per_node,
                                "intra_bytes_per_gpu": e.intra_bytes_per_gpu,
                                "terms": {"latency_s": e.latency_s, "inter_s": e.inter_s, "intra_s": e.intra_s,
                                          "kernel_s": e.kernel_s},
                                "bound": e.bound, "exact": e.exact, "source": e.source,
                                "fastest_exact": e.method == best.method})
    return out


def topology_payoff(rows: list) -> list:
    """Per (link, d, nodes): the fastest exact vote (flat or exact hierarchical) against the
    fastest all-reduce: how many times less step communication lionbit takes."""
    by = {}
    for r in rows:
        by.setdefault((r["link"], r["model"], r["nodes"]), {})[r["impl"]] = r
    out = []
    for (link, dn, m), rs in by.items():
        vote = min((rs[i] for i in ("flat_vote", "exact_hierarchical")), key=lambda r: r["median_s"])
        allreduce = min((r for i, r in rs.items() if i.startswith(("ring_", "hierarchical_"))),
                        key=lambda r: r["median_s"])
        out.append({"link": link, "model": dn, "nodes": m, "vote": vote["impl"], "vote_s": vote["median_s"],
                    "allreduce": allreduce["impl"], "allreduce_s": allreduce["median_s"],
                    "speedup": allreduce["median_s"] / vote["median_s"]})
    return out


TOPO_SHORT = {"flat_vote": "flat vote", "exact_hierarchical": "exact hier.", "node_vote": "node vote*",
              "ring_fp32": "fp32 ring", "ring_bf16": "bf16 ring", "hierarchical_fp32": "fp32 hier.",
              "hierarchical_bf16": "bf16 hier."}


def topology_markdown(rows: list, assumptions: str) -> str:
    if not rows:
        return ""
    gpus = rows[0]["gpus_per_node"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    L = [f"## Topology: nodes of {gpus} GPUs (lionbit.estimate)\n",
         "One step's communication of d parameters, seconds: NVLink inside a node (450 GB/s per GPU each way), "
         "the link rate per node between nodes (its GPUs share it). Methods, formulas and assumptions: the "
         "docstring of `python/lionbit/estimate.py`; `python -m lionbit.estimate` gives one row. "
         "*node vote: approximate (a majority of node majorities). Fastest exact: of every method but the "
         "node vote.\n",
         f"{assumptions}.\n",
         "| link | d | nodes | N | " + " | ".join(TOPO_SHORT[i] for i in impls) +
         " | fastest exact | inter-node GB per node: flat vote / exact hier. / fp32 ring |",
         "|---|---|---|---|" + "---|" * (len(impls) + 2)]
    by = {(r["link"], r["model"], r["nodes"], r["impl"]): r for r in rows}
    for link in dict.fromkeys(r["link"] for r in rows):
        for dn in dict.fromkeys(r["model"] for r in rows):
            for m in dict.fromkeys(r["nodes"] for r in rows):
                rs = [by[(link, dn, m, i)] for i in impls]
                best = next(r for r in rs if r["fastest_exact"])
                gb = " / ".join(f"{by[(link, dn, m, i)]['inter_bytes_per_node'] / 1e9:,.1f}"
                                for i in ("flat_vote", "exact_hierarchical", "ring_fp32"))
                L.append(f"| {link} | {dn} | {m} | {rs[0]['world_size']} | " +
                         " | ".join(_ms(r["median_s"]) for r in rs) + f" | {TOPO_SHORT[best['impl']]} | {gb} |")
    L.append("")
    pay = topology_payoff(rows)
    nodes = list(dict.fromkeys(p["nodes"] for p in pay))
    L.append("### When lionbit pays off\n")
    L.append("The fastest exact vote (flat or exact hierarchical) against the fastest all-reduce (ring or "
             "hierarchical, fp32 or bf16): all-reduce time / vote time, per number of nodes.\n")
    L.append("| link | d | " + " | ".join(f"{m} nodes" for m in nodes) + " |")
    L.append("|---|---|" + "---|" * len(nodes))
    pby = {(p["link"], p["model"], p["nodes"]): p for p in pay}
    for link in dict.fromkeys(p["link"] for p in pay):
        for dn in dict.fromkeys(p["model"] for p in pay):
            L.append(f"| {link} | {dn} | " + " | ".join(f"{pby[(link, dn, m)]['speedup']:.1f}x" for m in nodes) + " |")
    L.append("")
    return "\n".join(L) + "\n"


def topology_plot(rows: list, png_dir: str, stem: str) -> list:
    """Step communication vs nodes per method at TOPO_PLOT_D, one panel per link rate."""
    if not rows:
        return []
    try:
        import matplotlib  # optional: plots only
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: plots only
    except ImportError:
        return []   # plots() has said so
    dn = TOPO_PLOT_D if any(r["model"] == TOPO_PLOT_D for r in rows) else rows[0]["model"]
    links = list(dict.fromkeys(r["link"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    styles = {"flat_vote": "-", "exact_hierarchical": "-", "node_vote": ":", "ring_fp32": "--", "ring_bf16": "--",
              "hierarchical_fp32": "-.", "hierarchical_bf16": "-."}
    fig, axes = plt.subplots(1, len(links), figsize=(4.4 * len(links), 4), squeeze=False, sharey=True)
    for ax, link in zip(axes[0], links):
        for i, impl in enumerate(impls):
            pts = sorted((r["nodes"], r["median_s"]) for r in rows
                         if r["model"] == dn and r["link"] == link and r["impl"] == impl)
            label = TOPO_SHORT[impl].replace("*", " (approximate)")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, ls=styles.get(impl, "-"),
                    color=f"C{i}", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"nodes ({rows[0]['gpus_per_node']} GPUs each, NVLink inside)")
        ax.set_title(f"d = {dn}, {link} per node", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("modelled s of step communication")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("lionbit.estimate: one step's communication (GPU kernel rates assumed)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(png_dir, f"{stem}_topology.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


# =============================================================================
# output
# =============================================================================

def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.9g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def _ms(s: float) -> str:
    if s >= 100:
        return f"{s:,.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def markdown(meta: dict, val: list, summ: list, proj: list, train: list) -> str:
    L = []
    k = meta["kernels"]
    L.append("## Inputs\n")
    L.append(f"- kernels: `{meta['kernels_file']}` (one core): pack {k['pack_GBps']:.2f} GB/s, unpack "
             f"{k['unpack_GBps']:.2f} GB/s, read {k['read_GBps']:.2f} GB/s; vote "
             f"{k['vote_a_ns']:.4f} + {k['vote_b_ns']:.4f}·N ns per output element "
             f"(least squares over N = {', '.join(str(p[0]) for p in k['vote_points'])})")
    L.append(f"- collectives: {', '.join('`' + c + '`' for c in meta['collectives_files']) or 'none'}")
    L.append(f"- alpha {meta['alpha_s'] * 1e6:g} µs per dependent step, o {meta['msg_overhead_s'] * 1e6:g} µs "
             f"per further all-to-all message, wire/payload {meta['wire_overhead']:.3f}"
             f" (measured median {meta['wire_overhead_measured']:.3f})" if meta.get("wire_overhead_measured")
             else f"- alpha {meta['alpha_s'] * 1e6:g} µs, o {meta['msg_overhead_s'] * 1e6:g} µs, "
                  f"wire/payload {meta['wire_overhead']:.3f}")
    fit = meta.get("torch_fit", {}).get("calibration", {})
    for impl, c in fit.items():
        L.append(f"- fitted: torch code of {impl}: {c['bytes_per_s'] / 1e9:.2f} GB/s of memory traffic "
                 f"(from {c['link']}, N = {c['world_size']}, d = {numel_label(c['numel'])})")
    chunk_txt = (f"{numel_label(meta['chunk_elems'])} elements" if meta['chunk_elems']
                 else "lionbit's default, max(4M, 256K N) elements")
    L.append(f"- chunk: {chunk_txt}; tie fraction: "
             f"{meta['tie_fraction'] if meta['tie_fraction'] is not None else 'suite-1 input model'}\n")

    if val:
        L.append("## Validation: predicted vs measured (suite 1, N ≤ 8)\n")
        L.append("`emulated`: N ranks on the run's cores (kappa = N / cores on the compute terms), the "
                 "iperf3 goodput of that (link, N) as the rate and, where N > cores, "
                 f"{meta['alpha_emulated_s'] * 1e3:g} ms (a scheduler slice) per dependent step; `ideal`: the "
                 "nominal line rate / wire overhead, alpha, one core per rank. Error = predicted / measured − 1. "
                 "(c): the calibration case of a fitted constant. The last column: lionbit's bytes by the "
                 "formulas / its own counters.\n")
        L.append("| link | N | d | impl | measured ms | emulated ms | error | ideal ms | error | "
                 "lat / bw / kern ms (emulated) | bytes model / measured |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for v in sorted(val, key=lambda v: (v["link"] != "1gbit", v["link"], v["world_size"], v["numel"],
                                            IMPLS.index(v["impl"]))):
            t = v["terms"]
            L.append(f"| {v['link']} | {v['world_size']} | {numel_label(v['numel'])} | {v['impl']}"
                     f"{' (c)' if v['calibration_case'] else ''} | {v['measured_s'] * 1e3:,.1f} | "
                     f"{v['median_s'] * 1e3:,.1f} | {_pct(v['rel_error'])} | {v['median_s_ideal'] * 1e3:,.1f} | "
                     f"{_pct(v['rel_error_ideal'])} | {t['latency_s'] * 1e3:.1f} / {t['bandwidth_s'] * 1e3:.1f} / "
                     f"{t['kernel_s'] * 1e3:.1f} | {v['bytes_per_rank'] / v['measured_bytes_per_rank']:.4f} |")
        L.append("")
        L.append("| impl | cases | median abs error (emulated) | max | median signed "
                 "| median abs error (ideal) | max |")
        L.append("|---|---|---|---|---|---|---|")
        for s in summ:
            L.append(f"| {s['impl']} | {s['cases']} | {s['median_abs_err'] * 100:.0f}% | "
                     f"{s['max_abs_err'] * 100:.0f}% | "
                     f"{s['median_signed_err'] * 100:+.0f}% | {s['median_abs_err_ideal'] * 100:.0f}% | "
                     f"{s['max_abs_err_ideal'] * 100:.0f}% |")
        sens = meta.get("alpha_emulated_sensitivity_median_abs_err") or {}
        if sens:
            L.append("\nSensitivity to the emulated cluster's per-step wait (not fitted; used: "
                     f"{meta['alpha_emulated_s'] * 1e6:g} µs), median |error|: " +
                     "; ".join(f"{key}: lionbit rows {v['lionbit'] * 100:.0f}%, all {v['all'] * 100:.0f}%"
                               for key, v in sens.items()))
        comm = [v for v in val if "rel_error_comm" in v]
        if comm:
            L.append("\nThe torch baselines' collective alone (no fitted constant): predicted vs measured `comm_s`:\n")
            L.append("| link | N | d | impl | measured comm ms | predicted ms | error |")
            L.append("|---|---|---|---|---|---|---|")
            for v in comm:
                L.append(f"| {v['link']} | {v['world_size']} | {numel_label(v['numel'])} | {v['impl']} | "
                         f"{v['measured_comm_s'] * 1e3:,.1f} | {v['predicted_comm_s'] * 1e3:,.1f} | "
                         f"{_pct(v['rel_error_comm'])} |")
        L.append("")

    if proj:
        L.append("## Projection: one collective of d float32 elements per rank\n")
        L.append("A core per rank; baselines with ideal kernels (allgather_bits counts with lionbit's vote "
                 "kernel, int8_counts converts at read bandwidth). Bound: the largest of latency (L), "
                 "bandwidth (B), kernels (K) for lionbit_vote. `vote` has the suite-1 input's ties; "
                 "int8 counts are int16 from N = 128. What-ifs (not built): `vote log`, the vote with "
                 "256M-element chunks and log2 N all-gather steps; `fp32 log`, the fp32 all-reduce by "
                 "recursive halving + doubling (2 log2 N steps).\n")
        impls = PROJ_IMPLS + WHATIF_IMPLS
        short = {"lionbit_vote": "vote", "lionbit_vote_tiefree": "vote tie-free", "lionbit_avg": "avg",
                 "gloo_fp32": "fp32 ring", "gloo_bf16": "bf16 ring", "allgather_bits": "allgather bits",
                 "int8_counts": "int8 counts", "whatif_vote_log": "vote log", "whatif_fp32_log": "fp32 log"}
        L.append("| link | d | N | " + " | ".join(short[i] for i in impls) + " | vote bound | fp32 / vote |")
        L.append("|---|---|---|" + "---|" * (len(impls) + 2))
        by = {(r["link"], r["model"], r["world_size"], r["impl"]): r for r in proj}
        for link in dict.fromkeys(r["link"] for r in proj):
            for dn in dict.fromkeys(r["model"] for r in proj):
                for n in dict.fromkeys(r["world_size"] for r in proj):
                    cells = [_ms(by[(link, dn, n, i)]["median_s"]) for i in impls]
                    v = by[(link, dn, n, "lionbit_vote")]
                    f = by[(link, dn, n, "gloo_fp32")]
                    L.append(f"| {link} | {dn} | {n} | " + " | ".join(cells) +
                             f" | {v['bound'][0].upper()} | {f['median_s'] / v['median_s']:.1f}x |")
        L.append("")
    cross = meta.get("crossovers") or []
    if cross:
        L.append(f"## Crossovers (N = 2, 4, .. 4096; d = {cross[0]['model']})\n")
        L.append("| link | vote latency-bound from N | what-if vote latency-bound from N | "
                 "vote kernels / comm at N = 8 | vote faster than fp32 ring up to N |")
        L.append("|---|---|---|---|---|")
        for c in cross:
            L.append(f"| {c['link']} | {c['vote_latency_bound_from_n'] or '—'} | "
                     f"{c['whatif_latency_bound_from_n'] or '> 4096'} | {c['vote_kernels_over_comm_n8']:.1f} | "
                     f"{c['vote_beats_fp32_up_to_n'] or 'never'} |")
        L.append("")
    if train:
        L.append("## Training step: DDP fp32 vs DistributedLion (vote)\n")
        L.append(f"compute = 6·P·{meta['tokens_per_rank']} tokens / {meta['flops_per_rank'] / 1e12:g} TFLOP/s "
                 f"per rank, backward = 2/3 of it; {meta['bucket_mb']:g} MB buckets; step = compute + "
                 f"max(last bucket, comm − backward); the optimizer update (the same on both sides) left out.\n")
        L.append("DL: DistributedLion (vote). What-ifs (not built): the log-depth variants of the projection, "
                 "per bucket.\n")
        L.append("| link | model | N | compute s | DDP comm s | DDP step s | DL comm s | DL step s | "
                 "DDP / DL step | DL bound | what-if DDP comm s | what-if DL comm s |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        by = {(r["link"], r["model"], r["world_size"], r["impl"]): r for r in train}
        for link in dict.fromkeys(r["link"] for r in train):
            for dn in dict.fromkeys(r["model"] for r in train):
                for n in dict.fromkeys(r["world_size"] for r in train):
                    a, b = by[(link, dn, n, "ddp_fp32")], by[(link, dn, n, "distributed_lion_vote")]
                    t = b["terms"]
                    bound = max(t, key=t.get).split("_")[0]
                    wa, wb = by[(link, dn, n, "ddp_fp32_whatif_log")], by[(link, dn, n, "distributed_lion_whatif_log")]
                    L.append(f"| {link} | {dn} | {n} | {a['compute_s']:.2f} | {a['comm_s']:,.2f} | "
                             f"{a['median_s']:,.2f} | {b['comm_s']:,.2f} | {b['median_s']:,.2f} | "
                             f"{a['median_s'] / b['median_s']:.2f}x | {bound} | {wa['comm_s']:,.2f} | "
                             f"{wb['comm_s']:,.2f} |")
        L.append("")
    return "\n".join(L) + "\n"


def plots(val: list, proj: list, png_dir: str, stem: str) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("cost_model: matplotlib missing: no plots (pip install -r tools/requirements-bench.txt)")
        return []
    made = []
    colors = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}
    if val:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), sharey=True)
        for ax, key, title in ((axes[0], "median_s", "emulated cluster (kappa = N/cores, iperf3 rate)"),
                               (axes[1], "median_s_ideal", "ideal cluster (line rate, a core per rank)")):
            for impl in IMPLS:
                pts = [(v["measured_s"], v[key], v["link"]) for v in val if v["impl"] == impl]
                for link, mk in (("1gbit", "o"), ("10gbit", "^")):
                    p = [q for q in pts if q[2] == link]
                    if p:
                        ax.scatter([q[0] * 1e3 for q in p], [q[1] * 1e3 for q in p], marker=mk, s=22,
                                   color=colors[impl], label=f"{impl} ({link})" if ax is axes[0] else None)
            lo = min(min(v["measured_s"], v["median_s"], v["median_s_ideal"]) for v in val) * 1e3 / 1.5
            hi = max(max(v["measured_s"], v["median_s"], v["median_s_ideal"]) for v in val) * 1e3 * 1.5
            ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
            ax.plot([lo, hi], [lo / 2, hi / 2], "k:", lw=0.6)
            ax.plot([lo, hi], [lo * 2, hi * 2], "k:", lw=0.6)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            ax.set_xlabel("measured ms (suite 1)")
            ax.set_title(title, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("predicted ms")
        axes[0].legend(fontsize=6, ncol=2)
        fig.suptitle("cost model vs suite 1 (dotted: factor 2)", fontsize=10)
        fig.tight_layout()
        path = os.path.join(png_dir, f"{stem}_validation.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
    if proj:
        combos = [("125M", "25gbit"), ("7B", "10gbit"), ("7B", "400gbit"), ("70B", "100gbit")]
        combos = [c for c in combos if any(r["model"] == c[0] and r["link"] == c[1] for r in proj)] or \
            [(proj[0]["model"], proj[0]["link"])]
        fig, axes = plt.subplots(1, len(combos), figsize=(4.2 * len(combos), 4), squeeze=False)
        for ax, (dn, link) in zip(axes[0], combos):
            for impl in PROJ_IMPLS + WHATIF_IMPLS:
                pts = sorted((r["world_size"], r["median_s"]) for r in proj
                             if r["model"] == dn and r["link"] == link and r["impl"] == impl)
                style = dict(color=colors.get(impl, "k"))
                if impl in WHATIF_IMPLS:
                    style = dict(ls="--", color=colors["lionbit_vote" if "vote" in impl else "gloo_fp32"])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=impl, **style)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (ranks)")
            ax.set_ylabel("predicted s per collective")
            ax.set_title(f"d = {dn}, {link}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=6)
        fig.tight_layout()
        path = os.path.join(png_dir, f"{stem}_projection.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
        # The vote's three terms vs N: where latency and where the kernels take over.
        links = [lk for lk in ("10gbit", "400gbit") if any(r["link"] == lk for r in proj)] or [proj[0]["link"]]
        dn = "7B" if any(r["model"] == "7B" for r in proj) else proj[0]["model"]
        fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 3.8), squeeze=False, sharey=True)
        for ax, link in zip(axes[0], links):
            rows = sorted((r for r in proj if r["impl"] == "lionbit_vote" and r["model"] == dn and r["link"] == link),
                          key=lambda r: r["world_size"])
            ns = [r["world_size"] for r in rows]
            for key, lab in (("latency_s", "latency (alpha, o)"), ("bandwidth_s", "bandwidth (bytes / rate)"),
                             ("kernel_s", "kernels (pack, vote, unpack)")):
                ax.plot(ns, [r["terms"][key] for r in rows], marker="o", ms=3, label=lab)
            f32 = sorted((r["world_size"], r["median_s"]) for r in proj
                         if r["impl"] == "gloo_fp32" and r["model"] == dn and r["link"] == link)
            ax.plot([p[0] for p in f32], [p[1] for p in f32], "k--", lw=0.8, label="gloo_fp32 total")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (ranks)")
            ax.set_title(f"lionbit_vote terms, d = {dn}, {link}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("seconds")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(png_dir, f"{stem}_terms.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=os.path.relpath(os.path.join(DOCS, "cpu_kernels.json")),
                   help="suite-2 Google Benchmark JSON (default: docs/benchmarks/cpu_kernels.json)")
    p.add_argument("--collectives", nargs="*", default=None,
                   help="suite-1 JSON files to validate against (default: docs/benchmarks/collectives*.json)")
    p.add_argument("--json", default="bench/results/cost_model.json")
    p.add_argument("--md", default=None, help="Markdown output (default: the JSON's name with .md)")
    p.add_argument("--png-dir", default=None, help="where the PNGs go (default: the JSON's folder)")
    p.add_argument("--quick", action="store_true", help=f"projection at N {QUICK_N}, d {QUICK_D}, links {QUICK_LINKS}")
    p.add_argument("--alpha-us", type=float, default=ALPHA_S * 1e6, help="latency per dependent message step")
    p.add_argument("--alpha-emulated-us", type=float, default=ALPHA_EMULATED_S * 1e6,
                   help="latency per dependent step on suite 1's emulated cluster (validation only)")
    p.add_argument("--msg-overhead-us", type=float, default=MSG_OVERHEAD_S * 1e6,
                   help="cost of each further message an all-to-all posts at once")
    p.add_argument("--wire-overhead", type=float, default=None,
                   help=f"wire / payload bytes (default: measured median of the collectives, else {WIRE_OVERHEAD})")
    p.add_argument("--tie-fraction", type=float, default=None,
                   help="fraction of vote ties at even N (default: suite 1's input model, per N)")
    p.add_argument("--chunk-elems", default="auto",
                   help="lionbit's chunk (LIONBIT_CHUNK_ELEMS); auto: its default, max(4M, 256K N)")
    p.add_argument("--links", default=",".join(PROJ_LINKS))
    p.add_argument("--ranks", default=",".join(map(str, PROJ_N)))
    p.add_argument("--bucket-mb", type=float, default=BUCKET_MB)
    p.add_argument("--flops-per-rank", type=float, default=FLOPS_PER_RANK)
    p.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK)
    a = p.parse_args()
    t0 = time.time()

    k = load_kernels(a.kernels)
    if a.collectives is None:
        a.collectives = sorted(os.path.relpath(os.path.join(DOCS, f)) for f in os.listdir(DOCS)
                               if f.startswith("collectives") and f.endswith(".json"))
    rows = load_collectives(a.collectives)
    measured_wo = measured_wire_overhead(rows)
    wo = a.wire_overhead or measured_wo or WIRE_OVERHEAD
    alpha, overhead = a.alpha_us * 1e-6, a.msg_overhead_us * 1e-6
    chunk = DEFAULT_CHUNK_ELEMS if a.chunk_elems == "auto" else parse_numel(a.chunk_elems)
    torch_fit = fit_torch_rates(rows)

    alpha_emu = a.alpha_emulated_us * 1e-6
    val = validate(rows, k, wo, alpha, alpha_emu, overhead, torch_fit)
    summ = error_summary(val) if val else []
    # Sensitivity of the emulated-cluster error to its alpha (not fitted).
    sens = {}
    for us in sorted({50, 500, round(a.alpha_emulated_us), 3000}):
        v2 = validate(rows, k, wo, alpha, us * 1e-6, overhead, torch_fit)
        if v2:
            sens[f"{us}us"] = {impl: statistics.median(abs(v["rel_error"]) for v in v2 if v["impl"] in impls)
                               for impl, impls in (("lionbit", ("lionbit_vote", "lionbit_vote_tiefree", "lionbit_avg")),
                                                   ("all", IMPLS))}

    ns = QUICK_N if a.quick else [int(x) for x in a.ranks.split(",")]
    ds = {dn: PROJ_D[dn] for dn in QUICK_D} if a.quick else PROJ_D
    links = QUICK_LINKS if a.quick else a.links.split(",")
    proj = project(k, links, ns, ds, wo, alpha, overhead, a.tie_fraction, chunk)
    train = training(k, links, [n for n in ns if n >= 8], ds, wo, alpha, overhead, a.tie_fraction, chunk,
                     a.bucket_mb, a.flops_per_rank, a.tokens_per_rank)
    cross = crossovers(k, links, ds, wo, alpha, overhead, a.tie_fraction, chunk)
    topo_d = {dn: TOPO_D[dn] for dn in TOPO_QUICK_D} if a.quick else TOPO_D
    topo = topology(TOPO_QUICK_NODES if a.quick else TOPO_NODES, TOPO_LINKS, topo_d)
    c8 = estimate.Cluster(nodes=2, gpus_per_node=TOPO_GPUS)
    topo_assumptions = estimate.assumptions(c8, estimate.Kernels())

    meta = {
        "command": " ".join(["python"] + sys.argv),
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kernels_file": a.kernels,
        "collectives_files": a.collectives,
        "kernels": {"pack_GBps": k.pack / 1e9, "unpack_GBps": k.unpack / 1e9, "read_GBps": k.read / 1e9,
                    "vote_a_ns": k.vote_a * 1e9, "vote_b_ns": k.vote_b * 1e9,
                    "vote_points": [[n, s * 1e9] for n, s in k.vote_points]},
        "alpha_s": alpha, "alpha_emulated_s": alpha_emu, "msg_overhead_s": overhead, "wire_overhead": wo,
        "wire_overhead_measured": measured_wo, "chunk_elems": chunk, "tie_fraction": a.tie_fraction,
        "suite1_tie_fraction": {str(n): suite1_tie_fraction(n) for n in sorted(set(ns) | {2, 4, 8})},
        "torch_fit": torch_fit, "fitted_constants": sorted(torch_fit["rates"]),
        "alpha_emulated_sensitivity_median_abs_err": sens,
        "bucket_mb": a.bucket_mb, "flops_per_rank": a.flops_per_rank, "tokens_per_rank": a.tokens_per_rank,
        "error_summary": summ,
        "crossovers": cross,
        "topology": {"gpus_per_node": TOPO_GPUS, "intra_bytes_per_s": c8.intra_bytes_per_s,
                     "inter_latency_s": c8.inter_latency_s, "intra_latency_s": c8.intra_latency_s,
                     "message_overhead_s": c8.message_overhead_s,
                     "kernels_bytes_per_s": {"stream": estimate.Kernels().stream_bytes_per_s,
                                             "count": estimate.Kernels().count_bytes_per_s},
                     "assumptions": topo_assumptions, "payoff": topology_payoff(topo)},
        # lionbit's payload: the byte formulas against its own counters (lionbit.stats()).
        "bytes_check_max_rel_diff": max((abs(v["bytes_per_rank"] / v["measured_bytes_per_rank"] - 1)
                                         for v in val if v["impl"].startswith("lionbit")), default=None),
    }
    out_dir = os.path.dirname(os.path.abspath(a.json))
    os.makedirs(out_dir, exist_ok=True)
    with open(a.json, "w") as f:
        # One result a line, floats to 9 significant digits: a file that diffs well.
        f.write('{"meta": ' + json.dumps(_rounded(meta), indent=1) + ',\n "results": [\n')
        f.write(",\n".join(json.dumps(_rounded(r)) for r in val + proj + train + topo) + "\n]}\n")
    md_path = a.md or os.path.splitext(a.json)[0] + ".md"
    md = markdown(meta, val, summ, proj, train) + topology_markdown(topo, topo_assumptions)
    with open(md_path, "w") as f:
        f.write(md)
    png_dir = a.png_dir or os.path.dirname(a.json) or "."
    os.makedirs(png_dir, exist_ok=True)
    pngs = plots(val, proj, png_dir, os.path.splitext(os.path.basename(a.json))[0])
    pngs += topology_plot(topo, png_dir, os.path.splitext(os.path.basename(a.json))[0])

    for v in sorted(val, key=lambda v: (parse_rate(v["link"]), v["world_size"], v["numel"], IMPLS.index(v["impl"]))):
        print(f"  {v['link']:>7} N={v['world_size']} d={numel_label(v['numel']):>4} {v['impl']:<21} measured "
              f"{v['measured_s'] * 1e3:8.1f} ms  emulated {v['median_s'] * 1e3:8.1f} ms {_pct(v['rel_error']):>5}  "
              f"ideal {v['median_s_ideal'] * 1e3:8.1f} ms {_pct(v['rel_error_ideal']):>5}"
              f"{'  (calibration case)' if v['calibration_case'] else ''}")
    for s in summ:
        print(f"cost_model: {s['impl']:<22} {s['cases']:3d} cases  |error| median {s['median_abs_err'] * 100:5.1f}% "
              f"max {s['max_abs_err'] * 100:6.1f}%  (ideal cluster: median {s['median_abs_err_ideal'] * 100:5.1f}% "
              f"max {s['max_abs_err_ideal'] * 100:6.1f}%)")
    if not val:
        print("cost_model: no suite-1 case with a link rate to validate against")
    for p in topology_payoff(topo):
        if p["model"] == TOPO_PLOT_D:
            print(f"  topology {p['link']:>7} d={p['model']} {p['nodes']:3d} nodes x {TOPO_GPUS}: fastest vote "
                  f"{p['vote']:<18} {_ms(p['vote_s']):>9}, fastest all-reduce {p['allreduce']:<17} "
                  f"{_ms(p['allreduce_s']):>9}: {p['speedup']:.1f}x")
    print(f"cost_model: {len(topo)} topology rows ({TOPO_GPUS} GPUs a node, lionbit.estimate from "
          f"{estimate.__file__})")
    print(f"cost_model: {len(val)} validation, {len(proj)} projection, {len(train)} training rows in "
          f"{time.time() - t0:.1f} s: {a.json}, {md_path}" + (", " + ", ".join(pngs) if pngs else ""))


if __name__ == "__main__":
    main()
