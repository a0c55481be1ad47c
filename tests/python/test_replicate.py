"""DistributedLion on composable ``replicate()``: the DDP of torchtitan
(``apply_ddp``: ``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=...)``)
and OLMo-core, which builds a DistributedDataParallel inside the module at
its first forward.

The scripts are written as torchtitan's trainer runs a step: the model
replicated over a 1-D device mesh, the optimizer built from
``model.parameters()`` afterwards, gradient clipping by the total norm, an
LR schedule, accumulation (``set_requires_gradient_sync(False)`` on the
micro-batches before the last), checkpoints through
``get_model_state_dict`` / ``get_optimizer_state_dict(...,
flatten_optimizer_state_dict=True)`` and ``dcp``.

The reference is test_optim's ReferenceLion (numpy, every rank's momentum):
each step the ranks' local gradients, as they stand after clipping, are
all-gathered, and the parameters and this rank's momentum after ``step()``
must equal the reference bit for bit. The gathered gradients must differ
between ranks: had ``attach`` left DDP's all-reduce in place, every rank
would see the mean and the vote would still agree with a reference fed it.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_optim import ReferenceLion, _gathered_grads, _groups, _hash, _loss, _model

pytestmark = pytest.mark.kernels

N = 2
F32 = np.float32


def _replicated(seed=0, bucket_cap_mb=0.01, compile=False):
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(seed=seed)
    if compile:  # torchtitan's order: each block compiled, then replicate()
        model.a.compile()
        model.b.compile()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_replicate",))
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb)  # several buckets
    return model


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _refs(model):
    return [
        ReferenceLion(g["params"], N, g["lr"], g.get("betas", (0.9, 0.99)), g.get("weight_decay", 0.0), "vote")
        for g in _groups(model)
    ]


def _follow_schedule(refs, model, opt):
    """The reference takes each group's lr as the schedule left it."""
    for ref, g, now in zip(refs, _groups(model), opt.param_groups):
        ref.lr, ref.decay = F32(now["lr"]), F32(1.0 - now["lr"] * g.get("weight_decay", 0.0))


def _step(model, opt, rank, step, accumulate, clip):
    """One training step as torchtitan's train_step writes it."""
    opt.zero_grad()
    for micro in range(accumulate):
        model.set_requires_gradient_sync(micro == accumulate - 1)
        (_loss(model, rank, step, micro, it=step) / accumulate).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)


def loop(rank, world_size, attach_late, accumulate, clip, overlap, compile=False):
    """Ten steps, each compared bitwise with the reference."""
    import torch._dynamo

    with torch._dynamo.config.patch(optimize_ddp="ddp_optimizer"):  # what torchtitan sets when it compiles
        return _loop(rank, attach_late, accumulate, clip, overlap, compile)


def _loop(rank, attach_late, accumulate, clip, overlap, compile):
    import lionbit

    # torchtitan's buckets when compiled (dynamo's DDP optimizer wants the first bucket the smallest)
    model = _replicated(compile=compile, bucket_cap_mb=100 if compile else 0.01)
    if attach_late:  # a validation pass first: replicate() has built its DDP by then
        with torch.no_grad():
            model(torch.zeros(2, 12))
    opt = lionbit.DistributedLion(_groups(model))
    sched = _schedule(opt)
    opt.attach(model, overlap=overlap)
    refs = _refs(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(trainable)}
    local_differs = False
    for step in range(10):
        _follow_schedule(refs, model, opt)
        _step(model, opt, rank, step, accumulate, clip)
        grads = _gathered_grads(model, N)
        local_differs |= any(not np.array_equal(a, b) for a, b in zip(grads[0], grads[1]))
        for ref, g in zip(refs, _groups(model)):
            ref.step([[grads[r][index[id(p)]] for p in g["params"]] for r in range(N)])
        opt.step()
        sched.step()
        for ref, g in zip(refs, _groups(model)):
            for i, p in enumerate(g["params"]):
                x = p.detach().numpy()
                assert np.array_equal(ref.x[i].view(np.int32), x.view(np.int32)), (
                    f"step {step}: parameter differs from the reference by {np.abs(ref.x[i] - x).max()}")
                m = opt.state[p]["exp_avg"].numpy()
                assert np.array_equal(ref.m[rank][i].view(np.int32), m.view(np.int32)), (
                    f"step {step}: rank {rank}'s momentum differs from the reference")
    assert local_differs, "every rank saw the same gradients: DDP still all-reduces them"
    return _hash(model)


CASES = {
    "attach before the first forward": dict(attach_late=False, accumulate=1, clip=0.0, overlap=True),
    "clipping, accumulation": dict(attach_late=False, accumulate=2, clip=0.5, overlap=True),
    "attach after a validation pass, vote at step()": dict(attach_late=True, accumulate=1, clip=0.5, overlap=False),
    "compiled blocks (torchtitan's order)": dict(attach_late=False, accumulate=1, clip=0.5, overlap=True,
                                                 compile=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replicate_equals_the_reference_bitwise(case):
    hashes = values(run_ranks("test_replicate:loop", N, kwargs=CASES[case], timeout=120))
    assert len(set(hashes)) == 1, "replicas differ"


def bytes_per_step(rank, world_size):
    """The 1-bit figure: what each rank sends a step (after the first, in which
    DDP builds its buckets), on a 400k-parameter model."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh

    import lionbit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 10))
    replicate(model, device_mesh=init_device_mesh("cpu", (world_size,)), bucket_cap_mb=100)  # torchtitan's buckets
    opt = lionbit.DistributedLion(model.parameters(), lr=1e-4).attach(model)
    for step in range(5):
        if step == 1:
            lionbit.reset_stats()
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        torch.nn.functional.cross_entropy(model(torch.randn(16, 256, generator=g)),
                                          torch.randint(0, 10, (16,), generator=g)).backward()
        opt.step()
    return {"d": sum(p.numel() for p in model.parameters()), "sent": lionbit.stats()["bytes_sent"] / 4}


def test_replicate_sends_one_bit_an_element():
    for r in values(run_ranks("test_replicate:bytes_per_step", N)):
        one_bit = 2 * (N - 1) / N * r["d"] / 8
        fp32 = 2 * (N - 1) / N * 4 * r["d"]
        assert one_bit * 0.99 <= r["sent"] <= one_bit * 1.05, r
        assert fp32 / r["sent"] > 30, r


def checkpoint(rank, world_size, path):
    """torchtitan's checkpoint: 6 steps, get_model_state_dict and
    get_optimizer_state_dict (flattened) through dcp.save, a fresh model (another
    seed) and optimizer that load it, 6 more; against 12 uninterrupted steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import lionbit

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def build(seed):
        model = _replicated(seed=seed)
        opt = lionbit.DistributedLion(_groups(model))
        return model, opt.attach(model)

    def train(model, opt, steps):
        for step in steps:
            _step(model, opt, rank, step, 1, 0.5)
            opt.step()

    def state(model, opt):
        return [_hash(model)] + [opt.state[p]["exp_avg"].sum().item() for p in model.parameters() if p in opt.state]

    model, opt = build(0)
    train(model, opt, range(12))
    want = state(model, opt)

    model, opt = build(0)
    train(model, opt, range(6))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)},
             checkpoint_id=path)
    saved = state(model, opt)
    model, opt = build(1)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"], options=options)
    loaded = state(model, opt)
    steps = opt.steps_taken
    train(model, opt, range(6, 12))
    return {"resumed": state(model, opt) == want, "loaded": loaded == saved, "steps": steps, "momentum": saved[1:]}


def test_replicate_checkpoint_resumes_bitwise(tmp_path):
    res = values(run_ranks("test_replicate:checkpoint", N, kwargs={"path": str(tmp_path / "ckpt")}, timeout=120))
    for r in res:
        assert r["loaded"] and r["resumed"] and r["steps"] == 6, r
    assert res[0]["momentum"] != res[1]["momentum"]  # each rank resumed its own momentum


def refusals(rank, world_size):
    """What attach refuses, naming what is wrong; the model trains on after a refusal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lionbit

    said = {}
    model = _replicated()
    opt = lionbit.DistributedLion([p for n, p in model.named_parameters() if not n.startswith("head.")])
    try:
        opt.attach(model)
    except ValueError as err:
        said["missing"] = str(err)
    opt = lionbit.DistributedLion(model.parameters()).attach(model)
    try:
        opt.attach(model)
    except RuntimeError as err:
        said["twice"] = str(err)
    newer = lionbit.DistributedLion(model.parameters()).attach(model)  # takes the model over
    said["another"] = [newer.attachment.kind, opt.attachment.kind]

    from torch.distributed._composable.replicate import replicate

    mixed = _model()
    fully_shard(mixed.a, mesh=init_device_mesh("cpu", (world_size,)))
    replicate(mixed)
    try:
        lionbit.DistributedLion(mixed.parameters()).attach(mixed)
    except NotImplementedError as err:
        said["mixed"] = str(err)
    return said


def test_replicate_refusals_name_the_problem():
    for said in values(run_ranks("test_replicate:refusals", N)):
        assert "head.weight" in said.get("missing", "") and "not in this optimizer" in said["missing"], said
        assert "already attached to this model" in said.get("twice", ""), said
        assert said.get("another") == ["DDP", "a plain module"], said  # the newer one serves the model
        assert "fully_shard-ed parts" in said.get("mixed", ""), said


# -- FSDP2's replicate (torch.distributed._composable.replicate_with_fsdp) ---------------------------------
# The newest torchtitan's DDP: replicate() on each block and then the root, over the dp mesh, FSDP's
# gradient division turned off (its global-token loss). An FSDP2 module whose parameters are Replicate()
# DTensors; each rank is a worker, as under DDP.


def _fsdp_replicated(seed=0):
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(seed=seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_replicate",))
    for block in (model.a, model.b):
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    return model


def fsdp_replicate_like_ddp(rank, world_size, clip, accumulate):
    """The same script under DDP and under FSDP2's replicate(): parameters and this
    rank's momentum bitwise equal after every step (test_optim checks DDP against
    its numpy reference)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    ddp = DDP(_model(), bucket_cap_mb=0.01)
    dopt = lionbit.DistributedLion(_groups(ddp.module)).attach(ddp)
    model = _fsdp_replicated()
    opt = lionbit.DistributedLion(_groups(model)).attach(model)
    lionbit.reset_stats()
    for step in range(6):
        for net, o in ((ddp, dopt), (model, opt)):
            o.zero_grad()
            for micro in range(accumulate):
                last = micro == accumulate - 1
                if net is ddp and not last:
                    with ddp.no_sync():
                        _loss(net, rank, step, micro, it=step).backward()
                    continue
                if net is model:
                    model.set_requires_gradient_sync(last)
                _loss(net, rank, step, micro, it=step).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], clip)
            o.step()
        for (name, a), b in zip(model.named_parameters(), ddp.module.parameters()):
            assert torch.equal(a.full_tensor(), b), f"step {step}: {name} differs from DDP's"
            if b.requires_grad:
                assert torch.equal(opt.state[a]["exp_avg"], dopt.state[b]["exp_avg"]), (
                    f"step {step}: the momentum of {name} differs from DDP's")
    return {"calls": lionbit.stats()["sign_allreduce_calls"], "steps": opt.steps_taken}


FSDP_CASES = {"plain": dict(clip=0.0, accumulate=1), "clipping, accumulation": dict(clip=0.5, accumulate=2)}


@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_fsdp2_replicate_steps_like_ddp_bitwise(case):
    for r in values(run_ranks("test_replicate:fsdp_replicate_like_ddp", N, kwargs=FSDP_CASES[case], timeout=120)):
        assert r["calls"] > 0 and r["steps"] == 6, r


def fsdp_replicate_checkpoint(rank, world_size, path):
    """DCP through get/set_state_dict: 3 + 3 steps against 6, each rank its own momentum."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import lionbit

    def build(seed):
        model = _fsdp_replicated(seed)
        return model, lionbit.DistributedLion(_groups(model)).attach(model)

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            _loss(model, rank, step, 0, it=step).backward()
            opt.step()

    def state(model, opt):
        momenta = [opt.state[p]["exp_avg"].sum().item() for p in model.parameters() if p in opt.state]
        return [_hash_full(model)] + momenta

    model, opt = build(0)
    train(model, opt, range(6))
    want = state(model, opt)
    model, opt = build(0)
    train(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    model, opt = build(1)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    steps = opt.steps_taken
    train(model, opt, range(3, 6))
    got = state(model, opt)
    return {"same": got == want, "steps": steps, "momentum": want[1:]}


def _hash_full(model):
    return _hash(torch.nn.ParameterList([torch.nn.Parameter(p.full_tensor()) for p in model.parameters()]))


def test_fsdp2_replicate_checkpoint_resumes_bitwise(tmp_path):
    res = values(run_ranks("test_replicate:fsdp_replicate_checkpoint", N, kwargs={"path": str(tmp_path / "c")},
                           timeout=120))
    for r in res:
        assert r["same"] and r["steps"] == 3, r
    assert res[0]["momentum"] != res[1]["momentum"]
