"""DDP over "lionbit" trains exactly like DDP over "gloo"; the backend starts
under torchrun, with and without `import lionbit`, and as "cpu:lionbit"; a
rank that ends without destroy_process_group, calls in flight, exits
cleanly."""

import hashlib
import os
import re
import subprocess
import sys

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


def _detail_kinds() -> tuple:
    """torch 2.11's debug wrapper has no allgather_into_tensor_coalesced, which
    DTensor's full_tensor() calls (over Gloo too): FSDP2 under DETAIL from 2.12."""
    from test_forwarded import _TORCH_2_11

    return ("ddp",) if _TORCH_2_11 else ("ddp", "fsdp2")


def _lion_runs(rank, device="cpu"):
    """DDP + DistributedLion and FSDP2 + DistributedLion, a few steps each with clipping: their parameters' digests."""
    import lionbit
    from test_fsdp import LION, _digest, _full_params, _loss, _net, _shard

    out = {}
    for kind in _detail_kinds():
        model = (DDP(_net().to(device), bucket_cap_mb=0.001) if kind == "ddp"
                 else _shard(_net(), device=None if device == "cpu" else device))
        opt = lionbit.DistributedLion(model.parameters(), **LION)
        opt.attach(model)
        for step in range(4):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        out[kind] = _digest(_full_params(model))
    return out


def lion_under_debug_detail(rank, n, store, device="cpu"):
    """A script run with TORCH_DISTRIBUTED_DEBUG=DETAIL (torch reads it when it
    is imported: these ranks are forked after that, so they read it again)."""
    import lionbit  # noqa: F401 - registers the backend

    dist.set_debug_level_from_env()
    dist.init_process_group("lionbit", init_method=f"file://{store}", rank=rank, world_size=n)
    wrapper = type(dist.distributed_c10d._get_default_group()._get_backend(torch.device(device))).__name__
    return {"wrapper": wrapper, **_lion_runs(rank, device)}


def lion_plain(rank, n, device="cpu"):
    return _lion_runs(rank, device)


def test_distributed_lion_under_torch_distributed_debug_detail(tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL, what a user sets to find a hang, wraps
    every backend in torch's checking wrapper: DistributedLion refused the
    wrapped group as not lionbit's. Now its sign calls go to the backend
    inside, and DDP and FSDP2 train bitwise as without the variable."""
    detail = values(run_ranks("test_ddp_and_launch:lion_under_debug_detail", 2, backend=None,
                              env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, kwargs={"store": str(tmp_path / "store")}))
    plain = values(run_ranks("test_ddp_and_launch:lion_plain", 2))
    assert {d.pop("wrapper") for d in detail} == {"_ProcessGroupWrapper"}
    assert detail == plain and len({d["ddp"] for d in plain}) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_distributed_lion_under_torch_distributed_debug_detail_on_a_gpu(tmp_path):
    """The same on CUDA tensors: 2 ranks on one GPU over the Gloo transport."""
    gloo = {"LIONBIT_CUDA_TRANSPORT": "gloo"}
    detail = values(run_ranks("test_ddp_and_launch:lion_under_debug_detail", 2, backend=None,
                              env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", **gloo},
                              kwargs={"store": str(tmp_path / "store"), "device": "cuda"}))
    plain = values(run_ranks("test_ddp_and_launch:lion_plain", 2, env=gloo, kwargs={"device": "cuda"}))
    assert {d.pop("wrapper") for d in detail} == {"_ProcessGroupWrapper"}
    assert detail == plain and len({d["ddp"] for d in plain}) == 1


TORCHRUN_WORKER = os.path.join(HERE, "torchrun_worker.py")


#: id -> (backend spec, import lionbit first, how the ranks end: torchrun_worker.py). Two of
#: them are also two of test_exit_without_destroy_process_group_is_clean's six exits.
LAUNCHES = {"autoload": ("lionbit", False, "exit"), "import": ("lionbit", True, "destroy"),
            "cpu-device-spec": ("cpu:lionbit", True, "exit")}


def _torchrun_workers(args_list, timeout):
    """torchrun launches of torchrun_worker.py (2 ranks each), started
    together (each mostly waits on its ranks' start): one
    (returncode, stdout, stderr) per launch."""
    penv = dict(os.environ)
    penv.pop("LOCAL_WORLD_SIZE", None)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    procs = [subprocess.Popen([torchrun, "--standalone", "--nproc-per-node=2", TORCHRUN_WORKER, *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=penv)
             for args in args_list]
    done = []
    try:
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"launch {i} ({args_list[i]}): torchrun did not end within {timeout} s") from None
            done.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


@pytest.fixture(scope="module")
def launched():
    """The three torchrun launches: id -> (returncode, stdout, stderr)."""
    args = [(spec, "import" if import_first else "noimport", end) for spec, import_first, end in LAUNCHES.values()]
    return dict(zip(LAUNCHES, _torchrun_workers(args, 180)))


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


def _exited_cleanly(rc, out, err) -> bool:
    return rc == 0 and "terminate called" not in err and sorted(re.findall(r"EXITING (\d)", out)) == ["0", "1"]


def test_exit_without_destroy_process_group_is_clean(launched):
    # Regression: a worker releasing Python-owned tensors while the
    # interpreter finalized was killed mid-destructor (std::terminate) or
    # deadlocked on the GIL, about 1 run in 10. Six launches end so: the
    # launches above whose ranks exit, and four more, two at a time.
    exits = [launched[name] for name, (_, _, end) in LAUNCHES.items() if end == "exit"]
    for _ in range(2):
        exits += _torchrun_workers([("lionbit", "noimport", "exit")] * 2, 120)
    assert len(exits) == 6
    for i, (rc, out, err) in enumerate(exits):
        assert _exited_cleanly(rc, out, err), (i, out + err)
