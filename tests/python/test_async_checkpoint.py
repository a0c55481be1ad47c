"""torchtitan's checkpoint loop with DistributedLion: ``dcp.async_save`` of a
Stateful app state (``get_state_dict`` / ``set_state_dict``, the optimizer
state flattened) on a gloo group of its own, the save in flight while
training goes on, waited for before the next one; then a restart from
another seed loads it and trains on. On 4 real CPU ranks, under DDP, FSDP2
and HSDP (2 nodes of 2), with Lion Cub's momentum sync every 4 steps.

The run that saved must equal one that never saved, and the restarted run
must equal it too, parameters and each rank's own momentum, bit for bit:
the save's collectives (on their own group, from DCP's thread) never meet
the training's, and the momentum the save holds is the one of the step it
was taken after (DistributedLion changes its state only in ``step()``,
where torchtitan waits for the staging to end)."""

import pytest
import torch.distributed as dist

import test_fsdp as fsdp
from harness import run_ranks, values

STEPS, SAVE, WAIT = 10, 4, 7  # the save after step SAVE, in flight until before step WAIT


def _build(kind, seed):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    model = fsdp._net(seed)
    if kind == "ddp":
        net = DDP(model, bucket_cap_mb=0.001)  # several buckets: the vote overlaps backward
    elif kind == "fsdp2":
        net = model = fsdp._shard(model)
    else:  # HSDP: 2 nodes of 2 ranks
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        net = model = fsdp._shard(model, mesh=mesh)
    opt = lionbit.DistributedLion(model.parameters(), momentum_sync=4, **fsdp.LION)
    return model, net, opt.attach(net)


def _step(rank, net, opt, step):
    fsdp._loss(net, rank, step).backward()
    opt.step()
    opt.zero_grad()


def _digests(model, opt):
    momenta = [opt.state[p]["exp_avg"] for p in model.parameters()]
    return {"params": fsdp._digest(fsdp._full_params(model)), "momentum": fsdp._digest(momenta)}


def async_checkpoints(rank, world_size, path, kinds):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    class AppState(Stateful):  # torchtitan's ModelWrapper and OptimizersContainer in one
        options = StateDictOptions(flatten_optimizer_state_dict=True)

        def __init__(self, model, opt):
            self.model, self.opt = model, opt

        def state_dict(self):
            model_sd, optim_sd = get_state_dict(self.model, self.opt, options=self.options)
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, sd):
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                           options=self.options)

    group = dist.new_group(backend="gloo")  # torchtitan's: the checkpoint's collectives apart from training's
    out = {}
    for kind in kinds:
        model, net, opt = _build(kind, 0)
        for step in range(STEPS):
            _step(rank, net, opt, step)
        never_saved = _digests(model, opt)

        where = f"{path}/{kind}"
        model, net, opt = _build(kind, 0)
        pending = None
        for step in range(STEPS):
            if step == WAIT:
                pending.result()
            _step(rank, net, opt, step)
            if step == SAVE:
                at_save = _digests(model, opt)
                pending = dcp.async_save({"app": AppState(model, opt)}, checkpoint_id=where, process_group=group)
        saved = _digests(model, opt)

        model, net, opt = _build(kind, 1)  # other weights: all must come from the checkpoint
        dcp.load({"app": AppState(model, opt)}, checkpoint_id=where, process_group=group)
        loaded = _digests(model, opt)
        for step in range(SAVE + 1, STEPS):
            _step(rank, net, opt, step)
        out[kind] = {"never_saved": never_saved, "saved": saved, "at_save": at_save, "loaded": loaded,
                     "resumed": _digests(model, opt), "steps": opt.steps_taken}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("async"))
    return values(run_ranks("test_async_checkpoint:async_checkpoints", 4,
                            kwargs=dict(path=path, kinds=["ddp", "fsdp2", "hsdp"])))


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "hsdp"])
def test_async_save_while_training_then_resume_is_bitwise(runs, kind):
    for r in (run[kind] for run in runs):
        assert r["saved"] == r["never_saved"], "the save in flight changed the training"
        assert r["loaded"] == r["at_save"], "the checkpoint holds another momentum than the step's"
        assert r["resumed"] == r["never_saved"]
        assert r["steps"] == STEPS
    assert len({run[kind]["resumed"]["params"] for run in runs}) == 1
    # each rank's momentum its own (under HSDP its shard of its node's): no rank's kept for all
    assert len({run[kind]["at_save"]["momentum"] for run in runs}) == 4
