"""DistributedLion on HSDP (2 nodes x 2 ranks) through checkpoints: each
node's momentum, sharded over its ranks, saved and resumed bitwise through
opt.sharded_state_dict() + dcp, torch's get/set_optimizer_state_dict + dcp,
and a consolidated full_state_dict=True checkpoint, also as a lionbit
before the mesh's layout entry (lionbit.fsdp_checkpoint.MESH_SHAPE_KEY) wrote them; a
change of mesh fails with an error naming both meshes (through dcp.load:
DCP's size check of that entry, the first it meets), except where the
consolidated file, which holds every node's momentum, loads on it.

Each path trains K steps (the lr changed before the save), checkpoints,
trains J more (parameters P1, momenta); then a model from another seed with
another lr loads and trains J steps: parameters and every rank's momentum
must equal P1's bitwise."""

import os

import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_hsdp import LION, L, M, _config, _hsdp_model, _loss

K, J = 3, 3
MODES = ("plain", "sharded", "flattened", "full")  # flattened: torchtitan's (flatten_optimizer_state_dict)


def _build(mesh, seed, lr=None):
    import lionbit

    model = _hsdp_model(mesh, _config(), seed)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    if lr is not None:
        opt.param_groups[0]["lr"] = lr
    return model, opt


def _train(model, opt, rank, steps):
    for step in steps:
        if step == K - 1:
            opt.param_groups[0]["lr"] = 0.005
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()


def _state(model, opt):
    params = torch.cat([p.to_local().flatten() for p in model.parameters()])
    momenta = torch.cat([opt.state[p]["exp_avg"].flatten() for p in model.parameters()])
    return params.tolist(), momenta.tolist(), opt.param_groups[0]["lr"]


def _save(model, opt, rank, mode, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if mode == "plain":
        dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=where)
        return
    options = StateDictOptions(full_state_dict=mode == "full", cpu_offload=mode == "full",
                               flatten_optimizer_state_dict=mode == "flattened")
    sd = {"model": get_model_state_dict(model, options=options), "optim": get_optimizer_state_dict(model, opt,
                                                                                                  options=options)}
    if mode in ("sharded", "flattened"):
        dcp.save(sd, checkpoint_id=where)
        return
    if rank == 0:
        torch.save(sd, where + ".pt")
    dist.barrier()


def _drop_mesh_layout(optim_sd):
    """An HSDP optimizer state dict as a lionbit before MESH_SHAPE_KEY gave it."""
    from lionbit.fsdp_checkpoint import MESH_SHAPE_KEY

    optim_sd.pop(MESH_SHAPE_KEY, None)
    for st in optim_sd.get("state", {}).values():
        st.pop(MESH_SHAPE_KEY, None)
    for key in [k for k in optim_sd if k.endswith("." + MESH_SHAPE_KEY)]:  # a flattened one's
        del optim_sd[key]


def _load(model, opt, mode, where, broadcast=True, older=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if mode == "plain":
        sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
        if older:
            _drop_mesh_layout(sd["optim"])
        dcp.load(sd, checkpoint_id=where)
        model.load_state_dict(sd["model"])
        opt.load_sharded_state_dict(sd["optim"])
        return
    if mode in ("sharded", "flattened"):
        options = StateDictOptions(flatten_optimizer_state_dict=mode == "flattened")
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)}
        if older:
            _drop_mesh_layout(sd["optim"])
        dcp.load(sd, checkpoint_id=where)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"], options=options)
        return
    if not broadcast:  # every rank reads the consolidated file; its momenta go to lionbit as they are
        sd = torch.load(where + ".pt", weights_only=False)
        set_optimizer_state_dict(model, opt, sd["optim"])
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd = torch.load(where + ".pt", weights_only=False) if dist.get_rank() == 0 else {"model": {}, "optim": {}}
    if older:
        _drop_mesh_layout(sd["optim"])
    set_model_state_dict(model, sd["model"], options=options)
    set_optimizer_state_dict(model, opt, sd["optim"], options=options)


def _layout_check(opt, mode):
    """lionbit's own check of the mesh's layout (MESH_SHAPE_KEY) where the
    mesh's description (MESH_KEY) is gone: this run's state dict with the
    2x2 mesh's layout given to its loader."""
    from lionbit.fsdp_checkpoint import MESH_KEY, MESH_SHAPE_KEY

    layout = torch.arange(M * L).view(M, L)
    try:
        if mode == "plain":
            sd = opt.sharded_state_dict()
            del sd[MESH_KEY]
            sd[MESH_SHAPE_KEY] = layout
            opt.load_sharded_state_dict(sd)
        else:
            sd = opt.state_dict()
            for g in sd["param_groups"]:
                del g[MESH_KEY]
            for st in sd["state"].values():
                st[MESH_SHAPE_KEY] = layout
            opt.load_state_dict(sd)
        return "no error"
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"{type(err).__name__}: {err}"


def hsdp_checkpoints(rank, world_size, path):
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (M, L), mesh_dim_names=("replicate", "shard"))
    other = init_device_mesh("cpu", (1, M * L), mesh_dim_names=("replicate", "shard"))
    out = {}
    for mode in MODES:
        where = os.path.join(path, mode)
        model, opt = _build(mesh, 0)
        _train(model, opt, rank, range(K))
        _save(model, opt, rank, mode, where)
        _train(model, opt, rank, range(K, K + J))
        uninterrupted = _state(model, opt)

        model, opt = _build(mesh, 1, lr=0.123)  # other weights, other lr: all must come from the checkpoint
        _load(model, opt, mode, where)
        _train(model, opt, rank, range(K, K + J))
        out[mode] = {"same": _state(model, opt) == uninterrupted, "momentum": uninterrupted[1][:8],
                     "state_keys": sorted({k for st in opt.state.values() for k in st})}

        model, opt = _build(mesh, 2, lr=0.2)  # the same checkpoint without the mesh's layout (older lionbit)
        _load(model, opt, mode, where, older=True)
        _train(model, opt, rank, range(K, K + J))
        out[mode]["older_same"] = _state(model, opt) == uninterrupted

        model, opt = _build(other, 0)  # the mesh changed: 2x2 -> 1x4
        try:
            _load(model, opt, mode, where, broadcast=False)
            out[mode]["mesh_change"] = "no error"
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported to the test
            out[mode]["mesh_change"] = f"{type(err).__name__}: {err}"
        if mode in ("plain", "full"):
            out[mode]["layout_check"] = _layout_check(opt, mode)
    return out


def test_hsdp_checkpoints_resume_bitwise_and_refuse_another_mesh(tmp_path):
    res = values(run_ranks("test_hsdp_dcp:hsdp_checkpoints", M * L, kwargs=dict(path=str(tmp_path)), timeout=240))
    for mode in MODES:
        for rank, r in enumerate(res):
            assert r[mode]["same"], (mode, rank)
            assert r[mode]["older_same"], (mode, rank)
            assert r[mode]["state_keys"] == ["exp_avg"], (mode, rank, r[mode]["state_keys"])  # the layout not kept
        # the nodes' momenta differ (their own data); the replicas' agree
        assert res[0][mode]["momentum"] != res[L][mode]["momentum"]
    for rank, r in enumerate(res):
        # A consolidated checkpoint holds every node's momentum: on one node, their mean (its values:
        # test_elastic_resume). Through dcp.load, DCP refuses first, at the mesh's layout (before any
        # momentum): both mesh shapes.
        assert r["full"]["mesh_change"] == "no error", (rank, r["full"]["mesh_change"])
        first = {"plain": "optim.lionbit_mesh_shape", "sharded": "optim.state.emb.weight.lionbit_mesh_shape",
                 "flattened": "optim.state.emb.weight.lionbit_mesh_shape"}
        for mode, key in first.items():
            err = r[mode]["mesh_change"]
            assert "CheckpointException" in err and "Size mismatch between saved torch.Size([2, 2]) and " \
                f"current: torch.Size([1, 4]) for {key}\n" in err, (mode, rank, err)
            assert "37, 12" not in err, (mode, rank, err)  # not a momentum's size
        for mode, call in (("plain", "load_sharded_state_dict"), ("full", "load_state_dict (FSDP2)")):
            err = r[mode]["layout_check"]
            assert f"ValueError: DistributedLion.{call} on rank {rank}: the checkpoint was written on the mesh 2x2, " \
                "this run shards over the mesh 1x4 (replicate, shard)" in err, (mode, rank, err)
