"""Training quality on scikit-learn's bundled digits at N = 4 (about a minute):
issue 3's acceptance item, asserted as stated. Over seeds 0-3,
DistributedLion vote and avg each end within 1.0 point of single-process
Lion's mean test accuracy and at least as good as AdamW's.

The protocol (fixed before any run, docs/convergence_protocol.md): same MLP,
initial weights, batch order, global batch 128, 60 epochs, warm-up + cosine
to 0 and label smoothing for all four runs; hyperparameters per optimizer
from examples/tune_digits.py (4-fold cross-validation on the training images,
the same 15-config budget for Lion and AdamW). "At least as good" is compared
in whole test images (360 per seed), so float rounding cannot decide it. The
margins are small (see docs/convergence.md): this test can fail, e.g. if a
change to the optimizer or the collectives costs DistributedLion a few
images."""

import json
import os
import tempfile

import torchrun_env

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "convergence_digits.py")


def test_distributed_lion_matches_lion_and_adamw_on_digits():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        # 4 ranks with torchrun's worker environment (torchrun_env.py). The deadline is a hang guard,
        # not a speed target: 89 s in a quiet hour, 260 s alone with a quarter of the cores stolen
        # (2026-11-29), over 300 s inside a slow suite; about half that since the seeds' models
        # train side by side (2026-12-01: 53 s against 113 s).
        torchrun_env.run(EXAMPLE, "--seeds", "4", "--json", out, ranks=4, timeout=900)
        with open(out) as f:
            res = json.load(f)
    lion = res["Lion, single process"]
    adamw = res["AdamW, single process"]
    dist_runs = [res["DistributedLion vote (N=4)"], res["DistributedLion avg (N=4)"]]
    print({k: round(v["mean_test_accuracy"], 2) for k, v in res.items()})
    for run in dist_runs:
        assert run["seeds"] == [0, 1, 2, 3] and run["test_images"] == adamw["test_images"] == 360, res
        assert abs(run["mean_test_accuracy"] - lion["mean_test_accuracy"]) <= 1.0, res
        assert run["correct_total"] >= adamw["correct_total"], res  # at least as good as AdamW
    assert min(r["mean_test_accuracy"] for r in res.values()) > 90.0, res  # they all learned the task
