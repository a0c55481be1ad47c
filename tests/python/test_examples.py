"""The examples a user starts from, run as the README says (torchrun), at
N = 2 and one epoch: `make demo`'s DDP script, `make demo-fsdp`'s FSDP2 and
FSDP1 scripts and `make demo-sign`'s collective. Each must finish, print its
figures, and the three training scripts (one task, one seed, one data order)
must end at the same test accuracy: DDP, FSDP2 and FSDP1 take the same steps
bitwise (tests/python/test_fsdp.py, test_fsdp1.py)."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _torchrun(script, *args):
    env = dict(os.environ)
    env.pop("LOCAL_WORLD_SIZE", None)  # Gloo's shared-memory shortcut
    env["OMP_NUM_THREADS"] = "1"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", os.path.join(EXAMPLES, script), *args],
                       capture_output=True, text=True, timeout=300, env=env)  # a hang guard: ~8 s each
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout.replace("\r", "\n")


def _accuracy(out):
    return float(re.search(r"final test accuracy ([0-9.]+)%", out).group(1))


def _times_one_bit(out):
    """The printed ratio of the gradient path's bytes to the 1-bit figure."""
    return float(re.search(r"([0-9.]+)x (?:it\)|the 1-bit figure)", out).group(1))


@pytest.fixture(scope="module")
def ddp():
    return _torchrun("ddp_train.py", "--epochs", "1")


def test_the_ddp_example(ddp):
    assert "replicas identical: True" in ddp, ddp
    assert 1.0 <= _times_one_bit(ddp) <= 1.05, ddp
    assert _accuracy(ddp) > 20.0, ddp  # ten classes: one epoch learns something


@pytest.mark.parametrize("flags", [[], ["--fsdp1"]], ids=["fsdp2", "fsdp1"])
def test_the_fsdp_example_steps_as_the_ddp_one(ddp, flags):
    out = _torchrun("fsdp_train.py", "--epochs", "1", *flags)
    assert 1.0 <= _times_one_bit(out) <= 1.05, out
    assert _accuracy(out) == _accuracy(ddp), (out, ddp)


def test_the_sign_allreduce_example():
    out = _torchrun("sign_allreduce_demo.py")
    ratios = [float(x) for x in re.findall(r"lionbit sent ([0-9.]+)x that", out)]
    assert ratios and all(1.0 <= x <= 1.01 for x in ratios), out
