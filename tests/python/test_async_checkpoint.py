"""torchtitan's checkpoint loop with DistributedLion: ``dcp.async_save`` of a
Stateful app state (``get_state_dict`` / ``set_state_dict``, the optimizer
state flattened) on a gloo group of its own, the save in flight while
training goes on, waited for before the next one; then a restart from
another seed loads it and trains on. On 4 real CPU ranks, under DDP, FSDP2
and HSDP (2 nodes of 2), with Lion Cub's momentum sync every 4 steps; under
FSDP2 also as torchtitan's ``async_with_pinned_mem``: DCP's writer in a
process of its own and the staging itself asynchronous, running beside the
next step's forward and backward, waited for just before ``step()``.

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
    kind = kind.split("/")[0]
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


def _step(rank, net, opt, step, before_step=lambda: None):
    fsdp._loss(net, rank, step).backward()
    before_step()  # torchtitan waits for the last save's staging here
    opt.step()
    opt.zero_grad()


def _digests(model, opt):
    momenta = [opt.state[p]["exp_avg"] for p in model.parameters()]
    return {"params": fsdp._digest(fsdp._full_params(model)), "momentum": fsdp._digest(momenta)}


def async_checkpoints(rank, world_size, path, kinds):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
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

        where = f"{path}/{kind.replace('/', '_')}"
        kw = dict(async_checkpointer_type=AsyncCheckpointerType.THREAD)
        if kind.endswith("/process"):  # torchtitan's async_with_pinned_mem (no pinned memory without a GPU)
            kw = dict(async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=DefaultStager(
                StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)))
        model, net, opt = _build(kind, 0)
        saving = staging = None
        for step in range(STEPS):
            if step == WAIT:
                saving.result()
            _step(rank, net, opt, step, lambda: staging.result() if staging is not None else None)
            if step == SAVE:
                at_save = _digests(model, opt)
                res = dcp.async_save({"app": AppState(model, opt)}, checkpoint_id=where, process_group=group, **kw)
                # the staging runs on while the next step's forward and backward do (async_stager's)
                staged = hasattr(res, "staging_completion")
                saving, staging = (res.upload_completion, res.staging_completion) if staged else (res, None)
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
                            kwargs=dict(path=path, kinds=KINDS)))


KINDS = ["ddp", "fsdp2", "hsdp", "fsdp2/process"]  # /process: DCP writes from a process of its own


@pytest.mark.parametrize("kind", KINDS)
def test_async_save_while_training_then_resume_is_bitwise(runs, kind):
    for r in (run[kind] for run in runs):
        assert r["saved"] == r["never_saved"], "the save in flight changed the training"
        assert r["loaded"] == r["at_save"], "the checkpoint holds another momentum than the step's"
        assert r["resumed"] == r["never_saved"]
        assert r["steps"] == STEPS
    assert len({run[kind]["resumed"]["params"] for run in runs}) == 1
    # each rank's momentum its own (under HSDP its shard of its node's): no rank's kept for all
    assert len({run[kind]["at_save"]["momentum"] for run in runs}) == 4
