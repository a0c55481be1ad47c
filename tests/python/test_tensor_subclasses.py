"""DistributedLion on parameters that are tensor subclasses, as a user's
training loop has them: torchtitan's float8 training (torchao's
``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather``) makes
every linear weight a wrapper subclass that keeps its values in a tensor it
holds and casts them to float8 for FSDP2's all-gather. Such a wrapper has no
memory of its own (its data pointer is null): the kernels update the tensor
it holds, which is what its own in-place ops change. Before, the step wrote
through the null pointer and every rank died of a segmentation fault.

The wrapper here (``CastOnUse``) has the shape of torchao's, without the
cast: it keeps its values in ``_t``, runs every op on them and stays a
wrapper through the ops FSDP2 shards and copies with (its local shards are
wrappers; FSDP2 all-gathers their values). A plain module, DDP and FSDP2 with its
weights wrapped train bitwise as numpy Distributed Lion of the same
gradients (each rank's from a plain copy of the model at the reference's
parameters, gathered), with clipping; the weights stay wrapped. A subclass
that holds no tensor of its values (a packed or quantized form) is refused
on every rank before anything changes, naming it; so is a wrapper handed to
the sign collective. With torchao installed (tools/requirements-dev.txt),
its float8 training under FSDP2 with the float8 all-gather steps bitwise as
DDP over the same float8 model."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from harness import run_ranks, values
from test_fsdp import LION, _full_params, _loss, _net, _shard
from test_optim import ReferenceLion

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

STEPS = 4
MAX_NORM = 0.5  # small enough that the loop clips


class CastOnUse(torch.Tensor):
    """A wrapper subclass holding its values in ``_t`` (torchao's float8
    training weight without the cast)."""

    # what FSDP2 shards, copies and pads a parameter with: the result stays a wrapper
    KEEP = {
        torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
        torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
        torch.ops.aten._to_copy.default, torch.ops.aten.split.Tensor, torch.ops.aten.clone.default,
    }

    @staticmethod
    def __new__(cls, t):
        return torch.Tensor._make_wrapper_subclass(
            cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(), dtype=t.dtype,
            layout=t.layout, device=t.device, requires_grad=t.requires_grad)

    def __init__(self, t):
        self._t = t

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func == torch.ops.aten.detach.default:
            return CastOnUse(args[0]._t)
        args, kwargs = pytree.tree_map_only(CastOnUse, lambda x: x._t, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, CastOnUse, out) if func in cls.KEEP else out

    def __tensor_flatten__(self):
        return ["_t"], None

    @staticmethod
    def __tensor_unflatten__(inner, spec, size, stride):
        return CastOnUse(inner["_t"])


class Packed(torch.Tensor):
    """Values kept in float64 (a packed form, say): no tensor of the
    parameter's dtype holds them; each op computes them afresh."""

    @staticmethod
    def __new__(cls, t, held=None):
        return torch.Tensor._make_wrapper_subclass(cls, t.size(), dtype=torch.float32, device=t.device,
                                                   requires_grad=t.requires_grad)

    def __init__(self, t, held=None):
        self._t = t.to(torch.float64) if held is None else held

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func == torch.ops.aten.detach.default:
            return Packed(args[0], held=args[0]._t)
        args, kwargs = pytree.tree_map_only(Packed, lambda x: x._t.to(torch.float32), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_t"], None


def _wrap_weights(model, cls=CastOnUse):
    """Every linear weight of ``model`` a ``cls`` parameter (as torchao's
    convert_to_float8_training does), the biases left plain."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight = torch.nn.Parameter(cls(m.weight.detach().clone()), requires_grad=True)
    return model


def _values(t) -> np.ndarray:
    t = t.detach().cpu()
    inner = getattr(t, "_t", None) if isinstance(t, CastOnUse) else getattr(t, "_tensor", None)
    return (t if inner is None else inner).numpy()


def _local_grads(plain, x, rank, step):
    """This rank's gradient of the plain model at the reference's parameters x
    (on the plain model's device, whose kernels the wrapped model's use)."""
    with torch.no_grad():
        for p, v in zip(plain.parameters(), x):
            p.copy_(torch.from_numpy(v))
    plain.zero_grad()
    _loss(plain, rank, step).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
    return [p.grad.cpu().numpy().copy() for p in plain.parameters()]


def train_wrapped(rank, world_size, kind, device="cpu"):
    """A user's loop (zero_grad, backward, per-rank clipping, step) over the
    wrapped model under ``kind``, each step bitwise against the reference."""
    import lionbit

    model = _wrap_weights(_net().to(device))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    elif kind == "fsdp2":
        model = _shard(model, device=None if device == "cpu" else device)
    opt = lionbit.DistributedLion(model.parameters(), **LION)
    if kind != "module":
        opt.attach(model)
    plain = _net().to(device)
    ref = ReferenceLion(list(plain.parameters()), world_size, LION["lr"], LION["betas"], LION["weight_decay"], "vote")
    same = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        grads = [None] * world_size
        dist.all_gather_object(grads, _local_grads(plain, ref.x, rank, step))
        ref.step(grads)
        same.append([bool(np.array_equal(_values(p), x)) for p, x in zip(_full_params(model), ref.x)])
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {"same": same, "wrapped": sum(isinstance(t, CastOnUse) for t in local),
            "moved": float(sum((p.cpu() - q).abs().sum() for p, q in zip(_full_params(model), _net().parameters())))}


@pytest.fixture(scope="module")
def wrapped_runs():
    return {kind: values(run_ranks("test_tensor_subclasses:train_wrapped", 2, kwargs={"kind": kind}))
            for kind in ("module", "ddp", "fsdp2")}


@pytest.mark.parametrize("kind", ["module", "ddp", "fsdp2"])
def test_wrapped_weights_train_as_the_reference_bitwise(wrapped_runs, kind):
    for r in wrapped_runs[kind]:
        assert all(all(step) for step in r["same"]), (kind, r["same"])
        assert r["wrapped"] == 3, r  # the three linear weights are wrappers still, after every step
        assert r["moved"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["module", "ddp", "fsdp2"])
def test_wrapped_weights_train_as_the_reference_bitwise_on_a_gpu(kind):
    """The same on CUDA tensors (2 ranks on one GPU over the Gloo transport):
    the GPU's list kernels update the tensors the wrappers hold."""
    res = values(run_ranks("test_tensor_subclasses:train_wrapped", 2, kwargs={"kind": kind, "device": "cuda"},
                           env={"LIONBIT_CUDA_TRANSPORT": "gloo"}))
    for r in res:
        assert all(all(step) for step in r["same"]) and r["wrapped"] == 3 and r["moved"] > 0, (kind, r)


def packed_refused(rank, world_size, kind):
    """A weight whose values no tensor of its dtype holds: refused on every
    rank, at attach() (DDP) or the first step (a plain module), with nothing
    changed; the sign collective refuses a wrapper too."""
    import lionbit

    out = {}
    model = _wrap_weights(_net(), Packed)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    opt = lionbit.DistributedLion(model.parameters(), **LION)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        out["where"] = "attach"
        if kind != "module":
            opt.attach(model)
        out["where"] = "backward"
        _loss(model, rank, 0).backward()
        out["where"] = "step"
        opt.step()
        out["error"] = None
    except TypeError as e:
        out["error"] = str(e)
    out["unchanged"] = all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    out["no_momentum"] = not any("exp_avg" in s for s in opt.state.values()) or all(
        not s["exp_avg"].any() for s in opt.state.values() if "exp_avg" in s)
    try:
        lionbit.all_reduce_sign(CastOnUse(torch.randn(10)))
        out["collective"] = None
    except ValueError as e:
        out["collective"] = str(e)
    return out


@pytest.mark.parametrize("kind", ["module", "ddp"])
def test_a_subclass_without_its_values_in_memory_is_refused_naming_it(kind):
    for rank, r in enumerate(values(run_ranks("test_tensor_subclasses:packed_refused", 2, kwargs={"kind": kind}))):
        assert r["error"] is not None and r["where"] == ("step" if kind == "module" else "attach"), r
        assert f"on rank {rank}" in r["error"] and "test_tensor_subclasses.Packed" in r["error"], r["error"]
        assert "shape (33, 12)" in r["error"] and "cannot update it in place" in r["error"], r["error"]
        assert r["unchanged"] and r["no_momentum"], r
        assert "argument 'tensor' is a tensor subclass with no memory of its own" in r["collective"], r


def _float8_model(all_gather: bool):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather))
    return model


def float8_runs(rank, world_size):
    """torchtitan's float8 training as its loop runs it: each linear layer
    and the root fully_shard-ed (a 1-D mesh, and HSDP over 2 x 2), per-rank
    clipping, the step, then torchao's scale precomputation for the next
    float8 all-gather; with the float8 all-gather (every weight a wrapper
    subclass) and without it (plain weights, the same float8 matmuls)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    import lionbit

    out = {}
    for mesh_kind in ("1-D", "HSDP"):
        shape, names = ((world_size,), ("shard",)) if mesh_kind == "1-D" else ((2, world_size // 2),
                                                                                ("replicate", "shard"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for all_gather in (True, False):
            model = _float8_model(all_gather)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = lionbit.DistributedLion(model.parameters(), **LION)
            opt.attach(model)
            for step in range(STEPS):
                g = torch.Generator().manual_seed(1000 * step + rank)
                x = torch.randn(16, 64, generator=g)
                opt.zero_grad()
                model(x).square().mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
                if all_gather:
                    precompute_float8_dynamic_scale_for_fsdp(model)
            full = [p.full_tensor() for p in model.parameters()]
            out[(mesh_kind, all_gather)] = [_values(t).tolist() for t in full]
            out[(mesh_kind, all_gather, "wrapped")] = sum(type(p.to_local()).__name__ != "Tensor"
                                                          for p in model.parameters())
    return {str(k): v for k, v in out.items()}


def test_float8_training_under_fsdp2_and_hsdp_steps_as_without_the_float8_all_gather():
    pytest.importorskip("torchao.float8", reason="torchao (tools/requirements-dev.txt) is not installed")
    res = values(run_ranks("test_tensor_subclasses:float8_runs", 4, timeout=300))
    for r in res:
        for mesh in ("1-D", "HSDP"):
            assert r[str((mesh, True, "wrapped"))] == 2 and r[str((mesh, False, "wrapped"))] == 0, r
            assert r[str((mesh, True))] == r[str((mesh, False))], mesh
    assert all(r == res[0] for r in res)  # every rank holds the same parameters
