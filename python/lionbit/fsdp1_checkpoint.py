"""DistributedLion's checkpoints on FSDP1 (lionbit.fsdp1): a file a rank.

Each FSDP instance's momentum is one flat full-size tensor of its rank
(hybrid: this rank's shard of its node's), which torch's FSDP1 and DCP
state dicts cannot hold, so a checkpoint is a file a rank:
:func:`state_dict` (torch's layout, each parameter's momentum a view of its
part of the flat one) or :func:`local_state_dict` (the flat momenta by
module name), each marked with whose momentum it is and checked against it
on load. Each function takes the FSDP1 attachment (lionbit.fsdp1's
FSDP1Attachment) whose optimizer's state it presents.
"""

import torch
import torch.distributed as dist

from .attachment import asked_by_torch_state_dicts


def _whose(att) -> dict:
    """Whose momentum a per-rank file holds: this rank of its group; hybrid:
    this global rank, of the layout (nodes x ranks per node) that shards it."""
    g = att.units[0].group
    if not att.hybrid:
        return {"rank": g.rank(), "world_size": g.size()}
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "hybrid": f"{att.replicas.size()} nodes x {g.size()} ranks"}


def local_state_dict(att) -> dict:
    """This rank's optimizer state for a per-rank file: the momentum of each
    FSDP instance (flat, full-size; hybrid: this rank's shard of its node's,
    the FlatParameter's local shard's size), keyed by the instance's module
    name, and the hyperparameters of every group."""
    groups = [{k: v for k, v in grp.items() if k != "params"} for grp in att.opt.param_groups]
    return {**_momenta(att, clone=True), "param_groups": groups}


def _momenta(att, clone: bool) -> dict:
    """Each FSDP instance's flat momentum by its module name, and whose they
    are: what a per-rank file holds and :func:`_load_momenta` checks."""
    return {"momentum": {u.name: u.momentum_tensor().clone() if clone else u.momentum_tensor() for u in att.units},
            "aggregation": att.opt.aggregation, **_whose(att)}


def state_dict(att) -> dict:
    """``opt.state_dict()``: torch's (the groups' hyperparameters, each
    parameter's momentum in "state") with this rank's flat momenta and whose
    they are under "lionbit" (the same storage: saved once): a file a rank,
    as under DDP. Refused where torch's FSDP or distributed-checkpoint code
    asks for it. Like torch's, it holds the live tensors."""
    _refuse_torch_optim_state(att)
    att.show_momenta()  # (parameters added to the optimizer since attach too)
    sd = torch.optim.Optimizer.state_dict(att.opt)  # "state": the views of show_momenta, as torch gives them
    sd["lionbit"] = _momenta(att, clone=False)
    return sd


def load_state_dict(att, sd: dict) -> None:
    where = "DistributedLion.load_state_dict"
    saved = sd.get("lionbit")
    if not isinstance(saved, dict) or "momentum" not in saved:
        raise ValueError(
            f"{where} (FSDP1) on rank {dist.get_rank()}: this state dict holds no momentum (lionbit's FSDP1 "
            f"state dict keeps it under 'lionbit'; a state dict written by another optimizer, or through "
            f"FSDP.optim_state_dict, has none), so the resume would start from zero momentum"
        )
    groups = sd.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in att.opt.param_groups]:
        raise ValueError(
            f"{where} (FSDP1): the state dict's parameter groups hold {[len(g['params']) for g in groups]} "
            f"parameters, this optimizer's {[len(g['params']) for g in att.opt.param_groups]}"
        )
    _load_momenta(att, saved, where)  # every check passed: torch's own load below cannot fail half-way
    torch.optim.Optimizer.load_state_dict(att.opt, {"state": {}, "param_groups": groups})
    att.show_momenta()  # torch made a new opt.state


def _refuse_torch_optim_state(att) -> None:
    """``FSDP.optim_state_dict``, ``get_optimizer_state_dict`` and ``dcp``
    hold one sharded (or replicated) value per parameter; under FSDP1 each
    rank's momentum is its own and full-size, so through them it would be
    lost without a word."""
    asker = asked_by_torch_state_dicts()
    if asker is not None:
        raise RuntimeError(
            f"DistributedLion.state_dict (FSDP1) on rank {dist.get_rank()}: called by {asker}: FSDP1's and "
            f"torch.distributed.checkpoint's optimizer state dicts (FSDP.optim_state_dict, "
            f"get_optimizer_state_dict, dcp.save) hold one sharded or replicated value per parameter, and under "
            f"FSDP1 each rank's momentum is its own, full-size (it follows the rank's local gradient), so "
            f"they would drop it. Save a file a rank: torch.save({{'model': <the model's LOCAL_STATE_DICT>, "
            f"'optim': opt.state_dict()}}, f'ckpt/rank{{rank}}.pt') (docs/fsdp.md, FSDP1 checkpoints), or "
            f"use FSDP2, whose dcp checkpoints carry every rank's momentum"
        )


def load_local_state_dict(att, sd: dict) -> None:
    opt = att.opt
    where = "DistributedLion.load_local_state_dict"
    if len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError(
            f"{where}: the checkpoint has {len(sd['param_groups'])} parameter groups, "
            f"this optimizer {len(opt.param_groups)}"
        )
    _load_momenta(att, sd, where)
    for mine, saved in zip(opt.param_groups, sd["param_groups"]):
        for k, v in saved.items():
            mine[k] = tuple(v) if k == "betas" else v


def _load_momenta(att, sd: dict, where: str) -> None:
    """Checks a per-rank file's layout, rank, aggregation and instances
    against this run, then copies its momenta into the units."""
    opt = att.opt
    mine = _whose(att)
    if sd.get("hybrid") != mine.get("hybrid"):
        raise ValueError(
            f"{where} on rank {mine['rank']}: the file was written "
            f"{'with hybrid sharding over ' + sd['hybrid'] if sd.get('hybrid') else 'without hybrid sharding'}, "
            f"this run {'shards hybrid over ' + mine['hybrid'] if att.hybrid else 'does not shard hybrid'}; "
            f"each worker's momentum (one per rank, or one per node sharded over its ranks) follows its own data, "
            f"so resume on the same layout"
        )
    if (sd.get("rank"), sd.get("world_size")) != (mine["rank"], mine["world_size"]):
        raise ValueError(
            f"{where} on rank {mine['rank']}: the file holds rank {sd.get('rank')} of {sd.get('world_size')}, "
            f"this is rank {mine['rank']} of {mine['world_size']} (each rank loads its own file; same world size)"
        )
    if sd.get("aggregation") != opt.aggregation:
        raise ValueError(
            f"{where}: the checkpoint used aggregation={sd.get('aggregation')!r}, this optimizer {opt.aggregation!r}"
        )
    units = {u.name: u for u in att.units}
    if set(sd["momentum"]) != set(units):
        raise ValueError(
            f"{where}: the checkpoint's FSDP instances {sorted(sd['momentum'])} "
            f"differ from the model's {sorted(units)}"
        )
    for name, m in sd["momentum"].items():
        u = units[name]
        if m.numel() != u.momentum_numel:
            raise ValueError(
                f"{where}: momentum of FSDP instance '{name}' has {m.numel()} elements, expected {u.momentum_numel}"
            )
    for name, m in sd["momentum"].items():
        units[name].momentum_tensor().copy_(m.reshape(-1))
