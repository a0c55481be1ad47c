#!/usr/bin/env python3
"""Why the vote takes the steps it takes (issue 30, item 6): suite 5's LM
(bench/time_to_target.py: the same model, corpus, batches, schedule and
initial weights) trained by an N-rank sign vote simulated in one process,
with, at every step, the single-process Lion direction computed on the same
parameters for comparison.

    python tools/vote_diagnostics.py --ranks 2 --lr 1e-3 --wd 0.1 --json out.json

Per step, over every parameter element (the reference is Lion on the whole
global batch, its momentum fed the mean of the ranks' gradients, i.e. what
DDP + Lion computes):

    ties        fraction of elements where the ranks' signs sum to 0 (the vote moves them by 0)
    agree       among the vote's nonzero elements, the fraction whose sign is Lion's
    norm_ratio  |vote update| / |Lion update| (= sqrt(1 - ties): both are +-1 per element)
    cosine      cos(vote update, Lion update)
    flips       fraction of elements whose update sign is the opposite of the previous
                step's (the vote; both steps nonzero), and the same for Lion's direction
    local_off   mean over ranks of the fraction where a rank's own sign is not Lion's

The vote here is written out in torch ops, independent of lionbit's packing,
all-to-all and counting (which tests/python check bit for bit elsewhere); its
validation curve should follow suite 5's distlion_vote curve of the same seed
and settings (the JSON has both when --suite-json is given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def run(ranks: int, lr: float, wd: float, steps: int, seed: int, eval_every: int, tiny: bool) -> dict:
    import torch

    import convergence_digits as cd
    import lm_stdlib as lm
    import time_to_target as ttt

    torch.set_num_threads(1)
    data = lm.build(verbose=False, limit=ttt.TINY_CORPUS_FILES if tiny else None)
    train = data["arrays"]["train"]
    evals = lm.eval_windows(data["arrays"]["val"], ttt.EVAL_WINDOWS, ttt.CTX)
    net = lm.model(seed, dict(lm.MODEL, ctx=ttt.CTX, **(ttt.TINY if tiny else {})))
    params = [p for p in net.parameters() if p.requires_grad]
    b1, b2 = ttt.GRIDS["lion"]["betas"]
    local_m = [[torch.zeros_like(p) for p in params] for _ in range(ranks)]
    lion_m = [torch.zeros_like(p) for p in params]
    prev_vote, prev_lion = None, None
    starts = lm.batches(train, seed, steps, ttt.GLOBAL_BATCH, ttt.CTX)
    span = torch.arange(ttt.CTX + 1)
    factor = cd.lr_factor(steps)
    rows, curve, t0 = [], [], time.perf_counter()
    for step in range(steps):
        local = starts[step].view(ranks, -1)
        grads = []
        for r in range(ranks):  # each rank's gradient of its share of the global batch
            net.zero_grad()
            lm.loss_of(net, train[local[r][:, None] + span]).backward()
            grads.append([p.grad.detach().clone() for p in params])
        with torch.no_grad():
            total = agree_n = nonzero = ties = flips_v = flips_l = both_v = both_l = off = 0.0
            dot = 0.0
            vote_now, lion_now = [], []
            for j, p in enumerate(params):
                mean_g = sum(grads[r][j] for r in range(ranks)) / ranks
                lion_dir = torch.sign(b1 * lion_m[j] + (1 - b1) * mean_g)
                lion_m[j].mul_(b2).add_(mean_g, alpha=1 - b2)
                count = torch.zeros_like(p)
                for r in range(ranks):
                    mine = torch.sign(b1 * local_m[r][j] + (1 - b1) * grads[r][j])
                    off += (mine != lion_dir).sum().item() / ranks
                    count += mine
                    local_m[r][j].mul_(b2).add_(grads[r][j], alpha=1 - b2)
                vote = torch.sign(count)
                n = p.numel()
                total += n
                ties += (count == 0).sum().item()
                nz = vote != 0
                nonzero += nz.sum().item()
                agree_n += (vote[nz] == lion_dir[nz]).sum().item()
                dot += (vote * lion_dir).sum().item()
                if prev_vote is not None:
                    both = (vote != 0) & (prev_vote[j] != 0)
                    both_v += both.sum().item()
                    flips_v += (vote[both] != prev_vote[j][both]).sum().item()
                    both2 = (lion_dir != 0) & (prev_lion[j] != 0)
                    both_l += both2.sum().item()
                    flips_l += (lion_dir[both2] != prev_lion[j][both2]).sum().item()
                vote_now.append(vote)
                lion_now.append(lion_dir)
                step_lr = lr * factor(step)
                p.mul_(1 - step_lr * wd).add_(vote, alpha=-step_lr)
            lion_nz = sum((d != 0).sum().item() for d in lion_now)
            prev_vote, prev_lion = vote_now, lion_now
        rows.append(dict(step=step + 1, ties=ties / total, agree=agree_n / max(nonzero, 1),
                         norm_ratio=(nonzero / max(lion_nz, 1)) ** 0.5,
                         cosine=dot / max((nonzero * lion_nz) ** 0.5, 1e-30),
                         flips_vote=flips_v / both_v if both_v else None,
                         flips_lion=flips_l / both_l if both_l else None, local_off=off / total))
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            net.eval()
            curve.append((step + 1, lm.evaluate(net, evals)))
            net.train()
            r = rows[-1]
            print(f"  N={ranks} step {step + 1}: val {curve[-1][1]:.3f}  ties {r['ties']:.3f}  agree {r['agree']:.3f}  "
                  f"cos {r['cosine']:.3f}  flips vote {r['flips_vote'] or 0:.3f} lion {r['flips_lion'] or 0:.3f}  "
                  f"local_off {r['local_off']:.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return dict(ranks=ranks, lr=lr, weight_decay=wd, steps=steps, seed=seed, per_step=rows, curve=curve)


def summarise(rec: dict) -> dict:
    rows = rec["per_step"]
    out = {}
    for name in ("ties", "agree", "norm_ratio", "cosine", "flips_vote", "flips_lion", "local_off"):
        vals = [r[name] for r in rows if r[name] is not None]
        half = len(vals) // 2
        out[name] = dict(first_half=statistics.fmean(vals[:half]) if half else None,
                         second_half=statistics.fmean(vals[half:]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2", help="comma-separated N to simulate")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--wd", type=float, required=True)
    p.add_argument("--steps", type=int, default=None, help="default: suite 5's STEPS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="suite 5's tiny model and corpus (tests)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import time_to_target as ttt
    steps = a.steps or ttt.STEPS
    recs = []
    for n in [int(v) for v in a.ranks.split(",")]:
        if ttt.GLOBAL_BATCH % n:
            p.error(f"--ranks {n}: the global batch {ttt.GLOBAL_BATCH} does not split over {n} ranks")
        rec = run(n, a.lr, a.wd, steps, a.seed, a.eval_every or ttt.EVAL_EVERY, a.tiny)
        rec["summary"] = summarise(rec)
        recs.append(rec)
        print(json.dumps(dict(ranks=n, summary=rec["summary"]), indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f)


if __name__ == "__main__":
    main()
