"""Training quality on scikit-learn's bundled digits at N = 4 (under 2 minutes):
DistributedLion vote and avg end within 1.0 point of single-process Lion's
test accuracy (means over 4 seeds). examples/convergence_digits.py prints the
whole table; docs/convergence.md records it, AdamW included."""

import json
import os
import subprocess
import sys
import tempfile

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "convergence_digits.py")


def test_distributed_lion_tracks_single_process_lion_on_digits():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        env = dict(os.environ)
        env.pop("LOCAL_WORLD_SIZE", None)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        r = subprocess.run(
            [torchrun, "--standalone", "--nproc-per-node=4", EXAMPLE, "--seeds", "4", "--json", out],
            capture_output=True, text=True, timeout=300, env=env,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        with open(out) as f:
            res = json.load(f)
    lion = res["Lion, single process"]["mean_test_accuracy"]
    vote = res["DistributedLion vote (N=4)"]["mean_test_accuracy"]
    avg = res["DistributedLion avg (N=4)"]["mean_test_accuracy"]
    adamw = res["AdamW, single process"]["mean_test_accuracy"]
    print(f"vote {vote:.2f}  avg {avg:.2f}  lion {lion:.2f}  adamw {adamw:.2f}")
    assert abs(vote - lion) <= 1.0, res
    assert abs(avg - lion) <= 1.0, res
    assert min(vote, avg, lion) > 90.0, res  # they all learned the task
