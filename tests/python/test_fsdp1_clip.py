"""Gradient clipping under sharded FSDP1, per rank: a user's script calls
``model.clip_grad_norm_(max_norm)`` (FSDP1's API, which attach() replaces
with lionbit's per-rank clip of each rank's full local gradient) and must get
bitwise what DDP + DistributedLion gives with
``torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)``: the
same returned norms, parameters after every step and momenta, on real
processes at N = 2 and 3, FULL_SHARD and SHARD_GRAD_OP, use_orig_params
both ways, with the habits of real loops around it (no_sync accumulation,
two synchronized backwards, a step without zero_grad, zero_grad to zeros,
model.zero_grad(), the inf and 1-norms, a step() without a backward, an inf/NaN
gradient on one rank); NO_SHARD too. And the clear error for
``torch.nn.utils.clip_grad_norm_(model.parameters())``, which sees only
shards."""

import math

import pytest
import torch

from harness import run_ranks, values
from test_fsdp import LION, _digest, _loss, _net
from test_fsdp1 import _params, _wrap

# One step of a user's loop: how it zeroes the gradients first ("none":
# opt.zero_grad(), "zeros": opt.zero_grad(set_to_none=False), "model":
# model.zero_grad(), "keep": not at all), its backwards ("micro" micro-batches,
# all but the last under no_sync(); "syncs" synchronized ones), the clipping
# (max_norm, norm_type; None: no clipping) and whether rank 1's loss is NaN.
PLAN = [
    dict(zero="none", micro=1, syncs=1, clip=(0.3, 2.0)),
    dict(zero="none", micro=2, syncs=1, clip=(0.3, 2.0)),
    dict(zero="keep", micro=1, syncs=1, clip=(0.5, 2.0)),  # onto step 1's clipped gradients
    dict(zero="zeros", micro=1, syncs=2, clip=(0.2, math.inf)),
    dict(zero="model", micro=2, syncs=1, clip=(100.0, 2.0)),  # a norm below max_norm: factor 1
    dict(zero="keep", micro=2, syncs=1, clip=(0.3, 2.0)),  # no_sync onto a kept sharded gradient
    dict(zero="none", micro=1, syncs=1, clip=(0.3, 2.0), nan=True),  # every rank raises, nothing changes
    dict(zero="none", micro=1, syncs=1, clip=None),
    dict(zero="keep", micro=0, syncs=0, clip=(0.3, 2.0)),  # step() again without a backward
    dict(zero="none", micro=1, syncs=1, clip=(0.3, 1.0)),
]


def _run(rank, model, opt, clip, params, plan):
    """The user's loop; returns the clipping norms and the parameters after
    each step (None where step() raised, which must change nothing)."""
    norms, after = [], []
    for step, spec in enumerate(plan):
        if spec["zero"] == "none":
            opt.zero_grad()
        elif spec["zero"] == "zeros":
            opt.zero_grad(set_to_none=False)
        elif spec["zero"] == "model":
            model.zero_grad()
        for i in range(spec["micro"] + spec["syncs"] - 1):
            loss = _loss(model, rank, step, i)
            if spec.get("nan") and rank == 1:
                loss = loss * float("nan")
            if i < spec["micro"] - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if spec["clip"] is not None:
            norms.append(clip(*spec["clip"]))
        try:
            opt.step()
        except RuntimeError as err:
            assert spec.get("nan") and "non-finite gradient" in str(err), err
            assert all(torch.equal(a, b) for a, b in zip(params(), after[-1])), "a refused step changed parameters"
            after.append(None)
            continue
        assert not spec.get("nan"), "a NaN on rank 1 did not stop the step"
        after.append(params())
    return norms, after


def clip_vs_ddp(rank, world_size, configs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)
    ddp = DDP(_net())
    dopt = lionbit.DistributedLion(ddp.parameters(), **LION).attach(ddp, overlap=False)

    def ddp_clip(max_norm, norm_type):
        return torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm, norm_type)

    want_norms, want = _run(rank, ddp, dopt, ddp_clip, lambda: [p.detach().clone() for p in ddp.module.parameters()],
                            PLAN)
    want_m = {n: dopt.state[p]["exp_avg"] for n, p in ddp.module.named_parameters()}
    out = []
    for strategy, use_orig in configs:
        model = _wrap(_net(), strategy, use_orig)
        opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
        norms, got = _run(rank, model, opt, model.clip_grad_norm_, lambda: _params(model), PLAN)
        cfg = (strategy, use_orig)
        assert len(norms) == len(want_norms)
        for i, (a, b) in enumerate(zip(norms, want_norms)):
            assert a.dtype == b.dtype and (torch.equal(a, b) or (a.isnan() and b.isnan())), (cfg, i, a, b)
        for step, (a, b) in enumerate(zip(got, want)):
            assert (a is None) == (b is None), (cfg, step)
            if a is not None:
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{cfg}: parameters differ after step {step}"
        assert len(got) < 7 or (got[6] is None and want[6] is None)
        seen = set()
        for unit in opt.attachment.units:
            m = unit.momentum_tensor()
            for off, numel, _, fqn in unit.segments:
                assert torch.equal(m[off : off + numel], want_m[fqn].reshape(-1)), (cfg, fqn)
                seen.add(fqn)
        assert seen == set(want_m), seen
        # clipping really clipped somewhere, and somewhere not
        assert len(norms) < 5 or (any(float(n) > 0.3 for n in norms) and any(float(n) < 100.0 for n in norms))
        # detach() gives FSDP's own clip_grad_norm_ back
        assert "clip_grad_norm_" in vars(model)
        opt.detach()
        assert "clip_grad_norm_" not in vars(model)
        out.append({"digest": _digest(got[-1]), "moved": float(sum((a - b).abs().sum() for a, b in
                                                                       zip(got[-1], _net().parameters())))})
    return out


CONFIGS = [("FULL_SHARD", False), ("FULL_SHARD", True), ("SHARD_GRAD_OP", False), ("SHARD_GRAD_OP", True),
           ("NO_SHARD", False)]


@pytest.mark.parametrize("n", [2, 3])
def test_fsdp1_clip_equals_ddp_clip_bitwise(n):
    res = values(run_ranks("test_fsdp1_clip:clip_vs_ddp", n, kwargs=dict(configs=CONFIGS), timeout=300))
    for i, cfg in enumerate(CONFIGS):
        assert len({r[i]["digest"] for r in res}) == 1, cfg  # the replicas agree
        assert all(r[i]["moved"] > 0.1 for r in res), cfg


def torch_clip_on_shards(rank, world_size, use_orig, max_norm):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) under sharded
    FSDP1: step() raises on every rank, naming model.clip_grad_norm_, and
    changes nothing (even when the factor is 1 and no value changed)."""
    import lionbit

    torch.set_num_threads(1)
    model = _wrap(_net(), "FULL_SHARD", use_orig)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    _loss(model, rank, 0).backward()
    before = _params(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with pytest.raises(RuntimeError) as err:
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    assert all(u.momentum is None or not u.momentum.any() for u in opt.attachment.units)
    return str(err.value)


@pytest.mark.parametrize("use_orig,max_norm", [(False, 0.1), (True, 0.1), (True, 1e9)])
def test_torch_clip_on_the_shards_is_a_clear_error(use_orig, max_norm):
    msgs = values(run_ranks("test_fsdp1_clip:torch_clip_on_shards", 2,
                            kwargs=dict(use_orig=use_orig, max_norm=max_norm)))
    for msg in msgs:
        assert "torch.nn.utils.clip_grad_norm_" in msg and "model.clip_grad_norm_(max_norm)" in msg, msg
        assert "per-rank clip" in msg, msg


def kept_gradient_lifecycle(rank, world_size, use_orig):
    """White box: after backward the sharded p.grad is this rank's shard of
    its kept local gradient; the kept gradient outlives step() (DDP's p.grad)
    and is freed by the forward after zero_grad(); clipping without gradients
    returns 0; clipping or stepping between no_sync() micro-batches is an
    error; an edit of the shards after step() is an error at the next
    forward."""
    import lionbit

    torch.set_num_threads(1)
    model = _wrap(_net(), "FULL_SHARD", use_orig)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    units = opt.attachment.units
    x = torch.zeros(2, 12)
    _loss(model, rank, 0).backward()
    for u in units:
        g, s = u.flat_param.grad, u.shard_numel
        assert u.kept is not None and u.kept.numel() == u.numel
        mine = u.kept[rank * s : (rank + 1) * s]
        assert torch.equal(g[: mine.numel()], mine) and not g[mine.numel() :].any()
    opt.step()
    assert all(u.kept is not None for u in units)
    opt.zero_grad()
    with torch.no_grad():
        model(x)
    assert all(u.kept is None for u in units)
    assert float(model.clip_grad_norm_(1.0)) == 0.0
    with model.no_sync():
        _loss(model, rank, 1, 0).backward()
    for call in (lambda: model.clip_grad_norm_(1.0), opt.step):  # mid-accumulation
        with pytest.raises(RuntimeError, match="during no_sync"):
            call()
    _loss(model, rank, 1, 1).backward()
    opt.step()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(2.0)
    with pytest.raises(RuntimeError) as err:
        model(x)
    return str(err.value)


@pytest.mark.parametrize("use_orig", [False, True])
def test_the_kept_gradient_lives_like_ddps_p_grad(use_orig):
    msgs = values(run_ranks("test_fsdp1_clip:kept_gradient_lifecycle", 2, kwargs=dict(use_orig=use_orig)))
    assert all("changed after step()" in m and "zero_grad()" in m for m in msgs), msgs
