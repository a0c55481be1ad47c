#!/usr/bin/env python3
"""Suite 5: time to quality where the link matters. A ~10M-parameter causal
transformer LM on the Python standard library's sources (examples/lm_stdlib.py:
local byte-level BPE, 8,192 tokens) trained under DDP until its validation
loss reaches a target fixed in advance, for every method on its own tuned
learning rate and weight decay. The protocol, fixed before the final runs:
docs/convergence_protocol.md ("Time to quality").

    adamw_fp32        AdamW, DDP's fp32 gradient all-reduce
    adamw_bf16        AdamW, DDP's bf16 compression hook
    adamw_powersgd4   AdamW, torch's PowerSGD hook, rank 4 (the first 10 steps uncompressed; one
                      DDP bucket: with several, the hook's collectives cross on Gloo and it aborts)
    adamw_powersgd16  AdamW, PowerSGD rank 16
    lion_fp32         Lion (torch ops), DDP's fp32 all-reduce
    lion_bf16         Lion, DDP's bf16 compression hook
    distlion_vote     DistributedLion, 1-bit vote (attach(ddp))
    distlion_alt      DistributedLion, tie_break="alternate"
    distlion_l1p4     DistributedLion, Lion Cub's L1 aggregation, 4 bits

Global batch GLOBAL_BATCH windows of CTX + 1 tokens, split over the ranks; the
same schedule for every method (linear warm-up 5 %, cosine to 0 over STEPS).
The phases, each writing bench/results/time_to_target/<phase>.json:

    tune     each method's grid (GRIDS: 2 learning rates x 2 weight decays), N = 2, loopback,
             TUNE_STEPS steps, seed 0: the final validation loss picks the configuration
    target   adamw_fp32 (tuned) at N = 2, loopback, seeds 0-2, the whole schedule: the
             target is its mean validation loss at STEPS / 2, rounded up to 0.01
    link     per N (link-n2.json, link-n4.json): every method on 1 Gbit/s emulated links (root:
             namespaces), the first seed, to the target: end to end and seconds per step; plus
             "floor" (no communication)
    steps    per N (steps-n2.json, ...): every method, loopback, the other seeds, to the target.
             Steps to target over seeds 0-2 also take the link phase's run of seed 0 (the
             arithmetic does not depend on the link: bitwise the same curve) and, at N = 2,
             adamw_fp32's runs of phase target (the same jobs)
    levers   only when asked (--only levers): the vote's (and Lion's) tuned run with one change
             each (LEVERS), N = 2, loopback, seeds 0-2, to the target (issue 30, item 6)

    python bench/time_to_target.py                 # every phase not yet done (--redo PHASE to rerun one)
    python bench/time_to_target.py --quick         # the suite at a tenth of the scale (no levers), < 10 min
    python bench/time_to_target.py --only levers   # one phase (here: the levers, after tune and target)
    python bench/time_to_target.py --summary       # the table and the plot from the phases' JSON

Seconds to target = steps to target (mean over seeds) x seconds
per step on the link (phase "link"); the link phase's own end-to-end figure
says how far that product is from a real run. Results: bench/results/time_to_target/
summary.md, curves.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from collectives import choose_mode, gather_rows, launch, new_meta, run_cases, tx_bytes  # noqa: E402

GLOBAL_BATCH = 4
CTX = 64
STEPS = 400
TUNE_STEPS = 100
EVAL_EVERY = 20
EVAL_WINDOWS = 32
SEEDS = "0-2"
RANKS = "2,4"
POWERSGD_START = 10
METHODS = ["adamw_fp32", "adamw_bf16", "adamw_powersgd4", "adamw_powersgd16", "lion_fp32", "lion_bf16",
           "distlion_vote", "distlion_alt", "distlion_l1p4"]
DISTLION = {"distlion_vote": {}, "distlion_alt": dict(tie_break="alternate"),
            "distlion_l1p4": dict(aggregation="l1", bits=4)}
# Grids of the same size for every method: 2 learning rates x 2 weight decays;
# Lion's rates 3-10x under AdamW's (the Lion paper), its decays 10x over. These are
# the second run's grids (docs/convergence_protocol.md): the first run, AdamW lr
# {1e-3, 3e-3} and Lion lr {1e-4, 3e-4}, picked the top rate of every method. The
# third run's Lion betas: a momentum memory of 10 steps, not 100 (the pilot in the
# protocol: with 0.99, a quarter of the schedule, Lion stalled).
GRIDS = {"adamw": dict(lr=[3e-3, 1e-2], weight_decay=[0.0, 0.1], betas=(0.9, 0.95)),
         "lion": dict(lr=[3e-4, 1e-3], weight_decay=[0.1, 1.0], betas=(0.9, 0.9))}
# Issue 30's item 6, the levers that might close a gap between the vote and Lion
# (docs/convergence_protocol.md, "the levers, and the advice"): each runs like a method of
# the "steps" phase (N = 2, loopback, seeds 0-2, to the target) with one change to
# its base method's tuned run: "lr_scale" multiplies the tuned lr, "kwargs" go to
# DistributedLion, "batch" replaces the global batch (same steps and schedule).
LEVERS = {
    "vote_lr_x2": dict(base="distlion_vote", lr_scale=2.0),
    "vote_momentum_sync10": dict(base="distlion_vote", kwargs=dict(momentum_sync=10)),
    "vote_batch8": dict(base="distlion_vote", batch=8),
    "lion_fp32_batch8": dict(base="lion_fp32", batch=8),
}
TINY = dict(d_model=32, layers=1, heads=2, ffn=64)  # --tiny: a test's model and corpus
TINY_CORPUS_FILES = 40
QUICK = dict(steps=50, tune_steps=20, eval_every=10, seeds="0", ranks="2", methods=METHODS)


def family(method: str) -> str:
    return "adamw" if method.startswith("adamw") else "lion"


def grid(method: str) -> list:
    g = GRIDS[family(method)]
    return [dict(lr=lr, weight_decay=wd, betas=g["betas"]) for lr in g["lr"] for wd in g["weight_decay"]]


def make(method: str, hp: dict, seed: int, steps: int, model: dict | None = None, extra: dict | None = None):
    """(model, ddp, optimizer, scheduler) of one run; `extra`: more DistributedLion options."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import convergence_digits as cd
    import lionbit
    import lm_stdlib as lm
    from training import make_lion

    net = lm.model(seed, dict(lm.MODEL, ctx=CTX, **(model or {})))
    # torch's PowerSGD hook issues its collectives from future callbacks; with several
    # buckets on Gloo they reach the ranks in different orders and Gloo aborts (plain Gloo
    # too: "Received data size doesn't match expected size"). One bucket for PowerSGD.
    ddp = DDP(net, bucket_cap_mb=64 if "powersgd" in method else 25)
    if method.startswith("adamw") or method == "floor":
        opt = torch.optim.AdamW(ddp.parameters(), **hp)
    elif method.startswith("lion"):
        opt = make_lion(ddp.parameters(), **hp)
    else:
        opt = lionbit.DistributedLion(ddp.parameters(), **hp, **DISTLION[method], **(extra or {}))
        opt.attach(ddp)
    if method.endswith("_bf16"):
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif "powersgd" in method:
        rank = int(method.rsplit("powersgd", 1)[1])
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=POWERSGD_START, random_seed=seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cd.lr_factor(steps))
    return net, ddp, opt, sched


def run_one(job: dict, data: dict, rank: int, n: int) -> dict:
    """One run: the schedule's steps (or until the target), evaluations every
    eval_every steps (excluded from the time); the same numbers on every rank."""
    import torch
    import torch.distributed as dist

    import lm_stdlib as lm
    from collectives import busy_seconds

    method, seed, steps, target = job["method"], job["seed"], job["steps"], job.get("target")
    train = data["arrays"]["train"]
    evals = lm.eval_windows(data["arrays"]["val"], EVAL_WINDOWS, CTX)
    net, ddp, opt, sched = make(method, job["hp"], seed, steps, job.get("model"), job.get("extra"))
    starts = lm.batches(train, seed, steps, job.get("batch", GLOBAL_BATCH), CTX)
    span = torch.arange(CTX + 1)
    wire = lambda: tx_bytes(os.environ.get("LIONBIT_BENCH_IF", ""))
    curve, train_s, sent, reached, other, irq = [], 0.0, 0, None, 0.0, 0.0
    only_local = method == "floor"
    for first in range(0, steps, job["eval_every"]):
        dist.barrier()
        w0, t0, c0, (b0, _, i0) = wire(), time.perf_counter(), time.process_time(), busy_seconds()
        for s in starts[first: first + job["eval_every"]]:
            local = s.view(n, -1)[rank]
            opt.zero_grad()
            if only_local:  # no communication at all: the floor
                with ddp.no_sync():
                    lm.loss_of(ddp, train[local[:, None] + span]).backward()
            else:
                lm.loss_of(ddp, train[local[:, None] + span]).backward()
            opt.step()
            sched.step()
        b1, _, i1 = busy_seconds()
        dt, dw, dc = time.perf_counter() - t0, wire() - w0, time.process_time() - c0
        row = gather_rows(torch.tensor([dt, float(max(dw, 0)), dc, b1 - b0, i1 - i0], dtype=torch.float64))
        train_s += row[:, 0].max().item()
        sent += int(row[:, 1].max().item())
        # Cores busy with anything but the ranks during these steps: the machine's busy
        # seconds (read on rank 0) less every rank's own CPU seconds, split into interrupt
        # time (irq + softirq: the emulated links' veth and tbf work on the ranks' packets,
        # charged to no process) and the rest (other processes: what "a quiet machine" is about).
        irq += row[0, 4].item()
        other += max(0.0, row[0, 3].item() - row[0, 4].item() - row[:, 2].sum().item())
        done = min(first + job["eval_every"], steps)
        ddp.eval()
        val = lm.evaluate(ddp, evals, rank, n)
        ddp.train()
        curve.append((done, train_s, sent, val))
        if not math.isfinite(val):
            break
        if target is not None and reached is None and val <= target:
            reached = dict(steps=done, seconds=train_s, bytes=sent, val_loss=val)
            break
    last = curve[-1][0]
    return dict(job, reached=reached, curve=curve, steps_run=last, seconds_per_step=train_s / last,
                not_ranks_cores=other / max(train_s, 1e-9), interrupt_cores=irq / max(train_s, 1e-9),
                final_val_loss=curve[-1][3], world_size=n)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import lm_stdlib as lm

    torch.set_num_threads(1)
    dist.init_process_group("lionbit")
    rank, n = dist.get_rank(), dist.get_world_size()
    with open(args.jobs) as f:
        jobs = json.load(f)
    data = lm.build(verbose=False, limit=jobs[0].get("corpus_files"))
    results = []
    for job in jobs:
        rec = run_one(job, data, rank, n)
        rec["link"] = args.link
        results.append(rec)
        if rank == 0:
            r = rec["reached"]
            got = (f"target at step {r['steps']}, {r['seconds']:.1f} s, {r['bytes'] / 1e6:.1f} MB"
                   if r else f"{rec['steps_run']} steps, val {rec['final_val_loss']:.3f}")
            print(f"  {args.link} N={n} {job.get('lever', job['method']):<16} {job['hp']} seed {job['seed']}: {got}; "
                  f"{rec['seconds_per_step'] * 1e3:.0f} ms/step, not ranks {rec['not_ranks_cores']:.2f}, "
                  f"link irq {rec['interrupt_cores']:.2f}", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def parse_seeds(text: str) -> list:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def cut_at(run: dict, target: float) -> dict:
    """A whole-schedule run as if it had stopped at the target, as phase steps' runs do."""
    curve = []
    for point in run["curve"]:
        curve.append(point)
        if point[3] <= target:
            break
    done, seconds, sent, val = curve[-1]
    reached = dict(steps=done, seconds=seconds, bytes=sent, val_loss=val) if val <= target else None
    return dict(run, target=target, reached=reached, curve=curve, steps_run=done, seconds_per_step=seconds / done,
                final_val_loss=val)


def round_up(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


class Suite:
    def __init__(self, a):
        self.a = a
        self.dir = a.dir
        os.makedirs(self.dir, exist_ok=True)

    def path(self, phase: str) -> str:
        return os.path.join(self.dir, f"{phase}.json")

    def done(self, phase: str) -> bool:
        """Nothing to run for this phase: its JSON is there (and no --redo), or --only leaves it out."""
        if self.a.only and phase not in self.a.only.split(","):
            return True
        return os.path.exists(self.path(phase)) and phase not in self.a.redo.split(",")

    def load(self, phase: str) -> dict:
        with open(self.path(phase)) as f:
            return json.load(f)

    def run(self, phase: str, jobs: list, ranks: list, links: list, loopback: bool) -> list:
        use_ns = choose_mode(f"time_to_target {phase}", loopback)
        meta = dict(new_meta(use_ns), phase=phase, global_batch=GLOBAL_BATCH, ctx=CTX)
        jobs_path = self.path(phase) + ".jobs"
        with open(jobs_path, "w") as f:
            json.dump(jobs, f)

        def one(cluster, n, link, tmp):
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "--link", link, "--jobs", jobs_path,
                    "--out", tmp]
            return launch(cluster, n, argv, tmp, self.a.timeout)

        shown = links if use_ns else ["loopback"]
        print(f"time_to_target: phase {phase}: {len(jobs)} runs at N {ranks}, links {shown}", flush=True)
        results = run_cases(f"time_to_target {phase}", use_ns, links, ranks, self.path(phase), meta, one)
        os.remove(jobs_path)
        return results

    def tuned(self) -> dict:
        best = {}
        for r in self.load("tune")["results"]:
            m = r["method"]
            if m not in best or r["final_val_loss"] < best[m]["final_val_loss"]:
                best[m] = r
        return {m: r["hp"] for m, r in best.items()}

    def all(self):
        a = self.a
        methods = a.methods.split(",")
        seeds, ranks = parse_seeds(a.seeds), [int(v) for v in a.ranks.split(",")]
        base = dict(eval_every=a.eval_every)
        if a.tiny:
            base.update(model=TINY, corpus_files=TINY_CORPUS_FILES)
        if not self.done("tune"):
            jobs = [dict(base, method=m, hp=hp, seed=0, steps=a.tune_steps) for m in methods for hp in grid(m)]
            self.run("tune", jobs, [2], ["loopback"], True)
        hp = self.tuned()
        if not self.done("target"):
            jobs = [dict(base, method="adamw_fp32", hp=hp["adamw_fp32"], seed=s, steps=a.steps) for s in seeds]
            self.run("target", jobs, [2], ["loopback"], True)
        target = self.target()
        for n in ranks:  # files per N: N = 4 can follow N = 2 in a later run
            if not self.done(f"link-n{n}"):
                jobs = [dict(base, method=m, hp=hp[m], seed=seeds[0], steps=a.steps, target=target) for m in methods]
                jobs.append(dict(base, method="floor", hp=hp["adamw_fp32"], seed=seeds[0], steps=2 * a.eval_every))
                self.run(f"link-n{n}", jobs, [n], a.links.split(","), a.loopback)
            # The first seed's steps come from the link phase and AdamW + fp32's at N = 2 from
            # the target phase: the same runs (steps_results), so they are not run again.
            jobs = [dict(base, method=m, hp=hp[m], seed=s, steps=a.steps, target=target)
                    for m in methods if not (n == 2 and m == "adamw_fp32") for s in seeds[1:]]
            if jobs and not self.done(f"steps-n{n}"):
                self.run(f"steps-n{n}", jobs, [n], ["loopback"], True)
        if not self.done("levers") and "levers" in a.only.split(","):  # item 6's levers: when asked
            self.run_levers(base, hp, seeds, target)
        print(self.summary())

    def run_levers(self, base: dict, hp: dict, seeds: list, target: float) -> None:
        """The levers phase (LEVERS): N = 2, loopback, every seed, to the target."""
        jobs = []
        for name, lever in LEVERS.items():
            if lever["base"] not in hp:  # --methods left its base out
                continue
            tuned = hp[lever["base"]]
            scaled = dict(tuned, lr=tuned["lr"] * lever.get("lr_scale", 1.0))
            jobs += [dict(base, method=lever["base"], lever=name, hp=scaled,
                          extra=lever.get("kwargs", {}), batch=lever.get("batch", GLOBAL_BATCH), seed=s,
                          steps=self.a.steps, target=target) for s in seeds]
        self.run("levers", jobs, [2], ["loopback"], True)

    def levers_table(self) -> str:
        """Steps to target of each lever beside its base method's (phase steps-n2)."""
        if not os.path.exists(self.path("levers")):
            return ""
        by = {}
        for r in self.load("levers")["results"] + [r for r in self.steps_results() if r["world_size"] == 2]:
            by.setdefault(r.get("lever", r["method"]), []).append(r)

        def cell(rs):
            ok = [r["reached"]["steps"] for r in rs if r["reached"]]
            rng = f"{statistics.fmean(ok):.0f} [{min(ok)}, {max(ok)}]" if ok else "-"
            finals = statistics.fmean(r["final_val_loss"] for r in rs)
            return f"{len(ok)}/{len(rs)} | {rng} | {finals:.3f}"

        lines = ["", "Levers (N = 2, loopback; item 6 of issue 30): steps to target, mean [min, max] over the seeds "
                 "that reached it; the last validation loss each run saw, mean over seeds.", "",
                 "| run | change | lr, wd | global batch | reached | steps to target | last val loss |",
                 "|---|---|---|---|---|---|---|"]
        names = [m for m in METHODS if m in by and (m in DISTLION or m.startswith("lion"))] + list(LEVERS)
        for name in names:
            rs = by.get(name)
            if not rs:
                continue
            lever = LEVERS.get(name)
            change = "-" if lever is None else ", ".join(f"{k} {v}" for k, v in lever.items() if k != "base")
            hp = rs[0]["hp"]
            lines.append(f"| {name} | {change} | {hp['lr']:g}, {hp['weight_decay']:g} | "
                         f"{rs[0].get('batch', GLOBAL_BATCH)} | {cell(rs)} |")
        return "\n".join(lines) + "\n"

    def phase_results(self, prefix: str) -> list:
        out = []
        for name in sorted(os.listdir(self.dir)):
            if name.startswith(prefix + "-n") and name.endswith(".json"):
                with open(os.path.join(self.dir, name)) as f:
                    out += json.load(f)["results"]
        return out

    def steps_results(self) -> list:
        """Every run that counts for steps to target, one per (N, method, seed): phase steps-nN;
        the first seed's run of phase link-nN (on its first link): the arithmetic does not depend
        on the link, and its curve is bitwise the loopback run's (checked on every method,
        docs/convergence_protocol.md); at N = 2 AdamW + fp32's runs of phase target, cut at
        the target (the same jobs, bitwise)."""
        runs = {}
        for r in self.phase_results("steps"):
            runs.setdefault((r["world_size"], r["method"], r["seed"]), r)
        for r in self.phase_results("link"):
            if r["method"] != "floor":  # the first link's run first: the JSON keeps the links' order
                runs.setdefault((r["world_size"], r["method"], r["seed"]), r)
        if os.path.exists(self.path("target")):
            goal = self.target()
            for r in self.load("target")["results"]:
                runs.setdefault((2, r["method"], r["seed"]), cut_at(r, goal))
        return list(runs.values())

    def target(self) -> float:
        """The rule: adamw_fp32's mean validation loss at half the schedule, rounded up to 0.01."""
        runs = self.load("target")["results"]
        half = runs[0]["steps"] // 2
        vals = [next(c[3] for c in r["curve"] if c[0] >= half) for r in runs]
        return round_up(statistics.fmean(vals))

    def summary(self) -> str:
        target, hp = self.target(), self.tuned()
        steps, link = self.steps_results(), self.phase_results("link")
        cell = {}
        for r in steps:
            cell.setdefault((r["world_size"], r["method"]), []).append(r)
        on_link = {(r["world_size"], r["method"]): r for r in link}
        half, seed = self.load("target")["results"][0]["steps"] // 2, parse_seeds(self.a.seeds)[0]
        lines = [f"Target: validation loss {target:.2f} nats per token (adamw_fp32's mean at step {half}). Steps "
                 f"to target: loopback runs, mean [min, max] over seeds; s/step and end to end: the emulated "
                 f"link, seed {seed}.",
                 "", "| N | method | lr, wd | reached | steps to target | s/step on the link | s to target "
                 "(steps x s/step) | end to end on the link | MB sent per rank to target | vs best other | "
                 "not ranks | link irq |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        rows = {}
        for (n, m), rs in cell.items():
            ok = [r["reached"] for r in rs if r["reached"]]
            lk = on_link.get((n, m))
            sps = lk["seconds_per_step"] if lk else float("nan")
            mean_steps = statistics.fmean(x["steps"] for x in ok) if len(ok) == len(rs) else float("nan")
            rows[(n, m)] = dict(rs=rs, ok=ok, lk=lk, sps=sps, secs=mean_steps * sps)
        best = {}
        for (n, m), v in rows.items():
            if m not in DISTLION and math.isfinite(v["secs"]):
                best[n] = min(best.get(n, v["secs"]), v["secs"])
        for (n, m), v in sorted(rows.items(), key=lambda kv: (kv[0][0], METHODS.index(kv[0][1]))):
            ok, lk = v["ok"], v["lk"]
            st = (f"{statistics.fmean(x['steps'] for x in ok):.0f} [{min(x['steps'] for x in ok)}, "
                  f"{max(x['steps'] for x in ok)}]") if ok else "-"
            e2e = (f"{lk['reached']['seconds']:.1f} s" if lk and lk["reached"] else "-")
            mb = (f"{lk['reached']['bytes'] / 1e6:.0f}" if lk and lk["reached"] else "-")
            vs = f"{best[n] / v['secs']:.2f}x" if n in best and math.isfinite(v["secs"]) else "-"
            lines.append(f"| {n} | {m} | {hp[m]['lr']:g}, {hp[m]['weight_decay']:g} | {len(ok)}/{len(v['rs'])} | {st} "
                         f"| {v['sps']:.3f} | {v['secs']:.1f} | {e2e} | {mb} | {vs} | "
                         f"{lk['not_ranks_cores'] if lk else float('nan'):.2f} | {irq_cell(lk)} |")
        lines += self.per_seed(rows)
        floor = {r["world_size"]: r["seconds_per_step"] for r in link if r["method"] == "floor"}
        for n, f in sorted(floor.items()):
            fp32 = on_link.get((n, "adamw_fp32"))
            if fp32:
                lines.append(f"\nN = {n}: the floor (no communication) {f:.3f} s/step; AdamW + fp32 all-reduce "
                             f"{fp32['seconds_per_step']:.3f} s/step = {fp32['seconds_per_step'] / f:.2f}x the floor.")
        text = "\n".join(lines) + "\n" + self.levers_table()
        with open(os.path.join(self.dir, "summary.md"), "w") as f:
            f.write(text)
        self.plot(rows, target)
        return text

    @staticmethod
    def per_seed(rows) -> list:
        """Where a DistributedLion method reached the target on some seeds only: on each such
        seed, its seconds (steps x s/step on the link) against the best other method's."""
        out = []
        for (n, m), v in sorted(rows.items(), key=lambda kv: (kv[0][0], METHODS.index(kv[0][1]))):
            if m not in DISTLION or not v["ok"] or len(v["ok"]) == len(v["rs"]):
                continue
            for r in v["rs"]:
                if not r["reached"]:
                    continue
                mine = r["reached"]["steps"] * v["sps"]
                others = [(o["reached"]["steps"] * w["sps"], om) for (on, om), w in rows.items()
                          if on == n and om not in DISTLION for o in w["rs"] if o["seed"] == r["seed"] and o["reached"]]
                if others:
                    best, who = min(others)
                    out.append(f"\nN = {n}, seed {r['seed']}: {m} reached the target at step {r['reached']['steps']}, "
                               f"{mine:.1f} s on the link; the best other, {who}, {best:.1f} s ({best / mine:.2f}x).")
        return out

    def plot(self, rows, target):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("time_to_target: matplotlib missing (make bench-setup): no plot")
            return
        ns = sorted({n for n, _ in rows})
        fig, axes = plt.subplots(1, len(ns), figsize=(6.5 * len(ns), 4.5), squeeze=False)
        for ax, n in zip(axes[0], ns):
            for i, m in enumerate(METHODS):
                v = rows.get((n, m))
                if not v:
                    continue
                for j, r in enumerate(v["rs"]):  # loss against steps x the link's s/step
                    ax.plot([c[0] * v["sps"] for c in r["curve"]], [c[3] for c in r["curve"]], color=f"C{i}",
                            alpha=0.75, lw=1.2, label=m if j == 0 else None)
            ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:.2f}")
            ax.set_title(f"N = {n}, 1 Gbit/s (emulated)")
            ax.set_xlabel("seconds on the link (steps x s/step)")
            ax.set_ylabel("validation loss (nats / token)")
            ax.set_ylim(target - 0.6, target + 2.0)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(self.dir, "curves.png"), dpi=110)


def irq_cell(link_run) -> str:
    """The "link irq" cell: cores in irq + softirq during a link run's steps (runs made before
    the column existed counted them under "not ranks" and show "-")."""
    return f"{link_run['interrupt_cores']:.2f}" if link_run and "interrupt_cores" in link_run else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--jobs", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--link", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a tenth of the scale: one seed, N = 2, 50 steps")
    p.add_argument("--summary", action="store_true", help="only the table and the plot")
    p.add_argument("--only", default="", help="run only these phases (tune,target,steps-n2,levers,link-n2,...)")
    p.add_argument("--redo", default="", help="phases to rerun although their JSON exists (tune,target,steps-n2,...)")
    p.add_argument("--ranks", default=RANKS)
    p.add_argument("--links", default="1gbit")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default=SEEDS)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--tune-steps", type=int, default=TUNE_STEPS)
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    p.add_argument("--loopback", action="store_true", help="the link phase on loopback too (no root)")
    p.add_argument("--tiny", action="store_true", help="a tiny model on 40 files (tests: the suite runs, nothing more)")
    p.add_argument("--dir", default=None, help="where the phases' JSON go (default bench/results/time_to_target)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per (link, N) launch")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.quick:
        for k, v in QUICK.items():
            if k == "methods":
                continue
            setattr(a, k, v if p.get_default(k) == getattr(a, k) else getattr(a, k))
    unknown = [m for m in a.methods.split(",") if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {METHODS}")
    if "adamw_fp32" not in a.methods.split(","):
        p.error("--methods must include adamw_fp32 (the target comes from it)")
    a.dir = a.dir or os.path.join("bench", "results", "time_to_target" + ("_quick" if a.quick else ""))
    suite = Suite(a)
    if a.summary:
        print(suite.summary())
        return
    suite.all()


if __name__ == "__main__":
    main()
