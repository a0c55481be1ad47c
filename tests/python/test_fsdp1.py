"""DistributedLion on FSDP1 (FullyShardedDataParallel) models, on real
processes: parity with DDP + DistributedLion (sharded strategies and
NO_SHARD, both use_orig_params), bytes per step, per-rank checkpoints,
errors."""

import os

import pytest
import torch

from harness import run_ranks, values
from test_fsdp import LION, _agg, _digest, _loss, _net, _train_ddp, chunk_limit

CPU = torch.device("cpu")


def _wrap(model, strategy="FULL_SHARD", use_orig_params=False, device=CPU, **kw):
    """Three FSDP instances, as the FSDP2 tests: a, b and the root (head)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    kw = dict(device_id=device, sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=use_orig_params,
              **kw)
    model.a = FSDP(model.a, **kw)
    model.b = FSDP(model.b, **kw)
    return FSDP(model, **kw)


def _params(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _train_fsdp1(rank, steps, accumulate, aggregation, strategy, use_orig_params, momentum_dtype=None, seed=0,
                 model=None):
    import lionbit

    model = model or _wrap(_net(seed), strategy, use_orig_params)
    opt = lionbit.DistributedLion(model.parameters(), **_agg(aggregation), momentum_dtype=momentum_dtype, **LION)
    opt.attach(model)
    for step in range(steps):
        for micro in range(accumulate):
            if micro < accumulate - 1:
                with model.no_sync():
                    _loss(model, rank, step, micro).backward()
            else:
                _loss(model, rank, step, micro).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fsdp1_vs_ddp(rank, world_size, configs, steps):
    out = []
    for strategy, use_orig, accumulate, aggregation, md in configs:
        md = getattr(torch, md) if md else None
        ddp = _train_ddp(rank, steps, accumulate, aggregation, md)
        model, _ = _train_fsdp1(rank, steps, accumulate, aggregation, strategy, use_orig, md)
        full = _params(model)
        init = list(_net().parameters())
        out.append(
            {
                "same": [bool(torch.equal(a, b)) for a, b in zip(ddp, full)],
                "digest": _digest(full),
                "moved": float(sum((a - b).abs().sum() for a, b in zip(full, init))),
            }
        )
    return out


@pytest.mark.parametrize(
    "world_size,configs",
    [
        (2, [("FULL_SHARD", False, 1, "vote", None), ("NO_SHARD", False, 2, "avg", None)]),
        (3, [("SHARD_GRAD_OP", True, 2, "avg", None), ("NO_SHARD", True, 1, "vote", "bfloat16")]),
        (4, [("FULL_SHARD", True, 1, "vote", "bfloat16")]),
        (4, [("FULL_SHARD", False, 1, "l1:4+alternate", None), ("NO_SHARD", False, 1, "l1:4", None)]),
        (3, [("SHARD_GRAD_OP", True, 2, "vote+alternate", None)]),
    ],
)
def test_fsdp1_equals_ddp_bitwise(world_size, configs):
    res = values(run_ranks("test_fsdp1:fsdp1_vs_ddp", world_size, kwargs=dict(configs=configs, steps=12)))
    for i, cfg in enumerate(configs):
        for r in res:
            assert all(r[i]["same"]), (cfg, r[i]["same"])
            assert r[i]["moved"] > 0.1, cfg  # the parameters did change
        assert len({r[i]["digest"] for r in res}) == 1, cfg


def _resumed_with_a_schedule(model, rank, steps=6, reload_after=2):
    """A user's loop: decay / no-decay groups, a StepLR schedule, and after
    step ``reload_after`` torch's own resume of the optimizer in place
    (``opt.load_state_dict(opt.state_dict())``, which makes new group dicts
    that the schedule then sets)."""
    import copy

    import lionbit

    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight")]
    no_decay = [p for n, p in named if not n.endswith("weight")]
    groups = [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    opt = lionbit.DistributedLion(groups, **LION)
    opt.attach(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(steps):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step == reload_after:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return model


def fsdp1_resume_vs_ddp(rank, world_size, strategies):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = [p.detach().clone() for p in _resumed_with_a_schedule(DDP(_net()), rank).module.parameters()]
    out = {}
    for strategy in strategies:  # (one original parameter a flat parameter's segment: a group each)
        full = _params(_resumed_with_a_schedule(_wrap(_net(), strategy, use_orig_params=True), rank))
        out[strategy] = [bool(torch.equal(a, b)) for a, b in zip(ddp, full)]
    return out


def test_fsdp1_follows_the_schedule_after_a_resumed_state_dict():
    """torch's load_state_dict replaces the parameter groups' dicts; FSDP1's
    step must read the new ones (the schedule's lr), as DDP's does."""
    res = values(run_ranks("test_fsdp1:fsdp1_resume_vs_ddp", 2, kwargs={"strategies": ["FULL_SHARD", "NO_SHARD"]}))
    for r in res:
        for strategy, same in r.items():
            assert all(same), (strategy, same)


def fsdp1_bytes(rank, world_size, steps, limit=None):
    import lionbit

    out = {}
    with chunk_limit(limit):
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            model, opt = _train_fsdp1(rank, 1, 1, "vote", strategy, False)
            lionbit.reset_stats()
            for step in range(1, steps + 1):
                _loss(model, rank, step).backward()
                opt.step()
                opt.zero_grad()
            out[strategy] = lionbit.stats()
    return out


@pytest.mark.parametrize("limit", [None, 1])
def test_fsdp1_bytes_per_step_are_the_phase1_figure(limit):
    """The units' shards end to end in one reduce-scatter a step, or (a limit
    below any unit's planes) one a unit."""
    steps, n = 3, 4  # N = 4 pads every unit (429, 238 and 24 elements)
    units = [12 * 33 + 33, 33 * 7 + 7, 7 * 3 + 3]  # a, b, root (head): flat numels
    res = values(run_ranks("test_fsdp1:fsdp1_bytes", n, kwargs=dict(steps=steps, limit=limit)))
    for r in res:
        st = r["FULL_SHARD"]
        shards = [-(-d // n) for d in units]  # FSDP pads each flat parameter to a multiple of N
        calls = [sum(shards)] if limit is None else shards  # each call's shard elements
        assert st["sign_reduce_scatter_calls"] == steps * len(calls)
        assert st["sign_allreduce_calls"] == 0
        payload = sum((n - 1) * 8 * -(-s // 64) for s in calls)
        header = len(calls) * 72 * (n - 1)  # the 72-byte header round
        # zero-free directions: exactly the formula, nothing else
        assert st["bytes_sent"] == steps * (payload + header), (st, shards)
        assert payload <= (n - 1) / n * sum(units) / 8 + len(calls) * (n - 1) * 8
        if limit is not None:
            continue  # (the limit splits NO_SHARD's votes too)
        # NO_SHARD is DDP's path: step() votes every unit's directions in one
        # sign all-reduce (they fit one chunk), about twice the bytes
        st = r["NO_SHARD"]
        assert st["sign_allreduce_calls"] == steps and st["sign_reduce_scatter_calls"] == 0
        assert st["bytes_sent"] > steps * payload


CHECKPOINTS = [("torch.float32", "local_state_dict", False), ("torch.bfloat16", "local_state_dict", False),
               ("torch.float32", "state_dict", True), ("torch.bfloat16", "state_dict", False)]


def fsdp1_checkpoint(rank, world_size, path):
    """Per momentum dtype and way of saving: 10 uninterrupted steps (lr
    changed at step 5) against 6 steps, per-rank files (model
    LOCAL_STATE_DICT + the optimizer's local_state_dict(), or its
    state_dict() as a user saves any optimizer's), a fresh model from another
    seed with another lr loading them, and 4 more steps."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    import lionbit

    def build(md, seed, orig):
        model = _wrap(_net(seed), use_orig_params=orig)
        opt = lionbit.DistributedLion(model.parameters(), momentum_dtype=md, **LION)
        return model, opt.attach(model)

    def train(model, opt, steps):
        for step in steps:
            if step == 5:
                opt.param_groups[0]["lr"] = 0.005
            _loss(model, rank, step).backward()
            opt.step()
            opt.zero_grad()

    def digests(model, opt):
        return {"params": _digest(_params(model)), "momentum": _digest([u.momentum for u in opt.attachment.units])}

    out = {}
    for name, how, orig in CHECKPOINTS:
        md = getattr(torch, name.partition(".")[2])
        where = os.path.join(path, f"{md}-{how}-rank{rank}.pt")
        model, opt = build(md, 0, orig)
        train(model, opt, range(10))
        full = digests(model, opt)

        model, opt = build(md, 0, orig)
        train(model, opt, range(6))
        kind = StateDictType.FULL_STATE_DICT if orig else StateDictType.LOCAL_STATE_DICT  # (LOCAL: FlatParameters)
        with FSDP.state_dict_type(model, kind):
            torch.save({"model": model.state_dict(), "optim": getattr(opt, how)()}, where)

        model, opt = build(md, 1, orig)
        opt.param_groups[0]["lr"] = 0.123
        sd = torch.load(where, weights_only=False)
        with FSDP.state_dict_type(model, kind):
            model.load_state_dict(sd["model"])
        getattr(opt, "load_" + how)(sd["optim"])
        assert opt.param_groups[0]["lr"] == 0.005
        train(model, opt, range(6, 10))
        out[f"{name} {how}"] = {"full": full, "resumed": digests(model, opt)}
    return out


def torch_state_dicts(rank, world_size):
    """What torch's own optimizer-state tools do with an FSDP1 model's
    DistributedLion: opt.state shows each parameter's momentum; FSDP's and
    DCP's state dicts are refused before anything changes (torch's
    get_optimizer_state_dict would first step an optimizer with an empty
    state on zero gradients); a state dict without lionbit's momentum, or
    another rank's, is refused by load_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    import lionbit

    model = _wrap(_net(), use_orig_params=True)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    fresh = [p for p in model.parameters() if "exp_avg" not in opt.state[p]]
    for step in range(2):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    shown = {}
    for unit in opt.attachment.units:
        for off, numel, owner, _ in unit.segments:
            shown[owner] = torch.equal(opt.state[owner]["exp_avg"], unit.momentum[off : off + numel])
    before = _digest([u.momentum for u in opt.attachment.units] + _params(model))
    said = {}
    for what, call in {
        "optim_state_dict": lambda: FSDP.optim_state_dict(model, opt),
        "get_optimizer_state_dict": lambda: get_optimizer_state_dict(model, opt),
    }.items():
        try:
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                call()
            said[what] = "no error"
        except RuntimeError as err:
            said[what] = str(err)
    unchanged = _digest([u.momentum for u in opt.attachment.units] + _params(model)) == before
    sd = opt.state_dict()
    for what, bad in {
        "without momentum": {k: v for k, v in sd.items() if k != "lionbit"},
        "another rank's": {**sd, "lionbit": {**sd["lionbit"], "rank": 1 - rank}},
    }.items():
        try:
            opt.load_state_dict(bad)
            said[what] = "no error"
        except ValueError as err:
            said[what] = str(err)
    return {"fresh": len(fresh), "shown": all(shown.values()) and len(shown) == 6, "said": said,
            "unchanged": unchanged and _digest([u.momentum for u in opt.attachment.units] + _params(model)) == before,
            "steps": opt.steps_taken}


def test_fsdp1_torch_state_dicts_show_momentum_or_refuse():
    for rank, r in enumerate(values(run_ranks("test_fsdp1:torch_state_dicts", 2))):
        assert r["fresh"] == 0  # every parameter's state shows its momentum from attach on
        assert r["shown"]
        assert "called by torch.distributed.fsdp" in r["said"]["optim_state_dict"], r["said"]
        assert "called by torch.distributed.checkpoint" in r["said"]["get_optimizer_state_dict"], r["said"]
        for said in (r["said"]["optim_state_dict"], r["said"]["get_optimizer_state_dict"]):
            assert f"DistributedLion.state_dict (FSDP1) on rank {rank}" in said and "a file a rank" in said
        assert "holds no momentum" in r["said"]["without momentum"]
        assert f"the file holds rank {1 - rank} of 2, this is rank {rank} of 2" in r["said"]["another rank's"]
        assert r["unchanged"] and r["steps"] == 2  # no step on zero gradients, nothing loaded half-way


def nan_in_one_call(rank, world_size, strategies, layer, own_group=False):
    """A user's loop whose step() votes in several calls (one a unit: a small
    chunk limit) and whose step 1 gives rank 1 a NaN gradient in ``layer``
    alone (a backward pre-hook, as a bad kernel would: the layers below
    get NaN gradients too, the layers above none): every rank raises
    naming rank 1 and changes nothing, though the other calls were agreed
    to; training goes on, bitwise equal to DDP's loop with the same NaN.
    ``strategies``: FSDP1's sharding strategy of a, b and the root;
    ``own_group``: the optimizer votes over a group of its own (the
    NO_SHARD call then starts once the sharded calls' bits are in)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit
    from lionbit import step_vote

    torch.set_num_threads(1)

    def nan_hook(module, grad_output):
        return (grad_output[0] * float("nan"),)

    def train(model, opt, inner, params, momenta):
        errors, states = [], []
        for step in range(4):
            hook = None
            if step == 1 and rank == 1:
                hook = getattr(inner, layer).register_full_backward_pre_hook(nan_hook)
            _loss(model, rank, step).backward()
            if hook is not None:
                hook.remove()
            if step == 1:
                before = _digest(params() + momenta())
                try:
                    opt.step()
                except RuntimeError as err:
                    errors.append(str(err))
                states.append(_digest(params() + momenta()) == before)
            else:
                opt.step()
            opt.zero_grad()
        return errors, states, params(), momenta()

    limit = step_vote.CHUNK_ELEMENTS
    step_vote.CHUNK_ELEMENTS = 1  # every unit (every NO_SHARD parameter) a call of its own
    try:
        ddp = DDP(_net())
        dopt = lionbit.DistributedLion(ddp.parameters(), **LION).attach(ddp, overlap=False)
        want = train(ddp, dopt, ddp.module, lambda: [p.detach().clone() for p in ddp.module.parameters()],
                     lambda: [dopt.state[p]["exp_avg"].clone() for p in ddp.module.parameters()])

        net = _net()
        kw = dict(device_id=CPU, use_orig_params=True)
        net.a = FSDP(net.a, sharding_strategy=getattr(ShardingStrategy, strategies[0]), **kw)
        net.b = FSDP(net.b, sharding_strategy=getattr(ShardingStrategy, strategies[1]), **kw)
        model = FSDP(net, sharding_strategy=getattr(ShardingStrategy, strategies[2]), **kw)
        group = torch.distributed.new_group(backend="lionbit") if own_group else None
        opt = lionbit.DistributedLion(model.parameters(), group=group, **LION).attach(model)
        units = opt.attachment.units

        def momenta():
            out = {}
            for unit in units:
                m = unit.momentum_tensor()
                for off, numel, _, fqn in unit.segments:
                    out[fqn] = m[off : off + numel].clone()
            return [out[name].view_as(p) for name, p in ddp.module.named_parameters()]

        inner = model.module
        got = train(model, opt, inner, lambda: _params(model), momenta)
        if group is not None:
            torch.distributed.destroy_process_group(group)
    finally:
        step_vote.CHUNK_ELEMENTS = limit
    return {
        "errors": got[0],
        "unchanged": got[1],
        "ddp_errors": want[0],
        "ddp_unchanged": want[1],
        "params": [bool(torch.equal(a, b)) for a, b in zip(got[2], want[2])],
        "momenta": [bool(torch.equal(a, b)) for a, b in zip(got[3], want[3])],
    }


@pytest.mark.parametrize(
    "strategies,layer,own_group",
    [
        (("FULL_SHARD", "FULL_SHARD", "FULL_SHARD"), "a", False),  # a's call: the step's last
        (("FULL_SHARD", "FULL_SHARD", "FULL_SHARD"), "head", False),  # the root's call: its first
        (("NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP"), "a", False),  # the NO_SHARD vote, after every sharded call
        (("NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP"), "a", True),  # the same over the optimizer's own group
    ],
)
def test_fsdp1_nan_in_one_call_changes_nothing(strategies, layer, own_group):
    res = values(run_ranks("test_fsdp1:nan_in_one_call", 2, kwargs=dict(strategies=strategies, layer=layer,
                                                                         own_group=own_group)))
    for r in res:
        assert len(r["errors"]) == 1 and "non-finite gradient (inf or NaN) on rank(s) [1]" in r["errors"][0], r
        assert "no parameter or momentum changed on any rank" in r["errors"][0], r
        assert r["unchanged"] == [True] and r["ddp_unchanged"] == [True], r
        assert all(r["params"]) and all(r["momenta"]), r


def test_fsdp1_per_rank_checkpoint_resume_is_bitwise(tmp_path):
    n = 2
    res = values(run_ranks("test_fsdp1:fsdp1_checkpoint", n, kwargs=dict(path=str(tmp_path))))
    for name, how, _ in CHECKPOINTS:
        key = f"{name} {how}"
        for r in res:
            assert r[key]["resumed"] == r[key]["full"], key
        assert len({r[key]["resumed"]["momentum"] for r in res}) == n  # each rank's own
        assert len({r[key]["resumed"]["params"] for r in res}) == 1


ERRORS = {
    "hybrid_l1": "argument 'aggregation'='l1' is not supported with hybrid sharding (rank ",
    "hybrid_node_hierarchy": "argument 'hierarchy'='node' does not apply to hybrid sharding (rank ",
    "hybrid_and_not": "uses sharding_strategy=FULL_SHARD and the root does shard hybrid",
    "float16_params": "MixedPrecision(param_dtype=torch.float16) is not supported: float16 gradients need a loss scale",
    "float16_reduction": "MixedPrecision(reduce_dtype=torch.float16) is not supported",
    "missing_param": "is not in this optimizer",
    "missing_orig_param": "'b.weight' is not in this optimizer",
    "ignored_states": "['b.weight', 'b.bias'] are the model's but not managed by FSDP (FSDP's ignored_states",
    "another_models": "2 of this optimizer's parameters are not managed by the FSDP model",
    "nested": "attach the root FullyShardedDataParallel",
    "twice": "already attached",
}


def errors(rank, world_size, cases):
    seen = {}
    for case in cases:
        try:
            _error_case(rank, world_size, case)
            seen[case] = "no error"
        except Exception as err:  # noqa: BLE001 - reported to the test
            seen[case] = f"{type(err).__name__}: {err}"
    return seen


def _error_case(rank, world_size, case):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy

    import lionbit

    def attach(model, params=None, **kw):
        opt = lionbit.DistributedLion(model.parameters() if params is None else params, **kw)
        return opt.attach(model)

    if case.startswith("hybrid"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
        hybrid = dict(device_id=CPU, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        if case == "hybrid_l1":
            attach(FSDP(_net(), **hybrid), aggregation="l1", bits=2)
        elif case == "hybrid_node_hierarchy":
            attach(FSDP(_net(), **hybrid), hierarchy="node")
        else:  # a FULL_SHARD instance inside a hybrid root
            model = _net()
            model.a = FSDP(model.a, device_id=CPU, process_group=mesh.get_group(1))
            attach(FSDP(model, **hybrid))
    elif case == "float16_params":  # (bfloat16 works: test_fsdp_mixed.py)
        attach(FSDP(_net(), device_id=CPU, mixed_precision=MixedPrecision(param_dtype=torch.float16)))
    elif case == "float16_reduction":
        attach(FSDP(_net(), device_id=CPU, mixed_precision=MixedPrecision(reduce_dtype=torch.float16)))
    elif case == "missing_param":
        model = _wrap(_net())
        attach(model, model.a.parameters())
    elif case == "missing_orig_param":
        model = _wrap(_net(), use_orig_params=True)
        attach(model, [p for p in model.parameters() if p is not model.b.module.weight])
    elif case == "ignored_states":
        net = _net()
        attach(FSDP(net, device_id=CPU, use_orig_params=True, ignored_states=[net.b]))
    elif case == "another_models":
        model = _wrap(_net())
        attach(model, [*model.parameters(), *_net().b.parameters()])
    elif case == "nested":
        model = _wrap(_net())
        model(torch.zeros(1, 12))  # lazy init: model.a is no root now
        attach(model.a, model.a.parameters())
    elif case == "twice":
        model = _wrap(_net())
        opt = attach(model)
        opt.attach(model)


def test_fsdp1_errors():
    # (CPUOffload(offload_params=True) is refused too, but FSDP1 cannot build
    # it without a GPU; a non-lionbit group is refused by the code the FSDP2
    # tests cover.)
    res = values(run_ranks("test_fsdp1:errors", 4, kwargs=dict(cases=list(ERRORS)), timeout=150))
    for rank, seen in enumerate(res):
        for case, expect in ERRORS.items():
            assert expect in seen[case], (rank, case, seen[case])
