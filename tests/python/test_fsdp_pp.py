"""DistributedLion with pipeline parallelism beside FSDP2: torchtitan's PP.

4 ranks on a (pp 2, dp 2) mesh. The model is cut into stages
(torch.distributed.pipelining), each stage ``fully_shard``-ed over
``mesh["dp"]`` and given its own DistributedLion (torchtitan's
OptimizersContainer holds one optimizer per model part), attached to it.
A step is torchtitan's: the schedule runs the micro-batches (FSDP
accumulates them, the last one reduces, the stage divides the gradients
by the number of micro-batches), the gradients are clipped by the norm of
this dp rank's whole model (each stage's norm, summed over pp), and each
optimizer steps. Schedules: GPipe, 1F1B, and interleaved 1F1B with two
model parts a rank.

The reference runs inside each rank with no lionbit, FSDP or pipelining
in it: the whole model computes this dp rank's gradient micro-batch by
micro-batch with the same kernels on the same values (so the comparison
is bitwise), the dp ranks' gradients are all-gathered, each is clipped by
the norm the run computed (checked against the reference's own), and
Distributed Lion with 2 workers runs in plain torch float32. After every
step each rank's stage parameters and momentum must equal it bit for bit.
"""

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values

pytestmark = pytest.mark.kernels

PP, DP, MICRO = 2, 2, 4
WIDTHS = (12, 21, 20, 17, 6)  # 4 layers; 21 and 17 rows do not split evenly over dp: FSDP pads
LION = {"lr": 0.02, "betas": (0.9, 0.99), "weight_decay": 0.1}
CLIP = 0.5


def _blocks(seed=0):
    torch.manual_seed(seed)
    blocks = []
    for i in range(len(WIDTHS) - 1):
        layer = torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1])
        blocks.append(torch.nn.Sequential(layer, torch.nn.Tanh()) if i < len(WIDTHS) - 2 else layer)
    return blocks


def _stage_blocks(stage, stages):
    per = (len(WIDTHS) - 1) // stages
    return list(range(stage * per, (stage + 1) * per))


def _batch(dp, step):
    g = torch.Generator().manual_seed(1000 * step + dp)
    return torch.randn(2 * MICRO, WIDTHS[0], generator=g), torch.randn(2 * MICRO, WIDTHS[-1], generator=g)


def _loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


def _clip_grad_norm(params, max_norm, pp_group):
    """torchtitan's dist_utils.clip_grad_norm_ with a pp mesh: the norm of
    this rank's gradients, squares summed over the pipeline stages."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm = norm ** 2
    dist.all_reduce(norm, group=pp_group)
    norm = norm ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def _pipeline(mesh, schedule, seed=0):
    """This rank's model parts (each fully_shard-ed over dp), their stages and the schedule."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pp = mesh["pp"].get_local_rank()
    stages = PP * (2 if schedule == "interleaved" else 1)
    mine = [pp, pp + PP] if schedule == "interleaved" else [pp]
    blocks = _blocks(seed)
    parts, pipe = [], []
    for s in mine:
        # the blocks keep their names in the whole model, as torchtitan's model parts do
        part = torch.nn.Sequential(OrderedDict((f"block{i}", blocks[i]) for i in _stage_blocks(s, stages)))
        for block in part:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        parts.append(part)
        pipe.append(PipelineStage(part, s, stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(pipe, n_microbatches=MICRO, loss_fn=_loss_fn)
    else:
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = kind(pipe[0], n_microbatches=MICRO, loss_fn=_loss_fn)
    return parts, mine, stages, sched


def _train_step(mesh, sched, opts, params, step, clip):
    """torchtitan's train step: the schedule, clipping over pp, every model part's optimizer."""
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    x, y = _batch(dp, step)
    if pp == 0:  # the first stage's rank feeds the inputs, the last stage's the targets
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    norm = _clip_grad_norm(params, CLIP, mesh["pp"].get_group()) if clip else None
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return norm


def pipeline_runs(rank, world_size, schedule, clip, steps=4):
    from torch.distributed.device_mesh import init_device_mesh

    import lionbit

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"].get_local_rank()
    parts, mine, stages, sched = _pipeline(mesh, schedule)
    opts = [lionbit.DistributedLion(part.parameters(), **LION).attach(part) for part in parts]
    params = [p for part in parts for p in part.parameters()]

    # the reference: the whole model, this rank's blocks picked out of it
    ref_blocks = _blocks()
    ref_model = torch.nn.Sequential(*ref_blocks)
    every = list(ref_model.parameters())  # the reference steps the whole model: the other stages feed this one
    index = {p: i for i, p in enumerate(every)}
    ref_params = [p for s in mine for i in _stage_blocks(s, stages) for p in ref_blocks[i].parameters()]
    momentum = [[torch.zeros_like(p) for p in every] for _ in range(DP)]
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    worst, clipped = 0.0, 0
    lionbit.reset_stats(mesh["dp"].get_group())
    for step in range(steps):
        x, y = _batch(dp, step)
        norm = _train_step(mesh, sched, opts, params, step, clip)

        ref_model.zero_grad(set_to_none=True)
        for m in range(MICRO):
            _loss_fn(ref_model(x[2 * m : 2 * m + 2]), y[2 * m : 2 * m + 2]).backward()
        grads = [p.grad / MICRO for p in every]
        everyone = [[torch.empty_like(g) for _ in range(DP)] for g in grads]
        for parts_of, g in zip(everyone, grads):
            dist.all_gather(parts_of, g, group=mesh["dp"].get_group())
        if clip:
            own = sum(float((p.grad.double() / MICRO).square().sum()) for p in ref_model.parameters()) ** 0.5
            worst = max(worst, abs(float(norm) - own) / own)
            clipped += float(norm) > CLIP
            norms = [torch.empty(1) for _ in range(DP)]
            dist.all_gather(norms, norm.reshape(1), group=mesh["dp"].get_group())
            for w in range(DP):
                coef = torch.clamp(CLIP / (norms[w][0] + 1e-6), max=1.0)
                everyone = [[g * coef if r == w else g for r, g in enumerate(row)] for row in everyone]
        with torch.no_grad():
            for i, p in enumerate(every):
                dirs = []
                for w in range(DP):
                    m, g = momentum[w][i], everyone[i][w]
                    dirs.append(torch.sign(torch.add(torch.mul(m, _f32(b1)), torch.mul(g, _f32(1.0 - b1)))))
                    momentum[w][i] = torch.add(torch.mul(m, _f32(b2)), torch.mul(g, _f32(1.0 - b2)))
                delta = torch.sign(dirs[0] + dirs[1])
                p.copy_(torch.sub(torch.mul(p, _f32(1.0 - lr * wd)), torch.mul(delta, _f32(lr))))
        for i, (p, want) in enumerate(zip(params, ref_params)):
            got = p.full_tensor()
            assert torch.equal(got, want), (
                f"step {step}: stage parameter {i} differs from the reference by {(got - want).abs().max()}")
        ran = [opt.state[p]["exp_avg"] for opt, part in zip(opts, parts) for p in part.parameters()]
        for i, (m, p) in enumerate(zip(ran, ref_params)):
            want = momentum[dp][index[p]]
            assert torch.equal(m, want), f"step {step}: this rank's momentum of stage parameter {i} differs"
    stats = lionbit.stats(mesh["dp"].get_group())
    return {"norm_rel_err": worst, "clipped": clipped, "calls": stats["sign_reduce_scatter_calls"]}


CASES = {
    "gpipe": dict(schedule="gpipe", clip=False),
    "1f1b, clipping": dict(schedule="1f1b", clip=True),
    "interleaved 1f1b, two parts a rank, clipping": dict(schedule="interleaved", clip=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_beside_fsdp_equals_the_reference_bitwise(case):
    for r in values(run_ranks("test_fsdp_pp:pipeline_runs", PP * DP, kwargs=CASES[case], timeout=180)):
        assert r["norm_rel_err"] < 1e-5 and r["calls"] > 0, r
        assert r["clipped"] > 0 or not CASES[case]["clip"], r


def pipeline_checkpoint(rank, world_size, path):
    """torchtitan's checkpoint of model parts: every part's model and
    (flattened) optimizer state dicts merged into one, dcp.save; a fresh
    pipeline (another seed) loads it through every part; 2 + 2 steps must
    equal 4 uninterrupted ones, parameters and momenta bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    import lionbit

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def build(seed):
        parts, _, _, sched = _pipeline(mesh, "interleaved", seed)
        opts = [lionbit.DistributedLion(part.parameters(), **LION).attach(part) for part in parts]
        return parts, opts, sched

    def train(parts, opts, sched, steps):
        params = [p for part in parts for p in part.parameters()]
        for step in steps:
            _train_step(mesh, sched, opts, params, step, clip=True)

    def state_dicts(parts, opts):
        model = {k: v for part in parts for k, v in get_model_state_dict(part).items()}
        optim = {k: v for part, opt in zip(parts, opts)
                 for k, v in get_optimizer_state_dict(part, opt, options=flat).items()}
        return {"model": model, "optimizer": optim}

    def digest(parts, opts):
        out = [p.full_tensor() for part in parts for p in part.parameters()]
        return out + [opt.state[p]["exp_avg"] for part, opt in zip(parts, opts) for p in part.parameters()]

    whole = build(0)
    train(*whole, range(4))
    want = digest(*whole[:2])

    first = build(0)
    train(*first, range(2))
    dcp.save(state_dicts(*first[:2]), checkpoint_id=path)
    parts, opts, sched = build(1)
    sd = state_dicts(parts, opts)
    dcp.load(sd, checkpoint_id=path)
    for part, opt in zip(parts, opts):
        set_model_state_dict(part, sd["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, opt, sd["optimizer"], options=flat)
    steps = [opt.steps_taken for opt in opts]
    train(parts, opts, sched, range(2, 4))
    got = digest(parts, opts)
    return {"steps": steps, "same": [bool(torch.equal(a, b)) for a, b in zip(got, want)]}


def test_pipeline_checkpoint_resumes_bitwise(tmp_path):
    for r in values(run_ranks("test_fsdp_pp:pipeline_checkpoint", PP * DP, kwargs={"path": str(tmp_path / "ckpt")},
                              timeout=180)):
        assert r["steps"] == [2, 2] and all(r["same"]) and len(r["same"]) == 8, r
