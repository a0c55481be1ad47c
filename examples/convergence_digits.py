"""Training quality: DistributedLion (vote, avg) against single-process Lion on
the same global batch and against AdamW, on scikit-learn's bundled digits
(1,797 8x8 images, no download).

    torchrun --standalone --nproc-per-node 4 examples/convergence_digits.py

Every run trains the same MLP from the same initial weights on the same
sequence of global batches. The distributed runs split each global batch
across the ranks (DDP + DistributedLion.attach); the single-process runs see
the whole batch. Rank 0 prints the table (and writes it as JSON with --json).
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import lionbit

# Chosen on a validation split of the training images (not the test set):
# each optimizer's best of lr x wd in {3e-4, 1e-3, 3e-3} x {0.1, 1} (Lion),
# {1e-3, 3e-3, 1e-2} x {0.01, 0.1} (AdamW), 30 epochs.
LION = dict(lr=3e-4, betas=(0.9, 0.99), weight_decay=0.1)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.01)


def data():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = 360
    xtr, ytr, xte, yte = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    mean, std = xtr.mean(0), xtr.std(0) + 1e-3
    return (xtr - mean) / std, ytr, (xte - mean) / std, yte


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )


def batches(n_train, batch, epochs, seed=0):
    """The same sequence of global batches for every run of a seed."""
    g = torch.Generator().manual_seed(1000 + seed)
    for _ in range(epochs):
        perm = torch.randperm(n_train, generator=g)
        for i in range(0, n_train - batch + 1, batch):
            yield perm[i : i + batch]


@torch.no_grad()
def accuracy(net, x, y):
    return 100.0 * (net(x).argmax(1) == y).float().mean().item()


def train(net, opt, x, y, idx_iter, rank=0, world=1):
    for idx in idx_iter:
        local = idx.view(world, -1)[rank]  # this rank's share of the global batch
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[local]), y[local]).backward()
        opt.step()


class _SingleProcessLion(lionbit.DistributedLion):
    """DistributedLion that never touches the process group: plain Lion."""

    def _vote(self, sign, zero, numel, nans, out, group, where):
        from lionbit.optim import _local_vote

        out.copy_(_local_vote(sign, zero, numel))
        fut = torch.futures.Future()
        fut.set_result([out])
        return fut


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split across ranks)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per optimizer (init and batch order)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    dist.init_process_group("lionbit")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.batch % world == 0
    xtr, ytr, xte, yte = data()
    runs = {}  # name -> list of per-seed results

    def record(name, **r):
        runs.setdefault(name, []).append(r)

    for seed in range(args.seeds):
        for agg in ("vote", "avg"):
            net = model(seed)
            ddp = DDP(net)
            opt = lionbit.DistributedLion(net.parameters(), aggregation=agg, **LION).attach(ddp)
            lionbit.reset_stats()
            t0 = time.perf_counter()
            train(ddp, opt, xtr, ytr, batches(len(xtr), args.batch, args.epochs, seed), rank, world)
            record(f"DistributedLion {agg} (N={world})", test_accuracy=accuracy(net, xte, yte),
                   seconds=time.perf_counter() - t0, bytes_sent=lionbit.stats()["bytes_sent"])
        if rank == 0:
            for name, make_opt in (
                ("Lion, single process", lambda p: _SingleProcessLion(p, **LION)),
                ("AdamW, single process", lambda p: torch.optim.AdamW(p, **ADAMW)),
            ):
                net = model(seed)
                opt = make_opt(net.parameters())
                t0 = time.perf_counter()
                train(net, opt, xtr, ytr, batches(len(xtr), args.batch, args.epochs, seed))
                record(name, test_accuracy=accuracy(net, xte, yte), seconds=time.perf_counter() - t0, bytes_sent=0)
    if rank == 0:
        print(f"\ndigits: {len(xtr)} train / {len(xte)} test images, MLP 64-128-128-10, global batch {args.batch}, "
              f"{args.epochs} epochs, {args.seeds} seeds; Lion {LION}, AdamW {ADAMW}")
        print(f"{'run':34}{'mean test acc':>15}{'per seed':>26}{'s/run':>8}{'bytes sent/rank':>18}")
        summary = {}
        for name, rs in runs.items():
            accs = [r["test_accuracy"] for r in rs]
            mean = sum(accs) / len(accs)
            summary[name] = dict(mean_test_accuracy=mean, per_seed=accs,
                                 seconds=sum(r["seconds"] for r in rs) / len(rs), bytes_sent=rs[0]["bytes_sent"])
            per = " ".join(f"{a:.2f}" for a in accs)
            print(f"{name:34}{mean:>14.2f}%{per:>26}{summary[name]['seconds']:>8.1f}{rs[0]['bytes_sent']:>18,}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
