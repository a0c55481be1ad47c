"""DDP over "lionbit" trains exactly like DDP over "gloo"; the backend starts
under torchrun, with and without `import lionbit`, and as "cpu:lionbit"."""

import hashlib
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import HERE, run_ranks, values


def _train(rank, steps=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )
    # Small buckets: several all-reduces per step, overlapping backward.
    ddp = DDP(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 20, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train_ddp(rank, n):
    return {"backend": dist.get_backend(), "hash": _train(rank)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_without_hook_matches_gloo_bit_for_bit(world_size):
    mine = values(run_ranks("test_ddp_and_launch:train_ddp", world_size, backend="lionbit"))
    ref = values(run_ranks("test_ddp_and_launch:train_ddp", world_size, backend="gloo"))
    assert {m["backend"] for m in mine} == {"lionbit"}
    assert len({m["hash"] for m in mine}) == 1, "replicas diverged"
    assert mine[0]["hash"] == ref[0]["hash"], "DDP over lionbit differs from DDP over gloo"


TORCHRUN_WORKER = os.path.join(HERE, "torchrun_worker.py")


LAUNCHES = {"autoload": ("lionbit", False), "import": ("lionbit", True), "cpu-device-spec": ("cpu:lionbit", True)}


@pytest.fixture(scope="module")
def launched():
    """The three torchrun launches, started together (each mostly waits on its ranks' start):
    id -> (returncode, stdout, stderr)."""
    penv = dict(os.environ)
    penv.pop("LOCAL_WORLD_SIZE", None)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    procs = {
        name: subprocess.Popen([torchrun, "--standalone", "--nproc-per-node=2", TORCHRUN_WORKER, spec,
                                "import" if import_first else "noimport"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=penv)
        for name, (spec, import_first) in LAUNCHES.items()
    }
    done = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=180)
            done[name] = (p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return done


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_init_process_group_under_torchrun(launched, name):
    rc, out, err = launched[name]
    assert rc == 0, out + err
    # Both ranks print to one pipe; their lines may interleave.
    assert sorted(re.findall(r"OK rank (\d) backend (?:cpu:)?lionbit", out)) == ["0", "1"], out + err


def test_a_broken_lionbit_never_breaks_import_torch():
    # Make `import lionbit` fail inside torch's autoload: torch still imports
    # and only warns.
    code = (
        "import sys; sys.modules['lionbit._C'] = None\n"
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import torch\n"
        "print('torch', torch.__version__, any('lionbit' in str(x.message) for x in w))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("True"), r.stdout + r.stderr


EXIT_WORKER = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import lionbit
dist.init_process_group("lionbit")
model = DDP(torch.nn.Linear(8, 2))
opt = lionbit.DistributedLion(model.parameters(), lr=1e-3).attach(model)
for step in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
pending = [lionbit.all_reduce_sign(torch.randn(1 << 16), async_op=True) for _ in range(3)]
sys.stdout.write(f"EXITING {dist.get_rank()}\\n")
sys.stdout.flush()
# no destroy_process_group, calls possibly still in flight: the interpreter
# finalizes while lionbit's worker thread exists
"""


def test_exit_without_destroy_process_group_is_clean():
    # Regression: a worker releasing Python-owned tensors while the
    # interpreter finalized was killed mid-destructor (std::terminate) or
    # deadlocked on the GIL, about 1 run in 10.
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "exit_worker.py")
        with open(script, "w") as f:
            f.write(EXIT_WORKER)
        penv = dict(os.environ)
        penv.pop("LOCAL_WORLD_SIZE", None)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        # Six launches, two at a time (each mostly waits on its ranks' start).
        for pair in range(3):
            runs = [subprocess.Popen([torchrun, "--standalone", "--nproc-per-node=2", script], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=penv) for _ in range(2)]
            for i, p in enumerate(runs):
                try:
                    out, err = p.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    for q in runs:
                        q.kill()
                    raise AssertionError(f"launch {2 * pair + i}: torchrun did not end within 120 s") from None
                assert p.returncode == 0 and "terminate called" not in err, (2 * pair + i, out + err)
