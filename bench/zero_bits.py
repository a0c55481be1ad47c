#!/usr/bin/env python3
"""Bits DistributedLion's vote sends per update where exact zeros come in runs (issue 46).

Real models have Lion directions that are exactly 0, in runs: timm's resnet18
zero-initializes the last BatchNorm weight of every residual block
(zero_init_last), so each branch's conv1/bn1/conv2 get exactly-zero gradients
until that weight moves; a language model's embedding rows of tokens not in
the batch; ReLU units dead on a rank's batch. This measures what those zeros
cost on the wire: for each model, N and tie rule, the bytes each rank sent
per update (lionbit.stats()["bytes_sent"] deltas on every rank, headers and
zero positions included) as bits per element and as a multiple of the 1-bit
figure 2(N-1)/N * d/8 bytes (d: the trainable parameters voted): update 1,
then the mean and the max over updates 2..T, for rank 0 and for the rank
that sent most. Models, each trained the way its own script trains it:

    digits    examples/ddp_train.py's RowTransformer on sklearn's digits (make demo):
              global batch 64, lr 1e-3, wd 0.1, cosine, attach(ddp)
    lm        suite 5's 10M-parameter LM (bench/time_to_target.py's make(), examples/lm_stdlib.py),
              global batch 4 x 64 tokens, its tuned vote lr 1e-3, wd 0.1, betas (0.9, 0.9)
    resnet18  timm.create_model("resnet18", num_classes=10) (zero_init_last on), as timm's train.py
              trains it with Lion: no decay on 1-D parameters, gradient-norm clipping at 1.0,
              warm-up + cosine; synthetic 3x64x64 images, 16 a rank. Clipping edits the gradients,
              so attach(ddp, overlap=False): step() votes (with overlap the first update's votes
              would be dropped and sent again). Skipped, saying why, when `import timm` fails.

Also per update: the elements whose gradient is exactly 0 and those whose
local direction is 0 (gradient and momentum both 0), rank 0 and the most on
any rank. --tie-study: resnet18 at N = 2 under tie_break "zero", "alternate"
and "random", 30 updates: the fraction of the zero-initialized bn2.weight
elements still exactly 0 after each update, the exactly-zero gradient
elements, and the bits per element (the tie rule decides whether a 1-1 split
on those weights leaves them at 0).

    python bench/zero_bits.py                          # digits, lm, resnet18; N 2, 4; zero, alternate
    python bench/zero_bits.py --models digits --ranks 2 --steps 10
    python bench/zero_bits.py --tie-study              # resnet18, N = 2, three tie rules
    PYTHONPATH=/path/to/timm python bench/zero_bits.py --json zero_bits.json

Ranks: N local processes on loopback (bench/collectives.py's launch),
init_process_group("lionbit"), one thread each. Byte counts are exact
whatever the load; the seconds depend on the machine (printed first). The
lionbit imported is the first on sys.path: to compare two builds, run the
script once with each (e.g. one installed with `pip install --target DIR`,
then PYTHONPATH=DIR); where the build counts them, the forms the zeros took
(lists, runs, planes) are printed too. --json PATH writes every rank's
counters per update.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from collectives import gather_rows, launch, machine  # noqa: E402

MODELS = ("digits", "lm", "resnet18")
COUNTERS = ("bytes_sent", "bytes_received", "sign_allreduce_calls", "elements", "tie_rounds", "inline_tie_chunks",
            "late_zero_chunks", "zero_lists_sent", "zero_runs_sent", "zero_packed_sent", "zero_planes_sent",
            "zero_bytes_sent")
LOCAL = ("grad_zeros", "dir_zeros", "watched_zeros", "seconds")  # per update, measured in the loop
LM_HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.9))  # suite 5's tuned vote (docs/benchmarks.md)
RESNET = dict(classes=10, batch=16, size=64, lr=3e-4, weight_decay=0.05, clip=1.0)


# -- the models, each as its own script trains it -------------------------------------------------

class Run:
    """One training run: update(i) = zero_grad, the loss of batch i, backward, clipping if any;
    then step() (the vote) and the schedule. `watched`: parameters whose exact zeros are counted."""

    def __init__(self, model, opt, sched, loss_of, clip=None, watched=()):
        self.model, self.opt, self.sched, self.loss_of = model, opt, sched, loss_of
        self.clip, self.watched = clip, list(watched)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.d = sum(p.numel() for p in self.params)

    def backward(self, i: int) -> None:
        import torch
        self.opt.zero_grad()
        self.loss_of(i).backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)

    def step(self) -> None:
        self.opt.step()
        self.sched.step()

    def zeros(self) -> tuple:
        """(elements with an exactly-zero gradient, those whose momentum is 0 too: a zero direction)."""
        import torch
        grad = direction = 0
        with torch.no_grad():
            for p in self.params:
                g0 = p.grad == 0 if p.grad is not None else torch.ones_like(p, dtype=torch.bool)
                m = self.opt.state.get(p, {}).get("exp_avg")
                grad += int(g0.sum())
                direction += int((g0 if m is None else g0 & (m == 0)).sum())
        return grad, direction


def digits_run(rank: int, n: int, tie_break: str, steps: int) -> Run:
    """make demo's model and loop (examples/ddp_train.py): the first updates of its first epochs."""
    import torch
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_train
    import lionbit

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xtr, ytr = x[perm[360:]], y[perm[360:]]
    batch = 64
    torch.manual_seed(0)
    ddp = DDP(ddp_train.RowTransformer())
    opt = lionbit.DistributedLion(ddp.parameters(), lr=1e-3, weight_decay=0.1, tie_break=tie_break).attach(ddp)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g, per_epoch = torch.Generator().manual_seed(1), len(xtr) // batch
    order = torch.cat([torch.randperm(len(xtr), generator=g)[: per_epoch * batch]
                       for _ in range(-(-steps // per_epoch))]).view(-1, batch)

    def loss_of(i):
        idx = order[i].view(n, -1)[rank]
        return torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])

    return Run(ddp, opt, sched, loss_of)


_LM_DATA = {}


def lm_run(rank: int, n: int, tie_break: str, steps: int) -> Run:
    """Suite 5's LM, built by bench/time_to_target.py's make() with the vote's tuned hyperparameters."""
    import torch

    import lm_stdlib as lm
    import time_to_target as ttt

    if not _LM_DATA:
        _LM_DATA.update(lm.build(verbose=False))
    train = _LM_DATA["arrays"]["train"]
    _, ddp, opt, sched = ttt.make("distlion_vote", LM_HP, 0, steps, extra=dict(tie_break=tie_break))
    starts = lm.batches(train, 0, steps, ttt.GLOBAL_BATCH, ttt.CTX)
    span = torch.arange(ttt.CTX + 1)
    return Run(ddp, opt, sched, lambda i: lm.loss_of(ddp, train[starts[i].view(n, -1)[rank][:, None] + span]))


def resnet18_run(rank: int, n: int, tie_break: str, steps: int) -> Run:
    """timm's resnet18 as timm's train.py trains it, Lion in SGD's place (see the docstring)."""
    import timm
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import convergence_digits as cd
    import lionbit

    c = RESNET
    torch.manual_seed(0)
    net = timm.create_model("resnet18", num_classes=c["classes"])
    ddp = DDP(net)
    decay = [p for p in net.parameters() if p.ndim > 1]
    flat = [p for p in net.parameters() if p.ndim <= 1]  # norms and biases: no weight decay
    opt = lionbit.DistributedLion([dict(params=decay, weight_decay=c["weight_decay"]),
                                   dict(params=flat, weight_decay=0.0)], lr=c["lr"], tie_break=tie_break)
    opt.attach(ddp, overlap=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cd.lr_factor(steps))
    shape = (3, c["size"], c["size"])
    templates = torch.randn((c["classes"], *shape), generator=torch.Generator().manual_seed(0))

    def loss_of(i):  # synthetic images: a class's template under noise, a batch per rank and update
        g = torch.Generator().manual_seed(1 + 1000 * i + rank)
        y = torch.randint(0, c["classes"], (c["batch"],), generator=g)
        x = 0.5 * templates[y] + torch.randn((c["batch"], *shape), generator=g)
        return torch.nn.functional.cross_entropy(ddp(x), y)

    last_bn = [m.bn2.weight for m in net.modules() if type(m).__name__ == "BasicBlock"]
    return Run(ddp, opt, sched, loss_of, clip=c["clip"], watched=last_bn)


BUILD = {"digits": digits_run, "lm": lm_run, "resnet18": resnet18_run}


# -- one rank ---------------------------------------------------------------------------------------

def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import lionbit

    torch.set_num_threads(1)
    dist.init_process_group("lionbit")
    rank, n = dist.get_rank(), dist.get_world_size()
    with open(args.jobs) as f:
        jobs = json.load(f)
    have = [k for k in COUNTERS if k in lionbit.stats()]
    results = []
    for job in jobs:
        t0 = time.perf_counter()
        run = BUILD[job["model"]](rank, n, job["tie_break"], job["steps"])
        watched = sum(p.numel() for p in run.watched)
        build_s, rows = time.perf_counter() - t0, []
        for i in range(job["steps"]):
            before, t1 = lionbit.stats(), time.perf_counter()
            run.backward(i)
            grad_zeros, dir_zeros = run.zeros()
            run.step()
            after = lionbit.stats()
            w0 = sum(int((p == 0).sum()) for p in run.watched)
            rows.append([after[k] - before[k] for k in have]
                        + [grad_zeros, dir_zeros, w0, time.perf_counter() - t1])
        every = gather_rows(torch.tensor(rows, dtype=torch.float64).flatten()).view(n, job["steps"], -1)
        per_update = {k: every[:, :, j].tolist() for j, k in enumerate(have + list(LOCAL))}
        results.append(dict(job, world_size=n, d=run.d, watched=watched, build_s=build_s, counters=have,
                            per_update=per_update))
        if rank == 0:
            s = summary(results[-1])
            print(f"  {job['model']} N={n} {job['tie_break']}: update 1 {s['first']['bits']:.3f} bits/el, "
                  f"later mean {s['mean']['bits']:.3f}, max {s['max']['bits']:.3f} "
                  f"({build_s:.1f} s build + {sum(per_update['seconds'][0]):.1f} s updates)", flush=True)
        del run
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the figures ------------------------------------------------------------------------------------

def one_bit(n: int) -> float:
    """The 1-bit figure in bits per element: 2(N-1)/N."""
    return 2 * (n - 1) / n


def summary(r: dict) -> dict:
    """Bits per element per update (rank 0, and the most any rank sent): update 1, mean and max of 2..T."""
    sent = r["per_update"]["bytes_sent"]
    bits0 = [8 * b / r["d"] for b in sent[0]]
    bits_top = [8 * max(col) / r["d"] for col in zip(*sent)]
    out = {}
    for who, bits in (("", bits0), ("top_", bits_top)):
        later = bits[1:] or bits
        for key, v in (("first", bits[0]), ("mean", statistics.fmean(later)), ("max", max(later))):
            out[who + key] = dict(bits=v, x=v / one_bit(r["world_size"]))
    dz = [z / r["d"] for z in r["per_update"]["dir_zeros"][0]]
    out["zero_dirs"] = dict(first=dz[0], later_mean=statistics.fmean(dz[1:] or dz))
    forms = [k for k in ("zero_lists_sent", "zero_runs_sent", "zero_packed_sent", "zero_planes_sent", "zero_bytes_sent")
             if k in r["per_update"]]
    out["zero_forms_rank0"] = {k: int(sum(r["per_update"][k][0])) for k in forms}
    out["seconds_per_update"] = statistics.fmean(r["per_update"]["seconds"][0])
    return out


def table(results: list) -> str:
    lines = ["| model | d | N | tie rule | update 1: bits/el (× 1-bit) | updates 2–T mean | updates 2–T max | "
             "most on a rank: × at 1 / mean / max | zero directions: 1 / later mean | s/update |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = summary(r)
        cell = lambda k: f"{s[k]['bits']:.3f} ({s[k]['x']:.3f}×)"
        top = " / ".join(f"{s['top_' + k]['x']:.3f}×" for k in ("first", "mean", "max"))
        lines.append(f"| {r['model']} | {r['d']:,} | {r['world_size']} | {r['tie_break']} | {cell('first')} | "
                     f"{cell('mean')} | {cell('max')} | {top} | {100 * s['zero_dirs']['first']:.2f} % / "
                     f"{100 * s['zero_dirs']['later_mean']:.2f} % | {s['seconds_per_update']:.2f} |")
    steps = {r["steps"] for r in results}
    lines.append(f"\nT = {', '.join(map(str, sorted(steps)))} updates; bits/el = 8 × bytes_sent / d on rank 0; "
                 f"× 1-bit = that / (2(N−1)/N).")
    forms = [(r, summary(r)["zero_forms_rank0"]) for r in results]
    if any(f for _, f in forms):
        lines.append("Zero forms sent, rank 0, all updates (lists / runs / planes; zero bytes):")
        for r, f in forms:
            lines.append(f"  {r['model']} N={r['world_size']} {r['tie_break']}: "
                         + ", ".join(f"{k.replace('_sent', '')} {v:,}" for k, v in f.items()))
    return "\n".join(lines)


def tie_table(results: list) -> str:
    rules = [r["tie_break"] for r in results]
    head = " | ".join(f"{t}: bn2 = 0 / zero grads / bits/el" for t in rules)
    lines = [f"| update | {head} |", "|---|" + "---|" * len(rules)]
    for i in range(results[0]["steps"]):
        cells = []
        for r in results:
            u = r["per_update"]
            cells.append(f"{100 * u['watched_zeros'][0][i] / r['watched']:.1f} % / {int(u['grad_zeros'][0][i]):,} "
                         f"/ {8 * u['bytes_sent'][0][i] / r['d']:.3f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    r = results[0]
    lines.append(f"\nbn2 = 0: the share of the {r['watched']:,} bn2.weight elements (zero-initialized, "
                 f"zero_init_last) exactly 0 after the update; zero grads: elements of d = {r['d']:,} with an "
                 f"exactly-zero gradient on rank 0 in that update; bits/el: 8 × bytes_sent / d, rank 0. N = "
                 f"{r['world_size']}.")
    return "\n".join(lines)


# -- the driver -------------------------------------------------------------------------------------

def timm_missing() -> str:
    """Why resnet18 cannot run here ("" when it can)."""
    try:
        import timm  # noqa: F401
    except Exception as err:  # ImportError, or a torchvision that does not fit this torch
        return f"import timm failed: {type(err).__name__}: {err}"
    return ""


def run_jobs(jobs: list, n: int, timeout: float) -> tuple:
    """The jobs on N loopback ranks; (results, wall seconds)."""
    with tempfile.TemporaryDirectory(prefix="zero_bits-") as tmp:
        path, out = os.path.join(tmp, "jobs.json"), os.path.join(tmp, "out.json")
        with open(path, "w") as f:
            json.dump(jobs, f)
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--jobs", path, "--out", out]
        t0 = time.time()
        return launch(None, n, argv, out, timeout), time.time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--jobs", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--models", default=",".join(MODELS), help=f"some of {','.join(MODELS)}")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--ties", default=None, help="tie rules (default zero,alternate; with --tie-study also random)")
    p.add_argument("--steps", type=int, default=None, help="updates per run (default 20; --tie-study 30)")
    p.add_argument("--tie-study", action="store_true", help="resnet18 at N = 2: the tie rule and bn2.weight's zeros")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch of N ranks")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    models = ["resnet18"] if a.tie_study else a.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {MODELS}")
    ties = (a.ties or ("zero,alternate,random" if a.tie_study else "zero,alternate")).split(",")
    steps = a.steps or (30 if a.tie_study else 20)
    ranks = [2] if a.tie_study else [int(v) for v in a.ranks.split(",")]
    meta = dict(machine(), command=" ".join(["python"] + sys.argv), started=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    import lionbit
    print(f"zero_bits: {meta['cpu']}, {meta['cores']} cores; torch {meta['torch']}, lionbit {meta['lionbit']} "
          f"({lionbit.__file__})", flush=True)
    skipped = {}
    if "resnet18" in models:
        why = timm_missing()
        if why:
            print(f"zero_bits: resnet18 skipped: {why}", flush=True)
            skipped["resnet18"], models = why, [m for m in models if m != "resnet18"]
    results, walls = [], {}
    for n in ranks:
        jobs = [dict(model=m, tie_break=t, steps=steps) for m in models for t in ties]
        if not jobs:
            break
        got, walls[n] = run_jobs(jobs, n, a.timeout)
        results += got
        print(f"zero_bits: N={n} done in {walls[n]:.0f} s", flush=True)
    text = tie_table(results) if a.tie_study and results else table(results) if results else "nothing ran"
    print("\n" + text)
    if a.json:
        meta.update(finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"), wall_s_per_n=walls, skipped=skipped,
                    mode="tie_study" if a.tie_study else "bits")
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, results=[dict(r, summary=summary(r)) for r in results]), f, indent=1)


if __name__ == "__main__":
    main()
