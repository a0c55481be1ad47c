"""DistributedLion on FSDP2 through torch.distributed.checkpoint's state-dict
API, as pytorch/examples' FSDP2 example and torchtitan save and resume:
get_optimizer_state_dict / set_optimizer_state_dict (default sharded options,
flatten_optimizer_state_dict, and full_state_dict=True + cpu_offload=True, a
rank-0 consolidated checkpoint) with dcp.save / dcp.load or torch.save /
torch.load, on real processes.

Each test trains K steps, checkpoints, trains M more (parameters P1); then
fresh processes build a model from another seed and an optimizer with
another lr, load, train M steps: the parameters must equal P1 bitwise on
every rank, and every rank's momentum must be its own (the ranks see
different data, so their momenta differ)."""

import os

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_fsdp import LION, _digest, _full_params, _loss, _net, _shard

K, M = 3, 3
LR_AT_SAVE = 0.005  # set at step K - 1: the scheduler's value must come back
DTYPES = ("float32", "bfloat16")


def _build(md, seed):
    import lionbit

    model = _shard(_net(seed))
    opt = lionbit.DistributedLion(model.parameters(), momentum_dtype=getattr(torch, md), **LION)
    return model, opt.attach(model)


def _train(model, opt, rank, steps):
    for step in steps:
        if step == K - 1:
            opt.param_groups[0]["lr"] = LR_AT_SAVE
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()


def _momentum_digest(opt):
    ms = [opt.state[p]["exp_avg"] for g in opt.param_groups for p in g["params"] if "exp_avg" in opt.state.get(p, {})]
    n = sum(len(g["params"]) for g in opt.param_groups)
    return _digest(ms) if len(ms) == n else f"{len(ms)} of {n} momenta"


def _opts(mode):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if mode == "sharded":
        return StateDictOptions()
    if mode == "flat":
        return StateDictOptions(flatten_optimizer_state_dict=True)
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _save(model, opt, rank, mode, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _opts(mode)
    sd = {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }
    if mode in ("sharded", "flat"):
        dcp.save(sd, checkpoint_id=where)
        return
    if rank == 0:
        torch.save(sd, where + ".pt")
    else:
        assert sd == {"model": {}, "optim": {}}, sd  # cpu_offload: rank 0 only
    dist.barrier()


def _load(model, opt, rank, mode, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = _opts(mode)
    if mode in ("sharded", "flat"):
        sd = {
            "model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, opt, options=options),
        }
        dcp.load(sd, checkpoint_id=where)
    elif mode == "full":  # every rank reads the file (as pytorch/examples does)
        sd = torch.load(where + ".pt", weights_only=True)
    else:  # "full_bcast": rank 0 reads it and broadcasts
        assert mode == "full_bcast"
        sd = torch.load(where + ".pt", weights_only=True) if rank == 0 else {"model": {}, "optim": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, sd["model"], options=options)
    set_optimizer_state_dict(model, opt, sd["optim"], options=options)


def save_phase(rank, world_size, path, modes):
    """K steps, a checkpoint in every mode (the same state), M more steps."""
    out = {}
    for md in DTYPES:
        model, opt = _build(md, 0)
        _train(model, opt, rank, range(K))
        at_save = _momentum_digest(opt)
        for mode in modes:
            _save(model, opt, rank, mode, os.path.join(path, f"{mode}-{md}"))
        _train(model, opt, rank, range(K, K + M))
        out[md] = {"at_save": at_save, "params": _digest(_full_params(model)), "momentum": _momentum_digest(opt)}
    return out


def resume_phase(rank, world_size, path, modes):
    """Fresh processes: another seed, another lr; load; M steps."""
    out = {}
    for md in DTYPES:
        for mode in modes:
            model, opt = _build(md, 1)
            opt.param_groups[0]["lr"] = 0.123
            _load(model, opt, rank, mode, os.path.join(path, f"{mode}-{md}"))
            loaded = {
                "momentum": _momentum_digest(opt),
                "dtypes": sorted({str(s["exp_avg"].dtype) for s in opt.state.values() if "exp_avg" in s}),
                "lr": opt.param_groups[0]["lr"],
                "betas": list(opt.param_groups[0]["betas"]),
            }
            _train(model, opt, rank, range(K, K + M))
            out[f"{mode}-{md}"] = {
                "loaded": loaded,
                "params": _digest(_full_params(model)),
                "momentum": _momentum_digest(opt),
            }
    return out


def _check_resume(world_size, modes, path):
    saved = values(run_ranks("test_fsdp_dcp:save_phase", world_size, kwargs=dict(path=path, modes=modes)))
    resumed = values(run_ranks("test_fsdp_dcp:resume_phase", world_size, kwargs=dict(path=path, modes=modes)))
    for md in DTYPES:
        # the ranks' momenta differ (different data), the parameters do not
        assert len({s[md]["at_save"] for s in saved}) == world_size
        assert len({s[md]["params"] for s in saved}) == 1
        for mode in modes:
            for rank, (s, r) in enumerate(zip(saved, resumed)):
                got = r[f"{mode}-{md}"]
                what = (mode, md, rank)
                # each rank got its own momentum back, in the optimizer's dtype
                assert got["loaded"]["momentum"] == s[md]["at_save"], what
                assert got["loaded"]["dtypes"] == [f"torch.{md}"], what
                assert got["loaded"]["lr"] == LR_AT_SAVE, what
                assert got["loaded"]["betas"] == list(LION["betas"]), what
                # and M more steps give bitwise the uninterrupted run
                assert got["params"] == s[md]["params"], what
                assert got["momentum"] == s[md]["momentum"], what


@pytest.mark.parametrize("world_size", [2, 3])
def test_dcp_api_sharded_resume_is_bitwise(world_size, tmp_path):
    """Default StateDictOptions (and flatten_optimizer_state_dict) with
    dcp.save / dcp.load: every rank writes and reads its own momentum."""
    _check_resume(world_size, ["sharded", "flat"], str(tmp_path))


@pytest.mark.parametrize("world_size", [2, 3])
def test_dcp_api_full_state_dict_resume_is_bitwise(world_size, tmp_path):
    """full_state_dict=True + cpu_offload=True: rank 0 holds every rank's
    momentum (stacked, row r = rank r) and torch.save-s it; the resume
    distributes row r to rank r, read by every rank or broadcast from rank 0."""
    _check_resume(world_size, ["full", "full_bcast"], str(tmp_path))


def full_state_dict_layout(rank, world_size):
    """The consolidated checkpoint: per parameter one (N, *shape) tensor on
    rank 0, row r = rank r's momentum; nothing on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, opt = _build("float32", 0)
    _train(model, opt, rank, range(2))
    names = {p: n for n, p in model.named_parameters()}
    own = {names[p]: opt.state[p]["exp_avg"].clone() for p in names}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {n: m.tolist() for n, m in own.items()})
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return {"empty": full == {}}
    ok = {}
    for n, m in own.items():
        t = full["state"][n]["exp_avg"]
        ok[n] = (
            type(t) is torch.Tensor
            and tuple(t.shape) == (world_size, *m.shape)
            and all(torch.equal(t[r], torch.tensor(everyone[r][n])) for r in range(world_size))
        )
    return {"ok": ok, "params": full["param_groups"][0]["params"]}


def test_full_state_dict_holds_every_ranks_momentum():
    res = values(run_ranks("test_fsdp_dcp:full_state_dict_layout", 3))
    assert all(res[0]["ok"].values()) and len(res[0]["ok"]) == 6, res[0]
    assert res[0]["params"] == ["a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "head.bias"]
    assert res[1] == res[2] == {"empty": True}


def init_optim_state(rank, world_size):
    """torch's _init_optim_state (a step() with zero gradients and lr 0) on a
    fresh optimizer, then state_dict() / load_state_dict(), on rank 0 only:
    they must create zero momentum for every parameter, change no parameter
    and run no collective (the other ranks do not call them); training then
    goes on as if they had not happened."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    import lionbit

    def run(init):
        model, opt = _build("float32", 0)
        before = _digest([p.to_local() for p in model.parameters()])
        out = {}
        if init:
            lionbit.reset_stats()
            _init_optim_state(opt)
            opt.load_state_dict(opt.state_dict())  # no collective in these either
            st = lionbit.stats()
            out = {
                "states": len(opt.state),
                "zeros": all(not s["exp_avg"].any() and s["exp_avg"].shape == p.shape for p, s in opt.state.items()),
                "same": _digest([p.to_local() for p in model.parameters()]) == before,
                "grads": [p.grad for p in model.parameters()] == [None] * 6,
                "lr": opt.param_groups[0]["lr"],
                "collectives": st["sign_reduce_scatter_calls"] + st["sign_allreduce_calls"],
            }
        _train(model, opt, rank, range(3))
        out["params"] = _digest(_full_params(model))
        out["momentum"] = _momentum_digest(opt)
        return out

    return {"plain": run(False), "init": run(rank == 0)}


def test_init_optim_state_creates_zero_momentum_without_collectives():
    res = values(run_ranks("test_fsdp_dcp:init_optim_state", 2, timeout=90, pg_timeout=30))
    r0 = res[0]["init"]
    assert (r0["states"], r0["zeros"], r0["same"], r0["grads"], r0["lr"], r0["collectives"]) == (
        6, True, True, True, LION["lr"], 0), r0
    for r in res:
        assert r["init"]["params"] == r["plain"]["params"]
        assert r["init"]["momentum"] == r["plain"]["momentum"]


def other_layouts(rank, world_size):
    """load_state_dict with momenta not in the (N, *shape) DTensor layout:
    every rank's stacked (its own row), its own, one of the parameter's
    shape, the momenta of another number of ranks (their mean)."""
    import warnings

    model, opt = _build("float32", 0)
    _train(model, opt, rank, range(2))
    want = _momentum_digest(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(params)))}
              for g in opt.param_groups]
    own = {i: {"exp_avg": opt.state[p]["exp_avg"].clone()} for i, p in enumerate(params)}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, own)
    out = {}

    def load(sd):
        _, fresh = _build("float32", 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fresh.load_state_dict(sd)
            except ValueError as err:
                return str(err)
        return {"momentum": _momentum_digest(fresh), "warnings": len(caught)}

    # a plain (N, *shape) stack (a consolidated checkpoint as it is): row rank
    stacked = {i: {"exp_avg": torch.stack([everyone[r][i]["exp_avg"] for r in range(world_size)])} for i in own}
    out["stacked"] = load({"state": stacked, "param_groups": groups})
    # per-rank plain momenta (torch's default layout): this rank's own file says so, others warn
    marker = {"rank": rank, "world_size": world_size}
    out["own_file"] = load({"state": own, "param_groups": groups, "lionbit": marker})
    out["unmarked"] = load({"state": own, "param_groups": groups})
    # the momenta of another number of ranks (rank 0's twice): their mean, float64 here, to float32's rounding
    more = {i: {"exp_avg": torch.cat([s["exp_avg"], s["exp_avg"][:1]])} for i, s in stacked.items()}
    out["other_n"] = load({"state": more, "param_groups": groups})
    _, fresh = _build("float32", 1)
    fresh.load_state_dict({"state": more, "param_groups": groups})
    got = [fresh.state[p]["exp_avg"].double() for g in fresh.param_groups for p in g["params"]]
    mean = [more[i]["exp_avg"].double().mean(0) for i in sorted(more)]
    out["other_n_error"] = max(float(((a - b).abs() / b.abs().max()).max()) for a, b in zip(got, mean))
    # between backward and step() (the vote waits for step()): the momentum as before the backward
    _loss(model, rank, 9).backward()
    mid = opt.state_dict()["state"]
    out["mid_step"] = _digest([mid[i]["exp_avg"].to_local()[0] for i in sorted(mid)])
    opt.step()
    return {"want": want, **out}


def test_load_state_dict_other_layouts():
    res = values(run_ranks("test_fsdp_dcp:other_layouts", 2))
    for r in res:
        assert r["stacked"] == {"momentum": r["want"], "warnings": 0}
        assert r["own_file"] == {"momentum": r["want"], "warnings": 0}
        assert r["unmarked"] == {"momentum": r["want"], "warnings": 1}
        assert r["other_n"]["warnings"] == 1 and r["other_n"]["momentum"] == res[0]["other_n"]["momentum"]
        assert r["other_n_error"] <= 2 ** -22, r["other_n_error"]
        assert r["mid_step"] == r["want"]
