"""Hyperparameter search for examples/convergence_digits.py, on the training
images only (the test images are never loaded here).

    python examples/tune_digits.py
    python examples/tune_digits.py --batch 64 --steps 150   # a cell of the levers grid

Protocol (docs/convergence_protocol.md): the same budget for Lion and AdamW,
5 lr x 3 wd, each grid centred on its literature defaults (Lion: lr ~3x
smaller, wd 10x larger than AdamW's). Each config is scored by 4-fold
cross-validation over the 1,437 training images with the example's exact
model, batch, epochs, schedule and loss (fold k held out, seed k); the score
is the mean validation accuracy, ties broken by lower validation loss.
Single process; DistributedLion vote and avg reuse Lion's choice.

--batch and --steps tune for the levers experiment's grid instead (the same
grids, folds and scoring, training each fold for exactly that many steps at
that global batch); the choices go into convergence_digits.TUNED. --extend
up (or down) adds one lr beyond each grid's top (bottom), the next of its
~3.3x steps, for both optimizers alike (the levers protocol's rule when a
best lr lands on an edge).
"""

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convergence_digits as cd  # noqa: E402

GRIDS = {
    "Lion": dict(lr=[3e-5, 1e-4, 3e-4, 1e-3, 3e-3], weight_decay=[1e-2, 1e-1, 1.0], betas=(0.9, 0.99)),
    "AdamW": dict(lr=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2], weight_decay=[1e-3, 1e-2, 1e-1], betas=(0.9, 0.999)),
}
FOLDS = 4


def make(name, params, lr, wd, betas):
    if name == "Lion":
        return cd._SingleProcessLion(params, lr=lr, betas=betas, weight_decay=wd)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=wd)


def cross_validate(name, lr, wd, betas, batch=cd.BATCH, steps=None, kind="mlp"):
    x, y = cd.training_images()
    n = len(x)
    bounds = [round(k * n / FOLDS) for k in range(FOLDS + 1)]
    accs, losses = [], []
    for k in range(FOLDS):
        val = torch.zeros(n, dtype=torch.bool)
        val[bounds[k] : bounds[k + 1]] = True
        xtr, xva = cd.standardise(x[~val], x[val])
        ytr, yva = y[~val], y[val]
        net = cd.model(k, kind)
        cd.train(net, make(name, net.parameters(), lr, wd, betas), xtr, ytr, seed=k, batch=batch, steps=steps)
        with torch.no_grad():
            out = net(xva)
            losses.append(torch.nn.functional.cross_entropy(out, yva).item())
            accs.append(100.0 * (out.argmax(1) == yva).float().mean().item())
    return sum(accs) / FOLDS, sum(losses) / FOLDS, accs


def extended(lrs, where):
    """The lr grid with one more rung of its 1-3-10 ladder above ("up") or below ("down")."""
    lead = lambda x: f"{x:.0e}"[0]  # the mantissa's digit: 1 or 3
    if where == "up":
        return lrs + [float(f"{lrs[-1] * (10 / 3 if lead(lrs[-1]) == '3' else 3):.0e}")]
    if where == "down":
        return [float(f"{lrs[0] / (10 / 3 if lead(lrs[0]) == '1' else 3):.0e}")] + lrs
    return lrs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--batch", type=int, default=cd.BATCH, help="global batch (default: the example's)")
    parser.add_argument("--steps", type=int, default=None, help="steps per fold (default: the example's epochs)")
    parser.add_argument("--extend", choices=("up", "down"), default=None,
                        help="one more lr beyond the top (bottom) of both grids")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                        help="the example's MLP (default) or the CNN of the lr-advice check (TUNED_CNN)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name, g in GRIDS.items():
        g = dict(g, lr=extended(g["lr"], args.extend))
        rows = []
        for lr, wd in itertools.product(g["lr"], g["weight_decay"]):
            acc, loss, per = cross_validate(name, lr, wd, g["betas"], args.batch, args.steps, args.model)
            rows.append(dict(lr=lr, weight_decay=wd, val_accuracy=acc, val_loss=loss, per_fold=per))
            print(f"{name:6} lr {lr:<7g} wd {wd:<6g} val acc {acc:6.2f}  val loss {loss:.4f}  "
                  f"folds {' '.join(f'{a:.2f}' for a in per)}", flush=True)
        best = max(rows, key=lambda r: (r["val_accuracy"], -r["val_loss"]))
        print(f"{name} best: lr {best['lr']:g} wd {best['weight_decay']:g} "
              f"val acc {best['val_accuracy']:.2f} val loss {best['val_loss']:.4f}\n", flush=True)
        results[name] = dict(grid=rows, best=best, batch=args.batch, steps=args.steps, extend=args.extend,
                             model=args.model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
