"""DistributedLion on FSDP2's storage meshes: ``fully_shard(model,
mesh=storage_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` of a model
whose parameters carry spmd_types annotations (torchtitan's default
``spmd_backend="spmd_types"``), on 4 real CPU ranks: FSDP over dp_shard 4,
and HSDP over (dp_replicate 2, dp_shard 2).

The storage mesh changes where FSDP keeps its shards, not what it reduces:
the same script on the plain meshes (``fully_shard(model, mesh=...)``, the
path the other FSDP tests check bitwise against plain-torch references)
must give bitwise the same parameters and every rank's momentum after every
step, with clipping and two micro-batches."""

import pytest
import torch

from harness import run_ranks, values

pytest.importorskip("spmd_types", reason="spmd_types (tools/requirements-dev.txt) is not installed")

LION = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
STEPS, MICRO = 4, 2


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.GELU(), torch.nn.Linear(24, 24), torch.nn.GELU(),
                               torch.nn.Linear(24, 5))


def _storage(hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))


def _model(mesh, hsdp, spmd_backend):
    """torchtitan's order: each block, then the root; under spmd_types every parameter is annotated
    replicated over the storage mesh's dims first, and fully_shard is told which dims are FSDP's."""
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    model = _net()
    kw = dict(mesh=mesh)
    if spmd_backend:
        import spmd_types as spmd

        with spmd.set_current_mesh(mesh):
            for p in model.parameters():
                spmd.assert_type(p, {name: spmd.R for name in mesh.mesh_dim_names})
        kw["dp_mesh_dims"] = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate" if hsdp else None)
    for block in (model[0], model[2]):
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _run(hsdp, spmd_backend):
    import contextlib

    import lionbit

    rank = torch.distributed.get_rank()
    mesh = _storage(hsdp)
    model = _model(mesh, hsdp, spmd_backend)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    if spmd_backend:
        import spmd_types as spmd

        region = lambda: spmd.set_current_mesh(mesh)  # noqa: E731 - torchtitan runs the model in its mesh
    else:
        region = contextlib.nullcontext
    traj = []
    for step in range(STEPS):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
            x, y = torch.randn(6, 10, generator=g), torch.randn(6, 5, generator=g)
            with region():
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        traj.append([p.full_tensor().flatten().tolist() for p in model.parameters()])
    return {"traj": traj, "momentum": [opt.state[p]["exp_avg"].flatten().tolist() for p in model.parameters()],
            "steps": opt.steps_taken, "placements": [str(tuple(p.placements)) for p in model.parameters()]}


def spmd_runs(rank, world_size, hsdp):
    return {"spmd": _run(hsdp, True), "plain": _run(hsdp, False)}


def spmd_refusal(rank, world_size):
    """dp_mesh_dims with two shard dims (torchtitan folds context parallelism into FSDP's): refused."""
    import spmd_types as spmd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    import lionbit

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    model = _net()
    with spmd.set_current_mesh(mesh):
        for p in model.parameters():
            spmd.assert_type(p, {"dp_shard": spmd.R, "cp": spmd.R})
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("dp_shard", "cp")))
    try:
        lionbit.DistributedLion(model.parameters(), **LION).attach(model)
        return "no error"
    except NotImplementedError as err:
        return str(err)


@pytest.mark.parametrize("hsdp", [False, True], ids=["FSDP over dp_shard 4", "HSDP 2 x 2"])
def test_storage_mesh_steps_as_the_plain_mesh_bitwise(hsdp):
    res = values(run_ranks("test_fsdp_spmd:spmd_runs", 4, kwargs=dict(hsdp=hsdp), timeout=240))
    for rank, r in enumerate(res):
        assert r["spmd"]["traj"] == r["plain"]["traj"], rank
        assert r["spmd"]["momentum"] == r["plain"]["momentum"], rank
        assert r["spmd"]["steps"] == STEPS
        assert r["spmd"]["traj"] == res[0]["spmd"]["traj"]
        assert r["spmd"]["traj"][0] != r["spmd"]["traj"][-1]  # the parameters moved
    assert res[0]["spmd"]["momentum"] != res[-1]["spmd"]["momentum"]  # each worker's own


def test_storage_mesh_with_two_shard_dims_is_refused():
    for r in values(run_ranks("test_fsdp_spmd:spmd_refusal", 4, timeout=240)):
        assert "dp_mesh_dims with several shard or replicate dims" in r, r
