"""DistributedLion's checkpoints on FSDP2 and HSDP (lionbit.fsdp): each
worker's momentum presented to torch's state dicts and
torch.distributed.checkpoint as a row of one DTensor, and taken back.

``opt.state_dict()`` (:func:`state_dict`, so also torch's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) and
:func:`sharded_state_dict` / :func:`load_sharded_state_dict` (also
``opt.sharded_state_dict()``) present each rank's momentum as one DTensor of
shape (N, *param_shape) sharded on dim 0 of the FSDP mesh, so
``torch.distributed.checkpoint`` stores every rank's own momentum and a
``full_state_dict=True`` checkpoint holds all N of them (row r: rank r's).
Resuming needs the same number of ranks, except through ``dcp.load`` with
lionbit.ElasticLoadPlanner (lionbit.elastic: every worker starts from the
mean of the saved momenta). Under HSDP each state dict also
carries the mesh's rank layout (:data:`MESH_SHAPE_KEY`) ahead of the momenta,
so that ``dcp.load`` on another mesh fails on it first, naming both mesh
shapes. Each function takes the FSDP2 attachment (lionbit.fsdp's
FSDP2Attachment) whose optimizer's state it presents.
"""

import copy
import sys
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from . import momentum_mean, tensor_parallel, torch_internals, user_warning

#
# Each rank's momentum is full-size and its own (it follows the rank's local
# gradients), so a checkpoint keeps N momenta per parameter. In every state
# dict below, the momentum of a parameter of shape S is a DTensor of global
# shape (N, *S) sharded on dim 0 over the FSDP mesh: row r is rank r's
# momentum, and rank r's local tensor (1, *S) is a view of its momentum.
# torch.distributed.checkpoint then writes every rank's row (a plain tensor
# counts as replicated: dcp.save writes one rank's copy, whichever rank its
# de-duplication balances the write onto, parameter by parameter), and
# full_state_dict=True gathers the rows: a consolidated checkpoint holds all N
# momenta stacked. Loading needs the same number of ranks (lionbit.elastic's
# planner loads another number as the rows' mean).


def _rows(att, p: torch.Tensor, m: torch.Tensor):
    """This worker's momentum m as row ``att.dp.row`` of a (workers, *shape)
    DTensor (sharing m's memory). 1-D: row r is rank r's, placed Shard(0)
    over the FSDP mesh. HSDP: row r is node r's, placed (Shard(0), Shard(1))
    over (replicate, shard): the rows over the replicas, each row's dim 1
    sharded as FSDP shards the parameter's dim 0 (torch.chunk's split, which
    DTensor's Shard shares). With tensor parallelism each row is placed over
    the tensor-parallel dim as p (lionbit.tensor_parallel.rows_placements)."""
    from . import elastic  # optional: imports torch.distributed.checkpoint

    if att.replicas is None and p not in att.split:
        return elastic.presented(DTensor.from_local(m.unsqueeze(0), p.device_mesh, [Shard(0)], run_check=False))
    shape = (att.mesh_of[p].rows, *p.shape)
    return elastic.presented(
        DTensor.from_local(m.unsqueeze(0), p.device_mesh, tensor_parallel.rows_placements(p), run_check=False,
                           shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride()))


def _own_part(att, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full tensor of p's shape: with tensor
    parallelism its tensor-parallel part; under HSDP then its block of that
    along FSDP's shard dim (FSDP's chunk: Shard(0), its rows)."""
    if p in att.split:
        t = tensor_parallel.part(p, t)
    if att.replicas is None:
        return t
    mesh, k = att.mesh_of[p], torch_internals.fsdp2_shard_dim(att.managed[p])
    width = -(-t.shape[k] // mesh.shards)
    return t.narrow(k, min(mesh.shard * width, t.shape[k]), p.to_local().shape[k])


def _other_workers(att, p: torch.Tensor, value) -> bool:
    """Whether a loaded momentum holds the momenta of another number of
    workers than this run has (:func:`_own_row` loads their mean)."""
    return momentum_mean.are_rows(value, p) and value.shape[0] != att.mesh_of[p].rows


def _consolidated(p: torch.Tensor, value) -> bool:
    """Whether a loaded momentum is a consolidated file's rows, every
    worker's of the run that wrote it: plain (workers, *shape), or as
    torch's set_optimizer_state_dict(full_state_dict=True) distributed them
    over this run's mesh (not rows lionbit presented, not a per-rank file's,
    whose mesh is the run's that wrote it). They load on any mesh: each
    saved worker's row, resharded, where the number of workers is this
    run's; their mean where it is not."""
    if not momentum_mean.are_rows(value, p):
        return False
    if not isinstance(value, DTensor):
        return True
    elastic = sys.modules.get(__package__ + ".elastic")
    return value.device_mesh == p.device_mesh and not (elastic is not None and elastic.is_presented(value))


def _own_row(att, p: torch.Tensor, value, name: str, where: str, unsure: Optional[list] = None,
             averaged: Optional[list] = None) -> torch.Tensor:
    """This rank's momentum out of a loaded value: the (workers, *shape)
    DTensor of :func:`_rows`, or a plain (workers, *shape) tensor (a
    consolidated checkpoint given to load_state_dict as it is): its worker's
    row (HSDP: this rank's chunk of it); the same holding another number of
    workers' momenta (a consolidated file, plain or distributed by torch's
    ``set_optimizer_state_dict(full_state_dict=True)``): their mean
    (lionbit.momentum_mean; a collective where torch distributed them), the
    number of saved workers and the name added to ``averaged``; a plain
    tensor of the parameter's shape (what torch's default state_dict held
    before): taken as it is (HSDP: this rank's chunk), its name added to
    ``unsure`` (see :func:`_warn_unsure`)."""
    shape = tuple(p.shape)
    mesh = att.mesh_of[p]
    n, row = mesh.rows, mesh.row
    mine = tuple(att.momentum(p).shape)  # the parameter's shape (1-D), its local shard's (HSDP), tensor-parallel
    placed = tensor_parallel.rows_placements(p)
    rows = (n, *shape)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: momentum of '{name}' is a {type(value).__name__}, not a tensor")
    if isinstance(value, DTensor):
        local = value.to_local()
        if tuple(value.shape) == rows and tuple(value.placements) == placed and tuple(local.shape) == (1, *mine):
            elastic = sys.modules.get(__package__ + ".elastic")
            mean = elastic.mean_loaded(value) if elastic is not None else None  # another number of workers saved it
            return local[0] if mean is None else mean[0]
        if (_other_workers(att, p, value) and tuple(value.placements) == placed
                and value.device_mesh == p.device_mesh and tuple(local.shape[1:]) == mine):
            if averaged is not None:
                averaged.append((value.shape[0], name))
            return momentum_mean.of_distributed(value, momentum_mean.rows_mesh_dim(placed), att.opt.momentum_dtype)
        got = f"a DTensor of shape {tuple(value.shape)} placed {tuple(value.placements)}"
    else:
        if tuple(value.shape) == rows:
            return _own_part(att, p, value[row])
        if _other_workers(att, p, value):
            if averaged is not None:
                averaged.append((value.shape[0], name))
            return _own_part(att, p, momentum_mean.of_stacked(value, att.opt.momentum_dtype))
        if tuple(value.shape) == shape:
            if unsure is not None:
                unsure.append(name)
            return _own_part(att, p, value)
        got = f"a tensor of shape {tuple(value.shape)}"
    hint = ""
    if value.dim() == len(shape) + 1 and tuple(value.shape[1:]) == shape and value.shape[0] != n:
        hint = (
            f": it holds the momenta of {value.shape[0]} ranks and this run has {n}; each rank's momentum "
            f"follows its own data, so resume with the same number of ranks"
        ) if att.replicas is None else (
            f": it holds the momenta of {value.shape[0]} nodes and this run has {n} (mesh {mesh.describe()}); "
            f"each node's momentum follows its own data, so resume on the same mesh"
        )
        hint += (", or load a torch.distributed.checkpoint checkpoint with dcp.load(..., "
                 "planner=lionbit.ElasticLoadPlanner()): every worker then starts from the mean of the saved momenta")
    raise ValueError(
        f"{where} on rank {dist.get_rank()}: momentum of '{name}' is {got}; expected {rows} placed {placed}, row r "
        f"being worker r's momentum (as state_dict() gives it on the mesh {mesh.describe()}){hint}"
    )


#: Where an HSDP state dict records its mesh (every parameter group of
#: state_dict(), the top level of sharded_state_dict()).
MESH_KEY = "lionbit_mesh"

#: Where an HSDP state dict carries the mesh's rank layout, a plain tensor
#: of the mesh's shape (M, L), ahead of the momenta: the first entry of
#: sharded_state_dict(), the first of every parameter's state in
#: state_dict(). torch.distributed.checkpoint's load planner checks each
#: entry's saved size in the state dict's order and stops at the first that
#: differs, so on another mesh ``dcp.load`` refuses with "Size mismatch
#: between saved torch.Size([2, 2]) and current: torch.Size([1, 4]) for
#: optim...lionbit_mesh_shape" (the two meshes) rather than on a momentum
#: (whose dim 0 only counts the nodes). The loaders check it and never keep
#: it as optimizer state; a state dict without it (a 1-D mesh's, an older
#: lionbit's) loads as before.
MESH_SHAPE_KEY = "lionbit_mesh_shape"


def _mesh_layout(att, device) -> torch.Tensor:
    """HSDP: the mesh's rank layout as a new plain int64 tensor on the
    momenta's device (DCP, which counts a plain tensor as replicated, writes
    one rank's copy: it is the same on every rank; ``dcp.load`` writes into
    it, so it is never the mesh's own)."""
    from . import elastic  # optional: imports torch.distributed.checkpoint

    layout = torch.as_tensor(att.dp.device_mesh.mesh).to(device=device, dtype=torch.int64, copy=True)
    return elastic.presented_layout(layout, MESH_KEY)


def _remeshed(layout) -> bool:
    """Whether dcp.load with lionbit.ElasticLoadPlanner met this layout
    against a checkpoint of another mesh: its rows are then this mesh's
    (each node's momentum resharded, or the mean of the saved nodes')."""
    elastic = sys.modules.get(__package__ + ".elastic")
    return elastic is not None and elastic.remeshed(layout)


def _check_mesh_layout(att, value, where: str) -> None:
    """A state dict's :data:`MESH_SHAPE_KEY` entry against this run's mesh:
    the clear error of :func:`_check_mesh` when its shape differs."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        raise ValueError(
            f"{where} on rank {dist.get_rank()}: '{MESH_SHAPE_KEY}' is a {type(value).__name__}; expected the plain "
            f"tensor of the mesh's rank layout that state_dict() gives (shape {tuple(att.dp.device_mesh.shape)} on "
            f"the mesh {att.dp.describe()})"
        )
    shape = tuple(value.shape)
    if shape != tuple(att.dp.device_mesh.shape):
        _check_mesh(att, "x".join(str(n) for n in shape) or "of shape ()", where)


def _saved_mesh(att, d: dict, has_layout: bool = False):
    """The mesh a state dict (or one of its groups) records: HSDP's own; a
    1-D run's records none. None where it records none but carries the
    mesh's layout (``has_layout``: MESH_SHAPE_KEY, which is checked
    instead), and where torch's set_optimizer_state_dict unflattened it
    (``flatten_optimizer_state_dict=True``, torchtitan's): that keeps only
    the optimizer's own keys, and dcp.load checked MESH_SHAPE_KEY before."""
    saved = d.get(MESH_KEY)
    if saved is None and att.replicas is not None and not has_layout:
        if torch_internals.loading_flattened_optimizer_state():  # (torch kept no entry of lionbit's own)
            return None
        return "a 1-D mesh (FSDP without HSDP), or an older lionbit"
    return saved


def _check_mesh(att, saved, where: str) -> None:
    """The mesh a checkpoint was written on (None: not recorded) against this run's."""
    if saved is not None and saved != att.dp.describe():
        raise ValueError(
            f"{where} on rank {dist.get_rank()}: the checkpoint was written on the mesh {saved}, this run shards "
            f"over the mesh {att.dp.describe()}; each worker's momentum (one per rank on a 1-D mesh, one per node "
            f"under HSDP) follows its own data, so resume on the same mesh, or through dcp.load(..., "
            f"planner=lionbit.ElasticLoadPlanner()) on another (the nodes' momenta resharded, or their mean "
            f"where the number of nodes changes)"
        )


def _warn_unsure(att, names: list, where: str) -> None:
    if names:
        user_warning.warn(
            f"{where} on rank {dist.get_rank()}: the momentum of {len(names)} parameter(s) "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) is one tensor of the parameter's shape, "
            f"not one per rank, so whose it is cannot be told: this rank continues from it. A per-rank file of "
            f"this rank resumes exactly; a checkpoint of single-process Lion, another rank's file, or a DCP "
            f"checkpoint written before lionbit kept every rank's momentum (DCP kept one rank's copy) does not "
            f"continue bitwise"
        )


def state_dict(att) -> dict:
    """``DistributedLion.state_dict()`` under FSDP2 (after attach): torch's
    layout (``{"state": {index: {"exp_avg": ...}}, "param_groups": [...]}``,
    parameters numbered in param_groups order, the state-dict hooks run), each
    momentum the (N, *shape) DTensor described above, sharing memory with the
    momentum (``dcp.load`` into it restores in place). Parameters without
    momentum get zero momentum first, so the state dict is complete.

    Through torch.distributed.checkpoint.state_dict: the default options give
    every rank its row, which dcp.save / dcp.load keep per rank;
    ``full_state_dict=True`` gathers the rows into one plain (N, *shape)
    tensor per parameter (``cpu_offload=True``: on rank 0 only), a
    consolidated checkpoint of every rank's momentum, N times a parameter's
    size. HSDP: every parameter's state starts with :data:`MESH_SHAPE_KEY`
    (and every parameter group records :data:`MESH_KEY`)."""
    opt = att.opt
    for hook in torch_internals.state_dict_hooks(opt, "state_dict_pre"):
        hook(opt)
    att.momenta()  # zero momentum where a parameter has none yet: the state dict is complete
    index: Dict[int, int] = {}
    groups = []
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        if att.replicas is not None:  # HSDP: the mesh the rows belong to (a 1-D state dict stays as it was)
            packed[MESH_KEY] = att.dp.describe()
        packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
        groups.append(packed)
    state = {}
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            # HSDP: the mesh's layout first (MESH_SHAPE_KEY): torch's state_dict helpers keep a parameter's
            # entries in order, so DCP meets it before the momentum
            first = {MESH_SHAPE_KEY: _mesh_layout(att, p.device)} if att.replicas is not None else {}
            state[index[id(p)]] = first | {
                k: (_rows(att, p, v) if k == "exp_avg" and p in att.managed else v) for k, v in st.items()
            }
    sd = {"state": state, "param_groups": groups}
    for hook in torch_internals.state_dict_hooks(opt, "state_dict_post"):
        out = hook(opt, sd)
        if out is not None:
            sd = out
    return sd


def load_state_dict(att, state_dict: dict) -> None:
    """``DistributedLion.load_state_dict()`` under FSDP2 (after attach): what
    :func:`state_dict` gave (after dcp.load into it), or the same with keys
    renamed (torch's get/set_optimizer_state_dict use parameter names), or a
    consolidated (N, *shape) momentum: rank r takes row r. Parameters are
    matched by position in param_groups, as torch does; the hyperparameters
    come from the state dict. The momentum is copied into the optimizer's own
    tensor in its momentum_dtype (torch's Optimizer.load_state_dict would cast
    it to the parameter's dtype). Everything is checked before anything
    changes. A parameter's :data:`MESH_SHAPE_KEY` entry is checked against
    this run's mesh and dropped; a state dict without it loads alike."""
    where = "DistributedLion.load_state_dict (FSDP2)"
    opt = att.opt
    sd = dict(state_dict)
    for hook in torch_internals.state_dict_hooks(opt, "load_state_dict_pre"):
        out = hook(opt, sd)
        if out is not None:
            sd = out
    groups, saved_groups = opt.param_groups, sd["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"{where}: the state dict has {len(saved_groups)} parameter groups, this optimizer {len(groups)}"
        )
    ids = {}
    for i, (mine, saved) in enumerate(zip(groups, saved_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(
                f"{where}: parameter group {i} has {len(saved['params'])} parameters in the state dict, "
                f"{len(mine['params'])} in this optimizer"
            )
        ids.update(zip(saved["params"], mine["params"]))
    has_layout = any(isinstance(st, dict) and MESH_SHAPE_KEY in st for st in sd["state"].values())
    # The mesh is checked unless the rows are this mesh's (dcp.load with lionbit's planner) or a
    # consolidated file's (every saved worker's: they load on any mesh).
    remeshed = any(isinstance(st, dict) and (_remeshed(st.get(MESH_SHAPE_KEY)) or (
        key in ids and _consolidated(ids[key], st.get("exp_avg")))) for key, st in sd["state"].items())
    if not remeshed:
        for saved in saved_groups:
            _check_mesh(att, _saved_mesh(att, saved, has_layout), where)
    marker = sd.get("lionbit")  # optim.py's {"rank", "world_size"} of a per-rank state dict
    own_file = isinstance(marker, dict) and (marker.get("rank"), marker.get("world_size")) == (
        att.dp.row,
        att.dp.rows,
    )
    unsure, averaged = [], []
    loaded = {}
    for key, st in sd["state"].items():
        p = ids.get(key)
        if p is None:
            raise ValueError(f"{where}: the state dict has state for parameter {key!r}, which no parameter group lists")
        name = att.fqns.get(p, str(key))
        if MESH_SHAPE_KEY in st and not remeshed:  # the mesh's layout: checked, never kept
            _check_mesh_layout(att, st[MESH_SHAPE_KEY], where)
        loaded[p] = {
            k: (_own_row(att, p, v, name, where, unsure, averaged) if k == "exp_avg" else v)
            for k, v in st.items() if k != MESH_SHAPE_KEY
        }
    if not own_file:
        _warn_unsure(att, unsure, where)
    if averaged:
        momentum_mean.warn(where, averaged[0][0], att.dp.rows, averaged[0][1])
    # Checked: now change the optimizer. Its state becomes the state dict's.
    for p in [p for p in opt.state if p not in loaded]:
        del opt.state[p]
    for p, new in loaded.items():
        row = new.pop("exp_avg", None)
        st = opt.state[p]
        old = st.get("exp_avg")
        st.clear()
        st.update(new)
        if row is None:
            continue
        if old is None or old.dtype != opt.momentum_dtype or old.shape != row.shape:
            old = torch.zeros(row.shape, dtype=opt.momentum_dtype, device=p.device)
        if not (row.data_ptr() == old.data_ptr() and row.dtype == old.dtype and row.stride() == old.stride()):
            old.copy_(row)
        st["exp_avg"] = old
    for mine, saved in zip(groups, saved_groups):
        for k, v in saved.items():
            if k not in ("params", MESH_KEY):
                mine[k] = tuple(v) if k == "betas" else copy.deepcopy(v)
    for hook in torch_internals.state_dict_hooks(opt, "load_state_dict_post"):
        hook(opt)


def sharded_state_dict(att) -> dict:
    """The optimizer's state for ``torch.distributed.checkpoint`` used
    directly (without torch's state_dict helpers): each parameter's momentum
    as the (N, *param_shape) DTensor above, keyed by the parameter's name;
    the hyperparameters of every parameter group as plain values. Its
    DTensors share memory with the momentum: ``dcp.load`` into it restores
    in place; call :func:`load_sharded_state_dict` afterwards. HSDP: the
    mesh's rank layout comes first (:data:`MESH_SHAPE_KEY`), and its
    description is recorded (:data:`MESH_KEY`)."""
    opt = att.opt
    momentum = {}
    for p in att.managed:
        if not p.requires_grad:
            continue
        momentum[att.fqns[p]] = _rows(att, p, att.momentum(p))
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    sd = {"momentum": momentum, "param_groups": hyper, "aggregation": opt.aggregation}
    if att.replicas is not None:  # HSDP: the mesh the rows belong to (a 1-D state dict stays as it was)
        sd[MESH_KEY] = att.dp.describe()
        # its layout first: DCP then meets it before any momentum (MESH_SHAPE_KEY)
        sd = {MESH_SHAPE_KEY: _mesh_layout(att, next(iter(att.managed)).device)} | sd
    return sd


def load_sharded_state_dict(att, sd: dict) -> None:
    where = "DistributedLion.load_sharded_state_dict"
    opt = att.opt
    if sd.get("aggregation", opt.aggregation) != opt.aggregation:
        raise ValueError(
            f"{where}: the checkpoint used aggregation={sd['aggregation']!r}, this optimizer {opt.aggregation!r}"
        )
    groups = sd["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"{where}: the checkpoint has {len(groups)} parameter groups, this optimizer {len(opt.param_groups)}"
        )
    if not _remeshed(sd.get(MESH_SHAPE_KEY)):
        _check_mesh(att, _saved_mesh(att, sd, MESH_SHAPE_KEY in sd), where)
        if MESH_SHAPE_KEY in sd:  # the mesh's layout (absent from a 1-D or an older state dict)
            _check_mesh_layout(att, sd[MESH_SHAPE_KEY], where)
    by_name = {n: p for p, n in att.fqns.items()}
    rows, unsure, averaged = {}, [], []
    for name, value in sd["momentum"].items():
        p = by_name.get(name)
        if p is None or p not in att.managed:
            raise ValueError(f"{where}: unknown parameter '{name}' in the checkpoint")
        rows[p] = _own_row(att, p, value, name, where, unsure, averaged)
    _warn_unsure(att, unsure, where)
    if averaged:
        momentum_mean.warn(where, averaged[0][0], att.dp.rows, averaged[0][1])
    for p, row in rows.items():
        m = att.momentum(p)
        if row.data_ptr() != m.data_ptr():
            m.copy_(row)
    for mine, saved in zip(opt.param_groups, groups):
        for k, v in saved.items():
            if k != MESH_KEY:
                mine[k] = tuple(v) if k == "betas" else v
