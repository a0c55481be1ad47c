"""DistributedLion on HSDP (2 nodes x 2 ranks): what step() does with a
non-finite gradient on one rank (every rank of the mesh raises naming it,
nothing changed anywhere, training goes on), a momentum synchronization
(over the replicate group: the nodes' momenta), and what attach refuses."""

import pytest
import torch

from harness import run_ranks, values
from test_hsdp import LION, L, M, _config, _hsdp_model, _loss


def hsdp_cases(rank, world_size, device_round=False):
    """``device_round``: as where the shard group has no CPU backend (the
    node's round of flags on the parameters' device, after the votes' bits
    are in: step_vote.flags_on_cpu False)."""
    from torch.distributed.device_mesh import init_device_mesh

    import lionbit
    from lionbit import step_vote

    on_cpu = step_vote.flags_on_cpu
    if device_round:
        step_vote.flags_on_cpu = lambda group: False
    try:
        return _hsdp_cases(rank, world_size, lionbit, init_device_mesh)
    finally:
        step_vote.flags_on_cpu = on_cpu


def _hsdp_cases(rank, world_size, lionbit, init_device_mesh):
    mesh = init_device_mesh("cpu", (M, L), mesh_dim_names=("replicate", "shard"))
    out = {}

    # A NaN in one rank's shard of its node's gradient: every rank raises before anything changed.
    model = _hsdp_model(mesh, _config())
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    params = list(model.parameters())

    def state():
        return [p.to_local().clone() for p in params] + [opt.state[p]["exp_avg"].clone() for p in params]

    _loss(model, rank, 0).backward()
    opt.step()
    opt.zero_grad()
    before = state()
    _loss(model, rank, 1).backward()
    if rank == 1:
        model.blocks[0].up.weight.grad.to_local()[0, 0] = float("nan")
    try:
        opt.step()
        out["nan"] = "no error"
    except RuntimeError as err:
        out["nan"] = str(err)
    out["nan_changed_nothing"] = all(torch.equal(a, b) for a, b in zip(before, state()))
    opt.zero_grad()
    _loss(model, rank, 2).backward()
    opt.step()
    out["steps_after"] = opt.steps_taken

    # momentum_sync=1: the nodes' momenta averaged after every step (the replicas of a shard agree)
    model = _hsdp_model(mesh, _config())
    opt = lionbit.DistributedLion(model.parameters(), momentum_sync=1, **LION).attach(model)
    for step in range(2):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    mine = torch.cat([opt.state[p]["exp_avg"].flatten() for p in model.parameters()]).tolist()
    everyone = [None] * world_size  # (the shards differ in size)
    torch.distributed.all_gather_object(everyone, mine)
    out["synced"] = [everyone[s] == everyone[L + s] for s in range(L)]

    # hierarchy= does not apply (the replicate group is the cross-node level); nor does "l1"
    for case, kw in (("hierarchy", dict(hierarchy="node")), ("l1", dict(aggregation="l1"))):
        model = _hsdp_model(mesh, _config())
        try:
            lionbit.DistributedLion(model.parameters(), **kw, **LION).attach(model)
            out[case] = "no error"
        except (ValueError, NotImplementedError) as err:
            out[case] = str(err)
    return out


@pytest.mark.parametrize("device_round", [False, True])
def test_hsdp_nan_momentum_sync_and_refusals(device_round):
    res = values(run_ranks("test_hsdp_errors:hsdp_cases", M * L, kwargs=dict(device_round=device_round),
                           timeout=240))
    for rank, r in enumerate(res):
        assert f"DistributedLion.step on rank {rank}: non-finite gradient (inf or NaN) on rank(s) [1]" in r["nan"], r
        assert "no parameter or momentum changed on any rank" in r["nan"], r
        assert r["nan_changed_nothing"] and r["steps_after"] == 2, r
        assert r["synced"] == [True] * L, r
        assert "argument 'hierarchy'='node' does not apply to HSDP" in r["hierarchy"], r
        assert f"argument 'aggregation'='l1' is not supported on HSDP (rank {rank}, mesh 2x2 (replicate, shard))" \
            in r["l1"], r
