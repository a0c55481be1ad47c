"""DistributedLion on FSDP1 models with FSDP1's ``MixedPrecision``, the way
accelerate, transformers' ``Trainer`` and Lightning's ``FSDPStrategy`` set it
up (bfloat16 parameters and reduction; float32 parameters reduced in bfloat16
under bf16 autocast, Lightning's "bf16-mixed"; bfloat16 parameters alone), on
real processes, written as a user's loop (clipping with
``model.clip_grad_norm_``, ``no_sync()`` accumulation, ``zero_grad()``).

The reference is independent of lionbit and of FSDP: each rank computes its
local gradient with a plain copy of the model at the reference's parameters,
cast as FSDP casts the model (the copy in bfloat16, or float32 under
autocast), sums micro-batches as autograd does, and casts the gradient as
FSDP hands it to the comm hook (to ``reduce_dtype``); the ranks' gradients,
gathered, drive Distributed Lion in numpy float32 (test_optim.ReferenceLion).
Every parameter is compared bitwise after every step."""

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_fsdp import LION, Net, _batch, _shard
from test_fsdp1 import _wrap
from test_optim import ReferenceLion

BF16, F32 = torch.bfloat16, torch.float32
MAX_NORM = 0.05  # small enough that every step clips


class NormNet(Net):
    """test_fsdp's Net with a LayerNorm in the root instance: under autocast
    its gradients are float32's (the linear layers' are bf16 values), so
    FSDP's cast to reduce_dtype changes them."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(33)

    def forward(self, x):
        return self.head(torch.tanh(self.b(self.norm(torch.tanh(self.a(x))))))


def _net():
    torch.manual_seed(0)
    return NormNet()


def _mixed(mp: dict):
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(**{k: getattr(torch, v) if isinstance(v, str) else v for k, v in mp.items()})


def _forward_loss(model, rank, step, micro, cfg, dtype):
    device = cfg.get("device", "cpu")
    x, y = (t.to(device) for t in _batch(rank, step, micro))
    with torch.autocast(device, dtype=BF16) if cfg["autocast"] else contextlib.nullcontext():
        return torch.nn.functional.cross_entropy(model(x.to(dtype)), y)


def _reference_grads(x: dict, rank, step, cfg):
    """This rank's local gradients (name -> tensor) as FSDP hands them over:
    the plain model in the compute dtype, autograd's sum over micro-batches,
    cast to reduce_dtype (a sharded instance keeps that; NO_SHARD's gradient
    is cast back to the parameters' float32 after the hook), then clipped by
    this rank's norm, as torch.nn.utils.clip_grad_norm_ clips them."""
    mp = cfg["mp"]
    compute = getattr(torch, mp.get("param_dtype", "float32"))
    reduce = getattr(torch, mp.get("reduce_dtype", mp.get("param_dtype", "float32")))
    voted = F32 if cfg["strategy"] == "NO_SHARD" and not mp.get("keep_low_precision_grads") else reduce
    model = _net().to(cfg.get("device", "cpu"), compute)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(x[n]).to(p.device, compute))
    for micro in range(cfg["accumulate"]):
        _forward_loss(model, rank, step, micro, cfg, compute).backward()
    grads = {n: p.grad.to(reduce).to(voted) for n, p in model.named_parameters()}
    if cfg["clip"]:  # as torch.nn.utils.clip_grad_norm_ clips gradients of these dtypes
        total = torch.nn.utils.get_total_norm(list(grads.values()), 2.0)
        coef = torch.clamp(cfg["clip"] / (total + 1e-6), max=1.0)
        grads = {n: g * coef for n, g in grads.items()}
    return grads


def _gather(grads: dict, n: int) -> list:
    """Every rank's gradients, as numpy float32 lists in the reference's order."""
    out = [[] for _ in range(n)]
    for g in grads.values():
        parts = [torch.empty_like(g, dtype=F32) for _ in range(n)]
        dist.all_gather(parts, g.to(F32).contiguous())
        for r in range(n):
            out[r].append(parts[r].cpu().numpy())
    return out


def _full(model) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(model, FSDP):  # FSDP2
        return {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}


def _momenta(model, opt) -> dict:
    """This rank's momentum of each parameter (name -> flat numpy float32)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(model, FSDP):  # FSDP2 on a 1-D mesh: full-size, per parameter
        return {n: opt.attachment.momentum(p).reshape(-1).cpu().numpy() for n, p in model.named_parameters()}
    out = {}
    for unit in opt.attachment.units:  # FSDP1: one flat full-size tensor an instance, in FlatParameter order
        for off, numel, _, name in unit.segments:
            out[name.replace("_fsdp_wrapped_module.", "")] = unit.momentum[off : off + numel].cpu().numpy()
    return out


def mixed_vs_reference(rank, world_size, cfg, steps):
    import lionbit

    device = cfg.get("device", "cpu")
    if cfg["strategy"] == "fully_shard":  # FSDP2, as accelerate's fsdp_version=2 sets up bf16
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(**{k: getattr(torch, v) for k, v in cfg["mp"].items()})
        model = _shard(_net(), device=device, mp_policy=policy)
    else:
        model = _wrap(_net().to(device), cfg["strategy"], cfg["use_orig_params"], device=torch.device(device),
                      mixed_precision=_mixed(cfg["mp"]))
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    names = [n for n, _ in _net().named_parameters()]
    ref = ReferenceLion(list(_net().parameters()), world_size, LION["lr"], LION["betas"], LION["weight_decay"], "vote")
    out = {"equal": [], "norms": [], "dtypes": None}
    for step in range(steps):
        before = dict(zip(names, (x.copy() for x in ref.x)))
        for micro in range(cfg["accumulate"]):
            last = micro == cfg["accumulate"] - 1
            with contextlib.nullcontext() if last else model.no_sync():
                _forward_loss(model, rank, step, micro, cfg, F32).backward()
        if out["dtypes"] is None:
            out["dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        if cfg["clip"]:
            out["norms"].append(float(model.clip_grad_norm_(cfg["clip"])))
        opt.step()
        opt.zero_grad()
        ref.step(_gather(_reference_grads(before, rank, step, cfg), world_size))
        full = _full(model)
        out["equal"].append(all(np.array_equal(full[n].cpu().numpy().view(np.int32), ref.x[i].view(np.int32))
                                for i, n in enumerate(names)))
    mine = _momenta(model, opt)
    out["momentum_equal"] = all(np.array_equal(mine[n].view(np.int32), ref.m[rank][i].reshape(-1).view(np.int32))
                                for i, n in enumerate(names))
    moved = sum(float(np.abs(ref.x[i] - p.detach().numpy()).sum()) for i, p in enumerate(_net().parameters()))
    out["moved"] = moved
    out["steps"] = opt.steps_taken
    return out


def _cfg(strategy, mp, use_orig_params=False, autocast=False, accumulate=1, clip=None):
    return dict(strategy=strategy, mp=mp, use_orig_params=use_orig_params, autocast=autocast, accumulate=accumulate,
                clip=clip)


ALL_BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "buffer_dtype": "bfloat16"}
LIGHTNING_BF16_MIXED = {"param_dtype": "float32", "reduce_dtype": "bfloat16", "buffer_dtype": "bfloat16"}

CASES = {
    "accelerate's bf16: FULL_SHARD, bf16 parameters and reduction, clipped": (
        2, _cfg("FULL_SHARD", ALL_BF16, clip=MAX_NORM)),
    "Lightning's bf16-mixed: SHARD_GRAD_OP, use_orig_params, autocast, no_sync accumulation": (
        3, _cfg("SHARD_GRAD_OP", LIGHTNING_BF16_MIXED, use_orig_params=True, autocast=True, accumulate=2)),
    "bf16 parameters alone (reduced in bf16): FULL_SHARD, use_orig_params, clipped": (
        3, _cfg("FULL_SHARD", {"param_dtype": "bfloat16"}, use_orig_params=True, clip=MAX_NORM)),
    "NO_SHARD, bf16 parameters and reduction, clipped, accumulation": (
        2, _cfg("NO_SHARD", ALL_BF16, accumulate=2, clip=MAX_NORM)),
    "NO_SHARD, keep_low_precision_grads=True (p.grad stays bf16), clipped": (
        2, _cfg("NO_SHARD", dict(ALL_BF16, keep_low_precision_grads=True), clip=MAX_NORM)),
    "FSDP2 as accelerate's fsdp_version=2 sets bf16: parameters, reduction and output in bf16": (
        3, _cfg("fully_shard", {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "output_dtype": "bfloat16"})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp1_mixed_precision_equals_reference_bitwise(case):
    world_size, cfg = CASES[case]
    res = values(run_ranks("test_fsdp_mixed:mixed_vs_reference", world_size, kwargs=dict(cfg=cfg, steps=6)))
    for r in res:
        assert r["equal"] == [True] * 6, (case, r["equal"])
        assert r["steps"] == 6
        assert r["momentum_equal"], case  # the momentum follows the gradient as FSDP cast it
        assert r["moved"] > 0.1  # the parameters did change
        # the sharded p.grad FSDP exposes is cast back to the parameters' float32, unless kept in low precision
        low = cfg["mp"].get("keep_low_precision_grads")
        assert r["dtypes"] == ["torch.bfloat16" if low else "torch.float32"], r["dtypes"]
    if cfg["clip"]:  # each rank's own norm: the ranks' data differ, so do their norms
        assert len({r["norms"][0] for r in res}) == world_size
        assert all(n > cfg["clip"] for r in res for n in r["norms"])  # every step clipped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fsdp_mixed_precision_on_a_gpu_equals_reference_bitwise():
    """The same on one GPU (NCCL underneath, world size 1: FSDP1 runs every
    instance NO_SHARD): FSDP1 in bf16 with clipping and Lightning's
    bf16-mixed under CUDA autocast, FSDP2 with accelerate's bf16 policy. The
    reference computes its gradients on the GPU too (the same kernels)."""
    cases = [_cfg("FULL_SHARD", ALL_BF16, clip=MAX_NORM),
             _cfg("SHARD_GRAD_OP", LIGHTNING_BF16_MIXED, use_orig_params=True, autocast=True, accumulate=2),
             _cfg("fully_shard", {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "output_dtype": "bfloat16"})]
    for cfg in cases:
        cfg["device"] = "cuda"
        r, = values(run_ranks("test_fsdp_mixed:mixed_vs_reference", 1, kwargs=dict(cfg=cfg, steps=6)))
        assert r["equal"] == [True] * 6 and r["momentum_equal"], (cfg, r["equal"], r["momentum_equal"])
        assert r["moved"] > 0.1 and r["steps"] == 6
