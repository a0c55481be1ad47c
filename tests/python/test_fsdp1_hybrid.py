"""DistributedLion on FSDP1 hybrid sharding (``HYBRID_SHARD`` and
``_HYBRID_SHARD_ZERO2``), on 4 real CPU ranks as 2 nodes x 2 ranks, written
as the training script a user writes. As under FSDP2's HSDP
(test_hsdp.py), each node is one Distributed Lion worker: lionbit's comm hook
reduce-scatters inside the node (FSDP's sharded gradient is this rank's shard
of its node's mean gradient), each rank keeps its shard of the node's
momentum, and the shard's direction is voted over the inter-node group.

The reference is test_hsdp's independent single-process simulation of
Distributed Lion with M = 2 workers whose gradients are their nodes' mean
gradients (plain torch, not lionbit's code); every run is compared with it
step by step, bitwise. (FSDP1 averages a node of 2 ranks as g_a / 2 + g_b / 2,
the reference as (g_a + g_b) / 2: halving is exact, so both round alike.)"""

import contextlib

import pytest
import torch

from harness import run_ranks, values
from test_hsdp import LION, SCALE, L, M, _loss, _model, _reference

CPU = torch.device("cpu")


def _config(**kw):
    cfg = dict(
        strategy="HYBRID_SHARD",
        groups="process_group",
        use_orig_params=False,
        aggregation="vote",
        tie_break="zero",
        steps=4,
        clip=None,
        accumulate=1,
        mp=None,
        scaler=False,
        overflow=None,
        resume=None,
    )
    cfg.update(kw)
    return cfg


CONFIGS = {
    "HYBRID_SHARD, vote, process_group=(intra, inter), save at step 2 and resume": _config(resume=2),
    "_HYBRID_SHARD_ZERO2, vote+alternate, clip, no_sync accumulation, use_orig_params, device_mesh": _config(
        strategy="_HYBRID_SHARD_ZERO2",
        groups="device_mesh",
        use_orig_params=True,
        tie_break="alternate",
        clip=0.5,
        accumulate=2,
    ),
    "HYBRID_SHARD, avg, GradScaler with an overflow on rank 3": _config(
        aggregation="avg", scaler=True, overflow=[2, 3]
    ),
    "HYBRID_SHARD, MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), device_mesh": _config(
        mp="bfloat16", reduce="float32", groups="device_mesh"
    ),
}


# -- the ranks: the user's training script ---------------------------------------------------------


def _groups():
    """(intra-node group, inter-node group) of this rank: nodes are ranks
    [0, 1] and [2, 3]; a shard's replicas are [0, 2] and [1, 3]."""
    import torch.distributed as dist

    rank = dist.get_rank()
    intra = [dist.new_group([node * L + i for i in range(L)], backend="lionbit") for node in range(M)]
    inter = [dist.new_group([node * L + i for node in range(M)], backend="lionbit") for i in range(L)]
    return intra[rank // L], inter[rank % L]


def _wrap(cfg, groups, mesh):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    kw = dict(
        device_id=CPU,
        sharding_strategy=getattr(ShardingStrategy, cfg["strategy"]),
        use_orig_params=cfg["use_orig_params"],
    )
    kw.update(process_group=groups) if cfg["groups"] == "process_group" else kw.update(device_mesh=mesh)
    if cfg["mp"]:  # computed in bf16, reduced in the node in cfg["reduce"] (the reference rounds the mean to it)
        from torch.distributed.fsdp import MixedPrecision

        kw["mixed_precision"] = MixedPrecision(param_dtype=getattr(torch, cfg["mp"]),
                                               reduce_dtype=getattr(torch, cfg["reduce"]))
    model = _model()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, **kw)
    return FSDP(model, **kw)


def _full(model) -> dict:
    """Every parameter, whole, by its name (as every rank sees it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().flatten().tolist() for n, p in model.named_parameters()
        }


def _train(rank, model, opt, cfg, steps, names, scaler=None):
    traj, norms = [], []
    for step in steps:
        for micro in range(cfg["accumulate"]):
            sync = micro == cfg["accumulate"] - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = _loss(model, rank, step, micro)
                if cfg["overflow"] == [step, rank]:
                    loss = loss * 1e38
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if cfg["clip"]:
            norms.append(float(model.clip_grad_norm_(cfg["clip"])))  # FSDP1's own: the node's norm
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        full = _full(model)
        traj.append([full[n] for n in names])
    return traj, norms


def _run(rank, cfg, groups, mesh, path):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    import lionbit
    from lionbit import torch_internals

    names = [n for n, _ in _model().named_parameters()]

    def fresh():
        model = _wrap(cfg, groups, mesh)
        opt = lionbit.DistributedLion(
            model.parameters(), aggregation=cfg["aggregation"], tie_break=cfg["tie_break"], **LION
        )
        return model, opt.attach(model)

    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if cfg["scaler"] else None
    out = {}
    if cfg["resume"] is None:
        out["traj"], out["norms"] = _train(rank, model, opt, cfg, range(cfg["steps"]), names, scaler)
    else:
        k = cfg["resume"]
        first, _ = _train(rank, model, opt, cfg, range(k), names)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            weights = model.state_dict()
        torch.save({"model": weights, "opt": opt.local_state_dict()}, f"{path}/rank{rank}.pt")
        rest, _ = _train(rank, model, opt, cfg, range(k, cfg["steps"]), names)
        out["traj"], out["norms"] = first + rest, []
        # a new process's resume: a fresh model and optimizer, each rank its own file
        model2, opt2 = fresh()
        saved = torch.load(f"{path}/rank{rank}.pt", weights_only=True)
        with FSDP.state_dict_type(model2, StateDictType.FULL_STATE_DICT):
            model2.load_state_dict(saved["model"])
        opt2.load_local_state_dict(saved["opt"])
        again, _ = _train(rank, model2, opt2, cfg, range(k, cfg["steps"]), names)
        out["resumed_traj"] = again
        out["resumed_momentum"] = {n: m.tolist() for n, m in opt2.local_state_dict()["momentum"].items()}
    sd = opt.local_state_dict()
    out["momentum"] = {n: m.tolist() for n, m in sd["momentum"].items()}
    # the flat layout of each FSDP instance (to place the reference's momentum), and its local shard
    layouts, local = {}, {}
    for unit in opt.attachment.units:
        lay = torch_internals.fsdp1_layout(unit.module)
        layouts[unit.name] = [(numel, padding, fqn) for numel, padding, fqn in lay.spans]
        local[unit.name] = lay.flat_param.detach().flatten().tolist()
    out["layouts"], out["local"] = layouts, local
    out["steps"] = opt.steps_taken
    out["replayed"] = opt.attachment.plan.replayed
    out["plannable"] = lionbit.kernel_choice.list_kernels_allowed("cpu")  # (not with LIONBIT_KERNELS=aten)
    return out


def _nan_and_sync(rank, groups) -> dict:
    """A NaN gradient on rank 1 only, without a GradScaler: step() raises on
    every rank and nothing changes anywhere (a NaN loss, then a NaN in one
    element of rank 1's shard alone); then momentum_sync=1 (the nodes'
    momenta averaged over the inter-node group after every step)."""
    import lionbit

    cfg = _config()
    model = _wrap(cfg, groups, None)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)

    def state():
        return [p.detach().clone() for p in model.parameters()] + [
            m.clone() for m in opt.local_state_dict()["momentum"].values()
        ]

    def step_error():
        """step()'s error, and whether it changed anything."""
        try:
            opt.step()
            said = "no error"
        except RuntimeError as err:
            said = str(err)
        return said, all(torch.equal(a, b) for a, b in zip(before, state()))

    _loss(model, rank, 0).backward()
    opt.step()
    opt.zero_grad()
    before = state()
    loss = _loss(model, rank, 1)
    (loss * float("nan") if rank == 1 else loss).backward()
    out = {}
    out["nan"], out["nan_changed_nothing"] = step_error()
    opt.zero_grad()
    # A NaN in rank 1's shard alone (an in-place edit of its sharded p.grad): only the vote of
    # that shard's replicas (ranks 1 and 3) sees it; node 0's other shard (rank 0's vote with
    # rank 2) is clean, and rank 0 and rank 2 must not change either.
    _loss(model, rank, 2).backward()
    if rank == 1:
        g = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
        g.view(-1)[0] = float("nan")
    out["nan_one_shard"], out["one_shard_changed_nothing"] = step_error()
    opt.zero_grad()

    model = _wrap(cfg, groups, None)
    opt = lionbit.DistributedLion(model.parameters(), momentum_sync=1, **LION).attach(model)
    for step in range(2):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    out["synced"] = [m.tolist() for m in opt.local_state_dict()["momentum"].values()]
    return out


def fsdp1_hybrid_runs(rank, world_size, configs, path):
    from torch.distributed.device_mesh import init_device_mesh

    groups = _groups()
    mesh = init_device_mesh("cpu", (M, L), mesh_dim_names=("replicate", "shard"))
    return [_run(rank, cfg, groups, mesh, path) for cfg in configs] + [_nan_and_sync(rank, groups)]


def hybrid_probe(rank, world_size) -> bool:
    """For test_torch_internals (the comm hook set on hybrid instances, the
    inter-node group): HYBRID_SHARD over world_size nodes of 1 rank (which
    FSDP runs as NO_SHARD, keeping the inter-node group: its own reduction
    would leave each node's gradient to itself). The
    instances hold lionbit's hook and the inter-node group they were given;
    each rank's gradient after backward is its own, not the nodes' mean (FSDP
    ran no all-reduce over the inter-node group); a step keeps the replicas
    equal; detach() gives FSDP its own reduction back."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    import lionbit
    from lionbit import fsdp1, torch_internals as ti

    alone = [dist.new_group([r], backend="lionbit") for r in range(world_size)]
    inter = dist.new_group(list(range(world_size)), backend="lionbit")
    model = FSDP(
        _model(), process_group=(alone[rank], inter), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=CPU
    )
    plain = _model()
    states = ti.fsdp1_states(model)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    hooked = all(ti.fsdp1_comm_hook(s) is fsdp1._fsdp1_hook for s in states)
    groups = all(ti.fsdp1_inter_node_group(s) is inter for s in states)
    _loss(model, rank, 0).backward()
    _loss(plain, rank, 0).backward()
    flat = ti.fsdp1_layout(states[0]).flat_param
    own = torch.equal(flat.grad, torch.cat([p.grad.flatten() for p in plain.parameters()]))
    opt.step()
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat.detach().clone())
    opt.detach()
    restored = all(ti.fsdp1_comm_hook(s) is None for s in states)
    return hooked and groups and own and restored and all(torch.equal(everyone[0], x) for x in everyone)


# -- the test -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp1_hybrid")
    configs = list(CONFIGS.values())
    return values(
        run_ranks(
            "test_fsdp1_hybrid:fsdp1_hybrid_runs", M * L, kwargs=dict(configs=configs, path=str(path)), timeout=240
        )
    )


def _expected_momentum(ref_momentum: dict, layout: list, prefix: str, shard: int, shard_numel: int) -> list:
    """The reference's momentum of one node, laid out as the FSDP instance's
    flat parameter (padding zero), this rank's chunk of it."""
    parts = []
    for numel, padding, fqn in layout:
        parts.append(torch.zeros(numel) if padding else torch.tensor(ref_momentum[prefix + fqn]))
    flat = torch.cat(parts)
    flat = torch.nn.functional.pad(flat, (0, L * shard_numel - flat.numel()))
    return flat[shard * shard_numel : (shard + 1) * shard_numel].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp1_hybrid_equals_the_m_worker_reference_bitwise(runs, name):
    i = list(CONFIGS).index(name)
    cfg = CONFIGS[name]
    per_rank = [r[i] for r in runs]
    # every rank holds the same full parameters after every step (replicas and shards agree)
    assert all(r["traj"] == per_rank[0]["traj"] for r in per_rank)
    run = dict(per_rank[0])
    run["norms"] = [per_rank[node * L]["norms"] for node in range(M)]  # each node's own clipping norm
    ref = _reference(cfg, run)
    names = [n for n, _ in _model().named_parameters()]
    for step, (got, want) in enumerate(zip(run["traj"], ref["steps"])):
        if want == "skipped":
            continue
        for n, a, b in zip(names, got, want):
            assert a == b, f"{name}: step {step}, parameter {n}: {sum(x != y for x, y in zip(a, b))} elements differ"
    # each rank's momentum is its shard of its node's
    for rank, r in enumerate(per_rank):
        node, shard = divmod(rank, L)
        for unit, layout in r["layouts"].items():
            prefix = f"{unit}." if unit else ""
            got = r["momentum"][unit]
            want = _expected_momentum(ref["momentum"][node], layout, prefix, shard, len(got))
            assert got == want, (name, rank, unit)
    assert run["steps"] == ref["applied"] == cfg["steps"] - (1 if cfg["overflow"] else 0)
    # every step but the first replayed its plan (lionbit.fsdp1_plan), where a plan can ("vote", the list kernels)
    plannable = cfg["aggregation"] == "vote" and run["plannable"]
    assert all(r["replayed"] == (run["steps"] - 1 if plannable else 0) for r in per_rank), run["replayed"]
    if cfg["clip"]:
        assert ref["norm_rel_err"] < 1e-5, ref["norm_rel_err"]


def test_fsdp1_hybrid_replicas_bitwise_equal_and_momentum_a_shard(runs):
    d = sum(p.numel() for p in _model().parameters())
    for i in range(len(CONFIGS)):
        per_rank = [r[i] for r in runs]
        for shard in range(L):
            # ranks with the same shard index hold the same local flat parameters and momenta, bitwise
            assert per_rank[shard]["local"] == per_rank[L + shard]["local"]
            assert per_rank[shard]["momentum"] != per_rank[L + shard]["momentum"]  # (each node's own)
        for r in per_rank:
            # a rank's momentum: exactly its FlatParameters' local shards, 1/L of the model (plus FSDP's padding)
            mine = sum(len(m) for m in r["momentum"].values())
            assert mine == sum(len(x) for x in r["local"].values())
            assert d / L <= mine < d / L + len(r["local"]) * L


def test_fsdp1_hybrid_save_and_resume_is_bitwise(runs):
    i = next(i for i, cfg in enumerate(CONFIGS.values()) if cfg["resume"] is not None)
    k = list(CONFIGS.values())[i]["resume"]
    for r in runs:
        assert r[i]["resumed_traj"] == r[i]["traj"][k:]
        assert r[i]["resumed_momentum"] == r[i]["momentum"]


def test_fsdp1_hybrid_nan_changes_nothing_and_momentum_sync(runs):
    extra = [r[-1] for r in runs]
    for rank, r in enumerate(extra):
        # rank 1's NaN is in its node's mean gradient: both shards of node 0 (ranks 0 and 1) are non-finite
        assert f"DistributedLion.step on rank {rank}: non-finite gradient (inf or NaN) on rank(s) [0, 1]" in r["nan"], r
        assert "no parameter or momentum changed on any rank" in r["nan"], r
        assert r["nan_changed_nothing"], rank
        assert f"DistributedLion.step on rank {rank}: non-finite gradient (inf or NaN) on rank(s) [1]" in \
            r["nan_one_shard"], r
        assert r["one_shard_changed_nothing"], rank
    for shard in range(L):  # the replicas of a shard hold the same (averaged) momentum
        assert extra[shard]["synced"] == extra[L + shard]["synced"]
