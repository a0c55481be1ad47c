"""Training quality: DistributedLion (vote, avg) against single-process Lion on
the same global batch and against AdamW, on scikit-learn's bundled digits
(1,797 8x8 images, no download).

    torchrun --standalone --nproc-per-node 4 examples/convergence_digits.py

Every run trains the same MLP from the same initial weights on the same
sequence of global batches, with the same schedule (linear warm-up, cosine
decay to 0) and loss (cross-entropy, label smoothing 0.1). The distributed
runs split each global batch across the ranks (DDP + DistributedLion.attach);
the single-process runs see the whole batch. Rank 0 prints the table (and
writes it as JSON with --json). The protocol, fixed before any run, is in
docs/convergence_protocol.md; the hyperparameters come from
examples/tune_digits.py (cross-validation on the training images only).

The levers experiment (Lion Cub's options, docs/convergence_protocol.md):
--variants runs a list of variants from VARIANTS below in one invocation,
at a chosen global batch (--batch) and length (--steps), for the given seeds,
and --json writes per-variant, per-seed test accuracy, test loss and bytes
sent per rank per step:

    torchrun --standalone --nproc-per-node 4 examples/convergence_digits.py \
        --variants vote,vote_alt,avg,lion,adamw --batch 64 --steps 200 --seeds 0,1,2 --json out.json

Without --variants it runs exactly what it always ran (vote, avg, Lion,
AdamW at batch 128, 60 epochs; tests/python/test_training_quality.py).
The run loop of --variants (run_levers) is shared with
examples/convergence_text.py.
"""

import argparse
import itertools
import json
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lionbit
from lionbit.lion_math import local_vote
from lionbit.voter import Voter

# Chosen by examples/tune_digits.py: 4-fold cross-validation on the 1,437
# training images (never the test set), 15 configs per optimizer: Lion
# 98.40 % (lr 1e-3; all three wd tie, wd 1 has the lowest loss), AdamW
# 98.82 % (lr 3e-3, wd 1e-3). Full grid in docs/convergence.md.
LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=1.0)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=1e-3)

# The levers experiment's variants: name -> the keyword arguments that
# DistributedLion gets on top of Lion's tuned config (every Lion-family
# variant shares that config: the same tuning budget for all of them), or
# None for the single-process baselines (Lion with Lion's config, AdamW with
# its own), which see the whole global batch.
VARIANTS = {
    "vote": dict(aggregation="vote"),
    "vote_alt": dict(aggregation="vote", tie_break="alternate"),
    "vote_rand": dict(aggregation="vote", tie_break="random"),
    "avg": dict(aggregation="avg"),
    "l1_p4": dict(aggregation="l1", bits=4),
    "l1_p8": dict(aggregation="l1", bits=8),
    "vote_ms10": dict(aggregation="vote", momentum_sync=10),
    "vote_ms100": dict(aggregation="vote", momentum_sync=100),
    "vote_nv": dict(aggregation="vote", hierarchy="node_vote"),
    "vote_alt_nv": dict(aggregation="vote", tie_break="alternate", hierarchy="node_vote"),
    # HSDP: FSDP2 over a 2-D (replicate, shard) mesh of nodes of --per-node ranks; each node one worker
    "vote_hsdp": dict(aggregation="vote", hsdp=True),
    "lion": None,
    "adamw": None,
}

# Lion's and AdamW's configs for the levers grid, tuned per (global batch,
# steps) by examples/tune_digits.py --batch B --steps T --extend up (the same
# cross-validation as above, training images only, 6 lr x 3 wd = 18 configs
# each; grids in docs/convergence.md). Batch 64: Lion 98.19 % (lr 3e-3, wd 1
# by loss over wd 0.01), AdamW 98.40 % (lr 3e-2, the extended top, ahead of
# lr 1e-2 by 0.0004 points with the same 1,414 images right). Batch 256: Lion
# 98.05 %, AdamW 98.54 %. A (batch, steps) not listed falls back to LION /
# ADAMW (tuned at batch 128, 60 epochs), and the JSON says so.
TUNED = {
    (64, 150): dict(lion=dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=1.0),
                    adamw=dict(lr=3e-2, betas=(0.9, 0.999), weight_decay=1e-2)),
    (256, 150): dict(lion=dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=1.0),
                     adamw=dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-2)),
}

# The digits CNN (model kind "cnn") of the lr-advice check, tuned by
# examples/tune_digits.py --model cnn --steps 200 --extend up (the same
# cross-validation; docs/benchmarks/digits_cnn_tuning.json): Lion 99.16 %
# (lr 3e-3, wd 1, interior after the extension), AdamW 99.10 % (lr 3e-2, the
# extended top: reported as on the edge, no second extension).
TUNED_CNN = {
    (128, 200): dict(lion=dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=1.0),
                     adamw=dict(lr=3e-2, betas=(0.9, 0.999), weight_decay=0.1)),
}

BATCH = 128  # global batch (split across ranks)
EPOCHS = 60
WARMUP = 0.05  # fraction of the steps
LABEL_SMOOTHING = 0.1
N_TEST = 360


def _permuted():
    # Imported here, as FSDP is in hsdp(): other scripts import this module for its schedule and
    # helpers (bench/time_to_target.py, in every rank it starts), and scikit-learn and FSDP
    # take about 3 s of a process's start on a 2-core machine.
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def training_images():
    """The 1,437 training images (raw): all that tuning may see."""
    x, y = _permuted()
    return x[N_TEST:], y[N_TEST:]


def standardise(xtr, *others):
    mean, std = xtr.mean(0), xtr.std(0) + 1e-3
    return [(t - mean) / std for t in (xtr,) + others]


def data():
    """Standardised training and test images for the final table."""
    x, y = _permuted()
    xtr, xte = standardise(x[N_TEST:], x[:N_TEST])
    return xtr, y[N_TEST:], xte, y[:N_TEST]


class _Image(torch.nn.Module):
    """The 64 standardised pixels as a 1 x 8 x 8 image."""

    def forward(self, x):
        return x.view(-1, 1, 8, 8)


def model(seed=0, kind="mlp"):
    """"mlp": 64-128-128-10 (the acceptance run's); "cnn": two 3x3 convolutions
    (16, 32 channels), 2x2 max-pool, 512-64-10 (the lr-advice check's)."""
    torch.manual_seed(seed)
    nn = torch.nn
    if kind == "cnn":
        return nn.Sequential(_Image(), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))
    if kind != "mlp":
        raise ValueError(f"model kind {kind!r}: 'mlp' or 'cnn'")
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def steps_per_epoch(n_train, batch=BATCH):
    return n_train // batch


def batches(n_train, batch, epochs, seed=0):
    """The same sequence of global batches for every run of a seed."""
    g = torch.Generator().manual_seed(1000 + seed)
    for _ in range(epochs):
        perm = torch.randperm(n_train, generator=g)
        for i in range(0, n_train - batch + 1, batch):
            yield perm[i : i + batch]


def lr_factor(total_steps, warmup=WARMUP):
    """Linear warm-up, then cosine decay to 0 (per step)."""
    w = max(1, round(warmup * total_steps))

    def f(step):
        if step < w:
            return (step + 1) / w
        return 0.5 * (1.0 + math.cos(math.pi * (step - w) / max(1, total_steps - w)))

    return f


def train(net, opt, x, y, seed, rank=0, world=1, batch=BATCH, epochs=EPOCHS, steps=None):
    """Train for `epochs` epochs, or for exactly `steps` steps (the same batch
    sequence, cut or continued epoch by epoch); returns the steps taken."""
    per_epoch = steps_per_epoch(len(x), batch)
    if steps is not None:
        epochs = -(-steps // per_epoch)
    total = per_epoch * epochs if steps is None else steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(total))
    for idx in itertools.islice(batches(len(x), batch, epochs, seed), total):
        local = idx.view(world, -1)[rank]  # this rank's share of the global batch
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[local]), y[local], label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        opt.step()
        sched.step()
    return total


class SideBySide(torch.nn.Module):
    """Several models as one module: forward takes one input per model."""

    def __init__(self, nets):
        super().__init__()
        self.nets = torch.nn.ModuleList(nets)

    def forward(self, xs):
        return [net(x) for net, x in zip(self.nets, xs)]


def train_side_by_side(ddp, opt, x, y, seeds, rank=0, world=1):
    """train() for the models of ddp.module (a SideBySide), model i on seed i's batches: the
    loss is the sum of theirs, so each model's gradient is its own loss's, bit for bit."""
    per_epoch = steps_per_epoch(len(x))
    total = per_epoch * EPOCHS
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(total))
    streams = [batches(len(x), BATCH, EPOCHS, seed) for seed in seeds]
    for idxs in itertools.islice(zip(*streams), total):
        local = [idx.view(world, -1)[rank] for idx in idxs]  # this rank's share of each global batch
        opt.zero_grad()
        outs = ddp([x[i] for i in local])
        loss = sum(torch.nn.functional.cross_entropy(out, y[i], label_smoothing=LABEL_SMOOTHING)
                   for out, i in zip(outs, local))
        loss.backward()
        opt.step()
        sched.step()


class _LocalVoter(Voter):
    """Each rank's own vote, no collective: what single-process Lion applies."""

    def votes_into_planes(self, device, group) -> bool:
        return False  # its own vote, as values

    def all_reduce(self, sign, zero, numel, nans, out, group, where, out_planes=False, nans_tally=None, agreed=None):
        out.copy_(local_vote(sign, zero, numel))
        fut = torch.futures.Future()
        fut.set_result([out])
        if agreed is not None:
            agreed.append(fut)  # (settled: the step's momenta need not wait)
        return fut


class _SingleProcessLion(lionbit.DistributedLion):
    """DistributedLion that never touches the process group: plain Lion."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.voter = _LocalVoter(self.aggregation, self.bits, self.tie_break, self)


SINGLE = {
    "Lion, single process": lambda p: _SingleProcessLion(p, **LION),
    "AdamW, single process": lambda p: torch.optim.AdamW(p, **ADAMW),
}


@torch.no_grad()
def correct(net, x, y):
    return int((net(x).argmax(1) == y).sum())


# ---------------------------------------------------------------------------
# The levers experiment: several variants in one invocation (also used by
# examples/convergence_text.py)
# ---------------------------------------------------------------------------


def parse_seeds(text, first=0):
    """'4' -> 4 seeds from `first` on (the old meaning of --seeds); '0,1,2',
    '0-2' or '3-3' -> exactly those."""
    text = str(text)
    if "," in text or "-" in text:
        seeds = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            seeds += list(range(int(lo), int(hi or lo) + 1))
    else:
        seeds = list(range(first, first + int(text)))
    if not seeds:
        raise SystemExit(f"--seeds {text}: no seeds (a bare number is a count; seed 0 alone is '0-0')")
    return seeds


def parse_variants(text):
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    return names


def parse_betas(text):
    """'0.9,0.9' -> (0.9, 0.9): two numbers in [0, 1)."""
    try:
        betas = tuple(float(b) for b in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise argparse.ArgumentTypeError(f"--lion-betas wants two numbers in [0, 1) like '0.9,0.9', got {text!r}")
    return betas


def make_single(name, params, lion, adamw):
    """A single-process baseline of VARIANTS ('lion' or 'adamw')."""
    if name == "lion":
        return _SingleProcessLion(params, **lion)
    return torch.optim.AdamW(params, **adamw)


def sent_counters(stats):
    """This rank's bytes-sent counters in lionbit.stats(): the sign path's
    bytes_sent, the momentum sync's momentum_sync_bytes_sent (absent
    without a sync) and, with a hierarchy, its node and cross-node bytes."""
    keys = ("bytes_sent", "momentum_sync_bytes_sent", "intra_node_bytes_sent", "inter_node_bytes_sent")
    return {k: int(v) for k, v in stats.items() if k in keys}


def spread(values):
    """Mean, sample standard deviation, min and max over the seeds."""
    return dict(mean=statistics.fmean(values), std=statistics.stdev(values) if len(values) > 1 else 0.0,
                min=min(values), max=max(values), n=len(values))


def hsdp(net, world, per_node):
    """net sharded by FSDP2 over a 2-D (replicate, shard) mesh: nodes of `per_node` consecutive ranks."""
    if not per_node or world % per_node:
        raise SystemExit(f"the HSDP variants need --per-node dividing N = {world} (got {per_node})")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    return fully_shard(net, mesh=mesh)


def run_levers(task, names, seeds, json_path=None, per_node=None):
    """Run every variant in `names` for every seed on `task`; rank 0 prints a
    table and writes the JSON. The distributed variants run one after another
    on all ranks (DDP + DistributedLion(**task.lion, **VARIANTS[v]).attach);
    the single-process ones (independent) are spread over the ranks.

    `task` has: name; lion, adamw (the optimizer configs); batch (global),
    steps; metrics (names of evaluate()'s results, the headline first) and
    higher_is_better (for the headline); model(seed); train(net, opt, seed,
    rank, world) -> steps taken; evaluate(net, rank, world) -> dict (called
    on every rank after a distributed run, with rank 0, world 1 after a
    single-process one); describe() -> dict.

    `per_node`: the variants with a hierarchy see nodes of this many
    consecutive ranks (a two-level cluster emulated on one machine).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = (lionbit.Topology.from_nodes([list(range(i, i + per_node)) for i in range(0, world, per_node)])
                if per_node else None)
    if task.batch % world:
        raise SystemExit(f"global batch {task.batch} is not a multiple of N = {world}")
    mine = []  # (variant, seed, result) computed by this rank
    distributed = [v for v in names if VARIANTS[v] is not None]
    for seed in seeds:
        for v in distributed:
            net = task.model(seed)
            kwargs = dict(VARIANTS[v])
            wrapped = hsdp(net, world, per_node) if kwargs.pop("hsdp", False) else DDP(net)
            extra = dict(topology=topology) if topology and "hierarchy" in kwargs else {}
            opt = lionbit.DistributedLion(net.parameters(), **task.lion, **kwargs, **extra).attach(wrapped)
            # HSDP votes over the replicate group: its lionbit backend counts the bytes
            group = next(net.parameters()).device_mesh.get_group("replicate") if wrapped is net else None
            before = sent_counters(lionbit.stats(group))
            t0 = time.perf_counter()
            steps = task.train(wrapped, opt, seed, rank, world)
            seconds = time.perf_counter() - t0
            after = sent_counters(lionbit.stats(group))
            counters = [None] * world
            dist.all_gather_object(counters, {k: after[k] - before.get(k, 0) for k in after})
            result = task.evaluate(net, rank, world)  # on every rank: a task may share the work out
            if rank == 0:
                keys = sorted({k for c in counters for k in c})
                by_key = {k: statistics.fmean(c.get(k, 0) for c in counters) / steps for k in keys}
                per_rank = [sum(c.values()) / steps for c in counters]
                mine.append((v, seed, dict(result, seed=seed, steps=steps, seconds=seconds,
                                           bytes_per_step=statistics.fmean(per_rank),
                                           bytes_per_step_max_rank=max(per_rank),
                                           bytes_per_step_by_key=by_key)))
            del net, wrapped, opt
    jobs = [(v, seed) for seed in seeds for v in names if VARIANTS[v] is None]
    for v, seed in jobs[rank::world]:
        net = task.model(seed)
        t0 = time.perf_counter()
        steps = task.train(net, make_single(v, net.parameters(), task.lion, task.adamw), seed)
        mine.append((v, seed, dict(task.evaluate(net), seed=seed, steps=steps, seconds=time.perf_counter() - t0,
                                   bytes_per_step=0.0, bytes_per_step_max_rank=0.0, bytes_per_step_by_key={})))
    everything = [None] * world
    dist.all_gather_object(everything, mine)
    if rank != 0:
        return None

    got = {}
    for v, _seed, r in sorted((t for part in everything for t in part), key=lambda t: t[1]):
        got.setdefault(v, []).append(r)
    head = task.metrics[0]
    doc = dict(task=task.name, world_size=world, per_node=per_node, global_batch=task.batch, steps=task.steps,
               seeds=seeds,
               params=sum(p.numel() for p in task.model(0).parameters()), headline=head,
               higher_is_better=task.higher_is_better, setup=task.describe(), lion=task.lion, adamw=task.adamw,
               torch=torch.__version__, lionbit=lionbit.__version__, variants={})
    print(f"\n{task.name}, N = {world}, global batch {task.batch}, {task.steps} steps, seeds {seeds}; "
          f"Lion {task.lion}, AdamW {task.adamw}")
    print(f"{'variant':12}{head + ' mean [min, max]':>34}  {'per seed':<{8 * len(seeds)}}"
          f"{task.metrics[1] + ' mean':>18}{'bytes/step/rank':>17}{'s/run':>8}")
    for v in names:
        rs = got[v]
        summary = {m: spread([r[m] for r in rs]) for m in task.metrics}
        summary["bytes_per_step"] = statistics.fmean(r["bytes_per_step"] for r in rs)
        summary["seconds"] = statistics.fmean(r["seconds"] for r in rs)
        kwargs = VARIANTS[v]
        doc["variants"][v] = dict(kind="single process" if kwargs is None else f"DistributedLion, N = {world}",
                                  kwargs=kwargs, runs=rs, summary=summary)
        h = summary[head]
        per = " ".join(f"{r[head]:7.3f}" for r in rs)
        print(f"{v:12}{h['mean']:>16.3f} [{h['min']:7.3f}, {h['max']:7.3f}]  {per:<{8 * len(seeds)}}"
              f"{summary[task.metrics[1]]['mean']:>18.4f}{summary['bytes_per_step']:>17,.0f}"
              f"{summary['seconds']:>8.1f}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


class DigitsTask:
    """The digits setup of this file at a chosen global batch and length."""

    name = "digits"
    metrics = ("test_accuracy", "test_loss")
    higher_is_better = True

    def __init__(self, batch=BATCH, steps=None, kind="mlp"):
        self.x, self.y, self.xte, self.yte = data()
        self.batch, self.kind = batch, kind
        self.steps = steps or steps_per_epoch(len(self.x), batch) * EPOCHS
        table = "TUNED_CNN" if kind == "cnn" else "TUNED"
        tuned = (TUNED_CNN if kind == "cnn" else TUNED).get((batch, self.steps))
        if kind == "cnn" and not tuned:
            raise SystemExit(f"--model cnn: no tuned config for batch {batch}, {self.steps} steps in TUNED_CNN "
                             f"(examples/tune_digits.py --model cnn --batch {batch} --steps {self.steps})")
        self.lion, self.adamw = (tuned["lion"], tuned["adamw"]) if tuned else (LION, ADAMW)
        self.hparams = (f"{table}[({batch}, {self.steps})]" if tuned
                        else "LION / ADAMW (tuned at batch 128, 60 epochs; none tuned for this batch and length)")

    def model(self, seed):
        return model(seed, self.kind)

    def train(self, net, opt, seed, rank=0, world=1):
        return train(net, opt, self.x, self.y, seed, rank, world, batch=self.batch, steps=self.steps)

    @torch.no_grad()
    def evaluate(self, net, rank=0, world=1):
        out = net(self.xte)
        right = int((out.argmax(1) == self.yte).sum())
        return dict(test_accuracy=100.0 * right / len(self.yte), test_correct=right,
                    test_loss=torch.nn.functional.cross_entropy(out, self.yte).item())

    def describe(self):
        return dict(data=f"scikit-learn digits, {len(self.x)} train / {len(self.yte)} test images",
                    model=("CNN conv3x3 16, conv3x3 32, max-pool 2, 512-64-10 (ReLU)" if self.kind == "cnn"
                           else "MLP 64-128-128-10 (ReLU)"),
                    epochs=self.steps / steps_per_epoch(len(self.x), self.batch),
                    schedule=f"linear warm-up {WARMUP:.0%} + cosine to 0", label_smoothing=LABEL_SMOOTHING,
                    test_loss="cross-entropy on the test images, no label smoothing", hparams=self.hparams)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="4",
                        help="runs per optimizer (init and batch order): a count from --first-seed, or a list "
                             "'0,1,2' / '0-2'")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--variants", default=None,
                        help=f"the levers experiment: a comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--batch", type=int, default=None, help=f"global batch (with --variants; default {BATCH})")
    parser.add_argument("--per-node", type=int, default=None,
                        help="with --variants: the hierarchy variants (vote_nv, ...) see nodes of this many "
                             "ranks; the HSDP variant (vote_hsdp) shards over a (nodes, this) mesh")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps (with --variants; default {EPOCHS} epochs' worth)")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                        help="with --variants: the MLP (default) or the CNN of the lr-advice check")
    parser.add_argument("--lion-betas", default=None, type=parse_betas,
                        help="with --variants: the Lion family's betas 'b1,b2' in place of the tuned ones "
                             "(single-process Lion and every DistributedLion variant alike)")
    args = parser.parse_args()
    if args.variants is None and (args.batch is not None or args.steps is not None or args.model != "mlp"
                                  or args.lion_betas is not None):
        parser.error("--batch, --steps, --model and --lion-betas go with --variants")

    torch.set_num_threads(1)
    dist.init_process_group("lionbit")
    if args.variants is not None:
        names = parse_variants(args.variants)
        task = DigitsTask(args.batch or BATCH, args.steps, args.model)
        if args.lion_betas is not None:
            task.lion = dict(task.lion, betas=args.lion_betas)
            task.hparams += f", Lion-family betas {args.lion_betas} (--lion-betas)"
        run_levers(task, names, parse_seeds(args.seeds, args.first_seed), args.json, args.per_node)
    else:
        legacy(args)
    dist.destroy_process_group()


def legacy(args):
    """vote, avg, Lion and AdamW at batch 128, 60 epochs: the acceptance run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert BATCH % world == 0
    xtr, ytr, xte, yte = data()
    seeds = parse_seeds(args.seeds, args.first_seed)
    mine = []  # (name, seed, result) computed by this rank

    for agg in ("vote", "avg"):
        # The seeds' models train side by side in one DDP model, each on its own batches:
        # DistributedLion's update is elementwise (tie_break "zero") and each model's gradient
        # comes from its own loss term alone, so each ends bit for bit as if trained alone,
        # with a quarter of the steps' round trips (tests/python/test_training_quality.py).
        side = SideBySide([model(seed) for seed in seeds])
        ddp = DDP(side)
        opt = lionbit.DistributedLion(side.parameters(), aggregation=agg, **LION).attach(ddp)
        lionbit.reset_stats()
        t0 = time.perf_counter()
        train_side_by_side(ddp, opt, xtr, ytr, seeds, rank, world)
        seconds, sent = (time.perf_counter() - t0) / len(seeds), lionbit.stats()["bytes_sent"] // len(seeds)
        if rank == 0:
            for seed, net in zip(seeds, side.nets):
                mine.append((f"DistributedLion {agg} (N={world})", seed, dict(
                    correct=correct(net, xte, yte), seconds=seconds, bytes_sent=sent)))
    # The single-process runs are independent: spread them over the ranks.
    jobs = [(name, seed) for seed in seeds for name in SINGLE]
    for name, seed in jobs[rank::world]:
        net = model(seed)
        t0 = time.perf_counter()
        train(net, SINGLE[name](net.parameters()), xtr, ytr, seed)
        mine.append((name, seed, dict(correct=correct(net, xte, yte), seconds=time.perf_counter() - t0, bytes_sent=0)))
    everything = [None] * world
    dist.all_gather_object(everything, mine)

    if rank == 0:
        got = {}
        for name, _seed, r in sorted((t for part in everything for t in part), key=lambda t: t[1]):
            got.setdefault(name, []).append(r)
        n = len(yte)
        print(f"\ndigits: {len(xtr)} train / {n} test images, MLP 64-128-128-10, global batch {BATCH}, "
              f"{EPOCHS} epochs, warm-up {WARMUP:.0%} + cosine to 0, label smoothing {LABEL_SMOOTHING}, "
              f"seeds {seeds[0]}-{seeds[-1]}; Lion {LION}, AdamW {ADAMW}")
        print(f"{'run':34}{'mean test acc':>15}  {'per seed':<{7 * len(seeds)}}{'s/run':>8}{'bytes sent/rank':>18}")
        summary = {}
        for name in [f"DistributedLion {a} (N={world})" for a in ("vote", "avg")] + list(SINGLE):
            rs = got[name]
            total = sum(r["correct"] for r in rs)
            accs = [100.0 * r["correct"] / n for r in rs]
            mean = 100.0 * total / (n * len(rs))
            summary[name] = dict(mean_test_accuracy=mean, correct_total=total, test_images=n, per_seed=accs,
                                 seeds=seeds, seconds=sum(r["seconds"] for r in rs) / len(rs),
                                 bytes_sent=rs[0]["bytes_sent"])
            per = " ".join(f"{a:6.2f}" for a in accs)
            print(f"{name:34}{mean:>14.2f}%  {per:<{7 * len(seeds)}}{summary[name]['seconds']:>8.1f}"
                  f"{rs[0]['bytes_sent']:>18,}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
