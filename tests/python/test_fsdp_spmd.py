"""DistributedLion on FSDP2's storage meshes: ``fully_shard(model,
mesh=storage_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` of a model
whose parameters carry spmd_types annotations (torchtitan's default
``spmd_backend="spmd_types"``), on 4 real CPU ranks: FSDP over dp_shard 4,
HSDP over (dp_replicate 2, dp_shard 2), and with tensor parallelism beside
them (storage meshes (dp_shard 2, tp 2) and (dp_replicate 2, dp_shard 1,
tp 2), torchtitan's dense storage mesh), an MoE's experts on their own
storage mesh (efsdp 2, ep 2) beside the dense parameters' (dp_shard 4),
and both: an MoE with tensor parallelism on (fsdp 2, tp 2) and (efsdp 2,
ep 2). (Context parallelism on the storage mesh: test_fsdp_cp.)

The storage mesh changes where FSDP keeps its shards, not what it reduces:
the same script on the plain meshes (``fully_shard(model, mesh=...)``, the
path the other FSDP tests check bitwise against plain-torch references)
must give bitwise the same parameters and every rank's momentum after every
step, with clipping and two micro-batches."""

import pytest
import torch
import torch.distributed.fsdp

from harness import run_ranks, values
from test_fsdp_ep_tp import Split

pytest.importorskip("spmd_types", reason="spmd_types (tools/requirements-dev.txt) is not installed")
if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    pytest.skip("this torch's fully_shard takes no dp_mesh_dims (torch >= 2.12)", allow_module_level=True)

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


# -- tensor parallelism on the storage mesh --------------------------------------------------------------------
# torchtitan's spmd_types models are local-tensor code with explicit tensor-parallel collectives. TPNet is one
# such model: a column-parallel linear, a row-parallel one, a sequence-parallel LayerNorm (each tensor-parallel
# rank normalizes its rows: its gradient is partial, summed by FSDP), a replicated head. Under spmd_types FSDP
# exposes the plain local tensors; on the plain meshes (parameters as DTensors over mesh["tp"], the layout
# torch's ColwiseParallel / RowwiseParallel give) the same code runs on their to_local() views.

TP = 2
# parameter -> its spmd_types type on tp: S(k) is Shard(k) on the plain tp mesh; I and R are Replicate() (R: each
# rank's gradient is a part of the sum, FSDP all-reduces it over tp first)
TP_LAYOUT = {"w1.weight": "S0", "w1.bias": "S0", "w2.weight": "S1", "w2.bias": "I", "norm.weight": "R",
             "norm.bias": "R", "out.weight": "I", "out.bias": "I"}


class _Copy(torch.autograd.Function):
    """Into a tensor-parallel region: identity; backward: the partial input gradients summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    """Out of a row-parallel linear: the partial outputs summed; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _local(t, partial=False):
    """What the local-tensor code computes with: FSDP hands spmd_types modules plain local tensors; on the
    plain meshes the DTensor's local part (``partial``: its gradient is this rank's part of a sum)."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=(Partial(),) if partial else None)


class ParallelLinear(torch.nn.Linear):
    """``column``: weight and bias split on their dim 0, a slice of the outputs; else row-parallel: weight
    split on dim 1, the partial outputs summed, then the whole bias."""

    def __init__(self, n_in, n_out, column, group=None):
        super().__init__(n_in, n_out)
        self.column, self.group = column, group

    def forward(self, x):
        w, b = _local(self.weight), _local(self.bias)
        if self.column:
            return torch.nn.functional.linear(_Copy.apply(x, self.group), w, b)
        return _Reduce.apply(torch.nn.functional.linear(x, w), self.group) + b


class SequenceParallelNorm(torch.nn.LayerNorm):
    """Each tensor-parallel rank normalizes its rows; the rows gathered after."""

    def __init__(self, n, group=None):
        super().__init__(n)
        self.group = group

    def forward(self, x):
        rows = Split.apply(x, self.group, 0, False)
        rows = torch.nn.functional.layer_norm(rows, self.normalized_shape, _local(self.weight, True),
                                              _local(self.bias, True), self.eps)
        return Split.apply(rows, self.group, 0, True)


class TPNet(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        torch.manual_seed(0)
        self.w1, self.w2 = ParallelLinear(10, 24, True, group), ParallelLinear(24, 10, False, group)
        self.norm, self.out = SequenceParallelNorm(10, group), torch.nn.Linear(10, 5)

    def forward(self, x):
        h = self.norm(self.w2(torch.nn.functional.gelu(self.w1(x))))
        return torch.nn.functional.linear(h, _local(self.out.weight), _local(self.out.bias))


def _tp_storage(hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:  # torchtitan keeps dp_shard in the storage mesh even at size 1
        return init_device_mesh("cpu", (2, 1, TP), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    return init_device_mesh("cpu", (2, TP), mesh_dim_names=("dp_shard", "tp"))


def _tp_model(mesh, hsdp, spmd_backend):
    """torchtitan's order: the tensor-parallel layout, then fully_shard each block, then the root."""
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp = mesh["tp"]
    model = TPNet(tp.get_group())
    dp_names = ("dp_replicate", "dp_shard") if hsdp else ("dp_shard",)
    for name, kind in TP_LAYOUT.items():
        module, attr = name.split(".")
        full = getattr(getattr(model, module), attr).detach()
        if spmd_backend:
            import spmd_types as spmd

            local = full.chunk(TP, int(kind[1]))[tp.get_local_rank()].clone() if kind[0] == "S" else full.clone()
            param = torch.nn.Parameter(local)
            with spmd.set_current_mesh(mesh):
                on_tp = spmd.S(int(kind[1])) if kind[0] == "S" else getattr(spmd, kind)
                spmd.assert_type(param, {**{n: spmd.R for n in dp_names}, "tp": on_tp})
        else:
            placement = Shard(int(kind[1])) if kind[0] == "S" else Replicate()
            param = torch.nn.Parameter(distribute_tensor(full, tp, [placement]))
        setattr(getattr(model, module), attr, param)
    if spmd_backend:
        kw = dict(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard",
                                                                replicate="dp_replicate" if hsdp else None))
    else:
        kw = dict(mesh=mesh[dp_names])
    for block in (model.w1, model.w2, model.norm):
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _storage_meshes(model) -> list:
    """Whether each FSDP unit keeps its parameters on a storage mesh (dp_mesh_dims given)."""
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state()._fsdp_param_group.mesh_info.is_spmd_mesh
            for m in model.modules() if isinstance(m, FSDPModule)]


def _tp_run(hsdp, spmd_backend):
    import lionbit

    mesh = _tp_storage(hsdp)
    dp = mesh["dp_replicate"].get_local_rank() if hsdp else mesh["dp_shard"].get_local_rank()
    model = _tp_model(mesh, hsdp, spmd_backend)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    traj = []
    for step in range(STEPS):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            g = torch.Generator().manual_seed(1000 * step + 10 * dp + micro)  # a dp rank's tp ranks: one batch
            x, y = torch.randn(6, 10, generator=g), torch.randn(6, 5, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        traj.append([p.full_tensor().flatten().tolist() for p in model.parameters()])
    return {"traj": traj, "momentum": [opt.state[p]["exp_avg"].flatten().tolist() for p in model.parameters()],
            "steps": opt.steps_taken, "placements": [str(tuple(p.placements)) for p in model.parameters()],
            "storage": _storage_meshes(model)}


def spmd_tp_runs(rank, world_size, hsdp):
    return {"spmd": _tp_run(hsdp, True), "plain": _tp_run(hsdp, False)}


# -- expert parallelism on the storage meshes -----------------------------------------------------------------
# torchtitan's MoE under spmd_types: the experts on the sparse storage mesh (efsdp, ep) with dp_mesh_dims
# shard="efsdp", the rest on the dense one (dp_shard); test_fsdp_ep's model, script and clip.


def _ep_model(hsdp, spmd_backend):
    import spmd_types as spmd
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    import test_fsdp_ep as ep

    # (dp_mod_ep 2, ep 2), dp_shard 4 (torchtitan's efsdp is dp_mod_ep); HSDP: (dp_replicate 2, dp_mod_ep 1,
    # ep 2), (dp_replicate 2, dp_shard 2)
    mesh, dp = ep._mesh(hsdp=hsdp)
    replicate = "dp_replicate" if hsdp else None
    dp_only = {"dp_replicate": spmd.R} if hsdp else {}
    if not spmd_backend:
        return mesh, ep._fsdp_ep_model(mesh, dp)
    model = ep._model(mesh["ep"])
    for layer in model.layers:
        experts = layer.moe.experts
        for key, p in list(experts.named_parameters()):  # the local experts, annotated on the sparse mesh
            local = torch.nn.Parameter(p.to_local().clone())
            with spmd.set_current_mesh(mesh):
                spmd.assert_type(local, {**dp_only, "dp_mod_ep": spmd.R, "ep": spmd.S(0)})
            experts.register_parameter(key, local)
    experts_params = {p for layer in model.layers for p in layer.moe.experts.parameters()}
    with spmd.set_current_mesh(dp):
        for p in model.parameters():
            if p not in experts_params:
                spmd.assert_type(p, {**dp_only, "dp_shard": spmd.R})
    for layer in model.layers:
        fully_shard(layer.moe.experts, mesh=mesh, dp_mesh_dims=DataParallelMeshDims("dp_mod_ep", replicate))
        fully_shard(layer, mesh=dp, dp_mesh_dims=DataParallelMeshDims("dp_shard", replicate))
    fully_shard(model, mesh=dp, dp_mesh_dims=DataParallelMeshDims("dp_shard", replicate))
    for module in model.modules():  # torchtitan's disable_fsdp_gradient_division
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    return mesh, model


def _moe_steps(model, batch, clip) -> dict:
    """test_fsdp_ep's MoE script (``clip``: with its clipping with EP): every step's parameters, the momenta."""
    import lionbit
    import test_fsdp_ep as ep

    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    params = list(model.parameters())
    traj = []
    for step in range(STEPS):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            ep._loss(model, batch, step, micro).backward()
        if clip:
            ep._clip_with_ep(params, 0.5)
        opt.step()
        opt.zero_grad()
        traj.append([p.full_tensor().flatten().tolist() for p in params])
    return {"traj": traj, "momentum": [opt.state[p]["exp_avg"].flatten().tolist() for p in params],
            "steps": opt.steps_taken, "storage": _storage_meshes(model)}


def _ep_run(hsdp, spmd_backend):
    import test_fsdp_ep as ep

    _, model = _ep_model(hsdp, spmd_backend)
    run = _moe_steps(model, torch.distributed.get_rank(), clip=True)
    params = list(model.parameters())
    return {**run, "placements": [str(tuple(p.placements)) for p in params],
            "experts": [ep._is_expert(p) for p in params]}


def spmd_ep_runs(rank, world_size, hsdp):
    return {"spmd": _ep_run(hsdp, True), "plain": _ep_run(hsdp, False)}


# -- expert parallelism beside tensor parallelism on the storage meshes ----------------------------------------
# test_fsdp_ep_tp's MoE (the router replicated over tp, each tp rank routing its part of the sequence, ep
# spanning the tp ranks) with its attention as local-tensor code (column- and row-parallel linears), on
# torchtitan's storage meshes (fsdp, tp) and (efsdp, ep); on the plain meshes the same code on DTensors.


def _ep_tp_model(spmd_backend):
    import spmd_types as spmd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import test_fsdp_ep as ep
    import test_fsdp_ep_tp as ep_tp

    dense = init_device_mesh("cpu", (2, TP), mesh_dim_names=("fsdp", "tp"))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    group = dense["tp"].get_group()
    torch.manual_seed(0)
    model = ep.TinyMoE(lambda: ep_tp.Block(group))
    layout = {}  # parameter -> its type on tp: "S<k>" (split on dim k), "R" (gradient summed over tp) or "I"
    for layer in model.layers:
        attention = layer.attention
        for name in ("wq", "wk", "wv", "wo"):
            column = name != "wo"
            linear = ParallelLinear(ep.D, ep.D, column, group)
            linear.load_state_dict(getattr(attention, name).state_dict())
            setattr(attention, name, linear)
            layout[linear.weight], layout[linear.bias] = ("S0", "S0") if column else ("S1", "I")
        layout[layer.moe.router.weight] = "R"
        ep.expert_parallel(layer.moe.experts, sparse["ep"])
    experts = {p for layer in model.layers for p in layer.moe.experts.parameters()}
    for module in list(model.modules()):
        for key, p in list(module.named_parameters(recurse=False)):
            if p in experts:
                if spmd_backend:  # the local experts, annotated on the sparse storage mesh
                    local = torch.nn.Parameter(p.to_local().clone())
                    with spmd.set_current_mesh(sparse):
                        spmd.assert_type(local, {"efsdp": spmd.R, "ep": spmd.S(0)})
                    module.register_parameter(key, local)
                continue
            kind = layout.get(p, "I")
            split = int(kind[1]) if kind[0] == "S" else None
            if spmd_backend:
                local = p.detach().chunk(TP, split)[dense["tp"].get_local_rank()] if split is not None else p.detach()
                param = torch.nn.Parameter(local.clone())
                with spmd.set_current_mesh(dense):
                    spmd.assert_type(param, {"fsdp": spmd.R, "tp": spmd.S(split) if split is not None else
                                             getattr(spmd, kind)})
            elif kind == "I":
                continue  # on the plain meshes: a plain tensor, sharded over fsdp alone
            else:
                placement = Shard(split) if split is not None else Replicate()
                param = torch.nn.Parameter(distribute_tensor(p.detach(), dense["tp"], [placement]))
            module.register_parameter(key, param)
    if spmd_backend:
        dense_kw = dict(mesh=dense, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
        sparse_kw = dict(mesh=sparse, dp_mesh_dims=DataParallelMeshDims(shard="efsdp"))
    else:
        dense_kw, sparse_kw = dict(mesh=dense["fsdp"]), dict(mesh=sparse["efsdp"])
    for layer in model.layers:
        fully_shard(layer.moe.experts, **sparse_kw)
        fully_shard(layer, **dense_kw)
    fully_shard(model, **dense_kw)
    for module in model.modules():  # torchtitan's disable_fsdp_gradient_division
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    return dense, model


def _ep_tp_run(spmd_backend):
    dense, model = _ep_tp_model(spmd_backend)
    return _moe_steps(model, dense["fsdp"].get_local_rank(), clip=False)


def spmd_ep_tp_runs(rank, world_size):
    return {"spmd": _ep_tp_run(True), "plain": _ep_tp_run(False)}


def spmd_refusal(rank, world_size):
    """dp_mesh_dims with two shard dims (torchtitan folds context parallelism into FSDP's) on a 1-D mesh, attach
    not told which ranks split a sequence: refused (test_fsdp_cp trains with it told)."""
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
    except ValueError as err:
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


def test_storage_mesh_with_two_shard_dims_needs_context_parallel():
    for rank, r in enumerate(values(run_ranks("test_fsdp_spmd:spmd_refusal", 4, timeout=240))):
        assert f"rank {rank}: FSDP shards over the storage mesh dims ('dp_shard', 'cp')" in r, r
        assert "opt.attach(model, context_parallel=mesh['cp'])" in r, r


def _check_storage_run(res, rank, r, units) -> None:
    """A rank's run on the storage meshes against its run on the plain ones: ``units`` FSDP units, all on storage
    meshes there and none here; bitwise the same parameters after every step and momenta; every rank's
    parameters alike; they moved."""
    assert all(r["spmd"]["storage"]) and not any(r["plain"]["storage"]) and len(r["spmd"]["storage"]) == units
    assert r["spmd"]["traj"] == r["plain"]["traj"], rank
    assert r["spmd"]["momentum"] == r["plain"]["momentum"], rank
    assert r["spmd"]["steps"] == STEPS
    assert r["spmd"]["traj"] == res[0]["spmd"]["traj"]
    assert r["spmd"]["traj"][0] != r["spmd"]["traj"][-1]


@pytest.mark.parametrize("hsdp", [False, True], ids=["dp_shard 2 x tp 2", "HSDP 2 x 1 x tp 2"])
def test_storage_mesh_with_tensor_parallelism_steps_as_the_plain_mesh_bitwise(hsdp):
    res = values(run_ranks("test_fsdp_spmd:spmd_tp_runs", 4, kwargs=dict(hsdp=hsdp), timeout=240))
    for rank, r in enumerate(res):
        assert r["spmd"]["placements"] == r["plain"]["placements"], rank
        _check_storage_run(res, rank, r, units=4)
    tp_ranks = (0, 1)  # one worker's two tensor-parallel ranks: their own halves of w1's momentum
    assert res[tp_ranks[0]]["spmd"]["momentum"][0] != res[tp_ranks[1]]["spmd"]["momentum"][0]
    assert res[0]["spmd"]["momentum"][-1] != res[-1]["spmd"]["momentum"][-1]  # each worker's own


@pytest.mark.parametrize("hsdp", [False, True], ids=["efsdp 2 x ep 2", "HSDP: 2 nodes of ep 2"])
def test_storage_meshes_with_expert_parallelism_step_as_the_plain_meshes_bitwise(hsdp):
    res = values(run_ranks("test_fsdp_spmd:spmd_ep_runs", 4, kwargs=dict(hsdp=hsdp), timeout=240))
    for rank, r in enumerate(res):
        assert r["spmd"]["placements"] == r["plain"]["placements"], rank
        assert r["spmd"]["experts"] == r["plain"]["experts"] and any(r["spmd"]["experts"])
        _check_storage_run(res, rank, r, units=5)


def test_storage_meshes_with_expert_and_tensor_parallelism_step_as_the_plain_meshes_bitwise():
    res = values(run_ranks("test_fsdp_spmd:spmd_ep_tp_runs", 4, timeout=240))
    for rank, r in enumerate(res):
        _check_storage_run(res, rank, r, units=5)
    assert res[0]["spmd"]["momentum"] != res[1]["spmd"]["momentum"]  # the tp ranks' parts, their experts
