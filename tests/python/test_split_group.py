"""Groups split from a lionbit group: ``dist.split_group``, and the
DeviceMesh that torch builds by splitting once ``init_process_group`` was
given a ``device_id`` (on a GPU machine: ``init_process_group("lionbit",
device_id=torch.device("cuda", local_rank))``, then ``init_device_mesh``).
Without the split, that mesh stopped in torch with "its backend does not
support splitting". A split's child is a lionbit backend as new_group's, so
the HSDP run on such a mesh is checked bitwise against test_hsdp's reference
(an independent simulation of Distributed Lion with plain torch).

This machine has no GPU. The ranks bind the default group to a CPU device
(with init_process_group's device_id where torch takes a CPU one, 2.15;
else as torch 2.11 binds a GPU's), and while DeviceMesh builds the mesh
torch says an accelerator is there (torch.accelerator in 2.15, torch.cuda
in 2.11: what DeviceMesh asks before it splits); it then splits the default
group, counted here. (LIONBIT_CUDA_TRANSPORT=gloo: lionbit, asked meanwhile
to make a group, reaches for no NCCL.)"""

import pytest
import torch
import torch.distributed as dist

import test_hsdp
from harness import run_ranks, values

GLOO = {"LIONBIT_CUDA_TRANSPORT": "gloo"}


def _cpu_binds() -> bool:
    """Whether this torch binds a group to a CPU device id (torch 2.15; 2.11
    wants an accelerator's)."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    return "must be an accelerator with an index" not in inspect.getsource(c10d._new_process_group_helper)


def _init(rank, n, store):
    """The script's first line on a GPU machine, with the CPU's device."""
    import lionbit  # noqa: F401 - registers the backend

    cpu0 = torch.device("cpu", 0)
    dist.init_process_group("lionbit", init_method=f"file://{store}", rank=rank, world_size=n,
                            device_id=cpu0 if _cpu_binds() else None)
    dist.distributed_c10d._get_default_group().bound_device_id = cpu0  # (what torch 2.11 sets for a GPU)


def split_collectives(rank, n, store):
    """dist.split_group into [0, 2] and [1]: the standard collectives and the
    sign vote over the child, its errors naming global ranks; new_group with
    the device bound (rank 1, outside it, takes the no-op part of a split),
    where this torch makes groups bound to a CPU device."""
    import lionbit

    _init(rank, n, store)
    out = {}
    child = dist.split_group(split_ranks=[[0, 2], [1]])
    out["ranks"] = dist.get_process_group_ranks(child)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=child)
    out["sum"] = t.tolist()
    x = torch.tensor([3.0, -1.0, 0.5, -2.0]) * (1 if rank == 0 else -1 if rank == 2 else 1)
    x[2] = 0.0 if rank == 2 else x[2]
    lionbit.all_reduce_sign(x, "vote", group=child)
    out["vote"] = x.tolist()
    if rank != 1:
        bad = torch.ones(4)
        bad[1] = float("nan") if rank == 2 else 1.0
        try:
            lionbit.all_reduce_sign(bad, group=child)
        except lionbit.NonFiniteInput as err:
            out["nan"] = (str(err), err.ranks)
    if _cpu_binds():  # (torch 2.11 makes no group bound to a CPU device)
        pair = dist.new_group([0, 2])
        if rank != 1:
            y = torch.ones(2) * (rank + 1)
            dist.all_reduce(y, group=pair)
            out["pair"] = y.tolist()
    dist.barrier()
    return out


def test_split_group_collectives_and_errors(tmp_path):
    res = values(run_ranks("test_split_group:split_collectives", 3, backend=None, env=GLOO,
                           kwargs={"store": str(tmp_path / "store")}))
    assert [r["ranks"] for r in res] == [[0, 2], [1], [0, 2]]
    assert [r["sum"] for r in res] == [[2.0] * 3, [1.0] * 3, [2.0] * 3]
    # rank 0's signs [+, -, +, -] and rank 2's [-, +, 0, +]: ties (0) but the zero, where rank 0 wins
    assert res[0]["vote"] == res[2]["vote"] == [0.0, 0.0, 1.0, 0.0]
    assert res[1]["vote"] == [1.0, -1.0, 1.0, -1.0]  # a group of one: its own signs
    for rank in (0, 2):
        msg, ranks = res[rank]["nan"]
        assert ranks == [2], ranks
        assert msg.startswith(f"lionbit all_reduce_sign(op=vote) on rank {rank} (group of ranks [0, 2]): input "
                              "contains NaN on rank(s) [2]"), msg
        assert res[rank].get("pair") == ([4.0, 4.0] if _cpu_binds() else None)


def _as_on_a_gpu_machine(build):
    """``build()`` while torch believes an accelerator (the CPU) is there:
    DeviceMesh then splits the default group, as it does on a GPU once the
    default group has a device. Returns what build returned and how many
    times DeviceMesh called split_group."""
    import torch.distributed.device_mesh as dm

    calls, split = [], dm.split_group

    def counted(*args, **kw):
        calls.append(kw.get("split_ranks"))
        return split(*args, **kw)

    patched = [(torch.accelerator, "is_available", lambda: True),
               (torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")),
               (torch.cuda, "is_available", lambda: True),
               (dm, "split_group", counted)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patched]
    for obj, name, value in patched:
        setattr(obj, name, value)
    try:
        return build(), len(calls)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def hsdp_on_a_split_mesh(rank, n, store):
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, n, store)
    mesh, splits = _as_on_a_gpu_machine(
        lambda: init_device_mesh("cpu", (test_hsdp.M, test_hsdp.L), mesh_dim_names=("replicate", "shard")))
    return {"splits": splits, "run": test_hsdp._train(rank, mesh, test_hsdp._config())}


def test_hsdp_on_a_mesh_split_from_the_default_group_equals_the_reference(tmp_path):
    n = test_hsdp.M * test_hsdp.L
    res = values(run_ranks("test_split_group:hsdp_on_a_split_mesh", n, backend=None, timeout=240, env=GLOO,
                           kwargs={"store": str(tmp_path / "store")}))
    assert all(r["splits"] == 2 for r in res), [r["splits"] for r in res]  # one split a mesh dim
    cfg = test_hsdp._config()
    runs = [r["run"] for r in res]
    assert all(r["traj"] == runs[0]["traj"] for r in runs)
    run = dict(runs[0])
    run["norms"] = [[] for _ in range(test_hsdp.M)]
    ref = test_hsdp._reference(cfg, run)
    for step, (got, want) in enumerate(zip(run["traj"], ref["steps"])):
        assert got == want, f"step {step}: the run differs from the M-worker reference"
    assert run["steps"] == ref["applied"] == cfg["steps"]


def hsdp_on_a_gpu(rank, n, store, bind):
    """HSDP on CUDA parameters over a 2 x 2 mesh, the default group bound to
    the GPU (``bind``: torch splits it for the mesh) or not (new_group)."""
    import torch.distributed.device_mesh as dm
    from torch.distributed.fsdp import fully_shard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import lionbit

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("lionbit", init_method=f"file://{store}", rank=rank, world_size=n,
                            device_id=device if bind else None)
    calls, split = [], dm.split_group
    dm.split_group = lambda *a, **k: calls.append(1) or split(*a, **k)
    try:
        mesh = dm.init_device_mesh("cuda", (test_hsdp.M, test_hsdp.L), mesh_dim_names=("replicate", "shard"))
    finally:
        dm.split_group = split
    model = test_hsdp._model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = lionbit.DistributedLion(model.parameters(), **test_hsdp.LION).attach(model)
    torch.use_deterministic_algorithms(True, warn_only=True)  # (the two runs compared bitwise)
    for step in range(3):
        tokens = test_hsdp._batch(rank, step).to(device)
        with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels' backward need not be deterministic
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, test_hsdp.V), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return {"splits": len(calls), "params": [p.full_tensor().cpu().flatten().tolist() for p in model.parameters()]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_hsdp_on_a_gpu_mesh_split_from_a_bound_default_group(tmp_path):
    """The GPU machine's own path: ``init_process_group("lionbit",
    device_id=...)`` then ``init_device_mesh("cuda", ...)``, which splits the
    default group; the run equals the same script without the device_id
    (a mesh of new_group's groups) bitwise, on every rank. 4 ranks on the
    host's GPUs (several on one: Gloo carries the CUDA tensors)."""
    env = {"LIONBIT_CUDA_TRANSPORT": "gloo", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    runs = {}
    for bind in (True, False):
        runs[bind] = values(run_ranks("test_split_group:hsdp_on_a_gpu", test_hsdp.M * test_hsdp.L, backend=None,
                                      env=env, timeout=300,
                                      kwargs={"store": str(tmp_path / f"store{int(bind)}"), "bind": bind}))
    assert [r["splits"] for r in runs[True]] == [2] * 4 and [r["splits"] for r in runs[False]] == [0] * 4
    assert all(r["params"] == runs[False][0]["params"] for r in runs[True] + runs[False])
