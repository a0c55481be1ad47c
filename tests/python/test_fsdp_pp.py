"""DistributedLion with pipeline parallelism beside FSDP2 (torchtitan's PP) or DDP.

4 ranks on a (pp 2, dp 2) mesh. The model is cut into stages
(torch.distributed.pipelining), each stage ``fully_shard``-ed over
``mesh["dp"]`` and given its own DistributedLion (torchtitan's
OptimizersContainer holds one optimizer per model part), attached to it.
A step is torchtitan's: the schedule runs the micro-batches (FSDP
accumulates them, the last one reduces, the stage divides the gradients
by the number of micro-batches), the gradients are clipped by the norm of
this dp rank's whole model (each stage's norm, summed over pp), and each
optimizer steps. Schedules: GPipe, 1F1B, and interleaved 1F1B with two
model parts a rank. With HSDP (8 ranks: pp 2 x 2 nodes x 2 shards,
``fully_shard`` over ``mesh["replicate", "shard"]``) each node is a
worker: its ranks' mean gradient, each rank's shard of its momentum. With
each stage made data-parallel over ``mesh["dp"]`` as DDP does instead
(DistributedDataParallel, composable ``replicate``, FSDP2's ``replicate``:
torchtitan's DDPs), each rank a worker (below).

The reference runs inside each rank with no lionbit, FSDP or pipelining
in it: the whole model computes this dp rank's gradient micro-batch by
micro-batch with the same kernels on the same values (so the comparison
is bitwise), the workers' gradients are all-gathered, each is clipped by
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

PP, DP, MICRO = 2, 2, 4  # DP: the workers (dp ranks, or HSDP's nodes)
SHARDS = 2  # HSDP: the ranks of a node
WIDTHS = (12, 21, 20, 17, 6)  # 4 layers; 21 and 17 rows do not split evenly over dp: FSDP pads
LION = {"lr": 0.02, "betas": (0.9, 0.99), "weight_decay": 0.1}


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


class _Mesh:
    """The pipeline's mesh and its data-parallel side: FSDP over dp (pp, dp),
    or HSDP over (replicate, shard) of (pp, replicate, shard), a node a worker."""

    def __init__(self, hsdp=False):
        from torch.distributed.device_mesh import init_device_mesh

        self.hsdp = hsdp
        if hsdp:
            self.mesh = init_device_mesh("cpu", (PP, DP, SHARDS), mesh_dim_names=("pp", "replicate", "shard"))
            self.fsdp, workers, self.shard = self.mesh["replicate", "shard"], self.mesh["replicate"], self.mesh["shard"]
            self.data = workers.get_local_rank() * SHARDS + self.shard.get_local_rank()  # this rank's batch
        else:
            self.mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
            self.fsdp = workers = self.mesh["dp"]
            self.data = workers.get_local_rank()
        self.workers, self.worker = workers.get_group(), workers.get_local_rank()  # the ranks that vote, and mine
        self.pp, self.pp_group = self.mesh["pp"].get_local_rank(), self.mesh["pp"].get_group()

    def worker_grads(self, g) -> list:
        """Every worker's gradient: each dp rank's, or (HSDP) each node's mean (a + b) / 2, as FSDP averages."""
        if self.hsdp:
            a, b = _gather(g, self.shard.get_group())
            g = (a + b) / 2
        return _gather(g, self.workers)

    def own(self, t):
        """This rank's part of its worker's momentum: under HSDP FSDP's chunk of dim 0."""
        if not self.hsdp:
            return t
        rows = -(-t.shape[0] // SHARDS)
        k = self.shard.get_local_rank()
        return t[k * rows : (k + 1) * rows]


def _gather(t, group) -> list:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _wrap(part, m, wrap):
    """A model part made data-parallel over dp: ``fully_shard`` on each block and the part (torchtitan's FSDP),
    ``DistributedDataParallel``, torch's composable ``replicate`` (torchtitan's DDP) or FSDP2's ``replicate`` on
    each block and the part (the newest torchtitan's DDP)."""
    if wrap == "ddp":  # (the stage runs DDP's no_sync for all micro-batches but the last)
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(part, process_group=m.workers)
    if wrap == "replicate":
        from torch.distributed._composable.replicate import replicate

        return replicate(part, device_mesh=m.mesh["dp"])
    if wrap == "replicate_with_fsdp":
        from torch.distributed._composable.replicate_with_fsdp import replicate as shard
        mesh = m.mesh["dp"]
    else:
        from torch.distributed.fsdp import fully_shard as shard
        mesh = m.fsdp
    for block in part:
        shard(block, mesh=mesh)
    return shard(part, mesh=mesh)


def _pipeline(m, schedule, seed=0, wrap="fsdp"):
    """This rank's model parts (each made data-parallel over dp by :func:`_wrap`), their stages and the
    schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pp = m.pp
    stages = PP * (2 if schedule == "interleaved" else 1)
    mine = [pp, pp + PP] if schedule == "interleaved" else [pp]
    blocks = _blocks(seed)
    parts, pipe = [], []
    for s in mine:
        # the blocks keep their names in the whole model, as torchtitan's model parts do
        part = torch.nn.Sequential(OrderedDict((f"block{i}", blocks[i]) for i in _stage_blocks(s, stages)))
        part = _wrap(part, m, wrap)
        parts.append(part)
        pipe.append(PipelineStage(part, s, stages, torch.device("cpu"), group=m.pp_group))
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(pipe, n_microbatches=MICRO, loss_fn=_loss_fn)
    else:
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = kind(pipe[0], n_microbatches=MICRO, loss_fn=_loss_fn)
    return parts, mine, stages, sched


def _train_step(m, sched, opts, params, step, clip):
    """torchtitan's train step: the schedule, clipping over pp, every model part's optimizer."""
    x, y = _batch(m.data, step)
    if m.pp == 0:  # the first stage's rank feeds the inputs, the last stage's the targets
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    norm = _clip_grad_norm(params, clip, m.pp_group) if clip else None
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return norm


def pipeline_runs(rank, world_size, schedule, clip, hsdp=False, steps=4, wrap="fsdp", overlap=True):
    import lionbit

    m = _Mesh(hsdp)
    parts, mine, stages, sched = _pipeline(m, schedule, wrap=wrap)
    opts = [lionbit.DistributedLion(part.parameters(), **LION).attach(part, overlap=overlap) for part in parts]
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
    lionbit.reset_stats(m.workers)
    for step in range(steps):
        x, y = _batch(m.data, step)
        norm = _train_step(m, sched, opts, params, step, clip)

        ref_model.zero_grad(set_to_none=True)
        for k in range(MICRO):
            _loss_fn(ref_model(x[2 * k : 2 * k + 2]), y[2 * k : 2 * k + 2]).backward()
        everyone = [m.worker_grads(p.grad / MICRO) for p in every]  # per parameter, every worker's gradient
        if clip:
            own = sum(float(row[m.worker].double().square().sum()) for row in everyone) ** 0.5
            worst = max(worst, abs(float(norm) - own) / own)
            clipped += float(norm) > clip
            norms = _gather(norm.reshape(1), m.workers)
            for w in range(DP):
                coef = torch.clamp(clip / (norms[w][0] + 1e-6), max=1.0)
                everyone = [[g * coef if r == w else g for r, g in enumerate(row)] for row in everyone]
        with torch.no_grad():
            for i, p in enumerate(every):
                dirs = []
                for w in range(DP):
                    mw, g = momentum[w][i], everyone[i][w]
                    dirs.append(torch.sign(torch.add(torch.mul(mw, _f32(b1)), torch.mul(g, _f32(1.0 - b1)))))
                    momentum[w][i] = torch.add(torch.mul(mw, _f32(b2)), torch.mul(g, _f32(1.0 - b2)))
                delta = torch.sign(dirs[0] + dirs[1])
                p.copy_(torch.sub(torch.mul(p, _f32(1.0 - lr * wd)), torch.mul(delta, _f32(lr))))
        for i, (p, want) in enumerate(zip(params, ref_params)):
            got = p.full_tensor() if hasattr(p, "full_tensor") else p
            assert torch.equal(got, want), (
                f"step {step}: stage parameter {i} differs from the reference by {(got - want).abs().max()}")
        ran = [opt.state[p]["exp_avg"] for opt, part in zip(opts, parts) for p in part.parameters()]
        for i, (mine_m, p) in enumerate(zip(ran, ref_params)):
            want = m.own(momentum[m.worker][index[p]])
            assert torch.equal(mine_m, want), f"step {step}: this rank's momentum of stage parameter {i} differs"
    stats = lionbit.stats(m.workers)
    return {"norm_rel_err": worst, "clipped": clipped,
            "calls": stats["sign_reduce_scatter_calls"] + stats["sign_allreduce_calls"]}


CASES = {
    "gpipe": dict(schedule="gpipe", clip=0.0),
    "1f1b, clipping": dict(schedule="1f1b", clip=0.5),
    "interleaved 1f1b, two parts a rank, clipping": dict(schedule="interleaved", clip=0.5),
}


HSDP_CASES = {
    "HSDP, 1f1b, clipping": dict(schedule="1f1b", clip=0.2, hsdp=True),  # a node's mean: a smaller norm
    "HSDP, interleaved 1f1b, two parts a rank": dict(schedule="interleaved", clip=0.0, hsdp=True),
}


# Stages made data-parallel as DDP does, each rank a worker. DistributedDataParallel (the stage runs DDP's no_sync
# for all micro-batches but the last): the schedule divides the gradients by the number of micro-batches after
# backward, so the votes DDP's hook started in backward are dropped and step() votes (attach(part, overlap=False)
# says so from the start); GPipe and interleaved 1F1B stop in torch's own DDP reducer with any backend (torch 2.15:
# "rebuilt parameter indices size is not same as original model parameters size" at the second step's forward), so
# only 1F1B is here. Composable replicate() (torchtitan's DDP; not a DDP instance to the stage, which runs no
# no_sync for it: the first step's votes are dropped the same way) and FSDP2's replicate() (the newest
# torchtitan's, an FSDP module to the stage): every schedule.
DDP_CASES = {
    "DDP, 1f1b": dict(schedule="1f1b", clip=0.0, wrap="ddp"),
    "DDP, 1f1b, clipping, overlap=False": dict(schedule="1f1b", clip=0.5, wrap="ddp", overlap=False),
    "replicate(), gpipe": dict(schedule="gpipe", clip=0.0, wrap="replicate"),
    "replicate(), interleaved 1f1b, clipping": dict(schedule="interleaved", clip=0.5, wrap="replicate"),
    "FSDP2's replicate(), 1f1b, clipping": dict(schedule="1f1b", clip=0.5, wrap="replicate_with_fsdp"),
    "FSDP2's replicate(), interleaved 1f1b": dict(schedule="interleaved", clip=0.0, wrap="replicate_with_fsdp"),
}


def _check(case, runs) -> None:
    for r in runs:
        assert r["norm_rel_err"] < 1e-5 and r["calls"] > 0, r
        assert r["clipped"] > 0 or not case["clip"], r


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_beside_fsdp_equals_the_reference_bitwise(case):
    _check(CASES[case], values(run_ranks("test_fsdp_pp:pipeline_runs", PP * DP, kwargs=CASES[case], timeout=180)))


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_pipeline_beside_ddp_equals_the_reference_bitwise(case):
    _check(DDP_CASES[case], values(run_ranks("test_fsdp_pp:pipeline_runs", PP * DP, kwargs=DDP_CASES[case],
                                             timeout=180)))


@pytest.mark.parametrize("case", list(HSDP_CASES))
def test_pipeline_beside_hsdp_equals_the_reference_bitwise(case):
    """torchtitan's PP x HSDP: 2 stages x 2 nodes x 2 shards (8 ranks)."""
    runs = values(run_ranks("test_fsdp_pp:pipeline_runs", PP * DP * SHARDS, kwargs=HSDP_CASES[case], timeout=180))
    _check(HSDP_CASES[case], runs)


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

    import lionbit

    m = _Mesh()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def build(seed):
        parts, _, _, sched = _pipeline(m, "interleaved", seed)
        opts = [lionbit.DistributedLion(part.parameters(), **LION).attach(part) for part in parts]
        return parts, opts, sched

    def train(parts, opts, sched, steps):
        params = [p for part in parts for p in part.parameters()]
        for step in steps:
            _train_step(m, sched, opts, params, step, clip=0.5)

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
