"""Suite 3: DDP training step time of a ~25M-parameter transformer LM on emulated links.

    python bench/training.py --quick                     # make bench: N 4; 1 and 10 Gbit/s; 3 warm-up + 8 timed steps
    python bench/training.py                              # N 4; 1 and 10 Gbit/s; 5 warm-up + 20 timed steps
    python bench/training.py --links 1gbit --impls distlion_vote,no_comm --steps 10
    python bench/training.py --loopback                   # no namespaces (also the fallback without root)
    python bench/training.py --ranks 2 --links 1gbit --interleave \
        --impls no_comm,ddp_no_comm,ddp_no_comm_bv,distlion_vote,distlion_vote_bv   # a core per rank, step by step

The cluster, the launch of one worker process per rank and the JSON/Markdown/
PNG conventions are suite 1's (bench/collectives.py, bench/netns.py). Every
run uses init_process_group("lionbit"): DDP's all-reduces, the bf16 and
PowerSGD hooks' collectives and the barriers are forwarded by lionbit to its
inner Gloo group; DistributedLion's vote is lionbit's 1-bit sign all-reduce.

Model: a causal transformer LM (pre-norm encoder layers; vocab 16384,
d_model 512, 3 layers, 8 heads, ffn 2048, untied output head: ~26.3M
parameters), batch 4 x 32 tokens per rank, synthetic tokens (fixed seeds),
torch.set_num_threads(1) per rank. Every rank builds the same initial model
from the same seed.

Implementations (all optimizers: lr 1e-4, weight decay 0.1; Lion betas 0.9, 0.99):

    adamw_fp32     DDP (its built-in fp32 all-reduce) + torch AdamW (fused=True where available)
    lion_fp32      DDP (built-in fp32 all-reduce) + Lion
    lion_bf16      DDP + bf16_compress_hook + Lion
    lion_powersgd  DDP + PowerSGD hook (rank 4, start_powerSGD_iter 2, error feedback,
                   warm start; the warm-up steps cover the 2 uncompressed iterations) + Lion
    distlion_vote  DDP + lionbit.DistributedLion(...).attach(ddp): no gradient all-reduce;
                   each bucket's Lion directions are packed in DDP's hook and their vote
                   (1 bit/param) starts there, overlapping the rest of backward; step()
                   checks that no gradient changed, waits for the votes and applies them
    distlion_vote_step  the same with attach(ddp, overlap=False): the hook leaves the
                   gradients alone and step() votes them, chunk by chunk (the mode a
                   loop that clips or unscales gradients falls back to)
    no_comm        the floor: the same model, forward, backward and Lion step on each
                   rank, no DDP and no collective (only the per-step barrier)

Not in the default list:

    ddp_no_comm    the floor under DDP: DDP with a comm hook that hands back the local
                   gradient (no collective), the same Lion: what DDP itself costs a step
                   (its autograd hooks and bucket copies), which every DDP config pays
    ddp_no_comm_bv the same with DDP(gradient_as_bucket_view=True): the gradients are
                   views of DDP's buckets, so DDP copies no bucket back into p.grad
    distlion_vote_bv  distlion_vote with DDP(gradient_as_bucket_view=True)
    distlion_vote_db  distlion_vote with DistributedLion(double_buffer=True): the next momentum
                   written in the pass that packs the direction, swapped in at step()
    distlion_vote_db_bv  both

Lion Cub's levers (not in the default list; name them with --impls), each
distlion_vote (attach, overlap) with one DistributedLion option (DISTLION):

    distlion_alt    tie_break="alternate"        distlion_rand   tie_break="random"
    distlion_avg    aggregation="avg"
    distlion_l1p2   aggregation="l1", bits=2     distlion_l1p4   aggregation="l1", bits=4
    distlion_l1p8   aggregation="l1", bits=8
    distlion_ms10   momentum_sync=10             distlion_ms100  momentum_sync=100
    distlion_node   hierarchy="node"             distlion_node_vote  hierarchy="node_vote"

On a two-level cluster (--per-node L: one namespace a node of L ranks, bench/netns.py):

    python bench/training.py --quick --ranks 4 --per-node 2 --links 1gbit \
        --impls no_comm,distlion_vote,distlion_node,distlion_node_vote

    python bench/training.py --links 1gbit --steps 100 \
        --impls distlion_vote,distlion_alt,distlion_avg,distlion_l1p4,distlion_l1p8,distlion_ms10,distlion_ms100,no_comm

A momentum sync lands on one step in k: the median step hides it, so every
config also records mean_s (each rank's mean over the timed steps, slowest
rank), the amortized figure to read for distlion_ms*, and momentum_syncs_timed
(how many syncs fell in the timed steps; the optimizer counts the warm-up
steps too). With --steps 100 any k dividing 100 lands exactly 100/k times;
with the default 20 timed steps (steps 6-25) k = 100 never does.

"Lion" in the baselines and the floor is a plain single-process Lion in torch
ops (make_lion: lerp, sign, in place, a persistent direction buffer), the
same in all four, so those configs differ only in their communication.
DistributedLion uses lionbit's fused kernels instead (direction + pack in
the hook, apply in step()). PowerSGD's hook runs chained bucket after bucket
(serialized(): on Gloo, torch's hook with several buckets in flight fails).

Per step (after a barrier, like suite 1's repeats): fwd_bwd = until
loss.backward() returns (for DDP this includes waiting for every bucket's
communication), opt = optimizer.step(). Figures are the slowest rank's
median over the timed steps (each rank's median, then the max over ranks),
as in suite 1; fwd_bwd and opt are that slowest rank's medians.
exposed_comm = median step - the no_comm floor. With --interleave every config is
built and warmed up first and the timed steps are taken in turn (step i of each
config, then step i + 1), and each config also gets vs_floor_by_step: the
median over i of its step i / the floor's step i (slowest rank each). On a
machine whose pace moves by 10-30 % between runs minutes (or seconds) apart,
that ratio moves least. The floor's optimizer step is
the torch Lion; no_comm also times lionbit's fused Lion kernels (direction
and apply, as DistributedLion runs them) on the same parameters, and
floor_fused_lion = floor - its step + that time: the floor with a fused local
Lion, the stricter reference for DistributedLion (an estimate). comm_alone: the same
impl's communication with no compute: DDP's own buckets (the reducer's
bucket layout, filled with a local gradient) run through the same comm hook
(reducer._run_comm_hook: the built-in all-reduce, the bf16 / PowerSGD hook,
or DistributedLion's hook, which computes the directions and votes them)
back to back after a barrier, median of the repeats. hidden = 1 -
exposed_comm / comm_alone, clamped to [0, 1]: the share of the
communication that backward covered.

Bytes per rank per step: payload (fp32: 2(N-1)/N * 4d, bf16: 2(N-1)/N * 2d,
PowerSGD: 2(N-1)/N * 4 * (P + Q + uncompressed elements) from the hook's own
counters, DistributedLion: lionbit.stats()["bytes_sent"], plus the node and
cross-node bytes with a hierarchy) and on the wire (veth tx_bytes over the
timed steps minus the same number of bare barriers, divided by the steps; on
a two-level cluster a node's veth, so per node).

Also recorded per config: the cores busy during its timed steps (/proc/stat)
and the share not charged to the ranks (other jobs, network softirqs), and
for distlion_vote, per DDP bucket, when its hook was called and its vote done
(a wrapper around DistributedLion's DDP hook while attach() registers it).

Output: JSON (suite "training"; the stable schema: suite, impl, world_size,
numel, link, median_s, bytes_per_rank, plus extras), a Markdown table, a PNG
(stacked bars: compute floor vs exposed communication).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from collectives import busy_seconds, choose_mode, gather_rows, launch, load_columns, new_meta, run_cases, tx_bytes  # noqa: E402

IMPLS = ["adamw_fp32", "lion_fp32", "lion_bf16", "lion_powersgd", "distlion_vote", "distlion_vote_step", "no_comm"]
# DistributedLion's configs: the keyword arguments each one adds (lr, betas,
# weight decay are everyone's). All attach with overlap but distlion_vote_step.
DISTLION = {
    "distlion_vote": {},
    "distlion_vote_step": {},
    "distlion_alt": dict(tie_break="alternate"),
    "distlion_rand": dict(tie_break="random"),
    "distlion_avg": dict(aggregation="avg"),
    "distlion_l1p2": dict(aggregation="l1", bits=2),
    "distlion_l1p4": dict(aggregation="l1", bits=4),
    "distlion_l1p8": dict(aggregation="l1", bits=8),
    "distlion_ms10": dict(momentum_sync=10),
    "distlion_ms100": dict(momentum_sync=100),
    "distlion_node": dict(hierarchy="node"),
    "distlion_node_vote": dict(hierarchy="node_vote"),
    "distlion_vote_bv": {},
    "distlion_vote_db": dict(double_buffer=True),
    "distlion_vote_db_bv": dict(double_buffer=True),
}
# DDP without communication: the same step as no_comm under DDP (its autograd hooks and bucket copies)
# with a comm hook that hands back the local gradient; what DDP itself costs a step.
DDP_NO_COMM = ("ddp_no_comm", "ddp_no_comm_bv")
# The configs that build DDP with more than init_sync=False.
DDP_KWARGS = {"distlion_vote_bv": dict(gradient_as_bucket_view=True),
              "distlion_vote_db_bv": dict(gradient_as_bucket_view=True),
              "ddp_no_comm_bv": dict(gradient_as_bucket_view=True)}
KNOWN = IMPLS + [k for k in DISTLION if k not in IMPLS] + list(DDP_NO_COMM)

MODEL = dict(vocab=16384, d_model=512, layers=3, heads=8, ffn=2048, seq=32, batch=4)
LR, WD, BETAS = 1e-4, 0.1, (0.9, 0.99)
POWERSGD_RANK, POWERSGD_START = 4, 2


def make_model(cfg: dict):
    import torch
    import torch.nn as nn

    class LM(nn.Module):
        """Causal transformer LM: embedding + learned positions, pre-norm encoder layers, untied head."""

        def __init__(self):
            super().__init__()
            d, t = cfg["d_model"], cfg["seq"]
            self.embed = nn.Embedding(cfg["vocab"], d)
            self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, cfg["heads"], cfg["ffn"], dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, cfg["layers"], enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, cfg["vocab"], bias=False)
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(t), persistent=False)

        def forward(self, tokens):
            h = self.embed(tokens) + self.pos[: tokens.shape[1]]
            h = self.blocks(h, mask=self.causal, is_causal=True)
            return self.head(self.norm(h))

    return LM()


def make_lion(params, lr: float, betas, weight_decay: float):
    """Plain single-process Lion (Chen et al. 2023) in torch ops, for the
    baselines and the floor (lionbit has none outside DistributedLion):

        c = b1 m + (1 - b1) g;  x = x (1 - lr wd) - lr sign(c);  m = b2 m + (1 - b2) g

    The direction goes into a buffer kept per parameter (a fresh 105 MB
    temporary each step would add page faults to every step)."""
    import torch

    class Lion(torch.optim.Optimizer):
        def __init__(self):
            super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                b1, b2 = group["betas"]
                decay, lr_ = 1.0 - group["lr"] * group["weight_decay"], group["lr"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["exp_avg"] = torch.zeros_like(p)
                        st["direction"] = torch.empty_like(p)
                    m, c = st["exp_avg"], st["direction"]
                    torch.lerp(p.grad, m, b1, out=c)
                    p.mul_(decay).sub_(c.sign_(), alpha=lr_)
                    m.lerp_(p.grad, 1.0 - b2)

    return Lion()


class traced_hook:
    """While open, wraps module._hook (DistributedLion's DDP hook, which attach()
    registers) so that each call appends [bucket index, numel, called, returned, done]
    (seconds since clock[0]) to the last list in the trace; "done" is when the
    bucket's vote finished (the hook returns the local gradient at once). No-op if
    lionbit has no such function."""

    def __init__(self, module, clock):
        self.module, self.clock, self.trace = module, clock, []

    def __enter__(self):
        self.inner = getattr(self.module, "_hook", None)
        if self.inner is None:
            return self.trace
        inner, clock, trace = self.inner, self.clock, self.trace

        def hook(state, bucket):
            rec = [bucket.index(), bucket.buffer().numel(), time.perf_counter() - clock[0], 0.0, float("nan")]
            fut = inner(state, bucket)
            rec[3] = time.perf_counter() - clock[0]
            att = state.attachment  # the DDP attachment the hook serves (None once detached)
            vote = att.buckets[bucket.index()].work if att is not None and att.overlap else None
            (vote or fut).add_done_callback(lambda _: rec.__setitem__(4, time.perf_counter() - clock[0]))
            if trace:
                trace[-1].append(rec)
            return fut

        self.module._hook = hook
        return self.trace

    def __exit__(self, *exc):
        if self.inner is not None:
            self.module._hook = self.inner


def local_gradient_hook(state, bucket):
    """A DDP comm hook that communicates nothing: the bucket's local gradient goes back to p.grad."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def serialized(hook):
    """A comm hook that starts each bucket's hook only once the previous
    bucket's future has completed. torch's PowerSGD hook issues a bucket's
    second and third all-reduce from the completion callback of the one
    before; on Gloo (which runs callbacks on its own threads) several buckets
    in flight then enqueue their all-reduces in a different order on
    different ranks, and Gloo fails ("Received data size doesn't match
    expected size"; the same with backend "gloo"). Chained, every rank issues
    them in bucket order; backward still runs on meanwhile."""
    import torch

    last = [None]

    def run(state, bucket):
        out = torch.futures.Future()

        def finish(f):
            try:
                out.set_result(f.value())
            except Exception as e:           # noqa: BLE001 - handed to DDP
                out.set_exception(e)

        def start(_=None):
            try:
                hook(state, bucket).add_done_callback(finish)
            except Exception as e:           # noqa: BLE001
                out.set_exception(e)

        prev, last[0] = last[0], out
        if prev is None:
            start()
        else:
            prev.add_done_callback(start)    # inline when prev is done already
        return out

    return run


# ---------------------------------------------------------------------------
# worker: one rank
# ---------------------------------------------------------------------------

def step_timeline(folder: str, rank: int, n: int, times, steps_seen, trace, gather_rows) -> dict | None:
    """--timeline: the median timed step (by its slowest rank's time), every rank's view, in ms from
    rank 0's start of that step: when backward and step() ended, and per bucket when its hook ran,
    and when its vote (the LIONBIT_TRACE line of the sign call that started within the step, in hook
    order) started on the worker, finished its header round, its last all-to-all and all-gather, and
    ended, and when the hook's future saw it done. Collective: every rank calls it."""
    import torch

    slowest = gather_rows(torch.tensor([t[0] for t in times], dtype=torch.float64)).max(dim=0).values
    k = int(slowest.argsort()[len(times) // 2])
    unix0, bwd, end = steps_seen[k]
    lines = []
    try:
        with open(os.path.join(folder, f"sign.rank{rank}.jsonl")) as f:
            lines = [json.loads(x) for x in f]
    except OSError:
        pass
    calls = [c for c in lines if unix0 * 1e6 <= c["start_unix_us"] <= (unix0 + end) * 1e6]
    calls.sort(key=lambda c: c["start_unix_us"])
    buckets = []
    for idx, numel, called, returned, done in trace[k]:
        b = {"bucket": idx, "numel": numel, "hook": called * 1e3, "hook_return": returned * 1e3, "done": done * 1e3}
        mine = [c for c in calls if c["numel"] == numel]
        if mine:
            c = mine.pop(0)
            calls.remove(c)
            at = c["start_unix_us"] / 1e3 - unix0 * 1e3
            ev = c["events"]

            def last(name):
                ts = [e[2] for e in ev if e[0] == name]
                return at + max(ts) if ts else None

            b.update(call=at, header=last("header"), a2a=last("a2a_done"), allgather=last("ag_done"),
                     end=last("end"))
        buckets.append(b)
    mine = {"rank": rank, "unix0": unix0, "backward_end": bwd * 1e3, "step_end": end * 1e3, "buckets": buckets}
    path = os.path.join(folder, f"step.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(mine, f)
    gather_rows(torch.zeros(1, dtype=torch.float64))   # every rank's file is written
    if rank != 0:
        return None
    ranks = []
    for r in range(n):
        with open(os.path.join(folder, f"step.rank{r}.json")) as f:
            ranks.append(json.load(f))
    base = ranks[0]["unix0"] * 1e3
    for r in ranks:
        shift = r.pop("unix0") * 1e3 - base
        r["backward_end"] += shift
        r["step_end"] += shift
        for b in r["buckets"]:
            for key in ("hook", "hook_return", "done", "call", "header", "a2a", "allgather", "end"):
                if b.get(key) is not None:
                    b[key] += shift
    return {"step": k, "ranks": ranks}


def print_timeline(tl: dict) -> None:
    def ms(v):
        return "   -  " if v is None else f"{v:6.1f}"

    print(f"  timeline of the median step ({tl['step']}), ms from rank 0's start of it:", flush=True)
    for r in tl["ranks"]:
        print(f"    rank {r['rank']}: backward ends {r['backward_end']:.1f}, step() ends {r['step_end']:.1f}")
        for b in r["buckets"]:
            print(f"      bucket {b['bucket']} {b['numel'] / 1e6:5.1f}M  hook {ms(b['hook'])} -{ms(b['hook_return'])}"
                  f"  vote starts {ms(b.get('call'))}  header {ms(b.get('header'))}  all-to-all {ms(b.get('a2a'))}"
                  f"  all-gather {ms(b.get('allgather'))}  ends {ms(b.get('end'))}  done {ms(b['done'])}",
                  flush=True)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit
    import lionbit.ddp  # noqa: F401  (traced_hook wraps its hook)
    from lionbit import step_vote

    torch.set_num_threads(1)          # N ranks share few cores; no oversubscription
    dist.init_process_group("lionbit")
    rank, n = dist.get_rank(), dist.get_world_size()
    if args.pin and n <= len(os.sched_getaffinity(0)):
        # A core per rank, literally: every thread of this rank (autograd, lionbit's worker, Gloo's)
        # runs on its own core and takes time from no other rank.
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    wire_bytes = lambda: tx_bytes(os.environ.get("LIONBIT_BENCH_IF", ""))

    cfg = MODEL
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(4)]

    def loss_of(net, i):
        x = batches[i % len(batches)]
        logits = net(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, cfg["vocab"]), x[:, 1:].reshape(-1))

    results = []
    clock = [0.0]      # start of the current step, for the bucket trace

    def run_impl(impl):
        """One config, a generator: its set-up and warm-up, then its timed steps, each after a
        yield (so that with --interleave the driver below takes every config's step i before any
        config's step i + 1), then its comm-alone runs and figures (appended to results).
        Collective: every rank advances the same generators in the same order."""
        trace = []
        torch.manual_seed(0)
        model = make_model(cfg)
        d = sum(p.numel() for p in model.parameters())
        if rank == 0 and impl == args.impls[0]:
            print(f"  model: transformer LM, {d:,} parameters ({d * 4 / 1e6:.1f} MB fp32), "
                  f"{cfg['batch']}x{cfg['seq']} tokens per rank per step", flush=True)
        psgd = None
        overlap = impl in DISTLION and impl != "distlion_vote_step"
        if impl == "no_comm":
            net = model
        else:
            # Same seed on every rank: the replicas start identical, so skip DDP's initial broadcast.
            net = DDP(model, init_sync=False, **DDP_KWARGS.get(impl, {}))
        if impl == "adamw_fp32":
            try:
                opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, fused=True)
            except (RuntimeError, TypeError):
                opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
        elif impl in DISTLION:
            opt = lionbit.DistributedLion(net.parameters(), lr=LR, betas=BETAS, weight_decay=WD, **DISTLION[impl])
            with traced_hook(lionbit.ddp, clock) as trace:
                opt.attach(net, overlap=overlap)
        else:
            opt = make_lion(net.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        if impl in DDP_NO_COMM:
            net.register_comm_hook(None, local_gradient_hook)
        elif impl == "lion_bf16":
            net.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif impl == "lion_powersgd":
            psgd = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                               start_powerSGD_iter=POWERSGD_START, random_seed=0)
            net.register_comm_hook(psgd, serialized(powerSGD_hook.powerSGD_hook))
        elif impl not in ("adamw_fp32", "lion_fp32", "no_comm", *DDP_NO_COMM) and impl not in DISTLION:
            raise ValueError(impl)

        steps_seen = []   # --timeline: (unix start, backward end, step end) of each step, s

        def step(i):
            opt.zero_grad(set_to_none=True)
            if impl.startswith("distlion"):
                trace.append([])
            unix0 = time.time()
            t0 = clock[0] = time.perf_counter()
            loss = loss_of(net, i)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            steps_seen.append((unix0, t1 - t0, t2 - t0))
            return t2 - t0, t1 - t0, t2 - t1

        for i in range(args.warmup):
            dist.barrier()
            step(i)
        if psgd is not None and psgd.iter < POWERSGD_START:
            raise RuntimeError(f"PowerSGD still in its uncompressed iterations after {args.warmup} warm-up steps")
        psgd_after0 = psgd.total_numel_after_compression if psgd is not None else 0

        times = []
        trace.clear()
        steps_seen.clear()
        synced0 = opt.steps_taken if impl in DISTLION else 0
        # Per timed step (a barrier, the step, a barrier), summed over the steps: the bytes on the
        # wire, this process's CPU, the machine's busy and stolen core seconds, the wall time and
        # lionbit's counters. With --interleave the other configs' steps fall between them.
        keys = ("bytes_sent", "pack_seconds", "comm_seconds", "vote_seconds", "unpack_seconds",
                "sign_allreduce_calls", "momentum_sync_bytes_sent", "intra_node_bytes_sent", "inter_node_bytes_sent")

        def counters():
            s = lionbit.stats()
            return [wire_bytes(), time.process_time(), *busy_seconds()[:2], time.perf_counter(),
                    *(float(s.get(k, 0)) for k in keys)]

        total = None
        for i in range(args.steps):
            yield
            dist.barrier()
            before = counters()
            times.append(step(args.warmup + i))
            dist.barrier()
            diff = [b - a for a, b in zip(before, counters())]
            total = diff if total is None else [t + x for t, x in zip(total, diff)]
        wire_s, cpu_s, busy_s, steal_s, wall_s = total[:5]
        st = dict(zip(keys, total[5:]))
        # As many bare barriers as the timed windows hold: their bytes are subtracted.
        w1 = wire_bytes()
        for _ in range(args.steps):
            dist.barrier()
        w2 = wire_bytes()
        # The momentum sync's bytes, where lionbit counts them apart from the sign path's.
        sync_bytes = st["momentum_sync_bytes_sent"]
        schedule = getattr(opt, "_sync_schedule", None) if impl in DISTLION else None
        syncs = sum(bool(schedule(k)) for k in range(synced0 + 1, opt.steps_taken + 1)) if schedule else 0
        psgd_numel = (psgd.total_numel_after_compression - psgd_after0) / args.steps if psgd is not None else 0

        # DistributedLion's buckets: per bucket, the median over the timed steps of when its
        # hook was called, when it returned and when its vote was done (s from the step's start).
        rows = buckets_seen = None
        timeline = None
        if args.timeline and trace and impl in DISTLION and overlap:
            timeline = step_timeline(args.timeline, rank, n, times, steps_seen, trace, gather_rows)
        if trace and trace[0] and all(len(t) == len(trace[0]) for t in trace):
            med = torch.tensor([[statistics.median(t[b][k] for t in trace) for k in range(2, 5)]
                                for b in range(len(trace[0]))], dtype=torch.float64).view(-1)
            rows, buckets_seen = gather_rows(med), [t[:2] for t in trace[0]]
        trace.clear()                                 # the comm-alone runs below are not traced

        # The communication alone: DDP's buckets through the same hook, no compute.
        comm = []
        if impl != "no_comm":
            opt.zero_grad(set_to_none=True)
            with net.no_sync():
                loss_of(net, 0).backward()           # a local gradient, no communication
            buckets = net.reducer._get_zeros_like_grad_buckets()
            for b in buckets:
                for view, p in zip(b.gradients(), b.parameters()):
                    view.copy_(p.grad)
            saved = [b.buffer().clone() for b in buckets]
            for _ in range(args.comm_repeats):
                for b, s in zip(buckets, saved):
                    b.buffer().copy_(s)
                dist.barrier()
                t0 = time.perf_counter()
                if impl in DISTLION:
                    # lionbit's hook hands back the local gradient at once and starts the
                    # bucket's vote; run by hand outside backward it would read as a
                    # Join's shadow, so the votes are started as the hook starts them.
                    futs = []
                    if overlap:
                        with torch.no_grad():
                            for b in buckets:
                                opt.attachment.start_bucket(b)
                else:
                    futs = [net.reducer._run_comm_hook(b) for b in buckets]
                for f in futs:
                    f.wait()
                if overlap:                     # the votes the hooks started
                    started, opt.attachment.started = opt.attachment.started, []
                    for bv in started:
                        bv.work.wait()
                        bv.work = None
                elif impl == "distlion_vote_step":   # step()'s chunked vote (changes no state)
                    step_vote.vote_chunks(opt, step_vote.step_entries(opt, opt.param_groups), opt.group,
                                          "bench", step_vote.VoteBuffers())
                comm.append(time.perf_counter() - t0)
            del buckets, saved

        # The DDP replicas must have stayed identical (no_comm, ddp_no_comm*: each rank trains alone).
        with torch.no_grad():
            check = torch.stack([q.double().sum() for q in net.parameters()]).sum().view(1)
        same = bool((gather_rows(check) == check).all()) if impl not in ("no_comm", *DDP_NO_COMM) else None

        # The floor's Lion step against lionbit's fused Lion kernels on the same
        # parameters (one pass direction + momentum, one pass apply), all ranks
        # at once as in the steps: what a fused local Lion would cost instead.
        fused = []
        if impl == "no_comm":
            ps = [q for q in net.parameters() if q.grad is not None]
            total = sum(q.numel() for q in ps)
            planes = [torch.zeros((total + 63) // 64 * 8, dtype=torch.uint8) for _ in range(2)]
            delta = torch.ones(total, dtype=torch.bfloat16)   # stands for the unpacked own direction
            b1, b2 = BETAS
            for _ in range(args.comm_repeats):
                dist.barrier()
                t0 = time.perf_counter()
                off = 0
                for q in ps:
                    k = q.numel()
                    lionbit._C.lion_direction_into(q.grad.view(-1), opt.state[q]["exp_avg"].view(-1), b1, 1 - b1,
                                                   b2, 1 - b2, planes[0], planes[1], off)
                    lionbit._C.lion_apply(q.view(-1), delta[off:off + k], LR, 1 - LR * WD)
                    off += k
                fused.append(time.perf_counter() - t0)
            del planes, delta

        step_t, fb_t, opt_t = (statistics.median(t[k] for t in times) for k in range(3))
        mine = torch.tensor([step_t, fb_t, opt_t,
                             statistics.median(comm) if comm else statistics.median(fused) if fused else 0.0,
                             wire_s - (w2 - w1) if w1 >= 0 else -1.0,
                             float(st["bytes_sent"]),
                             st["pack_seconds"], st["comm_seconds"], st["vote_seconds"], st["unpack_seconds"],
                             float(st["sign_allreduce_calls"]),
                             cpu_s, busy_s, wall_s, steal_s,
                             statistics.fmean(t[0] for t in times), float(sync_bytes),
                             float(st.get("intra_node_bytes_sent", 0)), float(st.get("inter_node_bytes_sent", 0))],
                            dtype=torch.float64)
        every = gather_rows(mine)
        # Each timed step's slowest rank (with --interleave, step i of every config ran in one round).
        by_step = gather_rows(torch.tensor([t[0] for t in times], dtype=torch.float64)).max(dim=0).values

        slow = int(every[:, 0].argmax())
        f = 2 * (n - 1) / n
        if impl in ("adamw_fp32", "lion_fp32"):
            payload = f * 4 * d
        elif impl == "lion_bf16":
            payload = f * 2 * d
        elif impl == "lion_powersgd":
            payload = f * 4 * psgd_numel
        elif impl in DISTLION:
            # with a hierarchy (distlion_node*), its node and cross-node communicators' bytes too
            payload = (every[:, 5] + every[:, 16] + every[:, 17] + every[:, 18]).max().item() / args.steps
        else:
            payload = 0.0
        wire = every[:, 4].max().item() / args.steps if every[0, 4] >= 0 else None
        if wire is not None and os.environ.get("LIONBIT_BENCH_IF") == "lo":
            wire /= n   # loopback: one counter carries every rank's traffic
        rec = {
            "suite": "training", "impl": impl, "world_size": n, "numel": d, "link": args.link,
            "median_s": every[:, 0].max().item(), "bytes_per_rank": payload,
            # Each rank's mean step, slowest rank: the amortized figure (momentum syncs included).
            "mean_s": every[:, 15].max().item(),
            "wire_bytes_per_rank": wire,   # with --per-node > 1: the rank's node's veth, i.e. per node
            "inter_node_bytes_per_rank": every[:, 18].max().item() / args.steps,
            # The split is the slowest rank's (the one whose median step is median_s).
            "fwd_bwd_s": every[slow, 1].item(), "opt_s": every[slow, 2].item(),
            "comm_alone_s": every[:, 3].max().item() if comm else None,
            "fused_lion_s": every[:, 3].max().item() if fused else None,
            # no_comm: each rank's step - its optimizer step + its fused kernels, slowest rank.
            "floor_fused_lion_s": (every[:, 0] - every[:, 2] + every[:, 3]).max().item() if fused else None,
            "payload_over_1bit": payload / (f * d / 8),
            "steps": args.steps, "warmup": args.warmup, "comm_repeats": args.comm_repeats,
            "per_rank_median_s": every[:, 0].tolist(),
            "step_s_by_step": by_step.tolist(),
            "replicas_identical": same,
            # Cores busy during the timed steps and the share not charged to the N ranks.
            **load_columns(every[0, 12].item(), every[0, 14].item(), every[:, 11].sum().item(),
                           every[0, 13].item()),
            "model": dict(cfg, params=d), "tokens_per_rank": cfg["batch"] * cfg["seq"],
        }
        if rows is not None:   # the slowest rank's
            rec["bucket_trace_ms"] = [
                {"bucket": idx, "numel": k,
                 **{key: 1e3 * rows[slow].view(-1, 3)[b, j].item()
                    for j, key in enumerate(("hook", "hook_return", "done"))}}
                for b, (idx, k) in enumerate(buckets_seen)]
        if timeline is not None:
            rec["timeline_ms"] = timeline
        if impl in DISTLION:
            rec["distlion_kwargs"] = DISTLION[impl]
            rec["momentum_sync_bytes_per_rank"] = every[:, 16].max().item() / args.steps
            rec["momentum_syncs_timed"] = syncs
            if schedule and not syncs and rank == 0:
                print(f"  {impl}: no momentum sync fell in the timed steps (use --steps 100)", flush=True)
            calls = every[:, 10].max().item()
            rec["lionbit_split_s"] = {k: every[:, 6 + j].max().item() / args.steps
                                      for j, k in enumerate(("pack", "comm", "vote", "unpack"))}
            rec["sign_allreduce_calls_per_step"] = calls / args.steps
        if impl == "lion_powersgd":
            rec["powersgd"] = {"matrix_approximation_rank": POWERSGD_RANK, "start_powerSGD_iter": POWERSGD_START,
                               "elements_after_compression": psgd_numel}
        results.append(rec)
        if rank == 0 and "bucket_trace_ms" in rec:
            print("  " + " ".join(f"[bucket {b['bucket']}: {b['numel'] / 1e6:.1f}M, hook at {b['hook']:.0f} ms, "
                                  f"voted at {b['done']:.0f} ms]" for b in rec["bucket_trace_ms"]), flush=True)
        if rank == 0 and timeline is not None:
            print_timeline(timeline)
        if rank == 0:
            ca = rec["comm_alone_s"]
            print(f"  {args.link:>9} N={n} {impl:<14} step {rec['median_s'] * 1e3:8.1f} ms  "
                  f"fwd+bwd {rec['fwd_bwd_s'] * 1e3:8.1f}  opt {rec['opt_s'] * 1e3:6.1f}  "
                  f"comm alone {ca * 1e3 if ca is not None else float('nan'):7.1f} ms  "
                  f"payload {payload / 1e6:8.3f} MB  wire {wire / 1e6 if wire is not None else float('nan'):8.3f} MB  "
                  f"cores busy {rec['cpu_busy_cores']:.2f} (not ranks {rec['cpu_other_cores']:.2f}, "
                  f"steal {rec['cpu_steal_cores']:.2f})", flush=True)
        # Rebound, not deleted: step() above refers to these names.
        net = model = opt = psgd = None
        gc.collect()

    runs = [run_impl(impl) for impl in args.impls]
    if args.interleave:
        # Every config is built and warmed up first, then step i of each config in turn: a
        # machine whose pace drifts within seconds slows every config's step i alike.
        live = list(runs)
        while live:
            for run in list(live):
                if next(run, StopIteration) is StopIteration:
                    live.remove(run)
    else:
        for run in runs:           # one config after the other
            for _ in run:
                pass

    # Relative figures against the floor and lion_fp32 of this run.
    by = {r["impl"]: r for r in results}
    nc = by.get("no_comm", {})
    floor = nc.get("median_s")
    # The floor with lionbit's fused Lion kernels in place of its torch Lion step (an estimate:
    # per rank, step - optimizer step + the fused kernels' time, slowest rank; the unpack of the own
    # direction is left out, so it errs on the fast side).
    floor_fused = nc.get("floor_fused_lion_s")
    lion = by.get("lion_fp32", {}).get("median_s")
    for r in results:
        t = r["median_s"]
        r["floor_s"] = floor
        r["floor_fused_lion_s"] = floor_fused
        r["exposed_comm_s"] = (t - floor) if floor is not None else None
        r["vs_floor"] = (t / floor) if floor else None
        r["vs_floor_fused_lion"] = (t / floor_fused) if floor_fused else None
        # --interleave: the median over the timed steps of step i / the floor's step i, both taken in
        # the same round (the ratio a drifting machine moves least).
        r["vs_floor_by_step"] = (statistics.median(a / b for a, b in zip(r["step_s_by_step"], nc["step_s_by_step"]))
                                 if floor and args.interleave else None)
        r["speedup_vs_lion_fp32"] = (lion / t) if lion else None
        ca, ex = r["comm_alone_s"], r["exposed_comm_s"]
        r["hidden_fraction"] = (min(1.0, max(0.0, 1.0 - ex / ca))
                                if ca and ex is not None and r["impl"] != "no_comm" else None)

    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def git_commit() -> str:
    """The checkout's commit (and '+dirty' with uncommitted changes), or '' outside git."""
    import subprocess
    try:
        head = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return ""


def run_ranks(cluster, n: int, link: str, impls, warmup: int, steps: int, comm_repeats: int,
              out: str, timeout: float, timeline: str | None = None, pin: bool = True,
              interleave: bool = False) -> list:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--link", link,
            "--impls", ",".join(impls), "--warmup", str(warmup), "--steps", str(steps),
            "--comm-repeats", str(comm_repeats), "--out", out, "--pin" if pin else "--no-pin"]
    if timeline:
        argv += ["--timeline", timeline]
    if interleave:
        argv += ["--interleave"]
    return launch(cluster, n, argv, out, timeout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="3 warm-up + 8 timed steps, comm alone x3")
    p.add_argument("--ranks", default="4", help="comma list of N (default 4)")
    p.add_argument("--links", default="1gbit,10gbit")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; quick 3; >= 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; quick 8)")
    p.add_argument("--comm-repeats", type=int, default=None, help="repeats of the comm-alone run (default 5; quick 3)")
    p.add_argument("--loopback", action="store_true", help="no namespaces: plain processes on 127.0.0.1")
    p.add_argument("--per-node", type=int, default=1,
                   help="ranks a node: a two-level cluster, one namespace a node (default 1)")
    p.add_argument("--link", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--json", default="bench/results/training.json", help="results file")
    p.add_argument("--md", default=None, help="Markdown table (default: the JSON's name with .md)")
    p.add_argument("--png", default=None, help="plot (default: the JSON's name with .png)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per (link, N) run")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="with N <= cores, pin rank r (all its threads) to core r (default on)")
    p.add_argument("--interleave", action="store_true",
                   help="take the configs' timed steps in turn (step i of each, then step i + 1; every config "
                        "built first) and report each config's median ratio of step i to the floor's step i")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="DistributedLion with overlap: print one step's timeline per rank (the median step: "
                        "each bucket's hook, its vote's header round, all-to-all, all-gather and end from "
                        "LIONBIT_TRACE, the step's end), traces kept in DIR")
    a = p.parse_args()

    if a.worker:
        a.impls = a.impls.split(",")
        worker(a)
        return

    ranks = [int(v) for v in a.ranks.split(",")]
    warmup = a.warmup if a.warmup is not None else (3 if a.quick else 5)
    steps = a.steps or (8 if a.quick else 20)
    comm_repeats = a.comm_repeats or (3 if a.quick else 5)
    impls = a.impls.split(",")
    unknown = [i for i in impls if i not in KNOWN]
    if unknown:
        p.error(f"unknown impl(s) {unknown}; known: {KNOWN}")
    if "lion_powersgd" in impls and warmup <= POWERSGD_START:
        p.error(f"--warmup must be > {POWERSGD_START} so that PowerSGD compresses in the timed steps")
    links = a.links.split(",")

    use_ns = choose_mode("training", a.loopback)
    if not use_ns:
        links = ["loopback"]
    meta = dict(new_meta(use_ns), model=MODEL, lr=LR, weight_decay=WD, betas=BETAS, git=git_commit(),
                pinned=a.pin, per_node=a.per_node, interleave=a.interleave)
    print(f"training: {meta['machine']['cores']} cores ({meta['machine']['cpu']}), "
          f"torch {meta['machine']['torch']}, lionbit {meta['machine']['lionbit']}; N {ranks}, links {links}, "
          f"impls {impls}; {warmup} warm-up + {steps} timed steps, comm alone x{comm_repeats}; "
          f"{'a core per rank (pinned) where N <= cores' if a.pin else 'not pinned'}", flush=True)
    if a.timeline:
        # Read by each rank's first sign call: every call of the run appends its events there.
        a.timeline = os.path.abspath(a.timeline)
        os.makedirs(a.timeline, exist_ok=True)
        for f in os.listdir(a.timeline):
            if f.startswith("sign.rank"):
                os.remove(os.path.join(a.timeline, f))
        os.environ["LIONBIT_TRACE"] = os.path.join(a.timeline, "sign")
    run_cases("training", use_ns, links, ranks, a.json, meta,
              lambda c, n, link, tmp: run_ranks(c, n, link, impls, warmup, steps, comm_repeats, tmp, a.timeout,
                                                a.timeline, a.pin, a.interleave), per_node=a.per_node)
    import report
    report.training(a.json, md=a.md, png=a.png)


if __name__ == "__main__":
    main()
