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
"""

import argparse
import json
import math
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import lionbit

# Chosen by examples/tune_digits.py: 4-fold cross-validation on the 1,437
# training images (never the test set), 15 configs per optimizer: Lion
# 98.40 % (lr 1e-3; all three wd tie, wd 1 has the lowest loss), AdamW
# 98.82 % (lr 3e-3, wd 1e-3). Full grid in docs/convergence.md.
LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=1.0)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=1e-3)

BATCH = 128  # global batch (split across ranks)
EPOCHS = 60
WARMUP = 0.05  # fraction of the steps
LABEL_SMOOTHING = 0.1
N_TEST = 360


def _permuted():
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


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )


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


def train(net, opt, x, y, seed, rank=0, world=1, batch=BATCH, epochs=EPOCHS):
    total = steps_per_epoch(len(x), batch) * epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(total))
    for idx in batches(len(x), batch, epochs, seed):
        local = idx.view(world, -1)[rank]  # this rank's share of the global batch
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[local]), y[local], label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        opt.step()
        sched.step()


class _SingleProcessLion(lionbit.DistributedLion):
    """DistributedLion that never touches the process group: plain Lion."""

    def _vote(self, sign, zero, numel, nans, out, group, where, counts=None):
        from lionbit.lion_math import local_vote

        out.copy_(local_vote(sign, zero, numel))
        fut = torch.futures.Future()
        fut.set_result([out])
        return fut


SINGLE = {
    "Lion, single process": lambda p: _SingleProcessLion(p, **LION),
    "AdamW, single process": lambda p: torch.optim.AdamW(p, **ADAMW),
}


@torch.no_grad()
def correct(net, x, y):
    return int((net(x).argmax(1) == y).sum())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=4, help="runs per optimizer (init and batch order)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("lionbit")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert BATCH % world == 0
    xtr, ytr, xte, yte = data()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    mine = []  # (name, seed, result) computed by this rank

    for seed in seeds:
        for agg in ("vote", "avg"):
            net = model(seed)
            ddp = DDP(net)
            opt = lionbit.DistributedLion(net.parameters(), aggregation=agg, **LION).attach(ddp)
            lionbit.reset_stats()
            t0 = time.perf_counter()
            train(ddp, opt, xtr, ytr, seed, rank, world)
            if rank == 0:
                mine.append((f"DistributedLion {agg} (N={world})", seed, dict(
                    correct=correct(net, xte, yte), seconds=time.perf_counter() - t0,
                    bytes_sent=lionbit.stats()["bytes_sent"])))
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
